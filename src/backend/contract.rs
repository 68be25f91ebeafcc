//! The one contract every backend implements, and every adapter (the
//! `ndarray` ops, the tiny model, bindings to other frameworks) calls.
//!
//! A call is described by *validated* argument types: [`AttnArgs`] (q, k, v,
//! their [`AttnShape`], the pack's mask and the [`AttnParams`]) is checked
//! once, when it is built, and a [`ForwardCall`] / [`BackwardCall`] /
//! [`SdccCall`] adds the caller-owned outputs, checked against it. Backends
//! implement [`AttentionBackend::run_forward`] and friends on those types and
//! never re-validate; a call that reaches a backend has the right lengths
//! everywhere, a mask that obeys `k <= kv_end[k] <= L` (a [`PackMask`] is
//! valid by construction), supported parameters, and — when
//! `params.check_finite` is set and the memory is the host's — finite
//! inputs.
//!
//! Where the tensors live is the backend's [`Memory`]: [`Host`] slices for
//! the CPU backend and the emulator, device buffers for CUDA. Outputs are
//! always the caller's (so a training loop reuses them, and a framework
//! hands in its own tensors); [`HostAttention`] and [`HostSdcc`] add
//! allocating conveniences for host backends.
//!
//! Element types: the CPU backend takes `f32` and `f64`, computed in
//! themselves, and `bf16` and `f16`, computed in `f32` (the LSE in the
//! compute type); the kernels (emulated or on a GPU) take `bf16` or `f16` with
//! f32 accumulation and an `f32` LSE. Layouts are those of
//! `flash_attn_varlen`: Q, O, dO, dQ `[tokens, q_heads, head_dim]`; K, V,
//! dK, dV `[tokens, kv_heads, head_dim]`; LSE `[q_heads, tokens]`; logits
//! `[rows, vocab]`, all row-major.
//!
//! ```
//! use treeattn::backend::{AttentionBackend, AttnArgs, AttnParams, AttnShape, Grads, Saved};
//! use treeattn::backend::cpu::Cpu;
//! use treeattn::mask::PackMask;
//!
//! // Two branches sharing a one-token trunk: key 0 is seen by all rows.
//! let (kv_end, pos) = ([3u32, 2, 3], [0u32, 1, 1]);
//! let mask = PackMask::new(&kv_end, &pos)?;
//! let shape = AttnShape { tokens: 3, q_heads: 2, kv_heads: 1, head_dim: 4, v_head_dim: 4 };
//! let q = vec![0.5f64; shape.q_len()];
//! let kv = vec![0.25f64; shape.kv_len()];
//! let args = AttnArgs::new(&q[..], &kv[..], &kv[..], shape, mask, AttnParams::new(4))?;
//!
//! let (mut o, mut lse) = (vec![0.0; shape.q_len()], vec![0.0; shape.lse_len()]);
//! Cpu::default().forward(&args, &mut o[..], &mut lse[..])?;
//!
//! let d_o = vec![1.0f64; shape.q_len()];
//! let (mut dq, mut dk, mut dv) =
//!     (vec![0.0; shape.q_len()], vec![0.0; shape.kv_len()], vec![0.0; shape.kv_len()]);
//! let saved = Saved { o: &o[..], lse: &lse[..] };
//! let grads = Grads::new(&mut dq[..], &mut dk[..], &mut dv[..]);
//! Cpu::default().backward(&args, saved, &d_o[..], grads)?;
//! // Every value equal: the output row is the value, whatever the weights.
//! assert!(o.iter().all(|&x| (x - 0.25).abs() < 1e-15));
//! # Ok::<(), treeattn::Error>(())
//! ```

use super::{AttnParams, AttnShape};
use crate::mask::PackMask;
use crate::{Error, Result};

/// A tensor element type of some backend: `f32`, `f64` (CPU), `half::bf16`,
/// `half::f16` (kernels; the SDCC kernel also takes `f32`).
pub trait Element: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// `"f32"`, `"f64"`, `"bf16"` or `"f16"`, for messages.
    const NAME: &'static str;
    /// The value as f64 (exact for every element type).
    fn to_f64(self) -> f64;
    /// The nearest value (rounds to nearest; NaN stays NaN).
    fn from_f64(x: f64) -> Self;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl Element for f64 {
    const NAME: &'static str = "f64";
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x
    }
}

impl Element for half::bf16 {
    const NAME: &'static str = "bf16";
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        half::bf16::from_f64(x)
    }
}

impl Element for half::f16 {
    const NAME: &'static str = "f16";
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        half::f16::from_f64(x)
    }
}

/// Something with an element count: a tensor reference of some [`Memory`].
pub trait Extent {
    /// Number of elements.
    fn len(&self) -> usize;
    /// True when there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Extent for &[T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
}

impl<T> Extent for &mut [T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
}

/// Where a backend's tensors live, and how a call refers to them.
pub trait Memory: 'static {
    /// A tensor the backend reads.
    type Ref<'a, T: Element>: Copy + Extent;
    /// A tensor the backend writes (every element, whatever it held).
    type Mut<'a, T: Element>: Extent;
    /// The pack's mask as the backend reads it (valid by construction).
    type Mask<'a>: Copy;
    /// Number of tokens of a mask.
    fn mask_tokens(mask: &Self::Mask<'_>) -> usize;
    /// [`PackMask::fingerprint`] of a mask.
    fn mask_fingerprint(mask: &Self::Mask<'_>) -> u64;
    /// [`PackMask::is_tree`] of a mask (a sliding window needs it).
    fn mask_is_tree(mask: &Self::Mask<'_>) -> bool;
    /// The first index whose element satisfies `bad`, where this memory can
    /// be read from the host without a stream; `None` otherwise (device
    /// memory is scanned by its backend).
    fn find<T: Element>(x: &Self::Ref<'_, T>, bad: impl Fn(f64) -> bool) -> Option<usize>;
    /// `x` borrowed for a shorter lifetime (a generic [`Memory`]'s
    /// reference types are invariant in their lifetime; every memory's are
    /// references, so this is a reborrow).
    fn shorten<'a: 'b, 'b, T: Element>(x: Self::Ref<'a, T>) -> Self::Ref<'b, T>;
    /// A mask borrowed for a shorter lifetime (see [`Memory::shorten`]).
    fn shorten_mask<'a: 'b, 'b>(mask: Self::Mask<'a>) -> Self::Mask<'b>;
    /// A tensor the backend writes, reborrowed for `'b` (to hand it to an
    /// inner call and write it again after).
    fn reborrow_mut<'b, T: Element>(x: &'b mut Self::Mut<'_, T>) -> Self::Mut<'b, T>;
}

/// Host memory: Rust slices (CPU backend, emulator).
#[derive(Clone, Copy, Debug, Default)]
pub struct Host;

impl Memory for Host {
    type Ref<'a, T: Element> = &'a [T];
    type Mut<'a, T: Element> = &'a mut [T];
    type Mask<'a> = PackMask<'a>;
    fn mask_tokens(mask: &PackMask<'_>) -> usize {
        mask.len()
    }
    fn mask_fingerprint(mask: &PackMask<'_>) -> u64 {
        mask.fingerprint()
    }
    fn mask_is_tree(mask: &PackMask<'_>) -> bool {
        mask.is_tree()
    }
    fn find<T: Element>(x: &&[T], bad: impl Fn(f64) -> bool) -> Option<usize> {
        x.iter().position(|e| bad(e.to_f64()))
    }
    fn shorten<'a: 'b, 'b, T: Element>(x: &'a [T]) -> &'b [T] {
        x
    }
    fn shorten_mask<'a: 'b, 'b>(mask: PackMask<'a>) -> PackMask<'b> {
        mask
    }
    fn reborrow_mut<'b, T: Element>(x: &'b mut &mut [T]) -> &'b mut [T] {
        x
    }
}

/// `Err(Shape)` unless `got == expected`; `how` says what the length is.
pub(crate) fn check_len(what: &str, got: usize, expected: usize, how: &str) -> Result<()> {
    if got != expected {
        return Err(Error::Shape(format!(
            "{what} has {got} elements, expected {expected} ({how})"
        )));
    }
    Ok(())
}

/// `Err(NonFinite)` at the first NaN or ±inf of `x`, where `M` can scan it.
fn check_finite<M: Memory, T: Element>(what: &str, x: &M::Ref<'_, T>) -> Result<()> {
    match M::find(x, |v| !v.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: what.into(),
            index,
        }),
        None => Ok(()),
    }
}

const Q_HOW: &str = "tokens · q_heads · head_dim, like q";
const KV_HOW: &str = "tokens · kv_heads · head_dim, like k";
const O_HOW: &str = "tokens · q_heads · v_head_dim, like o";
const V_HOW: &str = "tokens · kv_heads · v_head_dim, like v";
const LSE_HOW: &str = "q_heads · tokens";
const SINKS_HOW: &str = "one logit per query head";

/// The inputs of one attention call, validated when built (see
/// [`AttnArgs::new`]); shared by the forward and backward of that call.
pub struct AttnArgs<'a, M: Memory, T: Element> {
    q: M::Ref<'a, T>,
    k: M::Ref<'a, T>,
    v: M::Ref<'a, T>,
    sinks: Option<M::Ref<'a, T>>,
    key_starts: Option<&'a [u32]>,
    shape: AttnShape,
    mask: M::Mask<'a>,
    params: AttnParams,
}

impl<M: Memory, T: Element> Clone for AttnArgs<'_, M, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M: Memory, T: Element> Copy for AttnArgs<'_, M, T> {}

impl<'a, M: Memory, T: Element> AttnArgs<'a, M, T> {
    /// Checks one attention call's inputs: `q` `[tokens, q_heads,
    /// head_dim]`, `k` `[tokens, kv_heads, head_dim]`, `v` `[tokens,
    /// kv_heads, v_head_dim]`, a mask of `tokens` tokens.
    ///
    /// Errors: a zero-sized shape, `q_heads` not a multiple of `kv_heads`,
    /// a head dim over [`super::MAX_HEAD_DIM`], element counts overflowing
    /// `usize` ([`Error::Shape`]); a mask of another length
    /// ([`Error::Pack`]); a tensor of the wrong length ([`Error::Shape`],
    /// naming it); bad softmax scale, rotary, window or softcap settings
    /// ([`Error::Unsupported`]); a window on a mask that is not a tree
    /// ([`Error::Pack`], [`PackMask::window_starts`]); with
    /// `params.check_finite` on host memory, a NaN or ±inf in q, k or v
    /// ([`Error::NonFinite`], naming it and the index).
    pub fn new(
        q: M::Ref<'a, T>,
        k: M::Ref<'a, T>,
        v: M::Ref<'a, T>,
        shape: AttnShape,
        mask: M::Mask<'a>,
        params: AttnParams,
    ) -> Result<Self> {
        shape.validate()?;
        params.validate(&shape)?;
        let tokens = M::mask_tokens(&mask);
        if tokens != shape.tokens {
            return Err(Error::Pack(format!(
                "the mask has {tokens} tokens but the attention shape has {}",
                shape.tokens
            )));
        }
        check_len("q", q.len(), shape.q_len(), "tokens · q_heads · head_dim")?;
        check_len("k", k.len(), shape.kv_len(), "tokens · kv_heads · head_dim")?;
        check_len(
            "v",
            v.len(),
            shape.v_len(),
            "tokens · kv_heads · v_head_dim",
        )?;
        if params.window.is_some() && !M::mask_is_tree(&mask) {
            return Err(Error::Pack(
                "a sliding window needs a tree-shaped mask (nested key ranges): this kv_end has crossing ranges, so its rows have no tree depth".into(),
            ));
        }
        if params.check_finite {
            check_finite::<M, T>("q", &q)?;
            check_finite::<M, T>("k", &k)?;
            check_finite::<M, T>("v", &v)?;
        }
        Ok(AttnArgs {
            q,
            k,
            v,
            sinks: None,
            key_starts: None,
            shape,
            mask,
            params,
        })
    }

    /// The same call with an explicit first visible key per query row
    /// (host memory, `tokens` entries): query `q` sees key `k` iff
    /// `starts[q] <= k <= q < kv_end[k]`. A sliding window is this with the
    /// starts of [`PackMask::window_starts`]; explicit starts serve a call
    /// on part of a pack whose rows keep their window from the whole pack
    /// (context parallelism's gathered keys). Errors: `starts` not one per
    /// token ([`Error::Shape`]); a call with a window too
    /// ([`Error::Unsupported`]: one or the other); a mask that is not a
    /// tree ([`Error::Pack`]).
    pub fn with_key_starts(mut self, starts: &'a [u32]) -> Result<Self> {
        check_len(
            "key starts",
            starts.len(),
            self.shape.tokens,
            "one per token",
        )?;
        if self.params.window.is_some() {
            return Err(Error::Unsupported(
                "key starts and a sliding window together: give one (a window is its own key starts)"
                    .into(),
            ));
        }
        if !M::mask_is_tree(&self.mask) {
            return Err(Error::Pack(
                "key starts need a tree-shaped mask (nested key ranges): this kv_end has crossing ranges".into(),
            ));
        }
        self.key_starts = Some(starts);
        Ok(self)
    }

    /// The same call with attention sinks (gpt-oss): one learnable logit
    /// `σ_h` per query head that joins each row's softmax denominator and
    /// carries no value,
    ///
    /// ```text
    /// O_q = Σ_k e^{s_k} v_k / (Σ_k e^{s_k} + e^{σ_h})    LSE_q = ln(Σ_k e^{s_k} + e^{σ_h})
    /// ```
    ///
    /// (a row with no visible key gets `O = 0`, `LSE = σ_h`); the backward
    /// also writes `∂/∂σ_h = −Σ_q e^{σ_h − LSE_q} · D_q` into
    /// [`Grads::dsinks`] when given. Errors: `sinks` not `[q_heads]`
    /// ([`Error::Shape`]); with `params.check_finite` on host memory, a NaN
    /// or ±inf in it ([`Error::NonFinite`]).
    pub fn with_sinks(mut self, sinks: M::Ref<'a, T>) -> Result<Self> {
        check_len("sinks", sinks.len(), self.shape.q_heads, SINKS_HOW)?;
        if self.params.check_finite {
            check_finite::<M, T>("sinks", &sinks)?;
        }
        self.sinks = Some(sinks);
        Ok(self)
    }
    /// Queries, `[tokens, q_heads, head_dim]`.
    pub fn q(&self) -> M::Ref<'a, T> {
        self.q
    }
    /// Keys, `[tokens, kv_heads, head_dim]`.
    pub fn k(&self) -> M::Ref<'a, T> {
        self.k
    }
    /// Values, `[tokens, kv_heads, v_head_dim]`.
    pub fn v(&self) -> M::Ref<'a, T> {
        self.v
    }
    /// Attention sinks, `[q_heads]` ([`Self::with_sinks`]).
    pub fn sinks(&self) -> Option<M::Ref<'a, T>> {
        self.sinks
    }
    /// Explicit first visible key per query row ([`Self::with_key_starts`]).
    pub fn key_starts(&self) -> Option<&'a [u32]> {
        self.key_starts
    }
    /// Sizes of the call.
    pub fn shape(&self) -> AttnShape {
        self.shape
    }
    /// The pack's mask.
    pub fn mask(&self) -> M::Mask<'a> {
        self.mask
    }
    /// Softmax scale, rotary, finiteness scan.
    pub fn params(&self) -> &AttnParams {
        &self.params
    }
}

impl<'a, M: Memory, T: Element> AttnArgs<'a, M, T> {
    /// The same arguments borrowed for a shorter lifetime (argument types
    /// of a generic [`Memory`] are invariant in their lifetime:
    /// [`Memory::shorten`]).
    pub fn reborrow<'b>(&self) -> AttnArgs<'b, M, T>
    where
        'a: 'b,
    {
        AttnArgs {
            q: M::shorten(self.q),
            k: M::shorten(self.k),
            v: M::shorten(self.v),
            sinks: self.sinks.map(M::shorten),
            key_starts: self.key_starts,
            shape: self.shape,
            mask: M::shorten_mask(self.mask),
            params: self.params,
        }
    }
}

/// A forward call: validated inputs and the caller's outputs `o`
/// (`[tokens, q_heads, v_head_dim]`) and `lse` (`[q_heads, tokens]`),
/// checked against them.
pub struct ForwardCall<'i, 'o, M: Memory, T: Element, L: Element> {
    args: AttnArgs<'i, M, T>,
    o: M::Mut<'o, T>,
    lse: M::Mut<'o, L>,
}

impl<'i, 'o, M: Memory, T: Element, L: Element> ForwardCall<'i, 'o, M, T, L> {
    /// Errors: `o` or `lse` of the wrong length ([`Error::Shape`]).
    pub fn new(args: AttnArgs<'i, M, T>, o: M::Mut<'o, T>, lse: M::Mut<'o, L>) -> Result<Self> {
        let s = args.shape;
        check_len("o", o.len(), s.o_len(), O_HOW)?;
        check_len("lse", lse.len(), s.lse_len(), LSE_HOW)?;
        Ok(ForwardCall { args, o, lse })
    }
    /// The call's inputs.
    pub fn args(&self) -> &AttnArgs<'i, M, T> {
        &self.args
    }
    /// Inputs and outputs, for the backend that runs the call.
    pub fn into_parts(self) -> (AttnArgs<'i, M, T>, M::Mut<'o, T>, M::Mut<'o, L>) {
        (self.args, self.o, self.lse)
    }
}

/// What the forward of a call saved for its backward: `O` and `LSE`.
pub struct Saved<'i, M: Memory, T: Element, L: Element> {
    /// `[tokens, q_heads, v_head_dim]`.
    pub o: M::Ref<'i, T>,
    /// `[q_heads, tokens]`, natural log; `−inf` for a row with no visible key.
    pub lse: M::Ref<'i, L>,
}

impl<'i, M: Memory, T: Element, L: Element> Saved<'i, M, T, L> {
    /// The same state borrowed for a shorter lifetime (see
    /// [`AttnArgs::reborrow`]).
    pub fn reborrow<'b>(&self) -> Saved<'b, M, T, L>
    where
        'i: 'b,
    {
        Saved {
            o: M::shorten(self.o),
            lse: M::shorten(self.lse),
        }
    }
}

/// The gradients a backward writes, with respect to the *unrotated* q and
/// k when rotary is on.
pub struct Grads<'o, M: Memory, T: Element> {
    /// Like q.
    pub dq: M::Mut<'o, T>,
    /// Like k (summed over the query heads of each kv head).
    pub dk: M::Mut<'o, T>,
    /// Like v (summed over the query heads of each kv head).
    pub dv: M::Mut<'o, T>,
    /// `[q_heads]`: the gradient of the attention sinks, for a call with
    /// sinks ([`AttnArgs::with_sinks`]); `None` skips it.
    pub dsinks: Option<M::Mut<'o, T>>,
}

impl<'o, M: Memory, T: Element> Grads<'o, M, T> {
    /// dQ, dK, dV, and no sink gradient.
    pub fn new(dq: M::Mut<'o, T>, dk: M::Mut<'o, T>, dv: M::Mut<'o, T>) -> Self {
        Grads {
            dq,
            dk,
            dv,
            dsinks: None,
        }
    }
}

/// A backward call: the forward's validated inputs (borrowed for `'i`),
/// its saved `O`, `LSE` and the output gradient `dO` (for `'s`) and the
/// caller's gradient buffers (for `'o`).
pub struct BackwardCall<'i, 's, 'o, M: Memory, T: Element, L: Element> {
    args: AttnArgs<'i, M, T>,
    saved: Saved<'s, M, T, L>,
    d_o: M::Ref<'s, T>,
    grads: Grads<'o, M, T>,
}

impl<'i, 's, 'o, M: Memory, T: Element, L: Element> BackwardCall<'i, 's, 'o, M, T, L> {
    /// Errors: `o`, `d_o`, `lse`, `dq`, `dk`, `dv`, `dsinks` of the wrong
    /// length, or `dsinks` for a call without sinks ([`Error::Shape`]); a
    /// NaN or `+inf` in `lse` on host memory ([`Error::NonFinite`]; `−inf`
    /// marks a row with no visible key); with `params.check_finite` on host
    /// memory, a NaN or ±inf in `o` or `d_o`.
    pub fn new(
        args: AttnArgs<'i, M, T>,
        saved: Saved<'s, M, T, L>,
        d_o: M::Ref<'s, T>,
        grads: Grads<'o, M, T>,
    ) -> Result<Self> {
        let s = args.shape;
        check_len("o", saved.o.len(), s.o_len(), O_HOW)?;
        check_len("d_o", d_o.len(), s.o_len(), O_HOW)?;
        check_len("lse", saved.lse.len(), s.lse_len(), LSE_HOW)?;
        check_len("dq", grads.dq.len(), s.q_len(), Q_HOW)?;
        check_len("dk", grads.dk.len(), s.kv_len(), KV_HOW)?;
        check_len("dv", grads.dv.len(), s.v_len(), V_HOW)?;
        if let Some(ds) = &grads.dsinks {
            if args.sinks.is_none() {
                return Err(Error::Shape(
                    "dsinks given for a call without attention sinks".into(),
                ));
            }
            check_len("dsinks", ds.len(), s.q_heads, SINKS_HOW)?;
        }
        if let Some(index) = M::find(&saved.lse, |x| x.is_nan() || x == f64::INFINITY) {
            return Err(Error::NonFinite {
                what: "lse (NaN or +inf; −inf marks a row with no visible key)".into(),
                index,
            });
        }
        if args.params.check_finite {
            check_finite::<M, T>("o", &saved.o)?;
            check_finite::<M, T>("d_o", &d_o)?;
        }
        Ok(BackwardCall {
            args,
            saved,
            d_o,
            grads,
        })
    }
    /// The call's inputs.
    pub fn args(&self) -> &AttnArgs<'i, M, T> {
        &self.args
    }
    /// Inputs, saved state, `dO` and outputs, for the backend that runs the
    /// call.
    #[allow(clippy::type_complexity)]
    pub fn into_parts(
        self,
    ) -> (
        AttnArgs<'i, M, T>,
        Saved<'s, M, T, L>,
        M::Ref<'s, T>,
        Grads<'o, M, T>,
    ) {
        (self.args, self.saved, self.d_o, self.grads)
    }
}

/// Tree attention on a pack, forward and backward, for element type `T`:
/// per query head `h` (reading kv head `h / (q_heads / kv_heads)`), query
/// row `q`, over the keys `k <= q < kv_end[k]` of the pack's mask,
///
/// ```text
/// s_k = scale · rot(q)·rot(k_k)    O_q = Σ_k softmax(s)_k v_k    LSE_q = ln Σ_k exp(s_k)
/// D = rowsum(dO ∘ O)   dS = P ∘ (dO Vᵀ − D)
/// dQ = scale · dS K    dK = scale · dSᵀ Q    dV = Pᵀ dO
/// ```
///
/// where `rot` is the rotary embedding at the pack's position ids when
/// `params.rope` is set (dQ, dK are taken back through it). The variants
/// of [`AttnParams`] and [`AttnArgs::with_sinks`] change this as follows:
///
/// ```text
/// window W:   only keys with starts[q] <= k  (PackMask::window_starts: depth(q) − depth(k) < W)
/// softcap c:  s_k = c · tanh(scale · rot(q)·rot(k_k) / c);   dS ← dS ∘ (1 − (s/c)²)
/// sinks σ:    LSE_q = ln(Σ_k exp(s_k) + exp(σ_h)),  P = exp(s − LSE);  dσ_h = −Σ_q exp(σ_h − LSE_q) D_q
/// ```
///
/// and V, O have `v_head_dim` columns (multi-head latent attention when it
/// differs from `head_dim`). A query row with no visible key (only with
/// padding keys, `kv_end[k] == k`, or a window of one level on a padding
/// row) gets `O = 0`, `LSE = −inf` (`σ_h` with sinks), `dQ = 0` and adds
/// nothing to dK, dV — never a NaN. A backend that does not run a variant
/// returns [`Error::Unsupported`] naming it, never another result.
/// What rows that enter no visible pair hold (K, V of keys no query sees,
/// Q, dO of queries that see no key) is ignored, NaN and inf included
/// (DESIGN §5): every backend gives the result it gives with zeros there.
///
/// Non-finite results (scores overflowing the element type, or non-finite
/// inputs left unchecked) are an [`Error::NonFinite`] on host memory, never
/// returned; on device memory they are found only with
/// `params.check_finite` (which downloads the result).
///
/// Implemented by [`super::cpu::Cpu`], `super::emu::Emu` (feature-gated
/// kernel emulator) and, with the `cuda` feature, `super::cuda::CudaBackend`.
pub trait AttentionBackend<T: Element> {
    /// Where the call's tensors live.
    type Memory: Memory;
    /// Element type of the LSE: `T` on the CPU, `f32` on the kernels.
    type Lse: Element;

    /// Runs a validated forward call: writes every element of `o`, `lse`.
    fn run_forward(&self, call: ForwardCall<'_, '_, Self::Memory, T, Self::Lse>) -> Result<()>;

    /// Runs a validated backward call: writes every element of dq, dk, dv.
    fn run_backward(
        &self,
        call: BackwardCall<'_, '_, '_, Self::Memory, T, Self::Lse>,
    ) -> Result<()>;

    /// The forward of `args` into the caller's `o` (like q) and `lse`
    /// (`[q_heads, tokens]`). Errors: as [`ForwardCall::new`], then the
    /// backend's own (unsupported head dim or alignment, non-finite
    /// results, device errors).
    fn forward<'i, 'o>(
        &self,
        args: &AttnArgs<'i, Self::Memory, T>,
        o: <Self::Memory as Memory>::Mut<'o, T>,
        lse: <Self::Memory as Memory>::Mut<'o, Self::Lse>,
    ) -> Result<()> {
        self.run_forward(ForwardCall::new(*args, o, lse)?)
    }

    /// The backward of `args` (the same inputs, mask and parameters as the
    /// forward that produced `saved`) for the output gradient `d_o`, into
    /// the caller's `grads`. Errors: as [`BackwardCall::new`], then the
    /// backend's own.
    fn backward<'i, 's, 'o>(
        &self,
        args: &AttnArgs<'i, Self::Memory, T>,
        saved: Saved<'s, Self::Memory, T, Self::Lse>,
        d_o: <Self::Memory as Memory>::Ref<'s, T>,
        grads: Grads<'o, Self::Memory, T>,
    ) -> Result<()> {
        self.run_backward(BackwardCall::new(*args, saved, d_o, grads)?)
    }
}

/// Owned result of a forward on host memory ([`HostAttention::forward_owned`]).
#[derive(Clone, Debug, PartialEq)]
pub struct AttnOut<T, L> {
    /// `[tokens, q_heads, v_head_dim]`.
    pub o: Vec<T>,
    /// `[q_heads, tokens]`, natural log; `−inf` for a row with no visible key.
    pub lse: Vec<L>,
}

impl<T: Element, L: Element> AttnOut<T, L> {
    /// The forward's saved state, for [`HostAttention::backward_owned`] or
    /// [`AttentionBackend::backward`].
    pub fn saved(&self) -> Saved<'_, Host, T, L> {
        Saved {
            o: &self.o[..],
            lse: &self.lse[..],
        }
    }
}

/// Owned gradients of a backward on host memory
/// ([`HostAttention::backward_owned`]), with respect to the unrotated q, k.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnGrads<T> {
    /// Like q: `[tokens, q_heads, head_dim]`.
    pub dq: Vec<T>,
    /// Like k: `[tokens, kv_heads, head_dim]`.
    pub dk: Vec<T>,
    /// Like v: `[tokens, kv_heads, v_head_dim]`.
    pub dv: Vec<T>,
    /// `[q_heads]`, for a call with attention sinks.
    pub dsinks: Option<Vec<T>>,
}

/// Allocating forms of [`AttentionBackend`] for backends on host memory.
/// Outputs are allocated filled with NaN, so an element a backend failed
/// to write cannot pass for a result.
pub trait HostAttention<T: Element>: AttentionBackend<T, Memory = Host> {
    /// [`AttentionBackend::forward`] into fresh vectors.
    fn forward_owned(&self, args: &AttnArgs<'_, Host, T>) -> Result<AttnOut<T, Self::Lse>> {
        let s = args.shape();
        let mut o = vec![T::from_f64(f64::NAN); s.o_len()];
        let mut lse = vec![Self::Lse::from_f64(f64::NAN); s.lse_len()];
        self.forward(args, &mut o[..], &mut lse[..])?;
        Ok(AttnOut { o, lse })
    }

    /// [`AttentionBackend::backward`] into fresh vectors, from the saved
    /// state of the forward (an [`AttnOut::saved`], or the caller's own `o`
    /// and `lse`).
    fn backward_owned(
        &self,
        args: &AttnArgs<'_, Host, T>,
        saved: Saved<'_, Host, T, Self::Lse>,
        d_o: &[T],
    ) -> Result<AttnGrads<T>> {
        let s = args.shape();
        let nan = T::from_f64(f64::NAN);
        let mut g = AttnGrads {
            dq: vec![nan; s.q_len()],
            dk: vec![nan; s.kv_len()],
            dv: vec![nan; s.v_len()],
            dsinks: args.sinks().map(|_| vec![nan; s.q_heads]),
        };
        let grads = Grads {
            dq: &mut g.dq[..],
            dk: &mut g.dk[..],
            dv: &mut g.dv[..],
            dsinks: g.dsinks.as_deref_mut(),
        };
        self.backward(args, saved.reborrow(), d_o, grads)?;
        Ok(g)
    }
}

impl<T: Element, B: AttentionBackend<T, Memory = Host> + ?Sized> HostAttention<T> for B {}

/// Largest vocabulary an SDCC call takes: 2^24 entries per logit row (a
/// larger `vocab` is almost surely a wrong argument, and the CPU backend
/// allocates per-row scratch of that size).
pub const MAX_SDCC_VOCAB: usize = 1 << 24;

/// The inputs of one SDCC forward-KL call, validated when built (see
/// [`SdccArgs::new`]). `pairs` and `weights` are always host slices.
pub struct SdccArgs<'a, M: Memory, T: Element> {
    student: M::Ref<'a, T>,
    teacher: M::Ref<'a, T>,
    vocab: usize,
    pairs: &'a [(u32, u32)],
    weights: &'a [f32],
    temperature: f32,
}

impl<M: Memory, T: Element> Clone for SdccArgs<'_, M, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M: Memory, T: Element> Copy for SdccArgs<'_, M, T> {}

impl<'a, M: Memory, T: Element> SdccArgs<'a, M, T> {
    /// Checks one SDCC call: `[rows, vocab]` row-major `student` and
    /// `teacher` logits, pairs `(student row, teacher row)`, one weight per
    /// pair, the temperature. No allocation.
    ///
    /// Errors: `vocab == 0` or over [`MAX_SDCC_VOCAB`], logits not a whole
    /// number of rows ([`Error::Shape`]); `weights` not one per pair
    /// ([`Error::Shape`]), non-finite ([`Error::NonFinite`]) or negative;
    /// `temperature` non-finite or `<= 0` ([`Error::Unsupported`]); a pair
    /// naming a row out of range ([`Error::Pack`], the lowest such pair).
    pub fn new(
        student: M::Ref<'a, T>,
        teacher: M::Ref<'a, T>,
        vocab: usize,
        pairs: &'a [(u32, u32)],
        weights: &'a [f32],
        temperature: f32,
    ) -> Result<Self> {
        if vocab == 0 || vocab > MAX_SDCC_VOCAB {
            return Err(Error::Shape(format!(
                "SDCC vocab = {vocab}: must be in 1..={MAX_SDCC_VOCAB}"
            )));
        }
        for (what, n) in [("student", student.len()), ("teacher", teacher.len())] {
            if n % vocab != 0 {
                return Err(Error::Shape(format!(
                    "{what} logits have {n} elements, not a multiple of vocab = {vocab}"
                )));
            }
        }
        if weights.len() != pairs.len() {
            return Err(Error::Shape(format!(
                "{} weights for {} SDCC pairs",
                weights.len(),
                pairs.len()
            )));
        }
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(Error::Unsupported(format!(
                "SDCC temperature {temperature} must be finite and > 0"
            )));
        }
        if let Some(index) = weights.iter().position(|w| !w.is_finite()) {
            return Err(Error::NonFinite {
                what: "SDCC weights".into(),
                index,
            });
        }
        if let Some(i) = weights.iter().position(|&w| w < 0.0) {
            return Err(Error::Unsupported(format!(
                "SDCC weight {i} is {} (weights must be >= 0)",
                weights[i]
            )));
        }
        let (n_student, n_teacher) = (student.len() / vocab, teacher.len() / vocab);
        for (i, &(s, t)) in pairs.iter().enumerate() {
            if s as usize >= n_student || t as usize >= n_teacher {
                return Err(Error::Pack(format!(
                    "SDCC pair {i} = (student row {s}, teacher row {t}) is out of range: {n_student} student rows, {n_teacher} teacher rows"
                )));
            }
        }
        Ok(SdccArgs {
            student,
            teacher,
            vocab,
            pairs,
            weights,
            temperature,
        })
    }
    /// Student logits, `[student_rows, vocab]`.
    pub fn student(&self) -> M::Ref<'a, T> {
        self.student
    }
    /// Teacher logits, `[teacher_rows, vocab]`.
    pub fn teacher(&self) -> M::Ref<'a, T> {
        self.teacher
    }
    /// Entries per logit row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }
    /// `(student row, teacher row)` per pair.
    pub fn pairs(&self) -> &'a [(u32, u32)] {
        self.pairs
    }
    /// One weight per pair, finite and `>= 0`.
    pub fn weights(&self) -> &'a [f32] {
        self.weights
    }
    /// Softmax temperature `τ > 0`.
    pub fn temperature(&self) -> f32 {
        self.temperature
    }
    /// Rows of the student logits.
    pub fn student_rows(&self) -> usize {
        self.student.len() / self.vocab
    }
    /// Rows of the teacher logits.
    pub fn teacher_rows(&self) -> usize {
        self.teacher.len() / self.vocab
    }
}

/// An SDCC call: validated inputs and the caller's gradient buffer, shaped
/// like the student logits.
pub struct SdccCall<'i, 'o, M: Memory, T: Element, G: Element> {
    args: SdccArgs<'i, M, T>,
    grad: M::Mut<'o, G>,
}

impl<'i, 'o, M: Memory, T: Element, G: Element> SdccCall<'i, 'o, M, T, G> {
    /// Errors: `grad` not shaped like the student logits ([`Error::Shape`]).
    pub fn new(args: SdccArgs<'i, M, T>, grad: M::Mut<'o, G>) -> Result<Self> {
        check_len(
            "SDCC gradient",
            grad.len(),
            args.student.len(),
            "like the student logits",
        )?;
        Ok(SdccCall { args, grad })
    }
    /// Inputs and the gradient buffer, for the backend that runs the call.
    pub fn into_parts(self) -> (SdccArgs<'i, M, T>, M::Mut<'o, G>) {
        (self.args, self.grad)
    }
}

/// The loss of an SDCC call (the gradient went to the caller's buffer).
#[derive(Clone, Debug, PartialEq)]
pub struct SdccLoss {
    /// `Σ_pairs w · KL` (pairs with `w = 0` add exactly 0, even if their KL
    /// is `+inf`).
    pub loss_sum: f64,
    /// `loss_sum / Σ w`: the weighted mean, so that the loss scale does not
    /// depend on how many diverging targets a batch has nor on how the
    /// weights are normalized; `0` when `Σ w = 0` (no pairs).
    pub loss_mean: f64,
    /// The unweighted `KL(teacher ‖ student)` of each pair, in pair order.
    pub per_pair: Vec<f64>,
}

impl SdccLoss {
    /// `Σ w_i KL_i` and `Σ w_i KL_i / Σ w_i` over the pairs with `w_i > 0`
    /// (so that a zero-weight pair with `KL = +inf` adds exactly 0), in f64
    /// and pair order; a mean of 0 when no weight is positive.
    pub fn from_per_pair(per_pair: Vec<f64>, weights: &[f32]) -> SdccLoss {
        let mut loss_sum = 0.0;
        let mut weight_sum = 0.0;
        for (&kl, &w) in per_pair.iter().zip(weights) {
            if w > 0.0 {
                loss_sum += w as f64 * kl;
                weight_sum += w as f64;
            }
        }
        let loss_mean = if weight_sum > 0.0 {
            loss_sum / weight_sum
        } else {
            0.0
        };
        SdccLoss {
            loss_sum,
            loss_mean,
            per_pair,
        }
    }
}

/// The fused forward KL of SDCC self-distillation, for logits of type `T`:
/// for each pair `i = (s, t)` (student row, teacher row), weight `w_i` and
/// temperature `τ`, with `p = softmax(logits / τ)`,
///
/// ```text
/// KL_i = Σ_v p_t(v) · (log p_t(v) − log p_s(v))
/// ∂(Σ_i w_i KL_i) / ∂ student[s, v] = Σ_{i: s_i = s} w_i · (p_s(v) − p_t(v)) / τ
/// ```
///
/// computed without materializing either softmax; the teacher gets no
/// gradient (stop-gradient). A teacher entry of `−inf` (`p_t = 0`) adds
/// exactly 0; a student `−inf` under teacher mass gives `KL = +inf` with a
/// finite gradient. A used row holding a NaN or `+inf`, or entirely `−inf`,
/// is an [`Error::NonFinite`] (the lowest such pair).
pub trait SdccBackend<T: Element> {
    /// Where the logits and the gradient live.
    type Memory: Memory;
    /// Element type of the gradient: `T` on the CPU, `f32` on the kernels.
    type Grad: Element;

    /// Runs a validated call: writes every element of the gradient (rows
    /// no pair names are 0) and returns the loss.
    fn run_sdcc(&self, call: SdccCall<'_, '_, Self::Memory, T, Self::Grad>) -> Result<SdccLoss>;

    /// The SDCC forward KL of `args`, its gradient into the caller's `grad`
    /// (shaped like the student logits). Errors: as [`SdccCall::new`], then
    /// the backend's own.
    fn sdcc_forward_kl<'i, 'o>(
        &self,
        args: &SdccArgs<'i, Self::Memory, T>,
        grad: <Self::Memory as Memory>::Mut<'o, Self::Grad>,
    ) -> Result<SdccLoss> {
        self.run_sdcc(SdccCall::new(*args, grad)?)
    }
}

/// Owned result of an SDCC call on host memory ([`HostSdcc::sdcc_owned`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SdccOut<G> {
    /// Sum, mean and per-pair KL.
    pub loss: SdccLoss,
    /// `∂ loss_sum / ∂ student`, shaped like the student logits; rows used
    /// by several pairs hold the sum of their pairs' gradients; rows used
    /// by none are 0.
    pub grad_student: Vec<G>,
}

/// Allocating form of [`SdccBackend`] for backends on host memory.
pub trait HostSdcc<T: Element>: SdccBackend<T, Memory = Host> {
    /// [`SdccBackend::sdcc_forward_kl`] into a fresh gradient (allocated
    /// after the arguments were checked, filled with NaN before the backend
    /// writes it).
    fn sdcc_owned(&self, args: &SdccArgs<'_, Host, T>) -> Result<SdccOut<Self::Grad>> {
        let mut grad = vec![Self::Grad::from_f64(f64::NAN); args.student().len()];
        let loss = self.sdcc_forward_kl(args, &mut grad[..])?;
        Ok(SdccOut {
            loss,
            grad_student: grad,
        })
    }
}

impl<T: Element, B: SdccBackend<T, Memory = Host> + ?Sized> HostSdcc<T> for B {}
