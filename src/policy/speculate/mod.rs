//! PRR (predict, speculate, repair) on top of Quest's page scores: pure decisions, no kernels.
//!
//! Per (sequence, layer, KV head, page) a Holt predictor (double exponential smoothing) tracks the page's
//! Quest score: a page seen for the first time starts with `level = score, trend = 0`; after the true
//! scores `s` of a step are known, `level' = α·s + (1-α)·(level + trend)` and
//! `trend' = β·(level' - level) + (1-β)·trend`. The prediction for the next step is `level + γ·trend`.
//! Pages never scored yet (the sequence grew into them) are predicted `+inf`, so they are always in the
//! speculative set. The top predicted pages within the speculation budget form the speculative set; the
//! kernel side (`cpu::sparse`) attends it, computes the true Quest selection, attends the missed pages
//! and merges exactly through the LSE.
//!
//! Calibration ([`calibrate`]): the predictor is simulated over the page-score trajectory of the prefill
//! chunk's query rows (each row scores the pages it can see), for every candidate of a grid of
//! (α, β, γ) ([`grid`]); the candidate with the best score-weighted hit rate on the top-k selections
//! wins (weight of a true page: `exp(score - max score of the step)`).

pub mod cpu;
pub mod cuda;

use super::spec::{err, quoted, Arg, Args, Tok};
use crate::error::{Error, ErrorKind, Result};
use crate::ffi::guard::{engine_ref, guard, kvs_engine, kvs_status};
use crate::stats::StageCounter;

/// PRR's counters (C ABI: `kvs_stats.spec_*`): blocks predicted, of the true set, of those the prediction
/// hit, and missed blocks repaired; its kernels count them in device slots CTR_SPEC_*.
pub const PREDICTED_BLOCKS: StageCounter = StageCounter::device(2, 11);
pub const HIT_BLOCKS: StageCounter = StageCounter::device(3, 13);
pub const TRUE_BLOCKS: StageCounter = StageCounter::device(4, 12);
pub const REPAIRED_BLOCKS: StageCounter = StageCounter::device(5, 14);
/// Baseline (Rust only): blocks of the true set that the previous step's true set held (what reusing the
/// previous selection would have hit; compare with [`HIT_BLOCKS`]).
pub const REUSE_HIT_BLOCKS: StageCounter = StageCounter::device(6, 15);
/// Rust only: calibrations run at prefill (per sequence × KV head) and their total time in microseconds.
pub const CALIBRATIONS: StageCounter = StageCounter::host(7);
pub const CALIB_US: StageCounter = StageCounter::host(8);
/// Its counters, for the registry's `STAGE_COUNTERS`.
pub const COUNTERS: &[StageCounter] = &[PREDICTED_BLOCKS, HIT_BLOCKS, TRUE_BLOCKS, REPAIRED_BLOCKS, REUSE_HIT_BLOCKS, CALIBRATIONS, CALIB_US];

use super::quest::cpu::quest_pages;

/// How PRR predicts the speculative block set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Predict {
    /// Holt double exponential smoothing of each block's score (the method).
    Holt,
    /// The previous step's true set (the baseline the method is compared with).
    Previous,
    /// The lowest-predicted blocks: a deliberately bad predictor, for testing the repair path.
    Inverse,
}

/// `speculate(over=quest(budget, page), alpha, beta, gamma, budget, predict, extra)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speculate {
    /// The true selector: Quest with this token budget, page size and sink (tokens).
    pub quest_budget: usize,
    pub page: usize,
    pub quest_sink: usize,
    /// Holt parameters; `None` = calibrated at the sequence's prefill (see `policy::speculate`).
    pub alpha: Option<f32>,
    pub beta: Option<f32>,
    pub gamma: Option<f32>,
    /// Speculation budget in tokens (the constant of the default latency table); `None` = the Quest budget.
    pub budget: Option<usize>,
    pub predict: Predict,
    /// Keep predicted blocks outside the true set as extra context (`extra=keep`, the paper's behaviour and
    /// the default); `extra=drop` makes the output attention over the true set only.
    pub keep_extra: bool,
}

/// Holt parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HoltParams {
    pub alpha: f32,
    pub beta: f32,
    pub gamma: f32,
}

/// Used when the parameters are `auto` but no prefill was seen (nothing to calibrate on), and as the
/// first grid candidate (it wins ties).
pub const DEFAULT_PARAMS: HoltParams = HoltParams { alpha: 0.5, beta: 0.1, gamma: 1.0 };

/// The calibration grid: α ∈ {0.1, …, 1.0}, β ∈ {0.0, …, 0.8} (steps of 0.1) and γ ∈ {0, 0.5, 1, 1.5, 2}:
/// 450 candidates when all three are `auto`; a fixed parameter takes its one value. α = 1, γ = 0 predicts
/// the previous step's scores, i.e. reuses the previous selection, so calibration cannot land below the
/// reuse baseline on its own trajectory.
pub fn grid(alpha: Option<f32>, beta: Option<f32>, gamma: Option<f32>) -> Vec<HoltParams> {
    let axis = |fixed: Option<f32>, v: Vec<f32>| fixed.map_or(v, |x| vec![x]);
    let alphas = axis(alpha, (1..=10).map(|i| i as f32 / 10.0).collect());
    let betas = axis(beta, (0..=8).map(|i| i as f32 / 10.0).collect());
    let gammas = axis(gamma, vec![0.0, 0.5, 1.0, 1.5, 2.0]);
    let mut out = Vec::with_capacity(alphas.len() * betas.len() * gammas.len() + 1);
    let d = HoltParams { alpha: alpha.unwrap_or(DEFAULT_PARAMS.alpha), beta: beta.unwrap_or(DEFAULT_PARAMS.beta), gamma: gamma.unwrap_or(DEFAULT_PARAMS.gamma) };
    out.push(d);
    for &a in &alphas {
        for &b in &betas {
            for &g in &gammas {
                let p = HoltParams { alpha: a, beta: b, gamma: g };
                if p != d {
                    out.push(p);
                }
            }
        }
    }
    out
}

/// PRR state of one (sequence, layer, KV head).
#[derive(Clone, Debug)]
pub struct PrrHead {
    pub params: HoltParams,
    /// (level, trend) per absolute page index; level NaN = never scored.
    pub holt: Vec<(f32, f32)>,
    /// The previous step's true pages (sorted), for the reuse-previous baseline.
    pub prev_true: Vec<usize>,
}

impl super::PolicyState for PrrHead {
    fn bytes(&self) -> usize {
        PrrHead::bytes(self)
    }
}

impl PrrHead {
    pub fn new(params: HoltParams) -> Self {
        PrrHead { params, holt: Vec::new(), prev_true: Vec::new() }
    }

    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.holt.capacity() * 8 + self.prev_true.capacity() * std::mem::size_of::<usize>()
    }

    /// Predicted scores of pages `first .. first + n` (`+inf` for pages never scored).
    pub fn predict_scores(&self, first: usize, n: usize, out: &mut Vec<f32>) {
        out.clear();
        out.extend((first..first + n).map(|p| self.holt.get(p).map_or(f32::INFINITY, |&h| holt_predict(h, self.params.gamma))));
    }

    /// The speculative set: `k` pages of `first .. first + n` (sorted absolute indices).
    pub fn speculate(&self, mode: Predict, first: usize, n: usize, k: usize, buf: &mut Vec<f32>) -> Vec<usize> {
        self.predict_scores(first, n, buf);
        match mode {
            Predict::Holt => top_pages(buf, first, k),
            Predict::Previous if !self.prev_true.is_empty() => {
                // The previous true set, plus pages never scored (so the baseline is not penalised for growth).
                let mut v: Vec<usize> = self.prev_true.iter().copied().filter(|&p| p >= first && p < first + n).collect();
                v.extend((first..first + n).filter(|&p| buf[p - first] == f32::INFINITY));
                v.sort_unstable();
                v.dedup();
                v
            }
            Predict::Previous => top_pages(buf, first, k),
            Predict::Inverse => {
                for x in buf.iter_mut() {
                    *x = -*x;
                }
                top_pages(buf, first, k)
            }
        }
    }

    /// Folds the true scores of pages `first .. first + scores.len()` in; `truth` is the true selection.
    pub fn update(&mut self, first: usize, scores: &[f32], truth: &[usize]) {
        let end = first + scores.len();
        self.holt.truncate(end);
        self.holt.resize(end, (f32::NAN, 0.0));
        for (h, &s) in self.holt[first..end].iter_mut().zip(scores) {
            *h = holt_step(*h, s, self.params);
        }
        self.prev_true.clear();
        self.prev_true.extend_from_slice(truth);
    }
}

/// The prediction of one page's Holt state `(level, trend)`: `level + γ·trend`, `+inf` when never scored.
#[inline(always)]
fn holt_predict((l, t): (f32, f32), gamma: f32) -> f32 {
    if l.is_nan() {
        f32::INFINITY
    } else {
        l + gamma * t
    }
}

/// A page's Holt state `(level, trend)` after its true score `s` (a non-finite score resets the page, a
/// first score starts it). Both updates are computed and one is chosen, so the loop vectorises.
#[inline(always)]
fn holt_step((l, t): (f32, f32), s: f32, HoltParams { alpha, beta, .. }: HoltParams) -> (f32, f32) {
    let l2 = alpha * s + (1.0 - alpha) * (l + t);
    let t2 = beta * (l2 - l) + (1.0 - beta) * t;
    if !s.is_finite() {
        (f32::NAN, 0.0)
    } else if l.is_nan() {
        (s, 0.0)
    } else {
        (l2, t2)
    }
}

/// The `k` highest of `scores` (pages `first ..`), ties to the more recent page; sorted indices.
pub fn top_pages(scores: &[f32], first: usize, k: usize) -> Vec<usize> {
    if k == 0 {
        return Vec::new();
    }
    quest_pages(scores, first, k, 1, 0)
}

/// Count of `a ∩ b` for sorted page lists.
pub fn intersection(a: &[usize], b: &[usize]) -> usize {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

/// One step of a score trajectory: the first page index and the scores of pages `first ..`.
pub type TrajStep = (usize, Vec<f32>);

/// Result of [`calibrate`].
#[derive(Clone, Debug)]
pub struct Calibration {
    pub params: HoltParams,
    /// Score-weighted hit rate of the winner over the trajectory (1.0 for a trajectory of < 2 steps).
    pub hit: f64,
    pub candidates: usize,
    /// The predictor with the winning parameters, run over the whole trajectory (warm state).
    pub warm: PrrHead,
}

/// Score-weighted hit rate of `params` over `traj` with speculation budget `k_spec` and true top `k_true`
/// pages; also returns the warm state.
pub fn simulate(traj: &[TrajStep], params: HoltParams, k_spec: usize, k_true: usize) -> (f64, PrrHead) {
    let mut h = PrrHead::new(params);
    let (mut hit, mut tot) = (0f64, 0f64);
    let mut buf = Vec::new();
    for (t, (first, scores)) in traj.iter().enumerate() {
        let truth = top_pages(scores, *first, k_true);
        if t > 0 {
            let pred = h.speculate(Predict::Holt, *first, scores.len(), k_spec, &mut buf);
            let m = truth.iter().map(|&p| scores[p - first]).fold(f32::NEG_INFINITY, f32::max);
            for &p in &truth {
                let w = ((scores[p - first] - m) as f64).exp();
                let w = if w.is_finite() { w } else { 0.0 };
                tot += w;
                if pred.binary_search(&p).is_ok() {
                    hit += w;
                }
            }
        }
        h.update(*first, scores, &truth);
    }
    (if tot > 0.0 { hit / tot } else { 1.0 }, h)
}

/// Chooses the grid candidate with the best score-weighted hit rate (the first one on ties).
///
/// The same result as running [`simulate`] for every candidate and keeping the first best (the test
/// `fast_calibration_equals_simulating_every_candidate` compares them bit for bit), at a fraction of the cost:
/// the true sets, their weights and the total weight do not depend on the candidate and are computed once
/// ([`TruthSteps`]); per candidate, membership in the predicted top-k is one threshold per step
/// ([`SpecThreshold`]); candidates run in parallel and the winner is picked in grid order.
pub fn calibrate(traj: &[TrajStep], candidates: &[HoltParams], k_spec: usize, k_true: usize) -> Calibration {
    use rayon::prelude::*;
    let truth = TruthSteps::new(traj, k_true);
    let hits: Vec<f64> = candidates.par_iter().map_init(CandidateBufs::default, |bufs, &p| truth.hit_rate(traj, p, k_spec, bufs)).collect();
    let mut best: Option<(f64, HoltParams)> = None;
    for (&hit, &p) in hits.iter().zip(candidates) {
        if best.map_or(true, |(b, _)| hit > b) {
            best = Some((hit, p));
        }
    }
    let (hit, params) = best.unwrap_or((1.0, DEFAULT_PARAMS));
    Calibration { params, hit, candidates: candidates.len(), warm: truth.warm(traj, params) }
}

/// What [`simulate`] computes from the true scores alone: each step's true pages (sorted, absolute) and,
/// from the second step on, their weights in the same order, and the total weight summed in `simulate`'s
/// order (so a candidate's hit rate is the same `f64`).
struct TruthSteps {
    truth: Vec<Vec<usize>>,
    weights: Vec<Vec<f64>>,
    tot: f64,
}

/// A calibration worker's reused buffers: the Holt states (levels and trends apart, for vector loads)
/// and the predicted keys of one step.
#[derive(Default)]
struct CandidateBufs {
    level: Vec<f32>,
    trend: Vec<f32>,
    keys: Vec<u64>,
    truth_keys: Vec<u64>,
    hint: ThresholdHint,
}

impl TruthSteps {
    fn new(traj: &[TrajStep], k_true: usize) -> Self {
        let truth: Vec<Vec<usize>> = traj.iter().map(|(first, scores)| top_pages(scores, *first, k_true)).collect();
        let mut tot = 0f64;
        let weights = traj
            .iter()
            .zip(&truth)
            .skip(1)
            .map(|((first, scores), truth)| {
                let m = truth.iter().map(|&p| scores[p - first]).fold(f32::NEG_INFINITY, f32::max);
                let w: Vec<f64> = truth
                    .iter()
                    .map(|&p| {
                        let w = ((scores[p - first] - m) as f64).exp();
                        if w.is_finite() {
                            w
                        } else {
                            0.0
                        }
                    })
                    .collect();
                for &x in &w {
                    tot += x;
                }
                w
            })
            .collect();
        TruthSteps { truth, weights, tot }
    }

    /// [`simulate`]'s hit rate for `params`: the Holt states advance over the steps in one pass per step
    /// (each page's prediction is read before its update, as `speculate` precedes `update` there). With
    /// AVX2 that pass runs in 256-bit vectors: the same roundings (no FMA), so the same states.
    fn hit_rate(&self, traj: &[TrajStep], params: HoltParams, k_spec: usize, bufs: &mut CandidateBufs) -> f64 {
        use crate::cpu::isa::{detected, IsaLevel};
        match detected() {
            // SAFETY: the CPU has AVX2.
            #[cfg(target_arch = "x86_64")]
            IsaLevel::Avx2 | IsaLevel::Avx512 => unsafe { self.hit_rate_avx2(traj, params, k_spec, bufs) },
            IsaLevel::Portable => self.hit_rate_any(traj, params, k_spec, bufs),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn hit_rate_avx2(&self, traj: &[TrajStep], params: HoltParams, k_spec: usize, bufs: &mut CandidateBufs) -> f64 {
        self.hit_rate_any(traj, params, k_spec, bufs)
    }

    #[inline(always)]
    fn hit_rate_any(&self, traj: &[TrajStep], params: HoltParams, k_spec: usize, bufs: &mut CandidateBufs) -> f64 {
        let CandidateBufs { level, trend, keys, truth_keys, hint } = bufs;
        let gamma = params.gamma;
        hint.pivot = None;
        level.clear();
        trend.clear();
        let mut hit = 0f64;
        for (t, (first, scores)) in traj.iter().enumerate() {
            // `PrrHead::update`'s resizing: pages past the step are forgotten, new ones never scored.
            let (first, n) = (*first, scores.len());
            level.truncate(first + n);
            level.resize(first + n, f32::NAN);
            trend.truncate(first + n);
            trend.resize(first + n, 0.0);
            let states = level[first..].iter_mut().zip(&mut trend[first..]).zip(scores);
            if t == 0 {
                for ((l, tr), &s) in states {
                    (*l, *tr) = holt_step((*l, *tr), s, params);
                }
                continue;
            }
            keys.resize(n, 0); // every key is written below
            for (i, (((l, tr), &s), key)) in states.zip(keys.iter_mut()).enumerate() {
                *key = spec_key(holt_predict((*l, *tr), gamma), i);
                (*l, *tr) = holt_step((*l, *tr), s, params);
            }
            let truth = &self.truth[t];
            truth_keys.clear();
            truth_keys.extend(truth.iter().map(|&p| keys[p - first]));
            let spec = SpecThreshold::new(keys, k_spec, hint);
            for (&key, &w) in truth_keys.iter().zip(&self.weights[t - 1]) {
                if spec.contains(key) {
                    hit += w;
                }
            }
        }
        if self.tot > 0.0 {
            hit / self.tot
        } else {
            1.0
        }
    }

    /// The predictor with `params` after the whole trajectory, as [`simulate`] leaves it (the same
    /// states, and the same vector capacities: `PrrHead::bytes` counts them).
    fn warm(&self, traj: &[TrajStep], params: HoltParams) -> PrrHead {
        let mut h = PrrHead::new(params);
        for ((first, scores), truth) in traj.iter().zip(&self.truth) {
            h.update(*first, scores, truth);
        }
        h
    }
}

/// A page's place in the predicted order of [`top_pages`] (`quest_pages` with page 1, no sink): higher
/// is better; score descending with NaN as `+inf` and `total_cmp`'s order (-0.0 below +0.0), ties to the
/// higher (more recent) page. `i` is the page's index in the step.
#[inline(always)]
fn spec_key(pred: f32, i: usize) -> u64 {
    let bits = if pred.is_nan() { f32::INFINITY } else { pred }.to_bits();
    // total_cmp's order as an unsigned integer: negatives flipped whole (!bits), positives above them
    // (bits | 0x8000_0000), without a branch.
    let ord = bits ^ (((bits as i32) >> 31) as u32 | 0x8000_0000);
    (ord as u64) << 32 | i as u64
}

/// Membership in `top_pages(pred, first, k)` from the keys of a step's pages: every page when there are
/// at most `k`, none when `k = 0`; else the last page and the `k - 1` best others, i.e. those whose key is at
/// least the `(k-1)`-th best key (keys are distinct: they hold the index).
enum SpecThreshold {
    All,
    None,
    /// `min = u64::MAX` when only the last page is kept (no key reaches it: a key's high half is at most
    /// `+inf`'s).
    AtLeast { last: u64, min: u64 },
}

impl SpecThreshold {
    /// Reorders `keys` (the step's keys, in page order); `hint` carries a filter from step to step.
    fn new(keys: &mut [u64], k: usize, hint: &mut ThresholdHint) -> Self {
        let n = keys.len();
        if k == 0 {
            return SpecThreshold::None;
        }
        if n <= k {
            return SpecThreshold::All;
        }
        let (last, others) = (keys[n - 1], &mut keys[..n - 1]);
        let min = match k - 1 {
            0 => u64::MAX,
            m => hint.kth_largest(others, m),
        };
        SpecThreshold::AtLeast { last, min }
    }

    #[inline(always)]
    fn contains(&self, key: u64) -> bool {
        match *self {
            SpecThreshold::All => true,
            SpecThreshold::None => false,
            SpecThreshold::AtLeast { last, min } => key == last || key >= min,
        }
    }
}

/// A key a little below the previous step's threshold: the threshold moves little from step to step, so
/// the keys at or above it usually hold the new one, and selecting among those few is cheaper than among
/// all (when they are fewer than needed, all are searched).
#[derive(Default)]
struct ThresholdHint {
    pivot: Option<u64>,
    above: Vec<u64>,
}

impl ThresholdHint {
    /// The `m`-th largest of `keys` (distinct, `1 <= m <= keys.len()`); reorders `keys`.
    fn kth_largest(&mut self, keys: &mut [u64], m: usize) -> u64 {
        let ThresholdHint { pivot, above } = self;
        let (mut filtered, mut c) = (false, 0);
        if let Some(p) = *pivot {
            // Branch-free compaction of the keys >= p into `above[..c]` (longer than needed: not cleared).
            if above.len() < keys.len() {
                above.resize(keys.len(), 0);
            }
            for &x in keys.iter() {
                above[c] = x;
                c += (x >= p) as usize;
            }
            filtered = c >= m;
        }
        // Every key outside `above[..c]` is below every key in it, so the m-th largest is the same.
        let pool = if filtered { &mut above[..c] } else { keys };
        let len = pool.len();
        let (below, &mut kth, _) = pool.select_nth_unstable(len - m);
        // The next pivot: the key `slack` ranks below this threshold (or, short of that, the old pivot).
        let slack = m / 4 + 16;
        if below.len() >= slack {
            let at = below.len() - slack;
            *pivot = Some(*below.select_nth_unstable(at).1);
        } else if !filtered {
            *pivot = None;
        }
        kth
    }
}

/// Speculation budget by context length (the latency table): a step function over sorted
/// `(context_len, budget_tokens)` points; a context shorter than the first point takes the first budget.
/// On the CPU the engine uses a constant table (the spec's `budget`); a GPU backend can load a profiled one
/// with `Engine::set_speculation_budgets`.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecBudgetTable {
    points: Vec<(usize, usize)>,
}

impl crate::engine::Engine {
    /// Loads PRR's speculation budget table (context length → speculation budget in tokens), replacing the
    /// spec's constant `budget`; `None` goes back to the constant. Applies from the next call.
    pub fn set_speculation_budgets(&self, table: Option<SpecBudgetTable>) {
        self.set_policy_input(table.map(|t| std::sync::Arc::new(t) as super::PolicyInput));
    }
}

// PRR's C entry (made of src/ffi/guard.rs's parts). cbindgen reads it here: tests/header.rs reads each policy
// folder's mod.rs after the crate, so the header declares it after the library's own functions.
/// Loads PRR's speculation budget table: `n` points `(context_lens[i], budgets[i])` (tokens), used as a
/// step function of the sequence length (a context below the first point takes the first budget). `n = 0`
/// (pointers may then be NULL) goes back to the policy spec's constant `budget`. The arrays are read
/// during the call only; at most 65536 points (more is `KVS_ERR_UNSUPPORTED`). Applies from the next
/// forward call; thread-safe.
#[no_mangle]
pub unsafe extern "C" fn kvs_engine_set_speculation_budgets(engine: *mut kvs_engine, context_lens: *const u64, budgets: *const u64, n: usize) -> kvs_status {
    guard(|| {
        let e = engine_ref(engine)?;
        if n == 0 {
            e.set_speculation_budgets(None);
            return Ok(());
        }
        crate::ensure!(!context_lens.is_null() && !budgets.is_null(), InvalidArgument, "context_lens and budgets must not be NULL when n > 0");
        crate::ensure!(n <= MAX_BUDGET_POINTS, Unsupported, "{n} speculation budget points, more than the {MAX_BUDGET_POINTS} accepted");
        let (c, b) = (std::slice::from_raw_parts(context_lens, n), std::slice::from_raw_parts(budgets, n));
        let mut points = crate::alloc::try_with_capacity(n, "the speculation budget table")?;
        points.extend(c.iter().zip(b).map(|(&c, &b)| (c as usize, b as usize)));
        e.set_speculation_budgets(Some(SpecBudgetTable::new(points)?));
        Ok(())
    })
}

/// Most points `kvs_engine_set_speculation_budgets` takes.
const MAX_BUDGET_POINTS: usize = 1 << 16;

impl SpecBudgetTable {
    pub fn constant(budget: usize) -> Self {
        SpecBudgetTable { points: vec![(0, budget)] }
    }

    /// A table from `(context_len, budget)` points (any order); fails on an empty table, a zero budget or a
    /// repeated context length.
    pub fn new(mut points: Vec<(usize, usize)>) -> crate::error::Result<Self> {
        crate::ensure!(!points.is_empty(), InvalidArgument, "a speculation budget table needs at least one (context_len, budget) point");
        points.sort_unstable();
        for w in points.windows(2) {
            crate::ensure!(w[0].0 != w[1].0, InvalidArgument, "context length {} appears twice in the speculation budget table", w[0].0);
        }
        crate::ensure!(points.iter().all(|p| p.1 > 0), InvalidArgument, "speculation budgets must be >= 1 token");
        Ok(SpecBudgetTable { points })
    }

    pub fn budget_for(&self, context_len: usize) -> usize {
        let i = self.points.partition_point(|p| p.0 <= context_len);
        self.points[i.saturating_sub(1)].1
    }

    pub fn points(&self) -> &[(usize, usize)] {
        &self.points
    }
}

/// Query rows of a prefill chunk PRR calibrates on (a strided sample of the chunk).
pub const CALIB_ROWS: usize = 64;

/// At most `max` row indices of the chunk `start .. start + len`, evenly strided, ascending, the last row
/// always included (the decode steps continue from it).
pub fn calib_rows(start: usize, len: usize, max: usize) -> Vec<usize> {
    if len <= max {
        return (start..start + len).collect();
    }
    // Row j of max: start + len - 1 - (max - 1 - j) * len / max (exact integer stride, distinct rows).
    (0..max).map(|j| start + len - 1 - (max - 1 - j) * len / max).collect()
}

/// `speculate(over=quest(...), alpha, beta, gamma, budget, predict, extra)`'s arguments
/// (src/policy/registry.rs names the stage).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<Speculate> {
    let mut raw = raw;
    let over = raw.iter().position(|a| a.key == "over");
    let over_arg = over.map(|i| raw.remove(i));
    let mut a = Args::new(src, "speculate", raw, &["alpha", "beta", "gamma", "budget", "predict", "extra"])?;
    let super::quest::Quest { budget: quest_budget, page, sink: quest_sink } = match over_arg {
        None => return Err(Error::new(ErrorKind::InvalidArgument, format!("policy spec {}: stage `speculate` needs `over=quest(budget=...)`", quoted(src)))),
        Some(o) => {
            if o.val != Tok::Name("quest".into()) {
                return Err(err(src, o.val_pos, "`quest(...)` for `speculate.over`", &o.val.describe()));
            }
            super::quest::parse(src, o.nested.unwrap_or_default())?
        }
    };
    let alpha = a.auto_num("alpha", "a number in [0, 1] or `auto`", |v| (0.0..=1.0).contains(&v))?;
    let beta = a.auto_num("beta", "a number in [0, 1] or `auto`", |v| (0.0..=1.0).contains(&v))?;
    let gamma = a.auto_num("gamma", "a number in [0, 4] or `auto`", |v| (0.0..=4.0).contains(&v))?;
    let budget = match a.find("budget") {
        Some(_) => Some(a.int("budget", None, 1, "", |_| true)?),
        None => None,
    };
    let predict = match a.word("predict", "holt", &["holt", "previous", "inverse"])? {
        "previous" => Predict::Previous,
        "inverse" => Predict::Inverse,
        _ => Predict::Holt,
    };
    let keep_extra = a.word("extra", "keep", &["drop", "keep"])? == "keep";
    Ok(Speculate { quest_budget, page, quest_sink, alpha, beta, gamma, budget, predict, keep_extra })
}

impl super::kind::SelectorKind for Speculate {
    /// Over FP8 its repair attention reads rows decoded times their scales (kernels/policy/speculate.cu);
    /// its scores read Quest's bounds and its speculative attention the plan kernel.
    fn cuda_fp8_cache(&self) -> bool {
        true
    }

    fn stateful(&self) -> bool {
        true
    }

    /// Quest's page bounds (the true selection).
    fn meta_needs(&self, needs: &mut crate::meta::MetaNeeds) {
        needs.bounds_page = Some(self.page);
    }

    fn device_input(&self) -> std::result::Result<(), String> {
        Err("a speculation budget table (set_speculation_budgets) is not supported by the CUDA backend; PRR there uses the spec's `budget`".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holt_follows_a_linear_trend() {
        let mut h = PrrHead::new(HoltParams { alpha: 0.5, beta: 0.5, gamma: 1.0 });
        for t in 0..40 {
            h.update(0, &[t as f32, 10.0], &[]);
        }
        let mut buf = Vec::new();
        h.predict_scores(0, 3, &mut buf);
        assert!((buf[0] - 40.0).abs() < 1e-3, "{buf:?}");
        assert!((buf[1] - 10.0).abs() < 1e-6);
        assert_eq!(buf[2], f32::INFINITY); // never scored
        // A new page starts at its first score with no trend.
        h.update(0, &[40.0, 10.0, 3.0], &[0]);
        assert_eq!(h.holt[2], (3.0, 0.0));
        assert_eq!(h.prev_true, vec![0]);
    }

    #[test]
    fn speculation_modes() {
        let mut h = PrrHead::new(HoltParams { alpha: 1.0, beta: 0.0, gamma: 0.0 });
        h.update(0, &[5.0, 1.0, 4.0, 2.0], &[0, 2]);
        let mut buf = Vec::new();
        // Like Quest's own selection, the last page (the decode token's) is always among the k.
        assert_eq!(h.speculate(Predict::Holt, 0, 4, 2, &mut buf), vec![0, 3]);
        assert_eq!(h.speculate(Predict::Inverse, 0, 4, 2, &mut buf), vec![1, 3]);
        // Grown by one page: the new page is always speculated.
        assert_eq!(h.speculate(Predict::Holt, 0, 5, 2, &mut buf), vec![0, 4]);
        assert_eq!(h.speculate(Predict::Previous, 0, 5, 2, &mut buf), vec![0, 2, 4]);
        assert_eq!(intersection(&[1, 3, 5, 7], &[3, 4, 5]), 2);
    }

    #[test]
    fn calibration_prefers_trend_following_on_trending_scores() {
        // Two pages swap places linearly: only a trend-aware predictor sees the crossing coming.
        let traj: Vec<TrajStep> = (0..30).map(|t| (0, vec![10.0 - t as f32 * 0.5, t as f32 * 0.5, 4.0])).collect();
        let g = grid(None, None, None);
        assert_eq!(g.len(), 450);
        let c = calibrate(&traj, &g, 1, 1);
        let (no_trend, _) = simulate(&traj, HoltParams { alpha: 0.1, beta: 0.0, gamma: 0.0 }, 1, 1);
        assert!(c.hit >= no_trend && c.hit > 0.9, "{c:?} vs {no_trend}");
        assert_eq!(grid(Some(0.3), Some(0.2), None).len(), 5);
    }

    /// α = 1, γ = 0 is in the grid and predicts the previous step's scores, so at equal budgets the
    /// calibrated hit rate is never below that of reusing the previous top-k (on the same trajectory).
    #[test]
    fn calibration_is_never_below_reusing_the_previous_selection() {
        let g = grid(None, None, None);
        assert!(g.contains(&HoltParams { alpha: 1.0, beta: 0.0, gamma: 0.0 }));
        let mut rng = crate::rng::Rng::new(5);
        for trial in 0..20 {
            // Noisy scores that jump around: smoothing is wrong here, reuse is as good as anything.
            let traj: Vec<TrajStep> = (0..24).map(|_| (0, (0..12).map(|_| (rng.uniform() as f32) * 8.0).collect())).collect();
            let k = 1 + trial % 4;
            let c = calibrate(&traj, &g, k, k);
            let (reuse, _) = simulate(&traj, HoltParams { alpha: 1.0, beta: 0.0, gamma: 0.0 }, k, k);
            // Reuse-previous by hand: the previous step's top-k, weighted like `simulate`.
            let (mut hit, mut tot) = (0f64, 0f64);
            for t in 1..traj.len() {
                let truth = top_pages(&traj[t].1, 0, k);
                let prev = top_pages(&traj[t - 1].1, 0, k);
                let m = truth.iter().map(|&p| traj[t].1[p]).fold(f32::NEG_INFINITY, f32::max);
                for &p in &truth {
                    let w = ((traj[t].1[p] - m) as f64).exp();
                    tot += w;
                    if prev.contains(&p) {
                        hit += w;
                    }
                }
            }
            assert!((reuse - hit / tot).abs() < 1e-9, "α=1, γ=0 is not reuse-previous: {reuse} vs {}", hit / tot);
            assert!(c.hit >= reuse, "calibrated {} below reuse {reuse}", c.hit);
        }
    }

    /// The calibration as it was first written: [`simulate`] per candidate, the first best wins (the
    /// reference for the fast path).
    fn calibrate_by_simulating(traj: &[TrajStep], candidates: &[HoltParams], k_spec: usize, k_true: usize) -> Calibration {
        let mut best: Option<(f64, HoltParams)> = None;
        for &p in candidates {
            let (hit, _) = simulate(traj, p, k_spec, k_true);
            if best.map_or(true, |(b, _)| hit > b) {
                best = Some((hit, p));
            }
        }
        let (hit, params) = best.unwrap_or((1.0, DEFAULT_PARAMS));
        let (_, warm) = simulate(traj, params, k_spec, k_true);
        Calibration { params, hit, candidates: candidates.len(), warm }
    }

    /// A score with the hard cases mixed in: quantized values (ties), ±0.0, ±inf, NaN, and magnitudes
    /// whose Holt sums overflow (infinite and NaN predictions).
    fn nasty_score(rng: &mut crate::rng::Rng) -> f32 {
        match rng.below(40) {
            0 => 0.0,
            1 => -0.0,
            2 => f32::INFINITY,
            3 => f32::NEG_INFINITY,
            4 => f32::NAN,
            5 => 3.0e38 * if rng.below(2) == 0 { 1.0 } else { -1.0 },
            6..=20 => (rng.below(5) as f32 - 2.0) * 0.5,
            _ => (rng.normal() * 4.0) as f32,
        }
    }

    /// Rows whose page range grows (and with a sliding window starts later), sometimes shrinks; `pages0`
    /// pages at the first row.
    fn random_trajectory(rng: &mut crate::rng::Rng, rows: usize, pages0: usize, window: bool) -> Vec<TrajStep> {
        let (mut first, mut end) = (0usize, pages0);
        let mut drift: Vec<f32> = Vec::new();
        (0..rows)
            .map(|_| {
                let steps = (first, (first..end).map(|p| {
                    // Smooth per-page trends (what Holt is for) under the noise, so candidates differ.
                    if p >= drift.len() {
                        drift.resize(p + 1, 0.0);
                    }
                    drift[p] += (rng.normal() * 0.3) as f32;
                    if rng.below(3) == 0 { nasty_score(rng) } else { drift[p] }
                }).collect());
                end = match rng.below(10) {
                    0 => end.saturating_sub(rng.below(3)).max(first),
                    _ => end + rng.below(3),
                };
                if window && rng.below(3) == 0 && first + 1 < end {
                    first += 1;
                }
                steps
            })
            .collect()
    }

    fn assert_same_calibration(fast: &Calibration, reference: &Calibration, what: &str) {
        assert_eq!(fast.params, reference.params, "{what}");
        assert_eq!(fast.hit.to_bits(), reference.hit.to_bits(), "{what}: hit {} vs {}", fast.hit, reference.hit);
        assert_eq!(fast.candidates, reference.candidates, "{what}");
        let bits = |h: &PrrHead| h.holt.iter().map(|&(l, t)| (l.to_bits(), t.to_bits())).collect::<Vec<_>>();
        assert_eq!(bits(&fast.warm), bits(&reference.warm), "{what}: warm Holt states");
        assert_eq!(fast.warm.params, reference.warm.params, "{what}");
        assert_eq!(fast.warm.prev_true, reference.warm.prev_true, "{what}: warm previous true set");
        assert_eq!(fast.warm.bytes(), reference.warm.bytes(), "{what}: warm state bytes (capacities)");
    }

    #[test]
    fn fast_calibration_equals_simulating_every_candidate() {
        let mut rng = crate::rng::Rng::new(11);
        let full = grid(None, None, None);
        // (pages at the first row, rows, k_spec, k_true): one page, two, k, k + 1, k beyond the pages, k = 0,
        // thousands of pages.
        let shapes = [(1, 6, 1, 1), (2, 6, 1, 2), (2, 6, 2, 1), (4, 12, 4, 4), (5, 12, 4, 4), (5, 12, 8, 2), (3, 8, 0, 2), (3, 8, 2, 0), (12, 24, 3, 5), (40, 24, 7, 7), (300, 16, 20, 12), (3000, 8, 64, 64)];
        for (trial, &(pages0, rows, k_spec, k_true)) in shapes.iter().cycle().take(3 * shapes.len()).enumerate() {
            let window = trial % 2 == 1;
            let traj = random_trajectory(&mut rng, rows, pages0, window);
            // The whole grid on the small cases; on the large ones a sample, with repeats (ties go first).
            let cands: Vec<HoltParams> = if pages0 < 300 { full.clone() } else { (0..24).map(|_| full[rng.below(full.len())]).collect() };
            let what = format!("trial {trial}: {pages0} pages, {rows} rows, k_spec {k_spec}, k_true {k_true}, window {window}");
            assert_same_calibration(&calibrate(&traj, &cands, k_spec, k_true), &calibrate_by_simulating(&traj, &cands, k_spec, k_true), &what);
        }
        // Degenerate inputs: no candidates, an empty trajectory, one row, rows without pages.
        let traj = random_trajectory(&mut rng, 5, 6, false);
        assert_same_calibration(&calibrate(&traj, &[], 2, 2), &calibrate_by_simulating(&traj, &[], 2, 2), "no candidates");
        assert_same_calibration(&calibrate(&[], &full, 2, 2), &calibrate_by_simulating(&[], &full, 2, 2), "empty trajectory");
        assert_same_calibration(&calibrate(&traj[..1], &full, 2, 2), &calibrate_by_simulating(&traj[..1], &full, 2, 2), "one row");
        let empty: Vec<TrajStep> = vec![(0, vec![]), (0, vec![1.0]), (1, vec![]), (0, vec![2.0, 1.0])];
        assert_same_calibration(&calibrate(&empty, &full, 1, 1), &calibrate_by_simulating(&empty, &full, 1, 1), "rows without pages");
    }

    /// The threshold answers "is page i in `top_pages(pred, first, k)`" exactly, on scores full of ties,
    /// signed zeros, infinities and NaN, over sequences of steps that drift (the hint's filter holds),
    /// jump down (it does not: all keys are searched) or grow by a page.
    #[test]
    fn speculation_threshold_is_top_pages_membership() {
        let mut rng = crate::rng::Rng::new(3);
        let mut keys = Vec::new();
        for trial in 0..600 {
            let n0 = rng.below(if trial % 10 == 0 { 2000 } else { 12 });
            let mut pred: Vec<f32> = (0..n0).map(|_| nasty_score(&mut rng)).collect();
            let k = [0, 1, 2, 3, n0.saturating_sub(1), n0, n0 + 1, rng.below(n0 + 2), n0 / 4 + 1][trial % 9];
            let first = rng.below(5);
            let mut hint = ThresholdHint::default();
            for step in 0..8 {
                let n = pred.len();
                let top = top_pages(&pred, first, k);
                keys.clear();
                keys.extend(pred.iter().enumerate().map(|(i, &x)| spec_key(x, i)));
                let by_key = keys.clone();
                let spec = SpecThreshold::new(&mut keys, k, &mut hint);
                let members: Vec<usize> = (0..n).filter(|&i| spec.contains(by_key[i])).map(|i| i + first).collect();
                assert_eq!(members, top, "trial {trial} step {step}: n {n}, k {k}, scores {pred:?}");
                let shift = if rng.below(4) == 0 { -(rng.below(20) as f32) } else { 0.0 };
                for x in pred.iter_mut() {
                    *x = if rng.below(20) == 0 { nasty_score(&mut rng) } else { *x + shift + (rng.normal() * 0.1) as f32 };
                }
                if rng.below(2) == 0 {
                    pred.push(nasty_score(&mut rng));
                }
            }
        }
    }

    /// `cargo test --release -p kvsparse --lib prr_calibration_timing -- --ignored --nocapture`: the time of
    /// one (sequence, KV head) calibration at 131072 tokens (a 64-row trajectory over 8192 pages of 16
    /// tokens, the full grid, k_spec = k_true = 512), alone and 8 heads at once as the CUDA path runs them,
    /// for this calibration and the reference (`simulate` per candidate; `KVS_BENCH_NO_REFERENCE=1` skips
    /// it). A table, not a timed test.
    #[test]
    #[ignore]
    fn prr_calibration_timing() {
        use rayon::prelude::*;
        let (rows, pages, k, heads) = (CALIB_ROWS, 8192, 512, 8);
        let trajectory = |seed: u64| -> Vec<TrajStep> {
            let mut rng = crate::rng::Rng::new(seed);
            let mut walk: Vec<f32> = (0..pages).map(|_| (rng.normal() * 2.0) as f32).collect();
            // A prefill chunk's last rows: every row sees (nearly) all pages; the last one grows by a page.
            (0..rows)
                .map(|t| {
                    walk.iter_mut().for_each(|w| *w += (rng.normal() * 0.2) as f32);
                    let n = if t + 1 == rows { pages } else { pages - 1 };
                    (0, walk[..n].iter().map(|&w| w + (rng.normal() * 0.5) as f32).collect())
                })
                .collect()
        };
        let trajs: Vec<Vec<TrajStep>> = (0..heads as u64).map(trajectory).collect();
        let cands = grid(None, None, None);
        let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
        let threads = rayon::current_num_threads();
        println!("PRR calibration, {rows} rows x {pages} pages, {} candidates, k_spec = k_true = {k}, {threads} rayon threads", cands.len());
        println!("{:<28} {:>12} {:>16}", "", "1 head (ms)", format!("{heads} heads (ms)"));
        // One head alone, then `heads` at once (each calibration's own parallelism inside).
        let run = |name: &str, calib: fn(&[TrajStep], &[HoltParams], usize, usize) -> Calibration| {
            let t = std::time::Instant::now();
            let one = calib(&trajs[0], &cands, k, k);
            let one_ms = ms(t);
            let t = std::time::Instant::now();
            let all: Vec<Calibration> = trajs.par_iter().map(|tr| calib(tr, &cands, k, k)).collect();
            println!("{name:<28} {one_ms:>12.1} {:>16.1}", ms(t));
            (one, all)
        };
        let (fast1, fast) = run("calibrate", calibrate);
        if std::env::var_os("KVS_BENCH_NO_REFERENCE").is_some() {
            return;
        }
        let (ref1, refs) = run("reference (simulate each)", calibrate_by_simulating);
        assert_same_calibration(&fast1, &ref1, "head 0");
        for (h, (f, r)) in fast.iter().zip(&refs).enumerate() {
            assert_same_calibration(f, r, &format!("head {h}"));
        }
        println!("winner of head 0: {:?}, hit {:.4}", fast1.params, fast1.hit);
    }

    #[test]
    fn budget_table_is_a_step_function() {
        let t = SpecBudgetTable::new(vec![(8192, 2048), (0, 256), (2048, 1024)]).unwrap();
        assert_eq!(t.budget_for(100), 256);
        assert_eq!(t.budget_for(2048), 1024);
        assert_eq!(t.budget_for(100_000), 2048);
        assert!(SpecBudgetTable::new(vec![]).is_err());
        assert!(SpecBudgetTable::new(vec![(1, 2), (1, 3)]).is_err());
        assert_eq!(SpecBudgetTable::constant(64).budget_for(1 << 20), 64);
    }
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::registry::{parse, refusal as msg};
    use crate::policy::*;

    #[test]
    fn speculate_spec() {
        let p = parse("speculate(over=quest(budget=1024, page=32), alpha=0.3, gamma=auto, budget=512)").unwrap().pipeline.unwrap();
        assert_eq!(
            p.selector,
            Selector::Speculate(Speculate { quest_budget: 1024, page: 32, quest_sink: 0, alpha: Some(0.3), beta: None, gamma: None, budget: Some(512), predict: Predict::Holt, keep_extra: true })
        );
        let p = parse("speculate(over=quest(budget=64), predict=inverse, extra=drop)").unwrap().pipeline.unwrap();
        assert!(matches!(p.selector, Selector::Speculate(Speculate { quest_budget: 64, page: 16, quest_sink: 0, predict: Predict::Inverse, keep_extra: false, .. })));
        let p = parse("speculate(over=quest(budget=64, sink=16))").unwrap().pipeline.unwrap();
        assert!(matches!(p.selector, Selector::Speculate(Speculate { quest_budget: 64, quest_sink: 16, .. })));
        // The deepest legal spec parses.
        assert!(parse("speculate(over=quest(budget=8))").is_ok());
    }

    #[test]
    fn bad_speculate_specs() {
        assert!(msg("speculate(alpha=0.5)").contains("needs `over=quest"));
        let m = msg("speculate(over=snapkv(budget=8))");
        assert!(m.contains("position 15") && m.contains("`quest(...)`"), "{m}");
        let m = msg("speculate(over=quest(budget=8, pag=16))");
        assert!(m.contains("position 31") && m.contains("unknown key `pag`"), "{m}");
        assert!(msg("speculate(over=quest())").contains("needs `budget="));
        assert!(msg("speculate(over=quest(budget=8), alpha=1.5)").contains("speculate.alpha"));
        assert!(msg("speculate(over=quest(budget=8), gamma=-1)").contains("speculate.gamma"));
        assert!(msg("speculate(over=quest(budget=8), predict=oracle)").contains("holt, previous, inverse"));
        assert!(msg("speculate(over=quest(budget=8), budget=0)").contains("speculate.budget"));
        assert!(msg("speculate(over=quest(budget=8)) > art").contains("nothing after"));
    }
}
