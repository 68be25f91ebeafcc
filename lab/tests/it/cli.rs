//! The `treeattn` binary on the bundled data: exit codes, output files and
//! their tensors, and that `gen` regenerates `data/sample.jsonl` exactly.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use treeattn::rollout::read_jsonl;
use treeattn::safetensors::{pack_from_tensors, read_file};
use treeattn::tree::Tree;

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/sample.jsonl");

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
    // One pack: the file is --out itself and equals the library's trie pack,
    // prefixes shared by default.
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
    let mut want = Tree::build(&rs, true).unwrap().trie_pack();
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
    assert_eq!(st.metadata["share_prefixes"], "true");

    // --no-share-prefixes: each rollout keeps its prefixes (more tokens, the
    // library's unshared trie); the later of the two flags wins.
    let own = d.join("own.safetensors");
    for flags in [
        &["--no-share-prefixes"][..],
        &["--share-prefixes", "--no-share-prefixes"],
    ] {
        let o = run(&[&["pack", SAMPLE, "--out", own.to_str().unwrap()][..], flags].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        let st_own = read_file(&own).unwrap();
        assert_eq!(st_own.metadata["share_prefixes"], "false", "{flags:?}");
        let mut unshared = Tree::build(&rs, false).unwrap().trie_pack();
        unshared.loss.iter_mut().for_each(|e| e.logprob = None);
        let got = pack_from_tensors(&st_own, &base).unwrap();
        assert!(got == unshared, "{flags:?}: not the unshared trie pack");
        assert!(got.len() > back.len(), "{} vs {}", got.len(), back.len());
    }
    let o = run(&[
        "pack",
        SAMPLE,
        "--out",
        own.to_str().unwrap(),
        "--no-share-prefixes",
        "--share-prefixes",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(read_file(&own).unwrap().metadata["share_prefixes"], "true");

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
        if !share {
            args.push("--no-share-prefixes");
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

#[test]
fn version_and_help_per_subcommand() {
    let o = run(&["--version"]);
    assert!(o.status.success());
    assert!(
        stdout(&o).contains(env!("CARGO_PKG_VERSION")),
        "{}",
        stdout(&o)
    );
    // `help pack` is pack's help, not the global one.
    let o = run(&["help", "pack"]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("--no-share-prefixes"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("gpu-check"), "{}", stdout(&o));
    // Every bench option is in its help.
    let o = run(&["bench", "--help"]);
    for opt in [
        "--shape",
        "--reps",
        "--heads",
        "--head-dim",
        "--size",
        "--seed",
        "--costs-only",
        "--sdcc",
    ] {
        assert!(stdout(&o).contains(opt), "{opt}");
    }
}

#[test]
fn one_rollout_is_singular() {
    let d = scratch("plural");
    let f = d.join("one.jsonl");
    let o = run(&["gen", "golden", "--out", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("wrote 1 rollout to"), "{}", stderr(&o));
    let out = d.join("one.safetensors");
    let o = run(&["pack", f.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(": 1 rollout, L = 16"), "{}", stdout(&o));
    let o = run(&["inspect", f.to_str().unwrap()]);
    assert!(
        stdout(&o).contains(": 1 rollout, 4 calls"),
        "{}",
        stdout(&o)
    );
}

/// Names in a directory, sorted.
fn listing(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn pack_output_is_all_or_nothing() {
    let d = scratch("atomic");
    let out = d.join("p.safetensors");
    // The sample needs several packs at 1000 tokens; at 300 one rollout is
    // too big, which is only found after the smaller ones would have been
    // written: nothing may be left behind.
    let o = run(&[
        "pack",
        SAMPLE,
        "--out",
        out.to_str().unwrap(),
        "--budget",
        "300",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(listing(&d).is_empty(), "{:?}", listing(&d));
    // A write that fails (the output directory is missing) leaves nothing.
    let o = run(&[
        "pack",
        SAMPLE,
        "--out",
        d.join("missing/p.safetensors").to_str().unwrap(),
        "--budget",
        "1000",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(listing(&d).is_empty(), "{:?}", listing(&d));
    // Writing pack 1 fails (a directory holds its name): pack 0, written
    // first, must not be left behind (it used to be, with exit 1).
    std::fs::create_dir(d.join("p-00001.safetensors")).unwrap();
    let o = run(&[
        "pack",
        SAMPLE,
        "--out",
        out.to_str().unwrap(),
        "--budget",
        "1000",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(listing(&d), vec!["p-00001.safetensors".to_string()]);
}

#[test]
fn a_rerun_with_fewer_packs_leaves_no_stale_files() {
    let d = scratch("stale");
    let out = d.join("p.safetensors");
    let pack = |budget: &str| {
        let o = run(&[
            "pack",
            SAMPLE,
            "--out",
            out.to_str().unwrap(),
            "--budget",
            budget,
            "--no-share-prefixes",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        o
    };
    pack("1000");
    let many = listing(&d);
    assert!(
        many.len() > 2 && many.iter().all(|n| n.starts_with("p-")),
        "{many:?}"
    );
    let o = pack("100000");
    assert_eq!(listing(&d), vec!["p.safetensors".to_string()]);
    assert!(stderr(&o).contains("removed"), "{}", stderr(&o));
    // And back: the single file of the earlier run goes too.
    pack("1000");
    assert_eq!(listing(&d), many);
    // A file named like a pack that is not one is refused, untouched.
    std::fs::write(d.join("p-00099.safetensors"), b"not a pack").unwrap();
    let o = run(&[
        "pack",
        SAMPLE,
        "--out",
        out.to_str().unwrap(),
        "--budget",
        "1000",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("p-00099"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(d.join("p-00099.safetensors")).unwrap(),
        b"not a pack"
    );
}

#[test]
fn pack_refuses_to_overwrite_its_input() {
    let d = scratch("self");
    let f = d.join("in.jsonl");
    std::fs::copy(SAMPLE, &f).unwrap();
    let before = std::fs::read(&f).unwrap();
    let sub = d.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let via_dots = sub.join("../in.jsonl");
    for out in [f.clone(), via_dots] {
        let o = run(&["pack", f.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("input"), "{}", stderr(&o));
    }
    assert_eq!(std::fs::read(&f).unwrap(), before);
}

#[test]
fn gen_into_a_closed_pipe_exits_0() {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args(["gen", "compaction", "grpo", "fold", "--paper-scale"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one line, then close the pipe (what `| head -1` does).
    let mut first = [0u8; 64];
    use std::io::Read;
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{:?}: {}", o.status, stderr(&o));
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
}

#[test]
fn inspect_of_a_directory_says_so() {
    let d = scratch("dir");
    let o = run(&["inspect", d.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("is a directory"), "{}", stderr(&o));
    assert!(
        !stderr(&o).contains("invalid rollout JSON"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn pack_progress_only_on_a_terminal() {
    let d = scratch("progress");
    let out = d.join("p.safetensors");
    let o = run(&["pack", SAMPLE, "--out", out.to_str().unwrap()]);
    assert!(o.status.success());
    assert!(stderr(&o).is_empty(), "not a terminal: {}", stderr(&o));
    // Under a pseudo-terminal (util-linux `script`), progress appears.
    let cmd = format!(
        "{} pack {SAMPLE} --out {} --budget 1000",
        env!("CARGO_BIN_EXE_treeattn"),
        out.display()
    );
    let Ok(o) = Command::new("script")
        .args(["-qefc", &cmd, "/dev/null"])
        .output()
    else {
        eprintln!("no `script` here: the terminal half is skipped");
        return;
    };
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("read 22 rollouts; packing"), "{text}");
    assert!(text.contains("writing pack 1 of "), "{text}");
}

#[test]
fn bench_on_a_pack_file_prints_json_and_refuses_bad_options() {
    let d = scratch("bench-pack");
    let out = d.join("sample.safetensors");
    let o = run(&["pack", SAMPLE, "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let args = |extra: &[&str]| {
        let mut a = vec!["bench", "--pack", out.to_str().unwrap(), "--reps", "1"];
        a.extend_from_slice(extra);
        run(&a)
    };
    let o = args(&[
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "16",
        "--threads",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let rs = sample();
    let tree = Tree::build(&rs, true).unwrap();
    let pack = tree.trie_pack();
    assert_eq!(json["tokens"], pack.len() as u64);
    assert_eq!(json["visible_pairs"], pack.mask().unwrap().visible_pairs());
    assert_eq!(
        (json["threads"].clone(), json["kv_heads"].clone()),
        (1.into(), 1.into())
    );
    assert!(json["fwd_gflops"].as_f64().unwrap() > 0.0);
    let o = args(&["--threads", "1"]);
    assert!(
        o.status.success() && stdout(&o).contains("tree/causal"),
        "{}",
        stderr(&o)
    );
    // Heads that do not divide, and --json without --pack, are errors.
    let o = args(&["--heads", "3", "--kv-heads", "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("multiple of kv_heads"),
        "{}",
        stderr(&o)
    );
    let o = run(&["bench", "--json"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn gen_regenerates_the_rl_sample_exactly() {
    let d = scratch("gen-rl");
    let f = d.join("rl_sample.jsonl");
    let args = [
        "gen",
        "compaction",
        "fold",
        "grpo",
        "--rewards",
        "--seed",
        "2",
        "--out",
    ];
    let o = run(&[&args[..], &[f.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let want = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/rl_sample.jsonl"
    ))
    .unwrap();
    assert_eq!(std::fs::read_to_string(&f).unwrap(), want);
}

#[test]
fn gen_rewards_then_pack_writes_the_rl_fields() {
    let d = scratch("rewards");
    let jsonl = d.join("rl.jsonl");
    let o = run(&[
        "gen",
        "compaction",
        "grpo",
        "--rewards",
        "--seed",
        "3",
        "--out",
        jsonl.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rs = read_jsonl(std::io::BufReader::new(
        std::fs::File::open(&jsonl).unwrap(),
    ))
    .unwrap();
    assert_eq!(rs.len(), 17);
    assert!(rs
        .iter()
        .all(|r| matches!(r.reward(), Some(x) if x == 0.0 || x == 1.0)));
    assert_eq!(rs[0].group(), None);
    assert!(rs[1..].iter().all(|r| r.group() == Some("grpo-3")));
    // Both reward values occur (a fixed seed: this is deterministic).
    assert!(
        rs.iter().any(|r| r.reward() == Some(0.0)) && rs.iter().any(|r| r.reward() == Some(1.0))
    );

    let out = d.join("rl.safetensors");
    let o = run(&[
        "pack",
        jsonl.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--share-prefixes",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let st = read_file(&out).unwrap();
    let reward = st.get("rollout_reward").unwrap().to_f32().unwrap();
    let group = st.get("rollout_group").unwrap().to_i64().unwrap();
    let want: Vec<f32> = rs.iter().map(|r| r.reward().unwrap()).collect();
    assert_eq!(reward, want);
    assert_eq!(group[0], -1);
    assert!(group[1..].iter().all(|&g| g == 0));
    assert_eq!(st.metadata["groups"], r#"["grpo-3"]"#);
    // Each rollout's calls' fingerprint, which tells rollouts of one id in
    // two files apart (treeattn.rl.grpo_advantages).
    let fp = st.get("rollout_fingerprint").unwrap().to_i64().unwrap();
    let want: Vec<i64> = rs
        .iter()
        .map(|r| treeattn::pack::calls_fingerprint(r) as i64)
        .collect();
    assert_eq!(fp, want);
    // Segments: the compaction rollout (input index 0) spans several.
    let seg = st.get("loss_segment").unwrap().to_i64().unwrap();
    let roll = st.get("loss_rollout").unwrap().to_i64().unwrap();
    let last = seg
        .iter()
        .zip(&roll)
        .filter(|(_, &r)| r == 0)
        .map(|(&s, _)| s)
        .max();
    let junctions = (1..rs[0].calls().len())
        .filter(|&c| rs[0].is_junction(c))
        .count();
    assert_eq!(last, Some(junctions as i64));
    assert!(junctions >= 1);
}
