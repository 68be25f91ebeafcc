//! `treeattn bench`: the quick attention comparison of `treeattn_lab::bench`.

use clap::Args;
use std::path::PathBuf;

use treeattn::{Error, Result};
use treeattn_lab::bench::{
    costs, quick_with, sdcc_table, time_pack, Options, PackBenchOptions, Size,
};
use treeattn_lab::gen::Shape;

use crate::args::{emit, number, positive};

/// Time attention (trie pack vs LogitTree K+1 passes, replicated, dense
/// mask, Naive-Compressed) per shape; or count costs only, or time SDCC.
#[derive(Args, Debug)]
#[command(long_about = "\
Times attention forward and forward+backward (CPU backend, f32) on each tree
shape for: the trie pack (one exact pass), the branch-replicated pack, LogitTree's
K+1 causal passes, a dense-mask attention over the trie pack (L×L mask and
scores), Naive-Compressed, and a plain causal pack of the trie's length. Prints
tokens, visible pairs, GFLOP (4·d·heads per visible pair forward, ×3.5 with the
backward), median time, GFLOP/s and ratios to the trie pack, then per shape the
trie's FLOP/s over causal and its cost over Naive-Compressed.

Threads: TREEATTN_THREADS or all cores. Build with --release.")]
pub struct BenchArgs {
    /// Shapes, comma-separated (compaction, stack-pop, fold, memex, grpo,
    /// plain, golden) [default: all but golden].
    #[arg(long, value_name = "SHAPE,...")]
    shape: Option<String>,
    /// Timed repetitions (the median is shown) [default: 3].
    #[arg(long, value_name = "N", value_parser = positive)]
    reps: Option<usize>,
    /// Attention heads [default: 4].
    #[arg(long, value_name = "H", value_parser = positive)]
    heads: Option<usize>,
    /// Head dimension [default: 64].
    #[arg(long, value_name = "D", value_parser = positive)]
    head_dim: Option<usize>,
    /// Tree sizes: small (hundreds of tokens), bench (trie packs of ~1-2k
    /// tokens), paper (windows of up to 80k tokens, with --costs-only)
    /// [default: bench].
    #[arg(long, value_name = "small|bench|paper")]
    size: Option<String>,
    /// Seed of the generated trees [default: 0].
    #[arg(long, value_name = "N", value_parser = number)]
    seed: Option<u64>,
    /// Count tokens and visible pairs of every method without timing.
    #[arg(long, conflicts_with = "sdcc")]
    costs_only: bool,
    /// Time forward and forward+backward on this pack file (from `treeattn
    /// pack`) and on a causal mask of the same length, instead of the
    /// generated shapes.
    #[arg(long, value_name = "FILE.safetensors", conflicts_with_all = ["shape", "size", "costs_only", "sdcc"])]
    pack: Option<PathBuf>,
    /// With --pack: kv heads (divides --heads) [default: --heads].
    #[arg(long, value_name = "H", value_parser = positive, requires = "pack")]
    kv_heads: Option<usize>,
    /// With --pack: CPU threads [default: TREEATTN_THREADS or all cores].
    #[arg(long, value_name = "N", value_parser = positive, requires = "pack")]
    threads: Option<usize>,
    /// With --pack: print one JSON object (tokens, visible_pairs, fwd_ms,
    /// fwd_bwd_ms, fwd_gflops, fwd_bwd_gflops, causal_fwd_gflops,
    /// causal_fwd_bwd_gflops, threads, isa, ...) instead of a table.
    #[arg(long, requires = "pack")]
    json: bool,
    /// Time the SDCC forward KL instead, fused against unfused (both
    /// softmaxes materialised), 128 pairs, vocabularies of 32k and 150k,
    /// with the peak memory of each.
    #[arg(long)]
    sdcc: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    let mut opts = Options::default();
    if let Some(list) = &a.shape {
        opts.shapes = list
            .split(',')
            .map(|s| Shape::parse(s.trim()))
            .collect::<Result<_>>()?;
    }
    opts.reps = a.reps.unwrap_or(opts.reps);
    opts.heads = a.heads.unwrap_or(opts.heads);
    opts.head_dim = a.head_dim.unwrap_or(opts.head_dim);
    if let Some(s) = &a.size {
        opts.size = Size::parse(s)?;
    }
    opts.seed = a.seed.unwrap_or(opts.seed);
    if let Some(path) = &a.pack {
        let st = treeattn::safetensors::read_file(path)?;
        let ids = |name: &str| -> Result<Vec<u32>> {
            st.get(name)?
                .to_i64()?
                .into_iter()
                .enumerate()
                .map(|(i, x)| {
                    u32::try_from(x).map_err(|_| {
                        Error::Pack(format!(
                            "{}: {name}[{i}] = {x} is not a u32",
                            path.display()
                        ))
                    })
                })
                .collect()
        };
        let (kv_end, position_ids) = (ids("kv_end")?, ids("position_ids")?);
        let pack_opts = PackBenchOptions {
            heads: opts.heads,
            kv_heads: a.kv_heads.unwrap_or(opts.heads),
            head_dim: opts.head_dim,
            threads: a
                .threads
                .unwrap_or_else(treeattn::backend::cpu::num_threads),
            reps: opts.reps,
        };
        let t = time_pack(&kv_end, &position_ids, pack_opts)?;
        return emit(&if a.json {
            t.to_json() + "\n"
        } else {
            t.to_string()
        });
    }
    if a.sdcc {
        return emit(&format!(
            "{}",
            sdcc_table(128, &[32_000, 150_000], opts.reps)?
        ));
    }
    if a.costs_only {
        return emit(&format!("{}", costs(&opts)?));
    }
    // Rows are printed as each shape is timed; the summary at the end.
    let table = quick_with(&opts, emit)?;
    emit(&table.summary())
}

#[cfg(test)]
mod tests {
    use super::run;
    use clap::Parser;
    use treeattn::Error;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        bench: super::BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<super::BenchArgs, String> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
            .map(|c| c.bench)
            .map_err(|e| e.to_string())
    }

    fn usage(args: &[&str]) -> String {
        match parse(args) {
            Err(m) => m,
            Ok(a) => match run(a) {
                Err(Error::Usage(m)) => m,
                other => panic!("{args:?}: expected a usage error, got {other:?}"),
            },
        }
    }

    // Bad options are rejected before anything is timed.
    #[test]
    fn bad_options_are_usage_errors() {
        assert!(usage(&["--reps", "0"]).contains("at least 1"));
        assert!(usage(&["--heads", "0"]).contains("--heads"));
        assert!(usage(&["--head-dim", "x"]).contains("not a non-negative integer"));
        assert!(usage(&["--shape", "compaction,tree"]).contains("unknown shape \"tree\""));
        assert!(usage(&["--size", "huge"]).contains("unknown size"));
        assert!(usage(&["--costs-only=yes"]).contains("--costs-only"));
        assert!(usage(&["--warmup", "2"]).contains("--warmup"));
        assert!(usage(&["compaction"]).contains("unexpected argument"));
        assert!(usage(&["--sdcc", "--costs-only"]).contains("cannot be used with"));
        assert!(usage(&["--size", "paper"]).contains("use --costs-only"));
    }

    #[test]
    fn costs_only_runs_without_timing() {
        let a = parse(&["--costs-only", "--shape", "golden"]).unwrap();
        assert_eq!(run(a), Ok(()));
    }
}
