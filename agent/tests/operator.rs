//! The operator API of a control plane: only a proof made with the operator
//! key, for a challenge this node issued and only once, replaces the join
//! measurements; with a measurements signing key configured, only a file
//! signed with it does; everything else is refused and changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use join_common::{boot_measurements, boot_measurements_with, free_port};
use keel_agent::cluster::{ClusterSlot, ClusterState, ControlPlaneFacts};
use keel_agent::operator::{OperatorAuth, OperatorError, OperatorServer, SET_JOIN_MEASUREMENTS};
use keel_proto::operator::SetJoinMeasurementsRequest;
use keel_testkit::swtpm::EkCa;
use keel_verifier::ek::EkDigest;
use keel_verifier::keys::operator_proof;
use keel_verifier::measurements::{Expected, Measurements};
use keel_verifier::signature::SigningPrivateKey;

fn request(challenge: &[u8; 32], key: &[u8], body: &[u8]) -> SetJoinMeasurementsRequest {
    signed(challenge, key, body, &[])
}

/// [`request`] carrying `signature`.
fn signed(
    challenge: &[u8; 32],
    key: &[u8],
    body: &[u8],
    signature: &[u8],
) -> SetJoinMeasurementsRequest {
    SetJoinMeasurementsRequest {
        measurements: body.to_vec(),
        challenge: challenge.to_vec(),
        proof: operator_proof(key, SET_JOIN_MEASUREMENTS, challenge, body)
            .unwrap()
            .to_vec(),
        signature: signature.to_vec(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_replaces_the_join_measurements_once_per_challenge() {
    let ca = EkCa::new().unwrap();
    let service = join_common::start_service(&ca, free_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("work/join-measurements.json");
    let slot = Arc::new(ClusterSlot::new(None));
    let own_ek = join_common::ek_digest(&service.tpm);
    // An address that sent a wrong proof waits an hour: the test never
    // outlasts its throttle, however slow the runner.
    let hour = Duration::from_secs(3600);
    let auth =
        OperatorAuth::new(own_ek, slot.clone(), Arc::default()).with_failure_backoff(hour, hour);
    let server = OperatorServer::new(
        auth,
        slot.clone(),
        Some(path.clone()),
        dir.path().join("root"),
        None,
    );
    let key = service.state.keys.operator_key(&own_ek).unwrap();
    let key = key.expose();
    // Another node's key (another EK) proves nothing here.
    let other_node = service
        .state
        .keys
        .operator_key(&EkDigest::of_marshalled(b"x"))
        .unwrap();
    let new = boot_measurements_with(&service.config, [(13, Expected::warn_only([7; 32]))])
        .to_json()
        .into_bytes();
    let refused = |result: Result<[u8; 32], OperatorError>, code: tonic::Code| match result {
        Err(e) => assert_eq!(tonic::Status::from(&e).code(), code, "{e}"),
        Ok(_) => panic!("accepted"),
    };

    // A node that serves no cluster yet takes nothing.
    let c = server.challenge();
    refused(
        server.set_join_measurements(&request(&c, key, &new), None),
        tonic::Code::FailedPrecondition,
    );
    slot.send_replace(Some(service.state.clone()));

    // Another key, another node's key, a proof over other bytes than those
    // sent, a challenge never issued.
    let c = server.challenge();
    refused(
        server.set_join_measurements(&request(&c, &[9; 32], &new), None),
        tonic::Code::PermissionDenied,
    );
    let tried = server.challenge();
    refused(
        server.set_join_measurements(&request(&tried, other_node.expose(), &new), None),
        tonic::Code::PermissionDenied,
    );
    let c = server.challenge();
    let mut swapped = request(&c, key, &new);
    swapped.measurements = boot_measurements(&service.config).to_json().into_bytes();
    refused(
        server.set_join_measurements(&swapped, None),
        tonic::Code::PermissionDenied,
    );
    refused(
        server.set_join_measurements(&request(&[1; 32], key, &new), None),
        tonic::Code::PermissionDenied,
    );
    assert!(!path.exists(), "a refused request wrote the measurements");

    // A flood of challenges (anyone may ask) takes no one's away, and a
    // wrong proof does not spend one: the operator's challenge, asked for
    // before both, still works.
    for _ in 0..10_000 {
        server.challenge();
    }
    // The operator: replaced in the file the join service reads, in the
    // facts on the disk and in the state the next tickets come from.
    let good = request(&tried, key, &new);
    let digest = server.set_join_measurements(&good, None).unwrap();
    let expected = Measurements::parse(&new).unwrap();
    assert_eq!(
        Measurements::parse(&std::fs::read(&path).unwrap()).unwrap(),
        expected
    );
    let written: [u8; 32] =
        <sha2::Sha256 as sha2::Digest>::digest(std::fs::read(&path).unwrap()).into();
    assert_eq!(digest, written);
    assert_eq!(slot.borrow().clone().unwrap().join_measurements, expected);
    let facts = ControlPlaneFacts::load(&dir.path().join("root")).unwrap();
    assert_eq!(
        Measurements::parse(facts.join_measurements.to_string().as_bytes()).unwrap(),
        expected
    );

    // Replayed: the challenge was used.
    refused(
        server.set_join_measurements(&good, None),
        tonic::Code::PermissionDenied,
    );
    // A file that enforces less (PCR 12 missing) is refused, even from the
    // operator, and the one in force stays.
    let mut weak: serde_json::Value = serde_json::from_slice(&new).unwrap();
    weak.as_object_mut()
        .unwrap()
        .remove("12")
        .expect("no PCR 12 entry");
    let weak = serde_json::to_vec(&weak).unwrap();
    let c = server.challenge();
    refused(
        server.set_join_measurements(&request(&c, key, &weak), None),
        tonic::Code::InvalidArgument,
    );
    assert_eq!(
        Measurements::parse(&std::fs::read(&path).unwrap()).unwrap(),
        expected
    );

    // The facts cannot be saved (a full disk; here a directory in the
    // file's place): the change fails and the join service keeps
    // enforcing the set in force, which a reboot would keep too.
    let facts = dir
        .path()
        .join("root")
        .join(keel_agent::paths::CONTROL_PLANE_FACTS);
    std::fs::remove_file(&facts).unwrap();
    std::fs::create_dir(&facts).unwrap();
    let other = boot_measurements_with(&service.config, [(13, Expected::warn_only([8; 32]))])
        .to_json()
        .into_bytes();
    let c = server.challenge();
    assert!(server
        .set_join_measurements(&request(&c, key, &other), None)
        .is_err());
    assert_eq!(
        Measurements::parse(&std::fs::read(&path).unwrap()).unwrap(),
        expected
    );
    std::fs::remove_dir(&facts).unwrap();

    // Guessing from one address: after the first wrong proof, its next
    // wrong proofs are refused as throttled (neither counted nor logged).
    let guesser: IpAddr = "192.0.2.9".parse().unwrap();
    let c = server.challenge();
    refused(
        server.set_join_measurements(&request(&c, &[3; 32], &new), Some(guesser)),
        tonic::Code::PermissionDenied,
    );
    let c = server.challenge();
    refused(
        server.set_join_measurements(&request(&c, &[3; 32], &new), Some(guesser)),
        tonic::Code::ResourceExhausted,
    );
    // Attacker's move: keep the operator from acting by sending wrong
    // proofs from the operator's own address (a shared NAT). The
    // operator's valid proof is accepted all the same, while the address
    // waits, and its success clears the address's count: the next wrong
    // proof is counted again, not throttled.
    let c = server.challenge();
    server
        .set_join_measurements(&request(&c, key, &new), Some(guesser))
        .unwrap();
    let c = server.challenge();
    refused(
        server.set_join_measurements(&request(&c, &[3; 32], &new), Some(guesser)),
        tonic::Code::PermissionDenied,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_signing_key_only_a_signed_file_replaces_the_join_measurements() {
    let ca = EkCa::new().unwrap();
    let service = join_common::start_service(&ca, free_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("work/join-measurements.json");
    let root = dir.path().join("root");
    let signing = SigningPrivateKey::generate();
    let state = ClusterState {
        measurements_key: Some(signing.public_key()),
        ..(*service.state).clone()
    };
    let slot = Arc::new(ClusterSlot::new(Some(Arc::new(state.clone()))));
    let own_ek = join_common::ek_digest(&service.tpm);
    let auth = OperatorAuth::new(own_ek, slot.clone(), Arc::default());
    let server = OperatorServer::new(auth, slot.clone(), Some(path.clone()), root.clone(), None);
    let key = service.state.keys.operator_key(&own_ek).unwrap();
    let key = key.expose();
    let new = format!(
        "{}\n",
        boot_measurements_with(&service.config, [(13, Expected::warn_only([7; 32]))]).to_json()
    )
    .into_bytes();
    let signature = signing.sign(&new);
    let mut flipped = signature.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    let mut weak: serde_json::Value = serde_json::from_slice(&new).unwrap();
    weak.as_object_mut().unwrap().remove("12").unwrap();
    let weak = serde_json::to_vec(&weak).unwrap();
    let padded = [new.as_slice(), b" "].concat();
    let unchanged = |case: &str| {
        assert!(!path.exists(), "{case}: the measurements file was written");
        let now = slot.borrow().clone().unwrap();
        assert_eq!(now.join_measurements, state.join_measurements, "{case}");
        assert!(now.signed_measurements.is_empty(), "{case}");
        assert!(
            ControlPlaneFacts::load(&root).is_err(),
            "{case}: facts written"
        );
    };

    // The operator's proof is valid in every case; the signature is not.
    let cases: [(&str, &[u8], Vec<u8>, tonic::Code); 6] = [
        ("unsigned", &new, Vec::new(), tonic::Code::PermissionDenied),
        (
            "wrong signature",
            &new,
            flipped,
            tonic::Code::PermissionDenied,
        ),
        (
            "signature over other bytes",
            &new,
            signing.sign(b"{}"),
            tonic::Code::PermissionDenied,
        ),
        (
            "signature by another key",
            &new,
            SigningPrivateKey::generate().sign(&new),
            tonic::Code::PermissionDenied,
        ),
        (
            "signature of the file with a byte added",
            &padded,
            signature.clone(),
            tonic::Code::PermissionDenied,
        ),
        (
            "signed file that enforces less (no PCR 12)",
            &weak,
            signing.sign(&weak),
            tonic::Code::InvalidArgument,
        ),
    ];
    for (case, body, sig, code) in cases {
        let c = server.challenge();
        match server.set_join_measurements(&signed(&c, key, body, &sig), None) {
            Err(e) => {
                let status = tonic::Status::from(&e);
                assert_eq!(status.code(), code, "{case}: {e}");
                if code == tonic::Code::PermissionDenied {
                    assert!(status.message().contains("signing key"), "{case}: {e}");
                }
            }
            Ok(_) => panic!("{case}: accepted"),
        }
        unchanged(case);
    }

    // Signed: replaced everywhere, and its signed file is the one kept.
    let c = server.challenge();
    let digest = server
        .set_join_measurements(&signed(&c, key, &new, &signature), None)
        .unwrap();
    let expected = Measurements::parse(&new).unwrap();
    assert_eq!(digest, expected.digest());
    assert_eq!(
        Measurements::parse(&std::fs::read(&path).unwrap()).unwrap(),
        expected
    );
    let now = slot.borrow().clone().unwrap();
    assert_eq!(now.join_measurements, expected);
    assert_eq!(now.signed_measurements.len(), 1);
    assert_eq!(now.signed_measurements[0].body(), new.as_slice());
    assert_eq!(now.signed_measurements[0].signature(), signature.as_slice());
    let facts = ControlPlaneFacts::load(&root).unwrap();
    assert_eq!(
        Measurements::parse(facts.join_measurements.to_string().as_bytes()).unwrap(),
        expected
    );
}

/// A change of the cluster state (an upgrade's, an operator request's)
/// does not hold readers up while it is worked out: the join port's
/// handshakes and the evidence service read the state in force meanwhile
/// (here from another thread, during the change's update), and see the new
/// state once its facts are saved. The save runs outside the readers' lock
/// too, after the update; the test reads during the update only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_see_the_state_in_force_while_a_change_is_made() {
    #[derive(Debug)]
    enum Failed {
        Facts(#[allow(dead_code)] keel_agent::cluster::FactsError),
        ReaderHeldUp,
    }
    impl From<keel_agent::cluster::FactsError> for Failed {
        fn from(e: keel_agent::cluster::FactsError) -> Self {
            Failed::Facts(e)
        }
    }
    let ca = EkCa::new().unwrap();
    let service = join_common::start_service(&ca, free_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let slot = service.slot.clone();
    let before = slot.borrow().as_ref().unwrap().image_epoch;
    let root = dir.path().to_owned();
    let changed = tokio::task::spawn_blocking(move || {
        keel_agent::cluster::change_state(&slot, &root, |state| {
            // Another thread reads the slot while this change is made.
            let (seen, reader) = (std::sync::mpsc::channel(), slot.clone());
            std::thread::spawn(move || {
                let epoch = reader.borrow().as_ref().map(|s| s.image_epoch);
                seen.0.send(epoch).unwrap();
            });
            match seen.1.recv_timeout(std::time::Duration::from_secs(10)) {
                Ok(Some(epoch)) if epoch == before => Ok(ClusterState {
                    image_epoch: before + 1,
                    ..state.clone()
                }),
                _ => Err(Failed::ReaderHeldUp),
            }
        })
    })
    .await
    .unwrap()
    .unwrap()
    .unwrap();
    assert_eq!(changed.image_epoch, before + 1);
    assert_eq!(
        service.slot.borrow().as_ref().unwrap().image_epoch,
        before + 1
    );
    assert_eq!(
        ControlPlaneFacts::load(dir.path()).unwrap().image_epoch,
        before + 1
    );
}
