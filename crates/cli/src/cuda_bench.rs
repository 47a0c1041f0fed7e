//! Decode benchmark on the CUDA backend: dense paged decode over a grid of batch sizes, context lengths
//! and head layouts, timed with CUDA events, next to the device-to-device copy bandwidth measured in the
//! same process. Achieved bandwidth counts the bytes a decode step must move: every visible K and V row
//! once, plus q and out. Inputs rotate among several caches when one would fit in L2, so the cache does
//! not flatter the numbers; block tables are random permutations (blocks scattered as in a long-running
//! server).



use kvsparse::cuda::context::DevBuf;
use kvsparse::cuda::driver::{check, cuda, CUevent, CUstream};
use kvsparse::config::EngineConfig;
use kvsparse::engine::{Engine, ForwardArgs};
use kvsparse::error::Result;
use kvsparse::policy::{refresh, speculate, top_p};
use kvsparse::rng::Rng;
use kvsparse::tensor::{DType, Device, TensorRef};

#[derive(Clone, Copy, Debug)]
pub struct Point {
    pub batch: usize,
    pub ctx: usize,
    pub hq: usize,
    pub hk: usize,
}

#[derive(Clone, Debug)]
pub struct Row {
    pub us: f64,
    pub bytes: f64,
    pub gbps: f64,
    pub frac_copy: f64,
    pub rotation: usize,
}

pub const HEAD_DIM: usize = 128;
pub const BLOCK: usize = 16;

/// The grid: batch 1..128, context 1K..128K, heads 32/8 and 64/8 (head 128, bf16, block 16).
/// PRR's device state of a CUDA engine whose policy is `speculate` (benchmarks' timeline hooks).
fn prr_state(backend: &kvsparse::cuda::CudaBackend) -> Option<&kvsparse::policy::speculate::cuda::PrrDevice> {
    backend.policy_state().and_then(|s| s.downcast_ref())
}

/// Records (or stops recording) the phases of later PRR steps (nothing for other policies).
fn set_prr_timeline(backend: &kvsparse::cuda::CudaBackend, on: bool) {
    if let Some(p) = prr_state(backend) {
        p.set_timeline(on);
    }
}

/// The last PRR step's phase ends on `stream` (empty for other policies).
fn prr_timeline(backend: &kvsparse::cuda::CudaBackend, stream: CUstream) -> Result<Vec<(&'static str, f32)>> {
    prr_state(backend).map_or(Ok(Vec::new()), |p| p.timeline(stream))
}

/// Records events between the predictor's parts of later calls (None: stop; nothing for other policies).
fn set_predictor_probe(backend: &kvsparse::cuda::CudaBackend, ev: Option<[CUevent; 5]>) {
    if let Some(p) = backend.policy_state().and_then(|s| s.downcast_ref::<kvsparse::policy::predictor::cuda::PredictorDev>()) {
        p.set_probe(ev);
    }
}

pub fn default_grid() -> Vec<Point> {
    let mut g = Vec::new();
    for &(hq, hk) in &[(32usize, 8usize), (64, 8)] {
        for &batch in &[1usize, 4, 16, 32, 64, 128] {
            for &ctx in &[1024usize, 4096, 16384, 32768, 131072] {
                g.push(Point { batch, ctx, hq, hk });
            }
        }
    }
    g
}

/// KV bytes of one step at `p` (K and V, bf16).
pub fn kv_bytes(p: &Point) -> usize {
    p.batch * p.ctx * p.hk * HEAD_DIM * 2 * 2
}

pub(crate) struct Events(CUevent, CUevent);
impl Events {
    pub(crate) fn new() -> Result<Events> {
        let api = cuda()?;
        let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: out-parameters; destroyed in Drop.
        unsafe {
            check((api.cuEventCreate)(&mut a, 0), "cuEventCreate")?;
            check((api.cuEventCreate)(&mut b, 0), "cuEventCreate")?;
        }
        Ok(Events(a, b))
    }
    /// Milliseconds taken by `f` (which enqueues work on `stream`).
    pub(crate) fn time(&self, stream: CUstream, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        let api = cuda()?;
        let mut ms = 0f32;
        // SAFETY: valid events and stream.
        unsafe {
            check((api.cuEventRecord)(self.0, stream), "cuEventRecord")?;
            f()?;
            check((api.cuEventRecord)(self.1, stream), "cuEventRecord")?;
            check((api.cuEventSynchronize)(self.1), "cuEventSynchronize")?;
            check((api.cuEventElapsedTime)(&mut ms, self.0, self.1), "cuEventElapsedTime")?;
        }
        Ok(ms as f64)
    }
}
impl Drop for Events {
    fn drop(&mut self) {
        if let Ok(api) = cuda() {
            // SAFETY: created in new().
            unsafe {
                (api.cuEventDestroy)(self.0);
                (api.cuEventDestroy)(self.1);
            }
        }
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of 20 copies of 1 GiB.
pub fn copy_bandwidth() -> Result<f64> {
    let _gpu = kvsparse::cuda::context::Gpu::open(0)?; // primary context current on this thread
    let n = 1usize << 30;
    let (a, b) = (DevBuf::alloc(n)?, DevBuf::alloc(n)?);
    let api = cuda()?;
    let ev = Events::new()?;
    let s: CUstream = std::ptr::null_mut();
    // SAFETY: both buffers hold n bytes.
    let copy = || check(unsafe { (api.cuMemcpyDtoDAsync)(b.ptr, a.ptr, n, s) }, "cuMemcpyDtoDAsync");
    for _ in 0..3 {
        copy()?;
    }
    let mut t = Vec::new();
    for _ in 0..20 {
        t.push(ev.time(s, copy)?);
    }
    Ok(2.0 * n as f64 / (median(t) * 1e-3) / 1e9)
}

/// Random FP8 bytes (no NaN pattern of either format) for `n` cache elements: the FP8 bench's cache.
fn random_fp8(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Exponent fields up to 14 (E4M3: |x| <= 240) and 29 (E5M2): finite, never NaN or infinite.
            (x >> 24) as u8 & 0xf7
        })
        .collect()
}

/// K and V caches of `n` random FP8 elements each for `engine` (its FP8 `cache_dtype`), with the fixed
/// scales the FP8 benches use set on every layer.
pub(crate) fn random_fp8_caches(engine: &Engine, n: usize, seed: u64) -> Result<(DevBuf, DevBuf)> {
    engine.set_kv_scales(None, 1.0 / 32.0, 1.0 / 64.0)?;
    Ok((DevBuf::from_host(&random_fp8(n, seed))?, DevBuf::from_host(&random_fp8(n, seed ^ 0x5555))?))
}

/// Times dense decode at `p` over a cache of `cache` (bf16, or an FP8 format under bf16 queries);
/// `copy_gbps` is the reference bandwidth. `table_width` > 0: block tables of that many tokens (at
/// least the context; the columns past it hold valid, unread ids) and max_seq_len = 0, as a CUDA graph
/// captured for any length is launched. `hnd`: the cache in HND order inside each block (a KV head's rows
/// contiguous, as FlashInfer's backends allocate it) instead of vLLM's NHD.
pub fn bench_point(p: &Point, copy_gbps: f64, l2_bytes: usize, seed: u64, table_width: usize, cache: DType, hnd: bool) -> Result<Row> {
    let d = HEAD_DIM;
    let blocks_per_seq = p.ctx.div_ceil(BLOCK);
    let cols = table_width.div_ceil(BLOCK).max(blocks_per_seq);
    let ces = cache.size_bytes();
    let kv = kv_bytes(p) / 2 * ces;
    let rotation = (4 * l2_bytes).div_ceil(kv).clamp(1, 16);
    let nb = rotation * p.batch * blocks_per_seq;
    let mut cfg = EngineConfig::new(1, p.hq, p.hk, d, BLOCK, DType::BF16);
    cfg.device = Device::Cuda(0);
    cfg.num_threads = 1;
    cfg.cache_dtype = cache;
    let engine = Engine::new(cfg)?;
    let backend = engine.backend().as_any().downcast_ref::<kvsparse::cuda::CudaBackend>().expect("CUDA engine");
    let cache_elems = nb * BLOCK * p.hk * d;
    let s: CUstream = std::ptr::null_mut();
    let (kc, vc) = if cache.is_fp8() {
        random_fp8_caches(&engine, cache_elems, seed)?
    } else {
        let (kc, vc) = (DevBuf::alloc(cache_elems * 2)?, DevBuf::alloc(cache_elems * 2)?);
        backend.fill_random(kc.ptr, cache_elems, DType::BF16, seed as u32, 4.0, s)?;
        backend.fill_random(vc.ptr, cache_elems, DType::BF16, seed as u32 ^ 0x5555, 2.0, s)?;
        (kc, vc)
    };
    let q_elems = rotation * p.batch * p.hq * d;
    let q = DevBuf::alloc(q_elems * 2)?;
    backend.fill_random(q.ptr, q_elems, DType::BF16, seed as u32 ^ 0xaaaa, 2.0, s)?;
    let out = DevBuf::alloc(rotation * p.batch * p.hq * d * 2)?;
    // Rotation r uses blocks [r*B*bps, (r+1)*B*bps), each set shuffled.
    let mut rng = Rng::new(seed);
    let mut table = vec![0i32; rotation * p.batch * blocks_per_seq];
    for r in 0..rotation {
        let base = r * p.batch * blocks_per_seq;
        let mut ids: Vec<usize> = (base..base + p.batch * blocks_per_seq).collect();
        rng.shuffle(&mut ids);
        for (i, id) in ids.into_iter().enumerate() {
            table[base + i] = id as i32;
        }
    }
    // Rows of `cols` entries: the sequence's blocks, then (past its length) its first block again.
    let table: Vec<i32> = table.chunks(blocks_per_seq).flat_map(|row| row.iter().copied().chain(std::iter::repeat(row[0]).take(cols - blocks_per_seq))).collect();
    let bt = DevBuf::from_host(bytes(&table))?;
    let seq_lens = DevBuf::from_host(bytes(&vec![p.ctx as i32; p.batch]))?;
    let qsl = DevBuf::from_host(bytes(&(0..=p.batch as i32).collect::<Vec<i32>>()))?;
    let dev = Device::Cuda(0);
    let v = |ptr: *mut u8, dt, shape: &[i64]| -> Result<TensorRef> {
        // SAFETY: each view addresses exactly its allocation (or a slice of it for a rotation index).
        unsafe { TensorRef::from_raw(ptr, dt, dev, shape, None) }
    };
    let cshape = [nb as i64, BLOCK as i64, p.hk as i64, d as i64];
    let (blk, hk, di) = (BLOCK as i64, p.hk as i64, d as i64);
    let hnd_strides = [blk * hk * di, di, blk * di, 1];
    let cache_view = |ptr: *mut u8| -> Result<TensorRef> {
        // SAFETY: both layouts address exactly the allocation's nb blocks.
        unsafe { TensorRef::from_raw(ptr, cache, dev, &cshape, if hnd { Some(&hnd_strides[..]) } else { None }) }
    };
    let mut args = Vec::with_capacity(rotation);
    for r in 0..rotation {
        let qoff = r * p.batch * p.hq * d * 2;
        args.push(ForwardArgs {
            layer: 0,
            query: v(unsafe { q.as_ptr().add(qoff) }, DType::BF16, &[p.batch as i64, p.hq as i64, d as i64])?,
            key_cache: cache_view(kc.as_ptr())?,
            value_cache: cache_view(vc.as_ptr())?,
            block_table: v(unsafe { bt.as_ptr().add(r * p.batch * cols * 4) }, DType::I32, &[p.batch as i64, cols as i64])?,
            seq_lens: v(seq_lens.as_ptr(), DType::I32, &[p.batch as i64])?,
            query_start_loc: v(qsl.as_ptr(), DType::I32, &[p.batch as i64 + 1])?,
            seq_ids: None,
            out: v(unsafe { out.as_ptr().add(qoff) }, DType::BF16, &[p.batch as i64, p.hq as i64, d as i64])?,
            lse: None,
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: 0,
            softcap: 0.0,
            max_query_len: 1,
            max_seq_len: if table_width > 0 { 0 } else { p.ctx as i32 },
            stream: s,
        });
    }
    for a in &args {
        engine.attention_forward(a)?; // warm-up: modules, workspace
    }
    let ev = Events::new()?;
    let per_group = 10usize;
    let mut times = Vec::new();
    let mut i = 0usize;
    for _ in 0..15 {
        let ms = ev.time(s, || {
            for _ in 0..per_group {
                engine.attention_forward(&args[i % args.len()])?;
                i += 1;
            }
            Ok(())
        })?;
        times.push(ms / per_group as f64);
    }
    let ms = median(times);
    let bytes = kv as f64 + 2.0 * (p.batch * p.hq * d * 2) as f64;
    let gbps = bytes / (ms * 1e-3) / 1e9;
    Ok(Row { us: ms * 1e3, bytes, gbps, frac_copy: gbps / copy_gbps, rotation })
}

pub(crate) fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slice viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Free device memory in bytes.
pub fn free_memory() -> Result<usize> {
    let (mut f, mut t) = (0usize, 0usize);
    // SAFETY: out-parameters.
    check(unsafe { (cuda()?.cuMemGetInfo)(&mut f, &mut t) }, "cuMemGetInfo")?;
    Ok(f)
}


/// One grid point of the sparse decode benchmark.
#[derive(Clone, Debug)]
pub struct SparseRow {
    /// The decode step's cache write of one new row per sequence, appended as a serving engine's decode
    /// step appends it (the next slot of the sequence's last block, or offset 0 of a block reused): with
    /// the policy's metadata upkeep, and on a dense engine (no metadata).
    pub write_us: f64,
    pub write_dense_us: f64,
    /// The same write onto a row already there (the sequence's last, kept row rewritten): the policy's
    /// metadata upkeep re-reads the unit's other rows. What a step costs where an engine rewrites a slot
    /// (a rejected speculative token's slot, a recomputed chunk).
    pub write_rewrite_us: f64,
    pub select_us: f64,
    pub attend_us: f64,
    /// Selection + attention in one call (what a step pays besides the write).
    pub forward_us: f64,
    pub dense_us: f64,
    /// Blocks visited / eligible over the policy rows, and top-p's kept / candidates.
    pub visited: f64,
    pub top_p_kept: f64,
    /// Bytes of metadata Quest's selection reads (page bounds), and that time at `copy_gbps`.
    pub bound_bytes: f64,
    pub rotation: usize,
    /// Stateful policies: how many consecutive steps `step_mean_us` averages (0 for others).
    pub mean_steps: usize,
    /// SnapKV: its choice at the prefill chunk (the `window` last prompt tokens of every sequence), the
    /// choice kernels alone; NaN for other policies.
    pub choice_us: f64,
    /// Stateful policies: the mean of many consecutive steps (selection + attention), and for RefreshKV the
    /// fraction of those steps that ran full; NaN for other policies.
    pub step_mean_us: f64,
    pub refresh_full: f64,
    /// PRR (`speculate`): the serial path on the same inputs (`quest` with the same budget, page and sink:
    /// select, then attend), the fraction of true pages the speculation hit in the timed steps, and the
    /// mean end of each phase of a step in us after the fork (both streams; `prr::TIMELINE`). NaN / empty
    /// for other policies.
    pub serial_us: f64,
    pub spec_hit: f64,
    pub timeline: Vec<(&'static str, f64)>,
    /// PRR: the same steps captured in CUDA graphs and replayed (no host launch cost: the GPU's own time),
    /// PRR and serial Quest, and the timeline of a replayed step (or why it could not be read).
    pub graph_us: f64,
    pub serial_graph_us: f64,
    pub graph_timeline: std::result::Result<Vec<(&'static str, f64)>, String>,
    /// AttentionPredictor: median per-part times of a step (schedule + CNN, selection, history row), from
    /// events between the parts; NaN for other policies.
    pub pred_parts_us: [f64; 3],
}

/// Keys that attention concentrates on, as in real decoding (heavy hitters): for every (rotation, sequence,
/// KV head), `HOT_KEYS` random positions get a key along that head's mean query direction, scaled so that
/// its logit is about `HOT_LOGIT` above the flat background of the uniform random keys (logit spread ~0.3).
/// Without them a random cache gives flat attention, where top-p keeps almost every candidate.
pub const HOT_KEYS: usize = 32;
pub const HOT_LOGIT: f64 = 12.0;

fn plant_heavy_hitters(kc: &DevBuf, qh: &[f32], table: &[i32], p: &Point, rotation: usize, bps: usize, rng: &mut Rng) -> Result<()> {
    let d = HEAD_DIM;
    let g = p.hq / p.hk;
    for r in 0..rotation {
        for b in 0..p.batch {
            for h in 0..p.hk {
                let qrow = |j: usize| &qh[((r * p.batch + b) * p.hq + h * g + j) * d..][..d];
                let mut dir = vec![0f64; d];
                for j in 0..g {
                    for (x, &y) in dir.iter_mut().zip(qrow(j)) {
                        *x += y as f64;
                    }
                }
                let norm = dir.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-9);
                dir.iter_mut().for_each(|x| *x /= norm);
                let proj = (0..g).map(|j| qrow(j).iter().zip(&dir).map(|(&a, &b)| a as f64 * b).sum::<f64>()).sum::<f64>() / g as f64;
                let alpha = HOT_LOGIT * (d as f64).sqrt() / proj.max(1e-3);
                for _ in 0..HOT_KEYS {
                    // Each heavy hitter its own key (a little noise): real ones are not copies of each other.
                    let row: Vec<u16> = dir.iter().map(|&x| half::bf16::from_f64((x + 0.05 * (rng.uniform() - 0.5)) * alpha).to_bits()).collect();
                    let pos = rng.below(p.ctx);
                    let blk = table[(r * p.batch + b) * bps + pos / BLOCK] as usize;
                    let off = ((blk * BLOCK + pos % BLOCK) * p.hk + h) * d * 2;
                    kc.upload(off, bytes(&row))?;
                }
            }
        }
    }
    Ok(())
}

/// Query sets in a drift cycle of `drift_deg` degrees per step (1: no drift).
pub fn drift_period(drift_deg: f64) -> usize {
    if drift_deg > 0.0 { (360.0 / drift_deg).round().clamp(4.0, 720.0) as usize } else { 1 }
}

/// Drifting decode queries: for every query row q0 of `qh` (rows of `d`), `period` rows on a great circle
/// through it: q_t = cos(2 pi t / period) q0 + sin(2 pi t / period) b, b a random row made orthogonal to q0
/// and of its norm, so step t's row is 360 t / period degrees from q0 and every step turns it by the same
/// angle, with no jump where the cycle closes. Layout [t][rows of qh], t = 0 being `qh` itself.
fn drifting_queries(qh: &[f32], d: usize, period: usize, rng: &mut Rng) -> Vec<f32> {
    let mut out = Vec::with_capacity(qh.len() * period);
    out.extend_from_slice(qh);
    let mut bs = Vec::with_capacity(qh.len());
    for a in qh.chunks(d) {
        let b: Vec<f64> = (0..d).map(|_| rng.uniform() * 2.0 - 1.0).collect();
        let aa: f64 = a.iter().map(|&x| x as f64 * x as f64).sum();
        let ab: f64 = a.iter().zip(&b).map(|(&x, y)| x as f64 * y).sum();
        let perp: Vec<f64> = a.iter().zip(&b).map(|(&x, y)| y - ab / aa.max(f64::MIN_POSITIVE) * x as f64).collect();
        let pn = perp.iter().map(|x| x * x).sum::<f64>().sqrt().max(f64::MIN_POSITIVE);
        bs.extend(perp.iter().map(|x| x * aa.sqrt() / pn));
    }
    for t in 1..period {
        let phi = 2.0 * std::f64::consts::PI * t as f64 / period as f64;
        out.extend(qh.iter().zip(&bs).map(|(&a, b)| (phi.cos() * a as f64 + phi.sin() * b) as f32));
    }
    out
}

/// The FP8 scales of the benches' caches (the random bf16 rows lie in ±4 for K, ±2 for V: no saturation).
const FP8_K_SCALE: f32 = 1.0 / 64.0;
const FP8_V_SCALE: f32 = 1.0 / 128.0;
/// Blocks per sequence that the step's appended rows cycle through (outside every block table).
const APPEND_BLOCKS: usize = 16;

/// Times one decode step of `policy` at `p` (32/8-style heads, head 128, bf16, block 16), phase by phase,
/// next to our dense kernel on the same cache (uniform random keys and values plus planted heavy hitters,
/// see [`plant_heavy_hitters`]). The cache is filled with random rows and its metadata built
/// by one `cache_write` of every slot onto itself. The step's write appends one row per sequence in blocks
/// of its own outside the attended range (the next slot each call, cycling through [`APPEND_BLOCKS`]
/// blocks, whose offset 0 is then a reused block's first write, as in a serving engine), and is also timed
/// rewriting each sequence's last row.
/// Inputs rotate among copies so that the bytes a sparse step touches (bounds + selected rows) cover at
/// least 4x the L2 cache (`max_kv_bytes` bounds the copies' memory).
/// `cache`: the K/V caches' dtype, bf16 or FP8 (the rows are made in bf16 and written through the engine's
/// cache write, which quantizes them and keeps the key metadata from what it stored).
/// `drift_deg` > 0: the decode queries drift, each step's turned `drift_deg` degrees further from the
/// first ([`drifting_queries`]); 0: every step of a sequence sees the same query.
pub fn bench_sparse_point(p: &Point, policy: &str, l2_bytes: usize, max_kv_bytes: usize, seed: u64, cache: DType, drift_deg: f64) -> Result<SparseRow> {
    let d = HEAD_DIM;
    let bps = p.ctx.div_ceil(BLOCK);
    let kv = kv_bytes(p);
    let touched = (kv / 8).max(1);
    let rotation = (4 * l2_bytes).div_ceil(touched).clamp(1, 32).min((max_kv_bytes / kv.max(1)).max(1));
    // The attended blocks, then APPEND_BLOCKS per sequence of rotation 0 for the step's appended rows.
    let nb_attended = rotation * p.batch * bps;
    let nb = nb_attended + p.batch * APPEND_BLOCKS;
    // Stateful policies (RefreshKV) keep state per sequence: every rotation's sequences have ids of their own.
    // The one parse of the spec text (the engine's config depends on it); later decisions read the engine's.
    let parsed = kvsparse::policy::Policy::parse(policy)?;
    let stateful = parsed.device_slots().is_some();
    // Every policy that keeps per-sequence state needs seq_ids (SnapKV too, though on the device its choice
    // lives with the cache blocks): the engine refuses its calls without them.
    let with_ids = parsed.is_stateful();
    let n_ids = rotation * p.batch;
    let mk = |pol: &str| -> Result<Engine> {
        let mut cfg = EngineConfig::new(1, p.hq, p.hk, d, BLOCK, DType::BF16);
        cfg.device = Device::Cuda(0);
        cfg.num_threads = 1;
        // Options after a policy's own (e.g. `; max_seqs=32`) join with a comma; stateful policies get a slot
        // per sequence of the rotation unless the spec names max_seqs.
        let opts = if stateful && !pol.contains("max_seqs") { format!("dense_layers=0, max_seqs={}", n_ids.max(1)) } else { "dense_layers=0".to_string() };
        cfg.policy = if pol.is_empty() { String::new() } else if pol.contains(';') { format!("{pol}, {opts}") } else { format!("{pol}; {opts}") };
        cfg.cache_dtype = cache;
        let e = Engine::new(cfg)?;
        if cache.is_fp8() {
            e.set_kv_scales(None, FP8_K_SCALE, FP8_V_SCALE)?;
        }
        Ok(e)
    };
    let engine = mk(policy)?;
    let dense = mk("")?;
    // PRR: the serial Quest path it is measured against.
    let serial = match engine.policy().pipeline().map(|pl| pl.selector.clone()) {
        Some(kvsparse::policy::Selector::Speculate(sp)) => Some(mk(&format!("quest(budget={}, page={}, sink={})", sp.quest_budget, sp.page, sp.quest_sink))?),
        _ => None,
    };
    let backend = engine.backend().as_any().downcast_ref::<kvsparse::cuda::CudaBackend>().expect("CUDA engine");
    let s: CUstream = std::ptr::null_mut();
    let row = p.hk * d; // elements per token row
    let cache_elems = nb * BLOCK * row;
    let (kc, vc) = (DevBuf::alloc(cache_elems * 2)?, DevBuf::alloc(cache_elems * 2)?);
    backend.fill_random(kc.ptr, cache_elems, DType::BF16, seed as u32, 4.0, s)?;
    backend.fill_random(vc.ptr, cache_elems, DType::BF16, seed as u32 ^ 0x5555, 2.0, s)?;
    let q_elems = rotation * p.batch * p.hq * d;
    let mut rng = Rng::new(seed);
    let qh: Vec<f32> = (0..q_elems).map(|_| (rng.uniform() * 2.0 - 1.0) as f32).collect();
    // Drifting queries: `period` query sets per rotation, step t's the first turned by t * drift degrees.
    let period = drift_period(drift_deg);
    let drifted = if period > 1 { drifting_queries(&qh, d, period, &mut rng) } else { Vec::new() };
    let q_all: &[f32] = if period > 1 { &drifted } else { &qh };
    let q = DevBuf::from_host(bytes(&q_all.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect::<Vec<u16>>()))?;
    let out = DevBuf::alloc(q_elems * 2)?;
    let mut table = vec![0i32; rotation * p.batch * bps];
    for r in 0..rotation {
        let base = r * p.batch * bps;
        let mut ids: Vec<usize> = (base..base + p.batch * bps).collect();
        rng.shuffle(&mut ids);
        for (i, id) in ids.into_iter().enumerate() {
            table[base + i] = id as i32;
        }
    }
    plant_heavy_hitters(&kc, &qh, &table, p, rotation, bps, &mut rng)?;
    let bt = DevBuf::from_host(bytes(&table))?;
    let seq_lens = DevBuf::from_host(bytes(&vec![p.ctx as i32; p.batch]))?;
    let qsl = DevBuf::from_host(bytes(&(0..=p.batch as i32).collect::<Vec<i32>>()))?;
    let ids = DevBuf::from_host(bytes(&(0..n_ids as i64).collect::<Vec<i64>>()))?;
    let dev = Device::Cuda(0);
    let v = |ptr: *mut u8, dt, shape: &[i64]| -> Result<TensorRef> {
        // SAFETY: each view addresses exactly its allocation (or a slice of it for a rotation index).
        unsafe { TensorRef::from_raw(ptr, dt, dev, shape, None) }
    };
    let cshape = [nb as i64, BLOCK as i64, p.hk as i64, d as i64];
    // The caches the steps read: the bf16 rows themselves, or an FP8 copy the writes below fill.
    let fp8_caches = if cache.is_fp8() { Some((DevBuf::alloc(cache_elems)?, DevBuf::alloc(cache_elems)?)) } else { None };
    let (kcache, vcache) = match &fp8_caches {
        Some((k8, v8)) => (v(k8.as_ptr(), cache, &cshape)?, v(v8.as_ptr(), cache, &cshape)?),
        None => (v(kc.as_ptr(), DType::BF16, &cshape)?, v(vc.as_ptr(), DType::BF16, &cshape)?),
    };
    // Metadata for every slot (and the FP8 copy): write the rows into the cache (onto themselves for bf16),
    // in chunks of 1M rows.
    let all_slots: Vec<i64> = (0..(nb * BLOCK) as i64).collect();
    let slots_dev = DevBuf::from_host(bytes(&all_slots))?;
    let chunk = 1usize << 20;
    let mut at = 0usize;
    while at < nb * BLOCK {
        let n = chunk.min(nb * BLOCK - at);
        let off = at * row * 2;
        let view_rows = |b: &DevBuf| v(unsafe { b.as_ptr().add(off) }, DType::BF16, &[n as i64, p.hk as i64, d as i64]);
        let w = kvsparse::engine::CacheWriteArgs {
            layer: 0,
            key: view_rows(&kc)?,
            value: view_rows(&vc)?,
            key_cache: kcache.clone(),
            value_cache: vcache.clone(),
            slot_mapping: v(unsafe { slots_dev.as_ptr().add(at * 8) }, DType::I64, &[n as i64])?,
            stream: s,
        };
        engine.cache_write(&w)?;
        if let Some(e) = &serial {
            e.cache_write(&w)?;
        }
        at += n;
    }
    // The step's write: each sequence's last row (rotation 0), copied out and written back.
    let last_slots: Vec<i64> = (0..p.batch).map(|b| table[b * bps + (p.ctx - 1) / BLOCK] as i64 * BLOCK as i64 + ((p.ctx - 1) % BLOCK) as i64).collect();
    let step_slots = DevBuf::from_host(bytes(&last_slots))?;
    let (nk, nv) = (DevBuf::alloc(p.batch * row * 2)?, DevBuf::alloc(p.batch * row * 2)?);
    let api = cuda()?;
    for (b, &sl) in last_slots.iter().enumerate() {
        // SAFETY: both ranges lie inside their allocations.
        unsafe {
            check((api.cuMemcpyDtoDAsync)(nk.ptr + (b * row * 2) as u64, kc.ptr + (sl as usize * row * 2) as u64, row * 2, s), "copy")?;
            check((api.cuMemcpyDtoDAsync)(nv.ptr + (b * row * 2) as u64, vc.ptr + (sl as usize * row * 2) as u64, row * 2, s), "copy")?;
        }
    }
    let step_write = kvsparse::engine::CacheWriteArgs {
        layer: 0,
        key: v(nk.as_ptr(), DType::BF16, &[p.batch as i64, p.hk as i64, d as i64])?,
        value: v(nv.as_ptr(), DType::BF16, &[p.batch as i64, p.hk as i64, d as i64])?,
        key_cache: kcache.clone(),
        value_cache: vcache.clone(),
        slot_mapping: v(step_slots.as_ptr(), DType::I64, &[p.batch as i64])?,
        stream: s,
    };
    // The appending writes: call c puts sequence b's row at slot c % BLOCK of its append block c / BLOCK.
    let cycle = APPEND_BLOCKS * BLOCK;
    let append_slots: Vec<i64> =
        (0..cycle).flat_map(|c| (0..p.batch).map(move |b| ((nb_attended + b * APPEND_BLOCKS + c / BLOCK) * BLOCK + c % BLOCK) as i64)).collect();
    let append_dev = DevBuf::from_host(bytes(&append_slots))?;
    let append_writes = (0..cycle)
        .map(|c| {
            let slots = v(unsafe { append_dev.as_ptr().add(c * p.batch * 8) }, DType::I64, &[p.batch as i64])?;
            Ok(kvsparse::engine::CacheWriteArgs { slot_mapping: slots, ..step_write.clone() })
        })
        .collect::<Result<Vec<_>>>()?;
    // Call i serves rotation i % rotation at drift step (i / rotation) % period: args[t * rotation + r],
    // indexed by i % args.len().
    let mut args = Vec::with_capacity(rotation * period);
    for (t, r) in (0..period).flat_map(|t| (0..rotation).map(move |r| (t, r))) {
        let qoff = r * p.batch * p.hq * d * 2;
        let qoff_t = (t * rotation + r) * p.batch * p.hq * d * 2;
        args.push(ForwardArgs {
            layer: 0,
            query: v(unsafe { q.as_ptr().add(qoff_t) }, DType::BF16, &[p.batch as i64, p.hq as i64, d as i64])?,
            key_cache: kcache.clone(),
            value_cache: vcache.clone(),
            block_table: v(unsafe { bt.as_ptr().add(r * p.batch * bps * 4) }, DType::I32, &[p.batch as i64, bps as i64])?,
            seq_lens: v(seq_lens.as_ptr(), DType::I32, &[p.batch as i64])?,
            query_start_loc: v(qsl.as_ptr(), DType::I32, &[p.batch as i64 + 1])?,
            seq_ids: if with_ids { Some(v(unsafe { ids.as_ptr().add(r * p.batch * 8) }, DType::I64, &[p.batch as i64])?) } else { None },
            out: v(unsafe { out.as_ptr().add(qoff) }, DType::BF16, &[p.batch as i64, p.hq as i64, d as i64])?,
            lse: None,
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: 0,
            softcap: 0.0,
            max_query_len: 1,
            max_seq_len: p.ctx as i32,
            stream: s,
        });
    }
    // SnapKV chooses at a prefill chunk: the last `window` prompt tokens of every sequence, whose queries
    // are the decode query repeated (the observation window predicts the decode step, which is what the
    // method relies on). One chunk per rotation, so every rotation's blocks hold a choice.
    let snap_window = match engine.policy().pipeline().map(|pl| pl.selector.clone()) {
        Some(kvsparse::policy::Selector::SnapKv(kvsparse::policy::SnapKv { window, .. })) => Some(window.clamp(1, p.ctx)),
        _ => None,
    };
    let mut prefill = Vec::new();
    let mut prefill_bufs = Vec::new();
    if let Some(w) = snap_window {
        let pq: Vec<u16> = (0..rotation * p.batch * w).flat_map(|i| {
            let (r, b) = (i / (p.batch * w), (i / w) % p.batch);
            let at = (r * p.batch + b) * p.hq * d;
            qh[at..at + p.hq * d].iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect::<Vec<u16>>()
        }).collect();
        let (pqd, pod) = (DevBuf::from_host(bytes(&pq))?, DevBuf::alloc(pq.len() * 2)?);
        let pqsl = DevBuf::from_host(bytes(&(0..=p.batch as i32).map(|b| b * w as i32).collect::<Vec<i32>>()))?;
        for r in 0..rotation {
            let off = r * p.batch * w * p.hq * d * 2;
            let rows = (p.batch * w) as i64;
            prefill.push(ForwardArgs {
                query: v(unsafe { pqd.as_ptr().add(off) }, DType::BF16, &[rows, p.hq as i64, d as i64])?,
                query_start_loc: v(pqsl.as_ptr(), DType::I32, &[p.batch as i64 + 1])?,
                out: v(unsafe { pod.as_ptr().add(off) }, DType::BF16, &[rows, p.hq as i64, d as i64])?,
                max_query_len: w as i32,
                ..args[r].clone()
            });
        }
        for a in &prefill {
            engine.attention_forward(a)?;
        }
        prefill_bufs.extend([pqd, pod, pqsl]);
    }
    let ev = Events::new()?;
    let time_calls = |f: &dyn Fn(usize) -> Result<()>| -> Result<f64> {
        for i in 0..rotation.max(2) {
            f(i)?; // warm-up: modules, workspaces
        }
        let per_group = 10usize;
        let mut times = Vec::new();
        let mut i = 0usize;
        for _ in 0..15 {
            let ms = ev.time(s, || {
                for _ in 0..per_group {
                    f(i)?;
                    i += 1;
                }
                Ok(())
            })?;
            times.push(ms / per_group as f64);
        }
        Ok(median(times) * 1e3)
    };
    if stateful {
        // A stateful policy's first steps have no history (they attend everything): count a later one.
        for i in 0..3 {
            engine.attention_forward(&args[i % args.len()])?;
        }
    }
    let before = engine.stats().total;
    engine.attention_forward(&args[0])?;
    let after = engine.stats().total;
    let (elig, vis) = ((after.blocks_eligible - before.blocks_eligible) as f64, (after.blocks_visited - before.blocks_visited) as f64);
    let (cand, kept) = ((after[top_p::CANDIDATES] - before[top_p::CANDIDATES]) as f64, (after[top_p::KEPT] - before[top_p::KEPT]) as f64);
    let forward_us = time_calls(&|i| engine.attention_forward(&args[i % args.len()]).map(|_| ()))?;
    // A stateful policy's steps differ (RefreshKV: full and partial), so a median of groups can miss the
    // expensive ones: the mean over many consecutive steps (every rotation's sequences alike), and the
    // fraction of them that ran full.
    // With drifting queries, at least two cycles of the drift per sequence.
    let mean_steps = if stateful { 60.max(2 * period) * rotation } else { 0 };
    let (step_mean_us, refresh_full) = if stateful {
        let n = mean_steps;
        let c0 = engine.stats().total;
        let ms = ev.time(s, || {
            for i in 0..n {
                engine.attention_forward(&args[i % args.len()])?;
            }
            Ok(())
        })?;
        let c1 = engine.stats().total;
        let (rf, rp) = (c1[refresh::FULL_STEPS] - c0[refresh::FULL_STEPS], c1[refresh::PARTIAL_STEPS] - c0[refresh::PARTIAL_STEPS]);
        (ms * 1e3 / n as f64, if rf + rp > 0 { rf as f64 / (rf + rp) as f64 } else { f64::NAN })
    } else {
        (f64::NAN, f64::NAN)
    };
    // PRR runs its own phases on two streams: the serial Quest path and the step's timeline instead.
    let (mut serial_us, mut spec_hit, mut timeline) = (f64::NAN, f64::NAN, Vec::new());
    let (mut graph_us, mut serial_graph_us, mut graph_timeline) = (f64::NAN, f64::NAN, Ok(Vec::new()));
    if let Some(se) = &serial {
        serial_us = time_calls(&|i| se.attention_forward(&args[i % args.len()]).map(|_| ()))?;
        let before = engine.stats().total;
        set_prr_timeline(backend, true);
        let n = 30usize;
        let mut per: Vec<Vec<f64>> = vec![Vec::new(); kvsparse::policy::speculate::cuda::TIMELINE.len()];
        for i in 0..n {
            engine.attention_forward(&args[i % args.len()])?;
            for (j, (_, ms)) in prr_timeline(backend, s)?.into_iter().enumerate() {
                per[j].push(ms as f64 * 1e3);
            }
        }
        set_prr_timeline(backend, false);
        let after = engine.stats().total;
        let (hit, tru) = (after[speculate::HIT_BLOCKS] - before[speculate::HIT_BLOCKS], after[speculate::TRUE_BLOCKS] - before[speculate::TRUE_BLOCKS]);
        spec_hit = if tru > 0 { hit as f64 / tru as f64 } else { f64::NAN };
        timeline = kvsparse::policy::speculate::cuda::TIMELINE.iter().zip(per).map(|(&name, v)| (name, median(v))).collect();
        let (g, sg, gt) = prr_graph_times(&engine, se, &args, rotation)?;
        graph_us = g;
        serial_graph_us = sg;
        graph_timeline = gt;
    }
    let (select_us, attend_us) = if serial.is_some() {
        (Ok(f64::NAN), Ok(f64::NAN))
    } else {
        backend.set_bench_phases(true, false);
        let select_us = time_calls(&|i| engine.attention_forward(&args[i % args.len()]).map(|_| ()));
        backend.set_bench_phases(false, true);
        let attend_us = time_calls(&|i| engine.attention_forward(&args[i % args.len()]).map(|_| ()));
        backend.set_bench_phases(true, true);
        (select_us, attend_us)
    };
    let choice_us = if prefill.is_empty() {
        Ok(f64::NAN)
    } else {
        backend.set_bench_phases(true, false);
        let t = time_calls(&|i| engine.attention_forward(&prefill[i % rotation]).map(|_| ()));
        backend.set_bench_phases(true, true);
        t
    };
    let (select_us, attend_us, choice_us) = (select_us?, attend_us?, choice_us?);
    let mut pred_parts_us = [f64::NAN; 3];
    if matches!(engine.policy().pipeline().map(|pl| &pl.selector), Some(kvsparse::policy::Selector::Predictor(_))) {
        let api = cuda()?;
        let mut evs = [std::ptr::null_mut(); 5];
        for e in evs.iter_mut() {
            // SAFETY: out-parameter; destroyed below.
            check(unsafe { (api.cuEventCreate)(e, 0) }, "cuEventCreate")?;
        }
        set_predictor_probe(backend, Some(evs));
        let mut parts: [Vec<f64>; 3] = Default::default();
        let r = (|| -> Result<()> {
            for i in 0..30 {
                engine.attention_forward(&args[i % args.len()])?;
                // SAFETY: events recorded by the call above.
                unsafe { check((api.cuEventSynchronize)(evs[4]), "cuEventSynchronize")? };
                // Schedule + CNN, selection, history rows (the step's attention, between events 2 and 3, not).
                for (part, (e0, e1)) in parts.iter_mut().zip([(0, 1), (1, 2), (3, 4)]) {
                    let mut ms = 0f32;
                    // SAFETY: both events recorded and complete.
                    unsafe { check((api.cuEventElapsedTime)(&mut ms, evs[e0], evs[e1]), "cuEventElapsedTime")? };
                    part.push(ms as f64 * 1e3);
                }
            }
            Ok(())
        })();
        set_predictor_probe(backend, None);
        for e in evs {
            // SAFETY: created above.
            unsafe { (api.cuEventDestroy)(e) };
        }
        r?;
        for (k, part) in parts.into_iter().enumerate() {
            pred_parts_us[k] = median(part);
        }
    }
    drop(prefill_bufs);
    let dense_us = time_calls(&|i| dense.attention_forward(&args[i % args.len()]).map(|_| ()))?;
    let write_us = time_calls(&|i| engine.cache_write(&append_writes[i % cycle]))?;
    let write_dense_us = time_calls(&|i| dense.cache_write(&append_writes[i % cycle]))?;
    let write_rewrite_us = time_calls(&|_| engine.cache_write(&step_write))?;
    let bound_bytes = match engine.policy().pipeline().map(|pl| pl.selector.clone()) {
        Some(kvsparse::policy::Selector::Quest(kvsparse::policy::Quest { page, .. })) => (p.batch * p.hk * p.ctx.div_ceil(page.min(BLOCK)) * d * 2 * 2) as f64,
        _ => 0.0,
    };
    Ok(SparseRow {
        write_us,
        write_dense_us,
        write_rewrite_us,
        select_us,
        attend_us,
        forward_us,
        dense_us,
        visited: if elig > 0.0 { vis / elig } else { f64::NAN },
        top_p_kept: if cand > 0.0 { kept / cand } else { f64::NAN },
        bound_bytes,
        rotation,
        mean_steps,
        choice_us,
        step_mean_us,
        refresh_full,
        serial_us,
        spec_hit,
        timeline,
        graph_us,
        serial_graph_us,
        graph_timeline,
        pred_parts_us,
    })
}

/// PRR against serial Quest with both steps captured in CUDA graphs (one graph of `rotation` steps each,
/// on a private stream), replayed in groups of 10 (median of 15 groups, per step); then the timeline of a
/// replayed single step (the timing events become event-record nodes of the graph).
#[allow(clippy::type_complexity)]
fn prr_graph_times(engine: &Engine, serial: &Engine, args: &[ForwardArgs], rotation: usize) -> Result<(f64, f64, std::result::Result<Vec<(&'static str, f64)>, String>)> {
    use kvsparse::cuda::driver::{CUgraphExec, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, CU_STREAM_NON_BLOCKING};
    let api = cuda()?;
    let mut gs: CUstream = std::ptr::null_mut();
    // SAFETY: out-parameter; destroyed below.
    check(unsafe { (api.cuStreamCreate)(&mut gs, CU_STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
    let gargs: Vec<ForwardArgs> = args.iter().map(|a| ForwardArgs { stream: gs, ..*a }).collect();
    let backend = engine.backend().as_any().downcast_ref::<kvsparse::cuda::CudaBackend>().expect("CUDA engine");
    let capture = |e: &Engine, steps: &[ForwardArgs]| -> Result<CUgraphExec> {
        // SAFETY: capture on our own stream; the graph is destroyed once instantiated.
        unsafe {
            check((api.cuStreamSynchronize)(gs), "cuStreamSynchronize")?;
            check((api.cuStreamBeginCapture)(gs, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")?;
            let r = steps.iter().try_for_each(|a| e.attention_forward(a).map(|_| ()));
            let mut graph = std::ptr::null_mut();
            let end = check((api.cuStreamEndCapture)(gs, &mut graph), "cuStreamEndCapture");
            r?;
            end?;
            let mut exec = std::ptr::null_mut();
            let inst = check((api.cuGraphInstantiateWithFlags)(&mut exec, graph, 0), "cuGraphInstantiate");
            (api.cuGraphDestroy)(graph);
            inst?;
            Ok(exec)
        }
    };
    let result = (|| -> Result<(f64, f64, std::result::Result<Vec<(&'static str, f64)>, String>)> {
        for a in &gargs {
            engine.attention_forward(a)?; // warm-up on this stream: side stream, events, workspaces
            serial.attention_forward(a)?;
        }
        let ev = Events::new()?;
        let time = |exec: CUgraphExec| -> Result<f64> {
            let mut v = Vec::new();
            for g in 0..16 {
                let ms = ev.time(gs, || {
                    for _ in 0..10 {
                        // SAFETY: a live graph and stream.
                        check(unsafe { (api.cuGraphLaunch)(exec, gs) }, "cuGraphLaunch")?;
                    }
                    Ok(())
                })?;
                if g > 0 {
                    v.push(ms * 1e3 / (10 * rotation) as f64);
                }
            }
            Ok(median(v))
        };
        let (ge, gse) = (capture(engine, &gargs)?, capture(serial, &gargs)?);
        let (g, sg) = (time(ge)?, time(gse)?);
        // SAFETY: instantiated above.
        unsafe {
            (api.cuGraphExecDestroy)(ge);
            (api.cuGraphExecDestroy)(gse);
        }
        set_prr_timeline(backend, true);
        let tl = (|| -> Result<Vec<(&'static str, f64)>> {
            engine.attention_forward(&gargs[0])?; // creates the timing events outside capture
            let exec = capture(engine, &gargs[..1])?;
            let mut per: Vec<Vec<f64>> = vec![Vec::new(); kvsparse::policy::speculate::cuda::TIMELINE.len()];
            for _ in 0..30 {
                // SAFETY: a live graph and stream.
                check(unsafe { (api.cuGraphLaunch)(exec, gs) }, "cuGraphLaunch")?;
                for (j, (_, ms)) in prr_timeline(backend, gs)?.into_iter().enumerate() {
                    per[j].push(ms as f64 * 1e3);
                }
            }
            // SAFETY: instantiated above.
            unsafe { (api.cuGraphExecDestroy)(exec) };
            Ok(kvsparse::policy::speculate::cuda::TIMELINE.iter().zip(per).map(|(&name, v)| (name, median(v))).collect())
        })();
        set_prr_timeline(backend, false);
        Ok((g, sg, tl.map_err(|e| e.to_string())))
    })();
    // SAFETY: created above; the engines' per-stream sets for it stay until the engines drop.
    unsafe {
        (api.cuStreamSynchronize)(gs);
        (api.cuStreamDestroy)(gs);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(a: &[f32], b: &[f32]) -> f64 {
        let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let n = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        dot / (n(a) * n(b))
    }

    #[test]
    fn drifting_queries_turn_by_the_same_angle_every_step() {
        let (d, rows, drift) = (128, 6, 3.6);
        let mut rng = Rng::new(7);
        let qh: Vec<f32> = (0..d * rows).map(|_| (rng.uniform() * 2.0 - 1.0) as f32).collect();
        let period = drift_period(drift);
        assert_eq!(period, 100);
        let q = drifting_queries(&qh, d, period, &mut rng);
        assert_eq!(q.len(), qh.len() * period);
        assert_eq!(&q[..qh.len()], &qh[..], "step 0 is the first query");
        let row = |t: usize, j: usize| &q[(t % period) * qh.len() + j * d..][..d];
        for j in 0..rows {
            for t in 0..period {
                // Every step (the cycle's close included) turns the row by `drift` degrees.
                let c = cosine(row(t, j), row(t + 1, j));
                assert!((c - (drift as f64).to_radians().cos()).abs() < 1e-5, "row {j} step {t}: cos {c}");
            }
            // Step t is 360 t / period degrees from step 0 (here 36 degrees at t = 10), norm kept.
            let c10 = cosine(row(0, j), row(10, j));
            assert!((c10 - 36f64.to_radians().cos()).abs() < 1e-5, "row {j}: cos {c10}");
            let n = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
            assert!((n(row(37, j)) / n(row(0, j)) - 1.0).abs() < 1e-5);
        }
        assert_eq!(drift_period(0.0), 1);
    }
}
