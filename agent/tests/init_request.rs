//! An init request without usable join measurements is refused before the
//! node lock: the node's join service could not admit anyone by it, or
//! would admit a node that booted anything.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use join_common::{free_port, joiner};
use keel_agent::init::InitServer;
use keel_proto::init::init_service_server::InitService;
use keel_proto::init::{InitRequest, InitSecrets};
use keel_testkit::swtpm::EkCa;
use keel_verifier::measurement::pcr;
use prost::Message as _;

const SECRET: &[u8] = b"init secret of the checked node";

const H: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn entry(pcr: u32, warn_only: bool) -> String {
    format!(r#""{pcr}": {{"expected": "{H}", "warnOnly": {warn_only}}}"#)
}

fn file(entries: &[String]) -> Vec<u8> {
    format!("{{{}}}", entries.join(", ")).into_bytes()
}

fn enforced(pcrs: &[u32]) -> Vec<String> {
    pcrs.iter().map(|&p| entry(p, false)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_malformed_or_unenforcing_join_measurements_are_refused_before_the_lock() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "checked-0", "control-plane");
    let init = node.init_server(SECRET, false);
    let sealed = sealed_secrets(&node);
    let mut cases = vec![
        ("missing", Vec::new(), "join measurements"),
        ("empty", b"{}".to_vec(), "name no PCR"),
        (
            "malformed",
            br#"{"4": "not hex"}"#.to_vec(),
            "join measurements",
        ),
        ("too large", vec![b' '; 65 * 1024], "join measurements"),
        (
            "all warn-only",
            file(&[4, 9, 11, 12, 15].map(|p| entry(p, true))),
            "enforce no PCR",
        ),
        (
            "PCR 12 warn-only",
            file(&[enforced(&[4, 9, 11]), vec![entry(12, true)]].concat()),
            "PCR 12 warn-only",
        ),
        (
            "repeated key",
            file(&[enforced(&[4, 9, 11, 12]), vec![entry(12, true)]].concat()),
            "\"12\" appears more than once",
        ),
    ];
    for (missing, expected) in [
        (4, "PCR 4 missing"),
        (9, "PCR 9 missing"),
        (11, "PCR 11 missing"),
        (12, "PCR 12 missing"),
    ] {
        let rest: Vec<u32> = [4, 9, 11, 12, 15]
            .into_iter()
            .filter(|&p| p != missing)
            .collect();
        cases.push(("a required PCR missing", file(&enforced(&rest)), expected));
    }
    // Good measurements, but signed while the node's config names no
    // measurements signing key: refused like bad measurements.
    let mut requests: Vec<(&str, InitRequest, &str)> = cases
        .into_iter()
        .map(|(case, measurements, expected)| {
            let request = InitRequest {
                join_measurements: measurements,
                ..InitRequest::default()
            };
            (case, request, expected)
        })
        .collect();
    // Good measurements, but network settings the kubeadm configuration
    // would refuse after the lock.
    for (case, service_cidr, sans, expected) in [
        (
            "a service CIDR without a prefix",
            "10.96.0.0",
            vec![],
            "CIDR",
        ),
        (
            "a service CIDR with a bad prefix",
            "10.96.0.0/33",
            vec![],
            "CIDR",
        ),
        (
            "a certificate name that is neither a DNS name nor an address",
            "",
            vec!["not a name".to_owned()],
            "not a name",
        ),
    ] {
        requests.push((
            case,
            InitRequest {
                join_measurements: file(&enforced(&[4, 9, 11, 12, 15])),
                service_cidr: service_cidr.to_owned(),
                api_server_cert_sans: sans,
                ..InitRequest::default()
            },
            expected,
        ));
    }
    requests.push((
        "a signature without a key in the config",
        InitRequest {
            join_measurements: file(&enforced(&[4, 9, 11, 12, 15])),
            join_measurements_signature: vec![0x30, 0x06, 0x02, 0x01, 0x01, 0x02, 0x01, 0x01],
            ..InitRequest::default()
        },
        "the node config names no measurements signing key",
    ));
    // The operator's own components, installed where no later upgrade
    // could switch them: the cluster would be stuck on them.
    let component = |install_path: &str, extract: bool| keel_proto::components::Component {
        url: "http://127.0.0.1:1/tool".into(),
        hash: format!("sha256:{}", "a".repeat(64)),
        install_path: install_path.into(),
        extract,
    };
    for (case, components, expected) in [
        (
            "a component outside the component directories",
            vec![component("/etc/kubernetes/tool", false)],
            "/etc/kubernetes is not /run/state/bin",
        ),
        (
            "component directories that nest",
            vec![
                component("/opt/cni/bin", true),
                component("/opt/cni/bin/extra/tool", false),
            ],
            "/opt/cni/bin and /opt/cni/bin/extra nest",
        ),
        (
            "two archives for one directory",
            vec![
                component("/opt/cni/bin", true),
                keel_proto::components::Component {
                    hash: format!("sha256:{}", "b".repeat(64)),
                    ..component("/opt/cni/bin", true)
                },
            ],
            "more than one archive in the list extracts into /opt/cni/bin",
        ),
    ] {
        requests.push((
            case,
            InitRequest {
                join_measurements: file(&enforced(&[4, 9, 11, 12, 15])),
                kubernetes_components: Some(keel_proto::components::Components { components }),
                ..InitRequest::default()
            },
            expected,
        ));
    }
    for (case, request, expected) in requests {
        let request = complete(&sealed, request);
        refused_before_the_lock(
            &init,
            &node,
            request,
            case,
            (tonic::Code::InvalidArgument, expected),
        )
        .await;
        let pcr15 = node
            .tpm
            .lock()
            .unwrap()
            .tpm()
            .pcr_read(&[pcr::CLUSTER_ID])
            .unwrap()[&pcr::CLUSTER_ID];
        assert_eq!(pcr15, [0; 32], "{case}");
    }
    // Cluster names kubeadm refuses, which it would say only after the lock.
    for name in ["prod-", "-prod", "-"] {
        let request = InitRequest {
            cluster_name: name.into(),
            ..complete(
                &sealed,
                InitRequest {
                    join_measurements: file_of_enforced(),
                    ..InitRequest::default()
                },
            )
        };
        let expected = (tonic::Code::InvalidArgument, "cluster name");
        refused_before_the_lock(&init, &node, request, name, expected).await;
    }
}

/// Attacker's move: someone who can change the operator's components file
/// (or who holds the init secret) initialises the cluster with binaries of
/// their choosing. Where the node's measured config names a measurements
/// signing key, the operator's own components count only with their
/// components file signed by that key, and exactly as it lists them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_signing_key_an_init_takes_only_signed_components() {
    let ca = EkCa::new().unwrap();
    let key = keel_verifier::signature::SigningPrivateKey::generate();
    // The CA's certificates exist once it manufactured a TPM.
    let swtpm = keel_testkit::swtpm::Swtpm::start(&ca).unwrap();
    let mut config = join_common::config(&ca, free_port(), "checked-0", "control-plane");
    config.cluster.measurements_signing_key = Some(key.public_key().to_pem().unwrap());
    let node = join_common::joiner_with(config, swtpm);
    let init = node.init_server(SECRET, false);
    let sealed = sealed_secrets(&node);
    let listed = vec![keel_proto::components::Component {
        url: "http://127.0.0.1:1/kubelet".into(),
        hash: format!("sha256:{H}"),
        install_path: "/run/state/bin/kubelet".into(),
        extract: false,
    }];
    let file = |hash: &str| {
        format!(
            r#"[{{"url":"http://127.0.0.1:1/kubelet","hash":"sha256:{hash}","install_path":"/run/state/bin/kubelet"}}]"#
        )
        .into_bytes()
    };
    let other = "1".repeat(64);
    let other_key = keel_verifier::signature::SigningPrivateKey::generate();
    let for_version = |version: &str, file: &[u8]| {
        keel_installer::components_file::signed_message(
            keel_installer::resolve(version).unwrap().version(),
            file,
        )
    };
    for (case, components_file, components_signature, expected) in [
        (
            "unsigned",
            Vec::new(),
            Vec::new(),
            "only with their components file signed",
        ),
        (
            "signed by another key",
            file(H),
            other_key.sign(&for_version("v1.31", &file(H))),
            "does not verify",
        ),
        (
            "signed as another version's file",
            file(H),
            key.sign(&for_version("v1.32", &file(H))),
            "does not verify",
        ),
        (
            "a signed file of other components",
            file(&other),
            key.sign(&for_version("v1.31", &file(&other))),
            "not the ones its signed components file lists",
        ),
        // Signed right: the request passes this check and is refused by
        // the next, the join measurements' signature (left out here).
        (
            "signed right",
            file(H),
            key.sign(&for_version("v1.31", &file(H))),
            "the join measurements are not signed",
        ),
    ] {
        let request = complete(
            &sealed,
            InitRequest {
                kubernetes_components: Some(keel_proto::components::Components {
                    components: listed.clone(),
                }),
                components_file,
                components_signature,
                join_measurements: file_of_enforced(),
                ..InitRequest::default()
            },
        );
        refused_before_the_lock(
            &init,
            &node,
            request,
            case,
            (tonic::Code::PermissionDenied, expected),
        )
        .await;
    }
}

/// Attacker's move: make the node unsure whether its state disk holds a
/// cluster (a header that cannot be read, a device that is gone) so that
/// init formats it. A disk that carries a LUKS header refuses init (a
/// member's, or a set-up that never finished, each with its own remedy);
/// one whose header cannot be read refuses it too, and the node stays
/// unlocked with the disk as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_never_formats_a_disk_it_cannot_read_or_that_holds_a_cluster() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "disk-0", "control-plane");
    let init = node.init_server(SECRET, true);
    let sealed = sealed_secrets(&node);
    let request = || {
        complete(
            &sealed,
            InitRequest {
                join_measurements: file_of_enforced(),
                ..InitRequest::default()
            },
        )
    };

    // A set-up that never finished (a format labels the header as being
    // provisioned) and that the start could not reset: init leaves it
    // alone and says that a reboot resets it.
    let cryptsetup = keel_agent::disk::Cryptsetup::default();
    cryptsetup.format(&node.disk, &[9; 32]).unwrap();
    assert_eq!(
        cryptsetup.label(&node.disk).unwrap(),
        keel_agent::disk::PROVISIONING_LABEL
    );
    refused_leaving_the_disk(&init, &node, request(), "never finished", &["reboot"]).await;

    // A member's disk: it rejoins or is recovered.
    cryptsetup
        .relabel(&node.disk, keel_agent::disk::PROVISIONED_LABEL)
        .unwrap();
    refused_leaving_the_disk(&init, &node, request(), "initialised", &["rejoins"]).await;

    // Both copies of the member's header damaged (cryptsetup no longer
    // calls it LUKS): a damaged header, not an empty disk.
    join_common::damage_luks_headers(&node.disk);
    refused_leaving_the_disk(&init, &node, request(), "damaged LUKS header", &[]).await;

    // A LUKS1 header (no label; keel writes LUKS2 only): someone's data,
    // and no retry changes that.
    join_common::format_luks1(&node.disk);
    refused_leaving_the_disk(&init, &node, request(), "keel cannot use", &[]).await;

    // The device is gone: whether it holds a cluster cannot be told.
    std::fs::remove_file(&node.disk).unwrap();
    let status = init.init(tonic::Request::new(request())).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("state disk"), "{status:?}");
    assert!(!node.lock.is_locked());
    assert!(!node.disk.exists(), "something wrote the missing disk");

    // A fresh disk: the init runs to the end, and only then does the
    // disk's header say its set-up finished.
    join_common::fresh_disk(&node.disk);
    let mirror = keel_testkit::mirror::MirrorServer::start().unwrap();
    let components = join_common::stand_in_components(&mirror)
        .into_iter()
        .map(Into::into)
        .collect();
    let stream = init
        .init(tonic::Request::new(InitRequest {
            kubernetes_components: Some(keel_proto::components::Components { components }),
            ..request()
        }))
        .await
        .unwrap();
    assert!(join_common::init_succeeds(stream).await);
    assert!(node.lock.is_locked());
    assert_eq!(
        cryptsetup.label(&node.disk).unwrap(),
        keel_agent::disk::PROVISIONED_LABEL
    );
}

/// Attacker's move: an attested node of the cluster's image, before its
/// lock, asks the first control plane for a join ticket naming that
/// control plane's own state disk (its UUID is in the clear in the LUKS
/// header), to bind the disk there to its own TPM: that control plane
/// would then refuse the disk's owner its rejoin and its evidence. The
/// init node's disk is bound to its own EK, and its own record names the
/// disk, once its join service serves; the claim is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_init_nodes_disk_is_bound_and_recorded_as_its_own() {
    use keel_agent::cluster::ClusterSlot;
    use std::sync::Arc;

    let ca = EkCa::new().unwrap();
    let port = free_port();
    let node = joiner(&ca, &ca, port, "cp-0", "control-plane");
    let slot = Arc::new(ClusterSlot::new(None));
    let mut accepting = node.node(slot.clone());
    accepting.config.cluster.init_secret_hash = keel_verifier::init_secret::hash(SECRET).unwrap();
    let init = InitServer::new(accepting);
    let mirror = keel_testkit::mirror::MirrorServer::start().unwrap();
    let components = join_common::stand_in_components(&mirror)
        .into_iter()
        .map(Into::into)
        .collect();
    let request = complete(
        &sealed_secrets(&node),
        InitRequest {
            join_measurements: join_common::boot_measurements(&node.config)
                .to_json()
                .into_bytes(),
            kubernetes_components: Some(keel_proto::components::Components { components }),
            ..InitRequest::default()
        },
    );
    let stream = init.init(tonic::Request::new(request)).await.unwrap();
    assert!(join_common::init_succeeds(stream).await);
    let serving = node.serve_join(port, slot).await;

    let own_ek = join_common::ek_digest(&node.tpm);
    let disk = keel_agent::disk::Cryptsetup::default()
        .uuid(&node.disk)
        .unwrap();
    let bindings = keel_agent::disk_bindings::DiskBindings::new(&node.root);
    assert_eq!(bindings.lookup(&disk).unwrap(), Some(own_ek));
    let registry = keel_agent::registry::RegistryStore::shared(&node.root).unwrap();
    let own = registry.snapshot().nodes()[&own_ek.to_string()].clone();
    assert_eq!(
        (own.name.as_str(), own.disk_uuid.as_str()),
        ("cp-0", disk.as_str())
    );

    let claimer = join_common::member_with(&ca, join_common::config(&ca, port, "w-9", "worker"));
    let key = keel_agent::join::KubeletKey::generate("w-9").unwrap();
    let claim = keel_proto::join::IssueJoinTicketRequest {
        disk_uuid: disk.clone(),
        kubelet_csr: key.csr_pem().as_bytes().to_vec(),
        is_control_plane: false,
        node_name: "w-9".into(),
        file_discovery: true,
    };
    match claimer
        .tickets(&ca)
        .request_join_ticket(&format!("127.0.0.1:{port}"), claim)
        .await
    {
        Err(keel_agent::join::TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
            assert!(
                status.message().contains("not bound to this node's TPM"),
                "{status:?}"
            );
        }
        Err(e) => panic!("not refused for the disk: {}", keel_atls::ErrorChain(&e)),
        Ok(_) => panic!("a ticket bound the init node's disk to another TPM"),
    }
    assert_eq!(bindings.lookup(&disk).unwrap(), Some(own_ek));
    serving.abort();
    let _ = serving.await;
}

fn file_of_enforced() -> Vec<u8> {
    file(&enforced(&[4, 9, 11, 12, 15]))
}

/// Sends `request` to `init` and checks that it is refused with the
/// expected code, saying the expected text, with `node` left unlocked;
/// returns the refusal.
async fn refused_before_the_lock(
    init: &keel_agent::init::InitServer,
    node: &join_common::Joiner,
    request: InitRequest,
    case: &str,
    (code, expected): (tonic::Code, &str),
) -> tonic::Status {
    let status = init
        .init(tonic::Request::new(request))
        .await
        .err()
        .unwrap_or_else(|| panic!("{case}: accepted"));
    assert_eq!(status.code(), code, "{case}: {status:?}");
    assert!(status.message().contains(expected), "{case}: {status:?}");
    assert!(!node.lock.is_locked(), "{case}: the node got locked");
    status
}

/// [`refused_before_the_lock`] with `FailedPrecondition`, saying `text`
/// and each of `more`, and `node`'s state disk byte for byte as it was.
async fn refused_leaving_the_disk(
    init: &keel_agent::init::InitServer,
    node: &join_common::Joiner,
    request: InitRequest,
    text: &str,
    more: &[&str],
) {
    let before = std::fs::read(&node.disk).unwrap();
    let code = tonic::Code::FailedPrecondition;
    let status = refused_before_the_lock(init, node, request, text, (code, text)).await;
    for text in more {
        assert!(status.message().contains(text), "{text}: {status:?}");
    }
    assert!(
        std::fs::read(&node.disk).unwrap() == before,
        "{text}: disk changed"
    );
}

/// The right init secret and a master secret, sealed to `node`'s TPM.
fn sealed_secrets(node: &join_common::Joiner) -> keel_proto::attestation::SealedSecret {
    node.sealed(
        &InitSecrets {
            init_secret: SECRET.to_vec(),
            master_secret: vec![7; 32],
        }
        .encode_to_vec(),
    )
}

/// `request` with the fields every case shares: the sealed secrets, salts,
/// a supported version and a valid cluster name.
fn complete(sealed: &keel_proto::attestation::SealedSecret, request: InitRequest) -> InitRequest {
    InitRequest {
        secrets: Some(sealed.clone()),
        master_salt: vec![1; 32],
        measurement_salt: vec![2; 32],
        kubernetes_version: "v1.31".into(),
        cluster_name: "checked".into(),
        ..request
    }
}

/// A worker takes no init, even with the right init secret (which every
/// node's config carries): its agent would hold the master secret and run
/// no join service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_takes_no_init() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "worker-0", "worker");
    let init = node.init_server(SECRET, false);
    let request = complete(
        &sealed_secrets(&node),
        InitRequest {
            join_measurements: file_of_enforced(),
            ..Default::default()
        },
    );
    refused_leaving_the_disk(&init, &node, request, "this node is a worker", &[]).await;
}

/// A control plane whose config has no EK CA (accepted at load: such a
/// node attests no peer) could never run its join service or check any
/// member's evidence once initialised: init is refused before the lock,
/// saying why, instead of leaving a locked node that retries those
/// services forever and a disk only a wipe makes initialisable again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_whose_config_cannot_run_a_control_plane_is_refused_before_the_lock() {
    let ca = EkCa::new().unwrap();
    // The CA's certificates exist once it manufactured a TPM.
    let swtpm = keel_testkit::swtpm::Swtpm::start(&ca).unwrap();
    let mut config = join_common::config(&ca, free_port(), "cp-0", "control-plane");
    config.cluster.ek_ca_pem = String::new();
    let node = join_common::joiner_with(config, swtpm);
    let init = node.init_server(SECRET, true);
    let request = complete(
        &sealed_secrets(&node),
        InitRequest {
            join_measurements: file_of_enforced(),
            ..Default::default()
        },
    );
    refused_leaving_the_disk(
        &init,
        &node,
        request,
        "cannot run a cluster's control plane",
        &["no EK CA configured"],
    )
    .await;
}

/// Race: a join locks the node and starts formatting its state disk while
/// init is inspecting that disk. The disk then shows a set-up that never
/// finished, and init must not answer from it ("reboot the node to reset
/// it" would have the operator reboot a node in the middle of its join):
/// the lock, checked again after the inspection, makes the answer that the
/// node is taken, and init leaves the disk as the join left it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_locking_during_inits_disk_inspection_wins_the_answer() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "inspected-0", "control-plane");
    let dir = tempfile::tempdir().unwrap();
    let held = HeldInspection::start(&node, dir.path()).await;
    let (answer, go) = (held.answer, held.go);
    // The join: the lock, then the format that labels the header as being
    // provisioned.
    node.lock.try_lock([5; 32]).unwrap();
    let cryptsetup = keel_agent::disk::Cryptsetup::default();
    cryptsetup.format(&node.disk, &[9; 32]).unwrap();
    let formatted = std::fs::read(&node.disk).unwrap();
    std::fs::write(&go, b"").unwrap();

    let status = answer.await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains("already part of a cluster"),
        "{status:?}"
    );
    assert!(
        std::fs::read(&node.disk).unwrap() == formatted,
        "init changed the disk"
    );
    assert_eq!(
        cryptsetup.label(&node.disk).unwrap(),
        keel_agent::disk::PROVISIONING_LABEL
    );
}

/// Race: the caller goes away (the host resets the connection, the
/// operator presses Ctrl-C, the request timeout fires) while the node lock
/// is being taken. The lock is a blocking task of its own and lands all the
/// same; what follows it must too, or the node sits locked into a cluster
/// with nothing set up and no reboot to come, refusing init and joins. Here
/// the TPM is held so that the lock waits, the caller is dropped, and the
/// node goes on to set its state disk up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_gone_while_the_lock_is_taken_leaves_the_node_provisioning() {
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "dropped-0", "control-plane");
    let dir = tempfile::tempdir().unwrap();
    let held = HeldInspection::start(&node, dir.path()).await;
    let (answer, go) = (held.answer, held.go);
    let unkept = held.work_dir.join(keel_agent::resume::UNKEPT);
    // The TPM, held, so that the lock waits for it.
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let tpm = node.tpm.clone();
    let holder = std::thread::spawn(move || {
        let _tpm = tpm.lock().unwrap();
        held_tx.send(()).unwrap();
        let _ = release_rx.recv();
    });
    held_rx.recv().unwrap();
    std::fs::write(&go, b"").unwrap();
    until("init never began to take the lock", || unkept.exists()).await;
    answer.abort();
    assert!(answer.await.unwrap_err().is_cancelled());
    release_tx.send(()).unwrap();
    holder.join().unwrap();
    // The lock landed, and the node goes on: its disk is set up (and, should
    // provisioning fail later, reset with a reboot to come).
    let disk = node.disk.clone();
    until("the node was locked and nothing followed", || {
        std::fs::read(&disk).is_ok_and(|d| d.starts_with(b"LUKS\xba\xbe"))
    })
    .await;
    assert!(node.lock.is_locked());
}

/// A format that fails (the device in use, or not the disk the operator
/// meant) leaves the device as it was: the failure after the lock resets
/// only a disk this boot formatted, and this one it did not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_disk_whose_format_failed_is_not_reset() {
    use keel_agent::provision::{DiskStep, Plan, ProvisionError, Provisioner};
    use std::os::unix::fs::PermissionsExt as _;
    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "format-0", "worker");
    let dir = tempfile::tempdir().unwrap();
    // The device holds something that is not keel's (here: bytes that
    // look like nothing in particular).
    std::fs::write(&node.disk, vec![0x5a; 4 << 20]).unwrap();
    let before = std::fs::read(&node.disk).unwrap();
    let script = |name: &str, body: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    };
    let wiped = dir.path().join("wiped");
    let cryptsetup = script(
        "busy-cryptsetup",
        "for a; do [ \"$a\" = luksFormat ] && { echo 'Device in use' >&2; exit 5; }; done\n\
         exec cryptsetup \"$@\"",
    );
    let wipefs = script("wipefs", &format!("touch {}", wiped.display()));
    let mut env = node.env();
    env.state_disk.as_mut().unwrap().cryptsetup =
        keel_agent::disk::Cryptsetup::new(&cryptsetup, &wipefs);
    let lines = std::sync::Mutex::new(Vec::new());
    let log = |line: String| lines.lock().unwrap().push(line);
    let p = Provisioner::new(&env, &node.tpm, &log);
    let failed = p
        .prepare(Plan {
            disk: DiskStep::SetUp {
                uuid: join_common::uuid(),
                key: zeroize::Zeroizing::new(vec![7; 32]),
            },
            files: Vec::new(),
            components: None,
        })
        .await
        .unwrap_err();
    assert!(matches!(failed, ProvisionError::Disk(_)), "{failed:?}");
    p.fail(&failed).await;
    assert!(
        !wiped.exists(),
        "wipefs ran on a disk this boot never formatted"
    );
    assert!(
        std::fs::read(&node.disk).unwrap() == before,
        "the device changed"
    );
}

/// Waits (polling every 2 ms, up to 60 s) until `done`; fails naming `what`.
async fn until(what: &str, done: impl Fn() -> bool) {
    let started = std::time::Instant::now();
    while !done() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "{what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// An init of a control plane with the right secret, under way and held at
/// its look at the state disk (`cryptsetup isLuks`, its last step before
/// the lock) until `go` exists.
struct HeldInspection {
    answer: tokio::task::JoinHandle<
        Result<tonic::Response<<InitServer as InitService>::InitStream>, tonic::Status>,
    >,
    go: std::path::PathBuf,
    work_dir: std::path::PathBuf,
}

impl HeldInspection {
    async fn start(node: &join_common::Joiner, dir: &std::path::Path) -> Self {
        use std::os::unix::fs::PermissionsExt as _;
        let (inspecting, go) = (dir.join("inspecting"), dir.join("go"));
        let wrapper = dir.join("slow-cryptsetup");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nif [ \"$1\" = isLuks ] && [ ! -e {go} ]; then\n  touch {inspecting}\n  \
                 while [ ! -e {go} ]; do sleep 0.01; done\nfi\nexec cryptsetup \"$@\"\n",
                go = go.display(),
                inspecting = inspecting.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut env = node.env();
        env.state_disk.as_mut().unwrap().cryptsetup =
            keel_agent::disk::Cryptsetup::new(&wrapper, "wipefs");
        let work_dir = env.work_dir.clone();
        let init = node.init_server_in(SECRET, env);
        let request = complete(
            &sealed_secrets(node),
            InitRequest {
                join_measurements: file_of_enforced(),
                ..InitRequest::default()
            },
        );
        let answer = tokio::spawn(async move { init.init(tonic::Request::new(request)).await });
        until("init never inspected the disk", || inspecting.exists()).await;
        Self {
            answer,
            go,
            work_dir,
        }
    }
}

/// A lock that cannot be recorded (the event log cannot be written, so
/// PCR 15 is never extended) refuses the init and leaves the node unlocked,
/// and the node's journal says why: an operator sees the node's console,
/// not its files.
#[tokio::test(flavor = "current_thread")]
async fn an_init_whose_lock_cannot_be_recorded_says_why() {
    use keel_agent::cluster::ClusterSlot;
    use std::sync::Arc;

    let ca = EkCa::new().unwrap();
    let node = joiner(&ca, &ca, free_port(), "cp-0", "control-plane");
    let mut accepting = node.node(Arc::new(ClusterSlot::new(None)));
    accepting.config.cluster.init_secret_hash = keel_verifier::init_secret::hash(SECRET).unwrap();
    let init = InitServer::new(accepting);
    let request = complete(
        &sealed_secrets(&node),
        InitRequest {
            join_measurements: file_of_enforced(),
            ..InitRequest::default()
        },
    );
    node.make_event_log_unwritable();

    let (captured, _default) = keel_testkit::logs::Captured::debug_log();
    let status = refused_before_the_lock(
        &init,
        &node,
        request,
        "event log unwritable",
        (tonic::Code::Unavailable, "taking the node lock failed"),
    )
    .await;
    let journal = captured.text();
    assert!(
        journal.contains("init refused") && journal.contains("Is a directory"),
        "{status:?}\n{journal}"
    );
}
