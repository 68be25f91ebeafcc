//! A tiny argument parser: `--flag`, `--key VALUE` / `--key=VALUE`, and
//! positionals. Options are taken out by name; whatever is left must be
//! positional, so a misspelt option is a usage error, not silently ignored.

use treeattn::{Error, Result};

pub struct Args {
    items: Vec<String>,
}

impl Args {
    pub fn new(items: Vec<String>) -> Args {
        Args { items }
    }

    /// True (and removed) when `--help` or `-h` is present.
    pub fn help(&mut self) -> bool {
        let n = self.items.len();
        self.items.retain(|a| a != "--help" && a != "-h");
        self.items.len() != n
    }

    /// Removes `--name`; true when it was present.
    pub fn flag(&mut self, name: &str) -> Result<bool> {
        let full = format!("--{name}");
        if let Some(bad) = self
            .items
            .iter()
            .find(|a| a.starts_with(&format!("{full}=")))
        {
            return Err(Error::Usage(format!("{bad}: --{name} takes no value")));
        }
        let n = self.items.len();
        self.items.retain(|a| *a != full);
        Ok(self.items.len() != n)
    }

    /// Removes `--name VALUE` or `--name=VALUE` and returns the value.
    pub fn value(&mut self, name: &str) -> Result<Option<String>> {
        let full = format!("--{name}");
        let prefix = format!("{full}=");
        let mut found = None;
        let mut i = 0;
        while i < self.items.len() {
            if self.items[i] == full {
                if i + 1 >= self.items.len() {
                    return Err(Error::Usage(format!("{full} needs a value")));
                }
                let v = self.items.remove(i + 1);
                self.items.remove(i);
                if found.replace(v).is_some() {
                    return Err(Error::Usage(format!("{full} given twice")));
                }
            } else if let Some(v) = self.items[i].strip_prefix(&prefix) {
                let v = v.to_string();
                self.items.remove(i);
                if found.replace(v).is_some() {
                    return Err(Error::Usage(format!("{full} given twice")));
                }
            } else {
                i += 1;
            }
        }
        Ok(found)
    }

    /// Removes `--name N` and parses it as an unsigned integer.
    pub fn number(&mut self, name: &str) -> Result<Option<u64>> {
        match self.value(name)? {
            None => Ok(None),
            Some(v) => {
                v.replace('_', "").parse::<u64>().map(Some).map_err(|_| {
                    Error::Usage(format!("--{name} {v:?} is not a non-negative integer"))
                })
            }
        }
    }

    /// The remaining arguments, which must all be positional.
    pub fn positionals(self) -> Result<Vec<String>> {
        if let Some(opt) = self
            .items
            .iter()
            .find(|a| a.starts_with('-') && a.len() > 1)
        {
            return Err(Error::Usage(format!("unknown option {opt}")));
        }
        Ok(self.items)
    }
}

/// Reads and validates a JSONL rollout file.
pub fn read_rollouts(path: &str) -> Result<Vec<treeattn::rollout::Rollout>> {
    treeattn::rollout::read_jsonl_file(std::path::Path::new(path))
}

/// Exactly one positional argument, named `what` in the error.
pub fn one_file(args: Args, what: &str) -> Result<String> {
    let mut p = args.positionals()?;
    match p.len() {
        1 => Ok(p.remove(0)),
        0 => Err(Error::Usage(format!("missing {what}"))),
        _ => Err(Error::Usage(format!(
            "expected one {what}, got {}",
            p.len()
        ))),
    }
}

/// Writes `text` to stdout; a closed pipe (`treeattn inspect ... | head`)
/// ends the output quietly instead of failing.
pub fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(Error::Io(format!("stdout: {e}")))
        }
        _ => Ok(()),
    }
}
