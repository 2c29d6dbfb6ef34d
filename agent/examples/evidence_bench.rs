//! Benchmark: the control plane's cost of one evidence check, and the
//! evidence traffic of one node.
//!
//! One swtpm-backed member locked into a cluster; the control plane's
//! evidence service (members' validator, registry on disk) in-process.
//! Prints the median time of one validation (EK certificate, quote,
//! replay, measurements, cluster lock, components), of one whole
//! submission (nonce check, validation, registry written to disk), the same
//! with the registry holding thousands of other nodes (a large cluster's
//! control plane), then, with half of those revoked, a merge of a peer's
//! registry and a sweep for silent nodes, and the encoded sizes of the
//! messages of one round.
//!
//! `cargo run --release -p keel-agent --example evidence_bench -- [rounds [other nodes]]`
//! (9,000 other nodes unless given)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::cluster::{ClusterSlot, ClusterState};
use keel_agent::disk_bindings::DiskBindings;
use keel_agent::evidence::admission::MemberPolicy;
use keel_agent::evidence::{user_data, EvidenceService};
use keel_agent::measured::MeasuredTpm;
use keel_agent::nodelock::NodeLock;
use keel_agent::registry::RegistryStore;
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_proto::evidence::{NextNonceResponse, SubmitEvidenceRequest, SubmitEvidenceResponse};
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::{EvidenceConfig, NodeConfig};
use keel_verifier::ek::EkTrust;
use keel_verifier::keys::{self, KeyService};
use keel_verifier::measurement::EventType;
use keel_verifier::measurements::{Expected, Measurements};
use prost::Message as _;

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(10);
    let others: u32 = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(9_000);
    let ca = EkCa::new().unwrap();
    let swtpm = Swtpm::start(&ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = NodeConfig::default();
    config.cluster.evidence = EvidenceConfig {
        interval_seconds: 1,
        ..EvidenceConfig::default()
    };
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let mut m = MeasuredTpm::open(tpm, &dir.path().join("log")).unwrap();
    m.record(EventType::NodeConfig, "config", config.cluster_bytes())
        .unwrap();
    m.record(EventType::NodeIdentity, "node", config.node_bytes())
        .unwrap();
    // The versions table's components, measured as a node measures them
    // (their record and a description of the same length).
    let entry = keel_installer::resolve("v1.31").unwrap();
    for c in entry.components() {
        let record = serde_json::json!({
            "url": c.url(),
            "hash": c.hash().to_string(),
            "install_path": c.install_path().as_str(),
            "extract": c.extract(),
        });
        let description = format!(
            "component {} {} from {}",
            c.install_path(),
            c.hash(),
            c.url()
        );
        m.record(
            EventType::Component,
            description,
            serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
    }
    let tpm = m.shared();

    let keys = KeyService::new(&[1; 32], &[2; 32]).unwrap();
    let secret = keys.measurement_secret().unwrap();
    let salt = vec![3; 32];
    let cluster_id = keys::cluster_id(&secret, &salt).unwrap();
    NodeLock::new(tpm.clone())
        .unwrap()
        .try_lock(cluster_id)
        .unwrap();
    let measurements = Measurements::new([
        (4, Expected::enforced([0; 32])),
        (9, Expected::enforced([0; 32])),
        (11, Expected::enforced([0; 32])),
        (12, Expected::enforced(config.expected_config_pcr())),
        (15, Expected::enforced([0; 32])),
    ])
    .unwrap();
    let state = ClusterState {
        keys: Arc::new(keys),
        measurement_salt: salt,
        measurement_secret: secret,
        cluster_id,
        kubernetes_version: entry.version(),
        components: entry.components().to_vec(),
        authorised_components: Vec::new(),
        api_server: "127.0.0.1:6443".parse().unwrap(),
        pki_dir: dir.path().join("pki"),
        join_measurements: measurements,
        staged_measurements: None,
        measurements_key: None,
        signed_measurements: Vec::new(),
        image_epoch: 0,
        control_plane_endpoints: Vec::new(),
    };
    let slot = ClusterSlot::new(Some(Arc::new(state)));
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let members = Arc::new(MemberPolicy::new(
        &slot,
        trust,
        config.expected_config_pcr(),
        Arc::default(),
    ));
    let registry = RegistryStore::shared(&dir.path().join("root")).unwrap();
    let service = EvidenceService::new(
        &slot,
        members.clone(),
        registry.clone(),
        Arc::new(DiskBindings::new(dir.path())),
        config.cluster.evidence,
        keel_agent::disk_bindings::EkDigest::from_hex(&"00".repeat(32)).unwrap(),
    );
    let issuer = TpmIssuer::new(tpm);

    // The handshake's claims, as aTLS would hand them to the service.
    let member = members.current().unwrap();
    let peer = member
        .validator
        .validate(
            &issuer.issue(&[9; 32], &[8; 32]).unwrap(),
            &[9; 32],
            &[8; 32],
        )
        .unwrap();

    let (disk, version) = ("0a1b2c3d-0000-4000-8000-00000000000a", "v1.31.13");
    let data = user_data(disk, version);
    let submit_rounds = || async {
        let mut submits = Vec::new();
        let mut last = None;
        for _ in 0..rounds {
            let nonce = service.next_nonce(&peer).await.unwrap();
            let request = SubmitEvidenceRequest {
                nonce: nonce.to_vec(),
                document: issuer.issue(&nonce, &data).unwrap(),
                disk_uuid: disk.into(),
                kubernetes_version: version.into(),
            };
            let t = Instant::now();
            let verdict = service.submit(&peer, request.clone()).await.unwrap();
            submits.push(t.elapsed());
            assert_eq!(verdict.as_str(), "trusted");
            last = Some(request);
        }
        (submits, last.unwrap())
    };
    let (mut submits, request) = submit_rounds().await;
    // A large cluster: `others` more nodes in the registry, then the same
    // submissions again.
    registry
        .update(|r| {
            for i in 0..others {
                let ek = keel_agent::disk_bindings::EkDigest::of_marshalled(&i.to_le_bytes());
                r.register(&ek, "", &format!("node-{i}"), "worker")?;
            }
            Ok(())
        })
        .unwrap();
    let (mut crowded, _) = submit_rounds().await;

    // Half of those revoked, then what a control plane does under the
    // registry's lock besides submissions: merging a peer's registry (here
    // its own, so nothing is new and nothing is written) and the sweep for
    // silent nodes (nobody is silent yet, so it only scans).
    let revoked = registry
        .update(|r| {
            let records: Vec<_> = r
                .nodes()
                .values()
                .take(others as usize / 2)
                .cloned()
                .collect();
            for record in &records {
                r.revoke(record, None, "bench")?;
            }
            Ok(records.len())
        })
        .unwrap();
    let peer = registry.snapshot();
    // The sweeping control plane's own EK: none of the records.
    let own = keel_verifier::ek::EkDigest::from_hex(&"0".repeat(64)).unwrap();
    let mut merges = Vec::new();
    let mut sweeps = Vec::new();
    for _ in 0..rounds {
        let theirs = peer.clone();
        let t = Instant::now();
        assert_eq!(registry.merge(theirs).unwrap(), 0);
        merges.push(t.elapsed());
        let t = Instant::now();
        let (marked, written) = registry.mark_silent(
            keel_agent::registry::now(),
            Duration::from_secs(3600),
            0,
            &own,
        );
        sweeps.push(t.elapsed());
        written.unwrap();
        assert!(marked.is_empty());
    }

    let mut validations = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let v = member
            .validator
            .validate(&request.document, &request.nonce, &data)
            .unwrap();
        keel_verifier::validator::check_cluster_lock(&v, &cluster_id).unwrap();
        validations.push(t.elapsed());
    }

    let nonce_response = NextNonceResponse {
        nonce: vec![0; 32],
        interval_seconds: 60,
    }
    .encoded_len();
    let submit_response = SubmitEvidenceResponse {
        verdict: "trusted".into(),
    }
    .encoded_len();
    let round = request.encoded_len() + nonce_response + submit_response;
    println!(
        "one validation (EK cert, quote, replay, measurements, cluster lock): {:.2} ms median of 200",
        median(&mut validations).as_secs_f64() * 1e3
    );
    println!(
        "one submission (nonce, keys, validation, components, registry written): {:.2} ms median of {rounds}",
        median(&mut submits).as_secs_f64() * 1e3
    );
    println!(
        "the same with {others} other nodes in the registry: {:.2} ms median of {rounds}",
        median(&mut crowded).as_secs_f64() * 1e3
    );
    println!(
        "with {revoked} of them revoked: merging a peer's registry {:.2} ms, the sweep for silent nodes {:.2} ms (medians of {rounds})",
        median(&mut merges).as_secs_f64() * 1e3,
        median(&mut sweeps).as_secs_f64() * 1e3
    );
    println!(
        "messages of one round: evidence {} B (document {} B), nonce {} B, verdict {} B; {} B in all",
        request.encoded_len(),
        request.document.len(),
        nonce_response,
        submit_response,
        round
    );
    println!(
        "per node and control plane per hour at 60 s: {:.0} KiB of messages",
        (round * 60) as f64 / 1024.0
    );
}
