//! A small but genuine attestation scheme for testing the transport, and a
//! gRPC service to call over it.
//!
//! Document: `nonce (32) || user_data (32) || Ed25519 signature (64)` over
//! `"keel-atls-test" || nonce || user_data`. The validator trusts one public
//! key and checks the signature, the nonce and the key binding, in that order.
//!
//! Key residency stands in for a TPM's credential activation: the issuer
//! holds a residency key (its "TPM") that the validator knows belongs to the
//! trusted signer; a challenge is 32 random bytes and its secret their
//! HMAC-SHA256 under that key. An issuer with the right signing key but
//! another residency key signs valid documents and fails the challenge, as a
//! software attestation key next to a copied EK certificate does.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use keel_atls::{
    AtlsClient, AtlsServer, AtlsStream, Challenge, ConnectError, DynIssuer, DynValidator,
    HandshakeError, IssueError, Issuer, PeerInfo, ResidencySecret, ValidationError, Validator,
};
use keel_proto::kms::key_service_client::KeyServiceClient;
use keel_proto::kms::key_service_server::{KeyService, KeyServiceServer};
use keel_proto::kms::{GetDataKeyRequest, GetDataKeyResponse};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use tokio::net::TcpListener;
use tonic::transport::{Endpoint, Server};

const CONTEXT: &[u8] = b"keel-atls-test";
const DOC_LEN: usize = 32 + 32 + 64;

/// An issuer holding an Ed25519 key; it records every document it issues.
pub struct TestIssuer {
    key: Ed25519KeyPair,
    pkcs8: Vec<u8>,
    residency_key: [u8; 32],
    pub issued: Mutex<Vec<Vec<u8>>>,
    pub answered: AtomicUsize,
}

fn random32() -> [u8; 32] {
    let mut out = [0u8; 32];
    SystemRandom::new().fill(&mut out).unwrap();
    out
}

impl TestIssuer {
    pub fn generate() -> Arc<Self> {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).unwrap();
        Self::from_parts(pkcs8.as_ref().to_vec(), random32())
    }

    fn from_parts(pkcs8: Vec<u8>, residency_key: [u8; 32]) -> Arc<Self> {
        Arc::new(Self {
            key: Ed25519KeyPair::from_pkcs8(&pkcs8).unwrap(),
            pkcs8,
            residency_key,
            issued: Mutex::new(Vec::new()),
            answered: AtomicUsize::new(0),
        })
    }

    /// An issuer whose documents carry this issuer's signature but whose key
    /// lives elsewhere: it cannot answer residency challenges made for this
    /// issuer (a software key next to a copied EK certificate).
    pub fn impostor(&self) -> Arc<Self> {
        Self::from_parts(self.pkcs8.clone(), random32())
    }

    pub fn public_key(&self) -> Vec<u8> {
        self.key.public_key().as_ref().to_vec()
    }

    pub fn residency_key(&self) -> [u8; 32] {
        self.residency_key
    }

    /// A validator that trusts this issuer.
    pub fn validator(&self) -> TestValidator {
        TestValidator::new(self.public_key(), self.residency_key)
    }

    pub fn answered_count(&self) -> usize {
        self.answered.load(Ordering::SeqCst)
    }

    pub fn last_issued(&self) -> Vec<u8> {
        self.issued
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("a document was issued")
    }

    pub fn issued_count(&self) -> usize {
        self.issued.lock().unwrap().len()
    }

    /// A document for explicit inputs (to craft stale or moved documents).
    pub fn document(&self, nonce: &[u8], user_data: &[u8]) -> Vec<u8> {
        let mut doc = Vec::with_capacity(DOC_LEN);
        doc.extend_from_slice(nonce);
        doc.extend_from_slice(user_data);
        let mut message = CONTEXT.to_vec();
        message.extend_from_slice(nonce);
        message.extend_from_slice(user_data);
        doc.extend_from_slice(self.key.sign(&message).as_ref());
        doc
    }
}

impl Issuer for TestIssuer {
    fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, IssueError> {
        if nonce.len() != 32 || user_data.len() != 32 {
            return Err(IssueError::new("nonce and user data must be 32 bytes"));
        }
        let doc = self.document(nonce, user_data);
        self.issued.lock().unwrap().push(doc.clone());
        Ok(doc)
    }

    fn answer(&self, challenge: &[u8]) -> Result<ResidencySecret, IssueError> {
        self.answered.fetch_add(1, Ordering::SeqCst);
        if challenge.len() != 32 {
            return Err(IssueError::new("a test challenge is 32 bytes"));
        }
        Ok(residency_secret(&self.residency_key, challenge))
    }
}

fn residency_secret(key: &[u8; 32], challenge: &[u8]) -> ResidencySecret {
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), challenge);
    let mut out = zeroize::Zeroizing::new([0u8; 32]);
    out.copy_from_slice(tag.as_ref());
    out
}

/// What the test validator establishes: who signed, and which validator
/// generation accepted it (to observe swaps).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestClaims {
    pub signer: Vec<u8>,
    pub generation: u32,
}

/// Trusts one Ed25519 public key whose residency key it knows; counts its
/// validations and challenges, and remembers proven keys.
pub struct TestValidator {
    trusted: Vec<u8>,
    residency_key: [u8; 32],
    generation: u32,
    pub validations: Arc<AtomicUsize>,
    pub challenges: Arc<AtomicUsize>,
    proven: Arc<Mutex<HashSet<Vec<u8>>>>,
    remember: bool,
    /// Run by each validation before it returns.
    on_validate: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl TestValidator {
    pub fn new(trusted: Vec<u8>, residency_key: [u8; 32]) -> Self {
        Self {
            trusted,
            residency_key,
            generation: 0,
            validations: Arc::new(AtomicUsize::new(0)),
            challenges: Arc::new(AtomicUsize::new(0)),
            proven: Arc::default(),
            remember: true,
            on_validate: None,
        }
    }

    /// Runs `hook` in each validation, before it returns.
    pub fn on_validate(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_validate = Some(Arc::new(hook));
        self
    }

    /// Challenges every handshake, proven before or not.
    pub fn forgetful(mut self) -> Self {
        self.remember = false;
        self
    }

    pub fn challenge_count(&self) -> usize {
        self.challenges.load(Ordering::SeqCst)
    }

    pub fn generation(mut self, generation: u32) -> Self {
        self.generation = generation;
        self
    }

    pub fn count(&self) -> usize {
        self.validations.load(Ordering::SeqCst)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Reason(&'static str);

impl Validator for TestValidator {
    type Claims = TestClaims;

    fn validate(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<TestClaims, ValidationError> {
        self.validations.fetch_add(1, Ordering::SeqCst);
        if document.len() != DOC_LEN {
            return Err(ValidationError::malformed(Reason("document length")));
        }
        let (doc_nonce, rest) = document.split_at(32);
        let (doc_user_data, signature) = rest.split_at(32);
        let mut message = CONTEXT.to_vec();
        message.extend_from_slice(doc_nonce);
        message.extend_from_slice(doc_user_data);
        UnparsedPublicKey::new(&ED25519, &self.trusted)
            .verify(&message, signature)
            .map_err(|_| {
                ValidationError::rejected(Reason("signature is not by the trusted key"))
            })?;
        if doc_nonce != nonce {
            return Err(ValidationError::NonceMismatch);
        }
        if doc_user_data != user_data {
            return Err(ValidationError::KeyBindingMismatch);
        }
        if let Some(hook) = &self.on_validate {
            hook();
        }
        Ok(TestClaims {
            signer: self.trusted.clone(),
            generation: self.generation,
        })
    }

    fn residency_challenge(
        &self,
        claims: &TestClaims,
    ) -> Result<Option<Challenge>, ValidationError> {
        if self.remember && self.proven.lock().unwrap().contains(&claims.signer) {
            return Ok(None);
        }
        self.challenges.fetch_add(1, Ordering::SeqCst);
        let message = random32();
        let secret = residency_secret(&self.residency_key, &message);
        Ok(Some(Challenge::new(message.to_vec(), secret)))
    }

    fn residency_proven(&self, claims: &TestClaims) {
        if self.remember {
            self.proven.lock().unwrap().insert(claims.signer.clone());
        }
    }
}

pub fn dyn_issuer(issuer: &Arc<TestIssuer>) -> DynIssuer {
    issuer.clone()
}

pub fn dyn_validator<V: Validator<Claims = TestClaims>>(v: V) -> DynValidator<TestClaims> {
    Arc::new(v)
}

/// A mutual-mode server that attests with `issuer` and accepts documents
/// signed by `trusted` only.
pub fn mutual_server(issuer: &Arc<TestIssuer>, trusted: &TestIssuer) -> AtlsServer<TestClaims> {
    AtlsServer::mutual(dyn_issuer(issuer), dyn_validator(trusted.validator()))
}

/// A mutual-mode client that attests with `issuer` and accepts documents
/// signed by `trusted` only.
pub fn mutual_client(issuer: &Arc<TestIssuer>, trusted: &TestIssuer) -> AtlsClient<TestClaims> {
    AtlsClient::mutual(dyn_issuer(issuer), dyn_validator(trusted.validator()))
}

/// One handshake on 127.0.0.1 between `server` and `client`, without an
/// accept loop: both outcomes.
pub async fn handshake<S: Send + Sync + 'static, C: Send + Sync + 'static>(
    server: &AtlsServer<S>,
    client: &AtlsClient<C>,
) -> (
    Result<AtlsStream<S>, HandshakeError>,
    Result<AtlsStream<C>, ConnectError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server_side = async {
        let (tcp, _) = listener.accept().await.unwrap();
        server.accept(tcp).await
    };
    tokio::join!(server_side, client.connect("127.0.0.1", port))
}

/// The key service answers with the attestation document the client
/// presented (empty when the server does not validate clients), so tests see
/// what handlers see. A request for the key `vouch` vouches for its
/// connection ([`PeerInfo::vouch`]).
pub struct EchoPeer;

#[tonic::async_trait]
impl KeyService for EchoPeer {
    async fn get_data_key(
        &self,
        request: tonic::Request<GetDataKeyRequest>,
    ) -> Result<tonic::Response<GetDataKeyResponse>, tonic::Status> {
        let peer = request
            .extensions()
            .get::<PeerInfo<TestClaims>>()
            .ok_or_else(|| tonic::Status::internal("no aTLS peer info"))?;
        if request.get_ref().data_key_id == "vouch" {
            peer.vouch();
        }
        let data_key = peer
            .attested()
            .map(|a| a.document().to_vec())
            .unwrap_or_default();
        Ok(tonic::Response::new(GetDataKeyResponse { data_key }))
    }
}

/// A running gRPC server over aTLS on 127.0.0.1.
pub struct TestServer {
    pub addr: std::net::SocketAddr,
    pub stats: Arc<keel_atls::HandshakeStats>,
    task: tokio::task::JoinHandle<()>,
}

impl TestServer {
    pub async fn start(server: AtlsServer<TestClaims>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = server.incoming(listener);
        let stats = incoming.stats();
        let task = tokio::spawn(async move {
            Server::builder()
                .add_service(KeyServiceServer::new(EchoPeer))
                .serve_with_incoming(incoming)
                .await
                .unwrap();
        });
        Self { addr, stats, task }
    }

    pub fn endpoint(&self) -> Endpoint {
        Endpoint::from_shared(format!("http://{}", self.addr)).unwrap()
    }

    /// Waits until the server finished `n` handshakes (accepted or refused).
    pub async fn wait_for_handshakes(&self, n: u64) {
        for _ in 0..500 {
            if self.stats.accepted() + self.stats.refused() >= n {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("server did not finish {n} handshakes");
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One unary call over a channel bound to one aTLS connection; returns the
/// server's answer (the document the server saw from this client).
pub async fn call(
    client: &AtlsClient<TestClaims>,
    server: &TestServer,
) -> Result<(Vec<u8>, Option<Arc<keel_atls::Attested<TestClaims>>>), ConnectError> {
    let bound = client.bind_channel(server.endpoint()).await?;
    let response = KeyServiceClient::new(bound.channel)
        .get_data_key(GetDataKeyRequest {
            data_key_id: "disk".into(),
            length: 32,
        })
        .await
        .expect("the call over a validated connection succeeds");
    Ok((response.into_inner().data_key, bound.attested))
}

/// Logs to the test output (shown for failing tests).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("keel_atls=debug")
        .try_init();
}
