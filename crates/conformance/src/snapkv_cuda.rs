//! SnapKV on CUDA against the CPU engine. SnapKV decides at a prefill chunk and applies its choice at
//! decode, so a case is two calls on one cache: a prefill call where every sequence's last chunk of
//! `Q` tokens is attended (SnapKV chooses from its last `window` queries), then a decode call whose rows
//! are each sequence's last query again (same position, same length). Both engines see the same fixture;
//! the GPU must visit exactly the CPU's positions at decode (which checks the choice through the kept
//! bits of the visible range, and the plan), count the same statistics, and produce outputs within the
//! dense tolerances of the CPU's.

use super::cuda::{view, DeviceCase};
use super::fixture::{run_on_engine, Fixture, Outputs};
use super::hostbuf::HostBuf;
use super::reference::{max_abs_err, rel_err};
use super::sparse_cuda::{cfg_for, compare_counters, compare_visits, sorted, sync, SparseResult};
use super::{tolerance, CaseSpec};
use kvsparse::cuda::context::DevBuf;
use kvsparse::engine::{Engine, ForwardArgs};
use kvsparse::error::Result;
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

/// Runs the prefill-then-decode case of `policy` (a `snapkv` pipeline) on fixture `spec` (see
/// [`snapkv_spec`]) on the CPU and on CUDA device 0, and compares the decode calls.
pub fn run_snapkv_case(spec: &CaseSpec, policy: &str, seed: u64) -> SparseResult {
    // Key metadata is not compared here (the CPU keeps none for SnapKV; sparse_cuda covers the others).
    let mut res = SparseResult { meta_equal: true, ..SparseResult::new(spec, policy, seed) };
    let mut f = Fixture::new(spec, seed);
    let run = |res: &mut SparseResult, f: &mut Fixture| -> Result<()> {
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
        res.decision_mismatch = compare_visits(&v_cpu, &v_gpu);
        res.counters_mismatch = compare_counters(&c_cpu, &c_gpu);
        let (oc, lc) = so_cpu.to_f64();
        let (og, lg) = so_gpu.to_f64();
        res.rel_err = rel_err(&og, &oc);
        res.lse_err = max_abs_err(&lg, &lc);
        let (tol_o, tol_l) = tolerance(spec.dtype);
        res.pass = res.rows > 0 && res.decision_mismatch.is_none() && res.counters_mismatch.is_none() && res.rel_err <= tol_o && res.lse_err <= tol_l;
        Ok(())
    };
    if let Err(e) = run(&mut res, &mut f) {
        res.error = Some(e.to_string());
        res.pass = false;
    }
    res
}
