//! Host buffers of any float dtype the library serves, readable and writable as f64, so fixtures and the
//! float64 reference can treat every dtype alike. FP8 buffers read and write unscaled values (a scaled
//! cache element goes through [`HostBuf::set_byte`] with `kvsparse::fp8::quantize`).

use half::{bf16, f16};

use kvsparse::tensor::{DType, TensorRef};

#[derive(Clone, Debug)]
pub enum HostBuf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    /// FP8 bytes of the given format; views are uint8, as vLLM allocates FP8 caches.
    F8(DType, Vec<u8>),
}

impl HostBuf {
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => HostBuf::F32(vec![0.0; n]),
            DType::F16 => HostBuf::F16(vec![f16::ZERO; n]),
            DType::BF16 => HostBuf::BF16(vec![bf16::ZERO; n]),
            DType::F8E4M3 | DType::F8E5M2 => HostBuf::F8(dtype, vec![0; n]),
            other => panic!("HostBuf of {other:?}"),
        }
    }
    /// Every element NaN: any element a kernel fails to write shows up in the comparison.
    pub fn nans(dtype: DType, n: usize) -> Self {
        let mut b = Self::zeros(dtype, n);
        for i in 0..n {
            b.set(i, f64::NAN);
        }
        b
    }
    pub fn len(&self) -> usize {
        match self {
            HostBuf::F32(v) => v.len(),
            HostBuf::F16(v) => v.len(),
            HostBuf::BF16(v) => v.len(),
            HostBuf::F8(_, v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            HostBuf::F32(_) => DType::F32,
            HostBuf::F16(_) => DType::F16,
            HostBuf::BF16(_) => DType::BF16,
            HostBuf::F8(d, _) => *d,
        }
    }
    pub fn get(&self, i: usize) -> f64 {
        match self {
            HostBuf::F32(v) => v[i] as f64,
            HostBuf::F16(v) => v[i].to_f64(),
            HostBuf::BF16(v) => v[i].to_f64(),
            HostBuf::F8(d, v) => kvsparse::fp8::decode(*d, v[i]) as f64,
        }
    }
    /// Stores `x` rounded to the buffer's dtype (FP8: unscaled, saturating).
    pub fn set(&mut self, i: usize, x: f64) {
        match self {
            HostBuf::F32(v) => v[i] = x as f32,
            HostBuf::F16(v) => v[i] = f16::from_f64(x),
            HostBuf::BF16(v) => v[i] = bf16::from_f64(x),
            HostBuf::F8(d, v) => v[i] = kvsparse::fp8::encode_satfinite(*d, x as f32),
        }
    }
    /// Stores one raw FP8 byte (a quantized cache element); panics on other dtypes.
    pub fn set_byte(&mut self, i: usize, b: u8) {
        match self {
            HostBuf::F8(_, v) => v[i] = b,
            other => panic!("set_byte on a {:?} buffer", other.dtype()),
        }
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            HostBuf::F32(v) => v.as_mut_ptr() as *mut u8,
            HostBuf::F16(v) => v.as_mut_ptr() as *mut u8,
            HostBuf::BF16(v) => v.as_mut_ptr() as *mut u8,
            HostBuf::F8(_, v) => v.as_mut_ptr(),
        }
    }
    pub fn as_bytes(&self) -> &[u8] {
        let (p, n) = match self {
            HostBuf::F32(v) => (v.as_ptr() as *const u8, v.len() * 4),
            HostBuf::F16(v) => (v.as_ptr() as *const u8, v.len() * 2),
            HostBuf::BF16(v) => (v.as_ptr() as *const u8, v.len() * 2),
            HostBuf::F8(_, v) => (v.as_ptr(), v.len()),
        };
        // SAFETY: plain-old-data slice reinterpreted as bytes.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
    /// A strided CPU view (offset and strides in elements); panics if it would reach outside the buffer.
    pub fn view(&mut self, offset: usize, shape: &[i64], strides: &[i64]) -> TensorRef {
        let t = match self {
            HostBuf::F32(v) => TensorRef::strided(v, offset, shape, strides),
            HostBuf::F16(v) => TensorRef::strided(v, offset, shape, strides),
            HostBuf::BF16(v) => TensorRef::strided(v, offset, shape, strides),
            HostBuf::F8(_, v) => TensorRef::strided(v, offset, shape, strides),
        };
        t.expect("fixture view fits its buffer")
    }
    /// A compact row-major view.
    pub fn view_contiguous(&mut self, shape: &[i64]) -> TensorRef {
        let mut strides = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        self.view(0, shape, &strides)
    }
}
