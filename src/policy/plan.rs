//! The visit plan: the contract between a policy's decision and the kernel that attends.
//!
//! For one decode row and one KV head, a plan is a list of *entries* in visiting order; each entry names
//! `1 << unit_log2` consecutive key positions starting at `entry << unit_log2` (a Quest page, a cache
//! block, or with `unit_log2 = 0` a single token). The row's own visible range (causal limit and sliding
//! window) still masks every position, so an entry may reach past it. Both backends produce and consume
//! this same form: the CPU engine builds it with the functions of `policy::select` / `policy::top_p`, the
//! CUDA engine with the selection kernels of `kernels/select.cu` and `kernels/policy/`, which write it into a device buffer of
//! a fixed capacity per (row, KV head) that the attention kernel reads instead of the block table. The CPU
//! engine is therefore the reference for the GPU's *decisions* (same entries), not only for its outputs.
//!
//! The granularity of a pipeline's plan is fixed by its last stage (see [`plan_unit_log2`]), and its
//! largest length is bounded before the step from the budget and the block table's capacity (see
//! [`plan_capacity`]), which is what lets a GPU decode step be captured in a graph.

use super::kind::{PipelineKind, SelectorKind};

/// One (decode row, KV head)'s plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeadPlan {
    /// log2 of the positions one entry covers.
    pub unit_log2: u32,
    /// Entry indices (position >> unit_log2), in visiting order, without duplicates.
    pub entries: Vec<u32>,
}

impl HeadPlan {
    pub fn new(unit_log2: u32) -> Self {
        HeadPlan { unit_log2, entries: Vec::new() }
    }

    pub fn clear(&mut self, unit_log2: u32) {
        self.unit_log2 = unit_log2;
        self.entries.clear();
    }

    /// The visited positions inside `lo..=hi` as sorted, disjoint half-open spans (adjacent ones merged).
    pub fn spans(&self, lo: usize, hi: usize, out: &mut Vec<(usize, usize)>) {
        out.clear();
        let u = 1usize << self.unit_log2;
        for &e in &self.entries {
            let a = (e as usize * u).max(lo);
            let b = ((e as usize + 1) * u).min(hi + 1);
            if a < b {
                out.push((a, b));
            }
        }
        normalize_spans(out);
    }

    /// Number of positions inside `lo..=hi` the plan visits.
    pub fn tokens(&self, lo: usize, hi: usize) -> usize {
        let mut v = Vec::new();
        self.spans(lo, hi, &mut v);
        v.iter().map(|(a, b)| b - a).sum()
    }

    /// Sets the plan to the single tokens of sorted, disjoint `spans` (granularity 1).
    pub fn set_tokens_from_spans(&mut self, spans: &[(usize, usize)]) {
        self.clear(0);
        for &(a, b) in spans {
            self.entries.extend(a as u32..b as u32);
        }
    }
}

/// Granularity of the plans a pipeline produces: tokens when the last stage chooses tokens (top-p,
/// SnapKV, StreamingLLM's token windows), Quest's page, or the cache block for `all`.
pub(crate) fn plan_unit_log2(p: &(impl PipelineKind + ?Sized), block_size: usize) -> u32 {
    if p.plans_tokens() {
        return 0;
    }
    p.selector_kind().unit_log2(block_size)
}

/// Granularity of the *base selector's* plan (what top-p, when present, prunes).
pub(crate) fn selector_unit_log2(sel: &dyn SelectorKind, block_size: usize) -> u32 {
    sel.unit_log2(block_size)
}

/// Most entries the base selector's plan of a row can hold, for rows of at most `max_len` positions
/// (the block table's capacity): its budget in entries (plus the forced pages), never more than the
/// entries that cover `max_len` positions.
pub(crate) fn selector_capacity(sel: &dyn SelectorKind, block_size: usize, max_len: usize) -> usize {
    let unit = 1usize << selector_unit_log2(sel, block_size);
    let cover = max_len.div_ceil(unit) + 1;
    sel.budget_entries().unwrap_or(cover).min(cover)
}

/// Most entries a row's final plan can hold (top-p keeps a subset of its candidates' tokens).
pub(crate) fn plan_capacity(p: &(impl PipelineKind + ?Sized), block_size: usize, max_len: usize) -> usize {
    let sel = p.selector_kind();
    let base = selector_capacity(&*sel, block_size, max_len);
    if p.plans_tokens() {
        let unit = 1usize << selector_unit_log2(&*sel, block_size);
        base.saturating_mul(unit).min(max_len + 1)
    } else {
        base
    }
}

/// A call's plans on the device as (entries per row, unit_log2, one plan shared by every KV head): the
/// selector's and the final ones (after top-p), for rows of at most `max_len` positions.
pub(crate) fn device_plan_shapes(p: &(impl PipelineKind + ?Sized), block_size: usize, max_len: usize) -> [(usize, u32, bool); 2] {
    let sel = p.selector_kind();
    let shared = sel.shared_plan();
    [
        (selector_capacity(&*sel, block_size, max_len).max(1), selector_unit_log2(&*sel, block_size), shared),
        (plan_capacity(p, block_size, max_len).max(1), plan_unit_log2(p, block_size), shared && !p.plans_tokens()),
    ]
}

/// Merges possibly overlapping spans into sorted disjoint ones (empty spans dropped).
pub fn normalize_spans(spans: &mut Vec<(usize, usize)>) {
    spans.retain(|(a, b)| a < b);
    spans.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    for &(a, b) in spans.iter() {
        match out.last_mut() {
            Some(l) if a <= l.1 => l.1 = l.1.max(b),
            _ => out.push((a, b)),
        }
    }
    *spans = out;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_clip_to_the_row_and_merge() {
        let p = HeadPlan { unit_log2: 4, entries: vec![0, 1, 5, 3] };
        let mut s = Vec::new();
        p.spans(4, 85, &mut s);
        assert_eq!(s, vec![(4, 32), (48, 64), (80, 86)]);
        assert_eq!(p.tokens(4, 85), 28 + 16 + 6);
        let mut t = HeadPlan::default();
        t.set_tokens_from_spans(&[(0, 3), (9, 10)]);
        assert_eq!(t.entries, vec![0, 1, 2, 9]);
        t.spans(1, 100, &mut s);
        assert_eq!(s, vec![(1, 3), (9, 10)]);
    }
}
