//! `kvsparse conformance --lib PATH`: the suite through the C ABI of a library loaded with `dlopen` (another
//! build of kvsparse, or any library that implements `include/kvsparse.h`). The fixtures are the same as in
//! process; tensors cross as DLPack descriptors built from the same views, statuses come back as codes plus
//! the library's own `kvs_last_error()` text, and `KVS_ERR_UNSUPPORTED` makes a case unsupported, not failed.

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use super::fixture::{run_on_engine, Fixture};
use super::{judge, Api, CaseResult, CaseSpec};
use kvsparse::config::EngineConfig;
use kvsparse::engine::{CacheWriteArgs, ForwardArgs};
use kvsparse::error::{Error, ErrorKind, Result};
use kvsparse::ffi::dlpack::{device_to_dl, dtype_to_dl, DLTensor};
use kvsparse::ffi::types::{kvs_cache_write_args, kvs_dtype, kvs_engine_config, kvs_forward_args, kvs_stats};
use kvsparse::policy::top_p;
use kvsparse::stats::Counters;
use kvsparse::tensor::{DType, TensorRef};

type Handle = *mut c_void;

/// The entry points the suite uses, resolved from the library. Statuses are read as plain `i32` (a foreign
/// library may return codes this build does not know).
struct Fns {
    version: unsafe extern "C" fn() -> u32,
    last_error: unsafe extern "C" fn() -> *const c_char,
    status_name: unsafe extern "C" fn(i32) -> *const c_char,
    create: unsafe extern "C" fn(*const kvs_engine_config, *mut Handle) -> i32,
    destroy: unsafe extern "C" fn(Handle),
    cache_write: unsafe extern "C" fn(Handle, *const kvs_cache_write_args) -> i32,
    forward: unsafe extern "C" fn(Handle, *const kvs_forward_args) -> i32,
    release: unsafe extern "C" fn(Handle, u64) -> i32,
    /// `kvs_engine_set_kv_scales`, absent from libraries built before FP8 caches.
    set_kv_scales: Option<unsafe extern "C" fn(Handle, i32, f32, f32) -> i32>,
}

/// A library loaded for the lifetime of the process (never closed: engines may point into it).
pub struct Lib {
    pub path: PathBuf,
    f: Fns,
}

unsafe fn sym<T>(h: Handle, name: &str) -> std::result::Result<T, String> {
    let c = CString::new(name).expect("symbol name");
    let p = libc::dlsym(h, c.as_ptr());
    if p.is_null() {
        return Err(format!("symbol {name} not found"));
    }
    // SAFETY: the caller names a symbol of the C ABI whose Rust type is T (a function pointer).
    Ok(std::mem::transmute_copy::<*mut c_void, T>(&p))
}

impl Lib {
    /// Loads the library and resolves the C ABI; refuses a library of another ABI version.
    pub fn open(path: &Path) -> std::result::Result<Lib, String> {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| "library path contains a NUL byte".to_string())?;
        // SAFETY: dlopen/dlsym with valid C strings; the handle is never closed.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if h.is_null() {
                let msg = CStr::from_ptr(libc::dlerror()).to_string_lossy().into_owned();
                return Err(format!("cannot load {}: {msg}", path.display()));
            }
            let f = Fns {
                version: sym(h, "kvs_version")?,
                last_error: sym(h, "kvs_last_error")?,
                status_name: sym(h, "kvs_status_name")?,
                create: sym(h, "kvs_engine_create")?,
                destroy: sym(h, "kvs_engine_destroy")?,
                cache_write: sym(h, "kvs_cache_write")?,
                forward: sym(h, "kvs_attention_forward")?,
                release: sym(h, "kvs_sequence_release")?,
                set_kv_scales: sym(h, "kvs_engine_set_kv_scales").ok(),
            };
            let lib = Lib { path: path.to_path_buf(), f };
            let v = lib.abi_version();
            if v != kvsparse::ABI_VERSION {
                return Err(format!("{} has C ABI version {v}; this suite speaks version {}", path.display(), kvsparse::ABI_VERSION));
            }
            Ok(lib)
        }
    }

    pub fn abi_version(&self) -> u32 {
        // SAFETY: no arguments, never fails.
        unsafe { (self.f.version)() }
    }

    /// Turns a status into `Ok` or an error carrying the status name and the library's message.
    fn check(&self, status: i32, what: &str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: both return NUL-terminated strings owned by the library (never NULL per the ABI).
        let (name, msg) = unsafe { (CStr::from_ptr((self.f.status_name)(status)).to_string_lossy(), CStr::from_ptr((self.f.last_error)()).to_string_lossy()) };
        let kind = match status {
            1 => ErrorKind::InvalidArgument,
            2 => ErrorKind::InvalidShape,
            3 => ErrorKind::InvalidDtype,
            4 => ErrorKind::OutOfRange,
            5 => ErrorKind::Unsupported,
            6 => ErrorKind::UnknownSequence,
            7 => ErrorKind::OutOfMemory,
            8 => ErrorKind::Device,
            _ => ErrorKind::Internal,
        };
        Err(Error { kind, message: format!("{what}: {name}: {msg}") })
    }
}

/// One engine of a loaded library; destroyed on drop.
pub struct LibEngine<'a> {
    lib: &'a Lib,
    h: Handle,
}

impl<'a> LibEngine<'a> {
    pub fn create(lib: &'a Lib, cfg: &EngineConfig) -> Result<Self> {
        let policy = CString::new(cfg.policy.as_str()).map_err(|_| Error { kind: ErrorKind::InvalidArgument, message: "policy contains a NUL byte".into() })?;
        let dev = device_to_dl(cfg.device);
        let dtype = match cfg.dtype {
            DType::F32 => kvs_dtype::KVS_DTYPE_FLOAT32,
            DType::BF16 => kvs_dtype::KVS_DTYPE_BFLOAT16,
            _ => kvs_dtype::KVS_DTYPE_FLOAT16,
        };
        // Filled here rather than by the library's kvs_engine_config_init, so that a library built from a
        // newer header (larger struct) cannot write past this one; struct_size says which version we speak.
        let c = kvs_engine_config {
            struct_size: std::mem::size_of::<kvs_engine_config>() as u32,
            device_type: dev.device_type,
            device_id: dev.device_id,
            num_layers: cfg.num_layers as u32,
            num_q_heads: cfg.num_q_heads as u32,
            num_kv_heads: cfg.num_kv_heads as u32,
            head_dim: cfg.head_dim as u32,
            block_size: cfg.block_size as u32,
            num_blocks: cfg.num_blocks as u32,
            dtype,
            num_threads: cfg.num_threads as u32,
            max_state_bytes: cfg.max_state_bytes,
            policy: policy.as_ptr(),
            validate: match cfg.validate {
                kvsparse::config::Validate::Deferred => kvsparse::ffi::kvs_validate::KVS_VALIDATE_DEFERRED,
                kvsparse::config::Validate::Sync => kvsparse::ffi::kvs_validate::KVS_VALIDATE_SYNC,
            },
            cache_dtype: match cfg.cache_dtype {
                DType::F8E4M3 => kvsparse::ffi::kvs_cache_dtype::KVS_CACHE_DTYPE_FP8_E4M3,
                DType::F8E5M2 => kvsparse::ffi::kvs_cache_dtype::KVS_CACHE_DTYPE_FP8_E5M2,
                _ => kvsparse::ffi::kvs_cache_dtype::KVS_CACHE_DTYPE_AUTO,
            },
            padded_batches: cfg.padded_batches as u32,
        };
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: valid config and out-pointer; the policy string outlives the call.
        lib.check(unsafe { (lib.f.create)(&c, &mut h) }, "kvs_engine_create")?;
        Ok(LibEngine { lib, h })
    }
}

impl Drop for LibEngine<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from kvs_engine_create and no call is in flight.
        unsafe { (self.lib.f.destroy)(self.h) }
    }
}

/// A DLTensor with its own shape and stride arrays (boxed so the pointers stay put).
struct Dl {
    shape: Vec<i64>,
    strides: Vec<i64>,
    t: DLTensor,
}

fn dl(t: &TensorRef) -> Box<Dl> {
    let mut b = Box::new(Dl {
        shape: t.shape().to_vec(),
        strides: t.strides().to_vec(),
        t: DLTensor {
            data: t.data as *mut c_void,
            device: device_to_dl(t.device),
            ndim: t.ndim() as i32,
            dtype: dtype_to_dl(t.dtype),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
    });
    b.t.shape = b.shape.as_mut_ptr();
    b.t.strides = b.strides.as_mut_ptr();
    b
}

fn ptr(d: &Option<Box<Dl>>) -> *const DLTensor {
    d.as_ref().map_or(std::ptr::null(), |d| &d.t)
}

impl Api for LibEngine<'_> {
    fn cache_write(&self, a: &CacheWriteArgs) -> Result<()> {
        let ts = [&a.key, &a.value, &a.key_cache, &a.value_cache, &a.slot_mapping].map(dl);
        let c = kvs_cache_write_args {
            struct_size: std::mem::size_of::<kvs_cache_write_args>() as u32,
            layer: a.layer as u32,
            key: &ts[0].t,
            value: &ts[1].t,
            key_cache: &ts[2].t,
            value_cache: &ts[3].t,
            slot_mapping: &ts[4].t,
            stream: a.stream as *mut c_void,
        };
        // SAFETY: every descriptor points at live views for the duration of the call.
        self.lib.check(unsafe { (self.lib.f.cache_write)(self.h, &c) }, "kvs_cache_write")
    }

    fn attention_forward(&self, a: &ForwardArgs) -> Result<Counters> {
        let ts = [&a.query, &a.key_cache, &a.value_cache, &a.block_table, &a.seq_lens, &a.query_start_loc, &a.out].map(dl);
        let (ids, lse) = (a.seq_ids.as_ref().map(dl), a.lse.as_ref().map(dl));
        let mut st = kvs_stats { struct_size: std::mem::size_of::<kvs_stats>() as u32, ..Default::default() };
        let c = kvs_forward_args {
            struct_size: std::mem::size_of::<kvs_forward_args>() as u32,
            layer: a.layer as u32,
            query: &ts[0].t,
            key_cache: &ts[1].t,
            value_cache: &ts[2].t,
            block_table: &ts[3].t,
            seq_lens: &ts[4].t,
            query_start_loc: &ts[5].t,
            seq_ids: ptr(&ids),
            out: &ts[6].t,
            lse: ptr(&lse),
            scale: a.scale,
            sliding_window: a.sliding_window,
            softcap: a.softcap,
            max_query_len: a.max_query_len,
            max_seq_len: a.max_seq_len,
            stream: a.stream as *mut c_void,
            call_stats: &mut st,
        };
        // SAFETY: as for cache_write; `st` outlives the call.
        self.lib.check(unsafe { (self.lib.f.forward)(self.h, &c) }, "kvs_attention_forward")?;
        let mut c = Counters {
            calls: st.calls,
            prefill_tokens: st.prefill_tokens,
            decode_rows: st.decode_rows,
            policy_rows: st.policy_rows,
            blocks_eligible: st.blocks_eligible,
            blocks_visited: st.blocks_visited,
            blocks_skipped_termination: st.blocks_skipped_termination,
            kv_bytes_read: st.kv_bytes_read,
            ..Default::default()
        };
        (c[top_p::CANDIDATES], c[top_p::KEPT]) = (st.top_p_candidates, st.top_p_kept);
        Ok(c)
    }

    fn release_sequence(&self, seq_id: u64) -> Result<()> {
        // SAFETY: plain call on a live handle.
        self.lib.check(unsafe { (self.lib.f.release)(self.h, seq_id) }, "kvs_sequence_release")
    }

    fn set_kv_scales(&self, layer: usize, k_scale: f32, v_scale: f32) -> Result<()> {
        let Some(f) = self.lib.f.set_kv_scales else {
            return Err(Error { kind: ErrorKind::Unsupported, message: "the library has no kvs_engine_set_kv_scales (no FP8 caches)".into() });
        };
        // SAFETY: plain call on a live handle.
        self.lib.check(unsafe { f(self.h, layer as i32, k_scale, v_scale) }, "kvs_engine_set_kv_scales")
    }
}

/// One case through the library's C ABI, judged like the in-process run.
pub fn run_case_lib(lib: &Lib, spec: &CaseSpec, seed: u64) -> CaseResult {
    let mut f = Fixture::new(spec, seed);
    let res = LibEngine::create(lib, &f.engine_config()).and_then(|e| run_on_engine(&e, &mut f));
    match res {
        Ok(outs) => judge(&f, &outs, seed),
        Err(e) => CaseResult::refused(&spec.name, seed, &e),
    }
}
