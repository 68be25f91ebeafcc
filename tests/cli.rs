//! The `treeattn` binary on the bundled data: exit codes, output files and
//! their tensors, and that `gen` regenerates `data/sample.jsonl` exactly.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use treeattn::rollout::read_jsonl;
use treeattn::safetensors::{pack_from_tensors, read_file};
use treeattn::tree::Tree;

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/sample.jsonl");

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treeattn-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn sample() -> Vec<treeattn::rollout::Rollout> {
    read_jsonl(std::io::BufReader::new(
        std::fs::File::open(SAMPLE).unwrap(),
    ))
    .unwrap()
}

#[test]
fn help_and_usage_errors() {
    let o = run(&["--help"]);
    assert!(o.status.success());
    for cmd in ["inspect", "pack", "gen"] {
        assert!(stdout(&o).contains(cmd));
        let h = run(&[cmd, "--help"]);
        assert!(
            h.status.success() && stdout(&h).contains(&format!("treeattn {cmd}")),
            "{cmd}"
        );
    }
    for bad in [
        &[][..],
        &["frobnicate"],
        &["inspect"],
        &["inspect", SAMPLE, "--colour"],
        &["pack", SAMPLE],
        &["gen"],
        &["gen", "spiral"],
    ] {
        let o = run(bad);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", stderr(&o));
        assert!(stderr(&o).starts_with("error: "), "{bad:?}");
    }
    let o = run(&[
        "pack",
        SAMPLE,
        "--out",
        "/nonexistent/x.safetensors",
        "--layout",
        "dense",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("dense"));
}

#[test]
fn inspect_prints_the_figures_and_the_tree() {
    let o = run(&["inspect", SAMPLE]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("rollout 0 \"golden\": 4 calls, 6 targets"),
        "{out}"
    );
    assert!(
        out.contains("junctions K = 1, branches 2, diverging targets D = 3 of 4"),
        "{out}"
    );
    assert!(
        out.contains("trie 16 tokens, branches 18 tokens, dedup ratio 0.889"),
        "{out}"
    );
    assert!(
        out.contains("b1: 8 tok (+6 own) forks from b0 at depth 2; calls 3"),
        "{out}"
    );
    assert!(
        out.contains("junction at call 3: forks at depth 2, kept 6 of 10"),
        "{out}"
    );
    assert!(
        out.contains("\"compaction-1\"") && out.contains("junctions K = 3"),
        "{out}"
    );
    assert!(out.contains("22 rollouts"), "{out}");
}

#[test]
fn bad_input_exits_1_naming_the_line() {
    let d = scratch("bad");
    let f = d.join("bad.jsonl");
    let good = std::fs::read_to_string(SAMPLE)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    std::fs::write(
        &f,
        format!(
            "{good}\n{{\"id\": \"x\", \"calls\": [{{\"context\": [1], \"completion\": []}}]}}\n"
        ),
    )
    .unwrap();
    let o = run(&["inspect", f.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("rollout \"x\", call 0, field `completion`") && e.contains("line 2"),
        "{e}"
    );
    let o = run(&[
        "pack",
        f.to_str().unwrap(),
        "--out",
        d.join("o.safetensors").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let o = run(&["inspect", d.join("missing.jsonl").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("missing.jsonl"));
    let o = run(&[
        "pack",
        SAMPLE,
        "--out",
        d.join("o.safetensors").to_str().unwrap(),
        "--budget",
        "100",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("compaction-1"), "{}", stderr(&o));
}

/// Global index of each rollout's first call.
fn call_base(rs: &[treeattn::rollout::Rollout]) -> Vec<u64> {
    rs.iter()
        .scan(0u64, |n, r| {
            let b = *n;
            *n += r.calls().len() as u64;
            Some(b)
        })
        .collect()
}

#[test]
fn pack_writes_one_exact_file_per_pack() {
    let d = scratch("pack");
    let rs = sample();
    let base = call_base(&rs);
    // One pack: the file is --out itself and equals the library's trie pack.
    let one = d.join("all.safetensors");
    let o = run(&["pack", SAMPLE, "--out", one.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let st = read_file(&one).unwrap();
    let names: Vec<&str> = st.tensors.keys().map(String::as_str).collect();
    for n in [
        "tokens",
        "position_ids",
        "kv_end",
        "loss_rows",
        "loss_labels",
        "loss_call",
        "loss_offset",
        "loss_weights",
    ] {
        assert!(names.contains(&n), "{n} missing from {names:?}");
    }
    assert_eq!(st.metadata["layout"], "trie");
    let back = pack_from_tensors(&st, &base).unwrap();
    let mut want = Tree::build(&rs, false).unwrap().trie_pack();
    // The golden rollout has no log-probs, so the file has no loss_logprobs.
    assert!(!st.tensors.contains_key("loss_logprobs"));
    want.loss.iter_mut().for_each(|e| e.logprob = None);
    assert!(back == want, "the file holds the library's trie pack");
    // loss_call counts calls across the file: the golden rollout is first.
    let calls = st.get("loss_call").unwrap().to_i64().unwrap();
    assert_eq!(&calls[..6], &[0, 0, 1, 2, 2, 3]);
    assert_eq!(
        *calls.last().unwrap() as usize,
        rs.iter().map(|r| r.calls().len()).sum::<usize>() - 1
    );

    // Several packs: -00000, -00001, ... each within budget, together
    // covering every target once.
    for (layout, share) in [("trie", true), ("replicated", false)] {
        let stem = d.join(format!("{layout}.safetensors"));
        let mut args = vec![
            "pack",
            SAMPLE,
            "--out",
            stem.to_str().unwrap(),
            "--budget",
            "1000",
            "--layout",
            layout,
        ];
        if share {
            args.push("--share-prefixes");
        }
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let mut targets = 0;
        let mut i = 0;
        while let Ok(st) = read_file(&d.join(format!("{layout}-{i:05}.safetensors"))) {
            let p = pack_from_tensors(&st, &base).unwrap();
            assert!(p.len() <= 1000);
            targets += p.loss.len();
            assert_eq!(st.metadata["pack_index"], i.to_string());
            i += 1;
        }
        assert!(i > 1, "{layout}: expected several packs");
        assert!(!Path::new(&stem).exists());
        assert_eq!(targets, rs.iter().map(|r| r.targets()).sum::<usize>());
    }
}

#[test]
fn gen_regenerates_the_sample_exactly() {
    let d = scratch("gen");
    let f = d.join("sample.jsonl");
    let args = [
        "gen",
        "golden",
        "compaction",
        "stack-pop",
        "fold",
        "memex",
        "grpo",
        "plain",
        "--seed",
        "1",
        "--out",
    ];
    let o = run(&[&args[..], &[f.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(&f).unwrap(),
        std::fs::read_to_string(SAMPLE).unwrap()
    );
    let o = run(&["gen", "golden", "golden"]);
    assert_eq!(o.status.code(), Some(2), "duplicate ids are refused");
}
