//! Quest on the CPU: the `ceil(budget / page)` pages with the highest upper-bound score from the key
//! metadata (min/max per page), the sink pages and the decode token's page always kept.

use crate::cpu::sparse::{isa, CpuStage, HeadWork, Isa, IsaLevel, LayerMeta, Portable, RowLimits, Scratch, SelectCx};
use crate::policy::plan::HeadPlan;

/// Quest's upper bound of `q·k` over a page with channel-wise key bounds `[mn, mx]`:
/// `Σ_i max(q_i·mn_i, q_i·mx_i)`, which is `>=` the score of every key in the page.
///
/// The sum has a fixed order that the CUDA selection kernel (kernels/policy/quest.cu) repeats bit for bit with
/// one half-warp per page: sixteen lane sums, lane `l` over channels `l, l+16, l+32, ...` in order (each
/// product rounded on its own), then a butterfly `v[j] += v[j ^ s]` for s = 8, 4, 2, 1, the result in
/// lane 0. The sixteen lanes vectorise on the CPU too. `q.len()` must be a multiple of 16 (every
/// supported head size is).
#[inline(always)]
pub fn quest_bound(q: &[f32], mn: &[f32], mx: &[f32]) -> f32 {
    debug_assert!(q.len() % 16 == 0);
    let mut acc = [0f32; 16];
    for ((x, a), b) in q.chunks_exact(16).zip(mn.chunks_exact(16)).zip(mx.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += (x[l] * a[l]).max(x[l] * b[l]);
        }
    }
    butterfly16(acc)
}

/// `v[j] += v[j ^ s]` for s = 8, 4, 2, 1 (a warp's xor-shuffle reduction over 16 lanes); lane 0's value.
#[inline(always)]
pub fn butterfly16(mut v: [f32; 16]) -> f32 {
    for s in [8usize, 4, 2, 1] {
        let prev = v;
        for j in 0..16 {
            v[j] = prev[j] + prev[j ^ s];
        }
    }
    v[0]
}

/// Bounds of the pages `lo/page ..= hi/page` (max over the group's rows and over the page's units) into
/// `out`; returns the metadata bytes read.
#[allow(clippy::too_many_arguments)]
pub fn quest_page_scores(q: &[f32], rows: usize, d: usize, lim: RowLimits, page: usize, blocks: &[u32], head: usize, meta: &LayerMeta, out: &mut Vec<f32>) -> u64 {
    match isa::decisions() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512 => unsafe { quest_scores_avx2(q, rows, d, lim, page, blocks, head, meta, out) },
        IsaLevel::Portable => quest_scores_generic::<Portable>(q, rows, d, lim, page, blocks, head, meta, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn quest_scores_avx2(q: &[f32], rows: usize, d: usize, lim: RowLimits, page: usize, blocks: &[u32], head: usize, meta: &LayerMeta, out: &mut Vec<f32>) -> u64 {
    quest_scores_generic::<crate::cpu::convert::Avx2>(q, rows, d, lim, page, blocks, head, meta, out)
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

impl CpuStage for super::Quest {
    fn select(&self, cx: &SelectCx, hw: &mut HeadWork, sc: &mut Scratch) -> (usize, u64, bool) {
        let (budget, page, sink) = (self.budget, self.page, self.sink);
        let (io, lim, blocks, head) = (cx.io, cx.lim, cx.blocks, hw.head);
        let (d, bs, g) = (io.cache.head_dim, io.cache.block_size, io.group());
        let meta = cx.ctx.meta.expect("engine checked quest metadata");
        let first_page = lim.lo / page;
        let bytes = quest_page_scores(&hw.q, g, d, lim, page, blocks, head, meta, &mut sc.page_scores);
        let kept = quest_pages(&sc.page_scores, first_page, budget, page, sink);
        quest(&mut hw.plan, &kept, page);
        let scores = &sc.page_scores;
        hw.entry_score.extend(kept.iter().map(|&pg| scores[pg - first_page]));
        hw.cand.from_plan(&hw.plan, lim.lo, lim.hi, bs, sink.max(1), |blk| quest_block_score(blk, &kept, scores, first_page, page, bs), &mut sc.part);
        (sink.max(1), bytes, true)
    }
}

/// `quest(budget, page, sink)`: keeps the page holding the decode token (the last page offered) and the
/// pages holding the first `sink` positions, plus the best other pages up to `ceil(budget / page)` pages
/// in all (ties: the more recent page; the forced pages are kept even when they alone exceed the budget).
/// The last page is kept unconditionally, as Quest implementations do: it holds the row's own key and the
/// tokens just generated, and on real traces its bound alone often ranks it out. The sink pages are
/// optional (`sink=0`, the paper's rule, by default): a sink page's tight min/max bound ranks below the
/// loose bounds of ordinary pages exactly when it holds most of the attention (docs/quality.md).
/// `page_scores[p]` is the bound of page `p` (positions `p*page .. (p+1)*page`); pages outside `lo..=hi`
/// must not be offered. Returns the kept page indices in increasing order.
pub fn quest_pages(page_scores: &[f32], first_page: usize, budget: usize, page: usize, sink: usize) -> Vec<usize> {
    let k = budget.div_ceil(page).max(1);
    let n = page_scores.len();
    if n <= k {
        return (first_page..first_page + n).collect();
    }
    let last = n - 1;
    // Offered pages (relative indices) below the sink limit, other than the last page.
    let forced = sink.div_ceil(page).saturating_sub(first_page).min(last);
    let mut idx: Vec<usize> = (forced..last).collect();
    let m = k.saturating_sub(1 + forced).min(idx.len());
    if m > 0 {
        // Highest score first. A NaN bound (a NaN or infinity in the query or among the page's keys) ranks
        // first, so a poisoned key is attended (and its row comes out NaN) instead of skipped by chance.
        let key = |p: usize| if page_scores[p].is_nan() { f32::INFINITY } else { page_scores[p] };
        idx.select_nth_unstable_by(m - 1, |&a, &b| key(b).total_cmp(&key(a)).then(b.cmp(&a)));
    }
    idx.truncate(m);
    idx.extend(0..forced);
    idx.push(last);
    idx.sort_unstable();
    idx.into_iter().map(|i| i + first_page).collect()
}

/// Quest's plan: the kept pages (increasing), at page granularity.
pub fn quest(plan: &mut HeadPlan, kept_pages: &[usize], page: usize) {
    plan.clear(page.trailing_zeros());
    plan.entries.extend(kept_pages.iter().map(|&p| p as u32));
}

/// The priority of logical block `blk` under Quest (ART's `order=priority`): its page's bound, or with
/// several pages per block the best kept one.
pub fn quest_block_score(blk: usize, kept_pages: &[usize], page_scores: &[f32], first_page: usize, page: usize, block_size: usize) -> f32 {
    if page >= block_size {
        page_scores[(blk * block_size) / page - first_page]
    } else {
        kept_pages.iter().filter(|&&q| q * page / block_size == blk).map(|&q| page_scores[q - first_page]).fold(f32::NEG_INFINITY, f32::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quest_keeps_the_best_pages() {
        // Budget of two pages: the last page (the decode token's) plus the best other one.
        assert_eq!(quest_pages(&[1.0, 5.0, 3.0, 4.0], 0, 32, 16, 0), vec![1, 3]);
        assert_eq!(quest_pages(&[1.0, 5.0, 3.0, -9.0], 0, 32, 16, 0), vec![1, 3]);
        assert_eq!(quest_pages(&[1.0, 5.0, 3.0, -9.0, 2.0], 10, 48, 16, 0), vec![11, 12, 14]);
        // Budget of one page: only the last page.
        assert_eq!(quest_pages(&[7.0, 5.0, 3.0], 0, 16, 16, 0), vec![2]);
        assert_eq!(quest_pages(&[1.0, 2.0], 0, 1000, 16, 0), vec![0, 1]);
    }

    #[test]
    fn quest_sink_pages_are_kept_within_the_budget() {
        // sink=16 tokens = page 0, kept though its score is the lowest; it takes one of the 3 pages.
        assert_eq!(quest_pages(&[-5.0, 5.0, 3.0, 4.0, 1.0], 0, 48, 16, 16), vec![0, 1, 4]);
        // sink=17 reaches into page 1: pages 0 and 1 forced, plus the last; nothing else fits.
        assert_eq!(quest_pages(&[-5.0, -4.0, 3.0, 4.0, 1.0], 0, 48, 16, 17), vec![0, 1, 4]);
        // Forced pages past the budget are still kept (sink and last page are unconditional).
        assert_eq!(quest_pages(&[-5.0, -4.0, 3.0, 4.0, 1.0], 0, 16, 16, 32), vec![0, 1, 4]);
        // A sliding window that starts past the sink pages forces nothing (pages 10.. offered).
        assert_eq!(quest_pages(&[1.0, 5.0, 3.0, -9.0, 2.0], 10, 48, 16, 64), vec![11, 12, 14]);
        // Window starting at page 2 with sink reaching page 3: page 2 and 3 forced (relative 0 and 1).
        assert_eq!(quest_pages(&[1.0, 0.5, 9.0, 8.0, 2.0], 2, 64, 16, 64), vec![2, 3, 4, 6]);
        // sink=0 is the paper's rule.
        assert_eq!(quest_pages(&[-5.0, 5.0, 3.0, 4.0, 1.0], 0, 48, 16, 0), vec![1, 3, 4]);
    }
}
