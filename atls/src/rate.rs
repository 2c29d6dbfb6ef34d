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
//! also get at most [`OVERALL_BURST`] and then one every [`OVERALL_EVERY`],
//! except that a source that asked for nothing lately (its own bucket is
//! full) is still answered: a few addresses cannot keep the TPM busy with
//! answers and starve the quotes of the node's other ports, nor lock out
//! the operator's CLI by keeping the overall bound used up; getting past
//! it takes a fresh address per answer. A server
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
    /// The bucket of all sources, where they are bounded together.
    overall: Option<Bucket>,
}

impl AnswerRate {
    /// The rate of a server; `bounded_overall` for one that validates no
    /// client (see the module documentation).
    pub(crate) fn new(bounded_overall: bool) -> Self {
        Self {
            state: Mutex::new(State {
                sources: HashMap::new(),
                overall: bounded_overall.then(|| Bucket::full(OVERALL_BURST, Instant::now())),
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
        if let Some(overall) = &state.overall {
            // Past the overall bound, only a source that asked for nothing
            // lately (its own bucket full) is answered: a few addresses
            // that keep the bound used up do not lock out everyone else.
            let fresh = state
                .sources
                .get(&source)
                .is_none_or(|b| b.level(PER_SOURCE_BURST, per_source, now) >= PER_SOURCE_BURST);
            if overall.level(OVERALL_BURST, overall_rate, now) < 1.0 && !fresh {
                return false;
            }
        }
        let allowed = state
            .sources
            .entry(source)
            .or_insert_with(|| Bucket::full(PER_SOURCE_BURST, now))
            .take(PER_SOURCE_BURST, per_source, now);
        if let (true, Some(overall)) = (allowed, &mut state.overall) {
            overall.take(OVERALL_BURST, overall_rate, now);
        }
        allowed
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
    /// and the operator out. Together they get the overall burst and then
    /// one answer per period; an address that asked for nothing lately (the
    /// operator's) is still answered. A port that validates its clients is
    /// not bounded so.
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
