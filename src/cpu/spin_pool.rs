//! A fork-join pool for the CPU decode hot path whose caller takes part and whose workers spin briefly
//! between calls before they sleep.
//!
//! Why not the rayon pool there: a decode step calls attention once per layer with ~0.1 ms of other work
//! (the model's Python) in between, and each call is small (0.1–5 ms). Handing such a call to a sleeping
//! rayon worker costs a wake-up: measured on the 2-vCPU VM (crates/conformance/examples/cpu_gap_probe.rs), a 256-key call
//! took 196 µs on one thread and 372 µs on two — the hand-off alone cost more than the work, and at 2K
//! keys two threads were only 1.1–1.4× one. OpenMP runtimes (vLLM's CPU attention) avoid this by spinning
//! after a parallel region; this pool does the same for a bounded time (`KVS_SPIN_US`, default 100 µs),
//! then parks, and the caller works on the items itself, so a call is never slower than running it
//! alone while a worker wakes up.
//!
//! Why the spin is short: inside a model our workers are not the only threads; the model's own (PyTorch's
//! OpenMP pool, which runs the GEMMs between attention calls) want the same cores. With a 1000 µs spin,
//! vLLM on the 2-vCPU VM decoded SmolLM2 at 0.60x of its own attention's speed (7K prompt), with 100 µs
//! or none at 0.87-0.88x, and at 4K 0.77x against 1.15-1.16x (scripts/vllm_e2e_bench.py, docs/perf.md):
//! a spinning worker took a core from the GEMM that followed. 100 µs still covers the cache write ->
//! attention gap of one layer.
//!
//! Inside a process that runs PyTorch, the pool does not start workers of its own: it runs its items on
//! PyTorch's OpenMP team (`host_omp`), whose threads are the ones spinning between the GEMMs.
//!
//! Safety protocol: the job lives on the caller's stack. Workers join it under the slot's mutex (counting
//! themselves in `in_flight`); the caller, once the items are taken, empties the slot under the same mutex
//! and waits for `in_flight == 0`, so no worker touches the job after the caller returns. A panic in an
//! item is caught in the worker and re-raised on the caller after the others finished.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::host_omp::HostOmp;

type Item<'a> = dyn Fn(usize) + Sync + 'a;

struct Job {
    n: usize,
    next: AtomicUsize,
    in_flight: AtomicUsize,
    /// The caller's closure, lifetime erased; valid while the job is in the slot or `in_flight > 0`.
    f: *const Item<'static>,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

// SAFETY: `f` is Sync and outlives every use (see the protocol above).
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

impl Job {
    /// Takes items until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            // SAFETY: see the protocol: the caller keeps the closure alive while items are being run.
            let f = unsafe { &*self.f };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                self.panic.lock().get_or_insert(p);
                // Leave the rest to the caller's re-raise: stop handing out items.
                self.next.store(self.n, Ordering::Relaxed);
                return;
            }
        }
    }
}

struct Shared {
    /// Pointer to the current job (None between calls).
    slot: Mutex<Option<*const Job>>,
    epoch: AtomicU64,
    stop: AtomicBool,
    spin: Duration,
    /// Per worker: parked (or about to park) and its handle.
    sleeping: Vec<AtomicBool>,
    threads: Mutex<Vec<Thread>>,
}

// SAFETY: the raw job pointer is only dereferenced under the protocol above.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// `threads - 1` workers plus the calling thread; or, in a process that already has an OpenMP runtime
/// loaded (PyTorch's), that runtime's team of `threads` (see [`HostOmp`]) and no workers of our own.
pub struct SpinPool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    threads: usize,
    omp: Option<HostOmp>,
}

fn spin_time() -> Duration {
    let us = std::env::var("KVS_SPIN_US").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(100);
    Duration::from_micros(us.min(1_000_000))
}

impl SpinPool {
    /// A pool that runs items on up to `threads` threads in all (the caller included): on the host's OpenMP
    /// team where the process runs PyTorch or one OpenMP runtime (`host_omp`), else on `threads - 1`
    /// workers of its own. Fails only if the OS refuses a thread.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        Self::with_host_omp(threads, if threads > 1 { HostOmp::detect() } else { None })
    }

    /// A pool on the given OpenMP runtime (None: our own spinning workers).
    pub fn with_host_omp(threads: usize, omp: Option<HostOmp>) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let workers = if omp.is_some() { 0 } else { threads - 1 };
        let shared = Arc::new(Shared {
            slot: Mutex::new(None),
            epoch: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            spin: spin_time(),
            sleeping: (0..workers).map(|_| AtomicBool::new(false)).collect(),
            threads: Mutex::new(Vec::new()),
        });
        let mut handles = Vec::with_capacity(workers);
        for w in 0..workers {
            let sh = shared.clone();
            let h = std::thread::Builder::new().name(format!("kvsparse-spin-{w}")).spawn(move || worker(&sh, w))?;
            shared.threads.lock().push(h.thread().clone());
            handles.push(h);
        }
        Ok(SpinPool { shared, handles, threads, omp })
    }

    /// Threads that run items (workers + the caller, or the OpenMP team).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Whether handing items to the other threads is cheap: they are the host's OpenMP team, kept awake by
    /// the host's own parallel work, rather than our workers, which may be parked.
    pub fn on_host_team(&self) -> bool {
        self.omp.is_some()
    }

    /// Runs `f(0) .. f(n - 1)` on the pool and the calling thread; returns when all have run. A panic in
    /// an item is re-raised here.
    pub fn run<'a>(&self, n: usize, f: &(dyn Fn(usize) + Sync + 'a)) {
        if n == 0 {
            return;
        }
        if n == 1 || self.threads == 1 {
            (0..n).for_each(f);
            return;
        }
        // SAFETY: lifetime erasure only; the job is emptied and drained before this function returns.
        let f_static: *const Item<'static> = unsafe { std::mem::transmute::<*const Item<'a>, *const Item<'static>>(f as *const Item<'a>) };
        let job = Job {
            n,
            next: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            f: f_static,
            panic: Mutex::new(None),
        };
        if let Some(omp) = &self.omp {
            // Every thread of the team takes items until none are left; the team is joined on return. No
            // more threads than the host runs its own regions with: a larger team would start threads beside
            // the host's (more threads than cores, all of them spinning).
            let team = self.threads.min(n).min(omp.team_size());
            if team <= 1 {
                (0..n).for_each(f);
                return;
            }
            omp.run_on_team(team, &|| job.work());
            if let Some(p) = job.panic.lock().take() {
                resume_unwind(p);
            }
            return;
        }
        *self.shared.slot.lock() = Some(&job as *const Job);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        let threads = self.shared.threads.lock();
        for (w, t) in threads.iter().enumerate() {
            if self.shared.sleeping[w].load(Ordering::SeqCst) {
                t.unpark();
            }
        }
        drop(threads);
        job.work();
        // No new joiners; wait for the ones inside.
        *self.shared.slot.lock() = None;
        while job.in_flight.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        let panicked = job.panic.lock().take();
        if let Some(p) = panicked {
            resume_unwind(p);
        }
    }
}

fn worker(sh: &Shared, w: usize) {
    let mut seen = sh.epoch.load(Ordering::SeqCst);
    loop {
        // Wait for a new job: spin for a while, then park.
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            if sh.stop.load(Ordering::Relaxed) {
                return;
            }
            let e = sh.epoch.load(Ordering::SeqCst);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 && t0.elapsed() >= sh.spin {
                sh.sleeping[w].store(true, Ordering::SeqCst);
                // Re-check after announcing: a job posted in between unparks us (or we see its epoch).
                if sh.epoch.load(Ordering::SeqCst) == seen && !sh.stop.load(Ordering::SeqCst) {
                    std::thread::park_timeout(Duration::from_millis(100));
                }
                sh.sleeping[w].store(false, Ordering::SeqCst);
                continue;
            }
            std::hint::spin_loop();
        }
        // Join the job if it is still open.
        let job = {
            let slot = sh.slot.lock();
            match *slot {
                Some(j) => {
                    // SAFETY: the job is alive while it is in the slot; counted before the lock is released.
                    unsafe { (*j).in_flight.fetch_add(1, Ordering::AcqRel) };
                    Some(j)
                }
                None => None,
            }
        };
        if let Some(j) = job {
            // SAFETY: in_flight > 0 keeps the caller waiting, so the job stays alive.
            let j = unsafe { &*j };
            j.work();
            j.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for t in self.shared.threads.lock().iter() {
            t.unpark();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_item_once_from_many_calls() {
        let pool = SpinPool::with_host_omp(3, None).unwrap();
        for n in [0usize, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
        // After the workers fell asleep, calls still complete.
        std::thread::sleep(Duration::from_millis(5));
        let sum = AtomicUsize::new(0);
        pool.run(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

    #[test]
    fn runs_on_a_loaded_openmp_runtime() {
        if !crate::cpu::host_omp::tests::load_system_libgomp() {
            eprintln!("no libgomp on this machine: host-OpenMP path not tested");
            return;
        }
        let omp = HostOmp::detect().expect("the loaded libgomp is found");
        assert!(omp.path.contains("libgomp"), "{}", omp.path);
        let pool = SpinPool::with_host_omp(3, Some(omp)).unwrap();
        assert!(pool.on_host_team() && pool.threads() == 3 && pool.handles.is_empty());
        let tids = Mutex::new(std::collections::HashSet::new());
        for n in [0usize, 1, 2, 7, 300] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                tids.lock().insert(std::thread::current().id());
                std::hint::black_box((0..2000).sum::<u64>());
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
        // Items that wait (up to 10 s) until two threads are in them: they finish only if the team's
        // threads take items at once (on a loaded machine the caller alone may have run every item above).
        let inside = AtomicUsize::new(0);
        pool.run(3, &|_| {
            inside.fetch_add(1, Ordering::SeqCst);
            tids.lock().insert(std::thread::current().id());
            let t0 = std::time::Instant::now();
            while inside.load(Ordering::SeqCst) < 2 && t0.elapsed() < std::time::Duration::from_secs(10) {
                std::hint::spin_loop();
            }
        });
        assert!(tids.lock().len() > 1 && inside.load(Ordering::SeqCst) == 3, "items ran on one thread only");
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(50, &|i| assert!(i != 17, "item 17"))));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_panicking_item_is_reraised_on_the_caller_and_the_pool_survives() {
        let pool = SpinPool::with_host_omp(2, None).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(50, &|i| {
                if i == 17 {
                    panic!("item 17");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }
}
