//! Output files that appear whole, together, or not at all.
//!
//! [`StagedFiles::stage`] writes each file to a temporary `.NAME.tmp-PID-N`
//! beside its target and syncs it; [`StagedFiles::commit`] renames them all
//! over their targets. Dropped uncommitted (an error, a panic), it removes
//! its temporary files. The rules:
//!
//! - A regular file at a target is replaced by one `rename`: a reader sees
//!   the old file or the new one, never a mix or nothing.
//! - A symbolic link at a target is followed (to its final target, relative
//!   links from the link's directory) and that file is replaced; the link
//!   stays a link.
//! - A directory, FIFO, socket or device at a target is an error that names
//!   the path given, before anything is written (`--out /dev/null` used to
//!   replace `/dev/null` with a regular file when run as root).
//! - Several files are all-or-nothing: before a target is replaced, its old
//!   file gets a second name (a hard link, or a copy where the file system has
//!   none), `.NAME.bak-PID-N`; if any later step fails, every file already
//!   replaced gets its old file back and every new one is removed. Files
//!   given to [`StagedFiles::remove`] (a previous run's files that the new
//!   set does not replace) are removed in the same commit, undone the same way.
//! - Staging a file removes the `.NAME.tmp-PID-N` and `.NAME.bak-PID-N` left
//!   beside its target by a writer that no longer runs (on Linux, where
//!   `/proc/PID` tells; elsewhere they are left alone).
//! - [`remove_uncommitted`] removes this process's temporary files, for a
//!   signal handler (the CLI's); a commit in progress finishes or restores
//!   first.
//!
//! Errors name the target as the caller gave it, never a temporary name.
//! What no process can do: a `SIGKILL` or a power loss in the middle of a
//! commit of several files can leave some of them replaced and others not
//! (the old ones survive as `.NAME.bak-PID-N` until the next writer there).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::{Error, Result};

/// This process's temporary files that exist (or are being created).
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The `N` of `.NAME.tmp-PID-N`, unique in the process.
static SERIAL: AtomicUsize = AtomicUsize::new(0);

fn live() -> MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes every temporary file of this process's uncommitted
/// [`StagedFiles`] and returns holding the lock on them: while the guard
/// lives, no file is staged and no commit starts, and a commit in progress
/// has finished (or restored the old files) before this returns. For a
/// signal handler that ends the process next.
#[must_use = "the guard keeps new temporary files from appearing until the process ends"]
pub fn remove_uncommitted() -> MutexGuard<'static, Vec<PathBuf>> {
    let mut files = live();
    for f in files.drain(..) {
        let _ = std::fs::remove_file(f);
    }
    files
}

/// A target as the caller named it (for messages) and as the file system
/// resolves it (links followed; for the writes).
#[derive(Debug)]
struct Target {
    shown: PathBuf,
    real: PathBuf,
}

impl Target {
    /// Follows links and refuses anything at the path that is not a regular
    /// file.
    fn resolve(shown: &Path) -> Result<Target> {
        let real = follow_links(shown)?;
        check_replaceable(shown, &real)?;
        Ok(Target {
            shown: shown.to_path_buf(),
            real,
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> Error {
        Error::Io(format!("{}: {e}", self.shown.display()))
    }
}

/// The file a path names once every symbolic link is followed, in its
/// directory's canonical form (the file itself need not exist).
fn follow_links(shown: &Path) -> Result<PathBuf> {
    let err = |e: &dyn std::fmt::Display| Error::Io(format!("{}: {e}", shown.display()));
    let mut p = shown.to_path_buf();
    // Linux's own limit on links followed in one path.
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p).map_err(|e| err(&e))?;
                // A relative link is relative to the link's directory.
                p = p.parent().map_or(to.clone(), |d| d.join(&to));
            }
            _ => {
                let name = p.file_name().ok_or_else(|| err(&"not a file name"))?;
                let dir = match p.parent() {
                    Some(d) if !d.as_os_str().is_empty() => d,
                    _ => Path::new("."),
                };
                let dir = std::fs::canonicalize(dir).map_err(|e| err(&e))?;
                return Ok(dir.join(name));
            }
        }
    }
    Err(err(&"too many levels of symbolic links"))
}

/// Nothing, or a regular file, may be at `real`.
fn check_replaceable(shown: &Path, real: &Path) -> Result<()> {
    match std::fs::metadata(real) {
        Ok(m) if !m.is_file() => Err(Error::Io(format!(
            "{}: is {}, not a regular file; refusing to replace it",
            shown.display(),
            kind_of(&m.file_type())
        ))),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::Io(format!("{}: {e}", shown.display()))),
    }
}

/// "a directory", "a FIFO", ... for the message of [`check_replaceable`].
fn kind_of(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
    }
    "a special file"
}

/// `.NAME.KIND-PID-N` beside `real`.
fn sibling(real: &Path, kind: &str) -> PathBuf {
    let name = real.file_name().unwrap_or_default().to_string_lossy();
    real.with_file_name(format!(
        ".{name}.{kind}-{}-{}",
        std::process::id(),
        SERIAL.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Removes the temporary and backup files that a writer which no longer
/// runs left beside `real`. Best effort: what cannot be removed stays.
fn remove_stale_siblings(real: &Path) {
    let (Some(dir), Some(name)) = (real.parent(), real.file_name()) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let name = name.to_string_lossy();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let pid = ["tmp", "bak"]
            .iter()
            .find_map(|kind| file.strip_prefix(&format!(".{name}.{kind}-")))
            .and_then(writer_pid);
        let is_file = e.file_type().is_ok_and(|t| t.is_file());
        if pid.is_some_and(|p| p != std::process::id() && !running(p)) && is_file {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The `PID` of `PID-N`.
fn writer_pid(rest: &str) -> Option<u32> {
    let (pid, n) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
    (digits(pid) && digits(n)).then(|| pid.parse().ok())?
}

/// Whether process `pid` may still be running: on Linux, whether
/// `/proc/PID` exists (when `/proc` is mounted); elsewhere always, so that
/// nothing of a live writer is removed.
fn running(pid: u32) -> bool {
    if cfg!(target_os = "linux") && Path::new("/proc/self").exists() {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

/// A file written beside its target, to be renamed over it.
#[derive(Debug)]
struct Write {
    tmp: PathBuf,
    target: Target,
}

/// What a commit did to one path, and how to take it back: the old file's
/// second name to rename back, or nothing there before (remove the new one).
#[derive(Debug)]
struct Done {
    path: PathBuf,
    old: Option<PathBuf>,
}

impl Done {
    fn undo(&self) -> std::io::Result<()> {
        match &self.old {
            Some(old) => std::fs::rename(old, &self.path),
            None => std::fs::remove_file(&self.path),
        }
    }
}

/// Files written to temporary names next to their targets, put in place
/// together by [`StagedFiles::commit`] (the module docs give the rules).
#[derive(Debug, Default)]
pub struct StagedFiles {
    writes: Vec<Write>,
    /// Removed by the commit, as the caller named them (links not followed).
    removals: Vec<PathBuf>,
}

impl StagedFiles {
    /// No file staged yet.
    pub fn new() -> StagedFiles {
        StagedFiles::default()
    }

    /// Writes `bytes` to a temporary file beside `target` (beside the file
    /// a link at `target` leads to) and syncs it. An error names `target`.
    pub fn stage(&mut self, target: &Path, bytes: &[u8]) -> Result<()> {
        use std::io::Write as _;
        let target = Target::resolve(target)?;
        remove_stale_siblings(&target.real);
        let tmp = sibling(&target.real, "tmp");
        let mut f = create_registered(&tmp).map_err(|e| target.err(e))?;
        self.writes.push(Write { tmp, target });
        let target = &self.writes.last().expect("just pushed").target;
        f.write_all(bytes).map_err(|e| target.err(e))?;
        f.sync_all().map_err(|e| target.err(e))
    }

    /// Has the commit remove `path` (a file of an earlier run that this set
    /// replaces by nothing), undone with the rest if the commit fails.
    pub fn remove(&mut self, path: &Path) {
        self.removals.push(path.to_path_buf());
    }

    /// Renames every staged file over its target and removes the files
    /// given to [`StagedFiles::remove`]; on any error, puts every file it
    /// had changed back as it was.
    pub fn commit(mut self) -> Result<()> {
        let writes = std::mem::take(&mut self.writes);
        let removals = std::mem::take(&mut self.removals);
        // A signal's cleanup waits for the files to be in place or restored.
        let mut live = live();
        let mut done = Vec::with_capacity(writes.len() + removals.len());
        let steps = writes.len() + removals.len();
        let mut result = Ok(());
        for (k, w) in writes.iter().enumerate() {
            // The last step needs no backup: nothing after it can fail.
            result = replace(w, k + 1 < steps).map(|d| done.push(d));
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            for r in &removals {
                result = remove(r).map(|d| done.push(d));
                if result.is_err() {
                    break;
                }
            }
        }
        for w in &writes {
            // Renamed (gone) or, after an error, still there: removed.
            let _ = std::fs::remove_file(&w.tmp);
        }
        live.retain(|f| !writes.iter().any(|w| &w.tmp == f));
        match result {
            Ok(()) => {
                for old in done.iter().filter_map(|d| d.old.as_ref()) {
                    let _ = std::fs::remove_file(old);
                }
                sync_dirs(writes.iter().map(|w| w.target.real.as_path()));
                Ok(())
            }
            Err(e) => Err(undo_all(&done, e)),
        }
    }
}

/// Registers `tmp` as this process's, then creates it (under the lock, so
/// that a signal's cleanup sees every file that exists).
fn create_registered(tmp: &Path) -> std::io::Result<std::fs::File> {
    let mut files = live();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)?;
    files.push(tmp.to_path_buf());
    Ok(f)
}

/// Renames one staged file over its target, first giving the old file a
/// second name when `keep_old` (it may have to come back).
fn replace(w: &Write, keep_old: bool) -> Result<Done> {
    let t = &w.target;
    check_replaceable(&t.shown, &t.real)?;
    let old = if keep_old && t.real.exists() {
        let old = sibling(&t.real, "bak");
        std::fs::hard_link(&t.real, &old)
            .or_else(|_| std::fs::copy(&t.real, &old).map(drop))
            .map_err(|e| t.err(format_args!("keeping the old file: {e}")))?;
        Some(old)
    } else {
        None
    };
    if let Err(e) = std::fs::rename(&w.tmp, &t.real) {
        if let Some(old) = &old {
            let _ = std::fs::remove_file(old);
        }
        return Err(t.err(e));
    }
    Ok(Done {
        path: t.real.clone(),
        old,
    })
}

/// Removes `path` by renaming it to a backup name (removed after the
/// commit, renamed back if it fails).
fn remove(path: &Path) -> Result<Done> {
    let old = sibling(path, "bak");
    std::fs::rename(path, &old).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    Ok(Done {
        path: path.to_path_buf(),
        old: Some(old),
    })
}

/// Takes back every step of a failed commit, last first; the error says
/// what could not be taken back.
fn undo_all(done: &[Done], e: Error) -> Error {
    let failed: Vec<String> = done
        .iter()
        .rev()
        .filter_map(|d| {
            d.undo()
                .err()
                .map(|u| format!("{}: could not be restored: {u}", d.path.display()))
        })
        .collect();
    if failed.is_empty() {
        return e;
    }
    let e = match e {
        Error::Io(m) => m,
        other => other.to_string(),
    };
    Error::Io(format!("{e}; {}", failed.join("; ")))
}

/// Makes the renames durable where the platform allows it.
fn sync_dirs<'a>(targets: impl Iterator<Item = &'a Path>) {
    let mut dirs: Vec<&Path> = targets.filter_map(Path::parent).collect();
    dirs.sort();
    dirs.dedup();
    for d in dirs {
        if let Ok(f) = std::fs::File::open(d) {
            let _ = f.sync_all();
        }
    }
}

impl Drop for StagedFiles {
    fn drop(&mut self) {
        if self.writes.is_empty() {
            return;
        }
        let mut files = live();
        for w in &self.writes {
            let _ = std::fs::remove_file(&w.tmp);
        }
        files.retain(|f| !self.writes.iter().any(|w| &w.tmp == f));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("treeattn-staged-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Names in `d`, sorted (hidden ones too).
    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn staged_files_appear_together_or_not_at_all() {
        let dir = scratch("together");
        let (a, b) = (dir.join("a.bin"), dir.join("b.bin"));
        {
            let mut s = StagedFiles::new();
            s.stage(&a, b"one").unwrap();
            s.stage(&b, b"two").unwrap();
            // Dropped without commit: nothing is left, not even temporaries.
        }
        assert!(names(&dir).is_empty());
        let mut s = StagedFiles::new();
        s.stage(&a, b"one").unwrap();
        s.stage(&b, b"two").unwrap();
        assert!(!a.exists());
        s.commit().unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"one");
        assert_eq!(std::fs::read(&b).unwrap(), b"two");
        assert_eq!(names(&dir), ["a.bin", "b.bin"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_commit_puts_every_earlier_file_back() {
        let dir = scratch("undo");
        let (a, b, c, stale) = (
            dir.join("a"),
            dir.join("b"),
            dir.join("c"),
            dir.join("stale"),
        );
        std::fs::write(&a, b"old a").unwrap();
        std::fs::write(&stale, b"old stale").unwrap();
        // a replaces a file, b is new, the stale file is removed; c's rename
        // fails (its temporary file is gone) after a and b are in place.
        let mut s = StagedFiles::new();
        s.stage(&a, b"new a").unwrap();
        s.stage(&b, b"new b").unwrap();
        s.remove(&stale);
        s.stage(&c, b"new c").unwrap();
        std::fs::remove_file(&s.writes[2].tmp).unwrap();
        let e = s.commit().unwrap_err().to_string();
        assert!(e.contains(&c.display().to_string()), "{e}");
        assert!(
            !e.contains(".tmp-"),
            "names the target, not the temporary: {e}"
        );
        assert_eq!(std::fs::read(&a).unwrap(), b"old a");
        assert_eq!(std::fs::read(&stale).unwrap(), b"old stale");
        assert_eq!(
            names(&dir),
            ["a", "stale"],
            "no new, temporary or backup file"
        );
        // The same set without the failure: in place, the stale file gone.
        let mut s = StagedFiles::new();
        s.stage(&a, b"new a").unwrap();
        s.remove(&stale);
        s.stage(&c, b"new c").unwrap();
        s.commit().unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"new a");
        assert_eq!(names(&dir), ["a", "c"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_removal_puts_back_what_came_before() {
        let dir = scratch("undo-removal");
        let (a, one, two) = (dir.join("a"), dir.join("one"), dir.join("two"));
        std::fs::write(&a, b"old a").unwrap();
        std::fs::write(&one, b"old one").unwrap();
        // a is replaced and `one` removed before the removal of `two` (not
        // there) fails.
        let mut s = StagedFiles::new();
        s.stage(&a, b"new a").unwrap();
        s.remove(&one);
        s.remove(&two);
        let e = s.commit().unwrap_err().to_string();
        assert!(e.contains(&two.display().to_string()), "{e}");
        assert_eq!(std::fs::read(&a).unwrap(), b"old a");
        assert_eq!(std::fs::read(&one).unwrap(), b"old one");
        assert_eq!(names(&dir), ["a", "one"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_link_is_followed_and_stays_a_link() {
        let dir = scratch("link");
        std::fs::create_dir(dir.join("data")).unwrap();
        std::fs::write(dir.join("data/real"), b"old").unwrap();
        // A relative link, from the link's own directory.
        std::os::unix::fs::symlink("data/real", dir.join("link")).unwrap();
        // A link to a link to a file that does not exist yet.
        std::os::unix::fs::symlink("data/new", dir.join("to-new")).unwrap();
        std::os::unix::fs::symlink("to-new", dir.join("chain")).unwrap();
        let mut s = StagedFiles::new();
        s.stage(&dir.join("link"), b"new").unwrap();
        s.stage(&dir.join("chain"), b"made").unwrap();
        s.commit().unwrap();
        for l in ["link", "chain", "to-new"] {
            let m = std::fs::symlink_metadata(dir.join(l)).unwrap();
            assert!(m.file_type().is_symlink(), "{l} is still a link");
        }
        assert_eq!(std::fs::read(dir.join("data/real")).unwrap(), b"new");
        assert_eq!(std::fs::read(dir.join("data/new")).unwrap(), b"made");
        assert_eq!(names(&dir.join("data")), ["new", "real"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_or_fifo_is_refused_naming_the_path_given() {
        let dir = scratch("special");
        let sub = dir.join("sub");
        std::fs::create_dir(&sub).unwrap();
        let mut targets = vec![sub.clone()];
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            targets.push(fifo);
        } else {
            eprintln!("no mkfifo here: the FIFO half is skipped");
        }
        #[cfg(unix)]
        {
            // A link to the directory is refused the same way.
            std::os::unix::fs::symlink("sub", dir.join("to-sub")).unwrap();
            targets.push(dir.join("to-sub"));
        }
        let before = names(&dir);
        for t in &targets {
            let e = StagedFiles::new().stage(t, b"x").unwrap_err().to_string();
            assert!(
                e.contains(&format!("{}: is a ", t.display())) && e.contains("refusing"),
                "{e}"
            );
        }
        assert_eq!(names(&dir), before, "nothing written or replaced");
        assert!(names(&sub).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn staging_removes_the_temporaries_of_writers_that_are_gone() {
        let dir = scratch("stale-tmp");
        let gone = {
            let mut c = std::process::Command::new("true").spawn().unwrap();
            c.wait().unwrap();
            c.id()
        };
        let me = std::process::id();
        let leftovers = [format!(".out.tmp-{gone}-0"), format!(".out.bak-{gone}-7")];
        let kept = [
            format!(".out.tmp-{me}-999999"), // this process's own
            format!(".other.tmp-{gone}-0"),  // another target's
            format!(".out.tmp-{gone}-x"),    // not a name of ours
        ];
        for n in leftovers.iter().chain(&kept) {
            std::fs::write(dir.join(n), b"partial").unwrap();
        }
        let mut s = StagedFiles::new();
        s.stage(&dir.join("out"), b"whole").unwrap();
        s.commit().unwrap();
        let mut want: Vec<String> = kept.to_vec();
        want.push("out".into());
        if !cfg!(target_os = "linux") {
            want.extend(leftovers.iter().cloned());
        }
        want.sort();
        assert_eq!(names(&dir), want);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_name_the_target_never_the_temporary() {
        let dir = scratch("errors");
        let missing = dir.join("no-such-dir/out");
        let e = StagedFiles::new()
            .stage(&missing, b"x")
            .unwrap_err()
            .to_string();
        assert!(e.contains(&missing.display().to_string()), "{e}");
        assert!(!e.contains(".tmp-"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
