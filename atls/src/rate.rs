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
//! past that the server tells the peer it is busy (`residency`), and the
//! peer may try again. On a server that validates no client, all sources
//! together also get at most [`OVERALL_BURST`] and then one every
//! [`OVERALL_EVERY`]. A few addresses can keep that bound used up, so past
//! it a *quiet* prefix is still answered: an IPv4 /24 or an IPv6 /48
//! ([`Prefix`]) that got no answer for [`QUIET_FOR`]. Quiet prefixes share
//! a small bucket of their own ([`QUIET_BURST`], then one every
//! [`QUIET_EVERY`]) and take its answers in turn: in the order in which
//! they first asked for one, each waiting for its turn up to
//! [`QUIET_WAIT`] and keeping its place for [`PLACE_KEPT_FOR`] after it
//! last asked. A prefix that asks again while its request waits is told
//! busy at once, so asking often gains nothing; a client told busy that
//! asks again soon is answered before every prefix that first asked after
//! it. Many addresses of one /24 or /48 count as one, and many prefixes
//! asking get one answer each in turn: the operator's CLI, retrying, waits
//! for the prefixes ahead of it, not for ever.
//!
//! A server that validates its clients has no such bound: there, answers
//! go only to attested nodes, and after a control plane restarts every
//! member may need one.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

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
/// How long a prefix must have had no answer to be answered past the
/// overall bound.
pub(crate) const QUIET_FOR: Duration = Duration::from_secs(30);
/// Answers past the overall bound, to quiet prefixes, at once.
pub(crate) const QUIET_BURST: f64 = 4.0;
/// Then one answer per this long to quiet prefixes past the overall bound.
pub(crate) const QUIET_EVERY: Duration = Duration::from_secs(1);
/// How long a request of a quiet prefix waits for its turn before the
/// server tells the peer it is busy: long enough for the next answer of
/// the quiet bucket, short against the handshake timeout; not counted in
/// an eviction's age (it is the server's, and one request per prefix
/// waits).
pub(crate) const QUIET_WAIT: Duration = Duration::from_millis(1500);
/// How long a quiet prefix keeps its place in the order after it last
/// asked: a client told busy keeps it while it asks again.
pub(crate) const PLACE_KEPT_FOR: Duration = Duration::from_secs(30);
/// Most places in the order; a prefix past it is told busy.
const MAX_PLACES: usize = 1024;
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

    /// How long from `now` until there is a token.
    fn until_one(&self, burst: f64, rate: f64, now: Instant) -> Duration {
        let missing = 1.0 - self.level(burst, rate, now);
        Duration::try_from_secs_f64(missing.max(0.0) / rate).unwrap_or(Duration::MAX)
    }
}

/// What answers past the overall bound are counted under: an IPv4 /24 or
/// an IPv6 /48, wider than a [`Source`], so that addresses drawn from one
/// network count once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Prefix {
    V4([u8; 3]),
    V6([u8; 6]),
    Unknown,
}

impl Prefix {
    fn of(source: Source) -> Self {
        match source {
            Source::V4(v4) => {
                let [a, b, c, _] = v4.octets();
                Self::V4([a, b, c])
            }
            Source::V6Prefix([a, b, c, d, e, f, _, _]) => Self::V6([a, b, c, d, e, f]),
            Source::Unknown => Self::Unknown,
        }
    }
}

/// The answer rate of one server.
#[derive(Debug)]
pub(crate) struct AnswerRate {
    state: Mutex<State>,
    /// Woken when a quiet prefix's turn may have come: the one ahead was
    /// answered or stopped waiting.
    turns: Notify,
}

#[derive(Debug, Default)]
struct State {
    sources: HashMap<Source, Bucket>,
    /// The bound over all sources, where there is one.
    overall: Option<Overall>,
}

/// The bound over all sources of a server that validates no client, and
/// the quiet prefixes' turns past it.
#[derive(Debug)]
struct Overall {
    all: Bucket,
    quiet: Bucket,
    /// When each prefix was last answered, while that keeps it from being
    /// quiet (pruned once past [`QUIET_FOR`]).
    answered: HashMap<Prefix, Instant>,
    /// Quiet prefixes in the order they first asked.
    places: VecDeque<Place>,
}

/// A quiet prefix's place in the order.
#[derive(Debug)]
struct Place {
    prefix: Prefix,
    /// When it last asked.
    asked: Instant,
    /// Whether a request of it waits for its turn now.
    waiting: bool,
}

/// What [`AnswerRate::decide`] decided for a request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Answer it.
    Answer,
    /// Tell the peer the server is busy.
    Refuse,
    /// Wait for the prefix's turn ([`AnswerRate::take_turn`]).
    Queue(Prefix),
}

/// What [`AnswerRate::take_turn`] found.
#[derive(Debug, PartialEq, Eq)]
enum Turn {
    /// The prefix's turn came: answer it.
    Answered,
    /// It is the prefix's turn; the next token comes after this long.
    Next(Duration),
    /// Another prefix's turn comes first.
    Behind,
}

impl Overall {
    fn new(now: Instant) -> Self {
        Self {
            all: Bucket::full(OVERALL_BURST, now),
            quiet: Bucket::full(QUIET_BURST, now),
            answered: HashMap::new(),
            places: VecDeque::new(),
        }
    }

    fn quiet(&self, prefix: Prefix, now: Instant) -> bool {
        self.answered
            .get(&prefix)
            .is_none_or(|at| now.saturating_duration_since(*at) >= QUIET_FOR)
    }

    /// Notes an answer to `prefix`, which gives up its place.
    fn answered(&mut self, prefix: Prefix, now: Instant) {
        if self.answered.len() >= MAX_SOURCES {
            self.answered
                .retain(|_, at| now.saturating_duration_since(*at) < QUIET_FOR);
        }
        // The bounds on answers keep the table far below its bound; past
        // it, a prefix answered is forgotten sooner, never refused.
        if self.answered.len() < MAX_SOURCES {
            self.answered.insert(prefix, now);
        }
        self.places.retain(|p| p.prefix != prefix);
    }

    /// Queues a request of the quiet `prefix`, at its place if it has one:
    /// false if a request of it waits already or the order is full.
    fn join(&mut self, prefix: Prefix, now: Instant) -> bool {
        self.places
            .retain(|p| p.waiting || now.saturating_duration_since(p.asked) < PLACE_KEPT_FOR);
        let full = self.places.len() >= MAX_PLACES;
        match self.places.iter_mut().find(|p| p.prefix == prefix) {
            Some(place) if place.waiting => false,
            Some(place) => {
                place.waiting = true;
                place.asked = now;
                true
            }
            None if full => false,
            None => {
                self.places.push_back(Place {
                    prefix,
                    asked: now,
                    waiting: true,
                });
                true
            }
        }
    }

    /// Whether the waiting `prefix` is answered now, or how long it waits.
    fn take_turn(&mut self, prefix: Prefix, now: Instant) -> Turn {
        let rate = 1.0 / QUIET_EVERY.as_secs_f64();
        let first = self.places.iter().find(|p| p.waiting).map(|p| p.prefix);
        if first != Some(prefix) {
            return Turn::Behind;
        }
        if self.quiet.take(QUIET_BURST, rate, now) {
            self.answered(prefix, now);
            return Turn::Answered;
        }
        Turn::Next(self.quiet.until_one(QUIET_BURST, rate, now))
    }

    /// The request of `prefix` stops waiting; the prefix keeps its place.
    fn leave(&mut self, prefix: Prefix) {
        if let Some(place) = self.places.iter_mut().find(|p| p.prefix == prefix) {
            place.waiting = false;
        }
    }
}

impl AnswerRate {
    /// The rate of a server; `bounded_overall` for one that validates no
    /// client (see the module documentation).
    pub(crate) fn new(bounded_overall: bool) -> Self {
        Self {
            state: Mutex::new(State {
                sources: HashMap::new(),
                overall: bounded_overall.then(|| Overall::new(Instant::now())),
            }),
            turns: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the server may answer a challenge from `source`; counts the
    /// answer if so. A request of a quiet prefix past the overall bound
    /// waits for its turn, at most [`QUIET_WAIT`].
    pub(crate) async fn allow(&self, source: Source) -> bool {
        match self.decide(source, Instant::now()) {
            Decision::Answer => true,
            Decision::Refuse => false,
            Decision::Queue(prefix) => self.wait_turn(prefix).await,
        }
    }

    /// Decides a request of `source` at `now`: answered, refused, or
    /// queued for its prefix's turn (then it waits in the order).
    fn decide(&self, source: Source, now: Instant) -> Decision {
        let per_source = 1.0 / PER_SOURCE_EVERY.as_secs_f64();
        let mut state = self.lock();
        if !state.sources.contains_key(&source) && state.sources.len() >= MAX_SOURCES {
            state
                .sources
                .retain(|_, b| b.level(PER_SOURCE_BURST, per_source, now) < PER_SOURCE_BURST);
            if state.sources.len() >= MAX_SOURCES {
                return Decision::Refuse;
            }
        }
        let allowed = state
            .sources
            .entry(source)
            .or_insert_with(|| Bucket::full(PER_SOURCE_BURST, now))
            .take(PER_SOURCE_BURST, per_source, now);
        if !allowed {
            return Decision::Refuse;
        }
        let Some(overall) = &mut state.overall else {
            return Decision::Answer;
        };
        let prefix = Prefix::of(source);
        if overall
            .all
            .take(OVERALL_BURST, 1.0 / OVERALL_EVERY.as_secs_f64(), now)
        {
            overall.answered(prefix, now);
            return Decision::Answer;
        }
        // Past the overall bound, only a quiet prefix is answered, in its
        // turn: a few addresses that keep the bound used up do not lock
        // out everyone else, and many fresh ones get little past it.
        if overall.quiet(prefix, now) && overall.join(prefix, now) {
            Decision::Queue(prefix)
        } else {
            Decision::Refuse
        }
    }

    /// Whether the queued `prefix` is answered at `now`, or how long it
    /// waits.
    fn take_turn(&self, prefix: Prefix, now: Instant) -> Turn {
        match &mut self.lock().overall {
            Some(overall) => overall.take_turn(prefix, now),
            None => Turn::Behind,
        }
    }

    /// The queued request of `prefix` stops waiting (answered or not); the
    /// one behind it may take its turn.
    fn leave(&self, prefix: Prefix) {
        if let Some(overall) = &mut self.lock().overall {
            overall.leave(prefix);
        }
        self.turns.notify_waiters();
    }

    /// Waits for the turn of the queued `prefix`, at most [`QUIET_WAIT`]:
    /// whether it was answered.
    async fn wait_turn(&self, prefix: Prefix) -> bool {
        // Leaves the order also when the handshake gives up meanwhile.
        let _waiting = Waiting { rate: self, prefix };
        let deadline = tokio::time::Instant::now() + QUIET_WAIT;
        loop {
            let notified = self.turns.notified();
            tokio::pin!(notified);
            // Registered before looking, so no turn is missed in between.
            notified.as_mut().enable();
            let wait = match self.take_turn(prefix, Instant::now()) {
                Turn::Answered => return true,
                // A millisecond more, so the token is whole when it wakes.
                Turn::Next(next) => next.saturating_add(Duration::from_millis(1)),
                Turn::Behind => QUIET_WAIT,
            };
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            let wake = deadline.min(tokio::time::Instant::now() + wait);
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// Asks once for `source` at `now` without waiting for a turn: a
    /// queued request takes its turn at once or leaves.
    #[cfg(test)]
    fn allow_at(&self, source: Source, now: Instant) -> bool {
        match self.decide(source, now) {
            Decision::Answer => true,
            Decision::Refuse => false,
            Decision::Queue(prefix) => {
                let answered = self.take_turn(prefix, now) == Turn::Answered;
                self.leave(prefix);
                answered
            }
        }
    }
}

/// A request waiting for its prefix's turn; leaves the order when dropped.
struct Waiting<'a> {
    rate: &'a AnswerRate,
    prefix: Prefix,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.rate.leave(self.prefix);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::Ipv4Addr;
    use std::sync::Arc;

    use super::*;

    /// `10.0.0.n`: one /24 for all of them.
    fn source(n: u32) -> Source {
        Source::V4(Ipv4Addr::from(0x0a00_0000 + n))
    }

    /// `10.n.n.1`: a /24 of its own for each `n` below 2^16.
    fn own_24(n: u32) -> Source {
        Source::V4(Ipv4Addr::from(0x0a00_0001 + (n << 8)))
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

    #[test]
    fn prefixes_are_ipv4_24s_and_ipv6_48s() {
        let of = |ip: &str| Prefix::of(Source::of_ip(ip.parse().unwrap()));
        assert_eq!(of("192.0.2.1"), of("192.0.2.200"));
        assert_ne!(of("192.0.2.1"), of("192.0.3.1"));
        assert_eq!(of("2001:db8:1::1"), of("2001:db8:1:ffff::1"));
        assert_ne!(of("2001:db8:1::1"), of("2001:db8:2::1"));
        assert_eq!(of("::ffff:192.0.2.7"), of("192.0.2.1"));
    }

    /// Attacker's move: a few addresses, each within its own share, ask
    /// a port that validates no client for answers, to keep the TPM busy
    /// and the operator out; or many fresh addresses ask once each.
    /// Together they get the overall burst and then one answer per period;
    /// a prefix that got no answer lately (the operator's) is still
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
        // A fresh address of another /24 is answered; one of the flood's
        // /24 is not (answers past the bound are counted per /24, so
        // addresses drawn from one network count once).
        assert!(rate.allow_at(own_24(100), later), "a fresh address");
        assert!(!rate.allow_at(source(100), later), "the flood's /24");
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
        // Many fresh prefixes at once, past the bound: the quiet bucket.
        let at = later + Duration::from_millis(260 * 40);
        let fresh = (1000..1100)
            .filter(|n| rate.allow_at(own_24(*n), at))
            .count();
        assert!(fresh <= QUIET_BURST as usize + 1, "{fresh} fresh answered");
        let unbounded = AnswerRate::new(false);
        let allowed = (0..200)
            .filter(|n| unbounded.allow_at(source(n % 3), t0))
            .count();
        assert_eq!(allowed, 200);
    }

    /// A port that validates no client whose overall bound stays used up,
    /// as flooders keep it.
    fn drained(t0: Instant) -> AnswerRate {
        let rate = AnswerRate::new(true);
        if let Some(overall) = &mut rate.lock().overall {
            overall.all = Bucket {
                tokens: -1e9,
                at: t0,
            };
        }
        rate
    }

    /// Attacker's move: rotate through the addresses of one network, each
    /// asking once, to take the answers past the overall bound. They count
    /// as one prefix: one answer in all.
    #[test]
    fn the_addresses_of_one_24_share_one_answer_past_the_bound() {
        let t0 = Instant::now();
        let rate = drained(t0);
        let answered = (1..=250)
            .filter(|n| rate.allow_at(Source::V4(Ipv4Addr::new(192, 0, 2, *n)), t0))
            .count();
        assert_eq!(answered, 1);
        // Asking again later, answered or not, gains nothing for 30 s.
        let later = t0 + QUIET_FOR - Duration::from_secs(1);
        assert!(!rate.allow_at(Source::V4(Ipv4Addr::new(192, 0, 2, 9)), later));
        assert!(rate.allow_at(Source::V4(Ipv4Addr::new(192, 0, 2, 9)), t0 + QUIET_FOR));
    }

    /// Attacker's move: from many prefixes, keep asking while requests
    /// wait, so that whoever asks first after a token comes takes it. The
    /// turns go by when a prefix first asked: the client told busy that
    /// asks again is answered before every prefix that first asked after
    /// it, however often they ask; one request of a prefix waits at a
    /// time.
    #[test]
    fn past_the_bound_quiet_prefixes_are_answered_in_the_order_they_first_asked() {
        let t0 = Instant::now();
        let rate = drained(t0);
        // The quiet burst goes first come, to four of them.
        let early = (100..104).filter(|n| rate.allow_at(own_24(*n), t0)).count();
        assert_eq!(early, 4);
        // The client asks, is told busy (no token) and goes away.
        let client = own_24(7);
        assert!(!rate.allow_at(client, t0));
        // Forty prefixes after it ask and wait, and keep asking.
        let t1 = t0 + Duration::from_millis(10);
        let spammers: Vec<Prefix> = (200..240)
            .map(|n| match rate.decide(own_24(n), t1) {
                Decision::Queue(prefix) => prefix,
                other => panic!("{other:?}"),
            })
            .collect();
        for n in 200..240 {
            assert_eq!(
                rate.decide(own_24(n), t1),
                Decision::Refuse,
                "one at a time"
            );
        }
        // A token comes while the client is away: the first waiting takes
        // it (an absent place holds nothing up).
        let t2 = t0 + QUIET_EVERY;
        assert_eq!(rate.take_turn(spammers[0], t2), Turn::Answered);
        rate.leave(spammers[0]);
        assert_eq!(rate.take_turn(spammers[1], t2), Turn::Next(QUIET_EVERY));
        // The client asks again: its place is ahead of theirs.
        let Decision::Queue(prefix) = rate.decide(client, t2) else {
            panic!("the client is not queued");
        };
        assert_eq!(rate.take_turn(spammers[1], t2), Turn::Behind);
        let t3 = t2 + QUIET_EVERY;
        assert_eq!(rate.take_turn(spammers[1], t3), Turn::Behind);
        assert_eq!(rate.take_turn(prefix, t3), Turn::Answered);
        rate.leave(prefix);
        // Then the spammers again, in order.
        assert_eq!(rate.take_turn(spammers[2], t3), Turn::Behind);
        assert_eq!(
            rate.take_turn(spammers[1], t3 + QUIET_EVERY),
            Turn::Answered
        );
    }

    #[tokio::test]
    async fn a_queued_request_waits_for_the_next_answer_and_leaves_the_order() {
        let rate = Arc::new(drained(Instant::now()));
        for n in 100..104 {
            assert!(rate.allow(own_24(n)).await);
        }
        let started = Instant::now();
        assert!(rate.allow(own_24(7)).await, "answered in its turn");
        let took = started.elapsed();
        assert!(took < QUIET_WAIT, "{took:?}");
        // Two at once: the first is answered at the next token (a second
        // later), the second waits behind it and is refused at the end of
        // its wait, before the token after.
        let first = tokio::spawn({
            let rate = rate.clone();
            async move { rate.allow(own_24(8)).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let second = rate.allow(own_24(9)).await;
        assert!(first.await.unwrap());
        assert!(!second, "answered past its wait");
        let state = rate.lock();
        let overall = state.overall.as_ref().unwrap();
        assert!(overall.places.iter().all(|p| !p.waiting));
        assert_eq!(overall.places.len(), 1, "the second keeps its place");
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

    #[test]
    fn the_places_in_the_order_are_bounded() {
        let t0 = Instant::now();
        let rate = drained(t0);
        let queued = (100..100 + MAX_PLACES as u32 + 10)
            .filter(|n| matches!(rate.decide(own_24(*n), t0), Decision::Queue(_)))
            .count();
        assert_eq!(queued, MAX_PLACES);
        // Places of prefixes that stopped asking are forgotten in time.
        let state = &mut *rate.lock();
        let overall = state.overall.as_mut().unwrap();
        for place in &mut overall.places {
            place.waiting = false;
        }
        assert!(overall.join(Prefix::of(own_24(50_000)), t0 + PLACE_KEPT_FOR));
        assert_eq!(overall.places.len(), 1);
    }
}
