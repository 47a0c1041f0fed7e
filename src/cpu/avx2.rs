//! Explicit AVX2/FMA versions of the two inner loops (scores Q·Kᵀ and P·V). The compiler's
//! auto-vectoriser splits the register-blocked generic code into 2-wide pieces and spills, so these are
//! written with intrinsics: 4 query rows × 2 keys of 8-lane accumulators for the scores, 4 rows × 16
//! columns for the values, all in registers. They read K and V rows straight from the cache (fp16 through
//! F16C, bf16 by a shift) so no f32 staging copy is written and read back.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::attention::CHUNK;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
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

/// `scores[r * CHUNK + j] = q_r · k_j` with key `j` read from `krows[j]` (a contiguous row of format
/// `FMT`, converted in registers), 4 query rows × 2 keys at a time.
///
/// # Safety
/// Requires AVX2, FMA and F16C; every `krows[j]` must address `d` elements; `q` holds `rows × d`,
/// `scores` `rows × CHUNK`; `d % 8 == 0`, `krows.len() <= CHUNK`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores_rows<const FMT: u8>(scores: &mut [f32], q: &[f32], krows: &[*const u8], rows: usize, d: usize) {
    let n = krows.len();
    assert!(q.len() >= rows * d && scores.len() >= rows * CHUNK && d % 8 == 0 && n <= CHUNK);
    let qp = q.as_ptr();
    let mut r0 = 0;
    while r0 + 4 <= rows {
        let (q0, q1, q2, q3) = (qp.add(r0 * d), qp.add((r0 + 1) * d), qp.add((r0 + 2) * d), qp.add((r0 + 3) * d));
        let mut j = 0;
        while j < n {
            let two = j + 1 < n;
            let ka = krows[j];
            let kb = if two { krows[j + 1] } else { ka };
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < d {
                let va = load8!(FMT, ka, c);
                let vb = load8!(FMT, kb, c);
                let x0 = _mm256_loadu_ps(q0.add(c));
                acc[0] = _mm256_fmadd_ps(x0, va, acc[0]);
                acc[1] = _mm256_fmadd_ps(x0, vb, acc[1]);
                let x1 = _mm256_loadu_ps(q1.add(c));
                acc[2] = _mm256_fmadd_ps(x1, va, acc[2]);
                acc[3] = _mm256_fmadd_ps(x1, vb, acc[3]);
                let x2 = _mm256_loadu_ps(q2.add(c));
                acc[4] = _mm256_fmadd_ps(x2, va, acc[4]);
                acc[5] = _mm256_fmadd_ps(x2, vb, acc[5]);
                let x3 = _mm256_loadu_ps(q3.add(c));
                acc[6] = _mm256_fmadd_ps(x3, va, acc[6]);
                acc[7] = _mm256_fmadd_ps(x3, vb, acc[7]);
                c += 8;
            }
            // Horizontal sums of all eight accumulators at once: [r0a r0b r1a r1b] and [r2a r2b r3a r3b].
            let s01 = _mm256_hadd_ps(acc[0], acc[1]);
            let s23 = _mm256_hadd_ps(acc[2], acc[3]);
            let s45 = _mm256_hadd_ps(acc[4], acc[5]);
            let s67 = _mm256_hadd_ps(acc[6], acc[7]);
            let lo = _mm256_hadd_ps(s01, s23);
            let hi = _mm256_hadd_ps(s45, s67);
            let mut t = [0f32; 8];
            _mm_storeu_ps(t.as_mut_ptr(), _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1)));
            _mm_storeu_ps(t.as_mut_ptr().add(4), _mm_add_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps(hi, 1)));
            for a in 0..4 {
                *scores.get_unchecked_mut((r0 + a) * CHUNK + j) = t[2 * a];
                if two {
                    *scores.get_unchecked_mut((r0 + a) * CHUNK + j + 1) = t[2 * a + 1];
                }
            }
            j += 2;
        }
        r0 += 4;
    }
    while r0 < rows {
        let qr = qp.add(r0 * d);
        for (j, &k) in krows.iter().enumerate() {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut c = 0;
            while c + 16 <= d {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c)), load8!(FMT, k, c), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c + 8)), load8!(FMT, k, c + 8), a1);
                c += 16;
            }
            if c < d {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c)), load8!(FMT, k, c), a0);
            }
            *scores.get_unchecked_mut(r0 * CHUNK + j) = hsum(_mm256_add_ps(a0, a1));
        }
        r0 += 1;
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

/// `acc[r] += Σ_j p[r * CHUNK + j] · v_j` with value `j` read from `vrows[j]` (format `FMT`), 4 rows × 16
/// columns of accumulators held in registers across the chunk.
///
/// # Safety
/// Requires AVX2, FMA and F16C; every `vrows[j]` must address `d` elements; `acc` holds `rows × d`, `p`
/// `rows × CHUNK`; `d % 16 == 0`, `vrows.len() <= CHUNK`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn accumulate_rows<const FMT: u8>(acc: &mut [f32], p: &[f32], vrows: &[*const u8], rows: usize, d: usize) {
    let n = vrows.len();
    assert!(acc.len() >= rows * d && p.len() >= rows * CHUNK && d % 16 == 0 && n <= CHUNK);
    let ap = acc.as_mut_ptr();
    let pp = p.as_ptr();
    let mut r0 = 0;
    while r0 + 4 <= rows {
        let mut c = 0;
        while c < d {
            let mut a = [_mm256_setzero_ps(); 8];
            for r in 0..4 {
                a[2 * r] = _mm256_loadu_ps(ap.add((r0 + r) * d + c));
                a[2 * r + 1] = _mm256_loadu_ps(ap.add((r0 + r) * d + c + 8));
            }
            for (j, &v) in vrows.iter().enumerate() {
                let v0 = load8!(FMT, v, c);
                let v1 = load8!(FMT, v, c + 8);
                for r in 0..4 {
                    let w = _mm256_broadcast_ss(&*pp.add((r0 + r) * CHUNK + j));
                    a[2 * r] = _mm256_fmadd_ps(w, v0, a[2 * r]);
                    a[2 * r + 1] = _mm256_fmadd_ps(w, v1, a[2 * r + 1]);
                }
            }
            for r in 0..4 {
                _mm256_storeu_ps(ap.add((r0 + r) * d + c), a[2 * r]);
                _mm256_storeu_ps(ap.add((r0 + r) * d + c + 8), a[2 * r + 1]);
            }
            c += 16;
        }
        r0 += 4;
    }
    while r0 < rows {
        let mut c = 0;
        while c < d {
            let mut a0 = _mm256_loadu_ps(ap.add(r0 * d + c));
            let mut a1 = _mm256_loadu_ps(ap.add(r0 * d + c + 8));
            for (j, &v) in vrows.iter().enumerate() {
                let w = _mm256_broadcast_ss(&*pp.add(r0 * CHUNK + j));
                a0 = _mm256_fmadd_ps(w, load8!(FMT, v, c), a0);
                a1 = _mm256_fmadd_ps(w, load8!(FMT, v, c + 8), a1);
            }
            _mm256_storeu_ps(ap.add(r0 * d + c), a0);
            _mm256_storeu_ps(ap.add(r0 * d + c + 8), a1);
            c += 16;
        }
        r0 += 1;
    }
}
