//! The crate's one error type. Every fallible public function returns
//! [`Result<T>`]; bad input is reported as an `Err` that names what was wrong
//! and where (rollout id, call index, field, line number, tensor name), never
//! as a panic.

use std::fmt;

/// Everything that can go wrong in treeattn.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// A rollout that breaks the calls format (DESIGN §2): names the rollout
    /// id, the call index (if the problem is inside one call) and the field.
    Rollout {
        /// Id of the rollout.
        rollout: String,
        /// Index of the call, when the problem is inside one.
        call: Option<usize>,
        /// The JSON field at fault.
        field: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// A JSON Lines input that cannot be parsed; `line` counts from 1.
    Json {
        /// Line of the input.
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// Tensor shapes or lengths that do not fit together.
    Shape(String),
    /// A configuration the op does not support (head dim, dtype, ...).
    Unsupported(String),
    /// A NaN or infinity where finite values are required.
    NonFinite {
        /// The tensor or field.
        what: String,
        /// Index of its first bad element.
        index: usize,
    },
    /// A pack that is malformed or does not belong to the tensors given.
    Pack(String),
    /// File system errors, with the path.
    Io(String),
    /// CUDA driver / module / launch errors (and "no GPU present").
    Cuda(String),
    /// Bad command-line usage.
    Usage(String),
    /// A null pointer where a buffer of elements was required (the raw
    /// entries of [`crate::ffi`]): names the buffer.
    Null(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Rollout {
                rollout,
                call,
                field,
                msg,
            } => match call {
                Some(c) => write!(f, "rollout {rollout:?}, call {c}, field `{field}`: {msg}"),
                None => write!(f, "rollout {rollout:?}, field `{field}`: {msg}"),
            },
            Error::Json { line, msg } => write!(f, "line {line}: invalid rollout JSON: {msg}"),
            Error::Shape(m) => write!(f, "shape mismatch: {m}"),
            Error::Unsupported(m) => write!(f, "unsupported: {m}"),
            Error::NonFinite { what, index } => {
                write!(f, "non-finite value in {what} at index {index}")
            }
            Error::Pack(m) => write!(f, "invalid pack: {m}"),
            Error::Io(m) => write!(f, "i/o error: {m}"),
            Error::Cuda(m) => write!(f, "cuda: {m}"),
            Error::Usage(m) => write!(f, "usage: {m}"),
            Error::Null(m) => write!(f, "null pointer: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
