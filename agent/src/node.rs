//! The running agent: after the config is measured, serve the init API over
//! server-attested aTLS and run the join client until the node joins or
//! creates a cluster; on a control-plane node that created the cluster,
//! serve the join service over mutual aTLS.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use keel_atls::AtlsServer;
use keel_installer::{InstallPath, InstallerConfig, Mirror};
use keel_proto::init::init_service_server::InitServiceServer;
use keel_verifier::config::{NodeConfig, Role};
use keel_verifier::ek::EkTrust;
use keel_verifier::measurement::pcr;
use tokio::net::TcpListener;

use crate::address::AdvertiseAddress;
use crate::attestation::issuer::TpmIssuer;
use crate::attestation::policy::{cpu_trust, ReloadableValidator};
use crate::backoff::Backoff;
use crate::cluster::ClusterSlot;
use crate::disk::{Cryptsetup, DiskState, StateDisk, StateMount};
use crate::disk_bindings::{Bind, DiskBindings, EkDigest};
use crate::evidence::admission::{MemberPolicy, PortValidator};
use crate::evidence::EvidenceService;
use crate::grpc::{self, GrpcLimits, InFlightLimit};
use crate::init::InitServer;
use crate::join::{JoinClient, JoinOutcome, JoinService, JoinSettings};
use crate::kubeadm::Kubeadm;
use crate::measured::SharedTpm;
use crate::nodelock::NodeLock;
use crate::operator::{OperatorAuth, OperatorServer};
use crate::paths::{
    BIN_DIR, KEPT_COMPONENTS, MEMORY_BINDS, PRIVATE_STATE_DIRS, STATE_BINDS, STATE_MOUNT,
    STATE_SERVICES, STATE_TMPFS,
};
use crate::provision::Node;
use crate::provision::{KubeletStart, NodeEnv};
use crate::reboot::RebootPolicy;
use crate::recovery::RecoveryServer;
use crate::registry::RegistryStore;
use crate::upgrade::Upgrader;

/// Largest init request: the CLI sends at most 1 MiB of components (its
/// JSON file limit; no larger as protobuf) and 64 KiB of join measurements,
/// plus small fields.
pub const MAX_INIT_REQUEST_BYTES: usize = 2 * 1024 * 1024;
pub use keel_proto::MAX_INIT_RESPONSE_BYTES;
/// Init requests the init port holds at once, counted over all its
/// connections: each may buffer up to [`MAX_INIT_REQUEST_BYTES`] before its
/// handler runs, and anyone can open a connection to this port. One per
/// source; a node takes one init; a request beyond the bounds is answered
/// `UNAVAILABLE`.
pub const INIT_REQUESTS_IN_FLIGHT: usize = 4;
/// How long an init request's body may take to arrive (at most
/// [`MAX_INIT_REQUEST_BYTES`]): a client that trickles it holds a place
/// no longer.
pub const INIT_REQUEST_BODY_DEADLINE: Duration = Duration::from_secs(30);
/// How long an init request that finds every place taken waits for one,
/// first come first served, before it is answered `UNAVAILABLE`.
pub const INIT_REQUEST_WAIT: Duration = Duration::from_secs(10);
/// How old an init request's place must be, its body still arriving, for a
/// waiting request to evict it (each waiter evicts at most one).
pub const INIT_REQUEST_EVICTION_AGE: Duration = Duration::from_secs(2);
/// Init requests waiting for a place at once (one per source); beyond it a
/// request is answered `UNAVAILABLE` at once.
pub const INIT_REQUESTS_WAITING: usize = 64;
/// Connections the init port keeps open at once. Its clients are the
/// operator's CLI (one connection per command) and, before init, whoever
/// reaches the port; the operator requests each connection may hold are
/// small (at most 128 KiB, 8 streams), and recovery requests, of up to a
/// full revocation list, are held to a few at once across the port
/// (`recovery_service`).
pub const OPERATOR_PORT_CONNECTIONS: usize = 32;
/// A source's share of [`OPERATOR_PORT_CONNECTIONS`], at every load.
pub const OPERATOR_PORT_CONNECTIONS_PER_SOURCE: usize = 2;
/// When every place on the init port is taken, a newcomer waits up to
/// [`OPERATOR_PORT_WAIT`] for one (under the CLI's 10 s handshake
/// timeout), and for each one waiting the oldest connection open for at
/// least this long whose requests proved nothing is closed
/// ([`crate::grpc::Caller`]). The operator's CLI proves itself well within
/// it: one handshake, a challenge, the request.
pub const OPERATOR_PORT_EVICTION_AGE: Duration = Duration::from_secs(3);
/// See [`OPERATOR_PORT_EVICTION_AGE`].
pub const OPERATOR_PORT_WAIT: Duration = Duration::from_secs(5);
/// How long a join ticket request may take: a wait for a slot plus
/// creating the bootstrap token.
pub const JOIN_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Ticket requests the join port holds at once, across every connection:
/// each buffers up to [`crate::join::service::MAX_REQUEST_BYTES`] (16 MiB
/// in all). The service issues
/// [`crate::join::service::MAX_CONCURRENT_TICKETS`] at once and queues as
/// many. Without a bound across connections, the port's
/// [`JOIN_CONNECTIONS`] connections of 8 streams each could make it buffer
/// gigabytes for one attested peer.
pub const JOIN_REQUESTS_IN_FLIGHT: usize = 256;
/// Evidence requests the join port holds at once, across every
/// connection: each buffers up to
/// [`crate::evidence::service::MAX_EVIDENCE_REQUEST_BYTES`] (about 33 MiB
/// in all). A node submits once an interval and each takes milliseconds;
/// its nonce request, which waits up to an interval for the node's turn,
/// gives its place up once its turn is marked (the service bounds those
/// waits, one per member), so even the registry's bound on nodes seldom
/// has more than a few in flight.
pub const EVIDENCE_REQUESTS_IN_FLIGHT: usize = 128;
/// A source's share of the join port's requests (of each service, waiting
/// included) once half of its places are taken; below that, nodes behind
/// one address (a NAT, a VM network's gateway) take what they need.
pub const JOIN_PORT_REQUESTS_PER_SOURCE: usize = 32;
/// How long a request's body may take to arrive on the join port. A
/// ticket request is a few kilobytes, evidence at most 260 KiB; a body
/// trickled in holds its place no longer.
pub const JOIN_PORT_BODY_DEADLINE: Duration = Duration::from_secs(10);
/// How long a request on the join port that finds every place taken
/// waits for one (under the clients' 30 s timeouts).
pub const JOIN_PORT_REQUEST_WAIT: Duration = Duration::from_secs(10);
/// How old a place on the join port must be, its body still arriving, for
/// a waiting request to evict it.
pub const JOIN_PORT_EVICTION_AGE: Duration = Duration::from_secs(2);
/// Requests of each service of the join port waiting for a place at once;
/// beyond it one is answered `UNAVAILABLE` at once. Each holds at most
/// [`JOIN_PORT_STREAM_WINDOW`] unread (16 MiB in all).
pub const JOIN_PORT_REQUESTS_WAITING: usize = 256;
/// The join port's HTTP/2 stream window: what a peer may send on a stream
/// before the server reads it, so what a waiting request holds.
pub const JOIN_PORT_STREAM_WINDOW: u32 = 64 * 1024;
/// How long a request on the init port may take: recovery opens the disk,
/// reinstalls the recorded components and starts the kubelet (the CLI's
/// `keel recover` waits a little longer, so this bound answers first).
pub const OPERATOR_PORT_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// Handshakes of one source that the join port admits to its issuer at
/// once (keel-atls's default, 2, is meant for an issuer that quotes per
/// handshake; the agent's issuer batches, so one quote serves all of them).
pub const JOIN_ISSUING_PER_SOURCE: usize = 16;
/// Handshakes of all sources that the join port admits to its issuer at
/// once.
pub const JOIN_ISSUING: usize = 64;
/// When every handshake place on the join port is taken (keel-atls's 256,
/// 8 per source once half are taken: 17 addresses can take them all, each
/// handshake stalled after the server's flight holding its place until the
/// 10 s handshake timeout), a newcomer waits up to [`JOIN_HANDSHAKE_WAIT`]
/// for one, and for each one waiting the oldest handshake in progress for
/// at least this long is closed. The age counts from when the handshake
/// took its place, less its turns at the TPM (the quote for its
/// certificate and its residency answer) and an attested member's wait
/// for its answer in the issuer's shared queue (one per IPv4 address or
/// IPv6 /64, 64 in all; others there age): on a slow TPM, or with
/// every member reconnecting, the handshakes it is serving are not
/// closed, while the wait for a turn for a certificate, and for the
/// source's share of turns, ages a handshake like a wait on its peer (a
/// flood's own ClientHellos queue there). A genuine handshake takes well
/// under a second on an idle port, seconds on a loaded one (a control
/// plane that restarted, its members all reconnecting), and one older
/// than this is closed only while newcomers wait. Half the handshake
/// timeout: a stalled handshake holds its place half as long.
pub const JOIN_HANDSHAKE_EVICTION_AGE: Duration = Duration::from_secs(5);
/// See [`JOIN_HANDSHAKE_EVICTION_AGE`]; above it, so a newcomer outwaits
/// a port filled just before it, and under the join and evidence clients'
/// 30 s timeouts.
pub const JOIN_HANDSHAKE_WAIT: Duration = Duration::from_secs(8);
/// Connections the join port keeps open at once: every member keeps its
/// evidence stream to every control plane open, so this is the registry's
/// bound on nodes ([`crate::registry::MAX_NODES`]) with room for joins.
/// Only a peer that passed mutual attestation holds a connection here past
/// its handshake.
pub const JOIN_CONNECTIONS: usize = crate::registry::MAX_NODES + 2048;
/// A source's share of [`JOIN_CONNECTIONS`] once half are taken: below
/// that, nodes behind one address (a local cluster's VM network gateway, a
/// NAT, an IPv6 /64) may hold as many as they need.
pub const JOIN_CONNECTIONS_PER_SOURCE: usize = 64;
/// File descriptors the agent asks for (its soft limit, up to the hard
/// one): the join port's and the init port's connections with room for
/// the agent's files, pipes and TPM.
pub const FILE_DESCRIPTORS: u64 = 16 * 1024;

/// The environment of a real node: installs under `/` (components in
/// memory, [`STATE_TMPFS`]), kubeadm from [`BIN_DIR`], the configured
/// state disk mounted at [`STATE_MOUNT`], the address of the route toward
/// the first control-plane endpoint (or of the default route), reboot
/// after 60 s on failure.
pub fn node_env(config: &NodeConfig, state_dir: PathBuf) -> anyhow::Result<NodeEnv> {
    let mut installer = InstallerConfig {
        kept: Some(InstallPath::new(KEPT_COMPONENTS)?),
        ..InstallerConfig::default()
    };
    if let Some(m) = &config.cluster.component_mirror {
        installer.mirror = Some(Mirror::new(m)?);
    }
    let toward = config
        .cluster
        .control_plane_endpoints
        .first()
        .and_then(|e| e.parse::<SocketAddr>().ok())
        .map(|a| a.ip())
        // No endpoint (a lone first node): a documentation address
        // (RFC 5737) is never on a link, so the lookup takes the default
        // route.
        .unwrap_or(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)));
    Ok(NodeEnv {
        installer,
        kubeadm: Kubeadm::new(std::path::Path::new(BIN_DIR)),
        work_dir: state_dir,
        advertise_address: AdvertiseAddress::Toward(toward),
        state_disk: config.node.state_disk.as_ref().map(|d| StateDisk {
            device: d.into(),
            cryptsetup: Cryptsetup::default(),
            mount: Some(StateMount {
                memory: STATE_TMPFS.into(),
                memory_binds: MEMORY_BINDS
                    .iter()
                    .map(|(inside, target)| (inside.into(), target.into()))
                    .collect(),
                point: STATE_MOUNT.into(),
                binds: STATE_BINDS
                    .iter()
                    .map(|(inside, target)| (inside.into(), target.into()))
                    .collect(),
                private: PRIVATE_STATE_DIRS.iter().map(Into::into).collect(),
                services: STATE_SERVICES.iter().map(|s| (*s).to_owned()).collect(),
            }),
        }),
        kubelet: KubeletStart::Systemd,
        reboot: RebootPolicy::After(Duration::from_secs(60)),
    })
}

/// Tries to inspect the state disk at start this many times, a second
/// apart, before giving up.
const START_INSPECTIONS: u32 = 3;

/// Before the node serves anything: a state disk whose set-up never
/// finished (the node stopped during an earlier init or join) is reset, so
/// this boot starts over. A disk that cannot be inspected is left alone;
/// init and join refuse it until it can. If the node is locked already,
/// the agent itself stopped within this boot (it was restarted) and PCR 15
/// holds the cluster ID: unless the disk is a finished member's, nothing
/// this boot can do lets the node start over, so a reboot is scheduled.
/// Returns whether a reboot is scheduled. (A reboot the agent scheduled
/// before it restarted is resumed earlier, [`crate::reboot::resume_pending`].)
pub async fn reset_unfinished_disk(env: &NodeEnv, lock: &NodeLock) -> bool {
    let Some(disk) = env.state_disk.clone() else {
        return false;
    };
    let device = disk.device.display().to_string();
    let mut attempt = 1;
    let found = loop {
        let inspect = disk.clone();
        let error = match tokio::task::spawn_blocking(move || inspect.reset_unfinished()).await {
            Ok(Ok(found)) => break Some(found),
            Ok(Err(e)) => keel_atls::ErrorChain(&e).to_string(),
            Err(e) => e.to_string(),
        };
        tracing::warn!(disk = device, attempt, %error, "inspecting the state disk at start failed");
        if attempt >= START_INSPECTIONS {
            break None;
        }
        attempt += 1;
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    if let Some(DiskState::Unfinished { uuid }) = &found {
        tracing::warn!(
            disk = device,
            uuid,
            "the state disk's set-up never finished (the node stopped during init or join): reset; starting over"
        );
    }
    if lock.is_locked() && !matches!(found, Some(DiskState::Member { .. })) {
        // Recorded for a later start only when the disk was read: one that
        // could not be read now may be read after a restart.
        let record_in = found.is_some().then_some(env.work_dir.as_path());
        let why = if found.is_some() {
            "its disk is no member's"
        } else {
            "its state disk could not be read"
        };
        for line in crate::reboot::reset_node(None, env.reboot, record_in).await {
            tracing::error!("the node was locked before this start and {why}: {line}");
        }
        return true;
    }
    false
}

/// Records this control plane under its own name in its registry, with
/// its own state disk bound to its own EK in its disk bindings
/// ([`bind_own_disk`]), before its join service serves. Until its own
/// evidence or a registry exchange brings that record, the registry may
/// not have it (the first control plane's never had; one recovered from an
/// older registry may lack it), and a second TPM booted under its name
/// would get a ticket here. The record names the disk, so that every
/// control plane the registry reaches refuses a join ticket naming it
/// ([`crate::registry::Registry::check_disk`]). What keeps the record from
/// being made (the name held by another EK, this control plane revoked, a
/// full registry) is logged; the service serves all the same.
fn hold_own_name(
    registry: &RegistryStore,
    disks: &DiskBindings,
    own_ek: &EkDigest,
    name: &str,
    disk: Option<&StateDisk>,
) {
    let own_disk = disk.map_or_else(String::new, |d| bind_own_disk(disks, own_ek, d));
    let held = registry.update(|r| {
        // A record made elsewhere of this disk under another EK: a node
        // that claimed it at a peer before this control plane bound it.
        if let Err(e) = r.check_disk(own_ek, &own_disk) {
            tracing::error!(
                name,
                error = %keel_atls::ErrorChain(&e),
                "another node's record names this control plane's own state disk: that node \
                 claimed the disk; revoke it"
            );
        }
        r.register(own_ek, &own_disk, name, "control-plane")
    });
    if let Err(e) = held {
        tracing::warn!(
            name,
            error = %keel_atls::ErrorChain(&e),
            "this control plane's name is not recorded in its registry"
        );
    }
}

/// Binds this control plane's own state disk `disk` (the UUID of its LUKS
/// header) to its own EK in its disk bindings; returns the UUID, which its
/// registry record then names, or empty where the disk is not bound to
/// it. The join service binds the disks of the nodes it issues join
/// tickets to, never its own: the first control plane's was made by its
/// init, and one that joined through a peer was bound there. Unbound, an
/// attested node could name the disk in a join ticket request here and
/// have it bound to its own TPM, and this control plane would refuse the
/// disk's rejoins and evidence. Runs at every start, so a control plane of
/// a cluster created before this binding, or recovered, binds its disk
/// too. A disk bound to another EK stays bound to it (a binding never
/// changes EK) and is logged as an error; so is a disk that cannot be read
/// or bound. The join service serves all the same: refusing to serve would
/// add the loss of this control plane's join and evidence service to what
/// a claim took, and an operator revokes the claimer.
fn bind_own_disk(disks: &DiskBindings, own_ek: &EkDigest, disk: &StateDisk) -> String {
    let device = disk.device.display().to_string();
    let uuid = match disk.initialised_uuid() {
        Ok(Some(uuid)) => uuid,
        Ok(None) => {
            tracing::error!(
                disk = device,
                "this control plane's state disk has no LUKS header: its disk is not bound to its \
                 EK here"
            );
            return String::new();
        }
        Err(e) => {
            tracing::error!(
                disk = device,
                error = %keel_atls::ErrorChain(&e),
                "reading this control plane's state disk UUID failed: its disk is not bound to its \
                 EK here until the next start"
            );
            return String::new();
        }
    };
    match disks.bind(&uuid, own_ek) {
        Ok(Bind::Recorded) => {
            tracing::info!(disk = %uuid, ek = %own_ek, "this control plane's own state disk is bound to its EK");
            uuid.to_ascii_lowercase()
        }
        Ok(Bind::AlreadyBound) => uuid.to_ascii_lowercase(),
        Ok(Bind::OtherEk(bound)) => {
            tracing::error!(
                disk = %uuid,
                bound_to = %bound,
                own_ek = %own_ek,
                "this control plane's own state disk is bound to another EK in its disk \
                 bindings: a node claimed it with a join ticket; revoke that EK. This control \
                 plane refuses its own disk's evidence and rejoins here, and its record names no \
                 disk"
            );
            String::new()
        }
        Err(e) => {
            tracing::error!(
                disk = %uuid,
                error = %keel_atls::ErrorChain(&e),
                "binding this control plane's own state disk to its EK failed: its disk is not \
                 bound here until the next start"
            );
            String::new()
        }
    }
}

/// Serves the init API on `addr` until the task is dropped.
pub async fn serve_init(addr: SocketAddr, node: Node) -> anyhow::Result<()> {
    serve_operator_port(TcpListener::bind(addr).await?, node, None).await
}

/// Serves the init API and, on a control plane, recovery and the operator
/// API (its join service reads `measurements`) on `listener` until the task
/// is dropped.
pub async fn serve_operator_port(
    listener: TcpListener,
    node: Node,
    measurements: Option<PathBuf>,
) -> anyhow::Result<()> {
    OperatorPort::set_up(listener, node, measurements)?
        .serve()
        .await
}

/// The init port's server, set up and not yet serving: what can fail
/// (reading the node's own EK) has run, so a node that says it is ready
/// after [`OperatorPort::set_up`] does serve its init port.
pub struct OperatorPort {
    addr: SocketAddr,
    serving: std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>>,
}

impl OperatorPort {
    /// Sets up the init API and, on a control plane, recovery and the
    /// operator API (its join service reads `measurements`) on `listener`.
    pub fn set_up(
        listener: TcpListener,
        node: Node,
        measurements: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        let addr = listener.local_addr()?;
        let own_ek = crate::attestation::shared_own_ek_digest(&node.tpm)
            .context("reading the node's own endorsement key for the operator API")?;
        let auth = OperatorAuth::new(own_ek, node.cluster.clone(), node.operator_key.clone());
        let upgrader = Upgrader::new(node.env.clone(), node.tpm.clone(), node.cluster.clone())
            .with_signing_key(node.config.cluster.signing_key()?);
        // A control plane renews kubeadm's certificates before they end,
        // for as long as its port serves (none before its init or join).
        let renewals = (node.config.node.role == Role::ControlPlane)
            .then(|| upgrader.clone().renew_certificates_forever());
        let operator = OperatorServer::new(
            auth,
            node.cluster.clone(),
            measurements,
            node.env.root().to_owned(),
            Some(upgrader),
        )
        .with_disk_bindings(Arc::new(DiskBindings::new(node.env.root())));
        let issuer = Arc::new(TpmIssuer::new(node.tpm.clone()));
        let recovery = RecoveryServer::new(node.clone());
        let init = InitServer::new(node);
        let init = init_service(init);
        let recovery = recovery_service(recovery);
        let operator = operator.into_service();
        let limits = GrpcLimits {
            request_timeout: OPERATOR_PORT_REQUEST_TIMEOUT,
            ..GrpcLimits::default()
        };
        let serving = async move {
            let _renewals = renewals.map(|r| AbortOnDrop(tokio::spawn(r)));
            // Accepting starts here: until then connections wait in the
            // backlog.
            let incoming = operator_port_incoming(issuer, listener);
            grpc::serve(incoming, &limits, |server| {
                server
                    .add_service(init)
                    .add_service(recovery)
                    .add_service(operator)
            })
            .await?;
            Ok(())
        };
        Ok(Self {
            addr,
            serving: Box::pin(serving),
        })
    }

    /// Serves until the task is dropped.
    pub async fn serve(self) -> anyhow::Result<()> {
        tracing::info!(addr = %self.addr, "init server listening (server-attested aTLS)");
        self.serving.await
    }
}

/// Serves `init` alone on `listener` over server-attested aTLS (attesting
/// with `tpm`) with the gRPC `limits`, as the init port does but with
/// `body_deadline` for each init request's body, until the task is
/// dropped.
pub async fn serve_init_on(
    listener: TcpListener,
    tpm: SharedTpm,
    init: InitServer,
    limits: &GrpcLimits,
    body_deadline: Duration,
) -> anyhow::Result<()> {
    let issuer = Arc::new(TpmIssuer::new(tpm));
    let incoming = operator_port_incoming(issuer, listener);
    let service = bounded_init_service(init, body_deadline);
    grpc::serve(incoming, limits, |server| server.add_service(service)).await?;
    Ok(())
}

/// The init port's validated connections, within its connection bounds.
fn operator_port_incoming(
    issuer: Arc<TpmIssuer>,
    listener: TcpListener,
) -> keel_atls::Incoming<()> {
    AtlsServer::<()>::server_attested(issuer)
        .with_connection_limits(
            OPERATOR_PORT_CONNECTIONS_PER_SOURCE,
            OPERATOR_PORT_CONNECTIONS,
        )
        .with_connection_share_always()
        .with_eviction(OPERATOR_PORT_EVICTION_AGE, OPERATOR_PORT_WAIT)
        .incoming(listener)
}

/// The init service with its message sizes and its requests in flight
/// bounded.
pub fn init_service(init: InitServer) -> InFlightLimit<InitServiceServer<InitServer>> {
    bounded_init_service(init, INIT_REQUEST_BODY_DEADLINE)
}

fn bounded_init_service(
    init: InitServer,
    body_deadline: Duration,
) -> InFlightLimit<InitServiceServer<InitServer>> {
    let service = init
        .into_service()
        .max_decoding_message_size(MAX_INIT_REQUEST_BYTES)
        .max_encoding_message_size(MAX_INIT_RESPONSE_BYTES);
    init_port_bounds(
        service,
        INIT_REQUESTS_IN_FLIGHT,
        MAX_INIT_REQUEST_BYTES,
        body_deadline,
        "other init requests are in progress; try again",
    )
}

/// `service` with the init port's bounds on requests in flight: `limit`
/// at once across every connection, one per source, each body of at most
/// `max_message` bytes within `body_deadline`; a request finding none free
/// waits for one ([`INIT_REQUEST_WAIT`]), evicting a slow body.
fn init_port_bounds<S>(
    service: S,
    limit: usize,
    max_message: usize,
    body_deadline: Duration,
    busy: &'static str,
) -> InFlightLimit<S> {
    InFlightLimit::new(service, limit, max_message, body_deadline, busy).with_waiting(
        INIT_REQUEST_WAIT,
        INIT_REQUEST_EVICTION_AGE,
        INIT_REQUESTS_WAITING,
    )
}

/// The recovery service with the init port's bounds
/// ([`init_port_bounds`]): a request of up to [`crate::recovery::MAX_RECOVER_REQUEST_BYTES`]
/// (a full revocation list) from anyone who reaches the init port, so at
/// most [`crate::recovery::MAX_WAITING`] bodies at once, each within
/// [`INIT_REQUEST_BODY_DEADLINE`]; the handler gives its place up once it
/// has its request whole.
fn recovery_service(
    recovery: RecoveryServer,
) -> InFlightLimit<
    keel_proto::recovery::recovery_service_server::RecoveryServiceServer<RecoveryServer>,
> {
    init_port_bounds(
        recovery.into_service(),
        crate::recovery::MAX_WAITING,
        crate::recovery::MAX_RECOVER_REQUEST_BYTES,
        INIT_REQUEST_BODY_DEADLINE,
        "other recovery requests are in progress; try again",
    )
}

/// The join service's validator: the measurements file, plus the cluster's
/// config PCR and PCR 15 = zero (a node already in a cluster cannot join).
pub fn join_service_policy(
    config: &NodeConfig,
    measurements: &std::path::Path,
) -> anyhow::Result<Arc<ReloadableValidator>> {
    let ek_trust = EkTrust::from_pem(config.cluster.ek_ca_pem.as_bytes())?;
    let required = vec![
        (pcr::CLUSTER_ID, [0; 32]),
        (pcr::CONFIG, config.expected_config_pcr()),
    ];
    Ok(Arc::new(
        ReloadableValidator::load(measurements, ek_trust, required)?.with_cpu(cpu_trust(config)?),
    ))
}

/// Serves `service` on `addr` over mutual aTLS with `policy` until the task
/// is dropped.
pub async fn serve_join(
    addr: SocketAddr,
    tpm: SharedTpm,
    policy: Arc<ReloadableValidator>,
    service: JoinService,
) -> anyhow::Result<()> {
    serve_join_port(addr, tpm, policy.validator(), service, None).await
}

/// Serves `service` and, when given, the `evidence` service on `addr` over
/// mutual aTLS, admitting peers by `validator`, until the task is dropped.
pub async fn serve_join_port(
    addr: SocketAddr,
    tpm: SharedTpm,
    validator: keel_atls::DynValidator<keel_verifier::validator::Verified>,
    service: JoinService,
    evidence: Option<EvidenceService>,
) -> anyhow::Result<()> {
    let evidence = evidence.map(|e| (e, EVIDENCE_REQUESTS_IN_FLIGHT));
    serve_join_port_with(addr, tpm, validator, service, evidence).await
}

/// [`serve_join_port`], the evidence service given with the evidence
/// requests the port holds at once.
async fn serve_join_port_with(
    addr: SocketAddr,
    tpm: SharedTpm,
    validator: keel_atls::DynValidator<keel_verifier::validator::Verified>,
    service: JoinService,
    evidence: Option<(EvidenceService, usize)>,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "join service listening (mutual aTLS)");
    let issuer = Arc::new(TpmIssuer::new(tpm));
    let incoming = AtlsServer::mutual(issuer, validator)
        .with_issuer_limits(JOIN_ISSUING_PER_SOURCE, JOIN_ISSUING)
        .with_connection_limits(JOIN_CONNECTIONS_PER_SOURCE, JOIN_CONNECTIONS)
        .with_handshake_eviction(JOIN_HANDSHAKE_EVICTION_AGE, JOIN_HANDSHAKE_WAIT)
        .incoming(listener);
    let limits = GrpcLimits {
        request_timeout: JOIN_REQUEST_TIMEOUT,
        stream_window: Some(JOIN_PORT_STREAM_WINDOW),
        ..GrpcLimits::default()
    };
    let service = join_port_bounds(
        service.into_service(),
        JOIN_REQUESTS_IN_FLIGHT,
        crate::join::service::MAX_REQUEST_BYTES,
        "the join service is busy; retry later",
    );
    let evidence = evidence.map(|(evidence, places)| {
        join_port_bounds(
            evidence.into_service(),
            places,
            crate::evidence::service::MAX_EVIDENCE_REQUEST_BYTES,
            "the evidence service is busy; retry later",
        )
    });
    grpc::serve(incoming, &limits, |server| {
        server.add_service(service).add_optional_service(evidence)
    })
    .await?;
    Ok(())
}

/// `service` with the join port's bounds on requests in flight: `limit`
/// at once across every connection, each body of at most `max_message`
/// bytes within [`JOIN_PORT_BODY_DEADLINE`], a source held to
/// [`JOIN_PORT_REQUESTS_PER_SOURCE`] of them (waiting included) once half
/// are taken; a request finding none free waits for one.
fn join_port_bounds<S>(
    service: S,
    limit: usize,
    max_message: usize,
    busy: &'static str,
) -> InFlightLimit<S> {
    InFlightLimit::new(service, limit, max_message, JOIN_PORT_BODY_DEADLINE, busy)
        .with_source_share_under_load(JOIN_PORT_REQUESTS_PER_SOURCE)
        .with_waiting(
            JOIN_PORT_REQUEST_WAIT,
            JOIN_PORT_EVICTION_AGE,
            JOIN_PORT_REQUESTS_WAITING,
        )
}

/// Keeps the join service's measurements file, and its policy, those of
/// the cluster state in `cluster`: written and reloaded at each change of
/// the state, a failed write tried again every 5 s. The ticket handlers
/// admit only peers of the state's sets, so a file left behind (a change
/// that landed while serving started, a write that failed) would let no
/// node join. Runs until aborted.
pub async fn follow_join_measurements(
    cluster: Arc<ClusterSlot>,
    path: PathBuf,
    policy: Arc<ReloadableValidator>,
) {
    let mut states = cluster.subscribe();
    loop {
        let state = states.borrow_and_update().clone();
        if let Some(state) = state {
            let (path, policy) = (path.clone(), policy.clone());
            let written = tokio::task::spawn_blocking(move || {
                crate::attestation::policy::write_accepted(
                    &path,
                    &state.join_measurements,
                    state.staged_measurements.as_ref(),
                )
                .map_err(|e| keel_atls::ErrorChain(&e).to_string())?;
                // A file the policy refuses is logged by the reload.
                let _ = policy.reload();
                Ok::<_, String>(())
            })
            .await
            .unwrap_or_else(|_| Err("the writing task ended".into()));
            if let Err(e) = written {
                tracing::error!(error = %e, "writing the join measurements failed; trying again in 5 s");
                tokio::time::sleep(Duration::from_secs(5)).await;
                continue;
            }
        }
        if states.changed().await.is_err() {
            return;
        }
    }
}

/// On a control-plane node: waits until this node has a cluster state
/// (it created the cluster, joined or rejoined as a control plane, or was
/// recovered), writes the measurements its cluster state carries to
/// `measurements`, then serves the join service on `addr`. The file
/// follows the cluster state (the operator API changes it), and the
/// join service's policy follows the file ([`follow_join_measurements`]);
/// the file is also re-read every 10 s.
///
/// A node that has its cluster state told the operator it serves joins
/// (`keel init`, a rejoin, `keel recover`): a set-up that fails (the port
/// held a moment by another process, a full `/run`) is logged and tried
/// again, with pauses from 0.5-1 s doubling to 15-30 s ([`Backoff`]'s
/// default), until it serves.
pub async fn serve_join_as_control_plane(
    addr: SocketAddr,
    config: NodeConfig,
    tpm: SharedTpm,
    env: NodeEnv,
    cluster: Arc<ClusterSlot>,
    measurements: PathBuf,
) -> anyhow::Result<()> {
    serve_join_as_control_plane_with(
        addr,
        config,
        tpm,
        env,
        cluster,
        measurements,
        EVIDENCE_REQUESTS_IN_FLIGHT,
    )
    .await
}

/// [`serve_join_as_control_plane`] with `evidence_places` evidence
/// requests held at once in place of [`EVIDENCE_REQUESTS_IN_FLIGHT`]: for
/// tests of what members need of the port.
pub async fn serve_join_as_control_plane_with(
    addr: SocketAddr,
    config: NodeConfig,
    tpm: SharedTpm,
    env: NodeEnv,
    cluster: Arc<ClusterSlot>,
    measurements: PathBuf,
    evidence_places: usize,
) -> anyhow::Result<()> {
    // Once per start, before any run: a set-up tried again below may
    // follow a service whose last `token create` still runs.
    crate::kubeadm::token::remove_stale_configs(&env.work_dir.join(crate::paths::TOKEN_CONFIG_DIR));
    Backoff::default()
        .retry("the join service", || {
            let (config, tpm, env, cluster, measurements) = (
                config.clone(),
                tpm.clone(),
                env.clone(),
                cluster.clone(),
                measurements.clone(),
            );
            async move {
                let mut slot = cluster.subscribe();
                let state = loop {
                    if let Some(state) = slot.borrow_and_update().clone() {
                        break state;
                    }
                    slot.changed().await?;
                };
                crate::attestation::policy::write_accepted(
                    &measurements,
                    &state.join_measurements,
                    state.staged_measurements.as_ref(),
                )?;
                tracing::info!(
                    path = %measurements.display(),
                    staged = state.staged_measurements.is_some(),
                    "join measurements written"
                );
                let policy = join_service_policy(&config, &measurements)?;
                let _watch = AbortOnDrop(policy.clone().watch(Duration::from_secs(10)));
                let _follow = AbortOnDrop(tokio::spawn(follow_join_measurements(
                    cluster.clone(),
                    measurements.clone(),
                    policy.clone(),
                )));
                let registry = RegistryStore::shared(env.root())?;
                let disks = Arc::new(DiskBindings::new(env.root()));
                let own_ek = crate::attestation::shared_own_ek_digest(&tpm)?;
                tokio::task::spawn_blocking({
                    let (registry, disks) = (registry.clone(), disks.clone());
                    let (name, disk) = (config.node.name.clone(), env.state_disk.clone());
                    move || hold_own_name(&registry, &disks, &own_ek, &name, disk.as_ref())
                })
                .await
                .map_err(|_| {
                    anyhow::anyhow!("recording this control plane in its registry: the task ended")
                })?;
                let own_image = crate::cluster::own_image(&tpm)
                    .await
                    .map_err(|e| anyhow::anyhow!("reading this node's image PCRs: {e}"))?;
                if !state.accepts_image(&own_image) {
                    tracing::warn!(
                        "this control plane's own image (its PCRs 4, 9 and 11) is neither the \
                         cluster's current nor its staged one"
                    );
                }
                let service = JoinService::new(
                    state,
                    env.kubeadm.clone(),
                    env.work_dir.clone(),
                    disks.clone(),
                    own_image,
                )?
                .following(&cluster)
                .with_registry(registry.clone(), own_ek)
                .with_api_server_endpoint(config.cluster.api_server_endpoint.clone());
                let members = Arc::new(MemberPolicy::new(
                    &cluster,
                    EkTrust::from_pem(config.cluster.ek_ca_pem.as_bytes())?,
                    config.expected_config_pcr(),
                    policy.cpu(),
                ));
                let evidence = EvidenceService::new(
                    &cluster,
                    members.clone(),
                    registry,
                    disks,
                    config.cluster.evidence.clone(),
                    own_ek,
                );
                let _sweep = AbortOnDrop(tokio::spawn(evidence.clone().sweep_forever()));
                let _present = AbortOnDrop(tokio::spawn({
                    let (cluster, tpm) = (cluster.clone(), tpm.clone());
                    async move { crate::cluster::present_own_image(&cluster, tpm).await }
                }));
                let validator = Arc::new(PortValidator::new(policy, members));
                let evidence = Some((evidence, evidence_places));
                serve_join_port_with(addr, tpm, validator, service, evidence).await
            }
        })
        .await;
    Ok(())
}

/// Runs the join client of this node and logs how it ended; a control
/// plane that joins or rejoins hands its cluster state to `cluster`. A
/// set-up that fails (reading the TPM's PCRs for the service's policy) is
/// logged and tried again with backoff: given up, the node would sit
/// unlocked and idle for the rest of its boot.
pub async fn run_join_client(node: Node) -> anyhow::Result<()> {
    let client = crate::backoff::Backoff::default()
        .retry("setting up the join client", || {
            let (config, tpm) = (node.config.clone(), node.tpm.clone());
            let (lock, env) = (node.lock.clone(), node.env.clone());
            async move {
                let settings = JoinSettings::from_config(&config)?;
                anyhow::Ok(JoinClient::new(config, tpm, lock, env, settings)?)
            }
        })
        .await
        .with_cluster_slot(node.cluster)
        .with_operator_key_slot(node.operator_key);
    match client.run().await {
        JoinOutcome::Joined { cluster_id } => {
            tracing::info!(cluster_id = %hex::encode(cluster_id), "joined the cluster");
        }
        JoinOutcome::Rejoined { cluster_id } => {
            tracing::info!(cluster_id = %hex::encode(cluster_id), "rejoined the cluster");
        }
        JoinOutcome::LostRace => tracing::info!("the node was locked by init; join client stopped"),
        JoinOutcome::Failed { error } => tracing::error!(%error, "join failed"),
    }
    Ok(())
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
