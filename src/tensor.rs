//! Borrowed, strided tensor views: the crate's internal form of a DLPack `DLTensor`.
//!
//! A `TensorRef` is a raw pointer plus shape and strides (in elements, as in DLPack). It does not own
//! memory; whoever builds one promises the memory stays valid for the call. The FFI layer builds them from
//! `DLTensor`s, Rust callers from slices with [`TensorRef::from_slice`] / [`TensorRef::from_slice_mut`].

use crate::error::Result;
use crate::{bail, ensure};

/// Element types kvsparse understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    I64,
    U64,
    /// FP8 E4M3 ("fn": no infinities, `S.1111.111` is NaN), a cache dtype only (src/fp8.rs).
    F8E4M3,
    /// FP8 E5M2 (IEEE-like: infinities and NaNs), a cache dtype only.
    F8E5M2,
    /// Raw bytes: vLLM allocates FP8 caches as `torch.uint8`; an FP8 engine reads them as its cache dtype.
    U8,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F8E4M3 | DType::F8E5M2 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 | DType::U64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F8E4M3 => "float8_e4m3",
            DType::F8E5M2 => "float8_e5m2",
            DType::U8 => "uint8",
        }
    }
    /// A dtype of queries, outputs and full-precision caches.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
    /// An FP8 cache dtype (scaled: src/fp8.rs).
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }
}

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(i32),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Largest rank any kvsparse argument has (`[2, blocks, block_size, heads, dim]` combined caches).
pub const MAX_NDIM: usize = 5;

/// Element types that can back a tensor built from a Rust slice.
pub trait Element: Copy + 'static {
    const DTYPE: DType;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u64 {
    const DTYPE: DType = DType::U64;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// A borrowed strided view. `data` already includes DLPack's `byte_offset`.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef {
    pub data: *mut u8,
    pub dtype: DType,
    pub device: Device,
    ndim: usize,
    shape: [i64; MAX_NDIM],
    strides: [i64; MAX_NDIM],
}

// SAFETY: a TensorRef is a plain description of memory; the code that dereferences it (kernels) is
// responsible for disjoint writes, and the C ABI documents that tensors must outlive the call.
unsafe impl Send for TensorRef {}
unsafe impl Sync for TensorRef {}

impl TensorRef {
    /// Builds a view from raw parts. `strides == None` means compact row-major, as in DLPack.
    ///
    /// Checks what can be checked without knowing the memory (see [`check_extent`](Self::check_extent)):
    /// the element count and the byte extent fit in 63 bits, the addressed bytes do not wrap around the
    /// address space, and a view that addresses any element has a non-NULL `data`.
    ///
    /// # Safety
    /// `data` must point to memory that holds every element the shape and strides address, and stay
    /// valid (and, for outputs, writable and unaliased) for as long as the view is used.
    pub unsafe fn from_raw(
        data: *mut u8,
        dtype: DType,
        device: Device,
        shape: &[i64],
        strides: Option<&[i64]>,
    ) -> Result<Self> {
        ensure!(shape.len() <= MAX_NDIM, InvalidShape, "tensor has {} dimensions, at most {} are supported", shape.len(), MAX_NDIM);
        let mut t = TensorRef { data, dtype, device, ndim: shape.len(), shape: [0; MAX_NDIM], strides: [0; MAX_NDIM] };
        for (i, &s) in shape.iter().enumerate() {
            ensure!(s >= 0, InvalidShape, "negative extent {} in dimension {}", s, i);
            t.shape[i] = s;
        }
        match strides {
            Some(st) => {
                ensure!(st.len() == shape.len(), InvalidShape, "strides have {} entries for {} dimensions", st.len(), shape.len());
                t.strides[..st.len()].copy_from_slice(st);
            }
            None => {
                // Compact strides of an empty tensor are never used to address anything: saturate.
                let mut acc = 1i64;
                for i in (0..shape.len()).rev() {
                    t.strides[i] = acc;
                    acc = acc.saturating_mul(shape[i].max(1));
                }
            }
        }
        t.check_extent()?;
        Ok(t)
    }

    /// Checked size arithmetic of a view: the element count fits in an i64, and, when the view addresses
    /// any element, the lowest and highest addressed bytes fit in an isize, `data` is not NULL and the
    /// addressed byte range does not wrap around the address space. A view with no element (some extent
    /// 0) addresses nothing, whatever its strides and pointer.
    fn check_extent(&self) -> Result<()> {
        let numel = self.shape().iter().try_fold(1i64, |acc, &s| acc.checked_mul(s));
        let Some(numel) = numel else {
            bail!(InvalidShape, "shape {:?} has more elements than fit in 64 bits", self.shape());
        };
        if numel == 0 {
            return Ok(());
        }
        let too_big = || crate::error::Error::new(crate::error::ErrorKind::InvalidShape, format!("shape {:?} with strides {:?} addresses more bytes than fit in the address space", self.shape(), self.strides()));
        let (mut lo, mut hi) = (0i64, 0i64);
        for i in 0..self.ndim {
            let reach = (self.shape[i] - 1).checked_mul(self.strides[i]).ok_or_else(too_big)?;
            if reach < 0 {
                lo = lo.checked_add(reach).ok_or_else(too_big)?;
            } else {
                hi = hi.checked_add(reach).ok_or_else(too_big)?;
            }
        }
        let es = self.dtype.size_bytes() as i64;
        let lo_bytes = lo.checked_mul(es).ok_or_else(too_big)?;
        let hi_bytes = hi.checked_mul(es).and_then(|h| h.checked_add(es - 1)).ok_or_else(too_big)?;
        hi_bytes.checked_sub(lo_bytes).filter(|&span| span < isize::MAX as i64).ok_or_else(too_big)?;
        ensure!(!self.data.is_null(), InvalidArgument, "data is NULL but the shape {:?} holds {numel} elements", self.shape());
        let addr = self.data as usize;
        let fits = addr.checked_sub(lo_bytes.unsigned_abs() as usize).is_some() && addr.checked_add(hi_bytes as usize).is_some();
        ensure!(fits, InvalidArgument, "data {:p} plus the byte extent [{lo_bytes}, {hi_bytes}] wraps around the address space", self.data);
        ensure!(addr % es as usize == 0, InvalidArgument, "data {:p} (with byte_offset) is not aligned to its {es}-byte elements", self.data);
        Ok(())
    }

    /// A compact row-major CPU view of a slice; panics (Rust callers only) if the shape does not match.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i64]) -> Self {
        let n: i64 = shape.iter().product();
        assert_eq!(n as usize, data.len(), "slice length does not match shape {shape:?}");
        // SAFETY: the slice holds exactly the addressed elements.
        unsafe { Self::from_raw(data.as_ptr() as *mut u8, T::DTYPE, Device::Cpu, shape, None).expect("valid shape") }
    }

    /// Like [`from_slice`](Self::from_slice) for outputs.
    pub fn from_slice_mut<T: Element>(data: &mut [T], shape: &[i64]) -> Self {
        Self::from_slice(&*data, shape)
    }

    /// A strided CPU view into a slice; checks that every addressed element lies inside the slice.
    pub fn strided<T: Element>(data: &[T], offset: usize, shape: &[i64], strides: &[i64]) -> Result<Self> {
        ensure!(offset <= data.len(), OutOfRange, "strided view starts at {offset}, past its slice of {}", data.len());
        let base = data.as_ptr().wrapping_add(offset) as *mut u8;
        // SAFETY: checked below before the view is handed out.
        let t = unsafe { Self::from_raw(base, T::DTYPE, Device::Cpu, shape, Some(strides))? };
        if t.numel() > 0 {
            let (lo, hi) = t.element_span();
            ensure!(offset as i64 + lo >= 0 && (offset as i64 + hi) < data.len() as i64, OutOfRange, "strided view reaches outside its slice");
        }
        Ok(t)
    }

    pub fn ndim(&self) -> usize {
        self.ndim
    }
    pub fn shape(&self) -> &[i64] {
        &self.shape[..self.ndim]
    }
    pub fn strides(&self) -> &[i64] {
        &self.strides[..self.ndim]
    }
    pub fn dim(&self, i: usize) -> usize {
        self.shape[i] as usize
    }
    pub fn stride(&self, i: usize) -> isize {
        self.strides[i] as isize
    }
    pub fn numel(&self) -> usize {
        self.shape().iter().product::<i64>() as usize
    }

    /// Lowest and highest element offsets (relative to `data`) the view addresses; (0, 0) when empty.
    pub fn element_span(&self) -> (i64, i64) {
        let (mut lo, mut hi) = (0i64, 0i64);
        for i in 0..self.ndim {
            if self.shape[i] == 0 {
                return (0, 0);
            }
            let reach = (self.shape[i] - 1) * self.strides[i];
            if reach < 0 {
                lo += reach
            } else {
                hi += reach
            }
        }
        (lo, hi)
    }

    /// Pointer to the element at `idx` (no bounds check; callers validated the shape).
    #[inline(always)]
    pub fn ptr_at(&self, idx: &[usize]) -> *mut u8 {
        let mut off: isize = 0;
        for (i, &x) in idx.iter().enumerate() {
            off += x as isize * self.strides[i] as isize;
        }
        unsafe { self.data.offset(off * self.dtype.size_bytes() as isize) }
    }

    /// Splits dimension 0 of a combined tensor (e.g. a `[2, num_blocks, ...]` KV cache) into a sub-view.
    pub fn select0(&self, i: usize) -> Result<TensorRef> {
        ensure!(self.ndim >= 1 && (i as i64) < self.shape[0], OutOfRange, "index {} out of range for dimension 0 of extent {}", i, self.shape.first().copied().unwrap_or(0));
        let mut t = *self;
        t.data = self.ptr_at(&[i]);
        t.ndim -= 1;
        t.shape.copy_within(1..MAX_NDIM, 0);
        t.strides.copy_within(1..MAX_NDIM, 0);
        Ok(t)
    }

    /// Reads an integer element (I32, I64 or U64 tensors) as i64.
    ///
    /// # Safety
    /// The view must be valid and `idx` inside its shape.
    #[inline]
    pub unsafe fn read_int(&self, idx: &[usize]) -> i64 {
        let p = self.ptr_at(idx);
        match self.dtype {
            DType::I32 => (p as *const i32).read_unaligned() as i64,
            DType::I64 => (p as *const i64).read_unaligned(),
            DType::U64 => (p as *const u64).read_unaligned() as i64,
            _ => unreachable!("read_int on a float tensor"),
        }
    }

    /// Checks rank, dtype and device in one go, naming the argument in the error.
    pub fn expect(&self, name: &str, ndim: usize, dtypes: &[DType], device: Device) -> Result<()> {
        if self.ndim != ndim {
            bail!(InvalidShape, "{name} must have {ndim} dimensions, got {} (shape {:?})", self.ndim, self.shape());
        }
        if !dtypes.contains(&self.dtype) {
            let names: Vec<_> = dtypes.iter().map(|d| d.name()).collect();
            bail!(InvalidDtype, "{name} has dtype {}, expected {}", self.dtype.name(), names.join(" or "));
        }
        if self.device != device {
            bail!(InvalidArgument, "{name} is on {}, but this call runs on {}", self.device, device);
        }
        for i in 0..self.ndim {
            if self.strides[i] < 0 {
                bail!(InvalidShape, "{name} has a negative stride {} in dimension {i}", self.strides[i]);
            }
        }
        Ok(())
    }

    /// Checks the extents; `None` entries are free.
    pub fn expect_shape(&self, name: &str, want: &[Option<usize>]) -> Result<()> {
        for (i, w) in want.iter().enumerate() {
            if let Some(w) = w {
                if self.shape[i] as usize != *w {
                    let pretty: Vec<String> = want.iter().map(|x| x.map_or("*".to_string(), |v| v.to_string())).collect();
                    bail!(InvalidShape, "{name} has shape {:?}, expected [{}]", self.shape(), pretty.join(", "));
                }
            }
        }
        Ok(())
    }

    /// Outputs must not write one element twice: rejects zero strides on dimensions longer than one and
    /// overlapping row-major-ish layouts (checked by sorting dimensions by stride). A view with no element
    /// writes nothing and never overlaps (numpy gives empty arrays all-zero strides).
    pub fn expect_no_self_overlap(&self, name: &str) -> Result<()> {
        if self.numel() == 0 {
            return Ok(());
        }
        let mut dims: Vec<(i64, i64)> = (0..self.ndim).filter(|&i| self.shape[i] > 1).map(|i| (self.strides[i], self.shape[i])).collect();
        dims.sort();
        let mut reach = 0i64; // elements covered by the smaller dimensions, minus one
        for (stride, extent) in dims {
            let next = stride.checked_mul(extent - 1).and_then(|r| r.checked_add(reach));
            match next {
                Some(next) if stride > reach => reach = next,
                _ => bail!(InvalidShape, "{name} has overlapping strides {:?} for shape {:?}; outputs must not alias themselves", self.strides(), self.shape()),
            }
        }
        Ok(())
    }
}
