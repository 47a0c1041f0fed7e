//! AttentionPredictor: per (sequence, layer, KV head) a history of the last H block-pooled attention rows
//! (softmax weights, max over the block's tokens and the GQA group's query heads); a tiny CNN predicts the
//! next row's block scores from it. Pure decisions and the CNN; the kernels live in `cpu::sparse`.
//!
//! Model (trained by `scripts/train_predictor.py`, weights embedded from `predictor_weights.safetensors`):
//! input `x[t, b] = (ln(s + 1e-6) + ln 1e6) / ln 1e6` for the H most recent rows (oldest first; missing rows
//! and blocks are 0) as a one-channel H × N image; conv 3×3, 1→8 channels, zero padding 1, ReLU; conv 3×3,
//! 8→8, padding 1, ReLU; conv 1×1, 8→1; then a learned temporal mix `score[b] = Σ_t u[t]·y[t, b] + c`.
//!
//! Selection: the first `sink` and last `local` tokens, then the `(budget - sink - local) / block` best
//! blocks (by predicted score) that are not already entirely selected. Every `calib` steps a full step
//! attends everything and appends the true row; other steps append the row of the attended tokens' weights
//! (normalised over them; 0 for blocks not attended).

use std::collections::VecDeque;

use once_cell::sync::Lazy;

use crate::error::{Error, ErrorKind, Result};

/// The history of one (sequence, layer, KV head).
#[derive(Clone, Debug, Default)]
pub struct PredictorHead {
    /// Rows of block scores, oldest first (at most H); row `i` has as many blocks as the sequence had then.
    pub rows: VecDeque<Vec<f32>>,
    /// Steps since the last full (calibration) step.
    pub since_calib: usize,
    /// Convolution rows (before the temporal mix) of the last prediction, `history × conv_nb`, and the
    /// rows pushed since (see [`PredictorWeights::predict_cached`]).
    pub conv: Vec<f32>,
    pub conv_nb: usize,
    pub pushed: usize,
}

impl PredictorHead {
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.rows.iter().map(|r| r.capacity() * 4 + std::mem::size_of::<Vec<f32>>()).sum::<usize>() + self.conv.capacity() * 4
    }

    /// Appends a row, keeping at most `h`.
    pub fn push(&mut self, row: Vec<f32>, h: usize) {
        self.rows.push_back(row);
        self.pushed += 1;
        while self.rows.len() > h {
            self.rows.pop_front();
        }
    }
}

/// The CNN's weights.
#[derive(Clone, Debug)]
pub struct PredictorWeights {
    pub channels: usize,
    pub history: usize,
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
    w3: Vec<f32>,
    b3: f32,
    temporal: Vec<f32>,
    tb: f32,
}

const EPS: f32 = 1e-6;

static BUILTIN: Lazy<std::result::Result<PredictorWeights, String>> =
    Lazy::new(|| PredictorWeights::from_safetensors(include_bytes!("predictor_weights.safetensors")).map_err(|e| e.message));

impl PredictorWeights {
    /// The weights shipped with the library (`src/policy/predictor_weights.safetensors`).
    pub fn builtin() -> Result<&'static PredictorWeights> {
        BUILTIN.as_ref().map_err(|m| Error::new(ErrorKind::Internal, format!("built-in predictor weights: {m}")))
    }

    pub fn from_safetensors(bytes: &[u8]) -> Result<Self> {
        let bad = |m: String| Error::new(ErrorKind::InvalidArgument, format!("predictor weights: {m}"));
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let t = st.tensor(name).map_err(|e| bad(format!("{name}: {e}")))?;
            if t.dtype() != safetensors::Dtype::F32 || t.shape() != shape {
                return Err(bad(format!("{name} is {:?} {:?}, expected F32 {shape:?}", t.dtype(), t.shape())));
            }
            Ok(t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        };
        let c = st.tensor("conv1.bias").map_err(|e| bad(format!("conv1.bias: {e}")))?.shape()[0];
        let h = st.tensor("temporal.weight").map_err(|e| bad(format!("temporal.weight: {e}")))?.shape()[0];
        Ok(PredictorWeights {
            channels: c,
            history: h,
            w1: get("conv1.weight", &[c, 1, 3, 3])?,
            b1: get("conv1.bias", &[c])?,
            w2: get("conv2.weight", &[c, c, 3, 3])?,
            b2: get("conv2.bias", &[c])?,
            w3: get("conv3.weight", &[1, c, 1, 1])?,
            b3: get("conv3.bias", &[1])?[0],
            temporal: get("temporal.weight", &[h])?,
            tb: get("temporal.bias", &[1])?[0],
        })
    }

    /// Predicted scores of `nb` blocks from `rows` (oldest first, at most `history`, raw block scores),
    /// computing every row of the convolution.
    pub fn predict(&self, rows: &VecDeque<Vec<f32>>, nb: usize) -> Vec<f32> {
        let x = self.image(rows, nb);
        let mut y3 = vec![0f32; self.history * nb];
        let all: Vec<usize> = (0..self.history).collect();
        self.conv_rows(&x, nb, &all, &mut y3);
        self.mix(&y3, nb)
    }

    /// Like [`Self::predict`] for the history of `ph`, reusing the convolution rows cached at its last
    /// prediction: the image only shifts up by one row per pushed row, and an output row whose 5-row
    /// receptive field lies inside both images (and away from the top padding) is unchanged. The result is
    /// bit for bit that of [`Self::predict`] (tested).
    pub fn predict_cached(&self, ph: &mut PredictorHead, nb: usize) -> Vec<f32> {
        let h = self.history;
        let x = self.image(&ph.rows, nb);
        let s = ph.pushed;
        let reuse = ph.conv_nb == nb && ph.conv.len() == h * nb && s + 4 < h;
        let mut y3 = vec![0f32; h * nb];
        let mut todo = Vec::new();
        for t in 0..h {
            if reuse && t >= 2 && t + s + 2 < h {
                y3[t * nb..(t + 1) * nb].copy_from_slice(&ph.conv[(t + s) * nb..(t + s + 1) * nb]);
            } else {
                todo.push(t);
            }
        }
        self.conv_rows(&x, nb, &todo, &mut y3);
        let out = self.mix(&y3, nb);
        ph.conv = y3;
        ph.conv_nb = nb;
        ph.pushed = 0;
        out
    }

    /// Input image, most recent row at `history - 1`.
    fn image(&self, rows: &VecDeque<Vec<f32>>, n: usize) -> Vec<f32> {
        let h = self.history;
        let mut x = vec![0f32; h * n];
        let used = rows.len().min(h);
        for (k, row) in rows.iter().skip(rows.len() - used).enumerate() {
            let t = h - used + k;
            for (b, &s) in row.iter().take(n).enumerate() {
                x[t * n + b] = ((s.max(0.0) + EPS).ln() - EPS.ln()) / -EPS.ln();
            }
        }
        x
    }

    fn mix(&self, y3: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![self.tb; n];
        for t in 0..self.history {
            let u = self.temporal[t];
            for (o, &v) in out.iter_mut().zip(&y3[t * n..(t + 1) * n]) {
                *o += u * v;
            }
        }
        out
    }

    /// Output rows `todo` (of the 1×1 convolution, before the temporal mix) into `y3`.
    fn conv_rows(&self, x: &[f32], n: usize, todo: &[usize], y3: &mut [f32]) {
        let (h, c) = (self.history, self.channels);
        if todo.is_empty() {
            return;
        }
        let at = |img: &[f32], t: isize, b: isize| -> f32 {
            if t < 0 || b < 0 || t >= h as isize || b >= n as isize {
                0.0
            } else {
                img[t as usize * n + b as usize]
            }
        };
        // conv1 rows needed: t-1 ..= t+1 of every output row.
        let mut need = vec![false; h];
        for &t in todo {
            for r in t.saturating_sub(1)..=(t + 1).min(h - 1) {
                need[r] = true;
            }
        }
        let mut y1 = vec![0f32; c * h * n];
        for ch in 0..c {
            let w = &self.w1[ch * 9..ch * 9 + 9];
            for t in (0..h).filter(|&t| need[t]) {
                for b in 0..n {
                    let mut acc = self.b1[ch];
                    for dt in 0..3 {
                        for db in 0..3 {
                            acc += w[dt * 3 + db] * at(x, t as isize + dt as isize - 1, b as isize + db as isize - 1);
                        }
                    }
                    y1[(ch * h + t) * n + b] = acc.max(0.0);
                }
            }
        }
        let mut y2 = vec![0f32; n];
        for &t in todo {
            let dst = &mut y3[t * n..(t + 1) * n];
            dst.fill(self.b3);
            for co in 0..c {
                y2.fill(self.b2[co]);
                for ci in 0..c {
                    let w = &self.w2[(co * c + ci) * 9..(co * c + ci) * 9 + 9];
                    let src = &y1[ci * h * n..(ci + 1) * h * n];
                    for dt in 0..3 {
                        let ts = t as isize + dt as isize - 1;
                        if ts < 0 || ts >= h as isize {
                            continue;
                        }
                        let srow = &src[ts as usize * n..(ts as usize + 1) * n];
                        for db in 0..3 {
                            let wv = w[dt * 3 + db];
                            // out[b] += wv * in[b + db - 1]
                            let (d0, s0, len) = match db {
                                0 => (1, 0, n.saturating_sub(1)),
                                1 => (0, 0, n),
                                _ => (0, 1, n.saturating_sub(1)),
                            };
                            for (o, &i) in y2[d0..d0 + len].iter_mut().zip(&srow[s0..s0 + len]) {
                                *o += wv * i;
                            }
                        }
                    }
                }
                let w3 = self.w3[co];
                for (o, &v) in dst.iter_mut().zip(&y2) {
                    *o += w3 * v.max(0.0);
                }
            }
        }
    }
}

/// The selection for a row seeing positions `0 .. n`: sorted disjoint spans (sink, local, best blocks).
pub fn select(scores: &[f32], n: usize, budget: usize, block: usize, sink: usize, local: usize) -> Vec<(usize, usize)> {
    let sink_end = sink.min(n);
    let local_start = n.saturating_sub(local);
    let covered = |b: usize| {
        let (a, e) = (b * block, ((b + 1) * block).min(n));
        e <= sink_end || a >= local_start
    };
    let nb = n.div_ceil(block);
    let extra = budget.saturating_sub(sink + local) / block;
    let mut cand: Vec<usize> = (0..nb).filter(|&b| !covered(b)).collect();
    cand.sort_by(|&a, &b| scores.get(b).copied().unwrap_or(f32::NEG_INFINITY).total_cmp(&scores.get(a).copied().unwrap_or(f32::NEG_INFINITY)).then(b.cmp(&a)));
    cand.truncate(extra);
    let mut spans = vec![(0, sink_end), (local_start, n)];
    spans.extend(cand.into_iter().map(|b| (b * block, ((b + 1) * block).min(n))));
    super::select::normalize_spans(&mut spans);
    spans
}

/// Block-max pooling of per-position scores `w` (positions `0 .. w.len()`).
pub fn block_max(w: &[f32], block: usize) -> Vec<f32> {
    w.chunks(block).map(|c| c.iter().copied().fold(0f32, f32::max)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_weights_load_and_predict_finite_scores() {
        let w = PredictorWeights::builtin().unwrap();
        assert_eq!((w.channels, w.history), (8, 64));
        let mut rows = VecDeque::new();
        for t in 0..70 {
            let mut r = vec![1e-4f32; 10 + t / 16];
            r[3] = 0.5;
            rows.push_back(r);
            while rows.len() > 64 {
                rows.pop_front();
            }
        }
        let s = w.predict(&rows, 15);
        assert_eq!(s.len(), 15);
        assert!(s.iter().all(|x| x.is_finite()));
        // A block that held attention at every step is predicted above one that never did.
        assert!(s[3] > s[5], "{s:?}");
    }

    /// The Rust CNN reproduces PyTorch's output on the check vector the training script stores with the
    /// weights.
    #[test]
    fn matches_the_pytorch_model() {
        let bytes = include_bytes!("predictor_weights.safetensors");
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        let f = |name: &str| -> (Vec<f32>, Vec<usize>) {
            let t = st.tensor(name).unwrap();
            (t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(), t.shape().to_vec())
        };
        let (rows, shape) = f("check.rows");
        let (lens, _) = f("check.row_len");
        let (want, _) = f("check.out");
        let (nr, width) = (shape[0], shape[1]);
        let hist: VecDeque<Vec<f32>> = (0..nr).map(|j| rows[j * width..j * width + lens[j] as usize].to_vec()).collect();
        let w = PredictorWeights::builtin().unwrap();
        let got = w.predict(&hist, want.len());
        let scale = want.iter().map(|x| x.abs()).fold(0f32, f32::max).max(1.0);
        for (b, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!((g - e).abs() <= 1e-4 * scale, "block {b}: rust {g} vs pytorch {e}");
        }
    }

    /// The cached prediction equals the full one through a decode-like sequence of pushes (one or two per
    /// prediction), a growing number of blocks, and a history that fills up.
    #[test]
    fn cached_prediction_is_exact() {
        let w = PredictorWeights::builtin().unwrap();
        let mut rng = crate::rng::Rng::new(3);
        let mut ph = PredictorHead::default();
        let mut nb = 20;
        for step in 0..150 {
            let row: Vec<f32> = (0..nb).map(|_| (rng.uniform() as f32).powi(6)).collect();
            ph.push(row, 64);
            if step % 7 == 3 {
                continue; // a full step: pushed without predicting
            }
            if step % 23 == 0 {
                nb += 1;
            }
            let full = w.predict(&ph.rows, nb);
            let cached = w.predict_cached(&mut ph, nb);
            assert_eq!(full, cached, "step {step}");
        }
    }

    #[test]
    fn selection_covers_sink_local_and_best_blocks() {
        let scores: Vec<f32> = (0..20).map(|b| if b == 7 { 5.0 } else if b == 12 { 4.0 } else { 0.0 }).collect();
        let s = select(&scores, 320, 64 + 64 + 32, 16, 64, 64);
        assert_eq!(s, vec![(0, 64), (112, 128), (192, 208), (256, 320)]);
        // Budget below sink + local: only those.
        assert_eq!(select(&scores, 320, 100, 16, 64, 64), vec![(0, 64), (256, 320)]);
        assert_eq!(block_max(&[0.1, 0.3, 0.2], 2), vec![0.3, 0.2]);
    }
}
