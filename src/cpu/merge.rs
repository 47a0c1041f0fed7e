//! Exact merge of two partial attention results over disjoint key sets, through their log-sum-exps:
//! with m = max(lse_a, lse_b), w_x = exp(lse_x − m): out = (w_a·out_a + w_b·out_b) / (w_a + w_b) and
//! lse = m + ln(w_a + w_b). A side with lse = −inf (no keys) contributes nothing.

use super::convert::{load_row, store_row, Portable};
use crate::tensor::TensorRef;

/// Merges one (row, head) pair; returns the merged LSE. `a`, `b`, `out` are f32 rows of equal length.
pub fn merge_row(a: &[f32], lse_a: f32, b: &[f32], lse_b: f32, out: &mut [f32]) -> f32 {
    let m = lse_a.max(lse_b);
    if m == f32::NEG_INFINITY {
        out.fill(0.0);
        return f32::NEG_INFINITY;
    }
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
