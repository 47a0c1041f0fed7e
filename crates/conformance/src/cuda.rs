//! The conformance fixtures on a CUDA engine: host buffers are copied to the device as they are (same
//! strides, offsets, padding and garbage), the engine runs cache write + forward on the device, and the
//! (NaN-poisoned) outputs come back to be judged by the same `judge` as the CPU.
//! Also the CUDA-graph check: one decode step captured once and replayed on new data, and the sparse
//! contract's session on the device.

use super::fixture::{Fixture, Outputs, Rows};
use super::hostbuf::HostBuf;
use super::sparse::{Batch, Geometry, Session};
use super::{judge, CaseResult, CaseSpec};
use kvsparse::cuda::context::DevBuf;
use kvsparse::cuda::driver::{self, check, cuda, CUstream};
use kvsparse::engine::{CacheWriteArgs, Engine, ForwardArgs};
use kvsparse::stats::Counters;
use kvsparse::error::Result;
use kvsparse::tensor::{DType, Device, TensorRef};

/// Should a missing device fail (KVS_REQUIRE_CUDA=1) rather than skip?
pub fn cuda_required() -> bool {
    std::env::var("KVS_REQUIRE_CUDA").map(|v| v == "1").unwrap_or(false)
}

fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (ints) viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

pub(super) fn view(buf: &DevBuf, byte_off: usize, dtype: DType, shape: &[i64], strides: &[i64]) -> Result<TensorRef> {
    // SAFETY: the fixture's strides address only elements inside its host buffer, which has the same
    // size as `buf` (checked for the host copy by `TensorRef::strided`).
    unsafe { TensorRef::from_raw(buf.as_ptr().add(byte_off), dtype, Device::Cuda(0), shape, Some(strides)) }
}

/// A fixture's inputs on the device, plus NaN-poisoned outputs.
pub struct DeviceCase {
    /// The earlier sequence's rows in reused blocks (k, v, slots), when the case has any.
    pub prior: Option<(DevBuf, DevBuf, DevBuf)>,
    pub cache: DevBuf,
    pub q: DevBuf,
    pub new_k: DevBuf,
    pub new_v: DevBuf,
    pub slots: DevBuf,
    pub block_table: DevBuf,
    pub seq_lens: DevBuf,
    pub qsl: DevBuf,
    pub seq_ids: DevBuf,
    pub out: DevBuf,
    pub lse: DevBuf,
}

impl DeviceCase {
    pub fn upload(f: &Fixture, outs: &Outputs) -> Result<DeviceCase> {
        Ok(DeviceCase {
            prior: Self::upload_prior(f)?,
            cache: DevBuf::from_host(f.cache.as_bytes())?,
            q: DevBuf::from_host(f.q.as_bytes())?,
            new_k: DevBuf::from_host(f.new_k.as_bytes())?,
            new_v: DevBuf::from_host(f.new_v.as_bytes())?,
            slots: DevBuf::from_host(bytes(&f.slots))?,
            block_table: DevBuf::from_host(bytes(&f.block_table))?,
            seq_lens: DevBuf::from_host(bytes(&f.seq_lens))?,
            qsl: DevBuf::from_host(bytes(&f.query_start_loc))?,
            seq_ids: DevBuf::from_host(bytes(&f.seq_ids))?,
            out: DevBuf::from_host(outs.out.as_bytes())?,
            lse: DevBuf::from_host(bytes(&outs.lse))?,
        })
    }

    fn upload_prior(f: &Fixture) -> Result<Option<(DevBuf, DevBuf, DevBuf)>> {
        if f.prior.slots.is_empty() {
            return Ok(None);
        }
        Ok(Some((DevBuf::from_host(f.prior.k.as_bytes())?, DevBuf::from_host(f.prior.v.as_bytes())?, DevBuf::from_host(bytes(&f.prior.slots))?)))
    }

    /// Overwrites the device inputs with another fixture of identical geometry, and re-poisons outputs.
    /// The rows to write (whose count varies with the random padding) get fresh buffers.
    pub fn refill(&mut self, f: &Fixture, outs: &Outputs) -> Result<()> {
        self.prior = Self::upload_prior(f)?;
        self.new_k = DevBuf::from_host(f.new_k.as_bytes())?;
        self.new_v = DevBuf::from_host(f.new_v.as_bytes())?;
        self.slots = DevBuf::from_host(bytes(&f.slots))?;
        self.cache.upload(0, f.cache.as_bytes())?;
        self.q.upload(0, f.q.as_bytes())?;
        self.block_table.upload(0, bytes(&f.block_table))?;
        self.seq_lens.upload(0, bytes(&f.seq_lens))?;
        self.qsl.upload(0, bytes(&f.query_start_loc))?;
        self.out.upload(0, outs.out.as_bytes())?;
        self.lse.upload(0, bytes(&outs.lse))
    }

    /// Re-uploads only the block table and sequence lengths (tests that corrupt them after a write).
    pub fn refill_metadata(&mut self, f: &Fixture) -> Result<()> {
        self.block_table.upload(0, bytes(&f.block_table))?;
        self.seq_lens.upload(0, bytes(&f.seq_lens))
    }

    /// Writes the earlier sequence's rows (if any), then this batch's, as two calls.
    pub fn write_cache(&self, engine: &Engine, f: &Fixture, stream: CUstream) -> Result<()> {
        if let Some((k, v, slots)) = &self.prior {
            let dt = f.spec.dtype;
            let (hk, d) = (f.spec.num_kv_heads as i64, f.spec.head_dim as i64);
            let n = f.prior.slots.len() as i64;
            engine.cache_write(&CacheWriteArgs {
                layer: 0,
                key: view(k, 0, dt, &[n, hk, d], &[hk * d, d, 1])?,
                value: view(v, 0, dt, &[n, hk, d], &[hk * d, d, 1])?,
                key_cache: view(&self.cache, 0, f.cache_dtype(), &f.cache_shape, &f.cache_strides)?,
                value_cache: view(&self.cache, f.v_offset * f.cache_dtype().size_bytes(), f.cache_dtype(), &f.cache_shape, &f.cache_strides)?,
                slot_mapping: view(slots, 0, DType::I64, &[n], &[1])?,
                stream,
            })?;
        }
        engine.cache_write(&self.cache_write_args(f, stream)?)
    }

    pub fn cache_write_args(&self, f: &Fixture, stream: CUstream) -> Result<CacheWriteArgs> {
        let dt = f.spec.dtype;
        let (hk, d) = (f.spec.num_kv_heads as i64, f.spec.head_dim as i64);
        let n = f.slots.len() as i64;
        Ok(CacheWriteArgs {
            layer: 0,
            key: view(&self.new_k, 0, dt, &[n, hk, d], &[hk * d, d, 1])?,
            value: view(&self.new_v, 0, dt, &[n, hk, d], &[hk * d, d, 1])?,
            key_cache: view(&self.cache, 0, f.cache_dtype(), &f.cache_shape, &f.cache_strides)?,
            value_cache: view(&self.cache, f.v_offset * f.cache_dtype().size_bytes(), f.cache_dtype(), &f.cache_shape, &f.cache_strides)?,
            slot_mapping: view(&self.slots, 0, DType::I64, &[n], &[1])?,
            stream,
        })
    }

    pub fn forward_args(&self, f: &Fixture, outs: &Outputs, stream: CUstream) -> Result<ForwardArgs> {
        let s = &f.spec;
        let dt = s.dtype;
        let nseq = s.seqs.len() as i64;
        let (t, hq, d) = (f.num_tokens as i64, s.num_q_heads as i64, s.head_dim as i64);
        Ok(ForwardArgs {
            layer: 0,
            query: view(&self.q, 0, dt, &[t, hq, d], &f.q_strides)?,
            key_cache: view(&self.cache, 0, f.cache_dtype(), &f.cache_shape, &f.cache_strides)?,
            value_cache: view(&self.cache, f.v_offset * f.cache_dtype().size_bytes(), f.cache_dtype(), &f.cache_shape, &f.cache_strides)?,
            block_table: view(&self.block_table, 0, DType::I32, &[nseq, f.max_blocks as i64], &[f.max_blocks as i64, 1])?,
            seq_lens: view(&self.seq_lens, 0, DType::I32, &[nseq], &[1])?,
            query_start_loc: view(&self.qsl, 0, DType::I32, &[nseq + 1], &[1])?,
            seq_ids: Some(view(&self.seq_ids, 0, DType::I64, &[nseq], &[1])?),
            out: view(&self.out, 0, dt, &[t, hq, d], &outs.out_strides)?,
            lse: Some(view(&self.lse, 0, DType::F32, &[t, hq], &outs.lse_strides)?),
            scale: f.scale,
            sliding_window: s.window as i32,
            softcap: s.softcap,
            max_query_len: s.seqs.iter().map(|&(q, _)| q).max().unwrap_or(0) as i32,
            max_seq_len: s.seqs.iter().map(|&(_, l)| l).max().unwrap_or(0) as i32,
            stream,
        })
    }

    /// Copies the device outputs back into `outs` (synchronous).
    pub fn download(&self, outs: &mut Outputs) -> Result<()> {
        let n = outs.out.len() * outs.out.dtype().size_bytes();
        // SAFETY: the host buffer holds exactly n bytes.
        let host = unsafe { std::slice::from_raw_parts_mut(outs.out.as_mut_ptr(), n) };
        self.out.download(0, host)?;
        // SAFETY: f32 slice viewed as bytes.
        let lse = unsafe { std::slice::from_raw_parts_mut(outs.lse.as_mut_ptr() as *mut u8, outs.lse.len() * 4) };
        self.lse.download(0, lse)
    }
}

fn cuda_engine(f: &Fixture) -> Result<Engine> {
    let mut cfg = f.engine_config();
    cfg.device = Device::Cuda(0);
    cfg.num_threads = 1;
    let e = Engine::new(cfg)?;
    if f.cache_dtype().is_fp8() {
        e.set_kv_scales(Some(0), f.k_scale, f.v_scale)?;
    }
    Ok(e)
}

fn failed(spec: &CaseSpec, seed: u64, e: kvsparse::Error) -> CaseResult {
    CaseResult::refused(&spec.name, seed, &e)
}

/// Cache write + forward of a fixture on CUDA device 0 (default stream); the outputs come back to the
/// host. Also the CUDA backend for `nonfinite::check_attention`.
pub fn run_fixture_cuda(f: &Fixture) -> Result<Outputs> {
    run_fixture_cuda_planned(f, true)
}

/// As `run_fixture_cuda`; `known_len = false` passes max_seq_len = 0, as a captured CUDA graph does:
/// the launch is planned for the block table's width and each row splits its own span.
pub fn run_fixture_cuda_planned(f: &Fixture, known_len: bool) -> Result<Outputs> {
    let engine = cuda_engine(f)?;
    let mut outs = Outputs::new(f);
    let dc = DeviceCase::upload(f, &outs)?;
    dc.write_cache(&engine, f, std::ptr::null_mut())?;
    let mut args = dc.forward_args(f, &outs, std::ptr::null_mut())?;
    if !known_len {
        args.max_seq_len = 0;
    }
    engine.attention_forward(&args)?;
    engine_sync(&engine)?;
    dc.download(&mut outs)?;
    Ok(outs)
}

/// As `run_fixture_cuda`, also returning the device cache's bytes after the writes (the combined
/// storage, as `Fixture::written_cache` computes it on the host).
pub fn run_fixture_cuda_with_cache(f: &Fixture) -> Result<(Outputs, Vec<u8>)> {
    let engine = cuda_engine(f)?;
    let mut outs = Outputs::new(f);
    let dc = DeviceCase::upload(f, &outs)?;
    dc.write_cache(&engine, f, std::ptr::null_mut())?;
    engine.attention_forward(&dc.forward_args(f, &outs, std::ptr::null_mut())?)?;
    engine_sync(&engine)?;
    dc.download(&mut outs)?;
    let mut cache = vec![0u8; f.cache.as_bytes().len()];
    dc.cache.download(0, &mut cache)?;
    Ok((outs, cache))
}

/// One conformance case on CUDA device 0 (default stream).
pub fn run_case_cuda(spec: &CaseSpec, seed: u64) -> CaseResult {
    run_case_cuda_planned(spec, seed, true)
}

/// As `run_case_cuda`, with max_seq_len = 0 when `known_len` is false (see `run_fixture_cuda_planned`).
pub fn run_case_cuda_planned(spec: &CaseSpec, seed: u64, known_len: bool) -> CaseResult {
    let f = Fixture::new(spec, seed);
    match run_fixture_cuda_planned(&f, known_len) {
        Ok(outs) => judge(&f, &outs, seed),
        Err(e) => failed(spec, seed, e),
    }
}

/// `kvs_merge_states` on CUDA device 0: the CUDA backend for `nonfinite::check_merge`.
pub fn merge_on_cuda(m: &super::nonfinite::MergeInputs) -> Result<(Vec<f64>, Vec<f32>)> {
    use super::hostbuf::HostBuf;
    use kvsparse::engine::MergeArgs;
    let dtype = m.out_a.dtype();
    let mut cfg = kvsparse::config::EngineConfig::new(1, m.heads, m.heads, m.dim, 16, dtype);
    cfg.device = Device::Cuda(0);
    let engine = Engine::new(cfg)?;
    let (shape3, shape2) = ([m.tokens as i64, m.heads as i64, m.dim as i64], [m.tokens as i64, m.heads as i64]);
    let (s3, s2) = ([shape3[1] * shape3[2], shape3[2], 1], [shape2[1], 1]);
    let (da, db) = (DevBuf::from_host(m.out_a.as_bytes())?, DevBuf::from_host(m.out_b.as_bytes())?);
    let (dla, dlb) = (DevBuf::from_host(bytes(&m.lse_a))?, DevBuf::from_host(bytes(&m.lse_b))?);
    let dout = DevBuf::from_host(HostBuf::nans(dtype, m.out_a.len()).as_bytes())?;
    let dlse = DevBuf::from_host(bytes(&vec![f32::NAN; m.lse_a.len()]))?;
    engine.merge_states(&MergeArgs {
        out_a: view(&da, 0, dtype, &shape3, &s3)?,
        lse_a: view(&dla, 0, DType::F32, &shape2, &s2)?,
        out_b: view(&db, 0, dtype, &shape3, &s3)?,
        lse_b: view(&dlb, 0, DType::F32, &shape2, &s2)?,
        out: view(&dout, 0, dtype, &shape3, &s3)?,
        lse_out: Some(view(&dlse, 0, DType::F32, &shape2, &s2)?),
        stream: std::ptr::null_mut(),
    })?;
    engine_sync(&engine)?;
    let mut out = HostBuf::zeros(dtype, m.out_a.len());
    let n = out.len() * dtype.size_bytes();
    // SAFETY: the host buffer holds exactly n bytes; the f32 vector is viewed as its bytes.
    dout.download(0, unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr(), n) })?;
    let mut lse = vec![0f32; m.lse_a.len()];
    dlse.download(0, unsafe { std::slice::from_raw_parts_mut(lse.as_mut_ptr() as *mut u8, lse.len() * 4) })?;
    Ok(((0..out.len()).map(|i| out.get(i)).collect(), lse))
}

fn engine_sync(_e: &Engine) -> Result<()> {
    // SAFETY: no arguments; the engine made its context current on this thread.
    check(unsafe { (cuda()?.cuCtxSynchronize)() }, "cuCtxSynchronize")
}

/// An instantiated CUDA graph (destroyed on drop).
pub struct Graph {
    exec: driver::CUgraphExec,
    graph: driver::CUgraph,
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Ok(api) = cuda() {
            // SAFETY: handles created by `capture`, destroyed once.
            unsafe {
                (api.cuGraphExecDestroy)(self.exec);
                (api.cuGraphDestroy)(self.graph);
            }
        }
    }
}

/// Captures what `body` enqueues on `stream` (thread-local mode) and instantiates it. The capture is
/// ended whatever `body` returns; its error comes first.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // a driver handle (CUstream): opaque, passed to the driver, never dereferenced here
pub fn capture(stream: CUstream, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
    let api = cuda()?;
    // SAFETY: capture on the caller's stream; the graph is instantiated and returned.
    unsafe {
        check((api.cuStreamBeginCapture)(stream, driver::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")?;
        let r = body();
        let mut graph = std::ptr::null_mut();
        let end = check((api.cuStreamEndCapture)(stream, &mut graph), "cuStreamEndCapture");
        r?;
        end?;
        let mut exec = std::ptr::null_mut();
        check((api.cuGraphInstantiateWithFlags)(&mut exec, graph, 0), "cuGraphInstantiate")?;
        Ok(Graph { exec, graph })
    }
}

/// Launches `g` on `stream` and waits for it.
#[allow(clippy::not_unsafe_ptr_arg_deref)] // a driver handle (CUstream): opaque, passed to the driver, never dereferenced here
pub fn replay(g: &Graph, stream: CUstream) -> Result<()> {
    let api = cuda()?;
    // SAFETY: an instantiated graph on the caller's stream.
    unsafe {
        check((api.cuGraphLaunch)(g.exec, stream), "cuGraphLaunch")?;
        check((api.cuStreamSynchronize)(stream), "cuStreamSynchronize")
    }
}

/// Captures the forward call of fixture `spec`/`seed_a` into a CUDA graph on a private stream, then
/// replays it after overwriting every input with a second fixture (`seed_b`, same geometry); returns the
/// judgement of the replay against the second fixture's reference (and of the first run).
pub fn graph_replay(spec: &CaseSpec, seed_a: u64, seed_b: u64) -> Vec<CaseResult> {
    let fa = Fixture::new(spec, seed_a);
    let fb = Fixture::new(spec, seed_b);
    let run = || -> Result<Vec<CaseResult>> {
        let api = cuda()?;
        let engine = cuda_engine(&fa)?;
        let outs = Outputs::new(&fa);
        let mut dc = DeviceCase::upload(&fa, &outs)?;
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: out-parameter; destroyed below.
        check(unsafe { (api.cuStreamCreate)(&mut stream, driver::CU_STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
        let fwd = dc.forward_args(&fa, &outs, stream)?;
        dc.write_cache(&engine, &fa, stream)?;
        engine.attention_forward(&fwd)?; // warm-up: loads modules, sizes the workspace
        let mut results = Vec::new();
        // SAFETY: our own stream.
        check(unsafe { (api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")?;
        dc.out.upload(0, outs.out.as_bytes())?;
        let g = capture(stream, || engine.attention_forward(&fwd).map(|_| ()))?;
        for (f, tag) in [(&fa, "graph-replay-same-data"), (&fb, "graph-replay-new-data")] {
            let mut o = Outputs::new(f);
            dc.refill(f, &o)?;
            dc.write_cache(&engine, f, stream)?;
            replay(&g, stream)?;
            dc.download(&mut o)?;
            let mut r = judge(f, &o, if tag.ends_with("new-data") { seed_b } else { seed_a });
            r.name = format!("{}-{tag}", spec.name);
            results.push(r);
        }
        drop(g);
        // SAFETY: our own stream, no work left on it.
        unsafe { (api.cuStreamDestroy)(stream) };
        Ok(results)
    };
    run().unwrap_or_else(|e| vec![failed(spec, seed_b, e)])
}

/// A sparse-contract session on CUDA device 0 (`sparse::Session`): the cache lives in device memory (raw
/// accesses copy it whole to or from the host), each call copies its batch over and its output back.
pub struct CudaSession {
    engine: Engine,
    geo: Geometry,
    cache: DevBuf,
}

/// Opens a [`CudaSession`] for (geometry, policy); fails like engine creation does (e.g. unsupported).
pub fn cuda_session(g: &Geometry, policy: &str) -> Result<Box<dyn Session>> {
    let mut cfg = g.config(policy);
    cfg.device = Device::Cuda(0);
    cfg.num_threads = 1;
    let engine = Engine::new(cfg)?;
    let cache = DevBuf::from_host(HostBuf::nans(g.dtype, 2 * g.cache_len()).as_bytes())?;
    Ok(Box::new(CudaSession { engine, geo: *g, cache }))
}

impl CudaSession {
    fn caches(&self) -> Result<(TensorRef, TensorRef)> {
        let (g, shape) = (&self.geo, self.geo.cache_shape());
        let st = [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1];
        Ok((view(&self.cache, 0, g.dtype, &shape, &st)?, view(&self.cache, g.cache_len() * g.dtype.size_bytes(), g.dtype, &shape, &st)?))
    }
}

impl Session for CudaSession {
    fn geometry(&self) -> Geometry {
        self.geo
    }
    fn write(&mut self, rows: &mut Rows) -> Result<()> {
        let (g, n) = (self.geo, rows.slots.len() as i64);
        let (hk, d) = (g.num_kv_heads as i64, g.head_dim as i64);
        let (k, v, s) = (DevBuf::from_host(rows.k.as_bytes())?, DevBuf::from_host(rows.v.as_bytes())?, DevBuf::from_host(bytes(&rows.slots))?);
        let (kc, vc) = self.caches()?;
        let args = CacheWriteArgs {
            layer: 0,
            key: view(&k, 0, g.dtype, &[n, hk, d], &[hk * d, d, 1])?,
            value: view(&v, 0, g.dtype, &[n, hk, d], &[hk * d, d, 1])?,
            key_cache: kc,
            value_cache: vc,
            slot_mapping: view(&s, 0, DType::I64, &[n], &[1])?,
            stream: std::ptr::null_mut(),
        };
        self.engine.cache_write(&args)?;
        engine_sync(&self.engine)
    }
    fn cache(&mut self) -> Result<HostBuf> {
        let mut h = HostBuf::zeros(self.geo.dtype, 2 * self.geo.cache_len());
        let n = h.len() * self.geo.dtype.size_bytes();
        // SAFETY: the host buffer holds exactly n bytes.
        self.cache.download(0, unsafe { std::slice::from_raw_parts_mut(h.as_mut_ptr(), n) })?;
        Ok(h)
    }
    fn set_cache(&mut self, c: &HostBuf) -> Result<()> {
        self.cache.upload(0, c.as_bytes())
    }
    fn forward(&mut self, b: &mut Batch) -> Result<(Vec<f64>, Counters)> {
        let g = self.geo;
        let (t, hq, d, n) = (b.num_tokens() as i64, g.num_q_heads as i64, g.head_dim as i64, b.seq_lens.len() as i64);
        let mut host_out = HostBuf::nans(g.dtype, (t * hq * d) as usize);
        let q = DevBuf::from_host(b.query.as_bytes())?;
        let out = DevBuf::from_host(host_out.as_bytes())?;
        let (table, lens, qsl, ids) = (DevBuf::from_host(bytes(&b.table))?, DevBuf::from_host(bytes(&b.seq_lens))?, DevBuf::from_host(bytes(&b.qsl))?, DevBuf::from_host(bytes(&b.seq_ids))?);
        let (kc, vc) = self.caches()?;
        let mut args = b.args(&g, (kc, vc), view(&out, 0, g.dtype, &[t, hq, d], &[hq * d, d, 1])?);
        args.query = view(&q, 0, g.dtype, &[t, hq, d], &[hq * d, d, 1])?;
        args.block_table = view(&table, 0, DType::I32, &[n, b.max_blocks as i64], &[b.max_blocks as i64, 1])?;
        args.seq_lens = view(&lens, 0, DType::I32, &[n], &[1])?;
        args.query_start_loc = view(&qsl, 0, DType::I32, &[n + 1], &[1])?;
        args.seq_ids = Some(view(&ids, 0, DType::I64, &[n], &[1])?);
        // A CUDA call returns only its call count; the policy counters live on the device and are read
        // (with a sync) through the engine's statistics, before and after.
        let before = self.engine.stats().total;
        self.engine.attention_forward(&args)?;
        engine_sync(&self.engine)?;
        let c = self.engine.stats().total.since(&before);
        let nb = host_out.len() * g.dtype.size_bytes();
        // SAFETY: the host buffer holds exactly nb bytes.
        out.download(0, unsafe { std::slice::from_raw_parts_mut(host_out.as_mut_ptr(), nb) })?;
        Ok(((0..host_out.len()).map(|i| host_out.get(i)).collect(), c))
    }
    fn release(&mut self, seq_id: u64) -> Result<()> {
        self.engine.release_sequence(seq_id)
    }
}
