//! PRR (`speculate(over=quest(...))`) on CUDA against the CPU engine over several calls: a prefill call
//! (each sequence's last chunk; PRR calibrates there), then decode steps that each write one new token per
//! sequence with `cache_write` and attend it. Both engines get the same inputs; after every call the GPU
//! must report the CPU's visit records (speculated + repaired pages, i.e. what each row read), the same
//! cumulative counters (the dense ones and spec_* predicted / true / hit / repaired / reuse-hit /
//! calibrations), and outputs and LSEs within the dense tolerances. Queries drift slowly between steps (a
//! fixed base plus noise) so predictions partly hit and partly miss, exercising the repair.

use super::cuda::view;
use super::hostbuf::HostBuf;
use super::reference::{max_abs_err, rel_err};
use super::sparse_cuda::{compare_counters, compare_visits, sorted, sync};
use super::{tolerance, CaseSpec};
use kvsparse::cuda::context::DevBuf;
use kvsparse::engine::{CacheWriteArgs, Engine, ForwardArgs};
use kvsparse::error::Result;
use kvsparse::policy::speculate;
use kvsparse::rng::Rng;
use kvsparse::stats::{Counters, VisitRecord};
use kvsparse::tensor::{DType, Device, TensorRef};

/// PRR settings: fixed parameters (pages equal to, smaller and larger than blocks, a sink, a speculation
/// budget below and above Quest's), partly and fully calibrated parameters.
pub fn prr_policies() -> Vec<&'static str> {
    vec![
        "speculate(over=quest(budget=128), alpha=0.5, beta=0.1, gamma=1)",
        "speculate(over=quest(budget=96, page=8, sink=16), budget=64, alpha=0.3, beta=0.2, gamma=0.5)",
        "speculate(over=quest(budget=256, page=32), budget=512, alpha=0.8, beta=0, gamma=1.5)",
        "speculate(over=quest(budget=64, page=4), alpha=auto, beta=0.1, gamma=auto)",
        "speculate(over=quest(budget=128))",
    ]
}

/// Result of one multi-call case.
#[derive(Clone, Debug)]
pub struct PrrResult {
    pub name: String,
    pub policy: String,
    pub seed: u64,
    /// Calls compared (prefill + decode steps) and decode rows (sequence, KV head) compared over them.
    pub calls: usize,
    pub rows: usize,
    pub decision_mismatch: Option<String>,
    pub counters_mismatch: Option<String>,
    pub rel_err: f64,
    pub lse_err: f64,
    /// The CPU's final spec counters (predicted, true, hit, repaired pages), to show what was exercised.
    pub spec: [u64; 4],
    pub pass: bool,
    pub error: Option<String>,
}

/// Counters both engines must agree on: the dense ones and PRR's.
pub fn compare_prr_counters(c: &Counters, g: &Counters) -> Option<String> {
    let pick = |x: &Counters| [x[speculate::PREDICTED_BLOCKS], x[speculate::TRUE_BLOCKS], x[speculate::HIT_BLOCKS], x[speculate::REPAIRED_BLOCKS], x[speculate::REUSE_HIT_BLOCKS], x[speculate::CALIBRATIONS]];
    let names = ["spec_predicted_blocks", "spec_true_blocks", "spec_hit_blocks", "spec_repaired_blocks", "spec_reuse_hit_blocks", "spec_calibrations"];
    let (a, b) = (pick(c), pick(g));
    let mut diffs: Vec<String> = (0..a.len()).filter(|&i| a[i] != b[i]).map(|i| format!("{} CPU {} GPU {}", names[i], a[i], b[i])).collect();
    if let Some(d) = compare_counters(c, g) {
        diffs.push(d);
    }
    (!diffs.is_empty()).then(|| diffs.join(", "))
}

fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slice viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// One call's inputs (host copies).
struct Call {
    /// New K/V rows `[n, hk, d]` and their slots (n may be 0).
    k: HostBuf,
    v: HostBuf,
    slots: Vec<i64>,
    /// Queries `[tokens, hq, d]`, lengths, query starts.
    q: HostBuf,
    lens: Vec<i32>,
    qsl: Vec<i32>,
    max_q: i32,
    /// false: the call only writes the cache (no forward; its output is empty).
    forward: bool,
}

/// An engine with its cache (host memory for the CPU, device memory for CUDA).
enum Side {
    Cpu(Engine, HostBuf),
    Gpu(Engine, DevBuf),
}

struct Geo {
    dtype: DType,
    /// The caches' dtype (the spec's `cache_dtype`, else `dtype`).
    cache: DType,
    hq: usize,
    hk: usize,
    d: usize,
    bs: usize,
    nb: usize,
    window: usize,
    softcap: f32,
    max_blocks: usize,
}

impl Geo {
    fn cache_len(&self) -> usize {
        self.nb * self.bs * self.hk * self.d
    }
    fn shape(&self) -> ([i64; 4], [i64; 4]) {
        let (nb, bs, hk, d) = (self.nb as i64, self.bs as i64, self.hk as i64, self.d as i64);
        ([nb, bs, hk, d], [bs * hk * d, hk * d, d, 1])
    }
}

impl Side {
    fn engine(&self) -> &Engine {
        match self {
            Side::Cpu(e, _) | Side::Gpu(e, _) => e,
        }
    }

    /// The call's cache write (if any) then its forward; returns the output and LSE.
    fn run(&mut self, g: &Geo, c: &Call, table: &[i32], ids: &[i64], scale: f32) -> Result<(HostBuf, Vec<f32>)> {
        let (hq, hk, d) = (g.hq as i64, g.hk as i64, g.d as i64);
        let n = c.slots.len() as i64;
        let t = c.q.len() as i64 / (hq * d);
        let ns = c.lens.len() as i64;
        let (shape, st) = g.shape();
        let mut out = HostBuf::nans(g.dtype, (t * hq * d) as usize);
        let mut lse = vec![f32::NAN; (t * hq) as usize];
        let fwd = |q: TensorRef, kc: TensorRef, vc: TensorRef, bt: TensorRef, sl: TensorRef, qs: TensorRef, id: TensorRef, o: TensorRef, l: TensorRef| ForwardArgs {
            layer: 0,
            query: q,
            key_cache: kc,
            value_cache: vc,
            block_table: bt,
            seq_lens: sl,
            query_start_loc: qs,
            seq_ids: Some(id),
            out: o,
            lse: Some(l),
            scale,
            sliding_window: g.window as i32,
            softcap: g.softcap,
            max_query_len: c.max_q,
            max_seq_len: c.lens.iter().copied().max().unwrap_or(0),
            stream: std::ptr::null_mut(),
        };
        match self {
            Side::Cpu(e, cache) => {
                let mut kb = c.k.clone();
                let mut vb = c.v.clone();
                let kc = cache.view(0, &shape, &st);
                let vc = cache.view(g.cache_len(), &shape, &st);
                if n > 0 {
                    e.cache_write(&CacheWriteArgs {
                        layer: 0,
                        key: kb.view_contiguous(&[n, hk, d]),
                        value: vb.view_contiguous(&[n, hk, d]),
                        key_cache: kc,
                        value_cache: vc,
                        slot_mapping: TensorRef::from_slice(&c.slots, &[n]),
                        stream: std::ptr::null_mut(),
                    })?;
                }
                let mut qb = c.q.clone();
                let args = fwd(
                    qb.view_contiguous(&[t, hq, d]),
                    kc,
                    vc,
                    TensorRef::from_slice(table, &[ns, g.max_blocks as i64]),
                    TensorRef::from_slice(&c.lens, &[ns]),
                    TensorRef::from_slice(&c.qsl, &[ns + 1]),
                    TensorRef::from_slice(ids, &[ns]),
                    out.view_contiguous(&[t, hq, d]),
                    TensorRef::from_slice(&lse, &[t, hq]),
                );
                if c.forward {
                    e.attention_forward(&args)?;
                }
            }
            Side::Gpu(e, cache) => {
                let es = g.cache.size_bytes();
                let kc = view(cache, 0, g.cache, &shape, &st)?;
                let vc = view(cache, g.cache_len() * es, g.cache, &shape, &st)?;
                // Kept alive until the device is synchronized below.
                let (kd, vd, sd) = (DevBuf::from_host(c.k.as_bytes())?, DevBuf::from_host(c.v.as_bytes())?, DevBuf::from_host(bytes(&c.slots))?);
                if n > 0 {
                    e.cache_write(&CacheWriteArgs {
                        layer: 0,
                        key: view(&kd, 0, g.dtype, &[n, hk, d], &[hk * d, d, 1])?,
                        value: view(&vd, 0, g.dtype, &[n, hk, d], &[hk * d, d, 1])?,
                        key_cache: kc,
                        value_cache: vc,
                        slot_mapping: view(&sd, 0, DType::I64, &[n], &[1])?,
                        stream: std::ptr::null_mut(),
                    })?;
                }
                let (qd, bt, sl, qs, idd) =
                    (DevBuf::from_host(c.q.as_bytes())?, DevBuf::from_host(bytes(table))?, DevBuf::from_host(bytes(&c.lens))?, DevBuf::from_host(bytes(&c.qsl))?, DevBuf::from_host(bytes(ids))?);
                let (od, ld) = (DevBuf::from_host(out.as_bytes())?, DevBuf::from_host(bytes(&lse))?);
                let args = fwd(
                    view(&qd, 0, g.dtype, &[t, hq, d], &[hq * d, d, 1])?,
                    kc,
                    vc,
                    view(&bt, 0, DType::I32, &[ns, g.max_blocks as i64], &[g.max_blocks as i64, 1])?,
                    view(&sl, 0, DType::I32, &[ns], &[1])?,
                    view(&qs, 0, DType::I32, &[ns + 1], &[1])?,
                    view(&idd, 0, DType::I64, &[ns], &[1])?,
                    view(&od, 0, g.dtype, &[t, hq, d], &[hq * d, d, 1])?,
                    view(&ld, 0, DType::F32, &[t, hq], &[hq, 1])?,
                );
                if c.forward {
                    e.attention_forward(&args)?;
                }
                sync()?;
                // SAFETY: the host buffers hold exactly the device buffers' bytes.
                unsafe {
                    od.download(0, std::slice::from_raw_parts_mut(out.as_mut_ptr(), out.as_bytes().len()))?;
                    ld.download(0, std::slice::from_raw_parts_mut(lse.as_mut_ptr() as *mut u8, lse.len() * 4))?;
                }
            }
        }
        Ok((out, lse))
    }
}

/// A case's inputs: geometry, calls (prefill then decode steps), block table, ids, scale.
struct CaseInputs {
    g: Geo,
    calls: Vec<Call>,
    table: Vec<i32>,
    ids: Vec<i64>,
    scale: f32,
}

/// `prefill`: call 0 writes the prefix and runs a prefill chunk over its last tokens (PRR calibrates
/// there); without it, call 0 only writes the cache and the first decode step is the sequences' first
/// forward (no calibration: the spec's fixed or default Holt parameters, every page unseen).
fn build_case(spec: &CaseSpec, steps: usize, seed: u64, prefill: bool) -> CaseInputs {
    let mut rng = Rng::new(seed);
    let (hq, hk, d, bs) = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.block_size);
    let lens: Vec<usize> = spec.seqs.iter().map(|&(_, l)| l.max(1)).collect();
    let ns = lens.len();
    let max_blocks = lens.iter().map(|&l| (l + steps).div_ceil(bs)).max().unwrap_or(1);
    let total: usize = lens.iter().map(|&l| (l + steps).div_ceil(bs)).sum();
    let nb = total + 3;
    let mut perm: Vec<i32> = (0..nb as i32).collect();
    rng.shuffle(&mut perm);
    let mut table = vec![-1i32; ns * max_blocks];
    let mut next = 0;
    for (s, &l) in lens.iter().enumerate() {
        for b in 0..(l + steps).div_ceil(bs) {
            table[s * max_blocks + b] = perm[next];
            next += 1;
        }
    }
    let g = Geo { dtype: spec.dtype, cache: spec.cache_dtype.unwrap_or(spec.dtype), hq, hk, d, bs, nb, window: spec.window, softcap: spec.softcap, max_blocks };
    let ids: Vec<i64> = (0..ns as i64).map(|s| 1000 + 7 * s).collect();
    let scale = 1.0 / (d as f32).sqrt();
    // Per-sequence base queries; a query at a position is its base plus noise.
    let base: Vec<Vec<f64>> = (0..ns).map(|_| (0..hq * d).map(|_| 2.0 * rng.uniform() - 1.0).collect()).collect();
    let slot = |s: usize, p: usize| table[s * max_blocks + p / bs] as i64 * bs as i64 + (p % bs) as i64;
    let rows = |rng: &mut Rng, which: &[(usize, usize)]| -> (HostBuf, HostBuf, Vec<i64>) {
        let mut k = HostBuf::zeros(g.dtype, which.len() * hk * d);
        let mut v = HostBuf::zeros(g.dtype, which.len() * hk * d);
        for i in 0..which.len() * hk * d {
            k.set(i, 2.0 * rng.uniform() - 1.0);
            v.set(i, 2.0 * rng.uniform() - 1.0);
        }
        (k, v, which.iter().map(|&(s, p)| slot(s, p)).collect())
    };
    let queries = |rng: &mut Rng, which: &[(usize, usize)]| -> HostBuf {
        let mut q = HostBuf::zeros(g.dtype, which.len() * hq * d);
        for (r, &(s, _)) in which.iter().enumerate() {
            for i in 0..hq * d {
                q.set(r * hq * d + i, base[s][i] + 0.6 * (2.0 * rng.uniform() - 1.0));
            }
        }
        q
    };
    let mut calls: Vec<Call> = Vec::new();
    // Call 0: the prefix (no forward is made for it: written together with the chunk).
    let chunk: Vec<usize> = lens.iter().map(|&l| l.min(24)).collect();
    let mut written: Vec<(usize, usize)> = Vec::new();
    for (s, &l) in lens.iter().enumerate() {
        written.extend((0..l).map(|p| (s, p)));
    }
    let (k, v, slots) = rows(&mut rng, &written);
    let qrows: Vec<(usize, usize)> = lens.iter().enumerate().flat_map(|(s, &l)| (l - chunk[s]..l).map(move |p| (s, p))).collect();
    let q = queries(&mut rng, &qrows);
    let mut qsl = vec![0i32];
    for &c in &chunk {
        qsl.push(qsl.last().unwrap() + c as i32);
    }
    calls.push(Call { k, v, slots, q, lens: lens.iter().map(|&l| l as i32).collect(), qsl, max_q: chunk.iter().copied().max().unwrap_or(1) as i32, forward: prefill });
    for j in 0..steps {
        let which: Vec<(usize, usize)> = lens.iter().enumerate().map(|(s, &l)| (s, l + j)).collect();
        let (k, v, slots) = rows(&mut rng, &which);
        let q = queries(&mut rng, &which);
        calls.push(Call { k, v, slots, q, lens: lens.iter().map(|&l| (l + j + 1) as i32).collect(), qsl: (0..=ns as i32).collect(), max_q: 1, forward: true });
    }

    CaseInputs { g, calls, table, ids, scale }
}

/// An FP8 cache's (k_scale, v_scale): the rows are uniform in [-1, 1], so |x| / scale stays below E4M3's
/// largest value (448).
const FP8_SCALES: (f32, f32) = (1.0 / 320.0, 1.0 / 288.0);

fn engine_for(spec: &CaseSpec, policy: &str, dev: Device) -> Result<Engine> {
    let mut cfg = kvsparse::EngineConfig::new(1, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype);
    cfg.policy = format!("{policy}; dense_layers=0");
    cfg.device = dev;
    cfg.num_threads = 2;
    cfg.cache_dtype = spec.cache_dtype.unwrap_or(spec.dtype);
    let e = Engine::new(cfg)?;
    if fp8_cache(spec) {
        e.set_kv_scales(Some(0), FP8_SCALES.0, FP8_SCALES.1)?;
    }
    Ok(e)
}

fn fp8_cache(spec: &CaseSpec) -> bool {
    spec.cache_dtype.is_some_and(|d| d.is_fp8())
}

/// The case on the CPU engine alone (no GPU needed): its final counters. Tests use it to check that a
/// case exercises what the GPU comparison relies on (misses and repairs, calibration).
pub fn run_prr_cpu(spec: &CaseSpec, policy: &str, steps: usize, seed: u64) -> Result<Counters> {
    let ci = build_case(spec, steps, seed, true);
    let e = engine_for(spec, policy, Device::Cpu)?;
    let mut cpu = Side::Cpu(e, HostBuf::zeros(ci.g.cache, 2 * ci.g.cache_len()));
    for c in &ci.calls {
        cpu.run(&ci.g, c, &ci.table, &ci.ids, ci.scale)?;
    }
    Ok(cpu.engine().stats().total)
}

/// Runs `policy` on the geometry of `spec` (its dtype, heads, block size, window, soft-cap; the
/// sequences' lengths after prefill are `spec.seqs`' lengths): a prefill call of each sequence's last
/// `min(len, 24)` tokens, then `steps` decode steps, on the CPU engine and on CUDA device 0.
pub fn run_prr_case(spec: &CaseSpec, policy: &str, steps: usize, seed: u64) -> PrrResult {
    run_prr_case_with(spec, policy, steps, seed, true)
}

/// As [`run_prr_case`]; `prefill = false` writes the prefix without a forward call, so the decode steps
/// start with no calibration and every page unseen (a sequence whose first call through the engine is a
/// decode step).
pub fn run_prr_case_with(spec: &CaseSpec, policy: &str, steps: usize, seed: u64, prefill: bool) -> PrrResult {
    let mut res = PrrResult {
        name: spec.name.clone(),
        policy: policy.to_string(),
        seed,
        calls: 0,
        rows: 0,
        decision_mismatch: None,
        counters_mismatch: None,
        rel_err: 0.0,
        lse_err: 0.0,
        spec: [0; 4],
        pass: false,
        error: None,
    };
    let run = |res: &mut PrrResult| -> Result<()> {
        let CaseInputs { g, calls, table, ids, scale } = build_case(spec, steps, seed, prefill);
        let cpu_e = engine_for(spec, policy, Device::Cpu)?;
        cpu_e.record_visits(true);
        let gpu_e = engine_for(spec, policy, Device::Cuda(0))?;
        gpu_e.record_visits(true);
        let mut cpu = Side::Cpu(cpu_e, HostBuf::zeros(g.cache, 2 * g.cache_len()));
        let mut gpu = Side::Gpu(gpu_e, DevBuf::from_host(HostBuf::zeros(g.cache, 2 * g.cache_len()).as_bytes())?);
        let (tol_o, tol_l) = tolerance(spec.dtype);
        for (i, c) in calls.iter().enumerate() {
            let (oc, lc) = cpu.run(&g, c, &table, &ids, scale)?;
            let (og, lg) = gpu.run(&g, c, &table, &ids, scale)?;
            if !c.forward {
                continue;
            }
            let vc: Vec<VisitRecord> = sorted(cpu.engine().take_visits());
            let vg: Vec<VisitRecord> = sorted(gpu.engine().take_visits());
            let (cc, cg) = (cpu.engine().stats().total, gpu.engine().stats().total);
            res.calls += 1;
            res.rows += vc.len();
            res.spec = [cc[speculate::PREDICTED_BLOCKS], cc[speculate::TRUE_BLOCKS], cc[speculate::HIT_BLOCKS], cc[speculate::REPAIRED_BLOCKS]];
            if res.decision_mismatch.is_none() {
                res.decision_mismatch = compare_visits(&vc, &vg).map(|m| format!("call {i}: {m}"));
            }
            if res.counters_mismatch.is_none() {
                res.counters_mismatch = compare_prr_counters(&cc, &cg).map(|m| format!("call {i}: {m}"));
            }
            let f = |b: &HostBuf| (0..b.len()).map(|i| b.get(i)).collect::<Vec<f64>>();
            let l64 = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
            res.rel_err = res.rel_err.max(rel_err(&f(&og), &f(&oc)));
            res.lse_err = res.lse_err.max(max_abs_err(&l64(&lg), &l64(&lc)));
        }
        res.pass = res.rows > 0 && res.decision_mismatch.is_none() && res.counters_mismatch.is_none() && res.rel_err <= tol_o && res.lse_err <= tol_l;
        Ok(())
    };
    if let Err(e) = run(&mut res) {
        res.error = Some(e.to_string());
        res.pass = false;
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU side of the cases: every policy predicts, misses some true pages and repairs them over
    /// the decode steps, and calibrates at the prefill call (so the GPU comparison covers all of it).
    #[test]
    fn prr_cases_miss_and_repair_on_the_cpu() {
        let spec = &super::super::sparse_cuda::sparse_specs(true)[0];
        for pol in prr_policies() {
            let c = run_prr_cpu(spec, pol, 3, 11).unwrap_or_else(|e| panic!("{pol}: {e}"));
            println!(
                "{pol}: predicted {} true {} hit {} repaired {} reuse {} calibrations {}",
                c[speculate::PREDICTED_BLOCKS], c[speculate::TRUE_BLOCKS], c[speculate::HIT_BLOCKS], c[speculate::REPAIRED_BLOCKS], c[speculate::REUSE_HIT_BLOCKS], c[speculate::CALIBRATIONS]
            );
            assert!(c[speculate::REPAIRED_BLOCKS] > 0 && c[speculate::HIT_BLOCKS] > 0, "{pol}: {c:?}");
            assert_eq!(c[speculate::CALIBRATIONS] as usize, 6 * spec.num_kv_heads - spec.num_kv_heads, "{pol}: one per (prefill sequence, KV head)");
        }
    }
}
