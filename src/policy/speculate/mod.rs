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
        out.extend((first..first + n).map(|p| match self.holt.get(p) {
            Some(&(l, t)) if !l.is_nan() => l + self.params.gamma * t,
            _ => f32::INFINITY,
        }));
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
        let HoltParams { alpha, beta, .. } = self.params;
        for (i, &s) in scores.iter().enumerate() {
            let h = &mut self.holt[first + i];
            if !s.is_finite() {
                *h = (f32::NAN, 0.0);
            } else if h.0.is_nan() {
                *h = (s, 0.0);
            } else {
                let (l, t) = *h;
                let l2 = alpha * s + (1.0 - alpha) * (l + t);
                *h = (l2, beta * (l2 - l) + (1.0 - beta) * t);
            }
        }
        self.prev_true.clear();
        self.prev_true.extend_from_slice(truth);
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
pub fn calibrate(traj: &[TrajStep], candidates: &[HoltParams], k_spec: usize, k_true: usize) -> Calibration {
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
