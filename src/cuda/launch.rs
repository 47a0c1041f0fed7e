//! Kernel modules (compiled or loaded once per variant, then kept for the process) and kernel launches
//! with by-value arguments packed without heap allocation.

use std::collections::HashMap;
use std::ffi::{c_void, CString};

use parking_lot::Mutex;

use super::context::Gpu;
use super::driver::{check, cuda, CUfunction, CUlaunchAttribute, CUlaunchConfig, CUmodule, CUstream, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION};
use super::kernel_src::KernelFile;
use super::module_cache;
use crate::error::Result;

/// The shared modules (each a list of kernels/ files, expanded before compiling).
pub use super::kernel_src::{ATTENTION, ATTENTION_MMA, ATTENTION_PREFILL, CACHE_WRITE, FILL, MERGE, META, WRITE_STEP};
/// Threads of the selection kernels whose launch bound is kernels/include/topk.cuh's TOPK_THREADS (Quest's and
/// PRR's top-k, SnapKV's choice and plan, RefreshKV's plan, the predictor's selection): one CTA per row.
/// (1024 was measured no faster for the top-k: its time is a serial chain of block-wide phases.)
pub const TOPK_THREADS: u32 = 512;

/// CTAs per row of the selection kernels that split a row over a thread-block cluster (Quest's top-k,
/// top-p's search, RefreshKV's rebuild, the predictor's selection): kernels/include/cluster_topk.cuh QC_CTAS.
pub const CLUSTER_CTAS: usize = 8;

/// Whether the clusters of `rows` rows fit in one wave of one CTA per SM: the rule by which those kernels
/// take clusters at small batch (more rows fill the device with one CTA per row, or tiles).
pub fn clusters_fit_one_wave(rows: usize, num_sms: usize) -> bool {
    rows.saturating_mul(CLUSTER_CTAS) <= num_sms.max(1)
}

/// Loaded modules by variant (source name + defines) and the functions looked up in them.
#[derive(Default)]
pub struct Modules {
    modules: Mutex<HashMap<String, usize>>,
    functions: Mutex<HashMap<(String, &'static str), usize>>,
}

impl Modules {
    /// The function `func` of module `name`, built from the files `source` with `defines` (e.g.
    /// "HEAD_DIM=128"; an entry starting with "--" is passed to NVRTC as an option). One name, one list of
    /// files: the name and defines identify a loaded module.
    /// The first request compiles (or loads from the disk cache) and loads the module; later ones are a
    /// hash-map lookup. Must not be first called inside a graph capture.
    pub fn function(&self, gpu: &Gpu, name: &str, source: &[&KernelFile], defines: &[String], func: &'static str) -> Result<CUfunction> {
        let variant = format!("{name}:{}", defines.join(","));
        if let Some(&f) = self.functions.lock().get(&(variant.clone(), func)) {
            return Ok(f as CUfunction);
        }
        let module = {
            let mut mods = self.modules.lock();
            match mods.get(&variant) {
                Some(&m) => m as CUmodule,
                None => {
                    // Entries starting with "--" are NVRTC options (e.g. --fmad=false), the rest macros.
                    let mut opts: Vec<String> = defines.iter().map(|d| if d.starts_with("--") { d.clone() } else { format!("-D{d}") }).collect();
                    opts.push("--std=c++17".to_string());
                    if std::env::var("KVS_PTXAS_VERBOSE").is_ok() {
                        opts.push("--ptxas-options=-v".to_string());
                    }
                    let text = super::kernel_src::expand(source)?;
                    let bin = module_cache::cubin(name, &text, &opts, &gpu.arch())?;
                    let mut m: CUmodule = std::ptr::null_mut();
                    // SAFETY: bin is a complete cubin for this device's architecture.
                    check(unsafe { (cuda()?.cuModuleLoadData)(&mut m, bin.as_ptr() as *const c_void) }, &format!("cuModuleLoadData({name})"))?;
                    mods.insert(variant.clone(), m as usize);
                    m
                }
            }
        };
        let cname = CString::new(func).expect("no NUL in function name");
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: module is loaded; out-parameter.
        check(unsafe { (cuda()?.cuModuleGetFunction)(&mut f, module, cname.as_ptr()) }, &format!("cuModuleGetFunction({func})"))?;
        self.functions.lock().insert((variant, func), f as usize);
        Ok(f)
    }
}

/// Up to 48 kernel arguments, stored inline: scalars of at most 8 bytes, or `#[repr(C)]` structs passed
/// by value (up to 128 words in all).
pub struct KArgs {
    vals: [u64; 128],
    /// Word index where each argument starts.
    starts: [usize; 48],
    used: usize,
    n: usize,
}

impl KArgs {
    pub fn new() -> Self {
        KArgs { vals: [0; 128], starts: [0; 48], used: 0, n: 0 }
    }
    fn push(&mut self, v: u64) -> &mut Self {
        self.push_words(&[v])
    }
    fn push_words(&mut self, w: &[u64]) -> &mut Self {
        assert!(self.n < self.starts.len() && self.used + w.len() <= self.vals.len(), "too many kernel arguments");
        self.starts[self.n] = self.used;
        self.vals[self.used..self.used + w.len()].copy_from_slice(w);
        self.used += w.len();
        self.n += 1;
        self
    }
    /// A `#[repr(C)]` struct by value (its layout must match the kernel's struct; 8-byte aligned).
    pub fn by_value<T: Copy>(&mut self, v: &T) -> &mut Self {
        self.struct_arg(&StructArg::of(v))
    }
    /// A struct argument taken earlier ([`StructArg::of`]).
    pub fn struct_arg(&mut self, a: &StructArg) -> &mut Self {
        self.push_words(&a.w[..a.words])
    }
    /// The driver's `kernelParams`: a pointer to each argument's first word, valid while `self` is.
    fn pointers(&mut self) -> [*mut c_void; 48] {
        let mut ptrs: [*mut c_void; 48] = [std::ptr::null_mut(); 48];
        for i in 0..self.n {
            ptrs[i] = &mut self.vals[self.starts[i]] as *mut u64 as *mut c_void;
        }
        ptrs
    }
    pub fn ptr<T>(&mut self, p: *const T) -> &mut Self {
        self.push(p as usize as u64)
    }
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.push(v as u64)
    }
    /// 4-byte arguments sit in the low bytes of their slot (little-endian), which is what the driver copies.
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.push(v as u32 as u64)
    }
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.push(v.to_bits() as u64)
    }
}

/// A `#[repr(C)]` struct's bytes, taken to be passed by value by a launch that does not know its type
/// (a traversal hook's arguments, src/cuda/traversal.rs): at most 16 words.
#[derive(Clone, Copy, Debug)]
pub struct StructArg {
    w: [u64; 16],
    words: usize,
}

impl StructArg {
    /// `v`'s bytes (its layout must match the kernel's struct; 8-byte aligned).
    pub fn of<T: Copy>(v: &T) -> Self {
        let words = std::mem::size_of::<T>().div_ceil(8);
        let mut w = [0u64; 16];
        assert!(words <= w.len() && std::mem::align_of::<T>() <= 8, "struct argument too large");
        // SAFETY: copies size_of::<T>() bytes of a Copy value into a buffer at least that large.
        unsafe { std::ptr::copy_nonoverlapping(v as *const T as *const u8, w.as_mut_ptr() as *mut u8, std::mem::size_of::<T>()) };
        StructArg { w, words }
    }
}

impl Default for KArgs {
    fn default() -> Self {
        Self::new()
    }
}

/// Launches `f` on `stream` and checks the launch (not the execution: that would need a sync).
pub fn launch(f: CUfunction, grid: (u32, u32, u32), block: u32, args: &mut KArgs, stream: CUstream, what: &str) -> Result<()> {
    launch_smem(f, grid, block, 0, args, stream, what)
}

/// As `launch`, with `smem` bytes of dynamic shared memory (see `allow_dynamic_smem`).
#[allow(clippy::not_unsafe_ptr_arg_deref)] // driver handles (CUstream, CUfunction): opaque, passed to the driver, never dereferenced here
pub fn launch_smem(f: CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, args: &mut KArgs, stream: CUstream, what: &str) -> Result<()> {
    let mut ptrs = args.pointers();
    // SAFETY: every argument pointer points into `args`, alive for the call; the kernel signature matches
    // the packing order (each launcher below mirrors its kernel's parameter list).
    check(unsafe { (cuda()?.cuLaunchKernel)(f, grid.0, grid.1, grid.2, block, 1, 1, smem, stream, ptrs.as_mut_ptr(), std::ptr::null_mut()) }, what)
}

/// A launch choice forced from the environment for tests and benchmarks, read once into `cell`:
/// `Some(false)` when `var` is `off`, `Some(true)` when it is `on`, else `None` (the launcher's own rule).
pub fn env_choice(cell: &'static std::sync::OnceLock<Option<bool>>, var: &str, off: &str, on: &str) -> Option<bool> {
    *cell.get_or_init(|| match std::env::var(var) {
        Ok(v) if v == off => Some(false),
        Ok(v) if v == on => Some(true),
        _ => None,
    })
}

/// Programmatic dependent launch (sm_90 and newer, `KVS_PDL` unset or not "0"; read once per process):
/// whether `launch_dependent` may let a kernel start while the previous kernel of its stream drains.
pub fn pdl_enabled(cc_major: i32) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    cc_major >= 9 && *ON.get_or_init(|| std::env::var("KVS_PDL").map_or(true, |v| v != "0"))
}

/// As `launch_smem`, but with `pdl` the kernel is launched as a programmatic dependent of the previous
/// kernel in the stream: its CTAs may be scheduled while that kernel's last ones still run, hiding the
/// launch and ramp-up between the two. Only for kernels whose first statement is `KVS_GRID_WAIT()`
/// (kernels/include/common.cuh): they wait there for the previous kernel to finish and its writes to be
/// visible, before any read or write of global memory and before any early return, so the order of
/// effects is the stream's. Without `pdl` (older GPUs, `KVS_PDL=0`) it is a plain launch.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // driver handles (CUstream, CUfunction): opaque, passed to the driver, never dereferenced here
pub fn launch_dependent(pdl: bool, f: CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, args: &mut KArgs, stream: CUstream, what: &str) -> Result<()> {
    if !pdl {
        return launch_smem(f, grid, block, smem, args, stream, what);
    }
    let mut ptrs = args.pointers();
    let mut value = [0u64; 8];
    value[0] = 1; // programmaticStreamSerializationAllowed = 1 (an int in the union's first bytes)
    let attr = CUlaunchAttribute { id: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, pad: 0, value };
    let cfg = CUlaunchConfig { grid: [grid.0, grid.1, grid.2], block: [block, 1, 1], shared_mem_bytes: smem, stream, attrs: &attr, num_attrs: 1 };
    // SAFETY: as launch_smem; `cfg` and `attr` outlive the call.
    check(unsafe { (cuda()?.cuLaunchKernelEx)(&cfg, f, ptrs.as_mut_ptr(), std::ptr::null_mut()) }, what)
}

/// A grid dimension computed from sizes the caller controls: an OutOfRange error (naming `what`) where it
/// is 0 or does not fit the launch's 31 bits, instead of a truncating cast.
pub fn grid_dim(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).ok().filter(|&x| x > 0 && x < i32::MAX as u32).ok_or_else(|| crate::error::Error::new(crate::error::ErrorKind::OutOfRange, format!("{what}: grid of {v} CTAs")))
}

/// CTAs of `f` with `block` threads that fit on one multiprocessor.
pub fn occupancy(f: CUfunction, block: u32) -> Result<i32> {
    occupancy_smem(f, block, 0)
}

/// CTAs of `f` with `block` threads and `smem` bytes of dynamic shared memory per multiprocessor.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // driver handles (CUstream, CUfunction): opaque, passed to the driver, never dereferenced here
pub fn occupancy_smem(f: CUfunction, block: u32, smem: usize) -> Result<i32> {
    let mut n = 0;
    // SAFETY: out-parameter, valid function.
    check(unsafe { (cuda()?.cuOccupancyMaxActiveBlocksPerMultiprocessor)(&mut n, f, block as i32, smem) }, "cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
    Ok(n.max(1))
}

/// Lets `f` use up to `bytes` of dynamic shared memory (needed above 48 KiB).
#[allow(clippy::not_unsafe_ptr_arg_deref)] // driver handles (CUstream, CUfunction): opaque, passed to the driver, never dereferenced here
pub fn allow_dynamic_smem(f: CUfunction, bytes: usize) -> Result<()> {
    const CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: i32 = 8;
    // SAFETY: valid function handle; plain integer attribute.
    check(unsafe { (cuda()?.cuFuncSetAttribute)(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32) }, "cuFuncSetAttribute(max dynamic shared memory)")
}

#[cfg(test)]
mod tests {
    use super::{clusters_fit_one_wave, CLUSTER_CTAS};

    #[test]
    fn cluster_ctas_mirror_the_kernels_and_fill_one_wave() {
        let header = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/include/cluster_topk.cuh"));
        assert!(header.contains(&format!("#define QC_CTAS {CLUSTER_CTAS} ")), "kernels/include/cluster_topk.cuh QC_CTAS");
        // 132 SMs: 16 rows of 8 CTAs fit, 17 do not; a device reporting no SM counts as one.
        assert!(clusters_fit_one_wave(16, 132) && !clusters_fit_one_wave(17, 132));
        assert!(!clusters_fit_one_wave(1, 0) && !clusters_fit_one_wave(usize::MAX, 132));
    }
}
