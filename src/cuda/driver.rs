//! The CUDA driver and NVRTC, loaded at run time with `dlopen`: the crate builds and its CPU paths run on
//! machines without CUDA, and a missing driver becomes an error value, never a link failure or a panic.
//!
//! Only the ~35 entry points kvsparse uses are bound (by their versioned `_v2` names where the driver
//! has them), so the table below is the whole surface; a symbol that is missing is reported by name.
//! We bind these ourselves rather than through cudarc: its loader panics when the library is absent and
//! needs a compile-time CUDA-version feature, while this table works with any driver from CUDA 12 on.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

use once_cell::sync::OnceCell;

use crate::error::{Error, ErrorKind, Result};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type NvrtcProgram = *mut c_void;

pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
pub const CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: c_int = 38;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub const CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;

/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` (cuda.h): the kernel may start before the
/// previous one in its stream ends, and waits for it where it executes `griddepcontrol.wait`.
pub const CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: u32 = 6;

/// cuda.h's `CUlaunchAttribute`: an id, padding to 8 bytes, a 64-byte value union.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUlaunchAttribute {
    pub id: u32,
    pub pad: u32,
    pub value: [u64; 8],
}

/// cuda.h's `CUlaunchConfig` (CUDA 12 and newer).
#[repr(C)]
pub struct CUlaunchConfig {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub stream: CUstream,
    pub attrs: *const CUlaunchAttribute,
    pub num_attrs: c_uint,
}

macro_rules! api_table {
    ($name:ident { $($f:ident : fn($($a:ty),*) -> $r:ty;)* }) => {
        #[allow(non_snake_case)]
        pub struct $name { $(pub $f: unsafe extern "C" fn($($a),*) -> $r,)* }
        impl $name {
            /// Resolves every symbol of the table in `lib`, naming the first one that is missing.
            unsafe fn load(lib: *mut c_void, lib_name: &str) -> std::result::Result<Self, String> {
                Ok($name { $($f: {
                    let p = sym(lib, stringify!($f))?;
                    if p.is_null() { return Err(format!("{} has no symbol {}", lib_name, stringify!($f))); }
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($a),*) -> $r>(p)
                },)* })
            }
        }
    };
}

/// Symbols whose plain name is a legacy (v1) ABI: ask for the versioned one.
fn versioned(name: &str) -> &str {
    match name {
        "cuMemAlloc" => "cuMemAlloc_v2",
        "cuMemFree" => "cuMemFree_v2",
        "cuMemcpyHtoD" => "cuMemcpyHtoD_v2",
        "cuMemcpyDtoH" => "cuMemcpyDtoH_v2",
        "cuMemcpyDtoDAsync" => "cuMemcpyDtoDAsync_v2",
        "cuMemGetInfo" => "cuMemGetInfo_v2",
        "cuStreamDestroy" => "cuStreamDestroy_v2",
        "cuEventDestroy" => "cuEventDestroy_v2",
        "cuStreamBeginCapture" => "cuStreamBeginCapture_v2",
        "cuDevicePrimaryCtxRelease" => "cuDevicePrimaryCtxRelease_v2",
        other => other,
    }
}

unsafe fn sym(lib: *mut c_void, name: &str) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(versioned(name)).map_err(|e| e.to_string())?;
    Ok(libc::dlsym(lib, c.as_ptr()))
}

api_table!(CudaApi {
    cuInit: fn(c_uint) -> CUresult;
    cuDriverGetVersion: fn(*mut c_int) -> CUresult;
    cuGetErrorString: fn(CUresult, *mut *const c_char) -> CUresult;
    cuDeviceGetCount: fn(*mut c_int) -> CUresult;
    cuDeviceGet: fn(*mut CUdevice, c_int) -> CUresult;
    cuDeviceGetAttribute: fn(*mut c_int, c_int, CUdevice) -> CUresult;
    cuDevicePrimaryCtxRetain: fn(*mut CUcontext, CUdevice) -> CUresult;
    cuDevicePrimaryCtxRelease: fn(CUdevice) -> CUresult;
    cuCtxSetCurrent: fn(CUcontext) -> CUresult;
    cuCtxSynchronize: fn() -> CUresult;
    cuModuleLoadData: fn(*mut CUmodule, *const c_void) -> CUresult;
    cuModuleGetFunction: fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult;
    cuLaunchKernel: fn(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream, *mut *mut c_void, *mut *mut c_void) -> CUresult;
    cuLaunchKernelEx: fn(*const CUlaunchConfig, CUfunction, *mut *mut c_void, *mut *mut c_void) -> CUresult;
    cuFuncSetAttribute: fn(CUfunction, c_int, c_int) -> CUresult;
    cuMemAlloc: fn(*mut CUdeviceptr, usize) -> CUresult;
    cuMemFree: fn(CUdeviceptr) -> CUresult;
    cuMemGetInfo: fn(*mut usize, *mut usize) -> CUresult;
    cuMemcpyHtoD: fn(CUdeviceptr, *const c_void, usize) -> CUresult;
    cuMemcpyDtoH: fn(*mut c_void, CUdeviceptr, usize) -> CUresult;
    cuMemcpyDtoDAsync: fn(CUdeviceptr, CUdeviceptr, usize, CUstream) -> CUresult;
    cuMemsetD8Async: fn(CUdeviceptr, u8, usize, CUstream) -> CUresult;
    cuMemsetD16Async: fn(CUdeviceptr, u16, usize, CUstream) -> CUresult;
    cuMemsetD32Async: fn(CUdeviceptr, c_uint, usize, CUstream) -> CUresult;
    cuStreamCreate: fn(*mut CUstream, c_uint) -> CUresult;
    cuStreamDestroy: fn(CUstream) -> CUresult;
    cuStreamSynchronize: fn(CUstream) -> CUresult;
    cuStreamWaitEvent: fn(CUstream, CUevent, c_uint) -> CUresult;
    cuStreamIsCapturing: fn(CUstream, *mut c_int) -> CUresult;
    cuStreamBeginCapture: fn(CUstream, c_int) -> CUresult;
    cuStreamEndCapture: fn(CUstream, *mut CUgraph) -> CUresult;
    cuGraphInstantiateWithFlags: fn(*mut CUgraphExec, CUgraph, u64) -> CUresult;
    cuGraphLaunch: fn(CUgraphExec, CUstream) -> CUresult;
    cuGraphExecDestroy: fn(CUgraphExec) -> CUresult;
    cuGraphDestroy: fn(CUgraph) -> CUresult;
    cuEventCreate: fn(*mut CUevent, c_uint) -> CUresult;
    cuEventRecord: fn(CUevent, CUstream) -> CUresult;
    cuEventSynchronize: fn(CUevent) -> CUresult;
    cuEventElapsedTime: fn(*mut f32, CUevent, CUevent) -> CUresult;
    cuEventDestroy: fn(CUevent) -> CUresult;
    cuOccupancyMaxActiveBlocksPerMultiprocessor: fn(*mut c_int, CUfunction, c_int, usize) -> CUresult;
});

api_table!(NvrtcApi {
    nvrtcVersion: fn(*mut c_int, *mut c_int) -> c_int;
    nvrtcGetErrorString: fn(c_int) -> *const c_char;
    nvrtcCreateProgram: fn(*mut NvrtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> c_int;
    nvrtcCompileProgram: fn(NvrtcProgram, c_int, *const *const c_char) -> c_int;
    nvrtcGetProgramLogSize: fn(NvrtcProgram, *mut usize) -> c_int;
    nvrtcGetProgramLog: fn(NvrtcProgram, *mut c_char) -> c_int;
    nvrtcGetCUBINSize: fn(NvrtcProgram, *mut usize) -> c_int;
    nvrtcGetCUBIN: fn(NvrtcProgram, *mut c_char) -> c_int;
    nvrtcDestroyProgram: fn(*mut NvrtcProgram) -> c_int;
});

// SAFETY: the tables hold plain function pointers into libraries that stay loaded for the process.
unsafe impl Send for CudaApi {}
unsafe impl Sync for CudaApi {}
unsafe impl Send for NvrtcApi {}
unsafe impl Sync for NvrtcApi {}

/// Opens the first library of `candidates` (after `$env_var` if set) that loads.
fn open_first(env_var: &str, candidates: &[&str]) -> std::result::Result<(*mut c_void, String), String> {
    let mut names: Vec<String> = Vec::new();
    if let Ok(p) = std::env::var(env_var) {
        if !p.is_empty() {
            names.push(p);
        }
    }
    names.extend(candidates.iter().map(|s| s.to_string()));
    let mut tried = Vec::new();
    for n in &names {
        let c = CString::new(n.as_str()).map_err(|e| e.to_string())?;
        // SAFETY: dlopen with a valid C string; the handle is never closed (the tables point into it).
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !h.is_null() {
            return Ok((h, n.clone()));
        }
        tried.push(n.as_str());
    }
    Err(format!("none of [{}] could be loaded (set {env_var} to the library's path)", tried.join(", ")))
}

static CUDA: OnceCell<std::result::Result<CudaApi, String>> = OnceCell::new();
static NVRTC: OnceCell<std::result::Result<NvrtcApi, String>> = OnceCell::new();

/// The driver API, loaded and initialised (`cuInit`) on first use.
pub fn cuda() -> Result<&'static CudaApi> {
    let r = CUDA.get_or_init(|| {
        let (h, name) = open_first("KVS_LIBCUDA", &["libcuda.so.1", "libcuda.so"])?;
        // SAFETY: symbols resolved from the driver library with the documented signatures.
        let api = unsafe { CudaApi::load(h, &name)? };
        let rc = unsafe { (api.cuInit)(0) };
        if rc != 0 {
            return Err(format!("cuInit failed with CUDA error {rc} ({})", error_name(&api, rc)));
        }
        Ok(api)
    });
    r.as_ref().map_err(|e| Error::new(ErrorKind::Unsupported, format!("CUDA driver not available: {e}")))
}

/// NVRTC, loaded on first use (only needed when a kernel module is not in the disk cache).
pub fn nvrtc() -> Result<&'static NvrtcApi> {
    let r = NVRTC.get_or_init(|| {
        let (h, name) = open_first(
            "KVS_LIBNVRTC",
            &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", "/usr/local/cuda/lib64/libnvrtc.so"],
        )?;
        // SAFETY: symbols resolved from NVRTC with the documented signatures.
        unsafe { NvrtcApi::load(h, &name) }
    });
    r.as_ref().map_err(|e| Error::new(ErrorKind::Unsupported, format!("NVRTC not available: {e}")))
}

fn error_name(api: &CudaApi, rc: CUresult) -> String {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string or leaves it null.
    unsafe {
        if (api.cuGetErrorString)(rc, &mut p) == 0 && !p.is_null() {
            return CStr::from_ptr(p).to_string_lossy().into_owned();
        }
    }
    "unknown error".to_string()
}

/// Turns a driver return code into a `Device` error that says which call failed.
pub fn check(rc: CUresult, what: &str) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let name = match CUDA.get() {
        Some(Ok(api)) => error_name(api, rc),
        _ => "unknown error".to_string(),
    };
    let kind = if rc == 2 { ErrorKind::OutOfMemory } else { ErrorKind::Device };
    Err(Error::new(kind, format!("{what} failed: CUDA error {rc} ({name})")))
}

/// Same for NVRTC return codes.
pub fn check_nvrtc(api: &NvrtcApi, rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static string.
    let s = unsafe { CStr::from_ptr((api.nvrtcGetErrorString)(rc)).to_string_lossy().into_owned() };
    Err(Error::new(ErrorKind::Device, format!("{what} failed: NVRTC error {rc} ({s})")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// cuda.h (CUDA 12/13, x86-64): `CUlaunchAttribute` is a 4-byte id, 4 bytes of padding and a 64-byte value
    /// union; `CUlaunchConfig` is seven 4-byte dims and sizes, then the stream, the attribute pointer and the
    /// count. A mismatch would pass garbage to cuLaunchKernelEx.
    #[test]
    fn launch_config_structs_match_cuda_h() {
        assert_eq!(size_of::<CUlaunchAttribute>(), 72);
        assert_eq!(offset_of!(CUlaunchAttribute, value), 8);
        assert_eq!(offset_of!(CUlaunchConfig, shared_mem_bytes), 24);
        assert_eq!(offset_of!(CUlaunchConfig, stream), 32);
        assert_eq!(offset_of!(CUlaunchConfig, attrs), 40);
        assert_eq!(offset_of!(CUlaunchConfig, num_attrs), 48);
        assert_eq!(size_of::<CUlaunchConfig>(), 56);
    }
}
