//! The result check of the CPU backend's calls (their inputs are checked
//! once, by the contract's argument types: `backend::contract`).

use crate::backend::Element;
use crate::{Error, Result};

/// `Err(NonFinite)` at the first NaN or ±inf of a result. Finite inputs can
/// still overflow `T` (e.g. `scale · q·k` beyond f32 range, or a result
/// beyond f16's 65504 as it is rounded); this linear scan
/// turns that into an error instead of a silent NaN. The attention calls
/// run it only once a work item has reported a non-finite row, to name the
/// first bad index.
pub(crate) fn check_result<T: Element>(what: &str, x: &[T]) -> Result<()> {
    match x.iter().position(|v| !v.to_f64().is_finite()) {
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
