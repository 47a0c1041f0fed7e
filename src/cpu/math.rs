//! Branch-free `exp` for softmax weights, so whole score rows vectorise (libm's `expf` does not).
//!
//! Cephes-style: range reduction by ln 2 with round-to-nearest through the 1.5·2^23 trick, a degree-6
//! polynomial on [-ln2/2, ln2/2], and the exponent built from bits. Relative error about 2e-7 (tested below
//! against f64), far below the tolerances of any dtype kvsparse serves.

pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
/// Polynomial coefficients, highest degree first (the vector version in `avx2.rs` uses the same).
pub(crate) const EXP_C: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1];

/// exp(x) for x ≤ 88; returns exactly 0 for -inf and for x < -87 (where exp underflows anyway).
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    let xc = x.clamp(-87.0, 88.0);
    let n = (xc * LOG2E + ROUND_MAGIC) - ROUND_MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut y = EXP_C[0];
    for &c in &EXP_C[1..] {
        y = y.mul_add(r, c);
    }
    y = y.mul_add(r * r, r + 1.0);
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}

/// `tanh` for the policies' decisions (soft-capped scores in top-p estimates and SnapKV's choice):
/// `sign(x) · (1 − e) / (1 + e)` with `e = fast_exp(−2|x|)`, every operation rounded on its own, so the
/// CUDA selection kernels (`kernels/include/decide.cuh`) compute the same bits. Absolute error below 1e-7; the
/// relative error grows near 0 (3e-4 at |x| = 1e-4), which only perturbs estimates, never attention.
#[inline]
pub fn decision_tanh(x: f32) -> f32 {
    let e = fast_exp(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// Soft-cap of a logit for the decisions: `cap · tanh(x / cap)` with [`decision_tanh`] (0 = off).
#[inline]
pub fn decision_softcap(x: f32, cap: f32) -> f32 {
    if cap > 0.0 {
        cap * decision_tanh(x / cap)
    } else {
        x
    }
}

/// Dot product in the decisions' fixed order: eight lane sums over `i ≡ l (mod 8)`, each product rounded
/// before it is added (no fused multiply-add), then the lanes added in order 0..7. `a.len()` must be a
/// multiple of 8 (every supported head size is). Vectorises on the CPU; the CUDA kernels repeat it.
#[inline(always)]
pub fn decision_dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert!(a.len() % 8 == 0 && a.len() == b.len());
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = acc[0];
    for &v in &acc[1..] {
        s += v;
    }
    s
}

/// Scale of [`softmax_norm`]'s fixed point: 2^42, so that 2^22 numerators (sequences of 4M tokens) of at
/// most ~1 each sum below 2^64 (longer ones wrap, the same way on both backends).
pub const NORM_FIXED_ONE: f64 = 4_398_046_511_104.0;

/// A softmax normaliser Σ e (numerators `e = fast_exp(x − max)`, so each ≤ 1) as an exact fixed-point sum:
/// every term truncated to a multiple of 2^-42, added as integers, so the result is the same whatever
/// order the terms are added in; the CUDA kernels add them with atomics and get the same bits. The
/// truncation costs at most n · 2^-42 of a normaliser that is ≥ 1 (the maximum's own term). NaN if any
/// term is NaN.
pub fn softmax_norm(e: impl IntoIterator<Item = f32>) -> f64 {
    let mut acc = 0u64;
    for x in e {
        if x.is_nan() {
            return f64::NAN;
        }
        acc = acc.wrapping_add((x as f64 * NORM_FIXED_ONE) as u64);
    }
    acc as f64 / NORM_FIXED_ONE
}

/// Sum in order (the decisions' fixed order for `Σ q`).
#[inline]
pub fn ordered_sum(a: &[f32]) -> f32 {
    let mut s = 0f32;
    for &v in a {
        s += v;
    }
    s
}

/// The smaller of `a` and `b` as IEEE 754-2019's minimumNumber: a NaN is ignored (NaN only when both are)
/// and -0 < +0. The key metadata's folds use it so that their result does not depend on the order of the
/// fold (the device folds in other orders; `f32::min` leaves the sign of a zero result unspecified, and
/// compiled code picks either).
#[inline]
pub fn min_num(a: f32, b: f32) -> f32 {
    if a < b || b.is_nan() {
        a
    } else if b < a || a.is_nan() {
        b
    } else {
        f32::from_bits(a.to_bits() | b.to_bits()) // equal: -0 if either is
    }
}

/// The larger of `a` and `b` as IEEE 754-2019's maximumNumber: a NaN is ignored and +0 > -0 (see [`min_num`]).
#[inline]
pub fn max_num(a: f32, b: f32) -> f32 {
    if a > b || b.is_nan() {
        a
    } else if b > a || a.is_nan() {
        b
    } else {
        f32::from_bits(a.to_bits() & b.to_bits()) // equal: +0 if either is
    }
}

/// The largest fp16 value `<= x` (as bits).
pub fn f16_down(x: f32) -> u16 {
    let h = half::f16::from_f32(x);
    if h.is_nan() || h.to_f32() <= x {
        return h.to_bits();
    }
    let b = h.to_bits();
    if b & 0x7fff == 0 {
        0x8001 // ±0 above a tiny negative x: the smallest negative subnormal
    } else if b & 0x8000 == 0 {
        b - 1
    } else {
        b + 1
    }
}

/// The smallest fp16 value `>= x` (as bits).
pub fn f16_up(x: f32) -> u16 {
    f16_down(-x) ^ 0x8000
}

#[cfg(test)]
mod tests {
    use super::*;

    /// min_num / max_num: NaN ignored, -0 < +0, so a fold gives the same bits in every order.
    #[test]
    fn min_max_num_folds_do_not_depend_on_the_order() {
        let vals = [0.0f32, -0.0, 1.5, -2.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -1e-40];
        assert_eq!(min_num(0.0, -0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(min_num(-0.0, 0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(max_num(-0.0, 0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(max_num(0.0, -0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(min_num(f32::NAN, 2.0), 2.0);
        assert_eq!(max_num(2.0, f32::NAN), 2.0);
        assert!(min_num(f32::NAN, f32::NAN).is_nan());
        // Every pair and rotation of a few subsets: the fold's bits are those of the first order.
        for mask in 1u32..(1 << vals.len()) {
            let sub: Vec<f32> = (0..vals.len()).filter(|i| mask >> i & 1 == 1).map(|i| vals[i]).collect();
            let fold = |v: &[f32]| (v.iter().fold(f32::INFINITY, |a, &x| min_num(a, x)).to_bits(), v.iter().fold(f32::NEG_INFINITY, |a, &x| max_num(a, x)).to_bits());
            let want = fold(&sub);
            let mut r = sub.clone();
            for _ in 0..sub.len() {
                r.rotate_left(1);
                assert_eq!(fold(&r), want, "{sub:?}");
                let rev: Vec<f32> = r.iter().rev().copied().collect();
                assert_eq!(fold(&rev), want, "{sub:?}");
            }
        }
    }

    #[test]
    fn fast_exp_matches_f64_exp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = fast_exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(-1000.0), 0.0);
        assert_eq!(fast_exp(0.0), 1.0);
    }

    #[test]
    fn softmax_norm_is_order_free_close_to_the_f64_sum_and_nan_on_nan() {
        let mut rng = crate::rng::Rng::new(crate::rng::Rng::fresh_seed());
        let e: Vec<f32> = (0..50_000).map(|i| if i == 7 { 1.0 } else { fast_exp(-(rng.uniform() as f32) * 30.0) }).collect();
        let z = softmax_norm(e.iter().copied());
        let mut rev = e.clone();
        rev.reverse();
        assert_eq!(z.to_bits(), softmax_norm(rev.iter().copied()).to_bits(), "the same bits in any order");
        let exact: f64 = e.iter().map(|&x| x as f64).sum();
        assert!((z - exact).abs() <= e.len() as f64 / NORM_FIXED_ONE, "{z} vs {exact}");
        assert!(z <= exact, "truncation only lowers the sum");
        let mut poisoned = e.clone();
        poisoned[123] = f32::NAN;
        assert!(softmax_norm(poisoned).is_nan());
    }

    #[test]
    fn decision_tanh_is_close_to_tanh() {
        let mut x = -20.0f32;
        while x <= 20.0 {
            let (got, want) = (decision_tanh(x) as f64, (x as f64).tanh());
            assert!((got - want).abs() < 2e-7 + 1e-6 * want.abs(), "{x}: {got} vs {want}");
            x += 0.0031;
        }
        assert!(decision_tanh(f32::NAN).is_nan());
        assert_eq!(decision_tanh(f32::INFINITY), 1.0);
        assert_eq!(decision_softcap(3.0, 0.0), 3.0);
    }
}
