//! The verifier's clock: the system's, never earlier than [`FLOOR`].
//!
//! A verifier in a confidential VM reads a clock its host sets. Set back,
//! it would make expired certificates current again: an EK certificate, an
//! AMD or Intel certificate, a CRL or TCB info past its next update. The
//! floor is a time this release was made after (raise it with each
//! release), so the host can take the clock back no further than that.

use std::time::{SystemTime, UNIX_EPOCH};

/// 2026-12-01T00:00:00Z, in Unix seconds.
pub const FLOOR: u64 = 1_796_083_200;

/// Now, in Unix seconds: the system's clock, or [`FLOOR`] if it is earlier.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        .max(FLOOR)
}

/// [`now`] as a signed count, as certificate times are given.
pub fn now_signed() -> i64 {
    i64::try_from(now()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn now_is_the_system_clock_above_the_floor() {
        let system = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        assert!(system >= FLOOR, "this machine's clock is before the floor");
        let read = now();
        assert!(read >= system && read <= system + 5);
        assert_eq!(now_signed(), i64::try_from(now()).unwrap_or(0));
    }
}
