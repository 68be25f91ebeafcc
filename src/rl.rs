//! Advantages for reinforcement learning on packs: GAE over a rollout's
//! targets (exact across its compactions, per segment, or CompactionRL's
//! discounted segments) and GRPO's group-normalised rewards.
//!
//! The input is a pack's loss entries in their order, which is generation
//! order: sorted by `(rollout, call, offset)`, so the targets of one rollout
//! are one contiguous run, `t = 0 … n−1`. A rollout has one scalar reward
//! `R`, given at its last target: `r_t = 0` for `t < n−1`, `r_{n−1} = R`.
//! `V_t` is the critic's value at target `t`'s loss row, which a pack
//! evaluates under that target's own live prefix (the context the token was
//! sampled from, not the compacted transcript).
//!
//! [`GaeMode`] (`γ` = `gamma`, `λ` = the [`Lambda`]):
//!
//! - **Exact**: `δ_t = r_t + γ V_{t+1} − V_t` with `V_n = 0`, and
//!   `A_t = Σ_{l≥0} (γλ)^l δ_{t+l}` over the whole rollout, across its
//!   segments: one reverse scan. CompactionRL (arXiv 2607.05378) computes
//!   segments in separate passes and approximates this; a tree pack holds
//!   every segment of a rollout at once, so the exact value is free.
//! - **Segment**: each segment `s` alone, as if the rollout ended at its
//!   last target: `δ` uses the value of the next target of the same segment,
//!   `0` after the segment's last target, whose reward is `R`.
//! - **Compaction**: CompactionRL's eq. 9: the segment advantage of segment
//!   `s` times `(γλ)^{N>s}`, `N>s` = the rollout's targets in segments after
//!   `s`.
//!
//! In every mode the returns are `A + V`. [`Lambda::Adaptive`] is VAPO's
//! length-adaptive `λ = 1 − 1/(α·n)`, with `n` read as the rollout's number
//! of targets (the paper's "response length"), clamped to `[0, 1]`.
//!
//! [`grpo_advantages`]: `(R − mean_g) / (std_g + ε)` over the rollouts of a
//! group `g` (population std), or `R − mean_g` unscaled.

use std::collections::HashMap;

use crate::{Error, Result};

/// The `λ` of GAE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lambda {
    /// One `λ` in `[0, 1]` for every rollout.
    Fixed(f64),
    /// VAPO's length-adaptive `λ = 1 − 1/(α·n)` per rollout, `n` its number
    /// of targets, clamped to `[0, 1]`; `α > 0` (VAPO uses 1.5).
    Adaptive {
        /// `α`.
        alpha: f64,
    },
}

/// How GAE treats a rollout's segments (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GaeMode {
    /// One reverse scan over the whole rollout, across segments.
    Exact,
    /// Each segment alone, ending with the rollout's reward.
    Segment,
    /// [`GaeMode::Segment`] discounted by `(γλ)^{N>s}` (CompactionRL eq. 9).
    Compaction,
}

impl GaeMode {
    /// `"exact"`, `"segment"` or `"compaction"`.
    pub fn name(self) -> &'static str {
        match self {
            GaeMode::Exact => "exact",
            GaeMode::Segment => "segment",
            GaeMode::Compaction => "compaction",
        }
    }

    /// The mode of a name of [`GaeMode::name`].
    pub fn parse(name: &str) -> Result<GaeMode> {
        match name {
            "exact" => Ok(GaeMode::Exact),
            "segment" => Ok(GaeMode::Segment),
            "compaction" => Ok(GaeMode::Compaction),
            other => Err(Error::Usage(format!(
                "GAE mode {other:?}: expected \"exact\", \"segment\" or \"compaction\""
            ))),
        }
    }
}

/// The parameters of GAE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gae {
    /// The discount `γ`, in `[0, 1]`.
    pub gamma: f64,
    /// The trace parameter `λ`.
    pub lambda: Lambda,
    /// How segments are treated.
    pub mode: GaeMode,
}

/// The targets of a pack in generation order: for each, its rollout (any
/// key; a rollout's targets must be one contiguous run) and its segment
/// within the rollout (non-decreasing along the run), as a pack's loss
/// entries give them ([`crate::pack::LossEntry`]).
#[derive(Clone, Copy, Debug)]
pub struct Targets<'a> {
    /// The rollout of each target.
    pub rollout: &'a [u32],
    /// The segment of each target within its rollout.
    pub segment: &'a [u32],
}

impl Targets<'_> {
    /// Number of targets.
    pub fn len(&self) -> usize {
        self.rollout.len()
    }

    /// True when there are no targets.
    pub fn is_empty(&self) -> bool {
        self.rollout.is_empty()
    }

    /// The rollouts' runs `[start, end)`, checked: equal lengths, each
    /// rollout one contiguous run, segments non-decreasing inside it.
    fn runs(&self) -> Result<Vec<(usize, usize)>> {
        if self.segment.len() != self.rollout.len() {
            return Err(Error::Shape(format!(
                "{} segments for {} targets",
                self.segment.len(),
                self.rollout.len()
            )));
        }
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut seen: HashMap<u32, usize> = HashMap::new();
        for t in 0..self.len() {
            let r = self.rollout[t];
            if t > 0 && self.rollout[t - 1] == r {
                if self.segment[t] < self.segment[t - 1] {
                    return Err(Error::Pack(format!(
                        "target {t}: segment {} after segment {} of rollout {r}: targets must be in generation order",
                        self.segment[t],
                        self.segment[t - 1]
                    )));
                }
                runs.last_mut().expect("a run is open").1 = t + 1;
                continue;
            }
            if let Some(first) = seen.insert(r, t) {
                return Err(Error::Pack(format!(
                    "target {t}: rollout {r} again after other rollouts (its targets start at {first}): a rollout's targets must be contiguous"
                )));
            }
            runs.push((t, t + 1));
        }
        Ok(runs)
    }
}

/// Advantages and returns, one each per target.
#[derive(Clone, Debug, PartialEq)]
pub struct Advantages {
    /// `A_t`.
    pub advantages: Vec<f64>,
    /// `A_t + V_t`.
    pub returns: Vec<f64>,
}

fn finite(what: &str, x: &[f64]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: what.into(),
            index,
        }),
        None => Ok(()),
    }
}

impl Gae {
    fn check(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.gamma) {
            return Err(Error::Usage(format!(
                "gamma = {}: the discount must be in [0, 1]",
                self.gamma
            )));
        }
        match self.lambda {
            Lambda::Fixed(l) if !(0.0..=1.0).contains(&l) => Err(Error::Usage(format!(
                "lam = {l}: GAE's lambda must be in [0, 1]"
            ))),
            Lambda::Adaptive { alpha } if !(alpha.is_finite() && alpha > 0.0) => Err(Error::Usage(
                format!("alpha = {alpha}: the adaptive lambda's alpha must be positive and finite"),
            )),
            _ => Ok(()),
        }
    }

    /// `λ` for a rollout of `n` targets.
    pub fn lambda_for(&self, n: usize) -> f64 {
        match self.lambda {
            Lambda::Fixed(l) => l,
            Lambda::Adaptive { alpha } => (1.0 - 1.0 / (alpha * n as f64)).clamp(0.0, 1.0),
        }
    }

    /// Advantages and returns of `targets` from the critic's `values` (one
    /// per target) and `rewards` (one per target: the reward of its
    /// rollout, the same for all of that rollout's targets).
    ///
    /// Errors: lengths that differ ([`Error::Shape`]), a rollout whose
    /// targets are not contiguous or whose segments decrease, rewards that
    /// differ inside a rollout ([`Error::Pack`]), a value or reward that is
    /// not finite ([`Error::NonFinite`]: a NaN reward is a rollout without
    /// one), `γ` or `λ` outside `[0, 1]` ([`Error::Usage`]).
    pub fn compute(&self, targets: Targets, values: &[f64], rewards: &[f64]) -> Result<Advantages> {
        self.check()?;
        for (what, n) in [("values", values.len()), ("rewards", rewards.len())] {
            if n != targets.len() {
                return Err(Error::Shape(format!(
                    "{n} {what} for {} targets",
                    targets.len()
                )));
            }
        }
        finite("value", values)?;
        finite("reward (a rollout without a reward?)", rewards)?;
        let runs = targets.runs()?;
        let mut adv = vec![0.0; values.len()];
        for &(a, b) in &runs {
            let reward = rewards[a];
            if let Some(t) = (a..b).find(|&t| rewards[t] != reward) {
                return Err(Error::Pack(format!(
                    "target {t}: reward {} but {reward} at target {a} of the same rollout {}",
                    rewards[t], targets.rollout[a]
                )));
            }
            let gl = self.gamma * self.lambda_for(b - a);
            match self.mode {
                GaeMode::Exact => self.scan(&values[a..b], reward, gl, &mut adv[a..b]),
                GaeMode::Segment | GaeMode::Compaction => {
                    let mut s0 = a;
                    while s0 < b {
                        let seg = targets.segment[s0];
                        let s1 = (s0..b).find(|&t| targets.segment[t] != seg).unwrap_or(b);
                        self.scan(&values[s0..s1], reward, gl, &mut adv[s0..s1]);
                        if self.mode == GaeMode::Compaction {
                            // (γλ)^{N>s}: N>s targets in the later segments.
                            let discount = gl.powf((b - s1) as f64);
                            adv[s0..s1].iter_mut().for_each(|x| *x *= discount);
                        }
                        s0 = s1;
                    }
                }
            }
        }
        let returns = adv.iter().zip(values).map(|(a, v)| a + v).collect();
        Ok(Advantages {
            advantages: adv,
            returns,
        })
    }

    /// One reverse GAE scan over a run of targets that ends with `reward`
    /// and a terminal value of 0.
    fn scan(&self, values: &[f64], reward: f64, gl: f64, out: &mut [f64]) {
        let n = values.len();
        let (mut next_value, mut acc) = (0.0, 0.0);
        for t in (0..n).rev() {
            let r = if t == n - 1 { reward } else { 0.0 };
            let delta = r + self.gamma * next_value - values[t];
            acc = delta + gl * acc;
            out[t] = acc;
            next_value = values[t];
        }
    }
}

/// How GRPO scales a rollout's centred reward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GrpoScale {
    /// `(R − mean) / (std + ε)`, population std of the group.
    Std {
        /// `ε ≥ 0`.
        eps: f64,
    },
    /// `R − mean` (Dr. GRPO's unscaled form).
    None,
}

/// GRPO advantages, one per rollout: rollout `i` has reward `rewards[i]`
/// and is in group `groups[i]` (any key). Mean and population std are over
/// the rollouts of a group, two-pass in f64. A group whose rewards are all
/// equal (a group of one included) has no learning signal: its advantages
/// are exactly 0, never NaN, also with `ε = 0`.
///
/// Errors: lengths that differ, a reward that is not finite, `ε` negative or
/// not finite.
pub fn grpo_advantages(rewards: &[f64], groups: &[u32], scale: GrpoScale) -> Result<Vec<f64>> {
    if rewards.len() != groups.len() {
        return Err(Error::Shape(format!(
            "{} rewards for {} groups",
            rewards.len(),
            groups.len()
        )));
    }
    if let GrpoScale::Std { eps } = scale {
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::Usage(format!(
                "eps = {eps}: must be finite and non-negative"
            )));
        }
    }
    finite("reward (a rollout without a reward?)", rewards)?;
    // Per group: count, sum, then the sum of squared deviations, min, max.
    let mut stats: HashMap<u32, (usize, f64, f64, f64, f64)> = HashMap::new();
    for (&r, &g) in rewards.iter().zip(groups) {
        let s = stats
            .entry(g)
            .or_insert((0, 0.0, 0.0, f64::INFINITY, f64::NEG_INFINITY));
        s.0 += 1;
        s.1 += r;
        s.3 = s.3.min(r);
        s.4 = s.4.max(r);
    }
    for (&r, &g) in rewards.iter().zip(groups) {
        let s = stats.get_mut(&g).expect("counted above");
        let d = r - s.1 / s.0 as f64;
        s.2 += d * d;
    }
    Ok(rewards
        .iter()
        .zip(groups)
        .map(|(&r, g)| {
            let (n, sum, ss, lo, hi) = stats[g];
            if lo == hi {
                return 0.0;
            }
            let centred = r - sum / n as f64;
            match scale {
                GrpoScale::Std { eps } => centred / ((ss / n as f64).sqrt() + eps),
                GrpoScale::None => centred,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GAE by its definition: A_t = Σ_l (γλ)^l δ_{t+l} over `values`,
    /// reward at the end, terminal value 0 (quadratic, independent of the
    /// scan).
    fn by_definition(values: &[f64], reward: f64, gamma: f64, lam: f64) -> Vec<f64> {
        let n = values.len();
        let delta: Vec<f64> = (0..n)
            .map(|t| {
                let r = if t == n - 1 { reward } else { 0.0 };
                let next = if t + 1 < n { values[t + 1] } else { 0.0 };
                r + gamma * next - values[t]
            })
            .collect();
        (0..n)
            .map(|t| {
                (t..n)
                    .map(|u| (gamma * lam).powi((u - t) as i32) * delta[u])
                    .sum()
            })
            .collect()
    }

    fn close(a: &[f64], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{i}: {x} vs {y}");
        }
    }

    fn gae(gamma: f64, lam: f64, mode: GaeMode) -> Gae {
        Gae {
            gamma,
            lambda: Lambda::Fixed(lam),
            mode,
        }
    }

    /// Two rollouts: the first with segments 0,0,0 | 1,1 | 2 (two
    /// compactions), the second with one segment.
    fn example() -> (Vec<u32>, Vec<u32>, Vec<f64>, Vec<f64>) {
        let rollout = vec![4, 4, 4, 4, 4, 4, 9, 9];
        let segment = vec![0, 0, 0, 1, 1, 2, 0, 0];
        let values = vec![0.5, -0.25, 0.75, 0.125, 1.5, -1.0, 0.3, 0.2];
        let rewards = vec![2.0, 2.0, 2.0, 2.0, 2.0, 2.0, -1.0, -1.0];
        (rollout, segment, values, rewards)
    }

    #[test]
    fn exact_is_gae_by_definition_across_segments() {
        let (rollout, segment, values, rewards) = example();
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let (g, l) = (0.97, 0.9);
        let got = gae(g, l, GaeMode::Exact)
            .compute(t, &values, &rewards)
            .unwrap();
        let mut want = by_definition(&values[..6], 2.0, g, l);
        want.extend(by_definition(&values[6..], -1.0, g, l));
        close(&got.advantages, &want, 1e-14);
        let ret: Vec<f64> = want.iter().zip(&values).map(|(a, v)| a + v).collect();
        close(&got.returns, &ret, 1e-14);
    }

    #[test]
    fn compaction_is_eq_9_by_hand() {
        // Rollout 4: segments of 3, 2 and 1 targets; γλ = 0.5, γ = 1.
        let (rollout, segment, values, rewards) = example();
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let got = gae(1.0, 0.5, GaeMode::Compaction)
            .compute(t, &values, &rewards)
            .unwrap();
        // Segment 2 (one target, N>2 = 0): δ = 2 − (−1) = 3.
        // Segment 1 (N>1 = 1): t4: δ = 2 − 1.5 = 0.5 → A = 0.5;
        //   t3: δ = 1.5 − 0.125 = 1.375 → A = 1.375 + 0.5·0.5 = 1.625; × 0.5.
        // Segment 0 (N>0 = 3): t2: δ = 2 − 0.75 = 1.25; t1: δ = 0.75 + 0.25
        //   = 1.0 → A = 1.0 + 0.625 = 1.625; t0: δ = −0.25 − 0.5 = −0.75
        //   → A = −0.75 + 0.8125 = 0.0625; × 0.5³.
        let want = [
            0.0625 * 0.125,
            1.625 * 0.125,
            1.25 * 0.125,
            1.625 * 0.5,
            0.5 * 0.5,
            3.0,
        ];
        close(&got.advantages[..6], &want, 1e-15);
        // Rollout 9 has one segment: all three modes agree there.
        let exact = gae(1.0, 0.5, GaeMode::Exact)
            .compute(t, &values, &rewards)
            .unwrap();
        close(&got.advantages[6..], &exact.advantages[6..], 0.0);
    }

    #[test]
    fn segment_is_each_segment_alone_and_one_segment_agrees_everywhere() {
        let (rollout, segment, values, rewards) = example();
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let (g, l) = (0.99, 0.95);
        let got = gae(g, l, GaeMode::Segment)
            .compute(t, &values, &rewards)
            .unwrap();
        let mut want = by_definition(&values[..3], 2.0, g, l);
        want.extend(by_definition(&values[3..5], 2.0, g, l));
        want.extend(by_definition(&values[5..6], 2.0, g, l));
        want.extend(by_definition(&values[6..], -1.0, g, l));
        close(&got.advantages, &want, 1e-14);
        let one = vec![0; rollout.len()];
        let t1 = Targets {
            rollout: &rollout,
            segment: &one,
        };
        let modes = [GaeMode::Exact, GaeMode::Segment, GaeMode::Compaction];
        let all: Vec<Advantages> = modes
            .iter()
            .map(|&m| gae(g, l, m).compute(t1, &values, &rewards).unwrap())
            .collect();
        assert_eq!(all[0], all[1]);
        assert_eq!(all[0], all[2]);
    }

    #[test]
    fn adaptive_lambda_is_per_rollout_length() {
        let g = Gae {
            gamma: 1.0,
            lambda: Lambda::Adaptive { alpha: 1.5 },
            mode: GaeMode::Exact,
        };
        assert_eq!(g.lambda_for(6), 1.0 - 1.0 / 9.0);
        assert_eq!(g.lambda_for(0), 0.0);
        let (rollout, segment, values, rewards) = example();
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let got = g.compute(t, &values, &rewards).unwrap();
        close(
            &got.advantages[..6],
            &by_definition(&values[..6], 2.0, 1.0, 1.0 - 1.0 / 9.0),
            1e-14,
        );
        close(
            &got.advantages[6..],
            &by_definition(&values[6..], -1.0, 1.0, 1.0 - 1.0 / 3.0),
            1e-14,
        );
    }

    #[test]
    fn bad_input_is_an_error() {
        let (rollout, segment, values, rewards) = example();
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let g = gae(1.0, 0.95, GaeMode::Exact);
        assert!(matches!(
            g.compute(t, &values[1..], &rewards),
            Err(Error::Shape(_))
        ));
        let mut nan = rewards.clone();
        nan[6] = f64::NAN;
        nan[7] = f64::NAN;
        assert!(matches!(
            g.compute(t, &values, &nan),
            Err(Error::NonFinite { index: 6, .. })
        ));
        let mut differ = rewards.clone();
        differ[2] = 0.0;
        assert!(matches!(
            g.compute(t, &values, &differ),
            Err(Error::Pack(_))
        ));
        let split = vec![4, 4, 9, 4, 4, 4, 9, 9];
        let t2 = Targets {
            rollout: &split,
            segment: &segment,
        };
        assert!(g.compute(t2, &values, &rewards).is_err());
        let back = vec![0, 1, 0, 1, 1, 2, 0, 0];
        let t3 = Targets {
            rollout: &rollout,
            segment: &back,
        };
        assert!(g.compute(t3, &values, &rewards).is_err());
        assert!(gae(1.5, 0.9, GaeMode::Exact)
            .compute(t, &values, &rewards)
            .is_err());
        assert!(gae(1.0, -0.1, GaeMode::Exact)
            .compute(t, &values, &rewards)
            .is_err());
        let empty = Targets {
            rollout: &[],
            segment: &[],
        };
        let e = g.compute(empty, &[], &[]).unwrap();
        assert!(e.advantages.is_empty() && e.returns.is_empty());
    }

    #[test]
    fn grpo_centres_and_scales_per_group() {
        let rewards = [1.0, 0.0, 1.0, 1.0, 5.0, 0.1, 0.1, 0.1];
        let groups = [0, 0, 0, 0, 7, 3, 3, 3];
        let a = grpo_advantages(&rewards, &groups, GrpoScale::Std { eps: 1e-6 }).unwrap();
        // Group 0: mean 0.75, population std sqrt(0.1875).
        let sd = 0.1875f64.sqrt();
        close(
            &a[..4],
            &[
                0.25 / (sd + 1e-6),
                -0.75 / (sd + 1e-6),
                0.25 / (sd + 1e-6),
                0.25 / (sd + 1e-6),
            ],
            1e-15,
        );
        // A group of one and a group of equal rewards: exactly 0.
        assert_eq!(&a[4..], &[0.0; 4]);
        let a0 = grpo_advantages(&rewards, &groups, GrpoScale::Std { eps: 0.0 }).unwrap();
        assert!(a0.iter().all(|x| x.is_finite()));
        assert_eq!(&a0[4..], &[0.0; 4]);
        let u = grpo_advantages(&rewards, &groups, GrpoScale::None).unwrap();
        close(&u[..4], &[0.25, -0.75, 0.25, 0.25], 1e-15);
        assert!(grpo_advantages(&[1.0, f64::NAN], &[0, 0], GrpoScale::None).is_err());
        assert!(grpo_advantages(&[1.0], &[0, 0], GrpoScale::None).is_err());
        assert!(grpo_advantages(&[1.0], &[0], GrpoScale::Std { eps: -1.0 }).is_err());
    }
}
