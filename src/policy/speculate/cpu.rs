//! PRR on the CPU: calibration at a prefill chunk and the speculate/repair decode row (moved from
//! src/cpu/sparse/stateful.rs).

use crate::cpu::sparse::*;
use crate::policy::speculate::{self, calib_rows, HoltParams, PrrHead, SpecBudgetTable, TrajStep, CALIB_ROWS, DEFAULT_PARAMS};
use super::Speculate;
use crate::policy::quest::cpu::quest_page_scores;

/// The budget table the caller loaded (`Engine::set_speculation_budgets`), if any.
fn budget_table(input: Option<&(dyn std::any::Any + Send + Sync)>) -> Option<&SpecBudgetTable> {
    input.and_then(|t| t.downcast_ref::<SpecBudgetTable>())
}

/// PRR for the heads of one item: speculate (attend the predicted pages, one partial state each), compute
/// the true Quest selection, repair (attend the missed pages), merge exactly through the LSE. Predicted
/// pages outside the true set are dropped from the merge unless `extra=keep`, so by default the output is
/// attention over the true set whatever the prediction.
pub(crate) fn run_speculate(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, sp: &Speculate, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, g) = (cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, cache.block_size);
    let meta = ctx.meta.expect("engine checked quest metadata");
    let state = state_of(ctx, i);
    let page = sp.page;
    let first = lim.lo / page;
    let n_pages = lim.hi / page - first + 1;
    let spec_tokens = budget_table(ctx.policy_input).map_or(sp.budget.unwrap_or(sp.quest_budget), |t| t.budget_for(sd.seq_len));
    let k_spec = spec_tokens.div_ceil(page);
    let softcap = io.params.softcap;
    for_each_policy_head(io, s, heads, ctx, sc, |head, hw, kv, sc, c| {
        let fixed = HoltParams { alpha: sp.alpha.unwrap_or(DEFAULT_PARAMS.alpha), beta: sp.beta.unwrap_or(DEFAULT_PARAMS.beta), gamma: sp.gamma.unwrap_or(DEFAULT_PARAMS.gamma) };
        let mut prr = state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).take::<PrrHead>().unwrap_or_else(|| Box::new(PrrHead::new(fixed)));
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
            attend_set(&mut sc.pages[j], &hw.q, &hw.limits, kv, &span, n, &mut sc.tokens, softcap);
            attended += n;
        }
        // 2. The true selection (Quest), from metadata only.
        c.kv_bytes_read += quest_page_scores(&hw.q, g, d, lim, page, blocks, head, meta, &mut sc.page_scores);
        let truth = crate::policy::quest::cpu::quest_pages(&sc.page_scores, first, sp.quest_budget, page, sp.quest_sink);
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
            attend_set(rep, &hw.q, &hw.limits, kv, &miss_spans, n, &mut sc.tokens, softcap);
            st.merge_from(rep);
            attended += n;
        }
        let hits = speculate::intersection(&pred, &truth);
        c[speculate::PREDICTED_BLOCKS] += pred.len() as u64;
        c[speculate::TRUE_BLOCKS] += truth.len() as u64;
        c[speculate::HIT_BLOCKS] += hits as u64;
        c[speculate::REPAIRED_BLOCKS] += missed.len() as u64;
        c[speculate::REUSE_HIT_BLOCKS] += speculate::intersection(&prr.prev_true, &truth) as u64;
        let mut read = pred.clone();
        read.extend_from_slice(&missed);
        read.sort_unstable();
        c.kv_bytes_read += (attended * 2 * d * cache.dtype.size_bytes()) as u64;
        let used = if sp.keep_extra { None } else { Some(page_spans(&truth, page, lim.lo, lim.hi)) };
        prr.update(first, &sc.page_scores, &truth);
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).put(prr);
        HeadVisit { read: page_spans(&read, page, lim.lo, lim.hi), used }
    })
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

impl CpuStage for Speculate {
    /// Calibrates PRR on Quest's page scores of the prefill chunks' query rows (per sequence and KV head).
    fn prefill(&self, cx: &PrefillCx) -> crate::error::Result<Counters> {
        use rayon::prelude::*;
        let mut c = Counters::default();
        let Some(m) = cx.meta else { return Ok(c) };
        let hk = cx.cfg.num_kv_heads;
        let t0 = std::time::Instant::now();
        let items: Vec<(usize, usize)> = cx.calib_seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
        let warm: Vec<_> = cx.pool.install(|| items.par_iter().map(|&(s, h)| prr_calibrate(cx.io, s, h, self, m, budget_table(cx.policy_input)).0).collect());
        for (&(s, h), w) in items.iter().zip(warm) {
            let st = cx.sequences.get_or_create(cx.io.batch.seqs[s].seq_id);
            st.lock().policy.head_mut(cx.layer, h, hk).put(Box::new(w));
        }
        c[speculate::CALIBRATIONS] += items.len() as u64;
        c[speculate::CALIB_US] += t0.elapsed().as_micros() as u64;
        Ok(c)
    }

    fn prefill_reads_meta(&self) -> bool {
        true
    }

    fn run_item(&self, io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, _decided: bool, ctx: &SparseCtx, sc: &mut Scratch) -> Option<Counters> {
        Some(run_speculate(io, s, i, heads, self, ctx, sc))
    }
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

