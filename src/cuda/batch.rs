//! What a call's launches share, below the backend and the policies' device code: the batch's geometry as
//! the host knows it, the batch and a plan as kernels read them, which rows an attention launch serves,
//! and small device read-backs. Nothing here names a policy or the backend, so both build on it.

use super::driver::{check, cuda};
use super::traversal::TraversalLaunch;
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::KvCache;
use crate::tensor::{DType, TensorRef};
use crate::ensure;

/// What the host knows of a call's batch before launching anything.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub num_tokens: usize,
    pub num_seqs: usize,
    /// Block-table columns, and the positions they can address.
    pub cols: usize,
    pub max_pos: usize,
    /// Longest sequence (the caller's max_seq_len when given, else the table's capacity).
    pub max_len: usize,
}

/// Which rows an attention launch serves.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Rows {
    /// Every row, densely (dense layers).
    All,
    /// The rows that are not decode rows (query length != 1), densely: a policy layer's prefill rows.
    DenseRest,
    /// Decode rows through their plans; the second field bounds a row's plan keys; the third, a stage's
    /// hook on the traversal (src/cuda/traversal.rs).
    Plan(PlanRef, usize, Option<TraversalLaunch>),
    /// As `Plan` (no hook), the tensor-core kernel also writing the rows' logits (kernels/attention_mma.cu
    /// LOGITS=1): to `lg` (device address), `maxpos` positions per (sequence, KV head), and each split's
    /// softmax statistics per query head to `parts` (`nparts` slots per head: the launch splits no more).
    PlanLogits(PlanRef, usize, LogitsOut),
}

/// Where `Rows::PlanLogits` writes the logits and the splits' statistics (see kernels/attention_mma.cu,
/// LOGITS).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LogitsOut {
    pub lg: u64,
    pub maxpos: i32,
    pub parts: u64,
    pub nparts: i32,
}

/// A plan as the attention kernel reads it (kernels/include/params.cuh `PlanRef`; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanRef {
    pub e: u64,
    pub p_s: i64,
    pub p_h: i64,
    pub len: u64,
    pub ulog2: i32,
    pub hk: i32,
    pub cap: i32,
    pub pad: i32,
}

impl PlanRef {
    pub fn none() -> Self {
        PlanRef::default()
    }
}

/// The batch as the selection kernels read it (kernels/include/params.cuh `Batch`; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchArg {
    bt: u64,
    bt0: i64,
    bt1: i64,
    bt_cols: i32,
    bs_log2: i32,
    num_blocks: i64,
    seq_lens: u64,
    sl0: i64,
    qsl: u64,
    qsl0: i64,
    num_seqs: i32,
    num_tokens: i32,
    window: i32,
    pad: i32,
}

impl BatchArg {
    /// The call's batch as the selection kernels read it.
    pub(crate) fn new(a: &ForwardArgs, geo: &Geometry, cache: &KvCache) -> Self {
        BatchArg {
            bt: a.block_table.data as u64,
            bt0: a.block_table.stride(0) as i64,
            bt1: a.block_table.stride(1) as i64,
            bt_cols: geo.cols as i32,
            bs_log2: cache.block_size.trailing_zeros() as i32,
            num_blocks: cache.num_blocks as i64,
            seq_lens: a.seq_lens.data as u64,
            sl0: a.seq_lens.stride(0) as i64,
            qsl: a.query_start_loc.data as u64,
            qsl0: a.query_start_loc.stride(0) as i64,
            num_seqs: geo.num_seqs as i32,
            num_tokens: geo.num_tokens as i32,
            window: a.sliding_window,
            pad: 0,
        }
    }
}

/// The layouts a test compares with kernels/include/params.cuh.
#[cfg(test)]
pub(crate) fn c_layouts() -> Vec<super::kernel_src::CLayout> {
    use super::kernel_src::c_layout;
    vec![
        c_layout!(BatchArg as "Batch" { bt, bt0, bt1, bt_cols, bs_log2, num_blocks, seq_lens, sl0, qsl, qsl0, num_seqs, num_tokens, window, pad }),
        c_layout!(PlanRef as "PlanRef" { e, p_s, p_h, len, ulog2, hk, cap, pad }),
    ]
}

/// The kernels' element-type code (`KVS_DTYPE`).
pub(crate) fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        _ => 2,
    }
}

/// The kernels' `KV8` define (kernels/include/fp8.cuh): 1 = E4M3 cache, 2 = E5M2, 0 = the engine's dtype.
pub(crate) fn kv8_code(cache: DType) -> i32 {
    match cache {
        DType::F8E4M3 => 1,
        DType::F8E5M2 => 2,
        _ => 0,
    }
}

/// Copies `dst.len()` bytes from device address `ptr` (synchronous).
pub(crate) fn download_raw(ptr: u64, dst: &mut [u8]) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: the caller names a device range inside one of our allocations or the caller's tensors.
    check(unsafe { (cuda()?.cuMemcpyDtoH)(dst.as_mut_ptr() as *mut std::ffi::c_void, ptr, dst.len()) }, "cuMemcpyDtoH")
}

/// The first `n` elements of a 1-D int32/int64 device tensor (any stride).
pub(crate) fn download_ints(t: &TensorRef, n: usize) -> Result<Vec<i64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let es = t.dtype.size_bytes();
    let stride = t.stride(0);
    ensure!(stride >= 0, InvalidShape, "negative stride");
    let span = ((n - 1) * stride as usize + 1) * es;
    let mut raw = vec![0u8; span];
    download_raw(t.data as u64, &mut raw)?;
    Ok((0..n)
        .map(|i| {
            let at = i * stride as usize * es;
            match t.dtype {
                DType::I64 | DType::U64 => i64::from_le_bytes(raw[at..at + 8].try_into().expect("8")),
                _ => i32::from_le_bytes(raw[at..at + 4].try_into().expect("4")) as i64,
            }
        })
        .collect())
}
