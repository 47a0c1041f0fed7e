//! Decode rows of the stateful policies: PRR speculate/repair, AttentionPredictor and RefreshKV, plus
//! the prefill-time setup (PRR calibration, predictor history) the engine runs on prefill chunks.

use super::*;

/// PRR for the heads of one item: speculate (attend the predicted pages, one partial state each), compute
/// the true Quest selection, repair (attend the missed pages), merge exactly through the LSE. Predicted
/// pages outside the true set are dropped from the merge unless `extra=keep`, so by default the output is
/// attention over the true set whatever the prediction.
pub(super) fn run_speculate(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, sp: &Speculate, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
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
        let truth = select::quest_pages(&sc.page_scores, first, sp.quest_budget, page, sp.quest_sink);
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
            log.lock().expect("visit log").push(VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: head, spans: page_spans(&used, page, lim.lo, lim.hi), art_tiles: None });
        }
        prr.update(first, &sc.page_scores, &truth);
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).prr = Some(prr);
        sc.row.resize(d, 0.0);
        io.store_rows(hw.st.as_ref().expect("loaded"), sd.q_start..sd.q_start + 1, head, &mut sc.row);
    }
    sc.heads = hws;
    c
}

/// PRR calibration for prefill sequence `s` and `head`: the Quest page scores of [`CALIB_ROWS`] query rows
/// sampled with an even stride over the whole chunk (ending at its last row; every row when the chunk is
/// shorter) form the trajectory; returns the warm predictor and the calibration's hit rate.
pub fn prr_calibrate(io: &ForwardIo, s: usize, head: usize, sp: &Speculate, meta: &LayerMeta, spec_budgets: Option<&SpecBudgetTable>) -> (PrrHead, f64) {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let blocks = io.batch.blocks(s, bs);
    let rows = calib_rows(sd.q_start, sd.q_len, CALIB_ROWS);
    let mut q = vec![0f32; g * d];
    let mut lims = Vec::new();
    let mut traj: Vec<TrajStep> = Vec::with_capacity(rows.len());
    for t in rows {
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

/// RefreshKV's partial set initialised at a prefill chunk, as the paper's prefilling stage does: the
/// attention of the chunk's last query row (softmax weights per query head, max over the GQA group,
/// max-pooled over `pool` neighbours) picks the top `k` positions it can see.
pub fn refresh_seed(io: &ForwardIo, s: usize, head: usize, r: &Refresh) -> RefreshHead {
    let (d, g) = (io.cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    let blocks = io.batch.blocks(s, io.cache.block_size);
    let t = sd.q_start + sd.q_len - 1;
    let mut q = vec![0f32; g * d];
    let mut lims = Vec::new();
    io.load_queries(t..t + 1, head, &mut q);
    io.limits(sd, t..t + 1, &mut lims);
    let lim = lims[0];
    let mut w = Vec::new();
    refresh_weights(io, &q, g, lim, blocks, head, &mut w);
    let mut rh = RefreshHead::default();
    rh.rebuild(&max_pool(&w, r.pool), lim.lo, lim.hi, r.k);
    rh
}

/// RefreshKV's scores of one query row: the softmax weight of every visible position `lim.lo ..= lim.hi`
/// for each of the group's `rows` query heads (`q`: scaled rows), the maximum over the group (from 0, NaN
/// dropped as `f32::max` does), into `out[pos - lo]`. In the decisions' fixed arithmetic, as SnapKV's
/// choice (`cpu::snapkv`): `decision_dot`, `decision_softcap`, `fast_exp(x - max)`, the order-free
/// fixed-point normaliser `softmax_norm`, `w = f32(e / z)`; the CUDA kernel `kvs_refresh_scores`
/// (kernels/refresh.cu) computes the same bits, so both engines rebuild the same token sets.
pub fn refresh_weights(io: &ForwardIo, q: &[f32], rows: usize, lim: RowLimits, blocks: &[u32], head: usize, out: &mut Vec<f32>) {
    use crate::cpu::math::{decision_dot, decision_softcap, softmax_norm};
    let cache = io.cache;
    let (d, bs) = (cache.head_dim, cache.block_size);
    out.clear();
    if lim.hi < lim.lo {
        return;
    }
    let n = lim.hi + 1 - lim.lo;
    out.resize(n, 0.0);
    let mut logits = vec![0f32; rows * n];
    let mut k = vec![0f32; d];
    for j in 0..n {
        let pos = lim.lo + j;
        // SAFETY: pos <= hi < seq_len, whose blocks were validated.
        unsafe { load_row::<Portable>(cache.k_row(blocks[pos / bs] as usize, pos % bs, head), cache.dtype, cache.k_dim_stride(), d, &mut k) };
        for r in 0..rows {
            logits[r * n + j] = decision_softcap(decision_dot(&q[r * d..(r + 1) * d], &k), io.params.softcap);
        }
    }
    for r in 0..rows {
        let row = &mut logits[r * n..(r + 1) * n];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            continue;
        }
        for x in row.iter_mut() {
            *x = fast_exp(*x - m);
        }
        let z = softmax_norm(row.iter().copied());
        for (o, &e) in out.iter_mut().zip(row.iter()) {
            *o = o.max(0f32 + (e as f64 / z) as f32);
        }
    }
}

/// Mean query over all query heads of row `t` (RefreshKV's schedule compares it between steps).
pub fn mean_query(io: &ForwardIo, t: usize) -> Vec<f32> {
    let (d, g) = (io.cache.head_dim, io.group());
    let mut qm = vec![0f32; d];
    let mut buf = vec![0f32; g * d];
    for h in 0..io.num_kv_heads {
        io.load_queries(t..t + 1, h, &mut buf);
        for row in buf.chunks_exact(d) {
            for (m, &x) in qm.iter_mut().zip(row) {
                *m += x;
            }
        }
    }
    qm
}

/// AttentionPredictor's history seeded from a prefill chunk: the true block rows of the chunk's last
/// `history` query rows (in the decisions' arithmetic, [`super::history_row`]).
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
        ph.push(super::history_row(io, &q, g, &pos, blocks, head, lim.hi + 1, ps.block, &mut logits), ps.history);
    }
    ph
}

/// AttentionPredictor for the heads of one item: attends the sink, the local window and the blocks the
/// CNN predicts. The row appended to the history is, on a calibration step (every `calib`-th), the full
/// attention row (a scoring pass over every key; the output stays the sparse one), else the block row of
/// the attended tokens' weights. A row with no history yet (no prefill seen) attends everything.
pub(super) fn run_predictor(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, ps: &PredictorSpec, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, bs);
    let state = state_of(ctx, i);
    let weights = ctx.predictor.expect("the engine loads the predictor's weights with the policy");
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
        let no_history = ph.rows.is_empty();
        let calibrate = no_history || ph.since_calib >= ps.calib;
        if calibrate {
            ph.since_calib = 0;
            c.refresh_full_steps += 1;
        } else {
            c.refresh_partial_steps += 1;
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
        attend_set(st, &hw.q, &hw.limits, &kv, &spans, n_tok, &mut sc.tokens, softcap);
        // The history row: every visible position's weight on a calibration step, else the attended ones'.
        let pos: Vec<usize> = if calibrate { (lim.lo..n).collect() } else { spans.iter().flat_map(|&(a, b)| a..b).collect() };
        ph.push(super::history_row(io, &hw.q, g, &pos, blocks, head, n, ps.block, &mut sc.p_rows), ps.history);
        // K and V of the attended tokens, K again for the history row's weights.
        c.kv_bytes_read += ((n_tok * 2 + pos.len()) * d * cache.dtype.size_bytes()) as u64;
        hw.cand.from_spans(&spans, bs, 1, |_| f32::NAN);
        c.blocks_visited += hw.cand.units.len() as u64;
        if let Some(log) = ctx.visits {
            log.lock().expect("visit log").push(VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: head, spans, art_tiles: None });
        }
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).predictor = Some(ph);
        sc.row.resize(d, 0.0);
        io.store_rows(hw.st.as_ref().expect("loaded"), sd.q_start..sd.q_start + 1, head, &mut sc.row);
    }
    sc.heads = hws;
    c
}

/// RefreshKV for the heads of one item: a full step attends everything, scores every position and
/// rebuilds the set; a partial step attends the set only.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_refresh(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, r: &Refresh, full: bool, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
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
            refresh_weights(io, &hw.q, g, lim, blocks, head, &mut sc.w);
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
            log.lock().expect("visit log").push(VisitRecord { layer: 0, seq_id: sd.seq_id, kv_head: head, spans, art_tiles: None });
        }
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).refresh = Some(rh);
        sc.row.resize(d, 0.0);
        io.store_rows(hw.st.as_ref().expect("loaded"), sd.q_start..sd.q_start + 1, head, &mut sc.row);
    }
    sc.heads = hws;
    c
}

#[cfg(test)]
mod tests {
    use crate::policy::speculate::calib_rows;

    #[test]
    fn calibration_rows_are_strided_over_the_whole_chunk() {
        assert_eq!(calib_rows(10, 5, 64), vec![10, 11, 12, 13, 14]);
        let r = calib_rows(100, 1000, 64);
        assert_eq!(r.len(), 64);
        assert_eq!(*r.last().unwrap(), 1099, "ends at the chunk's last row");
        assert!(r[0] >= 100 && r[0] < 100 + 1000 / 64 + 1, "starts near the chunk's first row: {}", r[0]);
        assert!(r.windows(2).all(|w| w[1] - w[0] >= 15 && w[1] - w[0] <= 16), "{r:?}");
    }
}
