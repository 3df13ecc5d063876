//! What time it is, for labd's loops: the ticker, holds, housekeeping,
//! heartbeats and the coordinator's down-after read it here, never from
//! the system directly. labd runs on [`Clock::system`]; a test hands
//! labd a [`Clock::manual`] and moves its [`Hand`], so that what must
//! *not* happen for some seconds is shown without waiting those seconds
//! (mini-redis's injected effects, `../shared/STYLE.md`).
//!
//! ```
//! use std::time::Duration;
//! use labsync_agent::Clock;
//!
//! let (clock, hand) = Clock::manual(1_700_000_000);
//! let then = clock.instant();
//! hand.advance(Duration::from_secs(8));
//! assert_eq!(clock.since(then), Duration::from_secs(8));
//! assert_eq!(clock.unix_secs(), 1_700_000_008);
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of the wall time (Unix) and of monotonic instants. Cheap to
/// clone; the copies of a manual clock share its hand.
#[derive(Clone, Debug, Default)]
pub struct Clock(Source);

#[derive(Clone, Debug, Default)]
enum Source {
    /// The system's clocks.
    #[default]
    System,
    /// Stands still until its hand moves.
    Manual(Arc<Face>),
}

/// A manual clock's state: where it started and how far its hand moved.
#[derive(Debug)]
struct Face {
    /// The instant it stood at when made (instants are opaque: a manual
    /// one is this plus what the hand moved).
    start: Instant,
    /// The Unix time it stood at when made, ms.
    unix_ms: u64,
    /// How far the hand moved since, ms.
    moved_ms: AtomicU64,
}

/// The hand of a [`Clock::manual`]: moving it moves every copy of the
/// clock, forward only.
#[derive(Clone, Debug)]
pub struct Hand(Arc<Face>);

impl Hand {
    /// Moves the clock `by` forward.
    pub fn advance(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.0.moved_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock {
    /// The system's clocks: what labd runs on.
    pub fn system() -> Clock {
        Clock(Source::System)
    }

    /// A clock standing at `unix_secs` until its [`Hand`] moves it.
    pub fn manual(unix_secs: u64) -> (Clock, Hand) {
        let face = Arc::new(Face {
            start: Instant::now(),
            unix_ms: unix_secs.saturating_mul(1000),
            moved_ms: AtomicU64::new(0),
        });
        (Clock(Source::Manual(face.clone())), Hand(face))
    }

    /// The wall time, Unix milliseconds (what signatures, heartbeats and
    /// job records carry).
    pub fn unix_ms(&self) -> u64 {
        match &self.0 {
            Source::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            Source::Manual(f) => f.unix_ms + f.moved_ms.load(Ordering::SeqCst),
        }
    }

    /// The wall time, Unix seconds.
    pub fn unix_secs(&self) -> u64 {
        self.unix_ms() / 1000
    }

    /// A monotonic instant: what "how long since" is measured from.
    pub fn instant(&self) -> Instant {
        match &self.0 {
            Source::System => Instant::now(),
            Source::Manual(f) => f.start + Duration::from_millis(f.moved_ms.load(Ordering::SeqCst)),
        }
    }

    /// How long since `then` (an [`Clock::instant`] of this clock); zero
    /// for an instant still to come.
    pub fn since(&self, then: Instant) -> Duration {
        self.instant().saturating_duration_since(then)
    }
}

/// `2026-12-02 18:04` from Unix seconds, read as UTC.
pub fn utc_time(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_with_its_hand_and_its_copies_with_it() {
        let (clock, hand) = Clock::manual(100);
        let copy = clock.clone();
        let then = clock.instant();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(clock.since(then), Duration::ZERO);
        assert_eq!(clock.unix_ms(), 100_000);
        hand.advance(Duration::from_millis(2_500));
        assert_eq!(copy.since(then), Duration::from_millis(2_500));
        assert_eq!(copy.unix_secs(), 102);
        assert_eq!(
            clock.since(clock.instant() + Duration::from_secs(1)),
            Duration::ZERO
        );
    }

    #[test]
    fn the_system_clock_reads_the_system() {
        let c = Clock::system();
        let before = crate::leases::unix_now();
        let secs = c.unix_secs();
        assert!(secs >= before && secs <= crate::leases::unix_now());
        let then = c.instant();
        std::thread::sleep(Duration::from_millis(5));
        assert!(c.since(then) >= Duration::from_millis(5));
    }
}
