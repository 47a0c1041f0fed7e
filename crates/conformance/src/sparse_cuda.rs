//! Sparse decode on CUDA against the CPU engine (module `sparse_cuda`; `sparse` holds the backend-neutral
//! sparse contract): for the same fixture (cache written through
//! `cache_write` on both engines) and the same policy, the CUDA engine must visit exactly the pages and
//! tokens the CPU engine visits (compared through the engines' visit records, i.e. their plans), keep
//! bit-identical key metadata, count the same policy statistics, and produce outputs within the dense
//! tolerances of the CPU engine's. Also the CUDA-graph replay of a sparse decode step.

use super::cuda::{capture, replay, DeviceCase};
use super::fixture::{run_on_engine, write_rows, Fixture, Outputs};
use super::reference::{max_abs_err, rel_err};
use super::quest_agree::{quest_agreement, quest_alone};
use super::top_p_agree::top_p_rows_agree;
use super::{tolerance, CaseSpec};
use kvsparse::cuda::driver::{self, check, cuda, CUstream};
use kvsparse::engine::Engine;
use kvsparse::error::Result;
use kvsparse::policy::top_p;
use kvsparse::stats::{Counters, VisitRecord};
use kvsparse::tensor::{DType, Device};

/// One sparse case on both backends.
#[derive(Clone, Debug)]
pub struct SparseResult {
    pub name: String,
    pub policy: String,
    pub seed: u64,
    /// Policy rows compared, and the first one whose visited positions differ (if any).
    pub rows: usize,
    pub decision_mismatch: Option<String>,
    pub meta_equal: bool,
    pub counters_mismatch: Option<String>,
    /// GPU output vs CPU output: relative error, max LSE difference.
    pub rel_err: f64,
    pub lse_err: f64,
    /// Quest alone (the agreement contract): pages on which the sets differ, worst |S - S_k| / delta.
    pub quest: Option<(usize, f64)>,
    /// `base > top_p` (the agreement contract): tokens on which the sets differ, the worst margin.
    pub top_p: Option<(usize, f64)>,
    pub pass: bool,
    pub error: Option<String>,
}

impl SparseResult {
    /// Nothing compared yet (a case that fails before comparing reports this with its error).
    pub fn new(spec: &CaseSpec, policy: &str, seed: u64) -> Self {
        SparseResult {
            name: spec.name.clone(),
            policy: policy.to_string(),
            seed,
            rows: 0,
            decision_mismatch: None,
            meta_equal: false,
            counters_mismatch: None,
            rel_err: f64::NAN,
            lse_err: f64::NAN,
            quest: None,
            top_p: None,
            pass: false,
            error: None,
        }
    }
}

/// A fresh CUDA engine for `policy` recording its visits, fixture `f`'s cache write and forward call on
/// the default stream, the outputs downloaded.
pub(super) fn run_fixture_cuda_policy(f: &Fixture, policy: &str) -> Result<(Engine, Outputs)> {
    let gpu = Engine::new(cfg_for(f, policy, Device::Cuda(0)))?;
    if f.cache_dtype().is_fp8() {
        gpu.set_kv_scales(Some(0), f.k_scale, f.v_scale)?;
    }
    gpu.record_visits(true);
    let mut outs = Outputs::new(f);
    let dc = DeviceCase::upload(f, &outs)?;
    gpu.cache_write(&dc.cache_write_args(f, std::ptr::null_mut())?)?;
    gpu.attention_forward(&dc.forward_args(f, &outs, std::ptr::null_mut())?)?;
    sync()?;
    dc.download(&mut outs)?;
    Ok((gpu, outs))
}

/// The policies the CUDA backend runs, with settings that exercise every branch (forced sink pages,
/// pages smaller and larger than blocks, top-p over each base, lossless settings).
pub fn sparse_policies() -> Vec<&'static str> {
    vec![
        "streaming(sink=4, recent=64)",
        "quest(budget=128)",
        "quest(budget=96, page=8, sink=16)",
        "quest(budget=256, page=32)",
        "all > top_p(p=0.9)",
        "quest(budget=256, sink=4) > top_p(p=0.95)",
        "streaming(sink=16, recent=200) > top_p(p=0.8)",
        "quest(budget=1000000)",
        "quest(budget=1000000) > top_p(p=1)",
    ]
}

/// Geometries for the sparse matrix: every head size, GQA 1..16, block sizes 1..256, the three dtypes,
/// window and soft-cap, strided tensors; decode rows of many lengths plus a prefill row in the same call.
pub fn sparse_specs(quick: bool) -> Vec<CaseSpec> {
    let mk = |name: &str, dtype, head_dim, hq, hk, bs, window, softcap: f32, strided| {
        let mut c = CaseSpec::new(name, dtype, head_dim, hq, hk, bs, vec![(1, 1), (1, 17), (1, 300), (7, 900), (1, 1500), (1, 4000)]);
        c.window = window;
        c.softcap = softcap;
        c.strided = strided;
        c
    };
    let mut v = vec![
        mk("h128-bf16-gqa4-bs16", DType::BF16, 128, 8, 2, 16, 0, 0.0, false),
        mk("h64-f16-gqa8-bs8-strided", DType::F16, 64, 16, 2, 8, 0, 0.0, true),
        mk("h128-f32-gqa4-bs16-window", DType::F32, 128, 8, 2, 16, 700, 0.0, false),
        mk("h96-bf16-gqa16-bs32-softcap", DType::BF16, 96, 16, 1, 32, 0, 30.0, false),
    ];
    if !quick {
        v.extend([
            mk("h80-f16-gqa1-bs1", DType::F16, 80, 4, 4, 1, 0, 0.0, false),
            mk("h112-bf16-gqa2-bs256", DType::BF16, 112, 4, 2, 256, 0, 0.0, false),
            mk("h192-f32-gqa4-bs64-softcap-strided", DType::F32, 192, 8, 2, 64, 0, 20.0, true),
            mk("h256-bf16-gqa8-bs16-window", DType::BF16, 256, 8, 1, 16, 333, 0.0, false),
            mk("h128-f16-gqa16-bs128", DType::F16, 128, 32, 2, 128, 0, 0.0, false),
            mk("h64-bf16-gqa4-bs2-window-softcap", DType::BF16, 64, 8, 2, 2, 500, 10.0, false),
        ]);
    }
    v
}

pub(super) fn cfg_for(f: &Fixture, policy: &str, device: Device) -> kvsparse::EngineConfig {
    let mut cfg = f.engine_config();
    cfg.policy = format!("{policy}; dense_layers=0");
    cfg.device = device;
    cfg.num_threads = 2;
    cfg
}

pub(super) fn sorted(mut v: Vec<VisitRecord>) -> Vec<VisitRecord> {
    v.sort_by_key(|r| (r.seq_id, r.kv_head));
    v
}

/// The first difference between two sets of visit records, described.
pub fn compare_visits(cpu: &[VisitRecord], gpu: &[VisitRecord]) -> Option<String> {
    if cpu.len() != gpu.len() {
        return Some(format!("{} CPU policy rows vs {} GPU rows", cpu.len(), gpu.len()));
    }
    for (a, b) in cpu.iter().zip(gpu) {
        if (a.seq_id, a.kv_head) != (b.seq_id, b.kv_head) || a.spans != b.spans {
            let tok = |r: &VisitRecord| r.spans.iter().map(|(x, y)| y - x).sum::<usize>();
            let first_diff = a.spans.iter().zip(&b.spans).position(|(x, y)| x != y).unwrap_or(a.spans.len().min(b.spans.len()));
            return Some(format!(
                "seq {} head {}: CPU {} tokens in {} spans, GPU {} tokens in {} spans (seq {} head {}); first differing span #{first_diff}: {:?} vs {:?}",
                a.seq_id,
                a.kv_head,
                tok(a),
                a.spans.len(),
                tok(b),
                b.spans.len(),
                b.seq_id,
                b.kv_head,
                a.spans.get(first_diff),
                b.spans.get(first_diff)
            ));
        }
    }
    None
}

/// Policy counters both backends must agree on.
pub fn compare_counters(c: &Counters, g: &Counters) -> Option<String> {
    let pick = |x: &Counters| [x.decode_rows, x.prefill_tokens, x.policy_rows, x.blocks_eligible, x.blocks_visited, x[top_p::CANDIDATES], x[top_p::KEPT], x.kv_bytes_read];
    let names = ["decode_rows", "prefill_tokens", "policy_rows", "blocks_eligible", "blocks_visited", "top_p_candidates", "top_p_kept", "kv_bytes_read"];
    let (a, b) = (pick(c), pick(g));
    let diffs: Vec<String> = (0..a.len()).filter(|&i| a[i] != b[i]).map(|i| format!("{} CPU {} GPU {}", names[i], a[i], b[i])).collect();
    (!diffs.is_empty()).then(|| diffs.join(", "))
}

pub(super) fn sync() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { (cuda()?.cuCtxSynchronize)() }, "cuCtxSynchronize")
}

/// Runs `policy` on fixture `spec`/`seed` on the CPU and on CUDA device 0 and compares them.
pub fn run_sparse_case(spec: &CaseSpec, policy: &str, seed: u64) -> SparseResult {
    run_sparse_case_keys(spec, policy, seed, None)
}

/// Fixture `spec`/`seed` with every key it writes replaced by `key(row)` when given (row = the index of the
/// written row, prior rows first): keys that make many scores the same.
pub fn fixture_with_keys(spec: &CaseSpec, seed: u64, key: Option<&dyn Fn(usize) -> f64>) -> Fixture {
    let mut f = Fixture::new(spec, seed);
    if let Some(key) = key {
        let per = f.spec.num_kv_heads * f.spec.head_dim;
        let np = f.prior.k.len() / per;
        for i in 0..f.prior.k.len() {
            f.prior.k.set(i, key(i / per));
        }
        for i in 0..f.new_k.len() {
            f.new_k.set(i, key(np + i / per));
        }
    }
    f
}

/// As `run_sparse_case`, with every key written replaced by `key(row)` (row = the index of the written row,
/// prior rows first), when given: keys that make many pages score the same.
pub fn run_sparse_case_keys(spec: &CaseSpec, policy: &str, seed: u64, key: Option<&dyn Fn(usize) -> f64>) -> SparseResult {
    let mut res = SparseResult::new(spec, policy, seed);
    let mut f = fixture_with_keys(spec, seed, key);
    let mut run = |res: &mut SparseResult| -> Result<()> {
        let cpu = Engine::new(cfg_for(&f, policy, Device::Cpu))?;
        cpu.record_visits(true);
        let outs_cpu = run_on_engine(&cpu, &mut f)?;
        let v_cpu = sorted(cpu.take_visits());
        let meta_cpu = cpu.metadata_snapshot(0)?;
        let c_cpu = cpu.stats().total;

        let (gpu, outs) = run_fixture_cuda_policy(&f, policy)?;
        let v_gpu = sorted(gpu.take_visits());
        let meta_gpu = gpu.metadata_snapshot(0)?;
        let c_gpu = gpu.stats().total;

        res.rows = v_cpu.len();
        res.meta_equal = meta_cpu == meta_gpu;
        let (oc, mut lc) = outs_cpu.to_f64(&f);
        let (og, mut lg) = outs.to_f64(&f);
        res.rel_err = rel_err(&og, &oc);
        res.counters_mismatch = compare_counters(&c_cpu, &c_gpu);
        let top_p = top_p_last(policy);
        match (quest_alone(policy), meta_cpu.as_ref()) {
            // Quest alone scores on tensor cores: its sets agree with the CPU's up to borderline pages.
            (Some(set), Some(meta)) => {
                let ag = quest_agreement(&f, set, meta, &v_cpu, &v_gpu, &oc, &og);
                res.decision_mismatch = ag.violation.clone();
                res.rel_err = ag.out_rel;
                res.quest = Some((ag.differing, ag.worst_ratio));
                if !ag.rows_apart.is_empty() {
                    // Visited blocks and bytes follow the sets; the LSE of a row apart follows the GPU's set
                    // (its output is checked against the f64 reference over that set above).
                    res.counters_mismatch = compare_counters(&without_set_counters(&c_cpu), &without_set_counters(&c_gpu));
                    mask_rows(&mut lc, &mut lg, &ag.rows_apart, spec);
                }
            }
            // `base > top_p(p < 1)`: the device estimates on tensor cores, so its sets agree with the CPU's up
            // to borderline tokens (top_p_agree.rs); the candidates are the base's set on the CPU engine.
            (None, Some(meta)) if top_p.is_some() => {
                let (base, p) = top_p.expect("guarded");
                let cand = base_candidates(spec, &base, seed, key)?;
                let ag = top_p_rows_agree(&f, meta, &v_cpu, &v_gpu, &|s, h| cand.get(&(s, h)).cloned().unwrap_or_default(), p, &oc, &og);
                res.decision_mismatch = ag.violation.clone().or_else(|| (ag.out_rel > ag.out_tol).then(|| format!("output over the GPU's sets: rel {:.3e} > {:.3e}", ag.out_rel, ag.out_tol)));
                res.rel_err = ag.out_rel;
                res.top_p = Some((ag.differing, ag.worst_margin));
                if !ag.rows_apart.is_empty() {
                    // As Quest's, and the tokens top-p kept.
                    let strip = |c: &Counters| {
                        let mut c = without_set_counters(c);
                        c[top_p::KEPT] = 0;
                        c
                    };
                    res.counters_mismatch = compare_counters(&strip(&c_cpu), &strip(&c_gpu));
                    mask_rows(&mut lc, &mut lg, &ag.rows_apart, spec);
                }
            }
            _ => res.decision_mismatch = compare_visits(&v_cpu, &v_gpu),
        }
        res.lse_err = max_abs_err(&lg, &lc);
        let (tol_o, tol_l) = tolerance(spec.dtype);
        res.pass = res.decision_mismatch.is_none() && res.meta_equal && res.counters_mismatch.is_none() && res.rel_err <= tol_o && res.lse_err <= tol_l;
        Ok(())
    };
    if let Err(e) = run(&mut res) {
        res.error = Some(e.to_string());
        res.pass = false;
    }
    res
}

/// The counters without those that follow a row's set (visited blocks, bytes read): compared when the
/// engines' sets differ on some rows.
fn without_set_counters(c: &Counters) -> Counters {
    Counters { blocks_visited: 0, kv_bytes_read: 0, ..c.clone() }
}

/// Zeroes the LSE of rows whose sets differ between the engines (they follow each engine's own set; the
/// outputs of those rows are checked against an f64 attention over the GPU's set instead).
fn mask_rows(lc: &mut [f64], lg: &mut [f64], rows: &[(usize, usize)], spec: &CaseSpec) {
    let hq = spec.num_q_heads;
    let g = hq / spec.num_kv_heads;
    for &(t, h) in rows {
        for gi in 0..g {
            lc[t * hq + h * g + gi] = 0.0;
            lg[t * hq + h * g + gi] = 0.0;
        }
    }
}

/// `base > top_p(p)` with p < 1 (a search that decides something): the base's spec and p.
pub fn top_p_last(policy: &str) -> Option<(String, f32)> {
    let parsed = kvsparse::policy::Policy::parse(policy).ok()?;
    let pl = parsed.pipeline()?;
    let p = pl.top_p.as_ref().filter(|_| pl.art.is_none())?.p;
    let (base, _) = policy.rsplit_once('>')?;
    (p < 1.0 && !policy.contains(';')).then(|| (base.trim().to_string(), p))
}

/// Each policy row's candidates: the tokens the CPU engine visits with the base selector alone, by
/// (sequence, KV head), on the same fixture.
fn base_candidates(spec: &CaseSpec, base: &str, seed: u64, key: Option<&dyn Fn(usize) -> f64>) -> Result<std::collections::HashMap<(usize, usize), Vec<usize>>> {
    let mut f = fixture_with_keys(spec, seed, key);
    let cpu = Engine::new(cfg_for(&f, base, Device::Cpu))?;
    cpu.record_visits(true);
    run_on_engine(&cpu, &mut f)?;
    Ok(cpu.take_visits().into_iter().map(|v| ((v.seq_id - 1000) as usize, v.kv_head, v.spans.iter().flat_map(|&(a, b)| a..b).collect::<Vec<usize>>())).map(|(s, h, t)| ((s, h), t)).collect())
}

/// A decode step's cache write: the last position of every sequence of a decode-only fixture, taken
/// out of the fixture's own write (those rows become padding there) and written by the step itself.
struct StepRows {
    slots: Vec<i64>,
    k: crate::hostbuf::HostBuf,
    v: crate::hostbuf::HostBuf,
}

fn split_last_rows(f: &mut Fixture) -> StepRows {
    let s = &f.spec;
    let (hk, d, bs) = (s.num_kv_heads, s.head_dim, s.block_size);
    let ns = s.seqs.len();
    let mut k = crate::hostbuf::HostBuf::zeros(s.dtype, ns * hk * d);
    let mut v = crate::hostbuf::HostBuf::zeros(s.dtype, ns * hk * d);
    let mut slots = Vec::with_capacity(ns);
    for (q, &(_, len)) in s.seqs.iter().enumerate() {
        let j = len - 1;
        let slot = f.block_table[q * f.max_blocks + j / bs] as i64 * bs as i64 + (j % bs) as i64;
        let row = f.slots.iter().position(|&x| x == slot).expect("every position is written once");
        f.slots[row] = -1;
        for i in 0..hk * d {
            k.set(q * hk * d + i, f.new_k.get(row * hk * d + i));
            v.set(q * hk * d + i, f.new_v.get(row * hk * d + i));
        }
        slots.push(slot);
    }
    StepRows { slots, k, v }
}

fn bytes_of<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slice viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// A decode step's cache write (one row per sequence, the one-launch metadata path on CUDA) after the
/// fixture's prefix write, on the CPU and on CUDA: whether the key metadata (fill mask, Quest bounds,
/// INT4 copy) is the same bit for bit afterwards. `spec` must be decode-only.
pub fn decode_step_meta_equal(spec: &CaseSpec, policy: &str, seed: u64) -> Result<bool> {
    use kvsparse::cuda::context::DevBuf;
    use kvsparse::tensor::TensorRef;
    kvsparse::ensure!(spec.seqs.iter().all(|&(q, _)| q == 1), InvalidArgument, "decode_step_meta_equal needs a decode-only spec");
    let mut f = Fixture::new(spec, seed);
    let mut st = split_last_rows(&mut f);
    let (hk, d, ns) = (spec.num_kv_heads as i64, spec.head_dim as i64, spec.seqs.len() as i64);
    let cpu = Engine::new(cfg_for(&f, policy, Device::Cpu))?;
    let (kc, vc) = (f.k_cache_view(), f.v_cache_view());
    write_rows(&cpu, (kc, vc), &mut f.prior.k, &mut f.prior.v, &f.prior.slots, hk, d)?;
    write_rows(&cpu, (kc, vc), &mut f.new_k, &mut f.new_v, &f.slots, hk, d)?;
    write_rows(&cpu, (kc, vc), &mut st.k, &mut st.v, &st.slots, hk, d)?;
    let meta_cpu = cpu.metadata_snapshot(0)?;

    let gpu = Engine::new(cfg_for(&f, policy, Device::Cuda(0)))?;
    let outs = Outputs::new(&f);
    let dc = DeviceCase::upload(&f, &outs)?;
    gpu.cache_write(&dc.cache_write_args(&f, std::ptr::null_mut())?)?;
    let (k, v, sl) = (DevBuf::from_host(st.k.as_bytes())?, DevBuf::from_host(st.v.as_bytes())?, DevBuf::from_host(bytes_of(&st.slots))?);
    let mut a = dc.cache_write_args(&f, std::ptr::null_mut())?;
    let view = |b: &DevBuf, dt, shape: &[i64], str: &[i64]| unsafe { TensorRef::from_raw(b.as_ptr(), dt, Device::Cuda(0), shape, Some(str)) };
    a.key = view(&k, spec.dtype, &[ns, hk, d], &[hk * d, d, 1])?;
    a.value = view(&v, spec.dtype, &[ns, hk, d], &[hk * d, d, 1])?;
    a.slot_mapping = view(&sl, DType::I64, &[ns], &[1])?;
    gpu.cache_write(&a)?;
    sync()?;
    Ok(meta_cpu == gpu.metadata_snapshot(0)?)
}

/// Captures a whole sparse decode step (the cache write of each sequence's new row, which also updates
/// the key metadata, then selection, attention and combine) in a CUDA graph on a private stream, replays
/// it after replacing every input (cache contents, queries, block table, lengths, the new rows and their
/// slots) with a second fixture of the same geometry, and compares the replay with an eager run of that
/// fixture on a fresh engine: the same visited positions and bit-identical outputs. `spec` must be
/// decode-only. Returns (policy rows compared, mismatch description or None).
pub fn sparse_graph_replay(spec: &CaseSpec, policy: &str, seed_a: u64, seed_b: u64) -> Result<(usize, Option<String>)> {
    sparse_graph_replay_on(spec, policy, seed_a, seed_b, false)
}

/// As [`sparse_graph_replay`]; with `capture_elsewhere` the eager warm-up runs on one stream and the
/// capture on a second one, as vLLM and `torch.cuda.graph` do (the capturing stream has had no eager call
/// of its own), and the graph is replayed on the first.
pub fn sparse_graph_replay_on(spec: &CaseSpec, policy: &str, seed_a: u64, seed_b: u64, capture_elsewhere: bool) -> Result<(usize, Option<String>)> {
    use kvsparse::cuda::context::DevBuf;
    use kvsparse::engine::CacheWriteArgs;
    use kvsparse::tensor::TensorRef;
    kvsparse::ensure!(spec.seqs.iter().all(|&(q, _)| q == 1), InvalidArgument, "sparse_graph_replay needs a decode-only spec");
    let mut fa = Fixture::new(spec, seed_a);
    let mut fb = Fixture::new(spec, seed_b);
    let (sa, sb) = (split_last_rows(&mut fa), split_last_rows(&mut fb));
    let (hk, d, ns) = (spec.num_kv_heads as i64, spec.head_dim as i64, spec.seqs.len() as i64);
    let api = cuda()?;
    let step_args = |k: &DevBuf, v: &DevBuf, sl: &DevBuf, dc: &DeviceCase, f: &Fixture, stream: CUstream| -> Result<CacheWriteArgs> {
        let mut a = dc.cache_write_args(f, stream)?;
        let view = |b: &DevBuf, dt, shape: &[i64], st: &[i64]| unsafe { TensorRef::from_raw(b.as_ptr(), dt, Device::Cuda(0), shape, Some(st)) };
        a.key = view(k, spec.dtype, &[ns, hk, d], &[hk * d, d, 1])?;
        a.value = view(v, spec.dtype, &[ns, hk, d], &[hk * d, d, 1])?;
        a.slot_mapping = view(sl, DType::I64, &[ns], &[1])?;
        Ok(a)
    };

    // Eager reference on fixture b: prefix write, step write, forward.
    let eager = Engine::new(cfg_for(&fb, policy, Device::Cuda(0)))?;
    eager.record_visits(true);
    let mut outs_e = Outputs::new(&fb);
    let dce = DeviceCase::upload(&fb, &outs_e)?;
    let (ke, ve, se) = (DevBuf::from_host(sb.k.as_bytes())?, DevBuf::from_host(sb.v.as_bytes())?, DevBuf::from_host(bytes_of(&sb.slots))?);
    eager.cache_write(&dce.cache_write_args(&fb, std::ptr::null_mut())?)?;
    eager.cache_write(&step_args(&ke, &ve, &se, &dce, &fb, std::ptr::null_mut())?)?;
    eager.attention_forward(&dce.forward_args(&fb, &outs_e, std::ptr::null_mut())?)?;
    sync()?;
    dce.download(&mut outs_e)?;
    let v_eager = sorted(eager.take_visits());

    let engine = Engine::new(cfg_for(&fa, policy, Device::Cuda(0)))?;
    let outs = Outputs::new(&fa);
    let mut dc = DeviceCase::upload(&fa, &outs)?;
    let (kg, vg, sg) = (DevBuf::from_host(sa.k.as_bytes())?, DevBuf::from_host(sa.v.as_bytes())?, DevBuf::from_host(bytes_of(&sa.slots))?);
    let (mut stream, mut cap): (CUstream, CUstream) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out-parameters; destroyed below.
    check(unsafe { (api.cuStreamCreate)(&mut stream, driver::CU_STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
    if capture_elsewhere {
        check(unsafe { (api.cuStreamCreate)(&mut cap, driver::CU_STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
    } else {
        cap = stream;
    }
    let result = (|| -> Result<(usize, Option<String>)> {
        let step = step_args(&kg, &vg, &sg, &dc, &fa, stream)?;
        let fwd = dc.forward_args(&fa, &outs, stream)?;
        engine.cache_write(&dc.cache_write_args(&fa, stream)?)?;
        engine.cache_write(&step)?; // warm-up: modules, metadata, workspaces
        engine.attention_forward(&fwd)?;
        let (step_c, fwd_c) = (step_args(&kg, &vg, &sg, &dc, &fa, cap)?, dc.forward_args(&fa, &outs, cap)?);
        // SAFETY: our own stream.
        check(unsafe { (api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")?;
        let graph = capture(cap, || engine.cache_write(&step_c).and_then(|_| engine.attention_forward(&fwd_c)).map(|_| ()))?;
        {
            // Fixture b in a's buffers: cache, queries, table, lengths; b's prefix written eagerly (b's
            // blocks start over, so a's metadata there is replaced); b's new rows and slots in the step's
            // buffers, which the graph reads at replay.
            let mut o = Outputs::new(&fb);
            dc.refill(&fb, &o)?;
            engine.cache_write(&dc.cache_write_args(&fb, stream)?)?;
            kg.upload(0, sb.k.as_bytes())?;
            vg.upload(0, sb.v.as_bytes())?;
            sg.upload(0, bytes_of(&sb.slots))?;
            // SAFETY: our own stream.
            check(unsafe { (api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")?;
            replay(&graph, stream)?;
            dc.download(&mut o)?;
            let cfg = engine.config().clone();
            let v_replay = sorted(engine.backend().as_any().downcast_ref::<kvsparse::cuda::CudaBackend>().expect("cuda").visit_records(&cfg, &dc.forward_args(&fb, &o, stream)?)?);
            drop(graph);
            let mism = compare_visits(&v_eager, &v_replay).or_else(|| {
                let (a, _) = outs_e.to_f64(&fb);
                let (b, _) = o.to_f64(&fb);
                let bad = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                (bad > 0).then(|| format!("{bad} output elements differ from the eager run (rel err {:.2e})", rel_err(&b, &a)))
            });
            Ok((v_eager.len(), mism))
        }
    })();
    // SAFETY: created above.
    unsafe {
        (api.cuStreamDestroy)(stream);
        if capture_elsewhere {
            (api.cuStreamDestroy)(cap);
        }
    }
    result
}

/// ART's stop tile per decode row (sequence, KV head) on the GPU and on the CPU engine, same fixture.
/// `spec_at(s)` is the policy with its thresholds scaled by `s` (tau·s, phi·s): the CPU runs at s = 1 and
/// at 1 ± `eps`, which brackets the tiles a run whose decision values differ from the CPU's by less than
/// a relative `eps` can stop at (looser thresholds can only stop earlier). Returns per row
/// `(gpu, cpu, cpu_loose, cpu_tight, total)` in tiles, and the relative error of the GPU's output against
/// the CPU engine's over the rows that stopped at the same tile (the same visited set; `spec` must be
/// decode-only: token = sequence), NaN when no row did.
/// ART's stop-tile contract over `specs` × `pols` (name, policy at a threshold scale; `art_stop_tiles` per
/// case, seed `seed + 10 i + j`): panics where a row that stopped at the CPU's tile differs in output beyond
/// the dense tolerance or a row stopped outside its ±`eps` bracket; prints a line per case (`label` first).
/// Returns (rows, same stop tile, borderline, stopped early on the CPU) for the caller's totals.
pub fn check_art_stops(label: &str, specs: &[CaseSpec], pols: &[(&str, fn(f64) -> String)], eps: f64, seed: u64) -> (usize, usize, usize, usize) {
    let (mut rows, mut same, mut border, mut early) = (0, 0, 0, 0);
    for (i, spec) in specs.iter().enumerate() {
        for (j, (name, f)) in pols.iter().enumerate() {
            let (r, err) = art_stop_tiles(spec, f, eps, seed.wrapping_add((i * 10 + j) as u64)).unwrap_or_else(|e| panic!("{} {name}: {e}", spec.name));
            let tol = tolerance(spec.dtype).0;
            assert!(!(err > tol), "{} {name} (seed {seed}): output over the same visited tiles differs from the CPU engine's: rel {err:.3e} > {tol:.0e}", spec.name);
            for &(g, c, lo, hi, total) in &r {
                rows += 1;
                early += (c < total) as usize;
                if g == c {
                    same += 1;
                } else {
                    assert!(lo <= g && g <= hi, "{} {name} (seed {seed}): GPU stopped after {g} tiles, CPU after {c} (bracket {lo}..={hi} at ±{eps})", spec.name);
                    border += 1;
                }
            }
            println!("{label} {:<36} {:<40} rows {:>3} rel {err:.2e} (same stop)", spec.name, name, r.len());
        }
    }
    (rows, same, border, early)
}

pub fn art_stop_tiles(spec: &CaseSpec, spec_at: &dyn Fn(f64) -> String, eps: f64, seed: u64) -> Result<(Vec<(u32, u32, u32, u32, u32)>, f64)> {
    let mut f = Fixture::new(spec, seed);
    let mut cpu_run = |s: f64| -> Result<(Vec<VisitRecord>, Outputs)> {
        let cpu = Engine::new(cfg_for(&f, &spec_at(s), Device::Cpu))?;
        cpu.record_visits(true);
        let outs = run_on_engine(&cpu, &mut f)?;
        Ok((sorted(cpu.take_visits()), outs))
    };
    let tiles = |v: &[VisitRecord]| -> Vec<(u32, u32)> { v.iter().map(|r| r.traversal_tiles.unwrap_or((0, 0))).collect() };
    let (v_cpu, outs_cpu) = cpu_run(1.0)?;
    let (cpu, loose, tight) = (tiles(&v_cpu), tiles(&cpu_run(1.0 + eps)?.0), tiles(&cpu_run(1.0 - eps)?.0));
    let (gpu, outs_gpu) = run_fixture_cuda_policy(&f, &spec_at(1.0))?;
    let g = tiles(&sorted(gpu.take_visits()));
    kvsparse::ensure!(g.len() == cpu.len(), InvalidArgument, "{} GPU rows vs {} CPU rows", g.len(), cpu.len());
    let (hq, hk, d) = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim);
    let ((oc, _), (og, _)) = (outs_cpu.to_f64(&f), outs_gpu.to_f64(&f));
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for (_, r) in v_cpu.iter().enumerate().filter(|&(i, _)| g[i].0 == cpu[i].0) {
        let t = f.seq_ids.iter().position(|&x| x as u64 == r.seq_id).expect("a fixture sequence");
        let h0 = r.kv_head * (hq / hk);
        let at = (t * hq + h0) * d..(t * hq + h0 + hq / hk) * d;
        a.extend_from_slice(&og[at.clone()]);
        b.extend_from_slice(&oc[at]);
    }
    let err = if a.is_empty() { f64::NAN } else { rel_err(&a, &b) };
    Ok(((0..g.len()).map(|i| (g[i].0, cpu[i].0, loose[i].0, tight[i].0, cpu[i].1.max(g[i].1))).collect(), err))
}

#[cfg(test)]
mod tests {
    use super::top_p_last;

    #[test]
    fn top_p_last_names_the_base_of_a_deciding_search() {
        assert_eq!(top_p_last("quest(budget=256, sink=4) > top_p(p=0.95)"), Some(("quest(budget=256, sink=4)".into(), 0.95)));
        assert_eq!(top_p_last("all > top_p(p=0.9)"), Some(("all".into(), 0.9)));
        assert_eq!(top_p_last("quest(budget=1000000) > top_p(p=1)"), None, "p = 1 keeps every candidate");
        assert_eq!(top_p_last("quest(budget=256) > top_p(p=0.9) > art()"), None);
        assert_eq!(top_p_last("quest(budget=256)"), None);
    }
}
