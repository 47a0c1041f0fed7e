//! ART on the CUDA backend: the termination itself runs inside the tensor-core attention kernel, as its
//! traversal hook (kernels/policy/art/traversal.cuh in front of kernels/attention_mma.cu, parameters
//! [`ArtLaunch`]; src/cuda/traversal.rs is the host side of the hook), which also counts the blocks no
//! visited tile reached once a row's splits have all run; this stage reserves its priority order, probe
//! partials and arrival counters, and sorts a Quest plan by page score (kvs_art_priority,
//! kernels/policy/art/priority.cu). Visit records rebuild each row's visited spans from the tile counts,
//! in the kernel's order.

use crate::cuda::batch::{download_raw, Rows};
use crate::cuda::driver::{check, cuda};
use crate::cuda::kernel_src::{kernel_file, KernelFile};
use crate::cuda::launch::{self, KArgs, StructArg};
use crate::cuda::stage::{CallShape, CudaStage, RowVisits, StepCx, WsAlloc};
use crate::cuda::traversal::{HookKernel, HookSplits, TraversalLaunch};
use crate::error::Result;
use crate::policy::plan::{normalize_spans, HeadPlan};
use crate::policy::kind::SelectorKind;
use super::{Art, Order, Probe};
use crate::ensure;

/// ART's traversal hook, compiled in front of the attention kernel (`HOOK`).
pub const TRAVERSAL: KernelFile = kernel_file!("art_traversal.cuh", "policy/art/traversal.cuh");
/// ART's priority order (kvs_art_priority), compiled in the selection module (the registry's `SELECT_MODULE`).
pub const PRIORITY: KernelFile = kernel_file!("art.cu", "policy/art/priority.cu");

/// Threads of a kvs_art_priority CTA and the entries it ranks (kernels/policy/art/priority.cu
/// `ART_RANK_THREADS`, `ART_RANKS`: four lanes per entry).
const ART_RANK_THREADS: u32 = 256;
const ART_RANKS: usize = 64;

/// ART's hook: 4 warps (one round = one 64-slot tile, [`super::ART_TILE`]) of 3 stages; its static
/// shared memory (the probe's exchange, the decision's group summaries) within 4 KiB.
/// `KVS_ART_NOPROBE=1` (benchmarks only) compiles ART's launch without the detector (the same order and
/// splits), the baseline of the detector's cost.
pub(crate) const HOOK: HookKernel = HookKernel { name: "`art`", file: &TRAVERSAL, warps: 4, stages: 3, smem_reserve: 4096, bench_define: Some("ART_NOPROBE=1") };

/// ART's launch arguments (kernels/policy/art/traversal.cuh `ArtArgs`, the kernel's `TraversalArgs`; a test
/// compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ArtLaunch {
    pub tau: f32,
    pub phi: f32,
    /// -1 = never stop (`patience=inf`).
    pub patience: i32,
    pub sink_limit: i32,
    pub ctr: u64,
    pub tiles_out: u64,
    pub hk: i32,
    /// Keys per segment (`art(segment=...)`), 0 = one segment.
    pub segment: i32,
    /// Priority order (behind Quest): the plan's entries in visiting order and the inverse permutation,
    /// written by `kvs_art_priority`; 0 = recency order.
    pub order: u64,
    pub inv: u64,
    /// A row's split-parallel traversal (one segment over several splits): every round's probe partial
    /// `[seqs][kv_heads][tmax][48]` f32 (32 numerators, then 8 row sums and 8 running maxima) and the
    /// rows' arrival counters `[seqs][kv_heads]` (zero before the launch; the last split resets its own).
    pub probe: u64,
    pub arrive: u64,
    /// Tiles per row the probe region holds (>= the plan's capacity in 64-key tiles).
    pub tmax: i32,
    pub pad: i32,
}

/// The layout a test compares with kernels/policy/art/traversal.cuh.
#[cfg(test)]
pub(crate) fn c_layouts() -> Vec<crate::cuda::kernel_src::CLayout> {
    use crate::cuda::kernel_src::c_layout;
    vec![c_layout!(ArtLaunch as "ArtArgs" { tau, phi, patience, sink_limit, ctr, tiles_out, hk, segment, order, inv, probe, arrive, tmax, pad })]
}

/// ART's splits: one per segment of `segment` keys of the plan's capacity `keys` (`art(segment=...)`), or
/// one for the whole traversal; returns (splits, keys per split). Each split terminates on its own.
pub fn art_splits(keys: usize, segment: Option<u32>) -> (usize, usize) {
    match segment {
        Some(sg) if (sg as usize) < keys => (keys.div_ceil(sg as usize), sg as usize),
        _ => (1, keys.max(1)),
    }
}

/// Whether the CUDA backend runs `art` behind `selector` (and a pruning stage when `pruned`).
pub(crate) fn supported(a: &Art, selector: &dyn SelectorKind, pruned: bool) -> std::result::Result<(), String> {
    // In the kernel: recency order over `all` / `streaming` / `quest` plans, and Quest's priority order
    // (its page scores sorted on the device, kvs_art_priority), the paper's probe. Priority by SnapKV's
    // pooled scores or top-p's estimated mass is not built (those scores are not kept on the device).
    if !selector.device_terminable() || pruned {
        return Err("`art` on the CUDA backend runs behind `all`, `streaming` or `quest` only (ART behind `snapkv` or `top_p` needs their scores on the device, not built yet)".into());
    }
    if a.probe != Probe::Lanes {
        return Err("`art` on the CUDA backend supports probe=lanes only".into());
    }
    if a.order == Order::Priority && !selector.device_page_scores() {
        return Err("`art(order=priority)` on the CUDA backend needs a scored selector (quest)".into());
    }
    Ok(())
}

/// The positions below which ART's order puts a plan's entries first (the selector's sinks, as the CPU's
/// `prepare_head`): `streaming.sink` or `quest.sink`, else position 0.
pub(crate) fn sink_limit(selector: &dyn SelectorKind) -> i32 {
    selector.sink_positions().clamp(1, i32::MAX as usize) as i32
}

/// ART's stage for one call, and its workspace regions.
pub(crate) struct ArtStage {
    art: Art,
    sink_limit: i32,
    /// kvs_art_priority holds a row's keys (8 bytes per entry of the plan's capacity) in shared memory.
    keys: usize,
    /// Priority order (behind Quest): the ordered entries and their inverse, in the plan's layout.
    order: usize,
    inv: usize,
    /// The split-parallel traversal's probe partials (48 f32 per 64-key tile of a row's plan) and the
    /// rows' arrival counters ([`ArtLaunch`]).
    probe: usize,
    arrive: usize,
    tmax: usize,
}

impl ArtStage {
    pub(crate) fn new(art: Art, sink_limit: i32) -> Self {
        ArtStage { art, sink_limit, keys: 0, order: 0, inv: 0, probe: 0, arrive: 0, tmax: 0 }
    }

    fn priority(&self) -> bool {
        self.art.order == Order::Priority
    }

    /// Device addresses of the priority order and its inverse (0 = recency order).
    fn order_at(&self, ws: u64) -> (u64, u64) {
        if self.priority() {
            (ws + self.order as u64, ws + self.inv as u64)
        } else {
            (0, 0)
        }
    }
}

impl CudaStage for ArtStage {
    fn splits(&self, cx: &CallShape) -> Result<usize> {
        // Its splits follow from the plan's capacity.
        let n = art_splits(cx.fin.cap << cx.fin.ulog2, self.art.segment).0;
        ensure!(n < 65536, Unsupported, "`art(segment=...)` would split a row into {n} segments; at most 65535 (use a larger segment)");
        Ok(n)
    }

    fn reserve(&mut self, cx: &CallShape, ws: &mut WsAlloc) -> Result<()> {
        let fin = &cx.fin;
        self.keys = fin.cap;
        if self.priority() {
            ensure!(self.keys.saturating_mul(8).saturating_add(1024) <= cx.smem_optin, Unsupported, "`art(order=priority)` on the CUDA backend sorts a row's plan in shared memory: {} entries is more than this device holds (use a smaller budget or order=recent)", fin.cap);
            self.order = ws.take_n(&[cx.rows_of(fin), fin.cap, 4])?;
            self.inv = ws.take_n(&[cx.rows_of(fin), fin.cap, 4])?;
        }
        let rows = cx.geo.num_seqs * cx.cfg.num_kv_heads;
        if self.art.segment.is_none() {
            self.tmax = (fin.cap << fin.ulog2).div_ceil(super::ART_TILE).max(1);
            ensure!(self.tmax < i32::MAX as usize, Unsupported, "`art` plan too long for 32-bit tile indices");
            self.probe = ws.take_n(&[rows, self.tmax, 48, 4])?;
        }
        self.arrive = ws.take_n(&[rows, 4])?;
        Ok(())
    }

    fn select(&self, cx: &StepCx) -> Result<()> {
        let (rows, arrive) = (cx.geo.num_seqs * cx.cfg.num_kv_heads, cx.ws + self.arrive as u64);
        let sc = match cx.scores {
            Some(sc) if self.priority() => sc,
            _ => {
                // The splits' arrival counters start at zero (kvs_art_priority zeroes them when it runs).
                // SAFETY: a region of this call's workspace, `rows` counters.
                return unsafe { check((cuda()?.cuMemsetD32Async)(arrive, 0, rows, cx.a.stream), "cuMemsetD32Async") };
            }
        };
        let (hk, ns, base) = (cx.cfg.num_kv_heads, cx.geo.num_seqs, &cx.base);
        let f_ord = cx.function("kvs_art_priority")?;
        let smem = self.keys * 8;
        if smem > 48 * 1024 {
            cx.dev.allow_smem_once(f_ord, (cx.dev.gpu().smem_optin as usize).saturating_sub(1024))?;
        }
        let (order, inv) = self.order_at(cx.ws);
        let mut k = KArgs::new();
        k.by_value(&cx.batch).i32(hk as i32).i64(base.e as i64).i64(base.p_s).i64(base.p_h).i64(base.len as i64).i32(base.cap);
        k.i32(self.sink_limit).i32(sc.page as i32).i64(sc.at as i64).i32(sc.maxp as i32);
        k.i64(order as i64).i64(inv as i64).i64(arrive as i64);
        // Parts of a row's ranks (kernels/policy/art/priority.cu ART_RANKS entries each).
        let parts = self.keys.div_ceil(ART_RANKS).max(1);
        launch::launch_dependent(cx.pdl(), f_ord, (hk as u32, ns as u32, parts as u32), ART_RANK_THREADS, smem as u32, &mut k, cx.a.stream, "kvs_art_priority launch")
    }

    fn rows(&self, cx: &StepCx, _keys: usize) -> Option<Rows> {
        let (order, inv) = self.order_at(cx.ws);
        let args = ArtLaunch {
            tau: self.art.tau,
            phi: self.art.phi,
            patience: self.art.patience.map_or(-1, |v| v.min(i32::MAX as u32) as i32),
            sink_limit: self.sink_limit,
            ctr: cx.ctr as u64,
            tiles_out: cx.tiles,
            hk: cx.cfg.num_kv_heads as i32,
            segment: self.art.segment.map_or(0, |v| v.min(i32::MAX as u32) as i32),
            order,
            inv,
            probe: if self.art.segment.is_none() { cx.ws + self.probe as u64 } else { 0 },
            arrive: cx.ws + self.arrive as u64,
            tmax: self.tmax as i32,
            pad: 0,
        };
        // ART walks the plan in its segments (art_splits): the key bound is the plan's capacity.
        let keys = (cx.fin.cap as usize) << cx.fin.ulog2;
        // `art(segment=K)`: one split per segment. One segment (the paper's traversal): split like any plan,
        // each split a run of whole 64-key tiles; the row's last split decides over all (art_decide: its
        // shared memory holds 48 floats per split).
        let splits = if args.segment > 0 {
            let (n, chunk) = art_splits(keys, Some(args.segment as u32));
            HookSplits::Fixed(n, chunk)
        } else {
            HookSplits::Planned { smem_per_split: 48 * 4 }
        };
        let bench = std::env::var("KVS_ART_NOPROBE").is_ok_and(|v| v == "1");
        Some(Rows::Plan(cx.fin, keys, Some(TraversalLaunch { hook: HOOK, args: StructArg::of(&args), splits, bench })))
    }

    fn visits(&self, cx: &StepCx) -> Option<Box<dyn RowVisits>> {
        Some(Box::new(ArtVisits {
            tiles_at: cx.tiles,
            tiles: None,
            sink_limit: self.sink_limit as usize,
            nsplit: cx.nsplit,
            segment: self.art.segment,
            order: self.order_at(cx.ws).0,
            p_s: cx.fin.p_s,
            p_h: cx.fin.p_h,
            rows: cx.geo.num_seqs * cx.cfg.num_kv_heads,
            hk: cx.cfg.num_kv_heads,
        }))
    }
}

/// Where an ART call left its tile counts and order (read back for visit records only).
struct ArtVisits {
    tiles_at: u64,
    /// The tile counts `[seqs][kv_heads][nsplit]`, downloaded on first use.
    tiles: Option<Vec<i32>>,
    sink_limit: usize,
    nsplit: usize,
    segment: Option<u32>,
    /// The priority order (the plan's layout), 0 = recency.
    order: u64,
    p_s: i64,
    p_h: i64,
    rows: usize,
    hk: usize,
}

impl RowVisits for ArtVisits {
    fn spans(&mut self, s: usize, h: usize, entries: &[u32], ulog2: u32, lo: usize, hi: usize, spans: &mut Vec<(usize, usize)>) -> Result<(u32, u32)> {
        if self.tiles.is_none() {
            let mut raw = vec![0u8; self.rows * self.nsplit * 4];
            download_raw(self.tiles_at, &mut raw)?;
            self.tiles = Some(raw.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4"))).collect());
        }
        let t = self.tiles.as_ref().expect("downloaded above");
        let plan = HeadPlan { unit_log2: ulog2, entries: entries.to_vec() };
        let n = entries.len();
        // The kernel's order (priority: as kvs_art_priority wrote it; else recency) and tiles; each split
        // (segment) cut where it stopped.
        let mut order = Vec::new();
        if self.order != 0 {
            let mut raw = vec![0u8; n * 4];
            download_raw(self.order + ((s as i64 * self.p_s + h as i64 * self.p_h) * 4) as u64, &mut raw)?;
            order.extend(raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4"))));
        } else {
            super::order_entries(&plan, self.sink_limit, Order::Recent, |_| f32::NAN, &mut order);
        }
        let mut tiles = super::Tiles::default();
        tiles.build(&order, plan.unit_log2, lo, hi);
        let seg_tiles = self.segment.map_or(usize::MAX, |k| k as usize / super::ART_TILE);
        spans.clear();
        let mut visited = 0usize;
        let nsplit = self.nsplit;
        for k in 0..nsplit {
            let t0 = k.saturating_mul(seg_tiles).min(tiles.len());
            let t1 = t0.saturating_add(t[(s * self.hk + h) * nsplit + k].max(0) as usize).min(tiles.len()).min(t0.saturating_add(seg_tiles));
            spans.extend_from_slice(&tiles.spans[tiles.bounds[t0]..tiles.bounds[t1]]);
            visited += t1 - t0;
        }
        normalize_spans(spans);
        Ok((visited as u32, tiles.len() as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::{ART_RANKS, ART_RANK_THREADS};

    #[test]
    fn rank_launch_mirrors_the_priority_kernel() {
        let src = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/policy/art/priority.cu"));
        assert!(src.contains(&format!("#define ART_RANK_THREADS {ART_RANK_THREADS}\n")), "priority.cu ART_RANK_THREADS");
        let split = ART_RANK_THREADS as usize / ART_RANKS;
        assert!(src.contains(&format!("#define ART_RANK_SPLIT {split}\n")), "priority.cu ART_RANK_SPLIT");
    }
}
