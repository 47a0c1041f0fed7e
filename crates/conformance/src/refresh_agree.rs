//! RefreshKV's agreement check (design.md "Decisions on the GPU: agreement, not bit equality"): the CUDA
//! engine computes a full decode step's weights from its own tensor-core attention, so its token sets may
//! differ from the CPU engine's, but only at the boundary. This module mirrors the schedule (the same
//! decisions on both engines, bit for bit), keeps for every (sequence, KV head) the f64 reference of the
//! pooled weights at its last full step (or prefill seed), and checks each differing position of a step:
//! its reference score must lie within `delta` (relative) of the set's boundary, the m-th largest reference
//! score among the old positions still in range, m being how many old positions the CPU's set keeps
//! (a partial step keeps the top m of the last full step's scores: new positions enter at +inf).
//!
//! delta follows from the arithmetic (docs/policies.md, "refresh"): both engines' logits differ from the
//! exact ones by at most Lambda = scale * max sum_i |q_i k_i| * (d * 2^-23 + (d + 1) * 2^-24) (the
//! tensor cores' f32 accumulation of exact bf16/f16 products, truncating: 2^-23 per addition; the CPU's
//! f32 dot of the scaled query: 2^-24 per operation), plus 8 * 2^-24 * max |logit| for the scaling and
//! exp2/log2 steps, plus softcap * 2^-17 for the two tanh's; over an FP8 cache (`scaled_keys`) plus
//! 2 * 2^-24 * scale * max sum_i |q_i k_i| (the CPU rounds each decoded key times k_scale, the GPU the
//! product scale * k_scale; FP8 widens to f16 exactly). The GPU's normaliser is the attention's f32 softmax
//! sum (per lane over its tiles, then the quad, the warps and the splits): relative error at most
//! Z = (n / 8 + 256) * 2^-24 for n positions. A weight exp(l - lse) then moves by at most a factor
//! exp(2 Lambda + Z) on either engine; two scores compared across the boundary: delta =
//! 2 * (exp(2 Lambda + Z) - 1) + 2^-20 (the CPU's fast_exp and fixed-point normaliser, 5e-7 relative).

use std::collections::HashMap;

use kvsparse::policy::refresh::RefreshLayer;
use kvsparse::policy::Refresh;
use kvsparse::stats::VisitRecord;

use super::hostbuf::HostBuf;

/// The reference of one (sequence, KV head) at its last full step.
#[derive(Clone, Debug)]
pub struct RefScores {
    pub lo: usize,
    pub hi: usize,
    /// Max-pooled weights of positions lo..=hi (f64).
    pub pooled: Vec<f64>,
    /// The stated margin for this step's inputs (relative).
    pub delta: f64,
}

/// What a case's decisions came to: differing positions, the worst margin seen (relative distance of a
/// differing position's reference score to the boundary) and the worst allowed (delta), and the first
/// position past its delta.
#[derive(Clone, Debug, Default)]
pub struct Agreement {
    pub differing: usize,
    pub worst_margin: f64,
    pub delta_at_worst: f64,
    pub violation: Option<String>,
}

impl Agreement {
    pub fn merge(&mut self, o: &Agreement) {
        self.differing += o.differing;
        if o.worst_margin > self.worst_margin {
            self.worst_margin = o.worst_margin;
            self.delta_at_worst = o.delta_at_worst;
        }
        if self.violation.is_none() {
            self.violation = o.violation.clone();
        }
    }
}

/// One query row's inputs: `q` [hq, d] (the row as stored, to f64), and a closure giving K rows.
pub struct RowInputs<'a> {
    pub q: Vec<f64>,
    pub k: &'a dyn Fn(usize, usize) -> Vec<f64>,
    pub scale: f64,
    pub softcap: f64,
    /// The keys are FP8 bytes decoded times k_scale (module doc: two more roundings in Lambda).
    pub scaled_keys: bool,
}

/// f64 reference of the pooled weights of KV head `head` (query heads head*g .. head*g+g) over lo..=hi,
/// and the margin delta of this row (module doc).
pub fn reference(inp: &RowInputs, head: usize, group: usize, d: usize, lo: usize, hi: usize, pool: usize) -> RefScores {
    let n = hi + 1 - lo;
    let mut w = vec![0f64; n];
    let (mut max_abs_dot, mut max_logit) = (0f64, 0f64);
    let keys: Vec<Vec<f64>> = (lo..=hi).map(|p| (inp.k)(p, head)).collect();
    for g in 0..group {
        let q = &inp.q[(head * group + g) * d..(head * group + g + 1) * d];
        let mut l = vec![0f64; n];
        for (j, k) in keys.iter().enumerate() {
            let (mut dot, mut abs) = (0f64, 0f64);
            for i in 0..d {
                dot += q[i] * k[i];
                abs += (q[i] * k[i]).abs();
            }
            let x = dot * inp.scale;
            l[j] = if inp.softcap > 0.0 { inp.softcap * (x / inp.softcap).tanh() } else { x };
            max_abs_dot = max_abs_dot.max(abs * inp.scale);
            max_logit = max_logit.max(l[j].abs());
        }
        let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + l.iter().map(|&x| (x - m).exp()).sum::<f64>().ln();
        for (o, &x) in w.iter_mut().zip(&l) {
            *o = o.max((x - lse).exp());
        }
    }
    let rad = pool / 2;
    let pooled = (0..n).map(|i| w[i.saturating_sub(rad)..(i + rad + 1).min(n)].iter().copied().fold(f64::NEG_INFINITY, f64::max)).collect();
    let u = 2f64.powi(-24);
    let kscale = if inp.scaled_keys { 2.0 } else { 0.0 };
    let lambda = max_abs_dot * (d as f64 * 2.0 * u + (d as f64 + 1.0 + kscale) * u) + 8.0 * u * max_logit + inp.softcap * 2f64.powi(-17);
    let zsum = (n as f64 / 8.0 + 256.0) * u;
    RefScores { lo, hi, pooled, delta: 2.0 * ((2.0 * lambda + zsum).exp() - 1.0) + 2f64.powi(-20) }
}

/// The schedule of every sequence id (`RefreshLayer::decide` on the mean query as the CPU engine forms it:
/// each query head's row times the scale, in f32, added in head order).
#[derive(Default)]
pub struct ScheduleMirror {
    layers: HashMap<i64, RefreshLayer>,
}

impl ScheduleMirror {
    /// Decides a row of sequence `id` with query `q` [hq, d] (as stored): true = full.
    pub fn decide(&mut self, r: &Refresh, id: i64, q: &[f64], hq: usize, d: usize, scale: f32) -> bool {
        let mut qm = vec![0f32; d];
        for h in 0..hq {
            for (c, m) in qm.iter_mut().enumerate() {
                *m += q[h * d + c] as f32 * scale;
            }
        }
        self.layers.entry(id).or_default().decide(r, &qm)
    }

    pub fn forget(&mut self, id: i64) {
        self.layers.remove(&id);
    }
}

/// Positions of a visit record.
pub fn positions(v: &VisitRecord) -> Vec<usize> {
    v.spans.iter().flat_map(|&(a, b)| a..b).collect()
}

/// Compares one row's sets (CPU `c`, GPU `g`, positions ascending) at limits lo..=hi against the reference
/// of the last full step `rf` (None: no state, the sets must be equal).
pub fn check_row(c: &[usize], g: &[usize], lo: usize, rf: Option<&RefScores>, what: &str) -> Agreement {
    let mut a = Agreement::default();
    if c == g {
        return a;
    }
    let cs: std::collections::BTreeSet<usize> = c.iter().copied().collect();
    let gs: std::collections::BTreeSet<usize> = g.iter().copied().collect();
    let diff: Vec<usize> = cs.symmetric_difference(&gs).copied().collect();
    a.differing = diff.len();
    let Some(rf) = rf else {
        a.violation = Some(format!("{what}: {} positions differ where no set was built (first {:?})", diff.len(), diff.first()));
        return a;
    };
    // The old positions still in range and the CPU set's count of them: the boundary is the m-th largest.
    let from = lo.max(rf.lo);
    let mut old: Vec<f64> = if from <= rf.hi { rf.pooled[from - rf.lo..=rf.hi - rf.lo].to_vec() } else { Vec::new() };
    let m = c.iter().filter(|&&p| p >= from && p <= rf.hi).count();
    old.sort_by(|x, y| y.total_cmp(x));
    let b = if m == 0 { old.first().copied().unwrap_or(0.0) } else { old[m - 1] };
    for &p in &diff {
        if p < from || p > rf.hi {
            a.violation.get_or_insert_with(|| format!("{what}: position {p} differs outside the last full step's range {from}..={}", rf.hi));
            a.worst_margin = f64::INFINITY;
            continue;
        }
        let s = rf.pooled[p - rf.lo];
        let margin = if b > 0.0 { (s - b).abs() / b } else { (s - b).abs() };
        if margin > a.worst_margin {
            a.worst_margin = margin;
            a.delta_at_worst = rf.delta;
        }
        if margin > rf.delta {
            a.violation.get_or_insert_with(|| format!("{what}: position {p} (reference {s:.6e}) differs at relative margin {margin:.3e} from the boundary {b:.6e}, past delta {:.3e}", rf.delta));
        }
    }
    a
}

/// The rows of a call as f64: token `t`'s query [hq, d].
pub fn query_row(q: &HostBuf, t: usize, hq: usize, d: usize) -> Vec<f64> {
    (0..hq * d).map(|i| q.get(t * hq * d + i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borderline_swaps_pass_and_clear_ones_fail() {
        let rf = RefScores { lo: 0, hi: 5, pooled: vec![0.5, 0.30, 0.3001, 0.1, 0.01, 0.2], delta: 1e-3 };
        // k = 2: CPU {0, 2}; a GPU that kept 1 instead of 2 is within 3.3e-4 of the boundary 0.3001.
        let a = check_row(&[0, 2], &[0, 1], 0, Some(&rf), "t");
        assert_eq!(a.differing, 2);
        assert!(a.violation.is_none() && a.worst_margin < 1e-3, "{a:?}");
        // Keeping 3 (0.1) instead of 2 is no borderline swap.
        let a = check_row(&[0, 2], &[0, 3], 0, Some(&rf), "t");
        assert!(a.violation.is_some(), "{a:?}");
        // A new position differing is never borderline; equal sets need no reference.
        assert!(check_row(&[0, 6], &[0, 7], 0, Some(&rf), "t").violation.is_some());
        assert!(check_row(&[1, 2], &[1, 2], 0, None, "t").violation.is_none());
        assert!(check_row(&[1, 2], &[1, 3], 0, None, "t").violation.is_some());
    }

    #[test]
    fn reference_weights_are_a_softmax_maximum() {
        // One head, two query rows, d = 1: logits q*k*scale.
        let k = |p: usize, _h: usize| vec![p as f64];
        let inp = RowInputs { q: vec![1.0, -1.0], k: &k, scale: 1.0, softcap: 0.0, scaled_keys: false };
        let r = reference(&inp, 0, 2, 1, 0, 2, 1);
        let z: f64 = (0..3).map(|p| (p as f64).exp()).sum();
        assert!((r.pooled[2] - 2f64.exp() / z).abs() < 1e-12);
        let z2: f64 = (0..3).map(|p| (-(p as f64)).exp()).sum();
        assert!((r.pooled[0] - 1.0 / z2).abs() < 1e-12);
        assert!(r.delta > 0.0 && r.delta < 1e-4, "{}", r.delta);
    }
}
