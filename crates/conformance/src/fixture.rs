//! Random test batches for the conformance suite, shaped like what a serving engine feeds a kernel: a paged
//! cache filled through `cache_write` (with padding slots), shuffled block tables, blocks shared between
//! sequences (prefix caching), stale ids or -1 in unused table columns, unwritten slots holding garbage or
//! NaN, blocks reused from an earlier sequence (their tails still hold its rows), strided views of one
//! combined K/V storage; plus the logical float64 copies the reference needs.

use super::hostbuf::HostBuf;
use super::reference::{attention_f64, RefParams, SeqRef};
use kvsparse::config::EngineConfig;
use super::Api;
use kvsparse::engine::{CacheWriteArgs, ForwardArgs};
use kvsparse::rng::Rng;
use kvsparse::tensor::{DType, TensorRef};

/// What the cache slots that no sequence wrote hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Poison {
    /// Loud finite values (N(0, 7²)): a kernel that reads them without masking gets a visibly wrong output.
    #[default]
    Garbage,
    /// NaN: also catches kernels that mask the logits but still multiply the masked rows' values by zero.
    NaN,
}

/// What the block table holds past the columns a sequence needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Columns {
    /// Valid ids of other blocks, as a persistent table keeps from earlier requests.
    #[default]
    Stale,
    /// -1 padding.
    Pad,
}

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
    /// Cache blocks head-major (a block's tokens of one KV head side by side: vLLM's LBHNC, its CPU
    /// backend's layout) instead of token-major (a token's heads side by side: LBNHC).
    pub head_major: bool,
    /// Blocks assigned to sequences in random order (else in order).
    pub shuffled: bool,
    pub poison: Poison,
    pub columns: Columns,
    /// Every sequence whose cached part (`seq_len - q_len`) covers this many blocks shares them with the
    /// first such sequence (prefix caching: same physical blocks in several table rows, written once).
    pub shared_prefix_blocks: usize,
    /// The blocks a sequence fills only partly, and all spare blocks but one, were filled by an earlier
    /// sequence first (written through `cache_write`): their tails hold that sequence's rows, not poison.
    pub reused: bool,
    /// An FP8 cache ([`DType::F8E4M3`], [`DType::F8E5M2`]) under queries and outputs of `dtype`; `None`:
    /// the cache holds `dtype`. The reference then reads the dequantized cache (what was stored).
    pub cache_dtype: Option<DType>,
}

impl CaseSpec {
    /// A case with a shuffled table, stale unused columns, garbage in unwritten slots and nothing else.
    pub fn new(name: impl Into<String>, dtype: DType, head_dim: usize, hq: usize, hk: usize, block_size: usize, seqs: Vec<(usize, usize)>) -> Self {
        CaseSpec {
            name: name.into(),
            dtype,
            head_dim,
            num_q_heads: hq,
            num_kv_heads: hk,
            block_size,
            seqs,
            window: 0,
            softcap: 0.0,
            strided: false,
            head_major: false,
            shuffled: true,
            poison: Poison::Garbage,
            columns: Columns::Stale,
            shared_prefix_blocks: 0,
            reused: false,
            cache_dtype: None,
        }
    }

    /// Short tags of what this case exercises (exported in the manifest).
    pub fn features(&self) -> Vec<&'static str> {
        let mut f = Vec::new();
        let decode = self.seqs.iter().any(|&(q, _)| q == 1);
        let prefill = self.seqs.iter().any(|&(q, _)| q > 1);
        f.push(match (decode, prefill) {
            (true, true) => "mixed",
            (true, false) => "decode",
            _ => "prefill",
        });
        if self.seqs.iter().any(|&(q, l)| q > 1 && q < l) {
            f.push("chunked-prefill");
        }
        if self.num_q_heads != self.num_kv_heads {
            f.push(if self.num_kv_heads == 1 { "mqa" } else { "gqa" });
        }
        if self.window > 0 {
            f.push("sliding-window");
        }
        if self.softcap > 0.0 {
            f.push("softcap");
        }
        if self.shuffled {
            f.push("shuffled-table");
        }
        if self.shared_prefix_blocks > 0 {
            f.push("shared-blocks");
        }
        f.push(match self.columns {
            Columns::Stale => "stale-columns",
            Columns::Pad => "pad-columns",
        });
        f.push(match self.poison {
            Poison::Garbage => "garbage-unwritten",
            Poison::NaN => "nan-unwritten",
        });
        if self.reused {
            f.push("reused-blocks");
        }
        f.push("combined-cache");
        if self.strided {
            f.push("strided");
        }
        if self.head_major {
            f.push("head-major-blocks");
        }
        match self.cache_dtype {
            Some(DType::F8E4M3) => f.push("fp8-e4m3-cache"),
            Some(DType::F8E5M2) => f.push("fp8-e5m2-cache"),
            _ => {}
        }
        f
    }

    /// The first sequence (index) whose cached part covers the shared prefix, if sharing is on.
    fn prefix_donor(&self) -> Option<usize> {
        let n = self.shared_prefix_blocks * self.block_size;
        if n == 0 {
            return None;
        }
        self.seqs.iter().position(|&(q, l)| l - q >= n)
    }

    /// Does sequence `s` read the shared prefix blocks (donor included)?
    fn shares_prefix(&self, s: usize) -> bool {
        let (q, l) = self.seqs[s];
        self.prefix_donor().is_some() && l - q >= self.shared_prefix_blocks * self.block_size
    }
}

/// Rows to write with `cache_write`: `[n, kv_heads, dim]` keys and values and their slots (-1 = padding).
pub struct Rows {
    pub k: HostBuf,
    pub v: HostBuf,
    pub slots: Vec<i64>,
}

/// Host-side inputs of one case plus the float64 reference result.
pub struct Fixture {
    pub spec: CaseSpec,
    pub num_tokens: usize,
    pub num_blocks: usize,
    pub max_blocks: usize,
    pub q: HostBuf,
    /// Combined `[2, ...]` storage of both caches: poison everywhere until an engine writes into it.
    pub cache: HostBuf,
    pub cache_shape: [i64; 4],
    pub cache_strides: [i64; 4],
    pub v_offset: usize,
    pub q_strides: [i64; 3],
    pub block_table: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub query_start_loc: Vec<i32>,
    pub seq_ids: Vec<i64>,
    /// The earlier sequence's rows in reused blocks (written first, in a call of their own); may be empty.
    pub prior: Rows,
    /// This batch's rows (`new_k`/`new_v`/`slots`), padding rows included.
    pub new_k: HostBuf,
    pub new_v: HostBuf,
    pub slots: Vec<i64>,
    /// Reference output `[tokens][q_heads][dim]` and LSE `[tokens][q_heads]`.
    pub ref_out: Vec<f64>,
    pub ref_lse: Vec<f64>,
    pub scale: f32,
    /// Dequantization scales of an FP8 cache (1 otherwise).
    pub k_scale: f32,
    pub v_scale: f32,
}

const PAD: usize = 8;

/// A non-finite value planted in a fixture's logical inputs (see `conformance::nonfinite`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Plant {
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
    pub fn poisoned(spec: &CaseSpec, seed: u64, poison: &[Plant]) -> Fixture {
        let garbage = poison.iter().find_map(|p| match p {
            Plant::Garbage { value } => Some(*value),
            _ => None,
        });
        let mut rng = Rng::new(seed);
        let (hq, hk, d, bs, dt) = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype);
        let cache_dt = spec.cache_dtype.unwrap_or(dt);
        let nseq = spec.seqs.len();
        let blocks_needed: Vec<usize> = spec.seqs.iter().map(|&(_, l)| l.div_ceil(bs)).collect();
        let donor = spec.prefix_donor();
        let n_shared = if donor.is_some() { spec.shared_prefix_blocks } else { 0 };
        let owned = |s: usize| if donor != Some(s) && spec.shares_prefix(s) { blocks_needed[s] - n_shared } else { blocks_needed[s] };
        let num_blocks = (0..nseq).map(owned).sum::<usize>() + 3; // spare blocks stay unused (poison or stale)
        let max_blocks = blocks_needed.iter().copied().max().unwrap_or(0).max(1) + 1;
        let mut ids: Vec<usize> = (0..num_blocks).collect();
        if spec.shuffled {
            rng.shuffle(&mut ids);
        }
        let mut block_table = vec![-1i32; nseq * max_blocks];
        let mut next = 0;
        for s in 0..nseq {
            for j in 0..blocks_needed[s] {
                block_table[s * max_blocks + j] = match donor {
                    Some(dn) if s != dn && j < n_shared && spec.shares_prefix(s) => block_table[dn * max_blocks + j],
                    _ => {
                        next += 1;
                        ids[next - 1] as i32
                    }
                };
            }
            for j in blocks_needed[s]..max_blocks {
                if spec.columns == Columns::Stale {
                    block_table[s * max_blocks + j] = rng.below(num_blocks) as i32;
                }
            }
        }
        let spare: Vec<usize> = ids[next..].to_vec();
        // Cache geometry: padded rows and a gap between blocks when strided.
        let (row, gap) = if spec.strided { (d + PAD, PAD) } else { (d, 0) };
        let (token, head) = if spec.head_major { (row, bs * row) } else { (hk * row, row) };
        let cache_strides = [(bs * hk * row + gap) as i64, token as i64, head as i64, 1];
        let one = num_blocks * cache_strides[0] as usize;
        let mut cache = HostBuf::zeros(cache_dt, 2 * one);
        for i in 0..cache.len() {
            // Unwritten slots and the padding between rows: reading them would show.
            let noise = rng.normal() * 7.0;
            cache.set(i, garbage.unwrap_or(if spec.poison == Poison::NaN { f64::NAN } else { noise }));
        }
        let cache_shape = [num_blocks as i64, bs as i64, hk as i64, d as i64];

        // Logical K/V/Q per sequence, rounded to the dtype (the reference sees exactly the stored values).
        let round = |x: f64| -> f64 {
            let mut b = HostBuf::zeros(dt, 1);
            b.set(0, x);
            b.get(0)
        };
        // FP8 scales around calibrated ones (amax / 448 for E4M3): the loudest keys saturate.
        let (k_scale, v_scale) = if cache_dt.is_fp8() { ((0.01 * (1.0 + rng.uniform())) as f32, (0.005 * (1.0 + rng.uniform())) as f32) } else { (1.0, 1.0) };
        let stored = |x: f64, scale: f32| -> f64 {
            if cache_dt.is_fp8() {
                kvsparse::fp8::dequantize(cache_dt, kvsparse::fp8::quantize(cache_dt, x as f32, scale), scale) as f64
            } else {
                x
            }
        };
        let prior = if spec.reused { Self::prior_life(spec, &block_table, max_blocks, &spare, &mut rng) } else { Rows { k: HostBuf::zeros(dt, 0), v: HostBuf::zeros(dt, 0), slots: Vec::new() } };
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
        let mut donor_kv: (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
        for (s, &(q_len, seq_len)) in spec.seqs.iter().enumerate() {
            // Keys with a per-sequence direction bias and a few loud positions: realistic, peaky softmax.
            let bias: Vec<f64> = (0..d).map(|_| rng.normal() * 0.5).collect();
            let mut k = vec![0.0; seq_len * hk * d];
            let mut v = vec![0.0; seq_len * hk * d];
            // A sequence sharing the prefix reads the donor's rows there, written once by the donor.
            let inherited = if spec.shares_prefix(s) && donor != Some(s) { n_shared * bs } else { 0 };
            k[..inherited * hk * d].copy_from_slice(&donor_kv.0[..inherited * hk * d]);
            v[..inherited * hk * d].copy_from_slice(&donor_kv.1[..inherited * hk * d]);
            for j in inherited..seq_len {
                let loud = if rng.below(50) == 0 { 3.0 } else { 1.0 };
                for i in 0..hk * d {
                    k[j * hk * d + i] = round((rng.normal() + bias[i % d]) * loud);
                    v[j * hk * d + i] = round(rng.normal());
                }
                for p in poison {
                    match *p {
                        Plant::Key { seq, pos, kv_head, value } if seq == s && pos == j => k[(j * hk + kv_head) * d] = value,
                        Plant::Value { seq, pos, kv_head, dim, value } if seq == s && pos == j => v[(j * hk + kv_head) * d + dim] = value,
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
                            if let Plant::Query { token, head, value } = *p {
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
            // The reference reads what the cache holds: FP8 rows dequantized.
            let (kr, vr): (Vec<f64>, Vec<f64>) = (k.iter().map(|&x| stored(x, k_scale)).collect(), v.iter().map(|&x| stored(x, v_scale)).collect());
            let (o, l) = attention_f64(&SeqRef { q: &qv, k: &kr, v: &vr, q_len, seq_len }, &params);
            ref_out[t0 * hq * d..(t0 + q_len) * hq * d].copy_from_slice(&o);
            ref_lse[t0 * hq..(t0 + q_len) * hq].copy_from_slice(&l);
            t0 += q_len;
            query_start_loc.push(t0 as i32);
            if donor == Some(s) {
                donor_kv = (k, v);
            }
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
            seq_ids: (0..nseq).map(|s| 1000 + s as i64).collect(),
            prior,
            new_k,
            new_v,
            slots,
            ref_out,
            ref_lse,
            scale,
            k_scale,
            v_scale,
        }
    }

    /// Rows of an earlier sequence that filled every block a sequence now fills only partly, and the spare
    /// blocks but one: loud keys with a direction of their own, so a kernel or a page bound that still sees them
    /// after the reuse goes visibly wrong.
    fn prior_life(spec: &CaseSpec, table: &[i32], max_blocks: usize, spare: &[usize], rng: &mut Rng) -> Rows {
        let (hk, d, bs) = (spec.num_kv_heads, spec.head_dim, spec.block_size);
        let mut blocks: Vec<usize> = spare[1..].to_vec(); // one spare block stays never written
        for (s, &(_, l)) in spec.seqs.iter().enumerate() {
            if l % bs != 0 {
                blocks.push(table[s * max_blocks + l / bs] as usize);
            }
        }
        let bias: Vec<f64> = (0..d).map(|_| rng.normal() * 2.0).collect();
        let n = blocks.len() * bs;
        let (mut k, mut v) = (HostBuf::zeros(spec.dtype, n * hk * d), HostBuf::zeros(spec.dtype, n * hk * d));
        let mut slots = Vec::with_capacity(n);
        for (r, slot) in blocks.iter().flat_map(|&b| (0..bs).map(move |o| (b * bs + o) as i64)).enumerate() {
            slots.push(slot);
            for i in 0..hk * d {
                k.set(r * hk * d + i, (rng.normal() + bias[i % d]) * 3.0);
                v.set(r * hk * d + i, rng.normal() * 5.0);
            }
        }
        Rows { k, v, slots }
    }

    /// The combined cache storage after both writes (prior life, then this batch), done plainly on the host:
    /// what a kernel that reads the cache sees. Exported instead of the rows, so no consumer needs a cache
    /// write of its own.
    pub fn written_cache(&self) -> HostBuf {
        let mut c = self.cache.clone();
        let (hk, d, bs) = (self.spec.num_kv_heads, self.spec.head_dim, self.spec.block_size);
        let st = self.cache_strides.map(|x| x as usize);
        let lives = [(&self.prior.k, &self.prior.v, &self.prior.slots), (&self.new_k, &self.new_v, &self.slots)];
        for (k, v, slots) in lives {
            for (r, &slot) in slots.iter().enumerate() {
                if slot < 0 {
                    continue;
                }
                let (b, o) = (slot as usize / bs, slot as usize % bs);
                for h in 0..hk {
                    for i in 0..d {
                        let at = b * st[0] + o * st[1] + h * st[2] + i;
                        let (x, y) = (k.get((r * hk + h) * d + i), v.get((r * hk + h) * d + i));
                        if let HostBuf::F8(dt, _) = c {
                            c.set_byte(at, kvsparse::fp8::quantize(dt, x as f32, self.k_scale));
                            c.set_byte(self.v_offset + at, kvsparse::fp8::quantize(dt, y as f32, self.v_scale));
                        } else {
                            c.set(at, x);
                            c.set(self.v_offset + at, y);
                        }
                    }
                }
            }
        }
        c
    }

    /// The dtype the cache holds (the spec's FP8 format, else the query dtype).
    pub fn cache_dtype(&self) -> DType {
        self.spec.cache_dtype.unwrap_or(self.spec.dtype)
    }

    pub fn engine_config(&self) -> EngineConfig {
        let s = &self.spec;
        let mut c = EngineConfig::new(1, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size, s.dtype);
        c.cache_dtype = s.cache_dtype.unwrap_or(s.dtype);
        c
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

/// Writes `k`/`v` rows `[n, kv_heads, dim]` to `slots` of the caches through `engine.cache_write` (no call
/// when there are none).
pub(crate) fn write_rows(engine: &dyn Api, caches: (TensorRef, TensorRef), k: &mut HostBuf, v: &mut HostBuf, slots: &[i64], hk: i64, d: i64) -> kvsparse::Result<()> {
    if slots.is_empty() {
        return Ok(());
    }
    let n = slots.len() as i64;
    engine.cache_write(&CacheWriteArgs {
        layer: 0,
        key: k.view(0, &[n, hk, d], &[hk * d, d, 1]),
        value: v.view(0, &[n, hk, d], &[hk * d, d, 1]),
        key_cache: caches.0,
        value_cache: caches.1,
        slot_mapping: TensorRef::from_slice(slots, &[n]),
        stream: std::ptr::null_mut(),
    })
}

/// Fills the fixture's cache through `engine.cache_write` (the earlier sequence's rows first, in a call of
/// their own, as a serving engine would have), then runs one forward call.
pub fn run_on_engine(engine: &dyn Api, f: &mut Fixture) -> kvsparse::Result<Outputs> {
    let s = f.spec.clone();
    let (hk, d) = (s.num_kv_heads as i64, s.head_dim as i64);
    let (kc, vc) = (f.k_cache_view(), f.v_cache_view());
    if s.cache_dtype.is_some_and(|d| d.is_fp8()) {
        engine.set_kv_scales(0, f.k_scale, f.v_scale)?;
    }
    write_rows(engine, (kc, vc), &mut f.prior.k, &mut f.prior.v, &f.prior.slots, hk, d)?;
    write_rows(engine, (kc, vc), &mut f.new_k, &mut f.new_v, &f.slots, hk, d)?;
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
