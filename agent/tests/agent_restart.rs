//! An agent that restarts within a boot, after its node was locked into a
//! cluster, on swtpm-backed nodes over real mutual aTLS: a control plane
//! and a worker resume their roles from the record kept before the
//! restart (through a sealed memfd, as the service manager hands it back);
//! a record of another cluster, a forged one (another cluster's master
//! secret under this cluster's ID), one of the other role, and any record
//! on a node that is not locked resume nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::sync::Arc;
use std::time::Duration;

use join_common::{config_for, free_port, joiner_with, stand_in_components, start_service_for};
use keel_agent::cluster::ClusterSlot;
use keel_agent::join::JoinOutcome;
use keel_agent::resume::{self, ResumeError, ResumeRecord, Resumed};
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::keys::{KeyService, OperatorKey};

const LIMIT: Duration = Duration::from_secs(120);

/// `record` as a restarted agent reads it back from the store.
fn through_the_store(record: &ResumeRecord) -> ResumeRecord {
    resume::read(&resume::sealed(record).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_resume_their_roles_after_an_agent_restart() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let ports = [free_port(), free_port()];
    let cp0 = start_service_for(&ca, &ports, Some(stand_in_components(&mirror)), false).await;
    let cluster_id = cp0.state.cluster_id;

    // cp-1 joins as a control plane; a worker joins.
    let cp1 = joiner_with(
        config_for(&ca, &ports, "cp-1", "control-plane"),
        Swtpm::start(&ca).unwrap(),
    );
    let slot = Arc::new(ClusterSlot::new(None));
    let joined = tokio::time::timeout(LIMIT, cp1.client(&ca).with_cluster_slot(slot.clone()).run())
        .await
        .unwrap();
    assert!(matches!(joined, JoinOutcome::Joined { .. }), "{joined:?}");
    let state = slot.borrow().clone().unwrap();
    let worker = joiner_with(
        config_for(&ca, &ports, "w-1", "worker"),
        Swtpm::start(&ca).unwrap(),
    );
    let joined = tokio::time::timeout(LIMIT, worker.client(&ca).run())
        .await
        .unwrap();
    assert!(matches!(joined, JoinOutcome::Joined { .. }), "{joined:?}");

    // What each kept (the worker's operator key stands in for its ticket's).
    let cp_record = through_the_store(&ResumeRecord::of_control_plane(&state));
    let operator_key = OperatorKey::from_slice(&[6; 32]).unwrap();
    let worker_record =
        through_the_store(&ResumeRecord::of_member(cluster_id, operator_key.clone()));

    // Their agents restart: locked, empty-handed.
    let cp1 = cp1.restart_agent();
    let worker = worker.restart_agent();
    assert!(cp1.lock.is_locked() && worker.lock.is_locked());
    let cp_node = cp1.node(Arc::new(ClusterSlot::new(None)));
    let worker_node = worker.node(Arc::new(ClusterSlot::new(None)));

    // Another cluster's record.
    let other_keys = Arc::new(KeyService::new(&[1; 32], &[2; 32]).unwrap());
    let mut other = state.as_ref().clone();
    other.keys = other_keys.clone();
    other.cluster_id = [0x77; 32];
    let refused = resume::resume(&cp_node, ResumeRecord::of_control_plane(&other)).await;
    assert!(
        matches!(refused, Err(ResumeError::OtherCluster { .. })),
        "{refused:?}"
    );
    // Forged: this cluster's ID (the lock's) with another master secret,
    // which does not derive the ID the disk's facts name.
    other.cluster_id = cluster_id;
    let refused = resume::resume(&cp_node, ResumeRecord::of_control_plane(&other)).await;
    assert!(
        matches!(refused, Err(ResumeError::Restore(_))),
        "{refused:?}"
    );
    // The other role's record.
    let refused = resume::resume(&cp_node, worker_record.clone()).await;
    assert!(
        matches!(refused, Err(ResumeError::Role { .. })),
        "{refused:?}"
    );
    let refused = resume::resume(&worker_node, cp_record.clone()).await;
    assert!(
        matches!(refused, Err(ResumeError::Role { .. })),
        "{refused:?}"
    );
    assert!(
        cp_node.cluster.borrow().is_none(),
        "a refused record resumed"
    );

    // The records they kept.
    let resumed = resume::resume(&cp_node, cp_record.clone()).await.unwrap();
    assert_eq!(resumed, Resumed::ControlPlane);
    let back = cp_node.cluster.borrow().clone().expect("no cluster state");
    assert_eq!(back.cluster_id, cluster_id);
    assert_eq!(back.keys.expose_master(), cp0.state.keys.expose_master());
    assert_eq!(back.join_measurements, state.join_measurements);
    let resumed = resume::resume(&worker_node, worker_record).await.unwrap();
    assert_eq!(resumed, Resumed::Member);
    assert!(worker_node.operator_key.is_set());

    // A node that is not locked resumes nothing.
    let fresh = joiner_with(
        config_for(&ca, &ports, "w-2", "worker"),
        Swtpm::start(&ca).unwrap(),
    );
    let refused = resume::resume(&fresh.node(Arc::new(ClusterSlot::new(None))), cp_record).await;
    assert!(
        matches!(refused, Err(ResumeError::NotLocked)),
        "{refused:?}"
    );
    fresh.assert_untouched();
}
