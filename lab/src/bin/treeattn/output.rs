//! Output files of the subcommands (`pack --out`, `gen --out`): committed
//! through [`StagedFiles`] (atomic, all-or-nothing, links followed, special
//! files refused), with their temporary files removed when SIGINT, SIGTERM
//! or SIGHUP ends the process.
//!
//! The signals are taken with `signal-hook` on an ordinary thread, not in a
//! signal handler: there the cleanup may lock the list of temporary files
//! (so that a commit in progress finishes or restores first) and remove
//! them, then re-raise the signal's default action, so that the process
//! still ends by that signal (a shell sees 130 / 143). A process killed by
//! SIGKILL leaves its temporary files; the next run that writes beside them
//! removes them (see `treeattn::staged`).

use treeattn::safetensors::StagedFiles;
use treeattn::Result;

/// An empty set of output files, with the cleanup on signals installed.
pub fn staged() -> StagedFiles {
    clean_up_on_signals();
    StagedFiles::new()
}

/// Puts the staged files in place.
pub fn commit(staged: StagedFiles) -> Result<()> {
    pause_for_tests();
    staged.commit()
}

/// Installs the cleanup on SIGINT, SIGTERM and SIGHUP (once). Where it
/// cannot be installed, a signal leaves the temporary files to the next run.
fn clean_up_on_signals() {
    #[cfg(unix)]
    {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
            else {
                return;
            };
            std::thread::spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    let _held = treeattn::staged::remove_uncommitted();
                    let _ = signal_hook::low_level::emulate_default_handler(sig);
                    std::process::exit(128 + sig);
                }
            });
        });
    }
}

/// Test hook: with `TREEATTN_TEST_PAUSE_BEFORE_COMMIT` set, says
/// `paused before commit` on stderr and waits for stdin to close, so that
/// a test can signal the process, or change the targets, at a known point.
fn pause_for_tests() {
    if std::env::var_os("TREEATTN_TEST_PAUSE_BEFORE_COMMIT").is_none() {
        return;
    }
    eprintln!("paused before commit");
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
}
