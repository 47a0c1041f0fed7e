//! Counters users tune policies with: what was eligible, what was visited, what each stage removed.
//! Kept per layer (plus totals) in the engine, and per call for the caller that asks.

/// Defines [`Counters`] from one list of its shared fields: `name @ n` where device counter slot `n`
/// (kernels/include/decide.cuh CTR_*) holds it on the CUDA backend. Every field is read from its slot,
/// added and subtracted alike, so a counter needs nothing but its line; the stages' own counters
/// ([`StageCounter`]) are read, added and subtracted the same way.
macro_rules! counters {
    ( $( $(#[$doc:meta])* $field:ident $(@ $slot:literal)? ),* $(,)? ) => {
        /// One set of counters. Also the payload of the C struct `kvs_stats` (see `policy::kvs_stats`).
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Counters {
            $( $(#[$doc])* pub $field: u64, )*
            /// Each stage's own counters, read and counted as `counters[top_p::KEPT]`.
            pub stages: StageCounts,
        }

        /// The device slots of the shared counters (those a stage's own counter must not take).
        const SHARED_DEVICE_SLOTS: &[usize] = &[$( $( $slot, )? )*];

        impl Counters {
            /// The counters a layer's device slots hold (kernels/include/decide.cuh CTR_*): the shared ones
            /// and those of `stage_counters` (the policy registry's `STAGE_COUNTERS`) that have a slot; the
            /// others zero.
            pub(crate) fn from_device_slots(c: &[u64], stage_counters: &[&[StageCounter]]) -> Counters {
                let mut out = Counters::default();
                $( $( out.$field = c[$slot]; )? )*
                for s in stage_counters.iter().copied().flatten() {
                    if let Some(slot) = s.device_slot {
                        out[*s] = c[slot];
                    }
                }
                out
            }

            pub fn add(&mut self, o: &Counters) {
                $( self.$field += o.$field; )*
                for (a, b) in self.stages.0.iter_mut().zip(o.stages.0) {
                    *a += b;
                }
            }

            /// What was counted since `before` (an earlier reading of the same, only growing, counters).
            pub fn since(&self, before: &Counters) -> Counters {
                let f = |a: u64, b: u64| a.saturating_sub(b);
                Counters { $( $field: f(self.$field, before.$field), )* stages: StageCounts(std::array::from_fn(|i| f(self.stages.0[i], before.stages.0[i]))) }
            }
        }
    };
}

// The counters every stage shares; each stage's own are declared in its folder (`StageCounter`). The C
// ABI's `kvs_stats` names both (src/policy/registry.rs). A leaf: the policies and backends that fill
// them import this file, so it imports none of them. A stage fills its fields where it runs.
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
}

/// Device counter slots per layer (kernels/include/decide.cuh CTR_COUNT).
pub(crate) const DEVICE_COUNTER_SLOTS: usize = 16;

/// Room for the stages' own counters in [`Counters`] (the registry's table must fit; checked at build).
pub const MAX_STAGE_COUNTERS: usize = 16;

/// The values of the stages' own counters, in the places their [`StageCounter`]s name (zero where none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageCounts([u64; MAX_STAGE_COUNTERS]);

/// A counter one stage keeps beyond the shared ones, declared as a constant in the stage's folder (e.g.
/// `top_p::KEPT`) and read or counted as `counters[top_p::KEPT]`: its place in [`StageCounts`] and, when
/// the stage's kernels count it on the CUDA backend, its device counter slot (decide.cuh CTR_*). The
/// policy registry's `STAGE_COUNTERS` lists every stage's (one line per stage), so the build checks
/// that no two share a place or a slot ([`check_stage_counters`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageCounter {
    index: usize,
    device_slot: Option<usize>,
}

impl StageCounter {
    /// A counter the host counts, at place `index`.
    pub(crate) const fn host(index: usize) -> Self {
        StageCounter { index, device_slot: None }
    }

    /// A counter the stage's kernels count in device slot `slot`, at place `index`.
    pub(crate) const fn device(index: usize, slot: usize) -> Self {
        StageCounter { index, device_slot: Some(slot) }
    }
}

/// Fails (at build time, called in a `const`) unless the stages' counters fit [`StageCounts`] and the
/// device's slots, and no two counters (shared ones included) share a place or a device slot.
pub(crate) const fn check_stage_counters(stages: &[&[StageCounter]]) {
    let (mut places, mut slots) = ([false; MAX_STAGE_COUNTERS], [false; DEVICE_COUNTER_SLOTS]);
    let mut i = 0;
    while i < SHARED_DEVICE_SLOTS.len() {
        slots[SHARED_DEVICE_SLOTS[i]] = true;
        i += 1;
    }
    i = 0;
    while i < stages.len() {
        let mut j = 0;
        while j < stages[i].len() {
            let c = stages[i][j];
            assert!(c.index < MAX_STAGE_COUNTERS, "a stage counter's place is past MAX_STAGE_COUNTERS");
            assert!(!places[c.index], "two stage counters share a place");
            places[c.index] = true;
            if let Some(s) = c.device_slot {
                assert!(s < DEVICE_COUNTER_SLOTS, "a stage counter's device slot is past DEVICE_COUNTER_SLOTS");
                assert!(!slots[s], "two counters share a device slot");
                slots[s] = true;
            }
            j += 1;
        }
        i += 1;
    }
}

impl std::ops::Index<StageCounter> for Counters {
    type Output = u64;
    fn index(&self, c: StageCounter) -> &u64 {
        &self.stages.0[c.index]
    }
}

impl std::ops::IndexMut<StageCounter> for Counters {
    fn index_mut(&mut self, c: StageCounter) -> &mut u64 {
        &mut self.stages.0[c.index]
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const DEV: StageCounter = StageCounter::device(0, 5);
    const HOST: StageCounter = StageCounter::host(3);

    /// A stage's counters are read from their device slots (those with one), added and subtracted as the
    /// shared ones are.
    #[test]
    fn stage_counters_are_read_added_and_subtracted_like_the_shared_ones() {
        let slots: Vec<u64> = (100..100 + DEVICE_COUNTER_SLOTS as u64).collect();
        let d = Counters::from_device_slots(&slots, &[&[DEV, HOST]]);
        assert_eq!((d.decode_rows, d.blocks_visited, d[DEV], d[HOST]), (100, 104, 105, 0));
        assert_eq!(Counters::from_device_slots(&slots, &[])[DEV], 0, "a counter no table lists is not read");
        let mut c = d;
        c[HOST] += 7;
        c.add(&d);
        assert_eq!((c.decode_rows, c[DEV], c[HOST]), (200, 210, 7));
        let s = c.since(&d);
        assert_eq!((s.decode_rows, s[DEV], s[HOST]), (100, 105, 7));
        assert_eq!(d.since(&c)[DEV], 0, "saturates");
    }

    #[test]
    fn distinct_stage_counters_pass_the_check() {
        check_stage_counters(&[&[DEV, HOST], &[StageCounter::device(1, 6), StageCounter::host(MAX_STAGE_COUNTERS - 1)]]);
    }

    #[test]
    #[should_panic(expected = "share a place")]
    fn two_stage_counters_in_one_place_fail_the_check() {
        check_stage_counters(&[&[DEV], &[StageCounter::host(0)]]);
    }

    #[test]
    #[should_panic(expected = "share a device slot")]
    fn a_stage_counter_in_a_shared_counters_slot_fails_the_check() {
        check_stage_counters(&[&[StageCounter::device(1, 4)]]);
    }

    #[test]
    #[should_panic(expected = "past MAX_STAGE_COUNTERS")]
    fn a_stage_counter_past_the_room_fails_the_check() {
        check_stage_counters(&[&[StageCounter::host(MAX_STAGE_COUNTERS)]]);
    }
}
