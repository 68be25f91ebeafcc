//! `treeattn gen`: write generated rollouts as JSONL.

use std::io::Write;

use treeattn::gen::{generate, Shape};
use treeattn::rollout::write_jsonl;
use treeattn::{Error, Result};

use crate::args::{emit, Args};

const HELP: &str = "\
treeattn gen SHAPE... [--seed N] [--out FILE.jsonl] [--paper-scale]

Generates rollouts of each SHAPE in turn, all from the same seed (default 0),
and writes them as JSON Lines to FILE (stdout when --out is absent or `-`).
Shapes: golden (the worked example of DESIGN.md §4), compaction, stack-pop,
fold, memex, grpo (a group of 16 rollouts sharing a prompt), plain (no edits).
Ids are SHAPE-SEED (grpo: grpo-SEED-00 .. -15; golden: golden); a file must
not repeat an id. --paper-scale uses the sizes of DESIGN.md §1 instead of the
CPU-sized defaults.";

pub fn run(args: Vec<String>) -> Result<()> {
    let mut a = Args::new(args);
    if a.help() {
        return emit(&format!("{HELP}\n"));
    }
    let seed = a.number("seed")?.unwrap_or(0);
    let out = a.value("out")?;
    let paper = a.flag("paper-scale")?;
    let shapes = a.positionals()?;
    if shapes.is_empty() {
        return Err(Error::Usage("gen needs at least one SHAPE".into()));
    }
    let mut rollouts = Vec::new();
    for s in &shapes {
        rollouts.extend(generate(Shape::parse(s)?, seed, paper)?);
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(r) = rollouts.iter().find(|r| !seen.insert(r.id().to_string())) {
        return Err(Error::Usage(format!(
            "rollout id {:?} would appear twice in one file",
            r.id()
        )));
    }
    match out.as_deref() {
        None | Some("-") => write_jsonl(std::io::stdout().lock(), &rollouts),
        Some(path) => {
            let f = std::fs::File::create(path).map_err(|e| Error::Io(format!("{path}: {e}")))?;
            let mut w = std::io::BufWriter::new(f);
            write_jsonl(&mut w, &rollouts)?;
            w.flush().map_err(|e| Error::Io(format!("{path}: {e}")))?;
            eprintln!("wrote {} rollouts to {path}", rollouts.len());
            Ok(())
        }
    }
}
