//! The device half of a policy: what the CUDA backend's policy pipeline (src/cuda/sparse.rs) asks of a
//! stage, and what it offers the stage's code in return. Each policy implements [`CudaStage`] (and, when
//! it keeps device state for the engine's life, [`PolicyDevice`]) in `src/policy/<name>/cuda.rs`; the
//! registry (src/policy/registry.rs) is the one place that picks the implementation, so nothing here or in
//! sparse.rs names a policy. The backend implements [`Device`]. This file imports no policy code and not
//! the backend, so the policies' device code builds on it without an import circle.

use std::any::Any;

use parking_lot::Mutex;

use super::batch::{BatchArg, Geometry, PlanRef, Rows};
use super::context::{DevBuf, Gpu};
use super::driver::{CUfunction, CUstream};
use super::kernel_src::Module;
use super::launch::Modules;
use super::meta::{DeviceMeta, LayerDevMeta};
use super::slots::SeqSlots;
use crate::args::ForwardArgs;
use crate::config::EngineConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::KvCache;
use crate::policy::kind::PipelineKind;
use crate::stats::Counters;
use crate::tensor::TensorRef;

/// What a policy's device code may use of the backend it runs in (the CUDA backend implements it).
pub(crate) trait Device: Sync {
    fn gpu(&self) -> &Gpu;
    fn modules(&self) -> &Modules;
    /// The key metadata the cache writes keep.
    fn meta(&self) -> &DeviceMeta;
    /// The per-sequence state slot map, for policies that keep such state.
    fn slots(&self) -> Option<&SeqSlots>;
    /// Buffers replaced by larger ones, kept until the engine is destroyed (graphs captured before may
    /// still use them).
    fn retired(&self) -> &Mutex<Vec<DevBuf>>;
    /// Raises `f`'s dynamic shared-memory limit to `bytes`, once per function.
    fn allow_smem_once(&self, f: CUfunction, bytes: usize) -> Result<()>;
    /// One attention launch (plus its split combine) over the rows `rows` selects.
    fn attend(&self, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry, rows: Rows) -> Result<()>;
    /// Whether the tensor-core attention kernel serves these caches (ART's 4-warp launch aside).
    fn tensor_cores(&self, cfg: &EngineConfig, cache: &KvCache) -> bool;
    /// The device address of `layer`'s counters (kernels/include/decide.cuh CTR_*).
    fn layer_counters(&self, layer: usize) -> u64;
    /// Records where a call that ran its own rows left its final plans (for visit records).
    fn set_last_plan(&self, plan: PlanRef, num_seqs: usize);
    /// Whether a policy layer's kernels launch as programmatic dependents on this GPU
    /// (`launch::launch_dependent`; each such kernel starts with `KVS_GRID_WAIT()`).
    fn pdl(&self) -> bool {
        super::launch::pdl_enabled(self.gpu().cc.0)
    }
}

/// A policy's device state, kept for the engine's life (made by the registry when the backend is made).
pub(crate) trait PolicyDevice: Send + Sync {
    /// After a cache write's slots were stored (PRR resets the entries of the pages a write starts).
    #[allow(clippy::too_many_arguments)]
    fn on_cache_write(&self, _dev: &dyn Device, _cfg: &EngineConfig, _layer: usize, _cache: &KvCache, _slots: &TensorRef, _n: usize, _stream: CUstream) -> Result<()> {
        Ok(())
    }

    /// Adds the counters the policy keeps itself to the engine's per-layer counters (the caller
    /// synchronized the device).
    fn add_counters(&self, _gpu: &Gpu, _per_layer: &mut [Counters]) -> Result<()> {
        Ok(())
    }

    /// Releases what must go while the engine's context is alive (the backend's Drop calls this first).
    fn release(&self) {}

    /// The state itself, for its own policy's code (and benchmarks' hooks).
    fn as_any(&self) -> &dyn Any;
}

/// Sizes of a call's plans (entries per row, granularity, whether one plan serves every KV head).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PlanShape {
    pub cap: usize,
    pub ulog2: u32,
    pub shared: bool,
}

/// What a call's stages know when they reserve their workspace.
pub(crate) struct CallShape<'a> {
    pub cfg: &'a EngineConfig,
    /// The call's `max_query_len` (1: decode rows only; 0: unknown).
    pub max_query_len: i32,
    pub geo: &'a Geometry,
    /// The selector's plans, and the final plans (after top-p and ART).
    pub base: PlanShape,
    pub fin: PlanShape,
    /// The device's opt-in dynamic shared memory per block.
    pub smem_optin: usize,
    /// Whether the tensor-core attention kernel serves these caches.
    pub tensor_cores: bool,
}

impl CallShape<'_> {
    /// Rows of plans of shape `sh`: one per sequence when shared by the KV heads, else per (sequence, head).
    pub fn rows_of(&self, sh: &PlanShape) -> usize {
        if sh.shared {
            self.geo.num_seqs
        } else {
            self.geo.num_seqs * self.cfg.num_kv_heads
        }
    }

    /// The selector's candidate positions per row; a multiple of 4 (the top-p kernel reads float4s of each row).
    pub fn candidates(&self) -> usize {
        let b = &self.base;
        (b.cap << b.ulog2).min(self.geo.max_pos + (1usize << b.ulog2)).next_multiple_of(4)
    }
}

/// A call's policy workspace being laid out: regions in reservation order, each 256-byte aligned.
#[derive(Default, Debug)]
pub(crate) struct WsAlloc {
    off: usize,
    /// (offset, bytes) of every region, in order (the layout test reads them).
    pub regions: Vec<(usize, usize)>,
}

impl WsAlloc {
    /// A region of `bytes` bytes: its offset. A layout whose end overflows ends at usize::MAX, so that
    /// its allocation fails (OutOfMemory) instead of wrapping to a small workspace.
    pub fn take(&mut self, bytes: usize) -> usize {
        let at = self.off;
        self.regions.push((at, bytes));
        self.off = self.off.checked_add(bytes).and_then(|e| e.checked_next_multiple_of(256)).unwrap_or(usize::MAX);
        at
    }

    /// A region of the product of `parts` bytes (checked).
    pub fn take_n(&mut self, parts: &[usize]) -> Result<usize> {
        Ok(self.take(checked(parts)?))
    }

    /// The workspace's size (at least 256 bytes).
    pub fn total(&self) -> usize {
        self.off.max(256)
    }
}

/// The product of `parts` (a policy workspace size), or an OutOfMemory error when it overflows.
pub(crate) fn checked(parts: &[usize]) -> Result<usize> {
    parts.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).ok_or_else(|| Error::new(ErrorKind::OutOfMemory, "policy workspace size overflows"))
}

/// A selector's page scores in the workspace, for a later stage's order (ART's priority behind Quest).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageScores {
    /// Device address of `[seqs][kv_heads][maxp]` f32.
    pub at: u64,
    pub maxp: usize,
    pub page: usize,
}

/// A call's launch context, once its workspace is placed.
pub(crate) struct StepCx<'a> {
    pub dev: &'a dyn Device,
    pub cfg: &'a EngineConfig,
    pub a: &'a ForwardArgs,
    pub cache: &'a KvCache,
    pub geo: &'a Geometry,
    pub batch: BatchArg,
    /// Device address of the call's workspace.
    pub ws: u64,
    /// The selection module's files (`CudaPipeline::select_module`).
    pub module: Module,
    /// The selection module's compile-time definitions.
    pub defines: &'a [String],
    /// Device address of the layer's counters.
    pub ctr: i64,
    /// Bytes of K and V per position of one KV head (the counters' bytes read).
    pub row_bytes: i64,
    /// The layer's key metadata, when the policy needs some (checked by the pipeline; `select` only).
    pub meta: Option<&'a LayerDevMeta>,
    /// The selector's plans, and the final ones (the same when no later stage rewrites them).
    pub base: PlanRef,
    pub fin: PlanRef,
    /// Whether the selector counts its plans' blocks (no later stage counts the final ones instead).
    pub count_base: i32,
    /// Device addresses of the sequences' state slots and generations (0 without a slot map).
    pub slot: u64,
    pub slot_gen: u64,
    /// The attention's per-(sequence, KV head, split) tile counts (a terminating stage writes them).
    pub tiles: u64,
    pub nsplit: usize,
    /// Whether this call runs its selection (benchmarks time the phases apart).
    pub select: bool,
    /// The selector's page scores, when it keeps some in the workspace.
    pub scores: Option<PageScores>,
}

impl StepCx<'_> {
    /// A function of the selection module (kernels/select.cu and kernels/policy/, one module).
    pub fn function(&self, name: &'static str) -> Result<CUfunction> {
        self.dev.modules().function(self.dev.gpu(), "select", self.module, self.defines, name)
    }

    /// Whether the call's selection kernels launch as programmatic dependents (`launch::launch_dependent`;
    /// each starts with `KVS_GRID_WAIT()`).
    pub fn pdl(&self) -> bool {
        self.dev.pdl()
    }
}

/// What a decode row visited of its plan, when a stage cut the visit short (ART's terminated tiles).
pub(crate) trait RowVisits: Send {
    /// Row (sequence `s`, KV head `h`)'s visited spans of its plan (`entries`, units of `1 << ulog2`
    /// positions) over the visible positions [lo, hi], into `out`; returns (tiles visited, tiles).
    #[allow(clippy::too_many_arguments)]
    fn spans(&mut self, s: usize, h: usize, entries: &[u32], ulog2: u32, lo: usize, hi: usize, out: &mut Vec<(usize, usize)>) -> Result<(u32, u32)>;
}

/// What the CUDA backend asks of a policy pipeline (the policy registry's `Pipeline` implements it), so
/// that the backend never names the registry's closed set of policies.
pub(crate) trait CudaPipeline: PipelineKind + Sync {
    /// The pipeline's stages for one call, the selector first (`dev`: the policy's device state).
    fn cuda_stages<'a>(&'a self, dev: Option<&'a dyn PolicyDevice>) -> Vec<Box<dyn CudaStage + 'a>>;
    /// Whether this backend runs the pipeline for a GQA group of `group` query heads per KV head (at most
    /// `max_group`): the reason it does not, else Ok.
    fn cuda_supported(&self, group: usize, max_group: usize) -> std::result::Result<(), String>;
    /// The selection module's files: kernels/select.cu and the policies' selection kernels, compiled as one
    /// module (named "select") whatever the pipeline, so an engine compiles it once per variant.
    fn select_module(&self) -> Module;
}

/// One stage of a call's device pipeline (`selector [> top_p] [> art]`), made per call by the registry.
/// Every method has the behaviour of a stage that does not need it. The pipeline calls them in this
/// order: `splits`, `reserve` (the later stages, last first, then the selector: the layout the workspace
/// always had), `select` (selector first), the attention (`rows`), `after_attention`, `visits`.
pub(crate) trait CudaStage {
    /// Runs the whole call itself (a stage with its own rows and attention, PRR): Some(result), else None.
    fn forward(&self, _dev: &dyn Device, _cfg: &EngineConfig, _a: &ForwardArgs, _cache: &KvCache, _geo: &Geometry) -> Option<Result<()>> {
        None
    }

    /// Splits each row's attention is cut into by a stage that terminates rows in the kernel; 1 otherwise.
    fn splits(&self, _cx: &CallShape) -> Result<usize> {
        Ok(1)
    }

    /// Reserves the call's workspace regions (their offsets kept in the stage).
    fn reserve(&mut self, _cx: &CallShape, _ws: &mut WsAlloc) -> Result<()> {
        Ok(())
    }

    /// Where the selector's plans (entries, lengths) go when this stage writes the final plans from them.
    fn base_plan(&self) -> Option<(usize, usize)> {
        None
    }

    /// The selector's page scores in the workspace at `ws`, when it keeps some.
    fn page_scores(&self, _ws: u64) -> Option<PageScores> {
        None
    }

    /// Enqueues the stage's selection (the selector writes `cx.base`, a later stage `cx.fin`).
    fn select(&self, _cx: &StepCx) -> Result<()> {
        Ok(())
    }

    /// The attention's rows when the stage changes them (in-kernel termination, logits out); `keys`
    /// bounds a row's plan keys.
    fn rows(&self, _cx: &StepCx, _keys: usize) -> Option<Rows> {
        None
    }

    /// After the attention (`keys`: the bound its rows had).
    fn after_attention(&self, _cx: &StepCx, _keys: usize) -> Result<()> {
        Ok(())
    }

    /// What the call's rows visited when the stage cut their visits short (for visit records).
    fn visits(&self, _cx: &StepCx) -> Option<Box<dyn RowVisits>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::WsAlloc;

    #[test]
    fn a_workspace_layout_that_overflows_ends_at_usize_max() {
        let mut ws = WsAlloc::default();
        assert_eq!(ws.take(100), 0);
        assert_eq!(ws.take(10), 256);
        assert_eq!(ws.total(), 512);
        ws.take(usize::MAX - 300);
        assert_eq!(ws.total(), usize::MAX);
        ws.take(1);
        assert_eq!(ws.total(), usize::MAX);
        assert!(ws.take_n(&[usize::MAX, 2]).is_err());
    }
}
