//! AttentionPredictor on the CPU: the history seeded at a prefill chunk, the decode row, and the history
//! row (moved from src/cpu/sparse/{stateful,predictor_row}.rs).
//!
//! AttentionPredictor's history row in the decisions' fixed arithmetic, so that the CUDA engine
//! (kernels/predictor.cu) pushes the same bits and its CNN therefore predicts, and selects, the same
//! blocks: logits `decision_softcap(decision_dot(q, k))`, numerators `fast_exp(x − max)` (the max ignores
//! NaN), the normaliser as the exact fixed-point sum `softmax_norm`, weights `f32(e / z)` computed in f64,
//! and the row value of a block the largest weight of its positions over the GQA group (NaN never wins;
//! blocks with no listed position are 0). Every step of it is independent of the order positions are
//! visited in, which lets the device spread a row over many CTAs.

use crate::cpu::sparse::*;
use crate::policy::predictor::{self, PredictorHead};
use crate::policy::refresh;
use super::PredictorSpec;
use crate::cpu::math::{decision_dot, decision_softcap, softmax_norm};

/// AttentionPredictor's history seeded from a prefill chunk: the true block rows of the chunk's last
/// `history` query rows (in the decisions' arithmetic, [`history_row`]).
pub fn predictor_seed(io: &ForwardIo, s: usize, head: usize, ps: &PredictorSpec) -> PredictorHead {
    let (d, g) = (io.cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    let blocks = io.batch.blocks(s, io.cache.block_size);
    let t_end = sd.q_start + sd.q_len;
    let t0 = t_end - sd.q_len.min(ps.history);
    let mut q = vec![0f32; g * d];
    let mut lims = Vec::new();
    let mut logits = Vec::new();
    let mut ph = PredictorHead::default();
    for t in t0..t_end {
        io.load_queries(t..t + 1, head, &mut q);
        io.limits(sd, t..t + 1, &mut lims);
        let lim = lims[0];
        let pos: Vec<usize> = (lim.lo..=lim.hi).collect();
        ph.push(history_row(io, &q, g, &pos, blocks, head, lim.hi + 1, ps.block, &mut logits), ps.history);
    }
    ph
}

/// AttentionPredictor for the heads of one item: attends the sink, the local window and the blocks the
/// CNN predicts. The row appended to the history is, on a calibration step (every `calib`-th), the full
/// attention row (a scoring pass over every key; the output stays the sparse one), else the block row of
/// the attended tokens' weights. A row with no history yet (no prefill seen) attends everything.
pub(crate) fn run_predictor(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, ps: &PredictorSpec, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, g) = (cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, cache.block_size);
    let state = state_of(ctx, i);
    let weights = ctx.policy_data.and_then(|d| d.downcast_ref::<predictor::PredictorWeights>()).expect("the engine loads the predictor's weights with the policy");
    let softcap = io.params.softcap;
    let n = lim.hi + 1;
    for_each_policy_head(io, s, heads, ctx, sc, |head, hw, kv, sc, c| {
        let mut ph = state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).take::<super::PredictorHead>().unwrap_or_default();
        ph.since_calib += 1;
        let no_history = ph.rows.is_empty();
        let calibrate = no_history || ph.since_calib >= ps.calib;
        if calibrate {
            ph.since_calib = 0;
            c[refresh::FULL_STEPS] += 1;
        } else {
            c[refresh::PARTIAL_STEPS] += 1;
        }
        let spans: Vec<(usize, usize)> = if no_history {
            vec![(lim.lo, n)]
        } else {
            let nb = n.div_ceil(ps.block);
            let (start, width) = predictor::crop(nb, ps.block, ps.sink, ps.local);
            let pred = weights.predict_cached(&mut ph, ps.history, start, width);
            let mut scores = vec![f32::NEG_INFINITY; nb];
            scores[start..start + width].copy_from_slice(&pred);
            let mut v: Vec<(usize, usize)> = predictor::select(&scores, n, ps.budget, ps.block, ps.sink, ps.local).into_iter().map(|(a, b)| (a.max(lim.lo), b)).filter(|(a, b)| a < b).collect();
            normalize_spans(&mut v);
            v
        };
        let n_tok = span_tokens(&spans);
        let st = hw.st.as_mut().expect("loaded");
        attend_set(st, &hw.q, &hw.limits, kv, &spans, n_tok, &mut sc.tokens, softcap);
        // The history row: every visible position's weight on a calibration step, else the attended ones'.
        let pos: Vec<usize> = if calibrate { (lim.lo..n).collect() } else { spans.iter().flat_map(|&(a, b)| a..b).collect() };
        ph.push(history_row(io, &hw.q, g, &pos, blocks, head, n, ps.block, &mut sc.p_rows), ps.history);
        // K and V of the attended tokens, K again for the history row's weights.
        c.kv_bytes_read += ((n_tok * 2 + pos.len()) * d * cache.dtype.size_bytes()) as u64;
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).put(ph);
        HeadVisit { read: spans, used: None }
    })
}

/// The block row (`ceil(n / block)` blocks) of the weights of the `g` query rows `q` (scaled, `g × d`)
/// over `positions` (each `< n`, normalised over them) of sequence `blocks`, KV head `head`.
#[allow(clippy::too_many_arguments)]
pub fn history_row(io: &ForwardIo, q: &[f32], g: usize, positions: &[usize], blocks: &[u32], head: usize, n: usize, block: usize, logits: &mut Vec<f32>) -> Vec<f32> {
    let cache = io.cache;
    let (d, bs) = (cache.head_dim, cache.block_size);
    let np = positions.len();
    logits.clear();
    logits.resize(g * np, f32::NEG_INFINITY);
    let mut k = vec![0f32; d];
    for (j, &pos) in positions.iter().enumerate() {
        // SAFETY: pos < n <= seq_len, whose blocks were validated.
        unsafe { load_cache_row::<Portable>(cache.k_row(blocks[pos / bs] as usize, pos % bs, head), cache.dtype, cache.k_scale, cache.k_dim_stride(), d, &mut k) };
        for r in 0..g {
            logits[r * np + j] = decision_softcap(decision_dot(&q[r * d..(r + 1) * d], &k), io.params.softcap);
        }
    }
    let mut row = vec![0f32; n.div_ceil(block)];
    for r in 0..g {
        let l = &mut logits[r * np..(r + 1) * np];
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            continue;
        }
        for x in l.iter_mut() {
            *x = fast_exp(*x - m);
        }
        let z = softmax_norm(l.iter().copied());
        for (&e, &pos) in l.iter().zip(positions) {
            let w = (e as f64 / z) as f32;
            let b = pos / block;
            if w > row[b] {
                row[b] = w;
            }
        }
    }
    row
}

impl CpuStage for PredictorSpec {
    /// Seeds each prefill sequence's and KV head's history from the chunk's last query rows.
    fn prefill(&self, cx: &PrefillCx) -> crate::error::Result<Counters> {
        use rayon::prelude::*;
        let (io, hk) = (cx.io, cx.cfg.num_kv_heads);
        let items: Vec<(usize, usize)> = cx.calib_seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
        let seeded: Vec<_> = cx.pool.install(|| items.par_iter().map(|&(s, h)| predictor_seed(io, s, h, self)).collect());
        for (&(s, h), ph) in items.iter().zip(seeded) {
            let st = cx.sequences.get_or_create(io.batch.seqs[s].seq_id);
            st.lock().policy.head_mut(cx.layer, h, hk).put(Box::new(ph));
        }
        Ok(Counters::default())
    }

    fn prefill_reads_meta(&self) -> bool {
        true
    }

    fn run_item(&self, io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, _decided: bool, ctx: &SparseCtx, sc: &mut Scratch) -> Option<Counters> {
        Some(run_predictor(io, s, i, heads, self, ctx, sc))
    }
}
