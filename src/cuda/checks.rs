//! The device half of "validate before writing" (docs/abi.md, "Where each check runs"; issue 33).
//!
//! A captured decode step cannot wait for the host, so the host never reads the contents of block tables,
//! sequence lengths, query offsets or slot mappings on a CUDA engine. The kernels that read them check
//! them (kernels/common.cuh): a row whose metadata is bad is written as NaN, and the fault goes to one
//! error record per engine, owned here. The record keeps the fault that comes first in the CPU engine's
//! order of checks, whatever order the CTAs ran in, and [`decode`] turns it into the CPU engine's status
//! and message. It surfaces at `kvs_engine_check` (which clears it), in `kvs_engine_stats`
//! (`pending_status`, not cleared), or from the call itself under `validate = sync`.
//!
//! Cache writes: `kvs_slots_check` (kernels/cache_write.cu) copies the slot mapping into a per-layer
//! int64 buffer here, every entry -1 (skip) when any slot is out of range, and every kernel of the write
//! reads that copy: a bad slot anywhere writes nothing, without a host sync. A decode step's write
//! (`write_step`, one launch) checks the slots in the same launch and fills the same buffer.

use parking_lot::Mutex;

use super::context::{DevBuf, Gpu};
use super::driver::{check, cuda, CUstream};
use super::launch::{self, KArgs, Modules};
use crate::error::{Error, ErrorKind, Result};
use crate::tensor::{DType, TensorRef};
use crate::{bail, ensure};

/// Fault groups and per-sequence checks, as kernels/common.cuh (KVS_FAULT_*, KVS_SUB_*) encodes them.
const FAULT_QSL_FIRST: u64 = 1;
const FAULT_SEQ: u64 = 2;
const FAULT_QSL_LAST: u64 = 3;
const FAULT_SLOT: u64 = 4;
const SUB_QSL_ORDER: u64 = 0;
const SUB_QSL_BEYOND: u64 = 1;
const SUB_LEN_NEG: u64 = 2;
const SUB_QLEN: u64 = 3;
const SUB_LEN_TABLE: u64 = 4;
const SUB_BLOCK: u64 = 5;

/// Smallest clean slot buffer (entries), so that decode-sized writes never grow it.
const MIN_CLEAN_SLOTS: usize = 4096;

/// The engine's error record and the cache writes' clean slot buffers.
pub struct DeviceChecks {
    /// Four u64: lock, fault key (0 = none), two values (kernels/common.cuh `kvs_fail`).
    record: DevBuf,
    /// Per layer: the int64 slot list the kernels of a cache write read.
    clean: Vec<Mutex<Option<DevBuf>>>,
    /// Clean buffers replaced by larger ones: kept until the engine is destroyed, because CUDA graphs
    /// captured before the growth still point at them.
    retired: Mutex<Vec<DevBuf>>,
    block_size: usize,
}

/// A recorded fault as the kernels left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub key: u64,
    pub a: i64,
    pub b: i64,
}

impl DeviceChecks {
    pub fn new(num_layers: usize, block_size: usize) -> Result<Self> {
        Ok(DeviceChecks { record: DevBuf::from_host(&[0u8; 32])?, clean: (0..num_layers).map(|_| Mutex::new(None)).collect(), retired: Mutex::new(Vec::new()), block_size })
    }

    /// Device address of the error record (the kernels' `kerr` / `err` argument).
    pub fn record_ptr(&self) -> u64 {
        self.record.ptr
    }

    /// Enqueues `kvs_slots_check` for a cache write of `n` rows into layer `layer`'s cache of `capacity`
    /// slots; returns the view of the checked slots that the write's kernels must read instead of
    /// `slot_mapping`. Grows the layer's buffer outside a capture only.
    /// `defines`: those of the engine's cache-write module (kernels/cache_write.cu holds both kernels).
    #[allow(clippy::too_many_arguments)]
    pub fn check_slots(&self, gpu: &Gpu, modules: &Modules, defines: &[String], layer: usize, slot_mapping: &TensorRef, n: usize, capacity: usize, stream: CUstream) -> Result<TensorRef> {
        let buf = self.clean_buffer(gpu, layer, n, stream)?;
        let f = modules.function(gpu, "cache_write", launch::CACHE_WRITE, defines, "kvs_slots_check")?;
        let mut k = KArgs::new();
        k.ptr(slot_mapping.data).i64(slot_mapping.stride(0) as i64).i32((slot_mapping.dtype == DType::I64) as i32).i32(n as i32);
        k.i64(capacity as i64).i64(buf as i64).i64(self.record.ptr as i64);
        launch::launch(f, (1, 1, 1), 1024, &mut k, stream, "kvs_slots_check launch")?;
        clean_view(buf, n, slot_mapping.device)
    }

    /// Device address of layer `layer`'s clean slot buffer, grown (outside a capture only) to at least
    /// `n` entries. A decode step's write (`write_step`) fills it itself.
    pub fn clean_buffer(&self, gpu: &Gpu, layer: usize, n: usize, stream: CUstream) -> Result<u64> {
        let mut g = self.clean[layer].lock();
        if g.as_ref().map_or(true, |b| b.bytes < n * 8) {
            ensure!(
                !gpu.is_capturing(stream)?,
                InvalidArgument,
                "this cache write of {n} rows needs a larger slot check buffer for layer {layer} on a stream that is being captured; write that many rows once before capturing"
            );
            let fresh = DevBuf::alloc(n.max(MIN_CLEAN_SLOTS).next_power_of_two() * 8)?;
            if let Some(old) = g.replace(fresh) {
                self.retired.lock().push(old);
            }
        }
        Ok(g.as_ref().expect("allocated above").ptr)
    }

    /// Waits for `stream`, then reads the record and clears it: the fault recorded since the last take,
    /// as the CPU engine's error. Refused on a stream that is being captured (it cannot wait).
    #[allow(clippy::not_unsafe_ptr_arg_deref)] // driver handles (CUstream, CUfunction): opaque, passed to the driver, never dereferenced here
    pub fn take(&self, gpu: &Gpu, stream: CUstream) -> Result<Option<Error>> {
        gpu.make_current()?;
        ensure!(!gpu.is_capturing(stream)?, InvalidArgument, "the device checks cannot be read on a stream that is being captured into a CUDA graph; read them after the capture (or a replay)");
        // SAFETY: the caller's stream handle (NULL = legacy default stream).
        check(unsafe { (cuda()?.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")?;
        let fault = self.read()?;
        if fault.is_some() {
            // Key and values only: a kernel of another stream may hold the lock word right now.
            self.record.upload(8, &[0u8; 24])?;
        }
        Ok(fault.map(|f| decode(f, self.block_size)))
    }

    /// The recorded fault, if any, without clearing it (the caller synchronized).
    pub fn peek(&self) -> Result<Option<Error>> {
        Ok(self.read()?.map(|f| decode(f, self.block_size)))
    }

    fn read(&self) -> Result<Option<Fault>> {
        let mut raw = [0u8; 32];
        self.record.download(0, &mut raw)?;
        let w = |i: usize| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        Ok((w(1) != 0).then(|| Fault { key: w(1), a: w(2) as i64, b: w(3) as i64 }))
    }
}

/// The first `n` entries of a clean slot buffer (`DeviceChecks::clean_buffer`) as the int64 slot list
/// the write's kernels and the policies' write hooks read.
pub fn clean_view(buf: u64, n: usize, device: crate::tensor::Device) -> Result<TensorRef> {
    // SAFETY: n int64 elements of a live device buffer of at least n * 8 bytes, kept alive by the engine
    // (never freed while the engine lives).
    unsafe { TensorRef::from_raw(buf as usize as *mut u8, DType::I64, device, &[n as i64], Some(&[1])) }
}

/// The CPU engine's status and message for a recorded fault (layout::Batch, cpu::cache_write), with the
/// place it was found.
pub fn decode(f: Fault, block_size: usize) -> Error {
    let group = f.key >> 56;
    let idx = (f.key >> 36) & 0xfffff;
    let sub = (f.key >> 32) & 0xf;
    let col = f.key & 0xffff_ffff;
    let (a, b) = (f.a, f.b);
    let (kind, msg) = match (group, sub) {
        (FAULT_QSL_FIRST, _) => (ErrorKind::InvalidArgument, format!("query_start_loc[0] must be 0, got {a}")),
        (FAULT_SEQ, SUB_QSL_ORDER) => (ErrorKind::InvalidArgument, format!("query_start_loc must be non-decreasing: entry {} is {b} after {a}", idx + 1)),
        (FAULT_SEQ, SUB_QSL_BEYOND) => (ErrorKind::OutOfRange, format!("query_start_loc[{}] = {a} exceeds the {b} query tokens", idx + 1)),
        (FAULT_SEQ, SUB_LEN_NEG) => (ErrorKind::OutOfRange, format!("seq_lens[{idx}] = {a} is negative")),
        (FAULT_SEQ, SUB_QLEN) => (ErrorKind::OutOfRange, format!("sequence {idx} has {a} query tokens but seq_len {b}; seq_lens must include the new tokens")),
        (FAULT_SEQ, SUB_LEN_TABLE) => (
            ErrorKind::OutOfRange,
            format!("sequence {idx} has seq_len {a}, which needs {} blocks of {block_size}, but the block table has {b} columns", (a.max(0) as u64).div_ceil(block_size.max(1) as u64)),
        ),
        (FAULT_SEQ, SUB_BLOCK) => (ErrorKind::OutOfRange, format!("block_table[{idx}][{col}] = {a} is outside the cache's {b} blocks")),
        (FAULT_QSL_LAST, _) => (ErrorKind::InvalidShape, format!("query_start_loc ends at {a} but the query has {b} tokens")),
        (FAULT_SLOT, _) => (ErrorKind::OutOfRange, format!("slot_mapping[{idx}] = {a} is outside the cache's {b} slots ({} blocks of {block_size})", b / block_size.max(1) as i64)),
        _ => (ErrorKind::Internal, format!("unknown device check record {:#x} ({a}, {b})", f.key)),
    };
    Error::new(kind, format!("{msg} (found by the device checks)"))
}

/// The attention kernels' define that compiles the checks in (`KVS_CHECKS=3`, always; `| 4` for an engine
/// with `padded_batches`) or out.
/// Benchmarks only, the baselines of their cost in the same binary: `KVS_BENCH_NO_DEVICE_CHECKS=1`
/// compiles them all out (no NaN rows, no fault record, no dense row counters), `=rows` the rows'
/// checks only, `=seqs` the sequences' checks and counters only.
pub fn kernel_define(padded_batches: bool) -> String {
    let bits = match std::env::var("KVS_BENCH_NO_DEVICE_CHECKS").as_deref() {
        Ok("1") => 0,
        Ok("rows") => 2,
        Ok("seqs") => 1,
        _ => 3,
    };
    // Bit 2: query_start_loc may end before the last query row (engine option padded_batches).
    format!("KVS_CHECKS={}", bits | if padded_batches { 4 } else { 0 })
}

/// Refuses `validate = sync` on a stream that is being captured (a captured call cannot wait).
pub fn refuse_sync_in_capture(gpu: &Gpu, stream: CUstream) -> Result<()> {
    gpu.make_current()?;
    if gpu.is_capturing(stream)? {
        bail!(InvalidArgument, "the engine validates synchronously (validate = sync), which waits for every call; a call on a stream that is being captured into a CUDA graph cannot wait: use an engine without validate = sync for capture");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(group: u64, idx: u64, sub: u64, col: u64) -> u64 {
        (group << 56) | (idx << 36) | (sub << 32) | col
    }

    #[test]
    fn records_decode_to_the_cpu_engines_messages() {
        let d = |k, a, b| decode(Fault { key: k, a, b }, 16);
        let e = d(key(FAULT_SEQ, 2, SUB_BLOCK, 7), -1, 100);
        assert_eq!((e.kind, e.message.as_str()), (ErrorKind::OutOfRange, "block_table[2][7] = -1 is outside the cache's 100 blocks (found by the device checks)"));
        let e = d(key(FAULT_SEQ, 3, SUB_QSL_ORDER, 0), 5, 3);
        assert_eq!((e.kind, e.message.as_str()), (ErrorKind::InvalidArgument, "query_start_loc must be non-decreasing: entry 4 is 3 after 5 (found by the device checks)"));
        let e = d(key(FAULT_SEQ, 1, SUB_LEN_TABLE, 0), 100, 4);
        assert!(e.message.starts_with("sequence 1 has seq_len 100, which needs 7 blocks of 16, but the block table has 4 columns"), "{}", e.message);
        assert_eq!(d(key(FAULT_QSL_LAST, 0, 0, 0), 3, 4).kind, ErrorKind::InvalidShape);
        assert_eq!(d(key(FAULT_QSL_FIRST, 0, 0, 0), 1, 0).kind, ErrorKind::InvalidArgument);
        let e = d(key(FAULT_SLOT, 9, 0, 0), 1600, 1600);
        assert!(e.message.starts_with("slot_mapping[9] = 1600 is outside the cache's 1600 slots (100 blocks of 16)"), "{}", e.message);
        assert_eq!(d(key(FAULT_SEQ, 0, SUB_LEN_NEG, 0), -3, 0).message, "seq_lens[0] = -3 is negative (found by the device checks)");
        assert_eq!(d(key(FAULT_SEQ, 0, SUB_QLEN, 0), 5, 2).kind, ErrorKind::OutOfRange);
        assert_eq!(d(key(FAULT_SEQ, 0, SUB_QSL_BEYOND, 0), 9, 4).message, "query_start_loc[1] = 9 exceeds the 4 query tokens (found by the device checks)");
    }

    /// The keys order faults as the CPU engine checks them (the record keeps the smallest).
    #[test]
    fn keys_follow_the_cpu_engines_order() {
        let order = [
            key(FAULT_QSL_FIRST, 0, 0, 0),
            key(FAULT_SEQ, 0, SUB_QSL_ORDER, 0),
            key(FAULT_SEQ, 0, SUB_LEN_NEG, 0),
            key(FAULT_SEQ, 0, SUB_BLOCK, 0),
            key(FAULT_SEQ, 0, SUB_BLOCK, 5),
            key(FAULT_SEQ, 1, SUB_QSL_ORDER, 0),
            key(FAULT_SEQ, 65535, SUB_BLOCK, u32::MAX as u64),
            key(FAULT_QSL_LAST, 0, 0, 0),
        ];
        assert!(order.windows(2).all(|w| w[0] < w[1]));
    }
}
