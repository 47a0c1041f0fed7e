//! Counters users tune policies with: what was eligible, what was visited, what each stage removed.
//! Kept per layer (plus totals) in the engine, and per call for the caller that asks.

/// Defines [`Counters`]: the shared counters below, then each stage's own (listed where the macro is
/// expanded): `name @ n` where device counter slot `n` (kernels/include/decide.cuh CTR_*) holds it on the
/// CUDA backend. Every field is added and subtracted alike, so a stage's counters need nothing but their
/// line.
macro_rules! counters {
    ( $( $(#[$doc:meta])* $field:ident $(@ $slot:literal)? ),* $(,)? ) => {
        /// One set of counters. Also the payload of the C struct `kvs_stats` (see `ffi::types`).
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Counters {
            /// Forward calls (per layer: calls that touched that layer).
            pub calls: u64,
            /// Query rows of prefill / chunked-prefill sequences (query length > 1).
            pub prefill_tokens: u64,
            /// Decode rows (query length 1), dense or not.
            pub decode_rows: u64,
            /// Decode rows × KV heads that went through a non-dense policy.
            pub policy_rows: u64,
            /// KV blocks that dense attention would have visited for those policy rows (per KV head).
            pub blocks_eligible: u64,
            /// KV blocks (per KV head) whose keys were actually read.
            pub blocks_visited: u64,
            /// Blocks the selector offered but a stage that terminates the traversal did not visit.
            pub blocks_skipped_termination: u64,
            /// Bytes of K and V read by attention (all rows, dense and sparse).
            pub kv_bytes_read: u64,
            /// A stage that terminates the traversal: the steps (tiles of its visit order) visited, and those
            /// of the whole traversals (Rust only).
            pub traversal_tiles_visited: u64,
            pub traversal_tiles_total: u64,
            $( $(#[$doc])* pub $field: u64, )*
        }

        impl Counters {
            /// The counters a layer's device slots hold (kernels/include/decide.cuh CTR_*); the others zero.
            pub(crate) fn from_device_slots(c: &[u64]) -> Counters {
                #[allow(unused_mut)]
                let mut out = Counters {
                    decode_rows: c[0],
                    prefill_tokens: c[1],
                    policy_rows: c[2],
                    blocks_eligible: c[3],
                    blocks_visited: c[4],
                    kv_bytes_read: c[7],
                    blocks_skipped_termination: c[8],
                    traversal_tiles_visited: c[9],
                    traversal_tiles_total: c[10],
                    ..Counters::default()
                };
                $( $( out.$field = c[$slot]; )? )*
                out
            }

            pub fn add(&mut self, o: &Counters) {
                self.calls += o.calls;
                self.prefill_tokens += o.prefill_tokens;
                self.decode_rows += o.decode_rows;
                self.policy_rows += o.policy_rows;
                self.blocks_eligible += o.blocks_eligible;
                self.blocks_visited += o.blocks_visited;
                self.blocks_skipped_termination += o.blocks_skipped_termination;
                self.kv_bytes_read += o.kv_bytes_read;
                self.traversal_tiles_visited += o.traversal_tiles_visited;
                self.traversal_tiles_total += o.traversal_tiles_total;
                $( self.$field += o.$field; )*
            }

            /// What was counted since `before` (an earlier reading of the same, only growing, counters).
            pub fn since(&self, before: &Counters) -> Counters {
                let f = |a: u64, b: u64| a.saturating_sub(b);
                Counters {
                    calls: f(self.calls, before.calls),
                    prefill_tokens: f(self.prefill_tokens, before.prefill_tokens),
                    decode_rows: f(self.decode_rows, before.decode_rows),
                    policy_rows: f(self.policy_rows, before.policy_rows),
                    blocks_eligible: f(self.blocks_eligible, before.blocks_eligible),
                    blocks_visited: f(self.blocks_visited, before.blocks_visited),
                    blocks_skipped_termination: f(self.blocks_skipped_termination, before.blocks_skipped_termination),
                    kv_bytes_read: f(self.kv_bytes_read, before.kv_bytes_read),
                    traversal_tiles_visited: f(self.traversal_tiles_visited, before.traversal_tiles_visited),
                    traversal_tiles_total: f(self.traversal_tiles_total, before.traversal_tiles_total),
                    $( $field: f(self.$field, before.$field), )*
                }
            }
        }
    };
}

// Each stage's counters, after the shared ones: the C ABI's `kvs_stats` names them (src/ffi/types.rs), so
// this list mirrors the ABI (a leaf: the policies and backends that fill them import this file, so it
// imports none of them). A stage fills its fields where it runs.
counters! {
    /// Tokens offered to top-p, and tokens it kept.
    top_p_candidates @ 5, top_p_kept @ 6,
    /// Speculate/repair: blocks predicted, of those in the true set, and missed blocks repaired.
    spec_predicted_blocks @ 11, spec_hit_blocks @ 13, spec_true_blocks @ 12, spec_repaired_blocks @ 14,
    /// Speculate/repair baseline: blocks of the true set that the previous step's true set held
    /// (what reusing the previous selection would have hit; compare with `spec_hit_blocks`).
    spec_reuse_hit_blocks @ 15,
    /// PRR calibrations run at prefill (per sequence × KV head) and their total time in microseconds.
    spec_calibrations, spec_calib_us,
    /// Refresh scheduling: full-attention steps and partial (token-set) steps.
    refresh_full_steps, refresh_partial_steps,
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
