//! The join service: admits attested nodes into the cluster this
//! control-plane node created.
//!
//! Served over mutual aTLS after init. The aTLS validator (a
//! [`ReloadableValidator`](crate::attestation::policy::ReloadableValidator)
//! requiring PCR 15 = zero and the cluster's config PCR) has accepted the
//! peer before a handler runs; the handlers read what it established
//! ([`Verified`]) from the request and never serve a peer without it.
//!
//! `IssueJoinTicket` checks the request against the peer's *measured*
//! identity: the node name and role in the request must be the ones in the
//! peer's replayed node-identity event, so a node cannot obtain a kubelet
//! certificate for another node's name or a control-plane ticket with a
//! worker config. The kubelet CSR must carry a valid self-signature and
//! exactly the subject `O=system:nodes, CN=system:node:<name>`; the
//! certificate is built from that subject and the CSR's key only (requested
//! extensions are ignored). A ticket that does not ask for file discovery,
//! from a node of another image than the service's own (whose agent
//! always asks for it), gets its own bootstrap token, registered with the
//! cluster through `kubeadm token create --config`
//! (the token goes in a 0600 file, never in an argument); the tokens of
//! tickets issued at the same time share a run ([`super::tokens`]).
//!
//! Everything that grants access (disk key, measurement secret, bootstrap
//! token, kubelet certificate, control-plane keys) is sealed to the peer's
//! TPM with [`credential::seal`]: a peer whose quote came from a key outside
//! the attested TPM gets nothing it can use. Concurrent tickets are bounded
//! by [`MAX_CONCURRENT_TICKETS`].
//!
//! The one state the service keeps is [`DiskBindings`] (see
//! [`crate::disk_bindings`]): a join ticket binds the state disk's UUID to
//! the joining TPM's endorsement key before any key leaves, and a rejoin
//! ticket goes only to the TPM a disk is bound to.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel_atls::Attested;
use keel_proto::join::join_service_server::{self, JoinServiceServer};
use keel_proto::join::{
    ControlPlaneFile, ControlPlaneSecrets, IssueJoinTicketRequest, IssueJoinTicketResponse,
    IssueRejoinTicketRequest, IssueRejoinTicketResponse, JoinSecrets,
};
use keel_verifier::cluster_settings::is_dns_label;
use keel_verifier::config::{NodeIdentity, Role};
use keel_verifier::credential;
use keel_verifier::signature::SignedMeasurements;
use keel_verifier::validator::Verified;
use prost::Message as _;
use rcgen::{Issuer, KeyPair};
use tokio::sync::Semaphore;
use tracing::Instrument as _;
use zeroize::{Zeroize as _, Zeroizing};

use super::kubelet;
use super::refusal::JoinServiceError;
use super::ticket::{CONTROL_PLANE_FILES, MAX_TICKET_BYTES};
use super::tokens::TokenRegistrar;
use crate::batching::BatchStats;
use crate::cluster::ClusterState;
use crate::disk_bindings::{Bind, DiskBindingRefusal, DiskBindings, DiskBindingsError, EkDigest};
use crate::grpc::HeldUntilSent;
use crate::kubeadm::{BootstrapToken, CaCertHash, Kubeadm};
use crate::paths;
use crate::registry::RegistryStore;
use crate::throttle::PerSource;

/// Largest accepted request message (tonic refuses larger ones).
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// Tickets being issued at once; further requests wait up to [`QUEUE_WAIT`].
/// A ticket spends most of its time waiting for the disk binding write and
/// the kubeadm run it shares with the tickets issued at the same time (one
/// of each at a time, however many tickets wait), so this bounds memory and
/// CPU work, not processes or writes. At 32, a hundred nodes joining at once
/// waited half of their ticket time for a slot.
pub const MAX_CONCURRENT_TICKETS: usize = 128;
/// How long a request waits for a ticket slot before it is refused as busy.
pub const QUEUE_WAIT: Duration = Duration::from_secs(30);
/// How long after its handshake a connection may ask for a ticket: a
/// joining node asks at once, on a connection of its own.
pub const TICKET_WINDOW: Duration = Duration::from_secs(60);
/// Largest control-plane PKI file read.
const MAX_PKI_FILE: u64 = 64 * 1024;

/// Why the join service could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NewJoinServiceError {
    /// The cluster CA could not be read.
    #[error("reading the cluster CA {path}")]
    ReadCa {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The cluster CA certificate or key is unusable.
    #[error("the cluster CA in {dir} is unusable: {reason}")]
    Ca {
        /// The PKI directory.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// The disk binding store exists but cannot be used.
    #[error("the disk binding store is unusable")]
    DiskBindings(#[source] DiskBindingsError),
    /// The control plane's own image lacks one of the PCRs that tell
    /// images apart.
    #[error("this control plane's own image lacks PCR {0}")]
    OwnImage(u32),
}

/// The cluster CA as the join service uses it.
struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    hash: CaCertHash,
}

impl ClusterCa {
    fn load(pki: &Path) -> Result<Self, NewJoinServiceError> {
        // Bounded, and into a buffer wiped when dropped (ca.key).
        let read = |name: &str| {
            let path = pki.join(name);
            crate::files::read_secret(&path, MAX_PKI_FILE)
                .and_then(|mut bytes| {
                    String::from_utf8(std::mem::take(&mut *bytes))
                        .map(Zeroizing::new)
                        .map_err(|e| {
                            zeroize::Zeroize::zeroize(&mut e.into_bytes());
                            std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8")
                        })
                })
                .map_err(|source| NewJoinServiceError::ReadCa { path, source })
        };
        let bad = |reason: String| NewJoinServiceError::Ca {
            dir: pki.to_owned(),
            reason,
        };
        let cert_pem = read("ca.crt")?;
        let key_pem = read("ca.key")?;
        let key = ca_key(&key_pem).map_err(|e| bad(format!("ca.key: {e}")))?;
        let hash = CaCertHash::of_ca_pem(cert_pem.as_bytes())
            .ok_or_else(|| bad("ca.crt does not parse".into()))?;
        let issuer =
            Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| bad(format!("ca.crt: {e}")))?;
        Ok(Self {
            issuer,
            cert_pem: cert_pem.to_string(),
            hash,
        })
    }
}

/// The cluster CA's private key as kubeadm writes it: PKCS#8 (`PRIVATE
/// KEY`), PKCS#1 (`RSA PRIVATE KEY`, kubeadm's default RSA-2048 and its
/// other RSA sizes) or SEC1 (`EC PRIVATE KEY`, `encryptionAlgorithm:
/// ECDSA-P256` or `ECDSA-P384`). The signing library takes PKCS#8 only,
/// so the other two are wrapped in a PKCS#8 envelope naming their
/// algorithm; the key itself is checked by the library as it loads.
fn ca_key(pem: &str) -> Result<KeyPair, String> {
    use p256::pkcs8::der::asn1::{AnyRef, ObjectIdentifier};
    use p256::pkcs8::der::{pem as der_pem, Encode as _};
    use p256::pkcs8::{AlgorithmIdentifierRef, PrivateKeyInfo};

    const RSA_ENCRYPTION: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.113549.1.1.1");
    const EC_PUBLIC_KEY: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.2.1");
    const P256: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.3.1.7");
    const P384: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.3.132.0.34");

    let (label, der) = der_pem::decode_vec(pem.trim().as_bytes())
        .map_err(|_| "not a PEM private key".to_owned())?;
    let der = Zeroizing::new(der);
    let wrapped = |oid: ObjectIdentifier, parameters: AnyRef<'_>, alg| {
        let info = PrivateKeyInfo::new(
            AlgorithmIdentifierRef {
                oid,
                parameters: Some(parameters),
            },
            &der,
        );
        let pkcs8 = Zeroizing::new(info.to_der().map_err(|e| e.to_string())?);
        KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8.as_slice().into(), alg)
            .map_err(|e| e.to_string())
    };
    match label {
        "PRIVATE KEY" => KeyPair::try_from(der.as_slice()).map_err(|e| e.to_string()),
        "RSA PRIVATE KEY" => wrapped(RSA_ENCRYPTION, AnyRef::NULL, &rcgen::PKCS_RSA_SHA256),
        "EC PRIVATE KEY" => wrapped(
            EC_PUBLIC_KEY,
            (&P256).into(),
            &rcgen::PKCS_ECDSA_P256_SHA256,
        )
        .or_else(|p256| {
            wrapped(
                EC_PUBLIC_KEY,
                (&P384).into(),
                &rcgen::PKCS_ECDSA_P384_SHA384,
            )
            .map_err(|p384| format!("neither a P-256 key ({p256}) nor a P-384 key ({p384})"))
        }),
        other => Err(format!("a PEM {other:?}, not a private key")),
    }
}

/// The join service of one cluster.
#[derive(Clone)]
pub struct JoinService {
    inner: Arc<Inner>,
    /// Later states of the cluster (new join measurements), when followed.
    updates: Option<tokio::sync::watch::Receiver<Option<Arc<ClusterState>>>>,
    /// The node registry whose revocation list this service enforces, and
    /// this node's own EK, which the list may name too.
    registry: Option<(Arc<RegistryStore>, EkDigest)>,
    /// How long after its handshake a connection may ask for a ticket.
    ticket_window: Duration,
    /// This control plane's own image (its PCRs 4, 9 and 11), whose nodes
    /// join with file discovery: a bootstrap token goes only to nodes of
    /// another image.
    own_image: BTreeMap<u32, [u8; 32]>,
    /// Where tickets send nodes for the API server, if the config names
    /// one for every control plane; otherwise the cluster's own address.
    api_server_endpoint: Option<String>,
}

struct Inner {
    cluster: Arc<ClusterState>,
    ca: ClusterCa,
    tokens: TokenRegistrar,
    slots: Semaphore,
    disks: Arc<DiskBindings>,
    /// EKs whose ticket with the registry is being built or sent.
    sending_registry: PerSource<EkDigest>,
}

impl JoinService {
    /// A join service for `cluster`; reads the cluster CA from its PKI
    /// directory. Bootstrap tokens are registered with `kubeadm`, whose
    /// token files go to `work_dir`; `disks` are the node's disk bindings
    /// ([`DiskBindings::new`] of its root), and a store that exists but
    /// does not load stops the service here. `own_image` is this control
    /// plane's image, the PCRs 4, 9 and 11 of its TPM
    /// ([`crate::cluster::own_image`]): a node of that image runs this
    /// agent, which asks for kubeadm's file discovery, so a ticket request
    /// of such a node without it, which would get a bootstrap token, is
    /// refused ([`JoinServiceError::TokenDowngrade`]). Nodes of another
    /// image the cluster accepts (an upgrade from a release before file
    /// discovery) still get one.
    pub fn new(
        cluster: Arc<ClusterState>,
        kubeadm: Kubeadm,
        work_dir: PathBuf,
        disks: Arc<DiskBindings>,
        own_image: BTreeMap<u32, [u8; 32]>,
    ) -> Result<Self, NewJoinServiceError> {
        if let Some(&pcr) = crate::cluster::IMAGE_PCRS
            .iter()
            .find(|pcr| !own_image.contains_key(pcr))
        {
            return Err(NewJoinServiceError::OwnImage(pcr));
        }
        let ca = ClusterCa::load(&cluster.pki_dir)?;
        let bound = disks.len().map_err(NewJoinServiceError::DiskBindings)?;
        tracing::info!(path = %disks.path().display(), disks = bound, "disk bindings loaded");
        Ok(Self {
            inner: Arc::new(Inner {
                cluster,
                ca,
                tokens: TokenRegistrar::new(kubeadm, work_dir.join(paths::TOKEN_CONFIG_DIR)),
                slots: Semaphore::new(MAX_CONCURRENT_TICKETS),
                disks,
                sending_registry: PerSource::default(),
            }),
            updates: None,
            registry: None,
            ticket_window: TICKET_WINDOW,
            own_image,
            api_server_endpoint: None,
        })
    }

    /// The same service, sending nodes to `endpoint` for the API server
    /// (the config's `cluster.api_server_endpoint`, which reaches every
    /// control plane) instead of this control plane's own address.
    pub fn with_api_server_endpoint(mut self, endpoint: Option<String>) -> Self {
        self.api_server_endpoint = endpoint;
        self
    }

    /// Refuses a request for a bootstrap token from a node of this control
    /// plane's own image (see [`JoinService::new`]): a token is in
    /// kubeadm's group for joining nodes, whose node client CSRs
    /// kube-controller-manager approves for any node name, and a node of
    /// this image asks for none unless whoever controls it wants that.
    /// A control plane whose own image `cluster` no longer accepts (a
    /// rollout retired it before this node rebooted) cannot tell which
    /// images ask for tokens, and issues none.
    fn refuse_token_downgrade(
        &self,
        cluster: &ClusterState,
        peer: &Verified,
        file_discovery: bool,
    ) -> Result<(), JoinServiceError> {
        if file_discovery {
            return Ok(());
        }
        let own = &self.own_image;
        let same_image = crate::cluster::IMAGE_PCRS
            .iter()
            .all(|pcr| own.get(pcr).is_some_and(|v| peer.pcrs.get(pcr) == Some(v)));
        if same_image {
            return Err(JoinServiceError::TokenDowngrade);
        }
        if !cluster.accepts_image(own) {
            return Err(JoinServiceError::TokensRetired);
        }
        Ok(())
    }

    /// The same service, taking ticket requests only within `window` of
    /// their connection's handshake (default [`TICKET_WINDOW`]).
    pub fn with_ticket_window(mut self, window: Duration) -> Self {
        self.ticket_window = window;
        self
    }

    /// The same service, refusing every ticket to a node the registry's
    /// revocation list names, and registering each node it issues one to;
    /// once the list names `own_ek` (this control plane was revoked, and
    /// learnt it from a peer), it issues no ticket at all.
    pub fn with_registry(mut self, registry: Arc<RegistryStore>, own_ek: EkDigest) -> Self {
        self.registry = Some((registry, own_ek));
        self
    }

    /// Marks `ek`'s ticket with the registry (a control plane's, on a
    /// service with a registry) as being built and sent; the mark goes
    /// with the answer ([`HeldUntilSent`]), so that a peer that does not
    /// read its tickets has one registry copy in memory, not one per
    /// request. Refused while one is out.
    fn mark_registry_sending(
        &self,
        ek: EkDigest,
        control_plane: bool,
    ) -> Result<Option<HeldUntilSent>, JoinServiceError> {
        if !control_plane || self.registry.is_none() {
            return Ok(None);
        }
        self.inner
            .sending_registry
            .claim(ek)
            .map(|sending| Some(HeldUntilSent::new(sending)))
            .ok_or(JoinServiceError::RegistryUnsent)
    }

    /// What a ticket carries of the registry: for a control plane, this
    /// service's whole registry (node records and revocations), which it
    /// holds before it serves: it refuses a revoked node, and a second
    /// TPM under a name another node holds, from its first ticket on, not
    /// from its first registry exchange. Nothing for a worker.
    fn registry_for(&self, control_plane: bool) -> Vec<u8> {
        match &self.registry {
            Some((registry, _)) if control_plane => registry.snapshot().to_json(),
            _ => Vec::new(),
        }
    }

    /// Refuses a revoked peer (its EK is on the list), a name another node
    /// holds, another name or role than its EK holds and, for a join, a
    /// `disk` another node is recorded with, before the ticket costs
    /// anything (a disk before this service binds it); [`Self::register`]
    /// checks all but the disk again under the registry's lock.
    fn check_registry(
        &self,
        ek: &EkDigest,
        identity: &NodeIdentity,
        disk: Option<&str>,
    ) -> Result<(), JoinServiceError> {
        let Some((registry, own_ek)) = self.registry.as_ref() else {
            return Ok(());
        };
        if let Some(revocation) = registry.revocation(own_ek) {
            return Err(JoinServiceError::ServiceRevoked(revocation));
        }
        if let Some(revocation) = registry.revocation(ek) {
            return Err(JoinServiceError::Revoked(revocation));
        }
        registry
            .check_identity(ek, &identity.name, identity.role.as_str())
            .and_then(|()| disk.map_or(Ok(()), |disk| registry.check_disk(ek, disk)))
            .map_err(JoinServiceError::from_identity_check)
    }

    /// Records in the registry that `peer` gets a ticket, with `disk_uuid`
    /// if it is bound to its EK (else empty); refused if it was revoked
    /// meanwhile.
    async fn register(
        &self,
        ek: EkDigest,
        disk_uuid: String,
        identity: NodeIdentity,
    ) -> Result<(), JoinServiceError> {
        let Some((registry, own_ek)) = self.registry.clone() else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || {
            // Under the registry's lock: a peer's merge that revokes this
            // control plane cannot land between the check and the record.
            let own_revocation = registry
                .update(|r| match r.revocation(&own_ek) {
                    Some(revocation) => Ok(Some(revocation.clone())),
                    None => r
                        .register(&ek, &disk_uuid, &identity.name, identity.role.as_str())
                        .map(|()| None),
                })
                .map_err(JoinServiceError::from_identity_check)?;
            match own_revocation {
                Some(revocation) => Err(JoinServiceError::ServiceRevoked(revocation)),
                None => Ok(()),
            }
        })
        .await
        .map_err(|_| JoinServiceError::Registry(crate::registry::RegistryError::Task))?
    }

    /// The same service, issuing tickets from the latest cluster state in
    /// `slot` (the operator may replace the join measurements).
    pub fn following(mut self, slot: &crate::cluster::ClusterSlot) -> Self {
        self.updates = Some(slot.subscribe());
        self
    }

    /// The cluster state tickets are issued from now.
    fn cluster(&self) -> Arc<ClusterState> {
        self.updates
            .as_ref()
            .and_then(|updates| updates.borrow().clone())
            .unwrap_or_else(|| self.inner.cluster.clone())
    }

    /// The disk binding store this service checks and records in.
    pub fn disk_bindings(&self) -> &DiskBindings {
        &self.inner.disks
    }

    /// How many kubeadm runs registered how many bootstrap tokens.
    pub fn token_stats(&self) -> BatchStats {
        self.inner.tokens.stats()
    }

    /// Runs a blocking operation on the disk binding store off the runtime.
    async fn with_disks<T: Send + 'static>(
        &self,
        f: impl FnOnce(&DiskBindings) -> Result<T, DiskBindingsError> + Send + 'static,
    ) -> Result<T, JoinServiceError> {
        let disks = self.inner.disks.clone();
        tokio::task::spawn_blocking(move || f(&disks))
            .await
            .map_err(|_| JoinServiceError::DiskBindings(DiskBindingsError::Task))?
            .map_err(JoinServiceError::DiskBindings)
    }

    /// The tonic service, with requests bounded to [`MAX_REQUEST_BYTES`]
    /// and tickets to what the join client accepts.
    pub fn into_service(self) -> JoinServiceServer<Self> {
        JoinServiceServer::new(self)
            .max_decoding_message_size(MAX_REQUEST_BYTES)
            .max_encoding_message_size(MAX_TICKET_BYTES)
    }

    /// Issues a join ticket to the validated peer `peer`.
    pub async fn join_ticket(
        &self,
        peer: &Attested<Verified>,
        request: IssueJoinTicketRequest,
    ) -> Result<IssueJoinTicketResponse, JoinServiceError> {
        Ok(self.join_ticket_marked(peer, request).await?.0)
    }

    /// [`Self::join_ticket`], with the mark a control plane's ticket
    /// holds until it is sent ([`Self::mark_registry_sending`]).
    async fn join_ticket_marked(
        &self,
        peer: &Attested<Verified>,
        request: IssueJoinTicketRequest,
    ) -> Result<(IssueJoinTicketResponse, Option<HeldUntilSent>), JoinServiceError> {
        let Admitted {
            _slot,
            peer,
            cluster,
        } = self.admit(peer).await?;
        let cluster = &cluster;
        let identity = check_identity(peer, &request.node_name, request.is_control_plane)?;
        let ek = EkDigest::of_public(&peer.ek);
        self.check_registry(&ek, &identity, Some(&request.disk_uuid))?;
        let sending = self.mark_registry_sending(ek, request.is_control_plane)?;
        self.refuse_token_downgrade(cluster, peer, request.file_discovery)?;
        let disk_key = cluster
            .keys
            .disk_key(&request.disk_uuid, &ek)
            .map_err(JoinServiceError::DiskUuid)?;
        let kubelet_cert = tracing::debug_span!("join.kubelet_cert").in_scope(|| {
            kubelet::sign_csr(
                &self.inner.ca.issuer,
                &request.kubelet_csr,
                &request.node_name,
            )
        })?;
        let control_plane_files = if request.is_control_plane {
            self.control_plane_files().await?
        } else {
            PkiFiles::default()
        };
        // Recorded before any key or token leaves; a retry by the same TPM
        // finds its own binding.
        let uuid = request.disk_uuid.clone();
        match self.with_disks(move |d| d.bind(&uuid, &ek)).await? {
            Bind::Recorded | Bind::AlreadyBound => {}
            Bind::OtherEk(bound) => {
                return Err(JoinServiceError::DiskNotBound(
                    DiskBindingRefusal::OtherEk {
                        uuid: request.disk_uuid.to_ascii_lowercase(),
                        bound,
                        peer: ek,
                    },
                ))
            }
        }
        // A node that joins with kubeadm's file discovery (its kubeconfig
        // holds the kubelet certificate above) gets no token: a token is in
        // kubeadm's group for joining nodes, whose node client CSRs are
        // approved for any node name.
        let token = if request.file_discovery {
            None
        } else {
            let token = BootstrapToken::generate();
            self.inner
                .tokens
                .register(&token, cluster.kubernetes_version)
                .await
                .map_err(JoinServiceError::Token)?;
            Some(token)
        };
        // The image may have been withdrawn while the token was registered
        // (a kubeadm run, maybe behind another): judged again on the state
        // of the moment, which the ticket is then built from.
        let current = self.still_accepted(peer)?;
        let cluster = &current;
        if token.is_some() && !cluster.accepts_image(&self.own_image) {
            // Retired while the token was registered (see
            // `refuse_token_downgrade`); the token is never sent.
            return Err(JoinServiceError::TokensRetired);
        }
        // Last before sealing: a revocation that landed while the token was
        // registered refuses the ticket here, under the registry's lock. A
        // token registered for a refused ticket is never sent and expires.
        self.register(ek, request.disk_uuid.clone(), identity)
            .await?;
        // Whatever can fail comes before the secrets are copied out of
        // their wiped buffers: from here to `seal`, which wipes the
        // copies, nothing returns early.
        let operator_key = operator_key(cluster, &ek)?;
        let secrets = JoinSecrets {
            state_disk_key: disk_key.to_vec(),
            measurement_secret: cluster.measurement_secret.to_vec(),
            bootstrap_token: token
                .as_ref()
                .map(|t| t.expose().to_owned())
                .unwrap_or_default(),
            kubelet_cert: kubelet_cert.into_bytes(),
            control_plane_files: control_plane_files.take(),
            control_plane: request
                .is_control_plane
                .then(|| control_plane_secrets(cluster)),
            operator_key: operator_key.to_vec(),
        };
        let sealed = seal(peer, secrets)?;
        tracing::info!(
            node = %request.node_name.escape_debug(),
            control_plane = request.is_control_plane,
            token_id = token.as_ref().map_or("none (file discovery)", BootstrapToken::id),
            measurements = %hex::encode(peer.measurements),
            "issued join ticket"
        );
        let image = TicketImage::of(cluster, request.is_control_plane);
        let ticket = IssueJoinTicketResponse {
            secrets: Some(sealed),
            measurement_salt: cluster.measurement_salt.clone(),
            api_server_endpoint: self
                .api_server_endpoint
                .clone()
                .unwrap_or_else(|| cluster.api_server.to_string()),
            discovery_token_ca_cert_hash: self.inner.ca.hash.as_str().to_owned(),
            kubernetes_version: cluster.kubernetes_version.to_string(),
            kubernetes_components: Some(keel_proto::components::Components {
                components: cluster.components.iter().map(Into::into).collect(),
            }),
            cluster_ca_cert: self.inner.ca.cert_pem.clone().into_bytes(),
            join_measurements: image.join,
            control_plane_endpoints: ticket_endpoints(cluster),
            staged_measurements: image.staged,
            signed_measurements: image.signed,
            authorised_components: request.is_control_plane.then(|| {
                keel_proto::components::Components {
                    components: cluster
                        .authorised_components
                        .iter()
                        .map(Into::into)
                        .collect(),
                }
            }),
            registry: self.registry_for(request.is_control_plane),
            image_epoch: image.floor,
            registry_served_at: crate::registry::now(),
        };
        Ok((ticket, sending))
    }

    /// Issues a rejoin ticket (disk key and measurement secret, and for a
    /// control plane the master secret) to the validated peer `peer`, whose
    /// state disk is already initialised. The disk key is bound to the
    /// peer's EK, so any control plane can issue it, including one that
    /// never saw the disk join; a disk this service saw join with another
    /// TPM is refused outright.
    pub async fn rejoin_ticket(
        &self,
        peer: &Attested<Verified>,
        request: IssueRejoinTicketRequest,
    ) -> Result<IssueRejoinTicketResponse, JoinServiceError> {
        Ok(self.rejoin_ticket_marked(peer, request).await?.0)
    }

    /// [`Self::rejoin_ticket`], with the mark a control plane's ticket
    /// holds until it is sent ([`Self::mark_registry_sending`]).
    async fn rejoin_ticket_marked(
        &self,
        peer: &Attested<Verified>,
        request: IssueRejoinTicketRequest,
    ) -> Result<(IssueRejoinTicketResponse, Option<HeldUntilSent>), JoinServiceError> {
        let Admitted {
            _slot,
            peer,
            cluster,
        } = self.admit(peer).await?;
        let cluster = &cluster;
        let identity = measured_identity(peer)?;
        let is_control_plane = identity.role == Role::ControlPlane;
        let ek = EkDigest::of_public(&peer.ek);
        self.check_registry(&ek, &identity, None)?;
        let sending = self.mark_registry_sending(ek, is_control_plane)?;
        let disk_key = cluster
            .keys
            .disk_key(&request.disk_uuid, &ek)
            .map_err(JoinServiceError::DiskUuid)?;
        let uuid = request.disk_uuid.clone();
        // The registry records the disk only where this service's
        // bindings bind it to the peer: elsewhere it is the peer's claim.
        let recorded = match self.with_disks(move |d| d.lookup(&uuid)).await? {
            Some(bound) if !bound.ct_eq(&ek) => {
                return Err(JoinServiceError::DiskNotBound(
                    DiskBindingRefusal::OtherEk {
                        uuid: request.disk_uuid.to_ascii_lowercase(),
                        bound,
                        peer: ek,
                    },
                ))
            }
            Some(_) => request.disk_uuid.clone(),
            None => {
                tracing::info!(
                    disk = %request.disk_uuid.escape_debug(),
                    peer_ek = %ek,
                    "disk not seen here; its key is bound to the peer's EK"
                );
                String::new()
            }
        };
        let current = self.still_accepted(peer)?;
        let cluster = &current;
        self.register(ek, recorded, identity.clone()).await?;
        // As for a join ticket: nothing fails between the copies and `seal`.
        let operator_key = operator_key(cluster, &ek)?;
        let secrets = JoinSecrets {
            state_disk_key: disk_key.to_vec(),
            measurement_secret: cluster.measurement_secret.to_vec(),
            control_plane: is_control_plane.then(|| control_plane_secrets(cluster)),
            operator_key: operator_key.to_vec(),
            ..JoinSecrets::default()
        };
        let sealed = seal(peer, secrets)?;
        tracing::info!(
            node = %identity.name.escape_debug(),
            control_plane = is_control_plane,
            disk = %request.disk_uuid.escape_debug(),
            measurements = %hex::encode(peer.measurements),
            "issued rejoin ticket"
        );
        let image = TicketImage::of(cluster, is_control_plane);
        let ticket = IssueRejoinTicketResponse {
            secrets: Some(sealed),
            measurement_salt: cluster.measurement_salt.clone(),
            control_plane_endpoints: ticket_endpoints(cluster),
            registry: self.registry_for(is_control_plane),
            join_measurements: image.join,
            staged_measurements: image.staged,
            signed_measurements: image.signed,
            image_epoch: image.floor,
            registry_served_at: crate::registry::now(),
        };
        Ok((ticket, sending))
    }

    /// What every ticket takes before its own checks: one of the ticket
    /// slots, then a peer judged within the ticket window (the handshake
    /// is where the policy of the moment, measurements and CPU evidence
    /// with its collateral, judged it; a connection held open is not
    /// judged again), outside any cluster, whose matched set the cluster
    /// still accepts.
    async fn admit<'s, 'p>(
        &'s self,
        peer: &'p Attested<Verified>,
    ) -> Result<Admitted<'s, 'p>, JoinServiceError> {
        let slot = self.slot().await?;
        let age = peer.age();
        if age > self.ticket_window {
            return Err(JoinServiceError::StaleHandshake(age.as_secs()));
        }
        let peer = peer.claims();
        require_outside_cluster(peer)?;
        let cluster = self.still_accepted(peer)?;
        Ok(Admitted {
            _slot: slot,
            peer,
            cluster,
        })
    }

    /// The cluster state of the moment, if it accepts the peer's image:
    /// judged when a ticket is admitted, and again before it is recorded.
    fn still_accepted(&self, peer: &Verified) -> Result<Arc<ClusterState>, JoinServiceError> {
        let cluster = self.cluster();
        require_accepted_image(&cluster, peer)?;
        Ok(cluster)
    }

    async fn slot(&self) -> Result<tokio::sync::SemaphorePermit<'_>, JoinServiceError> {
        tokio::time::timeout(QUEUE_WAIT, self.inner.slots.acquire())
            .instrument(tracing::debug_span!("join.slot"))
            .await
            .map_err(|_| JoinServiceError::Busy)?
            .map_err(|_| JoinServiceError::Busy)
    }

    async fn control_plane_files(&self) -> Result<PkiFiles, JoinServiceError> {
        let pki = &self.inner.cluster.pki_dir;
        let mut files = PkiFiles::default();
        for name in CONTROL_PLANE_FILES {
            let path = pki.join(name);
            let required = matches!(name, "ca.crt" | "ca.key");
            match crate::files::read_secret_async(&path, MAX_PKI_FILE).await {
                Ok(data) => files.0.push(ControlPlaneFile {
                    name: name.to_owned(),
                    data: data.to_vec(),
                }),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {}
                Err(source) => return Err(JoinServiceError::ControlPlaneFile { name, source }),
            }
        }
        Ok(files)
    }
}

/// The control-plane PKI files read for a ticket (the cluster's CA keys
/// among them): wiped when dropped, as when the ticket is refused after
/// they were read; [`PkiFiles::take`] hands them to the ticket, which
/// [`seal`] wipes.
#[derive(Default)]
struct PkiFiles(Vec<ControlPlaneFile>);

impl PkiFiles {
    fn take(mut self) -> Vec<ControlPlaneFile> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for PkiFiles {
    fn drop(&mut self) {
        for file in &mut self.0 {
            file.data.zeroize();
        }
    }
}

/// A ticket request admitted ([`JoinService::admit`]): its slot, held
/// until the ticket is issued, the peer's claims and the cluster state to
/// issue from.
struct Admitted<'s, 'p> {
    _slot: tokio::sync::SemaphorePermit<'s>,
    peer: &'p Verified,
    cluster: Arc<ClusterState>,
}

/// The join port also admits members (their evidence): a ticket goes only to
/// a node whose PCR 15 is still zero.
fn require_outside_cluster(peer: &Verified) -> Result<(), JoinServiceError> {
    match peer.pcrs.get(&keel_verifier::measurement::pcr::CLUSTER_ID) {
        Some(value) if *value == [0; 32] => Ok(()),
        _ => Err(JoinServiceError::Member),
    }
}

/// The handshake judged the peer by the measurements accepted then; a
/// connection can outlive them (the operator withdraws an image while it
/// is open). A ticket goes only to a peer whose matched set is still one
/// the cluster accepts: its current join measurements or the staged ones.
fn require_accepted_image(cluster: &ClusterState, peer: &Verified) -> Result<(), JoinServiceError> {
    let accepted = std::iter::once(&cluster.join_measurements)
        .chain(cluster.staged_measurements.as_ref())
        .any(|set| set.digest() == peer.measurements);
    if accepted {
        Ok(())
    } else {
        Err(JoinServiceError::Withdrawn(hex::encode(peer.measurements)))
    }
}

/// The image fields of a control plane's ticket: the images `cluster`
/// accepts, serialised, and its rollback floor; empty in a worker's.
#[derive(Default)]
struct TicketImage {
    join: Vec<u8>,
    staged: Vec<u8>,
    signed: Vec<keel_proto::attestation::SignedMeasurements>,
    floor: u64,
}

impl TicketImage {
    fn of(cluster: &ClusterState, is_control_plane: bool) -> Self {
        if !is_control_plane {
            return Self::default();
        }
        Self {
            join: cluster.join_measurements.to_json().into_bytes(),
            staged: cluster
                .staged_measurements
                .as_ref()
                .map(|staged| staged.to_json().into_bytes())
                .unwrap_or_default(),
            signed: cluster
                .signed_measurements
                .iter()
                .map(SignedMeasurements::to_proto)
                .collect(),
            floor: cluster.image_epoch,
        }
    }
}

/// The control-plane endpoints a ticket names: the cluster state's, at
/// most as many as a joining node takes
/// ([`MAX_CONTROL_PLANE_ENDPOINTS`](super::ticket::MAX_CONTROL_PLANE_ENDPOINTS)).
fn ticket_endpoints(cluster: &ClusterState) -> Vec<String> {
    cluster
        .control_plane_endpoints
        .iter()
        .take(super::ticket::MAX_CONTROL_PLANE_ENDPOINTS)
        .cloned()
        .collect()
}

/// The request's node name and role must be those the peer measured:
/// returns that identity.
fn check_identity(
    peer: &Verified,
    node_name: &str,
    is_control_plane: bool,
) -> Result<NodeIdentity, JoinServiceError> {
    if !is_dns_label(node_name) {
        return Err(JoinServiceError::InvalidRequest(
            "node name must be 1-63 characters of a-z, 0-9 and '-' that begin and end with a \
             letter or digit",
        ));
    }
    let identity = measured_identity(peer)?;
    if identity.name != node_name {
        return Err(JoinServiceError::Identity(
            "node name differs from the measured one",
        ));
    }
    if (identity.role == Role::ControlPlane) != is_control_plane {
        return Err(JoinServiceError::Identity(
            "role differs from the measured one",
        ));
    }
    Ok(identity)
}

/// The node name and role in the peer's replayed node-identity event. A
/// name Kubernetes refuses gets no ticket: its node would fail after its
/// lock, and its EK would keep that name in the registry.
pub(crate) fn measured_identity(peer: &Verified) -> Result<NodeIdentity, JoinServiceError> {
    let identity = peer.identity().ok_or(JoinServiceError::Identity(
        "no node identity that parses in the event log",
    ))?;
    if !is_dns_label(&identity.name) {
        return Err(JoinServiceError::Identity(
            "the measured node name is not a DNS label",
        ));
    }
    Ok(identity)
}

/// The operator key of the node whose EK is `ek`, for its ticket.
fn operator_key(
    cluster: &ClusterState,
    ek: &EkDigest,
) -> Result<Zeroizing<Vec<u8>>, JoinServiceError> {
    let key = cluster
        .keys
        .operator_key(ek)
        .map_err(|_| JoinServiceError::Derive)?;
    Ok(Zeroizing::new(key.expose().to_vec()))
}

/// The master secret and salt, for a control plane's ticket.
fn control_plane_secrets(cluster: &ClusterState) -> ControlPlaneSecrets {
    let (master_secret, master_salt) = cluster.keys.expose_master();
    ControlPlaneSecrets {
        master_secret: master_secret.to_vec(),
        master_salt: master_salt.to_vec(),
    }
}

fn seal(
    peer: &Verified,
    mut secrets: JoinSecrets,
) -> Result<keel_proto::attestation::SealedSecret, JoinServiceError> {
    let _span = tracing::debug_span!("join.seal").entered();
    let payload = Zeroizing::new(secrets.encode_to_vec());
    secrets.state_disk_key.zeroize();
    secrets.measurement_secret.zeroize();
    secrets.bootstrap_token.zeroize();
    secrets.operator_key.zeroize();
    for file in &mut secrets.control_plane_files {
        file.data.zeroize();
    }
    if let Some(cp) = &mut secrets.control_plane {
        cp.master_secret.zeroize();
        cp.master_salt.zeroize();
    }
    credential::seal(&peer.ek, &peer.ak.name, &payload).map_err(JoinServiceError::Seal)
}

/// The validated claims of the peer of `request`.
fn peer_claims<T>(
    request: &tonic::Request<T>,
) -> Result<Arc<Attested<Verified>>, JoinServiceError> {
    crate::grpc::attested_peer(request).ok_or(JoinServiceError::NotAttested)
}

/// Logs a refusal with its causes and makes the peer's status.
fn refused(what: &str, e: &JoinServiceError) -> tonic::Status {
    tracing::warn!(error = %keel_atls::ErrorChain(e), "{what} ticket refused");
    e.into()
}

#[tonic::async_trait]
impl join_service_server::JoinService for JoinService {
    async fn issue_join_ticket(
        &self,
        request: tonic::Request<IssueJoinTicketRequest>,
    ) -> Result<tonic::Response<IssueJoinTicketResponse>, tonic::Status> {
        let result = match peer_claims(&request) {
            Ok(peer) => {
                self.join_ticket_marked(&peer, request.into_inner())
                    .instrument(tracing::debug_span!("join.ticket"))
                    .await
            }
            Err(e) => Err(e),
        };
        result.map(answer).map_err(|e| refused("join", &e))
    }

    async fn issue_rejoin_ticket(
        &self,
        request: tonic::Request<IssueRejoinTicketRequest>,
    ) -> Result<tonic::Response<IssueRejoinTicketResponse>, tonic::Status> {
        let result = match peer_claims(&request) {
            Ok(peer) => self.rejoin_ticket_marked(&peer, request.into_inner()).await,
            Err(e) => Err(e),
        };
        result.map(answer).map_err(|e| refused("rejoin", &e))
    }
}

/// A ticket's answer, with the mark it holds until it is sent.
fn answer<T>((ticket, sending): (T, Option<HeldUntilSent>)) -> tonic::Response<T> {
    let mut answer = tonic::Response::new(ticket);
    if let Some(sending) = sending {
        answer.extensions_mut().insert(sending);
    }
    answer
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Runs the openssl command line in `dir`; its standard output.
    fn openssl(dir: &Path, args: &[&str]) -> Vec<u8> {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// kubeadm's own CA: an RSA-2048 key in PKCS#1 (`RSA PRIVATE KEY`) and
    /// a self-signed SHA256-with-RSA certificate, as `kubeadm init` writes
    /// them without an `encryptionAlgorithm`.
    #[test]
    fn a_kubeadm_rsa_ca_signs_kubelet_certificates() {
        let dir = tempfile::tempdir().unwrap();
        let openssl = |args: &[&str]| openssl(dir.path(), args);
        openssl(&["genrsa", "-traditional", "-out", "ca.key", "2048"]);
        openssl(&[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca.key",
            "-subj",
            "/CN=kubernetes",
            "-days",
            "3650",
            "-sha256",
            "-out",
            "ca.crt",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign",
        ]);
        let key = std::fs::read_to_string(dir.path().join("ca.key")).unwrap();
        assert!(key.starts_with("-----BEGIN RSA PRIVATE KEY-----"), "{key}");
        let ca =
            ClusterCa::load(dir.path()).unwrap_or_else(|e| panic!("{}", keel_atls::ErrorChain(&e)));
        let node = kubelet::KubeletKey::generate("n-1").unwrap();
        let cert = kubelet::sign_csr(&ca.issuer, node.csr_pem().as_bytes(), "n-1").unwrap();
        kubelet::check_cert(&cert, &ca.cert_pem, &node.spki()).unwrap();
        // What openssl itself says of the chain.
        std::fs::write(dir.path().join("kubelet.crt"), &cert).unwrap();
        openssl(&["verify", "-CAfile", "ca.crt", "kubelet.crt"]);
    }

    /// The same with kubeadm's ECDSA CAs (`encryptionAlgorithm:
    /// ECDSA-P256` / `ECDSA-P384`, SEC1 `EC PRIVATE KEY`) and a PKCS#8 key;
    /// anything else is refused by name.
    #[test]
    fn ecdsa_and_pkcs8_ca_keys_load_and_other_pem_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let openssl = |args: &[&str]| openssl(dir.path(), args);
        for (curve, label) in [
            ("prime256v1", "-----BEGIN EC PRIVATE KEY-----"),
            ("secp384r1", "-----BEGIN EC PRIVATE KEY-----"),
        ] {
            let sec1 = openssl(&["ecparam", "-name", curve, "-genkey", "-noout"]);
            let pem = String::from_utf8(sec1).unwrap();
            assert!(pem.starts_with(label), "{pem}");
            ca_key(&pem).unwrap_or_else(|e| panic!("{curve}: {e}"));
        }
        let pkcs8 = openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ]);
        ca_key(std::str::from_utf8(&pkcs8).unwrap()).unwrap();
        let rsa = openssl(&["genrsa", "2048"]);
        ca_key(std::str::from_utf8(&rsa).unwrap()).unwrap();

        let cert = KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["x".into()])
            .unwrap()
            .self_signed(&cert)
            .unwrap()
            .pem();
        let err = ca_key(&cert).unwrap_err();
        assert!(err.contains("CERTIFICATE"), "{err}");
        assert!(ca_key("junk").is_err());
        // A label that lies about its contents.
        let lying = std::str::from_utf8(&rsa)
            .unwrap()
            .replace("PRIVATE KEY", "EC PRIVATE KEY");
        assert!(ca_key(&lying).is_err());
    }
}
