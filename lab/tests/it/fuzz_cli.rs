//! Fuzzing the CLI's output handling (`treeattn pack --out`), beside the
//! fixed cases of `output_files`: output paths built at random from the
//! things a directory can hold at a name (files, packs of an earlier run,
//! directories, links to each, dangling and looping links, FIFOs, the input
//! itself, odd names), and SIGINT / SIGTERM / SIGHUP sent at random moments
//! of a multi-pack run over an earlier run's packs. Seeds are fixed (the
//! proptest runner's); the signals' moments depend on the machine's speed,
//! but the properties hold at every moment.
//!
//! Properties: the process ends with status 0, 1 or 2 (never a panic's 101,
//! never killed by anything but the signal sent) within a time limit; it
//! leaves no temporary or backup file; on failure the directory is byte
//! for byte what it was; on success the packs at the output names (through
//! links) are the bytes of a reference run and nothing else changed but
//! the packs of an earlier run at the same name; after a signal the
//! directory holds the earlier set or the new one, whole.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/sample.jsonl");
const BIN: &str = env!("CARGO_BIN_EXE_treeattn");

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treeattn-fuzz-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::canonicalize(&d).unwrap()
}

/// Runs the CLI with a time limit: (status, stderr). A run past the limit
/// is killed and fails the test (a hang).
fn run_limited(args: &[&OsStr], err: &Path) -> (ExitStatus, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(err).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("treeattn {args:?} did not end within 30 s");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    (status, std::fs::read_to_string(err).unwrap_or_default())
}

/// What is at a name: a file's bytes, a directory, a link's target, or
/// something else (a FIFO).
#[derive(Clone, Debug, PartialEq)]
enum Entry {
    File(Vec<u8>),
    Dir,
    Link(PathBuf),
    Other,
}

/// Every entry under `d` (links not followed).
fn snapshot(d: &Path) -> BTreeMap<PathBuf, Entry> {
    let mut out = BTreeMap::new();
    let mut todo = vec![d.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let entry = if m.file_type().is_symlink() {
                Entry::Link(std::fs::read_link(&p).unwrap())
            } else if m.is_dir() {
                todo.push(p.clone());
                Entry::Dir
            } else if m.is_file() {
                Entry::File(std::fs::read(&p).unwrap())
            } else {
                Entry::Other
            };
            out.insert(p, entry);
        }
    }
    out
}

fn leftovers(s: &BTreeMap<PathBuf, Entry>) -> Vec<&PathBuf> {
    s.keys()
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.contains(".tmp-") || n.contains(".bak-")
        })
        .collect()
}

/// The CLI's names for pack `i` of `n` at `out` (src/bin/treeattn/pack.rs).
fn output_path(out: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 {
        return out.to_path_buf();
    }
    let (stem, ext) = stem_ext(out);
    let name = match ext {
        Some(ext) => format!("{stem}-{i:05}.{ext}"),
        None => format!("{stem}-{i:05}"),
    };
    out.with_file_name(name)
}

fn stem_ext(out: &Path) -> (String, Option<String>) {
    (
        out.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        out.extension().map(|e| e.to_string_lossy().into_owned()),
    )
}

/// Where a write to `p` lands: its directory resolved, and the link at the
/// name followed.
fn lands(p: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let (Some(parent), Some(name)) = (p.parent(), p.file_name()) {
        if let Ok(dir) = std::fs::canonicalize(parent) {
            out.push(dir.join(name));
        }
    }
    if let Ok(c) = std::fs::canonicalize(p) {
        out.push(c);
    }
    out
}

/// Is `p` a name the CLI may remove as a pack of an earlier run at `out`
/// (`STEM.EXT` or `STEM-NNNNN.EXT` in `out`'s directory)?
fn stale_name(out: &Path, p: &Path) -> bool {
    let Some(dir) = out.parent().and_then(|d| std::fs::canonicalize(d).ok()) else {
        return false;
    };
    if p.parent() != Some(dir.as_path()) {
        return false;
    }
    let (stem, ext) = stem_ext(out);
    let name = p.file_name().unwrap().to_string_lossy().into_owned();
    let rest = match &ext {
        Some(x) => name.strip_suffix(&format!(".{x}")),
        None => Some(name.as_str()),
    };
    rest.is_some_and(|r| {
        r == stem
            || r.strip_prefix(&format!("{stem}-"))
                .is_some_and(|n| n.len() >= 5 && n.bytes().all(|c| c.is_ascii_digit()))
    })
}

fn mkfifo(p: &Path) -> bool {
    Command::new("mkfifo")
        .arg(p)
        .status()
        .is_ok_and(|s| s.success())
}

/// Path components the generator joins (`..` only after a directory).
const PARTS: [&str; 22] = [
    "new.safetensors",
    "old.safetensors",
    "file.safetensors",
    "dir",
    "dir.safetensors",
    "link-file",
    "link-pack.safetensors",
    "link-dir",
    "dangling.safetensors",
    "loop.safetensors",
    "fifo.safetensors",
    "in.jsonl",
    "missing",
    "noext",
    "sp ace.safetensors",
    "nl\nx.safetensors",
    "ü.safetensors",
    ".hidden",
    "LONG",
    ".",
    "dir/..",
    "link-dir/..",
];

#[test]
fn random_output_paths_give_the_packs_or_a_clean_error() {
    let d = scratch("paths");
    let input = d.join("in.jsonl");
    std::fs::copy(SAMPLE, &input).unwrap();
    // Reference runs: one pack, and three packs (--budget 1000).
    let refdir = d.join("ref");
    std::fs::create_dir(&refdir).unwrap();
    let err = d.join("stderr");
    let mut refs: BTreeMap<usize, Vec<Vec<u8>>> = BTreeMap::new();
    for (n, budget) in [(1usize, None), (3, Some("1000"))] {
        let out = refdir.join(format!("p{n}.safetensors"));
        let mut args = vec![
            "pack".as_ref(),
            input.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
            "--no-share-prefixes".as_ref(),
        ];
        if let Some(b) = budget {
            args.extend([OsStr::new("--budget"), OsStr::new(b)]);
        }
        let (st, e) = run_limited(&args, &err);
        assert!(st.success(), "{e}");
        let files: Vec<Vec<u8>> = (0..n)
            .map(|i| std::fs::read(output_path(&out, i, n)).unwrap())
            .collect();
        refs.insert(n, files);
    }
    let fifo_ok = mkfifo(&d.join("probe-fifo"));
    let counter = std::cell::Cell::new(0usize);
    let (ok_runs, failed_runs) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let strategy = (
        prop::collection::vec(0usize..PARTS.len(), 1..4),
        any::<bool>(),
        any::<bool>(),
    );
    let mut runner = TestRunner::new(Config {
        cases: 70,
        rng_seed: RngSeed::Fixed(0x41_6201),
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&strategy, |(parts, slash, several)| {
            let k = counter.get();
            counter.set(k + 1);
            // A fresh directory of things at names.
            let c = d.join(format!("case{k}"));
            std::fs::create_dir(&c).unwrap();
            std::os::unix::fs::symlink(&input, c.join("in.jsonl")).unwrap();
            std::fs::write(c.join("file.safetensors"), b"not a pack").unwrap();
            std::fs::write(c.join("old.safetensors"), &refs[&1][0]).unwrap();
            for (i, name) in ["old-00000", "old-00001", "old-00007"].iter().enumerate() {
                std::fs::write(c.join(format!("{name}.safetensors")), &refs[&3][i]).unwrap();
            }
            std::fs::create_dir(c.join("dir")).unwrap();
            std::fs::write(c.join("dir/inner.safetensors"), &refs[&1][0]).unwrap();
            std::fs::create_dir(c.join("dir.safetensors")).unwrap();
            for (link, target) in [
                ("link-file", "file.safetensors"),
                ("link-pack.safetensors", "old.safetensors"),
                ("link-dir", "dir"),
                ("dangling.safetensors", "missing/x"),
                ("loop.safetensors", "loop.safetensors"),
            ] {
                std::os::unix::fs::symlink(target, c.join(link)).unwrap();
            }
            if fifo_ok {
                assert!(mkfifo(&c.join("fifo.safetensors")));
            }
            let long = format!("{}.safetensors", "x".repeat(300));
            let mut rel: Vec<&str> = parts
                .iter()
                .map(|&i| {
                    if PARTS[i] == "LONG" {
                        long.as_str()
                    } else {
                        PARTS[i]
                    }
                })
                .collect();
            // `..` only where it stays inside the case's directory.
            if rel.len() > 1 {
                rel.retain(|p| !p.ends_with(".."));
            }
            // `NAME/.` after a file's name is the trailing slash's case.
            let mut s = c.display().to_string();
            for part in rel {
                if part != "." || std::fs::metadata(&s).is_ok_and(|m| m.is_dir()) {
                    s = format!("{s}/{part}");
                }
            }
            // A trailing slash: refused after a name that is not a
            // directory's (`a_trailing_slash_after_a_file_name_is_refused`).
            if slash {
                s.push('/');
            }
            let out = PathBuf::from(&s);
            let n = if several { 3 } else { 1 };
            let mut args = vec![
                "pack".as_ref(),
                input.as_os_str(),
                "--out".as_ref(),
                out.as_os_str(),
                "--no-share-prefixes".as_ref(),
            ];
            if several {
                args.extend([OsStr::new("--budget"), OsStr::new("1000")]);
            }
            let before = snapshot(&c);
            let (st, e) = run_limited(&args, &err);
            let after = snapshot(&c);
            let what = format!("pack --out {out:?} ({n} packs): {st}, {e}");
            // 1: an error, 2: a usage error (src/bin/treeattn/main.rs).
            assert!(matches!(st.code(), Some(0..=2)), "{what}");
            assert!(!e.contains("panicked"), "{what}");
            assert!(
                leftovers(&after).is_empty(),
                "{what}: left {:?}",
                leftovers(&after)
            );
            if !st.success() {
                assert!(!e.trim().is_empty(), "{what}: no message");
                assert!(
                    before == after,
                    "{what}: a failed run changed the directory"
                );
                failed_runs.set(failed_runs.get() + 1);
                return Ok(());
            }
            ok_runs.set(ok_runs.get() + 1);
            let mut allowed = Vec::new();
            for (i, want) in refs[&n].iter().enumerate() {
                let p = output_path(&out, i, n);
                let bytes = std::fs::read(&p).unwrap_or_else(|err| panic!("{what}: {p:?}: {err}"));
                assert!(bytes == *want, "{what}: {p:?} is not the reference pack");
                allowed.extend(lands(&p));
            }
            for (p, was) in &before {
                let now = after.get(p);
                if now == Some(was) || allowed.contains(p) {
                    continue;
                }
                assert!(
                    // A pack of an earlier run at the name (or a link to one).
                    now.is_none()
                        && stale_name(&out, p)
                        && matches!(was, Entry::File(_) | Entry::Link(_)),
                    "{what}: {p:?} changed ({now:?})"
                );
            }
            for p in after.keys() {
                assert!(
                    before.contains_key(p) || allowed.contains(p),
                    "{what}: {p:?} appeared"
                );
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "output paths: {} runs succeeded, {} refused",
        ok_runs.get(),
        failed_runs.get()
    );
    assert!(ok_runs.get() > 5 && failed_runs.get() > 5);
    let _ = std::fs::remove_dir_all(&d);
}

/// Found by the fuzzing above (src/bin/treeattn/pack.rs): `--out NAME/`
/// (and `NAME/.`) was written as `NAME` — a link at `NAME` was replaced by
/// a regular file instead of followed, and a missing `NAME` was created —
/// where `cp` and the shell refuse such a path (`ENOTDIR`). Now refused,
/// the directory untouched.
#[test]
fn a_trailing_slash_after_a_file_name_is_refused() {
    let d = scratch("slash");
    let w = d.join("w");
    std::fs::create_dir(&w).unwrap();
    std::fs::write(w.join("file.safetensors"), b"not a pack").unwrap();
    std::os::unix::fs::symlink("file.safetensors", w.join("link-file")).unwrap();
    let err = d.join("stderr");
    for name in [
        "link-file/",
        "new.safetensors/",
        "file.safetensors/",
        "new.safetensors/.",
    ] {
        let before = snapshot(&w);
        let out = format!("{}/{name}", w.display());
        let args = ["pack", SAMPLE, "--out", &out].map(OsStr::new);
        let (st, e) = run_limited(&args, &err);
        assert!(!st.success(), "--out {out} was written: {e}");
        assert!(before == snapshot(&w), "--out {out} changed the directory");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[cfg(unix)]
#[test]
fn signals_at_random_moments_leave_one_whole_set() {
    use std::os::unix::process::ExitStatusExt;
    let d = scratch("signals");
    let set = d.join("set");
    std::fs::create_dir(&set).unwrap();
    let out = set.join("p.safetensors");
    let err = d.join("stderr");
    let pack = |budget: &'static str| -> Vec<&OsStr> {
        vec![
            OsStr::new("pack"),
            OsStr::new(SAMPLE),
            OsStr::new("--out"),
            out.as_os_str(),
            OsStr::new("--budget"),
            OsStr::new(budget),
            OsStr::new("--no-share-prefixes"),
        ]
    };
    // The new set (4 packs) and the earlier one (2 packs), and how long a
    // run takes here.
    let (st, e) = run_limited(&pack("800"), &err);
    assert!(st.success(), "{e}");
    let new = snapshot(&set);
    for p in new.keys() {
        std::fs::remove_file(p).unwrap();
    }
    let start = Instant::now();
    let (st, e) = run_limited(&pack("2000"), &err);
    let took = start.elapsed();
    assert!(st.success(), "{e}");
    let old = snapshot(&set);
    assert_eq!((old.len(), new.len()), (2, 4));
    let counts = std::cell::Cell::new([0usize; 3]);
    let strategy = (0usize..3, 0u32..1300);
    let mut runner = TestRunner::new(Config {
        cases: 30,
        rng_seed: RngSeed::Fixed(0x41_6202),
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&strategy, |(sig, permille)| {
            // The earlier set, as the last run left it.
            for p in snapshot(&set).keys() {
                std::fs::remove_file(p).unwrap();
            }
            for (p, e) in &old {
                let Entry::File(b) = e else { unreachable!() };
                std::fs::write(p, b).unwrap();
            }
            let (name, number) = [("INT", 2), ("TERM", 15), ("HUP", 1)][sig];
            let mut child = Command::new(BIN)
                .args(pack("800"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            std::thread::sleep(took.mul_f64(f64::from(permille) / 1000.0));
            let sent = Command::new("kill")
                .args([format!("-{name}"), child.id().to_string()])
                .status()
                .unwrap();
            assert!(sent.success());
            let start = Instant::now();
            let status = loop {
                if let Some(s) = child.try_wait().unwrap() {
                    break s;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "SIG{name}: the run hangs"
                );
                std::thread::sleep(Duration::from_millis(2));
            };
            let by_signal = status.signal() == Some(number) || status.code() == Some(128 + number);
            assert!(
                status.success() || by_signal,
                "SIG{name} after {permille}‰: {status}"
            );
            let now = snapshot(&set);
            assert!(
                leftovers(&now).is_empty(),
                "SIG{name}: left {:?}",
                leftovers(&now)
            );
            let mut c = counts.get();
            if now == old {
                c[0] += 1;
            } else if now == new {
                c[1 + usize::from(status.success())] += 1;
            } else {
                panic!(
                    "SIG{name} after {permille}‰ ({status}): neither set whole: {:?}",
                    now.keys().collect::<Vec<_>>()
                );
            }
            counts.set(c);
            Ok(())
        })
        .unwrap();
    let c = counts.get();
    eprintln!(
        "signals: {} runs left the earlier set, {} the new set and ended by the signal, {} finished first",
        c[0], c[1], c[2]
    );
    let _ = std::fs::remove_dir_all(&d);
}
