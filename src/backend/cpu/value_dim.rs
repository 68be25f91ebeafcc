//! Calls whose V has another head dim than Q and K (multi-head latent
//! attention: DeepSeek-V3 and Kimi K2 attend with 192-dim queries and keys
//! over 128-dim values). They run as the square call of head dim `D =
//! max(head_dim, v_head_dim)` on copies zero-padded to `D` — exact, since a
//! zero lane adds nothing to a score (`q·k`) and a zero V lane only makes a
//! zero O lane — whose outputs are then cut back to their own dims. The
//! backend copies its operands into padded head-major layouts anyway; this
//! adds one token-major copy of each input and output (`O(L · heads · D)`
//! memory) and computes the narrower products at `D` lanes (192 / 128: the
//! `P V` half of the forward at 1.5× its work).

use super::{attention_bwd, attention_fwd, CpuElement};
use crate::backend::{AttnArgs, AttnShape, BackwardCall, ForwardCall, Grads, Host, Saved};
use crate::{Error, Result};

/// The forward of a call with `v_head_dim != head_dim`.
pub(super) fn forward<S: CpuElement>(
    call: ForwardCall<'_, '_, Host, S, S::Compute>,
    threads: usize,
) -> Result<()> {
    let (args, o, lse) = call.into_parts();
    let s = args.shape();
    let d = s.head_dim.max(s.v_head_dim);
    let wide = square(&s, d);
    let (q, k, v) = (
        pad(args.q(), s.head_dim, d),
        pad(args.k(), s.head_dim, d),
        pad(args.v(), s.v_head_dim, d),
    );
    let inner = square_args(args.reborrow(), &q, &k, &v, wide)?;
    let mut o_wide = vec![S::default(); wide.o_len()];
    attention_fwd::forward(ForwardCall::new(inner, &mut o_wide[..], lse)?, threads)
        .map_err(|e| narrow_index(e, d, s.v_head_dim))?;
    cut(&o_wide, d, o, s.v_head_dim);
    Ok(())
}

/// The backward of a call with `v_head_dim != head_dim`.
pub(super) fn backward<S: CpuElement>(
    call: BackwardCall<'_, '_, '_, Host, S, S::Compute>,
    threads: usize,
) -> Result<()> {
    let (args, saved, d_o, grads) = call.into_parts();
    let s = args.shape();
    let d = s.head_dim.max(s.v_head_dim);
    let wide = square(&s, d);
    let (q, k, v) = (
        pad(args.q(), s.head_dim, d),
        pad(args.k(), s.head_dim, d),
        pad(args.v(), s.v_head_dim, d),
    );
    let (o, d_o) = (pad(saved.o, s.v_head_dim, d), pad(d_o, s.v_head_dim, d));
    let inner = square_args(args.reborrow(), &q, &k, &v, wide)?;
    let mut dq = vec![S::default(); wide.q_len()];
    let mut dk = vec![S::default(); wide.kv_len()];
    let mut dv = vec![S::default(); wide.v_len()];
    let Grads {
        dq: dq_out,
        dk: dk_out,
        dv: dv_out,
        dsinks,
    } = grads;
    let wide_grads = Grads {
        dq: &mut dq[..],
        dk: &mut dk[..],
        dv: &mut dv[..],
        dsinks,
    };
    let saved = Saved {
        o: &o[..],
        lse: saved.lse,
    };
    let call = BackwardCall::new(inner, saved, &d_o[..], wide_grads)?;
    attention_bwd::backward(call, threads).map_err(|e| match &e {
        Error::NonFinite { what, .. } if what == "dv" => narrow_index(e, d, s.v_head_dim),
        _ => narrow_index(e, d, s.head_dim),
    })?;
    cut(&dq, d, dq_out, s.head_dim);
    cut(&dk, d, dk_out, s.head_dim);
    cut(&dv, d, dv_out, s.v_head_dim);
    Ok(())
}

/// `s` with both head dims `d`.
fn square(s: &AttnShape, d: usize) -> AttnShape {
    AttnShape {
        head_dim: d,
        v_head_dim: d,
        ..*s
    }
}

/// The square call on the padded copies, with the call's mask, sinks, key
/// starts and parameters (the inputs were checked for finiteness already).
fn square_args<'a, S: CpuElement>(
    args: AttnArgs<'a, Host, S>,
    q: &'a [S],
    k: &'a [S],
    v: &'a [S],
    wide: AttnShape,
) -> Result<AttnArgs<'a, Host, S>> {
    let mut params = *args.params();
    params.check_finite = false;
    let mut inner = AttnArgs::new(q, k, v, wide, args.mask(), params)?;
    if let Some(sinks) = args.sinks() {
        inner = inner.with_sinks(sinks)?;
    }
    match args.key_starts() {
        Some(starts) => inner.with_key_starts(starts),
        None => Ok(inner),
    }
}

/// `x` `[rows, from]` as `[rows, to]`, zero past column `from`.
fn pad<S: CpuElement>(x: &[S], from: usize, to: usize) -> Vec<S> {
    let mut out = vec![S::default(); x.len() / from * to];
    for (dst, src) in out.chunks_exact_mut(to).zip(x.chunks_exact(from)) {
        dst[..from].copy_from_slice(src);
    }
    out
}

/// The first `to` columns of `x` `[rows, from]` into `out` `[rows, to]`.
fn cut<S: Copy>(x: &[S], from: usize, out: &mut [S], to: usize) {
    for (dst, src) in out.chunks_exact_mut(to).zip(x.chunks_exact(from)) {
        dst.copy_from_slice(&src[..to]);
    }
}

/// A non-finite error's index in a `[rows, from]` padded output as the
/// index in the caller's `[rows, to]` one.
fn narrow_index(e: Error, from: usize, to: usize) -> Error {
    match e {
        Error::NonFinite { what, index } => Error::NonFinite {
            what,
            index: index / from * to + (index % from).min(to - 1),
        },
        other => other,
    }
}
