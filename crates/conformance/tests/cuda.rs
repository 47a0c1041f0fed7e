//! The CUDA backend against the float64 reference. Without a CUDA device the GPU tests are reported as
//! `ignored` (a skip that shows: libtest has no run-time skip, so this file has its own `main` on
//! libtest-mimic, with the same command line: filters, `--include-ignored`, `--test-threads`), and fail
//! instead when KVS_REQUIRE_CUDA=1. KVS_QUICK=1 runs the reduced matrix (for compute-sanitizer). Fresh
//! random data each run; the seed is printed.

use kvsparse_conformance::cuda::{cuda_required, graph_replay, merge_on_cuda, run_case_cuda_planned, run_fixture_cuda, DeviceCase};
use kvsparse_conformance::nonfinite::{check_all_attention, check_merge};
use kvsparse_conformance::{matrix, CaseSpec, Fixture, Outputs};
use kvsparse::rng::Rng;
use kvsparse::{DType, Device, Engine};

fn have_cuda(test: &str) -> bool {
    if kvsparse::cuda::device_available() {
        return true;
    }
    assert!(!cuda_required(), "{test}: KVS_REQUIRE_CUDA=1 but no CUDA device/driver is available");
    eprintln!("{test}: skipped, no CUDA device (set KVS_REQUIRE_CUDA=1 to make this a failure)");
    false
}

fn quick() -> bool {
    std::env::var("KVS_QUICK").map(|v| v == "1").unwrap_or(false)
}

/// Runs every spec on CUDA against the float64 reference (max_seq_len given when `known_len`, else 0)
/// and fails with the list of the cases that did not pass.
fn run_specs_against_float64(specs: &[CaseSpec], known_len: bool) {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let r = run_case_cuda_planned(spec, seed.wrapping_add(i as u64), known_len);
        println!("cuda {:<40} rel_err {:.2e} lse_err {:.2e} {}", r.name, r.rel_err, r.lse_err, if r.pass { "ok" } else { "FAIL" });
        if !r.pass {
            failures.push(format!("{} (seed {}): rel {:.3e} lse {:.3e} {:?}", r.name, r.seed, r.rel_err, r.lse_err, r.error));
        }
    }
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

fn cuda_matches_float64_reference_on_the_matrix() {
    if !have_cuda("cuda_matrix") {
        return;
    }
    run_specs_against_float64(&matrix(quick()), true);
}

/// The matrix again with max_seq_len = 0, as a captured CUDA graph launches: the grid is planned for the
/// block table's width and every row cuts its own visible span (sliding windows, short rows beside long
/// ones, prefill rows) into the grid's splits; the results must meet the same tolerances.
fn cuda_matches_float64_reference_planned_for_the_table_width() {
    if !have_cuda("cuda_matrix_table_width") {
        return;
    }
    let mut specs = matrix(quick());
    // Rows far shorter than the table (one long sequence sizes the plan) and a window inside a long row.
    specs.push(CaseSpec::new("table-width-short-rows", DType::BF16, 128, 32, 8, 16, vec![(1, 40000), (1, 1), (1, 700), (1, 3000), (3, 5000)]));
    let mut w = CaseSpec::new("table-width-window", DType::F16, 64, 8, 2, 16, vec![(1, 30000), (1, 9000), (2, 2500)]);
    w.window = 1500;
    specs.push(w);
    run_specs_against_float64(&specs, false);
}

fn decode_spec(dtype: DType) -> CaseSpec {
    CaseSpec::new("graph-decode", dtype, 128, 32, 8, 16, vec![(1, 4000), (1, 1), (1, 17), (1, 1500), (1, 777)])
}

fn cuda_graph_capture_of_a_decode_step_replays_on_new_data() {
    if !have_cuda("cuda_graph") {
        return;
    }
    let seed = Rng::fresh_seed();
    let rs = graph_replay(&decode_spec(DType::BF16), seed, seed.wrapping_add(7919));
    assert_eq!(rs.len(), 2, "{rs:?}");
    for r in &rs {
        println!("cuda {:<40} rel_err {:.2e} lse_err {:.2e}", r.name, r.rel_err, r.lse_err);
        assert!(r.pass, "{r:?}");
    }
}

/// Garbage metadata on the device (block ids out of range, negative, seq_lens beyond the table) cannot be
/// validated by the host without a sync; the kernels must stay inside the tensors, write the rows that read
/// it as NaN and record the fault. Run under compute-sanitizer memcheck to prove the "no read out of
/// bounds" half.
fn cuda_bad_device_metadata_stays_in_bounds() {
    if !have_cuda("cuda_bad_metadata") {
        return;
    }
    let spec = decode_spec(DType::F16);
    let mut f = Fixture::new(&spec, Rng::fresh_seed());
    let nb = f.num_blocks as i32;
    for (i, b) in f.block_table.iter_mut().enumerate() {
        *b = match i % 3 {
            0 => nb + 1000,
            1 => -5,
            _ => *b,
        };
    }
    f.seq_lens[0] = 1 << 30;
    f.seq_lens[1] = -3;
    let mut cfg = f.engine_config();
    cfg.device = Device::Cuda(0);
    let engine = Engine::new(cfg).expect("engine");
    let mut outs = Outputs::new(&f);
    let dc = DeviceCase::upload(&f, &outs).expect("upload");
    let mut args = dc.forward_args(&f, &outs, std::ptr::null_mut()).expect("args");
    args.max_seq_len = 0; // unknown: the backend falls back to the table's capacity
    engine.attention_forward(&args).expect("forward");
    kvsparse::cuda::context::DevBuf::alloc(16).expect("alloc"); // any driver call after the kernel
    dc.download(&mut outs).expect("download (would report a kernel fault)");
    // The device checks found the garbage (tests/cuda_checks.rs checks each class in detail).
    let err = engine.check(std::ptr::null_mut()).expect_err("the device checks record the bad metadata");
    assert_eq!(err.kind, kvsparse::ErrorKind::OutOfRange, "{err:?}");
    let (o, l) = outs.to_f64(&f);
    let (hq, d) = (spec.num_q_heads, spec.head_dim);
    for t in 0..f.num_tokens {
        let row = &o[t * hq * d..(t + 1) * hq * d];
        let nan = row.iter().all(|x| x.is_nan()) && l[t * hq..(t + 1) * hq].iter().all(|x| x.is_nan());
        assert!(nan, "row {t}: every row of this batch reads bad metadata, so it is NaN (out and lse)");
    }
}

fn cuda_merge_states_matches_cpu() {
    if !have_cuda("cuda_merge") {
        return;
    }
    use kvsparse_conformance::hostbuf::HostBuf;
    use kvsparse::cuda::context::DevBuf;
    use kvsparse::{EngineConfig, MergeArgs, TensorRef};
    let (t, h, d) = (5usize, 8usize, 128usize);
    let mut rng = Rng::new(Rng::fresh_seed());
    let mut a = HostBuf::zeros(DType::BF16, t * h * d);
    let mut b = HostBuf::zeros(DType::BF16, t * h * d);
    for i in 0..t * h * d {
        a.set(i, rng.normal());
        b.set(i, rng.normal());
    }
    let la: Vec<f32> = (0..t * h).map(|i| if i == 3 { f32::NEG_INFINITY } else { rng.normal() as f32 * 3.0 }).collect();
    let lb: Vec<f32> = (0..t * h).map(|i| if i == 3 || i == 5 { f32::NEG_INFINITY } else { rng.normal() as f32 * 3.0 }).collect();
    let shape3 = [t as i64, h as i64, d as i64];
    let shape2 = [t as i64, h as i64];
    // CPU result
    let mut out_cpu = HostBuf::nans(DType::BF16, t * h * d);
    let mut lse_cpu = vec![f32::NAN; t * h];
    let cpu = Engine::new(EngineConfig::new(1, h, h, d, 16, DType::BF16)).unwrap();
    cpu.merge_states(&MergeArgs {
        out_a: a.view_contiguous(&shape3),
        lse_a: TensorRef::from_slice(&la, &shape2),
        out_b: b.view_contiguous(&shape3),
        lse_b: TensorRef::from_slice(&lb, &shape2),
        out: out_cpu.view_contiguous(&shape3),
        lse_out: Some(TensorRef::from_slice_mut(&mut lse_cpu, &shape2)),
        stream: std::ptr::null_mut(),
    })
    .unwrap();
    // GPU result
    let mut cfg = EngineConfig::new(1, h, h, d, 16, DType::BF16);
    cfg.device = Device::Cuda(0);
    let gpu = Engine::new(cfg).unwrap();
    let f32b = |v: &[f32]| unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }.to_vec();
    let (da, db) = (DevBuf::from_host(a.as_bytes()).unwrap(), DevBuf::from_host(b.as_bytes()).unwrap());
    let (dla, dlb) = (DevBuf::from_host(&f32b(&la)).unwrap(), DevBuf::from_host(&f32b(&lb)).unwrap());
    let dout = DevBuf::from_host(HostBuf::nans(DType::BF16, t * h * d).as_bytes()).unwrap();
    let dlse = DevBuf::from_host(&f32b(&vec![f32::NAN; t * h])).unwrap();
    let v = |buf: &DevBuf, dt, shape: &[i64]| unsafe { TensorRef::from_raw(buf.as_ptr(), dt, Device::Cuda(0), shape, None).unwrap() };
    gpu.merge_states(&MergeArgs {
        out_a: v(&da, DType::BF16, &shape3),
        lse_a: v(&dla, DType::F32, &shape2),
        out_b: v(&db, DType::BF16, &shape3),
        lse_b: v(&dlb, DType::F32, &shape2),
        out: v(&dout, DType::BF16, &shape3),
        lse_out: Some(v(&dlse, DType::F32, &shape2)),
        stream: std::ptr::null_mut(),
    })
    .unwrap();
    let mut out_gpu = HostBuf::zeros(DType::BF16, t * h * d);
    let n = out_gpu.len() * 2;
    dout.download(0, unsafe { std::slice::from_raw_parts_mut(out_gpu.as_mut_ptr(), n) }).unwrap();
    let mut lse_gpu = vec![0f32; t * h];
    dlse.download(0, unsafe { std::slice::from_raw_parts_mut(lse_gpu.as_mut_ptr() as *mut u8, t * h * 4) }).unwrap();
    for i in 0..t * h * d {
        let (x, y) = (out_gpu.get(i), out_cpu.get(i));
        assert!((x - y).abs() <= 1e-2 * (1.0 + y.abs()), "out[{i}]: gpu {x} cpu {y}");
    }
    for i in 0..t * h {
        let (x, y) = (lse_gpu[i], lse_cpu[i]);
        assert!(x == y || (x - y).abs() <= 1e-5 * (1.0 + y.abs()), "lse[{i}]: gpu {x} cpu {y}");
    }
}

fn cuda_engine_fails_cleanly_without_a_device() {
    // With a device this checks the other branch: an ordinal that does not exist.
    let mut cfg = kvsparse::EngineConfig::new(1, 8, 2, 128, 16, DType::BF16);
    cfg.device = Device::Cuda(if kvsparse::cuda::device_available() { 4096 } else { 0 });
    let e = Engine::new(cfg).err().expect("no engine on a missing device");
    assert_eq!(e.kind, kvsparse::ErrorKind::Unsupported, "{e}");
}

/// NaN and infinity propagate on the GPU exactly as on the CPU (the contract on `kvs_forward_args` and
/// `kvs_merge_args`; `crates/conformance/tests/conformance.rs` runs the same check on the CPU).
fn cuda_propagates_nan_and_inf_as_documented() {
    if !have_cuda("cuda_nonfinite") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut results = check_all_attention(seed, &mut |f| run_fixture_cuda(f));
    for dtype in [DType::F32, DType::BF16] {
        results.push(check_merge(dtype, seed, &mut merge_on_cuda));
    }
    let mut failures = Vec::new();
    for r in &results {
        println!("cuda {:<40} {}", r.name, if r.pass { "ok" } else { "FAIL" });
        if !r.pass {
            failures.push(format!("{} (seed {}): {:?}", r.name, r.seed, r.error));
        }
    }
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

/// The CUDA kernels propagate NaN and infinity as the CPU does (attention, split combine, merge).
const NAN_PORT_PENDING: bool = false;

/// The device slot map (src/cuda/slots.rs): distinct slots for distinct ids, the same slot and generation
/// on a second lookup, -1 and a counted row once every slot is taken, a released slot handed to a new id
/// with a new generation, unknown ids refused, and many release/insert rounds (tombstones, rebuilds)
/// keeping every live id on its slot.
fn cuda_sequence_slots_map_ids_to_state_slots() {
    use kvsparse::cuda::context::{DevBuf, Gpu};
    use kvsparse::cuda::launch::Modules;
    use kvsparse::cuda::slots::SeqSlots;
    use kvsparse::tensor::TensorRef;
    let gpu = Gpu::open(0).expect("device 0");
    gpu.make_current().expect("context");
    let modules = Modules::default();
    let max = 4usize;
    let slots = SeqSlots::new(max).expect("slot map");
    let look = |ids: &[u64]| -> (Vec<i32>, Vec<u32>) {
        let n = ids.len();
        let bytes = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let d_ids = DevBuf::from_host(&bytes(ids)).unwrap();
        let out = DevBuf::alloc(n * 8).unwrap();
        // SAFETY: n int64 elements of a live device buffer.
        let t = unsafe { TensorRef::from_raw(d_ids.as_ptr(), DType::I64, Device::Cuda(0), &[n as i64], Some(&[1])) }.unwrap();
        // As a policy layer launches it: a dependent launch where the GPU has them.
        slots.lookup(&gpu, &modules, &t, n, out.ptr, out.ptr + (n * 4) as u64, std::ptr::null_mut(), kvsparse::cuda::launch::pdl_enabled(gpu.cc.0)).unwrap();
        gpu.synchronize().unwrap();
        let mut raw = vec![0u8; n * 8];
        out.download(0, &mut raw).unwrap();
        let s = raw[..n * 4].chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        let g = raw[n * 4..].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        (s, g)
    };
    let (s1, g1) = look(&[10, 20, 30]);
    let mut sorted = s1.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert!(sorted.len() == 3 && s1.iter().all(|&s| (0..max as i32).contains(&s)), "{s1:?}");
    assert_eq!(g1, vec![1, 1, 1]);
    assert_eq!(look(&[30, 10, 20]), (vec![s1[2], s1[0], s1[1]], vec![1, 1, 1]), "a second lookup finds the same slots");
    let (s2, _) = look(&[40, 50]);
    assert!(s2[0] >= 0 && s2[1] == -1, "the fifth id finds no slot: {s2:?}");
    assert_eq!(slots.read_counts(&gpu).unwrap(), (1, 4));
    slots.release(&gpu, 20).unwrap();
    assert_eq!(slots.release(&gpu, 20).unwrap_err().kind, kvsparse::ErrorKind::UnknownSequence);
    assert_eq!(slots.release(&gpu, 999).unwrap_err().kind, kvsparse::ErrorKind::UnknownSequence);
    let (s3, g3) = look(&[50]);
    assert_eq!((s3[0], g3[0]), (s1[1], 2), "the released slot goes to the next new id with a new generation");
    // Churn: ids come and go; the live ones keep their slots.
    let mut live: Vec<(u64, i32)> = vec![(10, s1[0]), (30, s1[2]), (40, s2[0]), (50, s3[0])];
    for round in 0..40u64 {
        let (id, _) = live.remove((round % 4) as usize);
        slots.release(&gpu, id).unwrap();
        let new_id = 1000 + round;
        let (s, _) = look(&[new_id]);
        assert!(s[0] >= 0, "round {round}: a freed slot must be reused");
        live.push((new_id, s[0]));
        let ids: Vec<u64> = live.iter().map(|x| x.0).collect();
        let (got, _) = look(&ids);
        assert_eq!(got, live.iter().map(|x| x.1).collect::<Vec<_>>(), "round {round}");
    }
    assert_eq!(slots.read_counts(&gpu).unwrap(), (1, 4));
}

fn main() {
    use libtest_mimic::{Arguments, Trial};
    let args = Arguments::from_args();
    let skip = !kvsparse::cuda::device_available() && !cuda_required();
    if skip {
        println!("no CUDA device: the GPU tests below are skipped, listed as ignored (KVS_REQUIRE_CUDA=1 makes a missing device a failure)");
    }
    let test = |name: &'static str, f: fn()| {
        Trial::test(name, move || {
            f();
            Ok(())
        })
    };
    let tests = vec![
        test("cuda_matches_float64_reference_on_the_matrix", cuda_matches_float64_reference_on_the_matrix).with_ignored_flag(skip),
        test("cuda_matches_float64_reference_planned_for_the_table_width", cuda_matches_float64_reference_planned_for_the_table_width).with_ignored_flag(skip),
        test("cuda_graph_capture_of_a_decode_step_replays_on_new_data", cuda_graph_capture_of_a_decode_step_replays_on_new_data).with_ignored_flag(skip),
        test("cuda_bad_device_metadata_stays_in_bounds", cuda_bad_device_metadata_stays_in_bounds).with_ignored_flag(skip),
        test("cuda_merge_states_matches_cpu", cuda_merge_states_matches_cpu).with_ignored_flag(skip),
        test("cuda_sequence_slots_map_ids_to_state_slots", cuda_sequence_slots_map_ids_to_state_slots).with_ignored_flag(skip),
        test("cuda_propagates_nan_and_inf_as_documented", cuda_propagates_nan_and_inf_as_documented).with_ignored_flag(skip || NAN_PORT_PENDING),
        // Runs everywhere: without a device it checks the clean failure.
        test("cuda_engine_fails_cleanly_without_a_device", cuda_engine_fails_cleanly_without_a_device),
    ];
    libtest_mimic::run(&args, tests).exit();
}
