//! The CLI's output files (`pack --out`, `gen --out`): nothing lost,
//! nothing stale. Special files are refused, links followed, a failed
//! multi-pack write leaves the previous run's files byte for byte, fewer
//! packs remove the rest, leftovers of dead writers are removed, a signal
//! removes the temporaries, the same input gives the same bytes, and an
//! empty input is an error naming it.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/sample.jsonl");
const BIN: &str = env!("CARGO_BIN_EXE_treeattn");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treeattn-out-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every file of `d` (hidden ones too) with the length and a hash of its
/// bytes; `None` for what is not a regular file.
fn snapshot(d: &Path) -> BTreeMap<String, Option<(usize, u64)>> {
    use std::hash::{Hash, Hasher};
    let digest = |bytes: Vec<u8>| {
        // SipHash with fixed keys: the same bytes, the same hash.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut h);
        (bytes.len(), h.finish())
    };
    std::fs::read_dir(d)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let regular = e.file_type().unwrap().is_file();
            let name = e.file_name().to_string_lossy().into_owned();
            (
                name,
                regular.then(|| digest(std::fs::read(e.path()).unwrap())),
            )
        })
        .collect()
}

fn names(d: &Path) -> Vec<String> {
    snapshot(d).into_keys().collect()
}

/// `treeattn pack SAMPLE --out OUT --budget B --no-share-prefixes`: 2000
/// gives 2 packs, 1000 gives 3, 800 gives 4, 100000 one.
fn pack(out: &Path, budget: &str) -> Output {
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
}

fn mkfifo(p: &Path) -> bool {
    let made = Command::new("mkfifo").arg(p).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("no mkfifo here: the FIFO case is skipped");
        return false;
    }
    true
}

/// Exit 1 with an error that names `shown` and no temporary file.
fn refused(o: &Output, shown: &Path) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains(&shown.display().to_string()), "{e}");
    assert!(!e.contains(".tmp-") && !e.contains(".bak-"), "{e}");
}

#[test]
fn special_files_at_an_output_name_are_refused_untouched() {
    let d = scratch("special");
    let fifo = d.join("fifo.safetensors");
    let dir = d.join("dir.jsonl");
    std::fs::create_dir(&dir).unwrap();
    let mut outs = vec![dir.clone()];
    if mkfifo(&fifo) {
        outs.push(fifo.clone());
    }
    // A link to the directory (the link is followed, then refused).
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink("dir.jsonl", d.join("to-dir.jsonl")).unwrap();
        outs.push(d.join("to-dir.jsonl"));
    }
    let before = snapshot(&d);
    for out in &outs {
        let o = run(&["gen", "golden", "--out", out.to_str().unwrap()]);
        refused(&o, out);
        assert!(stderr(&o).contains("refusing"), "{}", stderr(&o));
    }
    if outs.contains(&fifo) {
        // One pack: the FIFO is the file itself (a reader would have got a
        // pack, or as root the FIFO been replaced by a file).
        let o = run(&["pack", SAMPLE, "--out", fifo.to_str().unwrap()]);
        refused(&o, &fifo);
        assert!(stderr(&o).contains("is a FIFO"), "{}", stderr(&o));
        // Several packs: a FIFO at the name of pack 1.
        let fifo1 = d.join("p-00001.safetensors");
        assert!(mkfifo(&fifo1));
        let o = run(&[
            "pack",
            SAMPLE,
            "--out",
            d.join("p.safetensors").to_str().unwrap(),
            "--budget",
            "1000",
        ]);
        refused(&o, &fifo1);
        std::fs::remove_file(&fifo1).unwrap();
    }
    assert_eq!(snapshot(&d), before, "nothing written, nothing replaced");
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if outs.contains(&fifo) {
            assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        }
    }
}

#[cfg(unix)]
#[test]
fn a_link_at_out_is_followed_and_stays_a_link() {
    let d = scratch("link");
    std::fs::create_dir(d.join("store")).unwrap();
    std::fs::write(d.join("store/pack.safetensors"), b"old").unwrap();
    std::fs::write(d.join("store/rollouts.jsonl"), b"old").unwrap();
    std::os::unix::fs::symlink("store/pack.safetensors", d.join("p.safetensors")).unwrap();
    std::os::unix::fs::symlink("store/rollouts.jsonl", d.join("r.jsonl")).unwrap();
    let plain = d.join("plain.safetensors");
    run(&["pack", SAMPLE, "--out", plain.to_str().unwrap()]);
    let o = run(&[
        "pack",
        SAMPLE,
        "--out",
        d.join("p.safetensors").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&[
        "gen",
        "golden",
        "--out",
        d.join("r.jsonl").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for link in ["p.safetensors", "r.jsonl"] {
        let m = std::fs::symlink_metadata(d.join(link)).unwrap();
        assert!(m.file_type().is_symlink(), "{link} is still a link");
    }
    assert_eq!(
        std::fs::read(d.join("store/pack.safetensors")).unwrap(),
        std::fs::read(&plain).unwrap(),
        "the link's target holds the pack"
    );
    let golden = std::fs::read_to_string(d.join("store/rollouts.jsonl")).unwrap();
    assert!(golden.starts_with("{\"calls\""), "{golden}");
    assert_eq!(
        names(&d.join("store")),
        ["pack.safetensors", "rollouts.jsonl"],
        "no temporary file left beside the targets"
    );
}

/// `treeattn pack ... --budget B --no-share-prefixes` stopped before its
/// commit (the test hook), once it says so on stderr.
fn paused_pack(out: &Path, budget: &str) -> Child {
    let mut child = Command::new(BIN)
        .args([
            "pack",
            SAMPLE,
            "--out",
            out.to_str().unwrap(),
            "--budget",
            budget,
            "--no-share-prefixes",
        ])
        .env("TREEATTN_TEST_PAUSE_BEFORE_COMMIT", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "paused before commit");
    child.stderr = Some(err.into_inner());
    child
}

#[test]
fn a_failed_multi_pack_write_leaves_the_previous_run_as_it_was() {
    let d = scratch("undo");
    let out = d.join("p.safetensors");
    pack(&out, "2000");
    let before = snapshot(&d);
    assert_eq!(before.len(), 2, "{:?}", before.keys());
    // The next run writes 4 packs. While it waits before its commit, a
    // directory takes the name of its last pack: the commit fails after
    // packs 0..2 (two of them over the earlier run's) are in place.
    let mut child = paused_pack(&out, "800");
    let blocker = d.join("p-00003.safetensors");
    std::fs::create_dir(&blocker).unwrap();
    drop(child.stdin.take());
    let o = child.wait_with_output().unwrap();
    refused(&o, &blocker);
    let mut want = before;
    want.insert("p-00003.safetensors".into(), None);
    assert_eq!(
        snapshot(&d),
        want,
        "the earlier packs byte for byte, no new, temporary or backup file"
    );
}

#[test]
fn fewer_packs_leave_no_stale_packs() {
    let d = scratch("fewer");
    let out = d.join("p.safetensors");
    let set =
        |n: usize| -> Vec<String> { (0..n).map(|i| format!("p-{i:05}.safetensors")).collect() };
    pack(&out, "800");
    assert_eq!(names(&d), set(4));
    let o = pack(&out, "1000");
    assert_eq!(names(&d), set(3));
    assert!(stderr(&o).contains("p-00003.safetensors"), "{}", stderr(&o));
    pack(&out, "2000");
    assert_eq!(names(&d), set(2));
    pack(&out, "100000");
    assert_eq!(names(&d), ["p.safetensors"]);
    pack(&out, "800");
    assert_eq!(names(&d), set(4));
}

#[test]
fn a_later_run_removes_the_temporaries_of_a_dead_writer() {
    let d = scratch("leftovers");
    let gone = {
        let mut c = Command::new("true").spawn().unwrap();
        c.wait().unwrap();
        c.id()
    };
    // Beside the two packs the next run writes: what a killed writer left.
    let leftovers = [
        format!(".p-00000.safetensors.tmp-{gone}-0"),
        format!(".p-00000.safetensors.bak-{gone}-5"),
        format!(".p-00001.safetensors.tmp-{gone}-3"),
    ];
    // A live writer's (this test process) stays.
    let live = format!(".p-00000.safetensors.tmp-{}-0", std::process::id());
    for n in leftovers.iter().chain([&live]) {
        std::fs::write(d.join(n), b"partial").unwrap();
    }
    pack(&d.join("p.safetensors"), "2000");
    let mut want = vec![
        live,
        "p-00000.safetensors".to_string(),
        "p-00001.safetensors".to_string(),
    ];
    if !cfg!(target_os = "linux") {
        want.extend(leftovers.iter().cloned()); // no /proc to ask: left alone
    }
    want.sort();
    assert_eq!(names(&d), want);
}

#[cfg(unix)]
#[test]
fn a_signal_removes_the_temporaries_and_ends_the_process() {
    use std::os::unix::process::ExitStatusExt;
    let d = scratch("signal");
    let out = d.join("p.safetensors");
    pack(&out, "2000");
    let before = snapshot(&d);
    for (name, number) in [("TERM", 15), ("INT", 2)] {
        let mut child = paused_pack(&out, "800");
        // Held open until the child has ended: closing it would let the
        // commit run (and win the race with the signal's cleanup).
        let stdin = child.stdin.take();
        // The four packs are staged: their temporaries exist now.
        assert!(
            names(&d).iter().any(|n| n.contains(".tmp-")),
            "{:?}",
            names(&d)
        );
        let killed = Command::new("kill")
            .args([&format!("-{name}"), &child.id().to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let o = child.wait_with_output().unwrap();
        drop(stdin);
        assert_eq!(o.status.signal(), Some(number), "SIG{name}: {}", stderr(&o));
        assert_eq!(
            snapshot(&d),
            before,
            "SIG{name}: the earlier packs, nothing else"
        );
    }
}

#[test]
fn the_same_input_gives_the_same_bytes() {
    let (a, b) = (scratch("same-a"), scratch("same-b"));
    for (budget, share) in [
        ("100000", "--share-prefixes"),
        ("800", "--no-share-prefixes"),
    ] {
        for d in [&a, &b] {
            let out = d.join("p.safetensors");
            let o = run(&[
                "pack",
                SAMPLE,
                "--out",
                out.to_str().unwrap(),
                "--budget",
                budget,
                share,
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
        }
        assert!(!snapshot(&a).is_empty());
        assert_eq!(snapshot(&a), snapshot(&b), "--budget {budget} {share}");
    }
}

#[test]
fn an_empty_input_is_an_error_naming_it() {
    let d = scratch("empty");
    let empty = d.join("empty.jsonl");
    std::fs::write(&empty, b"").unwrap();
    let blank = d.join("blank.jsonl");
    std::fs::write(&blank, b"\n  \n").unwrap();
    let out = d.join("p.safetensors");
    for (f, why) in [(&empty, "empty"), (&blank, "only blank lines")] {
        for args in [
            vec!["inspect", f.to_str().unwrap()],
            vec!["pack", f.to_str().unwrap(), "--out", out.to_str().unwrap()],
        ] {
            let o = run(&args);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
            assert!(
                e.contains(&format!("{}: no rollouts", f.display())) && e.contains(why),
                "{args:?}: {e}"
            );
            assert!(!e.contains("i/o error"), "{args:?}: {e}");
        }
    }
    assert!(!out.exists());
}
