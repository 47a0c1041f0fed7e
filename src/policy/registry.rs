//! The policy registry: each policy's place in the closed set of stages, one line per policy and table:
//! its stage name and parser entry, its variant of [`Selector`] or slot of [`Pipeline`] (over its
//! folder's parsed form), its CPU and CUDA implementations, its own counters (and their fields of the C
//! ABI's `kvs_stats`). The engine and the backends reach a stage through here (`Selector::cpu`,
//! `Pipeline::cuda`, `Policy::cuda_device`), so nothing outside src/policy matches on a policy's name. The registry imports the folders; a folder never names the registry's
//! types (it answers through [`SelectorKind`] and takes its own parsed form).

use super::spec::{self, Arg, Args, Role, StageDef, DEFAULT_DENSE_LAYERS, DEFAULT_MAX_SEQS};
use super::kind::{LaterStageKind, PipelineKind, SelectorKind};
use super::Policy;
use crate::config::EngineConfig;
use crate::cpu::sparse::{CpuLaterStage, CpuPipeline, CpuStage, MAX_LATER_STAGES};
use crate::cuda::kernel_src::{self, Module};
use crate::cuda::stage::{CudaPipeline, CudaStage, PolicyDevice};
use crate::error::Result;
use crate::stats::{Counters, EngineStats, StageCounter};

/// Declares each policy's folder as a module of `policy` (expanded in src/policy/mod.rs, so the folders
/// are `crate::policy::<name>`).
macro_rules! policy_modules {
    () => {
        pub mod art;
        pub mod predictor;
        pub mod quest;
        pub mod refresh;
        pub mod snapkv;
        pub mod speculate;
        pub mod streaming;
        pub mod top_p;
    };
}

/// Each stage's parsed form, defined in its folder.
pub use super::art::{Art, Order, Probe};
pub use super::predictor::PredictorSpec;
pub use super::quest::Quest;
pub use super::refresh::Refresh;
pub use super::snapkv::SnapKv;
pub use super::speculate::{Predict, Speculate};
pub use super::streaming::Streaming;
pub use super::top_p::TopP;

/// Which blocks/tokens are eligible for a decode row: the closed set of selectors.
#[derive(Clone, Debug, PartialEq)]
pub enum Selector {
    /// Every position the row may see (dense).
    All,
    Streaming(Streaming),
    Quest(Quest),
    SnapKv(SnapKv),
    /// PRR: Quest's true selection `over`, attended as a speculative (predicted) set plus repaired misses.
    Speculate(Speculate),
    /// RefreshKV: a per-(sequence, layer) partial token set rebuilt at full-attention steps.
    Refresh(Refresh),
    /// AttentionPredictor: a small CNN predicts the next step's block attention from its history.
    Predictor(PredictorSpec),
}

/// A non-dense pipeline: select, then optionally prune (top-p), then optionally terminate (ART).
#[derive(Clone, Debug, PartialEq)]
pub struct Pipeline {
    pub selector: Selector,
    pub top_p: Option<TopP>,
    pub art: Option<Art>,
}

/// A parsed spec: `pipeline == None` is dense attention everywhere.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub pipeline: Option<Pipeline>,
    pub dense_layers: usize,
    /// `predictor(weights="...")`: the weights file the engine loads (None = the built-in weights).
    pub predictor_weights: Option<String>,
    /// Option `max_seqs`: the most sequences a CUDA engine keeps per-sequence policy state for at once
    /// (its device slot map, src/cuda/slots.rs); the CPU engine's state is bounded by `max_state_bytes`.
    pub max_seqs: usize,
}

impl Default for Spec {
    /// Dense attention everywhere, the options' defaults.
    fn default() -> Self {
        Spec { pipeline: None, dense_layers: DEFAULT_DENSE_LAYERS, predictor_weights: None, max_seqs: DEFAULT_MAX_SEQS }
    }
}

/// A later stage's value: its CPU part and its answers to the shared code.
pub(crate) trait LaterStage: CpuLaterStage + LaterStageKind {}
impl<T: CpuLaterStage + LaterStageKind> LaterStage for T {}

impl Pipeline {
    /// The stages after the selector (top-p, then ART), in pipeline order. An iterator, not a collection:
    /// the CPU engine asks once per decode row and KV head.
    pub(crate) fn later_stages(&self) -> impl Iterator<Item = &dyn LaterStage> {
        let top_p = self.top_p.as_ref().map(|t| t as &dyn LaterStage);
        top_p.into_iter().chain(self.art.as_ref().map(|a| a as &dyn LaterStage))
    }
}

impl CpuPipeline for Pipeline {
    fn cpu_selector(&self) -> Box<dyn CpuStage + '_> {
        self.selector.cpu()
    }

    fn cpu_later_stages(&self) -> [Option<&dyn CpuLaterStage>; MAX_LATER_STAGES] {
        let mut out = [None; MAX_LATER_STAGES];
        for (slot, stage) in out.iter_mut().zip(self.later_stages()) {
            *slot = Some(stage as &dyn CpuLaterStage);
        }
        out
    }
}

impl PipelineKind for Pipeline {
    fn selector_kind(&self) -> Box<dyn SelectorKind> {
        self.selector.kind()
    }

    fn plans_tokens(&self) -> bool {
        self.later_stages().any(|s| s.plans_tokens())
    }
}

/// The selection module (one module, so a sparse engine compiles it once per dtype, head size and group):
/// kernels/select.cu's plans, then each stage's selection kernels (kernels/policy/, declared in its
/// folder's cuda.rs), one line per stage that has some. The order is the module's text: changing it
/// changes every compiled selection module (its NVRTC cache key and cubin).
pub(crate) const SELECT_MODULE: Module = &[
    kernel_src::file("select.cu"),
    &super::quest::cuda::KERNEL,
    &super::top_p::cuda::KERNEL,
    &super::art::cuda::PRIORITY,
    &super::snapkv::cuda::KERNEL,
    &super::refresh::cuda::KERNEL,
    &super::speculate::cuda::KERNEL,
];

/// A stage's module of its own, by name (one line per stage that has one): what the kernels' checks
/// expand (the stage's folder compiles it and checks its variants).
#[cfg(test)]
pub(crate) const OWN_MODULES: &[(&str, Module)] = &[("predictor", super::predictor::cuda::PREDICTOR)];

/// The attention kernel's traversal hooks (src/cuda/traversal.rs), one line per stage that has one: what
/// the kernels' compile check builds.
#[cfg(test)]
pub(crate) const TRAVERSAL_HOOKS: &[crate::cuda::traversal::HookKernel] = &[super::art::cuda::HOOK];

/// The Rust mirrors of the structs a stage's own kernel file defines and its launches pass by value, one
/// line per stage that has some: what the layout test compares with the C definitions.
#[cfg(test)]
pub(crate) const PARAM_LAYOUTS: &[fn() -> Vec<kernel_src::CLayout>] = &[super::refresh::cuda::c_layouts, super::predictor::cuda::c_layouts, super::art::cuda::c_layouts];

/// Each stage's own counters (declared in its folder, beyond the shared ones of [`Counters`]), one line
/// per stage that keeps some: a CUDA engine reads those with a device slot from its device counters. The
/// build checks that they fit `Counters` and that no two share a place or a device slot.
pub const STAGE_COUNTERS: &[&[StageCounter]] = &[super::top_p::COUNTERS, super::speculate::COUNTERS, super::refresh::COUNTERS];
const _: () = crate::stats::check_stage_counters(STAGE_COUNTERS);

// The C ABI's counters (src/ffi re-exports them). Defined here, with the stages' table, because the
// struct's middle is each stage's counters, one line per stage; cbindgen writes it to include/kvsparse.h as
// written, one flat struct. Field order is ABI: append new fields at the end only (callers say how much
// of the struct they know through `struct_size`).
/// Counters, for one call or accumulated by the engine (totals or one layer).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvs_stats {
    /// Set by the caller to `sizeof(kvs_stats)`; kvsparse writes only that many bytes.
    pub struct_size: u32,
    pub reserved: u32,
    pub calls: u64,
    pub prefill_tokens: u64,
    pub decode_rows: u64,
    /// Decode rows × KV heads served by a non-dense policy.
    pub policy_rows: u64,
    /// Blocks (per KV head) dense attention would have read for those rows.
    pub blocks_eligible: u64,
    /// Blocks (per KV head) actually read.
    pub blocks_visited: u64,
    /// Blocks offered by the selector but skipped by early termination.
    pub blocks_skipped_termination: u64,
    // Each stage's counters, one line per stage (its folder declares them: `top_p::CANDIDATES`, ...).
    pub top_p_candidates: u64, pub top_p_kept: u64,
    pub spec_predicted_blocks: u64, pub spec_hit_blocks: u64, pub spec_true_blocks: u64, pub spec_repaired_blocks: u64,
    pub refresh_full_steps: u64, pub refresh_partial_steps: u64,
    /// K and V bytes attention read (and a policy's selection, of key metadata); a sequence attended
    /// densely counts every position visible to its first query row, on both engines.
    pub kv_bytes_read: u64,
    /// Engine-wide (not per layer, not per call): sequences with live state, created, released.
    pub live_sequences: u64,
    pub sequences_created: u64,
    pub sequences_released: u64,
    /// Bytes of per-sequence policy state held now on the host (a CUDA engine preallocates its
    /// per-sequence state on the device at creation and reports 0).
    pub state_bytes: u64,
    /// Engine-wide: decode rows of a CUDA engine whose sequence found no free state slot (option
    /// `max_seqs`) and therefore ran dense attention instead of the policy.
    pub policy_rows_without_state: u64,
    /// Engine-wide, CUDA engines: the `kvs_status` of the fault the device checks recorded and
    /// `kvs_engine_check` has not returned yet (0 = none; reading the stats does not clear it).
    pub pending_status: u64,
}

impl kvs_stats {
    /// The C struct of the library's counters (the fields' names are the ABI's).
    pub(crate) fn from_counters(c: &Counters, engine: Option<&EngineStats>) -> Self {
        kvs_stats {
            struct_size: std::mem::size_of::<kvs_stats>() as u32,
            reserved: 0,
            calls: c.calls,
            prefill_tokens: c.prefill_tokens,
            decode_rows: c.decode_rows,
            policy_rows: c.policy_rows,
            blocks_eligible: c.blocks_eligible,
            blocks_visited: c.blocks_visited,
            blocks_skipped_termination: c.blocks_skipped_termination,
            top_p_candidates: c[super::top_p::CANDIDATES], top_p_kept: c[super::top_p::KEPT],
            spec_predicted_blocks: c[super::speculate::PREDICTED_BLOCKS], spec_hit_blocks: c[super::speculate::HIT_BLOCKS], spec_true_blocks: c[super::speculate::TRUE_BLOCKS], spec_repaired_blocks: c[super::speculate::REPAIRED_BLOCKS],
            refresh_full_steps: c[super::refresh::FULL_STEPS], refresh_partial_steps: c[super::refresh::PARTIAL_STEPS],
            kv_bytes_read: c.kv_bytes_read,
            live_sequences: engine.map_or(0, |s| s.live_sequences),
            sequences_created: engine.map_or(0, |s| s.sequences_created),
            sequences_released: engine.map_or(0, |s| s.sequences_released),
            state_bytes: engine.map_or(0, |s| s.state_bytes),
            policy_rows_without_state: engine.map_or(0, |s| s.policy_rows_without_state),
            pending_status: engine.map_or(0, |s| s.pending_status),
        }
    }
}

/// Why a selector whose `SelectorKind::cuda_fp8_cache` is false is refused over an FP8 cache on CUDA.
pub(super) const SELECTOR_NO_FP8: &str = "this selector's own kernels read 16-bit cache rows only";

/// A stage's parsed value, as the registry's table hands it to [`Spec::parse`].
enum Parsed {
    Dense,
    /// The selector, and a weights file it names (`predictor(weights="...")`).
    Selector(Selector, Option<String>),
    TopP(TopP),
    /// ART, and its order when the spec gives one (else `art::default_order` picks it).
    Art(Art, Option<Order>),
}

/// A selector without a weights file.
fn selector(s: Selector) -> Parsed {
    Parsed::Selector(s, None)
}

/// Every stage name of the spec grammar with its parser entry (in the policy's folder), in the order
/// messages list them.
const STAGES: &[StageDef<Parsed>] = &[
    StageDef { name: "dense", role: Role::Dense, whole_pipeline: false, parse: parse_dense },
    StageDef { name: "all", role: Role::Selector, whole_pipeline: false, parse: parse_all },
    StageDef { name: "streaming", role: Role::Selector, whole_pipeline: false, parse: |s, a| Ok(selector(Selector::Streaming(super::streaming::parse(s, a)?))) },
    StageDef { name: "quest", role: Role::Selector, whole_pipeline: false, parse: |s, a| Ok(selector(Selector::Quest(super::quest::parse(s, a)?))) },
    StageDef { name: "snapkv", role: Role::Selector, whole_pipeline: false, parse: |s, a| Ok(selector(Selector::SnapKv(super::snapkv::parse(s, a)?))) },
    StageDef { name: "speculate", role: Role::Selector, whole_pipeline: true, parse: |s, a| Ok(selector(Selector::Speculate(super::speculate::parse(s, a)?))) },
    StageDef { name: "refresh", role: Role::Selector, whole_pipeline: true, parse: |s, a| Ok(selector(Selector::Refresh(super::refresh::parse(s, a)?))) },
    StageDef { name: "predictor", role: Role::Selector, whole_pipeline: true, parse: |s, a| super::predictor::parse(s, a).map(|(p, w)| Parsed::Selector(Selector::Predictor(p), w)) },
    StageDef { name: "top_p", role: Role::Prune, whole_pipeline: false, parse: |s, a| Ok(Parsed::TopP(super::top_p::parse(s, a)?)) },
    StageDef { name: "art", role: Role::Terminate, whole_pipeline: false, parse: |s, a| super::art::parse(s, a).map(|(art, order)| Parsed::Art(art, order)) },
];

/// `dense` and `all` take no arguments.
fn parse_dense(src: &str, raw: Vec<Arg>) -> Result<Parsed> {
    Args::new(src, "dense", raw, &[])?;
    Ok(Parsed::Dense)
}

fn parse_all(src: &str, raw: Vec<Arg>) -> Result<Parsed> {
    Args::new(src, "all", raw, &[])?;
    Ok(selector(Selector::All))
}

impl Spec {
    /// Parses a whole spec: the grammar in src/policy/spec.rs, each stage's arguments in its folder; then
    /// assembles the stages' values (the selector `all` when the spec names none; ART's order).
    pub fn parse(src: &str) -> Result<Spec> {
        let parsed = spec::parse_with(src, STAGES)?;
        let mut predictor_weights = None;
        let pipeline = parsed.stages.map(|values| {
            let mut p = Pipeline { selector: Selector::All, top_p: None, art: None };
            let mut art_order = None;
            for v in values {
                match v {
                    Parsed::Dense => {}
                    Parsed::Selector(s, weights) => {
                        p.selector = s;
                        if weights.is_some() {
                            predictor_weights = weights;
                        }
                    }
                    Parsed::TopP(t) => p.top_p = Some(t),
                    Parsed::Art(a, order) => {
                        p.art = Some(a);
                        art_order = order;
                    }
                }
            }
            if let Some(a) = p.art.as_mut() {
                a.order = art_order.unwrap_or_else(|| super::art::default_order(&*p.selector.kind(), p.top_p.is_some()));
            }
            p
        });
        Ok(Spec { pipeline, dense_layers: parsed.dense_layers, predictor_weights, max_seqs: parsed.max_seqs })
    }
}

/// `Spec::parse` (for the stages' tests in their folders).
#[cfg(test)]
pub(crate) fn parse(spec: &str) -> Result<Spec> {
    Spec::parse(spec)
}

/// The message of the error a spec is refused with (for the stages' tests in their folders).
#[cfg(test)]
pub(crate) fn refusal(spec: &str) -> String {
    let e = Spec::parse(spec).expect_err(spec);
    assert_eq!(e.kind, crate::error::ErrorKind::InvalidArgument);
    e.message
}

/// `all`: every visible position (the stage's defaults): one plan of whole cache blocks for every head.
struct All;
impl CpuStage for All {}
impl SelectorKind for All {
    fn cuda_fp8_cache(&self) -> bool {
        true
    }

    fn graph_capturable(&self) -> bool {
        true
    }

    fn unit_log2(&self, block_size: usize) -> u32 {
        block_size.trailing_zeros()
    }

    fn shared_plan(&self) -> bool {
        true
    }

    /// A pattern, not a ranking: later stages keep position order.
    fn ranks_by_score(&self) -> bool {
        false
    }

    /// Its plans are whole cache blocks the terminating attention kernel walks in order.
    fn device_terminable(&self) -> bool {
        true
    }
}

/// A selector's value: its CPU stage, and its answers to the shared code.
trait SelectorValue: CpuStage + SelectorKind {}
impl<T: CpuStage + SelectorKind> SelectorValue for T {}

impl Selector {
    /// The selector's value (one small value per use), made in its folder's types.
    fn value(&self) -> Box<dyn SelectorValue> {
        match *self {
            Selector::All => Box::new(All),
            Selector::Streaming(s) => Box::new(s),
            Selector::Quest(q) => Box::new(q),
            Selector::SnapKv(s) => Box::new(s),
            Selector::Speculate(s) => Box::new(s),
            Selector::Refresh(r) => Box::new(r),
            Selector::Predictor(p) => Box::new(p),
        }
    }

    /// What the shared code asks of this selector, answered in its folder ([`SelectorKind`]).
    pub(crate) fn kind(&self) -> Box<dyn SelectorKind> {
        self.value()
    }

    /// This selector as a CPU stage (one small value per forward call).
    pub(crate) fn cpu(&self) -> Box<dyn CpuStage + '_> {
        self.value()
    }
}

/// The backend's device state of the engine's policy, as its own type (made by `Policy::cuda_device`).
fn state<T: 'static>(state: Option<&dyn PolicyDevice>) -> Option<&T> {
    state.and_then(|s| s.as_any().downcast_ref::<T>())
}

impl CudaPipeline for Pipeline {
    /// This pipeline's stages on the CUDA backend for one call: the selector, then top-p and ART when
    /// present. `dev`: the policy's device state the backend keeps ([`Policy::cuda_device`]).
    fn cuda_stages<'a>(&'a self, dev: Option<&'a dyn PolicyDevice>) -> Vec<Box<dyn CudaStage + 'a>> {
        let selector: Box<dyn CudaStage + 'a> = match self.selector {
            Selector::All => Box::new(super::streaming::cuda::SimplePlan::all()),
            Selector::Streaming(s) => Box::new(super::streaming::cuda::SimplePlan::streaming(s.sink, s.recent)),
            Selector::Quest(q) => Box::new(super::quest::cuda::Quest::new(q.budget, q.page, q.sink, self.top_p.is_some() || self.art.is_some())),
            Selector::SnapKv(s) => Box::new(super::snapkv::cuda::SnapKv::new(s.budget, s.window, s.pool)),
            Selector::Speculate(sp) => Box::new(super::speculate::cuda::PrrStage { state: state(dev), sp }),
            Selector::Refresh(r) => Box::new(super::refresh::cuda::RefreshStage::new(state(dev), r)),
            Selector::Predictor(ps) => Box::new(super::predictor::cuda::PredictorStage::new(state(dev), ps)),
        };
        let mut stages = vec![selector];
        if let Some(tp) = self.top_p {
            stages.push(Box::new(super::top_p::cuda::TopPStage::new(tp.p)));
        }
        if let Some(art) = self.art {
            stages.push(Box::new(super::art::cuda::ArtStage::new(art, super::art::cuda::sink_limit(&*self.selector.kind()))));
        }
        stages
    }

    /// Whether the CUDA backend runs this pipeline for a GQA group of `group` query heads per KV head
    /// (at most `max_group`).
    fn cuda_supported(&self, group: usize, max_group: usize) -> std::result::Result<(), String> {
        if let Some(art) = &self.art {
            super::art::cuda::supported(art, &*self.selector.kind(), self.top_p.is_some())?;
        }
        if group > max_group {
            return Err(format!("policies on the CUDA backend support GQA groups of at most {max_group} query heads per KV head (this model has {group})"));
        }
        match self.selector {
            Selector::Speculate(s) => super::speculate::cuda::supported(&s),
            _ => Ok(()),
        }
    }

    fn select_module(&self) -> Module {
        SELECT_MODULE
    }
}

impl Policy {
    /// Every stage's own counters ([`STAGE_COUNTERS`]), for a CUDA engine to read those its stages' kernels
    /// count from its device counters (a stage this policy lacks leaves its slots zero).
    pub(crate) fn stage_counters(&self) -> &'static [&'static [StageCounter]] {
        STAGE_COUNTERS
    }

    /// What a new CPU engine loads for this policy's life and hands every call (`SparseCtx::policy_data`):
    /// the predictor's weights; None for the others.
    pub(crate) fn cpu_data(&self) -> Result<Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>> {
        Ok(match self.pipeline().map(|p| &p.selector) {
            Some(Selector::Predictor(_)) => Some(super::predictor::PredictorWeights::for_spec(self.spec.predictor_weights.as_deref())?),
            _ => None,
        })
    }

    /// The device state a new CUDA engine keeps for this policy's life (PRR's block-keyed state and side
    /// streams, RefreshKV's per-layer state, the predictor's weights and history); None for the others.
    pub(crate) fn cuda_device(&self, cfg: &EngineConfig) -> Result<Option<Box<dyn PolicyDevice>>> {
        Ok(match self.pipeline().map(|p| &p.selector) {
            Some(Selector::Speculate(sp)) => {
                let mut d = super::speculate::cuda::PrrDevice::new(cfg, SELECT_MODULE);
                d.set_spec(*sp);
                Some(Box::new(d))
            }
            Some(Selector::Refresh(_)) => Some(Box::new(super::refresh::cuda::RefreshDevice::new(cfg.num_layers)?)),
            Some(Selector::Predictor(ps)) => {
                let w = super::predictor::PredictorWeights::for_spec(self.spec.predictor_weights.as_deref())?;
                Some(Box::new(super::predictor::cuda::PredictorDev::upload(&w, *ps, cfg.num_layers, cfg.num_kv_heads, self.spec.max_seqs)?))
            }
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::EngineConfig;
    use crate::cuda::batch::Geometry;
    use crate::cuda::sparse::lay_out;
    use crate::cuda::stage::{CallShape, CudaPipeline, PlanShape};
    use crate::error::Result;
    use crate::policy::plan::{device_plan_shapes, plan_capacity, plan_unit_log2, selector_capacity, selector_unit_log2};
    use crate::policy::{Order, Pipeline, Policy, Quest, SnapKv, Selector, Streaming};
    use crate::tensor::DType;

    /// The policy workspace's regions (offset, bytes) and total as src/cuda/sparse.rs laid them out before
    /// the stages had a trait (10d7224, `WsLayout`), transcribed: the reference the stages' layout must
    /// equal byte for byte (same launches, same offsets); top-p's and ART's regions (and ART's shared-memory
    /// limit) as issue 34 changed them.
    #[allow(clippy::too_many_arguments)]
    fn layout_10d7224(p: &Pipeline, cfg: &EngineConfig, geo: &Geometry, max_query_len: i32, smem_optin: usize, tensor_cores: bool, slots: bool) -> Result<(Vec<(usize, usize)>, usize)> {
        let (hk, bs, g) = (cfg.num_kv_heads, cfg.block_size, cfg.group_size());
        let checked = |parts: &[usize]| crate::cuda::stage::checked(parts);
        let base = (selector_capacity(&*p.selector.kind(), bs, geo.max_pos).max(1), selector_unit_log2(&*p.selector.kind(), bs), matches!(p.selector, Selector::All | Selector::Streaming(_)));
        let fin = (plan_capacity(p, bs, geo.max_pos).max(1), plan_unit_log2(p, bs), base.2 && p.top_p.is_none());
        let ns = geo.num_seqs;
        let rows_of = |sh: &(usize, u32, bool)| if sh.2 { ns } else { ns * hk };
        let mut regions = Vec::new();
        let mut off = 0usize;
        let mut take = |bytes: usize| -> usize {
            let at = off;
            regions.push((at, bytes));
            off = (off + bytes).next_multiple_of(256);
            at
        };
        take(checked(&[rows_of(&fin), fin.0, 4])?);
        take(checked(&[ns, hk, 4])?);
        let art_nsplit = p.art.map_or(1, |art| crate::policy::art::cuda::art_splits(fin.0 << fin.1, art.segment).0);
        crate::ensure!(art_nsplit < 65536, Unsupported, "segments");
        take(checked(&[ns, hk, art_nsplit, 4])?);
        let art_priority = p.art.is_some_and(|art| art.order == Order::Priority);
        if art_priority {
            // The priority order's keys in shared memory: since b541944 (a rank count) the plan's capacity of
            // them, no longer its next power of two (a bitonic sort's).
            crate::ensure!(fin.0 * 8 + 1024 <= smem_optin, Unsupported, "priority");
            take(checked(&[rows_of(&fin), fin.0, 4])?);
            take(checked(&[rows_of(&fin), fin.0, 4])?);
        }
        if let Some(art) = p.art {
            // Since issue 34 (one traversal walked split-parallel): every 64-key tile's probe partial (48
            // f32) when the traversal is one segment, and the rows' arrival counters.
            if art.segment.is_none() {
                take(checked(&[ns * hk, (fin.0 << fin.1).div_ceil(64).max(1), 48, 4])?);
            }
            take(checked(&[ns * hk, 4])?);
        }
        let quest_pages = match p.selector {
            Selector::Quest(Quest { page, .. }) => Some((page, geo.max_pos.div_ceil(page) + 1)),
            _ => None,
        };
        let maxc = (base.0 << base.1).min(geo.max_pos + (1usize << base.1)).next_multiple_of(4);
        if p.top_p.is_some() {
            take(checked(&[rows_of(&base), base.0, 4])?);
            take(checked(&[ns, hk, 4])?);
            take(checked(&[ns, hk, g, maxc, 4])?);
            take(checked(&[ns, hk, maxc, 4])?);
            // Since issue 34 (top-p's search over many CTAs): tile maxima, tile normalisers, row max and
            // 1/normaliser, 4 histograms, 5 search states, tile summaries, flags. Since 00ae4fb the tile
            // maxima have room for the estimate's smallest tile (256 candidates).
            let (etiles, stiles) = (maxc.div_ceil(256), maxc.div_ceil(1024));
            take(checked(&[ns, hk, etiles, g, 4])?);
            take(checked(&[ns, hk, stiles, g, 8])?);
            take(checked(&[ns, hk, 2, g, 4])?);
            take(checked(&[ns, hk, 4, 256, g, 8])?);
            take(checked(&[ns, hk, 5, 8 + 16 * g])?);
            take(checked(&[ns, hk, stiles, 8 + 8 * g])?);
            take(checked(&[ns, hk, 2, 4])?);
        }
        if let Some((_, maxp)) = quest_pages {
            take(checked(&[ns, hk, maxp, 4])?);
            take(checked(&[ns, hk, 2048, 4])?);
        }
        let snap_rows = match p.selector {
            Selector::SnapKv(SnapKv { window, .. }) if max_query_len != 1 => {
                let mq = if max_query_len > 0 { max_query_len as usize } else { window };
                Some(checked(&[window.min(mq).max(1), g])?)
            }
            _ => None,
        };
        if let Some(rows) = snap_rows {
            take(checked(&[ns, hk, rows, 4])?);
            take(checked(&[ns, hk, rows, 8])?);
            take(checked(&[ns, hk, rows, 4])?);
            // Since issue 35 (SnapKV's log-sum-exp pass over spans of 2,048 positions): (max, sum) per kernel
            // row (the group times the window rounded up to 16) and span.
            take(checked(&[ns, hk, g * (rows / g).next_multiple_of(16), geo.max_pos.max(1).div_ceil(2048), 8])?);
            take(checked(&[ns, hk, geo.max_pos.max(1), 4])?);
            take(checked(&[ns, hk, geo.max_pos.max(1), 4])?);
        }
        if slots {
            take(checked(&[ns, 4])?);
            take(checked(&[ns, 4])?);
        }
        if let Selector::Refresh(r) = p.selector {
            crate::policy::refresh::cuda::RefreshWs::reserve(&mut take, ns, hk, g, geo.max_pos, r.k, tensor_cores)?;
        }
        if let Selector::Predictor(ps) = p.selector {
            let pw = crate::policy::predictor::cuda::PredWs::new(&ps, geo, g, max_query_len)?;
            take(checked(&[ns, hk, 4])?);
            take(checked(&[ns, hk, pw.nbmax, 4])?);
            take(checked(&[ns, hk, pw.rcap, 4])?);
            take(checked(&[ns, hk, pw.rcap, 8])?);
            take(checked(&[ns, hk, pw.rcap, 4])?);
            // Since issue 35: a decode row's logits, kept between the history row's passes; the tensor-core
            // history rows' CTA statistics per query head.
            take(checked(&[ns, hk, g, pw.lcap, 4])?);
            take(checked(&[ns, hk, g, crate::policy::predictor::cuda::HIST_PARTS, 8])?);
            // Since the history rows come from the step's attention (tensor cores): its split statistics.
            if crate::policy::predictor::cuda::tc_history(tensor_cores, cfg.cache_dtype, cfg.dtype, cfg.head_dim, g) {
                take(checked(&[ns, hk, g, crate::policy::predictor::cuda::ATTN_PARTS, 8])?);
            }
        }
        Ok((regions, off.max(256)))
    }

    /// Every device pipeline's workspace, laid out by its stages, equals the layout before the stages had
    /// a trait, region for region (same offsets and sizes, same total, the same refusals), over policies,
    /// batch shapes, prefill or decode calls, devices with and without tensor cores and shared memory.
    #[test]
    fn stage_workspace_layout_equals_the_layout_before_the_trait() {
        let specs = [
            "all",
            "streaming(sink=64, recent=448)",
            "quest(budget=512)",
            "quest(budget=512, page=32, sink=16)",
            "quest(budget=4096, page=8)",
            "snapkv(budget=256)",
            "snapkv(budget=100, window=8, pool=3)",
            "refresh(k=64)",
            "refresh(k=512, stride=1, every=10)",
            "predictor(budget=1024)",
            "all > top_p(p=0.9)",
            "quest(budget=512) > top_p(p=0.95)",
            "streaming(sink=4, recent=64) > top_p",
            "snapkv(budget=256) > top_p",
            "art(tau=1e-5, phi=1e-3, patience=5)",
            "streaming(sink=64, recent=448) > art(tau=1e-4)",
            "quest(budget=512) > art(order=priority)",
            "quest(budget=65536, page=16) > art(order=priority)",
            "quest(budget=512) > art(order=recent, segment=4096)",
            "all > art(segment=64)",
            // Not run by the CUDA backend (ART behind top-p), laid out all the same.
            "quest(budget=512) > top_p(p=0.95) > art(tau=1e-5)",
            "all > top_p > art(order=priority)",
        ];
        let mut cases = 0;
        for spec in specs {
            let policy = Policy::parse(spec).unwrap_or_else(|e| panic!("{spec}: {e:?}"));
            let p = policy.pipeline().expect("a pipeline");
            for &(hk, g, d, bs) in &[(2usize, 4usize, 64usize, 16usize), (8, 1, 128, 32), (1, 16, 128, 16)] {
                let cfg = EngineConfig::new(4, hk * g, hk, d, bs, DType::BF16);
                for &(ns, cols) in &[(1usize, 1usize), (3, 64), (17, 8192), (256, 4096)] {
                    let max_pos = cols * bs;
                    for max_len in [max_pos, max_pos / 2 + 1] {
                        let geo = Geometry { num_tokens: ns, num_seqs: ns, cols, max_pos, max_len };
                        for mql in [0, 1, 7, 512] {
                            for (smem, tc) in [(232_448usize, true), (49_152, false)] {
                                let slots = policy.device_slots().is_some();
                                let want = layout_10d7224(p, &cfg, &geo, mql, smem, tc, slots);
                                let [base, fin] = device_plan_shapes(p, bs, geo.max_pos).map(|(cap, ulog2, shared)| PlanShape { cap, ulog2, shared });
                                let shape = CallShape { cfg: &cfg, max_query_len: mql, geo: &geo, base, fin, smem_optin: smem, tensor_cores: tc };
                                let mut stages = p.cuda_stages(None);
                                let got = lay_out(&mut stages, &shape, slots).map(|l| (l.ws.regions.clone(), l.ws.total()));
                                match (&want, &got) {
                                    (Ok(w), Ok(g)) => assert_eq!(w, g, "{spec}: hk {hk} g {g:?} ns {ns} cols {cols} max_len {max_len} mql {mql} smem {smem}"),
                                    (Err(_), Err(_)) => {}
                                    _ => panic!("{spec}: hk {hk} ns {ns} cols {cols} mql {mql} smem {smem}: before {want:?}, stages {:?}", got.as_ref().map(|_| ()).map_err(|e| e.to_string())),
                                }
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(cases > 1000);
    }

    /// `kvs_stats` is the C ABI's flat struct: every field at the offset C callers were compiled with, the
    /// stages' lines in the middle included, and the size they pass as `struct_size`.
    #[test]
    fn kvs_stats_keeps_the_abi_layout() {
        use crate::policy::kvs_stats as S;
        use std::mem::offset_of;
        let got = [
            offset_of!(S, reserved),
            offset_of!(S, calls),
            offset_of!(S, blocks_skipped_termination),
            offset_of!(S, top_p_candidates),
            offset_of!(S, top_p_kept),
            offset_of!(S, spec_predicted_blocks),
            offset_of!(S, spec_hit_blocks),
            offset_of!(S, spec_true_blocks),
            offset_of!(S, spec_repaired_blocks),
            offset_of!(S, refresh_full_steps),
            offset_of!(S, refresh_partial_steps),
            offset_of!(S, kv_bytes_read),
            offset_of!(S, pending_status),
            std::mem::size_of::<S>(),
        ];
        assert_eq!(got, [4, 8, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 176, 184]);
    }

    /// The C struct carries each stage's counters from `Counters` (through the stages' constants), and the
    /// engine-wide values only when given.
    #[test]
    fn kvs_stats_takes_each_stage_counter_from_its_place() {
        use crate::policy::{kvs_stats, refresh, speculate, top_p};
        use crate::stats::{Counters, EngineStats};
        let mut c = Counters { calls: 1, kv_bytes_read: 2, ..Default::default() };
        let stage = [top_p::CANDIDATES, top_p::KEPT, speculate::PREDICTED_BLOCKS, speculate::HIT_BLOCKS, speculate::TRUE_BLOCKS, speculate::REPAIRED_BLOCKS, refresh::FULL_STEPS, refresh::PARTIAL_STEPS];
        for (i, s) in stage.into_iter().enumerate() {
            c[s] = 10 + i as u64;
        }
        let k = kvs_stats::from_counters(&c, None);
        let got = [k.top_p_candidates, k.top_p_kept, k.spec_predicted_blocks, k.spec_hit_blocks, k.spec_true_blocks, k.spec_repaired_blocks, k.refresh_full_steps, k.refresh_partial_steps];
        assert_eq!(got, [10, 11, 12, 13, 14, 15, 16, 17]);
        assert_eq!((k.calls, k.kv_bytes_read, k.live_sequences), (1, 2, 0));
        let e = EngineStats { live_sequences: 3, pending_status: 4, ..Default::default() };
        let k = kvs_stats::from_counters(&c, Some(&e));
        assert_eq!((k.live_sequences, k.pending_status, k.struct_size as usize), (3, 4, std::mem::size_of::<kvs_stats>()));
    }

    #[test]
    fn capacity_bounds_every_selector() {
        let q = Pipeline { selector: Selector::Quest(Quest { budget: 100, page: 16, sink: 16 }), top_p: None, art: None };
        assert_eq!(plan_capacity(&q, 16, 100_000), 7 + 1 + 1);
        assert_eq!(plan_capacity(&q, 16, 40), 4, "never more than the entries covering the row");
        let s = Pipeline { selector: Selector::Streaming(Streaming { sink: 4, recent: 64 }), top_p: None, art: None };
        assert_eq!(plan_capacity(&s, 16, 1000), 68);
        let t = Pipeline { selector: Selector::Quest(Quest { budget: 64, page: 16, sink: 0 }), top_p: Some(crate::policy::TopP { p: 0.9 }), art: None };
        assert_eq!(plan_capacity(&t, 16, 100_000), (4 + 0 + 1) * 16);
        assert_eq!(plan_unit_log2(&t, 16), 0);
        assert_eq!(plan_unit_log2(&q, 16), 4);
    }
}
