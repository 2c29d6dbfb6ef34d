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
//! extensions are ignored). Each ticket gets its own bootstrap token,
//! registered with the cluster through `kubeadm token create --config`
//! (the token goes in a 0600 file, never in an argument).
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

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use keel_proto::join::join_service_server::{self, JoinServiceServer};
use keel_proto::join::{
    ControlPlaneFile, IssueJoinTicketRequest, IssueJoinTicketResponse, IssueRejoinTicketRequest,
    IssueRejoinTicketResponse, JoinSecrets,
};
use keel_verifier::config::{NodeIdentity, Role};
use keel_verifier::credential::{self, CredentialError};
use keel_verifier::measurement::EventType;
use keel_verifier::validator::Verified;
use prost::Message as _;
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair,
    KeyUsagePurpose, SerialNumber,
};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncReadExt as _;
use tokio::sync::Semaphore;
use x509_parser::prelude::{FromDer as _, X509Certificate, X509CertificationRequest};
use zeroize::{Zeroize as _, Zeroizing};

use crate::cluster::ClusterState;
use crate::disk_bindings::{Bind, DiskBindingRefusal, DiskBindings, DiskBindingsError, EkDigest};
use crate::key_service::DiskKeyError;
use crate::kubeadm::{self, BootstrapToken, CaCertHash, ConfigApi, Kubeadm};

/// Largest accepted request message (tonic refuses larger ones).
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// Largest accepted kubelet CSR (PEM).
pub const MAX_CSR_BYTES: usize = 16 * 1024;
/// Tickets being issued at once; further requests wait up to [`QUEUE_WAIT`].
pub const MAX_CONCURRENT_TICKETS: usize = 32;
/// How long a request waits for a ticket slot before it is refused as busy.
pub const QUEUE_WAIT: Duration = Duration::from_secs(30);
/// Lifetime of a ticket's bootstrap token.
pub const TOKEN_TTL: &str = "1h0m0s";
/// Lifetime of a kubelet certificate.
pub const KUBELET_CERT_DAYS: i64 = 365;
/// Limit for one `kubeadm token create`.
const TOKEN_CREATE_TIMEOUT: Duration = Duration::from_secs(60);
/// Most stderr of `kubeadm token create` kept for an error.
const MAX_STDERR: usize = 2048;
/// Largest control-plane PKI file read.
const MAX_PKI_FILE: u64 = 64 * 1024;
/// The kubeadm group of bootstrap tokens for joining nodes.
const TOKEN_GROUP: &str = "system:bootstrappers:kubeadm:default-node-token";
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
}

/// Why a kubelet CSR was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CsrError {
    /// Larger than [`MAX_CSR_BYTES`].
    #[error("the kubelet CSR is larger than {MAX_CSR_BYTES} bytes")]
    TooLarge,
    /// Not a PEM `CERTIFICATE REQUEST`.
    #[error("the kubelet CSR is not a PEM certificate request")]
    Pem,
    /// The DER does not parse (or has trailing bytes).
    #[error("the kubelet CSR does not parse")]
    Parse,
    /// The self-signature does not verify.
    #[error("the kubelet CSR's signature does not verify")]
    Signature,
    /// The subject is not exactly `O=system:nodes, CN=system:node:<name>`.
    #[error("the kubelet CSR's subject must be exactly O=system:nodes, CN=system:node:{0}")]
    Subject(String),
    /// The CSR's key type is not supported for signing.
    #[error("the kubelet CSR's key type is not supported")]
    KeyType,
}

/// Why a ticket was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JoinServiceError {
    /// The connection carries no validated attestation.
    #[error("the peer is not attested")]
    NotAttested,
    /// A request field is invalid.
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// The disk UUID is malformed.
    #[error("invalid disk UUID")]
    DiskUuid(#[source] DiskKeyError),
    /// The request does not match the peer's measured identity.
    #[error("the request does not match the node's measured identity: {0}")]
    Identity(&'static str),
    /// The kubelet CSR was refused.
    #[error(transparent)]
    Csr(#[from] CsrError),
    /// Signing the kubelet certificate failed.
    #[error("signing the kubelet certificate failed")]
    Sign(#[source] rcgen::Error),
    /// Too many tickets are being issued.
    #[error("the join service is busy; retry later")]
    Busy,
    /// Registering the bootstrap token with the cluster failed.
    #[error("registering the bootstrap token failed: {0}")]
    Token(String),
    /// Reading a control-plane file failed.
    #[error("reading control-plane file {name}")]
    ControlPlaneFile {
        /// The file, relative to the PKI directory.
        name: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The secrets could not be sealed to the peer's TPM.
    #[error("sealing the ticket to the node's TPM failed")]
    Seal(#[source] CredentialError),
    /// Deriving a key failed.
    #[error("deriving a key failed")]
    Derive,
    /// The disk is bound to another TPM, or (rejoin) was never bound. The
    /// peer gets this fixed message; the cause, logged locally, says which.
    #[error("the state disk is not bound to this node's TPM")]
    DiskNotBound(#[source] DiskBindingRefusal),
    /// The disk binding store failed: nothing was issued.
    #[error("the disk binding store is unavailable")]
    DiskBindings(#[source] DiskBindingsError),
}

impl From<&JoinServiceError> for tonic::Status {
    /// The one map from ticket refusals to gRPC codes; the peer gets the
    /// short message, the service's log has the full chain.
    fn from(e: &JoinServiceError) -> Self {
        use JoinServiceError as E;
        let code = match e {
            E::NotAttested => tonic::Code::Unauthenticated,
            E::InvalidRequest(_) | E::DiskUuid(_) | E::Csr(_) => tonic::Code::InvalidArgument,
            E::Identity(_) | E::DiskNotBound(_) => tonic::Code::PermissionDenied,
            E::Seal(CredentialError::UnsupportedEk) => tonic::Code::FailedPrecondition,
            E::Busy | E::Token(_) => tonic::Code::Unavailable,
            E::Sign(_)
            | E::ControlPlaneFile { .. }
            | E::Seal(_)
            | E::Derive
            | E::DiskBindings(_) => tonic::Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}

/// The cluster CA as the join service uses it.
struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    hash: CaCertHash,
}

impl ClusterCa {
    fn load(pki: &Path) -> Result<Self, NewJoinServiceError> {
        let read = |name: &str| {
            let path = pki.join(name);
            std::fs::read_to_string(&path)
                .map(Zeroizing::new)
                .map_err(|source| NewJoinServiceError::ReadCa { path, source })
        };
        let bad = |reason: String| NewJoinServiceError::Ca {
            dir: pki.to_owned(),
            reason,
        };
        let cert_pem = read("ca.crt")?;
        let key_pem = read("ca.key")?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| bad(format!("ca.key: {e}")))?;
        let hash =
            spki_hash(cert_pem.as_bytes()).ok_or_else(|| bad("ca.crt does not parse".into()))?;
        let issuer =
            Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| bad(format!("ca.crt: {e}")))?;
        Ok(Self {
            issuer,
            cert_pem: cert_pem.to_string(),
            hash,
        })
    }
}

/// `sha256:<hex>` of the SubjectPublicKeyInfo of the first certificate in
/// `pem`: kubeadm's discovery hash of a CA.
pub fn spki_hash(pem: &[u8]) -> Option<CaCertHash> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem).ok()?;
    let (_, cert) = X509Certificate::from_der(&pem.contents).ok()?;
    let digest = Sha256::digest(cert.tbs_certificate.subject_pki.raw);
    format!("sha256:{}", hex::encode(digest)).parse().ok()
}

/// The join service of one cluster.
#[derive(Clone)]
pub struct JoinService {
    inner: Arc<Inner>,
}

struct Inner {
    cluster: Arc<ClusterState>,
    ca: ClusterCa,
    kubeadm: Kubeadm,
    work_dir: PathBuf,
    slots: Semaphore,
    disks: Arc<DiskBindings>,
}

impl JoinService {
    /// A join service for `cluster`; reads the cluster CA from its PKI
    /// directory. Bootstrap tokens are registered with `kubeadm`, whose
    /// token files go to `work_dir`; the disk bindings are kept there too
    /// ([`DISK_BINDINGS_FILE`]), and a store that exists but does not
    /// load stops the service here.
    pub fn new(
        cluster: Arc<ClusterState>,
        kubeadm: Kubeadm,
        work_dir: PathBuf,
    ) -> Result<Self, NewJoinServiceError> {
        let ca = ClusterCa::load(&cluster.pki_dir)?;
        let disks = DiskBindings::new(&work_dir);
        let bound = disks.len().map_err(NewJoinServiceError::DiskBindings)?;
        tracing::info!(path = %disks.path().display(), disks = bound, "disk bindings loaded");
        Ok(Self {
            inner: Arc::new(Inner {
                cluster,
                ca,
                kubeadm,
                work_dir,
                slots: Semaphore::new(MAX_CONCURRENT_TICKETS),
                disks: Arc::new(disks),
            }),
        })
    }

    /// The disk binding store this service checks and records in.
    pub fn disk_bindings(&self) -> &DiskBindings {
        &self.inner.disks
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

    /// The tonic service, with requests bounded to [`MAX_REQUEST_BYTES`].
    pub fn into_service(self) -> JoinServiceServer<Self> {
        JoinServiceServer::new(self).max_decoding_message_size(MAX_REQUEST_BYTES)
    }

    /// Issues a join ticket to the validated peer `peer`.
    pub async fn join_ticket(
        &self,
        peer: &Verified,
        request: IssueJoinTicketRequest,
    ) -> Result<IssueJoinTicketResponse, JoinServiceError> {
        let _slot = self.slot().await?;
        let cluster = &self.inner.cluster;
        check_identity(peer, &request.node_name, request.is_control_plane)?;
        let disk_key = cluster
            .keys
            .disk_key(&request.disk_uuid)
            .map_err(JoinServiceError::DiskUuid)?;
        let kubelet_cert = self.sign_kubelet_csr(&request.kubelet_csr, &request.node_name)?;
        let control_plane_files = if request.is_control_plane {
            self.control_plane_files().await?
        } else {
            Vec::new()
        };
        // Bound durably before any key or token leaves; a retry by the same
        // TPM finds its own binding.
        let ek = EkDigest::of_public(&peer.ek);
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
            Bind::EkFull => {
                return Err(JoinServiceError::DiskNotBound(DiskBindingRefusal::EkFull {
                    peer: ek,
                }))
            }
        }
        let token = BootstrapToken::generate();
        self.register_token(&token).await?;
        let secrets = JoinSecrets {
            state_disk_key: disk_key.to_vec(),
            measurement_secret: cluster.measurement_secret.to_vec(),
            certificate_key: Vec::new(),
            bootstrap_token: token.expose().to_owned(),
            kubelet_cert: kubelet_cert.into_bytes(),
            control_plane_files,
        };
        let sealed = seal(peer, secrets)?;
        tracing::info!(
            node = %request.node_name,
            control_plane = request.is_control_plane,
            token_id = token.id(),
            "issued join ticket"
        );
        Ok(IssueJoinTicketResponse {
            secrets: Some(sealed),
            measurement_salt: cluster.measurement_salt.clone(),
            kubelet_cert: Vec::new(),
            api_server_endpoint: cluster.api_server.to_string(),
            token: String::new(),
            discovery_token_ca_cert_hash: self.inner.ca.hash.as_str().to_owned(),
            control_plane_files: Vec::new(),
            kubernetes_version: cluster.kubernetes_version.to_string(),
            kubernetes_components: Some(keel_proto::components::Components {
                components: cluster.components.iter().map(Into::into).collect(),
            }),
            cluster_ca_cert: self.inner.ca.cert_pem.clone().into_bytes(),
        })
    }

    /// Issues a rejoin ticket (disk key and measurement secret) to the
    /// validated peer `peer`, whose state disk is already initialised.
    pub async fn rejoin_ticket(
        &self,
        peer: &Verified,
        request: IssueRejoinTicketRequest,
    ) -> Result<IssueRejoinTicketResponse, JoinServiceError> {
        let _slot = self.slot().await?;
        let cluster = &self.inner.cluster;
        crate::key_service::disk_key_id(&request.disk_uuid)
            .map_err(|e| JoinServiceError::DiskUuid(e.into()))?;
        let ek = EkDigest::of_public(&peer.ek);
        let uuid = request.disk_uuid.clone();
        let refusal = match self.with_disks(move |d| d.lookup(&uuid)).await? {
            Some(bound) if bound.ct_eq(&ek) => None,
            Some(bound) => Some(DiskBindingRefusal::OtherEk {
                uuid: request.disk_uuid.to_ascii_lowercase(),
                bound,
                peer: ek,
            }),
            None => Some(DiskBindingRefusal::Unknown {
                uuid: request.disk_uuid.to_ascii_lowercase(),
            }),
        };
        if let Some(refusal) = refusal {
            return Err(JoinServiceError::DiskNotBound(refusal));
        }
        let disk_key = cluster
            .keys
            .disk_key(&request.disk_uuid)
            .map_err(JoinServiceError::DiskUuid)?;
        let secrets = JoinSecrets {
            state_disk_key: disk_key.to_vec(),
            measurement_secret: cluster.measurement_secret.to_vec(),
            ..JoinSecrets::default()
        };
        let sealed = seal(peer, secrets)?;
        tracing::info!(disk = %request.disk_uuid.escape_debug(), "issued rejoin ticket");
        Ok(IssueRejoinTicketResponse {
            secrets: Some(sealed),
            measurement_salt: cluster.measurement_salt.clone(),
        })
    }

    async fn slot(&self) -> Result<tokio::sync::SemaphorePermit<'_>, JoinServiceError> {
        tokio::time::timeout(QUEUE_WAIT, self.inner.slots.acquire())
            .await
            .map_err(|_| JoinServiceError::Busy)?
            .map_err(|_| JoinServiceError::Busy)
    }

    /// Checks the CSR and signs a kubelet client certificate for its key.
    fn sign_kubelet_csr(
        &self,
        csr_pem: &[u8],
        node_name: &str,
    ) -> Result<String, JoinServiceError> {
        let spki = check_csr(csr_pem, node_name)?;
        let key = rcgen::SubjectPublicKeyInfo::from_der(&spki).map_err(|_| CsrError::KeyType)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "system:nodes");
        dn.push(DnType::CommonName, format!("system:node:{node_name}"));
        params.distinguished_name = dn;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + time::Duration::days(KUBELET_CERT_DAYS);
        let mut serial = [0u8; 16];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut serial);
        serial[0] &= 0x7f;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let cert = params
            .signed_by(&key, &self.inner.ca.issuer)
            .map_err(JoinServiceError::Sign)?;
        Ok(cert.pem())
    }

    async fn control_plane_files(&self) -> Result<Vec<ControlPlaneFile>, JoinServiceError> {
        let pki = &self.inner.cluster.pki_dir;
        let mut files = Vec::new();
        for name in CONTROL_PLANE_FILES {
            let path = pki.join(name);
            let required = matches!(name, "ca.crt" | "ca.key");
            match read_bounded(&path, MAX_PKI_FILE).await {
                Ok(data) => files.push(ControlPlaneFile {
                    name: name.to_owned(),
                    data: data.to_vec(),
                }),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {}
                Err(source) => return Err(JoinServiceError::ControlPlaneFile { name, source }),
            }
        }
        Ok(files)
    }

    /// `kubeadm token create --config F`: F is an `InitConfiguration` with
    /// the one token (mode 0600, removed afterwards).
    async fn register_token(&self, token: &BootstrapToken) -> Result<(), JoinServiceError> {
        let fail = |m: String| JoinServiceError::Token(m);
        let api = ConfigApi::for_version(self.inner.cluster.kubernetes_version)
            .map_err(|e| fail(e.to_string()))?;
        let yaml = Zeroizing::new(format!(
            "apiVersion: {api}\nkind: InitConfiguration\nbootstrapTokens:\n- token: \"{token}\"\n  \
             ttl: \"{TOKEN_TTL}\"\n  usages: [\"signing\", \"authentication\"]\n  groups: [\"{TOKEN_GROUP}\"]\n  \
             description: \"keel join ticket\"\n",
            api = api.api_version(),
            token = token.expose(),
        ));
        let path = self
            .inner
            .work_dir
            .join("join-tokens")
            .join(format!("token-{}.yaml", token.id()));
        crate::files::write_private(&path, yaml.as_bytes())
            .map_err(|e| fail(keel_atls::ErrorChain(&e).to_string()))?;
        let result = self.run_token_create(&path).await;
        let _ = tokio::fs::remove_file(&path).await;
        result
    }

    async fn run_token_create(&self, config: &Path) -> Result<(), JoinServiceError> {
        let kubeadm = &self.inner.kubeadm;
        let kubeconfig = kubeadm.root.join(kubeadm::run::ADMIN_CONF);
        let child = tokio::process::Command::new(&kubeadm.program)
            .arg("token")
            .arg("create")
            .arg("--config")
            .arg(config)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .envs(kubeadm.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            // kubeadm prints the token: never read it.
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                JoinServiceError::Token(format!("running {}: {e}", kubeadm.program.display()))
            })?;
        let output = tokio::time::timeout(TOKEN_CREATE_TIMEOUT, child.wait_with_output())
            .await
            .map_err(|_| {
                JoinServiceError::Token(format!(
                    "kubeadm token create did not finish within {TOKEN_CREATE_TIMEOUT:?}"
                ))
            })?
            .map_err(|e| JoinServiceError::Token(format!("waiting for kubeadm: {e}")))?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail = stderr
            .get(stderr.len().saturating_sub(MAX_STDERR)..)
            .unwrap_or_default();
        Err(JoinServiceError::Token(format!(
            "kubeadm token create failed ({}): {}",
            output.status,
            kubeadm::run::scrub_tokens(tail.trim())
        )))
    }
}

/// The request's node name and role must be those the peer measured.
fn check_identity(
    peer: &Verified,
    node_name: &str,
    is_control_plane: bool,
) -> Result<(), JoinServiceError> {
    if node_name.is_empty() || node_name.len() > 63 {
        return Err(JoinServiceError::InvalidRequest(
            "node name must be 1-63 characters",
        ));
    }
    let event = peer
        .events
        .iter()
        .find(|e| e.event_type == EventType::NodeIdentity)
        .ok_or(JoinServiceError::Identity(
            "no node identity in the event log",
        ))?;
    let identity: NodeIdentity = serde_json::from_slice(&event.data)
        .map_err(|_| JoinServiceError::Identity("the node identity does not parse"))?;
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
    Ok(())
}

/// Checks a PEM CSR (size, signature, subject) and returns its
/// SubjectPublicKeyInfo DER.
pub fn check_csr(csr_pem: &[u8], node_name: &str) -> Result<Vec<u8>, CsrError> {
    if csr_pem.len() > MAX_CSR_BYTES {
        return Err(CsrError::TooLarge);
    }
    let (_, pem) = x509_parser::pem::parse_x509_pem(csr_pem).map_err(|_| CsrError::Pem)?;
    if pem.label != "CERTIFICATE REQUEST" {
        return Err(CsrError::Pem);
    }
    let (rest, csr) =
        X509CertificationRequest::from_der(&pem.contents).map_err(|_| CsrError::Parse)?;
    if !rest.is_empty() {
        return Err(CsrError::Parse);
    }
    csr.verify_signature().map_err(|_| CsrError::Signature)?;
    let info = &csr.certification_request_info;
    let expected_cn = format!("system:node:{node_name}");
    let subject_ok = {
        let attributes: Vec<_> = info.subject.iter_attributes().collect();
        let cn = info.subject.iter_common_name().collect::<Vec<_>>();
        let o = info.subject.iter_organization().collect::<Vec<_>>();
        attributes.len() == 2
            && matches!(cn.as_slice(), [c] if c.as_str().ok() == Some(expected_cn.as_str()))
            && matches!(o.as_slice(), [o] if o.as_str().ok() == Some("system:nodes"))
    };
    if !subject_ok {
        return Err(CsrError::Subject(node_name.escape_debug().to_string()));
    }
    Ok(info.subject_pki.raw.to_vec())
}

fn seal(
    peer: &Verified,
    mut secrets: JoinSecrets,
) -> Result<keel_proto::attestation::SealedSecret, JoinServiceError> {
    let payload = Zeroizing::new(secrets.encode_to_vec());
    secrets.state_disk_key.zeroize();
    secrets.measurement_secret.zeroize();
    secrets.bootstrap_token.zeroize();
    for file in &mut secrets.control_plane_files {
        file.data.zeroize();
    }
    credential::seal(&peer.ek, &peer.ak.name, &payload).map_err(JoinServiceError::Seal)
}

async fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Zeroizing<Vec<u8>>> {
    let file = tokio::fs::File::open(path).await?;
    let mut data = Zeroizing::new(Vec::new());
    file.take(limit + 1).read_to_end(&mut data).await?;
    if data.len() as u64 > limit {
        return Err(std::io::Error::other(format!("larger than {limit} bytes")));
    }
    Ok(data)
}

/// The validated claims of the peer of `request`.
fn peer_claims<T>(
    request: &tonic::Request<T>,
) -> Result<Arc<keel_atls::Attested<Verified>>, JoinServiceError> {
    request
        .extensions()
        .get::<keel_atls::PeerInfo<Verified>>()
        .and_then(|p| p.attested().cloned())
        .ok_or(JoinServiceError::NotAttested)
}

#[tonic::async_trait]
impl join_service_server::JoinService for JoinService {
    async fn issue_join_ticket(
        &self,
        request: tonic::Request<IssueJoinTicketRequest>,
    ) -> Result<tonic::Response<IssueJoinTicketResponse>, tonic::Status> {
        let result = match peer_claims(&request) {
            Ok(peer) => self.join_ticket(peer.claims(), request.into_inner()).await,
            Err(e) => Err(e),
        };
        result.map(tonic::Response::new).map_err(|e| {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "join ticket refused");
            (&e).into()
        })
    }

    async fn issue_rejoin_ticket(
        &self,
        request: tonic::Request<IssueRejoinTicketRequest>,
    ) -> Result<tonic::Response<IssueRejoinTicketResponse>, tonic::Status> {
        let result = match peer_claims(&request) {
            Ok(peer) => {
                self.rejoin_ticket(peer.claims(), request.into_inner())
                    .await
            }
            Err(e) => Err(e),
        };
        result.map(tonic::Response::new).map_err(|e| {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "rejoin ticket refused");
            (&e).into()
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn csr(cn: &str, o: Option<&str>) -> String {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        if let Some(o) = o {
            dn.push(DnType::OrganizationName, o);
        }
        dn.push(DnType::CommonName, cn);
        params.distinguished_name = dn;
        params.serialize_request(&key).unwrap().pem().unwrap()
    }

    #[test]
    fn csr_subject_and_signature_are_checked() {
        let good = csr("system:node:w-1", Some("system:nodes"));
        assert!(check_csr(good.as_bytes(), "w-1").is_ok());
        assert!(matches!(
            check_csr(good.as_bytes(), "w-2"),
            Err(CsrError::Subject(_))
        ));
        for bad in [
            csr("system:node:w-1", None),
            csr("system:node:w-1", Some("system:masters")),
            csr("system:admin", Some("system:nodes")),
        ] {
            assert!(matches!(
                check_csr(bad.as_bytes(), "w-1"),
                Err(CsrError::Subject(_))
            ));
        }
        // A flipped bit in the signature.
        let (_, pem) = x509_parser::pem::parse_x509_pem(good.as_bytes()).unwrap();
        let mut der = pem.contents.clone();
        *der.last_mut().unwrap() ^= 1;
        let tampered = pem_encode("CERTIFICATE REQUEST", &der);
        assert!(matches!(
            check_csr(tampered.as_bytes(), "w-1"),
            Err(CsrError::Signature)
        ));
        assert!(matches!(check_csr(b"junk", "w-1"), Err(CsrError::Pem)));
        let huge = vec![b'a'; MAX_CSR_BYTES + 1];
        assert!(matches!(check_csr(&huge, "w-1"), Err(CsrError::TooLarge)));
    }

    fn pem_encode(label: &str, der: &[u8]) -> String {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        let lines: Vec<&str> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            lines.join("\n")
        )
    }

    const DISK: &str = "0a1b2c3d-0000-4000-8000-00000000000a";

    #[test]
    fn status_codes() {
        let code = |e: JoinServiceError| tonic::Status::from(&e).code();
        assert_eq!(
            code(JoinServiceError::NotAttested),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            code(JoinServiceError::Identity("x")),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            code(JoinServiceError::Csr(CsrError::Signature)),
            tonic::Code::InvalidArgument
        );
        assert_eq!(code(JoinServiceError::Busy), tonic::Code::Unavailable);
        let not_bound =
            JoinServiceError::DiskNotBound(DiskBindingRefusal::Unknown { uuid: DISK.into() });
        let status = tonic::Status::from(&not_bound);
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        // The peer learns nothing about the binding.
        assert!(!status.message().contains(DISK), "{}", status.message());
        assert_eq!(
            code(JoinServiceError::DiskBindings(DiskBindingsError::Full)),
            tonic::Code::Internal
        );
    }
}
