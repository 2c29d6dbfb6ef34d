//! aTLS with TPM attestation: every party has its own swtpm, documents are
//! real quotes, validation is the agent's validator, TLS is real rustls over
//! loopback, and a gRPC call runs over the result.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::attestation::policy::ReloadableValidator;
use keel_agent::measured::MeasuredTpm;
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_atls::{
    AtlsClient, AtlsServer, ConnectError, DynIssuer, ErrorChain, IssueError, Issuer, PeerInfo,
};
use keel_proto::attestation::AttestationDocument;
use keel_proto::kms::key_service_client::KeyServiceClient;
use keel_proto::kms::key_service_server::{KeyService, KeyServiceServer};
use keel_proto::kms::{GetDataKeyRequest, GetDataKeyResponse};
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::ek::EkTrust;
use keel_verifier::measurement::EventType;
use keel_verifier::measurements::{Expected, Measurements};
use keel_verifier::validator::Verified;
use prost::Message;
use tokio::net::TcpListener;
use tonic::transport::{Endpoint, Server};

const CONFIG: &[u8] =
    br#"{"cluster":{"control_plane_endpoints":["127.0.0.1:9090"]},"node":{"name":"n"}}"#;

/// A node: its swtpm, measured config and issuer.
struct Node {
    issuer: Arc<TpmIssuer>,
    _dir: tempfile::TempDir,
    _swtpm: Swtpm,
}

fn node(ca: &EkCa) -> Node {
    let swtpm = Swtpm::start(ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let mut measured = MeasuredTpm::open(tpm, &dir.path().join("log")).unwrap();
    let config = NodeConfig::parse(CONFIG, "c".as_ref()).unwrap();
    measured
        .record(EventType::NodeConfig, "config", config.cluster_bytes())
        .unwrap();
    measured
        .record(EventType::NodeIdentity, "node", config.node_bytes())
        .unwrap();
    Node {
        _swtpm: swtpm,
        _dir: dir,
        issuer: Arc::new(TpmIssuer::new(measured.shared())),
    }
}

fn expected_config_pcr() -> [u8; 32] {
    NodeConfig::parse(CONFIG, "c".as_ref())
        .unwrap()
        .expected_config_pcr()
}

/// A verifier's policy file with PCR 12 (and optionally more) expected.
struct Policy {
    _dir: tempfile::TempDir,
    path: PathBuf,
    validator: Arc<ReloadableValidator>,
}

/// Writes the measurements of these swtpm nodes, all enforced: PCRs 4, 9
/// and 11 zero (nothing measures into them there), PCR 12 `pcr12`, PCR 15
/// zero; with `warn13`, PCR 13 expected to be that value, warn-only.
fn write_measurements(path: &PathBuf, pcr12: [u8; 32], warn13: Option<[u8; 32]>) {
    let mut entries = vec![
        (4, Expected::enforced([0; 32])),
        (9, Expected::enforced([0; 32])),
        (11, Expected::enforced([0; 32])),
        (12, Expected::enforced(pcr12)),
        (15, Expected::enforced([0; 32])),
    ];
    entries.extend(warn13.map(|v| (13, Expected::warn_only(v))));
    std::fs::write(path, Measurements::new(entries).unwrap().to_json()).unwrap();
}

fn policy(ca: &EkCa, pcr12: [u8; 32], warn13: Option<[u8; 32]>) -> Policy {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("measurements.json");
    write_measurements(&path, pcr12, warn13);
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let validator = Arc::new(ReloadableValidator::load(&path, trust, Vec::new()).unwrap());
    Policy {
        _dir: dir,
        path,
        validator,
    }
}

/// Answers with the PCR 12 the server saw from the client (empty if none).
struct PeerPcr;

#[tonic::async_trait]
impl KeyService for PeerPcr {
    async fn get_data_key(
        &self,
        request: tonic::Request<GetDataKeyRequest>,
    ) -> Result<tonic::Response<GetDataKeyResponse>, tonic::Status> {
        let peer = request
            .extensions()
            .get::<PeerInfo<Verified>>()
            .ok_or_else(|| tonic::Status::internal("no peer"))?;
        let data_key = peer
            .attested()
            .map(|a| a.claims().pcrs[&12].to_vec())
            .unwrap_or_default();
        Ok(tonic::Response::new(GetDataKeyResponse { data_key }))
    }
}

async fn serve(server: AtlsServer<Verified>) -> (Endpoint, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = server.incoming(listener);
    let task = tokio::spawn(async move {
        let _ = Server::builder()
            .add_service(KeyServiceServer::new(PeerPcr))
            .serve_with_incoming(incoming)
            .await;
    });
    (
        Endpoint::from_shared(format!("http://{addr}")).unwrap(),
        task,
    )
}

async fn call(
    client: &AtlsClient<Verified>,
    endpoint: Endpoint,
) -> Result<(Vec<u8>, Option<Verified>), ConnectError> {
    let bound = client.bind_channel(endpoint).await?;
    let answer = KeyServiceClient::new(bound.channel)
        .get_data_key(GetDataKeyRequest {
            data_key_id: "x".into(),
            length: 32,
        })
        .await
        .unwrap()
        .into_inner()
        .data_key;
    Ok((answer, bound.attested.map(|a| a.claims().clone())))
}

fn chain(e: &ConnectError) -> String {
    ErrorChain(e).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_call_in_each_mode() {
    let ca = EkCa::new().unwrap();
    let server_node = node(&ca);
    let client_node = node(&ca);
    let p = policy(&ca, expected_config_pcr(), None);
    let issuer = |n: &Node| -> DynIssuer { n.issuer.clone() };

    // Server-attested: the client (e.g. the operator CLI) has no TPM.
    let (endpoint, task) = serve(AtlsServer::server_attested(issuer(&server_node))).await;
    let (answer, attested) = call(
        &AtlsClient::server_attested(p.validator.validator()),
        endpoint,
    )
    .await
    .unwrap();
    assert!(answer.is_empty());
    let server = attested.unwrap();
    assert_eq!(server.pcrs[&12], expected_config_pcr());
    assert_eq!(server.events.len(), 2);
    task.abort();

    // Client-attested.
    let (endpoint, task) = serve(AtlsServer::client_attested(p.validator.validator())).await;
    let (answer, attested) = call(&AtlsClient::client_attested(issuer(&client_node)), endpoint)
        .await
        .unwrap();
    assert_eq!(answer, expected_config_pcr());
    assert!(attested.is_none());
    task.abort();

    // Mutual.
    let (endpoint, task) = serve(AtlsServer::mutual(
        issuer(&server_node),
        p.validator.validator(),
    ))
    .await;
    let client = AtlsClient::mutual(issuer(&client_node), p.validator.validator());
    let (answer, attested) = call(&client, endpoint).await.unwrap();
    assert_eq!(answer, expected_config_pcr());
    assert!(attested.is_some());
    task.abort();
}

/// A hostile server-side issuer: does something wrong with the real TPM's documents.
struct Hostile {
    inner: Arc<TpmIssuer>,
    kind: Attack,
    first: Mutex<Option<Vec<u8>>>,
}

#[derive(Clone, Copy)]
enum Attack {
    /// Serves the first document it ever made, for every later handshake.
    Replay,
    /// Binds its documents to another key than the certificate's.
    MoveToOtherKey,
    /// Flips a bit of the quote signature.
    ForgeSignature,
}

impl Issuer for Hostile {
    fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, IssueError> {
        match self.kind {
            Attack::Replay => {
                let mut first = self.first.lock().unwrap();
                if let Some(doc) = first.as_ref() {
                    return Ok(doc.clone());
                }
                let doc = self
                    .inner
                    .issue(nonce, user_data)
                    .map_err(IssueError::new)?;
                *first = Some(doc.clone());
                Ok(doc)
            }
            Attack::MoveToOtherKey => self
                .inner
                .issue(nonce, &[0x42; 32])
                .map_err(IssueError::new),
            Attack::ForgeSignature => {
                let doc = self
                    .inner
                    .issue(nonce, user_data)
                    .map_err(IssueError::new)?;
                let mut doc = AttestationDocument::decode(doc.as_slice()).unwrap();
                let n = doc.signature.len() - 1;
                doc.signature[n] ^= 1;
                Ok(doc.encode_to_vec())
            }
        }
    }

    fn answer(&self, challenge: &[u8]) -> Result<keel_atls::ResidencySecret, IssueError> {
        keel_atls::Issuer::answer(self.inner.as_ref(), challenge)
    }
}

async fn refused_by_client(server_issuer: DynIssuer, client: &AtlsClient<Verified>) -> String {
    let (endpoint, task) = serve(AtlsServer::server_attested(server_issuer)).await;
    let result = call(client, endpoint).await;
    task.abort();
    match result {
        Ok(_) => panic!("the client accepted a hostile server"),
        Err(e) => {
            assert!(matches!(e, ConnectError::ServerRefused(_)), "{}", chain(&e));
            chain(&e)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_or_unexpected_servers_fail_the_handshake() {
    let ca = EkCa::new().unwrap();
    let good = node(&ca);
    let p = policy(&ca, expected_config_pcr(), None);
    let client = AtlsClient::server_attested(p.validator.validator());
    let hostile = |kind| -> DynIssuer {
        Arc::new(Hostile {
            inner: good.issuer.clone(),
            kind,
            first: Mutex::new(None),
        })
    };

    // Replayed document: the first handshake passes, the replay fails on the nonce.
    let replayer = hostile(Attack::Replay);
    let (endpoint, task) = serve(AtlsServer::server_attested(replayer.clone())).await;
    call(&client, endpoint.clone()).await.unwrap();
    let err = call(&client, endpoint).await.unwrap_err();
    task.abort();
    assert!(chain(&err).contains("nonce"), "{}", chain(&err));

    let err = refused_by_client(hostile(Attack::MoveToOtherKey), &client).await;
    assert!(err.contains("key"), "{err}");

    let err = refused_by_client(hostile(Attack::ForgeSignature), &client).await;
    assert!(err.contains("signature does not verify"), "{err}");

    // Enforced PCR mismatch fails and names the PCR; a warn-only mismatch passes.
    let strict = policy(&ca, [7; 32], None);
    let err = refused_by_client(
        good.issuer.clone(),
        &AtlsClient::server_attested(strict.validator.validator()),
    )
    .await;
    assert!(err.contains("PCR 12: expected 0707"), "{err}");
    let lenient = policy(&ca, expected_config_pcr(), Some([7; 32]));
    let (endpoint, task) = serve(AtlsServer::server_attested(good.issuer.clone())).await;
    let (_, attested) = call(
        &AtlsClient::server_attested(lenient.validator.validator()),
        endpoint,
    )
    .await
    .unwrap();
    task.abort();
    assert_eq!(attested.unwrap().warnings[0].pcr, 13);

    // AK not anchored to a trusted EK: a TPM whose EK certificate comes from another CA.
    let stranger = node(&EkCa::new().unwrap());
    let err = refused_by_client(stranger.issuer.clone(), &client).await;
    assert!(err.contains("endorsement key not trusted"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_client_gets_a_clear_error() {
    let ca = EkCa::new().unwrap();
    let server_node = node(&ca);
    let p = policy(&ca, expected_config_pcr(), None);
    let stranger = node(&EkCa::new().unwrap());
    let (endpoint, task) = serve(AtlsServer::mutual(
        server_node.issuer.clone(),
        p.validator.validator(),
    ))
    .await;
    let err = call(
        &AtlsClient::mutual(stranger.issuer.clone(), p.validator.validator()),
        endpoint,
    )
    .await
    .unwrap_err();
    task.abort();
    assert!(
        matches!(
            err,
            ConnectError::RefusedByServer(_) | ConnectError::ClosedByServer
        ),
        "{}",
        chain(&err)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapping_measurements_applies_to_the_next_handshake() {
    let ca = EkCa::new().unwrap();
    let server_node = node(&ca);
    let p = policy(&ca, expected_config_pcr(), None);
    let client = AtlsClient::server_attested(p.validator.validator());
    let (endpoint, task) = serve(AtlsServer::server_attested(server_node.issuer.clone())).await;
    call(&client, endpoint.clone()).await.unwrap();

    // New values: the next handshake is refused.
    write_measurements(&p.path, [9; 32], None);
    p.validator.reload().unwrap();
    let err = call(&client, endpoint.clone()).await.unwrap_err();
    assert!(
        chain(&err).contains("PCR 12: expected 0909"),
        "{}",
        chain(&err)
    );

    // A bad file is rejected; the previous (strict) validator stays.
    std::fs::write(&p.path, br#"{"12": "not hex"}"#).unwrap();
    assert!(p.validator.reload().is_err());
    assert!(call(&client, endpoint.clone()).await.is_err());

    // So is a file that enforces nothing (it would admit this node with
    // warnings only).
    let h = hex::encode(expected_config_pcr());
    let warn =
        |pcr: u32, value: &str| format!(r#""{pcr}": {{"expected": "{value}", "warnOnly": true}}"#);
    let zero = "0".repeat(64);
    let lenient = format!(
        "{{{}, {}, {}, {}}}",
        warn(4, &zero),
        warn(9, &zero),
        warn(11, &zero),
        warn(12, &h)
    );
    std::fs::write(&p.path, lenient).unwrap();
    let err = p.validator.reload().unwrap_err();
    assert!(
        ErrorChain(&err).to_string().contains("enforce no PCR"),
        "{}",
        ErrorChain(&err)
    );
    assert!(call(&client, endpoint.clone()).await.is_err());

    // Back to the right values; then handshakes run while the file flips.
    write_measurements(&p.path, expected_config_pcr(), None);
    p.validator.reload().unwrap();
    call(&client, endpoint.clone()).await.unwrap();

    let mut handshakes = Vec::new();
    for i in 0..8 {
        let client = client.clone();
        let endpoint = endpoint.clone();
        handshakes.push(tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(i * 15)).await;
            call(&client, endpoint).await.map(|_| ())
        }));
    }
    for i in 0..8u8 {
        let value = if i % 2 == 0 {
            [i; 32]
        } else {
            expected_config_pcr()
        };
        write_measurements(&p.path, value, None);
        p.validator.reload().unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    for h in handshakes {
        // Each completes or fails cleanly: no panic, no hang.
        match h.await.unwrap() {
            Ok(()) => {}
            Err(e) => assert!(matches!(e, ConnectError::ServerRefused(_)), "{}", chain(&e)),
        }
    }
    task.abort();
}
