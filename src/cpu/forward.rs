//! Dense paged varlen attention on the CPU: splits a validated batch into work items
//! (sequence × KV head × tile of query tokens) and runs them on the engine's thread pool.
//!
//! Also home of the small helpers every CPU path shares: loading a GQA group's query rows and writing
//! finished rows (output and LSE) back to the caller's tensors.

use super::attention::{attend_spans_heads, AttnParams, RowLimits, RowsState, SeqKv};
use super::convert::{load_row, store_row, Portable};
use super::prefill::{attend_prefill_heads, PREFILL_TILE_ROWS};
use super::spin_pool::SpinPool;
use crate::layout::{Batch, KvCache, SeqDesc};
use crate::tensor::TensorRef;

/// Query rows per decode work item: a tile holds `max(1, TILE_ROWS / group)` tokens of one GQA group.
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

    /// Writes the finished states of all KV heads (`states[h]` for head h) for `tokens`.
    pub fn store_heads(&self, states: &[RowsState], tokens: std::ops::Range<usize>, row_buf: &mut Vec<f32>) {
        row_buf.resize(self.cache.head_dim, 0.0);
        for (h, st) in states.iter().enumerate() {
            self.store_rows(st, tokens.clone(), h, row_buf);
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

/// One unit of parallel work: a tile of query tokens of one sequence, all KV heads, keys `[k0, k1)`;
/// `prefill` when the sequence has several query tokens (then [`attend_prefill_heads`] runs it).
#[derive(Clone, Copy, Debug)]
struct Item {
    seq: usize,
    t0: usize,
    t1: usize,
    k0: usize,
    k1: usize,
    prefill: bool,
}

/// Fewest keys worth a split of its own (below this, merging costs more than it spreads).
const MIN_SPLIT_KEYS: usize = 512;

/// The same on the host's OpenMP team, whose threads are awake: there a split of 128 keys pays. Measured
/// side by side with vLLM on the 2-vCPU VM (SmolLM2 shape, batch 1 × 512 keys, two threads): 35 / 39 µs
/// (f32) and 34 / 34 µs (bf16) against 48 / 54 and 38 / 41 µs with 512 (docs/perf.md).
const MIN_SPLIT_KEYS_ON_TEAM: usize = 128;

/// A call with few work items that reads less than this runs on the calling thread alone, unless the pool
/// is the host's OpenMP team (awake: no wake-up to pay). Measured side by side with vLLM's CPU attention on
/// the 2-vCPU VM (issue 16): a SmolLM2-shaped decode of 2K keys (1.5 MB of bf16 K/V) took 173 µs on one
/// thread and 192 µs on two of our own (a parked worker wakes); at 3 MB (f32) two threads were 10% faster.
const MIN_PARALLEL_KV_BYTES: usize = 2 << 20;

/// A prefill sequence with fewer query tiles than this has each tile's keys split into pieces of at least
/// [`PREFILL_MIN_SPLIT_KEYS`], up to this many items per sequence in all: so a short extend over a long
/// prefix still spreads over threads. The split depends only on the call's shapes, never on the thread
/// count, so prefill outputs are the same bits whatever the pool (decode rows split by the thread count).
const PREFILL_MIN_ITEMS: usize = 16;
const PREFILL_MIN_SPLIT_KEYS: usize = 1024;

/// Dense attention for the sequences `seqs` (indices into the batch) of one forward call.
///
/// Work items are (sequence, tile of query tokens), each covering all KV heads so the cache is read in
/// address order. Decode rows: when there are fewer items than twice the threads (small decode batches),
/// each item's key range is split and the partial states are merged exactly afterwards (split-KV).
/// Prefill rows: tiles of [`PREFILL_TILE_ROWS`] rows, split by shape alone (see [`PREFILL_MIN_ITEMS`]).
pub fn dense_forward(io: &ForwardIo, seqs: &[usize], pool: &SpinPool) {
    let g = io.group();
    let mut units = Vec::new();
    // Per unit: into how many key ranges it is split (prefill: fixed here by shape).
    let mut pieces = Vec::new();
    for &s in seqs {
        let sd = &io.batch.seqs[s];
        let prefill = sd.q_len > 1;
        let tile_tokens = ((if prefill { PREFILL_TILE_ROWS } else { TILE_ROWS }) / g).max(1);
        let tiles = sd.q_len.div_ceil(tile_tokens);
        let mut t0 = sd.q_start;
        while t0 < sd.q_start + sd.q_len {
            let t1 = (t0 + tile_tokens).min(sd.q_start + sd.q_len);
            let first = RowLimits::causal(sd.first_pos() + (t0 - sd.q_start), io.params.window).lo;
            let last = sd.first_pos() + (t1 - 1 - sd.q_start);
            units.push(Item { seq: s, t0, t1, k0: first, k1: last + 1, prefill });
            pieces.push(if prefill { PREFILL_MIN_ITEMS.div_ceil(tiles).min((last + 1 - first).div_ceil(PREFILL_MIN_SPLIT_KEYS)).max(1) } else { 1 });
            t0 = t1;
        }
    }
    let threads = pool.threads();
    let wanted = 2 * threads;
    // K and V bytes the call reads (a query tile reads its keys once for all its rows).
    let row_bytes = io.cache.head_dim * io.cache.dtype.size_bytes();
    let kv_bytes = units.iter().fold(0usize, |acc, it| acc.saturating_add((it.k1 - it.k0).saturating_mul(2 * io.num_kv_heads * row_bytes)));
    let small = units.len() < wanted && kv_bytes < MIN_PARALLEL_KV_BYTES && !pool.on_host_team();
    if !small && units.len() < wanted && threads > 1 {
        let min_split = if pool.on_host_team() { MIN_SPLIT_KEYS_ON_TEAM } else { MIN_SPLIT_KEYS };
        for (it, n) in units.iter().zip(pieces.iter_mut()) {
            if !it.prefill {
                *n = wanted.div_ceil(units.len()).min((it.k1 - it.k0).div_ceil(min_split)).max(1);
            }
        }
    }
    if pieces.iter().all(|&n| n == 1) {
        // Longest first, so the pool does not end waiting for one long prefill tile.
        units.sort_by_key(|it| std::cmp::Reverse(it.k1 - it.k0));
        // Too little to share (`small`): handing items to another thread costs more than it saves.
        run_items(io, &units, if small { None } else { Some(pool) }, |st, it, row| io.store_heads(st, it.t0..it.t1, row));
        return;
    }
    let mut items = Vec::new();
    let mut unit_of = Vec::new();
    for (u, (it, &n)) in units.iter().zip(&pieces).enumerate() {
        let step = (it.k1 - it.k0).div_ceil(n);
        let mut k0 = it.k0;
        while k0 < it.k1 {
            let k1 = (k0 + step).min(it.k1);
            items.push(Item { k0, k1, ..*it });
            unit_of.push(u);
            k0 = k1;
        }
    }
    let slots: Vec<parking_lot::Mutex<Option<Vec<RowsState>>>> = items.iter().map(|_| parking_lot::Mutex::new(None)).collect();
    let run = |i: usize| *slots[i].lock() = Some(attend_item(io, &items[i], &mut Vec::new(), &mut Vec::new()));
    if small {
        (0..items.len()).for_each(run);
    } else {
        pool.run(items.len(), &run);
    }
    let partials = slots.into_iter().map(|s| s.into_inner().expect("every item ran"));
    let mut merged: Vec<Option<Vec<RowsState>>> = vec![None; units.len()];
    for (p, &u) in partials.into_iter().zip(&unit_of) {
        match &mut merged[u] {
            None => merged[u] = Some(p),
            Some(acc) => acc.iter_mut().zip(&p).for_each(|(a, b)| a.merge_from(b)),
        }
    }
    let mut row = Vec::new();
    for (it, st) in units.iter().zip(merged) {
        io.store_heads(&st.expect("every unit has at least one split"), it.t0..it.t1, &mut row);
    }
}

/// Attends one item for every KV head; returns one state per head.
fn attend_item(io: &ForwardIo, it: &Item, lim: &mut Vec<RowLimits>, qs_spare: &mut Vec<Vec<f32>>) -> Vec<RowsState> {
    let d = io.cache.head_dim;
    let rows = (it.t1 - it.t0) * io.group();
    let mut states: Vec<RowsState> = (0..io.num_kv_heads).map(|_| RowsState::new(rows, d)).collect();
    let mut qs = std::mem::take(qs_spare);
    qs.resize_with(io.num_kv_heads, Vec::new);
    for (h, q) in qs.iter_mut().enumerate() {
        q.resize(rows * d, 0.0);
        io.load_queries(it.t0..it.t1, h, q);
    }
    let sd = &io.batch.seqs[it.seq];
    io.limits(sd, it.t0..it.t1, lim);
    let kv = SeqKv { cache: io.cache, blocks: io.batch.blocks(it.seq, io.cache.block_size), head: 0 };
    if it.prefill {
        attend_prefill_heads(&mut states, &qs, lim, &kv, (it.k0, it.k1), io.params.softcap);
    } else {
        attend_spans_heads(&mut states, &qs, lim, &kv, &[(it.k0, it.k1)], io.params.softcap);
    }
    *qs_spare = qs;
    states
}

/// Runs items on the pool (None: on the calling thread), handing each finished set of per-head states to
/// `finish`.
fn run_items(io: &ForwardIo, items: &[Item], pool: Option<&SpinPool>, finish: impl Fn(&[RowsState], &Item, &mut Vec<f32>) + Sync) {
    let run = |it: &Item, lim: &mut Vec<RowLimits>, qs: &mut Vec<Vec<f32>>, row: &mut Vec<f32>| {
        let st = attend_item(io, it, lim, qs);
        finish(&st, it, row);
    };
    match pool {
        Some(pool) if items.len() > 1 && pool.threads() > 1 => {
            pool.run(items.len(), &|i| run(&items[i], &mut Vec::new(), &mut Vec::new(), &mut Vec::new()))
        }
        _ => {
            let (mut lim, mut qs, mut row) = (Vec::new(), Vec::new(), Vec::new());
            items.iter().for_each(|it| run(it, &mut lim, &mut qs, &mut row));
        }
    }
}
