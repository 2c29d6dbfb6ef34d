//! The init secret over the real init server (aTLS, swtpm): it travels
//! sealed to the node's TPM with the master secret, a wrong one is refused
//! and makes its sender wait before the next try, and secrets sealed to
//! another TPM do not open.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::sync::Arc;
use std::time::Duration;

use join_common::{free_port, joiner, node_env, wait_for_port, Joiner};
use keel_agent::cluster::ClusterSlot;
use keel_atls::AtlsClient;
use keel_proto::attestation::SealedSecret;
use keel_proto::init::init_service_client::InitServiceClient;
use keel_proto::init::{InitRequest, InitSecrets};
use keel_testkit::swtpm::EkCa;
use keel_verifier::ek::EkTrust;
use keel_verifier::validator::{Validator, Verified};
use prost::Message as _;
use tonic::transport::Endpoint;

const SECRET: &[u8] = b"the right init secret";

/// Serves `node`'s init API on a free port; returns the address.
async fn serve(node: &Joiner) -> std::net::SocketAddr {
    let mut config = node.config.clone();
    config.cluster.init_secret_hash = keel_verifier::init_secret::hash(SECRET).unwrap();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut served = node.node(Arc::new(ClusterSlot::new(None)));
    served.config = config;
    served.env = node_env(&node.root, &node.work, None);
    tokio::spawn(async move {
        let _ = keel_agent::node::serve_init(addr, served).await;
    });
    wait_for_port(addr).await;
    addr
}

/// An attested channel to the init server of `node` at `addr`.
async fn bind(ca: &EkCa, node: &Joiner, addr: std::net::SocketAddr) -> tonic::transport::Channel {
    let measurements = join_common::measurements_of(&node.tpm, &[4, 9, 11, 12, 15]);
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let client =
        AtlsClient::<Verified>::server_attested(Arc::new(Validator::new(measurements, trust)));
    client
        .bind_channel(Endpoint::from_shared(format!("http://{addr}")).unwrap())
        .await
        .unwrap()
        .channel
}

/// Sends one init request; the code of the refusal.
async fn init(
    ca: &EkCa,
    node: &Joiner,
    addr: std::net::SocketAddr,
    secrets: SealedSecret,
    name: &str,
) -> tonic::Code {
    let channel = bind(ca, node, addr).await;
    let request = InitRequest {
        secrets: Some(secrets),
        master_salt: vec![1; 32],
        measurement_salt: vec![2; 32],
        kubernetes_version: "v1.31".into(),
        cluster_name: name.into(),
        join_measurements: Vec::new(),
        ..InitRequest::default()
    };
    match InitServiceClient::new(channel).init(request).await {
        Ok(_) => panic!("init was accepted"),
        Err(status) => status.code(),
    }
}

fn secrets(init_secret: &[u8]) -> Vec<u8> {
    InitSecrets {
        init_secret: init_secret.to_vec(),
        master_secret: vec![7; 32],
    }
    .encode_to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_init_secrets_are_refused_and_slow_their_sender_down() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "cp-0", "control-plane");
    let addr = serve(&node).await;

    // A wrong secret: Unauthenticated. At once again: throttled, and the
    // node does not even open the request.
    let code = init(&ca, &node, addr, node.sealed(&secrets(b"guess 1")), "c").await;
    assert_eq!(code, tonic::Code::Unauthenticated);
    let code = init(&ca, &node, addr, node.sealed(&secrets(SECRET)), "c").await;
    assert_eq!(
        code,
        tonic::Code::ResourceExhausted,
        "a second try was not held back"
    );
    // After the first wait (1 s) the right secret gets past the secret
    // check: the request is then judged on its fields (the empty join
    // measurements are refused), so nothing is locked.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let code = init(&ca, &node, addr, node.sealed(&secrets(SECRET)), "c").await;
    assert_eq!(code, tonic::Code::InvalidArgument);
    node.assert_untouched();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_sealed_to_another_tpm_do_not_open() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "cp-0", "control-plane");
    let other = joiner(&ca, &ca, free_port(), "cp-1", "control-plane");
    let addr = serve(&node).await;
    let code = init(&ca, &node, addr, other.sealed(&secrets(SECRET)), "c").await;
    assert_eq!(code, tonic::Code::InvalidArgument);
    // Flood: a request that does not open cost the TPM as much as a wrong
    // secret, and slows its sender down the same way.
    let code = init(&ca, &node, addr, node.sealed(&secrets(SECRET)), "c").await;
    assert_eq!(
        code,
        tonic::Code::ResourceExhausted,
        "a second try was not held back"
    );
    node.assert_untouched();
}

/// Flood: every node measures the cluster's init secret hash, so every
/// node serves the init API; a node already in a cluster refuses any init
/// request before its TPM opens anything (here a sealed blob that would
/// not open, which an unlocked node would try).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_node_refuses_init_before_opening_anything() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "w-1", "worker");
    node.lock.try_lock([1; 32]).unwrap();
    let addr = serve(&node).await;
    let garbage = SealedSecret {
        encrypted_seed: vec![0x5a; 256],
        ..node.sealed(b"anything")
    };
    for _ in 0..3 {
        let code = init(&ca, &node, addr, garbage.clone(), "c").await;
        assert_eq!(code, tonic::Code::FailedPrecondition);
    }
}

/// Attacker's move: send a wrong init secret and go away before the node
/// answers, so that the failure is never counted against the address and
/// the memory-hard check runs again at once. The request counts as its
/// address's failure from the moment it reaches the TPM: the next request
/// from that address is held back, though the first never got an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_goes_away_still_counts_against_its_address() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "cp-0", "control-plane");
    let addr = serve(&node).await;
    // What the node's check of a secret costs in this build.
    let hash = keel_verifier::init_secret::hash(SECRET).unwrap();
    let started = std::time::Instant::now();
    assert!(!keel_verifier::init_secret::matches(&hash, b"guess"));
    let check = started.elapsed();

    let channel = bind(&ca, &node, addr).await;
    let request = InitRequest {
        secrets: Some(node.sealed(&secrets(b"guess"))),
        ..InitRequest::default()
    };
    // Gone halfway through the node's check.
    let mut service = InitServiceClient::new(channel);
    let gone = tokio::time::timeout(check / 2, service.init(request)).await;
    assert!(
        gone.is_err(),
        "the node answered before its check could end"
    );
    drop(service);

    let code = init(&ca, &node, addr, node.sealed(&secrets(SECRET)), "c").await;
    assert_eq!(
        code,
        tonic::Code::ResourceExhausted,
        "the request that went away was not counted"
    );
    node.assert_untouched();
}

/// Flood: requests that carry no secrets at all cost the node no TPM work,
/// but each one was a warning in its log. They count against their
/// address like a wrong secret, so the next is held back (and logged at
/// debug level only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_secrets_slow_their_sender_down() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "cp-0", "control-plane");
    let addr = serve(&node).await;
    let mut refusals = Vec::new();
    for _ in 0..2 {
        let channel = bind(&ca, &node, addr).await;
        let request = InitRequest {
            cluster_name: "c".into(),
            ..InitRequest::default()
        };
        match InitServiceClient::new(channel).init(request).await {
            Ok(_) => panic!("init was accepted"),
            Err(status) => refusals.push(status),
        }
    }
    let codes: Vec<_> = refusals.iter().map(tonic::Status::code).collect();
    assert_eq!(
        codes,
        [tonic::Code::InvalidArgument, tonic::Code::ResourceExhausted]
    );
    // The hold says how long it lasts (whole seconds, at least one), so a
    // client can send again after it; other refusals carry no such mark.
    assert_eq!(keel_proto::held_back_for(&refusals[0]), None);
    assert_eq!(
        keel_proto::held_back_for(&refusals[1]),
        Some(Duration::from_secs(1))
    );
    // The right secret after the wait is judged on its fields.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let code = init(&ca, &node, addr, node.sealed(&secrets(SECRET)), "c").await;
    assert_eq!(code, tonic::Code::InvalidArgument);
    node.assert_untouched();
}
