//! Random test batches for the conformance suite: a paged cache filled through `cache_write` (with
//! padding slots), shuffled block tables, optionally strided caches/queries/outputs, and the logical
//! float64 copies the reference needs.

use super::hostbuf::HostBuf;
use super::reference::{attention_f64, RefParams, SeqRef};
use crate::config::EngineConfig;
use crate::engine::{CacheWriteArgs, Engine, ForwardArgs};
use crate::rng::Rng;
use crate::tensor::{DType, TensorRef};

/// One conformance case: model geometry, dtype and the batch's (query length, sequence length) pairs.
#[derive(Clone, Debug)]
pub struct CaseSpec {
    pub name: String,
    pub dtype: DType,
    pub head_dim: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub block_size: usize,
    /// (q_len, seq_len) per sequence.
    pub seqs: Vec<(usize, usize)>,
    pub window: usize,
    pub softcap: f32,
    /// Padded, non-contiguous caches, queries and outputs; LSE in `[heads, tokens]` layout.
    pub strided: bool,
    /// Blocks assigned to sequences in random order (else in order).
    pub shuffled: bool,
}

/// Host-side inputs of one case plus the float64 reference result.
pub struct Fixture {
    pub spec: CaseSpec,
    pub num_tokens: usize,
    pub num_blocks: usize,
    pub max_blocks: usize,
    pub q: HostBuf,
    /// Combined `[2, ...]` storage of both caches.
    pub cache: HostBuf,
    pub cache_shape: [i64; 4],
    pub cache_strides: [i64; 4],
    pub v_offset: usize,
    pub q_strides: [i64; 3],
    pub block_table: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub query_start_loc: Vec<i32>,
    pub seq_ids: Vec<i64>,
    /// Rows to write with `cache_write` (`[n, kv_heads, dim]`) and their slots (-1 = padding).
    pub new_k: HostBuf,
    pub new_v: HostBuf,
    pub slots: Vec<i64>,
    /// Reference output `[tokens][q_heads][dim]` and LSE `[tokens][q_heads]`.
    pub ref_out: Vec<f64>,
    pub ref_lse: Vec<f64>,
    pub scale: f32,
}

const PAD: usize = 8;

/// A non-finite value planted in a fixture's logical inputs (see `conformance::nonfinite`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Poison {
    /// Element 0 of the query row (`token` of the batch, query head `head`).
    Query { token: usize, head: usize, value: f64 },
    /// Element 0 of the key row at position `pos` of sequence `seq`, KV head `kv_head`.
    Key { seq: usize, pos: usize, kv_head: usize, value: f64 },
    /// Element `dim` of the value row at position `pos` of sequence `seq`, KV head `kv_head`.
    Value { seq: usize, pos: usize, kv_head: usize, dim: usize, value: f64 },
    /// Every cache slot no sequence uses (spare blocks, the tail of each last block) and every padding
    /// row of the cache write (slot -1): memory no query may read.
    Garbage { value: f64 },
}

impl Fixture {
    pub fn new(spec: &CaseSpec, seed: u64) -> Fixture {
        Self::poisoned(spec, seed, &[])
    }

    /// Like [`new`](Self::new) with non-finite values planted; the reference is computed on the
    /// poisoned inputs (what the rows that do not see a poisoned value must still match).
    pub fn poisoned(spec: &CaseSpec, seed: u64, poison: &[Poison]) -> Fixture {
        let garbage = poison.iter().find_map(|p| match p {
            Poison::Garbage { value } => Some(*value),
            _ => None,
        });
        let mut rng = Rng::new(seed);
        let (hq, hk, d, bs, dt) = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype);
        let blocks_needed: Vec<usize> = spec.seqs.iter().map(|&(_, l)| l.div_ceil(bs)).collect();
        let num_blocks = blocks_needed.iter().sum::<usize>() + 3; // spare blocks stay unused (and garbage)
        let max_blocks = blocks_needed.iter().copied().max().unwrap_or(0).max(1) + 1;
        let mut ids: Vec<usize> = (0..num_blocks).collect();
        if spec.shuffled {
            rng.shuffle(&mut ids);
        }
        let mut block_table = vec![-1i32; spec.seqs.len() * max_blocks];
        let mut next = 0;
        for (s, &nb) in blocks_needed.iter().enumerate() {
            for j in 0..nb {
                block_table[s * max_blocks + j] = ids[next] as i32;
                next += 1;
            }
        }
        // Cache geometry: padded rows and a gap between blocks when strided.
        let (row, gap) = if spec.strided { (d + PAD, PAD) } else { (d, 0) };
        let cache_strides = [(bs * hk * row + gap) as i64, (hk * row) as i64, row as i64, 1];
        let one = num_blocks * cache_strides[0] as usize;
        let mut cache = HostBuf::zeros(dt, 2 * one);
        for i in 0..cache.len() {
            cache.set(i, garbage.unwrap_or(rng.normal() * 7.0)); // garbage in unused slots: reading them would show
        }
        let cache_shape = [num_blocks as i64, bs as i64, hk as i64, d as i64];

        // Logical K/V/Q per sequence, rounded to the dtype (the reference sees exactly the stored values).
        let round = |x: f64| -> f64 {
            let mut b = HostBuf::zeros(dt, 1);
            b.set(0, x);
            b.get(0)
        };
        let num_tokens: usize = spec.seqs.iter().map(|&(q, _)| q).sum();
        let q_row = if spec.strided { hq * d + 16 } else { hq * d };
        let q_strides = [q_row as i64, d as i64, 1];
        let mut q = HostBuf::zeros(dt, num_tokens.max(1) * q_row);
        let total_kv: usize = spec.seqs.iter().map(|&(_, l)| l).sum();
        let n_pad = total_kv; // worst case: a padding row before every real one
        let mut new_k = HostBuf::zeros(dt, (total_kv + n_pad) * hk * d);
        let mut new_v = HostBuf::zeros(dt, (total_kv + n_pad) * hk * d);
        let mut slots = Vec::with_capacity(total_kv + n_pad);
        let mut ref_out = vec![0.0; num_tokens * hq * d];
        let mut ref_lse = vec![0.0; num_tokens * hq];
        let mut query_start_loc = vec![0i32];
        let scale = 1.0 / (d as f32).sqrt();
        let params = RefParams { num_q_heads: hq, num_kv_heads: hk, dim: d, scale: scale as f64, softcap: spec.softcap as f64, window: spec.window };
        let mut t0 = 0;
        let mut w = 0; // rows written to new_k/new_v
        for (s, &(q_len, seq_len)) in spec.seqs.iter().enumerate() {
            // Keys with a per-sequence direction bias and a few loud positions: realistic, peaky softmax.
            let bias: Vec<f64> = (0..d).map(|_| rng.normal() * 0.5).collect();
            let mut k = vec![0.0; seq_len * hk * d];
            let mut v = vec![0.0; seq_len * hk * d];
            for j in 0..seq_len {
                let loud = if rng.below(50) == 0 { 3.0 } else { 1.0 };
                for i in 0..hk * d {
                    k[j * hk * d + i] = round((rng.normal() + bias[i % d]) * loud);
                    v[j * hk * d + i] = round(rng.normal());
                }
                for p in poison {
                    match *p {
                        Poison::Key { seq, pos, kv_head, value } if seq == s && pos == j => k[(j * hk + kv_head) * d] = value,
                        Poison::Value { seq, pos, kv_head, dim, value } if seq == s && pos == j => v[(j * hk + kv_head) * d + dim] = value,
                        _ => {}
                    }
                }
                // Write row j through the slot mapping, with a padding row now and then.
                if rng.below(7) == 0 {
                    slots.push(-1);
                    for i in 0..hk * d {
                        new_k.set(w * hk * d + i, garbage.unwrap_or(1e4));
                        new_v.set(w * hk * d + i, garbage.unwrap_or(1e4));
                    }
                    w += 1;
                }
                let block = block_table[s * max_blocks + j / bs] as i64;
                slots.push(block * bs as i64 + (j % bs) as i64);
                for i in 0..hk * d {
                    new_k.set(w * hk * d + i, k[j * hk * d + i]);
                    new_v.set(w * hk * d + i, v[j * hk * d + i]);
                }
                w += 1;
            }
            let mut qv = vec![0.0; q_len * hq * d];
            for t in 0..q_len {
                for h in 0..hq {
                    for i in 0..d {
                        let mut x = round(rng.normal() * 1.5 + bias[i]);
                        for p in poison {
                            if let Poison::Query { token, head, value } = *p {
                                if token == t0 + t && head == h && i == 0 {
                                    x = value;
                                }
                            }
                        }
                        qv[(t * hq + h) * d + i] = x;
                        q.set((t0 + t) * q_row + h * d + i, x);
                    }
                }
            }
            let (o, l) = attention_f64(&SeqRef { q: &qv, k: &k, v: &v, q_len, seq_len }, &params);
            ref_out[t0 * hq * d..(t0 + q_len) * hq * d].copy_from_slice(&o);
            ref_lse[t0 * hq..(t0 + q_len) * hq].copy_from_slice(&l);
            t0 += q_len;
            query_start_loc.push(t0 as i32);
        }
        slots.truncate(w);
        Fixture {
            spec: spec.clone(),
            num_tokens,
            num_blocks,
            max_blocks,
            q,
            cache,
            cache_shape,
            cache_strides,
            v_offset: one,
            q_strides,
            block_table,
            seq_lens: spec.seqs.iter().map(|&(_, l)| l as i32).collect(),
            query_start_loc,
            seq_ids: (0..spec.seqs.len()).map(|s| 1000 + s as i64).collect(),
            new_k,
            new_v,
            slots,
            ref_out,
            ref_lse,
            scale,
        }
    }

    pub fn engine_config(&self) -> EngineConfig {
        let s = &self.spec;
        EngineConfig::new(1, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size, s.dtype)
    }

    pub fn k_cache_view(&mut self) -> TensorRef {
        let (shape, strides) = (self.cache_shape, self.cache_strides);
        self.cache.view(0, &shape, &strides)
    }
    pub fn v_cache_view(&mut self) -> TensorRef {
        let (shape, strides, off) = (self.cache_shape, self.cache_strides, self.v_offset);
        self.cache.view(off, &shape, &strides)
    }
    pub fn query_view(&mut self) -> TensorRef {
        let s = &self.spec;
        let shape = [self.num_tokens as i64, s.num_q_heads as i64, s.head_dim as i64];
        let strides = self.q_strides;
        self.q.view(0, &shape, &strides)
    }
}

/// Output buffers of one run, poisoned with NaN.
pub struct Outputs {
    pub out: HostBuf,
    pub lse: Vec<f32>,
    pub out_strides: [i64; 3],
    pub lse_strides: [i64; 2],
}

impl Outputs {
    pub fn new(f: &Fixture) -> Outputs {
        let s = &f.spec;
        let (t, hq, d) = (f.num_tokens, s.num_q_heads, s.head_dim);
        let row = if s.strided { hq * d + 8 } else { hq * d };
        let lse_strides = if s.strided { [1, t.max(1) as i64] } else { [hq as i64, 1] };
        Outputs { out: HostBuf::nans(s.dtype, t.max(1) * row), lse: vec![f32::NAN; t.max(1) * hq], out_strides: [row as i64, d as i64, 1], lse_strides }
    }
    pub fn out_view(&mut self, f: &Fixture) -> TensorRef {
        let shape = [f.num_tokens as i64, f.spec.num_q_heads as i64, f.spec.head_dim as i64];
        let st = self.out_strides;
        self.out.view(0, &shape, &st)
    }
    pub fn lse_view(&mut self, f: &Fixture) -> TensorRef {
        let shape = [f.num_tokens as i64, f.spec.num_q_heads as i64];
        TensorRef::strided(&self.lse, 0, &shape, &self.lse_strides).expect("lse view")
    }
    /// Logical `[tokens][heads][dim]` output and `[tokens][heads]` LSE as f64.
    pub fn to_f64(&self, f: &Fixture) -> (Vec<f64>, Vec<f64>) {
        let (t_n, hq, d) = (f.num_tokens, f.spec.num_q_heads, f.spec.head_dim);
        let mut o = Vec::with_capacity(t_n * hq * d);
        let mut l = Vec::with_capacity(t_n * hq);
        for t in 0..t_n {
            for h in 0..hq {
                for i in 0..d {
                    o.push(self.out.get(t * self.out_strides[0] as usize + h * d + i));
                }
                l.push(self.lse[t * self.lse_strides[0] as usize + h * self.lse_strides[1] as usize] as f64);
            }
        }
        (o, l)
    }
}

/// Fills the fixture's cache through `engine.cache_write`, then runs one forward call on the CPU engine.
pub fn run_on_engine(engine: &Engine, f: &mut Fixture) -> crate::Result<Outputs> {
    let s = f.spec.clone();
    let (hk, d) = (s.num_kv_heads as i64, s.head_dim as i64);
    let n = f.slots.len() as i64;
    let kc = f.k_cache_view();
    let vc = f.v_cache_view();
    let key = f.new_k.view(0, &[n, hk, d], &[hk * d, d, 1]);
    let value = f.new_v.view(0, &[n, hk, d], &[hk * d, d, 1]);
    engine.cache_write(&CacheWriteArgs {
        layer: 0,
        key,
        value,
        key_cache: kc,
        value_cache: vc,
        slot_mapping: TensorRef::from_slice(&f.slots, &[n]),
        stream: std::ptr::null_mut(),
    })?;
    let mut outs = Outputs::new(f);
    let nseq = s.seqs.len() as i64;
    let args = ForwardArgs {
        layer: 0,
        query: f.query_view(),
        key_cache: kc,
        value_cache: vc,
        block_table: TensorRef::from_slice(&f.block_table, &[nseq, f.max_blocks as i64]),
        seq_lens: TensorRef::from_slice(&f.seq_lens, &[nseq]),
        query_start_loc: TensorRef::from_slice(&f.query_start_loc, &[nseq + 1]),
        seq_ids: Some(TensorRef::from_slice(&f.seq_ids, &[nseq])),
        out: outs.out_view(f),
        lse: Some(outs.lse_view(f)),
        scale: f.scale,
        sliding_window: s.window as i32,
        softcap: s.softcap,
        max_query_len: s.seqs.iter().map(|&(q, _)| q).max().unwrap_or(0) as i32,
        max_seq_len: s.seqs.iter().map(|&(_, l)| l).max().unwrap_or(0) as i32,
        stream: std::ptr::null_mut(),
    };
    engine.attention_forward(&args)?;
    Ok(outs)
}
