//! One forward call on the CPU backend: dense rows through `forward::dense_forward`, decode rows of
//! policy layers through the policy pipeline (`sparse`), and the selector stage's prefill hook (each
//! policy's own, in src/policy/<name>/cpu.rs).

use parking_lot::{Mutex, RwLock};

use super::attention::AttnParams;
use super::forward::ForwardIo;
use super::metadata::CacheMeta;
use super::sparse::{sparse_forward, CpuPipeline, PrefillCx, SparseCtx};
use crate::config::EngineConfig;
use crate::cpu;
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::{Batch, KvCache};
use crate::policy::{Policy, PolicyInput};
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
    pub policy_input: &'a RwLock<Option<PolicyInput>>,
    /// What the policy loaded for the engine's life (`Policy::cpu_data`).
    pub policy_data: Option<&'a (dyn std::any::Any + Send + Sync)>,
}

/// Causal varlen attention of one validated call on the CPU; returns its counters.
pub fn forward(e: &CallCtx, a: &ForwardArgs, cache: &KvCache) -> Result<Counters> {
    let cfg = e.cfg;
    let cache = *cache;
    let num_tokens = a.query.dim(0);
    let batch = Batch::from_host_tensors(num_tokens, &a.query_start_loc, &a.seq_lens, &a.block_table, a.seq_ids.as_ref(), cfg.block_size, cache.num_blocks, cfg.padded_batches)?;
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

    // The pipeline's selector as a CPU stage (src/policy/registry.rs).
    let stage = pipeline.map(|p| p.cpu_selector());
    // Prefill sequences a stage reads key metadata on at prefill (PRR's calibration, the seeds).
    let calib_seqs: Vec<usize> = if stage.as_ref().is_some_and(|st| st.prefill_reads_meta()) { (0..batch.seqs.len()).filter(|&s| !batch.seqs[s].is_decode() && batch.seqs[s].q_len > 0).collect() } else { Vec::new() };
    if e.cfg.max_state_bytes > 0 && pipeline.is_some() && e.policy.is_stateful() && !stage.as_ref().is_some_and(|st| st.caps_own_state()) {
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
    // The stage sees the prefill chunks (SnapKV's choice, PRR's calibration, the seeds) before anything
    // is attended; a refusal (SnapKV's state cap) leaves everything unchanged.
    let mut c = Counters { calls: 1, ..Default::default() };
    if let Some(st) = &stage {
        let input = e.policy_input.read();
        let cx = PrefillCx { io: &io, cfg, pool: e.pool, sequences: e.sequences, layer: a.layer, calib_seqs: &calib_seqs, meta, policy_input: input.as_deref() };
        c.add(&st.prefill(&cx)?);
    }
    if batch.has_seq_ids {
        for s in &batch.seqs {
            e.sequences.get_or_create(s.seq_id);
        }
    }
    cpu::forward::dense_forward(&io, &dense_seqs, e.spin);

    if let Some(p) = pipeline {
        if !policy_seqs.is_empty() {
            // What the stage's rows read of each sequence's state (SnapKV's choice), taken once here.
            let st_ref = stage.as_deref().expect("a pipeline has a stage");
            let held = policy_seqs
                .iter()
                .map(|&s| {
                    let st = e.sequences.get(batch.seqs[s].seq_id);
                    let st = st.as_ref().map(|st| st.lock());
                    (0..cfg.num_kv_heads).map(|h| st.as_ref().and_then(|st| st.policy.head(a.layer, h)).and_then(|hs| st_ref.held(hs))).collect()
                })
                .collect();
            let log = e.visits.lock().is_some().then(|| std::sync::Mutex::new(Vec::new()));
            let states = if e.policy.is_stateful() { policy_seqs.iter().map(|&s| e.sequences.get(batch.seqs[s].seq_id)).collect() } else { Vec::new() };
            let input = e.policy_input.read();
            let ctx = SparseCtx { pipeline: p, stage: st_ref, meta, held, visits: log.as_ref(), layer: a.layer, states, policy_input: input.as_deref(), policy_data: e.policy_data };
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

    let row_bytes = (cfg.head_dim * cfg.cache_dtype.size_bytes() * 2 * cfg.num_kv_heads) as u64;
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
