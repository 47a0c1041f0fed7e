//! Decode benchmark on the CUDA backend: dense paged decode over a grid of batch sizes, context lengths
//! and head layouts, timed with CUDA events, next to the device-to-device copy bandwidth measured in the
//! same process. Achieved bandwidth counts the bytes a decode step must move: every visible K and V row
//! once, plus q and out. Inputs rotate among several caches when one would fit in L2, so the cache does
//! not flatter the numbers; block tables are random permutations (blocks scattered as in a long-running
//! server).



use super::context::DevBuf;
use super::driver::{check, cuda, CUevent, CUstream};
use crate::config::EngineConfig;
use crate::engine::{Engine, ForwardArgs};
use crate::error::Result;
use crate::rng::Rng;
use crate::tensor::{DType, Device, TensorRef};

#[derive(Clone, Copy, Debug)]
pub struct Point {
    pub batch: usize,
    pub ctx: usize,
    pub hq: usize,
    pub hk: usize,
}

#[derive(Clone, Debug)]
pub struct Row {
    pub p: Point,
    pub us: f64,
    pub bytes: f64,
    pub gbps: f64,
    pub frac_copy: f64,
    pub rotation: usize,
}

pub const HEAD_DIM: usize = 128;
pub const BLOCK: usize = 16;

/// The grid: batch 1..128, context 1K..128K, heads 32/8 and 64/8 (head 128, bf16, block 16).
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

struct Events(CUevent, CUevent);
impl Events {
    fn new() -> Result<Events> {
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
    fn time(&self, stream: CUstream, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of 20 copies of 1 GiB.
pub fn copy_bandwidth() -> Result<f64> {
    let _gpu = super::context::Gpu::open(0)?; // primary context current on this thread
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

/// Times dense decode at `p`; `copy_gbps` is the reference bandwidth. `max_kv_bytes` bounds memory.
pub fn bench_point(p: &Point, copy_gbps: f64, l2_bytes: usize, seed: u64) -> Result<Row> {
    let d = HEAD_DIM;
    let blocks_per_seq = p.ctx.div_ceil(BLOCK);
    let kv = kv_bytes(p);
    let rotation = (4 * l2_bytes).div_ceil(kv).clamp(1, 16);
    let nb = rotation * p.batch * blocks_per_seq;
    let mut cfg = EngineConfig::new(1, p.hq, p.hk, d, BLOCK, DType::BF16);
    cfg.device = Device::Cuda(0);
    cfg.num_threads = 1;
    let engine = Engine::new(cfg)?;
    let backend = engine.cuda_backend().expect("CUDA engine");
    let cache_elems = nb * BLOCK * p.hk * d;
    let (kc, vc) = (DevBuf::alloc(cache_elems * 2)?, DevBuf::alloc(cache_elems * 2)?);
    let s: CUstream = std::ptr::null_mut();
    backend.fill_random(kc.ptr, cache_elems, DType::BF16, seed as u32, 4.0, s)?;
    backend.fill_random(vc.ptr, cache_elems, DType::BF16, seed as u32 ^ 0x5555, 2.0, s)?;
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
    let bt = DevBuf::from_host(bytes(&table))?;
    let seq_lens = DevBuf::from_host(bytes(&vec![p.ctx as i32; p.batch]))?;
    let qsl = DevBuf::from_host(bytes(&(0..=p.batch as i32).collect::<Vec<i32>>()))?;
    let dev = Device::Cuda(0);
    let v = |ptr: *mut u8, dt, shape: &[i64]| -> Result<TensorRef> {
        // SAFETY: each view addresses exactly its allocation (or a slice of it for a rotation index).
        unsafe { TensorRef::from_raw(ptr, dt, dev, shape, None) }
    };
    let cshape = [nb as i64, BLOCK as i64, p.hk as i64, d as i64];
    let mut args = Vec::with_capacity(rotation);
    for r in 0..rotation {
        let qoff = r * p.batch * p.hq * d * 2;
        args.push(ForwardArgs {
            layer: 0,
            query: v(unsafe { q.as_ptr().add(qoff) }, DType::BF16, &[p.batch as i64, p.hq as i64, d as i64])?,
            key_cache: v(kc.as_ptr(), DType::BF16, &cshape)?,
            value_cache: v(vc.as_ptr(), DType::BF16, &cshape)?,
            block_table: v(unsafe { bt.as_ptr().add(r * p.batch * blocks_per_seq * 4) }, DType::I32, &[p.batch as i64, blocks_per_seq as i64])?,
            seq_lens: v(seq_lens.as_ptr(), DType::I32, &[p.batch as i64])?,
            query_start_loc: v(qsl.as_ptr(), DType::I32, &[p.batch as i64 + 1])?,
            seq_ids: None,
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
                engine.attention_forward(&args[i % rotation])?;
                i += 1;
            }
            Ok(())
        })?;
        times.push(ms / per_group as f64);
    }
    let ms = median(times);
    let bytes = kv as f64 + 2.0 * (p.batch * p.hq * d * 2) as f64;
    let gbps = bytes / (ms * 1e-3) / 1e9;
    Ok(Row { p: *p, us: ms * 1e3, bytes, gbps, frac_copy: gbps / copy_gbps, rotation })
}

fn bytes<T>(v: &[T]) -> &[u8] {
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

