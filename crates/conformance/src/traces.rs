//! Real attention traces (captured from a model, see the `py-traces` branch's docs/traces.md) and their
//! replay through an [`Engine`] as a serving engine would drive it.
//!
//! Format: `manifest.json` (model geometry and one entry per trace) and one safetensors file per trace
//! holding, per recorded layer `L`: `layer{L}.k` / `.v` f16 `[P+T, Hkv, D]` (position-major, K after
//! RoPE), `layer{L}.q` f16 `[T, Hq, D]` (decode step `t` is the query at position `P+t`, attending keys
//! `0..=P+t`), `layer{L}.out` f32 `[T, Hq, D]` (the model's attention output) and
//! `layer{L}.q_prompt_tail` f16 `[W, Hq, D]` (queries of prompt positions `P-W..P`).
//!
//! Replay ([`replay`]): one fresh engine per (trace, policy), with `num_layers = max recorded layer + 1`
//! and **trace layer `L` served as engine layer `L`**, so the spec's `dense_layers` (default 2) applies to
//! real layer ids exactly as in serving (layers 7 and 20 are policy layers by default). Per layer, a paged
//! cache with blocks of 16 in shuffled physical order; the prompt is written with `cache_write`, then one
//! prefill chunk (the prompt-tail queries, as the last chunk of a chunked prefill: this is where SnapKV
//! chooses) runs, then every decode step writes its own K/V row (`cache_write`) and attends with
//! `seq_len = P+t+1`. One sequence id per trace, released at the end.

use std::path::{Path, PathBuf};
use std::time::Instant;

use half::f16;
use safetensors::SafeTensors;

use crate::hostbuf::HostBuf;
use kvsparse::rng::Rng;
use kvsparse::stats::{Counters, VisitRecord};
use kvsparse::cuda::context::DevBuf;
use kvsparse::{CacheWriteArgs, DType, Device, Engine, EngineConfig, ForwardArgs, TensorRef};

/// Tokens per KV block of the replay caches.
pub const BLOCK_SIZE: usize = 16;

/// Geometry shared by all traces of a manifest.
#[derive(Clone, Debug)]
pub struct Manifest {
    pub dir: PathBuf,
    pub model: String,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub traces: Vec<TraceInfo>,
}

/// One manifest entry.
#[derive(Clone, Debug)]
pub struct TraceInfo {
    pub name: String,
    pub file: String,
    pub kind: String,
    pub prompt_len: usize,
    pub decode_steps: usize,
    pub layers: Vec<usize>,
}

/// One recorded layer of a trace (f16 tensors kept as stored, position-major).
pub struct LayerTrace {
    pub layer: usize,
    pub k: Vec<f16>,
    pub v: Vec<f16>,
    pub q: Vec<f16>,
    pub out: Vec<f32>,
    pub q_prompt_tail: Vec<f16>,
    pub tail_len: usize,
}

/// A loaded trace.
pub struct Trace {
    pub info: TraceInfo,
    pub hq: usize,
    pub hk: usize,
    pub d: usize,
    pub scale: f32,
    pub layers: Vec<LayerTrace>,
}

fn field<'a>(v: &'a serde_json::Value, key: &str, what: &str) -> Result<&'a serde_json::Value, String> {
    v.get(key).ok_or_else(|| format!("{what}: missing field {key:?}"))
}

fn usize_field(v: &serde_json::Value, key: &str, what: &str) -> Result<usize, String> {
    field(v, key, what)?.as_u64().map(|x| x as usize).ok_or_else(|| format!("{what}: field {key:?} is not a non-negative integer"))
}


/// The repository's committed trace set (`traces/` with its manifest.json), for tests; `None`, with a
/// SKIPPED line on stderr, where a checkout does not have it.
pub fn committed_traces_dir() -> Option<std::path::PathBuf> {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    if dir.join("manifest.json").exists() {
        Some(dir)
    } else {
        eprintln!("SKIPPED: {} has no manifest.json", dir.display());
        None
    }
}

impl Manifest {
    /// Reads `dir/manifest.json`.
    pub fn load(dir: &Path) -> Result<Manifest, String> {
        let path = dir.join("manifest.json");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let m: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let what = path.display().to_string();
        let dtype = field(&m, "dtype", &what)?.as_str().unwrap_or("");
        if dtype != "float16" {
            return Err(format!("{what}: dtype {dtype:?} is not supported (float16 expected)"));
        }
        let mut traces = Vec::new();
        for t in field(&m, "traces", &what)?.as_array().ok_or_else(|| format!("{what}: traces is not a list"))? {
            let file = field(t, "file", &what)?.as_str().ok_or_else(|| format!("{what}: file is not a string"))?.to_string();
            let w = format!("{what} ({file})");
            let layers = field(t, "layers", &w)?.as_array().ok_or_else(|| format!("{w}: layers is not a list"))?;
            traces.push(TraceInfo {
                name: file.trim_end_matches(".safetensors").to_string(),
                kind: t.get("kind").and_then(|k| k.as_str()).unwrap_or("?").to_string(),
                prompt_len: usize_field(t, "prompt_len", &w)?,
                decode_steps: usize_field(t, "decode_steps", &w)?,
                layers: layers.iter().map(|l| l.as_u64().map(|x| x as usize).ok_or_else(|| format!("{w}: bad layer id {l}"))).collect::<Result<_, _>>()?,
                file,
            });
        }
        Ok(Manifest {
            dir: dir.to_path_buf(),
            model: m.get("model").and_then(|x| x.as_str()).unwrap_or("?").to_string(),
            num_q_heads: usize_field(&m, "num_q_heads", &what)?,
            num_kv_heads: usize_field(&m, "num_kv_heads", &what)?,
            head_dim: usize_field(&m, "head_dim", &what)?,
            scale: field(&m, "scale", &what)?.as_f64().ok_or_else(|| format!("{what}: scale is not a number"))? as f32,
            traces,
        })
    }

    /// Loads one trace's tensors, checking every shape against the manifest.
    pub fn load_trace(&self, info: &TraceInfo) -> Result<Trace, String> {
        let path = self.dir.join(&info.file);
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        let (p, t, hq, hk, d) = (info.prompt_len, info.decode_steps, self.num_q_heads, self.num_kv_heads, self.head_dim);
        let get = |name: &str, dtype: safetensors::Dtype, shape: &[usize]| -> Result<Vec<u8>, String> {
            let v = st.tensor(name).map_err(|e| format!("{}: tensor {name}: {e}", path.display()))?;
            if v.dtype() != dtype || v.shape() != shape {
                return Err(format!("{}: tensor {name} is {:?} {:?}, expected {dtype:?} {shape:?}", path.display(), v.dtype(), v.shape()));
            }
            Ok(v.data().to_vec())
        };
        let f16s = |b: Vec<u8>| b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect::<Vec<_>>();
        let mut layers = Vec::new();
        for &l in &info.layers {
            let tail = st.tensor(&format!("layer{l}.q_prompt_tail")).map_err(|e| format!("{}: layer{l}.q_prompt_tail: {e}", path.display()))?.shape()[0];
            layers.push(LayerTrace {
                layer: l,
                k: f16s(get(&format!("layer{l}.k"), safetensors::Dtype::F16, &[p + t, hk, d])?),
                v: f16s(get(&format!("layer{l}.v"), safetensors::Dtype::F16, &[p + t, hk, d])?),
                q: f16s(get(&format!("layer{l}.q"), safetensors::Dtype::F16, &[t, hq, d])?),
                out: get(&format!("layer{l}.out"), safetensors::Dtype::F32, &[t, hq, d])?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
                q_prompt_tail: f16s(get(&format!("layer{l}.q_prompt_tail"), safetensors::Dtype::F16, &[tail, hq, d])?),
                tail_len: tail,
            });
        }
        Ok(Trace { info: info.clone(), hq, hk, d, scale: self.scale, layers })
    }
}

impl Trace {
    /// Number of positions (keys) in the trace: prompt plus decode steps.
    pub fn positions(&self) -> usize {
        self.info.prompt_len + self.info.decode_steps
    }

    /// Exact softmax weights (f64) of decode step `t` of layer index `li`, `[hq][P+t+1]`, computed from the
    /// trace's f16 q and k.
    pub fn dense_weights(&self, li: usize, t: usize) -> Vec<f64> {
        let lt = &self.layers[li];
        let (hq, hk, d) = (self.hq, self.hk, self.d);
        let n = self.info.prompt_len + t + 1;
        let g = hq / hk;
        let mut w = vec![0f64; hq * n];
        for h in 0..hq {
            let q: Vec<f64> = (0..d).map(|i| lt.q[(t * hq + h) * d + i].to_f64() * self.scale as f64).collect();
            let row = &mut w[h * n..(h + 1) * n];
            let kh = h / g;
            for (j, x) in row.iter_mut().enumerate() {
                let k = &lt.k[(j * hk + kh) * d..(j * hk + kh + 1) * d];
                *x = q.iter().zip(k).map(|(a, b)| a * b.to_f64()).sum();
            }
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let mut s = 0.0;
            for x in row.iter_mut() {
                *x = (*x - m).exp();
                s += *x;
            }
            for x in row.iter_mut() {
                *x /= s;
            }
        }
        w
    }
}

/// How to replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// dtype of the engine (caches, queries, outputs); the trace's f16 values are converted exactly.
    pub dtype: DType,
    /// Run the decode forward of every `step_stride`-th step only (cache writes still happen every step).
    pub step_stride: usize,
    /// Seed of the physical block shuffle.
    pub seed: u64,
    /// Engine worker threads (0 = one per core).
    pub threads: usize,
    /// Collect per-row visit records (needed for attention mass recovered).
    pub record_visits: bool,
    /// The engine's device: the CPU, or a CUDA device (tensors are copied there for every call and the
    /// outputs back; the caches live there).
    pub device: Device,
    /// An FP8 cache (the trace's K/V quantized on write) instead of one of `dtype`.
    pub cache_dtype: Option<DType>,
    /// The FP8 cache's (k_scale, v_scale), every layer: vLLM's default without calibration is (1, 1).
    pub kv_scales: (f32, f32),
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions { dtype: DType::F16, step_stride: 1, seed: 7, threads: 0, record_visits: false, device: Device::Cpu, cache_dtype: None, kv_scales: (1.0, 1.0) }
    }
}

/// The result of replaying one trace under one policy.
pub struct Replay {
    /// Replayed decode steps (those the stride kept), in order.
    pub steps: Vec<usize>,
    /// Outputs as f64, `[layer index][step index][hq][d]` flattened per layer.
    pub out: Vec<Vec<f64>>,
    /// Counters summed over the decode calls only (the prefill chunk is excluded).
    pub counters: Counters,
    /// Wall seconds spent in the decode `attention_forward` calls.
    pub forward_s: f64,
    /// Attended spans per (layer index, step index, kv head); `None` where the row ran dense.
    pub visits: Vec<Option<Vec<(usize, usize)>>>,
    /// ART's (tiles visited, tiles in the traversal) per (layer index, step index, kv head), same index.
    pub art_tiles: Vec<Option<(u32, u32)>>,
}

impl Replay {
    /// Index into [`Replay::visits`].
    pub fn visit_index(&self, hk: usize, li: usize, si: usize, h: usize) -> usize {
        (li * self.steps.len() + si) * hk + h
    }
}

fn fill(buf: &mut HostBuf, src: &[f16]) {
    for (i, x) in src.iter().enumerate() {
        buf.set(i, x.to_f64());
    }
}

/// A device copy of the contiguous host tensor `t` (kept alive in `keep`).
fn to_device(t: &TensorRef, keep: &mut Vec<DevBuf>) -> kvsparse::Result<TensorRef> {
    let n = t.numel() * t.dtype.size_bytes();
    // SAFETY: `t` is a contiguous host tensor of exactly n bytes.
    let b = DevBuf::from_host(unsafe { std::slice::from_raw_parts(t.data as *const u8, n) })?;
    // SAFETY: the view addresses exactly the new allocation, which `keep` holds.
    let r = unsafe { TensorRef::from_raw(b.as_ptr(), t.dtype, Device::Cuda(0), t.shape(), Some(t.strides())) }?;
    keep.push(b);
    Ok(r)
}

/// A view of a whole device buffer with the shape (and contiguous strides) of `like`.
fn device_view(b: &DevBuf, like: &TensorRef) -> kvsparse::Result<TensorRef> {
    // SAFETY: the buffer holds exactly `like`'s bytes.
    unsafe { TensorRef::from_raw(b.as_ptr(), like.dtype, Device::Cuda(0), like.shape(), Some(like.strides())) }
}

/// Replays every decode step of `trace` through a fresh engine configured with `policy` (see the module
/// docs for the protocol). Errors are engine or spec errors, as text.
pub fn replay(trace: &Trace, policy: &str, opts: &ReplayOptions) -> Result<Replay, String> {
    let (hq, hk, d, bs) = (trace.hq, trace.hk, trace.d, BLOCK_SIZE);
    let num_layers = trace.layers.iter().map(|l| l.layer).max().unwrap_or(0) + 1;
    let mut cfg = EngineConfig::new(num_layers, hq, hk, d, bs, opts.dtype);
    cfg.policy = policy.to_string();
    cfg.num_threads = opts.threads;
    cfg.device = opts.device;
    let cache_dt = opts.cache_dtype.unwrap_or(opts.dtype);
    cfg.cache_dtype = cache_dt;
    let engine = Engine::new(cfg).map_err(|e| e.message)?;
    if cache_dt.is_fp8() {
        engine.set_kv_scales(None, opts.kv_scales.0, opts.kv_scales.1).map_err(|e| e.message)?;
    }
    let cuda = matches!(opts.device, Device::Cuda(_));
    engine.record_visits(opts.record_visits);
    let (p, tsteps, n) = (trace.info.prompt_len, trace.info.decode_steps, trace.positions());
    let stride = opts.step_stride.max(1);
    let steps: Vec<usize> = (0..tsteps).step_by(stride).collect();

    // Physical blocks: the sequence's logical blocks in shuffled order, with a few unused spares.
    let nblk = n.div_ceil(bs);
    let num_blocks = nblk + 3;
    let mut phys: Vec<i32> = (0..num_blocks as i32).collect();
    Rng::new(opts.seed).shuffle(&mut phys);
    let table: Vec<i32> = phys[..nblk].to_vec();
    let seq_id: u64 = 0x7ace_0000 + opts.seed;
    let ids = [seq_id];
    let slot = |pos: usize| (table[pos / bs] as i64) * bs as i64 + (pos % bs) as i64;
    let row = hk * d;

    let mut caches: Vec<(HostBuf, HostBuf)> = trace.layers.iter().map(|_| (HostBuf::zeros(cache_dt, num_blocks * bs * row), HostBuf::zeros(cache_dt, num_blocks * bs * row))).collect();
    let cache_shape = [num_blocks as i64, bs as i64, hk as i64, d as i64];
    let dev_caches: Vec<(DevBuf, DevBuf)> = if cuda {
        let zeros = vec![0u8; num_blocks * bs * row * cache_dt.size_bytes()];
        caches.iter().map(|_| Ok((DevBuf::from_host(&zeros)?, DevBuf::from_host(&zeros)?))).collect::<kvsparse::Result<_>>().map_err(|e| e.message)?
    } else {
        Vec::new()
    };
    let dev_cache = |li: usize, host: &TensorRef, v: bool| -> Result<TensorRef, String> { device_view(if v { &dev_caches[li].1 } else { &dev_caches[li].0 }, host).map_err(|e| e.message) };
    let li_of = |layer: usize| trace.layers.iter().position(|l| l.layer == layer).expect("a recorded layer");
    let write = |engine: &Engine, layer: usize, lt: &LayerTrace, kc: &mut HostBuf, vc: &mut HostBuf, range: std::ops::Range<usize>| -> Result<(), String> {
        let m = range.len();
        let mut kb = HostBuf::zeros(opts.dtype, m * row);
        let mut vb = HostBuf::zeros(opts.dtype, m * row);
        fill(&mut kb, &lt.k[range.start * row..range.end * row]);
        fill(&mut vb, &lt.v[range.start * row..range.end * row]);
        let slots: Vec<i64> = range.map(slot).collect();
        let args = CacheWriteArgs {
            layer,
            key: kb.view_contiguous(&[m as i64, hk as i64, d as i64]),
            value: vb.view_contiguous(&[m as i64, hk as i64, d as i64]),
            key_cache: kc.view_contiguous(&cache_shape),
            value_cache: vc.view_contiguous(&cache_shape),
            slot_mapping: TensorRef::from_slice(&slots, &[m as i64]),
            stream: std::ptr::null_mut(),
        };
        if !cuda {
            return engine.cache_write(&args).map_err(|e| e.message);
        }
        let mut keep = Vec::new();
        let li = li_of(layer);
        let dargs = CacheWriteArgs {
            key: to_device(&args.key, &mut keep).map_err(|e| e.message)?,
            value: to_device(&args.value, &mut keep).map_err(|e| e.message)?,
            key_cache: dev_cache(li, &args.key_cache, false)?,
            value_cache: dev_cache(li, &args.value_cache, true)?,
            slot_mapping: to_device(&args.slot_mapping, &mut keep).map_err(|e| e.message)?,
            ..args
        };
        engine.cache_write(&dargs).map_err(|e| e.message)
    };
    let forward = |engine: &Engine, layer: usize, kc: &mut HostBuf, vc: &mut HostBuf, q: &[f16], m: usize, seq_len: usize, out: &mut HostBuf| -> Result<Counters, String> {
        let mut qb = HostBuf::zeros(opts.dtype, m * hq * d);
        fill(&mut qb, q);
        let lens = [seq_len as i32];
        let qsl = [0i32, m as i32];
        let args = ForwardArgs {
            layer,
            query: qb.view_contiguous(&[m as i64, hq as i64, d as i64]),
            key_cache: kc.view_contiguous(&cache_shape),
            value_cache: vc.view_contiguous(&cache_shape),
            block_table: TensorRef::from_slice(&table, &[1, nblk as i64]),
            seq_lens: TensorRef::from_slice(&lens, &[1]),
            query_start_loc: TensorRef::from_slice(&qsl, &[2]),
            seq_ids: Some(TensorRef::from_slice(&ids, &[1])),
            out: out.view_contiguous(&[m as i64, hq as i64, d as i64]),
            lse: None,
            scale: trace.scale,
            sliding_window: 0,
            softcap: 0.0,
            max_query_len: 0,
            max_seq_len: 0,
            stream: std::ptr::null_mut(),
        };
        if !cuda {
            return engine.attention_forward(&args).map_err(|e| e.message);
        }
        let dev = |r: kvsparse::Result<TensorRef>| r.map_err(|e| e.message);
        let mut keep = Vec::new();
        let li = li_of(layer);
        let out_dev = DevBuf::alloc(m * hq * d * opts.dtype.size_bytes()).map_err(|e| e.message)?;
        let dargs = ForwardArgs {
            query: dev(to_device(&args.query, &mut keep))?,
            key_cache: dev_cache(li, &args.key_cache, false)?,
            value_cache: dev_cache(li, &args.value_cache, true)?,
            block_table: dev(to_device(&args.block_table, &mut keep))?,
            seq_lens: dev(to_device(&args.seq_lens, &mut keep))?,
            query_start_loc: dev(to_device(&args.query_start_loc, &mut keep))?,
            seq_ids: Some(dev(to_device(&args.seq_ids.expect("set above"), &mut keep))?),
            out: dev(device_view(&out_dev, &args.out))?,
            // The CUDA backend plans grids from these (0 = unknown would size for the whole table).
            max_query_len: m as i32,
            max_seq_len: seq_len as i32,
            ..args
        };
        let c = engine.attention_forward(&dargs).map_err(|e| e.message)?;
        let n = m * hq * d * opts.dtype.size_bytes();
        // SAFETY: the host output buffer holds exactly n bytes (checked by its view above).
        let host = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr(), n) };
        out_dev.download(0, host).map_err(|e| e.message)?;
        Ok(c)
    };

    // Prompt, then the prompt's last chunk as a prefill call (its output is not used).
    for (lt, (kc, vc)) in trace.layers.iter().zip(caches.iter_mut()) {
        write(&engine, lt.layer, lt, kc, vc, 0..p)?;
        let w = lt.tail_len;
        if w > 0 && w <= p {
            let mut o = HostBuf::zeros(opts.dtype, w * hq * d);
            forward(&engine, lt.layer, kc, vc, &lt.q_prompt_tail, w, p, &mut o)?;
        }
    }
    engine.take_visits();
    let stats_before = engine.stats().total;

    let mut out: Vec<Vec<f64>> = trace.layers.iter().map(|_| Vec::with_capacity(steps.len() * hq * d)).collect();
    let mut visits: Vec<Option<Vec<(usize, usize)>>> = vec![None; trace.layers.len() * steps.len() * hk];
    let mut art_tiles: Vec<Option<(u32, u32)>> = vec![None; visits.len()];
    let mut counters = Counters::default();
    let mut forward_s = 0.0;
    let mut ob = HostBuf::zeros(opts.dtype, hq * d);
    let mut si = 0;
    for t in 0..tsteps {
        let sampled = si < steps.len() && steps[si] == t;
        for (li, (lt, (kc, vc))) in trace.layers.iter().zip(caches.iter_mut()).enumerate() {
            write(&engine, lt.layer, lt, kc, vc, p + t..p + t + 1)?;
            if !sampled {
                continue;
            }
            let t0 = Instant::now();
            let c = forward(&engine, lt.layer, kc, vc, &lt.q[t * hq * d..(t + 1) * hq * d], 1, p + t + 1, &mut ob)?;
            forward_s += t0.elapsed().as_secs_f64();
            counters.add(&c);
            out[li].extend((0..hq * d).map(|i| ob.get(i)));
            for r in engine.take_visits() {
                let VisitRecord { kv_head, spans, traversal_tiles: tiles, .. } = r;
                visits[(li * steps.len() + si) * hk + kv_head] = Some(spans);
                art_tiles[(li * steps.len() + si) * hk + kv_head] = tiles;
            }
        }
        if sampled {
            si += 1;
        }
    }
    engine.release_sequence(seq_id).map_err(|e| e.message)?;
    if cuda {
        // The device keeps the policy counters; the decode phase's share is the difference.
        let after = engine.stats().total;
        counters = after.since(&stats_before);
    }
    Ok(Replay { steps, out, counters, forward_s, visits, art_tiles })
}

/// Sum of `w` (one query head's weights over positions) over the sorted half-open `spans`.
pub fn mass_in_spans(w: &[f64], spans: &[(usize, usize)]) -> f64 {
    spans.iter().map(|&(a, b)| w[a.min(w.len())..b.min(w.len())].iter().sum::<f64>()).sum()
}
