//! What a selector stage (and a later one) does on the CPU, as a forward call's prefill (`cpu::call`) and the decode pipeline
//! ([`super::sparse_forward`]) call it. Each policy implements [`CpuStage`] in `src/policy/<name>/cpu.rs`;
//! the registry (`cpu()` on a selector, src/policy/registry.rs) is the one place that picks the implementation, so nothing here
//! names a policy.

use super::{HeadWork, Scratch, SparseCtx};
use crate::config::EngineConfig;
use crate::cpu::attention::RowLimits;
use crate::cpu::forward::ForwardIo;
use crate::cpu::metadata::LayerMeta;
use crate::error::Result;
use crate::policy::{select, HeadState};
use crate::sequences::Registry;
use crate::stats::Counters;

/// A forward call's prefill chunks, as a stage sees them before any row is attended.
pub(crate) struct PrefillCx<'a> {
    pub io: &'a ForwardIo<'a>,
    pub cfg: &'a EngineConfig,
    pub pool: &'a rayon::ThreadPool,
    pub sequences: &'a Registry,
    pub layer: usize,
    /// The call's prefill sequences with query rows (indices into the batch), when the stage reads
    /// metadata at prefill (`prefill_reads_meta`); else empty.
    pub calib_seqs: &'a [usize],
    /// The layer's key metadata, when the policy needs some.
    pub meta: Option<&'a LayerMeta>,
    /// What the caller set for the policy at run time (`Engine::set_policy_input`).
    pub policy_input: Option<&'a (dyn std::any::Any + Send + Sync)>,
}

/// One KV head's selection on the pipeline's generic path.
pub(crate) struct SelectCx<'a> {
    pub io: &'a ForwardIo<'a>,
    /// The decode row's visible positions and its sequence's block-table row.
    pub lim: RowLimits,
    pub blocks: &'a [u32],
    /// What the stage's `held` took from this (sequence, layer, head)'s state at the call's start.
    pub held: Option<&'a super::Held>,
    pub ctx: &'a SparseCtx<'a>,
}

/// The most stages a pipeline has after its selector (a pruning one, then a terminating one).
pub(crate) const MAX_LATER_STAGES: usize = 2;

/// What the CPU backend asks of a policy pipeline (the policy registry's `Pipeline` implements it), so
/// that the backend never names the registry's closed set of policies.
pub(crate) trait CpuPipeline: Sync {
    /// The selector as a CPU stage.
    fn cpu_selector(&self) -> Box<dyn CpuStage + '_>;
    /// The stages after the selector in pipeline order, then `None`s (no allocation: asked per decode row
    /// and KV head).
    fn cpu_later_stages(&self) -> [Option<&dyn CpuLaterStage>; MAX_LATER_STAGES];
}

/// A stage after the selector on the CPU (src/policy/<name>/cpu.rs; the registry lists a pipeline's,
/// `Pipeline::later_stages`). Every method has the behaviour of a stage that does not need it.
pub(crate) trait CpuLaterStage: Sync {
    /// Prunes one KV head's selection on the generic path (`hw.plan`, `hw.cand` and `hw.entry_score`,
    /// as the `select` method of `CpuStage` left them); returns the key metadata bytes read.
    fn prune(&self, _cx: &SelectCx, _hw: &mut HeadWork, _sc: &mut Scratch, _c: &mut Counters) -> u64 {
        0
    }

    /// The stage's traversal when it orders the plan and may stop attending it early: the pipeline then
    /// attends the decode rows through it instead of in position order.
    fn traversal(&self) -> Option<&dyn CpuTraversal> {
        None
    }
}

/// A later stage that walks a decode row's plan in its own order and may stop before its end (on the CUDA
/// backend: the attention kernel's traversal hook, src/cuda/traversal.rs). Its per-head work lives in
/// `HeadWork::traversal`, of the stage's own type.
pub(crate) trait CpuTraversal: Sync {
    /// After select and prune: one KV head's visiting order of its plan (`hw.plan`, and `hw.entry_score`
    /// where the selector scored the entries; `sink_limit`: the selector's sinks come first), over the
    /// row's visible positions `lim`.
    fn order(&self, hw: &mut HeadWork, sink_limit: usize, lim: RowLimits);

    /// Attends the KV heads of one decode row (`hws`, prepared; `blocks`: the sequence's block-table row)
    /// in their orders into each `hw.st`, stopping where the stage decides; sets `hw.visited` and
    /// `hw.attended` and counts the blocks visited and skipped and the stage's own counters into `c`.
    fn attend(&self, io: &ForwardIo, blocks: &[u32], hws: &mut [HeadWork], sc: &mut Scratch, c: &mut Counters);

    /// One head's visit record: the sorted spans it attended, and (tiles visited, tiles of the traversal).
    fn visits(&self, hw: &HeadWork) -> (Vec<(usize, usize)>, (u32, u32));
}

/// A selector stage on the CPU. Every method has the behaviour of a stage that does not need it.
pub(crate) trait CpuStage: Sync {
    /// Sees the call's prefill chunks before anything is attended; an error leaves everything unchanged.
    fn prefill(&self, _cx: &PrefillCx) -> Result<Counters> {
        Ok(Counters::default())
    }

    /// Whether `prefill` reads key metadata on the prefill rows (their coverage is checked first).
    fn prefill_reads_meta(&self) -> bool {
        false
    }

    /// Whether the stage holds its per-sequence state to the engine's cap itself, at prefill (else a call
    /// that starts over the cap is refused).
    fn caps_own_state(&self) -> bool {
        false
    }

    /// Per decode sequence `i` (index into the call's decode sequences), before its heads run: a decision
    /// the sequence's heads share (RefreshKV: a full or a partial step).
    fn decide_sequence(&self, _io: &ForwardIo, _s: usize, _ctx: &SparseCtx, _i: usize, _c: &mut Counters) -> bool {
        false
    }

    /// The part of a decode sequence's (layer, head) state the rows read, taken under the sequence's lock
    /// at the call's start so that the rows read it without one (SnapKV's choice). Default: nothing.
    fn held(&self, _hs: &HeadState) -> Option<super::Held> {
        None
    }

    /// Runs one work item (decode sequence `s`, the `i`-th, KV heads `heads`) itself, for stages with their
    /// own rows; None: the pipeline's select → prune → order path, through `select`.
    #[allow(clippy::too_many_arguments)]
    fn run_item(&self, _io: &ForwardIo, _s: usize, _i: usize, _heads: std::ops::Range<usize>, _decided: bool, _ctx: &SparseCtx, _sc: &mut Scratch) -> Option<Counters> {
        None
    }

    /// The generic path's selection for one KV head: the row's plan into `hw.plan` (ART's priority of each
    /// entry into `hw.entry_score`, left empty when the stage has none) and, for a stage that scores its
    /// units, `hw.cand`. Returns (the sink limit of ART's order, key metadata bytes read, whether `hw.cand`
    /// was built). Default: every visible position.
    fn select(&self, cx: &SelectCx, hw: &mut HeadWork, _sc: &mut Scratch) -> (usize, u64, bool) {
        select::all(&mut hw.plan, cx.lim.lo, cx.lim.hi, cx.io.cache.block_size);
        (1, 0, false)
    }
}
