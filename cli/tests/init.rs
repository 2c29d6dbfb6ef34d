//! `keel init` against an agent's init server: each node has its own swtpm
//! (EK certificate from a test CA), components come from the loopback mirror
//! (kubeadm is the stand-in), TLS is real aTLS.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use harness::{events, run_keel, text, Settings, SECRET};
use keel_agent::address::AdvertiseAddress;
use keel_agent::cluster::ClusterSlot;
use keel_agent::kubeadm::Kubeadm;
use keel_agent::measured::SharedTpm;
use keel_agent::nodelock::NodeLock;
use keel_agent::provision::{KubeletStart, NodeEnv};
use keel_agent::reboot::RebootPolicy;
use keel_installer::InstallerConfig;
use keel_proto::components::Component;
use keel_testkit::components::{stand_in_set_with, KubeExecutables};
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::measurement::{event_digest, extend, pcr, EventType};
use keel_verifier::measurements::{Expected, Measurements};

struct Node {
    tpm: SharedTpm,
    cluster: Arc<ClusterSlot>,
    addr: SocketAddr,
    dir: tempfile::TempDir,
    config: NodeConfig,
    components: Vec<Component>,
    task: tokio::task::JoinHandle<()>,
    _mirror: MirrorServer,
    _swtpm: Swtpm,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A loopback address free a moment ago.
fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

async fn node(ca: &EkCa, kubeadm_env: &[(&str, &str)]) -> Node {
    node_at(ca, kubeadm_env, free_addr()).await
}

/// A node whose init server listens on `addr`.
async fn node_at(ca: &EkCa, kubeadm_env: &[(&str, &str)], addr: SocketAddr) -> Node {
    let swtpm = Swtpm::start(ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let config = harness::serving_control_plane_config(&harness::secret_hash(), ca);
    let tpm = harness::measured(&swtpm, &dir.path().join("eventlog.jsonl"), &config);
    let lock = Arc::new(NodeLock::new(tpm.clone()).unwrap());

    // The components, served by the mirror; the CLI sends their list.
    let mirror = MirrorServer::start().unwrap();
    let components = stand_in_set_with(
        &mirror,
        Path::new("/"),
        "v1.31.13",
        &KubeExecutables::standin().unwrap(),
    )
    .unwrap();

    let mut kubeadm = Kubeadm::new(&root.join("run/state/bin"));
    kubeadm.root = root.clone();
    kubeadm.env = [
        ("KEEL_STANDIN_ROOT", root.to_str().unwrap()),
        ("KEEL_STANDIN_VERSION", "v1.31.13"),
    ]
    .iter()
    .chain(kubeadm_env)
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    let env = NodeEnv {
        installer: InstallerConfig {
            root: root.clone(),
            ..InstallerConfig::default()
        },
        kubeadm,
        work_dir: dir.path().to_owned(),
        advertise_address: AdvertiseAddress::Fixed("127.0.0.1".parse().unwrap()),
        state_disk: None,
        kubelet: KubeletStart::Systemd,
        reboot: RebootPolicy::Never,
    };
    let cluster = Arc::new(ClusterSlot::new(None));
    let task = tokio::spawn({
        let (config, tpm, cluster) = (config.clone(), tpm.clone(), cluster.clone());
        async move {
            let node = keel_agent::provision::Node {
                config,
                tpm,
                lock,
                env,
                cluster,
                operator_key: Default::default(),
            };
            let _ = keel_agent::node::serve_init(addr, node).await;
        }
    });
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Node {
        tpm,
        cluster,
        addr,
        dir,
        config,
        components,
        task,
        _mirror: mirror,
        _swtpm: swtpm,
    }
}

impl Node {
    fn pcr15(&self) -> [u8; 32] {
        self.tpm
            .lock()
            .unwrap()
            .tpm()
            .pcr_read(&[pcr::CLUSTER_ID])
            .unwrap()[&pcr::CLUSTER_ID]
    }

    /// Writes the CLI's settings for this node; `pcr12` overrides the expected config PCR.
    fn settings(&self, ca: &EkCa, secret: &[u8], pcr12: Option<[u8; 32]>) -> PathBuf {
        Settings {
            endpoint: self.addr,
            measurements: &harness::measurements(
                pcr12.unwrap_or_else(|| self.config.expected_config_pcr()),
                Expected::enforced([0; 32]),
            ),
            ek_ca: ca,
            init_secret: secret,
            components: Some(&self.components),
        }
        .write(self.dir.path())
    }
}

async fn keel_init(settings: &Path, workspace: &Path) -> std::process::Output {
    run_keel(&["init", "--skip-helm-wait"], settings, Some(workspace)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_creates_the_cluster_and_locks_the_node() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    let out = keel_init(&n.settings(&ca, SECRET, None), ws.path()).await;
    assert!(out.status.success(), "{}", text(&out));

    let secret_mode = std::fs::metadata(ws.path().join("keel-master-secret.json"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(secret_mode & 0o777, 0o600);
    let kubeconfig = std::fs::read_to_string(ws.path().join("keel-admin.conf")).unwrap();
    assert!(
        kubeconfig.contains("certificate-authority-data"),
        "{kubeconfig}"
    );
    let id: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ws.path().join("keel-id.json")).unwrap()).unwrap();
    let cluster_id = hex::decode(id["cluster_id"].as_str().unwrap()).unwrap();
    assert!(text(&out).contains(id["cluster_id"].as_str().unwrap()));

    // PCR 15 is the extend of the cluster ID, and the log records the lock.
    let lock_event = &events(&n.tpm, EventType::ClusterId)[0];
    assert_eq!(lock_event.data, cluster_id);
    assert_eq!(events(&n.tpm, EventType::Component).len(), 5);
    let expected = extend(
        &[0; 32],
        &event_digest(lock_event.seq, EventType::ClusterId, &cluster_id),
    );
    assert_eq!(n.pcr15(), expected);

    // The node's join service will admit what the CLI admitted.
    let sent = Measurements::parse(&std::fs::read(n.dir.path().join("measurements.json")).unwrap())
        .unwrap();
    let state = n
        .cluster
        .borrow()
        .clone()
        .expect("the node holds the cluster");
    assert_eq!(state.join_measurements, sent);

    // A second init is refused with FailedPrecondition.
    let ws2 = tempfile::tempdir().unwrap();
    let out = keel_init(&n.settings(&ca, SECRET, None), ws2.path()).await;
    assert!(!out.status.success());
    // The node's PCR 15 is no longer zero, so the CLI refuses it already; ask the node directly too.
    assert!(text(&out).contains("PCR 15"), "{}", text(&out));
    assert!(
        text(&out).contains("the node is already in a cluster"),
        "{}",
        text(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_init_is_failed_precondition() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    assert!(keel_init(&n.settings(&ca, SECRET, None), ws.path())
        .await
        .status
        .success());
    // Settings whose measurements accept any PCR 15 (warn-only) do not
    // make the CLI send this node a second cluster's secrets: it requires
    // PCR 15 zero whatever the file says, and sends nothing.
    let settings = n.settings(&ca, SECRET, None);
    let m = harness::measurements(n.config.expected_config_pcr(), Expected::warn_only([0; 32]));
    std::fs::write(n.dir.path().join("measurements.json"), m.to_json()).unwrap();
    let ws2 = tempfile::tempdir().unwrap();
    let out = keel_init(&settings, ws2.path()).await;
    assert!(!out.status.success());
    assert!(text(&out).contains("PCR 15"), "{}", text(&out));
    assert!(
        !ws2.path().join("keel-master-secret.json").exists(),
        "a master secret was made for a node in a cluster"
    );
}

/// A workspace holding an admin kubeconfig but no master secret (moved or
/// removed by hand) holds an earlier cluster's credentials: init refuses
/// before it connects, and the file stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_clusters_kubeconfig_stops_init_before_anything_is_sent() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    let kubeconfig = ws.path().join("keel-admin.conf");
    std::fs::write(&kubeconfig, "an earlier cluster's").unwrap();
    let out = keel_init(&n.settings(&ca, SECRET, None), ws.path()).await;
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("exists without a master secret beside it"),
        "{t}"
    );
    assert_eq!(
        std::fs::read_to_string(&kubeconfig).unwrap(),
        "an earlier cluster's"
    );
    assert!(!ws.path().join("keel-master-secret.json").exists());
    assert_eq!(n.pcr15(), [0; 32]);
}

/// An init secret's hash is in every node's measured config, which the
/// node shows anyone who connects: a short secret could be guessed
/// offline. The CLI refuses one before it connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_init_secret_is_refused_before_anything_is_sent() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    let out = keel_init(&n.settings(&ca, b"fifteen bytes!!", None), ws.path()).await;
    assert!(!out.status.success());
    assert!(
        text(&out).contains("holds 15 bytes; an init secret needs at least 16"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    assert!(
        !text(&out).contains("fifteen bytes!!"),
        "the secret must not be echoed"
    );
    assert_eq!(n.pcr15(), [0; 32]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_init_secret_is_refused_and_the_node_stays_unlocked() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    let wrong = b"a wrong init secret of a fair length";
    let out = keel_init(&n.settings(&ca, wrong, None), ws.path()).await;
    assert!(!out.status.success());
    // The node's measured config names the secret's hash: the CLI says so
    // before it sends anything (the node's own refusal, and the wait it
    // imposes on the address, are `agent/tests/init_secret.rs`'s).
    assert!(
        text(&out).contains("does not match the hash in the node's measured config"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    assert!(
        !text(&out).contains("a wrong init secret"),
        "the secret must not be echoed"
    );
    assert_eq!(n.pcr15(), [0; 32]);
    // Nothing reached the node: the right secret is taken at once, with
    // no wait a refused request would have cost.
    let ws2 = tempfile::tempdir().unwrap();
    let out = keel_init(&n.settings(&ca, SECRET, None), ws2.path()).await;
    assert!(out.status.success(), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_node_is_retried_until_the_wait_ends() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let settings = n.settings(&ca, SECRET, None);
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap();
    drop(closed);
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&settings).unwrap()).unwrap();
    json["endpoint"] = closed_addr.to_string().into();
    std::fs::write(&settings, json.to_string()).unwrap();
    let ws = tempfile::tempdir().unwrap();
    let out = run_keel(
        &["init", "--skip-helm-wait", "--wait", "3"],
        &settings,
        Some(ws.path()),
    )
    .await;
    assert!(!out.status.success());
    let t = text(&out);
    let retries = t
        .matches(&format!("{closed_addr}: the node is not reachable yet"))
        .count();
    assert!(retries >= 1, "{t}");
    assert!(
        t.contains(&format!(
            "{closed_addr}: the node's attestation was not accepted or it was not reachable; \
             nothing was sent"
        )),
        "{t}"
    );
    assert_eq!(n.pcr15(), [0; 32]);
}

/// `keel verify` started before the node's init server listens keeps
/// trying (the node may still be booting or bringing its network up) and
/// verifies the node once it is up; with no time left to wait it gives up
/// at once, naming why. A refused attestation is not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_waits_for_a_node_that_is_still_booting() {
    let ca = EkCa::new().unwrap();
    let addr = free_addr();
    let dir = tempfile::tempdir().unwrap();
    // The CA's certificates, which the settings name, exist once it has
    // certified a TPM.
    let tpm = dir.path().join("tpm");
    std::fs::create_dir(&tpm).unwrap();
    ca.manufacture(&tpm).unwrap();
    let config = harness::serving_control_plane_config(&harness::secret_hash(), &ca);
    let settings = Settings {
        endpoint: addr,
        measurements: &harness::measurements(
            config.expected_config_pcr(),
            Expected::enforced([0; 32]),
        ),
        ek_ca: &ca,
        init_secret: SECRET,
        components: None,
    }
    .write(dir.path());

    let out = run_keel(&["verify", "--wait", "0"], &settings, None).await;
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("connecting to the server failed"), "{t}");
    assert!(!t.contains("not reachable yet"), "{t}");

    let verify = tokio::spawn({
        let settings = settings.clone();
        async move { run_keel(&["verify", "--wait", "60"], &settings, None).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let n = node_at(&ca, &[], addr).await;
    let out = verify.await.unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("not reachable yet"), "{t}");
    assert!(t.contains("attestation verified"), "{t}");

    let out = run_keel(
        &["verify", "--wait", "60"],
        &n.settings(&ca, SECRET, Some([3; 32])),
        None,
    )
    .await;
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("PCR 12"), "{t}");
    assert!(
        !t.contains("not reachable yet"),
        "a refusal is not retried: {t}"
    );
}

/// Settings the node would refuse (its cluster name, service CIDR, API
/// server names) are said before a master secret is made for them: a
/// rerun with the settings fixed can use the same workspace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_the_node_would_refuse_stop_init_before_a_master_secret_is_made() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    let settings = n.settings(&ca, SECRET, None);
    let good: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&settings).unwrap()).unwrap();
    for (field, value, said) in [
        (
            "cluster_name",
            serde_json::json!("Prod"),
            "cluster name \"Prod\"",
        ),
        (
            "service_cidr",
            serde_json::json!("10.96.0.0"),
            "service CIDR \"10.96.0.0\"",
        ),
        (
            "api_server_cert_sans",
            serde_json::json!(["a name"]),
            "SAN \"a name\"",
        ),
    ] {
        let mut json = good.clone();
        json[field] = value;
        std::fs::write(&settings, json.to_string()).unwrap();
        let out = keel_init(&settings, ws.path()).await;
        assert!(!out.status.success());
        let t = text(&out);
        assert!(t.contains(said) && t.contains("nothing was sent"), "{t}");
        assert!(!ws.path().join("keel-master-secret.json").exists());
    }
    assert_eq!(n.pcr15(), [0; 32]);
    std::fs::write(&settings, good.to_string()).unwrap();
    let out = keel_init(&settings, ws.path()).await;
    assert!(out.status.success(), "{}", text(&out));
}

/// A node downloads only from the mirror its measured config names: a
/// mirror in the settings that the node's config does not name is said
/// before anything is sent (init used to send it, and the node ignored it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_the_node_does_not_name_stops_init_before_anything_is_sent() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    let settings = n.settings(&ca, SECRET, None);
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&settings).unwrap()).unwrap();
    json["component_mirror"] = "http://10.0.0.5/k8s/".into();
    std::fs::write(&settings, json.to_string()).unwrap();
    let out = keel_init(&settings, ws.path()).await;
    assert!(!out.status.success());
    let t = text(&out);
    assert!(
        t.contains(
            "component_mirror is http://10.0.0.5/k8s/, the node's measured config names none"
        ) && t.contains("nothing was sent"),
        "{t}"
    );
    assert_eq!(n.pcr15(), [0; 32]);
    assert!(!ws.path().join("keel-master-secret.json").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatching_measurements_stop_the_cli_before_it_sends_anything() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    let out = keel_init(&n.settings(&ca, SECRET, Some([3; 32])), ws.path()).await;
    assert!(!out.status.success());
    let t = text(&out);
    assert!(
        t.contains("nothing was sent") && t.contains("PCR 12"),
        "{t}"
    );
    assert!(
        !t.contains("not reachable yet"),
        "a refusal is not retried: {t}"
    );
    assert_eq!(n.pcr15(), [0; 32]);
    assert!(!ws.path().join("keel-admin.conf").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubeadm_failure_streams_the_error_and_the_logs() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[("KEEL_STANDIN_FAIL", "always")]).await;
    let ws = tempfile::tempdir().unwrap();
    let out = keel_init(&n.settings(&ca, SECRET, None), ws.path()).await;
    assert!(!out.status.success());
    let t = text(&out);
    assert!(
        t.contains("init failed on the node") && t.contains("kubeadm init"),
        "{t}"
    );
    // The test node never reboots (the agent's host-test policy), and the
    // CLI says nothing of a reboot the node did not schedule.
    assert!(!t.contains("reboots"), "{t}");
    let logs = std::fs::read_to_string(ws.path().join("keel-init-failure.log")).unwrap();
    assert!(
        logs.contains("running kubeadm init") && logs.contains("init failed"),
        "{logs}"
    );
    // The node is locked (the failure came after the lock) and says it is unusable.
    assert_ne!(n.pcr15(), [0; 32]);
    assert!(logs.contains("unusable"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_from_the_node_reach_the_terminal_escaped() {
    // The stand-in kubeadm claims this version and fails on it, so the
    // sequences come back in a streamed log line and the failure text.
    let claim = "v1.31.13\u{1b}[2J\u{1b}]0;owned\u{7}\rfake";
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[("KEEL_STANDIN_VERSION", claim)]).await;
    let ws = tempfile::tempdir().unwrap();
    let out = keel_init(&n.settings(&ca, SECRET, None), ws.path()).await;
    assert!(!out.status.success());
    let t = text(&out);
    let escaped = "v1.31.13\\u{1b}[2J\\u{1b}]0;owned\\u{7}\\rfake";
    assert!(
        t.lines()
            .any(|l| l.starts_with("  node: ") && l.contains(escaped)),
        "{t}"
    );
    assert!(
        t.contains("init failed on the node") && t.matches(escaped).count() >= 2,
        "{t}"
    );
    assert!(
        !t.contains('\u{1b}') && !t.contains('\u{7}') && !t.contains('\r'),
        "{t:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_inits_lock_once() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let settings = n.settings(&ca, SECRET, None);
    let (w1, w2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = tokio::join!(
        keel_init(&settings, w1.path()),
        keel_init(&settings, w2.path())
    );
    let wins = [&a, &b].iter().filter(|o| o.status.success()).count();
    assert_eq!(wins, 1, "{}\n---\n{}", text(&a), text(&b));
    assert_eq!(events(&n.tpm, EventType::ClusterId).len(), 1);
}

/// Another client behind the operator's address sent the node requests it
/// refused, so the node holds the address back for a few seconds: `keel
/// init` waits that out on its connection and sends again, instead of
/// failing on a refusal that never read its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_waits_out_a_short_hold_on_its_address() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let validator = Arc::new(keel_verifier::validator::Validator::new(
        harness::measurements(n.config.expected_config_pcr(), Expected::enforced([0; 32])),
        keel_verifier::ek::EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap(),
    ));
    // Three requests without secrets, each after the previous hold ended:
    // the address is then held back for 4 s.
    for round in 0..3u64 {
        let bound = keel_atls::AtlsClient::<keel_verifier::validator::Verified>::server_attested(
            validator.clone(),
        )
        .bind_channel(
            tonic::transport::Endpoint::from_shared(format!("http://{}", n.addr)).unwrap(),
        )
        .await
        .unwrap();
        let refused = keel_proto::init::init_service_client::InitServiceClient::new(bound.channel)
            .init(keel_proto::init::InitRequest::default())
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        if round < 2 {
            tokio::time::sleep(std::time::Duration::from_millis(1000 * (1 << round) + 100)).await;
        }
    }
    let ws = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let out = keel_init(&n.settings(&ca, SECRET, None), ws.path()).await;
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("holds back init requests from this address"),
        "{t}"
    );
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(1),
        "{t}"
    );
    assert_eq!(events(&n.tpm, EventType::ClusterId).len(), 1);
}

/// Files outside the workspace that planted links point to; each must keep
/// its content.
struct Victims {
    dir: tempfile::TempDir,
}

impl Victims {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Plants a link at `link` to a new victim file `name`.
    fn plant(&self, link: &Path, name: &str) {
        let victim = self.dir.path().join(name);
        std::fs::write(&victim, "untouched").unwrap();
        // A mode distinguishable from what the CLI sets.
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o640)).unwrap();
        std::os::unix::fs::symlink(&victim, link).unwrap();
    }

    fn assert_untouched(&self) {
        for entry in std::fs::read_dir(self.dir.path()).unwrap() {
            let path = entry.unwrap().path();
            assert_eq!(
                std::fs::read_to_string(&path).unwrap(),
                "untouched",
                "{} was written through a link",
                path.display()
            );
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o640, "{} was chmod-ed", path.display());
        }
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_at_the_old_temporary_names_are_not_written_through() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let ws = tempfile::tempdir().unwrap();
    let victims = Victims::new();
    // The names the CLI used to write through: `<file>.tmp` next to each file.
    for name in ["keel-admin.tmp", "keel-id.tmp", "keel-init-failure.tmp"] {
        victims.plant(&ws.path().join(name), name);
    }

    let out = keel_init(&n.settings(&ca, SECRET, None), ws.path()).await;
    assert!(out.status.success(), "{}", text(&out));
    victims.assert_untouched();

    let kubeconfig = ws.path().join("keel-admin.conf");
    assert!(std::fs::symlink_metadata(&kubeconfig).unwrap().is_file());
    assert_eq!(mode(&kubeconfig), 0o600);
    assert!(std::fs::read_to_string(&kubeconfig)
        .unwrap()
        .contains("certificate-authority-data"));
    assert_eq!(mode(&ws.path().join("keel-id.json")), 0o644);
    // The planted links are left alone, and no temporary file is left over.
    let mut names: Vec<String> = std::fs::read_dir(ws.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "keel-admin.conf",
            "keel-admin.tmp",
            "keel-id.json",
            "keel-id.tmp",
            "keel-init-failure.tmp",
            "keel-master-secret.json",
        ]
    );
    assert!(std::fs::symlink_metadata(ws.path().join("keel-admin.tmp"))
        .unwrap()
        .file_type()
        .is_symlink());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_at_an_output_file_stops_init_before_anything_is_sent() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let settings = n.settings(&ca, SECRET, None);
    for name in ["keel-admin.conf", "keel-id.json", "keel-init-failure.log"] {
        let ws = tempfile::tempdir().unwrap();
        let victims = Victims::new();
        victims.plant(&ws.path().join(name), name);
        let out = keel_init(&settings, ws.path()).await;
        assert!(!out.status.success(), "{name}: {}", text(&out));
        let t = text(&out);
        assert!(
            t.contains(name) && t.contains("symbolic link"),
            "{name}: {t}"
        );
        assert!(!t.contains("connecting to"), "{name}: {t}");
        victims.assert_untouched();
        // Nothing written, nothing sent: no master secret, the node unlocked.
        assert!(
            !ws.path().join("keel-master-secret.json").exists(),
            "{name}"
        );
        assert_eq!(n.pcr15(), [0; 32], "{name}");
    }
    // The same node and settings, without the link: init goes through.
    let ws = tempfile::tempdir().unwrap();
    let out = keel_init(&settings, ws.path()).await;
    assert!(out.status.success(), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_workspace_is_private() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let base = tempfile::tempdir().unwrap();
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ws = base.path().join("clusters/keel");
    let out = keel_init(&n.settings(&ca, SECRET, None), &ws).await;
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(mode(&base.path().join("clusters")), 0o700);
    assert_eq!(mode(&ws), 0o700);
    assert_eq!(mode(&ws.join("keel-admin.conf")), 0o600);
    assert_eq!(mode(&ws.join("keel-master-secret.json")), 0o600);
}

/// Attacker's move: another local user makes the workspace (or a
/// world-writable directory the operator names), so that they can later
/// remove the master secret, swap the admin kubeconfig or hold the
/// workspace's locks. `keel init` refuses such a workspace before it makes
/// a secret or contacts the node; a link to it is judged by the directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_others_can_write_is_refused_before_anything_is_sent() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, &[]).await;
    let base = tempfile::tempdir().unwrap();
    let open = base.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let link = base.path().join("link");
    std::os::unix::fs::symlink(&open, &link).unwrap();
    for ws in [&open, &link] {
        let out = keel_init(&n.settings(&ca, SECRET, None), ws).await;
        let t = text(&out);
        assert!(!out.status.success(), "{t}");
        assert!(t.contains("is writable by every user"), "{t}");
        assert!(!open.join("keel-master-secret.json").exists());
    }
    assert_eq!(n.pcr15(), [0; 32]);
}

/// `keel init-secret FILE` makes a secret only its file holds (0600, 64 hex
/// digits) and prints a salted hash a node config accepts and that matches
/// only that secret; it never replaces a secret that may already be in use.
#[test]
fn init_secret_writes_a_private_secret_and_prints_its_hash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("init-secret");
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_keel"))
            .arg("init-secret")
            .arg(&path)
            .output()
            .unwrap()
    };
    let out = run();
    assert!(out.status.success(), "{}", text(&out));
    let secret = std::fs::read(&path).unwrap();
    assert_eq!(secret.len(), 64);
    assert!(secret.iter().all(u8::is_ascii_hexdigit));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let hash = String::from_utf8(out.stdout.clone()).unwrap();
    let hash = hash.trim_end();
    assert!(!text(&out).contains(std::str::from_utf8(&secret).unwrap()));
    keel_verifier::init_secret::check(hash).unwrap();
    assert!(keel_verifier::init_secret::matches(hash, &secret));
    assert!(!keel_verifier::init_secret::matches(hash, SECRET));
    let doc = serde_json::json!({"cluster": {"init_secret_hash": hash}});
    let config = NodeConfig::parse(&serde_json::to_vec(&doc).unwrap(), Path::new("t")).unwrap();
    assert!(config.init_secret_matches(&secret));

    let again = run();
    assert!(!again.status.success());
    assert!(
        text(&again).contains("an existing init secret is never replaced"),
        "{}",
        text(&again)
    );
    assert_eq!(std::fs::read(&path).unwrap(), secret);
}
