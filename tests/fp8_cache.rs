//! FP8 KV caches (issue 28): configuration, scales and validation. Bad scales, a missing scale, FP8
//! queries or caches of the wrong dtype get a clear error and write nothing; the cache write quantizes
//! as vLLM does (the numbers are the conformance suite's, crates/conformance `fp8` cases).

mod common;

use kvsparse::ffi::dlpack::{DLDataType, DLDevice, DLTensor};
use kvsparse::ffi::*;
use kvsparse::fp8;
use kvsparse::{CacheWriteArgs, DType, Device, Engine, EngineConfig, ErrorKind, TensorRef};

const HQ: usize = 4;
const HK: usize = 2;
const D: usize = 64;
const BS: usize = 16;
const NB: usize = 2;

fn config(cache: DType) -> EngineConfig {
    let mut c = EngineConfig::new(2, HQ, HK, D, BS, DType::F32);
    c.cache_dtype = cache;
    c.num_threads = 1;
    c
}

/// A cache view of bytes, typed as `dtype` (an FP8 format, or uint8 as vLLM allocates it).
fn cache_view(bytes: &[u8], dtype: DType) -> TensorRef {
    let shape = [NB as i64, BS as i64, HK as i64, D as i64];
    // SAFETY: the slice holds exactly the addressed bytes.
    unsafe { TensorRef::from_raw(bytes.as_ptr() as *mut u8, dtype, Device::Cpu, &shape, None).unwrap() }
}

fn write(e: &Engine, layer: usize, kc: TensorRef, vc: TensorRef, rows: &[f32], slots: &[i64]) -> kvsparse::Result<()> {
    let n = slots.len() as i64;
    let rows_view = TensorRef::from_slice(rows, &[n, HK as i64, D as i64]);
    e.cache_write(&CacheWriteArgs { layer, key: rows_view, value: rows_view, key_cache: kc, value_cache: vc, slot_mapping: TensorRef::from_slice(slots, &[n]), stream: std::ptr::null_mut() })
}

fn forward(e: &Engine, q: TensorRef, kc: TensorRef, vc: TensorRef, out: &mut [f32]) -> kvsparse::Result<()> {
    common::decode_row_of_20(e, q, kc, vc, TensorRef::from_slice_mut(out, &[1, HQ as i64, D as i64]), None)
}

#[test]
fn configuration_keeps_fp8_to_the_cache() {
    assert!(Engine::new(config(DType::F8E4M3)).is_ok());
    assert!(Engine::new(config(DType::F8E5M2)).is_ok());
    // FP8 queries and outputs, or a cache of another full-precision dtype: InvalidDtype.
    let mut c = config(DType::F8E4M3);
    c.dtype = DType::F8E4M3;
    let e = Engine::new(c).err().unwrap();
    assert_eq!(e.kind, ErrorKind::InvalidDtype, "{e}");
    assert!(e.message.contains("cache dtype"), "{e}");
    let e = Engine::new(config(DType::BF16)).err().unwrap();
    assert_eq!(e.kind, ErrorKind::InvalidDtype, "{e}");
    // The CUDA engine serves FP8 caches under f16/bf16 queries (float32 queries are refused at creation,
    // checked without a device), with dense attention and every policy: each policy's device path reads
    // FP8 rows or the key metadata made from the dequantized keys.
    let mut c = config(DType::F8E4M3);
    c.device = Device::Cuda(0);
    let e = Engine::check_config(&c).err().unwrap();
    assert_eq!(e.kind, ErrorKind::Unsupported, "{e}");
    c.dtype = DType::BF16;
    assert!(Engine::check_config(&c).is_ok());
    for served in [
        "quest(budget=256)",
        "streaming(sink=4, recent=64)",
        "quest(budget=256, page=8) > top_p(p=0.9)",
        "all > top_p(p=0.9)",
        "quest(budget=256) > art(patience=2)",
        "art(patience=2)",
        "snapkv(budget=256)",
        "snapkv(budget=256) > top_p(p=0.9)",
        "refresh(k=64)",
        "predictor(budget=256)",
        "speculate(over=quest(budget=256), budget=128)",
    ] {
        c.policy = served.into();
        assert!(Engine::check_config(&c).is_ok(), "{served}: {:?}", Engine::check_config(&c).err());
    }
    // The CPU engine serves every policy over FP8.
    c.device = Device::Cpu;
    assert!(Engine::check_config(&c).is_ok());
}

#[test]
fn scales_must_be_finite_and_positive_and_set_before_use() {
    let e = Engine::new(config(DType::F8E4M3)).unwrap();
    let (kb, vb) = (vec![0u8; NB * BS * HK * D], vec![0u8; NB * BS * HK * D]);
    let rows = vec![1.5f32; 2 * HK * D];
    // Missing scales: the write and the forward fail, naming the call to make; nothing is written.
    let err = write(&e, 0, cache_view(&kb, DType::U8), cache_view(&vb, DType::U8), &rows, &[0, 1]).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
    assert!(err.message.contains("kvs_engine_set_kv_scales"), "{err}");
    assert!(kb.iter().chain(&vb).all(|&b| b == 0));
    let q = vec![0.1f32; HQ * D];
    let mut out = vec![7.0f32; HQ * D];
    let err = forward(&e, TensorRef::from_slice(&q, &[1, HQ as i64, D as i64]), cache_view(&kb, DType::F8E4M3), cache_view(&vb, DType::F8E4M3), &mut out).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
    assert!(out.iter().all(|&x| x == 7.0));
    // Bad scales are refused and change nothing (layer 0 stays unset).
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0] {
        let err = e.set_kv_scales(Some(0), bad, 1.0).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{bad}: {err}");
        let err = e.set_kv_scales(None, 1.0, bad).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{bad}: {err}");
    }
    assert_eq!(e.set_kv_scales(Some(2), 1.0, 1.0).unwrap_err().kind, ErrorKind::OutOfRange);
    assert!(write(&e, 0, cache_view(&kb, DType::U8), cache_view(&vb, DType::U8), &rows, &[0, 1]).is_err());
    // Scales of another layer do not count for this one.
    e.set_kv_scales(Some(1), 0.5, 0.25).unwrap();
    assert!(write(&e, 0, cache_view(&kb, DType::U8), cache_view(&vb, DType::U8), &rows, &[0, 1]).is_err());
    assert!(kb.iter().chain(&vb).all(|&b| b == 0));
    write(&e, 1, cache_view(&kb, DType::U8), cache_view(&vb, DType::U8), &rows, &[0, 1]).unwrap();
    assert_eq!((kb[0], vb[0]), (fp8::quantize(DType::F8E4M3, 1.5, 0.5), fp8::quantize(DType::F8E4M3, 1.5, 0.25)));
    assert_eq!(fp8::decode(DType::F8E4M3, kb[0]), 3.0);
}

#[test]
fn queries_and_caches_of_the_wrong_dtype_are_refused() {
    let e = Engine::new(config(DType::F8E4M3)).unwrap();
    e.set_kv_scales(None, 1.0, 1.0).unwrap();
    let (kb, vb) = (vec![0x38u8; NB * BS * HK * D], vec![0x38u8; NB * BS * HK * D]);
    let mut out = vec![7.0f32; HQ * D];
    // An FP8 query.
    let qb = vec![0x38u8; HQ * D];
    // SAFETY: the slice holds exactly the addressed bytes.
    let q8 = unsafe { TensorRef::from_raw(qb.as_ptr() as *mut u8, DType::F8E4M3, Device::Cpu, &[1, HQ as i64, D as i64], None).unwrap() };
    let err = forward(&e, q8, cache_view(&kb, DType::F8E4M3), cache_view(&vb, DType::F8E4M3), &mut out).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidDtype, "{err}");
    assert!(err.message.contains("query"), "{err}");
    // An E5M2 cache on an E4M3 engine, and a float32 cache.
    let q = vec![0.1f32; HQ * D];
    let qv = TensorRef::from_slice(&q, &[1, HQ as i64, D as i64]);
    let err = forward(&e, qv, cache_view(&kb, DType::F8E5M2), cache_view(&vb, DType::F8E5M2), &mut out).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidDtype, "{err}");
    let f32_cache = vec![0f32; NB * BS * HK * D];
    let fc = TensorRef::from_slice(&f32_cache, &[NB as i64, BS as i64, HK as i64, D as i64]);
    assert_eq!(forward(&e, qv, fc, fc, &mut out).unwrap_err().kind, ErrorKind::InvalidDtype);
    assert!(out.iter().all(|&x| x == 7.0));
    // The typed FP8 view and the uint8 view of the same bytes give the same result: every key 1.0, so the
    // output is the mean of values 1.0.
    forward(&e, qv, cache_view(&kb, DType::F8E4M3), cache_view(&vb, DType::U8), &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 1.0), "{:?}", &out[..4]);
}

#[test]
fn cache_write_saturates_and_keeps_nan() {
    for dt in [DType::F8E4M3, DType::F8E5M2] {
        let e = Engine::new(config(dt)).unwrap();
        e.set_kv_scales(None, 0.5, 2.0).unwrap();
        let (kb, vb) = (vec![0u8; NB * BS * HK * D], vec![0u8; NB * BS * HK * D]);
        let mut rows = vec![0f32; HK * D];
        let specials = [1e9, -1e9, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.3, -0.0, 1e-12];
        rows[..specials.len()].copy_from_slice(&specials);
        write(&e, 0, cache_view(&kb, dt), cache_view(&vb, dt), &rows, &[17]).unwrap();
        let at = BS * HK * D + HK * D; // block 1, offset 1
        let max = if dt == DType::F8E4M3 { fp8::E4M3_MAX } else { fp8::E5M2_MAX };
        let k: Vec<f32> = kb[at..at + specials.len()].iter().map(|&b| fp8::dequantize(dt, b, 0.5)).collect();
        assert_eq!(&k[..4], &[max * 0.5, -max * 0.5, max * 0.5, -max * 0.5], "{}", dt.name());
        assert!(k[4].is_nan());
        assert_eq!(kb[at + 5], fp8::encode_satfinite(dt, 0.3 / 0.5));
        assert_eq!(kb[at + 6], 0x80, "-0 keeps its sign");
        assert_eq!(kb[at + 7], 0, "underflow to zero");
        assert_eq!(vb[at + 5], fp8::encode_satfinite(dt, 0.3 / 2.0));
        // Only the written slot changed.
        assert!(kb[..at].iter().chain(&kb[at + HK * D..]).all(|&b| b == 0));
    }
}

fn dl(data: *mut u8, shape: &mut [i64], code: u8, bits: u8) -> DLTensor {
    DLTensor { data: data as *mut _, device: DLDevice { device_type: 1, device_id: 0 }, ndim: shape.len() as i32, dtype: DLDataType { code, bits, lanes: 1 }, shape: shape.as_mut_ptr(), strides: std::ptr::null_mut(), byte_offset: 0 }
}

#[test]
fn the_c_abi_takes_cache_dtype_scales_and_fp8_dlpack_codes() {
    unsafe {
        let mut c = std::mem::zeroed::<kvs_engine_config>();
        assert_eq!(kvs_engine_config_init(&mut c), kvs_status::KVS_OK);
        assert_eq!(c.cache_dtype, kvs_cache_dtype::KVS_CACHE_DTYPE_AUTO);
        (c.num_layers, c.num_q_heads, c.num_kv_heads, c.head_dim, c.block_size, c.num_threads) = (1, HQ as u32, HK as u32, D as u32, BS as u32, 1);
        c.dtype = kvs_dtype::KVS_DTYPE_FLOAT32;
        // A raw cache_dtype outside the enum is refused before Rust reads it.
        let raw = std::ptr::addr_of_mut!(c.cache_dtype) as *mut i32;
        raw.write(7);
        assert_eq!(kvs_engine_config_check(&c), kvs_status::KVS_ERR_INVALID_DTYPE);
        // A caller compiled before cache_dtype (struct_size ends before it) gets AUTO, whatever the bytes.
        let before = std::mem::offset_of!(kvs_engine_config, cache_dtype) as u32;
        c.struct_size = before;
        assert_eq!(kvs_engine_config_check(&c), kvs_status::KVS_OK);
        c.struct_size = std::mem::size_of::<kvs_engine_config>() as u32;
        c.cache_dtype = kvs_cache_dtype::KVS_CACHE_DTYPE_FP8_E4M3;
        let mut e = std::ptr::null_mut();
        assert_eq!(kvs_engine_create(&c, &mut e), kvs_status::KVS_OK);
        assert_eq!(kvs_engine_set_kv_scales(e, 0, f32::NAN, 1.0), kvs_status::KVS_ERR_INVALID_ARGUMENT);
        assert_eq!(kvs_engine_set_kv_scales(e, -2, 1.0, 1.0), kvs_status::KVS_ERR_OUT_OF_RANGE);
        assert_eq!(kvs_engine_set_kv_scales(e, 1, 1.0, 1.0), kvs_status::KVS_ERR_OUT_OF_RANGE);
        // A cache write with the FP8 DLPack code (kDLFloat8_e4m3fn = 10) before any scale: refused.
        let mut rows = vec![2.0f32; HK * D];
        let (mut kb, mut vb) = (vec![0u8; NB * BS * HK * D], vec![0u8; NB * BS * HK * D]);
        let mut slots = [3i64];
        let (mut rs, mut cs, mut ss) = ([1i64, HK as i64, D as i64], [NB as i64, BS as i64, HK as i64, D as i64], [1i64]);
        let key = dl(rows.as_mut_ptr() as *mut u8, &mut rs, 2, 32);
        let kc = dl(kb.as_mut_ptr(), &mut cs, 10, 8);
        let vc = dl(vb.as_mut_ptr(), &mut cs, 10, 8);
        let sm = dl(slots.as_mut_ptr() as *mut u8, &mut ss, 0, 64);
        let a = kvs_cache_write_args { struct_size: std::mem::size_of::<kvs_cache_write_args>() as u32, layer: 0, key: &key, value: &key, key_cache: &kc, value_cache: &vc, slot_mapping: &sm, stream: std::ptr::null_mut() };
        assert_eq!(kvs_cache_write(e, &a), kvs_status::KVS_ERR_INVALID_ARGUMENT);
        let msg = std::ffi::CStr::from_ptr(kvs_last_error()).to_string_lossy().into_owned();
        assert!(msg.contains("k_scale"), "{msg}");
        assert!(kb.iter().all(|&b| b == 0));
        assert_eq!(kvs_engine_set_kv_scales(e, -1, 0.25, 0.5), kvs_status::KVS_OK);
        assert_eq!(kvs_cache_write(e, &a), kvs_status::KVS_OK);
        let at = 3 * HK * D;
        assert_eq!((fp8::dequantize(DType::F8E4M3, kb[at], 0.25), fp8::dequantize(DType::F8E4M3, vb[at], 0.5)), (2.0, 2.0));
        // E5M2's code (12) on an E4M3 engine is the wrong dtype.
        let kc5 = dl(kb.as_mut_ptr(), &mut cs, 12, 8);
        let a5 = kvs_cache_write_args { key_cache: &kc5, ..a };
        assert_eq!(kvs_cache_write(e, &a5), kvs_status::KVS_ERR_INVALID_DTYPE);
        kvs_engine_destroy(e);
    }
}
