//! The init flow: the operator's CLI turns this node into the first node of
//! a new cluster.
//!
//! Everything the request carries is checked before the node lock is taken:
//! the init and master secrets (sealed together to this TPM, so they open
//! only here), the init secret (constant time, against the hash in the
//! measured config; an address that sends wrong ones waits longer after
//! each), salts and the Kubernetes version. A refusal there changes nothing. Then the lock is
//! taken (PCR 15 := cluster ID) and the node is committed: it sets up its
//! state disk, installs the components, runs kubeadm and returns the admin
//! kubeconfig. A failure after the lock is fatal for this boot: the stream
//! carries the failure and the node's logs, the state disk is marked for
//! reset, and the node reboots after a grace period.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use keel_installer::{Component, KubernetesVersion};
use keel_proto::init::init_response::Kind;
use keel_proto::init::init_service_server::{InitService, InitServiceServer};
use keel_proto::init::{InitFailure, InitRequest, InitResponse, InitSecrets, InitSuccess};
use keel_verifier::cluster_settings::{
    check_cluster_name, check_cluster_network, DEFAULT_SERVICE_CIDR,
};
use keel_verifier::config::Role;
use keel_verifier::measurements::Measurements;
use keel_verifier::signature::{SignedMeasurements, SigningPublicKey};
use prost::Message as _;
use tokio_stream::wrappers::ReceiverStream;
use zeroize::Zeroizing;

use crate::attestation::credential;
use crate::cluster::ClusterState;
use crate::disk::{DiskState, UnusableHeader};
use crate::kubeadm::{self, BootstrapToken, InitConfig};
use crate::nodelock::LockError;
use crate::provision::{DiskStep, Node, Plan, ProvisionError, Provisioner};
use crate::throttle::FailureThrottle;
use keel_verifier::keys::{self, KeyService};

use crate::transcript::Transcript;

/// Size of one log chunk on the init stream.
pub const LOG_CHUNK: usize = 32 * 1024;

/// Why an init request was refused before the node lock.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// The node has no init secret hash in its config: it does not accept init.
    #[error("this node does not accept init (no init secret configured)")]
    NotInitNode,
    /// The node is measured as a worker: a cluster starts on a control
    /// plane, and a worker's agent runs no join service to grow it.
    #[error("this node is a worker; init runs on a control plane")]
    NotControlPlane,
    /// The node's config could not run what an initialised control plane
    /// runs (its join service and evidence checks need the EK CA, the CPU
    /// policy and the measurements key): a locked node would serve nothing.
    #[error(
        "this node's config cannot run a cluster's control plane: {0}; boot it with a \
         corrected config (PCR 12 changes with it)"
    )]
    UnusableConfig(String),
    /// The init secret does not match.
    #[error("wrong init secret")]
    WrongInitSecret,
    /// A request field is invalid. Only fields checked after the init
    /// secret matched carry detail: the caller is then the operator.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// What the request chose (its own components, the join measurements)
    /// lacks a valid signature by the cluster's measurements signing key,
    /// which the node's config names.
    #[error("{0}")]
    Unsigned(String),
    /// The master secret was not sealed to this node's TPM.
    #[error("the master secret is not sealed to this node's TPM")]
    Sealed(#[source] keel_verifier::credential::CredentialError),
    /// The node is already locked.
    #[error("the node is already part of a cluster")]
    Locked,
    /// The state disk holds a cluster's data: init would format it.
    #[error("this node's state disk is initialised; it rejoins or is recovered, never initialised again")]
    DiskInitialised,
    /// The state disk holds a set-up that never finished, left by an
    /// earlier boot, which the agent's start could not reset. Init does
    /// not reset it itself: a reset decided before a join takes the lock
    /// and done after could erase the header that join formats. The next
    /// boot's start resets it.
    #[error("this node's state disk holds a set-up that never finished and was not reset at start; reboot the node to reset it")]
    DiskUnfinished,
    /// The state disk carries a LUKS signature whose header cryptsetup
    /// cannot read ([`crate::disk::DiskError::DamagedHeader`]): init does
    /// not format what may be a member's data.
    #[error("this node's state disk carries a damaged LUKS header; init does not format it: restore the header or wipe the disk")]
    DiskDamaged(#[source] crate::disk::DiskError),
    /// The state disk carries a LUKS header keel cannot use
    /// ([`crate::disk::UnusableHeader::Foreign`]): init does not
    /// format what may be someone's data.
    #[error("this node's state disk carries a LUKS header keel cannot use (LUKS1, or no UUID or label it can read); init does not format it: wipe the disk to use it")]
    DiskForeign(#[source] crate::disk::DiskError),
    /// Whether the state disk holds a cluster's data could not be told:
    /// init refuses rather than risk formatting it.
    #[error("reading the state disk's header failed")]
    DiskUnreadable(#[source] crate::disk::DiskError),
    /// Taking the lock failed for another reason.
    #[error("taking the node lock failed")]
    Lock(#[source] LockError),
    /// Recording the lock failed after PCR 15 was extended: the node is
    /// locked with nothing served, and starts over from a reset.
    #[error("the node locked but could not record its lock; it resets its state disk and starts over from a reboot")]
    LockBroken(#[source] LockError),
    /// The node has no route toward its configured peer or the operator
    /// to take the address it would advertise from.
    #[error("the node has no network route to take the address it would advertise from")]
    NoAddress,
    /// The TPM could not be used.
    #[error("the TPM is unavailable")]
    Tpm,
    /// A task of the check ended without its result (it panicked).
    #[error("an internal task failed")]
    Internal,
    /// The peer's address sent requests that were refused (wrong init
    /// secrets or none) and must wait this many seconds.
    #[error("too many refused init requests from this address; retry in {0} s")]
    Throttled(u64),
}

/// Maps a refused field (checked after the init secret matched) to
/// [`InitError::InvalidRequest`]: `what`, then why.
fn invalid<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> InitError {
    move |e| InitError::InvalidRequest(format!("{what}: {e}"))
}

impl From<&InitError> for tonic::Status {
    /// The one map from init refusals to gRPC codes; peers get the short
    /// message, the node's log has the full chain.
    fn from(e: &InitError) -> Self {
        let code = match e {
            InitError::WrongInitSecret => tonic::Code::Unauthenticated,
            InitError::Unsigned(_) => tonic::Code::PermissionDenied,
            InitError::InvalidRequest(_) | InitError::Sealed(_) => tonic::Code::InvalidArgument,
            InitError::NotInitNode
            | InitError::NotControlPlane
            | InitError::UnusableConfig(_)
            | InitError::Locked
            | InitError::DiskInitialised
            | InitError::DiskUnfinished
            | InitError::DiskDamaged(_)
            | InitError::DiskForeign(_) => tonic::Code::FailedPrecondition,
            InitError::Lock(_)
            | InitError::LockBroken(_)
            | InitError::Tpm
            | InitError::NoAddress
            | InitError::DiskUnreadable(_) => tonic::Code::Unavailable,
            InitError::Internal => tonic::Code::Internal,
            InitError::Throttled(seconds) => return keel_proto::held_back(e.to_string(), *seconds),
        };
        tonic::Status::new(code, e.to_string())
    }
}

/// A request that passed every check, ready to lock on.
struct Accepted {
    keys: Arc<KeyService>,
    disk_uuid: String,
    disk_key: Zeroizing<Vec<u8>>,
    measurement_salt: Vec<u8>,
    measurement_secret: Zeroizing<Vec<u8>>,
    cluster_id: keys::ClusterId,
    /// The address the cluster's API server is advertised on.
    advertise_address: IpAddr,
    version: KubernetesVersion,
    components: Vec<Component>,
    cluster_name: String,
    cert_sans: Vec<String>,
    service_cidr: String,
    join_measurements: Measurements,
    measurements_key: Option<SigningPublicKey>,
    signed_measurements: Vec<SignedMeasurements>,
}

/// The init server.
#[derive(Clone)]
pub struct InitServer {
    inner: Arc<Inner>,
}

struct Inner {
    node: Node,
    throttle: FailureThrottle,
    opening: tokio::sync::Mutex<()>,
    /// One init secret check at a time, held by the check itself: a
    /// request whose client goes away ends, its check does not.
    checking: Arc<tokio::sync::Semaphore>,
}

/// The opened secrets of a request, wiped when dropped.
struct SecretsGuard(InitSecrets);

impl Drop for SecretsGuard {
    fn drop(&mut self) {
        use zeroize::Zeroize as _;
        self.0.init_secret.zeroize();
        self.0.master_secret.zeroize();
    }
}

impl InitServer {
    /// An init server for this node.
    pub fn new(node: Node) -> Self {
        Self {
            inner: Arc::new(Inner {
                node,
                throttle: FailureThrottle::default(),
                opening: tokio::sync::Mutex::new(()),
                checking: Arc::new(tokio::sync::Semaphore::new(1)),
            }),
        }
    }

    /// The tonic service.
    pub fn into_service(self) -> InitServiceServer<Self> {
        InitServiceServer::new(self)
    }

    /// Opens the sealed secrets of a request with this node's TPM and
    /// checks their init secret; also returns this node's EK digest.
    async fn open(
        &self,
        sealed: keel_proto::attestation::SealedSecret,
    ) -> Result<(SecretsGuard, keel_verifier::ek::EkDigest), InitError> {
        let (opened, own_ek) = credential::open_on(&self.inner.node.tpm, sealed)
            .await
            .map_err(|e| match e {
                credential::OpenError::Tpm => InitError::Tpm,
                credential::OpenError::Sealed(e) => InitError::Sealed(e),
            })?;
        // Decoded into the guard, so that what a decode that fails partway
        // filled in is wiped too.
        let mut secrets = SecretsGuard(InitSecrets::default());
        secrets
            .0
            .merge(opened.as_slice())
            .map_err(|_| InitError::InvalidRequest("sealed secrets do not decode".into()))?;
        // Memory-hard: checked off the runtime's workers, one at a time
        // even when the requests that started them are gone.
        let hash = self.inner.node.config.cluster.init_secret_hash.clone();
        let permit = self
            .inner
            .checking
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| InitError::Internal)?;
        let (secrets, matches) = tokio::task::spawn_blocking(move || {
            let matches = keel_verifier::init_secret::matches(&hash, &secrets.0.init_secret);
            drop(permit);
            (secrets, matches)
        })
        .await
        .map_err(|_| InitError::Internal)?;
        if !matches {
            return Err(InitError::WrongInitSecret);
        }
        Ok((secrets, own_ek))
    }

    /// Checks `request` completely, without side effects.
    async fn accept(
        &self,
        request: InitRequest,
        peer: Option<IpAddr>,
    ) -> Result<Accepted, InitError> {
        let config = &self.inner.node.config;
        if config.cluster.init_secret_hash.is_empty() {
            return Err(InitError::NotInitNode);
        }
        if config.node.role != Role::ControlPlane {
            return Err(InitError::NotControlPlane);
        }
        // What the control plane runs once locked is set up from the config
        // alone: a config it cannot be set up from is refused here, not
        // found after the lock by services that retry it forever.
        crate::join::JoinSettings::from_config(config)
            .map_err(|e| InitError::UnusableConfig(keel_atls::ErrorChain(&e).to_string()))?;
        // A node in a cluster takes no init: refused before the request
        // costs its TPM anything.
        if self.inner.node.lock.is_locked() {
            return Err(InitError::Locked);
        }
        // One request at a time is opened (each costs a TPM operation), and
        // an address whose request did not open to the right init secret
        // waits, doubling per failure.
        let _one_at_a_time = self.inner.opening.lock().await;
        // Locked (by a join, or the request before this one) while this
        // one waited its turn: still nothing spent on it.
        if self.inner.node.lock.is_locked() {
            return Err(InitError::Locked);
        }
        if let Some(ip) = peer {
            self.inner
                .throttle
                .check(ip)
                .map_err(|wait| InitError::Throttled(wait.as_secs().max(1)))?;
        }
        // Every request past this point counts as a failure of its
        // address until it opens to the right secret: one that does not
        // open has cost the TPM as much as one with a wrong secret, and one
        // whose client goes away midway (this future dropped) has cost the
        // TPM and the secret's check all the same. One without secrets
        // counts too, so a flood of them is throttled like wrong secrets.
        let counted = peer.map(|ip| (ip, self.inner.throttle.failed(ip)));
        let opened = match request.secrets {
            Some(sealed) => self.open(sealed).await,
            None => Err(InitError::InvalidRequest("sealed secrets missing".into())),
        };
        let (secrets, own_ek) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                if let Some((ip, (failures, wait))) = counted {
                    tracing::warn!(
                        peer = %ip,
                        failures,
                        wait_s = wait.as_secs_f64(),
                        "init refused: {e}"
                    );
                }
                return Err(e);
            }
        };
        if let Some(ip) = peer {
            self.inner.throttle.succeeded(ip);
        }
        // Locked (by a join) while this request was opened.
        if self.inner.node.lock.is_locked() {
            return Err(InitError::Locked);
        }
        if let Some(disk) = self.inner.node.env.state_disk.clone() {
            let found = tokio::task::spawn_blocking(move || disk.inspect())
                .await
                .map_err(|_| InitError::Internal)?;
            // A join that locked the node since the check above may be
            // setting the disk up now (or be done): whatever the disk
            // showed, the answer is that the node is taken.
            if self.inner.node.lock.is_locked() {
                return Err(InitError::Locked);
            }
            let found = found.map_err(|e| match e.unusable_header() {
                Some(UnusableHeader::Damaged) => InitError::DiskDamaged(e),
                Some(UnusableHeader::Foreign) => InitError::DiskForeign(e),
                None => InitError::DiskUnreadable(e),
            })?;
            match found {
                DiskState::Fresh => {}
                DiskState::Member { .. } => return Err(InitError::DiskInitialised),
                DiskState::Unfinished { .. } => return Err(InitError::DiskUnfinished),
            }
        }
        let cluster_name = request.cluster_name;
        check_cluster_name(&cluster_name).map_err(|e| InitError::InvalidRequest(e.to_string()))?;
        let entry = keel_installer::resolve(&request.kubernetes_version)
            .map_err(invalid("unsupported Kubernetes version"))?;
        // The key comes from the measured config, never from the request.
        let measurements_key = config.cluster.signing_key().map_err(invalid(
            "invalid measurements signing key in the node config",
        ))?;
        let components = match request.kubernetes_components {
            Some(list) if !list.components.is_empty() => {
                // With a signing key, the operator's own components come
                // with their file signed by it, as they do in an upgrade.
                if let Some(key) = &measurements_key {
                    crate::components::check_signed_list(
                        key,
                        entry.version(),
                        &request.components_file,
                        &request.components_signature,
                        &list.components,
                    )
                    .map_err(|e| InitError::Unsigned(format!("components: {e}")))?;
                }
                list.components
                    .into_iter()
                    .map(Component::try_from)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(invalid("invalid component"))?
            }
            _ => entry.components().to_vec(),
        };
        keel_installer::check_list(&components).map_err(invalid("invalid component list"))?;
        // Every later upgrade switches these components' directories.
        crate::upgrade::check_switchable(&components)
            .map_err(invalid("components an upgrade could not replace"))?;
        let join_measurements = Measurements::parse(&request.join_measurements)
            .map_err(invalid("invalid join measurements"))?;
        // With a signing key, the measurements must carry its signature, so
        // that nodes of a later image accept this image's join services.
        let signed_measurements = match &measurements_key {
            Some(key) => vec![SignedMeasurements::verify(
                key,
                &request.join_measurements,
                &request.join_measurements_signature,
            )
            .map_err(|e| {
                InitError::Unsigned(format!(
                    "the join measurements are not signed with the node config's measurements \
                     signing key: {e}"
                ))
            })?],
            None if request.join_measurements_signature.is_empty() => Vec::new(),
            None => {
                return Err(InitError::InvalidRequest(
                    "the join measurements carry a signature, but the node config names no measurements signing key".into(),
                ))
            }
        };
        let keys = KeyService::new(&secrets.0.master_secret, &request.master_salt)
            .map_err(invalid("invalid master secret or salt"))?;
        let measurement_secret = keys
            .measurement_secret()
            .map_err(invalid("invalid master secret or salt"))?;
        let cluster_id = keys::cluster_id(&measurement_secret, &request.measurement_salt)
            .map_err(invalid("invalid measurement salt"))?;
        let disk_uuid = crate::disk::new_uuid();
        let disk_key = keys
            .disk_key(&disk_uuid, &own_ek)
            .map_err(invalid("invalid master secret or salt"))?;
        let service_cidr = if request.service_cidr.is_empty() {
            DEFAULT_SERVICE_CIDR.to_owned()
        } else {
            request.service_cidr
        };
        check_cluster_network(&service_cidr, &request.api_server_cert_sans)
            .map_err(invalid("invalid cluster network settings"))?;
        // Chosen before the lock: a node with no route to advertise an
        // address on refuses, untouched, instead of creating a cluster on
        // its loopback address.
        let advertise_address = self
            .inner
            .node
            .env
            .advertise_address
            .resolve_for_init(peer)
            .ok_or(InitError::NoAddress)?;
        Ok(Accepted {
            advertise_address,
            keys: Arc::new(keys),
            disk_uuid,
            disk_key,
            measurement_salt: request.measurement_salt,
            measurement_secret,
            cluster_id,
            version: entry.version(),
            components,
            cluster_name,
            cert_sans: request.api_server_cert_sans,
            service_cidr,
            join_measurements,
            measurements_key,
            signed_measurements,
        })
    }

    /// Creates the cluster on this node, locked for `accepted`, streaming
    /// each step and kubeadm's output to `log` (a line never waits for the
    /// client); ends the transcript with the admin kubeconfig, or with the
    /// failure and the node's logs once the node is reset.
    async fn provision_after_lock(&self, accepted: &Accepted, log: &Transcript<Kind>) {
        log.line(format!(
            "node locked into cluster {}",
            hex::encode(accepted.cluster_id)
        ));
        let line = |l: String| log.line(l);
        let provisioner = Provisioner::new(&self.inner.node.env, &self.inner.node.tpm, &line);
        match self.create_cluster(accepted, &provisioner).await {
            Ok(kubeconfig) => {
                log.line("cluster created");
                log.finish([Kind::Success(InitSuccess {
                    kubeconfig: kubeconfig.to_vec(),
                    cluster_id: accepted.cluster_id.to_vec(),
                })])
                .await;
            }
            Err(e) => {
                let error = keel_atls::ErrorChain(&e).to_string();
                log.line(format!("init failed: {error}"));
                let reboots = provisioner.fail(&e).await;
                let logs = log.collected_logs().await;
                let chunks: Vec<Kind> = logs
                    .chunks(LOG_CHUNK)
                    .map(|chunk| Kind::LogChunk(chunk.to_vec()))
                    .collect();
                log.finish(
                    std::iter::once(Kind::Failure(InitFailure {
                        error,
                        node_reset: reboots,
                    }))
                    .chain(chunks),
                )
                .await;
            }
        }
    }

    /// The work after the lock; every line goes to `log`.
    async fn create_cluster(
        &self,
        a: &Accepted,
        provisioner: &Provisioner<'_>,
    ) -> Result<Zeroizing<Vec<u8>>, ProvisionError> {
        let env = &self.inner.node.env;
        provisioner
            .prepare(Plan {
                disk: DiskStep::SetUp {
                    uuid: a.disk_uuid.clone(),
                    key: a.disk_key.clone(),
                },
                files: Vec::new(),
                components: Some((a.version, a.components.clone())),
            })
            .await?;
        let advertise_address = a.advertise_address;
        let cluster_config = &self.inner.node.config.cluster;
        let init_config = InitConfig {
            node_name: self.inner.node.config.node.name.clone(),
            advertise_address,
            cluster_name: a.cluster_name.clone(),
            kubernetes_version: a.version,
            cert_sans: a.cert_sans.clone(),
            service_cidr: a.service_cidr.clone(),
            pod_cidr: "10.244.0.0/16".into(),
            patches_dir: env.patches_dir(),
            bootstrap_token: BootstrapToken::generate(),
            control_plane_endpoint: cluster_config.api_server_endpoint.clone(),
        };
        if cluster_config.api_server_endpoint.is_none()
            && cluster_config.control_plane_endpoints.len() > 1
        {
            tracing::warn!(
                "the config lists several control planes but no cluster.api_server_endpoint: \
                 every kubeconfig names this node's address, and the Kubernetes API is down \
                 while this node is"
            );
        }
        let kubeconfig = provisioner.kubeadm_init(&init_config).await?;
        let state = ClusterState {
            keys: a.keys.clone(),
            measurement_salt: a.measurement_salt.clone(),
            measurement_secret: a.measurement_secret.clone(),
            cluster_id: a.cluster_id,
            kubernetes_version: a.version,
            components: a.components.clone(),
            authorised_components: Vec::new(),
            api_server: SocketAddr::new(advertise_address, kubeadm::config::API_SERVER_PORT),
            pki_dir: env.pki_dir(),
            join_measurements: a.join_measurements.clone(),
            staged_measurements: None,
            measurements_key: a.measurements_key.clone(),
            signed_measurements: a.signed_measurements.clone(),
            image_epoch: 0,
            control_plane_endpoints: cluster_config.control_plane_endpoints.clone(),
        }
        // The initial image's epoch: no older image is staged after it.
        .with_floor(0);
        provisioner
            .serve_as_control_plane(state, &self.inner.node.cluster)
            .await?;
        Ok(kubeconfig)
    }
}

#[tonic::async_trait]
impl InitService for InitServer {
    type InitStream = ReceiverStream<Result<InitResponse, tonic::Status>>;

    async fn init(
        &self,
        request: tonic::Request<InitRequest>,
    ) -> Result<tonic::Response<Self::InitStream>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        let accepted = {
            let _open = caller.protect();
            self.accept(request.into_inner(), caller.ip()).await
        };
        let accepted = match accepted {
            Ok(a) => {
                // The init secret matched: the stream of the init stays.
                caller.vouch();
                a
            }
            // Refusals that cost the sender nothing (a throttled address,
            // a node already taken, a node that takes no init) are logged
            // at debug level only, so a flood of them cannot crowd other
            // events out of the journal.
            Err(
                e @ (InitError::Throttled(_)
                | InitError::Locked
                | InitError::NotInitNode
                | InitError::NotControlPlane
                | InitError::UnusableConfig(_)),
            ) => {
                tracing::debug!(error = %e, "init refused");
                return Err((&e).into());
            }
            Err(e) => {
                tracing::warn!(error = %keel_atls::ErrorChain(&e), "init refused");
                return Err((&e).into());
            }
        };
        let node = &self.inner.node;
        let (lock, work_dir, cluster_id) = (
            node.lock.clone(),
            node.env.work_dir.clone(),
            accepted.cluster_id,
        );
        let (log, rx) = Transcript::<Kind>::new();
        let (locked, lock_taken) = tokio::sync::oneshot::channel();
        let server = self.clone();
        // The lock and everything after it run on a task of their own, as a
        // recovery does: a caller that goes away (a reset stream, the
        // request timeout) while the lock is taken must not leave the node
        // locked with nothing set up and no reboot to come. The handler
        // waits for the lock's outcome only.
        tokio::spawn(async move {
            let taken = tokio::task::spawn_blocking(move || {
                crate::resume::take_lock(&lock, cluster_id, &work_dir)
            })
            .await;
            let refusal = match taken {
                Ok(Ok(())) => None,
                Ok(Err(LockError::AlreadyLocked)) => Some(InitError::Locked),
                // A failed record that set PCR 15 anyway: the node is locked
                // for good with nothing served, and starts over from a
                // reboot, as after any failure past the lock.
                Ok(Err(e)) if e.left_locked() => {
                    let log =
                        |line: String| tracing::info!(target: "keel_agent::provision", "{line}");
                    let error = ProvisionError::Lock(keel_atls::ErrorChain(&e).to_string());
                    Provisioner::new(&server.inner.node.env, &server.inner.node.tpm, &log)
                        .fail(&error)
                        .await;
                    Some(InitError::LockBroken(e))
                }
                Ok(Err(e)) => Some(InitError::Lock(e)),
                Err(_) => Some(InitError::Internal),
            };
            if let Some(refusal) = refusal {
                let _ = locked.send(Err(refusal));
                return;
            }
            tracing::info!(cluster_id = %hex::encode(accepted.cluster_id), "node locked for init");
            let _ = locked.send(Ok(()));
            server.provision_after_lock(&accepted, &log).await;
        });
        match lock_taken.await {
            Ok(Ok(())) => {}
            Ok(Err(refusal)) => {
                tracing::warn!(error = %keel_atls::ErrorChain(&refusal), "init refused");
                return Err((&refusal).into());
            }
            Err(_) => return Err((&InitError::Internal).into()),
        }
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}
