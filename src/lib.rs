//! # treeattn
//!
//! Exact, deduplicated training on *compressed agent rollouts*.
//!
//! An agent harness rewrites the model's context while a rollout runs
//! (summaries, dropped tool outputs, popped stack frames), so every sampled
//! token was generated under its own *live view*. The set of live views is a
//! tree — the *conditioning tree* — and this crate:
//!
//! 1. reads rollouts as lists of model calls ([`rollout`]),
//! 2. builds the conditioning tree as the token trie of the calls ([`tree`]),
//! 3. packs the tree into one deduplicated sequence with an exact interval
//!    mask `kv_end` and depth position ids ([`pack`], [`mask`]),
//! 4. runs attention forward and backward on that pack, and the fused
//!    forward-KL of SDCC self-distillation ([`ops`], on the [`backend`]s),
//! 5. proves by property tests that one packed pass equals LogitTree's K+1
//!    separate passes ([`logittree`]).
//!
//! The mask rule: query `q` may attend to key `k` iff `k <= q < kv_end[k]`.

pub mod backend;
pub mod bench;
pub mod demo;
pub mod error;
pub mod gen;
#[cfg(feature = "cuda")]
pub mod gpu_check;
pub mod logittree;
pub mod mask;
mod matmul;
pub mod model;
pub mod ops;
pub mod pack;
pub mod rng;
pub mod rollout;
pub mod safetensors;
pub mod tree;

pub use error::{Error, Result};
