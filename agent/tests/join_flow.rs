//! The join client against a join service, each node with its own swtpm,
//! over mutual aTLS on loopback; components from the loopback mirror,
//! kubeadm the stand-in, state disks LUKS2 image files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::net::Ipv4Addr;
use std::time::Duration;

use join_common::{
    boot_measurements, boot_measurements_with, free_port, joiner, stand_in_components,
    start_service_with, Joiner, Service,
};
use keel_agent::address::AdvertiseAddress;
use keel_agent::disk::Cryptsetup;
use keel_agent::join::{JoinOutcome, JoinTicket, KubeletKey, TicketError};
use keel_atls::ConnectError;
use keel_proto::join::IssueJoinTicketRequest;
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::EkCa;
use keel_verifier::measurements::Expected;

/// How long a refused node is watched retrying.
const WATCH: Duration = Duration::from_secs(3);

async fn joined(j: &Joiner, ca: &EkCa) -> [u8; 32] {
    let outcome = tokio::time::timeout(Duration::from_secs(90), j.client(ca).run())
        .await
        .expect("the join did not finish");
    match outcome {
        JoinOutcome::Joined { cluster_id } => cluster_id,
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_keeps_retrying_until_the_join_service_is_up() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let node = joiner(&ca, &ca, port, "w-1", "worker");
    let client = node.client(&ca);
    let run = tokio::spawn(client.run());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!run.is_finished());
    node.assert_untouched();

    let service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    let outcome = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("the node did not join once the service was up")
        .unwrap();
    let JoinOutcome::Joined { cluster_id } = outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(cluster_id, service.state.cluster_id);
    assert_eq!(node.pcr15(), join_common::pcr15(&service.tpm));
    node.assert_disk_opens(&service);
    assert!(node.root.join("etc/kubernetes/kubelet.conf").is_file());
}

/// Attacker's move (or a slow device): make the state disk impossible to
/// inspect as the node boots, so that it takes a member's disk for a fresh
/// one and a join formats it. The node waits, never locks, and joins once
/// the disk can be told fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_cannot_be_inspected_is_never_taken_for_fresh() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    let node = joiner(&ca, &ca, port, "w-unread", "worker");
    std::fs::remove_file(&node.disk).unwrap();
    let run = tokio::spawn(node.client(&ca).run());
    tokio::time::sleep(WATCH).await;
    assert!(!run.is_finished(), "{:?}", run.await);
    assert_eq!(node.pcr15(), [0; 32], "the node got locked");
    assert!(!node.lock.is_locked());
    assert!(!node.disk.exists(), "something wrote the missing disk");

    join_common::fresh_disk(&node.disk);
    let outcome = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("the node did not join once its disk could be inspected")
        .unwrap();
    let JoinOutcome::Joined { cluster_id } = outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(cluster_id, service.state.cluster_id);
    node.assert_disk_opens(&service);
}

/// A node that stops while it provisions (a crash, a power cut, a host
/// that kills the VM during `kubeadm join`) leaves a formatted disk
/// without the setup a member has. Its next boot must not rejoin with it
/// (it would start a kubelet that never joined, or fail to restore a
/// control plane on every boot): the disk's header still says unfinished,
/// the start resets it, and the node joins afresh. A finished join's disk
/// says finished and survives the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_cut_off_midway_starts_over_on_the_next_boot() {
    use keel_agent::disk::{DiskState, PROVISIONED_LABEL, PROVISIONING_LABEL};

    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    let node = joiner(&ca, &ca, port, "w-cut", "worker");
    let run = tokio::spawn(
        node.client_with_kubeadm_env(&ca, &[("KEEL_STANDIN_SLEEP", "60")])
            .run(),
    );
    // Cut off once kubeadm runs: the disk is set up, kubeadm never ends.
    let started = std::time::Instant::now();
    while !node.work.join("kubeadm-join.yaml").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "kubeadm never ran"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What kubeadm reads holds the kubelet's key: there while it runs ...
    assert!(node.work.join("kubeadm-discovery.conf").exists());
    run.abort();
    let _ = run.await;
    // ... and gone with the run, also one cut off.
    for input in ["kubeadm-join.yaml", "kubeadm-discovery.conf"] {
        assert!(!node.work.join(input).exists(), "{input} left behind");
    }
    let cs = Cryptsetup::default();
    assert_eq!(cs.label(&node.disk).unwrap(), PROVISIONING_LABEL);
    let old_uuid = cs.uuid(&node.disk).unwrap();

    let node = node.reboot(&ca);
    let env = node.env();
    let disk = env.state_disk.clone().unwrap();
    assert_eq!(
        disk.inspect().unwrap(),
        DiskState::Unfinished {
            uuid: old_uuid.clone()
        }
    );
    // Unlocked (PCR 15 zero after the reboot): reset, and no reboot.
    assert!(!keel_agent::node::reset_unfinished_disk(&env, &node.lock).await);
    assert_eq!(disk.inspect().unwrap(), DiskState::Fresh);
    let cluster_id = joined(&node, &ca).await;
    assert_eq!(cluster_id, service.state.cluster_id);
    node.assert_disk_opens(&service);
    assert_ne!(cs.uuid(&node.disk).unwrap(), old_uuid);
    assert_eq!(cs.label(&node.disk).unwrap(), PROVISIONED_LABEL);

    // The finished disk survives the next start, and the node rejoins.
    let node = node.reboot(&ca);
    let env = node.env();
    assert!(!keel_agent::node::reset_unfinished_disk(&env, &node.lock).await);
    let outcome = tokio::time::timeout(Duration::from_secs(90), node.client(&ca).run())
        .await
        .expect("the rejoin did not finish");
    assert!(
        matches!(outcome, JoinOutcome::Rejoined { .. }),
        "{outcome:?}"
    );
    node.assert_disk_opens(&service);
}

/// A join client whose set-up fails (its TPM gone while it reads the PCRs
/// of the service's policy) says so and tries again, instead of ending
/// for the boot with the node unlocked and idle.
#[tokio::test(flavor = "current_thread")]
async fn a_join_client_whose_set_up_fails_tries_again() {
    let ca = EkCa::new().unwrap();
    let mut node = joiner(&ca, &ca, free_port(), "w-no-tpm", "worker");
    node.kill_tpm();
    let (captured, _default) = keel_testkit::logs::Captured::debug_log();
    let run = keel_agent::node::run_join_client(node.node(Default::default()));
    let ended = tokio::time::timeout(Duration::from_secs(3), run).await;
    let journal = captured.text();
    assert!(
        ended.is_err(),
        "the join client ended: {ended:?}\n{journal}"
    );
    assert!(
        journal.contains("setting up the join client failed; trying again"),
        "{journal}"
    );
    assert!(!node.lock.is_locked());
}

/// A node whose lock cannot be recorded (its event log unwritable) asks
/// for another ticket after the backoff, not at once: each ticket costs the
/// control plane a handshake, a signed kubelet certificate and registry
/// writes, and a lock that keeps failing must not become a stream of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_client_whose_lock_keeps_failing_backs_off() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let _service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    let node = joiner(&ca, &ca, port, "w-lk", "worker");
    node.make_event_log_unwritable();

    let (captured, _default) = keel_testkit::logs::Captured::debug_log();
    let backoff = keel_agent::backoff::Backoff {
        initial: Duration::from_millis(400),
        max: Duration::from_secs(2),
    };
    let client = node.client_backing_off(&ca, node.env(), backoff);
    let ended = tokio::time::timeout(Duration::from_secs(4), client.run()).await;
    let journal = captured.text();
    assert!(ended.is_err(), "the join ended: {ended:?}\n{journal}");
    assert!(!node.lock.is_locked());
    let failed = journal.matches("taking the node lock failed").count();
    let tickets = journal.matches("join ticket issued by").count();
    // Pauses of at least 200, 400, 800, 1000 ms: at most six tickets in
    // 4 s, where asking at once fetches hundreds.
    assert!(failed >= 2, "{failed} lock failures\n{journal}");
    assert!(tickets <= 6, "{tickets} tickets in 4 s\n{journal}");
}

/// An agent restarted on a locked node whose state disk it cannot read
/// schedules a reboot and says that is why: it does not claim the disk is
/// no member's, which it never read.
#[tokio::test(flavor = "current_thread")]
async fn a_locked_node_that_cannot_read_its_disk_says_so_before_its_reboot() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "w-unread", "worker");
    node.lock.try_lock([3; 32]).unwrap();
    let mut env = node.env();
    let mut disk = env.state_disk.clone().unwrap();
    disk.device = node.work.join("no-such-disk");
    env.state_disk = Some(disk);
    let (captured, _default) = keel_testkit::logs::Captured::debug_log();
    assert!(keel_agent::node::reset_unfinished_disk(&env, &node.lock).await);
    let journal = captured.text();
    assert!(
        journal.contains("inspecting the state disk at start failed")
            && journal.contains("locked before this start and its state disk could not be read")
            && !journal.contains("no member's"),
        "{journal}"
    );
}

/// A failure after the node lock resets what this boot set up and nothing
/// else: a join that fails (kubeadm) marks the disk it formatted for
/// reset; a start within that boot (the agent restarted) finds the node
/// locked with no member's disk and schedules a reboot; a rejoin that
/// fails (its version record damaged, or gone) leaves the member's disk as
/// it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_after_the_lock_resets_only_what_this_boot_set_up() {
    use keel_agent::disk::{DiskState, PROVISIONED_LABEL};

    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    let node = joiner(&ca, &ca, port, "w-fail", "worker");
    let cs = Cryptsetup::default();

    let failed = tokio::time::timeout(
        Duration::from_secs(90),
        node.client_with_kubeadm_env(&ca, &[("KEEL_STANDIN_FAIL", "always")])
            .run(),
    )
    .await
    .expect("the join did not finish");
    // It failed in kubeadm, after the disk step.
    match &failed {
        JoinOutcome::Failed { error } => assert!(error.contains("kubeadm"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert!(node.lock.is_locked());
    assert!(
        !cs.is_luks(&node.disk).unwrap(),
        "the disk it formatted was not reset"
    );

    // The agent restarts within that boot: locked, and no member's disk.
    // Had marking it failed, the header would still say its set-up is
    // unfinished: that too is reset.
    cs.format(&node.disk, &[9; 32]).unwrap();
    assert_eq!(
        cs.label(&node.disk).unwrap(),
        keel_agent::disk::PROVISIONING_LABEL
    );
    let node = node.restart_agent();
    let env = node.env();
    assert!(keel_agent::node::reset_unfinished_disk(&env, &node.lock).await);
    assert_eq!(
        env.state_disk.clone().unwrap().inspect().unwrap(),
        DiskState::Fresh
    );

    // After the reboot it joins.
    let node = node.reboot(&ca);
    assert_eq!(joined(&node, &ca).await, service.state.cluster_id);
    let member_uuid = cs.uuid(&node.disk).unwrap();
    assert_eq!(cs.label(&node.disk).unwrap(), PROVISIONED_LABEL);

    // It reboots with its version record unreadable (damaged): the rejoin
    // fails after the lock, and the disk is the member's still.
    std::fs::write(
        node.root.join(keel_agent::paths::NODE_VERSION),
        b"{ not a record",
    )
    .unwrap();
    let node = node.reboot(&ca);
    let failed = tokio::time::timeout(Duration::from_secs(90), node.client(&ca).run())
        .await
        .expect("the rejoin did not finish");
    match &failed {
        JoinOutcome::Failed { error } => assert!(error.contains("version"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert!(node.lock.is_locked());
    assert_eq!(cs.uuid(&node.disk).unwrap(), member_uuid);
    assert_eq!(cs.label(&node.disk).unwrap(), PROVISIONED_LABEL);
    node.assert_disk_opens(&service);

    // Attacker's move: the host writes back the sectors of the record's
    // directory entry, so the disk holds no record: the kubelet's unit,
    // finding no binary, would be skipped as if it had started, and the
    // node report itself rejoined. The rejoin fails instead.
    std::fs::remove_file(node.root.join(keel_agent::paths::NODE_VERSION)).unwrap();
    let node = node.reboot(&ca);
    let failed = tokio::time::timeout(Duration::from_secs(90), node.client(&ca).run())
        .await
        .expect("the rejoin did not finish");
    match &failed {
        JoinOutcome::Failed { error } => {
            assert!(error.contains("no version record"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(cs.uuid(&node.disk).unwrap(), member_uuid);
}

/// Attacker's move: time an operator request (an upgrade, with the
/// operator's proof) to reach a node while it is still being provisioned
/// (the host reboots it as the rollout reaches it, and stalls its
/// downloads), so the upgrade's switch and the join's install run at once.
/// The operator key comes with the ticket, but the node takes it into use
/// only once the join has finished: until then operator requests are
/// refused for want of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_key_is_taken_into_use_only_once_the_node_is_provisioned() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let _service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    let node = joiner(&ca, &ca, port, "w-1", "worker");
    let slot = std::sync::Arc::new(keel_agent::operator::OperatorKeySlot::default());
    let client = node
        .client_with_kubeadm_env(&ca, &[("KEEL_STANDIN_SLEEP", "3")])
        .with_operator_key_slot(slot.clone());
    let run = tokio::spawn(client.run());
    // The ticket arrived (the node is locked); kubeadm join is still on.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !node.lock.is_locked() {
        assert!(std::time::Instant::now() < deadline, "no ticket");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!run.is_finished());
    assert!(
        !slot.is_set(),
        "the operator key was in use during the join"
    );
    let outcome = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("the join did not finish")
        .unwrap();
    assert!(matches!(outcome, JoinOutcome::Joined { .. }), "{outcome:?}");
    assert!(slot.is_set());
}

/// Attacker's move: a compromised worker of the cluster serves the join
/// port (the host sends a joining node's connection to it). It runs the
/// cluster's image under the cluster's lock, so image and PCR 15 match;
/// only its measured role tells it from a control plane, and the joining
/// node refuses its ticket for that before using anything in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serving_the_join_port_gets_no_ticket_used() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    // The CA's certificates (in the config) exist once it made a TPM.
    let swtpm = keel_testkit::swtpm::Swtpm::start(&ca).unwrap();
    let config = join_common::config_for(&ca, &[port], "w-0", "worker");
    let worker = join_common::start_service_config(
        port,
        config,
        swtpm,
        Some(stand_in_components(&mirror)),
        false,
    )
    .await;
    let deceived = joiner(&ca, &ca, port, "w-1", "worker");
    let (request, spki) = worker_request("w-1");
    let err = deceived
        .tickets(&ca)
        .join_ticket(&worker.endpoint, request, &spki)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TicketError::ServiceCluster(why) if why.contains("not a control plane")),
        "{err}"
    );
    // The join loop keeps retrying and leaves the node as it was.
    let run = tokio::time::timeout(WATCH, deceived.client(&ca).run()).await;
    assert!(run.is_err(), "{run:?}");
    deceived.assert_untouched();
}

/// A worker's ticket request for `name` (a fresh kubelet key and disk),
/// and the key's SPKI the ticket must certify.
fn worker_request(name: &str) -> (IssueJoinTicketRequest, Vec<u8>) {
    let key = KubeletKey::generate(name).unwrap();
    let request = IssueJoinTicketRequest {
        disk_uuid: join_common::uuid(),
        kubelet_csr: key.csr_pem().as_bytes().to_vec(),
        is_control_plane: false,
        node_name: name.into(),
        file_discovery: true,
    };
    (request, key.spki())
}

/// Attacker's move: a join service (a control plane of a cluster whose
/// list an earlier agent took, or one that lies) hands out a ticket whose
/// components put two archives into one directory, so that the node locks
/// and then fails to install. The node refuses the ticket before it locks
/// or fetches anything, and keeps trying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_with_two_archives_for_one_directory_leaves_the_node_unlocked() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let mut list = stand_in_components(&mirror);
    let archive = list.iter().find(|c| c.extract()).unwrap();
    let second = keel_installer::Component::try_from(&keel_proto::components::Component {
        url: format!("{}/other.tgz", mirror.base_url()),
        hash: format!("sha256:{}", "b".repeat(64)),
        install_path: archive.install_path().to_string(),
        extract: true,
    })
    .unwrap();
    list.push(second);
    a_ticket_of_is_refused(&ca, &mirror, list, "more than one archive").await;
}

/// Serves `list` in join tickets: a joining node keeps trying, locks,
/// writes and fetches nothing, and a ticket asked for directly is refused
/// as invalid, naming `why`.
async fn a_ticket_of_is_refused(
    ca: &EkCa,
    mirror: &MirrorServer,
    list: Vec<keel_installer::Component>,
    why: &str,
) {
    let port = free_port();
    let service = start_service_with(ca, port, Some(list), false).await;
    let node = joiner(ca, ca, port, "w-1", "worker");

    let run = tokio::time::timeout(WATCH, node.client(ca).run()).await;
    assert!(run.is_err(), "{run:?}");
    node.assert_untouched();
    assert_eq!(mirror.total_requests(), 0);

    let (request, spki) = worker_request("w-1");
    let err = node
        .tickets(ca)
        .join_ticket(&service.endpoint, request, &spki)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TicketError::Invalid(reason) if reason.contains(why)),
        "{err}"
    );
    node.assert_untouched();
}

/// Attacker's move: a compromised control plane hands out a ticket whose
/// components install a file outside the component directories, here a
/// static pod manifest the kubelet would run. Init and upgrade plans
/// refuse such a list; the node refuses the ticket as well, before it
/// locks or writes anything, and keeps trying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_with_components_outside_the_component_directories_is_refused() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let mut list = stand_in_components(&mirror);
    let manifest = b"apiVersion: v1\nkind: Pod\n";
    let outside = keel_installer::Component::try_from(&keel_proto::components::Component {
        url: "data:,apiVersion%3A%20v1%0Akind%3A%20Pod%0A".into(),
        hash: keel_installer::Sha256Digest::of(manifest).to_string(),
        install_path: "/etc/kubernetes/manifests/x.yaml".into(),
        extract: false,
    })
    .unwrap();
    assert_eq!(
        outside.source(),
        &keel_installer::Source::Inline(manifest.to_vec())
    );
    list.push(outside);
    a_ticket_of_is_refused(&ca, &mirror, list, "/etc/kubernetes/manifests").await;
}

/// A node whose route lookup finds no route to take the address it would
/// advertise from (no route toward its first control-plane endpoint, or
/// no default route) would join on its loopback address, which no other
/// node reaches: it neither locks nor writes nor fetches anything, and
/// keeps trying. Once it has a route, it joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_no_route_to_advertise_on_stays_unlocked() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    let node = joiner(&ca, &ca, port, "w-1", "worker");
    let mut env = node.env();
    // A broadcast address stands in for a peer without a route.
    env.advertise_address = AdvertiseAddress::Toward(Ipv4Addr::BROADCAST.into());

    let run = tokio::time::timeout(WATCH, node.client_in(&ca, env).run()).await;
    assert!(run.is_err(), "{run:?}");
    node.assert_untouched();
    assert_eq!(mirror.total_requests(), 0);

    let cluster_id = joined(&node, &ca).await;
    assert_eq!(cluster_id, service.state.cluster_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_nodes_stay_unlocked_and_untouched() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;

    // A node whose PCR 11 differs from the service's reference: the
    // reference is swapped in at run time (the node's own PCR is zero).
    let reference = boot_measurements_with(&service.config, [(11, Expected::enforced([1; 32]))]);
    std::fs::write(&service.measurements, reference.to_json()).unwrap();
    service.policy.reload().unwrap();
    let mismatched = joiner(&ca, &ca, port, "w-1", "worker");

    // A node without a trusted EK certificate (another CA issued it).
    let other_ca = EkCa::new().unwrap();
    let untrusted = joiner(&ca, &other_ca, port, "w-2", "worker");

    // A join service whose own attestation does not match its tickets: it
    // serves a cluster but its node is locked into another one.
    let rogue_port = free_port();
    let rogue = start_service_with(&ca, rogue_port, Some(stand_in_components(&mirror)), true).await;
    let deceived = joiner(&ca, &ca, rogue_port, "w-3", "worker");

    let (a, c) = tokio::join!(
        tokio::time::timeout(WATCH, mismatched.client(&ca).run()),
        tokio::time::timeout(WATCH, deceived.client(&ca).run()),
    );
    // Each is still retrying: refused, nothing written, not locked.
    assert!(a.is_err() && c.is_err(), "{a:?} {c:?}");
    mismatched.assert_untouched();
    deceived.assert_untouched();
    assert!(service.registered_tokens().is_empty());

    // Why, asked directly: the service refuses the first in the handshake;
    // the node refuses the rogue service's ticket.
    let err = direct_ticket(&mismatched, &ca, &service).await.unwrap_err();
    assert!(
        matches!(err, TicketError::Connect(ConnectError::RefusedByServer(_))),
        "{err}"
    );
    let tickets = deceived.tickets(&ca);
    let (req, spki) = worker_request("w-3");
    let err = tickets
        .join_ticket(&rogue.endpoint, req, &spki)
        .await
        .unwrap_err();
    assert!(matches!(err, TicketError::ServiceCluster(_)), "{err}");
    deceived.assert_untouched();

    // Once the reference is what the image measures, the same node joins.
    std::fs::write(
        &service.measurements,
        boot_measurements(&service.config).to_json(),
    )
    .unwrap();
    service.policy.reload().unwrap();

    // The node whose EK another CA certified measures what the reference
    // says: it is refused for its EK alone, in the handshake.
    let (outcome, direct) = tokio::join!(
        tokio::time::timeout(WATCH, untrusted.client(&ca).run()),
        direct_ticket(&untrusted, &ca, &service),
    );
    assert!(outcome.is_err(), "{outcome:?}");
    let err = direct.unwrap_err();
    assert!(
        matches!(err, TicketError::Connect(ConnectError::RefusedByServer(_))),
        "{err}"
    );
    untrusted.assert_untouched();

    let cluster_id = joined(&mismatched, &ca).await;
    assert_eq!(cluster_id, service.state.cluster_id);
    assert_eq!(mismatched.pcr15(), join_common::pcr15(&service.tpm));
    mismatched.assert_disk_opens(&service);

    // A node that is already locked: the join client stops at once and
    // touches nothing.
    let locked = joiner(&ca, &ca, port, "w-4", "worker");
    locked.lock.try_lock([9; 32]).unwrap();
    let outcome = locked.client(&ca).run().await;
    assert!(matches!(outcome, JoinOutcome::LostRace), "{outcome:?}");
    assert!(!locked.root.exists() && !locked.work.exists());
    assert!(!Cryptsetup::default().is_luks(&locked.disk).unwrap());
}

/// A ticket `node` asks `service` for directly, as a worker.
async fn direct_ticket(
    node: &Joiner,
    ca: &EkCa,
    service: &Service,
) -> Result<JoinTicket, TicketError> {
    let (req, spki) = worker_request(&node.config.node.name);
    node.tickets(ca)
        .join_ticket(&service.endpoint, req, &spki)
        .await
}

/// A join ticket for `uuid`, as `tickets`' node named `name`; the opened
/// state-disk key.
async fn disk_key_by_join(
    tickets: &keel_agent::join::TicketClient,
    service: &Service,
    name: &str,
    uuid: &str,
) -> Result<Vec<u8>, TicketError> {
    let key = KubeletKey::generate(name).unwrap();
    let request = IssueJoinTicketRequest {
        disk_uuid: uuid.to_owned(),
        kubelet_csr: key.csr_pem().as_bytes().to_vec(),
        is_control_plane: false,
        node_name: name.into(),
        file_discovery: false,
    };
    let mut raw = tickets
        .request_join_ticket(&service.endpoint, request)
        .await?;
    let secrets = tickets.open(raw.response.secrets.take()).await?;
    Ok(secrets.state_disk_key.clone())
}

/// The refusal of a disk that is not bound to the asking TPM: permission
/// denied with the one fixed message, nothing else.
fn assert_not_bound<T>(result: Result<T, TicketError>) {
    match result {
        Err(TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
            assert_eq!(
                status.message(),
                "the state disk is not bound to this node's TPM"
            );
        }
        Err(other) => panic!("{}", keel_atls::ErrorChain(&other)),
        Ok(_) => panic!("a disk key was issued"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_key_goes_only_to_the_tpm_the_disk_joined_with() {
    let ca = EkCa::new().unwrap();
    let port = free_port();
    let mut service = join_common::start_service(&ca, port).await;
    service.serving_older_members().await;
    let owner = join_common::member(&ca, port, "w-1", "worker");
    let other = join_common::member(&ca, port, "w-2", "worker");
    let (owner_tickets, other_tickets) = (owner.tickets(&ca), other.tickets(&ca));
    let disk = join_common::uuid();
    let owner_ek = join_common::ek_digest(&owner.tpm);
    let expected = service.state.keys.disk_key(&disk, &owner_ek).unwrap();

    // A disk this service never saw join: a rejoin ticket is issued (any
    // control plane can serve a rebooted node), but its key is bound to
    // the asking TPM, so only the TPM the disk was made with gets the key
    // that opens it.
    let ticket = other_tickets
        .rejoin_ticket(&service.endpoint, &disk)
        .await
        .unwrap();
    assert_ne!(ticket.disk_key.as_slice(), expected.as_slice());
    let ticket = owner_tickets
        .rejoin_ticket(&service.endpoint, &disk)
        .await
        .unwrap();
    assert_eq!(ticket.disk_key.as_slice(), expected.as_slice());
    assert!(
        ticket.control_plane_keys.is_none(),
        "a worker got the master secret"
    );

    // w-1 joins with the disk: recorded against w-1's EK.
    let key = disk_key_by_join(&owner_tickets, &service, "w-1", &disk)
        .await
        .unwrap();
    assert_eq!(key, expected.as_slice());
    let bindings = keel_agent::disk_bindings::DiskBindings::new(&service.root);
    assert_eq!(bindings.len().unwrap(), 1);
    // Recorded in the store's journal, private to the service.
    let journal = keel_agent::journal::beside(bindings.path());
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&journal).unwrap().permissions()
        ) & 0o777,
        0o600
    );
    let tokens = service.registered_tokens().len();

    // Another attested TPM naming the recorded disk gets nothing: not by
    // rejoin, not by "joining" with its UUID (in any letter case), and no
    // token is registered for the attempt.
    assert_not_bound(other_tickets.rejoin_ticket(&service.endpoint, &disk).await);
    assert_not_bound(disk_key_by_join(&other_tickets, &service, "w-2", &disk).await);
    let upper = disk.to_ascii_uppercase();
    assert_not_bound(other_tickets.rejoin_ticket(&service.endpoint, &upper).await);
    assert_not_bound(disk_key_by_join(&other_tickets, &service, "w-2", &upper).await);
    assert_eq!(service.registered_tokens().len(), tokens);

    // The owner rejoins.
    let ticket = owner_tickets
        .rejoin_ticket(&service.endpoint, &disk)
        .await
        .unwrap();
    assert_eq!(ticket.disk_key.as_slice(), expected.as_slice());
    assert_eq!(ticket.cluster_id, service.state.cluster_id);
    // Joining again with its own disk (a retried join) is the owner's right.
    let again = disk_key_by_join(&owner_tickets, &service, "w-1", &disk)
        .await
        .unwrap();
    assert_eq!(again, expected.as_slice());

    // The binding survives a restart of the join service, and a reboot of
    // its node: the work directory, a tmpfs there, is gone.
    for reboot in [false, true] {
        if reboot {
            std::fs::remove_dir_all(service.work_dir()).unwrap();
        }
        service.restart().await;
        let ticket = owner_tickets
            .rejoin_ticket(&service.endpoint, &disk)
            .await
            .unwrap();
        assert_eq!(ticket.disk_key.as_slice(), expected.as_slice());
        assert_not_bound(other_tickets.rejoin_ticket(&service.endpoint, &disk).await);
        assert_not_bound(disk_key_by_join(&other_tickets, &service, "w-2", &disk).await);
    }

    // w-2 joins with a disk of its own, and rejoins with it.
    let own = join_common::uuid();
    disk_key_by_join(&other_tickets, &service, "w-2", &own)
        .await
        .unwrap();
    other_tickets
        .rejoin_ticket(&service.endpoint, &own)
        .await
        .unwrap();
    assert_eq!(bindings.len().unwrap(), 2);

    // A store that no longer loads stops the service from issuing anything:
    // refused with a fixed message, the file left for an operator.
    std::fs::write(
        bindings.path(),
        b"{\"version\":1,\"disks\":{\"not-a-uuid\":\"00\"}}",
    )
    .unwrap();
    match owner_tickets.rejoin_ticket(&service.endpoint, &disk).await {
        Err(TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::Internal);
            assert_eq!(status.message(), "the disk binding store is unavailable");
        }
        Err(other) => panic!("{}", keel_atls::ErrorChain(&other)),
        Ok(_) => panic!("a disk key was issued"),
    }
    assert!(keel_agent::join::JoinService::new(
        service.state.clone(),
        join_common::standin_kubeadm(&service.root),
        service.work_dir(),
        std::sync::Arc::new(keel_agent::disk_bindings::DiskBindings::new(&service.root)),
        join_common::newer_image(),
    )
    .is_err());
}

/// A mutual aTLS connection of `node` to `service`'s join port, held open
/// for as many requests as a test makes on it, and a maker of join
/// ticket requests for `node`.
struct OpenConnection {
    atls: keel_atls::AtlsClient<keel_verifier::validator::Verified>,
    endpoint: tonic::transport::Endpoint,
    tickets: keel_proto::join::join_service_client::JoinServiceClient<tonic::transport::Channel>,
    name: String,
}

impl OpenConnection {
    async fn new(node: &join_common::Member, ca: &EkCa, service: &Service) -> Self {
        use keel_agent::attestation::issuer::TpmIssuer;
        let trust = keel_verifier::ek::EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
        let validator = keel_agent::join::service_validator(&node.tpm, trust, None).unwrap();
        let atls = keel_atls::AtlsClient::mutual(
            std::sync::Arc::new(TpmIssuer::new(node.tpm.clone())),
            std::sync::Arc::new(validator),
        );
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://{}", service.endpoint))
                .unwrap();
        let bound = atls.bind_channel(endpoint.clone()).await.unwrap();
        Self {
            atls,
            endpoint,
            tickets: keel_proto::join::join_service_client::JoinServiceClient::new(bound.channel),
            name: node.name.clone(),
        }
    }

    /// Asks for a join ticket (a new disk each time) on this connection;
    /// returns the disk's UUID.
    async fn ticket(&mut self) -> Result<String, tonic::Status> {
        let key = KubeletKey::generate(&self.name).unwrap();
        let disk = join_common::uuid();
        let request = IssueJoinTicketRequest {
            disk_uuid: disk.clone(),
            kubelet_csr: key.csr_pem().as_bytes().to_vec(),
            is_control_plane: false,
            node_name: self.name.clone(),
            file_discovery: false,
        };
        self.tickets.issue_join_ticket(request).await.map(|_| disk)
    }

    /// Asks for a rejoin ticket for `disk` on this connection.
    async fn rejoin(&mut self, disk: &str) -> Result<(), tonic::Status> {
        let request = keel_proto::join::IssueRejoinTicketRequest {
            disk_uuid: disk.to_owned(),
        };
        self.tickets.issue_rejoin_ticket(request).await.map(|_| ())
    }

    /// Whether a new connection of the same node passes the handshake.
    async fn connects_again(&self) -> bool {
        self.atls.bind_channel(self.endpoint.clone()).await.is_ok()
    }
}

/// The handshake judged the node by the measurements accepted then; a
/// connection kept open past their withdrawal gets no ticket on it, and a
/// new one is refused at its handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_outliving_its_image_gets_no_ticket() {
    use keel_agent::attestation::policy::write_accepted;
    use std::sync::Arc;

    let ca = EkCa::new().unwrap();
    let port = free_port();
    let mut service = join_common::start_service(&ca, port).await;
    service.serving_older_members().await;
    let node = join_common::member(&ca, port, "w-1", "worker");
    let mut open = OpenConnection::new(&node, &ca, &service).await;

    // The operator replaces the join measurements (another image), as
    // SetJoinMeasurements does: the cluster state and the service's file.
    let other = boot_measurements_with(&service.config, [(11, Expected::enforced([1; 32]))]);
    let admitted = service.slot.borrow().clone().unwrap();
    service
        .slot
        .send_replace(Some(Arc::new(keel_agent::cluster::ClusterState {
            join_measurements: other.clone(),
            ..(*admitted).clone()
        })));
    write_accepted(&service.measurements, &other, None).unwrap();
    service.policy.reload().unwrap();

    for refused in [
        open.ticket().await.unwrap_err(),
        open.rejoin(&join_common::uuid()).await.unwrap_err(),
    ] {
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
        assert!(
            refused.message().contains("no longer accepted"),
            "{}",
            refused.message()
        );
    }
    assert!(!open.connects_again().await);
    assert!(service.registered_tokens().is_empty());

    // Accepted again, the same connection gets its ticket: the refusal was
    // the withdrawal's.
    service.slot.send_replace(Some(admitted));
    open.ticket().await.unwrap();
    assert_eq!(service.registered_tokens().len(), 1);
}

/// The agent measures its node identity once: a log with a second one
/// (here a control plane's after a worker's, both in PCR 13, which no
/// measurements fix) names no identity, and no ticket is issued for
/// either role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_with_two_node_identities_gets_no_ticket() {
    use keel_verifier::measurement::EventType;

    let ca = EkCa::new().unwrap();
    let port = free_port();
    let service = join_common::start_service(&ca, port).await;
    let node = join_common::member(&ca, port, "w-1", "worker");
    let second = join_common::config(&ca, port, "w-1", "control-plane").node_bytes();
    node.tpm
        .lock()
        .unwrap()
        .record(EventType::NodeIdentity, "node", second)
        .unwrap();
    let tickets = node.tickets(&ca);
    for is_control_plane in [false, true] {
        let key = KubeletKey::generate(&node.name).unwrap();
        let request = IssueJoinTicketRequest {
            disk_uuid: join_common::uuid(),
            kubelet_csr: key.csr_pem().as_bytes().to_vec(),
            is_control_plane,
            node_name: node.name.clone(),
            file_discovery: false,
        };
        let refused = tickets
            .request_join_ticket(&service.endpoint, request)
            .await
            .map(|_| ())
            .unwrap_err();
        let chain = keel_atls::ErrorChain(&refused).to_string();
        assert!(chain.contains("measured identity"), "{chain}");
    }
    assert!(service.registered_tokens().is_empty());
}

/// With the config's endpoint of every control plane, tickets send nodes
/// there for the API server, not to the issuing control plane's address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_send_nodes_to_the_clusters_api_server_endpoint() {
    let ca = EkCa::new().unwrap();
    let port = free_port();
    let mut service = join_common::start_service(&ca, port).await;
    let node = joiner(&ca, &ca, port, "w-1", "worker");
    let own = direct_ticket(&node, &ca, &service).await.unwrap();
    assert_eq!(
        own.api_server_endpoint,
        service.state.api_server.to_string()
    );
    service
        .restart_with(|s| s.with_api_server_endpoint(Some("api.cluster.example:6443".into())))
        .await;
    let shared = direct_ticket(&node, &ca, &service).await.unwrap();
    assert_eq!(shared.api_server_endpoint, "api.cluster.example:6443");
}

/// A connection asks for its ticket within a window of its handshake,
/// where the policy of the moment judged it (CPU evidence and collateral
/// included); later it must connect again and be judged anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_is_asked_for_within_the_window_of_its_handshake() {
    let ca = EkCa::new().unwrap();
    let port = free_port();
    let mut service = join_common::start_service(&ca, port).await;
    service.serving_older_members().await;
    service
        .restart_with(|s| s.with_ticket_window(Duration::from_millis(500)))
        .await;
    let node = join_common::member(&ca, port, "w-1", "worker");
    let mut open = OpenConnection::new(&node, &ca, &service).await;
    let disk = open.ticket().await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    for refused in [
        open.ticket().await.unwrap_err(),
        open.rejoin(&disk).await.unwrap_err(),
    ] {
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert!(refused.message().contains("connect again"), "{refused:?}");
    }
    assert_eq!(service.registered_tokens().len(), 1);
    // Connected again, it is judged now and gets its tickets.
    let mut again = OpenConnection::new(&node, &ca, &service).await;
    again.ticket().await.unwrap();
    again.rejoin(&disk).await.unwrap();
    assert_eq!(service.registered_tokens().len(), 2);
}

/// The join service's measurements file and its policy follow the cluster
/// state: the ticket handlers admit only the state's sets, so a file left
/// behind (stale, or a write that failed) would let no node join.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_join_measurements_file_and_policy_follow_the_cluster_state() {
    use keel_verifier::measurements::Measurements;
    use std::sync::Arc;

    let ca = EkCa::new().unwrap();
    let port = free_port();
    let mut service = join_common::start_service(&ca, port).await;
    service.serving_older_members().await;
    // A stale file: what a change that landed while serving started, or
    // a failed write, leaves.
    let stale = boot_measurements_with(&service.config, [(11, Expected::enforced([1; 32]))]);
    std::fs::write(&service.measurements, stale.to_json()).unwrap();
    service.policy.reload().unwrap();
    let follow = tokio::spawn(keel_agent::node::follow_join_measurements(
        service.slot.clone(),
        service.measurements.clone(),
        service.policy.clone(),
    ));
    let in_force = || {
        let state = service.slot.borrow().clone().unwrap();
        let file = Measurements::parse(&std::fs::read(&service.measurements).unwrap()).ok();
        // The policy's set is the file's with the required values added.
        file.as_ref() == Some(&state.join_measurements)
            && service.policy.current().measurements().get(11) == state.join_measurements.get(11)
    };
    let settle = || async {
        for _ in 0..250 {
            if in_force() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    };
    assert!(settle().await, "the state's set was not written at start");
    // A node of the state's image joins.
    let node = join_common::member(&ca, port, "w-1", "worker");
    OpenConnection::new(&node, &ca, &service)
        .await
        .ticket()
        .await
        .unwrap();
    // The state changes: the file and the policy follow.
    service
        .slot
        .send_replace(Some(Arc::new(keel_agent::cluster::ClusterState {
            join_measurements: stale,
            ..(*service.state).clone()
        })));
    assert!(settle().await, "the changed set was not written");
    follow.abort();
}

/// Attacker's move: the host writes a node name Kubernetes refuses into
/// the node part of a config (one an agent measured without checking it).
/// Such a node would take a ticket, lock, fail at kubeadm, and find its EK
/// kept to that name in the registry, refused under any other. The service
/// gives it no ticket, by join or by rejoin, and records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_name_kubernetes_refuses_gets_no_ticket_and_binds_nothing() {
    let ca = EkCa::new().unwrap();
    let port = free_port();
    let service = start_service_with(&ca, port, None, false).await;
    let mut config = join_common::config(&ca, port, "w-1", "worker");
    config.node.name = "w-1-".into();
    let node = join_common::joiner_with(config, keel_testkit::swtpm::Swtpm::start(&ca).unwrap());
    let tickets = node.tickets(&ca);
    let refused = |result: Result<_, TicketError>, code: tonic::Code, case: &str| match result {
        Err(TicketError::Refused(status)) => assert_eq!(status.code(), code, "{case}: {status:?}"),
        other => panic!("{case}: {other:?}"),
    };
    // Named as measured, or as it should have been: refused either way.
    for name in ["w-1-", "W-1", "w_1", "-w"] {
        let (request, spki) = worker_request(name);
        let result = tickets.join_ticket(&service.endpoint, request, &spki).await;
        refused(result.map(|_| ()), tonic::Code::InvalidArgument, name);
    }
    let (request, spki) = worker_request("w-1");
    let result = tickets.join_ticket(&service.endpoint, request, &spki).await;
    refused(result.map(|_| ()), tonic::Code::PermissionDenied, "w-1");
    let disk = join_common::uuid();
    let result = tickets.rejoin_ticket(&service.endpoint, &disk).await;
    refused(result.map(|_| ()), tonic::Code::PermissionDenied, "rejoin");
    let bindings = keel_agent::disk_bindings::DiskBindings::new(&service.root);
    assert_eq!(bindings.len().unwrap(), 0);
    assert!(service.registered_tokens().is_empty());
    node.assert_untouched();
}

/// A control plane runs a patch the joining node's image no longer pins
/// (its versions table moved on to a newer patch of the minor, as after an
/// image upgrade): the ticket names the components, so the node takes it
/// and joins at the cluster's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_a_cluster_at_a_patch_its_image_does_not_pin() {
    use keel_installer::KubernetesVersion;
    use std::sync::Arc;

    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let port = free_port();
    let service = start_service_with(&ca, port, Some(stand_in_components(&mirror)), false).await;
    let pinned = keel_installer::resolve("v1.31").unwrap().version();
    let older: KubernetesVersion = "v1.31.12".parse().unwrap();
    assert_ne!(older, pinned);
    assert!(keel_installer::resolve(&older.to_string()).is_err());
    service
        .slot
        .send_replace(Some(Arc::new(keel_agent::cluster::ClusterState {
            kubernetes_version: older,
            ..(*service.state).clone()
        })));

    let asking = joiner(&ca, &ca, port, "w-1", "worker");
    let (request, spki) = worker_request("w-1");
    let ticket = asking
        .tickets(&ca)
        .join_ticket(&service.endpoint, request, &spki)
        .await
        .unwrap();
    assert_eq!(ticket.version, older);
    assert_eq!(ticket.components, service.state.components);

    let node = joiner(&ca, &ca, port, "w-2", "worker");
    assert_eq!(joined(&node, &ca).await, service.state.cluster_id);
    let record = keel_agent::upgrade::NodeVersion::load(&node.root)
        .unwrap()
        .expect("no version record");
    assert_eq!(record.version, older);
    assert_eq!(record.components, service.state.components);
}

/// Attacker's move (flood): a control plane's ticket carries the whole
/// registry (up to 24 MB); ask for one again and again on streams whose
/// HTTP/2 window stays shut, so that every answer stays in the service's
/// memory. One ticket with the registry is out per EK at a time: a second
/// is refused while the first is unsent, and served once the first
/// stream is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_planes_unread_ticket_holds_off_its_next_one() {
    use keel_proto::join::join_service_client::JoinServiceClient;
    let ca = EkCa::new().unwrap();
    let port = free_port();
    let service = join_common::start_service(&ca, port).await;
    let node = join_common::member(&ca, port, "cp-1", "control-plane");
    let disk = join_common::uuid();
    let request = || {
        let key = KubeletKey::generate("cp-1").unwrap();
        IssueJoinTicketRequest {
            disk_uuid: disk.clone(),
            kubelet_csr: key.csr_pem().as_bytes().to_vec(),
            is_control_plane: true,
            node_name: "cp-1".into(),
            file_discovery: true,
        }
    };

    let trust = keel_verifier::ek::EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let validator = keel_agent::join::service_validator(&node.tpm, trust, None).unwrap();
    let atls = keel_atls::AtlsClient::mutual(
        std::sync::Arc::new(keel_agent::attestation::issuer::TpmIssuer::new(
            node.tpm.clone(),
        )),
        std::sync::Arc::new(validator),
    );
    let shut = tonic::transport::Endpoint::from_shared(format!("http://{}", service.endpoint))
        .unwrap()
        .initial_stream_window_size(0);
    let mut client = JoinServiceClient::new(atls.bind_channel(shut).await.unwrap().channel);
    let first = request();
    let unread = tokio::spawn(async move { client.issue_join_ticket(first).await });
    // Built and answered by now, not read.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !unread.is_finished(),
        "the ticket was read through a shut window"
    );

    let tickets = node.tickets(&ca);
    match tickets
        .request_join_ticket(&service.endpoint, request())
        .await
    {
        Err(TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}")
        }
        Err(e) => panic!("{}", keel_atls::ErrorChain(&e)),
        Ok(_) => panic!("a second ticket with the registry while the first is unsent"),
    }
    unread.abort();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ticket = tickets
        .request_join_ticket(&service.endpoint, request())
        .await
        .unwrap();
    assert!(!ticket.response.registry.is_empty());
}
