//! The stable C ABI (version 0). Every exported function goes through [`guard::guard`], so no panic
//! crosses the boundary and every failure leaves a message for `kvs_last_error`.
//!
//! Thread safety: an engine may be used from several threads at once (for different sequences); the
//! calls synchronise internally. Ownership: tensors are borrowed for the duration of a call; the engine
//! handle is owned by the caller between `kvs_engine_create` and `kvs_engine_destroy`.

pub mod dlpack;
pub mod guard;
pub mod types;

use std::ffi::CStr;
use std::os::raw::c_char;

use dlpack::{tensor, tensor_opt, DLTensor};
use guard::{engine_ref, guard};
pub use types::*;

use crate::config::EngineConfig;
use crate::args::{CacheWriteArgs, ForwardArgs, MergeArgs};
use crate::engine::Engine;
use crate::error::Result;
use crate::stats::Counters;
use crate::tensor::DType;
use crate::{bail, ensure};

/// Checks a caller-provided struct pointer and its `struct_size`.
unsafe fn args_ref<'a, T>(name: &str, p: *const T, struct_size: impl Fn(&T) -> u32) -> Result<&'a T> {
    ensure!(!p.is_null(), InvalidArgument, "{name} is NULL");
    let a = &*p;
    let have = struct_size(a) as usize;
    ensure!(
        have >= std::mem::size_of::<T>(),
        InvalidArgument,
        "{name}.struct_size is {have}, expected at least {} (set it to sizeof({name}))",
        std::mem::size_of::<T>()
    );
    Ok(a)
}

/// ABI version of this library (0). Compare with `KVS_ABI_VERSION` from the header you compiled with.
/// Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn kvs_version() -> u32 {
    crate::ABI_VERSION
}

/// Message of the calling thread's last failed kvsparse call; never NULL. The string is owned by
/// kvsparse and stays valid until this thread's next failing call.
#[no_mangle]
pub extern "C" fn kvs_last_error() -> *const c_char {
    guard::last_error_ptr()
}

/// Fills `config` with defaults (CPU, dense, float16, all cores) and the right `struct_size`.
/// The model fields (layers, heads, head_dim, block_size) must still be set.
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_config_init(config: *mut kvs_engine_config) -> kvs_status {
    guard(|| {
        ensure!(!config.is_null(), InvalidArgument, "config is NULL");
        config.write(kvs_engine_config {
            struct_size: std::mem::size_of::<kvs_engine_config>() as u32,
            device_type: dlpack::KDL_CPU,
            device_id: 0,
            num_layers: 0,
            num_q_heads: 0,
            num_kv_heads: 0,
            head_dim: 0,
            block_size: 16,
            num_blocks: 0,
            dtype: kvs_dtype::KVS_DTYPE_FLOAT16,
            num_threads: 0,
            max_state_bytes: 0,
            policy: std::ptr::null(),
            validate: kvs_validate::KVS_VALIDATE_DEFERRED,
            cache_dtype: kvs_cache_dtype::KVS_CACHE_DTYPE_AUTO,
            padded_batches: 0,
        });
        Ok(())
    })
}

/// Bytes of `kvs_engine_config` before `validate` (the struct as callers compiled before it was appended).
const CONFIG_SIZE_BEFORE_VALIDATE: usize = std::mem::offset_of!(kvs_engine_config, validate);

/// The caller's config, `struct_size` bytes of it (at least the fields before `validate`); fields it does
/// not have keep their defaults. Returns it with `validate` and `cache_dtype` decoded (their raw values
/// checked before Rust reads the enums; `None` = the engine's dtype).
unsafe fn config_prefix(config: *const kvs_engine_config) -> Result<(kvs_engine_config, crate::config::Validate, Option<DType>)> {
    let size = (*config).struct_size as usize;
    ensure!(
        size >= CONFIG_SIZE_BEFORE_VALIDATE,
        InvalidArgument,
        "kvs_engine_config.struct_size is {size}, expected at least {CONFIG_SIZE_BEFORE_VALIDATE} (set it to sizeof(kvs_engine_config))"
    );
    let full = std::mem::size_of::<kvs_engine_config>();
    let mut c = std::mem::MaybeUninit::<kvs_engine_config>::zeroed();
    std::ptr::copy_nonoverlapping(config as *const u8, c.as_mut_ptr() as *mut u8, size.min(full));
    let raw = (std::ptr::addr_of!((*c.as_ptr()).validate) as *const i32).read_unaligned();
    let validate = match raw {
        0 => crate::config::Validate::Deferred,
        1 => crate::config::Validate::Sync,
        v => bail!(InvalidArgument, "config.validate {v} is not a kvs_validate (0 = deferred, 1 = sync)"),
    };
    let raw = (std::ptr::addr_of!((*c.as_ptr()).cache_dtype) as *const i32).read_unaligned();
    let cache_dtype = match raw {
        0 => None,
        1 => Some(DType::F8E4M3),
        2 => Some(DType::F8E5M2),
        v => bail!(InvalidDtype, "config.cache_dtype {v} is not a kvs_cache_dtype (0 = auto, 1 = fp8_e4m3, 2 = fp8_e5m2)"),
    };
    // SAFETY: every byte is initialised (zeroes where the caller's struct ended; zero is a valid value of
    // every field, the enums included) and the enums' raw values were checked.
    Ok((c.assume_init(), validate, cache_dtype))
}

unsafe fn config_from_c(c: &kvs_engine_config) -> Result<EngineConfig> {
    let policy = if c.policy.is_null() {
        String::new()
    } else {
        match CStr::from_ptr(c.policy).to_str() {
            Ok(s) => s.to_string(),
            Err(_) => bail!(InvalidArgument, "config.policy is not valid UTF-8"),
        }
    };
    let dtype = match c.dtype {
        kvs_dtype::KVS_DTYPE_FLOAT32 => DType::F32,
        kvs_dtype::KVS_DTYPE_FLOAT16 => DType::F16,
        kvs_dtype::KVS_DTYPE_BFLOAT16 => DType::BF16,
    };
    Ok(EngineConfig {
        device: dlpack::device_from_dl(c.device_type, c.device_id)?,
        num_layers: c.num_layers as usize,
        num_q_heads: c.num_q_heads as usize,
        num_kv_heads: c.num_kv_heads as usize,
        head_dim: c.head_dim as usize,
        block_size: c.block_size as usize,
        num_blocks: c.num_blocks as usize,
        dtype,
        cache_dtype: dtype,
        policy,
        num_threads: c.num_threads as usize,
        max_state_bytes: c.max_state_bytes,
        validate: crate::config::Validate::Deferred,
        padded_batches: match c.padded_batches {
            0 => false,
            1 => true,
            v => bail!(InvalidArgument, "config.padded_batches {v} must be 0 or 1"),
        },
    })
}

/// The engine config behind a C pointer, checked as far as reading it needs.
unsafe fn config_arg(config: *const kvs_engine_config) -> Result<EngineConfig> {
    ensure!(!config.is_null(), InvalidArgument, "config is NULL");
    // The dtype field is an enum: check its raw value before Rust reads it as one.
    let raw_dtype = std::ptr::addr_of!((*config).dtype) as *const i32;
    let dt = raw_dtype.read_unaligned();
    ensure!((0..=2).contains(&dt), InvalidDtype, "config.dtype {dt} is not a kvs_dtype");
    let (c, validate, cache_dtype) = config_prefix(config)?;
    let mut cfg = config_from_c(&c)?;
    cfg.validate = validate;
    cfg.cache_dtype = cache_dtype.unwrap_or(cfg.dtype);
    Ok(cfg)
}

/// Checks a configuration as `kvs_engine_create` would (geometry, dtype, policy spec, and for a CUDA device
/// whether the CUDA backend runs the policy) without creating anything or touching any device: no GPU
/// context, no thread, no allocation beyond the check. `KVS_OK` means only that creation would not refuse
/// the configuration itself (it can still fail for lack of a device or memory). For serving engines that
/// must report a bad configuration in a process that cannot create the engine (e.g. before forking workers).
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_config_check(config: *const kvs_engine_config) -> kvs_status {
    guard(|| {
        Engine::check_config(&config_arg(config)?)?;
        Ok(())
    })
}

/// Creates an engine. On success `*out` owns a new engine (free it with `kvs_engine_destroy`); on failure
/// `*out` is set to NULL (when `out` is not NULL) and nothing is allocated. The config is read during the
/// call only. A bad configuration (head size, block size, GQA ratio, policy spec, device) fails here.
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_create(config: *const kvs_engine_config, out: *mut *mut kvs_engine) -> kvs_status {
    guard(|| {
        ensure!(!out.is_null(), InvalidArgument, "out is NULL");
        out.write(std::ptr::null_mut());
        let engine = Engine::new(config_arg(config)?)?;
        out.write(Box::into_raw(Box::new(kvs_engine { inner: engine })));
        Ok(())
    })
}

/// Destroys an engine and all its per-sequence state. NULL is a no-op. No call on this engine may be in
/// flight or follow.
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_destroy(engine: *mut kvs_engine) {
    if !engine.is_null() {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(Box::from_raw(engine))));
    }
}

/// Writes new K/V rows into the layer's caches by slot mapping. Every slot is validated before any byte
/// is written (a CUDA engine checks them on the device first: a bad slot writes nothing and surfaces at
/// `kvs_engine_check`, or from this call with `validate = KVS_VALIDATE_SYNC`). Thread-safe with respect
/// to other sequences' calls.
#[no_mangle]
pub unsafe extern "C" fn kvs_cache_write(engine: *mut kvs_engine, args: *const kvs_cache_write_args) -> kvs_status {
    guard(|| {
        let e = engine_ref(engine)?;
        let a = args_ref("kvs_cache_write_args", args, |a| a.struct_size)?;
        e.cache_write(&CacheWriteArgs {
            layer: a.layer as usize,
            key: tensor("key", a.key)?,
            value: tensor("value", a.value)?,
            key_cache: tensor("key_cache", a.key_cache)?,
            value_cache: tensor("value_cache", a.value_cache)?,
            slot_mapping: tensor("slot_mapping", a.slot_mapping)?,
            stream: a.stream,
        })
    })
}

/// Causal paged attention for a varlen batch of one layer; decode rows of non-dense layers go through the
/// engine's policy. Validates everything (shapes, dtypes, block ids, lengths) before writing `out`/`lse`;
/// on failure nothing is written. A CUDA engine checks the host-known parts (shapes, dtypes, devices,
/// seq_ids for a stateful policy) here and the device-resident contents (block ids, lengths, query
/// offsets) in its kernels: an offending row's `out` and `lse` are NaN and the fault surfaces at
/// `kvs_engine_check` (or from this call with `validate = KVS_VALIDATE_SYNC`); see docs/abi.md. Per-call
/// counters go to `args->call_stats` when it is not NULL (on a CUDA engine: `calls` only, unless
/// `validate = KVS_VALIDATE_SYNC`, where the call waits and they are read back from the device).
#[no_mangle]
pub unsafe extern "C" fn kvs_attention_forward(engine: *mut kvs_engine, args: *const kvs_forward_args) -> kvs_status {
    guard(|| {
        let e = engine_ref(engine)?;
        let a = args_ref("kvs_forward_args", args, |a| a.struct_size)?;
        if !a.call_stats.is_null() {
            ensure!((*a.call_stats).struct_size >= 8, InvalidArgument, "call_stats.struct_size must be set (to sizeof(kvs_stats))");
        }
        let c = e.attention_forward(&ForwardArgs {
            layer: a.layer as usize,
            query: tensor("query", a.query)?,
            key_cache: tensor("key_cache", a.key_cache)?,
            value_cache: tensor("value_cache", a.value_cache)?,
            block_table: tensor("block_table", a.block_table)?,
            seq_lens: tensor("seq_lens", a.seq_lens)?,
            query_start_loc: tensor("query_start_loc", a.query_start_loc)?,
            seq_ids: tensor_opt("seq_ids", a.seq_ids)?,
            out: tensor("out", a.out)?,
            lse: tensor_opt("lse", a.lse)?,
            scale: a.scale,
            sliding_window: a.sliding_window,
            softcap: a.softcap,
            max_query_len: a.max_query_len,
            max_seq_len: a.max_seq_len,
            stream: a.stream,
        })?;
        if !a.call_stats.is_null() {
            write_stats(a.call_stats, &c, None);
        }
        Ok(())
    })
}

/// Merges two partial attention states exactly (see `kvs_merge_args`). Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn kvs_merge_states(engine: *mut kvs_engine, args: *const kvs_merge_args) -> kvs_status {
    guard(|| {
        let e = engine_ref(engine)?;
        let a = args_ref("kvs_merge_args", args, |a| a.struct_size)?;
        e.merge_states(&MergeArgs {
            out_a: tensor("out_a", a.out_a)?,
            lse_a: tensor("lse_a", a.lse_a)?,
            out_b: tensor("out_b", a.out_b)?,
            lse_b: tensor("lse_b", a.lse_b)?,
            out: tensor("out", a.out)?,
            lse_out: tensor_opt("lse_out", a.lse_out)?,
            stream: a.stream,
        })
    })
}

/// Frees the per-sequence state of `seq_id` (call when a request finishes or is preempted).
/// Returns `KVS_ERR_UNKNOWN_SEQUENCE` for an id the engine does not hold (never named in a forward call's
/// `seq_ids`, or released already). A CUDA engine registers ids on the device and synchronizes here; one
/// without per-sequence policy state registers at most 8192 live ids (later ones are not registered).
#[no_mangle]
pub unsafe extern "C" fn kvs_sequence_release(engine: *mut kvs_engine, seq_id: u64) -> kvs_status {
    guard(|| engine_ref(engine)?.release_sequence(seq_id))
}

/// Sets the dequantization scales of an FP8 cache (`kvs_engine_config.cache_dtype`): vLLM's per-layer
/// `k_scale` and `v_scale` (float32, per tensor; `fp8 = x / scale` on write, `x = fp8 * scale` on read).
/// `layer = -1` sets every layer, else one layer `0 .. num_layers-1` (any other value is
/// `KVS_ERR_OUT_OF_RANGE`). A scale that is not finite or not above 0 is `KVS_ERR_INVALID_ARGUMENT` and
/// changes nothing. A forward call or cache write on an FP8 layer whose scales were never set fails with
/// `KVS_ERR_INVALID_ARGUMENT` and writes nothing. Engines whose cache is not FP8 keep the scales unused.
/// Applies from the next call (a captured CUDA graph keeps the scales it was captured with); thread-safe.
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_set_kv_scales(engine: *mut kvs_engine, layer: i32, k_scale: f32, v_scale: f32) -> kvs_status {
    guard(|| {
        let e = engine_ref(engine)?;
        let layer = match usize::try_from(layer) {
            _ if layer == -1 => None,
            Ok(l) => Some(l),
            Err(_) => bail!(OutOfRange, "layer {layer} is outside the engine's {} layers (-1 = every layer)", e.config().num_layers),
        };
        e.set_kv_scales(layer, k_scale, v_scale)
    })
}

/// Accumulated counters: `layer = -1` for all layers, else one layer `0 .. num_layers-1` (any other
/// value, other negative ones included, is `KVS_ERR_OUT_OF_RANGE`). `out->struct_size` must be set;
/// kvsparse writes at most that many bytes. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_stats(engine: *const kvs_engine, layer: i32, out: *mut kvs_stats) -> kvs_status {
    guard(|| {
        let e = engine_ref(engine)?;
        ensure!(!out.is_null(), InvalidArgument, "out is NULL");
        ensure!((*out).struct_size >= 8, InvalidArgument, "out.struct_size must be set (to sizeof(kvs_stats))");
        let s = e.stats();
        let c = match usize::try_from(layer) {
            _ if layer == -1 => s.total,
            Ok(l) if l < s.per_layer.len() => s.per_layer[l],
            _ => bail!(OutOfRange, "layer {layer} is outside the engine's {} layers (-1 = totals)", s.per_layer.len()),
        };
        write_stats(out, &c, Some(&s));
        Ok(())
    })
}

/// Returns what the device-side checks of a CUDA engine found since the last check: it waits for the work
/// enqueued on `stream` (a CUstream; NULL = the legacy default stream), then returns the status and
/// message (`kvs_last_error`) of the first fault recorded (in the CPU engine's order of checks: the same
/// status and message a CPU engine gives at the call, naming the field and index) and clears the record;
/// `KVS_OK` when none. Refused (`KVS_ERR_INVALID_ARGUMENT`) on a stream that is being captured. A CPU
/// engine checks everything at the call: always `KVS_OK`. See docs/abi.md, "Where each check runs".
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_check(engine: *const kvs_engine, stream: *mut std::ffi::c_void) -> kvs_status {
    guard(|| engine_ref(engine)?.check(stream))
}

/// Describes the policy spec `policy` (a NUL-terminated string, as `kvs_engine_config.policy`; NULL or
/// empty = dense) into `*info`, written up to `info->struct_size`: its stages, dense layers, whether it keeps
/// per-sequence state and whether its decode steps may be captured in a CUDA graph. A malformed spec is
/// `KVS_ERR_INVALID_ARGUMENT` (the message says where), `*info` untouched. Creates nothing, touches no device.
#[no_mangle]
pub unsafe extern "C" fn kvs_policy_query(policy: *const c_char, info: *mut kvs_policy_info) -> kvs_status {
    guard(|| {
        let out = info_arg(info)?;
        let text = if policy.is_null() { "" } else { CStr::from_ptr(policy).to_str().map_err(|_| crate::error::Error::new(crate::error::ErrorKind::InvalidArgument, "policy is not UTF-8"))? };
        ensure!(text.len() <= crate::config::MAX_POLICY_LEN, InvalidArgument, "the policy spec is {} bytes long, more than the {} accepted", text.len(), crate::config::MAX_POLICY_LEN);
        write_policy_info(out, &crate::policy::Policy::parse(text)?);
        Ok(())
    })
}

/// `kvs_policy_query` for the policy an engine runs.
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_policy(engine: *const kvs_engine, info: *mut kvs_policy_info) -> kvs_status {
    guard(|| {
        let e = engine_ref(engine)?;
        write_policy_info(info_arg(info)?, e.policy());
        Ok(())
    })
}

/// The caller's info struct, its `struct_size` checked (at least the size of the first field).
unsafe fn info_arg<'a>(info: *mut kvs_policy_info) -> Result<&'a mut kvs_policy_info> {
    ensure!(!info.is_null(), InvalidArgument, "info is NULL");
    let have = (*info).struct_size as usize;
    ensure!(have >= 4, InvalidArgument, "info.struct_size is {have} (set it to sizeof(kvs_policy_info))");
    Ok(&mut *info)
}

/// Writes what the library says about `p`, up to the caller's `struct_size`.
unsafe fn write_policy_info(out: &mut kvs_policy_info, p: &crate::policy::Policy) {
    let full = kvs_policy_info {
        struct_size: std::mem::size_of::<kvs_policy_info>() as u32,
        num_stages: p.num_stages() as u32,
        dense_layers: p.dense_layers().min(u32::MAX as usize) as u32,
        stateful: (p.pipeline().is_some() && p.is_stateful()) as u32,
        graph_capturable: p.graph_capturable() as u32,
        reserved: 0,
    };
    let n = (out.struct_size as usize).min(std::mem::size_of::<kvs_policy_info>());
    // Keep the caller's struct_size; copy the rest up to what the caller declared.
    std::ptr::copy_nonoverlapping((&full as *const kvs_policy_info as *const u8).add(4), (out as *mut kvs_policy_info as *mut u8).add(4), n - 4);
}

/// Short constant name of a status code ("KVS_OK", ...). Never NULL.
#[no_mangle]
pub extern "C" fn kvs_status_name(status: i32) -> *const c_char {
    let s: &'static [u8] = match status {
        0 => b"KVS_OK\0",
        1 => b"KVS_ERR_INVALID_ARGUMENT\0",
        2 => b"KVS_ERR_INVALID_SHAPE\0",
        3 => b"KVS_ERR_INVALID_DTYPE\0",
        4 => b"KVS_ERR_OUT_OF_RANGE\0",
        5 => b"KVS_ERR_UNSUPPORTED\0",
        6 => b"KVS_ERR_UNKNOWN_SEQUENCE\0",
        7 => b"KVS_ERR_OUT_OF_MEMORY\0",
        8 => b"KVS_ERR_DEVICE\0",
        9 => b"KVS_ERR_INTERNAL\0",
        _ => b"KVS_UNKNOWN_STATUS\0",
    };
    s.as_ptr() as *const c_char
}

/// Copies counters into a caller struct, honouring its `struct_size`.
unsafe fn write_stats(out: *mut kvs_stats, c: &Counters, engine: Option<&crate::stats::EngineStats>) {
    let full = kvs_stats::from_counters(c, engine);
    let caller_size = (*out).struct_size as usize;
    let n = caller_size.min(std::mem::size_of::<kvs_stats>());
    // Keep the caller's struct_size; copy the rest up to what the caller declared.
    let src = &full as *const kvs_stats as *const u8;
    std::ptr::copy_nonoverlapping(src.add(4), (out as *mut u8).add(4), n - 4);
}

// Re-exported so cbindgen sees DLTensor in signatures; the header defines it guarded by DLPACK_VERSION.
#[allow(unused)]
fn _dl(_: DLTensor) {}
