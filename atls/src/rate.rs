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
//! tries again. There is no bound across sources: a few addresses could
//! use it all up and lock out everyone else, the operator's CLI included.

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
}

impl AnswerRate {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::default(),
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
        state
            .sources
            .entry(source)
            .or_insert_with(|| Bucket::full(PER_SOURCE_BURST, now))
            .take(PER_SOURCE_BURST, per_source, now)
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
        let rate = AnswerRate::new();
        let allowed = (0..200).filter(|_| rate.allow_at(source(1), t0)).count();
        assert_eq!(allowed, PER_SOURCE_BURST as usize);
        // Another source is not held back by the first.
        assert!(rate.allow_at(source(2), t0));
        // One more per period, not a burst.
        let later = t0 + PER_SOURCE_EVERY;
        assert!(rate.allow_at(source(1), later));
        assert!(!rate.allow_at(source(1), later));
    }

    #[test]
    fn the_sources_remembered_are_bounded() {
        let t0 = Instant::now();
        let rate = AnswerRate::new();
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
