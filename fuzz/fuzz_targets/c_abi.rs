//! The C ABI's argument validation on arbitrary DLTensor descriptors (ndim, shapes, strides, byte
//! offsets, dtypes, devices, NULL pointers) and arbitrary batch metadata, through the exported
//! `kvs_*` functions, as a C caller would call them.
//!
//! Every tensor the harness passes is honest about its memory: when its descriptor addresses at most
//! 256 KiB, `data` points into an allocation of exactly those bytes (so AddressSanitizer reports any
//! read or write outside them); a larger descriptor gets `data = NULL` (the library must reject it, which
//! is how overflowing element counts are caught); an empty one gets NULL or a dangling pointer. About
//! half the calls use coherent batches (valid block ids, lengths and slots) so the kernels run too.
//!
//! Checked on every call: no crash or sanitizer report, no `KVS_ERR_INTERNAL` (a caught panic), a message
//! on every failure, and on failure nothing written (outputs and caches compared byte for byte).
//! Legit work stays small: a sequence is at most 4096 tokens when the table's extent is large.
#![no_main]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ffi::CStr;
use std::sync::OnceLock;

use kvsparse::ffi::dlpack::{dtype_to_dl as dl, DLDevice, DLTensor};
use kvsparse::ffi::*;
use kvsparse::policy::speculate::kvs_engine_set_speculation_budgets;
use kvsparse::DType;
use libfuzzer_sys::fuzz_target;

/// Fuzz bytes as a stream of choices (zeros when exhausted).
struct R<'a> {
    d: &'a [u8],
    i: usize,
}

impl R<'_> {
    fn u8(&mut self) -> u8 {
        let v = self.d.get(self.i).copied().unwrap_or(0);
        self.i += 1;
        v
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn below(&mut self, n: usize) -> usize {
        if n <= 1 {
            0
        } else {
            self.u16() as usize % n
        }
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    /// True with probability k/16; false once the input is exhausted (so short inputs make honest calls).
    fn chance(&mut self, k: u8) -> bool {
        self.u8() % 16 >= 16 - k
    }
}

const BIG: [i64; 9] = [i32::MAX as i64, 1 << 32, (1 << 32) + 1, 1 << 40, 1 << 62, i64::MAX, -1, i64::MIN, 65537];
const CAP: usize = 256 << 10;

fn of(dt: kvs_dtype) -> DType {
    match dt {
        kvs_dtype::KVS_DTYPE_FLOAT32 => DType::F32,
        kvs_dtype::KVS_DTYPE_FLOAT16 => DType::F16,
        kvs_dtype::KVS_DTYPE_BFLOAT16 => DType::BF16,
    }
}

/// A DLTensor plus everything it points to.
struct T {
    desc: DLTensor,
    _shape: Vec<i64>,
    _strides: Option<Vec<i64>>,
    mem: Option<(*mut u8, Layout)>,
    /// Logical element → byte offset in `mem` (valid descriptors with memory only).
    layout: Option<(Vec<i64>, Vec<i64>, usize, i64)>, // shape, strides, elem size, base offset in elements
}

impl Drop for T {
    fn drop(&mut self) {
        if let Some((p, l)) = self.mem {
            // SAFETY: allocated with this layout in `build`.
            unsafe { dealloc(p, l) }
        }
    }
}

impl T {
    fn bytes(&self) -> Vec<u8> {
        match self.mem {
            // SAFETY: the allocation holds l.size() initialised bytes.
            Some((p, l)) => unsafe { std::slice::from_raw_parts(p, l.size()) }.to_vec(),
            None => Vec::new(),
        }
    }
    /// Writes integer `v` at logical index `idx` (if the tensor has memory and the index exists).
    fn set_int(&mut self, idx: &[i64], v: i64, _role: DType) {
        let (Some((p, _)), Some((shape, strides, es, base))) = (self.mem, &self.layout) else { return };
        if idx.len() != shape.len() || idx.iter().zip(shape.iter()).any(|(&i, &s)| i < 0 || i >= s) {
            return;
        }
        let off: i64 = idx.iter().zip(strides.iter()).map(|(&i, &s)| i * s).sum::<i64>() - base;
        let at = (off as usize) * es;
        // SAFETY: the index is inside the shape, so the element (of the descriptor's size, which the
        // fuzzer may have changed from the role's) lies inside the allocation.
        unsafe {
            match es {
                8 => (p.add(at) as *mut i64).write_unaligned(v),
                4 => (p.add(at) as *mut i32).write_unaligned(v as i32),
                _ => (p.add(at) as *mut i16).write_unaligned(v as i16),
            }
        }
    }
}

/// Builds a tensor for a role whose honest shape is `shape`; the fuzzer may change rank, extents,
/// strides, offset, dtype and device. Float memory is filled with fuzz-chosen values (NaN and inf too).
fn build(r: &mut R, shape: &[i64], elem: DType) -> T {
    let mut shape = shape.to_vec();
    let mut elem_dl = dl(elem);
    let mut device = DLDevice { device_type: 1, device_id: 0 };
    let mut byte_offset = 0u64;
    let mut strides: Option<Vec<i64>> = None;
    let mutate = r.chance(6);
    if mutate {
        match r.below(8) {
            0 => shape.truncate(r.below(shape.len() + 1)),
            1 => shape.push(r.pick(&[0, 1, 2, 7])),
            _ => {}
        }
        for s in shape.iter_mut() {
            if r.chance(3) {
                *s = if r.chance(8) { r.pick(&BIG) } else { r.below(9) as i64 };
            }
        }
        if r.chance(2) {
            elem_dl = dl(r.pick(&[DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U64]));
            if r.chance(2) {
                elem_dl.lanes = 2;
            }
            if r.chance(2) {
                elem_dl.code = 9;
            }
        }
        if r.chance(1) {
            device = DLDevice { device_type: r.pick(&[2, 3, 7, -1]), device_id: r.pick(&[0, 1, -1]) };
        }
        if r.chance(2) {
            byte_offset = r.pick(&[1, 2, 4, 8, 64, u64::MAX - 3, 1 << 63]);
        }
    }
    // Strides: compact (NULL or explicit), broadcast, padded, or fuzz values.
    if mutate && r.chance(8) || r.chance(3) {
        let mut st = vec![0i64; shape.len()];
        let mut acc = 1i64;
        let pad = r.below(3) as i64;
        for i in (0..shape.len()).rev() {
            st[i] = match r.below(10) {
                0 => 0,
                1 => r.pick(&BIG),
                2 => r.below(70) as i64,
                _ => acc,
            };
            acc = acc.saturating_mul(shape[i].max(1)).saturating_add(pad);
        }
        strides = Some(st);
    }
    let ndim = if mutate && r.chance(1) { r.pick(&[-1, 6, 100, i32::MAX]) } else { shape.len() as i32 };
    let es = match (elem_dl.code, elem_dl.bits) {
        (_, 16) => 2,
        (_, 64) => 8,
        _ => 4,
    };
    // The harness's own extent computation (i128: nothing overflows here).
    let valid = (0..=5).contains(&ndim) && shape.iter().all(|&s| s >= 0) && elem_dl.lanes == 1;
    let eff: Vec<i64> = match &strides {
        Some(s) => s.clone(),
        None => {
            let mut st = vec![0i64; shape.len()];
            let mut acc = 1i64;
            for i in (0..shape.len()).rev() {
                st[i] = acc;
                acc = acc.saturating_mul(shape[i].max(1));
            }
            st
        }
    };
    let numel: i128 = shape.iter().try_fold(1i128, |a, &s| a.checked_mul(s as i128)).unwrap_or(i128::MAX);
    let (mut lo, mut hi) = (0i128, 0i128);
    for (&s, &st) in shape.iter().zip(&eff) {
        let reach = (s as i128 - 1).max(0) * st as i128;
        if reach < 0 {
            lo = lo.saturating_add(reach)
        } else {
            hi = hi.saturating_add(reach)
        }
    }
    let mut t = T { desc: DLTensor { data: std::ptr::null_mut(), device, ndim, dtype: elem_dl, shape: std::ptr::null_mut(), strides: std::ptr::null_mut(), byte_offset }, _shape: Vec::new(), _strides: None, mem: None, layout: None };
    let span = hi.saturating_sub(lo).saturating_add(1).saturating_mul(es as i128);
    if valid && numel > 0 && span <= CAP as i128 && byte_offset < 1 << 20 {
        let layout = Layout::from_size_align(span as usize, 16).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        assert!(!p.is_null());
        // Fill: floats with fuzz-chosen values, ints with a fuzz byte pattern (overwritten where coherent).
        // A 64-byte pattern repeated (cheap even for 256 KiB).
        let fill = r.pick(&[0u8, 1, 2, 3]);
        let mut pat = [0u8; 64];
        for (b, x) in pat.iter_mut().enumerate() {
            *x = match fill {
                0 => 0u8,
                1 => (b as u8).wrapping_mul(37) & 0x3f,
                2 => 0xff, // NaN patterns / -1
                _ => r.u8(),
            };
        }
        // SAFETY: the allocation holds `span` bytes.
        let mem = unsafe { std::slice::from_raw_parts_mut(p, span as usize) };
        for chunk in mem.chunks_mut(64) {
            chunk.copy_from_slice(&pat[..chunk.len()]);
        }
        t.mem = Some((p, layout));
        t.layout = Some((shape.clone(), eff.clone(), es, lo as i64));
        // data + byte_offset + lo*es == p
        t.desc.data = (p as usize).wrapping_sub(byte_offset as usize).wrapping_sub((lo * es as i128) as usize) as *mut _;
    } else if valid && numel == 0 && r.chance(8) {
        t.desc.data = std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut _;
    } else if !valid && r.chance(4) {
        // An invalid descriptor with a real (tiny) pointer: must be rejected before any access.
        let layout = Layout::from_size_align(16, 16).unwrap();
        // SAFETY: non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        t.mem = Some((p, layout));
        t.desc.data = p as *mut _;
    }
    t._shape = shape;
    t.desc.shape = if t._shape.is_empty() && r.chance(8) { std::ptr::null_mut() } else { t._shape.as_mut_ptr() };
    t._strides = strides;
    if let Some(s) = t._strides.as_mut() {
        t.desc.strides = s.as_mut_ptr();
    }
    t
}

fn ptr(t: &Option<Box<T>>) -> *const DLTensor {
    t.as_ref().map_or(std::ptr::null(), |t| &t.desc as *const DLTensor)
}

/// Builds a tensor, or (rarely) none: a NULL DLTensor pointer.
fn arg(r: &mut R, shape: &[i64], elem: DType) -> Option<Box<T>> {
    if r.chance(1) && r.chance(8) {
        None
    } else {
        Some(Box::new(build(r, shape, elem)))
    }
}

struct Eng {
    p: *mut kvs_engine,
    cfg: kvs_engine_config,
}
unsafe impl Send for Eng {}
unsafe impl Sync for Eng {}

fn engines() -> &'static [Eng] {
    static E: OnceLock<Vec<Eng>> = OnceLock::new();
    E.get_or_init(|| {
        let specs: [(kvs_dtype, u32, u32, u32, u32, &CStr); 5] = [
            (kvs_dtype::KVS_DTYPE_FLOAT32, 4, 2, 16, 2, c""),
            (kvs_dtype::KVS_DTYPE_FLOAT16, 4, 4, 1, 1, c"quest(budget=8, page=4); dense_layers=0"),
            (kvs_dtype::KVS_DTYPE_BFLOAT16, 8, 2, 4, 1, c"quest(budget=16) > top_p(p=0.9) > art(patience=2); dense_layers=0"),
            (kvs_dtype::KVS_DTYPE_FLOAT32, 4, 1, 16, 1, c"speculate(over=quest(budget=32)); dense_layers=0"),
            (kvs_dtype::KVS_DTYPE_FLOAT16, 4, 2, 8, 1, c"snapkv(budget=8, window=4); dense_layers=0"),
        ];
        specs
            .iter()
            .map(|&(dtype, hq, hk, bs, threads, policy)| unsafe {
                let mut cfg = std::mem::zeroed::<kvs_engine_config>();
                assert_eq!(kvs_engine_config_init(&mut cfg), kvs_status::KVS_OK);
                cfg.num_layers = 2;
                cfg.num_q_heads = hq;
                cfg.num_kv_heads = hk;
                cfg.head_dim = 64;
                cfg.block_size = bs;
                cfg.dtype = dtype;
                cfg.num_threads = threads;
                cfg.policy = policy.as_ptr();
                let mut p = std::ptr::null_mut();
                assert_eq!(kvs_engine_create(&cfg, &mut p), kvs_status::KVS_OK, "{:?}", CStr::from_ptr(kvs_last_error()));
                Eng { p, cfg }
            })
            .collect()
    })
}

/// The status must be a documented one, never a caught panic, and come with a message on failure.
fn check_status(st: kvs_status, what: &str) {
    let code = st as i32;
    assert!((0..=9).contains(&code), "{what}: undocumented status {code}");
    if st != kvs_status::KVS_OK {
        // SAFETY: never NULL, NUL-terminated.
        let msg = unsafe { CStr::from_ptr(kvs_last_error()) }.to_string_lossy().into_owned();
        assert!(st != kvs_status::KVS_ERR_INTERNAL, "{what}: internal error (a panic?): {msg}");
        assert!(!msg.is_empty() && msg != "no error", "{what}: status {code} without a message");
    }
}

/// A coherent batch plan: per sequence (q_len, seq_len) and its blocks.
struct Plan {
    q_lens: Vec<i64>,
    seq_lens: Vec<i64>,
    cols: i64,
    tokens: i64,
}

fn plan(r: &mut R, bs: i64, nb: i64) -> Plan {
    let n = r.below(4) + if r.chance(12) { 1 } else { 0 };
    let cols = 1 + r.below(5) as i64;
    let mut p = Plan { q_lens: Vec::new(), seq_lens: Vec::new(), cols, tokens: 0 };
    for _ in 0..n {
        let cap = (cols * bs).min(nb * bs).max(1);
        let seq_len = 1 + r.below(cap as usize) as i64;
        let q_len = if r.chance(10) { 1 } else { r.below(seq_len.min(6) as usize + 1) as i64 };
        p.q_lens.push(q_len);
        p.seq_lens.push(seq_len);
        p.tokens += q_len;
    }
    p
}

/// Fills the batch tensors from the plan (where their layout allows), then maybe corrupts one value.
fn fill_batch(r: &mut R, p: &Plan, nb: i64, qsl: &mut Option<Box<T>>, lens: &mut Option<Box<T>>, table: &mut Option<Box<T>>, ids: &mut Option<Box<T>>, big_table: bool) {
    let mut acc = 0;
    if let Some(t) = qsl.as_mut() {
        t.set_int(&[0], 0, DType::I32);
    }
    for (s, (&q, &l)) in p.q_lens.iter().zip(&p.seq_lens).enumerate() {
        acc += q;
        let s = s as i64;
        if let Some(t) = qsl.as_mut() {
            t.set_int(&[s + 1], acc, DType::I32);
        }
        if let Some(t) = lens.as_mut() {
            t.set_int(&[s], l, DType::I32);
        }
        if let Some(t) = table.as_mut() {
            for j in 0..p.cols {
                t.set_int(&[s, j], r.below(nb as usize) as i64, DType::I32);
            }
        }
        if let Some(t) = ids.as_mut() {
            t.set_int(&[s], 1000 + s, DType::I64);
        }
    }
    if r.chance(4) {
        let v = if r.chance(8) { r.pick(&[-1i64, i32::MAX as i64, i32::MIN as i64, nb, nb + 1]) } else { r.below(70) as i64 };
        let s = r.below(p.q_lens.len().max(1)) as i64;
        match r.below(4) {
            0 => qsl.as_mut().map(|t| t.set_int(&[s + r.below(2) as i64], v, DType::I32)),
            1 => lens.as_mut().map(|t| t.set_int(&[s], if big_table { v.rem_euclid(4096) } else { v }, DType::I32)),
            2 => table.as_mut().map(|t| t.set_int(&[s, r.below(p.cols as usize) as i64], v, DType::I32)),
            _ => ids.as_mut().map(|t| t.set_int(&[s], v, DType::I64)),
        };
    }
}

fn snapshot(ts: &[&Option<Box<T>>]) -> Vec<Vec<u8>> {
    ts.iter().map(|t| t.as_ref().map_or(Vec::new(), |t| t.bytes())).collect()
}

unsafe fn cache_write(r: &mut R, e: &Eng, kc: &Option<Box<T>>, vc: &Option<Box<T>>, nb: i64) {
    let c = &e.cfg;
    let (hk, d, bs) = (c.num_kv_heads as i64, c.head_dim as i64, c.block_size as i64);
    let el = of(c.dtype);
    let n = r.below(9) as i64;
    let key = arg(r, &[n, hk, d], el);
    let value = arg(r, &[n, hk, d], el);
    let slot_el = if r.chance(8) { DType::I64 } else { DType::I32 };
    let extra = r.below(2) as i64;
    let mut slots = arg(r, &[n + extra], slot_el);
    // Coherent slots: distinct, in order within a block (as serving engines write), some padding.
    let start = r.below((nb * bs).max(1) as usize) as i64;
    for i in 0..n {
        let v = if r.chance(2) { -1 } else if r.chance(1) { r.pick(&[nb * bs, i64::MAX, i32::MIN as i64]) } else { (start + i) % (nb * bs).max(1) };
        if let Some(t) = slots.as_mut() {
            t.set_int(&[i], v, slot_el);
        }
    }
    let layer = if r.chance(1) { r.pick(&[2u32, u32::MAX]) } else { r.below(2) as u32 };
    let args = kvs_cache_write_args { struct_size: std::mem::size_of::<kvs_cache_write_args>() as u32, layer, key: ptr(&key), value: ptr(&value), key_cache: ptr(kc), value_cache: ptr(vc), slot_mapping: ptr(&slots), stream: std::ptr::null_mut() };
    let before = snapshot(&[kc, vc]);
    let st = kvs_cache_write(e.p, &args);
    check_status(st, "kvs_cache_write");
    if st != kvs_status::KVS_OK {
        assert!(before == snapshot(&[kc, vc]), "kvs_cache_write failed but changed a cache");
    }
}

/// Writes every slot of the caches in order through honest tensors, so policy rows (which need key
/// metadata for every position they may see) can run.
unsafe fn full_write(e: &Eng, kc: &Option<Box<T>>, vc: &Option<Box<T>>, nb: i64) {
    let c = &e.cfg;
    let n = nb * c.block_size as i64;
    let mut honest = R { d: &[], i: 0 };
    let el = of(c.dtype);
    let key = arg(&mut honest, &[n, c.num_kv_heads as i64, c.head_dim as i64], el);
    let value = arg(&mut honest, &[n, c.num_kv_heads as i64, c.head_dim as i64], el);
    let mut slots = arg(&mut honest, &[n], DType::I64);
    for i in 0..n {
        slots.as_mut().unwrap().set_int(&[i], i, DType::I64);
    }
    for layer in 0..2 {
        let args = kvs_cache_write_args { struct_size: std::mem::size_of::<kvs_cache_write_args>() as u32, layer, key: ptr(&key), value: ptr(&value), key_cache: ptr(kc), value_cache: ptr(vc), slot_mapping: ptr(&slots), stream: std::ptr::null_mut() };
        check_status(kvs_cache_write(e.p, &args), "full kvs_cache_write");
    }
}

unsafe fn forward(r: &mut R, e: &Eng, kc: &Option<Box<T>>, vc: &Option<Box<T>>, nb: i64) {
    let c = &e.cfg;
    let (hq, bs) = (c.num_q_heads as i64, c.block_size as i64);
    let d = c.head_dim as i64;
    let el = of(c.dtype);
    let p = plan(r, bs, nb);
    let ns = p.q_lens.len() as i64;
    let query = arg(r, &[p.tokens, hq, d], el);
    let out = arg(r, &[p.tokens, hq, d], el);
    let lse = if r.chance(12) { arg(r, &[p.tokens, hq], DType::F32) } else { None };
    let mut qsl = arg(r, &[ns + 1], DType::I32);
    let mut lens = arg(r, &[ns], DType::I32);
    let mut table = arg(r, &[ns, p.cols], DType::I32);
    let id_el = if r.chance(8) { DType::I64 } else { DType::U64 };
    let mut ids = if r.chance(12) { arg(r, &[ns], id_el) } else { None };
    let big_table = table.as_ref().is_some_and(|t| t._shape.get(1).is_some_and(|&c| c > 4096));
    fill_batch(r, &p, nb, &mut qsl, &mut lens, &mut table, &mut ids, big_table);
    if big_table {
        // Keep legit work small: no sequence longer than 4096 tokens when the table allows more.
        if let Some(t) = lens.as_mut() {
            for s in 0..ns {
                t.set_int(&[s], p.seq_lens[s as usize].min(4096), DType::I32);
            }
        }
    }
    let mut stats = kvs_stats { struct_size: std::mem::size_of::<kvs_stats>() as u32, ..Default::default() };
    let args = kvs_forward_args {
        struct_size: if r.chance(1) { 4 } else { std::mem::size_of::<kvs_forward_args>() as u32 },
        layer: if r.chance(1) { r.pick(&[2u32, u32::MAX]) } else { r.below(2) as u32 },
        query: ptr(&query),
        key_cache: ptr(kc),
        value_cache: ptr(vc),
        block_table: ptr(&table),
        seq_lens: ptr(&lens),
        query_start_loc: ptr(&qsl),
        seq_ids: ptr(&ids),
        out: ptr(&out),
        lse: ptr(&lse),
        scale: r.pick(&[0.125f32, 1.0, 0.0, -1.0, f32::NAN, f32::INFINITY, 1e30]),
        sliding_window: r.pick(&[0, 0, 0, 1, 5, 17, -1, i32::MAX]),
        softcap: r.pick(&[0.0f32, 0.0, 30.0, -1.0, f32::NAN]),
        max_query_len: r.pick(&[0, 1, 8, -1]),
        max_seq_len: r.pick(&[0, 64, -1]),
        stream: std::ptr::null_mut(),
        call_stats: if r.chance(4) { &mut stats } else { std::ptr::null_mut() },
    };
    let before = snapshot(&[&out, &lse]);
    let st = kvs_attention_forward(e.p, &args);
    check_status(st, "kvs_attention_forward");
    if st != kvs_status::KVS_OK {
        assert!(before == snapshot(&[&out, &lse]), "kvs_attention_forward failed but wrote an output");
    }
    // Bound the engine's sequence registry over millions of runs.
    for s in 0..ns {
        kvs_sequence_release(e.p, 1000 + s as u64);
    }
    for v in [0u64, 1, 2, 69, u64::MAX, i32::MAX as u64, i32::MIN as i64 as u64] {
        kvs_sequence_release(e.p, v);
    }
}

unsafe fn merge(r: &mut R, e: &Eng) {
    let el = r.pick(&[DType::F32, DType::F16, DType::BF16]);
    let (t, h, d) = (r.below(4) as i64, 1 + r.below(4) as i64, r.pick(&[1i64, 8, 64]));
    let out_a = arg(r, &[t, h, d], el);
    let out_b = arg(r, &[t, h, d], el);
    let lse_a = arg(r, &[t, h], DType::F32);
    let lse_b = arg(r, &[t, h], DType::F32);
    let out = arg(r, &[t, h, d], el);
    let lse_out = if r.chance(12) { arg(r, &[t, h], DType::F32) } else { None };
    let args = kvs_merge_args { struct_size: std::mem::size_of::<kvs_merge_args>() as u32, out_a: ptr(&out_a), lse_a: ptr(&lse_a), out_b: ptr(&out_b), lse_b: ptr(&lse_b), out: ptr(&out), lse_out: ptr(&lse_out), stream: std::ptr::null_mut() };
    let before = snapshot(&[&out, &lse_out]);
    let st = kvs_merge_states(e.p, &args);
    check_status(st, "kvs_merge_states");
    if st != kvs_status::KVS_OK {
        assert!(before == snapshot(&[&out, &lse_out]), "kvs_merge_states failed but wrote an output");
    }
}

unsafe fn create(r: &mut R) {
    let mut cfg = std::mem::zeroed::<kvs_engine_config>();
    check_status(kvs_engine_config_init(&mut cfg), "config_init");
    let sizes = [0u32, 1, 2, 4, 8, 64, 4096, 4097, 100_000, u32::MAX];
    cfg.num_layers = r.pick(&sizes);
    cfg.num_q_heads = r.pick(&[1u32, 2, 4, 8, 1024, 1025, u32::MAX, 0]);
    cfg.num_kv_heads = r.pick(&[1u32, 2, 4, 0, u32::MAX]);
    cfg.head_dim = r.pick(&[64u32, 128, 100, 0, u32::MAX]);
    cfg.block_size = r.pick(&[16u32, 1, 256, 512, 24, 0]);
    cfg.num_blocks = r.pick(&sizes);
    cfg.num_threads = r.pick(&[1u32, 2, 1025, 100_000, u32::MAX]);
    cfg.max_state_bytes = r.pick(&[0u64, 1, u64::MAX]);
    cfg.device_type = r.pick(&[1, 1, 3, 7, -1]);
    cfg.struct_size = if r.chance(1) { 8 } else { cfg.struct_size };
    let spec: std::ffi::CString = match r.below(4) {
        0 => std::ffi::CString::new("").unwrap(),
        1 => std::ffi::CString::new("quest(budget=64)").unwrap(),
        2 => std::ffi::CString::new("quest(a=".repeat(20_000) + &")".repeat(20_000)).unwrap(),
        _ => std::ffi::CString::new("x".repeat(5000)).unwrap(),
    };
    cfg.policy = if r.chance(2) { std::ptr::null() } else { spec.as_ptr() };
    // The dtype field is an enum in C: write a raw value through its address.
    let raw = r.pick(&[0i32, 1, 2, 3, -1]);
    std::ptr::addr_of_mut!(cfg.dtype).cast::<i32>().write(raw);
    let mut p = std::ptr::null_mut();
    let st = kvs_engine_create(&cfg, &mut p);
    check_status(st, "kvs_engine_create");
    assert_eq!(st == kvs_status::KVS_OK, !p.is_null(), "out is set exactly on success");
    kvs_engine_destroy(p);
}

fuzz_target!(|data: &[u8]| {
    let mut r = R { d: data, i: 0 };
    let es = engines();
    let e = &es[r.below(es.len())];
    let c = e.cfg;
    let el = of(c.dtype);
    unsafe {
        match r.below(8) {
            0..=3 => {
                // Policy engines keep metadata sized by the first cache they saw: mostly use 4 blocks.
                let nb = if r.chance(12) { 4 } else { 1 + r.below(8) as i64 };
                let shape = [nb, c.block_size as i64, c.num_kv_heads as i64, c.head_dim as i64];
                let kc = arg(&mut r, &shape, el);
                let vc = arg(&mut r, &shape, el);
                if r.chance(8) {
                    full_write(e, &kc, &vc, nb);
                }
                cache_write(&mut r, e, &kc, &vc, nb);
                if r.chance(12) {
                    forward(&mut r, e, &kc, &vc, nb);
                }
            }
            4 => merge(&mut r, e),
            5 => create(&mut r),
            6 => {
                let mut s = kvs_stats { struct_size: r.pick(&[0u32, 8, std::mem::size_of::<kvs_stats>() as u32, u32::MAX]), ..Default::default() };
                let layer = r.pick(&[-1, -2, i32::MIN, 0, 1, 2, i32::MAX]);
                let st = kvs_engine_stats(e.p, layer, &mut s);
                check_status(st, "kvs_engine_stats");
                assert_eq!(st == kvs_status::KVS_OK, (-1..=1).contains(&layer) && s.struct_size >= 8, "stats layer {layer}");
            }
            _ => {
                let n = r.pick(&[0usize, 1, 3]);
                let ctx: Vec<u64> = (0..n).map(|_| r.pick(&[0u64, 512, 4096, u64::MAX])).collect();
                let bud: Vec<u64> = (0..n).map(|_| r.pick(&[0u64, 64, u64::MAX])).collect();
                let st = kvs_engine_set_speculation_budgets(e.p, ctx.as_ptr(), bud.as_ptr(), n);
                check_status(st, "kvs_engine_set_speculation_budgets");
                kvs_engine_set_speculation_budgets(e.p, std::ptr::null(), std::ptr::null(), 0);
            }
        }
    }
});
