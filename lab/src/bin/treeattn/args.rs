//! Shared helpers of the subcommands: number parsers for clap, reading a
//! rollout file, writing to stdout through a closed pipe, plurals.

use std::path::Path;

use treeattn::{Error, Result};

/// A non-negative integer; `_` may group digits (`1_000_000`).
pub fn number(s: &str) -> std::result::Result<u64, String> {
    s.replace('_', "")
        .parse::<u64>()
        .map_err(|_| format!("{s:?} is not a non-negative integer"))
}

/// A positive integer that fits in `usize`.
pub fn positive(s: &str) -> std::result::Result<usize, String> {
    match number(s)? {
        0 => Err("must be at least 1".into()),
        n => usize::try_from(n).map_err(|_| format!("{n} is too large")),
    }
}

/// Reads and validates a JSONL rollout file; one without a rollout is an
/// error naming it.
pub fn read_rollouts(path: &str) -> Result<Vec<treeattn::rollout::Rollout>> {
    nonempty(path, treeattn::rollout::read_jsonl_file(Path::new(path))?)
}

/// `rollouts` read from `path`, refused when there are none.
pub fn nonempty(
    path: &str,
    rollouts: Vec<treeattn::rollout::Rollout>,
) -> Result<Vec<treeattn::rollout::Rollout>> {
    if rollouts.is_empty() {
        return Err(treeattn::rollout::no_rollouts_error(Path::new(path)));
    }
    Ok(rollouts)
}

/// `1 rollout`, `2 rollouts`.
pub fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// Whether an i/o error is a closed pipe (`treeattn ... | head`): the
/// reader has gone, so the output ends quietly instead of failing.
pub fn closed_pipe(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::BrokenPipe
}

/// Writes `text` to stdout; a closed pipe ends the output quietly.
pub fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if !closed_pipe(&e) => Err(Error::Io(format!("stdout: {e}"))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_plurals() {
        assert_eq!(number("1_000"), Ok(1000));
        assert!(number("-1").is_err() && number("x").is_err());
        assert_eq!(positive("3"), Ok(3));
        assert!(positive("0").unwrap_err().contains("at least 1"));
        assert_eq!(plural(1, "rollout"), "1 rollout");
        assert_eq!(plural(0, "rollout"), "0 rollouts");
        assert_eq!(plural(2, "SDCC pair"), "2 SDCC pairs");
    }
}
