//! The one exact attention kernel every CPU path uses: online softmax over logical key positions of one
//! sequence and one KV head, for a group of query rows at once (all query heads of the GQA group, and for
//! prefill several tokens), in chunks of [`CHUNK`] keys.
//!
//! Each key and value row is loaded from the paged cache and converted to f32 once per chunk and reused by
//! every query row of the group, so the loop streams the KV cache once per (sequence, KV head) in decode.
//! Dense attention calls it with one position range; policies call it with their own span lists.

use super::convert::{Isa, Portable};
use super::isa::{self, IsaLevel};
use super::math::fast_exp;
use crate::layout::KvCache;

pub use super::chunk::CHUNK;

/// Scalar attention parameters (validated by `layout::validate_params`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub scale: f32,
    /// Logit soft-cap: `s = cap * tanh(s / cap)` on scaled logits; 0 = off.
    pub softcap: f32,
    /// Sliding window in tokens (a query at position p sees keys p-window+1..=p); 0 = off.
    pub window: usize,
}

/// Inclusive range of key positions a query row may see (causal limit and sliding window).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLimits {
    pub lo: usize,
    pub hi: usize,
}

impl RowLimits {
    /// Limits of the query at position `pos` under the given window.
    pub fn causal(pos: usize, window: usize) -> Self {
        let lo = if window == 0 { 0 } else { (pos + 1).saturating_sub(window) };
        RowLimits { lo, hi: pos }
    }
}

/// The keys of one sequence and one KV head: the cache, the sequence's physical blocks, the head.
#[derive(Clone, Copy)]
pub struct SeqKv<'a> {
    pub cache: &'a KvCache,
    pub blocks: &'a [u32],
    pub head: usize,
}

impl SeqKv<'_> {
    // Block sizes are powers of two (validated), so position → (block, offset) is a shift and a mask.
    #[inline(always)]
    pub(crate) fn k_row(&self, pos: usize) -> *const u8 {
        let sh = self.cache.block_size.trailing_zeros();
        self.cache.k_row(self.blocks[pos >> sh] as usize, pos & (self.cache.block_size - 1), self.head)
    }
    #[inline(always)]
    pub(crate) fn v_row(&self, pos: usize) -> *const u8 {
        let sh = self.cache.block_size.trailing_zeros();
        self.cache.v_row(self.blocks[pos >> sh] as usize, pos & (self.cache.block_size - 1), self.head)
    }
}

/// Online-softmax accumulators for `rows` query rows of width `dim`: running max `m`, running sum `l`
/// and the unnormalised output `acc`, all f32.
#[derive(Clone, Debug)]
pub struct RowsState {
    pub rows: usize,
    pub dim: usize,
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub acc: Vec<f32>,
    // scratch, kept here so repeated calls allocate nothing (K/V staging: only for caches that cannot be
    // read in place, allocated on first use)
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    scores: Vec<f32>,
}

impl RowsState {
    pub fn new(rows: usize, dim: usize) -> Self {
        RowsState {
            rows,
            dim,
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            acc: vec![0.0; rows * dim],
            kbuf: Vec::new(),
            vbuf: Vec::new(),
            scores: vec![0.0; rows * CHUNK],
        }
    }

    /// Forgets all keys seen so far (keeps the allocations).
    pub fn reset(&mut self) {
        self.m.fill(f32::NEG_INFINITY);
        self.l.fill(0.0);
        self.acc.fill(0.0);
    }

    /// Folds another partial state over a disjoint key set into this one (exact, through the running
    /// maxima): used to combine split-KV partials. A poisoned row (see [`poison`](Self::poison)) on either
    /// side poisons the result.
    pub fn merge_from(&mut self, o: &RowsState) {
        let d = self.dim;
        for r in 0..self.rows {
            if o.l[r].is_nan() {
                self.l[r] = f32::NAN;
            }
            if self.l[r].is_nan() {
                continue;
            }
            let m = self.m[r].max(o.m[r]);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let a = if self.l[r] > 0.0 { fast_exp(self.m[r] - m) } else { 0.0 };
            let b = if o.l[r] > 0.0 { fast_exp(o.m[r] - m) } else { 0.0 };
            self.l[r] = self.l[r] * a + o.l[r] * b;
            for (x, &y) in self.acc[r * d..(r + 1) * d].iter_mut().zip(&o.acc[r * d..(r + 1) * d]) {
                *x = *x * a + y * b;
            }
            self.m[r] = m;
        }
    }

    /// Marks row `r` as having met a logit that is not finite (NaN or infinity in its query or in a key it
    /// attends, or an overflowing product): the row finishes as NaN, whatever else it attends. The mark
    /// is `l = NaN`, which every later update keeps (`NaN + x`, and rescaling is skipped unless `l > 0`).
    #[inline]
    pub fn poison(&mut self, r: usize) {
        self.l[r] = f32::NAN;
    }

    /// Normalised output of row `r` written into `out`; returns its log-sum-exp (natural log, scaled
    /// logits). A row that saw no key gets zeros and `-inf`; a poisoned row gets NaN everywhere and a NaN
    /// LSE (non-finite values in V are not poisoning: they reach the output elements they touch).
    pub fn finish_row(&self, r: usize, out: &mut [f32]) -> f32 {
        let acc = &self.acc[r * self.dim..(r + 1) * self.dim];
        if self.l[r].is_nan() {
            out[..self.dim].fill(f32::NAN);
            return f32::NAN;
        }
        if self.l[r] > 0.0 {
            let inv = 1.0 / self.l[r];
            for (o, &a) in out.iter_mut().zip(acc) {
                *o = a * inv;
            }
            self.m[r] + self.l[r].ln()
        } else {
            out[..self.dim].fill(0.0);
            f32::NEG_INFINITY
        }
    }
}

/// Attends the query rows `q` (`rows × dim`, already multiplied by the softmax scale) to the key positions
/// of every span `[start, end)` in `spans`, in the order given, masking each row by its `limits`.
/// Spans may come in any order and need not be contiguous; they must not overlap (each key counted once).
pub fn attend_spans(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    attend_spans_at(isa::detected(), st, q, limits, kv, spans, softcap)
}

/// [`attend_spans`] on instruction set `level` (at most the detected one; see [`isa::decisions`]).
pub fn attend_spans_at(level: IsaLevel, st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    match level {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { attend_spans_avx2(st, q, limits, kv, spans, softcap) },
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512 => unsafe { attend_spans_avx512(st, q, limits, kv, spans, softcap) },
        IsaLevel::Portable => attend_spans_generic::<Portable>(st, q, limits, kv, spans, softcap),
    }
}

/// Like [`attend_spans`] for an explicit list of key positions (any order, no duplicates), taken
/// [`CHUNK`] at a time: what token-level selections (top-p, SnapKV) use, so a scattered set costs one
/// online-softmax update per chunk, not per token.
pub fn attend_tokens(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, tokens: &[u32], softcap: f32) {
    attend_tokens_at(isa::detected(), st, q, limits, kv, tokens, softcap)
}

/// [`attend_tokens`] on instruction set `level` (at most the detected one; see [`isa::decisions`]).
pub fn attend_tokens_at(level: IsaLevel, st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, tokens: &[u32], softcap: f32) {
    match level {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { attend_tokens_avx2(st, q, limits, kv, tokens, softcap) },
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512 => unsafe { attend_tokens_avx512(st, q, limits, kv, tokens, softcap) },
        IsaLevel::Portable => attend_tokens_generic::<Portable>(st, q, limits, kv, tokens, softcap),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_tokens_avx2(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, tokens: &[u32], softcap: f32) {
    attend_tokens_generic::<super::convert::Avx2>(st, q, limits, kv, tokens, softcap)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend_tokens_avx512(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, tokens: &[u32], softcap: f32) {
    attend_tokens_generic::<super::convert::Avx512>(st, q, limits, kv, tokens, softcap)
}

#[inline(always)]
fn attend_tokens_generic<I: Isa>(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, tokens: &[u32], softcap: f32) {
    debug_assert_eq!(q.len(), st.rows * st.dim);
    debug_assert_eq!(limits.len(), st.rows);
    for part in tokens.chunks(CHUNK) {
        chunk::<I>(st, q, limits, kv, Keys::List(part), softcap);
    }
}

/// The keys of one chunk: a contiguous range of positions or an explicit list (at most [`CHUNK`]).
#[derive(Clone, Copy)]
enum Keys<'a> {
    Range(usize, usize),
    List(&'a [u32]),
}

impl Keys<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        match *self {
            Keys::Range(a, b) => b - a,
            Keys::List(l) => l.len(),
        }
    }
    #[inline(always)]
    fn pos(&self, jj: usize) -> usize {
        match *self {
            Keys::Range(a, _) => a + jj,
            Keys::List(l) => l[jj] as usize,
        }
    }
    /// Smallest position and one past the largest.
    #[inline(always)]
    fn bounds(&self) -> (usize, usize) {
        match *self {
            Keys::Range(a, b) => (a, b),
            Keys::List(l) => {
                let lo = l.iter().copied().min().unwrap_or(0) as usize;
                let hi = l.iter().copied().max().map_or(0, |x| x as usize + 1);
                (lo, hi)
            }
        }
    }
}

/// Like [`attend_spans`] for several KV heads of one sequence at once (`states[i]` and the query rows
/// `qs[i]` belong to KV head `head0 + i`): the heads take turns over the positions in an order that reads
/// the cache in address order for its layout ([`chunks_per_head_pass`]) instead of one head's rows
/// scattered over pages, which is what keeps the CPU decode loop at memory bandwidth.
pub fn attend_spans_heads(states: &mut [RowsState], qs: &[Vec<f32>], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    match isa::detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { attend_spans_heads_avx2(states, qs, limits, kv, spans, softcap) },
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512 => unsafe { attend_spans_heads_avx512(states, qs, limits, kv, spans, softcap) },
        IsaLevel::Portable => attend_spans_heads_generic::<Portable>(states, qs, limits, kv, spans, softcap),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_spans_heads_avx2(states: &mut [RowsState], qs: &[Vec<f32>], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    attend_spans_heads_generic::<super::convert::Avx2>(states, qs, limits, kv, spans, softcap)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend_spans_heads_avx512(states: &mut [RowsState], qs: &[Vec<f32>], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    attend_spans_heads_generic::<super::convert::Avx512>(states, qs, limits, kv, spans, softcap)
}

#[inline(always)]
fn attend_spans_heads_generic<I: Isa>(states: &mut [RowsState], qs: &[Vec<f32>], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    let cache = kv.cache;
    // Byte distance from one KV head's row to the next head's row of the same token.
    let (kh, vh) = (cache.k_byte_stride(2), cache.v_byte_stride(2));
    let row_bytes = cache.head_dim * cache.dtype.size_bytes();
    let group = chunks_per_head_pass(cache);
    let mut krows = [[std::ptr::null::<u8>(); CHUNK]; MAX_GROUP_CHUNKS];
    let mut vrows = [[std::ptr::null::<u8>(); CHUNK]; MAX_GROUP_CHUNKS];
    let mut ns = [0usize; MAX_GROUP_CHUNKS];
    let (mut kh_rows, mut vh_rows) = ([std::ptr::null::<u8>(); CHUNK], [std::ptr::null::<u8>(); CHUNK]);
    for &(start, end) in spans {
        let mut c0 = start;
        while c0 < end {
            // Up to `group` chunks (the same chunk boundaries whatever the group: each head's state sees the
            // same chunks in the same order, so the result does not depend on the layout).
            let g0 = c0;
            let mut chunks = 0;
            while chunks < group && c0 < end {
                let c1 = (c0 + CHUNK).min(end);
                // The rows of the first head once per chunk; the other heads' rows are a fixed offset away.
                for jj in 0..c1 - c0 {
                    krows[chunks][jj] = kv.k_row(c0 + jj);
                    vrows[chunks][jj] = kv.v_row(c0 + jj);
                }
                ns[chunks] = c1 - c0;
                chunks += 1;
                c0 = c1;
            }
            if *PREFETCH {
                prefetch_next_chunk(kv, c0, end, states.len(), (kh, vh), row_bytes);
            }
            for (i, st) in states.iter_mut().enumerate() {
                let i = i as isize;
                let mut p0 = g0;
                for c in 0..chunks {
                    let n = ns[c];
                    for jj in 0..n {
                        kh_rows[jj] = krows[c][jj].wrapping_offset(i * kh);
                        vh_rows[jj] = vrows[c][jj].wrapping_offset(i * vh);
                    }
                    chunk_rows::<I>(st, &qs[i as usize], limits, cache, Keys::Range(p0, p0 + n), &kh_rows[..n], &vh_rows[..n], softcap);
                    p0 += n;
                }
            }
        }
    }
}

/// Most chunks one head consumes before the next head's turn (see [`chunks_per_head_pass`]).
const MAX_GROUP_CHUNKS: usize = 8;

/// How many chunks each head consumes in a row, so the loop reads the cache in address order. Token-major
/// caches (a token's heads side by side, vLLM's LBNHC) have every head's row of a chunk in one run: one
/// chunk per head, then the next head. Head-major blocks (a block's tokens of one head side by side,
/// LBHNC: vLLM's own CPU layout) hold each head's run of a block in one place: a head reads up to a
/// block's worth of chunks before the next head, so the block is read front to back. Measured on the
/// 2-vCPU AVX-512 VM (issue 16), head-major blocks: 3-10% faster than chunk by chunk (Llama-8B shape f32,
/// SmolLM2 shape bf16); token-major caches are still faster for wide tokens (docs/perf.md).
fn chunks_per_head_pass(cache: &KvCache) -> usize {
    let token = cache.k.stride(1).unsigned_abs();
    let head = cache.k.stride(2).unsigned_abs();
    if head <= token {
        1
    } else {
        (cache.block_size / CHUNK).clamp(1, MAX_GROUP_CHUNKS)
    }
}

/// Whether [`prefetch_next_chunk`] runs (`KVS_CPU_PREFETCH=1`; off by default). Measured with
/// `scripts/cpu_attn_bench.py`, libraries with and without it alternated on a quiet machine: on the first
/// 2-vCPU VM (AVX2) it made the SmolLM2 shape 5-10% faster; on its successor (a Xeon with AVX-512 and a
/// 260 MB L3) it made the Llama-8B shape 1.2-1.6x slower (bf16, batch 1-8, 2K-8K keys: the prefetches
/// stall on full fill buffers) and the SmolLM2 shape no faster (docs/perf.md, issue 16).
static PREFETCH: once_cell::sync::Lazy<bool> = once_cell::sync::Lazy::new(|| std::env::var("KVS_CPU_PREFETCH").is_ok_and(|v| v.trim() == "1"));

/// Hints every K and V row of the next chunk (all heads) into the cache while this chunk is computed:
/// one head's rows are spread over the chunk's tokens (another head's rows in between, blocks shuffled).
/// Off by default; see [`PREFETCH`].
#[inline(always)]
fn prefetch_next_chunk(kv: &SeqKv, c1: usize, end: usize, heads: usize, (kh, vh): (isize, isize), row_bytes: usize) {
    for pos in c1..(c1 + CHUNK).min(end) {
        let (k, v) = (kv.k_row(pos), kv.v_row(pos));
        for h in 0..heads as isize {
            prefetch_row(k.wrapping_offset(h * kh), row_bytes);
            prefetch_row(v.wrapping_offset(h * vh), row_bytes);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_spans_avx2(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    attend_spans_generic::<super::convert::Avx2>(st, q, limits, kv, spans, softcap)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend_spans_avx512(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    attend_spans_generic::<super::convert::Avx512>(st, q, limits, kv, spans, softcap)
}

#[inline(always)]
fn attend_spans_generic<I: Isa>(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    debug_assert_eq!(q.len(), st.rows * st.dim);
    debug_assert_eq!(limits.len(), st.rows);
    for &(start, end) in spans {
        let mut c0 = start;
        while c0 < end {
            let c1 = (c0 + CHUNK).min(end);
            chunk::<I>(st, q, limits, kv, Keys::Range(c0, c1), softcap);
            c0 = c1;
        }
    }
}

/// Hints the cache lines of one row (`bytes` long) into the cache; a no-op off x86-64.
#[inline(always)]
fn prefetch_row(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut off = 0;
        while off < bytes {
            // SAFETY: prefetch never faults; the address is only a hint.
            unsafe { std::arch::x86_64::_mm_prefetch(p.wrapping_add(off) as *const i8, std::arch::x86_64::_MM_HINT_T1) };
            off += 64;
        }
    }
}

/// Whether any row sees any key of the chunk (otherwise the chunk is skipped without loads).
#[inline(always)]
fn visible(limits: &[RowLimits], (c0, c1): (usize, usize)) -> bool {
    limits.iter().any(|lim| lim.lo < c1 && lim.hi >= c0)
}

/// One chunk of keys (a range or a list) of one head: finds the K and V rows, then [`chunk_rows`].
#[inline(always)]
fn chunk<I: Isa>(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, keys: Keys, softcap: f32) {
    let n = keys.len();
    let (mut krows, mut vrows) = ([std::ptr::null::<u8>(); CHUNK], [std::ptr::null::<u8>(); CHUNK]);
    for jj in 0..n {
        krows[jj] = kv.k_row(keys.pos(jj));
        vrows[jj] = kv.v_row(keys.pos(jj));
    }
    chunk_rows::<I>(st, q, limits, kv.cache, keys, &krows[..n], &vrows[..n], softcap);
}

/// Scores, online-softmax update and value accumulation of one chunk whose K and V rows are given (they
/// lie in the cache and are converted in registers where the ISA can).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn chunk_rows<I: Isa>(st: &mut RowsState, q: &[f32], limits: &[RowLimits], cache: &KvCache, keys: Keys, krows: &[*const u8], vrows: &[*const u8], softcap: f32) {
    let d = st.dim;
    let bounds = keys.bounds();
    if !visible(limits, bounds) {
        return;
    }
    // SAFETY: positions < seq_len, whose blocks were validated against the cache.
    unsafe { I::scores_rows(&mut st.scores, q, krows, cache.dtype, cache.k_scale, cache.k_dim_stride(), &mut st.kbuf, st.rows, d) };
    if !softmax_chunk::<I>(st, limits, keys, bounds, softcap) {
        return;
    }
    unsafe { I::accumulate_rows(&mut st.acc, &st.scores, vrows, cache.dtype, cache.v_scale, cache.v_dim_stride(), &mut st.vbuf, st.rows, d) };
}

/// With the chunk's raw scores in `st.scores`: soft-cap, masking and the online-softmax update, leaving
/// the chunk's unnormalised weights in `st.scores` (0 for masked keys). Returns whether any row got weight.
/// A visible raw score that is not finite poisons its row (NaN out, NaN LSE; see [`RowsState::poison`]).
#[inline(always)]
fn softmax_chunk<I: Isa>(st: &mut RowsState, limits: &[RowLimits], keys: Keys, (c0, c1): (usize, usize), softcap: f32) -> bool {
    let n = keys.len();
    let d = st.dim;
    let mut any_weight = false;
    for r in 0..st.rows {
        let lim = limits[r];
        let sc = &mut st.scores[r * CHUNK..r * CHUNK + n];
        // Only a chunk that reaches outside the row's limits needs the per-key mask (decode: never).
        let partial = lim.lo > c0 || lim.hi + 1 < c1;
        // A visible raw score that is not finite poisons the row (checked before the soft-cap, which would
        // turn an infinity into a finite value).
        let finite = if partial {
            sc.iter().enumerate().all(|(jj, s)| {
                let pos = keys.pos(jj);
                pos < lim.lo || pos > lim.hi || s.is_finite()
            })
        } else {
            sc.iter().all(|s| s.is_finite())
        };
        if !finite {
            st.l[r] = f32::NAN;
            sc.fill(0.0);
            continue;
        }
        if softcap > 0.0 {
            for s in sc.iter_mut() {
                *s = softcap * (*s / softcap).tanh();
            }
        }
        if partial {
            for (jj, s) in sc.iter_mut().enumerate() {
                let pos = keys.pos(jj);
                if pos < lim.lo || pos > lim.hi {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        let cmax = I::max(sc);
        if cmax == f32::NEG_INFINITY {
            sc.fill(0.0);
            continue;
        }
        let m_old = st.m[r];
        let m_new = m_old.max(cmax);
        if m_new > m_old && st.l[r] > 0.0 {
            let alpha = fast_exp(m_old - m_new);
            st.l[r] *= alpha;
            for a in &mut st.acc[r * d..(r + 1) * d] {
                *a *= alpha;
            }
        }
        st.m[r] = m_new;
        st.l[r] += I::exp_sub_sum(sc, m_new);
        any_weight = true;
    }
    any_weight
}


