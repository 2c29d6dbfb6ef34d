//! A join port that answers a ticket request with the response headers and
//! then never the message. tonic's channel timeout ends at the headers, so
//! without a bound of its own the joining node would wait for the message
//! for ever instead of asking the next control plane.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use join_common::{boot_measurements, config, free_port, measured};
use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::join::{service_validator, TicketClient, TicketError};
use keel_agent::nodelock::NodeLock;
use keel_atls::AtlsServer;
use keel_proto::join::IssueJoinTicketRequest;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::ek::EkTrust;

/// A response body that never yields a frame.
struct Held;

impl http_body::Body for Held {
    type Data = bytes::Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Infallible>>> {
        Poll::Pending
    }
}

/// A control plane compromised after it booted: a genuine TPM, config and
/// lock (cluster `[0x11; 32]`), whose join port completes the mutual aTLS
/// handshake as a join service does, and then answers as the attacker
/// likes. Keep the first value as long as the port serves.
async fn compromised_control_plane(
    ca: &EkCa,
    port: u16,
) -> (
    (Swtpm, tempfile::TempDir),
    keel_atls::Incoming<keel_verifier::validator::Verified>,
) {
    let swtpm = Swtpm::start(ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cp_config = config(ca, port, "cp-0", "control-plane");
    let cp_tpm = measured(&swtpm, &dir.path().join("log"), &cp_config);
    NodeLock::new(cp_tpm.clone())
        .unwrap()
        .try_lock([0x11; 32])
        .unwrap();
    let measurements = dir.path().join("measurements.json");
    std::fs::write(&measurements, boot_measurements(&cp_config).to_json()).unwrap();
    let policy = keel_agent::node::join_service_policy(&cp_config, &measurements).unwrap();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let incoming =
        AtlsServer::mutual(Arc::new(TpmIssuer::new(cp_tpm)), policy.validator()).incoming(listener);
    ((swtpm, dir), incoming)
}

/// Attacker's move: a control plane compromised after it booted (its
/// attestation still passes) holds back its answers to joining nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_service_that_holds_back_its_answer_is_given_up_on() {
    let ca = EkCa::new().unwrap();
    let port = free_port();

    let (_cp, mut incoming) = compromised_control_plane(&ca, port).await;
    let server = tokio::spawn(async move {
        while let Some(Ok(stream)) = incoming.next().await {
            tokio::spawn(async move {
                let answer = hyper::service::service_fn(|_request| async {
                    let response = http::Response::builder()
                        .header("content-type", "application/grpc")
                        .body(Held)
                        .unwrap();
                    Ok::<_, Infallible>(response)
                });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), answer)
                        .await;
            });
        }
    });

    // A joining worker, validating the service as the join client does,
    // with a 5 s timeout.
    let member = join_common::member(&ca, port, "w-0", "worker");
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let validator = service_validator(&member.tpm, trust, None).unwrap();
    let tickets = TicketClient::new(member.tpm.clone(), validator, Duration::from_secs(5));

    let started = Instant::now();
    let endpoint = format!("127.0.0.1:{port}");
    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        tickets.request_join_ticket(&endpoint, IssueJoinTicketRequest::default()),
    )
    .await
    .expect("the join client waited for the held-back answer past its own timeout");
    let took = started.elapsed();
    match outcome {
        Err(TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status}");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a ticket from a service that sent none"),
    }
    assert!(took < Duration::from_secs(30), "{took:?}");
    server.abort();
}

/// An evidence service that answers every call at once: a nonce without
/// waiting for the member's turn, every evidence "trusted", an empty
/// registry; it counts the evidence it gets.
struct Eager {
    submits: Arc<std::sync::atomic::AtomicUsize>,
}

#[tonic::async_trait]
impl keel_proto::evidence::evidence_service_server::EvidenceService for Eager {
    async fn next_nonce(
        &self,
        _: tonic::Request<keel_proto::evidence::NextNonceRequest>,
    ) -> Result<tonic::Response<keel_proto::evidence::NextNonceResponse>, tonic::Status> {
        Ok(tonic::Response::new(
            keel_proto::evidence::NextNonceResponse {
                nonce: rand::random::<[u8; 32]>().to_vec(),
                ..Default::default()
            },
        ))
    }

    async fn submit(
        &self,
        _: tonic::Request<keel_proto::evidence::SubmitEvidenceRequest>,
    ) -> Result<tonic::Response<keel_proto::evidence::SubmitEvidenceResponse>, tonic::Status> {
        self.submits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(tonic::Response::new(
            keel_proto::evidence::SubmitEvidenceResponse {
                verdict: "trusted".into(),
            },
        ))
    }

    async fn registry(
        &self,
        _: tonic::Request<keel_proto::evidence::RegistryRequest>,
    ) -> Result<tonic::Response<keel_proto::evidence::RegistryResponse>, tonic::Status> {
        Ok(tonic::Response::new(
            keel_proto::evidence::RegistryResponse::default(),
        ))
    }
}

/// Attacker's move (starve, a control plane compromised after it
/// booted): answer every nonce request at once instead of an interval
/// later, so that every member quotes back to back on its TPM (and every
/// control plane pulls the registry each round). A member starts its
/// rounds at least half its interval apart whatever the service does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_that_answers_every_nonce_at_once_is_asked_at_the_members_pace() {
    let ca = EkCa::new().unwrap();
    let port = free_port();
    let (_cp, incoming) = compromised_control_plane(&ca, port).await;
    let submits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let eager = Eager {
        submits: submits.clone(),
    };
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                keel_proto::evidence::evidence_service_server::EvidenceServiceServer::new(eager),
            )
            .serve_with_incoming(
                incoming.filter_map(|s| async move { s.ok().map(Ok::<_, Infallible>) }),
            ),
    );

    let member = join_common::member(&ca, port, "w-0", "worker");
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let validator = service_validator(&member.tpm, trust, None).unwrap();
    let interval = Duration::from_secs(2);
    let root = tempfile::tempdir().unwrap();
    let client = keel_agent::evidence::EvidenceClient::new(
        member.tpm.clone(),
        validator,
        root.path().to_owned(),
        String::new(),
        interval,
    );
    let evidence = tokio::spawn(client.run(format!("127.0.0.1:{port}"), [0x11; 32]));
    tokio::time::sleep(Duration::from_secs(3)).await;
    evidence.abort();
    let rounds = submits.load(std::sync::atomic::Ordering::Relaxed);
    assert!(rounds >= 2, "the member did not report: {rounds} rounds");
    assert!(
        rounds <= 5,
        "{rounds} rounds in 3 s: the member quoted at the service's pace"
    );
    server.abort();
}
