//! NaN and infinity propagation, as a check any backend can run (the contract is documented on
//! `kvs_forward_args` and `kvs_merge_args` in the header):
//!
//! * attention: a row whose query, or the key of any position it attends, holds a NaN or an infinity (any
//!   logit that is not finite) comes out NaN in every element with a NaN LSE; a NaN or infinity in the value
//!   of an attended position makes the output elements it touches non-finite and leaves the LSE alone;
//!   memory no row of the call attends (unused slots, padding rows of a cache write, keys outside every
//!   row's window) changes nothing;
//! * merge: a side with LSE −inf is empty and its output is not read; a NaN or +inf LSE gives a NaN row
//!   and LSE; a NaN or infinity in the output of a side with a finite LSE reaches the merged elements.
//!
//! [`check_attention`] and [`check_merge`] take the backend as a closure (the CPU engine here, the CUDA
//! engine through `conformance::cuda`), so both are held to the same expectations.

use super::fixture::{Fixture, Outputs, Plant};
use super::hostbuf::HostBuf;
use super::reference::{max_abs_err, rel_err};
use super::{tolerance, CaseResult, CaseSpec};
use kvsparse::error::Result;
use kvsparse::tensor::DType;

/// One attention case: a geometry and the values planted in it.
#[derive(Clone, Debug)]
pub struct AttentionCase {
    pub spec: CaseSpec,
    pub poison: Vec<Plant>,
}

fn spec(name: &str, dtype: DType, seqs: Vec<(usize, usize)>, window: usize, softcap: f32) -> CaseSpec {
    let mut c = CaseSpec::new(name, dtype, 64, 4, 2, 16, seqs);
    c.window = window;
    c.softcap = softcap;
    // Unused table columns are -1 here (as the suite was written); the planted values are the point.
    c.columns = super::fixture::Columns::Pad;
    c
}

/// The cases: NaN and ±inf in queries, keys and values of decode and prefill rows, with and without a
/// sliding window and soft-cap, and non-finite garbage in memory nobody attends.
pub fn attention_cases() -> Vec<AttentionCase> {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    // Decode at 40, a 5-token chunk ending at 37 (positions 32..=36), a whole 16-token prefill.
    let mixed = vec![(1, 40), (5, 37), (16, 16)];
    vec![
        AttentionCase {
            spec: spec("nonfinite-query-f32", DType::F32, mixed.clone(), 0, 0.0),
            poison: vec![Plant::Query { token: 0, head: 1, value: nan }, Plant::Query { token: 3, head: 2, value: inf }, Plant::Query { token: 10, head: 0, value: -inf }],
        },
        AttentionCase {
            spec: spec("nonfinite-key-f32", DType::F32, mixed.clone(), 0, 0.0),
            poison: vec![
                Plant::Key { seq: 0, pos: 7, kv_head: 0, value: nan },
                Plant::Key { seq: 1, pos: 34, kv_head: 1, value: -inf },
                Plant::Key { seq: 2, pos: 9, kv_head: 0, value: inf },
            ],
        },
        AttentionCase {
            spec: spec("nonfinite-value-bf16", DType::BF16, mixed.clone(), 0, 0.0),
            poison: vec![
                Plant::Value { seq: 0, pos: 3, kv_head: 1, dim: 5, value: inf },
                Plant::Value { seq: 1, pos: 35, kv_head: 0, dim: 9, value: nan },
                Plant::Value { seq: 2, pos: 15, kv_head: 1, dim: 63, value: -inf },
            ],
        },
        AttentionCase {
            // Window 8: the decode row at 39 sees 32..=39; the chunk's rows at 24..=29 see from 17..=22 on.
            spec: spec("nonfinite-window-f16", DType::F16, vec![(1, 40), (6, 30)], 8, 0.0),
            poison: vec![
                Plant::Key { seq: 0, pos: 5, kv_head: 0, value: nan },
                Plant::Value { seq: 1, pos: 2, kv_head: 1, dim: 0, value: nan },
                Plant::Key { seq: 1, pos: 20, kv_head: 1, value: nan },
            ],
        },
        AttentionCase {
            // A soft-cap maps an infinite logit to the cap: the row must still come out NaN.
            spec: spec("nonfinite-softcap-f32", DType::F32, mixed.clone(), 0, 30.0),
            poison: vec![Plant::Key { seq: 0, pos: 39, kv_head: 1, value: inf }, Plant::Query { token: 2, head: 0, value: inf }],
        },
        AttentionCase {
            // One long decode row: backends split its keys (split-KV) and merge partials, poisoned or not.
            spec: spec("nonfinite-split-kv-f32", DType::F32, vec![(1, 3000), (1, 2000)], 0, 0.0),
            poison: vec![Plant::Key { seq: 0, pos: 100, kv_head: 0, value: nan }, Plant::Value { seq: 1, pos: 1900, kv_head: 1, dim: 3, value: inf }],
        },
        AttentionCase { spec: spec("nonfinite-garbage-nan-bf16", DType::BF16, mixed.clone(), 0, 0.0), poison: vec![Plant::Garbage { value: nan }] },
        AttentionCase { spec: spec("nonfinite-garbage-inf-f32", DType::F32, mixed, 0, 0.0), poison: vec![Plant::Garbage { value: f64::INFINITY }] },
    ]
}

/// What one output row (token, query head) must hold.
#[derive(Clone, Debug, Default, PartialEq)]
struct RowExpect {
    /// NaN everywhere, NaN LSE.
    nan_row: bool,
    /// Elements that must not be finite (a non-finite value the row attends).
    nonfinite: Vec<usize>,
    /// Elements that may be non-finite: a value another row of the same sequence attends (a backend may
    /// multiply it by a zero weight for this row, 0·inf = NaN, as tiled kernels do).
    maybe: Vec<usize>,
}

fn expectations(f: &Fixture, poison: &[Plant]) -> Vec<RowExpect> {
    let s = &f.spec;
    let (hq, g) = (s.num_q_heads, s.num_q_heads / s.num_kv_heads);
    let lo_of = |pos: usize| if s.window == 0 { 0 } else { (pos + 1).saturating_sub(s.window) };
    let mut rows = vec![RowExpect::default(); f.num_tokens * hq];
    let mut t0 = 0;
    for (si, &(q_len, seq_len)) in s.seqs.iter().enumerate() {
        let first = seq_len - q_len;
        // Positions attended by some row of this sequence: [lo of the first row, last position].
        let (seq_lo, seq_hi) = (lo_of(first), seq_len - 1);
        for t in 0..q_len {
            let pos = first + t;
            let lo = lo_of(pos);
            for h in 0..hq {
                let e = &mut rows[(t0 + t) * hq + h];
                for p in poison {
                    match *p {
                        Plant::Query { token, head, .. } if token == t0 + t && head == h => e.nan_row = true,
                        Plant::Key { seq, pos: kp, kv_head, .. } if seq == si && kv_head == h / g && (lo..=pos).contains(&kp) => e.nan_row = true,
                        Plant::Value { seq, pos: vp, kv_head, dim, .. } if seq == si && kv_head == h / g => {
                            if (lo..=pos).contains(&vp) {
                                e.nonfinite.push(dim);
                            } else if (seq_lo..=seq_hi).contains(&vp) {
                                e.maybe.push(dim);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        t0 += q_len;
    }
    rows
}

/// Builds `case` from `seed`, runs it through `run` (cache write + forward on some backend) and checks
/// every row against the contract; the rows no poison reaches must match the float64 reference.
pub fn check_attention(case: &AttentionCase, seed: u64, run: &mut dyn FnMut(&mut Fixture) -> Result<Outputs>) -> CaseResult {
    let mut f = Fixture::poisoned(&case.spec, seed, &case.poison);
    let name = case.spec.name.clone();
    let fail = |msg: String, rel: f64, lse: f64| CaseResult { name: name.clone(), seed, rel_err: rel, lse_err: lse, pass: false, unsupported: false, error: Some(msg) };
    let outs = match run(&mut f) {
        Ok(o) => o,
        Err(e) => return fail(format!("the call failed: {e}"), f64::NAN, f64::NAN),
    };
    let (o, l) = outs.to_f64(&f);
    let d = f.spec.head_dim;
    let (mut got, mut want, mut got_lse, mut want_lse) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut problems = Vec::new();
    for (r, e) in expectations(&f, &case.poison).iter().enumerate() {
        let (t, h) = (r / f.spec.num_q_heads, r % f.spec.num_q_heads);
        let row = &o[r * d..(r + 1) * d];
        if e.nan_row {
            if !(row.iter().all(|x| x.is_nan()) && l[r].is_nan()) {
                problems.push(format!("token {t} head {h}: expected a NaN row and LSE (non-finite logit), got lse {} and {} NaN elements", l[r], row.iter().filter(|x| x.is_nan()).count()));
            }
            continue;
        }
        if !l[r].is_finite() {
            problems.push(format!("token {t} head {h}: LSE {} should be finite (no non-finite logit)", l[r]));
        }
        got_lse.push(l[r]);
        want_lse.push(f.ref_lse[r]);
        for (i, &x) in row.iter().enumerate() {
            if e.nonfinite.contains(&i) {
                if x.is_finite() {
                    problems.push(format!("token {t} head {h} element {i}: {x} should be non-finite (an attended value is)"));
                }
            } else if e.maybe.contains(&i) && !x.is_finite() {
                // allowed
            } else {
                got.push(x);
                want.push(f.ref_out[r * d + i]);
            }
        }
    }
    let (rel, lse) = (rel_err(&got, &want), max_abs_err(&got_lse, &want_lse));
    let (tol_o, tol_l) = tolerance(f.spec.dtype);
    if !(rel <= tol_o && lse <= tol_l) {
        problems.push(format!("rows without poison differ from the reference: rel {rel:.3e} (tol {tol_o:.0e}), lse {lse:.3e} (tol {tol_l:.0e})"));
    }
    if problems.is_empty() {
        CaseResult { name, seed, rel_err: rel, lse_err: lse, pass: true, unsupported: false, error: None }
    } else {
        let n = problems.len();
        problems.truncate(8);
        fail(format!("{n} problems: {}", problems.join("; ")), rel, lse)
    }
}

/// Every attention case (seeds `seed`, `seed + 1`, ...).
pub fn check_all_attention(seed: u64, run: &mut dyn FnMut(&mut Fixture) -> Result<Outputs>) -> Vec<CaseResult> {
    attention_cases().iter().enumerate().map(|(i, c)| check_attention(c, seed.wrapping_add(i as u64), run)).collect()
}

/// Host inputs of a merge check: `[tokens, heads, dim]` outputs of one dtype, f32 LSEs `[tokens, heads]`.
pub struct MergeInputs {
    pub tokens: usize,
    pub heads: usize,
    pub dim: usize,
    pub out_a: HostBuf,
    pub lse_a: Vec<f32>,
    pub out_b: HostBuf,
    pub lse_b: Vec<f32>,
}

/// Merge rows (token, head) and what each plants; the remaining rows are ordinary.
const MERGE_ROWS: [&str; 9] = [
    "finite",
    "a empty (lse -inf), out_a NaN",
    "both empty",
    "lse_a NaN",
    "lse_b +inf",
    "out_a[3] NaN",
    "out_b[7] +inf, weight underflows",
    "b empty, out_b +inf",
    "a empty, out_a -inf, lse_b finite",
];

/// Builds the merge inputs for `dtype` from `seed` (4 tokens × 4 heads × 64).
pub fn merge_inputs(dtype: DType, seed: u64) -> MergeInputs {
    let mut rng = kvsparse::rng::Rng::new(seed);
    let (t, h, d) = (4usize, 4usize, 64usize);
    let mut m = MergeInputs { tokens: t, heads: h, dim: d, out_a: HostBuf::zeros(dtype, t * h * d), lse_a: vec![0.0; t * h], out_b: HostBuf::zeros(dtype, t * h * d), lse_b: vec![0.0; t * h] };
    for r in 0..t * h {
        for i in 0..d {
            m.out_a.set(r * d + i, rng.normal());
            m.out_b.set(r * d + i, rng.normal());
        }
        m.lse_a[r] = (rng.normal() * 3.0) as f32;
        m.lse_b[r] = (rng.normal() * 3.0) as f32;
        let (nan, inf) = (f64::NAN, f64::INFINITY);
        match r {
            1 => {
                m.lse_a[r] = f32::NEG_INFINITY;
                (0..d).for_each(|i| m.out_a.set(r * d + i, nan));
            }
            2 => (m.lse_a[r], m.lse_b[r]) = (f32::NEG_INFINITY, f32::NEG_INFINITY),
            3 => m.lse_a[r] = f32::NAN,
            4 => m.lse_b[r] = f32::INFINITY,
            5 => m.out_a.set(r * d + 3, nan),
            6 => {
                m.out_b.set(r * d + 7, inf);
                m.lse_b[r] = m.lse_a[r] - 200.0;
            }
            7 => {
                m.lse_b[r] = f32::NEG_INFINITY;
                (0..d).for_each(|i| m.out_b.set(r * d + i, inf));
            }
            8 => {
                m.lse_a[r] = f32::NEG_INFINITY;
                (0..d).for_each(|i| m.out_a.set(r * d + i, -inf));
            }
            _ => {}
        }
    }
    m
}

/// Runs `merge` (which returns the merged output as f64 `[tokens*heads*dim]` and the merged LSE) on
/// [`merge_inputs`] and checks every row against the contract and an f64 merge.
pub fn check_merge(dtype: DType, seed: u64, merge: &mut dyn FnMut(&MergeInputs) -> Result<(Vec<f64>, Vec<f32>)>) -> CaseResult {
    let m = merge_inputs(dtype, seed);
    let name = format!("nonfinite-merge-{}", dtype.name());
    let (o, l) = match merge(&m) {
        Ok(x) => x,
        Err(e) => return CaseResult { name, seed, rel_err: f64::NAN, lse_err: f64::NAN, pass: false, unsupported: false, error: Some(format!("the call failed: {e}")) },
    };
    let d = m.dim;
    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
    let mut problems = Vec::new();
    for r in 0..m.tokens * m.heads {
        let what = MERGE_ROWS.get(r).copied().unwrap_or("finite");
        let (la, lb) = (m.lse_a[r] as f64, m.lse_b[r] as f64);
        let row = &o[r * d..(r + 1) * d];
        let invalid = |x: f64| x.is_nan() || x == f64::INFINITY;
        let (want, want_lse): (Vec<f64>, f64) = if invalid(la) || invalid(lb) {
            (vec![f64::NAN; d], f64::NAN)
        } else if la == f64::NEG_INFINITY && lb == f64::NEG_INFINITY {
            (vec![0.0; d], f64::NEG_INFINITY)
        } else if lb == f64::NEG_INFINITY {
            ((0..d).map(|i| m.out_a.get(r * d + i)).collect(), la)
        } else if la == f64::NEG_INFINITY {
            ((0..d).map(|i| m.out_b.get(r * d + i)).collect(), lb)
        } else {
            let mx = la.max(lb);
            let (wa, wb) = ((la - mx).exp(), (lb - mx).exp());
            ((0..d).map(|i| (wa * m.out_a.get(r * d + i) + wb * m.out_b.get(r * d + i)) / (wa + wb)).collect(), mx + (wa + wb).ln())
        };
        let lse_ok = if want_lse.is_nan() { l[r].is_nan() } else if want_lse.is_infinite() { l[r] as f64 == want_lse } else { (l[r] as f64 - want_lse).abs() <= 1e-4 * (1.0 + want_lse.abs()) };
        if !lse_ok {
            problems.push(format!("row {r} ({what}): lse {} expected {want_lse}", l[r]));
        }
        for i in 0..d {
            let (x, y) = (row[i], want[i]);
            let ok = if y.is_nan() { x.is_nan() } else if y.is_infinite() { !x.is_finite() } else { (x - y).abs() <= tol * (1.0 + y.abs()) };
            if !ok {
                problems.push(format!("row {r} ({what}) element {i}: {x} expected {y}"));
            }
        }
    }
    let pass = problems.is_empty();
    let n = problems.len();
    problems.truncate(8);
    CaseResult { name, seed, rel_err: 0.0, lse_err: 0.0, pass, unsupported: false, error: (!pass).then(|| format!("{n} problems: {}", problems.join("; "))) }
}

/// The CPU engine as a merge backend for [`check_merge`].
pub fn merge_on_cpu(m: &MergeInputs) -> Result<(Vec<f64>, Vec<f32>)> {
    use kvsparse::engine::{Engine, MergeArgs};
    use kvsparse::tensor::TensorRef;
    let dtype = m.out_a.dtype();
    let engine = Engine::new(kvsparse::config::EngineConfig::new(1, m.heads, m.heads, m.dim, 16, dtype))?;
    let (shape3, shape2) = ([m.tokens as i64, m.heads as i64, m.dim as i64], [m.tokens as i64, m.heads as i64]);
    let (mut a, mut b) = (m.out_a.clone(), m.out_b.clone());
    let mut out = HostBuf::zeros(dtype, m.out_a.len());
    let mut lse = vec![0f32; m.lse_a.len()];
    engine.merge_states(&MergeArgs {
        out_a: a.view_contiguous(&shape3),
        lse_a: TensorRef::from_slice(&m.lse_a, &shape2),
        out_b: b.view_contiguous(&shape3),
        lse_b: TensorRef::from_slice(&m.lse_b, &shape2),
        out: out.view_contiguous(&shape3),
        lse_out: Some(TensorRef::from_slice_mut(&mut lse, &shape2)),
        stream: std::ptr::null_mut(),
    })?;
    Ok(((0..out.len()).map(|i| out.get(i)).collect(), lse))
}
