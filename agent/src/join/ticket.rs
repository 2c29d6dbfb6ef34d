//! Join and rejoin tickets: what they carry and the checks a node makes of
//! them before it uses anything.
//!
//! A ticket is only as good as the service that issued it: after the sealed
//! secrets are opened, [`check_service`] requires that the service is a
//! control plane locked into exactly the cluster the ticket's secrets
//! derive, and [`parse_join_ticket`] checks every field (key lengths, the token and
//! hash formats, the CA against its discovery hash, the kubelet certificate
//! against this node's key and the CA, the version against the versions
//! table, the control-plane files against the expected set).

use std::str::FromStr as _;
use std::sync::Arc;

use keel_atls::{Attested, ConnectError};
use keel_installer::{Component, KubernetesVersion};
use keel_proto::join::{IssueJoinTicketResponse, IssueRejoinTicketResponse, JoinSecrets};
use keel_verifier::credential::CredentialError;
use keel_verifier::measurements::Measurements;
use keel_verifier::signature::{SignedMeasurements, SigningPublicKey};

use crate::cluster::{ImageState, MAX_SIGNED_MEASUREMENTS};
use crate::registry::{Registry, MAX_REGISTRY_BYTES};
use keel_verifier::validator::Verified;
use subtle::ConstantTimeEq as _;
use zeroize::Zeroizing;

use super::kubelet;
use crate::kubeadm::{BootstrapToken, CaCertHash};
use keel_verifier::ek::EkDigest;
use keel_verifier::keys::{ClusterId, ClusterIdError, KeyService, OperatorKey, DISK_KEY_LEN};

/// Largest accepted ticket message: a control-plane ticket carries the
/// issuing control plane's registry (a document of at most
/// [`MAX_REGISTRY_BYTES`]) beside measurements and PKI files (at most
/// 1 MiB).
pub const MAX_TICKET_BYTES: usize = MAX_REGISTRY_BYTES + 1024 * 1024;
/// The control-plane PKI files a control-plane join receives (relative to
/// the PKI directory), as kubeadm's `--upload-certs` would share them.
/// `ca.crt` and `ca.key` are required, the others are sent when present.
pub const CONTROL_PLANE_FILES: [&str; 8] = [
    "ca.crt",
    "ca.key",
    "sa.key",
    "sa.pub",
    "front-proxy-ca.crt",
    "front-proxy-ca.key",
    "etcd/ca.crt",
    "etcd/ca.key",
];

/// Why getting a ticket from one endpoint failed (before the lock: retried).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TicketError {
    /// The endpoint is not `host:port`.
    #[error("invalid endpoint {0:?}")]
    Endpoint(String),
    /// The aTLS connection failed (includes the service's attestation).
    #[error("connecting to the join service")]
    Connect(#[source] ConnectError),
    /// The connection has no validated attestation of the service.
    #[error("the join service is not attested")]
    ServiceNotAttested,
    /// The service refused the request.
    #[error("the join service refused: {}: {}", .0.code(), .0.message())]
    Refused(tonic::Status),
    /// The ticket carries no sealed secrets.
    #[error("the ticket carries no secrets")]
    NoSecrets,
    /// The secrets were not sealed to this TPM.
    #[error("opening the ticket's secrets")]
    Open(#[source] CredentialError),
    /// The TPM could not be used.
    #[error("the TPM is unavailable")]
    Tpm,
    /// The secrets do not decode.
    #[error("the ticket's secrets do not decode")]
    Decode(#[source] prost::DecodeError),
    /// The cluster ID cannot be derived from the ticket.
    #[error("deriving the cluster ID from the ticket")]
    ClusterId(#[source] ClusterIdError),
    /// The service's attestation does not show a control plane of the
    /// ticket's cluster.
    #[error("the join service's attestation does not match the ticket: {0}")]
    ServiceCluster(&'static str),
    /// A ticket field is invalid.
    #[error("invalid ticket: {0}")]
    Invalid(String),
    /// This node has no route to take the address it would advertise
    /// from: no ticket was asked for, since the node could not use one.
    #[error("this node has no address to advertise; not asking for a ticket until it has a route")]
    NoAddress(#[source] crate::address::NoRoute),
}

impl TicketError {
    /// Whether the attempt ended before either side did any work: the
    /// connection to the service was refused at once (see
    /// [`ConnectError::is_refused_at_once`]), or this node had no route to
    /// advertise an address on (its network is still coming up) and asked
    /// for nothing.
    pub fn is_refused_at_once(&self) -> bool {
        match self {
            Self::Connect(e) => e.is_refused_at_once(),
            Self::NoAddress(_) => true,
            _ => false,
        }
    }
}

/// A ticket as the service sent it, with the service's validated attestation.
pub struct RawTicket<T> {
    /// The response.
    pub response: T,
    /// What the service's attestation established.
    pub service: Arc<Attested<Verified>>,
}

/// What a control-plane ticket says its join services accept.
#[derive(Clone, Debug)]
pub struct TicketMeasurements {
    /// The images the issuing control plane accepts and its rollback
    /// floor (the new control plane's is at least this and its current
    /// set's epoch).
    pub image: ImageState,
    /// Components of other Kubernetes versions the operator authorised.
    pub authorised: Vec<Component>,
    /// The issuing control plane's registry: node records and revocations.
    pub registry: Registry,
    /// The issuing control plane's EK.
    pub issuer: EkDigest,
}

/// A checked join ticket.
pub struct JoinTicket {
    /// The cluster ID derived from the ticket.
    pub cluster_id: ClusterId,
    /// The measurement salt (with the measurement secret, the cluster ID).
    pub measurement_salt: Vec<u8>,
    /// The state-disk key for the requested UUID.
    pub disk_key: Zeroizing<Vec<u8>>,
    /// The kubelet client certificate (PEM) for this node's key.
    pub kubelet_cert: String,
    /// The cluster CA certificate (PEM).
    pub ca_cert: String,
    /// `host:port` of the API server.
    pub api_server_endpoint: String,
    /// The bootstrap token, from a control plane of an earlier version
    /// (one that takes the request's `file_discovery` sends none: the node
    /// then joins with file discovery and its kubelet certificate).
    pub token: Option<BootstrapToken>,
    /// The discovery hash of the CA.
    pub ca_hash: CaCertHash,
    /// Control-plane PKI files (name relative to the PKI dir, contents).
    pub control_plane_files: Vec<(&'static str, Zeroizing<Vec<u8>>)>,
    /// The Kubernetes version the cluster runs, that of `components`.
    pub version: KubernetesVersion,
    /// The components to install.
    pub components: Vec<Component>,
    /// A control-plane ticket: the cluster's keys and the measurements its
    /// join services accept.
    pub control_plane: Option<(KeyService, TicketMeasurements)>,
    /// Join endpoints of the cluster's control planes.
    pub control_plane_endpoints: Vec<String>,
    /// The key this node checks the operator's requests with.
    pub operator_key: OperatorKey,
}

impl std::fmt::Debug for JoinTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinTicket")
            .field("cluster_id", &hex::encode(self.cluster_id))
            .field("api_server_endpoint", &self.api_server_endpoint)
            .field("token", &self.token)
            .field("version", &self.version.to_string())
            .finish_non_exhaustive()
    }
}

/// Opened ticket secrets; wiped when dropped.
pub struct OpenedSecrets(JoinSecrets);

impl OpenedSecrets {
    /// Decodes the opened payload of a ticket into the wrapper, so that
    /// what a decode that fails partway filled in is wiped too.
    pub fn decode(payload: &[u8]) -> Result<Self, TicketError> {
        use prost::Message as _;
        let mut opened = Self(JoinSecrets::default());
        opened.0.merge(payload).map_err(TicketError::Decode)?;
        Ok(opened)
    }
}

impl std::ops::Deref for OpenedSecrets {
    type Target = JoinSecrets;

    fn deref(&self) -> &JoinSecrets {
        &self.0
    }
}

impl Drop for OpenedSecrets {
    fn drop(&mut self) {
        use zeroize::Zeroize as _;
        self.0.state_disk_key.zeroize();
        self.0.measurement_secret.zeroize();
        if let Some(cp) = &mut self.0.control_plane {
            cp.master_secret.zeroize();
            cp.master_salt.zeroize();
        }
        self.0.bootstrap_token.zeroize();
        self.0.kubelet_cert.zeroize();
        self.0.operator_key.zeroize();
        for file in &mut self.0.control_plane_files {
            file.data.zeroize();
        }
    }
}

/// A checked rejoin ticket.
pub struct RejoinTicket {
    /// The cluster ID derived from the ticket.
    pub cluster_id: ClusterId,
    /// The state-disk key.
    pub disk_key: Zeroizing<Vec<u8>>,
    /// A control plane's rejoin ticket: the cluster's keys.
    pub control_plane_keys: Option<KeyService>,
    /// Join endpoints of the cluster's control planes.
    pub control_plane_endpoints: Vec<String>,
    /// The key this node checks the operator's requests with.
    pub operator_key: OperatorKey,
    /// A control plane's rejoin ticket: the issuing control plane's
    /// registry.
    pub registry: Registry,
    /// A control plane's rejoin ticket: the images the issuing control
    /// plane accepts and its rollback floor, taken where newer than the
    /// restored state's ([`crate::cluster::ClusterState::with_newer_image`]).
    pub image: Option<ImageState>,
    /// The issuing control plane's EK.
    pub issuer: EkDigest,
}

impl RejoinTicket {
    /// Checks the opened `secrets` and the other fields of a rejoin ticket
    /// (`response`) for `cluster_id`, asked for by a node in role
    /// `is_control_plane` whose config names `measurements_key`, from
    /// `source`.
    pub fn parse(
        secrets: &JoinSecrets,
        response: IssueRejoinTicketResponse,
        cluster_id: ClusterId,
        is_control_plane: bool,
        measurements_key: Option<&SigningPublicKey>,
        source: TicketSource,
    ) -> Result<Self, TicketError> {
        if secrets.state_disk_key.len() != DISK_KEY_LEN {
            return Err(TicketError::Invalid("disk key length".into()));
        }
        let control_plane_keys = control_plane_keys(secrets, is_control_plane)?;
        let (registry, image) = if is_control_plane {
            // A control plane of an earlier version sends no images.
            let image = match response.join_measurements.as_slice() {
                [] => None,
                join => Some(image_state(
                    join,
                    &response.staged_measurements,
                    &response.signed_measurements,
                    response.image_epoch,
                    measurements_key,
                )?),
            };
            (
                registry_of(&response.registry, response.registry_served_at, &source)?,
                image,
            )
        } else {
            (Registry::default(), None)
        };
        Ok(Self {
            cluster_id,
            disk_key: Zeroizing::new(secrets.state_disk_key.clone()),
            control_plane_keys,
            control_plane_endpoints: check_endpoints(response.control_plane_endpoints)?,
            operator_key: operator_key(secrets)?,
            registry,
            image,
            issuer: source.issuer,
        })
    }
}

/// Where a ticket came from: the issuing control plane's EK, and when this
/// node asked for it (Unix seconds, this clock), which dates the registry
/// it carries ([`Registry::on_this_clock`]).
#[derive(Clone, Copy, Debug)]
pub struct TicketSource {
    /// The issuing control plane's EK.
    pub issuer: EkDigest,
    /// When the ticket was asked for.
    pub asked_at: u64,
}

/// The images a control plane's ticket says its join services accept:
/// the current set (`join`), the staged one (empty: none), the signed
/// files (checked with the node config's `key`) and the rollback `floor`.
fn image_state(
    join: &[u8],
    staged: &[u8],
    signed: &[keel_proto::attestation::SignedMeasurements],
    floor: u64,
    key: Option<&SigningPublicKey>,
) -> Result<ImageState, TicketError> {
    let join = Measurements::parse(join)
        .map_err(|e| TicketError::Invalid(format!("join measurements: {e}")))?;
    let staged = match staged {
        [] => None,
        bytes => Some(
            Measurements::parse(bytes)
                .map_err(|e| TicketError::Invalid(format!("staged measurements: {e}")))?,
        ),
    };
    Ok(ImageState {
        join,
        staged,
        signed: signed_measurements(signed, key)?,
        floor,
    })
}

/// The registry a control plane's ticket carries (none: empty), served at
/// `served_at` on the issuer's clock and moved to this one
/// ([`Registry::on_this_clock`]).
fn registry_of(
    bytes: &[u8],
    served_at: u64,
    source: &TicketSource,
) -> Result<Registry, TicketError> {
    match bytes {
        [] => Ok(Registry::default()),
        bytes => Registry::parse(bytes)
            .map(|registry| {
                let (registry, gap) = registry.on_this_clock(served_at, source.asked_at);
                if let crate::registry::ClockGap::Apart(apart) = gap {
                    tracing::warn!(
                        apart_s = apart,
                        "the issuer's clock and this node's are further apart than the skew \
                         allowed: only the revocations of its registry and the names it holds are taken"
                    );
                }
                registry
            })
            .map_err(|e| TicketError::Invalid(format!("registry: {e}"))),
    }
}

/// The node's operator key from a ticket's secrets.
fn operator_key(secrets: &JoinSecrets) -> Result<OperatorKey, TicketError> {
    OperatorKey::from_slice(&secrets.operator_key)
        .ok_or_else(|| TicketError::Invalid("operator key length".into()))
}

/// Most control-plane endpoints a ticket may name.
pub const MAX_CONTROL_PLANE_ENDPOINTS: usize = 16;

/// `host:port`, at most 261 bytes (a DNS name and a port).
pub fn is_host_port(endpoint: &str) -> bool {
    endpoint.len() <= 261
        && endpoint
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
}

fn check_endpoints(endpoints: Vec<String>) -> Result<Vec<String>, TicketError> {
    if endpoints.len() > MAX_CONTROL_PLANE_ENDPOINTS || !endpoints.iter().all(|e| is_host_port(e)) {
        return Err(TicketError::Invalid(
            "control-plane endpoints are not a short list of host:port".into(),
        ));
    }
    Ok(endpoints)
}

/// The signed measurements files of a control plane's ticket, each checked
/// with the node config's `key`: at most [`MAX_SIGNED_MEASUREMENTS`], and
/// none without a key.
fn signed_measurements(
    files: &[keel_proto::attestation::SignedMeasurements],
    key: Option<&SigningPublicKey>,
) -> Result<Vec<SignedMeasurements>, TicketError> {
    if files.len() > MAX_SIGNED_MEASUREMENTS {
        return Err(TicketError::Invalid(
            "too many signed measurements files".into(),
        ));
    }
    match key {
        Some(key) => files
            .iter()
            .map(|f| {
                SignedMeasurements::verify(key, &f.measurements, &f.signature).map_err(|e| {
                    TicketError::Invalid(format!(
                        "signed measurements that this node's key does not verify: {e}"
                    ))
                })
            })
            .collect(),
        None if files.is_empty() => Ok(Vec::new()),
        None => Err(TicketError::Invalid(
            "signed measurements, but the node config names no measurements signing key".into(),
        )),
    }
}

/// The cluster's keys from a control plane's ticket: present exactly for a
/// control plane, and deriving the ticket's measurement secret.
fn control_plane_keys(
    secrets: &JoinSecrets,
    is_control_plane: bool,
) -> Result<Option<KeyService>, TicketError> {
    let invalid = |m: &str| TicketError::Invalid(m.to_owned());
    let Some(cp) = &secrets.control_plane else {
        return if is_control_plane {
            Err(invalid("a control-plane ticket carries no master secret"))
        } else {
            Ok(None)
        };
    };
    if !is_control_plane {
        return Err(invalid("a worker ticket carries the master secret"));
    }
    let keys = KeyService::new(&cp.master_secret, &cp.master_salt)
        .map_err(|_| invalid("master secret or salt length"))?;
    let derived = keys
        .measurement_secret()
        .map_err(|_| invalid("master secret"))?;
    if !bool::from(derived.as_slice().ct_eq(&secrets.measurement_secret)) {
        return Err(invalid(
            "the master secret does not derive the ticket's measurement secret",
        ));
    }
    Ok(Some(keys))
}

/// The service must be a control plane (its replayed node identity) whose
/// PCR 15 is the extend of exactly `cluster_id`, logged as the one
/// cluster-ID event of its replayed log. A worker of the cluster runs the
/// same image under the same lock: without the role, a compromised one
/// could serve tickets, or a registry, to the nodes the host sends it.
pub fn check_service(service: &Verified, cluster_id: &ClusterId) -> Result<(), TicketError> {
    keel_verifier::validator::check_cluster_lock(service, cluster_id)
        .and_then(|()| keel_verifier::validator::check_control_plane(service))
        .map_err(TicketError::ServiceCluster)
}

/// Checks every field of a join ticket from `source`, with its opened
/// `secrets`, for the kubelet key `kubelet_spki`.
pub fn parse_join_ticket(
    response: IssueJoinTicketResponse,
    secrets: &JoinSecrets,
    cluster_id: ClusterId,
    kubelet_spki: &[u8],
    is_control_plane: bool,
    measurements_key: Option<&SigningPublicKey>,
    source: TicketSource,
) -> Result<JoinTicket, TicketError> {
    let invalid = |m: &str| TicketError::Invalid(m.to_owned());
    if secrets.state_disk_key.len() != DISK_KEY_LEN {
        return Err(invalid("disk key length"));
    }
    let token = match secrets.bootstrap_token.as_str() {
        "" => None,
        token => {
            Some(BootstrapToken::from_str(token).map_err(|_| invalid("bootstrap token format"))?)
        }
    };
    let ca_hash = CaCertHash::from_str(&response.discovery_token_ca_cert_hash)
        .map_err(|_| invalid("discovery CA hash format"))?;
    let ca_cert =
        String::from_utf8(response.cluster_ca_cert).map_err(|_| invalid("CA certificate"))?;
    if CaCertHash::of_ca_pem(ca_cert.as_bytes()).as_ref() != Some(&ca_hash) {
        return Err(invalid("the discovery hash is not the CA certificate's"));
    }
    let kubelet_cert = String::from_utf8(secrets.kubelet_cert.clone())
        .map_err(|_| invalid("kubelet certificate"))?;
    kubelet::check_cert(&kubelet_cert, &ca_cert, kubelet_spki).map_err(invalid)?;
    let endpoint = response.api_server_endpoint;
    if !is_host_port(&endpoint) {
        return Err(invalid("API server endpoint is not host:port"));
    }
    // A ticket that lists its components names the version the cluster
    // runs, which this image's versions table may pin no longer (an image
    // upgrade moved it to another patch of the minor); only a control
    // plane of an earlier release lists none, and then the table's entry
    // for the version supplies them.
    let (version, components) = match response.kubernetes_components {
        Some(list) if !list.components.is_empty() => {
            let version: KubernetesVersion = response
                .kubernetes_version
                .parse()
                .map_err(|e| TicketError::Invalid(format!("Kubernetes version: {e}")))?;
            let components = list
                .components
                .into_iter()
                .map(Component::try_from)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TicketError::Invalid(format!("component: {e}")))?;
            (version, components)
        }
        _ => {
            let entry = keel_installer::resolve(&response.kubernetes_version)
                .map_err(|e| TicketError::Invalid(format!("Kubernetes version: {e}")))?;
            (entry.version(), entry.components().to_vec())
        }
    };
    // Older than any kubeadm configuration this agent writes (v1.30):
    // refused here, before the node locks, as the versions table did.
    crate::kubeadm::ConfigApi::for_version(version)
        .map_err(|e| TicketError::Invalid(format!("Kubernetes version: {e}")))?;
    // The control plane took this list at init or in a plan; the node
    // checks it again before it locks, since installing it would fail
    // after the lock, and a control plane that lies could otherwise have
    // it write files outside the component directories.
    keel_installer::check_list(&components)
        .map_err(|e| TicketError::Invalid(format!("components: {e}")))?;
    crate::upgrade::check_switchable(&components)
        .map_err(|e| TicketError::Invalid(format!("components: {e}")))?;
    let mut files = Vec::new();
    for file in &secrets.control_plane_files {
        let name = CONTROL_PLANE_FILES
            .into_iter()
            .find(|n| *n == file.name)
            .ok_or_else(|| invalid("unexpected control-plane file"))?;
        if files.iter().any(|(n, _)| *n == name) {
            return Err(invalid("repeated control-plane file"));
        }
        files.push((name, Zeroizing::new(file.data.clone())));
    }
    let has = |n: &str| files.iter().any(|(f, _)| *f == n);
    if is_control_plane && !(has("ca.crt") && has("ca.key")) {
        return Err(invalid("a control-plane ticket needs ca.crt and ca.key"));
    }
    if !is_control_plane && !files.is_empty() {
        return Err(invalid("a worker ticket carries control-plane files"));
    }
    let control_plane = match control_plane_keys(secrets, is_control_plane)? {
        Some(keys) => {
            let image = image_state(
                &response.join_measurements,
                &response.staged_measurements,
                &response.signed_measurements,
                response.image_epoch,
                measurements_key,
            )?;
            let authorised = response
                .authorised_components
                .map(|list| list.components)
                .unwrap_or_default();
            if authorised.len() > crate::cluster::MAX_AUTHORISED_COMPONENTS {
                return Err(invalid("too many authorised components"));
            }
            let authorised = authorised
                .into_iter()
                .map(Component::try_from)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TicketError::Invalid(format!("authorised component: {e}")))?;
            let registry = registry_of(&response.registry, response.registry_served_at, &source)?;
            Some((
                keys,
                TicketMeasurements {
                    image,
                    authorised,
                    registry,
                    issuer: source.issuer,
                },
            ))
        }
        None => None,
    };
    Ok(JoinTicket {
        cluster_id,
        measurement_salt: response.measurement_salt,
        disk_key: Zeroizing::new(secrets.state_disk_key.clone()),
        kubelet_cert,
        ca_cert,
        api_server_endpoint: endpoint,
        token,
        ca_hash,
        control_plane_files: files,
        version,
        components,
        control_plane,
        control_plane_endpoints: check_endpoints(response.control_plane_endpoints)?,
        operator_key: operator_key(secrets)?,
    })
}
