//! `treeattn`: inspect rollouts, pack them into safetensors, generate sample
//! data. Hand-written argument parsing; one module per subcommand.

mod args;
mod bench;
mod demo;
mod gen;
mod gpu_check;
mod inspect;
mod pack;

use treeattn::Error;

const HELP: &str = "\
treeattn — exact, deduplicated packing of agent rollouts with context edits

USAGE:
    treeattn <COMMAND> [ARGS] [--help]

COMMANDS:
    demo [--input FILE.jsonl] [--seed N] [--repeats N]
                           the main job: trie pack vs LogitTree vs naive
                           methods on a tiny model (bundled sample by default)
    inspect FILE.jsonl     per rollout: calls, junctions K, branches, targets,
                           diverging targets D, evictions, dedup ratio, and a
                           drawing of the conditioning tree
    pack FILE.jsonl --out PACK.safetensors [--budget TOKENS] [--share-prefixes]
                           [--layout trie|replicated]
                           write the exact pack(s) as safetensors
    gen SHAPE... [--seed N] [--out FILE.jsonl] [--paper-scale]
                           generate rollouts (golden, compaction, stack-pop,
                           fold, memex, grpo, plain)
    gpu-check [--device N] [--seed S] [--tokens N] [--heads H] [--reps R]
                           CUDA kernels vs reference on random packs, then
                           timings (needs a build with --features cuda)
    bench [--shape S,...] [--reps N] [--heads H] [--head-dim D]
                           time attention (trie pack vs LogitTree K+1 passes,
                           replicated, dense mask, Naive-Compressed) per shape
    help                   this text

Exit status: 0 on success, 2 for bad usage, 1 for bad input or i/o errors;
errors are printed to stderr as `error: ...`.";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match dispatch(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            if matches!(e, Error::Usage(_)) {
                eprintln!("(run `treeattn --help` for usage)");
                2
            } else {
                1
            }
        }
    };
    std::process::exit(code);
}

fn dispatch(mut args: Vec<String>) -> treeattn::Result<()> {
    if args.is_empty() {
        return Err(Error::Usage("no command given".into()));
    }
    let cmd = args.remove(0);
    match cmd.as_str() {
        "-h" | "--help" | "help" => args::emit(&format!("{HELP}\n")),
        "demo" => demo::run(args),
        "inspect" => inspect::run(args),
        "pack" => pack::run(args),
        "gen" => gen::run(args),
        "gpu-check" => gpu_check::run(args),
        "bench" => bench::run(args),
        other => Err(Error::Usage(format!("unknown command {other:?}"))),
    }
}
