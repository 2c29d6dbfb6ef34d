//! The server side: one aTLS handshake on an accepted TCP connection.
//!
//! Per connection: read the ClientHello ([`LazyConfigAcceptor`]), take the
//! client's nonce from its server name, make a fresh key and a certificate
//! whose document binds that nonce (on a blocking thread: the issuer may talk
//! to a TPM), and build a `ServerConfig` for this connection alone; when the
//! client must attest, the config's client verifier carries a fresh server
//! nonce and validates the client's certificate against it. TLS 1.3 only,
//! no session resumption (a resumed session would skip attestation).
//!
//! Before anything about the client is known it can cost little: the
//! ClientHello has a short budget of its own, and the issuer runs only after
//! a well-formed one, in turns shared fairly between sources (see
//! [`Incoming`](crate::Incoming) for the limits).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::server::{Acceptor, NoServerSessionStorage};
use rustls::sign::SingleCertAndKey;
use rustls::AlertDescription;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::LazyConfigAcceptor;

use crate::attestation::{DynIssuer, DynValidator};
use crate::cert::CertError;
#[cfg(feature = "danger")]
use crate::danger::PresentFn;
use crate::incoming::{IssuerGate, Limits, ServerWork, Source};
use crate::nonce::{Nonce, NonceError};
use crate::present::Presenter;
use crate::residency::{self, PeerKey, Prover, ResidencyError, Role};
use crate::stream::{self, AtlsStream, CLIENT_ACCEPTED};
use crate::verify::{ClientVerifier, PeerCheck, PeerError};
use crate::{rustls_error, DEFAULT_HANDSHAKE_TIMEOUT};

/// The server side of aTLS: what it presents and how it checks clients.
///
/// `C` is what the client validator establishes (its
/// [`Validator::Claims`](crate::Validator::Claims)); `()` when clients are
/// not validated.
pub struct AtlsServer<C = ()> {
    presenter: Presenter,
    client_validator: Option<DynValidator<C>>,
    provider: Arc<CryptoProvider>,
    handshake_timeout: Duration,
    limits: Limits,
    /// Shared by all clones: one queue for the issuer per server.
    issuer_gate: Arc<IssuerGate>,
}

impl<C> Clone for AtlsServer<C> {
    fn clone(&self) -> Self {
        Self {
            presenter: self.presenter.clone(),
            client_validator: self.client_validator.clone(),
            provider: self.provider.clone(),
            handshake_timeout: self.handshake_timeout,
            limits: self.limits,
            issuer_gate: self.issuer_gate.clone(),
        }
    }
}

impl<C> std::fmt::Debug for AtlsServer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtlsServer")
            .field("attests", &matches!(self.presenter, Presenter::Attest(_)))
            .field("validates_clients", &self.client_validator.is_some())
            .field("handshake_timeout", &self.handshake_timeout)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl<C: Send + Sync + 'static> AtlsServer<C> {
    /// Server-attested mode: the server attests with `issuer`; clients are
    /// not asked for a certificate.
    pub fn server_attested(issuer: DynIssuer) -> Self {
        Self::new(Presenter::Attest(issuer), None)
    }

    /// Client-attested mode: clients must attest and are validated with
    /// `validator`; the server presents a certificate without attestation.
    pub fn client_attested(validator: DynValidator<C>) -> Self {
        Self::new(Presenter::Unattested, Some(validator))
    }

    /// Mutual mode: the server attests with `issuer`, clients must attest and
    /// are validated with `validator`.
    pub fn mutual(issuer: DynIssuer, validator: DynValidator<C>) -> Self {
        Self::new(Presenter::Attest(issuer), Some(validator))
    }

    fn new(presenter: Presenter, client_validator: Option<DynValidator<C>>) -> Self {
        let limits = Limits::default();
        let unvalidated = client_validator.is_none();
        Self {
            presenter,
            client_validator,
            provider: crate::provider(),
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            limits,
            issuer_gate: Arc::new(IssuerGate::new(
                limits.issuing_per_source,
                limits.issuing,
                unvalidated,
            )),
        }
    }

    /// Bounds each handshake, from the first byte read to the validated
    /// connection (default 10 s).
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Bounds the time from accepting a connection to its complete
    /// ClientHello, so a silent or trickling socket is dropped early
    /// (default 3 s; the handshake timeout still bounds the whole).
    pub fn with_client_hello_timeout(mut self, timeout: Duration) -> Self {
        self.limits.client_hello_timeout = timeout;
        self
    }

    /// Bounds the handshakes in progress that [`Incoming`](crate::Incoming)
    /// admits: `per_source` for one source (an IPv4 address or an IPv6
    /// /64) once half of `total` is taken, `total` in all (defaults 8 and
    /// 256). A connection over either is closed right after accept (or,
    /// over `total`, waits: [`AtlsServer::with_handshake_eviction`]).
    pub fn with_handshake_limits(mut self, per_source: usize, total: usize) -> Self {
        self.limits.handshakes_per_source = per_source.max(1);
        self.limits.handshakes = total.max(1);
        self
    }

    /// Makes room for newcomers once every handshake place is taken
    /// ([`AtlsServer::with_handshake_limits`]), instead of closing them at
    /// once: a newcomer waits up to `wait` for a place (first come first
    /// served; one waiting per source, at most four per place), and for
    /// each one waiting the oldest handshake in progress is closed once it
    /// is `min_age` old (counted from when it took its place, less its
    /// turns at the issuer: the quote for its certificate and its
    /// residency answer; the wait for a turn counts, but for a validated
    /// client's answer only the wait for its source's share). Handshakes
    /// that stall (a ClientHello, then silence after the server's flight)
    /// then hold a place for `min_age`, not for the handshake timeout, and
    /// cannot keep a newcomer out by taking every place, while those a
    /// slow issuer is serving are not closed for newcomers that would wait
    /// on it too. Keep `min_age` above what a genuine handshake takes
    /// besides its turns, and `wait` at or above `min_age` and under the
    /// clients' timeout.
    pub fn with_handshake_eviction(mut self, min_age: Duration, wait: Duration) -> Self {
        self.limits.handshake_eviction = Some(crate::incoming::Eviction { min_age, wait });
        self
    }

    /// Bounds the connections open at once, from accept until the
    /// application drops them: `per_source` for one source once half of
    /// `total` is taken, `total` in all (defaults 32 and 512). A connection
    /// over either is closed right after accept. Keep `total`, with the
    /// process's other descriptors, under its file descriptor limit.
    pub fn with_connection_limits(mut self, per_source: usize, total: usize) -> Self {
        self.limits.connections_per_source = per_source.max(1);
        self.limits.connections = total.max(1);
        self
    }

    /// Holds each source to its share of open connections
    /// ([`AtlsServer::with_connection_limits`]) at every load, not only
    /// once half are taken: for a port whose clients never come many from
    /// one address (an operator's CLI, one connection per command), where
    /// a source bursting into the free half would leave fewer addresses to
    /// fill the rest.
    pub fn with_connection_share_always(mut self) -> Self {
        self.limits.connection_share_always = true;
        self
    }

    /// Makes room for newcomers once every open-connection place is taken
    /// ([`AtlsServer::with_connection_limits`]), instead of closing them at
    /// once: a newcomer waits up to `wait` for a place (first come first
    /// served; one waiting per source, at most four per place), and for
    /// each one waiting, the oldest connection that the application
    /// neither vouched for ([`crate::PeerInfo::vouch`]) nor protects
    /// ([`crate::PeerInfo::protect`]) is closed, once it is `min_age` old
    /// (counted from the end of its handshake, or from its start while the
    /// handshake lasts, less the server's work on it: its turns at the
    /// issuer, a validated client's sheltered wait for its answer and a
    /// quiet prefix's rate wait). Connections kept
    /// open with requests that prove nothing then cannot keep a newcomer
    /// out; `min_age` leaves a newcomer the time to prove itself before a
    /// burst of connects could close it in turn. Keep `wait` under the
    /// clients' handshake timeout.
    pub fn with_eviction(mut self, min_age: Duration, wait: Duration) -> Self {
        self.limits.eviction = Some(crate::incoming::Eviction { min_age, wait });
        self
    }

    /// Bounds the handshakes that wait for or run the issuer (on a node a
    /// TPM quote): `per_source` for one source, `total` in all (defaults 2
    /// and 8). Further handshakes wait for a turn, first come first served
    /// within a source, within the handshake timeout.
    pub fn with_issuer_limits(mut self, per_source: usize, total: usize) -> Self {
        self.limits.issuing_per_source = per_source.max(1);
        self.limits.issuing = total.max(1);
        self.issuer_gate = Arc::new(IssuerGate::new(
            self.limits.issuing_per_source,
            self.limits.issuing,
            self.client_validator.is_none(),
        ));
        self
    }

    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    /// Replaces how this server makes its certificate: for tests that need a
    /// misbehaving server. See [`crate::danger`].
    #[cfg(feature = "danger")]
    pub fn danger_present_with(mut self, present: PresentFn) -> Self {
        self.presenter = Presenter::Custom(present, self.presenter.prover());
        self
    }

    /// Runs the aTLS handshake on an accepted connection.
    pub async fn accept(&self, tcp: TcpStream) -> Result<AtlsStream<C>, HandshakeError> {
        self.accept_counting(tcp, &ServerWork::default()).await
    }

    /// [`AtlsServer::accept`], telling `work` when this server works on
    /// the handshake (its turns at the issuer and what the issuer makes).
    pub(crate) async fn accept_counting(
        &self,
        tcp: TcpStream,
        work: &ServerWork,
    ) -> Result<AtlsStream<C>, HandshakeError> {
        tokio::time::timeout(self.handshake_timeout, self.handshake(tcp, work))
            .await
            .map_err(|_| HandshakeError::Timeout(self.handshake_timeout))?
    }

    async fn handshake(
        &self,
        tcp: TcpStream,
        work: &ServerWork,
    ) -> Result<AtlsStream<C>, HandshakeError> {
        // Without it each small gRPC message waits for delayed ACKs (~15 ms).
        tcp.set_nodelay(true).map_err(HandshakeError::Socket)?;
        let remote_addr: Option<SocketAddr> = tcp.peer_addr().ok();

        let hello_timeout = self.limits.client_hello_timeout;
        let start = tokio::time::timeout(
            hello_timeout,
            LazyConfigAcceptor::new(Acceptor::default(), tcp),
        )
        .await
        .map_err(|_| HandshakeError::ClientHelloTimeout(hello_timeout))?
        .map_err(HandshakeError::ClientHello)?;
        let client_nonce = start
            .client_hello()
            .server_name()
            .ok_or(NonceError::MissingServerName)
            .and_then(Nonce::from_server_name)
            .map_err(HandshakeError::ClientNonce)?;

        // Only a few handshakes per source wait for the issuer (a TPM quote
        // under the TPM lock), so one source cannot queue ahead of others.
        // The wait for a turn ages the handshake (a flood's own queue must
        // not shelter it from eviction); the turn itself does not.
        let turn = self
            .issuer_gate
            .enter(Source::of(remote_addr))
            .await
            .map_err(|_| HandshakeError::IssuerGateClosed)?;
        let own_work = work.begin();
        let presenter = self.presenter.clone();
        let certified = tokio::task::spawn_blocking(move || {
            // Held until the issuer returns, also if the handshake gave up.
            let _turn = turn;
            presenter.present(&client_nonce)
        })
        .await
        .map_err(HandshakeError::IssuerTask)?
        .map_err(HandshakeError::Certificate)?;
        drop(own_work);

        let check = match &self.client_validator {
            Some(validator) => {
                let nonce = Nonce::generate(self.provider.secure_random)
                    .map_err(HandshakeError::ServerNonce)?;
                Some(Arc::new(PeerCheck::new(validator.clone(), nonce)))
            }
            None => None,
        };
        let config = self.config(certified, check.clone())?;

        let tls = match start.into_stream(Arc::new(config)).await {
            Ok(tls) => tls,
            Err(e) => return Err(classify(e, check.as_deref())),
        };
        let exporter = residency::export(&**tls.get_ref().1).map_err(HandshakeError::Residency)?;
        let mut tls = stream::buffered(tls);
        let attested = match &check {
            Some(check) => {
                let attested = match check.take() {
                    Some(Ok(attested)) => attested,
                    Some(Err(e)) => return Err(HandshakeError::ClientRefused(e)),
                    None => return Err(HandshakeError::ClientNotChecked),
                };
                // Flushed with this side's first residency frame, which
                // the client reads right after it.
                tls.write_all(&[CLIENT_ACCEPTED])
                    .await
                    .map_err(HandshakeError::Confirm)?;
                Some(attested)
            }
            None => None,
        };
        // No connection reaches the application before the client's
        // attestation key is proven to be in its TPM (and, when the client
        // validates this server, this server's key in its own).
        let peer = match (&check, &attested) {
            (Some(check), Some(attested)) => Some(PeerKey {
                validator: check.validator(),
                claims: attested.claims(),
            }),
            _ => None,
        };
        let prover = self.presenter.prover().map(|issuer| Prover {
            issuer,
            gate: Some((self.issuer_gate.clone(), Source::of(remote_addr))),
            work: work.clone(),
        });
        residency::exchange(&mut tls, &exporter, Role::Server, prover, peer)
            .await
            .map_err(HandshakeError::Residency)?;
        Ok(AtlsStream::new(tls, remote_addr, attested))
    }

    fn config(
        &self,
        certified: Arc<rustls::sign::CertifiedKey>,
        check: Option<Arc<PeerCheck<C>>>,
    ) -> Result<rustls::ServerConfig, HandshakeError> {
        let builder = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(HandshakeError::Config)?;
        let builder = match check {
            Some(check) => builder.with_client_cert_verifier(Arc::new(ClientVerifier::new(
                self.provider.clone(),
                check,
            ))),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(Arc::new(SingleCertAndKey::from(certified)));
        config.session_storage = Arc::new(NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
        Ok(config)
    }
}

/// Turns a failed rustls handshake into the most precise reason known.
fn classify<C: Send + Sync + 'static>(
    e: io::Error,
    check: Option<&PeerCheck<C>>,
) -> HandshakeError {
    if let Some(Err(reason)) = check.and_then(PeerCheck::take) {
        return HandshakeError::ClientRefused(reason);
    }
    match rustls_error(&e) {
        Some(rustls::Error::NoCertificatesPresented) => HandshakeError::ClientNotAttested,
        Some(rustls::Error::AlertReceived(alert)) => HandshakeError::RefusedByClient(*alert),
        _ => HandshakeError::Tls(e),
    }
}

/// Why a server-side aTLS handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The handshake took longer than the configured bound.
    #[error("the aTLS handshake did not finish within {0:?}")]
    Timeout(Duration),
    /// Configuring the accepted socket failed.
    #[error("configuring the accepted socket failed")]
    Socket(#[source] io::Error),
    /// The ClientHello was not complete within the configured bound.
    #[error("no complete ClientHello within {0:?}")]
    ClientHelloTimeout(Duration),
    /// Reading the ClientHello failed.
    #[error("reading the ClientHello failed")]
    ClientHello(#[source] io::Error),
    /// The client's nonce is missing or malformed.
    #[error("reading the client's nonce failed")]
    ClientNonce(#[source] NonceError),
    /// Waiting for a turn at the issuer failed; never expected.
    #[error("the issuer queue was closed")]
    IssuerGateClosed,
    /// The blocking task that makes the certificate did not finish.
    #[error("the certificate task failed")]
    IssuerTask(#[source] tokio::task::JoinError),
    /// Making the server's certificate (and its attestation) failed.
    #[error("making the server certificate failed")]
    Certificate(#[source] CertError),
    /// Drawing the server's nonce failed.
    #[error("drawing the server nonce failed")]
    ServerNonce(#[source] NonceError),
    /// Building the connection's TLS configuration failed.
    #[error("building the TLS configuration failed")]
    Config(#[source] rustls::Error),
    /// The client's certificate or attestation was refused.
    #[error("the client's attestation was refused")]
    ClientRefused(#[source] PeerError),
    /// The client sent no certificate, hence no attestation.
    #[error("the client presented no certificate, hence no attestation")]
    ClientNotAttested,
    /// The handshake finished without the client verifier having run; never
    /// expected, and refused.
    #[error("the handshake finished but the client's certificate was not checked")]
    ClientNotChecked,
    /// The client aborted the handshake with an alert, typically because it
    /// refused the server's attestation (its log has the reason).
    #[error("the client refused the handshake (TLS alert {0:?}); the client's log has the reason")]
    RefusedByClient(AlertDescription),
    /// Any other TLS failure.
    #[error("the TLS handshake failed")]
    Tls(#[source] io::Error),
    /// Sending the confirmation that the client was accepted failed.
    #[error("confirming the client's attestation failed")]
    Confirm(#[source] io::Error),
    /// The key residency exchange failed: the client's attestation key is
    /// not proven to be in its TPM, or the client refused this server's
    /// proof.
    #[error("key residency")]
    Residency(#[source] ResidencyError),
}

impl<C: Send + Sync + 'static> AtlsServer<C> {
    /// Accepts aTLS connections on `listener`; see [`Incoming`](crate::Incoming).
    pub fn incoming(self, listener: tokio::net::TcpListener) -> crate::Incoming<C> {
        crate::Incoming::new(self, listener)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn per_connection_config_allows_no_resumption() {
        let server = AtlsServer::<()>::new(Presenter::Unattested, None);
        let certified = crate::cert::unattested().unwrap();
        let config = server.config(certified, None).unwrap();
        assert_eq!(config.send_tls13_tickets, 0);
        assert!(!config.session_storage.can_cache());
        assert_eq!(config.max_early_data_size, 0);
    }
}
