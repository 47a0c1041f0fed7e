//! Scoring kernels the policy decisions need: Quest's page upper bound from the per-page key min/max,
//! Twilight's weight estimate from the INT4 copy of K (both read metadata only, never K), and exact
//! softmax weights over chosen positions for full steps (these read K).

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

/// Quest's upper bound of `q·k` over a page with channel-wise key bounds `[mn, mx]`:
/// `Σ_i max(q_i·mn_i, q_i·mx_i)`, which is `>=` the score of every key in the page.
///
/// The sum has a fixed order that the CUDA selection kernel (kernels/policy/quest.cu) repeats bit for bit with
/// one half-warp per page: sixteen lane sums, lane `l` over channels `l, l+16, l+32, ...` in order (each
/// product rounded on its own), then a butterfly `v[j] += v[j ^ s]` for s = 8, 4, 2, 1, the result in
/// lane 0. The sixteen lanes vectorise on the CPU too. `q.len()` must be a multiple of 16 (every
/// supported head size is).
#[inline(always)]
pub fn quest_bound(q: &[f32], mn: &[f32], mx: &[f32]) -> f32 {
    debug_assert!(q.len() % 16 == 0);
    let mut acc = [0f32; 16];
    for ((x, a), b) in q.chunks_exact(16).zip(mn.chunks_exact(16)).zip(mx.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += (x[l] * a[l]).max(x[l] * b[l]);
        }
    }
    butterfly16(acc)
}

/// `v[j] += v[j ^ s]` for s = 8, 4, 2, 1 (a warp's xor-shuffle reduction over 16 lanes); lane 0's value.
#[inline(always)]
pub fn butterfly16(mut v: [f32; 16]) -> f32 {
    for s in [8usize, 4, 2, 1] {
        let prev = v;
        for j in 0..16 {
            v[j] = prev[j] + prev[j ^ s];
        }
    }
    v[0]
}

/// Bounds of the pages `lo/page ..= hi/page` (max over the group's rows and over the page's units) into
/// `out`; returns the metadata bytes read.
#[allow(clippy::too_many_arguments)]
pub fn quest_page_scores(q: &[f32], rows: usize, d: usize, lim: RowLimits, page: usize, blocks: &[u32], head: usize, meta: &LayerMeta, out: &mut Vec<f32>) -> u64 {
    match isa::decisions() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 | IsaLevel::Avx512 => unsafe { quest_scores_avx2(q, rows, d, lim, page, blocks, head, meta, out) },
        IsaLevel::Portable => quest_scores_generic::<Portable>(q, rows, d, lim, page, blocks, head, meta, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn quest_scores_avx2(q: &[f32], rows: usize, d: usize, lim: RowLimits, page: usize, blocks: &[u32], head: usize, meta: &LayerMeta, out: &mut Vec<f32>) -> u64 {
    quest_scores_generic::<crate::cpu::convert::Avx2>(q, rows, d, lim, page, blocks, head, meta, out)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn quest_scores_generic<I: Isa>(q: &[f32], rows: usize, d: usize, lim: RowLimits, page: usize, blocks: &[u32], head: usize, meta: &LayerMeta, out: &mut Vec<f32>) -> u64 {
    let (mut mn, mut mx) = (vec![0f32; d], vec![0f32; d]);
    let mut bytes = 0u64;
    out.clear();
    for pg in lim.lo / page..=lim.hi / page {
        let (a, b) = ((pg * page).max(lim.lo), ((pg + 1) * page).min(lim.hi + 1));
        let mut best = f32::NEG_INFINITY;
        let mut u0 = a / meta.unit;
        while u0 * meta.unit < b {
            let (blk, u) = (u0 / meta.units_per_block, u0 % meta.units_per_block);
            let (mnb, mxb) = meta.unit_minmax(blocks[blk] as usize, u, head);
            // SAFETY: both slices hold `d` fp16 values.
            unsafe {
                I::f16_to_f32(mnb.as_ptr(), &mut mn, d);
                I::f16_to_f32(mxb.as_ptr(), &mut mx, d);
            }
            for r in 0..rows {
                best = best.max(quest_bound(&q[r * d..(r + 1) * d], &mn, &mx));
            }
            bytes += (2 * d * 2) as u64;
            u0 += 1;
        }
        out.push(best);
    }
    bytes
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
