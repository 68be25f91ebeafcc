//! One packed pass equals LogitTree's K+1 passes, in f64 to a relative 1e-9,
//! over random rollouts with edits from the crate's generators (several per
//! pack, shared prefixes or not), GQA and RoPE on and off:
//!
//! (a) attention: the output row `O[row_e]` of every loss entry, and dQ, dK,
//!     dV of the probe objective `Σ_e ⟨g_e, O[row_e]⟩` — for the trie pack a
//!     node shared by several branches carries the *sum* of its per-branch
//!     gradients — equal between trie pack, replicated pack and LogitTree;
//! (b) the tiny transformer: every per-entry log-prob and every parameter
//!     gradient equal between the same three layouts;
//!
//! and, as negative controls, Naive-Full and Naive-Compressed give other
//! log-probs on trees with an edit.
//!
//! Tolerance: every comparison is `|a − b| <= 1e-9 · max(|a|, |b|, s)`
//! with `s` the largest magnitude in the tensor compared. Exact methods
//! compute the same sums in another order (other tiles, branch
//! contributions added separately), so they differ by f64 rounding,
//! ~1e-15 relative; a leaked or missing key or a dropped branch contribution
//! changes values by 1e-3 or more.

use proptest::prelude::*;
use treeattn::backend::cpu::Cpu;
use treeattn::backend::{AttnParams, AttnShape, Rope};
use treeattn::pack::Pack;
use treeattn::rollout::{Call, Rollout};
use treeattn::tree::Tree;
use treeattn_lab::gen::{self, Rng};
use treeattn_lab::logittree::{compare_entries, run_attention, run_model, AttnInputs};
use treeattn_lab::model::{Model, ModelConfig};

/// `n` values uniform in (−1, 1).
fn values(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| 2.0 * rng.unit() - 1.0).collect()
}

/// Uniform in `0..n`.
fn below(rng: &mut Rng, n: usize) -> usize {
    rng.range(0, n - 1)
}

/// Content tokens are folded into this many ids so that coincident tokens
/// (and so merged trie nodes) are common; marker ids stay as they are.
const CONTENT_IDS: u32 = 60;
const VOCAB_USED: u32 = gen::CONTENT_MIN + CONTENT_IDS;

/// A forest of 1–3 draws from the crate's generators ([`gen`]: compaction,
/// stack pop, fold, memex, 1–3 members of a GRPO group, no-edit, the worked
/// example) at their CPU-sized defaults, tokens folded into the test
/// vocabulary, packed with or without prefix sharing across rollouts.
fn random_tree(rng: &mut Rng) -> Tree {
    let mut rollouts: Vec<Rollout> = Vec::new();
    for _ in 0..1 + below(rng, 3) {
        let shape = gen::Shape::ALL[below(rng, gen::Shape::ALL.len())];
        let generated =
            gen::generate(shape, rng.next_u64(), false).expect("generators produce valid rollouts");
        // A GRPO group holds 16 rollouts; a few members keep the case small.
        let take = 1 + below(rng, 3);
        for r in generated.iter().take(take) {
            rollouts.push(fold_tokens(r, rollouts.len()));
        }
    }
    Tree::build(&rollouts, below(rng, 2) == 0).expect("valid rollouts build a tree")
}

fn fold_tokens(r: &Rollout, index: usize) -> Rollout {
    let fold = |t: &Vec<u32>| -> Vec<u32> {
        t.iter()
            .map(|&x| {
                if x < gen::CONTENT_MIN {
                    x
                } else {
                    gen::CONTENT_MIN + x % CONTENT_IDS
                }
            })
            .collect()
    };
    let calls = r.calls().iter().map(|c| Call {
        context: fold(&c.context),
        completion: fold(&c.completion),
        logprobs: c.logprobs.clone(),
    });
    Rollout::new(format!("{}#{index}", r.id()), calls.collect())
        .expect("folding tokens keeps a rollout valid")
}

/// For every pass of a branch layout, the trie node of each packed row.
/// Checked against the packs' tokens and positions, so a changed branch order
/// fails loudly instead of comparing the wrong rows.
fn branch_nodes(tree: &Tree, packs: &[&Pack]) -> Vec<Vec<u32>> {
    let paths: Vec<Vec<u32>> = tree
        .branches()
        .iter()
        .map(|b| tree.path_to(b.leaf as usize))
        .collect();
    let per_pack: Vec<Vec<u32>> = if packs.len() == 1 {
        vec![paths.concat()]
    } else {
        paths
    };
    for (p, (nodes, pack)) in per_pack.iter().zip(packs).enumerate() {
        let tokens: Vec<u32> = nodes.iter().map(|&n| tree.tokens()[n as usize]).collect();
        let depths: Vec<u32> = nodes.iter().map(|&n| tree.depths()[n as usize]).collect();
        assert_eq!(
            tokens, pack.tokens,
            "pass {p}: branch rows are not the tree's paths"
        );
        assert_eq!(
            depths, pack.position_ids,
            "pass {p}: positions are not depths"
        );
    }
    per_pack
}

fn assert_close(what: &str, a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let s = a.iter().chain(b).fold(0.0f64, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-9 * s.max(x.abs()).max(y.abs()),
            "{what}[{i}]: {x} vs {y} (scale {s})"
        );
    }
}

/// Rows gathered from per-node values: `out[r] = node_values[nodes[r]]`.
fn gather(values: &[f64], nodes: &[u32], width: usize) -> Vec<f64> {
    nodes
        .iter()
        .flat_map(|&n| &values[n as usize * width..(n as usize + 1) * width])
        .copied()
        .collect()
}

/// Per-row gradients summed into their trie nodes.
fn scatter(grads: &[&[f64]], nodes: &[Vec<u32>], n_nodes: usize, width: usize) -> Vec<f64> {
    let mut out = vec![0.0; n_nodes * width];
    for (g, rows) in grads.iter().zip(nodes) {
        for (r, &n) in rows.iter().enumerate() {
            for j in 0..width {
                out[n as usize * width + j] += g[r * width + j];
            }
        }
    }
    out
}

/// A layout's name, its passes, and the trie node of every row of each pass.
type Layout<'a> = (&'a str, Vec<&'a Pack>, Vec<Vec<u32>>);

fn check_attention(seed: u64, q_heads: usize, group: usize, head_dim: usize, rope: bool) {
    let mut rng = Rng::new(seed);
    let tree = random_tree(&mut rng);
    let (trie, replicated, logittree) = (
        tree.trie_pack(),
        tree.replicated_pack(),
        tree.logittree_packs(),
    );
    let kv_heads = q_heads / group;
    let (qw, kw) = (q_heads * head_dim, kv_heads * head_dim);
    let n = tree.len();
    // Inputs live on the trie nodes; every layout gathers its rows from them.
    let (q, k, v) = (
        values(&mut rng, n * qw),
        values(&mut rng, n * kw),
        values(&mut rng, n * kw),
    );
    let cotangent = values(&mut rng, trie.loss.len() * qw);
    let params = AttnParams {
        // All lanes rotated, or only the first half (the rest pass through).
        rope: rope.then_some(Rope {
            base: 10_000.0,
            dims: if below(&mut rng, 2) == 0 {
                head_dim
            } else {
                head_dim / 2
            },
        }),
        ..AttnParams::new(head_dim)
    };

    let identity: Vec<u32> = (0..n as u32).collect();
    let layouts: [Layout; 3] = [
        ("trie", vec![&trie], vec![identity]),
        (
            "replicated",
            vec![&replicated],
            branch_nodes(&tree, &[&replicated]),
        ),
        (
            "logittree",
            logittree.iter().collect(),
            branch_nodes(&tree, &logittree.iter().collect::<Vec<_>>()),
        ),
    ];
    let mut results = Vec::new();
    for (name, packs, nodes) in &layouts {
        let gathered: Vec<[Vec<f64>; 3]> = nodes
            .iter()
            .map(|rows| {
                [
                    gather(&q, rows, qw),
                    gather(&k, rows, kw),
                    gather(&v, rows, kw),
                ]
            })
            .collect();
        let inputs: Vec<AttnInputs<f64>> = gathered
            .iter()
            .zip(packs)
            .map(|([q, k, v], p)| AttnInputs {
                q,
                k,
                v,
                shape: AttnShape {
                    tokens: p.len(),
                    q_heads,
                    kv_heads,
                    head_dim,
                    v_head_dim: head_dim,
                },
            })
            .collect();
        let owned: Vec<Pack> = packs.iter().map(|&p| p.clone()).collect();
        let run = run_attention(&Cpu::default(), &owned, &inputs, &params, &cotangent).unwrap();
        let dq: Vec<&[f64]> = run.grads.iter().map(|g| g.dq.as_slice()).collect();
        let dk: Vec<&[f64]> = run.grads.iter().map(|g| g.dk.as_slice()).collect();
        let dv: Vec<&[f64]> = run.grads.iter().map(|g| g.dv.as_slice()).collect();
        let node_grads = [
            scatter(&dq, nodes, n, qw),
            scatter(&dk, nodes, n, kw),
            scatter(&dv, nodes, n, kw),
        ];
        results.push((*name, run.entries, run.outputs, node_grads));
    }
    let (_, trie_entries, trie_out, trie_grads) = &results[0];
    assert!(trie_out.iter().all(|x| x.is_finite()));
    for (name, entries, out, grads) in &results[1..] {
        let keys = |e: &[treeattn::pack::LossEntry]| e.iter().map(|e| e.key()).collect::<Vec<_>>();
        assert_eq!(keys(trie_entries), keys(entries), "{name}: entry keys");
        assert_close(&format!("{name}: O at loss rows"), trie_out, out);
        for (g, (t, o)) in ["dQ", "dK", "dV"].iter().zip(trie_grads.iter().zip(grads)) {
            assert_close(&format!("{name}: {g} per trie node"), t, o);
        }
    }
}

fn model_config(rng: &mut Rng, rope: bool) -> ModelConfig {
    let kv_heads = [1, 2, 4][below(rng, 3)];
    ModelConfig {
        vocab: VOCAB_USED as usize,
        d_model: 16,
        layers: 1 + below(rng, 2),
        q_heads: 4,
        kv_heads,
        head_dim: 4,
        ffn_dim: 24,
        rope: rope.then_some(Rope {
            base: [100.0, 10_000.0][below(rng, 2)],
            dims: [2, 4][below(rng, 2)],
        }),
        tied_embeddings: below(rng, 2) == 0,
        rms_eps: 1e-6,
    }
}

/// Whether some loss row of the trie pack has, before it in its top-level
/// subtree (one rollout, or one group sharing a prefix), a key it may not
/// see: then a plain causal replay (Naive-Full) gives that row another
/// context.
fn sees_evicted_content(trie: &Pack) -> bool {
    let mut top_start = vec![0usize; trie.len()];
    let mut i = 0;
    while i < trie.len() {
        let end = trie.kv_end[i] as usize;
        top_start[i..end].iter_mut().for_each(|s| *s = i);
        i = end;
    }
    trie.loss.iter().any(|e| {
        let r = e.row as usize;
        (top_start[r]..r).any(|k| trie.kv_end[k] as usize <= r)
    })
}

fn check_model(seed: u64, rope: bool) {
    let mut rng = Rng::new(seed);
    let tree = random_tree(&mut rng);
    let model = Model::<f64>::new(model_config(&mut rng, rope), seed ^ 0xabcd).unwrap();
    let trie = run_model(&model, &[tree.trie_pack()]).unwrap();
    let replicated = run_model(&model, &[tree.replicated_pack()]).unwrap();
    let logittree = run_model(&model, &tree.logittree_packs()).unwrap();
    assert!(trie.logprobs.iter().all(|x| x.is_finite()));
    assert_eq!(logittree.passes, tree.branches().len());
    for (name, other) in [("replicated", &replicated), ("logittree", &logittree)] {
        let keys = |r: &treeattn_lab::logittree::ModelRun<f64>| {
            r.entries.iter().map(|e| e.key()).collect::<Vec<_>>()
        };
        assert_eq!(keys(&trie), keys(other), "{name}: entry keys");
        assert_close(
            &format!("{name}: log-probs"),
            &trie.logprobs,
            &other.logprobs,
        );
        for ((tensor, a), (_, b)) in trie.grads.tensors().iter().zip(other.grads.tensors()) {
            assert_close(&format!("{name}: ∂J/∂{tensor}"), a, b);
        }
    }

    // Negative controls. Naive-Full replays the pre-order tokens causally:
    // an entry whose row comes after a finished sibling subtree (content
    // evicted before its call) sees that content.
    if sees_evicted_content(&tree.trie_pack()) {
        let naive = run_model(&model, &[tree.naive_full_pack()]).unwrap();
        let d = compare_entries(
            &trie.entries,
            &trie.logprobs,
            &naive.entries,
            &naive.logprobs,
            1,
        )
        .unwrap();
        assert_eq!(d.compared, trie.entries.len());
        assert!(
            d.max_abs > 1e-6,
            "naive-full matched the exact log-probs on a tree with an edit: {d:?}"
        );
    }
    // Naive-Compressed scores the present targets on the final sequence; the
    // diverging ones (an SDCC pair each) had another live prefix.
    if !tree.sdcc_pairs().is_empty() {
        let naive = run_model(&model, &[tree.naive_compressed_pack()]).unwrap();
        let d = compare_entries(
            &trie.entries,
            &trie.logprobs,
            &naive.entries,
            &naive.logprobs,
            1,
        )
        .unwrap();
        assert_eq!(
            d.only_second, 0,
            "naive-compressed scores only real targets"
        );
        assert!(
            d.max_abs > 1e-6,
            "naive-compressed matched the exact log-probs at diverging targets: {d:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn attention_trie_equals_replicated_and_logittree(
        seed in any::<u64>(),
        (q_heads, group) in prop_oneof![Just((2, 1)), Just((4, 2)), Just((4, 4)), Just((6, 3))],
        head_dim in prop_oneof![Just(4usize), Just(8)],
        rope in any::<bool>(),
    ) {
        check_attention(seed, q_heads, group, head_dim, rope);
    }

    #[test]
    fn model_trie_equals_replicated_and_logittree(seed in any::<u64>(), rope in any::<bool>()) {
        check_model(seed, rope);
    }
}

/// The worked example of DESIGN §4 (K = 1, D = 3): all three exact layouts
/// agree, both naive ones do not — fixed, so it runs the same way every time.
#[test]
fn worked_example_three_exact_layouts_two_naive() {
    let calls = vec![
        Call::new(vec![10, 11, 20], vec![30, 31]),
        Call::new(vec![10, 11, 20, 30, 31, 40], vec![32]),
        Call::new(vec![10, 11, 20, 30, 31, 40, 32, 1], vec![50, 51]),
        Call::new(vec![10, 11, 3, 50, 51, 40, 32], vec![33]),
    ];
    let tree = Tree::build(&[Rollout::new("example", calls).unwrap()], false).unwrap();
    assert_eq!(tree.sdcc_pairs().len(), 3);
    for rope in [false, true] {
        check_model_on(&tree, rope);
    }
}

fn check_model_on(tree: &Tree, rope: bool) {
    let model = Model::<f64>::new(model_config(&mut Rng::new(3), rope), 17).unwrap();
    let trie = run_model(&model, &[tree.trie_pack()]).unwrap();
    let lt = run_model(&model, &tree.logittree_packs()).unwrap();
    assert_close("example log-probs", &trie.logprobs, &lt.logprobs);
    for ((name, a), (_, b)) in trie.grads.tensors().iter().zip(lt.grads.tensors()) {
        assert_close(name, a, b);
    }
    let naive = run_model(&model, &[tree.naive_compressed_pack()]).unwrap();
    let d = compare_entries(
        &trie.entries,
        &trie.logprobs,
        &naive.entries,
        &naive.logprobs,
        1,
    )
    .unwrap();
    // Naive-Compressed scores 50, 51, 32 and 33 (DESIGN §4), not 30 and 31.
    assert_eq!((d.compared, d.only_first, d.only_second), (4, 2, 0));
    assert!(d.max_abs > 1e-6);
}
