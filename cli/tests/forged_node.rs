//! `keel init` and `keel verify` against a forged node: the real node's EK
//! certificate, PCRs and event log next to a software attestation key (the
//! security review's attack). The CLI must refuse it before the init secret,
//! the master secret or any request leaves the machine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::measured::{MeasuredTpm, SharedTpm};
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_atls::AtlsServer;
use keel_proto::init::init_service_server::{InitService, InitServiceServer};
use keel_proto::init::{InitRequest, InitResponse};
use keel_testkit::forgery::SoftwareAk;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::measurement::EventType;
use keel_verifier::measurements::{Expected, Measurements};
use tokio_stream::wrappers::ReceiverStream;

const SECRET: &[u8] = b"the init secret a forger wants";

/// The forger's init API: counts the requests that reach it.
#[derive(Default, Clone)]
struct Recorder(Arc<AtomicUsize>);

#[tonic::async_trait]
impl InitService for Recorder {
    type InitStream = ReceiverStream<Result<InitResponse, tonic::Status>>;

    async fn init(
        &self,
        _request: tonic::Request<InitRequest>,
    ) -> Result<tonic::Response<Self::InitStream>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(tonic::Status::unavailable("a forged node"))
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
    let swtpm = Swtpm::start(ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = NodeConfig::parse(
        br#"{"cluster":{"init_secret_hash":"sha256:0000000000000000000000000000000000000000000000000000000000000000"},"node":{"name":"cp-0","role":"control-plane"}}"#,
        "t".as_ref(),
    )
    .unwrap();
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let mut measured = MeasuredTpm::open(tpm, &dir.path().join("eventlog.jsonl")).unwrap();
    measured
        .record(EventType::NodeConfig, "config", config.cluster_bytes())
        .unwrap();
    measured
        .record(EventType::NodeIdentity, "node", config.node_bytes())
        .unwrap();
    Victim {
        tpm: measured.shared(),
        config,
        _swtpm: swtpm,
        _dir: dir,
    }
}

/// The CLI's settings for the node at `endpoint`, expecting the victim's
/// measurements.
fn settings(dir: &Path, ca: &EkCa, v: &Victim, endpoint: std::net::SocketAddr) -> PathBuf {
    let m = Measurements::new([
        (4, Expected::enforced([0; 32])),
        (9, Expected::enforced([0; 32])),
        (11, Expected::enforced([0; 32])),
        (12, Expected::enforced(v.config.expected_config_pcr())),
        (15, Expected::enforced([0; 32])),
    ])
    .unwrap();
    std::fs::write(dir.join("measurements.json"), m.to_json()).unwrap();
    std::fs::write(dir.join("ek-ca.pem"), ca.issuer_pem().unwrap()).unwrap();
    std::fs::write(dir.join("init-secret"), SECRET).unwrap();
    let settings = serde_json::json!({
        "endpoint": endpoint.to_string(),
        "kubernetes_version": "v1.31",
        "measurements": "measurements.json",
        "ek_ca": "ek-ca.pem",
        "init_secret_file": "init-secret",
    });
    let path = dir.join("keel.json");
    std::fs::write(&path, settings.to_string()).unwrap();
    path
}

async fn keel(args: &[&str], settings: &Path, extra: &[&Path]) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_keel"));
    cmd.args(args).arg("--settings").arg(settings);
    for (flag, path) in ["--workspace"].iter().zip(extra) {
        cmd.arg(flag).arg(path);
    }
    cmd.output().await.unwrap()
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_node_gets_no_init_secret_and_fails_verify() {
    let ca = EkCa::new().unwrap();
    let v = victim(&ca);
    let real = Arc::new(TpmIssuer::new(v.tpm.clone()));
    // Anyone who connects to a node gets a genuine document to copy from.
    let genuine = real.issue(&[0; 32], &[0; 32]).unwrap();
    let forger = Arc::new(SoftwareAk::new(&genuine, Some(real)).unwrap());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let recorder = Recorder::default();
    let incoming = AtlsServer::<()>::server_attested(forger.clone()).incoming(listener);
    let server = tokio::spawn({
        let recorder = recorder.clone();
        async move {
            let _ = tonic::transport::Server::builder()
                .add_service(InitServiceServer::new(recorder))
                .serve_with_incoming(incoming)
                .await;
        }
    });

    let dir = tempfile::tempdir().unwrap();
    let settings = settings(dir.path(), &ca, &v, addr);
    let ws = dir.path().join("workspace");
    let out = keel(&["init", "--wait", "5"], &settings, &[&ws]).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("key residency"), "{}", text(&out));
    assert!(text(&out).contains("nothing was sent"), "{}", text(&out));
    assert_eq!(
        recorder.0.load(Ordering::SeqCst),
        0,
        "a request reached the forger"
    );
    assert!(forger.challenges_received() >= 1);

    let out = keel(&["verify"], &settings, &[]).await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("key residency"), "{}", text(&out));
    server.abort();
}
