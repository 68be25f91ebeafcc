//! Launch planning of the SDCC forward-KL kernel (`kernels/sdcc_kl.cu`),
//! shared by the `emu` and `cuda` backends: one block of 256 threads per
//! (student row, teacher row) pair, 336 bytes of dynamic shared memory.

use super::LaunchPlan;
use crate::backend::{Element, Memory, SdccArgs};
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

/// Per-pair status words from the unfused baseline's per-row words
/// (`[student rows of the pairs, teacher rows of the pairs]`, student bits):
/// teacher-row bits move to the teacher positions.
pub(crate) fn merge_row_status(row_status: &[u32]) -> Vec<u32> {
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
pub(crate) fn status_error(status: &[u32], pairs: &[(u32, u32)], vocab: usize) -> Result<()> {
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
