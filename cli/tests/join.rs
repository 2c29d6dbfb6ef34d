//! `keel init` of node 1, then a worker and a control-plane node join and
//! the worker rejoins after a reboot. Each node has its own swtpm (EK
//! certificates from one test CA), root directory and LUKS2 state-disk
//! image; components come from the loopback mirror (kubeadm is the
//! stand-in); every connection is real aTLS on loopback.
//!
//! The rejoin checks the disk key with `cryptsetup open --test-passphrase`;
//! opening the disk needs device-mapper, which the host lacks, so these
//! state disks have no mount (`StateDisk::mount`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;
#[path = "../../agent/tests/join_common/mod.rs"]
mod join_common;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::sync::Arc;
use std::time::Duration;

use harness::{events, run_keel, text, Settings, SECRET};
use join_common::{
    boot_measurements, boot_measurements_with, joiner_with, node_env, stand_in_components, Joiner,
};
use keel_agent::cluster::ClusterSlot;
use keel_agent::disk::Cryptsetup;
use keel_agent::join::JoinOutcome;
use keel_agent::join::JoinService;
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::measurement::EventType;
use keel_verifier::measurements::Expected;

fn mode(path: &std::path::Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_cli_init_a_worker_and_a_control_plane_join_and_the_worker_rejoins() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let join_port = join_common::free_port();

    // Node 1: the init server, as the agent runs it.
    let swtpm1 = Swtpm::start(&ca).unwrap();
    let dir1 = tempfile::tempdir().unwrap();
    let root1 = dir1.path().join("root");
    let mut config1 = join_common::config(&ca, join_port, "cp-0", "control-plane");
    config1.cluster.init_secret_hash = harness::secret_hash();
    // The key that signs every image's measurements, in the measured
    // cluster config as the settings name it.
    let signing = keel_verifier::signature::SigningPrivateKey::generate();
    config1.cluster.measurements_signing_key = Some(signing.public_key().to_pem().unwrap());
    let cluster_config = config1.cluster.clone();
    let tpm1 = join_common::measured(&swtpm1, &dir1.path().join("log"), &config1);
    let lock1 = Arc::new(keel_agent::nodelock::NodeLock::new(tpm1.clone()).unwrap());
    let components = stand_in_components(&mirror);
    let env1 = node_env(&root1, dir1.path(), None);
    let slot = Arc::new(ClusterSlot::new(None));
    let init_addr: SocketAddr = format!("127.0.0.1:{}", join_common::free_port())
        .parse()
        .unwrap();
    let init_task = tokio::spawn({
        let (config, tpm, env, slot) = (config1.clone(), tpm1.clone(), env1.clone(), slot.clone());
        async move {
            let node = keel_agent::provision::Node {
                config,
                tpm,
                lock: lock1,
                env,
                cluster: slot,
                operator_key: Default::default(),
            };
            let _ = keel_agent::node::serve_init(init_addr, node).await;
        }
    });
    join_common::wait_for_port(init_addr).await;

    // `keel init` against it, from the operator's own directory.
    let operator = tempfile::tempdir().unwrap();
    let components: Vec<keel_proto::components::Component> =
        components.iter().map(Into::into).collect();
    let settings = Settings {
        endpoint: init_addr,
        measurements: &boot_measurements_with(&config1, [(15, Expected::enforced([0; 32]))]),
        ek_ca: &ca,
        init_secret: SECRET,
        components: Some(&components),
    }
    .write(operator.path());
    // The settings name the config's signing key; the node's config
    // names one, so `keel init` needs the measurements signed: refused,
    // with nothing sent, until they are.
    std::fs::write(
        operator.path().join("signing.pub.pem"),
        signing.public_key().to_pem().unwrap(),
    )
    .unwrap();
    let mut with_key: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&settings).unwrap()).unwrap();
    with_key["measurements_signing_key"] = "signing.pub.pem".into();
    std::fs::write(&settings, with_key.to_string()).unwrap();
    let measurements_file = operator.path().join("measurements.json");
    let signature_file = operator.path().join("measurements.json.sig");
    // The first image's file carries rollback epoch 1: the control plane
    // takes no file below it from then on (every file below is at 1).
    let first = keel_verifier::measurements::Measurements::parse(
        &std::fs::read(&measurements_file).unwrap(),
    )
    .unwrap();
    std::fs::write(&measurements_file, first.to_json_with_epoch(1)).unwrap();
    // `keel init` in a fresh workspace, refused for `why` (each text must be
    // in its output) before anything reached the node.
    let refused_init = |why: &'static [&'static str]| {
        let settings = settings.clone();
        let slot = slot.clone();
        async move {
            let ws = tempfile::tempdir().unwrap();
            let out = run_keel(&["init", "--skip-helm-wait"], &settings, Some(ws.path())).await;
            assert!(!out.status.success());
            for text_part in why {
                assert!(text(&out).contains(text_part), "{}", text(&out));
            }
            assert!(slot.borrow().is_none(), "a refused init reached the node");
        }
    };
    refused_init(&["needs its signature"]).await;
    let other = keel_verifier::signature::SigningPrivateKey::generate();
    std::fs::write(
        &signature_file,
        other.sign(&std::fs::read(&measurements_file).unwrap()),
    )
    .unwrap();
    refused_init(&["is not signed with the measurements signing key"]).await;
    std::fs::write(
        &signature_file,
        signing.sign(&std::fs::read(&measurements_file).unwrap()),
    )
    .unwrap();
    // The settings name the operator's own components: with a signing key,
    // the node takes them only with their file signed too.
    refused_init(&["no signature for", "components.json"]).await;
    // Signed as the file for another version: refused as well.
    let components_file = operator.path().join("components.json");
    let components_for = |version: &str| {
        keel_installer::components_file::signed_message(
            keel_installer::resolve(version).unwrap().version(),
            &std::fs::read(&components_file).unwrap(),
        )
    };
    let components_signature = operator.path().join("components.json.sig");
    std::fs::write(
        &components_signature,
        signing.sign(&components_for("v1.32")),
    )
    .unwrap();
    refused_init(&["is not a signature of", "for Kubernetes v1.31"]).await;
    std::fs::write(
        &components_signature,
        signing.sign(&components_for("v1.31")),
    )
    .unwrap();
    let ws = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let out = run_keel(&["init", "--skip-helm-wait"], &settings, Some(ws.path())).await;
    assert!(out.status.success(), "{}", text(&out));
    eprintln!("keel init took {:?}", started.elapsed());
    let state = slot
        .borrow()
        .clone()
        .expect("init published no cluster state");
    assert_eq!(state.measurements_key, Some(signing.public_key()));
    assert_eq!(
        state.signed_measurements.len(),
        1,
        "the init measurements, signed"
    );
    assert_eq!(
        state.signed_measurements[0].body(),
        std::fs::read(&measurements_file).unwrap().as_slice()
    );
    assert_eq!(state.image_epoch, 1, "init takes the first image's epoch");
    init_task.abort();

    // Node 1 serves the join service, its file written from the cluster
    // state as a control plane's is: the measurements init validated it by.
    let d = dir1.path();
    let measurements = d.join("measurements.json");
    std::fs::write(&measurements, state.join_measurements.to_json()).unwrap();
    let policy = keel_agent::node::join_service_policy(&config1, &measurements).unwrap();
    let service = JoinService::new(
        state.clone(),
        env1.kubeadm.clone(),
        d.join("work"),
        Arc::new(keel_agent::disk_bindings::DiskBindings::new(env1.root())),
        keel_agent::cluster::own_image(&tpm1).await.unwrap(),
    )
    .unwrap();
    let join_addr: SocketAddr = format!("127.0.0.1:{join_port}").parse().unwrap();
    let join_task = tokio::spawn({
        let tpm = tpm1.clone();
        async move {
            keel_agent::node::serve_join(join_addr, tpm, policy, service)
                .await
                .unwrap();
        }
    });
    join_common::wait_for_port(join_addr).await;

    // Nodes 2 (worker) and 3 (control plane) join at the same time.
    let member = |name: &str, role: &str| {
        let mut config = join_common::config(&ca, join_port, name, role);
        config.cluster = cluster_config.clone();
        joiner_with(config, Swtpm::start(&ca).unwrap())
    };
    let worker = member("w-1", "worker");
    let control = member("cp-1", "control-plane");
    let (a, b) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(90), worker.client(&ca).run()),
        tokio::time::timeout(Duration::from_secs(90), control.client(&ca).run()),
    );
    eprintln!("joins took {:?}", started.elapsed());
    for outcome in [a.unwrap(), b.unwrap()] {
        match outcome {
            JoinOutcome::Joined { cluster_id } => assert_eq!(cluster_id, state.cluster_id),
            other => panic!("{other:?}"),
        }
    }
    let pcr15 = join_common::pcr15(&tpm1);
    assert_ne!(pcr15, [0; 32]);
    assert_eq!(worker.pcr15(), pcr15);
    assert_eq!(control.pcr15(), pcr15);

    // Disk keys: one per disk UUID, the key service's.
    let cs = Cryptsetup::default();
    let key_of = |j: &Joiner| {
        let uuid = cs.uuid(&j.disk).unwrap();
        let key = state
            .keys
            .disk_key(&uuid, &join_common::ek_digest(&j.tpm))
            .unwrap();
        assert!(cs.key_matches(&j.disk, &key).unwrap(), "{uuid}");
        key
    };
    assert_ne!(key_of(&worker).as_slice(), key_of(&control).as_slice());

    // Files: 0600; control-plane PKI only on the control plane.
    for j in [&worker, &control] {
        let pki = j.root.join("var/lib/kubelet/pki");
        for f in ["kubelet-client.crt", "kubelet-client.key", "ca.crt"] {
            assert_eq!(mode(&pki.join(f)), 0o600, "{f}");
        }
        assert_eq!(
            std::fs::read(pki.join("ca.crt")).unwrap(),
            std::fs::read(state.pki_dir.join("ca.crt")).unwrap()
        );
        assert!(j.root.join("etc/kubernetes/kubelet.conf").is_file());
        assert_eq!(events(&j.tpm, EventType::Component).len(), 5);
    }
    assert!(!worker.root.join("etc/kubernetes/pki/ca.key").exists());
    let ca_key = control.root.join("etc/kubernetes/pki/ca.key");
    assert_eq!(mode(&ca_key), 0o600);
    assert_eq!(
        std::fs::read(&ca_key).unwrap(),
        std::fs::read(state.pki_dir.join("ca.key")).unwrap()
    );

    // The joins used kubeadm's file discovery, with their own kubelet
    // certificates: no join registered a bootstrap token with the cluster
    // (node 1's kubeadm ran no `token create`).
    assert!(!root1.join("var/lib/keel-standin/tokens").exists());
    for j in [&control, &worker] {
        let with = std::fs::read_to_string(j.root.join("var/lib/keel-standin/joined-with"));
        assert_eq!(with.unwrap(), "file\n");
        // The join's configuration and its discovery kubeconfig, which
        // holds the kubelet's key, are gone once the join ended.
        assert!(!j.work.join("kubeadm-join.yaml").exists());
        assert!(!j.work.join("kubeadm-discovery.conf").exists());
    }

    // Node 2 reboots: PCRs are zero again, the disk is initialised, so it
    // asks for a rejoin ticket and locks into the same cluster.
    let Joiner {
        config, dir, disk, ..
    } = worker;
    let rebooted = join_common::reboot(config, &ca, dir, disk);
    assert_eq!(rebooted.pcr15(), [0; 32]);
    let outcome = tokio::time::timeout(Duration::from_secs(60), rebooted.client(&ca).run())
        .await
        .unwrap();
    match outcome {
        JoinOutcome::Rejoined { cluster_id } => assert_eq!(cluster_id, state.cluster_id),
        other => panic!("{other:?}"),
    }
    assert_eq!(rebooted.pcr15(), pcr15);
    // Still no token: a rejoin does not run kubeadm.
    assert!(!root1.join("var/lib/keel-standin/tokens").exists());

    // The operator rolls new measurements out to node 1: its operator API
    // takes them only with the proof the workspace's master secret makes.
    let operator_addr: SocketAddr = format!("127.0.0.1:{}", join_common::free_port())
        .parse()
        .unwrap();
    let join_measurements = d.join("join-measurements.json");
    std::fs::write(&join_measurements, boot_measurements(&config1).to_json()).unwrap();
    let operator_task = tokio::spawn({
        let (config, tpm, env, slot, path) = (
            config1.clone(),
            tpm1.clone(),
            env1.clone(),
            slot.clone(),
            join_measurements.clone(),
        );
        async move {
            let lock = Arc::new(keel_agent::nodelock::NodeLock::new(tpm.clone()).unwrap());
            let node = keel_agent::provision::Node {
                config,
                tpm,
                lock,
                env,
                cluster: slot,
                operator_key: Default::default(),
            };
            let _ = keel_agent::node::serve_operator_port(
                tokio::net::TcpListener::bind(operator_addr).await.unwrap(),
                node,
                Some(path),
            )
            .await;
        }
    });
    join_common::wait_for_port(operator_addr).await;
    let new = boot_measurements_with(&config1, [(13, Expected::warn_only([7; 32]))]);
    let new_file = operator.path().join("new-measurements.json");
    std::fs::write(&new_file, new.to_json_with_epoch(1)).unwrap();
    let push_with = |workspace: std::path::PathBuf, settings: std::path::PathBuf| {
        let new_file = new_file.clone();
        let endpoint = operator_addr.to_string();
        async move {
            run_keel(
                &[
                    "push-measurements",
                    "--workspace",
                    workspace.to_str().unwrap(),
                    "--file",
                    new_file.to_str().unwrap(),
                    "--endpoint",
                    &endpoint,
                ],
                &settings,
                None,
            )
            .await
        }
    };
    let push = |workspace: std::path::PathBuf| push_with(workspace, settings.clone());
    // The measurements the node's join service holds now.
    let in_force = || {
        keel_verifier::measurements::Measurements::parse(
            &std::fs::read(&join_measurements).unwrap(),
        )
        .unwrap()
    };
    // The cluster has a measurements signing key: the operator's proof
    // alone replaces nothing. Settings that name no key (so the CLI checks
    // nothing) and no signature beside the file: refused by the node.
    let mut no_key: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&settings).unwrap()).unwrap();
    no_key
        .as_object_mut()
        .unwrap()
        .remove("measurements_signing_key");
    let no_key_settings = operator.path().join("keel-no-key.json");
    std::fs::write(&no_key_settings, no_key.to_string()).unwrap();
    let out = push_with(ws.path().to_owned(), no_key_settings.clone()).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("not signed with the measurements signing key"),
        "{}",
        text(&out)
    );
    // A signature by another key, sent as found beside the file: refused too.
    let new_signature = operator.path().join("new-measurements.json.sig");
    std::fs::write(
        &new_signature,
        keel_verifier::signature::SigningPrivateKey::generate()
            .sign(new.to_json_with_epoch(1).as_bytes()),
    )
    .unwrap();
    let out = push_with(ws.path().to_owned(), no_key_settings).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("not signed with the measurements signing key"),
        "{}",
        text(&out)
    );
    assert_eq!(in_force(), boot_measurements(&config1));
    // Signed with the cluster's key from here on.
    std::fs::write(
        &new_signature,
        signing.sign(new.to_json_with_epoch(1).as_bytes()),
    )
    .unwrap();
    // Another cluster's master secret beside this cluster's ID file: the
    // CLI refuses before it contacts the node, nothing replaced. (A wrong
    // proof reaching the node, and the wait its address then gets, are
    // agent/tests/operator.rs's: the CLI no longer sends one.)
    let forged = tempfile::tempdir().unwrap();
    for name in ["keel-id.json", "keel-master-secret.json"] {
        std::fs::copy(ws.path().join(name), forged.path().join(name)).unwrap();
    }
    let secret_file = forged.path().join("keel-master-secret.json");
    let mut secret: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&secret_file).unwrap()).unwrap();
    secret["key"] = serde_json::Value::String("42".repeat(32));
    std::fs::write(&secret_file, serde_json::to_vec(&secret).unwrap()).unwrap();
    let out = push(forged.path().to_owned()).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("they are not of one cluster"),
        "{}",
        text(&out)
    );
    assert_eq!(in_force(), boot_measurements(&config1));
    // The workspace's own secret: accepted.
    let out = push(ws.path().to_owned()).await;
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(in_force(), new);
    // The push made the workspace's image record, where no rollout had
    // made one: `keel recover` holds its settings to the pushed set.
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ws.path().join("keel-image.json")).unwrap()).unwrap();
    assert_eq!(record["digest"], hex::encode(new.digest()));
    assert_eq!(record["epoch"], 1);

    // An image upgrade through the CLI: the new image's signed measurements
    // are staged next to the current ones, then finish makes them the only
    // ones.
    let signed_file = |name: &str, set: &keel_verifier::measurements::Measurements| {
        let file = operator.path().join(name);
        let body = format!("{}\n", set.to_json_with_epoch(1));
        std::fs::write(&file, &body).unwrap();
        std::fs::write(
            operator.path().join(format!("{name}.sig")),
            signing.sign(body.as_bytes()),
        )
        .unwrap();
        file
    };
    let image = boot_measurements_with(&config1, [(11, Expected::enforced([5; 32]))]);
    let image_file = signed_file("image.json", &image);
    // A second signed image that was never staged.
    let other = boot_measurements_with(&config1, [(11, Expected::enforced([6; 32]))]);
    let other_file = signed_file("other.json", &other);
    let endpoint = operator_addr.to_string();
    let ws_arg = ws.path().to_str().unwrap();
    let out = run_keel(
        &[
            "upgrade",
            "apply",
            "--workspace",
            ws_arg,
            "--image-measurements",
            image_file.to_str().unwrap(),
            "--skip-phases",
            "kubernetes",
            "--endpoint",
            &endpoint,
        ],
        &settings,
        None,
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("{endpoint}: image measurements staged")),
        "{}",
        text(&out)
    );
    let staged_file = keel_agent::attestation::policy::staged_path(&join_measurements);
    let read = |p: &std::path::Path| {
        keel_verifier::measurements::Measurements::parse(&std::fs::read(p).unwrap()).unwrap()
    };
    assert_eq!(read(&staged_file), image);
    assert_eq!(read(&join_measurements), new);
    // Finishing another set than the staged one changes nothing.
    let finish_args = |file: &std::path::Path| {
        [
            "upgrade",
            "finish",
            "--workspace",
            ws_arg,
            "--image-measurements",
            file.to_str().unwrap(),
            "--endpoint",
            &endpoint,
        ]
        .map(str::to_owned)
    };
    let finish_file = |file: std::path::PathBuf| {
        let args = finish_args(&file);
        let settings = &settings;
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run_keel(&args, settings, None).await
        }
    };
    let out = finish_file(other_file.clone()).await;
    assert!(!out.status.success());
    assert!(
        text(&out).contains(&format!(
            "the staged image measurements are sha256:{}, not the sha256:{}",
            hex::encode(image.digest()),
            hex::encode(other.digest())
        )),
        "{}",
        text(&out)
    );
    assert_eq!(read(&staged_file), image);
    assert_eq!(read(&join_measurements), new);
    let finish = || finish_file(image_file.clone());
    let out = finish().await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(!staged_file.exists());
    assert_eq!(read(&join_measurements), image);
    // The workspace records the finished image, for `keel recover`.
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ws.path().join("keel-image.json")).unwrap()).unwrap();
    assert_eq!(record["digest"], hex::encode(image.digest()));
    // Finished: another set has nothing to finish, the same one (asked
    // again, as after a failure to write the join service's file) changes
    // nothing.
    let out = finish_file(other_file.clone()).await;
    assert!(!out.status.success());
    assert!(text(&out).contains("nothing to finish"), "{}", text(&out));
    let out = finish().await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(!staged_file.exists());
    assert_eq!(read(&join_measurements), image);
    // `upgrade apply` of the finished image again (a retry): nothing to
    // stage, no error. A file signed without an epoch (0, below the
    // cluster's 1): refused with the reason, nothing staged.
    let apply_image = |file: std::path::PathBuf| {
        let settings = &settings;
        let endpoint = &endpoint;
        async move {
            let file = file.to_str().unwrap().to_owned();
            let args = [
                "upgrade",
                "apply",
                "--workspace",
                ws_arg,
                "--image-measurements",
                &file,
                "--skip-phases",
                "kubernetes",
                "--endpoint",
                endpoint,
            ];
            run_keel(&args, settings, None).await
        }
    };
    let out = apply_image(image_file.clone()).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("is the current image"),
        "{}",
        text(&out)
    );
    let old_body = format!("{}\n", other.to_json());
    let old_file = operator.path().join("old.json");
    std::fs::write(&old_file, &old_body).unwrap();
    std::fs::write(
        operator.path().join("old.json.sig"),
        signing.sign(old_body.as_bytes()),
    )
    .unwrap();
    let out = apply_image(old_file).await;
    assert!(!out.status.success());
    assert!(text(&out).contains("epoch 0 is below 1"), "{}", text(&out));
    assert!(!staged_file.exists());
    assert_eq!(read(&join_measurements), image);
    // `keel revoke` and `keel status` over the same operator API: the node
    // the control plane knows (registered as a ticket registers it) is put
    // on its revocation list; an unknown one is a clear error.
    let registry = keel_agent::registry::RegistryStore::shared(&root1).unwrap();
    let worker_ek = join_common::ek_digest(&rebooted.tpm);
    registry
        .update(|r| {
            r.register(
                &worker_ek,
                "0a1b2c3d-0000-4000-8000-00000000000a",
                "w-1",
                "worker",
            )
        })
        .unwrap();
    // A node the alias case below revokes, so that w-1's own revocation
    // later is a run of its own.
    let w2_ek = keel_verifier::ek::EkDigest::from_hex(&"dd".repeat(32)).unwrap();
    registry
        .update(|r| r.register(&w2_ek, "", "w-2", "worker"))
        .unwrap();
    let operator_cmd = |args: Vec<String>| {
        let settings = settings.clone();
        let mut full = args;
        full.extend([
            "--workspace".to_owned(),
            ws.path().to_str().unwrap().to_owned(),
            "--endpoint".to_owned(),
            operator_addr.to_string(),
        ]);
        async move {
            let args: Vec<&str> = full.iter().map(String::as_str).collect();
            run_keel(&args, &settings, None).await
        }
    };
    let out = operator_cmd(vec!["revoke".into(), "keel-nobody".into()]).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("no control plane named knows a node keel-nobody"),
        "{}",
        text(&out)
    );
    // The host sends a second control plane's connection to this one: one
    // node answers at two endpoints. The CLI says so instead of reporting
    // the revocation done on a control plane that never got it.
    // (By its EK: a name is resolved only when every named control plane
    // answered, and the alias is not read as one.)
    let alias = format!("localhost:{}", operator_addr.port());
    let out = operator_cmd(vec![
        "revoke".into(),
        w2_ek.to_string(),
        "--endpoint".into(),
        alias.clone(),
    ])
    .await;
    assert!(
        text(&out).contains(&format!(
            "{operator_addr} answered as the node at {alias} (EK {}): two endpoints, one node",
            join_common::ek_digest(&tpm1)
        )),
        "{}",
        text(&out)
    );
    assert!(
        text(&out).contains("1 of 2 control plane(s) did not revoke the node"),
        "{}",
        text(&out)
    );
    assert!(!out.status.success(), "{}", text(&out));
    // The control plane that answered revoked w-2, and only w-2.
    assert!(registry.revocation(&w2_ek).is_some());
    assert!(registry.revocation(&worker_ek).is_none());
    // The host sends a control plane's connection to a (compromised)
    // worker, which would answer "revoked": the CLI sends nothing to a
    // node whose measured role is not the control plane's.
    let worker_addr: SocketAddr = format!("127.0.0.1:{}", join_common::free_port())
        .parse()
        .unwrap();
    let worker_operator = tokio::spawn({
        let node = rebooted.node(slot.clone());
        async move {
            let _ = keel_agent::node::serve_operator_port(
                tokio::net::TcpListener::bind(worker_addr).await.unwrap(),
                node,
                None,
            )
            .await;
        }
    });
    join_common::wait_for_port(worker_addr).await;
    let revoke_at_worker = [
        "revoke",
        "w-1",
        "--workspace",
        ws.path().to_str().unwrap(),
        "--endpoint",
        &worker_addr.to_string(),
    ];
    let out = run_keel(&revoke_at_worker, &settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("{worker_addr} is not a control plane")),
        "{}",
        text(&out)
    );
    worker_operator.abort();
    let out = operator_cmd(vec!["revoke".into(), "w-1".into()]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&worker_ek.to_string()),
        "{}",
        text(&out)
    );
    assert!(registry.revocation(&worker_ek).is_some());
    // The workspace recorded the EK: `keel recover` never sends it the
    // master secret.
    let revoked: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ws.path().join("keel-revoked.json")).unwrap())
            .unwrap();
    let eks = revoked["eks"].as_array().unwrap();
    assert!(
        eks.iter().any(|ek| *ek == worker_ek.to_string()),
        "{revoked}"
    );
    let out = operator_cmd(vec!["status".into(), "-o".into(), "json".into()]).await;
    assert!(out.status.success(), "{}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let view = &status["control_planes"][0]["registry"];
    assert_eq!(view["nodes"][worker_ek.to_string()]["name"], "w-1");
    assert_eq!(view["revoked"][1]["ek"], worker_ek.to_string());
    // The registry's clock when it answered: the ages' reference.
    let served_at = status["control_planes"][0]["served_at"].as_u64().unwrap();
    assert!(served_at >= keel_agent::registry::now() - 60, "{status}");

    // `keel kubeconfig` over the same operator API: the control plane's
    // admin kubeconfig, the one init wrote, fetched again; a kubeconfig in
    // the workspace is kept without --force, and nothing is fetched.
    let kubeconfig = ws.path().join("keel-admin.conf");
    let from_init = std::fs::read(&kubeconfig).unwrap();
    assert_eq!(
        from_init,
        std::fs::read(root1.join(keel_agent::paths::ADMIN_CONF)).unwrap()
    );
    let out = operator_cmd(vec!["kubeconfig".into()]).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("pass --force") && text(&out).contains("nothing was fetched"),
        "{}",
        text(&out)
    );
    std::fs::remove_file(&kubeconfig).unwrap();
    let out = operator_cmd(vec!["kubeconfig".into()]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read(&kubeconfig).unwrap(), from_init);
    assert_eq!(mode(&kubeconfig), 0o600);
    std::fs::write(&kubeconfig, b"stale").unwrap();
    let out = operator_cmd(vec!["kubeconfig".into(), "--force".into()]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("replaced the one there"),
        "{}",
        text(&out)
    );
    assert_eq!(std::fs::read(&kubeconfig).unwrap(), from_init);
    assert_eq!(mode(&kubeconfig), 0o600);

    // A Kubernetes upgrade that leaves out a control plane this one knows:
    // that one would never authorise the target, and would judge the
    // upgraded nodes drifted (under the revoke policy, revoke them). The
    // CLI refuses before it changes anything.
    let other_cp = keel_verifier::ek::EkDigest::from_hex(&"cd".repeat(32)).unwrap();
    registry
        .update(|r| r.register(&other_cp, "", "cp-9", "control-plane"))
        .unwrap();
    let refused_for_cp9 = |out: &std::process::Output| {
        assert!(!out.status.success(), "{}", text(out));
        assert!(
            text(out).contains(&format!(
                "knows control planes not named with --endpoint: cp-9 ({other_cp})"
            )),
            "{}",
            text(out)
        );
        assert!(text(out).contains("nothing was changed"), "{}", text(out));
    };
    let args = |list: &[&str]| list.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>();
    let other = other_file.to_str().unwrap();
    refused_for_cp9(
        &operator_cmd(args(&[
            "upgrade",
            "apply",
            "--kubernetes",
            "v1.31",
            "--skip-phases",
            "image",
        ]))
        .await,
    );
    // The same for an image rollout: nothing staged.
    refused_for_cp9(
        &operator_cmd(args(&[
            "upgrade",
            "apply",
            "--image-measurements",
            other,
            "--skip-phases",
            "kubernetes",
        ]))
        .await,
    );
    assert!(!staged_file.exists());
    // And for the end of an image rollout, which the left-out control plane
    // would never see: it would go on accepting the old image.
    refused_for_cp9(
        &operator_cmd(args(&["upgrade", "finish", "--image-measurements", other])).await,
    );
    // And for new measurements pushed outside a rollout, for the same reason.
    refused_for_cp9(&operator_cmd(args(&["push-measurements", "--file", other])).await);
    // And for a revocation, which cp-9 would not know of: it would go on
    // issuing the node tickets.
    let out = operator_cmd(args(&["revoke", "w-1"])).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!(
            "knows control planes not named with --endpoint: cp-9 ({other_cp})"
        )),
        "{}",
        text(&out)
    );
    // Except for cp-9 itself, gone for good, named here by the 16 hex
    // digits of its EK that `keel status` shows.
    let out = operator_cmd(args(&["revoke", &other_cp.to_string()[7..23]])).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("revoking node cp-9 (EK {other_cp})")),
        "{}",
        text(&out)
    );
    assert!(registry.revocation(&other_cp).is_some());

    // `keel verify --cluster-id`: locked into exactly that cluster, or not.
    for (id, member) in [
        (hex::encode(state.cluster_id), true),
        ("ab".repeat(32), false),
    ] {
        let out = run_keel(
            &[
                "verify",
                "--endpoint",
                &operator_addr.to_string(),
                "--cluster-id",
                &id,
                "-o",
                "json",
            ],
            &settings,
            None,
        )
        .await;
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["cluster"]["expected"], id.as_str(), "{}", text(&out));
        assert_eq!(report["cluster"]["member"], member, "{}", text(&out));
        if !member {
            assert!(!out.status.success());
            assert_eq!(report["verified"], false);
        }
    }

    // `keel recover` with settings that still name the image the finish
    // retired: refused before anything is sent (a host could boot that
    // image and route the operator to it).
    let recover_from = |workspace: &std::path::Path| {
        let (workspace, endpoint) = (
            workspace.to_str().unwrap().to_owned(),
            operator_addr.to_string(),
        );
        let settings = settings.clone();
        async move {
            let args = [
                "recover",
                "--workspace",
                &workspace,
                "--endpoint",
                &endpoint,
                "--wait",
                "0",
            ];
            run_keel(&args, &settings, None).await
        }
    };
    let out = recover_from(ws.path()).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    assert!(
        text(&out).contains(&format!(
            "are not an image this cluster accepts (sha256:{}, epoch",
            hex::encode(image.digest())
        )),
        "{}",
        text(&out)
    );
    // `keel recover` against a node that is a member (PCR 15 set), from a
    // workspace that finished no image rollout: the CLI refuses it before
    // it sends anything, whatever the node would answer.
    let before_rollout = tempfile::tempdir().unwrap();
    for file in ["keel-master-secret.json", "keel-id.json"] {
        std::fs::copy(ws.path().join(file), before_rollout.path().join(file)).unwrap();
    }
    let out = recover_from(before_rollout.path()).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    assert!(text(&out).contains("PCR 15"), "{}", text(&out));
    operator_task.abort();
    join_task.abort();
}
