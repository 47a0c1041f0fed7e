//! Quality measures of a policy on real attention traces: what `kvsparse eval` prints and plots.
//!
//! Every measure is per *row* = (recorded layer, decode step, query head), so the CLI can pool rows over
//! traces and report medians and tails:
//! - relative output error `‖o − o_dense‖ / ‖o_dense‖` against the dense replay of the same trace;
//! - attention mass recovered: the exact (f64) softmax weight of the positions the row's KV head attended
//!   ([`kvsparse::stats::VisitRecord`]); 1 for rows that ran dense.

use crate::reference::rel_err;
use crate::traces::{mass_in_spans, Replay, Trace};

/// Per-row relative error of `r`'s outputs against `dense`'s (same trace, same steps), in row order
/// (layer, step, query head). `d` is the head size.
pub fn row_errors(r: &Replay, dense: &Replay, d: usize) -> Vec<f64> {
    let mut errs = Vec::new();
    for (a, b) in r.out.iter().zip(&dense.out) {
        errs.extend(a.chunks_exact(d).zip(b.chunks_exact(d)).map(|(x, y)| rel_err(x, y)));
    }
    errs
}

/// Per-row attention mass recovered by each replay of `runs` (all of the same trace, replayed with
/// visit records and the same step stride), in row order (layer, step, query head). The exact weights
/// of a step are computed once and shared by every run.
pub fn recovered_mass(tr: &Trace, runs: &[&Replay]) -> Vec<Vec<f64>> {
    let (hq, hk) = (tr.hq, tr.hk);
    let g = hq / hk;
    let p = tr.info.prompt_len;
    let mut out: Vec<Vec<f64>> = runs.iter().map(|_| Vec::new()).collect();
    let Some(first) = runs.first() else { return out };
    assert!(runs.iter().all(|r| r.steps == first.steps), "replays of one trace must share their steps");
    for li in 0..tr.layers.len() {
        for (si, &t) in first.steps.iter().enumerate() {
            let w = tr.dense_weights(li, t);
            let len = p + t + 1;
            for (r, masses) in runs.iter().zip(out.iter_mut()) {
                for qh in 0..hq {
                    let row = &w[qh * len..(qh + 1) * len];
                    masses.push(match &r.visits[r.visit_index(hk, li, si, qh / g)] {
                        Some(spans) => mass_in_spans(row, spans),
                        None => 1.0,
                    });
                }
            }
        }
    }
    out
}

/// The `q`-quantile (0..=1) of `v` by the nearest-rank method; NaN for an empty slice.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q.clamp(0.0, 1.0) * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// Arithmetic mean; NaN for an empty slice.
pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
