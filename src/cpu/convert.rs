//! Loading rows of fp32/fp16/bf16 into f32 scratch, and storing f32 results back.
//!
//! The hot loops are written once and compiled twice: a portable version and one for x86-64 with AVX2,
//! FMA and F16C (chosen at run time, see [`super::isa`]). fp16 uses the F16C conversion instruction when
//! it is there; bf16 is a 16-bit shift, which the compiler vectorises by itself.

use crate::tensor::DType;

/// Instruction-set flavour a kernel body is compiled for.
pub trait Isa: Copy {
    /// Converts `n` contiguous fp16 values to f32.
    ///
    /// # Safety
    /// `src` must hold `n` halfs; `dst.len() >= n`.
    unsafe fn f16_to_f32(src: *const u16, dst: &mut [f32], n: usize);
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

/// Loads `n` elements of `dtype` starting at `src` with element stride `stride` into `dst[..n]`.
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
            _ => unreachable!("load_row on integer dtype"),
        }
    } else {
        for (i, d) in dst.iter_mut().enumerate() {
            *d = load_one(src, dtype, i as isize * stride);
        }
    }
}

/// Loads one element (any float dtype) as f32.
///
/// # Safety
/// `src + idx` must be a valid element.
#[inline(always)]
pub unsafe fn load_one(src: *const u8, dtype: DType, idx: isize) -> f32 {
    match dtype {
        DType::F32 => (src as *const f32).offset(idx).read_unaligned(),
        DType::F16 => half::f16::from_bits((src as *const u16).offset(idx).read_unaligned()).to_f32(),
        DType::BF16 => f32::from_bits(((src as *const u16).offset(idx).read_unaligned() as u32) << 16),
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

/// Dot product written so the compiler keeps eight independent accumulators (one AVX register).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            acc[k] = x[k].mul_add(y[k], acc[k]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = x.mul_add(*y, tail);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `acc += w * x`, vectorised.
#[inline(always)]
pub fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a = w.mul_add(v, *a);
    }
}
