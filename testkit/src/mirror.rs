//! A local HTTP/1.1 component mirror on 127.0.0.1, for tests and the local
//! cluster: serves bytes or files by path, counts requests, and injects the
//! faults a real mirror or CDN shows — error statuses, bodies cut short,
//! connections that never answer.
//!
//! A route is a path (any query matches) or a path with its query (only that
//! query matches; it wins over the bare path), and may carry response
//! headers, so the mirror can stand in for a vendor API too.
//!
//! It runs on its own thread and runtime, so it works from synchronous and
//! asynchronous callers alike, and stops (closing every connection) when the
//! [`MirrorServer`] is dropped. Every response closes its connection.
//!
//! [`MirrorServer::start_tls`] serves the same over HTTPS, with a
//! certificate for `127.0.0.1` from a fresh CA that
//! [`MirrorServer::tls_root`] returns.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

/// Largest request head the mirror reads.
const MAX_REQUEST_HEAD: usize = 16 * 1024;
/// How long the mirror waits for a request head.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Chunk size when streaming a file body.
const FILE_CHUNK: usize = 1024 * 1024;

/// What a path serves.
#[derive(Debug, Clone)]
pub enum Body {
    /// Bytes held in memory.
    Bytes(Bytes),
    /// A file read at request time (for large bodies).
    File(PathBuf),
}

/// A misbehaviour to show instead of (or while) serving a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this status and a short body.
    Status(u16),
    /// Answer with this status and the path's body (an error page of the
    /// server's own words).
    StatusWithBody(u16),
    /// Announce the full Content-Length, send only this many body bytes,
    /// then close the connection.
    Truncate(u64),
    /// Send no Content-Length (the body is delimited by the end of the
    /// connection, as HTTP/1.1 allows a response), only this many body
    /// bytes, then close: to the client the cut looks like the end.
    TruncateUnannounced(u64),
    /// Send only this many body bytes as a whole chunked body (its last
    /// chunk included): a well-framed body of other bytes.
    ChunkedPrefix(u64),
    /// Read the request and never answer (the connection stays open until
    /// the mirror stops).
    Hang,
}

#[derive(Debug, Default)]
struct Route {
    body: Option<Body>,
    /// A `302 Found` to this URL instead of the body.
    redirect: Option<String>,
    /// Extra response headers of a 200.
    headers: Vec<(String, String)>,
    /// Faults used up one per request, before `always`.
    next: VecDeque<Fault>,
    /// A fault shown on every request once `next` is empty.
    always: Option<Fault>,
    requests: usize,
}

#[derive(Debug, Default)]
struct State {
    routes: HashMap<String, Route>,
    /// Requests of any path, unknown ones included.
    total: usize,
}

/// Why the mirror could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MirrorError {
    /// Binding 127.0.0.1:0 failed.
    #[error("binding the mirror's listening socket on 127.0.0.1")]
    Bind(#[source] std::io::Error),
    /// Building the mirror's runtime failed.
    #[error("starting the mirror's runtime thread")]
    Runtime(#[source] std::io::Error),
    /// Making the HTTPS mirror's certificate failed.
    #[error("making the mirror's TLS certificate")]
    Certificate(#[source] rcgen::Error),
    /// Configuring the HTTPS mirror's TLS failed.
    #[error("configuring the mirror's TLS")]
    Tls(#[source] rustls::Error),
}

/// A running mirror. Dropping it stops the server.
#[derive(Debug)]
pub struct MirrorServer {
    addr: SocketAddr,
    /// The CA of an HTTPS mirror's certificate.
    tls_root: Option<CertificateDer<'static>>,
    state: Arc<Mutex<State>>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl MirrorServer {
    /// Starts a mirror on an ephemeral loopback port.
    pub fn start() -> Result<Self, MirrorError> {
        Self::start_with(None)
    }

    /// Starts an HTTPS mirror on an ephemeral loopback port; its
    /// certificate (for `127.0.0.1`) is issued by [`Self::tls_root`].
    pub fn start_tls() -> Result<Self, MirrorError> {
        Self::start_tls_offering(&[])
    }

    /// [`Self::start_tls`], the TLS server also selecting from `protocols`
    /// by ALPN (as a CDN offers `h2`); the mirror speaks HTTP/1.1 alone,
    /// so a client that picks another protocol gets no answer it can read.
    pub fn start_tls_offering(protocols: &[&[u8]]) -> Result<Self, MirrorError> {
        let ca_key = rcgen::KeyPair::generate().map_err(MirrorError::Certificate)?;
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())
            .map_err(MirrorError::Certificate)?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).map_err(MirrorError::Certificate)?;
        let key = rcgen::KeyPair::generate().map_err(MirrorError::Certificate)?;
        let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .map_err(MirrorError::Certificate)?
            .signed_by(&key, &rcgen::Issuer::new(ca, &ca_key))
            .map_err(MirrorError::Certificate)?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(MirrorError::Tls)?
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .map_err(MirrorError::Tls)?;
        let mut config = config;
        config.alpn_protocols = protocols.iter().map(|p| p.to_vec()).collect();
        let mut mirror = Self::start_with(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))?;
        mirror.tls_root = Some(ca_cert.der().clone());
        Ok(mirror)
    }

    /// The CA certificate (DER) of an HTTPS mirror; `None` for HTTP.
    pub fn tls_root(&self) -> Option<CertificateDer<'static>> {
        self.tls_root.clone()
    }

    fn start_with(tls: Option<tokio_rustls::TlsAcceptor>) -> Result<Self, MirrorError> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(MirrorError::Bind)?;
        listener.set_nonblocking(true).map_err(MirrorError::Bind)?;
        let addr = listener.local_addr().map_err(MirrorError::Bind)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(MirrorError::Runtime)?;
        let state = Arc::new(Mutex::new(State::default()));
        let (shutdown, stop) = oneshot::channel();
        let served = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name(format!("mirror-{}", addr.port()))
            .spawn(move || runtime.block_on(serve(listener, tls, served, stop)))
            .map_err(MirrorError::Runtime)?;
        Ok(Self {
            addr,
            tls_root: None,
            state,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:<port>` (`https://` for an HTTPS mirror; no
    /// trailing slash).
    pub fn base_url(&self) -> String {
        let scheme = if self.tls_root.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    /// The URL of `path` (which starts with `/`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url())
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves `bytes` at `path`.
    pub fn serve(&self, path: &str, bytes: impl Into<Bytes>) {
        let body = Body::Bytes(bytes.into());
        self.with_route(path, |r| r.body = Some(body));
    }

    /// Serves `bytes` at `target` (a path, or a path and query) with extra
    /// response `headers`.
    pub fn serve_with_headers(
        &self,
        target: &str,
        bytes: impl Into<Bytes>,
        headers: &[(&str, &str)],
    ) {
        let body = Body::Bytes(bytes.into());
        let headers = headers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect();
        self.with_route(target, |r| {
            r.body = Some(body);
            r.headers = headers;
        });
    }

    /// Answers requests of `path` with `302 Found` to `location`.
    pub fn redirect(&self, path: &str, location: &str) {
        let location = location.to_owned();
        self.with_route(path, |r| r.redirect = Some(location));
    }

    /// Serves the file at `file` at `path`, read at request time.
    pub fn serve_file(&self, path: &str, file: impl Into<PathBuf>) {
        let body = Body::File(file.into());
        self.with_route(path, |r| r.body = Some(body));
    }

    /// Shows `fault` on the next `times` requests of `path`, then serves it
    /// normally (e.g. 503 twice, then 200).
    pub fn fail_next(&self, path: &str, fault: Fault, times: usize) {
        self.with_route(path, |r| r.next.extend(std::iter::repeat_n(fault, times)));
    }

    /// Shows `fault` on every request of `path` from now on.
    pub fn fail_always(&self, path: &str, fault: Fault) {
        self.with_route(path, |r| r.always = Some(fault));
    }

    /// How many requests the mirror has received, for any path.
    pub fn total_requests(&self) -> usize {
        lock(&self.state).total
    }

    /// How many requests `path` has received.
    pub fn requests(&self, path: &str) -> usize {
        lock(&self.state).routes.get(path).map_or(0, |r| r.requests)
    }

    fn with_route(&self, path: &str, change: impl FnOnce(&mut Route)) {
        change(lock(&self.state).routes.entry(path.to_owned()).or_default());
    }
}

impl Drop for MirrorServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn serve(
    listener: std::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<Mutex<State>>,
    mut stop: oneshot::Receiver<()>,
) {
    let Ok(listener) = TcpListener::from_std(listener) else {
        return;
    };
    // Dropping the set at the end aborts every open connection.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => {
                if let Ok((stream, _)) = accepted {
                    let state = Arc::clone(&state);
                    match tls.clone() {
                        None => connections.spawn(handle(stream, state)),
                        Some(tls) => connections.spawn(async move {
                            let handshake = tls.accept(stream);
                            if let Ok(Ok(stream)) = tokio::time::timeout(REQUEST_TIMEOUT, handshake).await {
                                handle(stream, state).await;
                            }
                        }),
                    };
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// What one request gets, decided under the lock.
enum Reply {
    NotFound,
    MethodNotAllowed,
    Fault(Fault, Option<Body>),
    Redirect(String),
    Body(Body, Vec<(String, String)>),
}

async fn handle<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, state: Arc<Mutex<State>>) {
    let Ok(Ok(Some((method, target)))) =
        tokio::time::timeout(REQUEST_TIMEOUT, read_request_line(&mut stream)).await
    else {
        return;
    };
    let path = target.split('?').next().unwrap_or_default().to_owned();
    let head_only = method == "HEAD";
    let reply = {
        let mut state = lock(&state);
        state.total += 1;
        let key = if state.routes.contains_key(&target) {
            target
        } else {
            path
        };
        match state.routes.get_mut(&key) {
            _ if method != "GET" && method != "HEAD" => Reply::MethodNotAllowed,
            None => Reply::NotFound,
            Some(route) => {
                route.requests += 1;
                match (route.next.pop_front().or(route.always), &route.redirect) {
                    (Some(fault), _) => Reply::Fault(fault, route.body.clone()),
                    (None, Some(location)) => Reply::Redirect(location.clone()),
                    (None, None) => match route.body.clone() {
                        Some(body) => Reply::Body(body, route.headers.clone()),
                        None => Reply::NotFound,
                    },
                }
            }
        }
    };
    let _ = match reply {
        Reply::NotFound => status(&mut stream, 404).await,
        Reply::MethodNotAllowed => status(&mut stream, 405).await,
        Reply::Fault(Fault::Status(code), _) => status(&mut stream, code).await,
        Reply::Fault(Fault::StatusWithBody(code), body) => match body {
            Some(body) => {
                send_body_as(&mut stream, code, body, &[], Framing::WHOLE, head_only).await
            }
            None => status(&mut stream, code).await,
        },
        Reply::Redirect(location) => redirect(&mut stream, &location).await,
        Reply::Fault(Fault::Hang, _) => std::future::pending::<std::io::Result<()>>().await,
        Reply::Fault(
            fault @ (Fault::Truncate(keep)
            | Fault::TruncateUnannounced(keep)
            | Fault::ChunkedPrefix(keep)),
            body,
        ) => {
            let framing = Framing {
                keep: Some(keep),
                length: match fault {
                    Fault::Truncate(_) => Length::Announced,
                    Fault::ChunkedPrefix(_) => Length::Chunked,
                    _ => Length::ByClose,
                },
            };
            match body {
                Some(body) => send_body_as(&mut stream, 200, body, &[], framing, head_only).await,
                None => status(&mut stream, 404).await,
            }
        }
        Reply::Body(body, headers) => {
            send_body_as(&mut stream, 200, body, &headers, Framing::WHOLE, head_only).await
        }
    };
    let _ = stream.shutdown().await;
}

/// Reads the request head and returns the method and target (path and query).
async fn read_request_line<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> std::io::Result<Option<(String, String)>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_REQUEST_HEAD {
            return Ok(None);
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(None);
        }
        head.extend_from_slice(buf.get(..n).unwrap_or_default());
    }
    let text = String::from_utf8_lossy(&head);
    let mut words = text.lines().next().unwrap_or_default().split(' ');
    let (Some(method), Some(target)) = (words.next(), words.next()) else {
        return Ok(None);
    };
    Ok(Some((method.to_owned(), target.to_owned())))
}

async fn redirect<S: AsyncWrite + Unpin>(stream: &mut S, location: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await
}

async fn status<S: AsyncWrite + Unpin>(stream: &mut S, code: u16) -> std::io::Result<()> {
    let body = format!("mirror: status {code}\n");
    let head = format!(
        "HTTP/1.1 {code} Mirror\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await
}

/// How much of a body goes out, and how its end is marked.
#[derive(Clone, Copy)]
struct Framing {
    /// Send only this many bytes of the body.
    keep: Option<u64>,
    length: Length,
}

/// How a response marks the end of its body.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Length {
    /// A Content-Length of the whole body.
    Announced,
    /// One chunk with the bytes sent, then the last chunk.
    Chunked,
    /// Nothing: the body ends with the connection.
    ByClose,
}

impl Framing {
    const WHOLE: Self = Self {
        keep: None,
        length: Length::Announced,
    };
}

/// Sends `code` with `headers` and the body as `framing` says.
async fn send_body_as<S: AsyncWrite + Unpin>(
    stream: &mut S,
    code: u16,
    body: Body,
    headers: &[(String, String)],
    framing: Framing,
    head_only: bool,
) -> std::io::Result<()> {
    let length = match &body {
        Body::Bytes(bytes) => bytes.len() as u64,
        Body::File(path) => tokio::fs::metadata(path).await?.len(),
    };
    let mut extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let mut remaining = framing.keep.unwrap_or(length).min(length);
    match framing.length {
        Length::Announced => extra.insert_str(0, &format!("Content-Length: {length}\r\n")),
        Length::Chunked => extra.insert_str(0, "Transfer-Encoding: chunked\r\n"),
        Length::ByClose => {}
    }
    let head = format!(
        "HTTP/1.1 {code} Mirror\r\nContent-Type: application/octet-stream\r\n{extra}Connection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await?;
    if head_only {
        return Ok(());
    }
    let chunked = framing.length == Length::Chunked;
    let chunk = remaining;
    if chunked && chunk > 0 {
        stream
            .write_all(format!("{chunk:x}\r\n").as_bytes())
            .await?;
    }
    match body {
        Body::Bytes(bytes) => {
            let end = usize::try_from(remaining).unwrap_or(usize::MAX);
            stream.write_all(bytes.get(..end).unwrap_or(&bytes)).await?;
        }
        Body::File(path) => {
            let mut file = tokio::fs::File::open(path).await?;
            let mut buf = vec![0u8; FILE_CHUNK];
            while remaining > 0 {
                let want = usize::try_from(remaining)
                    .unwrap_or(usize::MAX)
                    .min(FILE_CHUNK);
                let n = file.read(buf.get_mut(..want).unwrap_or_default()).await?;
                if n == 0 {
                    break;
                }
                stream.write_all(buf.get(..n).unwrap_or_default()).await?;
                remaining -= n as u64;
            }
        }
    }
    if chunked {
        let last: &[u8] = if chunk > 0 {
            b"\r\n0\r\n\r\n"
        } else {
            b"0\r\n\r\n"
        };
        stream.write_all(last).await?;
    }
    stream.flush().await
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::io::{Read as _, Write as _};

    use super::*;

    /// One raw GET; returns the status line, headers and body as received.
    fn get(mirror: &MirrorServer, path: &str) -> (String, Vec<u8>) {
        let mut stream = std::net::TcpStream::connect(mirror.addr()).unwrap();
        write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).unwrap();
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8(raw[..split].to_vec()).unwrap();
        (head, raw[split + 4..].to_vec())
    }

    #[test]
    fn serves_bytes_and_files_and_counts_requests() {
        let mirror = MirrorServer::start().unwrap();
        mirror.serve("/a", &b"hello"[..]);
        let dir = std::env::temp_dir().join(format!("mirror-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("f"), b"from disk").unwrap();
        mirror.serve_file("/f", dir.join("f"));

        let (head, body) = get(&mirror, "/a?ignored=1");
        assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
        assert!(head.contains("Content-Length: 5"), "{head}");
        assert_eq!(body, b"hello");
        assert_eq!(get(&mirror, "/f").1, b"from disk");
        let (head, _) = get(&mirror, "/missing");
        assert!(head.starts_with("HTTP/1.1 404 "), "{head}");
        assert_eq!(mirror.requests("/a"), 1);
        assert_eq!(mirror.total_requests(), 3);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_route_with_a_query_wins_and_carries_its_headers() {
        let mirror = MirrorServer::start().unwrap();
        mirror.serve("/v", &b"any"[..]);
        mirror.serve_with_headers("/v?a=1", &b"exact"[..], &[("X-Chain", "a%20b")]);
        let (head, body) = get(&mirror, "/v?a=1");
        assert_eq!(body, b"exact");
        assert!(head.contains("X-Chain: a%20b"), "{head}");
        assert_eq!(get(&mirror, "/v?a=2").1, b"any");
        assert_eq!(get(&mirror, "/v").1, b"any");
    }

    #[test]
    fn injects_statuses_then_recovers() {
        let mirror = MirrorServer::start().unwrap();
        mirror.serve("/a", &b"ok"[..]);
        mirror.fail_next("/a", Fault::Status(503), 2);
        assert!(get(&mirror, "/a").0.starts_with("HTTP/1.1 503 "));
        assert!(get(&mirror, "/a").0.starts_with("HTTP/1.1 503 "));
        assert_eq!(get(&mirror, "/a").1, b"ok");
    }

    #[test]
    fn cuts_bodies_of_unannounced_length() {
        let mirror = MirrorServer::start().unwrap();
        mirror.serve("/a", vec![7u8; 10_000]);
        mirror.fail_next("/a", Fault::TruncateUnannounced(100), 1);
        let (head, body) = get(&mirror, "/a");
        assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
        assert!(!head.contains("Content-Length"), "{head}");
        assert_eq!(body, vec![7u8; 100]);
        let (head, body) = get(&mirror, "/a");
        assert!(head.contains("Content-Length: 10000"), "{head}");
        assert_eq!(body.len(), 10_000);
    }

    #[test]
    fn sends_a_prefix_as_a_whole_chunked_body() {
        let mirror = MirrorServer::start().unwrap();
        mirror.serve("/a", vec![7u8; 10_000]);
        mirror.fail_always("/a", Fault::ChunkedPrefix(100));
        let (head, body) = get(&mirror, "/a");
        assert!(head.contains("Transfer-Encoding: chunked"), "{head}");
        assert!(!head.contains("Content-Length"), "{head}");
        let expected = [b"64\r\n".as_slice(), &[7u8; 100], b"\r\n0\r\n\r\n"].concat();
        assert_eq!(body, expected);
    }

    #[test]
    fn truncates_bodies_below_their_announced_length() {
        let mirror = MirrorServer::start().unwrap();
        mirror.serve("/a", vec![7u8; 10_000]);
        mirror.fail_always("/a", Fault::Truncate(100));
        let (head, body) = get(&mirror, "/a");
        assert!(head.contains("Content-Length: 10000"), "{head}");
        assert_eq!(body.len(), 100);
    }

    #[test]
    fn hangs_and_stops_when_dropped() {
        let mirror = MirrorServer::start().unwrap();
        mirror.serve("/a", &b"ok"[..]);
        mirror.fail_always("/a", Fault::Hang);
        let addr = mirror.addr();
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        stream.write_all(b"GET /a HTTP/1.1\r\n\r\n").unwrap();
        let mut buf = [0u8; 16];
        let err = stream.read(&mut buf).unwrap_err();
        assert!(matches!(
            err.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ));
        drop(mirror);
        // The hanging connection is closed and nothing listens any more.
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(stream.read(&mut buf).unwrap_or(0), 0);
        assert!(std::net::TcpStream::connect(addr).is_err());
    }
}
