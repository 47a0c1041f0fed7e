//! Quest on the CPU: the `ceil(budget / page)` pages with the highest upper-bound score from the key
//! metadata (min/max per page), the sink pages and the decode token's page always kept.

use crate::cpu::sparse::{quest_page_scores, CpuStage, HeadWork, Scratch, SelectCx};
use crate::policy::select;

/// `quest(budget, page, sink)` as a CPU stage.
pub struct Quest {
    pub budget: usize,
    pub page: usize,
    pub sink: usize,
}

impl CpuStage for Quest {
    fn select(&self, cx: &SelectCx, hw: &mut HeadWork, sc: &mut Scratch) -> (usize, u64, bool) {
        let (budget, page, sink) = (self.budget, self.page, self.sink);
        let (io, lim, blocks, head) = (cx.io, cx.lim, cx.blocks, hw.head);
        let (d, bs, g) = (io.cache.head_dim, io.cache.block_size, io.group());
        let meta = cx.ctx.meta.expect("engine checked quest metadata");
        let first_page = lim.lo / page;
        let bytes = quest_page_scores(&hw.q, g, d, lim, page, blocks, head, meta, &mut sc.page_scores);
        let kept = select::quest_pages(&sc.page_scores, first_page, budget, page, sink);
        select::quest(&mut hw.plan, &kept, page);
        let scores = &sc.page_scores;
        hw.entry_score.extend(kept.iter().map(|&pg| scores[pg - first_page]));
        hw.cand.from_plan(&hw.plan, lim.lo, lim.hi, bs, sink.max(1), |blk| select::quest_block_score(blk, &kept, scores, first_page, page, bs), &mut sc.part);
        (sink.max(1), bytes, true)
    }
}
