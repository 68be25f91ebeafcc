//! `treeattn bench`: the quick attention comparison of `treeattn::bench`.

use treeattn::bench::{costs, quick, sdcc_table, Options, Size};
use treeattn::gen::Shape;
use treeattn::{Error, Result};

use crate::args::{emit, Args};

const HELP: &str = "\
treeattn bench [--shape SHAPE[,SHAPE...]] [--reps N] [--heads H] [--head-dim D]
               [--size small|bench|paper] [--seed N] [--costs-only | --sdcc]

Times attention forward and forward+backward (CPU backend, f32) on each tree
shape for: the trie pack (one exact pass), the branch-replicated pack, LogitTree's
K+1 causal passes, a dense-mask attention over the trie pack (L×L mask and
scores), Naive-Compressed, and a plain causal pack of the trie's length. Prints
tokens, visible pairs, GFLOP (4·d·heads per visible pair forward, ×3.5 with the
backward), median time, GFLOP/s and ratios to the trie pack, then per shape the
trie's FLOP/s over causal and its cost over Naive-Compressed.

Defaults: all shapes (compaction, stack-pop, fold, memex, grpo, plain), 3 reps,
4 heads of dim 64, size bench (trie packs of ~1-2k tokens), seed 0. Threads:
TREEATTN_THREADS or all cores. Build with --release.

--costs-only counts tokens and visible pairs of every method without timing
anything (use it with --size paper: windows of up to 80k tokens).
--sdcc times the SDCC forward KL instead, fused against unfused (both
softmaxes materialised), 128 pairs, vocabularies of 32k and 150k, with the
peak memory of each.";

pub fn run(args: Vec<String>) -> Result<()> {
    let mut a = Args::new(args);
    if a.help() {
        return emit(&format!("{HELP}\n"));
    }
    let mut opts = Options::default();
    if let Some(list) = a.value("shape")? {
        opts.shapes = list
            .split(',')
            .map(|s| Shape::parse(s.trim()))
            .collect::<Result<_>>()?;
    }
    let positive = |name: &str, v: Option<u64>, default: usize| -> Result<usize> {
        match v {
            None => Ok(default),
            Some(0) => Err(Error::Usage(format!("--{name} must be at least 1"))),
            Some(n) => {
                usize::try_from(n).map_err(|_| Error::Usage(format!("--{name} {n} is too large")))
            }
        }
    };
    opts.reps = positive("reps", a.number("reps")?, opts.reps)?;
    opts.heads = positive("heads", a.number("heads")?, opts.heads)?;
    opts.head_dim = positive("head-dim", a.number("head-dim")?, opts.head_dim)?;
    if let Some(s) = a.value("size")? {
        opts.size = Size::parse(&s)?;
    }
    opts.seed = a.number("seed")?.unwrap_or(opts.seed);
    let costs_only = a.flag("costs-only")?;
    let sdcc = a.flag("sdcc")?;
    let rest = a.positionals()?;
    if let Some(extra) = rest.first() {
        return Err(Error::Usage(format!(
            "unexpected argument {extra:?} (shapes go after --shape, comma-separated)"
        )));
    }
    if costs_only && sdcc {
        return Err(Error::Usage(
            "--costs-only and --sdcc exclude each other".into(),
        ));
    }
    if sdcc {
        return emit(&format!(
            "{}",
            sdcc_table(128, &[32_000, 150_000], opts.reps)?
        ));
    }
    if costs_only {
        return emit(&format!("{}", costs(&opts)?));
    }
    emit(&format!("{}", quick(&opts)?))
}

#[cfg(test)]
mod tests {
    use super::run;
    use treeattn::Error;

    fn usage(args: &[&str]) -> String {
        match run(args.iter().map(|s| s.to_string()).collect()) {
            Err(Error::Usage(m)) => m,
            other => panic!("{args:?}: expected a usage error, got {other:?}"),
        }
    }

    // Bad options are rejected before anything is timed.
    #[test]
    fn bad_options_are_usage_errors() {
        assert!(usage(&["--reps", "0"]).contains("--reps must be at least 1"));
        assert!(usage(&["--heads", "0"]).contains("--heads"));
        assert!(usage(&["--head-dim", "x"]).contains("not a non-negative integer"));
        assert!(usage(&["--shape", "compaction,tree"]).contains("unknown shape \"tree\""));
        assert!(usage(&["--size", "huge"]).contains("unknown size"));
        assert!(usage(&["--costs-only=yes"]).contains("takes no value"));
        assert!(usage(&["--warmup", "2"]).contains("unknown option --warmup"));
        assert!(usage(&["compaction"]).contains("unexpected argument"));
        assert!(usage(&["--sdcc", "--costs-only"]).contains("exclude each other"));
    }

    #[test]
    fn costs_only_runs_without_timing() {
        assert_eq!(
            run(vec![
                "--costs-only".into(),
                "--shape".into(),
                "golden".into()
            ]),
            Ok(())
        );
    }
}
