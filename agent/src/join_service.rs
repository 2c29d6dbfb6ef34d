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
//! The one state the service keeps is [`DiskBindings`]: a join ticket binds
//! the state disk's UUID to the joining TPM's endorsement key (the SHA-256
//! of its marshalled TPMT_PUBLIC, see [`EkDigest`]), durably, before any
//! key leaves. A rejoin ticket is issued only to the TPM a disk is bound
//! to, and a join ticket for a disk bound to another TPM is refused: an
//! attested node cannot obtain another node's disk key by naming its UUID.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use keel_proto::join::join_service_server::{self, JoinServiceServer};
use keel_proto::join::{
    ControlPlaneFile, IssueJoinTicketRequest, IssueJoinTicketResponse, IssueRejoinTicketRequest,
    IssueRejoinTicketResponse, JoinSecrets,
};
use prost::Message as _;
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair,
    KeyUsagePurpose, SerialNumber,
};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;
use tokio::io::AsyncReadExt as _;
use tokio::sync::Semaphore;
use x509_parser::prelude::{FromDer as _, X509Certificate, X509CertificationRequest};
use zeroize::{Zeroize as _, Zeroizing};

use crate::attestation::credential::{self, CredentialError};
use crate::attestation::tpm_wire::Public;
use crate::attestation::validator::Verified;
use crate::cluster::ClusterState;
use crate::config::{NodeIdentity, Role};
use crate::files::WriteFileError;
use crate::key_service::{DiskKeyError, DiskKeyIdError};
use crate::kubeadm::{self, BootstrapToken, CaCertHash, ConfigApi, Kubeadm};
use crate::measurement::EventType;

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
/// The disk binding store, in the join service's work directory.
pub const DISK_BINDINGS_FILE: &str = "disk-bindings.json";
/// Most disks the binding store holds; further new disks are refused.
pub const MAX_DISK_BINDINGS: usize = 10_000;
/// Most disks bound to one endorsement key: an attested node that keeps
/// asking for join tickets with new disk UUIDs cannot fill the store.
pub const MAX_DISKS_PER_EK: usize = 128;
/// Largest accepted binding store file (10 000 entries take about 1.1 MB).
const MAX_DISK_BINDINGS_BYTES: u64 = 2 * 1024 * 1024;
/// Format version of the binding store file.
const DISK_BINDINGS_VERSION: u32 = 1;

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

/// SHA-256 over an endorsement key's marshalled TPMT_PUBLIC: the digest
/// part of the EK's TPM name (nameAlg SHA-256). Every field of the public
/// area is covered, the RSA modulus included; the TPM recreates the same
/// area from its endorsement seed, so the digest is stable across reboots.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct EkDigest([u8; 32]);

impl EkDigest {
    /// The digest of a marshalled TPMT_PUBLIC.
    pub fn of_marshalled(public: &[u8]) -> Self {
        Self(Sha256::digest(public).into())
    }

    /// The digest of a parsed EK: the same value as [`EkDigest::of_marshalled`]
    /// of the bytes it was parsed from (its name minus the algorithm ID).
    pub fn of_public(ek: &Public) -> Self {
        let mut digest = [0u8; 32];
        match ek.name.get(2..) {
            Some(tail) if tail.len() == digest.len() => digest.copy_from_slice(tail),
            // A parsed Public's name is always nameAlg || SHA-256 (32 bytes);
            // should that change, hash the whole name rather than guess.
            _ => digest = Sha256::digest(&ek.name).into(),
        }
        Self(digest)
    }

    /// Compares in constant time.
    pub fn ct_eq(&self, other: &Self) -> bool {
        self.0.ct_eq(&other.0).into()
    }

    fn parse_hex(text: &str) -> Option<Self> {
        let mut digest = [0u8; 32];
        hex::decode_to_slice(text, &mut digest).ok()?;
        Some(Self(digest))
    }
}

impl std::fmt::Display for EkDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl std::fmt::Debug for EkDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Why a disk binding refused a ticket (the local log's detail; the peer
/// only learns that the disk is not bound to its TPM).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskBindingRefusal {
    /// The disk is bound to another endorsement key.
    #[error("disk {uuid} is bound to EK {bound}, the peer's EK is {peer}")]
    OtherEk {
        /// The disk UUID (lower case).
        uuid: String,
        /// The EK the disk is bound to.
        bound: EkDigest,
        /// The peer's EK.
        peer: EkDigest,
    },
    /// No join ticket was ever issued for the disk by this cluster's join
    /// service (or its binding was lost).
    #[error("disk {uuid} never joined through this join service")]
    Unknown {
        /// The disk UUID (lower case).
        uuid: String,
    },
    /// The peer's EK already has [`MAX_DISKS_PER_EK`] disks bound.
    #[error("EK {peer} already has {MAX_DISKS_PER_EK} disks bound")]
    EkFull {
        /// The peer's EK.
        peer: EkDigest,
    },
}

/// The disk binding store failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskBindingsError {
    /// The disk UUID is malformed.
    #[error("invalid disk UUID")]
    Uuid(#[source] DiskKeyIdError),
    /// The store file could not be read.
    #[error("reading the disk bindings {path}")]
    Read {
        /// The store file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The store file exists but is not a valid store. It is left as it is
    /// for an operator to inspect; nothing is issued until it is fixed.
    #[error("the disk bindings {path} are corrupt: {reason}")]
    Corrupt {
        /// The store file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The store holds [`MAX_DISK_BINDINGS`] disks.
    #[error("the disk bindings are full ({MAX_DISK_BINDINGS} disks)")]
    Full,
    /// Writing the store failed; the binding was not recorded.
    #[error("writing the disk bindings")]
    Write(#[source] WriteFileError),
    /// The blocking task running a store operation failed.
    #[error("the disk binding task failed")]
    Task,
}

/// The outcome of [`DiskBindings::bind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Bind {
    /// The disk was not bound; it is now bound to the EK, durably.
    Recorded,
    /// The disk was already bound to this EK.
    AlreadyBound,
    /// The disk is bound to another EK (given); nothing changed.
    OtherEk(EkDigest),
    /// The EK has [`MAX_DISKS_PER_EK`] disks bound; nothing changed.
    EkFull,
}

/// The file form of the store.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskBindingsFile {
    version: u32,
    /// Lower-case disk UUID to lower-case hex EK digest.
    disks: BTreeMap<String, String>,
}

/// Serialises every store operation in this process: a binding is checked
/// and recorded as one step, and one writer at a time uses the temp file.
static DISK_BINDINGS_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The disks of this cluster and the TPMs they belong to: disk UUID (lower
/// case, as the disk key derivation uses it) to [`EkDigest`], in one JSON
/// file written atomically with mode 0600 (temp file, fsync, rename).
/// Reads are bounded ([`MAX_DISK_BINDINGS`] entries, 2 MiB). The methods
/// block on file I/O.
#[derive(Debug, Clone)]
pub struct DiskBindings {
    path: PathBuf,
}

impl DiskBindings {
    /// The store in `dir` ([`DISK_BINDINGS_FILE`]); nothing is read yet.
    /// The init path records the first node's own disk through the same
    /// directory the join service uses.
    pub fn new(dir: &Path) -> Self {
        Self {
            path: dir.join(DISK_BINDINGS_FILE),
        }
    }

    /// The store file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many disks are bound (loads and checks the whole store).
    pub fn len(&self) -> Result<usize, DiskBindingsError> {
        let _guard = lock_bindings();
        Ok(self.load()?.len())
    }

    /// Whether no disk is bound yet.
    pub fn is_empty(&self) -> Result<bool, DiskBindingsError> {
        self.len().map(|n| n == 0)
    }

    /// The EK the disk `uuid` is bound to, if any.
    pub fn lookup(&self, uuid: &str) -> Result<Option<EkDigest>, DiskBindingsError> {
        let uuid = normalise_uuid(uuid)?;
        let _guard = lock_bindings();
        Ok(self.load()?.get(&uuid).copied())
    }

    /// Binds the disk `uuid` to `ek` unless it is bound already; checks
    /// and records as one step. A new binding is on disk when this returns.
    pub fn bind(&self, uuid: &str, ek: &EkDigest) -> Result<Bind, DiskBindingsError> {
        let uuid = normalise_uuid(uuid)?;
        let _guard = lock_bindings();
        let mut disks = self.load()?;
        if let Some(bound) = disks.get(&uuid) {
            return Ok(if bound.ct_eq(ek) {
                Bind::AlreadyBound
            } else {
                Bind::OtherEk(*bound)
            });
        }
        if disks.values().filter(|e| e.ct_eq(ek)).count() >= MAX_DISKS_PER_EK {
            return Ok(Bind::EkFull);
        }
        if disks.len() >= MAX_DISK_BINDINGS {
            return Err(DiskBindingsError::Full);
        }
        disks.insert(uuid, *ek);
        self.store(&disks)?;
        Ok(Bind::Recorded)
    }

    fn corrupt(&self, reason: impl Into<String>) -> DiskBindingsError {
        DiskBindingsError::Corrupt {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    /// Reads the store; a missing file is an empty store.
    fn load(&self) -> Result<BTreeMap<String, EkDigest>, DiskBindingsError> {
        let read_err = |source| DiskBindingsError::Read {
            path: self.path.clone(),
            source,
        };
        let file = match std::fs::File::open(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(e) => return Err(read_err(e)),
        };
        let mut bytes = Vec::new();
        file.take(MAX_DISK_BINDINGS_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(read_err)?;
        if bytes.len() as u64 > MAX_DISK_BINDINGS_BYTES {
            return Err(self.corrupt(format!("larger than {MAX_DISK_BINDINGS_BYTES} bytes")));
        }
        let raw: DiskBindingsFile = serde_json::from_slice(&bytes)
            .map_err(|e| self.corrupt(format!("not a binding store: {e}")))?;
        if raw.version != DISK_BINDINGS_VERSION {
            return Err(self.corrupt(format!("unknown version {}", raw.version)));
        }
        if raw.disks.len() > MAX_DISK_BINDINGS {
            return Err(self.corrupt(format!("more than {MAX_DISK_BINDINGS} disks")));
        }
        let mut disks = BTreeMap::new();
        for (uuid, ek) in raw.disks {
            if normalise_uuid(&uuid).ok().as_deref() != Some(uuid.as_str()) {
                return Err(self.corrupt(format!(
                    "invalid disk UUID {:?}",
                    uuid.escape_debug().to_string()
                )));
            }
            let digest = (ek.len() == 64 && ek == ek.to_ascii_lowercase())
                .then(|| EkDigest::parse_hex(&ek))
                .flatten()
                .ok_or_else(|| self.corrupt(format!("invalid EK digest for disk {uuid}")))?;
            disks.insert(uuid, digest);
        }
        Ok(disks)
    }

    fn store(&self, disks: &BTreeMap<String, EkDigest>) -> Result<(), DiskBindingsError> {
        let file = DiskBindingsFile {
            version: DISK_BINDINGS_VERSION,
            disks: disks
                .iter()
                .map(|(uuid, ek)| (uuid.clone(), hex::encode(ek.0)))
                .collect(),
        };
        let mut json = serde_json::to_vec_pretty(&file).map_err(|e| {
            DiskBindingsError::Write(WriteFileError {
                path: self.path.clone(),
                source: std::io::Error::other(e),
            })
        })?;
        json.push(b'\n');
        crate::files::write_private(&self.path, &json).map_err(DiskBindingsError::Write)
    }
}

fn lock_bindings() -> std::sync::MutexGuard<'static, ()> {
    // The guarded data is `()`: a panic while holding the lock leaves
    // nothing inconsistent behind (the file is replaced atomically).
    DISK_BINDINGS_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The UUID in the form the disk key derivation uses (lower case), after
/// the same shape check.
fn normalise_uuid(uuid: &str) -> Result<String, DiskBindingsError> {
    crate::key_service::disk_key_id(uuid).map_err(DiskBindingsError::Uuid)?;
    Ok(uuid.to_ascii_lowercase())
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

    fn ek(n: u8) -> EkDigest {
        EkDigest::of_marshalled(&[n])
    }

    const DISK: &str = "0a1b2c3d-0000-4000-8000-00000000000a";

    #[test]
    fn bindings_record_refuse_and_persist() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        assert!(store.is_empty().unwrap());
        assert_eq!(store.lookup(DISK).unwrap(), None);
        assert_eq!(store.bind(DISK, &ek(1)).unwrap(), Bind::Recorded);
        assert_eq!(store.bind(DISK, &ek(1)).unwrap(), Bind::AlreadyBound);
        assert_eq!(store.bind(DISK, &ek(2)).unwrap(), Bind::OtherEk(ek(1)));
        // The key derivation lower-cases the UUID: so does the binding.
        let upper = DISK.to_ascii_uppercase();
        assert_eq!(store.bind(&upper, &ek(2)).unwrap(), Bind::OtherEk(ek(1)));
        assert_eq!(store.lookup(&upper).unwrap(), Some(ek(1)));
        assert!(matches!(
            store.bind("not-a-uuid", &ek(1)),
            Err(DiskBindingsError::Uuid(_))
        ));

        // A new store over the same directory reads the same bindings.
        let reopened = DiskBindings::new(dir.path());
        assert_eq!(reopened.lookup(DISK).unwrap(), Some(ek(1)));
        assert_eq!(reopened.len().unwrap(), 1);
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(store.path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [DISK_BINDINGS_FILE], "a temporary file was left");
    }

    #[test]
    fn one_ek_binds_a_bounded_number_of_disks() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        for i in 0..MAX_DISKS_PER_EK {
            let uuid = format!("00000000-0000-4000-8000-{i:012x}");
            assert_eq!(store.bind(&uuid, &ek(1)).unwrap(), Bind::Recorded);
        }
        let next = format!("00000000-0000-4000-8000-{MAX_DISKS_PER_EK:012x}");
        assert_eq!(store.bind(&next, &ek(1)).unwrap(), Bind::EkFull);
        assert_eq!(store.bind(&next, &ek(2)).unwrap(), Bind::Recorded);
        assert_eq!(store.len().unwrap(), MAX_DISKS_PER_EK + 1);
    }

    #[test]
    fn a_corrupt_store_is_refused_and_left_alone() {
        let good_ek = hex::encode([0xab_u8; 32]);
        let cases = [
            "".to_owned(),
            "[]".to_owned(),
            "{\"version\":1}".to_owned(),
            format!("{{\"version\":2,\"disks\":{{\"{DISK}\":\"{good_ek}\"}}}}"),
            format!("{{\"version\":1,\"disks\":{{\"{DISK}\":\"{good_ek}\"}},\"x\":1}}"),
            format!("{{\"version\":1,\"disks\":{{\"not-a-uuid\":\"{good_ek}\"}}}}"),
            format!(
                "{{\"version\":1,\"disks\":{{\"{}\":\"{good_ek}\"}}}}",
                DISK.to_ascii_uppercase()
            ),
            format!("{{\"version\":1,\"disks\":{{\"{DISK}\":\"00\"}}}}"),
            format!(
                "{{\"version\":1,\"disks\":{{\"{DISK}\":\"{}\"}}}}",
                good_ek.to_ascii_uppercase()
            ),
            " ".repeat(MAX_DISK_BINDINGS_BYTES as usize + 1),
        ];
        for text in cases {
            let dir = tempfile::tempdir().unwrap();
            let store = DiskBindings::new(dir.path());
            std::fs::write(store.path(), &text).unwrap();
            let shown = text.get(..60).unwrap_or(&text).to_owned();
            assert!(
                matches!(store.len(), Err(DiskBindingsError::Corrupt { .. })),
                "{shown}"
            );
            assert!(
                matches!(
                    store.bind(DISK, &ek(1)),
                    Err(DiskBindingsError::Corrupt { .. })
                ),
                "{shown}"
            );
            assert!(matches!(
                store.lookup(DISK),
                Err(DiskBindingsError::Corrupt { .. })
            ));
            assert_eq!(std::fs::read_to_string(store.path()).unwrap(), text);
        }
        // The well-formed version of the same loads.
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        let text = format!("{{\"version\":1,\"disks\":{{\"{DISK}\":\"{good_ek}\"}}}}");
        std::fs::write(store.path(), text).unwrap();
        assert_eq!(store.lookup(DISK).unwrap(), Some(EkDigest([0xab; 32])));
    }

    #[test]
    fn the_ek_digest_is_the_sha256_of_the_marshalled_public_area() {
        // A TPMT_PUBLIC: ECC, SHA-256 name, attributes, empty policy, no
        // symmetric, no scheme, P-256, no KDF, 1-byte coordinates.
        let bytes = [
            0x00, 0x23, 0x00, 0x0b, 0x00, 0x04, 0x00, 0x72, 0x00, 0x00, 0x00, 0x10, 0x00, 0x10,
            0x00, 0x03, 0x00, 0x10, 0x00, 0x01, 0x05, 0x00, 0x01, 0x06,
        ];
        let public = Public::parse(&bytes).unwrap();
        let digest = EkDigest::of_public(&public);
        assert_eq!(digest, EkDigest::of_marshalled(&bytes));
        assert_eq!(digest.0, <[u8; 32]>::from(Sha256::digest(bytes)));
        assert!(digest.ct_eq(&EkDigest::of_marshalled(&bytes)));
        assert!(!digest.ct_eq(&ek(1)));
        assert!(digest.to_string().starts_with("sha256:"));
    }

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
