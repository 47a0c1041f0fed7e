//! Synthetic decode batches whose attention looks like a real LLM's, for benchmarks and policy tests.
//! Produces host tensors only (any backend copies them where it needs them).
//!
//! Per (sequence, KV head) a "topic" direction `u` (unit vector) is drawn; the decode query of every query
//! head of the group is `√d·(u + w_h)` with a small per-head perturbation `w_h` (norm ≈ 0.5), so with the
//! usual scale `1/√d` a key `a·u + b` gets the logit `≈ a + (u + w_h)·b`. Keys are:
//!
//! * **background**: a shared mean vector (a constant logit shift, as real keys have) plus noise that
//!   drifts slowly along positions (AR(1), ρ = 0.9: neighbouring keys resemble each other, as in real
//!   caches, which is what page-level bounds like Quest's exploit); logits ≈ N(−ln(context/8192), 1), so
//!   the background keeps about a quarter of the mass at every context length;
//! * **sinks**: the first `sinks` tokens with `a = 8.5` (together ≈ 40% of the mass at 8K context);
//! * **recent**: `a = 6.5 − i/16` for the token `i` places before the query (≈ 20% at 8K);
//! * **needles**: `needles` random positions with `a ≈ 7` (≈ 15% at 8K together).
//!
//! Values are N(0, 1) per channel, except sinks (0.2× as large, as sink values are small in real models)
//! and needles (3× as large and distinct from each other), so missing a needle moves the output.
//!
//! The cache is written through `Engine::cache_write` (so policy metadata is maintained) from staging rows
//! in position order: row `s·context + j` of `new_k`/`new_v` is position `j` of sequence `s`. Tests may
//! overwrite staging rows or queries before [`Synth::write_cache`] to build special inputs.

use crate::hostbuf::HostBuf;
use kvsparse::engine::{CacheWriteArgs, Engine, ForwardArgs};
use kvsparse::rng::Rng;
use kvsparse::tensor::{DType, TensorRef};

/// Shape of a synthetic batch.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub num_seqs: usize,
    /// Tokens per sequence, including the decode token.
    pub context: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: DType,
    pub sinks: usize,
    pub needles: usize,
    /// Prompt queries before the decode token generated for SnapKV's observation window.
    pub window: usize,
}

impl SynthSpec {
    /// A Llama-3-8B-like geometry (32 query heads, 8 KV heads, head size 128, fp16, blocks of 16).
    pub fn llama_like(num_seqs: usize, context: usize) -> Self {
        SynthSpec { num_seqs, context, num_q_heads: 32, num_kv_heads: 8, head_dim: 128, block_size: 16, dtype: DType::F16, sinks: 4, needles: 8, window: 32 }
    }
}

/// The generated batch: empty paged caches, staging rows, slots, block table, queries.
pub struct Synth {
    pub spec: SynthSpec,
    pub num_blocks: usize,
    pub max_blocks: usize,
    pub k_cache: HostBuf,
    pub v_cache: HostBuf,
    pub new_k: HostBuf,
    pub new_v: HostBuf,
    pub slots: Vec<i64>,
    pub block_table: Vec<i32>,
    pub seq_ids: Vec<i64>,
    /// Decode queries `[num_seqs, num_q_heads, head_dim]` at position `context - 1`.
    pub query: HostBuf,
    /// Prompt queries `[num_seqs · window, num_q_heads, head_dim]` at positions `context-1-window ..`.
    pub obs_query: HostBuf,
    /// Needle positions per (sequence, KV head).
    pub needle_pos: Vec<Vec<usize>>,
    pub scale: f32,
}

const SINK_LOGIT: f64 = 8.5;
const RECENT_LOGIT: f64 = 6.5;
const RECENT_DECAY: f64 = 16.0;
const NEEDLE_LOGIT: f64 = 7.0;

impl Synth {
    pub fn generate(spec: &SynthSpec, seed: u64) -> Synth {
        let mut rng = Rng::new(seed);
        let (b, l, hq, hk, d, bs) = (spec.num_seqs, spec.context, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.block_size);
        let g = hq / hk;
        let per_seq = l.div_ceil(bs);
        let num_blocks = b * per_seq + 2;
        let mut ids: Vec<usize> = (0..num_blocks).collect();
        rng.shuffle(&mut ids);
        let max_blocks = per_seq;
        let block_table: Vec<i32> = (0..b * per_seq).map(|i| ids[i] as i32).collect();
        let mut slots = Vec::with_capacity(b * l);
        for s in 0..b {
            for j in 0..l {
                slots.push(block_table[s * per_seq + j / bs] as i64 * bs as i64 + (j % bs) as i64);
            }
        }
        let cache_len = num_blocks * bs * hk * d;
        let mut new_k = HostBuf::zeros(spec.dtype, b * l * hk * d);
        let mut new_v = HostBuf::zeros(spec.dtype, b * l * hk * d);
        let mut query = HostBuf::zeros(spec.dtype, b * hq * d);
        let w = spec.window.min(l.saturating_sub(1));
        let mut obs_query = HostBuf::zeros(spec.dtype, (b * w).max(1) * hq * d);
        let mut needle_pos = Vec::new();
        let sd = (d as f64).sqrt();
        let rho: f64 = 0.9;
        let innov = (1.0 - rho * rho).sqrt();
        let sigma = 0.9;
        let mut drift = vec![0f64; d];
        // Background logit shift: keeps the background's share of the mass near a quarter at any context.
        let background = -(l as f64 / 8192.0).ln();
        for s in 0..b {
            for h in 0..hk {
                let u = unit(&mut rng, d);
                let mean: Vec<f64> = (0..d).map(|_| rng.normal() * 0.2).collect();
                // Queries: decode row and the observation window, per query head of the group.
                for qh in h * g..(h + 1) * g {
                    let wh: Vec<f64> = (0..d).map(|_| rng.normal() * 0.5 / sd).collect();
                    for i in 0..d {
                        query.set((s * hq + qh) * d + i, sd * (u[i] + wh[i]));
                    }
                    for t in 0..w {
                        for i in 0..d {
                            obs_query.set(((s * w + t) * hq + qh) * d + i, sd * (u[i] + wh[i] + rng.normal() * 0.3 / sd));
                        }
                    }
                }
                let lo = spec.sinks.min(l);
                let hi = l.saturating_sub((4.0 * RECENT_DECAY) as usize).max(lo);
                let mut needles: Vec<usize> = (0..spec.needles).filter(|_| hi > lo).map(|_| lo + rng.below(hi - lo)).collect();
                needles.sort_unstable();
                needles.dedup();
                for x in drift.iter_mut() {
                    *x = rng.normal();
                }
                for j in 0..l {
                    for x in drift.iter_mut() {
                        *x = rho * *x + innov * rng.normal();
                    }
                    let (a, vscale) = if j < spec.sinks {
                        (SINK_LOGIT, 0.2)
                    } else if needles.binary_search(&j).is_ok() {
                        (NEEDLE_LOGIT + rng.normal() * 0.3, 3.0)
                    } else {
                        let back = (l - 1 - j) as f64;
                        (background.max(RECENT_LOGIT - back / RECENT_DECAY), 1.0)
                    };
                    let row = (s * l + j) * hk + h;
                    for i in 0..d {
                        new_k.set(row * d + i, a * u[i] + mean[i] + sigma * drift[i]);
                        new_v.set(row * d + i, vscale * rng.normal());
                    }
                }
                needle_pos.push(needles);
            }
        }
        Synth {
            spec: spec.clone(),
            num_blocks,
            max_blocks,
            k_cache: HostBuf::zeros(spec.dtype, cache_len),
            v_cache: HostBuf::zeros(spec.dtype, cache_len),
            new_k,
            new_v,
            slots,
            block_table,
            seq_ids: (0..b as i64).map(|s| 7000 + s).collect(),
            query,
            obs_query,
            needle_pos,
            scale: 1.0 / sd as f32,
        }
    }

    fn cache_shape(&self) -> [i64; 4] {
        let s = &self.spec;
        [self.num_blocks as i64, s.block_size as i64, s.num_kv_heads as i64, s.head_dim as i64]
    }

    pub fn k_view(&mut self) -> TensorRef {
        let sh = self.cache_shape();
        self.k_cache.view_contiguous(&sh)
    }

    pub fn v_view(&mut self) -> TensorRef {
        let sh = self.cache_shape();
        self.v_cache.view_contiguous(&sh)
    }

    /// Writes every position of every sequence into the cache through `engine` (layer `layer`).
    pub fn write_cache(&mut self, engine: &Engine, layer: usize) -> kvsparse::Result<()> {
        let (hk, d) = (self.spec.num_kv_heads as i64, self.spec.head_dim as i64);
        let n = self.slots.len() as i64;
        let (kc, vc) = (self.k_view(), self.v_view());
        let key = self.new_k.view_contiguous(&[n, hk, d]);
        let value = self.new_v.view_contiguous(&[n, hk, d]);
        engine.cache_write(&CacheWriteArgs { layer, key, value, key_cache: kc, value_cache: vc, slot_mapping: TensorRef::from_slice(&self.slots, &[n]), stream: std::ptr::null_mut() })
    }

    /// Host tensors of a call: block table, seq_lens, query_start_loc (owned, so views stay valid).
    pub fn tables(&self, seq_len: usize, q_len: usize) -> (Vec<i32>, Vec<i32>) {
        let b = self.spec.num_seqs;
        (vec![seq_len as i32; b], (0..=b as i32).map(|i| i * q_len as i32).collect())
    }

    /// Arguments of the decode call (every sequence at its full length); `out` is `[num_seqs, hq, d]`.
    pub fn decode_args(&mut self, layer: usize, tabs: &(Vec<i32>, Vec<i32>), out: &mut HostBuf) -> ForwardArgs {
        let s = self.spec.clone();
        let b = s.num_seqs as i64;
        let shape = [b, s.num_q_heads as i64, s.head_dim as i64];
        let (kc, vc) = (self.k_view(), self.v_view());
        ForwardArgs {
            layer,
            query: self.query.view_contiguous(&shape),
            key_cache: kc,
            value_cache: vc,
            block_table: TensorRef::from_slice(&self.block_table, &[b, self.max_blocks as i64]),
            seq_lens: TensorRef::from_slice(&tabs.0, &[b]),
            query_start_loc: TensorRef::from_slice(&tabs.1, &[b + 1]),
            seq_ids: Some(TensorRef::from_slice(&self.seq_ids, &[b])),
            out: out.view_contiguous(&shape),
            lse: None,
            scale: self.scale,
            sliding_window: 0,
            softcap: 0.0,
            max_query_len: 0,
            max_seq_len: 0,
            stream: std::ptr::null_mut(),
        }
    }

    /// Arguments of the last prompt chunk (the `window` tokens before the decode token, so `seq_len =
    /// context - 1`): what SnapKV observes. `out` is `[num_seqs · window, hq, d]`.
    pub fn observe_args(&mut self, layer: usize, tabs: &(Vec<i32>, Vec<i32>), out: &mut HostBuf) -> ForwardArgs {
        let s = self.spec.clone();
        let b = s.num_seqs as i64;
        let w = s.window.min(s.context - 1) as i64;
        let shape = [b * w, s.num_q_heads as i64, s.head_dim as i64];
        let (kc, vc) = (self.k_view(), self.v_view());
        ForwardArgs {
            layer,
            query: self.obs_query.view(0, &shape, &[s.num_q_heads as i64 * s.head_dim as i64, s.head_dim as i64, 1]),
            key_cache: kc,
            value_cache: vc,
            block_table: TensorRef::from_slice(&self.block_table, &[b, self.max_blocks as i64]),
            seq_lens: TensorRef::from_slice(&tabs.0, &[b]),
            query_start_loc: TensorRef::from_slice(&tabs.1, &[b + 1]),
            seq_ids: Some(TensorRef::from_slice(&self.seq_ids, &[b])),
            out: out.view_contiguous(&shape),
            lse: None,
            scale: self.scale,
            sliding_window: 0,
            softcap: 0.0,
            max_query_len: 0,
            max_seq_len: 0,
            stream: std::ptr::null_mut(),
        }
    }
}

fn unit(rng: &mut Rng, d: usize) -> Vec<f64> {
    let v: Vec<f64> = (0..d).map(|_| rng.normal()).collect();
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.into_iter().map(|x| x / n).collect()
}
