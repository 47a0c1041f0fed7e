//! Twilight's top-p pruning as a pure decision on estimated attention weights.
//!
//! Input: for each query row `r` of a GQA group, the estimated softmax weights `P[r][j]` of the candidate
//! tokens. One set is chosen per KV head, by a threshold on the aggregated weight `w_j = max_r P[r][j]`:
//! `S(t) = { j : w_j >= t }`. The kept set is the smallest `S(t)` whose mass reaches `p` for *every* row
//! (`Σ_{j∈S(t)} P[r][j] >= p · Σ_j P[r][j]`). With one row this is the classic top-p set.
//!
//! As in the paper's Algorithm 1 the threshold is found by binary search on `t` with an epsilon stop
//! (`EPS` × the largest weight); the few tokens whose weight falls inside the final bracket are then added
//! in decreasing weight until the mass is reached, so the result is exactly minimal (checked against
//! sort-and-accumulate in the tests), not just minimal up to epsilon. Equivalently: the shortest prefix of
//! the candidates sorted by weight (descending; equal weights by position, ascending) that reaches the
//! mass for every row, which is how the CUDA kernel finds the same set (a radix search on the weights).

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args};
use crate::error::Result;
use crate::stats::StageCounter;

/// Top-p's counters (C ABI: `kvs_stats.top_p_candidates`, `top_p_kept`): tokens offered to it, and tokens
/// it kept. Its kernels count them in device slots CTR_TOP_P_CANDIDATES and CTR_TOP_P_KEPT.
pub const CANDIDATES: StageCounter = StageCounter::device(0, 5);
pub const KEPT: StageCounter = StageCounter::device(1, 6);
/// Its counters, for the registry's `STAGE_COUNTERS`.
pub const COUNTERS: &[StageCounter] = &[CANDIDATES, KEPT];

/// Twilight's select-then-prune: keep the smallest set whose estimated attention mass reaches `p`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopP {
    pub p: f32,
}

/// Top-p keeps a subset of the candidates' tokens per KV head, estimated from the INT4 copy of the keys.
impl super::kind::LaterStageKind for TopP {
    fn plans_tokens(&self) -> bool {
        true
    }

    fn meta_needs(&self, needs: &mut crate::meta::MetaNeeds) {
        needs.int4 = true;
    }
}

/// Relative width of the bracket at which the binary search stops.
pub const EPS: f32 = 1e-3;

/// Per-row mass of `S(t)`: true when every row reaches its target.
/// Masses are accumulated in f64: with tens of thousands of small weights an f32 sum drifts by more
/// than the last few tokens weigh, which would make the set minimal only up to rounding.
fn reaches(p_rows: &[f32], n: usize, w: &[f32], t: f32, target: &[f64]) -> bool {
    target.iter().enumerate().all(|(r, &goal)| {
        let row = &p_rows[r * n..(r + 1) * n];
        let mut m = 0f64;
        for (j, &x) in row.iter().enumerate() {
            if w[j] >= t {
                m += x as f64;
            }
        }
        m >= goal
    })
}

/// Chooses the kept tokens; `keep[j]` is set for every kept candidate. Returns the number kept.
/// `p_rows` is `rows × n` (each row non-negative), `w` the aggregated weights (scratch, overwritten).
pub fn select(p_rows: &[f32], rows: usize, n: usize, p: f32, w: &mut Vec<f32>, keep: &mut Vec<bool>) -> usize {
    keep.clear();
    keep.resize(n, false);
    if n == 0 {
        return 0;
    }
    let target: Vec<f64> = (0..rows).map(|r| p as f64 * p_rows[r * n..(r + 1) * n].iter().map(|&x| x as f64).sum::<f64>()).collect();
    if p >= 1.0 || target.iter().any(|t| !t.is_finite()) {
        // p = 1 keeps every candidate (also those whose weight underflowed to zero). So does a NaN or
        // infinite estimate (a non-finite query or key): nothing can be ranked, and a poisoned key must
        // reach the attention (whose row then comes out NaN) rather than be pruned by chance.
        keep.fill(true);
        return n;
    }
    w.clear();
    w.extend((0..n).map(|j| (0..rows).map(|r| p_rows[r * n + j]).fold(0f32, f32::max)));
    let wmax = w.iter().copied().fold(0f32, f32::max);
    // Invariant: S(lo) reaches the target, S(hi) does not (or hi is above every weight).
    let (mut lo, mut hi) = (0f32, f32::INFINITY);
    if reaches(p_rows, n, w, wmax, &target) {
        lo = wmax;
    } else {
        hi = wmax;
        // The bracket halves each step; the step bound only matters where floats stop halving (a
        // subnormal wmax), which must not loop forever.
        let mut steps = 0;
        while hi - lo > EPS * wmax && steps < 64 {
            steps += 1;
            let mid = 0.5 * (lo + hi);
            if reaches(p_rows, n, w, mid, &target) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
    }
    // Exact finish: start from S(hi) and add the bracket's tokens, heaviest first, until every row
    // reaches its target.
    let mut mass: Vec<f64> = vec![0.0; rows];
    let mut band: Vec<usize> = Vec::new();
    let mut kept = 0;
    for j in 0..n {
        if w[j] >= hi {
            keep[j] = true;
            kept += 1;
            for (r, m) in mass.iter_mut().enumerate() {
                *m += p_rows[r * n + j] as f64;
            }
        } else if w[j] >= lo {
            band.push(j);
        }
    }
    // Ties in weight: the earlier position first (the documented rule the CUDA kernel follows too).
    band.sort_unstable_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    for j in band {
        if mass.iter().zip(&target).all(|(m, t)| m >= t) {
            break;
        }
        keep[j] = true;
        kept += 1;
        for (r, m) in mass.iter_mut().enumerate() {
            *m += p_rows[r * n + j] as f64;
        }
    }
    kept
}

/// `top_p(p)`'s arguments (src/policy/registry.rs names the stage).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<TopP> {
    let mut a = Args::new(src, "top_p", raw, &["p"])?;
    let v = a.num("p", Some(0.95), false, "a number in (0, 1]", |v| v > 0.0 && v <= 1.0)?;
    Ok(TopP { p: v as f32 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Sort by aggregated weight and accumulate until every row reaches p: the minimal threshold set.
    fn sort_and_accumulate(p_rows: &[f32], rows: usize, n: usize, p: f32) -> usize {
        let w: Vec<f32> = (0..n).map(|j| (0..rows).map(|r| p_rows[r * n + j]).fold(0f32, f32::max)).collect();
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        let target: Vec<f64> = (0..rows).map(|r| p as f64 * p_rows[r * n..(r + 1) * n].iter().map(|&x| x as f64).sum::<f64>()).collect();
        let mut mass = vec![0f64; rows];
        for (k, &j) in idx.iter().enumerate() {
            if mass.iter().zip(&target).all(|(m, t)| m >= t) {
                return k;
            }
            for r in 0..rows {
                mass[r] += p_rows[r * n + j] as f64;
            }
        }
        n
    }

    fn softmax_rows(rng: &mut Rng, rows: usize, n: usize, temp: f64) -> Vec<f32> {
        let mut out = vec![0f32; rows * n];
        for r in 0..rows {
            let logits: Vec<f64> = (0..n).map(|_| rng.normal() * temp).collect();
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = logits.iter().map(|x| (x - m).exp()).sum();
            for j in 0..n {
                out[r * n + j] = ((logits[j] - m).exp() / z) as f32;
            }
        }
        out
    }

    #[test]
    fn kept_set_reaches_p_and_is_minimal() {
        let seed = Rng::fresh_seed();
        let mut rng = Rng::new(seed);
        let (mut w, mut keep) = (Vec::new(), Vec::new());
        for trial in 0..200 {
            let rows = [1, 2, 4, 8][trial % 4];
            let n = 1 + rng.below(3000);
            let p = [0.5f32, 0.8, 0.9, 0.95, 0.99][trial % 5];
            let temp = [0.5, 2.0, 4.0][trial % 3];
            let pr = softmax_rows(&mut rng, rows, n, temp);
            let k = select(&pr, rows, n, p, &mut w, &mut keep);
            assert_eq!(k, keep.iter().filter(|&&b| b).count());
            for r in 0..rows {
                let total: f32 = pr[r * n..(r + 1) * n].iter().sum();
                let m: f32 = (0..n).filter(|&j| keep[j]).map(|j| pr[r * n + j]).sum();
                assert!(m >= p * total * (1.0 - 1e-5), "seed {seed} trial {trial}: row {r} mass {m} < {p}");
            }
            let want = sort_and_accumulate(&pr, rows, n, p);
            assert_eq!(k, want, "seed {seed} trial {trial}: kept vs minimal (n {n}, rows {rows}, p {p})");
        }
    }

    #[test]
    fn non_finite_estimates_keep_everything_and_tiny_weights_terminate() {
        let (mut w, mut keep) = (Vec::new(), Vec::new());
        let pr = vec![0.5, f32::NAN, 0.25, 0.25];
        assert_eq!(select(&pr, 1, 4, 0.5, &mut w, &mut keep), 4);
        let pr = vec![0.5, f32::INFINITY, 0.25, 0.25];
        assert_eq!(select(&pr, 1, 4, 0.5, &mut w, &mut keep), 4);
        // Subnormal weights: the bisection cannot halve below the float grid, and must still stop.
        let pr = vec![1e-44, 1e-45, 2e-45, 3e-45];
        let k = select(&pr, 1, 4, 0.9, &mut w, &mut keep);
        assert!((1..=4).contains(&k));
    }

    #[test]
    fn p_one_keeps_everything() {
        let pr = vec![1.0, 0.0, 0.0, 0.0];
        let (mut w, mut keep) = (Vec::new(), Vec::new());
        assert_eq!(select(&pr, 1, 4, 1.0, &mut w, &mut keep), 4);
        assert_eq!(select(&pr, 1, 4, 0.9, &mut w, &mut keep), 1);
        assert!(keep[0]);
    }
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::registry::{parse, refusal as msg};
    use crate::policy::*;

    #[test]
    fn top_p_spec() {
        assert_eq!(parse("top_p").unwrap().pipeline.unwrap().top_p, Some(TopP { p: 0.95 }));
        let m = msg("top_p(p=1.5)");
        assert!(m.contains("(0, 1]") && m.contains("position 8"), "{m}");
        assert!(msg("top_p(p=0)").contains("(0, 1]"));
        assert!(msg("quest(budget=8) top_p").contains("`>`, `;` or end of spec"));
    }
}
