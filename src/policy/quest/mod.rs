//! Quest (query-aware page selection). Its parameters are parsed here ([`parse`]); the CPU stage in
//! [`cpu`], the device stage in [`cuda`] with its kernels in kernels/policy/quest.cu and
//! kernels/include/quest.cuh; its key metadata (min/max per page) is kept by cpu::metadata and cuda::meta.

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args, Parsed, Selector};
use crate::error::Result;

/// `quest(budget, page, sink)`'s arguments (src/policy/registry.rs names the stage).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<Parsed> {
    let (budget, page, sink) = args(src, raw)?;
    Ok(Parsed::Selector(Selector::Quest { budget, page, sink }, None))
}

/// Quest's (budget, page, sink), also `speculate(over=quest(...))`'s.
pub(crate) fn args(src: &str, raw: Vec<Arg>) -> Result<(usize, usize, usize)> {
    let mut a = Args::new(src, "quest", raw, &["budget", "page", "sink"])?;
    let budget = a.int("budget", None, 1, "", |_| true)?;
    let page = a.int("page", Some(16), 1, ", a power of two", |v| v.is_power_of_two())?;
    let sink = a.int("sink", Some(0), 0, "", |_| true)?;
    Ok((budget, page, sink))
}

impl super::kind::SelectorKind for cpu::Quest {
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
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::spec::{parse, refusal as msg};

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
