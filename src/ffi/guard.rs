//! The one wrapper every exported function goes through: it catches panics (none may cross the C
//! boundary), turns a `Result` into a status code, and keeps the message for `kvs_last_error`; with the
//! status it returns and the engine handle, what any C entry is made of (a policy's own too, in its
//! folder: this file imports no policy).
#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::engine::Engine;
use crate::error::{ErrorKind, Result};

/// Result of every kvsparse call except `kvs_version`, `kvs_last_error` and `kvs_engine_destroy`.
/// 0 is success; any other value comes with a message from `kvs_last_error()`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvs_status {
    KVS_OK = 0,
    /// A NULL pointer, a bad scalar, a malformed policy spec, a struct_size that is too small.
    KVS_ERR_INVALID_ARGUMENT = 1,
    /// Wrong ndim, extent or strides.
    KVS_ERR_INVALID_SHAPE = 2,
    /// A dtype not accepted for that argument.
    KVS_ERR_INVALID_DTYPE = 3,
    /// An index or length outside the cache or table: block ids, seq_lens, query lengths, slots, layers.
    KVS_ERR_OUT_OF_RANGE = 4,
    /// A valid request this build or device cannot serve (head size, block size, device, ...).
    KVS_ERR_UNSUPPORTED = 5,
    /// `kvs_sequence_release` of an id the engine does not hold.
    KVS_ERR_UNKNOWN_SEQUENCE = 6,
    KVS_ERR_OUT_OF_MEMORY = 7,
    /// The GPU driver or runtime reported an error.
    KVS_ERR_DEVICE = 8,
    /// A bug in kvsparse (including a caught panic); the message says where.
    KVS_ERR_INTERNAL = 9,
}

/// Opaque engine handle.
pub struct kvs_engine {
    pub(crate) inner: crate::engine::Engine,
}

/// The engine behind a C handle (NULL is `KVS_ERR_INVALID_ARGUMENT`).
pub(crate) unsafe fn engine_ref<'a>(p: *const kvs_engine) -> Result<&'a Engine> {
    crate::ensure!(!p.is_null(), InvalidArgument, "engine is NULL");
    Ok(&(*p).inner)
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::new("no error").unwrap());
}

/// Stores `msg` as this thread's last error (interior NULs are replaced).
pub fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Pointer to this thread's last error message; valid until the thread's next failing kvsparse call.
pub fn last_error_ptr() -> *const std::os::raw::c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

pub fn status_of(kind: ErrorKind) -> kvs_status {
    match kind {
        ErrorKind::InvalidArgument => kvs_status::KVS_ERR_INVALID_ARGUMENT,
        ErrorKind::InvalidShape => kvs_status::KVS_ERR_INVALID_SHAPE,
        ErrorKind::InvalidDtype => kvs_status::KVS_ERR_INVALID_DTYPE,
        ErrorKind::OutOfRange => kvs_status::KVS_ERR_OUT_OF_RANGE,
        ErrorKind::Unsupported => kvs_status::KVS_ERR_UNSUPPORTED,
        ErrorKind::UnknownSequence => kvs_status::KVS_ERR_UNKNOWN_SEQUENCE,
        ErrorKind::OutOfMemory => kvs_status::KVS_ERR_OUT_OF_MEMORY,
        ErrorKind::Device => kvs_status::KVS_ERR_DEVICE,
        ErrorKind::Internal => kvs_status::KVS_ERR_INTERNAL,
    }
}

/// Runs `f`, mapping `Ok` to `KVS_OK`, errors to their status (message kept), panics to
/// `KVS_ERR_INTERNAL`.
pub fn guard(f: impl FnOnce() -> Result<()>) -> kvs_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => kvs_status::KVS_OK,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            status_of(e.kind)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            set_last_error(&format!("internal error (a bug in kvsparse, please report it): {what}"));
            kvs_status::KVS_ERR_INTERNAL
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ErrorKind::status_code` (what layers below the ABI report) is the status `guard` returns.
    #[test]
    fn status_codes_agree() {
        use ErrorKind::*;
        for k in [InvalidArgument, InvalidShape, InvalidDtype, OutOfRange, Unsupported, UnknownSequence, OutOfMemory, Device, Internal] {
            assert_eq!(status_of(k) as u32, k.status_code(), "{k:?}");
        }
    }
}
