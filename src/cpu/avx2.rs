//! Explicit AVX2/FMA versions of the two inner loops (scores Q·Kᵀ and P·V). The compiler's
//! auto-vectoriser splits the register-blocked generic code into 2-wide pieces and spills, so these are
//! written with intrinsics: 4 query rows × 2 keys of 8-lane accumulators for the scores, 4 rows × 16
//! columns for the values, all in registers. They read K and V rows straight from the cache (fp16 through
//! F16C, bf16 by a shift) so no f32 staging copy is written and read back.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::chunk::CHUNK;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Eight f32 lanes for the prefill micro-kernels ([`super::prefill`]); only valid inside code compiled
/// with AVX2 and FMA enabled (the `#[inline(always)]` bodies are inlined into such functions).
#[derive(Clone, Copy)]
pub(crate) struct Ymm;

impl super::simd::Simd for Ymm {
    const L: usize = 8;
    type V = __m256;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> __m256 {
        _mm256_broadcast_ss(&*p)
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        _mm256_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        _mm256_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        exp8(x)
    }
    #[inline(always)]
    unsafe fn exp_weight(x: __m256, keep: __m256) -> __m256 {
        use super::math::{EXP_C, LN2_HI, LN2_LO, LOG2E};
        let xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc));
        let mut y = _mm256_set1_ps(EXP_C[0]);
        for &c in &EXP_C[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let one = _mm256_set1_ps(1.0);
        y = _mm256_fmadd_ps(_mm256_fmadd_ps(y, r, one), r, one);
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127))));
        let live = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-87.0)), keep);
        _mm256_and_ps(_mm256_mul_ps(y, scale), live)
    }
}

/// Row formats the kernels read directly (no f32 staging copy): the const parameter of
/// [`scores_rows`] and [`accumulate_rows`].
pub const FMT_F32: u8 = 0;
pub const FMT_F16: u8 = 1;
pub const FMT_BF16: u8 = 2;

/// Eight consecutive elements of a row of format `$fmt` at element index `$i`, as f32 lanes.
macro_rules! load8 {
    ($fmt:expr, $p:expr, $i:expr) => {
        match $fmt {
            FMT_F16 => _mm256_cvtph_ps(_mm_loadu_si128(($p as *const u16).add($i) as *const __m128i)),
            FMT_BF16 => _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(($p as *const u16).add($i) as *const __m128i)), 16)),
            _ => _mm256_loadu_ps(($p as *const f32).add($i)),
        }
    };
}

/// `scores[r * CHUNK + j] = q_r · k_j` for all rows and the `n` keys in `kbuf` (`d % 8 == 0`).
///
/// # Safety
/// Requires AVX2 and FMA; slices must hold `rows × d` queries, `n × d` keys, `rows × CHUNK` scores.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores(scores: &mut [f32], q: &[f32], kbuf: &[f32], rows: usize, n: usize, d: usize) {
    assert!(kbuf.len() >= n * d && n <= CHUNK);
    let mut ptrs = [std::ptr::null::<u8>(); CHUNK];
    for (j, p) in ptrs[..n].iter_mut().enumerate() {
        *p = kbuf.as_ptr().add(j * d) as *const u8;
    }
    scores_rows::<FMT_F32>(scores, q, &ptrs[..n], rows, d)
}

/// Horizontal sums of eight accumulators at once: lane `i` of the result is the sum of `a[i]`'s lanes.
#[inline(always)]
unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
    let s01 = _mm256_hadd_ps(a[0], a[1]);
    let s23 = _mm256_hadd_ps(a[2], a[3]);
    let s45 = _mm256_hadd_ps(a[4], a[5]);
    let s67 = _mm256_hadd_ps(a[6], a[7]);
    // [a0 a1 a2 a3 | a0 a1 a2 a3] as sums of the low and of the high 128-bit halves
    let lo = _mm256_hadd_ps(s01, s23);
    let hi = _mm256_hadd_ps(s45, s67);
    _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31))
}

/// `scores[r * CHUNK + j] = q_r · k_j` with key `j` read from `krows[j]` (a contiguous row of format
/// `FMT`, converted in registers). Rows go in blocks of 4, the rest in one block of 3, 2 or 1, each block
/// against as many keys at once as keep eight accumulators busy (4×2, 3×2, 2×4, 1×8): every K load feeds
/// every row of the block, and one horizontal-sum tree finishes eight scores.
///
/// # Safety
/// Requires AVX2, FMA and F16C; every `krows[j]` must address `d` elements; `q` holds `rows × d`,
/// `scores` `rows × CHUNK`; `d % 8 == 0`, `krows.len() <= CHUNK`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores_rows<const FMT: u8>(scores: &mut [f32], q: &[f32], krows: &[*const u8], rows: usize, d: usize) {
    let n = krows.len();
    assert!(q.len() >= rows * d && scores.len() >= rows * CHUNK && d % 8 == 0 && n <= CHUNK);
    let (sp, qp) = (scores.as_mut_ptr(), q.as_ptr());
    let mut r0 = 0;
    while r0 + 4 <= rows {
        score_rows_block::<FMT, 4, 2>(sp, qp, krows, r0, d);
        r0 += 4;
    }
    match rows - r0 {
        3 => score_rows_block::<FMT, 3, 2>(sp, qp, krows, r0, d),
        2 => score_rows_block::<FMT, 2, 4>(sp, qp, krows, r0, d),
        1 => score_rows_block::<FMT, 1, 8>(sp, qp, krows, r0, d),
        _ => {}
    }
}

/// Scores of rows `r0..r0 + R` against all keys, `KB` keys at a time (`R * KB <= 8`).
#[inline(always)]
unsafe fn score_rows_block<const FMT: u8, const R: usize, const KB: usize>(sp: *mut f32, qp: *const f32, krows: &[*const u8], r0: usize, d: usize) {
    let n = krows.len();
    let mut j = 0;
    while j < n {
        let valid = (n - j).min(KB);
        // A short last group repeats its last key (computed, not stored).
        let mut kp = [std::ptr::null::<u8>(); KB];
        for (b, p) in kp.iter_mut().enumerate() {
            *p = *krows.get_unchecked(j + b.min(valid - 1));
        }
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut c = 0;
        while c < d {
            let mut kv = [_mm256_setzero_ps(); KB];
            for b in 0..KB {
                kv[b] = load8!(FMT, kp[b], c);
            }
            for r in 0..R {
                let x = _mm256_loadu_ps(qp.add((r0 + r) * d + c));
                for b in 0..KB {
                    acc[r * KB + b] = _mm256_fmadd_ps(x, kv[b], acc[r * KB + b]);
                }
            }
            c += 8;
        }
        let mut t = [0f32; 8];
        _mm256_storeu_ps(t.as_mut_ptr(), hsum8(&acc));
        // (the two loops differ in the trip count being a constant: a variable one becomes a memcpy call)
        if valid == KB {
            for r in 0..R {
                for b in 0..KB {
                    *sp.add((r0 + r) * CHUNK + j + b) = t[r * KB + b];
                }
            }
        } else {
            for r in 0..R {
                for b in 0..valid {
                    *sp.add((r0 + r) * CHUNK + j + b) = t[r * KB + b];
                }
            }
        }
        j += KB;
    }
}

/// `acc[r] += Σ_j p[r * CHUNK + j] · v_j` for all rows (`d % 16 == 0`).
///
/// # Safety
/// Requires AVX2 and FMA; slices must hold `rows × d` accumulators, `rows × CHUNK` weights, `n × d` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn accumulate(acc: &mut [f32], p: &[f32], vbuf: &[f32], rows: usize, n: usize, d: usize) {
    assert!(vbuf.len() >= n * d && n <= CHUNK);
    let mut ptrs = [std::ptr::null::<u8>(); CHUNK];
    for (j, ptr) in ptrs[..n].iter_mut().enumerate() {
        *ptr = vbuf.as_ptr().add(j * d) as *const u8;
    }
    accumulate_rows::<FMT_F32>(acc, p, &ptrs[..n], rows, d)
}

/// `acc[r] += Σ_j p[r * CHUNK + j] · v_j` with value `j` read from `vrows[j]` (format `FMT`), rows in
/// blocks of 4 (the rest in one block of 3, 2 or 1) × 16 columns of accumulators held in registers across
/// the chunk, so every V load feeds every row of the block.
///
/// # Safety
/// Requires AVX2, FMA and F16C; every `vrows[j]` must address `d` elements; `acc` holds `rows × d`, `p`
/// `rows × CHUNK`; `d % 16 == 0`, `vrows.len() <= CHUNK`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn accumulate_rows<const FMT: u8>(acc: &mut [f32], p: &[f32], vrows: &[*const u8], rows: usize, d: usize) {
    let n = vrows.len();
    assert!(acc.len() >= rows * d && p.len() >= rows * CHUNK && d % 16 == 0 && n <= CHUNK);
    let (ap, pp) = (acc.as_mut_ptr(), p.as_ptr());
    let mut r0 = 0;
    while r0 + 4 <= rows {
        accumulate_rows_block::<FMT, 4>(ap, pp, vrows, r0, d);
        r0 += 4;
    }
    match rows - r0 {
        3 => accumulate_rows_block::<FMT, 3>(ap, pp, vrows, r0, d),
        2 => accumulate_rows_block::<FMT, 2>(ap, pp, vrows, r0, d),
        1 => accumulate_rows_block::<FMT, 1>(ap, pp, vrows, r0, d),
        _ => {}
    }
}

#[inline(always)]
unsafe fn accumulate_rows_block<const FMT: u8, const R: usize>(ap: *mut f32, pp: *const f32, vrows: &[*const u8], r0: usize, d: usize) {
    let mut c = 0;
    while c < d {
        let mut a = [[_mm256_setzero_ps(); 2]; R];
        for r in 0..R {
            a[r][0] = _mm256_loadu_ps(ap.add((r0 + r) * d + c));
            a[r][1] = _mm256_loadu_ps(ap.add((r0 + r) * d + c + 8));
        }
        for (j, &v) in vrows.iter().enumerate() {
            let v0 = load8!(FMT, v, c);
            let v1 = load8!(FMT, v, c + 8);
            for r in 0..R {
                let w = _mm256_broadcast_ss(&*pp.add((r0 + r) * CHUNK + j));
                a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(ap.add((r0 + r) * d + c), a[r][0]);
            _mm256_storeu_ps(ap.add((r0 + r) * d + c + 8), a[r][1]);
        }
        c += 16;
    }
}

/// [`super::math::fast_exp`] on eight lanes, the same operations in the same order (so both paths give
/// bit-identical weights). NaN stays NaN (the clamps are ordered so that `max`/`min` return the NaN).
#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    use super::math::{EXP_C, LN2_HI, LN2_LO, LOG2E, ROUND_MAGIC};
    let xc = _mm256_min_ps(_mm256_set1_ps(88.0), _mm256_max_ps(_mm256_set1_ps(-87.0), x));
    let magic = _mm256_set1_ps(ROUND_MAGIC);
    let n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)), magic), magic);
    let r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))), _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
    let mut y = _mm256_set1_ps(EXP_C[0]);
    for &c in &EXP_C[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    let under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_LT_OQ);
    _mm256_andnot_ps(under, _mm256_mul_ps(y, scale))
}

/// Largest element of `x` (NaN handling as `f32::max`: a NaN is skipped unless all are NaN; the NaN
/// itself still reaches the output through [`exp_sub_sum`]).
///
/// # Safety
/// Requires AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn max(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    let mut i = 0;
    let mut m = f32::NEG_INFINITY;
    if n >= 8 {
        let mut v = _mm256_loadu_ps(p);
        i = 8;
        while i + 8 <= n {
            v = _mm256_max_ps(v, _mm256_loadu_ps(p.add(i)));
            i += 8;
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        m = _mm_cvtss_f32(h);
    }
    for &y in &x[i..] {
        m = m.max(y);
    }
    m
}

/// `x[i] = exp(x[i] - m)` for every element; returns their sum.
///
/// # Safety
/// Requires AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mv = _mm256_set1_ps(m);
    let mut s = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
        _mm256_storeu_ps(p.add(i), e);
        s = _mm256_add_ps(s, e);
        i += 8;
    }
    let mut tail = 0f32;
    for y in &mut x[i..] {
        *y = super::math::fast_exp(*y - m);
        tail += *y;
    }
    hsum(s) + tail
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpu::math::fast_exp;
    use crate::rng::Rng;

    fn have_avx2() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }

    /// Rows stored in format `fmt` (as the cache holds them) and their exact values as f64.
    fn rows(fmt: u8, n: usize, d: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f64>) {
        let mut bytes = Vec::new();
        let mut exact = Vec::new();
        for _ in 0..n * d {
            let x = rng.normal() as f32;
            let (b, v): (Vec<u8>, f64) = match fmt {
                FMT_F16 => {
                    let h = half::f16::from_f32(x);
                    (h.to_bits().to_le_bytes().to_vec(), h.to_f64())
                }
                FMT_BF16 => {
                    let h = half::bf16::from_f32(x);
                    (h.to_bits().to_le_bytes().to_vec(), h.to_f64())
                }
                _ => (x.to_le_bytes().to_vec(), x as f64),
            };
            bytes.extend(b);
            exact.push(v);
        }
        (bytes, exact)
    }

    /// Checks a scores kernel and an accumulate kernel (any ISA; arguments `(format, out, q or p, row
    /// pointers, rows, d)`) against f64 on fresh random rows: every format, every head size in `dims`,
    /// 1..=9 query rows (every row block and remainder), chunks of 1 to CHUNK keys; nothing written past
    /// the chunk's keys.
    pub(crate) fn check_kernels(scores_k: impl Fn(u8, &mut [f32], &[f32], &[*const u8], usize, usize), acc_k: impl Fn(u8, &mut [f32], &[f32], &[*const u8], usize, usize), dims: &[usize]) {
        let mut rng = Rng::new(Rng::fresh_seed());
        for fmt in [FMT_F32, FMT_F16, FMT_BF16] {
            let esize = if fmt == FMT_F32 { 4 } else { 2 };
            for &d in dims {
                for nrows in 1..=9 {
                    for n in [1usize, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32] {
                        let q: Vec<f32> = (0..nrows * d).map(|_| rng.normal() as f32).collect();
                        let (kb, k) = rows(fmt, n, d, &mut rng);
                        let (vb, v) = rows(fmt, n, d, &mut rng);
                        // Rows in reverse order in memory, so a row's address is not its index.
                        let krows: Vec<*const u8> = (0..n).map(|j| kb[(n - 1 - j) * d * esize..].as_ptr()).collect();
                        let vrows: Vec<*const u8> = (0..n).map(|j| vb[(n - 1 - j) * d * esize..].as_ptr()).collect();
                        let mut sc = vec![f32::NAN; nrows * CHUNK];
                        scores_k(fmt, &mut sc, &q, &krows, nrows, d);
                        let p: Vec<f32> = (0..nrows * CHUNK).map(|_| rng.normal() as f32).collect();
                        let acc0: Vec<f32> = (0..nrows * d).map(|_| rng.normal() as f32).collect();
                        let mut acc = acc0.clone();
                        acc_k(fmt, &mut acc, &p, &vrows, nrows, d);
                        for r in 0..nrows {
                            for j in 0..n {
                                let want: f64 = (0..d).map(|c| q[r * d + c] as f64 * k[(n - 1 - j) * d + c]).sum();
                                let got = sc[r * CHUNK + j] as f64;
                                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "score fmt {fmt} d {d} rows {nrows} n {n} ({r},{j}): {got} vs {want}");
                            }
                            for j in n..CHUNK {
                                assert!(sc[r * CHUNK + j].is_nan(), "score past n written: fmt {fmt} rows {nrows} n {n}");
                            }
                            for c in 0..d {
                                let want = acc0[r * d + c] as f64 + (0..n).map(|j| p[r * CHUNK + j] as f64 * v[(n - 1 - j) * d + c]).sum::<f64>();
                                let got = acc[r * d + c] as f64;
                                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "acc fmt {fmt} d {d} rows {nrows} n {n} ({r},{c}): {got} vs {want}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Checks an `exp_sub_sum` (bit-identical to `fast_exp`, NaN kept, sum within f32 rounding) and a `max`.
    pub(crate) fn check_exp_max(exp_k: impl Fn(&mut [f32], f32) -> f32, max_k: impl Fn(&[f32]) -> f32) {
        let mut xs: Vec<f32> = (0..20000).map(|i| -100.0 + i as f32 * 0.0097).collect();
        xs.extend([f32::NEG_INFINITY, f32::NAN, -87.0, -86.99, 0.0, -0.0, 88.0, 1e-30, -1e-30]);
        let m = 0.25f32;
        let mut got = xs.clone();
        let sum = exp_k(&mut got, m);
        let mut total = 0f64;
        for (&x, &g) in xs.iter().zip(&got) {
            let want = fast_exp(x - m);
            assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "exp({x} - {m}): {g} vs {want}");
            total += want as f64;
        }
        assert!(sum.is_nan() && total.is_nan(), "a NaN input makes the sum NaN");
        // (sums of values above ~80 overflow f32, as they would in the scalar path)
        let finite: Vec<f32> = xs.iter().copied().filter(|x| !x.is_nan() && *x < 80.0).collect();
        let mut e = finite.clone();
        let s = exp_k(&mut e, m) as f64;
        let want: f64 = finite.iter().map(|&x| fast_exp(x - m) as f64).sum();
        assert!((s - want).abs() <= 1e-5 * want, "sum {s} vs {want}");
        assert_eq!(max_k(&xs[..20000]), xs[19999], "largest of the grid");
        for n in 0..40 {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 * 7.3) % 5.0 - 2.0).collect();
            assert_eq!(max_k(&v), v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)), "max of {v:?}");
        }
        // A NaN among finite values gives a NaN weight and sum.
        let mut v: Vec<f32> = (0..32).map(|i| i as f32 * 0.1).collect();
        v[20] = f32::NAN;
        assert!(exp_k(&mut v, 3.1).is_nan() && v[20].is_nan(), "NaN score gives a NaN weight and sum");
    }

    /// [`check_kernels`] on the `scores_rows` / `accumulate_rows` of the module at `$m` (every format).
    macro_rules! check_module_kernels {
        ($($m:ident)::+, $dims:expr) => {
            // SAFETY: the caller checked the module's CPU features.
            $crate::cpu::avx2::tests::check_kernels(
                |fmt, sc, q, k, rows, d| unsafe {
                    use $crate::cpu::avx2::{FMT_BF16, FMT_F16, FMT_F32};
                    match fmt {
                        FMT_F16 => $($m)::+::scores_rows::<FMT_F16>(sc, q, k, rows, d),
                        FMT_BF16 => $($m)::+::scores_rows::<FMT_BF16>(sc, q, k, rows, d),
                        _ => $($m)::+::scores_rows::<FMT_F32>(sc, q, k, rows, d),
                    }
                },
                |fmt, acc, p, v, rows, d| unsafe {
                    use $crate::cpu::avx2::{FMT_BF16, FMT_F16, FMT_F32};
                    match fmt {
                        FMT_F16 => $($m)::+::accumulate_rows::<FMT_F16>(acc, p, v, rows, d),
                        FMT_BF16 => $($m)::+::accumulate_rows::<FMT_BF16>(acc, p, v, rows, d),
                        _ => $($m)::+::accumulate_rows::<FMT_F32>(acc, p, v, rows, d),
                    }
                },
                $dims,
            )
        };
    }
    pub(crate) use check_module_kernels;

    #[test]
    fn scores_and_accumulate_match_f64_for_every_row_block_and_format() {
        if !have_avx2() {
            return;
        }
        check_module_kernels!(crate::cpu::avx2, &[64, 80, 128]);
    }

    #[test]
    fn vector_exp_equals_fast_exp_bit_for_bit_and_keeps_nan() {
        if !have_avx2() {
            return;
        }
        // SAFETY: as above.
        check_exp_max(|x, m| unsafe { exp_sub_sum(x, m) }, |x| unsafe { max(x) });
    }
}
