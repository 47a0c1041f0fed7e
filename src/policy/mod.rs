//! Decode policies: which KV blocks or tokens each decode row visits, in which order, and when it stops.
//! Policies decide; kernels compute (`cpu::sparse` runs a pipeline through the one exact kernel).
//!
//! A pipeline is `selector [> top_p] [> art]` (spec grammar: [`spec`], docs/policies.md). It applies to
//! decode rows (query length 1) of layers `>= dense_layers`, one decision per (sequence, KV head) shared
//! by the query heads of the GQA group (scores aggregated by max over the group).
//!
//! Stateful stages keep per-(sequence, layer, KV head) state in [`SequencePolicyState`], owned by the
//! engine's sequence registry: created on first use, freed by `kvs_sequence_release`.

pub mod art;
pub mod device;
pub mod plan;
pub mod predictor;
pub mod quest;
pub mod refresh;
mod registry;
pub mod select;
pub mod snapkv;
pub mod spec;
pub mod speculate;
pub mod streaming;
pub mod top_p;

use std::collections::HashMap;
use std::sync::Arc;

use crate::meta::MetaNeeds;
use crate::error::Result;
pub use plan::HeadPlan;
pub use spec::{Art, Order, Pipeline, Predict, PredictorSpec, Probe, Refresh, Selector, Spec, Speculate, TopP};

/// A parsed policy spec. The empty spec and `dense` mean dense attention everywhere.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub spec: Spec,
}

impl Default for Policy {
    fn default() -> Self {
        Policy { spec: Spec { pipeline: None, dense_layers: spec::DEFAULT_DENSE_LAYERS, predictor_weights: None, max_seqs: spec::DEFAULT_MAX_SEQS } }
    }
}

impl Policy {
    pub fn parse(text: &str) -> Result<Self> {
        Ok(Policy { spec: Spec::parse(text)? })
    }

    pub fn pipeline(&self) -> Option<&Pipeline> {
        self.spec.pipeline.as_ref()
    }

    pub fn dense_layers(&self) -> usize {
        self.spec.dense_layers
    }

    /// True when no decode row of `layer` runs anything but dense attention.
    pub fn is_dense_for_layer(&self, layer: usize) -> bool {
        self.spec.pipeline.is_none() || layer < self.spec.dense_layers
    }

    /// True when the pipeline keeps per-sequence state (so forward calls must pass seq_ids).
    pub fn is_stateful(&self) -> bool {
        matches!(self.pipeline(), Some(Pipeline { selector: Selector::SnapKv { .. } | Selector::Speculate(_) | Selector::Refresh(_) | Selector::Predictor(_), .. }))
    }

    /// Number of stages of the pipeline (selector, then top-p and ART when present); 0 = dense.
    pub fn num_stages(&self) -> usize {
        self.pipeline().map_or(0, |p| 1 + p.top_p.is_some() as usize + p.art.is_some() as usize)
    }

    /// Whether a CUDA engine's decode steps under this policy may be captured in a CUDA graph by a serving
    /// plugin: every stage's decode step enqueues a fixed launch sequence (no host sync, allocation or
    /// decision) and was checked replay == eager through the shim's twin-engine check (scripts/
    /// gpu_shim_check.py) or a whole model step (scripts/gpu_e2e.py). Dense: always. The stateful stages
    /// (snapkv, speculate, refresh, predictor) replay == eager in the C-level graph tests only, not yet in
    /// those checks, so they report false until they pass there.
    pub fn graph_capturable(&self) -> bool {
        match self.pipeline() {
            None => true,
            Some(p) => matches!(p.selector, Selector::All | Selector::Streaming { .. } | Selector::Quest { .. }),
        }
    }

    /// Key metadata the cache writes must maintain.
    pub fn meta_needs(&self) -> MetaNeeds {
        match self.pipeline() {
            None => MetaNeeds::default(),
            Some(p) => MetaNeeds {
                quest_page: match p.selector {
                    Selector::Quest { page, .. } => Some(page),
                    Selector::Speculate(s) => Some(s.page),
                    _ => None,
                },
                int4: p.top_p.is_some(),
                snap_keep: false,
            },
        }
    }

    /// The size of a CUDA engine's per-sequence state slot map (`max_seqs`), for the policies whose device
    /// state belongs to a sequence rather than to cache blocks; None for the others.
    pub fn device_slots(&self) -> Option<usize> {
        matches!(self.pipeline(), Some(Pipeline { selector: Selector::Refresh(_) | Selector::Predictor(_), .. })).then_some(self.spec.max_seqs)
    }

    /// Key metadata a CUDA engine's cache writes maintain: the CPU's, plus SnapKV's kept-slot bits (on
    /// the device SnapKV's choice lives with the cache blocks, kernels/snapkv.cu).
    pub fn device_meta_needs(&self) -> MetaNeeds {
        let mut n = self.meta_needs();
        n.snap_keep = matches!(self.pipeline(), Some(Pipeline { selector: Selector::SnapKv { .. }, .. }));
        n
    }
}

impl Policy {
    /// AttentionPredictor's CNN for a `predictor` pipeline: the spec's `weights` file, else the built-in
    /// weights; None for other policies.
    pub fn predictor_weights(&self) -> Result<Option<Arc<predictor::PredictorWeights>>> {
        Ok(match self.pipeline().map(|p| &p.selector) {
            Some(Selector::Predictor(_)) => Some(Arc::new(match &self.spec.predictor_weights {
                Some(path) => predictor::PredictorWeights::from_file(path)?,
                None => predictor::PredictorWeights::builtin()?.clone(),
            })),
            _ => None,
        })
    }
}

/// SnapKV's choice for one (sequence, layer, KV head), made at the sequence's last prefill chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapSelection {
    /// Sequence length when the choice was made; positions from here on (generated tokens) are all kept.
    pub prefill_len: usize,
    /// Sorted kept positions `< prefill_len` (the chosen prefix positions and the observation window).
    pub keep: Vec<u32>,
    /// The pooled score of each kept position (ART's priority); +inf for the observation window.
    pub score: Vec<f32>,
}

/// State of one (sequence, layer, KV head).
#[derive(Clone, Debug, Default)]
pub struct HeadState {
    pub snapkv: Option<Arc<SnapSelection>>,
    /// PRR: Holt predictor per page and the previous true set.
    pub prr: Option<Box<speculate::PrrHead>>,
    /// RefreshKV: the partial token set.
    pub refresh: Option<Box<refresh::RefreshHead>>,
    /// AttentionPredictor: the block-attention history.
    pub predictor: Option<Box<predictor::PredictorHead>>,
}

impl HeadState {
    pub fn bytes(&self) -> usize {
        self.snapkv.as_ref().map_or(0, |s| std::mem::size_of::<SnapSelection>() + s.keep.capacity() * 4)
            + self.prr.as_ref().map_or(0, |s| s.bytes())
            + self.refresh.as_ref().map_or(0, |s| s.bytes())
            + self.predictor.as_ref().map_or(0, |s| s.bytes())
    }

    /// Number of policy state objects held (for lifecycle accounting).
    pub fn objects(&self) -> usize {
        self.snapkv.is_some() as usize + self.prr.is_some() as usize + self.refresh.is_some() as usize + self.predictor.is_some() as usize
    }
}

/// Per-sequence policy state: per layer, one [`HeadState`] per KV head, plus RefreshKV's layer-level
/// schedule.
#[derive(Default)]
pub struct SequencePolicyState {
    pub layers: HashMap<usize, Vec<HeadState>>,
    pub refresh_layers: HashMap<usize, refresh::RefreshLayer>,
}

impl SequencePolicyState {
    pub fn bytes(&self) -> usize {
        self.layers.values().flat_map(|v| v.iter()).map(|h| h.bytes() + std::mem::size_of::<HeadState>()).sum::<usize>()
            + self.refresh_layers.values().map(|l| l.bytes()).sum::<usize>()
    }

    /// Number of policy state objects (per-head states and layer schedules) held.
    pub fn objects(&self) -> usize {
        self.layers.values().flat_map(|v| v.iter()).map(|h| h.objects()).sum::<usize>() + self.refresh_layers.len()
    }

    /// The state of (layer, head), created empty for `num_kv_heads` heads on first use.
    pub fn head_mut(&mut self, layer: usize, head: usize, num_kv_heads: usize) -> &mut HeadState {
        let v = self.layers.entry(layer).or_insert_with(|| vec![HeadState::default(); num_kv_heads]);
        &mut v[head]
    }

    pub fn head(&self, layer: usize, head: usize) -> Option<&HeadState> {
        self.layers.get(&layer).and_then(|v| v.get(head))
    }
}
