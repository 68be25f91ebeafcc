//! The lab's integration tests, one test binary (as the library's
//! tests/it): the `treeattn` command line (its outputs, its errors, its
//! temporary files), the GPU check's flow on the emulator and its script,
//! the reference model, and LogitTree against one packed pass. Run one
//! module with `cargo test -p treeattn-lab --test it cli::`.

mod cli;
mod equivalence;
mod fuzz_cli;
mod gpu_check_emu;
mod gpu_check_script;
mod model;
mod output_files;
