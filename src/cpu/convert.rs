//! Loading rows of fp32/fp16/bf16 into f32 scratch, and storing f32 results back.
//!
//! The hot loops are written once and compiled twice: a portable version and one for x86-64 with AVX2,
//! FMA and F16C (chosen at run time, see [`super::isa`]). fp16 uses the F16C conversion instruction when
//! it is there; bf16 is a 16-bit shift, which the compiler vectorises by itself.

use super::chunk::CHUNK;
use crate::layout::KvCache;
use crate::tensor::DType;

/// Instruction-set flavour a kernel body is compiled for.
pub trait Isa: Copy {
    /// Converts `n` contiguous fp16 values to f32.
    ///
    /// # Safety
    /// `src` must hold `n` halfs; `dst.len() >= n`.
    unsafe fn f16_to_f32(src: *const u16, dst: &mut [f32], n: usize);
    /// `a * b + c`: a fused instruction where the ISA has one (a libm call would be far slower).
    fn fma(a: f32, b: f32, c: f32) -> f32;
    /// Scores `q · kᵀ` of a chunk (see `scores_generic`).
    #[inline(always)]
    fn scores(scores: &mut [f32], q: &[f32], kbuf: &[f32], rows: usize, n: usize, d: usize) {
        scores_generic::<Self>(scores, q, kbuf, rows, n, d)
    }
    /// Value accumulation `acc += p · v` of a chunk (see `accumulate_generic`).
    #[inline(always)]
    fn accumulate(acc: &mut [f32], p: &[f32], vbuf: &[f32], rows: usize, n: usize, d: usize) {
        accumulate_generic::<Self>(acc, p, vbuf, rows, n, d)
    }
    /// Largest element (`f32::max` semantics).
    #[inline(always)]
    fn max(x: &[f32]) -> f32 {
        x.iter().fold(f32::NEG_INFINITY, |m, &y| m.max(y))
    }
    /// `x[i] = exp(x[i] - m)` (see [`super::math::fast_exp`]); returns the sum of the new values.
    #[inline(always)]
    fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
        for y in x.iter_mut() {
            *y = super::math::fast_exp(*y - m);
        }
        sum8(x)
    }
    /// Scores of the keys at `krows` (cache rows of `dtype`, element stride `stride`; `scale` dequantizes
    /// an FP8 cache and is ignored otherwise): by default converted into `kbuf` first, then [`Isa::scores`].
    ///
    /// # Safety
    /// Every pointer must address `d` elements at that stride.
    #[inline(always)]
    unsafe fn scores_rows(scores: &mut [f32], q: &[f32], krows: &[*const u8], dtype: DType, scale: f32, stride: isize, kbuf: &mut Vec<f32>, rows: usize, d: usize) {
        stage_rows::<Self>(krows, dtype, scale, stride, d, kbuf);
        Self::scores(scores, q, kbuf, rows, krows.len(), d)
    }
    /// Value accumulation from cache rows (see [`Isa::scores_rows`]).
    ///
    /// # Safety
    /// Every pointer must address `d` elements at that stride.
    #[inline(always)]
    unsafe fn accumulate_rows(acc: &mut [f32], p: &[f32], vrows: &[*const u8], dtype: DType, scale: f32, stride: isize, vbuf: &mut Vec<f32>, rows: usize, d: usize) {
        stage_rows::<Self>(vrows, dtype, scale, stride, d, vbuf);
        Self::accumulate(acc, p, vbuf, rows, vrows.len(), d)
    }
}

/// Portable code: whatever the baseline target allows.
#[derive(Clone, Copy)]
pub struct Portable;

impl Isa for Portable {
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u16, dst: &mut [f32], n: usize) {
        for (i, d) in dst[..n].iter_mut().enumerate() {
            *d = half::f16::from_bits(src.add(i).read_unaligned()).to_f32();
        }
    }
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// x86-64 with AVX2 + FMA + F16C.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Isa for Avx2 {
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u16, dst: &mut [f32], n: usize) {
        f16_to_f32_f16c(src, dst, n)
    }
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn scores(scores: &mut [f32], q: &[f32], kbuf: &[f32], rows: usize, n: usize, d: usize) {
        // SAFETY: this ISA is only selected when AVX2 and FMA were detected.
        unsafe { super::avx2::scores(scores, q, kbuf, rows, n, d) }
    }
    #[inline(always)]
    fn accumulate(acc: &mut [f32], p: &[f32], vbuf: &[f32], rows: usize, n: usize, d: usize) {
        // SAFETY: as above.
        unsafe { super::avx2::accumulate(acc, p, vbuf, rows, n, d) }
    }
    #[inline(always)]
    fn max(x: &[f32]) -> f32 {
        // SAFETY: as above.
        unsafe { super::avx2::max(x) }
    }
    #[inline(always)]
    fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
        // SAFETY: as above.
        unsafe { super::avx2::exp_sub_sum(x, m) }
    }
    #[inline(always)]
    unsafe fn scores_rows(scores: &mut [f32], q: &[f32], krows: &[*const u8], dtype: DType, scale: f32, stride: isize, kbuf: &mut Vec<f32>, rows: usize, d: usize) {
        use super::avx2 as k;
        match (dtype, stride) {
            (DType::F16, 1) => k::scores_rows::<{k::FMT_F16}>(scores, q, krows, rows, d),
            (DType::BF16, 1) => k::scores_rows::<{k::FMT_BF16}>(scores, q, krows, rows, d),
            (DType::F32, 1) => k::scores_rows::<{k::FMT_F32}>(scores, q, krows, rows, d),
            _ => {
                stage_rows::<Self>(krows, dtype, scale, stride, d, kbuf);
                Self::scores(scores, q, kbuf, rows, krows.len(), d)
            }
        }
    }
    #[inline(always)]
    unsafe fn accumulate_rows(acc: &mut [f32], p: &[f32], vrows: &[*const u8], dtype: DType, scale: f32, stride: isize, vbuf: &mut Vec<f32>, rows: usize, d: usize) {
        use super::avx2 as k;
        match (dtype, stride) {
            (DType::F16, 1) => k::accumulate_rows::<{k::FMT_F16}>(acc, p, vrows, rows, d),
            (DType::BF16, 1) => k::accumulate_rows::<{k::FMT_BF16}>(acc, p, vrows, rows, d),
            (DType::F32, 1) => k::accumulate_rows::<{k::FMT_F32}>(acc, p, vrows, rows, d),
            _ => {
                stage_rows::<Self>(vrows, dtype, scale, stride, d, vbuf);
                Self::accumulate(acc, p, vbuf, rows, vrows.len(), d)
            }
        }
    }
}

/// x86-64 with AVX-512F (and AVX2, FMA, F16C): the cache-row kernels, max and exp of [`super::avx512`]
/// where the head size is a multiple of 16 (every supported one); conversions and the staged (strided)
/// path as [`Avx2`].
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Isa for Avx512 {
    #[inline(always)]
    unsafe fn f16_to_f32(src: *const u16, dst: &mut [f32], n: usize) {
        Avx2::f16_to_f32(src, dst, n)
    }
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        Avx2::fma(a, b, c)
    }
    #[inline(always)]
    fn scores(scores: &mut [f32], q: &[f32], kbuf: &[f32], rows: usize, n: usize, d: usize) {
        Avx2::scores(scores, q, kbuf, rows, n, d)
    }
    #[inline(always)]
    fn accumulate(acc: &mut [f32], p: &[f32], vbuf: &[f32], rows: usize, n: usize, d: usize) {
        Avx2::accumulate(acc, p, vbuf, rows, n, d)
    }
    #[inline(always)]
    fn max(x: &[f32]) -> f32 {
        // SAFETY: this ISA is only selected when AVX-512F, AVX2, FMA and F16C were detected.
        unsafe { super::avx512::max(x) }
    }
    #[inline(always)]
    fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
        // SAFETY: as above.
        unsafe { super::avx512::exp_sub_sum(x, m) }
    }
    #[inline(always)]
    unsafe fn scores_rows(scores: &mut [f32], q: &[f32], krows: &[*const u8], dtype: DType, scale: f32, stride: isize, kbuf: &mut Vec<f32>, rows: usize, d: usize) {
        use super::avx2::{FMT_BF16, FMT_F16, FMT_F32};
        use super::avx512 as k;
        match (dtype, stride, d % 16) {
            (DType::F16, 1, 0) => k::scores_rows::<FMT_F16>(scores, q, krows, rows, d),
            (DType::BF16, 1, 0) => k::scores_rows::<FMT_BF16>(scores, q, krows, rows, d),
            (DType::F32, 1, 0) => k::scores_rows::<FMT_F32>(scores, q, krows, rows, d),
            _ => Avx2::scores_rows(scores, q, krows, dtype, scale, stride, kbuf, rows, d),
        }
    }
    #[inline(always)]
    unsafe fn accumulate_rows(acc: &mut [f32], p: &[f32], vrows: &[*const u8], dtype: DType, scale: f32, stride: isize, vbuf: &mut Vec<f32>, rows: usize, d: usize) {
        use super::avx2::{FMT_BF16, FMT_F16, FMT_F32};
        use super::avx512 as k;
        match (dtype, stride, d % 16) {
            (DType::F16, 1, 0) => k::accumulate_rows::<FMT_F16>(acc, p, vrows, rows, d),
            (DType::BF16, 1, 0) => k::accumulate_rows::<FMT_BF16>(acc, p, vrows, rows, d),
            (DType::F32, 1, 0) => k::accumulate_rows::<FMT_F32>(acc, p, vrows, rows, d),
            _ => Avx2::accumulate_rows(acc, p, vrows, dtype, scale, stride, vbuf, rows, d),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_to_f32_f16c(src: *const u16, dst: &mut [f32], n: usize) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.add(i) as *const __m128i);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    while i < n {
        dst[i] = half::f16::from_bits(src.add(i).read_unaligned()).to_f32();
        i += 1;
    }
}

/// Converts the rows at `rows` (each `d` elements of `dtype` at element stride `stride`, dequantized by
/// `scale` when FP8) into `buf`, one after the other, growing `buf` on first use (only the paths that
/// cannot read the cache in place use it).
///
/// # Safety
/// Every pointer must address `d` elements at that stride.
#[inline(always)]
unsafe fn stage_rows<I: Isa>(rows: &[*const u8], dtype: DType, scale: f32, stride: isize, d: usize, buf: &mut Vec<f32>) {
    if buf.len() < rows.len() * d {
        buf.resize(CHUNK * d, 0.0);
    }
    for (j, &p) in rows.iter().enumerate() {
        load_cache_row::<I>(p, dtype, scale, stride, d, &mut buf[j * d..(j + 1) * d]);
    }
}

/// Loads a cache row like [`load_row`], dequantized when the cache is FP8: `decode(byte) * scale` in f32
/// (src/fp8.rs), so every reader of the cache (attention, policy metadata, scoring) sees the same values.
///
/// # Safety
/// As [`load_row`].
#[inline(always)]
pub unsafe fn load_cache_row<I: Isa>(src: *const u8, dtype: DType, scale: f32, stride: isize, n: usize, dst: &mut [f32]) {
    load_row::<I>(src, dtype, stride, n, dst);
    if dtype.is_fp8() {
        for x in dst[..n].iter_mut() {
            *x *= scale;
        }
    }
}

/// The K row of (block, offset-in-block, kv head) as f32, dequantized (`head_dim` values into `dst`).
///
/// # Safety
/// The block must lie in the cache (validated), `dst.len() >= head_dim`.
#[inline(always)]
pub unsafe fn load_k<I: Isa>(cache: &KvCache, block: usize, off: usize, head: usize, dst: &mut [f32]) {
    load_cache_row::<I>(cache.k_row(block, off, head), cache.dtype, cache.k_scale, cache.k_dim_stride(), cache.head_dim, dst)
}

/// Like [`load_k`] for the V row.
///
/// # Safety
/// As [`load_k`].
#[inline(always)]
pub unsafe fn load_v<I: Isa>(cache: &KvCache, block: usize, off: usize, head: usize, dst: &mut [f32]) {
    load_cache_row::<I>(cache.v_row(block, off, head), cache.dtype, cache.v_scale, cache.v_dim_stride(), cache.head_dim, dst)
}

/// Loads `n` elements of `dtype` starting at `src` with element stride `stride` into `dst[..n]` (FP8
/// unscaled: cache rows go through [`load_cache_row`]).
///
/// # Safety
/// `src` must address `n` valid elements at that stride.
#[inline(always)]
pub unsafe fn load_row<I: Isa>(src: *const u8, dtype: DType, stride: isize, n: usize, dst: &mut [f32]) {
    let dst = &mut dst[..n];
    if stride == 1 {
        match dtype {
            DType::F32 => std::ptr::copy_nonoverlapping(src as *const f32, dst.as_mut_ptr(), n),
            DType::BF16 => {
                let s = src as *const u16;
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = f32::from_bits((s.add(i).read_unaligned() as u32) << 16);
                }
            }
            DType::F16 => I::f16_to_f32(src as *const u16, dst, n),
            DType::F8E4M3 | DType::F8E5M2 => {
                let t = crate::fp8::decode_table(dtype);
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = t[*src.add(i) as usize];
                }
            }
            _ => unreachable!("load_row on integer dtype"),
        }
    } else {
        for (i, d) in dst.iter_mut().enumerate() {
            *d = load_one(src, dtype, i as isize * stride);
        }
    }
}

/// Loads one element (any float dtype; FP8 unscaled) as f32.
///
/// # Safety
/// `src + idx` must be a valid element.
#[inline(always)]
pub unsafe fn load_one(src: *const u8, dtype: DType, idx: isize) -> f32 {
    match dtype {
        DType::F32 => (src as *const f32).offset(idx).read_unaligned(),
        DType::F16 => half::f16::from_bits((src as *const u16).offset(idx).read_unaligned()).to_f32(),
        DType::BF16 => f32::from_bits(((src as *const u16).offset(idx).read_unaligned() as u32) << 16),
        DType::F8E4M3 | DType::F8E5M2 => crate::fp8::decode(dtype, *src.offset(idx)),
        _ => unreachable!("load_one on integer dtype"),
    }
}

/// Stores `src` into a row of `dtype` with element stride `stride`, rounding to nearest even.
///
/// # Safety
/// `dst` must address `src.len()` writable elements at that stride.
#[inline]
pub unsafe fn store_row(src: &[f32], dst: *mut u8, dtype: DType, stride: isize) {
    for (i, &x) in src.iter().enumerate() {
        let o = i as isize * stride;
        match dtype {
            DType::F32 => (dst as *mut f32).offset(o).write_unaligned(x),
            DType::F16 => (dst as *mut u16).offset(o).write_unaligned(half::f16::from_f32(x).to_bits()),
            DType::BF16 => (dst as *mut u16).offset(o).write_unaligned(half::bf16::from_f32(x).to_bits()),
            _ => unreachable!("store_row on integer dtype"),
        }
    }
}

/// Copies one element of `dtype` (same dtype on both sides).
///
/// # Safety
/// Both pointers must be valid for one element.
#[inline(always)]
pub unsafe fn copy_elem(src: *const u8, dst: *mut u8, size: usize) {
    std::ptr::copy_nonoverlapping(src, dst, size)
}

// ---------------------------------------------------------------------------------------------------
// The chunk kernels every ISA flavour starts from (its `Isa::scores` / `accumulate` defaults; AVX2 and
// AVX-512 override them). They live beside the trait so that this file names no caller of its own.

/// Sum with eight independent lanes (vectorises; a plain fold is a serial dependency chain).
#[inline(always)]
pub(crate) fn sum8(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    let tail: f32 = it.remainder().iter().sum();
    acc.iter().sum::<f32>() + tail
}

/// `scores[r][j] = q_r · k_j` for `rows` query rows and `n` keys (`kbuf` is `n × d`, `d % 8 == 0`).
/// Register-blocked 4 rows × 2 keys: every K load feeds four rows, every Q load two keys.
#[inline(always)]
pub(crate) fn scores_generic<I: Isa>(scores: &mut [f32], q: &[f32], kbuf: &[f32], rows: usize, n: usize, d: usize) {
    let mut r0 = 0;
    while r0 + 4 <= rows {
        let mut j = 0;
        while j + 2 <= n {
            let s = dot_block::<I, 4, 2>(q, r0, kbuf, j, d);
            for a in 0..4 {
                for b in 0..2 {
                    scores[(r0 + a) * CHUNK + j + b] = s[a][b];
                }
            }
            j += 2;
        }
        if j < n {
            let s = dot_block::<I, 4, 1>(q, r0, kbuf, j, d);
            for a in 0..4 {
                scores[(r0 + a) * CHUNK + j] = s[a][0];
            }
        }
        r0 += 4;
    }
    while r0 < rows {
        let mut j = 0;
        while j + 4 <= n {
            let s = dot_block::<I, 1, 4>(q, r0, kbuf, j, d);
            for b in 0..4 {
                scores[r0 * CHUNK + j + b] = s[0][b];
            }
            j += 4;
        }
        while j < n {
            scores[r0 * CHUNK + j] = dot_block::<I, 1, 1>(q, r0, kbuf, j, d)[0][0];
            j += 1;
        }
        r0 += 1;
    }
}

#[inline(always)]
fn dot_block<I: Isa, const R: usize, const K: usize>(q: &[f32], r0: usize, kbuf: &[f32], j0: usize, d: usize) -> [[f32; K]; R] {
    let mut acc = [[[0f32; 8]; K]; R];
    for c in (0..d).step_by(8) {
        let mut kk = [[0f32; 8]; K];
        for b in 0..K {
            kk[b].copy_from_slice(&kbuf[(j0 + b) * d + c..(j0 + b) * d + c + 8]);
        }
        for a in 0..R {
            let qq = &q[(r0 + a) * d + c..(r0 + a) * d + c + 8];
            for b in 0..K {
                for l in 0..8 {
                    acc[a][b][l] = I::fma(qq[l], kk[b][l], acc[a][b][l]);
                }
            }
        }
    }
    let mut out = [[0f32; K]; R];
    for a in 0..R {
        for b in 0..K {
            let v = &acc[a][b];
            out[a][b] = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
        }
    }
    out
}

/// `acc[r] += Σ_j p[r][j] · v_j`, register-blocked 4 rows × 16 columns so the accumulators stay in
/// registers for the whole chunk instead of being loaded and stored once per key.
#[inline(always)]
pub(crate) fn accumulate_generic<I: Isa>(acc: &mut [f32], p: &[f32], vbuf: &[f32], rows: usize, n: usize, d: usize) {
    let mut r0 = 0;
    while r0 + 4 <= rows {
        accumulate_block::<I, 4>(acc, p, vbuf, r0, n, d);
        r0 += 4;
    }
    while r0 < rows {
        accumulate_block::<I, 1>(acc, p, vbuf, r0, n, d);
        r0 += 1;
    }
}

#[inline(always)]
fn accumulate_block<I: Isa, const R: usize>(acc: &mut [f32], p: &[f32], vbuf: &[f32], r0: usize, n: usize, d: usize) {
    for c in (0..d).step_by(16) {
        let mut a = [[0f32; 16]; R];
        for r in 0..R {
            a[r].copy_from_slice(&acc[(r0 + r) * d + c..(r0 + r) * d + c + 16]);
        }
        for j in 0..n {
            let v = &vbuf[j * d + c..j * d + c + 16];
            for r in 0..R {
                let w = p[(r0 + r) * CHUNK + j];
                for l in 0..16 {
                    a[r][l] = I::fma(w, v[l], a[r][l]);
                }
            }
        }
        for r in 0..R {
            acc[(r0 + r) * d + c..(r0 + r) * d + c + 16].copy_from_slice(&a[r]);
        }
    }
}
