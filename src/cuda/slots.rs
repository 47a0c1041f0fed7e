//! Per-sequence state slots on the device, for the policies whose state belongs to a sequence rather than
//! to cache blocks (RefreshKV's schedule and token sets, AttentionPredictor's history).
//!
//! Why on the device: a serving engine replays a captured decode step whose sequence ids sit in device
//! memory, so the host cannot look them up. `kernels/slots.cu` keeps an open-addressing table from 64-bit
//! sequence id to a slot in `0..max_seqs` (the spec option `max_seqs`), claimed from a free stack the first
//! time an id is seen. Each call looks its rows up (one small launch, capturable) and hands the policy
//! kernels a slot and a generation per sequence; the generation, bumped whenever a slot is handed to a new
//! sequence, tells a policy that the state stamped in its arrays belongs to a released sequence.
//!
//! Release (`kvs_sequence_release`) synchronizes the device, then edits the table on the host: the entry
//! becomes a tombstone and the slot goes back on the free stack (the table is rebuilt when tombstones pile
//! up). When every slot is taken, a new sequence's rows run dense attention (exact) and are counted as
//! `policy_rows_without_state`: the engine never makes up state, and the stats say it happened.

use parking_lot::Mutex;

use super::context::{DevBuf, Gpu};
use super::launch::{self, KArgs, Modules};
use crate::error::{Error, ErrorKind, Result};
use crate::tensor::TensorRef;
use crate::{bail, ensure};

const EMPTY: u64 = u64::MAX;
const TOMB: u64 = u64::MAX - 1;

use crate::policy::spec::MAX_MAX_SEQS;

pub use super::kernel_src::SLOTS;

/// The device-side map from sequence id to state slot.
pub struct SeqSlots {
    max_seqs: usize,
    tsize_log2: u32,
    keys: DevBuf,
    entry_slot: DevBuf,
    free_stack: DevBuf,
    free_top: DevBuf,
    gen: DevBuf,
    /// [0]: rows left without a slot since the engine started; [1]: ids given a slot (created).
    counters: DevBuf,
    /// Successful releases (the host edits the table).
    released: std::sync::atomic::AtomicU64,
    /// Serializes releases (host edits of the table) with each other; holds the tombstones released since
    /// the last rebuild.
    edit: Mutex<usize>,
}

fn bytes_of<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slice viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

impl SeqSlots {
    /// An empty map for at most `max_seqs` live sequences.
    pub fn new(max_seqs: usize) -> Result<Self> {
        ensure!((1..=MAX_MAX_SEQS).contains(&max_seqs), Unsupported, "max_seqs must be in 1..={MAX_MAX_SEQS} (got {max_seqs})");
        let tsize = (2 * max_seqs).next_power_of_two();
        let keys = DevBuf::from_host(bytes_of(&vec![EMPTY; tsize]))?;
        let entry_slot = DevBuf::from_host(bytes_of(&vec![-1i32; tsize]))?;
        // Slot 0 is popped first (the stack's top is its last element).
        let stack: Vec<i32> = (0..max_seqs as i32).rev().collect();
        let free_stack = DevBuf::from_host(bytes_of(&stack))?;
        let free_top = DevBuf::from_host(bytes_of(&[max_seqs as i32]))?;
        let gen = DevBuf::from_host(bytes_of(&vec![0u32; max_seqs]))?;
        let counters = DevBuf::from_host(&[0u8; 16])?;
        Ok(SeqSlots { max_seqs, tsize_log2: tsize.trailing_zeros(), keys, entry_slot, free_stack, free_top, gen, counters, released: Default::default(), edit: Mutex::new(0) })
    }

    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }

    /// Enqueues the lookup (inserting unknown ids) of the call's `n` sequence ids on `stream`: slot (i32,
    /// -1 = none) and generation (u32) per row into the device arrays at `out_slot` / `out_gen`. `pdl`: launch
    /// as a dependent of the kernel before it (a policy layer's chain; kvs_seq_slots starts with
    /// KVS_GRID_WAIT()); the caller has checked the GPU has them (`Device::pdl`).
    #[allow(clippy::too_many_arguments)]
    pub fn lookup(&self, gpu: &Gpu, modules: &Modules, ids: &TensorRef, n: usize, out_slot: u64, out_gen: u64, stream: super::driver::CUstream, pdl: bool) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = modules.function(gpu, "slots", SLOTS, &[], "kvs_seq_slots")?;
        let mut k = KArgs::new();
        k.ptr(ids.data).i64(ids.stride(0) as i64).i32(n as i32);
        k.i64(self.keys.ptr as i64).i64(self.entry_slot.ptr as i64).i32(self.tsize_log2 as i32);
        k.i64(self.free_stack.ptr as i64).i64(self.free_top.ptr as i64).i64(self.gen.ptr as i64);
        k.i64(out_slot as i64).i64(out_gen as i64).i64(self.counters.ptr as i64);
        launch::launch_dependent(pdl, f, (n.div_ceil(128) as u32, 1, 1), 128, 0, &mut k, stream, "kvs_seq_slots launch")
    }

    /// Rows left without a slot so far, and live sequences (synchronizes the device).
    pub fn read_counts(&self, gpu: &Gpu) -> Result<(u64, u64)> {
        gpu.synchronize()?;
        let mut c = [0u8; 8];
        self.counters.download(0, &mut c)?;
        let mut top = [0u8; 4];
        self.free_top.download(0, &mut top)?;
        let free = i32::from_le_bytes(top).clamp(0, self.max_seqs as i32) as u64;
        Ok((u64::from_le_bytes(c), self.max_seqs as u64 - free))
    }

    /// Sequences created (ids given a slot) and released since the map was made (synchronizes the device).
    pub fn lifecycle(&self, gpu: &Gpu) -> Result<(u64, u64)> {
        gpu.synchronize()?;
        let mut c = [0u8; 16];
        self.counters.download(0, &mut c)?;
        Ok((u64::from_le_bytes(c[8..].try_into().expect("8 bytes")), self.released.load(std::sync::atomic::Ordering::Relaxed)))
    }

    /// Frees `id`'s slot (synchronizes the device first, so no enqueued step still uses it). Unknown ids
    /// are an error, as on the CPU engine. Reads only the entries on the id's probe path (a few bytes per
    /// release: serving engines release every finished request); the whole table only when tombstones
    /// call for a rebuild.
    pub fn release(&self, gpu: &Gpu, id: u64) -> Result<()> {
        let mut tombs = self.edit.lock();
        gpu.synchronize()?;
        let tsize = 1usize << self.tsize_log2;
        let mask = tsize - 1;
        let key_at = |e: usize| -> Result<u64> {
            let mut b = [0u8; 8];
            self.keys.download(e * 8, &mut b)?;
            Ok(u64::from_le_bytes(b))
        };
        let mut found = None;
        if id != EMPTY && id != TOMB {
            let h = (hash(id) as usize) & mask;
            for k in 0..tsize {
                let e = (h + k) & mask;
                match key_at(e)? {
                    x if x == id => {
                        found = Some(e);
                        break;
                    }
                    EMPTY => break,
                    _ => {}
                }
            }
        }
        let Some(e) = found else {
            bail!(UnknownSequence, "sequence {id} is not known to this engine (never used in a forward call, or already released)");
        };
        let mut sb = [0u8; 4];
        self.entry_slot.download(e * 4, &mut sb)?;
        let slot = i32::from_le_bytes(sb);
        let mut top = [0u8; 4];
        self.free_top.download(0, &mut top)?;
        let top = i32::from_le_bytes(top);
        if slot >= 0 {
            ensure!((top as usize) < self.max_seqs, Internal, "slot free stack is full while releasing slot {slot}");
            self.free_stack.upload(top as usize * 4, bytes_of(&[slot]))?;
            self.free_top.upload(0, bytes_of(&[top + 1]))?;
        }
        // Tombstones lengthen every probe: rebuild the table when they are a quarter of it (counted here;
        // the few the lookup kernel leaves when no slot is free are found at the rebuild).
        *tombs += 1;
        if *tombs * 4 > tsize {
            let mut keys = vec![0u64; tsize];
            // SAFETY: a u64 slice viewed as bytes for the download.
            self.keys.download(0, unsafe { std::slice::from_raw_parts_mut(keys.as_mut_ptr() as *mut u8, tsize * 8) })?;
            let mut slots = vec![0i32; tsize];
            // SAFETY: as above.
            self.entry_slot.download(0, unsafe { std::slice::from_raw_parts_mut(slots.as_mut_ptr() as *mut u8, tsize * 4) })?;
            keys[e] = TOMB;
            slots[e] = -1;
            let mut nk = vec![EMPTY; tsize];
            let mut ns = vec![-1i32; tsize];
            for (&k, &s) in keys.iter().zip(&slots) {
                if k == EMPTY || k == TOMB {
                    continue;
                }
                let mut e = (hash(k) as usize) & mask;
                while nk[e] != EMPTY {
                    e = (e + 1) & mask;
                }
                nk[e] = k;
                ns[e] = s;
            }
            self.keys.upload(0, bytes_of(&nk))?;
            self.entry_slot.upload(0, bytes_of(&ns))?;
            *tombs = 0;
        } else {
            self.keys.upload(e * 8, bytes_of(&[TOMB]))?;
            self.entry_slot.upload(e * 4, bytes_of(&[-1i32]))?;
        }
        self.released.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// The kernel's hash (splitmix64's finaliser).
fn hash(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d049bb133111eb);
    x ^= x >> 31;
    x
}

/// Bytes of per-slot state arrays: `max_seqs × per_slot`, checked.
pub fn state_bytes(max_seqs: usize, per_slot: usize) -> Result<usize> {
    max_seqs.checked_mul(per_slot).ok_or_else(|| Error::new(ErrorKind::OutOfMemory, "per-sequence device state size overflows"))
}
