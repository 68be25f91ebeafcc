//! `treeattn gen`: write generated rollouts as JSONL.

use std::io::Write;

use clap::Args;
use treeattn::{Error, Result};
use treeattn_lab::gen::{generate, with_rewards, Shape};

use crate::args::{closed_pipe, number, plural};
use crate::output;

/// Generate rollouts (golden, compaction, stack-pop, fold, memex, grpo, plain).
#[derive(Args, Debug)]
#[command(long_about = "\
Generates rollouts of each SHAPE in turn, all from the same seed, and writes
them as JSON Lines to FILE (stdout when --out is absent or `-`; a closed pipe,
as in `treeattn gen ... | head`, ends the output quietly).
Shapes: golden (the worked example of DESIGN.md §4), compaction, stack-pop, fold,
memex, grpo (a group of 16 rollouts sharing a prompt), plain (no edits).
Ids are SHAPE-SEED (grpo: grpo-SEED-00 .. -15; golden: golden); a file must
not repeat an id. A file is written atomically (a temporary file, renamed;
a link at FILE is followed and a directory, FIFO or device refused).
With --rewards every rollout also gets a \"reward\" (0 or 1, drawn from the
seed) and grpo rollouts the \"group\" grpo-SEED: input for treeattn.rl.")]
pub struct GenArgs {
    /// Tree shapes to generate, in order.
    #[arg(value_name = "SHAPE", required = true, value_parser = shape)]
    shapes: Vec<Shape>,
    /// Seed of every generator.
    #[arg(long, value_name = "N", default_value = "0", value_parser = number)]
    seed: u64,
    /// Output file (`-` for stdout).
    #[arg(long, value_name = "FILE.jsonl")]
    out: Option<String>,
    /// The sizes of DESIGN.md §1 instead of the CPU-sized defaults.
    #[arg(long)]
    paper_scale: bool,
    /// Write a reward (0 or 1) on every rollout and a group on GRPO ones.
    #[arg(long)]
    rewards: bool,
}

fn shape(s: &str) -> std::result::Result<Shape, String> {
    Shape::parse(s).map_err(|e| match e {
        Error::Usage(m) => m,
        other => other.to_string(),
    })
}

pub fn run(a: GenArgs) -> Result<()> {
    let mut rollouts = Vec::new();
    for &s in &a.shapes {
        let generated = generate(s, a.seed, a.paper_scale)?;
        rollouts.extend(if a.rewards {
            with_rewards(s, a.seed, generated)?
        } else {
            generated
        });
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(r) = rollouts.iter().find(|r| !seen.insert(r.id().to_string())) {
        return Err(Error::Usage(format!(
            "rollout id {:?} would appear twice in one file",
            r.id()
        )));
    }
    match a.out.as_deref() {
        None | Some("-") => {
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            let written = rollouts
                .iter()
                .try_for_each(|r| writeln!(out, "{}", r.to_json()))
                .and_then(|_| out.flush());
            match written {
                // The reader has gone (`| head`): not an error.
                Err(e) if !closed_pipe(&e) => Err(Error::Io(format!("stdout: {e}"))),
                _ => Ok(()),
            }
        }
        Some(path) => {
            let mut bytes = Vec::new();
            treeattn::rollout::write_jsonl(&mut bytes, &rollouts)?;
            let mut staged = output::staged();
            staged.stage(std::path::Path::new(path), &bytes)?;
            output::commit(staged)?;
            eprintln!("wrote {} to {path}", plural(rollouts.len(), "rollout"));
            Ok(())
        }
    }
}
