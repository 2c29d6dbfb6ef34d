//! The attack of the security review, against real swtpm TPMs and real
//! servers: a forger copies a node's public EK certificate, EK, PCR values
//! and event log, and signs quotes with a software P-256 key that claims to
//! be the attestation key. Its documents pass every check a document allows;
//! key residency (credential activation) refuses it before any request, in
//! both directions, even when it relays the challenge to the real node's TPM
//! or answers it with a genuine TPM of its own, into which it loaded the
//! software key's public area.
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

/// What a forger's TPM said to its ActivateCredential.
type Activation = Result<Vec<u8>, tss_esapi::Error>;

/// A forger's answerer on a genuine TPM it holds (another machine whose EK
/// certificate chains to the trusted CA): it loads the software key's public
/// area into that TPM (TPM2_LoadExternal, no sensitive area) and asks the
/// TPM to activate the credential for it, authorising the key by a policy
/// session when the area asks for one, else by its (absent) auth value.
struct PublicOnlyAnswerer {
    tcti: String,
    /// The software key's public area, once the forger made it.
    ak_public: std::sync::OnceLock<Vec<u8>>,
    by_policy: bool,
    outcomes: std::sync::Mutex<Vec<Activation>>,
}

impl PublicOnlyAnswerer {
    fn activate(&self, challenge: &[u8]) -> Activation {
        use prost::Message as _;
        use tss_esapi::abstraction::{ek, DefaultKey};
        use tss_esapi::constants::{CommandCode, SessionType};
        use tss_esapi::handles::AuthHandle;
        use tss_esapi::interface_types::algorithm::{AsymmetricAlgorithm, HashingAlgorithm};
        use tss_esapi::interface_types::resource_handles::Hierarchy;
        use tss_esapi::interface_types::session_handles::{AuthSession, PolicySession};
        use tss_esapi::structures::{EncryptedSecret, IdObject, Public, SymmetricDefinition};
        use tss_esapi::traits::UnMarshall;

        let challenge =
            keel_proto::attestation::ResidencyChallenge::decode(challenge).expect("a challenge");
        let mut ctx = tss_esapi::Context::new(self.tcti.parse().unwrap()).unwrap();
        let ek = ek::create_ek_object(&mut ctx, AsymmetricAlgorithm::Rsa, DefaultKey).unwrap();
        let ak = ctx
            .load_external_public(
                Public::unmarshall(self.ak_public.get().expect("the key's area"))?,
                Hierarchy::Owner,
            )
            .expect("a TPM loads any public area");
        let policy_session = |ctx: &mut tss_esapi::Context| {
            ctx.start_auth_session(
                None,
                None,
                None,
                SessionType::Policy,
                SymmetricDefinition::AES_128_CFB,
                HashingAlgorithm::Sha256,
            )
            .unwrap()
            .unwrap()
        };
        let ek_session = policy_session(&mut ctx);
        ctx.execute_with_session(Some(AuthSession::Password), |c| {
            c.policy_secret(
                PolicySession::try_from(ek_session).unwrap(),
                AuthHandle::Endorsement,
                Default::default(),
                Default::default(),
                Default::default(),
                None,
            )
        })
        .unwrap();
        let ak_session = if self.by_policy {
            let session = policy_session(&mut ctx);
            ctx.policy_command_code(
                PolicySession::try_from(session).unwrap(),
                CommandCode::ActivateCredential,
            )
            .unwrap();
            session
        } else {
            AuthSession::Password
        };
        ctx.execute_with_sessions((Some(ak_session), Some(ek_session), None), |c| {
            c.activate_credential(
                ak,
                ek,
                IdObject::try_from(challenge.credential_blob).unwrap(),
                EncryptedSecret::try_from(challenge.encrypted_seed).unwrap(),
            )
        })
        .map(|secret| secret.value().to_vec())
    }
}

impl keel_atls::Issuer for PublicOnlyAnswerer {
    fn issue(&self, _: &[u8], _: &[u8]) -> Result<Vec<u8>, keel_atls::IssueError> {
        Err(keel_atls::IssueError::new(std::io::Error::other(
            "answers only",
        )))
    }

    fn answer(
        &self,
        challenge: &[u8],
    ) -> Result<keel_atls::ResidencySecret, keel_atls::IssueError> {
        let outcome = self.activate(challenge);
        let answer = match &outcome {
            Ok(secret) => {
                let mut out = zeroize::Zeroizing::new([0; keel_atls::RESIDENCY_SECRET_LEN]);
                out.copy_from_slice(secret);
                Ok(out)
            }
            Err(e) => Err(keel_atls::IssueError::new(std::io::Error::other(
                e.to_string(),
            ))),
        };
        self.outcomes.lock().unwrap().push(outcome);
        answer
    }
}

/// PolicyCommandCode(TPM_CC_ActivateCredential) from an empty policy.
fn activate_credential_policy() -> [u8; 32] {
    use sha2::{Digest as _, Sha256};
    let mut h = Sha256::new();
    h.update([0; 32]);
    h.update(0x0000_016cu32.to_be_bytes()); // TPM_CC_PolicyCommandCode
    h.update(0x0000_0147u32.to_be_bytes()); // TPM_CC_ActivateCredential
    h.finalize().into()
}

/// The review's stronger forger: it holds a genuine TPM of its own whose EK
/// certificate chains to the trusted CA, puts that EK and certificate in
/// documents that carry the victim's PCRs and a software key's quotes, and
/// answers residency challenges with its TPM, into which it loaded the
/// software key's public area alone.
///
/// With the attestation key's usual attributes the document checks pass,
/// and the TPM refuses the activation: the key's admin role needs its auth
/// value, which lives in the sensitive area the TPM does not have. Given
/// adminWithPolicy and a policy for ActivateCredential, the key would be
/// authorised by a session instead, and residency would rest on whether the
/// TPM refuses policy authorisation to a public-only object; the validator
/// refuses such a key before it challenges anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forger_with_a_genuine_tpm_cannot_answer_for_a_key_it_loaded_as_public_only() {
    use keel_verifier::quote::QuoteError;
    use keel_verifier::validator::ValidationError;

    let ca = EkCa::new().unwrap();
    let victim = member(&ca, free_port(), "cp-0", "control-plane");
    let genuine = TpmIssuer::new(victim.tpm.clone())
        .issue(&[0; 32], &[0; 32])
        .unwrap();
    let measurements = join_common::measurements_of(&victim.tpm, &[4, 9, 11, 12, 15]);
    let validator = Arc::new(Validator::new(
        measurements,
        EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap(),
    ));

    // The forger's own TPM, manufactured by the same CA.
    let own_tpm = keel_testkit::swtpm::Swtpm::start(&ca).unwrap();
    let endorsement = {
        let spec = own_tpm.tcti().parse::<keel_agent::tpm::TctiSpec>().unwrap();
        keel_agent::tpm::Tpm::open(&spec)
            .unwrap()
            .endorsement()
            .unwrap()
    };

    for by_policy in [false, true] {
        let answerer = Arc::new(PublicOnlyAnswerer {
            tcti: own_tpm.tcti(),
            ak_public: Default::default(),
            by_policy,
            outcomes: Default::default(),
        });
        let forger = SoftwareAk::new(&genuine, Some(answerer.clone()))
            .unwrap()
            .with_endorsement(
                endorsement.public.clone(),
                endorsement.certificate.clone().unwrap(),
            );
        let forger = if by_policy {
            forger
                .with_admin_policy(&activate_credential_policy())
                .unwrap()
        } else {
            forger
        };
        answerer.ak_public.set(forger.ak_public().to_vec()).unwrap();
        let forger = Arc::new(forger);
        let (nonce, user_data) = ([9; 32], [8; 32]);
        let checked = validator.validate(
            &forger.forge(&nonce, &user_data).unwrap(),
            &nonce,
            &user_data,
        );

        let port = free_port();
        let recorder = Recorder::default();
        serve_forged(forger.clone(), recorder.clone(), port).await;
        let client = AtlsClient::server_attested(validator.clone());
        let e = client
            .connect("127.0.0.1", port)
            .await
            .expect_err("refused");
        assert_eq!(
            recorder.0.load(Ordering::SeqCst),
            0,
            "by policy: {by_policy}"
        );

        if by_policy {
            assert!(
                matches!(
                    checked,
                    Err(ValidationError::Quote(QuoteError::AkAttributes(
                        "admin role by policy"
                    )))
                ),
                "{:?}",
                checked.map(|_| "the document was accepted")
            );
            assert!(matches!(e, ConnectError::ServerRefused(_)), "{e:?}");
            assert_eq!(forger.challenges_received(), 0, "challenged");
        } else {
            checked.expect("the forged document passes the document checks");
            assert!(
                matches!(e, ConnectError::Residency(ResidencyError::NoAnswer)),
                "{e:?}"
            );
            assert_eq!(forger.challenges_received(), 1);
            let outcomes = answerer.outcomes.lock().unwrap();
            let [Err(tss_esapi::Error::Tss2Error(rc))] = outcomes.as_slice() else {
                panic!("the TPM answered: {outcomes:?}");
            };
            assert_eq!(
                rc.kind(),
                Some(tss_esapi::constants::response_code::Tss2ResponseCodeKind::AuthUnavailable),
                "{rc:?}"
            );
        }
    }
}
