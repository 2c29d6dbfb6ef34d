//! aTLS over real TLS on 127.0.0.1 with a real (Ed25519) attestation scheme:
//! gRPC calls in each mode, and every way a peer's attestation must be
//! refused, seen from both sides.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    call, dyn_issuer, dyn_validator, handshake, mutual_client, mutual_server, TestClaims,
    TestIssuer, TestServer, TestValidator,
};
use keel_atls::{cert, danger};
use keel_atls::{
    AtlsClient, AtlsServer, AtlsStream, ConnectError, HandshakeError, Nonce, PeerCertError,
    PeerError, SwappableValidator, ValidationError, ATTESTATION_OID,
};
use rustls::AlertDescription;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

type ServerResult = Result<AtlsStream<TestClaims>, HandshakeError>;
type ClientResult = Result<AtlsStream<TestClaims>, ConnectError>;

/// The client refused the server's certificate, for a reason `why` accepts.
fn assert_server_refused<T: Debug>(
    client_result: &Result<T, ConnectError>,
    why: fn(&PeerError) -> bool,
) {
    assert!(
        matches!(client_result, Err(ConnectError::ServerRefused(e)) if why(e)),
        "{client_result:?}"
    );
}

/// The server refused the client's certificate, for a reason `why` accepts.
fn assert_client_refused(server_result: &ServerResult, why: fn(&PeerError) -> bool) {
    assert!(
        matches!(server_result, Err(HandshakeError::ClientRefused(e)) if why(e)),
        "{server_result:?}"
    );
}

/// The client learnt at connect time, by `alert`, that the server refused it.
fn assert_refused_by_server(client_result: &ClientResult, alert: AlertDescription) {
    assert!(
        matches!(client_result, Err(ConnectError::RefusedByServer(a)) if *a == alert),
        "{client_result:?}"
    );
}

/// In a mutual handshake, the client refused the server for a reason `why`
/// accepts. Deferred refusal: the server judged (and accepted) the client's
/// document; the client closed before the key residency exchange, so the
/// server hands no connection on either.
fn assert_client_refuses(
    (server_result, client_result): &(ServerResult, ClientResult),
    why: fn(&PeerError) -> bool,
) {
    assert_server_refused(client_result, why);
    assert!(
        matches!(
            server_result,
            Err(HandshakeError::Residency(keel_atls::ResidencyError::Closed))
        ),
        "{server_result:?}"
    );
}

/// The server refused the client for a reason `why` accepts; the client
/// learnt it at connect time, not at its first request, by `alert`.
fn assert_server_refuses(
    (server_result, client_result): &(ServerResult, ClientResult),
    why: fn(&PeerError) -> bool,
    alert: AlertDescription,
) {
    assert_client_refused(server_result, why);
    assert_refused_by_server(client_result, alert);
}

struct Parties {
    server_issuer: Arc<TestIssuer>,
    client_issuer: Arc<TestIssuer>,
}

impl Parties {
    fn new() -> Self {
        Self {
            server_issuer: TestIssuer::generate(),
            client_issuer: TestIssuer::generate(),
        }
    }

    fn mutual_server(&self) -> AtlsServer<TestClaims> {
        self.server_trusting(&self.client_issuer)
    }

    fn mutual_client(&self) -> AtlsClient<TestClaims> {
        self.client_trusting(&self.server_issuer)
    }

    /// The server, accepting documents signed by `signer` only.
    fn server_trusting(&self, signer: &TestIssuer) -> AtlsServer<TestClaims> {
        mutual_server(&self.server_issuer, signer)
    }

    /// The client, accepting documents signed by `signer` only.
    fn client_trusting(&self, signer: &TestIssuer) -> AtlsClient<TestClaims> {
        mutual_client(&self.client_issuer, signer)
    }

    /// One mutual handshake in which the server presents what `present` makes.
    async fn server_presenting(&self, present: danger::PresentFn) -> (ServerResult, ClientResult) {
        let server = self.mutual_server().danger_present_with(present);
        handshake(&server, &self.mutual_client()).await
    }

    /// One mutual handshake in which the client presents what `present` makes.
    async fn client_presenting(&self, present: danger::PresentFn) -> (ServerResult, ClientResult) {
        let client = self.mutual_client().danger_present_with(present);
        handshake(&self.mutual_server(), &client).await
    }
}

/// A presenter that attests honestly once, then replays that certificate
/// (key, certificate and document) in every later handshake.
fn replaying(issuer: Arc<TestIssuer>) -> danger::PresentFn {
    let first = Mutex::new(None);
    Arc::new(move |nonce: &Nonce| {
        let mut first = first.lock().unwrap();
        if let Some(cert) = &*first {
            return Ok(Arc::clone(cert));
        }
        let cert = danger::attested_certificate(issuer.as_ref(), nonce)?;
        *first = Some(cert.clone());
        Ok(cert)
    })
}

/// A presenter that takes a genuine document for this handshake's nonce and
/// one key, and puts it into a certificate for another key.
fn moving(issuer: Arc<TestIssuer>) -> danger::PresentFn {
    Arc::new(move |nonce: &Nonce| {
        let bound_key = danger::generate_key()?;
        let document = issuer.document(nonce.as_bytes(), &danger::user_data_for(&bound_key));
        let other_key = danger::generate_key()?;
        danger::certificate_with_extension(other_key, ATTESTATION_OID, &document)
    })
}

/// A presenter that puts a genuine document under an OID this version does
/// not know.
fn unknown_oid(issuer: Arc<TestIssuer>) -> danger::PresentFn {
    Arc::new(move |nonce: &Nonce| {
        let key = danger::generate_key()?;
        let document = issuer.document(nonce.as_bytes(), &danger::user_data_for(&key));
        danger::certificate_with_extension(key, &[1, 3, 9901, 1, 2], &document)
    })
}

/// A presenter that takes an honest certificate for this handshake's nonce
/// (a fresh document, bound to the certificate's key) and presents it
/// without that key: its handshake signatures come from another key.
fn without_its_key(issuer: Arc<TestIssuer>) -> danger::PresentFn {
    Arc::new(move |nonce: &Nonce| {
        let honest = danger::attested_certificate(issuer.as_ref(), nonce)?;
        danger::certificate_without_its_key(honest.cert[0].clone(), danger::generate_key()?)
    })
}

fn unattested() -> danger::PresentFn {
    Arc::new(|_: &Nonce| danger::certificate_without_attestation())
}

#[tokio::test]
async fn mutual_mode_call_succeeds_and_each_side_sees_the_others_document() {
    common::init_tracing();
    let parties = Parties::new();
    let server = TestServer::start(parties.mutual_server()).await;

    let (seen_by_server, attested) = call(&parties.mutual_client(), &server).await.unwrap();

    assert_eq!(seen_by_server, parties.client_issuer.last_issued());
    let attested = attested.expect("the client validated the server");
    assert_eq!(attested.document(), parties.server_issuer.last_issued());
    assert_eq!(attested.claims().signer, parties.server_issuer.public_key());
}

#[tokio::test]
async fn server_attested_mode_call_succeeds() {
    let parties = Parties::new();
    let server = TestServer::start(AtlsServer::server_attested(dyn_issuer(
        &parties.server_issuer,
    )))
    .await;
    let client = AtlsClient::server_attested(dyn_validator(parties.server_issuer.validator()));

    let (seen_by_server, attested) = call(&client, &server).await.unwrap();

    assert!(
        seen_by_server.is_empty(),
        "the server does not validate clients"
    );
    let attested = attested.expect("the client validated the server");
    assert_eq!(attested.document(), parties.server_issuer.last_issued());
}

#[tokio::test]
async fn client_attested_mode_call_succeeds() {
    let parties = Parties::new();
    let server = TestServer::start(AtlsServer::client_attested(dyn_validator(
        parties.client_issuer.validator(),
    )))
    .await;
    let client = AtlsClient::client_attested(dyn_issuer(&parties.client_issuer));

    let (seen_by_server, attested) = call(&client, &server).await.unwrap();

    assert_eq!(seen_by_server, parties.client_issuer.last_issued());
    assert!(
        attested.is_none(),
        "this client does not validate the server"
    );
    assert_eq!(parties.server_issuer.issued_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_mode_works_on_a_multi_threaded_runtime() {
    let parties = Parties::new();
    let server = TestServer::start(parties.mutual_server()).await;
    let (seen_by_server, attested) = call(&parties.mutual_client(), &server).await.unwrap();
    assert_eq!(seen_by_server, parties.client_issuer.last_issued());
    assert!(attested.is_some());
}

#[tokio::test]
async fn replayed_server_document_is_refused_as_stale() {
    common::init_tracing();
    let parties = Parties::new();
    let server = parties
        .mutual_server()
        .danger_present_with(replaying(parties.server_issuer.clone()));
    let client = parties.mutual_client();

    let (first_server, first_client) = handshake(&server, &client).await;
    first_server.unwrap();
    first_client.unwrap();

    assert_client_refuses(&handshake(&server, &client).await, |e| {
        matches!(e, PeerError::Validation(ValidationError::NonceMismatch))
    });
}

#[tokio::test]
async fn replayed_client_document_is_refused_as_stale() {
    let parties = Parties::new();
    let server = parties.mutual_server();
    let client = parties
        .mutual_client()
        .danger_present_with(replaying(parties.client_issuer.clone()));

    let (first_server, first_client) = handshake(&server, &client).await;
    first_server.unwrap();
    first_client.unwrap();

    assert_server_refuses(
        &handshake(&server, &client).await,
        |e| matches!(e, PeerError::Validation(ValidationError::NonceMismatch)),
        AlertDescription::AccessDenied,
    );
}

#[tokio::test]
async fn document_moved_into_another_certificate_is_refused() {
    let parties = Parties::new();
    let key_binding = |e: &PeerError| {
        matches!(
            e,
            PeerError::Validation(ValidationError::KeyBindingMismatch)
        )
    };
    let outcome = parties
        .server_presenting(moving(parties.server_issuer.clone()))
        .await;
    assert_client_refuses(&outcome, key_binding);

    let outcome = parties
        .client_presenting(moving(parties.client_issuer.clone()))
        .await;
    assert_server_refuses(&outcome, key_binding, AlertDescription::AccessDenied);
}

/// The certificate's self-signature is not what protects it: a peer that
/// presents a genuine, fresh certificate without holding its key fails the
/// TLS handshake signature, in both directions, before anything is sent.
#[tokio::test]
async fn a_certificate_presented_without_its_key_is_refused() {
    let parties = Parties::new();
    let (server_result, client_result) = parties
        .server_presenting(without_its_key(parties.server_issuer.clone()))
        .await;
    assert!(
        matches!(&client_result, Err(ConnectError::Tls(e)) if bad_signature(e)),
        "{client_result:?}"
    );
    assert!(server_result.is_err(), "{server_result:?}");

    let (server_result, client_result) = parties
        .client_presenting(without_its_key(parties.client_issuer.clone()))
        .await;
    assert!(
        matches!(&server_result, Err(HandshakeError::Tls(e)) if bad_signature(e)),
        "{server_result:?}"
    );
    assert_refused_by_server(&client_result, AlertDescription::DecryptError);
}

/// The handshake failed because the peer's CertificateVerify signature does
/// not verify under its certificate's key.
fn bad_signature(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|e| {
            matches!(
                e,
                rustls::Error::InvalidCertificate(rustls::CertificateError::BadSignature)
            )
        })
}

#[tokio::test]
async fn unknown_attestation_extension_oid_is_refused() {
    let parties = Parties::new();
    let outcome = parties
        .server_presenting(unknown_oid(parties.server_issuer.clone()))
        .await;
    assert_client_refuses(
        &outcome,
        |e| matches!(e, PeerError::Certificate(PeerCertError::UnknownExtensionOid(oid)) if oid == "1.3.9901.1.2"),
    );
}

#[tokio::test]
async fn server_without_attestation_is_refused() {
    let parties = Parties::new();
    let (_, client_result) = parties.server_presenting(unattested()).await;
    assert_server_refused(&client_result, |e| {
        matches!(e, PeerError::Certificate(PeerCertError::ExtensionMissing))
    });

    // A client-attested server does not attest: a client that validates
    // servers refuses it for the same reason.
    let server = AtlsServer::client_attested(dyn_validator(parties.client_issuer.validator()));
    let (_, client_result) = handshake(&server, &parties.mutual_client()).await;
    assert_server_refused(&client_result, |e| {
        matches!(e, PeerError::Certificate(PeerCertError::ExtensionMissing))
    });
}

#[tokio::test]
async fn client_without_attestation_is_refused() {
    let parties = Parties::new();

    // A client that presents a certificate without the extension.
    assert_server_refuses(
        &parties.client_presenting(unattested()).await,
        |e| matches!(e, PeerError::Certificate(PeerCertError::ExtensionMissing)),
        AlertDescription::BadCertificate,
    );

    // A client that does not attest at all.
    let client = AtlsClient::server_attested(dyn_validator(parties.server_issuer.validator()));
    let (server_result, client_result) = handshake(&parties.mutual_server(), &client).await;
    assert!(
        matches!(server_result, Err(HandshakeError::ClientNotAttested)),
        "{server_result:?}"
    );
    assert!(
        matches!(client_result, Err(ConnectError::AttestationRequired)),
        "{client_result:?}"
    );
}

#[tokio::test]
async fn document_from_an_untrusted_signer_is_refused() {
    common::init_tracing();
    let parties = Parties::new();
    let stranger = TestIssuer::generate();

    // The client trusts another key than the server's.
    let client = parties.client_trusting(&stranger);
    assert_client_refuses(&handshake(&parties.mutual_server(), &client).await, |e| {
        matches!(e, PeerError::Validation(ValidationError::Rejected(_)))
    });

    // The server trusts another key than the client's.
    let server = parties.server_trusting(&stranger);
    assert_server_refuses(
        &handshake(&server, &parties.mutual_client()).await,
        |e| {
            matches!(e, PeerError::Validation(ValidationError::Rejected(reason))
                if reason.to_string() == "signature is not by the trusted key")
        },
        AlertDescription::AccessDenied,
    );
}

#[tokio::test]
async fn when_both_refuse_each_side_names_its_own_reason() {
    let parties = Parties::new();
    let stranger = TestIssuer::generate();
    let (server_result, client_result) = handshake(
        &parties.server_trusting(&stranger),
        &parties.client_trusting(&stranger),
    )
    .await;
    // The client refused the server first, but still let the server judge it.
    assert_server_refused(&client_result, |e| {
        matches!(e, PeerError::Validation(ValidationError::Rejected(_)))
    });
    assert_client_refused(&server_result, |e| {
        matches!(e, PeerError::Validation(ValidationError::Rejected(_)))
    });
}

#[tokio::test]
async fn a_client_in_server_attested_mode_refuses_during_the_handshake() {
    let parties = Parties::new();
    let stranger = TestIssuer::generate();
    let client = AtlsClient::server_attested(dyn_validator(stranger.validator()));
    let server = AtlsServer::<TestClaims>::server_attested(dyn_issuer(&parties.server_issuer));
    let (server_result, client_result) = handshake(&server, &client).await;
    assert!(
        matches!(client_result, Err(ConnectError::ServerRefused(_))),
        "{client_result:?}"
    );
    // Nothing to defer for: the server learns of the refusal by the alert.
    assert!(
        matches!(server_result, Err(HandshakeError::RefusedByClient(_))),
        "{server_result:?}"
    );
}

/// An established connection collects what is written until the writer
/// flushes (one TLS record, not one per write): nothing reaches the peer
/// before the flush, and everything does after it.
#[tokio::test]
async fn writes_reach_the_peer_when_the_writer_flushes() {
    let parties = Parties::new();
    let (server, client) = handshake(&parties.mutual_server(), &parties.mutual_client()).await;
    let (mut server, mut client) = (server.unwrap(), client.unwrap());
    client.write_all(b"frame header, ").await.unwrap();
    client.write_all(b"then its payload").await.unwrap();
    let mut received = [0u8; 30];
    let early = tokio::time::timeout(Duration::from_millis(300), server.read(&mut received)).await;
    assert!(early.is_err(), "bytes reached the peer before the flush");
    client.flush().await.unwrap();
    server.read_exact(&mut received).await.unwrap();
    assert_eq!(&received, b"frame header, then its payload");
    // The other direction, and a write larger than the buffer.
    let large = vec![7u8; 40 * 1024];
    server.write_all(&large).await.unwrap();
    server.flush().await.unwrap();
    let mut back = vec![0u8; large.len()];
    client.read_exact(&mut back).await.unwrap();
    assert_eq!(back, large);
}

#[tokio::test]
async fn every_connection_is_fully_validated_no_resumption() {
    let parties = Parties::new();
    let server_validator = Arc::new(parties.client_issuer.validator());
    let client_validator = Arc::new(parties.server_issuer.validator());
    let server = TestServer::start(AtlsServer::mutual(
        dyn_issuer(&parties.server_issuer),
        server_validator.clone(),
    ))
    .await;
    let client = AtlsClient::mutual(dyn_issuer(&parties.client_issuer), client_validator.clone());

    for round in 1..=3 {
        let (seen_by_server, attested) = call(&client, &server).await.unwrap();
        assert_eq!(seen_by_server, parties.client_issuer.last_issued());
        assert_eq!(
            attested.unwrap().document(),
            parties.server_issuer.last_issued()
        );
        assert_eq!(server_validator.count(), round);
        assert_eq!(client_validator.count(), round);
        assert_eq!(parties.server_issuer.issued_count(), round);
        assert_eq!(parties.client_issuer.issued_count(), round);
    }
}

#[tokio::test]
async fn swapping_the_validator_changes_the_next_handshake() {
    let parties = Parties::new();
    let other = TestIssuer::generate();
    let swappable = Arc::new(SwappableValidator::new(
        parties.server_issuer.validator().generation(1),
    ));
    let client = AtlsClient::mutual(dyn_issuer(&parties.client_issuer), swappable.clone());
    let server = TestServer::start(parties.mutual_server()).await;

    let (_, attested) = call(&client, &server).await.unwrap();
    assert_eq!(attested.unwrap().claims().generation, 1);

    // An established connection outlives the swap.
    let bound = client.bind_channel(server.endpoint()).await.unwrap();

    // The new validator trusts another key: the same server is now refused.
    let old = swappable.replace(other.validator().generation(2));
    assert_eq!(old.count(), 2);
    let refused = call(&client, &server).await;
    assert_server_refused(&refused, |e| {
        matches!(e, PeerError::Validation(ValidationError::Rejected(_)))
    });
    let mut still_open = keel_proto::kms::key_service_client::KeyServiceClient::new(bound.channel);
    still_open
        .get_data_key(keel_proto::kms::GetDataKeyRequest {
            data_key_id: "x".into(),
            length: 16,
        })
        .await
        .unwrap();

    // ... and a server the new validator trusts is accepted.
    let other_server = TestServer::start(mutual_server(&other, &parties.client_issuer)).await;
    let (_, attested) = call(&client, &other_server).await.unwrap();
    assert_eq!(attested.unwrap().claims().generation, 2);
}

/// A swap that lands between a handshake's validation and its residency
/// challenge: the validator that validated the peer also challenges it,
/// and the new one (which trusts another key) plays no part.
#[tokio::test]
async fn a_swap_during_a_handshake_leaves_it_to_the_validator_it_started_with() {
    let parties = Parties::new();
    let stranger = TestIssuer::generate();
    let next = stranger.validator().generation(2).forgetful();
    let next_challenges = next.challenges.clone();
    let next = std::sync::Mutex::new(Some(next));
    let cell: Arc<std::sync::OnceLock<std::sync::Weak<SwappableValidator<TestValidator>>>> =
        Arc::default();
    let hook_cell = cell.clone();
    let first = parties
        .client_issuer
        .validator()
        .generation(1)
        .forgetful()
        .on_validate(move || {
            let swappable = hook_cell.get().and_then(std::sync::Weak::upgrade);
            if let (Some(swappable), Some(next)) = (swappable, next.lock().unwrap().take()) {
                swappable.replace(next);
            }
        });
    let first_challenges = first.challenges.clone();
    let swappable = Arc::new(SwappableValidator::new(first));
    cell.set(Arc::downgrade(&swappable)).unwrap();
    let server = TestServer::start(AtlsServer::mutual(
        dyn_issuer(&parties.server_issuer),
        swappable.clone(),
    ))
    .await;
    let stream = parties
        .mutual_client()
        .connect("127.0.0.1", server.addr.port())
        .await
        .unwrap();
    assert!(stream.peer().attested().is_some());
    assert_eq!(
        first_challenges.load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert_eq!(next_challenges.load(std::sync::atomic::Ordering::SeqCst), 0);
    // The swap took effect for the handshakes after it.
    assert_eq!(swappable.current().count(), 0);
    assert!(parties
        .mutual_client()
        .connect("127.0.0.1", server.addr.port())
        .await
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_handshakes_during_swaps_complete_or_fail_cleanly() {
    const HANDSHAKES: usize = 50;
    let parties = Parties::new();
    let stranger = TestIssuer::generate();
    // Generation 1 accepts the client, generation 2 refuses it.
    let swappable = Arc::new(SwappableValidator::new(
        parties.client_issuer.validator().generation(1),
    ));
    let server = TestServer::start(AtlsServer::mutual(
        dyn_issuer(&parties.server_issuer),
        swappable.clone(),
    ))
    .await;

    let swapping = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let swapper = {
        let swappable = swappable.clone();
        let swapping = swapping.clone();
        let (accepting, refusing) = (
            (
                parties.client_issuer.public_key(),
                parties.client_issuer.residency_key(),
            ),
            (stranger.public_key(), stranger.residency_key()),
        );
        tokio::spawn(async move {
            let mut swaps = 0u32;
            while swapping.load(std::sync::atomic::Ordering::SeqCst) {
                let (trusted, generation) = if swaps.is_multiple_of(2) {
                    (&refusing, 2)
                } else {
                    (&accepting, 1)
                };
                swappable.replace(
                    TestValidator::new(trusted.0.clone(), trusted.1).generation(generation),
                );
                swaps += 1;
                tokio::time::sleep(Duration::from_micros(500)).await;
            }
            swaps
        })
    };

    let client = parties.mutual_client();
    let tasks: Vec<_> = (0..HANDSHAKES)
        .map(|_| {
            let client = client.clone();
            let addr = server.addr;
            tokio::spawn(async move { client.connect("127.0.0.1", addr.port()).await })
        })
        .collect();
    let (mut accepted, mut refused) = (0u64, 0u64);
    for task in tasks {
        match task.await.expect("no handshake task panicked") {
            Ok(stream) => {
                assert!(stream.peer().attested().is_some());
                accepted += 1;
            }
            Err(ConnectError::RefusedByServer(AlertDescription::AccessDenied)) => refused += 1,
            // No residency failure: a swap between a handshake's document
            // check and its challenge leaves both to the validator it
            // started with (the two generations expect different keys).
            Err(other) => panic!("unclean failure: {other:?}"),
        }
    }
    swapping.store(false, std::sync::atomic::Ordering::SeqCst);
    let swaps = swapper.await.unwrap();
    assert!(swaps > 1, "the validator was swapped during the handshakes");

    eprintln!("accepted {accepted}, refused {refused}, swaps {swaps}");
    server.wait_for_handshakes(HANDSHAKES as u64).await;
    assert_eq!(server.stats.accepted(), accepted);
    assert_eq!(server.stats.refused(), refused);
    assert_eq!(accepted + refused, HANDSHAKES as u64);
}

#[tokio::test]
async fn a_silent_client_is_cut_off_after_the_handshake_timeout() {
    let parties = Parties::new();
    let server = parties
        .mutual_server()
        .with_handshake_timeout(Duration::from_millis(200));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (tcp, _) = listener.accept().await.unwrap();
    let started = std::time::Instant::now();
    let result = server.accept(tcp).await;
    assert!(
        matches!(result, Err(HandshakeError::Timeout(_))),
        "{result:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn the_largest_document_fits_in_a_handshake() {
    let parties = Parties::new();
    let large: danger::PresentFn = Arc::new(|_: &Nonce| {
        let key = danger::generate_key()?;
        danger::certificate_with_extension(
            key,
            ATTESTATION_OID,
            &vec![0x5a; cert::MAX_DOCUMENT_LEN],
        )
    });
    let (_, client_result) = parties.server_presenting(large).await;
    // The certificate crossed the wire; the validator then refused the junk.
    assert_server_refused(&client_result, |e| {
        matches!(e, PeerError::Validation(ValidationError::Malformed(_)))
    });
}

#[tokio::test]
async fn the_accept_loop_counts_refusals_and_keeps_serving() {
    common::init_tracing();
    let parties = Parties::new();
    let server = TestServer::start(parties.mutual_server()).await;
    let stranger = TestIssuer::generate();

    let intruder = mutual_client(&stranger, &parties.server_issuer);
    let refused = intruder.connect("127.0.0.1", server.addr.port()).await;
    assert_refused_by_server(&refused, AlertDescription::AccessDenied);
    server.wait_for_handshakes(1).await;
    assert_eq!(server.stats.refused(), 1);

    let (seen_by_server, _) = call(&parties.mutual_client(), &server).await.unwrap();
    assert_eq!(seen_by_server, parties.client_issuer.last_issued());
    assert_eq!(server.stats.accepted(), 1);
}

/// Only a connection refused before the server did any work counts as
/// refused at once (worth retrying soon): nothing listening on the port.
/// A server that accepts and then stays silent until the client's bound,
/// or that refuses the client's attestation, does not.
#[tokio::test]
async fn only_a_connection_refused_before_any_work_is_refused_at_once() {
    let parties = Parties::new();
    // Bound but not listening: the port stays this test's, and a
    // connection to it is refused (a listener bound and dropped would
    // free it for any other test's listener).
    let closed = tokio::net::TcpSocket::new_v4().unwrap();
    closed.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let closed_addr = closed.local_addr().unwrap();
    let Err(err) = parties
        .mutual_client()
        .connect("127.0.0.1", closed_addr.port())
        .await
    else {
        panic!("nothing listens, yet it connected");
    };
    assert!(err.is_refused_at_once(), "{err:?}");
    assert!(err.is_unreachable(), "{err:?}");
    drop(closed);

    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let Err(err) = parties
        .mutual_client()
        .with_timeout(Duration::from_millis(200))
        .connect("127.0.0.1", silent_addr.port())
        .await
    else {
        panic!("the server never answers, yet it connected");
    };
    assert!(matches!(err, ConnectError::Timeout(_)), "{err:?}");
    assert!(!err.is_refused_at_once(), "{err:?}");
    drop(silent);

    let (_, client_result) = parties
        .server_presenting(Arc::new(|_: &Nonce| {
            danger::certificate_with_extension(danger::generate_key()?, ATTESTATION_OID, b"junk")
        }))
        .await;
    let Err(err) = client_result else {
        panic!("the server's document is junk, yet it was accepted");
    };
    assert!(!err.is_refused_at_once(), "{err:?}");
}
