//! Pack files: the tensor set of a pack in the safetensors format, read and
//! written by Hugging Face's `safetensors` crate (fuzzed upstream), with this
//! module's own checks on top (no repeated header key, only the dtypes a
//! pack uses, and in [`pack_from_tensors`] every pack invariant).
//!
//! File layout: an 8-byte little-endian header size `N`, then `N` bytes of
//! JSON (padded with spaces to a multiple of 8), then the data. The header
//! maps each tensor name to `{"dtype", "shape", "data_offsets": [begin,
//! end]}` (byte offsets into the data, contiguous) and may hold
//! `"__metadata__"`, a map of strings. Data is little-endian, row-major.
//!
//! Files are written atomically: to a temporary file in the same directory,
//! synced, then renamed over the target ([`write_file`], [`StagedFiles`] for
//! several files that appear together or not at all; [`crate::staged`] has
//! the rules: links followed, special files refused, a failed set undone).
//! The bytes depend on the tensors and metadata alone (metadata in key
//! order), so the same pack gives the same file on every run.
//!
//! Pack files ([`pack_tensors`]) hold, for a pack of `L` tokens and `T` loss
//! entries:
//!
//! | tensor | shape | dtype | meaning |
//! |---|---|---|---|
//! | `tokens` | `[L]` | I64 | token ids |
//! | `position_ids` | `[L]` | I64 | depth of the token (its index in its call's sequence) |
//! | `kv_end` | `[L]` | I64 | query `q` sees key `k` iff `k <= q < kv_end[k]` |
//! | `loss_rows` | `[T]` | I64 | row whose logits predict the label |
//! | `loss_labels` | `[T]` | I64 | the sampled token |
//! | `loss_call` | `[T]` | I64 | the call's global index in input order, from 0 across the file |
//! | `loss_offset` | `[T]` | I64 | offset in the call's completion |
//! | `loss_weights` | `[T]` | F32 | loss weight |
//! | `loss_rollout` | `[T]` | I64 | rollout index in input order |
//! | `loss_segment` | `[T]` | I64 | the call's segment in its rollout (0 from the first call, +1 at each junction) |
//! | `loss_logprobs` | `[T]` | F32 | rollout log-probs (only when every entry has one) |
//! | `sdcc_student_rows`, `sdcc_teacher_rows` | `[P]` | I64 | SDCC pairs (trie layout only) |
//! | `loss_reward` | `[T]` | F32 | the input's per-token reward (`"rewards"`), NaN where its rollout has none ([`loss_field_tensors`]) |
//! | `loss_summary` | `[T]` | BOOL | the target's call is marked `"summary": true` ([`loss_field_tensors`]) |
//!
//! and, for the `R` rollouts of the pack ([`rollout_tensors`], in the order
//! of the metadata's `rollout_indices`):
//!
//! | tensor | shape | dtype | meaning |
//! |---|---|---|---|
//! | `rollout_reward` | `[R]` | F32 | the rollout's reward, NaN where it has none |
//! | `rollout_group` | `[R]` | I64 | index of its GRPO group in the metadata's `groups` (a JSON array of names), −1 where it has none |
//! | `rollout_fingerprint` | `[R]` | I64 | [`crate::pack::calls_fingerprint`] of its calls (files of earlier versions lack it) |
//! | `rollout_truncated` | `[R]` | BOOL | the rollout is marked `"truncated": true` (its last value bootstraps) |
//!
//! `loss_reward`, `loss_summary` and `rollout_truncated` are absent from
//! files of earlier versions (which held no per-token rewards, summary
//! marks or truncation); a reader must not take their absence for "none".

use std::collections::BTreeMap;
use std::path::Path;

use crate::pack::{LossEntry, LossFields, Pack, RolloutFields, SdccPair};
pub use crate::staged::StagedFiles;

/// The `format` value in a pack file's metadata.
pub const PACK_FORMAT: &str = "treeattn-pack-v2";

/// The format before `loss_segment` and the rollout tensors: read back as
/// an error that says to re-pack, never as a pack without segments.
pub const PACK_FORMAT_V1: &str = "treeattn-pack-v1";
use crate::{Error, Result};

/// The axis of a pack tensor: which count its length is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// `L`: one per packed token.
    Tokens,
    /// `T`: one per loss entry.
    Targets,
    /// `P`: one per SDCC pair.
    Pairs,
    /// `R`: one per rollout of the pack.
    Rollouts,
}

impl Axis {
    /// `"L"`, `"T"`, `"P"` or `"R"`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tokens => "L",
            Axis::Targets => "T",
            Axis::Pairs => "P",
            Axis::Rollouts => "R",
        }
    }
}

/// One tensor of a pack file (and of a Python `treeattn.Pack`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackTensor {
    /// The tensor's name.
    pub name: &'static str,
    /// Its element type.
    pub dtype: Dtype,
    /// Its one axis.
    pub axis: Axis,
}

const fn spec(name: &'static str, dtype: Dtype, axis: Axis) -> PackTensor {
    PackTensor { name, dtype, axis }
}

/// Every tensor a pack may hold, in the order a pack file writes them: the
/// one statement of the pack schema, which the Python package reads
/// (`treeattn._native.PACK_SCHEMA`) and the writers
/// ([`pack_tensors`], `rollout_tensors`,
/// `loss_field_tensors`) are tested against (`tests/it/pack_balance.rs`).
/// What each holds: the table of this module's docs. Some are absent
/// from some packs: `loss_logprobs` unless every target has a log-prob, the
/// SDCC rows outside the trie layout, `loss_reward`, `loss_summary`,
/// `rollout_fingerprint` and `rollout_truncated` in files of earlier
/// versions.
pub const PACK_SCHEMA: &[PackTensor] = &[
    spec("tokens", Dtype::I64, Axis::Tokens),
    spec("position_ids", Dtype::I64, Axis::Tokens),
    spec("kv_end", Dtype::I64, Axis::Tokens),
    spec("loss_rows", Dtype::I64, Axis::Targets),
    spec("loss_labels", Dtype::I64, Axis::Targets),
    spec("loss_call", Dtype::I64, Axis::Targets),
    spec("loss_offset", Dtype::I64, Axis::Targets),
    spec("loss_weights", Dtype::F32, Axis::Targets),
    spec("loss_rollout", Dtype::I64, Axis::Targets),
    spec("loss_segment", Dtype::I64, Axis::Targets),
    spec("loss_logprobs", Dtype::F32, Axis::Targets),
    spec("sdcc_student_rows", Dtype::I64, Axis::Pairs),
    spec("sdcc_teacher_rows", Dtype::I64, Axis::Pairs),
    spec("rollout_reward", Dtype::F32, Axis::Rollouts),
    spec("rollout_group", Dtype::I64, Axis::Rollouts),
    spec("rollout_fingerprint", Dtype::I64, Axis::Rollouts),
    spec("rollout_truncated", Dtype::Bool, Axis::Rollouts),
    spec("loss_reward", Dtype::F32, Axis::Targets),
    spec("loss_summary", Dtype::Bool, Axis::Targets),
];

/// Element types this crate writes and reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// `I64`.
    I64,
    /// `I32`.
    I32,
    /// `F32`.
    F32,
    /// `F64`.
    F64,
    /// `BOOL`: one byte, 0 or 1.
    Bool,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool => 1,
            Dtype::I32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// The format's name (`"I64"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::Bool => "BOOL",
        }
    }
}

/// A tensor: dtype, shape and little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Little-endian element bytes.
    pub data: Vec<u8>,
}

impl Tensor {
    /// A 1-D int64 tensor.
    pub fn from_i64(values: &[i64]) -> Tensor {
        Tensor {
            dtype: Dtype::I64,
            shape: vec![values.len()],
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// A 1-D float32 tensor.
    pub fn from_f32(values: &[f32]) -> Tensor {
        Tensor {
            dtype: Dtype::F32,
            shape: vec![values.len()],
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// A 1-D bool tensor.
    pub fn from_bool(values: &[bool]) -> Tensor {
        Tensor {
            dtype: Dtype::Bool,
            shape: vec![values.len()],
            data: values.iter().map(|&v| u8::from(v)).collect(),
        }
    }

    /// The values of a BOOL tensor (a byte other than 0 or 1 is an error
    /// naming its index).
    pub fn to_bool(&self) -> Result<Vec<bool>> {
        self.expect(Dtype::Bool)?;
        self.data
            .iter()
            .enumerate()
            .map(|(i, &b)| match b {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(Error::Pack(format!(
                    "BOOL entry {i} is the byte {b}, not 0 or 1"
                ))),
            })
            .collect()
    }

    /// The values of an I64 tensor.
    pub fn to_i64(&self) -> Result<Vec<i64>> {
        self.expect(Dtype::I64)?;
        Ok(self
            .data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("chunk of 8")))
            .collect())
    }

    /// The values of an F32 tensor.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        self.expect(Dtype::F32)?;
        Ok(self
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("chunk of 4")))
            .collect())
    }

    fn expect(&self, d: Dtype) -> Result<()> {
        if self.dtype != d {
            return Err(Error::Shape(format!(
                "tensor has dtype {} where {} was expected",
                self.dtype.name(),
                d.name()
            )));
        }
        Ok(())
    }

    fn numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
    }
}

impl safetensors::View for &Tensor {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            Dtype::I64 => safetensors::Dtype::I64,
            Dtype::I32 => safetensors::Dtype::I32,
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::F64 => safetensors::Dtype::F64,
            Dtype::Bool => safetensors::Dtype::BOOL,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }

    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn st_err(e: safetensors::SafeTensorError) -> Error {
    Error::Pack(format!("safetensors: {e}"))
}

/// Serializes named tensors and string metadata (tensors are laid out by
/// the `safetensors` crate: by dtype alignment, then name; the metadata
/// comes first in the header, in key order): the same arguments give the
/// same bytes.
pub fn serialize(
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut seen = std::collections::HashSet::new();
    for (name, t) in tensors {
        if name == "__metadata__" || !seen.insert(name.as_str()) {
            return Err(Error::Shape(format!(
                "tensor name {name:?} is reserved or repeated"
            )));
        }
        if t.numel().and_then(|n| n.checked_mul(t.dtype.size())) != Some(t.data.len()) {
            return Err(Error::Shape(format!(
                "tensor {name:?}: shape {:?} of {} does not match {} bytes",
                t.shape,
                t.dtype.name(),
                t.data.len()
            )));
        }
    }
    let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), None)
        .map_err(st_err)?;
    Ok(with_metadata(&bytes, metadata))
}

/// `bytes` (a safetensors file without metadata) with `metadata` as the
/// header's first entry, in key order. The `safetensors` crate takes
/// metadata as a `HashMap` and writes it in that map's random order, which
/// gave the same pack a different file on every run.
fn with_metadata(bytes: &[u8], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    if metadata.is_empty() {
        return bytes.to_vec();
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8-byte header size")) as usize;
    let tensors = std::str::from_utf8(&bytes[8..8 + n])
        .expect("the header the crate wrote is UTF-8")
        .trim_end();
    // `{}` or `{"name":{...},...}`: the entries after the brace.
    let rest = &tensors[1..];
    let sep = if rest == "}" { "" } else { "," };
    let meta = serde_json::to_string(metadata).expect("a map of strings");
    let mut head = format!("{{\"__metadata__\":{meta}{sep}{rest}").into_bytes();
    // The data starts 8-aligned, as the format asks.
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + head.len() + bytes.len() - 8 - n);
    out.extend((head.len() as u64).to_le_bytes());
    out.extend(head);
    out.extend(&bytes[8 + n..]);
    out
}

/// A parsed safetensors file.
#[derive(Clone, Debug, PartialEq)]
pub struct SafeTensors {
    /// Tensors by name.
    pub tensors: BTreeMap<String, Tensor>,
    /// The `__metadata__` strings.
    pub metadata: BTreeMap<String, String>,
}

impl SafeTensors {
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::Pack(format!("safetensors: no tensor named {name:?}")))
    }
}

/// Parses a safetensors buffer: the `safetensors` crate checks the header
/// size, the JSON, the offsets (contiguous, covering the data exactly) and
/// the shapes against the byte counts; on top of it a header key may not
/// repeat and only I64, I32, F32, F64 and BOOL tensors are taken.
pub fn deserialize(bytes: &[u8]) -> Result<SafeTensors> {
    let bad = |m: String| Error::Pack(format!("safetensors: {m}"));
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(st_err)?;
    // The crate has validated the header bounds and UTF-8; serde keeps the
    // last of two equal keys, so look for repeats here.
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let head = std::str::from_utf8(&bytes[8..8 + n]).map_err(|e| bad(format!("header: {e}")))?;
    let header =
        crate::rollout::parse_json_strict(head).map_err(|e| bad(format!("header JSON: {e}")))?;
    let mut metadata = BTreeMap::new();
    if let Some(m) = header.get("__metadata__") {
        for (k, x) in m
            .as_object()
            .ok_or_else(|| bad("__metadata__ is not an object".into()))?
        {
            let s = x
                .as_str()
                .ok_or_else(|| bad(format!("metadata {k:?} is not a string")))?;
            metadata.insert(k.clone(), s.to_string());
        }
    }
    let mut tensors = BTreeMap::new();
    for (name, view) in st.iter() {
        let dtype = match view.dtype() {
            safetensors::Dtype::I64 => Dtype::I64,
            safetensors::Dtype::I32 => Dtype::I32,
            safetensors::Dtype::F32 => Dtype::F32,
            safetensors::Dtype::F64 => Dtype::F64,
            safetensors::Dtype::BOOL => Dtype::Bool,
            other => return Err(bad(format!("tensor {name:?}: unsupported dtype {other}"))),
        };
        tensors.insert(
            name.to_string(),
            Tensor {
                dtype,
                shape: view.shape().to_vec(),
                data: view.data().to_vec(),
            },
        );
    }
    Ok(SafeTensors { tensors, metadata })
}

/// Writes a safetensors file atomically (temporary file, then rename).
pub fn write_file(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let bytes = serialize(tensors, metadata)?;
    let mut s = StagedFiles::new();
    s.stage(path, &bytes)?;
    s.commit()
}

/// Reads a safetensors file.
pub fn read_file(path: &Path) -> Result<SafeTensors> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    deserialize(&bytes).map_err(|e| match e {
        Error::Pack(m) => Error::Pack(format!("{}: {m}", path.display())),
        other => other,
    })
}

/// The string metadata of a safetensors file, reading only its header
/// (`None` when the file is not safetensors).
pub fn read_metadata(path: &Path) -> Result<Option<BTreeMap<String, String>>> {
    use std::io::Read;
    let io = |e: std::io::Error| Error::Io(format!("{}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut n = [0u8; 8];
    if f.read_exact(&mut n).is_err() {
        return Ok(None);
    }
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 {
        return Ok(None);
    }
    let mut head = Vec::new();
    f.take(n).read_to_end(&mut head).map_err(io)?;
    let Ok(Ok(v)) = std::str::from_utf8(&head).map(crate::rollout::parse_json_strict) else {
        return Ok(None);
    };
    Ok(v.get("__metadata__").and_then(|m| m.as_object()).map(|m| {
        m.iter()
            .filter_map(|(k, x)| Some((k.clone(), x.as_str()?.to_string())))
            .collect()
    }))
}

/// The tensors of a pack file (see the module docs). `call_base[r]` is the
/// global index of call 0 of rollout `r` (prefix sums of call counts in
/// input order), so `loss_call = call_base[rollout] + call`.
pub fn pack_tensors(
    pack: &Pack,
    sdcc: Option<&[SdccPair]>,
    call_base: &[u64],
) -> Result<Vec<(String, Tensor)>> {
    pack.validate()?;
    if let Some((i, e)) = pack.loss.iter().enumerate().find(|(_, e)| {
        e.weight.is_nan() || e.weight < 0.0 || e.logprob.is_some_and(|l| !l.is_finite() || l > 0.0)
    }) {
        return Err(Error::Pack(format!(
            "loss entry {i}: weight {} / log-prob {:?} cannot be written (weights are non-negative, log-probs finite and at most 0)",
            e.weight, e.logprob
        )));
    }
    if let Some(p) = sdcc.and_then(|ps| {
        ps.iter()
            .find(|p| p.student_row as usize >= pack.len() || p.teacher_row as usize >= pack.len())
    }) {
        return Err(Error::Pack(format!(
            "SDCC pair {p:?} outside the pack of {} rows",
            pack.len()
        )));
    }
    let i64s = |v: &mut dyn Iterator<Item = i64>| Tensor::from_i64(&v.collect::<Vec<_>>());
    let mut global_calls = Vec::with_capacity(pack.loss.len());
    for e in &pack.loss {
        let base = call_base.get(e.rollout as usize).ok_or_else(|| {
            Error::Pack(format!(
                "loss entry of rollout {} but only {} rollouts have call offsets",
                e.rollout,
                call_base.len()
            ))
        })?;
        global_calls.push((base + e.call as u64) as i64);
    }
    let mut t = vec![
        (
            "tokens".to_string(),
            i64s(&mut pack.tokens.iter().map(|&x| x as i64)),
        ),
        (
            "position_ids".to_string(),
            i64s(&mut pack.position_ids.iter().map(|&x| x as i64)),
        ),
        (
            "kv_end".to_string(),
            i64s(&mut pack.kv_end.iter().map(|&x| x as i64)),
        ),
        (
            "loss_rows".to_string(),
            i64s(&mut pack.loss.iter().map(|e| e.row as i64)),
        ),
        (
            "loss_labels".to_string(),
            i64s(&mut pack.loss.iter().map(|e| e.label as i64)),
        ),
        ("loss_call".to_string(), Tensor::from_i64(&global_calls)),
        (
            "loss_offset".to_string(),
            i64s(&mut pack.loss.iter().map(|e| e.offset as i64)),
        ),
        (
            "loss_weights".to_string(),
            Tensor::from_f32(&pack.loss.iter().map(|e| e.weight).collect::<Vec<_>>()),
        ),
        (
            "loss_rollout".to_string(),
            i64s(&mut pack.loss.iter().map(|e| e.rollout as i64)),
        ),
        (
            "loss_segment".to_string(),
            i64s(&mut pack.loss.iter().map(|e| e.segment as i64)),
        ),
    ];
    if !pack.loss.is_empty() && pack.loss.iter().all(|e| e.logprob.is_some()) {
        let lp: Vec<f32> = pack
            .loss
            .iter()
            .map(|e| e.logprob.expect("checked"))
            .collect();
        t.push(("loss_logprobs".to_string(), Tensor::from_f32(&lp)));
    }
    if let Some(pairs) = sdcc {
        t.push((
            "sdcc_student_rows".to_string(),
            i64s(&mut pairs.iter().map(|p| p.student_row as i64)),
        ));
        t.push((
            "sdcc_teacher_rows".to_string(),
            i64s(&mut pairs.iter().map(|p| p.teacher_row as i64)),
        ));
    }
    Ok(t)
}

/// The rollout tensors of a pack file, `rollout_reward`, `rollout_group`,
/// `rollout_fingerprint` and `rollout_truncated` (see the module docs); the
/// group names go into the metadata as `groups`.
pub fn rollout_tensors(fields: &RolloutFields) -> Vec<(String, Tensor)> {
    vec![
        (
            "rollout_reward".to_string(),
            Tensor::from_f32(&fields.reward),
        ),
        ("rollout_group".to_string(), Tensor::from_i64(&fields.group)),
        (
            "rollout_fingerprint".to_string(),
            Tensor::from_i64(&fields.fingerprint),
        ),
        (
            "rollout_truncated".to_string(),
            Tensor::from_bool(&fields.truncated),
        ),
    ]
}

/// The per-target RL tensors of a pack file, `loss_reward` and
/// `loss_summary` (see the module docs), in the order of the pack's loss
/// entries.
pub fn loss_field_tensors(fields: &LossFields) -> Vec<(String, Tensor)> {
    vec![
        ("loss_reward".to_string(), Tensor::from_f32(&fields.reward)),
        (
            "loss_summary".to_string(),
            Tensor::from_bool(&fields.summary),
        ),
    ]
}

/// Reads a pack back from the tensors of [`pack_tensors`]: `call_base` maps
/// global call indices back to (rollout, call) (`call_base[r]` is rollout
/// `r`'s first call; with `call_base[r + 1]` present, calls of rollout `r`
/// must lie below it).
///
/// Every tensor must be 1-D with the pack's dtype (`[L]` or `[T]`, not
/// `[1, L]`); loss weights finite and non-negative; log-probs (present only
/// when every target has one: absent is the missing tensor, never NaN)
/// finite and at most 0; SDCC rows inside the pack and paired; a `format`
/// in the metadata, when present, [`PACK_FORMAT`] (an older format is an
/// error that says to re-pack). The result is then
/// validated as a [`Pack`] (mask, loss rows, order).
pub fn pack_from_tensors(st: &SafeTensors, call_base: &[u64]) -> Result<Pack> {
    if let Some(f) = st.metadata.get("format") {
        if f == PACK_FORMAT_V1 {
            return Err(Error::Pack(format!(
                "written by an older treeattn (format {PACK_FORMAT_V1:?}, without loss_segment and \
                 the rollout tensors): re-pack the rollouts with this version (format {PACK_FORMAT:?})"
            )));
        }
        if f != PACK_FORMAT {
            return Err(Error::Pack(format!(
                "metadata format {f:?}, expected {PACK_FORMAT:?}"
            )));
        }
    }
    let one_d = |name: &str, dtype: Dtype| -> Result<&Tensor> {
        let t = st.get(name)?;
        if t.dtype != dtype {
            return Err(Error::Pack(format!(
                "tensor {name:?} has dtype {}, expected {}",
                t.dtype.name(),
                dtype.name()
            )));
        }
        if t.shape.len() != 1 {
            return Err(Error::Pack(format!(
                "tensor {name:?} has shape {:?}, expected one dimension",
                t.shape
            )));
        }
        Ok(t)
    };
    let u32s = |name: &str| -> Result<Vec<u32>> {
        one_d(name, Dtype::I64)?
            .to_i64()?
            .into_iter()
            .enumerate()
            .map(|(i, x)| {
                u32::try_from(x).map_err(|_| Error::Pack(format!("{name}[{i}] = {x} is not a u32")))
            })
            .collect()
    };
    let (rows, labels, calls, offsets, rollouts, segments) = (
        u32s("loss_rows")?,
        u32s("loss_labels")?,
        one_d("loss_call", Dtype::I64)?.to_i64()?,
        u32s("loss_offset")?,
        u32s("loss_rollout")?,
        u32s("loss_segment")?,
    );
    let weights = one_d("loss_weights", Dtype::F32)?.to_f32()?;
    let logprobs = match st.tensors.get("loss_logprobs") {
        Some(_) => Some(one_d("loss_logprobs", Dtype::F32)?.to_f32()?),
        None => None,
    };
    // The per-target RL tensors (absent in files of earlier versions):
    // rewards finite or NaN (none), summary marks 0 or 1.
    let rewards = match st.tensors.get("loss_reward") {
        Some(_) => Some(one_d("loss_reward", Dtype::F32)?.to_f32()?),
        None => None,
    };
    if let Some((i, x)) = rewards
        .iter()
        .flatten()
        .enumerate()
        .find(|(_, x)| x.is_infinite())
    {
        return Err(Error::Pack(format!(
            "loss_reward[{i}] = {x} is not a reward (finite, or NaN for none)"
        )));
    }
    let summary =
        match st.tensors.get("loss_summary") {
            Some(_) => Some(one_d("loss_summary", Dtype::Bool)?.to_bool().map_err(
                |e| match e {
                    Error::Pack(m) => Error::Pack(format!("loss_summary: {m}")),
                    e => e,
                },
            )?),
            None => None,
        };
    let t = rows.len();
    for (name, n) in [
        ("loss_labels", labels.len()),
        ("loss_call", calls.len()),
        ("loss_offset", offsets.len()),
        ("loss_rollout", rollouts.len()),
        ("loss_segment", segments.len()),
        ("loss_weights", weights.len()),
        ("loss_logprobs", logprobs.as_ref().map_or(t, Vec::len)),
        ("loss_reward", rewards.as_ref().map_or(t, Vec::len)),
        ("loss_summary", summary.as_ref().map_or(t, Vec::len)),
    ] {
        if n != t {
            return Err(Error::Pack(format!(
                "tensor {name:?} has {n} entries, loss_rows has {t}"
            )));
        }
    }
    let mut loss = Vec::with_capacity(t);
    for i in 0..t {
        let r = rollouts[i] as usize;
        let base = *call_base
            .get(r)
            .ok_or_else(|| Error::Pack(format!("loss_rollout[{i}] = {r} has no call offset")))?;
        let end = call_base.get(r + 1).copied().unwrap_or(u64::MAX);
        let call = u64::try_from(calls[i])
            .ok()
            .filter(|&c| c >= base && c < end)
            .map(|c| c - base)
            .and_then(|c| u32::try_from(c).ok())
            .ok_or_else(|| {
                Error::Pack(format!(
                    "loss_call[{i}] = {} is not a call of rollout {r} (calls {base}..{})",
                    calls[i],
                    if end == u64::MAX {
                        "".to_string()
                    } else {
                        end.to_string()
                    }
                ))
            })?;
        if !weights[i].is_finite() || weights[i] < 0.0 {
            return Err(Error::Pack(format!(
                "loss_weights[{i}] = {} is not a finite non-negative weight",
                weights[i]
            )));
        }
        if let Some(lp) = &logprobs {
            if !lp[i].is_finite() || lp[i] > 0.0 {
                return Err(Error::Pack(format!(
                    "loss_logprobs[{i}] = {} is not a log-probability (finite, at most 0)",
                    lp[i]
                )));
            }
        }
        loss.push(LossEntry {
            row: rows[i],
            label: labels[i],
            weight: weights[i],
            rollout: rollouts[i],
            call,
            offset: offsets[i],
            segment: segments[i],
            logprob: logprobs.as_ref().map(|l| l[i]),
        });
    }
    let p = Pack {
        tokens: u32s("tokens")?,
        position_ids: u32s("position_ids")?,
        kv_end: u32s("kv_end")?,
        loss,
    };
    if p.position_ids.len() != p.tokens.len() {
        return Err(Error::Pack(format!(
            "tensor \"position_ids\" has {} entries, tokens has {}",
            p.position_ids.len(),
            p.tokens.len()
        )));
    }
    p.validate()?;
    sdcc_rows_from_tensors(st, p.len())?;
    Ok(p)
}

/// The SDCC pairs of a pack file as (student row, teacher row), checked:
/// both tensors present or both absent, 1-D, equally long, every row inside
/// the pack of `len` tokens. `None` when the file has no SDCC tensors.
pub fn sdcc_rows_from_tensors(st: &SafeTensors, len: usize) -> Result<Option<Vec<(u32, u32)>>> {
    let get = |name: &str| -> Result<Option<Vec<u32>>> {
        let Some(t) = st.tensors.get(name) else {
            return Ok(None);
        };
        if t.dtype != Dtype::I64 || t.shape.len() != 1 {
            return Err(Error::Pack(format!(
                "tensor {name:?} is {} {:?}, expected a 1-D I64 tensor",
                t.dtype.name(),
                t.shape
            )));
        }
        t.to_i64()?
            .into_iter()
            .enumerate()
            .map(|(i, x)| {
                u32::try_from(x)
                    .ok()
                    .filter(|&r| (r as usize) < len)
                    .ok_or_else(|| {
                        Error::Pack(format!(
                            "{name}[{i}] = {x} is outside the pack of {len} rows"
                        ))
                    })
            })
            .collect::<Result<Vec<u32>>>()
            .map(Some)
    };
    match (get("sdcc_student_rows")?, get("sdcc_teacher_rows")?) {
        (None, None) => Ok(None),
        (Some(s), Some(t)) if s.len() == t.len() => Ok(Some(s.into_iter().zip(t).collect())),
        (Some(s), Some(t)) => Err(Error::Pack(format!(
            "{} SDCC student rows but {} teacher rows",
            s.len(),
            t.len()
        ))),
        _ => Err(Error::Pack(
            "only one of sdcc_student_rows and sdcc_teacher_rows is present".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_padded_and_offsets_contiguous() {
        let t = vec![
            ("a".to_string(), Tensor::from_i64(&[1, -2, 3])),
            ("empty".to_string(), Tensor::from_f32(&[])),
            ("b".to_string(), Tensor::from_f32(&[0.5, f32::NEG_INFINITY])),
        ];
        let meta = BTreeMap::from([("layout".to_string(), "trie".to_string())]);
        let bytes = serialize(&t, &meta).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        assert_eq!(bytes.len(), 8 + n + 24 + 8);
        let back = deserialize(&bytes).unwrap();
        assert_eq!(back.metadata, meta);
        assert_eq!(back.get("a").unwrap().to_i64().unwrap(), vec![1, -2, 3]);
        assert_eq!(
            back.get("b").unwrap().to_f32().unwrap(),
            vec![0.5, f32::NEG_INFINITY]
        );
        assert!(back.get("a").unwrap().to_f32().is_err());
    }

    use crate::rollout::{Call, Rollout};
    use crate::tree::Tree;

    /// The worked example's pack, its tensors and call offsets.
    fn golden_tensors() -> (Vec<(String, Tensor)>, Vec<u64>) {
        let r = Rollout::new(
            "g",
            vec![
                Call::new(vec![10, 11, 20], vec![30, 31]),
                Call::new(vec![10, 11, 20, 30, 31, 40], vec![32]),
                Call::new(vec![10, 11, 20, 30, 31, 40, 32, 1], vec![50, 51]),
                Call {
                    context: vec![10, 11, 3, 50, 51, 40, 32],
                    completion: vec![33],
                    logprobs: Some(vec![-0.25]),
                },
            ],
        )
        .unwrap();
        let tree = Tree::build(&[r], false).unwrap();
        let pairs = tree.sdcc_pairs();
        let t = pack_tensors(&tree.trie_pack(), Some(&pairs), &[0, 4]).unwrap();
        (t, vec![0, 4])
    }

    #[test]
    fn an_older_format_and_bad_segments_are_errors() {
        let (t, base) = golden_tensors();
        let v1 = BTreeMap::from([("format".to_string(), PACK_FORMAT_V1.to_string())]);
        let st = deserialize(&serialize(&t, &v1).unwrap()).unwrap();
        let e = pack_from_tensors(&st, &base).unwrap_err().to_string();
        assert!(e.contains("re-pack") && e.contains("loss_segment"), "{e}");
        let v2 = BTreeMap::from([("format".to_string(), PACK_FORMAT.to_string())]);
        let st = deserialize(&serialize(&t, &v2).unwrap()).unwrap();
        let p = pack_from_tensors(&st, &base).unwrap();
        let segs: Vec<u32> = p.loss.iter().map(|e| e.segment).collect();
        assert_eq!(segs, [0, 0, 0, 0, 0, 1]);
        rejects("loss_segment", |t| t.retain(|(n, _)| n != "loss_segment"));
        // A segment that goes back inside a rollout, or changes in a call.
        rejects("segment 0 after segment 1", |t| {
            set(t, "loss_segment", Tensor::from_i64(&[0, 0, 1, 0, 0, 1]))
        });
        rejects("segment 1 after segment 0", |t| {
            set(t, "loss_segment", Tensor::from_i64(&[0, 1, 1, 1, 1, 1]))
        });
    }

    /// Reading the golden tensors after `edit` must fail naming `what`.
    fn rejects(what: &str, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
        let (mut t, base) = golden_tensors();
        edit(&mut t);
        let st = deserialize(&serialize(&t, &BTreeMap::new()).unwrap()).unwrap();
        let e = pack_from_tensors(&st, &base).unwrap_err();
        assert!(e.to_string().contains(what), "{what}: {e}");
    }

    fn set(t: &mut [(String, Tensor)], name: &str, v: Tensor) {
        t.iter_mut().find(|(n, _)| n == name).unwrap().1 = v;
    }

    #[test]
    fn rl_fields_are_written_per_target_and_per_rollout_and_checked() {
        use crate::pack::{batch, Layout};
        let text = concat!(
            r#"{"id":"a","reward":1.5,"truncated":true,"rewards":[[0.25,-1],[2]],"calls":["#,
            r#"{"context":[1,2],"completion":[3,4]},"#,
            r#"{"context":[1,2,3,4,9],"completion":[5],"summary":true}]}"#,
            "\n",
            r#"{"id":"b","calls":[{"context":[1,2],"completion":[7]}]}"#,
        );
        let rs = crate::rollout::parse_jsonl(text).unwrap();
        let b = batch(&rs, usize::MAX, false, Layout::Trie)
            .unwrap()
            .remove(0);
        assert_eq!(b.fields.truncated, [true, false]);
        // Per target, in the pack's loss order: rollout a's three targets
        // carry its rewards and marks; b has no per-token rewards (NaN).
        let mut got: Vec<(u32, u32, u32, String, bool)> = b
            .pack
            .loss
            .iter()
            .zip(b.loss_fields.reward.iter().zip(&b.loss_fields.summary))
            .map(|(e, (r, &s))| (e.rollout, e.call, e.offset, format!("{r}"), s))
            .collect();
        got.sort();
        let want = [
            (0, 0, 0, "0.25".to_string(), false),
            (0, 0, 1, "-1".to_string(), false),
            (0, 1, 0, "2".to_string(), true),
            (1, 0, 0, "NaN".to_string(), false),
        ];
        assert_eq!(got, want);
        // Written and read back bit for bit.
        let mut t = loss_field_tensors(&b.loss_fields);
        t.extend(rollout_tensors(&b.fields));
        let st = deserialize(&serialize(&t, &BTreeMap::new()).unwrap()).unwrap();
        assert_eq!(
            st.get("loss_summary").unwrap().to_bool().unwrap(),
            b.loss_fields.summary
        );
        assert_eq!(
            st.get("rollout_truncated").unwrap().to_bool().unwrap(),
            [true, false]
        );
        let r = st.get("loss_reward").unwrap().to_f32().unwrap();
        assert!(r
            .iter()
            .zip(&b.loss_fields.reward)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
        // The reader checks them where a pack carries them (6 targets).
        let add =
            |t: &mut Vec<(String, Tensor)>, name: &str, v: Tensor| t.push((name.to_string(), v));
        let ok = |t: &mut Vec<(String, Tensor)>| {
            add(
                t,
                "loss_reward",
                Tensor::from_f32(&[0.0, f32::NAN, 1.0, 2.0, -3.0, 0.5]),
            );
            add(
                t,
                "loss_summary",
                Tensor::from_bool(&[false, false, true, false, false, true]),
            );
        };
        let (mut t, base) = golden_tensors();
        ok(&mut t);
        let st = deserialize(&serialize(&t, &BTreeMap::new()).unwrap()).unwrap();
        assert!(pack_from_tensors(&st, &base).is_ok());
        rejects("loss_reward[4] = inf", |t| {
            ok(t);
            set(
                t,
                "loss_reward",
                Tensor::from_f32(&[0.0, 0.0, 0.0, 0.0, f32::INFINITY, 0.0]),
            );
        });
        rejects("loss_reward", |t| {
            ok(t);
            set(t, "loss_reward", Tensor::from_f32(&[0.0; 5]));
        });
        rejects("loss_summary: BOOL entry 3 is the byte 2", |t| {
            ok(t);
            let mut v = Tensor::from_bool(&[false; 6]);
            v.data[3] = 2;
            set(t, "loss_summary", v);
        });
        rejects("\"loss_summary\" has dtype I64, expected BOOL", |t| {
            ok(t);
            set(t, "loss_summary", Tensor::from_i64(&[0; 6]));
        });
    }

    #[test]
    fn the_pack_reader_checks_what_it_reads() {
        let (t, base) = golden_tensors();
        let st = deserialize(&serialize(&t, &BTreeMap::new()).unwrap()).unwrap();
        let p = pack_from_tensors(&st, &base).unwrap();
        assert_eq!(p.len(), 16);
        assert_eq!(sdcc_rows_from_tensors(&st, 16).unwrap().unwrap().len(), 3);
        // A call index past u32 used to wrap to call 0.
        rejects("loss_call[0]", |t| {
            let mut c = t
                .iter()
                .find(|(n, _)| n == "loss_call")
                .unwrap()
                .1
                .to_i64()
                .unwrap();
            c[0] = 1 << 32;
            set(t, "loss_call", Tensor::from_i64(&c));
        });
        // A call of the next rollout, or before the first.
        rejects("loss_call[5]", |t| {
            let mut c = t
                .iter()
                .find(|(n, _)| n == "loss_call")
                .unwrap()
                .1
                .to_i64()
                .unwrap();
            c[5] = 4;
            set(t, "loss_call", Tensor::from_i64(&c));
        });
        rejects("loss_weights[2]", |t| {
            set(
                t,
                "loss_weights",
                Tensor::from_f32(&[1.0, 1.0, -1.0, 1.0, 1.0, 1.0]),
            );
        });
        rejects("loss_logprobs[1]", |t| {
            let lp = [-0.5, f32::NAN, -0.5, -0.5, -0.5, -0.5];
            t.push(("loss_logprobs".into(), Tensor::from_f32(&lp)));
        });
        rejects("loss_logprobs[0]", |t| {
            let lp = [3.0, -0.5, -0.5, -0.5, -0.5, -0.5];
            t.push(("loss_logprobs".into(), Tensor::from_f32(&lp)));
        });
        rejects("sdcc_teacher_rows[1]", |t| {
            set(t, "sdcc_teacher_rows", Tensor::from_i64(&[7, 16, 5]));
        });
        rejects("teacher rows", |t| {
            set(t, "sdcc_teacher_rows", Tensor::from_i64(&[7, 8]));
        });
        rejects("only one of", |t| {
            t.retain(|(n, _)| n != "sdcc_student_rows")
        });
        // [1, L] where [L] is expected.
        rejects("shape [1, 16]", |t| {
            let tok = &mut t.iter_mut().find(|(n, _)| n == "tokens").unwrap().1;
            tok.shape = vec![1, 16];
        });
        rejects("dtype I32", |t| {
            set(
                t,
                "kv_end",
                Tensor {
                    dtype: Dtype::I32,
                    shape: vec![16],
                    data: vec![0; 64],
                },
            );
        });
        rejects("position_ids", |t| {
            set(t, "position_ids", Tensor::from_i64(&[0; 15]))
        });
    }

    #[test]
    fn a_repeated_header_key_is_an_error() {
        // Two entries for "a": serde would keep the last one silently.
        let head = r#"{"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
        let mut head = head.as_bytes().to_vec();
        while !head.len().is_multiple_of(8) {
            head.push(b' ');
        }
        let mut bytes = (head.len() as u64).to_le_bytes().to_vec();
        bytes.extend(&head);
        bytes.extend(7i64.to_le_bytes());
        let e = deserialize(&bytes).unwrap_err();
        assert!(e.to_string().contains("duplicate key"), "{e}");
    }

    #[test]
    fn the_writer_refuses_what_the_reader_would_reject() {
        let tree = Tree::build(
            &[Rollout::new("w", vec![Call::new(vec![1, 2], vec![3])]).unwrap()],
            false,
        )
        .unwrap();
        let mut p = tree.trie_pack();
        p.loss[0].weight = -2.0;
        assert!(pack_tensors(&p, None, &[0]).is_err());
    }

    #[test]
    fn the_same_tensors_give_the_same_bytes() {
        // Every HashMap has its own random order: nine keys in one map
        // came out in a different order almost every time.
        let (t, _) = golden_tensors();
        let meta: BTreeMap<String, String> = (0..9)
            .map(|i| (format!("key{i}"), format!("value {i}")))
            .collect();
        let first = serialize(&t, &meta).unwrap();
        for _ in 0..8 {
            assert_eq!(serialize(&t, &meta).unwrap(), first);
        }
        let n = u64::from_le_bytes(first[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0, "the data stays 8-aligned");
        let head = std::str::from_utf8(&first[8..8 + n]).unwrap();
        let want: String = meta
            .iter()
            .map(|(k, v)| format!("\"{k}\":\"{v}\""))
            .collect::<Vec<_>>()
            .join(",");
        assert!(
            head.starts_with(&format!("{{\"__metadata__\":{{{want}}},")),
            "{head}"
        );
        let back = deserialize(&first).unwrap();
        assert_eq!(back.metadata, meta);
        assert_eq!(back.tensors.len(), t.len());
        // Metadata alone, without tensors, is a valid file too.
        let empty = serialize(&[], &meta).unwrap();
        assert_eq!(deserialize(&empty).unwrap().metadata, meta);
    }

    #[test]
    fn corrupt_files_are_errors() {
        let bytes = serialize(
            &[("a".to_string(), Tensor::from_i64(&[7]))],
            &BTreeMap::new(),
        )
        .unwrap();
        assert!(deserialize(&bytes[..bytes.len() - 1]).is_err()); // truncated data
        assert!(deserialize(&bytes[..4]).is_err());
        let mut extra = bytes.clone();
        extra.push(0); // trailing byte not covered by any tensor
        assert!(deserialize(&extra).is_err());
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(deserialize(&huge).is_err());
        let bad_shape = Tensor {
            dtype: Dtype::I64,
            shape: vec![2],
            data: vec![0; 8],
        };
        assert!(serialize(&[("x".to_string(), bad_shape)], &BTreeMap::new()).is_err());
    }
}
