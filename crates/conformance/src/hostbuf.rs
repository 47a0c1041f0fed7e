//! Host buffers of any float dtype the library serves, readable and writable as f64, so fixtures and the
//! float64 reference can treat every dtype alike.

use half::{bf16, f16};

use kvsparse::tensor::{DType, TensorRef};

#[derive(Clone, Debug)]
pub enum HostBuf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl HostBuf {
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => HostBuf::F32(vec![0.0; n]),
            DType::F16 => HostBuf::F16(vec![f16::ZERO; n]),
            DType::BF16 => HostBuf::BF16(vec![bf16::ZERO; n]),
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
        }
    }
    pub fn get(&self, i: usize) -> f64 {
        match self {
            HostBuf::F32(v) => v[i] as f64,
            HostBuf::F16(v) => v[i].to_f64(),
            HostBuf::BF16(v) => v[i].to_f64(),
        }
    }
    /// Stores `x` rounded to the buffer's dtype.
    pub fn set(&mut self, i: usize, x: f64) {
        match self {
            HostBuf::F32(v) => v[i] = x as f32,
            HostBuf::F16(v) => v[i] = f16::from_f64(x),
            HostBuf::BF16(v) => v[i] = bf16::from_f64(x),
        }
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            HostBuf::F32(v) => v.as_mut_ptr() as *mut u8,
            HostBuf::F16(v) => v.as_mut_ptr() as *mut u8,
            HostBuf::BF16(v) => v.as_mut_ptr() as *mut u8,
        }
    }
    pub fn as_bytes(&self) -> &[u8] {
        let (p, n) = match self {
            HostBuf::F32(v) => (v.as_ptr() as *const u8, v.len() * 4),
            HostBuf::F16(v) => (v.as_ptr() as *const u8, v.len() * 2),
            HostBuf::BF16(v) => (v.as_ptr() as *const u8, v.len() * 2),
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
