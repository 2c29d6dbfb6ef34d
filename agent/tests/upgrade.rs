//! Upgrades of swtpm-backed nodes from Kubernetes v1.30 to v1.31 through
//! the operator API: the new components are staged, measured into PCR 13
//! and switched to at once; a component whose hash does not match, or a
//! kubeadm that fails after the switch, leaves the node on its previous
//! version (switched back, measured again); downgrades, skipped minor
//! versions, requests without the node's operator proof and replayed
//! proofs are refused before anything changes; a node stopped between the
//! switch and the record comes back with only its recorded version's files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use join_common::{config, free_port, measured};
use keel_agent::cluster::ClusterSlot;
use keel_agent::measured::SharedTpm;
use keel_agent::operator::{OperatorAuth, OperatorKeySlot, OperatorServer, UPGRADE};
use keel_agent::provision::{DiskStep, NodeEnv, Plan, Provisioner};
use keel_agent::upgrade::{NodeVersion, Switching, Target, UpgradeError, Upgrader, STAGED_SUFFIX};
use keel_proto::components::Components;
use keel_proto::operator::upgrade_response::Event;
use keel_proto::operator::{UpgradePlan, UpgradeRequest, UpgradeStep};
use keel_testkit::components::{stand_in_set_with, KubeExecutables};
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::keys::{KeyService, OperatorKey};
use keel_verifier::measurement::{pcr, verify_replay, EventType};
use keel_verifier::signature::{SigningPrivateKey, SigningPublicKey};
use prost::Message as _;
use zeroize::Zeroizing;

const FROM: &str = "v1.30.14";
const TO: &str = "v1.31.13";

/// A member node at v1.30: its TPM, root, operator key and operator API.
struct UpgradableNode {
    tpm: SharedTpm,
    root: PathBuf,
    key: OperatorKey,
    server: OperatorServer,
    _swtpm: Swtpm,
    _dir: tempfile::TempDir,
}

fn stand_ins(mirror: &MirrorServer, version: &str) -> Vec<keel_proto::components::Component> {
    stand_in_set_with(
        mirror,
        Path::new("/"),
        version,
        &KubeExecutables::standin().unwrap(),
    )
    .unwrap()
}

/// The node environment: the stand-ins claim the version they were served
/// as (no version forced), kubeadm as `extra_env` says.
fn env(root: &Path, work: &Path, extra_env: &[(&str, &str)]) -> NodeEnv {
    let mut env = join_common::node_env(root, work, None);
    // Each kubelet (re)start appends what the kubelet in its directory
    // claims to be to a file beside the root
    // ([`UpgradableNode::kubelet_starts`]).
    let starter = root.with_file_name("start-kubelet");
    std::fs::write(
        &starter,
        format!(
            "#!/bin/sh\nexec '{}' \"$@\" >> '{}'\n",
            root.join("run/state/bin/kubelet").display(),
            root.with_file_name("kubelet-starts").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &starter,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    env.kubelet = keel_agent::provision::KubeletStart::Program(starter);
    env.kubeadm.env.retain(|(k, _)| k != "KEEL_STANDIN_VERSION");
    env.kubeadm
        .env
        .extend(extra_env.iter().map(|(k, v)| ((*k).into(), (*v).into())));
    env
}

/// A node provisioned at v1.30 (components installed and measured, its
/// version recorded) that kubeadm set up as `role`.
async fn node(
    ca: &EkCa,
    mirror: &MirrorServer,
    role: &str,
    extra_env: &[(&str, &str)],
) -> UpgradableNode {
    node_with_key(ca, mirror, role, extra_env, None, None).await
}

/// [`node`], of a cluster whose config names the measurements signing key
/// `signing_key`.
async fn node_with_key(
    ca: &EkCa,
    mirror: &MirrorServer,
    role: &str,
    extra_env: &[(&str, &str)],
    signing_key: Option<SigningPublicKey>,
    kubeadm_limit: Option<std::time::Duration>,
) -> UpgradableNode {
    let swtpm = Swtpm::start(ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let work = dir.path().join("work");
    let config = config(ca, free_port(), role, role);
    let tpm = measured(&swtpm, &dir.path().join("log"), &config);
    let mut env = env(&root, &work, extra_env);
    if let Some(limit) = kubeadm_limit {
        env.kubeadm.init_timeout = limit;
        env.kubeadm.join_timeout = limit;
        env.kubeadm.upgrade_timeout = limit;
    }
    let components: Vec<_> = stand_ins(mirror, FROM)
        .into_iter()
        .map(|c| keel_installer::Component::try_from(c).unwrap())
        .collect();
    let log = |_line: String| {};
    Provisioner::new(&env, &tpm, &log)
        .prepare(Plan {
            disk: DiskStep::Open {
                key: Zeroizing::new(Vec::new()),
            },
            files: Vec::new(),
            components: Some((FROM.parse().unwrap(), components)),
        })
        .await
        .unwrap();
    // What kubeadm init (or join) left behind.
    let kube = root.join("etc/kubernetes");
    std::fs::create_dir_all(&kube).unwrap();
    let conf = if role == "control-plane" {
        "admin.conf"
    } else {
        "kubelet.conf"
    };
    std::fs::write(kube.join(conf), "apiVersion: v1\n").unwrap();
    let record = root.join("etc/kubernetes/keel-standin-version");
    std::fs::create_dir_all(record.parent().unwrap()).unwrap();
    std::fs::write(record, FROM).unwrap();

    // A member that joined: its operator key came in its ticket.
    let ek = join_common::ek_digest(&tpm);
    let key = KeyService::new(&[7; 32], &[8; 32])
        .unwrap()
        .operator_key(&ek)
        .unwrap();
    let joined = Arc::new(OperatorKeySlot::default());
    joined.set(key.clone());
    let cluster = Arc::new(ClusterSlot::new(None));
    let auth = OperatorAuth::new(ek, cluster.clone(), joined);
    let upgrader = Upgrader::new(env, tpm.clone(), cluster.clone()).with_signing_key(signing_key);
    let server = OperatorServer::new(auth, cluster, None, root.clone(), Some(upgrader));
    UpgradableNode {
        tpm,
        root,
        key,
        server,
        _swtpm: swtpm,
        _dir: dir,
    }
}

/// An upgrade's stream read to its end: the progress lines and the last
/// event.
async fn to_the_end(
    mut rx: tokio::sync::mpsc::Receiver<
        Result<keel_proto::operator::UpgradeResponse, tonic::Status>,
    >,
) -> (Vec<String>, Event) {
    let mut lines = Vec::new();
    while let Some(message) = rx.recv().await {
        match message.unwrap().event.unwrap() {
            Event::Log(line) => lines.push(line),
            last => return (lines, last),
        }
    }
    panic!("the stream ended without a result: {lines:?}");
}

fn plan(
    version: &str,
    components: Option<&[keel_proto::components::Component]>,
    step: UpgradeStep,
) -> Vec<u8> {
    UpgradePlan {
        kubernetes_version: version.into(),
        components: components.map(|c| Components {
            components: c.to_vec(),
        }),
        step: step.into(),
        ..UpgradePlan::default()
    }
    .encode_to_vec()
}

impl UpgradableNode {
    fn request(&self, plan: Vec<u8>) -> UpgradeRequest {
        let challenge = self.server.challenge().to_vec();
        let proof = self.key.prove(UPGRADE, &challenge, &plan).to_vec();
        UpgradeRequest {
            plan,
            challenge,
            proof,
        }
    }

    /// Runs `request` to its end: the progress lines and the last event.
    async fn run(&self, request: &UpgradeRequest) -> Result<(Vec<String>, Event), tonic::Status> {
        let rx = self
            .server
            .start_upgrade(request, None)
            .await
            .map_err(|e| tonic::Status::from(&e))?;
        Ok(to_the_end(rx).await)
    }

    /// Runs a worker's upgrade to [`TO`] with `components` (`kubeadm
    /// upgrade node`), which must fail: its progress lines and failure.
    async fn failed_upgrade(
        &self,
        components: &[keel_proto::components::Component],
    ) -> (Vec<String>, keel_proto::operator::UpgradeFailed) {
        self.failed_step(components, UpgradeStep::Node).await
    }

    /// As [`Self::failed_upgrade`], with `step`.
    async fn failed_step(
        &self,
        components: &[keel_proto::components::Component],
        step: UpgradeStep,
    ) -> (Vec<String>, keel_proto::operator::UpgradeFailed) {
        let (lines, last) = self
            .run(&self.request(plan(TO, Some(components), step)))
            .await
            .unwrap();
        let Event::Failed(failed) = last else {
            panic!("{last:?}");
        };
        (lines, failed)
    }

    fn version(&self) -> String {
        NodeVersion::load(&self.root)
            .unwrap()
            .unwrap()
            .version
            .to_string()
    }

    /// What the kubelet claimed to be at each (re)start, in order.
    fn kubelet_starts(&self) -> Vec<String> {
        let log = self.root.with_file_name("kubelet-starts");
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The version the installed kubelet claims to be.
    fn kubelet_claims(&self) -> String {
        let out = std::process::Command::new(self.root.join("run/state/bin/kubelet"))
            .arg("--version")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The component events of the log, which replays to the TPM's PCRs.
    fn component_events(&self) -> Vec<String> {
        let mut tpm = self.tpm.lock().unwrap();
        let events = tpm.events().to_vec();
        let reported = tpm.tpm().pcr_read(&pcr::AGENT_OWNED).unwrap();
        verify_replay(&events, &reported).unwrap();
        events
            .iter()
            .filter(|e| e.event_type == EventType::Component)
            .map(|e| e.description.clone())
            .collect()
    }

    fn assert_no_staging_left(&self) {
        for dir in ["run/state/bin", "opt/cni/bin"] {
            let staged = self.root.join(format!("{dir}{STAGED_SUFFIX}"));
            assert!(!staged.exists(), "{} left behind", staged.display());
        }
    }
}

fn code(result: Result<(Vec<String>, Event), tonic::Status>) -> tonic::Code {
    match result {
        Err(status) => status.code(),
        Ok(other) => panic!("accepted: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_upgrade_and_a_bad_component_rolls_one_back() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let old = stand_ins(&mirror, FROM);
    let new = stand_ins(&mirror, TO);
    let cp = node(&ca, &mirror, "control-plane", &[]).await;
    let worker = node(&ca, &mirror, "worker", &[]).await;
    assert!(
        cp.kubelet_claims().contains(FROM),
        "{}",
        cp.kubelet_claims()
    );

    // Refused before anything changes: no proof, another node's proof, a
    // replayed proof, a skipped minor version, a downgrade.
    let to_new = plan(TO, Some(&new), UpgradeStep::Apply);
    let mut unproven = cp.request(to_new.clone());
    unproven.proof = vec![0; 32];
    assert_eq!(code(cp.run(&unproven).await), tonic::Code::PermissionDenied);
    // Another node's key over this node's own challenge: the challenge
    // is good, the proof is not this node's.
    let challenge = cp.server.challenge().to_vec();
    let foreign = UpgradeRequest {
        proof: worker.key.prove(UPGRADE, &challenge, &to_new).to_vec(),
        plan: to_new.clone(),
        challenge,
    };
    assert_eq!(code(cp.run(&foreign).await), tonic::Code::PermissionDenied);
    // And this node's key over another node's challenge.
    let challenge = worker.server.challenge().to_vec();
    let elsewhere = UpgradeRequest {
        proof: cp.key.prove(UPGRADE, &challenge, &to_new).to_vec(),
        plan: to_new.clone(),
        challenge,
    };
    assert_eq!(
        code(cp.run(&elsewhere).await),
        tonic::Code::PermissionDenied
    );
    let skip = cp.request(plan("v1.32", None, UpgradeStep::Apply));
    let refused = cp.run(&skip).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("next minor version"),
        "{}",
        refused.message()
    );
    let down = cp.request(plan("v1.29", None, UpgradeStep::Apply));
    assert_eq!(
        code(cp.run(&down).await),
        tonic::Code::InvalidArgument,
        "v1.29 is not supported"
    );
    // A plan that installs nothing into a directory the node runs
    // components from: its old binaries would keep running, measured by no
    // event after the next boot.
    let without_cni: Vec<_> = new
        .iter()
        .filter(|c| !c.install_path.starts_with("/opt/cni/"))
        .cloned()
        .collect();
    assert!(without_cni.len() < new.len());
    let partial = cp.request(plan(TO, Some(&without_cni), UpgradeStep::Apply));
    let refused = cp.run(&partial).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused
            .message()
            .contains("installs nothing into /opt/cni/bin, which this node runs"),
        "{}",
        refused.message()
    );
    // Nor does a control plane authorise such plans for its members'
    // evidence: every node would refuse them.
    for (version, components, why) in [
        ("v1.32", None, "next minor version"),
        (
            TO,
            Some(&without_cni[..]),
            "installs nothing into /opt/cni/bin",
        ),
        // The version it runs, with other components: no node moves to
        // it, so no evidence may show them either.
        (FROM, Some(&new[..]), "already runs Kubernetes"),
    ] {
        let authorise = cp.request(plan(version, components, UpgradeStep::Authorise));
        let refused = cp.run(&authorise).await.unwrap_err();
        assert!(refused.message().contains(why), "{}", refused.message());
    }
    assert_eq!(cp.version(), FROM);
    cp.assert_no_staging_left();

    // The control plane upgrades: kubeadm upgrade apply, new binaries,
    // each measured with its version, the record moved on.
    let kept_dir = cp
        .root
        .join(keel_agent::paths::KEPT_COMPONENTS.trim_start_matches('/'));
    let kept_names = |components: &[keel_proto::components::Component]| {
        let mut names: Vec<String> = components
            .iter()
            .filter(|c| !c.url.starts_with("data:"))
            .map(|c| {
                let suffix = if c.extract { "tgz" } else { "bin" };
                format!("{}.{suffix}", c.hash.trim_start_matches("sha256:"))
            })
            .collect();
        // Components with the same bytes share a kept copy.
        names.sort();
        names.dedup();
        names
    };
    let kept_now = || {
        let mut names: Vec<String> = std::fs::read_dir(&kept_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };
    assert_eq!(kept_now(), kept_names(&old));
    // An archive of a version before: gone once the node runs the target.
    let earlier = kept_dir.join(format!("{}.tgz", "e".repeat(64)));
    std::fs::write(&earlier, b"an archive of an earlier version").unwrap();
    let request = cp.request(to_new.clone());
    let (lines, last) = cp.run(&request).await.unwrap();
    let Event::Done(done) = last else {
        panic!("{last:?}\n{}", lines.join("\n"));
    };
    assert_eq!(
        (
            done.previous_version.as_str(),
            done.kubernetes_version.as_str()
        ),
        (FROM, TO)
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("SUCCESS! Your cluster was upgraded")),
        "{lines:?}"
    );
    // One line per staged component: downloaded, from its kept copy (bytes
    // the old version has too) or already in place; each hash verified.
    let told: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("downloaded and verified") || l.ends_with("hash verified"))
        .collect();
    assert_eq!(told.len(), new.len(), "{lines:#?}");
    assert!(
        told.iter().any(|l| l.contains("downloaded and verified"))
            && told.iter().any(|l| l.contains("from the copy kept")),
        "{lines:#?}"
    );
    assert_eq!(cp.version(), TO);
    assert!(cp.kubelet_claims().contains(TO), "{}", cp.kubelet_claims());
    assert_eq!(kept_now(), kept_names(&new));
    let events = cp.component_events();
    assert_eq!(events.len(), old.len() + new.len());
    let upgraded = &events[old.len()..];
    assert!(
        upgraded
            .iter()
            .all(|d| d.contains(&format!("(Kubernetes {TO})"))),
        "{upgraded:?}"
    );
    assert!(
        upgraded
            .iter()
            .any(|d| d.contains(&format!("/{TO}/bin/linux/amd64/kubelet"))),
        "{upgraded:?}"
    );
    cp.assert_no_staging_left();
    // Replayed: the challenge was spent.
    assert_eq!(code(cp.run(&request).await), tonic::Code::PermissionDenied);
    // The same rollout run again (a later node of it failed): done, with
    // nothing changed; the same version with other components is refused.
    let events_before = cp.component_events().len();
    let (lines, last) = cp.run(&cp.request(to_new.clone())).await.unwrap();
    let Event::Done(again) = last else {
        panic!("{last:?}\n{}", lines.join("\n"));
    };
    assert_eq!(again.previous_version, TO);
    assert!(
        lines.iter().any(|l| l.contains("nothing to do")),
        "{lines:?}"
    );
    assert_eq!(cp.component_events().len(), events_before);
    let mut other_mirror = new.clone();
    other_mirror[0].url.push_str("?other");
    let refused = cp
        .run(&cp.request(plan(TO, Some(&other_mirror), UpgradeStep::Apply)))
        .await
        .unwrap_err();
    assert!(
        refused.message().contains("already runs"),
        "{}",
        refused.message()
    );
    cp.assert_no_staging_left();
    // A downgrade to the version it ran.
    let back = cp.request(plan(FROM, Some(&old), UpgradeStep::Apply));
    let refused = cp.run(&back).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("downgrades are refused"),
        "{}",
        refused.message()
    );

    // The worker's mirror serves a kubelet that does not match the list:
    // nothing switches, nothing new is measured, it keeps running v1.30.
    let mut tampered = new.clone();
    let kubelet = tampered
        .iter_mut()
        .find(|c| c.url.ends_with("/kubelet"))
        .unwrap();
    kubelet.hash = format!("sha256:{}", "00".repeat(32));
    let before = worker.component_events().len();
    let (lines, failed) = worker.failed_upgrade(&tampered).await;
    assert!(failed.error.contains("kubelet"), "{}", failed.error);
    assert!(!failed.rolled_back);
    assert_eq!(failed.running_version, FROM);
    assert!(!lines.iter().any(|l| l.contains("switched")), "{lines:?}");
    assert_eq!(worker.component_events().len(), before);
    assert_eq!(worker.version(), FROM);
    assert!(worker.kubelet_claims().contains(FROM));
    worker.assert_no_staging_left();
    // The control plane keeps the new version.
    assert_eq!(cp.version(), TO);
    assert!(cp.kubelet_claims().contains(TO));

    // With the real components, the worker follows (kubeadm upgrade node).
    let (lines, last) = worker
        .run(&worker.request(plan(TO, Some(&new), UpgradeStep::Node)))
        .await
        .unwrap();
    assert!(
        matches!(last, Event::Done(_)),
        "{last:?}\n{}",
        lines.join("\n")
    );
    assert_eq!(worker.version(), TO);
    assert!(worker.kubelet_claims().contains(TO));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_after_the_switch_switches_back_and_measures_it() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let node = node(&ca, &mirror, "worker", &[("KEEL_STANDIN_FAIL", "always")]).await;
    let (lines, failed) = node.failed_upgrade(&new).await;
    assert!(failed.rolled_back, "{failed:?}");
    assert_eq!(failed.running_version, FROM);
    assert!(failed.error.contains("kubeadm upgrade"), "{}", failed.error);
    assert!(
        lines
            .iter()
            .any(|l| l.contains("switched back to Kubernetes")),
        "{lines:?}"
    );
    assert_eq!(node.version(), FROM);
    assert!(
        node.kubelet_claims().contains(FROM),
        "{}",
        node.kubelet_claims()
    );
    node.assert_no_staging_left();
    // The log ends with what the node runs again.
    let events = node.component_events();
    let last = events.last().unwrap();
    assert!(
        last.contains(&format!("rollback to Kubernetes {FROM}")),
        "{events:?}"
    );
}

/// Attacker's move: let each upgrade's downloads succeed and break what
/// comes after the switch, so that it rolls back, and have the operator
/// retry: each attempt measures the new components and the old ones again
/// into a log that only a reboot empties, until the node's attestation no
/// longer fits a handshake and it drops out of the cluster. Before that,
/// an upgrade is refused up front, changing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_that_would_outgrow_the_event_log_are_refused_before_they_start() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let node = node(&ca, &mirror, "worker", &[("KEEL_STANDIN_FAIL", "always")]).await;
    let log_bytes = |node: &UpgradableNode| -> usize {
        let tpm = node.tpm.lock().unwrap();
        tpm.events()
            .iter()
            .map(|e| e.description.len() + e.data.len() + 64)
            .sum()
    };
    let mut refused = None;
    for attempt in 0..100 {
        let (_, failed) = node.failed_upgrade(&new).await;
        if failed.error.contains("event log") {
            refused = Some((attempt, failed));
            break;
        }
        assert!(failed.rolled_back, "{failed:?}");
    }
    let (attempts, failed) = refused.expect("no upgrade was refused for the event log");
    eprintln!(
        "refused after {attempts} rolled-back upgrades, the log at {} bytes: {}",
        log_bytes(&node),
        failed.error
    );
    assert!(attempts > 0);
    assert!(
        !failed.rolled_back && failed.running_version == FROM,
        "{failed:?}"
    );
    assert!(failed.error.contains("reboot the node"), "{}", failed.error);
    assert!(log_bytes(&node) <= keel_agent::upgrade::EVENT_LOG_BUDGET);
    // The node still attests.
    let issuer = keel_agent::attestation::issuer::TpmIssuer::new(node.tpm.clone());
    let document = tokio::task::spawn_blocking(move || issuer.issue(&[7; 32], b"user data"))
        .await
        .unwrap()
        .unwrap();
    assert!(document.len() <= keel_atls::cert::MAX_DOCUMENT_LEN);
    // Nothing changed: the refusal measured nothing.
    let before = node.component_events().len();
    let (_, again) = node.failed_upgrade(&new).await;
    assert!(again.error.contains("event log"), "{again:?}");
    assert_eq!(node.component_events().len(), before);
}

/// A plan whose measurements could never fit, even in a fresh boot's log,
/// is refused as too large (a reboot would not help), changing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_too_large_for_any_event_log_is_refused_as_such() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    // Never fetched: the plan is refused before anything is staged.
    let mut big = stand_ins(&mirror, TO);
    let long = "p".repeat(500);
    while big.len() < keel_agent::upgrade::MAX_PLAN_COMPONENTS {
        let n = big.len();
        big.push(keel_proto::components::Component {
            url: format!("https://dl.example/{long}/p{n}.json"),
            hash: format!("sha256:{n:064x}"),
            install_path: format!("/opt/kubernetes/patches/p{n}.json"),
            extract: false,
        });
    }
    let node = node(&ca, &mirror, "worker", &[]).await;
    let before = node.component_events().len();
    let (_, failed) = node.failed_upgrade(&big).await;
    assert!(failed.error.contains("too many components"), "{failed:?}");
    assert!(
        !failed.rolled_back && failed.running_version == FROM,
        "{failed:?}"
    );
    assert_eq!(node.component_events().len(), before);
    assert_eq!(node.version(), FROM);
}

// One thread: the first upgrade's task cannot start before the second
// request is answered, whatever the machine's timing.
#[tokio::test(flavor = "current_thread")]
async fn a_second_upgrade_while_one_runs_is_refused_before_it_starts() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let node = node(&ca, &mirror, "worker", &[]).await;
    let plan = plan(TO, Some(&new), UpgradeStep::Node);
    // The first is admitted and runs in its own task; the second, sent
    // before that task could start, is refused as busy (`Aborted`), not
    // admitted and then streamed as a failure.
    let first = node
        .server
        .start_upgrade(&node.request(plan.clone()), None)
        .await
        .unwrap();
    let second = node
        .server
        .start_upgrade(&node.request(plan), None)
        .await
        .map(|_| ())
        .map_err(|e| tonic::Status::from(&e));
    let refused = second.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Aborted, "{refused:?}");
    assert!(refused.message().contains("already running"), "{refused:?}");
    let (_, last) = to_the_end(first).await;
    assert!(matches!(last, Event::Done(_)), "{last:?}");
    assert_eq!(node.version(), TO);
}

/// kubeadm undoes a failed control-plane phase, not what its later phases
/// wrote (the kubelet's configuration, the cluster's kubeadm config): a
/// kubeadm that fails after changing the node is not reported rolled back,
/// on a control plane (`upgrade apply`) or a worker (`upgrade node`), and
/// the operator is told to run the upgrade again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeadm_that_fails_after_changing_the_node_is_not_reported_rolled_back() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let late = [("KEEL_STANDIN_FAIL_POST_UPGRADE", "1")];
    for (role, step) in [
        ("control-plane", UpgradeStep::Apply),
        ("worker", UpgradeStep::Node),
    ] {
        let node = node(&ca, &mirror, role, &late).await;
        let (lines, failed) = node.failed_step(&new, step).await;
        assert!(failed.switched, "{role}: {failed:?}");
        assert!(!failed.rolled_back, "{role}: {failed:?}");
        assert!(
            failed.error.contains("run the same upgrade again")
                && failed.error.contains("post-upgrade"),
            "{role}: {}",
            failed.error
        );
        // The binaries went back; the record admits the same upgrade again.
        assert!(
            lines
                .iter()
                .any(|l| l.contains("switched back to Kubernetes")),
            "{role}: {lines:?}"
        );
        assert_eq!(node.version(), FROM, "{role}");
    }
}

/// A network plugin (Cilium, Calico, flannel) copies its CNI binary into
/// `/opt/cni/bin` from an init container, which runs again only when its
/// pod is recreated. An upgrade that switched the directory without it
/// would leave every new pod on the node without a network. It is kept,
/// link and all; the new version's own files win over the old ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_plugins_cni_binary_survives_an_upgrade() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let node = node(&ca, &mirror, "worker", &[]).await;
    let cni = node.root.join("opt/cni/bin");
    let shipped: Vec<_> = std::fs::read_dir(&cni)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        !shipped.is_empty(),
        "the stand-in set installs no CNI plugins"
    );
    std::fs::write(cni.join("cilium-cni"), "the plugin's binary").unwrap();
    std::os::unix::fs::symlink("cilium-cni", cni.join("cilium-cni-link")).unwrap();

    let new = stand_ins(&mirror, TO);
    let (lines, last) = node
        .run(&node.request(plan(TO, Some(&new), UpgradeStep::Node)))
        .await
        .unwrap();
    assert!(matches!(last, Event::Done(_)), "{last:?}");
    assert_eq!(node.version(), TO);
    assert_eq!(
        std::fs::read_to_string(cni.join("cilium-cni")).unwrap(),
        "the plugin's binary"
    );
    assert_eq!(
        std::fs::read_link(cni.join("cilium-cni-link")).unwrap(),
        std::path::Path::new("cilium-cni")
    );
    for name in &shipped {
        assert!(
            cni.join(name).exists(),
            "{name:?} of the new version missing"
        );
    }
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("kept 2 file(s) a network plugin put")),
        "{lines:?}"
    );
}

/// kubeadm keeps what its upgrades back up (on a control plane a copy of
/// etcd's data each time) after the run, failed or not, for someone to
/// clear by hand: a node has no shell, so without the agent clearing them
/// each upgrade and each retried one would leave a copy of etcd on the
/// state disk until it is full. What is not kubeadm's in that directory
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubeadms_upgrade_backups_do_not_pile_up_on_the_state_disk() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let left = |node: &UpgradableNode| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(node.root.join("etc/kubernetes/tmp"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let late = [("KEEL_STANDIN_FAIL_POST_UPGRADE", "1")];
    let failing = node(&ca, &mirror, "control-plane", &late).await;
    let tmp = failing.root.join("etc/kubernetes/tmp");
    // A working copy a killed kubeadm left, and a file that is not kubeadm's.
    std::fs::create_dir_all(tmp.join("kubeadm-upgraded-manifests0815")).unwrap();
    std::fs::write(tmp.join("kept"), "not kubeadm's").unwrap();
    for attempt in 0..3 {
        let (_, failed) = failing.failed_step(&new, UpgradeStep::Apply).await;
        assert!(
            failed.error.contains("post-upgrade"),
            "{attempt}: {failed:?}"
        );
        assert_eq!(left(&failing), ["kept"], "attempt {attempt}");
    }

    let node = node(&ca, &mirror, "control-plane", &[]).await;
    let (_, last) = node
        .run(&node.request(plan(TO, Some(&new), UpgradeStep::Apply)))
        .await
        .unwrap();
    assert!(matches!(last, Event::Done(_)), "{last:?}");
    assert_eq!(node.version(), TO);
    assert!(left(&node).is_empty(), "{:?}", left(&node));
}

/// kubeadm fails, and its files cannot be read (a directory where a
/// manifest goes): whether it changed the node cannot be told, so the node
/// is not reported rolled back, and the operator is told why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeadm_failure_whose_files_cannot_be_read_is_not_reported_rolled_back() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let node = node(&ca, &mirror, "worker", &[("KEEL_STANDIN_FAIL", "always")]).await;
    std::fs::create_dir_all(node.root.join("etc/kubernetes/manifests/unreadable.yaml")).unwrap();
    let (_, failed) = node.failed_upgrade(&new).await;
    assert!(failed.switched, "{failed:?}");
    assert!(!failed.rolled_back, "{failed:?}");
    assert!(
        failed.error.contains("could not be told") && failed.error.contains("not a regular file"),
        "{}",
        failed.error
    );
    assert_eq!(node.version(), FROM);
}

/// A kubeadm killed at its limit may have been midway (manifests, the
/// kubelet's config): the binaries switch back, but the operator is not
/// told the node was rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeadm_killed_at_its_limit_is_not_reported_rolled_back() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let limit = Some(std::time::Duration::from_secs(1));
    let sleep = [("KEEL_STANDIN_SLEEP", "3")];
    let node = node_with_key(&ca, &mirror, "worker", &sleep, None, limit).await;
    let (lines, failed) = node.failed_upgrade(&new).await;
    assert!(
        failed.error.contains("did not finish within"),
        "{}",
        failed.error
    );
    assert!(failed.switched, "{failed:?}");
    assert!(!failed.rolled_back, "{failed:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("switched back to Kubernetes")),
        "{lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_that_cannot_write_its_record_still_restarts_the_old_kubelet() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let node = node(&ca, &mirror, "worker", &[]).await;
    // kubeadm succeeds and the new kubelet starts, but the version record
    // cannot be replaced: its temporary file's name (this process writes
    // it) is taken by a directory that is not empty.
    let record = node.root.join("etc/kubernetes/keel/node-version.json");
    let blocker = record.with_file_name(format!(".node-version.json.tmp-{}", std::process::id()));
    std::fs::create_dir_all(blocker.join("taken")).unwrap();
    let (lines, failed) = node.failed_upgrade(&new).await;
    // Not restored in full, and said so; but the kubelet the switch
    // started (the new version's) is not left running.
    assert!(!failed.rolled_back, "{failed:?}");
    assert!(
        failed.error.contains("node-version.json"),
        "{}",
        failed.error
    );
    // kubeadm's upgrade had succeeded: the operator is told what stays and
    // what to do.
    assert!(
        failed.error.contains(&format!(
            "kubeadm had upgraded this node to Kubernetes {TO}"
        )) && failed.error.contains("run the same upgrade again"),
        "{}",
        failed.error
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("switched back to Kubernetes")
                && l.contains("writing its version record failed")
                && !l.contains("restarting the kubelet failed")),
        "{lines:?}"
    );
    // Why the rollback's own write failed is in the stream, not only that
    // it did.
    assert!(
        lines.iter().any(
            |l| l.starts_with("writing the previous version's record failed: ")
                && l.contains("node-version.json")
        ),
        "{lines:#?}"
    );
    let starts = node.kubelet_starts();
    assert!(
        starts.len() >= 2 && starts[starts.len() - 2].contains(TO),
        "{starts:?}"
    );
    assert!(starts.last().unwrap().contains(FROM), "{starts:?}");
    assert_eq!(node.version(), FROM);
}

/// A plan whose components install where no upgrade can switch (here
/// beside the image's own binaries), or with two archives for one
/// directory, is refused when it is read, so a control plane does not
/// authorise for its members' evidence what every node would refuse to
/// stage.
#[test]
fn a_plan_no_node_would_stage_is_refused() {
    let mirror = MirrorServer::start().unwrap();
    let mut listed = stand_ins(&mirror, TO);
    let good = Target::parse(
        UpgradePlan::decode(&plan(TO, Some(&listed), UpgradeStep::Authorise)[..]).unwrap(),
        None,
    );
    assert!(good.is_ok(), "{good:?}");
    let archive = listed.iter().find(|c| c.extract).unwrap();
    let second = keel_proto::components::Component {
        hash: format!("sha256:{}", "b".repeat(64)),
        ..archive.clone()
    };
    let mut doubled = listed.clone();
    doubled.push(second);
    let refused = Target::parse(
        UpgradePlan::decode(&plan(TO, Some(&doubled), UpgradeStep::Authorise)[..]).unwrap(),
        None,
    );
    match refused {
        Err(UpgradeError::Plan(why)) => {
            assert!(why.contains("more than one archive"), "{why}");
        }
        other => panic!("accepted: {other:?}"),
    }
    let kubelet = listed
        .iter_mut()
        .find(|c| c.install_path.ends_with("/kubelet"))
        .unwrap();
    kubelet.install_path = "/usr/bin/kubelet".into();
    let refused = Target::parse(
        UpgradePlan::decode(&plan(TO, Some(&listed), UpgradeStep::Authorise)[..]).unwrap(),
        None,
    );
    match refused {
        Err(UpgradeError::Plan(why)) => assert!(why.contains("/usr/bin"), "{why}"),
        other => panic!("accepted: {other:?}"),
    }
}

/// An upgrader of `node` (working in `work`) whose kubeadm hangs for a
/// minute, and the target of a node step to `new` at Kubernetes [`TO`]:
/// an upgrade that stays in kubeadm, its components switched.
fn hanging_upgrade(
    node: &UpgradableNode,
    work: &Path,
    new: &[keel_proto::components::Component],
) -> (Upgrader, Target) {
    let upgrader = Upgrader::new(
        env(&node.root, work, &[("KEEL_STANDIN_SLEEP", "60")]),
        node.tpm.clone(),
        Arc::new(ClusterSlot::new(None)),
    );
    let target = Target::parse(
        UpgradePlan::decode(&plan(TO, Some(new), UpgradeStep::Node)[..]).unwrap(),
        None,
    )
    .unwrap();
    (upgrader, target)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopped_between_switch_and_record_comes_back_with_the_recorded_version() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let node = node(&ca, &mirror, "worker", &[]).await;
    let work = node.root.parent().unwrap().join("work");

    // The agent stops while kubeadm runs: the directories hold v1.31, the
    // record still names v1.30. (Dropping the upgrade runs none of its
    // code after that point; kubeadm is killed with it.)
    let (hanging, target) = hanging_upgrade(&node, &work, &new);
    let log = |_line: String| {};
    let turn = hanging.check(&target).unwrap();
    let upgrade = hanging.run(&target, turn, &log);
    let switched = async {
        while Switching::load(&node.root).unwrap().is_none() || !node.kubelet_claims().contains(TO)
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        result = upgrade => panic!("the upgrade ended: {result:?}"),
        () = switched => {}
    }
    assert_eq!(node.version(), FROM);
    let switching = Switching::load(&node.root).unwrap().unwrap();
    assert!(
        switching.directories.contains(&"/run/state/bin".to_owned()),
        "{switching:?}"
    );
    // A file only the new version has (as an archive of it would bring).
    std::fs::write(node.root.join("run/state/bin/only-in-v1.31"), "new").unwrap();
    // No upgrade starts over the half-done switch: its record would be
    // overwritten, and a rollback would leave the directories as they are.
    let refused = node
        .run(&node.request(plan(TO, Some(&new), UpgradeStep::Node)))
        .await;
    match &refused {
        Err(status) => assert!(status.message().contains("half switched"), "{status:?}"),
        Ok(other) => panic!("accepted: {other:?}"),
    }
    assert_eq!(code(refused), tonic::Code::FailedPrecondition);

    // The reboot: the recorded version, and nothing else, is installed
    // and measured again, from the kept copies (nothing fetched). kubeadm
    // had started: the boot says it may have upgraded the node.
    let fetched = mirror.total_requests();
    let lines = reinstall_logged(&node, &work).await;
    assert_eq!(mirror.total_requests(), fetched);
    assert_kubeadm_may_have_upgraded(&lines);
    assert!(
        node.kubelet_claims().contains(FROM),
        "{}",
        node.kubelet_claims()
    );
    assert!(!node.root.join("run/state/bin/only-in-v1.31").exists());
    node.assert_no_staging_left();
    assert!(Switching::load(&node.root).unwrap().is_none());
    assert_eq!(node.version(), FROM);
    let events = node.component_events();
    assert!(
        events.last().unwrap().contains(FROM),
        "the log ends with what the node runs: {events:?}"
    );

    // The node upgrades normally afterwards, and leaves no switch record.
    let (_, last) = node
        .run(&node.request(plan(TO, Some(&new), UpgradeStep::Node)))
        .await
        .unwrap();
    assert!(matches!(last, Event::Done(_)), "{last:?}");
    assert!(Switching::load(&node.root).unwrap().is_none());
    assert!(node.kubelet_claims().contains(TO));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_record_naming_other_directories_empties_only_the_components() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let node = node(&ca, &mirror, "worker", &[]).await;
    let work = node.root.parent().unwrap().join("work");
    // A record that names a mount point of the state disk, beside a file
    // there and a stray one among the components.
    let canary = node.root.join("opt/cni/canary");
    std::fs::write(&canary, "kept").unwrap();
    std::fs::write(node.root.join("run/state/bin/stray"), "x").unwrap();
    let record = node.root.join("etc/kubernetes/keel/upgrade-switching.json");
    std::fs::write(&record, r#"{"directories":["/opt/cni"]}"#).unwrap();
    assert!(Switching::load(&node.root).is_err());

    let log = |_line: String| {};
    Provisioner::new(&env(&node.root, &work, &[]), &node.tpm, &log)
        .reinstall_recorded()
        .await
        .unwrap();
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), "kept");
    assert!(!node.root.join("run/state/bin/stray").exists());
    assert!(node.kubelet_claims().contains(FROM));
    assert!(!record.exists());
}

/// A node that stopped once its upgrade had started kubeadm (its switch
/// record, and beside it the mark naming the target, next to a record of
/// the previous version): the boot installs the recorded version into the
/// switched directories as before, and says, as a failure after kubeadm
/// does, that kubeadm may have upgraded the node and to run the same
/// upgrade again, naming the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopped_once_kubeadm_started_is_told_to_run_the_upgrade_again() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let node = node(&ca, &mirror, "worker", &[]).await;
    let work = node.root.parent().unwrap().join("work");
    std::fs::write(node.root.join("run/state/bin/only-in-v1.31"), "new").unwrap();
    let keel = node.root.join("etc/kubernetes/keel");
    std::fs::write(
        keel.join("upgrade-switching.json"),
        r#"{"directories":["/run/state/bin"]}"#,
    )
    .unwrap();
    let mark = keel.join("upgrade-kubeadm.json");
    std::fs::write(&mark, format!(r#"{{"kubernetes_version":"{TO}"}}"#)).unwrap();

    let lines = reinstall_logged(&node, &work).await;
    assert_kubeadm_may_have_upgraded(&lines);
    // What is installed and recorded is the previous version, as before.
    assert!(node.kubelet_claims().contains(FROM));
    assert!(!node.root.join("run/state/bin/only-in-v1.31").exists());
    assert_eq!(node.version(), FROM);
    assert!(Switching::load(&node.root).unwrap().is_none());
    assert!(!mark.exists());
    // The same upgrade is admitted again, and finishes.
    let new = stand_ins(&mirror, TO);
    let (_, last) = node
        .run(&node.request(plan(TO, Some(&new), UpgradeStep::Node)))
        .await
        .unwrap();
    assert!(matches!(last, Event::Done(_)), "{last:?}");
    assert_eq!(node.version(), TO);
}

/// A switch record as earlier agents write it (no kubeadm mark beside it)
/// loads and is settled as before: the directories emptied and the
/// recorded version installed, with no word of kubeadm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_agents_switch_record_is_settled_as_before() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let node = node(&ca, &mirror, "worker", &[]).await;
    let work = node.root.parent().unwrap().join("work");
    std::fs::write(node.root.join("run/state/bin/only-in-v1.31"), "new").unwrap();
    let record = node.root.join("etc/kubernetes/keel/upgrade-switching.json");
    std::fs::write(&record, r#"{"directories":["/run/state/bin"]}"#).unwrap();
    assert_eq!(
        Switching::load(&node.root).unwrap().unwrap().directories,
        ["/run/state/bin"]
    );

    let lines = reinstall_logged(&node, &work).await;
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("an upgrade stopped while switching /run/state/bin")),
        "{lines:?}"
    );
    // The kubeadm component's own install line is not a word of the
    // kubeadm step.
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("kubeadm") && !l.starts_with("kubeadm: installed from")),
        "{lines:?}"
    );
    assert!(node.kubelet_claims().contains(FROM));
    assert!(!node.root.join("run/state/bin/only-in-v1.31").exists());
    assert_eq!(node.version(), FROM);
    assert!(!record.exists());
}

/// Reinstalls `node`'s recorded version as a reboot does; the lines it
/// logged.
async fn reinstall_logged(node: &UpgradableNode, work: &Path) -> Vec<String> {
    let lines = std::sync::Mutex::new(Vec::new());
    let log = |line: String| lines.lock().unwrap().push(line);
    Provisioner::new(&env(&node.root, work, &[]), &node.tpm, &log)
        .reinstall_recorded()
        .await
        .unwrap();
    lines.into_inner().unwrap()
}

/// `lines` say that kubeadm may have upgraded the node to [`TO`], and to
/// run the same upgrade again.
fn assert_kubeadm_may_have_upgraded(lines: &[String]) {
    assert!(
        lines
            .iter()
            .any(|l| l.contains("run the same upgrade again")
                && l.contains(&format!(
                    "kubeadm may have upgraded this node to Kubernetes {TO}"
                ))),
        "{lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reboot_reinstalls_the_recorded_version_with_the_mirror_gone() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let node = node(&ca, &mirror, "worker", &[]).await;
    let work = node.root.parent().unwrap().join("work");
    let before = node.component_events().len();
    // The upstream hosts (here the mirror) out of reach, and what was
    // installed gone with the memory it was in: only the state disk's kept
    // copies can bring it back.
    drop(mirror);
    for installed in ["run/state/bin", "opt/cni", "opt/kubernetes"] {
        std::fs::remove_dir_all(node.root.join(installed)).unwrap();
    }

    reinstall_after_reboot(&node, &work).await;
    assert!(node
        .root
        .join("opt/cni/bin")
        .read_dir()
        .unwrap()
        .next()
        .is_some());
    assert!(node.kubelet_claims().contains(FROM));
    // Every component measured again, the archives included.
    let events = node.component_events();
    assert_eq!(events.len(), 2 * before, "{events:?}");
    assert_eq!(events[..before], events[before..]);
}

/// A node whose image is replaced by one of this release boots on a disk
/// of the earlier layout: the components on the disk itself (`bin`, `cni`,
/// `opt-kubernetes`) and the kept archives in `archives`. With no mirror,
/// the recorded version still installs, from what the disk held, into
/// memory; the disk's component directories are gone afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_of_the_earlier_layout_is_taken_over_without_a_mirror() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let node = node(&ca, &mirror, "worker", &[]).await;
    let work = node.root.parent().unwrap().join("work");
    drop(mirror);
    // The earlier layout: the installed files on the disk, the archives
    // in `archives`, no kept single files.
    let disk = node
        .root
        .join(keel_agent::paths::STATE_MOUNT.trim_start_matches('/'));
    let kept = node
        .root
        .join(keel_agent::paths::KEPT_COMPONENTS.trim_start_matches('/'));
    std::fs::create_dir_all(disk.join("archives")).unwrap();
    for entry in std::fs::read_dir(&kept).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        if name.ends_with(".tgz") {
            std::fs::rename(entry.path(), disk.join("archives").join(&name)).unwrap();
        } else {
            std::fs::remove_file(entry.path()).unwrap();
        }
    }
    for (memory, on_disk) in [("run/state/bin", "bin"), ("opt/cni", "cni")] {
        std::fs::rename(node.root.join(memory), disk.join(on_disk)).unwrap();
    }
    // A staged twin left by an upgrade of that release.
    std::fs::create_dir_all(disk.join("bin.keel-next")).unwrap();
    std::fs::write(disk.join("bin.keel-next/kubelet"), "a staged kubelet").unwrap();
    // A symlink where a component directory was (root on the node, or a
    // damaged disk): not followed, and what it points at stays.
    let elsewhere = node.root.join("elsewhere");
    std::fs::rename(node.root.join("opt/kubernetes"), &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, disk.join("opt-kubernetes")).unwrap();

    reinstall_after_reboot(&node, &work).await;
    assert!(node.kubelet_claims().contains(FROM));
    for gone in ["bin", "bin.keel-next", "cni", "archives"] {
        assert!(!disk.join(gone).exists(), "{gone} is still on the disk");
    }
    assert!(std::fs::read_dir(&elsewhere).unwrap().next().is_some());
    assert!(std::fs::read_dir(&kept).unwrap().next().is_some());
}

/// What a reboot does on `node`: reinstalls its recorded version; then
/// every file of it is in `/run/state/bin` again.
async fn reinstall_after_reboot(node: &UpgradableNode, work: &std::path::Path) {
    let log = |_line: String| {};
    Provisioner::new(&env(&node.root, work, &[]), &node.tpm, &log)
        .reinstall_recorded()
        .await
        .unwrap();
    for file in ["crictl", "kubelet", "kubeadm", "kubectl"] {
        assert!(
            node.root.join("run/state/bin").join(file).is_file(),
            "{file}"
        );
    }
}

/// A components file listing `components`, as an operator writes it.
fn components_file(components: &[keel_proto::components::Component]) -> Vec<u8> {
    let list: Vec<serde_json::Value> = components
        .iter()
        .map(|c| {
            serde_json::json!({
                "url": c.url,
                "hash": c.hash,
                "install_path": c.install_path,
                "extract": c.extract,
            })
        })
        .collect();
    serde_json::to_vec_pretty(&list).unwrap()
}

/// Attacker's move: with the master secret alone (the operator key of
/// every node), roll out binaries of one's choosing: a plan that lists its
/// own components with their hashes. Where the cluster has a measurements
/// signing key, the master secret does not admit an image, and it does
/// not choose binaries either: a plan's own components count only with
/// their components file signed by that key, and exactly as it lists them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plans_own_components_need_their_file_signed_by_the_clusters_key() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let cluster_key = SigningPrivateKey::generate();
    let cp = node_with_key(
        &ca,
        &mirror,
        "control-plane",
        &[],
        Some(cluster_key.public_key()),
        None,
    )
    .await;
    let signed_plan = |file: Vec<u8>, signature: Vec<u8>, listed: &[_]| {
        UpgradePlan {
            kubernetes_version: TO.into(),
            components: Some(keel_proto::components::Components {
                components: listed.to_vec(),
            }),
            step: UpgradeStep::Apply.into(),
            components_file: file,
            components_signature: signature,
        }
        .encode_to_vec()
    };
    let file = components_file(&new);
    // What a signature covers: the file, as the file for one version.
    let for_version = |version: &str, file: &[u8]| {
        keel_installer::components_file::signed_message(
            keel_installer::resolve(version).unwrap().version(),
            file,
        )
    };
    let other_key = SigningPrivateKey::generate();
    let mut fewer = new.clone();
    fewer.pop();
    let fewer_file = components_file(&fewer);
    for (plan, why) in [
        (
            plan(TO, Some(&new), UpgradeStep::Apply),
            "only with their components file signed",
        ),
        (
            signed_plan(file.clone(), other_key.sign(&for_version(TO, &file)), &new),
            "does not verify with the cluster's measurements signing key",
        ),
        // The file's bytes alone, or signed as another version's file: a
        // plan cannot label binaries signed for one version as another's.
        (
            signed_plan(file.clone(), cluster_key.sign(&file), &new),
            "does not verify with the cluster's measurements signing key",
        ),
        (
            signed_plan(
                file.clone(),
                cluster_key.sign(&for_version(FROM, &file)),
                &new,
            ),
            "as the file for this Kubernetes version",
        ),
        (
            signed_plan(
                fewer_file.clone(),
                cluster_key.sign(&for_version(TO, &fewer_file)),
                &new,
            ),
            "not the ones its signed components file lists",
        ),
    ] {
        let refused = cp.run(&cp.request(plan)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
        assert!(refused.message().contains(why), "{}", refused.message());
    }
    assert_eq!(cp.version(), FROM);
    cp.assert_no_staging_left();

    // Signed by the cluster's key, exactly as listed: the node moves.
    let good = signed_plan(
        file.clone(),
        cluster_key.sign(&for_version(TO, &file)),
        &new,
    );
    let (lines, last) = cp.run(&cp.request(good)).await.unwrap();
    assert!(
        matches!(last, Event::Done(_)),
        "{last:?}\n{}",
        lines.join("\n")
    );
    assert_eq!(cp.version(), TO);
}

/// An operator who runs `keel upgrade apply` again while the first run's
/// upgrade still goes on here (its CLI gone) is told it is running, not
/// that it was left half switched and to reboot the node, which would
/// stop kubeadm midway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authorisation_while_an_upgrade_runs_is_refused_as_busy() {
    let ca = EkCa::new().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let new = stand_ins(&mirror, TO);
    let node = node(&ca, &mirror, "worker", &[]).await;
    let work = node.root.parent().unwrap().join("work");
    let (upgrader, target) = hanging_upgrade(&node, &work, &new);
    let log = |_line: String| {};
    let turn = upgrader.check(&target).unwrap();
    // Kept going (not dropped) while the authorisation is asked for.
    let upgrade = upgrader.run(&target, turn, &log);
    tokio::pin!(upgrade);
    let switched = async {
        while Switching::load(&node.root).unwrap().is_none() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        result = &mut upgrade => panic!("the upgrade ended: {result:?}"),
        () = switched => {}
    }
    match upgrader.authorise(&target) {
        Err(UpgradeError::Busy) => {}
        other => panic!("not refused as running: {other:?}"),
    }
}
