//! The main job, `treeattn demo`: pack rollouts with context edits, run the
//! tiny transformer ([`crate::model`]) forward and backward under every
//! serialization, and report cost, exactness, drift and SDCC's KL.
//!
//! Methods, all on the same conditioning tree (one forest of all input
//! rollouts, identical prefixes across rollouts shared):
//!
//! | method | passes | exact |
//! |---|---|---|
//! | trie pack (this crate) | 1 | yes |
//! | branch-replicated pack (the paper's 4D mask) | 1 | yes |
//! | LogitTree | K+1 | yes |
//! | Naive-Full | 1 | no: later tokens see evicted content |
//! | Naive-Compressed | 1 | no: scores on the final transcript only |
//!
//! Figures: tokens processed (a proxy for everything but attention: the MLPs
//! and projections scale with tokens); attention FLOPs counted as
//! FlashAttention does, `4 · head_dim` per visible (query, key) pair per
//! query head per layer, forward only, visible pairs only; wall time of
//! forward + backward (best of `repeats`); the largest `|Δ log-prob|` between
//! the trie pack and LogitTree (rounding level, the model runs in f32); the
//! drift of the naive methods (mean and max `|Δ log-prob|` against the exact
//! log-probs, over the targets each scores); SDCC's forward
//! `KL(teacher ‖ student)` at the diverging targets, teacher = the live row,
//! student = the compressed-stream row, both rows of the trie pack's logits.

use std::fmt;
use std::path::PathBuf;
use std::time::Instant;

use crate::logittree::{compare_entries, run_model, ModelRun};
use crate::model::{Model, ModelConfig};
use treeattn::backend::cpu::Cpu;
use treeattn::backend::{HostSdcc, Rope, SdccArgs};
use treeattn::pack::Pack;
use treeattn::rollout::Rollout;
use treeattn::tree::Tree;
use treeattn::{Error, Result};

/// The bundled sample rollouts (`data/sample.jsonl`), embedded so that the
/// binary runs from any directory.
pub const SAMPLE_JSONL: &str = include_str!("../../data/sample.jsonl");

/// What to run the demo on.
#[derive(Clone, Debug, PartialEq)]
pub struct DemoOptions {
    /// A JSONL file of rollouts (DESIGN §2); `None` for the bundled sample.
    pub input: Option<PathBuf>,
    /// Seed of the model's random weights.
    pub seed: u64,
    /// Rounds of timing (each method once per round, after one warm-up
    /// pass); the best round of each method is reported.
    pub repeats: usize,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            input: None,
            seed: 0,
            repeats: 3,
        }
    }
}

/// Cost of one method.
#[derive(Clone, Debug, PartialEq)]
pub struct MethodReport {
    /// The method's name in the table: `trie pack`, `replicated pack`,
    /// `LogitTree (K+1)`, `Naive-Full` or `Naive-Compressed`.
    pub name: &'static str,
    /// Whether the method scores every target under its exact live view.
    pub exact: bool,
    /// Forward + backward passes (K+1 for LogitTree).
    pub passes: usize,
    /// Tokens processed, summed over passes.
    pub tokens: usize,
    /// Visible (query, key) pairs, summed over passes.
    pub visible_pairs: u64,
    /// `visible_pairs · 4 · head_dim · q_heads · layers` (forward).
    pub attn_flops: f64,
    /// Targets scored.
    pub scored: usize,
    /// Best wall time of forward + backward over all passes, seconds.
    pub seconds: f64,
}

/// Drift of an inexact method against the exact log-probs.
#[derive(Clone, Debug, PartialEq)]
pub struct DriftReport {
    /// `Naive-Full` or `Naive-Compressed`.
    pub name: &'static str,
    /// Targets the method scores (all exact targets for Naive-Full, the
    /// targets present on the final transcript for Naive-Compressed).
    pub compared: usize,
    /// Targets the method does not score at all.
    pub unscored: usize,
    /// Mean `|log p_method − log p_exact|` over the `compared` targets, in
    /// nats (exact = the trie pack).
    pub mean_abs: f64,
    /// Largest `|log p_method − log p_exact|` over the `compared` targets,
    /// in nats.
    pub max_abs: f64,
}

/// SDCC's forward KL at the diverging targets.
#[derive(Clone, Debug, PartialEq)]
pub struct SdccReport {
    /// Diverging targets D (one (student, teacher) pair each).
    pub pairs: usize,
    /// Softmax temperature τ.
    pub temperature: f32,
    /// Mean over the pairs (all weights 1) of
    /// `KL(teacher ‖ student) = Σ_v p_t(v) (log p_t(v) − log p_s(v))` with
    /// `p = softmax(logits / τ)`, in nats; 0 when there are no pairs.
    pub kl_mean: f64,
    /// Largest per-pair KL, in nats; 0 when there are no pairs.
    pub kl_max: f64,
}

/// Everything `treeattn demo` prints (its [`fmt::Display`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// `bundled sample` or the input path.
    pub source: String,
    /// Rollouts read.
    pub rollouts: usize,
    /// Model calls, summed over the rollouts.
    pub calls: usize,
    /// Sampled tokens scored: the trie pack's loss entries.
    pub targets: usize,
    /// Root-to-leaf paths of the forest (LogitTree's passes).
    pub branches: usize,
    /// The model run ([`demo_config`] over the input's distinct token ids).
    pub model: ModelConfig,
    /// Scalars in the model's weights.
    pub parameters: usize,
    /// One report per method: trie pack, replicated pack, LogitTree,
    /// Naive-Full, Naive-Compressed.
    pub methods: Vec<MethodReport>,
    /// Timing rounds ([`DemoOptions::repeats`]).
    pub rounds: usize,
    /// Largest `|Δ log-prob|` between the trie pack and LogitTree.
    pub trie_vs_logittree: f64,
    /// Largest `|Δ log-prob|` between the replicated pack and LogitTree.
    pub replicated_vs_logittree: f64,
    /// Largest `max|Δg| / max|g|` over the parameter tensors, trie vs
    /// LogitTree.
    pub grad_rel_diff: f64,
    /// Drift of Naive-Full, then of Naive-Compressed.
    pub drift: Vec<DriftReport>,
    /// SDCC's KL at the diverging targets of the trie pack.
    pub sdcc: SdccReport,
}

/// The tiny model of the demo for a vocabulary of `vocab` ids: 2 layers,
/// d_model 64, GQA 4 query / 2 kv heads of dim 16, RoPE, SwiGLU 128,
/// untied head.
pub fn demo_config(vocab: usize) -> ModelConfig {
    ModelConfig {
        vocab,
        d_model: 64,
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn_dim: 128,
        rope: Some(Rope {
            base: 10_000.0,
            dims: 16,
        }),
        tied_embeddings: false,
        rms_eps: 1e-6,
    }
}

fn load(opts: &DemoOptions) -> Result<(String, Vec<Rollout>)> {
    let Some(path) = &opts.input else {
        return Ok((
            "bundled sample (data/sample.jsonl)".into(),
            treeattn::rollout::parse_jsonl(SAMPLE_JSONL)?,
        ));
    };
    let name = path.display().to_string();
    let rollouts = treeattn::rollout::read_jsonl_file(path)?;
    if rollouts.is_empty() {
        return Err(treeattn::rollout::no_rollouts_error(path));
    }
    Ok((name, rollouts))
}

/// Re-indexes token ids densely (`ids[i]` becomes `i`) in a pack's tokens and
/// labels: the model's vocabulary is the set of ids that occur, so a 32k- or
/// 150k-id tokenizer does not make the LM head the whole cost.
fn reindex(pack: &Pack, ids: &[u32]) -> Result<Pack> {
    let dense = |t: &mut u32| -> Result<()> {
        *t = ids
            .binary_search(t)
            .map_err(|_| Error::Pack(format!("token {t} of a pack is not a token of its tree")))?
            as u32;
        Ok(())
    };
    let mut p = pack.clone();
    p.tokens.iter_mut().try_for_each(dense)?;
    p.loss.iter_mut().try_for_each(|e| dense(&mut e.label))?;
    Ok(p)
}

/// Most trie tokens the demo takes: it runs a dense model forward and
/// backward over five layouts, LogitTree's K+1 passes among them.
pub const MAX_DEMO_TOKENS: usize = 20_000;

/// Most logits (rows × vocabulary) of the largest pass the demo takes:
/// 2^27 f32 values, 512 MiB per logits buffer (the backward holds a few).
pub const MAX_DEMO_LOGITS: usize = 1 << 27;

/// Refuses, before any model work, a forest the demo cannot run in bounded
/// time and memory: more than [`MAX_DEMO_TOKENS`] trie tokens, or a largest
/// pass (the replicated pack) whose logits exceed [`MAX_DEMO_LOGITS`].
pub fn check_size(source: &str, tree: &Tree, vocab: usize) -> Result<()> {
    let replicated: usize = tree.branches().iter().map(|b| b.len as usize).sum();
    let logits = replicated.saturating_mul(vocab);
    if tree.len() > MAX_DEMO_TOKENS || logits > MAX_DEMO_LOGITS {
        return Err(Error::Unsupported(format!(
            "{source}: {} trie tokens ({replicated} in the replicated pack) over {vocab} distinct \
             token ids, {:.1} GiB of f32 logits in one pass; the demo takes at most {MAX_DEMO_TOKENS} \
             trie tokens and {MAX_DEMO_LOGITS} logits per pass ({} MiB). Run it on a few \
             rollouts, or use `treeattn inspect` / `treeattn pack` on the whole file",
            tree.len(),
            logits as f64 * 4.0 / (1u64 << 30) as f64,
            (MAX_DEMO_LOGITS * 4) >> 20
        )));
    }
    Ok(())
}

/// Runs the demo (see the module docs).
pub fn run(opts: &DemoOptions) -> Result<Report> {
    if opts.repeats == 0 {
        return Err(Error::Usage("repeats must be at least 1".into()));
    }
    let (source, rollouts) = load(opts)?;
    let tree = Tree::build(&rollouts, true)?;
    let mut ids = tree.tokens().to_vec();
    ids.sort_unstable();
    ids.dedup();
    check_size(&source, &tree, ids.len())?;
    let config = demo_config(ids.len());
    let model = Model::<f32>::new(config.clone(), opts.seed)?;
    let pack = |p: Pack| reindex(&p, &ids);
    let trie = pack(tree.trie_pack())?;
    let methods: Vec<(&'static str, bool, Vec<Pack>)> = vec![
        ("trie pack", true, vec![trie.clone()]),
        ("replicated pack", true, vec![pack(tree.replicated_pack())?]),
        (
            "LogitTree (K+1)",
            true,
            tree.logittree_packs()
                .into_iter()
                .map(pack)
                .collect::<Result<_>>()?,
        ),
        ("Naive-Full", false, vec![pack(tree.naive_full_pack())?]),
        (
            "Naive-Compressed",
            false,
            vec![pack(tree.naive_compressed_pack())?],
        ),
    ];

    let flops_per_pair = 4.0 * (config.head_dim * config.q_heads * config.layers) as f64;
    // One untimed warm-up pass (page faults, first thread start-ups), then
    // the methods timed in turn, round after round, so that load from other
    // processes spreads over all of them; the best round counts.
    run_model(&model, &methods[0].2)?;
    let mut best = vec![f64::INFINITY; methods.len()];
    let mut runs: Vec<ModelRun<f32>> = Vec::new();
    for round in 0..opts.repeats {
        for (m, (_, _, packs)) in methods.iter().enumerate() {
            let start = Instant::now();
            let run = run_model(&model, packs)?;
            best[m] = best[m].min(start.elapsed().as_secs_f64());
            if round == 0 {
                runs.push(run);
            }
        }
    }
    let reports: Vec<MethodReport> = methods
        .iter()
        .zip(&runs)
        .zip(&best)
        .map(|(((name, exact, _), run), &seconds)| MethodReport {
            name,
            exact: *exact,
            passes: run.passes,
            tokens: run.tokens,
            visible_pairs: run.visible_pairs,
            attn_flops: run.visible_pairs as f64 * flops_per_pair,
            scored: run.entries.len(),
            seconds,
        })
        .collect();
    let (trie_run, replicated_run, logittree_run) = (&runs[0], &runs[1], &runs[2]);
    let (naive_full, naive_compressed) = (&runs[3], &runs[4]);
    let diff = |a: &ModelRun<f32>, b: &ModelRun<f32>| {
        compare_entries(&a.entries, &a.logprobs, &b.entries, &b.logprobs, 1)
    };
    let trie_vs_lt = diff(trie_run, logittree_run)?;
    let replicated_vs_lt = diff(replicated_run, logittree_run)?;
    if trie_vs_lt.only_first
        + trie_vs_lt.only_second
        + replicated_vs_lt.only_first
        + replicated_vs_lt.only_second
        > 0
    {
        return Err(Error::Pack(
            "the exact layouts do not score the same targets".into(),
        ));
    }
    let mut grad_rel_diff = 0.0f64;
    for ((_, a), (_, b)) in trie_run
        .grads
        .tensors()
        .iter()
        .zip(logittree_run.grads.tensors())
    {
        let scale = a.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
        let d = a
            .iter()
            .zip(b)
            .fold(0.0f64, |m, (x, y)| m.max((x - y).abs() as f64));
        if scale > 0.0 {
            grad_rel_diff = grad_rel_diff.max(d / scale);
        }
    }
    let mut drift = Vec::new();
    for (name, run) in [
        ("Naive-Full", naive_full),
        ("Naive-Compressed", naive_compressed),
    ] {
        let d = diff(trie_run, run)?;
        drift.push(DriftReport {
            name,
            compared: d.compared,
            unscored: d.only_first,
            mean_abs: d.mean_abs,
            max_abs: d.max_abs,
        });
    }

    // SDCC: teacher = live row, student = compressed-stream row, both rows
    // of one trie-pack forward.
    let pairs = tree.sdcc_pairs();
    let temperature = 1.0f32;
    let mut sdcc = SdccReport {
        pairs: pairs.len(),
        temperature,
        kl_mean: 0.0,
        kl_max: 0.0,
    };
    if !pairs.is_empty() {
        let fwd = model.forward_pack(&trie)?;
        let vocab = config.vocab;
        let rows: Vec<u32> = pairs
            .iter()
            .map(|p| p.student_row)
            .chain(pairs.iter().map(|p| p.teacher_row))
            .collect();
        let logits = model.logits(&fwd, &rows)?;
        let (student, teacher) = logits.split_at(pairs.len() * vocab);
        let index: Vec<(u32, u32)> = (0..pairs.len() as u32).map(|i| (i, i)).collect();
        let weights = vec![1.0; pairs.len()];
        let args = SdccArgs::new(student, teacher, vocab, &index, &weights, temperature)?;
        let out = Cpu::default().sdcc_owned(&args)?.loss;
        sdcc.kl_mean = out.loss_mean;
        sdcc.kl_max = out.per_pair.iter().fold(0.0, |m: f64, &v| m.max(v));
    }

    Ok(Report {
        source,
        rollouts: rollouts.len(),
        calls: rollouts.iter().map(|r| r.calls().len()).sum(),
        targets: trie.loss.len(),
        branches: tree.branches().len(),
        parameters: model.params().len(),
        model: config,
        methods: reports,
        rounds: opts.repeats,
        trie_vs_logittree: trie_vs_lt.max_abs,
        replicated_vs_logittree: replicated_vs_lt.max_abs,
        grad_rel_diff,
        drift,
        sdcc,
    })
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.model;
        writeln!(f, "treeattn demo — {}", self.source)?;
        writeln!(
            f,
            "  {} rollouts, {} calls, {} targets; one forest of {} trie tokens, {} branches (LogitTree passes), {} diverging targets",
            self.rollouts,
            self.calls,
            self.targets,
            self.methods[0].tokens,
            self.branches,
            self.sdcc.pairs
        )?;
        writeln!(
            f,
            "  tiny model, f32, random weights: {} layers, d_model {}, {} query / {} kv heads × {}, RoPE {}, SwiGLU {}, vocab {} (the distinct ids of the input, re-indexed), {} parameters",
            m.layers,
            m.d_model,
            m.q_heads,
            m.kv_heads,
            m.head_dim,
            if m.rope.is_some() { "on" } else { "off" },
            m.ffn_dim,
            m.vocab,
            self.parameters
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "  {:<18} {:>5} {:>6} {:>8} {:>12} {:>8} {:>14}",
            "method", "exact", "passes", "tokens", "attn MFLOP", "scored", "fwd+bwd ms"
        )?;
        let base = &self.methods[0];
        for r in &self.methods {
            writeln!(
                f,
                "  {:<18} {:>5} {:>6} {:>8} {:>12.1} {:>8} {:>9.2} {:>4}",
                r.name,
                if r.exact { "yes" } else { "no" },
                r.passes,
                r.tokens,
                r.attn_flops / 1e6,
                r.scored,
                r.seconds * 1e3,
                format!("{:.2}×", r.seconds / base.seconds)
            )?;
        }
        writeln!(
            f,
            "  attention FLOPs = visible (query, key) pairs × 4·head_dim × query heads × layers, forward only; time = best of {} rounds after a warm-up, × = relative to the trie pack",
            self.rounds
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "  exactness: max |Δ log-prob| trie vs LogitTree {:.2e}, replicated vs LogitTree {:.2e} (f32 rounding); max relative gradient difference trie vs LogitTree {:.2e}",
            self.trie_vs_logittree, self.replicated_vs_logittree, self.grad_rel_diff
        )?;
        writeln!(
            f,
            "  train–rollout drift of the naive methods, |Δ log-prob| against the exact log-probs:"
        )?;
        for d in &self.drift {
            writeln!(
                f,
                "    {:<18} mean {:.4}  max {:.4} nats over {} targets{}",
                d.name,
                d.mean_abs,
                d.max_abs,
                d.compared,
                if d.unscored > 0 {
                    format!(" ({} targets not scored at all)", d.unscored)
                } else {
                    String::new()
                }
            )?;
        }
        if self.sdcc.pairs == 0 {
            writeln!(f, "  SDCC: no diverging targets, nothing to distil")
        } else {
            writeln!(
                f,
                "  SDCC forward KL(teacher ‖ student) at the {} diverging targets (teacher = live row, student = compressed-stream row, τ = {}): mean {:.4}, max {:.4} nats",
                self.sdcc.pairs, self.sdcc.temperature, self.sdcc.kl_mean, self.sdcc.kl_max
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paper_scale_rollout_is_refused_up_front() {
        // Issue 17: one 195k-token compaction rollout ran 11+ minutes at
        // 10 GB; now it is an Err before any model work.
        let rs = crate::gen::generate(crate::gen::Shape::Compaction, 0, true).unwrap();
        let path =
            std::env::temp_dir().join(format!("treeattn-demo-big-{}.jsonl", std::process::id()));
        treeattn::rollout::write_jsonl(std::fs::File::create(&path).unwrap(), &rs).unwrap();
        let t = Instant::now();
        let e = run(&DemoOptions {
            input: Some(path.clone()),
            repeats: 1,
            ..DemoOptions::default()
        })
        .unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        let s = e.to_string();
        assert!(
            s.contains("trie tokens") && s.contains(&MAX_DEMO_TOKENS.to_string()),
            "{s}"
        );
        assert!(t.elapsed().as_secs_f64() < 30.0, "refused quickly");
    }

    #[test]
    fn sample_demo_is_exact_and_naive_methods_drift() {
        let report = run(&DemoOptions {
            repeats: 1,
            ..DemoOptions::default()
        })
        .unwrap();
        assert_eq!(report.rollouts, 22);
        assert_eq!(report.methods.len(), 5);
        // f32 log-probs of magnitude ~10: rounding differences stay near
        // 1e-5; a real mismatch (a leaked key) is 1e-2 or more.
        assert!(report.trie_vs_logittree < 1e-4, "{report}");
        assert!(report.replicated_vs_logittree < 1e-4, "{report}");
        assert!(report.grad_rel_diff < 1e-3, "{report}");
        assert!(report.drift.iter().all(|d| d.max_abs > 1e-2), "{report}");
        assert!(
            report.sdcc.pairs > 0 && report.sdcc.kl_max > 0.0,
            "{report}"
        );
        // The trie pack is the smallest exact layout.
        let tokens: Vec<usize> = report.methods.iter().map(|m| m.tokens).collect();
        assert!(
            tokens[0] < tokens[1] && tokens[1] == tokens[2],
            "{tokens:?}"
        );
        let text = report.to_string();
        assert!(
            text.contains("LogitTree (K+1)") && text.contains("SDCC"),
            "{text}"
        );
    }

    #[test]
    fn missing_input_file_is_an_error_naming_it() {
        let err = run(&DemoOptions {
            input: Some("/nonexistent/rollouts.jsonl".into()),
            ..DemoOptions::default()
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/rollouts.jsonl"),
            "{err}"
        );
    }
}
