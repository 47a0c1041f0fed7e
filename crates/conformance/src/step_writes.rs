//! Cache writes of few tokens (decode steps, the CUDA engine's one-launch write, kernels/write_step.cu)
//! against the CPU engine: the same calls on both engines, after each of them the same outcome (error or
//! not, and which), the same cache bytes and the same key metadata, bit for bit. The scenarios are what a
//! serving engine does to a block: appends of one or several tokens per call, a rewrite from the middle of
//! a filled block (rejected speculative tokens), a rewrite of its last row, a slot written twice in one
//! call, and a call with a slot out of range (nothing may be written).

use super::fixture::Fixture;
use super::hostbuf::HostBuf;
use super::sparse_cuda::{cfg_for, sync};
use super::CaseSpec;
use kvsparse::cuda::context::DevBuf;
use kvsparse::engine::{CacheWriteArgs, Engine};
use kvsparse::error::Result;
use kvsparse::tensor::{DType, Device, TensorRef};

/// One cache write: rows `[n][kv_heads][head_dim]` of the fixture's dtype and their slots.
pub struct WriteCall {
    pub k: HostBuf,
    pub v: HostBuf,
    pub slots: Vec<i64>,
}

/// A scenario: the calls after the prefix write, and the fixture rows (indices into `new_k`) the prefix
/// write leaves out.
struct Scenario {
    name: &'static str,
    held_back: Vec<usize>,
    calls: Vec<WriteCall>,
}

/// What a scenario found: the first call after which the engines differ, and how (None: never).
#[derive(Debug)]
pub struct StepWrites {
    pub scenario: &'static str,
    pub calls: usize,
    pub mismatch: Option<String>,
}

fn bytes_of<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slice viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// The fixture row (index into new_k/new_v/slots) that writes position `j` of sequence `q`, and its slot.
fn row_of(f: &Fixture, q: usize, j: usize) -> (usize, i64) {
    let bs = f.spec.block_size;
    let slot = f.block_table[q * f.max_blocks + j / bs] as i64 * bs as i64 + (j % bs) as i64;
    (f.slots.iter().position(|&x| x == slot).expect("every position is written once"), slot)
}

/// A call writing the fixture rows `rows` at `slots` (a row of None: padding, slot -1).
fn call_of(f: &Fixture, rows: &[(Option<usize>, i64)]) -> WriteCall {
    let w = f.spec.num_kv_heads * f.spec.head_dim;
    let (mut k, mut v) = (HostBuf::zeros(f.spec.dtype, rows.len() * w), HostBuf::zeros(f.spec.dtype, rows.len() * w));
    for (i, &(row, _)) in rows.iter().enumerate() {
        for e in 0..w {
            let (x, y) = row.map_or((1e4, 1e4), |r| (f.new_k.get(r * w + e), f.new_v.get(r * w + e)));
            k.set(i * w + e, x);
            v.set(i * w + e, y);
        }
    }
    WriteCall { k, v, slots: rows.iter().map(|&(_, s)| s).collect() }
}

fn scenarios(f: &Fixture) -> Vec<Scenario> {
    let lens: Vec<usize> = f.spec.seqs.iter().map(|&(_, l)| l).collect();
    let cap = (f.num_blocks * f.spec.block_size) as i64;
    // Each sequence's last `n` positions (fewer for short ones).
    let last = |n: usize| -> Vec<(usize, usize)> { lens.iter().enumerate().flat_map(|(q, &l)| (l.saturating_sub(n)..l).map(move |j| (q, j))).collect() };
    let rows = |ps: &[(usize, usize)]| -> Vec<usize> { ps.iter().map(|&(q, j)| row_of(f, q, j).0).collect() };
    let at = |q: usize, j: usize| -> (Option<usize>, i64) {
        let (r, s) = row_of(f, q, j);
        (Some(r), s)
    };
    // Another row's values at (q, j)'s slot: a rewrite that changes the data.
    let other = |q: usize, j: usize| -> (Option<usize>, i64) { (Some(row_of(f, q, 0).0), row_of(f, q, j).1) };
    let mut out = Vec::new();
    // Appends: the last three positions of every sequence in one call (several tokens of a call in one
    // block, padding between them), then one token per sequence and call, as decode steps.
    let three = last(3);
    let mut one_call: Vec<(Option<usize>, i64)> = three.iter().map(|&(q, j)| at(q, j)).collect();
    one_call.insert(one_call.len() / 2, (None, -1));
    out.push(Scenario { name: "append 3 tokens per sequence in one call", held_back: rows(&three), calls: vec![call_of(f, &one_call)] });
    let steps = (0..3).rev().map(|back| call_of(f, &lens.iter().enumerate().filter(|&(_, &l)| l > back).map(|(q, &l)| at(q, l - 1 - back)).collect::<Vec<_>>())).collect();
    out.push(Scenario { name: "append one token per sequence and call", held_back: rows(&three), calls: steps });
    // Rewrites of a filled block: from its middle (the later rows' fill bits are cleared), and its last row
    // (what the bench's step does).
    let mid: Vec<(Option<usize>, i64)> = lens.iter().enumerate().filter(|&(_, &l)| l >= 4).map(|(q, &l)| other(q, l - 3)).collect();
    out.push(Scenario { name: "rewrite from the middle of a block", held_back: vec![], calls: vec![call_of(f, &mid)] });
    let end: Vec<(Option<usize>, i64)> = lens.iter().enumerate().map(|(q, &l)| other(q, l - 1)).collect();
    out.push(Scenario { name: "rewrite the last row", held_back: vec![], calls: vec![call_of(f, &end)] });
    // A slot written twice in one call: the later row stays (the CPU writes in order).
    let two = last(2);
    let mut dup: Vec<(Option<usize>, i64)> = two.iter().map(|&(q, j)| at(q, j)).collect();
    dup.extend(lens.iter().enumerate().filter(|&(_, &l)| l >= 2).map(|(q, &l)| other(q, l - 2)));
    out.push(Scenario { name: "a slot written twice in one call", held_back: rows(&two), calls: vec![call_of(f, &dup)] });
    // A slot out of range in the middle of a call: the call writes nothing; the same call without it then
    // writes everything.
    let tail = last(1);
    let good: Vec<(Option<usize>, i64)> = tail.iter().map(|&(q, j)| at(q, j)).collect();
    let mut bad = good.clone();
    bad.insert(bad.len() / 2, (bad[0].0, cap));
    out.push(Scenario { name: "a slot out of range, then the same call without it", held_back: rows(&tail), calls: vec![call_of(f, &bad), call_of(f, &good)] });
    out
}

/// Every key value of the fixture's rows with magnitude below 0.5 becomes +0 or -0 (alternating), the others
/// their magnitude: units and rows whose minimum is a zero of both signs.
fn signed_zeros(f: &mut Fixture) {
    for i in 0..f.new_k.len() {
        let x = f.new_k.get(i);
        f.new_k.set(i, if x.abs() < 0.5 { if i % 3 == 0 { -0.0 } else { 0.0 } } else { x.abs() });
    }
}

/// The CUDA engine's cache (a device copy of the fixture's poisoned cache) and its views.
struct DevCache {
    buf: DevBuf,
}

impl DevCache {
    fn views(&self, f: &Fixture) -> Result<(TensorRef, TensorRef)> {
        let dt = f.cache_dtype();
        // SAFETY: both views address the fixture's cache layout inside this allocation.
        unsafe {
            Ok((
                TensorRef::from_raw(self.buf.as_ptr(), dt, Device::Cuda(0), &f.cache_shape, Some(&f.cache_strides))?,
                TensorRef::from_raw(self.buf.as_ptr().add(f.v_offset * dt.size_bytes()), dt, Device::Cuda(0), &f.cache_shape, Some(&f.cache_strides))?,
            ))
        }
    }
}

/// Runs one call on the CUDA engine; its error (recorded by the device checks, read after the call).
fn write_cuda(e: &Engine, f: &Fixture, dc: &DevCache, c: &WriteCall) -> Result<Option<kvsparse::Error>> {
    let (hk, d, n) = (f.spec.num_kv_heads as i64, f.spec.head_dim as i64, c.slots.len() as i64);
    let (k, v, s) = (DevBuf::from_host(c.k.as_bytes())?, DevBuf::from_host(c.v.as_bytes())?, DevBuf::from_host(bytes_of(&c.slots))?);
    let (kc, vc) = dc.views(f)?;
    // SAFETY: each view addresses exactly its allocation.
    let view = |b: &DevBuf, dt, shape: &[i64], st: &[i64]| unsafe { TensorRef::from_raw(b.as_ptr(), dt, Device::Cuda(0), shape, Some(st)) };
    let a = CacheWriteArgs {
        layer: 0,
        key: view(&k, f.spec.dtype, &[n, hk, d], &[hk * d, d, 1])?,
        value: view(&v, f.spec.dtype, &[n, hk, d], &[hk * d, d, 1])?,
        key_cache: kc,
        value_cache: vc,
        slot_mapping: view(&s, DType::I64, &[n], &[1])?,
        stream: std::ptr::null_mut(),
    };
    let r = e.cache_write(&a);
    let err = r.err().or(e.check(std::ptr::null_mut()).err());
    sync()?;
    Ok(err)
}

fn write_cpu(e: &Engine, f: &mut Fixture, c: &mut WriteCall) -> Option<kvsparse::Error> {
    let (hk, d) = (f.spec.num_kv_heads as i64, f.spec.head_dim as i64);
    let (kc, vc) = (f.k_cache_view(), f.v_cache_view());
    super::fixture::write_rows(e, (kc, vc), &mut c.k, &mut c.v, &c.slots, hk, d).err()
}

/// Whether the two engines' states differ after a call: the outcome, the cache bytes, the key metadata.
fn compare(cpu: &Engine, gpu: &Engine, f: &Fixture, dc: &DevCache, ec: Option<kvsparse::Error>, eg: Option<kvsparse::Error>) -> Result<Option<String>> {
    match (&ec, &eg) {
        (None, None) => {}
        (Some(a), Some(b)) if a.kind == b.kind && b.message.starts_with(a.message.as_str()) => {}
        _ => return Ok(Some(format!("outcome: CPU {ec:?}, CUDA {eg:?}"))),
    }
    let mut bytes = vec![0u8; dc.buf.bytes];
    dc.buf.download(0, &mut bytes)?;
    if let Some(i) = bytes.iter().zip(f.cache.as_bytes()).position(|(a, b)| a != b) {
        return Ok(Some(format!("cache byte {i} differs (of {})", bytes.len())));
    }
    let (mc, mg) = (cpu.metadata_snapshot(0)?, gpu.metadata_snapshot(0)?);
    if mc != mg {
        let (mc, mg) = (mc.expect("the policy keeps metadata"), mg.expect("the policy keeps metadata"));
        let first = |a: &[u16], b: &[u16]| a.iter().zip(b).position(|(x, y)| x != y);
        return Ok(Some(format!(
            "metadata differs: fill word {:?}, qmin {:?}, qmax {:?}, codes equal {}, qparams equal {}",
            mc.fill.iter().zip(&mg.fill).position(|(a, b)| a != b),
            mc.qmin.as_deref().zip(mg.qmin.as_deref()).and_then(|(a, b)| first(a, b)),
            mc.qmax.as_deref().zip(mg.qmax.as_deref()).and_then(|(a, b)| first(a, b)),
            mc.codes == mg.codes,
            mc.qparams == mg.qparams
        )));
    }
    Ok(None)
}

/// Runs every scenario on the fixture `spec`/`seed` with `policy` (which must keep key metadata): a fresh
/// fixture and fresh engines per scenario, the prefix write (every fixture row but the held-back ones, one
/// call of many tokens) then the scenario's calls, compared after each call.
/// `zeros`: every key value of magnitude below 0.5 becomes a zero of either sign first (so min and max of
/// rows and units are zeros of both signs, whose fold the device must do in the CPU's order).
pub fn step_writes_agree(spec: &CaseSpec, policy: &str, seed: u64, zeros: bool) -> Result<Vec<StepWrites>> {
    let mut out = Vec::new();
    // The primary context, retained across the scenarios' engines (each would otherwise create it anew).
    let _ctx = kvsparse::cuda::context::Gpu::open(0)?;
    let names: Vec<&'static str> = scenarios(&Fixture::new(spec, seed)).iter().map(|s| s.name).collect();
    for (i, name) in names.into_iter().enumerate() {
        let mut f = Fixture::new(spec, seed);
        if zeros {
            signed_zeros(&mut f);
        }
        let mut sc = scenarios(&f).swap_remove(i);
        let cpu = Engine::new(cfg_for(&f, policy, Device::Cpu))?;
        let gpu = Engine::new(cfg_for(&f, policy, Device::Cuda(0)))?;
        if f.cache_dtype().is_fp8() {
            cpu.set_kv_scales(Some(0), f.k_scale, f.v_scale)?;
            gpu.set_kv_scales(Some(0), f.k_scale, f.v_scale)?;
        }
        let dc = DevCache { buf: DevBuf::from_host(f.cache.as_bytes())? };
        let prefix: Vec<(Option<usize>, i64)> = f.slots.iter().enumerate().map(|(r, &s)| if sc.held_back.contains(&r) { (None, -1) } else { (Some(r), s) }).collect();
        let mut calls = vec![call_of(&f, &prefix)];
        calls.append(&mut sc.calls);
        let mut mismatch = None;
        for (k, c) in calls.iter_mut().enumerate() {
            let eg = write_cuda(&gpu, &f, &dc, c)?;
            let ec = write_cpu(&cpu, &mut f, c);
            if let Some(m) = compare(&cpu, &gpu, &f, &dc, ec, eg)? {
                mismatch = Some(format!("after call {k} ({} tokens): {m}", c.slots.len()));
                break;
            }
        }
        out.push(StepWrites { scenario: name, calls: calls.len(), mismatch });
    }
    Ok(out)
}
