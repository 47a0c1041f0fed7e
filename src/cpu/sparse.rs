//! Runs a policy pipeline for the decode rows of one forward call on the CPU: per (sequence, KV head), in
//! parallel on the engine's pool, select → prune (top-p) → order/terminate (ART), and attend exactly over
//! what is left with the same kernel dense attention uses ([`attend_spans`] / [`attend_tokens`]).
//!
//! The scoring kernels the decisions need live here too: Quest's page bound from the per-page min/max,
//! and Twilight's weight estimate from the INT4 copy of K. Both read only metadata, never K.

use std::sync::Arc;

use rayon::prelude::*;

use super::attention::{attend_spans, attend_tokens, RowLimits, RowsState, SeqKv, CHUNK};
use super::convert::{Isa, Portable};
use super::isa::{self, IsaLevel};
use super::forward::ForwardIo;
use super::math::fast_exp;
use super::metadata::LayerMeta;
use super::quantize::code_bytes;
use super::convert::load_row;
use crate::policy::select::{self, max_pool, normalize_spans, Candidates};
use crate::policy::speculate::{self, HoltParams, PrrHead, SpecBudgetTable, TrajStep, DEFAULT_PARAMS};
use crate::policy::termination::{order_units, probe_dims, ArtState};
use crate::policy::predictor::{self, PredictorHead, PredictorWeights};
use crate::policy::{top_p, Pipeline, PredictorSpec, Refresh, Selector, SnapSelection, Speculate};
use crate::sequences::SequenceState;
use crate::stats::{Counters, VisitRecord};

/// Per-sequence state handles of the decode sequences (same order as `seqs`).
pub type SeqStates = Vec<Option<Arc<parking_lot::Mutex<SequenceState>>>>;

/// Everything one call's policy rows need besides the caller's tensors.
pub struct SparseCtx<'a> {
    pub pipeline: &'a Pipeline,
    /// Layer metadata (Quest min/max, INT4 K), present when the pipeline needs it.
    pub meta: Option<&'a LayerMeta>,
    /// SnapKV choices per decode sequence (same order as `seqs`), one entry per KV head.
    pub snap: Vec<Vec<Option<Arc<SnapSelection>>>>,
    /// When set, each policy row appends the spans it attended (evaluation only; off when serving).
    pub visits: Option<&'a std::sync::Mutex<Vec<VisitRecord>>>,
    /// The engine layer of this call (stateful policies key their state by it).
    pub layer: usize,
    /// Per-sequence state of each decode sequence (stateful policies; empty otherwise).
    pub states: SeqStates,
    /// PRR's speculation budget table, when the engine loaded one (else the spec's constant).
    pub spec_budgets: Option<&'a SpecBudgetTable>,
}

/// One KV head's work inside an item: its query rows, candidates, accumulators and traversal state.
#[derive(Default)]
struct HeadWork {
    head: usize,
    q: Vec<f32>,
    limits: Vec<RowLimits>,
    cand: Candidates,
    st: Option<RowsState>,
    order: Vec<usize>,
    merged: Vec<(usize, usize)>,
    art: ArtState,
    active: bool,
    visited: usize,
    attended: usize,
    cursor: usize,
}

/// Reusable per-thread buffers, so a steady decode loop allocates little.
#[derive(Default)]
struct Scratch {
    heads: Vec<HeadWork>,
    row: Vec<f32>,
    page_scores: Vec<f32>,
    p_rows: Vec<f32>,
    w: Vec<f32>,
    keep: Vec<bool>,
    tokens: Vec<u32>,
    probe: Vec<f32>,
    part: Vec<(usize, usize)>,
    /// PRR: one partial state per speculated page.
    pages: Vec<RowsState>,
    repair: Option<RowsState>,
}

/// Below this many tokens per span on average, a selection is attended as a token list (full chunks).
const MIN_RUN_FOR_SPANS: usize = 8;

/// Selected keys per head per step when the KV heads of an item are interleaved: every head's selected
/// keys in one position window are consumed before the next window, so the cache is read roughly in
/// address order while chunks stay full (the window widens for sparse selections).
const WINDOW: usize = 64;

/// Policy attention for the decode sequences `seqs` (indices into the batch); returns the counters.
///
/// Work items are (sequence, group of KV heads): heads are grouped so there are about two items per
/// thread, and inside an item the heads are interleaved (by position window, or step by step under
/// ART), since one head's rows alone are scattered over the cache.
pub fn sparse_forward(io: &ForwardIo, seqs: &[usize], ctx: &SparseCtx, pool: &rayon::ThreadPool) -> Counters {
    let hk = io.num_kv_heads;
    let threads = pool.current_num_threads();
    let per_item = (seqs.len() * hk).div_ceil(2 * threads).clamp(1, hk);
    let mut items: Vec<(usize, usize, usize)> = Vec::new();
    for i in 0..seqs.len() {
        let mut h0 = 0;
        while h0 < hk {
            items.push((i, h0, (h0 + per_item).min(hk)));
            h0 += per_item;
        }
    }
    // RefreshKV decides full or partial per (sequence, layer) before the heads run.
    let mut pre = Counters::default();
    let full: Vec<bool> = match ctx.pipeline.selector {
        Selector::Refresh(r) => seqs.iter().enumerate().map(|(i, &s)| refresh_decide(io, s, ctx, i, &r, &mut pre)).collect(),
        _ => Vec::new(),
    };
    let run = |sc: &mut Scratch, &(i, h0, h1): &(usize, usize, usize)| -> Counters {
        match ctx.pipeline.selector {
            Selector::Speculate(sp) => run_speculate(io, seqs[i], i, h0..h1, &sp, ctx, sc),
            Selector::Refresh(r) => run_refresh(io, seqs[i], i, h0..h1, &r, full[i], ctx, sc),
            Selector::Predictor(ps) => run_predictor(io, seqs[i], i, h0..h1, &ps, ctx, sc),
            _ => run_item(io, seqs[i], h0..h1, ctx.snap.get(i), ctx, sc),
        }
    };
    if items.len() <= 1 || threads <= 1 {
        let mut sc = Scratch::default();
        let mut total = pre;
        for it in &items {
            total.add(&run(&mut sc, it));
        }
        return total;
    }
    let mut total = pool.install(|| {
        items
            .par_iter()
            .map_init(Scratch::default, run)
            .reduce(Counters::default, |mut a, b| {
                a.add(&b);
                a
            })
    });
    total.add(&pre);
    total
}

fn state_of<'a>(ctx: &'a SparseCtx, i: usize) -> &'a Arc<parking_lot::Mutex<SequenceState>> {
    ctx.states.get(i).and_then(|s| s.as_ref()).expect("the engine passes the state of every stateful policy sequence")
}

/// Mean query of the row over all query heads, compared by RefreshKV's schedule.
fn refresh_decide(io: &ForwardIo, s: usize, ctx: &SparseCtx, i: usize, r: &Refresh, c: &mut Counters) -> bool {
    let (d, g) = (io.cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    let mut qm = vec![0f32; d];
    let mut buf = vec![0f32; g * d];
    for h in 0..io.num_kv_heads {
        io.load_queries(sd.q_start..sd.q_start + 1, h, &mut buf);
        for row in buf.chunks_exact(d) {
            for (m, &x) in qm.iter_mut().zip(row) {
                *m += x;
            }
        }
    }
    let full = state_of(ctx, i).lock().policy.refresh_layers.entry(ctx.layer).or_default().decide(r, &qm);
    if full {
        c.refresh_full_steps += 1;
    } else {
        c.refresh_partial_steps += 1;
    }
    full
}

/// Loads the decode row's scaled queries and limits of `head` into `hw`, and resets its accumulator.
fn load_head(io: &ForwardIo, s: usize, head: usize, hw: &mut HeadWork) {
    let (d, g) = (io.cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    hw.head = head;
    hw.q.resize(g * d, 0.0);
    io.load_queries(sd.q_start..sd.q_start + 1, head, &mut hw.q);
    io.limits(sd, sd.q_start..sd.q_start + 1, &mut hw.limits);
    match &mut hw.st {
        Some(st) if st.rows == g && st.dim == d => st.reset(),
        slot => *slot = Some(RowsState::new(g, d)),
    }
}

fn fresh_state(slot: &mut Option<RowsState>, rows: usize, dim: usize) -> &mut RowsState {
    match slot {
        Some(st) if st.rows == rows && st.dim == dim => st.reset(),
        _ => *slot = Some(RowsState::new(rows, dim)),
    }
    slot.as_mut().expect("just set")
}

/// Spans of sorted pages clipped to `lo ..= hi`.
fn page_spans(pages: &[usize], page: usize, lo: usize, hi: usize) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = pages.iter().map(|&p| ((p * page).max(lo), ((p + 1) * page).min(hi + 1))).collect();
    normalize_spans(&mut v);
    v
}

fn span_tokens(spans: &[(usize, usize)]) -> usize {
    spans.iter().map(|(a, b)| b - a).sum()
}

/// PRR for the heads of one item: speculate (attend the predicted pages, one partial state each), compute
/// the true Quest selection, repair (attend the missed pages), merge exactly through the LSE. Predicted
/// pages outside the true set are dropped from the merge unless `extra=keep`, so by default the output is
/// attention over the true set whatever the prediction.
fn run_speculate(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, sp: &Speculate, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, bs);
    let meta = ctx.meta.expect("engine checked quest metadata");
    let state = state_of(ctx, i);
    let page = sp.page;
    let first = lim.lo / page;
    let n_pages = lim.hi / page - first + 1;
    let spec_tokens = ctx.spec_budgets.map_or(sp.budget.unwrap_or(sp.quest_budget), |t| t.budget_for(sd.seq_len));
    let k_spec = spec_tokens.div_ceil(page);
    let softcap = io.params.softcap;
    let mut c = Counters::default();
    let mut hws = std::mem::take(&mut sc.heads);
    hws.resize_with(1, HeadWork::default);
    let hw = &mut hws[0];
    for head in heads {
        c.policy_rows += 1;
        c.blocks_eligible += (lim.hi / bs - lim.lo / bs + 1) as u64;
        load_head(io, s, head, hw);
        let kv = SeqKv { cache, blocks, head };
        let fixed = HoltParams { alpha: sp.alpha.unwrap_or(DEFAULT_PARAMS.alpha), beta: sp.beta.unwrap_or(DEFAULT_PARAMS.beta), gamma: sp.gamma.unwrap_or(DEFAULT_PARAMS.gamma) };
        let mut prr = state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).prr.take().unwrap_or_else(|| Box::new(PrrHead::new(fixed)));
        // 1. Speculate: one partial (out, LSE) state per predicted page.
        let pred = prr.speculate(sp.predict, first, n_pages, k_spec, &mut sc.w);
        while sc.pages.len() < pred.len() {
            sc.pages.push(RowsState::new(g, d));
        }
        let mut attended = 0;
        for (j, &pg) in pred.iter().enumerate() {
            let span = [((pg * page).max(lim.lo), ((pg + 1) * page).min(lim.hi + 1))];
            if sc.pages[j].rows == g && sc.pages[j].dim == d {
                sc.pages[j].reset();
            } else {
                sc.pages[j] = RowsState::new(g, d);
            }
            let n = span[0].1 - span[0].0;
            attend_set(&mut sc.pages[j], &hw.q, &hw.limits, &kv, &span, n, &mut sc.tokens, softcap);
            attended += n;
        }
        // 2. The true selection (Quest), from metadata only.
        c.kv_bytes_read += quest_page_scores(&hw.q, g, d, lim, page, blocks, head, meta, &mut sc.page_scores);
        let truth = select::quest_pages(&sc.page_scores, first, sp.quest_budget, page);
        // 3. Merge the speculated pages that count, repair the missed ones.
        let st = hw.st.as_mut().expect("loaded");
        for (j, &pg) in pred.iter().enumerate() {
            if sp.keep_extra || truth.binary_search(&pg).is_ok() {
                st.merge_from(&sc.pages[j]);
            }
        }
        let missed: Vec<usize> = truth.iter().copied().filter(|p| pred.binary_search(p).is_err()).collect();
        let miss_spans = page_spans(&missed, page, lim.lo, lim.hi);
        if !miss_spans.is_empty() {
            let n = span_tokens(&miss_spans);
            let rep = fresh_state(&mut sc.repair, g, d);
            attend_set(rep, &hw.q, &hw.limits, &kv, &miss_spans, n, &mut sc.tokens, softcap);
            st.merge_from(rep);
            attended += n;
        }
        let hits = speculate::intersection(&pred, &truth);
        c.spec_predicted_blocks += pred.len() as u64;
        c.spec_true_blocks += truth.len() as u64;
        c.spec_hit_blocks += hits as u64;
        c.spec_repaired_blocks += missed.len() as u64;
        c.spec_reuse_hit_blocks += speculate::intersection(&prr.prev_true, &truth) as u64;
        let mut read = pred.clone();
        read.extend_from_slice(&missed);
        read.sort_unstable();
        let read_spans = page_spans(&read, page, lim.lo, lim.hi);
        hw.cand.from_spans(&read_spans, bs, 1, |_| f32::NAN);
        c.blocks_visited += hw.cand.units.len() as u64;
        c.kv_bytes_read += (attended * 2 * d * cache.dtype.size_bytes()) as u64;
        if let Some(log) = ctx.visits {
            let mut used = truth.clone();
            if sp.keep_extra {
                used = read.clone();
            }
            log.lock().expect("visit log").push(VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: head, spans: page_spans(&used, page, lim.lo, lim.hi) });
        }
        prr.update(first, &sc.page_scores, &truth);
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).prr = Some(prr);
        sc.row.resize(d, 0.0);
        io.store_rows(hw.st.as_ref().expect("loaded"), sd.q_start..sd.q_start + 1, head, &mut sc.row);
    }
    sc.heads = hws;
    c
}

/// PRR calibration for prefill sequence `s` and `head`: the Quest page scores of the chunk's last
/// [`CALIB_ROWS`] query rows form the trajectory; returns the warm predictor and the calibration's hit rate.
pub fn prr_calibrate(io: &ForwardIo, s: usize, head: usize, sp: &Speculate, meta: &LayerMeta, spec_budgets: Option<&SpecBudgetTable>) -> (PrrHead, f64) {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let blocks = io.batch.blocks(s, bs);
    let t_end = sd.q_start + sd.q_len;
    let t0 = t_end - sd.q_len.min(CALIB_ROWS);
    let mut q = vec![0f32; g * d];
    let mut lims = Vec::new();
    let mut traj: Vec<TrajStep> = Vec::with_capacity(t_end - t0);
    for t in t0..t_end {
        io.load_queries(t..t + 1, head, &mut q);
        io.limits(sd, t..t + 1, &mut lims);
        let lim = lims[0];
        let mut scores = Vec::new();
        quest_page_scores(&q, g, d, lim, sp.page, blocks, head, meta, &mut scores);
        traj.push((lim.lo / sp.page, scores));
    }
    let spec_tokens = spec_budgets.map_or(sp.budget.unwrap_or(sp.quest_budget), |t| t.budget_for(sd.seq_len));
    let cands = speculate::grid(sp.alpha, sp.beta, sp.gamma);
    let cal = speculate::calibrate(&traj, &cands, spec_tokens.div_ceil(sp.page), sp.quest_budget.div_ceil(sp.page));
    (cal.warm, cal.hit)
}

/// AttentionPredictor's history seeded from a prefill chunk: the true block rows of the chunk's last
/// `history` query rows.
pub fn predictor_seed(io: &ForwardIo, s: usize, head: usize, ps: &PredictorSpec) -> PredictorHead {
    let (d, g) = (io.cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    let blocks = io.batch.blocks(s, io.cache.block_size);
    let t_end = sd.q_start + sd.q_len;
    let t0 = t_end - sd.q_len.min(ps.history);
    let mut q = vec![0f32; g * d];
    let mut lims = Vec::new();
    let (mut logits, mut w) = (Vec::new(), Vec::new());
    let mut ph = PredictorHead::default();
    for t in t0..t_end {
        io.load_queries(t..t + 1, head, &mut q);
        io.limits(sd, t..t + 1, &mut lims);
        let lim = lims[0];
        token_weights(io, &q, g, lim, blocks, head, &mut logits, &mut w);
        let mut full = vec![0f32; lim.lo];
        full.extend_from_slice(&w);
        ph.push(predictor::block_max(&full, ps.block), ps.history);
    }
    ph
}

/// AttentionPredictor for the heads of one item: every `calib` steps (and while there is no history) a
/// full step attends everything and appends the true block row; other steps attend the sink, the local
/// window and the blocks the CNN predicts, and append the block row of the attended tokens' weights.
fn run_predictor(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, ps: &PredictorSpec, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, bs);
    let state = state_of(ctx, i);
    let weights = PredictorWeights::builtin().expect("checked at engine creation");
    let softcap = io.params.softcap;
    let n = lim.hi + 1;
    let mut c = Counters::default();
    let mut hws = std::mem::take(&mut sc.heads);
    hws.resize_with(1, HeadWork::default);
    let hw = &mut hws[0];
    for head in heads {
        c.policy_rows += 1;
        c.blocks_eligible += (lim.hi / bs - lim.lo / bs + 1) as u64;
        load_head(io, s, head, hw);
        let kv = SeqKv { cache, blocks, head };
        let mut ph = state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).predictor.take().unwrap_or_default();
        ph.since_calib += 1;
        let full = ph.rows.is_empty() || ph.since_calib >= ps.calib;
        let spans: Vec<(usize, usize)> = if full {
            ph.since_calib = 0;
            c.refresh_full_steps += 1;
            vec![(lim.lo, n)]
        } else {
            c.refresh_partial_steps += 1;
            let scores = weights.predict_cached(&mut ph, n.div_ceil(ps.block));
            let mut v: Vec<(usize, usize)> = predictor::select(&scores, n, ps.budget, ps.block, ps.sink, ps.local).into_iter().map(|(a, b)| (a.max(lim.lo), b)).collect();
            normalize_spans(&mut v);
            v
        };
        let n_tok = span_tokens(&spans);
        let st = hw.st.as_mut().expect("loaded");
        attend_set(st, &hw.q, &hw.limits, &kv, &spans, n_tok, &mut sc.tokens, softcap);
        // The row appended to the history: weights of what was attended (all positions on a full step).
        let pos: Vec<usize> = spans.iter().flat_map(|&(a, b)| a..b).collect();
        weights_at(io, &hw.q, g, &pos, blocks, head, &mut sc.p_rows, &mut sc.w);
        let mut row = vec![0f32; n];
        for (&p, &x) in pos.iter().zip(&sc.w) {
            row[p] = x;
        }
        ph.push(predictor::block_max(&row, ps.block), ps.history);
        c.kv_bytes_read += (n_tok * 3 * d * cache.dtype.size_bytes()) as u64; // K twice (attend, score), V once
        hw.cand.from_spans(&spans, bs, 1, |_| f32::NAN);
        c.blocks_visited += hw.cand.units.len() as u64;
        if let Some(log) = ctx.visits {
            log.lock().expect("visit log").push(VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: head, spans });
        }
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).predictor = Some(ph);
        sc.row.resize(d, 0.0);
        io.store_rows(hw.st.as_ref().expect("loaded"), sd.q_start..sd.q_start + 1, head, &mut sc.row);
    }
    sc.heads = hws;
    c
}

/// Query rows of a prefill chunk PRR calibrates on (the chunk's last rows; the observation window).
pub const CALIB_ROWS: usize = 64;

/// RefreshKV for the heads of one item: a full step attends everything, scores every position and
/// rebuilds the set; a partial step attends the set only.
#[allow(clippy::too_many_arguments)]
fn run_refresh(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, r: &Refresh, full: bool, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, bs);
    let state = state_of(ctx, i);
    let softcap = io.params.softcap;
    let mut c = Counters::default();
    let mut hws = std::mem::take(&mut sc.heads);
    hws.resize_with(1, HeadWork::default);
    let hw = &mut hws[0];
    for head in heads {
        c.policy_rows += 1;
        c.blocks_eligible += (lim.hi / bs - lim.lo / bs + 1) as u64;
        load_head(io, s, head, hw);
        let kv = SeqKv { cache, blocks, head };
        let taken = state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).refresh.take();
        let (mut rh, do_full) = match taken {
            Some(rh) if !full => (rh, false),
            other => (other.unwrap_or_default(), true),
        };
        let st = hw.st.as_mut().expect("loaded");
        let spans: Vec<(usize, usize)> = if do_full {
            let spans = vec![(lim.lo, lim.hi + 1)];
            attend_set(st, &hw.q, &hw.limits, &kv, &spans, lim.hi + 1 - lim.lo, &mut sc.tokens, softcap);
            token_weights(io, &hw.q, g, lim, blocks, head, &mut sc.p_rows, &mut sc.w);
            c.kv_bytes_read += ((lim.hi + 1 - lim.lo) * d * cache.dtype.size_bytes()) as u64; // K read again to score
            let pooled = max_pool(&sc.w, r.pool);
            rh.rebuild(&pooled, lim.lo, lim.hi, r.k);
            spans
        } else {
            rh.advance(lim.lo, lim.hi, r.k);
            let mut spans: Vec<(usize, usize)> = Vec::new();
            for &t in &rh.tokens {
                let t = t as usize;
                match spans.last_mut() {
                    Some(l) if l.1 == t => l.1 = t + 1,
                    _ => spans.push((t, t + 1)),
                }
            }
            let n = span_tokens(&spans);
            attend_set(st, &hw.q, &hw.limits, &kv, &spans, n, &mut sc.tokens, softcap);
            spans
        };
        hw.cand.from_spans(&spans, bs, 1, |_| f32::NAN);
        c.blocks_visited += hw.cand.units.len() as u64;
        c.kv_bytes_read += (span_tokens(&spans) * 2 * d * cache.dtype.size_bytes()) as u64;
        if let Some(log) = ctx.visits {
            log.lock().expect("visit log").push(VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: head, spans });
        }
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).refresh = Some(rh);
        sc.row.resize(d, 0.0);
        io.store_rows(hw.st.as_ref().expect("loaded"), sd.q_start..sd.q_start + 1, head, &mut sc.row);
    }
    sc.heads = hws;
    c
}

/// Exact softmax weights of the group's rows over positions `lim.lo ..= lim.hi` (each row normalised over
/// them), maximised over the group, into `out[pos - lo]`. Reads K (a full step's scoring pass).
#[allow(clippy::too_many_arguments)]
pub fn token_weights(io: &ForwardIo, q: &[f32], rows: usize, lim: RowLimits, blocks: &[u32], head: usize, logits: &mut Vec<f32>, out: &mut Vec<f32>) {
    let pos: Vec<usize> = (lim.lo..=lim.hi).collect();
    weights_at(io, q, rows, &pos, blocks, head, logits, out)
}

/// Like [`token_weights`] over an explicit list of positions (normalised over them). Keys are loaded
/// [`CHUNK`] at a time and scored with the attention kernel's register-blocked dot products.
#[allow(clippy::too_many_arguments)]
pub fn weights_at(io: &ForwardIo, q: &[f32], rows: usize, positions: &[usize], blocks: &[u32], head: usize, logits: &mut Vec<f32>, out: &mut Vec<f32>) {
    match isa::detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { weights_at_avx2(io, q, rows, positions, blocks, head, logits, out) },
        IsaLevel::Portable => weights_at_generic::<Portable>(io, q, rows, positions, blocks, head, logits, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn weights_at_avx2(io: &ForwardIo, q: &[f32], rows: usize, positions: &[usize], blocks: &[u32], head: usize, logits: &mut Vec<f32>, out: &mut Vec<f32>) {
    weights_at_generic::<super::convert::Avx2>(io, q, rows, positions, blocks, head, logits, out)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weights_at_generic<I: Isa>(io: &ForwardIo, q: &[f32], rows: usize, positions: &[usize], blocks: &[u32], head: usize, logits: &mut Vec<f32>, out: &mut Vec<f32>) {
    let cache = io.cache;
    let (d, bs) = (cache.head_dim, cache.block_size);
    let n = positions.len();
    logits.clear();
    logits.resize(rows * n, 0.0);
    let mut kbuf = vec![0f32; CHUNK * d];
    let mut sc = vec![0f32; rows * CHUNK];
    for (ci, part) in positions.chunks(CHUNK).enumerate() {
        for (jj, &pos) in part.iter().enumerate() {
            // SAFETY: pos <= hi < seq_len, whose blocks were validated.
            unsafe { load_row::<I>(cache.k_row(blocks[pos / bs] as usize, pos % bs, head), cache.dtype, cache.k_dim_stride(), d, &mut kbuf[jj * d..(jj + 1) * d]) };
        }
        I::scores(&mut sc, q, &kbuf, rows, part.len(), d);
        for r in 0..rows {
            for jj in 0..part.len() {
                let mut x = sc[r * CHUNK + jj];
                if io.params.softcap > 0.0 {
                    x = io.params.softcap * (x / io.params.softcap).tanh();
                }
                logits[r * n + ci * CHUNK + jj] = x;
            }
        }
    }
    out.clear();
    out.resize(n, 0.0);
    for r in 0..rows {
        let row = &mut logits[r * n..(r + 1) * n];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f64;
        for x in row.iter_mut() {
            *x = (*x - m).exp();
            z += *x as f64;
        }
        let inv = if z > 0.0 { (1.0 / z) as f32 } else { 0.0 };
        for (o, &x) in out.iter_mut().zip(row.iter()) {
            *o = o.max(x * inv);
        }
    }
}

fn run_item(io: &ForwardIo, s: usize, heads: std::ops::Range<usize>, snap: Option<&Vec<Option<Arc<SnapSelection>>>>, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, bs);
    let p = ctx.pipeline;
    let mut c = Counters::default();
    let nh = heads.len();
    let mut hws = std::mem::take(&mut sc.heads);
    hws.resize_with(nh, HeadWork::default);
    for (hw, head) in hws.iter_mut().zip(heads.clone()) {
        hw.head = head;
        let sel = snap.and_then(|v| v[head].clone());
        c.add(&prepare_head(io, s, lim, blocks, sel, ctx, hw, sc));
    }
    let kv_of = |head: usize| SeqKv { cache, blocks, head };
    let softcap = io.params.softcap;
    match p.art {
        None => {
            // Interleave heads by position window.
            for hw in hws.iter_mut() {
                hw.cursor = 0;
            }
            // Window: about WINDOW selected keys per head per step, whatever the selection's density.
            let positions = (lim.hi + 1 - lim.lo) * hws.len();
            let selected: usize = hws.iter().map(|h| h.cand.tokens()).sum::<usize>().max(1);
            let window = (WINDOW * positions / selected).clamp(WINDOW, 16 * WINDOW).next_power_of_two();
            let mut w0 = lim.lo / window * window;
            while w0 <= lim.hi {
                let w1 = w0 + window;
                for hw in hws.iter_mut() {
                    sc.part.clear();
                    while hw.cursor < hw.merged.len() {
                        let (a, b) = hw.merged[hw.cursor];
                        if a >= w1 {
                            break;
                        }
                        sc.part.push((a.max(w0), b.min(w1)));
                        if b <= w1 {
                            hw.cursor += 1;
                        } else {
                            break;
                        }
                    }
                    let n_tok: usize = sc.part.iter().map(|(a, b)| b - a).sum();
                    let st = hw.st.as_mut().expect("prepared");
                    attend_set(st, &hw.q, &hw.limits, &kv_of(hw.head), &sc.part, n_tok, &mut sc.tokens, softcap);
                    hw.attended += n_tok;
                }
                w0 = w1;
            }
            for hw in hws.iter() {
                c.blocks_visited += hw.cand.units.len() as u64;
            }
        }
        Some(art) => {
            let dims = probe_dims(d, art.probe);
            let steps = hws.iter().map(|h| h.order.len()).max().unwrap_or(0);
            for t in 0..steps {
                for hw in hws.iter_mut() {
                    if !hw.active || t >= hw.order.len() {
                        continue;
                    }
                    let u = hw.cand.units[hw.order[t]];
                    let spans = hw.cand.unit_spans(&u);
                    let n_tok: usize = spans.iter().map(|(a, b)| b - a).sum();
                    let st = hw.st.as_mut().expect("prepared");
                    attend_set(st, &hw.q, &hw.limits, &kv_of(hw.head), spans, n_tok, &mut sc.tokens, softcap);
                    hw.attended += n_tok;
                    hw.visited += 1;
                    sc.probe.clear();
                    for r in 0..g {
                        let l = st.l[r];
                        for &i in &dims {
                            sc.probe.push(if l > 0.0 { st.acc[r * d + i] / l } else { f32::NAN });
                        }
                    }
                    if hw.art.observe(&sc.probe, dims.len(), art.tau, art.phi, art.patience) {
                        hw.active = false;
                    }
                }
            }
            for hw in hws.iter() {
                c.blocks_visited += hw.visited as u64;
                c.blocks_skipped_termination += (hw.cand.units.len() - hw.visited) as u64;
            }
        }
    }
    if let Some(log) = ctx.visits {
        let recs = hws.iter().map(|hw| VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: hw.head, spans: visited_spans(hw, p.art.is_some()) });
        log.lock().expect("visit log").extend(recs);
    }
    let row_bytes = (2 * d * cache.dtype.size_bytes()) as u64;
    sc.row.resize(d, 0.0);
    for hw in hws.iter() {
        c.kv_bytes_read += hw.attended as u64 * row_bytes;
        io.store_rows(hw.st.as_ref().expect("prepared"), sd.q_start..sd.q_start + 1, hw.head, &mut sc.row);
    }
    sc.heads = hws;
    c
}

/// The sorted spans one head attended: all candidates, or under ART the units visited before it stopped.
fn visited_spans(hw: &HeadWork, art: bool) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = if art {
        hw.order[..hw.visited].iter().flat_map(|&u| hw.cand.unit_spans(&hw.cand.units[u]).iter().copied()).collect()
    } else {
        hw.cand.spans.clone()
    };
    v.sort_unstable();
    v
}

/// Select and prune for one KV head; leaves the candidates (and, under ART, the visiting order) in `hw`.
/// Returns the counters of these stages (metadata bytes read, top-p counts, eligible blocks).
#[allow(clippy::too_many_arguments)]
fn prepare_head(io: &ForwardIo, s: usize, lim: RowLimits, blocks: &[u32], snap: Option<Arc<SnapSelection>>, ctx: &SparseCtx, hw: &mut HeadWork, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let head = hw.head;
    let p = ctx.pipeline;
    let mut c = Counters { policy_rows: 1, ..Default::default() };
    c.blocks_eligible = (lim.hi / bs - lim.lo / bs + 1) as u64;
    let mut meta_bytes = 0u64;
    hw.q.resize(g * d, 0.0);
    io.load_queries(sd.q_start..sd.q_start + 1, head, &mut hw.q);
    io.limits(sd, sd.q_start..sd.q_start + 1, &mut hw.limits);
    hw.active = true;
    hw.visited = 0;
    hw.attended = 0;
    hw.art.reset();
    match &mut hw.st {
        Some(st) if st.rows == g => st.reset(),
        slot => {
            *slot = Some(RowsState::new(g, d));
        }
    }

    // 1. Select.
    match p.selector {
        Selector::All => select::all(&mut hw.cand, lim.lo, lim.hi, bs),
        Selector::Streaming { sink, recent } => select::streaming(&mut hw.cand, lim.lo, lim.hi, sink, recent, bs),
        Selector::Quest { budget, page } => {
            let meta = ctx.meta.expect("engine checked quest metadata");
            let first_page = lim.lo / page;
            meta_bytes += quest_page_scores(&hw.q, g, d, lim, page, blocks, head, meta, &mut sc.page_scores);
            let kept = select::quest_pages(&sc.page_scores, first_page, budget, page);
            select::quest(&mut hw.cand, &kept, &sc.page_scores, first_page, lim.lo, lim.hi, page, bs);
        }
        Selector::SnapKv { .. } => match &snap {
            Some(sel) => {
                // Chosen prompt positions, then everything from the end of the prompt on (generated
                // tokens); the row's own position is always attended, even if the sequence is now shorter
                // than the prompt the choice was made for.
                let cut = sel.prefill_len.min(lim.hi).max(lim.lo);
                let fixed = sel.keep.iter().map(|&t| t as usize).filter(|&t| t >= lim.lo && t < cut);
                let generated = cut..lim.hi + 1;
                hw.cand.from_tokens(fixed.chain(generated), bs, 1, |_| f32::NAN);
            }
            // No prefill was seen for this sequence and layer: nothing to choose from, attend everything.
            None => select::all(&mut hw.cand, lim.lo, lim.hi, bs),
        },
        Selector::Speculate(_) | Selector::Refresh(_) | Selector::Predictor(_) => unreachable!("stateful selectors run in their own item functions"),
    }

    // 2. Prune: Twilight top-p on INT4 estimates.
    if let Some(tp) = p.top_p {
        let meta = ctx.meta.expect("engine checked int4 metadata");
        sc.tokens.clear();
        for &(a, b) in &hw.cand.spans {
            sc.tokens.extend(a as u32..b as u32);
        }
        let n = sc.tokens.len();
        c.top_p_candidates += n as u64;
        meta_bytes += (n * (code_bytes(d) + 8)) as u64;
        estimate_weights(&hw.q, g, d, &sc.tokens, blocks, bs, head, meta, io.params.softcap, &mut sc.p_rows);
        let kept = top_p::select(&sc.p_rows, g, n, tp.p, &mut sc.w, &mut sc.keep);
        c.top_p_kept += kept as u64;
        // Rebuild the units from the kept tokens; a unit's priority becomes its estimated mass.
        let mut mass: Vec<(usize, f32)> = Vec::new();
        for (j, &t) in sc.tokens.iter().enumerate() {
            if !sc.keep[j] {
                continue;
            }
            let wj = (0..g).map(|r| sc.p_rows[r * n + j]).fold(0f32, f32::max);
            let blk = t as usize / bs;
            match mass.last_mut() {
                Some(m) if m.0 == blk => m.1 += wj,
                _ => mass.push((blk, wj)),
            }
        }
        let kept_iter = sc.tokens.iter().zip(&sc.keep).filter(|(_, &k)| k).map(|(&t, _)| t as usize);
        let score = |blk: usize| mass.binary_search_by_key(&blk, |m| m.0).map_or(f32::NAN, |i| mass[i].1);
        hw.cand.from_tokens(kept_iter, bs, 1, score);
    }

    // 3. Order (ART) or coalesce (units split spans at block boundaries; merge them so chunks stay full).
    match p.art {
        Some(art) => order_units(&hw.cand, art.order, &mut hw.order),
        None => {
            hw.merged.clear();
            for &(a, b) in &hw.cand.spans {
                match hw.merged.last_mut() {
                    Some(l) if l.1 == a => l.1 = b,
                    _ => hw.merged.push((a, b)),
                }
            }
        }
    }
    c.kv_bytes_read = meta_bytes;
    c
}

/// Attends a set of spans: as spans when runs are long, as a token list (full chunks) when scattered.
#[allow(clippy::too_many_arguments)]
fn attend_set(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], n_tok: usize, tokens: &mut Vec<u32>, softcap: f32) {
    if spans.is_empty() {
        return;
    }
    if n_tok >= MIN_RUN_FOR_SPANS * spans.len() {
        attend_spans(st, q, limits, kv, spans, softcap);
    } else {
        tokens.clear();
        for &(a, b) in spans {
            tokens.extend(a as u32..b as u32);
        }
        attend_tokens(st, q, limits, kv, tokens, softcap);
    }
}

/// Quest's upper bound of `q·k` over a page with channel-wise key bounds `[mn, mx]`:
/// `Σ_i max(q_i·mn_i, q_i·mx_i)`, which is `>=` the score of every key in the page. Eight lanes, so the
/// sum vectorises.
#[inline(always)]
pub fn quest_bound(q: &[f32], mn: &[f32], mx: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (qc, ac, bc) = (q.chunks_exact(8), mn.chunks_exact(8), mx.chunks_exact(8));
    let tail: f32 = qc.remainder().iter().zip(ac.remainder()).zip(bc.remainder()).map(|((&x, &a), &b)| (x * a).max(x * b)).sum();
    for ((x, a), b) in qc.zip(ac).zip(bc) {
        for l in 0..8 {
            acc[l] += (x[l] * a[l]).max(x[l] * b[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Bounds of the pages `lo/page ..= hi/page` (max over the group's rows and over the page's units) into
/// `out`; returns the metadata bytes read.
#[allow(clippy::too_many_arguments)]
pub fn quest_page_scores(q: &[f32], rows: usize, d: usize, lim: RowLimits, page: usize, blocks: &[u32], head: usize, meta: &LayerMeta, out: &mut Vec<f32>) -> u64 {
    match isa::detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { quest_scores_avx2(q, rows, d, lim, page, blocks, head, meta, out) },
        IsaLevel::Portable => quest_scores_generic::<Portable>(q, rows, d, lim, page, blocks, head, meta, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn quest_scores_avx2(q: &[f32], rows: usize, d: usize, lim: RowLimits, page: usize, blocks: &[u32], head: usize, meta: &LayerMeta, out: &mut Vec<f32>) -> u64 {
    quest_scores_generic::<super::convert::Avx2>(q, rows, d, lim, page, blocks, head, meta, out)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn quest_scores_generic<I: Isa>(q: &[f32], rows: usize, d: usize, lim: RowLimits, page: usize, blocks: &[u32], head: usize, meta: &LayerMeta, out: &mut Vec<f32>) -> u64 {
    let (mut mn, mut mx) = (vec![0f32; d], vec![0f32; d]);
    let mut bytes = 0u64;
    out.clear();
    for pg in lim.lo / page..=lim.hi / page {
        let (a, b) = ((pg * page).max(lim.lo), ((pg + 1) * page).min(lim.hi + 1));
        let mut best = f32::NEG_INFINITY;
        let mut u0 = a / meta.unit;
        while u0 * meta.unit < b {
            let (blk, u) = (u0 / meta.units_per_block, u0 % meta.units_per_block);
            let (mnb, mxb) = meta.unit_minmax(blocks[blk] as usize, u, head);
            // SAFETY: both slices hold `d` fp16 values.
            unsafe {
                I::f16_to_f32(mnb.as_ptr(), &mut mn, d);
                I::f16_to_f32(mxb.as_ptr(), &mut mx, d);
            }
            for r in 0..rows {
                best = best.max(quest_bound(&q[r * d..(r + 1) * d], &mn, &mx));
            }
            bytes += (2 * d * 2) as u64;
            u0 += 1;
        }
        out.push(best);
    }
    bytes
}

/// Estimated softmax weights (`rows × n`, each row normalised to sum 1) of the candidate `tokens` from the
/// INT4 copy of K; `q` holds the scaled query rows. Codes are unpacked 32 tokens at a time and scored with
/// the same register-blocked kernel as exact attention: `q·k̂ = min·Σq + scale·(q·codes)`.
#[allow(clippy::too_many_arguments)]
pub fn estimate_weights(q: &[f32], rows: usize, d: usize, tokens: &[u32], blocks: &[u32], bs: usize, head: usize, meta: &LayerMeta, softcap: f32, out: &mut Vec<f32>) {
    match isa::detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { estimate_avx2(q, rows, d, tokens, blocks, bs, head, meta, softcap, out) },
        IsaLevel::Portable => estimate_generic::<Portable>(q, rows, d, tokens, blocks, bs, head, meta, softcap, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn estimate_avx2(q: &[f32], rows: usize, d: usize, tokens: &[u32], blocks: &[u32], bs: usize, head: usize, meta: &LayerMeta, softcap: f32, out: &mut Vec<f32>) {
    estimate_generic::<super::convert::Avx2>(q, rows, d, tokens, blocks, bs, head, meta, softcap, out)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn estimate_generic<I: Isa>(q: &[f32], rows: usize, d: usize, tokens: &[u32], blocks: &[u32], bs: usize, head: usize, meta: &LayerMeta, softcap: f32, out: &mut Vec<f32>) {
    let n = tokens.len();
    out.clear();
    out.resize(rows * n, 0.0);
    let sums: Vec<f32> = (0..rows).map(|r| q[r * d..(r + 1) * d].iter().sum()).collect();
    let mut kbuf = vec![0f32; CHUNK * d];
    let mut sc = vec![0f32; rows * CHUNK];
    let mut prm = [(0f32, 0f32); CHUNK];
    for (ci, part) in tokens.chunks(CHUNK).enumerate() {
        for (jj, &t) in part.iter().enumerate() {
            let t = t as usize;
            let (codes, mn, scl) = meta.row_q4(blocks[t / bs] as usize, t % bs, head);
            prm[jj] = (mn, scl);
            for (pair, &byte) in kbuf[jj * d..(jj + 1) * d].chunks_exact_mut(2).zip(codes) {
                pair[0] = (byte & 15) as f32;
                pair[1] = (byte >> 4) as f32;
            }
        }
        I::scores(&mut sc, q, &kbuf, rows, part.len(), d);
        for r in 0..rows {
            for (jj, &(mn, scl)) in prm[..part.len()].iter().enumerate() {
                let mut x = mn * sums[r] + scl * sc[r * CHUNK + jj];
                if softcap > 0.0 {
                    x = softcap * (x / softcap).tanh();
                }
                out[r * n + ci * CHUNK + jj] = x;
            }
        }
    }
    for r in 0..rows {
        let row = &mut out[r * n..(r + 1) * n];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for x in row.iter_mut() {
            *x = fast_exp(*x - m);
            z += *x;
        }
        if z > 0.0 {
            let inv = 1.0 / z;
            for x in row.iter_mut() {
                *x *= inv;
            }
        }
    }
}
