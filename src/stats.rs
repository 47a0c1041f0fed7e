//! Counters users tune policies with: what was eligible, what was visited, what each stage removed.
//! Kept per layer (plus totals) in the engine, and per call for the caller that asks.

/// Defines [`Counters`] from one list of its fields: `name @ n` where device counter slot `n`
/// (kernels/include/decide.cuh CTR_*) holds it on the CUDA backend. Every field is read from its slot,
/// added and subtracted alike, so a counter needs nothing but its line.
macro_rules! counters {
    ( $( $(#[$doc:meta])* $field:ident $(@ $slot:literal)? ),* $(,)? ) => {
        /// One set of counters. Also the payload of the C struct `kvs_stats` (see `ffi::types`).
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Counters {
            $( $(#[$doc])* pub $field: u64, )*
        }

        impl Counters {
            /// The counters a layer's device slots hold (kernels/include/decide.cuh CTR_*); the others zero.
            pub(crate) fn from_device_slots(c: &[u64]) -> Counters {
                let mut out = Counters::default();
                $( $( out.$field = c[$slot]; )? )*
                out
            }

            pub fn add(&mut self, o: &Counters) {
                $( self.$field += o.$field; )*
            }

            /// What was counted since `before` (an earlier reading of the same, only growing, counters).
            pub fn since(&self, before: &Counters) -> Counters {
                let f = |a: u64, b: u64| a.saturating_sub(b);
                Counters { $( $field: f(self.$field, before.$field), )* }
            }
        }
    };
}

// The shared counters, then each stage's: the C ABI's `kvs_stats` names them (src/ffi/types.rs), so this
// list mirrors the ABI (a leaf: the policies and backends that fill them import this file, so it imports
// none of them). A stage fills its fields where it runs.
counters! {
    /// Forward calls (per layer: calls that touched that layer).
    calls,
    /// Query rows of prefill / chunked-prefill sequences (query length > 1).
    prefill_tokens @ 1,
    /// Decode rows (query length 1), dense or not.
    decode_rows @ 0,
    /// Decode rows × KV heads that went through a non-dense policy.
    policy_rows @ 2,
    /// KV blocks that dense attention would have visited for those policy rows (per KV head).
    blocks_eligible @ 3,
    /// KV blocks (per KV head) whose keys were actually read.
    blocks_visited @ 4,
    /// Blocks the selector offered but a stage that terminates the traversal did not visit.
    blocks_skipped_termination @ 8,
    /// Bytes of K and V read by attention (all rows, dense and sparse).
    kv_bytes_read @ 7,
    /// A stage that terminates the traversal: the steps (tiles of its visit order) visited, and those of
    /// the whole traversals (Rust only).
    traversal_tiles_visited @ 9,
    traversal_tiles_total @ 10,
    /// Tokens offered to top-p, and tokens it kept.
    top_p_candidates @ 5,
    top_p_kept @ 6,
    /// Speculate/repair: blocks predicted, of those in the true set, and missed blocks repaired.
    spec_predicted_blocks @ 11,
    spec_hit_blocks @ 13,
    spec_true_blocks @ 12,
    spec_repaired_blocks @ 14,
    /// Speculate/repair baseline: blocks of the true set that the previous step's true set held
    /// (what reusing the previous selection would have hit; compare with `spec_hit_blocks`).
    spec_reuse_hit_blocks @ 15,
    /// PRR calibrations run at prefill (per sequence × KV head) and their total time in microseconds.
    spec_calibrations,
    spec_calib_us,
    /// Refresh scheduling: full-attention steps and partial (token-set) steps.
    refresh_full_steps,
    refresh_partial_steps,
}

impl Counters {
    /// Fraction of eligible blocks visited by policy rows (1.0 when nothing was eligible).
    pub fn visited_fraction(&self) -> f64 {
        if self.blocks_eligible == 0 {
            1.0
        } else {
            self.blocks_visited as f64 / self.blocks_eligible as f64
        }
    }
}

/// Engine-wide view: totals, one entry per layer, and the sequence registry's counts.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub total: Counters,
    pub per_layer: Vec<Counters>,
    pub live_sequences: u64,
    pub sequences_created: u64,
    pub sequences_released: u64,
    pub state_bytes: u64,
    /// CUDA engine: sequences' decode rows that found no free state slot (spec option `max_seqs`) and ran
    /// dense attention instead of the policy.
    pub policy_rows_without_state: u64,
    /// CUDA engine: the C status of the fault the device checks recorded and `Engine::check` has not
    /// returned yet (0 = none).
    pub pending_status: u64,
}

/// What one policy row attended: for (sequence, KV head) of a decode row in a non-dense layer, the sorted
/// half-open position spans whose keys exact attention read (after selection, pruning and early stop),
/// adjacent spans merged (the same canonical form on both backends).
/// Collected only when asked for ([`crate::Engine::record_visits`]); evaluation uses it to measure the
/// attention mass a policy recovered. Dense rows are not recorded (they visit every visible position).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisitRecord {
    pub layer: usize,
    pub seq_id: u64,
    pub kv_head: usize,
    pub spans: Vec<(usize, usize)>,
    /// Under a stage that terminates the traversal: (tiles visited, tiles of the whole traversal); else `None`.
    pub traversal_tiles: Option<(u32, u32)>,
}
