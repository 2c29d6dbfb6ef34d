//! Init and join racing on one unlocked node: both go through the node
//! lock, exactly one takes it, and the other changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use join_common::{boot_measurements, free_port, joiner, stand_in_components, start_service_with};
use keel_agent::disk::{Cryptsetup, PROVISIONED_LABEL};
use keel_agent::join::JoinOutcome;
use keel_proto::init::init_service_server::InitService;
use keel_proto::init::{InitRequest, InitSecrets};
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::EkCa;
use keel_verifier::measurement::EventType;
use prost::Message as _;

const SECRET: &[u8] = b"init secret of the racing node";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_and_join_racing_lock_once() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let _service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    // An init that wins installs the same stand-ins from the mirror.
    let components: Vec<keel_proto::components::Component> = stand_in_components(&mirror)
        .into_iter()
        .map(Into::into)
        .collect();

    for round in 0..3 {
        let node = joiner(&ca, &ca, port, &format!("racer-{round}"), "worker");
        // The init server of the same node (it accepts init: an init secret hash).
        let init = node.init_server(SECRET, true);
        let sealed = node.sealed(
            &InitSecrets {
                init_secret: SECRET.to_vec(),
                master_secret: vec![7; 32],
            }
            .encode_to_vec(),
        );
        let request = InitRequest {
            secrets: Some(sealed),
            master_salt: vec![1; 32],
            measurement_salt: vec![2; 32],
            kubernetes_version: "v1.31".into(),
            cluster_name: "race".into(),
            join_measurements: boot_measurements(&node.config).to_json().into_bytes(),
            kubernetes_components: Some(keel_proto::components::Components {
                components: components.clone(),
            }),
            ..InitRequest::default()
        };

        let join = tokio::spawn(node.client(&ca).run());
        let init_result = init.init(tonic::Request::new(request)).await;
        let join_outcome = join.await.unwrap();

        let locks = node
            .tpm
            .lock()
            .unwrap()
            .events()
            .iter()
            .filter(|e| e.event_type == EventType::ClusterId)
            .count();
        assert_eq!(
            locks, 1,
            "round {round}: the node lock was taken {locks} times"
        );
        match (init_result, &join_outcome) {
            (Ok(stream), JoinOutcome::LostRace) => {
                // The init runs to the end, and only then says the disk's
                // set-up finished.
                let succeeded = join_common::init_succeeds(stream).await;
                assert!(succeeded, "round {round}: the init did not succeed");
                assert_eq!(
                    Cryptsetup::default().label(&node.disk).unwrap(),
                    PROVISIONED_LABEL,
                    "round {round}"
                );
            }
            (Err(status), JoinOutcome::Joined { .. }) => {
                assert_eq!(
                    status.code(),
                    tonic::Code::FailedPrecondition,
                    "round {round}: {status:?}"
                );
                assert_eq!(
                    Cryptsetup::default().label(&node.disk).unwrap(),
                    PROVISIONED_LABEL,
                    "round {round}"
                );
            }
            (init, join) => panic!(
                "round {round}: init {:?} and join {join:?} both or neither won",
                init.err()
            ),
        }
    }
}
