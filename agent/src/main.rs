//! keel-agent: the composition root. Parses the command line, sets up
//! logging and hands over to the library.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use keel_verifier::config::{NodeConfig, Role};
use keel_verifier::cpu::CpuPolicy;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, Signal, SignalKind};

use keel_agent::attestation::cpu::{ConfigfsTsm, CONFIGFS_TSM_ROOT};
use keel_agent::cluster::ClusterSlot;
use keel_agent::measured::{self, MeasuredLog, MeasuredTpm, SharedTpm};
use keel_agent::node;
use keel_agent::nodelock::NodeLock;
use keel_agent::resume;
use keel_agent::systemd;
use keel_agent::tpm::{TctiSpec, Tpm, TpmError};
use keel_verifier::measurement::{self, pcr, EventType, HexDigest};

/// The keel node agent. Started by systemd on every boot of a keel image: it
/// measures its node config into the TPM before using it, then serves the
/// init flow and runs the join flow. Stopped with SIGTERM (or SIGINT), it
/// ends its tasks and sends TPM2_Shutdown(CLEAR) before it exits.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    /// The TPM: a device path, or a TCTI such as `swtpm:host=127.0.0.1,port=2321`.
    #[arg(
        long,
        global = true,
        env = "KEEL_TCTI",
        default_value = "device:/dev/tpmrm0"
    )]
    tcti: String,
    /// Directory for the event log and runtime state.
    #[arg(
        long,
        global = true,
        env = "KEEL_STATE_DIR",
        default_value = "/run/keel"
    )]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent: measure the node config, report readiness, serve.
    Run {
        /// Node config file (default: fw_cfg `opt/keel/node-config`, then the image default).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Measure and report readiness, then exit (for checks and tests).
        #[arg(long)]
        once: bool,
        /// Where the join service keeps the measurements it checks joining
        /// nodes against (written from the cluster state, which the operator
        /// API changes; default: `join-measurements.json` in the state
        /// directory).
        #[arg(long, env = "KEEL_MEASUREMENTS")]
        measurements: Option<PathBuf>,
    },
    /// Print the SHA-256 PCR values 0-23.
    Pcrs,
    /// Print the agent's event log and whether it replays to the TPM's PCRs
    /// (read only; the agent settles its own log when it opens it).
    Eventlog,
}

/// Logs `event` with the time since the kernel started: a line a boot
/// timeline can anchor on (`make vm-check`, `tests/src/timeline.rs`).
fn log_boot_time(event: &str) {
    if let Some(t) = systemd::since_boot() {
        tracing::info!(since_boot_s = t.as_secs_f64(), "{event}");
    }
}

/// Raises the soft limit of open files to
/// [`keel_agent::node::FILE_DESCRIPTORS`] (or the hard limit, if lower):
/// under systemd the soft limit is 1024, fewer than the ports' bounds on
/// open connections, and a process out of descriptors can neither accept a
/// join nor write its stores.
fn raise_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let wanted = keel_agent::node::FILE_DESCRIPTORS;
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < wanted => {
            let raised = wanted.min(hard);
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, raised, hard) {
                tracing::warn!(error = %e, soft, "raising the open file limit failed");
            } else if raised < wanted {
                tracing::warn!(
                    limit = raised,
                    wanted,
                    "open file limit below what the ports' connection bounds need"
                );
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "reading the open file limit failed"),
    }
}

fn main() -> std::process::ExitCode {
    // The TSS logs to stderr on its own; its failures reach us as errors
    // with the TPM return code, so keep it quiet unless asked (TSS2_LOG).
    if std::env::var_os("TSS2_LOG").is_none() {
        std::env::set_var("TSS2_LOG", "all+NONE");
    }
    keel_agent::logging::init(tracing::Level::INFO);
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("keel-agent: error: {err:#}");
            exit_code(&err)
        }
    }
}

/// The exit status for a failed run: [`NO_TPM_EXIT`] when the machine has
/// no TPM, which no restart can change (the unit does not restart on it),
/// else 1.
fn exit_code(err: &anyhow::Error) -> std::process::ExitCode {
    let no_tpm = err
        .chain()
        .any(|e| matches!(e.downcast_ref(), Some(TpmError::NoDevice { .. })));
    if no_tpm {
        std::process::ExitCode::from(NO_TPM_EXIT)
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// The exit status of an agent on a machine without a TPM: sysexits'
/// EX_CONFIG, named in the unit's `RestartPreventExitStatus=`.
const NO_TPM_EXIT: u8 = 78;

fn run(cli: Cli) -> anyhow::Result<()> {
    let tcti: TctiSpec = cli.tcti.parse()?;
    let log_path = cli.state_dir.join(keel_agent::paths::EVENT_LOG);
    match cli.command {
        Command::Pcrs => {
            let mut tpm = Tpm::open(&tcti)?;
            for (index, value) in tpm.pcr_read_all()? {
                println!("pcr {index} {}", HexDigest(&value));
            }
            Ok(())
        }
        Command::Eventlog => {
            // Read only: the agent may be running, and settles its own log.
            // The PCRs before the log: an event the agent records meanwhile
            // then shows as one not extended yet, not as a mismatch.
            let mut tpm = Tpm::open(&tcti)?;
            let reported = tpm.pcr_read(&pcr::AGENT_OWNED)?;
            let events = MeasuredLog::read(&log_path);
            for (index, value) in &reported {
                println!("pcr {index} {}", HexDigest(value));
            }
            let events = events.context("the event log does not replay to the TPM's PCRs")?;
            for e in &events {
                println!(
                    "pcr {} {} {} {}",
                    e.pcr,
                    HexDigest(&e.digest),
                    e.event_type.as_str(),
                    e.description
                );
            }
            if let Err(e) = measurement::verify_replay(&events, &reported) {
                if keel_agent::measured::pending(&events, &reported).is_some() {
                    anyhow::bail!(
                        "the event log's last event is not extended yet: the agent extends it \
                         when it next opens the log ({e})"
                    );
                }
                return Err(anyhow::Error::new(e)
                    .context("the event log does not replay to the TPM's PCRs"));
            }
            println!("replay: ok ({} events)", events.len());
            Ok(())
        }
        Command::Run {
            config,
            once,
            measurements,
        } => {
            log_boot_time("agent started");
            // Taken before any thread starts: what the agent kept in the
            // service manager's store before it restarted (this boot).
            let kept = resume::take_kept(systemd::take_passed_fds());
            raise_file_limit();
            // A reboot an earlier run of the agent scheduled in this boot
            // still happens, whatever fails below.
            let reboot_pending = keel_agent::reboot::resume_pending(&cli.state_dir);
            if let Some(left) = reboot_pending {
                tracing::error!(
                    "the agent restarted after it had scheduled a reboot in this boot: \
                     the node still reboots, in {} s",
                    left.as_secs()
                );
            }
            let (config, source) = NodeConfig::load(config.as_deref())?;
            tracing::info!(%source, "node config loaded");
            // Stop signals are caught from here on: one that comes before
            // the services run stops them as soon as they start, and the
            // TPM is shut down all the same.
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let stop = {
                let _runtime = runtime.enter();
                StopSignals::new()?
            };
            let mut tpm = Tpm::open(&tcti)?;
            log_tpm_state(&mut tpm);
            let mut measured = MeasuredTpm::open(tpm, &log_path)?;
            // Measured before anything below reads it.
            measured.record_once(
                EventType::NodeConfig,
                format!("node config from {source}"),
                config.cluster_bytes(),
            )?;
            measured.record_once(
                EventType::NodeIdentity,
                format!("node {} ({})", config.node.name, config.node.role.as_str()),
                config.node_bytes(),
            )?;
            let cpu_policy = config.cluster.cpu_policy()?;
            if let Some(mut tsm) = ConfigfsTsm::new(CONFIGFS_TSM_ROOT, cpu_policy.variant()) {
                if let CpuPolicy::SevSnp(snp) = &cpu_policy {
                    tsm = tsm.with_privlevel(snp.vmpl);
                }
                measured = measured.with_cpu_reporter(Arc::new(tsm));
            }
            for (index, value) in measured.tpm().pcr_read_all()? {
                println!("pcr {index} sha256:{}", HexDigest(&value));
            }
            let tpm = measured.shared();
            let lock = Arc::new(NodeLock::new(tpm.clone())?);
            if once {
                return announce_ready();
            }
            let measurements = measurements
                .unwrap_or_else(|| cli.state_dir.join(keel_agent::paths::JOIN_MEASUREMENTS));
            let served = runtime.block_on(serve(
                config,
                tpm.clone(),
                lock,
                cli.state_dir,
                measurements,
                stop,
                EarlierRun {
                    kept,
                    reboot_pending: reboot_pending.is_some(),
                },
            ));
            // The tasks are gone: end the TPM's cycle so that its next
            // startup finds an orderly shutdown.
            match measured::shutdown(&tpm) {
                Ok(()) => tracing::info!("TPM shut down (TPM2_Shutdown CLEAR)"),
                Err(e) => tracing::warn!(
                    error = %keel_atls::ErrorChain(&e),
                    "TPM2_Shutdown failed"
                ),
            }
            runtime.shutdown_timeout(Duration::from_secs(5));
            served
        }
    }
}

/// Tells systemd and the console that the node is measured and (unless it
/// only measures, `--once`) its init port accepts connections: the end of
/// the boot timeline by the guest's clock (this output reaches the console
/// through journald, which may start later).
fn announce_ready() -> anyhow::Result<()> {
    systemd::notify("READY=1")?;
    log_boot_time("agent ready");
    println!("keel-agent: ready");
    Ok(())
}

/// Logs how the TPM's previous cycle ended and its dictionary-attack
/// counter: after a crash, or with failures counted, an operator sees it
/// before a lockout stops attestation.
fn log_tpm_state(tpm: &mut Tpm) {
    match tpm.lockout_state() {
        Ok(s) => {
            if !s.orderly_startup {
                tracing::info!("the TPM's previous cycle ended without TPM2_Shutdown");
            }
            if s.in_lockout || s.failed_tries > 0 {
                tracing::warn!(
                    failed_tries = s.failed_tries,
                    max_tries = s.max_tries,
                    recovery_seconds = s.recovery_seconds,
                    in_lockout = s.in_lockout,
                    "the TPM's dictionary-attack counter is not zero"
                );
            }
        }
        Err(e) => tracing::warn!(
            error = %keel_atls::ErrorChain(&e),
            "reading the TPM's dictionary-attack state failed"
        ),
    }
}

/// The signals that stop the agent cleanly: SIGTERM (systemd) and SIGINT.
struct StopSignals {
    terminate: Signal,
    interrupt: Signal,
}

impl StopSignals {
    /// Installs the handlers; needs a runtime context.
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for either signal.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

/// What an earlier run of the agent in this boot left for this one.
struct EarlierRun {
    /// The record it kept in the service manager's store, if any.
    kept: Option<Result<resume::ResumeRecord, resume::ResumeError>>,
    /// It had scheduled a reboot, which is still to come.
    reboot_pending: bool,
}

/// Serves the node's APIs until `stop` fires, then ends every task: the
/// init server (when an init secret is configured) and the join client
/// (when control-plane endpoints are configured) race for the node lock; a
/// control-plane node serves the join service once it created the cluster.
async fn serve(
    config: NodeConfig,
    tpm: SharedTpm,
    lock: Arc<NodeLock>,
    state_dir: PathBuf,
    measurements: PathBuf,
    mut stop: StopSignals,
    earlier: EarlierRun,
) -> anyhow::Result<()> {
    let EarlierRun {
        kept,
        reboot_pending,
    } = earlier;
    // Every node serves its init port: init (where an init secret is
    // configured), recovery (control planes) and the operator API. Bound
    // before the node says it is ready, so an operator who acts on "ready"
    // finds it listening: connections wait in the backlog until the server
    // below accepts them.
    let init_port = SocketAddr::from((Ipv4Addr::UNSPECIFIED, config.cluster.init_port));
    let init_listener = TcpListener::bind(init_port)
        .await
        .with_context(|| format!("binding the init port {init_port}"))?;
    let node = keel_agent::provision::Node {
        env: node::node_env(&config, state_dir)?,
        cluster: Arc::new(ClusterSlot::new(None)),
        operator_key: Arc::default(),
        config,
        tpm,
        lock,
    };
    // A node that reboots anyway leaves its disk as it is.
    let rebooting = reboot_pending || node::reset_unfinished_disk(&node.env, &node.lock).await;
    let control_plane = node.config.node.role == Role::ControlPlane;
    let operator_port = match node::OperatorPort::set_up(
        init_listener,
        node.clone(),
        control_plane.then(|| measurements.clone()),
    ) {
        Ok(port) => Some(port),
        // The reboot scheduled above must still happen: the agent runs on
        // to it, serving nothing on its init port.
        Err(e) if rebooting => {
            tracing::error!(
                error = format!("{e:#}"),
                "setting up the init port's server failed"
            );
            None
        }
        Err(e) => return Err(e),
    };
    // Ready once the disk was checked (a node that found it must reboot
    // logged why above) and the init port's server is set up.
    announce_ready()?;
    // Locked already: the agent restarted within this boot.
    let restarted = node.lock.is_locked();
    // A restart that cannot resume the flow that locked the node reboots
    // it (a reboot scheduled above is left to happen).
    if !rebooting {
        resume::at_start(&node, kept).await;
    }
    let mut tasks = tokio::task::JoinSet::new();
    if control_plane {
        tasks.spawn(node::serve_join_as_control_plane(
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, node.config.cluster.join_port)),
            node.config.clone(),
            node.tpm.clone(),
            node.env.clone(),
            node.cluster.clone(),
            measurements.clone(),
        ));
    }
    if node.config.cluster.control_plane_endpoints.is_empty() {
        tracing::info!("no control-plane endpoints configured: this node does not join");
    } else {
        if !restarted {
            tasks.spawn(node::run_join_client(node.clone()));
        }
        // Once locked into the cluster (init or join), the node attests on.
        tasks.spawn(keel_agent::evidence::client::run_for_node(node.clone()));
    }
    if node.config.cluster.init_secret_hash.is_empty() {
        tracing::info!("no init secret configured: this node does not accept init");
    }
    if let Some(port) = operator_port {
        tasks.spawn(port.serve());
    }
    let supervise = async {
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(error = format!("{e:#}"), "a node task failed"),
                Err(e) => tracing::error!(error = %e, "a node task panicked"),
            }
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        () = supervise => {}
        signal = stop.recv() => tracing::info!(signal, "stopping"),
    }
    tasks.shutdown().await;
    Ok(())
}
