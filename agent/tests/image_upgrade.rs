//! An image upgrade on a control plane, each node with its own swtpm and
//! over real mutual aTLS: a node of a new image (PCR 4 differs) joins only
//! once the operator staged the new image's signed measurements; nodes of
//! the old image join during the rollout and no longer after it finished.
//! Every refused request (no signing key at init, no or a replayed proof,
//! a wrong, missing or foreign signature, a file that enforces less, a
//! finish with nothing staged) changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use join_common::{free_port, measurements_of, member, start_service, Member, Service};
use keel_agent::attestation::policy::staged_path;
use keel_agent::cluster::{ClusterState, ControlPlaneFacts};
use keel_agent::join::settings::SHARED_PCRS;
use keel_agent::join::{JoinTicket, KubeletKey, TicketClient, TicketError};
use keel_agent::operator::{
    OperatorAuth, OperatorError, OperatorServer, FINISH_IMAGE_UPGRADE, STAGE_IMAGE_MEASUREMENTS,
};
use keel_atls::ConnectError;
use keel_proto::join::IssueJoinTicketRequest;
use keel_proto::operator::{FinishImageUpgradeRequest, StageImageMeasurementsRequest};
use keel_testkit::swtpm::EkCa;
use keel_verifier::ek::EkTrust;
use keel_verifier::keys::operator_proof;
use keel_verifier::measurements::Measurements;
use keel_verifier::signature::{SigningPrivateKey, SigningPublicKey};
use keel_verifier::validator::Validator;

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

fn finish_request(server: &OperatorServer, key: &[u8]) -> FinishImageUpgradeRequest {
    let challenge = server.challenge();
    FinishImageUpgradeRequest {
        challenge: challenge.to_vec(),
        proof: operator_proof(key, FINISH_IMAGE_UPGRADE, &challenge, &[])
            .unwrap()
            .to_vec(),
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
/// this test checks is the service's side.
async fn ticket(
    node: &Member,
    ca: &EkCa,
    service: &Service,
    control_plane: bool,
) -> Result<JoinTicket, TicketError> {
    let key = KubeletKey::generate(&node.name).unwrap();
    let request = IssueJoinTicketRequest {
        disk_uuid: join_common::uuid(),
        kubelet_csr: key.csr_pem().as_bytes().to_vec(),
        is_control_plane: control_plane,
        node_name: node.name.clone(),
    };
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let validator = Validator::new(measurements_of(&service.tpm, &SHARED_PCRS), trust);
    TicketClient::new(node.tpm.clone(), validator, Duration::from_secs(20))
        .join_ticket(&service.endpoint, request, &key.spki())
        .await
}

async fn admitted(node: &Member, ca: &EkCa, service: &Service) -> bool {
    match ticket(node, ca, service, false).await {
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
    if let Ok(facts) = ControlPlaneFacts::load(root) {
        assert!(
            facts.staged_measurements.is_none(),
            "{case}: staged in facts"
        );
    }
    assert!(service.policy.reload().is_ok());
    assert!(service.policy.current().staged().is_none(), "{case}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_new_image_joins_beside_the_old_until_the_upgrade_finishes() {
    let ca = EkCa::new().unwrap();
    let service = start_service(&ca, free_port()).await;
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
    let auth = OperatorAuth::new(own_ek, service.slot.clone(), Arc::default());
    let server = OperatorServer::new(
        auth,
        service.slot.clone(),
        Some(service.measurements.clone()),
        root.clone(),
        None,
    );
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
        server.finish_image_upgrade(&finish_request(&server, operator_key), None),
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
    let facts = ControlPlaneFacts::load(&root).unwrap();
    let rebooted = facts
        .into_state(
            service.state.keys.clone(),
            service.state.api_server,
            service.state.pki_dir.clone(),
        )
        .unwrap();
    assert_eq!(rebooted.staged_measurements.as_ref(), Some(&new_set));
    assert_eq!(rebooted.measurements_key, Some(signing.public_key()));
    let cp = member(&ca, port, "cp-1", "control-plane");
    let (_, carried) = ticket(&cp, &ca, &service, true)
        .await
        .unwrap()
        .control_plane
        .expect("a control-plane ticket");
    assert_eq!(carried.join, service.state.join_measurements);
    assert_eq!(carried.staged.as_ref(), Some(&new_set));
    assert_eq!(carried.signing_key, Some(signing.public_key()));

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
        proof: operator_proof(operator_key, STAGE_IMAGE_MEASUREMENTS, &challenge, &[])
            .unwrap()
            .to_vec(),
    };
    refused(
        server.finish_image_upgrade(&wrong_kind, None),
        tonic::Code::PermissionDenied,
        "finish with a stage proof",
    );
    assert!(staged_path(&service.measurements).exists());

    // Finished: only the new image joins.
    let finish = finish_request(&server, operator_key);
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
    refused(
        server.finish_image_upgrade(&finish_request(&server, operator_key), None),
        tonic::Code::FailedPrecondition,
        "second finish",
    );
}
