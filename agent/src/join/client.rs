//! The join client: makes this node a member of an existing cluster.
//!
//! It runs while the node is unlocked, next to the init server; whichever
//! takes the node lock first wins. Two paths:
//!
//! * **Join** (no initialised state disk): the node asks the control-plane
//!   endpoints of its measured config in turn for a join ticket, with capped
//!   exponential backoff and jitter, forever, until one issues a ticket or
//!   the node is locked by init. It asks only while it has a route to take
//!   the address it advertises from (a node on its loopback address joins
//!   a cluster no other node reaches). Nothing is written before the lock: the
//!   kubelet key and the disk UUID live in memory until then. With a valid
//!   ticket it takes the lock with the cluster ID derived from the ticket,
//!   then hands the rest to the [provisioning pipeline](crate::provision):
//!   state disk with the ticket's key, the kubelet certificate and key, the
//!   cluster CA and (control-plane joins) the control-plane PKI files,
//!   components, `kubeadm join`.
//! * **Rejoin** (the state disk carries a LUKS header, i.e. the node was a
//!   member before this boot): it asks for a rejoin ticket for the disk's
//!   UUID, checks that the key opens the disk, takes the lock with the
//!   cluster ID, opens the disk and starts the kubelet.
//!
//! **Mutual attestation.** The connection is mutual aTLS: the service
//! validates this node, and this node validates the service before it uses
//! anything from a ticket. The service must run the same boot chain and
//! config (PCRs 4, 9, 11 and 12 equal this node's own, read from its TPM),
//! its EK must chain to the cluster's EK CA, and once the ticket is opened
//! (its secrets are sealed to this TPM) the service's PCR 15 must be exactly
//! the extend of the cluster ID this node derives from the ticket, with that
//! ID in the service's replayed event log ([`super::ticket`]). A service of
//! another cluster, or one running another image, never gets this node.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use keel_proto::join::IssueJoinTicketRequest;
use keel_verifier::config::{NodeConfig, Role};
use zeroize::Zeroizing;

use super::kubelet::KubeletKey;
use super::settings::{JoinError, JoinSettings, Rounds};
use super::ticket::{JoinTicket, TicketError};
use super::transport::TicketClient;
use crate::cluster::{ClusterSlot, ClusterState};
use crate::disk::{DiskState, StateDisk};
use crate::kubeadm::{ControlPlaneJoin, Discovery, DiscoveryKubeconfig, JoinConfig};
use crate::measured::SharedTpm;
use crate::nodelock::{LockError, NodeLock};
use crate::operator::OperatorKeySlot;
use crate::paths;
use crate::provision::{DiskStep, NodeEnv, Plan, ProvisionError, Provisioner};
use crate::registry::RegistryStore;
use crate::resume::ResumeRecord;
use keel_verifier::keys::{ClusterId, OperatorKey};

/// Most endpoints a client keeps (its config's and those tickets named):
/// a control plane's tickets name them all, and a ticket may name no more
/// than [`MAX_CONTROL_PLANE_ENDPOINTS`](super::ticket::MAX_CONTROL_PLANE_ENDPOINTS).
const MAX_KNOWN_ENDPOINTS: usize = super::ticket::MAX_CONTROL_PLANE_ENDPOINTS;

/// The result of one attempt to take the node lock.
enum Locking {
    Taken,
    /// Something else holds it.
    Lost,
    /// Not taken; the node is still unlocked.
    Retry(String),
    /// Not recorded, yet PCR 15 changed: the node is locked and unusable.
    Broken(String),
}

/// How a join client run ended.
#[derive(Debug)]
pub enum JoinOutcome {
    /// The node joined the cluster.
    Joined {
        /// The cluster ID (now in PCR 15).
        cluster_id: ClusterId,
    },
    /// The node rejoined with its initialised state disk.
    Rejoined {
        /// The cluster ID (now in PCR 15).
        cluster_id: ClusterId,
    },
    /// The node was locked by something else (init won): nothing was touched.
    LostRace,
    /// The join failed for this boot: after the lock the node is unusable
    /// until it reboots (the state disk is marked for reset).
    Failed {
        /// What failed.
        error: String,
    },
}

/// The join client of this node.
pub struct JoinClient {
    config: NodeConfig,
    tpm: SharedTpm,
    lock: Arc<NodeLock>,
    env: NodeEnv,
    settings: JoinSettings,
    tickets: TicketClient,
    /// The endpoints tried: the config's, then those tickets named.
    endpoints: Mutex<Vec<String>>,
    /// Where each round of tries starts in `endpoints` (modulo its
    /// length), drawn at random for each boot: a control plane that
    /// answers first but whose tickets this node must refuse after its
    /// lock (its registry revokes the issuer, seen only on the opened
    /// disk) would otherwise be the one asked at every boot.
    first_endpoint: usize,
    /// Where a control plane hands its cluster state to its join service.
    cluster: Arc<ClusterSlot>,
    /// Where the operator key of a ticket goes.
    operator_key: Arc<OperatorKeySlot>,
}

impl JoinClient {
    /// A join client; reads this node's PCRs for the service validator.
    pub fn new(
        config: NodeConfig,
        tpm: SharedTpm,
        lock: Arc<NodeLock>,
        env: NodeEnv,
        settings: JoinSettings,
    ) -> Result<Self, JoinError> {
        if settings.endpoints.is_empty() {
            return Err(JoinError::NoEndpoints);
        }
        let validator = settings.service_validator(&tpm)?;
        let tickets = TicketClient::new(tpm.clone(), validator, settings.timeout)
            .for_role(config.node.role)
            .with_measurements_key(settings.measurements_key.clone());
        Ok(Self {
            config,
            tpm,
            lock,
            env,
            endpoints: Mutex::new(settings.endpoints.clone()),
            first_endpoint: rand::random::<u16>().into(),
            settings,
            tickets,
            cluster: Arc::new(ClusterSlot::new(None)),
            operator_key: Arc::default(),
        })
    }

    /// Hands the cluster state of a control plane (after it joined or
    /// rejoined) to `slot`, where its join service waits for it.
    pub fn with_cluster_slot(mut self, slot: Arc<ClusterSlot>) -> Self {
        self.cluster = slot;
        self
    }

    /// Keeps the operator key of the ticket this node joins or rejoins
    /// with in `slot`, where its operator API reads it.
    pub fn with_operator_key_slot(mut self, slot: Arc<OperatorKeySlot>) -> Self {
        self.operator_key = slot;
        self
    }

    /// Takes into use the operator key of the ticket this node became a
    /// member of `cluster_id` with, and keeps it for an agent restart.
    fn take_operator_key(&self, cluster_id: ClusterId, key: OperatorKey) {
        self.operator_key.set(key.clone());
        crate::resume::keep(ResumeRecord::of_member(cluster_id, key), &self.env.work_dir);
    }

    /// The endpoints to try now.
    fn endpoints(&self) -> Vec<String> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Adds the endpoints a ticket named to those tried from now on.
    fn learn_endpoints(&self, named: &[String]) {
        let mut known = self
            .endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for endpoint in named {
            if !known.contains(endpoint) && known.len() < MAX_KNOWN_ENDPOINTS {
                tracing::info!(%endpoint, "control-plane endpoint learned from a ticket");
                known.push(endpoint.clone());
            }
        }
    }

    /// Runs until the node joined, lost the race for the lock, or failed
    /// after the lock.
    pub async fn run(self) -> JoinOutcome {
        let Some(disk) = self.env.state_disk.clone() else {
            return self.join().await;
        };
        match self.member_disk_uuid(disk).await {
            Some(Some(uuid)) => self.rejoin(&uuid).await,
            Some(None) => self.join().await,
            None => JoinOutcome::LostRace,
        }
    }

    /// The UUID of a member's state disk, `Some(None)` for a fresh disk.
    /// A disk that cannot be inspected, or whose set-up is unfinished (a
    /// provisioning runs, or the reset at start failed), is inspected again
    /// after a pause, never taken for fresh: a join would format it, and
    /// it may hold a member's data or another provisioning's. `None` when
    /// the node got locked meanwhile (init won).
    async fn member_disk_uuid(&self, disk: StateDisk) -> Option<Option<String>> {
        let mut failures = 0;
        loop {
            let inspect = disk.clone();
            let inspected = tokio::task::spawn_blocking(move || inspect.inspect()).await;
            let pause = self.settings.backoff.delay(failures);
            let device = disk.device.display();
            let error = match inspected {
                Ok(Ok(DiskState::Member { uuid })) => return Some(Some(uuid)),
                Ok(Ok(DiskState::Fresh)) => return Some(None),
                Ok(Ok(DiskState::Unfinished { uuid })) => {
                    tracing::warn!(
                        disk = %device,
                        uuid,
                        retry_in = ?pause,
                        "the state disk's set-up is unfinished and resetting it at start failed; not joining until it is reset"
                    );
                    None
                }
                Ok(Err(e)) if e.unusable_header().is_some() => {
                    tracing::warn!(
                        error = %keel_atls::ErrorChain(&e),
                        disk = %device,
                        retry_in = ?pause,
                        "the state disk carries a LUKS header keel cannot use (damaged, or not keel's); not joining until the disk is wiped or its header restored"
                    );
                    None
                }
                Ok(Err(e)) => Some(keel_atls::ErrorChain(&e).to_string()),
                Err(e) => Some(e.to_string()),
            };
            if let Some(error) = error {
                tracing::warn!(
                    %error,
                    disk = %device,
                    retry_in = ?pause,
                    "inspecting the state disk failed; not joining until it can be told whether it holds a cluster's data"
                );
            }
            tokio::time::sleep(pause).await;
            if self.lock.is_locked() {
                return None;
            }
            failures = failures.saturating_add(1);
        }
    }

    /// Tries every endpoint in turn until `attempt` yields a value, with
    /// backoff between rounds. `None` when the node got locked meanwhile.
    async fn until_ticket<T, F, Fut>(&self, what: &str, mut attempt: F) -> Option<T>
    where
        F: FnMut(String) -> Fut,
        Fut: std::future::Future<Output = Result<T, TicketError>>,
    {
        let mut rounds = Rounds::default();
        loop {
            let mut refused_at_once = true;
            for endpoint in rotated(self.endpoints(), self.first_endpoint) {
                if self.lock.is_locked() {
                    return None;
                }
                match attempt(endpoint.clone()).await {
                    Ok(ticket) => {
                        tracing::info!(%endpoint, "{what} ticket issued by {endpoint}");
                        return Some(ticket);
                    }
                    Err(e) => {
                        refused_at_once &= e.is_refused_at_once();
                        tracing::warn!(
                            %endpoint,
                            error = %keel_atls::ErrorChain(&e),
                            "no {what} ticket from this endpoint"
                        )
                    }
                }
            }
            let pause = rounds.after(&self.settings.backoff, refused_at_once);
            tracing::info!(
                pause_ms = pause.as_millis() as u64,
                "retrying the {what} ticket"
            );
            if !self.pause_unless_locked(pause).await {
                return None;
            }
        }
    }

    /// Waits `pause`, in slices so that a lock taken by init stops the
    /// client promptly; `false` as soon as the node is locked.
    async fn pause_unless_locked(&self, pause: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + pause;
        while tokio::time::Instant::now() < deadline {
            if self.lock.is_locked() {
                return false;
            }
            let slice = deadline
                .saturating_duration_since(tokio::time::Instant::now())
                .min(Duration::from_millis(200));
            tokio::time::sleep(slice).await;
        }
        !self.lock.is_locked()
    }

    /// Fetches a ticket ([`Self::until_ticket`]) and takes the node lock with
    /// its cluster ID, fetching again while the lock fails transiently,
    /// after the settings' backoff: each ticket costs the control plane a
    /// handshake, a signed certificate and registry writes, and a lock that
    /// keeps failing (its record cannot be written) must not turn into a
    /// stream of tickets. `Err` carries the outcome when the race was lost
    /// or the lock broke.
    async fn locked_ticket<T, F, Fut>(
        &self,
        what: &str,
        mut attempt: F,
        cluster_id: impl Fn(&T) -> ClusterId,
    ) -> Result<T, JoinOutcome>
    where
        F: FnMut(String) -> Fut,
        Fut: std::future::Future<Output = Result<T, TicketError>>,
    {
        let mut failures = 0u32;
        loop {
            let Some(ticket) = self.until_ticket(what, &mut attempt).await else {
                return Err(JoinOutcome::LostRace);
            };
            match self.lock(cluster_id(&ticket)).await {
                Locking::Taken => return Ok(ticket),
                Locking::Lost => return Err(JoinOutcome::LostRace),
                Locking::Retry(e) => {
                    let pause = self.settings.backoff.delay(failures);
                    failures = failures.saturating_add(1);
                    tracing::warn!(
                        error = %e,
                        retry_in = ?pause,
                        "taking the node lock failed; asking for another ticket after the pause"
                    );
                    if !self.pause_unless_locked(pause).await {
                        return Err(JoinOutcome::LostRace);
                    }
                }
                Locking::Broken(e) => return Err(self.fail(ProvisionError::Lock(e)).await),
            }
        }
    }

    /// Takes the lock with `cluster_id`.
    async fn lock(&self, cluster_id: ClusterId) -> Locking {
        let (lock, run_dir) = (self.lock.clone(), self.env.work_dir.clone());
        let taken = tokio::task::spawn_blocking(move || {
            crate::resume::take_lock(&lock, cluster_id, &run_dir)
        })
        .await;
        match taken {
            Ok(Ok(())) => Locking::Taken,
            Ok(Err(LockError::AlreadyLocked)) => Locking::Lost,
            // A failed record may still have extended PCR 15: then the
            // node is locked for good and cannot continue.
            Ok(Err(e)) if e.left_locked() => Locking::Broken(keel_atls::ErrorChain(&e).to_string()),
            Ok(Err(e)) => Locking::Retry(keel_atls::ErrorChain(&e).to_string()),
            Err(e) => Locking::Retry(format!("lock task: {e}")),
        }
    }

    async fn join(self) -> JoinOutcome {
        let node = &self.config.node;
        let is_control_plane = node.role == Role::ControlPlane;
        let kubelet = match KubeletKey::generate(&node.name) {
            Ok(k) => k,
            Err(e) => {
                return JoinOutcome::Failed {
                    error: format!("making the kubelet key: {e}"),
                }
            }
        };
        let spki = kubelet.spki();
        let disk_uuid = crate::disk::new_uuid();
        let request = IssueJoinTicketRequest {
            disk_uuid: disk_uuid.clone(),
            kubelet_csr: kubelet.csr_pem().as_bytes().to_vec(),
            is_control_plane,
            node_name: node.name.clone(),
            file_discovery: true,
        };
        let (tickets, spki) = (&self.tickets, spki.as_slice());
        let advertise = &self.env.advertise_address;
        let attempt = |endpoint: String| {
            let request = request.clone();
            async move {
                // Chosen before the lock: a node with no route to take the
                // address it advertises from asks for nothing and stays
                // untouched, instead of joining on its loopback address.
                let address = advertise.resolve().map_err(TicketError::NoAddress)?;
                let ticket = tickets.join_ticket(&endpoint, request, spki).await?;
                Ok((ticket, address))
            }
        };
        let locked = self
            .locked_ticket("join", attempt, |(t, _)| t.cluster_id)
            .await;
        let (mut ticket, advertise_address) = match locked {
            Ok(locked) => locked,
            Err(outcome) => return outcome,
        };
        tracing::info!(cluster_id = %hex::encode(ticket.cluster_id), "node locked for join");
        self.learn_endpoints(&ticket.control_plane_endpoints);
        // Taken into use once the node is provisioned: an operator request
        // (an upgrade) must not run while the join installs components.
        let operator_key = ticket.operator_key.clone();
        let (plan, join) = self.join_plan(
            &ticket,
            advertise_address,
            disk_uuid,
            &kubelet,
            is_control_plane,
        );
        let cluster_id = ticket.cluster_id;
        let registry = ticket
            .control_plane
            .as_mut()
            .map(|(_, m)| (std::mem::take(&mut m.registry), m.issuer));
        let files = plan.files.clone();
        let p = Provisioner::new(&self.env, &self.tpm, &log_line);
        let result = async {
            p.prepare(plan).await?;
            if let Some((registry, issuer)) = registry {
                self.take_registry(registry, issuer).await?;
            }
            p.kubeadm_join(&join, &files).await?;
            match self.control_plane_state(ticket, advertise_address)? {
                Some(state) => p.serve_as_control_plane(state, &self.cluster).await,
                None => p.finish().await,
            }
        }
        .await;
        match settle(&p, result).await {
            Ok(()) => {
                self.take_operator_key(cluster_id, operator_key);
                tracing::info!("this node joined the cluster");
                JoinOutcome::Joined { cluster_id }
            }
            Err(outcome) => outcome,
        }
    }

    async fn rejoin(self, disk_uuid: &str) -> JoinOutcome {
        let Some(disk) = self.env.state_disk.clone() else {
            return JoinOutcome::Failed {
                error: "rejoin without a state disk".into(),
            };
        };
        tracing::info!(disk = %disk.device.display(), uuid = disk_uuid, "state disk initialised: rejoining");
        let tickets = &self.tickets;
        let advertise =
            (self.config.node.role == Role::ControlPlane).then_some(&self.env.advertise_address);
        let attempt = |endpoint: String| {
            let disk = disk.clone();
            async move {
                // A control plane serves its API server on the address it
                // advertises: with no route to take one from, it asks for
                // nothing and stays untouched (as a join does).
                if let Some(advertise) = advertise {
                    advertise.resolve().map_err(TicketError::NoAddress)?;
                }
                let ticket = tickets.rejoin_ticket(&endpoint, disk_uuid).await?;
                // Before the lock: the key must open this very disk.
                let key = ticket.disk_key.clone();
                let matches = tokio::task::spawn_blocking(move || {
                    disk.cryptsetup.key_matches(&disk.device, &key)
                })
                .await
                .map_err(|_| TicketError::Tpm)?
                .map_err(|e| {
                    TicketError::Invalid(format!(
                        "testing the disk key: {}",
                        keel_atls::ErrorChain(&e)
                    ))
                })?;
                if !matches {
                    return Err(TicketError::Invalid(
                        "the disk key does not open the state disk".into(),
                    ));
                }
                Ok(ticket)
            }
        };
        let mut ticket = match self
            .locked_ticket("rejoin", attempt, |t| t.cluster_id)
            .await
        {
            Ok(ticket) => ticket,
            Err(outcome) => return outcome,
        };
        self.learn_endpoints(&ticket.control_plane_endpoints);
        // As for a join: not while the recorded components are reinstalled.
        let operator_key = ticket.operator_key.clone();
        let plan = Plan {
            disk: DiskStep::Open {
                key: ticket.disk_key,
            },
            files: Vec::new(),
            components: None,
        };
        let p = Provisioner::new(&self.env, &self.tpm, &log_line);
        let registry = std::mem::take(&mut ticket.registry);
        let result = async {
            p.prepare(plan).await?;
            // Revoked while a control plane the host routes this rejoin to
            // was cut off from the others: its own registry, now readable,
            // says so, as it does to recovery and to a restart.
            let tpm = self.tpm.clone();
            let own_ek =
                tokio::task::spawn_blocking(move || crate::attestation::shared_own_ek_digest(&tpm))
                    .await
                    .map_err(ProvisionError::Blocking)?
                    .map_err(ProvisionError::Tpm)?;
            p.refuse_revoked_or_renamed(&own_ek, &self.config.node)
                .await?;
            // A control plane restores its state before the kubelet starts
            // anything: facts that do not match the keys stop it here.
            let state = match ticket.control_plane_keys {
                Some(keys) => {
                    let restored =
                        p.restore_control_plane(keys, self.settings.measurements_key.clone())?;
                    // Nothing is taken from an issuer this registry revokes.
                    self.take_registry(registry, ticket.issuer).await?;
                    Some(match ticket.image.take() {
                        Some(image) => newer_image(restored, image),
                        None => restored,
                    })
                }
                None => None,
            };
            p.reinstall_recorded().await?;
            p.start_kubelet().await?;
            match state {
                Some(state) => p.serve_as_control_plane(state, &self.cluster).await,
                None => Ok(()),
            }
        }
        .await;
        match settle(&p, result).await {
            Ok(()) => {
                self.take_operator_key(ticket.cluster_id, operator_key);
                JoinOutcome::Rejoined {
                    cluster_id: ticket.cluster_id,
                }
            }
            Err(outcome) => outcome,
        }
    }

    /// Merges the registry of the issuing control plane (of the EK
    /// `issuer`) from a control plane's ticket into this node's, on its
    /// opened state disk, before its join service (which opens the same
    /// store) can issue a ticket: a control plane that joined, or was
    /// down, when a node was revoked or joined refuses that node's EK, or
    /// a second TPM under its name, before it exchanged registries with
    /// the others. As in that exchange, a drift held here stands against
    /// the issuer's records, and nothing is taken from an issuer this
    /// registry revokes (the host may route a rejoin to a revoked control
    /// plane that still runs): the ticket is refused.
    async fn take_registry(
        &self,
        registry: crate::registry::Registry,
        issuer: keel_verifier::ek::EkDigest,
    ) -> Result<(), ProvisionError> {
        let root = self.env.root().to_owned();
        let stands = self.config.cluster.evidence.drift_stands();
        let offered = registry.nodes().len();
        let merged = tokio::task::spawn_blocking(move || {
            RegistryStore::shared(&root)
                .and_then(|store| store.merge_from_ticket(registry, stands, &issuer))
        })
        .await
        .map_err(ProvisionError::Blocking)?
        .map_err(ProvisionError::Registry)?;
        tracing::info!(
            revocations = merged.added,
            nodes = merged.taken,
            offered,
            "registry taken from the ticket (a node record older than this one's is not taken)"
        );
        Ok(())
    }

    /// The work after a join ticket: a fresh state disk, the kubelet's
    /// (and a control plane's) PKI, the components, `kubeadm join`, the
    /// node advertising `advertise_address`.
    fn join_plan(
        &self,
        ticket: &JoinTicket,
        advertise_address: IpAddr,
        disk_uuid: String,
        kubelet: &KubeletKey,
        is_control_plane: bool,
    ) -> (Plan, JoinConfig) {
        let kubelet_dir = PathBuf::from(paths::KUBELET_PKI_DIR);
        let mut files = vec![
            (
                kubelet_dir.join("kubelet-client.crt"),
                Zeroizing::new(ticket.kubelet_cert.as_bytes().to_vec()),
            ),
            (
                kubelet_dir.join("kubelet-client.key"),
                Zeroizing::new(kubelet.private_pem().as_bytes().to_vec()),
            ),
            (
                kubelet_dir.join("ca.crt"),
                Zeroizing::new(ticket.ca_cert.as_bytes().to_vec()),
            ),
        ];
        let pki = PathBuf::from(paths::CONTROL_PLANE_PKI_DIR);
        for (name, data) in &ticket.control_plane_files {
            files.push((pki.join(name), data.clone()));
        }
        let join = JoinConfig {
            node_name: self.config.node.name.clone(),
            node_ip: advertise_address,
            kubernetes_version: ticket.version,
            api_server_endpoint: ticket.api_server_endpoint.clone(),
            discovery: match &ticket.token {
                // A control plane of an earlier version sends a token.
                Some(token) => Discovery::Token {
                    token: token.clone(),
                    ca_cert_hashes: vec![ticket.ca_hash.clone()],
                },
                None => Discovery::File {
                    path: self.env.work_dir.join(paths::KUBEADM_DISCOVERY_CONFIG),
                    kubeconfig: DiscoveryKubeconfig {
                        ca_pem: ticket.ca_cert.clone(),
                        cert_pem: ticket.kubelet_cert.clone(),
                        key_pem: kubelet.private_pem(),
                    },
                },
            },
            control_plane: is_control_plane.then_some(ControlPlaneJoin {
                advertise_address,
                certificate_key: None,
            }),
            patches_dir: self.env.patches_dir(),
        };
        let plan = Plan {
            disk: DiskStep::SetUp {
                uuid: disk_uuid,
                key: ticket.disk_key.clone(),
            },
            files,
            components: Some((ticket.version, ticket.components.clone())),
        };
        (plan, join)
    }

    /// The cluster state of a control plane that joined with `ticket`,
    /// its API server on `advertise_address`; `None` for a worker.
    fn control_plane_state(
        &self,
        ticket: JoinTicket,
        advertise_address: IpAddr,
    ) -> Result<Option<ClusterState>, ProvisionError> {
        let Some((keys, measurements)) = ticket.control_plane else {
            return Ok(None);
        };
        let measurement_secret = keys
            .measurement_secret()
            .map_err(|e| ProvisionError::Lock(format!("deriving the measurement secret: {e}")))?;
        // Held to this version's bounds (a control plane of an older one
        // may keep more authorised components than the facts take).
        let state = ClusterState {
            keys: Arc::new(keys),
            measurement_salt: ticket.measurement_salt,
            measurement_secret,
            cluster_id: ticket.cluster_id,
            kubernetes_version: ticket.version,
            components: ticket.components,
            authorised_components: measurements.authorised,
            api_server: SocketAddr::new(advertise_address, crate::kubeadm::config::API_SERVER_PORT),
            pki_dir: self.env.pki_dir(),
            join_measurements: measurements.image.join,
            staged_measurements: measurements.image.staged,
            measurements_key: self.settings.measurements_key.clone(),
            signed_measurements: measurements.image.signed,
            image_epoch: 0,
            control_plane_endpoints: self.endpoints(),
        };
        Ok(Some(
            state.authorising(&[]).with_floor(measurements.image.floor),
        ))
    }

    /// After the lock could not be recorded: the node is unusable.
    async fn fail(&self, error: ProvisionError) -> JoinOutcome {
        let p = Provisioner::new(&self.env, &self.tpm, &log_line);
        p.fail(&error).await;
        JoinOutcome::Failed {
            error: keel_atls::ErrorChain(&error).to_string(),
        }
    }
}

/// After the provisioning steps: a failure resets the node and becomes the
/// outcome.
async fn settle(
    p: &Provisioner<'_>,
    result: Result<(), ProvisionError>,
) -> Result<(), JoinOutcome> {
    let Err(e) = result else {
        return Ok(());
    };
    p.fail(&e).await;
    Err(JoinOutcome::Failed {
        error: keel_atls::ErrorChain(&e).to_string(),
    })
}

/// `endpoints` starting at the one at `first` (modulo their number).
fn rotated(mut endpoints: Vec<String>, first: usize) -> Vec<String> {
    if let Some(by) = first.checked_rem(endpoints.len()) {
        endpoints.rotate_left(by);
    }
    endpoints
}

/// A restored control-plane state with the images of its rejoin ticket's
/// issuer where they are newer ([`ClusterState::with_newer_image`]).
fn newer_image(restored: ClusterState, image: crate::cluster::ImageState) -> ClusterState {
    let (own, offered) = (restored.image_epoch, image.floor);
    let (state, taken) = restored.with_newer_image(image);
    if taken {
        tracing::warn!(
            own_floor = own,
            issuer_floor = offered,
            join_measurements = %hex::encode(state.join_measurements.digest()),
            "this state disk held an older image state than the cluster's: \
             serving with the issuer's accepted images and floor"
        );
    }
    state
}

/// The join client's provisioning log: the agent's log.
fn log_line(line: String) {
    tracing::info!(target: "keel_agent::provision", "{line}");
}

#[cfg(test)]
mod tests {
    use super::rotated;

    #[test]
    fn each_round_of_tries_starts_at_the_drawn_endpoint() {
        let endpoints: Vec<String> = ["a:1", "b:1", "c:1"].map(String::from).into();
        let order = |first| rotated(endpoints.clone(), first).join(",");
        assert_eq!(order(0), "a:1,b:1,c:1");
        assert_eq!(order(1), "b:1,c:1,a:1");
        assert_eq!(order(5), "c:1,a:1,b:1");
        assert!(rotated(Vec::new(), 7).is_empty());
    }
}
