//! The CUDA engine keeps the C ABI's promises about device-resident metadata (issue 33; docs/abi.md,
//! "Where each check runs"): for every class of bad block table, sequence length, query offsets and
//! slots, the fault comes back with the CPU engine's status and message (from `Engine::check`, and from
//! the call itself under `validate = sync`); the rows that depend on it are NaN and every other row
//! equals a clean run bit for bit; a bad cache write leaves the cache unchanged; the same holds under
//! CUDA-graph replay; and sequence bookkeeping and counters read as on a CPU engine.
//!
//! Without a CUDA device the tests are reported as `ignored` (KVS_REQUIRE_CUDA=1 makes that a failure).
//! Fresh random data each run; the seed is printed.

use kvsparse::config::Validate;
use kvsparse_conformance::cuda::{capture, cuda_required, replay, DeviceCase};
use kvsparse_conformance::fixture::run_on_engine;
use kvsparse_conformance::{CaseSpec, Fixture, Outputs};
use kvsparse::cuda::driver::{self, check, cuda, CUstream};
use kvsparse::rng::Rng;
use kvsparse::{DType, Device, Engine, ErrorKind};

fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (ints) viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Decode rows of five sequences (lengths 1 to 4000) on the tensor-core kernel (bf16) or the lane-group
/// kernel (f32); batches mixing prefill chunks with decode rows.
fn specs() -> Vec<CaseSpec> {
    let decode = vec![(1, 4000), (1, 1), (1, 17), (1, 1500), (1, 777)];
    vec![
        CaseSpec::new("decode-bf16", DType::BF16, 128, 32, 8, 16, decode.clone()),
        CaseSpec::new("decode-f32", DType::F32, 128, 32, 8, 16, decode),
        CaseSpec::new("mixed-f16", DType::F16, 128, 8, 2, 16, vec![(5, 40), (1, 33), (3, 3), (1, 300)]),
        // Prefill rows on the prefill kernel (kernels/attention_prefill.cu), tiles straddling sequences.
        CaseSpec::new("prefill-bf16-gqa8", DType::BF16, 64, 16, 2, 16, vec![(40, 300), (1, 50), (100, 100), (7, 2000), (1, 1)]),
    ]
}

/// The metadata a case corrupts.
#[derive(Clone, Debug)]
struct Meta {
    block_table: Vec<i32>,
    seq_lens: Vec<i32>,
    qsl: Vec<i32>,
    cols: usize,
}

impl Meta {
    fn of(f: &Fixture) -> Meta {
        Meta { block_table: f.block_table.clone(), seq_lens: f.seq_lens.clone(), qsl: f.query_start_loc.clone(), cols: f.max_blocks }
    }
    fn apply(&self, f: &mut Fixture) {
        f.block_table.clone_from(&self.block_table);
        f.seq_lens.clone_from(&self.seq_lens);
        f.query_start_loc.clone_from(&self.qsl);
    }
    fn upload(&self, dc: &DeviceCase) {
        dc.block_table.upload(0, bytes(&self.block_table)).unwrap();
        dc.seq_lens.upload(0, bytes(&self.seq_lens)).unwrap();
        dc.qsl.upload(0, bytes(&self.qsl)).unwrap();
    }

    /// The rows the documented rule (kernels/common.cuh `kvs_row_fault`, docs/abi.md) writes as NaN: a
    /// row whose sequence (found by binary search over query_start_loc, as the kernels do) has a bad
    /// query_start_loc pair or a bad neighbouring pair, a bad seq_len or query length, that lies outside
    /// its sequence's rows, every row when query_start_loc does not start at 0 or end at num_tokens, and a
    /// row that reads (causally, no window here) a block id outside [0, num_blocks).
    fn nan_rows(&self, num_tokens: usize, num_blocks: usize, bs: usize) -> Vec<bool> {
        let q = &self.qsl;
        let n = self.seq_lens.len();
        (0..num_tokens)
            .map(|t| {
                let (mut lo, mut hi) = (0usize, n - 1);
                while lo < hi {
                    let mid = (lo + hi + 1) / 2;
                    if q[mid] <= t as i32 { lo = mid } else { hi = mid - 1 }
                }
                let s = lo;
                let (q0, q1) = (q[s] as i64, q[s + 1] as i64);
                let qprev = if s > 0 { q[s - 1] as i64 } else { q0 };
                let qnext = if s + 2 <= n { q[s + 2] as i64 } else { q1 };
                let len = self.seq_lens[s] as i64;
                let t64 = t as i64;
                let bad = q[0] != 0 || qprev > q0 || q1 < q0 || q1 > num_tokens as i64 || len < 0 || q1 - q0 > len || len > (self.cols * bs) as i64 || qnext < q1 || q[n] as usize != num_tokens || t64 < q0 || t64 >= q1;
                if bad {
                    return true;
                }
                let pos = len - (q1 - q0) + (t64 - q0);
                (0..=(pos as usize / bs)).any(|c| {
                    let id = self.block_table[s * self.cols + c];
                    id < 0 || id as usize >= num_blocks
                })
            })
            .collect()
    }
}

/// One corruption: its name and what it does to the metadata.
type Corruption = (&'static str, Box<dyn Fn(&mut Meta, usize, usize)>);

/// Every class of bad device-resident metadata the issue lists (block ids -1, num_blocks, INT32_MAX,
/// INT32_MIN; lengths beyond the table, negative, INT32_MAX; a query longer than its sequence; query
/// offsets that descend, do not start at 0, end short or beyond, or hold a negative entry). Arguments:
/// the metadata, num_tokens, num_blocks.
fn corruptions() -> Vec<Corruption> {
    // The last column a sequence's last row reads.
    let last_col = |m: &Meta, s: usize| ((m.seq_lens[s] as usize).max(1) - 1) / 16;
    vec![
        ("block id -1", Box::new(|m: &mut Meta, _, _| m.block_table[2 * m.cols] = -1)),
        ("block id num_blocks", Box::new(move |m: &mut Meta, _, nb| {
            let c = last_col(m, 0);
            m.block_table[c] = nb as i32;
        })),
        ("block id INT32_MAX", Box::new(|m: &mut Meta, _, _| m.block_table[3 * m.cols + 1] = i32::MAX)),
        ("block id INT32_MIN", Box::new(|m: &mut Meta, _, _| m.block_table[m.cols] = i32::MIN)),
        ("seq_len beyond the table", Box::new(|m: &mut Meta, _, _| m.seq_lens[1] = (m.cols * 16 + 1) as i32)),
        ("seq_len negative", Box::new(|m: &mut Meta, _, _| m.seq_lens[2] = -3)),
        ("seq_len INT32_MAX", Box::new(|m: &mut Meta, _, _| m.seq_lens[3] = i32::MAX)),
        ("query longer than its sequence", Box::new(|m: &mut Meta, _, _| {
            let ql = m.qsl[2] - m.qsl[1];
            m.seq_lens[1] = ql - 1;
        })),
        ("query_start_loc descends", Box::new(|m: &mut Meta, _, _| m.qsl.swap(2, 3))),
        ("query_start_loc does not start at 0", Box::new(|m: &mut Meta, _, _| m.qsl[0] = 1)),
        ("query_start_loc ends short", Box::new(|m: &mut Meta, _, _| {
            let n = m.qsl.len() - 1;
            m.qsl[n] -= 1;
        })),
        ("query_start_loc ends beyond", Box::new(|m: &mut Meta, _, _| {
            let n = m.qsl.len() - 1;
            m.qsl[n] += 1;
        })),
        ("query_start_loc negative entry", Box::new(|m: &mut Meta, _, _| m.qsl[2] = -1)),
    ]
}

fn engine(f: &Fixture, validate: Validate) -> Engine {
    let mut cfg = f.engine_config();
    cfg.device = Device::Cuda(0);
    cfg.num_threads = 1;
    cfg.validate = validate;
    Engine::new(cfg).expect("CUDA engine")
}

fn sync() {
    // SAFETY: no arguments.
    check(unsafe { (cuda().unwrap().cuCtxSynchronize)() }, "cuCtxSynchronize").unwrap();
}

/// Outputs filled with 7.0: a row the kernels do not write keeps it (so NaN means "written as NaN").
fn sentinel(f: &Fixture) -> Outputs {
    let mut o = Outputs::new(f);
    for i in 0..o.out.len() {
        o.out.set(i, 7.0);
    }
    o.lse.iter_mut().for_each(|x| *x = 7.0);
    o
}

fn upload_outputs(dc: &DeviceCase, o: &Outputs) {
    dc.out.upload(0, o.out.as_bytes()).unwrap();
    dc.lse.upload(0, bytes(&o.lse)).unwrap();
}

/// Row by row: the NaN rows are NaN in every element and LSE; the others equal `clean` exactly.
fn judge_rows(name: &str, f: &Fixture, got: &Outputs, clean: &(Vec<f64>, Vec<f64>), nan: &[bool]) -> Vec<String> {
    let (o, l) = got.to_f64(f);
    let (hq, d) = (f.spec.num_q_heads, f.spec.head_dim);
    let mut bad = Vec::new();
    for (t, &is_nan) in nan.iter().enumerate() {
        let orow = &o[t * hq * d..(t + 1) * hq * d];
        let lrow = &l[t * hq..(t + 1) * hq];
        if is_nan {
            if !(orow.iter().all(|x| x.is_nan()) && lrow.iter().all(|x| x.is_nan())) {
                bad.push(format!("{name}: row {t} should be NaN (out and lse)"));
            }
        } else if orow != &clean.0[t * hq * d..(t + 1) * hq * d] || lrow != &clean.1[t * hq..(t + 1) * hq] {
            bad.push(format!("{name}: row {t} differs from the clean run"));
        }
    }
    bad
}

/// The CPU engine's error for fixture `f` with metadata `m` and slots `slots` (None: its own); `f` is
/// left as it was.
fn cpu_error(f: &mut Fixture, m: Option<&Meta>, slots: Option<&[i64]>) -> kvsparse::Error {
    let (keep, keep_slots) = (Meta::of(f), f.slots.clone());
    if let Some(m) = m {
        m.apply(f);
    }
    if let Some(s) = slots {
        f.slots = s.to_vec();
    }
    let cpu = Engine::new(f.engine_config()).unwrap();
    let r = run_on_engine(&cpu, f);
    keep.apply(f);
    f.slots = keep_slots;
    r.err().expect("the CPU engine refuses the corrupted call")
}

/// Corrupts the device copy of `f`'s metadata with `corrupt` and fills the device outputs with the
/// sentinel; returns the corrupted metadata, the CPU engine's error for it, and host outputs to download to.
fn corrupt_on_device(f: &mut Fixture, dc: &DeviceCase, corrupt: &dyn Fn(&mut Meta, usize, usize)) -> (Meta, kvsparse::Error, Outputs) {
    let mut m = Meta::of(f);
    corrupt(&mut m, f.num_tokens, f.num_blocks);
    let want = cpu_error(f, Some(&m), None);
    m.upload(dc);
    let got = sentinel(f);
    upload_outputs(dc, &got);
    (m, want, got)
}

fn same_error(name: &str, got: Option<kvsparse::Error>, want: &kvsparse::Error) -> Option<String> {
    match got {
        Some(g) if g.kind == want.kind && g.message.starts_with(&want.message) => None,
        other => Some(format!("{name}: got {other:?}, the CPU engine says {want:?}")),
    }
}

fn forward_faults_surface_with_the_cpu_engines_status_and_message() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut fails = Vec::new();
    for spec in specs() {
        let mut f = Fixture::new(&spec, seed);
        for validate in [Validate::Deferred, Validate::Sync] {
            let e = engine(&f, validate);
            let mut outs = Outputs::new(&f);
            let dc = DeviceCase::upload(&f, &outs).unwrap();
            dc.write_cache(&e, &f, std::ptr::null_mut()).unwrap();
            let args = dc.forward_args(&f, &outs, std::ptr::null_mut()).unwrap();
            e.attention_forward(&args).expect("clean forward");
            e.check(std::ptr::null_mut()).expect("a clean call records nothing");
            sync();
            dc.download(&mut outs).unwrap();
            let clean = outs.to_f64(&f);
            for (what, corrupt) in corruptions() {
                let name = format!("{} {validate:?} {what}", spec.name);
                let (m, want, mut got) = corrupt_on_device(&mut f, &dc, corrupt.as_ref());
                let r = e.attention_forward(&args);
                let err = match validate {
                    Validate::Deferred => {
                        assert!(r.is_ok(), "{name}: a deferred engine returns OK from the call: {r:?}");
                        e.check(std::ptr::null_mut()).err()
                    }
                    Validate::Sync => r.err(),
                };
                fails.extend(same_error(&name, err, &want));
                assert!(e.check(std::ptr::null_mut()).is_ok(), "{name}: the record is cleared once returned");
                sync();
                dc.download(&mut got).unwrap();
                let nan = m.nan_rows(f.num_tokens, f.num_blocks, spec.block_size);
                assert!(nan.iter().any(|&x| x), "{name}: the case must poison some row");
                fails.extend(judge_rows(&name, &f, &got, &clean, &nan));
                Meta::of(&f).upload(&dc);
                println!("{name}: {} of {} rows NaN; {}", nan.iter().filter(|&&x| x).count(), nan.len(), want.message);
            }
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

fn cache_bytes(dc: &DeviceCase) -> Vec<u8> {
    sync();
    let mut v = vec![0u8; dc.cache.bytes];
    dc.cache.download(0, &mut v).unwrap();
    v
}

/// A write whose last slot (or a middle one) is at or beyond the capacity writes nothing; so does a call of
/// few tokens (the one-launch write).
fn bad_cache_write_changes_nothing() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    for spec in specs() {
        let mut f = Fixture::new(&spec, seed);
        let cap = (f.num_blocks * spec.block_size) as i64;
        for validate in [Validate::Deferred, Validate::Sync] {
            let e = engine(&f, validate);
            let outs = Outputs::new(&f);
            let dc = DeviceCase::upload(&f, &outs).unwrap();
            let n = f.slots.len();
            // A call of few tokens (a decode step's one-launch write): the first rows only.
            let few = 6.min(n);
            let first_rows = |a: &kvsparse::engine::CacheWriteArgs| {
                let narrow = |t: &kvsparse::TensorRef| {
                    let mut shape = t.shape().to_vec();
                    shape[0] = few as i64;
                    // SAFETY: a prefix of the rows `t` addresses.
                    unsafe { kvsparse::TensorRef::from_raw(t.data, t.dtype, t.device, &shape, Some(t.strides())).unwrap() }
                };
                kvsparse::engine::CacheWriteArgs { key: narrow(&a.key), value: narrow(&a.value), slot_mapping: narrow(&a.slot_mapping), ..*a }
            };
            let cases = [
                ("last slot = capacity", n - 1, cap, false),
                ("middle slot INT64_MAX", n / 2, i64::MAX, false),
                ("first slot capacity+1", 0, cap + 1, false),
                ("few tokens, last slot = capacity", few - 1, cap, true),
                ("few tokens, first slot INT64_MAX", 0, i64::MAX, true),
            ];
            for (what, at, value, short) in cases {
                let name = format!("{} {validate:?} {what}", spec.name);
                let mut slots = f.slots.clone();
                slots[at] = value;
                let want = cpu_error(&mut f, None, Some(&slots));
                dc.slots.upload(0, bytes(&slots)).unwrap();
                let before = cache_bytes(&dc);
                let args = dc.cache_write_args(&f, std::ptr::null_mut()).unwrap();
                let r = e.cache_write(&if short { first_rows(&args) } else { args });
                let err = match validate {
                    Validate::Deferred => {
                        assert!(r.is_ok(), "{name}: {r:?}");
                        e.check(std::ptr::null_mut()).err()
                    }
                    Validate::Sync => r.err(),
                };
                if let Some(msg) = same_error(&name, err, &want) {
                    panic!("{msg}");
                }
                assert!(cache_bytes(&dc) == before, "{name}: the cache changed");
                println!("{name}: cache unchanged; {}", want.message);
            }
            dc.slots.upload(0, bytes(&f.slots)).unwrap();
            let before = cache_bytes(&dc);
            e.cache_write(&first_rows(&dc.cache_write_args(&f, std::ptr::null_mut()).unwrap())).unwrap();
            e.check(std::ptr::null_mut()).unwrap();
            assert!(f.slots[..few].iter().all(|&s| s < 0) || cache_bytes(&dc) != before, "{}: a clean write of few tokens must write", spec.name);
            // The clean write still writes.
            let before = cache_bytes(&dc);
            e.cache_write(&dc.cache_write_args(&f, std::ptr::null_mut()).unwrap()).unwrap();
            e.check(std::ptr::null_mut()).unwrap();
            assert!(f.slots.iter().all(|&s| s < 0) || cache_bytes(&dc) != before, "{}: a clean write must write", spec.name);
        }
    }
}

/// The primary context, current on this thread and retained while the returned handle lives (the engines of
/// earlier tests released it; a stream needs a context), and a non-blocking stream the caller destroys.
fn own_stream() -> (kvsparse::cuda::context::Gpu, CUstream) {
    let ctx = kvsparse::cuda::context::Gpu::open(0).unwrap();
    let mut stream: CUstream = std::ptr::null_mut();
    // SAFETY: out-parameter; the caller destroys the stream.
    check(unsafe { (cuda().unwrap().cuStreamCreate)(&mut stream, driver::CU_STREAM_NON_BLOCKING) }, "cuStreamCreate").unwrap();
    (ctx, stream)
}

/// A captured decode step replayed with bad metadata: NaN rows, the other rows equal to the clean replay,
/// the fault sticky until checked; a captured cache write replayed with a bad slot writes nothing; and an
/// engine with validate = sync refuses to be captured.
fn graph_replay_with_bad_metadata() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let api = cuda().unwrap();
    let (_ctx, stream) = own_stream();
    for spec in specs() {
        let mut f = Fixture::new(&spec, seed);
        let e = engine(&f, Validate::Deferred);
        let mut outs = Outputs::new(&f);
        let dc = DeviceCase::upload(&f, &outs).unwrap();
        dc.write_cache(&e, &f, stream).unwrap();
        let args = dc.forward_args(&f, &outs, stream).unwrap();
        e.attention_forward(&args).unwrap(); // warm-up: modules, workspace
        let fwd = capture(stream, || e.attention_forward(&args).map(|_| ())).expect("capture of a forward call");
        replay(&fwd, stream).unwrap();
        e.check(stream).expect("clean replay");
        dc.download(&mut outs).unwrap();
        let clean = outs.to_f64(&f);
        for (what, corrupt) in corruptions() {
            let name = format!("{} graph {what}", spec.name);
            let (m, want, mut got) = corrupt_on_device(&mut f, &dc, corrupt.as_ref());
            replay(&fwd, stream).unwrap();
            // Sticky: a second replay with the metadata repaired does not clear it.
            dc.download(&mut got).unwrap();
            Meta::of(&f).upload(&dc);
            replay(&fwd, stream).unwrap();
            if let Some(msg) = same_error(&name, e.check(stream).err(), &want) {
                panic!("{msg}");
            }
            let nan = m.nan_rows(f.num_tokens, f.num_blocks, spec.block_size);
            let bad = judge_rows(&name, &f, &got, &clean, &nan);
            assert!(bad.is_empty(), "{}", bad.join("\n"));
            e.check(stream).expect("cleared");
        }
        // A captured cache write, replayed with a bad last slot: nothing written.
        let cw = dc.cache_write_args(&f, stream).unwrap();
        e.cache_write(&cw).unwrap(); // warm-up: the slot check buffer
        let g = capture(stream, || e.cache_write(&cw)).expect("capture of a cache write");
        let mut slots = f.slots.clone();
        let n = slots.len();
        slots[n - 1] = (f.num_blocks * spec.block_size) as i64;
        dc.slots.upload(0, bytes(&slots)).unwrap();
        let before = cache_bytes(&dc);
        replay(&g, stream).unwrap();
        assert!(cache_bytes(&dc) == before, "{}: a replayed bad write changed the cache", spec.name);
        let want = cpu_error(&mut f, None, Some(&slots));
        if let Some(msg) = same_error(&format!("{} graph cache write", spec.name), e.check(stream).err(), &want) {
            panic!("{msg}");
        }
        // validate = sync cannot be captured: refused with a clear error, the capture ends cleanly.
        let es = engine(&f, Validate::Sync);
        let args_s = dc.forward_args(&f, &outs, stream).unwrap();
        dc.slots.upload(0, bytes(&f.slots)).unwrap();
        es.attention_forward(&args_s).unwrap();
        let r = capture(stream, || es.attention_forward(&args_s).map(|_| ()));
        match r {
            Err(err) => assert!(err.kind == ErrorKind::InvalidArgument && err.message.contains("validate = sync"), "{err:?}"),
            Ok(_) => panic!("{}: a validate=sync engine was captured", spec.name),
        }
        println!("{}: graph replay ok", spec.name);
    }
    // SAFETY: our stream.
    unsafe { (api.cuStreamDestroy)(stream) };
}

/// A decode batch padded as vLLM 0.26's FULL CUDA graphs pad it to a capture size: `P` extra sequences
/// with `seq_len` 0, `query_start_loc` repeating the real token count for them, and `P` extra query rows
/// past that count. On an engine with `padded_batches` (checks on: `validate = deferred`), dense and
/// each policy a vLLM engine captures: the real rows equal the unpadded call's bit for bit, the padding
/// rows keep the sentinel (not written), no fault is recorded, eager and graph replay alike. (Before the
/// option, the device check made every row of such a step NaN.)
fn padded_batches_as_vllm_pads_them() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let api = cuda().unwrap();
    let (_ctx, stream) = own_stream();
    const PAD: usize = 3;
    let spec = CaseSpec::new("padded-decode", DType::BF16, 128, 16, 4, 16, vec![(1, 700), (1, 1500), (1, 33)]);
    for policy in ["dense", "quest(budget=256)", "streaming(sink=16, recent=256)"] {
        let f = Fixture::new(&spec, seed);
        let (n, t, hq, d) = (spec.seqs.len(), f.num_tokens, spec.num_q_heads, spec.head_dim);
        let mk = |padded: bool| {
            let mut cfg = f.engine_config();
            cfg.device = Device::Cuda(0);
            cfg.num_threads = 1;
            cfg.validate = Validate::Deferred;
            cfg.policy = policy.to_string();
            cfg.padded_batches = padded;
            Engine::new(cfg).expect("CUDA engine")
        };
        // The unpadded call on a plain engine: the reference.
        let plain = mk(false);
        let outs = sentinel(&f);
        let dc = DeviceCase::upload(&f, &outs).unwrap();
        dc.write_cache(&plain, &f, stream).unwrap();
        plain.attention_forward(&dc.forward_args(&f, &outs, stream).unwrap()).unwrap();
        plain.check(stream).expect("clean unpadded call");
        let mut exact = sentinel(&f);
        dc.download(&mut exact).unwrap();
        let (eo, el) = exact.to_f64(&f);
        assert!(eo.iter().all(|x| x.is_finite()), "{policy}: unpadded outputs finite");
        // The padded inputs: P more sequences (seq_len 0, no query rows) and P more query rows.
        let e = mk(true);
        dc.write_cache(&e, &f, stream).unwrap(); // the same cache contents; the policy's metadata for this engine
        let esz = spec.dtype.size_bytes();
        let row = hq * d * esz;
        let mut qb = f.q.as_bytes().to_vec();
        qb.extend_from_slice(&f.q.as_bytes()[..PAD * row]);
        let sent = sentinel(&f);
        let mut ob = sent.out.as_bytes().to_vec();
        ob.extend_from_slice(&sent.out.as_bytes()[..PAD * row]);
        let lb: Vec<f32> = vec![7.0; (t + PAD) * hq];
        let mut table = f.block_table.clone();
        table.extend(std::iter::repeat_n(0i32, PAD * f.max_blocks));
        let mut lens = f.seq_lens.clone();
        lens.extend(std::iter::repeat_n(0i32, PAD));
        let mut qsl = f.query_start_loc.clone();
        qsl.extend(std::iter::repeat_n(t as i32, PAD));
        let mut ids = f.seq_ids.clone();
        ids.extend((0..PAD as i64).map(|i| 1_000_000 + i));
        let bufs: Vec<kvsparse::cuda::context::DevBuf> =
            [&qb[..], &ob[..], bytes(&lb), bytes(&table), bytes(&lens), bytes(&qsl), bytes(&ids)].iter().map(|b| kvsparse::cuda::context::DevBuf::from_host(b).unwrap()).collect();
        // SAFETY: a compact view (strides None) of exactly the buffer's elements.
        let tv = |i: usize, dt: DType, shape: &[i64]| unsafe { kvsparse::TensorRef::from_raw(bufs[i].ptr as *mut u8, dt, Device::Cuda(0), shape, None) }.unwrap();
        let (tp, np) = ((t + PAD) as i64, (n + PAD) as i64);
        let mut args = dc.forward_args(&f, &outs, stream).unwrap();
        args.query = tv(0, spec.dtype, &[tp, hq as i64, d as i64]);
        args.out = tv(1, spec.dtype, &[tp, hq as i64, d as i64]);
        args.lse = Some(tv(2, DType::F32, &[tp, hq as i64]));
        args.block_table = tv(3, DType::I32, &[np, f.max_blocks as i64]);
        args.seq_lens = tv(4, DType::I32, &[np]);
        args.query_start_loc = tv(5, DType::I32, &[np + 1]);
        args.seq_ids = Some(tv(6, DType::I64, &[np]));
        let judge = |how: &str| {
            e.check(stream).unwrap_or_else(|err| panic!("{policy} {how}: padded call recorded a fault: {err}"));
            let mut got = vec![0u8; ob.len()];
            bufs[1].download(0, &mut got).unwrap();
            let mut glse = vec![0f32; lb.len()];
            // SAFETY: plain f32s viewed as bytes for the download.
            bufs[2].download(0, unsafe { std::slice::from_raw_parts_mut(glse.as_mut_ptr() as *mut u8, glse.len() * 4) }).unwrap();
            assert!(got[..t * row] == exact.out.as_bytes()[..t * row], "{policy} {how}: real rows differ from the unpadded call's");
            assert!(glse[..t * hq].iter().zip(&el).all(|(a, b)| *a as f64 == *b), "{policy} {how}: real rows' LSE differ");
            assert!(got[t * row..] == ob[t * row..], "{policy} {how}: padding rows were written");
            assert!(glse[t * hq..].iter().all(|&x| x == 7.0), "{policy} {how}: padding rows' LSE written");
        };
        e.attention_forward(&args).expect("padded call accepted");
        judge("eager");
        bufs[1].upload(0, &ob).unwrap();
        bufs[2].upload(0, bytes(&lb)).unwrap();
        let g = capture(stream, || e.attention_forward(&args).map(|_| ())).expect("capture of a padded call");
        replay(&g, stream).unwrap();
        judge("graph replay");
        // Without the option the same call is refused and writes nothing.
        bufs[1].upload(0, &ob).unwrap();
        let r = plain.attention_forward(&args);
        let refused = r.is_err() || plain.check(stream).is_err();
        assert!(refused, "{policy}: a padded batch on an engine without padded_batches was accepted");
        println!("{policy}: padded batch (+{PAD} seqs, +{PAD} rows): real rows equal, padding untouched, eager and replay");
    }
    // SAFETY: our stream.
    unsafe { (api.cuStreamDestroy)(stream) };
}

/// What a call sequence leaves in the stats and the release statuses, on any engine.
#[derive(Debug, PartialEq, Eq)]
struct Book {
    releases: Vec<Option<ErrorKind>>,
    live: u64,
    created: u64,
    released: u64,
    calls: u64,
    decode_rows: u64,
    prefill_tokens: u64,
    /// K/V bytes dense attention read (the CPU engine's count: each sequence's positions visible to its
    /// first query row).
    kv_bytes_read: u64,
    null_ids_stateful: Option<ErrorKind>,
}

fn bookkeeping(device: Device, spec: &CaseSpec, seed: u64) -> Book {
    let mut f = Fixture::new(spec, seed);
    let mut cfg = f.engine_config();
    cfg.device = device;
    cfg.num_threads = 1;
    let e = Engine::new(cfg.clone()).unwrap();
    let ids = f.seq_ids.clone();
    let run = |e: &Engine, f: &mut Fixture| match device {
        Device::Cpu => run_on_engine(e, f).map(|_| ()),
        _ => {
            let outs = Outputs::new(f);
            let dc = DeviceCase::upload(f, &outs).unwrap();
            dc.write_cache(e, f, std::ptr::null_mut())?;
            e.attention_forward(&dc.forward_args(f, &outs, std::ptr::null_mut())?).map(|_| ())
        }
    };
    run(&e, &mut f).unwrap();
    run(&e, &mut f).unwrap();
    let mut releases = Vec::new();
    for id in [ids[1] as u64, ids[1] as u64, 999_999, ids[0] as u64] {
        releases.push(e.release_sequence(id).err().map(|x| x.kind));
    }
    let s = e.stats();
    // A stateful policy without seq_ids: refused at the call, on both engines.
    let mut pcfg = cfg;
    pcfg.policy = "snapkv(budget=64); dense_layers=0".into();
    let pe = Engine::new(pcfg).unwrap();
    let null_ids_stateful = match device {
        Device::Cpu => {
            let mut outs = Outputs::new(&f);
            let nseq = spec.seqs.len() as i64;
            let a = kvsparse::ForwardArgs {
                layer: 0,
                query: f.query_view(),
                key_cache: f.k_cache_view(),
                value_cache: f.v_cache_view(),
                block_table: kvsparse::tensor::TensorRef::from_slice(&f.block_table, &[nseq, f.max_blocks as i64]),
                seq_lens: kvsparse::tensor::TensorRef::from_slice(&f.seq_lens, &[nseq]),
                query_start_loc: kvsparse::tensor::TensorRef::from_slice(&f.query_start_loc, &[nseq + 1]),
                seq_ids: None,
                out: outs.out_view(&f),
                lse: Some(outs.lse_view(&f)),
                scale: f.scale,
                sliding_window: 0,
                softcap: 0.0,
                max_query_len: 0,
                max_seq_len: 0,
                stream: std::ptr::null_mut(),
            };
            pe.attention_forward(&a).err().map(|x| x.kind)
        }
        _ => {
            let outs = Outputs::new(&f);
            let dc = DeviceCase::upload(&f, &outs).unwrap();
            let mut a = dc.forward_args(&f, &outs, std::ptr::null_mut()).unwrap();
            a.seq_ids = None;
            pe.attention_forward(&a).err().map(|x| x.kind)
        }
    };
    Book { releases, live: s.live_sequences, created: s.sequences_created, released: s.sequences_released, calls: s.total.calls, decode_rows: s.total.decode_rows, prefill_tokens: s.total.prefill_tokens, kv_bytes_read: s.total.kv_bytes_read, null_ids_stateful }
}

/// The bookkeeping cases: `specs()`, and the mixed batch under a sliding window (which bounds the dense
/// bytes read).
fn bookkeeping_specs() -> Vec<CaseSpec> {
    let mut v = specs();
    let mut w = v[2].clone();
    w.name = "mixed-f16-window".into();
    w.window = 20;
    v.push(w);
    v
}

fn bookkeeping_matches_the_cpu_engine() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    for spec in bookkeeping_specs() {
        let cpu = bookkeeping(Device::Cpu, &spec, seed);
        let gpu = bookkeeping(Device::Cuda(0), &spec, seed);
        println!("{}: cpu {cpu:?}\n{}: cuda {gpu:?}", spec.name, spec.name);
        assert_eq!(gpu, cpu, "{}", spec.name);
        assert_eq!(cpu.releases, vec![None, Some(ErrorKind::UnknownSequence), Some(ErrorKind::UnknownSequence), None]);
        assert!(cpu.decode_rows + cpu.prefill_tokens > 0 && cpu.live == spec.seqs.len() as u64 - 2);
    }
}

/// Under validate = sync a CUDA call's counters come back in the call (decode rows, prefill tokens), as
/// on the CPU engine; the stats show a pending fault until it is checked.
fn call_stats_and_pending_status() {
    let seed = Rng::fresh_seed();
    for spec in specs() {
        let mut f = Fixture::new(&spec, seed);
        let cpu = Engine::new(f.engine_config()).unwrap();
        let nseq = spec.seqs.len();
        run_on_engine(&cpu, &mut f).unwrap();
        let cpu_call = cpu.stats().total;
        let e = engine(&f, Validate::Sync);
        let outs = Outputs::new(&f);
        let dc = DeviceCase::upload(&f, &outs).unwrap();
        dc.write_cache(&e, &f, std::ptr::null_mut()).unwrap();
        let c = e.attention_forward(&dc.forward_args(&f, &outs, std::ptr::null_mut()).unwrap()).unwrap();
        assert_eq!((c.calls, c.decode_rows, c.prefill_tokens), (1, cpu_call.decode_rows, cpu_call.prefill_tokens), "{}", spec.name);
        // Deferred: a fault shows in the stats until checked.
        let ed = engine(&f, Validate::Deferred);
        dc.write_cache(&ed, &f, std::ptr::null_mut()).unwrap();
        let mut m = Meta::of(&f);
        m.seq_lens[nseq - 1] = -1;
        m.upload(&dc);
        ed.attention_forward(&dc.forward_args(&f, &outs, std::ptr::null_mut()).unwrap()).unwrap();
        assert_eq!(ed.stats().pending_status, 4, "{}: KVS_ERR_OUT_OF_RANGE pending", spec.name);
        assert_eq!(ed.stats().pending_status, 4, "reading the stats does not clear it");
        assert_eq!(ed.check(std::ptr::null_mut()).unwrap_err().kind, ErrorKind::OutOfRange);
        assert_eq!(ed.stats().pending_status, 0);
    }
}

/// Runs everywhere: each corruption is one the CPU engine refuses, and the rule poisons some row (so the
/// CUDA tests above compare against a real refusal and a non-empty set of NaN rows).
fn every_corruption_is_refused_by_the_cpu_engine() {
    let seed = Rng::fresh_seed();
    for spec in specs() {
        let mut f = Fixture::new(&spec, seed);
        for (what, corrupt) in corruptions() {
            let mut m = Meta::of(&f);
            corrupt(&mut m, f.num_tokens, f.num_blocks);
            let e = cpu_error(&mut f, Some(&m), None);
            let nan = m.nan_rows(f.num_tokens, f.num_blocks, spec.block_size);
            println!("{} {what}: {e:?}; NaN rows {:?}", spec.name, nan.iter().enumerate().filter(|x| *x.1).map(|x| x.0).collect::<Vec<_>>());
            assert!(nan.iter().any(|&x| x), "{} {what}", spec.name);
        }
        let cap = (f.num_blocks * spec.block_size) as i64;
        let mut slots = f.slots.clone();
        let n = slots.len();
        slots[n - 1] = cap;
        assert_eq!(cpu_error(&mut f, None, Some(&slots)).kind, ErrorKind::OutOfRange);
    }
}

/// Runs everywhere: the CPU engine's side of the bookkeeping comparison.
fn cpu_bookkeeping_is_what_the_cuda_test_compares_with() {
    let seed = Rng::fresh_seed();
    for spec in bookkeeping_specs() {
        let b = bookkeeping(Device::Cpu, &spec, seed);
        assert_eq!(b.releases, vec![None, Some(ErrorKind::UnknownSequence), Some(ErrorKind::UnknownSequence), None]);
        let n = spec.seqs.len() as u64;
        let dec = spec.seqs.iter().filter(|s| s.0 == 1).count() as u64;
        let pre: u64 = spec.seqs.iter().filter(|s| s.0 != 1).map(|s| s.0 as u64).sum();
        // Positions the first query row of each sequence sees (the window counts back from it).
        let visible: u64 = spec.seqs.iter().map(|&(q, l)| (if spec.window > 0 { (l - q + 1).min(spec.window) + q - 1 } else { l }) as u64).sum();
        let row_bytes = (spec.head_dim * spec.dtype.size_bytes() * 2 * spec.num_kv_heads) as u64;
        assert_eq!((b.live, b.created, b.released, b.calls, b.decode_rows, b.prefill_tokens), (n - 2, n, 2, 2, 2 * dec, 2 * pre), "{b:?}");
        assert_eq!(b.kv_bytes_read, 2 * visible * row_bytes, "{}: {b:?}", spec.name);
        assert_eq!(b.null_ids_stateful, Some(ErrorKind::InvalidArgument));
    }
}

fn main() {
    use libtest_mimic::{Arguments, Trial};
    let args = Arguments::from_args();
    let have = kvsparse::cuda::device_available();
    assert!(have || !cuda_required(), "KVS_REQUIRE_CUDA=1 but no CUDA device/driver is available");
    if !have {
        println!("no CUDA device: the GPU tests below are skipped, listed as ignored (KVS_REQUIRE_CUDA=1 makes a missing device a failure)");
    }
    let test = |name: &'static str, f: fn()| Trial::test(name, move || {
        f();
        Ok(())
    });
    let gpu = |name: &'static str, f: fn()| test(name, f).with_ignored_flag(!have);
    let tests = vec![
        test("every_corruption_is_refused_by_the_cpu_engine", every_corruption_is_refused_by_the_cpu_engine),
        test("cpu_bookkeeping_is_what_the_cuda_test_compares_with", cpu_bookkeeping_is_what_the_cuda_test_compares_with),
        gpu("forward_faults_surface_with_the_cpu_engines_status_and_message", forward_faults_surface_with_the_cpu_engines_status_and_message),
        gpu("bad_cache_write_changes_nothing", bad_cache_write_changes_nothing),
        gpu("graph_replay_with_bad_metadata", graph_replay_with_bad_metadata),
        gpu("bookkeeping_matches_the_cpu_engine", bookkeeping_matches_the_cpu_engine),
        gpu("call_stats_and_pending_status", call_stats_and_pending_status),
        gpu("padded_batches_as_vllm_pads_them", padded_batches_as_vllm_pads_them),
    ];
    libtest_mimic::run(&args, tests).exit();
}
