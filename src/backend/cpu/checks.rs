//! Input and result checks shared by the CPU backend's calls.

use super::CpuFloat;
use crate::backend::{AttnParams, AttnShape};
use crate::mask::PackMask;
use crate::{Error, Result};

/// `Err(Shape)` unless `got == expected`.
pub(crate) fn check_len(what: &str, got: usize, expected: usize, how: &str) -> Result<()> {
    if got != expected {
        return Err(Error::Shape(format!(
            "{what} has {got} elements, expected {expected} ({how})"
        )));
    }
    Ok(())
}

/// `Err(NonFinite)` at the first NaN or ±inf.
pub(crate) fn check_finite<T: CpuFloat>(what: &str, x: &[T]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: what.to_string(),
            index,
        }),
        None => Ok(()),
    }
}

/// `Err(NonFinite)` at the first NaN or ±inf of a result. Finite inputs can
/// still overflow `T` (e.g. `scale · q·k` beyond f32 range); this linear scan
/// turns that into an error instead of a silent NaN. The attention calls
/// run it only once a work item has reported a non-finite row, to name the
/// first bad index.
pub(crate) fn check_result<T: CpuFloat>(what: &str, x: &[T]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: format!(
                "{what} (the result overflowed {}: inputs too large or non-finite)",
                T::NAME
            ),
            index,
        }),
        None => Ok(()),
    }
}

/// Validation shared by forward and backward: shape, params, mask (re-checked,
/// since `PackMask`'s fields are public), and the q, k, v lengths.
pub(crate) fn check_qkv<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &AttnShape,
    mask: &PackMask<'_>,
    params: &AttnParams,
) -> Result<()> {
    shape.validate()?;
    params.validate(shape)?;
    if mask.len() != shape.tokens {
        return Err(Error::Pack(format!(
            "kv_end has {} entries but the attention shape has {} tokens",
            mask.len(),
            shape.tokens
        )));
    }
    PackMask::new(mask.kv_end, mask.position_ids)?;
    let elements = |heads: usize| {
        shape
            .tokens
            .checked_mul(heads)
            .and_then(|x| x.checked_mul(shape.head_dim))
    };
    if elements(shape.q_heads).is_none() || elements(shape.kv_heads).is_none() {
        return Err(Error::Shape(format!(
            "attention shape {shape:?} overflows usize"
        )));
    }
    let q_how = "tokens · q_heads · head_dim";
    let kv_how = "tokens · kv_heads · head_dim";
    check_len("q", q.len(), shape.q_len(), q_how)?;
    check_len("k", k.len(), shape.kv_len(), kv_how)?;
    check_len("v", v.len(), shape.kv_len(), kv_how)?;
    if params.check_finite {
        check_finite("q", q)?;
        check_finite("k", k)?;
        check_finite("v", v)?;
    }
    Ok(())
}
