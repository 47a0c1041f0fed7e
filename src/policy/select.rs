//! Base selectors: which key positions a decode row may visit, as *candidate units*.
//!
//! A unit is the set of selected positions inside one logical KV block (so "blocks visited" counts what the
//! kernels actually load), stored as sorted, disjoint spans, with a priority score (Quest's bound, SnapKV's
//! pooled attention, top-p's estimated mass; NaN when the selector has none) and a `sink` flag (units holding
//! the first tokens, which ART visits first). Pure decisions: the scores come from `cpu::sparse`.
//!
//! Each selector writes a [`HeadPlan`] (the contract with the kernels); the CPU engine builds its
//! [`Candidates`] from that plan, so both backends attend exactly what the plan says.

pub use super::plan::normalize_spans;
use super::plan::HeadPlan;

/// One candidate unit: spans `spans[span_lo..span_hi]` of [`Candidates`], all inside logical block `block`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Unit {
    pub block: usize,
    pub span_lo: u32,
    pub span_hi: u32,
    pub score: f32,
    pub sink: bool,
}

/// The selector's output for one (decode row, KV head), in increasing position order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Candidates {
    pub units: Vec<Unit>,
    pub spans: Vec<(usize, usize)>,
}

impl Candidates {
    pub fn clear(&mut self) {
        self.units.clear();
        self.spans.clear();
    }

    /// Builds units from sorted, disjoint spans: splits them at block boundaries; `score(block)` gives
    /// each unit's priority; units with a position `< sink_limit` are sinks.
    pub fn from_spans(&mut self, spans: &[(usize, usize)], block_size: usize, sink_limit: usize, score: impl Fn(usize) -> f32) {
        self.clear();
        for &(s, e) in spans {
            let mut a = s;
            while a < e {
                let blk = a / block_size;
                let b = e.min((blk + 1) * block_size);
                self.push_span(blk, a, b, sink_limit, &score);
                a = b;
            }
        }
    }

    fn push_span(&mut self, blk: usize, a: usize, b: usize, sink_limit: usize, score: &impl Fn(usize) -> f32) {
        let n = self.spans.len() as u32;
        match self.units.last_mut() {
            Some(u) if u.block == blk => {
                let last = self.spans.last_mut().expect("unit has spans");
                if last.1 == a {
                    last.1 = b;
                } else {
                    self.spans.push((a, b));
                    u.span_hi = n + 1;
                }
            }
            _ => {
                self.spans.push((a, b));
                self.units.push(Unit { block: blk, span_lo: n, span_hi: n + 1, score: score(blk), sink: a < sink_limit });
            }
        }
    }

    /// Builds units from a sorted list of positions (token-level selections).
    pub fn from_tokens(&mut self, tokens: impl Iterator<Item = usize>, block_size: usize, sink_limit: usize, score: impl Fn(usize) -> f32) {
        self.clear();
        for t in tokens {
            self.push_span(t / block_size, t, t + 1, sink_limit, &score);
        }
    }

    /// Builds units from a plan's positions inside `lo..=hi` (`spans` is scratch).
    #[allow(clippy::too_many_arguments)]
    pub fn from_plan(&mut self, plan: &HeadPlan, lo: usize, hi: usize, block_size: usize, sink_limit: usize, score: impl Fn(usize) -> f32, spans: &mut Vec<(usize, usize)>) {
        plan.spans(lo, hi, spans);
        self.from_spans(spans, block_size, sink_limit, score);
    }

    pub fn unit_spans(&self, u: &Unit) -> &[(usize, usize)] {
        &self.spans[u.span_lo as usize..u.span_hi as usize]
    }

    pub fn tokens(&self) -> usize {
        self.spans.iter().map(|(a, b)| b - a).sum()
    }
}

/// `all`: every position in `lo..=hi`, as the plan of the blocks that hold them.
pub fn all(plan: &mut HeadPlan, lo: usize, hi: usize, block_size: usize) {
    plan.clear(block_size.trailing_zeros());
    plan.entries.extend((lo / block_size) as u32..=(hi / block_size) as u32);
}

/// SnapKV: 1-D max pooling of `scores` with a centred window of `pool` (odd) positions.
pub fn max_pool(scores: &[f32], pool: usize) -> Vec<f32> {
    let r = pool / 2;
    let n = scores.len();
    (0..n).map(|i| scores[i.saturating_sub(r)..(i + r + 1).min(n)].iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect()
}

/// SnapKV: the `k` positions with the highest pooled score (ties: the earlier position), sorted.
pub fn top_k_positions(pooled: &[f32], k: usize) -> Vec<u32> {
    let n = pooled.len();
    let mut idx: Vec<u32> = (0..n as u32).collect();
    if n > k {
        if k == 0 {
            return Vec::new();
        }
        idx.select_nth_unstable_by(k - 1, |&a, &b| pooled[b as usize].total_cmp(&pooled[a as usize]).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort_unstable();
    }
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_split_at_block_boundaries_and_merge_within() {
        let mut c = Candidates::default();
        c.from_spans(&[(0, 4), (14, 40)], 16, 4, |b| b as f32);
        assert_eq!(c.units.len(), 3);
        assert_eq!(c.unit_spans(&c.units[0]), &[(0, 4), (14, 16)]);
        assert!(c.units[0].sink && !c.units[1].sink);
        assert_eq!(c.unit_spans(&c.units[1]), &[(16, 32)]);
        assert_eq!(c.unit_spans(&c.units[2]), &[(32, 40)]);
        assert_eq!(c.tokens(), 30);
        c.from_tokens([1usize, 2, 3, 7, 20].into_iter(), 16, 1, |_| 0.0);
        assert_eq!(c.spans, vec![(1, 4), (7, 8), (20, 21)]);
        assert_eq!(c.units.len(), 2);
    }



    #[test]
    fn pooling_and_top_k() {
        let p = max_pool(&[0.0, 1.0, 0.0, 0.0, 0.0, 2.0], 3);
        assert_eq!(p, vec![1.0, 1.0, 1.0, 0.0, 2.0, 2.0]);
        assert_eq!(top_k_positions(&p, 2), vec![4, 5]);
    }
}
