//! The sparse contract a serving engine needs from a policy backend, checked from the outside (outputs,
//! counters and the cache memory only), so the same checks run on the in-process CPU engine, through a
//! library's C ABI (`--lib`) and on the CUDA engine:
//!
//! * **full budget equals dense, bit for bit in f32**: a policy whose budget covers everything returns the
//!   dense engine's bytes;
//! * **unselected pages may hold NaN**: which (block, KV head) pages a batch reads is found by poisoning each
//!   one alone with NaN (bypassing the engine, so its metadata still describes the real rows) and seeing
//!   which rows' outputs change; the per-row counts must equal the `blocks_visited` counter, something must
//!   have been skipped, and with every unread page NaN at once the output must be bit-identical;
//! * **a reused block's metadata is reset**: a sequence reusing blocks of a released one (whose loud stale
//!   rows remain in the tails) gets the bytes a fresh engine gives on the same memory; an engine whose
//!   metadata is left stale on purpose must differ (so the check can fail);
//! * **selections are per KV head**: with different hot pages per KV head, each head reads its own.

use super::fixture::Rows;
use super::hostbuf::HostBuf;
use super::Api;
use kvsparse::config::EngineConfig;
use kvsparse::engine::{CacheWriteArgs, Engine, ForwardArgs};
use kvsparse::error::{ErrorKind, Result};
use kvsparse::rng::Rng;
use kvsparse::stats::Counters;
use kvsparse::tensor::{DType, TensorRef};

/// Geometry of a contract case's single-layer engine; the cache is `[2][num_blocks][block_size][kv_heads][dim]`.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: DType,
}

impl Geometry {
    pub fn config(&self, policy: &str) -> EngineConfig {
        let mut c = EngineConfig::new(1, self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size, self.dtype);
        c.policy = if policy.is_empty() { String::new() } else { format!("{policy}; dense_layers=0") };
        // One worker: with several, the CPU's dense path splits a short batch's keys among threads (split-KV)
        // while a policy row is attended whole, and "full budget equals dense bit for bit" compares sums in
        // two orders (seen on a 16-core machine).
        c.num_threads = 1;
        c
    }
    /// Elements of one cache (K or V).
    pub fn cache_len(&self) -> usize {
        self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim
    }
    pub fn cache_shape(&self) -> [i64; 4] {
        [self.num_blocks as i64, self.block_size as i64, self.num_kv_heads as i64, self.head_dim as i64]
    }
    /// Element index of (block, offset, head, 0) in one cache.
    fn at(&self, block: usize, offset: usize, head: usize) -> usize {
        ((block * self.block_size + offset) * self.num_kv_heads + head) * self.head_dim
    }
}

/// One forward call's batch (host tensors).
#[derive(Clone)]
pub struct Batch {
    /// `[tokens, q_heads, dim]`, compact.
    pub query: HostBuf,
    pub table: Vec<i32>,
    pub max_blocks: usize,
    pub seq_lens: Vec<i32>,
    pub qsl: Vec<i32>,
    pub seq_ids: Vec<i64>,
}

impl Batch {
    pub fn num_tokens(&self) -> usize {
        *self.qsl.last().unwrap_or(&0) as usize
    }
    /// Host views of the batch (the caller passes them on or copies them to a device).
    pub fn args(&mut self, g: &Geometry, caches: (TensorRef, TensorRef), out: TensorRef) -> ForwardArgs {
        let n = self.seq_lens.len() as i64;
        let t = self.num_tokens() as i64;
        let lens = || self.seq_lens.iter().zip(self.qsl.windows(2));
        ForwardArgs {
            layer: 0,
            query: self.query.view_contiguous(&[t, g.num_q_heads as i64, g.head_dim as i64]),
            key_cache: caches.0,
            value_cache: caches.1,
            block_table: TensorRef::from_slice(&self.table, &[n, self.max_blocks as i64]),
            seq_lens: TensorRef::from_slice(&self.seq_lens, &[n]),
            query_start_loc: TensorRef::from_slice(&self.qsl, &[n + 1]),
            seq_ids: Some(TensorRef::from_slice(&self.seq_ids, &[n])),
            out,
            lse: None,
            scale: 1.0 / (g.head_dim as f32).sqrt(),
            sliding_window: 0,
            softcap: 0.0,
            max_query_len: lens().map(|(_, w)| w[1] - w[0]).max().unwrap_or(0),
            max_seq_len: lens().map(|(&l, _)| l).max().unwrap_or(0),
            stream: std::ptr::null_mut(),
        }
    }
}

/// One engine plus the cache it serves, wherever they live. Everything the checks need: cache writes
/// through the engine, raw access to the cache memory (to poison or to copy it), forward calls, release.
pub trait Session {
    fn geometry(&self) -> Geometry;
    /// Writes rows through the engine's `cache_write` (metadata maintained).
    fn write(&mut self, rows: &mut Rows) -> Result<()>;
    /// A host copy of the combined cache storage (`2 * cache_len` elements).
    fn cache(&mut self) -> Result<HostBuf>;
    /// Overwrites the cache memory directly, behind the engine's back.
    fn set_cache(&mut self, c: &HostBuf) -> Result<()>;
    /// One forward call; the output as f64 `[tokens][q_heads][dim]` and the call's counters.
    fn forward(&mut self, b: &mut Batch) -> Result<(Vec<f64>, Counters)>;
    fn release(&mut self, seq_id: u64) -> Result<()>;
}

/// Opens a session for (geometry, policy spec); `""` is dense.
pub type Opener<'a> = dyn FnMut(&Geometry, &str) -> Result<Box<dyn Session + 'a>> + 'a;

/// A session whose cache lives in host memory and whose engine is anything with the suite's [`Api`].
pub struct HostSession<E: Api> {
    engine: E,
    geo: Geometry,
    cache: HostBuf,
}

impl<E: Api> HostSession<E> {
    pub fn new(engine: E, geo: &Geometry) -> Self {
        HostSession { engine, geo: *geo, cache: HostBuf::nans(geo.dtype, 2 * geo.cache_len()) }
    }
    fn caches(&mut self) -> (TensorRef, TensorRef) {
        let (shape, n) = (self.geo.cache_shape(), self.geo.cache_len());
        let st = compact_strides(&shape);
        (self.cache.view(0, &shape, &st), self.cache.view(n, &shape, &st))
    }
}

fn compact_strides(shape: &[i64; 4]) -> [i64; 4] {
    [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1]
}

/// The `CacheWriteArgs` for `rows` into `caches`.
pub fn write_args(g: &Geometry, rows: &mut Rows, caches: (TensorRef, TensorRef)) -> CacheWriteArgs {
    let (n, hk, d) = (rows.slots.len() as i64, g.num_kv_heads as i64, g.head_dim as i64);
    CacheWriteArgs {
        layer: 0,
        key: rows.k.view_contiguous(&[n, hk, d]),
        value: rows.v.view_contiguous(&[n, hk, d]),
        key_cache: caches.0,
        value_cache: caches.1,
        slot_mapping: TensorRef::from_slice(&rows.slots, &[n]),
        stream: std::ptr::null_mut(),
    }
}

impl<E: Api> Session for HostSession<E> {
    fn geometry(&self) -> Geometry {
        self.geo
    }
    fn write(&mut self, rows: &mut Rows) -> Result<()> {
        let caches = self.caches();
        let geo = self.geo;
        self.engine.cache_write(&write_args(&geo, rows, caches))
    }
    fn cache(&mut self) -> Result<HostBuf> {
        Ok(self.cache.clone())
    }
    fn set_cache(&mut self, c: &HostBuf) -> Result<()> {
        self.cache = c.clone();
        Ok(())
    }
    fn forward(&mut self, b: &mut Batch) -> Result<(Vec<f64>, Counters)> {
        let g = self.geo;
        let t = b.num_tokens();
        let mut out = HostBuf::nans(g.dtype, t * g.num_q_heads * g.head_dim);
        let caches = self.caches();
        let ov = out.view_contiguous(&[t as i64, g.num_q_heads as i64, g.head_dim as i64]);
        let c = self.engine.attention_forward(&b.args(&g, caches, ov))?;
        Ok(((0..out.len()).map(|i| out.get(i)).collect(), c))
    }
    fn release(&mut self, seq_id: u64) -> Result<()> {
        self.engine.release_sequence(seq_id)
    }
}

/// A session on kvsparse's in-process CPU engine.
pub fn cpu_session(g: &Geometry, policy: &str) -> Result<Box<dyn Session>> {
    Ok(Box::new(HostSession::new(Engine::new(g.config(policy))?, g)))
}

/// A session on a library loaded with `--lib` (host memory, through its C ABI).
pub fn lib_session<'a>(lib: &'a super::dylib::Lib, g: &Geometry, policy: &str) -> Result<Box<dyn Session + 'a>> {
    Ok(Box::new(HostSession::new(super::dylib::LibEngine::create(lib, &g.config(policy))?, g)))
}

/// Outcome of one contract check.
#[derive(Clone, Debug)]
pub struct ContractResult {
    pub name: String,
    pub pass: bool,
    pub unsupported: bool,
    /// A listed, explained deviation that occurred as listed (not counted as a failure).
    pub known: bool,
    pub detail: String,
}

impl ContractResult {
    pub fn verdict(&self) -> String {
        match (self.pass, self.unsupported, self.known) {
            (true, ..) => format!("pass  {}", self.detail),
            (false, true, _) => format!("unsupported: {}", self.detail),
            (false, false, true) => format!("known deviation: {}", self.detail),
            (false, false, false) => format!("FAIL {}", self.detail),
        }
    }
    /// A failure that counts: neither unsupported nor a listed deviation.
    pub fn failed(&self) -> bool {
        !self.pass && !self.unsupported && !self.known
    }
}

type CheckFn = fn(&mut Opener, &str, u64) -> Result<std::result::Result<String, String>>;

/// One named check of the contract: a function of (opener, policy spec, seed) that returns
/// `Ok(Ok(detail))` for a pass and `Ok(Err(why))` for a failure; an `Err` is an engine error.
pub struct Check {
    pub name: String,
    policy: String,
    seed: u64,
    f: CheckFn,
    /// Why this check is known to fail on kvsparse today. Strict: if it passes, that is a failure too
    /// (the list must be updated), so the list cannot go stale.
    known: Option<&'static str>,
}

impl Check {
    pub fn run(&self, open: &mut Opener) -> ContractResult {
        let r = (self.f)(open, &self.policy, self.seed);
        let (mut pass, unsupported, mut known, mut detail) = match r {
            Ok(Ok(d)) => (true, false, false, d),
            Ok(Err(why)) => (false, false, self.known.is_some(), format!("{why} (seed {})", self.seed)),
            Err(e) if e.kind == ErrorKind::Unsupported => (false, true, false, e.message),
            Err(e) => (false, false, false, e.to_string()),
        };
        if let Some(reason) = self.known {
            if pass {
                (pass, detail) = (false, format!("listed as a known deviation ({reason}) but passed: update sparse::checks; {detail}"));
            } else if known {
                detail = format!("{reason}; {detail}");
            }
        }
        known &= !pass;
        ContractResult { name: self.name.clone(), pass, unsupported, known, detail }
    }
}

/// ART accumulates its units in its visiting order (sinks, the newest unit, then newest first or by
/// priority), dense in position order: the same sum rounded in another order, ~1 ulp apart.
const ART_ORDER: &str = "ours: ART's online softmax adds units in visiting order (newest first), dense in position order, so the f32 sums round differently";

/// Every check, with the seed each draws its data from.
pub fn checks(seed: u64) -> Vec<Check> {
    let mut v = Vec::new();
    let mut add = |name: String, policy: &str, f: CheckFn, known: Option<&'static str>| {
        let s = seed.wrapping_add(v.len() as u64);
        v.push(Check { name, policy: policy.to_string(), seed: s, f, known });
    };
    for p in [
        "quest(budget=100000)",
        "quest(budget=100000, page=4)",
        "streaming(sink=4, recent=100000)",
        "snapkv(budget=100000)",
        "top_p(p=1)",
        "art(patience=inf)",
        "art(patience=inf, order=priority, probe=full)",
        "quest(budget=100000) > top_p(p=1) > art(patience=inf)",
    ] {
        add(format!("full-budget-equals-dense-f32 {p}"), p, full_budget_equals_dense, p.contains("art(").then_some(ART_ORDER));
    }
    for p in ["quest(budget=128)", "streaming(sink=16, recent=100)", "quest(budget=256) > top_p(p=0.9)", "quest(budget=256) > art(tau=1e-3, phi=1e-2, patience=2)"] {
        add(format!("unselected-pages-nan-f32 {p}"), p, unselected_pages_may_hold_nan, None);
    }
    add("unselected-pages-nan-bf16 quest(budget=128)".into(), "quest(budget=128)", unselected_pages_may_hold_nan_bf16, None);
    add("reused-block-metadata-reset quest(budget=64)".into(), "quest(budget=64)", reused_block_metadata_is_reset, None);
    add("per-kv-head-selection quest(budget=48)".into(), "quest(budget=48)", per_kv_head_selection, None);
    v
}

// ---------------------------------------------------------------------------------------------------
// Scenario data.

const BS: usize = 16;

fn geometry(dtype: DType, num_blocks: usize) -> Geometry {
    Geometry { num_q_heads: 8, num_kv_heads: 2, head_dim: 64, block_size: BS, num_blocks, dtype }
}

/// Logit of a hot key (queries are `√d·dir`, the scale `1/√d`, hot keys `HOT·dir`).
const HOT: f64 = 8.0;

/// A batch of sequences (q_len, seq_len) with per-(sequence, KV head) "hot" logical pages whose keys
/// point along that head's query direction (logit ≈ HOT) while the rest are background (logit ≈ N(0, 0.5²)).
/// Blocks are assigned in random order from `blocks` (or fresh ids); sequences after the first with a
/// long enough cached part share its first `shared` blocks.
struct Scenario {
    rows: Rows,
    batch: Batch,
    /// Direction of (sequence, KV head), unit vectors.
    dirs: Vec<Vec<f64>>,
}

struct ScenarioSpec<'a> {
    seqs: &'a [(usize, usize)],
    hot: &'a dyn Fn(usize, usize) -> Vec<usize>,
    shared: usize,
    ids: Vec<usize>,
    seq_id_base: i64,
}

fn unit(rng: &mut Rng, d: usize) -> Vec<f64> {
    let v: Vec<f64> = (0..d).map(|_| rng.normal()).collect();
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.into_iter().map(|x| x / n).collect()
}

fn scenario(g: &Geometry, s: &ScenarioSpec, rng: &mut Rng) -> Scenario {
    let (hq, hk, d) = (g.num_q_heads, g.num_kv_heads, g.head_dim);
    let grp = hq / hk;
    let nseq = s.seqs.len();
    let max_blocks = s.seqs.iter().map(|&(_, l)| l.div_ceil(BS)).max().unwrap_or(1) + 1;
    let mut table = vec![-1i32; nseq * max_blocks];
    let mut next = 0;
    let sqrt_d = (d as f64).sqrt();
    let dirs: Vec<Vec<f64>> = (0..nseq * hk).map(|_| unit(rng, d)).collect();
    let total: usize = s.seqs.iter().map(|&(_, l)| l).sum();
    let (mut k, mut v) = (HostBuf::zeros(g.dtype, total * hk * d), HostBuf::zeros(g.dtype, total * hk * d));
    let mut slots = Vec::new();
    let ntok: usize = s.seqs.iter().map(|&(q, _)| q).sum();
    let mut query = HostBuf::zeros(g.dtype, ntok * hq * d);
    let mut qsl = vec![0i32];
    for (si, &(q_len, seq_len)) in s.seqs.iter().enumerate() {
        let shares = si > 0 && s.shared > 0 && seq_len - q_len >= s.shared * BS && s.seqs[0].1 - s.seqs[0].0 >= s.shared * BS;
        for j in 0..seq_len.div_ceil(BS) {
            table[si * max_blocks + j] = if shares && j < s.shared {
                table[j]
            } else {
                next += 1;
                s.ids[next - 1] as i32
            };
        }
        let hot: Vec<Vec<usize>> = (0..hk).map(|h| (s.hot)(si, h)).collect();
        for j in 0..seq_len {
            if shares && j < s.shared * BS {
                continue; // written once, by sequence 0
            }
            let r = slots.len();
            slots.push(table[si * max_blocks + j / BS] as i64 * BS as i64 + (j % BS) as i64);
            for h in 0..hk {
                let a = if hot[h].contains(&(j / BS)) { HOT } else { 0.0 };
                for i in 0..d {
                    let dir = dirs[si * hk + h][i];
                    k.set((r * hk + h) * d + i, a * dir + rng.normal() * 0.5);
                    v.set((r * hk + h) * d + i, rng.normal());
                }
            }
        }
        let t0 = *qsl.last().unwrap() as usize;
        for t in 0..q_len {
            for h in 0..hq {
                for i in 0..d {
                    query.set(((t0 + t) * hq + h) * d + i, dirs[si * hk + h / grp][i] * sqrt_d + rng.normal() * 0.2);
                }
            }
        }
        qsl.push((t0 + q_len) as i32);
    }
    // Unused columns hold stale ids, as a persistent table does.
    for (si, &(_, l)) in s.seqs.iter().enumerate() {
        for j in l.div_ceil(BS)..max_blocks {
            table[si * max_blocks + j] = rng.below(g.num_blocks) as i32;
        }
    }
    let n = slots.len();
    let rows = Rows { k: truncate(&k, n * hk * d), v: truncate(&v, n * hk * d), slots };
    let batch = Batch {
        query,
        table,
        max_blocks,
        seq_lens: s.seqs.iter().map(|&(_, l)| l as i32).collect(),
        qsl,
        seq_ids: (0..nseq as i64).map(|i| s.seq_id_base + i).collect(),
    };
    Scenario { rows, batch, dirs }
}

fn truncate(b: &HostBuf, n: usize) -> HostBuf {
    let mut o = HostBuf::zeros(b.dtype(), n);
    for i in 0..n {
        o.set(i, b.get(i));
    }
    o
}

fn shuffled_ids(n: usize, rng: &mut Rng) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut ids);
    ids
}

/// The standard mixed batch: three decode rows (the second and third share a 4-block prefix with the
/// first) and a chunked-prefill row, which always runs dense.
const MIXED: [(usize, usize); 4] = [(1, 1000), (1, 700), (8, 200), (1, 333)];

fn mixed(g_dtype: DType, rng: &mut Rng) -> (Geometry, Scenario) {
    let g = geometry(g_dtype, 160);
    let hot = |s: usize, h: usize| vec![3 + 5 * s + 7 * h, 9 + 3 * s + 2 * h];
    let spec = ScenarioSpec { seqs: &MIXED, hot: &hot, shared: 4, ids: shuffled_ids(160, rng), seq_id_base: 100 };
    let sc = scenario(&g, &spec, rng);
    (g, sc)
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn first_difference(a: &[f64], b: &[f64]) -> Option<(usize, f64, f64)> {
    a.iter().zip(b).enumerate().find(|(_, (x, y))| x.to_bits() != y.to_bits()).map(|(i, (x, y))| (i, *x, *y))
}

// ---------------------------------------------------------------------------------------------------
// The checks.

fn full_budget_equals_dense(open: &mut Opener, policy: &str, seed: u64) -> Result<std::result::Result<String, String>> {
    let mut rng = Rng::new(seed);
    let (g, mut sc) = mixed(DType::F32, &mut rng);
    let mut outs = Vec::new();
    for p in ["", policy] {
        let mut s = open(&g, p)?;
        s.write(&mut sc.rows)?;
        outs.push(s.forward(&mut sc.batch)?);
    }
    let (dense, (sparse, c)) = (&outs[0].0, &outs[1]);
    if c.policy_rows == 0 {
        return Ok(Err("no decode row went through the policy".into()));
    }
    Ok(match first_difference(sparse, dense) {
        None => Ok(format!("{} values identical; {} policy rows, visited {}/{} blocks", dense.len(), c.policy_rows, c.blocks_visited, c.blocks_eligible)),
        Some((i, x, y)) => Err(format!("element {i}: {x:e} vs dense {y:e}")),
    })
}

/// (row, KV head) pairs whose output changes when `pairs` of (block, KV head) are NaN.
struct Probe<'s, 'a> {
    s: &'s mut Box<dyn Session + 'a>,
    clean: HostBuf,
    base: Vec<f64>,
    g: Geometry,
}

impl Probe<'_, '_> {
    fn poisoned(&self, pairs: &[(usize, usize)]) -> HostBuf {
        let mut c = self.clean.clone();
        let n = self.g.cache_len();
        for &(b, h) in pairs {
            for o in 0..self.g.block_size {
                let at = self.g.at(b, o, h);
                for i in 0..self.g.head_dim {
                    c.set(at + i, f64::NAN);
                    c.set(n + at + i, f64::NAN);
                }
            }
        }
        c
    }
    /// Runs with `pairs` poisoned; returns the output and restores the clean cache.
    fn run(&mut self, b: &mut Batch, pairs: &[(usize, usize)]) -> Result<Vec<f64>> {
        self.s.set_cache(&self.poisoned(pairs))?;
        let r = self.s.forward(b);
        self.s.set_cache(&self.clean)?;
        Ok(r?.0)
    }
    /// Which (token row, KV head) outputs differ from the baseline.
    fn changed(&self, out: &[f64], b: &Batch) -> Vec<(usize, usize)> {
        let (hq, hk, d) = (self.g.num_q_heads, self.g.num_kv_heads, self.g.head_dim);
        let grp = hq / hk;
        let mut v = Vec::new();
        for t in 0..b.num_tokens() {
            for kh in 0..hk {
                let r = (t * hq + kh * grp) * d..(t * hq + (kh + 1) * grp) * d;
                if bits(&out[r.clone()]) != bits(&self.base[r]) {
                    v.push((t, kh));
                }
            }
        }
        v
    }
}

/// The (block, KV head) pages each (token row, KV head) reads, found by poisoning one page at a time.
fn read_sets(p: &mut Probe, b: &mut Batch) -> Result<std::collections::BTreeMap<(usize, usize), Vec<usize>>> {
    let mut blocks: Vec<usize> = Vec::new();
    for (s, &l) in b.seq_lens.iter().enumerate() {
        blocks.extend(b.table[s * b.max_blocks..s * b.max_blocks + (l as usize).div_ceil(p.g.block_size)].iter().map(|&x| x as usize));
    }
    blocks.sort_unstable();
    blocks.dedup();
    let mut sets: std::collections::BTreeMap<(usize, usize), Vec<usize>> = Default::default();
    for &blk in &blocks {
        for h in 0..p.g.num_kv_heads {
            let out = p.run(b, &[(blk, h)])?;
            for key in p.changed(&out, b) {
                sets.entry(key).or_default().push(blk);
            }
        }
    }
    Ok(sets)
}

fn decode_rows(b: &Batch) -> Vec<(usize, usize)> {
    // (token row, sequence) of every decode row
    b.qsl.windows(2).enumerate().filter(|(_, w)| w[1] - w[0] == 1).map(|(s, w)| (w[0] as usize, s)).collect()
}

fn nan_check(open: &mut Opener, policy: &str, seed: u64, dtype: DType) -> Result<std::result::Result<String, String>> {
    let mut rng = Rng::new(seed);
    let (g, mut sc) = mixed(dtype, &mut rng);
    let mut s = open(&g, policy)?;
    s.write(&mut sc.rows)?;
    let (base, c) = s.forward(&mut sc.batch)?;
    if base.iter().any(|x| x.is_nan()) {
        return Ok(Err("NaN in the output before any poisoning".into()));
    }
    let clean = s.cache()?;
    let mut p = Probe { s: &mut s, clean, base, g };
    let sets = read_sets(&mut p, &mut sc.batch)?;
    // Per decode row and KV head, the pages read must be what the counters say was visited.
    let decode: Vec<usize> = decode_rows(&sc.batch).into_iter().map(|(t, _)| t).collect();
    let read_by_decode: usize = sets.iter().filter(|((t, _), _)| decode.contains(t)).map(|(_, v)| v.len()).sum();
    if read_by_decode as u64 != c.blocks_visited {
        return Ok(Err(format!("decode rows read {read_by_decode} (block, head) pages by probing, counters say {} visited", c.blocks_visited)));
    }
    if c.blocks_visited >= c.blocks_eligible {
        return Ok(Err(format!("nothing skipped ({}/{} visited): the check would be vacuous", c.blocks_visited, c.blocks_eligible)));
    }
    // Every page no row reads, NaN at once.
    let read: std::collections::BTreeSet<(usize, usize)> = sets.iter().flat_map(|(&(_, h), v)| v.iter().map(move |&b| (b, h))).collect();
    let all: Vec<(usize, usize)> = (0..g.num_blocks).flat_map(|b| (0..g.num_kv_heads).map(move |h| (b, h))).filter(|x| !read.contains(x)).collect();
    let out = p.run(&mut sc.batch, &all)?;
    Ok(match first_difference(&out, &p.base) {
        None => Ok(format!("{} of {} pages NaN, output identical; decode rows read {}/{} blocks (= counters)", all.len(), g.num_blocks * g.num_kv_heads, c.blocks_visited, c.blocks_eligible)),
        Some((i, x, y)) => Err(format!("with unread pages NaN, element {i} is {x:e}, was {y:e}")),
    })
}

fn unselected_pages_may_hold_nan(open: &mut Opener, policy: &str, seed: u64) -> Result<std::result::Result<String, String>> {
    nan_check(open, policy, seed, DType::F32)
}

fn unselected_pages_may_hold_nan_bf16(open: &mut Opener, policy: &str, seed: u64) -> Result<std::result::Result<String, String>> {
    nan_check(open, policy, seed, DType::BF16)
}

/// Life 1: a sequence fills 40 blocks, its keys loud along the direction life 2's queries will have;
/// it decodes once and is released. Life 2: a shorter sequence reuses 20 of those blocks (its last one
/// partly, so life 1's loud rows stay in the tail) with quiet keys and hot pages elsewhere.
fn reused_block_metadata_is_reset(open: &mut Opener, policy: &str, seed: u64) -> Result<std::result::Result<String, String>> {
    let mut rng = Rng::new(seed);
    let g = geometry(DType::F32, 48);
    let ids = shuffled_ids(48, &mut rng);
    let hot2 = |_: usize, h: usize| vec![4 + 6 * h, 11 - 3 * h];
    let life2 = ScenarioSpec { seqs: &[(1, 19 * BS + 5)], hot: &hot2, shared: 0, ids: ids[8..28].to_vec(), seq_id_base: 2 };
    let mut sc2 = scenario(&g, &life2, &mut rng);
    // Life 1 occupies ids[0..40] (a superset of life 2's blocks), every key loud along life 2's directions.
    let none = |_: usize, _: usize| Vec::new();
    let life1 = ScenarioSpec { seqs: &[(1, 40 * BS)], hot: &none, shared: 0, ids: ids[..40].to_vec(), seq_id_base: 1 };
    let mut sc1 = scenario(&g, &life1, &mut rng);
    let (hk, d) = (g.num_kv_heads, g.head_dim);
    for r in 0..sc1.rows.slots.len() {
        for h in 0..hk {
            for i in 0..d {
                let x = sc1.rows.k.get((r * hk + h) * d + i) + 1.5 * HOT * sc2.dirs[h][i];
                sc1.rows.k.set((r * hk + h) * d + i, x);
            }
        }
    }
    // The engine under test: life 1, decode, release, life 2, decode.
    let mut s = open(&g, policy)?;
    s.write(&mut sc1.rows)?;
    s.forward(&mut sc1.batch)?;
    s.release(1)?;
    s.write(&mut sc2.rows)?;
    let (reused, c_reused) = s.forward(&mut sc2.batch)?;
    let memory = s.cache()?;
    // A fresh engine on the same memory (stale tails included) that only ever saw life 2's writes.
    let mut f = open(&g, policy)?;
    f.set_cache(&memory)?;
    f.write(&mut sc2.rows)?;
    let (fresh, c_fresh) = f.forward(&mut sc2.batch)?;
    // Control: an engine whose metadata describes life 1 (life 2 written behind its back) must differ.
    let mut stale = open(&g, policy)?;
    stale.write(&mut sc1.rows)?;
    stale.set_cache(&memory)?;
    let (stale_out, _) = stale.forward(&mut sc2.batch)?;
    if first_difference(&stale_out, &fresh).is_none() {
        return Ok(Err("control failed: stale metadata gives the same output, so this scenario cannot detect it".into()));
    }
    Ok(match (first_difference(&reused, &fresh), c_reused.blocks_visited == c_fresh.blocks_visited) {
        (None, true) => Ok(format!("identical to a fresh engine (visited {}/{}); stale-metadata control differs", c_reused.blocks_visited, c_reused.blocks_eligible)),
        (None, false) => Err(format!("same output but visited {} blocks, fresh engine {}", c_reused.blocks_visited, c_fresh.blocks_visited)),
        (Some((i, x, y)), _) => Err(format!("element {i}: {x:e} after reuse, {y:e} on a fresh engine")),
    })
}

/// Two decode rows whose KV heads have disjoint hot pages; with a budget of exactly the row's own page and
/// the two hot ones, each head must read its own hot pages and not the other head's.
fn per_kv_head_selection(open: &mut Opener, policy: &str, seed: u64) -> Result<std::result::Result<String, String>> {
    let mut rng = Rng::new(seed);
    let g = geometry(DType::F32, 96);
    let hot = |s: usize, h: usize| if h == 0 { vec![2 + s, 20] } else { vec![9 + s, 30] };
    let spec = ScenarioSpec { seqs: &[(1, 40 * BS + 3), (1, 35 * BS)], hot: &hot, shared: 0, ids: shuffled_ids(96, &mut rng), seq_id_base: 10 };
    let mut sc = scenario(&g, &spec, &mut rng);
    let mut s = open(&g, policy)?;
    s.write(&mut sc.rows)?;
    let (base, _) = s.forward(&mut sc.batch)?;
    let clean = s.cache()?;
    let mut p = Probe { s: &mut s, clean, base, g };
    let sets = read_sets(&mut p, &mut sc.batch)?;
    let mut lines = Vec::new();
    for (t, si) in decode_rows(&sc.batch) {
        let row = &sc.batch.table[si * sc.batch.max_blocks..];
        let got: Vec<Vec<usize>> = (0..g.num_kv_heads).map(|h| sets.get(&(t, h)).cloned().unwrap_or_default()).collect();
        if got[0] == got[1] {
            return Ok(Err(format!("sequence {si}: both KV heads read the same pages {:?}", got[0])));
        }
        for h in 0..g.num_kv_heads {
            for page in hot(si, h) {
                if !got[h].contains(&(row[page] as usize)) {
                    return Ok(Err(format!("sequence {si} KV head {h} did not read its hot page {page} (read {:?})", got[h])));
                }
            }
            for page in hot(si, 1 - h) {
                if got[h].contains(&(row[page] as usize)) {
                    return Ok(Err(format!("sequence {si} KV head {h} read the other head's hot page {page}")));
                }
            }
        }
        lines.push(format!("seq {si}: {}/{} pages", got[0].len(), got[1].len()));
    }
    Ok(Ok(format!("each head reads its own hot pages ({})", lines.join(", "))))
}
