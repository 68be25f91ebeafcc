//! Self-tests of the SIMT emulator (kernels/emu/): the lane layouts of
//! `ldmatrix` and `mma.m16n8k16` against the PTX ISA and a scalar matmul,
//! shuffles and ballots against their CUDA definitions, the cp.async group
//! model, shared-memory poisoning, and the errors the emulator must raise
//! instead of hanging (divergent barriers, partial masks, unconverged warps)
//! or aborting (C++ exceptions).
//!
//! Inputs are fresh random numbers every run; the seed is printed in every
//! failure message and `TREEATTN_SEED` replays it.

use crate::common;
use crate::common::calls;

use half::{bf16, f16};
use treeattn::backend::emu::shim_selftest::{run, Kernel};
use treeattn::backend::emu::{EmuOptions, Schedule};

fn u16s_to_bytes(x: &[u16]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}
fn bytes_to_u32s(x: &[u8]) -> Vec<u32> {
    x.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

const POISON: u32 = 0xffff_ffff;
const SENTINEL: u32 = 0xdead_beef;

#[test]
fn ldmatrix_lane_layouts_follow_the_ptx_isa() {
    let (mut rng, seed) = common::seeded_rng();
    for count in [1u32, 2, 4] {
        for trans in [false, true] {
            let m: Vec<u16> = (0..256).map(|_| rng.next_u64() as u16).collect();
            let mut out: Vec<u8> = SENTINEL.to_le_bytes().repeat(32 * 4);
            let arg = count | (u32::from(trans) << 8);
            // SAFETY: the kernel reads 256 u16 and writes 4 u32 per lane of one warp.
            unsafe {
                run(
                    calls::options(),
                    Kernel::LdmatrixDump,
                    &u16s_to_bytes(&m),
                    &mut out,
                    arg,
                    1,
                    32,
                    512,
                )
            }
            .unwrap();
            let out = bytes_to_u32s(&out);
            for t in 0..32usize {
                for j in 0..4usize {
                    let got = out[t * 4 + j];
                    if j >= count as usize {
                        assert_eq!(got, SENTINEL, "seed {seed}: x{count} wrote register {j}");
                        continue;
                    }
                    // Lane t holds row t/4, columns 2(t%4) and 2(t%4)+1 of
                    // matrix j (of its transpose with .trans).
                    let (r, c) = (t / 4, 2 * (t % 4));
                    let at = |row: usize, col: usize| m[64 * j + row * 8 + col] as u32;
                    let want = if trans {
                        at(c, r) | (at(c + 1, r) << 16)
                    } else {
                        at(r, c) | (at(r, c + 1) << 16)
                    };
                    assert_eq!(
                        got, want,
                        "seed {seed}: x{count} trans={trans} lane {t} register {j}"
                    );
                }
            }
        }
    }
}

/// Runs D = A B + C through ldmatrix + mma in the emulator.
fn mma_chain(a: &[u16], b: &[u16], c: &[f32], bf16_inputs: bool, b_k_major: bool) -> Vec<f32> {
    let mut input = u16s_to_bytes(a);
    input.extend(u16s_to_bytes(b));
    input.extend(c.iter().flat_map(|v| v.to_le_bytes()));
    let mut out = vec![0u8; 128 * 4];
    let arg = u32::from(bf16_inputs) | (u32::from(b_k_major) << 1);
    // SAFETY: the kernel reads A (256 u16), B (128 u16), C (128 f32) and writes 128 f32.
    unsafe {
        run(
            calls::options(),
            Kernel::MmaChain,
            &input,
            &mut out,
            arg,
            1,
            32,
            768,
        )
    }
    .unwrap();
    bytes_to_u32s(&out)
        .into_iter()
        .map(f32::from_bits)
        .collect()
}

#[test]
fn mma_m16n8k16_matches_a_scalar_matmul() {
    let (mut rng, seed) = common::seeded_rng();
    for bf in [true, false] {
        for b_k_major in [false, true] {
            let round = |x: f32| -> (u16, f64) {
                if bf {
                    let h = bf16::from_f32(x);
                    (h.to_bits(), h.to_f64())
                } else {
                    let h = f16::from_f32(x);
                    (h.to_bits(), h.to_f64())
                }
            };
            let a: Vec<(u16, f64)> = (0..256).map(|_| round(rng.signed_unit() * 3.0)).collect(); // [16][16]
            let b: Vec<(u16, f64)> = (0..128).map(|_| round(rng.signed_unit() * 3.0)).collect(); // [k 16][n 8]
            let c: Vec<f32> = (0..128).map(|_| rng.signed_unit() * 4.0).collect(); // [16][8]
                                                                                   // B is stored k-major ([16][8]) for the .trans path, n-major otherwise.
            let b_store: Vec<u16> = if b_k_major {
                b.iter().map(|x| x.0).collect()
            } else {
                (0..128).map(|i| b[(i % 16) * 8 + i / 16].0).collect()
            };
            let a_bits: Vec<u16> = a.iter().map(|x| x.0).collect();
            let d = mma_chain(&a_bits, &b_store, &c, bf, b_k_major);
            let mut worst_wrong_layout = 0.0f64;
            for i in 0..16 {
                for j in 0..8 {
                    let (mut s, mut mag) = (c[i * 8 + j] as f64, (c[i * 8 + j] as f64).abs());
                    let mut wrong = c[i * 8 + j] as f64;
                    for k in 0..16 {
                        s += a[i * 16 + k].1 * b[k * 8 + j].1;
                        mag += (a[i * 16 + k].1 * b[k * 8 + j].1).abs();
                        wrong += a[k * 16 + i].1 * b[k * 8 + j].1; // Aᵀ B: a transposed fragment
                    }
                    // Products of 16-bit values are exact in f32; 16 f32
                    // additions err by at most ~16 ulp of the magnitude sum.
                    let tol = 16.0 * f32::EPSILON as f64 * mag;
                    let got = d[i * 8 + j] as f64;
                    assert!(
                        (got - s).abs() <= tol,
                        "seed {seed}: bf16={bf} k_major={b_k_major} D[{i}][{j}] = {got}, expected {s} (tol {tol})"
                    );
                    worst_wrong_layout = worst_wrong_layout.max((wrong - s).abs());
                }
            }
            // Negative control: the check above can tell A from Aᵀ.
            assert!(
                worst_wrong_layout > 0.5,
                "seed {seed}: inputs too degenerate to test the layout"
            );
        }
    }
}

#[test]
fn shuffles_and_ballot_follow_cuda_semantics() {
    let (mut rng, seed) = common::seeded_rng();
    for _ in 0..4 {
        let arg = [1u32, 2, 3, 4, 7, 8, 13][(rng.next_u64() % 7) as usize];
        let v: Vec<u32> = (0..64)
            .map(|_| (rng.next_u64() % (1 << 20)) as u32)
            .collect();
        let input: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut out = vec![0u8; 64 * 9 * 4];
        // SAFETY: 64 threads read one u32 each and write 9 u32 each.
        unsafe {
            run(
                calls::options(),
                Kernel::Shuffles,
                &input,
                &mut out,
                arg,
                1,
                64,
                0,
            )
        }
        .unwrap();
        let out = bytes_to_u32s(&out);
        let a = arg as usize;
        for i in 0..64usize {
            let (w, l) = (i / 32 * 32, i % 32);
            let o = &out[i * 9..i * 9 + 9];
            let ctx = format!("seed {seed}: thread {i}, arg {arg}");
            assert_eq!(o[0], v[w + (l ^ a)], "{ctx}: xor");
            assert_eq!(
                o[1],
                if l + a < 32 { v[i + a] } else { v[i] },
                "{ctx}: down"
            );
            assert_eq!(o[2], if l >= a { v[i - a] } else { v[i] }, "{ctx}: up");
            assert_eq!(o[3], v[w + a], "{ctx}: idx");
            let ballot = (0..32).fold(0u32, |b, j| b | ((v[w + j] & 1) << j));
            assert_eq!(o[4], ballot, "{ctx}: ballot");
            // width 16: lanes may read earlier groups, not later ones.
            let src = l ^ a;
            let want = if src >= (l / 16 + 1) * 16 {
                v[i]
            } else {
                v[w + src]
            };
            assert_eq!(o[5], want, "{ctx}: xor width 16");
            let q = (0..4).map(|j| v[w + l / 4 * 4 + j]).max().unwrap() as f32;
            assert_eq!(f32::from_bits(o[6]), q, "{ctx}: quad max");
            let sparse = (0..32).fold(0u32, |b, j| {
                b | (u32::from(w == 0 && (v[w + j] >> 3).is_multiple_of(arg)) << j)
            });
            let ffs = if sparse == 0 {
                0
            } else {
                sparse.trailing_zeros() + 1
            };
            assert_eq!(o[7], ffs, "{ctx}: __ffs");
            assert_eq!(o[8], sparse.count_ones(), "{ctx}: __popc");
        }
    }
}

fn expect_err(kernel: Kernel, arg: u32, grid: u32, block: u32, needles: &[&str]) {
    let input = vec![0u8; 4096];
    let mut out = vec![0u8; 4096];
    // SAFETY: the error kernels touch at most one u32 per thread (< 1024 threads).
    let e = unsafe {
        run(
            calls::options(),
            kernel,
            &input,
            &mut out,
            arg,
            grid,
            block,
            256,
        )
    }
    .unwrap_err()
    .to_string();
    for n in needles {
        assert!(
            e.contains(n),
            "{kernel:?}: error {e:?} does not mention {n:?}"
        );
    }
}

#[test]
fn divergent_barriers_are_errors_not_hangs() {
    expect_err(
        Kernel::DivergentBarrier,
        0,
        3,
        64,
        &[
            "divergent __syncthreads",
            "63 threads wait",
            "1 have exited",
        ],
    );
    // Odd threads pass one more barrier than even ones (2 against 3).
    expect_err(
        Kernel::UnevenBarriers,
        2 | (1 << 8),
        1,
        128,
        &["divergent __syncthreads", "64 threads wait"],
    );
    // Positive control: the same kernel with a uniform count of 3 barriers.
    let mut out = [0u8; 4];
    // SAFETY: this kernel touches no memory.
    unsafe {
        run(
            calls::options(),
            Kernel::UnevenBarriers,
            &[],
            &mut out,
            3,
            2,
            128,
            0,
        )
    }
    .unwrap();
}

#[test]
fn warp_collectives_need_full_masks_and_converged_lanes() {
    expect_err(
        Kernel::PartialMask,
        0,
        1,
        32,
        &["__shfl_xor_sync", "mask 0x0000ffff"],
    );
    expect_err(
        Kernel::NotConverged,
        0,
        1,
        32,
        &["not converged", "__shfl_xor_sync", "__ballot_sync"],
    );
    expect_err(
        Kernel::NotConverged,
        1,
        1,
        64,
        &["not converged", "__syncthreads"],
    );
}

#[test]
fn launches_with_partial_warps_are_rejected() {
    let mut out = [0u8; 4];
    // SAFETY: nothing runs: the launch is rejected.
    let e = unsafe {
        run(
            calls::options(),
            Kernel::Shuffles,
            &[],
            &mut out,
            1,
            1,
            48,
            0,
        )
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("multiple of 32"), "{e}");
}

#[test]
fn shared_memory_is_poisoned_fresh_for_every_block() {
    // One worker runs the 6 blocks one after another on the same storage:
    // each block must still read only the poison, never the last block's writes.
    let mut out = vec![0u8; 6 * 64 * 4];
    let one_worker = EmuOptions {
        workers: 1,
        ..EmuOptions::default()
    };
    // SAFETY: 6 blocks of 64 threads write one u32 each.
    calls::with_options(one_worker, || unsafe {
        run(
            calls::options(),
            Kernel::PoisonRead,
            &[],
            &mut out,
            0,
            6,
            64,
            256,
        )
    })
    .unwrap();
    for (i, w) in bytes_to_u32s(&out).into_iter().enumerate() {
        assert_eq!(w, POISON, "word {i} (block {}, thread {})", i / 64, i % 64);
    }
    assert!(
        f32::from_bits(POISON).is_nan()
            && bf16::from_bits(0xffff).is_nan()
            && f16::from_bits(0xffff).is_nan()
    );
}

#[test]
fn cp_async_lands_at_its_wait_group_or_eagerly() {
    // Hardware may land a copy anywhere between issue and its wait_group; the
    // emulator offers both ends.
    let (mut rng, seed) = common::seeded_rng();
    for (zero_fill, eager) in [(false, false), (true, false), (false, true), (true, true)] {
        let input: Vec<u8> = (0..32 * 32).map(|_| rng.next_u64() as u8).collect();
        let mut out = vec![0u8; 32 * 12 * 4];
        // SAFETY: 32 threads read 32 bytes each and write 12 u32 each; smem 1024.
        let opts = EmuOptions {
            cp_async_eager: eager,
            ..EmuOptions::default()
        };
        calls::with_options(opts, || unsafe {
            run(
                calls::options(),
                Kernel::CpAsyncGroups,
                &input,
                &mut out,
                u32::from(zero_fill),
                1,
                32,
                1024,
            )
        })
        .unwrap();
        let out = bytes_to_u32s(&out);
        let data = bytes_to_u32s(&input);
        for t in 0..32 {
            let o = &out[t * 12..t * 12 + 12];
            for i in 0..4 {
                let ctx =
                    format!("seed {seed}: thread {t} word {i} zero_fill {zero_fill} eager {eager}");
                let second = if zero_fill { 0 } else { data[t * 8 + 4 + i] };
                if eager {
                    // Landed at issue: everything visible at once.
                    assert_eq!(o[i], data[t * 8 + i], "{ctx}: before any wait");
                    assert_eq!(
                        o[4 + i],
                        data[t * 8 + i] ^ second,
                        "{ctx}: after wait_group 1"
                    );
                } else {
                    assert_eq!(o[i], POISON, "{ctx}: visible before any wait");
                    assert_eq!(
                        o[4 + i],
                        data[t * 8 + i] ^ POISON,
                        "{ctx}: after wait_group 1"
                    );
                }
                assert_eq!(o[8 + i], second, "{ctx}: after wait_group 0");
            }
        }
    }
}

#[test]
fn warp_serial_schedules_expose_a_missing_barrier() {
    // Warp 0 writes shared memory, warp 1 reads it: with the barrier every
    // schedule agrees; without it, lockstep happens to hide the race and the
    // reverse schedule (warp 1 first) reads the poison.
    let (mut rng, seed) = common::seeded_rng();
    let input: Vec<u8> = (0..32 * 4).map(|_| rng.next_u64() as u8).collect();
    let data = bytes_to_u32s(&input);
    for opts in EmuOptions::all() {
        for barrier in [true, false] {
            let mut out = vec![0u8; 32 * 4];
            // SAFETY: warp 0 reads 32 u32, warp 1 writes 32 u32; smem 128.
            calls::with_options(opts, || unsafe {
                run(
                    calls::options(),
                    Kernel::MissingBarrier,
                    &input,
                    &mut out,
                    u32::from(barrier),
                    1,
                    64,
                    128,
                )
            })
            .unwrap();
            let got = bytes_to_u32s(&out);
            let race_visible = opts.schedule == Schedule::WarpSerialReverse && !barrier;
            for i in 0..32 {
                let want = if race_visible { POISON } else { data[i] };
                assert_eq!(
                    got[i], want,
                    "seed {seed}: {opts:?} barrier {barrier} word {i}"
                );
            }
        }
    }
}

#[test]
fn cp_async_outside_the_inputs_is_an_error() {
    // The kernel copies 32 bytes per thread from the input; give it 16 bytes
    // too few: the last thread's second copy leaves the buffer.
    let input = vec![7u8; 32 * 32 - 16];
    let mut out = vec![0u8; 32 * 12 * 4];
    // SAFETY: the kernel reads the input only with cp.async (checked against
    // its length) and writes 12 u32 per thread.
    let e = unsafe {
        run(
            calls::options(),
            Kernel::CpAsyncGroups,
            &input,
            &mut out,
            0,
            1,
            32,
            1024,
        )
    }
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("offset 1008 of the input, a buffer of 1008 bytes"),
        "{e}"
    );
    assert!(e.contains("thread (31,0,0)"), "{e}");
}

#[test]
fn syncthreads_or_tells_every_thread_of_its_barrier_only() {
    // 3 blocks of 96 threads under every schedule: barrier 1's predicate is
    // one thread's (or none's), barrier 2's nobody's, barrier 3's the last
    // thread's; each result is its own barrier's, in every thread.
    let (blocks, threads) = (3u32, 96u32);
    for opts in EmuOptions::all() {
        for arg in [0u32, 37, 95, 96] {
            let mut out = vec![0xffu8; (blocks * threads * 3 * 4) as usize];
            // SAFETY: the kernel writes 3 u32 per thread.
            calls::with_options(opts, || unsafe {
                run(
                    calls::options(),
                    Kernel::SyncthreadsOr,
                    &[],
                    &mut out,
                    arg,
                    blocks,
                    threads,
                    0,
                )
            })
            .unwrap();
            let want = [u32::from(arg < threads), 0, 1];
            for (t, got) in bytes_to_u32s(&out).chunks(3).enumerate() {
                assert_eq!(got, want, "{opts:?} arg {arg} thread {t}");
            }
        }
    }
}

#[test]
fn atomics_are_atomic_across_blocks_and_threads() {
    // 24 blocks of 96 threads on two OS threads: lost updates would show.
    let (blocks, threads) = (24u32, 96u32);
    let n = blocks * threads;
    let mut out = vec![0u8; 24];
    out[12..16].copy_from_slice(&0i32.to_le_bytes());
    let opts = EmuOptions {
        workers: 2,
        ..EmuOptions::default()
    };
    // SAFETY: the kernel updates the 24 bytes of `out` only.
    calls::with_options(opts, || unsafe {
        run(
            calls::options(),
            Kernel::Atomics,
            &[],
            &mut out,
            0,
            blocks,
            threads,
            0,
        )
    })
    .unwrap();
    let w = bytes_to_u32s(&out);
    assert_eq!(w[0], n, "atomicAdd(u32)");
    assert_eq!(
        f32::from_bits(w[1]),
        0.5 * n as f32,
        "atomicAdd(f32), exact for these sums"
    );
    assert_eq!(w[2], n - 1, "atomicMax(u32)");
    assert_eq!(w[3] as i32, -(n as i32 - 1), "atomicMin(i32)");
    assert_eq!(
        u64::from(w[4]) | (u64::from(w[5]) << 32),
        u64::from(n),
        "atomicAdd(u64)"
    );
}

#[test]
fn cpp_exceptions_become_errors_not_aborts() {
    // From a kernel thread (on a fiber), with one and with several OS
    // threads running blocks: the exception's message, not a divergent
    // barrier (the other 63 threads wait at the second one).
    for workers in [1, 3] {
        let opts = EmuOptions {
            workers,
            ..EmuOptions::default()
        };
        calls::with_options(opts, || {
            expect_err(
                Kernel::Throws,
                37,
                4,
                64,
                &[
                    "C++ exception in the kernel: thrown by thread 37",
                    "thread (37,0,0)",
                ],
            )
        });
    }
    // From the entry point itself, on the calling thread.
    expect_err(
        Kernel::ThrowOnHost,
        0,
        1,
        32,
        &["ta_emu_selftest: C++ exception: thrown by the entry point"],
    );
    // The emulator still works on this thread afterwards.
    let mut out = [0u8; 4];
    // SAFETY: this kernel touches no memory.
    unsafe {
        run(
            calls::options(),
            Kernel::UnevenBarriers,
            &[],
            &mut out,
            3,
            2,
            128,
            0,
        )
    }
    .unwrap();
}
