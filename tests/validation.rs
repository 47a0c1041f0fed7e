//! Tensor validation as a class (issue 12): checked extents for every view, and one routine per tensor
//! role, so forward, cache write and merge accept and reject the same layouts.

mod common;

use kvsparse::{CacheWriteArgs, DType, Device, Engine, EngineConfig, ErrorKind, MergeArgs, TensorRef};

const BIG: i64 = 1 << 62;

fn view(data: &mut [f32], shape: &[i64], strides: &[i64]) -> kvsparse::Result<TensorRef> {
    // SAFETY: every view built here addresses only elements inside `data` (or none), or is rejected.
    unsafe { TensorRef::from_raw(data.as_mut_ptr() as *mut u8, DType::F32, Device::Cpu, shape, Some(strides)) }
}

#[test]
fn extents_are_checked_when_a_view_is_built() {
    let mut buf = vec![0f32; 64];
    // Element counts and byte extents that overflow are errors, with or without memory behind them.
    let e = unsafe { TensorRef::from_raw(std::ptr::null_mut(), DType::F32, Device::Cpu, &[BIG, 16, 2, 64], None) }.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidShape, "{e}");
    let e = view(&mut buf, &[2, 4, 64], &[BIG, BIG, 1]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidShape, "{e}");
    let e = view(&mut buf, &[3, 2], &[i64::MAX / 2, 1]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidShape, "{e}");
    // NULL data is fine only without elements; broadcasting a huge extent over one element is fine.
    let e = unsafe { TensorRef::from_raw(std::ptr::null_mut(), DType::F32, Device::Cpu, &[1 << 40, 2], Some(&[0, 0])) }.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    assert!(unsafe { TensorRef::from_raw(std::ptr::null_mut(), DType::F32, Device::Cpu, &[0, 4, 64], Some(&[0, 0, 0])) }.is_ok());
    assert!(view(&mut buf, &[1 << 40, 4], &[0, 1]).is_ok());
    // Misaligned data.
    let e = unsafe { TensorRef::from_raw((buf.as_mut_ptr() as *mut u8).add(2), DType::F32, Device::Cpu, &[4], None) }.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
}

#[test]
fn outputs_must_not_alias_themselves_unless_empty() {
    let mut buf = vec![0f32; 1024];
    let ok = |t: kvsparse::Result<TensorRef>| t.unwrap().expect_no_self_overlap("out");
    assert!(ok(view(&mut buf, &[2, 4, 64], &[256, 64, 1])).is_ok());
    assert!(ok(view(&mut buf, &[2, 4, 64], &[0, 64, 1])).is_err());
    assert!(ok(view(&mut buf, &[2, 4, 64], &[256, 32, 1])).is_err());
    assert!(ok(view(&mut buf, &[0, 4, 64], &[0, 0, 0])).is_ok(), "numpy's empty arrays have zero strides");
    assert!(ok(view(&mut buf, &[1, 1, 64], &[0, 0, 1])).is_ok(), "extent-1 dimensions never overlap");
}

struct Setup {
    engine: Engine,
    cache: Vec<f32>,
    q: Vec<f32>,
    out: Vec<f32>,
    lse: Vec<f32>,
}

const HQ: usize = 4;
const HK: usize = 2;
const D: usize = 64;
const BS: usize = 16;
const NB: usize = 2;

fn setup() -> Setup {
    let mut cfg = EngineConfig::new(1, HQ, HK, D, BS, DType::F32);
    cfg.num_threads = 1;
    Setup { engine: Engine::new(cfg).unwrap(), cache: vec![0.5; 2 * NB * BS * HK * D], q: vec![0.1; HQ * D], out: vec![7.0; HQ * D], lse: vec![7.0; HQ] }
}

fn cache_strides(block: i64) -> [i64; 4] {
    [block, (HK * D) as i64, D as i64, 1]
}

/// One decode row of 20 keys over blocks 0 and 1 of the given caches.
fn forward(engine: &Engine, q: &[f32], out: &mut [f32], kc: TensorRef, vc: TensorRef, lse: TensorRef) -> kvsparse::Result<()> {
    let (q, out) = (TensorRef::from_slice(q, &[1, HQ as i64, D as i64]), TensorRef::from_slice_mut(out, &[1, HQ as i64, D as i64]));
    common::decode_row_of_20(engine, q, kc, vc, out, Some(lse))
}

/// Forward and cache write over caches with the given block stride; returns both results.
fn both_with_block_stride(s: &mut Setup, block: i64) -> (kvsparse::Result<()>, kvsparse::Result<()>) {
    let shape = [NB as i64, BS as i64, HK as i64, D as i64];
    let half = NB * BS * HK * D;
    let (kbuf, vbuf) = s.cache.split_at_mut(half);
    let kc = view(kbuf, &shape, &cache_strides(block)).unwrap();
    let vc = view(vbuf, &shape, &cache_strides((BS * HK * D) as i64)).unwrap();
    let lse = TensorRef::from_slice_mut(&mut s.lse, &[1, HQ as i64]);
    let fwd = forward(&s.engine, &s.q, &mut s.out, kc, vc, lse);
    let rows = vec![1.0f32; HK * D];
    let slots = [3i64];
    let cw = s.engine.cache_write(&CacheWriteArgs {
        layer: 0,
        key: TensorRef::from_slice(&rows, &[1, HK as i64, D as i64]),
        value: TensorRef::from_slice(&rows, &[1, HK as i64, D as i64]),
        key_cache: kc,
        value_cache: vc,
        slot_mapping: TensorRef::from_slice(&slots, &[1]),
        stream: std::ptr::null_mut(),
    });
    (fwd, cw)
}

#[test]
fn forward_and_cache_write_agree_on_cache_layouts() {
    let mut s = setup();
    let (f, w) = both_with_block_stride(&mut s, (BS * HK * D) as i64);
    assert!(f.is_ok() && w.is_ok(), "{f:?} {w:?}");
    // Block stride 0 (every block the same memory) and a stride that folds blocks onto each other.
    for bad in [0, (BS * HK * D / 2) as i64] {
        let before = s.cache.clone();
        let out_before = s.out.clone();
        let (f, w) = both_with_block_stride(&mut s, bad);
        for r in [&f, &w] {
            let e = r.as_ref().unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidShape, "block stride {bad}: {e}");
            assert!(e.message.contains("key_cache"), "{e}");
        }
        assert_eq!(s.cache, before, "cache untouched");
        assert_eq!(s.out, out_before, "out untouched");
    }
}

#[test]
fn forward_and_merge_agree_on_lse_layouts() {
    let mut s = setup();
    let (a, b) = (vec![1.0f32; HQ * D], vec![2.0f32; HQ * D]);
    let (la, lb) = (vec![0.0f32; HQ], vec![0.0f32; HQ]);
    for (strides, ok) in [([HQ as i64, 1], true), ([HQ as i64, 0], false), ([0, 1], true)] {
        // Forward with this lse layout ([1, HQ]: a zero token stride is fine for one token).
        let mut lse_buf = vec![9.0f32; HQ];
        let lse = view(&mut lse_buf, &[1, HQ as i64], &strides).unwrap();
        let merged = s.engine.merge_states(&MergeArgs {
            out_a: TensorRef::from_slice(&a, &[1, HQ as i64, D as i64]),
            lse_a: TensorRef::from_slice(&la, &[1, HQ as i64]),
            out_b: TensorRef::from_slice(&b, &[1, HQ as i64, D as i64]),
            lse_b: TensorRef::from_slice(&lb, &[1, HQ as i64]),
            out: TensorRef::from_slice_mut(&mut s.out, &[1, HQ as i64, D as i64]),
            lse_out: Some(lse),
            stream: std::ptr::null_mut(),
        });
        let shape = [NB as i64, BS as i64, HK as i64, D as i64];
        let half = NB * BS * HK * D;
        let (kbuf, vbuf) = s.cache.split_at_mut(half);
        let block = (BS * HK * D) as i64;
        let (kc, vc) = (view(kbuf, &shape, &cache_strides(block)).unwrap(), view(vbuf, &shape, &cache_strides(block)).unwrap());
        let fwd = forward(&s.engine, &s.q, &mut s.out, kc, vc, lse);
        assert_eq!(merged.is_ok(), ok, "merge with lse strides {strides:?}: {merged:?}");
        assert_eq!(fwd.is_ok(), ok, "forward with lse strides {strides:?}: {fwd:?}");
        if !ok {
            assert_eq!(lse_buf, vec![9.0; HQ], "nothing written");
        }
    }
}

#[test]
fn per_call_counts_have_limits() {
    // One broadcast element stands for 2^20 + 1 new rows: rejected before any loop over them.
    let s = setup();
    let mut cache = vec![0f32; NB * BS * HK * D];
    let shape = [NB as i64, BS as i64, HK as i64, D as i64];
    let kc = view(&mut cache, &shape, &cache_strides((BS * HK * D) as i64)).unwrap();
    let mut row = vec![1f32; D];
    let n = (1 << 20) + 1;
    let rows = view(&mut row, &[n, HK as i64, D as i64], &[0, 0, 1]).unwrap();
    let slot = [-1i64];
    let slots = unsafe { TensorRef::from_raw(slot.as_ptr() as *mut u8, DType::I64, Device::Cpu, &[n], Some(&[0])) }.unwrap();
    let t0 = std::time::Instant::now();
    let e = s.engine.cache_write(&CacheWriteArgs { layer: 0, key: rows, value: rows, key_cache: kc, value_cache: kc, slot_mapping: slots, stream: std::ptr::null_mut() }).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unsupported, "{e}");
    assert!(t0.elapsed().as_secs_f64() < 0.1);
}

#[test]
fn engine_limits_fail_fast_with_their_status() {
    let base = EngineConfig::new(1, HQ, HK, D, BS, DType::F32);
    let t0 = std::time::Instant::now();
    for (cfg, kind) in [
        (EngineConfig { num_layers: u32::MAX as usize, ..base.clone() }, ErrorKind::Unsupported),
        (EngineConfig { num_threads: 5000, ..base.clone() }, ErrorKind::Unsupported),
        (EngineConfig { num_threads: 100_000, ..base.clone() }, ErrorKind::Unsupported),
        (EngineConfig { num_q_heads: 1 << 20, num_kv_heads: 1, ..base.clone() }, ErrorKind::Unsupported),
        (EngineConfig { policy: "quest(a=".repeat(15_000) + &")".repeat(15_000), ..base.clone() }, ErrorKind::InvalidArgument),
        (EngineConfig { policy: "quest(a=".repeat(100) + &")".repeat(100), ..base.clone() }, ErrorKind::InvalidArgument),
    ] {
        let e = Engine::new(cfg).err().expect("rejected");
        assert_eq!(e.kind, kind, "{e}");
    }
    assert!(t0.elapsed().as_secs_f64() < 1.0);
}
