//! The GPU run's flow runs here first (issue 16): `treeattn gpu-check
//! --backend emu --dump DIR` — the very check flow of the GPU, on the SIMT
//! emulator at small sizes — then `scripts/gpu-anchor.py DIR`, PyTorch on
//! the same packs (reference, FlexAttention), which must agree; and a dump
//! with one output corrupted, which it must reject.
//!
//! The Python half runs when `TREEATTN_ANCHOR_PY` names a python with torch
//! (.ci/run sets it to its venv's, with `TREEATTN_REQUIRE_ANCHOR=1`, so
//! that it cannot skip there); without it only the Rust half runs.

use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treeattn-gpucheck-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A copy of the dump in which case `case`'s `o` is scaled by 1.05 (a 5%
/// error: far above every bound); the timing packs are left out.
fn corrupt(from: &Path, to: &Path, case: usize) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            continue;
        }
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(to.join("manifest.json")).unwrap()).unwrap();
    let file = to.join(m["cases"][case]["file"].as_str().unwrap());
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    for (name, dtype, _, data) in owned.iter_mut() {
        if name == "o" {
            assert!(matches!(
                dtype,
                safetensors::Dtype::BF16 | safetensors::Dtype::F16
            ));
            let bf = *dtype == safetensors::Dtype::BF16;
            for c in data.chunks_exact_mut(2) {
                let bits = u16::from_le_bytes([c[0], c[1]]);
                let x = if bf {
                    half::bf16::from_bits(bits).to_f32()
                } else {
                    half::f16::from_bits(bits).to_f32()
                } * 1.05;
                let out = if bf {
                    half::bf16::from_f32(x).to_bits()
                } else {
                    half::f16::from_f32(x).to_bits()
                };
                c.copy_from_slice(&out.to_le_bytes());
            }
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(&file, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn emu_gpu_check_dump_and_the_torch_anchor_agree() {
    let base = scratch("emu");
    let dump = base.join("dump");
    let o = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args([
            "gpu-check",
            "--backend",
            "emu",
            "--seed",
            "16",
            "--reps",
            "1",
            "--dump",
        ])
        .arg(&dump)
        .output()
        .unwrap();
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    for want in [
        "gpu-check --backend emu on the SIMT emulator",
        "all 7 correctness checks passed",
        "sdcc vocab 8192",
        "EMULATOR WALL CLOCK, meaningless for a GPU",
        "LogitT ms",
        "SDCC timing",
    ] {
        assert!(out.contains(want), "{want:?} missing from:\n{out}");
    }
    assert!(!out.contains("FAIL"), "{out}");
    // The dump: a manifest naming 11 cases (7 forward, 4 backward), each
    // file present, nothing partial left beside it.
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dump.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["format"], treeattn_lab::gpu_check::DUMP_FORMAT);
    assert_eq!(m["backend"], "emu");
    let cases = m["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 11, "{m:#}");
    let kinds = |k: &str| cases.iter().filter(|c| c["kind"] == k).count();
    assert_eq!((kinds("forward"), kinds("backward")), (7, 4));
    for c in cases {
        let bytes = std::fs::read(dump.join(c["file"].as_str().unwrap())).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let l = c["tokens"].as_u64().unwrap() as usize;
        assert_eq!(st.tensor("kv_end").unwrap().shape(), [l]);
        let want: &[&str] = if c["kind"] == "backward" {
            &[
                "d_o",
                "dq",
                "dk",
                "dv",
                "o",
                "lse",
                "q",
                "k",
                "v",
                "position_ids",
            ]
        } else {
            &["o", "lse", "q", "k", "v", "position_ids"]
        };
        for n in want {
            assert!(st.tensor(n).is_ok(), "{n} missing in {c}");
        }
    }
    // The timing rows: packs and our times in dump/timing/ (13 forward
    // rows, 13 forward + backward rows: d 128 and 64 × causal and the three
    // tree packs, plus rotary, GQA 8:1 and the long pack with their causal
    // rows, all at d 128), each record's pack present at its length.
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dump.join("timing/timing.json")).unwrap())
            .unwrap();
    assert_eq!(t["format"], treeattn_lab::gpu_check::TIMING_FORMAT);
    let recs = t["records"].as_array().unwrap();
    let count = |k: &str| recs.iter().filter(|r| r["kind"] == k).count();
    assert_eq!(
        (count("forward"), count("forward+backward")),
        (13, 13),
        "{t:#}"
    );
    for r in recs {
        let bytes = std::fs::read(dump.join("timing").join(r["file"].as_str().unwrap())).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let l = r["tokens"].as_u64().unwrap() as usize;
        assert_eq!(st.tensor("kv_end").unwrap().shape(), [l], "{r}");
        assert!(r["ours_ms"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(recs
        .iter()
        .any(|r| r["rope"].is_object() && r["kind"] == "forward+backward"));
    assert!(recs
        .iter()
        .any(|r| r["q_heads"].as_u64() == Some(8 * r["kv_heads"].as_u64().unwrap())));
    assert!(recs.iter().any(|r| r["tokens"] == 1024));
    // One set of packs for every section: the forward and the forward +
    // backward rows of a pack point at the same file (6 packs: causal,
    // compaction, GRPO, random trees at 256 tokens; causal and random trees
    // at 1024).
    let files: std::collections::BTreeSet<&str> =
        recs.iter().map(|r| r["file"].as_str().unwrap()).collect();
    assert_eq!(files.len(), 6, "{files:?}");
    let left: Vec<_> = std::fs::read_dir(&base)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("dump")]);
    // A second run never overwrites the dump.
    let again = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args(["gpu-check", "--backend", "emu", "--dump"])
        .arg(&dump)
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2), "{}", text(&again.stderr));
    assert!(
        text(&again.stderr).contains("not empty"),
        "{}",
        text(&again.stderr)
    );

    // The torch side.
    let py = match std::env::var_os("TREEATTN_ANCHOR_PY") {
        Some(p) => PathBuf::from(p),
        None => {
            assert!(
                std::env::var_os("TREEATTN_REQUIRE_ANCHOR").is_none(),
                "TREEATTN_REQUIRE_ANCHOR is set but TREEATTN_ANCHOR_PY is not"
            );
            eprintln!(
                "TREEATTN_ANCHOR_PY not set: scripts/gpu-anchor.py not run (.ci/run runs it)"
            );
            std::fs::remove_dir_all(&base).unwrap();
            return;
        }
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-anchor.py");
    let anchor = |dir: &Path, extra: &[&str]| {
        let o = Command::new(&py)
            .arg(&script)
            .arg(dir)
            .args(["--device", "cpu", "--reps", "1", "--threads", "2"])
            .args(extra)
            .output()
            .unwrap();
        (o.status.code(), text(&o.stdout), text(&o.stderr))
    };
    let (code, out, err) = anchor(&dump, &["--flex", "eager"]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("all 11 cases agree"), "{out}");
    assert!(out.contains("flex (eager) vs ours"), "{out}");
    assert!(out.contains("side by side"), "{out}");
    // ... and torch on the timing packs, one line per record.
    assert!(out.contains("timing packs (gpu-check's own rows"), "{out}");
    assert!(out.contains("random trees 4/1 L=1024"), "{out}");
    assert!(!out.contains("FAILED"), "{out}");
    // A corrupted O (case 5: a backward case with rotary) must be caught.
    let bad = base.join("bad");
    corrupt(&dump, &bad, 5);
    let (code, out, err) = anchor(&bad, &["--flex", "off", "--cases", "5"]);
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(out.contains("MISMATCH"), "{out}");
    std::fs::remove_dir_all(&base).unwrap();
}

/// `--check-only` runs the correctness sections and no timing (its dump has
/// no `timing/`); `--profile` runs one forward + backward and nothing else.
#[test]
fn emu_gpu_check_check_only_and_profile() {
    let base = scratch("modes");
    let dump = base.join("dump");
    let o = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args([
            "gpu-check",
            "--backend",
            "emu",
            "--check-only",
            "--small",
            "--dump",
        ])
        .arg(&dump)
        .output()
        .unwrap();
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    assert!(out.contains("all 7 correctness checks passed"), "{out}");
    assert!(
        !out.contains("forward timing") && !out.contains("SDCC timing"),
        "{out}"
    );
    assert!(dump.join("manifest.json").exists());
    assert!(!dump.join("timing").exists());
    let o = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args([
            "gpu-check",
            "--backend",
            "emu",
            "--profile",
            "--tokens",
            "256",
            "--heads",
            "4",
        ])
        .output()
        .unwrap();
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    assert!(out.contains("profile: one forward + backward"), "{out}");
    assert!(!out.contains("correctness"), "{out}");
    std::fs::remove_dir_all(&base).unwrap();
}

/// `--timing-only` runs the timings and no correctness section, writing
/// only `timing/` into an existing dump directory (beside a check-only
/// run's); `--check-only --seed S` is reproducible: the same seed gives
/// the same packs (the same L of every case) and the same errors. Negative
/// control: another seed gives other packs.
#[test]
fn emu_gpu_check_timing_only_and_seeded_replay() {
    let base = scratch("split");
    let dump = base.join("dump");
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_treeattn"))
            .args(["gpu-check", "--backend", "emu"])
            .args(args)
            .output()
            .unwrap();
        let out = text(&o.stdout);
        assert!(o.status.success(), "{args:?}: {out}\n{}", text(&o.stderr));
        out
    };
    let d = dump.to_str().unwrap();
    let check = |seed: &str| {
        let out = run(&["--check-only", "--small", "--seed", seed]);
        // The correctness lines (case, L, errors), without the header.
        out.lines()
            .filter(|l| l.contains(" L="))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let a = check("7");
    assert!(a.len() >= 7, "{a:?}");
    assert_eq!(a, check("7"));
    assert_ne!(a, check("8"));
    run(&["--check-only", "--small", "--seed", "7", "--dump", d]);
    let out = run(&["--timing-only", "--seed", "7", "--dump", d]);
    assert!(!out.contains("correctness"), "{out}");
    assert!(out.contains("timing rows go to"), "{out}");
    // The two dQ modes compared at the timing sizes.
    let modes = out
        .lines()
        .find(|l| l.starts_with("atomic vs deterministic dQ on the timed packs"))
        .unwrap_or_else(|| panic!("no dQ mode comparison in:\n{out}"));
    assert!(
        modes.ends_with("ok") && !modes.contains("over 0 packs"),
        "{modes}"
    );
    assert!(dump.join("manifest.json").exists() && dump.join("timing").exists());
    let o = Command::new(env!("CARGO_BIN_EXE_treeattn"))
        .args([
            "gpu-check",
            "--backend",
            "emu",
            "--timing-only",
            "--check-only",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    std::fs::remove_dir_all(&base).unwrap();
}
