//! Timing on a user's pack (`treeattn bench --pack FILE`): the CPU
//! backend's forward and forward+backward on the pack's mask, and on a
//! causal mask of the same length, in one round-robin run, counted as
//! visible-pair throughput (the numbers `scripts/cpu-anchor.py` sets beside
//! torch's on the very same pack).

use std::fmt;

use super::timing::{measure_round_robin, Timing};
use treeattn::backend::cpu::{isa, Cpu};
use treeattn::backend::{AttentionBackend, AttnArgs, AttnParams, AttnShape, Grads, Saved};
use treeattn::mask::PackMask;
use treeattn::rng::Rng;
use treeattn::{Error, Result};

/// What to time on a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackBenchOptions {
    /// Query heads.
    pub heads: usize,
    /// Kv heads (divides `heads`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// CPU threads.
    pub threads: usize,
    /// Timed repetitions of each (mask, pass); the median is kept.
    pub reps: usize,
}

/// One pass timed on the pack and on the causal mask of its length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PassTiming {
    /// Median on the pack's mask.
    pub tree: Timing,
    /// Median on the causal mask of the same length.
    pub causal: Timing,
}

/// The result of [`time_pack`].
#[derive(Clone, Debug, PartialEq)]
pub struct PackTiming {
    /// The options it ran with.
    pub options: PackBenchOptions,
    /// Packed tokens `L`.
    pub tokens: usize,
    /// Visible (query, key) pairs of the pack: `Σ_k (kv_end[k] − k)`.
    pub visible_pairs: u64,
    /// Forward.
    pub fwd: PassTiming,
    /// Forward then backward.
    pub fwd_bwd: PassTiming,
    /// The CPU code path that ran: `"avx512"`, `"avx2+fma"` or `"portable"`.
    pub isa: &'static str,
}

/// FLOPs of one pass per visible pair per query head: 4·d forward (two
/// matrix products), 3.5 times that forward + backward (FlashAttention's
/// count).
fn flops_per_pair(head_dim: usize, backward: bool) -> f64 {
    4.0 * head_dim as f64 * if backward { 3.5 } else { 1.0 }
}

impl PackTiming {
    /// Visible pairs of the causal mask of the same length, `L (L + 1) / 2`.
    pub fn causal_pairs(&self) -> u64 {
        let l = self.tokens as u64;
        l * (l + 1) / 2
    }

    fn gflops(&self, pairs: u64, t: &Timing, backward: bool) -> f64 {
        let o = &self.options;
        pairs as f64 * o.heads as f64 * flops_per_pair(o.head_dim, backward) / t.wall_s * 1e-9
    }

    /// The JSON object `treeattn bench --pack --json` prints: `tokens`,
    /// `visible_pairs`, `fwd_ms`, `fwd_bwd_ms`, `fwd_gflops`,
    /// `fwd_bwd_gflops`, `causal_fwd_ms`, `causal_fwd_bwd_ms`,
    /// `causal_fwd_gflops`, `causal_fwd_bwd_gflops` (GFLOP/s per visible
    /// pair, wall time), `threads`, `heads`, `kv_heads`, `head_dim`, `reps`,
    /// `isa`.
    pub fn to_json(&self) -> String {
        let o = &self.options;
        let causal = self.causal_pairs();
        serde_json::json!({
            "tokens": self.tokens,
            "visible_pairs": self.visible_pairs,
            "fwd_ms": self.fwd.tree.wall_s * 1e3,
            "fwd_bwd_ms": self.fwd_bwd.tree.wall_s * 1e3,
            "fwd_gflops": self.gflops(self.visible_pairs, &self.fwd.tree, false),
            "fwd_bwd_gflops": self.gflops(self.visible_pairs, &self.fwd_bwd.tree, true),
            "causal_fwd_ms": self.fwd.causal.wall_s * 1e3,
            "causal_fwd_bwd_ms": self.fwd_bwd.causal.wall_s * 1e3,
            "causal_fwd_gflops": self.gflops(causal, &self.fwd.causal, false),
            "causal_fwd_bwd_gflops": self.gflops(causal, &self.fwd_bwd.causal, true),
            "threads": o.threads,
            "heads": o.heads,
            "kv_heads": o.kv_heads,
            "head_dim": o.head_dim,
            "reps": o.reps,
            "isa": self.isa,
        })
        .to_string()
    }
}

impl fmt::Display for PackTiming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "pack of {} tokens, {} visible pairs ({:.3} of causal); f32, {} / {} heads × {}, {} threads ({}), median of {} reps",
            self.tokens,
            self.visible_pairs,
            self.visible_pairs as f64 / self.causal_pairs().max(1) as f64,
            o.heads,
            o.kv_heads,
            o.head_dim,
            o.threads,
            self.isa,
            o.reps
        )?;
        writeln!(
            f,
            "{:<8} {:>10} {:>10} {:>12} {:>12} {:>12}",
            "pass", "tree ms", "causal ms", "tree GF/s", "causal GF/s", "tree/causal"
        )?;
        for (name, p, bwd) in [("fwd", &self.fwd, false), ("fwd+bwd", &self.fwd_bwd, true)] {
            let (t, c) = (
                self.gflops(self.visible_pairs, &p.tree, bwd),
                self.gflops(self.causal_pairs(), &p.causal, bwd),
            );
            writeln!(
                f,
                "{:<8} {:>10.2} {:>10.2} {:>12.1} {:>12.1} {:>12.2}",
                name,
                p.tree.wall_s * 1e3,
                p.causal.wall_s * 1e3,
                t,
                c,
                t / c
            )?;
        }
        writeln!(
            f,
            "GF/s: 4·d·heads FLOPs per visible pair forward, ×3.5 forward+backward, by wall time"
        )
    }
}

/// Inputs and outputs of one mask, allocated once.
struct Run {
    kv_end: Vec<u32>,
    backward: bool,
    o: Vec<f32>,
    lse: Vec<f32>,
    grads: [Vec<f32>; 3],
}

/// Times the CPU backend on `kv_end` / `position_ids` (a pack's mask) and on
/// the causal mask of the same length, forward and forward+backward, with
/// random f32 inputs (seeded, the same for both masks), `reps` round-robin
/// rounds; rotary off.
///
/// Errors: an invalid mask, an empty pack, options of 0 or heads that do
/// not divide ([`Error::Usage`] / the contract's errors).
pub fn time_pack(
    kv_end: &[u32],
    position_ids: &[u32],
    opts: PackBenchOptions,
) -> Result<PackTiming> {
    let mask = PackMask::new(kv_end, position_ids)?;
    if mask.is_empty() {
        return Err(Error::Usage("the pack is empty".into()));
    }
    if opts.threads == 0 {
        return Err(Error::Usage("--threads must be at least 1".into()));
    }
    let shape = AttnShape {
        tokens: mask.len(),
        q_heads: opts.heads,
        kv_heads: opts.kv_heads,
        head_dim: opts.head_dim,
        v_head_dim: opts.head_dim,
    };
    shape.validate()?;
    let mut rng = Rng::new(0x7ee_a77e);
    let mut random = |n: usize| (0..n).map(|_| rng.signed_unit()).collect::<Vec<f32>>();
    let (q, k, v, d_o) = (
        random(shape.q_len()),
        random(shape.kv_len()),
        random(shape.kv_len()),
        random(shape.q_len()),
    );
    let causal = vec![mask.len() as u32; mask.len()];
    let cpu = Cpu::with_threads(opts.threads);
    let params = AttnParams::new(opts.head_dim);
    let mut runs: Vec<Run> = [kv_end, &causal[..]]
        .into_iter()
        .flat_map(|e| [false, true].map(|backward| (e, backward)))
        .map(|(e, backward)| Run {
            kv_end: e.to_vec(),
            backward,
            o: vec![0.0; shape.q_len()],
            lse: vec![0.0; shape.lse_len()],
            grads: [shape.q_len(), shape.kv_len(), shape.kv_len()].map(|n| vec![0.0; n]),
        })
        .collect();
    let times = measure_round_robin(opts.reps, &mut runs, |r| {
        let mask = PackMask::new(&r.kv_end, position_ids)?;
        let args = AttnArgs::new(&q[..], &k[..], &v[..], shape, mask, params)?;
        cpu.forward(&args, &mut r.o[..], &mut r.lse[..])?;
        if r.backward {
            let [dq, dk, dv] = &mut r.grads;
            let saved = Saved {
                o: &r.o[..],
                lse: &r.lse[..],
            };
            let grads = Grads {
                dq: &mut dq[..],
                dk: &mut dk[..],
                dv: &mut dv[..],
                dsinks: None,
            };
            cpu.backward(&args, saved, &d_o[..], grads)?;
        }
        Ok(())
    })?;
    Ok(PackTiming {
        options: opts,
        tokens: mask.len(),
        visible_pairs: mask.visible_pairs(),
        fwd: PassTiming {
            tree: times[0],
            causal: times[2],
        },
        fwd_bwd: PassTiming {
            tree: times[1],
            causal: times[3],
        },
        isa: isa().name(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_a_tree_and_its_causal_twin_and_reports_json() {
        // Two branches of 100 tokens under a 50-token trunk.
        let kv_end: Vec<u32> = (0..250u32)
            .map(|k| match k {
                0..=49 => 250,
                50..=149 => 150,
                _ => 250,
            })
            .collect();
        let pos: Vec<u32> = (0..250u32)
            .map(|k| if k < 150 { k } else { k - 100 })
            .collect();
        let opts = PackBenchOptions {
            heads: 2,
            kv_heads: 1,
            head_dim: 16,
            threads: 1,
            reps: 1,
        };
        let t = time_pack(&kv_end, &pos, opts).unwrap();
        assert_eq!(t.tokens, 250);
        assert_eq!(t.visible_pairs, 50 * 250 - 1225 + 5050 * 2);
        assert_eq!(t.causal_pairs(), 250 * 251 / 2);
        for p in [t.fwd, t.fwd_bwd] {
            assert!(p.tree.wall_s > 0.0 && p.causal.wall_s > 0.0);
        }
        let json: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
        for key in [
            "tokens",
            "visible_pairs",
            "fwd_ms",
            "fwd_bwd_ms",
            "fwd_gflops",
            "fwd_bwd_gflops",
            "causal_fwd_gflops",
            "causal_fwd_bwd_gflops",
            "threads",
            "isa",
        ] {
            assert!(!json[key].is_null(), "{key} missing: {json}");
        }
        assert_eq!(json["tokens"], 250);
        let text = t.to_string();
        assert!(
            text.contains("tree/causal") && text.contains("fwd+bwd"),
            "{text}"
        );
        // Bad options and masks are errors, not panics.
        let zero = PackBenchOptions { threads: 0, ..opts };
        assert!(matches!(
            time_pack(&kv_end, &pos, zero),
            Err(Error::Usage(_))
        ));
        let gqa = PackBenchOptions {
            kv_heads: 3,
            ..opts
        };
        assert!(time_pack(&kv_end, &pos, gqa).is_err());
        assert!(time_pack(&kv_end[..10], &pos, opts).is_err());
        assert!(matches!(time_pack(&[], &[], opts), Err(Error::Usage(_))));
    }
}
