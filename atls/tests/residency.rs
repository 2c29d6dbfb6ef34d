//! Key residency after the handshake: a peer whose documents carry a valid
//! signature but whose key is not where its document says (an impostor with
//! a copied signing identity) is refused before any request, in both
//! directions; proofs are remembered per key so later handshakes skip it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{
    call, dyn_issuer, dyn_validator, handshake, mutual_client, mutual_server, TestServer,
};
use keel_atls::{
    AtlsClient, AtlsServer, ConnectError, HandshakeError, IssueError, Issuer, ResidencyError,
    ResidencySecret,
};

/// A connection that fails must fail with the residency error `want`.
fn assert_residency(e: &ConnectError, want: fn(&ResidencyError) -> bool) {
    match e {
        ConnectError::Residency(r) if want(r) => {}
        other => panic!("expected a key residency refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_key_is_elsewhere_is_refused_before_any_request() {
    common::init_tracing();
    let real = common::TestIssuer::generate();
    let impostor = real.impostor();
    let server = TestServer::start(AtlsServer::server_attested(dyn_issuer(&impostor))).await;
    let validator = real.validator();
    let challenges = validator.challenges.clone();
    let client = AtlsClient::server_attested(dyn_validator(validator));

    let e = call(&client, &server).await.expect_err("refused");
    assert_residency(&e, |r| matches!(r, ResidencyError::WrongAnswer));
    assert_eq!(challenges.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(impostor.answered_count(), 1);
    // The handshake itself (signature, nonce, key binding) passed: only the
    // residency proof refused the impostor.
    assert_eq!(impostor.issued_count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_key_is_elsewhere_is_refused_by_the_server() {
    common::init_tracing();
    let server_issuer = common::TestIssuer::generate();
    let real_client = common::TestIssuer::generate();
    let impostor = real_client.impostor();
    let server = TestServer::start(mutual_server(&server_issuer, &real_client)).await;
    let client = mutual_client(&impostor, &server_issuer);
    let e = call(&client, &server).await.expect_err("refused");
    // The server checks the client's proof before it answers: the impostor
    // gets no proof, and the server's TPM did nothing for it.
    assert_residency(&e, |r| matches!(r, ResidencyError::NoAnswer));
    server.wait_for_handshakes(1).await;
    assert_eq!(server.stats.accepted(), 0);
    assert_eq!(server.stats.refused(), 1);
    assert_eq!(server_issuer.answered_count(), 0);

    // The genuine client gets through the same server, which answers it.
    let client = mutual_client(&real_client, &server_issuer);
    call(&client, &server).await.unwrap();
    assert_eq!(server_issuer.answered_count(), 1);
}

/// Issues genuine documents but cannot answer challenges (its key is gone).
struct Mute(Arc<common::TestIssuer>);

impl Issuer for Mute {
    fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, IssueError> {
        self.0.issue(nonce, user_data)
    }

    fn answer(&self, _challenge: &[u8]) -> Result<ResidencySecret, IssueError> {
        Err(IssueError::new(std::io::Error::other("no such key")))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_cannot_answer_is_refused_with_the_reason_on_both_sides() {
    common::init_tracing();
    let server_issuer = common::TestIssuer::generate();
    let server = AtlsServer::<()>::server_attested(Arc::new(Mute(server_issuer.clone())));
    let client = AtlsClient::server_attested(dyn_validator(server_issuer.validator()));
    let (server_result, client_result) = handshake(&server, &client).await;
    assert_residency(&client_result.expect_err("refused"), |r| {
        matches!(r, ResidencyError::NoAnswer)
    });
    match server_result {
        Err(HandshakeError::Residency(ResidencyError::Answer(_))) => {}
        other => {
            panic!("expected the server to report the challenge it could not answer, got {other:?}")
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proven_key_is_not_challenged_again() {
    let server_issuer = common::TestIssuer::generate();
    let client_issuer = common::TestIssuer::generate();
    let server_validator = client_issuer.validator();
    let server_challenges = server_validator.challenges.clone();
    let server = TestServer::start(AtlsServer::mutual(
        dyn_issuer(&server_issuer),
        dyn_validator(server_validator),
    ))
    .await;
    let client_validator = Arc::new(server_issuer.validator());
    let client = AtlsClient::mutual(dyn_issuer(&client_issuer), client_validator.clone());
    for _ in 0..3 {
        call(&client, &server).await.unwrap();
    }
    let count =
        |c: &Arc<std::sync::atomic::AtomicUsize>| c.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        count(&server_challenges),
        1,
        "the server challenged a proven client again"
    );
    assert_eq!(
        client_validator.challenge_count(),
        1,
        "the client challenged a proven server again"
    );
    assert_eq!(server_issuer.answered_count(), 1);
    assert_eq!(client_issuer.answered_count(), 1);

    // A validator that does not remember challenges every time.
    let forgetful = Arc::new(server_issuer.validator().forgetful());
    let client = AtlsClient::mutual(dyn_issuer(&client_issuer), forgetful.clone());
    for _ in 0..2 {
        call(&client, &server).await.unwrap();
    }
    assert_eq!(forgetful.challenge_count(), 2);
    assert_eq!(server_issuer.answered_count(), 3);
}
