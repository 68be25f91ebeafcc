//! `treeattn demo`: a thin front over [`treeattn_lab::demo::run`].

use std::path::PathBuf;

use clap::Args;
use treeattn::Result;
use treeattn_lab::demo::{run as run_demo, DemoOptions};

use crate::args::{emit, number, positive};

/// The main job: trie pack vs LogitTree vs naive methods on a tiny model
/// (bundled sample by default).
#[derive(Args, Debug)]
#[command(long_about = "\
The main job: trie pack vs LogitTree vs naive methods on a tiny model.

Packs the rollouts (the bundled sample by default) into one forest, runs a
tiny random-weight transformer (f32) forward and backward on the trie pack,
the branch-replicated pack, LogitTree's K+1 branch passes, Naive-Full and
Naive-Compressed, and prints per method: tokens processed, attention FLOPs
(visible pairs × 4·head_dim × heads × layers, forward) and wall time; the
largest |Δ log-prob| of trie vs LogitTree; the drift of the naive methods
against the exact log-probs; SDCC's forward KL at the diverging targets.
Inputs larger than the demo's limit (see `treeattn_lab::demo::MAX_DEMO_TOKENS`)
are refused up front with the figures; use `treeattn inspect` for those.")]
pub struct DemoArgs {
    /// Rollouts to run on (JSON Lines); default: the bundled sample.
    #[arg(long, value_name = "FILE.jsonl")]
    input: Option<PathBuf>,
    /// Seed of the model weights.
    #[arg(long, value_name = "N", default_value = "0", value_parser = number)]
    seed: u64,
    /// Timed runs per method (the best is shown).
    #[arg(long, value_name = "N", default_value = "3", value_parser = positive)]
    repeats: usize,
}

pub fn run(a: DemoArgs) -> Result<()> {
    let report = run_demo(&DemoOptions {
        input: a.input,
        seed: a.seed,
        repeats: a.repeats,
    })?;
    emit(&format!("{report}\n"))
}
