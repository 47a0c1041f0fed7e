//! DLPack's `DLTensor` (and its device and dtype structs), laid out exactly as in `dlpack.h`, and their
//! conversion into [`TensorRef`]. The header defines these types only when `dlpack.h` was not included
//! first, so callers can use either.

use std::os::raw::c_void;

use crate::error::Result;
use crate::tensor::{DType, Device, TensorRef};
use crate::{bail, ensure};

/// DLPack device (`kDLCPU` = 1, `kDLCUDA` = 2, `kDLCUDAHost` = 3, ...).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

/// DLPack dtype: `code` (`kDLInt` 0, `kDLUInt` 1, `kDLFloat` 2, `kDLBfloat` 4), `bits`, `lanes`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

/// DLPack tensor descriptor. Not owned by kvsparse; strides are in elements (NULL = compact row-major).
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

/// DLPack device types a kvsparse caller uses (`DLDevice.device_type`, `kvs_engine_config.device_type`):
/// the values of dlpack.h's `kDLCPU`, `kDLCUDA`, `kDLCUDAHost`, in the header so a C caller needs no
/// dlpack.h and no bare numbers.
#[repr(C)]
#[allow(non_camel_case_types, clippy::enum_variant_names)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvs_dl_device_type {
    KVS_DL_CPU = 1,
    KVS_DL_CUDA = 2,
    /// Pinned host memory: served like CPU memory.
    KVS_DL_CUDA_HOST = 3,
}

/// DLPack type codes (`DLDataType.code`, the values of dlpack.h's `kDLInt`, `kDLUInt`, `kDLFloat`,
/// `kDLBfloat`). kvsparse takes float32 `{KVS_DL_FLOAT, 32, 1}`, float16 `{KVS_DL_FLOAT, 16, 1}`, bfloat16
/// `{KVS_DL_BFLOAT, 16, 1}`, int32 `{KVS_DL_INT, 32, 1}`, int64 `{KVS_DL_INT, 64, 1}` and uint64
/// `{KVS_DL_UINT, 64, 1}`, each argument the ones its documentation names; an FP8 cache
/// (`kvs_engine_config.cache_dtype`) is `{KVS_DL_FLOAT8_E4M3FN, 8, 1}` / `{KVS_DL_FLOAT8_E5M2, 8, 1}` or
/// raw bytes `{KVS_DL_UINT, 8, 1}` (how vLLM allocates it).
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvs_dl_type_code {
    KVS_DL_INT = 0,
    KVS_DL_UINT = 1,
    KVS_DL_FLOAT = 2,
    KVS_DL_BFLOAT = 4,
    /// `kDLFloat8_e4m3fn` (DLPack 1.1; PyTorch's `float8_e4m3fn`), 8 bits: an FP8 E4M3 cache.
    KVS_DL_FLOAT8_E4M3FN = 10,
    /// `kDLFloat8_e5m2`, 8 bits: an FP8 E5M2 cache.
    KVS_DL_FLOAT8_E5M2 = 12,
}

pub const KDL_CPU: i32 = kvs_dl_device_type::KVS_DL_CPU as i32;
pub const KDL_CUDA: i32 = kvs_dl_device_type::KVS_DL_CUDA as i32;
pub const KDL_CUDA_HOST: i32 = kvs_dl_device_type::KVS_DL_CUDA_HOST as i32;
const INT: u8 = kvs_dl_type_code::KVS_DL_INT as u8;
const UINT: u8 = kvs_dl_type_code::KVS_DL_UINT as u8;
const FLOAT: u8 = kvs_dl_type_code::KVS_DL_FLOAT as u8;
const BFLOAT: u8 = kvs_dl_type_code::KVS_DL_BFLOAT as u8;
const FLOAT8_E4M3FN: u8 = kvs_dl_type_code::KVS_DL_FLOAT8_E4M3FN as u8;
const FLOAT8_E5M2: u8 = kvs_dl_type_code::KVS_DL_FLOAT8_E5M2 as u8;

pub fn device_from_dl(device_type: i32, device_id: i32) -> Result<Device> {
    match device_type {
        KDL_CPU | KDL_CUDA_HOST => Ok(Device::Cpu),
        KDL_CUDA => Ok(Device::Cuda(device_id)),
        other => bail!(Unsupported, "DLPack device type {other} is not supported (use kDLCPU=1 or kDLCUDA=2)"),
    }
}

/// The DLPack device of a [`Device`] (the inverse of [`device_from_dl`] for CPU and CUDA).
pub fn device_to_dl(d: Device) -> DLDevice {
    match d {
        Device::Cpu => DLDevice { device_type: KDL_CPU, device_id: 0 },
        Device::Cuda(i) => DLDevice { device_type: KDL_CUDA, device_id: i },
    }
}

/// The DLPack dtype of a [`DType`] (the inverse of `dtype_from_dl`).
pub fn dtype_to_dl(d: DType) -> DLDataType {
    let (code, bits) = match d {
        DType::F32 => (FLOAT, 32),
        DType::F16 => (FLOAT, 16),
        DType::BF16 => (BFLOAT, 16),
        DType::I32 => (INT, 32),
        DType::I64 => (INT, 64),
        DType::U64 => (UINT, 64),
        DType::F8E4M3 => (FLOAT8_E4M3FN, 8),
        DType::F8E5M2 => (FLOAT8_E5M2, 8),
        DType::U8 => (UINT, 8),
    };
    DLDataType { code, bits, lanes: 1 }
}

fn dtype_from_dl(name: &str, t: DLDataType) -> Result<DType> {
    ensure!(t.lanes == 1, InvalidDtype, "{name} has {} lanes; only scalar dtypes are supported", t.lanes);
    Ok(match (t.code, t.bits) {
        (FLOAT, 32) => DType::F32,
        (FLOAT, 16) => DType::F16,
        (BFLOAT, 16) => DType::BF16,
        (INT, 32) => DType::I32,
        (INT, 64) => DType::I64,
        (UINT, 64) => DType::U64,
        (FLOAT8_E4M3FN, 8) => DType::F8E4M3,
        (FLOAT8_E5M2, 8) => DType::F8E5M2,
        (UINT, 8) => DType::U8,
        (c, b) => bail!(InvalidDtype, "{name} has an unsupported dtype (DLPack code {c}, {b} bits)"),
    })
}

/// Converts a possibly-NULL `DLTensor*`. `required` tensors may not be NULL.
///
/// # Safety
/// A non-NULL `p` must point to a valid `DLTensor` whose `shape` (and `strides`, when not NULL) arrays
/// hold `ndim` entries, and whose data holds the addressed elements for the duration of the call.
pub unsafe fn tensor_opt(name: &str, p: *const DLTensor) -> Result<Option<TensorRef>> {
    if p.is_null() {
        return Ok(None);
    }
    let t = &*p;
    ensure!(t.ndim >= 0 && t.ndim as usize <= crate::tensor::MAX_NDIM, InvalidShape, "{name} has ndim {}, which is not supported", t.ndim);
    let ndim = t.ndim as usize;
    ensure!(ndim == 0 || !t.shape.is_null(), InvalidArgument, "{name}.shape is NULL");
    let shape = if ndim == 0 { &[][..] } else { std::slice::from_raw_parts(t.shape, ndim) };
    let strides = if t.strides.is_null() || ndim == 0 { None } else { Some(std::slice::from_raw_parts(t.strides, ndim)) };
    let dtype = dtype_from_dl(name, t.dtype)?;
    let device = device_from_dl(t.device.device_type, t.device.device_id)?;
    // NULL data, element counts and byte extents are checked (overflow is an error) by `from_raw`.
    let offset = usize::try_from(t.byte_offset).ok().filter(|&o| (t.data as usize).checked_add(o).is_some());
    let Some(offset) = offset else {
        bail!(InvalidArgument, "{name}.byte_offset {} added to data {:p} wraps around the address space", t.byte_offset, t.data);
    };
    // A NULL data pointer stays NULL whatever the offset, so `from_raw` rejects it when elements exist.
    let data = if t.data.is_null() { std::ptr::null_mut() } else { (t.data as *mut u8).wrapping_add(offset) };
    TensorRef::from_raw(data, dtype, device, shape, strides).map(Some).map_err(|mut e| {
        e.message = format!("{name}: {}", e.message);
        e
    })
}

/// Like [`tensor_opt`] for required tensors: NULL is an invalid-argument error naming the tensor.
///
/// # Safety
/// As for [`tensor_opt`].
pub unsafe fn tensor(name: &str, p: *const DLTensor) -> Result<TensorRef> {
    match tensor_opt(name, p)? {
        Some(t) => Ok(t),
        None => bail!(InvalidArgument, "{name} is NULL"),
    }
}
