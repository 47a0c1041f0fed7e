//! PRR (`speculate(over=quest(...))`: predict, speculate, repair) on the CUDA backend (kernels/prr.cu).
//!
//! A decode step forks a side stream from the caller's stream (an event recorded on the caller's stream,
//! waited on by the side stream). The side stream predicts every page's Quest score from its Holt state,
//! takes the top `budget/page` predictions (the speculative set) and attends them; meanwhile the caller's
//! stream scores the pages (Quest bounds). After join A (the speculative set is known) one kernel selects
//! the true pages and computes the missed ones (true, not predicted) with the counters; the side stream,
//! once its speculative attention is done and the truth is known, updates the Holt state with the true
//! scores while the caller's stream, after join B (the speculative attention is done), attends the missed
//! pages and merges them with the speculative partial state through their LSEs in one kernel; join C
//! (the update is done) ends the step. So after the scores only two kernels stand between selection and
//! output. Pages predicted but not selected stay in the merge (`extra=keep`, the paper's and the default).
//! No host sync, no allocation, no host decision: the step is capturable. The side stream, the events and
//! the workspace are the engine's, one set per caller stream, created outside capture.
//!
//! State: Holt (level, trend), the Holt parameters and the previous-true bit per (cache block, KV head,
//! page slot) in the layer's PRR buffer, reset by the cache write when a page's first slot is written
//! (see kernels/prr.cu). Keyed by cache blocks, not sequence ids (which a captured step holds in device
//! memory), as SnapKV's kept bits: sequences sharing prefix blocks share those pages' state.
//!
//! Calibration: a call that may hold a prefill chunk (`max_query_len != 1`) scores the chunk's
//! calibration rows on the device, downloads the trajectory (a host sync), runs the CPU's own
//! `speculate::calibrate` per (sequence, KV head) and uploads the warm state. Such a call cannot be
//! captured (refused with a clear error); decode steps never sync.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::cuda::batch::{download_ints, BatchArg, Geometry, PlanRef, Rows};
use crate::cuda::context::DevBuf;
use crate::cuda::driver::{check, cuda, CUevent, CUstream, CU_STREAM_NON_BLOCKING};
use crate::cuda::kernel_src::{kernel_file, KernelFile, Module};
use crate::cuda::launch::{self, KArgs};
use crate::cuda::stage::{CudaStage, Device, PolicyDevice};
use crate::config::EngineConfig;
use crate::policy::speculate::{calib_rows, CALIB_ROWS};
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::KvCache;
use crate::policy::plan::selector_capacity;
use crate::policy::speculate::{self, TrajStep};
use super::Speculate;
use crate::stats::Counters;
use crate::tensor::{DType, TensorRef};
use crate::{bail, ensure};

/// PRR's kernels, compiled in the selection module (the registry's `SELECT_MODULE`).
pub const KERNEL: KernelFile = kernel_file!("prr.cu", "policy/speculate.cu");

/// Bytes of one state entry (kernels/prr.cu `PrrEntry`: level, trend, alpha, beta, gamma, flags).
const ENTRY_BYTES: usize = 24;
const PRR_PARAMS: u32 = 1;
const PRR_PREV: u32 = 2;

/// Phases of a step whose end the bench's timeline records (`set_timeline`), in this order.
pub const TIMELINE: [&str; 8] = ["fork", "side:predict", "side:spec_attn", "side:update", "main:scores", "main:select+repair_plan", "main:repair_attn+merge", "main:join"];

/// One caller stream's side stream, fork/join events and workspace.
struct StreamSet {
    side: CUstream,
    fork: CUevent,
    join_a: CUevent,
    join_b: CUevent,
    /// The Holt update is done (side stream -> caller's stream, the step's end).
    join_c: CUevent,
    /// The true selection is known (caller's stream -> side stream, for the update).
    truth: CUevent,
    /// Timing events (benchmarks), TIMELINE order.
    timing: Option<Vec<CUevent>>,
    ws: Option<DevBuf>,
}

// SAFETY: the handles are plain driver handles used under the engine's locks.
unsafe impl Send for StreamSet {}

impl Drop for StreamSet {
    fn drop(&mut self) {
        if let Ok(api) = cuda() {
            // SAFETY: created by us, destroyed once.
            unsafe {
                (api.cuStreamSynchronize)(self.side);
                for e in [self.fork, self.join_a, self.join_b, self.join_c, self.truth].into_iter().chain(self.timing.iter().flatten().copied()) {
                    (api.cuEventDestroy)(e);
                }
                (api.cuStreamDestroy)(self.side);
            }
        }
    }
}

/// PRR's device state of a CUDA engine.
pub struct PrrDevice {
    /// The policy's `speculate` stage, when that is the engine's policy.
    spec: Option<Speculate>,
    /// The selection module, which holds PRR's kernels ([`KERNEL`]) with the other stages'.
    select: Module,
    /// Per layer: entries `[num_blocks][kv_heads][slots per block]`, allocated by the layer's first cache write.
    layers: Vec<Mutex<Option<DevBuf>>>,
    streams: Mutex<HashMap<usize, StreamSet>>,
    /// Counted on the host (calibrations at prefill), per layer.
    host: Vec<Mutex<Counters>>,
    timeline: AtomicBool,
}

impl PrrDevice {
    /// Empty state; [`PrrDevice::set_spec`] arms it when the engine's policy is `speculate`. `select`: the
    /// selection module (the registry's), whose files PRR's launches compile.
    pub fn new(cfg: &EngineConfig, select: Module) -> Self {
        PrrDevice {
            spec: None,
            select,
            layers: (0..cfg.num_layers).map(|_| Mutex::new(None)).collect(),
            streams: Mutex::new(HashMap::new()),
            host: (0..cfg.num_layers).map(|_| Mutex::new(Counters::default())).collect(),
            timeline: AtomicBool::new(false),
        }
    }

    /// The engine's parsed `speculate` stage (set once, when the backend is made).
    pub fn set_spec(&mut self, spec: Speculate) {
        self.spec = Some(spec);
    }

    /// Host-side counters of `layer` (calibrations), added to the device counters by the stats call.
    pub fn host_counters(&self, layer: usize) -> Counters {
        self.host.get(layer).map_or_else(Counters::default, |c| c.lock().clone())
    }

    /// Destroys the side streams and events while the engine's context is still alive (the backend's
    /// Drop calls this before its fields, the context among them, are dropped).
    pub(crate) fn release(&self) {
        for (_, set) in self.streams.lock().drain() {
            drop(set);
        }
        for l in &self.layers {
            l.lock().take();
        }
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.lock().as_ref().map_or(0, |b| b.bytes)).sum::<usize>() + self.streams.lock().values().map(|s| s.ws.as_ref().map_or(0, |b| b.bytes)).sum::<usize>()
    }
}

/// A capture on a stream that made no eager PRR call takes over the set (side stream, events, workspace)
/// of a stream that did, as `workspace::for_stream` does with split-KV workspaces: serving engines warm
/// up eagerly on one stream and capture on another (vLLM, `torch.cuda.graph`). The smallest set whose
/// workspace holds `need` bytes (and that has timing events when the timeline is on) moves to `key`; its
/// old stream makes a new set at its next eager call. Nothing is allocated, so the capture stays valid.
fn take_over_set(streams: &mut HashMap<usize, StreamSet>, key: usize, need: usize, timeline: bool) {
    let donor = streams
        .iter()
        .filter(|(k, s)| **k != key && s.ws.as_ref().is_some_and(|b| b.bytes >= need) && (!timeline || s.timing.is_some()))
        .min_by_key(|(_, s)| s.ws.as_ref().map_or(0, |b| b.bytes))
        .map(|(k, _)| *k);
    if let Some(d) = donor {
        let set = streams.remove(&d).expect("found above");
        streams.insert(key, set);
    }
}

/// Which `speculate` settings the CUDA backend runs.
pub fn supported(s: &Speculate) -> std::result::Result<(), String> {
    if s.predict != super::Predict::Holt {
        return Err("`speculate` on the CUDA backend predicts with Holt only (`predict=previous|inverse` are CPU baselines)".into());
    }
    if !s.keep_extra {
        return Err("`speculate(extra=drop)` needs attention over the predicted pages that are also true, known only after selection, which defeats speculating on a second stream; the CUDA backend runs `extra=keep` (the default, the paper's)".into());
    }
    Ok(())
}

/// Slots per block: pages no larger than a block have one each, larger pages one in their first block.
fn slots_per_block(bs: usize, page: usize) -> usize {
    bs / page.min(bs)
}

fn bytes_of<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slice viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn oom(what: &str) -> crate::error::Error {
    crate::error::Error::new(crate::error::ErrorKind::OutOfMemory, format!("{what} size overflows"))
}

fn mul(parts: &[usize]) -> Result<usize> {
    parts.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).ok_or_else(|| oom("PRR workspace"))
}

/// Byte offsets of a step's regions in the stream's PRR workspace.
#[derive(Default)]
struct Layout {
    scores: usize,
    pred_scores: usize,
    truth: usize,
    truth_len: usize,
    pred: usize,
    pred_len: usize,
    missed: usize,
    missed_len: usize,
    uni: usize,
    uni_len: usize,
    params: usize,
    o1: usize,
    l1: usize,
    /// kvs_prr_finish: per-row part counters and the parts' partial states.
    done: usize,
    pw_o: usize,
    pw_l: usize,
    total: usize,
}

impl PrrDevice {
    /// Cache-write hook: allocates the layer's PRR state on first use (outside capture) and resets the
    /// entries of the pages whose first slot this write stores.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prr_on_write(&self, dev: &dyn Device, cfg: &EngineConfig, layer: usize, cache: &KvCache, slot_mapping: &TensorRef, n: usize, stream: CUstream) -> Result<()> {
        let Some(sp) = self.spec else {
            return Ok(());
        };
        if n == 0 {
            return Ok(());
        }
        let (nb, bs, hk) = (cache.num_blocks, cfg.block_size, cfg.num_kv_heads);
        let spb = slots_per_block(bs, sp.page);
        let mut g = self.layers[layer].lock();
        let bytes = mul(&[nb, hk, spb, ENTRY_BYTES])?;
        match &*g {
            Some(b) => ensure!(b.bytes == bytes, InvalidShape, "layer {layer}'s PRR state was built for another cache size; one engine layer serves one cache"),
            None => {
                if dev.gpu().is_capturing(stream)? {
                    bail!(InvalidArgument, "layer {layer}'s PRR state would be allocated inside a CUDA graph capture; write the cache of every layer once before capturing");
                }
                let b = DevBuf::alloc(bytes)?;
                // Zeros: every entry a step reads was reset first by the write of its page's first slot.
                // SAFETY: `bytes` bytes.
                unsafe { check((cuda()?.cuMemsetD8Async)(b.ptr, 0, bytes, stream), "cuMemsetD8Async")? };
                *g = Some(b);
            }
        }
        let st = g.as_ref().expect("set above").ptr;
        let f = self.prr_fn(dev, cfg, "kvs_prr_reset")?;
        let mut k = KArgs::new();
        k.ptr(slot_mapping.data).i64(slot_mapping.stride(0) as i64).i32((slot_mapping.dtype == DType::I64) as i32).i32(n as i32);
        k.i64(nb as i64).i32(bs as i32).i32(hk as i32).i32(sp.page.min(bs) as i32).i64(st as i64);
        // After the cache write (kvs_write_step at a decode step): a dependent launch where the GPU has them.
        launch::launch_dependent(dev.pdl(), f, ((n * hk).div_ceil(256).min(65536) as u32, 1, 1), 256, 0, &mut k, stream, "kvs_prr_reset launch")
    }

    fn prr_fn(&self, dev: &dyn Device, cfg: &EngineConfig, name: &'static str) -> Result<crate::cuda::driver::CUfunction> {
        // The selection module with src/cuda/sparse.rs's defines, so one compiled module.
        dev.modules().function(dev.gpu(), "select", self.select, &crate::cuda::sparse::select_defines(cfg), name)
    }

    /// Benchmarks only: record the phases of later PRR steps with timing events (see `timeline`).
    pub fn set_timeline(&self, on: bool) {
        self.timeline.store(on, Ordering::Relaxed);
    }

    /// Benchmarks only: the last PRR step's phase ends on `stream`, in ms after the fork (synchronizes).
    #[allow(clippy::not_unsafe_ptr_arg_deref)] // driver handles (CUstream, CUfunction): opaque, passed to the driver, never dereferenced here
    pub fn timeline(&self, stream: CUstream) -> Result<Vec<(&'static str, f32)>> {
        let map = self.streams.lock();
        let Some(set) = map.get(&(stream as usize)) else {
            return Ok(Vec::new());
        };
        let Some(ev) = &set.timing else {
            return Ok(Vec::new());
        };
        let api = cuda()?;
        let mut out = Vec::new();
        // SAFETY: events of this set, recorded by the last step.
        unsafe {
            check((api.cuStreamSynchronize)(stream), "cuStreamSynchronize")?;
            for (i, &e) in ev.iter().enumerate() {
                let mut ms = 0f32;
                check((api.cuEventElapsedTime)(&mut ms, ev[0], e), "cuEventElapsedTime")?;
                out.push((TIMELINE[i], ms));
            }
        }
        Ok(out)
    }

    /// A PRR layer's call: calibration for the prefill chunks (host sync; refused under capture), then
    /// the decode rows' predict / speculate / select / repair / merge on two streams, and the prefill rows
    /// densely.
    pub(crate) fn prr_forward(&self, dev: &dyn Device, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry, sp: &Speculate) -> Result<()> {
        let (hk, bs, d, nq) = (cfg.num_kv_heads, cfg.block_size, cfg.head_dim, cfg.num_q_heads);
        let ns = geo.num_seqs;
        ensure!(ns < 65536, Unsupported, "policies on the CUDA backend take at most 65535 sequences per call (got {ns})");
        let stream = a.stream;
        let page = sp.page;
        let ulog2 = page.trailing_zeros() as i32;
        let spb = slots_per_block(bs, page);
        let maxp = geo.max_pos.div_ceil(page) + 1;
        let k_spec = sp.budget.unwrap_or(sp.quest_budget).div_ceil(page).max(1);
        let t_cap = selector_capacity(&crate::policy::quest::Quest { budget: sp.quest_budget, page, sink: sp.quest_sink }, bs, geo.max_pos).max(1);
        let p_cap = k_spec.min(maxp).max(1);
        let (m_cap, u_cap) = (t_cap, p_cap + t_cap);
        ensure!(u_cap < i32::MAX as usize && maxp < i32::MAX as usize, Unsupported, "PRR plan too large for 32-bit indices");
        let es = cfg.dtype.size_bytes();
        let nt = geo.num_tokens;

        let mut lay = Layout::default();
        let mut off = 0usize;
        let mut take = |bytes: usize| -> usize {
            let at = off;
            off = (off + bytes).next_multiple_of(256);
            at
        };
        lay.scores = take(mul(&[ns, hk, maxp, 4])?);
        lay.pred_scores = take(mul(&[ns, hk, maxp, 4])?);
        lay.truth = take(mul(&[ns, hk, t_cap, 4])?);
        lay.truth_len = take(mul(&[ns, hk, 4])?);
        lay.pred = take(mul(&[ns, hk, p_cap, 4])?);
        lay.pred_len = take(mul(&[ns, hk, 4])?);
        lay.missed = take(mul(&[ns, hk, m_cap, 4])?);
        lay.missed_len = take(mul(&[ns, hk, 4])?);
        lay.uni = take(mul(&[ns, hk, u_cap, 4])?);
        lay.uni_len = take(mul(&[ns, hk, 4])?);
        lay.params = take(mul(&[ns, hk, 4, 4])?);
        lay.o1 = take(mul(&[nt, nq, d, es])?);
        lay.l1 = take(mul(&[nt, nq, 4])?);
        // The repair's parts: enough that a row whose whole truth was missed spreads over several CTAs.
        let parts = ((m_cap << ulog2).min(geo.max_len.max(1))).div_ceil(512).clamp(1, 8); // <= PRR_FIN_MAX_PARTS
        let group = cfg.group_size();
        lay.done = take(mul(&[ns, hk, 4])?);
        lay.pw_o = take(mul(&[ns, hk, parts, group, d, 4])?);
        lay.pw_l = take(mul(&[ns, hk, parts, group, 4])?);
        lay.total = off.max(256);

        let meta_guard = dev.meta().layer(a.layer);
        let Some(m) = meta_guard.as_ref() else {
            bail!(InvalidArgument, "policy {:?} needs key metadata for layer {}, but no cache write for that layer went through kvs_cache_write", cfg.policy, a.layer);
        };
        ensure!(m.num_blocks == cache.num_blocks, InvalidShape, "layer {}'s key metadata was built for {} blocks, the caches have {}", a.layer, m.num_blocks, cache.num_blocks);
        let st_guard = self.layers[a.layer].lock();
        let Some(st) = st_guard.as_ref().map(|b| b.ptr) else {
            bail!(InvalidArgument, "policy {:?} keeps PRR state for layer {}, but no cache write for that layer went through kvs_cache_write", cfg.policy, a.layer);
        };
        let batch = BatchArg::new(a, geo, cache);
        let capturing = dev.gpu().is_capturing(stream)?;

        // Prefill chunks: calibration (synchronous).
        if a.max_query_len != 1 {
            ensure!(!capturing, InvalidArgument, "a PRR call that may hold a prefill chunk (max_query_len != 1) calibrates on the host and synchronizes; it cannot be captured in a CUDA graph (capture decode steps only, with max_query_len = 1)");
            self.prr_calibrate(dev, cfg, a, geo, sp, &batch, m, st, spb)?;
        }

        let api = cuda()?;
        let mut streams = self.streams.lock();
        let key = stream as usize;
        let timeline = self.timeline.load(Ordering::Relaxed);
        if capturing && !streams.contains_key(&key) {
            take_over_set(&mut streams, key, lay.total, timeline);
        }
        if !streams.contains_key(&key) || (timeline && streams[&key].timing.is_none()) {
            ensure!(!capturing, InvalidArgument, "PRR's side stream and events for this stream would be created inside a CUDA graph capture, and no stream of this engine holds a set large enough to hand over; run one PRR call of the largest shape (on any stream) before capturing");
            let mk_event = |flags: u32| -> Result<CUevent> {
                let mut e = std::ptr::null_mut();
                // SAFETY: out-parameter; destroyed with the set.
                check(unsafe { (api.cuEventCreate)(&mut e, flags) }, "cuEventCreate")?;
                Ok(e)
            };
            if let Some(old) = streams.remove(&key) {
                // The timing events are added to an existing set: keep its workspace.
                let mut set = old;
                set.timing = Some((0..TIMELINE.len()).map(|_| mk_event(0)).collect::<Result<Vec<_>>>()?);
                streams.insert(key, set);
            } else {
                let mut side = std::ptr::null_mut();
                // SAFETY: out-parameter; destroyed with the set.
                check(unsafe { (api.cuStreamCreate)(&mut side, CU_STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
                const DISABLE_TIMING: u32 = 2;
                let set = StreamSet {
                    side,
                    fork: mk_event(DISABLE_TIMING)?,
                    join_a: mk_event(DISABLE_TIMING)?,
                    join_b: mk_event(DISABLE_TIMING)?,
                    join_c: mk_event(DISABLE_TIMING)?,
                    truth: mk_event(DISABLE_TIMING)?,
                    timing: if timeline { Some((0..TIMELINE.len()).map(|_| mk_event(0)).collect::<Result<Vec<_>>>()?) } else { None },
                    ws: None,
                };
                streams.insert(key, set);
            }
        }
        let set = streams.get_mut(&key).expect("inserted above");
        if set.ws.as_ref().map_or(true, |b| b.bytes < lay.total) {
            ensure!(
                !capturing,
                InvalidArgument,
                "this call needs {} bytes of PRR workspace on a stream that is being captured; run one call of the largest shape on this stream before capturing",
                lay.total
            );
            if let Some(old) = set.ws.replace(DevBuf::alloc(lay.total.checked_next_power_of_two().unwrap_or(lay.total))?) {
                dev.retired().lock().push(old);
            }
        }
        let ws = set.ws.as_ref().expect("allocated above").ptr;
        // Benchmarks only: KVS_PRR_ONE_STREAM=1 runs the side stream's work on the caller's stream (in the
        // same order), to measure what the overlap gains against the same kernels run one after another.
        let side = if std::env::var("KVS_PRR_ONE_STREAM").is_ok_and(|v| v == "1") { stream } else { set.side };
        let tev = if timeline { set.timing.clone() } else { None };
        let mark = |i: usize, s: CUstream| -> Result<()> {
            if let Some(ev) = &tev {
                // SAFETY: our event, a live stream.
                check(unsafe { (api.cuEventRecord)(ev[i], s) }, "cuEventRecord")?;
            }
            Ok(())
        };
        let at = |o: usize| ws + o as u64;
        let f = |name: &'static str| self.prr_fn(dev, cfg, name);
        let ctr = dev.layer_counters(a.layer) as i64;
        let row_bytes = (2 * d * cfg.cache_dtype.size_bytes()) as i64;
        let smem_keys = maxp.min((dev.gpu().smem_optin as usize).saturating_sub(4096) / 4);
        let plan = |e: usize, len: usize, cap: usize| PlanRef { e: at(e), p_s: (hk * cap) as i64, p_h: cap as i64, len: at(len), ulog2, hk: hk as i32, cap: cap as i32, pad: 0 };
        let (fa, fb, fg) = (sp.alpha.unwrap_or(speculate::DEFAULT_PARAMS.alpha), sp.beta.unwrap_or(speculate::DEFAULT_PARAMS.beta), sp.gamma.unwrap_or(speculate::DEFAULT_PARAMS.gamma));
        let clamp = |v: usize| v.min(i32::MAX as usize) as i32;
        // The step's kernels start with KVS_GRID_WAIT(): dependent launches of the kernel before them on their
        // stream where the GPU has them (the wait also covers what an event wait before a launch orders).
        let pdl = dev.pdl();

        // Fork.
        mark(0, stream)?;
        // SAFETY: our events and streams; `done` lies inside the workspace (Layout).
        unsafe {
            check((api.cuEventRecord)(set.fork, stream), "cuEventRecord")?;
            check((api.cuStreamWaitEvent)(side, set.fork, 0), "cuStreamWaitEvent")?;
            check((api.cuMemsetD32Async)(at(lay.done), 0, ns * hk, side), "cuMemsetD32Async")?;
        }
        // Side stream: predicted scores and the speculative set, then attention over it.
        let mut k = KArgs::new();
        k.by_value(&batch).i32(hk as i32).i32(page as i32).i64(st as i64).i32(spb as i32).i64(at(lay.pred_scores) as i64).i32(maxp as i32);
        launch::launch_dependent(pdl, f("kvs_prr_pred_scores")?, (maxp.div_ceil(256) as u32, hk as u32, ns as u32), 256, 0, &mut k, side, "kvs_prr_pred_scores launch")?;
        let smem_fn = |name: &'static str| -> Result<crate::cuda::driver::CUfunction> {
            let func = f(name)?;
            dev.allow_smem_once(func, (dev.gpu().smem_optin as usize).saturating_sub(4096))?;
            Ok(func)
        };
        let mut k = KArgs::new();
        k.by_value(&batch).i32(hk as i32).i32(clamp(k_spec)).i32(page as i32).f32(fa).f32(fb).f32(fg).i64(st as i64).i32(spb as i32);
        k.i64(at(lay.pred_scores) as i64).i32(maxp as i32).i64(at(lay.pred) as i64).i64(at(lay.pred_len) as i64).i32(p_cap as i32).i64(at(lay.params) as i64).i32(smem_keys as i32);
        launch::launch_dependent(pdl, smem_fn("kvs_prr_predict")?, (hk as u32, ns as u32, 1), launch::TOPK_THREADS, (smem_keys * 4) as u32, &mut k, side, "kvs_prr_predict launch")?;
        mark(1, side)?;
        // SAFETY: our event and stream.
        unsafe { check((api.cuEventRecord)(set.join_a, side), "cuEventRecord")? };
        let view = |o: usize, dt: DType, shape: &[i64], strides: &[i64]| -> Result<TensorRef> {
            // SAFETY: a region of our workspace sized for this shape (Layout).
            unsafe { TensorRef::from_raw(at(o) as usize as *mut u8, dt, cfg.device, shape, Some(strides)) }
        };
        let (nt64, nq64, d64) = (nt as i64, nq as i64, d as i64);
        let mut spec = *a;
        spec.out = view(lay.o1, cfg.dtype, &[nt64, nq64, d64], &[nq64 * d64, d64, 1])?;
        spec.lse = Some(view(lay.l1, DType::F32, &[nt64, nq64], &[nq64, 1])?);
        spec.stream = side;
        let pred_ref = plan(lay.pred, lay.pred_len, p_cap);
        dev.attend(cfg, &spec, cache, geo, Rows::Plan(pred_ref, (p_cap << ulog2).min(geo.max_len), None))?;
        mark(2, side)?;
        // SAFETY: our event and stream.
        unsafe { check((api.cuEventRecord)(set.join_b, side), "cuEventRecord")? };

        // Caller's stream: Quest scores (counting the call's rows).
        let q = &a.query;
        let mut k = KArgs::new();
        k.by_value(&batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).i32(hk as i32);
        k.i64(m.qmin.as_ref().map_or(0, |b| b.ptr) as i64).i64(m.qmax.as_ref().map_or(0, |b| b.ptr) as i64).i32(m.unit as i32).i32(m.units_per_block as i32).i32(page as i32);
        k.i64(at(lay.scores) as i64).i32(maxp as i32).i32(1).i64(row_bytes).i64(ctr);
        launch::launch_dependent(pdl, f("kvs_quest_scores")?, (maxp.div_ceil(64) as u32, hk as u32, ns as u32), 256, 0, &mut k, stream, "kvs_quest_scores launch")?;
        mark(4, stream)?;
        // Join A (the speculative set is known, and the predictions have read the state): the true
        // selection, the missed pages, the union and the counters, in one kernel.
        // SAFETY: our event, the caller's stream.
        unsafe { check((api.cuStreamWaitEvent)(stream, set.join_a, 0), "cuStreamWaitEvent")? };
        let mut k = KArgs::new();
        k.by_value(&batch).i32(hk as i32).i32(clamp(sp.quest_budget)).i32(page as i32).i32(clamp(sp.quest_sink));
        k.i64(at(lay.scores) as i64).i32(maxp as i32).i64(at(lay.truth) as i64).i64(at(lay.truth_len) as i64).i32(t_cap as i32);
        k.i64(at(lay.pred) as i64).i64(at(lay.pred_len) as i64).i32(p_cap as i32);
        k.i64(at(lay.missed) as i64).i64(at(lay.missed_len) as i64).i32(m_cap as i32).i64(at(lay.uni) as i64).i64(at(lay.uni_len) as i64).i32(u_cap as i32);
        k.i64(row_bytes).i32(smem_keys as i32).i64(ctr);
        launch::launch_dependent(pdl, smem_fn("kvs_prr_select")?, (hk as u32, ns as u32, 1), launch::TOPK_THREADS, (smem_keys * 4) as u32, &mut k, stream, "kvs_prr_select launch")?;
        mark(5, stream)?;
        // Side stream, once its speculative attention is done and the truth is known: the Holt update.
        // SAFETY: our events and streams.
        unsafe {
            check((api.cuEventRecord)(set.truth, stream), "cuEventRecord")?;
            check((api.cuStreamWaitEvent)(side, set.truth, 0), "cuStreamWaitEvent")?;
        }
        let mut k = KArgs::new();
        k.by_value(&batch).i32(hk as i32).i32(page as i32).i64(at(lay.scores) as i64).i32(maxp as i32).i64(at(lay.truth) as i64).i64(at(lay.truth_len) as i64).i32(t_cap as i32);
        k.i64(st as i64).i32(spb as i32).i64(at(lay.params) as i64).i64(ctr);
        launch::launch_dependent(pdl, f("kvs_prr_update")?, (maxp.div_ceil(256) as u32, hk as u32, ns as u32), 256, 0, &mut k, side, "kvs_prr_update launch")?;
        mark(3, side)?;
        // SAFETY: our event and stream.
        unsafe { check((api.cuEventRecord)(set.join_c, side), "cuEventRecord")? };
        if a.max_query_len != 1 {
            dev.attend(cfg, a, cache, geo, Rows::DenseRest)?;
        }
        // Join B (the speculative attention is done): attention over the missed pages, merged with it.
        // SAFETY: our event, the caller's stream.
        unsafe { check((api.cuStreamWaitEvent)(stream, set.join_b, 0), "cuStreamWaitEvent")? };
        let (lse_ptr, l0, l1) = match &a.lse {
            Some(l) => (l.data as i64, l.stride(0) as i64, l.stride(1) as i64),
            None => (0, 0, 0),
        };
        let (kc, vc) = (&cache.k, &cache.v);
        let mut k = KArgs::new();
        k.by_value(&batch).i32(hk as i32).i32(nq as i32).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).f32(a.softcap);
        k.ptr(kc.data).i64(kc.stride(0) as i64).i64(kc.stride(1) as i64).i64(kc.stride(2) as i64);
        k.ptr(vc.data).i64(vc.stride(0) as i64).i64(vc.stride(1) as i64).i64(vc.stride(2) as i64);
        k.i64(at(lay.missed) as i64).i64(at(lay.missed_len) as i64).i32(m_cap as i32).i32(ulog2);
        k.i64(at(lay.o1) as i64).i64(at(lay.l1) as i64).i64(at(lay.pw_o) as i64).i64(at(lay.pw_l) as i64).i64(at(lay.done) as i64);
        k.ptr(a.out.data).i64(a.out.stride(0) as i64).i64(a.out.stride(1) as i64).i64(a.out.stride(2) as i64).i64(lse_ptr).i64(l0).i64(l1);
        k.f32(cache.k_scale).f32(cache.v_scale);
        launch::launch_dependent(pdl, f("kvs_prr_finish")?, (ns as u32, hk as u32, parts as u32), 128, 0, &mut k, stream, "kvs_prr_finish launch")?;
        mark(6, stream)?;
        // Join C: the update is done; the step ends on the caller's stream.
        // SAFETY: our event, the caller's stream.
        unsafe { check((api.cuStreamWaitEvent)(stream, set.join_c, 0), "cuStreamWaitEvent")? };
        mark(7, stream)?;
        drop(streams);
        drop(st_guard);
        drop(meta_guard);
        dev.set_last_plan(plan(lay.uni, lay.uni_len, u_cap), ns);
        Ok(())
    }

    /// Calibration of the call's prefill chunks (synchronous): the calibration rows' Quest page scores on
    /// the device, the CPU's `speculate::calibrate` per (sequence, KV head) on the host, the warm state
    /// scattered into the block-keyed entries.
    #[allow(clippy::too_many_arguments)]
    fn prr_calibrate(&self, dev: &dyn Device, cfg: &EngineConfig, a: &ForwardArgs, geo: &Geometry, sp: &Speculate, batch: &BatchArg, m: &crate::cuda::meta::LayerDevMeta, st: u64, spb: usize) -> Result<()> {
        let t0 = std::time::Instant::now();
        let (hk, ns, page) = (cfg.num_kv_heads, geo.num_seqs, sp.page);
        let api = cuda()?;
        let stream = a.stream;
        // SAFETY: the caller's stream.
        check(unsafe { (api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")?;
        let qsl = download_ints(&a.query_start_loc, ns + 1)?;
        let lens = download_ints(&a.seq_lens, ns)?;
        let window = a.sliding_window.max(0) as usize;
        // (sequence, its calibration rows as (s, t, lo, hi)).
        let mut seqs: Vec<(usize, Vec<[i32; 4]>)> = Vec::new();
        for s in 0..ns {
            let (q0, q1) = (qsl[s], qsl[s + 1]);
            let q_len = q1 - q0;
            let len = lens[s].clamp(0, geo.max_pos as i64);
            if q_len == 1 || q_len <= 0 || q0 < 0 || q1 > geo.num_tokens as i64 || len < q_len {
                continue;
            }
            let rows = calib_rows(q0 as usize, q_len as usize, CALIB_ROWS);
            let first_pos = (len - q_len) as usize;
            let v = rows
                .iter()
                .map(|&t| {
                    let pos = first_pos + (t - q0 as usize);
                    let lo = if window == 0 { 0 } else { (pos + 1).saturating_sub(window) };
                    [s as i32, t as i32, lo as i32, pos as i32]
                })
                .collect();
            seqs.push((s, v));
        }
        if seqs.is_empty() {
            return Ok(());
        }
        let rows: Vec<[i32; 4]> = seqs.iter().flat_map(|(_, v)| v.iter().copied()).collect();
        let tmaxp = rows.iter().map(|r| (r[3] as usize) / page - (r[2] as usize) / page + 1).max().unwrap_or(1);
        let rows_d = DevBuf::from_host(bytes_of(&rows))?;
        let traj_bytes = mul(&[rows.len(), hk, tmaxp, 4])?;
        let traj_d = DevBuf::alloc(traj_bytes)?;
        let q = &a.query;
        let mut k = KArgs::new();
        k.by_value(batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).i32(hk as i32);
        k.i64(m.qmin.as_ref().map_or(0, |b| b.ptr) as i64).i64(m.qmax.as_ref().map_or(0, |b| b.ptr) as i64).i32(m.unit as i32).i32(m.units_per_block as i32).i32(page as i32);
        k.i64(rows_d.ptr as i64).i64(traj_d.ptr as i64).i32(tmaxp as i32);
        launch::launch(self.prr_fn(dev, cfg, "kvs_prr_traj_scores")?, (tmaxp.div_ceil(64) as u32, hk as u32, rows.len() as u32), 256, &mut k, stream, "kvs_prr_traj_scores launch")?;
        // SAFETY: the caller's stream.
        check(unsafe { (api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")?;
        let mut raw = vec![0u8; traj_bytes];
        traj_d.download(0, &mut raw)?;
        let traj: Vec<f32> = raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect();

        // The CPU's calibration, per (sequence, KV head).
        let spec_tokens = sp.budget.unwrap_or(sp.quest_budget);
        let (k_spec, k_true) = (spec_tokens.div_ceil(page), sp.quest_budget.div_ceil(page));
        let cands = speculate::grid(sp.alpha, sp.beta, sp.gamma);
        let mut items = Vec::new();
        let mut row0 = 0usize;
        for (j, (_, v)) in seqs.iter().enumerate() {
            for h in 0..hk {
                items.push((j, h, row0, v.len()));
            }
            row0 += v.len();
        }
        use rayon::prelude::*;
        let warm: Vec<speculate::PrrHead> = items
            .par_iter()
            .map(|&(_, h, r0, nr)| {
                let steps: Vec<TrajStep> = (r0..r0 + nr)
                    .map(|r| {
                        let (lo, hi) = (rows[r][2] as usize, rows[r][3] as usize);
                        let np = hi / page - lo / page + 1;
                        let at = (r * hk + h) * tmaxp;
                        (lo / page, traj[at..at + np].to_vec())
                    })
                    .collect();
                speculate::calibrate(&steps, &cands, k_spec, k_true).warm
            })
            .collect();
        let smaxp = warm.iter().map(|w| w.holt.len()).max().unwrap_or(0).max(1);
        // Pages past a head's trajectory (none: every head has the same rows) would be written as reset.
        let reset: Vec<u8> = [f32::NAN.to_bits(), 0, 0, 0, 0, 0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut src = reset.repeat(mul(&[seqs.len(), hk, smaxp])?);
        let mut npages = vec![0i32; seqs.len()];
        for (&(j, h, _, _), w) in items.iter().zip(&warm) {
            npages[j] = npages[j].max(w.holt.len() as i32);
            for (pg, &(l, t)) in w.holt.iter().enumerate() {
                let flags = PRR_PARAMS | if w.prev_true.binary_search(&pg).is_ok() { PRR_PREV } else { 0 };
                let at = ((j * hk + h) * smaxp + pg) * ENTRY_BYTES;
                for (i, x) in [l.to_bits(), t.to_bits(), w.params.alpha.to_bits(), w.params.beta.to_bits(), w.params.gamma.to_bits(), flags].iter().enumerate() {
                    src[at + 4 * i..at + 4 * i + 4].copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        let seq_ids: Vec<i32> = seqs.iter().map(|(s, _)| *s as i32).collect();
        let (seqs_d, np_d, src_d) = (DevBuf::from_host(bytes_of(&seq_ids))?, DevBuf::from_host(bytes_of(&npages))?, DevBuf::from_host(&src)?);
        let mut k = KArgs::new();
        k.by_value(batch).i32(hk as i32).i32(page as i32).i32(spb as i32).i64(seqs_d.ptr as i64).i64(np_d.ptr as i64).i64(src_d.ptr as i64).i32(smaxp as i32).i64(st as i64);
        launch::launch(self.prr_fn(dev, cfg, "kvs_prr_scatter")?, (smaxp.div_ceil(256) as u32, hk as u32, seqs.len() as u32), 256, &mut k, stream, "kvs_prr_scatter launch")?;
        // The temporary buffers must outlive the launches that read them.
        // SAFETY: the caller's stream.
        check(unsafe { (api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")?;
        let mut h = self.host[a.layer].lock();
        h[speculate::CALIBRATIONS] += items.len() as u64;
        h[speculate::CALIB_US] += t0.elapsed().as_micros() as u64;
        Ok(())
    }
}

impl PolicyDevice for PrrDevice {
    fn on_cache_write(&self, dev: &dyn Device, cfg: &EngineConfig, layer: usize, cache: &KvCache, slots: &TensorRef, n: usize, stream: CUstream) -> Result<()> {
        self.prr_on_write(dev, cfg, layer, cache, slots, n, stream)
    }

    fn add_counters(&self, _gpu: &crate::cuda::context::Gpu, per_layer: &mut [Counters]) -> Result<()> {
        for (l, c) in per_layer.iter_mut().enumerate() {
            let h = self.host_counters(l);
            c[speculate::CALIBRATIONS] += h[speculate::CALIBRATIONS];
            c[speculate::CALIB_US] += h[speculate::CALIB_US];
        }
        Ok(())
    }

    fn release(&self) {
        PrrDevice::release(self)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// PRR's stage: a whole call of its own (two streams, its own attention launches).
pub(crate) struct PrrStage<'a> {
    /// The engine's PRR state (None: not made, an internal error).
    pub state: Option<&'a PrrDevice>,
    pub sp: Speculate,
}

impl CudaStage for PrrStage<'_> {
    fn forward(&self, dev: &dyn Device, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry) -> Option<Result<()>> {
        Some(match self.state {
            Some(s) => s.prr_forward(dev, cfg, a, cache, geo, &self.sp),
            None => Err(crate::error::Error::new(crate::error::ErrorKind::Internal, "the CUDA backend holds no PRR state")),
        })
    }
}
