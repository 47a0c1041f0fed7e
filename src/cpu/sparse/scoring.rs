//! Scoring kernels the policy decisions share: Twilight's weight estimate from the INT4 copy of K (reads
//! metadata only, never K), and exact softmax weights over chosen positions for full steps (these read
//! K). (Quest's page bound is in src/policy/quest/cpu.rs.)

use super::*;

/// Exact softmax weights of the group's rows over positions `lim.lo ..= lim.hi` (each row normalised over
/// them), maximised over the group, into `out[pos - lo]`. Reads K (a full step's scoring pass).
#[allow(clippy::too_many_arguments)]
pub fn token_weights(io: &ForwardIo, q: &[f32], rows: usize, lim: RowLimits, blocks: &[u32], head: usize, logits: &mut Vec<f32>, out: &mut Vec<f32>) {
    let pos: Vec<usize> = (lim.lo..=lim.hi).collect();
    weights_at(io, q, rows, &pos, blocks, head, logits, out)
}

/// Like [`token_weights`] over an explicit list of positions (normalised over them). Keys are loaded
/// [`CHUNK`] at a time and scored with the attention kernel's register-blocked dot products.
#[allow(clippy::too_many_arguments)]
pub fn weights_at(io: &ForwardIo, q: &[f32], rows: usize, positions: &[usize], blocks: &[u32], head: usize, logits: &mut Vec<f32>, out: &mut Vec<f32>) {
    match isa::decisions() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512 => unsafe { weights_at_avx2(io, q, rows, positions, blocks, head, logits, out) },
        IsaLevel::Portable => weights_at_generic::<Portable>(io, q, rows, positions, blocks, head, logits, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn weights_at_avx2(io: &ForwardIo, q: &[f32], rows: usize, positions: &[usize], blocks: &[u32], head: usize, logits: &mut Vec<f32>, out: &mut Vec<f32>) {
    weights_at_generic::<crate::cpu::convert::Avx2>(io, q, rows, positions, blocks, head, logits, out)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weights_at_generic<I: Isa>(io: &ForwardIo, q: &[f32], rows: usize, positions: &[usize], blocks: &[u32], head: usize, logits: &mut Vec<f32>, out: &mut Vec<f32>) {
    let cache = io.cache;
    let (d, bs) = (cache.head_dim, cache.block_size);
    let n = positions.len();
    logits.clear();
    logits.resize(rows * n, 0.0);
    let mut kbuf = vec![0f32; CHUNK * d];
    let mut sc = vec![0f32; rows * CHUNK];
    for (ci, part) in positions.chunks(CHUNK).enumerate() {
        for (jj, &pos) in part.iter().enumerate() {
            // SAFETY: pos <= hi < seq_len, whose blocks were validated.
            unsafe { load_cache_row::<I>(cache.k_row(blocks[pos / bs] as usize, pos % bs, head), cache.dtype, cache.k_scale, cache.k_dim_stride(), d, &mut kbuf[jj * d..(jj + 1) * d]) };
        }
        I::scores(&mut sc, q, &kbuf, rows, part.len(), d);
        for r in 0..rows {
            for jj in 0..part.len() {
                let mut x = sc[r * CHUNK + jj];
                if io.params.softcap > 0.0 {
                    x = io.params.softcap * (x / io.params.softcap).tanh();
                }
                logits[r * n + ci * CHUNK + jj] = x;
            }
        }
    }
    out.clear();
    out.resize(n, 0.0);
    for r in 0..rows {
        let row = &mut logits[r * n..(r + 1) * n];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f64;
        for x in row.iter_mut() {
            *x = (*x - m).exp();
            z += *x as f64;
        }
        let inv = if z > 0.0 { (1.0 / z) as f32 } else { 0.0 };
        for (o, &x) in out.iter_mut().zip(row.iter()) {
            *o = o.max(x * inv);
        }
    }
}

/// Estimated softmax weights (`rows × n`, each row normalised to sum 1) of the candidate `tokens` from the
/// INT4 copy of K; `q` holds the scaled query rows. `q·k̂ = min·Σq + scale·(q·codes)`, soft-capped, then
/// a softmax per row. The arithmetic is the decisions' fixed order (`math::decision_dot`, products rounded
/// on their own, the normaliser summed in f64), which the CUDA top-p kernel repeats bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn estimate_weights(q: &[f32], rows: usize, d: usize, tokens: &[u32], blocks: &[u32], bs: usize, head: usize, meta: &LayerMeta, softcap: f32, out: &mut Vec<f32>) {
    use crate::cpu::math::{decision_dot, decision_softcap, ordered_sum};
    let n = tokens.len();
    out.clear();
    out.resize(rows * n, 0.0);
    let sums: Vec<f32> = (0..rows).map(|r| ordered_sum(&q[r * d..(r + 1) * d])).collect();
    let mut codes = vec![0f32; d];
    for (j, &t) in tokens.iter().enumerate() {
        let t = t as usize;
        let (packed, mn, scl) = meta.row_q4(blocks[t / bs] as usize, t % bs, head);
        for (pair, &byte) in codes.chunks_exact_mut(2).zip(packed) {
            pair[0] = (byte & 15) as f32;
            pair[1] = (byte >> 4) as f32;
        }
        for r in 0..rows {
            let dot = decision_dot(&q[r * d..(r + 1) * d], &codes);
            out[r * n + j] = decision_softcap(mn * sums[r] + scl * dot, softcap);
        }
    }
    for r in 0..rows {
        softmax_decision(&mut out[r * n..(r + 1) * n]);
    }
}

/// In-place softmax of one row of logits in the decisions' fixed arithmetic: `e = fast_exp(x − max)`,
/// the normaliser summed in f64, `p = e · f32(1 / z)`. A row whose maximum is -inf or NaN is left as
/// zeros or NaN respectively.
pub fn softmax_decision(row: &mut [f32]) {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0f64;
    for x in row.iter_mut() {
        *x = fast_exp(*x - m);
        z += *x as f64;
    }
    if z > 0.0 {
        let inv = (1.0 / z) as f32;
        for x in row.iter_mut() {
            *x *= inv;
        }
    }
}
