//! Quickstart: the worked example of DESIGN §4, end to end.
//!
//! A rollout of four model calls where the third call writes a summary and the
//! fourth resumes from it (one junction, two branches) is turned into the
//! exact deduplicated trie pack, attention runs forward and backward on it on
//! the CPU backend, and the SDCC forward KL is taken at its diverging targets.
//!
//! Run with `cargo run --release --example quickstart`.

use ndarray::{Array2, Array3};
use treeattn::backend::{AttnParams, Rope};
use treeattn::ops::{attention_backward, attention_forward, sdcc_forward_kl};
use treeattn::rollout::{parse_jsonl, Call, Rollout};
use treeattn::tree::Tree;

fn main() -> treeattn::Result<()> {
    // 1. A rollout is its list of model calls (context, sampled completion).
    //    The same thing as JSON Lines, as a harness would log it:
    let jsonl = r#"{"id": "r17", "calls": [
        {"context": [10, 11, 20], "completion": [30, 31]},
        {"context": [10, 11, 20, 30, 31, 40], "completion": [32]},
        {"context": [10, 11, 20, 30, 31, 40, 32, 1], "completion": [50, 51]},
        {"context": [10, 11, 3, 50, 51, 40, 32], "completion": [33]}]}"#
        .replace('\n', " ");
    let from_json = parse_jsonl(&jsonl)?;
    let rollout = Rollout::new(
        "r17",
        vec![
            Call::new(vec![10, 11, 20], vec![30, 31]),
            Call::new(vec![10, 11, 20, 30, 31, 40], vec![32]),
            Call::new(vec![10, 11, 20, 30, 31, 40, 32, 1], vec![50, 51]),
            Call::new(vec![10, 11, 3, 50, 51, 40, 32], vec![33]),
        ],
    )?;
    assert_eq!(from_json[0].calls(), rollout.calls());

    // 2. The conditioning tree is the token trie of the calls; its pre-order
    //    layout is the pack: tokens, depth position ids, interval mask kv_end
    //    (query q sees key k iff k <= q < kv_end[k]) and one loss entry per
    //    sampled token, on the row that predicts it on its live branch.
    let tree = Tree::build(&[rollout], false)?;
    let pack = tree.trie_pack();
    println!("tokens       {:?}", pack.tokens);
    println!("position_ids {:?}", pack.position_ids);
    println!("kv_end       {:?}", pack.kv_end);
    for e in &pack.loss {
        println!(
            "  call {} offset {}: row {} predicts {}",
            e.call, e.offset, e.row, e.label
        );
    }
    let branches = tree.logittree_packs();
    println!(
        "{} trie tokens instead of {} in LogitTree's {} branch passes",
        pack.len(),
        branches.iter().map(|b| b.len()).sum::<usize>(),
        branches.len()
    );

    // 3. Attention forward and backward on the pack, [tokens, heads, head_dim]
    //    (the varlen layout of flash_attn_varlen), GQA 4 query / 2 kv heads,
    //    rotary embedding at the pack's position ids.
    let (l, hq, hkv, d) = (pack.len(), 4, 2, 16);
    let wave = |n: usize, f: f64| (0..n).map(|i| ((i as f64) * f).sin()).collect::<Vec<f64>>();
    let q = Array3::from_shape_vec((l, hq, d), wave(l * hq * d, 0.37)).expect("sizes match");
    let k = Array3::from_shape_vec((l, hkv, d), wave(l * hkv * d, 0.53)).expect("sizes match");
    let v = Array3::from_shape_vec((l, hkv, d), wave(l * hkv * d, 0.71)).expect("sizes match");
    let mut params = AttnParams::new(d);
    params.rope = Some(Rope {
        base: 10_000.0,
        dims: d,
    });
    let fwd = attention_forward(q.view(), k.view(), v.view(), pack.mask()?, &params)?;
    let d_o = Array3::from_elem(fwd.o.dim(), 1.0);
    let grads = attention_backward(&fwd, q.view(), k.view(), v.view(), d_o.view(), pack.mask()?)?;
    println!(
        "O {:?}, LSE {:?}, dQ {:?}, dK {:?}",
        fwd.o.dim(),
        fwd.lse.dim(),
        grads.dq.dim(),
        grads.dk.dim()
    );

    // 4. SDCC: forward KL(teacher || student) between the live row (teacher)
    //    and the compressed-stream row (student) of each diverging target —
    //    both rows of the same packed logits.
    let pairs: Vec<(u32, u32)> = tree
        .sdcc_pairs()
        .iter()
        .map(|p| (p.student_row, p.teacher_row))
        .collect();
    let vocab = 64;
    let logits = Array2::from_shape_vec((l, vocab), wave(l * vocab, 0.11)).expect("sizes match");
    let weights = vec![1.0f32; pairs.len()];
    let kl = sdcc_forward_kl(logits.view(), logits.view(), &pairs, &weights, 1.0)?;
    println!(
        "SDCC pairs (student row, teacher row) {pairs:?}: mean KL {:.4}",
        kl.loss.loss_mean
    );
    Ok(())
}
