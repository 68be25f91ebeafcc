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
//! 5. is proven, by property tests, to equal LogitTree's K+1 separate
//!    passes in one packed pass (the lab's `treeattn_lab::logittree`).
//!
//! The mask rule: query `q` may attend to key `k` iff `k <= q < kv_end[k]`.
//!
//! Every backend implements one contract ([`backend::AttentionBackend`],
//! [`backend::SdccBackend`]) on arguments validated once
//! ([`backend::AttnArgs`], [`backend::SdccArgs`]):
//!
//! ```
//! use treeattn::backend::cpu::Cpu;
//! use treeattn::backend::{AttnArgs, AttnParams, AttnShape, HostAttention};
//! use treeattn::rollout::{Call, Rollout};
//! use treeattn::tree::Tree;
//!
//! // Two calls; the second rewrites the first's context (a junction).
//! let rollout = Rollout::new("r1", vec![
//!     Call::new(vec![1, 2], vec![3]),
//!     Call::new(vec![1, 9, 3], vec![4]),
//! ])?;
//! let pack = Tree::build(&[rollout], false)?.trie_pack();
//! assert_eq!(pack.tokens, [1, 2, 3, 9, 3, 4]);
//! assert_eq!(pack.kv_end, [6, 3, 3, 6, 6, 6]);
//!
//! let shape = AttnShape { tokens: pack.len(), q_heads: 2, kv_heads: 1, head_dim: 8, v_head_dim: 8 };
//! let x = |n: usize| (0..n).map(|i| (i as f64 * 0.1).cos()).collect::<Vec<f64>>();
//! let (q, kv) = (x(shape.q_len()), x(shape.kv_len()));
//! let args = AttnArgs::new(&q[..], &kv[..], &kv[..], shape, pack.mask()?, AttnParams::new(8))?;
//! let out = Cpu::default().forward_owned(&args)?;
//! assert_eq!(out.o.len(), shape.q_len());
//! # Ok::<(), treeattn::Error>(())
//! ```

#![warn(missing_docs)]
pub mod backend;
#[cfg(feature = "candle")]
pub mod candle;
pub mod cost;
pub mod error;
pub mod ffi;
pub mod mask;
pub mod ops;
pub mod pack;
pub mod paths;
pub mod plan;
pub mod rl;
#[doc(hidden)]
pub mod rng;
pub mod rollout;
pub mod safetensors;
pub mod staged;
pub mod tree;

pub use error::{Error, Result};

/// The `ndarray` version the [`ops`] take views of, so that a dependent on
/// another `ndarray` version still compiles against them.
pub use ndarray;

/// The `half` version of the kernels' `bf16` / `f16` element types.
pub use half;

// The Rust snippets of the README and of docs/rust.md compile and run as
// doctests (docs/candle.md's under `--features candle`, in .ci/run).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/rust.md")]
struct DocsRustDoctests;

#[cfg(all(doctest, feature = "candle"))]
#[doc = include_str!("../docs/candle.md")]
struct DocsCandleDoctests;
