//! AttentionPredictor's history row in the decisions' fixed arithmetic, so that the CUDA engine
//! (kernels/predictor.cu) pushes the same bits and its CNN therefore predicts, and selects, the same
//! blocks: logits `decision_softcap(decision_dot(q, k))`, numerators `fast_exp(x − max)` (the max ignores
//! NaN), the normaliser as the exact fixed-point sum `softmax_norm`, weights `f32(e / z)` computed in f64,
//! and the row value of a block the largest weight of its positions over the GQA group (NaN never wins;
//! blocks with no listed position are 0). Every step of it is independent of the order positions are
//! visited in, which lets the device spread a row over many CTAs.

use super::*;
use crate::cpu::math::{decision_dot, decision_softcap, softmax_norm};

/// The block row (`ceil(n / block)` blocks) of the weights of the `g` query rows `q` (scaled, `g × d`)
/// over `positions` (each `< n`, normalised over them) of sequence `blocks`, KV head `head`.
#[allow(clippy::too_many_arguments)]
pub fn history_row(io: &ForwardIo, q: &[f32], g: usize, positions: &[usize], blocks: &[u32], head: usize, n: usize, block: usize, logits: &mut Vec<f32>) -> Vec<f32> {
    let cache = io.cache;
    let (d, bs) = (cache.head_dim, cache.block_size);
    let np = positions.len();
    logits.clear();
    logits.resize(g * np, f32::NEG_INFINITY);
    let mut k = vec![0f32; d];
    for (j, &pos) in positions.iter().enumerate() {
        // SAFETY: pos < n <= seq_len, whose blocks were validated.
        unsafe { load_row::<Portable>(cache.k_row(blocks[pos / bs] as usize, pos % bs, head), cache.dtype, cache.k_dim_stride(), d, &mut k) };
        for r in 0..g {
            logits[r * np + j] = decision_softcap(decision_dot(&q[r * d..(r + 1) * d], &k), io.params.softcap);
        }
    }
    let mut row = vec![0f32; n.div_ceil(block)];
    for r in 0..g {
        let l = &mut logits[r * np..(r + 1) * np];
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            continue;
        }
        for x in l.iter_mut() {
            *x = fast_exp(*x - m);
        }
        let z = softmax_norm(l.iter().copied());
        for (&e, &pos) in l.iter().zip(positions) {
            let w = (e as f64 / z) as f32;
            let b = pos / block;
            if w > row[b] {
                row[b] = w;
            }
        }
    }
    row
}
