//! One forward call on the CPU backend: dense rows through `forward::dense_forward`, decode rows of
//! policy layers through the policy pipeline (`sparse`), and the policies' prefill hooks (SnapKV's
//! choice, PRR's calibration, the predictor's history seed) — everything policy-specific that a call
//! does, so that the engine itself only validates and dispatches.

use parking_lot::{Mutex, RwLock};

use super::attention::AttnParams;
use super::forward::ForwardIo;
use super::metadata::CacheMeta;
use super::sparse::{sparse_forward, SparseCtx};
use crate::config::EngineConfig;
use crate::cpu;
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::{Batch, KvCache};
use crate::policy::speculate::SpecBudgetTable;
use crate::policy::{Policy, Selector, SnapSelection};
use crate::sequences::Registry;
use crate::stats::{Counters, VisitRecord};
use crate::{bail, ensure};

/// The engine's parts a CPU call uses (borrowed for the call).
pub struct CallCtx<'a> {
    pub cfg: &'a EngineConfig,
    pub policy: &'a Policy,
    pub pool: &'a rayon::ThreadPool,
    pub spin: &'a crate::cpu::spin_pool::SpinPool,
    pub sequences: &'a Registry,
    pub meta: &'a CacheMeta,
    pub visits: &'a Mutex<Option<Vec<VisitRecord>>>,
    pub spec_budgets: &'a RwLock<Option<SpecBudgetTable>>,
    pub predictor: Option<&'a crate::policy::predictor::PredictorWeights>,
}

/// Causal varlen attention of one validated call on the CPU; returns its counters.
pub fn forward(e: &CallCtx, a: &ForwardArgs, cache: &KvCache) -> Result<Counters> {
    let cfg = e.cfg;
    let cache = *cache;
    let num_tokens = a.query.dim(0);
    let batch = Batch::from_host_tensors(num_tokens, &a.query_start_loc, &a.seq_lens, &a.block_table, a.seq_ids.as_ref(), cfg.block_size, cache.num_blocks)?;
    let pipeline = if e.policy.is_dense_for_layer(a.layer) { None } else { e.policy.pipeline() };
    ensure!(
        batch.has_seq_ids || pipeline.is_none() || !e.policy.is_stateful(),
        InvalidArgument,
        "policy {:?} keeps per-sequence state, so seq_ids is required",
        cfg.policy
    );
    let params = AttnParams { scale: a.scale, softcap: a.softcap, window: a.sliding_window as usize };
    let io = ForwardIo { q: a.query, out: a.out, lse: a.lse, cache: &cache, batch: &batch, params, num_q_heads: cfg.num_q_heads, num_kv_heads: cfg.num_kv_heads };
    let (policy_seqs, dense_seqs): (Vec<usize>, Vec<usize>) = (0..batch.seqs.len()).partition(|&s| pipeline.is_some() && batch.seqs[s].is_decode());

    // PRR calibrates at prefill chunks (on Quest's page scores of the chunk's queries).
    let speculate = match pipeline.map(|p| &p.selector) {
        Some(Selector::Speculate(sp)) => Some(*sp),
        _ => None,
    };
    let predictor = match pipeline.map(|p| &p.selector) {
        Some(Selector::Predictor(ps)) => Some(*ps),
        _ => None,
    };
    let refresh = match pipeline.map(|p| &p.selector) {
        Some(Selector::Refresh(r)) => Some(*r),
        _ => None,
    };
    let calib_seqs: Vec<usize> = if speculate.is_some() || predictor.is_some() || refresh.is_some() { (0..batch.seqs.len()).filter(|&s| !batch.seqs[s].is_decode() && batch.seqs[s].q_len > 0).collect() } else { Vec::new() };
    if e.cfg.max_state_bytes > 0 && pipeline.is_some() && e.policy.is_stateful() && !matches!(pipeline.map(|p| &p.selector), Some(Selector::SnapKv { .. })) {
        let held = e.sequences.state_bytes();
        ensure!(held <= e.cfg.max_state_bytes, OutOfMemory, "policy state holds {held} bytes, over the engine's cap of {}; release finished sequences", e.cfg.max_state_bytes);
    }

    // Everything that can fail is checked before anything is written: metadata coverage, state cap.
    let meta_guard = if e.meta.needs.any() && pipeline.is_some() && (!policy_seqs.is_empty() || !calib_seqs.is_empty()) { Some(e.meta.read(a.layer)) } else { None };
    let meta = match &meta_guard {
        Some(g) => {
            let Some(m) = g.as_ref() else {
                bail!(InvalidArgument, "policy {:?} needs key metadata for layer {}, but no cache write for that layer went through kvs_cache_write", cfg.policy, a.layer);
            };
            ensure!(m.num_blocks == cache.num_blocks, InvalidShape, "layer {}'s key metadata was built for {} blocks, the caches have {}", a.layer, m.num_blocks, cache.num_blocks);
            for &s in policy_seqs.iter().chain(&calib_seqs) {
                let sd = &batch.seqs[s];
                let lim = crate::cpu::attention::RowLimits::causal(sd.seq_len - 1, params.window);
                m.check_covers(batch.blocks(s, cfg.block_size), lim.lo, lim.hi, &format!("policy {:?} (layer {}, sequence {})", cfg.policy, a.layer, sd.seq_id))?;
            }
            Some(m)
        }
        None => None,
    };
    let snap_choices = match pipeline.map(|p| &p.selector) {
        Some(&Selector::SnapKv { budget, window, pool }) => snapkv_prefill(e, &io, budget, window, pool)?,
        _ => Vec::new(),
    };

    if batch.has_seq_ids {
        for s in &batch.seqs {
            e.sequences.get_or_create(s.seq_id);
        }
    }
    for (s, heads) in snap_choices {
        let st = e.sequences.get_or_create(batch.seqs[s].seq_id);
        let mut st = st.lock();
        for (h, sel) in heads.into_iter().enumerate() {
            st.policy.head_mut(a.layer, h, cfg.num_kv_heads).snapkv = Some(std::sync::Arc::new(sel));
        }
    }
    let mut c = Counters { calls: 1, ..Default::default() };
    if let (Some(sp), Some(m)) = (speculate, meta) {
        use rayon::prelude::*;
        let hk = cfg.num_kv_heads;
        let t0 = std::time::Instant::now();
        let table = e.spec_budgets.read();
        let items: Vec<(usize, usize)> = calib_seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
        let warm: Vec<_> = e.pool.install(|| items.par_iter().map(|&(s, h)| cpu::sparse::prr_calibrate(&io, s, h, &sp, m, table.as_ref()).0).collect());
        for (&(s, h), w) in items.iter().zip(warm) {
            let st = e.sequences.get_or_create(batch.seqs[s].seq_id);
            st.lock().policy.head_mut(a.layer, h, hk).prr = Some(Box::new(w));
        }
        c.spec_calibrations += items.len() as u64;
        c.spec_calib_us += t0.elapsed().as_micros() as u64;
    }
    if let Some(ps) = predictor {
        use rayon::prelude::*;
        let hk = cfg.num_kv_heads;
        let items: Vec<(usize, usize)> = calib_seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
        let seeded: Vec<_> = e.pool.install(|| items.par_iter().map(|&(s, h)| cpu::sparse::predictor_seed(&io, s, h, &ps)).collect());
        for (&(s, h), ph) in items.iter().zip(seeded) {
            let st = e.sequences.get_or_create(batch.seqs[s].seq_id);
            st.lock().policy.head_mut(a.layer, h, hk).predictor = Some(Box::new(ph));
        }
    }
    if let Some(r) = refresh {
        // RefreshKV's prefilling stage: the partial set from the last prompt token's attention, and that
        // token's mean query as the schedule's reference (the prefill is the first full step).
        use rayon::prelude::*;
        let hk = cfg.num_kv_heads;
        let items: Vec<(usize, usize)> = calib_seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
        let seeded: Vec<_> = e.pool.install(|| items.par_iter().map(|&(s, h)| cpu::sparse::refresh_seed(&io, s, h, &r)).collect());
        for (&(s, h), rh) in items.iter().zip(seeded) {
            let st = e.sequences.get_or_create(batch.seqs[s].seq_id);
            st.lock().policy.head_mut(a.layer, h, hk).refresh = Some(Box::new(rh));
        }
        for &s in &calib_seqs {
            let sd = &batch.seqs[s];
            let qm = cpu::sparse::mean_query(&io, sd.q_start + sd.q_len - 1);
            let st = e.sequences.get_or_create(sd.seq_id);
            st.lock().policy.refresh_layers.insert(a.layer, crate::policy::refresh::RefreshLayer { q_ref: qm, since_full: 0 });
        }
    }
    cpu::forward::dense_forward(&io, &dense_seqs, e.spin);

    if let Some(p) = pipeline {
        if !policy_seqs.is_empty() {
            let snap = policy_seqs
                .iter()
                .map(|&s| {
                    let st = e.sequences.get(batch.seqs[s].seq_id);
                    let st = st.as_ref().map(|st| st.lock());
                    (0..cfg.num_kv_heads).map(|h| st.as_ref().and_then(|st| st.policy.head(a.layer, h)).and_then(|hs| hs.snapkv.clone())).collect()
                })
                .collect();
            let log = e.visits.lock().is_some().then(|| std::sync::Mutex::new(Vec::new()));
            let states = if e.policy.is_stateful() { policy_seqs.iter().map(|&s| e.sequences.get(batch.seqs[s].seq_id)).collect() } else { Vec::new() };
            let table = e.spec_budgets.read();
            let ctx = SparseCtx { pipeline: p, meta, snap, visits: log.as_ref(), layer: a.layer, states, spec_budgets: table.as_ref(), predictor: e.predictor };
            c.add(&sparse_forward(&io, &policy_seqs, &ctx, e.spin));
            if let (Some(log), Some(dst)) = (log, e.visits.lock().as_mut()) {
                // Canonical form (sorted, adjacent spans merged), as the CUDA engine reports its plans.
                dst.extend(log.into_inner().expect("visit log").into_iter().map(|mut r| {
                    crate::policy::select::normalize_spans(&mut r.spans);
                    VisitRecord { layer: a.layer, ..r }
                }));
            }
        }
    }
    drop(meta_guard);

    let row_bytes = (cfg.head_dim * cfg.dtype.size_bytes() * 2 * cfg.num_kv_heads) as u64;
    for (i, s) in batch.seqs.iter().enumerate() {
        if s.q_len == 1 {
            c.decode_rows += 1;
        } else {
            c.prefill_tokens += s.q_len as u64;
        }
        if dense_seqs.binary_search(&i).is_ok() {
            let first_visible = if a.sliding_window > 0 { (s.first_pos() + 1).saturating_sub(a.sliding_window as usize) } else { 0 };
            c.kv_bytes_read += (s.seq_len - first_visible) as u64 * row_bytes;
        }
    }
            Ok(c)
}

/// SnapKV choices for the prefill sequences of this call, per (sequence, KV head), computed before
/// anything is written; fails if storing them would exceed the engine's state cap.
fn snapkv_prefill(e: &CallCtx, io: &ForwardIo, budget: usize, window: usize, pool: usize) -> Result<Vec<(usize, Vec<SnapSelection>)>> {
    use rayon::prelude::*;
    let hk = e.cfg.num_kv_heads;
    let seqs: Vec<usize> = (0..io.batch.seqs.len()).filter(|&s| !io.batch.seqs[s].is_decode() && io.batch.seqs[s].q_len > 0).collect();
    if seqs.is_empty() {
        return Ok(Vec::new());
    }
    let items: Vec<(usize, usize)> = seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
    let mut sels: Vec<SnapSelection> = e.pool.install(|| items.par_iter().map(|&(s, h)| crate::policy::snapkv::cpu::choose(io, s, h, budget, window, pool)).collect());
    if e.cfg.max_state_bytes > 0 {
        let new: u64 = sels.iter().map(|s| (s.keep.len() * 8 + std::mem::size_of::<SnapSelection>()) as u64).sum();
        let held = e.sequences.state_bytes();
        ensure!(
            held + new <= e.cfg.max_state_bytes,
            OutOfMemory,
            "SnapKV state for this call needs {new} bytes, the engine holds {held} of its {} byte cap; release finished sequences",
            e.cfg.max_state_bytes
        );
    }
    let mut out = Vec::with_capacity(seqs.len());
    for &s in seqs.iter().rev() {
        let heads = sels.split_off(sels.len() - hk);
        out.push((s, heads));
    }
    Ok(out)
}
