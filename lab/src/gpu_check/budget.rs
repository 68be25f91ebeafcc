//! The time budget of a `gpu-check` run (`--time-limit SECONDS`, issue 39):
//! a GPU machine is lent for minutes, and a step cut off by a timeout loses
//! its work. Each timing row is started only while the time left covers
//! its reserve, else it is skipped with a line saying so; the rows that
//! finished are already in `timing.json` (timing.rs, [`super::timing`]).

use std::time::{Duration, Instant};

/// Least reserve of a step: the time a row needs before its first
/// measurement (inputs, warm-up), when nothing has been timed yet.
pub(crate) const MIN_RESERVE: Duration = Duration::from_secs(2);

/// A deadline (or none) and the longest step seen so far.
#[derive(Clone, Debug, Default)]
pub(crate) struct Budget {
    end: Option<Instant>,
    slowest: Duration,
}

impl Budget {
    /// A budget of `limit` seconds from `start`.
    pub fn from(start: Instant, limit: Option<f64>) -> Budget {
        Budget {
            end: limit.map(|s| start + Duration::from_secs_f64(s.max(0.0))),
            slowest: Duration::ZERO,
        }
    }

    /// The reserve of the next step: twice the longest step so far (the
    /// next row may be the larger one of its group), at least
    /// [`MIN_RESERVE`].
    pub fn reserve(&self) -> Duration {
        (self.slowest * 2).max(MIN_RESERVE)
    }

    /// Time left at `now`; `None` without a limit.
    pub fn left_at(&self, now: Instant) -> Option<Duration> {
        self.end.map(|e| e.saturating_duration_since(now))
    }

    /// `Ok(())` when a step may start at `now`, else the line that says why
    /// it is skipped (naming `what`, the time left and the reserve).
    pub fn admit_at(&self, now: Instant, what: &str) -> std::result::Result<(), String> {
        match self.left_at(now) {
            Some(left) if left < self.reserve() => Err(format!(
                "skipped: {what} ({:.1} s left of the time limit, below the reserve of {:.1} s)",
                left.as_secs_f64(),
                self.reserve().as_secs_f64()
            )),
            _ => Ok(()),
        }
    }

    /// [`Budget::admit_at`] now.
    pub fn admit(&self, what: &str) -> std::result::Result<(), String> {
        self.admit_at(Instant::now(), what)
    }

    /// Records that a step took `took`.
    pub fn took(&mut self, took: Duration) {
        self.slowest = self.slowest.max(took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_skipped_when_the_time_left_is_below_their_reserve() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut b = Budget::from(t0, Some(10.0));
        // Nothing timed yet: the least reserve (2 s).
        assert!(b.admit_at(t0, "a").is_ok());
        assert!(b.admit_at(t0 + s(8), "a").is_ok());
        let e = b
            .admit_at(t0 + Duration::from_millis(8_500), "row x")
            .unwrap_err();
        assert!(e.starts_with("skipped: row x (1.5 s left"), "{e}");
        // A 3 s step: the next one needs 6 s.
        b.took(s(3));
        assert_eq!(b.reserve(), s(6));
        assert!(b.admit_at(t0 + s(4), "b").is_ok());
        assert!(b.admit_at(t0 + s(5), "b").is_err());
        // A shorter step does not lower it; past the end nothing starts.
        b.took(s(1));
        assert_eq!(b.reserve(), s(6));
        assert!(b.admit_at(t0 + s(11), "c").is_err());
        assert_eq!(b.left_at(t0 + s(11)), Some(Duration::ZERO));
        // No limit: everything starts.
        let mut free = Budget::from(t0, None);
        free.took(s(1000));
        assert!(free.admit_at(t0 + s(1_000_000), "d").is_ok());
        // A zero limit: nothing starts.
        assert!(Budget::from(t0, Some(0.0)).admit_at(t0, "e").is_err());
    }
}
