//! A small but genuine attestation scheme for testing the transport, and a
//! gRPC service to call over it.
//!
//! Document: `nonce (32) || user_data (32) || Ed25519 signature (64)` over
//! `"keel-atls-test" || nonce || user_data`. The validator trusts one public
//! key and checks the signature, the nonce and the key binding, in that order.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use keel_atls::{
    AtlsClient, AtlsServer, DynIssuer, DynValidator, IssueError, Issuer, PeerInfo, ValidationError,
    Validator,
};
use keel_proto::kms::key_service_client::KeyServiceClient;
use keel_proto::kms::key_service_server::{KeyService, KeyServiceServer};
use keel_proto::kms::{GetDataKeyRequest, GetDataKeyResponse};
use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use tokio::net::TcpListener;
use tonic::transport::{Endpoint, Server};

const CONTEXT: &[u8] = b"keel-atls-test";
const DOC_LEN: usize = 32 + 32 + 64;

/// An issuer holding an Ed25519 key; it records every document it issues.
pub struct TestIssuer {
    key: Ed25519KeyPair,
    pub issued: Mutex<Vec<Vec<u8>>>,
}

impl TestIssuer {
    pub fn generate() -> Arc<Self> {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).unwrap();
        Arc::new(Self {
            key: Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap(),
            issued: Mutex::new(Vec::new()),
        })
    }

    pub fn public_key(&self) -> Vec<u8> {
        self.key.public_key().as_ref().to_vec()
    }

    /// A validator that trusts this issuer.
    pub fn validator(&self) -> TestValidator {
        TestValidator::new(self.public_key())
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
}

/// What the test validator establishes: who signed, and which validator
/// generation accepted it (to observe swaps).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestClaims {
    pub signer: Vec<u8>,
    pub generation: u32,
}

/// Trusts one Ed25519 public key; counts its validations.
pub struct TestValidator {
    trusted: Vec<u8>,
    generation: u32,
    pub validations: Arc<AtomicUsize>,
}

impl TestValidator {
    pub fn new(trusted: Vec<u8>) -> Self {
        Self {
            trusted,
            generation: 0,
            validations: Arc::new(AtomicUsize::new(0)),
        }
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
        Ok(TestClaims {
            signer: self.trusted.clone(),
            generation: self.generation,
        })
    }
}

pub fn dyn_issuer(issuer: &Arc<TestIssuer>) -> DynIssuer {
    issuer.clone()
}

pub fn dyn_validator<V: Validator<Claims = TestClaims>>(v: V) -> DynValidator<TestClaims> {
    Arc::new(v)
}

/// The key service answers with the attestation document the client
/// presented (empty when the server does not validate clients), so tests see
/// what handlers see.
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
) -> Result<(Vec<u8>, Option<Arc<keel_atls::Attested<TestClaims>>>), keel_atls::ConnectError> {
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
