//! Explicit AVX2/FMA versions of the two inner loops (scores Q·Kᵀ and P·V). The compiler's
//! auto-vectoriser splits the register-blocked generic code into 2-wide pieces and spills, so these are
//! written with intrinsics: 4 query rows × 2 keys of 8-lane accumulators for the scores, 4 rows × 16
//! columns for the values, all in registers.
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

/// `scores[r * CHUNK + j] = q_r · k_j` for all rows and the `n` keys in `kbuf` (`d % 8 == 0`).
///
/// # Safety
/// Requires AVX2 and FMA; slices must hold `rows × d` queries, `n × d` keys, `rows × CHUNK` scores.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores(scores: &mut [f32], q: &[f32], kbuf: &[f32], rows: usize, n: usize, d: usize) {
    assert!(q.len() >= rows * d && kbuf.len() >= n * d && scores.len() >= rows * CHUNK && d % 8 == 0);
    let qp = q.as_ptr();
    let kp = kbuf.as_ptr();
    let mut r0 = 0;
    while r0 + 4 <= rows {
        let (q0, q1, q2, q3) = (qp.add(r0 * d), qp.add((r0 + 1) * d), qp.add((r0 + 2) * d), qp.add((r0 + 3) * d));
        let mut j = 0;
        while j < n {
            let two = j + 1 < n;
            let ka = kp.add(j * d);
            let kb = if two { kp.add((j + 1) * d) } else { ka };
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < d {
                let va = _mm256_loadu_ps(ka.add(c));
                let vb = _mm256_loadu_ps(kb.add(c));
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
            for a in 0..4 {
                *scores.get_unchecked_mut((r0 + a) * CHUNK + j) = hsum(acc[2 * a]);
                if two {
                    *scores.get_unchecked_mut((r0 + a) * CHUNK + j + 1) = hsum(acc[2 * a + 1]);
                }
            }
            j += 2;
        }
        r0 += 4;
    }
    while r0 < rows {
        let qr = qp.add(r0 * d);
        for j in 0..n {
            let k = kp.add(j * d);
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut c = 0;
            while c + 16 <= d {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c)), _mm256_loadu_ps(k.add(c)), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c + 8)), _mm256_loadu_ps(k.add(c + 8)), a1);
                c += 16;
            }
            if c < d {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c)), _mm256_loadu_ps(k.add(c)), a0);
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
#[target_feature(enable = "avx2,fma")]
pub unsafe fn accumulate(acc: &mut [f32], p: &[f32], vbuf: &[f32], rows: usize, n: usize, d: usize) {
    assert!(acc.len() >= rows * d && p.len() >= rows * CHUNK && vbuf.len() >= n * d && d % 16 == 0);
    let ap = acc.as_mut_ptr();
    let pp = p.as_ptr();
    let vp = vbuf.as_ptr();
    let mut r0 = 0;
    while r0 + 4 <= rows {
        let mut c = 0;
        while c < d {
            let mut a = [_mm256_setzero_ps(); 8];
            for r in 0..4 {
                a[2 * r] = _mm256_loadu_ps(ap.add((r0 + r) * d + c));
                a[2 * r + 1] = _mm256_loadu_ps(ap.add((r0 + r) * d + c + 8));
            }
            for j in 0..n {
                let v0 = _mm256_loadu_ps(vp.add(j * d + c));
                let v1 = _mm256_loadu_ps(vp.add(j * d + c + 8));
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
            for j in 0..n {
                let w = _mm256_broadcast_ss(&*pp.add(r0 * CHUNK + j));
                a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp.add(j * d + c)), a0);
                a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp.add(j * d + c + 8)), a1);
            }
            _mm256_storeu_ps(ap.add(r0 * d + c), a0);
            _mm256_storeu_ps(ap.add(r0 * d + c + 8), a1);
            c += 16;
        }
        r0 += 1;
    }
}
