//! Scaffolding shared by the integration tests (`crate::common` in every
//! module of the one test binary).

use treeattn::backend::emu::KernelElem;
use treeattn_lab::gen::Rng;

/// A fresh generator and its seed: `TREEATTN_SEED` when set (to replay a
/// failure), otherwise the clock. Tests put the seed in every failure
/// message.
pub fn seeded_rng() -> (Rng, u64) {
    let seed = std::env::var("TREEATTN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x5eed, |d| d.as_nanos() as u64)
        });
    (Rng::new(seed), seed)
}

/// `n` kernel-element values drawn uniformly from `[-amp, amp)` and rounded
/// to `T`, with the same rounded values widened to `W` (`f32` or `f64`) for
/// the reference, so that only the kernel's arithmetic is under test.
pub fn random_tensor<T: KernelElem, W: From<f32>>(
    rng: &mut Rng,
    n: usize,
    amp: f32,
) -> (Vec<T>, Vec<W>) {
    let x: Vec<T> = (0..n)
        .map(|_| T::from_f32(rng.signed_unit() * amp))
        .collect();
    let wide = x.iter().map(|e| W::from(e.to_f32())).collect();
    (x, wide)
}

/// Runs the calling test alone in a child process of this test binary with
/// `envs` set, for the few tests that flip process-wide state (the CPU
/// backend's code path, read once per process or forced for every thread):
/// in the one binary the other tests run beside them on other threads.
///
/// `test` is the test's path in the binary (`module::name`). In the parent
/// it runs `<this binary> test --exact` with `TREEATTN_TEST_CHILD=test`,
/// fails with the child's output unless exactly that test ran and passed,
/// and returns `false` (the caller returns); in the child it returns `true`
/// (the caller runs its body).
pub fn own_process(test: &str, envs: &[(&str, &str)]) -> bool {
    if std::env::var("TREEATTN_TEST_CHILD").as_deref() == Ok(test) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("TREEATTN_TEST_CHILD", test)
        .envs(envs.iter().copied())
        .output()
        .expect("spawn the test binary");
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && so.contains("test result: ok. 1 passed"),
        "{test} in its own process ({envs:?}): {}\n--- stdout\n{so}\n--- stderr\n{se}",
        out.status
    );
    false
}

/// Time this thread spent on a CPU (Linux: `/proc/thread-self/schedstat`,
/// nanoseconds), else wall-clock time: the complexity guards of `scale`
/// bound work, not the machine's load or the tests running beside them in
/// this binary.
pub struct ThreadClock {
    cpu_ns: Option<u64>,
    wall: std::time::Instant,
}

fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

impl ThreadClock {
    pub fn start() -> Self {
        ThreadClock {
            cpu_ns: thread_cpu_ns(),
            wall: std::time::Instant::now(),
        }
    }

    /// Seconds since `start`: on-CPU time of this thread where the system
    /// reports it, else wall-clock time.
    pub fn secs(&self) -> f64 {
        match (self.cpu_ns, thread_cpu_ns()) {
            (Some(a), Some(b)) => b.saturating_sub(a) as f64 * 1e-9,
            _ => self.wall.elapsed().as_secs_f64(),
        }
    }
}

pub mod calls;

/// A copy of `x` in a buffer of its own that starts `aligned` or not on a
/// 16-byte boundary (the attention kernels need 16-byte aligned tensors):
/// returns the buffer and the offset of the copy in it, so that
/// `&buf[off..off + x.len()]` is the view.
#[allow(dead_code)]
pub fn placed<T: Copy + Default>(x: &[T], aligned: bool) -> (Vec<T>, usize) {
    let size = std::mem::size_of::<T>();
    let mut buf = vec![T::default(); x.len() + 16];
    let base = buf.as_ptr() as usize;
    let off = (0..16)
        .find(|i| (base + i * size).is_multiple_of(16) == aligned)
        .expect("an offset with the asked alignment");
    buf[off..off + x.len()].copy_from_slice(x);
    (buf, off)
}
