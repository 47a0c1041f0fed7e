//! The f32 vector the prefill micro-kernels ([`super::prefill`]) are written over, implemented by the
//! portable lanes there and by the AVX2/AVX-512 registers in [`super::avx2`] / [`super::avx512`]. A file of
//! its own so that the instruction-set modules depend on the trait, not on the prefill code that uses it.

#[allow(unused_imports)] // named by the doc comment of `exp`
use super::math::fast_exp;

/// A vector of `L` f32 lanes: what the micro-kernels are written over.
pub(crate) trait Simd: Copy {
    const L: usize;
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn splat(p: *const f32) -> Self::V;
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise maximum (either operand NaN: the second).
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// [`fast_exp`] on every lane, bit for bit.
    unsafe fn exp(x: Self::V) -> Self::V;
    /// The prefill tiles' softmax weights: `exp(x)` on lanes where `keep` is all ones and `x ≥ -87`, else
    /// exactly 0 (a masked `-inf`, a row without weight), for `x ≤ 0` (a score minus its row's running
    /// maximum). Fewer operations than [`exp`](Self::exp) (a rounding instruction, fused range reduction,
    /// Horner's scheme, the exponent by `vscalefps` on AVX-512): relative error within 4e-7 of f64's
    /// `exp`, not bit-equal to [`fast_exp`].
    unsafe fn exp_weight(x: Self::V, keep: Self::V) -> Self::V;
}
