//! The accept loop: aTLS handshakes on a TCP listener, each in its own task,
//! yielding only validated connections, as tonic's
//! `Server::serve_with_incoming` expects.
//!
//! tonic logs and skips a failed connection, so handshakes are run here
//! instead, where a failure can be logged with its reason and counted. At
//! most [`Incoming::MAX_CONCURRENT_HANDSHAKES`] handshakes run at once; more
//! connections wait in the listener's backlog.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio_stream::Stream;

use crate::attestation::ErrorChain;
use crate::server::AtlsServer;
use crate::stream::AtlsStream;

/// Counts of finished server handshakes.
#[derive(Debug, Default)]
pub struct HandshakeStats {
    accepted: AtomicU64,
    refused: AtomicU64,
}

impl HandshakeStats {
    /// Handshakes that produced a validated connection.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Handshakes that failed (each logged with its reason).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// A stream of validated aTLS connections from a listener, for
/// `tonic::transport::Server::serve_with_incoming`. Dropping it stops
/// accepting.
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
    /// How many handshakes run at once.
    pub const MAX_CONCURRENT_HANDSHAKES: usize = 64;

    /// Starts accepting on `listener` with `server`'s configuration.
    pub fn new(server: AtlsServer<C>, listener: TcpListener) -> Self {
        let (tx, connections) = mpsc::channel(Self::MAX_CONCURRENT_HANDSHAKES);
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
    let slots = Arc::new(Semaphore::new(Incoming::<C>::MAX_CONCURRENT_HANDSHAKES));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return; // the semaphore is never closed
        };
        let (tcp, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tracing::warn!(error = %e, "accepting a TCP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let server = server.clone();
        let tx = tx.clone();
        let stats = stats.clone();
        tokio::spawn(async move {
            let _slot = slot;
            match server.accept(tcp).await {
                Ok(stream) => {
                    stats.accepted.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%remote, "aTLS handshake accepted");
                    // Fails only when the server stopped; the connection is dropped.
                    let _ = tx.send(stream).await;
                }
                Err(e) => {
                    stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%remote, error = %ErrorChain(&e), "aTLS handshake refused");
                }
            }
        });
    }
}
