// Per-sequence state slots on the device (src/cuda/slots.rs).
//
// A captured decode step's sequence ids live in device memory, so the host cannot map them to state. This
// module keeps the map on the device: an open-addressing hash table of 64-bit sequence ids (linear
// probing, `tsize` a power of two, at least twice the slot count) whose entries name a slot in
// `0..max_seqs`, taken from a free stack on first sight of an id. Every policy that keeps per-sequence state
// indexes its device arrays by that slot and stamps what it writes with the slot's generation, which the
// insert bumps: state stamped with an older generation belongs to a released sequence and reads as empty.
//
// Release (host, after a device sync) marks the entry a tombstone and pushes the slot back. Ids are unique
// within a call (the engine's contract); a row whose id finds no entry and no free slot gets slot -1 (its
// policy rows then run dense, exact, and are counted as `rows without state`).

#include "common.cuh"

#define SLOT_EMPTY 0xffffffffffffffffull
#define SLOT_TOMB 0xfffffffffffffffeull

__device__ __forceinline__ unsigned long long slot_hash(unsigned long long x) {
    // splitmix64's finaliser: ids are often small consecutive integers.
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

// One thread per sequence of the call. `ids` are int64/uint64 with element stride `ids_s`. Writes the
// slot (or -1) and its generation for each row. The two reserved key values cannot be stored: such an id
// gets slot -1. `counters[0]` counts rows left without a slot, `counters[1]` the ids given a slot
// (sequences created); both monotonic, read by the stats call.
extern "C" __global__ void kvs_seq_slots(const unsigned long long* __restrict__ ids, long long ids_s, int n,
                                         unsigned long long* keys, int* entry_slot, int tsize_log2,
                                         int* free_stack, int* free_top, unsigned* gen,
                                         int* out_slot, unsigned* out_gen, unsigned long long* counters) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long id = ids[(long long)i * ids_s];
    const unsigned mask = (1u << tsize_log2) - 1u;
    int slot = -1;
    if (id != SLOT_EMPTY && id != SLOT_TOMB) {
        const unsigned h = (unsigned)slot_hash(id) & mask;
        // Lookup: probe until an empty entry (tombstones are skipped).
        int found = -1;
        for (unsigned k = 0; k <= mask; ++k) {
            const unsigned e = (h + k) & mask;
            const unsigned long long key = keys[e];
            if (key == id) { found = (int)e; break; }
            if (key == SLOT_EMPTY) break;
        }
        if (found >= 0) {
            slot = entry_slot[found];
        } else {
            // Insert: claim the first empty or tombstone entry on the probe path.
            for (unsigned k = 0; k <= mask; ++k) {
                const unsigned e = (h + k) & mask;
                unsigned long long key = keys[e];
                if (key != SLOT_EMPTY && key != SLOT_TOMB) continue;
                if (atomicCAS(&keys[e], key, id) != key) continue;
                const int t = atomicSub(free_top, 1) - 1;
                if (t < 0) {
                    // No free slot: undo the claim (the entry becomes a tombstone).
                    atomicAdd(free_top, 1);
                    entry_slot[e] = -1;
                    keys[e] = SLOT_TOMB;
                } else {
                    slot = free_stack[t];
                    gen[slot] += 1u;
                    entry_slot[e] = slot;
                    atomicAdd(&counters[1], 1ull);  // sequences created
                }
                break;
            }
        }
    }
    out_slot[i] = slot;
    out_gen[i] = slot >= 0 ? gen[slot] : 0u;
    if (slot < 0) atomicAdd(&counters[0], 1ull);
}
