//! Dense paged varlen attention on the CPU: splits a validated batch into work items
//! (sequence × KV head × tile of query tokens) and runs them on the engine's thread pool.
//!
//! Also home of the small helpers every CPU path shares: loading a GQA group's query rows and writing
//! finished rows (output and LSE) back to the caller's tensors.

use rayon::prelude::*;

use super::attention::{attend_spans, AttnParams, RowLimits, RowsState, SeqKv};
use super::convert::{load_row, store_row, Portable};
use crate::layout::{Batch, KvCache, SeqDesc};
use crate::tensor::TensorRef;

/// Query rows per work item: a tile holds `max(1, TILE_ROWS / group)` tokens of one GQA group.
const TILE_ROWS: usize = 32;

/// Caller tensors and parameters of one forward call (all validated).
#[derive(Clone, Copy)]
pub struct ForwardIo<'a> {
    pub q: TensorRef,
    pub out: TensorRef,
    pub lse: Option<TensorRef>,
    pub cache: &'a KvCache,
    pub batch: &'a Batch,
    pub params: AttnParams,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
}

impl ForwardIo<'_> {
    pub fn group(&self) -> usize {
        self.num_q_heads / self.num_kv_heads
    }

    /// Loads the query rows of `tokens` (rows of the query tensor) for the query heads of `kv_head`,
    /// row order `token-major, head-minor`, multiplied by the softmax scale.
    pub fn load_queries(&self, tokens: std::ops::Range<usize>, kv_head: usize, dst: &mut [f32]) {
        let d = self.cache.head_dim;
        let g = self.group();
        let mut r = 0;
        for t in tokens {
            for h in kv_head * g..(kv_head + 1) * g {
                let row = &mut dst[r * d..(r + 1) * d];
                // SAFETY: t < num_tokens and h < num_q_heads were validated.
                unsafe { load_row::<Portable>(self.q.ptr_at(&[t, h, 0]), self.q.dtype, self.q.stride(2), d, row) };
                for x in row.iter_mut() {
                    *x *= self.params.scale;
                }
                r += 1;
            }
        }
    }

    /// Writes finished rows (same order as [`load_queries`](Self::load_queries)) to `out` and `lse`.
    pub fn store_rows(&self, st: &RowsState, tokens: std::ops::Range<usize>, kv_head: usize, row_buf: &mut [f32]) {
        let g = self.group();
        let mut r = 0;
        for t in tokens {
            for h in kv_head * g..(kv_head + 1) * g {
                let lse = st.finish_row(r, row_buf);
                // SAFETY: (t, h) is inside the validated output shapes; work items write disjoint rows.
                unsafe {
                    store_row(&row_buf[..st.dim], self.out.ptr_at(&[t, h, 0]), self.out.dtype, self.out.stride(2));
                    if let Some(l) = &self.lse {
                        (l.ptr_at(&[t, h]) as *mut f32).write_unaligned(lse);
                    }
                }
                r += 1;
            }
        }
    }

    /// Causal (and windowed) limits for the rows of `tokens` of sequence `s`.
    pub fn limits(&self, s: &SeqDesc, tokens: std::ops::Range<usize>, out: &mut Vec<RowLimits>) {
        out.clear();
        for t in tokens {
            let pos = s.first_pos() + (t - s.q_start);
            let lim = RowLimits::causal(pos, self.params.window);
            for _ in 0..self.group() {
                out.push(lim);
            }
        }
    }
}

/// One unit of parallel work.
#[derive(Clone, Copy, Debug)]
struct Item {
    seq: usize,
    kv_head: usize,
    t0: usize,
    t1: usize,
}

/// Dense attention for the sequences `seqs` (indices into the batch) of one forward call.
pub fn dense_forward(io: &ForwardIo, seqs: &[usize], pool: &rayon::ThreadPool) {
    let g = io.group();
    let tile_tokens = (TILE_ROWS / g).max(1);
    let mut items = Vec::new();
    for &s in seqs {
        let sd = &io.batch.seqs[s];
        let mut t0 = sd.q_start;
        while t0 < sd.q_start + sd.q_len {
            let t1 = (t0 + tile_tokens).min(sd.q_start + sd.q_len);
            for kv_head in 0..io.num_kv_heads {
                items.push(Item { seq: s, kv_head, t0, t1 });
            }
            t0 = t1;
        }
    }
    // Longest first, so the pool does not end waiting for one long prefill tile.
    items.sort_by_key(|it| std::cmp::Reverse(io.batch.seqs[it.seq].first_pos() + (it.t1 - io.batch.seqs[it.seq].q_start)));
    let run = |it: &Item, st: &mut Option<RowsState>, lim: &mut Vec<RowLimits>, qbuf: &mut Vec<f32>, row: &mut Vec<f32>| {
        let d = io.cache.head_dim;
        let rows = (it.t1 - it.t0) * g;
        let st = match st {
            Some(s) if s.rows == rows => {
                s.reset();
                s
            }
            _ => st.insert(RowsState::new(rows, d)),
        };
        qbuf.resize(rows * d, 0.0);
        row.resize(d, 0.0);
        let sd = &io.batch.seqs[it.seq];
        io.load_queries(it.t0..it.t1, it.kv_head, qbuf);
        io.limits(sd, it.t0..it.t1, lim);
        let lo = lim.iter().map(|l| l.lo).min().unwrap_or(0);
        let hi = lim.iter().map(|l| l.hi).max().unwrap_or(0);
        let kv = SeqKv { cache: io.cache, blocks: io.batch.blocks(it.seq, io.cache.block_size), head: it.kv_head };
        attend_spans(st, qbuf, lim, &kv, &[(lo, hi + 1)], io.params.softcap);
        io.store_rows(st, it.t0..it.t1, it.kv_head, row);
    };
    if items.len() <= 1 || pool.current_num_threads() <= 1 {
        let (mut st, mut lim, mut qb, mut row) = (None, Vec::new(), Vec::new(), Vec::new());
        for it in &items {
            run(it, &mut st, &mut lim, &mut qb, &mut row);
        }
        return;
    }
    pool.install(|| {
        items.par_iter().for_each_init(
            || (None, Vec::new(), Vec::new(), Vec::new()),
            |(st, lim, qb, row), it| run(it, st, lim, qb, row),
        );
    });
}
