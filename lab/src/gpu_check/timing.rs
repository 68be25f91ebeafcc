//! `treeattn gpu-check`, the forward timings and what every timing section
//! records for the anchor.
//!
//! Forward timing: tree packs at the timing length (a compaction fan, a
//! GRPO fan, random trees) against a plain causal run of the same kernel
//! and size, d 128 and 64, GQA 4:1; then, at d 128, random trees with
//! rotary on, with GQA 8:1, and at the long length (65,536 tokens on a GPU)
//! against a causal run of that length. Inputs larger than L2 (rotating
//! input sets); warm-up launches untimed, then all repetitions between one
//! pair of CUDA events (on the emulator its wall clock, marked
//! meaningless): the mean per launch. FLOPs count visible pairs only
//! (4·d per pair per head, DESIGN §7).
//!
//! Every timed row (this file's and bwd.rs's forward + backward rows) is a
//! [`TimingRecord`]; with `--dump DIR`, [`Timings::open`] starts
//! `DIR/timing/` and [`Timings::push`] writes each row's pack and the
//! records so far there as the row finishes (timing.json whole at any
//! moment), so that `scripts/gpu-anchor.py` times
//! PyTorch (FlexAttention, SDPA causal) on the very same packs and shapes
//! and prints them side by side with ours.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::budget::Budget;
use super::dump::DumpTensor;
use super::target::{DevElem, Target};
use super::{warmup, CheckOptions, Report};
use crate::gen::MaskBuilder;
use treeattn::backend::launch::{count_tiles, FwdTraits, KernelElem};
use treeattn::backend::{AttnParams, AttnShape, Rope};
use treeattn::rng::Rng;
use treeattn::Result;

/// The rotary setting of the timing rows that have one (Llama's).
pub(super) const TIMING_ROPE: Rope = Rope {
    base: 10_000.0,
    dims: 128,
};

/// One timed row: what ran, on which pack, and our times.
pub(super) struct TimingRecord {
    /// The row's label (the report's first column).
    pub name: String,
    /// `"forward"` or `"forward+backward"`.
    pub kind: &'static str,
    /// Index into [`Timings::packs`].
    pub pack: usize,
    /// Tokens, heads, head dim.
    pub shape: AttnShape,
    /// Rotary, when the row has it.
    pub rope: Option<Rope>,
    /// Visible (query, key) pairs of the pack, per head.
    pub pairs: u64,
    /// Our milliseconds per call (dQ by atomics for forward + backward).
    pub ours_ms: f64,
    /// Forward + backward with the deterministic dQ.
    pub ours_det_ms: Option<f64>,
    /// Forward + backward with the balanced main launch: (atomic dQ,
    /// deterministic dQ).
    pub ours_balanced_ms: Option<(f64, f64)>,
    /// Our milliseconds per call on a causal pack of the same length and
    /// shape, in the same run.
    pub causal_ms: f64,
}

/// The timing sections' packs and records (see the module docs).
#[derive(Default)]
pub(super) struct Timings {
    /// (name, pack); records point here by index.
    pub packs: Vec<(String, MaskBuilder)>,
    /// Every timed row, in report order.
    pub records: Vec<TimingRecord>,
    /// The causal runs already timed, `(kind, shape, ms)`: the first
    /// (priority) pass's causal rows serve the later pass's same shape.
    pub causal: Vec<(&'static str, AttnShape, f64)>,
    /// The rows the time limit skipped (their report lines).
    pub skipped: Vec<String>,
    /// `--time-limit`: which rows may still start.
    pub budget: Budget,
    /// `DIR/timing/` once opened, whether times are a GPU's, and how many
    /// of `packs` are written there.
    out: Option<(PathBuf, bool, usize)>,
}

impl Timings {
    /// The index of `pack` (named `name` on first use), added on first
    /// use; an equal pack (same kv_end and position ids) shares the index.
    pub fn pack_id(&mut self, name: &str, pack: &MaskBuilder) -> usize {
        if let Some(i) = self
            .packs
            .iter()
            .position(|(_, p)| p.kv_end == pack.kv_end && p.position_ids == pack.position_ids)
        {
            return i;
        }
        self.packs.push((name.to_string(), pack.clone()));
        self.packs.len() - 1
    }

    /// The causal ms of `kind` at `shape` when a pass already timed it.
    pub fn causal_ms(&self, kind: &str, shape: &AttnShape) -> Option<f64> {
        self.causal
            .iter()
            .find(|(k, s, _)| *k == kind && s == shape)
            .map(|c| c.2)
    }

    /// Starts `dir/timing/` (created; refused when it exists and is not an
    /// empty directory: the dump never overwrites) with a `timing.json` of
    /// no record, so that from here on the file is always there and whole.
    pub fn open(&mut self, dir: &Path, real_timing: bool) -> Result<PathBuf> {
        let t = dir.join("timing");
        let used = match std::fs::read_dir(&t) {
            Ok(mut entries) => entries.next().is_some(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(_) => true,
        };
        if used {
            return Err(treeattn::Error::Usage(format!(
                "{}: exists and is not an empty directory (the dump never overwrites)",
                t.display()
            )));
        }
        std::fs::create_dir_all(&t)
            .map_err(|e| treeattn::Error::Io(format!("{}: {e}", t.display())))?;
        self.out = Some((t.clone(), real_timing, 0));
        self.flush(false)?;
        Ok(t)
    }

    /// Appends a timed row; with `timing/` open, rewrites `timing.json`
    /// with it at once (see [`Timings::flush`]).
    pub fn push(&mut self, record: TimingRecord) -> Result<()> {
        self.records.push(record);
        self.flush(false)
    }

    /// Marks `timing.json` complete (every section ran to its end).
    pub fn finish(&mut self) -> Result<()> {
        self.flush(true)
    }

    /// Writes the packs not yet written (one safetensors file each:
    /// `kv_end`, `position_ids`, I64 `[L]`), then `timing.json` (`format`,
    /// `timing` — GPU times or the emulator's wall clock —, `complete`,
    /// `skipped`, `records`), each to a temporary file renamed over its
    /// name, the packs first: at any moment `timing.json` is whole and
    /// every pack it names is there. A run killed mid-way keeps every row
    /// that finished. Without `timing/` open: nothing.
    fn flush(&mut self, complete: bool) -> Result<()> {
        let Some((dir, real_timing, written)) = self.out.clone() else {
            return Ok(());
        };
        let records: Vec<_> = self
            .records
            .iter()
            .map(|r| {
                json!({
                    "name": r.name,
                    "kind": r.kind,
                    "file": format!("pack{:02}.safetensors", r.pack),
                    "pack": self.packs[r.pack].0,
                    "dtype": "bf16",
                    "tokens": r.shape.tokens,
                    "q_heads": r.shape.q_heads,
                    "kv_heads": r.shape.kv_heads,
                    "head_dim": r.shape.head_dim,
                    "rope": r.rope.map(|p| json!({"base": p.base, "dims": p.dims})),
                    "pairs": r.pairs,
                    "ours_ms": r.ours_ms,
                    "ours_det_ms": r.ours_det_ms,
                    "ours_balanced_ms": r.ours_balanced_ms.map(|b| b.0),
                    "ours_balanced_det_ms": r.ours_balanced_ms.map(|b| b.1),
                    "ours_causal_ms": r.causal_ms,
                })
            })
            .collect();
        let head = json!({
            "format": TIMING_FORMAT,
            "timing": if real_timing { "gpu" } else { "emulator wall clock (meaningless for a GPU)" },
            "method": "mean per call of all repetitions between one pair of CUDA events, after warm-up",
            "complete": complete,
            "skipped": self.skipped,
            "records": records,
        });
        let mut staged = treeattn::staged::StagedFiles::new();
        for (i, (_, p)) in self.packs.iter().enumerate().skip(written) {
            let t = [
                ("kv_end", DumpTensor::index(&p.kv_end)),
                ("position_ids", DumpTensor::index(&p.position_ids)),
            ];
            staged.stage(
                &dir.join(format!("pack{i:02}.safetensors")),
                &DumpTensor::serialize(&t)?,
            )?;
        }
        let text = serde_json::to_string_pretty(&head)
            .map_err(|e| treeattn::Error::Io(format!("timing.json: {e}")))?;
        staged.stage(&dir.join("timing.json"), text.as_bytes())?;
        staged.commit()?;
        self.out = Some((dir, real_timing, self.packs.len()));
        Ok(())
    }
}

/// `timing.json`'s `format`.
pub const TIMING_FORMAT: &str = "treeattn-gpu-check-timing-v1";

/// The timing input sets (q, k, v) on the target, and the host copy of the
/// first set.
type TimingInputs<D, T> = (Vec<[<D as Target>::Buf<T>; 3]>, [Vec<T>; 3]);

/// Random input sets (q, k, v) for timing: on a GPU, enough of them that
/// one pass over the sets is several times a 60 MB L2; two on the emulator.
/// Also returns the host copy of the first set (for [`sampled_rows_check`]).
fn timing_inputs<D: Target, T: KernelElem + DevElem>(
    be: &D,
    rng: &mut Rng,
    shape: AttnShape,
) -> Result<TimingInputs<D, T>> {
    let set_bytes = (shape.q_len() + 2 * shape.kv_len()) * 2;
    let sets = if D::REAL_TIMING {
        (240usize << 20).div_ceil(set_bytes).clamp(2, 16)
    } else {
        2
    };
    let mut inputs = Vec::with_capacity(sets);
    let mut first: Option<[Vec<T>; 3]> = None;
    for _ in 0..sets {
        let mut mk = |n: usize| -> Vec<T> {
            (0..n)
                .map(|_| T::from_f32(rng.signed_unit() * 2.0))
                .collect()
        };
        let host = [mk(shape.q_len()), mk(shape.kv_len()), mk(shape.kv_len())];
        inputs.push([be.up(&host[0])?, be.up(&host[1])?, be.up(&host[2])?]);
        first.get_or_insert(host);
    }
    Ok((inputs, first.expect("at least two input sets")))
}

/// Rows of the timing packs checked against a float64 reference.
const SAMPLED_ROWS: usize = 16;

/// The kernel forward on a timing pack (the first input set, no rotary)
/// against a float64 reference computed here on `SAMPLED_ROWS` query rows
/// (every head): the last row, and rows drawn at random. At the timing
/// lengths (16k and 64k tokens on a GPU) the correctness cases' full CPU
/// reference would take minutes; a row's reference is one pass over its
/// visible keys. Returns (relative Frobenius error of O on those rows, max
/// |ΔLSE|, rows); an error beyond `backend::tolerance` is an `Err`, as in
/// the correctness section.
fn sampled_rows_check<D: Target, T: KernelElem + DevElem>(
    be: &D,
    rng: &mut Rng,
    inputs: &[D::Buf<T>; 3],
    host: &[Vec<T>; 3],
    pack: &MaskBuilder,
    shape: AttnShape,
) -> Result<(f64, f64, usize)> {
    let (l, hq, hk, d) = (shape.tokens, shape.q_heads, shape.kv_heads, shape.head_dim);
    let params = AttnParams::new(d);
    let dp = be.pack(pack)?;
    let mut out = be.filled(shape.q_len(), T::from_f32(f32::NAN))?;
    let mut lse = be.filled(hq * l, f32::NAN)?;
    let [q, k, v] = inputs;
    be.forward(q, k, v, shape, &dp, &params, &mut out, &mut lse)?;
    let (o, lse) = (be.down(&out)?, be.down(&lse)?);
    let mut rows: Vec<usize> = (0..SAMPLED_ROWS.min(l) - 1)
        .map(|_| rng.range(0, l - 1))
        .collect();
    rows.push(l - 1);
    rows.sort_unstable();
    rows.dedup();
    let kv_end = &pack.kv_end;
    let wide = |x: &T| x.to_f32() as f64;
    let scale = params.softmax_scale;
    let (mut num, mut den, mut lse_err) = (0.0f64, 0.0f64, 0.0f64);
    for &r in &rows {
        let keys: Vec<usize> = (0..=r).filter(|&c| kv_end[c] as usize > r).collect();
        for h in 0..hq {
            let g = h / (hq / hk);
            let qr = &host[0][(r * hq + h) * d..][..d];
            let s: Vec<f64> = keys
                .iter()
                .map(|&c| {
                    let kc = &host[1][(c * hk + g) * d..][..d];
                    scale
                        * qr.iter()
                            .zip(kc)
                            .map(|(a, b)| wide(a) * wide(b))
                            .sum::<f64>()
                })
                .collect();
            let got_lse = lse[h * l + r] as f64;
            let got = &o[(r * hq + h) * d..][..d];
            if keys.is_empty() {
                if got_lse != f64::NEG_INFINITY || got.iter().any(|x| x.to_f32() != 0.0) {
                    return Err(treeattn::Error::Cuda(format!(
                        "row {r} head {h} sees no key: O must be 0 and LSE -inf, got LSE {got_lse}"
                    )));
                }
                continue;
            }
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = p.iter().sum();
            for (i, x) in got.iter().enumerate() {
                let want = keys
                    .iter()
                    .zip(&p)
                    .map(|(&c, pc)| pc * wide(&host[2][(c * hk + g) * d + i]))
                    .sum::<f64>()
                    / sum;
                let x = x.to_f32() as f64;
                if !x.is_finite() {
                    return Err(treeattn::Error::Cuda(format!(
                        "O[row {r}, head {h}, {i}] = {x}: not written or not finite"
                    )));
                }
                num += (x - want) * (x - want);
                den += want * want;
            }
            lse_err = lse_err.max((got_lse - (m + sum.ln())).abs());
        }
    }
    let o_err = (num / den.max(f64::MIN_POSITIVE)).sqrt();
    let tol = treeattn::backend::tolerance::attention(T::DTYPE);
    if !(o_err <= tol.o_rel && lse_err <= tol.lse_abs) {
        return Err(treeattn::Error::Cuda(format!(
            "L={l}: on {} sampled rows the kernel's O is {o_err:.2e} (relative) and its LSE {lse_err:.2e} (absolute) \
             from the float64 reference, beyond {:.0e} / {:.0e}",
            rows.len(),
            tol.o_rel,
            tol.lse_abs
        )));
    }
    Ok((o_err, lse_err, rows.len()))
}

/// Milliseconds per forward call of one pack: the warm-up launches, then
/// `reps` launches between one pair of events (the mean), rotating over the
/// input sets so that inputs never sit in L2.
fn time_pack<D: Target, T: KernelElem + DevElem>(
    be: &D,
    inputs: &[[D::Buf<T>; 3]],
    pack: &MaskBuilder,
    shape: AttnShape,
    params: &AttnParams,
    reps: usize,
) -> Result<f64> {
    let dp = be.pack(pack)?;
    let sets = inputs.len();
    let mut out = be.filled(shape.q_len(), T::from_f32(0.0))?;
    let mut lse = be.filled(shape.q_heads * shape.tokens, 0.0f32)?;
    let reps = reps.max(1);
    let mut launch = |i: usize| {
        let [q, k, v] = &inputs[i % sets];
        be.forward(q, k, v, shape, &dp, params, &mut out, &mut lse)
    };
    for i in 0..warmup::<D>(5) {
        launch(i)?;
    }
    let ms = be.time_ms(&mut || (0..reps).try_for_each(&mut launch))?;
    Ok(ms / reps as f64)
}

/// The tree packs of the timing sections at `n` tokens: a compaction fan,
/// a GRPO fan, random trees (DESIGN §8's shapes).
pub(super) fn timing_packs(rng: &mut Rng, n: usize) -> Vec<(String, MaskBuilder)> {
    let mut out = Vec::new();
    let mut p = MaskBuilder::new();
    let system = n / 8;
    p.push_fan(system, 4, (n - system) / 4);
    out.push(("compaction: prompt + 4 views".into(), p));
    let mut p = MaskBuilder::new();
    let prompt = n / 16;
    p.push_fan(prompt, 16, (n - prompt) / 16);
    out.push(("grpo: prompt + 16 responses".into(), p));
    out.push(("random trees".into(), random_trees(rng, n)));
    out
}

/// Random trees (edits, 3 levels, subtrees of ~n/16) filling exactly `n`
/// tokens.
pub(super) fn random_trees(rng: &mut Rng, n: usize) -> MaskBuilder {
    let mut p = MaskBuilder::new();
    while p.kv_end.len() < n {
        p.push_tree(rng, 0, (n / 16).max(8), 3, true);
    }
    p.kv_end.truncate(n);
    p.position_ids.truncate(n);
    for (k, e) in p.kv_end.iter_mut().enumerate() {
        *e = (*e).min(n as u32).max(k as u32 + 1);
    }
    p
}

/// One causal pack of `n` tokens.
pub(super) fn causal_pack(n: usize) -> MaskBuilder {
    let mut c = MaskBuilder::new();
    c.push_sequence(n);
    c
}

/// The long length of the timing rows: 65,536 tokens on a GPU, 4x the
/// timing length on the emulator.
pub(super) fn long_tokens(opts: &CheckOptions) -> usize {
    if opts.small {
        4 * opts.timing_tokens.max(256)
    } else {
        65_536
    }
}

/// The packs every timing section times, generated once so that the
/// forward rows, the forward + backward rows and the anchor (through the
/// dump) see the very same packs.
pub(super) struct TimingSet {
    /// The tree packs at the timing length (see [`timing_packs`]).
    pub packs: Vec<(String, MaskBuilder)>,
    /// Random trees at the long length ([`long_tokens`]).
    pub long_trees: MaskBuilder,
    /// The timing length and query heads.
    pub tokens: usize,
    /// Query heads of the timing rows (at least 4).
    pub q_heads: usize,
}

/// One timed row: its label, pack and rotary, and whether it is one of
/// the base rows (the three tree packs at GQA 4:1, d 128 and 64), the rows
/// that also run LogitTree's K+1 passes.
pub(super) struct Row<'p> {
    pub label: String,
    pub pack: &'p MaskBuilder,
    pub rope: Option<Rope>,
    pub base: bool,
    /// Whether the forward section checks the row against a float64
    /// reference on sampled rows (the d 128 rows at the timing heads).
    pub checked: bool,
}

impl TimingSet {
    /// Fresh packs for `opts`' sizes.
    pub fn new(rng: &mut Rng, opts: &CheckOptions) -> TimingSet {
        let tokens = opts.timing_tokens.max(256);
        TimingSet {
            packs: timing_packs(rng, tokens),
            long_trees: random_trees(rng, long_tokens(opts)),
            tokens,
            q_heads: opts.timing_q_heads.max(4),
        }
    }

    /// The rows, grouped by shape (each group shares its inputs and its
    /// causal run): the base rows at d 128 and 64 (GQA 4:1), then at d 128
    /// random trees with rotary, with GQA 8:1, and at the long length.
    pub fn groups(&self) -> Vec<(AttnShape, Vec<Row<'_>>)> {
        let (n, hq) = (self.tokens, self.q_heads);
        let shape = |tokens, q_heads, kv_heads, head_dim| AttnShape {
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            v_head_dim: head_dim,
        };
        let row = |label: String, pack, rope, base| Row {
            label,
            pack,
            rope,
            base,
            checked: false,
        };
        let trees = &self.packs[2].1;
        let mut groups = Vec::new();
        for d in [128usize, 64] {
            let rows: Vec<Row<'_>> = self
                .packs
                .iter()
                .map(|(name, p)| row(format!("{name} {hq}/{}", hq / 4), p, None, true))
                .collect();
            groups.push((shape(n, hq, hq / 4, d), rows));
        }
        groups[0].1.push(row(
            format!("random trees {hq}/{} rotary", hq / 4),
            trees,
            Some(TIMING_ROPE),
            false,
        ));
        for r in &mut groups[0].1 {
            r.checked = true;
        }
        let hq8 = hq.max(8);
        groups.push((
            shape(n, hq8, hq8 / 8, 128),
            vec![row(
                format!("random trees {hq8}/{} (gqa 8:1)", hq8 / 8),
                trees,
                None,
                false,
            )],
        ));
        let long = self.long_trees.kv_end.len();
        groups.push((
            shape(long, hq, hq / 4, 128),
            vec![row(
                format!("random trees {hq}/{} L={long}", hq / 4),
                &self.long_trees,
                None,
                false,
            )],
        ));
        groups[2].1[0].checked = hq8 == hq;
        groups[3].1[0].checked = true;
        groups
    }

    /// The rows in the order they are timed (issue 39): first the GRPO
    /// pack at d 128 against causal (the rows that matter most, so that a
    /// run cut short has them), then every other row of [`Self::groups`].
    /// The two passes share the d 128 shape; its causal run is timed once
    /// ([`Timings::causal_ms`]).
    pub fn passes(&self) -> [Vec<(AttnShape, Vec<Row<'_>>)>; 2] {
        let mut rest = self.groups();
        let grpo = &self.packs[1].1;
        let (first, others): (Vec<Row<'_>>, Vec<Row<'_>>) = std::mem::take(&mut rest[0].1)
            .into_iter()
            .partition(|r| std::ptr::eq(r.pack, grpo) && r.rope.is_none());
        rest[0].1 = others;
        [vec![(rest[0].0, first)], rest]
    }
}

/// The forward timing section on `groups` (a pass of [`TimingSet::passes`])
/// with `reps` timed launches per row: its table into `rep`, its rows into
/// `tm` (each written out as it finishes). A row that the time limit does
/// not admit is skipped with a line; a group whose causal run is not
/// admitted is skipped whole.
pub(super) fn forward<D: Target>(
    be: &D,
    rng: &mut Rng,
    reps: usize,
    rep: &mut Report<'_>,
    tm: &mut Timings,
    groups: &[(AttnShape, Vec<Row<'_>>)],
) -> Result<()> {
    let tiles = FwdTraits::for_head_dim(128)?;
    let how = if D::REAL_TIMING {
        format!(
            "mean of {reps} launches between one pair of CUDA events after 5 warm-up, rotating input sets > L2"
        )
    } else {
        format!(
            "EMULATOR WALL CLOCK, meaningless for a GPU (mean of {reps} after 1 warm-up; the layout of the GPU table)"
        )
    };
    let _ = writeln!(
        rep,
        "\nforward timing: {how}; FLOPs = 4·d·heads per visible pair; tiles {}x{} (skip%: never loaded, full%: no \
         mask); causal ms: ours on a causal pack of the same L and heads",
        tiles.block_m, tiles.block_n
    );
    let _ = writeln!(
        rep,
        "{:<34} {:>4} {:>6} {:>8} {:>6} {:>6} {:>8} {:>8} {:>9} {:>8}",
        "pack (bf16)",
        "d",
        "L",
        "pairs M",
        "skip%",
        "full%",
        "ms",
        "TFLOP/s",
        "causal ms",
        "pair/caus"
    );
    for (sh, rows) in groups {
        let traits = FwdTraits::for_head_dim(sh.head_dim)?;
        let started = std::time::Instant::now();
        let causal = causal_pack(sh.tokens);
        let causal_name = format!("causal {}/{}", sh.q_heads, sh.kv_heads);
        if tm.causal_ms("forward", sh).is_none() {
            if let Err(line) = tm.budget.admit(&format!(
                "forward {causal_name} d{} and its group",
                sh.head_dim
            )) {
                let _ = writeln!(rep, "{line}");
                tm.skipped.push(line);
                continue;
            }
        }
        let (inputs, host) = timing_inputs::<D, half::bf16>(be, rng, *sh)?;
        let plain = AttnParams::new(sh.head_dim);
        let causal_pairs = causal.mask()?.visible_pairs();
        let line = |tm: &mut Timings,
                    rep: &mut Report<'_>,
                    name: &str,
                    pack: &MaskBuilder,
                    rope: Option<Rope>,
                    ms: f64,
                    causal_ms: f64|
         -> Result<()> {
            let pairs = pack.mask()?.visible_pairs();
            let (skip, full, part) = count_tiles(&pack.kv_end, &traits);
            let all = (skip + full + part).max(1) as f64;
            let tflops =
                4.0 * sh.head_dim as f64 * sh.q_heads as f64 * pairs as f64 / (ms * 1e-3) / 1e12;
            // Throughput per visible pair against causal's (1: as fast per pair).
            let per_pair = (pairs as f64 / ms) / (causal_pairs as f64 / causal_ms);
            let _ = writeln!(
                rep,
                "{:<34} {:>4} {:>6} {:>8.1} {:>6.1} {:>6.1} {:>8.3} {:>8.1} {:>9.3} {:>8.2}",
                name,
                sh.head_dim,
                sh.tokens,
                pairs as f64 / 1e6,
                100.0 * skip as f64 / all,
                100.0 * full as f64 / all,
                ms,
                tflops,
                causal_ms,
                per_pair
            );
            let id = tm.pack_id(name_of_pack(name), pack);
            tm.push(TimingRecord {
                name: name.to_string(),
                kind: "forward",
                pack: id,
                shape: *sh,
                rope,
                pairs,
                ours_ms: ms,
                ours_det_ms: None,
                ours_balanced_ms: None,
                causal_ms,
            })
        };
        let causal_ms = match tm.causal_ms("forward", sh) {
            Some(ms) => ms,
            None => {
                let ms = time_pack(be, &inputs, &causal, *sh, &plain, reps)?;
                tm.causal.push(("forward", *sh, ms));
                line(tm, rep, &causal_name, &causal, None, ms, ms)?;
                tm.budget.took(started.elapsed());
                ms
            }
        };
        for r in rows {
            let started = std::time::Instant::now();
            if let Err(l) = tm
                .budget
                .admit(&format!("forward {} d{}", r.label, sh.head_dim))
            {
                let _ = writeln!(rep, "{l}");
                tm.skipped.push(l);
                continue;
            }
            let mut params = AttnParams::new(sh.head_dim);
            params.rope = r.rope;
            let ms = time_pack(be, &inputs, r.pack, *sh, &params, reps)?;
            line(tm, rep, &r.label, r.pack, r.rope, ms, causal_ms)?;
            // The timing packs at d 128 (16k tokens, and the long one: 64k
            // on a GPU) are also checked: sizes the correctness section
            // never runs.
            if sh.head_dim == 128 && r.rope.is_none() && r.checked {
                let (o_err, lse_err, n) =
                    sampled_rows_check(be, rng, &inputs[0], &host, r.pack, *sh)?;
                let _ = writeln!(
                    rep,
                    "  {:<32} float64 reference on {n} sampled rows x {} heads: O {o_err:.2e} (relative), LSE {lse_err:.2e} (absolute): ok",
                    r.label, sh.q_heads
                );
            }
            tm.budget.took(started.elapsed());
        }
    }
    Ok(())
}

/// The pack part of a row label ("random trees 16/4 rotary" → "random
/// trees"): rows on the same pack share one file in the dump.
pub(super) fn name_of_pack(label: &str) -> &str {
    label
        .split_once(|c: char| c.is_ascii_digit() || c == ':')
        .map_or(label, |(head, _)| head)
        .trim_end()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_labels_name_their_pack() {
        assert_eq!(name_of_pack("random trees 16/4 rotary"), "random trees");
        assert_eq!(name_of_pack("random trees 16/2 (gqa 8:1)"), "random trees");
        assert_eq!(name_of_pack("grpo: prompt + 16 responses 16/4"), "grpo");
        assert_eq!(name_of_pack("causal 16/4"), "causal");
    }

    /// The float64 check of the timing packs passes on the emulated kernel
    /// and fails when the reference's inputs are not the kernel's (a
    /// negative control: a wrong O is caught).
    #[cfg(feature = "emu")]
    #[test]
    fn sampled_rows_check_passes_and_catches_a_wrong_output() {
        use super::super::target::EmuTarget;
        let be = EmuTarget::default();
        let mut rng = Rng::new(11);
        let pack = random_trees(&mut rng, 300);
        let shape = AttnShape {
            tokens: 300,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 64,
            v_head_dim: 64,
        };
        let (inputs, host) = timing_inputs::<EmuTarget, half::bf16>(&be, &mut rng, shape).unwrap();
        let (o_err, lse_err, n) =
            sampled_rows_check(&be, &mut rng, &inputs[0], &host, &pack, shape).unwrap();
        assert!(
            n >= 2 && o_err < 1e-2 && lse_err < 1e-3,
            "{o_err} {lse_err} {n}"
        );
        let mut wrong = host.clone();
        wrong[2]
            .iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(-x.to_f32()));
        let e = sampled_rows_check(&be, &mut rng, &inputs[0], &wrong, &pack, shape).unwrap_err();
        assert!(e.to_string().contains("float64 reference"), "{e}");
    }

    #[test]
    fn random_trees_fill_exactly_and_are_valid() {
        let mut rng = Rng::new(7);
        for n in [256, 1000, 4096] {
            let p = random_trees(&mut rng, n);
            assert_eq!(p.kv_end.len(), n);
            p.mask().unwrap();
        }
    }
}
