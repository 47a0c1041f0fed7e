//! AttentionPredictor on the CUDA backend (kernels/predictor.cu): the block-attention history, the
//! calibration schedule, the CNN and the selection on the device, agreeing with the CPU engine's decisions
//! (`cpu.rs`, `mod.rs`) by the contract of design.md, within the error bounds of docs/policies.md: a
//! decode row's history row from tensor-core logits over 16-bit caches ([`tc_history`]: the step's own
//! attention's where it attends the row's positions, predicted and first steps; `kvs_pred_logits`' for a
//! calibration step's full row; in the CPU's arithmetic, bit for bit, over f32 and FP8 caches and for
//! prefill seeds), the CNN's first convolution in
//! f32 with fused multiply-adds, its second on tensor cores in 3xBF16. No host decision inside a decode step:
//! the launches and their grids follow from host-known bounds (block-table width, history, budgets), so a
//! step is capturable in a CUDA graph.
//!
//! State, per layer and per (state slot, KV head) of the slot map (src/cuda/slots.rs): a header (the
//! slot generation it belongs to, rows pushed, steps since calibration, the last prediction's crop), the
//! ring of `history` rows of block scores and, as large again, the CNN's per-row outputs of the last
//! prediction (a step recomputes only the rows and columns whose receptive field changed, five rows of
//! 64 in the steady state). Each ring row has `wc = ceil(max_pos / block)` entries (max_pos: the block
//! table's capacity), so a layer costs `max_seqs × kv_heads × (2 × history × wc × 4 + history × 4 + 32)`
//! bytes: 4 MiB per (sequence, KV head) at 128K tokens, history 64, block 16 (8.6 GB per layer at the default
//! `max_seqs=256` and 8 KV heads) — size `max_seqs` to the
//! batch. It is allocated on the layer's first call (outside capture), and grown (migrated by a kernel)
//! when a later call's table is wider, which must not happen inside a capture.
//!
//! The CNN's weights are uploaded once at engine creation, the second convolution's also as pre-split MMA
//! fragments ([`conv2_fragments`]). The conv kernel stages them, an image tile and the first convolution's
//! tile in dynamic shared memory (at most 100 KiB: two CTAs per SM), so a weights file must fit (the
//! built-in network, 16 / 32 channels: 53 KiB with tiles of 64 columns); wider ones (more than 32
//! first-layer or 128 second-layer channels, or too large together) are refused with UNSUPPORTED at
//! engine creation.

use parking_lot::Mutex;

use crate::cuda::batch::{Geometry, LogitsOut, Rows};
use crate::cuda::context::DevBuf;
use crate::cuda::driver::{check, cuda, CUfunction};
use crate::cuda::kernel_src::{kernel_file, Module};
use crate::cuda::launch::{self, KArgs};
use crate::cuda::stage::{CallShape, CudaStage, Device, PolicyDevice, StepCx, WsAlloc};
use crate::error::Result;
use crate::policy::predictor::PredictorWeights;
use crate::policy::refresh;
use super::PredictorSpec;
use crate::{bail, ensure};

/// The predictor's module of its own: its kernels (with the batch, top-k and weights-pass headers they
/// include).
pub const PREDICTOR: Module = &[&kernel_file!("predictor.cu", "policy/predictor.cu")];

/// Most CTAs per SM of one `kvs_pred_conv` launch, over all (sequence, KV head) pairs (each stages the
/// weights once and walks its share of the (band, column tile) items): four waves of the three CTAs an SM
/// holds. H200, 2026-11-28 (items without empty bands): 12 per SM against 9 / 6 / 3: 379 against 391 / 410 /
/// 463 us at 8 x 128K; at 1 x 128K (2,048 items) 9 (57.3 us) beat 12 (59.6) and 3 (67.0); at 1 x 32K (512
/// items) 3 beat 9 (CNN 29.4 against 36.3 us): see [`conv_ctas_per_row`].
const CONV_CTAS_PER_SM: usize = 12;
/// A decode step's steady state recomputes two bands per column tile (rows 0-1, and the rows the new one
/// reaches); `kvs_pred_conv` takes about 3 CTAs per 5 such items (1.7 items each) below its cap.
fn conv_ctas_per_row(tiles: usize, rows: usize, num_sms: usize) -> usize {
    let steady = tiles.saturating_mul(2).saturating_mul(3).div_ceil(5);
    let cap = CONV_CTAS_PER_SM.saturating_mul(num_sms.max(1)).div_ceil(rows.max(1));
    steady.min(cap).max(1)
}
/// Largest first-layer width the conv kernel accepts (its second convolution reduces over 9 x c1).
const MAX_C1: usize = 32;
/// Largest second-layer width (the kernel's accumulators: 16-channel tiles x rows per band).
const MAX_C2: usize = 128;
/// CTAs of one history-row scoring launch, over all (sequence, KV head) pairs (a few waves on an H100).
const SCORES_CTAS: usize = 2048;
/// Dynamic shared memory the conv kernel may use (two CTAs per SM).
const CONV_SMEM: usize = 100 * 1024;
/// CTAs of one tensor-core history-row launch (`kvs_pred_logits`, `kvs_pred_weights`), over all
/// (sequence, KV head) pairs: several CTAs per SM, so that enough K is in flight.
const HIST_CTAS: usize = 1024;
/// CTAs per (sequence, KV head) of `kvs_pred_logits` (before the cap of its positions): [`HIST_CTAS`] over the
/// rows, but no more than one wave of two per SM once that leaves at least [`LOGITS_MIN_PER_ROW`] per row.
/// A predicted step's launch only returns (its rows' logits come from the attention), a calibration step's
/// reads every key: H200, 2026-11-28, one wave instead of 128 per row at 1 x 128K saved 5.8 us a step
/// (143.7 -> 138.0), while at 8 x 128K one wave (5 per row) lost 30 us against 16 per row.
fn logits_ctas_per_row(rows: usize, num_sms: usize) -> usize {
    let rows = rows.max(1);
    let wave = (2 * num_sms.max(1)).div_ceil(rows).max(LOGITS_MIN_PER_ROW);
    HIST_CTAS.div_ceil(rows).min(wave).max(1)
}
/// The fewest CTAs per row [`logits_ctas_per_row`] takes while [`HIST_CTAS`] allows them.
const LOGITS_MIN_PER_ROW: usize = 16;
/// Most CTAs per (sequence, KV head) of `kvs_pred_logits`: its softmax statistics' slots per query head.
pub(crate) const HIST_PARTS: usize = 256;
/// Slots per query head for the attention's split statistics when it writes the history rows' logits
/// (`Rows::PlanLogits`: the launch splits no more).
pub(crate) const ATTN_PARTS: usize = 64;
/// Keys `kvs_pred_logits` takes per CTA and iteration (8 warps x 16 keys x PL_KT) at head sizes up to 128.
const HIST_KEYS_PER_CTA: usize = 256;
/// Threads (columns) per CTA of the time average's two shapes (kernels/policy/predictor.cu
/// `PRED_AVG_THREADS`, `PRED_AVG_WIDE_THREADS`).
const AVG_THREADS: usize = 256;
const AVG_WIDE_THREADS: usize = 128;
/// Launches of at most this many columns (rows x blocks) take `kvs_pred_average_wide` (32 rows' loads in
/// flight per thread, 128 per CTA). H200, 2026-11-28, against `kvs_pred_average` (8 rows, 256): the mean step
/// 158 -> 148 us at 1 x 128K (65,536 columns; the kernel alone level, 12.0 against 12.1 us) and 98 -> 89 us
/// at 1 x 32K, while at 8 x 128K the wide shape lost (668 -> 698 us; kernel 44.6 -> 65.0 us).
const AVG_WIDE_MAX_COLUMNS: usize = 65536;

/// The time average's kernel and threads per CTA for `columns` (rows x blocks) in the launch;
/// `KVS_PRED_AVERAGE=narrow|wide` forces the shape (tests, benchmarks).
fn average_shape(columns: usize) -> (&'static str, usize) {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    if launch::env_choice(&FORCED, "KVS_PRED_AVERAGE", "narrow", "wide").unwrap_or(columns <= AVG_WIDE_MAX_COLUMNS) {
        ("kvs_pred_average_wide", AVG_WIDE_THREADS)
    } else {
        ("kvs_pred_average", AVG_THREADS)
    }
}
/// Threads per CTA of kvs_pred_select_cluster (kernels/policy/predictor.cu PRED_QC_THREADS).
const PRED_QC_THREADS: u32 = 256;

/// Whether a call's selection runs on thread-block clusters (kvs_pred_select_cluster, sm_90 and newer):
/// for rows of at least [`CLUSTER_MIN_BLOCKS`] blocks while the rows' clusters fit in one wave of one CTA
/// per SM. Otherwise one CTA per row (kvs_pred_select) does less work in all (H200, 32/8 heads, `predictor(budget=L/32)`,
/// selection µs cluster / one CTA: 1 x 128K 31.8 / 45.8, 8 x 128K 78.8 / 79.8, 1 x 32K 25.9 / 22.9, 8 x 32K
/// 43.1 / 31.6, 32 x 128K 238.9 / 189.4; docs/journal/2026-11-28.md). `KVS_PRED_SELECT=cta|cluster` forces
/// the choice where the device has clusters (tests, benchmarks).
fn select_on_clusters(cc_major: i32, num_sms: usize, rows: usize, blocks: usize) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = launch::env_choice(&FORCED, "KVS_PRED_SELECT", "cta", "cluster");
    cc_major >= 9 && forced.unwrap_or_else(|| clusters_fit(num_sms, rows, blocks))
}

/// Blocks per row from which a row's selection pays for a cluster (between 2,048, where it loses, and 8,192).
const CLUSTER_MIN_BLOCKS: usize = 4096;

/// The default rule of [`select_on_clusters`].
fn clusters_fit(num_sms: usize, rows: usize, blocks: usize) -> bool {
    blocks >= CLUSTER_MIN_BLOCKS && launch::clusters_fit_one_wave(rows, num_sms)
}

/// Whether a call's decode rows get their history rows from the tensor cores (the step's attention's
/// logits, `Rows::PlanLogits`, or `kvs_pred_logits` for calibration rows; then `kvs_pred_weights`): a 16-bit cache of the queries' type, rows the tensor-core kernels can read (16-byte
/// aligned, `tensor_cores`), head sizes in whole 32-element chunks and at most 16 query heads per KV head.
/// Elsewhere (f32 and FP8 caches) the scalar passes compute them in the CPU's arithmetic.
pub(crate) fn tc_history(tensor_cores: bool, cache_dtype: crate::tensor::DType, q_dtype: crate::tensor::DType, head_dim: usize, group: usize) -> bool {
    use crate::tensor::DType;
    tensor_cores && matches!(cache_dtype, DType::F16 | DType::BF16) && q_dtype == cache_dtype && head_dim % 32 == 0 && head_dim <= 256 && group <= 16
}

/// Image rows per band of `kvs_pred_conv` for a second layer of `c2` channels (`PRED_RB`: its
/// accumulators hold 16-channel tiles x rows per band).
fn band_rows(c2: usize) -> usize {
    8 / c2.div_ceil(16)
}

/// Dynamic shared memory of `kvs_pred_conv` (kernels/policy/predictor.cu `PRED_SMEM_W`, in bytes) for a
/// network of `c1` / `c2` channels and column tiles of `pt`.
fn conv_smem_bytes(c1: usize, c2: usize, pt: usize) -> usize {
    let (c1p, mt) = (c1.div_ceil(16) * 16, c2.div_ceil(16));
    let rb = band_rows(c2);
    let frag = mt * 9 * (c1p / 16) * 32 * 8;
    let small = (c1 * 10 + 2 * c2 + 1 + rb + 4).div_ceil(4) * 4;
    let xs = (rb + 4) * (pt + 4);
    let ys = (rb + 2) * (pt + 2) * (c1p + if (c1p / 16) % 2 == 0 { 16 } else { 0 });
    4 * (frag + small + xs + ys)
}

/// bf16 of `x`, rounded to nearest even (`cvt.rn.bf16.f32` for finite `x`).
fn bf16_rn(x: f32) -> u16 {
    let u = x.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// The second convolution's weights as the A operands of `kvs_pred_conv`'s m16n8k16 MMAs, split into bf16
/// hi + lo (w = hi + lo to about 2^-18 of w): per 16-channel output tile `mi` and k-step `kk` (spatial offset
/// `kk / kc` = dt * 3 + db, input channels 16 (kk % kc) ..), the hi words a0..a3 of lanes 0..31, then their lo
/// words (so that a warp's 16-byte loads of either are conflict-free); lane (g8 = lane / 4, tq = lane % 4)
/// word j holding output channel mi*16 + g8 + 8 (j & 1) and input channels 2 tq + 8 (j >> 1) (+1 in the high
/// half); zero past the network's channels.
pub(crate) fn conv2_fragments(w: &PredictorWeights) -> Vec<u32> {
    let flat = w.flat();
    let (c1, c2) = (w.c1, w.c2);
    let (kc, mt) = (c1.div_ceil(16), c2.div_ceil(16));
    let w2 = &flat[c1 * 10..c1 * 10 + c2 * c1 * 9];
    let at = |co: usize, ch: usize, sp: usize| if co < c2 && ch < c1 { w2[(co * c1 + ch) * 9 + sp] } else { 0.0 };
    let split = |x: f32| {
        let hi = bf16_rn(x);
        (hi, bf16_rn(x - f32::from_bits((hi as u32) << 16)))
    };
    let mut out = Vec::with_capacity(mt * 9 * kc * 32 * 8);
    for mi in 0..mt {
        for kk in 0..9 * kc {
            let (sp, kb) = (kk / kc, kk % kc);
            let (mut his, mut los) = (Vec::with_capacity(128), Vec::with_capacity(128));
            for lane in 0..32 {
                let (g8, tq) = (lane / 4, lane % 4);
                for j in 0..4 {
                    let co = mi * 16 + g8 + 8 * (j & 1);
                    let ch = kb * 16 + 2 * tq + 8 * (j >> 1);
                    let (h0, l0) = split(at(co, ch, sp));
                    let (h1, l1) = split(at(co, ch + 1, sp));
                    his.push(h0 as u32 | (h1 as u32) << 16);
                    los.push(l0 as u32 | (l1 as u32) << 16);
                }
            }
            out.extend_from_slice(&his);
            out.extend_from_slice(&los);
        }
    }
    out
}

/// `PredState` of the kernels (kernels/policy/predictor.cu; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct StateArg {
    hdr: u64,
    lens: u64,
    ring: u64,
    zc: u64,
    h: i32,
    wc: i32,
    hk: i32,
    pad: i32,
}

/// `PredSpec` of the kernels (kernels/policy/predictor.cu; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SpecArg {
    budget: i32,
    block: i32,
    calib: i32,
    sink: i32,
    local: i32,
    pad: i32,
}

/// The layouts a test compares with kernels/policy/predictor.cu.
#[cfg(test)]
pub(crate) fn c_layouts() -> Vec<crate::cuda::kernel_src::CLayout> {
    use crate::cuda::kernel_src::c_layout;
    vec![
        c_layout!(StateArg as "PredState" { hdr, lens, ring, zc, h => "H", wc, hk, pad }),
        c_layout!(SpecArg as "PredSpec" { budget, block, calib, sink, local, pad }),
    ]
}

/// One layer's history arrays.
struct LayerState {
    hdr: DevBuf,
    lens: DevBuf,
    ring: DevBuf,
    zc: DevBuf,
    wc: usize,
}

/// The predictor's device state of an engine.
pub struct PredictorDev {
    spec: PredictorSpec,
    c1: usize,
    c2: usize,
    /// Image columns per conv CTA (fits the shared memory for these weights).
    pt: usize,
    weights: DevBuf,
    /// The second convolution's weights as MMA fragments ([`conv2_fragments`]).
    frag: DevBuf,
    max_seqs: usize,
    hk: usize,
    layers: Mutex<Vec<Option<LayerState>>>,
    /// Per layer: calibration steps, predicted steps (u64 each).
    counters: DevBuf,
    num_layers: usize,
    /// Benchmarks only: events recorded between the step's parts (start, after the CNN, after the
    /// selection, before and after the history rows: with tensor cores the step's attention runs between
    /// the selection and the history rows), when set.
    probe: Mutex<Option<[crate::cuda::driver::CUevent; 5]>>,
}

// SAFETY: the events are opaque driver handles, used only under the mutex.
unsafe impl Send for PredictorDev {}
unsafe impl Sync for PredictorDev {}

fn clamp(v: usize) -> i32 {
    v.min(i32::MAX as usize) as i32
}

fn checked(parts: &[usize]) -> Result<usize> {
    parts.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).ok_or_else(|| crate::error::Error::new(crate::error::ErrorKind::OutOfMemory, "predictor state size overflows"))
}

impl PredictorDev {
    /// Uploads the weights; refuses networks the kernels cannot hold.
    pub fn new(w: &PredictorWeights, spec: PredictorSpec, num_layers: usize, num_kv_heads: usize, max_seqs: usize) -> Result<Self> {
        let flat = w.flat();
        ensure!(w.c1 <= MAX_C1 && w.c2 <= MAX_C2, Unsupported, "predictor weights with {} / {} channels: the CUDA backend's CNN kernel holds at most {MAX_C1} / {MAX_C2}", w.c1, w.c2);
        let Some(pt) = [64usize, 32, 16].into_iter().find(|&pt| conv_smem_bytes(w.c1, w.c2, pt) <= CONV_SMEM) else {
            bail!(Unsupported, "predictor weights of {} / {} channels do not fit the CUDA backend's CNN kernel (shared memory); the built-in network has 16 / 32", w.c1, w.c2);
        };
        let bytes: Vec<u8> = flat.iter().flat_map(|x| x.to_le_bytes()).collect();
        let weights = DevBuf::from_host(&bytes)?;
        let frag_bytes: Vec<u8> = conv2_fragments(w).iter().flat_map(|x| x.to_le_bytes()).collect();
        let frag = DevBuf::from_host(&frag_bytes)?;
        let counters = DevBuf::from_host(&vec![0u8; checked(&[num_layers, 16])?])?;
        Ok(PredictorDev { spec, c1: w.c1, c2: w.c2, pt, weights, frag, max_seqs, hk: num_kv_heads, layers: Mutex::new((0..num_layers).map(|_| None).collect()), counters, num_layers, probe: Mutex::new(None) })
    }

    /// Bytes of one layer's state for ring rows of `wc` blocks.
    pub fn layer_bytes(&self, wc: usize) -> Result<usize> {
        let per = checked(&[self.spec.history, wc, 4, 2])?.checked_add(self.spec.history * 4 + 32);
        let per = per.ok_or_else(|| crate::error::Error::new(crate::error::ErrorKind::OutOfMemory, "predictor state size overflows"))?;
        crate::cuda::slots::state_bytes(self.max_seqs, checked(&[self.hk, per])?)
    }

    /// Calibration and predicted steps per layer (synchronizes).
    pub fn read_counters(&self, gpu: &crate::cuda::context::Gpu) -> Result<Vec<(u64, u64)>> {
        gpu.synchronize()?;
        let mut raw = vec![0u8; self.num_layers * 16];
        self.counters.download(0, &mut raw)?;
        Ok(raw.chunks_exact(16).map(|c| (u64::from_le_bytes(c[..8].try_into().expect("8")), u64::from_le_bytes(c[8..].try_into().expect("8")))).collect())
    }

    fn defines(&self, base: &[String]) -> Vec<String> {
        let mut d = base.to_vec();
        d.push(format!("PRED_C1={}", self.c1));
        d.push(format!("PRED_C2={}", self.c2));
        d.push(format!("PRED_PT={}", self.pt));
        d
    }
}

/// Workspace regions of a predictor call (bytes), given its geometry.
pub(crate) struct PredWs {
    pub nbmax: usize,
    /// Query rows per (sequence, KV head) of the history's scoring (tokens × group).
    pub rcap: usize,
    /// Logits kept per query row of a decode row's history (its positions: every visible one at most).
    pub lcap: usize,
}

impl PredWs {
    pub fn new(spec: &PredictorSpec, geo: &Geometry, group: usize, max_query_len: i32) -> Result<Self> {
        let nbmax = geo.max_pos.div_ceil(spec.block).max(1);
        // A prefill chunk seeds from its last min(q_len, history) rows; a decode-only call scores one.
        let tokens = match max_query_len {
            1 => 1,
            0 => spec.history,
            q => spec.history.min(q as usize).max(1),
        };
        ensure!(geo.max_pos < i32::MAX as usize, Unsupported, "predictor: sequences too long for the history's logits");
        Ok(PredWs { nbmax, rcap: checked(&[tokens, group])?, lcap: geo.max_pos + 1 })
    }
}

impl PredictorDev {
    /// AttentionPredictor's whole decision for one call, enqueued on its stream: modes and schedule,
    /// the CNN, the selection (the plan `fin`), the history rows of decode rows and prefill seeds.
    pub(crate) fn predictor_step(&self, cx: &StepCx, lay: &PredRegions, pw: &PredWs, tc: bool) -> Result<()> {
        let (dev, a, cache, geo, batch, base_defines, ws, fin, ctr) = (cx.dev, cx.a, cx.cache, cx.geo, &cx.batch, cx.defines, cx.ws, &cx.fin, cx.ctr);
        let pd = self;
        let (hk, d, ns) = (cache.num_kv_heads, cache.head_dim, geo.num_seqs);
        let stream = a.stream;
        let ps = pd.spec;
        let defines = pd.defines(base_defines);
        let f = |name: &'static str| -> Result<CUfunction> { dev.modules().function(dev.gpu(), "predictor", PREDICTOR, &defines, name) };
        let st = self.predictor_layer(dev, a.layer, pw.nbmax, stream, &f)?;
        let spec = pd.spec_arg();
        let (slot, gen, mode) = (lay.slot, lay.slot_gen, ws + lay.pred_mode as u64);
        let pctr = pd.counters.ptr + (a.layer * 16) as u64;
        let es = cache.dtype.size_bytes();
        let threads = (hk.next_multiple_of(32)).min(256) as u32;
        let mark = |i: usize| pd.mark(i, stream);
        mark(0)?;
        // Every kernel of the step starts with KVS_GRID_WAIT(): dependent launches where the GPU has them
        // (kvs_pred_migrate, which grows the state outside capture, stays plain).
        let pdl = dev.pdl();

        let mut k = KArgs::new();
        k.by_value(batch).by_value(&st).by_value(&spec).i64(slot as i64).i64(gen as i64).i64(mode as i64).i64(pctr as i64);
        launch::launch_dependent(pdl, f("kvs_pred_prepare")?, (ns as u32, 1, 1), threads, 0, &mut k, stream, "kvs_pred_prepare launch")?;

        // Work items (band, column tile): a tile has at most ceil(history / rows per band) bands.
        let items = checked(&[pw.nbmax.div_ceil(pd.pt), ps.history.div_ceil(band_rows(pd.c2))])?;
        ensure!(hk < 65536 && ns < 65536 && items < (1 << 31), Unsupported, "predictor: too many KV heads, sequences or blocks for the CNN's grid");
        let per = conv_ctas_per_row(pw.nbmax.div_ceil(pd.pt), ns * hk, dev.gpu().num_sms as usize).min(items).max(1);
        let conv = f("kvs_pred_conv")?;
        let smem = conv_smem_bytes(pd.c1, pd.c2, pd.pt);
        dev.allow_smem_once(conv, smem)?;
        let mut k = KArgs::new();
        k.by_value(batch).by_value(&st).by_value(&spec).i64(pd.weights.ptr as i64).i64(pd.frag.ptr as i64).i64(slot as i64).i64(mode as i64);
        launch::launch_dependent(pdl, conv, (per as u32, hk as u32, ns as u32), 4 * pd.pt as u32, smem as u32, &mut k, stream, "kvs_pred_conv launch")?;

        mark(1)?;
        let mut k = KArgs::new();
        k.by_value(batch).by_value(&st).by_value(&spec).i64(pd.weights.ptr as i64).i64(slot as i64).i64(mode as i64);
        k.i64((ws + lay.pred_scores as u64) as i64).i32(pw.nbmax as i32);
        let (avg, at) = average_shape((ns * hk).saturating_mul(pw.nbmax));
        launch::launch_dependent(pdl, f(avg)?, (pw.nbmax.div_ceil(at) as u32, hk as u32, ns as u32), at as u32, 0, &mut k, stream, "kvs_pred_average launch")?;
        let mut k = KArgs::new();
        k.by_value(batch).by_value(&st).by_value(&spec).i64(pd.weights.ptr as i64).i64(slot as i64).i64(mode as i64);
        k.i64((ws + lay.pred_scores as u64) as i64).i32(pw.nbmax as i32);
        k.i64(fin.e as i64).i64(fin.p_s).i64(fin.p_h).i64(fin.len as i64).i32(fin.cap).i64((2 * d * es) as i64).i64((d * es) as i64).i64(ctr);
        let gpu = dev.gpu();
        // With `tc` the selection zeroes the ring rows the history rows go to (after the attention).
        k.i32(tc as i32);
        if select_on_clusters(gpu.cc.0, gpu.num_sms as usize, ns * hk, pw.nbmax) {
            launch::launch_dependent(pdl, f("kvs_pred_select_cluster")?, ((hk * launch::CLUSTER_CTAS) as u32, ns as u32, 1), PRED_QC_THREADS, 0, &mut k, stream, "kvs_pred_select_cluster launch")?;
        } else {
            launch::launch_dependent(pdl, f("kvs_pred_select")?, (hk as u32, ns as u32, 1), launch::TOPK_THREADS, 0, &mut k, stream, "kvs_pred_select launch")?;
        }
        mark(2)?;
        if !tc {
            self.history_rows(cx, lay, pw, false)?;
        }
        Ok(())
    }

    /// The history rows of a call's decode rows and prefill seeds, and the ring's bookkeeping; with `tc`
    /// after the step's attention, whose logits (`Rows::PlanLogits` into the `pred_logits` region, its
    /// statistics into `attn_parts`) give the rows it attended in full (PRED, NOHIST). Prefill seeds (and,
    /// without `tc`, decode rows): three scalar passes in the CPU's arithmetic, a decode row's keys read by
    /// the first only (its logits kept in the workspace for the other two). With `tc`, CALIB rows (the full
    /// row while the attention took the predicted plan): their logits on the tensor cores
    /// (`kvs_pred_logits`), then every decode row's weights.
    fn history_rows(&self, cx: &StepCx, lay: &PredRegions, pw: &PredWs, tc: bool) -> Result<()> {
        let (dev, a, cache, geo, batch, base_defines, ws, fin) = (cx.dev, cx.a, cx.cache, cx.geo, &cx.batch, cx.defines, cx.ws, &cx.fin);
        let pd = self;
        let (hk, d, g, ns) = (cache.num_kv_heads, cache.head_dim, cx.cfg.group_size(), geo.num_seqs);
        let stream = a.stream;
        let defines = pd.defines(base_defines);
        let f = |name: &'static str| -> Result<CUfunction> { dev.modules().function(dev.gpu(), "predictor", PREDICTOR, &defines, name) };
        let st = self.predictor_layer(dev, a.layer, pw.nbmax, stream, &f)?;
        let spec = pd.spec_arg();
        let (slot, mode) = (lay.slot, ws + lay.pred_mode as u64);
        let threads = (hk.next_multiple_of(32)).min(256) as u32;
        let mark = |i: usize| pd.mark(i, stream);
        mark(3)?;
        let pdl = dev.pdl();
        let q = &a.query;
        let kc = &cache.k;
        // The arguments both history-row kernels (kvs_pred_scores, kvs_pred_logits) start with: the batch,
        // the queries, the keys, the state, the spec, slots, modes and the plan.
        let rows_args = |k: &mut KArgs| {
            k.by_value(batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).f32(a.softcap);
            k.ptr(kc.data).i64(kc.stride(0) as i64).i64(kc.stride(1) as i64).i64(kc.stride(2) as i64).by_value(&st).by_value(&spec).i64(slot as i64).i64(mode as i64);
            k.i64(fin.e as i64).i64(fin.p_s).i64(fin.p_h).i64(fin.len as i64).i32(fin.cap);
        };
        if !tc || a.max_query_len != 1 {
            let n_rows = checked(&[ns, hk, pw.rcap])?;
            let api = cuda()?;
            // SAFETY: each region holds n_rows elements of its width (sized by PredictorStage::reserve from `pw`).
            unsafe {
                // -inf's order key (kernels/include/decide.cuh kvs_order_key).
                check((api.cuMemsetD32Async)(ws + lay.pred_rmax as u64, 0x007f_ffff, n_rows, stream), "cuMemsetD32Async")?;
                check((api.cuMemsetD8Async)(ws + lay.pred_z as u64, 0, n_rows * 8, stream), "cuMemsetD8Async")?;
                check((api.cuMemsetD8Async)(ws + lay.pred_bad as u64, 0, n_rows * 4, stream), "cuMemsetD8Async")?;
            }
            let (tp, sthreads) = crate::policy::snapkv::cuda::scores_shape(d, g);
            // Key tiles per (sequence, KV head): each CTA walks tiles gridDim.x apart, so that a predicted row
            // (only its plan's keys) does not launch a CTA per tile of the longest row.
            let key_tiles = (geo.max_pos + 1).div_ceil(tp).min(SCORES_CTAS.div_ceil(ns * hk)).max(1);
            for phase in 0..3 {
                let mut k = KArgs::new();
                rows_args(&mut k);
                k.i32(phase);
                k.i64((ws + lay.pred_rmax as u64) as i64).i64((ws + lay.pred_z as u64) as i64).i64((ws + lay.pred_bad as u64) as i64).i32(pw.rcap as i32);
                k.i64((ws + lay.pred_logits as u64) as i64).i32(pw.lcap as i32).f32(cache.k_scale).i32(!tc as i32);
                launch::launch_dependent(pdl, f("kvs_pred_scores")?, (key_tiles as u32, hk as u32, ns as u32), sthreads as u32, 0, &mut k, stream, "kvs_pred_scores launch")?;
            }
        }
        if tc {
            let per = HIST_CTAS.div_ceil(ns * hk).max(1);
            let logits_ctas = (geo.max_pos + 1).div_ceil(HIST_KEYS_PER_CTA).min(logits_ctas_per_row(ns * hk, dev.gpu().num_sms as usize)).clamp(1, HIST_PARTS);
            let (lg, parts) = ((ws + lay.pred_logits as u64) as i64, (ws + lay.pred_parts as u64) as i64);
            let mut k = KArgs::new();
            rows_args(&mut k);
            k.i64(lg).i32(pw.lcap as i32).i64(parts);
            // A plain launch: as a programmatic dependent of the attention, a calibration step (1,024 CTAs of
            // two per SM reading every key) took ~570 us longer at 32 x 128K with the same kernel times (H200,
            // every step calibrating: 4,842 against 4,230 us); a predicted step's launch, which returns at once,
            // pays ~1.4 us for it at 1 x 128K (docs/journal/2026-11-28.md, twenty-second session).
            launch::launch_dependent(false, f("kvs_pred_logits")?, (logits_ctas as u32, hk as u32, ns as u32), 256, 0, &mut k, stream, "kvs_pred_logits launch")?;
            let weight_ctas = (geo.max_pos + 1).div_ceil(256).min(per).max(1);
            let mut k = KArgs::new();
            k.by_value(batch).by_value(&st).by_value(&spec).i64(slot as i64).i64(mode as i64);
            k.i64(fin.e as i64).i64(fin.p_s).i64(fin.p_h).i64(fin.len as i64).i32(fin.cap).i64(lg).i32(pw.lcap as i32).i64(parts).i32(logits_ctas as i32);
            k.i64((ws + lay.attn_parts as u64) as i64).i32(ATTN_PARTS as i32);
            launch::launch_dependent(pdl, f("kvs_pred_weights")?, (weight_ctas as u32, hk as u32, ns as u32), 256, 0, &mut k, stream, "kvs_pred_weights launch")?;
        }
        let mut k = KArgs::new();
        k.by_value(batch).by_value(&st).by_value(&spec).i64(slot as i64).i64(mode as i64).i32(pw.rcap as i32);
        launch::launch_dependent(pdl, f("kvs_pred_finish")?, (ns as u32, 1, 1), threads, 0, &mut k, stream, "kvs_pred_finish launch")?;
        mark(4)
    }

    /// Where the attention writes the decode rows' logits and split statistics (`Rows::PlanLogits`) for
    /// [`Self::history_rows`]: the `pred_logits` region by position (its extent per row is the same as
    /// `kvs_pred_logits`' layout's, which overwrites CALIB rows after the attention), `attn_parts`.
    fn logits_out(ws: u64, lay: &PredRegions, pw: &PredWs) -> LogitsOut {
        LogitsOut { lg: ws + lay.pred_logits as u64, maxpos: pw.lcap as i32, parts: ws + lay.attn_parts as u64, nparts: ATTN_PARTS as i32 }
    }

    fn spec_arg(&self) -> SpecArg {
        let ps = &self.spec;
        SpecArg { budget: clamp(ps.budget), block: clamp(ps.block), calib: clamp(ps.calib), sink: clamp(ps.sink), local: clamp(ps.local), pad: 0 }
    }

    /// Benchmarks only: records probe event `i` on `stream` when a benchmark set the events.
    fn mark(&self, i: usize, stream: crate::cuda::driver::CUstream) -> Result<()> {
        match *self.probe.lock() {
            // SAFETY: events created by the benchmark, recorded on the call's stream.
            Some(ev) => check(unsafe { (cuda()?.cuEventRecord)(ev[i], stream) }, "cuEventRecord"),
            None => Ok(()),
        }
    }

    /// Benchmarks only: record events between the predictor's parts of later calls (None: stop).
    pub fn set_probe(&self, ev: Option<[crate::cuda::driver::CUevent; 5]>) {
        *self.probe.lock() = ev;
    }

    /// The layer's state arrays, allocated (or grown to ring rows of `wc` blocks) outside capture.
    fn predictor_layer(&self, dev: &dyn Device, layer: usize, wc: usize, stream: crate::cuda::driver::CUstream, f: &dyn Fn(&'static str) -> Result<CUfunction>) -> Result<StateArg> {
        let pd = self;
        let mut layers = pd.layers.lock();
        let h = pd.spec.history;
        let rows = checked(&[pd.max_seqs, pd.hk, h])?;
        let need = layers[layer].as_ref().map_or(true, |l| l.wc < wc);
        if need {
            ensure!(!dev.gpu().is_capturing(stream)?, InvalidArgument, "the predictor's history for layer {layer} must grow to {wc} blocks per row on a stream that is being captured; run one call with the widest block table before capturing");
            let bytes = pd.layer_bytes(wc)?;
            // Out of memory here is the spec's `max_seqs` (every slot's rows are allocated up front): say so.
            let state = |e: crate::error::Error| {
                crate::error::Error::new(e.kind, format!("{} (the predictor's history state for layer {layer}: {bytes} bytes = max_seqs {} x {} KV heads x {h} rows of {wc} blocks, twice; lower the spec's `max_seqs` option to the sequences served at once)", e.message, pd.max_seqs, pd.hk))
            };
            let ring = DevBuf::alloc(checked(&[rows, wc, 4])?).map_err(state)?;
            let zc = DevBuf::alloc(checked(&[rows, wc, 4])?).map_err(state)?;
            let new = match layers[layer].take() {
                Some(old) => {
                    // Migrate the rows to the wider pitch (same stream, before anything reads them).
                    for (src, dst) in [(&old.ring, &ring), (&old.zc, &zc)] {
                        let total = checked(&[rows, wc])?;
                        let mut k = KArgs::new();
                        k.i64(src.ptr as i64).i64(dst.ptr as i64).i64(rows as i64).i32(old.wc as i32).i32(wc as i32);
                        launch::launch(f("kvs_pred_migrate")?, (total.div_ceil(256) as u32, 1, 1), 256, &mut k, stream, "kvs_pred_migrate launch")?;
                    }
                    let LayerState { hdr, lens, ring: oring, zc: ozc, .. } = old;
                    // Graphs captured before still name the old arrays: keep them alive.
                    dev.retired().lock().extend([oring, ozc]);
                    LayerState { hdr, lens, ring, zc, wc }
                }
                None => {
                    let hdr = DevBuf::from_host(&vec![0u8; checked(&[pd.max_seqs, pd.hk, 32])?])?;
                    let lens = DevBuf::alloc(checked(&[rows, 4])?)?;
                    LayerState { hdr, lens, ring, zc, wc }
                }
            };
            if std::env::var("KVS_LOG").is_ok_and(|v| v != "0" && !v.is_empty()) {
                eprintln!("kvsparse: predictor layer {layer}: history state {bytes} bytes ({} slots x {} KV heads, {h} rows of {wc} blocks)", pd.max_seqs, pd.hk);
            }
            layers[layer] = Some(new);
        }
        let l = layers[layer].as_ref().expect("allocated above");
        Ok(StateArg { hdr: l.hdr.ptr, lens: l.lens.ptr, ring: l.ring.ptr, zc: l.zc.ptr, h: h as i32, wc: l.wc as i32, hk: pd.hk as i32, pad: 0 })
    }
}

impl PredictorDev {
    /// Uploads the predictor's weights (engine creation).
    pub(crate) fn upload(w: &PredictorWeights, spec: PredictorSpec, num_layers: usize, num_kv_heads: usize, max_seqs: usize) -> Result<Self> {
        ensure!(spec.history < 65536 && spec.block < (1 << 30), Unsupported, "predictor history or block too large for the CUDA backend");
        PredictorDev::new(w, spec, num_layers, num_kv_heads, max_seqs)
    }
}

impl PolicyDevice for PredictorDev {
    fn add_counters(&self, gpu: &crate::cuda::context::Gpu, per_layer: &mut [crate::stats::Counters]) -> Result<()> {
        for (c, (full, partial)) in per_layer.iter_mut().zip(self.read_counters(gpu)?) {
            c[refresh::FULL_STEPS] += full;
            c[refresh::PARTIAL_STEPS] += partial;
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// AttentionPredictor's regions in a call's policy workspace: mode per (seq, head), predicted block scores
/// per (seq, head, block), the history rows' maxima, fixed-point normalisers and NaN flags per query row,
/// and a decode row's logits per (seq, head, query head, position); with the sequences' state slots
/// (device addresses).
pub(crate) struct PredRegions {
    slot: u64,
    slot_gen: u64,
    pred_mode: usize,
    pred_scores: usize,
    pred_rmax: usize,
    pred_z: usize,
    pred_bad: usize,
    pred_logits: usize,
    pred_parts: usize,
    attn_parts: usize,
}

/// The predictor's stage for one call (None: the weights were not uploaded).
pub(crate) struct PredictorStage<'a> {
    state: Option<&'a PredictorDev>,
    spec: PredictorSpec,
    pw: Option<PredWs>,
    /// Offsets of the regions (slots filled at launch).
    at: [usize; 8],
    /// Decode rows' history rows on the tensor cores ([`tc_history`]).
    tc: bool,
}

impl<'a> PredictorStage<'a> {
    pub(crate) fn new(state: Option<&'a PredictorDev>, spec: PredictorSpec) -> Self {
        PredictorStage { state, spec, pw: None, at: [0; 8], tc: false }
    }
}

impl CudaStage for PredictorStage<'_> {
    fn reserve(&mut self, cx: &CallShape, ws: &mut WsAlloc) -> Result<()> {
        let (ns, hk) = (cx.geo.num_seqs, cx.cfg.num_kv_heads);
        let pw = PredWs::new(&self.spec, cx.geo, cx.cfg.group_size(), cx.max_query_len)?;
        self.at = [
            ws.take_n(&[ns, hk, 4])?,
            ws.take_n(&[ns, hk, pw.nbmax, 4])?,
            ws.take_n(&[ns, hk, pw.rcap, 4])?,
            ws.take_n(&[ns, hk, pw.rcap, 8])?,
            ws.take_n(&[ns, hk, pw.rcap, 4])?,
            ws.take_n(&[ns, hk, cx.cfg.group_size(), pw.lcap, 4])?,
            ws.take_n(&[ns, hk, cx.cfg.group_size(), HIST_PARTS, 8])?,
            0,
        ];
        self.tc = tc_history(cx.tensor_cores, cx.cfg.cache_dtype, cx.cfg.dtype, cx.cfg.head_dim, cx.cfg.group_size());
        if self.tc {
            self.at[7] = ws.take_n(&[ns, hk, cx.cfg.group_size(), ATTN_PARTS, 8])?;
        }
        self.pw = Some(pw);
        Ok(())
    }

    fn select(&self, cx: &StepCx) -> Result<()> {
        let Some(pd) = self.state else { bail!(Internal, "predictor weights were not uploaded") };
        let pw = self.pw.as_ref().expect("predictor workspace");
        pd.predictor_step(cx, &self.regions(cx), pw, self.tc)
    }

    /// With tensor cores, the attention also writes the decode rows' logits: the history rows it attended
    /// in full come from them (K read once for both).
    fn rows(&self, cx: &StepCx, keys: usize) -> Option<Rows> {
        let pw = self.pw.as_ref()?;
        self.tc.then(|| Rows::PlanLogits(cx.fin, keys, PredictorDev::logits_out(cx.ws, &self.regions(cx), pw)))
    }

    fn after_attention(&self, cx: &StepCx, _keys: usize) -> Result<()> {
        if !self.tc || !cx.select {
            return Ok(());
        }
        let Some(pd) = self.state else { bail!(Internal, "predictor weights were not uploaded") };
        let pw = self.pw.as_ref().expect("predictor workspace");
        pd.history_rows(cx, &self.regions(cx), pw, true)
    }
}

impl PredictorStage<'_> {
    fn regions(&self, cx: &StepCx) -> PredRegions {
        let [pred_mode, pred_scores, pred_rmax, pred_z, pred_bad, pred_logits, pred_parts, attn_parts] = self.at;
        PredRegions { slot: cx.slot, slot_gen: cx.slot_gen, pred_mode, pred_scores, pred_rmax, pred_z, pred_bad, pred_logits, pred_parts, attn_parts }
    }
}

#[cfg(test)]
mod fragment_tests {
    use super::*;

    #[test]
    fn selection_takes_clusters_for_long_rows_in_one_wave() {
        // H200-like, 132 SMs, 8 KV heads: 1 x 128K (8 rows of 8,193 blocks) on clusters; 1 x 32K (2,049
        // blocks) and 8 x 128K (64 rows x 8 CTAs > 132) not.
        assert!(clusters_fit(132, 8, 8193));
        assert!(!clusters_fit(132, 8, 2049) && !clusters_fit(132, 64, 8193));
        assert!(!clusters_fit(0, 1, 8193) && !clusters_fit(132, usize::MAX, usize::MAX));
        assert!(!select_on_clusters(8, 132, 1, 8193), "no clusters before sm_90");
    }

    #[test]
    fn average_launch_mirrors_the_kernel() {
        let src = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/policy/predictor.cu"));
        assert!(src.contains(&format!("#define PRED_AVG_THREADS {AVG_THREADS}\n")), "predictor.cu PRED_AVG_THREADS");
        assert!(src.contains(&format!("#define PRED_AVG_WIDE_THREADS {AVG_WIDE_THREADS}\n")), "predictor.cu PRED_AVG_WIDE_THREADS");
        // One sequence of 8 KV heads at 128K (block 16) takes the wide shape, eight do not.
        assert_eq!(average_shape(8 * 8192), ("kvs_pred_average_wide", AVG_WIDE_THREADS));
        assert_eq!(average_shape(64 * 8192), ("kvs_pred_average", AVG_THREADS));
    }

    /// At batch 1 (8 rows) one wave of two per SM; from 64 rows the 1,024-CTA split (16 per row at 64, 4 at 256).
    #[test]
    fn logits_grid_is_one_wave_for_few_rows_only() {
        assert_eq!(logits_ctas_per_row(8, 132), 33);
        assert_eq!(logits_ctas_per_row(64, 132), 16);
        assert_eq!(logits_ctas_per_row(256, 132), 4);
        assert_eq!(logits_ctas_per_row(1, 132), 264);
        assert_eq!(logits_ctas_per_row(0, 0), 16);
        assert!(logits_ctas_per_row(100_000, 132) >= 1);
    }

    /// 1.7 steady-state items per CTA below 12 CTAs per SM (H200: 132 SMs), never 0.
    #[test]
    fn conv_grid_follows_the_steady_items_under_its_cap() {
        assert_eq!(conv_ctas_per_row(128, 8, 132), 154); // 1 x 128K, block 16, 64 columns per tile
        assert_eq!(conv_ctas_per_row(32, 8, 132), 39); // 1 x 32K
        assert_eq!(conv_ctas_per_row(128, 64, 132), 25); // 8 x 128K: the cap, 12 per SM
        assert_eq!(conv_ctas_per_row(0, 0, 0), 1);
        assert_eq!(conv_ctas_per_row(usize::MAX, 1, usize::MAX), usize::MAX.div_ceil(5)); // saturates, no overflow
    }

    /// Every second-layer weight sits at its lane, register and half, as hi + lo within 2^-16 of it;
    /// padding is zero; the shared memory the kernel asks for fits the built-in network.
    #[test]
    fn conv2_fragments_hold_every_weight_split_in_lane_order() {
        let w = PredictorWeights::builtin().expect("built-in weights");
        let (c1, c2) = (w.c1, w.c2);
        let flat = w.flat();
        let w2 = &flat[c1 * 10..c1 * 10 + c2 * c1 * 9];
        let fr = conv2_fragments(w);
        let (kc, mt) = (c1.div_ceil(16), c2.div_ceil(16));
        assert_eq!(fr.len(), mt * 9 * kc * 32 * 8);
        let half = |word: u32, upper: bool| f32::from_bits(if upper { word & 0xffff_0000 } else { word << 16 });
        let mut seen = 0usize;
        for mi in 0..mt {
            for kk in 0..9 * kc {
                for lane in 0..32 {
                    let (hi, lo) = (((mi * 9 * kc + kk) * 64 + lane) * 4, ((mi * 9 * kc + kk) * 64 + 32 + lane) * 4);
                    for j in 0..4 {
                        for upper in [false, true] {
                            let co = mi * 16 + lane / 4 + 8 * (j & 1);
                            let ch = (kk % kc) * 16 + 2 * (lane % 4) + 8 * (j >> 1) + upper as usize;
                            let v = half(fr[hi + j], upper) + half(fr[lo + j], upper);
                            let want = if co < c2 && ch < c1 { w2[(co * c1 + ch) * 9 + kk / kc] } else { 0.0 };
                            assert!((v as f64 - want as f64).abs() <= want.abs() as f64 * 2f64.powi(-16), "mi {mi} kk {kk} lane {lane} j {j}: {v} vs {want}");
                            seen += (co < c2 && ch < c1) as usize;
                        }
                    }
                }
            }
        }
        assert_eq!(seen, c2 * c1 * 9, "each weight once");
        assert!(conv_smem_bytes(c1, c2, 64) <= CONV_SMEM);
        assert_eq!(bf16_rn(1.0 + 2f32.powi(-8)), 0x3f80, "ties to even");
        assert_eq!(bf16_rn(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    }
}

/// Compiles the predictor's module (its own, beside the shared ones that src/cuda/module_cache.rs checks
/// under the same test name) with the built-in network's widths, PT as `PredictorDev` picks it.
#[cfg(test)]
mod compile_tests {
    use crate::cuda::module_cache::CompileCheck;

    #[test]
    fn kernel_sources_compile_with_nvrtc() {
        let Some(check) = CompileCheck::new() else { return };
        let widths = ["PRED_C1=16".to_string(), "PRED_C2=32".into(), "PRED_PT=64".into()];
        let build = |defs: Vec<String>| check.build("predictor", super::PREDICTOR, &[defs, widths.to_vec()].concat());
        // Over FP8 caches (kv_load.cuh), both formats.
        for &(dt, d, g) in &[(2, 128usize, 4usize), (1, 64, 8), (2, 256, 8)] {
            for kv8 in [1, 2] {
                build(vec![format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GROUP={g}"), format!("KV8={kv8}"), "--fmad=false".into()]);
            }
        }
        for &(dt, d, g) in &[(2, 128usize, 4usize), (1, 64, 8), (0, 128, 4), (2, 96, 16), (1, 80, 1), (2, 256, 8), (0, 192, 4)] {
            build(vec![format!("KVS_DTYPE={dt}"), format!("HEAD_DIM={d}"), format!("GROUP={g}"), "--fmad=false".into()]);
        }
    }
}
