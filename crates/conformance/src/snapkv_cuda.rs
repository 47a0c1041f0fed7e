//! SnapKV on CUDA against the CPU engine. SnapKV decides at a prefill chunk and applies its choice at
//! decode, so a case is two calls on one cache: a prefill call where every sequence's last chunk of
//! `Q` tokens is attended (SnapKV chooses from its last `window` queries), then a decode call whose rows
//! are each sequence's last query again (same position, same length). Both engines see the same fixture.
//! The decisions are checked by the agreement contract (`snapkv_agree`): where the GPU's visited positions
//! differ from the CPU's, every differing position must lie within delta of the choice's boundary (with
//! top-p behind SnapKV, a differing row needs a borderline SnapKV position); rows that agree must count
//! the same statistics; outputs stay within the dense tolerances of the CPU's, or, for a row whose set
//! differs, of the f64 attention over the GPU's own set.

use super::cuda::{view, DeviceCase};
use super::fixture::{run_on_engine, Fixture, Outputs};
use super::hostbuf::HostBuf;
use super::reference::{max_abs_err, rel_err};
use super::refresh_agree::{check_row, positions, Agreement};
use super::snapkv_agree::{borderline, snap_reference, SnapParams};
use super::sparse_cuda::{cfg_for, compare_counters, compare_visits, sorted, sync, SparseResult};
use super::{tolerance, CaseSpec};
use kvsparse::cuda::context::DevBuf;
use kvsparse::engine::{Engine, ForwardArgs};
use kvsparse::error::Result;
use kvsparse::policy::top_p;
use kvsparse::stats::{Counters, VisitRecord};
use kvsparse::tensor::{DType, Device, TensorRef};

/// SnapKV settings that exercise each branch: the window shorter than the chunk and longer than it,
/// no pooling and wide pooling, budgets below and above some sequences' lengths, and top-p after it.
pub fn snapkv_policies() -> Vec<&'static str> {
    vec!["snapkv(budget=256)", "snapkv(budget=64, window=16, pool=5)", "snapkv(budget=512, window=64, pool=1)", "snapkv(budget=128, window=8, pool=31) > top_p(p=0.9)"]
}

/// Tokens of each sequence's last prefill chunk.
pub const SNAP_CHUNK: usize = 24;

/// `spec` with its sequences turned into prefill chunks of [`SNAP_CHUNK`] tokens (lengths kept, at least
/// the chunk), the shape a SnapKV case needs.
pub fn snapkv_spec(spec: &CaseSpec) -> CaseSpec {
    let mut s = spec.clone();
    s.seqs = spec.seqs.iter().map(|&(_, l)| (SNAP_CHUNK, l.max(SNAP_CHUNK))).collect();
    s
}

fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Decode-call outputs `[seqs, q_heads, dim]` and LSE `[seqs, q_heads]`, NaN-poisoned.
struct StepOut {
    out: HostBuf,
    lse: Vec<f32>,
}

impl StepOut {
    fn new(f: &Fixture) -> Self {
        let (ns, hq, d) = (f.spec.seqs.len(), f.spec.num_q_heads, f.spec.head_dim);
        StepOut { out: HostBuf::nans(f.spec.dtype, ns * hq * d), lse: vec![f32::NAN; ns * hq] }
    }
    fn to_f64(&self) -> (Vec<f64>, Vec<f64>) {
        ((0..self.out.len()).map(|i| self.out.get(i)).collect(), self.lse.iter().map(|&x| x as f64).collect())
    }
}

/// The decode call's arguments over tensors `q`/`out`/`lse` (host or device views) and the fixture's
/// cache, table and lengths (the same `device`).
#[allow(clippy::too_many_arguments)]
fn step_args(f: &Fixture, query: TensorRef, caches: (TensorRef, TensorRef), table: TensorRef, lens: TensorRef, qsl: TensorRef, ids: TensorRef, out: TensorRef, lse: TensorRef) -> ForwardArgs {
    let s = &f.spec;
    ForwardArgs {
        layer: 0,
        query,
        key_cache: caches.0,
        value_cache: caches.1,
        block_table: table,
        seq_lens: lens,
        query_start_loc: qsl,
        seq_ids: Some(ids),
        out,
        lse: Some(lse),
        scale: f.scale,
        sliding_window: s.window as i32,
        softcap: s.softcap,
        max_query_len: 1,
        max_seq_len: s.seqs.iter().map(|&(_, l)| l).max().unwrap_or(0) as i32,
        stream: std::ptr::null_mut(),
    }
}

/// The decode rows whose visited positions differ: agreement over all of them, and per such row its
/// (sequence, KV head) and the GPU's positions.
struct Differing {
    agree: Agreement,
    rows: Vec<(usize, usize, Vec<usize>)>,
}

/// Checks the GPU's decode plans against the CPU's by the agreement contract (module doc).
fn agreement(f: &Fixture, policy: &str, cpu: &[VisitRecord], gpu: &[VisitRecord]) -> Differing {
    let mut out = Differing { agree: Agreement::default(), rows: Vec::new() };
    if cpu.len() != gpu.len() || cpu.iter().zip(gpu).any(|(a, b)| (a.seq_id, a.kv_head) != (b.seq_id, b.kv_head)) {
        out.agree.violation = compare_visits(cpu, gpu);
        return out;
    }
    let Some(p) = SnapParams::parse(policy) else {
        out.agree.violation = Some(format!("{policy}: not a snapkv(...) policy"));
        return out;
    };
    let cache = f.written_cache();
    let behind = policy.contains("top_p");
    for (a, b) in cpu.iter().zip(gpu) {
        if a.spans == b.spans {
            continue;
        }
        let what = format!("seq {} head {}", a.seq_id, a.kv_head);
        let Some(s) = f.seq_ids.iter().position(|&id| id as u64 == a.seq_id) else {
            out.agree.violation.get_or_insert(format!("{what}: unknown sequence id"));
            continue;
        };
        let (c, g) = (positions(a), positions(b));
        let len = f.seq_lens[s] as usize;
        let lo = if f.spec.window > 0 { len.saturating_sub(f.spec.window) } else { 0 };
        let row = match snap_reference(f, &cache, s, a.kv_head, &p) {
            None => Agreement { differing: 1, violation: Some(format!("{what}: the sets differ where the choice keeps every position")), ..Default::default() },
            Some((rf, k)) if behind => {
                // Top-p behind SnapKV: a swapped candidate moves top-p's masses, so the row may differ
                // beyond the swap, but only where SnapKV's choice has a borderline position, and every
                // prefix position the GPU visits must be one SnapKV could keep (within delta of the top k).
                let near = borderline(&rf, k);
                let differing = c.iter().filter(|x| !g.contains(x)).count() + g.iter().filter(|x| !c.contains(x)).count();
                let mut sorted = rf.pooled.clone();
                sorted.sort_by(|x, y| y.total_cmp(x));
                let b = sorted.get(k.max(1) - 1).copied().unwrap_or(0.0);
                let outside = g.iter().find(|&&p| p <= rf.hi && rf.pooled[p] < b * (1.0 - rf.delta));
                let violation = if near == 0 {
                    Some(format!("{what}: top-p's set differs and no SnapKV position is within delta {:.3e} of the boundary", rf.delta))
                } else {
                    outside.map(|&p| format!("{what}: the GPU visits position {p} (reference {:.6e}), below SnapKV's boundary {b:.6e} by more than delta {:.3e}", rf.pooled[p], rf.delta))
                };
                Agreement { differing, violation, ..Default::default() }
            }
            Some((rf, _)) => check_row(&c, &g, lo, Some(&rf), &what),
        };
        out.agree.merge(&row);
        out.rows.push((s, a.kv_head, g));
    }
    out
}

/// Counters that do not depend on which positions a row visits (compared where the sets differ).
fn compare_set_free_counters(c: &Counters, g: &Counters) -> Option<String> {
    let strip = |x: &Counters| {
        let mut s = Counters { blocks_visited: 0, kv_bytes_read: 0, ..*x };
        (s[top_p::CANDIDATES], s[top_p::KEPT]) = (0, 0);
        s
    };
    compare_counters(&strip(c), &strip(g))
}

/// f64 attention of KV head `h`'s query rows of the decode call (sequence `s`'s last prefill query) over
/// the positions `set`: outputs [group, d] and LSEs [group].
fn attend_over(f: &Fixture, cache: &HostBuf, s: usize, h: usize, set: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let sp = &f.spec;
    let (d, g, bs) = (sp.head_dim, sp.num_q_heads / sp.num_kv_heads, sp.block_size);
    let st = f.cache_strides.map(|x| x as usize);
    let row = |pos: usize, off: usize| -> Vec<f64> {
        let b = f.block_table[s * f.max_blocks + pos / bs] as usize;
        (0..d).map(|i| cache.get(off + b * st[0] + (pos % bs) * st[1] + h * st[2] + i)).collect()
    };
    let t = f.query_start_loc[s + 1] as usize - 1;
    let (scale, cap) = (f.scale as f64, sp.softcap as f64);
    let (mut out, mut lse) = (vec![0f64; g * d], vec![0f64; g]);
    for r in 0..g {
        let q: Vec<f64> = (0..d).map(|i| f.q.get(t * f.q_strides[0] as usize + (h * g + r) * d + i)).collect();
        let l: Vec<f64> = set
            .iter()
            .map(|&p| {
                let x = row(p, 0).iter().zip(&q).map(|(a, b)| a * b).sum::<f64>() * scale;
                if cap > 0.0 { cap * (x / cap).tanh() } else { x }
            })
            .collect();
        let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = l.iter().map(|&x| (x - m).exp()).sum();
        for (j, &p) in set.iter().enumerate() {
            let w = (l[j] - m).exp() / z;
            for (o, v) in out[r * d..(r + 1) * d].iter_mut().zip(row(p, f.v_offset)) {
                *o += w * v;
            }
        }
        lse[r] = m + z.ln();
    }
    (out, lse)
}

/// What a SnapKV case came to: the usual comparison, and the agreement of its decisions.
pub struct SnapResult {
    pub base: SparseResult,
    pub agree: Agreement,
}

/// Runs the prefill-then-decode case of `policy` (a `snapkv` pipeline) on fixture `spec` (see
/// [`snapkv_spec`]) on the CPU and on CUDA device 0, and compares the decode calls.
pub fn run_snapkv_case(spec: &CaseSpec, policy: &str, seed: u64) -> SnapResult {
    // Key metadata is not compared here (the CPU keeps none for SnapKV; sparse_cuda covers the others).
    let mut res = SparseResult { meta_equal: true, ..SparseResult::new(spec, policy, seed) };
    let mut agree = Agreement::default();
    let mut f = Fixture::new(spec, seed);
    let run = |res: &mut SparseResult, agree: &mut Agreement, f: &mut Fixture| -> Result<()> {
        kvsparse::ensure!(spec.seqs.iter().all(|&(q, _)| q == SNAP_CHUNK), InvalidArgument, "a SnapKV case needs chunks of {SNAP_CHUNK} tokens (snapkv_spec)");
        let (ns, hq, d) = (spec.seqs.len() as i64, spec.num_q_heads as i64, spec.head_dim as i64);
        let q_row = f.q_strides[0];
        let q_last = (SNAP_CHUNK as i64 - 1) * q_row;
        let q_strides = [SNAP_CHUNK as i64 * q_row, f.q_strides[1], f.q_strides[2]];
        let qsl: Vec<i32> = (0..=ns as i32).collect();
        let lse_strides = [hq, 1];

        // CPU: prefill (cache writes + forward), then the decode call.
        let cpu = Engine::new(cfg_for(f, policy, Device::Cpu))?;
        cpu.record_visits(true);
        run_on_engine(&cpu, f)?;
        let mut so_cpu = StepOut::new(f);
        let query = f.q.view(q_last as usize, &[ns, hq, d], &q_strides);
        let caches = (f.k_cache_view(), f.v_cache_view());
        let out = so_cpu.out.view_contiguous(&[ns, hq, d]);
        let lse = TensorRef::strided(&so_cpu.lse, 0, &[ns, hq], &lse_strides)?;
        let args = step_args(
            f,
            query,
            caches,
            TensorRef::from_slice(&f.block_table, &[ns, f.max_blocks as i64]),
            TensorRef::from_slice(&f.seq_lens, &[ns]),
            TensorRef::from_slice(&qsl, &[ns + 1]),
            TensorRef::from_slice(&f.seq_ids, &[ns]),
            out,
            lse,
        );
        cpu.attention_forward(&args)?;
        let v_cpu = sorted(cpu.take_visits());
        let c_cpu = cpu.stats().total;

        // GPU: the same two calls on device copies.
        let gpu = Engine::new(cfg_for(f, policy, Device::Cuda(0)))?;
        if f.cache_dtype().is_fp8() {
            gpu.set_kv_scales(Some(0), f.k_scale, f.v_scale)?;
        }
        gpu.record_visits(true);
        let outs = Outputs::new(f);
        let dc = DeviceCase::upload(f, &outs)?;
        gpu.cache_write(&dc.cache_write_args(f, std::ptr::null_mut())?)?;
        gpu.attention_forward(&dc.forward_args(f, &outs, std::ptr::null_mut())?)?;
        let mut so_gpu = StepOut::new(f);
        let (qsl_d, out_d, lse_d) = (DevBuf::from_host(bytes(&qsl))?, DevBuf::from_host(so_gpu.out.as_bytes())?, DevBuf::from_host(bytes(&so_gpu.lse))?);
        let (dt, es) = (spec.dtype, spec.dtype.size_bytes());
        let fw = dc.forward_args(f, &outs, std::ptr::null_mut())?;
        let args = step_args(
            f,
            view(&dc.q, q_last as usize * es, dt, &[ns, hq, d], &q_strides)?,
            (fw.key_cache, fw.value_cache),
            fw.block_table,
            fw.seq_lens,
            view(&qsl_d, 0, DType::I32, &[ns + 1], &[1])?,
            fw.seq_ids.expect("fixture ids"),
            view(&out_d, 0, dt, &[ns, hq, d], &[hq * d, d, 1])?,
            view(&lse_d, 0, DType::F32, &[ns, hq], &lse_strides)?,
        );
        gpu.attention_forward(&args)?;
        sync()?;
        // SAFETY: the host buffers hold exactly the device buffers' bytes.
        unsafe {
            out_d.download(0, std::slice::from_raw_parts_mut(so_gpu.out.as_mut_ptr(), so_gpu.out.as_bytes().len()))?;
            lse_d.download(0, std::slice::from_raw_parts_mut(so_gpu.lse.as_mut_ptr() as *mut u8, so_gpu.lse.len() * 4))?;
        }
        let v_gpu = sorted(gpu.take_visits());
        let c_gpu = gpu.stats().total;

        res.rows = v_cpu.len();
        let diff = agreement(f, policy, &v_cpu, &v_gpu);
        res.decision_mismatch = diff.agree.violation.clone();
        res.counters_mismatch = if diff.rows.is_empty() { compare_counters(&c_cpu, &c_gpu) } else { compare_set_free_counters(&c_cpu, &c_gpu) };
        let (mut oc, mut lc) = so_cpu.to_f64();
        let (og, lg) = so_gpu.to_f64();
        // A row whose set differs is compared with the f64 attention over the GPU's own set.
        let cache = f.written_cache();
        let (hq, d, g) = (spec.num_q_heads, spec.head_dim, spec.num_q_heads / spec.num_kv_heads);
        for (s, h, set) in &diff.rows {
            let (o, l) = attend_over(f, &cache, *s, *h, set);
            let at = (s * hq + h * g) * d;
            oc[at..at + g * d].copy_from_slice(&o);
            lc[s * hq + h * g..s * hq + h * g + g].copy_from_slice(&l);
        }
        *agree = diff.agree;
        res.rel_err = rel_err(&og, &oc);
        res.lse_err = max_abs_err(&lg, &lc);
        let (tol_o, tol_l) = tolerance(spec.dtype);
        res.pass = res.rows > 0 && res.decision_mismatch.is_none() && res.counters_mismatch.is_none() && res.rel_err <= tol_o && res.lse_err <= tol_l;
        Ok(())
    };
    if let Err(e) = run(&mut res, &mut agree, &mut f) {
        res.error = Some(e.to_string());
        res.pass = false;
    }
    SnapResult { base: res, agree }
}
