//! AVX-512 versions of the attention inner loops (scores Q·Kᵀ, P·V, max, exp-and-sum), for CPUs that
//! have AVX-512F. Same structure as [`super::avx2`] with 16 lanes and the 32 vector registers: 4 query
//! rows × 4 keys of accumulators for the scores, 4 rows × 64 columns for the values. On the 2-vCPU
//! development VM (a Xeon with AVX-512) vLLM's CPU attention, which uses AVX-512 there, was 1.1–1.4× faster
//! than the AVX2 loops at one thread (docs/perf.md, issue 16); these close that gap.
//!
//! Only the attention kernels use this level. The sparse policies' decision arithmetic (page bounds,
//! weights that choose tokens) stays on the AVX2 path, so a policy decides the same with either level.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::chunk::CHUNK;
use super::avx2::{FMT_BF16, FMT_F16};

/// Sixteen consecutive elements of a row of format `$fmt` at element index `$i`, as f32 lanes.
macro_rules! load16 {
    ($fmt:expr, $p:expr, $i:expr) => {
        match $fmt {
            FMT_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(($p as *const u16).add($i) as *const __m256i)),
            FMT_BF16 => _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(($p as *const u16).add($i) as *const __m256i)), 16)),
            _ => _mm512_loadu_ps(($p as *const f32).add($i)),
        }
    };
}

/// Sixteen f32 lanes for the prefill micro-kernels ([`super::prefill`]); only valid inside code compiled
/// with AVX-512F enabled (the `#[inline(always)]` bodies are inlined into such functions).
#[derive(Clone, Copy)]
pub(crate) struct Zmm;

impl super::simd::Simd for Zmm {
    const L: usize = 16;
    type V = __m512;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> __m512 {
        _mm512_set1_ps(*p)
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        _mm512_sub_ps(a, b)
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        _mm512_max_ps(a, b)
    }
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        exp16(x)
    }
    #[inline(always)]
    unsafe fn exp_weight(x: __m512, keep: __m512) -> __m512 {
        use super::math::{EXP_C, LN2_HI, LN2_LO, LOG2E};
        let xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc));
        let mut y = _mm512_set1_ps(EXP_C[0]);
        for &c in &EXP_C[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
        }
        let one = _mm512_set1_ps(1.0);
        y = _mm512_fmadd_ps(_mm512_fmadd_ps(y, r, one), r, one);
        let kept = _mm512_test_epi32_mask(_mm512_castps_si512(keep), _mm512_castps_si512(keep));
        let live = _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(kept, x, _mm512_set1_ps(-87.0));
        _mm512_maskz_scalef_ps(live, y, n)
    }
}

/// Whether this CPU runs these kernels.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// The sum of the two 256-bit halves of `v`.
#[inline(always)]
unsafe fn fold256(v: __m512) -> __m256 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    _mm256_add_ps(lo, hi)
}

/// Horizontal sums of eight accumulators: lane `i` of the result is the sum of `a[i]`'s lanes.
#[inline(always)]
unsafe fn hsum8(a: &[__m512]) -> __m256 {
    let h = |i: usize| fold256(a[i]);
    let s01 = _mm256_hadd_ps(h(0), h(1));
    let s23 = _mm256_hadd_ps(h(2), h(3));
    let s45 = _mm256_hadd_ps(h(4), h(5));
    let s67 = _mm256_hadd_ps(h(6), h(7));
    let lo = _mm256_hadd_ps(s01, s23);
    let hi = _mm256_hadd_ps(s45, s67);
    _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(lo, hi), _mm256_permute2f128_ps::<0x31>(lo, hi))
}

/// `scores[r * CHUNK + j] = q_r · k_j` with key `j` read from `krows[j]` (format `FMT`, converted in
/// registers). Rows in blocks of 4 (the rest in one block of 3, 2 or 1), each against 4, 4, 8 or 8 keys at
/// once (16, 12, 16, 8 accumulators of 16 lanes).
///
/// # Safety
/// Requires AVX-512F, AVX2, FMA, F16C; every `krows[j]` must address `d` elements; `q` holds `rows × d`,
/// `scores` `rows × CHUNK`; `d % 16 == 0`, `krows.len() <= CHUNK`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub unsafe fn scores_rows<const FMT: u8>(scores: &mut [f32], q: &[f32], krows: &[*const u8], rows: usize, d: usize) {
    let n = krows.len();
    assert!(q.len() >= rows * d && scores.len() >= rows * CHUNK && d % 16 == 0 && n <= CHUNK);
    let (sp, qp) = (scores.as_mut_ptr(), q.as_ptr());
    let mut r0 = 0;
    while r0 + 4 <= rows {
        score_rows_block::<FMT, 4, 4>(sp, qp, krows, r0, d);
        r0 += 4;
    }
    match rows - r0 {
        3 => score_rows_block::<FMT, 3, 4>(sp, qp, krows, r0, d),
        2 => score_rows_block::<FMT, 2, 8>(sp, qp, krows, r0, d),
        1 => score_rows_block::<FMT, 1, 8>(sp, qp, krows, r0, d),
        _ => {}
    }
}

/// Scores of rows `r0..r0 + R` against all keys, `KB` keys at a time (`R * KB <= 16`).
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
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut c = 0;
        while c < d {
            let mut kv = [_mm512_setzero_ps(); KB];
            for b in 0..KB {
                kv[b] = load16!(FMT, kp[b], c);
            }
            for r in 0..R {
                let x = _mm512_loadu_ps(qp.add((r0 + r) * d + c));
                for b in 0..KB {
                    acc[r * KB + b] = _mm512_fmadd_ps(x, kv[b], acc[r * KB + b]);
                }
            }
            c += 16;
        }
        // Accumulator i = r * KB + b; sums of eight at a time.
        let mut t = [0f32; 16];
        _mm256_storeu_ps(t.as_mut_ptr(), hsum8(&acc[0..8]));
        if R * KB > 8 {
            _mm256_storeu_ps(t.as_mut_ptr().add(8), hsum8(&acc[8..16]));
        }
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

/// `acc[r] += Σ_j p[r * CHUNK + j] · v_j` with value `j` read from `vrows[j]` (format `FMT`): rows in
/// blocks of 4 (the rest in one block of 3, 2 or 1) × up to 64 columns of accumulators held in registers
/// across the chunk, so every V load feeds every row of the block.
///
/// # Safety
/// Requires AVX-512F, AVX2, FMA, F16C; every `vrows[j]` must address `d` elements; `acc` holds `rows × d`,
/// `p` `rows × CHUNK`; `d % 16 == 0`, `vrows.len() <= CHUNK`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    while c + 64 <= d {
        accumulate_cols::<FMT, R, 4>(ap, pp, vrows, r0, d, c);
        c += 64;
    }
    match (d - c) / 16 {
        3 => accumulate_cols::<FMT, R, 3>(ap, pp, vrows, r0, d, c),
        2 => accumulate_cols::<FMT, R, 2>(ap, pp, vrows, r0, d, c),
        1 => accumulate_cols::<FMT, R, 1>(ap, pp, vrows, r0, d, c),
        _ => {}
    }
}

/// Columns `c..c + 16 * W` of rows `r0..r0 + R`, every key of the chunk.
#[inline(always)]
unsafe fn accumulate_cols<const FMT: u8, const R: usize, const W: usize>(ap: *mut f32, pp: *const f32, vrows: &[*const u8], r0: usize, d: usize, c: usize) {
    let mut a = [[_mm512_setzero_ps(); W]; R];
    for r in 0..R {
        for w in 0..W {
            a[r][w] = _mm512_loadu_ps(ap.add((r0 + r) * d + c + 16 * w));
        }
    }
    for (j, &v) in vrows.iter().enumerate() {
        let mut vv = [_mm512_setzero_ps(); W];
        for w in 0..W {
            vv[w] = load16!(FMT, v, c + 16 * w);
        }
        for r in 0..R {
            let x = _mm512_set1_ps(*pp.add((r0 + r) * CHUNK + j));
            for w in 0..W {
                a[r][w] = _mm512_fmadd_ps(x, vv[w], a[r][w]);
            }
        }
    }
    for r in 0..R {
        for w in 0..W {
            _mm512_storeu_ps(ap.add((r0 + r) * d + c + 16 * w), a[r][w]);
        }
    }
}

/// [`super::math::fast_exp`] on sixteen lanes, the same operations in the same order as it and as the
/// AVX2 `exp8` (bit-identical weights on every level). NaN stays NaN (`max`/`min` return their second
/// operand when either is NaN, as the scalar clamps are written).
#[inline(always)]
unsafe fn exp16(x: __m512) -> __m512 {
    use super::math::{EXP_C, LN2_HI, LN2_LO, LOG2E, ROUND_MAGIC};
    let xc = _mm512_min_ps(_mm512_set1_ps(88.0), _mm512_max_ps(_mm512_set1_ps(-87.0), x));
    let magic = _mm512_set1_ps(ROUND_MAGIC);
    let n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), magic), magic);
    let r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))), _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
    let mut y = _mm512_set1_ps(EXP_C[0]);
    for &c in &EXP_C[1..] {
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
    }
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127))));
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.0));
    _mm512_maskz_mov_ps(!under, _mm512_mul_ps(y, scale))
}

/// Largest element of `x` (NaN handling as `f32::max`: a NaN is skipped unless all are NaN; the NaN
/// itself still reaches the output through [`exp_sub_sum`]).
///
/// # Safety
/// Requires AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub unsafe fn max(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    let mut i = 0;
    let mut m = f32::NEG_INFINITY;
    if n >= 16 {
        let mut v = _mm512_loadu_ps(p);
        i = 16;
        while i + 16 <= n {
            v = _mm512_max_ps(v, _mm512_loadu_ps(p.add(i)));
            i += 16;
        }
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let h8 = _mm256_max_ps(lo, hi);
        let h = _mm_max_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps::<1>(h8));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_shuffle_ps::<1>(h, h));
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
/// Requires AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub unsafe fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mv = _mm512_set1_ps(m);
    let mut s = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), mv));
        _mm512_storeu_ps(p.add(i), e);
        s = _mm512_add_ps(s, e);
        i += 16;
    }
    let mut tail = 0f32;
    for y in &mut x[i..] {
        *y = super::math::fast_exp(*y - m);
        tail += *y;
    }
    _mm512_reduce_add_ps(s) + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::avx2::tests::{check_exp_max, check_module_kernels};

    #[test]
    fn scores_and_accumulate_match_f64_for_every_row_block_and_format() {
        if !available() {
            eprintln!("no AVX-512 on this CPU: the AVX-512 kernels are not tested here");
            return;
        }
        check_module_kernels!(crate::cpu::avx512, &[64, 80, 96, 112, 128, 192, 256]);
    }

    #[test]
    fn vector_exp_equals_fast_exp_bit_for_bit_and_keeps_nan() {
        if !available() {
            eprintln!("no AVX-512 on this CPU: the AVX-512 kernels are not tested here");
            return;
        }
        // SAFETY: the features were detected.
        check_exp_max(|x, m| unsafe { exp_sub_sum(x, m) }, |x| unsafe { max(x) });
    }
}
