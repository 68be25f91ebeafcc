//! Issue 39: a first GPU run that counts. `scripts/gpu-check.sh` in order
//! (correctness, timing, ncu, sanitizers) with a reserve per section, on
//! the emulator (`GPU_CHECK_BACKEND=emu`) with stand-ins for nvidia-smi,
//! ncu and compute-sanitizer that behave as under gVisor (cannot attach:
//! reported, not a failure) or as tools that work (a sanitizer finding is a
//! failure); timing rows in `timing.json` as each finishes, so that a run
//! killed mid-way keeps them; `--time-limit`; and `--plan-only`, the
//! backward launch plan without a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treeattn-gcscript-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An executable shell script `dir/name`.
fn stand_in(dir: &Path, name: &str, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// `scripts/gpu-check.sh` with `bin` first on PATH and `env`; (status,
/// the combined log).
fn run_script(base: &Path, bin: &Path, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = base.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let o = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh"))
        .env("PATH", path)
        .env("TREEATTN_BIN", env!("CARGO_BIN_EXE_treeattn"))
        .env("GPU_CARRY", base.join("no-carry"))
        .env("OUT", &out)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let log = std::fs::read_to_string(out.join("gpu-check.log")).unwrap_or_default();
    assert!(
        text(&o.stdout).contains("== summary"),
        "stdout: {}\nstderr: {}",
        text(&o.stdout),
        text(&o.stderr)
    );
    (o.status.code(), log)
}

fn position(log: &str, what: &str) -> usize {
    log.find(what)
        .unwrap_or_else(|| panic!("{what:?} missing from:\n{log}"))
}

/// The full dry run: every gpu-check of the script on the emulator, on a
/// machine where ncu and compute-sanitizer cannot attach (gVisor's
/// messages). The sections run in order, the timing rows land in
/// timing.json, most important first, and the unavailable tools are
/// reported without failing the call.
#[test]
fn the_gpu_script_dry_run_on_the_emulator_under_gvisor() {
    let base = scratch("gvisor");
    let bin = base.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    stand_in(&bin, "nvidia-smi", "echo 'NVIDIA H200 (stand-in), 580.00'");
    stand_in(
        &bin,
        "ncu",
        "echo '==PROF== Connected to process 4242'\necho '==ERROR== Failed to prepare kernel for profiling: Device not supported' >&2\nexit 1",
    );
    stand_in(
        &bin,
        "compute-sanitizer",
        &format!(
            "echo \"$*\" >> {}\necho '========= Error: Target application failed to load: LibraryNotLoaded'\necho '========= ERROR SUMMARY: 1 error'\nexit 1",
            base.join("sanitizer-calls").display()
        ),
    );
    let dump = base.join("dump");
    let started = Instant::now();
    let (code, log) = run_script(
        &base,
        &bin,
        &[
            ("GPU_CHECK_BACKEND", "emu"),
            ("GPU_CHECK_ARGS", "--small --tokens 256 --heads 4 --reps 1"),
            ("GPU_CHECK_ONLY", "check timing ncu sanitizer"),
            ("GPU_CHECK_SEED", "5"),
            ("GPU_CHECK_DUMP", dump.to_str().unwrap()),
        ],
    );
    let took = started.elapsed();
    assert_eq!(code, Some(0), "{log}");
    let order = [
        "== 1. correctness",
        "all 7 correctness checks passed",
        "== 2. timing",
        "timing, first pass",
        "timing, second pass",
        "== 5. ncu",
        "ncu: UNAVAILABLE on this machine",
        "== 6. compute-sanitizer --tool memcheck",
        "compute-sanitizer memcheck: UNAVAILABLE",
        "== 6. compute-sanitizer --tool initcheck",
        "== summary",
        "result: ok",
    ];
    let at: Vec<usize> = order.iter().map(|w| position(&log, w)).collect();
    assert!(
        at.windows(2).all(|w| w[0] < w[1]),
        "out of order {order:?}:\n{log}"
    );
    assert!(log.contains("Device not supported"), "{log}");
    // A sanitizer that reports its own attach failure as an error is
    // still unavailable, not a finding.
    assert!(log.contains("compute-sanitizer memcheck: UNAVAILABLE on this machine (exit 1: ========= Error: Target"), "{log}");
    // Once the sanitizer cannot attach, the other tools are not tried.
    assert_eq!(
        log.matches("skipped: compute-sanitizer is unavailable here")
            .count(),
        3,
        "{log}"
    );
    assert_eq!(
        std::fs::read_to_string(base.join("sanitizer-calls"))
            .unwrap()
            .lines()
            .count(),
        1
    );
    assert!(!log.contains("FAILED"), "{log}");
    // The timing rows: complete, the GRPO pack at d 128 and its causal run
    // first (forward, then forward + backward in both dQ modes).
    let t = json(&dump.join("timing/timing.json"));
    assert_eq!(t["complete"], true, "{t:#}");
    let recs = t["records"].as_array().unwrap();
    assert_eq!(recs.len(), 26, "{t:#}");
    let first: Vec<(&str, &str, u64)> = recs[..4]
        .iter()
        .map(|r| {
            (
                r["pack"].as_str().unwrap(),
                r["kind"].as_str().unwrap(),
                r["head_dim"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        first,
        [
            ("causal", "forward", 128),
            ("grpo", "forward", 128),
            ("causal", "forward+backward", 128),
            ("grpo", "forward+backward", 128)
        ]
    );
    assert!(recs[3]["ours_det_ms"].as_f64().unwrap() > 0.0);
    eprintln!(
        "gpu-check.sh dry run on the emulator: {:.1} s",
        took.as_secs_f64()
    );
    std::fs::remove_dir_all(&base).unwrap();
}

/// The reserves: with 150 s in all, correctness (which keeps 330 s for the
/// sections after it) and timing (180 s) are skipped with a line and the
/// call fails; ncu and the sanitizers still run, in that order. Tools that
/// attach: ncu's profile is ok, a sanitizer finding fails the call.
#[test]
fn the_gpu_script_keeps_reserves_and_fails_on_a_finding() {
    let base = scratch("reserve");
    let bin = base.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let calls = base.join("calls");
    let c = calls.display();
    stand_in(&bin, "nvidia-smi", "echo 'NVIDIA H100 (stand-in), 580.00'");
    stand_in(
        &bin,
        "ncu",
        &format!("echo ncu >> {c}\necho '==PROF== Profiling \"tree_attn_fwd_bf16_d128\" - 0: 0%....100% - 9 passes'"),
    );
    stand_in(
        &bin,
        "compute-sanitizer",
        &format!(
            "echo \"sanitizer $2\" >> {c}\nif [ \"$2\" = racecheck ]; then echo '========= ERROR SUMMARY: 2 errors'; exit 3; fi\necho '========= ERROR SUMMARY: 0 errors'"
        ),
    );
    let dump = base.join("dump");
    let (code, log) = run_script(
        &base,
        &bin,
        &[
            ("GPU_CHECK_BUDGET", "150"),
            ("GPU_CHECK_BACKEND", "emu"),
            ("GPU_CHECK_DUMP", dump.to_str().unwrap()),
        ],
    );
    assert_eq!(code, Some(1), "{log}");
    for want in [
        "skipped: correctness (budget: ",
        "reserve 330 s for the sections after it",
        "skipped: timing (budget: ",
        "compute-sanitizer racecheck: exit 3",
        "result: FAILED",
    ] {
        assert!(log.contains(want), "{want:?} missing from:\n{log}");
    }
    let summary = &log[position(&log, "== summary")..];
    for want in [
        "correctness",
        "skipped (budget)",
        "ncu",
        "ok",
        "compute-sanitizer racecheck",
        "FAILED (exit 3)",
    ] {
        assert!(
            summary.contains(want),
            "{want:?} missing from the summary:\n{summary}"
        );
    }
    assert!(!dump.exists(), "no gpu-check ran");
    assert_eq!(
        std::fs::read_to_string(&calls).unwrap(),
        "ncu\nsanitizer memcheck\nsanitizer synccheck\nsanitizer racecheck\nsanitizer initcheck\n"
    );
    std::fs::remove_dir_all(&base).unwrap();
}

/// A timing run killed mid-way (SIGKILL, as a timeout's second signal)
/// leaves a timing.json that parses, says it is not complete, and names
/// only packs that are there.
#[test]
fn a_killed_timing_run_keeps_the_rows_it_finished() {
    let base = scratch("killed");
    let dump = base.join("dump");
    let mut child = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args([
            "gpu-check",
            "--backend",
            "emu",
            "--timing-only",
            "--seed",
            "9",
            "--reps",
            "1",
            "--dump",
        ])
        .arg(&dump)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let file = dump.join("timing/timing.json");
    let t0 = Instant::now();
    let rows = |v: &serde_json::Value| v["records"].as_array().map_or(0, Vec::len);
    loop {
        // Whole at every moment it exists: each read parses.
        if file.exists() && rows(&json(&file)) >= 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "no second row in 300 s"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let t = json(&file);
    assert_eq!(t["complete"], false, "{t:#}");
    assert_eq!(t["format"], treeattn_lab::gpu_check::TIMING_FORMAT);
    let recs = t["records"].as_array().unwrap();
    assert!(recs.len() >= 2 && recs.len() < 26, "{t:#}");
    assert_eq!(
        (recs[0]["pack"].as_str(), recs[1]["pack"].as_str()),
        (Some("causal"), Some("grpo"))
    );
    for r in recs {
        let bytes = std::fs::read(dump.join("timing").join(r["file"].as_str().unwrap())).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            st.tensor("kv_end").unwrap().shape(),
            [r["tokens"].as_u64().unwrap() as usize]
        );
    }
    // The dump never overwrites: a second run into the same DIR/timing is
    // refused before it times anything.
    let o = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args(["gpu-check", "--backend", "emu", "--timing-only", "--dump"])
        .arg(&dump)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("not an empty directory"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(rows(&json(&file)), recs.len());
    std::fs::remove_dir_all(&base).unwrap();
}

/// `--time-limit 0`: every timing step is skipped with a line, the run
/// succeeds, and timing.json is complete with the skipped steps listed.
#[test]
fn a_spent_time_limit_skips_every_timing_row() {
    let base = scratch("limit");
    let dump = base.join("dump");
    let o = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args([
            "gpu-check",
            "--backend",
            "emu",
            "--timing-only",
            "--time-limit",
            "0",
            "--dump",
        ])
        .arg(&dump)
        .output()
        .unwrap();
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    assert!(
        out.contains("skipped: forward causal 4/1 d128 and its group ("),
        "{out}"
    );
    assert!(out.contains("skipped: SDCC timing"), "{out}");
    assert!(
        out.contains("timing step(s) skipped by --time-limit 0 s"),
        "{out}"
    );
    let t = json(&dump.join("timing/timing.json"));
    assert_eq!(t["complete"], true);
    assert_eq!(t["records"].as_array().unwrap().len(), 0);
    assert!(t["skipped"].as_array().unwrap().len() >= 8, "{t:#}");
    std::fs::remove_dir_all(&base).unwrap();
}

/// `--plan-only` on a pack file written by `treeattn pack` (a GRPO-like
/// fan: a 300-token prompt, 3 answers of 200) and on the built-in packs:
/// the JSON layout of the issue, items in launch order whose pairs sum to
/// the pack's visible pairs times the query heads; the table without
/// --json; usage errors.
#[test]
fn plan_only_prints_the_backward_launch() {
    let base = scratch("plan");
    let prompt: Vec<u32> = (1..=300).collect();
    let mut jsonl = String::new();
    for i in 0..3u32 {
        let completion: Vec<u32> = (0..200).map(|j| 1000 + 1000 * i + j).collect();
        jsonl += &serde_json::json!({"id": format!("r{i}"), "calls": [{"context": prompt, "completion": completion}]})
            .to_string();
        jsonl.push('\n');
    }
    std::fs::write(base.join("fan.jsonl"), jsonl).unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_treeattn"))
            .current_dir(&base)
            .args(args)
            .output()
            .unwrap()
    };
    let o = run(&["pack", "fan.jsonl", "--out", "fan.safetensors"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = run(&[
        "gpu-check",
        "--plan-only",
        "--pack",
        "fan.safetensors",
        "--heads",
        "8",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--sms",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["tokens"], 900);
    // Key k of the prompt is seen by 900 − k queries, an answer's by the
    // rest of its answer.
    let pairs: u64 = (0..300u64).map(|k| 900 - k).sum::<u64>() + 3 * (1..=200u64).sum::<u64>();
    assert_eq!(j["visible_pairs"], pairs);
    assert_eq!(j["blocks_per_sm"], 1);
    let k = &j["kernels"][0];
    assert_eq!(k["name"], "tree_attn_bwd_main2_atomic_bf16_d64");
    // 8 key tiles of 128 x 2 kv heads = 16 blocks < 264: the group of 4
    // splits 4 ways over grid.z.
    assert_eq!(k["grid"], serde_json::json!([8, 2, 4]));
    let items = k["items"].as_array().unwrap();
    assert_eq!(items.len(), 64);
    let sum: u64 = items.iter().map(|i| i[5].as_u64().unwrap()).sum();
    assert_eq!(sum, pairs * 8);
    // Launch order: key tiles fastest, then kv heads; block 0 is the
    // prompt's first tile, walking every query, 1 head of its split.
    let row = |i: usize| {
        items[i]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        row(0),
        vec![0, 128, 0, 0, 900, (0..128u64).map(|k| 900 - k).sum::<u64>()]
    );
    assert_eq!(row(8)[..3], [0, 128, 1]);
    let u = j["utilization"].as_f64().unwrap();
    assert!(u > 0.0 && u <= 1.0, "{u}");
    // Deterministic dQ: the dQ kernel follows.
    let o = run(&[
        "gpu-check",
        "--plan-only",
        "--pack",
        "@grpo",
        "--dq-mode",
        "det",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["kernels"][1]["name"], "tree_attn_bwd_dq_bf16_d128");
    assert_eq!(j["kernels"][1]["blocks_per_sm"], 2);
    // The table.
    let o = run(&[
        "gpu-check",
        "--plan-only",
        "--pack",
        "@compaction",
        "--head-dim",
        "64",
    ]);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        out.contains("predicted SM utilization of the main kernel: 0."),
        "{out}"
    );
    assert!(out.contains("heaviest of"), "{out}");
    // Usage: --pack needs --plan-only; --plan-only needs --pack; a head dim
    // with no kernel; a missing file.
    assert_eq!(
        run(&["gpu-check", "--pack", "@grpo"]).status.code(),
        Some(2)
    );
    assert_eq!(run(&["gpu-check", "--plan-only"]).status.code(), Some(2));
    let o = run(&[
        "gpu-check",
        "--plan-only",
        "--pack",
        "@grpo",
        "--head-dim",
        "96",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("64 and 128"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(
        run(&["gpu-check", "--plan-only", "--pack", "nope.safetensors"])
            .status
            .code(),
        Some(1)
    );
    let help = text(&run(&["gpu-check", "--help"]).stdout);
    assert!(
        help.contains("--plan-only") && help.contains("--time-limit"),
        "{help}"
    );
    std::fs::remove_dir_all(&base).unwrap();
}
