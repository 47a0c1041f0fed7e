//! `kvsparse bench --device cuda --prefill`: causal prefill attention (one layer's call) on CUDA device 0
//! over paged bf16 caches with shuffled block tables: whole prompts and a chunk over a cached prefix.
//! Each point is timed on the prefill kernel (kernels/attention_prefill.cu) and on the decode kernel
//! that served prefill rows before it (`KVS_CUDA_PREFILL=decode`, the same process and inputs), with
//! TFLOP/s of the causal FLOPs and the largest difference between the two outputs.

use kvsparse::config::EngineConfig;
use kvsparse::cuda::context::DevBuf;
use kvsparse::cuda::driver::CUstream;
use kvsparse::engine::{Engine, ForwardArgs};
use kvsparse::rng::Rng;
use kvsparse::tensor::{DType, Device, TensorRef};

use crate::cuda_bench::{bytes, median, Events, BLOCK, HEAD_DIM};

/// One point: `batch` sequences, each `query` new tokens after a cached prefix of `prefix` tokens.
#[derive(Clone, Copy, Debug)]
pub struct PrefillPoint {
    pub batch: usize,
    pub query: usize,
    pub prefix: usize,
}

impl PrefillPoint {
    /// `BxQ` or `BxQ+P`.
    pub fn parse(s: &str) -> Result<PrefillPoint, String> {
        let err = || format!("--points: {s:?} is not BxQ or BxQ+P (e.g. 1x32768, 1x2048+30720)");
        let (b, rest) = s.split_once('x').ok_or_else(err)?;
        let (q, p) = rest.split_once('+').unwrap_or((rest, "0"));
        let pt = PrefillPoint { batch: b.parse().map_err(|_| err())?, query: q.parse().map_err(|_| err())?, prefix: p.parse().map_err(|_| err())? };
        if pt.batch == 0 || pt.query < 2 {
            return Err(format!("--points: {s:?}: batch >= 1 and query >= 2 (query 1 is a decode row)"));
        }
        Ok(pt)
    }
    /// Causal FLOPs (QK^T and PV, 2 each per query head, key and dimension).
    pub fn flops(&self, hq: usize) -> f64 {
        let (a, b) = (self.prefix as f64, (self.prefix + self.query) as f64);
        let keys = (b * (b + 1.0) - a * (a + 1.0)) / 2.0; // sum over positions p of p + 1
        4.0 * HEAD_DIM as f64 * hq as f64 * keys * self.batch as f64
    }
}

pub struct PrefillRow {
    pub new_ms: f64,
    pub old_ms: f64,
    /// max |new - old| / max |old| over the output.
    pub diff: f64,
}

/// Times `engine.attention_forward(a)`: median of `reps` single calls after one warm-up call.
fn time_call(engine: &Engine, a: &ForwardArgs, s: CUstream, reps: usize) -> kvsparse::error::Result<f64> {
    engine.attention_forward(a)?;
    let ev = Events::new()?;
    let mut t = Vec::new();
    for _ in 0..reps {
        t.push(ev.time(s, || engine.attention_forward(a).map(|_| ()))?);
    }
    Ok(median(t))
}

fn download_bf16(buf: &DevBuf, n: usize) -> kvsparse::error::Result<Vec<f32>> {
    let mut raw = vec![0u8; n * 2];
    buf.download(0, &mut raw)?;
    Ok(raw.chunks_exact(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)).collect())
}

/// `cache`: bf16, or an FP8 format (random finite bytes, fixed scales) under bf16 queries.
pub fn bench_prefill_point(p: &PrefillPoint, hq: usize, hk: usize, old_reps: usize, seed: u64, cache: DType) -> kvsparse::error::Result<PrefillRow> {
    let d = HEAD_DIM;
    let len = p.prefix + p.query;
    let bps = len.div_ceil(BLOCK);
    let nb = p.batch * bps;
    let mut cfg = EngineConfig::new(1, hq, hk, d, BLOCK, DType::BF16);
    cfg.device = Device::Cuda(0);
    cfg.num_threads = 1;
    cfg.cache_dtype = cache;
    let engine = Engine::new(cfg)?;
    let backend = engine.backend().as_any().downcast_ref::<kvsparse::cuda::CudaBackend>().expect("CUDA engine");
    let s: CUstream = std::ptr::null_mut();
    let cache_elems = nb * BLOCK * hk * d;
    let (kc, vc) = if cache.is_fp8() {
        crate::cuda_bench::random_fp8_caches(&engine, cache_elems, seed)?
    } else {
        let (kc, vc) = (DevBuf::alloc(cache_elems * 2)?, DevBuf::alloc(cache_elems * 2)?);
        backend.fill_random(kc.ptr, cache_elems, DType::BF16, seed as u32, 4.0, s)?;
        backend.fill_random(vc.ptr, cache_elems, DType::BF16, seed as u32 ^ 0x5555, 2.0, s)?;
        (kc, vc)
    };
    let tokens = p.batch * p.query;
    let q = DevBuf::alloc(tokens * hq * d * 2)?;
    backend.fill_random(q.ptr, tokens * hq * d, DType::BF16, seed as u32 ^ 0xaaaa, 2.0, s)?;
    let out = DevBuf::alloc(tokens * hq * d * 2)?;
    let mut ids: Vec<i32> = (0..nb as i32).collect();
    Rng::new(seed).shuffle(&mut ids);
    let bt = DevBuf::from_host(bytes(&ids))?;
    let seq_lens = DevBuf::from_host(bytes(&vec![len as i32; p.batch]))?;
    let qsl = DevBuf::from_host(bytes(&(0..=p.batch).map(|i| (i * p.query) as i32).collect::<Vec<i32>>()))?;
    let dev = Device::Cuda(0);
    let v = |ptr: *mut u8, dt, shape: &[i64]| -> kvsparse::error::Result<TensorRef> {
        // SAFETY: each view addresses exactly its allocation.
        unsafe { TensorRef::from_raw(ptr, dt, dev, shape, None) }
    };
    let cshape = [nb as i64, BLOCK as i64, hk as i64, d as i64];
    let qshape = [tokens as i64, hq as i64, d as i64];
    let args = ForwardArgs {
        layer: 0,
        query: v(q.as_ptr(), DType::BF16, &qshape)?,
        key_cache: v(kc.as_ptr(), cache, &cshape)?,
        value_cache: v(vc.as_ptr(), cache, &cshape)?,
        block_table: v(bt.as_ptr(), DType::I32, &[p.batch as i64, bps as i64])?,
        seq_lens: v(seq_lens.as_ptr(), DType::I32, &[p.batch as i64])?,
        query_start_loc: v(qsl.as_ptr(), DType::I32, &[p.batch as i64 + 1])?,
        seq_ids: None,
        out: v(out.as_ptr(), DType::BF16, &qshape)?,
        lse: None,
        scale: 1.0 / (d as f32).sqrt(),
        sliding_window: 0,
        softcap: 0.0,
        max_query_len: p.query as i32,
        max_seq_len: len as i32,
        stream: s,
    };
    std::env::remove_var("KVS_CUDA_PREFILL");
    let new_ms = time_call(&engine, &args, s, 10)?;
    let new_out = download_bf16(&out, tokens * hq * d)?;
    if old_reps == 0 {
        return Ok(PrefillRow { new_ms, old_ms: f64::NAN, diff: f64::NAN });
    }
    std::env::set_var("KVS_CUDA_PREFILL", "decode");
    let old = time_call(&engine, &args, s, old_reps);
    std::env::remove_var("KVS_CUDA_PREFILL");
    let old_ms = old?;
    let old_out = download_bf16(&out, tokens * hq * d)?;
    let scale = old_out.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let nan = new_out.iter().chain(&old_out).any(|x| x.is_nan());
    let worst = new_out.iter().zip(&old_out).fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    let diff = if nan { f64::NAN } else { worst / scale.max(f64::MIN_POSITIVE) };
    Ok(PrefillRow { new_ms, old_ms, diff })
}
