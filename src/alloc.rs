//! Fallible allocation for buffers whose size follows from caller input (layer counts, cache sizes,
//! batch sizes): a size the machine cannot hold is `OutOfMemory` with a message, never an abort.

use crate::error::{Error, ErrorKind, Result};

fn oom(n: usize, size: usize, what: &str) -> Error {
    Error::new(ErrorKind::OutOfMemory, format!("cannot allocate {what}: {n} entries of {size} bytes"))
}

/// An empty vector with room for `n` entries.
pub fn try_with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| oom(n, std::mem::size_of::<T>(), what))?;
    Ok(v)
}

/// `vec![value; n]`, fallibly.
pub fn try_vec<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = try_with_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// Checked product of sizes (`what` names the quantity in the error).
pub fn checked_product(factors: &[usize], what: &str) -> Result<usize> {
    factors.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).ok_or_else(|| Error::new(ErrorKind::OutOfMemory, format!("{what} {factors:?} overflows a 64-bit size")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        let e = try_vec(usize::MAX / 2, 0u64, "test buffer").unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert!(e.message.contains("test buffer"), "{e}");
        assert_eq!(checked_product(&[1 << 40, 1 << 40], "x").unwrap_err().kind, ErrorKind::OutOfMemory);
        assert_eq!(try_vec(3, 7u8, "small").unwrap(), vec![7, 7, 7]);
    }
}
