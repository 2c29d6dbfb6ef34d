//! The attack of the security review, against real swtpm TPMs and real
//! servers: a forger copies a node's public EK certificate, EK, PCR values
//! and event log, and signs quotes with a software P-256 key that claims to
//! be the attestation key. Its documents pass every check a document allows;
//! key residency (credential activation) refuses it before any request, in
//! both directions, even when it relays the challenge to the real node's TPM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use join_common::{free_port, joiner, member, wait_for_port};
use keel_agent::attestation::issuer::TpmIssuer;
use keel_atls::{AtlsClient, AtlsServer, ConnectError, ResidencyError};
use keel_proto::join::join_service_server::{JoinService, JoinServiceServer};
use keel_proto::join::{
    IssueJoinTicketRequest, IssueJoinTicketResponse, IssueRejoinTicketRequest,
    IssueRejoinTicketResponse,
};
use keel_testkit::forgery::SoftwareAk;
use keel_testkit::swtpm::EkCa;
use keel_verifier::ek::EkTrust;
use keel_verifier::validator::Validator;

/// A join service run by the forger: it records every request that reaches it.
#[derive(Default, Clone)]
struct Recorder(Arc<AtomicUsize>);

#[tonic::async_trait]
impl JoinService for Recorder {
    async fn issue_join_ticket(
        &self,
        _request: tonic::Request<IssueJoinTicketRequest>,
    ) -> Result<tonic::Response<IssueJoinTicketResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(tonic::Status::unavailable("a forged service"))
    }

    async fn issue_rejoin_ticket(
        &self,
        _request: tonic::Request<IssueRejoinTicketRequest>,
    ) -> Result<tonic::Response<IssueRejoinTicketResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(tonic::Status::unavailable("a forged service"))
    }
}

/// Serves `recorder` as a join service on `port` over aTLS, presenting the
/// forger's documents.
async fn serve_forged(forger: Arc<SoftwareAk>, recorder: Recorder, port: u16) {
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let incoming = AtlsServer::<()>::server_attested(forger).incoming(listener);
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(JoinServiceServer::new(recorder))
            .serve_with_incoming(incoming)
            .await;
    });
    wait_for_port(addr).await;
}

/// A forger impersonating `real`, relaying challenges to it.
fn forger_of(real: &Arc<TpmIssuer>) -> Arc<SoftwareAk> {
    let genuine = real.issue(&[0; 32], &[0; 32]).unwrap();
    Arc::new(SoftwareAk::new(&genuine, Some(real.clone())).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_software_ak_passes_the_document_checks_but_not_key_residency() {
    let ca = EkCa::new().unwrap();
    let port = free_port();
    let victim = member(&ca, port, "cp-0", "control-plane");
    let real = Arc::new(TpmIssuer::new(victim.tpm.clone()));
    let forger = forger_of(&real);

    // What a document alone can show, the forgery shows: EK certificate,
    // quote signature, nonce and key binding, PCRs, event log replay.
    let measurements = join_common::measurements_of(&victim.tpm, &[4, 9, 11, 12, 15]);
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let validator = Validator::new(measurements, trust);
    let (nonce, user_data) = ([9; 32], [8; 32]);
    let forged = forger.forge(&nonce, &user_data).unwrap();
    let verified = validator
        .validate(&forged, &nonce, &user_data)
        .expect("the forged document passes the document checks");
    let genuine_ak = keel_verifier::tpm_wire::Public::parse(
        &victim.tpm.lock().unwrap().tpm().attestation_key().unwrap(),
    )
    .unwrap();
    assert_ne!(
        verified.ak.name, genuine_ak.name,
        "the AK is the forger's own"
    );

    // Over aTLS the forger is refused before any request: the challenge it
    // relays to the real TPM names the software key, which that TPM does
    // not hold.
    let recorder = Recorder::default();
    serve_forged(forger.clone(), recorder.clone(), port).await;
    let client = AtlsClient::server_attested(Arc::new(validator));
    let e = client
        .connect("127.0.0.1", port)
        .await
        .expect_err("refused");
    assert!(
        matches!(e, ConnectError::Residency(ResidencyError::NoAnswer)),
        "{e:?}"
    );
    assert_eq!(forger.challenges_received(), 1);
    assert_eq!(recorder.0.load(Ordering::SeqCst), 0);

    // The genuine node, same validator, gets through: its AK is in its TPM.
    let genuine_port = free_port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], genuine_port).into();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let server = AtlsServer::<()>::server_attested(real);
    let accept = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        server.accept(tcp).await.map(|_| ())
    });
    let stream = client.connect("127.0.0.1", genuine_port).await.unwrap();
    assert!(stream.peer().attested().is_some());
    accept.await.unwrap().unwrap();

    // The validator now remembers the genuine EK and AK as proven. The
    // forger, with that EK and its own key, is challenged again: what was
    // proven is the pair, not the EK.
    let e = client
        .connect("127.0.0.1", port)
        .await
        .expect_err("refused after the genuine node was proven");
    assert!(
        matches!(e, ConnectError::Residency(ResidencyError::NoAnswer)),
        "{e:?}"
    );
    assert_eq!(forger.challenges_received(), 2);
    assert_eq!(recorder.0.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_refuses_a_forged_join_service_before_asking_for_a_ticket() {
    let ca = EkCa::new().unwrap();
    let port = free_port();
    // The control plane the forger impersonates: same config, same CA.
    let victim = member(&ca, port, "cp-0", "control-plane");
    let forger = forger_of(&Arc::new(TpmIssuer::new(victim.tpm.clone())));
    let recorder = Recorder::default();
    serve_forged(forger.clone(), recorder.clone(), port).await;

    let node = joiner(&ca, &ca, port, "worker-0", "worker");
    // The join client retries a refused service forever; give it time for
    // several attempts.
    let outcome = tokio::time::timeout(Duration::from_secs(4), node.client(&ca).run()).await;
    assert!(outcome.is_err(), "the join client stopped: {outcome:?}");
    assert!(
        forger.challenges_received() >= 1,
        "the forger was never challenged"
    );
    assert_eq!(
        recorder.0.load(Ordering::SeqCst),
        0,
        "a request reached the forged service"
    );
    node.assert_untouched();
}

/// An EK's identity (revocation, disk bindings and keys, per-EK limits) is
/// a digest of its whole public area, while its certificate certifies only
/// the modulus: a node that rewrote another field of its genuine document
/// (here the authorization policy) would still activate credentials with
/// its real EK and count as a new EK. Only the template's area is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_genuine_document_with_another_ek_area_is_refused() {
    use keel_verifier::ek::EkError;
    use keel_verifier::validator::ValidationError;
    use prost::Message as _;

    let ca = EkCa::new().unwrap();
    let node = member(&ca, free_port(), "w-0", "worker");
    let measurements = join_common::measurements_of(&node.tpm, &[4, 9, 11, 12, 15]);
    let validator = Validator::new(
        measurements,
        EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap(),
    );
    let issuer = TpmIssuer::new(node.tpm.clone());
    let (nonce, user_data) = ([7; 32], [6; 32]);
    let genuine = issuer.issue(&nonce, &user_data).unwrap();
    validator.validate(&genuine, &nonce, &user_data).unwrap();

    let document =
        keel_proto::attestation::AttestationDocument::decode(genuine.as_slice()).unwrap();
    // Byte 10 is the first of the authorization policy's digest; 4-7 are
    // the object attributes (userWithAuth added); 52-55 the exponent.
    for (at, bit) in [(10, 0x01), (7, 0x40), (55, 0x03)] {
        let mut other = document.clone();
        other.ek_public[at] ^= bit;
        let refused = validator.validate(&other.encode_to_vec(), &nonce, &user_data);
        assert!(
            matches!(
                refused,
                Err(ValidationError::Endorsement(EkError::Template(_)))
            ),
            "byte {at}: {refused:?}"
        );
    }
}
