//! The end-to-end scenarios on the local cluster, in order, on one cluster
//! brought up once (`keel_e2e::mini`: control planes `keel-cp-0` and
//! `keel-cp-1`, worker `keel-worker-0`; every node config lists both join
//! endpoints):
//!
//! 1. happy path: `keel init` over aTLS on `keel-cp-0`; `keel-cp-1` and the
//!    worker join; all three verify as members of the cluster `keel init`
//!    reported, with the same PCR 15, and on each a locally built image ran
//!    in containerd, whose data is on the LUKS2 state disk;
//! 2. a node with another cluster config is refused: its attestation,
//!    judged by the join service's policy, differs in PCR 12, and it stays
//!    out of the cluster (PCR 15 zero);
//! 3. a node whose UKI command line differs in one byte is refused the same
//!    way on PCRs 4, 9 and 11;
//! 4. a second init gets FailedPrecondition;
//! 5. the worker, killed and booted again on the same TPM and disk,
//!    rejoins through IssueRejoinTicket with its state disk reopened (same
//!    LUKS header); 2, 3 and 5 boot their three VMs at once;
//! 6. every state disk is LUKS2 and opens with the key the host derives
//!    from the master secret, and no disk key, init secret or master secret
//!    appears in any log (run last, so it reads every log of 1-10);
//! 7. `keel-cp-1` joined through `keel-cp-0` and serves joins: with
//!    `keel-cp-0` stopped (8), a new worker joins with a ticket from
//!    `keel-cp-1`;
//! 8. `keel-cp-0` loses power; the worker reboots and rejoins with a ticket
//!    from `keel-cp-1` (7 and 8 boot their VMs at once);
//! 9. `keel-cp-0` boots again and rejoins through `keel-cp-1`, its state
//!    disk reopened, and serves joins again;
//! 10. every node loses power and boots again: no join service answers;
//!     `keel recover` with `keel init`'s workspace brings `keel-cp-0` back
//!     (same cluster ID, same disk) and the others rejoin through it;
//! 11. `keel upgrade apply --kubernetes v1.32.9` (after 10): both control
//!     planes, then the worker, move from v1.31.13 to v1.32.9 (stand-ins
//!     of that version, with their own hashes); each node's attested event
//!     log then ends with the new version's components, and the worker,
//!     rebooted, rejoins and measures the v1.32.9 components again from the
//!     version recorded on its state disk;
//! 12. continuous attestation and revocation (after 10, before 6): `keel
//!     status` on both control planes lists every node `trusted` with
//!     recent evidence (the local cluster's interval is 10 s); `keel revoke
//!     keel-worker-0` puts it on both revocation lists; the worker reboots
//!     and its rejoin is refused by every control plane, naming the
//!     revocation, and it stays out of the cluster (PCR 15 zero); `keel
//!     status` then lists the control planes `trusted` and the worker
//!     revoked.
//!
//! Results are read from `keel verify -o json` (PCR 15 and the cluster-ID
//! event), `keel recover -o json`, exit statuses, gRPC status codes and the
//! disks themselves; console lines only tell when to look, and which
//! control plane issued a ticket; the container check's structured (JSON)
//! report comes on the console as part of kubeadm's output
//! (`keel_testkit::container`). Each scenario prints `PASS <name>
//! <seconds>`; 8 and 10 also print the failover and recovery times.
//!
//! Under TCG a kernel now and then stalls before its initrd runs (RCU stall
//! reports on the console, then nothing). Every boot here waits for the
//! initrd's line first, and a boot without it four minutes after QEMU
//! started is cut and booted again on the same TPM, variables and disk,
//! as `keel-mini` does for the cluster's first boots
//! (`Node::wait_until_started`).
//!
//! Opt-in: set `KEEL_IMAGE_DIR` (`make e2e` does); without it the test
//! says so and passes.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use keel_e2e::image::IMAGE_DIR_VAR;
use keel_e2e::mini::cluster::{
    JOINED_LINE, JOIN_FAILED_LINE, JOIN_SERVICE_LINE, JOIN_SERVICE_PATIENCE, RECOVERED_LINE,
    REJOINED_LINE, TICKET_ISSUER_MARK,
};
use keel_e2e::mini::config::{
    GUEST_INIT_PORT, KUBERNETES_VERSION, MEASUREMENTS, MEASUREMENTS_MEMBER, PCR_CLUSTER_ID,
    UPGRADE_VERSION,
};
use keel_e2e::mini::operator::REVOKED_MARK;
use keel_e2e::mini::verify::Verification;
use keel_e2e::mini::{disk, procs, Cluster, Node, UpOptions};
use keel_e2e::report::READY_LINE;
use keel_verifier::config::Role;

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// The join services a node tries: `keel-cp-0`'s and `keel-cp-1`'s.
const JOIN_SERVICES: usize = 2;
/// How long a refused node's join client runs before it is checked to be
/// still outside the cluster. A node the service admits is locked (PCR 15
/// set) within seconds of its first attempt, made as soon as it is ready.
const JOIN_WINDOW: Duration = Duration::from_secs(30);
/// Pause between looks at a booting node's init port.
const POLL: Duration = Duration::from_secs(2);
/// The UKI command line as the image has it, and the byte changed in it:
/// "quiet" becomes "quieT", an unknown parameter the kernel passes on.
const CMDLINE: &[u8] = b" console=ttyS0 quiet ";
const CMDLINE_CHANGED_AT: usize = 19;

/// The agent's line once the tmpfs its components are installed in and the
/// state disk inside it are mounted.
const COMPONENTS_IN_MEMORY_LINE: &str = "components run from memory (/run/state, tmpfs)";

const ZERO: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn pass(name: &str, since: Instant) {
    println!("PASS {name} {:.1}", since.elapsed().as_secs_f64());
}

/// What every member of the cluster attests: the cluster ID `keel init`
/// reported (the data of its cluster-ID event) and the PCR 15 that event
/// gives, the same on every node and after every rejoin or recovery.
struct Lock {
    cluster_id: String,
    pcr15: String,
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
    let mut processes = cluster.processes();

    let lock = happy_path(&cluster, started)?;
    second_init(&cluster, &lock)?;
    let reboot = WorkerReboot::start(&mut cluster)?;
    refused_nodes(&cluster)?;
    reboot.check(&mut cluster, &lock)?;
    let cp0_restart = first_control_plane_down(&mut cluster, &lock)?;
    first_control_plane_rejoins(&cluster, &lock, cp0_restart)?;
    processes.extend(cluster.processes());
    all_down_recovery(&mut cluster, &lock)?;
    processes.extend(cluster.processes());
    kubernetes_upgrade(&mut cluster, &lock)?;
    processes.extend(cluster.processes());
    revoked_worker(&mut cluster)?;
    processes.extend(cluster.processes());
    disks_and_secrets(&cluster)?;
    println!(
        "e2e: {:.1} s in all, cluster up included",
        started.elapsed().as_secs_f64()
    );

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

/// Every node verifies as a member of the cluster `keel init` reported,
/// that ID is the one the master secret gives, and all three nodes have
/// the same PCR 15.
fn happy_path(cluster: &Cluster, started: Instant) -> TestResult<Lock> {
    let expected = cluster.master_secret()?.cluster_id()?;
    assert_eq!(
        cluster.cluster_id, expected,
        "keel init reported another cluster ID than its master secret gives"
    );
    let v = cluster.verify(&cluster.cp, MEASUREMENTS_MEMBER)?;
    let lock = Lock {
        cluster_id: cluster.cluster_id.clone(),
        pcr15: v.report.pcr(PCR_CLUSTER_ID).unwrap_or(ZERO).to_owned(),
    };
    for node in cluster.nodes() {
        let v = cluster.verify(node, MEASUREMENTS_MEMBER)?;
        member(&v, &lock, node)?;
        assert!(
            v.report.components() > 0,
            "{}: no component in the event log; see {}",
            node.short,
            node.dir.join("verify.json").display()
        );
        container_runtime(node)?;
        // What the node runs is installed in memory, not on the disk.
        node.wait_for(&[COMPONENTS_IN_MEMORY_LINE], Duration::from_secs(1))?;
    }
    pass("happy-path", started);
    Ok(lock)
}

/// The node's container runtime, as the stand-in kubeadm's preflight found
/// it: containerd answered, the image built and imported on the node ran
/// and printed its message, the image's snapshot and containerd's open
/// metadata database are on the LUKS2 state disk, containerd became active
/// only after that disk was mounted, and the stand-in and the component
/// directories are in memory.
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

/// `v` shows a member of the cluster: verified, locked by the cluster-ID
/// event of `lock`'s ID, PCR 15 nonzero and equal to `lock`'s.
fn member(v: &Verification, lock: &Lock, node: &Node) -> TestResult {
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
        Some(lock.cluster_id.as_str()),
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
    assert_eq!(
        v.report.pcr(PCR_CLUSTER_ID),
        Some(lock.pcr15.as_str()),
        "{}: PCR 15 differs from keel-cp-0's after init; see {}",
        node.short,
        report.display()
    );
    Ok(())
}

/// `node` verifies as a member now.
fn verify_member(cluster: &Cluster, node: &Node, lock: &Lock) -> TestResult {
    let v = cluster.verify(node, MEASUREMENTS_MEMBER)?;
    member(&v, lock, node)
}

/// Waits until `node` joined (`expect` = [`JOINED_LINE`]) or rejoined
/// ([`REJOINED_LINE`]) and returns when (since its QEMU started) and the
/// endpoint it logged as its ticket's issuer.
fn joined(cluster: &Cluster, node: &Node, expect: &str) -> TestResult<(Duration, String)> {
    let outcomes = [JOINED_LINE, REJOINED_LINE, JOIN_FAILED_LINE];
    let (which, at) = node.wait_for(&outcomes, cluster.patience)?;
    assert_eq!(
        outcomes[which],
        expect,
        "{}: expected {expect:?}; see {}",
        node.short,
        node.serial_log().display()
    );
    let issuer = node.ticket_issuer()?.ok_or_else(|| {
        format!(
            "{}: no \"ticket issued by\" line; see {}",
            node.short,
            node.serial_log().display()
        )
    })?;
    Ok((at, issuer))
}

/// `issuer` (a logged ticket issuer) is control plane `by`'s endpoint.
fn issued_by(cluster: &Cluster, node: &Node, issuer: &str, by: &Node) -> TestResult {
    let expected = by.join_endpoint().ok_or("not a control plane")?;
    let actual = cluster
        .control_plane_at(issuer)
        .map_or_else(|| "no control plane".to_owned(), |n| n.name().to_owned());
    assert_eq!(
        issuer,
        expected,
        "{}: ticket issued by {issuer} ({actual}), not {} ({expected}); see {}",
        node.short,
        by.name(),
        node.serial_log().display()
    );
    Ok(())
}

/// How long ago (on the host clock) `node` printed a line `at` (its QEMU
/// clock).
fn line_age(node: &Node, at: Duration) -> TestResult<Duration> {
    Ok(node.uptime()?.saturating_sub(at))
}

/// A second, valid init request is refused with FailedPrecondition, and
/// the node stays in its cluster.
fn second_init(cluster: &Cluster, lock: &Lock) -> TestResult {
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
    verify_member(cluster, &cluster.cp, lock)?;
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

/// Scenarios 2 and 3: both nodes boot in parallel (with the worker's
/// reboot, scenario 5); each must attest
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
    let mut image_node = cluster.add_node("other-image", image_config, image.clone(), 9000)?;
    config_node.boot(cluster.accel)?;
    image_node.boot(cluster.accel)?;
    config_node.wait_until_started()?;
    image_node.wait_until_started()?;

    let config_refused = refused(cluster, &config_node)?;
    assert_eq!(
        config_refused,
        [12],
        "other config: expected a refusal on PCR 12 alone; see {}",
        config_node.dir.join("verify.json").display()
    );
    pass("other-config-refused-pcr12", t);
    let image_refused = refused(cluster, &image_node)?;
    // The command line is in the UKI (PCR 4), is what the kernel measures
    // as its parameters (PCR 9) and is the `.cmdline` section systemd-stub
    // measures (PCR 11).
    assert_eq!(
        image_refused,
        [4, 9, 11],
        "changed image: expected a refusal on PCRs 4, 9 and 11; see {}",
        image_node.dir.join("verify.json").display()
    );
    pass("changed-image-refused-pcr4", t);
    // The changed image is a full copy of the disk: gone once its VM is,
    // so later scenarios (and a small CI disk) do not carry it.
    drop(config_node);
    drop(image_node);
    if let Err(e) = std::fs::remove_file(&image) {
        eprintln!("removing {}: {e}", image.display());
    }
    Ok(())
}

/// Waits until `node`'s join client has reached a join service and been
/// refused (the node's network comes up well after `keel-agent: ready`
/// on a loaded machine); then judges its attestation by the join
/// service's policy (the measurements `keel init` gave it: PCRs 4, 9, 11,
/// 12 and PCR 15 zero). Returns the enforced PCRs that differ, after
/// checking that the document itself is valid and the node is in no
/// cluster.
fn refused(cluster: &Cluster, node: &Node) -> TestResult<Vec<u32>> {
    let mut judged_by = BTreeSet::new();
    node.vm()?.wait_for_line_where(
        |line| {
            judged_by.extend(refused_join_attempt(line).map(str::to_owned));
            judged_by.len() == JOIN_SERVICES
        },
        "a refused join attempt at each join service",
        cluster.patience,
    )?;
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

/// The join service of a join client's line for an attempt that got as
/// far as an attestation verdict: the service refused this node, or this
/// node refused the service (a changed image expects other peers). `None`
/// for any other line, a connection that failed (`Connection refused (os
/// error 111)` included).
fn refused_join_attempt(line: &str) -> Option<&str> {
    let (_, rest) = line.split_once("no join ticket from this endpoint endpoint=")?;
    let (endpoint, error) = rest.split_once(' ')?;
    let judged = (error.contains("refused") && !error.contains("os error"))
        || error.contains("instead of accepting this client's attestation");
    judged.then_some(endpoint)
}

#[test]
fn a_refused_join_attempt_is_told_from_an_unreachable_service() {
    let line = |error: &str| {
        format!(
            "keel-agent[150]: 2026-11-27T07:02:23Z  WARN keel_agent::join::client: \
             no join ticket from this endpoint endpoint=10.0.2.2:45411 error=connecting \
             to the join service: {error}"
        )
    };
    for judged in [
        "the server refused this client (TLS alert HandshakeFailure); the server's log has the reason",
        "the server's attestation was refused: attestation document rejected: measurements do not match",
        "the server closed the connection instead of accepting this client's attestation; the server's log has the reason",
    ] {
        assert_eq!(refused_join_attempt(&line(judged)), Some("10.0.2.2:45411"), "{judged}");
    }
    for unreachable in [
        "connecting to the server failed: Network unreachable (os error 101)",
        "connecting to the server failed: Connection refused (os error 111)",
        "the aTLS connection did not finish within 30s",
    ] {
        assert_eq!(
            refused_join_attempt(&line(unreachable)),
            None,
            "{unreachable}"
        );
    }
    assert_eq!(
        refused_join_attempt("keel_agent::join::client: retrying the join ticket pause_ms=539"),
        None
    );
}

/// Scenario 5, started before the refused nodes boot so that the three
/// boots overlap: the worker loses power and boots again on the same TPM,
/// firmware variables and state disk.
struct WorkerReboot {
    since: Instant,
    uuid: String,
}

impl WorkerReboot {
    fn start(cluster: &mut Cluster) -> TestResult<Self> {
        let since = Instant::now();
        let uuid = disk::luks_uuid(&cluster.worker.state_disk())?;
        cluster.worker.kill();
        cluster.worker.boot(cluster.accel)?;
        Ok(Self { since, uuid })
    }

    /// It rejoined (IssueRejoinTicket, from either control plane), its disk
    /// is the same LUKS volume, and it verifies as a member again.
    fn check(self, cluster: &mut Cluster, lock: &Lock) -> TestResult {
        cluster.worker.wait_until_started()?;
        joined(cluster, &cluster.worker, REJOINED_LINE)?;
        verify_member(cluster, &cluster.worker, lock)?;
        assert_eq!(
            disk::luks_uuid(&cluster.worker.state_disk())?,
            self.uuid,
            "the state disk was formatted again instead of reopened"
        );
        pass("worker-reboot-rejoin", self.since);
        Ok(())
    }
}

/// Scenarios 7 and 8. `keel-cp-1` joined through `keel-cp-0` while the
/// cluster came up and serves joins. Then `keel-cp-0` loses power; at once
/// the worker is booted again and a new worker boots: both can only get a
/// ticket from `keel-cp-1`, the new one by IssueJoinTicket (7), the worker
/// by IssueRejoinTicket with its disk reopened (8). Once both hold their
/// tickets `keel-cp-0` boots again (scenario 9 goes on with it); the
/// returned instant is when.
fn first_control_plane_down(cluster: &mut Cluster, lock: &Lock) -> TestResult<Instant> {
    let t7 = Instant::now();
    let (_, issuer) = joined(cluster, &cluster.cp1, JOINED_LINE)?;
    issued_by(cluster, &cluster.cp1, &issuer, &cluster.cp)?;
    cluster
        .cp1
        .wait_for(&[JOIN_SERVICE_LINE], JOIN_SERVICE_PATIENCE)?;
    verify_member(cluster, &cluster.cp1, lock)?;

    let uuid = disk::luks_uuid(&cluster.worker.state_disk())?;
    let killed = Instant::now();
    cluster.cp.kill();
    cluster.worker.kill();
    cluster.worker.boot(cluster.accel)?;
    let config = cluster.node_config("keel-worker-1", Role::Worker);
    let mut fresh = cluster.add_node("worker1", config, cluster.image.disk(), GUEST_INIT_PORT)?;
    fresh.boot(cluster.accel)?;
    cluster.worker.wait_until_started()?;
    fresh.wait_until_started()?;

    // Neither may get its ticket from keel-cp-0, so it stays down until
    // both hold one.
    for node in [&cluster.worker, &fresh] {
        node.wait_for(&[TICKET_ISSUER_MARK], cluster.patience)?;
    }
    let cp0_restart = Instant::now();
    cluster.cp.boot(cluster.accel)?;
    cluster.cp.wait_until_started()?;

    let (_, issuer) = joined(cluster, &fresh, JOINED_LINE)?;
    issued_by(cluster, &fresh, &issuer, &cluster.cp1)?;
    verify_member(cluster, &fresh, lock)?;
    pass("second-control-plane-serves-joins", t7);

    let (at, issuer) = joined(cluster, &cluster.worker, REJOINED_LINE)?;
    let failover = killed
        .elapsed()
        .saturating_sub(line_age(&cluster.worker, at)?);
    let (_, ready) = cluster.worker.wait_for(&[READY_LINE], cluster.patience)?;
    issued_by(cluster, &cluster.worker, &issuer, &cluster.cp1)?;
    verify_member(cluster, &cluster.worker, lock)?;
    assert_eq!(
        disk::luks_uuid(&cluster.worker.state_disk())?,
        uuid,
        "the worker's state disk was formatted again instead of reopened"
    );
    pass("control-plane-down-worker-rejoins-through-cp1", killed);
    println!(
        "  keel-cp-0 killed -> worker rejoined through keel-cp-1: {:.1} s \
         (its reboot included; agent ready -> rejoined: {:.1} s)",
        failover.as_secs_f64(),
        at.saturating_sub(ready).as_secs_f64()
    );
    Ok(cp0_restart)
}

/// Scenario 9: `keel-cp-0`, booting again since `since` on the same TPM,
/// variables and disk, rejoins with a ticket from `keel-cp-1` (the only
/// control plane serving), reopens its state disk, verifies as a member
/// and serves joins again.
fn first_control_plane_rejoins(cluster: &Cluster, lock: &Lock, since: Instant) -> TestResult {
    let cp = &cluster.cp;
    let uuid = disk::luks_uuid(&cp.state_disk())?;
    let (_, issuer) = joined(cluster, cp, REJOINED_LINE)?;
    issued_by(cluster, cp, &issuer, &cluster.cp1)?;
    cp.wait_for(&[JOIN_SERVICE_LINE], JOIN_SERVICE_PATIENCE)?;
    verify_member(cluster, cp, lock)?;
    assert_eq!(
        disk::luks_uuid(&cp.state_disk())?,
        uuid,
        "keel-cp-0's state disk was formatted again instead of reopened"
    );
    pass("first-control-plane-rejoins-through-cp1", since);
    Ok(())
}

/// Waits until `node`'s init port presents a valid attestation (its agent
/// runs; after a power cut that port serves recovery) and returns it,
/// judged as a fresh node.
fn attested(cluster: &Cluster, node: &Node) -> TestResult<Verification> {
    let deadline = Instant::now() + cluster.patience;
    loop {
        let v = cluster.verify(node, MEASUREMENTS)?;
        if v.report.attested {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{}: no attestation on its init port within {:?} ({:?}); see {}",
                node.short,
                cluster.patience,
                v.report.error,
                node.serial_log().display()
            )
            .into());
        }
        std::thread::sleep(POLL);
    }
}

/// Scenario 10: every node loses power and boots again at once, so no
/// join service answers. `keel-cp-0` attests as a fresh node (PCR 15
/// zero); `keel recover` with `keel init`'s workspace brings it back: same
/// cluster ID and PCR 15, same disk, serving joins; `keel-cp-1` and the
/// worker then rejoin, `keel-cp-1` through it (the worker through either
/// control plane, whichever answers it first).
fn all_down_recovery(cluster: &mut Cluster, lock: &Lock) -> TestResult {
    let t = Instant::now();
    let mut uuids = Vec::new();
    for node in cluster.nodes() {
        uuids.push(disk::luks_uuid(&node.state_disk())?);
    }
    for node in [&mut cluster.cp, &mut cluster.cp1, &mut cluster.worker] {
        node.kill();
    }
    for node in [&mut cluster.cp, &mut cluster.cp1, &mut cluster.worker] {
        node.boot(cluster.accel)?;
    }
    for node in [&mut cluster.cp, &mut cluster.cp1, &mut cluster.worker] {
        node.wait_until_started()?;
    }
    let cp = &cluster.cp;
    let fresh = attested(cluster, cp)?;
    assert!(
        fresh.success && fresh.report.pcr(PCR_CLUSTER_ID) == Some(ZERO),
        "keel-cp-0 after the power cut: not a fresh node with PCR 15 zero; see {}",
        cp.dir.join("verify.json").display()
    );

    let recover_at = cp.uptime()?;
    let recovery = cluster.recover(cp)?;
    let recover_log = cp.dir.join("recover.log");
    assert!(
        recovery.success,
        "keel recover failed; see {} and {}",
        recover_log.display(),
        cp.serial_log().display()
    );
    let report = recovery.report.ok_or_else(|| {
        format!(
            "keel recover printed no report; see {}",
            recover_log.display()
        )
    })?;
    assert_eq!(
        report.cluster_id,
        lock.cluster_id,
        "keel recover reported another cluster ID; see {}",
        recover_log.display()
    );
    cp.wait_for(&[RECOVERED_LINE], cluster.patience)?;
    let (_, serving) = cp.wait_for(&[JOIN_SERVICE_LINE], JOIN_SERVICE_PATIENCE)?;
    verify_member(cluster, cp, lock)?;

    let (_, issuer) = joined(cluster, &cluster.cp1, REJOINED_LINE)?;
    issued_by(cluster, &cluster.cp1, &issuer, cp)?;
    cluster
        .cp1
        .wait_for(&[JOIN_SERVICE_LINE], JOIN_SERVICE_PATIENCE)?;
    let (_, issuer) = joined(cluster, &cluster.worker, REJOINED_LINE)?;
    let worker_issuer = cluster.control_plane_at(&issuer).ok_or_else(|| {
        format!(
            "the worker's ticket came from {issuer}, no control plane; see {}",
            cluster.worker.serial_log().display()
        )
    })?;
    for (node, uuid) in cluster.nodes().into_iter().zip(&uuids) {
        verify_member(cluster, node, lock)?;
        assert_eq!(
            &disk::luks_uuid(&node.state_disk())?,
            uuid,
            "{}: the state disk was formatted again instead of reopened",
            node.short
        );
    }
    pass("all-down-recover-then-rejoin", t);
    println!(
        "  keel recover -> keel-cp-0 serving joins: {:.1} s; the worker rejoined through {}",
        serving.saturating_sub(recover_at).as_secs_f64(),
        worker_issuer.name()
    );
    Ok(())
}

/// The kubelet URL of `version` in a node's component events.
fn kubelet_of(version: &str) -> String {
    format!("/{version}/bin/linux/amd64/kubelet")
}

/// Whether the node's attested log names the kubelet of `version` last.
fn runs(v: &Verification, version: &str) -> bool {
    v.report
        .events
        .iter()
        .filter(|e| e.event_type == keel_verifier::measurement::EventType::Component)
        .rfind(|e| e.description.contains("/bin/linux/amd64/kubelet"))
        .is_some_and(|e| e.description.contains(&kubelet_of(version)))
}

/// Scenario 11: every node moves to the next Kubernetes version with
/// `keel upgrade apply`; their attested logs show it; the worker, rebooted,
/// rejoins at that version.
fn kubernetes_upgrade(cluster: &mut Cluster, lock: &Lock) -> TestResult {
    let t = Instant::now();
    for node in cluster.nodes() {
        let v = attested(cluster, node)?;
        assert!(
            runs(&v, KUBERNETES_VERSION),
            "{} does not run {KUBERNETES_VERSION}",
            node.name()
        );
    }
    assert!(
        cluster.upgrade_kubernetes()?,
        "keel upgrade apply failed; see {}",
        cluster.path("upgrade.log").display()
    );
    let upgraded = t.elapsed();
    for node in cluster.nodes() {
        let v = cluster.verify(node, MEASUREMENTS_MEMBER)?;
        member(&v, lock, node)?;
        assert!(
            runs(&v, UPGRADE_VERSION),
            "{}'s attested event log does not end with the {UPGRADE_VERSION} kubelet; see {}",
            node.name(),
            cluster.path("upgrade.log").display()
        );
    }
    let reboot = Instant::now();
    cluster.worker.kill();
    cluster.worker.boot(cluster.accel)?;
    cluster.worker.wait_until_started()?;
    let worker = &cluster.worker;
    worker.wait_for(&[REJOINED_LINE], cluster.patience)?;
    let v = cluster.verify(worker, MEASUREMENTS_MEMBER)?;
    member(&v, lock, worker)?;
    assert!(
        runs(&v, UPGRADE_VERSION),
        "the rebooted worker did not measure the {UPGRADE_VERSION} components again; see {}",
        worker.serial_log().display()
    );
    println!(
        "  keel upgrade apply (3 nodes) {:.1} s, {:.1} s per node; worker reboot -> rejoined at {UPGRADE_VERSION}: {:.1} s",
        upgraded.as_secs_f64(),
        upgraded.as_secs_f64() / 3.0,
        reboot.elapsed().as_secs_f64()
    );
    pass("kubernetes-upgrade", t);
    Ok(())
}

/// How long `keel status` may take to show every node trusted: a few
/// evidence intervals after the nodes rejoined.
const EVIDENCE_PATIENCE: Duration = Duration::from_secs(120);

/// Waits until both control planes list every node of the cluster with the
/// verdict `trusted`.
fn all_trusted(cluster: &Cluster) -> TestResult<keel_e2e::mini::operator::Status> {
    let deadline = Instant::now() + EVIDENCE_PATIENCE;
    loop {
        let status = cluster.status()?;
        let trusted = status.control_planes.len() == 2
            && status.control_planes.iter().all(|view| {
                cluster.nodes().iter().all(|node| {
                    view.registry
                        .node(node.name())
                        .is_some_and(|n| n.verdict == "trusted" && n.last_evidence_at.is_some())
                })
            });
        if trusted {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "not every node is trusted by both control planes within {EVIDENCE_PATIENCE:?}: {status:#?}; see {}",
                cluster.path("status.log").display()
            )
            .into());
        }
        std::thread::sleep(POLL);
    }
}

/// Scenario 12: every node's evidence reaches both control planes; `keel
/// revoke keel-worker-0` puts the worker on both revocation lists; after a
/// reboot its rejoin is refused naming the revocation, and it stays out.
fn revoked_worker(cluster: &mut Cluster) -> TestResult {
    let t = Instant::now();
    all_trusted(cluster)?;
    let name = cluster.worker.name().to_owned();
    assert!(
        cluster.revoke(&name)?,
        "keel revoke {name} failed; see {}",
        cluster.path("revoke.log").display()
    );
    cluster.worker.kill();
    cluster.worker.boot(cluster.accel)?;
    cluster.worker.wait_until_started()?;
    let worker = &cluster.worker;
    worker.wait_for(&[REVOKED_MARK], cluster.patience)?;
    std::thread::sleep(JOIN_WINDOW);
    let v = cluster.verify(worker, MEASUREMENTS)?;
    assert_eq!(
        v.report.pcr(PCR_CLUSTER_ID),
        Some(ZERO),
        "the revoked worker is locked into a cluster; see {}",
        worker.serial_log().display()
    );
    let status = cluster.status()?;
    for view in &status.control_planes {
        assert!(
            view.registry.revoked.iter().any(|r| r.name == name),
            "{}: {name} is not on the revocation list: {view:#?}",
            view.endpoint
        );
        for node in [&cluster.cp, &cluster.cp1] {
            let seen = view.registry.node(node.name());
            assert!(
                seen.is_some_and(|n| n.verdict == "trusted"),
                "{}: {} is not trusted: {seen:?}",
                view.endpoint,
                node.name()
            );
        }
        assert!(
            view.registry.node(&name).is_some(),
            "{}: {name} is not listed",
            view.endpoint
        );
    }
    pass("revoked-worker-rejoin-refused", t);
    Ok(())
}

/// Every state disk is LUKS2 and opens with the key derived on the host
/// from the master secret (and not with another disk's key); no disk key,
/// the init secret or the master secret is in any log.
fn disks_and_secrets(cluster: &Cluster) -> TestResult {
    let t = Instant::now();
    let master = cluster.master_secret()?;
    let mut keys = Vec::new();
    let nodes = cluster.nodes();
    for node in nodes {
        let disk = node.state_disk();
        assert!(disk::is_luks2(&disk)?, "{} is not LUKS2", disk.display());
        let ek = cluster
            .verify(node, MEASUREMENTS_MEMBER)?
            .report
            .ek_digest
            .ok_or("keel verify reported no EK digest")?;
        let key = master.disk_key(&disk::luks_uuid(&disk)?, &ek)?;
        assert!(
            disk::opens_with(&disk, &key, &node.dir)?,
            "the key derived for {} does not open it",
            disk.display()
        );
        keys.push(key);
    }
    // The check can fail: each disk refuses the next one's key.
    for (i, node) in nodes.iter().enumerate() {
        let other = &keys[(i + 1) % keys.len()];
        assert!(
            !disk::opens_with(&node.state_disk(), other, &node.dir)?,
            "{} opens with another disk's key",
            node.state_disk().display()
        );
    }

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
