//! Launch planning of the SDCC forward-KL kernel (`kernels/sdcc_kl.cu`),
//! shared by the `emu` and `cuda` backends: one block of 256 threads per
//! (student row, teacher row) pair, 336 bytes of dynamic shared memory.

use super::LaunchPlan;
use crate::backend::{Element, Memory, SdccArgs, SdccLoss};
use crate::{Error, Result};

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for f32 {}
}

/// A logits element type of the SDCC kernel: `half::bf16`, `half::f16` or
/// `f32` (f32 accumulation inside, f64 for the per-pair combination).
pub trait SdccElem:
    sealed::Sealed + Element + Copy + Send + Sync + bytemuck::Pod + 'static
{
    /// The code the emulator entry point takes (0 = bf16, 1 = f16, 2 = f32).
    const CODE: u32;
    /// Widens exactly.
    fn to_f32(self) -> f32;
}

impl SdccElem for half::bf16 {
    const CODE: u32 = 0;
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}
impl SdccElem for half::f16 {
    const CODE: u32 = 1;
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}
impl SdccElem for f32 {
    const CODE: u32 = 2;
    fn to_f32(self) -> f32 {
        self
    }
}

/// Threads per block of `sdcc_kl_*`.
pub const SDCC_THREADS: u32 = 256;
/// Dynamic shared memory of `sdcc_kl_*`: one 48-byte partial state per warp
/// and the two final log-sum-exps (16 bytes).
pub const SDCC_SMEM_BYTES: u32 = (SDCC_THREADS / 32) * 48 + 16;

/// Status bits the kernel writes per pair.
pub(crate) const STATUS_STUDENT_NONFINITE: u32 = 1;
pub(crate) const STATUS_TEACHER_NONFINITE: u32 = 2;
pub(crate) const STATUS_STUDENT_ALL_NEG_INF: u32 = 4;
pub(crate) const STATUS_TEACHER_ALL_NEG_INF: u32 = 8;

/// The rows an SDCC call uses and how its gradient is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SdccPlan {
    /// One block per pair.
    pub launch: LaunchPlan,
    /// Rows of the student logits.
    pub student_rows: usize,
    /// Some student row is named by several pairs: the kernel adds its
    /// gradient with f32 atomics into a zeroed buffer.
    pub accumulate: bool,
    /// Per student row, whether some pair names it.
    pub used: Vec<bool>,
}

/// Plans a validated SDCC call. Errors: more pairs than one grid takes.
pub fn plan_sdcc<M: Memory, T: Element>(args: &SdccArgs<'_, M, T>) -> Result<SdccPlan> {
    let (pairs, n_student) = (args.pairs(), args.student_rows());
    if pairs.len() > i32::MAX as usize {
        return Err(Error::Unsupported(format!(
            "{} SDCC pairs exceed one launch's grid",
            pairs.len()
        )));
    }
    let mut used = vec![false; n_student];
    let mut accumulate = false;
    for &(s, _) in pairs {
        accumulate |= std::mem::replace(&mut used[s as usize], true);
    }
    Ok(SdccPlan {
        launch: LaunchPlan {
            grid: (pairs.len() as u32, 1, 1),
            block: (SDCC_THREADS, 1, 1),
            shared_mem_bytes: SDCC_SMEM_BYTES,
        },
        student_rows: n_student,
        accumulate,
        used,
    })
}

impl SdccPlan {
    /// The two launches of the unfused baseline: `sdcc_unfused_log_softmax`
    /// (one block per (pair, side)) and `sdcc_unfused_kl` (one per pair).
    pub fn unfused_launches(&self) -> [LaunchPlan; 2] {
        let mut ls = self.launch;
        ls.grid.1 = 2;
        [ls, self.launch]
    }
}

/// Where one fused SDCC launch reads and writes (device or host addresses).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SdccAddrs {
    pub student: u64,
    pub teacher: u64,
    /// The pairs as [`SdccPlan::flat_pairs`] lays them out.
    pub pairs: u64,
    pub weights: u64,
    pub grad: u64,
    /// f64 per pair, poisoned with [`SdccPlan::KL_POISON`].
    pub kl: u64,
    /// One word per pair, poisoned with [`SdccPlan::STATUS_POISON`].
    pub status: u64,
}

/// One SDCC call sequenced once for the emulator and CUDA (each only
/// allocates, uploads and launches): which gradient rows to zero first,
/// the pairs' layout, the kernel's arguments, the poison of the per-pair
/// outputs, and the result read back.
impl SdccPlan {
    /// What the per-pair KL holds before the kernel writes it: NaN, so that
    /// a pair the kernel skipped cannot pass for a KL of 0.
    pub(crate) const KL_POISON: f64 = f64::NAN;
    /// What the per-pair status words hold before the kernel writes them
    /// (every bit set: [`status_error`] reports such a pair as not
    /// processed by the kernel).
    pub(crate) const STATUS_POISON: u32 = u32::MAX;

    /// The runs of gradient rows (`[start, end)` in student rows) to zero
    /// before the launch: the rows no pair names (the kernel does not store
    /// them), and all rows when some row is named by several pairs (the
    /// kernel adds into zeros). The others keep what they held until the
    /// kernel stores them.
    pub(crate) fn zero_rows(&self) -> Vec<std::ops::Range<usize>> {
        let zero = |r: usize| !self.used[r] || self.accumulate;
        let mut runs = Vec::new();
        let mut row = 0;
        while row < self.student_rows {
            if !zero(row) {
                row += 1;
                continue;
            }
            let start = row;
            while row < self.student_rows && zero(row) {
                row += 1;
            }
            runs.push(start..row);
        }
        runs
    }

    /// The pairs as the kernel reads them: `[student row, teacher row]` per
    /// pair, flat.
    pub(crate) fn flat_pairs(pairs: &[(u32, u32)]) -> Vec<u32> {
        pairs.iter().flat_map(|&(s, t)| [s, t]).collect()
    }

    /// The fused kernel's arguments for `args` at `addrs`.
    pub(crate) fn params<M: Memory, T: Element>(
        &self,
        args: &SdccArgs<'_, M, T>,
        addrs: SdccAddrs,
    ) -> SdccParams {
        let (vocab, tau) = (args.vocab(), args.temperature() as f64);
        SdccParams {
            student: addrs.student,
            teacher: addrs.teacher,
            pairs: addrs.pairs,
            weights: addrs.weights,
            grad: addrs.grad,
            kl: addrs.kl,
            status: addrs.status,
            vocab: vocab as u64,
            num_pairs: args.pairs().len() as u32,
            inv_tau_log2: (std::f64::consts::LOG2_E / tau) as f32,
            inv_tau: (1.0 / tau) as f32,
            accumulate: u32::from(self.accumulate),
            vec8: vec8(vocab, [addrs.student, addrs.teacher, addrs.grad]),
            logp: 0,
            row_status: 0,
        }
    }

    /// The unfused baseline's arguments (both of its kernels): `addrs`
    /// with no status words (`addrs.status` unused) and the scratch of
    /// `[2, pairs, vocab]` log-probabilities at `logp` and `[2, pairs]` row
    /// status words at `row_status` (poisoned with
    /// [`Self::STATUS_POISON`]); the gradient zeroed whole first.
    pub(crate) fn unfused_params<M: Memory, T: Element>(
        &self,
        args: &SdccArgs<'_, M, T>,
        addrs: SdccAddrs,
        logp: u64,
        row_status: u64,
    ) -> SdccParams {
        SdccParams {
            status: 0,
            vec8: 0,
            logp,
            row_status,
            ..self.params(args, addrs)
        }
    }

    /// [`Self::finish`] for the unfused baseline's per-row status words.
    pub(crate) fn finish_unfused<M: Memory, T: Element>(
        args: &SdccArgs<'_, M, T>,
        kl: Vec<f64>,
        row_status: &[u32],
    ) -> Result<SdccLoss> {
        Self::finish(args, kl, &merge_row_status(row_status))
    }

    /// The call's loss from the per-pair KL and status words the kernel
    /// wrote: the error of the lowest bad pair ([`status_error`]), else
    /// [`SdccLoss::from_per_pair`].
    pub(crate) fn finish<M: Memory, T: Element>(
        args: &SdccArgs<'_, M, T>,
        kl: Vec<f64>,
        status: &[u32],
    ) -> Result<SdccLoss> {
        status_error(status, args.pairs(), args.vocab())?;
        Ok(SdccLoss::from_per_pair(kl, args.weights()))
    }
}

/// Per-pair status words from the unfused baseline's per-row words
/// (`[student rows of the pairs, teacher rows of the pairs]`, student bits):
/// teacher-row bits move to the teacher positions.
fn merge_row_status(row_status: &[u32]) -> Vec<u32> {
    let (student, teacher) = row_status.split_at(row_status.len() / 2);
    student
        .iter()
        .zip(teacher)
        .map(|(&s, &t)| {
            let moved = (if t & STATUS_STUDENT_NONFINITE != 0 {
                STATUS_TEACHER_NONFINITE
            } else {
                0
            }) | (if t & STATUS_STUDENT_ALL_NEG_INF != 0 {
                STATUS_TEACHER_ALL_NEG_INF
            } else {
                0
            });
            s | moved
        })
        .collect()
}

/// The error for the lowest pair whose status word is not 0, if any.
fn status_error(status: &[u32], pairs: &[(u32, u32)], vocab: usize) -> Result<()> {
    let Some(i) = status.iter().position(|&s| s != 0) else {
        return Ok(());
    };
    let (s, t) = (pairs[i].0 as usize, pairs[i].1 as usize);
    let (nonfinite, no_mass) = ("holds a NaN or +inf", "is entirely −inf: no distribution");
    let checks = [
        (STATUS_STUDENT_NONFINITE, "student", s, nonfinite),
        (STATUS_TEACHER_NONFINITE, "teacher", t, nonfinite),
        (STATUS_TEACHER_ALL_NEG_INF, "teacher", t, no_mass),
        (STATUS_STUDENT_ALL_NEG_INF, "student", s, no_mass),
    ];
    let (_, what, row, kind) = checks
        .into_iter()
        .find(|c| status[i] & c.0 != 0)
        .unwrap_or((0, "student", s, "was not processed by the kernel"));
    Err(Error::NonFinite {
        what: format!("SDCC pair {i}: {what} logits row {row} {kind}"),
        index: row * vocab,
    })
}

/// Whether the fused kernel may move 8 entries per 16-byte vector: the
/// vocabulary a multiple of 8 (so every row of 16-bit or f32 elements starts
/// 16-byte aligned when the tensor does) and the student, teacher and
/// gradient tensors 16-byte aligned (device allocations always are).
pub(crate) fn vec8(vocab: usize, addrs: [u64; 3]) -> u32 {
    u32::from(vocab.is_multiple_of(8) && addrs.iter().all(|a| a % 16 == 0))
}

/// Mirror of `SdccParams` (kernels/sdcc_kl.cu). Pointers are device
/// addresses (CUDA) or host addresses (emulator).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct SdccParams {
    pub student: u64,
    pub teacher: u64,
    pub pairs: u64,
    pub weights: u64,
    pub grad: u64,
    pub kl: u64,
    pub status: u64,
    pub vocab: u64,
    pub num_pairs: u32,
    pub inv_tau_log2: f32,
    pub inv_tau: f32,
    pub accumulate: u32,
    /// 16-byte vector loads and stores: see [`vec8`].
    pub vec8: u32,
    /// Unfused baseline only: `[2, pairs, vocab]` f32 scratch.
    pub logp: u64,
    /// Unfused baseline only: `[2, pairs]` status words.
    pub row_status: u64,
}
super::assert_layout!(SdccParams, 104, {
    student: 0, teacher: 8, pairs: 16, weights: 24, grad: 32, kl: 40, status: 48, vocab: 56,
    num_pairs: 64, inv_tau_log2: 68, inv_tau: 72, accumulate: 76, vec8: 80, logp: 88,
    row_status: 96,
});

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(used: &[bool], accumulate: bool) -> SdccPlan {
        SdccPlan {
            launch: LaunchPlan {
                grid: (1, 1, 1),
                block: (SDCC_THREADS, 1, 1),
                shared_mem_bytes: SDCC_SMEM_BYTES,
            },
            student_rows: used.len(),
            accumulate,
            used: used.to_vec(),
        }
    }

    /// The rows zeroed before a launch: the unused ones in runs, or every
    /// row when the kernel adds.
    #[test]
    fn zero_rows_are_the_unused_runs_or_all_when_the_kernel_adds() {
        let used = [false, true, true, false, false, true, false];
        assert_eq!(plan(&used, false).zero_rows(), [0..1, 3..5, 6..7]);
        let all = std::ops::Range { start: 0, end: 7 };
        assert_eq!(plan(&used, true).zero_rows(), [all]);
        assert!(plan(&[true, true], false).zero_rows().is_empty());
        assert!(plan(&[], false).zero_rows().is_empty());
        assert_eq!(SdccPlan::flat_pairs(&[(3, 1), (0, 2)]), [3, 1, 0, 2]);
    }

    /// A status word left at its poison is an error, never a pass.
    #[test]
    fn an_unwritten_status_word_is_an_error() {
        let e = status_error(&[0, SdccPlan::STATUS_POISON], &[(0, 0), (1, 1)], 4).unwrap_err();
        assert!(format!("{e}").contains("SDCC pair 1"), "{e}");
        assert!(status_error(&[0, 0], &[(0, 0), (1, 1)], 4).is_ok());
        // The unfused baseline's row words, poisoned: also an error.
        let rows = [0, 0, SdccPlan::STATUS_POISON, 0];
        assert!(status_error(&merge_row_status(&rows), &[(0, 0), (1, 1)], 4).is_err());
    }
}
