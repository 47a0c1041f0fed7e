//! AttentionPredictor: per (sequence, layer, KV head) a history of the last H block-pooled attention rows
//! (softmax weights, max over the block's tokens and the GQA group's query heads); a small CNN predicts the
//! next row's block scores from it. Pure decisions and the CNN; the kernels live in `cpu::sparse`.
//!
//! Model (the paper's, §4.2 and appendix C; trained by `scripts/train_predictor.py`, default weights
//! embedded from `weights.safetensors`): the input is the H most recent rows (oldest first,
//! missing rows and blocks 0) of raw block scores, cropped to the blocks between the sink and the local
//! window (which the selection keeps anyway), as a one-channel H × W image; conv 3×3, 1→16 channels, zero
//! padding 1, ReLU; conv 3×3, 16→32, padding 1, ReLU; average over the H rows; conv 1×1, 32→1. The 1×1
//! convolution is linear, so it is applied per row before the average (`z[t, b]`), which lets a decode step
//! reuse the rows whose receptive field did not change (see [`PredictorWeights::predict_cached`]).
//!
//! Selection: the first `sink` and last `local` tokens, then the `(budget - sink - local) / block` best
//! blocks (by predicted score) that are not already entirely selected. Every `calib`-th step is a
//! calibration step: the output is still the sparse selection's, but the row appended to the history is
//! the full attention row (a scoring pass over every key); other steps append the row of the attended
//! tokens' weights (normalised over them; 0 for blocks not attended).

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args};

use std::collections::VecDeque;
use std::sync::Arc;

use once_cell::sync::Lazy;

use crate::error::{Error, ErrorKind, Result};

/// `predictor(budget, block, history, calib, sink, local)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictorSpec {
    pub budget: usize,
    pub block: usize,
    pub history: usize,
    pub calib: usize,
    pub sink: usize,
    pub local: usize,
}

/// The history of one (sequence, layer, KV head).
#[derive(Clone, Debug, Default)]
pub struct PredictorHead {
    /// Rows of block scores, oldest first (at most H); row `i` has as many blocks as the sequence had then.
    pub rows: VecDeque<Vec<f32>>,
    /// Steps since the last calibration step.
    pub since_calib: usize,
    /// Per-row outputs `z` (1×1 convolution before the time average) of the last prediction,
    /// `history × width` for the crop starting at block `conv_start`, and the rows pushed since.
    pub conv: Vec<f32>,
    pub conv_start: usize,
    pub conv_width: usize,
    pub pushed: usize,
}

impl super::PolicyState for PredictorHead {
    fn bytes(&self) -> usize {
        PredictorHead::bytes(self)
    }
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
    /// Channels of the first and second convolution (16 and 32 in the paper).
    pub c1: usize,
    pub c2: usize,
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
    w3: Vec<f32>,
    b3: f32,
}

/// Largest weights file accepted (the paper's network is 19 KB in f32).
pub const MAX_WEIGHTS_BYTES: u64 = 1 << 20;
/// Largest channel count accepted in a weights file.
pub const MAX_CHANNELS: usize = 128;

static BUILTIN: Lazy<std::result::Result<PredictorWeights, String>> =
    Lazy::new(|| PredictorWeights::from_safetensors(include_bytes!("weights.safetensors")).map_err(|e| e.message));

impl PredictorWeights {
    /// The weights a `predictor` spec names (`weights="..."`), else the built-in ones.
    pub(crate) fn for_spec(weights: Option<&str>) -> Result<Arc<PredictorWeights>> {
        Ok(Arc::new(match weights {
            Some(path) => PredictorWeights::from_file(path)?,
            None => PredictorWeights::builtin()?.clone(),
        }))
    }

    /// The weights shipped with the library (`src/policy/weights.safetensors`, trained on
    /// SmolLM2-135M traces).
    pub fn builtin() -> Result<&'static PredictorWeights> {
        BUILTIN.as_ref().map_err(|m| Error::new(ErrorKind::Internal, format!("built-in predictor weights: {m}")))
    }

    /// Reads a weights file (safetensors, the tensors of `scripts/train_predictor.py`), at most
    /// [`MAX_WEIGHTS_BYTES`].
    pub fn from_file(path: &str) -> Result<Self> {
        let bad = |m: String| Error::new(ErrorKind::InvalidArgument, format!("predictor weights {path:?}: {m}"));
        let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        if meta.len() > MAX_WEIGHTS_BYTES {
            return Err(bad(format!("{} bytes, over the limit of {MAX_WEIGHTS_BYTES}", meta.len())));
        }
        let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        Self::from_safetensors(&bytes).map_err(|e| bad(e.message))
    }

    /// Parses and checks the tensors: `conv1.weight [c1,1,3,3]`, `conv1.bias [c1]`, `conv2.weight
    /// [c2,c1,3,3]`, `conv2.bias [c2]`, `conv3.weight [1,c2,1]`, `conv3.bias [1]`, all F32 and finite,
    /// `1 <= c1, c2 <=` [`MAX_CHANNELS`]. Other tensors are ignored.
    pub fn from_safetensors(bytes: &[u8]) -> Result<Self> {
        let bad = |m: String| Error::new(ErrorKind::InvalidArgument, format!("predictor weights: {m}"));
        if bytes.len() as u64 > MAX_WEIGHTS_BYTES {
            return Err(bad(format!("{} bytes, over the limit of {MAX_WEIGHTS_BYTES}", bytes.len())));
        }
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let shape = |name: &str| -> Result<Vec<usize>> { Ok(st.tensor(name).map_err(|e| bad(format!("{name}: {e}")))?.shape().to_vec()) };
        let get = |name: &str, want: &[usize]| -> Result<Vec<f32>> {
            let t = st.tensor(name).map_err(|e| bad(format!("{name}: {e}")))?;
            if t.dtype() != safetensors::Dtype::F32 || t.shape() != want {
                return Err(bad(format!("{name} is {:?} {:?}, expected F32 {want:?}", t.dtype(), t.shape())));
            }
            let v: Vec<f32> = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(bad(format!("{name}[{i}] is {} (weights must be finite)", v[i])));
            }
            Ok(v)
        };
        let s1 = shape("conv1.weight")?;
        let s2 = shape("conv2.weight")?;
        let (c1, c2) = match (s1.first(), s2.first()) {
            (Some(&a), Some(&b)) if (1..=MAX_CHANNELS).contains(&a) && (1..=MAX_CHANNELS).contains(&b) => (a, b),
            _ => return Err(bad(format!("conv1.weight {s1:?} / conv2.weight {s2:?}: expected [c1,1,3,3] and [c2,c1,3,3] with 1 <= c1, c2 <= {MAX_CHANNELS}"))),
        };
        Ok(PredictorWeights {
            c1,
            c2,
            w1: get("conv1.weight", &[c1, 1, 3, 3])?,
            b1: get("conv1.bias", &[c1])?,
            w2: get("conv2.weight", &[c2, c1, 3, 3])?,
            b2: get("conv2.bias", &[c2])?,
            w3: get("conv3.weight", &[1, c2, 1])?,
            b3: get("conv3.bias", &[1])?[0],
        })
    }

    /// Every parameter in one array, the order the CUDA kernels read them (kernels/predictor.cu):
    /// `w1 [c1][3][3]`, `b1 [c1]`, `w2 [c2][c1][3][3]`, `b2 [c2]`, `w3 [c2]`, `b3`.
    pub fn flat(&self) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.parameters());
        for part in [&self.w1, &self.b1, &self.w2, &self.b2, &self.w3] {
            v.extend_from_slice(part);
        }
        v.push(self.b3);
        v
    }

    /// Number of parameters.
    pub fn parameters(&self) -> usize {
        self.w1.len() + self.b1.len() + self.w2.len() + self.b2.len() + self.w3.len() + 1
    }

    /// Predicted scores of the crop `start .. start + width` of the blocks, from the `h` most recent
    /// `rows` (oldest first, raw block scores), computing every row of the convolution.
    pub fn predict(&self, rows: &VecDeque<Vec<f32>>, h: usize, start: usize, width: usize) -> Vec<f32> {
        let x = image(rows, h, start, width);
        let mut z = vec![0f32; h * width];
        let all: Vec<usize> = (0..h).collect();
        self.conv_rows(&x, h, width, &all, &mut z);
        self.average(&z, h, width)
    }

    /// Like [`Self::predict`] for the history of `ph`, reusing the per-row outputs cached at its last
    /// prediction: the image only shifts up by one row per pushed row, and an output row whose 5-row
    /// receptive field lies inside both images (and away from the top padding) is unchanged. The result is
    /// bit for bit that of [`Self::predict`] (tested).
    pub fn predict_cached(&self, ph: &mut PredictorHead, h: usize, start: usize, width: usize) -> Vec<f32> {
        let x = image(&ph.rows, h, start, width);
        let s = ph.pushed;
        let reuse = ph.conv_start == start && ph.conv_width == width && ph.conv.len() == h * width && s + 4 < h;
        let mut z = vec![0f32; h * width];
        let mut todo = Vec::new();
        for t in 0..h {
            if reuse && t >= 2 && t + s + 2 < h {
                z[t * width..(t + 1) * width].copy_from_slice(&ph.conv[(t + s) * width..(t + s + 1) * width]);
            } else {
                todo.push(t);
            }
        }
        self.conv_rows(&x, h, width, &todo, &mut z);
        let out = self.average(&z, h, width);
        ph.conv = z;
        ph.conv_start = start;
        ph.conv_width = width;
        ph.pushed = 0;
        out
    }

    /// `b3 + mean_t z[t, b]`, summed in row order.
    fn average(&self, z: &[f32], h: usize, n: usize) -> Vec<f32> {
        let mut acc = vec![0f32; n];
        for t in 0..h {
            for (o, &v) in acc.iter_mut().zip(&z[t * n..(t + 1) * n]) {
                *o += v;
            }
        }
        let inv = 1.0 / h as f32;
        acc.iter().map(|&a| self.b3 + a * inv).collect()
    }

    /// Output rows `todo` of `z = conv3(relu(conv2(relu(conv1(x)))))` (per row, before the time average).
    ///
    /// The f32 arithmetic has one fixed order (the CUDA engine's CNN runs within the bound of
    /// docs/policies.md: fused multiply-adds in the first convolution, tensor cores in the second,
    /// kernels/policy/predictor.cu): `y1[c][t][b] = b1[c]`, then `+= w1[c][dt][db] ·
    /// x[t+dt-1][b+db-1]` for dt, then db, in 0..3 (terms outside the image skipped), ReLU; `y2 = b2[o]`,
    /// then `+= w2[o][c][dt][db] · y1[c][t+dt-1][b+db-1]` for c, then dt, then db (skipped outside), ReLU;
    /// `z[t][b] = 0`, then `+= w3[o] · y2` for o in order; every product rounded before it is added.
    fn conv_rows(&self, x: &[f32], h: usize, n: usize, todo: &[usize], z: &mut [f32]) {
        let (c1, c2) = (self.c1, self.c2);
        if todo.is_empty() || n == 0 {
            return;
        }
        // conv1 rows needed: t-1 ..= t+1 of every output row.
        let mut need = vec![false; h];
        for &t in todo {
            for r in t.saturating_sub(1)..=(t + 1).min(h - 1) {
                need[r] = true;
            }
        }
        let mut y1 = vec![0f32; c1 * h * n];
        let mut row = vec![0f32; n];
        for ch in 0..c1 {
            let w = &self.w1[ch * 9..ch * 9 + 9];
            for t in (0..h).filter(|&t| need[t]) {
                row.fill(self.b1[ch]);
                for dt in 0..3 {
                    let ts = t as isize + dt as isize - 1;
                    if ts < 0 || ts >= h as isize {
                        continue;
                    }
                    shifted_axpy(&mut row, &x[ts as usize * n..(ts as usize + 1) * n], &w[dt * 3..dt * 3 + 3]);
                }
                for (o, &v) in y1[(ch * h + t) * n..(ch * h + t + 1) * n].iter_mut().zip(&row) {
                    *o = relu(v);
                }
            }
        }
        let mut y2 = vec![0f32; n];
        for &t in todo {
            let dst = &mut z[t * n..(t + 1) * n];
            dst.fill(0.0);
            for co in 0..c2 {
                y2.fill(self.b2[co]);
                for ci in 0..c1 {
                    let w = &self.w2[(co * c1 + ci) * 9..(co * c1 + ci) * 9 + 9];
                    let src = &y1[ci * h * n..(ci + 1) * h * n];
                    for dt in 0..3 {
                        let ts = t as isize + dt as isize - 1;
                        if ts < 0 || ts >= h as isize {
                            continue;
                        }
                        shifted_axpy(&mut y2, &src[ts as usize * n..(ts as usize + 1) * n], &w[dt * 3..dt * 3 + 3]);
                    }
                }
                let w3 = self.w3[co];
                for (o, &v) in dst.iter_mut().zip(&y2) {
                    *o += w3 * relu(v);
                }
            }
        }
    }
}

/// ReLU as the decisions define it (`v > 0 ? v : 0`): +0 for -0 and NaN, so that the device's
/// (kernels/predictor.cu) and the CPU's zeros have the same sign (the top-k orders by f32 total order).
#[inline]
fn relu(v: f32) -> f32 {
    if v > 0.0 {
        v
    } else {
        0.0
    }
}

/// `out[b] += w[0]·src[b-1] + w[1]·src[b] + w[2]·src[b+1]` (zero padding at both ends).
fn shifted_axpy(out: &mut [f32], src: &[f32], w: &[f32]) {
    let n = out.len();
    for (db, &wv) in w.iter().enumerate() {
        let (d0, s0, len) = match db {
            0 => (1, 0, n.saturating_sub(1)),
            1 => (0, 0, n),
            _ => (0, 1, n.saturating_sub(1)),
        };
        for (o, &i) in out[d0..d0 + len].iter_mut().zip(&src[s0..s0 + len]) {
            *o += wv * i;
        }
    }
}

/// Input image: the `h` most recent rows cropped to blocks `start .. start + width`, most recent row at
/// `h - 1`, raw scores (negative or NaN read as 0: a history row is a softmax weight).
fn image(rows: &VecDeque<Vec<f32>>, h: usize, start: usize, width: usize) -> Vec<f32> {
    let mut x = vec![0f32; h * width];
    let used = rows.len().min(h);
    for (k, row) in rows.iter().skip(rows.len() - used).enumerate() {
        let t = h - used + k;
        for (b, &s) in row.iter().skip(start).take(width).enumerate() {
            x[t * width + b] = if s > 0.0 { s } else { 0.0 };
        }
    }
    x
}

/// The crop the model predicts for a row of `nb` blocks: `(start, width)`, without the blocks of the
/// first `sink` and the last `local` tokens (always selected; the authors' code crops them the same way).
pub fn crop(nb: usize, block: usize, sink: usize, local: usize) -> (usize, usize) {
    let start = sink / block;
    let end = nb.saturating_sub(local / block).max(start);
    (start.min(nb), end - start.min(end))
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

/// `predictor(budget, block, history, calib, sink, local, weights)`'s arguments (src/policy/registry.rs
/// names the stage).
/// The weights file it names comes back beside the parameters (the spec keeps it: `Spec::predictor_weights`).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<(PredictorSpec, Option<String>)> {
    let mut a = Args::new(src, "predictor", raw, &["budget", "block", "history", "calib", "sink", "local", "weights"])?;
    let budget = a.int("budget", None, 1, "", |_| true)?;
    let block = a.int("block", Some(16), 1, ", a power of two", |v| v.is_power_of_two())?;
    let history = a.int("history", Some(64), 2, "", |v| v <= 4096)?;
    let calib = a.int("calib", Some(5), 1, "", |_| true)?;
    let sink = a.int("sink", Some(64), 0, "", |_| true)?;
    let local = a.int("local", Some(64), 1, "", |_| true)?;
    let weights = a.string("weights", "a non-empty \"path\" of a safetensors file")?;
    Ok((PredictorSpec { budget, block, history, calib, sink, local }, weights))
}

impl super::kind::SelectorKind for PredictorSpec {
    /// Over FP8 its history rows read the keys decoded times k_scale, in the CPU's arithmetic.
    fn cuda_fp8_cache(&self) -> bool {
        true
    }

    fn stateful(&self) -> bool {
        true
    }

    fn per_sequence_device_state(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_weights_are_the_papers_network() {
        let w = PredictorWeights::builtin().unwrap();
        assert_eq!((w.c1, w.c2), (16, 32));
        assert_eq!(w.parameters(), 4833, "Conv2d 1->16 3x3, Conv2d 16->32 3x3, Conv1d 32->1: about 4.9K parameters");
        let mut rows = VecDeque::new();
        for t in 0..70 {
            let mut r = vec![1e-4f32; 14 + t / 16];
            r[7] = 0.5;
            rows.push_back(r);
            while rows.len() > 64 {
                rows.pop_front();
            }
        }
        let (start, width) = crop(18, 16, 64, 64);
        assert_eq!((start, width), (4, 10));
        let s = w.predict(&rows, 64, start, width);
        assert_eq!(s.len(), 10);
        assert!(s.iter().all(|x| x.is_finite()));
        // A block that held attention at every step is predicted above one that never did.
        assert!(s[7 - 4] > s[9 - 4], "{s:?}");
    }

    /// The Rust CNN reproduces PyTorch's output on the check vector the training script stores with the
    /// weights.
    #[test]
    fn matches_the_pytorch_model() {
        let bytes = include_bytes!("weights.safetensors");
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        let f = |name: &str| -> (Vec<f32>, Vec<usize>) {
            let t = st.tensor(name).unwrap();
            (t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(), t.shape().to_vec())
        };
        let (rows, shape) = f("check.rows");
        let (lens, _) = f("check.row_len");
        let (nb, _) = f("check.nb");
        let (want, _) = f("check.out");
        let (nr, width) = (shape[0], shape[1]);
        let hist: VecDeque<Vec<f32>> = (0..nr).map(|j| rows[j * width..j * width + lens[j] as usize].to_vec()).collect();
        let w = PredictorWeights::builtin().unwrap();
        let (start, cw) = crop(nb[0] as usize, 16, 64, 64);
        let got = w.predict(&hist, 64, start, cw);
        assert_eq!(got.len(), want.len());
        let scale = want.iter().map(|x| x.abs()).fold(0f32, f32::max).max(1e-3);
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
                continue; // pushed without predicting
            }
            if step % 23 == 0 {
                nb += 1;
            }
            let (start, width) = crop(nb, 16, 64, 64);
            let full = w.predict(&ph.rows, 64, start, width);
            let cached = w.predict_cached(&mut ph, 64, start, width);
            assert_eq!(full, cached, "step {step}");
        }
    }

    /// Weights files are checked: shapes, dtype, finiteness, size; errors say what is wrong.
    #[test]
    fn weights_files_are_validated() {
        use safetensors::tensor::TensorView;
        let bytes = include_bytes!("weights.safetensors");
        assert!(PredictorWeights::from_safetensors(bytes).is_ok());
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        // Rewrites the built-in file: `edit(name, data)` returns the tensor's new (shape or None = same,
        // data), or None to leave it out.
        type Edit<'a> = &'a dyn Fn(&str, Vec<u8>) -> Option<(Option<Vec<usize>>, Vec<u8>)>;
        let write = |edit: Edit| -> Vec<u8> {
            let owned: Vec<(String, Vec<usize>, Vec<u8>)> = st
                .tensors()
                .into_iter()
                .filter_map(|(name, t)| edit(&name, t.data().to_vec()).map(|(shape, d)| (name.clone(), shape.unwrap_or_else(|| t.shape().to_vec()), d)))
                .collect();
            let views: Vec<(String, TensorView)> = owned.iter().map(|(n, s, d)| (n.clone(), TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap())).collect();
            safetensors::serialize(views, None).unwrap()
        };
        let msg = |b: &[u8]| PredictorWeights::from_safetensors(b).unwrap_err().message;
        // A missing tensor.
        let m = msg(&write(&|n, d| (n != "conv2.bias").then_some((None, d))));
        assert!(m.contains("conv2.bias"), "{m}");
        // A non-finite weight.
        let m = msg(&write(&|n, mut d| {
            if n == "conv1.weight" {
                d[0..4].copy_from_slice(&f32::NAN.to_le_bytes());
            }
            Some((None, d))
        }));
        assert!(m.contains("finite"), "{m}");
        // A wrong shape.
        let m = msg(&write(&|n, d| Some(if n == "conv3.weight" { (Some(vec![2, 16, 1]), d) } else { (None, d) })));
        assert!(m.contains("conv3.weight"), "{m}");
        // Not safetensors at all, and too large.
        assert!(msg(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}").contains("safetensors"));
        assert!(msg(&vec![0u8; MAX_WEIGHTS_BYTES as usize + 1]).contains("limit"));
        let e = PredictorWeights::from_file("/nonexistent/w.safetensors").unwrap_err();
        assert!(e.message.contains("/nonexistent/w.safetensors"), "{}", e.message);
    }

    #[test]
    fn selection_covers_sink_local_and_best_blocks() {
        let scores: Vec<f32> = (0..20).map(|b| if b == 7 { 5.0 } else if b == 12 { 4.0 } else { 0.0 }).collect();
        let s = select(&scores, 320, 64 + 64 + 32, 16, 64, 64);
        assert_eq!(s, vec![(0, 64), (112, 128), (192, 208), (256, 320)]);
        // Budget below sink + local: only those.
        assert_eq!(select(&scores, 320, 100, 16, 64, 64), vec![(0, 64), (256, 320)]);
        assert_eq!(block_max(&[0.1, 0.3, 0.2], 2), vec![0.3, 0.2]);
        assert_eq!(crop(3, 16, 64, 64), (3, 0));
    }
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::registry::{parse, refusal as msg};
    use crate::policy::*;

    #[test]
    fn predictor_spec() {
        let p = parse("predictor(budget=1024)").unwrap().pipeline.unwrap();
        assert_eq!(p.selector, Selector::Predictor(PredictorSpec { budget: 1024, block: 16, history: 64, calib: 5, sink: 64, local: 64 }));
        assert!(msg("predictor()").contains("needs `budget="));
        assert!(msg("predictor(budget=64, block=12)").contains("power of two"));
        assert!(msg("predictor(budget=64, history=1)").contains("predictor.history"));
        assert!(msg("predictor(budget=64, weights=model)").contains("predictor.weights"));
        assert!(msg("predictor(budget=64, weights=\"\")").contains("predictor.weights"));
        assert!(msg("predictor(budget=64, weights=\"a.safetensors)").contains("closing"));
        assert!(msg(&format!("predictor(budget=64, weights=\"{}\")", "x".repeat(crate::policy::spec::MAX_STRING + 1))).contains("at most"));
        let s = parse("predictor(budget=64, weights=\"/tmp/my model.safetensors\")").unwrap();
        assert_eq!(s.predictor_weights.as_deref(), Some("/tmp/my model.safetensors"));
        assert_eq!(parse("predictor(budget=64)").unwrap().predictor_weights, None);
    }
}
