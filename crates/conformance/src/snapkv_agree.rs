//! SnapKV's agreement check (design.md "Decisions on the GPU: agreement, not bit equality"): on f16/bf16
//! caches the CUDA engine computes the choice's weights on tensor cores, so its kept positions may differ
//! from the CPU engine's, but only at the boundary. This module computes, for one (sequence, KV head) of a
//! fixture, the f64 reference of the pooled observation scores the choice ranks (the definition of
//! `snapkv::cpu::choose`: softmax weights of the window's rows, summed over the window per query head,
//! max over the group, max-pooled), the number of prefix positions kept, and the margin delta of the
//! inputs; `refresh_agree::check_row` then checks each differing position against the boundary.
//!
//! delta follows from the arithmetic (docs/policies.md, "SnapKV's choice on the device"): both engines'
//! logits are within Lambda = scale * max sum_i |q_i k_i| * (d * 2^-23 + (d + 1) * 2^-24) + 8 * 2^-24 *
//! max |logit| + softcap * 2^-17 of the exact ones (as for RefreshKV's full step), so a weight moves by at
//! most a factor exp(2 Lambda); the window sum of n positive weights adds n * 2^-24 (relative) on each
//! engine and the device's f32 normaliser over `len` keys len * 2^-24; the max over the group and the
//! pooling keep relative errors. Two scores compared across the boundary: delta = 2 * (exp(2 Lambda) - 1)
//! + 2 * (n + len) * 2^-24 + 2^-20 (the CPU's fast_exp and fixed-point normaliser).

use super::fixture::Fixture;
use super::hostbuf::HostBuf;
use super::refresh_agree::RefScores;

/// SnapKV's parameters as the policy string gives them.
#[derive(Clone, Copy, Debug)]
pub struct SnapParams {
    pub budget: usize,
    pub window: usize,
    pub pool: usize,
}

impl SnapParams {
    /// Reads `snapkv(...)` at the start of a policy string (the parser's defaults: window 32, pool 7).
    pub fn parse(policy: &str) -> Option<SnapParams> {
        let inner = policy.trim().strip_prefix("snapkv(")?.split(')').next()?;
        let mut p = SnapParams { budget: 0, window: 32, pool: 7 };
        for kv in inner.split(',') {
            let (k, v) = kv.split_once('=')?;
            let v: usize = v.trim().parse().ok()?;
            match k.trim() {
                "budget" => p.budget = v,
                "window" => p.window = v,
                "pool" => p.pool = v,
                _ => return None,
            }
        }
        (p.budget > 0).then_some(p)
    }
}

/// The reference of sequence `s`, KV head `head`: pooled scores over the prefix `0..obs_start` (as
/// `RefScores` over `0..=obs_start - 1`, with delta) and the count of prefix positions kept; None when
/// the choice keeps everything (the prompt fits the budget, or no prefix).
pub fn snap_reference(f: &Fixture, cache: &HostBuf, s: usize, head: usize, p: &SnapParams) -> Option<(RefScores, usize)> {
    let sp = &f.spec;
    let (d, g, bs) = (sp.head_dim, sp.num_q_heads / sp.num_kv_heads, sp.block_size);
    let len = f.seq_lens[s] as usize;
    let q_len = sp.seqs[s].0;
    if len <= p.budget {
        return None;
    }
    let obs_start = len.saturating_sub(p.window);
    let k_prefix = p.budget.saturating_sub(len - obs_start);
    if obs_start == 0 {
        return None;
    }
    let n = q_len.min(len - obs_start);
    let t_first = f.query_start_loc[s] as usize + q_len - n;
    let st = f.cache_strides.map(|x| x as usize);
    let key = |pos: usize| -> Vec<f64> {
        let b = f.block_table[s * f.max_blocks + pos / bs] as usize;
        (0..d).map(|i| cache.get(b * st[0] + (pos % bs) * st[1] + head * st[2] + i)).collect()
    };
    let keys: Vec<Vec<f64>> = (0..len).map(key).collect();
    let (scale, cap) = (f.scale as f64, sp.softcap as f64);
    let q_row = f.q_strides[0] as usize;
    let mut per_head = vec![vec![0f64; obs_start]; g];
    let (mut max_abs_dot, mut max_logit) = (0f64, 0f64);
    for (gi, acc) in per_head.iter_mut().enumerate() {
        for t in 0..n {
            let tpos = len - n + t;
            let lo = if sp.window > 0 { (tpos + 1).saturating_sub(sp.window) } else { 0 };
            let q: Vec<f64> = (0..d).map(|i| f.q.get((t_first + t) * q_row + (head * g + gi) * d + i)).collect();
            let l: Vec<f64> = (lo..=tpos)
                .map(|pos| {
                    let (mut dot, mut abs) = (0f64, 0f64);
                    for i in 0..d {
                        dot += q[i] * keys[pos][i];
                        abs += (q[i] * keys[pos][i]).abs();
                    }
                    max_abs_dot = max_abs_dot.max(abs * scale);
                    let x = dot * scale;
                    let x = if cap > 0.0 { cap * (x / cap).tanh() } else { x };
                    max_logit = max_logit.max(x.abs());
                    x
                })
                .collect();
            let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + l.iter().map(|&x| (x - m).exp()).sum::<f64>().ln();
            for (j, &x) in l.iter().enumerate() {
                let pos = lo + j;
                if pos < obs_start {
                    acc[pos] += (x - lse).exp();
                }
            }
        }
    }
    let agg: Vec<f64> = (0..obs_start).map(|j| per_head.iter().map(|h| h[j]).fold(0f64, f64::max)).collect();
    let rad = p.pool / 2;
    let pooled = (0..obs_start).map(|i| agg[i.saturating_sub(rad)..(i + rad + 1).min(obs_start)].iter().copied().fold(f64::NEG_INFINITY, f64::max)).collect();
    let u = 2f64.powi(-24);
    let lambda = max_abs_dot * (d as f64 * 2.0 * u + (d as f64 + 1.0) * u) + 8.0 * u * max_logit + cap * 2f64.powi(-17);
    let delta = 2.0 * ((2.0 * lambda).exp() - 1.0) + 2.0 * (n + len) as f64 * u + 2f64.powi(-20);
    Some((RefScores { lo: 0, hi: obs_start - 1, pooled, delta }, k_prefix))
}

/// Prefix positions whose reference score differs from the boundary (the `k`-th largest) but lies within
/// delta of it: where two candidates may trade places on the device, and so where a later stage's set
/// (top-p over SnapKV's candidates) may differ too. Scores equal to the boundary do not count: equal
/// scores come from the same pooled maximum, and both engines break that tie by position.
pub fn borderline(rf: &RefScores, k: usize) -> usize {
    if k == 0 || k >= rf.pooled.len() {
        return 0;
    }
    let mut v = rf.pooled.clone();
    v.sort_by(|x, y| y.total_cmp(x));
    let b = v[k - 1];
    rf.pooled.iter().filter(|&&x| x != b && (x - b).abs() <= rf.delta * b.abs()).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_policy_strings_of_the_tests() {
        let p = SnapParams::parse("snapkv(budget=128, window=8, pool=31) > top_p(p=0.9)").unwrap();
        assert_eq!((p.budget, p.window, p.pool), (128, 8, 31));
        let p = SnapParams::parse("snapkv(budget=256)").unwrap();
        assert_eq!((p.budget, p.window, p.pool), (256, 32, 7));
        assert!(SnapParams::parse("quest(budget=256)").is_none());
    }

    #[test]
    fn borderline_counts_positions_near_the_kth_score() {
        let rf = RefScores { lo: 0, hi: 4, pooled: vec![0.5, 0.3, 0.30001, 0.1, 0.2], delta: 1e-3 };
        assert_eq!(borderline(&rf, 2), 1); // the boundary is 0.30001; 0.3 lies within delta of it
        assert_eq!(borderline(&rf, 1), 0); // nothing near 0.5
        assert_eq!(borderline(&rf, 5), 0);
        // A tie at the boundary alone cannot flip (both engines order it by position).
        let tie = RefScores { lo: 0, hi: 3, pooled: vec![0.5, 0.3, 0.3, 0.1], delta: 1e-3 };
        assert_eq!(borderline(&tie, 2), 0);
    }
}
