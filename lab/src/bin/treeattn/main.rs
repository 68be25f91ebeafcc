//! `treeattn`: inspect rollouts, pack them into safetensors, generate sample
//! data, run the demo and the benchmarks. Arguments parsed by clap (derive);
//! one module per subcommand.

mod args;
mod bench;
mod demo;
mod gen;
mod gpu_check;
mod inspect;
mod output;
mod pack;

use clap::{Parser, Subcommand};
use treeattn::Error;

/// Exact, deduplicated packing of agent rollouts with context edits.
#[derive(Parser, Debug)]
#[command(
    name = "treeattn",
    version,
    subcommand_required = true,
    arg_required_else_help = false,
    after_help = "Exit status: 0 on success, 2 for bad usage, 1 for bad input or i/o errors; \
errors are printed to stderr as `error: ...`.\n`treeattn help COMMAND` or `treeattn COMMAND --help` \
shows the options of one command."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    Demo(demo::DemoArgs),
    Inspect(inspect::InspectArgs),
    Pack(pack::PackArgs),
    Gen(gen::GenArgs),
    GpuCheck(gpu_check::GpuCheckArgs),
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                // Help and version go to stdout; a closed pipe is fine.
                let _ = args::emit(&e.render().to_string());
                std::process::exit(0);
            }
            let _ = e.print();
            std::process::exit(2);
        }
    };
    let result = match cli.cmd {
        Cmd::Demo(a) => demo::run(a),
        Cmd::Inspect(a) => inspect::run(a),
        Cmd::Pack(a) => pack::run(a),
        Cmd::Gen(a) => gen::run(a),
        Cmd::GpuCheck(a) => gpu_check::run(a),
        Cmd::Bench(a) => bench::run(a),
    };
    let code = match result {
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
