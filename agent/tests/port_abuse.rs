//! A node's init port (the real init service, aTLS with the node's swtpm,
//! the shared gRPC configuration) under abuse by a client that completed
//! the handshake: one connection opening hundreds of streams, many
//! connections each sending init requests slowly, and idle connections;
//! and the join port under a member that passed mutual attestation and
//! opens ticket requests on many connections. The abusing client speaks
//! HTTP/2 itself (a few frames by hand), since a well-behaved client
//! library never exceeds the server's stream limit or leaves a request
//! half sent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use join_common::{free_port, joiner, member, rss_kib, start_service, Joiner};
use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::grpc::GrpcLimits;
use keel_agent::join::ticket::TicketError;
use keel_agent::node::{
    INIT_REQUEST_BODY_DEADLINE, JOIN_REQUESTS_IN_FLIGHT, OPERATOR_PORT_CONNECTIONS,
    OPERATOR_PORT_CONNECTIONS_PER_SOURCE, OPERATOR_PORT_EVICTION_AGE,
};
use keel_atls::{AtlsClient, AtlsStream, Challenge, ValidationError, Validator};
use keel_proto::init::init_service_client::InitServiceClient;
use keel_proto::init::InitRequest;
use keel_proto::join::IssueJoinTicketRequest;
use keel_testkit::swtpm::EkCa;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tonic::transport::Endpoint;

const SECRET: &[u8] = b"init secret of the abused node";

/// The tests share the process's resident set size, which one of them
/// measures: they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Accepts any server: the abusing client does not care whom it abuses.
struct AnyServer;

impl Validator for AnyServer {
    type Claims = ();

    fn validate(&self, _: &[u8], _: &[u8], _: &[u8]) -> Result<(), ValidationError> {
        Ok(())
    }

    fn residency_challenge(&self, _: &()) -> Result<Option<Challenge>, ValidationError> {
        Ok(None)
    }

    fn residency_proven(&self, _: &()) {}
}

/// A node serving init on loopback with `limits`.
struct InitPort {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    _node: Joiner,
}

impl Drop for InitPort {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn init_port(limits: GrpcLimits) -> InitPort {
    init_port_with(limits, INIT_REQUEST_BODY_DEADLINE).await
}

async fn init_port_with(limits: GrpcLimits, body_deadline: Duration) -> InitPort {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "abused-0", "control-plane");
    let init = node.init_server(SECRET, false);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tpm = node.tpm.clone();
    let task = tokio::spawn(async move {
        keel_agent::node::serve_init_on(listener, tpm, init, &limits, body_deadline)
            .await
            .unwrap();
    });
    InitPort {
        addr,
        task,
        _node: node,
    }
}

async fn validated(port: &InitPort) -> AtlsStream<()> {
    AtlsClient::server_attested(Arc::new(AnyServer))
        .connect("127.0.0.1", port.addr.port())
        .await
        .unwrap()
}

// A few HTTP/2 frames (RFC 9113), enough to open streams and send data.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const ACK: u8 = 0x1;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;
const CANCEL: u32 = 0x8;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;
const MAX_FRAME: usize = 16 * 1024;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// HPACK "literal header field without indexing, new name", no Huffman.
fn literal(out: &mut Vec<u8>, name: &str, value: &str) {
    assert!(name.len() < 127 && value.len() < 127);
    out.push(0x00);
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.push(value.len() as u8);
    out.extend_from_slice(value.as_bytes());
}

fn init_request_headers() -> Vec<u8> {
    request_headers("/keel.init.v1.InitService/Init")
}

fn request_headers(path: &str) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "node"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        literal(&mut block, name, value);
    }
    block
}

/// What the server told this connection.
#[derive(Default)]
struct Seen {
    settings: HashMap<u16, u32>,
    conn_window: i64,
    stream_windows: HashMap<u32, i64>,
    /// Streams reset by the server, by error code.
    resets: HashMap<u32, u32>,
    /// Streams the server answered to the end (HEADERS with END_STREAM),
    /// such as a refusal before the request was read.
    answered: std::collections::HashSet<u32>,
    goaway: Option<u32>,
    closed_after: Option<Duration>,
}

/// The abusing client's connection: the write half, and what a reader task
/// records from the read half.
struct RawH2 {
    writer: tokio::sync::Mutex<WriteHalf<AtlsStream<()>>>,
    seen: Mutex<Seen>,
    changed: Notify,
    opened: Instant,
}

impl RawH2 {
    async fn start(stream: AtlsStream<()>) -> Arc<Self> {
        let (reader, mut writer) = tokio::io::split(stream);
        writer.write_all(PREFACE).await.unwrap();
        writer.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
        let h2 = Arc::new(Self {
            writer: tokio::sync::Mutex::new(writer),
            seen: Mutex::new(Seen {
                conn_window: 65_535,
                ..Seen::default()
            }),
            changed: Notify::new(),
            opened: Instant::now(),
        });
        tokio::spawn(h2.clone().read(reader));
        h2
    }

    async fn send(&self, bytes: &[u8]) -> std::io::Result<()> {
        let mut writer = self.writer.lock().await;
        writer.write_all(bytes).await?;
        writer.flush().await
    }

    async fn read(self: Arc<Self>, mut reader: ReadHalf<AtlsStream<()>>) {
        loop {
            let mut header = [0u8; 9];
            if reader.read_exact(&mut header).await.is_err() {
                break;
            }
            let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            let (kind, flags) = (header[3], header[4]);
            let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]);
            let mut payload = vec![0u8; len];
            if reader.read_exact(&mut payload).await.is_err() {
                break;
            }
            let word = |at: usize| {
                u32::from_be_bytes([
                    payload[at],
                    payload[at + 1],
                    payload[at + 2],
                    payload[at + 3],
                ])
            };
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    {
                        let mut seen = self.seen.lock().unwrap();
                        for entry in payload.chunks_exact(6) {
                            let id = u16::from_be_bytes([entry[0], entry[1]]);
                            let value =
                                u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
                            seen.settings.insert(id, value);
                        }
                    }
                    let _ = self.send(&frame(SETTINGS, ACK, 0, &[])).await;
                }
                PING if flags & ACK == 0 => {
                    let _ = self.send(&frame(PING, ACK, 0, &payload)).await;
                }
                WINDOW_UPDATE => {
                    let increment = i64::from(word(0) & 0x7fff_ffff);
                    let mut seen = self.seen.lock().unwrap();
                    if stream == 0 {
                        seen.conn_window += increment;
                    } else {
                        *seen.stream_windows.entry(stream).or_insert(0) += increment;
                    }
                }
                RST_STREAM => {
                    self.seen.lock().unwrap().resets.insert(stream, word(0));
                }
                HEADERS if flags & END_STREAM != 0 => {
                    self.seen.lock().unwrap().answered.insert(stream);
                }
                GOAWAY => {
                    self.seen.lock().unwrap().goaway = Some(word(4));
                }
                _ => {}
            }
            self.changed.notify_waiters();
        }
        self.seen.lock().unwrap().closed_after = Some(self.opened.elapsed());
        self.changed.notify_waiters();
    }

    /// Waits (at most `limit`) until `done` holds for what was seen.
    async fn wait_until(&self, limit: Duration, done: impl Fn(&Seen) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.changed.notified();
            if done(&self.seen.lock().unwrap()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return done(&self.seen.lock().unwrap());
            }
        }
    }

    /// Sends `bytes` on `stream` as DATA frames within the flow-control
    /// windows, without ending the stream. Fails if the connection closes
    /// or no window opens within `limit`.
    async fn send_data(&self, stream: u32, mut bytes: &[u8], limit: Duration) -> bool {
        let initial = |seen: &Seen| {
            i64::from(
                seen.settings
                    .get(&SETTINGS_INITIAL_WINDOW_SIZE)
                    .copied()
                    .unwrap_or(65_535),
            )
        };
        while !bytes.is_empty() {
            let open = self
                .wait_until(limit, |seen| {
                    let stream_window =
                        initial(seen) + seen.stream_windows.get(&stream).copied().unwrap_or(0);
                    seen.closed_after.is_some()
                        || seen.resets.contains_key(&stream)
                        || seen.answered.contains(&stream)
                        || (seen.conn_window > 0 && stream_window > 0)
                })
                .await;
            let room = {
                let mut seen = self.seen.lock().unwrap();
                if !open
                    || seen.closed_after.is_some()
                    || seen.resets.contains_key(&stream)
                    || seen.answered.contains(&stream)
                {
                    return false;
                }
                let stream_window =
                    initial(&seen) + seen.stream_windows.get(&stream).copied().unwrap_or(0);
                let room = seen
                    .conn_window
                    .min(stream_window)
                    .clamp(0, MAX_FRAME as i64) as usize;
                let room = room.min(bytes.len());
                seen.conn_window -= room as i64;
                *seen.stream_windows.entry(stream).or_insert(0) -= room as i64;
                room
            };
            if self
                .send(&frame(DATA, 0, stream, &bytes[..room]))
                .await
                .is_err()
            {
                return false;
            }
            bytes = &bytes[room..];
        }
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_connection_opening_hundreds_of_streams_is_held_to_the_stream_limit() {
    let _serial = SERIAL.lock().await;
    const STREAMS: u32 = 300;
    // Each stream announces a 1.5 MiB init request (within the decoding
    // limit) and sends 1 MiB of it: what the server buffers per stream.
    const DECLARED: u32 = 1536 * 1024;
    const SENT: usize = 1024 * 1024;
    let limits = GrpcLimits::default();
    let cap = limits.max_concurrent_streams;
    let port = init_port(limits).await;
    let h2 = RawH2::start(validated(&port).await).await;
    assert!(
        h2.wait_until(Duration::from_secs(5), |s| !s.settings.is_empty())
            .await,
        "no SETTINGS from the server"
    );
    let announced = h2
        .seen
        .lock()
        .unwrap()
        .settings
        .get(&SETTINGS_MAX_CONCURRENT_STREAMS)
        .copied();
    assert_eq!(announced, Some(cap));

    let before = rss_kib();
    let streams: Vec<u32> = (0..STREAMS).map(|i| 2 * i + 1).collect();
    let headers = init_request_headers();
    for &stream in &streams {
        h2.send(&frame(HEADERS, END_HEADERS, stream, &headers))
            .await
            .unwrap();
    }
    // Every stream beyond the limit is refused.
    let beyond = STREAMS.saturating_sub(cap) as usize;
    let refused_count = |s: &Seen| {
        s.resets
            .values()
            .filter(|&&code| code == REFUSED_STREAM)
            .count()
    };
    // Every stream is refused or answered, but the one init request of
    // this source that the port reads.
    h2.wait_until(Duration::from_secs(10), |s| {
        refused_count(s) + s.answered.len() + 1 >= STREAMS as usize
    })
    .await;
    let (refused, goaway) = {
        let seen = h2.seen.lock().unwrap();
        (refused_count(&seen), seen.goaway)
    };
    let open: Vec<u32> = {
        let seen = h2.seen.lock().unwrap();
        streams
            .iter()
            .copied()
            .filter(|s| seen.resets.get(s) != Some(&REFUSED_STREAM))
            .collect()
    };

    // The streams that were not refused each push 1 MiB of a request.
    let mut body = Vec::with_capacity(5 + SENT);
    body.push(0);
    body.extend_from_slice(&DECLARED.to_be_bytes());
    body.resize(5 + SENT, 0x42);
    let started = Instant::now();
    let mut pushed = 0usize;
    for &stream in &open {
        if h2.send_data(stream, &body, Duration::from_secs(10)).await {
            pushed += 1;
        }
    }
    let push_time = started.elapsed();
    // Let the server take in what was sent.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_kib();
    let grown_mib = after.saturating_sub(before) / 1024;
    let answered = h2.seen.lock().unwrap().answered.len();
    eprintln!(
        "{STREAMS} streams opened on one connection (limit {cap}): {refused} refused, \
         goaway {goaway:?}; of {} open streams, {answered} answered at once and \
         {pushed} took 1 MiB of a request in {push_time:?}; \
         RSS {before} KiB -> {after} KiB (+{grown_mib} MiB)",
        open.len()
    );
    // Streams answered at once (below) free their place at once, so more
    // than the limit may be taken in all; beyond it, they are refused.
    assert!(refused > 0 && refused <= beyond, "{refused} refused");
    assert_eq!(refused + open.len(), STREAMS as usize);
    // The port reads one init request of a source at once; the other
    // streams are answered (busy) without their bodies being read.
    assert_eq!(pushed, 1, "init requests of one source read at once");
    assert_eq!(
        answered,
        open.len() - pushed,
        "the streams beyond the bound were answered"
    );
    assert!(
        grown_mib < 64,
        "the server grew by {grown_mib} MiB for one connection"
    );
}

/// Attacker's move: from one address, open as many connections as the
/// port takes and, on each, as many init requests as a connection may
/// carry, each announcing 1.5 MiB and sending 1 MiB of it, slowly enough to
/// keep them in flight: each would be buffered until the request timeout.
/// The port keeps at most its connection share for one source, and reads
/// one init request of a source at once across all its connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_connections_sending_init_requests_are_held_to_the_ports_bounds() {
    let _serial = SERIAL.lock().await;
    const DECLARED: u32 = 1536 * 1024;
    const SENT: usize = 1024 * 1024;
    const ATTEMPTS: usize = 3 * OPERATOR_PORT_CONNECTIONS;
    let limits = GrpcLimits::default();
    let streams_per_connection = limits.max_concurrent_streams;
    let port = init_port(limits).await;

    // Connections beyond the source's share are closed in the handshake.
    let mut connections = Vec::new();
    let mut closed = 0;
    for _ in 0..ATTEMPTS {
        match AtlsClient::server_attested(Arc::new(AnyServer))
            .connect("127.0.0.1", port.addr.port())
            .await
        {
            Ok(stream) => connections.push(RawH2::start(stream).await),
            Err(_) => closed += 1,
        }
    }
    eprintln!(
        "{ATTEMPTS} connections from one address: {} kept, {closed} closed",
        connections.len()
    );
    assert_eq!(
        connections.len(),
        OPERATOR_PORT_CONNECTIONS_PER_SOURCE,
        "one source holds its share of the port's connections, even on an idle port"
    );

    let before = rss_kib();
    let headers = init_request_headers();
    let mut body = Vec::with_capacity(5 + SENT);
    body.push(0);
    body.extend_from_slice(&DECLARED.to_be_bytes());
    body.resize(5 + SENT, 0x42);
    let mut pushes = Vec::new();
    for h2 in &connections {
        for i in 0..streams_per_connection {
            let stream = 2 * i + 1;
            h2.send(&frame(HEADERS, END_HEADERS, stream, &headers))
                .await
                .unwrap();
            let (h2, body) = (h2.clone(), body.clone());
            pushes.push(tokio::spawn(async move {
                h2.send_data(stream, &body, Duration::from_secs(10)).await
            }));
        }
    }
    let mut pushed = 0;
    for push in pushes {
        if push.await.unwrap() {
            pushed += 1;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_kib();
    let grown_mib = after.saturating_sub(before) / 1024;
    let answered: usize = connections
        .iter()
        .map(|h2| h2.seen.lock().unwrap().answered.len())
        .sum();
    let opened = connections.len() * streams_per_connection as usize;
    eprintln!(
        "{opened} init requests opened: {pushed} took 1 MiB, {answered} answered at once; \
         RSS {before} KiB -> {after} KiB (+{grown_mib} MiB)"
    );
    assert_eq!(pushed, 1, "init requests of one source read at once");
    assert_eq!(answered, opened - pushed, "the others were answered (busy)");
    assert!(
        grown_mib < 16,
        "the server grew by {grown_mib} MiB for {opened} slow init requests"
    );
}

/// Attacker's move: hold the init port's place of an address (or all of
/// them, from a few addresses) with init requests whose bodies trickle in,
/// each until the request timeout, so that `keel init` never gets in. A
/// body that has not arrived by the deadline fails its request before the
/// handler runs, and the place is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_init_request_loses_its_place_at_the_body_deadline() {
    let _serial = SERIAL.lock().await;
    let deadline = Duration::from_secs(1);
    let port = init_port_with(GrpcLimits::default(), deadline).await;
    let h2 = RawH2::start(validated(&port).await).await;
    h2.send(&frame(HEADERS, END_HEADERS, 1, &init_request_headers()))
        .await
        .unwrap();
    let mut partial = vec![0u8];
    partial.extend_from_slice(&1000u32.to_be_bytes());
    partial.extend_from_slice(&[0; 10]);
    h2.send(&frame(DATA, 0, 1, &partial)).await.unwrap();
    // (The server may take streams that arrive together in either order.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    // While it trickles, the address's next request is answered at once.
    h2.send(&frame(HEADERS, END_HEADERS, 3, &init_request_headers()))
        .await
        .unwrap();
    let answered = h2
        .wait_until(Duration::from_millis(500), |s| s.answered.contains(&3))
        .await;
    assert!(
        answered,
        "a second request of the address was taken: {:?}",
        {
            let seen = h2.seen.lock().unwrap();
            (seen.answered.clone(), seen.resets.clone())
        }
    );
    assert!(
        !h2.seen.lock().unwrap().answered.contains(&1),
        "the first ended before its deadline"
    );
    let started = Instant::now();
    assert!(
        h2.wait_until(3 * deadline, |s| s.answered.contains(&1)
            || s.resets.contains_key(&1))
            .await,
        "the trickled request outlived its deadline"
    );
    eprintln!(
        "trickled request ended {:?} after the check",
        started.elapsed()
    );
    // Its place is free: the address's next request is read.
    h2.send(&frame(HEADERS, END_HEADERS, 5, &init_request_headers()))
        .await
        .unwrap();
    h2.send(&frame(DATA, 0, 5, &partial)).await.unwrap();
    assert!(
        !h2.wait_until(deadline / 2, |s| s.answered.contains(&5))
            .await,
        "the place was not freed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_a_request_in_flight_is_closed_after_the_idle_timeout() {
    let _serial = SERIAL.lock().await;
    let idle = Duration::from_secs(1);
    let mut limits = GrpcLimits::default();
    limits.idle_timeout = idle;
    // The server's keepalive pings (answered by the client) move bytes both
    // ways every 300 ms; they must not keep an idle connection open either.
    limits.keepalive_interval = Duration::from_millis(300);
    let port = init_port(limits).await;

    // Pinging does not make a connection busy.
    let h2 = RawH2::start(validated(&port).await).await;
    let pinger = {
        let h2 = h2.clone();
        tokio::spawn(async move {
            for _ in 0..50 {
                if h2.send(&frame(PING, 0, 0, &[7; 8])).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    assert!(
        h2.wait_until(Duration::from_secs(5), |s| s.closed_after.is_some())
            .await,
        "a pinging idle connection stayed open"
    );
    let closed_after = h2.seen.lock().unwrap().closed_after.unwrap();
    pinger.abort();
    eprintln!("pinging idle connection closed after {closed_after:?} (idle timeout {idle:?})");
    assert!(closed_after >= idle && closed_after < idle + Duration::from_secs(2));

    // A request in flight keeps it open past the idle timeout, however
    // quiet; once the request ends, the clock starts.
    let h2 = RawH2::start(validated(&port).await).await;
    h2.send(&frame(HEADERS, END_HEADERS, 1, &init_request_headers()))
        .await
        .unwrap();
    let mut partial = vec![0u8];
    partial.extend_from_slice(&100u32.to_be_bytes());
    partial.extend_from_slice(&[0; 10]);
    h2.send(&frame(DATA, 0, 1, &partial)).await.unwrap();
    assert!(
        !h2.wait_until(3 * idle, |s| s.closed_after.is_some() || s.goaway.is_some())
            .await,
        "closed with a request in flight"
    );
    let cancelled = Instant::now();
    h2.send(&frame(RST_STREAM, 0, 1, &CANCEL.to_be_bytes()))
        .await
        .unwrap();
    assert!(
        h2.wait_until(idle + Duration::from_secs(3), |s| s.closed_after.is_some())
            .await,
        "still open after the request ended"
    );
    let took = cancelled.elapsed();
    eprintln!("closed {took:?} after its last request ended");
    assert!(took >= idle - Duration::from_millis(50));

    // A real client: a call works, and the idle connection then goes.
    let bound = AtlsClient::server_attested(Arc::new(AnyServer))
        .bind_channel(Endpoint::from_shared(format!("http://{}", port.addr)).unwrap())
        .await
        .unwrap();
    let mut client = InitServiceClient::new(bound.channel);
    // Refused before anything is opened: no sealed secrets.
    let wrong = InitRequest::default();
    let status = client.init(wrong.clone()).await.err().unwrap();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    tokio::time::sleep(idle + Duration::from_millis(500)).await;
    let status = client.init(wrong).await.err().unwrap();
    eprintln!("a call after the idle timeout: {status:?}");
    assert_ne!(
        status.code(),
        tonic::Code::InvalidArgument,
        "the request reached the server over the idle connection"
    );
}

/// Whether the server closed `stream` (what it sent before is skipped).
async fn closed_by_server(stream: &mut AtlsStream<()>) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// Attacker's move: from 16 addresses, take every place on the init port
/// with completed handshakes (anyone can complete one) and keep them open,
/// so that the operator's `keel init`, `recover`, `revoke` or `status` is
/// reset at accept. The operator's connection waits for a place instead,
/// and the oldest connection that proved nothing is closed for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_init_port_makes_room_for_a_newcomer() {
    let _serial = SERIAL.lock().await;
    let port = init_port(GrpcLimits::default()).await;
    let client = |last: u8| {
        AtlsClient::server_attested(Arc::new(AnyServer))
            .with_local_address(std::net::IpAddr::from([127, 0, 0, last]))
    };
    let sources = OPERATOR_PORT_CONNECTIONS / OPERATOR_PORT_CONNECTIONS_PER_SOURCE;
    let mut held = Vec::new();
    for last in 0..sources {
        let last = u8::try_from(last + 2).unwrap();
        for _ in 0..OPERATOR_PORT_CONNECTIONS_PER_SOURCE {
            held.push(
                client(last)
                    .connect("127.0.0.1", port.addr.port())
                    .await
                    .unwrap(),
            );
        }
    }
    // Full, and every connection old enough to be closed for a newcomer.
    tokio::time::sleep(OPERATOR_PORT_EVICTION_AGE).await;
    let started = Instant::now();
    let newcomer = client(101).connect("127.0.0.1", port.addr.port()).await;
    eprintln!(
        "a newcomer on a full init port: {:?} after {:?}",
        newcomer.as_ref().map(|_| "admitted"),
        started.elapsed()
    );
    assert!(newcomer.is_ok(), "{:?}", newcomer.err());
    let mut evicted = 0;
    for stream in &mut held {
        if closed_by_server(stream).await {
            evicted += 1;
        }
    }
    assert_eq!(evicted, 1, "one held connection closed for the newcomer");
}

/// A raw HTTP/2 connection to the init port at `port` from 127.0.0.`last`,
/// tried again until the port takes it.
async fn connected_from(port: SocketAddr, last: u8) -> Arc<RawH2> {
    let client = AtlsClient::server_attested(Arc::new(AnyServer))
        .with_local_address(std::net::IpAddr::from([127, 0, 0, last]));
    loop {
        match client.connect("127.0.0.1", port.port()).await {
            Ok(stream) => return RawH2::start(stream).await,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// An attacker's source holding an init request's place: on one
/// connection, init HEADERS and a gRPC frame header announcing 1 MiB, then
/// a byte every 100 ms; a new request as soon as the last was answered or
/// reset (and a new connection if the port closed it).
async fn hold_a_place(port: SocketAddr, last: u8) {
    let mut start = vec![0u8];
    start.extend_from_slice(&(1024 * 1024u32).to_be_bytes());
    start.extend_from_slice(&[0; 10]);
    loop {
        let h2 = connected_from(port, last).await;
        let mut id = 1;
        'requests: loop {
            let sent = async {
                h2.send(&frame(HEADERS, END_HEADERS, id, &init_request_headers()))
                    .await?;
                h2.send(&frame(DATA, 0, id, &start)).await
            };
            if sent.await.is_err() {
                break;
            }
            loop {
                let done = |s: &Seen| {
                    s.closed_after.is_some()
                        || s.answered.contains(&id)
                        || s.resets.contains_key(&id)
                };
                if h2.wait_until(Duration::from_millis(100), done).await {
                    if h2.seen.lock().unwrap().closed_after.is_some() {
                        break 'requests;
                    }
                    break;
                }
                if h2.send(&frame(DATA, 0, id, &[0])).await.is_err() {
                    break 'requests;
                }
            }
            id += 2;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// An attacker's source sending new init requests (HEADERS alone) every
/// few milliseconds, to take any place the moment it frees.
async fn spam_init_headers(port: SocketAddr, last: u8) {
    loop {
        let h2 = connected_from(port, last).await;
        let mut id = 1;
        while h2
            .send(&frame(HEADERS, END_HEADERS, id, &init_request_headers()))
            .await
            .is_ok()
            && h2.seen.lock().unwrap().closed_after.is_none()
        {
            id += 2;
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    }
}

/// Attacker's move: from four addresses, hold every init request's place
/// with a body trickled in up to the 30 s body deadline and open the next
/// at once; from a fifth, send new init requests every few milliseconds,
/// so that a place that frees is taken within a millisecond. The
/// operator's `keel init` (a busy answer sent again after 2 s) would never
/// get in. A newcomer waits for a place in order instead, and the oldest
/// place whose body is still arriving is evicted for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn trickled_init_requests_from_every_place_do_not_keep_init_out() {
    let _serial = SERIAL.lock().await;
    let port = init_port(GrpcLimits::default()).await;
    let mut attackers: Vec<_> = (2..=5u8)
        .map(|last| tokio::spawn(hold_a_place(port.addr, last)))
        .collect();
    attackers.push(tokio::spawn(spam_init_headers(port.addr, 6)));
    // Every place taken.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let bound = AtlsClient::server_attested(Arc::new(AnyServer))
        .with_local_address(std::net::IpAddr::from([127, 0, 0, 7]))
        .bind_channel(Endpoint::from_shared(format!("http://{}", port.addr)).unwrap())
        .await
        .unwrap();
    let mut client = InitServiceClient::new(bound.channel);
    let started = Instant::now();
    let mut busy = 0;
    let status = loop {
        let status = client.init(InitRequest::default()).await.err().unwrap();
        let told_busy = status.metadata().get(keel_proto::BUSY_METADATA).is_some();
        if !told_busy || started.elapsed() > Duration::from_secs(15) {
            break status;
        }
        busy += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    for attacker in &attackers {
        attacker.abort();
    }
    eprintln!(
        "the operator's init under attack: {status:?} after {:?}, {busy} busy answers",
        started.elapsed()
    );
    assert!(
        status.metadata().get(keel_proto::BUSY_METADATA).is_none(),
        "the operator's init was kept out for {:?}: {status:?}",
        started.elapsed()
    );
}

/// Attacker's move: a member compromised after its attestation opens
/// ticket requests on many connections from one address, each announcing
/// a 32 KiB message and sending 10 bytes of it, never more. Every stream
/// of every connection would hold its buffer until the 120 s request
/// timeout: with the port's thousands of connections, gigabytes. The port
/// holds [`JOIN_REQUESTS_IN_FLIGHT`] ticket requests at once across its
/// connections, and once half are taken a source only up to its share: so
/// this source's requests past half of the places are answered busy at
/// once, their bodies never read, and a member from another address still
/// has its request read and answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ticket_requests_on_many_connections_are_held_to_the_join_ports_bound() {
    let _serial = SERIAL.lock().await;
    let ca = EkCa::new().unwrap();
    let port = free_port();
    let service = start_service(&ca, port).await;
    let flooder = member(&ca, port, "flooder", "worker");
    let client = AtlsClient::mutual(
        Arc::new(TpmIssuer::new(flooder.tpm.clone())),
        Arc::new(AnyServer),
    )
    .with_local_address(std::net::IpAddr::from([127, 0, 0, 2]));
    let half = JOIN_REQUESTS_IN_FLIGHT / 2;
    let streams_per_connection = 8;
    let connections = (half + 32) / streams_per_connection;
    let mut flood = Vec::new();
    for _ in 0..connections {
        let stream = client.connect("127.0.0.1", port).await.unwrap();
        flood.push(RawH2::start(stream).await);
    }
    let mut start = vec![0u8];
    start.extend_from_slice(&(32 * 1024u32).to_be_bytes());
    start.extend_from_slice(&[0; 10]);
    let headers = request_headers("/keel.join.v1.JoinService/IssueJoinTicket");
    for h2 in &flood {
        for i in 0..streams_per_connection {
            let id = 1 + 2 * i as u32;
            h2.send(&frame(HEADERS, END_HEADERS, id, &headers))
                .await
                .unwrap();
            h2.send(&frame(DATA, 0, id, &start)).await.unwrap();
        }
    }
    let sent = connections * streams_per_connection;
    let answered = || -> usize {
        flood
            .iter()
            .map(|h2| h2.seen.lock().unwrap().answered.len())
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while answered() < sent - half && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let busy = answered();
    eprintln!("{sent} trickled ticket requests from one address: {busy} answered at once");
    // A few may slip in past half while the places fill from both of the
    // server's threads at once.
    assert!(
        busy + 4 >= sent - half && busy <= sent - half,
        "{busy} of {sent} answered at once; {} expected past half the places",
        sent - half
    );

    // Another member's request is read and answered by the service.
    let newcomer = member(&ca, port, "newcomer", "worker");
    let refused = newcomer
        .tickets(&ca)
        .with_local_address(std::net::IpAddr::from([127, 0, 0, 3]))
        .request_join_ticket(&service.endpoint, IssueJoinTicketRequest::default())
        .await
        .err()
        .unwrap();
    let TicketError::Refused(status) = refused else {
        panic!("the newcomer's request failed on the way: {refused:?}");
    };
    assert!(
        !keel_proto::told_busy(&status),
        "the newcomer was told busy: {status:?}"
    );
    assert_ne!(status.code(), tonic::Code::Unavailable, "{status:?}");
    drop(flood);
}
