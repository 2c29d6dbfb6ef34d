//! How often a server's TPM answers key residency challenges from one
//! source: a token bucket per source address.
//!
//! Each answer is a TPM2_ActivateCredential, an RSA decryption by the EK
//! under the lock that quotes wait for. A server that validates its client
//! answers only a client that proved its own key first (`residency`), but
//! a port that validates no client (the init port, with the operator and
//! recovery services) answers anyone, and the issuer gate bounds only how
//! many answers run at once. So a source gets a burst of
//! [`PER_SOURCE_BURST`] answers and then one every [`PER_SOURCE_EVERY`];
//! past that the server sends no proof, the handshake fails and the peer
//! tries again. On a server that validates no client, all sources together
//! also get at most [`OVERALL_BURST`] and then one every [`OVERALL_EVERY`].
//! Past that bound, a source that asked for nothing for [`QUIET_FOR`] is
//! still answered, from a small bucket of its own kind ([`QUIET_BURST`],
//! then one every [`QUIET_EVERY`]): a few addresses cannot keep the TPM
//! busy with answers and starve the quotes of the node's other ports, nor
//! keep the operator's CLI out by keeping the overall bound used up. A server
//! that validates its clients has no such bound: there, answers go only to
//! attested nodes, and after a control plane restarts every member may
//! need one.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::incoming::Source;

/// Answers one source gets at once: nodes behind one address (a NAT, a
/// local cluster's host) may all be new at once, or all prove a control
/// plane's new key again after it restarted.
pub(crate) const PER_SOURCE_BURST: f64 = 128.0;
/// Then one answer per this long, per source.
pub(crate) const PER_SOURCE_EVERY: Duration = Duration::from_millis(250);
/// Answers of all sources at once, where the clients are not validated.
pub(crate) const OVERALL_BURST: f64 = 32.0;
/// Then one answer per this long, of all sources together.
pub(crate) const OVERALL_EVERY: Duration = Duration::from_millis(100);
/// How long a source must have asked for nothing to be answered past the
/// overall bound.
pub(crate) const QUIET_FOR: Duration = Duration::from_secs(30);
/// Answers past the overall bound, to quiet sources, at once.
pub(crate) const QUIET_BURST: f64 = 4.0;
/// Then one answer per this long to quiet sources past the overall bound.
pub(crate) const QUIET_EVERY: Duration = Duration::from_secs(1);
/// Most sources remembered; a new source past it is refused until one
/// that was quiet long enough to be full again is forgotten.
const MAX_SOURCES: usize = 4096;

/// A token bucket: `tokens` at `at`, refilled at `rate` a second up to
/// `burst`.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Self {
        Self {
            tokens: burst,
            at: now,
        }
    }

    /// The tokens at `now`.
    fn level(&self, burst: f64, rate: f64, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        (self.tokens + elapsed * rate).min(burst)
    }

    /// Takes one token at `now` if there is one.
    fn take(&mut self, burst: f64, rate: f64, now: Instant) -> bool {
        let level = self.level(burst, rate, now);
        self.at = now;
        if level >= 1.0 {
            self.tokens = level - 1.0;
            true
        } else {
            self.tokens = level;
            false
        }
    }
}

/// The answer rate of one server.
#[derive(Debug)]
pub(crate) struct AnswerRate {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    sources: HashMap<Source, Bucket>,
    /// The bucket of all sources, where they are bounded together, and
    /// that of quiet sources past it.
    overall: Option<(Bucket, Bucket)>,
}

impl AnswerRate {
    /// The rate of a server; `bounded_overall` for one that validates no
    /// client (see the module documentation).
    pub(crate) fn new(bounded_overall: bool) -> Self {
        Self {
            state: Mutex::new(State {
                sources: HashMap::new(),
                overall: bounded_overall.then(|| {
                    let now = Instant::now();
                    (
                        Bucket::full(OVERALL_BURST, now),
                        Bucket::full(QUIET_BURST, now),
                    )
                }),
            }),
        }
    }

    /// Whether the server may answer a challenge from `source` now; counts
    /// the answer if so.
    pub(crate) fn allow(&self, source: Source) -> bool {
        self.allow_at(source, Instant::now())
    }

    fn allow_at(&self, source: Source, now: Instant) -> bool {
        let per_source = 1.0 / PER_SOURCE_EVERY.as_secs_f64();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if !state.sources.contains_key(&source) && state.sources.len() >= MAX_SOURCES {
            state
                .sources
                .retain(|_, b| b.level(PER_SOURCE_BURST, per_source, now) < PER_SOURCE_BURST);
            if state.sources.len() >= MAX_SOURCES {
                return false;
            }
        }
        let overall_rate = 1.0 / OVERALL_EVERY.as_secs_f64();
        // A source's bucket notes when it last asked, answered or not.
        let quiet = state
            .sources
            .get(&source)
            .is_none_or(|b| now.saturating_duration_since(b.at) >= QUIET_FOR);
        let allowed = state
            .sources
            .entry(source)
            .or_insert_with(|| Bucket::full(PER_SOURCE_BURST, now))
            .take(PER_SOURCE_BURST, per_source, now);
        let Some((overall, quiet_ones)) = &mut state.overall else {
            return allowed;
        };
        // Past the overall bound, only a quiet source is answered, and
        // quiet sources share a small bucket: a few addresses that keep the
        // bound used up do not lock out everyone else, and many fresh ones
        // do not get past it much.
        allowed
            && (overall.take(OVERALL_BURST, overall_rate, now)
                || (quiet && quiet_ones.take(QUIET_BURST, 1.0 / QUIET_EVERY.as_secs_f64(), now)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn source(n: u32) -> Source {
        Source::V4(Ipv4Addr::from(0x0a00_0000 + n))
    }

    #[test]
    fn a_source_gets_its_burst_and_then_one_answer_per_period() {
        let t0 = Instant::now();
        let rate = AnswerRate::new(false);
        let allowed = (0..200).filter(|_| rate.allow_at(source(1), t0)).count();
        assert_eq!(allowed, PER_SOURCE_BURST as usize);
        // Another source is not held back by the first.
        assert!(rate.allow_at(source(2), t0));
        // One more per period, not a burst.
        let later = t0 + PER_SOURCE_EVERY;
        assert!(rate.allow_at(source(1), later));
        assert!(!rate.allow_at(source(1), later));
    }

    /// Attacker's move: a few addresses, each within its own share, ask
    /// a port that validates no client for answers, to keep the TPM busy
    /// and the operator out; or many fresh addresses ask once each.
    /// Together they get the overall burst and then one answer per period;
    /// an address that asked for nothing lately (the operator's) is still
    /// answered, and fresh ones past the bound share a small bucket. A
    /// port that validates its clients is not bounded so.
    #[test]
    fn a_port_of_unvalidated_clients_bounds_sources_that_keep_asking() {
        let t0 = Instant::now();
        let rate = AnswerRate::new(true);
        let flood = |at: Instant| {
            (0..200)
                .filter(|n| rate.allow_at(source(n % 3), at))
                .count()
        };
        assert_eq!(flood(t0), OVERALL_BURST as usize);
        let later = t0 + OVERALL_EVERY;
        assert_eq!(flood(later), 1);
        assert!(rate.allow_at(source(100), later), "a fresh address");
        assert!(!rate.allow_at(source(1), later));
        // Asking every 260 ms for ten seconds, each source within its own
        // share, the three get the overall rate and no more.
        let mut asked = 0;
        let mut answered = 0;
        for step in 1..=40u32 {
            let at = later + Duration::from_millis(260) * step;
            for n in 0..3 {
                asked += 1;
                answered += usize::from(rate.allow_at(source(n), at));
            }
        }
        let overall = (40.0 * 0.26 / OVERALL_EVERY.as_secs_f64()) as usize + 1;
        assert!(answered <= overall, "{answered} of {asked} answered");
        // Many fresh addresses at once, past the bound: the quiet bucket.
        let at = later + Duration::from_millis(260 * 40);
        let fresh = (1000..1100)
            .filter(|n| rate.allow_at(source(*n), at))
            .count();
        assert!(fresh <= QUIET_BURST as usize + 1, "{fresh} fresh answered");
        let unbounded = AnswerRate::new(false);
        let allowed = (0..200)
            .filter(|n| unbounded.allow_at(source(n % 3), t0))
            .count();
        assert_eq!(allowed, 200);
    }

    #[test]
    fn the_sources_remembered_are_bounded() {
        let t0 = Instant::now();
        let rate = AnswerRate::new(false);
        {
            let mut state = rate.state.lock().unwrap();
            for n in 0..MAX_SOURCES as u32 {
                let spent = Bucket {
                    tokens: 0.0,
                    at: t0,
                };
                state.sources.insert(source(n), spent);
            }
        }
        // Every remembered source spent its burst just now: a new one waits.
        let soon = t0 + Duration::from_millis(100);
        assert!(!rate.allow_at(source(1_000_000), soon));
        // Once they are full again they are forgotten, and it is answered.
        let later = t0 + PER_SOURCE_EVERY * (PER_SOURCE_BURST as u32 + 1);
        assert!(rate.allow_at(source(1_000_000), later));
        assert!(rate.state.lock().unwrap().sources.len() <= 2);
    }
}
