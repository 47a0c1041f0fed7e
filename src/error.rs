//! One error type for the whole crate. Every failure carries a kind (mapped 1:1 onto the C status codes)
//! and a human message that names the offending argument, so `kvs_last_error` can tell the caller what to fix.

use std::fmt;

/// What went wrong, coarse enough to branch on from C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A NULL pointer, a bad scalar value, a malformed policy spec.
    InvalidArgument,
    /// Wrong number of dimensions, wrong extent, bad strides.
    InvalidShape,
    /// A dtype that is not accepted for that argument.
    InvalidDtype,
    /// An index or length outside what the cache or table holds (block ids, seq_lens, slots).
    OutOfRange,
    /// Valid request that this build or device cannot serve (head size, CUDA not built, ...).
    Unsupported,
    /// A sequence id the engine holds no state for.
    UnknownSequence,
    /// An allocation or a configured memory cap failed.
    OutOfMemory,
    /// The device or its driver reported an error.
    Device,
    /// A bug inside kvsparse (including a caught panic).
    Internal,
}

impl ErrorKind {
    /// The C ABI's `kvs_status` value of this kind (`ffi::guard::status_of` returns the same, as the enum).
    pub fn status_code(self) -> u32 {
        match self {
            ErrorKind::InvalidArgument => 1,
            ErrorKind::InvalidShape => 2,
            ErrorKind::InvalidDtype => 3,
            ErrorKind::OutOfRange => 4,
            ErrorKind::Unsupported => 5,
            ErrorKind::UnknownSequence => 6,
            ErrorKind::OutOfMemory => 7,
            ErrorKind::Device => 8,
            ErrorKind::Internal => 9,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Early-return helpers: `bail!(InvalidShape, "query must be 3-D, got {}", n)`.
#[macro_export]
macro_rules! bail {
    ($kind:ident, $($arg:tt)*) => {
        return Err($crate::error::Error::new($crate::error::ErrorKind::$kind, format!($($arg)*)))
    };
}

/// `ensure!(cond, Kind, "message {}", x)`: bail unless the condition holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $kind:ident, $($arg:tt)*) => {
        if !$cond {
            $crate::bail!($kind, $($arg)*);
        }
    };
}
