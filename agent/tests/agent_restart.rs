//! An agent that restarts within a boot, after its node was locked into a
//! cluster, on swtpm-backed nodes over real mutual aTLS. A worker and a
//! control plane join; each sends the record it keeps to the service
//! manager (a socket standing in for systemd's, as `$NOTIFY_SOCKET`); their
//! agents restart and resume from those records: the control plane serves
//! a new worker's join, the worker has its operator key. A record of
//! another cluster, a forged one (another cluster's master secret under
//! this cluster's ID), one of the other role, a control plane revoked in
//! its own registry, and a node that is not locked resume nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::sync::Arc;
use std::time::Duration;

use join_common::{config_for, free_port, joiner_with, stand_in_components, start_service_for};
use keel_agent::cluster::ClusterSlot;
use keel_agent::join::JoinOutcome;
use keel_agent::provision::ProvisionError;
use keel_agent::resume::{self, ResumeError, ResumeRecord, Resumed};
use keel_testkit::mirror::MirrorServer;
use keel_testkit::notify::NotifySocket;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::keys::KeyService;

const LIMIT: Duration = Duration::from_secs(120);

/// The tests point this process's `$NOTIFY_SOCKET` at their own stand-in:
/// one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The stand-in service manager's notification socket.
struct Manager(NotifySocket);

impl Manager {
    /// Binds the socket and points this process's `$NOTIFY_SOCKET` at it.
    fn start() -> Self {
        let socket = NotifySocket::new().unwrap();
        std::env::set_var("NOTIFY_SOCKET", socket.socket());
        Self(socket)
    }

    /// The record of the last `FDSTORE=1` message received so far, read as
    /// a restarted agent reads it, under its stored name (the others are
    /// dropped).
    fn last_record(&self) -> ResumeRecord {
        let mut last = None;
        while let Some((state, mut files)) = self.0.receive() {
            if let (Some(name), Some(file)) =
                (state.strip_prefix("FDSTORE=1\nFDNAME="), files.pop())
            {
                last = Some((name.to_owned(), file));
            }
        }
        let passed = vec![last.expect("no record stored")];
        resume::take_kept(passed).unwrap().unwrap()
    }
}

/// A worker `name` of the cluster at `ports`, joined.
async fn joined_worker(ca: &EkCa, ports: &[u16], name: &str) -> join_common::Joiner {
    let worker = joiner_with(
        config_for(ca, ports, name, "worker"),
        Swtpm::start(ca).unwrap(),
    );
    let joined = tokio::time::timeout(LIMIT, worker.client(ca).run())
        .await
        .unwrap();
    assert!(matches!(joined, JoinOutcome::Joined { .. }), "{joined:?}");
    worker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_resume_their_roles_after_an_agent_restart() {
    let _one = ONE_AT_A_TIME.lock().await;
    let manager = Manager::start();
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let ports = [free_port(), free_port()];
    let mut cp0 = start_service_for(&ca, &ports, Some(stand_in_components(&mirror)), false).await;
    let cluster_id = cp0.state.cluster_id;

    // A worker joins, then cp-1 as a control plane; each keeps a record.
    let worker = joined_worker(&ca, &ports, "w-1").await;
    let worker_record = manager.last_record();
    assert!(!worker_record.is_control_plane());
    assert_eq!(worker_record.cluster_id(), cluster_id);
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
    let cp_record = manager.last_record();
    assert!(cp_record.is_control_plane());
    assert_eq!(cp_record.cluster_id(), cluster_id);

    // Their agents restart: locked, empty-handed.
    let cp1 = cp1.restart_agent();
    let worker = worker.restart_agent();
    assert!(cp1.lock.is_locked() && worker.lock.is_locked());
    let cp_node = cp1.node(Arc::new(ClusterSlot::new(None)));
    let worker_node = worker.node(Arc::new(ClusterSlot::new(None)));

    // Another cluster's record.
    let mut other = state.as_ref().clone();
    other.keys = Arc::new(KeyService::new(&[1; 32], &[2; 32]).unwrap());
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
        matches!(refused, Err(ResumeError::Restore(ProvisionError::Facts(_)))),
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
    assert!(!worker_node.operator_key.is_set());

    // The records they kept.
    let resumed = resume::resume(&cp_node, cp_record.clone()).await.unwrap();
    assert_eq!(resumed, Resumed::ControlPlane);
    let back = cp_node.cluster.borrow().clone().expect("no cluster state");
    assert_eq!(back.cluster_id, cluster_id);
    assert_eq!(back.keys.expose_master(), cp0.state.keys.expose_master());
    let resumed = resume::resume(&worker_node, worker_record).await.unwrap();
    assert_eq!(resumed, Resumed::Member);
    assert!(worker_node.operator_key.is_set());

    // The resumed control plane serves joins: with cp-0 down, a new
    // worker joins through it.
    cp0.stop().await;
    let serving = cp1.serve_join(ports[1], cp_node.cluster.clone()).await;
    let fresh = joiner_with(
        config_for(&ca, &ports, "w-2", "worker"),
        Swtpm::start(&ca).unwrap(),
    );
    let joined = tokio::time::timeout(LIMIT, fresh.client(&ca).run())
        .await
        .unwrap();
    match joined {
        JoinOutcome::Joined { cluster_id: id } => assert_eq!(id, cluster_id),
        other => panic!("{other:?}"),
    }
    serving.abort();
    let _ = serving.await;

    // A control plane revoked in its own registry (the revocation reached
    // it as another control plane's) does not resume.
    cp1.revoke_in_own_registry();
    let cp1 = cp1.restart_agent();
    let cp_node = cp1.node(Arc::new(ClusterSlot::new(None)));
    match resume::resume(&cp_node, cp_record.clone()).await {
        Err(ResumeError::Restore(ProvisionError::Revoked(why))) => {
            assert!(why.contains("revoked by the operator"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert!(cp_node.cluster.borrow().is_none(), "a revoked node resumed");

    // A node that is not locked resumes nothing.
    let unlocked = joiner_with(
        config_for(&ca, &ports, "w-3", "worker"),
        Swtpm::start(&ca).unwrap(),
    );
    let refused = resume::resume(&unlocked.node(Arc::new(ClusterSlot::new(None))), cp_record).await;
    assert!(
        matches!(refused, Err(ResumeError::NotLocked)),
        "{refused:?}"
    );
    unlocked.assert_untouched();
}

/// A crash during a rejoin, whose disk is already a member's: the
/// restarted agent finds the node locked and no record, and the mark the
/// flow left when it took the lock says the flow was cut off, so the node
/// is reset to reboot (it rejoins from there) instead of idling until an
/// operator notices. Without the mark (the service was stopped after the
/// node became a member) the restart only says it cannot resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_that_cut_off_the_flow_that_locked_the_node_reboots_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let _manager = Manager::start();
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let ports = [free_port(), free_port()];
    let _cp0 = start_service_for(&ca, &ports, Some(stand_in_components(&mirror)), false).await;
    let worker = joined_worker(&ca, &ports, "w-1").await;
    let mark = worker.work.join(resume::UNKEPT);
    assert!(!mark.exists(), "the finished join left its mark");

    // Stopped after it became a member: no record, no mark.
    let worker = worker.restart_agent();
    let node = worker.node(Arc::new(ClusterSlot::new(None)));
    assert!(!resume::at_start(&node, None).await, "a member was reset");

    // Cut off midway: the lock's mark is there, the record is not.
    std::fs::write(&mark, b"").unwrap();
    let worker = worker.restart_agent();
    let node = worker.node(Arc::new(ClusterSlot::new(None)));
    assert!(resume::at_start(&node, None).await, "not reset");

    // Every flow takes the lock through `take_lock`, which leaves the mark.
    let fresh = joiner_with(
        config_for(&ca, &ports, "w-2", "worker"),
        Swtpm::start(&ca).unwrap(),
    );
    resume::take_lock(&fresh.lock, [9; 32], &fresh.work).unwrap();
    assert!(fresh.lock.is_locked());
    assert!(fresh.work.join(resume::UNKEPT).exists(), "no mark");
}
