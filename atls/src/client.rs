//! The client side: an aTLS connection to a server, and tonic connectors.
//!
//! Per connection: a fresh nonce goes into the ClientHello's server name; the
//! server's certificate is validated against it; when the server asks for a
//! client certificate, its nonce is read from the CertificateRequest and a
//! fresh attested certificate is made for it. Each connection has its own
//! `ClientConfig`, TLS 1.3 only, with resumption off.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use rustls::client::{ResolvesClientCert, Resumption};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::ServerName;
use rustls::sign::CertifiedKey;
use rustls::{AlertDescription, SignatureScheme};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};
use tonic::transport::{Channel, Endpoint};
use tower::Service;

use crate::attestation::{Attested, DynIssuer, DynValidator};
use crate::cert::CertError;
#[cfg(feature = "danger")]
use crate::danger::PresentFn;
use crate::incoming::ServerWork;
use crate::nonce::{Nonce, NonceError};
use crate::present::Presenter;
use crate::residency::{self, PeerKey, Prover, ResidencyError, Role};
use crate::stream::{self, AtlsStream, CLIENT_ACCEPTED};
use crate::verify::{PeerCheck, PeerError, ServerVerifier};
use crate::{rustls_error, DEFAULT_HANDSHAKE_TIMEOUT};

/// The client side of aTLS: how it checks servers and what it presents.
///
/// `C` is what the server validator establishes (its
/// [`Validator::Claims`](crate::Validator::Claims)); `()` when the server is
/// not validated.
///
/// As a tower `Service<Uri>` it is a connector for
/// `Endpoint::connect_with_connector`: every (re)connection is a full aTLS
/// handshake. Use [`AtlsClient::bind_channel`] when the caller must know
/// which attested server it talks to.
pub struct AtlsClient<C = ()> {
    presenter: Option<Presenter>,
    server_validator: Option<DynValidator<C>>,
    provider: Arc<CryptoProvider>,
    timeout: Duration,
    local_address: Option<IpAddr>,
}

impl<C> Clone for AtlsClient<C> {
    fn clone(&self) -> Self {
        Self {
            presenter: self.presenter.clone(),
            server_validator: self.server_validator.clone(),
            provider: self.provider.clone(),
            timeout: self.timeout,
            local_address: self.local_address,
        }
    }
}

impl<C> std::fmt::Debug for AtlsClient<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtlsClient")
            .field("attests", &self.presenter.is_some())
            .field("validates_server", &self.server_validator.is_some())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl<C: Send + Sync + 'static> AtlsClient<C> {
    /// Server-attested mode: the server is validated with `validator`; this
    /// client does not attest (e.g. an operator's machine without a TPM).
    pub fn server_attested(validator: DynValidator<C>) -> Self {
        Self::new(None, Some(validator))
    }

    /// Client-attested mode: this client attests with `issuer`; the server is
    /// **not** validated (its handshake signature still is, but any key is
    /// accepted).
    pub fn client_attested(issuer: DynIssuer) -> Self {
        Self::new(Some(Presenter::Attest(issuer)), None)
    }

    /// Mutual mode: the server is validated with `validator` and this client
    /// attests with `issuer`.
    pub fn mutual(issuer: DynIssuer, validator: DynValidator<C>) -> Self {
        Self::new(Some(Presenter::Attest(issuer)), Some(validator))
    }

    fn new(presenter: Option<Presenter>, server_validator: Option<DynValidator<C>>) -> Self {
        Self {
            presenter,
            server_validator,
            provider: crate::provider(),
            timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            local_address: None,
        }
    }

    /// Connects from `address` (the local end of every connection), e.g.
    /// on a node with several addresses. Servers bound the handshakes per
    /// source address, so a benchmark that stands in for many nodes on one
    /// machine gives each its own loopback address.
    pub fn with_local_address(mut self, address: IpAddr) -> Self {
        self.local_address = Some(address);
        self
    }

    /// Bounds each connection, from the TCP connect to the validated
    /// connection (default 10 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Replaces how this client makes its certificate: for tests that need a
    /// misbehaving client. See [`crate::danger`].
    #[cfg(feature = "danger")]
    pub fn danger_present_with(mut self, present: PresentFn) -> Self {
        let prover = self.presenter.as_ref().and_then(Presenter::prover);
        self.presenter = Some(Presenter::Custom(present, prover));
        self
    }

    /// Connects to `host:port` and runs the aTLS handshake.
    pub async fn connect(&self, host: &str, port: u16) -> Result<AtlsStream<C>, ConnectError> {
        tokio::time::timeout(self.timeout, async {
            let tcp = match self.local_address {
                None => TcpStream::connect((host, port)).await,
                Some(local) => connect_from(local, host, port).await,
            }
            .map_err(ConnectError::Tcp)?;
            self.handshake(tcp).await
        })
        .await
        .map_err(|_| ConnectError::Timeout(self.timeout))?
    }

    /// Connects to the host and port of `uri`.
    pub async fn connect_uri(&self, uri: &Uri) -> Result<AtlsStream<C>, ConnectError> {
        let (Some(host), Some(port)) = (uri.host(), uri.port_u16()) else {
            return Err(ConnectError::Uri(uri.to_string()));
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.connect(host, port).await
    }

    /// Makes one aTLS connection to `endpoint` and a gRPC channel bound to it:
    /// the returned attestation is the one of the server every call on the
    /// channel reaches. The channel does not reconnect: once the connection
    /// is lost, calls fail and a new channel must be bound (and the new
    /// server's attestation checked again by the caller).
    pub async fn bind_channel(&self, endpoint: Endpoint) -> Result<BoundChannel<C>, ConnectError> {
        let stream = self.connect_uri(endpoint.uri()).await?;
        let attested = stream.peer().attested().cloned();
        let connector = OnceConnector(Arc::new(Mutex::new(Some(stream))));
        let channel = endpoint
            .connect_with_connector(connector)
            .await
            .map_err(ConnectError::Channel)?;
        Ok(BoundChannel { channel, attested })
    }

    /// Runs the aTLS handshake on a connected socket, without a bound of
    /// its own: [`AtlsClient::connect`], its one caller, runs it within the
    /// client's timeout.
    async fn handshake(&self, tcp: TcpStream) -> Result<AtlsStream<C>, ConnectError> {
        tcp.set_nodelay(true).map_err(ConnectError::Tcp)?;
        let remote_addr = tcp.peer_addr().ok();
        let rng = self.provider.secure_random;
        let nonce = Nonce::generate(rng).map_err(ConnectError::Nonce)?;
        let check = match &self.server_validator {
            Some(validator) => Some(Arc::new(PeerCheck::new(validator.clone(), nonce))),
            None => None,
        };
        let resolver = Arc::new(ClientResolver {
            presenter: self.presenter.clone(),
            requested: AtomicBool::new(false),
            failure: Mutex::new(None),
        });
        let config = self.config(check.clone(), resolver.clone())?;
        let server_name = ServerName::try_from(nonce.to_server_name())
            .map_err(|_| ConnectError::Nonce(NonceError::ServerNameShape))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));

        let handshake = connector.connect(server_name, tcp).await;
        if let Some(failure) = resolver.take_failure() {
            return Err(failure);
        }
        let server_outcome = check.as_ref().and_then(|c| c.take());
        let mut tls = match handshake {
            Ok(tls) => tls,
            Err(e) => {
                return Err(match server_outcome {
                    Some(Err(reason)) => ConnectError::ServerRefused(reason),
                    _ => classify(e),
                })
            }
        };
        let attested = match (&check, server_outcome) {
            (None, _) => Ok(None),
            (Some(_), Some(Ok(attested))) => Ok(Some(attested)),
            (Some(_), Some(Err(reason))) => Err(ConnectError::ServerRefused(reason)),
            (Some(_), None) => Err(ConnectError::ServerNotChecked),
        };
        let requested = resolver.requested.load(Ordering::SeqCst);
        if requested && self.presenter.is_none() {
            return Err(ConnectError::AttestationRequired);
        }
        // Wait for the server's verdict on this client's attestation, also
        // when this client refuses the server (deferred refusal): then the
        // server has judged this client before the connection closes.
        let verdict = if requested {
            read_verdict(&mut tls).await
        } else {
            Ok(())
        };
        let attested = attested?;
        verdict?;
        // Nothing is sent before the server's attestation key is proven to
        // be in its TPM (and this client's in its own, when it attests).
        let exporter = residency::export(&**tls.get_ref().1).map_err(ConnectError::Residency)?;
        let mut tls = stream::buffered(tls);
        let peer = match (&check, &attested) {
            (Some(check), Some(attested)) => Some(PeerKey {
                validator: check.validator(),
                claims: attested.claims(),
            }),
            _ => None,
        };
        let prover = self
            .presenter
            .as_ref()
            .and_then(Presenter::prover)
            .map(|issuer| Prover {
                issuer,
                gate: None,
                work: ServerWork::default(),
            });
        residency::exchange(&mut tls, &exporter, Role::Client, prover, peer)
            .await
            .map_err(ConnectError::Residency)?;
        Ok(AtlsStream::new(tls, remote_addr, attested))
    }

    fn config(
        &self,
        check: Option<Arc<PeerCheck<C>>>,
        resolver: Arc<ClientResolver>,
    ) -> Result<rustls::ClientConfig, ConnectError> {
        // In mutual mode a refused server still gets this client's
        // attestation (it is no secret), so both logs name their reasons;
        // no request is ever sent on such a connection.
        let verifier = ServerVerifier::new(self.provider.clone(), check, self.presenter.is_some());
        let mut config = rustls::ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(ConnectError::Config)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_cert_resolver(resolver);
        config.resumption = Resumption::disabled();
        Ok(config)
    }
}

/// Reads the server's one-byte verdict on this client's attestation.
async fn read_verdict<S: tokio::io::AsyncRead + Unpin>(tls: &mut S) -> Result<(), ConnectError> {
    let mut verdict = [0u8; 1];
    match tls.read_exact(&mut verdict).await {
        Ok(_) if verdict[0] == CLIENT_ACCEPTED => Ok(()),
        Ok(_) => Err(ConnectError::Confirmation),
        Err(e) => Err(match rustls_error(&e) {
            Some(rustls::Error::AlertReceived(alert)) => ConnectError::RefusedByServer(*alert),
            _ if e.kind() == io::ErrorKind::UnexpectedEof => ConnectError::ClosedByServer,
            _ => ConnectError::Tls(e),
        }),
    }
}

fn classify(e: io::Error) -> ConnectError {
    match rustls_error(&e) {
        Some(rustls::Error::AlertReceived(alert)) => ConnectError::RefusedByServer(*alert),
        _ => ConnectError::Tls(e),
    }
}

/// The client certificate source for one handshake: it reads the server's
/// nonce from the CertificateRequest and makes the attested certificate.
struct ClientResolver {
    presenter: Option<Presenter>,
    /// Whether the server asked for a client certificate.
    requested: AtomicBool,
    failure: Mutex<Option<ConnectError>>,
}

impl ClientResolver {
    fn take_failure(&self) -> Option<ConnectError> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn fail(&self, error: ConnectError) -> Option<Arc<CertifiedKey>> {
        *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(error);
        None
    }
}

impl std::fmt::Debug for ClientResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientResolver")
            .field("attests", &self.presenter.is_some())
            .finish_non_exhaustive()
    }
}

impl ResolvesClientCert for ClientResolver {
    fn resolve(
        &self,
        root_hint_subjects: &[&[u8]],
        sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.requested.store(true, Ordering::SeqCst);
        let presenter = self.presenter.as_ref()?;
        if !sigschemes.contains(&SignatureScheme::ECDSA_NISTP256_SHA256) {
            return self.fail(ConnectError::SignatureSchemes);
        }
        let nonce = match Nonce::from_distinguished_names(root_hint_subjects) {
            Ok(nonce) => nonce,
            Err(e) => return self.fail(ConnectError::ServerNonce(e)),
        };
        match crate::blocking::run(|| presenter.present(&nonce)) {
            Ok(certified) => Some(certified),
            Err(e) => self.fail(ConnectError::Certificate(e)),
        }
    }

    fn has_certs(&self) -> bool {
        // Also when not attesting: the resolver must run to notice that the
        // server requires attestation.
        true
    }
}

/// A gRPC channel over one aTLS connection, and the attestation of the server
/// at its other end.
#[derive(Debug)]
pub struct BoundChannel<C> {
    /// The channel; it fails once its connection is gone.
    pub channel: Channel,
    /// The server's validated attestation (`None` when this client does not
    /// validate servers).
    pub attested: Option<Arc<Attested<C>>>,
}

/// A connector that yields one already established connection, once.
struct OnceConnector<C>(Arc<Mutex<Option<AtlsStream<C>>>>);

impl<C: Send + Sync + 'static> Service<Uri> for OnceConnector<C> {
    type Response = TokioIo<AtlsStream<C>>;
    type Error = ConnectError;
    type Future = std::future::Ready<Result<Self::Response, ConnectError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let stream = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        std::future::ready(
            stream
                .map(TokioIo::new)
                .ok_or(ConnectError::ChannelConnectionGone),
        )
    }
}

impl<C: Send + Sync + 'static> Service<Uri> for AtlsClient<C> {
    type Response = TokioIo<AtlsStream<C>>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ConnectError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let client = self.clone();
        Box::pin(async move {
            match client.connect_uri(&uri).await {
                Ok(stream) => Ok(TokioIo::new(stream)),
                Err(e) => {
                    tracing::warn!(%uri, error = %crate::ErrorChain(&e), "aTLS connection failed");
                    Err(e)
                }
            }
        })
    }
}

/// Why a client-side aTLS connection failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URI has no host or port.
    #[error("the URI {0} names no host and port")]
    Uri(String),
    /// Connecting the TCP socket failed.
    #[error("connecting to the server failed")]
    Tcp(#[source] io::Error),
    /// The connection took longer than the configured bound.
    #[error("the aTLS connection did not finish within {0:?}")]
    Timeout(Duration),
    /// Making this client's nonce failed.
    #[error("making the client nonce failed")]
    Nonce(#[source] NonceError),
    /// Building the connection's TLS configuration failed.
    #[error("building the TLS configuration failed")]
    Config(#[source] rustls::Error),
    /// The server's certificate or attestation was refused.
    #[error("the server's attestation was refused")]
    ServerRefused(#[source] PeerError),
    /// The handshake finished without the server verifier having run; never
    /// expected, and refused.
    #[error("the handshake finished but the server's certificate was not checked")]
    ServerNotChecked,
    /// The server asked for a client certificate without a usable nonce.
    #[error("reading the server's nonce failed")]
    ServerNonce(#[source] NonceError),
    /// The server does not accept ECDSA P-256 client signatures.
    #[error("the server does not accept ECDSA P-256 SHA-256 client signatures")]
    SignatureSchemes,
    /// Making this client's attested certificate failed.
    #[error("making the client certificate failed")]
    Certificate(#[source] CertError),
    /// The server requires client attestation and this client does not attest.
    #[error("the server requires client attestation, but this client does not attest")]
    AttestationRequired,
    /// The server refused this client, typically its attestation; the
    /// server's log has the reason.
    #[error("the server refused this client (TLS alert {0:?}); the server's log has the reason")]
    RefusedByServer(AlertDescription),
    /// The server closed the connection instead of confirming this client's
    /// attestation.
    #[error("the server closed the connection instead of accepting this client's attestation; the server's log has the reason")]
    ClosedByServer,
    /// The server's first byte is not the expected confirmation.
    #[error("the server sent an unexpected confirmation of this client's attestation")]
    Confirmation,
    /// Any other TLS failure.
    #[error("the TLS handshake failed")]
    Tls(#[source] io::Error),
    /// Building the gRPC channel failed.
    #[error("building the gRPC channel failed")]
    Channel(#[source] tonic::transport::Error),
    /// The key residency exchange failed: the server's attestation key is
    /// not proven to be in its TPM, the server refused this client's
    /// proof, or the server was busy ([`ConnectError::is_busy`]).
    #[error("key residency")]
    Residency(#[source] ResidencyError),
    /// A bound channel tried to reconnect.
    #[error("the bound channel's aTLS connection is gone; bind a new channel")]
    ChannelConnectionGone,
}

impl ConnectError {
    /// Whether the server was not reachable (yet): the connection was
    /// refused, reset or closed before any attestation was exchanged, or did
    /// not finish in time. Worth retrying while a node boots; a refused
    /// attestation never is.
    pub fn is_unreachable(&self) -> bool {
        match self {
            Self::Tcp(_) | Self::Timeout(_) => true,
            Self::Tls(e) => matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }

    /// Whether the server was busy: it would answer this client's key
    /// residency challenge but answers no more for a while, having answered
    /// as many as it does lately ([`ResidencyError::Busy`]). Worth trying
    /// again after a pause (the same address keeps its turn at the server
    /// for a while); it says nothing against the server's attestation.
    pub fn is_busy(&self) -> bool {
        matches!(self, Self::Residency(ResidencyError::Busy))
    }

    /// Whether the TCP connection was refused at once, before the server
    /// did any work: no route to it yet (this host's network is not up),
    /// or nothing listening on the port (its server has not started).
    /// Retrying such a failure soon costs neither side more than a packet;
    /// a timeout, by contrast, may be an overloaded server.
    pub fn is_refused_at_once(&self) -> bool {
        match self {
            Self::Tcp(e) => matches!(
                e.kind(),
                io::ErrorKind::NetworkUnreachable
                    | io::ErrorKind::HostUnreachable
                    | io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::AddrNotAvailable
            ),
            _ => false,
        }
    }
}

/// Connects to `host:port` from `local`, trying each address of `host` of
/// the same family.
async fn connect_from(local: IpAddr, host: &str, port: u16) -> std::io::Result<TcpStream> {
    let mut last = None;
    for remote in tokio::net::lookup_host((host, port)).await? {
        if remote.is_ipv4() != local.is_ipv4() {
            continue;
        }
        let socket = if local.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.bind(SocketAddr::new(local, 0))?;
        match socket.connect(remote).await {
            Ok(tcp) => return Ok(tcp),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            "no address of the host's family",
        )
    }))
}
