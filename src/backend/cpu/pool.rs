//! The worker threads behind [`super::run_parallel`]: started once per
//! process and reused, instead of spawned and joined at every parallel step.
//!
//! A forward call has two parallel steps and a backward two per kv head;
//! spawning threads at every step is a visible share of a call on a short
//! pack. (Waking a parked worker still costs something per step; spinning
//! before blocking gains little and makes the process CPU time that the
//! bench reports erratic, so workers block. BENCHMARKS.md §7 has the
//! figures.) [`broadcast`] hands one task to
//! the calling thread and to `helpers` parked workers at once and returns
//! when every copy has returned, so the task may borrow from the caller's
//! stack exactly as a scoped thread may. One task runs on the pool at a
//! time; a call that finds it in use (another thread's call, or a task that
//! itself runs a parallel step) falls back to scoped threads.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

/// A task whose lifetime has been erased to hand it to the workers.
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn() + Sync + 'static));

// SAFETY: the pointee is `Sync` (callable from any thread through a shared
// reference), and `broadcast` keeps it alive until every worker that took
// it has returned from it.
unsafe impl Send for Job {}

#[derive(Default)]
struct State {
    /// Workers started so far (never stopped).
    started: usize,
    /// The current task and its number: a worker runs a task at most once.
    job: Option<Job>,
    generation: u64,
    /// Workers the current task asks for, how many took it, and how many of
    /// those have not returned yet.
    wanted: usize,
    taken: usize,
    running: usize,
    /// Whether a worker's copy of the current task panicked.
    panicked: bool,
}

#[derive(Default)]
struct Pool {
    /// Held by the one `broadcast` that owns the workers.
    busy: AtomicBool,
    state: Mutex<State>,
    /// A task was published / the last worker finished one.
    ready: Condvar,
    done: Condvar,
}

static POOL: OnceLock<Pool> = OnceLock::new();

impl Pool {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs `task` on the calling thread and on `helpers` other threads at the
/// same time, and returns when all `helpers + 1` copies have returned. A
/// panic in any copy is resumed on the caller after all have finished.
pub(crate) fn broadcast(helpers: usize, task: &(dyn Fn() + Sync)) {
    if helpers == 0 {
        return task();
    }
    let pool = POOL.get_or_init(Pool::default);
    if pool
        .busy
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return std::thread::scope(|s| {
            for _ in 0..helpers {
                s.spawn(task);
            }
            task();
        });
    }
    // SAFETY: only the lifetime changes. The workers call the task only
    // between taking it below and decrementing `running`, and this function
    // neither returns nor unwinds before `running` is back to 0 (the
    // caller's own copy runs under `catch_unwind`).
    let job = Job(unsafe {
        std::mem::transmute::<*const (dyn Fn() + Sync + '_), *const (dyn Fn() + Sync + 'static)>(
            task,
        )
    });
    {
        let mut st = pool.lock();
        while st.started < helpers {
            std::thread::Builder::new()
                .name("treeattn-cpu".into())
                .spawn(move || worker(pool))
                .expect("failed to spawn a treeattn worker thread");
            st.started += 1;
        }
        st.job = Some(job);
        st.generation += 1;
        st.wanted = helpers;
        st.taken = 0;
        st.running = helpers;
        st.panicked = false;
        pool.ready.notify_all();
    }
    let mine = panic::catch_unwind(AssertUnwindSafe(task));
    let theirs_panicked = {
        let mut st = pool.lock();
        while st.running > 0 {
            st = pool.done.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st.job = None;
        st.panicked
    };
    pool.busy.store(false, Ordering::Release);
    if let Err(payload) = mine {
        panic::resume_unwind(payload);
    }
    assert!(!theirs_panicked, "a treeattn worker thread panicked");
}

/// A worker: waits for a task it has not seen, runs it if the task still
/// wants a worker, reports back, forever.
fn worker(pool: &'static Pool) {
    let mut seen = 0;
    loop {
        let job = {
            let mut st = pool.lock();
            loop {
                if st.generation != seen {
                    seen = st.generation;
                    if st.taken < st.wanted {
                        st.taken += 1;
                        break st.job.expect("a published task");
                    }
                }
                st = pool.ready.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        };
        // SAFETY: `broadcast` keeps the task alive until this worker has
        // decremented `running` below.
        let ok = panic::catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)() })).is_ok();
        let mut st = pool.lock();
        st.panicked |= !ok;
        st.running -= 1;
        if st.running == 0 {
            pool.done.notify_all();
        }
    }
}

/// The process-wide default set by [`set_default_threads`]; 0 = not set.
static DEFAULT_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets the thread count that [`crate::backend::cpu::Cpu::default`] (and
/// every other caller of [`num_threads`]: the model's matrix product, the
/// bench baselines) uses from now on, in this process; `0` clears it, so
/// that the `TREEATTN_THREADS` environment variable (or the machine's
/// cores) applies again. A backend built with
/// [`crate::backend::cpu::Cpu::with_threads`] keeps its own count.
///
/// Coexisting with a host's thread pool (rayon, OpenMP, a framework's
/// intra-op pool): a call runs on the *calling* thread plus `n − 1` workers
/// of this module's own pool, started on first use and parked (blocked on a
/// condition variable, not spinning) between calls, so they take no CPU
/// while the host computes. The two pools do not know about each other:
/// give the host and treeattn counts whose sum fits the cores when both
/// run at once (e.g. call treeattn from a rayon task with
/// `set_default_threads(1)`, or give it all the cores when it runs between
/// the host's parallel regions). A call made while another call holds the
/// pool (two host threads calling at once, or a call from inside a
/// treeattn task) runs on scoped threads instead; it is never queued
/// behind the other.
///
/// ```
/// use treeattn::backend::cpu::{num_threads, set_default_threads, Cpu};
/// set_default_threads(2);
/// assert_eq!(num_threads(), 2);
/// assert_eq!(Cpu::default().threads(), 2);
/// assert_eq!(Cpu::with_threads(3).threads(), 3);
/// set_default_threads(0); // back to TREEATTN_THREADS or all cores
/// ```
pub fn set_default_threads(threads: usize) {
    DEFAULT_THREADS.store(threads, Ordering::Relaxed);
}

/// Number of threads the CPU backend uses by default: the count given to
/// [`set_default_threads`] if one is set, else the environment variable
/// `TREEATTN_THREADS` if it holds a positive integer (read at every call),
/// otherwise `std::thread::available_parallelism()` (1 if unknown).
pub fn num_threads() -> usize {
    match DEFAULT_THREADS.load(Ordering::Relaxed) {
        0 => std::env::var("TREEATTN_THREADS")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        n => n,
    }
}

/// Runs `body` on every work item on up to `threads` threads (the caller
/// and the process's pooled workers, [`broadcast`]), pulling items from a shared
/// queue in order (put expensive items first). Each thread builds its
/// scratch once with `init`.
pub fn run_parallel<W: Send, S>(
    work: Vec<W>,
    threads: usize,
    init: impl Fn() -> S + Sync,
    body: impl Fn(&mut S, W) + Sync,
) {
    let n = threads.min(work.len());
    if n <= 1 {
        let mut scratch = init();
        for w in work {
            body(&mut scratch, w);
        }
        return;
    }
    let queue = Mutex::new(work.into_iter());
    broadcast(n - 1, &|| {
        let mut scratch = init();
        loop {
            let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
            match next {
                Some(w) => body(&mut scratch, w),
                None => break,
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn run_parallel_visits_every_item_once() {
        for threads in [1, 3, 64] {
            let mut out = vec![0u32; 100];
            let work: Vec<_> = out.chunks_mut(7).enumerate().collect();
            run_parallel(
                work,
                threads,
                || 0u32,
                |calls, (i, chunk)| {
                    *calls += 1;
                    chunk.iter_mut().for_each(|x| *x += i as u32 + 1);
                },
            );
            assert!(
                out.iter()
                    .enumerate()
                    .all(|(j, &x)| x == (j / 7) as u32 + 1),
                "{threads} threads"
            );
        }
    }

    #[test]
    fn every_copy_runs_once_on_distinct_threads() {
        for helpers in [1, 3, 2, 0, 3] {
            let runs = AtomicUsize::new(0);
            let ids = Mutex::new(Vec::new());
            broadcast(helpers, &|| {
                runs.fetch_add(1, Ordering::Relaxed);
                ids.lock().unwrap().push(std::thread::current().id());
            });
            assert_eq!(runs.into_inner(), helpers + 1);
            let mut ids = ids.into_inner().unwrap();
            ids.sort_by_key(|id| format!("{id:?}"));
            ids.dedup();
            assert_eq!(ids.len(), helpers + 1, "copies on distinct threads");
        }
    }

    #[test]
    fn a_panicking_copy_reaches_the_caller_and_the_pool_goes_on() {
        for panicker in [0, 1] {
            let which = AtomicUsize::new(0);
            let r = panic::catch_unwind(AssertUnwindSafe(|| {
                broadcast(1, &|| {
                    if which.fetch_add(1, Ordering::SeqCst) == panicker {
                        panic!("copy {panicker}");
                    }
                })
            }));
            assert!(r.is_err());
            let runs = AtomicUsize::new(0);
            broadcast(2, &|| {
                runs.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(runs.into_inner(), 3);
        }
    }

    #[test]
    fn nested_and_concurrent_calls_fall_back_and_finish() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        broadcast(1, &|| {
                            // A task that runs a parallel step itself.
                            broadcast(1, &|| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.into_inner(), 4 * 50 * 2 * 2);
    }
}
