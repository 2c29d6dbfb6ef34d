//! The accept loop: aTLS handshakes on a TCP listener, each in its own task,
//! yielding only validated connections, as tonic's
//! `Server::serve_with_incoming` expects.
//!
//! tonic logs and skips a failed connection, so handshakes are run here
//! instead, where a failure can be logged with its reason and counted.
//!
//! Nothing about a connection is known before its handshake, so what a
//! not-yet-validated connection may hold is bounded; see [`Incoming`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, AcquireError, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio_stream::Stream;

use crate::attestation::ErrorChain;
use crate::server::{AtlsServer, HandshakeError};
use crate::stream::AtlsStream;

/// Default time from accepting a connection to its complete ClientHello.
pub(crate) const DEFAULT_CLIENT_HELLO_TIMEOUT: Duration = Duration::from_secs(3);
/// Default number of handshakes in progress from one source under load.
pub(crate) const DEFAULT_HANDSHAKES_PER_SOURCE: usize = 8;
/// Default number of handshakes in progress in total.
pub(crate) const DEFAULT_HANDSHAKES: usize = 256;
/// Default number of handshakes of one source waiting for or running the
/// issuer.
pub(crate) const DEFAULT_ISSUING_PER_SOURCE: usize = 2;
/// Default number of handshakes waiting for or running the issuer in total.
pub(crate) const DEFAULT_ISSUING: usize = 8;
/// Default number of open connections (in handshake or established) from
/// one source.
pub(crate) const DEFAULT_CONNECTIONS_PER_SOURCE: usize = 32;
/// Default number of open connections in total.
pub(crate) const DEFAULT_CONNECTIONS: usize = 512;

/// Validated connections waiting for the server to take them.
const READY_QUEUE: usize = 64;
/// How often a burst of closed or refused connections is summarised in the
/// log, and how many refusals are logged one by one within that time.
const LOG_WINDOW: Duration = Duration::from_secs(10);
const REFUSALS_LOGGED_PER_WINDOW: u64 = 10;

/// The bounds of one server; see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) client_hello_timeout: Duration,
    pub(crate) handshakes_per_source: usize,
    pub(crate) handshakes: usize,
    /// Whether a newcomer finding every handshake place taken waits for
    /// one, and how old a handshake must be to be closed for it.
    pub(crate) handshake_eviction: Option<Eviction>,
    pub(crate) issuing_per_source: usize,
    pub(crate) issuing: usize,
    pub(crate) connections_per_source: usize,
    pub(crate) connections: usize,
    /// Whether a source is held to its share of open connections at every
    /// load, not only once half are taken.
    pub(crate) connection_share_always: bool,
    /// Whether a newcomer finding every open-connection place taken waits
    /// for one, and what may be closed to make room.
    pub(crate) eviction: Option<Eviction>,
}

/// How a server whose open-connection places are all taken makes room: a
/// newcomer waits for a place (at most `wait`, one waiting per source, at
/// most [`WAITING_PER_PLACE`] per place), first come first served, and
/// for each one waiting, the oldest connection that the application
/// neither vouched for ([`crate::PeerInfo::vouch`]) nor protects
/// ([`crate::PeerInfo::protect`]), `min_age` old, is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Eviction {
    pub(crate) min_age: Duration,
    pub(crate) wait: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            client_hello_timeout: DEFAULT_CLIENT_HELLO_TIMEOUT,
            handshakes_per_source: DEFAULT_HANDSHAKES_PER_SOURCE,
            handshakes: DEFAULT_HANDSHAKES,
            handshake_eviction: None,
            issuing_per_source: DEFAULT_ISSUING_PER_SOURCE,
            issuing: DEFAULT_ISSUING,
            connections_per_source: DEFAULT_CONNECTIONS_PER_SOURCE,
            connections: DEFAULT_CONNECTIONS,
            connection_share_always: false,
            eviction: None,
        }
    }
}

/// What a peer is counted under (connections here, and failures in the
/// agent's throttles): an IPv4 address, the /64 of an IPv6 address (one
/// host may hold all of it), or one shared bucket for connections whose
/// address is unknown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// An IPv4 address (or an IPv4-mapped IPv6 one).
    V4(Ipv4Addr),
    /// The first 64 bits of an IPv6 address.
    V6Prefix([u8; 8]),
    /// No address known.
    Unknown,
}

impl Source {
    /// The source of a connection from `addr`.
    pub fn of(addr: Option<SocketAddr>) -> Self {
        addr.map_or(Self::Unknown, |a| Self::of_ip(a.ip()))
    }

    /// The source of the address `ip`.
    pub fn of_ip(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self::V4(v4),
                None => {
                    let mut prefix = [0u8; 8];
                    prefix.copy_from_slice(&v6.octets()[..8]);
                    Self::V6Prefix(prefix)
                }
            },
        }
    }
}

/// Counts of server handshakes and of connections closed before one.
#[derive(Debug, Default)]
pub struct HandshakeStats {
    accepted: AtomicU64,
    refused: AtomicU64,
    shed: AtomicU64,
}

impl HandshakeStats {
    /// Handshakes that produced a validated connection.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Handshakes that failed or timed out.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Connections closed right after accept, without a handshake, because
    /// their source or the server had its limit of handshakes in progress
    /// or of open connections.
    pub fn shed(&self) -> u64 {
        self.shed.load(Ordering::Relaxed)
    }
}

/// A stream of validated aTLS connections from a listener, for
/// `tonic::transport::Server::serve_with_incoming`. Dropping it stops
/// accepting.
///
/// What a connection may hold before it is validated is bounded, per source
/// and in total (set with [`AtlsServer`]'s `with_*` methods):
///
/// - Open connections (in handshake or established, until the application
///   drops them) are bounded the same way: 512 in all, and 32 per source
///   while at least half of them are taken, by default. An established
///   connection stays as long as the application keeps it (an idle gRPC
///   connection 30 s, one with a request in flight until its timeout), so
///   without this bound a client that completed handshakes and kept them
///   open could exhaust the process's file descriptors and memory. A
///   server may hold sources to their share at every load
///   ([`AtlsServer::with_connection_share_always`]), and may make room for
///   a newcomer when every place is taken rather than close it
///   ([`AtlsServer::with_eviction`]): it waits, and the oldest connection
///   the application neither vouched for nor protects is closed.
/// - Every connection is accepted at once. Right after `accept`, one is
///   closed at once (a TCP reset) and counted in [`HandshakeStats::shed`]
///   when all handshake slots are taken (default 256), or when its source
///   already has its share (default 8) in progress while at least half of
///   the slots are taken. Below half load a source may burst beyond its
///   share (many nodes behind one address); under load each source keeps
///   its share, so a client from a fresh address gets a slot while a flood
///   from a few addresses cannot take them all. But one source's burst and
///   a few more sources' shares can (17 addresses hold the default 256),
///   and a handshake that stalls after the server's flight holds its slot
///   until the handshake timeout; a server may therefore make room for a
///   newcomer that finds every slot taken
///   ([`AtlsServer::with_handshake_eviction`]): it waits, and the oldest
///   handshake in progress is closed for it.
/// - A connection has 3 s (by default) to deliver a complete ClientHello,
///   so a silent or trickling socket is dropped early, and the handshake
///   timeout for the whole handshake.
/// - The issuer (on a node a TPM quote under the TPM lock) runs only after
///   a well-formed ClientHello, and at most 2 handshakes of one source
///   (8 in total, by default) wait for or run it. A handshake takes its
///   source's share first, in arrival order, then a place in the shared
///   queue, which therefore holds at most a share of any one source: a
///   client from another address waits behind a flood's share, not behind
///   the flood.
///
/// A source is an IPv4 address, or the /64 prefix of an IPv6 address (one
/// host commonly holds a whole /64). Closed connections and refusals before
/// a ClientHello are logged at debug level, with a rate-limited summary.
pub struct Incoming<C> {
    connections: mpsc::Receiver<AtlsStream<C>>,
    accept_loop: JoinHandle<()>,
    stats: Arc<HandshakeStats>,
}

impl<C> std::fmt::Debug for Incoming<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<C: Send + Sync + 'static> Incoming<C> {
    /// Starts accepting on `listener` with `server`'s configuration and
    /// limits.
    pub fn new(server: AtlsServer<C>, listener: TcpListener) -> Self {
        let (tx, connections) = mpsc::channel(READY_QUEUE);
        let stats = Arc::new(HandshakeStats::default());
        let accept_loop = tokio::spawn(accept_loop(server, listener, tx, stats.clone()));
        Self {
            connections,
            accept_loop,
            stats,
        }
    }

    /// Handshake counts so far.
    pub fn stats(&self) -> Arc<HandshakeStats> {
        self.stats.clone()
    }
}

impl<C> Drop for Incoming<C> {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

impl<C> Stream for Incoming<C> {
    type Item = Result<AtlsStream<C>, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.connections.poll_recv(cx).map(|c| c.map(Ok))
    }
}

async fn accept_loop<C: Send + Sync + 'static>(
    server: AtlsServer<C>,
    listener: TcpListener,
    tx: mpsc::Sender<AtlsStream<C>>,
    stats: Arc<HandshakeStats>,
) {
    let limits = server.limits();
    let handshakes = Arc::new(
        Admission::new(limits.handshakes_per_source, limits.handshakes)
            .evicting(limits.handshake_eviction),
    );
    let open = Arc::new(
        Admission::new(limits.connections_per_source, limits.connections)
            .share_always(limits.connection_share_always)
            .evicting(limits.eviction),
    );
    let accepting = Arc::new(Accepting {
        server,
        handshakes,
        tx,
        stats,
        shed_log: Throttle::new(1),
        refusal_log: Throttle::new(REFUSALS_LOGGED_PER_WINDOW),
    });
    loop {
        let (tcp, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tracing::warn!(error = %e, "accepting a TCP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let source = Source::of(Some(remote));
        match open.admit(source) {
            Admit::Now(held) => accepting.clone().handshake(tcp, remote, source, held),
            Admit::Refused => accepting.shed(tcp, remote),
            Admit::Wait(waiting) => {
                let (accepting, open) = (accepting.clone(), open.clone());
                tokio::spawn(async move {
                    tracing::debug!(%remote, "waiting for a place among the open connections");
                    match open.wait(waiting).await {
                        Some(held) => accepting.handshake(tcp, remote, source, held),
                        None => accepting.shed(tcp, remote),
                    }
                });
            }
        }
    }
}

/// What every accepted connection's handshake shares.
struct Accepting<C> {
    server: AtlsServer<C>,
    handshakes: Arc<Admission>,
    tx: mpsc::Sender<AtlsStream<C>>,
    stats: Arc<HandshakeStats>,
    shed_log: Throttle,
    refusal_log: Throttle,
}

impl<C: Send + Sync + 'static> Accepting<C> {
    /// Closes `tcp` at once: no place for it.
    fn shed(&self, tcp: tokio::net::TcpStream, remote: SocketAddr) {
        self.stats.shed.fetch_add(1, Ordering::Relaxed);
        // A reset frees the connection on both ends at once.
        let _ = tcp.set_zero_linger();
        drop(tcp);
        tracing::debug!(%remote, "connection closed at once: connection or handshake limit reached");
        if let Some(count) = self.shed_log.record() {
            tracing::warn!(
                count,
                "closed connections at once because their source or the server had its \
                 limit of open connections or of handshakes in progress (count since the \
                 last report)"
            );
        }
    }

    /// Runs the handshake of `tcp`, counted as `held` among the open
    /// connections, in a task of its own, once it has a handshake place:
    /// at once if one is free, after a wait if the server makes room for
    /// newcomers ([`Limits::handshake_eviction`]); else `tcp` is closed.
    fn handshake(
        self: Arc<Self>,
        tcp: tokio::net::TcpStream,
        remote: SocketAddr,
        source: Source,
        held: AdmissionSlot,
    ) {
        match self.handshakes.admit(source) {
            Admit::Now(slot) => {
                tokio::spawn(self.run(tcp, remote, held, slot));
            }
            Admit::Refused => self.shed(tcp, remote),
            Admit::Wait(turn) => {
                tokio::spawn(async move {
                    tracing::debug!(%remote, "waiting for a place among the handshakes");
                    match self.handshakes.wait(turn).await {
                        Some(slot) => self.run(tcp, remote, held, slot).await,
                        None => self.shed(tcp, remote),
                    }
                });
            }
        }
    }

    /// Runs the handshake of `tcp`, which holds `held` among the open
    /// connections and `slot` among the handshakes, until it ends or either
    /// is closed to make room for a newcomer.
    async fn run(
        self: Arc<Self>,
        tcp: tokio::net::TcpStream,
        remote: SocketAddr,
        held: AdmissionSlot,
        slot: AdmissionSlot,
    ) {
        let work = ServerWork::of([&held, &slot]);
        let result = tokio::select! {
            result = self.server.accept_counting(tcp, &work) => result,
            () = held.evicted() => return self.evicted_in_handshake(remote),
            () = slot.evicted() => return self.evicted_in_handshake(remote),
        };
        // The connection is no longer unauthenticated either way.
        drop(slot);
        match result {
            Ok(stream) => {
                self.stats.accepted.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%remote, "aTLS handshake accepted");
                held.established();
                // Fails only when the server stopped; the connection is dropped.
                let _ = self.tx.send(stream.holding(held)).await;
            }
            Err(e) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                if before_client_hello(&e) {
                    // Silent, slow or non-TLS sockets: expected noise.
                    tracing::debug!(%remote, error = %ErrorChain(&e), "aTLS handshake refused");
                } else if let Some(count) = self.refusal_log.record() {
                    tracing::warn!(
                        %remote,
                        error = %ErrorChain(&e),
                        refusals = count,
                        "aTLS handshake refused"
                    );
                }
            }
        }
    }

    /// Counts a handshake closed to make room for a newcomer.
    fn evicted_in_handshake(&self, remote: SocketAddr) {
        self.stats.refused.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%remote, "connection closed in its handshake to make room for a newcomer");
    }
}

/// Whether a handshake failed before a complete, well-formed ClientHello.
fn before_client_hello(e: &HandshakeError) -> bool {
    matches!(
        e,
        HandshakeError::Socket(_)
            | HandshakeError::ClientHello(_)
            | HandshakeError::ClientHelloTimeout(_)
            | HandshakeError::ClientNonce(_)
    )
}

/// Connections counted per source and in total: the handshakes in
/// progress, or the open connections (which, with an [`Eviction`], make
/// room for a newcomer that finds every place taken).
struct Admission {
    per_source: usize,
    total: usize,
    /// Each source held to `per_source` at every load.
    always: bool,
    eviction: Option<Eviction>,
    state: Mutex<AdmissionState>,
}

#[derive(Default)]
struct AdmissionState {
    in_progress: usize,
    sources: HashMap<Source, usize>,
    /// The connections holding a place (with an eviction).
    held: HashMap<u64, Held>,
    next_id: u64,
    /// Newcomers waiting for a place, first come first served.
    waiting: VecDeque<Waiting>,
}

/// A connection holding a place, as an eviction sees it.
struct Held {
    /// When its place was taken, then when its handshake completed: its
    /// age counts from the later, so a slow handshake does not eat the
    /// time a newcomer has to prove itself. The server's own work on its
    /// handshake does not count ([`ServerWork`]).
    since: Instant,
    /// When it was closed to make room, if it was.
    evicted_at: Option<Instant>,
    standing: Arc<Standing>,
}

/// A newcomer waiting for a place.
struct Waiting {
    id: u64,
    source: Source,
    place: oneshot::Sender<AdmissionSlot>,
}

/// A newcomer's turn in the queue, from [`Admission::admit`].
struct Turn {
    id: u64,
    place: oneshot::Receiver<AdmissionSlot>,
}

/// What [`Admission::admit`] decided.
enum Admit {
    /// A place now.
    Now(AdmissionSlot),
    /// A turn in the queue: [`Admission::wait`].
    Wait(Turn),
    /// No place: close the connection.
    Refused,
}

#[cfg(test)]
impl Admit {
    /// The place, if admitted at once.
    fn now(self) -> Option<AdmissionSlot> {
        match self {
            Self::Now(slot) => Some(slot),
            _ => None,
        }
    }
}

/// Newcomers that may wait, per place: a lockout takes this many more
/// addresses (one waiting per source) than the places alone.
const WAITING_PER_PLACE: usize = 4;
/// How often a newcomer waiting for a place tries evictions again (the
/// connections age meanwhile).
const EVICTION_RETRY: Duration = Duration::from_millis(250);
/// How long a connection closed to make room counts as making it: one
/// still open after this (its task not run, its peer stalling a write the
/// close is behind) no longer holds back the eviction of another.
const EVICTION_GRACE: Duration = Duration::from_secs(2);

impl Admission {
    fn new(per_source: usize, total: usize) -> Self {
        Self {
            per_source: per_source.max(1),
            total: total.max(1),
            always: false,
            eviction: None,
            state: Mutex::default(),
        }
    }

    /// Holds each source to its share at every load (`always`), not only
    /// once half of the slots are taken.
    fn share_always(mut self, always: bool) -> Self {
        self.always = always;
        self
    }

    /// Makes room for newcomers as `eviction` says, if set.
    fn evicting(mut self, eviction: Option<Eviction>) -> Self {
        self.eviction = eviction;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AdmissionState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a new connection from `source`; refused when the source
    /// has its share and at least half of the slots are taken (or at any
    /// load, if so set), or when all slots are taken, unless this admission
    /// evicts: then a turn in the queue, refused only when the source
    /// already waits or the queue is full.
    fn admit(self: &Arc<Self>, source: Source) -> Admit {
        let mut state = self.lock();
        let under_load = self.always || state.in_progress >= self.total / 2;
        let held = state.sources.get(&source).copied().unwrap_or(0);
        if held >= self.per_source && under_load {
            return Admit::Refused;
        }
        if state.in_progress < self.total && state.waiting.is_empty() {
            return Admit::Now(self.take(&mut state, source));
        }
        let Some(eviction) = self.eviction else {
            return Admit::Refused;
        };
        if state.waiting.len() >= self.total.saturating_mul(WAITING_PER_PLACE)
            || state.waiting.iter().any(|w| w.source == source)
        {
            return Admit::Refused;
        }
        let (tx, rx) = oneshot::channel();
        let id = state.next_id;
        state.next_id += 1;
        state.waiting.push_back(Waiting {
            id,
            source,
            place: tx,
        });
        evict_for_waiting(&mut state, eviction);
        Admit::Wait(Turn { id, place: rx })
    }

    /// Waits for `turn`'s place, at most the eviction's wait; evictions
    /// are tried again as connections age.
    async fn wait(self: &Arc<Self>, mut turn: Turn) -> Option<AdmissionSlot> {
        let eviction = self.eviction?;
        let deadline = tokio::time::Instant::now() + eviction.wait;
        loop {
            let retry = (tokio::time::Instant::now() + EVICTION_RETRY).min(deadline);
            tokio::select! {
                place = &mut turn.place => return place.ok(),
                () = tokio::time::sleep_until(retry) => {}
            }
            let mut state = self.lock();
            if tokio::time::Instant::now() >= deadline {
                state.waiting.retain(|w| w.id != turn.id);
                drop(state);
                // A place handed over meanwhile is taken, not lost.
                return turn.place.try_recv().ok();
            }
            evict_for_waiting(&mut state, eviction);
        }
    }

    /// Takes a place for `source` (there is one).
    fn take(self: &Arc<Self>, state: &mut AdmissionState, source: Source) -> AdmissionSlot {
        state.in_progress += 1;
        *state.sources.entry(source).or_insert(0) += 1;
        let id = state.next_id;
        state.next_id += 1;
        let standing = self.eviction.map(|_| {
            let standing = Arc::new(Standing::default());
            state.held.insert(
                id,
                Held {
                    since: Instant::now(),
                    evicted_at: None,
                    standing: standing.clone(),
                },
            );
            standing
        });
        AdmissionSlot {
            admission: self.clone(),
            source,
            id,
            standing,
        }
    }

    /// The handshake of the connection `id` completed: its age restarts.
    fn established(&self, id: u64) {
        if let Some(held) = self.lock().held.get_mut(&id) {
            held.since = Instant::now();
            held.standing.server_work_restarts();
        }
    }

    fn release(self: &Arc<Self>, source: Source, id: u64) {
        let mut handed = Vec::new();
        {
            let mut state = self.lock();
            state.held.remove(&id);
            state.in_progress = state.in_progress.saturating_sub(1);
            if let Some(held) = state.sources.get_mut(&source) {
                *held = held.saturating_sub(1);
                if *held == 0 {
                    state.sources.remove(&source);
                }
            }
            // The freed place goes to the first newcomer still waiting.
            while state.in_progress < self.total {
                let Some(next) = state.waiting.pop_front() else {
                    break;
                };
                if next.place.is_closed() {
                    continue;
                }
                let slot = self.take(&mut state, next.source);
                handed.push((next.place, slot));
            }
        }
        // Outside the lock: a place whose newcomer went away meanwhile is
        // released again (and handed on) as its slot drops.
        for (place, slot) in handed {
            let _ = place.send(slot);
        }
    }
}

/// Closes, for each newcomer waiting beyond the connections closed for
/// them within [`EVICTION_GRACE`], the oldest connection the application
/// neither vouched for nor protects, open (or established) at least the
/// eviction's minimum age: established, or still in its handshake. A
/// connection's age leaves out the time the server worked on its
/// handshake ([`ServerWork`], which lists what that is): what ages it is
/// waiting on its peer, and for a turn at the issuer.
fn evict_for_waiting(state: &mut AdmissionState, eviction: Eviction) {
    let now = Instant::now();
    let making_room = state
        .held
        .values()
        .filter(|h| {
            h.evicted_at
                .is_some_and(|at| now.duration_since(at) < EVICTION_GRACE)
        })
        .count();
    for _ in making_room..state.waiting.len() {
        let oldest = state
            .held
            .values_mut()
            .filter(|h| h.evicted_at.is_none() && h.standing.evictable())
            .map(|h| (h.standing.age(h.since, now), h))
            .filter(|(age, _)| *age >= eviction.min_age)
            .max_by_key(|(age, _)| *age)
            .map(|(_, h)| h);
        let Some(held) = oldest else {
            return;
        };
        held.evicted_at = Some(now);
        held.standing.evict();
    }
}

/// What the application and the server know of an open connection that
/// matters to an eviction.
#[derive(Debug, Default)]
pub(crate) struct Standing {
    vouched: AtomicBool,
    protected: AtomicUsize,
    evicted: AtomicBool,
    /// The server's own work on the handshake so far ([`ServerWork`]).
    server_work: Mutex<WorkTime>,
    /// The task reading the established connection.
    reader: Mutex<Option<Waker>>,
    /// The handshake's task.
    handshake: tokio::sync::Notify,
}

/// Time a server spent on a connection's behalf: finished spans, and the
/// start of the one under way (`depth` of them at once).
#[derive(Debug, Default)]
struct WorkTime {
    done: Duration,
    depth: u32,
    since: Option<Instant>,
}

impl Standing {
    /// The connection's age at `now` for an eviction: from `since`, less
    /// the server's own work on it since then.
    fn age(&self, since: Instant, now: Instant) -> Duration {
        let work = self.work_time();
        let under_way = work
            .since
            .map_or(Duration::ZERO, |s| now.saturating_duration_since(s));
        now.saturating_duration_since(since)
            .saturating_sub(work.done + under_way)
    }

    fn work_time(&self) -> std::sync::MutexGuard<'_, WorkTime> {
        self.server_work
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The age restarts (the handshake completed): work done before no
    /// longer counts against it.
    fn server_work_restarts(&self) {
        let mut work = self.work_time();
        work.done = Duration::ZERO;
        if work.since.is_some() {
            work.since = Some(Instant::now());
        }
    }

    fn begin_work(&self) {
        let mut work = self.work_time();
        work.depth += 1;
        if work.since.is_none() {
            work.since = Some(Instant::now());
        }
    }

    fn end_work(&self) {
        let mut work = self.work_time();
        work.depth = work.depth.saturating_sub(1);
        if work.depth == 0 {
            if let Some(since) = work.since.take() {
                work.done += since.elapsed();
            }
        }
    }

    /// Neither vouched for nor protected.
    fn evictable(&self) -> bool {
        !self.vouched.load(Ordering::Acquire) && self.protected.load(Ordering::Acquire) == 0
    }

    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.handshake.notify_one();
        let reader = self
            .reader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(waker) = reader {
            waker.wake();
        }
    }

    /// Whether the connection was closed to make room; if not, the task of
    /// `cx` is woken when it is.
    pub(crate) fn poll_evicted(&self, cx: &Context<'_>) -> bool {
        if self.evicted.load(Ordering::Acquire) {
            return true;
        }
        let mut reader = self.reader.lock().unwrap_or_else(PoisonError::into_inner);
        if !reader.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *reader = Some(cx.waker().clone());
        }
        drop(reader);
        self.evicted.load(Ordering::Acquire)
    }

    /// Until the connection is closed to make room.
    async fn evicted(&self) {
        while !self.evicted.load(Ordering::Acquire) {
            self.handshake.notified().await;
        }
    }

    pub(crate) fn vouch(&self) {
        self.vouched.store(true, Ordering::Release);
    }

    pub(crate) fn protect(&self) {
        self.protected.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn unprotect(&self) {
        self.protected.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The connections whose handshake the server is working on, as their
/// evictions see them: the time between [`ServerWork::begin`] and the end
/// of what it returns does not count toward their age. That is
///
/// * a turn at the issuer: its quote for the certificate, or its
///   residency answer, batch wait included;
/// * for a client the server validated, its wait in the issuer's shared
///   queue for its answer, within the gate's bounds
///   ([`IssuerGate::enter_counting`]);
/// * the wait of a quiet prefix's answer for the overall answer rate
///   (at most [`crate::rate`]'s quiet wait, one per prefix).
///
/// A handshake the issuer is serving is not the stalling peer an eviction
/// makes room against; on a slow TPM it would otherwise be closed for a
/// newcomer, which then waits on the same TPM. Any other wait for a turn
/// counts: a flood's own handshakes queue there, behind their source's
/// share or in the shared queue, and must not be sheltered by it.
#[derive(Clone, Default)]
pub(crate) struct ServerWork {
    standings: Vec<Arc<Standing>>,
}

impl ServerWork {
    /// The work on the handshake of `slots` (its handshake place and its
    /// open connection place).
    fn of(slots: [&AdmissionSlot; 2]) -> Self {
        Self {
            standings: slots
                .into_iter()
                .filter_map(|slot| slot.standing.clone())
                .collect(),
        }
    }

    /// The server works on the handshake until the returned value drops.
    pub(crate) fn begin(&self) -> WorkUnderWay<'_> {
        for standing in &self.standings {
            standing.begin_work();
        }
        WorkUnderWay(self)
    }
}

/// The server's work on a handshake, under way until dropped.
pub(crate) struct WorkUnderWay<'a>(&'a ServerWork);

impl Drop for WorkUnderWay<'_> {
    fn drop(&mut self) {
        for standing in &self.0.standings {
            standing.end_work();
        }
    }
}

/// One handshake in progress, or one open connection; released when
/// dropped.
pub(crate) struct AdmissionSlot {
    admission: Arc<Admission>,
    source: Source,
    id: u64,
    /// What an eviction knows of the connection (an admission that
    /// evicts only).
    standing: Option<Arc<Standing>>,
}

impl AdmissionSlot {
    /// The handshake completed: the connection's age restarts.
    fn established(&self) {
        if self.standing.is_some() {
            self.admission.established(self.id);
        }
    }

    /// What an eviction knows of this connection, if anything.
    pub(crate) fn standing(&self) -> Option<&Arc<Standing>> {
        self.standing.as_ref()
    }

    /// Until an eviction closes the connection (never, without one).
    async fn evicted(&self) {
        match &self.standing {
            Some(standing) => standing.evicted().await,
            None => std::future::pending().await,
        }
    }
}

impl Drop for AdmissionSlot {
    fn drop(&mut self) {
        self.admission.release(self.source, self.id);
    }
}

/// Admission to the issuer: a per-source share first, then a place in the
/// shared, first-come first-served queue.
pub(crate) struct IssuerGate {
    per_source: usize,
    total: Arc<Semaphore>,
    sources: Mutex<HashMap<Source, Arc<Semaphore>>>,
    /// The sources of the handshakes whose wait in the shared queue is the
    /// server's work ([`IssuerGate::enter_counting`]): one per source.
    sheltered: Mutex<HashSet<Source>>,
    /// How many may be, in all: as many as the issuer takes at once.
    shelter_total: usize,
    /// How often key residency challenges are answered.
    answers: crate::rate::AnswerRate,
}

/// A handshake's wait in the shared queue counted as the server's work;
/// ends when dropped. One source has one at a time: a node makes one
/// handshake at a time, and a control plane's members usually connect
/// from their own addresses (members that share an IPv6 /64 or a NAT
/// address share one shelter).
struct Shelter<'g> {
    gate: &'g IssuerGate,
    source: Source,
}

impl Drop for Shelter<'_> {
    fn drop(&mut self) {
        self.gate
            .sheltered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.source);
    }
}

impl std::fmt::Debug for IssuerGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuerGate")
            .field("per_source", &self.per_source)
            .field("available", &self.total.available_permits())
            .finish_non_exhaustive()
    }
}

impl IssuerGate {
    /// A gate admitting `per_source` and `total` handshakes to the issuer;
    /// `answers_bounded_overall` for a server that validates no client
    /// ([`crate::rate`]).
    pub(crate) fn new(per_source: usize, total: usize, answers_bounded_overall: bool) -> Self {
        Self {
            per_source: per_source.max(1),
            total: Arc::new(Semaphore::new(total.max(1))),
            sources: Mutex::default(),
            sheltered: Mutex::default(),
            shelter_total: total.max(1),
            answers: crate::rate::AnswerRate::new(answers_bounded_overall),
        }
    }

    /// A shelter for a handshake of `source` in the shared queue, if its
    /// source has none and the gate's are not all taken.
    fn shelter(&self, source: Source) -> Option<Shelter<'_>> {
        let mut sheltered = self
            .sheltered
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if sheltered.len() >= self.shelter_total || !sheltered.insert(source) {
            return None;
        }
        Some(Shelter { gate: self, source })
    }

    /// Whether a key residency challenge from `source` may be answered
    /// ([`crate::rate`]); counts it if so. A request of a quiet prefix past
    /// the overall bound waits for its turn, briefly.
    pub(crate) async fn may_answer(&self, source: Source) -> bool {
        self.answers.allow(source).await
    }

    /// Waits for a turn at the issuer for a handshake from `source`. Fails
    /// only if the gate was closed, which it never is.
    pub(crate) async fn enter(
        self: &Arc<Self>,
        source: Source,
    ) -> Result<IssuerPermit, AcquireError> {
        self.enter_counting(source, None).await
    }

    /// [`IssuerGate::enter`]; once the source's share is held, the wait
    /// for the shared queue is `shared_wait`'s work, for one handshake of a
    /// source at a time ([`Shelter`]) and as many in all as the issuer
    /// takes at once. The others wait there, and behind
    /// their source's share, as theirs: what a flood of one node, or of
    /// many addresses, queues there ages.
    pub(crate) async fn enter_counting(
        self: &Arc<Self>,
        source: Source,
        shared_wait: Option<&ServerWork>,
    ) -> Result<IssuerPermit, AcquireError> {
        let own = {
            let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
            sources
                .entry(source)
                .or_insert_with(|| Arc::new(Semaphore::new(self.per_source)))
                .clone()
        };
        // Built before waiting: if the handshake gives up while waiting,
        // dropping it releases what it holds and forgets an unused source.
        let mut permit = IssuerPermit {
            gate: self.clone(),
            source,
            own: Some(own),
            holds_own: false,
            shared: None,
        };
        if let Some(own) = &permit.own {
            own.acquire().await?.forget();
        }
        permit.holds_own = true;
        // A free turn is taken without a shelter (nobody waits for one
        // when none is free: tokio hands freed permits to waiters first).
        if let Ok(turn) = self.total.clone().try_acquire_owned() {
            permit.shared = Some(turn);
            return Ok(permit);
        }
        let _queued = shared_wait.and_then(|work| Some((self.shelter(source)?, work.begin())));
        permit.shared = Some(self.total.clone().acquire_owned().await?);
        Ok(permit)
    }
}

/// A handshake's turn at the issuer; released when dropped.
pub(crate) struct IssuerPermit {
    gate: Arc<IssuerGate>,
    source: Source,
    /// This source's share; `None` only while being dropped.
    own: Option<Arc<Semaphore>>,
    holds_own: bool,
    shared: Option<OwnedSemaphorePermit>,
}

impl Drop for IssuerPermit {
    fn drop(&mut self) {
        drop(self.shared.take());
        let Some(own) = self.own.take() else { return };
        if self.holds_own {
            own.add_permits(1);
        }
        let mut sources = self
            .gate
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Clones are made and dropped only under this lock (this one just
        // below): with this one gone, the table's alone means nobody else
        // waits for or holds this source's share. Two permits of a source
        // dropped at once both count under the lock, so the second sees
        // the first's clone gone and forgets the source.
        drop(own);
        if sources
            .get(&self.source)
            .is_some_and(|own| Arc::strong_count(own) == 1)
        {
            sources.remove(&self.source);
        }
    }
}

/// Keeps a burst of similar log lines short: lets `burst` events per
/// [`LOG_WINDOW`] through and reports how many there were when it does.
struct Throttle {
    burst: u64,
    state: Mutex<ThrottleState>,
}

struct ThrottleState {
    window_start: Option<Instant>,
    logged: u64,
    pending: u64,
}

impl Throttle {
    fn new(burst: u64) -> Self {
        Self {
            burst: burst.max(1),
            state: Mutex::new(ThrottleState {
                window_start: None,
                logged: 0,
                pending: 0,
            }),
        }
    }

    /// Records an event; `Some(n)` when it is to be logged, with `n` the
    /// events since the last one logged (this one included).
    fn record(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        state.pending += 1;
        let expired = state
            .window_start
            .is_none_or(|start| now.duration_since(start) >= LOG_WINDOW);
        if expired {
            state.window_start = Some(now);
            state.logged = 0;
        }
        if state.logged >= self.burst {
            return None;
        }
        state.logged += 1;
        Some(std::mem::take(&mut state.pending))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// The README states the bounds this module enforces.
    #[test]
    fn the_readme_states_the_handshake_bounds() {
        let readme = include_str!("../README.md")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let stated = format!(
            "at most {DEFAULT_HANDSHAKES} at once and {DEFAULT_HANDSHAKES_PER_SOURCE} from one source \
             under load, each bounded by the handshake timeout, {} s by default, and by {} s to a \
             complete ClientHello",
            crate::DEFAULT_HANDSHAKE_TIMEOUT.as_secs(),
            DEFAULT_CLIENT_HELLO_TIMEOUT.as_secs()
        );
        assert!(readme.contains(&stated), "{stated}");
    }

    fn v4(last: u8) -> Source {
        Source::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    #[test]
    fn ipv6_sources_are_counted_per_64_and_mapped_ipv4_as_ipv4() {
        let a: SocketAddr = "[2001:db8:1:2::1]:1".parse().unwrap();
        let b: SocketAddr = "[2001:db8:1:2:ffff::9]:2".parse().unwrap();
        let c: SocketAddr = "[2001:db8:1:3::1]:1".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.0.0.7]:1".parse().unwrap();
        assert_eq!(Source::of(Some(a)), Source::of(Some(b)));
        assert_ne!(Source::of(Some(a)), Source::of(Some(c)));
        assert_eq!(Source::of(Some(mapped)), v4(7));
        assert_eq!(Source::of(None), Source::Unknown);
    }

    #[test]
    fn a_source_bursts_while_idle_and_keeps_its_share_under_load() {
        let admission = Arc::new(Admission::new(2, 8));
        // Below half load one source may take more than its share.
        let burst: Vec<_> = (0..4)
            .map(|_| admission.admit(v4(1)).now().unwrap())
            .collect();
        // At half load it is held to its share; others still get theirs.
        assert!(admission.admit(v4(1)).now().is_none());
        let others: Vec<_> = (2..4)
            .flat_map(|s| {
                [
                    admission.admit(v4(s)).now().unwrap(),
                    admission.admit(v4(s)).now().unwrap(),
                ]
            })
            .collect();
        assert!(admission.admit(v4(2)).now().is_none());
        // Full: nobody.
        assert!(admission.admit(v4(9)).now().is_none());
        drop(others);
        assert!(admission.admit(v4(9)).now().is_some());
        drop(burst);
        let state = admission.state.lock().unwrap();
        assert_eq!(state.in_progress, 0);
        assert!(state.sources.is_empty(), "released sources are forgotten");
    }

    #[test]
    fn a_source_held_to_its_share_always_never_bursts() {
        let admission = Arc::new(Admission::new(2, 8).share_always(true));
        let held: Vec<_> = (0..2)
            .map(|_| admission.admit(v4(1)).now().unwrap())
            .collect();
        // Idle as the server is, the source has its share.
        assert!(admission.admit(v4(1)).now().is_none());
        let others: Vec<_> = (2..5)
            .flat_map(|s| [admission.admit(v4(s)).now(), admission.admit(v4(s)).now()])
            .collect();
        assert!(others.iter().all(Option::is_some));
        drop(held);
        assert!(admission.admit(v4(1)).now().is_some());
    }

    /// An admission of 4 places, 2 per source at every load, that makes
    /// room for newcomers: connections of 50 ms or older are evictable,
    /// newcomers wait up to `wait`.
    fn evicting(wait: Duration) -> Arc<Admission> {
        Arc::new(
            Admission::new(2, 4)
                .share_always(true)
                .evicting(Some(Eviction {
                    min_age: Duration::from_millis(50),
                    wait,
                })),
        )
    }

    /// Every place of an [`evicting`] admission, two from each of sources
    /// 1 and 2, in that order.
    fn every_place(admission: &Arc<Admission>) -> Vec<AdmissionSlot> {
        (1..3)
            .flat_map(|s| [admission.admit(v4(s)), admission.admit(v4(s))])
            .map(|a| a.now().unwrap())
            .collect()
    }

    fn turn(admit: Admit) -> Turn {
        match admit {
            Admit::Wait(turn) => turn,
            Admit::Now(_) => panic!("admitted at once"),
            Admit::Refused => panic!("refused"),
        }
    }

    fn standing(slot: &AdmissionSlot) -> &Standing {
        slot.standing
            .as_deref()
            .expect("an evicting admission's slot")
    }

    fn evicted(slot: &AdmissionSlot) -> bool {
        standing(slot).evicted.load(Ordering::Acquire)
    }

    /// A newcomer from `source` waiting in the background.
    fn newcomer(
        admission: &Arc<Admission>,
        source: Source,
    ) -> tokio::task::JoinHandle<Option<AdmissionSlot>> {
        let admission = admission.clone();
        let turn = turn(admission.admit(source));
        tokio::spawn(async move { admission.wait(turn).await })
    }

    async fn until_evicted(slot: &AdmissionSlot) {
        let start = Instant::now();
        while !evicted(slot) {
            assert!(start.elapsed() < Duration::from_secs(4), "not evicted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Attacker's move: hold every place with connections that prove
    /// nothing: established ones kept open by cheap requests, or
    /// handshakes stalled to their timeout. A newcomer waits, and for it
    /// the oldest connection neither vouched for nor protected is closed,
    /// its age counted from its handshake's end once it has one; vouched
    /// and protected ones stay.
    #[tokio::test]
    async fn a_newcomer_waits_and_the_oldest_unvouched_connection_makes_room() {
        let admission = evicting(Duration::from_secs(5));
        let vouched = admission.admit(v4(1)).now().unwrap();
        let protected = admission.admit(v4(1)).now().unwrap();
        let idle = admission.admit(v4(2)).now().unwrap();
        let in_handshake = admission.admit(v4(2)).now().unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Their handshakes end: younger than the stalled one now, though
        // admitted before it.
        for slot in [&vouched, &protected, &idle] {
            slot.established();
        }
        standing(&vouched).vouch();
        standing(&protected).protect();
        let first = newcomer(&admission, v4(3));
        // One waiting per source; a source at its share does not queue.
        assert!(matches!(admission.admit(v4(3)), Admit::Refused));
        assert!(matches!(admission.admit(v4(2)), Admit::Refused));
        until_evicted(&in_handshake).await;
        for slot in [&vouched, &protected, &idle] {
            assert!(!evicted(slot));
        }
        // The handshake learns of it.
        tokio::time::timeout(Duration::from_secs(1), in_handshake.evicted())
            .await
            .unwrap();
        // Its place goes to the newcomer once it closes.
        drop(in_handshake);
        let place = first.await.unwrap().expect("the newcomer got no place");
        assert_eq!(place.source, v4(3));
        // The next newcomer: the idle established connection.
        let second = newcomer(&admission, v4(4));
        until_evicted(&idle).await;
        drop(idle);
        let _second = second.await.unwrap().expect("the second got no place");
        // Unprotected, the other one goes for the next; vouched, never.
        standing(&protected).unprotect();
        let third = newcomer(&admission, v4(5));
        until_evicted(&protected).await;
        assert!(!evicted(&vouched));
        drop(protected);
        assert!(third.await.unwrap().is_some());
    }

    /// A connection closed to make room that stays open (its peer stalls
    /// the writes the close is behind) holds back another eviction only
    /// for a while.
    #[tokio::test]
    async fn a_closed_connection_that_stays_open_does_not_hold_back_the_next_eviction() {
        let admission = evicting(Duration::from_secs(5));
        let held = every_place(&admission);
        let waiting = newcomer(&admission, v4(7));
        until_evicted(&held[0]).await;
        let evicted_now = held.iter().filter(|s| evicted(s)).count();
        assert_eq!(evicted_now, 1, "one eviction per newcomer");
        // It never closes: past the grace, another is closed.
        tokio::time::sleep(EVICTION_GRACE).await;
        until_evicted(&held[1]).await;
        let mut held = held;
        drop(held.remove(1));
        assert!(waiting.await.unwrap().is_some());
    }

    /// Attacker's move: load the server so that genuine handshakes wait on
    /// it past the eviction's age, then arrive as newcomers to have them
    /// closed. The server's own work on a handshake does not age it: of
    /// two handshakes admitted together, the one waiting on its peer is
    /// closed, the one the server works on stays, and ages again once the
    /// work ends.
    #[tokio::test]
    async fn the_servers_own_work_on_a_handshake_does_not_age_it() {
        let admission = evicting(Duration::from_secs(5));
        let mut held = every_place(&admission);
        for slot in &held[2..] {
            slot.established();
            standing(slot).vouch();
        }
        let served = ServerWork::of([&held[0], &held[0]]);
        let under_way = served.begin();
        tokio::time::sleep(Duration::from_millis(120)).await;
        let first = newcomer(&admission, v4(7));
        until_evicted(&held[1]).await;
        assert!(!evicted(&held[0]));
        drop(held.remove(1));
        let first = first.await.unwrap().expect("the first got no place");
        first.established();
        standing(&first).vouch();
        // Past its minimum age in all, but not on its peer: it stays.
        let second = newcomer(&admission, v4(8));
        tokio::time::sleep(EVICTION_RETRY * 2).await;
        assert!(!evicted(&held[0]));
        // The work ends: the handshake waits on its peer and ages again.
        drop(under_way);
        until_evicted(&held[0]).await;
        drop(held.remove(0));
        assert!(second.await.unwrap().is_some());
    }

    /// Newcomers get freed places in arrival order, and one that finds
    /// nothing evictable gives up at its wait, leaving the queue.
    #[tokio::test]
    async fn waiting_newcomers_are_served_in_order_and_give_up_at_their_wait() {
        let admission = evicting(Duration::from_millis(300));
        let mut held = every_place(&admission);
        for slot in &held {
            slot.established();
            standing(slot).vouch();
        }
        let first = turn(admission.admit(v4(7)));
        let second = turn(admission.admit(v4(8)));
        drop(held.pop());
        let got = admission.wait(first).await.expect("the first got no place");
        assert_eq!(got.source, v4(7));
        // Nothing evictable, nothing freed: the second gives up.
        assert!(admission.wait(second).await.is_none());
        assert!(admission.lock().waiting.is_empty());
        drop(got);
        assert!(admission.admit(v4(9)).now().is_some());
    }

    #[test]
    fn the_gate_shelters_one_wait_per_source_and_its_total_in_all() {
        let gate = IssuerGate::new(4, 2, false);
        let first = gate.shelter(v4(1)).expect("a source's first");
        assert!(gate.shelter(v4(1)).is_none(), "a source's second");
        let other = gate.shelter(v4(2)).expect("another source's first");
        assert!(gate.shelter(v4(3)).is_none(), "past the gate's total");
        drop(first);
        let again = gate.shelter(v4(3)).expect("a freed shelter");
        drop((other, again));
        assert!(
            gate.sheltered.lock().unwrap().is_empty(),
            "a source stays counted"
        );
    }

    #[tokio::test]
    async fn the_issuer_gate_holds_each_source_to_its_share() {
        let gate = Arc::new(IssuerGate::new(1, 2, false));
        let first = gate.enter(v4(1)).await.unwrap();
        // The source's second handshake waits for its own share ...
        let second = gate.enter(v4(1));
        tokio::pin!(second);
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut second)
            .await
            .is_err());
        // ... while another source gets the free shared place at once.
        let other = tokio::time::timeout(Duration::from_millis(50), gate.enter(v4(2)))
            .await
            .expect("another source is not queued behind the first")
            .unwrap();
        drop(first);
        let second = second.await.unwrap();
        drop((second, other));
        assert!(gate.sources.lock().unwrap().is_empty());
        assert_eq!(gate.total.available_permits(), 2);
    }

    #[tokio::test]
    async fn a_handshake_that_gives_up_waiting_leaves_nothing_behind() {
        let gate = Arc::new(IssuerGate::new(1, 1, false));
        let held = gate.enter(v4(1)).await.unwrap();
        let gave_up = tokio::time::timeout(Duration::from_millis(20), gate.enter(v4(3))).await;
        assert!(gave_up.is_err());
        drop(held);
        assert!(gate.sources.lock().unwrap().is_empty());
        assert_eq!(gate.total.available_permits(), 1);
    }

    #[test]
    fn the_throttle_logs_a_burst_then_summarises() {
        let throttle = Throttle::new(2);
        assert_eq!(throttle.record(), Some(1));
        assert_eq!(throttle.record(), Some(1));
        assert_eq!(throttle.record(), None);
        assert_eq!(throttle.record(), None);
        // A new window reports what was held back.
        throttle.state.lock().unwrap().window_start =
            Some(Instant::now() - LOG_WINDOW - Duration::from_millis(1));
        assert_eq!(throttle.record(), Some(3));
    }
}
