//! The gRPC servers on a node's aTLS ports: one configuration for the init
//! and the join service, bounding what one validated connection may hold.
//!
//! - At most [`GrpcLimits::max_concurrent_streams`] HTTP/2 streams at once
//!   per connection (default 8); the server announces it in its SETTINGS,
//!   and a stream beyond it is refused (`RST_STREAM REFUSED_STREAM`)
//!   without reaching a handler. Unset, tonic leaves hyper without any
//!   limit, and each stream buffers a request of up to the decoding limit.
//!   (No per-connection concurrency limit on top: tonic's would queue
//!   requests beyond it instead of refusing them.)
//! - Request headers of at most [`GrpcLimits::max_header_list_size`];
//!   frames keep hyper's 16 KiB default.
//! - Each request's handler is bounded by [`GrpcLimits::request_timeout`]
//!   (for a unary request this includes reading its body, so a trickled
//!   request ends too). Message sizes are bounded per service, where the
//!   node builds them.
//! - HTTP/2 keepalive: after [`GrpcLimits::keepalive_interval`] without
//!   anything from the peer the server pings, and closes the connection if
//!   the ping is not answered within [`GrpcLimits::keepalive_timeout`]; so a
//!   long stream to a vanished peer ends. (TCP keepalive settings of tonic do
//!   not apply to connections handed to it, as these are.)
//! - Idle connections are closed: tonic has none of its own, so every
//!   connection is wrapped in [`IdleClosing`], which reads the HTTP/2 frame
//!   headers going either way and ends the connection once no request was
//!   in flight for [`GrpcLimits::idle_timeout`]. A request is in flight from
//!   the client's HEADERS that open its stream until the server ends the
//!   stream or either side resets it. Pings, settings and window updates do
//!   not count: a peer that only pings an idle connection (or answers the
//!   server's keepalive pings) is still closed, while a long, quiet init
//!   stream is not. `max_connection_age` would cut connections by age, not
//!   by idleness; a plain byte timer would be kept alive by pings and would
//!   cut quiet streams.

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_stream::{Stream, StreamExt as _};
use tonic::transport::server::{Connected, Router};
use tonic::transport::Server;

use crate::throttle::{PerSource, SourcePlace};

/// What one connection of a node's gRPC server may hold; see the module
/// documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GrpcLimits {
    /// HTTP/2 streams open at once per connection (default 8).
    pub max_concurrent_streams: u32,
    /// Largest accepted header list of a request (default 16 KiB).
    pub max_header_list_size: u32,
    /// Bound on each request's handler (default 60 s).
    pub request_timeout: Duration,
    /// Silence from the peer after which the server pings (default 30 s).
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered before the connection is closed
    /// (default 20 s).
    pub keepalive_timeout: Duration,
    /// A connection with no request in flight for this long is closed
    /// (default 30 s).
    pub idle_timeout: Duration,
    /// HTTP/2 flow-control window of each request stream: what the peer
    /// may send on a stream before its body is read (default hyper's
    /// 1 MiB). A request waiting for a place holds at most this much.
    pub stream_window: Option<u32>,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 8,
            max_header_list_size: 16 * 1024,
            request_timeout: Duration::from_secs(60),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            idle_timeout: Duration::from_secs(30),
            stream_window: None,
        }
    }
}

/// Serves the services `routes` adds to the configured server on the
/// connections of `incoming` (validated aTLS connections), each wrapped in
/// [`IdleClosing`], until `incoming` ends.
pub async fn serve<I, IO>(
    incoming: I,
    limits: &GrpcLimits,
    routes: impl FnOnce(&mut Server) -> Router,
) -> Result<(), tonic::transport::Error>
where
    I: Stream<Item = Result<IO, Infallible>>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
{
    let mut server = Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .http2_max_header_list_size(limits.max_header_list_size)
        .timeout(limits.request_timeout)
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .initial_stream_window_size(limits.stream_window);
    let idle = limits.idle_timeout;
    let incoming = incoming.map(move |io| io.map(|io| IdleClosing::new(io, idle)));
    routes(&mut server).serve_with_incoming(incoming).await
}

/// A service whose requests are bounded in flight across every connection
/// of a port: at most a fixed number at once, a share of them per source
/// (an IPv6 source by its /64, from the aTLS peer information; by default
/// one at every load, see [`InFlightLimit::with_source_share_under_load`]),
/// each request's body no larger than the service's largest message and
/// arriving within a deadline. A request beyond a bound is
/// answered at once with `UNAVAILABLE` and its body is never read; a body
/// that is late fails the request with `DEADLINE_EXCEEDED` before its
/// handler runs. A request is in flight from its headers until its handler
/// returns its response (for a unary or server-streaming method, after the
/// request message was read whole), so the bounds cap how many large
/// request messages the port buffers at once, and for how long, whatever
/// the number of connections and streams.
///
/// With [`InFlightLimit::with_waiting`], a request that finds every place
/// taken (its source's own claim granted) waits for one instead, in order
/// of arrival, and asks for the eviction of the oldest place whose body has
/// not ended; see there.
///
/// A handler that only waits once its body was read (a long poll) gives
/// its place up through the [`HeldPlace`] in its request's extensions: the
/// places bound bodies, and a wait bounded by the service itself should
/// not keep others out of them.
#[derive(Clone)]
pub struct InFlightLimit<S> {
    inner: S,
    limit: usize,
    permits: Arc<Semaphore>,
    sources: PerSource,
    share: SourceShare,
    places: Places,
    waiting: Option<Waiting>,
    max_body: usize,
    body_deadline: Duration,
    busy: &'static str,
}

/// How many of an [`InFlightLimit`]'s requests (in a place or waiting for
/// one) one source may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SourceShare {
    /// This many, at every load.
    Always(usize),
    /// This many once half of the places are taken; any number below.
    UnderLoad(usize),
}

impl SourceShare {
    /// A source's bound while `taken` of `limit` places are taken.
    fn bound(self, taken: usize, limit: usize) -> usize {
        match self {
            Self::Always(share) => share,
            Self::UnderLoad(share) if taken.saturating_mul(2) >= limit => share,
            Self::UnderLoad(_) => usize::MAX,
        }
    }
}

/// How requests wait for a place; see [`InFlightLimit::with_waiting`].
#[derive(Clone)]
struct Waiting {
    within: Duration,
    eviction_age: Duration,
    slots: Arc<Semaphore>,
}

/// How often a waiter looks again for a place to evict when none is
/// eligible yet and none is on its way to be.
const EVICTION_RECHECK: Duration = Duration::from_millis(100);

impl<S> InFlightLimit<S> {
    /// Wraps `inner`: at most `limit` requests at once, one per source,
    /// each body a gRPC message of at most `max_message` bytes arriving
    /// within `body_deadline`; a request beyond the bounds is answered
    /// with `busy`.
    pub fn new(
        inner: S,
        limit: usize,
        max_message: usize,
        body_deadline: Duration,
        busy: &'static str,
    ) -> Self {
        let limit = limit.max(1);
        Self {
            inner,
            limit,
            permits: Arc::new(Semaphore::new(limit)),
            sources: PerSource::default(),
            share: SourceShare::Always(1),
            places: Places::default(),
            waiting: None,
            // The message and its gRPC frame header.
            max_body: max_message.saturating_add(5),
            body_deadline,
            busy,
        }
    }

    /// A source may hold up to `share` requests (in a place or waiting)
    /// once half of the places are taken, and any number below that: so
    /// nodes behind one address (a NAT, a VM network's gateway) are not
    /// held back on a quiet port, while under load one address cannot
    /// take every place, nor every waiting slot, from the others.
    pub fn with_source_share_under_load(mut self, share: usize) -> Self {
        self.share = SourceShare::UnderLoad(share.max(1));
        self
    }

    /// A request that finds every place taken waits for one, first come
    /// first served, up to `within` (then it is answered busy), if fewer
    /// than `waiters` wait already (else it is answered busy at once). Each
    /// waiter asks, once, for the eviction of the oldest place at least
    /// `eviction_age` old whose body has not ended (no other waiter's
    /// pick): that body fails at once with `UNAVAILABLE`, so its handler
    /// ends and the place frees. Nothing of a waiting request's body is
    /// read.
    pub fn with_waiting(
        mut self,
        within: Duration,
        eviction_age: Duration,
        waiters: usize,
    ) -> Self {
        self.waiting = Some(Waiting {
            within,
            eviction_age,
            slots: Arc::new(Semaphore::new(waiters)),
        });
        self
    }
}

/// The places taken, as waiters see them to pick one to evict.
#[derive(Clone, Default)]
struct Places(Arc<Mutex<Vec<Held>>>);

/// One taken place, as waiters see it.
struct Held {
    admitted: Instant,
    /// Set once the request's body ended: never evicted then.
    ended: Arc<AtomicBool>,
    /// Taken by the waiter that evicts the place.
    evict: Option<oneshot::Sender<()>>,
}

impl Places {
    /// Registers a place admitted now; what its body watches.
    fn take(&self) -> BodyWatch {
        let ended = Arc::new(AtomicBool::new(false));
        let (evict, evicted) = oneshot::channel();
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Held {
                admitted: Instant::now(),
                ended: ended.clone(),
                evict: Some(evict),
            });
        BodyWatch {
            ended,
            evicted: Some(evicted),
            was_evicted: false,
        }
    }

    /// Forgets the place whose body shares `ended`.
    fn free(&self, ended: &Arc<AtomicBool>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|h| !Arc::ptr_eq(&h.ended, ended));
    }

    /// Evicts the oldest place at least `age` old whose body has not ended
    /// and that no one evicted yet: `Ok` if one was, else when the next
    /// such place comes of age, if any is on its way.
    fn evict_oldest(&self, age: Duration) -> Result<(), Option<Instant>> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let oldest = held
            .iter_mut()
            .filter(|h| h.evict.is_some() && !h.ended.load(Ordering::Acquire))
            .min_by_key(|h| h.admitted);
        let Some(oldest) = oldest else {
            return Err(None);
        };
        if now < oldest.admitted + age {
            return Err(Some(oldest.admitted + age));
        }
        if let Some(evict) = oldest.evict.take() {
            // A body already gone has its handler ending anyway.
            let _ = evict.send(());
        }
        Ok(())
    }
}

/// One request's place among those in flight, and its source's; freed
/// when dropped.
struct Place {
    _permit: OwnedSemaphorePermit,
    _own: Option<SourcePlace>,
    places: Places,
    ended: Arc<AtomicBool>,
}

impl Place {
    /// Takes the place `permit` grants; what the request's body watches.
    fn new(
        permit: OwnedSemaphorePermit,
        own: Option<SourcePlace>,
        places: &Places,
    ) -> (Self, BodyWatch) {
        let watch = places.take();
        let place = Self {
            _permit: permit,
            _own: own,
            places: places.clone(),
            ended: watch.ended.clone(),
        };
        (place, watch)
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.free(&self.ended);
    }
}

/// A request's place among an [`InFlightLimit`]'s, found in the request's
/// extensions; freed once the handler's answer was sent (or given up,
/// [`hold_until_sent`]), or before by [`HeldPlace::release`].
#[derive(Clone)]
pub struct HeldPlace(Arc<Mutex<Option<Place>>>);

impl HeldPlace {
    /// Frees the place now if the request's body has ended: for a handler
    /// that has its request whole and now only waits, bounded by its
    /// service (a long poll). A place whose body still arrives is kept, so
    /// what it buffers stays bounded.
    pub fn release(&self) {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if held
            .as_ref()
            .is_some_and(|place| place.ended.load(Ordering::Acquire))
        {
            drop(held.take());
        }
    }

    /// Frees the place, whatever its body.
    fn free(&self) {
        let place = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        drop(place);
    }
}

/// Serves `request` through `inner` in the place `permit` grants (with
/// the source's own, among `places`): its body is held to `bounds` and
/// to the place's eviction, and the place is freed once the handler's
/// answer was sent ([`hold_until_sent`], within the same deadline as the
/// body), or when the handler releases it ([`HeldPlace`]).
fn serve_in_place<S>(
    inner: &mut S,
    permit: OwnedSemaphorePermit,
    own: Option<SourcePlace>,
    places: &Places,
    request: tonic::codegen::http::Request<tonic::body::Body>,
    bounds: BodyBounds,
) -> impl Future<Output = Result<tonic::codegen::http::Response<tonic::body::Body>, Infallible>>
       + Send
       + 'static
where
    S: tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
        Response = tonic::codegen::http::Response<tonic::body::Body>,
        Error = Infallible,
    >,
    S::Future: Send + 'static,
{
    let (place, watch) = Place::new(permit, own, places);
    let place = HeldPlace(Arc::new(Mutex::new(Some(place))));
    let mut request =
        request.map(|body| tonic::body::Body::new(DeadlineBody::new(body, bounds, watch)));
    request.extensions_mut().insert(place.clone());
    let answer = inner.call(request);
    let send_within = bounds.within;
    async move {
        let Ok(answer) = answer.await;
        Ok(hold_until_sent(answer, place, send_within))
    }
}

/// What a handler keeps until its answer is sent (an in-flight mark that
/// bounds a peer's answers to one): put in the response's extensions, it
/// goes with the answer's body ([`InFlightLimit`]), and is dropped once
/// the body was sent whole, its stream ended, or it stalled past its
/// deadline.
#[derive(Clone)]
pub struct HeldUntilSent(#[allow(dead_code)] Arc<dyn Send + Sync>);

impl HeldUntilSent {
    /// Keeps `held` until the answer is sent.
    pub fn new(held: impl Send + Sync + 'static) -> Self {
        Self(Arc::new(held))
    }
}

/// Most bytes of an answer handed to HTTP/2 at once. HTTP/2 takes a frame
/// whole into its send buffer whatever the peer's window, so a large
/// message goes in copies of this size: what a peer that stops reading
/// leaves buffered there is one of them, and the rest stays with
/// [`SendingBody`], which drops it at its deadline.
const SEND_PIECE: usize = 64 * 1024;

/// Keeps `place` (and the handler's [`HeldUntilSent`], if any) with
/// `response`'s body until it is sent: an answer whose caller never reads
/// it (an HTTP/2 window kept at 0) holds its place, and the handler's
/// mark, so that the peer's next request waits or is refused instead of
/// piling up answers in memory. The caller may take no part of the
/// answer for `within` at most (a caller that reads, however slowly,
/// keeps it going): then what is unsent is dropped, the place freed, and
/// the stream reset.
fn hold_until_sent(
    mut response: tonic::codegen::http::Response<tonic::body::Body>,
    place: HeldPlace,
    within: Duration,
) -> tonic::codegen::http::Response<tonic::body::Body> {
    let held = response.extensions_mut().remove::<HeldUntilSent>();
    if http_body::Body::is_end_stream(response.body()) {
        place.free();
        return response;
    }
    response.map(|body| tonic::body::Body::new(SendingBody::new(body, place, held, within)))
}

/// An answer's body on its way out, with the place (and mark) it holds;
/// see [`hold_until_sent`].
struct SendingBody {
    unsent: Arc<Mutex<Option<Unsent>>>,
    deadline: tokio::task::JoinHandle<()>,
}

/// What a [`SendingBody`] holds until it is sent or given up.
struct Unsent {
    body: tonic::body::Body,
    /// The rest of a data frame larger than [`SEND_PIECE`].
    rest: bytes::Bytes,
    /// Since when the answer waits for its caller: since the answer was
    /// made or the last frame was handed on to HTTP/2 (hyper asks for one
    /// only once the one before had window to go out). `None` while the
    /// body itself waits (a stream between its messages).
    stalled_since: Option<Instant>,
    place: HeldPlace,
    _held: Option<HeldUntilSent>,
}

impl Drop for Unsent {
    fn drop(&mut self) {
        self.place.free();
    }
}

impl SendingBody {
    fn new(
        body: tonic::body::Body,
        place: HeldPlace,
        held: Option<HeldUntilSent>,
        within: Duration,
    ) -> Self {
        let unsent = Arc::new(Mutex::new(Some(Unsent {
            body,
            rest: bytes::Bytes::new(),
            stalled_since: Some(Instant::now()),
            place,
            _held: held,
        })));
        let deadline = tokio::spawn(give_up_when_stalled(unsent.clone(), within));
        Self { unsent, deadline }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Unsent>> {
        self.unsent.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Drops what `unsent` holds once it stalled for `within`; ends when it
/// is gone.
async fn give_up_when_stalled(unsent: Arc<Mutex<Option<Unsent>>>, within: Duration) {
    loop {
        let due = {
            let mut held = unsent.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(since) = held.as_ref().map(|u| u.stalled_since) else {
                return;
            };
            match since.map(|since| since + within) {
                Some(due) if Instant::now() >= due => {
                    let given_up = held.take();
                    drop(held);
                    drop(given_up);
                    tracing::debug!(
                        within_secs = within.as_secs_f64(),
                        "an answer its caller did not read in time was dropped"
                    );
                    return;
                }
                Some(due) => due,
                None => Instant::now() + within,
            }
        };
        tokio::time::sleep_until(due).await;
    }
}

impl Drop for SendingBody {
    fn drop(&mut self) {
        self.deadline.abort();
        let sent = self.lock().take();
        drop(sent);
    }
}

/// The next piece of `rest`: a copy, so that a piece HTTP/2 keeps does
/// not keep the whole frame it came from.
fn next_piece(rest: &mut bytes::Bytes) -> bytes::Bytes {
    let piece = bytes::Bytes::copy_from_slice(&rest[..rest.len().min(SEND_PIECE)]);
    bytes::Buf::advance(rest, piece.len());
    piece
}

impl http_body::Body for SendingBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let mut held = self.lock();
        let Some(unsent) = held.as_mut() else {
            return Poll::Ready(Some(Err(tonic::Status::deadline_exceeded(
                "the answer was not read in time",
            ))));
        };
        // hyper asks for a frame only once the one before had window to
        // go out (it takes the next one, then waits for window to send
        // it): each frame handed on is progress, and the stall clock
        // starts again from it.
        if !unsent.rest.is_empty() {
            unsent.stalled_since = Some(Instant::now());
            return Poll::Ready(Some(Ok(http_body::Frame::data(next_piece(
                &mut unsent.rest,
            )))));
        }
        let frame = match Pin::new(&mut unsent.body).poll_frame(cx) {
            Poll::Pending => {
                unsent.stalled_since = None;
                return Poll::Pending;
            }
            Poll::Ready(None) => {
                let sent = held.take();
                drop(held);
                drop(sent);
                return Poll::Ready(None);
            }
            Poll::Ready(Some(frame)) => frame,
        };
        unsent.stalled_since = Some(Instant::now());
        Poll::Ready(Some(frame.map(|frame| match frame.into_data() {
            Ok(data) if data.len() > SEND_PIECE => {
                unsent.rest = data;
                http_body::Frame::data(next_piece(&mut unsent.rest))
            }
            Ok(data) => http_body::Frame::data(data),
            Err(other) => other,
        })))
    }

    fn is_end_stream(&self) -> bool {
        self.lock()
            .as_ref()
            .is_some_and(|u| u.rest.is_empty() && u.body.is_end_stream())
    }
}

/// Waits, in order of arrival, up to `waiting.within` for a place, asking
/// once for an eviction on the way; `None` if none came free.
async fn wait_for_place(
    permits: Arc<Semaphore>,
    places: Places,
    waiting: &Waiting,
) -> Option<OwnedSemaphorePermit> {
    let until = Instant::now() + waiting.within;
    // Kept across the loop: its place in the semaphore's queue.
    let acquire = permits.acquire_owned();
    tokio::pin!(acquire);
    let mut evicted = false;
    loop {
        let next = if evicted {
            until
        } else {
            match places.evict_oldest(waiting.eviction_age) {
                Ok(()) => {
                    evicted = true;
                    until
                }
                Err(next) => next
                    .unwrap_or_else(|| Instant::now() + EVICTION_RECHECK)
                    .min(until),
            }
        };
        tokio::select! {
            biased;
            permit = &mut acquire => return permit.ok(),
            () = tokio::time::sleep_until(next) => {
                if Instant::now() >= until {
                    return None;
                }
            }
        }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for InFlightLimit<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>>
    for InFlightLimit<S>
where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<tonic::body::Body>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        let source = source_of(&request);
        let busy = self.busy;
        let refuse = move || {
            tracing::debug!(
                busy,
                "request refused: the service's requests in flight are at their bound"
            );
            Ok(keel_proto::busy(busy).into_http())
        };
        // The source's own bound first: a source refused by it holds no
        // place of the others, not even for a moment, nor a waiting slot.
        let taken = self.limit.saturating_sub(self.permits.available_permits());
        let share = self.share.bound(taken, self.limit);
        let own = match source {
            Some(source) => match self.sources.claim_up_to(source, share) {
                Some(own) => Some(own),
                None => return Box::pin(std::future::ready(refuse())),
            },
            None => None,
        };
        let bounds = BodyBounds {
            within: self.body_deadline,
            max_bytes: self.max_body,
        };
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Box::pin(serve_in_place(
                &mut self.inner,
                permit,
                own,
                &self.places,
                request,
                bounds,
            ));
        }
        let Some((waiting, slot)) = self.waiting.as_ref().and_then(|w| {
            let slot = w.slots.clone().try_acquire_owned().ok()?;
            Some((w.clone(), slot))
        }) else {
            return Box::pin(std::future::ready(refuse()));
        };
        // The service made ready goes with the request; a clone stays.
        let mut inner = self.inner.clone();
        std::mem::swap(&mut inner, &mut self.inner);
        let (permits, places) = (self.permits.clone(), self.places.clone());
        Box::pin(async move {
            let permit = wait_for_place(permits, places.clone(), &waiting).await;
            drop(slot);
            let Some(permit) = permit else {
                return refuse();
            };
            serve_in_place(&mut inner, permit, own, &places, request, bounds).await
        })
    }
}

/// The source of `request`, from the aTLS peer information of a port
/// that validates no client or of one that validates nodes.
fn source_of<B>(request: &tonic::codegen::http::Request<B>) -> Option<keel_atls::Source> {
    let extensions = request.extensions();
    extensions
        .get::<keel_atls::PeerInfo<()>>()
        .and_then(keel_atls::PeerInfo::remote_addr)
        .or_else(|| {
            extensions
                .get::<keel_atls::PeerInfo<keel_verifier::validator::Verified>>()
                .and_then(keel_atls::PeerInfo::remote_addr)
        })
        .map(|addr| keel_atls::Source::of_ip(addr.ip()))
}

/// What a request's body shares with its place: whether it ended, and
/// whether a waiter evicted it.
struct BodyWatch {
    ended: Arc<AtomicBool>,
    evicted: Option<oneshot::Receiver<()>>,
    was_evicted: bool,
}

/// What a request's body must keep to: its time to arrive and its size.
#[derive(Clone, Copy)]
struct BodyBounds {
    within: Duration,
    max_bytes: usize,
}

/// A request body that fails once its deadline passed before it ended,
/// past its largest size, or once a waiter evicted its place.
struct DeadlineBody {
    inner: tonic::body::Body,
    deadline: Pin<Box<Sleep>>,
    max_bytes: usize,
    received: usize,
    watch: BodyWatch,
}

impl DeadlineBody {
    fn new(inner: tonic::body::Body, bounds: BodyBounds, watch: BodyWatch) -> Self {
        // (An ended body is not wrapped at all by `tonic::body::Body::new`.)
        if http_body::Body::is_end_stream(&inner) {
            watch.ended.store(true, Ordering::Release);
        }
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(bounds.within)),
            max_bytes: bounds.max_bytes,
            received: 0,
            watch,
        }
    }
}

impl http_body::Body for DeadlineBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        // The deadline and an eviction first: a client that always has a
        // frame ready (a trickle of tiny ones) does not outlive them.
        if self.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(tonic::Status::deadline_exceeded(
                "the request's body did not arrive in time",
            ))));
        }
        if let Some(evicted) = self.watch.evicted.as_mut() {
            if let Poll::Ready(sent) = Pin::new(evicted).poll(cx) {
                self.watch.evicted = None;
                self.watch.was_evicted = sent.is_ok();
            }
        }
        if self.watch.was_evicted {
            return Poll::Ready(Some(Err(tonic::Status::unavailable(
                "the request's body was too slow while others waited for its place",
            ))));
        }
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(data)) = frame
            .as_ref()
            .map(|f| f.as_ref().map(http_body::Frame::data_ref))
        {
            self.received = self
                .received
                .saturating_add(data.map_or(0, bytes::Bytes::len));
            if self.received > self.max_bytes {
                return Poll::Ready(Some(Err(tonic::Status::resource_exhausted(
                    "the request's body is larger than any request",
                ))));
            }
        }
        if frame.is_none() || self.inner.is_end_stream() {
            self.watch.ended.store(true, Ordering::Release);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Most streams tracked on one connection; beyond it (far above the
/// concurrent-stream limit, whose excess the server resets) the connection
/// is ended.
const MAX_TRACKED_STREAMS: usize = 4096;
/// The client connection preface that precedes the first frame.
const CLIENT_PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const FRAME_DATA: u8 = 0x0;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_RST_STREAM: u8 = 0x3;
const FLAG_END_STREAM: u8 = 0x1;

/// A server connection that ends once no HTTP/2 request was in flight on it
/// for a while; see the module documentation. Reading ends (end of file)
/// then, which makes the HTTP/2 server close the connection.
pub struct IdleClosing<IO> {
    io: IO,
    inbound: FrameScanner,
    outbound: FrameScanner,
    in_flight: InFlight,
    idle_timeout: Duration,
    deadline: Pin<Box<Sleep>>,
    read_waker: Option<Waker>,
    ended: bool,
}

impl<IO> std::fmt::Debug for IdleClosing<IO> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleClosing")
            .field("in_flight", &self.in_flight.open.len())
            .field("idle_timeout", &self.idle_timeout)
            .finish_non_exhaustive()
    }
}

impl<IO> IdleClosing<IO> {
    /// Wraps an accepted connection; it is idle until its first request.
    pub fn new(io: IO, idle_timeout: Duration) -> Self {
        Self {
            io,
            inbound: FrameScanner::new(CLIENT_PREFACE_LEN),
            outbound: FrameScanner::new(0),
            in_flight: InFlight::default(),
            idle_timeout,
            deadline: Box::pin(tokio::time::sleep(idle_timeout)),
            read_waker: None,
            ended: false,
        }
    }

    /// Restarts the idle clock when the last request in flight ended.
    fn after_frames(&mut self, was_busy: bool) {
        if was_busy && self.in_flight.is_idle() {
            self.deadline
                .as_mut()
                .reset(Instant::now() + self.idle_timeout);
            // The reader may be parked without this deadline registered.
            if let Some(waker) = self.read_waker.take() {
                waker.wake();
            }
        }
    }

    fn scan_outbound(&mut self, written: &[u8]) {
        let was_busy = !self.in_flight.is_idle();
        let in_flight = &mut self.in_flight;
        self.outbound
            .scan(written, |frame| in_flight.server_frame(frame));
        self.after_frames(was_busy);
    }
}

impl<IO: Connected> Connected for IdleClosing<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for IdleClosing<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(Ok(()));
        }
        if this.in_flight.is_idle() && this.deadline.as_mut().poll(cx).is_ready() {
            tracing::debug!(
                idle = ?this.idle_timeout,
                "closing a connection without a request in flight"
            );
            this.ended = true;
            return Poll::Ready(Ok(()));
        }
        if !this
            .read_waker
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            this.read_waker = Some(cx.waker().clone());
        }
        let before = buf.filled().len();
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = result {
            let was_busy = !this.in_flight.is_idle();
            let in_flight = &mut this.in_flight;
            this.inbound.scan(&buf.filled()[before..], |frame| {
                in_flight.client_frame(frame)
            });
            if in_flight.overflowed {
                return Poll::Ready(Err(io::Error::other(
                    "too many HTTP/2 streams opened on one connection",
                )));
            }
            this.after_frames(was_busy);
        }
        result
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for IdleClosing<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = result {
            this.scan_outbound(buf.get(..n).unwrap_or(buf));
        }
        result
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = result {
            let mut left = n;
            for slice in bufs {
                if left == 0 {
                    break;
                }
                let take = left.min(slice.len());
                this.scan_outbound(&slice[..take]);
                left -= take;
            }
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The header of one HTTP/2 frame, as far as stream lifetimes need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
}

/// Finds the frame headers in one direction of an HTTP/2 byte stream; the
/// payloads are skipped unread.
#[derive(Debug)]
struct FrameScanner {
    preface_left: usize,
    header: [u8; FRAME_HEADER_LEN],
    header_len: usize,
    payload_left: usize,
}

impl FrameScanner {
    fn new(preface_len: usize) -> Self {
        Self {
            preface_left: preface_len,
            header: [0; FRAME_HEADER_LEN],
            header_len: 0,
            payload_left: 0,
        }
    }

    fn scan(&mut self, mut bytes: &[u8], mut on_frame: impl FnMut(Frame)) {
        while !bytes.is_empty() {
            let skip = if self.preface_left > 0 {
                &mut self.preface_left
            } else {
                &mut self.payload_left
            };
            if *skip > 0 {
                let n = (*skip).min(bytes.len());
                *skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (FRAME_HEADER_LEN - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
            self.header_len += n;
            bytes = &bytes[n..];
            if self.header_len == FRAME_HEADER_LEN {
                let h = self.header;
                self.header_len = 0;
                self.payload_left = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
                on_frame(Frame {
                    kind: h[3],
                    flags: h[4],
                    stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
                });
            }
        }
    }
}

/// The requests in flight on one connection, by stream.
#[derive(Debug, Default)]
struct InFlight {
    open: HashSet<u32>,
    highest_opened: u32,
    overflowed: bool,
}

impl InFlight {
    fn is_idle(&self) -> bool {
        self.open.is_empty()
    }

    /// A frame from the client: HEADERS on a new (odd, higher) stream opens
    /// a request, RST_STREAM ends one.
    fn client_frame(&mut self, frame: Frame) {
        match frame.kind {
            FRAME_HEADERS if frame.stream % 2 == 1 && frame.stream > self.highest_opened => {
                self.highest_opened = frame.stream;
                if self.open.len() >= MAX_TRACKED_STREAMS {
                    self.overflowed = true;
                } else {
                    self.open.insert(frame.stream);
                }
            }
            FRAME_RST_STREAM => {
                self.open.remove(&frame.stream);
            }
            _ => {}
        }
    }

    /// A frame from the server: the end of its response (END_STREAM on
    /// HEADERS or DATA) or RST_STREAM ends a request.
    fn server_frame(&mut self, frame: Frame) {
        let ends = match frame.kind {
            FRAME_HEADERS | FRAME_DATA => frame.flags & FLAG_END_STREAM != 0,
            FRAME_RST_STREAM => true,
            _ => false,
        };
        if ends {
            self.open.remove(&frame.stream);
        }
    }
}

/// The answer to a client `call`, bounded in full by `limit`: a channel's
/// own timeout ends with the answer's headers, so a peer that sent them and
/// then held back its message would hold the call forever. Past `limit`,
/// `DEADLINE_EXCEEDED`.
pub async fn answer_within<T>(
    limit: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, tonic::Status> {
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => answer.map(tonic::Response::into_inner),
        Err(_) => Err(tonic::Status::deadline_exceeded(format!(
            "no answer within {} s",
            limit.as_secs()
        ))),
    }
}

/// Who sent a request on an aTLS server without a client validator (the
/// init port: init, recovery, operator): its address, and its connection.
/// When every place on the port is taken, the port closes the oldest
/// connection that proved nothing to make room for a newcomer; a handler
/// keeps its connection open while it runs ([`Caller::protect`]: a
/// handler runs once the request's message arrived whole, and ends soon
/// for a request that proves nothing) and vouches for it once the request
/// proved itself ([`Caller::vouch`]).
#[derive(Clone, Debug, Default)]
pub struct Caller(Option<keel_atls::PeerInfo<()>>);

impl Caller {
    /// The sender of `request`.
    pub fn of<T>(request: &tonic::Request<T>) -> Self {
        Self(
            request
                .extensions()
                .get::<keel_atls::PeerInfo<()>>()
                .cloned(),
        )
    }

    /// The sender's address.
    pub fn ip(&self) -> Option<std::net::IpAddr> {
        self.0
            .as_ref()
            .and_then(keel_atls::PeerInfo::remote_addr)
            .map(|a| a.ip())
    }

    /// Keeps the sender's connection open until the guard drops.
    pub fn protect(&self) -> Option<keel_atls::Protected> {
        self.0.as_ref().map(keel_atls::PeerInfo::protect)
    }

    /// The request proved itself (the operator's key, the init or master
    /// secret): its connection stays open until it closes or idles out.
    pub fn vouch(&self) {
        if let Some(peer) = &self.0 {
            peer.vouch();
        }
    }
}

/// The validated attestation of the peer of `request` on a mutual aTLS
/// server (the join port), if it has one.
pub fn attested_peer<T>(
    request: &tonic::Request<T>,
) -> Option<std::sync::Arc<keel_atls::Attested<keel_verifier::validator::Verified>>> {
    request
        .extensions()
        .get::<keel_atls::PeerInfo<keel_verifier::validator::Verified>>()
        .and_then(|p| p.attested().cloned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: usize) -> Vec<u8> {
        let len = (payload as u32).to_be_bytes();
        let mut out = vec![len[1], len[2], len[3], kind, flags];
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend(std::iter::repeat_n(0xee, payload));
        out
    }

    fn frames(scanner: &mut FrameScanner, bytes: &[u8], chunk: usize) -> Vec<Frame> {
        let mut seen = Vec::new();
        for piece in bytes.chunks(chunk) {
            scanner.scan(piece, |f| seen.push(f));
        }
        seen
    }

    #[test]
    fn frame_headers_are_found_across_any_split() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(0x4, 0, 0, 6)); // SETTINGS
        bytes.extend(frame(FRAME_HEADERS, 0x4, 1, 40));
        bytes.extend(frame(FRAME_DATA, FLAG_END_STREAM, 1, 1000));
        bytes.extend(frame(0x6, 0, 0, 8)); // PING
        bytes.extend(frame(FRAME_RST_STREAM, 0, 3, 4));
        let expected = vec![
            Frame {
                kind: 0x4,
                flags: 0,
                stream: 0,
            },
            Frame {
                kind: FRAME_HEADERS,
                flags: 0x4,
                stream: 1,
            },
            Frame {
                kind: FRAME_DATA,
                flags: FLAG_END_STREAM,
                stream: 1,
            },
            Frame {
                kind: 0x6,
                flags: 0,
                stream: 0,
            },
            Frame {
                kind: FRAME_RST_STREAM,
                flags: 0,
                stream: 3,
            },
        ];
        for chunk in [1, 2, 7, 9, 10, 100, bytes.len()] {
            let mut scanner = FrameScanner::new(CLIENT_PREFACE_LEN);
            assert_eq!(
                frames(&mut scanner, &bytes, chunk),
                expected,
                "chunk {chunk}"
            );
        }
    }

    #[test]
    fn a_request_is_in_flight_until_the_server_ends_or_either_side_resets_it() {
        let mut f = InFlight::default();
        let headers = |stream, flags| Frame {
            kind: FRAME_HEADERS,
            flags,
            stream,
        };
        f.client_frame(headers(1, FLAG_END_STREAM | 0x4));
        f.client_frame(headers(3, 0x4));
        assert_eq!(f.open.len(), 2);
        // The client's end of its request does not end it; the server's does.
        f.server_frame(headers(1, 0x4));
        assert_eq!(f.open.len(), 2);
        f.server_frame(Frame {
            kind: FRAME_DATA,
            flags: FLAG_END_STREAM,
            stream: 1,
        });
        // Trailers from the client on a finished stream do not reopen it.
        f.client_frame(headers(1, FLAG_END_STREAM));
        assert_eq!(f.open.len(), 1);
        f.client_frame(Frame {
            kind: FRAME_RST_STREAM,
            flags: 0,
            stream: 3,
        });
        assert!(f.is_idle());
        // A refused stream ends with the server's reset; pings change nothing.
        f.client_frame(headers(5, 0x4));
        f.client_frame(Frame {
            kind: 0x6,
            flags: 0,
            stream: 0,
        });
        f.server_frame(Frame {
            kind: 0x6,
            flags: 0x1,
            stream: 0,
        });
        assert!(!f.is_idle());
        f.server_frame(Frame {
            kind: FRAME_RST_STREAM,
            flags: 0,
            stream: 5,
        });
        assert!(f.is_idle());
        // Even streams (server-initiated) never count.
        f.client_frame(headers(6, 0x4));
        assert!(f.is_idle());
    }

    #[test]
    fn too_many_open_streams_end_the_connection() {
        let mut f = InFlight::default();
        for i in 0..=MAX_TRACKED_STREAMS as u32 {
            f.client_frame(Frame {
                kind: FRAME_HEADERS,
                flags: 0x4,
                stream: 2 * i + 1,
            });
        }
        assert!(f.overflowed);
        assert_eq!(f.open.len(), MAX_TRACKED_STREAMS);
    }

    /// A service that never answers.
    #[derive(Clone)]
    struct Silent;

    impl tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for Silent {
        type Response = tonic::codegen::http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
            Box::pin(std::future::pending())
        }
    }

    /// A request past the bound is answered busy, and marked so: a client
    /// sends it again on that mark alone, not on the service's other
    /// `Unavailable` answers (its TPM or disk failing), which carry none.
    #[tokio::test]
    async fn a_request_past_the_bound_is_answered_busy_and_marked() {
        use tonic::codegen::Service as _;
        let mut limit = InFlightLimit::new(Silent, 1, 1024, Duration::from_secs(5), "busy now");
        let request = || tonic::codegen::http::Request::new(tonic::body::Body::empty());
        let held = limit.call(request());
        let answer = limit.call(request()).await.unwrap();
        let status = tonic::Status::from_header_map(answer.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(status.message(), "busy now");
        assert!(status.metadata().get(keel_proto::BUSY_METADATA).is_some());
        drop(held);
    }

    /// A body that never ends: a request trickled in without end.
    struct Endless;

    impl http_body::Body for Endless {
        type Data = bytes::Bytes;
        type Error = tonic::Status;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
            Poll::Pending
        }
    }

    /// A service that reads the request's body to its end, answering its
    /// error, and then answers OK, or never for a request marked [`Hang`];
    /// it first gives its place up ([`HeldPlace::release`]) for a request
    /// marked [`Release`], as a long poll does.
    #[derive(Clone)]
    struct Reader;

    /// Marks a request [`Reader`] never answers.
    #[derive(Clone)]
    struct Hang;

    /// Marks a request whose place [`Reader`] gives up at once.
    #[derive(Clone)]
    struct Release;

    impl tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for Reader {
        type Response = tonic::codegen::http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(
            &mut self,
            request: tonic::codegen::http::Request<tonic::body::Body>,
        ) -> Self::Future {
            let hang = request.extensions().get::<Hang>().is_some();
            if request.extensions().get::<Release>().is_some() {
                if let Some(place) = request.extensions().get::<HeldPlace>() {
                    place.release();
                }
            }
            let mut body = request.into_body();
            Box::pin(async move {
                loop {
                    let frame = std::future::poll_fn(|cx| {
                        http_body::Body::poll_frame(Pin::new(&mut body), cx)
                    })
                    .await;
                    match frame {
                        Some(Ok(_)) => {}
                        Some(Err(status)) => return Ok(status.into_http()),
                        None => break,
                    }
                }
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok(tonic::Status::ok("").into_http())
            })
        }
    }

    fn status_of(answer: &tonic::codegen::http::Response<tonic::body::Body>) -> tonic::Status {
        tonic::Status::from_header_map(answer.headers()).unwrap()
    }

    /// A newcomer finding every place taken waits, and evicts the oldest
    /// place whose body has not ended once it is old enough; a second
    /// waiter past the waiting bound is answered busy at once.
    #[tokio::test]
    async fn a_waiting_request_evicts_a_slow_body() {
        use tonic::codegen::Service as _;
        let age = Duration::from_millis(300);
        let mut limit = InFlightLimit::new(Reader, 1, 1024, Duration::from_secs(30), "busy")
            .with_waiting(Duration::from_secs(5), age, 1);
        let slow = limit.call(tonic::codegen::http::Request::new(tonic::body::Body::new(
            Endless,
        )));
        let slow = tokio::spawn(slow);
        let started = Instant::now();
        let waiter = tokio::spawn(limit.call(tonic::codegen::http::Request::new(
            tonic::body::Body::empty(),
        )));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let past = limit
            .call(tonic::codegen::http::Request::new(
                tonic::body::Body::empty(),
            ))
            .await
            .unwrap();
        assert!(status_of(&past)
            .metadata()
            .get(keel_proto::BUSY_METADATA)
            .is_some());
        let evicted = status_of(&slow.await.unwrap().unwrap());
        assert_eq!(evicted.code(), tonic::Code::Unavailable, "{evicted:?}");
        assert!(evicted.metadata().get(keel_proto::BUSY_METADATA).is_none());
        let served = status_of(&waiter.await.unwrap().unwrap());
        assert_eq!(served.code(), tonic::Code::Ok, "{served:?}");
        assert!(started.elapsed() >= age);
    }

    /// A place whose body ended is never evicted: the newcomer evicts the
    /// younger place whose body is still arriving, not the older one.
    #[tokio::test]
    async fn a_place_whose_body_ended_is_not_evicted() {
        use tonic::codegen::Service as _;
        let mut limit = InFlightLimit::new(Reader, 2, 1024, Duration::from_secs(30), "busy")
            .with_waiting(Duration::from_secs(5), Duration::from_millis(100), 4);
        let mut ended = tonic::codegen::http::Request::new(tonic::body::Body::empty());
        ended.extensions_mut().insert(Hang);
        let ended = tokio::spawn(limit.call(ended));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let slow = limit.call(tonic::codegen::http::Request::new(tonic::body::Body::new(
            Endless,
        )));
        let slow = tokio::spawn(slow);
        let answer = limit
            .call(tonic::codegen::http::Request::new(
                tonic::body::Body::empty(),
            ))
            .await
            .unwrap();
        assert_eq!(status_of(&answer).code(), tonic::Code::Ok);
        let evicted = status_of(&slow.await.unwrap().unwrap());
        assert_eq!(evicted.code(), tonic::Code::Unavailable, "{evicted:?}");
        assert!(!ended.is_finished());
        ended.abort();
    }

    /// A handler whose request's body ended gives its place up and the
    /// next request takes it; one whose body still arrives keeps its place
    /// however it asks, and the next request is answered busy.
    #[tokio::test]
    async fn a_handler_gives_its_place_up_only_once_its_body_ended() {
        use tonic::codegen::Service as _;
        let mut limit = InFlightLimit::new(Reader, 1, 1024, Duration::from_secs(30), "busy");
        let request = |body| {
            let mut request = tonic::codegen::http::Request::new(body);
            request.extensions_mut().insert(Hang);
            request.extensions_mut().insert(Release);
            request
        };
        let whole = tokio::spawn(limit.call(request(tonic::body::Body::empty())));
        let arriving = tokio::spawn(limit.call(request(tonic::body::Body::new(Endless))));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!arriving.is_finished(), "the place given up was not taken");
        let next = limit.call(request(tonic::body::Body::empty()));
        let answer = tokio::time::timeout(Duration::from_secs(1), next)
            .await
            .expect("the place of a body still arriving was given up")
            .unwrap();
        let status = status_of(&answer);
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(status.metadata().get(keel_proto::BUSY_METADATA).is_some());
        whole.abort();
        arriving.abort();
    }

    /// A service that answers every request at once with a message of
    /// `len` bytes, keeping `held` until the answer is sent.
    #[derive(Clone)]
    struct Answering {
        len: usize,
        held: Arc<()>,
    }

    impl tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for Answering {
        type Response = tonic::codegen::http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
            let mut answer =
                tonic::codegen::http::Response::new(tonic::body::Body::new("7".repeat(self.len)));
            answer
                .extensions_mut()
                .insert(HeldUntilSent::new(self.held.clone()));
            std::future::ready(Ok(answer))
        }
    }

    impl tonic::server::NamedService for Answering {
        const NAME: &'static str = "test.Answering";
    }

    /// The next frame of `body`, if it has one ready.
    fn next_frame(
        body: &mut tonic::body::Body,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        let mut cx = Context::from_waker(Waker::noop());
        http_body::Body::poll_frame(Pin::new(body), &mut cx)
    }

    /// An answer its caller does not read (its HTTP/2 window at 0: the
    /// body never polled) keeps its place and the handler's mark, so the
    /// next request is answered busy, until its deadline: then both are
    /// freed, its bytes dropped and its stream fails. A large answer goes
    /// out in pieces; one read to its end frees them at once.
    #[tokio::test]
    async fn an_unread_answer_keeps_its_place_until_sent_or_its_deadline() {
        use tonic::codegen::Service as _;
        let within = Duration::from_millis(300);
        let service = Answering {
            len: 3 * SEND_PIECE + 10,
            held: Arc::new(()),
        };
        let mark = Arc::downgrade(&service.held);
        let mut limit = InFlightLimit::new(service.clone(), 1, 1024, within, "busy");
        drop(service);
        let request = || tonic::codegen::http::Request::new(tonic::body::Body::empty());
        let unread = limit.call(request()).await.unwrap();
        assert_eq!(mark.strong_count(), 2, "the mark went with the answer");
        let busy = limit.call(request()).await.unwrap();
        assert!(
            status_of(&busy)
                .metadata()
                .get(keel_proto::BUSY_METADATA)
                .is_some(),
            "the unread answer's place was free"
        );
        tokio::time::sleep(within + Duration::from_millis(200)).await;
        assert_eq!(mark.strong_count(), 1, "the mark outlived the deadline");
        let mut unread = unread.into_body();
        assert!(matches!(next_frame(&mut unread), Poll::Ready(Some(Err(_)))));

        // Read whole: its place is free at once, the mark gone with it.
        let mut read = limit.call(request()).await.unwrap().into_body();
        let mut pieces = Vec::new();
        while let Poll::Ready(Some(frame)) = next_frame(&mut read) {
            if let Ok(data) = frame.unwrap().into_data() {
                pieces.push(data.len());
            }
        }
        assert_eq!(pieces, [SEND_PIECE, SEND_PIECE, SEND_PIECE, 10]);
        assert_eq!(mark.strong_count(), 1);
        let next = limit.call(request()).await.unwrap();
        let status = tonic::Status::from_header_map(next.headers());
        assert!(status.is_none(), "{status:?}");
    }

    /// A caller that reads slowly but steadily, each piece well within
    /// the deadline and the whole answer well past it, gets it whole.
    #[tokio::test]
    async fn an_answer_read_slowly_but_steadily_is_sent_whole() {
        use tonic::codegen::Service as _;
        let within = Duration::from_millis(300);
        let service = Answering {
            len: 4 * SEND_PIECE + 10,
            held: Arc::new(()),
        };
        let mark = Arc::downgrade(&service.held);
        let mut limit = InFlightLimit::new(service.clone(), 1, 1024, within, "busy");
        drop(service);
        let answer = limit
            .call(tonic::codegen::http::Request::new(
                tonic::body::Body::empty(),
            ))
            .await
            .unwrap();
        let mut body = answer.into_body();
        let mut pieces = Vec::new();
        loop {
            tokio::time::sleep(Duration::from_millis(150)).await;
            match next_frame(&mut body) {
                Poll::Ready(Some(frame)) => {
                    if let Ok(data) = frame.unwrap().into_data() {
                        pieces.push(data.len());
                    }
                }
                Poll::Ready(None) => break,
                Poll::Pending => panic!("a body made whole has a frame ready"),
            }
        }
        assert_eq!(pieces, [SEND_PIECE, SEND_PIECE, SEND_PIECE, SEND_PIECE, 10]);
        assert_eq!(mark.strong_count(), 1);
    }

    /// Over a real HTTP/2 connection whose caller announces a stream
    /// window of 0 and never opens it: the answer's headers come, none of
    /// its body; at the deadline the place and the handler's mark are free
    /// (the next request is served, not answered busy), and once the
    /// caller opens its window the stream is reset, not ended as if the
    /// answer were whole. A caller that reads gets the answer whole.
    #[tokio::test]
    async fn an_answer_to_a_caller_that_keeps_its_window_shut_is_given_up() {
        let within = Duration::from_secs(1);
        let len = 4 * SEND_PIECE + 10;
        let held = Arc::new(());
        let mark = Arc::downgrade(&held);
        let limit = InFlightLimit::new(Answering { len, held }, 1, 1024, within, "busy");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener)
            .filter_map(|c| c.ok().map(Ok::<_, Infallible>));
        let server = tokio::spawn(async move {
            serve(incoming, &GrpcLimits::default(), |s| s.add_service(limit)).await
        });
        let request = || {
            tonic::codegen::http::Request::post(format!("http://{addr}/test.Answering/Answer"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap()
        };
        let connect = |window| async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            h2::client::Builder::new()
                .initial_window_size(window)
                .initial_connection_window_size(1 << 20)
                .handshake::<_, bytes::Bytes>(tcp)
                .await
                .unwrap()
        };

        let (shut, mut connection) = connect(0).await;
        let (open, opened) = oneshot::channel::<()>();
        tokio::spawn(async move {
            tokio::select! {
                _ = &mut connection => return,
                _ = opened => {}
            }
            connection.set_initial_window_size(len as u32 * 2).unwrap();
            let _ = connection.await;
        });
        let mut shut = shut.ready().await.unwrap();
        let (answer, _) = shut.send_request(request(), true).unwrap();
        let answer = answer.await.unwrap();
        assert_eq!(answer.status(), 200);
        assert!(answer.headers().get("grpc-status").is_none());
        let mut unread = answer.into_body();
        tokio::time::sleep(within + Duration::from_millis(300)).await;
        assert_eq!(mark.strong_count(), 1, "the mark outlived the deadline");
        let mut shut = shut.ready().await.unwrap();
        let (next, _) = shut.send_request(request(), true).unwrap();
        let next = next.await.unwrap();
        assert!(
            next.headers().get("grpc-status").is_none(),
            "the place of the answer given up was not freed: {:?}",
            next.headers()
        );
        open.send(()).unwrap();
        let given_up = tokio::time::timeout(Duration::from_secs(5), unread.data())
            .await
            .expect("the stream of the answer given up neither failed nor ended");
        assert!(
            matches!(&given_up, Some(Err(e)) if e.is_reset()),
            "{given_up:?}"
        );

        let (reader, connection) = connect(len as u32 * 2).await;
        tokio::spawn(connection);
        tokio::time::sleep(within + Duration::from_millis(300)).await;
        let mut reader = reader.ready().await.unwrap();
        let (answer, _) = reader.send_request(request(), true).unwrap();
        let mut body = answer.await.unwrap().into_body();
        let mut received = 0;
        while let Some(data) = body.data().await {
            let data = data.unwrap_or_else(|e| panic!("after {received} bytes: {e}"));
            received += data.len();
            body.flow_control().release_capacity(data.len()).unwrap();
        }
        assert_eq!(received, len);
        server.abort();
    }

    /// Under load, a source is held to its share; below half the places,
    /// nodes behind one address take what they need; a share for every
    /// load holds at every load.
    #[test]
    fn a_sources_share_binds_once_half_the_places_are_taken() {
        let under_load = SourceShare::UnderLoad(4);
        assert_eq!(under_load.bound(0, 256), usize::MAX);
        assert_eq!(under_load.bound(127, 256), usize::MAX);
        assert_eq!(under_load.bound(128, 256), 4);
        assert_eq!(under_load.bound(256, 256), 4);
        assert_eq!(SourceShare::Always(1).bound(0, 256), 1);
    }

    /// A body larger than the service's largest message fails before the
    /// handler has it whole.
    #[tokio::test]
    async fn a_body_past_the_largest_message_fails() {
        use tonic::codegen::Service as _;
        let mut limit = InFlightLimit::new(Reader, 1, 1000, Duration::from_secs(5), "busy");
        let fits = "x".repeat(1005);
        let answer = limit
            .call(tonic::codegen::http::Request::new(tonic::body::Body::new(
                fits,
            )))
            .await
            .unwrap();
        assert_eq!(status_of(&answer).code(), tonic::Code::Ok);
        let past = "x".repeat(1006);
        let answer = limit
            .call(tonic::codegen::http::Request::new(tonic::body::Body::new(
                past,
            )))
            .await
            .unwrap();
        assert_eq!(
            status_of(&answer).code(),
            tonic::Code::ResourceExhausted,
            "{:?}",
            status_of(&answer)
        );
    }

    /// A peer that sends the answer's headers and then holds back its
    /// message: the channel's timeout has ended, this one has not.
    #[tokio::test]
    async fn an_answer_held_back_is_given_up_on() {
        let limit = Duration::from_millis(200);
        let held = std::future::pending::<Result<tonic::Response<u8>, tonic::Status>>();
        let e = answer_within(limit, held).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
        let refused =
            async { Err::<tonic::Response<u8>, _>(tonic::Status::permission_denied("no")) };
        assert_eq!(
            answer_within(limit, refused).await.unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        let answered = async { Ok(tonic::Response::new(7u8)) };
        assert_eq!(answer_within(limit, answered).await.unwrap(), 7);
    }
}
