//! The one exact attention kernel every CPU path uses: online softmax over logical key positions of one
//! sequence and one KV head, for a group of query rows at once (all query heads of the GQA group, and for
//! prefill several tokens), in chunks of [`CHUNK`] keys.
//!
//! Each key and value row is loaded from the paged cache and converted to f32 once per chunk and reused by
//! every query row of the group, so the loop streams the KV cache once per (sequence, KV head) in decode.
//! Dense attention calls it with one position range; policies call it with their own span lists.

use super::convert::{axpy, dot, load_row, Isa, Portable};
use super::isa::{self, IsaLevel};
use super::math::fast_exp;
use crate::layout::KvCache;

/// Keys per chunk: large enough to amortise the softmax rescale, small enough to keep K in L1/L2.
pub const CHUNK: usize = 32;

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
    #[inline(always)]
    fn k_row(&self, pos: usize) -> *const u8 {
        let bs = self.cache.block_size;
        self.cache.k_row(self.blocks[pos / bs] as usize, pos % bs, self.head)
    }
    #[inline(always)]
    fn v_row(&self, pos: usize) -> *const u8 {
        let bs = self.cache.block_size;
        self.cache.v_row(self.blocks[pos / bs] as usize, pos % bs, self.head)
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
    // scratch, kept here so repeated calls allocate nothing
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
            kbuf: vec![0.0; CHUNK * dim],
            vbuf: vec![0.0; dim],
            scores: vec![0.0; rows * CHUNK],
        }
    }

    /// Forgets all keys seen so far (keeps the allocations).
    pub fn reset(&mut self) {
        self.m.fill(f32::NEG_INFINITY);
        self.l.fill(0.0);
        self.acc.fill(0.0);
    }

    /// Normalised output of row `r` written into `out`; returns its log-sum-exp (natural log, scaled
    /// logits). A row that saw no key gets zeros and `-inf`.
    pub fn finish_row(&self, r: usize, out: &mut [f32]) -> f32 {
        let acc = &self.acc[r * self.dim..(r + 1) * self.dim];
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
    match isa::detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { attend_spans_avx2(st, q, limits, kv, spans, softcap) },
        IsaLevel::Portable => attend_spans_generic::<Portable>(st, q, limits, kv, spans, softcap),
    }
}

/// Like [`attend_spans`] for an explicit list of key positions (any order, no duplicates), taken
/// [`CHUNK`] at a time: what token-level selections (top-p, SnapKV) use, so a scattered set costs one
/// online-softmax update per chunk, not per token.
pub fn attend_tokens(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, tokens: &[u32], softcap: f32) {
    match isa::detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { attend_tokens_avx2(st, q, limits, kv, tokens, softcap) },
        IsaLevel::Portable => attend_tokens_generic::<Portable>(st, q, limits, kv, tokens, softcap),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_spans_avx2(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], softcap: f32) {
    attend_spans_generic::<super::convert::Avx2>(st, q, limits, kv, spans, softcap)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_tokens_avx2(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, tokens: &[u32], softcap: f32) {
    attend_tokens_generic::<super::convert::Avx2>(st, q, limits, kv, tokens, softcap)
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
    /// Smallest and one past the largest position.
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

/// One chunk of keys: scores, online-softmax update, value accumulation.
#[inline(always)]
fn chunk<I: Isa>(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, keys: Keys, softcap: f32) {
    let n = keys.len();
    let (c0, c1) = keys.bounds();
    let d = st.dim;
    let cache = kv.cache;
    // Which rows see any key of this chunk? Skip the chunk (no loads) when none does.
    let any = limits.iter().any(|lim| lim.lo < c1 && lim.hi >= c0);
    if !any {
        return;
    }
    for jj in 0..n {
        // SAFETY: positions < seq_len, whose blocks were validated against the cache.
        unsafe { load_row::<I>(kv.k_row(keys.pos(jj)), cache.dtype, cache.k_dim_stride(), d, &mut st.kbuf[jj * d..(jj + 1) * d]) };
    }
    let mut any_weight = false;
    for r in 0..st.rows {
        let lim = limits[r];
        let sc = &mut st.scores[r * CHUNK..r * CHUNK + n];
        if lim.lo >= c1 || lim.hi < c0 {
            sc.fill(0.0);
            continue;
        }
        let qr = &q[r * d..(r + 1) * d];
        let mut cmax = f32::NEG_INFINITY;
        for jj in 0..n {
            let pos = keys.pos(jj);
            let s = if pos < lim.lo || pos > lim.hi {
                f32::NEG_INFINITY
            } else {
                let s = dot(qr, &st.kbuf[jj * d..(jj + 1) * d]);
                if softcap > 0.0 {
                    softcap * (s / softcap).tanh()
                } else {
                    s
                }
            };
            sc[jj] = s;
            cmax = cmax.max(s);
        }
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
        let mut sum = 0f32;
        for s in sc.iter_mut() {
            *s = fast_exp(*s - m_new);
            sum += *s;
        }
        st.l[r] += sum;
        any_weight = true;
    }
    if !any_weight {
        return;
    }
    for jj in 0..n {
        unsafe { load_row::<I>(kv.v_row(keys.pos(jj)), cache.dtype, cache.v_dim_stride(), d, &mut st.vbuf) };
        for r in 0..st.rows {
            let p = st.scores[r * CHUNK + jj];
            if p != 0.0 {
                axpy(&mut st.acc[r * d..(r + 1) * d], p, &st.vbuf);
            }
        }
    }
}
