//! The init flow: the operator's CLI turns this node into the first node of
//! a new cluster.
//!
//! Everything the request carries is checked before the node lock is taken:
//! the init secret (constant time, against the hash in the measured config),
//! the master secret (sealed to this TPM, so it opens only here), salts and
//! the Kubernetes version. A refusal there changes nothing. Then the lock is
//! taken (PCR 15 := cluster ID) and the node is committed: it sets up its
//! state disk, installs the components, runs kubeadm and returns the admin
//! kubeconfig. A failure after the lock is fatal for this boot: the stream
//! carries the failure and the node's logs, the state disk is marked for
//! reset, and the node reboots after a grace period.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel_installer::{Component, Installer, InstallerConfig, KubernetesVersion, LogProgress};
use keel_proto::init::init_response::Kind;
use keel_proto::init::init_service_server::{InitService, InitServiceServer};
use keel_proto::init::{InitFailure, InitRequest, InitResponse, InitSuccess};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use zeroize::Zeroizing;

use crate::address::AdvertiseAddress;
use crate::attestation::credential;
use crate::attestation::measurements::Measurements;
use crate::cluster::{ClusterSlot, ClusterState};
use crate::components::install_and_measure;
use crate::config::NodeConfig;
use crate::disk::StateDisk;
use crate::key_service::{self, KeyService};
use crate::kubeadm::{self, BootstrapToken, InitConfig, Kubeadm};
use crate::measured::SharedTpm;
use crate::nodelock::{LockError, NodeLock};

/// Most bytes of node logs sent after a failure.
const MAX_FAILURE_LOGS: usize = 1024 * 1024;
/// Size of one log chunk on the stream.
const LOG_CHUNK: usize = 32 * 1024;
/// Longest accepted cluster name.
const MAX_NAME: usize = 63;

/// Why an init request was refused before the node lock.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// The node has no init secret hash in its config: it does not accept init.
    #[error("this node does not accept init (no init secret configured)")]
    NotInitNode,
    /// The init secret does not match.
    #[error("wrong init secret")]
    WrongInitSecret,
    /// A request field is invalid.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The master secret was not sealed to this node's TPM.
    #[error("the master secret is not sealed to this node's TPM")]
    Sealed(#[source] credential::CredentialError),
    /// The node is already locked.
    #[error("the node is already part of a cluster")]
    Locked,
    /// Taking the lock failed for another reason.
    #[error("taking the node lock failed")]
    Lock(#[source] LockError),
    /// The TPM could not be used.
    #[error("the TPM is unavailable")]
    Tpm,
}

impl From<&InitError> for tonic::Status {
    /// The one map from init refusals to gRPC codes; peers get the short
    /// message, the node's log has the full chain.
    fn from(e: &InitError) -> Self {
        let code = match e {
            InitError::WrongInitSecret => tonic::Code::Unauthenticated,
            InitError::InvalidRequest(_) | InitError::Sealed(_) => tonic::Code::InvalidArgument,
            InitError::NotInitNode | InitError::Locked => tonic::Code::FailedPrecondition,
            InitError::Lock(_) | InitError::Tpm => tonic::Code::Unavailable,
        };
        tonic::Status::new(code, e.to_string())
    }
}

/// What to do after a fatal failure.
#[derive(Clone, Copy, Debug)]
pub enum RebootPolicy {
    /// Reboot after this grace period (a node).
    After(Duration),
    /// Never reboot (host tests); the failure is still reported.
    Never,
}

/// Where and how this node does the work after the lock.
#[derive(Clone, Debug)]
pub struct NodeEnv {
    /// The installer's settings (root, mirror, retries).
    pub installer: InstallerConfig,
    /// How kubeadm runs.
    pub kubeadm: Kubeadm,
    /// Where kubeadm configs are written.
    pub work_dir: PathBuf,
    /// The address the API server and kubelet advertise.
    pub advertise_address: AdvertiseAddress,
    /// The state disk, if the node has one.
    pub state_disk: Option<StateDisk>,
    /// After a fatal failure.
    pub reboot: RebootPolicy,
}

/// A request that passed every check, ready to lock on.
struct Accepted {
    keys: Arc<KeyService>,
    measurement_salt: Vec<u8>,
    measurement_secret: Zeroizing<Vec<u8>>,
    cluster_id: key_service::ClusterId,
    version: KubernetesVersion,
    components: Vec<Component>,
    cluster_name: String,
    cert_sans: Vec<String>,
    service_cidr: String,
    join_measurements: Measurements,
}

/// The init server.
#[derive(Clone)]
pub struct InitServer {
    inner: Arc<Inner>,
}

struct Inner {
    config: NodeConfig,
    tpm: SharedTpm,
    lock: Arc<NodeLock>,
    env: NodeEnv,
    cluster: Arc<ClusterSlot>,
}

impl InitServer {
    /// An init server for this node.
    pub fn new(
        config: NodeConfig,
        tpm: SharedTpm,
        lock: Arc<NodeLock>,
        env: NodeEnv,
        cluster: Arc<ClusterSlot>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                config,
                tpm,
                lock,
                env,
                cluster,
            }),
        }
    }

    /// The tonic service.
    pub fn into_service(self) -> InitServiceServer<Self> {
        InitServiceServer::new(self)
    }

    /// Checks `request` completely, without side effects.
    async fn accept(&self, request: InitRequest) -> Result<Accepted, InitError> {
        let config = &self.inner.config;
        if config.cluster.init_secret_hash.is_empty() {
            return Err(InitError::NotInitNode);
        }
        if !config.init_secret_matches(&request.init_secret) {
            return Err(InitError::WrongInitSecret);
        }
        if self.inner.lock.is_locked() {
            return Err(InitError::Locked);
        }
        let invalid = |m: &str| InitError::InvalidRequest(m.to_owned());
        let cluster_name = request.cluster_name;
        if cluster_name.is_empty()
            || cluster_name.len() > MAX_NAME
            || !cluster_name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(invalid(
                "cluster name must be 1-63 characters of a-z, 0-9 and '-'",
            ));
        }
        let entry = keel_installer::resolve(&request.kubernetes_version)
            .map_err(|e| InitError::InvalidRequest(e.to_string()))?;
        let components = match request.kubernetes_components {
            Some(list) if !list.components.is_empty() => list
                .components
                .into_iter()
                .map(Component::try_from)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| InitError::InvalidRequest(format!("component: {e}")))?,
            _ => entry.components().to_vec(),
        };
        let join_measurements = Measurements::parse(&request.join_measurements)
            .map_err(|e| InitError::InvalidRequest(format!("join measurements: {e}")))?;
        if join_measurements.iter().next().is_none() {
            return Err(invalid("join measurements name no PCR"));
        }
        let sealed = request
            .master_secret
            .ok_or_else(|| invalid("master secret missing"))?;
        let tpm = self.inner.tpm.clone();
        let master_secret = tokio::task::spawn_blocking(move || {
            let mut guard = tpm.lock().map_err(|_| InitError::Tpm)?;
            credential::open(guard.tpm(), &sealed).map_err(InitError::Sealed)
        })
        .await
        .map_err(|_| InitError::Tpm)??;
        let keys = KeyService::new(&master_secret, &request.master_salt)
            .map_err(|e| InitError::InvalidRequest(e.to_string()))?;
        let measurement_secret = keys
            .measurement_secret()
            .map_err(|e| InitError::InvalidRequest(e.to_string()))?;
        let cluster_id = key_service::cluster_id(&measurement_secret, &request.measurement_salt)
            .map_err(|e| InitError::InvalidRequest(e.to_string()))?;
        let service_cidr = if request.service_cidr.is_empty() {
            "10.96.0.0/12".to_owned()
        } else {
            request.service_cidr
        };
        Ok(Accepted {
            keys: Arc::new(keys),
            measurement_salt: request.measurement_salt,
            measurement_secret,
            cluster_id,
            version: entry.version(),
            components,
            cluster_name,
            cert_sans: request.api_server_cert_sans,
            service_cidr,
            join_measurements,
        })
    }

    /// The work after the lock; every line goes to `log`.
    async fn create_cluster(
        &self,
        a: &Accepted,
        log: &Transcript,
    ) -> Result<(Vec<u8>, ClusterState), String> {
        let env = &self.inner.env;
        let node = &self.inner.config.node;
        if let Some(disk) = &env.state_disk {
            log.line(format!(
                "setting up the state disk {}",
                disk.device.display()
            ))
            .await;
            let done = setup_state_disk(disk, &a.keys).await?;
            log.line(done).await;
        } else {
            log.line("no state disk configured; skipping disk encryption")
                .await;
        }

        log.line(format!(
            "installing {} components for Kubernetes {}",
            a.components.len(),
            a.version
        ))
        .await;
        let installer =
            Installer::new(env.installer.clone()).map_err(|e| format!("installer: {e}"))?;
        install_and_measure(
            &installer,
            &self.inner.tpm,
            &a.components,
            &LogProgress::default(),
        )
        .await
        .map_err(|e| format!("installing components: {}", keel_atls::ErrorChain(&e)))?;

        // The control-plane image pins arrive as data: components in this
        // directory; kubeadm requires it to exist even when empty.
        let patches_dir = env
            .kubeadm
            .root
            .join(kubeadm::DEFAULT_PATCHES_DIR.trim_start_matches('/'));
        std::fs::create_dir_all(&patches_dir)
            .map_err(|e| format!("creating {}: {e}", patches_dir.display()))?;
        let token = BootstrapToken::generate();
        let advertise_address = env.advertise_address.resolve();
        log.line(format!("advertising {advertise_address}")).await;
        let init_config = InitConfig {
            node_name: node.name.clone(),
            advertise_address,
            cluster_name: a.cluster_name.clone(),
            kubernetes_version: a.version,
            cert_sans: a.cert_sans.clone(),
            service_cidr: a.service_cidr.clone(),
            pod_cidr: "10.244.0.0/16".into(),
            patches_dir: patches_dir.clone(),
            bootstrap_token: token,
        };
        let yaml = init_config
            .to_yaml()
            .map_err(|e| format!("kubeadm config: {e}"))?;
        let config_path = env.work_dir.join("kubeadm-init.yaml");
        crate::files::write_private(&config_path, yaml.as_bytes())
            .map_err(|e| format!("writing kubeadm config: {}", keel_atls::ErrorChain(&e)))?;
        log.line("running kubeadm init").await;
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let forward = {
            let log = log.clone();
            tokio::spawn(async move {
                while let Some(line) = rx.recv().await {
                    log.line(line).await;
                }
            })
        };
        let mut on_line = move |line: &str| {
            let _ = tx.send(line.to_owned());
        };
        let result = env.kubeadm.init(&config_path, &mut on_line).await;
        drop(on_line);
        let _ = forward.await;
        let kubeconfig =
            result.map_err(|e| format!("kubeadm init: {}", keel_atls::ErrorChain(&e)))?;
        let state = ClusterState {
            keys: a.keys.clone(),
            measurement_salt: a.measurement_salt.clone(),
            measurement_secret: a.measurement_secret.clone(),
            cluster_id: a.cluster_id,
            kubernetes_version: a.version,
            components: a.components.clone(),
            api_server: SocketAddr::new(advertise_address, kubeadm::config::API_SERVER_PORT),
            pki_dir: env.kubeadm.root.join("etc/kubernetes/pki"),
            join_measurements: a.join_measurements.clone(),
        };
        Ok((kubeconfig.to_vec(), state))
    }

    /// After a fatal failure: mark the disk for reset and schedule the reboot.
    async fn fail(&self, log: &Transcript) -> bool {
        let env = &self.inner.env;
        for line in crate::reboot::reset_node(env.state_disk.as_ref(), env.reboot).await {
            log.line(line).await;
        }
        true
    }
}

/// Formats (and on a node mounts) the state disk; returns the line to log.
async fn setup_state_disk(disk: &StateDisk, keys: &KeyService) -> Result<String, String> {
    let disk = disk.clone();
    let uuid = crate::disk::new_uuid();
    let key = keys
        .disk_key(&uuid)
        .map_err(|e| format!("deriving the disk key: {e}"))?;
    let mounted = tokio::task::spawn_blocking(move || {
        disk.set_up(&uuid, &key)
            .map_err(|e| format!("setting up the state disk: {}", keel_atls::ErrorChain(&e)))
    })
    .await
    .map_err(|e| format!("disk task: {e}"))??;
    Ok(match mounted {
        Some(at) => format!("state disk set up (LUKS2), mounted at {}", at.display()),
        None => "state disk set up (LUKS2); not opened here".to_owned(),
    })
}

/// The lines of one init: streamed to the CLI and kept for the failure report.
#[derive(Clone)]
struct Transcript {
    tx: mpsc::Sender<Result<InitResponse, tonic::Status>>,
    lines: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Transcript {
    async fn line(&self, line: impl Into<String>) {
        let line = line.into();
        tracing::info!(target: "keel_agent::init", "{line}");
        if let Ok(mut lines) = self.lines.lock() {
            lines.push(line.clone());
        }
        // A gone client does not stop the init: the node finishes (or fails) either way.
        let _ = self
            .tx
            .send(Ok(InitResponse {
                kind: Some(Kind::LogLine(line)),
            }))
            .await;
    }

    async fn send(&self, kind: Kind) {
        let _ = self.tx.send(Ok(InitResponse { kind: Some(kind) })).await;
    }

    /// The node's logs: this transcript, then the journal of this boot where there is one.
    fn collected_logs(&self) -> Vec<u8> {
        let mut out: Vec<u8> = self
            .lines
            .lock()
            .map(|l| l.join("\n"))
            .unwrap_or_default()
            .into_bytes();
        out.push(b'\n');
        if let Ok(journal) = std::process::Command::new("journalctl")
            .args(["-b", "--no-pager", "-o", "short-monotonic"])
            .output()
        {
            if journal.status.success() {
                out.extend_from_slice(b"--- journal of this boot ---\n");
                out.extend_from_slice(&journal.stdout);
            }
        }
        if out.len() > MAX_FAILURE_LOGS {
            out.drain(..out.len() - MAX_FAILURE_LOGS);
        }
        out
    }
}

#[tonic::async_trait]
impl InitService for InitServer {
    type InitStream = ReceiverStream<Result<InitResponse, tonic::Status>>;

    async fn init(
        &self,
        request: tonic::Request<InitRequest>,
    ) -> Result<tonic::Response<Self::InitStream>, tonic::Status> {
        let accepted = match self.accept(request.into_inner()).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %keel_atls::ErrorChain(&e), "init refused");
                return Err((&e).into());
            }
        };
        match self.inner.lock.try_lock(accepted.cluster_id) {
            Ok(()) => {}
            Err(LockError::AlreadyLocked) => return Err((&InitError::Locked).into()),
            Err(e) => return Err((&InitError::Lock(e)).into()),
        }
        tracing::info!(cluster_id = %hex::encode(accepted.cluster_id), "node locked for init");
        let (tx, rx) = mpsc::channel(64);
        let log = Transcript {
            tx,
            lines: Arc::default(),
        };
        let server = self.clone();
        tokio::spawn(async move {
            log.line(format!(
                "node locked into cluster {}",
                hex::encode(accepted.cluster_id)
            ))
            .await;
            match server.create_cluster(&accepted, &log).await {
                Ok((kubeconfig, state)) => {
                    log.line("cluster created").await;
                    server.inner.cluster.send_replace(Some(Arc::new(state)));
                    log.send(Kind::Success(InitSuccess {
                        kubeconfig,
                        cluster_id: accepted.cluster_id.to_vec(),
                    }))
                    .await;
                }
                Err(error) => {
                    tracing::error!(%error, "init failed after the node lock");
                    log.line(format!("init failed: {error}")).await;
                    let node_reset = server.fail(&log).await;
                    log.send(Kind::Failure(InitFailure { error, node_reset }))
                        .await;
                    for chunk in log.collected_logs().chunks(LOG_CHUNK) {
                        log.send(Kind::LogChunk(chunk.to_vec())).await;
                    }
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}
