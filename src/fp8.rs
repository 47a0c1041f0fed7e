//! The two 8-bit float formats an FP8 KV cache holds, as vLLM stores them (`kv_cache_dtype="fp8"` /
//! `"fp8_e4m3"`: OCP E4M3 "fn", `"fp8_e5m2"`: E5M2), and their scaled conversions.
//!
//! vLLM's convention (csrc/quantization/fp8/nvidia/quant_utils.cuh, `scaled_vec_conversion`): a cache
//! element is `fp8 = cvt_satfinite(x / scale)` on write and `x ≈ float(fp8) * scale` on read, with one
//! float32 scale per layer for keys (`k_scale`) and one for values (`v_scale`). `cvt_satfinite` rounds to
//! nearest even and saturates: magnitudes past the largest finite value (448 for E4M3, 57344 for E5M2),
//! infinities included, become that value; NaN stays NaN.
//!
//! Decoding is a 256-entry table per format (exact: every FP8 value is an f32); encoding is exact rounding
//! in f64 (cache writes, not the attention loop).

use crate::tensor::DType;

/// Largest finite E4M3 value (`S.1111.110`).
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 value (`S.11110.11`).
pub const E5M2_MAX: f32 = 57344.0;

/// Bit layout of one FP8 format.
#[derive(Clone, Copy)]
struct Format {
    mant_bits: u32,
    bias: i32,
    /// E5M2 keeps IEEE infinities and NaNs in its top exponent; E4M3 "fn" has only `S.1111.111` = NaN.
    ieee_top: bool,
    max: f32,
}

const E4M3: Format = Format { mant_bits: 3, bias: 7, ieee_top: false, max: E4M3_MAX };
const E5M2: Format = Format { mant_bits: 2, bias: 15, ieee_top: true, max: E5M2_MAX };

fn format(dtype: DType) -> Format {
    match dtype {
        DType::F8E4M3 => E4M3,
        DType::F8E5M2 => E5M2,
        _ => unreachable!("fp8 conversion of a {} tensor", dtype.name()),
    }
}

/// `2^k` for the exponents FP8 needs (well inside f32's normal range).
const fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

const fn decode_with(f: Format, b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp_bits = 7 - f.mant_bits;
    let e = ((b as u32 >> f.mant_bits) & ((1 << exp_bits) - 1)) as i32;
    let m = (b as u32 & ((1 << f.mant_bits) - 1)) as i32;
    let top = (1 << exp_bits) - 1;
    if f.ieee_top && e == top {
        return if m == 0 { sign * f32::INFINITY } else { f32::NAN };
    }
    if !f.ieee_top && e == top && m == (1 << f.mant_bits) - 1 {
        return f32::NAN;
    }
    let frac_scale = pow2(-(f.mant_bits as i32));
    if e == 0 {
        sign * (m as f32) * frac_scale * pow2(1 - f.bias)
    } else {
        sign * ((1 << f.mant_bits) + m) as f32 * frac_scale * pow2(e - f.bias)
    }
}

const fn table(f: Format) -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_with(f, i as u8);
        i += 1;
    }
    t
}

static E4M3_TABLE: [f32; 256] = table(E4M3);
static E5M2_TABLE: [f32; 256] = table(E5M2);

/// The decoding table of an FP8 dtype (`table[byte]` is its exact value, unscaled).
#[inline(always)]
pub fn decode_table(dtype: DType) -> &'static [f32; 256] {
    match dtype {
        DType::F8E4M3 => &E4M3_TABLE,
        DType::F8E5M2 => &E5M2_TABLE,
        _ => unreachable!("fp8 decode of a {} tensor", dtype.name()),
    }
}

/// The exact value of one FP8 byte (unscaled).
#[inline(always)]
pub fn decode(dtype: DType, b: u8) -> f32 {
    decode_table(dtype)[b as usize]
}

/// `x` rounded to the nearest `dtype` value (ties to even), saturating to ±max (infinities too); NaN
/// gives a NaN byte. What `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)` returns.
pub fn encode_satfinite(dtype: DType, x: f32) -> u8 {
    let f = format(dtype);
    if x.is_nan() {
        return 0x7f;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = (x as f64).abs();
    let min_normal = 2f64.powi(1 - f.bias);
    // Spacing of representable values around `a`: fixed below the normal range, 2^(e - mant) above.
    let e = if a < min_normal { 1 - f.bias } else { a.log2().floor() as i32 };
    let quantum = 2f64.powi(e - f.mant_bits as i32);
    let v = ((a / quantum).round_ties_even() * quantum).min(f.max as f64);
    sign | encode_exact(f, v)
}

/// The byte of a non-negative value `v` that the format represents exactly.
fn encode_exact(f: Format, v: f64) -> u8 {
    let min_normal = 2f64.powi(1 - f.bias);
    let unit = 1u32 << f.mant_bits;
    if v < min_normal {
        return (v / min_normal * unit as f64) as u8;
    }
    let e = v.log2().floor() as i32;
    let m = (v / 2f64.powi(e) * unit as f64) as u32 - unit;
    (((e + f.bias) as u32) << f.mant_bits | m) as u8
}

/// `encode_satfinite(x / scale)`: how `kvs_cache_write` stores an element (float32 division, as vLLM).
#[inline]
pub fn quantize(dtype: DType, x: f32, scale: f32) -> u8 {
    encode_satfinite(dtype, x / scale)
}

/// `decode(b) * scale` in float32: how every reader of an FP8 cache dequantizes an element.
#[inline(always)]
pub fn dequantize(dtype: DType, b: u8, scale: f32) -> f32 {
    decode(dtype, b) * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn formats() -> [(DType, Format); 2] {
        [(DType::F8E4M3, E4M3), (DType::F8E5M2, E5M2)]
    }

    #[test]
    fn decoding_knows_the_landmark_values() {
        let t = decode_table(DType::F8E4M3);
        assert_eq!((t[0x7e], t[0xfe], t[0x01], t[0x08], t[0x38]), (448.0, -448.0, 2f32.powi(-9), 2f32.powi(-6), 1.0));
        assert!(t[0x7f].is_nan() && t[0xff].is_nan());
        assert_eq!(t.iter().filter(|v| v.is_nan()).count(), 2);
        let t = decode_table(DType::F8E5M2);
        assert_eq!((t[0x7b], t[0x01], t[0x3c]), (57344.0, 2f32.powi(-16), 1.0));
        assert_eq!((t[0x7c], t[0xfc]), (f32::INFINITY, f32::NEG_INFINITY));
        assert_eq!(t.iter().filter(|v| v.is_nan()).count(), 6);
        // E5M2 is the top byte of an IEEE half.
        for b in 0..=255u8 {
            let h = half::f16::from_bits((b as u16) << 8).to_f32();
            assert!(h == t[b as usize] || (h.is_nan() && t[b as usize].is_nan()), "byte {b:#x}");
        }
    }

    /// The nearest representable value by exhaustive search over the format's finite values (ties to
    /// the even mantissa, i.e. the even byte), saturating: an independent reference for the encoder.
    fn nearest_by_search(f: Format, dtype: DType, x: f32) -> u8 {
        let t = decode_table(dtype);
        let a = (x as f64).abs().min(f.max as f64);
        let mut best = 0u8;
        for b in 0..=0x7fu8 {
            let v = t[b as usize] as f64;
            if !v.is_finite() {
                continue;
            }
            let (db, dv) = ((t[best as usize] as f64 - a).abs(), (v - a).abs());
            if dv < db || (dv == db && b % 2 == 0) {
                best = b;
            }
        }
        best | if x.is_sign_negative() { 0x80 } else { 0 }
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_saturates() {
        let mut rng = crate::rng::Rng::new(0xf8);
        for (dtype, f) in formats() {
            let t = decode_table(dtype);
            // Every finite value round-trips; midpoints between neighbours go to the even byte.
            for b in 0..=0x7eu8 {
                let v = t[b as usize];
                if !v.is_finite() {
                    continue;
                }
                assert_eq!(encode_satfinite(dtype, v), b, "{} {v}", dtype.name());
                assert_eq!(encode_satfinite(dtype, -v), b | 0x80);
                let next = t[b as usize + 1];
                if next.is_finite() {
                    let mid = ((v as f64 + next as f64) / 2.0) as f32;
                    assert_eq!(encode_satfinite(dtype, mid), nearest_by_search(f, dtype, mid), "midpoint {mid}");
                    assert_eq!(encode_satfinite(dtype, mid) % 2, 0);
                }
            }
            for _ in 0..200_000 {
                let x = ((rng.uniform() - 0.5) * 2.0 * f.max as f64 * 1.2 * 2f64.powi(-(rng.below(24) as i32))) as f32;
                assert_eq!(encode_satfinite(dtype, x), nearest_by_search(f, dtype, x), "{} x={x}", dtype.name());
            }
            assert_eq!(encode_satfinite(dtype, f32::INFINITY), encode_satfinite(dtype, f.max));
            assert_eq!(encode_satfinite(dtype, f32::NEG_INFINITY), encode_satfinite(dtype, -f.max));
            assert_eq!(encode_satfinite(dtype, 1e30), encode_satfinite(dtype, f.max));
            assert!(decode(dtype, encode_satfinite(dtype, f32::NAN)).is_nan());
            assert_eq!(encode_satfinite(dtype, 1e-30), 0);
            assert_eq!(encode_satfinite(dtype, -1e-30), 0x80);
        }
    }

    #[test]
    fn quantize_divides_by_the_scale() {
        assert_eq!(quantize(DType::F8E4M3, 3.0, 0.5), encode_satfinite(DType::F8E4M3, 6.0));
        assert_eq!(dequantize(DType::F8E4M3, quantize(DType::F8E4M3, 3.0, 0.5), 0.5), 3.0);
        assert_eq!(quantize(DType::F8E4M3, 1000.0, 1.0), 0x7e);
    }
}
