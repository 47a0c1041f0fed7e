//! The C-visible types. Field order is ABI: append new fields at the end only (callers say how much of a
//! struct they know through `struct_size`).
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_void};

use super::dlpack::DLTensor;
pub use super::guard::{kvs_engine, kvs_status};

/// Element type of queries, caches and outputs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvs_dtype {
    KVS_DTYPE_FLOAT32 = 0,
    KVS_DTYPE_FLOAT16 = 1,
    KVS_DTYPE_BFLOAT16 = 2,
}

/// Engine configuration. Fill it with `kvs_engine_config_init` and then set the model's fields.
/// A size above its documented limit fails `kvs_engine_create` with `KVS_ERR_UNSUPPORTED`; an allocation
/// the machine cannot make fails it with `KVS_ERR_OUT_OF_MEMORY`.
///
/// Where checks run (docs/abi.md, "Where each check runs"): a CPU engine checks everything at the call.
/// A CUDA engine checks shapes, dtypes, strides, devices, scalars and a stateful policy's `seq_ids` at the
/// call, and the device-resident contents (query_start_loc, seq_lens, block ids, slots) in its kernels:
/// offending rows are NaN, a bad slot writes nothing, and the fault surfaces at `kvs_engine_check` (or
/// from the call with `validate = KVS_VALIDATE_SYNC`). A CUDA engine refuses with `KVS_ERR_UNSUPPORTED`:
/// caches whose head_dim stride is not 1; devices below compute capability 8.0; policies with GQA groups
/// over 16 or more than 65535 sequences per call; `art` on an f32 cache (it needs the tensor-core
/// kernel: f16/bf16, 16-byte aligned rows) or behind `snapkv`/`top_p`; a PRR speculation budget table.
/// It keeps at most 8192 live sequence ids without per-sequence policy state.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvs_engine_config {
    /// `sizeof(kvs_engine_config)` as the caller was compiled.
    pub struct_size: u32,
    /// DLPack device type of the tensors this engine serves: `KVS_DL_CPU` (1) or `KVS_DL_CUDA` (2).
    pub device_type: i32,
    pub device_id: i32,
    /// Attention layers served (1 to 4096); layer ids in calls are `0 .. num_layers-1`.
    pub num_layers: u32,
    /// Query heads, 1 to 1024.
    pub num_q_heads: u32,
    /// Must divide `num_q_heads` (GQA/MQA).
    pub num_kv_heads: u32,
    /// One of 64, 80, 96, 112, 128, 192, 256.
    pub head_dim: u32,
    /// Tokens per KV block: a power of two from 1 to 256.
    pub block_size: u32,
    /// Blocks per layer cache; 0 = whatever the caches passed in hold.
    pub num_blocks: u32,
    /// dtype of queries, caches and outputs.
    pub dtype: kvs_dtype,
    /// CPU worker threads, at most 1024; 0 = one per available core (at most 1024).
    /// In a process that runs PyTorch (or has one OpenMP runtime loaded), decode attention (dense and the
    /// policies') runs on that runtime's team of the calling thread instead, with at most this many of its
    /// threads and no more than it runs its own regions with; `KVS_HOST_OMP=0` keeps it on the engine's own
    /// threads.
    pub num_threads: u32,
    /// Cap on per-sequence policy state in bytes; 0 = none.
    pub max_state_bytes: u64,
    /// NUL-terminated policy spec (docs/policies.md), at most 4096 bytes; NULL or "" = dense. Copied
    /// during the call.
    pub policy: *const c_char,
    /// CUDA engines: when the device checks of block tables, lengths, query offsets and slots surface
    /// (docs/abi.md, "Where each check runs"). `KVS_VALIDATE_DEFERRED` (0, default): the kernels write an
    /// offending row as NaN and record the first fault, which `kvs_engine_check` returns (and
    /// `kvs_engine_stats` shows); nothing waits, so calls are capturable. `KVS_VALIDATE_SYNC` (1): every
    /// call waits for its work and returns the fault itself (a call on a capturing stream is refused).
    /// Ignored by CPU engines, which check everything before writing. Appended in ABI 0: a caller whose
    /// `struct_size` ends before it gets the default.
    pub validate: kvs_validate,
    /// The K/V caches' dtype: `KVS_CACHE_DTYPE_AUTO` (0, default) = `dtype`, or FP8
    /// (`KVS_CACHE_DTYPE_FP8_E4M3`, `KVS_CACHE_DTYPE_FP8_E5M2`, vLLM's `kv_cache_dtype="fp8"` / `"fp8_e5m2"`)
    /// with per-layer scales from `kvs_engine_set_kv_scales`. Queries and outputs stay `dtype` (float32
    /// queries with an FP8 cache: CPU engines only). A CUDA engine serves FP8 caches with dense attention and
    /// the policies `all`, `streaming` and `quest` (with or without `top_p`) on devices of compute capability
    /// 8.9 or newer, in its tensor-core kernel (16-byte aligned rows and strides); anything else is
    /// `KVS_ERR_UNSUPPORTED`. Appended in ABI 0: a caller whose
    /// `struct_size` ends before it gets `AUTO`.
    pub cache_dtype: kvs_cache_dtype,
    /// 1: a forward call's query may end with padding rows past `query_start_loc[num_seqs]` (vLLM's and
    /// SGLang's CUDA graphs pad a decode batch to a captured size, with `query_start_loc` ending at the real
    /// tokens): those rows are neither attended nor written and `query_start_loc[num_seqs] < num_tokens` is
    /// not an error. 0 (default): it is `KVS_ERR_INVALID_SHAPE` (CPU) or a device-check fault (CUDA). Any
    /// other value is `KVS_ERR_INVALID_ARGUMENT`. Appended in ABI 0: a caller whose `struct_size` ends
    /// before it gets 0.
    pub padded_batches: u32,
}

/// dtype of an engine's K/V caches (`kvs_engine_config.cache_dtype`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvs_cache_dtype {
    /// The engine's `dtype` (default).
    KVS_CACHE_DTYPE_AUTO = 0,
    /// FP8 E4M3 ("fn": max 448, no infinities); `kvs_cache_write` stores `x / k_scale` (or `v_scale`)
    /// rounded to nearest even and saturated to +-448, as vLLM does; readers use `fp8 * scale`.
    KVS_CACHE_DTYPE_FP8_E4M3 = 1,
    /// FP8 E5M2 (max 57344, with infinities), stored and read the same way.
    KVS_CACHE_DTYPE_FP8_E5M2 = 2,
}

/// When a CUDA engine's device checks surface (`kvs_engine_config.validate`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvs_validate {
    /// Recorded on the device; `kvs_engine_check` returns the fault (default). Capturable.
    KVS_VALIDATE_DEFERRED = 0,
    /// Every call waits for its work and returns the fault itself; not capturable.
    KVS_VALIDATE_SYNC = 1,
}

/// One attention call over a varlen batch (prefill, chunked prefill and decode rows mixed).
/// Tensor pointers are borrowed for the duration of the call only.
///
/// Tensors: strides are in elements and must not be negative; inputs may broadcast (stride 0), outputs
/// (`out`, `lse`) and the caches must not alias themselves (a tensor with no element is always valid,
/// whatever its strides). Element counts and byte extents must fit in 63 bits and not wrap the address
/// space; `data` may be NULL only for a tensor with no element. At most 1048576 tokens and 65536
/// sequences per call (more is `KVS_ERR_UNSUPPORTED`).
///
/// NaN and infinity propagate, as in other attention kernels, and never turn into zeros: for each output
/// row (token, query head), if the query row or the key of any position the row attends (causal limit,
/// sliding window and, for decode rows, the policy's selection) holds a NaN or an infinity, so that a
/// logit `scale * q.k` is not finite (an overflowing product counts too, and a soft-cap does not hide
/// it), the row's `out` is NaN in every element and its `lse` is NaN. A NaN or infinity in the value of
/// an attended position makes the output elements it reaches non-finite (NaN or +-inf) and leaves `lse`
/// finite; it may also make those elements non-finite in other rows of the same sequence that do not
/// attend that position (a zero weight times infinity is NaN in tiled kernels). Memory no row of the
/// call attends (cache slots past a sequence's length, other blocks, keys outside every row's window)
/// never affects the result. Status stays `KVS_OK`: the values are the caller's.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvs_forward_args {
    pub struct_size: u32,
    pub layer: u32,
    /// `[num_tokens, num_q_heads, head_dim]`, the engine's dtype.
    pub query: *const DLTensor,
    /// `[num_blocks, block_size, num_kv_heads, head_dim]` each, any strides (vLLM flash layout).
    pub key_cache: *const DLTensor,
    pub value_cache: *const DLTensor,
    /// `[num_seqs, max_blocks_per_seq]` int32. Entries `j < ceil(seq_len / block_size)` must lie in
    /// `[0, num_blocks)`: a CPU engine checks each of them, a CUDA engine those its kernels read (an entry
    /// no row visits, outside a window or a page a policy skips, is not read and not checked).
    pub block_table: *const DLTensor,
    /// `[num_seqs]` int32: total length of each sequence including its new tokens.
    pub seq_lens: *const DLTensor,
    /// `[num_seqs + 1]` int32: query row offsets; sequence s owns rows `[qsl[s], qsl[s+1])`.
    pub query_start_loc: *const DLTensor,
    /// `[num_seqs]` int64/uint64 stable sequence ids; may be NULL for dense policies.
    pub seq_ids: *const DLTensor,
    /// `[num_tokens, num_q_heads, head_dim]` output, the engine's dtype. Written only on success.
    pub out: *const DLTensor,
    /// `[num_tokens, num_q_heads]` float32 log-sum-exp (natural log of scaled logits); may be NULL.
    /// NaN for a row with a non-finite logit (see above); -inf only for a row that attends no key.
    pub lse: *const DLTensor,
    /// Softmax scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
    /// Sliding window in tokens (a query sees its last `sliding_window` keys, itself included); 0 = off.
    pub sliding_window: i32,
    /// Logit soft-cap (`cap * tanh(s / cap)` on scaled logits); 0 = off.
    pub softcap: f32,
    /// Largest query length and sequence length in the batch (needed by GPU launches; 0 = unknown).
    pub max_query_len: i32,
    pub max_seq_len: i32,
    /// CUstream for CUDA engines (NULL = default stream); ignored on CPU.
    pub stream: *mut c_void,
    /// If not NULL, receives this call's counters (set its `struct_size` first).
    pub call_stats: *mut kvs_stats,
}

/// Writes new K/V rows into a layer's cache by slot mapping (`slot = block * block_size + offset`).
/// Tensors follow the rules of `kvs_forward_args` (the caches here are the same role as there); at most
/// 1048576 tokens per call.
///
/// With a policy that keeps key metadata (`quest`, `speculate`, `top_p`), write each block's slots in
/// increasing order, as serving engines append tokens: a write at offset `j` of a block starts that
/// block's metadata over from `j`, so slots after `j` written by earlier calls count as unwritten until
/// written again (a forward call that needs them fails with `KVS_ERR_INVALID_ARGUMENT` naming the
/// position; it never uses stale bounds). Slots written in one call may come in any order.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvs_cache_write_args {
    pub struct_size: u32,
    pub layer: u32,
    /// `[num_tokens, num_kv_heads, head_dim]` each, the engine's dtype.
    pub key: *const DLTensor,
    pub value: *const DLTensor,
    /// The layer's caches, as in `kvs_forward_args`.
    pub key_cache: *const DLTensor,
    pub value_cache: *const DLTensor,
    /// `[num_tokens]` int64 (or int32); negative slots are skipped (padding).
    pub slot_mapping: *const DLTensor,
    pub stream: *mut c_void,
}

/// Merges two partial attention results over disjoint key sets: `out, lse_out = merge(a, b)`.
/// Tensors follow the rules of `kvs_forward_args` (`out` and `lse_out` are outputs).
///
/// Per row (token, head): a side whose lse is -inf attended no key and is ignored (its `out` is not
/// read); both -inf gives zeros and -inf. A NaN or +inf lse on either side gives a NaN row and a NaN
/// `lse_out`. A NaN or infinity in the `out` of a side with a finite lse reaches the merged elements,
/// even when that side's weight underflows to zero.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvs_merge_args {
    pub struct_size: u32,
    /// `[num_tokens, num_heads, head_dim]`, one float dtype for all three outputs.
    pub out_a: *const DLTensor,
    /// `[num_tokens, num_heads]` float32.
    pub lse_a: *const DLTensor,
    pub out_b: *const DLTensor,
    pub lse_b: *const DLTensor,
    /// May alias `out_a` or `out_b` (merged in place).
    pub out: *const DLTensor,
    /// May be NULL.
    pub lse_out: *const DLTensor,
    pub stream: *mut c_void,
}

// `kvs_stats` (the counters) is defined with the policy registry: its middle is one line per stage.
pub use crate::policy::kvs_stats;

/// What the library says about a policy (`kvs_policy_query`, `kvs_engine_policy`): what a serving plugin
/// needs to decide without parsing the spec itself.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvs_policy_info {
    /// Set by the caller to `sizeof(kvs_policy_info)`; the library writes up to it.
    pub struct_size: u32,
    /// Stages of the pipeline (selector, top-p, ART); 0 = dense attention everywhere.
    pub num_stages: u32,
    /// Leading layers kept dense (the spec's `dense_layers`).
    pub dense_layers: u32,
    /// 1 when the policy keeps per-sequence state, so forward calls must pass `seq_ids`; else 0.
    pub stateful: u32,
    /// 1 when a CUDA engine's decode steps under this policy may be captured in a CUDA graph by a serving
    /// plugin (every stage's step is a fixed launch sequence, checked replay == eager; docs/abi.md); else 0.
    pub graph_capturable: u32,
    pub reserved: u32,
}
