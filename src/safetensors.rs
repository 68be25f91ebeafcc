//! A small writer and reader for the safetensors format, and the tensor set
//! of a pack.
//!
//! File layout: an 8-byte little-endian header size `N`, then `N` bytes of
//! JSON (padded with spaces to a multiple of 8), then the data. The header
//! maps each tensor name to `{"dtype", "shape", "data_offsets": [begin,
//! end]}` (byte offsets into the data, contiguous, in writing order) and may
//! hold `"__metadata__"`, a map of strings. Data is little-endian, row-major.
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
//! | `loss_logprobs` | `[T]` | F32 | rollout log-probs (only when every entry has one) |
//! | `sdcc_student_rows`, `sdcc_teacher_rows` | `[P]` | I64 | SDCC pairs (trie layout only) |

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::pack::{LossEntry, Pack, SdccPair};
use crate::{Error, Result};

/// Element types this crate writes and reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    I64,
    I32,
    F32,
    F64,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
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
        }
    }

    fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "I64" => Dtype::I64,
            "I32" => Dtype::I32,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            _ => return None,
        })
    }
}

/// A tensor: dtype, shape and little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
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

/// Serializes named tensors (written in the given order) and string metadata.
pub fn serialize(
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), json!(metadata));
    }
    let mut offset = 0usize;
    for (name, t) in tensors {
        if name == "__metadata__" || header.contains_key(name) {
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
        header.insert(
            name.clone(),
            json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [offset, offset + t.data.len()]}),
        );
        offset += t.data.len();
    }
    let mut head = Value::Object(header).to_string().into_bytes();
    while head.len() % 8 != 0 {
        head.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + head.len() + offset);
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    for (_, t) in tensors {
        out.extend_from_slice(&t.data);
    }
    Ok(out)
}

/// A parsed safetensors file.
#[derive(Clone, Debug, PartialEq)]
pub struct SafeTensors {
    pub tensors: BTreeMap<String, Tensor>,
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

/// Parses a safetensors buffer, checking the header and that the data
/// offsets tile the data section exactly.
pub fn deserialize(bytes: &[u8]) -> Result<SafeTensors> {
    let bad = |m: String| Error::Pack(format!("safetensors: {m}"));
    if bytes.len() < 8 {
        return Err(bad(format!(
            "{} bytes is shorter than the 8-byte header size",
            bytes.len()
        )));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    if n > bytes.len() - 8 {
        return Err(bad(format!(
            "header size {n} exceeds the file ({} bytes)",
            bytes.len()
        )));
    }
    let header: Value =
        serde_json::from_slice(&bytes[8..8 + n]).map_err(|e| bad(format!("header JSON: {e}")))?;
    let header = header
        .as_object()
        .ok_or_else(|| bad("header is not a JSON object".into()))?;
    let data = &bytes[8 + n..];
    let mut metadata = BTreeMap::new();
    let mut spans = Vec::new();
    let mut tensors = BTreeMap::new();
    for (name, v) in header {
        if name == "__metadata__" {
            for (k, x) in v
                .as_object()
                .ok_or_else(|| bad("__metadata__ is not an object".into()))?
            {
                let s = x
                    .as_str()
                    .ok_or_else(|| bad(format!("metadata {k:?} is not a string")))?;
                metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        let dtype = v["dtype"].as_str().and_then(Dtype::parse).ok_or_else(|| {
            bad(format!(
                "tensor {name:?}: unsupported or missing dtype {}",
                v["dtype"]
            ))
        })?;
        let shape: Vec<usize> = v["shape"]
            .as_array()
            .ok_or_else(|| bad(format!("tensor {name:?}: missing shape")))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                bad(format!(
                    "tensor {name:?}: shape entries must be non-negative integers"
                ))
            })?;
        let off: Vec<usize> = v["data_offsets"]
            .as_array()
            .filter(|a| a.len() == 2)
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect::<Option<_>>()
            })
            .ok_or_else(|| {
                bad(format!(
                    "tensor {name:?}: data_offsets must be [begin, end]"
                ))
            })?;
        let (b, e) = (off[0], off[1]);
        if b > e || e > data.len() {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{b}, {e}] outside {} data bytes",
                data.len()
            )));
        }
        let t = Tensor {
            dtype,
            shape,
            data: data[b..e].to_vec(),
        };
        if t.numel().and_then(|x| x.checked_mul(dtype.size())) != Some(e - b) {
            return Err(bad(format!(
                "tensor {name:?}: shape {:?} does not match {} bytes",
                t.shape,
                e - b
            )));
        }
        spans.push((b, e, name.clone()));
        tensors.insert(name.clone(), t);
    }
    spans.sort();
    let mut at = 0;
    for (b, e, name) in &spans {
        if *b != at {
            return Err(bad(format!(
                "tensor {name:?} starts at byte {b}, expected {at} (offsets must be contiguous)"
            )));
        }
        at = *e;
    }
    if at != data.len() {
        return Err(bad(format!(
            "tensors cover {at} of {} data bytes",
            data.len()
        )));
    }
    Ok(SafeTensors { tensors, metadata })
}

/// Writes a safetensors file.
pub fn write_file(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let bytes = serialize(tensors, metadata)?;
    std::fs::write(path, bytes).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}

/// Reads a safetensors file.
pub fn read_file(path: &Path) -> Result<SafeTensors> {
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    deserialize(&bytes)
}

/// The tensors of a pack file (see the module docs). `call_base[r]` is the
/// global index of call 0 of rollout `r` (prefix sums of call counts in
/// input order), so `loss_call = call_base[rollout] + call`.
pub fn pack_tensors(
    pack: &Pack,
    sdcc: Option<&[SdccPair]>,
    call_base: &[u64],
) -> Result<Vec<(String, Tensor)>> {
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

/// Reads a pack back from the tensors of [`pack_tensors`]: `call_base` maps
/// global call indices back to (rollout, call). The result is validated.
pub fn pack_from_tensors(st: &SafeTensors, call_base: &[u64]) -> Result<Pack> {
    let u32s = |name: &str| -> Result<Vec<u32>> {
        st.get(name)?
            .to_i64()?
            .into_iter()
            .enumerate()
            .map(|(i, x)| {
                u32::try_from(x).map_err(|_| Error::Pack(format!("{name}[{i}] = {x} is not a u32")))
            })
            .collect()
    };
    let (rows, labels, calls, offsets, rollouts) = (
        u32s("loss_rows")?,
        u32s("loss_labels")?,
        st.get("loss_call")?.to_i64()?,
        u32s("loss_offset")?,
        u32s("loss_rollout")?,
    );
    let weights = st.get("loss_weights")?.to_f32()?;
    let logprobs = match st.tensors.get("loss_logprobs") {
        Some(t) => Some(t.to_f32()?),
        None => None,
    };
    let t = rows.len();
    if [
        labels.len(),
        calls.len(),
        offsets.len(),
        rollouts.len(),
        weights.len(),
    ]
    .iter()
    .any(|&n| n != t)
        || logprobs.as_ref().is_some_and(|l| l.len() != t)
    {
        return Err(Error::Pack("loss tensors have different lengths".into()));
    }
    let mut loss = Vec::with_capacity(t);
    for i in 0..t {
        let r = rollouts[i] as usize;
        let base = *call_base
            .get(r)
            .ok_or_else(|| Error::Pack(format!("loss_rollout[{i}] = {r} has no call offset")))?;
        let call = (calls[i] as u64)
            .checked_sub(base)
            .filter(|_| calls[i] >= 0)
            .ok_or_else(|| {
                Error::Pack(format!(
                    "loss_call[{i}] = {} is before rollout {r}'s first call {base}",
                    calls[i]
                ))
            })?;
        loss.push(LossEntry {
            row: rows[i],
            label: labels[i],
            weight: weights[i],
            rollout: rollouts[i],
            call: call as u32,
            offset: offsets[i],
            logprob: logprobs.as_ref().map(|l| l[i]),
        });
    }
    let p = Pack {
        tokens: u32s("tokens")?,
        position_ids: u32s("position_ids")?,
        kv_end: u32s("kv_end")?,
        loss,
    };
    p.validate()?;
    Ok(p)
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
