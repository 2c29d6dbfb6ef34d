//! Continuous attestation on swtpm-backed nodes over real mutual aTLS: a
//! control plane (the production join port: join service, evidence service,
//! registry) and a worker that joined through it and sends evidence at a
//! short interval. A worker whose PCR 13 is extended without a log entry
//! is marked drifted with the PCR named, and stays so when it stops
//! reporting; a trusted one that stops is marked silent;
//! bad evidence is refused without a verdict; a revoked node (by the
//! operator, or by the `revoke` policy) gets no rejoin ticket and no disk
//! key, for its EK nor its disk. A member that reports another node's disk
//! is refused, and its revocation does not take that disk with it; during
//! an image rollout a member of the staged image keeps reporting.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use join_common::{
    config_for, free_port, joiner_with, stand_in_components, start_service_config, Joiner, Service,
};
use keel_agent::cluster::ClusterSlot;
use keel_agent::disk::Cryptsetup;
use keel_agent::disk_bindings::{DiskBindings, EkDigest};
use keel_agent::evidence::client::EvidenceClientError;
use keel_agent::evidence::client::Session;
use keel_agent::evidence::service::REGISTRY_GAP;
use keel_agent::evidence::{user_data, EvidenceClient};
use keel_agent::join::settings::SHARED_PCRS;
use keel_agent::join::{service_validator, JoinOutcome, KubeletKey, TicketError};
use keel_agent::node::EVIDENCE_REQUESTS_IN_FLIGHT;
use keel_agent::operator::{
    OperatorAuth, OperatorServer, NODE_STATUS, REVOKE_NODE, STAGE_IMAGE_MEASUREMENTS,
};
use keel_agent::registry::{Registry, RegistryStore, Verdict};
use keel_atls::ConnectError;
use keel_proto::evidence::NextNonceRequest;
use keel_proto::join::IssueJoinTicketRequest;
use keel_proto::operator::{NodeStatusRequest, RevokeNodeRequest, StageImageMeasurementsRequest};
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::{EvidencePolicy, NodeConfig};
use keel_verifier::ek::EkTrust;
use keel_verifier::signature::SigningPrivateKey;
use keel_verifier::validator::Validator;

const LIMIT: Duration = Duration::from_secs(120);
const INTERVAL_S: u32 = 2;
const INTERVAL: Duration = Duration::from_secs(INTERVAL_S as u64);

fn config(ca: &EkCa, ports: &[u16], name: &str, role: &str, policy: EvidencePolicy) -> NodeConfig {
    let mut config = config_for(ca, ports, name, role);
    config.cluster.evidence.interval_seconds = INTERVAL_S;
    config.cluster.evidence.policy = policy;
    config
}

/// A cluster: cp-0 (a plain join service, stopped once cp-1 serves), cp-1
/// serving the production join port, and a worker joined through cp-1.
struct Cluster {
    ca: EkCa,
    ports: [u16; 2],
    _cp0: Service,
    cp1: Joiner,
    cp1_slot: Arc<ClusterSlot>,
    _serving: tokio::task::JoinHandle<()>,
    worker: Joiner,
    policy: EvidencePolicy,
    _mirror: MirrorServer,
}

impl Cluster {
    async fn start(policy: EvidencePolicy) -> Self {
        Cluster::start_with_evidence_places(policy, EVIDENCE_REQUESTS_IN_FLIGHT).await
    }

    /// [`Cluster::start`], cp-1's join port holding `places` evidence
    /// requests at once.
    async fn start_with_evidence_places(policy: EvidencePolicy, places: usize) -> Self {
        let ca = EkCa::new().unwrap();
        // The CA's certificates exist once it manufactured a TPM.
        let cp1_tpm = Swtpm::start(&ca).unwrap();
        let ports = [free_port(), free_port()];
        let mirror = MirrorServer::start().unwrap();
        let mut cp0 = start_service_config(
            ports[0],
            config(&ca, &ports, "cp-0", "control-plane", policy),
            Swtpm::start(&ca).unwrap(),
            Some(stand_in_components(&mirror)),
            false,
        )
        .await;
        let cp1 = joiner_with(
            config(&ca, &ports, "cp-1", "control-plane", policy),
            cp1_tpm,
        );
        let cp1_slot = Arc::new(ClusterSlot::new(None));
        assert!(matches!(
            run_client(&cp1, &ca, &cp1_slot).await,
            JoinOutcome::Joined { .. }
        ));
        let serving = cp1
            .serve_join_with_evidence_places(ports[1], cp1_slot.clone(), places)
            .await;
        cp0.stop().await;
        let worker = joiner_with(
            config(&ca, &ports, "w-1", "worker", policy),
            Swtpm::start(&ca).unwrap(),
        );
        let none = Arc::new(ClusterSlot::new(None));
        assert!(matches!(
            run_client(&worker, &ca, &none).await,
            JoinOutcome::Joined { .. }
        ));
        Self {
            ca,
            ports,
            _cp0: cp0,
            cp1,
            cp1_slot,
            _serving: serving,
            worker,
            policy,
            _mirror: mirror,
        }
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.ports[1])
    }

    fn cluster_id(&self) -> [u8; 32] {
        self.cp1_slot.borrow().as_ref().unwrap().cluster_id
    }

    fn registry(&self) -> Arc<RegistryStore> {
        RegistryStore::shared(&self.cp1.root).unwrap()
    }

    fn worker_disk(&self) -> String {
        Cryptsetup::default().uuid(&self.worker.disk).unwrap()
    }

    /// The worker's evidence client toward cp-1.
    fn evidence_client(&self, node: &Joiner) -> EvidenceClient {
        let disk = Cryptsetup::default().uuid(&node.disk).unwrap_or_default();
        self.evidence_client_reporting(node, disk)
    }

    /// `node`'s evidence client toward cp-1, reporting the disk `disk`.
    fn evidence_client_reporting(&self, node: &Joiner, disk: String) -> EvidenceClient {
        let trust = EkTrust::from_pem(&self.ca.issuer_pem().unwrap()).unwrap();
        EvidenceClient::new(
            node.tpm.clone(),
            service_validator(&node.tpm, trust, None).unwrap(),
            node.root.clone(),
            disk,
            Duration::from_millis(200),
        )
    }

    async fn session(&self, node: &Joiner) -> Session {
        self.evidence_client(node)
            .connect(&self.endpoint(), &self.cluster_id())
            .await
            .unwrap()
    }

    /// Starts the worker's evidence loop toward cp-1 and waits until cp-1
    /// trusts it.
    async fn worker_trusted(&self) -> tokio::task::JoinHandle<()> {
        let evidence = tokio::spawn(
            self.evidence_client(&self.worker)
                .run(self.endpoint(), self.cluster_id()),
        );
        self.wait_for("trusted", LIMIT, |r| {
            Cluster::worker_record(r).is_some_and(|w| w.verdict == Verdict::Trusted)
        })
        .await;
        evidence
    }

    /// Waits until cp-1's record of the worker satisfies `done`.
    async fn wait_for(&self, what: &str, limit: Duration, done: impl Fn(&Registry) -> bool) {
        let start = Instant::now();
        while !done(&self.registry().snapshot()) {
            assert!(
                start.elapsed() < limit,
                "{what}: not within {limit:?}: {:#?}",
                self.registry().snapshot()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn worker_record(registry: &Registry) -> Option<&keel_agent::registry::NodeRecord> {
        registry.nodes().values().find(|r| r.name == "w-1")
    }

    /// A new node `name` of `role` that joined through cp-1, and the
    /// cluster slot its join filled.
    async fn joined(&self, name: &str, role: &str) -> (Joiner, Arc<ClusterSlot>) {
        let node = joiner_with(
            config(&self.ca, &self.ports, name, role, self.policy),
            Swtpm::start(&self.ca).unwrap(),
        );
        let slot = Arc::new(ClusterSlot::new(None));
        assert!(matches!(
            run_client(&node, &self.ca, &slot).await,
            JoinOutcome::Joined { .. }
        ));
        (node, slot)
    }

    /// Merges into cp-1's registry a peer's record of the worker drifted
    /// for `failure` (resting on the peer's clock alone: `on_clock`);
    /// returns the worker's EK.
    fn merge_a_peers_drift_of_the_worker(&self, failure: &str, on_clock: bool) -> EkDigest {
        let ek = join_common::ek_digest(&self.worker.tpm);
        let mut peer = Registry::default();
        peer.record(&keel_agent::registry::Evidence {
            ek,
            disk: None,
            name: "w-1".into(),
            role: "worker".into(),
            kubernetes_version: "v1.31.13".into(),
            measurements: "00".repeat(32),
            failure: Some(failure.into()),
            failure_on_clock: on_clock,
        })
        .unwrap();
        self.registry().merge(peer).unwrap();
        ek
    }

    /// Asserts that cp-1 holds the worker drifted and has revoked no one.
    fn assert_the_worker_drifted_and_nobody_revoked(&self) {
        let registry = self.registry().snapshot();
        assert!(
            registry.revoked().is_empty(),
            "revoked: {:?}",
            registry.revoked()
        );
        assert_eq!(
            Cluster::worker_record(&registry).map(|r| r.verdict),
            Some(Verdict::Drifted)
        );
    }

    /// `keel revoke <selector>` at cp-1.
    fn revoke(
        &self,
        selector: &str,
    ) -> Result<keel_agent::registry::Revocation, keel_agent::operator::OperatorError> {
        let (op, challenge, proof) = self.operator(REVOKE_NODE, selector.as_bytes());
        op.revoke_node(
            &RevokeNodeRequest {
                node: selector.into(),
                challenge,
                proof,
            },
            None,
        )
    }

    /// cp-1's operator API, and a proof for `kind` over `body` on a fresh
    /// challenge.
    fn operator(&self, kind: &str, body: &[u8]) -> (OperatorServer, Vec<u8>, Vec<u8>) {
        let own_ek = join_common::ek_digest(&self.cp1.tpm);
        let server = OperatorServer::new(
            OperatorAuth::new(own_ek, self.cp1_slot.clone(), Arc::default()),
            self.cp1_slot.clone(),
            Some(self.cp1.work.join("join-measurements.json")),
            self.cp1.root.clone(),
            None,
        )
        .with_disk_bindings(Arc::new(DiskBindings::new(&self.cp1.root)));
        let challenge = server.challenge().to_vec();
        let key = self
            .cp1_slot
            .borrow()
            .as_ref()
            .unwrap()
            .keys
            .operator_key(&own_ek)
            .unwrap();
        let proof = key.prove(kind, &challenge, body).to_vec();
        (server, challenge, proof)
    }
}

async fn run_client(node: &Joiner, ca: &EkCa, slot: &Arc<ClusterSlot>) -> JoinOutcome {
    let client = node.client(ca).with_cluster_slot(slot.clone());
    tokio::time::timeout(LIMIT, client.run())
        .await
        .expect("the join client did not finish")
}

/// `node` asks `endpoint` for the rejoin ticket of `disk` and is refused
/// as revoked.
async fn assert_rejoin_revoked(ca: &EkCa, endpoint: &str, node: &Joiner, disk: &str) {
    let result = node.tickets(ca).rejoin_ticket(endpoint, disk).await;
    match result.map(|_| ()) {
        Err(TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
            assert!(status.message().contains("revoked"), "{status:?}");
        }
        other => panic!("not refused as revoked: {other:?}"),
    }
}

/// Extends PCR 13 of `node` without an event-log entry.
fn tamper(node: &Joiner) {
    node.tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(13, &[0x66; 32])
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drift_silence_bad_evidence_and_operator_revocation() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    // The ticket registered the worker.
    let registered = Cluster::worker_record(&c.registry().snapshot())
        .cloned()
        .expect("the worker was not registered with its ticket");
    assert_eq!(registered.verdict, Verdict::Registered);
    assert_eq!(registered.disk_uuid, c.worker_disk());

    let evidence = c.worker_trusted().await;
    let trusted = Cluster::worker_record(&c.registry().snapshot())
        .cloned()
        .unwrap();
    assert_eq!(trusted.measurements.len(), 64);
    assert!(trusted.last_evidence_at.is_some());
    // A member that is not a control plane does not read the registry.
    let mut ws = c.session(&c.worker).await;
    let err = ws
        .client()
        .registry(keel_proto::evidence::RegistryRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    // An unlogged extend of PCR 13: drifted within two intervals, PCR named.
    tamper(&c.worker);
    let tampered = Instant::now();
    c.wait_for("drifted", INTERVAL * 2 + Duration::from_secs(1), |r| {
        Cluster::worker_record(r).is_some_and(|w| w.verdict == Verdict::Drifted)
    })
    .await;
    println!("drift noticed after {:?}", tampered.elapsed());
    let drifted = Cluster::worker_record(&c.registry().snapshot())
        .cloned()
        .unwrap();
    let reason = drifted.reason.unwrap();
    assert!(reason.contains("PCR 13"), "{reason}");
    // The `log` policy revokes nothing.
    assert!(c.registry().snapshot().revoked().is_empty());
    // It stops reporting: past the three intervals that make a trusted
    // node silent, it stays drifted, the PCR still named (a silence would
    // restart the drift's hold under its own conditions).
    evidence.abort();
    let _ = evidence.await;
    tokio::time::sleep(INTERVAL * 5).await;
    let quiet = Cluster::worker_record(&c.registry().snapshot())
        .cloned()
        .unwrap();
    assert_eq!(quiet.verdict, Verdict::Drifted, "{quiet:?}");
    assert!(quiet
        .reason
        .as_deref()
        .unwrap_or_default()
        .contains("PCR 13"));
    // Bad evidence, over a member's own connection (cp-1 is a member too).
    let mut s = c.session(&c.cp1).await;
    let nonce = s.next_nonce().await.unwrap();
    // A nonce the control plane did not issue.
    let mut req = s.evidence(vec![7; 32]).await.unwrap();
    let err = s.client().submit(req.clone()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("nonce"), "{err:?}");
    // Evidence from another TPM (the worker's) for this connection's nonce.
    let foreign = keel_agent::attestation::issuer::TpmIssuer::new(c.worker.tpm.clone())
        .issue(&nonce, &user_data(&req.disk_uuid, &req.kubernetes_version))
        .unwrap();
    req.nonce = nonce.clone();
    req.document = foreign;
    let err = s.client().submit(req.clone()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("TPM key"), "{err:?}");
    // Oversized evidence.
    req.document = vec![0; keel_verifier::validator::MAX_DOCUMENT_BYTES + 1];
    let err = s.client().submit(req.clone()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    // Fields that are no disk UUID or Kubernetes version: the user data
    // separates the two by a NUL, so ("a\0b", "c") and ("a", "b\0c") would
    // bind one document to two claims.
    for (disk, version) in [("a\0b", "c"), ("", "v1.31.13\0"), ("not-a-uuid", "")] {
        req.disk_uuid = disk.into();
        req.kubernetes_version = version.into();
        req.document = keel_agent::attestation::issuer::TpmIssuer::new(c.cp1.tpm.clone())
            .issue(&nonce, &user_data(disk, version))
            .unwrap();
        let err = s.client().submit(req.clone()).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("malformed"), "{err:?}");
    }
    // A flood: the same valid evidence 16 times at once, and a second
    // nonce request while one waits.
    let nonce = s.next_nonce().await.unwrap();
    let good = s.evidence(nonce).await.unwrap();
    let mut floods = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (mut client, good) = (s.client().clone(), good.clone());
        floods.spawn(async move { client.submit(good).await.map(|_| ()) });
    }
    let mut accepted = 0;
    while let Some(done) = floods.join_next().await {
        if done.unwrap().is_ok() {
            accepted += 1;
        }
    }
    assert_eq!(accepted, 1, "one evidence per nonce");
    let mut waiting = s.client().clone();
    let first = tokio::spawn(async move { waiting.next_nonce(NextNonceRequest {}).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let err = s
        .client()
        .next_nonce(NextNonceRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(first.await.unwrap().is_ok());
    // The operator: status lists the worker; revoke of an unknown node is
    // a clear error; revoke by disk UUID puts its EK and disk on the list.
    let (op, challenge, proof) = c.operator(NODE_STATUS, b"");
    let status = op
        .node_status(&NodeStatusRequest { challenge, proof }, None)
        .unwrap();
    let status = Registry::parse(&status).unwrap();
    assert!(Cluster::worker_record(&status).is_some());
    let err = c.revoke("keel-nobody").unwrap_err();
    assert_eq!(tonic::Status::from(&err).code(), tonic::Code::NotFound);
    assert!(err.to_string().contains("keel-nobody"), "{err}");
    // A proof for another node does not revoke this one.
    let disk = c.worker_disk();
    let (op, challenge, proof) = c.operator(REVOKE_NODE, b"w-1");
    let err = op
        .revoke_node(
            &RevokeNodeRequest {
                node: disk.clone(),
                challenge,
                proof,
            },
            None,
        )
        .unwrap_err();
    assert_eq!(
        tonic::Status::from(&err).code(),
        tonic::Code::PermissionDenied
    );
    // A control plane that is down while the node is revoked: it joined
    // before and has exchanged no registry since.
    let (cp3, _) = c.joined("cp-3", "control-plane").await;
    let cp3_registry = RegistryStore::shared(&cp3.root).unwrap();
    assert!(cp3_registry.snapshot().revoked().is_empty());
    let revoked = c.revoke(&disk).unwrap();
    assert_eq!(revoked.name, "w-1");
    // Another control plane takes the list over the evidence connection
    // (cp-1's own session stands in for it): the revocation arrives once.
    let elsewhere = tempfile::tempdir().unwrap();
    let other_cp = RegistryStore::shared(elsewhere.path()).unwrap();
    let mut s = c.session(&c.cp1).await;
    let stands = Duration::from_secs(60);
    assert_eq!(s.merge_registry(&other_cp, stands).await.unwrap(), 1);
    let again = Instant::now();
    assert_eq!(s.merge_registry(&other_cp, stands).await.unwrap(), 0);
    assert_eq!(other_cp.snapshot().revoked()[0].ek, revoked.ek);
    // Attacker's move (a compromised control plane, not yet revoked): pile
    // up registry requests, each a copy and an encoding of the whole
    // registry. One is in flight at a time, each at least REGISTRY_GAP
    // after the last: the second above waited; one sent while another
    // waits is refused. (The gap counts from the start of the last
    // request, a little before its answer came back here.)
    assert!(again.elapsed() >= REGISTRY_GAP / 2, "{:?}", again.elapsed());
    let mut s2 = c.session(&c.cp1).await;
    let (first, second) = tokio::join!(s.merge_registry(&other_cp, stands), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s2.merge_registry(&other_cp, stands).await
    });
    assert_eq!(first.unwrap(), 0);
    match second {
        Err(EvidenceClientError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        }
        other => panic!("a second registry request in flight: {other:?}"),
    }
    // A control plane that revoked cp-1 takes nothing from its registry
    // (a compromised control plane, once revoked, can no longer fill the
    // others' lists or re-date their nodes), nor counts it as heard.
    let revoking = tempfile::tempdir().unwrap();
    let revoking = RegistryStore::shared(revoking.path()).unwrap();
    let cp1_ek = join_common::ek_digest(&c.cp1.tpm);
    revoking
        .update(|r| {
            r.register(&cp1_ek, "", "cp-1", "control-plane")?;
            let record = r.find(&cp1_ek.to_string())?.clone();
            r.revoke(&record, None, "test: compromised")
        })
        .unwrap();
    assert!(matches!(
        s.merge_registry(&revoking, stands).await,
        Err(EvidenceClientError::PeerRevoked)
    ));
    assert_eq!(revoking.snapshot().revoked().len(), 1);
    assert!(revoking.snapshot().find(&revoked.ek).is_err());
    assert_eq!(revoking.merged_at(), None);
    // The revoked worker reboots: no rejoin ticket, so no disk key.
    let endpoint = c.endpoint();
    let worker = c.worker.reboot(&c.ca);
    assert_rejoin_revoked(&c.ca, &endpoint, &worker, &disk).await;
    // Another TPM asking for the revoked disk gets no key either: the disk
    // is bound to the worker's EK (and a key for another EK would not open
    // it).
    let other = joiner_with(
        config(&c.ca, &c.ports, "w-2", "worker", c.policy),
        Swtpm::start(&c.ca).unwrap(),
    );
    match other.tickets(&c.ca).rejoin_ticket(&endpoint, &disk).await {
        Err(TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
            assert!(status.message().contains("not bound"), "{status:?}");
        }
        other => panic!("not refused as not bound: {:?}", other.map(|_| ())),
    }
    // A control plane that joins after the revocation enforces it from its
    // first ticket on: its ticket carried the issuer's registry, before it
    // exchanged one with anyone.
    // (`c.joined` cannot serve here: the worker was moved out of `c`.)
    let cp2 = joiner_with(
        config(&c.ca, &c.ports, "cp-2", "control-plane", c.policy),
        Swtpm::start(&c.ca).unwrap(),
    );
    let cp2_slot = Arc::new(ClusterSlot::new(None));
    assert!(matches!(
        run_client(&cp2, &c.ca, &cp2_slot).await,
        JoinOutcome::Joined { .. }
    ));
    let taken = RegistryStore::shared(&cp2.root).unwrap().snapshot();
    assert_eq!(taken.revoked().len(), 1);
    assert_eq!(taken.revoked()[0].ek, revoked.ek);
    // And the issuer's node records: the revoked worker's, cp-2's own.
    assert!(taken.nodes().contains_key(&revoked.ek), "{taken:?}");
    assert!(
        taken.nodes().values().any(|r| r.name == "cp-2"),
        "{taken:?}"
    );
    let cp2_port = free_port();
    let _cp2_serving = cp2.serve_join(cp2_port, cp2_slot).await;
    assert_rejoin_revoked(&c.ca, &format!("127.0.0.1:{cp2_port}"), &worker, &disk).await;
    // The control plane that was down comes back: its rejoin ticket
    // carries the list too.
    let cp3 = cp3.reboot(&c.ca);
    assert!(matches!(
        run_client(&cp3, &c.ca, &Arc::new(ClusterSlot::new(None))).await,
        JoinOutcome::Rejoined { .. }
    ));
    assert_eq!(cp3_registry.snapshot().revoked().len(), 1);
    assert_eq!(cp3_registry.snapshot().revoked()[0].ek, revoked.ek);
    // The list survives a restart of the registry (it is on the state disk).
    let path = RegistryStore::shared(&c.cp1.root)
        .unwrap()
        .path()
        .to_owned();
    let stored = Registry::on_disk(&path).unwrap();
    assert_eq!(stored.revoked().len(), 1);
    assert_eq!(stored.revoked()[0].disk_uuid, disk);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_revoke_policy_refuses_a_drifted_node_after_a_tpm_reset() {
    let c = Cluster::start(EvidencePolicy::Revoke).await;
    let evidence = c.worker_trusted().await;
    assert!(c.registry().snapshot().revoked().is_empty());
    tamper(&c.worker);
    c.wait_for("revoked", INTERVAL * 4 + Duration::from_secs(1), |r| {
        !r.revoked().is_empty()
    })
    .await;
    evidence.abort();
    let revocation = c.registry().snapshot().revoked()[0].clone();
    assert_eq!(revocation.name, "w-1");
    assert!(
        revocation.reason.contains("PCR 13"),
        "{}",
        revocation.reason
    );

    // The TPM resets (reboot): PCR 13 replays again, but the node is revoked.
    let (disk, endpoint) = (c.worker_disk(), c.endpoint());
    let worker = c.worker.reboot(&c.ca);
    assert_rejoin_revoked(&c.ca, &endpoint, &worker, &disk).await;
}

/// A cut-off control plane under the `revoke` policy: from where it stands
/// every other node falls silent at once, and its revocations would reach
/// every control plane. One that hears no member other than itself (here
/// cp-1, whose own evidence loop keeps reporting to it, while the worker
/// stops) marks the worker silent but revokes nobody for silence
/// (`evidence::hearing`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_control_plane_hearing_no_other_member_revokes_nobody_for_silence() {
    let c = Cluster::start(EvidencePolicy::Revoke).await;
    let own = tokio::spawn(c.evidence_client(&c.cp1).run(c.endpoint(), c.cluster_id()));
    let worker = c.worker_trusted().await;
    worker.abort();
    let _ = worker.await;
    c.wait_for("silent", INTERVAL * 6, |r| {
        Cluster::worker_record(r).is_some_and(|w| w.verdict == Verdict::Silent)
    })
    .await;
    // Past the interval after which a silent node heard by a connected
    // control plane would be revoked.
    tokio::time::sleep(INTERVAL * 3).await;
    let registry = c.registry().snapshot();
    assert!(
        registry.revoked().is_empty(),
        "revoked while hearing no other member: {:?}",
        registry.revoked()
    );
    assert_eq!(
        Cluster::worker_record(&registry).map(|w| w.verdict),
        Some(Verdict::Silent)
    );
    own.abort();
}

/// A node another control plane found drifted, whose revocation there
/// never reached the disk (its write failed, or that control plane
/// restarted in between): the merged verdict is newer than this control
/// plane's record, and its sweep revokes the node, not only nodes it
/// judged itself. (So does a node marked here whose revocation failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_revoke_policy_revokes_a_failing_node_it_did_not_judge_itself() {
    let c = Cluster::start(EvidencePolicy::Revoke).await;
    let ek = c.merge_a_peers_drift_of_the_worker("PCR 4: expected another value", false);
    let merged = c.registry().snapshot();
    assert_eq!(
        Cluster::worker_record(&merged).map(|r| r.verdict),
        Some(Verdict::Drifted)
    );
    assert!(merged.revoked().is_empty());
    c.wait_for("revoked", INTERVAL * 4 + Duration::from_secs(1), |r| {
        r.revoked().iter().any(|v| v.ek == ek.to_string())
    })
    .await;
    let revocation = c.registry().snapshot().revoked()[0].clone();
    assert!(revocation.reason.contains("PCR 4"), "{}", revocation.reason);
}

/// Attacker's move (root on a member): run authorised bytes as another
/// binary than the one they were authorised as, say a CNI plugin's as the
/// kubelet, measured as a component event with that hash at a path its
/// version does not list. The hash alone would pass; the control plane
/// holds it to the component's own path, and the member drifts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_component_measured_at_a_path_its_version_does_not_list_drifts() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let _evidence = c.worker_trusted().await;
    let state = c.cp1_slot.borrow().clone().unwrap();
    let authorised = &state.components[0];
    let moved = keel_installer::Component::new(
        authorised.url(),
        &authorised.hash().to_string(),
        "/opt/cni/bin/moved",
        authorised.extract(),
    )
    .unwrap();
    c.worker
        .tpm
        .lock()
        .unwrap()
        .record(
            keel_verifier::measurement::EventType::Component,
            moved.description(),
            moved.measurement_record(),
        )
        .unwrap();
    c.wait_for("drifted", INTERVAL * 3 + Duration::from_secs(1), |r| {
        Cluster::worker_record(r).is_some_and(|w| w.verdict == Verdict::Drifted)
    })
    .await;
    let reason = Cluster::worker_record(&c.registry().snapshot())
        .and_then(|w| w.reason.clone())
        .unwrap();
    assert!(
        reason.contains("PCR 13") && reason.contains("/opt/cni/bin/moved"),
        "{reason}"
    );
}

/// Attacker's move: the host of one control plane sets its clock past the
/// end of a member's EK or CPU certificate, or past its revocation list's
/// next update, so that the member's evidence fails there for the time
/// alone and the `revoke` policy revokes it for good, on every control
/// plane. A drift that rests on the clock (the rest of the evidence held)
/// is left to the operator: here a peer's, merged, stays unrevoked past
/// the sweep that revokes the same drift for a PCR
/// (`the_revoke_policy_revokes_a_failing_node_it_did_not_judge_itself`).
/// It does not keep the node from falling silent: the worker sends cp-1
/// no evidence here, and a member that stopped reporting after such a
/// drift must not keep its keys for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_revoke_policy_leaves_a_drift_on_the_clock_to_the_operator() {
    let c = Cluster::start(EvidencePolicy::Revoke).await;
    c.merge_a_peers_drift_of_the_worker(
        "endorsement key not trusted: EK certificate is not valid at this time",
        true,
    );
    let merged = c.registry().snapshot();
    let record = Cluster::worker_record(&merged).unwrap();
    assert_eq!(record.verdict, Verdict::Drifted);
    assert!(record.on_clock);
    // Past the sweep that would revoke a node drifted for an interval
    // (and short of the three intervals that make the worker silent).
    tokio::time::sleep(INTERVAL * 2 + Duration::from_millis(500)).await;
    c.assert_the_worker_drifted_and_nobody_revoked();
    c.wait_for("silent", INTERVAL * 3, |r| {
        Cluster::worker_record(r).is_some_and(|w| w.verdict == Verdict::Silent && !w.on_clock)
    })
    .await;
}

/// One control plane with stale CPU collateral, a wrong measurements file
/// or a broken view finds most nodes failing at once, and under the
/// `revoke` policy its revocations would reach every control plane. When
/// more than half of the unrevoked nodes fail together (here three of
/// three, merged from a peer), the policy revokes none of them; one
/// failing node alone is still revoked
/// (`the_revoke_policy_revokes_a_failing_node_it_did_not_judge_itself`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_revoke_policy_revokes_nobody_when_most_nodes_fail_at_once() {
    let c = Cluster::start(EvidencePolicy::Revoke).await;
    c.registry()
        .merge(c.a_tcb_fault_at_every_worker(true))
        .unwrap();
    // Past the sweep that would revoke a node drifted for an interval
    // (and short of the three intervals that make the worker silent).
    tokio::time::sleep(INTERVAL * 2 + Duration::from_millis(500)).await;
    c.assert_the_worker_drifted_and_nobody_revoked();
}

/// Once the fault clears, the nodes clear one by one at their next
/// reports; the last ones, drifted while too many were, are not revoked
/// then: they were left to the operator, and stay so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_revoke_policy_revokes_nobody_as_a_mass_failure_clears() {
    let c = Cluster::start(EvidencePolicy::Revoke).await;
    c.registry()
        .merge(c.a_tcb_fault_at_every_worker(true))
        .unwrap();
    tokio::time::sleep(INTERVAL * 2 + Duration::from_millis(500)).await;
    c.assert_the_worker_drifted_and_nobody_revoked();
    // Two of the three report again, trusted: the worker is drifted alone.
    c.registry()
        .merge(c.a_tcb_fault_at_every_worker(false))
        .unwrap();
    tokio::time::sleep(INTERVAL * 2 + Duration::from_millis(500)).await;
    c.assert_the_worker_drifted_and_nobody_revoked();
}

impl Cluster {
    /// A peer's registry in which the worker and two more workers report
    /// a TCB below the minimum (`all`), or only the worker does and the
    /// two others report later, trusted.
    fn a_tcb_fault_at_every_worker(&self, all: bool) -> Registry {
        let mut peer = Registry::default();
        let worker = join_common::ek_digest(&self.worker.tpm);
        let others = ["ab", "cd"].map(|b| EkDigest::from_hex(&b.repeat(32)).unwrap());
        for (n, ek) in [worker].iter().chain(&others).enumerate() {
            let failing = all || n == 0;
            peer.record(&keel_agent::registry::Evidence {
                ek: *ek,
                disk: None,
                name: format!("w-{}", n + 1),
                role: "worker".into(),
                kubernetes_version: "v1.31.13".into(),
                measurements: "00".repeat(32),
                failure: failing
                    .then(|| "CPU evidence rejected: the reported TCB is below the minimum".into()),
                failure_on_clock: false,
            })
            .unwrap();
        }
        peer
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_reporting_another_nodes_disk_is_refused_and_its_revocation_spares_that_disk() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    // The victim: the worker, whose disk its ticket from cp-1 bound to its
    // EK. The attacker: another member (cp-1's own TPM stands in for it).
    let victim_disk = c.worker_disk();
    let attacker_ek = join_common::ek_digest(&c.cp1.tpm);
    let attacker_key = attacker_ek.to_string();
    // cp-1 holds a record of its own from its ticket (cp-0's registry,
    // with the disk cp-0 bound): no evidence yet, its own disk.
    let before = c.registry().snapshot().nodes().get(&attacker_key).cloned();
    assert!(
        before.as_ref().is_some_and(|r| r.last_evidence_at.is_none()
            && !r.disk_uuid.is_empty()
            && r.disk_uuid != victim_disk),
        "{before:?}"
    );

    // Valid evidence (its quote binds the UUID it reports) naming the
    // victim's disk: refused, and nothing recorded for the attacker.
    let mut forged = c
        .evidence_client_reporting(&c.cp1, victim_disk.clone())
        .connect(&c.endpoint(), &c.cluster_id())
        .await
        .unwrap();
    match forged.round().await {
        Err(EvidenceClientError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
            assert!(status.message().contains("not bound"), "{status:?}");
        }
        other => panic!("evidence naming another node's disk: {other:?}"),
    }
    assert_eq!(
        c.registry().snapshot().nodes().get(&attacker_key).cloned(),
        before
    );

    // Its evidence naming its own disk (bound by cp-0, and here by cp-1
    // itself when its join service started): trusted, and the disk
    // recorded for it still the one cp-0 bound.
    let mut own = c.session(&c.cp1).await;
    assert_eq!(own.round().await.unwrap(), "trusted");
    let record = c.registry().snapshot().nodes()[&attacker_key].clone();
    assert_eq!(record.verdict, Verdict::Trusted);
    assert_eq!(
        Some(&record.disk_uuid),
        before.as_ref().map(|r| &r.disk_uuid),
        "{record:?}"
    );

    // However a record came to name the victim's disk (here: a ticket's
    // UUID taken on its word), revoking the attacker names its EK alone.
    c.registry()
        .update(|r| r.register(&attacker_ek, &victim_disk, "cp-1", "control-plane"))
        .unwrap();
    let revoked = c.revoke(&attacker_key).unwrap();
    assert_eq!(revoked.ek, attacker_key);
    assert_eq!(revoked.disk_uuid, "", "the victim's disk was revoked");
    let registry = c.registry().snapshot();
    assert!(registry.revocation(&attacker_ek).is_some());
    let victim_ek = join_common::ek_digest(&c.worker.tpm);
    assert!(registry.revocation(&victim_ek).is_none());

    // The victim still reports: its evidence would be refused if a
    // revocation covered it. (cp-1's own EK stands in for the attacker
    // here, so cp-1 now counts itself revoked and issues no ticket to
    // anyone; what a rejoin ticket checks of the victim, its EK and its
    // disk's binding to that EK, no revocation names, as asserted above.)
    let mut victim = c.session(&c.worker).await;
    assert_eq!(victim.round().await.unwrap(), "trusted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_of_the_staged_image_reports_during_an_image_rollout() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let signing = SigningPrivateKey::generate();
    let state = c.cp1_slot.borrow().clone().unwrap();
    c.cp1_slot
        .send_replace(Some(Arc::new(keel_agent::cluster::ClusterState {
            measurements_key: Some(signing.public_key()),
            ..(*state).clone()
        })));
    // The worker rejoined on a new image: its UKI (PCR 4) differs.
    c.worker
        .tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(4, &[0x4e; 32])
        .unwrap();
    // The worker accepts cp-1 by cp-1's own PCRs: what this test checks is
    // cp-1's side (a node of another image accepts it by the signed file it
    // presents, `image_upgrade.rs`).
    let trust = EkTrust::from_pem(&c.ca.issuer_pem().unwrap()).unwrap();
    let cp1_pcrs = join_common::measurements_of(&c.cp1.tpm, &SHARED_PCRS);
    let connect = || async {
        EvidenceClient::new(
            c.worker.tpm.clone(),
            Validator::new(cp1_pcrs.clone(), trust.clone()),
            c.worker.root.clone(),
            c.worker_disk(),
            Duration::from_millis(200),
        )
        .connect(&c.endpoint(), &c.cluster_id())
        .await
    };
    let refused_by_cp1 = |result: Result<Session, EvidenceClientError>, case: &str| match result {
        Err(EvidenceClientError::Connect(
            ConnectError::RefusedByServer(_) | ConnectError::ClosedByServer,
        )) => {}
        Err(e) => panic!("{case}: not refused by cp-1: {}", keel_atls::ErrorChain(&e)),
        Ok(_) => panic!("{case}: admitted"),
    };
    refused_by_cp1(connect().await, "a member of an image not accepted");

    // The operator stages the new image's signed measurements.
    let new_set = join_common::measurements_of(&c.worker.tpm, &[4, 9, 11, 12]);
    let body = format!("{}\n", new_set.to_json()).into_bytes();
    let (op, challenge, proof) = c.operator(STAGE_IMAGE_MEASUREMENTS, &body);
    let (staged, current) = op
        .stage_image_measurements(
            &StageImageMeasurementsRequest {
                measurements: body.clone(),
                signature: signing.sign(&body),
                challenge,
                proof,
            },
            None,
        )
        .unwrap();
    assert_eq!(staged, new_set.digest());
    assert_eq!(current, state.join_measurements.digest());

    // Admitted, trusted, and checked against the staged set.
    let mut session = connect().await.expect("a member of the staged image");
    assert_eq!(session.round().await.unwrap(), "trusted");
    let record = Cluster::worker_record(&c.registry().snapshot())
        .cloned()
        .unwrap();
    assert_eq!(record.verdict, Verdict::Trusted);
    assert_eq!(record.measurements, hex::encode(new_set.digest()));

    // Neither image (PCR 9 differs too): refused on a new connection, and
    // drifted on the one it holds.
    c.worker
        .tpm
        .lock()
        .unwrap()
        .tpm()
        .pcr_extend(9, &[0x99; 32])
        .unwrap();
    refused_by_cp1(connect().await, "a member matching neither set");
    assert_eq!(session.round().await.unwrap(), "drifted");
    let record = Cluster::worker_record(&c.registry().snapshot())
        .cloned()
        .unwrap();
    assert!(
        record.reason.as_deref().unwrap_or("").contains("PCR"),
        "{record:?}"
    );
}

/// The disk bindings can fail to read (a corrupt file, an I/O error): the
/// evidence is still taken, without its disk, so that a store error does
/// not turn every member silent and, under the `revoke` policy, revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn evidence_is_taken_when_the_disk_bindings_cannot_be_read() {
    let c = Cluster::start(EvidencePolicy::Revoke).await;
    let bindings = DiskBindings::new(&c.cp1.root).path().to_owned();
    std::fs::write(&bindings, b"not a disk binding store").unwrap();
    let mut session = c.session(&c.worker).await;
    assert_eq!(session.round().await.unwrap(), "trusted");
    assert_eq!(session.round().await.unwrap(), "trusted");
    assert!(c.registry().snapshot().revoked().is_empty());
    let record = Cluster::worker_record(&c.registry().snapshot())
        .cloned()
        .unwrap();
    assert_eq!(record.verdict, Verdict::Trusted);
}

/// Attacker's move (a control plane revoked while cut off from the
/// operator, e.g. its PCRs drifted in a half-done upgrade): keep issuing
/// tickets, and so disk keys, from a revocation list that stopped when it
/// was revoked; a node revoked since rejoins through it. Every other
/// control plane refuses its evidence, so it never hears of any
/// revocation again. It must still learn the list, its own revocation in
/// it, and then issue no ticket at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_control_plane_learns_of_its_revocation_and_issues_no_tickets() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let cp2_port = free_port();
    let (cp2, cp2_slot) = c.joined("cp-2", "control-plane").await;
    let cp2_registry = RegistryStore::shared(&cp2.root).unwrap();
    let cp2_ek = join_common::ek_digest(&cp2.tpm);
    let worker_ek = join_common::ek_digest(&c.worker.tpm);
    assert!(cp2_registry.snapshot().revoked().is_empty());

    // A node cp-2's ticket did not carry: cp-1 records it after.
    let late = EkDigest::from_hex(&"dd".repeat(32)).unwrap();
    c.registry()
        .update(|r| r.register(&late, "", "w-late", "worker"))
        .unwrap();

    // cp-1 revokes cp-2, then the worker.
    for name in ["cp-2", "w-1"] {
        c.revoke(name).unwrap();
    }

    // An EK cp-1 never saw is revoked by the EK alone (the node joined
    // elsewhere), and revoking it again gives the same revocation.
    let stranger = EkDigest::from_hex(&"ee".repeat(32)).unwrap().to_string();
    for _ in 0..2 {
        let revoked = c.revoke(&stranger).unwrap();
        assert_eq!(
            (revoked.ek.as_str(), revoked.name.as_str()),
            (stranger.as_str(), "")
        );
    }

    // cp-2's evidence loop: refused as revoked, it takes cp-1's list.
    let evidence = tokio::spawn(
        c.evidence_client(&cp2)
            .merging_into(cp2_registry.clone(), Duration::from_secs(60), cp2_ek)
            .run(c.endpoint(), c.cluster_id()),
    );
    let start = Instant::now();
    while cp2_registry.revocation(&cp2_ek).is_none()
        || cp2_registry.revocation(&worker_ek).is_none()
    {
        assert!(
            start.elapsed() < LIMIT,
            "cp-2 did not learn the revocations: {:#?}",
            cp2_registry.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    evidence.abort();
    // What a revoked control plane gets is the list alone: no node
    // records of cp-1's came with it (w-1's came with cp-2's ticket,
    // w-late's would only come with a whole registry), and the merge is
    // no view of the nodes (silence would be judged on it).
    assert_eq!(cp2_registry.merged_at(), None);
    assert!(
        cp2_registry.snapshot().find("w-1").is_ok(),
        "{:#?}",
        cp2_registry.snapshot()
    );
    assert!(
        cp2_registry.snapshot().find("w-late").is_err(),
        "{:#?}",
        cp2_registry.snapshot()
    );

    // cp-2's join service issues no ticket, to a node it never saw either.
    let _serving = cp2.serve_join(cp2_port, cp2_slot).await;
    let fresh = joiner_with(
        config(&c.ca, &c.ports, "w-3", "worker", c.policy),
        Swtpm::start(&c.ca).unwrap(),
    );
    let kubelet = KubeletKey::generate("w-3").unwrap();
    let request = IssueJoinTicketRequest {
        disk_uuid: join_common::uuid(),
        kubelet_csr: kubelet.csr_pem().as_bytes().to_vec(),
        is_control_plane: false,
        node_name: "w-3".into(),
        file_discovery: true,
    };
    let refused = fresh
        .tickets(&c.ca)
        .join_ticket(&format!("127.0.0.1:{cp2_port}"), request, &kubelet.spki())
        .await;
    match refused.map(|_| ()) {
        Err(TicketError::Refused(status)) => {
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            assert!(
                status.message().contains("this control plane is revoked"),
                "{status:?}"
            );
        }
        other => panic!("a revoked control plane issued a ticket: {other:?}"),
    }
}

/// Attacker's move: make a control plane's registry writes fail (the
/// host fills or fails its disk) while it revokes a node, then reboot it:
/// the revocation, held in its memory alone, would be lost, and the node
/// would come back trusted. Its peers' rounds fail on its writes, but they
/// take its registry all the same. Here cp-2's rounds fail at cp-1 for
/// another reason (they name a disk bound to another node), and it still
/// learns of the revocation cp-1 made.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_control_plane_whose_rounds_fail_still_takes_its_peers_revocations() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let (cp2, _cp2_slot) = c.joined("cp-2", "control-plane").await;
    let cp2_registry = RegistryStore::shared(&cp2.root).unwrap();
    let cp2_ek = join_common::ek_digest(&cp2.tpm);
    let worker_ek = join_common::ek_digest(&c.worker.tpm);
    c.revoke("w-1").unwrap();
    assert!(cp2_registry.revocation(&worker_ek).is_none());
    let failing = c
        .evidence_client_reporting(&cp2, c.worker_disk())
        .merging_into(cp2_registry.clone(), Duration::from_secs(60), cp2_ek);
    // The round fails (checked on a session of its own first).
    let mut session = failing
        .connect(&c.endpoint(), &c.cluster_id())
        .await
        .unwrap();
    assert!(session.round().await.is_err());
    let evidence = tokio::spawn(failing.run(c.endpoint(), c.cluster_id()));
    let start = Instant::now();
    while cp2_registry.revocation(&worker_ek).is_none() {
        assert!(
            start.elapsed() < LIMIT,
            "cp-2 did not learn the revocation: {:#?}",
            cp2_registry.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    evidence.abort();
}

/// Every session of a client (one per control plane) and its handshakes
/// quote through one issuer: their documents share its batches and its
/// PCR cache, instead of a quote and a PCR read each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_clients_sessions_share_its_issuer() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let client = c.evidence_client(&c.worker);
    let mut first = client
        .connect(&c.endpoint(), &c.cluster_id())
        .await
        .unwrap();
    let mut second = client
        .connect(&c.endpoint(), &c.cluster_id())
        .await
        .unwrap();
    assert_eq!(client.issuer_stats().requests, 2, "the two handshakes");
    let (a, b) = (
        first.next_nonce().await.unwrap(),
        second.next_nonce().await.unwrap(),
    );
    let (a, b) = tokio::join!(first.evidence(a), second.evidence(b));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a.document, b.document);
    assert_eq!(client.issuer_stats().requests, 4, "and the two rounds");
}

/// Attacker's move: a compromised worker serves the evidence port of a
/// control-plane endpoint (the host sends the control planes' registry
/// exchange to it) and hands out a crafted registry: junk revocations
/// that fill the list, revocations of every node, records that never go
/// silent. It runs the cluster's image under the cluster's lock; its
/// measured role is what the control plane's client refuses, before it
/// asks for anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_serving_a_control_planes_port_gets_no_registry_merged() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let rogue_port = free_port();
    // The worker serves what a control plane serves (here with cp-1's
    // state; what it serves is never asked for).
    let _rogue = c.worker.serve_join(rogue_port, c.cp1_slot.clone()).await;
    let refused = c
        .evidence_client(&c.cp1)
        .connect(&format!("127.0.0.1:{rogue_port}"), &c.cluster_id())
        .await;
    match refused {
        Err(EvidenceClientError::OtherCluster(TicketError::ServiceCluster(why))) => {
            assert!(why.contains("not a control plane"), "{why}")
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a worker's registry port was trusted"),
    }
    // The same client trusts cp-1.
    c.session(&c.cp1).await;
}

/// A node upgraded while its evidence session lasts reports (and binds
/// into its quote) the version it now runs, not the one it connected with.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_round_reports_the_version_the_node_runs_now() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let mut s = c.session(&c.worker).await;
    let nonce = s.next_nonce().await.unwrap();
    let before = s.evidence(nonce).await.unwrap();

    let mut record = keel_agent::upgrade::NodeVersion::load(&c.worker.root)
        .unwrap()
        .expect("a joined node has a version record");
    let upgraded = "v1.99.0";
    assert_ne!(before.kubernetes_version, upgraded);
    record.version = upgraded.parse().unwrap();
    record.save(&c.worker.root).unwrap();

    let nonce = s.next_nonce().await.unwrap();
    let after = s.evidence(nonce).await.unwrap();
    assert_eq!(after.kubernetes_version, upgraded);
    s.client().submit(after).await.unwrap();
    let registry = c.registry().snapshot();
    let record = Cluster::worker_record(&registry).unwrap();
    assert_eq!(record.kubernetes_version, upgraded);
}

/// A node locks into its cluster before it formats a fresh state disk, so
/// its evidence loop starts while the disk is being set up. The loop reads
/// the disk's UUID once the set-up finished (the header labelled
/// provisioned), not once at its start: until then a round reports no
/// disk, after it every round reports the disk, and the UUID it found is
/// kept even if the header is damaged later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_disk_is_reported_once_its_set_up_finished() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let uuid = c.worker_disk();
    let cryptsetup = Cryptsetup::default();
    cryptsetup
        .relabel(&c.worker.disk, keel_agent::disk::PROVISIONING_LABEL)
        .unwrap();
    let disk = keel_agent::disk::StateDisk {
        device: c.worker.disk.clone(),
        cryptsetup: cryptsetup.clone(),
        mount: None,
    };
    let mut s = c
        .evidence_client_reporting(&c.worker, String::new())
        .reading_disk(disk)
        .connect(&c.endpoint(), &c.cluster_id())
        .await
        .unwrap();

    let nonce = s.next_nonce().await.unwrap();
    let during = s.evidence(nonce).await.unwrap();
    assert_eq!(during.disk_uuid, "", "a disk still being set up");
    s.client().submit(during).await.unwrap();

    cryptsetup
        .relabel(&c.worker.disk, keel_agent::disk::PROVISIONED_LABEL)
        .unwrap();
    let nonce = s.next_nonce().await.unwrap();
    let after = s.evidence(nonce).await.unwrap();
    assert_eq!(after.disk_uuid, uuid);
    assert_eq!(
        s.client().submit(after).await.unwrap().into_inner().verdict,
        "trusted"
    );
    let registry = c.registry().snapshot();
    assert_eq!(Cluster::worker_record(&registry).unwrap().disk_uuid, uuid);

    join_common::damage_luks_headers(&c.worker.disk);
    let nonce = s.next_nonce().await.unwrap();
    assert_eq!(s.evidence(nonce).await.unwrap().disk_uuid, uuid);
}

/// A control plane sends evidence from its lock on, as any member does,
/// not only once it serves: its join (the disk, the downloads, `kubeadm
/// join`) can take longer than its peers wait before they find it silent,
/// and under the `revoke` policy revoke it. Once it serves, it merges the
/// others' registries too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_control_plane_reports_before_it_serves() {
    let c = Cluster::start(EvidencePolicy::Revoke).await;
    let cp2 = joiner_with(
        config(&c.ca, &c.ports, "cp-2", "control-plane", c.policy),
        Swtpm::start(&c.ca).unwrap(),
    );
    // Locked into the cluster, still joining: no cluster state yet.
    cp2.lock.try_lock(c.cluster_id()).unwrap();
    let slot = Arc::new(ClusterSlot::new(None));
    let evidence = tokio::spawn(keel_agent::evidence::client::run_for_node(
        cp2.node(slot.clone()),
    ));
    let cp2_trusted = |r: &Registry| {
        r.nodes()
            .values()
            .any(|n| n.name == "cp-2" && n.verdict == Verdict::Trusted)
    };
    c.wait_for("cp-2 trusted before it serves", LIMIT, cp2_trusted)
        .await;
    // It serves: cp-1's registry is merged into its own from then on.
    assert!(RegistryStore::shared(&cp2.root)
        .unwrap()
        .snapshot()
        .nodes()
        .is_empty());
    slot.send_replace(c.cp1_slot.borrow().clone());
    let start = Instant::now();
    while !RegistryStore::shared(&cp2.root)
        .unwrap()
        .snapshot()
        .nodes()
        .values()
        .any(|n| n.name == "w-1")
    {
        assert!(start.elapsed() < LIMIT, "cp-1's registry never merged");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    evidence.abort();
}

/// A member that measures a second node identity after its handshake
/// (PCR 13, which no measurement pins) names none in its evidence: it
/// drifts, and its recorded name stays, held and found.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_adds_a_second_identity_drifts_and_keeps_its_name() {
    let c = Cluster::start(EvidencePolicy::Log).await;
    let evidence = c.worker_trusted().await;
    let other = keel_verifier::config::NodeIdentity {
        name: "w-9".into(),
        ..c.worker.config.node.clone()
    };
    c.worker
        .tpm
        .lock()
        .unwrap()
        .record(
            keel_verifier::measurement::EventType::NodeIdentity,
            "node w-9 (worker)",
            serde_json::to_vec(&other).unwrap(),
        )
        .unwrap();
    c.wait_for("drifted", LIMIT, |r| {
        Cluster::worker_record(r).is_some_and(|w| {
            w.verdict == Verdict::Drifted
                && w.reason
                    .as_deref()
                    .is_some_and(|why| why.contains("no single node identity"))
        })
    })
    .await;
    let registry = c.registry().snapshot();
    let record = Cluster::worker_record(&registry).expect("the name w-1 was blanked");
    assert_eq!(record.role, "worker");
    assert!(registry.find("w-1").is_ok());
    evidence.abort();
}

/// A member's nonce request waits for its turn without holding one of the
/// evidence port's places: with two places, two members waiting an
/// interval for their next nonces leave room for a third member's
/// evidence, taken at once; a second nonce request of a waiting member is
/// still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_waiting_for_their_turns_leave_the_evidence_places_to_others() {
    let c = Cluster::start_with_evidence_places(EvidencePolicy::Log, 2).await;
    let (w2, _) = c.joined("w-2", "worker").await;
    // w-2's evidence, quoted ahead: its first nonce is due at once.
    let mut third = c.session(&w2).await;
    let nonce = third.next_nonce().await.unwrap();
    let evidence = third.evidence(nonce).await.unwrap();
    // cp-1 and the worker report: their next nonces are an interval away.
    let (mut cp1, mut worker) = (c.session(&c.cp1).await, c.session(&c.worker).await);
    let (a, b) = tokio::join!(cp1.round(), worker.round());
    assert_eq!(
        (a.unwrap().as_str(), b.unwrap().as_str()),
        ("trusted", "trusted")
    );
    let waits = [cp1.client().clone(), worker.client().clone()].map(|mut client| {
        tokio::spawn(async move { client.next_nonce(NextNonceRequest {}).await })
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let verdict = third.client().submit(evidence).await.unwrap().into_inner();
    assert_eq!(verdict.verdict, "trusted");
    assert!(
        waits.iter().all(|w| !w.is_finished()),
        "the evidence waited for a member's turn to end"
    );
    let err = cp1
        .client()
        .next_nonce(NextNonceRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    for wait in waits {
        assert!(wait.await.unwrap().is_ok());
    }
}

/// Attacker's move (flood, a control plane compromised after its
/// attestation): ask for the registry (a copy of up to 24 MB each) again
/// and again on streams whose HTTP/2 window stays shut, so that every
/// answer stays in the serving control plane's memory. The request's
/// in-flight mark lasts until its answer is sent: the next request is
/// refused while it is unread, and served once its stream is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unread_registry_answer_holds_off_the_next_request() {
    use keel_proto::evidence::evidence_service_client::EvidenceServiceClient;
    use keel_proto::evidence::RegistryRequest;
    let c = Cluster::start(EvidencePolicy::Log).await;
    let trust = EkTrust::from_pem(&c.ca.issuer_pem().unwrap()).unwrap();
    let atls = keel_atls::AtlsClient::mutual(
        Arc::new(keel_agent::attestation::issuer::TpmIssuer::new(
            c.cp1.tpm.clone(),
        )),
        Arc::new(service_validator(&c.cp1.tpm, trust, None).unwrap()),
    );
    let shut = tonic::transport::Endpoint::from_shared(format!("http://{}", c.endpoint()))
        .unwrap()
        .initial_stream_window_size(0);
    let mut client = EvidenceServiceClient::new(atls.bind_channel(shut).await.unwrap().channel);
    let unread = tokio::spawn(async move { client.registry(RegistryRequest {}).await });
    tokio::time::sleep(REGISTRY_GAP + Duration::from_millis(500)).await;
    assert!(
        !unread.is_finished(),
        "the registry was read through a shut window"
    );

    let mut s = c.session(&c.cp1).await;
    let err = s.client().registry(RegistryRequest {}).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    unread.abort();
    tokio::time::sleep(REGISTRY_GAP + Duration::from_millis(200)).await;
    let answer = s.client().registry(RegistryRequest {}).await.unwrap();
    assert!(!answer.into_inner().registry.is_empty());
}
