//! RefreshKV on the CUDA backend (kernels/refresh.cu): the schedule, the full step's scores and the token
//! sets on the device, per sequence slot (src/cuda/slots.rs), so a decode step has no host decision and
//! stays capturable. The schedule and the prefill's seed are the CPU engine's decisions bit for bit
//! (`policy::refresh`, `cpu::sparse::run_refresh`); a full decode step's weights come out of its own
//! attention on tensor cores (the kernel writes the logits and its splits' softmax statistics,
//! `Rows::PlanLogits`; the set is rebuilt from them after the attention) and agree with the CPU's within the margin
//! docs/policies.md states (FP8 caches included: the kernel's FP8 variant writes the logits of the keys
//! decoded times k_scale). Where the tensor-core kernel does not apply (f32 caches, unaligned rows), the
//! full step scores in the CPU's arithmetic before the attention, as the prefill's seed does (FP8 keys
//! decoded times k_scale, as the CPU reads them): the CPU's bits.
//!
//! Plans: token-granular (unit_log2 = 0) with a capacity of the block table's width, because a full step
//! (which the host cannot foresee) visits every visible position; the attention launch is therefore sized
//! for dense rows, and a partial step's rows use the first of its splits (docs/perf.md measures it).
//!
//! State: one device buffer per layer, allocated on the layer's first call (outside capture), indexed by
//! slot: the reference mean query, steps since the last full step and a generation stamp; per KV head
//! the set's `k` positions and scores, its size, the last position seen and a stamp. Counters of full and
//! partial steps per layer are kept here (the engine's stats call adds them to the device counters).

use parking_lot::Mutex;

use crate::cuda::batch::{BatchArg, Geometry, LogitsOut, PlanRef, Rows};
use crate::cuda::context::DevBuf;
use crate::cuda::driver::{check, cuda, CUfunction};
use crate::cuda::kernel_src::{kernel_file, KernelFile};
use crate::cuda::launch::{self, KArgs, CLUSTER_CTAS};
use crate::cuda::stage::{CallShape, CudaStage, Device, PolicyDevice, StepCx, WsAlloc};
use crate::args::ForwardArgs;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::KvCache;
use super::Refresh;
use crate::stats::Counters;
use crate::{bail, ensure};

/// RefreshKV's kernels, compiled in the selection module (the registry's `SELECT_MODULE`).
pub const KERNEL: KernelFile = kernel_file!("refresh.cu", "policy/refresh.cu");

/// The kernels' `RefreshArgs` (kernels/policy/refresh.cu; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RefreshArgs {
    qref: u64,
    since: u64,
    lstamp: u64,
    tok: u64,
    sc: u64,
    cnt: u64,
    last: u64,
    hstamp: u64,
    slot: u64,
    gen: u64,
    mode: u64,
    rctr: u64,
    k: i32,
    stride: i32,
    every: i32,
    pool: i32,
    s: f32,
    hk: i32,
}

/// The layout a test compares with kernels/policy/refresh.cu.
#[cfg(test)]
pub(crate) fn c_layouts() -> Vec<crate::cuda::kernel_src::CLayout> {
    use crate::cuda::kernel_src::c_layout;
    vec![c_layout!(RefreshArgs as "RefreshArgs" { qref, since, lstamp, tok, sc, cnt, last, hstamp, slot, gen, mode, rctr, k, stride, every, pool, s, hk })]
}

/// Byte offsets of RefreshKV's regions in a call's policy workspace.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RefreshWs {
    mode: usize,
    rmax: usize,
    z: usize,
    bad: usize,
    agg: usize,
    pooled: usize,
    tmp: usize,
    /// The full rows' logits from their attention ([ns, hk, max_pos, group] f32) and its splits' softmax
    /// statistics ([ns, hk, group, LOGIT_PARTS] f32 pairs); empty without the tensor-core path.
    lg: usize,
    parts: usize,
    /// The multi-CTA rebuild's radix histograms ([ns, hk, 3, 4096] u32), selections and arrival counts
    /// ([ns, hk, SEL_WORDS] u32) and the last pass's per-chunk counts ([ns, hk, chunks, CHUNK_COUNT_WORDS]
    /// u32).
    hist: usize,
    sel: usize,
    ccnt: usize,
    /// Whether the full step's weights come from its attention (the tensor-core kernel applies).
    pub(crate) logits: bool,
}

/// Positions per chunk of the weights pass and the rebuild (kernels/refresh.cu RF_CH).
const WEIGHT_CHUNK: usize = 2048;
/// Slots per query head for the attention's split statistics (the logits' launch splits no more).
const LOGIT_PARTS: usize = 64;
/// Threads per CTA of the rebuild's launches (kernels/refresh.cu RF_WTHREADS: its chunk loops assume it).
const WEIGHT_THREADS: u32 = 256;
/// Bins of the rebuild's radix histograms (kernels/refresh.cu RF_BINS).
const HIST_BINS: usize = 4096;
/// Words per row of the rebuild's selection state (kernels/refresh.cu RF_SEL).
const SEL_WORDS: usize = 4;
/// Words per chunk of the rebuild's last-pass counts (kernels/refresh.cu RF_CCW).
const CHUNK_COUNT_WORDS: usize = 258;
/// Static shared memory of kvs_refresh_top_cluster, at most (its staged weights, split statistics and
/// the cluster's scratch): the rest of the device's opt-in limit holds its part of the row's keys.
const CLUSTER_STATIC_SMEM: usize = 32 << 10;
/// Threads per CTA of kvs_refresh_top_cluster (kernels/policy/refresh.cu RC_THREADS).
const CLUSTER_THREADS: u32 = 1024;

/// Rows up to this many positions rebuild on a cluster; longer ones by the chunked launches.
const CLUSTER_MAX_POS: usize = 65536;

/// Whether the full rows' sets are rebuilt on thread-block clusters (one launch,
/// kvs_refresh_top_cluster) rather than by the four chunked launches: on sm_90 and newer, while the
/// rows' clusters fit in one wave of one CTA per SM (batch 1-2 at 8 KV heads on an H100) and the rows
/// are at most CLUSTER_MAX_POS long. The cluster kernel costs ~23 µs whatever the row (its passes'
/// barriers) plus ~0.4 µs per 1K positions (H100: 22.8 / 33.6 / 70 µs at 4K / 32K / 128K), the chunked
/// launches ~9 µs each from 32K; each partial step also launches one empty kernel instead of four
/// (journal 2026-11-28). KVS_BENCH_REFRESH_CHUNKS=1 keeps the chunked launches everywhere, so that
/// benches and tests can hold the two to each other.
fn cluster_rebuild(gpu: &crate::cuda::context::Gpu, ns: usize, hk: usize, max_pos: usize) -> bool {
    static CHUNKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let chunks = *CHUNKS.get_or_init(|| std::env::var("KVS_BENCH_REFRESH_CHUNKS").is_ok_and(|v| v == "1"));
    !chunks && gpu.cc.0 >= 9 && max_pos <= CLUSTER_MAX_POS && launch::clusters_fit_one_wave(ns.saturating_mul(hk), gpu.num_sms.max(0) as usize)
}

fn weight_chunks(max_pos: usize) -> usize {
    max_pos.max(1).div_ceil(WEIGHT_CHUNK)
}

fn checked(parts: &[usize]) -> Result<usize> {
    parts.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).ok_or_else(|| Error::new(ErrorKind::OutOfMemory, "RefreshKV workspace size overflows"))
}

impl RefreshWs {
    /// Where the full rows' logits go (`Rows::PlanLogits`), in the workspace at `ws`.
    pub(crate) fn logits_out(&self, geo: &Geometry, ws: u64) -> LogitsOut {
        LogitsOut { lg: ws + self.lg as u64, maxpos: geo.max_pos.max(1) as i32, parts: ws + self.parts as u64, nparts: LOGIT_PARTS as i32 }
    }

    /// Reserves the regions of a call of `ns` sequences through `take` (bytes -> offset).
    /// `logits`: the full step's weights come from its attention (reserves the logits and statistics).
    pub(crate) fn reserve(take: &mut dyn FnMut(usize) -> usize, ns: usize, hk: usize, group: usize, max_pos: usize, k: usize, logits: bool) -> Result<Self> {
        let rows = checked(&[ns, hk, group])?;
        let heads = checked(&[ns, hk])?;
        let (lg, parts) = if logits { (take(checked(&[rows, max_pos.max(1), 4])?), take(checked(&[rows, LOGIT_PARTS, 8])?)) } else { (0, 0) };
        let (hist, sel, ccnt) = if logits { (take(checked(&[heads, 3 * HIST_BINS, 4])?), take(checked(&[heads, SEL_WORDS, 4])?), take(checked(&[heads, weight_chunks(max_pos), CHUNK_COUNT_WORDS, 4])?)) } else { (0, 0, 0) };
        Ok(RefreshWs {
            lg,
            parts,
            hist,
            sel,
            ccnt,
            logits,
            mode: take(checked(&[ns, 4])?),
            rmax: take(checked(&[rows, 4])?),
            z: take(checked(&[rows, 8])?),
            bad: take(checked(&[rows, 4])?),
            agg: take(checked(&[ns, hk, max_pos.max(1), 4])?),
            pooled: take(checked(&[ns, hk, max_pos.max(1), 4])?),
            tmp: take(checked(&[ns, hk, k, 4])?),
        })
    }
}

/// Offsets of one layer's state arrays inside its buffer (all 256-byte aligned).
#[derive(Clone, Copy, Debug)]
struct StateLayout {
    qref: usize,
    since: usize,
    lstamp: usize,
    tok: usize,
    sc: usize,
    cnt: usize,
    last: usize,
    hstamp: usize,
    total: usize,
}

impl StateLayout {
    fn new(max_seqs: usize, hk: usize, d: usize, k: usize) -> Result<Self> {
        let mut off = 0usize;
        let mut take = |bytes: usize| -> usize {
            let at = off;
            off = (off + bytes).next_multiple_of(256);
            at
        };
        let per = |n: usize| crate::cuda::slots::state_bytes(max_seqs, n);
        let l = StateLayout {
            qref: take(per(checked(&[d, 4])?)?),
            since: take(per(4)?),
            lstamp: take(per(4)?),
            tok: take(per(checked(&[hk, k, 4])?)?),
            sc: take(per(checked(&[hk, k, 4])?)?),
            cnt: take(per(checked(&[hk, 4])?)?),
            last: take(per(checked(&[hk, 4])?)?),
            hstamp: take(per(checked(&[hk, 4])?)?),
            total: 0,
        };
        Ok(StateLayout { total: off.max(256), ..l })
    }
}

/// RefreshKV's device state of an engine: per layer, the state buffer (allocated on first use) and two
/// counters (full steps, partial steps).
pub struct RefreshDevice {
    layers: Mutex<Vec<Option<DevBuf>>>,
    counters: DevBuf,
    num_layers: usize,
}

impl RefreshDevice {
    pub fn new(num_layers: usize) -> Result<Self> {
        let bytes = checked(&[num_layers.max(1), 16])?;
        let counters = DevBuf::alloc(bytes)?;
        counters.upload(0, &vec![0u8; bytes])?;
        Ok(RefreshDevice { layers: Mutex::new((0..num_layers).map(|_| None).collect()), counters, num_layers })
    }

    /// Adds the per-layer step counters to `per_layer` (the caller synchronized the device).
    pub(crate) fn add_counters(&self, per_layer: &mut [Counters]) -> Result<()> {
        let mut raw = vec![0u8; self.num_layers * 16];
        self.counters.download(0, &mut raw)?;
        for (l, c) in per_layer.iter_mut().enumerate().take(self.num_layers) {
            let at = l * 16;
            c[super::FULL_STEPS] += u64::from_le_bytes(raw[at..at + 8].try_into().expect("8"));
            c[super::PARTIAL_STEPS] += u64::from_le_bytes(raw[at + 8..at + 16].try_into().expect("8"));
        }
        Ok(())
    }
}

/// CTAs per KV head of the scoring kernel: enough to fill the device several times over at batch 1.
fn score_ctas(num_sms: usize, hk: usize, max_pos: usize, tp: usize) -> usize {
    (8 * num_sms).div_ceil(hk.max(1)).clamp(1, max_pos.div_ceil(tp).max(1))
}

/// Slices of a full row's plan entries (kvs_refresh_plan's grid z): about 8 CTAs per SM over all rows, at
/// most 16 per row.
fn plan_slices(num_sms: usize, hk: usize, ns: usize) -> usize {
    (8 * num_sms).div_ceil((hk * ns).max(1)).clamp(1, 16)
}

impl RefreshDevice {
    /// Enqueues RefreshKV's decision for a policy call: schedule, scores of the prefill (and, without the
    /// tensor-core path, the full) rows, the sets and every decode row's plan `plan` (token-granular,
    /// `plan.cap` entries per row). With `after_attention`, called after the attention of a call whose
    /// full rows wrote their logits (`RefreshWs::logits`): those rows' weights and their sets rebuilt
    /// across CTAs (kvs_refresh_top_*, from the logits and the attention's split statistics).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn refresh_select(
        &self,
        dev: &dyn Device,
        a: &ForwardArgs,
        cache: &KvCache,
        geo: &Geometry,
        group: usize,
        batch: &BatchArg,
        f: impl Fn(&'static str) -> Result<CUfunction>,
        ws: u64,
        rw: &RefreshWs,
        (slot, slot_gen): (u64, u64),
        r: &Refresh,
        plan: PlanRef,
        row_bytes: i64,
        ctr: i64,
        after_attention: bool,
    ) -> Result<()> {
        let (hk, d, ns) = (cache.num_kv_heads, cache.head_dim, geo.num_seqs);
        let stream = a.stream;
        ensure!(r.k < i32::MAX as usize && r.pool < i32::MAX as usize, Unsupported, "refresh(k, pool) too large for 32-bit indices");
        let ra = self.refresh_args(dev, a, hk, d, ws, rw, (slot, slot_gen), r)?;
        let maxpos = geo.max_pos.max(1);
        // Every kernel here starts with KVS_GRID_WAIT(): dependent launches where the GPU has them.
        let pdl = dev.pdl();
        let plan_launch = || -> Result<()> {
            let mut k = KArgs::new();
            k.by_value(batch).by_value(&ra).i64((ws + rw.agg as u64) as i64).i64((ws + rw.pooled as u64) as i64).i32(maxpos as i32);
            k.i64(plan.e as i64).i64(plan.p_s).i64(plan.p_h).i64(plan.len as i64).i32(plan.cap).i64((ws + rw.tmp as u64) as i64);
            k.i64(row_bytes).i64((d * cache.dtype.size_bytes()) as i64).i64(ctr).i32(rw.logits as i32);
            k.i64((ws + rw.hist as u64) as i64).i64((ws + rw.sel as u64) as i64);
            launch::launch_dependent(pdl, f("kvs_refresh_plan")?, (hk as u32, ns as u32, plan_slices(dev.gpu().num_sms as usize, hk, ns) as u32), launch::TOPK_THREADS, 0, &mut k, stream, "kvs_refresh_plan launch")
        };
        if after_attention {
            let chunks = weight_chunks(maxpos);
            let (lg, parts) = ((ws + rw.lg as u64) as i64, (ws + rw.parts as u64) as i64);
            let (pooled, hist, sel, ccnt) = ((ws + rw.pooled as u64) as i64, (ws + rw.hist as u64) as i64, (ws + rw.sel as u64) as i64, (ws + rw.ccnt as u64) as i64);
            if cluster_rebuild(dev.gpu(), ns, hk, maxpos) {
                // One launch: each CTA's part of the row (its keys in shared memory when they fit).
                let f_top = f("kvs_refresh_top_cluster")?;
                let dyn_max = (dev.gpu().smem_optin.max(0) as usize).saturating_sub(CLUSTER_STATIC_SMEM);
                dev.allow_smem_once(f_top, dyn_max)?;
                let smem_keys = maxpos.div_ceil(CLUSTER_CTAS).min(dyn_max / 4);
                let mut k = KArgs::new();
                k.by_value(batch).by_value(&ra).i64(lg).i64(parts).i32(LOGIT_PARTS as i32).i64(pooled).i32(maxpos as i32).i32(smem_keys as i32);
                let grid = ((hk * CLUSTER_CTAS) as u32, ns as u32, 1);
                return launch::launch_dependent(pdl, f_top, grid, CLUSTER_THREADS, (smem_keys * 4) as u32, &mut k, stream, "kvs_refresh_top_cluster launch");
            }
            let grid = (chunks as u32, hk as u32, ns as u32);
            // Four launches (a partial step's find no FULL row; the plan kernel cleared the histograms):
            // three radix passes (the first computes and pools the weights from the logits and the row's
            // LSE, merged from the attention's split statistics; each pass's last chunk chooses its bin;
            // the last keeps the chunks' counts); their kept positions.
            for pass in 0..3 {
                let mut k = KArgs::new();
                k.by_value(batch).by_value(&ra).i64(lg).i64(parts).i32(LOGIT_PARTS as i32).i32(chunks as i32).i64(pooled).i32(maxpos as i32).i64(hist).i64(sel).i64(ccnt).i32(pass);
                launch::launch_dependent(pdl, f("kvs_refresh_top_hist")?, grid, WEIGHT_THREADS, 0, &mut k, stream, "kvs_refresh_top_hist launch")?;
            }
            let mut k = KArgs::new();
            k.by_value(batch).by_value(&ra).i64(pooled).i32(maxpos as i32).i64(sel).i64(ccnt).i32(chunks as i32);
            launch::launch_dependent(pdl, f("kvs_refresh_top_write")?, grid, WEIGHT_THREADS, 0, &mut k, stream, "kvs_refresh_top_write launch")?;
            return Ok(());
        }
        // The CPU's arithmetic: the prefill's seed, and the full decode rows without the tensor-core path.
        let scalar_phases = if a.max_query_len != 1 || !rw.logits { 0..3 } else { 0..0 };
        if !scalar_phases.is_empty() {
            let rows = ns * hk * group;
            let api = cuda()?;
            // SAFETY: each region holds `rows` elements of its width (RefreshWs, sized by the caller).
            unsafe {
                // -inf's order key (kernels/include/decide.cuh kvs_order_key).
                check((api.cuMemsetD32Async)(ws + rw.rmax as u64, 0x007f_ffff, rows, stream), "cuMemsetD32Async")?;
                check((api.cuMemsetD8Async)(ws + rw.z as u64, 0, rows * 8, stream), "cuMemsetD8Async")?;
                check((api.cuMemsetD8Async)(ws + rw.bad as u64, 0, rows * 4, stream), "cuMemsetD8Async")?;
            }
        }
        let q = &a.query;
        let mut k = KArgs::new();
        k.by_value(batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).i32((hk * group) as i32);
        k.by_value(&ra).i64(row_bytes).i64(ctr);
        launch::launch_dependent(pdl, f("kvs_refresh_decide")?, (ns as u32, 1, 1), 128, 0, &mut k, stream, "kvs_refresh_decide launch")?;

        let (tp, threads) = crate::policy::snapkv::cuda::scores_shape(d, group);
        let ctas = score_ctas(dev.gpu().num_sms as usize, hk, maxpos, tp);
        let kc = &cache.k;
        for phase in scalar_phases {
            let mut k = KArgs::new();
            k.by_value(batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).f32(a.softcap);
            k.ptr(kc.data).i64(kc.stride(0) as i64).i64(kc.stride(1) as i64).i64(kc.stride(2) as i64).i32(hk as i32).i64((ws + rw.mode as u64) as i64);
            k.i32(phase).i64((ws + rw.rmax as u64) as i64).i64((ws + rw.z as u64) as i64).i64((ws + rw.bad as u64) as i64);
            k.i64((ws + rw.agg as u64) as i64).i32(maxpos as i32).i32(rw.logits as i32).f32(cache.k_scale);
            launch::launch_dependent(pdl, f("kvs_refresh_scores")?, (ctas as u32, hk as u32, 1), threads as u32, 0, &mut k, stream, "kvs_refresh_scores launch")?;
        }
        plan_launch()
    }

    /// The kernels' arguments for the call's layer: its state (allocated by the layer's first call, which
    /// must not be captured), this call's slots and workspace, the policy's parameters.
    #[allow(clippy::too_many_arguments)]
    fn refresh_args(&self, dev: &dyn Device, a: &ForwardArgs, hk: usize, d: usize, ws: u64, rw: &RefreshWs, (slot, slot_gen): (u64, u64), r: &Refresh) -> Result<RefreshArgs> {
        let Some(slots) = dev.slots() else { bail!(Internal, "RefreshKV needs the sequence slot map") };
        let (base, sl) = {
            let mut layers = self.layers.lock();
            let entry = layers.get_mut(a.layer).ok_or_else(|| Error::new(ErrorKind::OutOfRange, "layer outside the engine"))?;
            let lay = StateLayout::new(slots.max_seqs(), hk, d, r.k)?;
            if entry.is_none() {
                if dev.gpu().is_capturing(a.stream)? {
                    bail!(InvalidArgument, "RefreshKV's state for layer {} is allocated by the layer's first call, which must not be captured; run one step eagerly first", a.layer);
                }
                let buf = DevBuf::alloc(lay.total)?;
                buf.upload(0, &vec![0u8; lay.total])?;
                *entry = Some(buf);
            }
            (entry.as_ref().expect("allocated above").ptr, lay)
        };
        let at = |o: usize| base + o as u64;
        Ok(RefreshArgs {
            qref: at(sl.qref),
            since: at(sl.since),
            lstamp: at(sl.lstamp),
            tok: at(sl.tok),
            sc: at(sl.sc),
            cnt: at(sl.cnt),
            last: at(sl.last),
            hstamp: at(sl.hstamp),
            slot,
            gen: slot_gen,
            mode: ws + rw.mode as u64,
            rctr: self.counters.ptr + (a.layer * 16) as u64,
            k: r.k as i32,
            stride: r.stride.min(i32::MAX as usize) as i32,
            every: r.every.map_or(0, |v| v.min(i32::MAX as usize) as i32),
            pool: r.pool as i32,
            s: r.s,
            hk: hk as i32,
        })
    }

}

impl PolicyDevice for RefreshDevice {
    fn add_counters(&self, _gpu: &crate::cuda::context::Gpu, per_layer: &mut [Counters]) -> Result<()> {
        RefreshDevice::add_counters(self, per_layer)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// RefreshKV's stage for one call: its decision before the attention (plans of `cx.fin`), and where the
/// tensor-core kernel writes the full rows' logits, the sets rebuilt from them after it.
pub(crate) struct RefreshStage<'a> {
    /// The engine's RefreshKV state (None: not made, an internal error at the first launch).
    state: Option<&'a RefreshDevice>,
    r: Refresh,
    ws: RefreshWs,
}

impl<'a> RefreshStage<'a> {
    pub(crate) fn new(state: Option<&'a RefreshDevice>, r: Refresh) -> Self {
        RefreshStage { state, r, ws: RefreshWs::default() }
    }

    fn run(&self, cx: &StepCx, after_attention: bool) -> Result<()> {
        let Some(state) = self.state else { bail!(Internal, "the CUDA backend holds no RefreshKV state") };
        let f = |n: &'static str| cx.function(n);
        state.refresh_select(cx.dev, cx.a, cx.cache, cx.geo, cx.cfg.group_size(), &cx.batch, f, cx.ws, &self.ws, (cx.slot, cx.slot_gen), &self.r, cx.fin, cx.row_bytes, cx.ctr, after_attention)
    }
}

impl CudaStage for RefreshStage<'_> {
    fn reserve(&mut self, cx: &CallShape, ws: &mut WsAlloc) -> Result<()> {
        // The full step's weights from its own attention wherever the tensor-core kernel runs it (16-bit
        // and FP8 caches; over FP8 the logits of the keys decoded times k_scale).
        let (ns, hk, g) = (cx.geo.num_seqs, cx.cfg.num_kv_heads, cx.cfg.group_size());
        let logits = cx.tensor_cores;
        self.ws = RefreshWs::reserve(&mut |b| ws.take(b), ns, hk, g, cx.geo.max_pos, self.r.k, logits)?;
        Ok(())
    }

    fn select(&self, cx: &StepCx) -> Result<()> {
        self.run(cx, false)
    }

    fn rows(&self, cx: &StepCx, keys: usize) -> Option<Rows> {
        self.ws.logits.then(|| Rows::PlanLogits(cx.fin, keys, self.ws.logits_out(cx.geo, cx.ws)))
    }

    fn after_attention(&self, cx: &StepCx, _keys: usize) -> Result<()> {
        if self.ws.logits && cx.select {
            self.run(cx, true)?;
        }
        Ok(())
    }
}
