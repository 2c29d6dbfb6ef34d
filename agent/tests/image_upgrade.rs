//! An image upgrade on a control plane, each node with its own swtpm and
//! over real mutual aTLS: a node of a new image (PCR 4 differs) joins only
//! once the operator staged the new image's signed measurements; nodes of
//! the old image join during the rollout and no longer after it finished.
//! Every refused request (no signing key at init, no or a replayed proof,
//! a wrong, missing or foreign signature, a file that enforces less, a
//! finish with nothing staged, a file older than the current image)
//! changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use join_common::{free_port, measurements_of, member, start_service, Member, Service};
use keel_agent::attestation::policy::staged_path;
use keel_agent::cluster::{
    change_state, present_own_image, ClusterState, ControlPlaneFacts, FactsError,
};
use keel_agent::join::settings::SHARED_PCRS;
use keel_agent::join::{service_validator, JoinTicket, KubeletKey, TicketClient, TicketError};
use keel_agent::operator::{
    OperatorAuth, OperatorError, OperatorServer, FINISH_IMAGE_UPGRADE, SET_JOIN_MEASUREMENTS,
    STAGE_IMAGE_MEASUREMENTS,
};
use keel_atls::ConnectError;
use keel_proto::join::IssueJoinTicketRequest;
use keel_proto::operator::{
    FinishImageUpgradeRequest, SetJoinMeasurementsRequest, StageImageMeasurementsRequest,
};
use keel_testkit::swtpm::EkCa;
use keel_verifier::config::Role;
use keel_verifier::ek::EkTrust;
use keel_verifier::keys::operator_proof;
use keel_verifier::measurements::Measurements;
use keel_verifier::signature::{SignedMeasurements, SigningPrivateKey, SigningPublicKey};
use keel_verifier::validator::Validator;

/// The PCRs of the image `set` describes (its values for every PCR it
/// names).
fn pcrs_of(set: &Measurements) -> std::collections::BTreeMap<u32, [u8; 32]> {
    set.iter().map(|(pcr, e)| (*pcr, e.digest)).collect()
}

/// `state` with another measurements signing key.
fn with_key(state: &ClusterState, key: Option<SigningPublicKey>) -> ClusterState {
    ClusterState {
        measurements_key: key,
        ..state.clone()
    }
}

fn stage_request(
    server: &OperatorServer,
    key: &[u8],
    body: &[u8],
    signature: &[u8],
) -> StageImageMeasurementsRequest {
    let challenge = server.challenge();
    StageImageMeasurementsRequest {
        measurements: body.to_vec(),
        signature: signature.to_vec(),
        challenge: challenge.to_vec(),
        proof: operator_proof(key, STAGE_IMAGE_MEASUREMENTS, &challenge, body)
            .unwrap()
            .to_vec(),
    }
}

/// A request to make the signed file `body` the current set.
fn set_request(
    server: &OperatorServer,
    key: &[u8],
    body: &[u8],
    signature: &[u8],
) -> SetJoinMeasurementsRequest {
    let challenge = server.challenge();
    SetJoinMeasurementsRequest {
        measurements: body.to_vec(),
        signature: signature.to_vec(),
        challenge: challenge.to_vec(),
        proof: operator_proof(key, SET_JOIN_MEASUREMENTS, &challenge, body)
            .unwrap()
            .to_vec(),
    }
}

/// A request to finish the rollout of the set whose SHA-256 is `staged`.
fn finish_request(
    server: &OperatorServer,
    key: &[u8],
    staged: [u8; 32],
) -> FinishImageUpgradeRequest {
    let challenge = server.challenge();
    FinishImageUpgradeRequest {
        challenge: challenge.to_vec(),
        proof: operator_proof(key, FINISH_IMAGE_UPGRADE, &challenge, &staged)
            .unwrap()
            .to_vec(),
        staged_digest: staged.to_vec(),
    }
}

fn refused<T: std::fmt::Debug>(result: Result<T, OperatorError>, code: tonic::Code, case: &str) {
    match result {
        Err(e) => assert_eq!(tonic::Status::from(&e).code(), code, "{case}: {e}"),
        Ok(v) => panic!("{case}: accepted: {v:?}"),
    }
}

/// A join ticket for `node`, over the service's real handshake. The node
/// validates the service by the service's own PCRs (the old image): what
/// this test checks is the service's side. A control plane's ticket carries
/// signed measurements, checked with `key`.
async fn ticket(
    node: &Member,
    ca: &EkCa,
    service: &Service,
    control_plane: bool,
    key: Option<SigningPublicKey>,
) -> Result<JoinTicket, TicketError> {
    let signing_key = key;
    let kubelet = KubeletKey::generate(&node.name).unwrap();
    let request = IssueJoinTicketRequest {
        disk_uuid: join_common::uuid(),
        kubelet_csr: kubelet.csr_pem().as_bytes().to_vec(),
        is_control_plane: control_plane,
        node_name: node.name.clone(),
        file_discovery: true,
    };
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let validator = Validator::new(measurements_of(&service.tpm, &SHARED_PCRS), trust);
    TicketClient::new(node.tpm.clone(), validator, Duration::from_secs(20))
        .with_measurements_key(signing_key)
        .join_ticket(&service.endpoint, request, &kubelet.spki())
        .await
}

async fn admitted(node: &Member, ca: &EkCa, service: &Service) -> bool {
    match ticket(node, ca, service, false, None).await {
        Ok(_) => true,
        Err(TicketError::Connect(ConnectError::RefusedByServer(_))) => false,
        Err(e) => panic!(
            "{}: neither a ticket nor a refusal: {}",
            node.name,
            keel_atls::ErrorChain(&e)
        ),
    }
}

/// Nothing is staged: not in the file the join service reads, the cluster
/// state or the facts on the disk.
fn nothing_staged(service: &Service, root: &Path, case: &str) {
    assert!(
        !staged_path(&service.measurements).exists(),
        "{case}: a staged file was written"
    );
    let state = service.slot.borrow().clone().unwrap();
    assert!(
        state.staged_measurements.is_none(),
        "{case}: staged in state"
    );
    // No facts saved yet is fine; facts that cannot be read are not.
    match ControlPlaneFacts::load(root) {
        Ok(facts) => assert!(
            facts.staged_measurements.is_none(),
            "{case}: staged in facts"
        ),
        Err(keel_agent::cluster::FactsError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("{case}: the facts do not load: {e:?}"),
    }
    assert!(service.policy.reload().is_ok());
    assert!(service.policy.current().staged().is_none(), "{case}");
}

/// The cluster state `service`'s control plane would restore after a
/// reboot from its facts under `root`, its config naming `key`.
fn restored(
    service: &Service,
    root: &Path,
    key: SigningPublicKey,
) -> Result<ClusterState, FactsError> {
    ControlPlaneFacts::load(root)?.into_state(
        service.state.keys.clone(),
        Some(key),
        service.state.api_server,
        service.state.pki_dir.clone(),
    )
}

/// A join service with its operator API, whose facts go under `root`.
struct ControlPlane {
    service: Service,
    port: u16,
    _dir: tempfile::TempDir,
    root: std::path::PathBuf,
    own_ek: keel_verifier::ek::EkDigest,
    server: OperatorServer,
}

async fn control_plane(ca: &EkCa) -> ControlPlane {
    let service = start_service(ca, free_port()).await;
    let port: u16 = service
        .endpoint
        .rsplit_once(':')
        .unwrap()
        .1
        .parse()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let own_ek = join_common::ek_digest(&service.tpm);
    let server = OperatorServer::new(
        OperatorAuth::new(own_ek, service.slot.clone(), Arc::default()),
        service.slot.clone(),
        Some(service.measurements.clone()),
        root.clone(),
        None,
    );
    ControlPlane {
        service,
        port,
        _dir: dir,
        root,
        own_ek,
        server,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_new_image_joins_beside_the_old_until_the_upgrade_finishes() {
    let ca = EkCa::new().unwrap();
    let ControlPlane {
        service,
        port,
        _dir,
        root,
        own_ek,
        server,
    } = control_plane(&ca).await;
    let operator_key = service.state.keys.operator_key(&own_ek).unwrap();
    let operator_key = operator_key.expose();
    // The operator key of another node (another EK): proves nothing here.
    let other_node = service
        .state
        .keys
        .operator_key(&keel_verifier::ek::EkDigest::of_marshalled(b"x"))
        .unwrap();

    // Two nodes of the cluster's config: one of the old image, one of a
    // new image whose UKI (PCR 4) differs.
    let old = member(&ca, port, "w-old", "worker");
    let new = member(&ca, port, "w-new", "worker");
    new.tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(4, &[0x4e; 32])
        .unwrap();
    let new_set = measurements_of(&new.tpm, &[4, 9, 11, 12]);
    let body = format!("{}\n", new_set.to_json()).into_bytes();
    let signing = SigningPrivateKey::generate();
    let signature = signing.sign(&body);
    assert!(admitted(&old, &ca, &service).await);
    assert!(
        !admitted(&new, &ca, &service).await,
        "new image before staging"
    );

    // No signing key configured at init: refused, whatever the request.
    refused(
        server.stage_image_measurements(
            &stage_request(&server, operator_key, &body, &signature),
            None,
        ),
        tonic::Code::FailedPrecondition,
        "no signing key",
    );
    nothing_staged(&service, &root, "no signing key");
    service.slot.send_replace(Some(Arc::new(with_key(
        &service.state,
        Some(signing.public_key()),
    ))));

    // Refused with the key configured, each leaving nothing staged.
    let other = SigningPrivateKey::generate();
    let mut flipped = signature.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    let mut weak: serde_json::Value = serde_json::from_slice(&body).unwrap();
    weak.as_object_mut().unwrap().remove("12").unwrap();
    let weak = serde_json::to_vec(&weak).unwrap();
    let mut no_proof = stage_request(&server, operator_key, &body, &signature);
    no_proof.proof.clear();
    let cases = [
        ("no operator proof", no_proof, tonic::Code::PermissionDenied),
        (
            "another operator key",
            stage_request(&server, &[9; 32], &body, &signature),
            tonic::Code::PermissionDenied,
        ),
        (
            "another node's operator key",
            stage_request(&server, other_node.expose(), &body, &signature),
            tonic::Code::PermissionDenied,
        ),
        (
            "missing signature",
            stage_request(&server, operator_key, &body, &[]),
            tonic::Code::PermissionDenied,
        ),
        (
            "wrong signature",
            stage_request(&server, operator_key, &body, &flipped),
            tonic::Code::PermissionDenied,
        ),
        (
            "signature over other bytes",
            stage_request(&server, operator_key, &body, &signing.sign(b"{}")),
            tonic::Code::PermissionDenied,
        ),
        (
            "signature by another key",
            stage_request(&server, operator_key, &body, &other.sign(&body)),
            tonic::Code::PermissionDenied,
        ),
        (
            "signed file that enforces less (no PCR 12)",
            stage_request(&server, operator_key, &weak, &signing.sign(&weak)),
            tonic::Code::InvalidArgument,
        ),
    ];
    for (case, request, code) in cases {
        refused(server.stage_image_measurements(&request, None), code, case);
        nothing_staged(&service, &root, case);
    }
    refused(
        server.finish_image_upgrade(
            &finish_request(&server, operator_key, new_set.digest()),
            None,
        ),
        tonic::Code::FailedPrecondition,
        "finish with nothing staged",
    );
    nothing_staged(&service, &root, "finish with nothing staged");
    assert!(
        !admitted(&new, &ca, &service).await,
        "new image after refusals"
    );

    // Staged: both images join.
    let good = stage_request(&server, operator_key, &body, &signature);
    let (staged, current) = server.stage_image_measurements(&good, None).unwrap();
    assert_eq!(staged, new_set.digest());
    assert_eq!(current, service.state.join_measurements.digest());
    service.policy.reload().unwrap();
    assert!(
        admitted(&new, &ca, &service).await,
        "new image after staging"
    );
    assert!(
        admitted(&old, &ca, &service).await,
        "old image during rollout"
    );

    // The staged set and the key survive a reboot (the facts) and reach a
    // control plane that joins now (its ticket).
    let rebooted = restored(&service, &root, signing.public_key()).unwrap();
    assert_eq!(rebooted.staged_measurements.as_ref(), Some(&new_set));
    assert_eq!(rebooted.measurements_key, Some(signing.public_key()));
    assert_eq!(rebooted.signed_measurements.len(), 1);
    assert_eq!(rebooted.signed_measurements[0].body(), body.as_slice());
    let cp = member(&ca, port, "cp-1", "control-plane");
    let (_, carried) = ticket(&cp, &ca, &service, true, Some(signing.public_key()))
        .await
        .unwrap()
        .control_plane
        .expect("a control-plane ticket");
    assert_eq!(carried.image.join, service.state.join_measurements);
    assert_eq!(carried.image.staged.as_ref(), Some(&new_set));
    assert_eq!(carried.image.signed.len(), 1, "the staged file, signed");
    assert_eq!(carried.image.signed[0].body(), body.as_slice());
    assert_eq!(carried.image.signed[0].signature(), signature.as_slice());

    // Replayed: the challenge was used; nothing changes.
    refused(
        server.stage_image_measurements(&good, None),
        tonic::Code::PermissionDenied,
        "replayed stage",
    );
    // Finish: a proof for another kind (a stage proof) does not finish.
    let challenge = server.challenge();
    let wrong_kind = FinishImageUpgradeRequest {
        challenge: challenge.to_vec(),
        proof: operator_proof(
            operator_key,
            STAGE_IMAGE_MEASUREMENTS,
            &challenge,
            &new_set.digest(),
        )
        .unwrap()
        .to_vec(),
        staged_digest: new_set.digest().to_vec(),
    };
    // Nor does a finish of another set than the staged one (one staged
    // since the operator's, or left from an earlier rollout), nor one
    // whose named set was changed after the proof.
    let mut moved = finish_request(&server, operator_key, [7; 32]);
    moved.staged_digest = new_set.digest().to_vec();
    let cases = [
        (
            "finish with a stage proof",
            wrong_kind,
            tonic::Code::PermissionDenied,
        ),
        (
            "finish of another set",
            finish_request(&server, operator_key, [7; 32]),
            tonic::Code::FailedPrecondition,
        ),
        (
            "named set changed after the proof",
            moved,
            tonic::Code::PermissionDenied,
        ),
    ];
    for (case, request, code) in cases {
        refused(server.finish_image_upgrade(&request, None), code, case);
        let staged = std::fs::read(staged_path(&service.measurements)).unwrap();
        assert_eq!(Measurements::parse(&staged).unwrap(), new_set, "{case}");
        assert!(
            ControlPlaneFacts::load(&root)
                .unwrap()
                .staged_measurements
                .is_some(),
            "{case}"
        );
    }

    // Finished, though the join service's file cannot be replaced (a
    // directory holds its name): the error says so, and the same finish
    // asked again writes it.
    std::fs::remove_file(&service.measurements).unwrap();
    std::fs::create_dir_all(service.measurements.join("taken")).unwrap();
    let failed = server
        .finish_image_upgrade(
            &finish_request(&server, operator_key, new_set.digest()),
            None,
        )
        .unwrap_err();
    assert!(matches!(failed, OperatorError::Store(_)), "{failed}");
    std::fs::remove_dir_all(&service.measurements).unwrap();
    // Only the new image joins.
    let finish = finish_request(&server, operator_key, new_set.digest());
    assert_eq!(
        server.finish_image_upgrade(&finish, None).unwrap(),
        new_set.digest()
    );
    assert!(!staged_path(&service.measurements).exists());
    assert_eq!(
        Measurements::parse(&std::fs::read(&service.measurements).unwrap()).unwrap(),
        new_set
    );
    let facts = ControlPlaneFacts::load(&root).unwrap();
    assert!(facts.staged_measurements.is_none());
    service.policy.reload().unwrap();
    assert!(service.policy.current().staged().is_none());
    assert!(
        admitted(&new, &ca, &service).await,
        "new image after finish"
    );
    assert!(
        !admitted(&old, &ca, &service).await,
        "old image after finish"
    );
    refused(
        server.finish_image_upgrade(&finish, None),
        tonic::Code::PermissionDenied,
        "replayed finish",
    );
    // Nothing is staged now: a finish of another set is refused, one of
    // the set in force changes nothing.
    refused(
        server.finish_image_upgrade(&finish_request(&server, operator_key, [7; 32]), None),
        tonic::Code::FailedPrecondition,
        "finish with nothing staged",
    );
    assert_eq!(
        server
            .finish_image_upgrade(
                &finish_request(&server, operator_key, new_set.digest()),
                None,
            )
            .unwrap(),
        new_set.digest()
    );
    assert_eq!(
        Measurements::parse(&std::fs::read(&service.measurements).unwrap()).unwrap(),
        new_set
    );
}

/// A ticket for `node`, validating the service as the join client does:
/// its own PCRs, or with `key` the signed image measurements the service
/// presents. `None` when the node refused the service.
async fn joins_as_client(
    node: &Member,
    ca: &EkCa,
    service: &Service,
    key: Option<&SigningPublicKey>,
) -> Option<JoinTicket> {
    let kubelet = KubeletKey::generate(&node.name).unwrap();
    let request = IssueJoinTicketRequest {
        disk_uuid: join_common::uuid(),
        kubelet_csr: kubelet.csr_pem().as_bytes().to_vec(),
        is_control_plane: false,
        node_name: node.name.clone(),
        file_discovery: true,
    };
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let validator = service_validator(&node.tpm, trust, key).unwrap();
    match TicketClient::new(node.tpm.clone(), validator, Duration::from_secs(20))
        .with_measurements_key(key.cloned())
        .join_ticket(&service.endpoint, request, &kubelet.spki())
        .await
    {
        Ok(ticket) => Some(ticket),
        Err(TicketError::Connect(ConnectError::ServerRefused(_))) => None,
        Err(e) => panic!(
            "{}: neither a ticket nor a refusal of the service: {}",
            node.name,
            keel_atls::ErrorChain(&e)
        ),
    }
}

/// What the service's documents present, once its image-presenting task
/// has seen the latest cluster state.
async fn presented(service: &Service, expected: Option<&[u8]>) {
    for _ in 0..250 {
        let now = service
            .tpm
            .lock()
            .unwrap()
            .image()
            .map(|i| i.measurements.clone());
        if now.as_deref() == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the service does not present the expected image measurements");
}

fn present(service: &Service, body: &[u8], signature: &[u8]) {
    service
        .tpm
        .lock()
        .unwrap()
        .present_image(Some(keel_proto::attestation::SignedMeasurements {
            measurements: body.to_vec(),
            signature: signature.to_vec(),
        }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_a_new_image_accepts_a_join_service_presenting_its_signed_image() {
    let ca = EkCa::new().unwrap();
    let ControlPlane {
        service,
        port,
        _dir,
        root,
        own_ek,
        server,
    } = control_plane(&ca).await;
    let operator_key = service.state.keys.operator_key(&own_ek).unwrap();
    let _presenting = tokio::spawn({
        let (slot, tpm) = (service.slot.clone(), service.tpm.clone());
        async move { present_own_image(&slot, tpm).await }
    });

    // The cluster's key signs the service's (old) image, as at init, and
    // the new image, staged by the operator so the service admits its
    // nodes: what is checked here is the joining node's side.
    let signing = SigningPrivateKey::generate();
    let key = signing.public_key();
    let old_body = format!("{}\n", service.state.join_measurements.to_json()).into_bytes();
    let old_signature = signing.sign(&old_body);
    let signed_old = SignedMeasurements::verify(&key, &old_body, &old_signature).unwrap();
    let new = member(&ca, port, "w-new", "worker");
    new.tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(4, &[0x4e; 32])
        .unwrap();
    let new_body =
        format!("{}\n", measurements_of(&new.tpm, &[4, 9, 11, 12]).to_json()).into_bytes();
    let new_signature = signing.sign(&new_body);
    service.slot.send_replace(Some(Arc::new(ClusterState {
        measurements_key: Some(key.clone()),
        signed_measurements: Vec::new(),
        ..(*service.state).clone()
    })));
    server
        .stage_image_measurements(
            &stage_request(&server, operator_key.expose(), &new_body, &new_signature),
            None,
        )
        .unwrap();
    service.policy.reload().unwrap();

    // Only the new image is signed so far: the service (old image) has
    // nothing to present, and the new node refuses it.
    presented(&service, None).await;
    assert!(
        joins_as_client(&new, &ca, &service, Some(&key))
            .await
            .is_none(),
        "a service of an unsigned image"
    );

    // The old image signed too: the service presents it, and the node of
    // the new image accepts the service of the old one.
    change_state::<FactsError>(&service.slot, &root, |state| {
        Ok(state.with_signed(signed_old.clone()))
    })
    .unwrap();
    presented(&service, Some(&old_body)).await;
    assert!(
        joins_as_client(&new, &ca, &service, Some(&key))
            .await
            .is_some(),
        "a service presenting its signed image"
    );
    // Without the key (a config that names none) the node keeps to its own
    // image, and refuses.
    assert!(
        joins_as_client(&new, &ca, &service, None).await.is_none(),
        "no key, another image"
    );

    // What the service presents is checked, not trusted. Each forgery is
    // refused by the joining node:
    let other = SigningPrivateKey::generate();
    let mut flipped = old_signature.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    let mut edited = old_body.clone();
    edited.insert(1, b' ');
    let forgeries: [(&str, &[u8], Vec<u8>); 4] = [
        ("a flipped signature", &old_body, flipped),
        ("another key's signature", &old_body, other.sign(&old_body)),
        (
            "the file edited after signing",
            &edited,
            old_signature.clone(),
        ),
        // Signed, but the image of the joining node, not the service's.
        (
            "a signed set of another image",
            &new_body,
            new_signature.clone(),
        ),
    ];
    for (case, body, signature) in forgeries {
        present(&service, body, &signature);
        assert!(
            joins_as_client(&new, &ca, &service, Some(&key))
                .await
                .is_none(),
            "{case}: accepted"
        );
    }
    present(&service, &old_body, &old_signature);

    // A node whose config PCR differs from the service's is refused even
    // with the service's image signed: the signed set admits an image,
    // never another cluster config.
    let stranger = member(&ca, port, "w-stranger", "worker");
    {
        let mut m = stranger.tpm.lock().unwrap();
        m.tpm().pcr_extend(4, &[0x4e; 32]).unwrap();
        m.tpm().pcr_extend(12, &[0x0c; 32]).unwrap();
    }
    assert!(
        joins_as_client(&stranger, &ca, &service, Some(&key))
            .await
            .is_none(),
        "another config"
    );

    // The signed files outlive a reboot (the facts) and reach a control
    // plane that joins now, which checks them with its own config's key.
    let rebooted = restored(&service, &root, key.clone()).unwrap();
    assert_eq!(rebooted.signed_measurements.len(), 2);
    assert!(restored(&service, &root, other.public_key()).is_err());
    let cp = member(&ca, port, "cp-1", "control-plane");
    let (_, carried) = ticket(&cp, &ca, &service, true, Some(key.clone()))
        .await
        .unwrap()
        .control_plane
        .expect("a control-plane ticket");
    assert_eq!(carried.image.signed.len(), 2);
    assert!(
        ticket(&cp, &ca, &service, true, Some(other.public_key()))
            .await
            .is_err(),
        "signed files another key does not verify"
    );

    // Finished: the old image's signed file goes; the service (still the
    // old image) has nothing to present, and the new node refuses it.
    server
        .finish_image_upgrade(
            &finish_request(
                &server,
                operator_key.expose(),
                Measurements::parse(&new_body).unwrap().digest(),
            ),
            None,
        )
        .unwrap();
    presented(&service, None).await;
    assert_eq!(
        service.slot.borrow().clone().unwrap().signed_measurements,
        vec![SignedMeasurements::verify(&key, &new_body, &new_signature).unwrap()]
    );
}

/// Attacker's move: the host boots a join service of the cluster's image
/// and makes its firmware run a driver of its own (an option ROM, a
/// `Driver####` variable), which can patch the kernel after it was
/// measured, and presents a file the operator signed without PCR 2 (before
/// PCR 2 was predicted, or for a platform that loads drivers by design).
/// A joining node whose own firmware ran none holds the service to PCR 2
/// through the signed file too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_image_without_pcr_2_lets_no_service_whose_firmware_ran_a_driver_through() {
    use sha2::{Digest as _, Sha256};
    let ca = EkCa::new().unwrap();
    let ControlPlane {
        service,
        port,
        _dir,
        ..
    } = control_plane(&ca).await;
    let separator: [u8; 32] = Sha256::digest([0u8; 4]).into();
    let node = member(&ca, port, "w-1", "worker");
    // Both firmwares ran no driver: PCR 2 holds the separator alone.
    for tpm in [&service.tpm, &node.tpm] {
        tpm.lock().unwrap().tpm().pcr_extend(2, &separator).unwrap();
    }
    let signing = SigningPrivateKey::generate();
    let key = signing.public_key();
    let body = format!(
        "{}\n",
        measurements_of(&service.tpm, &[4, 9, 11, 12]).to_json()
    )
    .into_bytes();
    present(&service, &body, &signing.sign(&body));
    assert!(
        joins_as_client(&node, &ca, &service, Some(&key))
            .await
            .is_some(),
        "a service of the node's image"
    );

    service
        .tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(2, &[0xd5; 32])
        .unwrap();
    assert!(
        joins_as_client(&node, &ca, &service, Some(&key))
            .await
            .is_none(),
        "a service whose firmware ran a driver, presenting a file without PCR 2"
    );
}

/// Staging again (a corrected build, another candidate) retires the set it
/// replaces with its signed file, never the current image's: control
/// planes of the current image keep presenting it to nodes of the new one
/// however often the operator stages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_again_keeps_the_current_images_signed_file() {
    let ca = EkCa::new().unwrap();
    let ControlPlane {
        service,
        port,
        _dir,
        root: _,
        own_ek,
        server,
    } = control_plane(&ca).await;
    let operator_key = service.state.keys.operator_key(&own_ek).unwrap();
    let signing = SigningPrivateKey::generate();
    // As init leaves it: the current set signed.
    let current_body = format!("{}\n", service.state.join_measurements.to_json()).into_bytes();
    let current = SignedMeasurements::verify(
        &signing.public_key(),
        &current_body,
        &signing.sign(&current_body),
    )
    .unwrap();
    service.slot.send_replace(Some(Arc::new(
        with_key(&service.state, Some(signing.public_key())).with_signed(current.clone()),
    )));

    // Five candidates in turn, each a build whose UKI (PCR 4) differs.
    let candidate = member(&ca, port, "w-new", "worker");
    let mut last = Vec::new();
    for i in 0..5u8 {
        candidate
            .tpm
            .lock()
            .unwrap()
            .tpm()
            .pcr_extend(4, &[i; 32])
            .unwrap();
        last = format!(
            "{}\n",
            measurements_of(&candidate.tpm, &[4, 9, 11, 12]).to_json()
        )
        .into_bytes();
        let signature = signing.sign(&last);
        server
            .stage_image_measurements(
                &stage_request(&server, operator_key.expose(), &last, &signature),
                None,
            )
            .unwrap();
    }
    let state = service.slot.borrow().clone().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let held: Vec<String> = state
        .signed_measurements
        .iter()
        .map(|s| text(s.body()))
        .collect();
    assert_eq!(held, [text(&current_body), text(&last)]);
}

/// An image rollback: the operator's credentials (the master secret) are
/// enough to stage, finish or set any file the measurements signing key
/// ever signed, so the files carry an epoch and a control plane takes none
/// below the highest epoch it made current. The old image's own signed
/// file, bytes and signature intact, is refused once a newer image is
/// current: staged, set, or finished after a staging. The floor survives a
/// reboot (the facts) and reaches a control plane that joins (its ticket),
/// and a set never passes the staged image's epoch, which could then never
/// be finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_older_than_one_made_current_is_not_brought_back() {
    let ca = EkCa::new().unwrap();
    let ControlPlane {
        service,
        port,
        _dir,
        root,
        own_ek,
        server,
    } = control_plane(&ca).await;
    let operator_key = service.state.keys.operator_key(&own_ek).unwrap();
    let key = operator_key.expose();
    let signing = SigningPrivateKey::generate();
    let sign = |set: &Measurements, epoch: u64| {
        let body = format!("{}\n", set.to_json_with_epoch(epoch)).into_bytes();
        let signature = signing.sign(&body);
        (body, signature)
    };
    // As init leaves it: the current image (A) signed at epoch 1.
    let image_a = service.state.join_measurements.clone();
    let (a_body, a_signature) = sign(&image_a, 1);
    let current = SignedMeasurements::verify(&signing.public_key(), &a_body, &a_signature).unwrap();
    assert_eq!(current.epoch(), 1);
    // Init (and a control-plane ticket) raise the floor to the current
    // set's epoch.
    let initial = with_key(&service.state, Some(signing.public_key()))
        .with_signed(current)
        .with_floor(0);
    assert_eq!(initial.image_epoch, 1);
    service.slot.send_replace(Some(Arc::new(initial.clone())));
    let floor = || service.slot.borrow().clone().unwrap().image_epoch;
    let current_set = || {
        service
            .slot
            .borrow()
            .clone()
            .unwrap()
            .join_measurements
            .clone()
    };

    // A new image (B): its UKI, PCR 4, differs.
    let node_b = member(&ca, port, "w-b", "worker");
    node_b
        .tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(4, &[0xb; 32])
        .unwrap();
    let image_b = measurements_of(&node_b.tpm, &[4, 9, 11, 12]);

    // B signed below the current image's epoch: a file from before A.
    let (body, signature) = sign(&image_b, 0);
    let refusal = server
        .stage_image_measurements(&stage_request(&server, key, &body, &signature), None)
        .unwrap_err();
    assert!(
        matches!(refusal, OperatorError::Rollback { epoch: 0, floor: 1 }),
        "{refusal:?}"
    );
    assert_eq!(
        tonic::Status::from(&refusal).code(),
        tonic::Code::FailedPrecondition
    );
    assert!(refusal.to_string().contains("at least 1"), "{refusal}");
    nothing_staged(&service, &root, "B below the floor");
    assert!(!admitted(&node_b, &ca, &service).await, "B admitted");

    // B at epoch 2 stages and finishes: the floor is B's epoch.
    let (b_body, b_signature) = sign(&image_b, 2);
    let (staged, _) = server
        .stage_image_measurements(&stage_request(&server, key, &b_body, &b_signature), None)
        .unwrap();
    assert_eq!(floor(), 1, "staging alone keeps the floor");
    // Staged again in an older file of B (epoch 1, at the floor): refused,
    // since the finish names only the set and would take its floor from
    // the older file; the same file again is taken.
    let (b_older, b_older_signature) = sign(&image_b, 1);
    let refusal = server
        .stage_image_measurements(
            &stage_request(&server, key, &b_older, &b_older_signature),
            None,
        )
        .unwrap_err();
    assert!(
        matches!(refusal, OperatorError::RestagedOlder { held: 2, epoch: 1 }),
        "{refusal:?}"
    );
    assert_eq!(
        tonic::Status::from(&refusal).code(),
        tonic::Code::FailedPrecondition
    );
    server
        .stage_image_measurements(&stage_request(&server, key, &b_body, &b_signature), None)
        .unwrap();
    assert_eq!(service.slot.borrow().clone().unwrap().epoch_of(&image_b), 2);
    server
        .finish_image_upgrade(&finish_request(&server, key, staged), None)
        .unwrap();
    assert_eq!((current_set(), floor()), (image_b.clone(), 2));
    service.policy.reload().unwrap();
    assert!(admitted(&node_b, &ca, &service).await, "B refused");

    // The current image staged again in another file (here at a higher
    // epoch, which would replace the file it was made current with):
    // refused. In its own file, as a retried `upgrade apply` sends it:
    // nothing to stage, no error.
    let (body, signature) = sign(&image_b, 9);
    let refusal = server
        .stage_image_measurements(&stage_request(&server, key, &body, &signature), None)
        .unwrap_err();
    assert!(
        matches!(refusal, OperatorError::AlreadyCurrent),
        "{refusal:?}"
    );
    nothing_staged(&service, &root, "the current set in another file");
    assert_eq!(service.slot.borrow().clone().unwrap().epoch_of(&image_b), 2);
    let b_digest = image_b.digest();
    assert_eq!(
        server
            .stage_image_measurements(&stage_request(&server, key, &b_body, &b_signature), None)
            .unwrap(),
        (b_digest, b_digest)
    );
    nothing_staged(&service, &root, "the current set in its own file");

    // The old image's own file, exactly as signed, is not brought back:
    // neither staged nor set.
    refused(
        server.stage_image_measurements(&stage_request(&server, key, &a_body, &a_signature), None),
        tonic::Code::FailedPrecondition,
        "A staged again",
    );
    nothing_staged(&service, &root, "A staged again");
    refused(
        server.set_join_measurements(&set_request(&server, key, &a_body, &a_signature), None),
        tonic::Code::FailedPrecondition,
        "A set again",
    );
    assert_eq!((current_set(), floor()), (image_b.clone(), 2));
    let node_a = member(&ca, port, "w-a", "worker");
    service.policy.reload().unwrap();
    assert!(!admitted(&node_a, &ca, &service).await, "A admitted");

    // The floor survives a reboot and reaches a control plane that joins.
    let facts_path = root.join(keel_agent::paths::CONTROL_PLANE_FACTS);
    let facts: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&facts_path).unwrap()).unwrap();
    assert_eq!(facts["image_epoch"], 2);
    assert_eq!(
        restored(&service, &root, signing.public_key())
            .unwrap()
            .image_epoch,
        2
    );
    // Facts an agent before epochs wrote (no floor): the current image's
    // epoch is the floor.
    let mut older = facts.clone();
    older.as_object_mut().unwrap().remove("image_epoch");
    std::fs::write(&facts_path, serde_json::to_vec(&older).unwrap()).unwrap();
    assert_eq!(
        restored(&service, &root, signing.public_key())
            .unwrap()
            .image_epoch,
        2
    );
    std::fs::write(&facts_path, serde_json::to_vec(&facts).unwrap()).unwrap();
    let cp = member(&ca, port, "cp-1", "control-plane");
    cp.tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(4, &[0xb; 32])
        .unwrap();
    let (_, carried) = ticket(&cp, &ca, &service, true, Some(signing.public_key()))
        .await
        .unwrap()
        .control_plane
        .expect("a control-plane ticket");
    assert_eq!(carried.image.floor, 2);

    // A control plane whose state disk holds the state from before B (the
    // host wrote an earlier copy back) rejoins: its ticket carries the
    // issuer's images, and the state it restored takes them, floor and
    // all, so it no longer admits A. A state at or above the issuer's
    // floor keeps its own, and a worker's ticket carries no images.
    let rejoin = |node: &Member, role: Role| {
        let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
        let validator = Validator::new(measurements_of(&service.tpm, &SHARED_PCRS), trust);
        let client = TicketClient::new(node.tpm.clone(), validator, Duration::from_secs(20))
            .for_role(role)
            .with_measurements_key(Some(signing.public_key()));
        let endpoint = service.endpoint.clone();
        async move { client.rejoin_ticket(&endpoint, &join_common::uuid()).await }
    };
    let image = rejoin(&cp, Role::ControlPlane)
        .await
        .unwrap()
        .image
        .expect("a control plane's rejoin ticket carries the issuer's images");
    assert_eq!((&image.join, image.floor), (&image_b, 2));
    assert_eq!(image.signed.len(), 1, "B's file; A's was retired");
    let stale = initial.clone();
    assert!(stale.accepts_image(&pcrs_of(&image_a)));
    let (taken, was_newer) = stale.with_newer_image(image.clone());
    assert!(was_newer);
    assert_eq!((&taken.join_measurements, taken.image_epoch), (&image_b, 2));
    assert!(!taken.accepts_image(&pcrs_of(&image_a)), "A still admitted");
    assert!(taken.accepts_image(&pcrs_of(&image_b)));
    assert_eq!(taken.epoch_of(&image_b), 2);
    let current = service.slot.borrow().clone().unwrap();
    let (kept, was_newer) = (*current).clone().with_newer_image(initial.image_state());
    assert!(!was_newer, "an older issuer's images taken");
    assert_eq!((&kept.join_measurements, kept.image_epoch), (&image_b, 2));
    let (kept, was_newer) = (*current).clone().with_newer_image(image);
    assert!(!was_newer, "images at the same floor taken");
    assert_eq!(kept.image_epoch, 2);
    let worker = rejoin(&node_b, Role::Worker).await.unwrap();
    assert!(worker.image.is_none());

    // A rollout withdrawn: D staged, then the current image's own file
    // staged again unstages D (its signed file goes too); D's nodes are
    // refused again.
    let node_d = member(&ca, port, "w-d", "worker");
    node_d
        .tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(4, &[0xd; 32])
        .unwrap();
    let image_d = measurements_of(&node_d.tpm, &[4, 9, 11, 12]);
    let (d_body, d_signature) = sign(&image_d, 2);
    server
        .stage_image_measurements(&stage_request(&server, key, &d_body, &d_signature), None)
        .unwrap();
    service.policy.reload().unwrap();
    assert!(admitted(&node_d, &ca, &service).await, "staged D refused");
    server
        .stage_image_measurements(&stage_request(&server, key, &b_body, &b_signature), None)
        .unwrap();
    nothing_staged(&service, &root, "D withdrawn");
    assert_eq!(service.slot.borrow().clone().unwrap().epoch_of(&image_d), 0);
    assert!(
        !admitted(&node_d, &ca, &service).await,
        "withdrawn D admitted"
    );

    // C staged at epoch 3; a set of B re-signed at epoch 4 would leave C
    // unfinishable below the floor: refused, C still staged. At epoch 3
    // (equal) B is set; C then finishes.
    let node_c = member(&ca, port, "w-c", "worker");
    node_c
        .tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(4, &[0xc; 32])
        .unwrap();
    let image_c = measurements_of(&node_c.tpm, &[4, 9, 11, 12]);
    let (c_body, c_signature) = sign(&image_c, 3);
    let (staged_c, _) = server
        .stage_image_measurements(&stage_request(&server, key, &c_body, &c_signature), None)
        .unwrap();
    let (body, signature) = sign(&image_b, 4);
    let refusal = server
        .set_join_measurements(&set_request(&server, key, &body, &signature), None)
        .unwrap_err();
    assert!(
        matches!(
            refusal,
            OperatorError::StagedOlder {
                staged: 3,
                epoch: 4
            }
        ),
        "{refusal:?}"
    );
    assert_eq!(floor(), 2);
    let (body, signature) = sign(&image_b, 3);
    server
        .set_join_measurements(&set_request(&server, key, &body, &signature), None)
        .unwrap();
    assert_eq!((current_set(), floor()), (image_b.clone(), 3));
    server
        .finish_image_upgrade(&finish_request(&server, key, staged_c), None)
        .unwrap();
    assert_eq!((current_set(), floor()), (image_c, 3));
}
