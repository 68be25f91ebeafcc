//! Advantages for reinforcement learning on packs: GAE over a rollout's
//! targets (exact across its compactions, per segment, or CompactionRL's
//! discounted segments) and GRPO's group-normalised rewards.
//!
//! The input is a pack's loss entries in their order, which is generation
//! order: sorted by `(rollout, call, offset)`, so the targets of one rollout
//! are one contiguous run, `t = 0 … n−1`. The reward of target `t` is
//! `r_t = ρ_t + [t = n−1]·R`: the per-token reward `ρ_t` (0 without one)
//! plus, at the rollout's last target, its scalar reward `R`. `V_t` is the
//! critic's value at target `t`'s loss row, which a pack evaluates under
//! that target's own live prefix (the context the token was sampled from,
//! not the compacted transcript). After the last target comes `V_n = B`:
//! 0 for a finished rollout, the critic's value after its last token for a
//! truncated one (cut off by a length limit, so its return goes on).
//!
//! [`GaeMode`] (`γ` = `gamma`, `λ` = the [`Lambda`]):
//!
//! - **Exact**: `δ_t = r_t + γ V_{t+1} − V_t` with `V_n = B`, and
//!   `A_t = Σ_{l≥0} (γλ)^l δ_{t+l}` over the whole rollout, across its
//!   segments: one reverse scan. CompactionRL (arXiv 2607.05378) computes
//!   segments in separate passes and approximates this; a tree pack holds
//!   every segment of a rollout at once, so the exact value is free.
//! - **Segment**: each segment `s` alone, as if the rollout ended at its
//!   last target: `δ` uses the value of the next target of the same
//!   segment, `B` after the segment's last target, whose reward is
//!   `ρ_t + R`.
//! - **Compaction**: CompactionRL's eq. 9: the segment advantage of segment
//!   `s` times `(γλ)^{N>s}`, `N>s` = the rollout's targets in segments after
//!   `s`.
//!
//! Segments are what the caller gives ([`Targets::segment`]): a pack's
//! `segment` splits at every junction (a context that does not extend the
//! previous call's sequence); [`summary_segments`] also makes every summary
//! call a segment of its own, as CompactionRL's eq. 9 does.
//!
//! The returns are `A + V`, with `A` computed with the critic's own `λ`
//! when [`Gae::critic_lambda`] is set (VAPO's decoupled GAE: the returns
//! with `λ_critic`, the advantages with `λ`). [`Lambda::Adaptive`] is
//! VAPO's length-adaptive `λ = 1 − 1/(α·n)`, with `n` read as the rollout's
//! number of targets (the paper's "response length"), clamped to `[0, 1]`.
//!
//! [`grpo_advantages`]: `(R − mean_g) / (std_g + ε)` over the rollouts of a
//! group `g` (sample, population or batch std, [`GrpoStd`]), or `R − mean_g`
//! unscaled; a group of one has mean 0 and std 1, as in verl.

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

impl Lambda {
    /// `λ` for a rollout of `n` targets.
    pub fn for_len(self, n: usize) -> f64 {
        match self {
            Lambda::Fixed(l) => l,
            Lambda::Adaptive { alpha } => (1.0 - 1.0 / (alpha * n as f64)).clamp(0.0, 1.0),
        }
    }

    fn check(self, name: &str) -> Result<()> {
        match self {
            Lambda::Fixed(l) if !(0.0..=1.0).contains(&l) => Err(Error::Usage(format!(
                "{name} = {l}: GAE's lambda must be in [0, 1]"
            ))),
            Lambda::Adaptive { alpha } if !(alpha.is_finite() && alpha > 0.0) => Err(Error::Usage(
                format!("alpha = {alpha}: the adaptive lambda's alpha must be positive and finite"),
            )),
            _ => Ok(()),
        }
    }
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
    /// The trace parameter `λ` of the advantages.
    pub lambda: Lambda,
    /// The `λ` of the returns (the critic's targets); `None`: `lambda`.
    pub critic_lambda: Option<Lambda>,
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

/// CompactionRL's segments (eq. 9): the junction segments of `targets`
/// with, in addition, every summary call a segment of its own. `call` is
/// each target's call (non-decreasing within a rollout), `summary` whether
/// that call writes a summary (the same for all targets of a call). A new
/// segment starts at a target whose junction segment differs from the
/// previous target's, or whose call differs from the previous target's
/// when either of the two calls is a summary call. Returns the segment of
/// each target, numbered from 0 in each rollout.
///
/// A compaction in which the harness appends its summary request to the
/// running transcript makes the summary call extend the previous call (no
/// junction) and the call after it a junction, so junctions alone put the
/// summary call in the segment before it: `K` such compactions give `K + 1`
/// junction segments and `2K + 1` here.
///
/// Errors: lengths that differ ([`Error::Shape`]), a rollout whose targets
/// are not contiguous, whose segments or calls decrease, or a call whose
/// targets disagree on `summary` ([`Error::Pack`]).
pub fn summary_segments(targets: Targets, call: &[u32], summary: &[bool]) -> Result<Vec<u32>> {
    for (what, n) in [("calls", call.len()), ("summary flags", summary.len())] {
        if n != targets.len() {
            return Err(Error::Shape(format!(
                "{n} {what} for {} targets",
                targets.len()
            )));
        }
    }
    let runs = targets.runs()?;
    let mut out = vec![0u32; targets.len()];
    for (a, b) in runs {
        let mut seg = 0u32;
        for t in a + 1..b {
            if call[t] < call[t - 1] {
                return Err(Error::Pack(format!(
                    "target {t}: call {} after call {} of rollout {}: targets must be in generation order",
                    call[t],
                    call[t - 1],
                    targets.rollout[t]
                )));
            }
            let new_call = call[t] != call[t - 1];
            if !new_call && summary[t] != summary[t - 1] {
                return Err(Error::Pack(format!(
                    "target {t}: call {} of rollout {} is a summary call for some of its targets only",
                    call[t], targets.rollout[t]
                )));
            }
            if targets.segment[t] != targets.segment[t - 1]
                || (new_call && (summary[t] || summary[t - 1]))
            {
                seg += 1;
            }
            out[t] = seg;
        }
    }
    Ok(out)
}

/// The rewards of the targets, one entry per target (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct Rewards<'a> {
    /// `R`, the rollout's scalar reward (the same for all of its targets),
    /// added at its last target (at each segment's last target in the
    /// segment modes).
    pub outcome: &'a [f64],
    /// `ρ_t`, per-token rewards, each at its own target; `None`: all 0.
    pub token: Option<&'a [f64]>,
    /// `B`, the value after the rollout's last target (the same for all of
    /// its targets): 0 for a finished rollout; `None`: all 0.
    pub bootstrap: Option<&'a [f64]>,
}

/// Advantages and returns, one each per target.
#[derive(Clone, Debug, PartialEq)]
pub struct Advantages {
    /// `A_t`.
    pub advantages: Vec<f64>,
    /// `A_t + V_t`, `A` with the critic's `λ`.
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

/// Checks that `x` is the same for all targets of each run.
fn per_rollout(what: &str, x: &[f64], runs: &[(usize, usize)], rollout: &[u32]) -> Result<()> {
    for &(a, b) in runs {
        if let Some(t) = (a..b).find(|&t| x[t] != x[a]) {
            return Err(Error::Pack(format!(
                "target {t}: {what} {} but {} at target {a} of the same rollout {}",
                x[t], x[a], rollout[a]
            )));
        }
    }
    Ok(())
}

impl Gae {
    fn check(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.gamma) {
            return Err(Error::Usage(format!(
                "gamma = {}: the discount must be in [0, 1]",
                self.gamma
            )));
        }
        self.lambda.check("lam")?;
        if let Some(l) = self.critic_lambda {
            l.check("critic_lam")?;
        }
        Ok(())
    }

    /// `λ` of the advantages for a rollout of `n` targets.
    pub fn lambda_for(&self, n: usize) -> f64 {
        self.lambda.for_len(n)
    }

    /// Advantages and returns of `targets` from the critic's `values` (one
    /// per target) and the `rewards`.
    ///
    /// Errors: lengths that differ ([`Error::Shape`]), a rollout whose
    /// targets are not contiguous or whose segments decrease, an outcome
    /// reward or bootstrap value that differs inside a rollout
    /// ([`Error::Pack`]), a value or reward that is not finite
    /// ([`Error::NonFinite`]: a NaN reward is a rollout without one), `γ`
    /// or a `λ` outside `[0, 1]` ([`Error::Usage`]).
    pub fn compute(
        &self,
        targets: Targets,
        values: &[f64],
        rewards: Rewards,
    ) -> Result<Advantages> {
        self.check()?;
        let lens = [
            ("values", Some(values.len())),
            ("rewards", Some(rewards.outcome.len())),
            ("token rewards", rewards.token.map(<[f64]>::len)),
            ("bootstrap values", rewards.bootstrap.map(<[f64]>::len)),
        ];
        for (what, n) in lens {
            if let Some(n) = n.filter(|&n| n != targets.len()) {
                return Err(Error::Shape(format!(
                    "{n} {what} for {} targets",
                    targets.len()
                )));
            }
        }
        finite("value", values)?;
        finite("reward (a rollout without a reward?)", rewards.outcome)?;
        finite("token reward", rewards.token.unwrap_or(&[]))?;
        finite("bootstrap value", rewards.bootstrap.unwrap_or(&[]))?;
        let runs = targets.runs()?;
        per_rollout("reward", rewards.outcome, &runs, targets.rollout)?;
        if let Some(b) = rewards.bootstrap {
            per_rollout("bootstrap value", b, &runs, targets.rollout)?;
        }
        let advantages = self.pass(self.lambda, targets, &runs, values, rewards);
        let critic = match self.critic_lambda {
            Some(l) if l != self.lambda => self.pass(l, targets, &runs, values, rewards),
            _ => advantages.clone(),
        };
        let returns = critic.iter().zip(values).map(|(a, v)| a + v).collect();
        Ok(Advantages {
            advantages,
            returns,
        })
    }

    /// The advantages with trace parameter `lambda`.
    fn pass(
        &self,
        lambda: Lambda,
        targets: Targets,
        runs: &[(usize, usize)],
        values: &[f64],
        rewards: Rewards,
    ) -> Vec<f64> {
        let mut adv = vec![0.0; values.len()];
        for &(a, b) in runs {
            let gl = self.gamma * lambda.for_len(b - a);
            let outcome = rewards.outcome[a];
            let boot = rewards.bootstrap.map_or(0.0, |x| x[a]);
            let scan = |s0: usize, s1: usize, out: &mut [f64]| {
                let token = rewards.token.map(|x| &x[s0..s1]);
                self.scan(&values[s0..s1], token, outcome, boot, gl, out)
            };
            match self.mode {
                GaeMode::Exact => scan(a, b, &mut adv[a..b]),
                GaeMode::Segment | GaeMode::Compaction => {
                    let mut s0 = a;
                    while s0 < b {
                        let seg = targets.segment[s0];
                        let s1 = (s0..b).find(|&t| targets.segment[t] != seg).unwrap_or(b);
                        scan(s0, s1, &mut adv[s0..s1]);
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
        adv
    }

    /// One reverse GAE scan over a run of targets: per-token rewards
    /// `token` (or 0), `outcome` added at the last target, `boot` the value
    /// after it.
    fn scan(
        &self,
        values: &[f64],
        token: Option<&[f64]>,
        outcome: f64,
        boot: f64,
        gl: f64,
        out: &mut [f64],
    ) {
        let n = values.len();
        let (mut next_value, mut acc) = (boot, 0.0);
        for t in (0..n).rev() {
            let r = token.map_or(0.0, |x| x[t]) + if t == n - 1 { outcome } else { 0.0 };
            let delta = r + self.gamma * next_value - values[t];
            acc = delta + gl * acc;
            out[t] = acc;
            next_value = values[t];
        }
    }
}

/// Which standard deviation GRPO divides by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrpoStd {
    /// The group's sample std, `sqrt(Σ (R − mean)² / (G − 1))` (Bessel's
    /// correction: `torch.std`, as verl, TRL and OpenRLHF).
    Sample,
    /// The group's population std, `sqrt(Σ (R − mean)² / G)`:
    /// `sqrt((G − 1)/G)` times the sample std.
    Population,
    /// The sample std of all rewards of the batch, every group together
    /// (TRL's `scale_rewards="batch"`); 1 for a batch of one rollout.
    Batch,
}

impl GrpoStd {
    /// `"sample"`, `"population"` or `"batch"`.
    pub fn name(self) -> &'static str {
        match self {
            GrpoStd::Sample => "sample",
            GrpoStd::Population => "population",
            GrpoStd::Batch => "batch",
        }
    }

    /// The std of a name of [`GrpoStd::name`].
    pub fn parse(name: &str) -> Result<GrpoStd> {
        match name {
            "sample" => Ok(GrpoStd::Sample),
            "population" => Ok(GrpoStd::Population),
            "batch" => Ok(GrpoStd::Batch),
            other => Err(Error::Usage(format!(
                "std {other:?}: expected \"sample\", \"population\" or \"batch\""
            ))),
        }
    }
}

/// How GRPO scales a rollout's centred reward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GrpoScale {
    /// `(R − mean) / (std + ε)`.
    Std {
        /// `ε ≥ 0`.
        eps: f64,
        /// Which std.
        std: GrpoStd,
    },
    /// `R − mean` (Dr. GRPO's unscaled form).
    None,
}

/// GRPO advantages, one per rollout: rollout `i` has reward `rewards[i]`
/// and is in group `groups[i]` (any key). Mean and std are over the
/// rollouts of a group, two-pass in f64.
///
/// As verl (`compute_grpo_outcome_advantage`): a group of one has mean 0
/// and std 1, so its advantage is `R / (1 + ε)` (`R` unscaled) — with
/// [`GrpoStd::Batch`] its std is the batch's like every other rollout's. A
/// group of two or more whose rewards are all equal has no learning signal:
/// its advantages are exactly 0 (verl computes `0 / ε` up to the rounding
/// of its mean). An advantage whose divisor `std + ε` is 0 is 0: never NaN
/// or infinite, also with `ε = 0`.
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
    if let GrpoScale::Std { eps, .. } = scale {
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
    let batch_std = match scale {
        GrpoScale::Std {
            std: GrpoStd::Batch,
            ..
        } if rewards.len() >= 2 => {
            let n = rewards.len() as f64;
            let mean = rewards.iter().sum::<f64>() / n;
            (rewards.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>() / (n - 1.0)).sqrt()
        }
        _ => 1.0,
    };
    Ok(rewards
        .iter()
        .zip(groups)
        .map(|(&r, g)| {
            let (n, sum, ss, lo, hi) = stats[g];
            if n >= 2 && lo == hi {
                return 0.0;
            }
            let mean = if n == 1 { 0.0 } else { sum / n as f64 };
            let centred = r - mean;
            let GrpoScale::Std { eps, std } = scale else {
                return centred;
            };
            let sd = match std {
                GrpoStd::Batch => batch_std,
                _ if n == 1 => 1.0,
                GrpoStd::Sample => (ss / (n - 1) as f64).sqrt(),
                GrpoStd::Population => (ss / n as f64).sqrt(),
            };
            if sd + eps == 0.0 {
                0.0
            } else {
                centred / (sd + eps)
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GAE by its definition: A_t = Σ_l (γλ)^l δ_{t+l} over `values`, the
    /// per-token rewards `token` (or 0), `reward` added at the end, `boot`
    /// the value after the last target (quadratic, independent of the scan).
    fn by_definition(
        values: &[f64],
        token: Option<&[f64]>,
        reward: f64,
        boot: f64,
        gamma: f64,
        lam: f64,
    ) -> Vec<f64> {
        let n = values.len();
        let delta: Vec<f64> = (0..n)
            .map(|t| {
                let r = token.map_or(0.0, |x| x[t]) + if t == n - 1 { reward } else { 0.0 };
                let next = if t + 1 < n { values[t + 1] } else { boot };
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

    fn plain(values: &[f64], reward: f64, gamma: f64, lam: f64) -> Vec<f64> {
        by_definition(values, None, reward, 0.0, gamma, lam)
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
            critic_lambda: None,
            mode,
        }
    }

    fn outcome(r: &[f64]) -> Rewards<'_> {
        Rewards {
            outcome: r,
            token: None,
            bootstrap: None,
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
            .compute(t, &values, outcome(&rewards))
            .unwrap();
        let mut want = plain(&values[..6], 2.0, g, l);
        want.extend(plain(&values[6..], -1.0, g, l));
        close(&got.advantages, &want, 1e-14);
        let ret: Vec<f64> = want.iter().zip(&values).map(|(a, v)| a + v).collect();
        close(&got.returns, &ret, 1e-14);
    }

    #[test]
    fn token_rewards_and_bootstrap_by_hand_and_by_definition() {
        // One rollout of 3 targets, γ = 1, λ = 0.5: V = 1, 2, 4; ρ = 0.5,
        // 0, −1; R = 3; truncated with B = 10.
        // δ2 = −1 + 3 + 10 − 4 = 8; δ1 = 0 + 4 − 2 = 2; δ0 = 0.5 + 2 − 1 = 1.5.
        // A2 = 8; A1 = 2 + 4 = 6; A0 = 1.5 + 3 = 4.5.
        let (rollout, segment) = ([0u32; 3], [0u32; 3]);
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let values = [1.0, 2.0, 4.0];
        let rw = Rewards {
            outcome: &[3.0; 3],
            token: Some(&[0.5, 0.0, -1.0]),
            bootstrap: Some(&[10.0; 3]),
        };
        let got = gae(1.0, 0.5, GaeMode::Exact)
            .compute(t, &values, rw)
            .unwrap();
        assert_eq!(got.advantages, vec![4.5, 6.0, 8.0]);
        // Negative control: a finished rollout (B = 0) is another answer.
        let finished = Rewards {
            bootstrap: None,
            ..rw
        };
        let f = gae(1.0, 0.5, GaeMode::Exact)
            .compute(t, &values, finished)
            .unwrap();
        assert_eq!(f.advantages[2], -2.0);

        // Random: every mode against the definition on the example's
        // segments, with per-token rewards and a bootstrap value.
        let (rollout, segment, values, rewards) = example();
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let token = [0.1, -0.2, 0.3, 0.0, 0.7, -0.4, 0.25, 0.5];
        let boot = [0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.0, 0.0];
        let rw = Rewards {
            outcome: &rewards,
            token: Some(&token),
            bootstrap: Some(&boot),
        };
        let (g, l) = (0.95, 0.8);
        let exact = gae(g, l, GaeMode::Exact).compute(t, &values, rw).unwrap();
        let mut want = by_definition(&values[..6], Some(&token[..6]), 2.0, 0.9, g, l);
        want.extend(by_definition(
            &values[6..],
            Some(&token[6..]),
            -1.0,
            0.0,
            g,
            l,
        ));
        close(&exact.advantages, &want, 1e-14);
        let seg = gae(g, l, GaeMode::Compaction)
            .compute(t, &values, rw)
            .unwrap();
        let mut want = Vec::new();
        for (a, b) in [(0, 3), (3, 5), (5, 6)] {
            let d = (g * l).powi(6 - b as i32);
            want.extend(
                by_definition(&values[a..b], Some(&token[a..b]), 2.0, 0.9, g, l)
                    .iter()
                    .map(|x| x * d),
            );
        }
        want.extend(by_definition(
            &values[6..],
            Some(&token[6..]),
            -1.0,
            0.0,
            g,
            l,
        ));
        close(&seg.advantages, &want, 1e-14);
    }

    #[test]
    fn critic_lambda_gives_the_returns_and_lambda_the_advantages() {
        let (rollout, segment, values, rewards) = example();
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let mut g = gae(0.99, 0.9, GaeMode::Exact);
        g.critic_lambda = Some(Lambda::Fixed(1.0));
        let got = g.compute(t, &values, outcome(&rewards)).unwrap();
        let mut adv = plain(&values[..6], 2.0, 0.99, 0.9);
        adv.extend(plain(&values[6..], -1.0, 0.99, 0.9));
        close(&got.advantages, &adv, 1e-14);
        // λ = 1: the return is the discounted reward to go, R γ^{n−1−t}.
        let mut ret: Vec<f64> = (0..6).map(|t| 2.0 * 0.99f64.powi(5 - t)).collect();
        ret.extend((0..2).map(|t| -0.99f64.powi(1 - t)));
        close(&got.returns, &ret, 1e-14);
        // Negative control: without it the returns are A + V.
        let same = gae(0.99, 0.9, GaeMode::Exact)
            .compute(t, &values, outcome(&rewards))
            .unwrap();
        assert!((same.returns[0] - ret[0]).abs() > 1e-3);
        g.critic_lambda = Some(Lambda::Fixed(1.5));
        assert!(matches!(
            g.compute(t, &values, outcome(&rewards)),
            Err(Error::Usage(m)) if m.contains("critic_lam")
        ));
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
            .compute(t, &values, outcome(&rewards))
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
            .compute(t, &values, outcome(&rewards))
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
            .compute(t, &values, outcome(&rewards))
            .unwrap();
        let mut want = plain(&values[..3], 2.0, g, l);
        want.extend(plain(&values[3..5], 2.0, g, l));
        want.extend(plain(&values[5..6], 2.0, g, l));
        want.extend(plain(&values[6..], -1.0, g, l));
        close(&got.advantages, &want, 1e-14);
        let one = vec![0; rollout.len()];
        let t1 = Targets {
            rollout: &rollout,
            segment: &one,
        };
        let modes = [GaeMode::Exact, GaeMode::Segment, GaeMode::Compaction];
        let all: Vec<Advantages> = modes
            .iter()
            .map(|&m| {
                gae(g, l, m)
                    .compute(t1, &values, outcome(&rewards))
                    .unwrap()
            })
            .collect();
        assert_eq!(all[0], all[1]);
        assert_eq!(all[0], all[2]);
    }

    #[test]
    fn summary_calls_are_segments_of_their_own() {
        // A compaction rollout as CompactionRL's harness makes it: work
        // calls 0, 1; summary call 2 (extends call 1: no junction); call 3
        // resumes (a junction); ... three compactions, two targets a call.
        // Calls:    0 1 2s | 3 4s | 5 6 7s | 8
        // Junction: 0 0 0  | 1 1  | 2 2 2  | 3   (4 segments)
        // Summary:  0 0 1  | 2 3  | 4 4 5  | 6   (7 segments)
        let calls: [u32; 9] = [0, 1, 2, 3, 4, 5, 6, 7, 8];
        let junction_seg = [0, 0, 0, 1, 1, 2, 2, 2, 3];
        let summary_call = [false, false, true, false, true, false, false, true, false];
        let want_seg = [0, 0, 1, 2, 3, 4, 4, 5, 6];
        let twice = |x: &[u32]| x.iter().flat_map(|&v| [v, v]).collect::<Vec<u32>>();
        let call = twice(&calls);
        let segment = twice(&junction_seg);
        let summary: Vec<bool> = summary_call.iter().flat_map(|&s| [s, s]).collect();
        let rollout = vec![7u32; call.len()];
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let got = summary_segments(t, &call, &summary).unwrap();
        assert_eq!(got, twice(&want_seg));
        assert_eq!(got.iter().max(), Some(&6)); // 3 compactions: 7 segments
                                                // Without summary calls it is the junction split, renumbered.
        let none = vec![false; call.len()];
        assert_eq!(summary_segments(t, &call, &none).unwrap(), segment);
        // Two summary calls in a row are two segments; a summary call as
        // the first call starts the rollout's segment 0.
        let (r2, s2, c2) = ([1u32; 3], [0u32; 3], [0u32, 1, 2]);
        let t2 = Targets {
            rollout: &r2,
            segment: &s2,
        };
        assert_eq!(
            summary_segments(t2, &c2, &[true, true, false]).unwrap(),
            vec![0, 1, 2]
        );
        // Errors: a call that is a summary call for part of its targets,
        // calls out of order, lengths.
        let mut half = summary.clone();
        half[4] = false;
        assert!(matches!(
            summary_segments(t, &call, &half),
            Err(Error::Pack(_))
        ));
        let mut back = call.clone();
        back.swap(0, 3);
        assert!(summary_segments(t, &back, &summary).is_err());
        assert!(matches!(
            summary_segments(t, &call[1..], &summary),
            Err(Error::Shape(_))
        ));
    }

    #[test]
    fn adaptive_lambda_is_per_rollout_length() {
        let g = Gae {
            gamma: 1.0,
            lambda: Lambda::Adaptive { alpha: 1.5 },
            critic_lambda: None,
            mode: GaeMode::Exact,
        };
        assert_eq!(g.lambda_for(6), 1.0 - 1.0 / 9.0);
        assert_eq!(g.lambda_for(0), 0.0);
        let (rollout, segment, values, rewards) = example();
        let t = Targets {
            rollout: &rollout,
            segment: &segment,
        };
        let got = g.compute(t, &values, outcome(&rewards)).unwrap();
        close(
            &got.advantages[..6],
            &plain(&values[..6], 2.0, 1.0, 1.0 - 1.0 / 9.0),
            1e-14,
        );
        close(
            &got.advantages[6..],
            &plain(&values[6..], -1.0, 1.0, 1.0 - 1.0 / 3.0),
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
            g.compute(t, &values[1..], outcome(&rewards)),
            Err(Error::Shape(_))
        ));
        let mut nan = rewards.clone();
        nan[6] = f64::NAN;
        nan[7] = f64::NAN;
        assert!(matches!(
            g.compute(t, &values, outcome(&nan)),
            Err(Error::NonFinite { index: 6, .. })
        ));
        let mut differ = rewards.clone();
        differ[2] = 0.0;
        assert!(matches!(
            g.compute(t, &values, outcome(&differ)),
            Err(Error::Pack(_))
        ));
        let boot = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let rw = Rewards {
            bootstrap: Some(&boot),
            ..outcome(&rewards)
        };
        assert!(
            matches!(g.compute(t, &values, rw), Err(Error::Pack(m)) if m.contains("bootstrap"))
        );
        let rw = Rewards {
            token: Some(&[0.0; 3]),
            ..outcome(&rewards)
        };
        assert!(matches!(g.compute(t, &values, rw), Err(Error::Shape(_))));
        let split = vec![4, 4, 9, 4, 4, 4, 9, 9];
        let t2 = Targets {
            rollout: &split,
            segment: &segment,
        };
        assert!(g.compute(t2, &values, outcome(&rewards)).is_err());
        let back = vec![0, 1, 0, 1, 1, 2, 0, 0];
        let t3 = Targets {
            rollout: &rollout,
            segment: &back,
        };
        assert!(g.compute(t3, &values, outcome(&rewards)).is_err());
        assert!(gae(1.5, 0.9, GaeMode::Exact)
            .compute(t, &values, outcome(&rewards))
            .is_err());
        assert!(gae(1.0, -0.1, GaeMode::Exact)
            .compute(t, &values, outcome(&rewards))
            .is_err());
        let empty = Targets {
            rollout: &[],
            segment: &[],
        };
        let e = g.compute(empty, &[], outcome(&[])).unwrap();
        assert!(e.advantages.is_empty() && e.returns.is_empty());
    }

    fn std_scale(eps: f64, std: GrpoStd) -> GrpoScale {
        GrpoScale::Std { eps, std }
    }

    #[test]
    fn grpo_sample_std_is_torch_std_and_verl_singletons() {
        // G = 2: the sample std is √2 times the population std, so the
        // advantages are 1/√2 of the population ones: ±1/√2 vs ±1.
        let (r, g) = ([1.0, 0.0], [0, 0]);
        let s = grpo_advantages(&r, &g, std_scale(0.0, GrpoStd::Sample)).unwrap();
        let p = grpo_advantages(&r, &g, std_scale(0.0, GrpoStd::Population)).unwrap();
        close(&s, &[0.5f64.sqrt(), -(0.5f64.sqrt())], 1e-15);
        close(&p, &[1.0, -1.0], 1e-15);
        close(&[p[0] / s[0]], &[2f64.sqrt()], 1e-15);

        let rewards = [1.0, 0.0, 1.0, 1.0, 5.0, 0.1, 0.1, 0.1];
        let groups = [0, 0, 0, 0, 7, 3, 3, 3];
        let eps = 1e-6;
        let a = grpo_advantages(&rewards, &groups, std_scale(eps, GrpoStd::Sample)).unwrap();
        // Group 0: mean 0.75, Σ(R − mean)² = 0.75, sample std sqrt(0.25).
        let sd = (0.75f64 / 3.0).sqrt();
        let want: Vec<f64> = [0.25, -0.75, 0.25, 0.25]
            .iter()
            .map(|c| c / (sd + eps))
            .collect();
        close(&a[..4], &want, 1e-15);
        // verl: a group of one has mean 0 and std 1.
        assert_eq!(a[4], 5.0 / (1.0 + eps));
        // Equal rewards: exactly 0.
        assert_eq!(&a[5..], &[0.0; 3]);
        let pop = grpo_advantages(&rewards, &groups, std_scale(eps, GrpoStd::Population)).unwrap();
        let psd = (0.75f64 / 4.0).sqrt();
        close(&pop[..2], &[0.25 / (psd + eps), -0.75 / (psd + eps)], 1e-15);
        assert_eq!(pop[4], 5.0 / (1.0 + eps));
        // ε = 0: finite, the same zeros.
        let a0 = grpo_advantages(&rewards, &groups, std_scale(0.0, GrpoStd::Sample)).unwrap();
        assert!(a0.iter().all(|x| x.is_finite()));
        assert_eq!(&a0[5..], &[0.0; 3]);
        assert_eq!(a0[4], 5.0);
        let u = grpo_advantages(&rewards, &groups, GrpoScale::None).unwrap();
        close(&u[..5], &[0.25, -0.75, 0.25, 0.25, 5.0], 1e-15);
        assert!(grpo_advantages(&[1.0, f64::NAN], &[0, 0], GrpoScale::None).is_err());
        assert!(grpo_advantages(&[1.0], &[0, 0], GrpoScale::None).is_err());
        assert!(grpo_advantages(&[1.0], &[0], std_scale(-1.0, GrpoStd::Sample)).is_err());
    }

    #[test]
    fn grpo_batch_std_is_over_every_reward() {
        let rewards = [1.0, 0.0, 1.0, 1.0, 5.0, 0.1, 0.1, 0.1];
        let groups = [0, 0, 0, 0, 7, 3, 3, 3];
        let n = rewards.len() as f64;
        let mean = rewards.iter().sum::<f64>() / n;
        let sd = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
        let a = grpo_advantages(&rewards, &groups, std_scale(1e-4, GrpoStd::Batch)).unwrap();
        let centred = [0.25, -0.75, 0.25, 0.25, 5.0, 0.0, 0.0, 0.0];
        let want: Vec<f64> = centred.iter().map(|c| c / (sd + 1e-4)).collect();
        close(&a, &want, 1e-15);
        // One rollout: std 1.
        let one = grpo_advantages(&[2.0], &[0], std_scale(0.0, GrpoStd::Batch)).unwrap();
        assert_eq!(one, vec![2.0]);
        // A zero divisor gives 0, not infinity.
        let flat =
            grpo_advantages(&[1.0, 1.0, 1.0], &[0, 0, 1], std_scale(0.0, GrpoStd::Batch)).unwrap();
        assert_eq!(flat, vec![0.0; 3]);
        assert_eq!(GrpoStd::parse("batch").unwrap().name(), "batch");
        assert!(GrpoStd::parse("group").is_err());
    }
}
