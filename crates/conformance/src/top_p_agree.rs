//! Twilight top-p's agreement check on CUDA (design.md "Decisions on the GPU: agreement, not bit
//! equality"): the device finds the set by a radix search spread over many CTAs, with the softmax
//! normaliser summed in another order than the CPU's, so its kept tokens may differ from the CPU engine's,
//! but only at the boundary. For one fixture and a `base > top_p(p)` policy whose base is position-only
//! (`all`, `streaming`: the candidates are known without the engines), this module computes per (sequence,
//! KV head) the f64 reference of the set's definition (top_p::select: INT4 estimates from the CPU engine's
//! metadata, softmax per row, w = max over the group, the shortest prefix by w reaching p of every row's
//! mass) and checks every token on which the two engines' sets differ against its boundary.
//!
//! The bound (docs/policies.md, "Twilight top-p on the device"): an engine's logit differs from the exact
//! one by at most Lambda = (d + 16) * 2^-24 * A (A = max over candidates of |min| * sum |q| + scale *
//! sum |q_c| code_c, every f32 operation of the estimate counted once) plus softcap * 2^-17, so each weight
//! moves by a factor at most exp(2 Lambda) and, with fast_exp and the normaliser, by delta = 2 (exp(2
//! Lambda) - 1) + 2^-20 (relative); a prefix mass then moves by delta of the row's total. A token is
//! borderline when (mass) its place in the reference order lies between the first place where every
//! row's prefix may reach the target within delta and the first where it surely does, or (order) its
//! reference weight lies within 2 delta (relative) of the weights at those places. Margin of a differing
//! token: 0 inside the mass band, else its relative distance to the band's weights; it must be <= 2 delta.

use super::fixture::{run_on_engine, Fixture, Outputs};
use super::reference::{attend_rows, rel_err};
use super::sparse_cuda::{cfg_for, fixture_with_keys, run_fixture_cuda_policy};
use super::{tolerance, CaseSpec};
use kvsparse::engine::Engine;
use kvsparse::error::Result;
use kvsparse::stats::VisitRecord;
use kvsparse::tensor::Device;

/// The base selector of a `base > top_p(p)` policy whose candidates depend on positions only.
#[derive(Clone, Copy, Debug)]
pub enum Base {
    All,
    Streaming { sink: usize, recent: usize },
}

impl Base {
    /// Candidate positions of a row of `len` visible tokens (no window), increasing.
    pub fn candidates(&self, len: usize) -> Vec<usize> {
        match *self {
            Base::All => (0..len).collect(),
            Base::Streaming { sink, recent } => {
                let a1 = sink.min(len);
                let b0 = len.saturating_sub(recent).max(a1);
                (0..a1).chain(b0..len).collect()
            }
        }
    }
}

/// What a case came to.
#[derive(Clone, Debug, Default)]
pub struct TopPAgreement {
    /// Policy rows compared, rows whose sets differ, differing tokens.
    pub rows: usize,
    pub rows_differing: usize,
    pub differing: usize,
    /// Tokens kept by each engine (all rows).
    pub kept_cpu: usize,
    pub kept_gpu: usize,
    /// Worst margin of a differing token and the allowed margin (2 delta) of its row; the largest allowed.
    pub worst_margin: f64,
    pub allowed_at_worst: f64,
    pub max_allowed: f64,
    /// GPU output against the reference over the GPU's own set: the CPU engine's output on rows whose sets
    /// agree, an f64 attention over the GPU's kept tokens on the others (relative error, and the bound).
    pub out_rel: f64,
    pub out_tol: f64,
    pub violation: Option<String>,
    /// (token row, KV head) of each row whose sets differ.
    pub rows_apart: Vec<(usize, usize)>,
}

impl TopPAgreement {
    pub fn pass(&self) -> bool {
        self.violation.is_none() && self.out_rel <= self.out_tol
    }
}

/// The reference of one row: candidates' f64 weights (max over the group), the place of each in the
/// reference order, the mass band [k_lo, k_hi) and delta.
struct RowRef {
    w: Vec<f64>,
    rank: Vec<usize>,
    k_lo: usize,
    k_hi: usize,
    w_band: (f64, f64),
    delta: f64,
}

/// Tokens (positions) of a visit record.
fn tokens_of(v: &VisitRecord) -> Vec<usize> {
    v.spans.iter().flat_map(|&(a, b)| a..b).collect()
}

fn row_reference(f: &Fixture, meta: &kvsparse::meta::MetaSnapshot, s: usize, h: usize, cand: &[usize], p: f32) -> RowRef {
    let sp = &f.spec;
    let (d, g, bs, hk) = (sp.head_dim, sp.num_q_heads / sp.num_kv_heads, sp.block_size, sp.num_kv_heads);
    let (codes, qp) = (meta.codes.as_ref().expect("int4 codes"), meta.qparams.as_ref().expect("int4 params"));
    let t = f.query_start_loc[s] as usize;
    let qs = f.q_strides.map(|x| x as usize);
    // The CPU's scaled query rows (f32 products), taken exactly into f64.
    let q: Vec<Vec<f64>> = (0..g).map(|gi| (0..d).map(|c| ((f.q.get(t * qs[0] + (h * g + gi) * qs[1] + c * qs[2]) as f32) * f.scale) as f64).collect()).collect();
    let n = cand.len();
    let cap = sp.softcap as f64;
    let mut logits = vec![vec![0f64; n]; g];
    let (mut a_max, mut b_max) = (0f64, 0f64);
    let q_abs_max = q.iter().flatten().fold(0f64, |m, &x| m.max(x.abs()));
    for (j, &pos) in cand.iter().enumerate() {
        let blk = f.block_table[s * f.max_blocks + pos / bs] as usize;
        let r = (blk * bs + pos % bs) * hk + h;
        let cb = d.div_ceil(2);
        let code = |c: usize| ((codes[r * cb + c / 2] >> (4 * (c % 2))) & 15) as f64;
        let mn = half::f16::from_bits(qp[2 * r]).to_f64();
        let scl = half::f16::from_bits(qp[2 * r + 1]).to_f64();
        b_max = b_max.max(scl.abs() * q_abs_max * (0..d).map(code).sum::<f64>());
        for (gi, qr) in q.iter().enumerate() {
            let (mut dot, mut abs, mut sq, mut sabs) = (0f64, 0f64, 0f64, 0f64);
            for c in 0..d {
                dot += qr[c] * code(c);
                abs += qr[c].abs() * code(c);
                sq += qr[c];
                sabs += qr[c].abs();
            }
            let x = mn * sq + scl * dot;
            a_max = a_max.max(mn.abs() * sabs + scl.abs() * abs);
            logits[gi][j] = if cap > 0.0 { cap * (x / cap).tanh() } else { x };
        }
    }
    let u = 2f64.powi(-24);
    // The CPU's scalar estimate, and the device's on tensor cores (docs/policies.md): both within lambda.
    let lambda = (d as f64 + 16.0) * u * a_max + (2.125 * d as f64 + 8.0) * 2.0 * u * b_max + if cap > 0.0 { cap * 2f64.powi(-17) } else { 0.0 };
    let delta = 2.0 * ((2.0 * lambda).exp() - 1.0) + 2f64.powi(-20);
    let pr: Vec<Vec<f64>> = logits
        .iter()
        .map(|l| {
            let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = l.iter().map(|&x| (x - m).exp()).sum();
            l.iter().map(|&x| (x - m).exp() / z).collect()
        })
        .collect();
    let w: Vec<f64> = (0..n).map(|j| pr.iter().map(|r| r[j]).fold(0f64, f64::max)).collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    let mut rank = vec![0usize; n];
    for (k, &j) in order.iter().enumerate() {
        rank[j] = k;
    }
    let tot: Vec<f64> = pr.iter().map(|r| r.iter().sum()).collect();
    let target: Vec<f64> = tot.iter().map(|t| p as f64 * t).collect();
    // Prefix masses before place k; the first k where every row may have reached (within delta), and
    // the first where every row surely has.
    let mut before = vec![0f64; g];
    let (mut k_lo, mut k_hi) = (n, n);
    for (k, &j) in order.iter().enumerate() {
        let may = (0..g).all(|r| before[r] >= target[r] - delta * tot[r]);
        let sure = (0..g).all(|r| before[r] >= target[r] + delta * tot[r]);
        if may && k_lo == n {
            k_lo = k;
        }
        if sure {
            k_hi = k;
            break;
        }
        for r in 0..g {
            before[r] += pr[r][j];
        }
    }
    let k_hi = k_hi.max(k_lo);
    let w_band = (if k_hi > 0 { w[order[k_hi - 1]] } else { w[order[0]] }, if k_lo < n { w[order[k_lo]] } else { 0.0 });
    RowRef { w, rank, k_lo, k_hi, w_band, delta }
}

/// An f64 attention output of query row `t`, query head `hq`, over `tokens` of sequence `s` (no window).
pub(crate) fn attend_f64(f: &Fixture, s: usize, t: usize, hq: usize, tokens: &[usize]) -> Vec<f64> {
    let sp = &f.spec;
    let (d, g, bs) = (sp.head_dim, sp.num_q_heads / sp.num_kv_heads, sp.block_size);
    let (qs, st) = (f.q_strides.map(|x| x as usize), f.cache_strides.map(|x| x as usize));
    let h = hq / g;
    let q: Vec<f64> = (0..d).map(|c| f.q.get(t * qs[0] + hq * qs[1] + c * qs[2])).collect();
    // What the cache holds: an FP8 row's bytes decode unscaled, so its scale is applied here.
    let (k_scale, v_scale) = if f.cache_dtype().is_fp8() { (f.k_scale as f64, f.v_scale as f64) } else { (1.0, 1.0) };
    let row = |pos: usize, off: usize, scale: f64| -> Vec<f64> {
        let b = f.block_table[s * f.max_blocks + pos / bs] as usize;
        (0..d).map(|c| f.cache.get(off + b * st[0] + (pos % bs) * st[1] + h * st[2] + c * st[3]) * scale).collect()
    };
    let ks: Vec<Vec<f64>> = tokens.iter().map(|&pos| row(pos, 0, k_scale)).collect();
    let vs: Vec<Vec<f64>> = tokens.iter().map(|&pos| row(pos, f.v_offset, v_scale)).collect();
    attend_rows(&q, &ks, &vs, 1, d, f.scale as f64, sp.softcap as f64).0
}

/// Runs `policy` (`base > top_p(p)`) on fixture `spec`/`seed` (every key replaced by `key(row)` when given)
/// on the CPU and on CUDA device 0, and checks the GPU's sets against the reference as described above.
pub fn top_p_agreement(spec: &CaseSpec, policy: &str, base: Base, p: f32, seed: u64, key: Option<&dyn Fn(usize) -> f64>) -> Result<TopPAgreement> {
    assert_eq!(spec.window, 0, "the reference's candidates assume no window");
    let mut f = fixture_with_keys(spec, seed, key);
    let cpu = Engine::new(cfg_for(&f, policy, Device::Cpu))?;
    cpu.record_visits(true);
    let outs_cpu = run_on_engine(&cpu, &mut f)?;
    let mut v_cpu = cpu.take_visits();
    let meta = cpu.metadata_snapshot(0)?.expect("top-p keeps an INT4 copy");
    let (gpu, outs_gpu): (Engine, Outputs) = run_fixture_cuda_policy(&f, policy)?;
    let mut v_gpu = gpu.take_visits();
    v_cpu.sort_by_key(|r| (r.seq_id, r.kv_head));
    v_gpu.sort_by_key(|r| (r.seq_id, r.kv_head));
    let (oc, _) = outs_cpu.to_f64(&f);
    let (og, _) = outs_gpu.to_f64(&f);
    let lens = f.seq_lens.clone();
    Ok(top_p_rows_agree(&f, &meta, &v_cpu, &v_gpu, &|s, _| base.candidates(lens[s] as usize), p, &oc, &og))
}

/// The check of one run: the engines' visit records (sorted by sequence and KV head), each row's candidate
/// positions (`cand(s, h)`, increasing: the base selector's set on the CPU engine), the CPU engine's
/// metadata and both engines' outputs (f64). Rows whose sets differ are listed in `rows_apart`.
#[allow(clippy::too_many_arguments)]
pub fn top_p_rows_agree(f: &Fixture, meta: &kvsparse::meta::MetaSnapshot, v_cpu: &[VisitRecord], v_gpu: &[VisitRecord], cand: &dyn Fn(usize, usize) -> Vec<usize>, p: f32, oc: &[f64], og: &[f64]) -> TopPAgreement {
    let spec = &f.spec;
    let mut res = TopPAgreement { rows: v_cpu.len(), ..Default::default() };
    if v_cpu.len() != v_gpu.len() {
        res.violation = Some(format!("{} CPU policy rows vs {} GPU rows", v_cpu.len(), v_gpu.len()));
        return res;
    }
    let (hq, d) = (spec.num_q_heads, spec.head_dim);
    let g = hq / spec.num_kv_heads;
    let mut want = oc.to_vec();
    for (a, b) in v_cpu.iter().zip(v_gpu) {
        if (a.seq_id, a.kv_head) != (b.seq_id, b.kv_head) {
            res.violation = Some(format!("row order differs: seq {} head {} vs seq {} head {}", a.seq_id, a.kv_head, b.seq_id, b.kv_head));
            return res;
        }
        let (s, h) = ((a.seq_id - 1000) as usize, a.kv_head);
        let (tc, tg) = (tokens_of(a), tokens_of(b));
        res.kept_cpu += tc.len();
        res.kept_gpu += tg.len();
        let cand = cand(s, h);
        let rf = row_reference(f, meta, s, h, &cand, p);
        res.max_allowed = res.max_allowed.max(2.0 * rf.delta);
        if tc == tg {
            continue;
        }
        res.rows_differing += 1;
        let t = f.query_start_loc[s] as usize;
        res.rows_apart.push((t, h));
        let index = |pos: usize| cand.binary_search(&pos).ok();
        let (mut ic, mut ig) = (vec![false; cand.len()], vec![false; cand.len()]);
        for (set, mark) in [(&tc, &mut ic), (&tg, &mut ig)] {
            for &pos in set.iter() {
                match index(pos) {
                    Some(j) => mark[j] = true,
                    None if res.violation.is_none() => res.violation = Some(format!("seq {s} head {h}: token {pos} kept but not a candidate")),
                    None => {}
                }
            }
        }
        for j in 0..cand.len() {
            if ic[j] == ig[j] {
                continue;
            }
            res.differing += 1;
            let k = rf.rank[j];
            // Relative distance; infinite from a zero weight (nothing can be borderline to it).
            let rel = |a: f64, b: f64| if b > 0.0 { (a - b) / b } else { f64::INFINITY };
            let margin = if k >= rf.k_lo && k < rf.k_hi {
                0.0
            } else if rf.w[j] > rf.w_band.1 {
                rel(rf.w[j], rf.w_band.1)
            } else if rf.w[j] < rf.w_band.0 {
                (rf.w_band.0 - rf.w[j]) / rf.w_band.0 // w_band.0 > w >= 0
            } else {
                0.0
            };
            if margin >= res.worst_margin {
                res.worst_margin = margin;
                res.allowed_at_worst = 2.0 * rf.delta;
            }
            if margin > 2.0 * rf.delta && res.violation.is_none() {
                res.violation = Some(format!(
                    "seq {s} head {h}: token {} kept by the {} only, reference place {k} (mass band {}..{}), weight {:.6e} (band {:.6e}..{:.6e}), margin {margin:.3e} > 2 delta {:.3e}",
                    cand[j],
                    if ic[j] { "CPU" } else { "GPU" },
                    rf.k_lo,
                    rf.k_hi,
                    rf.w[j],
                    rf.w_band.0,
                    rf.w_band.1,
                    2.0 * rf.delta
                ));
            }
        }
        // This row's outputs: an f64 attention over the GPU's own set.
        for gi in 0..g {
            let o = attend_f64(f, s, t, h * g + gi, &tg);
            want[(t * hq + h * g + gi) * d..][..d].copy_from_slice(&o);
        }
    }
    res.out_rel = rel_err(og, &want);
    res.out_tol = tolerance(spec.dtype).0;
    res
}

/// The GPU's visit records (sorted by sequence and head) of one fresh CUDA engine running `policy` on `f`.
pub fn gpu_visits(f: &Fixture, policy: &str) -> Result<Vec<VisitRecord>> {
    let (gpu, _) = run_fixture_cuda_policy(f, policy)?;
    let mut v = gpu.take_visits();
    v.sort_by_key(|r| (r.seq_id, r.kv_head));
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsparse::tensor::DType;

    /// The row check on the CPU engine's own records (no GPU): equal records agree; the same records with
    /// the row's heaviest candidate dropped on the "GPU" side are a violation (far from the boundary), and
    /// the same with the last kept candidate (at the boundary) are not.
    #[test]
    fn only_borderline_tokens_may_differ() {
        let spec = CaseSpec::new("top-p-rows", DType::BF16, 64, 8, 2, 16, vec![(1, 300), (1, 700)]);
        let mut f = Fixture::new(&spec, 7);
        let cpu = Engine::new(cfg_for(&f, "all > top_p(p=0.9)", Device::Cpu)).expect("engine");
        cpu.record_visits(true);
        let outs = run_on_engine(&cpu, &mut f).expect("run");
        let mut v = cpu.take_visits();
        v.sort_by_key(|r| (r.seq_id, r.kv_head));
        let meta = cpu.metadata_snapshot(0).expect("meta").expect("int4 copy");
        let (oc, _) = outs.to_f64(&f);
        let lens = f.seq_lens.clone();
        let cand = |s: usize, _h: usize| Base::All.candidates(lens[s] as usize);
        let same = top_p_rows_agree(&f, &meta, &v, &v, &cand, 0.9, &oc, &oc);
        assert!(same.violation.is_none() && same.differing == 0 && same.rows == v.len(), "{same:?}");
        // Row 0's candidates in the reference order: the heaviest, and the last one the CPU kept.
        let (s, h) = ((v[0].seq_id - 1000) as usize, v[0].kv_head);
        let c = cand(s, h);
        let rf = row_reference(&f, &meta, s, h, &c, 0.9);
        let kept = tokens_of(&v[0]);
        let by_rank = |k: usize| c[(0..c.len()).find(|&j| rf.rank[j] == k).expect("a place")];
        let last_kept = (0..c.len()).map(by_rank).take_while(|p| kept.contains(p)).last().expect("a kept token");
        for (drop, far) in [(by_rank(0), true), (last_kept, false)] {
            let mut g = v.clone();
            g[0].spans = kept.iter().filter(|&&p| p != drop).map(|&p| (p, p + 1)).collect();
            let ag = top_p_rows_agree(&f, &meta, &v, &g, &cand, 0.9, &oc, &oc);
            assert_eq!(ag.differing, 1, "{ag:?}");
            assert_eq!(ag.violation.is_some(), far, "token {drop} (far {far}): {ag:?}");
        }
    }
}
