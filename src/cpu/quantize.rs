//! INT4 asymmetric per-token quantization of key rows (Twilight's cheap copy of K for estimating
//! attention weights): each row of `head_dim` values gets its own `min` and `scale = (max - min) / 15`,
//! both stored as fp16 (min rounded down, scale rounded up, so every code stays in 0..=15), and codes
//! `round((x - min) * (1 / scale))` in 0..=15, two per byte (low nibble = even index). Codes plus the two
//! fp16 parameters are `head_dim / 2 + 4` bytes per row: 26.6% of an fp16 K row at head 128, 28.1% at 64.
//!
//! The estimate of `q·k` is then `min·Σq + scale·Σ q_i·code_i`, which needs no dequantized row.
//! The arithmetic is specified operation by operation (no fused multiply-add) because the CUDA cache
//! write (`kernels/meta.cu`) must produce the same bits.

/// Bytes of codes per row.
pub fn code_bytes(dim: usize) -> usize {
    dim.div_ceil(2)
}

/// Quantizes `x` into `codes` (`code_bytes(x.len())` bytes); returns `(min, scale)` as fp16 bits.
/// A row with a non-finite value, or whose range does not fit fp16, gets zero codes and parameters (its
/// estimate is 0; documented in docs/policies.md).
pub fn quantize_row(x: &[f32], codes: &mut [u8]) -> (u16, u16) {
    use crate::cpu::math::{f16_down, f16_up, max_num, min_num};
    let mut mn = f32::INFINITY;
    let mut mx = f32::NEG_INFINITY;
    for &v in x {
        mn = min_num(mn, v);
        mx = max_num(mx, v);
    }
    codes.fill(0);
    let mn16 = f16_down(mn);
    let mnf = half::f16::from_bits(mn16).to_f32();
    let scale16 = f16_up((mx - mnf) / 15.0);
    let scf = half::f16::from_bits(scale16).to_f32();
    if !mn.is_finite() || !mx.is_finite() || !mnf.is_finite() || !scf.is_finite() {
        return (0, 0);
    }
    let inv = if scf > 0.0 { 1.0 / scf } else { 0.0 };
    for (i, &v) in x.iter().enumerate() {
        let c = ((v - mnf) * inv).round().clamp(0.0, 15.0) as u8;
        codes[i / 2] |= c << ((i % 2) * 4);
    }
    (mn16, scale16)
}

/// The fp16 parameters as f32.
#[inline]
pub fn params_f32(p: (u16, u16)) -> (f32, f32) {
    (half::f16::from_bits(p.0).to_f32(), half::f16::from_bits(p.1).to_f32())
}

/// Estimated dot product of `q` with a quantized row; `q_sum = Σ q_i` is passed in (shared by all rows).
#[inline]
pub fn dot_q4(q: &[f32], q_sum: f32, codes: &[u8], mn: f32, scale: f32) -> f32 {
    let mut acc0 = 0f32;
    let mut acc1 = 0f32;
    for (pair, &byte) in q.chunks_exact(2).zip(codes) {
        acc0 += pair[0] * (byte & 15) as f32;
        acc1 += pair[1] * (byte >> 4) as f32;
    }
    if q.len() % 2 == 1 {
        acc0 += q[q.len() - 1] * (codes[q.len() / 2] & 15) as f32;
    }
    mn * q_sum + scale * (acc0 + acc1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Twilight's INT4 copy (codes plus the fp16 min and scale of each row) stays under 30% of an fp16 K
    /// cache at head sizes 64 and 128 (28.1% and 26.6%; with f32 parameters it was 31% and 28%).
    #[test]
    fn int4_copy_is_under_30_percent_of_fp16_k() {
        for (d, want) in [(64usize, 36usize), (128, 68)] {
            let mut codes = vec![0u8; code_bytes(d)];
            let params = quantize_row(&vec![1.0f32; d], &mut codes);
            let per_row = codes.len() + std::mem::size_of_val(&params);
            assert_eq!(per_row, want);
            let frac = per_row as f64 / (2 * d) as f64;
            assert!(frac < 0.30, "head {d}: INT4 copy is {:.1}% of fp16 K", 100.0 * frac);
        }
    }

    #[test]
    fn roundtrip_error_is_at_most_half_a_step() {
        let mut rng = Rng::new(Rng::fresh_seed());
        for d in [64usize, 80, 127, 128] {
            let x: Vec<f32> = (0..d).map(|_| (rng.normal() * 3.0) as f32).collect();
            let mut codes = vec![0u8; code_bytes(d)];
            let (mn, sc) = params_f32(quantize_row(&x, &mut codes));
            for (i, &v) in x.iter().enumerate() {
                let c = (codes[i / 2] >> ((i % 2) * 4)) & 15;
                let deq = mn + sc * c as f32;
                assert!(deq >= mn && (deq - v).abs() <= sc * 0.5 + 1e-5 * (1.0 + v.abs()), "d {d} i {i}: {v} vs {deq}");
            }
            // dot_q4 equals the dot product with the dequantized row.
            let q: Vec<f32> = (0..d).map(|_| rng.normal() as f32).collect();
            let want: f64 = (0..d).map(|i| q[i] as f64 * (mn + sc * ((codes[i / 2] >> ((i % 2) * 4)) & 15) as f32) as f64).sum();
            let got = dot_q4(&q, q.iter().sum(), &codes, mn, sc) as f64;
            assert!((got - want).abs() < 1e-3 * (1.0 + want.abs()), "{got} vs {want}");
        }
    }

    #[test]
    fn constant_row_is_exact() {
        let x = vec![2.5f32; 64];
        let mut codes = vec![0u8; 32];
        let (mn, sc) = params_f32(quantize_row(&x, &mut codes));
        assert_eq!((mn, sc), (2.5, 0.0));
        let q = vec![1.0f32; 64];
        assert_eq!(dot_q4(&q, 64.0, &codes, mn, sc), 160.0);
    }
}
