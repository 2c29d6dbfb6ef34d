//! An established aTLS connection and what it knows about its peer.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, BufWriter, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsStream;
use tonic::transport::server::Connected;

use crate::attestation::Attested;
use crate::incoming::{AdmissionSlot, Standing};

/// The byte a server sends as its first application data after it validated
/// the client's attestation. The client waits for it before it sends
/// anything, so a client whose attestation the server refused gets the
/// server's alert at connect time rather than as a broken first request
/// (in TLS 1.3 the client's side of the handshake is complete before the
/// server has checked the client's certificate).
pub(crate) const CLIENT_ACCEPTED: u8 = 0x01;

/// Bytes an aTLS connection collects before they go to TLS: one record's
/// worth of plaintext (RFC 8446, 5.1).
///
/// tokio-rustls seals every write into its own record and sends it at once,
/// each a TCP segment and a wake-up of the peer: the client's HTTP/2
/// preface and its SETTINGS went out as two, as did the server's verdict
/// byte and its first residency frame. Collected until the writer flushes
/// (h2 flushes whenever it has written what it has; the residency exchange
/// flushes each step), each flush is one record. A larger write goes
/// straight through.
const WRITE_BUFFER: usize = 16 * 1024;

/// A TLS connection whose writes are collected until a flush.
pub(crate) type Buffered = BufWriter<TlsStream<TcpStream>>;

/// `tls` with its writes collected until a flush (see [`WRITE_BUFFER`]).
pub(crate) fn buffered(tls: impl Into<TlsStream<TcpStream>>) -> Buffered {
    BufWriter::with_capacity(WRITE_BUFFER, tls.into())
}

/// What an aTLS connection knows about its peer. On the server, tonic puts it
/// into every request's extensions:
/// `request.extensions().get::<PeerInfo<C>>()`.
pub struct PeerInfo<C> {
    remote_addr: Option<SocketAddr>,
    attested: Option<Arc<Attested<C>>>,
    /// What the server's admission knows of the connection (a server's
    /// connection only).
    standing: Option<Arc<Standing>>,
}

impl<C> Clone for PeerInfo<C> {
    fn clone(&self) -> Self {
        Self {
            remote_addr: self.remote_addr,
            attested: self.attested.clone(),
            standing: self.standing.clone(),
        }
    }
}

impl<C> std::fmt::Debug for PeerInfo<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerInfo")
            .field("remote_addr", &self.remote_addr)
            .field("attested", &self.attested.is_some())
            .finish()
    }
}

impl<C> PeerInfo<C> {
    /// The peer's socket address.
    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.remote_addr
    }

    /// The peer's validated attestation; `None` when this side was configured
    /// not to validate the peer.
    pub fn attested(&self) -> Option<&Arc<Attested<C>>> {
        self.attested.as_ref()
    }

    /// Vouches for the peer of this server connection: it proved itself to
    /// the application (say, with the operator's key). A server that makes
    /// room for newcomers ([`crate::AtlsServer::with_eviction`]) never
    /// closes it for one. Once vouched, always vouched.
    pub fn vouch(&self) {
        if let Some(standing) = &self.standing {
            standing.vouch();
        }
    }

    /// Keeps this server connection from being closed for a newcomer
    /// while the guard lives: a request whose number the application
    /// bounds on its own is in flight on it.
    pub fn protect(&self) -> Protected {
        if let Some(standing) = &self.standing {
            standing.protect();
        }
        Protected(self.standing.clone())
    }
}

/// A connection kept from being closed for a newcomer until dropped
/// ([`PeerInfo::protect`]).
#[derive(Debug)]
pub struct Protected(Option<Arc<Standing>>);

impl Drop for Protected {
    fn drop(&mut self) {
        if let Some(standing) = &self.0 {
            standing.unprotect();
        }
    }
}

/// A TLS connection whose handshake passed aTLS checks. What is written
/// reaches the peer when the writer flushes (or fills a record), as with
/// any buffered writer.
pub struct AtlsStream<C> {
    inner: Buffered,
    peer: PeerInfo<C>,
    /// The server's count of this source's open connections, released
    /// when the connection is dropped.
    _held: Option<AdmissionSlot>,
}

impl<C> AtlsStream<C> {
    pub(crate) fn new(
        inner: Buffered,
        remote_addr: Option<SocketAddr>,
        attested: Option<Arc<Attested<C>>>,
    ) -> Self {
        Self {
            inner,
            peer: PeerInfo {
                remote_addr,
                attested,
                standing: None,
            },
            _held: None,
        }
    }

    /// Counts this connection against `held` until it is dropped.
    pub(crate) fn holding(mut self, held: AdmissionSlot) -> Self {
        self.peer.standing = held.standing().cloned();
        self._held = Some(held);
        self
    }

    /// What this connection knows about its peer.
    pub fn peer(&self) -> &PeerInfo<C> {
        &self.peer
    }

    /// Whether the server closed this connection to make room for a
    /// newcomer; if not, the task of `cx` is woken when it does.
    fn evicted(&self, cx: &Context<'_>) -> bool {
        self.peer
            .standing
            .as_ref()
            .is_some_and(|s| s.poll_evicted(cx))
    }
}

impl<C> std::fmt::Debug for AtlsStream<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtlsStream")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl<C: Send + Sync + 'static> Connected for AtlsStream<C> {
    type ConnectInfo = PeerInfo<C>;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.peer.clone()
    }
}

impl<C> AsyncRead for AtlsStream<C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // Closed to make room for a newcomer: the end, as if the peer had
        // closed (the HTTP/2 server then closes the connection).
        if self.evicted(cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

/// The error of a write on a connection closed to make room: a peer that
/// keeps the connection's writes stalled (it reads nothing) would otherwise
/// keep it open, as the HTTP/2 server reads nothing while its writes wait.
fn evicted_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection closed to make room for a newcomer",
    )
}

impl<C> AsyncWrite for AtlsStream<C> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.evicted(cx) {
            return Poll::Ready(Err(evicted_error()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.evicted(cx) {
            return Poll::Ready(Err(evicted_error()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Closed to make room: done, without the close_notify a peer that
        // reads nothing would keep pending.
        if self.evicted(cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.evicted(cx) {
            return Poll::Ready(Err(evicted_error()));
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
