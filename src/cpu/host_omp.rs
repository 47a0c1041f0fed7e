//! The host process's OpenMP team as the CPU pool's threads, when the process already has one loaded.
//!
//! Why: inside PyTorch (vLLM's CPU worker, SGLang) the GEMMs between two attention calls run on PyTorch's
//! OpenMP team, whose threads spin for a while after each parallel region (libgomp: up to 300,000 spins).
//! Our own workers then compete with those spinning threads for the same cores. Measured inside vLLM on the
//! 2-vCPU VM (SmolLM2 fp32, 7K prompt, decode): with our own worker, PyTorch's OpenMP worker thread was
//! busy 81% of the time and ours got 30% of a core; our attention call took 1,297-1,306 µs per layer, on
//! PyTorch's team 717-720 µs in the same run (decode 1.42x vLLM's own attention there instead of 1.03x;
//! docs/perf.md). Running our items on the host's team uses the threads that are already awake.
//!
//! How: `GOMP_parallel` (the GNU OpenMP entry point, also exported by LLVM's and Intel's runtimes) of the
//! runtime the host itself uses, already loaded (opened with RTLD_NOLOAD so nothing new is loaded). Which
//! one matters: vLLM's process also maps sentencepiece's bundled libgomp, and a team of that runtime is a
//! second set of threads (measured: 3.1-3.2 ms per call, three busy threads on two cores).
//! `KVS_HOST_OMP=0` turns it off; a process without an OpenMP runtime uses the spin pool.

use std::ffi::{c_uint, c_void, CString};

type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type OmpGetMaxThreads = unsafe extern "C" fn() -> std::ffi::c_int;

/// A loaded OpenMP runtime's `GOMP_parallel` and `omp_get_max_threads`.
pub struct HostOmp {
    parallel: GompParallel,
    max_threads: OmpGetMaxThreads,
    /// The runtime's file (tests check which one was found).
    pub path: String,
}

// SAFETY: a function pointer into a loaded library that is never unloaded (RTLD_NOLOAD handle kept open).
unsafe impl Send for HostOmp {}
unsafe impl Sync for HostOmp {}

/// Runtimes whose `GOMP_parallel` we call, by file-name prefix.
const RUNTIMES: [&str; 3] = ["libgomp", "libiomp5", "libomp"];

impl HostOmp {
    /// The OpenMP runtime whose team the host's own parallel work runs on, unless `KVS_HOST_OMP=0` or none
    /// can be told: PyTorch's (the runtime `libtorch_cpu` resolves `GOMP_parallel` to), else the only
    /// runtime loaded. A process can hold several (in vLLM, sentencepiece bundles its own libgomp beside
    /// PyTorch's); a team of another runtime than the host's adds threads that compete with the host's
    /// spinning ones (measured: 3.1 ms per call instead of 0.9 ms), so with several and no PyTorch, none.
    pub fn detect() -> Option<HostOmp> {
        if std::env::var("KVS_HOST_OMP").is_ok_and(|v| v.trim() == "0") {
            return None;
        }
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let mut runtimes: Vec<&str> = Vec::new();
        let mut torch = None;
        for p in mapped_files(&maps) {
            if is_runtime(p) && !runtimes.contains(&p) {
                runtimes.push(p);
            }
            if torch.is_none() && file_name(p).starts_with("libtorch_cpu.so") {
                torch = Some(p);
            }
        }
        if let Some(t) = torch {
            return runtime_used_by(t).and_then(|p| Self::open(&p));
        }
        match runtimes.as_slice() {
            [only] => Self::open(only),
            _ => None,
        }
    }

    #[cfg(unix)]
    fn open(path: &str) -> Option<HostOmp> {
        let h = already_loaded(path)?;
        let sym = |name: &str| -> Option<*mut c_void> {
            let c = CString::new(name).ok()?;
            // SAFETY: dlsym on a valid handle.
            let f = unsafe { libc::dlsym(h, c.as_ptr()) };
            (!f.is_null()).then_some(f)
        };
        let (par, max) = (sym("GOMP_parallel")?, sym("omp_get_max_threads")?);
        // SAFETY: both symbols have these C signatures in every runtime that exports them (GCC's ABI since
        // 4.9, implemented by LLVM's and Intel's runtimes for compatibility; omp_get_max_threads is OpenMP's).
        unsafe {
            Some(HostOmp {
                parallel: std::mem::transmute::<*mut c_void, GompParallel>(par),
                max_threads: std::mem::transmute::<*mut c_void, OmpGetMaxThreads>(max),
                path: path.to_string(),
            })
        }
    }

    #[cfg(not(unix))]
    fn open(_path: &str) -> Option<HostOmp> {
        None
    }

    /// The host's thread count for a parallel region started by the calling thread (PyTorch's
    /// `torch.get_num_threads()`; vLLM's CPU worker pins those threads to its cores).
    pub fn team_size(&self) -> usize {
        // SAFETY: a plain query of the runtime's settings for the calling thread.
        (unsafe { (self.max_threads)() }).max(1) as usize
    }

    /// Runs `f` once on each of `threads` threads of the calling thread's OpenMP team (the caller is one
    /// of them) and returns when all have returned. `f` must not unwind (a panic aborts the process).
    pub fn run_on_team(&self, threads: usize, f: &(dyn Fn() + Sync)) {
        extern "C" fn trampoline(data: *mut c_void) {
            // SAFETY: `data` is the `&&dyn Fn` below, alive until GOMP_parallel returns.
            let f = unsafe { &*(data as *const &(dyn Fn() + Sync)) };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                std::process::abort(); // never unwind into the OpenMP runtime
            }
        }
        let mut fref: &(dyn Fn() + Sync) = f;
        let n = threads.clamp(1, c_uint::MAX as usize) as c_uint;
        // SAFETY: GOMP_parallel runs `trampoline(data)` on the team's threads and joins them before returning.
        unsafe { (self.parallel)(trampoline, &mut fref as *mut &(dyn Fn() + Sync) as *mut c_void, n, 0) };
    }
}

/// A handle to the library at `path` if the process has already loaded it (nothing is loaded, no
/// constructors run); never closed, so what it resolves stays valid.
#[cfg(unix)]
fn already_loaded(path: &str) -> Option<*mut c_void> {
    let c = CString::new(path).ok()?;
    // SAFETY: RTLD_NOLOAD only returns a handle to a library that is already loaded.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    (!h.is_null()).then_some(h)
}

/// The file of the OpenMP runtime that the loaded library `lib` binds `GOMP_parallel` to (its own dependency
/// scope, as its calls resolve), if it binds one.
#[cfg(unix)]
fn runtime_used_by(lib: &str) -> Option<String> {
    let h = already_loaded(lib)?;
    let name = CString::new("GOMP_parallel").ok()?;
    // SAFETY: dlsym/dladdr on a valid handle and the address it returned; dli_fname points into the loader's
    // tables, valid while the library stays loaded (it is: the handle is not closed).
    unsafe {
        let f = libc::dlsym(h, name.as_ptr());
        if f.is_null() {
            return None;
        }
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(f, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let path = std::ffi::CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned();
        is_runtime(&path).then_some(path)
    }
}

#[cfg(not(unix))]
fn runtime_used_by(_lib: &str) -> Option<String> {
    None
}

/// The files mapped into the process, one entry per mapping, from the text of /proc/self/maps.
fn mapped_files(maps: &str) -> impl Iterator<Item = &str> {
    maps.lines().filter_map(|l| l.split_whitespace().nth(5))
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn is_runtime(path: &str) -> bool {
    let name = file_name(path);
    RUNTIMES.iter().any(|r| name.starts_with(r) && name.contains(".so"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn recognises_the_runtimes_by_file_name() {
        assert!(is_runtime("/x/torch/lib/libgomp-a34b3233.so.1"));
        assert!(is_runtime("/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"));
        assert!(is_runtime("/opt/intel/lib/libiomp5.so"));
        assert!(!is_runtime("/usr/lib/libgompish.a"));
        assert!(!is_runtime("/usr/lib/libc.so.6"));
    }

    /// The file of the first mapped library whose name starts with `prefix`.
    fn mapped(prefix: &str) -> Option<String> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let found = mapped_files(&maps).find(|p| file_name(p).starts_with(prefix)).map(str::to_string);
        found
    }

    /// Loads the system's libgomp into this test process (CI's machines have it with the C toolchain);
    /// false when there is none, which `KVS_REQUIRE_GOMP=1` (CI) turns into a failure instead of a skip.
    pub(crate) fn load_system_libgomp() -> bool {
        let loaded = ["libgomp.so.1", "libgomp.so"].iter().any(|name| {
            let c = CString::new(*name).unwrap();
            // SAFETY: loads a shared library by name; kept loaded for the process's life.
            !unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null()
        });
        assert!(loaded || std::env::var("KVS_REQUIRE_GOMP").is_err(), "KVS_REQUIRE_GOMP is set but libgomp could not be loaded");
        loaded
    }

    #[test]
    fn finds_the_runtime_a_library_binds_gomp_parallel_to() {
        if !load_system_libgomp() {
            eprintln!("no libgomp on this machine: runtime lookup not tested");
            return;
        }
        let gomp = mapped("libgomp").expect("libgomp is mapped after dlopen");
        // The loader names it by the path it was loaded under (a symlink here), the maps by the file.
        let found = runtime_used_by(&gomp).expect("libgomp binds its own GOMP_parallel");
        assert_eq!(std::fs::canonicalize(&found).unwrap(), std::fs::canonicalize(&gomp).unwrap());
        assert!(HostOmp::open(&found).is_some(), "{found}");
        // libc neither exports GOMP_parallel nor depends on a runtime that does.
        let libc_so = mapped("libc.so").expect("libc is mapped");
        assert_eq!(runtime_used_by(&libc_so), None);
        // Not loaded: RTLD_NOLOAD refuses it, nothing is loaded.
        assert_eq!(runtime_used_by("/nonexistent/libtorch_cpu.so"), None);
    }
}
