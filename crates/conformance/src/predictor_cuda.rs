//! AttentionPredictor on CUDA against the CPU engine, over several calls on one cache: a first call holding
//! each sequence's prefill chunk (the history's seed; one sequence instead starts with a decode row, so it
//! has no history), then decode steps that each write one new token per sequence with `cache_write` and
//! attend; midway one sequence is released and its table row taken by a new sequence whose first call is a
//! prefill chunk again (in a call with the others' decode rows). Per call both engines must visit the same
//! positions (the CNN's prediction, the calibration schedule and the history all feed them) and produce
//! outputs within the dense tolerances; at the end their counters must agree, calibration (full) and
//! predicted steps included. Also: a full slot map (`max_seqs` smaller than the batch) runs the
//! sequences left without a slot dense, and a captured decode step replays like eager steps.

use super::cuda::view;
use super::fixture::Fixture;
use super::hostbuf::HostBuf;
use super::predictor_agree::{check_predicted, Cnn64, Exact, Mirror, RowSrc};
use super::reference::{attend_rows, max_abs_err, rel_err};
use super::sparse_cuda::{cfg_for, compare_counters, compare_visits, sorted, sync};
use super::{tolerance, CaseSpec};
use kvsparse::cuda::context::DevBuf;
use kvsparse::cuda::driver::{self, check, cuda, CUstream};
use kvsparse::engine::{CacheWriteArgs, Engine, ForwardArgs};
use kvsparse::error::Result;
use kvsparse::rng::Rng;
use kvsparse::stats::{Counters, VisitRecord};
use kvsparse::policy::predictor::PredictorWeights;
use kvsparse::policy::{refresh, PredictorSpec};
use kvsparse::tensor::{DType, Device, TensorRef};
use std::collections::HashMap;

/// Predictor settings that exercise each branch: short histories (the ring wraps), frequent and rare
/// calibration, blocks smaller and larger than cache blocks, sinks and windows not multiples of the block,
/// budgets below sink + local, and the paper's defaults.
pub fn predictor_policies() -> Vec<&'static str> {
    vec![
        "predictor(budget=256, history=8, calib=3, sink=16, local=32)",
        "predictor(budget=200, block=8, history=6, calib=2, sink=5, local=19)",
        "predictor(budget=600, block=32, history=16, calib=4, sink=64, local=64)",
        "predictor(budget=64, block=16, history=4, calib=9, sink=64, local=64)",
        "predictor(budget=512)",
    ]
}

/// Tokens of a prefill chunk.
pub const CHUNK: usize = 24;
/// Decode steps after the first call.
pub const STEPS: usize = 7;
/// The call before which sequence 1 is released and replaced.
pub const RELEASE_AT: usize = 4;

/// `spec`'s geometry with the multi-step shape: sequence 0 has no prefill (a decode row first), the
/// others a chunk of [`CHUNK`] at their length; lengths leave room for the steps.
pub fn predictor_spec(spec: &CaseSpec) -> CaseSpec {
    let mut s = spec.clone();
    s.seqs = [40usize, 300, 900, 1500, 4000].iter().map(|&l| (1, l + STEPS)).collect();
    s
}

fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// One forward call of the sequence: per sequence its query length and length; the rows written first.
#[derive(Clone, Debug)]
struct Call {
    q_len: Vec<usize>,
    len: Vec<usize>,
    ids: Vec<i64>,
    /// (sequence, position) rows written before the call.
    write: Vec<(usize, usize)>,
    /// Sequence ids released before the call.
    release: Vec<i64>,
    /// Queries `[tokens, hq, d]`.
    q: HostBuf,
}

/// The calls of a case: the prefill call, STEPS decode steps (a release and a new prefill in one).
fn calls(f: &Fixture, seed: u64) -> Vec<Call> {
    let s = &f.spec;
    let ns = s.seqs.len();
    let mut rng = Rng::new(seed ^ 0x9e37_79b9);
    let mut cur: Vec<usize> = s.seqs.iter().map(|&(_, l)| l - STEPS).collect();
    let mut ids = f.seq_ids.clone();
    let mut out = Vec::new();
    let q_for = |q_len: &[usize], rng: &mut Rng| {
        let t: usize = q_len.iter().sum();
        let mut q = HostBuf::zeros(s.dtype, t * s.num_q_heads * s.head_dim);
        for i in 0..q.len() {
            q.set(i, rng.normal() * 1.5);
        }
        q
    };
    // Call 0: everything below each length written; chunks except sequence 0 (a decode row, no history).
    let write0: Vec<(usize, usize)> = (0..ns).flat_map(|q| (0..cur[q]).map(move |p| (q, p))).collect();
    let q_len: Vec<usize> = (0..ns).map(|q| if q == 0 { 1 } else { CHUNK.min(cur[q]) }).collect();
    out.push(Call { q: q_for(&q_len, &mut rng), q_len, len: cur.clone(), ids: ids.clone(), write: write0, release: Vec::new() });
    for step in 1..=STEPS {
        let mut release = Vec::new();
        let mut q_len = vec![1; ns];
        let mut write = Vec::new();
        for q in 0..ns {
            if step == RELEASE_AT && q == 1 {
                release.push(ids[q]);
                ids[q] = 7000 + q as i64;
                q_len[q] = CHUNK.min(cur[q]);
                continue; // a new sequence over the same rows: a prefill chunk, nothing written
            }
            write.push((q, cur[q]));
            cur[q] += 1;
        }
        out.push(Call { q: q_for(&q_len, &mut rng), q_len, len: cur.clone(), ids: ids.clone(), write, release });
    }
    out
}

/// Element `i` of the fully written cache `w` (a V element: `v`) as the engines read it: an FP8 cache's
/// byte decoded times its scale.
fn stored(f: &Fixture, w: &HostBuf, i: usize, v: bool) -> f64 {
    let x = w.get(i);
    if f.cache_dtype().is_fp8() {
        let scale = if v { f.v_scale } else { f.k_scale };
        x * scale as f64
    } else {
        x
    }
}

/// Rows `[n, hk, d]` of K and V at the cache slots of `rows`, from the fully written cache `w` (an FP8
/// cache's dequantized values: the engines' writes quantize them back to the same bytes).
fn gather(f: &Fixture, w: &HostBuf, rows: &[(usize, usize)]) -> (HostBuf, HostBuf, Vec<i64>) {
    let (hk, d, bs) = (f.spec.num_kv_heads, f.spec.head_dim, f.spec.block_size);
    let st = f.cache_strides.map(|x| x as usize);
    let mut k = HostBuf::zeros(f.spec.dtype, rows.len().max(1) * hk * d);
    let mut v = HostBuf::zeros(f.spec.dtype, rows.len().max(1) * hk * d);
    let mut slots = Vec::with_capacity(rows.len());
    for (r, &(q, p)) in rows.iter().enumerate() {
        let b = f.block_table[q * f.max_blocks + p / bs] as usize;
        slots.push((b * bs + p % bs) as i64);
        for h in 0..hk {
            for i in 0..d {
                let at = b * st[0] + (p % bs) * st[1] + h * st[2] + i;
                k.set((r * hk + h) * d + i, stored(f, w, at, false));
                v.set((r * hk + h) * d + i, stored(f, w, f.v_offset + at, true));
            }
        }
    }
    (k, v, slots)
}

/// Outputs of one call: `[tokens, hq, d]` and LSE `[tokens, hq]` as f64.
type Out = (Vec<f64>, Vec<f64>);

/// Device buffers of a decode step (one token per sequence), reused by every decode-only call so that a
/// captured step reads new data at each replay.
struct StepBufs {
    q: DevBuf,
    qsl: DevBuf,
    lens: DevBuf,
    ids: DevBuf,
    out: DevBuf,
    lse: DevBuf,
    k: DevBuf,
    v: DevBuf,
    slots: DevBuf,
}

/// Runs the calls on one engine; per call its sorted visit records and outputs; then its counters and
/// rows left without a slot. `device`: the engine's tensors live on the GPU (copies of the host buffers,
/// same layout), on a stream of our own. `capture_from`: decode calls from this index on run as replays
/// of one CUDA graph captured from the first of them (device only).
fn run_calls(engine: &Engine, f: &Fixture, calls: &[Call], device: bool, capture_from: Option<usize>) -> Result<(Vec<Vec<VisitRecord>>, Vec<Out>, Counters, u64)> {
    let api = if device { Some(cuda()?) } else { None };
    let mut stream: CUstream = std::ptr::null_mut();
    if let Some(api) = api {
        // SAFETY: out-parameter; destroyed below.
        check(unsafe { (api.cuStreamCreate)(&mut stream, driver::CU_STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
    }
    let mut graph: Option<(driver::CUgraph, driver::CUgraphExec)> = None;
    let r = run_calls_on(engine, f, calls, device, capture_from, stream, &mut graph);
    if let Some(api) = api {
        // SAFETY: handles created here.
        unsafe {
            if let Some((g, e)) = graph {
                (api.cuGraphExecDestroy)(e);
                (api.cuGraphDestroy)(g);
            }
            (api.cuStreamDestroy)(stream);
        }
    }
    r
}

#[allow(clippy::type_complexity)]
fn run_calls_on(
    engine: &Engine,
    f: &Fixture,
    calls: &[Call],
    device: bool,
    capture_from: Option<usize>,
    stream: CUstream,
    graph: &mut Option<(driver::CUgraph, driver::CUgraphExec)>,
) -> Result<(Vec<Vec<VisitRecord>>, Vec<Out>, Counters, u64)> {
    let s = &f.spec;
    let (hq, hk, d, dt) = (s.num_q_heads as i64, s.num_kv_heads as i64, s.head_dim as i64, s.dtype);
    let es = dt.size_bytes();
    let nsu = s.seqs.len();
    let ns = nsu as i64;
    let w = f.written_cache();
    let mut host_cache = f.cache.clone();
    let dev_cache = if device { Some(DevBuf::from_host(f.cache.as_bytes())?) } else { None };
    let table_d = if device { Some(DevBuf::from_host(bytes(&f.block_table))?) } else { None };
    let steps = if device {
        let row = (hk * d) as usize * es;
        Some(StepBufs {
            q: DevBuf::alloc(nsu * (hq * d) as usize * es)?,
            qsl: DevBuf::from_host(bytes(&(0..=ns as i32).collect::<Vec<i32>>()))?,
            lens: DevBuf::alloc(nsu * 4)?,
            ids: DevBuf::alloc(nsu * 8)?,
            out: DevBuf::alloc(nsu * (hq * d) as usize * es)?,
            lse: DevBuf::alloc(nsu * hq as usize * 4)?,
            k: DevBuf::alloc(nsu * row)?,
            v: DevBuf::alloc(nsu * row)?,
            slots: DevBuf::alloc(nsu * 8)?,
        })
    } else {
        None
    };
    let (cdt, ces) = (f.cache_dtype(), f.cache_dtype().size_bytes());
    let cache_views = |hc: &mut HostBuf| -> Result<(TensorRef, TensorRef)> {
        Ok(match &dev_cache {
            Some(b) => (view(b, 0, cdt, &f.cache_shape, &f.cache_strides)?, view(b, f.v_offset * ces, cdt, &f.cache_shape, &f.cache_strides)?),
            None => (hc.view(0, &f.cache_shape, &f.cache_strides), hc.view(f.v_offset, &f.cache_shape, &f.cache_strides)),
        })
    };
    let api = if device { Some(cuda()?) } else { None };
    let (mut visits, mut outs) = (Vec::new(), Vec::new());
    for (ci, c) in calls.iter().enumerate() {
        for &id in &c.release {
            engine.release_sequence(id as u64)?;
        }
        let (mut k, mut v, slots) = gather(f, &w, &c.write);
        let n = c.write.len() as i64;
        let t: usize = c.q_len.iter().sum();
        let mut qsl = vec![0i32];
        for &x in &c.q_len {
            qsl.push(qsl.last().copied().unwrap_or(0) + x as i32);
        }
        let lens: Vec<i32> = c.len.iter().map(|&x| x as i32).collect();
        let mut q = c.q.clone();
        let mut out = HostBuf::nans(dt, t * (hq * d) as usize);
        let mut lse = vec![f32::NAN; t * hq as usize];
        let mql = c.q_len.iter().copied().max().unwrap_or(1) as i32;
        let msl = s.seqs.iter().map(|&(_, l)| l).max().unwrap_or(0) as i32;
        let shape_q = [t as i64, hq, d];
        let (kc, vc) = cache_views(&mut host_cache)?;
        if let (Some(st), Some(api)) = (&steps, api) {
            let decode_only = mql == 1 && n == ns;
            let replay = capture_from.is_some_and(|c0| ci >= c0);
            kvsparse::ensure!(!replay || decode_only, InvalidArgument, "call {ci} is not a decode step and cannot be replayed");
            // Decode steps use the step buffers; other calls fresh ones.
            let fresh = if decode_only {
                None
            } else {
                Some((
                    DevBuf::from_host(q.as_bytes())?,
                    DevBuf::from_host(bytes(&qsl))?,
                    DevBuf::from_host(bytes(&lens))?,
                    DevBuf::from_host(bytes(&c.ids))?,
                    DevBuf::from_host(out.as_bytes())?,
                    DevBuf::from_host(bytes(&lse))?,
                    DevBuf::from_host(k.as_bytes())?,
                    DevBuf::from_host(v.as_bytes())?,
                    DevBuf::from_host(bytes(&slots))?,
                ))
            };
            let b = match &fresh {
                Some((q_, qsl_, lens_, ids_, out_, lse_, k_, v_, sl_)) => (q_, qsl_, lens_, ids_, out_, lse_, k_, v_, sl_),
                None => {
                    st.q.upload(0, q.as_bytes())?;
                    st.lens.upload(0, bytes(&lens))?;
                    st.ids.upload(0, bytes(&c.ids))?;
                    st.out.upload(0, out.as_bytes())?;
                    st.lse.upload(0, bytes(&lse))?;
                    st.k.upload(0, k.as_bytes())?;
                    st.v.upload(0, v.as_bytes())?;
                    st.slots.upload(0, bytes(&slots))?;
                    (&st.q, &st.qsl, &st.lens, &st.ids, &st.out, &st.lse, &st.k, &st.v, &st.slots)
                }
            };
            let wargs = CacheWriteArgs {
                layer: 0,
                key: view(b.6, 0, dt, &[n.max(1), hk, d], &[hk * d, d, 1])?,
                value: view(b.7, 0, dt, &[n.max(1), hk, d], &[hk * d, d, 1])?,
                key_cache: kc,
                value_cache: vc,
                slot_mapping: view(b.8, 0, DType::I64, &[n.max(1)], &[1])?,
                stream,
            };
            let args = ForwardArgs {
                layer: 0,
                query: view(b.0, 0, dt, &shape_q, &[hq * d, d, 1])?,
                key_cache: kc,
                value_cache: vc,
                block_table: view(table_d.as_ref().expect("device"), 0, DType::I32, &[ns, f.max_blocks as i64], &[f.max_blocks as i64, 1])?,
                seq_lens: view(b.2, 0, DType::I32, &[ns], &[1])?,
                query_start_loc: view(b.1, 0, DType::I32, &[ns + 1], &[1])?,
                seq_ids: Some(view(b.3, 0, DType::I64, &[ns], &[1])?),
                out: view(b.4, 0, dt, &shape_q, &[hq * d, d, 1])?,
                lse: Some(view(b.5, 0, DType::F32, &[t as i64, hq], &[hq, 1])?),
                scale: f.scale,
                sliding_window: s.window as i32,
                softcap: s.softcap,
                max_query_len: mql,
                max_seq_len: msl,
                stream,
            };
            // Host-to-device copies of pageable memory may still be in flight on the legacy stream.
            sync()?;
            if replay {
                if graph.is_none() {
                    engine.record_visits(false);
                    // SAFETY: capture and instantiate on our own stream; destroyed by the caller.
                    unsafe {
                        check((api.cuStreamBeginCapture)(stream, driver::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")?;
                        let r = engine.cache_write(&wargs).and_then(|_| engine.attention_forward(&args));
                        let mut g = std::ptr::null_mut();
                        let end = check((api.cuStreamEndCapture)(stream, &mut g), "cuStreamEndCapture");
                        r?;
                        end?;
                        let mut exec = std::ptr::null_mut();
                        check((api.cuGraphInstantiateWithFlags)(&mut exec, g, 0), "cuGraphInstantiate")?;
                        *graph = Some((g, exec));
                    }
                }
                let (_, exec) = graph.expect("captured");
                // SAFETY: launch of our instantiated graph on our stream.
                check(unsafe { (api.cuGraphLaunch)(exec, stream) }, "cuGraphLaunch")?;
            } else {
                if n > 0 {
                    engine.cache_write(&wargs)?;
                }
                engine.attention_forward(&args)?;
            }
            // SAFETY: our stream.
            check(unsafe { (api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")?;
            if replay {
                let cfg = engine.config().clone();
                visits.push(sorted(engine.backend().as_any().downcast_ref::<kvsparse::cuda::CudaBackend>().expect("cuda").visit_records(&cfg, &args)?));
            } else {
                visits.push(sorted(engine.take_visits()));
            }
            // SAFETY: the host buffers hold exactly the device buffers' bytes.
            unsafe {
                b.4.download(0, std::slice::from_raw_parts_mut(out.as_mut_ptr(), out.as_bytes().len()))?;
                b.5.download(0, std::slice::from_raw_parts_mut(lse.as_mut_ptr() as *mut u8, lse.len() * 4))?;
            }
        } else {
            if n > 0 {
                let (key, value, slot_mapping) = (k.view_contiguous(&[n, hk, d]), v.view_contiguous(&[n, hk, d]), TensorRef::from_slice(&slots, &[n]));
                engine.cache_write(&CacheWriteArgs { layer: 0, key, value, key_cache: kc, value_cache: vc, slot_mapping, stream: std::ptr::null_mut() })?;
            }
            let args = ForwardArgs {
                layer: 0,
                query: q.view_contiguous(&shape_q),
                key_cache: kc,
                value_cache: vc,
                block_table: TensorRef::from_slice(&f.block_table, &[ns, f.max_blocks as i64]),
                seq_lens: TensorRef::from_slice(&lens, &[ns]),
                query_start_loc: TensorRef::from_slice(&qsl, &[ns + 1]),
                seq_ids: Some(TensorRef::from_slice(&c.ids, &[ns])),
                out: out.view_contiguous(&shape_q),
                lse: Some(TensorRef::strided(&lse, 0, &[t as i64, hq], &[hq, 1])?),
                scale: f.scale,
                sliding_window: s.window as i32,
                softcap: s.softcap,
                max_query_len: mql,
                max_seq_len: msl,
                stream: std::ptr::null_mut(),
            };
            engine.attention_forward(&args)?;
            visits.push(sorted(engine.take_visits()));
        }
        outs.push(((0..out.len()).map(|i| out.get(i)).collect(), lse.iter().map(|&x| x as f64).collect()));
    }
    let st = engine.stats();
    Ok((visits, outs, st.total, st.policy_rows_without_state))
}

/// One multi-step predictor case on both engines.
#[derive(Clone, Debug)]
pub struct PredictorResult {
    pub name: String,
    pub policy: String,
    pub seed: u64,
    /// Policy rows compared over all calls, and the calibration / predicted steps the CPU counted.
    pub rows: usize,
    pub full_steps: u64,
    pub partial_steps: u64,
    /// Decode rows whose GPU set differs from the CPU engine's, rows checked against the exact prediction
    /// from the GPU's own history (from a (sequence, head)'s first difference on), differing blocks among
    /// those, the worst margin past the boundary and the delta it was held to.
    pub differing_rows: usize,
    pub checked_rows: usize,
    pub differing_blocks: usize,
    pub worst_margin: f64,
    pub delta_at_worst: f64,
    pub decision_mismatch: Option<String>,
    pub counters_mismatch: Option<String>,
    pub rel_err: f64,
    pub lse_err: f64,
    pub pass: bool,
    pub error: Option<String>,
}

fn engine_for(f: &Fixture, policy: &str, device: Device) -> Result<Engine> {
    let e = Engine::new(cfg_for(f, policy, device))?;
    if f.cache_dtype().is_fp8() {
        e.set_kv_scales(Some(0), f.k_scale, f.v_scale)?;
    }
    e.record_visits(true);
    Ok(e)
}

/// The agreement check of a case's decode rows (`predictor_agree`), and the reference outputs: the CPU
/// engine's, or where the GPU's set differs, f64 attention over the GPU's own positions.
fn check_agreement(f: &Fixture, ps: &PredictorSpec, cs: &[Call], v_cpu: &[Vec<VisitRecord>], v_gpu: &[Vec<VisitRecord>], o_cpu: &mut [Out], res: &mut PredictorResult) {
    let s = &f.spec;
    let (hq, hk, d, bs) = (s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size);
    let g = hq / hk;
    let w = f.written_cache();
    let st = f.cache_strides.map(|x| x as usize);
    let at = |q: usize, p: usize, h: usize| f.block_table[q * f.max_blocks + p / bs] as usize * st[0] + (p % bs) * st[1] + h * st[2];
    let key = |q: usize, p: usize, h: usize| (0..d).map(|i| stored(f, &w, at(q, p, h) + i, false)).collect::<Vec<f64>>();
    let value = |q: usize, p: usize, h: usize| (0..d).map(|i| stored(f, &w, f.v_offset + at(q, p, h) + i, true)).collect::<Vec<f64>>();
    let cnn = Cnn64::new(PredictorWeights::builtin().expect("built-in weights"));
    let mut mirrors: HashMap<(i64, usize), Mirror> = HashMap::new();
    let lo_of = |n: usize| if s.window > 0 { n.saturating_sub(s.window) } else { 0 };
    for (ci, c) in cs.iter().enumerate() {
        for id in &c.release {
            mirrors.retain(|k, _| k.0 != *id);
        }
        let mut t = 0;
        for (q, (&ql, &len)) in c.q_len.iter().zip(&c.len).enumerate() {
            let id = c.ids[q];
            let qrow = |tok: usize, h: usize| (0..g * d).map(|i| c.q.get((tok * hq + h * g) * d + i)).collect::<Vec<f64>>();
            for h in 0..hk {
                let ex = Exact { key: &key, head: h, group: g, d, scale: f.scale as f64, softcap: s.softcap as f64 };
                if ql > 1 {
                    // A prefill chunk seeds the history from its last rows.
                    let mut m = Mirror::default();
                    for tt in ql - ql.min(ps.history)..ql {
                        let n = len - ql + tt + 1;
                        let mut r = RowSrc { seq: q, q: qrow(t + tt, h), pos: (lo_of(n)..n).collect(), n, exact: None };
                        r.exact = Some(ex.row(&r, ps.block));
                        m.push(r, ps.history);
                    }
                    mirrors.insert((id, h), m);
                    continue;
                }
                let what = format!("call {ci} seq {id} head {h}");
                let find = |v: &[VisitRecord]| v.iter().find(|r| r.seq_id == id as u64 && r.kv_head == h).map(|r| r.spans.clone());
                let (Some(cpu), Some(gpu)) = (find(&v_cpu[ci]), find(&v_gpu[ci])) else {
                    res.decision_mismatch.get_or_insert(format!("{what}: a visit record is missing"));
                    continue;
                };
                let (n, lo) = (len, lo_of(len));
                let gpos: Vec<usize> = gpu.iter().flat_map(|&(a, b)| a..b).collect();
                let m = mirrors.entry((id, h)).or_default();
                m.since += 1;
                let nohist = m.rows.is_empty();
                let cal = nohist || m.since >= ps.calib;
                if cal {
                    m.since = 0;
                }
                if cpu != gpu {
                    res.differing_rows += 1;
                }
                if nohist {
                    if gpu != vec![(lo, n)] {
                        res.decision_mismatch.get_or_insert(format!("{what}: no history, but the GPU visits {gpu:?}"));
                    }
                } else {
                    // Every row with a history (calibration steps attend the predicted set too): the GPU's
                    // history rows are the CPU's only within a bound, so the CPU engine's set is no reference.
                    res.checked_rows += 1;
                    let r = check_predicted(&cnn, &ex, m, ps, lo, n, &gpos);
                    res.differing_blocks += r.differing;
                    if r.worst_margin > res.worst_margin {
                        res.worst_margin = r.worst_margin;
                        res.delta_at_worst = r.delta;
                    }
                    if let Some(v) = r.violation {
                        res.decision_mismatch.get_or_insert(format!("{what}: {v}"));
                    }
                }
                let qv = qrow(t, h);
                if cpu != gpu {
                    let (ks, vs): (Vec<Vec<f64>>, Vec<Vec<f64>>) = gpos.iter().map(|&p| (key(q, p, h), value(q, p, h))).unzip();
                    let (o, l) = attend_rows(&qv, &ks, &vs, g, d, f.scale as f64, s.softcap as f64);
                    let (oc, lc) = &mut o_cpu[ci];
                    oc[(t * hq + h * g) * d..(t * hq + h * g + g) * d].copy_from_slice(&o);
                    lc[t * hq + h * g..t * hq + h * g + g].copy_from_slice(&l);
                }
                let mut r = RowSrc { seq: q, q: qv, pos: if cal { (lo..n).collect() } else { gpos }, n, exact: None };
                r.exact = Some(ex.row(&r, ps.block));
                m.push(r, ps.history);
            }
            t += ql;
        }
    }
}

/// Runs `policy` over the calls of fixture `spec` (see [`predictor_spec`]) on the CPU and on CUDA device 0.
pub fn run_predictor_case(spec: &CaseSpec, policy: &str, seed: u64) -> PredictorResult {
    let mut res = PredictorResult {
        name: spec.name.clone(),
        policy: policy.into(),
        seed,
        rows: 0,
        full_steps: 0,
        partial_steps: 0,
        differing_rows: 0,
        checked_rows: 0,
        differing_blocks: 0,
        worst_margin: 0.0,
        delta_at_worst: 0.0,
        decision_mismatch: None,
        counters_mismatch: None,
        rel_err: 0.0,
        lse_err: 0.0,
        pass: false,
        error: None,
    };
    let run = |res: &mut PredictorResult| -> Result<()> {
        let f = Fixture::new(spec, seed);
        let cs = calls(&f, seed);
        let cpu = engine_for(&f, policy, Device::Cpu)?;
        let Some(kvsparse::policy::Selector::Predictor(ps)) = cpu.policy().pipeline().map(|pl| pl.selector.clone()) else {
            kvsparse::bail!(InvalidArgument, "{policy} is not a predictor policy")
        };
        let (v_cpu, mut o_cpu, c_cpu, _) = run_calls(&cpu, &f, &cs, false, None)?;
        let (v_gpu, o_gpu, c_gpu, _) = run_calls(&engine_for(&f, policy, Device::Cuda(0))?, &f, &cs, true, None)?;
        for (a, b) in v_cpu.iter().zip(&v_gpu) {
            res.rows += a.len();
            if a.len() != b.len() {
                res.decision_mismatch.get_or_insert(format!("{} CPU policy rows vs {} GPU rows", a.len(), b.len()));
            }
        }
        check_agreement(&f, &ps, &cs, &v_cpu, &v_gpu, &mut o_cpu, res);
        for ((oc, lc), (og, lg)) in o_cpu.iter().zip(&o_gpu) {
            res.rel_err = res.rel_err.max(rel_err(og, oc));
            res.lse_err = res.lse_err.max(max_abs_err(lg, lc));
        }
        // Where sets differ, blocks visited and bytes read differ with them; the schedule never does.
        if res.differing_rows == 0 {
            res.counters_mismatch = compare_counters(&c_cpu, &c_gpu);
        }
        if (c_cpu[refresh::FULL_STEPS], c_cpu[refresh::PARTIAL_STEPS]) != (c_gpu[refresh::FULL_STEPS], c_gpu[refresh::PARTIAL_STEPS]) {
            let m = format!("calibration/predicted steps CPU {}/{} GPU {}/{}", c_cpu[refresh::FULL_STEPS], c_cpu[refresh::PARTIAL_STEPS], c_gpu[refresh::FULL_STEPS], c_gpu[refresh::PARTIAL_STEPS]);
            res.counters_mismatch = Some(res.counters_mismatch.take().map_or(m.clone(), |x| format!("{x}, {m}")));
        }
        res.full_steps = c_cpu[refresh::FULL_STEPS];
        res.partial_steps = c_cpu[refresh::PARTIAL_STEPS];
        let (tol_o, tol_l) = tolerance(spec.dtype);
        res.pass = res.rows > 0 && res.partial_steps > 0 && res.decision_mismatch.is_none() && res.counters_mismatch.is_none() && res.rel_err <= tol_o && res.lse_err <= tol_l;
        Ok(())
    };
    if let Err(e) = run(&mut res) {
        res.error = Some(e.to_string());
        res.pass = false;
    }
    res
}

/// A full slot map: the CUDA engine with `max_seqs=2` keeps state for two of the five sequences. Every
/// GPU decode row must either visit the CPU engine's positions (a sequence with a slot) or its whole
/// visible range (dense; no slot), the slot-less rows must be counted in `policy_rows_without_state`, and
/// their outputs must match a CPU engine running dense attention. Returns (rows with a slot, rows
/// without, description of the first problem).
pub fn predictor_full_slot_map(spec: &CaseSpec, policy: &str, seed: u64) -> Result<(usize, usize, Option<String>)> {
    let f = Fixture::new(spec, seed);
    let cs: Vec<Call> = calls(&f, seed).into_iter().take(RELEASE_AT).collect();
    let (v_cpu, _, _, _) = run_calls(&engine_for(&f, policy, Device::Cpu)?, &f, &cs, false, None)?;
    let (_, o_dense, _, _) = run_calls(&engine_for(&f, "dense", Device::Cpu)?, &f, &cs, false, None)?;
    let (v_gpu, o_gpu, _, without) = run_calls(&engine_for(&f, &format!("{policy}; max_seqs=2"), Device::Cuda(0))?, &f, &cs, true, None)?;
    let (hq, d) = (spec.num_q_heads, spec.head_dim);
    let (tol_o, _) = tolerance(spec.dtype);
    let (mut with, mut dense) = (0, 0);
    for (i, c) in cs.iter().enumerate() {
        for (a, b) in v_cpu[i].iter().zip(&v_gpu[i]) {
            if a.spans == b.spans {
                with += 1;
                continue;
            }
            let q = c.ids.iter().position(|&x| x as u64 == b.seq_id).expect("a call's id");
            let lo = if spec.window > 0 { c.len[q].saturating_sub(spec.window) } else { 0 };
            if b.spans != vec![(lo, c.len[q])] {
                return Ok((with, dense, Some(format!("call {i} seq {} head {}: GPU visits {:?}, neither the CPU's plan nor the whole row", b.seq_id, b.kv_head, b.spans))));
            }
            dense += 1;
            // The row's output against dense attention on the CPU.
            let t: usize = c.q_len[..q].iter().sum();
            let r = t * hq * d..(t + 1) * hq * d;
            let e = rel_err(&o_gpu[i].0[r.clone()], &o_dense[i].0[r]);
            if e > tol_o {
                return Ok((with, dense, Some(format!("call {i} seq {}: slot-less row's output vs dense rel err {e:.2e}", b.seq_id))));
            }
        }
    }
    // The slot lookup counts every row of a call whose sequence has no slot (prefill rows too): the
    // sequences left without one (all but max_seqs = 2) times the calls.
    let slotless: std::collections::BTreeSet<u64> = v_gpu.iter().flatten().zip(v_cpu.iter().flatten()).filter(|(b, a)| a.spans != b.spans).map(|(b, _)| b.seq_id).collect();
    // (A slot-less sequence whose policy plan is the whole row anyway, e.g. one shorter than sink +
    // local, cannot be told apart by its visits: at most ns - 2 are seen.)
    let want = ((spec.seqs.len() - 2) * cs.len()) as u64;
    if slotless.len() > spec.seqs.len() - 2 || without != want || dense == 0 {
        return Ok((with, dense, Some(format!("{dense} dense GPU rows of {} sequences; policy_rows_without_state = {without}, expected {want}", slotless.len()))));
    }
    Ok((with, dense, None))
}

/// Captures one predictor decode step (the cache write of each sequence's new token, then the forward
/// call) in a CUDA graph after a prefill call and one eager step, and replays it for the remaining decode
/// steps (new queries, lengths and rows uploaded into the captured buffers before each replay); a second
/// engine runs the same steps eagerly. The replays must visit the eager steps' positions and produce
/// bit-identical outputs: the history and the schedule advance on the device through the replays. `spec`
/// from [`predictor_spec`]; returns (replayed rows compared, first mismatch).
pub fn predictor_graph_replay(spec: &CaseSpec, policy: &str, seed: u64) -> Result<(usize, Option<String>)> {
    let f = Fixture::new(spec, seed);
    let mut cs = calls(&f, seed);
    cs.truncate(RELEASE_AT); // the prefill call and decode steps only
    let (v_e, o_e, c_e, _) = run_calls(&engine_for(&f, policy, Device::Cuda(0))?, &f, &cs, true, None)?;
    let (v_g, o_g, c_g, _) = run_calls(&engine_for(&f, policy, Device::Cuda(0))?, &f, &cs, true, Some(2))?;
    let mut rows = 0;
    for i in 2..cs.len() {
        rows += v_e[i].len();
        if let Some(m) = compare_visits(&v_e[i], &v_g[i]) {
            return Ok((rows, Some(format!("step {i}: {m}"))));
        }
        let bad = o_e[i].0.iter().zip(&o_g[i].0).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        if bad > 0 {
            return Ok((rows, Some(format!("step {i}: {bad} output elements differ from the eager run"))));
        }
    }
    if let Some(m) = compare_counters(&c_e, &c_g) {
        return Ok((rows, Some(m)));
    }
    if (c_e[refresh::FULL_STEPS], c_e[refresh::PARTIAL_STEPS]) != (c_g[refresh::FULL_STEPS], c_g[refresh::PARTIAL_STEPS]) {
        return Ok((rows, Some("calibration/predicted step counts differ".into())));
    }
    Ok((rows, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU half of a case runs (the harness itself: calls, writes, a release and a new prefill) and
    /// has both calibration and predicted steps and a full-range first row for the sequence without prefill.
    #[test]
    fn cpu_half_of_a_predictor_case_runs() {
        let spec = predictor_spec(&super::super::sparse_cuda::sparse_specs(true)[0]);
        let f = Fixture::new(&spec, 5);
        let cs = calls(&f, 5);
        let (v, o, c, _) = run_calls(&engine_for(&f, predictor_policies()[0], Device::Cpu).unwrap(), &f, &cs, false, None).unwrap();
        assert_eq!(v.len(), STEPS + 1);
        assert!(c[refresh::FULL_STEPS] > 0 && c[refresh::PARTIAL_STEPS] > 0, "{c:?}");
        let hk = spec.num_kv_heads;
        assert_eq!(v[0].len(), hk, "call 0 has one decode row (sequence 0)");
        assert_eq!(v[0][0].spans, vec![(0, cs[0].len[0])], "no history: every position");
        assert_eq!(v[RELEASE_AT].len(), (spec.seqs.len() - 1) * hk, "the released row is a prefill chunk");
        assert!(o.iter().all(|(out, _)| out.iter().all(|x| x.is_finite())));
    }
}
