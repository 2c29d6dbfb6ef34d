//! Backoff for peers that keep failing authentication (a wrong init secret):
//! after each failure a peer address waits twice as long, up to a cap,
//! before its next attempt is even looked at. Peers are counted as aTLS
//! counts connections ([`keel_atls::Source`]): an IPv6 peer by its /64, so
//! a host does not start afresh from each of its addresses. Bounded in
//! memory.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use keel_atls::Source;

/// Per-address failure backoff.
#[derive(Debug)]
pub struct FailureThrottle {
    first_delay: Duration,
    max_delay: Duration,
    peers: Mutex<HashMap<Source, Failures>>,
}

#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    blocked_until: Instant,
}

impl Default for FailureThrottle {
    fn default() -> Self {
        Self::new(Duration::from_secs(1), Duration::from_secs(60))
    }
}

impl FailureThrottle {
    /// Most addresses tracked; past it, entries whose backoff ended are
    /// dropped, and when none has, the one that ends first.
    pub const MAX_PEERS: usize = 4096;

    /// A throttle whose first failure blocks for `first_delay`, doubling up
    /// to `max_delay`.
    pub fn new(first_delay: Duration, max_delay: Duration) -> Self {
        Self {
            first_delay,
            max_delay,
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// `Err(remaining)` while `peer` must still wait after its failures.
    pub fn check(&self, peer: IpAddr) -> Result<(), Duration> {
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        match peers.get(&Source::of_ip(peer)) {
            Some(f) if f.blocked_until > now => Err(f.blocked_until - now),
            _ => Ok(()),
        }
    }

    /// Records a failure of `peer`; returns its failure count and how long
    /// it now waits.
    pub fn failed(&self, peer: IpAddr) -> (u32, Duration) {
        let peer = Source::of_ip(peer);
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if peers.len() >= Self::MAX_PEERS && !peers.contains_key(&peer) {
            peers.retain(|_, f| f.blocked_until > now);
            if peers.len() >= Self::MAX_PEERS {
                if let Some(first) = peers
                    .iter()
                    .min_by_key(|(_, f)| f.blocked_until)
                    .map(|(source, _)| *source)
                {
                    peers.remove(&first);
                }
            }
        }
        let entry = peers.entry(peer).or_insert(Failures {
            count: 0,
            blocked_until: now,
        });
        entry.count = entry.count.saturating_add(1);
        let doublings = entry.count.saturating_sub(1).min(16);
        let delay = self
            .first_delay
            .saturating_mul(1u32 << doublings)
            .min(self.max_delay);
        entry.blocked_until = now + delay;
        (entry.count, delay)
    }

    /// Forgets `peer`'s failures (it authenticated).
    pub fn succeeded(&self, peer: IpAddr) {
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&Source::of_ip(peer));
    }
}

/// Sources with requests in progress, and how many each holds (an IPv6
/// source by its /64; or any other key a service counts by, such as an
/// EK); a source's place is freed when its [`SourcePlace`] drops.
#[derive(Debug, Clone)]
pub(crate) struct PerSource<K = Source>(Arc<Mutex<HashMap<K, usize>>>);

impl<K> Default for PerSource<K> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<K: Copy + Eq + std::hash::Hash> PerSource<K> {
    /// A place for `source`, unless it holds one already.
    pub(crate) fn claim(&self, source: K) -> Option<SourcePlace<K>> {
        self.claim_up_to(source, 1)
    }

    /// A place for `source`, unless it holds `at_most` already.
    pub(crate) fn claim_up_to(&self, source: K, at_most: usize) -> Option<SourcePlace<K>> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(source).or_insert(0);
        if *count >= at_most {
            if *count == 0 {
                held.remove(&source);
            }
            return None;
        }
        *count += 1;
        Some(SourcePlace {
            held: Arc::clone(&self.0),
            source,
        })
    }
}

/// One place of a source in a [`PerSource`].
#[derive(Debug)]
pub(crate) struct SourcePlace<K: Copy + Eq + std::hash::Hash = Source> {
    held: Arc<Mutex<HashMap<K, usize>>>,
    source: K,
}

impl<K: Copy + Eq + std::hash::Hash> Drop for SourcePlace<K> {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.source) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                held.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn failures_double_the_wait_up_to_the_cap() {
        let t = FailureThrottle::new(Duration::from_millis(100), Duration::from_millis(350));
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        assert!(t.check(a).is_ok());
        assert_eq!(t.failed(a), (1, Duration::from_millis(100)));
        assert!(t.check(a).is_err());
        assert!(t.check(b).is_ok(), "another peer is not held back");
        assert_eq!(t.failed(a).1, Duration::from_millis(200));
        assert_eq!(t.failed(a).1, Duration::from_millis(350));
        t.succeeded(a);
        assert!(t.check(a).is_ok());
    }

    #[test]
    fn an_ipv6_peer_is_counted_by_its_64() {
        let t = FailureThrottle::default();
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other_64: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        t.failed(a);
        assert!(t.check(same_64).is_err(), "a fresh address of the same /64");
        assert_eq!(t.failed(same_64).0, 2);
        assert!(t.check(other_64).is_ok());
        // An IPv4 peer and its IPv4-mapped IPv6 form are one peer.
        let v4: IpAddr = "192.0.2.1".parse().unwrap();
        t.failed(v4);
        assert!(t.check("::ffff:192.0.2.1".parse().unwrap()).is_err());
    }

    #[test]
    fn memory_stays_bounded() {
        let t = FailureThrottle::new(Duration::from_secs(60), Duration::from_secs(60));
        for i in 0..(FailureThrottle::MAX_PEERS as u32 + 100) {
            t.failed(IpAddr::from(i.to_be_bytes()));
        }
        assert!(t.peers.lock().unwrap().len() <= FailureThrottle::MAX_PEERS);
    }

    #[test]
    fn a_source_holds_at_most_its_count_of_places() {
        let sources = PerSource::default();
        let a = Source::of_ip("192.0.2.1".parse().unwrap());
        let b = Source::of_ip("192.0.2.2".parse().unwrap());
        let first = sources.claim_up_to(a, 2).unwrap();
        let second = sources.claim_up_to(a, 2).unwrap();
        assert!(sources.claim_up_to(a, 2).is_none());
        assert!(
            sources.claim(b).is_some(),
            "another source is not held back"
        );
        drop(first);
        let third = sources.claim_up_to(a, 2).unwrap();
        drop((second, third));
        assert!(
            sources.0.lock().unwrap().is_empty(),
            "freed sources are forgotten"
        );
        assert!(sources.claim_up_to(a, 0).is_none());
        assert!(sources.0.lock().unwrap().is_empty());
    }
}
