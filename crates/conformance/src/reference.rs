//! The straightforward float64 reference: causal attention of every query row over the logical keys of
//! its sequence, computed with a plain two-pass softmax. No chunking, no online rescaling, no f32.

/// Logical (already gathered) inputs of one sequence, in f64.
pub struct SeqRef<'a> {
    /// `[q_len][num_q_heads][dim]`
    pub q: &'a [f64],
    /// `[seq_len][num_kv_heads][dim]`
    pub k: &'a [f64],
    pub v: &'a [f64],
    pub q_len: usize,
    pub seq_len: usize,
}

#[derive(Clone, Copy, Debug)]
pub struct RefParams {
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub dim: usize,
    pub scale: f64,
    pub softcap: f64,
    pub window: usize,
}

/// Returns (`out [q_len][num_q_heads][dim]`, `lse [q_len][num_q_heads]`).
pub fn attention_f64(s: &SeqRef, p: &RefParams) -> (Vec<f64>, Vec<f64>) {
    let (hq, hk, d) = (p.num_q_heads, p.num_kv_heads, p.dim);
    let g = hq / hk;
    let mut out = vec![0.0; s.q_len * hq * d];
    let mut lse = vec![0.0; s.q_len * hq];
    let mut logits = vec![0.0; s.seq_len];
    for i in 0..s.q_len {
        let pos = s.seq_len - s.q_len + i;
        let lo = if p.window == 0 { 0 } else { (pos + 1).saturating_sub(p.window) };
        for h in 0..hq {
            let kh = h / g;
            let qrow = &s.q[(i * hq + h) * d..(i * hq + h + 1) * d];
            let mut m = f64::NEG_INFINITY;
            for j in lo..=pos {
                let krow = &s.k[(j * hk + kh) * d..(j * hk + kh + 1) * d];
                let mut x: f64 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() * p.scale;
                if p.softcap > 0.0 {
                    x = p.softcap * (x / p.softcap).tanh();
                }
                logits[j] = x;
                m = m.max(x);
            }
            let mut l = 0.0;
            let o = &mut out[(i * hq + h) * d..(i * hq + h + 1) * d];
            for j in lo..=pos {
                let w = (logits[j] - m).exp();
                l += w;
                let vrow = &s.v[(j * hk + kh) * d..(j * hk + kh + 1) * d];
                for (oo, vv) in o.iter_mut().zip(vrow) {
                    *oo += w * vv;
                }
            }
            for oo in o.iter_mut() {
                *oo /= l;
            }
            lse[i * hq + h] = m + l.ln();
        }
    }
    (out, lse)
}

/// f64 attention of `g` query rows `q` (`g x d`, unscaled) over keys `ks` and values `vs`: outputs (`g x d`)
/// and LSEs (natural log, of the scaled and soft-capped logits). The agreement tests check a GPU output
/// over the GPU's own positions with it.
pub fn attend_rows(q: &[f64], ks: &[Vec<f64>], vs: &[Vec<f64>], g: usize, d: usize, scale: f64, softcap: f64) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut lse) = (vec![0f64; g * d], vec![0f64; g]);
    for r in 0..g {
        let qr = &q[r * d..(r + 1) * d];
        let l: Vec<f64> = ks
            .iter()
            .map(|k| {
                let x = qr.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale;
                if softcap > 0.0 { softcap * (x / softcap).tanh() } else { x }
            })
            .collect();
        let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = l.iter().map(|&x| (x - m).exp()).sum();
        for (j, v) in vs.iter().enumerate() {
            let p = (l[j] - m).exp() / z;
            for c in 0..d {
                out[r * d + c] += p * v[c];
            }
        }
        lse[r] = m + z.ln();
    }
    (out, lse)
}

/// ‖a − b‖ / ‖b‖ over two equally long vectors (NaN anywhere gives NaN, which fails every tolerance).
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let mut num = 0.0;
    let mut den = 0.0;
    for (x, y) in a.iter().zip(b) {
        num += (x - y) * (x - y);
        den += y * y;
    }
    if a.iter().any(|x| x.is_nan()) {
        return f64::NAN;
    }
    (num / den.max(1e-300)).sqrt()
}

/// Largest absolute difference (NaN if any element is NaN).
pub fn max_abs_err(a: &[f64], b: &[f64]) -> f64 {
    let mut worst: f64 = 0.0;
    for (x, y) in a.iter().zip(b) {
        if x.is_nan() || y.is_nan() {
            return f64::NAN;
        }
        worst = worst.max((x - y).abs());
    }
    worst
}
