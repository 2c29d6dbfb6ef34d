//! `keel init` and `keel verify` against a forged node: the real node's EK
//! certificate, PCRs and event log next to a software attestation key (the
//! security review's attack). The CLI must refuse it before the init secret,
//! the master secret or any request leaves the machine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use harness::{run_keel, text, Settings};
use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::measured::SharedTpm;
use keel_atls::AtlsServer;
use keel_proto::init::init_service_server::{InitService, InitServiceServer};
use keel_proto::init::{InitRequest, InitResponse};
use keel_proto::operator as op;
use keel_proto::operator::operator_service_server::{OperatorService, OperatorServiceServer};
use keel_proto::recovery::recovery_service_server::{RecoveryService, RecoveryServiceServer};
use keel_proto::recovery::{RecoverRequest, RecoverResponse};
use keel_testkit::forgery::SoftwareAk;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::measurement::EventType;
use keel_verifier::measurements::{Expected, Measurements};
use tokio_stream::wrappers::ReceiverStream;

const SECRET: &[u8] = b"the init secret a forger wants";

/// The forger's init, recovery and operator APIs: counts the requests
/// that reach them, and answers as [`Answer`] says.
#[derive(Default, Clone)]
struct Recorder(Arc<AtomicUsize>, Answer);

/// How a [`Recorder`] answers.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// Refuses every request.
    #[default]
    Refuse,
    /// As a hostile node: init floods its stream and stalls; recovery says
    /// it recovered, to another cluster; a revocation of [`WORKER_EK`] is
    /// answered as one of [`OTHER_EK`].
    Hostile,
    /// Init says it created a cluster, under an ID its secrets do not
    /// make, with a kubeconfig.
    Misreport,
    /// Init sends a log line and then nothing, its stream open (a node
    /// whose result is lost on the way).
    Silent,
    /// Init sends a log line and ends its stream without a result (one
    /// cut short on the way).
    Ended,
    /// Init takes the request and never answers it.
    Mute,
    /// Init answers busy, with the mark of a request left unread.
    Busy,
    /// As a control plane that holds [`WORKER_EK`] and fails every
    /// revocation (one whose answer is lost on the way).
    RevocationLost,
    /// As a control plane with an empty registry that takes the join
    /// measurements pushed and finishes the image upgrade asked for.
    TakesImage,
    /// As [`Answer::TakesImage`], but the push and the finish fail (their
    /// answers lost on the way).
    ImageLost,
    /// As [`Answer::TakesImage`], but the push and the finish are never
    /// answered.
    ImageMute,
}

/// What a flooding init API sends: a failure, then this many 64 KiB log
/// chunks (3 MiB), and then it keeps the stream open without a word.
const FLOOD_CHUNKS: usize = 48;

#[tonic::async_trait]
impl InitService for Recorder {
    type InitStream = ReceiverStream<Result<InitResponse, tonic::Status>>;

    async fn init(
        &self,
        _request: tonic::Request<InitRequest>,
    ) -> Result<tonic::Response<Self::InitStream>, tonic::Status> {
        use keel_proto::init::init_response::Kind;
        self.0.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        match self.1 {
            Answer::Refuse
            | Answer::RevocationLost
            | Answer::TakesImage
            | Answer::ImageLost
            | Answer::ImageMute => return Err(tonic::Status::unavailable("a forged node")),
            Answer::Mute => {
                std::future::pending::<()>().await;
            }
            Answer::Busy => return Err(keel_proto::busy("other init requests are in progress")),
            Answer::Hostile => {}
            Answer::Silent | Answer::Ended => {
                let line = Kind::LogLine("running kubeadm init".into());
                let _ = tx.try_send(Ok(InitResponse { kind: Some(line) }));
                if self.1 == Answer::Silent {
                    tokio::spawn(async move {
                        let _keep = tx;
                        std::future::pending::<()>().await;
                    });
                }
                return Ok(tonic::Response::new(ReceiverStream::new(rx)));
            }
            Answer::Misreport => {
                let created = Kind::Success(keel_proto::init::InitSuccess {
                    cluster_id: vec![0x55; 32],
                    kubeconfig: b"apiVersion: v1\n".to_vec(),
                });
                let _ = tx.try_send(Ok(InitResponse {
                    kind: Some(created),
                }));
                return Ok(tonic::Response::new(ReceiverStream::new(rx)));
            }
        }
        tokio::spawn(async move {
            let failure = Kind::Failure(keel_proto::init::InitFailure {
                error: "kubeadm failed".into(),
                node_reset: false,
            });
            let chunks = (0..FLOOD_CHUNKS).map(|_| Kind::LogChunk(vec![b'x'; 64 * 1024]));
            for kind in std::iter::once(failure).chain(chunks) {
                let message = InitResponse { kind: Some(kind) };
                if tx.send(Ok(message)).await.is_err() {
                    return;
                }
            }
            // Never ends the stream.
            let _keep = tx;
            std::future::pending::<()>().await;
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

struct Victim {
    tpm: SharedTpm,
    config: NodeConfig,
    _swtpm: Swtpm,
    _dir: tempfile::TempDir,
}

/// The real node: its own swtpm with an EK certificate from `ca`, its config
/// measured as the agent measures it.
fn victim(ca: &EkCa) -> Victim {
    node_with(ca, harness::control_plane_config(&no_secret_hash()))
}

/// An init secret hash no secret the tests know matches (nothing reaches
/// these nodes).
fn no_secret_hash() -> String {
    let unknown: [u8; 32] = rand::random();
    keel_verifier::init_secret::hash(&unknown).unwrap()
}

/// The CLI's settings for the node at `endpoint`, expecting the victim's
/// measurements.
fn settings(dir: &Path, ca: &EkCa, v: &Victim, endpoint: std::net::SocketAddr) -> PathBuf {
    Settings {
        endpoint,
        measurements: &harness::measurements(
            v.config.expected_config_pcr(),
            Expected::enforced([0; 32]),
        ),
        ek_ca: ca,
        init_secret: SECRET,
        components: None,
    }
    .write(dir)
}

/// A recording init, recovery and operator API served over server-attested aTLS,
/// and the CLI's settings and workspace for the node behind it.
struct Served {
    recorder: Recorder,
    server: tokio::task::JoinHandle<()>,
    /// host:port it serves on.
    endpoint: String,
    settings: PathBuf,
    workspace: PathBuf,
    _dir: tempfile::TempDir,
}

impl Served {
    /// Serves on a fresh port with `issuer`'s documents; the settings
    /// expect `node`'s measurements.
    async fn start(ca: &EkCa, node: &Victim, issuer: Arc<dyn keel_atls::Issuer>) -> Self {
        Self::serving(ca, node, issuer, Recorder::default()).await
    }

    /// As [`Served::start`], with `recorder` as the init, recovery and
    /// operator APIs.
    async fn serving(
        ca: &EkCa,
        node: &Victim,
        issuer: Arc<dyn keel_atls::Issuer>,
        recorder: Recorder,
    ) -> Self {
        Self::serving_at("127.0.0.1:0", ca, node, issuer, recorder).await
    }

    /// As [`Served::serving`], listening on `bind`.
    async fn serving_at(
        bind: &str,
        ca: &EkCa,
        node: &Victim,
        issuer: Arc<dyn keel_atls::Issuer>,
        recorder: Recorder,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = AtlsServer::<()>::server_attested(issuer).incoming(listener);
        let server = tokio::spawn({
            let recorder = recorder.clone();
            async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(InitServiceServer::new(recorder.clone()))
                    .add_service(RecoveryServiceServer::new(recorder.clone()))
                    .add_service(OperatorServiceServer::new(recorder))
                    .serve_with_incoming(incoming)
                    .await;
            }
        });
        let dir = tempfile::tempdir().unwrap();
        Self {
            recorder,
            server,
            endpoint: addr.to_string(),
            settings: settings(dir.path(), ca, node, addr),
            workspace: dir.path().join("workspace"),
            _dir: dir,
        }
    }

    /// As [`Served::start`], with `node`'s own TPM issuing, answering as
    /// `answer` says.
    async fn answering(ca: &EkCa, node: &Victim, answer: Answer) -> Self {
        let issuer = Arc::new(TpmIssuer::new(node.tpm.clone()));
        Self::serving(ca, node, issuer, Recorder(Arc::default(), answer)).await
    }

    /// Requests that reached the API.
    fn requests(&self) -> usize {
        self.recorder.0.load(Ordering::SeqCst)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A control plane of the cluster's image (its init secret's hash
/// `SECRET`'s) whose init API answers as `answer` says, with its EK CA and
/// TPM, which must outlive it (dropped after it, in a `let` of the tuple).
async fn control_plane_answering(answer: Answer) -> (EkCa, Victim, Served) {
    let ca = EkCa::new().unwrap();
    let hash = keel_verifier::init_secret::hash(SECRET).unwrap();
    let node = node_with(&ca, harness::control_plane_config(&hash));
    let served = Served::answering(&ca, &node, answer).await;
    (ca, node, served)
}

/// Runs `keel args`, which must fail for `why` with nothing sent.
async fn sent_nothing(args: &[&str], settings: &Path, workspace: Option<&Path>, why: &str) {
    let out = run_keel(args, settings, workspace).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(why), "{}", text(&out));
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
}

/// A genuine node with `config`, measured as the agent measures it.
fn node_with(ca: &EkCa, config: NodeConfig) -> Victim {
    let swtpm = Swtpm::start(ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    Victim {
        tpm: harness::measured(&swtpm, &dir.path().join("eventlog.jsonl"), &config),
        config,
        _swtpm: swtpm,
        _dir: dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_node_gets_no_init_secret_and_fails_verify() {
    let ca = EkCa::new().unwrap();
    let v = victim(&ca);
    let real = Arc::new(TpmIssuer::new(v.tpm.clone()));
    // Anyone who connects to a node gets a genuine document to copy from.
    let genuine = real.issue(&[0; 32], &[0; 32]).unwrap();
    let forger = Arc::new(SoftwareAk::new(&genuine, Some(real)).unwrap());
    let served = Served::start(&ca, &v, forger.clone()).await;

    let init = ["init", "--wait", "5"];
    let (settings, ws) = (&served.settings, Some(served.workspace.as_path()));
    sent_nothing(&init, settings, ws, "key residency").await;
    assert_eq!(served.requests(), 0, "a request reached the forger");
    assert!(forger.challenges_received() >= 1);

    let out = run_keel(&["verify"], settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("key residency"), "{}", text(&out));
}

/// A node at an IPv6 address, written as `[address]:port` (the form every
/// command takes): `keel verify` reaches it as `keel init` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reaches_a_node_at_an_ipv6_address() {
    let ca = EkCa::new().unwrap();
    let node = node_with(&ca, harness::control_plane_config(&no_secret_hash()));
    let issuer = Arc::new(TpmIssuer::new(node.tpm.clone()));
    let served = Served::serving_at("[::1]:0", &ca, &node, issuer, Recorder::default()).await;
    assert!(served.endpoint.starts_with("[::1]:"), "{}", served.endpoint);
    let out = run_keel(&["verify", "--wait", "2"], &served.settings, None).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("attestation verified"),
        "{}",
        text(&out)
    );
    // Without the brackets, the address and the port cannot be told apart.
    let bare = served.endpoint.replace(['[', ']'], "");
    let out = run_keel(&["verify", "--endpoint", &bare], &served.settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("an IPv6 address goes in brackets"),
        "{}",
        text(&out)
    );
}

/// A cluster of a hardware variant, checked with settings that leave
/// `attestation` out (so `vtpm`: no CPU evidence asked for). The host of
/// such a cluster is not trusted and controls its vTPM's EK CA: it could
/// present a software TPM with a copied event log. The CLI compares the
/// node's measured `cluster.attestation` with its settings and sends
/// nothing when they differ; here the node is genuine, so only that check
/// stands between it and the secrets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_another_attestation_variant_than_the_settings_gets_nothing() {
    let ca = EkCa::new().unwrap();
    let doc = serde_json::json!({
        "cluster": {
            "init_secret_hash": no_secret_hash(),
            "attestation": {
                "variant": "sev-snp",
                "sev_snp": {
                    "minimum_tcb": {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
                    "measurement": "00".repeat(48),
                },
            },
        },
        "node": {"name": "cp-0", "role": "control-plane"},
    });
    let config = NodeConfig::parse(doc.to_string().as_bytes(), "t".as_ref()).unwrap();
    let node = node_with(&ca, config);
    let served = Served::start(&ca, &node, Arc::new(TpmIssuer::new(node.tpm.clone()))).await;

    let init = ["init", "--wait", "5"];
    let (settings, ws) = (&served.settings, Some(served.workspace.as_path()));
    sent_nothing(&init, settings, ws, "attestation variant sev-snp").await;
    assert_eq!(served.requests(), 0, "a request reached the node");

    // Verification refuses it in either output format: the JSON report
    // says why, and the exit status is a failure.
    for verify in [&["verify"][..], &["verify", "-o", "json"]] {
        let out = run_keel(verify, settings, None).await;
        assert!(!out.status.success(), "{verify:?}: {}", text(&out));
        assert!(
            text(&out).contains("attestation variant sev-snp"),
            "{verify:?}: {}",
            text(&out)
        );
    }

    // Nor does an operator request reach it (status, revoke, the image
    // upgrade's steps, push-measurements all connect the same way).
    let ws = served.workspace.as_path();
    operator_workspace(ws, Some(&served.endpoint));
    let endpoint = served.endpoint.clone();
    let status = [
        "status",
        "--workspace",
        ws.to_str().unwrap(),
        "--endpoint",
        &endpoint,
        "--wait",
        "5",
    ];
    let out = run_keel(&status, settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("attestation variant sev-snp"),
        "{}",
        text(&out)
    );
    assert_eq!(served.requests(), 0, "a request reached the node");
}

/// `keel recover` with the workspace `ws`, waiting 5 s for the node.
fn recover_args(ws: &std::path::Path) -> [&str; 5] {
    [
        "recover",
        "--workspace",
        ws.to_str().unwrap(),
        "--wait",
        "5",
    ]
}

/// The cluster ID the secrets [`operator_workspace`] writes make.
fn workspace_cluster_id() -> [u8; 32] {
    let keys = keel_verifier::keys::KeyService::new(&[0x11; 32], &[0x22; 32]).unwrap();
    keel_verifier::keys::cluster_id(&keys.measurement_secret().unwrap(), &[0x33; 32]).unwrap()
}

/// Locks `node` into the [`operator_workspace`]'s cluster, as a member is.
fn locked_into_the_workspace_cluster(node: &Victim) {
    node.tpm
        .lock()
        .unwrap()
        .record(
            EventType::ClusterId,
            "node lock",
            workspace_cluster_id().to_vec(),
        )
        .unwrap();
}

/// A workspace as `keel init` leaves it in `ws`: a master secret and, with
/// the `endpoint` init ran against, the cluster ID.
fn operator_workspace(ws: &std::path::Path, endpoint: Option<&str>) {
    std::fs::create_dir_all(ws).unwrap();
    std::fs::write(
        ws.join("keel-master-secret.json"),
        serde_json::json!({
            "key": "11".repeat(32),
            "salt": "22".repeat(32),
            "measurement_salt": "33".repeat(32),
        })
        .to_string(),
    )
    .unwrap();
    if let Some(endpoint) = endpoint {
        std::fs::write(
            ws.join("keel-id.json"),
            serde_json::json!({
                "cluster_id": hex::encode(workspace_cluster_id()),
                "endpoint": endpoint,
            })
            .to_string(),
        )
        .unwrap();
    }
}

/// The recovery API of a node: counts the requests that reach it.
#[tonic::async_trait]
impl RecoveryService for Recorder {
    async fn recover(
        &self,
        _request: tonic::Request<RecoverRequest>,
    ) -> Result<tonic::Response<RecoverResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        if self.1 == Answer::Hostile {
            // A compromised control plane: "recovered", to another cluster.
            return Ok(tonic::Response::new(RecoverResponse {
                cluster_id: vec![0x55; 32],
            }));
        }
        Err(tonic::Status::unavailable("a worker"))
    }
}

/// Attacker's move: a control plane of the cluster's image, compromised
/// after it booted (attestation passes), answers `keel recover` as
/// recovered, but to a cluster other than the workspace's. The operator is
/// told so instead of "recovered".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_to_another_cluster_is_reported() {
    let (_ca, _node, served) = control_plane_answering(Answer::Hostile).await;
    let ws = &served.workspace;
    operator_workspace(ws, Some(&served.endpoint));
    let out = run_keel(&recover_args(ws), &served.settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert_eq!(served.requests(), 1, "{}", text(&out));
    assert!(
        text(&out).contains(&format!(
            "recovered, but locked to cluster {}, not the workspace's {}",
            "55".repeat(32),
            hex::encode(workspace_cluster_id())
        )),
        "{}",
        text(&out)
    );
}

/// A node whose measured config names another init secret than the
/// settings' file: `keel recover` sends it nothing (the node would refuse
/// a recovery without the cluster's init secret, and count it against the
/// operator's address).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_with_another_init_secret_sends_nothing() {
    let ca = EkCa::new().unwrap();
    let node = node_with(&ca, harness::control_plane_config(&no_secret_hash()));
    let served = Served::answering(&ca, &node, Answer::Hostile).await;
    let ws = &served.workspace;
    operator_workspace(ws, Some(&served.endpoint));
    sent_nothing(
        &recover_args(ws),
        &served.settings,
        None,
        "the init secret does not match the hash in the node's measured config",
    )
    .await;
    assert_eq!(served.requests(), 0);
}

/// A workspace whose ID file is not its master secret's cluster (files of
/// two clusters mixed up): `keel recover` refuses before anything is sent,
/// as a node given that measurement salt would lock and only then refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_of_two_clusters_sends_no_recovery() {
    let ca = EkCa::new().unwrap();
    let node = node_with(&ca, harness::control_plane_config(&no_secret_hash()));
    let served = Served::answering(&ca, &node, Answer::Hostile).await;
    let ws = &served.workspace;
    operator_workspace(ws, Some(&served.endpoint));
    std::fs::write(
        ws.join("keel-id.json"),
        serde_json::json!({ "cluster_id": "44".repeat(32), "endpoint": served.endpoint })
            .to_string(),
    )
    .unwrap();
    let out = run_keel(&recover_args(ws), &served.settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!(
            "makes cluster {}, but its keel-id.json names {}",
            hex::encode(workspace_cluster_id()),
            "44".repeat(32)
        )),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    assert_eq!(served.requests(), 0, "{}", text(&out));
}

/// The worker a hostile control plane's registry holds, and the EK it
/// names instead when asked to revoke it.
const WORKER_EK: &str = "sha256:aaaaaaaa11111111111111111111111111111111111111111111111111111111";
const OTHER_EK: &str = "sha256:bbbbbbbb22222222222222222222222222222222222222222222222222222222";

/// The operator API of a node: counts the requests that reach it, and
/// answers every challenge. A hostile one, and one whose revocations are
/// lost, holds [`WORKER_EK`] as worker `w-1`; the hostile one answers its
/// revocation with [`OTHER_EK`]. Every other request is refused.
#[tonic::async_trait]
impl OperatorService for Recorder {
    type UpgradeStream = ReceiverStream<Result<op::UpgradeResponse, tonic::Status>>;

    async fn challenge(
        &self,
        _request: tonic::Request<op::ChallengeRequest>,
    ) -> Result<tonic::Response<op::ChallengeResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(tonic::Response::new(op::ChallengeResponse {
            challenge: vec![0x66; 32],
        }))
    }

    async fn node_status(
        &self,
        _request: tonic::Request<op::NodeStatusRequest>,
    ) -> Result<tonic::Response<op::NodeStatusResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        if matches!(
            self.1,
            Answer::TakesImage | Answer::ImageLost | Answer::ImageMute
        ) {
            let registry = serde_json::json!({ "nodes": {}, "revoked": [] });
            return Ok(tonic::Response::new(op::NodeStatusResponse {
                registry: registry.to_string().into_bytes(),
                served_at: 0,
            }));
        }
        if !matches!(self.1, Answer::Hostile | Answer::RevocationLost) {
            return Err(tonic::Status::unavailable("not a control plane"));
        }
        let worker = serde_json::json!({
            "name": "w-1", "ek": WORKER_EK, "disk_uuid": "", "role": "worker",
        });
        let registry = serde_json::json!({ "nodes": { WORKER_EK: worker }, "revoked": [] });
        Ok(tonic::Response::new(op::NodeStatusResponse {
            registry: registry.to_string().into_bytes(),
            served_at: 0,
        }))
    }

    async fn revoke_node(
        &self,
        request: tonic::Request<op::RevokeNodeRequest>,
    ) -> Result<tonic::Response<op::RevokeNodeResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        if self.1 == Answer::RevocationLost {
            return Err(tonic::Status::unavailable("the revocation was lost"));
        }
        if self.1 != Answer::Hostile || request.get_ref().node != WORKER_EK {
            return Err(tonic::Status::unavailable("not a control plane"));
        }
        Ok(tonic::Response::new(op::RevokeNodeResponse {
            name: "w-1".into(),
            ek: OTHER_EK.into(),
            disk_uuid: String::new(),
        }))
    }

    async fn upgrade(
        &self,
        _request: tonic::Request<op::UpgradeRequest>,
    ) -> Result<tonic::Response<Self::UpgradeStream>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(tonic::Status::unimplemented("not here"))
    }

    async fn set_join_measurements(
        &self,
        request: tonic::Request<op::SetJoinMeasurementsRequest>,
    ) -> Result<tonic::Response<op::SetJoinMeasurementsResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        match self.1 {
            Answer::TakesImage => {
                let set = Measurements::parse(&request.get_ref().measurements)
                    .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
                Ok(tonic::Response::new(op::SetJoinMeasurementsResponse {
                    digest: set.digest().to_vec(),
                }))
            }
            Answer::ImageLost => Err(tonic::Status::unavailable("the push was lost")),
            Answer::ImageMute => std::future::pending().await,
            _ => Err(tonic::Status::unimplemented("not here")),
        }
    }

    async fn stage_image_measurements(
        &self,
        _request: tonic::Request<op::StageImageMeasurementsRequest>,
    ) -> Result<tonic::Response<op::StageImageMeasurementsResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(tonic::Status::unimplemented("not here"))
    }

    async fn finish_image_upgrade(
        &self,
        request: tonic::Request<op::FinishImageUpgradeRequest>,
    ) -> Result<tonic::Response<op::FinishImageUpgradeResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        match self.1 {
            Answer::TakesImage => Ok(tonic::Response::new(op::FinishImageUpgradeResponse {
                digest: request.into_inner().staged_digest,
            })),
            Answer::ImageLost => Err(tonic::Status::unavailable("the finish was lost")),
            Answer::ImageMute => std::future::pending().await,
            _ => Err(tonic::Status::unimplemented("not here")),
        }
    }

    async fn admin_kubeconfig(
        &self,
        _request: tonic::Request<op::AdminKubeconfigRequest>,
    ) -> Result<tonic::Response<op::AdminKubeconfigResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        match self.1 {
            // Past the 64 KiB an admin kubeconfig may have.
            Answer::Hostile => Ok(tonic::Response::new(op::AdminKubeconfigResponse {
                kubeconfig: vec![b'k'; 4 * 1024 * 1024],
            })),
            _ => Err(tonic::Status::unimplemented("not here")),
        }
    }
}

/// `keel revoke w-1` against a control plane answering as `answer`:
/// what the CLI printed, and the EKs the workspace records as revoked.
async fn revoke_worker(answer: Answer) -> (String, serde_json::Value) {
    let ca = EkCa::new().unwrap();
    let node = node_with(&ca, harness::control_plane_config(&no_secret_hash()));
    locked_into_the_workspace_cluster(&node);
    let served = Served::answering(&ca, &node, answer).await;
    let ws = &served.workspace;
    operator_workspace(ws, Some(&served.endpoint));
    let ws_arg = ws.to_str().unwrap();
    let args = [
        "revoke",
        "w-1",
        "--endpoint",
        &served.endpoint,
        "--workspace",
        ws_arg,
        "--wait",
        "5",
    ];
    let out = run_keel(&args, &served.settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    // Two challenges, the registry read and the revocation.
    assert_eq!(served.requests(), 4, "{}", text(&out));
    let record = std::fs::read_to_string(ws.join("keel-revoked.json")).unwrap();
    (text(&out), serde_json::from_str(&record).unwrap())
}

/// Attacker's move: a control plane compromised after it booted answers
/// `keel kubeconfig` with a message of megabytes, which the operator's
/// client (bound for a whole registry, 32 MiB) would take in whole before
/// checking it. The call is held to the kubeconfig's own bound as the
/// answer arrives; nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_kubeconfig_past_its_bound_is_refused_as_it_arrives() {
    let ca = EkCa::new().unwrap();
    let node = node_with(&ca, harness::control_plane_config(&no_secret_hash()));
    locked_into_the_workspace_cluster(&node);
    let served = Served::answering(&ca, &node, Answer::Hostile).await;
    let ws = &served.workspace;
    operator_workspace(ws, Some(&served.endpoint));
    let args = [
        "kubeconfig",
        "--endpoint",
        &served.endpoint,
        "--workspace",
        ws.to_str().unwrap(),
        "--wait",
        "5",
    ];
    let out = run_keel(&args, &served.settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("too large"), "{}", text(&out));
    assert!(
        !text(&out).contains("sent a kubeconfig of"),
        "{}",
        text(&out)
    );
    assert!(!ws.join("keel-admin.conf").exists());
}

/// Attacker's move: a control plane of the cluster, compromised after it
/// booted (attestation passes), answers `keel revoke` for a worker as done
/// but names another EK, so that the operator's record would hold an EK
/// nobody has and the worker's would stay out of it (`keel recover` would
/// then send it the master secret if it were a control plane). The CLI
/// records the EK it asked for, and reports the answer as a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_answered_for_another_ek_fails_and_records_the_ek_asked_for() {
    let (out, record) = revoke_worker(Answer::Hostile).await;
    assert!(
        out.contains(&format!(
            "reports revoking EK {OTHER_EK}, not the EK {WORKER_EK} asked for"
        )),
        "{out}"
    );
    assert_eq!(record["eks"], serde_json::json!([WORKER_EK]), "{record}");
}

/// Attacker's move: drop the revocation's answer (or the request after
/// the control plane acted on it), so that the operator does not know
/// whether the node was revoked. The CLI recorded the EK before it sent
/// the request: `keel recover` refuses the node whatever became of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_whose_answer_is_lost_is_recorded_all_the_same() {
    let (out, record) = revoke_worker(Answer::RevocationLost).await;
    assert!(out.contains("the revocation was lost"), "{out}");
    assert_eq!(record["eks"], serde_json::json!([WORKER_EK]), "{record}");
}

/// A hostile control plane of the cluster's image, locked into the
/// workspace's cluster if `locked`, whose EK the workspace (which
/// [`operator_workspace`] writes) records as revoked; with its EK CA, TPM
/// (which must outlive it) and EK.
async fn revoked_control_plane(
    locked: bool,
) -> (EkCa, Victim, Served, keel_verifier::ek::EkDigest) {
    let ca = EkCa::new().unwrap();
    let node = node_with(&ca, harness::control_plane_config(&no_secret_hash()));
    if locked {
        locked_into_the_workspace_cluster(&node);
    }
    let ek = {
        let mut tpm = node.tpm.lock().unwrap();
        let public = tpm.tpm().endorsement().unwrap().public;
        keel_verifier::ek::EkDigest::of_marshalled(&public)
    };
    let served = Served::answering(&ca, &node, Answer::Hostile).await;
    let ws = &served.workspace;
    operator_workspace(ws, Some(&served.endpoint));
    std::fs::write(
        ws.join("keel-revoked.json"),
        serde_json::json!({ "eks": [ek.to_string()] }).to_string(),
    )
    .unwrap();
    (ca, node, served, ek)
}

/// Attacker's move: a control plane the operator revoked (its TPM's key
/// leaked, say) was cut off when it happened and never heard of it; once
/// every control plane is down, the host routes `keel recover` to it. It
/// attests, outside any cluster, but the workspace recorded its EK when it
/// was revoked: the master secret is not sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_revoked_from_the_workspace_gets_no_master_secret() {
    let (_ca, _node, served, ek) = revoked_control_plane(false).await;
    let ws = &served.workspace;
    let out = run_keel(&recover_args(ws), &served.settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("the node's EK ({ek}) was revoked")),
        "{}",
        text(&out)
    );
    assert_eq!(served.requests(), 0, "the master secret was sent");
}

/// Attacker's move: a control plane the operator revoked, cut off when it
/// happened, is still locked into the cluster and attests its role; the
/// host routes the operator's `--endpoint` to it. It would answer `keel
/// status` with a registry of its own (every node trusted) and `keel
/// kubeconfig` with a kubeconfig of its choosing. The workspace recorded
/// its EK: no operator command asks it anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_revoked_from_the_workspace_is_asked_nothing() {
    let (_ca, _node, served, ek) = revoked_control_plane(true).await;
    let ws = &served.workspace;
    let ws_arg = ws.to_str().unwrap();
    for command in ["status", "kubeconfig"] {
        let args = [
            command,
            "--endpoint",
            &served.endpoint,
            "--workspace",
            ws_arg,
            "--wait",
            "5",
        ];
        let out = run_keel(&args, &served.settings, None).await;
        assert!(!out.status.success(), "{command}: {}", text(&out));
        assert!(
            text(&out).contains(&format!(
                "the node's EK ({ek}) was revoked from this workspace"
            )),
            "{command}: {}",
            text(&out)
        );
        assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
        assert!(!text(&out).contains("w-1"), "{command}: {}", text(&out));
    }
    assert_eq!(served.requests(), 0, "the revoked node was asked");
    assert!(!ws.join("keel-admin.conf").exists());
}

/// Attacker's move: a control plane of the cluster's image, compromised
/// after it booted (attestation passes), answers `keel init` as done, with
/// a cluster ID the secrets it was sent do not make and a kubeconfig of its
/// own. The CLI says so and keeps neither the kubeconfig nor the ID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_answered_with_another_cluster_id_keeps_nothing() {
    let (_ca, _node, served) = control_plane_answering(Answer::Misreport).await;
    let init = ["init", "--wait", "5"];
    let out = run_keel(&init, &served.settings, Some(&served.workspace)).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert_eq!(served.requests(), 1, "{}", text(&out));
    assert!(
        text(&out).contains(&format!("the node reports cluster ID {}", "55".repeat(32))),
        "{}",
        text(&out)
    );
    for kept in ["keel-admin.conf", "keel-id.json"] {
        assert!(!served.workspace.join(kept).exists(), "{kept} was written");
    }
}

/// Attacker's move: the host sends the operator's `keel init` or `keel
/// recover` to a worker of the cluster's image, outside any cluster, which
/// it has compromised (or to one booted for the purpose). Image, config
/// and PCR 15 all pass; its measured role does not, and neither the init
/// secret nor the master secret is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_gets_neither_the_init_secret_nor_the_master_secret() {
    let ca = EkCa::new().unwrap();
    let mut config = harness::control_plane_config(&no_secret_hash());
    config.node.role = keel_verifier::config::Role::Worker;
    let node = node_with(&ca, config);
    let served = Served::start(&ca, &node, Arc::new(TpmIssuer::new(node.tpm.clone()))).await;

    let init = ["init", "--wait", "5"];
    let (settings, ws) = (&served.settings, &served.workspace);
    sent_nothing(&init, settings, Some(ws), "not a control plane").await;

    operator_workspace(ws, None);
    sent_nothing(&recover_args(ws), settings, None, "not a control plane").await;
    assert_eq!(served.requests(), 0, "a request reached the worker");
}

/// An init whose result never arrives (the node may have finished): the
/// cluster ID its secrets make is recorded, so that the workspace's
/// operator commands reach the cluster, and the error says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_whose_result_is_lost_keeps_its_cluster_id() {
    for answer in [Answer::Silent, Answer::Ended, Answer::Mute] {
        init_result_lost(answer).await;
    }
}

async fn init_result_lost(answer: Answer) {
    let (_ca, _node, served) = control_plane_answering(answer).await;
    let init = ["init", "--wait", "5", "--timeout", "3"];
    let out = run_keel(&init, &served.settings, Some(&served.workspace)).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("is recorded in"), "{}", text(&out));
    // The way to the kubeconfig the lost result carried.
    assert!(
        text(&out).contains("`keel kubeconfig --endpoint "),
        "{}",
        text(&out)
    );
    let id: serde_json::Value =
        serde_json::from_slice(&std::fs::read(served.workspace.join("keel-id.json")).unwrap())
            .unwrap();
    let recorded = id["cluster_id"].as_str().unwrap().to_owned();
    assert!(text(&out).contains(&recorded), "{}", text(&out));
    assert_eq!(recorded.len(), 64);
    assert!(!served.workspace.join("keel-admin.conf").exists());
}

/// A node busy until `--timeout` runs out: asked again while there is
/// time to, and then `keel init` stops, saying the master secret it wrote
/// was never used (no request was read) and recording no cluster ID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_busy_until_the_timeout_took_no_request() {
    let (_ca, _node, served) = control_plane_answering(Answer::Busy).await;
    // Busy at once, and again 2 s later with 13 s left: too little to wait
    // 2 s more and leave the node 11 s to answer (it may keep a request
    // waiting for a place for 10 s).
    let init = ["init", "--wait", "5", "--timeout", "15"];
    let out = run_keel(&init, &served.settings, Some(&served.workspace)).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert_eq!(
        served.requests(),
        2,
        "asked once, then once again: {}",
        text(&out)
    );
    assert!(text(&out).contains("still busy"), "{}", text(&out));
    assert!(text(&out).contains("was never used"), "{}", text(&out));
    assert!(!served.workspace.join("keel-id.json").exists());
}

/// Attacker's move: a control plane of the cluster's image, compromised
/// after it booted (attestation passes), keeps `keel init` busy and its
/// memory growing: a failure, then far more logs than a node sends, then
/// silence with the stream open. The CLI keeps at most 1 MiB of the logs,
/// says what it dropped, and gives up at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_floods_and_stalls_init_is_bounded_in_bytes_and_time() {
    let (_ca, _node, served) = control_plane_answering(Answer::Hostile).await;

    let started = std::time::Instant::now();
    let init = ["init", "--wait", "5", "--timeout", "4"];
    let out = run_keel(&init, &served.settings, Some(&served.workspace)).await;
    let took = started.elapsed();
    assert!(!out.status.success(), "{}", text(&out));
    assert_eq!(served.requests(), 1, "{}", text(&out));
    assert!(
        text(&out).contains("init did not end within 4 s (--timeout)"),
        "{}",
        text(&out)
    );
    assert!(took < std::time::Duration::from_secs(60), "{took:?}");
    // It reported a failure: no cluster ID is recorded.
    assert!(!served.workspace.join("keel-id.json").exists());
    let logs = std::fs::read(served.workspace.join("keel-init-failure.log")).unwrap();
    let kept = logs.iter().filter(|b| **b == b'x').count();
    assert_eq!(kept, keel_proto::MAX_FAILURE_LOG_BYTES);
    let note = String::from_utf8_lossy(&logs[kept..]).into_owned();
    assert!(
        note.contains(&format!(
            "sent {} more bytes",
            FLOOD_CHUNKS * 64 * 1024 - keel_proto::MAX_FAILURE_LOG_BYTES
        )),
        "{note}"
    );
}

/// Attacker's move: keep one control plane from finishing an image
/// rollout (drop its request), so that the workspace goes on naming the
/// retired image while the others accept only the new one: `keel recover`
/// would then send the master secret to a node of the retired image, whose
/// own refusal comes only once it holds it. A finish that reached one
/// control plane records the new image in the workspace, and `keel
/// recover` with the retired image's settings sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_rollout_finished_on_one_control_plane_retires_the_old_image_in_the_workspace() {
    let (_ca, _nodes, finishes, fails) =
        two_control_planes(Answer::TakesImage, Answer::ImageLost).await;
    let (file, image) = signed_image(&finishes.settings);
    let out = run_keel(
        &finish_args(&file, &finishes, &fails),
        &finishes.settings,
        None,
    )
    .await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("1 of 2 control plane(s) did not finish the image upgrade"),
        "{}",
        text(&out)
    );
    let record = recorded_image(&finishes.workspace);
    assert_eq!(record["digest"], hex::encode(image.digest()), "{record}");
    assert_eq!(record["epoch"], 1, "{record}");
    the_retired_image_is_recovered_nowhere(&finishes).await;
}

/// As above, with the finish cut short (the operator's Ctrl-C, a crash)
/// while the second control plane takes its time: what the first one
/// finished is in the workspace as soon as it reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_rollout_cut_short_after_one_control_plane_retires_the_old_image_in_the_workspace()
{
    use tokio::io::AsyncBufReadExt as _;

    let (_ca, _nodes, finishes, mute) =
        two_control_planes(Answer::TakesImage, Answer::ImageMute).await;
    let (file, image) = signed_image(&finishes.settings);
    let mut keel = tokio::process::Command::from(harness::keel(
        &finish_args(&file, &finishes, &mute),
        &finishes.settings,
        None,
    ));
    let mut keel = keel
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(keel.stdout.take().unwrap()).lines();
    let finished = format!("{}: image upgrade finished", finishes.endpoint);
    let seen = tokio::time::timeout(std::time::Duration::from_secs(120), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.starts_with(&finished) {
                return true;
            }
        }
        false
    })
    .await
    .unwrap();
    assert!(seen, "the first control plane's finish was not reported");
    keel.kill().await.unwrap();
    let record = recorded_image(&finishes.workspace);
    assert_eq!(record["digest"], hex::encode(image.digest()), "{record}");
    assert_eq!(record["epoch"], 1, "{record}");
    the_retired_image_is_recovered_nowhere(&finishes).await;
}

/// Attacker's move, as for the finish above: keep one control plane from
/// taking a measurements push. A push taken by one control plane records
/// the pushed set in the workspace, and `keel recover` with the retired
/// image's settings sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_taken_by_one_control_plane_retires_the_old_set_in_the_workspace() {
    let (_ca, _nodes, takes, fails) =
        two_control_planes(Answer::TakesImage, Answer::ImageLost).await;
    let pushed = harness::measurements([9; 32], Expected::enforced([0; 32]));
    let file = takes.settings.with_file_name("pushed.json");
    std::fs::write(&file, format!("{}\n", pushed.to_json_with_epoch(1))).unwrap();
    let args = [
        "push-measurements",
        "--file",
        file.to_str().unwrap(),
        "--endpoint",
        &takes.endpoint,
        "--endpoint",
        &fails.endpoint,
        "--workspace",
        takes.workspace.to_str().unwrap(),
        "--wait",
        "5",
    ];
    let out = run_keel(&args, &takes.settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("1 of 2 control plane(s) did not replace their join measurements"),
        "{}",
        text(&out)
    );
    let record = recorded_image(&takes.workspace);
    assert_eq!(record["digest"], hex::encode(pushed.digest()), "{record}");
    assert_eq!(record["epoch"], 1, "{record}");
    the_retired_image_is_recovered_nowhere(&takes).await;
}

/// Two control planes of the [`operator_workspace`]'s cluster (in the
/// first one's workspace, which names it), answering as `first` and
/// `second` say, with their EK CA and TPMs, which must outlive them.
async fn two_control_planes(first: Answer, second: Answer) -> (EkCa, [Victim; 2], Served, Served) {
    let ca = EkCa::new().unwrap();
    let config = harness::control_plane_config(&no_secret_hash());
    let nodes = [node_with(&ca, config.clone()), node_with(&ca, config)];
    nodes.iter().for_each(locked_into_the_workspace_cluster);
    let first = Served::answering(&ca, &nodes[0], first).await;
    let second = Served::answering(&ca, &nodes[1], second).await;
    operator_workspace(&first.workspace, Some(&first.endpoint));
    (ca, nodes, first, second)
}

/// Makes the settings at `settings` name a measurements signing key, and
/// writes an image's measurements file (epoch 1) beside them, signed with
/// it: the file and its set.
fn signed_image(settings: &Path) -> (PathBuf, Measurements) {
    let signing = keel_verifier::signature::SigningPrivateKey::generate();
    let dir = settings.parent().unwrap();
    std::fs::write(
        dir.join("signing.pub.pem"),
        signing.public_key().to_pem().unwrap(),
    )
    .unwrap();
    let mut named: serde_json::Value =
        serde_json::from_slice(&std::fs::read(settings).unwrap()).unwrap();
    named["measurements_signing_key"] = "signing.pub.pem".into();
    std::fs::write(settings, named.to_string()).unwrap();
    let image = harness::measurements([9; 32], Expected::enforced([0; 32]));
    let body = format!("{}\n", image.to_json_with_epoch(1));
    let file = dir.join("image.json");
    std::fs::write(&file, &body).unwrap();
    std::fs::write(dir.join("image.json.sig"), signing.sign(body.as_bytes())).unwrap();
    (file, image)
}

/// `keel upgrade finish` of the image `file` on `first`, then `second`,
/// from the first one's workspace.
fn finish_args<'a>(file: &'a Path, first: &'a Served, second: &'a Served) -> [&'a str; 12] {
    [
        "upgrade",
        "finish",
        "--image-measurements",
        file.to_str().unwrap(),
        "--endpoint",
        &first.endpoint,
        "--endpoint",
        &second.endpoint,
        "--workspace",
        first.workspace.to_str().unwrap(),
        "--wait",
        "5",
    ]
}

/// The image record in the workspace `ws`.
fn recorded_image(ws: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(ws.join("keel-image.json")).unwrap()).unwrap()
}

/// `keel recover` with the settings of `served`, which still name the
/// retired image: refused, with nothing sent.
async fn the_retired_image_is_recovered_nowhere(served: &Served) {
    let before = served.requests();
    let out = run_keel(&recover_args(&served.workspace), &served.settings, None).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("are not an image this cluster accepts"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    assert_eq!(served.requests(), before, "{}", text(&out));
}
