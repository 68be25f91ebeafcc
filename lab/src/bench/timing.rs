//! Timing: process CPU time, medians of repeated runs ([`measure`]) and
//! runs taken in turns ([`measure_round_robin`]).

use std::time::Instant;

use treeattn::{Error, Result};

/// CPU time consumed so far by the whole process (all threads), in
/// seconds, where the OS reports it (64-bit Linux: `clock_gettime` with
/// `CLOCK_PROCESS_CPUTIME_ID`). Unlike wall time it does not grow while the
/// process waits for a core, so it measures work on a loaded machine; it
/// also does not see threads idling at the end of an unbalanced pass, which
/// wall time does.
pub fn process_cpu_seconds() -> Option<f64> {
    #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
    {
        #[repr(C)]
        struct Timespec {
            tv_sec: i64,
            tv_nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
        }
        const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
        let mut ts = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one `struct timespec` (two 64-bit
        // fields on 64-bit Linux) into `ts`, which outlives the call.
        let rc = unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
    {
        None
    }
}

/// Median times of repeated runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Median wall time, seconds.
    pub wall_s: f64,
    /// Median process CPU time (all threads), seconds, where available.
    pub cpu_s: Option<f64>,
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    let mid = x.len() / 2;
    if x.len() % 2 == 1 {
        x[mid]
    } else {
        0.5 * (x[mid - 1] + x[mid])
    }
}

/// Median wall and CPU time of `reps` runs of `f`, after one warm-up run.
pub fn measure(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Timing> {
    if reps == 0 {
        return Err(Error::Usage("--reps must be at least 1".into()));
    }
    f()?;
    let (mut wall, mut cpu) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..reps {
        let c0 = process_cpu_seconds();
        let start = Instant::now();
        f()?;
        wall.push(start.elapsed().as_secs_f64());
        if let (Some(c0), Some(c1)) = (c0, process_cpu_seconds()) {
            cpu.push(c1 - c0);
        }
    }
    Ok(Timing {
        wall_s: median(wall),
        cpu_s: (cpu.len() == reps).then(|| median(cpu)),
    })
}

/// [`measure`] for several runs at once, taken in turns: `reps` rounds
/// that run each unit twice in a row, in order, and time the second run (the
/// first brings its inputs and buffers back into cache, as back-to-back
/// repetitions would); the median of each unit's timed runs. Ratios between
/// units (the tables' ×-columns) then compare runs taken under the same
/// conditions even when the machine's load or clock drifts during the
/// benchmark, which timing each unit's runs back to back does not.
///
/// Errors: `reps` of 0, and the first error of a run.
pub fn measure_round_robin<U>(
    reps: usize,
    units: &mut [U],
    mut run: impl FnMut(&mut U) -> Result<()>,
) -> Result<Vec<Timing>> {
    if reps == 0 {
        return Err(Error::Usage("--reps must be at least 1".into()));
    }
    let mut wall = vec![Vec::with_capacity(reps); units.len()];
    let mut cpu = vec![Vec::with_capacity(reps); units.len()];
    for _ in 0..reps {
        for (i, u) in units.iter_mut().enumerate() {
            run(u)?;
            let c0 = process_cpu_seconds();
            let start = Instant::now();
            run(u)?;
            wall[i].push(start.elapsed().as_secs_f64());
            if let (Some(c0), Some(c1)) = (c0, process_cpu_seconds()) {
                cpu[i].push(c1 - c0);
            }
        }
    }
    Ok(wall
        .into_iter()
        .zip(cpu)
        .map(|(wall, cpu)| Timing {
            wall_s: median(wall),
            cpu_s: (cpu.len() == reps).then(|| median(cpu)),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measure_takes_medians_of_timed_runs_after_a_warm_up() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        let mut n = 0;
        let t = measure(3, || {
            n += 1;
            let end = Instant::now() + std::time::Duration::from_millis(5);
            while Instant::now() < end {
                std::hint::spin_loop();
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(n, 4, "one warm-up and three timed runs");
        assert!(t.wall_s >= 0.005, "{t:?}");
        // Process CPU time (which also counts other tests' threads here).
        assert!(t.cpu_s.expect("Linux reports CPU time") > 0.0);
        assert!(measure(0, || Ok(())).is_err());
        let mut calls = 0;
        let failing = measure(2, || {
            calls += 1;
            Err(Error::Usage("stop".into()))
        });
        assert_eq!((failing, calls), (Err(Error::Usage("stop".into())), 1));
    }

    /// Round robin: rounds in order, each unit run twice in a row (warm-up,
    /// timed); each unit's median is its own (a 30 ms unit and a 1 ms unit
    /// are told apart; the gap is wide because other tests share the cores
    /// and can delay a spinning unit by milliseconds).
    #[test]
    fn round_robin_takes_turns_and_keeps_each_units_times() {
        let order = std::cell::RefCell::new(Vec::new());
        let mut units = [(0usize, 30u64), (1, 1)];
        let t = measure_round_robin(3, &mut units, |&mut (id, ms)| {
            order.borrow_mut().push(id);
            let end = Instant::now() + std::time::Duration::from_millis(ms);
            while Instant::now() < end {
                std::hint::spin_loop();
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(order.into_inner(), [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]);
        assert!(t[0].wall_s >= 0.030 && t[1].wall_s >= 0.001, "{t:?}");
        assert!(t[0].wall_s > t[1].wall_s * 2.0, "{t:?}");
        assert!(measure_round_robin(0, &mut units, |_| Ok(())).is_err());
        let mut calls = 0;
        let failing = measure_round_robin(2, &mut units, |_| {
            calls += 1;
            Err(Error::Usage("stop".into()))
        });
        assert_eq!((failing, calls), (Err(Error::Usage("stop".into())), 1));
    }
}
