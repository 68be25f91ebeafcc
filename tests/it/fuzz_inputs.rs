//! Byte-mutation fuzzing with a fixed budget, run by `cargo test` (a few
//! seconds): the JSONL reader and the pack reader must return `Ok` or `Err`
//! on any input, never panic. Inputs that parse go on through the tree, the
//! stats and the layouts, so a panic further down is found here too.
//! Seeds are fixed: a failure reproduces, and prints the input.

use std::panic::{catch_unwind, AssertUnwindSafe};

use treeattn::pack::{batch, Layout};
use treeattn::rollout::parse_jsonl;
use treeattn::safetensors::{deserialize, pack_from_tensors, pack_tensors, serialize};
use treeattn::tree::{RolloutStats, Tree};

const SAMPLE: &str = include_str!("../../data/sample.jsonl");

struct Xs(u64);

impl Xs {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Bytes that matter to JSON and to the number parser.
const INTERESTING: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\"",
    b"\\",
    b"-",
    b"e",
    b".",
    b"0",
    b"9",
    b"null",
    b"true",
    b"1e39",
    b"-1e400",
    b"4294967296",
    b"18446744073709551616",
    b"NaN",
    b"\xef\xbb\xbf",
    b"\xff",
    b"\n",
    b"\"id\"",
    b"\"calls\"",
    b"\"context\"",
    b"\"completion\"",
    b"\"logprobs\"",
    b"[]",
    b"{}",
    b"5.0",
];

/// One to four random edits: flip a bit, set a byte, insert or delete a
/// span, insert an interesting token, duplicate a span, truncate.
fn mutate(rng: &mut Xs, input: &[u8]) -> Vec<u8> {
    let mut b = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len() + 1);
        match rng.below(7) {
            0 if !b.is_empty() => {
                let i = at.min(b.len() - 1);
                b[i] ^= 1 << rng.below(8);
            }
            1 if !b.is_empty() => {
                let i = at.min(b.len() - 1);
                b[i] = rng.next() as u8;
            }
            2 => {
                let n = rng.below(8).min(b.len() - at.min(b.len()));
                b.drain(at..at + n);
            }
            3 => {
                let t = INTERESTING[rng.below(INTERESTING.len())];
                b.splice(at..at, t.iter().copied());
            }
            4 if !b.is_empty() => {
                let s = rng.below(b.len());
                let n = rng.below(32).min(b.len() - s);
                let span: Vec<u8> = b[s..s + n].to_vec();
                b.splice(at..at, span);
            }
            5 => b.truncate(at),
            _ => {
                let v = rng.next().to_le_bytes();
                b.splice(at..at, v[..1 + rng.below(8)].iter().copied());
            }
        }
    }
    b
}

fn no_panic(what: &str, input: &[u8], f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        panic!(
            "{what} panicked on input ({} bytes): {:?}",
            input.len(),
            String::from_utf8_lossy(&input[..input.len().min(2000)])
        );
    }
}

#[test]
fn jsonl_reader_never_panics() {
    let lines: Vec<&str> = SAMPLE.lines().filter(|l| l.len() < 4000).collect();
    assert!(lines.len() > 3);
    let mut rng = Xs(0x5eed_0001);
    let mut parsed = 0;
    for _ in 0..20_000 {
        // One or two short sample lines, mutated.
        let mut text = lines[rng.below(lines.len())].as_bytes().to_vec();
        if rng.below(3) == 0 {
            text.push(b'\n');
            text.extend(lines[rng.below(lines.len())].as_bytes());
        }
        let input = mutate(&mut rng, &text);
        no_panic("the JSONL reader", &input, || {
            let Ok(rs) = treeattn::rollout::read_jsonl(&input[..]) else {
                return;
            };
            parsed += 1;
            for r in &rs {
                let _ = RolloutStats::of(r);
            }
            if let Ok(tree) = Tree::build(&rs, true) {
                let _ = tree.sdcc_pairs();
                let _ = tree.naive_compressed_pack().validate();
            }
            let _ = batch(&rs, 64, true, Layout::Trie);
        });
    }
    // The mutations are small enough that some inputs still parse.
    assert!(parsed > 1000, "only {parsed} inputs parsed");
    // Whole-string API too, on the sample with a few edits.
    for _ in 0..20 {
        let input = mutate(&mut rng, SAMPLE.as_bytes());
        if let Ok(s) = std::str::from_utf8(&input) {
            no_panic("parse_jsonl", &input, || {
                let _ = parse_jsonl(s);
            });
        }
    }
}

#[test]
fn pack_reader_never_panics() {
    let rs = parse_jsonl(SAMPLE).unwrap();
    let mut base = vec![0u64];
    for r in &rs[..4] {
        base.push(base.last().unwrap() + r.calls().len() as u64);
    }
    let tree = Tree::build(&rs[..4], false).unwrap();
    let pairs = tree.sdcc_pairs();
    let tensors = pack_tensors(&tree.trie_pack(), Some(&pairs), &base).unwrap();
    let meta = std::collections::BTreeMap::from([(
        "format".to_string(),
        treeattn::safetensors::PACK_FORMAT.to_string(),
    )]);
    let good = serialize(&tensors, &meta).unwrap();
    let head = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut rng = Xs(0x5eed_0002);
    let mut ok = 0;
    for round in 0..30_000 {
        // Half the edits aimed at the header, where the structure is.
        let input = if round % 2 == 0 {
            let mut h = mutate(&mut rng, &good[8..head]);
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.append(&mut h);
            b.extend_from_slice(&good[head..]);
            b
        } else {
            mutate(&mut rng, &good)
        };
        no_panic("the pack reader", &input, || {
            if let Ok(st) = deserialize(&input) {
                if let Ok(p) = pack_from_tensors(&st, &base) {
                    ok += 1;
                    // What the reader accepts is a valid pack.
                    assert!(p.validate().is_ok());
                }
            }
        });
    }
    assert!(ok > 0, "no mutated pack was accepted at all");
}
