//! Quest (query-aware page selection). Its parameters are parsed here ([`parse`]); the CPU stage in
//! [`cpu`], the device stage in [`cuda`] with its kernels in kernels/policy/quest.cu (its page scoring in
//! kernels/include/page_bounds.cuh, shared with PRR); its key metadata (min/max per page) is kept by
//! cpu::metadata and cuda::meta.

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args};
use crate::error::Result;

/// `quest(budget, page, sink)`: the `ceil(budget / page)` pages with the highest upper-bound score
/// `Σ_i max(q_i·max_i, q_i·min_i)`; the page of the decode token and the pages holding the first `sink`
/// tokens are always kept (its CPU stage in [`cpu`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quest {
    pub budget: usize,
    pub page: usize,
    pub sink: usize,
}

/// `quest(budget, page, sink)`'s arguments (src/policy/registry.rs names the stage), also
/// `speculate(over=quest(...))`'s.
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<Quest> {
    let mut a = Args::new(src, "quest", raw, &["budget", "page", "sink"])?;
    let budget = a.int("budget", None, 1, "", |_| true)?;
    let page = a.int("page", Some(16), 1, ", a power of two", |v| v.is_power_of_two())?;
    let sink = a.int("sink", Some(0), 0, "", |_| true)?;
    Ok(Quest { budget, page, sink })
}

impl super::kind::SelectorKind for Quest {
    fn cuda_fp8_cache(&self) -> bool {
        true
    }

    fn graph_capturable(&self) -> bool {
        true
    }

    /// The min/max key bounds of every page.
    fn meta_needs(&self, needs: &mut crate::meta::MetaNeeds) {
        needs.bounds_page = Some(self.page);
    }

    fn unit_log2(&self, _block_size: usize) -> u32 {
        self.page.trailing_zeros()
    }

    /// The budget's pages, the sink pages and the decode token's page.
    fn budget_entries(&self) -> Option<usize> {
        Some(self.budget.div_ceil(self.page).max(1) + self.sink.div_ceil(self.page) + 1)
    }

    fn sink_positions(&self) -> usize {
        self.sink
    }

    /// Its plans are whole pages the terminating attention kernel walks in order.
    fn device_terminable(&self) -> bool {
        true
    }

    /// Its device stage keeps each page's score in the workspace (`CudaStage::page_scores`).
    fn device_page_scores(&self) -> bool {
        true
    }
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::registry::{parse, refusal as msg};

    #[test]
    fn quest_spec() {
        assert_eq!(parse("quest(budget=64)").unwrap().max_seqs, crate::policy::spec::DEFAULT_MAX_SEQS);
        let m = msg("quest(budget=4, pages=16)");
        assert!(m.contains("position 16") && m.contains("unknown key `pages`") && m.contains("budget, page"), "{m}");
        assert!(msg("quest(budget=0)").contains("quest.budget"));
        assert!(msg("quest()").contains("needs `budget=")); // nothing defaulted silently
        assert!(msg("quest(budget=64, page=12)").contains("power of two"));
        assert!(msg("quest(budget=\"64\")").contains("quest.budget"));
        assert!(msg("quest(budget=8) > quest(budget=8)").contains("at most one selector"));
        assert!(msg("quest(budget=8").contains("`,` or `)`"));
        assert!(msg("quest(budget=8,budget=9)").contains("at most once"));
    }
}
