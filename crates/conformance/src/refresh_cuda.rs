//! RefreshKV on CUDA against the CPU engine, over several steps: one cache, a prefill chunk (the set's
//! seed), then decode steps that each write one new token per sequence through `cache_write` and attend,
//! with queries that drift (a new direction every few steps) so that both full and partial steps occur.
//! Both engines see the same calls; at every step the GPU's sets must agree with the CPU's by the
//! agreement contract (`refresh_agree`: every differing position borderline, within the stated margin of
//! the boundary), and in the end count the same statistics (blocks visited excepted where sets differ);
//! outputs stay within the dense tolerances of the CPU reference over the GPU's own set (the CPU engine's
//! outputs, where the sets are equal; a step whose sets differ is checked by the dense tolerance against
//! the CPU's attention over the GPU's positions, `attend_over`). Variants: a sequence
//! never seen at prefill, a sequence released whose id is replaced by a new one (a reused slot starts
//! fresh), `max_seqs` exhausted (the sequence without a slot runs dense, checked against a dense CPU
//! engine), and a decode step captured in a CUDA graph and replayed step after step against eager runs.

use super::cuda::view;
use super::hostbuf::HostBuf;
use super::reference::{attend_rows, max_abs_err, rel_err};
use super::refresh_agree::{check_row, positions, query_row, reference, RefScores, RowInputs, ScheduleMirror};
use super::sparse_cuda::{compare_counters, compare_visits, sorted, sync};
use std::collections::HashMap;
use super::{tolerance, CaseSpec};
use kvsparse::cuda::context::DevBuf;
use kvsparse::cuda::driver::{self, check, cuda, CUstream};
use kvsparse::engine::{CacheWriteArgs, Engine, ForwardArgs};
use kvsparse::error::Result;
use kvsparse::policy::refresh;
use kvsparse::rng::Rng;
use kvsparse::stats::{Counters, VisitRecord};
use kvsparse::tensor::{DType, Device, TensorRef};

/// Settings that reach every branch: the similarity check at every step and every other step, a fixed
/// schedule, wide and no pooling, a set larger than every row (lossless), the paper's defaults.
pub fn refresh_policies() -> Vec<&'static str> {
    vec!["refresh(k=64, stride=1, s=0.9)", "refresh(k=200, stride=2, s=0.5, pool=3)", "refresh(k=32, every=3, pool=1)", "refresh(k=4096, stride=1, s=0.95)", "refresh(k=256)"]
}

/// Query tokens of each sequence's prefill chunk.
pub const REFRESH_CHUNK: usize = 24;

/// Which lifecycle events a run exercises.
#[derive(Clone, Copy, Debug, Default)]
pub struct Variant {
    /// The last sequence skips the prefill call (its first decode step is full).
    pub unseen: bool,
    /// After this many steps the first sequence is released and its id replaced by a new one.
    pub release_at: Option<usize>,
    /// The GPU engine's `max_seqs` (the unseen sequence finds no slot when it is the prefill's count).
    pub max_seqs: Option<usize>,
}

/// Result of one multi-step run.
#[derive(Clone, Debug, Default)]
pub struct RefreshResult {
    pub steps: usize,
    /// Policy rows (sequence, KV head, step) compared.
    pub rows: usize,
    pub full_steps: u64,
    pub partial_steps: u64,
    pub decision_mismatch: Option<String>,
    /// Differing positions, worst margin and the first violation (`refresh_agree`).
    pub agreement: super::refresh_agree::Agreement,
    pub counters_mismatch: Option<String>,
    pub rel_err: f64,
    pub lse_err: f64,
    pub rows_without_state: u64,
    pub pass: bool,
    pub error: Option<String>,
}

fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// The host side of a run: geometry, block table, every key/value row, every call's queries.
pub struct Work {
    pub spec: CaseSpec,
    pub ids: Vec<i64>,
    pub len0: Vec<usize>,
    pub steps: usize,
    pub nb: usize,
    pub max_blocks: usize,
    pub table: Vec<i32>,
    /// Rows of position p of sequence s at (s * cap_len + p) * hk * d.
    k_rows: HostBuf,
    v_rows: HostBuf,
    cap_len: usize,
    /// The prefill chunk's queries per sequence `[CHUNK, hq, d]`, and each step's `[ns, hq, d]`.
    q_pre: Vec<HostBuf>,
    q_step: Vec<HostBuf>,
    pub scale: f32,
    /// The caches' dtype (the spec's `cache_dtype`, else its dtype) and an FP8 cache's scales (1 otherwise).
    cache_dtype: DType,
    k_scale: f32,
    v_scale: f32,
}

impl Work {
    /// Sequences of lengths `len0` at prefill, `steps` decode steps; a new query direction every `jump`
    /// steps (per sequence, offset so that sequences switch at different steps).
    pub fn new(spec: &CaseSpec, len0: &[usize], steps: usize, jump: usize, seed: u64) -> Work {
        let (hq, hk, d, bs) = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.block_size);
        let mut rng = Rng::new(seed);
        let ns = len0.len();
        let cap_len = len0.iter().max().copied().unwrap_or(0) + steps;
        let max_blocks = cap_len.div_ceil(bs) + 1;
        let need: usize = len0.iter().map(|&l| (l + steps).div_ceil(bs)).sum();
        let nb = need + 3;
        let mut order: Vec<i32> = (0..nb as i32).collect();
        rng.shuffle(&mut order);
        let mut table = vec![-1i32; ns * max_blocks];
        let mut next = 0;
        for (s, &l) in len0.iter().enumerate() {
            for j in 0..(l + steps).div_ceil(bs) {
                table[s * max_blocks + j] = order[next];
                next += 1;
            }
        }
        let mut k_rows = HostBuf::zeros(spec.dtype, ns * cap_len * hk * d);
        let mut v_rows = HostBuf::zeros(spec.dtype, ns * cap_len * hk * d);
        for i in 0..k_rows.len() {
            k_rows.set(i, rng.normal());
            v_rows.set(i, rng.normal());
        }
        let mut base: Vec<Vec<f64>> = (0..ns).map(|_| (0..hq * d).map(|_| 2.0 * rng.normal()).collect()).collect();
        let mut q_pre = Vec::new();
        for b in &base {
            let mut q = HostBuf::zeros(spec.dtype, REFRESH_CHUNK * hq * d);
            for t in 0..REFRESH_CHUNK {
                for i in 0..hq * d {
                    q.set(t * hq * d + i, b[i] + 0.3 * rng.normal());
                }
            }
            q_pre.push(q);
        }
        let mut q_step = Vec::new();
        for t in 0..steps {
            let mut q = HostBuf::zeros(spec.dtype, ns * hq * d);
            for (s, b) in base.iter_mut().enumerate() {
                if (t + s) % jump.max(1) == jump.max(1) - 1 {
                    for x in b.iter_mut() {
                        *x = 2.0 * rng.normal();
                    }
                }
                for i in 0..hq * d {
                    q.set(s * hq * d + i, b[i] + 0.3 * rng.normal());
                }
            }
            q_step.push(q);
        }
        let d_f = d as f32;
        // Drawn last, so that a 16-bit case's data stay what they were.
        let cache_dtype = spec.cache_dtype.unwrap_or(spec.dtype);
        let (k_scale, v_scale) = if cache_dtype.is_fp8() { ((0.012 * (1.0 + rng.uniform())) as f32, (0.012 * (1.0 + rng.uniform())) as f32) } else { (1.0, 1.0) };
        Work {
            spec: spec.clone(),
            ids: (0..ns as i64).map(|i| 1000 + 7 * i).collect(),
            len0: len0.to_vec(),
            steps,
            nb,
            max_blocks,
            table,
            k_rows,
            v_rows,
            cap_len,
            q_pre,
            q_step,
            scale: 1.0 / d_f.sqrt(),
            cache_dtype,
            k_scale,
            v_scale,
        }
    }

    /// Row `p` of KV head `h` of sequence `s`, K (`v` = false) or V, as f64, as the engines read it from
    /// the cache (an FP8 cache: quantized on write, decoded times the scale).
    fn kv_row(&self, s: usize, p: usize, h: usize, v: bool) -> Vec<f64> {
        let (hk, d) = (self.spec.num_kv_heads, self.spec.head_dim);
        let (buf, scale) = if v { (&self.v_rows, self.v_scale) } else { (&self.k_rows, self.k_scale) };
        let fp8 = self.cache_dtype.is_fp8();
        (0..d)
            .map(|i| buf.get(((s * self.cap_len + p) * hk + h) * d + i))
            .map(|x| if fp8 { kvsparse::fp8::dequantize(self.cache_dtype, kvsparse::fp8::quantize(self.cache_dtype, x as f32, scale), scale) as f64 } else { x })
            .collect()
    }

    /// The f64 reference of KV head `h`'s pooled weights for sequence `s` at length `len`, query `q`.
    fn reference(&self, s: usize, q: &[f64], len: usize, h: usize, pool: usize) -> RefScores {
        let sp = &self.spec;
        let hi = len - 1;
        let lo = if sp.window > 0 { len.saturating_sub(sp.window) } else { 0 };
        let k = |p: usize, h: usize| self.kv_row(s, p, h, false);
        let inp = RowInputs { q: q.to_vec(), k: &k, scale: self.scale as f64, softcap: sp.softcap as f64, scaled_keys: self.cache_dtype.is_fp8() };
        reference(&inp, h, sp.num_q_heads / sp.num_kv_heads, sp.head_dim, lo, hi, pool)
    }

    /// f64 attention of KV head `h`'s query rows (of `q` [hq, d]) over `set` of sequence `s`: outputs
    /// [group, d] and LSEs [group].
    fn attend_over(&self, s: usize, q: &[f64], set: &[usize], h: usize) -> (Vec<f64>, Vec<f64>) {
        let sp = &self.spec;
        let (d, g) = (sp.head_dim, sp.num_q_heads / sp.num_kv_heads);
        let (ks, vs): (Vec<Vec<f64>>, Vec<Vec<f64>>) = set.iter().map(|&p| (self.kv_row(s, p, h, false), self.kv_row(s, p, h, true))).unzip();
        attend_rows(&q[h * g * d..(h + 1) * g * d], &ks, &vs, g, d, self.scale as f64, sp.softcap as f64)
    }

    fn slot(&self, s: usize, pos: usize) -> i64 {
        let bs = self.spec.block_size;
        self.table[s * self.max_blocks + pos / bs] as i64 * bs as i64 + (pos % bs) as i64
    }

    /// K and V rows `[n, hk, d]` and slots of the (sequence, position) pairs.
    fn rows(&self, which: &[(usize, usize)]) -> (HostBuf, HostBuf, Vec<i64>) {
        let hd = self.spec.num_kv_heads * self.spec.head_dim;
        let mut k = HostBuf::zeros(self.spec.dtype, which.len().max(1) * hd);
        let mut v = HostBuf::zeros(self.spec.dtype, which.len().max(1) * hd);
        for (j, &(s, p)) in which.iter().enumerate() {
            for i in 0..hd {
                k.set(j * hd + i, self.k_rows.get((s * self.cap_len + p) * hd + i));
                v.set(j * hd + i, self.v_rows.get((s * self.cap_len + p) * hd + i));
            }
        }
        (k, v, which.iter().map(|&(s, p)| self.slot(s, p)).collect())
    }
}

/// One forward call: sequences (indices into the work), their query tokens, lengths and ids.
pub struct Call {
    pub seqs: Vec<usize>,
    pub q: HostBuf,
    pub qlens: Vec<usize>,
    pub lens: Vec<usize>,
    pub ids: Vec<i64>,
}

impl Call {
    fn table(&self, w: &Work) -> Vec<i32> {
        self.seqs.iter().flat_map(|&s| w.table[s * w.max_blocks..(s + 1) * w.max_blocks].iter().copied()).collect()
    }
    fn qsl(&self) -> Vec<i32> {
        let mut v = vec![0i32];
        for &q in &self.qlens {
            v.push(v.last().copied().unwrap_or(0) + q as i32);
        }
        v
    }
    fn tokens(&self) -> usize {
        self.qlens.iter().sum()
    }
}

/// Output rows `[tokens, hq, d]` and LSE of one call, as f64.
pub struct CallOut {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub visits: Vec<VisitRecord>,
}

/// An engine and its caches (host buffers for the CPU, device buffers for CUDA).
pub enum Side {
    Cpu(Engine, HostBuf, HostBuf),
    Gpu(Engine, DevBuf, DevBuf),
}

impl Side {
    pub fn new(w: &Work, policy: &str, device: Device) -> Result<Side> {
        let s = &w.spec;
        let mut cfg = kvsparse::EngineConfig::new(1, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size, s.dtype);
        cfg.policy = if policy.is_empty() { String::new() } else if policy.contains(';') { format!("{policy}, dense_layers=0") } else { format!("{policy}; dense_layers=0") };
        cfg.device = device;
        cfg.num_threads = 2;
        cfg.cache_dtype = w.cache_dtype;
        let n = w.nb * s.block_size * s.num_kv_heads * s.head_dim;
        let e = Engine::new(cfg)?;
        if w.cache_dtype.is_fp8() {
            e.set_kv_scales(Some(0), w.k_scale, w.v_scale)?;
        }
        e.record_visits(true);
        Ok(match device {
            Device::Cpu => Side::Cpu(e, HostBuf::zeros(w.cache_dtype, n), HostBuf::zeros(w.cache_dtype, n)),
            _ => {
                let z = vec![0u8; n * w.cache_dtype.size_bytes()];
                Side::Gpu(e, DevBuf::from_host(&z)?, DevBuf::from_host(&z)?)
            }
        })
    }

    pub fn engine(&self) -> &Engine {
        match self {
            Side::Cpu(e, ..) | Side::Gpu(e, ..) => e,
        }
    }

    fn cache_shape(w: &Work) -> [i64; 4] {
        let s = &w.spec;
        [w.nb as i64, s.block_size as i64, s.num_kv_heads as i64, s.head_dim as i64]
    }

    /// Writes the rows of `which` through `cache_write`.
    pub fn write(&mut self, w: &Work, which: &[(usize, usize)]) -> Result<()> {
        let (mut k, mut v, slots) = w.rows(which);
        let (hk, d, n) = (w.spec.num_kv_heads as i64, w.spec.head_dim as i64, which.len() as i64);
        let shape = Self::cache_shape(w);
        match self {
            Side::Cpu(e, kc, vc) => {
                let a = CacheWriteArgs { layer: 0, key: k.view_contiguous(&[n, hk, d]), value: v.view_contiguous(&[n, hk, d]), key_cache: kc.view_contiguous(&shape), value_cache: vc.view_contiguous(&shape), slot_mapping: TensorRef::from_slice(&slots, &[n]), stream: std::ptr::null_mut() };
                e.cache_write(&a)
            }
            Side::Gpu(e, kc, vc) => {
                let dt = w.spec.dtype;
                let (kd, vd, sd) = (DevBuf::from_host(k.as_bytes())?, DevBuf::from_host(v.as_bytes())?, DevBuf::from_host(bytes(&slots))?);
                let st = [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1];
                let a = CacheWriteArgs {
                    layer: 0,
                    key: view(&kd, 0, dt, &[n, hk, d], &[hk * d, d, 1])?,
                    value: view(&vd, 0, dt, &[n, hk, d], &[hk * d, d, 1])?,
                    key_cache: view(kc, 0, w.cache_dtype, &shape, &st)?,
                    value_cache: view(vc, 0, w.cache_dtype, &shape, &st)?,
                    slot_mapping: view(&sd, 0, DType::I64, &[n], &[1])?,
                    stream: std::ptr::null_mut(),
                };
                e.cache_write(&a)?;
                sync()
            }
        }
    }

    /// Runs one forward call and returns its outputs and visit records.
    pub fn forward(&mut self, w: &Work, c: &Call) -> Result<CallOut> {
        let s = &w.spec;
        let (hq, d, dt) = (s.num_q_heads as i64, s.head_dim as i64, s.dtype);
        let (nt, ns, mb) = (c.tokens() as i64, c.seqs.len() as i64, w.max_blocks as i64);
        let table = c.table(w);
        let lens: Vec<i32> = c.lens.iter().map(|&l| l as i32).collect();
        let qsl = c.qsl();
        let shape = Self::cache_shape(w);
        let mut q = HostBuf::zeros(dt, c.q.len());
        for i in 0..c.q.len() {
            q.set(i, c.q.get(i));
        }
        let mut out = HostBuf::nans(dt, (nt * hq * d) as usize);
        let mut lse = vec![f32::NAN; (nt * hq) as usize];
        let mk = |query, kc, vc, bt, sl, qs, ids, o, l| ForwardArgs {
            layer: 0,
            query,
            key_cache: kc,
            value_cache: vc,
            block_table: bt,
            seq_lens: sl,
            query_start_loc: qs,
            seq_ids: Some(ids),
            out: o,
            lse: Some(l),
            scale: w.scale,
            sliding_window: s.window as i32,
            softcap: s.softcap,
            max_query_len: c.qlens.iter().max().copied().unwrap_or(0) as i32,
            max_seq_len: c.lens.iter().max().copied().unwrap_or(0) as i32,
            stream: std::ptr::null_mut(),
        };
        let e = match self {
            Side::Cpu(e, kc, vc) => {
                let a = mk(
                    q.view_contiguous(&[nt, hq, d]),
                    kc.view_contiguous(&shape),
                    vc.view_contiguous(&shape),
                    TensorRef::from_slice(&table, &[ns, mb]),
                    TensorRef::from_slice(&lens, &[ns]),
                    TensorRef::from_slice(&qsl, &[ns + 1]),
                    TensorRef::from_slice(&c.ids, &[ns]),
                    out.view_contiguous(&[nt, hq, d]),
                    TensorRef::strided(&lse, 0, &[nt, hq], &[hq, 1])?,
                );
                e.attention_forward(&a)?;
                &*e
            }
            Side::Gpu(e, kc, vc) => {
                let st = [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1];
                let (qd, td, ld, sd, id) = (DevBuf::from_host(q.as_bytes())?, DevBuf::from_host(bytes(&table))?, DevBuf::from_host(bytes(&lens))?, DevBuf::from_host(bytes(&qsl))?, DevBuf::from_host(bytes(&c.ids))?);
                let (od, lsd) = (DevBuf::from_host(out.as_bytes())?, DevBuf::from_host(bytes(&lse))?);
                let a = mk(
                    view(&qd, 0, dt, &[nt, hq, d], &[hq * d, d, 1])?,
                    view(kc, 0, w.cache_dtype, &shape, &st)?,
                    view(vc, 0, w.cache_dtype, &shape, &st)?,
                    view(&td, 0, DType::I32, &[ns, mb], &[mb, 1])?,
                    view(&ld, 0, DType::I32, &[ns], &[1])?,
                    view(&sd, 0, DType::I32, &[ns + 1], &[1])?,
                    view(&id, 0, DType::I64, &[ns], &[1])?,
                    view(&od, 0, dt, &[nt, hq, d], &[hq * d, d, 1])?,
                    view(&lsd, 0, DType::F32, &[nt, hq], &[hq, 1])?,
                );
                e.attention_forward(&a)?;
                sync()?;
                // SAFETY: the host buffers hold exactly the device buffers' bytes.
                unsafe {
                    od.download(0, std::slice::from_raw_parts_mut(out.as_mut_ptr(), out.as_bytes().len()))?;
                    lsd.download(0, std::slice::from_raw_parts_mut(lse.as_mut_ptr() as *mut u8, lse.len() * 4))?;
                }
                &*e
            }
        };
        Ok(CallOut { out: (0..out.len()).map(|i| out.get(i)).collect(), lse: lse.iter().map(|&x| x as f64).collect(), visits: sorted(e.take_visits()) })
    }

    pub fn release(&self, id: i64) -> Result<()> {
        self.engine().release_sequence(id as u64)
    }
}

/// The calls of a run, generated as the run goes (the ids change at a release).
pub struct Schedule {
    pub ids: Vec<i64>,
    pub prefill: Vec<usize>,
}

impl Schedule {
    pub fn new(w: &Work, v: &Variant) -> Schedule {
        let ns = w.ids.len();
        let prefill = if v.unseen && ns > 1 { (0..ns - 1).collect() } else { (0..ns).collect() };
        Schedule { ids: w.ids.clone(), prefill }
    }

    /// The prefill call: each prefill sequence's last CHUNK tokens.
    pub fn prefill_call(&self, w: &Work) -> Call {
        let (hq, d) = (w.spec.num_q_heads, w.spec.head_dim);
        let mut q = HostBuf::zeros(w.spec.dtype, self.prefill.len() * REFRESH_CHUNK * hq * d);
        for (j, &s) in self.prefill.iter().enumerate() {
            for i in 0..REFRESH_CHUNK * hq * d {
                q.set(j * REFRESH_CHUNK * hq * d + i, w.q_pre[s].get(i));
            }
        }
        Call { seqs: self.prefill.clone(), q, qlens: vec![REFRESH_CHUNK; self.prefill.len()], lens: self.prefill.iter().map(|&s| w.len0[s]).collect(), ids: self.prefill.iter().map(|&s| self.ids[s]).collect() }
    }

    /// Decode step `t` (0-based): every sequence at length len0 + t + 1.
    pub fn step_call(&self, w: &Work, t: usize) -> Call {
        let ns = w.ids.len();
        let mut q = HostBuf::zeros(w.spec.dtype, w.q_step[t].len());
        for i in 0..q.len() {
            q.set(i, w.q_step[t].get(i));
        }
        Call { seqs: (0..ns).collect(), q, qlens: vec![1; ns], lens: (0..ns).map(|s| w.len0[s] + t + 1).collect(), ids: self.ids.clone() }
    }
}

/// Runs the multi-step case of `policy` on geometry `spec` with sequences of `len0` tokens at prefill,
/// on the CPU and on CUDA device 0, and compares every step.
pub fn run_refresh_case(spec: &CaseSpec, policy: &str, len0: &[usize], steps: usize, v: Variant, seed: u64) -> RefreshResult {
    let mut res = RefreshResult { steps, ..Default::default() };
    let run = |res: &mut RefreshResult| -> Result<()> {
        let w = Work::new(spec, len0, steps, 3, seed);
        let gpu_policy = match v.max_seqs {
            Some(m) => format!("{policy}; max_seqs={m}"),
            None => policy.to_string(),
        };
        let mut cpu = Side::new(&w, policy, Device::Cpu)?;
        let mut gpu = Side::new(&w, &gpu_policy, Device::Cuda(0))?;
        // A dense CPU engine answers for the rows the GPU runs without state.
        let mut dense = if v.max_seqs.is_some() { Some(Side::new(&w, "", Device::Cpu)?) } else { None };
        let mut sched = Schedule::new(&w, &v);
        let ns = w.ids.len();
        let prefix: Vec<(usize, usize)> = (0..ns).flat_map(|s| (0..w.len0[s]).map(move |p| (s, p))).collect();
        for side in [Some(&mut cpu), Some(&mut gpu), dense.as_mut()].into_iter().flatten() {
            side.write(&w, &prefix)?;
        }
        let pre = sched.prefill_call(&w);
        let (oc, og) = (cpu.forward(&w, &pre)?, gpu.forward(&w, &pre)?);
        if let Some(dn) = dense.as_mut() {
            dn.forward(&w, &pre)?;
        }
        // The schedule as both engines decide it, and the reference of every set's last rebuild.
        let rp = refresh_params(policy)?;
        let mut mirror = ScheduleMirror::default();
        let mut refs: HashMap<(i64, usize), RefScores> = HashMap::new();
        for (j, &id) in pre.ids.iter().enumerate() {
            let t = (j + 1) * REFRESH_CHUNK - 1;
            let q = query_row(&pre.q, t, spec.num_q_heads, spec.head_dim);
            if mirror.decide(&rp, id, &q, spec.num_q_heads, spec.head_dim, w.scale) {
                for h in 0..spec.num_kv_heads {
                    refs.insert((id, h), w.reference(pre.seqs[j], &q, pre.lens[j], h, rp.pool));
                }
            }
        }
        let (tol_o, tol_l) = tolerance(spec.dtype);
        let (mut worst_o, mut worst_l) = (rel_err(&og.out, &oc.out), max_abs_err(&og.lse, &oc.lse));
        // Sequences the GPU runs without a slot: the unseen one when the prefill took every slot.
        let no_slot: Vec<i64> = match v.max_seqs {
            Some(m) if v.unseen && m == sched.prefill.len() => vec![w.ids[ns - 1]],
            _ => Vec::new(),
        };
        let mut next_id = 5000i64;
        for t in 0..steps {
            if v.release_at == Some(t) {
                let old = sched.ids[0];
                cpu.release(old)?;
                gpu.release(old)?;
                mirror.forget(old);
                refs.retain(|k, _| k.0 != old);
                sched.ids[0] = next_id;
                next_id += 1;
            }
            let step: Vec<(usize, usize)> = (0..ns).map(|s| (s, w.len0[s] + t)).collect();
            for side in [Some(&mut cpu), Some(&mut gpu), dense.as_mut()].into_iter().flatten() {
                side.write(&w, &step)?;
            }
            let call = sched.step_call(&w, t);
            let (mut oc, og) = (cpu.forward(&w, &call)?, gpu.forward(&w, &call)?);
            if let Some(dn) = dense.as_mut() {
                let od = dn.forward(&w, &call)?;
                let (hq, d) = (spec.num_q_heads, spec.head_dim);
                for (j, &id) in call.ids.iter().enumerate() {
                    if !no_slot.contains(&id) {
                        continue;
                    }
                    oc.out[j * hq * d..(j + 1) * hq * d].copy_from_slice(&od.out[j * hq * d..(j + 1) * hq * d]);
                    oc.lse[j * hq..(j + 1) * hq].copy_from_slice(&od.lse[j * hq..(j + 1) * hq]);
                    let len = call.lens[j];
                    let lo = if spec.window > 0 { len.saturating_sub(spec.window) } else { 0 };
                    for r in oc.visits.iter_mut().filter(|r| r.seq_id == id as u64) {
                        r.spans = vec![(lo, len)];
                    }
                }
            }
            res.rows += oc.visits.len();
            if oc.visits.len() != og.visits.len() && res.decision_mismatch.is_none() {
                res.decision_mismatch = Some(format!("step {t}: {} CPU policy rows, {} GPU rows", oc.visits.len(), og.visits.len()));
            }
            let gpu_sets: HashMap<(u64, usize), Vec<usize>> = og.visits.iter().map(|r| ((r.seq_id, r.kv_head), positions(r))).collect();
            let cpu_sets: HashMap<(u64, usize), Vec<usize>> = oc.visits.iter().map(|r| ((r.seq_id, r.kv_head), positions(r))).collect();
            let (hq, hk, d, g) = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.num_q_heads / spec.num_kv_heads);
            for (j, &id) in call.ids.iter().enumerate() {
                let q = query_row(&call.q, j, hq, d);
                let full = mirror.decide(&rp, id, &q, hq, d, w.scale);
                if no_slot.contains(&id) {
                    continue;
                }
                let hi = call.lens[j] - 1;
                let lo = if spec.window > 0 { (hi + 1).saturating_sub(spec.window) } else { 0 };
                for h in 0..hk {
                    let key = (id as u64, h);
                    let (Some(c), Some(gs)) = (cpu_sets.get(&key), gpu_sets.get(&key)) else {
                        res.decision_mismatch.get_or_insert_with(|| format!("step {t}: seq {id} head {h} has no visit record"));
                        continue;
                    };
                    if full && c.len() != hi + 1 - lo {
                        res.decision_mismatch.get_or_insert_with(|| format!("step {t}: seq {id} head {h}: the schedule's mirror says full, the CPU visited {} of {} positions", c.len(), hi + 1 - lo));
                    }
                    let a = check_row(c, gs, lo, refs.get(&(id, h)), &format!("step {t} seq {id} head {h}"));
                    if a.differing > 0 {
                        // The CPU reference over the GPU's own set for this head's query rows.
                        let (o, l) = w.attend_over(call.seqs[j], &q, gs, h);
                        oc.out[(j * hq + h * g) * d..(j * hq + (h + 1) * g) * d].copy_from_slice(&o);
                        oc.lse[j * hq + h * g..j * hq + (h + 1) * g].copy_from_slice(&l);
                    }
                    res.agreement.merge(&a);
                    if full {
                        refs.insert((id, h), w.reference(call.seqs[j], &q, call.lens[j], h, rp.pool));
                    }
                }
            }
            worst_o = worst_o.max(rel_err(&og.out, &oc.out));
            worst_l = worst_l.max(max_abs_err(&og.lse, &oc.lse));
        }
        let (c_cpu, c_gpu): (Counters, Counters) = (cpu.engine().stats().total, gpu.engine().stats().total);
        res.full_steps = c_cpu[refresh::FULL_STEPS];
        res.partial_steps = c_cpu[refresh::PARTIAL_STEPS];
        res.rows_without_state = gpu.engine().stats().policy_rows_without_state;
        if no_slot.is_empty() {
            // Borderline swaps may touch other blocks: the count of blocks visited then differs.
            let c_gpu = if res.agreement.differing > 0 { Counters { blocks_visited: c_cpu.blocks_visited, ..c_gpu } } else { c_gpu };
            res.counters_mismatch = compare_counters(&c_cpu, &c_gpu).or_else(|| {
                let (a, b) = ((c_cpu[refresh::FULL_STEPS], c_cpu[refresh::PARTIAL_STEPS]), (c_gpu[refresh::FULL_STEPS], c_gpu[refresh::PARTIAL_STEPS]));
                (a != b).then(|| format!("refresh (full, partial) steps CPU {a:?} GPU {b:?}"))
            });
        } else if res.rows_without_state != steps as u64 {
            res.counters_mismatch = Some(format!("{} rows without state on the GPU, expected {steps}", res.rows_without_state));
        }
        res.rel_err = worst_o;
        res.lse_err = worst_l;
        res.pass = res.rows > 0 && res.decision_mismatch.is_none() && res.agreement.violation.is_none() && res.counters_mismatch.is_none() && worst_o <= tol_o && worst_l <= tol_l;
        Ok(())
    };
    if let Err(e) = run(&mut res) {
        res.error = Some(e.to_string());
        res.pass = false;
    }
    res
}

/// Device buffers of a decode step whose contents change between replays (queries, lengths, the new
/// rows and their slots, outputs) and those that do not (table, query starts, ids).
struct StepBufs {
    q: DevBuf,
    lens: DevBuf,
    kn: DevBuf,
    vn: DevBuf,
    slots: DevBuf,
    out: DevBuf,
    lse: DevBuf,
    table: DevBuf,
    qsl: DevBuf,
    ids: DevBuf,
}

impl StepBufs {
    fn new(w: &Work, sched: &Schedule) -> Result<Self> {
        let s = &w.spec;
        let ns = w.ids.len();
        let (hq, hk, d, es) = (s.num_q_heads, s.num_kv_heads, s.head_dim, s.dtype.size_bytes());
        let z = |n: usize| DevBuf::from_host(&vec![0u8; n.max(1)]);
        let call = sched.step_call(w, 0);
        Ok(StepBufs {
            q: z(ns * hq * d * es)?,
            lens: z(ns * 4)?,
            kn: z(ns * hk * d * es)?,
            vn: z(ns * hk * d * es)?,
            slots: z(ns * 8)?,
            out: z(ns * hq * d * es)?,
            lse: z(ns * hq * 4)?,
            table: DevBuf::from_host(bytes(&call.table(w)))?,
            qsl: DevBuf::from_host(bytes(&call.qsl()))?,
            ids: DevBuf::from_host(bytes(&call.ids))?,
        })
    }

    /// Uploads step `t`'s inputs.
    fn load(&self, w: &Work, sched: &Schedule, t: usize) -> Result<()> {
        let ns = w.ids.len();
        let call = sched.step_call(w, t);
        let lens: Vec<i32> = call.lens.iter().map(|&l| l as i32).collect();
        let (k, v, slots) = w.rows(&(0..ns).map(|s| (s, w.len0[s] + t)).collect::<Vec<_>>());
        self.q.upload(0, call.q.as_bytes())?;
        self.lens.upload(0, bytes(&lens))?;
        self.kn.upload(0, k.as_bytes())?;
        self.vn.upload(0, v.as_bytes())?;
        self.slots.upload(0, bytes(&slots))
    }

    fn args(&self, w: &Work, kc: &DevBuf, vc: &DevBuf, stream: CUstream) -> Result<(CacheWriteArgs, ForwardArgs)> {
        let s = &w.spec;
        let (ns, hq, hk, d, dt) = (w.ids.len() as i64, s.num_q_heads as i64, s.num_kv_heads as i64, s.head_dim as i64, s.dtype);
        let shape = Side::cache_shape(w);
        let st = [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1];
        let mb = w.max_blocks as i64;
        let cw = CacheWriteArgs {
            layer: 0,
            key: view(&self.kn, 0, dt, &[ns, hk, d], &[hk * d, d, 1])?,
            value: view(&self.vn, 0, dt, &[ns, hk, d], &[hk * d, d, 1])?,
            key_cache: view(kc, 0, w.cache_dtype, &shape, &st)?,
            value_cache: view(vc, 0, w.cache_dtype, &shape, &st)?,
            slot_mapping: view(&self.slots, 0, DType::I64, &[ns], &[1])?,
            stream,
        };
        let fw = ForwardArgs {
            layer: 0,
            query: view(&self.q, 0, dt, &[ns, hq, d], &[hq * d, d, 1])?,
            key_cache: view(kc, 0, w.cache_dtype, &shape, &st)?,
            value_cache: view(vc, 0, w.cache_dtype, &shape, &st)?,
            block_table: view(&self.table, 0, DType::I32, &[ns, mb], &[mb, 1])?,
            seq_lens: view(&self.lens, 0, DType::I32, &[ns], &[1])?,
            query_start_loc: view(&self.qsl, 0, DType::I32, &[ns + 1], &[1])?,
            seq_ids: Some(view(&self.ids, 0, DType::I64, &[ns], &[1])?),
            out: view(&self.out, 0, dt, &[ns, hq, d], &[hq * d, d, 1])?,
            lse: Some(view(&self.lse, 0, DType::F32, &[ns, hq], &[hq, 1])?),
            scale: w.scale,
            sliding_window: s.window as i32,
            softcap: s.softcap,
            max_query_len: 1,
            max_seq_len: (w.len0.iter().max().copied().unwrap_or(0) + w.steps) as i32,
            stream,
        };
        Ok((cw, fw))
    }
}

/// A RefreshKV decode step captured once in a CUDA graph (cache write of the new rows, slot lookup,
/// schedule, scores, sets, attention) and replayed for steps 1.. of the run, each replay after uploading
/// that step's inputs, against an eager engine running the same steps: the same visited positions and
/// bit-identical outputs at every step, the same counters at the end. Step 0 runs eagerly on both (it
/// allocates the workspace and the state). Returns (policy rows compared, full and partial steps of the
/// eager engine, first mismatch).
pub fn refresh_graph_replay(spec: &CaseSpec, policy: &str, len0: &[usize], steps: usize, seed: u64) -> Result<(usize, u64, u64, Option<String>)> {
    let w = Work::new(spec, len0, steps, 2, seed);
    let sched = Schedule::new(&w, &Variant::default());
    let ns = w.ids.len();
    let api = cuda()?;
    let mut eager = Side::new(&w, policy, Device::Cuda(0))?;
    let mut graph = Side::new(&w, policy, Device::Cuda(0))?;
    graph.engine().record_visits(false);
    let prefix: Vec<(usize, usize)> = (0..ns).flat_map(|s| (0..w.len0[s]).map(move |p| (s, p))).collect();
    let pre = sched.prefill_call(&w);
    for side in [&mut eager, &mut graph] {
        side.write(&w, &prefix)?;
        side.forward(&w, &pre)?;
    }
    let (Side::Gpu(ee, ekc, evc), Side::Gpu(ge, gkc, gvc)) = (&eager, &graph) else { kvsparse::bail!(Internal, "GPU sides expected") };
    let (eb, gb) = (StepBufs::new(&w, &sched)?, StepBufs::new(&w, &sched)?);
    let mut stream: CUstream = std::ptr::null_mut();
    // SAFETY: out-parameter; destroyed below.
    check(unsafe { (api.cuStreamCreate)(&mut stream, driver::CU_STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
    let result = (|| -> Result<(usize, u64, u64, Option<String>)> {
        let (ecw, efw) = eb.args(&w, ekc, evc, std::ptr::null_mut())?;
        let (gcw, gfw) = gb.args(&w, gkc, gvc, stream)?;
        let cfg = ge.config().clone();
        let mut rows = 0;
        let mut mism = None;
        let es = spec.dtype.size_bytes();
        let n_out = ns * spec.num_q_heads * spec.head_dim * es;
        // SAFETY: capture / instantiate / launch on our own stream; handles destroyed below.
        unsafe {
            let mut exec = std::ptr::null_mut();
            let mut graph_h = std::ptr::null_mut();
            for t in 0..steps {
                eb.load(&w, &sched, t)?;
                gb.load(&w, &sched, t)?;
                ee.cache_write(&ecw)?;
                ee.attention_forward(&efw)?;
                if t == 0 {
                    ge.cache_write(&gcw)?;
                    ge.attention_forward(&gfw)?;
                    check((api.cuStreamSynchronize)(stream), "cuStreamSynchronize")?;
                    check((api.cuStreamBeginCapture)(stream, driver::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")?;
                    let r = ge.cache_write(&gcw).and_then(|_| ge.attention_forward(&gfw));
                    let end = check((api.cuStreamEndCapture)(stream, &mut graph_h), "cuStreamEndCapture");
                    r?;
                    end?;
                    check((api.cuGraphInstantiateWithFlags)(&mut exec, graph_h, 0), "cuGraphInstantiate")?;
                } else {
                    check((api.cuGraphLaunch)(exec, stream), "cuGraphLaunch")?;
                }
                check((api.cuStreamSynchronize)(stream), "cuStreamSynchronize")?;
                sync()?;
                let ve = sorted(ee.take_visits());
                let vg = sorted(ge.backend().as_any().downcast_ref::<kvsparse::cuda::CudaBackend>().expect("cuda").visit_records(&cfg, &gfw)?);
                rows += ve.len();
                let (mut oa, mut ob) = (vec![0u8; n_out], vec![0u8; n_out]);
                eb.out.download(0, &mut oa)?;
                gb.out.download(0, &mut ob)?;
                let (mut la, mut lb) = (vec![0u8; ns * spec.num_q_heads * 4], vec![0u8; ns * spec.num_q_heads * 4]);
                eb.lse.download(0, &mut la)?;
                gb.lse.download(0, &mut lb)?;
                if mism.is_none() {
                    mism = compare_visits(&ve, &vg).map(|m| format!("step {t}: {m}")).or_else(|| (oa != ob || la != lb).then(|| format!("step {t}: outputs differ from the eager run")));
                }
            }
            if !exec.is_null() {
                (api.cuGraphExecDestroy)(exec);
            }
            if !graph_h.is_null() {
                (api.cuGraphDestroy)(graph_h);
            }
        }
        let (ce, cg) = (ee.stats().total, ge.stats().total);
        if mism.is_none() {
            mism = compare_counters(&ce, &cg).or_else(|| ((ce[refresh::FULL_STEPS], ce[refresh::PARTIAL_STEPS]) != (cg[refresh::FULL_STEPS], cg[refresh::PARTIAL_STEPS])).then(|| format!("refresh steps eager {:?} graph {:?}", (ce[refresh::FULL_STEPS], ce[refresh::PARTIAL_STEPS]), (cg[refresh::FULL_STEPS], cg[refresh::PARTIAL_STEPS]))));
        }
        Ok((rows, ce[refresh::FULL_STEPS], ce[refresh::PARTIAL_STEPS], mism))
    })();
    // SAFETY: created above.
    unsafe { (api.cuStreamDestroy)(stream) };
    result
}

/// The RefreshKV parameters of a policy string.
fn refresh_params(policy: &str) -> Result<kvsparse::policy::Refresh> {
    match kvsparse::policy::Policy::parse(policy)?.pipeline().map(|p| &p.selector) {
        Some(kvsparse::policy::Selector::Refresh(r)) => Ok(*r),
        _ => kvsparse::bail!(InvalidArgument, "{policy:?} is not a RefreshKV policy"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness on the CPU alone: the drifting queries give both full and partial steps, the unseen
    /// sequence's first step is full, and the released id's successor starts fresh.
    #[test]
    fn cpu_run_has_full_and_partial_steps() {
        let spec = crate::sparse_cuda::sparse_specs(true)[0].clone();
        let w = Work::new(&spec, &[40, 300, 900], 6, 3, 3);
        let v = Variant { unseen: true, release_at: Some(3), max_seqs: None };
        let mut sched = Schedule::new(&w, &v);
        let policy = "refresh(k=64, stride=1, s=0.9)";
        let mut cpu = Side::new(&w, policy, Device::Cpu).unwrap();
        let prefix: Vec<(usize, usize)> = (0..3).flat_map(|s| (0..w.len0[s]).map(move |p| (s, p))).collect();
        cpu.write(&w, &prefix).unwrap();
        let pre = sched.prefill_call(&w);
        cpu.forward(&w, &pre).unwrap();
        // The harness's mirror of the schedule decides as the CPU engine does.
        let (rp, (hq, d)) = (refresh_params(policy).unwrap(), (spec.num_q_heads, spec.head_dim));
        let mut mirror = ScheduleMirror::default();
        for (j, &id) in pre.ids.iter().enumerate() {
            assert!(mirror.decide(&rp, id, &query_row(&pre.q, (j + 1) * REFRESH_CHUNK - 1, hq, d), hq, d, w.scale));
        }
        let (mut rows, mut full) = (0, 0u64);
        for t in 0..6 {
            if t == 3 {
                cpu.release(sched.ids[0]).unwrap();
                mirror.forget(sched.ids[0]);
                sched.ids[0] = 9999;
            }
            cpu.write(&w, &(0..3).map(|s| (s, w.len0[s] + t)).collect::<Vec<_>>()).unwrap();
            let call = sched.step_call(&w, t);
            let o = cpu.forward(&w, &call).unwrap();
            assert!(o.out.iter().all(|x| x.is_finite()));
            rows += o.visits.len();
            for (j, &id) in call.ids.iter().enumerate() {
                full += mirror.decide(&rp, id, &query_row(&call.q, j, hq, d), hq, d, w.scale) as u64;
            }
        }
        let c = cpu.engine().stats().total;
        assert_eq!(rows, 6 * 3 * spec.num_kv_heads);
        assert!(c[refresh::FULL_STEPS] >= 3 && c[refresh::PARTIAL_STEPS] > 0, "{c:?}");
        assert_eq!(full, c[refresh::FULL_STEPS], "the mirror's full steps");
    }
}
