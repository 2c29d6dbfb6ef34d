//! The end-to-end scenarios on the local cluster, in order, on one cluster
//! brought up once (`keel_e2e::mini`):
//!
//! 1. happy path: `keel init` over aTLS, the worker joins; both nodes verify
//!    as members of the cluster `keel init` reported, and on each a locally
//!    built image ran in containerd, whose data is on the LUKS2 state disk;
//! 2. a node with another cluster config is refused: its attestation,
//!    judged by the join service's policy, differs in PCR 12, and it stays
//!    out of the cluster (PCR 15 zero);
//! 3. a node whose UKI command line differs in one byte is refused the same
//!    way on PCR 4 (2 and 3 boot in parallel);
//! 4. a second init gets FailedPrecondition;
//! 5. the worker, killed and booted again on the same TPM and disk,
//!    rejoins through IssueRejoinTicket with its state disk reopened (same
//!    LUKS header);
//! 6. both state disks are LUKS2 and open with the key the host derives
//!    from the master secret, and no disk key, init secret or master secret
//!    appears in any log.
//!
//! Results are read from `keel verify -o json`, exit statuses, gRPC status
//! codes and the disks themselves; console lines only tell when to look,
//! except for the container check, whose structured (JSON) report the node
//! prints there as part of kubeadm's output (`keel_testkit::container`).
//! Each scenario prints `PASS <name> <seconds>`.
//!
//! Opt-in: set `KEEL_IMAGE_DIR` (`make e2e` does); without it the test
//! says so and passes.

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use keel_e2e::image::IMAGE_DIR_VAR;
use keel_e2e::mini::cluster::{JOINED_LINE, JOIN_FAILED_LINE, REJOINED_LINE};
use keel_e2e::mini::config::{MEASUREMENTS, MEASUREMENTS_MEMBER, PCR_CLUSTER_ID};
use keel_e2e::mini::verify::Verification;
use keel_e2e::mini::{disk, procs, Cluster, Node, UpOptions};
use keel_e2e::report::READY_LINE;
use keel_verifier::config::Role;

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// How long a refused node's join client runs before it is checked to be
/// still outside the cluster. A node the service admits is locked (PCR 15
/// set) within seconds of its first attempt, made as soon as it is ready.
const JOIN_WINDOW: Duration = Duration::from_secs(30);
/// The UKI command line as the image has it, and the byte changed in it:
/// "quiet" becomes "quieT", an unknown parameter the kernel passes on.
const CMDLINE: &[u8] = b" console=ttyS0 quiet ";
const CMDLINE_CHANGED_AT: usize = 19;

const ZERO: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn pass(name: &str, since: Instant) {
    println!("PASS {name} {:.1}", since.elapsed().as_secs_f64());
}

#[test]
fn local_cluster_scenarios() -> TestResult {
    if std::env::var_os(IMAGE_DIR_VAR).is_none_or(|v| v.is_empty()) {
        eprintln!("skipped: no image to boot. `make e2e` sets {IMAGE_DIR_VAR}=build/image.");
        return Ok(());
    }
    let mut opts = UpOptions::from_env()?;
    // `make e2e` builds the agent and the image first; the build phase here
    // builds the host tools.
    opts.build = false;
    let started = Instant::now();
    let mut cluster = Cluster::up(&opts)?;
    let processes = cluster.processes();

    happy_path(&cluster, started)?;
    second_init(&cluster)?;
    refused_nodes(&cluster)?;
    worker_rejoins(&mut cluster)?;
    disks_and_secrets(&cluster)?;

    drop(cluster);
    let left: Vec<_> = processes
        .iter()
        .filter(|p| procs::running(p.pid, &p.program))
        .collect();
    assert!(
        left.is_empty(),
        "still running after the cluster stopped: {left:?}"
    );
    Ok(())
}

/// Both nodes verify as members of the cluster `keel init` reported, and
/// that ID is the one the master secret gives.
fn happy_path(cluster: &Cluster, started: Instant) -> TestResult {
    let expected = cluster.master_secret()?.cluster_id()?;
    assert_eq!(
        cluster.cluster_id, expected,
        "keel init reported another cluster ID than its master secret gives"
    );
    for node in [&cluster.cp, &cluster.worker] {
        let v = cluster.verify(node, MEASUREMENTS_MEMBER)?;
        member(&v, &cluster.cluster_id, node)?;
        assert!(
            v.report.components() > 0,
            "{}: no component in the event log; see {}",
            node.short,
            node.dir.join("verify.json").display()
        );
        container_runtime(node)?;
    }
    pass("happy-path", started);
    Ok(())
}

/// The node's container runtime, as the stand-in kubeadm's preflight found
/// it: containerd answered, the image built and imported on the node ran
/// and printed its message, the image's snapshot and containerd's open
/// metadata database are on the LUKS2 state disk, and containerd became
/// active only after that disk was mounted.
fn container_runtime(node: &Node) -> TestResult {
    let check = node.container_check().ok_or_else(|| {
        format!(
            "{}: no container check report on the console; see {}",
            node.short,
            node.serial_log().display()
        )
    })?;
    let problems = check.problems();
    assert!(
        problems.is_empty(),
        "{}: {}; see {}",
        node.short,
        problems.join("; "),
        node.serial_log().display()
    );
    Ok(())
}

/// `v` shows a member of `cluster_id`: verified, PCR 15 set by the lock
/// event for that ID.
fn member(v: &Verification, cluster_id: &str, node: &Node) -> TestResult {
    let report = node.dir.join("verify.json");
    assert!(
        v.success && v.report.verified,
        "{}: not verified ({:?}); see {}",
        node.short,
        v.report.error,
        report.display()
    );
    assert_eq!(
        v.report.cluster_id().as_deref(),
        Some(cluster_id),
        "{}: locked to another cluster; see {}",
        node.short,
        report.display()
    );
    assert_ne!(
        v.report.pcr(PCR_CLUSTER_ID),
        Some(ZERO),
        "{}: PCR 15 is zero",
        node.short
    );
    Ok(())
}

/// A second, valid init request is refused with FailedPrecondition, and
/// the node stays in its cluster.
fn second_init(cluster: &Cluster) -> TestResult {
    let t = Instant::now();
    let status = match cluster.init_again()? {
        Ok(()) => return Err("the control plane accepted a second init".into()),
        Err(status) => status,
    };
    assert_eq!(
        status.code(),
        tonic::Code::FailedPrecondition,
        "refused, but with {status:?}; see {}",
        cluster.cp.serial_log().display()
    );
    assert!(
        status.message().contains("already part of a cluster"),
        "refused for another reason: {status:?}"
    );
    let v = cluster.verify(&cluster.cp, MEASUREMENTS_MEMBER)?;
    member(&v, &cluster.cluster_id, &cluster.cp)?;
    pass("second-init-refused", t);
    Ok(())
}

/// A copy of `image` with one byte of the UKI command line changed.
fn changed_image(image: &Path, out: &Path) -> TestResult {
    let mut bytes = std::fs::read(image)?;
    let at = bytes
        .windows(CMDLINE.len())
        .position(|w| w == CMDLINE)
        .ok_or_else(|| {
            format!(
                "the UKI command line {CMDLINE:?} is not in {}",
                image.display()
            )
        })?;
    bytes[at + CMDLINE_CHANGED_AT] = b'T';
    std::fs::write(out, bytes)?;
    Ok(())
}

/// Scenarios 2 and 3: both nodes boot in parallel; each must attest
/// validly, differ from the join service's policy exactly in the expected
/// PCRs, and still be outside the cluster after trying to join.
fn refused_nodes(cluster: &Cluster) -> TestResult {
    let t = Instant::now();
    let mut other_config = cluster.node_config("keel-other-config", Role::Worker);
    // Same cluster otherwise: only the cluster part, PCR 12, differs.
    other_config.cluster.init_port = 9001;
    let mut config_node =
        cluster.add_node("other-config", other_config, cluster.image.disk(), 9001)?;
    let image = cluster.path("other-image/keel.raw");
    std::fs::create_dir_all(cluster.path("other-image"))?;
    changed_image(&cluster.image.disk(), &image)?;
    let image_config = cluster.node_config("keel-other-image", Role::Worker);
    let mut image_node = cluster.add_node("other-image", image_config, image, 9000)?;
    config_node.boot(cluster.accel)?;
    image_node.boot(cluster.accel)?;

    let config_refused = refused(cluster, &config_node)?;
    assert_eq!(
        config_refused,
        [12],
        "other config: expected a refusal on PCR 12 alone; see {}",
        config_node.dir.join("verify.json").display()
    );
    pass("other-config-refused-pcr12", t);
    let image_refused = refused(cluster, &image_node)?;
    assert!(
        image_refused.contains(&4) && image_refused.iter().all(|p| [4, 9, 11].contains(p)),
        "changed image: expected a refusal on PCR 4 (and at most 9, 11), got {image_refused:?}; see {}",
        image_node.dir.join("verify.json").display()
    );
    pass("changed-image-refused-pcr4", t);
    Ok(())
}

/// Waits until `node` is ready and its join client has had
/// [`JOIN_WINDOW`]; then judges its attestation by the join service's
/// policy (the measurements `keel init` gave it: PCRs 4, 9, 11, 12 and
/// PCR 15 zero). Returns the enforced PCRs that differ, after checking
/// that the document itself is valid and the node is in no cluster.
fn refused(cluster: &Cluster, node: &Node) -> TestResult<Vec<u32>> {
    let (_, ready) = node.wait_for(&[READY_LINE], cluster.patience)?;
    let since_ready = node.vm()?.uptime().saturating_sub(ready);
    std::thread::sleep(JOIN_WINDOW.saturating_sub(since_ready));
    let v = cluster.verify(node, MEASUREMENTS)?;
    let report = node.dir.join("verify.json");
    assert!(
        v.report.attested,
        "{}: no valid attestation ({:?}); see {} and {}",
        node.short,
        v.report.error,
        report.display(),
        node.serial_log().display()
    );
    assert!(
        !v.success && !v.report.verified,
        "{}: keel verify accepted it; see {}",
        node.short,
        report.display()
    );
    assert_eq!(
        v.report.pcr(PCR_CLUSTER_ID),
        Some(ZERO),
        "{}: PCR 15 is set: it joined; see {}",
        node.short,
        node.serial_log().display()
    );
    assert_eq!(v.report.cluster_id(), None, "{}: it locked", node.short);
    Ok(v.report.refused_pcrs())
}

/// The worker loses power and boots again on the same TPM, firmware
/// variables and state disk: it rejoins (IssueRejoinTicket), its disk is
/// the same LUKS volume, and it verifies as a member again.
fn worker_rejoins(cluster: &mut Cluster) -> TestResult {
    let t = Instant::now();
    let disk = cluster.worker.state_disk();
    let uuid = disk::luks_uuid(&disk)?;
    cluster.worker.kill();
    cluster.worker.boot(cluster.accel)?;
    let (which, _) = cluster.worker.wait_for(
        &[REJOINED_LINE, JOINED_LINE, JOIN_FAILED_LINE],
        cluster.patience,
    )?;
    assert_eq!(
        which,
        0,
        "the worker did not rejoin; see {}",
        cluster.worker.serial_log().display()
    );
    let v = cluster.verify(&cluster.worker, MEASUREMENTS_MEMBER)?;
    member(&v, &cluster.cluster_id, &cluster.worker)?;
    assert_eq!(
        disk::luks_uuid(&disk)?,
        uuid,
        "the state disk was formatted again instead of reopened"
    );
    pass("worker-reboot-rejoin", t);
    Ok(())
}

/// Both state disks are LUKS2 and open with the key derived on the host
/// from the master secret (and not with the other disk's key); no disk
/// key, the init secret or the master secret is in any log.
fn disks_and_secrets(cluster: &Cluster) -> TestResult {
    let t = Instant::now();
    let master = cluster.master_secret()?;
    let mut keys = Vec::new();
    for node in [&cluster.cp, &cluster.worker] {
        let disk = node.state_disk();
        assert!(disk::is_luks2(&disk)?, "{} is not LUKS2", disk.display());
        let key = master.disk_key(&disk::luks_uuid(&disk)?)?;
        assert!(
            disk::opens_with(&disk, &key, &node.dir)?,
            "the key derived for {} does not open it",
            disk.display()
        );
        keys.push(key);
    }
    // The check can fail: each disk refuses the other's key.
    assert!(!disk::opens_with(
        &cluster.cp.state_disk(),
        &keys[1],
        &cluster.cp.dir
    )?);
    assert!(!disk::opens_with(
        &cluster.worker.state_disk(),
        &keys[0],
        &cluster.worker.dir
    )?);

    let b64 = base64::engine::general_purpose::STANDARD;
    let mut secrets: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        secrets.push((format!("disk key {i} (hex)"), hex::encode(key).into_bytes()));
        secrets.push((
            format!("disk key {i} (base64)"),
            b64.encode(key).into_bytes(),
        ));
    }
    secrets.push((
        "init secret".into(),
        std::fs::read(cluster.path("init-secret"))?,
    ));
    secrets.push(("master secret".into(), master.key.clone().into_bytes()));
    let logs = cluster.logs()?;
    assert!(logs.len() >= 8, "too few logs found: {logs:?}");
    for log in &logs {
        let text = std::fs::read(log)?;
        for (what, secret) in &secrets {
            assert!(
                !text.windows(secret.len()).any(|w| w == secret.as_slice()),
                "the {what} appears in {}",
                log.display()
            );
        }
    }
    pass("state-disks-luks2-no-secret-in-logs", t);
    Ok(())
}
