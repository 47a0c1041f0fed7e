//! Exact merge of two partial attention results over disjoint key sets, through their log-sum-exps:
//! with m = max(lse_a, lse_b), w_x = exp(lse_x − m): out = (w_a·out_a + w_b·out_b) / (w_a + w_b) and
//! lse = m + ln(w_a + w_b).
//!
//! Non-finite values, as documented on `kvs_merge_args`: a side with lse = −inf (no keys) contributes
//! nothing, its output is not read; a NaN or +inf lse on either side gives a NaN row and a NaN lse; NaN or
//! infinity in the output of a side with a finite lse reaches the merged elements (IEEE arithmetic, even
//! when that side's weight underflows to 0).

use super::convert::{load_row, store_row, Portable};
use crate::tensor::TensorRef;

/// Merges one (row, head) pair; returns the merged LSE. `a`, `b`, `out` are f32 rows of equal length.
pub fn merge_row(a: &[f32], lse_a: f32, b: &[f32], lse_b: f32, out: &mut [f32]) -> f32 {
    let invalid = |l: f32| l.is_nan() || l == f32::INFINITY;
    if invalid(lse_a) || invalid(lse_b) {
        out.fill(f32::NAN);
        return f32::NAN;
    }
    match (lse_a == f32::NEG_INFINITY, lse_b == f32::NEG_INFINITY) {
        (true, true) => {
            out.fill(0.0);
            return f32::NEG_INFINITY;
        }
        (false, true) => {
            out.copy_from_slice(a);
            return lse_a;
        }
        (true, false) => {
            out.copy_from_slice(b);
            return lse_b;
        }
        (false, false) => {}
    }
    let m = lse_a.max(lse_b);
    let wa = (lse_a - m).exp();
    let wb = (lse_b - m).exp();
    let inv = 1.0 / (wa + wb);
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = (wa * x + wb * y) * inv;
    }
    m + (wa + wb).ln()
}

/// Merges `[tokens, heads, dim]` partial outputs (validated views, any float dtype, f32 LSEs).
pub fn merge_states(out_a: &TensorRef, lse_a: &TensorRef, out_b: &TensorRef, lse_b: &TensorRef, out: &TensorRef, lse_out: Option<&TensorRef>) {
    let (t_n, h_n, d) = (out.dim(0), out.dim(1), out.dim(2));
    let (mut a, mut b, mut o) = (vec![0f32; d], vec![0f32; d], vec![0f32; d]);
    for t in 0..t_n {
        for h in 0..h_n {
            // SAFETY: every index is inside the validated shapes.
            unsafe {
                load_row::<Portable>(out_a.ptr_at(&[t, h, 0]), out_a.dtype, out_a.stride(2), d, &mut a);
                load_row::<Portable>(out_b.ptr_at(&[t, h, 0]), out_b.dtype, out_b.stride(2), d, &mut b);
                let la = (lse_a.ptr_at(&[t, h]) as *const f32).read_unaligned();
                let lb = (lse_b.ptr_at(&[t, h]) as *const f32).read_unaligned();
                let l = merge_row(&a, la, &b, lb, &mut o);
                store_row(&o, out.ptr_at(&[t, h, 0]), out.dtype, out.stride(2));
                if let Some(lo) = lse_out {
                    (lo.ptr_at(&[t, h]) as *mut f32).write_unaligned(l);
                }
            }
        }
    }
}
