//! The crate's integration tests, gathered into one test binary (as cargo
//! and other large Rust projects do): every module below used to be a test
//! binary of its own, each linking the whole crate, the C++ emulator and its
//! own copies of the generic kernels; one binary compiles and links them
//! once. Run one module with `cargo test --test it emu_bwd::`, one test with
//! its path (`cargo test --test it pack_props::interval_rule_is_trie_ancestry`).
//! The lab's tests (the CLI, the GPU check, the reference model, LogitTree)
//! are lab/tests/it.
//!
//! Tests that flip process-wide state (the CPU backend's code path) run in a
//! child process of this binary ([`common::own_process`]).

mod common;

mod attention_cpu;
mod attention_isa;
mod attention_portable;
mod contract;
mod docs;
mod emu_bwd;
mod emu_fwd;
mod emu_rope;
mod emu_sdcc;
mod emu_shim;
mod emu_variants;
mod forests;
mod fuzz_inputs;
mod fuzz_structured;
mod pack_balance;
mod pack_golden;
mod pack_props;
mod rollout_errors;
mod scale;
mod sdcc_cpu;
