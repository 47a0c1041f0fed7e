//! RefreshKV scheduling: pure decisions, no kernels.
//!
//! Per (sequence, layer): the mean query (over all query heads) saved at the last full step and the
//! number of steps since. Per (sequence, layer, KV head): a partial token set of at most `k` positions
//! with scores. A **full step** attends every visible position, scores each one (softmax weight per query
//! head, max over the GQA group, max-pooled over `pool` neighbours: `cpu::sparse` computes them) and
//! rebuilds the set as the top `k`. A **partial step** attends only the set; positions that appeared since
//! the last step are appended with score `+inf` (kept like a recent window) and the lowest-scored
//! positions are dropped to keep `k`.
//!
//! Initialisation (the paper's prefilling stage, §3 and Figure 2): at a prefill chunk the set is the top
//! `k` positions by the pooled attention of the chunk's last query row, and that row's mean query is the
//! reference (`cpu::sparse::refresh_seed`); the prefill counts as the first full step.
//!
//! Schedule: a decode row of a (sequence, layer) with no prefill seen is full. Then every `stride`-th step is a check: the
//! cosine similarity between the current mean query and the saved one is computed, and the step runs full
//! unless the similarity is strictly above `s` (so `s = 1` with `stride = 1` is dense attention at every
//! step). With `every = N` the check is replaced by a fixed full step every `N` steps.

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args};
use crate::error::Result;
use crate::stats::StageCounter;

/// The schedule's counters (C ABI: `kvs_stats.refresh_full_steps`, `refresh_partial_steps`): full-attention
/// steps and partial (token-set) steps, counted by the host. The predictor's schedule counts its own
/// full and partial steps here too.
pub const FULL_STEPS: StageCounter = StageCounter::host(9);
pub const PARTIAL_STEPS: StageCounter = StageCounter::host(10);
/// Its counters, for the registry's `STAGE_COUNTERS`.
pub const COUNTERS: &[StageCounter] = &[FULL_STEPS, PARTIAL_STEPS];

use super::select::top_k_positions;

/// `refresh(k, stride, s, pool, every)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Refresh {
    /// Tokens kept per KV head at partial steps.
    pub k: usize,
    /// Steps between similarity checks.
    pub stride: usize,
    /// Cosine threshold: a check keeps the partial set only while the similarity stays above `s`.
    pub s: f32,
    /// Max-pooling width (odd) of the full step's attention scores.
    pub pool: usize,
    /// Fixed schedule: a full step every `every` steps (no similarity check).
    pub every: Option<usize>,
}

/// Layer-level state of one sequence.
#[derive(Clone, Debug, Default)]
pub struct RefreshLayer {
    /// Mean query at the last full step (empty before the first).
    pub q_ref: Vec<f32>,
    pub since_full: usize,
}

impl super::PolicyState for RefreshLayer {
    fn bytes(&self) -> usize {
        RefreshLayer::bytes(self)
    }
}

impl RefreshLayer {
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.q_ref.capacity() * 4
    }

    /// Decides whether this step runs full, given the current mean query; updates the schedule.
    pub fn decide(&mut self, r: &Refresh, q_mean: &[f32]) -> bool {
        let full = if self.q_ref.is_empty() {
            true
        } else {
            self.since_full += 1;
            match r.every {
                Some(n) => self.since_full >= n,
                None => self.since_full % r.stride == 0 && !(cosine(q_mean, &self.q_ref) > r.s),
            }
        };
        if full {
            self.q_ref.clear();
            self.q_ref.extend_from_slice(q_mean);
            self.since_full = 0;
        }
        full
    }
}

/// Cosine similarity, clamped to [-1, 1]; 0 for a zero vector.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += x as f64 * y as f64;
        aa += x as f64 * x as f64;
        bb += y as f64 * y as f64;
    }
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    (ab / (aa.sqrt() * bb.sqrt())).clamp(-1.0, 1.0) as f32
}

/// The partial set of one (sequence, layer, KV head).
#[derive(Clone, Debug, Default)]
pub struct RefreshHead {
    /// Sorted positions and their scores.
    pub tokens: Vec<u32>,
    pub scores: Vec<f32>,
    /// Last position the set has seen (positions after it are new).
    pub last_pos: usize,
}

impl super::PolicyState for RefreshHead {
    fn bytes(&self) -> usize {
        RefreshHead::bytes(self)
    }
}

impl RefreshHead {
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.tokens.capacity() * 4 + self.scores.capacity() * 4
    }

    /// Rebuilds the set from pooled scores of positions `lo ..= hi` (`pooled[i]` is position `lo + i`).
    pub fn rebuild(&mut self, pooled: &[f32], lo: usize, hi: usize, k: usize) {
        let keep = top_k_positions(pooled, k);
        self.tokens.clear();
        self.scores.clear();
        for i in keep {
            self.tokens.push(lo as u32 + i);
            self.scores.push(pooled[i as usize]);
        }
        self.last_pos = hi;
    }

    /// A partial step at row limits `lo ..= hi`: drops positions outside, appends new ones with `+inf`,
    /// drops the lowest-scored (ties: the older) to keep `k`.
    pub fn advance(&mut self, lo: usize, hi: usize, k: usize) {
        let mut t: Vec<(u32, f32)> = self.tokens.iter().copied().zip(self.scores.iter().copied()).filter(|&(p, _)| (p as usize) >= lo && (p as usize) <= hi).collect();
        let from = (self.last_pos.min(hi) + 1).max(lo);
        let start_new = t.partition_point(|&(p, _)| (p as usize) < from);
        t.truncate(start_new);
        t.extend((from..=hi).map(|p| (p as u32, f32::INFINITY)));
        if t.len() > k {
            let mut idx: Vec<usize> = (0..t.len()).collect();
            // Highest score first, ties: the more recent first; keep the first k.
            idx.select_nth_unstable_by(k - 1, |&a, &b| t[b].1.total_cmp(&t[a].1).then(b.cmp(&a)));
            idx.truncate(k);
            idx.sort_unstable();
            t = idx.into_iter().map(|i| t[i]).collect();
        }
        self.tokens = t.iter().map(|x| x.0).collect();
        self.scores = t.iter().map(|x| x.1).collect();
        self.last_pos = hi;
    }
}

/// `refresh(k, stride, s, pool, every)`'s arguments (src/policy/registry.rs names the stage).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<Refresh> {
    let mut a = Args::new(src, "refresh", raw, &["k", "stride", "s", "pool", "every"])?;
    let k = a.int("k", Some(2048), 1, "", |_| true)?;
    let stride = a.int("stride", Some(5), 1, "", |_| true)?;
    let sim = a.num("s", Some(0.85), false, "a number in [-1, 1]", |v| (-1.0..=1.0).contains(&v))? as f32;
    let pool = a.int("pool", Some(7), 1, ", odd", |v| v % 2 == 1)?;
    let every = match a.find("every") {
        Some(_) => Some(a.int("every", None, 1, "", |_| true)?),
        None => None,
    };
    Ok(Refresh { k, stride, s: sim, pool, every })
}

impl super::kind::SelectorKind for Refresh {
    /// Over FP8 its scores read the keys decoded times k_scale, in the CPU's arithmetic (refresh::cuda).
    fn cuda_fp8_cache(&self) -> bool {
        true
    }

    fn stateful(&self) -> bool {
        true
    }

    fn per_sequence_device_state(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_checks_every_stride_steps() {
        let r = Refresh { k: 4, stride: 2, s: 0.9, pool: 1, every: None };
        let mut l = RefreshLayer::default();
        assert!(l.decide(&r, &[1.0, 0.0])); // first step
        assert!(!l.decide(&r, &[0.0, 1.0])); // not a check step
        assert!(l.decide(&r, &[0.0, 1.0])); // check: orthogonal -> full
        assert!(!l.decide(&r, &[0.0, 1.0]));
        assert!(!l.decide(&r, &[0.1, 1.0])); // check: similar -> partial
        let fixed = Refresh { every: Some(3), ..r };
        let mut l = RefreshLayer::default();
        let v: Vec<bool> = (0..7).map(|_| l.decide(&fixed, &[1.0])).collect();
        assert_eq!(v, vec![true, false, false, true, false, false, true]);
        let dense = Refresh { stride: 1, s: 1.0, ..r };
        let mut l = RefreshLayer::default();
        assert!((0..5).all(|_| l.decide(&dense, &[1.0, 2.0])), "s=1, stride=1 must always refresh");
    }

    #[test]
    fn partial_set_keeps_new_tokens_and_size() {
        let mut h = RefreshHead::default();
        h.rebuild(&[0.1, 0.9, 0.2, 0.8, 0.3], 0, 4, 3);
        assert_eq!(h.tokens, vec![1, 3, 4]);
        h.advance(0, 6, 3);
        assert_eq!(h.tokens, vec![1, 5, 6]);
        h.advance(0, 6, 3); // nothing new
        assert_eq!(h.tokens, vec![1, 5, 6]);
        h.advance(0, 5, 3); // sequence rewound
        assert_eq!(h.tokens, vec![1, 5]);
    }
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::registry::{parse, refusal as msg};
    use crate::policy::*;

    #[test]
    fn refresh_spec() {
        assert_eq!(parse("refresh(k=64); max_seqs=8, dense_layers=1").unwrap().max_seqs, 8);
        let p = parse("refresh").unwrap().pipeline.unwrap();
        assert_eq!(p.selector, Selector::Refresh(Refresh { k: 2048, stride: 5, s: 0.85, pool: 7, every: None }));
        let p = parse("refresh(k=64, stride=1, s=1.0, every=10)").unwrap().pipeline.unwrap();
        assert_eq!(p.selector, Selector::Refresh(Refresh { k: 64, stride: 1, s: 1.0, pool: 7, every: Some(10) }));
        assert!(msg("refresh(k=0)").contains("refresh.k"));
        assert!(msg("refresh(s=1.5)").contains("refresh.s"));
        assert!(msg("refresh(pool=4)").contains("odd"));
        assert!(msg("refresh(stride=0)").contains("refresh.stride"));
        assert!(msg("refresh(every=0)").contains("refresh.every"));
        assert!(msg("refresh(k=quest(budget=1))").contains("this key takes no stage"));
        assert!(msg("refresh > top_p").contains("nothing after"));
        assert!(msg("quest(budget=8) > refresh").contains("at most one selector"));
    }
}
