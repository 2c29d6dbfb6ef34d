//! Bringing the local cluster up, phase by phase, and the handles the
//! scenarios use on it: its nodes, `keel verify`, more nodes, reboots.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use keel_testkit::container::ContainerCheck;
use keel_testkit::swtpm::EkCa;
use keel_verifier::config::{NodeConfig, Role};

use super::config::{self, CliSettings};
use super::disk::{self, MasterSecret};
use super::init::{self, InitInputs};
use super::operator;
use super::procs::{self, KeptCluster, KeptNode, KeptProcess, Process};
use super::recover::{self, Recovery};
use super::verify::{self, Verification};
use super::{io, MiniError, Phases};
use crate::image::{workspace_root, ImageDir, IMAGE_DIR_VAR};
use crate::report::{INITRD_STARTED_LINE, READY_LINE};
use crate::timeline::BootTimeline;
use crate::vm::{Accel, Firmware, Vm, VmBuilder, VmError};

/// The Rust target the host tools are built for (`.cargo/config.toml`).
const TARGET: &str = "x86_64-unknown-linux-musl";
/// How long the mirror may take to announce its address.
const MIRROR_PATIENCE: Duration = Duration::from_secs(20);
/// How long the init server may take to listen after the agent is ready.
const INIT_SERVER_PATIENCE: Duration = Duration::from_secs(120);
/// How long a control plane may take to serve joins after it joined,
/// rejoined or was recovered.
pub const JOIN_SERVICE_PATIENCE: Duration = Duration::from_secs(120);
/// How long `keel verify` tries a node that does not answer yet (its
/// network may come up well after its agent is ready on a loaded machine).
const VERIFY_WAIT: Duration = Duration::from_secs(60);
/// The agent's line once its init server listens.
const INIT_SERVER_LINE: &str = "init server listening";
/// How long a boot may take to reach its initrd before it counts as
/// stalled. Under TCG on a loaded machine it takes up to about a minute; a
/// kernel whose second virtual CPU stopped getting timer interrupts (the
/// console shows RCU stall reports, then nothing more) never gets there.
const KERNEL_PATIENCE: Duration = Duration::from_secs(240);
/// What the kernel prints while a CPU stalls.
const RCU_STALL_LINE: &str = "rcu_preempt detected stalls";
/// The agent's line once its join service listens (after init, a join, a
/// rejoin or a recovery).
pub const JOIN_SERVICE_LINE: &str = "join service listening (mutual aTLS)";
/// What a joining node logs before the endpoint that issued its ticket
/// (as its config names it).
pub const TICKET_ISSUER_MARK: &str = "ticket issued by ";
/// The agent's line after a first join.
pub const JOINED_LINE: &str = "this node joined the cluster";
/// The agent's line after a rejoin.
pub const REJOINED_LINE: &str = "rejoined the cluster";
/// The agent's line when a join or rejoin failed after the node lock.
pub const JOIN_FAILED_LINE: &str = "join failed";
/// The agent's line after `keel recover` unlocked it.
pub const RECOVERED_LINE: &str = "recovered the cluster";
/// The workspace `keel init` writes (master secret, kubeconfig, cluster ID).
pub const WORKSPACE: &str = "workspace";
/// Variable bounding each wait for a VM, in seconds (default 600).
pub const PATIENCE_VAR: &str = "KEEL_MINI_PATIENCE_S";

/// How to bring the cluster up.
#[derive(Clone, Debug)]
pub struct UpOptions {
    /// The workspace root (the Makefile's directory).
    pub root: PathBuf,
    /// Where the cluster's files go (`build/mini`).
    pub dir: PathBuf,
    /// The image to boot (`build/image`, or `KEEL_IMAGE_DIR`).
    pub image_dir: PathBuf,
    /// Run `make agent image` first.
    pub build: bool,
    /// Bound on each wait for a VM.
    pub patience: Duration,
    /// Report phases and `keel init`'s output on standard error.
    pub echo: bool,
}

impl UpOptions {
    /// The defaults: `build/mini`, the image in `KEEL_IMAGE_DIR` or
    /// `build/image`, a build first, waits bounded by
    /// `KEEL_MINI_PATIENCE_S` or 600 s.
    pub fn from_env() -> Result<Self, MiniError> {
        let root = workspace_root();
        let image_dir = match std::env::var_os(IMAGE_DIR_VAR) {
            Some(v) if !v.is_empty() => root.join(v),
            _ => root.join("build/image"),
        };
        let patience = match std::env::var(PATIENCE_VAR) {
            Ok(v) => v.parse().map_err(|_| {
                MiniError::Check(format!("{PATIENCE_VAR}={v:?} is not a number of seconds"))
            })?,
            Err(_) => 600,
        };
        Ok(Self {
            dir: root.join("build/mini"),
            root,
            image_dir,
            build: true,
            patience: Duration::from_secs(patience),
            echo: true,
        })
    }
}

/// The host programs the cluster runs, built with the profile of the
/// program that runs the cluster (`keel-mini` from `make demo`: release;
/// the end-to-end test binary: debug).
#[derive(Clone, Debug)]
pub struct Tools {
    /// The operator CLI.
    pub keel: PathBuf,
    /// The stand-in kubeadm/kubelet/kubectl served to the nodes.
    pub standin: PathBuf,
    /// The component mirror.
    pub mirror: PathBuf,
}

impl Tools {
    /// The tools in `root`'s target directory (or `CARGO_TARGET_DIR`), of
    /// this program's profile.
    pub fn locate(root: &Path) -> Self {
        let target =
            std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
        let dir = target.join(TARGET).join(own_profile());
        Self {
            keel: dir.join("keel"),
            standin: dir.join("keel-standin"),
            mirror: dir.join("keel-mini-mirror"),
        }
    }

    fn check(&self) -> Result<(), MiniError> {
        for tool in [&self.keel, &self.standin, &self.mirror] {
            if !tool.is_file() {
                return Err(MiniError::MissingTool {
                    tool: tool.display().to_string(),
                });
            }
        }
        Ok(())
    }
}

/// The cargo profile this program was built with: the name of the
/// directory its executable is in (`deps/` for a test binary is skipped).
fn own_profile() -> String {
    let exe = std::env::current_exe().unwrap_or_default();
    exe.ancestors()
        .skip(1)
        .find(|d| !d.ends_with("deps"))
        .and_then(|d| d.file_name())
        .map_or_else(|| "debug".to_owned(), |n| n.to_string_lossy().into_owned())
}

fn run_checked(mut cmd: Command, what: &str, log: &Path) -> Result<(), MiniError> {
    let status = cmd.status().map_err(|source| MiniError::Spawn {
        program: what.to_owned(),
        source,
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(MiniError::Failed {
            what: what.to_owned(),
            status,
            log: log.to_owned(),
        })
    }
}

/// Removes what cargo sets for the program it runs (`cargo run`, `cargo
/// test`): a build started from here then sees the environment a build
/// from the shell sees, and finds its outputs fresh instead of rebuilding
/// them. `CARGO_HOME`, `CARGO_TARGET_DIR` and cargo's own settings stay.
fn as_from_the_shell(cmd: &mut Command) -> &mut Command {
    const SET_BY_CARGO: [&str; 8] = [
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_CRATE_",
        "CARGO_BIN_",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_RUSTC_CURRENT_DIR",
        "CARGO_TARGET_TMPDIR",
        "CARGO_SBOM_PATH",
    ];
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text == "CARGO" || SET_BY_CARGO.iter().any(|p| key_text.starts_with(p)) {
            cmd.env_remove(&key);
        }
    }
    cmd
}

/// Runs `make <targets>` in `root` as from the shell; `log` is where a
/// failure's details are.
fn make(root: &Path, targets: &[&str], log: &str) -> Result<(), MiniError> {
    let mut make = Command::new("make");
    as_from_the_shell(&mut make)
        .current_dir(root)
        .arg("--no-print-directory")
        .args(targets)
        .stdout(Stdio::inherit());
    run_checked(make, &format!("make {}", targets.join(" ")), Path::new(log))
}

/// The build phase. A release `keel-mini` (`make demo`) runs `make
/// binaries image`: the agent, the initrd's init and the host tools (`keel`,
/// `keel-standin`, `keel-mini-mirror`) in the one cargo invocation `make
/// demo` built them with, so nothing is rebuilt, and the image, cached when
/// unchanged. A debug one (the end-to-end tests) runs `make agent image` and
/// builds the host tools in its own profile. `image` false (`--no-build`)
/// leaves the image out. Their output goes to standard error.
pub fn build(root: &Path, image: bool) -> Result<Tools, MiniError> {
    if own_profile() == "release" {
        let (targets, log): (&[&str], &str) = if image {
            (
                &["binaries", "image"],
                "build/image.log (the image) or cargo's output above",
            )
        } else {
            (&["binaries"], "(cargo's output above)")
        };
        make(root, targets, log)?;
    } else {
        if image {
            make(root, &["agent", "image"], "build/image.log")?;
        }
        let mut build = Command::new("cargo");
        as_from_the_shell(&mut build).current_dir(root).args([
            "build",
            "--locked",
            "--quiet",
            "-p",
            "keel-cli",
            "--bin",
            "keel",
            "-p",
            "keel-testkit",
            "--bin",
            "keel-standin",
            "--bin",
            "keel-mini-mirror",
        ]);
        run_checked(
            build,
            "building the host tools",
            Path::new("(cargo's output above)"),
        )?;
    }
    let tools = Tools::locate(root);
    tools.check()?;
    Ok(tools)
}

fn require_host_tools() -> Result<(), MiniError> {
    for tool in [
        "qemu-system-x86_64",
        "swtpm",
        "swtpm_setup",
        "swtpm_localca",
        "cryptsetup",
        "strip",
    ] {
        let found = std::env::var_os("PATH")
            .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()));
        if !found {
            return Err(MiniError::MissingTool { tool: tool.into() });
        }
    }
    let firmware = Firmware::ovmf();
    if !firmware.code.is_file() {
        return Err(MiniError::MissingTool {
            tool: firmware.code.display().to_string(),
        });
    }
    Ok(())
}

/// One node: its directory (TPM state, state disk, firmware variables,
/// node config, logs), its config, and its VM while it runs.
pub struct Node {
    /// Its directory name under the cluster directory (`cp`, `worker`).
    pub short: String,
    /// Its config, as passed by fw_cfg.
    pub config: NodeConfig,
    /// Its directory.
    pub dir: PathBuf,
    /// Host port forwarded to its init server.
    pub init_port: u16,
    guest_init_port: u16,
    /// Host port forwarded to its join service (control planes).
    join_port: Option<u16>,
    os_disk: PathBuf,
    vm: Option<Vm>,
    boots: u32,
}

impl Node {
    /// The running VM.
    pub fn vm(&self) -> Result<&Vm, MiniError> {
        self.vm
            .as_ref()
            .ok_or_else(|| MiniError::Check(format!("{} is not running", self.short)))
    }

    /// Kills the VM (QEMU, then swtpm), as a power cut would.
    pub fn kill(&mut self) {
        self.vm = None;
    }

    /// The serial log of the current (or last) boot.
    pub fn serial_log(&self) -> PathBuf {
        self.dir.join("serial.log")
    }

    /// The container check the stand-in kubeadm ran on this node during
    /// `init` or `join` (its last report on the console), if any.
    pub fn container_check(&self) -> Option<ContainerCheck> {
        let lines = self.vm.as_ref()?.lines();
        ContainerCheck::from_lines(lines.iter().map(String::as_str))
    }

    /// The state disk image.
    pub fn state_disk(&self) -> PathBuf {
        self.dir.join("state.raw")
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.config.node.name
    }

    /// Its join endpoint as the node configs name it (`10.0.2.2:<host
    /// port>`), if it is a control plane.
    pub fn join_endpoint(&self) -> Option<String> {
        self.join_port.map(config::join_endpoint)
    }

    /// The endpoint that issued the ticket of this boot's last join or
    /// rejoin, as the node logged it (`ticket issued by <endpoint>`).
    pub fn ticket_issuer(&self) -> Result<Option<String>, MiniError> {
        Ok(self
            .vm()?
            .lines()
            .iter()
            .rev()
            .find_map(|l| ticket_issuer(l)))
    }

    /// The time since this boot's QEMU started (the clock of
    /// [`Node::wait_for`]).
    pub fn uptime(&self) -> Result<Duration, MiniError> {
        Ok(self.vm()?.uptime())
    }

    /// Boots the node: its TPM, firmware variables and state disk as they
    /// are; the logs of an earlier boot are kept as `*.bootN.*`.
    pub fn boot(&mut self, accel: Accel) -> Result<(), MiniError> {
        self.boot_niced(accel, 0)
    }

    /// [`Node::boot`] at a lower CPU priority ([`VmBuilder::niceness`]).
    pub fn boot_niced(&mut self, accel: Accel, niceness: i32) -> Result<(), MiniError> {
        if self.boots > 0 {
            for (name, ext) in [("serial", "log"), ("console", "raw"), ("qemu", "log")] {
                let from = self.dir.join(format!("{name}.{ext}"));
                let to = self.dir.join(format!("{name}.boot{}.{ext}", self.boots));
                // A log that is missing has nothing to keep.
                let _ = std::fs::rename(from, to);
            }
        }
        let mut builder = VmBuilder::new(&self.os_disk, &self.dir)
            .accel(accel)
            .tpm_state(self.dir.join("tpm-state"))
            .state_disk(self.state_disk())
            .vars(self.dir.join("vars.fd"))
            .node_config(self.dir.join("node-config.json"))
            .host_forward(self.init_port, self.guest_init_port)
            .niceness(niceness);
        if let Some(port) = self.join_port {
            builder = builder.host_forward(port, config::GUEST_JOIN_PORT);
        }
        self.vm = Some(builder.start()?);
        self.boots += 1;
        Ok(())
    }

    /// Waits for the agent's ready line, for at most `patience`; returns
    /// when it arrived. A boot whose kernel stalled is booted again first
    /// ([`Node::wait_until_started`]).
    pub fn wait_until_ready(&mut self, patience: Duration) -> Result<Duration, MiniError> {
        self.wait_until_started()?;
        Ok(self.wait_for(&[READY_LINE], patience)?.1)
    }

    /// Waits until the node's initrd runs. A boot whose kernel stalled
    /// before it (no initrd line [`KERNEL_PATIENCE`] after QEMU started) is
    /// cut and the node booted once more at normal priority, saying so; the
    /// stalled boot's logs are kept as `*.bootN.*`.
    pub fn wait_until_started(&mut self) -> Result<(), MiniError> {
        let vm = self.vm()?;
        let left = KERNEL_PATIENCE.saturating_sub(vm.uptime());
        match vm.wait_for_line(INITRD_STARTED_LINE, left) {
            Ok(_) => {}
            Err(VmError::Timeout { .. }) => {
                let accel = vm.accel();
                let stalls = vm.lines().iter().any(|l| l.contains(RCU_STALL_LINE));
                eprintln!(
                    "keel-mini: {}: no {INITRD_STARTED_LINE:?} within {KERNEL_PATIENCE:?} of QEMU's start \
                     ({}); booting it again (the stalled boot's serial log: serial.boot{}.log)",
                    self.name(),
                    if stalls {
                        "its kernel reported stalled CPUs"
                    } else {
                        "its kernel did not finish starting"
                    },
                    self.boots
                );
                self.kill();
                self.boot(accel)?;
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Sets the CPU priority of the node's VM ([`Vm::renice`]).
    pub fn renice(&self, niceness: i32) -> Result<(), MiniError> {
        Ok(self.vm()?.renice(niceness)?)
    }

    /// Waits for one of `needles` on the console; fails naming the serial
    /// log when another one (a failure line, by convention the last) comes.
    pub fn wait_for(
        &self,
        needles: &[&str],
        patience: Duration,
    ) -> Result<(usize, Duration), MiniError> {
        Ok(self.vm()?.wait_for_any(needles, patience)?)
    }
}

/// The endpoint in a `ticket issued by <endpoint>` line (a tracing field
/// `endpoint=<endpoint>`, quoted or not, is read the same way).
fn ticket_issuer(line: &str) -> Option<String> {
    let (_, rest) = line.split_once(TICKET_ISSUER_MARK)?;
    let rest = rest.trim_start_matches("endpoint=").trim_start_matches('"');
    let endpoint: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '[' | ']'))
        .collect();
    (!endpoint.is_empty()).then_some(endpoint)
}

/// A TCP port that was free a moment ago, never one this process handed
/// out before (the cluster's host forwards must differ), taken from below
/// the ephemeral range where there is room, so that no outgoing connection
/// holds it by the time QEMU binds it.
pub fn free_port() -> Result<u16, MiniError> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    if let Ok(port) = keel_testkit::free_port() {
        return Ok(port);
    }
    // Too few ports below the ephemeral range (`ip_local_port_range`
    // starts low): one the kernel picks, never one handed out before.
    loop {
        let port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(io("127.0.0.1:0"))?;
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
}

/// The niceness of the VMs that boot beside the first control plane.
const BACKGROUND_NICENESS: i32 = 10;

/// The nodes of the local cluster: directory, Kubernetes name, role.
const NODES: [(&str, &str, Role); 3] = [
    ("cp", "keel-cp-0", Role::ControlPlane),
    ("cp1", "keel-cp-1", Role::ControlPlane),
    ("worker", "keel-worker-0", Role::Worker),
];

/// The running local cluster. Dropping it stops every process it started.
pub struct Cluster {
    /// The cluster's directory.
    pub dir: PathBuf,
    /// The image the nodes boot.
    pub image: ImageDir,
    /// The host tools.
    pub tools: Tools,
    /// The accelerator.
    pub accel: Accel,
    /// Bound on each wait for a VM.
    pub patience: Duration,
    /// The first control plane (`keel-cp-0`, `keel init`ed).
    pub cp: Node,
    /// The second control plane (`keel-cp-1`): joins by itself, then serves
    /// joins too.
    pub cp1: Node,
    /// The worker node.
    pub worker: Node,
    /// The cluster ID `keel init` reported (hex).
    pub cluster_id: String,
    /// The phases so far.
    pub phases: Phases,
    ca: EkCa,
    ek_ca_pem: String,
    secret_hash: String,
    join_ports: Vec<u16>,
    mirror: Option<Process>,
}

impl Cluster {
    /// Brings the cluster up in `opts.dir` (emptied first; a cluster kept
    /// there is stopped): build, EK CA + TPMs, mirror, configs +
    /// measurements, boot (all three VMs at once), `keel init` of the first
    /// control plane, the joins of the second control plane and the worker,
    /// summary. Prints the summary on standard output.
    pub fn up(opts: &UpOptions) -> Result<Self, MiniError> {
        let mut phases = Phases::new(!opts.echo);
        let tools = phases.run("build", || build(&opts.root, opts.build))?;
        let image = ImageDir::open(&opts.image_dir)?;
        require_host_tools()?;
        let dir = &opts.dir;
        if procs::KeptCluster::load(dir)?.is_some() {
            procs::down(dir)?;
        }
        if let Ok(canonical) = dir.canonicalize() {
            let strays = procs::strays(&canonical);
            if !strays.is_empty() {
                eprintln!(
                    "keel-mini: stopping {} processes an earlier run left in {}",
                    strays.len(),
                    canonical.display()
                );
                procs::stop(&strays);
            }
        }
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(dir)(e)),
        }
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let dir = dir.canonicalize().map_err(io(dir))?;

        let (ca, ek_ca_pem) = phases.run("EK CA + TPMs", || {
            let ca = EkCa::in_dir(&dir.join("ca"))?;
            for (short, _, _) in NODES {
                let state = dir.join(short).join("tpm-state");
                std::fs::create_dir_all(&state).map_err(io(&state))?;
                ca.manufacture(&state)?;
            }
            let pem = ca.issuer_pem()?;
            let path = dir.join(config::EK_CA);
            std::fs::write(&path, &pem).map_err(io(&path))?;
            Ok((ca, String::from_utf8_lossy(&pem).into_owned()))
        })?;

        let mirror = phases.run("component mirror", || start_mirror(&dir, &tools))?;

        let (cp, cp1, worker, secret_hash, join_ports) =
            phases.run("configs + measurements", || {
                let secret_hash = config::init_secret(&dir.join(config::INIT_SECRET))?;
                // Every config lists every control plane's join endpoint, so
                // their host ports are chosen first.
                let control_planes = NODES
                    .iter()
                    .filter(|(_, _, role)| *role == Role::ControlPlane)
                    .count();
                let join_ports = (0..control_planes)
                    .map(|_| free_port())
                    .collect::<Result<Vec<_>, _>>()?;
                let mut nodes = Vec::new();
                let mut next_join_port = join_ports.iter();
                for (short, name, role) in NODES {
                    let config =
                        config::node_config(name, role, &secret_hash, &join_ports, &ek_ca_pem);
                    let mut node =
                        new_node(&dir, short, config, image.disk(), config::GUEST_INIT_PORT)?;
                    if role == Role::ControlPlane {
                        node.join_port = next_join_port.next().copied();
                    }
                    nodes.push(node);
                }
                let (Some(worker), Some(cp1), Some(cp)) = (nodes.pop(), nodes.pop(), nodes.pop())
                else {
                    return Err(MiniError::Check("three nodes were made".into()));
                };
                for (file, member) in [
                    (config::MEASUREMENTS, false),
                    (config::MEASUREMENTS_MEMBER, true),
                ] {
                    let m = config::measurements(&image.uki(), &cp.config, member)?;
                    let path = dir.join(file);
                    std::fs::write(&path, m.to_json()).map_err(io(&path))?;
                }
                config::write_json(&dir.join("keel.json"), &CliSettings::init(cp.init_port))?;
                for node in [&cp, &cp1, &worker] {
                    config::write_json(
                        &dir.join(format!("verify-{}.json", node.short)),
                        &CliSettings::verify(node.init_port, config::MEASUREMENTS_MEMBER),
                    )?;
                }
                Ok((cp, cp1, worker, secret_hash, join_ports))
            })?;

        let mut cluster = Self {
            dir,
            image,
            tools,
            accel: Accel::Tcg,
            patience: opts.patience,
            cp,
            cp1,
            worker,
            cluster_id: String::new(),
            phases,
            ca,
            ek_ca_pem,
            secret_hash,
            join_ports,
            mirror: Some(mirror),
        };
        cluster.boot_and_form(opts.echo)?;
        Ok(cluster)
    }

    fn boot_and_form(&mut self, echo: bool) -> Result<(), MiniError> {
        let patience = self.patience;
        let mut phases = std::mem::take(&mut self.phases);
        let result = (|| {
            phases.run("boot control plane", || {
                self.accel = Accel::detect(&Firmware::ovmf());
                // The first control plane and its init are the critical
                // path: the other two boot beside it on what CPU it leaves.
                self.cp.boot(self.accel)?;
                for node in [&mut self.cp1, &mut self.worker] {
                    node.boot_niced(self.accel, BACKGROUND_NICENESS)?;
                }
                if echo {
                    eprintln!(
                        "keel-mini: booting {}, {} and {} at once, the first one first ({:?}; serial logs {}/*/serial.log)",
                        self.cp.name(),
                        self.cp1.name(),
                        self.worker.name(),
                        self.accel,
                        self.dir.display()
                    );
                }
                self.cp.wait_until_ready(patience)?;
                Ok(())
            })?;
            self.cp
                .wait_for(&[INIT_SERVER_LINE], INIT_SERVER_PATIENCE)?;
            phases.run("keel init", || {
                let log = self.dir.join("init.log");
                let ok = init::run_cli(
                    &self.tools.keel,
                    &self.dir.join("keel.json"),
                    &self.dir.join(WORKSPACE),
                    &log,
                    echo,
                )?;
                if !ok {
                    return Err(MiniError::Check(format!(
                        "keel init failed: see {} and {}",
                        log.display(),
                        self.cp.serial_log().display()
                    )));
                }
                self.cluster_id =
                    init::id_file(&self.dir.join(WORKSPACE).join("keel-id.json"))?.cluster_id;
                Ok(())
            })?;
            for node in [&self.cp1, &self.worker] {
                // Without root the joins run at the lower priority: slower,
                // not wrong.
                if let Err(e) = node.renice(0) {
                    eprintln!("keel-mini: {}: {e}", node.name());
                }
            }
            phases.run("joins (cp-1, worker)", || {
                for node in [&mut self.cp1, &mut self.worker] {
                    node.wait_until_ready(patience)?;
                    let (which, _) = node.wait_for(&[JOINED_LINE, JOIN_FAILED_LINE], patience)?;
                    if which != 0 {
                        return Err(MiniError::Check(format!(
                            "{}'s join failed: see {} and {}",
                            node.name(),
                            node.serial_log().display(),
                            self.cp.serial_log().display()
                        )));
                    }
                }
                // A control plane that joined serves joins itself.
                self.cp1
                    .wait_for(&[JOIN_SERVICE_LINE], JOIN_SERVICE_PATIENCE)?;
                Ok(())
            })?;
            let mut text = String::new();
            phases.run("summary", || {
                text = self.summary()?;
                Ok(())
            })?;
            let _ = writeln!(text, "phases:");
            for (name, took) in phases.done() {
                let _ = writeln!(text, "  {name:<28} {:6.1} s", took.as_secs_f64());
            }
            let _ = writeln!(
                text,
                "  {:<28} {:6.1} s",
                "total",
                phases.total().as_secs_f64()
            );
            let serial = std::fs::read_to_string(self.cp.serial_log()).unwrap_or_default();
            match BootTimeline::parse(&serial) {
                Ok(t) => {
                    let _ = write!(text, "{}'s boot:\n{t}", self.cp.name());
                }
                Err(e) => {
                    let _ = writeln!(text, "{}'s boot: no breakdown: {e}", self.cp.name());
                }
            }
            print!("{text}");
            let path = self.dir.join("summary.txt");
            std::fs::write(&path, &text).map_err(io(&path))?;
            Ok(())
        })();
        self.phases = phases;
        result
    }

    /// Verifies every node and describes it, as the summary prints them.
    fn summary(&self) -> Result<String, MiniError> {
        let mut text = String::new();
        let _ = writeln!(text, "\nkeel local cluster ({:?})", self.accel);
        let _ = writeln!(text, "  cluster ID     {}", self.cluster_id);
        let mut unverified = Vec::new();
        for node in self.nodes() {
            let v = self.verify(node, config::MEASUREMENTS_MEMBER)?;
            let r = &v.report;
            let _ = writeln!(
                text,
                "  {:<14} role {:<13} PCR 15 {}",
                node.short,
                node.config.node.role.as_str(),
                r.pcr(config::PCR_CLUSTER_ID).unwrap_or("?")
            );
            let _ = writeln!(
                text,
                "  {:<14} attestation {}, event log {}",
                "",
                if v.success {
                    "verified"
                } else {
                    "NOT verified"
                },
                if r.attested {
                    format!("replays ({} events)", r.events.len())
                } else {
                    "not checked".to_owned()
                }
            );
            let disk = node.state_disk();
            let luks = if disk::is_luks2(&disk)? {
                format!("LUKS2 header on {}/state.raw", node.short)
            } else {
                "NOT LUKS2".to_owned()
            };
            let agent = node
                .vm
                .as_ref()
                .and_then(|vm| agent_disk_line(&vm.lines()))
                .map(|l| format!("; agent: {l}"))
                .unwrap_or_default();
            let _ = writeln!(text, "  {:<14} state disk: {luks}{agent}", "");
            let runtime = match node.container_check() {
                Some(c) if c.problems().is_empty() => c.describe(),
                Some(c) => format!("{} (CHECK FAILED: {})", c.runtime, c.problems().join("; ")),
                None => "no container check on the console".to_owned(),
            };
            let _ = writeln!(text, "  {:<14} container runtime: {runtime}", "");
            let _ = writeln!(
                text,
                "  {:<14} components: {} measured into PCR 13 (attested event log)",
                "",
                r.components()
            );
            if let Some(endpoint) = node.join_endpoint() {
                let _ = writeln!(text, "  {:<14} join service {endpoint}", "");
            }
            if let Some(issuer) = node.ticket_issuer()? {
                let by = self
                    .control_plane_at(&issuer)
                    .map_or_else(|| "?".to_owned(), |n| n.name().to_owned());
                let _ = writeln!(
                    text,
                    "  {:<14} joined with a ticket from {issuer} ({by})",
                    ""
                );
            }
            if !v.success || r.cluster_id().as_deref() != Some(self.cluster_id.as_str()) {
                unverified.push(node.short.clone());
            }
        }
        let _ = writeln!(
            text,
            "  admin kubeconfig {}",
            self.dir.join(WORKSPACE).join("keel-admin.conf").display()
        );
        if !unverified.is_empty() {
            print!("{text}");
            return Err(MiniError::Check(format!(
                "{} did not verify as members of cluster {}: see {}/*/verify.json",
                unverified.join(" and "),
                self.cluster_id,
                self.dir.display()
            )));
        }
        Ok(text)
    }

    /// A path in the cluster's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Every node: the control planes, then the worker.
    pub fn nodes(&self) -> [&Node; 3] {
        [&self.cp, &self.cp1, &self.worker]
    }

    /// The control plane whose join endpoint is `endpoint` (as the configs
    /// name it).
    pub fn control_plane_at(&self, endpoint: &str) -> Option<&Node> {
        self.nodes()
            .into_iter()
            .find(|n| n.join_endpoint().as_deref() == Some(endpoint))
    }

    /// The config a new node of this cluster gets.
    pub fn node_config(&self, name: &str, role: Role) -> NodeConfig {
        config::node_config(
            name,
            role,
            &self.secret_hash,
            &self.join_ports,
            &self.ek_ca_pem,
        )
    }

    /// A new node in `short/` with a TPM from the cluster's EK CA, booting
    /// `os_disk` with `config`, its init server (`guest_init_port`)
    /// forwarded to a host port. Not booted yet.
    pub fn add_node(
        &self,
        short: &str,
        config: NodeConfig,
        os_disk: PathBuf,
        guest_init_port: u16,
    ) -> Result<Node, MiniError> {
        let state = self.dir.join(short).join("tpm-state");
        std::fs::create_dir_all(&state).map_err(io(&state))?;
        self.ca.manufacture(&state)?;
        new_node(&self.dir, short, config, os_disk, guest_init_port)
    }

    /// `keel verify -o json` against `node` with the measurements file
    /// `measurements` (`config::MEASUREMENTS`: as a fresh node, the join
    /// service's policy; `config::MEASUREMENTS_MEMBER`: as a member),
    /// trying for [`VERIFY_WAIT`] while it does not answer. The report is
    /// kept in the node's `verify.json`.
    pub fn verify(&self, node: &Node, measurements: &str) -> Result<Verification, MiniError> {
        let settings = self.dir.join(format!(
            "verify-{}-{}.json",
            node.short,
            measurements.trim_end_matches(".json")
        ));
        config::write_json(
            &settings,
            &CliSettings::verify(node.init_port, measurements),
        )?;
        verify::run(
            &self.tools.keel,
            &settings,
            VERIFY_WAIT,
            &node.dir.join("verify.json"),
        )
    }

    /// `keel recover` against `node` with the workspace `keel init` wrote,
    /// validating it as a fresh node (PCR 15 zero enforced); its output is
    /// kept in the node's `recover.log`.
    pub fn recover(&self, node: &Node) -> Result<Recovery, MiniError> {
        let settings = self.dir.join(format!("recover-{}.json", node.short));
        config::write_json(&settings, &CliSettings::recover(node.init_port))?;
        recover::run(
            &self.tools.keel,
            &settings,
            node.init_port,
            &self.dir.join(WORKSPACE),
            &node.dir.join("recover.log"),
        )
    }

    /// The settings and init ports `keel revoke` and `keel status` use:
    /// both control planes, judged as members.
    fn operator_inputs(&self) -> Result<(PathBuf, Vec<u16>), MiniError> {
        let settings = self.dir.join("operator.json");
        config::write_json(
            &settings,
            &CliSettings::verify(self.cp.init_port, config::MEASUREMENTS_MEMBER),
        )?;
        Ok((settings, vec![self.cp.init_port, self.cp1.init_port]))
    }

    /// `keel revoke node` against both control planes; its output is kept
    /// in `revoke.log`. Returns whether it succeeded.
    pub fn revoke(&self, node: &str) -> Result<bool, MiniError> {
        let (settings, ports) = self.operator_inputs()?;
        operator::revoke(
            &self.tools.keel,
            &settings,
            &self.dir.join(WORKSPACE),
            &ports,
            node,
            &self.dir.join("revoke.log"),
        )
    }

    /// `keel upgrade apply --kubernetes` to [`config::UPGRADE_VERSION`]
    /// (its stand-in components) on every node, control planes first; its
    /// output is kept in `upgrade.log`. Returns whether it succeeded.
    pub fn upgrade_kubernetes(&self) -> Result<bool, MiniError> {
        let (settings, _) = self.operator_inputs()?;
        let ports = [self.cp.init_port, self.cp1.init_port, self.worker.init_port];
        operator::upgrade_kubernetes(
            &self.tools.keel,
            &settings,
            &self.dir.join(WORKSPACE),
            &ports,
            config::UPGRADE_VERSION,
            &self.dir.join(config::UPGRADE_COMPONENTS),
            &self.dir.join("upgrade.log"),
        )
    }

    /// `keel status -o json` against both control planes; its output is
    /// kept in `status.log`.
    pub fn status(&self) -> Result<operator::Status, MiniError> {
        let (settings, ports) = self.operator_inputs()?;
        operator::status(
            &self.tools.keel,
            &settings,
            &self.dir.join(WORKSPACE),
            &ports,
            &self.dir.join("status.log"),
        )
    }

    /// Sends the control plane a second, valid init request and returns its
    /// answer (see [`init::request`]).
    pub fn init_again(&self) -> Result<Result<(), tonic::Status>, MiniError> {
        init::request(&InitInputs {
            port: self.cp.init_port,
            measurements: &self.dir.join(config::MEASUREMENTS_MEMBER),
            ek_ca: &self.dir.join(config::EK_CA),
            init_secret: &self.dir.join(config::INIT_SECRET),
            components: &self.dir.join(config::COMPONENTS),
        })
    }

    /// The master secret `keel init` wrote.
    pub fn master_secret(&self) -> Result<MasterSecret, MiniError> {
        MasterSecret::load(&self.dir.join(WORKSPACE).join("keel-master-secret.json"))
    }

    /// Every log the cluster wrote: serial consoles, QEMU and swtpm logs,
    /// `keel init`'s output, the mirror's log, `keel verify` reports.
    pub fn logs(&self) -> Result<Vec<PathBuf>, MiniError> {
        let mut out = Vec::new();
        let mut dirs = vec![self.dir.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).map_err(io(&dir))? {
                let path = entry.map_err(io(&dir))?.path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "log")
                    || path
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("console."))
                {
                    out.push(path);
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// The long-running processes started so far (VMs' QEMU and swtpm, the
    /// mirror), e.g. to check that none is left after the cluster is dropped.
    pub fn processes(&self) -> Vec<KeptProcess> {
        let mut out = Vec::new();
        for node in self.nodes() {
            if let Some(vm) = &node.vm {
                let pids = vm.pids();
                out.push(KeptProcess {
                    name: format!("{} qemu", node.short),
                    program: "qemu-system-x86_64".into(),
                    pid: pids.qemu,
                });
                if let Some(pid) = pids.swtpm {
                    out.push(KeptProcess {
                        name: format!("{} swtpm", node.short),
                        program: "swtpm".into(),
                        pid,
                    });
                }
            }
        }
        if let Some(mirror) = &self.mirror {
            out.push(KeptProcess {
                name: "mirror".into(),
                program: "keel-mini-mirror".into(),
                pid: mirror.pid(),
            });
        }
        out
    }

    /// Leaves everything running and records it in `state.json` for
    /// `keel-mini status` and `keel-mini down`.
    pub fn keep(mut self) -> Result<PathBuf, MiniError> {
        let processes = self.processes();
        let mut nodes = Vec::new();
        for node in [&mut self.cp, &mut self.cp1, &mut self.worker] {
            if let Some(vm) = node.vm.take() {
                vm.detach();
            }
            nodes.push(KeptNode {
                dir: node.short.clone(),
                name: node.config.node.name.clone(),
                role: node.config.node.role.as_str().into(),
                init_port: node.init_port,
                verify_settings: format!("verify-{}.json", node.short),
            });
        }
        if let Some(mirror) = self.mirror.take() {
            mirror.detach();
        }
        KeptCluster {
            accel: format!("{:?}", self.accel),
            cluster_id: self.cluster_id.clone(),
            join_ports: self.join_ports.clone(),
            nodes,
            processes,
        }
        .save(&self.dir)
    }
}

fn new_node(
    dir: &Path,
    short: &str,
    config: NodeConfig,
    os_disk: PathBuf,
    guest_init_port: u16,
) -> Result<Node, MiniError> {
    let node_dir = dir.join(short);
    std::fs::create_dir_all(&node_dir).map_err(io(&node_dir))?;
    config::write_json(&node_dir.join("node-config.json"), &config)?;
    Ok(Node {
        short: short.to_owned(),
        config,
        dir: node_dir,
        init_port: free_port()?,
        guest_init_port,
        join_port: None,
        os_disk,
        vm: None,
        boots: 0,
    })
}

/// Starts `keel-mini-mirror` serving the stand-in components (a stripped
/// copy of `keel-standin` as kubeadm, kubelet and kubectl) and waits for
/// its address.
fn start_mirror(dir: &Path, tools: &Tools) -> Result<Process, MiniError> {
    let standin = dir.join("keel-standin");
    let mut strip = Command::new("strip");
    strip.arg("-o").arg(&standin).arg(&tools.standin);
    run_checked(strip, "strip keel-standin", &tools.standin)?;
    let log = dir.join("mirror.log");
    let out = std::fs::File::create(&log).map_err(io(&log))?;
    let err = out.try_clone().map_err(io(&log))?;
    let child = Command::new(&tools.mirror)
        .arg("--standin")
        .arg(&standin)
        .args(["--guest-host", config::GUEST_HOST, "--components"])
        .arg(dir.join(config::COMPONENTS))
        .args(["--version", config::KUBERNETES_VERSION])
        .args([
            "--upgrade-version",
            config::UPGRADE_VERSION,
            "--upgrade-components",
        ])
        .arg(dir.join(config::UPGRADE_COMPONENTS))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|source| MiniError::Spawn {
            program: tools.mirror.display().to_string(),
            source,
        })?;
    let mut mirror = Process::new(child);
    let deadline = std::time::Instant::now() + MIRROR_PATIENCE;
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.lines().any(|l| l.starts_with("mirror:")) {
            return Ok(mirror);
        }
        if mirror.exited() || std::time::Instant::now() >= deadline {
            return Err(MiniError::Timeout {
                what: "the component mirror did not announce its address".into(),
                patience: MIRROR_PATIENCE,
                log,
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The agent's last state-disk line, from its `state disk set up (LUKS2)`
/// or `state disk opened (LUKS2)` on (`…, mounted at /run/state/disk;
/// components run from memory (/run/state, tmpfs)`).
fn agent_disk_line(lines: &[String]) -> Option<String> {
    lines.iter().rev().find_map(|line| {
        let at = line
            .find("state disk set up (LUKS2)")
            .or_else(|| line.find("state disk opened (LUKS2)"))?;
        line.get(at..).map(str::to_owned)
    })
}

/// `keel-mini status`: the kept cluster's processes and a `keel verify` of
/// each node. Returns whether everything runs and verifies.
pub fn status(dir: &Path, tools: &Tools) -> Result<bool, MiniError> {
    let Some(kept) = KeptCluster::load(dir)? else {
        return Err(MiniError::NotRunning(dir.join(procs::STATE_FILE)));
    };
    let mut healthy = true;
    println!("keel local cluster ({}) in {}", kept.accel, dir.display());
    println!("  cluster ID     {}", kept.cluster_id);
    for port in &kept.join_ports {
        println!(
            "  join service   127.0.0.1:{port} (guests: {})",
            config::join_endpoint(*port)
        );
    }
    for p in &kept.processes {
        let up = procs::running(p.pid, &p.program);
        healthy &= up;
        println!(
            "  {:<14} pid {:<8} {}",
            p.name,
            p.pid,
            if up { "running" } else { "NOT running" }
        );
    }
    for node in &kept.nodes {
        // What each node shows now: a node that does not answer is
        // reported at once, not waited for.
        let v = verify::run(
            &tools.keel,
            &dir.join(&node.verify_settings),
            Duration::ZERO,
            &dir.join(&node.dir).join("verify.json"),
        )?;
        let member = v.report.cluster_id().as_deref() == Some(kept.cluster_id.as_str());
        healthy &= v.success && member;
        println!(
            "  {:<14} {} {:<13} init 127.0.0.1:{:<5} {}{}",
            node.dir,
            node.name,
            node.role,
            node.init_port,
            if v.success {
                "attestation verified"
            } else {
                "NOT verified"
            },
            if member {
                ", member (PCR 15 = cluster ID)"
            } else {
                ", not a member"
            }
        );
    }
    Ok(healthy)
}

#[cfg(test)]
mod tests {
    use super::ticket_issuer;

    #[test]
    fn ticket_issuer_is_read_from_the_line() {
        for line in [
            "[ 41.2] keel-agent: INFO ticket issued by 10.0.2.2:41234",
            "keel-agent: ticket issued by endpoint=10.0.2.2:41234 kind=rejoin",
            r#"keel-agent: ticket issued by "10.0.2.2:41234", attempt 3"#,
        ] {
            assert_eq!(ticket_issuer(line).as_deref(), Some("10.0.2.2:41234"));
        }
        assert_eq!(ticket_issuer("keel-agent: join attempt failed"), None);
        assert_eq!(ticket_issuer("ticket issued by "), None);
    }
}
