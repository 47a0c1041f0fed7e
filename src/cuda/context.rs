//! One CUDA device as kvsparse uses it: the device's primary context (shared with PyTorch and every other
//! runtime-API user of the process), its properties, and owned device allocations.

use std::ffi::c_void;

use super::driver::{self, check, cuda, CUcontext, CUdevice, CUdeviceptr, CUstream};
use crate::error::Result;
use crate::ensure;

/// A device and its retained primary context.
pub struct Gpu {
    pub ordinal: i32,
    dev: CUdevice,
    ctx: CUcontext,
    pub num_sms: i32,
    pub l2_bytes: i32,
    pub cc: (i32, i32),
    /// Most shared memory one CTA may opt into, bytes.
    pub smem_optin: i32,
}

// SAFETY: a primary context may be made current on any thread; the handles are plain tokens.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Retains the primary context of device `ordinal` (fails cleanly without a driver or device).
    pub fn open(ordinal: i32) -> Result<Gpu> {
        let api = cuda()?;
        let mut n = 0;
        // SAFETY: driver calls with valid out-parameters.
        unsafe {
            check((api.cuDeviceGetCount)(&mut n), "cuDeviceGetCount")?;
            ensure!(ordinal >= 0 && ordinal < n, Unsupported, "CUDA device {ordinal} requested, but the driver sees {n} device(s)");
            let mut dev = 0;
            check((api.cuDeviceGet)(&mut dev, ordinal), "cuDeviceGet")?;
            let attr = |a| -> Result<i32> {
                let mut v = 0;
                check((api.cuDeviceGetAttribute)(&mut v, a, dev), "cuDeviceGetAttribute")?;
                Ok(v)
            };
            let cc = (attr(driver::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(driver::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
            ensure!(cc.0 >= 8, Unsupported, "CUDA device {ordinal} has compute capability {}.{}; kvsparse needs 8.0 or newer", cc.0, cc.1);
            let num_sms = attr(driver::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let l2_bytes = attr(driver::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?;
            let smem_optin = attr(driver::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
            let mut ctx = std::ptr::null_mut();
            check((api.cuDevicePrimaryCtxRetain)(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            let g = Gpu { ordinal, dev, ctx, num_sms, l2_bytes, cc, smem_optin };
            g.make_current()?;
            Ok(g)
        }
    }

    /// Makes the primary context current on the calling thread (cheap; done at the start of every call).
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: ctx is a retained primary context.
        check(unsafe { (cuda()?.cuCtxSetCurrent)(self.ctx) }, "cuCtxSetCurrent")
    }

    /// NVRTC target for this device, e.g. "sm_90".
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }

    /// Is `stream` being captured into a graph right now?
    #[allow(clippy::not_unsafe_ptr_arg_deref)] // driver handles (CUstream, CUfunction): opaque, passed to the driver, never dereferenced here
    pub fn is_capturing(&self, stream: CUstream) -> Result<bool> {
        let mut st = 0;
        // SAFETY: valid stream handle by the caller's contract; out-parameter.
        check(unsafe { (cuda()?.cuStreamIsCapturing)(stream, &mut st) }, "cuStreamIsCapturing")?;
        Ok(st != driver::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.make_current()?;
        // SAFETY: no arguments.
        check(unsafe { (cuda()?.cuCtxSynchronize)() }, "cuCtxSynchronize")
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if let Ok(api) = cuda() {
            // SAFETY: releases the reference taken in open().
            unsafe { (api.cuDevicePrimaryCtxRelease)(self.dev) };
        }
    }
}

/// An owned device allocation (freed on drop). Used for workspaces, tests and benchmarks.
pub struct DevBuf {
    pub ptr: CUdeviceptr,
    pub bytes: usize,
}

impl DevBuf {
    pub fn alloc(bytes: usize) -> Result<DevBuf> {
        let mut ptr = 0;
        // SAFETY: out-parameter; a zero-byte request is rounded up so the pointer is always valid.
        check(unsafe { (cuda()?.cuMemAlloc)(&mut ptr, bytes.max(16)) }, &format!("cuMemAlloc({bytes} bytes)"))?;
        Ok(DevBuf { ptr, bytes })
    }
    /// Allocates and fills from host bytes (synchronous).
    pub fn from_host(data: &[u8]) -> Result<DevBuf> {
        let b = DevBuf::alloc(data.len())?;
        b.upload(0, data)?;
        Ok(b)
    }
    pub fn upload(&self, offset: usize, data: &[u8]) -> Result<()> {
        ensure!(offset + data.len() <= self.bytes, OutOfRange, "upload of {} bytes at {offset} exceeds a {}-byte buffer", data.len(), self.bytes);
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: range checked above; host slice valid for its length.
        check(unsafe { (cuda()?.cuMemcpyHtoD)(self.ptr + offset as u64, data.as_ptr() as *const c_void, data.len()) }, "cuMemcpyHtoD")
    }
    pub fn download(&self, offset: usize, data: &mut [u8]) -> Result<()> {
        ensure!(offset + data.len() <= self.bytes, OutOfRange, "download of {} bytes at {offset} exceeds a {}-byte buffer", data.len(), self.bytes);
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: range checked above; host slice valid for its length.
        check(unsafe { (cuda()?.cuMemcpyDtoH)(data.as_mut_ptr() as *mut c_void, self.ptr + offset as u64, data.len()) }, "cuMemcpyDtoH")
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr as usize as *mut u8
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if let Ok(api) = cuda() {
            // SAFETY: ptr came from cuMemAlloc and is freed once.
            unsafe { (api.cuMemFree)(self.ptr) };
        }
    }
}
