//! A cluster that outlives its first control plane, on swtpm-backed nodes
//! over real mutual aTLS: a second control plane joins and serves joins; a
//! worker joins and rejoins through it while the first is down; a control
//! plane that rebooted rejoins through another and serves joins again; and
//! with no join service left, recovery with the wrong and the right master
//! secret, and without the operator's init secret.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use join_common::{
    config_for, free_port, joiner_with, stand_in_components, start_service_for, Joiner,
};
use keel_agent::cluster::ClusterSlot;
use keel_agent::disk::Cryptsetup;
use keel_agent::join::JoinOutcome;
use keel_agent::provision::ProvisionError;
use keel_agent::recovery::{RecoveryError, RecoveryServer};
use keel_installer::MeasuredComponent;
use keel_proto::join::ControlPlaneSecrets;
use keel_proto::recovery::{RecoverRequest, RecoverySecrets};
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::keys::KeyService;
use prost::Message as _;

const LIMIT: Duration = Duration::from_secs(120);

/// Runs the join client of `node` (handing a control plane's state to
/// `slot`) to its end.
async fn run_client(node: &Joiner, ca: &EkCa, slot: &Arc<ClusterSlot>) -> JoinOutcome {
    let client = node.client(ca).with_cluster_slot(slot.clone());
    tokio::time::timeout(LIMIT, client.run())
        .await
        .expect("the join client did not finish")
}

/// Tokens the stand-in kubeadm under `root` registered.
fn tokens_under(root: &std::path::Path) -> usize {
    std::fs::read_dir(root.join("var/lib/keel-standin/tokens")).map_or(0, Iterator::count)
}

/// The operator's init secret, whose hash the recovering nodes' configs name.
const INIT_SECRET: &[u8] = b"the operator's init secret, 32+B";

/// The recovery service of `node`, its config naming [`INIT_SECRET`]'s hash
/// (as `Joiner::init_server` does, outside the measured config).
fn recovery_for(node: &Joiner, slot: &Arc<ClusterSlot>) -> RecoveryServer {
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let mut node = node.node(slot.clone());
    node.config.cluster.init_secret_hash = HASH
        .get_or_init(|| keel_verifier::init_secret::hash(INIT_SECRET).unwrap())
        .clone();
    RecoveryServer::new(node)
}

/// A recovery request with these secrets, sealed to `node`'s TPM.
fn recovery_with(
    node: &Joiner,
    secrets: &RecoverySecrets,
    measurement_salt: &[u8],
) -> RecoverRequest {
    RecoverRequest {
        secrets: Some(node.sealed(&secrets.encode_to_vec())),
        measurement_salt: measurement_salt.to_vec(),
        revoked_eks: Vec::new(),
    }
}

/// The operator's recovery request: the master secret and the init secret.
fn recover_request(
    node: &Joiner,
    master: &[u8],
    salt: &[u8],
    measurement_salt: &[u8],
) -> RecoverRequest {
    let secrets = RecoverySecrets {
        master_secret: master.to_vec(),
        master_salt: salt.to_vec(),
        init_secret: INIT_SECRET.to_vec(),
    };
    recovery_with(node, &secrets, measurement_salt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_planes_serve_joins_rejoin_and_recover() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let ports = [free_port(), free_port()];
    let mut cp0 = start_service_for(&ca, &ports, Some(stand_in_components(&mirror)), false).await;
    let cluster_id = cp0.state.cluster_id;
    // A cluster through many upgrades: more components of other versions
    // authorised than a state keeps; the oldest go, and a control-plane
    // ticket carries the rest.
    let many: Vec<keel_installer::Component> = (0..600u32)
        .map(|i| {
            keel_installer::Component::new(
                &format!("https://dl.example/v{i}/kubelet"),
                &format!("sha256:{i:064x}"),
                "/run/state/bin/kubelet",
                false,
            )
            .unwrap()
        })
        .collect();
    let authorised = cp0.state.authorising(&many);
    let kept = keel_agent::cluster::MAX_AUTHORISED_COMPONENTS;
    assert_eq!(authorised.authorised_components, many[600 - kept..]);
    // A component authorised again (one several versions share) is the
    // newest: the next to go is another.
    let shared = &many[600 - kept];
    let again = authorised.authorising(std::slice::from_ref(shared));
    assert_eq!(again.authorised_components.last(), Some(shared));
    assert_eq!(again.authorised_components.len(), kept);
    let more = again.authorising(&many[..1]);
    assert!(more.authorised_components.contains(shared));
    assert!(!more.authorised_components.contains(&many[601 - kept]));
    // A control plane of an older version may hold more than this
    // version's byte bound: large inline patches (200 KiB) as the newest
    // of the 512.
    let patches: Vec<_> = (0..10u32)
        .map(|i| {
            keel_installer::Component::new(
                &format!("data:,{}{i}", "p".repeat(20 * 1024)),
                &format!("sha256:{:064x}", 1000 + i),
                &format!("/opt/kubernetes/patches/q{i}.json"),
                false,
            )
            .unwrap()
        })
        .collect();
    let mut older = authorised.clone();
    older.authorised_components.drain(..patches.len());
    older.authorised_components.extend(patches.iter().cloned());
    cp0.slot.send_replace(Some(Arc::new(older.clone())));

    // A worker joins through cp-0 before cp-1 exists.
    let early = joiner_with(
        config_for(&ca, &ports, "w-0", "worker"),
        Swtpm::start(&ca).unwrap(),
    );
    match run_client(&early, &ca, &Arc::new(ClusterSlot::new(None))).await {
        JoinOutcome::Joined { cluster_id: id } => assert_eq!(id, cluster_id),
        other => panic!("{other:?}"),
    }

    // cp-1 joins as a control plane and gets what serving joins takes.
    let cp1 = joiner_with(
        config_for(&ca, &ports, "cp-1", "control-plane"),
        Swtpm::start(&ca).unwrap(),
    );
    let slot = Arc::new(ClusterSlot::new(None));
    match run_client(&cp1, &ca, &slot).await {
        JoinOutcome::Joined { cluster_id: id } => assert_eq!(id, cluster_id),
        other => panic!("{other:?}"),
    }
    let state = slot.borrow().clone().expect("cp-1 has no cluster state");
    assert_eq!(state.cluster_id, cluster_id);
    assert_eq!(state.keys.expose_master(), cp0.state.keys.expose_master());
    assert_eq!(state.control_plane_endpoints.len(), 2);
    // The authorised components, held to this version's bounds: the
    // oldest go, the newest (the patches) stay.
    assert_eq!(
        state.authorised_components,
        older.authorising(&[]).authorised_components
    );
    assert!(state.authorised_components.len() < older.authorised_components.len());
    assert!(state.authorised_components.ends_with(&patches));
    assert!(cp1.root.join("etc/kubernetes/pki/ca.key").is_file());
    assert!(cp1
        .root
        .join(keel_agent::paths::CONTROL_PLANE_FACTS)
        .is_file());
    cp1.assert_disk_opens(&cp0);
    let serving = cp1.serve_join(ports[1], slot.clone()).await;
    // Its own disk, bound by cp-0 at its join, is bound to it at cp-1 too
    // and named in its own record there.
    let cp1_ek = join_common::ek_digest(&cp1.tpm);
    let cp1_disk = Cryptsetup::default().uuid(&cp1.disk).unwrap();
    let own_disk_held = |root: &std::path::Path| {
        let bound = keel_agent::disk_bindings::DiskBindings::new(root)
            .lookup(&cp1_disk)
            .unwrap();
        let recorded = keel_agent::registry::RegistryStore::shared(root)
            .unwrap()
            .snapshot()
            .nodes()
            .get(&cp1_ek.to_string())
            .map(|r| r.disk_uuid.clone());
        bound == Some(cp1_ek) && recorded.as_deref() == Some(cp1_disk.as_str())
    };
    assert!(own_disk_held(&cp0.root) && own_disk_held(&cp1.root));

    // cp-1 holds every name before it serves: its own from the moment it
    // serves, w-0's from its ticket, which carried cp-0's registry. A
    // second TPM under either name gets no ticket there, before cp-1 ever
    // exchanged registries with cp-0.
    let held = keel_agent::registry::RegistryStore::shared(&cp1.root)
        .unwrap()
        .snapshot();
    let names: Vec<_> = held.nodes().values().map(|r| r.name.as_str()).collect();
    assert!(names.contains(&"w-0"), "{names:?}");
    for name in ["cp-1", "w-0"] {
        let impostor = join_common::member_with(&ca, config_for(&ca, &ports, name, "worker"));
        let key = keel_agent::join::KubeletKey::generate(name).unwrap();
        let request = keel_proto::join::IssueJoinTicketRequest {
            disk_uuid: join_common::uuid(),
            kubelet_csr: key.csr_pem().as_bytes().to_vec(),
            is_control_plane: false,
            node_name: name.into(),
            file_discovery: true,
        };
        match impostor
            .tickets(&ca)
            .request_join_ticket(&format!("127.0.0.1:{}", ports[1]), request)
            .await
        {
            Err(keel_agent::join::TicketError::Refused(status)) => assert!(
                status.message().contains("holds this node's name"),
                "{name}: {status:?}"
            ),
            Err(e) => panic!(
                "{name}: not refused for its name: {}",
                keel_atls::ErrorChain(&e)
            ),
            Ok(_) => panic!("a ticket went to a second TPM under {name}'s name"),
        }
    }

    // Attacker's move: a node under a free name asks cp-1, which never saw
    // w-0's disk join, for a ticket naming that disk (its UUID is in the
    // clear in the LUKS header), to bind it there to its own TPM: cp-1
    // would then refuse w-0's rejoins and evidence. w-0's record, from
    // cp-0's registry, refuses it before anything is bound.
    let w0_disk = Cryptsetup::default().uuid(&early.disk).unwrap();
    let claimer = join_common::member_with(&ca, config_for(&ca, &ports, "w-9", "worker"));
    let key = keel_agent::join::KubeletKey::generate("w-9").unwrap();
    let request = keel_proto::join::IssueJoinTicketRequest {
        disk_uuid: w0_disk.clone(),
        kubelet_csr: key.csr_pem().as_bytes().to_vec(),
        is_control_plane: false,
        node_name: "w-9".into(),
        file_discovery: true,
    };
    match claimer
        .tickets(&ca)
        .request_join_ticket(&format!("127.0.0.1:{}", ports[1]), request)
        .await
    {
        Err(keel_agent::join::TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied);
            assert!(
                status.message().contains("not bound to this node's TPM"),
                "{status:?}"
            );
        }
        Err(e) => panic!("not refused for the disk: {}", keel_atls::ErrorChain(&e)),
        Ok(_) => panic!("a ticket bound w-0's disk to another TPM at cp-1"),
    }
    let bindings = keel_agent::disk_bindings::DiskBindings::new(&cp1.root);
    assert_eq!(bindings.lookup(&w0_disk).unwrap(), None);

    // cp-0 goes down: a worker joins through cp-1, with a ticket as good as
    // one from cp-0 (same cluster, a disk key cp-0 derives too).
    cp0.stop().await;
    let (cp0_tokens, cp1_tokens) = (tokens_under(&cp0.root), tokens_under(&cp1.root));
    let worker = joiner_with(
        config_for(&ca, &ports, "w-1", "worker"),
        Swtpm::start(&ca).unwrap(),
    );
    let none = Arc::new(ClusterSlot::new(None));
    match run_client(&worker, &ca, &none).await {
        JoinOutcome::Joined { cluster_id: id } => assert_eq!(id, cluster_id),
        other => panic!("{other:?}"),
    }
    assert!(none.borrow().is_none(), "a worker got a cluster state");
    // Its ticket came from cp-1, and cost no token (the worker joins with
    // file discovery).
    let admitted = |root: &std::path::Path| {
        keel_agent::registry::Registry::on_disk(&root.join(keel_agent::paths::NODE_REGISTRY))
            .unwrap()
            .find("w-1")
            .is_ok()
    };
    assert!(admitted(&cp1.root) && !admitted(&cp0.root));
    assert_eq!(tokens_under(&cp0.root), cp0_tokens);
    assert_eq!(tokens_under(&cp1.root), cp1_tokens);
    assert_eq!(worker.pcr15(), join_common::pcr15(&cp0.tpm));
    worker.assert_disk_opens(&cp0);

    // The worker reboots and rejoins through cp-1, where it joined (cp-0
    // is still down).
    let worker = worker.reboot(&ca);
    match run_client(&worker, &ca, &none).await {
        JoinOutcome::Rejoined { cluster_id: id } => assert_eq!(id, cluster_id),
        other => panic!("{other:?}"),
    }

    // cp-1 reboots while cp-0 is back: it rejoins through cp-0, reopens its
    // disk, gets the master secret again and serves joins.
    serving.abort();
    let _ = serving.await;
    cp0.restart().await;

    // The worker reboots again and rejoins through cp-0, which never saw
    // its disk (it joined while cp-0 was down): cp-0 records the node but
    // not the disk it only claims, since a record naming a disk is what
    // `keel revoke <disk>` finds.
    let worker = worker.reboot(&ca);
    match run_client(&worker, &ca, &none).await {
        JoinOutcome::Rejoined { cluster_id: id } => assert_eq!(id, cluster_id),
        other => panic!("{other:?}"),
    }
    let seen = keel_agent::registry::RegistryStore::shared(&cp0.root)
        .unwrap()
        .snapshot();
    let record = seen
        .nodes()
        .get(&join_common::ek_digest(&worker.tpm).to_string())
        .expect("cp-0 registered the rejoined worker");
    assert_eq!(record.disk_uuid, "", "{record:?}");
    let cp1 = cp1.reboot(&ca);
    assert_eq!(cp1.pcr15(), [0; 32]);
    let slot = Arc::new(ClusterSlot::new(None));
    match run_client(&cp1, &ca, &slot).await {
        JoinOutcome::Rejoined { cluster_id: id } => assert_eq!(id, cluster_id),
        other => panic!("{other:?}"),
    }
    let state = slot
        .borrow()
        .clone()
        .expect("cp-1 restored no cluster state");
    assert_eq!(state.cluster_id, cluster_id);
    assert_eq!(state.keys.expose_master(), cp0.state.keys.expose_master());
    let serving = cp1.serve_join(ports[1], slot.clone()).await;
    serving.abort();
    let _ = serving.await;

    // Every join service gone, cp-1 reboots once more: only recovery
    // brings it back.
    cp0.stop().await;
    let cp1 = cp1.reboot(&ca);
    let slot = Arc::new(ClusterSlot::new(None));
    let recovery = recovery_for(&cp1, &slot);
    let (master, salt) = cp0.state.keys.expose_master();
    let operator: IpAddr = "192.0.2.7".parse().unwrap();
    let uuid_before = Cryptsetup::default().uuid(&cp1.disk).unwrap();

    // cp-1's host formats its disk anew with the key that a master secret
    // of its own derives for it (the disk's UUID and the node's EK are no
    // secret) and asks for recovery with that secret, to have a control
    // plane of this cluster's image and config serve joins into a cluster
    // of its own. The disk opens with it; without the operator's init
    // secret the node takes nothing: refused before the lock.
    let backup = std::fs::read(&cp1.disk).unwrap();
    let forged = RecoverySecrets {
        master_secret: vec![0x66; 32],
        master_salt: vec![0x77; 32],
        init_secret: Vec::new(),
    };
    let forged_key = KeyService::new(&forged.master_secret, &forged.master_salt)
        .unwrap()
        .disk_key(&uuid_before, &join_common::ek_digest(&cp1.tpm))
        .unwrap();
    let cryptsetup = Cryptsetup::default();
    cryptsetup
        .format_with_uuid(&cp1.disk, &uuid_before, &forged_key)
        .unwrap();
    cryptsetup
        .relabel(&cp1.disk, keel_agent::disk::cryptsetup::PROVISIONED_LABEL)
        .unwrap();
    assert!(cryptsetup.key_matches(&cp1.disk, &forged_key).unwrap());
    let no_init_secret = recovery_with(&cp1, &forged, &[0x55; 32]);
    match recovery.recover(no_init_secret, None).await {
        Err(e @ RecoveryError::NoInitSecret) => {
            assert_eq!(tonic::Status::from(&e).code(), tonic::Code::InvalidArgument)
        }
        other => panic!("{other:?}"),
    }
    let guessed = RecoverySecrets {
        init_secret: b"not the operator's init secret!!".to_vec(),
        ..forged.clone()
    };
    match recovery
        .recover(recovery_with(&cp1, &guessed, &[0x55; 32]), None)
        .await
    {
        Err(e @ RecoveryError::WrongInitSecret) => {
            assert_eq!(tonic::Status::from(&e).code(), tonic::Code::Unauthenticated)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(cp1.pcr15(), [0; 32]);
    assert!(!cp1.lock.is_locked());
    assert!(slot.borrow().is_none());
    std::fs::write(&cp1.disk, &backup).unwrap();
    // A request as `keel recover` sent it before the init secret was
    // required (the master secret alone): refused as such.
    let old_cli = ControlPlaneSecrets {
        master_secret: master.to_vec(),
        master_salt: salt.to_vec(),
    };
    let request = RecoverRequest {
        secrets: Some(cp1.sealed(&old_cli.encode_to_vec())),
        measurement_salt: cp0.state.measurement_salt.to_vec(),
        revoked_eks: Vec::new(),
    };
    match recovery.recover(request, None).await {
        Err(RecoveryError::NoInitSecret) => {}
        other => panic!("{other:?}"),
    }
    assert!(!cp1.lock.is_locked());

    // Another cluster's master secret: refused before anything changes.
    let wrong = recover_request(&cp1, &[0x42; 32], salt, &cp0.state.measurement_salt);
    match recovery.recover(wrong, Some(operator)).await {
        Err(RecoveryError::WrongSecret) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(cp1.pcr15(), [0; 32]);
    assert!(!cp1.lock.is_locked());
    assert_eq!(Cryptsetup::default().uuid(&cp1.disk).unwrap(), uuid_before);
    assert!(slot.borrow().is_none());
    // The same address at once again: it waits, whatever it sends.
    let right = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    match recovery.recover(right, Some(operator)).await {
        Err(e @ RecoveryError::Throttled(_)) => {
            assert_eq!(
                tonic::Status::from(&e).code(),
                tonic::Code::ResourceExhausted
            )
        }
        other => panic!("{other:?}"),
    }
    // Sealed secrets that do not decode cost the TPM as much: throttled
    // too, however well sealed.
    let prober: IpAddr = "192.0.2.8".parse().unwrap();
    let garbage = RecoverRequest {
        secrets: Some(cp1.sealed(&[0xff; 40])),
        measurement_salt: cp0.state.measurement_salt.to_vec(),
        revoked_eks: Vec::new(),
    };
    match recovery.recover(garbage, Some(prober)).await {
        Err(e @ RecoveryError::InvalidRequest(_)) => {
            assert_eq!(tonic::Status::from(&e).code(), tonic::Code::InvalidArgument)
        }
        other => panic!("{other:?}"),
    }
    let right = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    match recovery.recover(right, Some(prober)).await {
        Err(RecoveryError::Throttled(_)) => {}
        other => panic!("after a request that does not decode: {other:?}"),
    }
    // A caller that goes away while the TPM opens its request (it resets
    // the stream) is counted all the same: its address is told to retry
    // while that request runs, and is throttled once it failed.
    let canceller: IpAddr = "192.0.2.9".parse().unwrap();
    let garbage = RecoverRequest {
        secrets: Some(cp1.sealed(&[0xff; 40])),
        measurement_salt: cp0.state.measurement_salt.to_vec(),
        revoked_eks: Vec::new(),
    };
    let dropped = tokio::time::timeout(
        Duration::from_millis(1),
        recovery.recover(garbage, Some(canceller)),
    )
    .await;
    assert!(dropped.is_err(), "answered within 1 ms: {dropped:?}");
    let answer = loop {
        let right = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
        match recovery.recover(right, Some(canceller)).await {
            Err(RecoveryError::SourceBusy) => tokio::time::sleep(Duration::from_millis(20)).await,
            other => break other,
        }
    };
    match answer {
        Err(RecoveryError::Throttled(_)) => {}
        other => panic!("after a request whose caller went away: {other:?}"),
    }
    // A flood from many addresses: a bounded number runs or waits, the
    // rest are told to retry at once, before the TPM.
    let flood = (0..=keel_agent::recovery::MAX_WAITING).map(|i| {
        let from: IpAddr = format!("198.51.100.{}", i + 1).parse().unwrap();
        let junk = RecoverRequest {
            secrets: Some(cp1.sealed(&[0xff; 40])),
            measurement_salt: cp0.state.measurement_salt.to_vec(),
            revoked_eks: Vec::new(),
        };
        recovery.recover(junk, Some(from))
    });
    let answers = futures_util::future::join_all(flood).await;
    let busy = answers
        .iter()
        .filter(|a| matches!(a, Err(RecoveryError::Busy)))
        .count();
    assert_eq!(busy, 1, "{answers:?}");
    assert_eq!(
        tonic::Status::from(&RecoveryError::Busy).code(),
        tonic::Code::Unavailable
    );
    // One address holds one place: its second request while the first
    // runs or waits is told to retry, and the places stay for others.
    let from: IpAddr = "198.51.100.200".parse().unwrap();
    let twice = (0..2).map(|_| {
        let junk = RecoverRequest {
            secrets: Some(cp1.sealed(&[0xff; 40])),
            measurement_salt: cp0.state.measurement_salt.to_vec(),
            revoked_eks: Vec::new(),
        };
        recovery.recover(junk, Some(from))
    });
    let answers = futures_util::future::join_all(twice).await;
    let busy = answers
        .iter()
        .filter(|a| matches!(a, Err(RecoveryError::SourceBusy)))
        .count();
    assert_eq!(busy, 1, "{answers:?}");
    assert!(!cp1.lock.is_locked());
    // A worker is never recovered.
    let worker_recovery = recovery_for(&worker, &Arc::new(ClusterSlot::new(None)));
    let request = recover_request(&worker, master, salt, &cp0.state.measurement_salt);
    match worker_recovery.recover(request, None).await {
        Err(e @ RecoveryError::NotControlPlane) => {
            assert_eq!(
                tonic::Status::from(&e).code(),
                tonic::Code::FailedPrecondition
            )
        }
        other => panic!("{other:?}"),
    }

    // The right master secret with another measurement salt (which no
    // seal covers): the node locks to another cluster ID, finds its disk
    // holds this cluster, and fails without serving; after a reboot the
    // right request recovers it.
    let other_salt = recover_request(&cp1, master, salt, &[9; 32]);
    match recovery.recover(other_salt, None).await {
        Err(RecoveryError::Provision(e @ ProvisionError::OtherCluster { .. })) => {
            assert!(e.to_string().contains("measurement salt"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    assert!(slot.borrow().is_none());
    let cp1 = cp1.reboot(&ca);
    let recovery = recovery_for(&cp1, &slot);

    // Booted from another image (its UKI, PCR 4, differs: say one the
    // operator retired): the node locks, finds that its disk's cluster
    // neither runs nor stages its image, and serves nothing. No peer's
    // join service checks a recovering node's image; this check does.
    cp1.tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(4, &[0xa; 32])
        .unwrap();
    let retired = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    match recovery.recover(retired, None).await {
        Err(e @ RecoveryError::Provision(ProvisionError::ImageNotAccepted)) => {
            // The operator's CLI is told why.
            let status = tonic::Status::from(&e);
            assert_eq!(status.code(), tonic::Code::FailedPrecondition);
            assert!(status.message().contains("retired image"), "{status:?}")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        slot.borrow().is_none(),
        "a retired image got a cluster state"
    );
    let cp1 = cp1.reboot(&ca);
    let recovery = recovery_for(&cp1, &slot);

    // Both copies of its disk's LUKS header damaged, then a LUKS1 header:
    // the operator is told so, and nothing is locked or written; with the
    // header restored from a backup, recovery goes on.
    let backup = std::fs::read(&cp1.disk).unwrap();
    join_common::damage_luks_headers(&cp1.disk);
    let damaged = std::fs::read(&cp1.disk).unwrap();
    let request = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    match recovery.recover(request, None).await {
        Err(e @ RecoveryError::DiskDamaged) => {
            let status = tonic::Status::from(&e);
            assert_eq!(status.code(), tonic::Code::FailedPrecondition);
            assert!(
                status.message().contains("damaged LUKS header"),
                "{status:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(!cp1.lock.is_locked());
    assert!(std::fs::read(&cp1.disk).unwrap() == damaged, "disk changed");
    // The disk is judged before the TPM opens anything: sealed bytes that
    // do not decode get the disk's answer, not the TPM's, twice from one
    // address (nothing it sent was judged, so it is not throttled).
    let from: IpAddr = "203.0.113.7".parse().unwrap();
    for _ in 0..2 {
        let junk = RecoverRequest {
            secrets: Some(cp1.sealed(&[0xff; 40])),
            measurement_salt: cp0.state.measurement_salt.to_vec(),
            revoked_eks: Vec::new(),
        };
        match recovery.recover(junk, Some(from)).await {
            Err(RecoveryError::DiskDamaged) => {}
            other => panic!("{other:?}"),
        }
    }

    // A LUKS1 header in its place: not keel's, refused as such.
    join_common::format_luks1(&cp1.disk);
    let foreign = std::fs::read(&cp1.disk).unwrap();
    let request = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    match recovery.recover(request, None).await {
        Err(e @ RecoveryError::DiskForeign) => {
            let status = tonic::Status::from(&e);
            assert_eq!(status.code(), tonic::Code::FailedPrecondition);
            assert!(status.message().contains("keel cannot use"), "{status:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!cp1.lock.is_locked());
    assert!(std::fs::read(&cp1.disk).unwrap() == foreign, "disk changed");
    std::fs::write(&cp1.disk, &backup).unwrap();

    // A revoked EK that is no EK digest as the workspace writes them:
    // refused before anything changes.
    let mut odd = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    odd.revoked_eks = vec![format!("sha256:{}", "AB".repeat(32))];
    match recovery.recover(odd, None).await {
        Err(RecoveryError::InvalidRequest(why)) => assert!(why.contains("revoked EK"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(!cp1.lock.is_locked());

    // The right master secret: the node locks to the cluster ID stored on
    // its disk and serves joins. The operator revoked a node while cp-1
    // was down (through cp-0, now gone too): the workspace's record comes
    // with the request, and cp-1's revocation list holds it before it
    // serves, so that node gets no ticket or disk key from it.
    let missed = keel_agent::disk_bindings::EkDigest::from_hex(&"ab".repeat(32)).unwrap();
    let mut right = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    right.revoked_eks = vec![missed.to_string()];
    let id = recovery.recover(right, None).await.unwrap();
    assert_eq!(id, cluster_id);
    let registry = keel_agent::registry::RegistryStore::shared(&cp1.root).unwrap();
    assert!(
        registry.revocation(&missed).is_some(),
        "the workspace's revocation is not on the recovered control plane's list"
    );
    assert_eq!(cp1.pcr15(), join_common::pcr15(&cp0.tpm));
    let state = slot
        .borrow()
        .clone()
        .expect("the recovered node has no cluster state");
    assert_eq!(state.cluster_id, cluster_id);
    // Its join port is held a moment by another process (a host-network
    // pod, say) when the recovered node sets up its join service: the
    // set-up is tried again, not given up, and the node serves once the
    // port is free.
    let held = std::net::TcpListener::bind(("127.0.0.1", ports[1])).unwrap();
    let serving = cp1.start_join_service(ports[1], slot.clone());
    // Past the first set-up and the first retry (1 s later).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!serving.is_finished(), "the join service gave up");
    drop(held);
    join_common::wait_for_port(format!("127.0.0.1:{}", ports[1]).parse().unwrap()).await;
    // Recovered, it serves with its own disk bound to its EK and named in
    // its own record, as after every start.
    assert_eq!(uuid_before, cp1_disk);
    assert!(own_disk_held(&cp1.root));

    // Once recovered, the node is locked: a second recovery is refused.
    let again = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    match recovery.recover(again, None).await {
        Err(e @ RecoveryError::Locked) => {
            assert_eq!(
                tonic::Status::from(&e).code(),
                tonic::Code::FailedPrecondition
            )
        }
        other => panic!("{other:?}"),
    }

    // And the others rejoin through it.
    let worker = worker.reboot(&ca);
    match run_client(&worker, &ca, &none).await {
        JoinOutcome::Rejoined { cluster_id: id } => assert_eq!(id, cluster_id),
        other => panic!("{other:?}"),
    }
    serving.abort();
    let _ = serving.await;

    // cp-1's host rewrites its node config to another name, and every
    // control plane goes down: recovery does not bring it back under that
    // name (its own registry, read once its disk is open, holds its EK as
    // cp-1), and it serves nothing.
    let mut renamed = cp1.config.clone();
    renamed.node.name = "cp-9".into();
    let config = cp1.config.clone();
    let cp1 = join_common::reboot(renamed, &ca, cp1.dir, cp1.disk);
    let slot = Arc::new(ClusterSlot::new(None));
    let recovery = recovery_for(&cp1, &slot);
    let right = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    match recovery.recover(right, None).await {
        Err(e @ RecoveryError::Provision(ProvisionError::Renamed(_))) => {
            let status = tonic::Status::from(&e);
            assert_eq!(status.code(), tonic::Code::FailedPrecondition);
            assert!(
                status
                    .message()
                    .contains("joined as \"cp-1 (control-plane)\""),
                "{status:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        slot.borrow().is_none(),
        "a renamed node got a cluster state"
    );
    let cp1 = join_common::reboot(config, &ca, cp1.dir, cp1.disk);

    // cp-1 is revoked (the revocation reached its registry as another
    // control plane's), then every control plane goes down: recovery with
    // the right master secret does not bring it back (its own registry,
    // read once its disk is open, names it), and it serves nothing.
    cp1.revoke_in_own_registry();
    let cp1 = cp1.reboot(&ca);
    let slot = Arc::new(ClusterSlot::new(None));
    let recovery = recovery_for(&cp1, &slot);
    let right = recover_request(&cp1, master, salt, &cp0.state.measurement_salt);
    match recovery.recover(right, None).await {
        Err(RecoveryError::Provision(ProvisionError::Revoked(why))) => {
            assert!(why.contains("revoked by the operator"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        slot.borrow().is_none(),
        "a revoked node got a cluster state"
    );

    // Nor does a rejoin bring it back through a control plane that never
    // heard of the revocation (the host kept it cut off meanwhile): the
    // ticket comes, and the node's own registry refuses it.
    let cp1 = cp1.reboot(&ca);
    cp0.restart().await;
    let slot = Arc::new(ClusterSlot::new(None));
    match run_client(&cp1, &ca, &slot).await {
        JoinOutcome::Failed { error } => {
            assert!(error.contains("revocation list"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        slot.borrow().is_none(),
        "a revoked node got a cluster state"
    );
}

/// The cluster state's facts stay what a control plane reads back after a
/// reboot: authorised components are bounded in bytes (the oldest go), and
/// a state past the facts' bound is not saved, nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_facts_never_outgrow_what_a_control_plane_reads_back() {
    use keel_agent::cluster::{change_state, ClusterState, ControlPlaneFacts, FactsError};

    let ca = EkCa::new().unwrap();
    let service = join_common::start_service(&ca, free_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // Inline patches of 20 KiB each, as upgrade plans may carry.
    let inline = |i: u32| {
        keel_installer::Component::new(
            &format!("data:,{}{i}", "a".repeat(20 * 1024)),
            &format!("sha256:{i:064x}"),
            &format!("/opt/kubernetes/patches/p{i}.json"),
            false,
        )
        .unwrap()
    };
    let many: Vec<_> = (0..40).map(inline).collect();
    let authorised = service.state.authorising(&many);
    let kept = authorised.authorised_components.len();
    assert!((10..40).contains(&kept), "{kept}");
    assert_eq!(authorised.authorised_components, many[40 - kept..]);
    change_state::<FactsError>(&service.slot, root, |_| Ok(authorised.clone())).unwrap();
    let saved = ControlPlaneFacts::load(root).unwrap();
    assert_eq!(
        saved.authorised_components,
        authorised.authorised_components
    );

    // A state past the bound (not made through `authorising`): refused,
    // neither the facts nor the state change.
    let huge = ClusterState {
        authorised_components: (0..300).map(inline).collect(),
        ..authorised.clone()
    };
    let refused = change_state::<FactsError>(&service.slot, root, |_| Ok(huge)).unwrap_err();
    assert!(matches!(refused, FactsError::TooLarge(_)), "{refused}");
    let state = service.slot.borrow().clone().unwrap();
    assert_eq!(
        state.authorised_components,
        authorised.authorised_components
    );
    let saved = ControlPlaneFacts::load(root).unwrap();
    assert_eq!(
        saved.authorised_components,
        authorised.authorised_components
    );
}

/// The control plane `service` runs, restored (as at a reboot) from the
/// facts and version record saved in `root`: its state and the lines its
/// provisioning logged.
fn restored(
    service: &join_common::Service,
    root: &std::path::Path,
    work: &std::path::Path,
) -> (keel_agent::cluster::ClusterState, Vec<String>) {
    let env = join_common::node_env(root, work, None);
    let lines = std::sync::Mutex::new(Vec::new());
    let log = |line: String| lines.lock().unwrap().push(line);
    let (master, salt) = service.state.keys.expose_master();
    let keys = keel_verifier::keys::KeyService::new(master, salt).unwrap();
    let state = keel_agent::provision::Provisioner::new(&env, &service.tpm, &log)
        .restore_control_plane(keys, None)
        .unwrap();
    (state, lines.into_inner().unwrap())
}

/// A control plane restored (a rejoin, a recovery, an agent restart) on a
/// node whose route lookup finds no route to take the address it
/// advertises from is refused: its join service would hand the loopback
/// address to every node that joins through it as the API server's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_with_no_route_to_advertise_on_is_not_restored() {
    use keel_agent::address::AdvertiseAddress;
    use keel_agent::cluster::ControlPlaneFacts;

    let ca = EkCa::new().unwrap();
    let service = join_common::start_service(&ca, free_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let (root, work) = (dir.path().join("root"), dir.path().join("work"));
    ControlPlaneFacts::of(&service.state).save(&root).unwrap();
    let mut env = join_common::node_env(&root, &work, None);
    // A broadcast address stands in for a peer without a route.
    env.advertise_address = AdvertiseAddress::Toward(std::net::Ipv4Addr::BROADCAST.into());
    let (master, salt) = service.state.keys.expose_master();
    let keys = KeyService::new(master, salt).unwrap();
    let log = |_: String| {};
    let refused = keel_agent::provision::Provisioner::new(&env, &service.tpm, &log)
        .restore_control_plane(keys, None)
        .unwrap_err();
    assert!(matches!(refused, ProvisionError::NoAddress(_)), "{refused}");

    // With a route, the same facts restore.
    let (state, _) = restored(&service, &root, &work);
    assert_eq!(state.cluster_id, service.state.cluster_id);
}

/// An upgrade that stopped between the node's version record and the
/// control-plane facts: after the reboot the control plane serves the
/// version its record names (the one the boot installs), the version
/// before still authorised for members that run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_stopped_between_record_and_facts_serves_the_recorded_version() {
    use keel_agent::cluster::ControlPlaneFacts;
    use keel_agent::upgrade::NodeVersion;

    let ca = EkCa::new().unwrap();
    let service = join_common::start_service(&ca, free_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let (root, work) = (dir.path().join("root"), dir.path().join("work"));
    ControlPlaneFacts::of(&service.state).save(&root).unwrap();
    let next = keel_installer::resolve("v1.32").unwrap();
    assert_ne!(next.version(), service.state.kubernetes_version);
    NodeVersion {
        version: next.version(),
        components: next.components().to_vec(),
    }
    .save(&root)
    .unwrap();

    let (state, lines) = restored(&service, &root, &work);
    assert_eq!(state.kubernetes_version, next.version());
    assert_eq!(state.components, next.components());
    for before in &service.state.components {
        let measured = MeasuredComponent::parse(&before.measurement_record()).unwrap();
        assert!(state.authorises(&measured), "{before:?}");
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains(&format!("serving {}", next.version()))),
        "{lines:?}"
    );
}

/// A control plane rebooted into an image whose versions table pins
/// another patch of its minor (the cluster runs v1.31.12, the image pins
/// v1.31.13): its facts and record name the components it runs, so it
/// restores them and serves the version it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_restores_facts_of_a_patch_its_image_no_longer_pins() {
    use keel_agent::cluster::ControlPlaneFacts;
    use keel_agent::upgrade::NodeVersion;
    use keel_installer::KubernetesVersion;

    let ca = EkCa::new().unwrap();
    let service = join_common::start_service(&ca, free_port()).await;
    let dir = tempfile::tempdir().unwrap();
    let (root, work) = (dir.path().join("root"), dir.path().join("work"));
    let pinned = keel_installer::resolve("v1.31").unwrap();
    let older: KubernetesVersion = "v1.31.12".parse().unwrap();
    assert_ne!(older, pinned.version());
    assert!(keel_installer::resolve(&older.to_string()).is_err());
    let mut facts = ControlPlaneFacts::of(&service.state);
    facts.kubernetes_version = older.to_string();
    facts.components = pinned.components().to_vec();
    facts.save(&root).unwrap();
    NodeVersion {
        version: older,
        components: pinned.components().to_vec(),
    }
    .save(&root)
    .unwrap();

    let (state, lines) = restored(&service, &root, &work);
    assert_eq!(state.kubernetes_version, older);
    assert_eq!(state.components, pinned.components());
    // The record matched the facts: nothing was taken from it.
    assert!(!lines.iter().any(|l| l.contains("serving")), "{lines:?}");
}
