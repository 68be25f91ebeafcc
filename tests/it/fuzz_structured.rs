//! Structure-aware fuzzing with proptest (fixed seeds), beside the byte
//! mutations of `fuzz_inputs`: rollouts built as JSON values with fields
//! of every type and shape, and pack files built as tensor sets with one
//! tensor changed in dtype, shape, length or value.
//!
//! Properties: the readers return `Ok` or `Err`, never panic; a rollout
//! line is accepted exactly when it keeps the input rules of
//! `src/rollout.rs` (stated again here, in [`problem`]), and then every
//! field reads back as written and every pack of it is exact (each target
//! once, under its call's live prefix, at its depth); a pack file is read
//! back as the pack that was written, and whatever a changed file gives is
//! a valid pack.

use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use serde_json::{json, Value};
use treeattn::pack::{batch, calls_fingerprint, Layout, Pack};
use treeattn::rollout::{parse_jsonl, Rollout};
use treeattn::safetensors::{
    deserialize, loss_field_tensors, pack_from_tensors, pack_tensors, rollout_tensors,
    sdcc_rows_from_tensors, serialize, Dtype, Tensor, PACK_FORMAT,
};

fn config(cases: u32, seed: u64) -> Config {
    // A failure reproduces from the fixed seed (and is printed shrunk).
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    }
}

// ---------------------------------------------------------------------
// rollouts as JSON values

/// A value nested `n` arrays deep.
fn deep(n: usize) -> Value {
    (0..n).fold(json!(1), |v, _| json!([v]))
}

/// Values of every JSON type, in and out of each field's range.
fn weird() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        Value::Null,
        json!(true),
        json!(false),
        json!(0),
        json!(-1),
        json!(1),
        json!(7),
        json!(1u64 << 31),
        json!(u32::MAX),
        json!(1u64 << 32),
        json!(i64::MIN),
        json!(u64::MAX),
        json!(1.5),
        json!(1e39),
        json!(-1e-50),
        json!(3e38),
        json!(""),
        json!("x"),
        json!("\u{0}"),
        json!("é"),
        json!([]),
        json!([1]),
        json!([-1]),
        json!([1.5]),
        json!([[1]]),
        json!([null]),
        json!({}),
        json!({"a": 1}),
        deep(200),
    ])
}

/// A valid rollout: 1 to 4 calls over a 4-token vocabulary (or four ids
/// at the top of u32), extending or editing the previous call, with the
/// optional fields at random.
fn valid_rollout() -> impl Strategy<Value = Value> {
    (
        any::<bool>(),
        prop::collection::vec(
            (
                any::<bool>(),
                0usize..8,
                prop::collection::vec(0u32..4, 0..4),
                prop::collection::vec(0u32..4, 1..4),
                prop::option::of(prop::collection::vec(-5.0f64..=0.0, 3)),
                prop::option::of(any::<bool>()),
            ),
            1..5,
        ),
        prop::option::of(-3.0f64..3.0),
        prop::option::of(prop::sample::select(vec!["g0", "g1", "é"])),
        any::<bool>(),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(big, calls, reward, group, rewards, truncated)| {
            let tok = |t: u32| if big { u32::MAX - t } else { t };
            let mut prev: Vec<u32> = Vec::new();
            let mut out = Vec::new();
            for (extend, keep, extra, comp, lp, summary) in calls {
                let mut ctx = if extend || prev.is_empty() {
                    prev.clone()
                } else {
                    prev[..keep.min(prev.len())].to_vec()
                };
                ctx.extend(extra.iter().map(|&t| tok(t)));
                if ctx.is_empty() {
                    ctx.push(tok(0));
                }
                let comp: Vec<u32> = comp.iter().map(|&t| tok(t)).collect();
                let mut c = json!({"context": ctx, "completion": comp});
                if let Some(lp) = lp {
                    c["logprobs"] = json!(lp[..1].repeat(comp.len()));
                }
                if let Some(s) = summary {
                    c["summary"] = json!(s);
                }
                prev = ctx.iter().chain(&comp).copied().collect();
                out.push(c);
            }
            let mut r = json!({"id": "r", "calls": out});
            if let Some(x) = reward {
                r["reward"] = json!(x);
            }
            if let Some(g) = group {
                r["group"] = json!(g);
            }
            if rewards {
                let rw: Vec<Vec<f64>> = r["calls"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| vec![0.25; c["completion"].as_array().unwrap().len()])
                    .collect();
                r["rewards"] = json!(rw);
            }
            if let Some(t) = truncated {
                r["truncated"] = json!(t);
            }
            r
        })
}

/// One edit of a rollout value: (kind, selectors, a value).
type Edit = (u8, usize, usize, Value);

fn edit() -> impl Strategy<Value = Edit> {
    (0u8..8, any::<usize>(), any::<usize>(), weird())
}

const ROLLOUT_KEYS: [&str; 7] = [
    "id",
    "calls",
    "reward",
    "group",
    "rewards",
    "truncated",
    "other",
];
const CALL_KEYS: [&str; 4] = ["context", "completion", "logprobs", "summary"];

/// The call a selector picks.
fn call_at(o: &mut serde_json::Map<String, Value>, a: usize) -> Option<&mut Value> {
    let calls = o.get_mut("calls")?.as_array_mut()?;
    let n = calls.len().max(1);
    calls.get_mut(a % n)
}

fn apply(r: &mut Value, (kind, a, b, w): &Edit) {
    let Some(o) = r.as_object_mut() else {
        return;
    };
    let n_calls = o.get("calls").and_then(Value::as_array).map_or(0, Vec::len);
    match kind {
        0 => {
            o.insert(ROLLOUT_KEYS[a % ROLLOUT_KEYS.len()].into(), w.clone());
        }
        1 => {
            if let Some(c) = call_at(o, *a).and_then(Value::as_object_mut) {
                c.insert(CALL_KEYS[b % CALL_KEYS.len()].into(), w.clone());
            }
        }
        2 => {
            // An entry of a list: a token, a log-prob, a per-token reward.
            let field = ["context", "completion", "logprobs", "rewards"][b % 4];
            let seq = if field == "rewards" {
                o.get_mut("rewards")
                    .and_then(Value::as_array_mut)
                    .and_then(|rw| rw.get_mut(a % n_calls.max(1)))
                    .and_then(Value::as_array_mut)
            } else {
                call_at(o, *a)
                    .and_then(Value::as_object_mut)
                    .and_then(|c| c.get_mut(field))
                    .and_then(Value::as_array_mut)
            };
            // Half the time a number near some field's limits.
            let numbers = [
                json!(0),
                json!(1),
                json!(-1),
                json!(0.5),
                json!(-0.5),
                json!(1e-50),
                json!(-1e-50),
                json!(1e39),
                json!(-1e39),
                json!(-3e38),
                json!(u32::MAX),
                json!(1u64 << 32),
                json!(2.0),
            ];
            let w = if a % 2 == 0 {
                numbers[a / 2 % numbers.len()].clone()
            } else {
                w.clone()
            };
            if let Some(seq) = seq {
                let j = b / 4 % (seq.len() + 1);
                // Log-probs and rewards keep their length (else the length
                // rule alone refuses them).
                if j < seq.len() && (a % 3 == 0 || matches!(field, "logprobs" | "rewards")) {
                    seq[j] = w.clone();
                } else {
                    seq.insert(j, w.clone());
                }
            }
        }
        3 => {
            o.remove(ROLLOUT_KEYS[a % ROLLOUT_KEYS.len()]);
        }
        4 => {
            if let Some(c) = call_at(o, *a).and_then(Value::as_object_mut) {
                c.remove(CALL_KEYS[b % CALL_KEYS.len()]);
            }
        }
        5 => {
            if let Some(c) = call_at(o, *a) {
                *c = w.clone();
            }
        }
        6 => {
            // A list one entry too long or too short.
            let Some(c) = call_at(o, *a).and_then(Value::as_object_mut) else {
                return;
            };
            let n = c
                .get("completion")
                .and_then(Value::as_array)
                .map_or(1, Vec::len);
            let n = if b % 2 == 0 {
                n + 1
            } else {
                n.saturating_sub(1)
            };
            if b % 4 < 2 {
                c.insert("logprobs".into(), json!(vec![-0.5; n]));
            } else {
                let mut rw: Vec<Value> = (0..n_calls).map(|_| json!([0.0])).collect();
                rw[a % n_calls] = json!(vec![0.0; n]);
                o.insert("rewards".into(), Value::Array(rw));
            }
        }
        _ => {
            o.clear();
            o.insert("calls".into(), w.clone());
        }
    }
}

fn u32_of(v: &Value) -> Option<u32> {
    v.as_u64()
        .filter(|&x| x <= u32::MAX as u64)
        .map(|x| x as u32)
}

fn tokens(v: &Value) -> Option<Vec<u32>> {
    let a = v.as_array()?;
    let t: Option<Vec<u32>> = a.iter().map(u32_of).collect();
    t.filter(|t| !t.is_empty())
}

fn f32_of(v: &Value) -> Option<f32> {
    let x = v.as_f64()? as f32;
    x.is_finite().then_some(x)
}

fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Why the crate must refuse rollout `r` (the module docs of
/// `src/rollout.rs`), or `None`.
fn problem(r: &Value) -> Option<&'static str> {
    let o = r.as_object()?;
    if depth(r) > 120 {
        return Some("nested too deeply");
    }
    match o.get("id") {
        Some(Value::String(s)) if !s.is_empty() => {}
        Some(Value::Number(_)) => {}
        _ => return Some("id"),
    }
    let calls = match o.get("calls") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => return Some("calls"),
    };
    for c in calls {
        let Some(co) = c.as_object() else {
            return Some("call");
        };
        let (Some(_ctx), Some(comp)) = (
            co.get("context").and_then(tokens),
            co.get("completion").and_then(tokens),
        ) else {
            return Some("tokens");
        };
        match co.get("logprobs") {
            None | Some(Value::Null) => {}
            Some(Value::Array(lp)) => {
                let ok = lp.len() == comp.len()
                    && lp.iter().all(|x| f32_of(x).is_some_and(|x| x <= 0.0));
                if !ok {
                    return Some("logprobs");
                }
            }
            Some(_) => return Some("logprobs"),
        }
        if !matches!(
            co.get("summary"),
            None | Some(Value::Null) | Some(Value::Bool(_))
        ) {
            return Some("summary");
        }
    }
    match o.get("reward") {
        None | Some(Value::Null) => {}
        Some(x) if f32_of(x).is_some() => {}
        _ => return Some("reward"),
    }
    if !matches!(
        o.get("group"),
        None | Some(Value::Null) | Some(Value::String(_))
    ) {
        return Some("group");
    }
    match o.get("rewards") {
        None | Some(Value::Null) => {}
        Some(Value::Array(rw)) => {
            if rw.len() != calls.len() {
                return Some("rewards");
            }
            for (c, x) in calls.iter().zip(rw) {
                let n = c["completion"].as_array().map_or(0, Vec::len);
                let ok = x
                    .as_array()
                    .is_some_and(|x| x.len() == n && x.iter().all(|y| f32_of(y).is_some()));
                if !ok {
                    return Some("rewards");
                }
            }
        }
        Some(_) => return Some("rewards"),
    }
    if !matches!(
        o.get("truncated"),
        None | Some(Value::Null) | Some(Value::Bool(_))
    ) {
        return Some("truncated");
    }
    None
}

/// The id as the crate keeps it, where it is known here (strings and
/// integers; a float's text is not stated).
fn id_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    }
}

/// Every field of a parsed rollout as the JSON value says.
fn check_fields(r: &Rollout, v: &Value) {
    if let Some(id) = id_text(&v["id"]) {
        assert_eq!(r.id(), id);
    }
    let calls = v["calls"].as_array().unwrap();
    assert_eq!(r.calls().len(), calls.len());
    for (c, (call, cv)) in r.calls().iter().zip(calls).enumerate() {
        assert_eq!(Some(call.context.clone()), tokens(&cv["context"]));
        assert_eq!(Some(call.completion.clone()), tokens(&cv["completion"]));
        let lp: Option<Vec<f32>> = cv["logprobs"]
            .as_array()
            .map(|a| a.iter().map(|x| f32_of(x).unwrap()).collect());
        assert_eq!(call.logprobs, lp);
        assert_eq!(r.is_summary(c), cv["summary"] == json!(true));
    }
    assert_eq!(r.reward(), f32_of(&v["reward"]));
    assert_eq!(r.group(), v["group"].as_str());
    assert_eq!(r.truncated(), v["truncated"] == json!(true));
    let rw: Option<Vec<Vec<f32>>> = v["rewards"].as_array().map(|a| {
        a.iter()
            .map(|x| {
                x.as_array()
                    .unwrap()
                    .iter()
                    .map(|y| f32_of(y).unwrap())
                    .collect()
            })
            .collect()
    });
    assert_eq!(r.token_rewards().map(<[_]>::to_vec), rw);
}

/// Each target of the exact layouts once, under its call's live prefix:
/// the tokens of the keys its row sees are `context ++ completion[..offset]`
/// and the row sits at that prefix's depth.
fn check_exact(rs: &[Rollout], p: &Pack, members: &[u32]) {
    p.validate().unwrap();
    let mut seen = Vec::new();
    for e in &p.loss {
        let r = &rs[e.rollout as usize];
        let c = &r.calls()[e.call as usize];
        let row = e.row as usize;
        let live: Vec<u32> = (0..=row)
            .filter(|&k| p.kv_end[k] as usize > row)
            .map(|k| p.tokens[k])
            .collect();
        let mut want = c.context.clone();
        want.extend_from_slice(&c.completion[..e.offset as usize]);
        assert_eq!(
            live,
            want,
            "rollout {}, call {}, offset {}",
            r.id(),
            e.call,
            e.offset
        );
        assert_eq!(p.position_ids[row] as usize, want.len() - 1);
        assert_eq!(e.label, c.completion[e.offset as usize]);
        seen.push((e.rollout, e.call, e.offset));
    }
    let mut want = Vec::new();
    for &m in members {
        for (c, call) in rs[m as usize].calls().iter().enumerate() {
            for o in 0..call.completion.len() {
                want.push((m, c as u32, o as u32));
            }
        }
    }
    assert_eq!(
        seen, want,
        "every target of the pack's rollouts, once, in order"
    );
}

/// Rows of rollout `r` alone in the trie layout: its distinct prefixes.
fn trie_size(r: &Rollout) -> usize {
    let mut set = HashSet::new();
    for c in r.calls() {
        let s = c.sequence();
        for n in 1..=s.len() {
            set.insert(s[..n].to_vec());
        }
    }
    set.len()
}

#[test]
fn rollout_values_are_read_by_the_rules_and_packed_exactly() {
    let strategy = (
        prop::collection::vec((valid_rollout(), prop::collection::vec(edit(), 0..3)), 1..4),
        prop::sample::select(vec![0usize, 0, 4, 8, 16, 64]),
        any::<bool>(),
        any::<bool>(),
        prop::collection::vec(weird(), 4),
    );
    let accepted = std::cell::Cell::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(config(3000, 0x41_6101));
    runner
        .run(&strategy, |(items, budget, share, trie, ids)| {
            let mut vs = Vec::new();
            for (i, (mut v, edits)) in items.into_iter().enumerate() {
                v["id"] = match i % 3 {
                    2 => ids[i].clone(),
                    1 => json!(i),
                    _ => json!(format!("r{i}")),
                };
                for e in &edits {
                    apply(&mut v, e);
                }
                vs.push(v);
            }
            let text = vs
                .iter()
                .map(|v| serde_json::to_string(v).unwrap())
                .collect::<Vec<_>>()
                .join("\n");
            let parsed = catch_unwind(AssertUnwindSafe(|| parse_jsonl(&text)));
            let Ok(parsed) = parsed else {
                panic!("parse_jsonl panicked on {text}");
            };
            let mut problems: Vec<(usize, &str)> = vs
                .iter()
                .enumerate()
                .filter_map(|(i, v)| match v.as_object() {
                    None => Some((i, "not an object")),
                    Some(_) => problem(v).map(|p| (i, p)),
                })
                .collect();
            // Ids must be unique (by their text).
            let mut texts: Vec<(String, usize)> = Vec::new();
            let mut ambiguous = false;
            for (i, v) in vs.iter().enumerate() {
                if problems.iter().any(|&(j, _)| j == i) {
                    continue;
                }
                match id_text(&v["id"]) {
                    Some(t) if texts.iter().any(|(u, _)| *u == t) => {
                        problems.push((i, "duplicate id"))
                    }
                    Some(t) => texts.push((t, i)),
                    None => ambiguous = true, // a float id: its text is not stated here
                }
            }
            if ambiguous && problems.is_empty() {
                return Ok(());
            }
            match (&parsed, problems.is_empty()) {
                (Ok(_), false) => panic!("accepted, but {problems:?} break the rules: {text}"),
                (Err(e), true) => panic!("refused a valid input ({e}): {text}"),
                (Err(e), false) => {
                    // The error names a line that breaks the rules.
                    let msg = e.to_string();
                    assert!(
                        problems
                            .iter()
                            .any(|&(i, _)| msg.contains(&format!("line {}", i + 1))),
                        "{msg} names none of {problems:?}"
                    );
                    return Ok(());
                }
                (Ok(_), true) => {}
            }
            let rs = parsed.unwrap();
            accepted.set(accepted.get() + 1);
            for (r, v) in rs.iter().zip(&vs) {
                check_fields(r, v);
            }
            let layout = if trie {
                Layout::Trie
            } else {
                Layout::Replicated
            };
            let budget = if budget == 0 { usize::MAX } else { budget };
            match batch(&rs, budget, share, layout) {
                Ok(bs) => {
                    let mut all: Vec<u32> = Vec::new();
                    for b in &bs {
                        assert!(b.pack.len() <= budget, "a pack over the budget");
                        check_exact(&rs, &b.pack, &b.rollouts);
                        let fp: Vec<i64> = b
                            .rollouts
                            .iter()
                            .map(|&i| calls_fingerprint(&rs[i as usize]) as i64)
                            .collect();
                        assert_eq!(b.fields.fingerprint, fp);
                        all.extend(&b.rollouts);
                    }
                    all.sort_unstable();
                    assert_eq!(all, (0..rs.len() as u32).collect::<Vec<_>>());
                }
                Err(e) => {
                    assert!(e.to_string().contains("budget"), "{e}");
                    if trie {
                        assert!(rs.iter().any(|r| trie_size(r) > budget), "{e}");
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    eprintln!("rollout values: {} of 3000 valid", accepted.get());
    assert!(
        accepted.get() > 500,
        "only {} inputs were valid",
        accepted.get()
    );
}

// ---------------------------------------------------------------------
// pack files as tensor sets

/// A pack file's tensors and metadata, the call offsets to read it with,
/// and the pack it holds.
type PackFile = (
    Vec<(String, Tensor)>,
    BTreeMap<String, String>,
    Vec<u64>,
    Pack,
);

/// The tensor set of a pack file of random valid rollouts (one pack).
fn pack_file(rs: &[Rollout]) -> PackFile {
    let b = batch(rs, usize::MAX, true, Layout::Trie).unwrap().remove(0);
    let mut base = vec![0u64];
    for r in rs {
        base.push(base.last().unwrap() + r.calls().len() as u64);
    }
    let mut t = pack_tensors(&b.pack, b.sdcc.as_deref(), &base).unwrap();
    t.extend(rollout_tensors(&b.fields));
    t.extend(loss_field_tensors(&b.loss_fields));
    let meta = BTreeMap::from([("format".to_string(), PACK_FORMAT.to_string())]);
    (t, meta, base, b.pack)
}

fn i64s(t: &Tensor) -> Vec<i64> {
    match t.dtype {
        Dtype::I64 => t
            .data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::I32 => t
            .data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        Dtype::F32 => t
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        Dtype::F64 => t
            .data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        Dtype::Bool => t.data.iter().map(|&b| b as i64).collect(),
    }
}

fn with_values(dtype: Dtype, shape: Vec<usize>, v: &[i64]) -> Tensor {
    let data = match dtype {
        Dtype::I64 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::I32 => v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
        Dtype::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        Dtype::F64 => v.iter().flat_map(|&x| (x as f64).to_le_bytes()).collect(),
        // Any byte, so a changed value may be no bool at all (2, 255).
        Dtype::Bool => v.iter().map(|&x| x as u8).collect(),
    };
    Tensor { dtype, shape, data }
}

const INTERESTING: [i64; 10] = [
    0,
    1,
    -1,
    2,
    7,
    u32::MAX as i64,
    1 << 32,
    i64::MIN,
    i64::MAX,
    100,
];

/// One change to the tensor set; `false` when it left the values as they
/// were (a no-op by chance).
fn change(
    t: &mut Vec<(String, Tensor)>,
    meta: &mut BTreeMap<String, String>,
    kind: u8,
    a: usize,
    b: usize,
) -> bool {
    let n = t.len();
    let x = t[a % n].1.clone();
    let v = i64s(&x);
    let len = v.len();
    let pick = |k: usize| INTERESTING[k % INTERESTING.len()];
    let changed = match kind % 9 {
        0 => {
            // Another dtype, the same values (as far as it holds them).
            let d = [Dtype::I64, Dtype::I32, Dtype::F32, Dtype::F64, Dtype::Bool][b % 5];
            if d == x.dtype {
                return false; // re-encoding floats through i64 would round them
            }
            t[a % n].1 = with_values(d, x.shape.clone(), &v);
            true
        }
        1 => {
            // Another shape, the same elements.
            t[a % n].1.shape = match b % 3 {
                0 => vec![1, len],
                1 => vec![len, 1],
                _ if len == 1 => vec![],
                _ => vec![len, 1, 1],
            };
            true
        }
        2 => {
            t.remove(a % n);
            true
        }
        3 if len > 0 => {
            let mut w = v.clone();
            let i = b % len;
            let new = pick(b / len);
            w[i] = new;
            t[a % n].1 = with_values(x.dtype, x.shape.clone(), &w);
            // Float tensors hold what `as` made of the integers.
            new != v[i] || matches!(x.dtype, Dtype::F32 | Dtype::F64)
        }
        4 => {
            let mut w = v.clone();
            if b.is_multiple_of(2) || len == 0 {
                w.push(pick(b));
            } else {
                w.pop();
            }
            t[a % n].1 = with_values(x.dtype, vec![w.len()], &w);
            true
        }
        5 => {
            meta.insert(
                "format".into(),
                ["treeattn-pack-v1", "treeattn-pack-v3", ""][b % 3].into(),
            );
            true
        }
        6 if n > 1 => {
            // Two tensors swap names.
            let j = (a + 1 + b % (n - 1)) % n;
            let (ni, nj) = (t[a % n].0.clone(), t[j].0.clone());
            t[a % n].0 = nj;
            t[j].0 = ni;
            t[a % n].1 != t[j].1
        }
        7 if len > 1 => {
            // Two entries of one tensor swap.
            let mut w = v.clone();
            let (i, j) = (b % len, (b / len + 1) % len);
            w.swap(i, j);
            t[a % n].1 = with_values(x.dtype, x.shape.clone(), &w);
            w != v || matches!(x.dtype, Dtype::F32 | Dtype::F64)
        }
        8 => {
            let name = format!("extra_{}", b % 3);
            if !t.iter().any(|(m, _)| *m == name) {
                t.push((name, Tensor::from_i64(&[1, 2])));
            }
            false // an unknown tensor is ignored
        }
        _ => false,
    };
    changed
}

fn rollouts_strategy() -> impl Strategy<Value = Vec<Rollout>> {
    prop::collection::vec(valid_rollout(), 1..4).prop_map(|vs| {
        let text = vs
            .into_iter()
            .enumerate()
            .map(|(i, mut v)| {
                v["id"] = json!(format!("p{i}"));
                serde_json::to_string(&v).unwrap()
            })
            .collect::<Vec<_>>()
            .join("\n");
        parse_jsonl(&text).unwrap()
    })
}

#[test]
fn pack_files_read_back_or_fail_cleanly_after_structural_changes() {
    let strategy = (
        rollouts_strategy(),
        prop::collection::vec((0u8..9, any::<usize>(), any::<usize>()), 0..3),
    );
    let (unchanged, refused) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let mut runner = proptest::test_runner::TestRunner::new(config(3000, 0x41_6102));
    runner
        .run(&strategy, |(rs, changes)| {
            let (mut t, mut meta, base, want) = pack_file(&rs);
            let want_sdcc = sdcc_rows_from_tensors(
                &deserialize(&serialize(&t, &meta).unwrap()).unwrap(),
                want.len(),
            )
            .unwrap();
            let mut changed = false;
            for &(k, a, b) in &changes {
                if !t.is_empty() {
                    changed |= change(&mut t, &mut meta, k, a, b);
                }
            }
            let run = catch_unwind(AssertUnwindSafe(|| {
                let bytes = serialize(&t, &meta)?;
                let st = deserialize(&bytes)?;
                let p = pack_from_tensors(&st, &base)?;
                let sdcc = sdcc_rows_from_tensors(&st, p.len())?;
                Ok::<_, treeattn::Error>((p, sdcc))
            }));
            let Ok(res) = run else {
                panic!("the pack reader panicked after {changes:?}");
            };
            match res {
                Ok((p, sdcc)) => {
                    // Whatever is accepted is a valid pack; an unchanged
                    // file is the pack written.
                    p.validate().unwrap();
                    if !changed {
                        let mut want = want.clone();
                        if want.loss.iter().any(|e| e.logprob.is_none()) {
                            want.loss.iter_mut().for_each(|e| e.logprob = None);
                        }
                        assert!(p == want, "read back otherwise than written");
                        assert_eq!(sdcc, want_sdcc);
                        unchanged.set(unchanged.get() + 1);
                    }
                }
                Err(e) => {
                    assert!(changed, "an unchanged file was refused: {e}");
                    assert!(!e.to_string().is_empty());
                    refused.set(refused.get() + 1);
                }
            }
            Ok(())
        })
        .unwrap();
    let (unchanged, refused) = (unchanged.get(), refused.get());
    eprintln!("pack files: {unchanged} read back unchanged, {refused} refused");
    assert!(
        unchanged > 500 && refused > 1000,
        "{unchanged} unchanged, {refused} refused"
    );
}
