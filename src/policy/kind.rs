//! What the shared code asks of a pipeline's selector (the size and sharing of its plans, the key metadata
//! and the state it needs, whether a CUDA graph may capture its steps), answered in the selector's own
//! folder: each selector implements [`SelectorKind`] there and the registry (src/policy/registry.rs,
//! `Selector::kind`) hands it out, so the engine, the backends and the plan arithmetic never match on a
//! selector's name. The defaults are those of a stateless token selector with no budget.

use crate::meta::MetaNeeds;

/// One selector's answers (its parameters are the value's).
pub(crate) trait SelectorKind {
    /// Keeps per-sequence state, so forward calls must pass sequence ids.
    fn stateful(&self) -> bool {
        false
    }

    /// A CUDA engine's decode steps may be captured in a CUDA graph by a serving plugin (see
    /// `Policy::graph_capturable` for what that was checked by).
    fn graph_capturable(&self) -> bool {
        false
    }

    /// Adds the key metadata the cache writes must maintain for this selector (both backends).
    fn meta_needs(&self, _needs: &mut MetaNeeds) {}

    /// Adds the key metadata a CUDA engine's cache writes must maintain beyond [`Self::meta_needs`].
    fn device_meta_needs(&self, _needs: &mut MetaNeeds) {}

    /// Its device state belongs to a sequence (kept in a slot map of `max_seqs` entries) rather than to
    /// cache blocks.
    fn per_sequence_device_state(&self) -> bool {
        false
    }

    /// log2 of the positions one entry of its plan stands for (0: tokens).
    fn unit_log2(&self, _block_size: usize) -> u32 {
        0
    }

    /// Most entries its plan of a row holds whatever the row's length (its budget and forced entries);
    /// None: every entry covering the row.
    fn budget_entries(&self) -> Option<usize> {
        None
    }

    /// One plan serves every KV head of a sequence (the plan does not depend on the keys).
    fn shared_plan(&self) -> bool {
        false
    }

    /// Its CUDA path serves an FP8 cache: it reads keys through the key metadata (which the cache writes
    /// keep from the dequantized keys, as on the CPU) or in kernels of its own that read FP8 rows decoded
    /// times their scales (kernels/include/kv_load.cuh), and attends through the plan kernel, which reads
    /// FP8 rows. False where a kernel of its own reads cache rows as 16-bit elements.
    fn cuda_fp8_cache(&self) -> bool {
        false
    }

    /// Whether the CUDA backend accepts the host-set policy input (`PolicyInput`) for this selector:
    /// Err(why) where the selector reads it on the CPU only.
    fn device_input(&self) -> Result<(), String> {
        Ok(())
    }

    /// Its plan's entries carry scores that rank them, so a stage that orders the traversal visits them by
    /// priority by default; false for the patterns (`all`, `streaming`), which keep position order.
    fn ranks_by_score(&self) -> bool {
        true
    }

    /// Positions at the start of every row its plan always keeps (sinks), which an ordered traversal
    /// visits first.
    fn sink_positions(&self) -> usize {
        0
    }

    /// On the CUDA backend the terminating attention kernel (kernels/attention_mma.cu) walks its plans:
    /// whole blocks, pages or token windows, written before the attention launch.
    fn device_terminable(&self) -> bool {
        false
    }

    /// On the CUDA backend its stage keeps each page's score in the workspace (`CudaStage::page_scores`),
    /// for a later stage to order the plan by.
    fn device_page_scores(&self) -> bool {
        false
    }
}

/// A pipeline as the plan arithmetic (src/policy/plan.rs) sees it: its selector's answers, and whether a
/// later stage turns the plans into tokens. The registry's `Pipeline` implements it, so plan.rs does not
/// name the registry's closed set.
pub(crate) trait PipelineKind {
    fn selector_kind(&self) -> Box<dyn SelectorKind>;

    /// A later stage (top-p) turns the selector's candidates into single tokens, one set per KV head.
    fn plans_tokens(&self) -> bool;
}

/// What the shared code asks of a pipeline's stage after the selector (one that prunes or terminates the
/// selector's plan), answered in the stage's own folder; the registry lists a pipeline's
/// (`Pipeline::later_stages`). The defaults are those of a stage that leaves the plan's shape alone.
pub(crate) trait LaterStageKind {
    /// Its plans name single tokens (a subset of the selector's candidates' positions), whatever the
    /// selector's granularity, and differ between the KV heads of a sequence.
    fn plans_tokens(&self) -> bool {
        false
    }

    /// Adds the key metadata the cache writes must maintain for this stage (both backends).
    fn meta_needs(&self, _needs: &mut MetaNeeds) {}
}
