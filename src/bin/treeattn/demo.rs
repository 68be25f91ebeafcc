//! `treeattn demo`: a thin front over [`treeattn::demo::run`].

use treeattn::demo::{run as run_demo, DemoOptions};
use treeattn::{Error, Result};

use crate::args::{emit, Args};

const HELP: &str = "\
treeattn demo [--input FILE.jsonl] [--seed N] [--repeats N]

Packs the rollouts (the bundled sample by default) into one forest, runs a
tiny random-weight transformer (f32) forward and backward on the trie pack,
the branch-replicated pack, LogitTree's K+1 branch passes, Naive-Full and
Naive-Compressed, and prints per method: tokens processed, attention FLOPs
(visible pairs × 4·head_dim × heads × layers, forward) and wall time; the
largest |Δ log-prob| of trie vs LogitTree; the drift of the naive methods
against the exact log-probs; SDCC's forward KL at the diverging targets.
--seed sets the model weights (default 0); --repeats how many timed runs per
method (default 3, the best is shown).";

pub fn run(args: Vec<String>) -> Result<()> {
    let mut a = Args::new(args);
    if a.help() {
        return emit(&format!("{HELP}\n"));
    }
    let defaults = DemoOptions::default();
    let input = a.value("input")?.map(Into::into);
    let seed = a.number("seed")?.unwrap_or(defaults.seed);
    let repeats = match a.number("repeats")? {
        None => defaults.repeats,
        Some(0) => return Err(Error::Usage("--repeats must be at least 1".into())),
        Some(n) => {
            usize::try_from(n).map_err(|_| Error::Usage(format!("--repeats {n} is too large")))?
        }
    };
    let extra = a.positionals()?;
    if !extra.is_empty() {
        return Err(Error::Usage(format!(
            "demo takes no positional arguments, got {extra:?}"
        )));
    }
    let report = run_demo(&DemoOptions {
        input,
        seed,
        repeats,
    })?;
    emit(&format!("{report}\n"))
}
