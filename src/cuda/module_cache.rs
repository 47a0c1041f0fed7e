//! NVRTC compilation of the kernel sources in `kernels/` for the device's architecture, with an on-disk
//! cache of the resulting cubins so that a second process loads them without compiling.
//!
//! Cache key: FNV-1a of (source text, NVRTC options, target architecture, NVRTC version). The file name
//! carries the hash; the file itself starts with the full key text, which is compared on load, so a hash
//! collision or a truncated file means "recompile", never a wrong module. Location: `$KVS_KERNEL_CACHE`,
//! else `$XDG_CACHE_HOME/kvsparse/kernels`, else `$HOME/.cache/kvsparse/kernels`; `KVS_KERNEL_CACHE=off`
//! disables it. Writes go to a temporary file renamed into place, so concurrent processes never see half
//! a file. `KVS_LOG=1` prints one line per module (compiled or loaded, and how long it took).

use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::driver::{check_nvrtc, nvrtc, NvrtcProgram};
use crate::error::{Error, ErrorKind, Result};

static COMPILED: AtomicU64 = AtomicU64::new(0);
static FROM_DISK: AtomicU64 = AtomicU64::new(0);

/// (modules compiled by NVRTC, modules loaded from the disk cache) in this process so far.
pub fn counts() -> (u64, u64) {
    (COMPILED.load(Ordering::Relaxed), FROM_DISK.load(Ordering::Relaxed))
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in p.iter().chain(&[0xffu8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// The cache directory, or None when caching is off or no location is known.
pub fn cache_dir() -> Option<PathBuf> {
    match std::env::var("KVS_KERNEL_CACHE") {
        Ok(v) if v == "off" || v == "0" => return None,
        Ok(v) if !v.is_empty() => return Some(PathBuf::from(v)),
        _ => {}
    }
    if let Ok(x) = std::env::var("XDG_CACHE_HOME") {
        if !x.is_empty() {
            return Some(PathBuf::from(x).join("kvsparse/kernels"));
        }
    }
    std::env::var("HOME").ok().filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".cache/kvsparse/kernels"))
}

fn log_enabled() -> bool {
    std::env::var("KVS_LOG").map(|v| v != "0" && !v.is_empty()).unwrap_or(false)
}

const MAGIC: &[u8] = b"KVSCUBIN1\n";

/// Returns the cubin for `source` compiled with `options` for `arch` (e.g. "sm_90"), from the disk cache
/// when present. `name` only labels logs and files.
pub fn cubin(name: &str, source: &str, options: &[String], arch: &str) -> Result<Vec<u8>> {
    let api = nvrtc();
    let version = match api {
        Ok(a) => {
            let (mut ma, mut mi) = (0, 0);
            // SAFETY: plain out-parameters.
            unsafe { (a.nvrtcVersion)(&mut ma, &mut mi) };
            format!("{ma}.{mi}")
        }
        Err(_) => "none".to_string(),
    };
    let key = format!("{name}\n{arch}\nnvrtc {version}\n{}\n", options.join(" "));
    let hash = fnv1a(&[key.as_bytes(), source.as_bytes()]);
    let full_key = format!("{key}{hash:016x}\n");
    let path = cache_dir().map(|d| d.join(format!("{name}-{arch}-{hash:016x}.cubin")));
    let t0 = Instant::now();
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            let head_len = MAGIC.len() + full_key.len();
            if bytes.len() > head_len && &bytes[..MAGIC.len()] == MAGIC && &bytes[MAGIC.len()..head_len] == full_key.as_bytes() {
                FROM_DISK.fetch_add(1, Ordering::Relaxed);
                if log_enabled() {
                    eprintln!("kvsparse: kernel module {name} loaded from cache {} ({:.1} ms)", p.display(), t0.elapsed().as_secs_f64() * 1e3);
                }
                return Ok(bytes[head_len..].to_vec());
            }
        }
    }
    let api = api?;
    let bin = compile(api, name, source, options, arch)?;
    COMPILED.fetch_add(1, Ordering::Relaxed);
    if log_enabled() {
        eprintln!("kvsparse: kernel module {name} compiled by NVRTC {version} for {arch} ({:.1} ms)", t0.elapsed().as_secs_f64() * 1e3);
    }
    if let Some(p) = &path {
        // A cache that cannot be written only costs the next process a compile.
        let _ = store(p, &full_key, &bin);
    }
    Ok(bin)
}

fn store(path: &PathBuf, key: &str, bin: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut data = Vec::with_capacity(MAGIC.len() + key.len() + bin.len());
    data.extend_from_slice(MAGIC);
    data.extend_from_slice(key.as_bytes());
    data.extend_from_slice(bin);
    std::fs::write(&tmp, &data)?;
    std::fs::rename(&tmp, path)
}

fn compile(api: &super::driver::NvrtcApi, name: &str, source: &str, options: &[String], arch: &str) -> Result<Vec<u8>> {
    let src = CString::new(source).map_err(|_| Error::new(ErrorKind::Internal, "kernel source contains a NUL byte"))?;
    let cname = CString::new(format!("{name}.cu")).expect("no NUL in name");
    let mut opts: Vec<CString> = options.iter().map(|o| CString::new(o.as_str()).expect("no NUL in option")).collect();
    opts.push(CString::new(format!("--gpu-architecture={arch}")).expect("arch"));
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: NvrtcProgram = std::ptr::null_mut();
    // SAFETY: NVRTC calls with valid C strings and out-parameters; the program is destroyed on every path.
    unsafe {
        check_nvrtc(api, (api.nvrtcCreateProgram)(&mut prog, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()), "nvrtcCreateProgram")?;
        let rc = (api.nvrtcCompileProgram)(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let mut log_len = 0usize;
        (api.nvrtcGetProgramLogSize)(prog, &mut log_len);
        let mut log = vec![0u8; log_len.max(1)];
        (api.nvrtcGetProgramLog)(prog, log.as_mut_ptr() as *mut c_char);
        let log = String::from_utf8_lossy(&log[..log_len.saturating_sub(1)]).into_owned();
        if rc != 0 {
            (api.nvrtcDestroyProgram)(&mut prog);
            return Err(Error::new(ErrorKind::Internal, format!("NVRTC could not compile kernel module {name} ({}): {log}", options.join(" "))));
        }
        if log_enabled() && !log.trim().is_empty() {
            eprintln!("kvsparse: NVRTC log for {name}:\n{log}");
        }
        let mut size = 0usize;
        let r = (api.nvrtcGetCUBINSize)(prog, &mut size);
        if r != 0 {
            (api.nvrtcDestroyProgram)(&mut prog);
            return check_nvrtc(api, r, "nvrtcGetCUBINSize").map(|_| Vec::new());
        }
        let mut bin = vec![0u8; size];
        let r = (api.nvrtcGetCUBIN)(prog, bin.as_mut_ptr() as *mut c_char);
        (api.nvrtcDestroyProgram)(&mut prog);
        check_nvrtc(api, r, "nvrtcGetCUBIN")?;
        Ok(bin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}

/// The NVRTC compile checks (`kernel_sources_compile_with_nvrtc`, here for the shared modules and in a
/// policy's folder for a module of its own): compile a module's variants without a GPU, skipped when
/// NVRTC is not installed (unless `KVS_REQUIRE_NVRTC=1`). Catch source errors before a device run.
#[cfg(test)]
pub(crate) struct CompileCheck {
    /// `KVS_COMPILE_ONLY=<module>[:<define>]` limits the run (e.g. with KVS_PTXAS_VERBOSE=1 KVS_LOG=1).
    only: String,
    /// `KVS_COMPILE_QUICK=1`: the first variant of each module only (CI: every source file compiled once).
    quick: bool,
    done: std::cell::RefCell<std::collections::HashSet<String>>,
}

#[cfg(test)]
impl CompileCheck {
    /// None when NVRTC is not available (the check is skipped); panics then under `KVS_REQUIRE_NVRTC=1`.
    pub(crate) fn new() -> Option<Self> {
        if let Err(e) = nvrtc() {
            assert!(std::env::var("KVS_REQUIRE_NVRTC").map_or(true, |v| v != "1"), "KVS_REQUIRE_NVRTC=1: {e}");
            eprintln!("NVRTC not available, skipped");
            return None;
        }
        // KVS_DUMP_CUBIN=<dir>: keep the cubins there (cache files: the ELF follows the key text), e.g. to
        // read a kernel's SASS with cuobjdump without a GPU.
        std::env::set_var("KVS_KERNEL_CACHE", std::env::var("KVS_DUMP_CUBIN").unwrap_or("off".into()));
        let only = std::env::var("KVS_COMPILE_ONLY").unwrap_or_default();
        let quick = std::env::var("KVS_COMPILE_QUICK").is_ok_and(|v| v == "1");
        Some(CompileCheck { only, quick, done: Default::default() })
    }

    /// Compiles module `name` (its files `src`, expanded) for sm_90 with `defs` (`NAME=value` defines and
    /// `--` options); panics on an error.
    pub(crate) fn build(&self, name: &str, src: &[&super::kernel_src::KernelFile], defs: &[String]) {
        let (om, od) = self.only.split_once(':').unwrap_or((self.only.as_str(), ""));
        if !om.is_empty() && (om != name || (!od.is_empty() && !defs.iter().any(|d| d.contains(od)))) {
            return;
        }
        if self.quick && !self.done.borrow_mut().insert(name.to_string()) {
            return;
        }
        let mut opts: Vec<String> = defs.iter().map(|d| if d.starts_with("--") { d.clone() } else { format!("-D{d}") }).collect();
        opts.push("--std=c++17".into());
        if std::env::var("KVS_PTXAS_VERBOSE").is_ok() {
            opts.push("--ptxas-options=-v".into());
            eprintln!("module {name} {}", defs.join(" "));  // names the ptxas lines that follow
        }
        let text = super::kernel_src::expand(src).expect("kernel sources expand");
        cubin(name, &text, &opts, "sm_90").unwrap_or_else(|e| panic!("{name} {defs:?}: {e}"));
    }
}

/// Compiles every shared kernel module, the selection module and the traversal hooks' in the variants the
/// conformance matrix and the benchmark use (a policy's own module is checked in its folder, under the
/// same test name).
#[cfg(test)]
mod compile_tests {
    use super::super::kernel_src::{KernelFile, ATTENTION, ATTENTION_MMA, ATTENTION_PREFILL, CACHE_WRITE, FILL, MERGE, META, SLOTS, WRITE_STEP};
    use super::CompileCheck;
    use crate::policy::SELECT_MODULE as SELECT;

    #[test]
    fn kernel_sources_compile_with_nvrtc() {
        let Some(check) = CompileCheck::new() else { return };
        let build = |name: &str, src: &[&KernelFile], defs: &[String]| check.build(name, src, defs);
        for dt in 0..3 {
            build("cache_write", CACHE_WRITE, &[format!("KVS_DTYPE={dt}")]);
            for kv8 in [1, 2] {
                build("cache_write", CACHE_WRITE, &[format!("KVS_DTYPE={dt}"), format!("KV8={kv8}")]);
            }
            // A decode step's write in one launch, over every cache format.
            for kv8 in [0, 1, 2] {
                build("write_step", WRITE_STEP, &[format!("KVS_DTYPE={dt}"), format!("KV8={kv8}"), "--fmad=false".into()]);
            }
            build("fill", FILL, &[format!("KVS_DTYPE={dt}")]);
            for &(d, g) in &[(64usize, 4usize), (80, 4), (256, 8), (128, 1), (192, 8)] {
                let es = [4usize, 2, 2][dt];
                for aligned in [true, false] {
                    let s = super::super::plan::kernel_shape(g, d, es, aligned);
                    for plan in [0, 1] {
                        let defs = vec![
                            format!("KVS_DTYPE={dt}"),
                            format!("HEAD_DIM={d}"),
                            format!("GQ={}", s.gq),
                            format!("GROUP={g}"),
                            format!("LOAD_BYTES={}", s.load_bytes),
                            format!("KB={}", s.kb),
                            format!("PLAN={plan}"),
                        ];
                        build("attention", ATTENTION, &defs);
                    }
                    if d == 128 && aligned {
                        // Benchmarks' baseline without the device checks (KVS_BENCH_NO_DEVICE_CHECKS=1).
                        let defs = vec![format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GQ={}", s.gq), format!("GROUP={g}"), format!("LOAD_BYTES={}", s.load_bytes), format!("KB={}", s.kb), "PLAN=0".into(), "KVS_CHECKS=0".into()];
                        build("attention", ATTENTION, &defs);
                        // An engine with padded_batches (checks bit 2).
                        let defs = vec![format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GQ={}", s.gq), format!("GROUP={g}"), format!("LOAD_BYTES={}", s.load_bytes), format!("KB={}", s.kb), "PLAN=0".into(), "KVS_CHECKS=7".into()];
                        build("attention", ATTENTION, &defs);
                    }
                }
                let fm = "--fmad=false".to_string();
                build("select", SELECT, &[format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GROUP={g}"), fm.clone()]);
                if d == 128 {
                    // Quest's MMA scoring at its two round sizes (policy/quest.cu QM_ROUND 64 and 32).
                    for g in [4, 16] {
                        build("select", SELECT, &[format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GROUP={g}"), fm.clone()]);
                    }
                }
                if dt > 0 {
                    // The default shape for dense and plan rows (super::super::plan::DEFAULT_WARPS x DEFAULT_STAGES).
                    let (w, st) = (super::super::plan::DEFAULT_WARPS, super::super::plan::DEFAULT_STAGES);
                    for plan in [0, 1] {
                        let defs: Vec<String> = [format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GQ={g}"), format!("GROUP={g}"), format!("NWARPS={w}"), format!("NSTAGE={st}"), "L2_HINT=128".into(), format!("PLAN={plan}")].to_vec();
                        build("attention_mma", ATTENTION_MMA, &defs);
                    }
                    // FP8 caches (dense rows and plans): both formats under either query type.
                    for (kv8, plan) in [(1, 0), (2, 0), (1, 1), (2, 1)] {
                        let defs: Vec<String> = [format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GQ={g}"), format!("GROUP={g}"), format!("NWARPS={w}"), format!("NSTAGE={st}"), "L2_HINT=128".into(), format!("PLAN={plan}"), format!("KV8={kv8}")].to_vec();
                        build("attention_mma", ATTENTION_MMA, &defs);
                    }
                    // Each traversal hook in its shape: 16-bit and FP8 caches (both formats), and its
                    // measurement variant (also without the device checks, as benchmarks run it).
                    for h in crate::policy::TRAVERSAL_HOOKS {
                        let (name, src) = h.module();
                        let base: Vec<String> = [format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GQ={g}"), format!("GROUP={g}"), format!("NWARPS={}", h.warps), format!("NSTAGE={}", h.stages), "L2_HINT=128".into(), "PLAN=1".into()].to_vec();
                        build(&name, &src, &base);
                        for kv8 in [1, 2] {
                            let mut defs = base.clone();
                            defs.push(format!("KV8={kv8}"));
                            build(&name, &src, &defs);
                        }
                        if let Some(b) = h.bench_define {
                            let mut defs = base.clone();
                            defs.push(b.into());
                            build(&name, &src, &defs);
                            if d == 128 {
                                // Benchmarks' baseline without the device checks (KVS_BENCH_NO_DEVICE_CHECKS=1).
                                defs.push("KVS_CHECKS=0".into());
                                build(&name, &src, &defs);
                            }
                        }
                    }
                    // An engine with padded_batches (checks bit 2): dense and plan rows.
                    for plan in [0, 1] {
                        let defs: Vec<String> = [format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GQ={g}"), format!("GROUP={g}"), format!("NWARPS={w}"), format!("NSTAGE={st}"), "L2_HINT=128".into(), format!("PLAN={plan}"), "KVS_CHECKS=7".into()].to_vec();
                        build("attention_mma", ATTENTION_MMA, &defs);
                    }
                    // RefreshKV's full step: the plan's attention writing its logits (16-bit and FP8 caches).
                    for kv8 in [0, 1, 2] {
                        let defs: Vec<String> = [format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GQ={g}"), format!("GROUP={g}"), format!("NWARPS={w}"), format!("NSTAGE={st}"), "L2_HINT=128".into(), "PLAN=1".into(), "LOGITS=1".into(), format!("KV8={kv8}")].to_vec();
                        build("attention_mma", ATTENTION_MMA, &defs);
                    }
                    if let Some(ps) = super::super::prefill::prefill_shape(g, d, 2, true, 225 * 1024) {
                        build("attention_prefill", ATTENTION_PREFILL, &ps.defines_for(dt as i32, d, g));
                        let mut defs = ps.defines_for(dt as i32, d, g);
                        defs.push("KVS_CHECKS=7".into());
                        build("attention_prefill", ATTENTION_PREFILL, &defs);
                        // FP8 caches (tiles widened in shared memory), both formats.
                        for kv8 in [1, 2] {
                            let mut defs = ps.defines_for(dt as i32, d, g);
                            defs.push(format!("KV8={kv8}"));
                            build("attention_prefill", ATTENTION_PREFILL, &defs);
                        }
                    }
                }
            }
            build("meta", META, &[format!("KVS_DTYPE={dt}"), "KV8=0".into(), "--fmad=false".into()]);
        }
        // Key metadata over FP8 key caches (both formats).
        for kv8 in [1, 2] {
            build("meta", META, &["KVS_DTYPE=1".into(), format!("KV8={kv8}"), "--fmad=false".into()]);
        }
        build("select", SELECT, &["KVS_DTYPE=2".into(), "HEAD_DIM=128".into(), "GROUP=16".into(), "--fmad=false".into()]);
        // The selection kernels over FP8 caches (kv_load.cuh), both formats.
        for &(dt, d, g) in &[(2, 128usize, 4usize), (1, 64, 8), (2, 256, 8)] {
            for kv8 in [1, 2] {
                build("select", SELECT, &[format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GROUP={g}"), format!("KV8={kv8}"), "--fmad=false".into()]);
            }
        }
        // The prefill kernel at the Llama-8B shape (and GQA 8, f16).
        for &(dt, d, g) in &[(2, 128usize, 4usize), (1, 128, 8)] {
            let ps = super::super::prefill::prefill_shape(g, d, 2, true, 225 * 1024).expect("prefill shape");
            build("attention_prefill", ATTENTION_PREFILL, &ps.defines_for(dt, d, g));
        }
        build("merge", MERGE, &[]);
        build("slots", SLOTS, &[]);
    }
}
