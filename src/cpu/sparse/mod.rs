//! Runs a policy pipeline for the decode rows of one forward call on the CPU: per (sequence, KV head), in
//! parallel on the engine's pool, select → prune → order/terminate (a later stage's [`CpuTraversal`]), and
//! attend exactly over what is left with the same kernel dense attention uses ([`attend_spans`] /
//! [`attend_tokens`]).
//!
//! The scoring kernels the decisions share (Twilight's INT4 estimate, exact weights for full steps) are
//! in [`scoring`].

mod scoring;
mod stage;

pub(crate) use stage::{CpuLaterStage, CpuPipeline, CpuStage, CpuTraversal, PrefillCx, SelectCx, MAX_LATER_STAGES};
pub use scoring::{estimate_weights, token_weights, weights_at};

pub(crate) use std::sync::Arc;

pub(crate) use super::attention::{attend_spans_at, attend_tokens_at, RowLimits, RowsState, SeqKv, CHUNK};
pub(crate) use super::convert::{Isa, Portable};
pub(crate) use super::isa::{self, IsaLevel};
pub(crate) use super::forward::ForwardIo;
pub(crate) use super::math::fast_exp;
pub(crate) use super::metadata::LayerMeta;
pub(crate) use super::quantize::code_bytes;
pub(crate) use super::spin_pool::SpinPool;
pub(crate) use super::convert::load_cache_row;
pub(crate) use crate::policy::select::{max_pool, normalize_spans, Candidates};
pub(crate) use crate::policy::HeadPlan;
pub(crate) use crate::sequences::SequenceState;
pub(crate) use crate::stats::{Counters, VisitRecord};

/// A decode row's read-only share of its (sequence, layer, head) state (the `held` method of `CpuStage`).
pub(crate) type Held = Arc<dyn std::any::Any + Send + Sync>;

/// Per-sequence state handles of the decode sequences (same order as `seqs`).
pub type SeqStates = Vec<Option<Arc<parking_lot::Mutex<SequenceState>>>>;

/// Everything one call's policy rows need besides the caller's tensors.
pub struct SparseCtx<'a> {
    pub(crate) pipeline: &'a dyn CpuPipeline,
    /// The pipeline's selector as a CPU stage (the registry's `cpu()`, src/policy/registry.rs).
    pub(crate) stage: &'a dyn CpuStage,
    /// Layer metadata (Quest min/max, INT4 K), present when the pipeline needs it.
    pub meta: Option<&'a LayerMeta>,
    /// The stage's `held` state per decode sequence (same order as `seqs`), one entry per KV head.
    pub(crate) held: Vec<Vec<Option<Held>>>,
    /// When set, each policy row appends the spans it attended (evaluation only; off when serving).
    pub visits: Option<&'a std::sync::Mutex<Vec<VisitRecord>>>,
    /// The engine layer of this call (stateful policies key their state by it).
    pub layer: usize,
    /// Per-sequence state of each decode sequence (stateful policies; empty otherwise).
    pub states: SeqStates,
    /// What the caller set for the policy at run time (`Engine::set_policy_input`).
    pub policy_input: Option<&'a (dyn std::any::Any + Send + Sync)>,
    /// What the policy loaded for the engine's life (`Policy::cpu_data`: the predictor's weights).
    pub policy_data: Option<&'a (dyn std::any::Any + Send + Sync)>,
}

/// One KV head's work inside an item: its query rows, candidates, accumulators and traversal state.
#[derive(Default)]
pub(crate) struct HeadWork {
    pub(crate) head: usize,
    pub(crate) q: Vec<f32>,
    pub(crate) limits: Vec<RowLimits>,
    /// The row's plan (what the selector and top-p chose), and the candidate units built from it.
    pub(crate) plan: HeadPlan,
    pub(crate) cand: Candidates,
    pub(crate) st: Option<RowsState>,
    /// A priority per plan entry (NaN: none), for a later stage's visiting order.
    pub(crate) entry_score: Vec<f32>,
    /// The candidates' spans, adjacent ones merged (the attention in position order).
    pub(crate) merged: Vec<(usize, usize)>,
    /// A later stage's own work on this head when it orders and terminates the traversal
    /// ([`CpuTraversal`]; its type is the stage's, kept here so a decode loop reuses its buffers).
    pub(crate) traversal: Option<Box<dyn std::any::Any + Send>>,
    /// Blocks whose keys were read, and keys attended.
    pub(crate) visited: usize,
    pub(crate) attended: usize,
    pub(crate) cursor: usize,
}

/// Reusable per-thread buffers, so a steady decode loop allocates little.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) heads: Vec<HeadWork>,
    pub(crate) row: Vec<f32>,
    pub(crate) page_scores: Vec<f32>,
    pub(crate) p_rows: Vec<f32>,
    pub(crate) w: Vec<f32>,
    pub(crate) keep: Vec<bool>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) part: Vec<(usize, usize)>,
    /// PRR: one partial state per speculated page.
    pub(crate) pages: Vec<RowsState>,
    pub(crate) repair: Option<RowsState>,
}

/// Below this many tokens per span on average, a selection is attended as a token list (full chunks).
pub(crate) const MIN_RUN_FOR_SPANS: usize = 8;

/// Selected keys per head per step when the KV heads of an item are interleaved: every head's selected
/// keys in one position window are consumed before the next window, so the cache is read roughly in
/// address order while chunks stay full (the window widens for sparse selections).
pub(crate) const WINDOW: usize = 64;

/// Policy attention for the decode sequences `seqs` (indices into the batch); returns the counters.
///
/// Work items are (sequence, group of KV heads): heads are grouped so there are about two items per
/// thread, and inside an item the heads are interleaved (by position window, or step by step under
/// ART), since one head's rows alone are scattered over the cache. They run on the dense path's pool, so
/// inside PyTorch on its OpenMP team (see `cpu::host_omp`).
pub fn sparse_forward(io: &ForwardIo, seqs: &[usize], ctx: &SparseCtx, pool: &SpinPool) -> Counters {
    let hk = io.num_kv_heads;
    let threads = pool.threads();
    let per_item = (seqs.len() * hk).div_ceil(2 * threads).clamp(1, hk);
    let mut items: Vec<(usize, usize, usize)> = Vec::new();
    for i in 0..seqs.len() {
        let mut h0 = 0;
        while h0 < hk {
            items.push((i, h0, (h0 + per_item).min(hk)));
            h0 += per_item;
        }
    }
    // Per-sequence decisions the heads share (RefreshKV's full or partial step), before the heads run.
    let mut pre = Counters::default();
    let decided: Vec<bool> = seqs.iter().enumerate().map(|(i, &s)| ctx.stage.decide_sequence(io, s, ctx, i, &mut pre)).collect();
    let run = |sc: &mut Scratch, &(i, h0, h1): &(usize, usize, usize)| -> Counters {
        ctx.stage.run_item(io, seqs[i], i, h0..h1, decided[i], ctx, sc).unwrap_or_else(|| run_item(io, seqs[i], h0..h1, ctx.held.get(i), ctx, sc))
    };
    if items.len() <= 1 || threads <= 1 {
        let mut sc = Scratch::default();
        let mut total = pre;
        for it in &items {
            total.add(&run(&mut sc, it));
        }
        return total;
    }
    let counters: Vec<parking_lot::Mutex<Counters>> = items.iter().map(|_| parking_lot::Mutex::new(Counters::default())).collect();
    pool.run(items.len(), &|k| *counters[k].lock() = run(&mut Scratch::default(), &items[k]));
    let mut total = pre;
    for c in counters {
        total.add(&c.into_inner());
    }
    total
}

pub(crate) fn state_of<'a>(ctx: &'a SparseCtx, i: usize) -> &'a Arc<parking_lot::Mutex<SequenceState>> {
    ctx.states.get(i).and_then(|s| s.as_ref()).expect("the engine passes the state of every stateful policy sequence")
}

/// Loads the decode row's scaled queries and limits of `head` into `hw`, and resets its accumulator.
pub(crate) fn load_head(io: &ForwardIo, s: usize, head: usize, hw: &mut HeadWork) {
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

/// The spans a stateful policy's head read (counted as visited blocks) and, when they differ, the spans
/// its output attends (the visit log; PRR reads speculated pages it may drop from the merge).
pub(crate) struct HeadVisit {
    pub read: Vec<(usize, usize)>,
    pub used: Option<Vec<(usize, usize)>>,
}

/// The frame of a stateful policy's decode row `s` (predictor, PRR, RefreshKV), per KV head of `heads`:
/// counts the row and its eligible blocks, loads the head's scaled queries into a `HeadWork`, runs `body`
/// (which takes and puts back its own state, attends into `hw.st` and counts its own reads), then counts
/// the blocks it read, logs the visit and stores the head's output row.
pub(crate) fn for_each_policy_head(
    io: &ForwardIo, s: usize, heads: std::ops::Range<usize>, ctx: &SparseCtx, sc: &mut Scratch,
    mut body: impl FnMut(usize, &mut HeadWork, &SeqKv, &mut Scratch, &mut Counters) -> HeadVisit,
) -> Counters {
    let cache = io.cache;
    let (d, bs) = (cache.head_dim, cache.block_size);
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, bs);
    let mut c = Counters::default();
    let mut hws = std::mem::take(&mut sc.heads);
    hws.resize_with(1, HeadWork::default);
    let hw = &mut hws[0];
    for head in heads {
        c.policy_rows += 1;
        c.blocks_eligible += (lim.hi / bs - lim.lo / bs + 1) as u64;
        load_head(io, s, head, hw);
        let kv = SeqKv { cache, blocks, head };
        let visit = body(head, hw, &kv, sc, &mut c);
        hw.cand.from_spans(&visit.read, bs, 1, |_| f32::NAN);
        c.blocks_visited += hw.cand.units.len() as u64;
        if let Some(log) = ctx.visits {
            let spans = visit.used.unwrap_or(visit.read);
            log.lock().expect("visit log").push(VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: head, spans, traversal_tiles: None });
        }
        sc.row.resize(d, 0.0);
        io.store_rows(hw.st.as_ref().expect("loaded"), sd.q_start..sd.q_start + 1, head, &mut sc.row);
    }
    sc.heads = hws;
    c
}

pub(crate) fn fresh_state(slot: &mut Option<RowsState>, rows: usize, dim: usize) -> &mut RowsState {
    match slot {
        Some(st) if st.rows == rows && st.dim == dim => st.reset(),
        _ => *slot = Some(RowsState::new(rows, dim)),
    }
    slot.as_mut().expect("just set")
}

/// Spans of sorted pages clipped to `lo ..= hi`.
pub(crate) fn page_spans(pages: &[usize], page: usize, lo: usize, hi: usize) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = pages.iter().map(|&p| ((p * page).max(lo), ((p + 1) * page).min(hi + 1))).collect();
    normalize_spans(&mut v);
    v
}

pub(crate) fn span_tokens(spans: &[(usize, usize)]) -> usize {
    spans.iter().map(|(a, b)| b - a).sum()
}

pub(crate) fn run_item(io: &ForwardIo, s: usize, heads: std::ops::Range<usize>, held: Option<&Vec<Option<Held>>>, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, bs) = (cache.head_dim, cache.block_size);
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
        let own = held.and_then(|v| v[head].as_ref());
        c.add(&prepare_head(io, s, lim, blocks, own, ctx, hw, sc));
    }
    let kv_of = |head: usize| SeqKv { cache, blocks, head };
    let softcap = io.params.softcap;
    let traversal = p.cpu_later_stages().into_iter().flatten().find_map(|s| s.traversal());
    if let Some(t) = traversal {
        t.attend(io, blocks, &mut hws, sc, &mut c);
    } else {
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
    if let Some(log) = ctx.visits {
        let recs = hws.iter().map(|hw| {
            let (spans, traversal_tiles) = match traversal {
                Some(t) => {
                    let (spans, tiles) = t.visits(hw);
                    (spans, Some(tiles))
                }
                None => (visited_spans(hw), None),
            };
            VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: hw.head, spans, traversal_tiles }
        });
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

/// The sorted spans one head attended (every candidate: no stage cut its traversal short).
fn visited_spans(hw: &HeadWork) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = hw.cand.spans.clone();
    v.sort_unstable();
    v
}

/// Select and prune for one KV head; leaves the candidates (and a traversing stage's order) in `hw`.
/// Returns the counters of these stages (metadata bytes read, top-p counts, eligible blocks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare_head(io: &ForwardIo, s: usize, lim: RowLimits, blocks: &[u32], held: Option<&Held>, ctx: &SparseCtx, hw: &mut HeadWork, sc: &mut Scratch) -> Counters {
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
    hw.visited = 0;
    hw.attended = 0;
    match &mut hw.st {
        Some(st) if st.rows == g => st.reset(),
        slot => {
            *slot = Some(RowsState::new(g, d));
        }
    }

    // 1. Select: the selector writes the row's plan; the candidates are built from it. Its priority of
    // each plan entry goes to `entry_score` (left empty when the selector has none).
    hw.entry_score.clear();
    let cx = SelectCx { io, lim, blocks, held, ctx };
    let (sink_limit, bytes, built) = ctx.stage.select(&cx, hw, sc);
    meta_bytes += bytes;
    if !built {
        hw.cand.from_plan(&hw.plan, lim.lo, lim.hi, bs, sink_limit, |_| f32::NAN, &mut sc.part);
    }

    // 2. Prune: the later stages' part on the selector's positions (top-p: the plan becomes the kept
    // tokens, each entry's priority its estimated mass).
    for stage in p.cpu_later_stages().into_iter().flatten() {
        meta_bytes += stage.prune(&cx, hw, sc, &mut c);
    }

    // 3. Order (a traversing stage) or coalesce (units split spans at block boundaries; merge them so
    // chunks stay full).
    match p.cpu_later_stages().into_iter().flatten().find_map(|s| s.traversal()) {
        Some(t) => t.order(hw, sink_limit, lim),
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
pub(crate) fn attend_set(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], n_tok: usize, tokens: &mut Vec<u32>, softcap: f32) {
    attend_set_at(isa::detected(), st, q, limits, kv, spans, n_tok, tokens, softcap)
}

/// [`attend_set`] on instruction set `level` (a traversal whose decisions read the running output:
/// [`isa::decisions`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_set_at(level: IsaLevel, st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], n_tok: usize, tokens: &mut Vec<u32>, softcap: f32) {
    if spans.is_empty() {
        return;
    }
    if n_tok >= MIN_RUN_FOR_SPANS * spans.len() {
        attend_spans_at(level, st, q, limits, kv, spans, softcap);
    } else {
        tokens.clear();
        for &(a, b) in spans {
            tokens.extend(a as u32..b as u32);
        }
        attend_tokens_at(level, st, q, limits, kv, tokens, softcap);
    }
}
