//! Whether a control plane's silence verdicts can be acted on.
//!
//! A control plane judges a node silent by its own wall clock against the
//! last evidence it received (or merged from a peer). Cut off from the
//! cluster (a partition, its host dropping its traffic), paused, or with a
//! clock that jumped forward, it would find every other node silent at
//! once, and under the `revoke` policy its revocations would reach every
//! control plane with the next registry exchange. So:
//!
//! * a sweep that comes more than [`GAP_INTERVALS`] intervals after the
//!   last one (the service was paused or stopped, or the clock jumped)
//!   counts silence afresh from then;
//! * a silent node is revoked only while this control plane has heard
//!   members other than itself throughout the grace period, without a gap
//!   of more than [`GAP_INTERVALS`] intervals, and only if it was marked
//!   at least one interval ago, so that a node marked by a sweep that came
//!   too early has one more interval to report.
//!
//! The evidence service adds two guards of its own: where other control
//! planes are registered, one of their registries merged within the grace
//! period; and no revocation by policy while more than half of the nodes
//! are drifted, or silent, at once ([`crate::registry::Standing::too_many`]).
//!
//! Where a control plane hears no other member (a one-node cluster, or its
//! last worker down), no node is revoked for silence: the price of not
//! revoking a cluster from one cut-off control plane. The operator revokes
//! by hand (`keel revoke`).

use std::time::Duration;

/// Intervals between two sweeps, or two evidences from other members,
/// after which the control plane counts as having been away.
pub const GAP_INTERVALS: u64 = 2;

/// What a control plane heard, and when it swept (Unix seconds).
#[derive(Debug, Clone)]
pub struct Hearing {
    interval: u64,
    swept: Option<u64>,
    counting_from: u64,
    last_heard: Option<u64>,
    heard_since: u64,
}

/// What a sweep may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sweep {
    /// Silence counts from here at the earliest.
    pub counting_from: u64,
    /// Seconds since the last sweep, when the control plane was away.
    pub away: Option<u64>,
    /// Whether silent nodes may be revoked now.
    pub may_revoke_silent: bool,
}

impl Hearing {
    /// A control plane that started at `started`, with evidence every
    /// `interval`.
    pub fn new(started: u64, interval: Duration) -> Self {
        Self {
            interval: interval.as_secs().max(1),
            swept: None,
            counting_from: started,
            last_heard: None,
            heard_since: started,
        }
    }

    fn gap(&self) -> u64 {
        self.interval * GAP_INTERVALS
    }

    /// Evidence from a member other than this control plane, at `now`.
    pub fn heard(&mut self, now: u64) {
        let continuous = self
            .last_heard
            .is_some_and(|last| now >= last && now - last <= self.gap());
        if !continuous {
            self.heard_since = now;
        }
        self.last_heard = Some(now);
    }

    /// A sweep at `now`, whose silence grace is `grace`.
    pub fn sweep(&mut self, now: u64, grace: Duration) -> Sweep {
        let away = self
            .swept
            .filter(|&last| now < last || now - last > self.gap())
            .map(|last| now.saturating_sub(last));
        self.swept = Some(now);
        if away.is_some() {
            self.counting_from = now;
            self.last_heard = None;
        }
        let hearing = self
            .last_heard
            .is_some_and(|last| now >= last && now - last <= self.gap());
        Sweep {
            counting_from: self.counting_from,
            away,
            may_revoke_silent: hearing
                && now.saturating_sub(self.heard_since) >= grace.as_secs()
                && now.saturating_sub(self.counting_from) >= grace.as_secs(),
        }
    }

    /// Whether a node marked silent at `marked_at` may be revoked at `now`
    /// (by [`Sweep::may_revoke_silent`] too): marked an interval ago or more.
    pub fn marked_long_enough(&self, marked_at: u64, now: u64) -> bool {
        now.saturating_sub(marked_at) >= self.interval
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const I: u64 = 60;
    const GRACE: Duration = Duration::from_secs(3 * I);

    /// A control plane started at 0 that heard others every interval and
    /// swept every interval until `until`.
    fn steady(until: u64) -> Hearing {
        let mut h = Hearing::new(0, Duration::from_secs(I));
        let mut t = 0;
        while t <= until {
            h.heard(t);
            h.sweep(t, GRACE);
            t += I;
        }
        h
    }

    #[test]
    fn a_control_plane_that_hears_the_cluster_revokes_after_the_grace() {
        let mut h = Hearing::new(0, Duration::from_secs(I));
        h.heard(0);
        assert!(!h.sweep(60, GRACE).may_revoke_silent, "before the grace");
        let mut h = steady(600);
        let s = h.sweep(660, GRACE);
        assert_eq!(s.away, None);
        assert!(s.may_revoke_silent);
        assert!(h.marked_long_enough(600, 660));
        assert!(!h.marked_long_enough(630, 660));
    }

    #[test]
    fn cut_off_it_revokes_nobody_until_it_heard_the_cluster_for_the_grace() {
        // Partition after 600: nothing heard; sweeps go on. Every node,
        // last heard at 600, is marked silent once quiet for the grace;
        // none may be revoked.
        let mut h = steady(600);
        let mut marked = None;
        for t in (660..=1200).step_by(60) {
            let s = h.sweep(t, GRACE);
            if t - 600 >= GRACE.as_secs() {
                marked = marked.or(Some(t));
            }
            let revoked = marked.is_some_and(|m| s.may_revoke_silent && h.marked_long_enough(m, t));
            assert!(!revoked, "revoked while cut off, at {t}");
            if t >= 600 + 3 * I {
                assert!(!s.may_revoke_silent, "at {t}");
            }
        }
        // Back at 1230: the first evidence does not make its old marks
        // revocable; the others get three intervals to report.
        h.heard(1230);
        assert!(!h.sweep(1260, GRACE).may_revoke_silent);
        let mut t = 1260;
        while t < 1230 + 180 {
            h.heard(t);
            assert!(!h.sweep(t, GRACE).may_revoke_silent, "at {t}");
            t += 60;
        }
        h.heard(1410);
        assert!(h.sweep(1410, GRACE).may_revoke_silent);
    }

    #[test]
    fn a_pause_or_a_clock_jump_counts_silence_afresh() {
        for now in [600 + 3 * I, 600 + 1000 * I] {
            let mut h = steady(600);
            let s = h.sweep(now, GRACE);
            assert_eq!(s.away, Some(now - 600));
            assert_eq!(s.counting_from, now);
            assert!(!s.may_revoke_silent);
            // Others report again: still nothing for the grace.
            h.heard(now + 10);
            assert!(!h.sweep(now + 60, GRACE).may_revoke_silent);
        }
        // Backwards.
        let mut h = steady(600);
        let s = h.sweep(300, GRACE);
        assert_eq!(s.away, Some(0));
        assert_eq!(s.counting_from, 300);
        // One late sweep within the gap is not an absence.
        let mut h = steady(600);
        assert_eq!(h.sweep(600 + 2 * I, GRACE).away, None);
    }
}
