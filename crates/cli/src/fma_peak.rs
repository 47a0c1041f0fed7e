//! The machine's f32 FMA peak as the CPU kernels can use it: a register-resident loop of independent
//! fused multiply-adds on the instruction set the kernels run on (`kvsparse::cpu::isa::detected`), on
//! every thread at once. What the prefill bench's GFLOP/s are compared with.

use kvsparse::cpu::isa::{self, IsaLevel};
use std::time::Instant;

/// Independent accumulators: enough to cover the FMA latency on two ports (4 cycles × 2).
const ACCS: usize = 16;
/// Iterations per timed run (each is `ACCS` vector FMAs).
const ITERS: usize = 20_000_000;

/// CPU time of the calling thread (`CLOCK_THREAD_CPUTIME_ID`) or of the whole process, in seconds: on a
/// shared machine, time on a core rather than wall time.
pub fn cpu_seconds(process: bool) -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    let clock = if process { libc::CLOCK_PROCESS_CPUTIME_ID } else { libc::CLOCK_THREAD_CPUTIME_ID };
    // SAFETY: a valid clock id and a valid out-pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The FMA peak on `threads` threads at once: (total GFLOP/s of wall time, GFLOP per CPU-second of one
/// thread, ISA name); best of three runs each. The second is what a core does while it runs this process,
/// whatever else shares the machine.
pub fn fma_peak_gflops(threads: usize) -> (f64, f64, &'static str) {
    let level = isa::detected();
    let (lanes, name) = match level {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512 => (16, "avx512"),
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => (8, "avx2"),
        IsaLevel::Portable => (8, "portable"),
    };
    let (mut best, mut best_core) = (0f64, 0f64);
    let flops = (ITERS * ACCS * lanes * 2) as f64;
    for _ in 0..3 {
        let t = Instant::now();
        std::thread::scope(|s| {
            let runs: Vec<_> = (0..threads.max(1))
                .map(|_| {
                    s.spawn(|| {
                        let c = cpu_seconds(false);
                        std::hint::black_box(fma_loop(level, ITERS));
                        cpu_seconds(false) - c
                    })
                })
                .collect();
            for r in runs {
                best_core = best_core.max(flops / r.join().unwrap_or(f64::INFINITY) / 1e9);
            }
        });
        best = best.max(threads.max(1) as f64 * flops / t.elapsed().as_secs_f64() / 1e9);
    }
    (best, best_core, name)
}

fn fma_loop(level: IsaLevel, iters: usize) -> f32 {
    match level {
        // SAFETY: the level was detected on this CPU.
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512 => unsafe { fma_avx512(iters) },
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { fma_avx2(iters) },
        IsaLevel::Portable => fma_portable(iters),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(1.0); ACCS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, m, a);
        }
    }
    acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(1.0); ACCS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, m, a);
        }
    }
    let mut out = [0f32; 8];
    let mut s = 0f32;
    for v in acc {
        _mm256_storeu_ps(out.as_mut_ptr(), v);
        s += out.iter().sum::<f32>();
    }
    s
}

/// Eight lanes of multiply-add in plain Rust (what the portable kernels compile to).
fn fma_portable(iters: usize) -> f32 {
    let mut acc = [[1f32; 8]; ACCS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            for l in x.iter_mut() {
                *l = *l * 0.999_999 + 1e-7;
            }
        }
        std::hint::black_box(&mut acc);
    }
    acc.iter().flatten().sum()
}
