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

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use keel_installer::{Component, Installer, InstallerConfig, KubernetesVersion, LogProgress};
use keel_proto::init::init_response::Kind;
use keel_proto::init::init_service_server::{InitService, InitServiceServer};
use keel_proto::init::{InitFailure, InitRequest, InitResponse, InitSecrets, InitSuccess};
use keel_verifier::config::NodeConfig;
use keel_verifier::measurements::Measurements;
use prost::Message as _;
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio_stream::wrappers::ReceiverStream;
use zeroize::Zeroizing;

use crate::address::AdvertiseAddress;
use crate::attestation::credential;
use crate::cluster::{ClusterSlot, ClusterState};
use crate::components::install_and_measure;
use crate::disk::StateDisk;
use crate::key_service::{self, KeyService};
use crate::kubeadm::{self, BootstrapToken, InitConfig, Kubeadm};
use crate::measured::SharedTpm;
use crate::nodelock::{LockError, NodeLock};
use crate::throttle::FailureThrottle;

/// Most bytes of node logs sent after a failure.
const MAX_FAILURE_LOGS: usize = 1024 * 1024;
/// Size of one log chunk on the stream.
const LOG_CHUNK: usize = 32 * 1024;
/// Messages the init stream holds for a slow client; lines beyond it are
/// dropped (and counted) rather than waited for.
const STREAM_BUFFER: usize = 256;
/// Longest log line streamed or kept; longer ones are cut.
const MAX_LINE: usize = 16 * 1024;
/// How long the final message (and after a failure, the log chunks) may
/// wait for a client that does not read, in all.
const FINAL_WAIT: Duration = Duration::from_secs(30);
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
    Sealed(#[source] keel_verifier::credential::CredentialError),
    /// The node is already locked.
    #[error("the node is already part of a cluster")]
    Locked,
    /// Taking the lock failed for another reason.
    #[error("taking the node lock failed")]
    Lock(#[source] LockError),
    /// The TPM could not be used.
    #[error("the TPM is unavailable")]
    Tpm,
    /// The peer sent wrong init secrets and must wait this many seconds.
    #[error("too many wrong init secrets from this address; retry in {0} s")]
    Throttled(u64),
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
            InitError::Throttled(_) => tonic::Code::ResourceExhausted,
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
    throttle: FailureThrottle,
    opening: tokio::sync::Mutex<()>,
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
                throttle: FailureThrottle::default(),
                opening: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// The tonic service.
    pub fn into_service(self) -> InitServiceServer<Self> {
        InitServiceServer::new(self)
    }

    /// Checks `request` completely, without side effects.
    async fn accept(
        &self,
        request: InitRequest,
        peer: Option<IpAddr>,
    ) -> Result<Accepted, InitError> {
        let config = &self.inner.config;
        if config.cluster.init_secret_hash.is_empty() {
            return Err(InitError::NotInitNode);
        }
        // One request at a time is opened (each costs a TPM operation), and
        // an address that sent wrong init secrets waits, doubling per failure.
        let _one_at_a_time = self.inner.opening.lock().await;
        if let Some(ip) = peer {
            self.inner
                .throttle
                .check(ip)
                .map_err(|wait| InitError::Throttled(wait.as_secs().max(1)))?;
        }
        let sealed = request
            .secrets
            .ok_or_else(|| InitError::InvalidRequest("sealed secrets missing".into()))?;
        let tpm = self.inner.tpm.clone();
        let opened = tokio::task::spawn_blocking(move || {
            let mut guard = tpm.lock().map_err(|_| InitError::Tpm)?;
            credential::open(guard.tpm(), &sealed).map_err(InitError::Sealed)
        })
        .await
        .map_err(|_| InitError::Tpm)??;
        let secrets = InitSecrets::decode(opened.as_slice())
            .map_err(|_| InitError::InvalidRequest("sealed secrets do not decode".into()))?;
        let secrets = SecretsGuard(secrets);
        if !config.init_secret_matches(&secrets.0.init_secret) {
            if let Some(ip) = peer {
                let (failures, wait) = self.inner.throttle.failed(ip);
                tracing::warn!(
                    peer = %ip,
                    failures,
                    wait_s = wait.as_secs_f64(),
                    "init refused: wrong init secret"
                );
            }
            return Err(InitError::WrongInitSecret);
        }
        if let Some(ip) = peer {
            self.inner.throttle.succeeded(ip);
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
        let keys = KeyService::new(&secrets.0.master_secret, &request.master_salt)
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
            ));
            let done = setup_state_disk(disk, &a.keys).await?;
            log.line(done);
        } else {
            log.line("no state disk configured; skipping disk encryption");
        }

        log.line(format!(
            "installing {} components for Kubernetes {}",
            a.components.len(),
            a.version
        ));
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
        log.line(format!("advertising {advertise_address}"));
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
        log.line("running kubeadm init");
        // Streaming a line never waits for the client, so kubeadm's output
        // goes straight to the transcript.
        let mut on_line = |line: &str| log.line(line);
        let result = env.kubeadm.init(&config_path, &mut on_line).await;
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
            log.line(line);
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
///
/// Streaming never holds the node up. A line that does not fit into the
/// stream's buffer ([`STREAM_BUFFER`] messages: the client is not reading)
/// is dropped and counted, and once there is room again one line says how
/// many were dropped. The final message, and after a failure the collected
/// logs, wait for room, at most [`FINAL_WAIT`] in all. The kept lines are
/// bounded to the [`MAX_FAILURE_LOGS`] most recent bytes.
#[derive(Clone)]
struct Transcript {
    tx: mpsc::Sender<Result<InitResponse, tonic::Status>>,
    state: Arc<Mutex<TranscriptState>>,
}

#[derive(Default)]
struct TranscriptState {
    kept: VecDeque<String>,
    kept_bytes: usize,
    /// Lines not streamed since the last one that was.
    dropped: u64,
}

impl TranscriptState {
    fn keep(&mut self, line: String) {
        self.kept_bytes += line.len() + 1;
        self.kept.push_back(line);
        while self.kept_bytes > MAX_FAILURE_LOGS {
            match self.kept.pop_front() {
                Some(old) => self.kept_bytes -= old.len() + 1,
                None => break,
            }
        }
    }
}

/// The line that stands for `n` lines the client did not get.
fn dropped_marker(n: u64) -> Kind {
    Kind::LogLine(format!("… {n} log lines dropped (client not reading)"))
}

fn message(kind: Kind) -> Result<InitResponse, tonic::Status> {
    Ok(InitResponse { kind: Some(kind) })
}

/// `line` cut to at most [`MAX_LINE`] bytes, on a character boundary.
fn bounded_line(mut line: String) -> String {
    if line.len() > MAX_LINE {
        let mut end = MAX_LINE;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push_str(" [cut]");
    }
    line
}

impl Transcript {
    /// A transcript streaming to a new channel, and that channel's receiver.
    fn new() -> (Self, mpsc::Receiver<Result<InitResponse, tonic::Status>>) {
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let transcript = Self {
            tx,
            state: Arc::default(),
        };
        (transcript, rx)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TranscriptState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Logs, keeps and streams `line`, without waiting for the client.
    fn line(&self, line: impl Into<String>) {
        let line = bounded_line(line.into());
        tracing::info!(target: "keel_agent::init", "{line}");
        let mut state = self.state();
        state.keep(line.clone());
        // A gone client does not stop the init: the node finishes (or
        // fails) either way.
        if state.dropped > 0 {
            match self.tx.try_send(message(dropped_marker(state.dropped))) {
                Ok(()) => state.dropped = 0,
                Err(TrySendError::Full(_)) => {
                    state.dropped += 1;
                    return;
                }
                Err(TrySendError::Closed(_)) => return,
            }
        }
        if let Err(TrySendError::Full(_)) = self.tx.try_send(message(Kind::LogLine(line))) {
            state.dropped += 1;
        }
    }

    /// Streams the closing `messages` (after a marker for dropped lines),
    /// waiting for room at most [`FINAL_WAIT`] in all. Returns whether the
    /// client got them all.
    async fn finish(&self, messages: impl IntoIterator<Item = Kind>) -> bool {
        let deadline = tokio::time::Instant::now() + FINAL_WAIT;
        let dropped = std::mem::take(&mut self.state().dropped);
        let marker = (dropped > 0).then(|| dropped_marker(dropped));
        for kind in marker.into_iter().chain(messages) {
            match tokio::time::timeout_at(deadline, self.tx.send(message(kind))).await {
                Ok(Ok(())) => {}
                // The client is gone.
                Ok(Err(_)) => return false,
                Err(_) => {
                    tracing::warn!(
                        wait = ?FINAL_WAIT,
                        "the init client is not reading; the rest of its stream is dropped"
                    );
                    return false;
                }
            }
        }
        true
    }

    /// The node's logs: this transcript, then the journal of this boot where there is one.
    fn collected_logs(&self) -> Vec<u8> {
        let mut out: Vec<u8> = {
            let state = self.state();
            let mut text = String::with_capacity(state.kept_bytes);
            for line in &state.kept {
                text.push_str(line);
                text.push('\n');
            }
            text.into_bytes()
        };
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
        let peer = request
            .extensions()
            .get::<keel_atls::PeerInfo<()>>()
            .and_then(keel_atls::PeerInfo::remote_addr)
            .map(|a| a.ip());
        let accepted = match self.accept(request.into_inner(), peer).await {
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
        let (log, rx) = Transcript::new();
        let server = self.clone();
        tokio::spawn(async move {
            log.line(format!(
                "node locked into cluster {}",
                hex::encode(accepted.cluster_id)
            ));
            match server.create_cluster(&accepted, &log).await {
                Ok((kubeconfig, state)) => {
                    log.line("cluster created");
                    server.inner.cluster.send_replace(Some(Arc::new(state)));
                    log.finish([Kind::Success(InitSuccess {
                        kubeconfig,
                        cluster_id: accepted.cluster_id.to_vec(),
                    })])
                    .await;
                }
                Err(error) => {
                    tracing::error!(%error, "init failed after the node lock");
                    log.line(format!("init failed: {error}"));
                    let node_reset = server.fail(&log).await;
                    let logs = log.collected_logs();
                    let chunks: Vec<Kind> = logs
                        .chunks(LOG_CHUNK)
                        .map(|chunk| Kind::LogChunk(chunk.to_vec()))
                        .collect();
                    log.finish(
                        std::iter::once(Kind::Failure(InitFailure { error, node_reset }))
                            .chain(chunks),
                    )
                    .await;
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    type Rx = mpsc::Receiver<Result<InitResponse, tonic::Status>>;

    fn drain(rx: &mut Rx) -> Vec<Kind> {
        let mut out = Vec::new();
        while let Ok(m) = rx.try_recv() {
            out.push(m.unwrap().kind.unwrap());
        }
        out
    }

    fn text(kind: &Kind) -> &str {
        match kind {
            Kind::LogLine(line) => line,
            other => panic!("not a log line: {other:?}"),
        }
    }

    fn fill(log: &Transcript, n: usize) {
        for i in 0..n {
            log.line(format!("line {i}"));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lines_to_a_client_that_does_not_read_are_dropped_and_counted() {
        let (log, mut rx) = Transcript::new();
        let total = 4 * STREAM_BUFFER;
        fill(&log, total);
        let got = drain(&mut rx);
        assert_eq!(got.len(), STREAM_BUFFER);
        assert_eq!(text(&got[0]), "line 0");
        assert_eq!(
            text(&got[STREAM_BUFFER - 1]),
            format!("line {}", STREAM_BUFFER - 1)
        );

        // Once the client reads again it learns how much it missed.
        log.line("after");
        let got = drain(&mut rx);
        let missed = total - STREAM_BUFFER;
        assert_eq!(
            got.iter().map(text).collect::<Vec<_>>(),
            [
                format!("… {missed} log lines dropped (client not reading)").as_str(),
                "after"
            ]
        );
        // The failure report still has every line.
        assert_eq!(log.state().kept.len(), total + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_final_message_reaches_a_client_that_reads_late() {
        let (log, mut rx) = Transcript::new();
        fill(&log, STREAM_BUFFER + 10);
        let reader = tokio::spawn(async move {
            tokio::time::sleep(FINAL_WAIT / 2).await;
            let mut all = Vec::new();
            while let Some(m) = rx.recv().await {
                all.push(m.unwrap().kind.unwrap());
            }
            all
        });
        let delivered = log
            .finish([Kind::Success(InitSuccess {
                kubeconfig: b"kubeconfig".to_vec(),
                cluster_id: vec![1; 32],
            })])
            .await;
        assert!(delivered);
        drop(log);
        let all = reader.await.unwrap();
        assert_eq!(all.len(), STREAM_BUFFER + 2);
        assert_eq!(
            text(&all[STREAM_BUFFER]),
            "… 10 log lines dropped (client not reading)"
        );
        assert!(
            matches!(all.last(), Some(Kind::Success(s)) if s.kubeconfig == b"kubeconfig"),
            "{:?}",
            all.last()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_closing_messages_give_up_on_a_client_that_does_not_read() {
        let (log, rx) = Transcript::new();
        fill(&log, STREAM_BUFFER);
        let started = tokio::time::Instant::now();
        let chunks = (0..100).map(|_| Kind::LogChunk(vec![0; LOG_CHUNK]));
        let failure = Kind::Failure(InitFailure {
            error: "kubeadm init: failed".into(),
            node_reset: true,
        });
        let delivered = log.finish(std::iter::once(failure).chain(chunks)).await;
        assert!(!delivered);
        let waited = started.elapsed();
        assert!(
            waited >= FINAL_WAIT && waited < FINAL_WAIT + Duration::from_secs(1),
            "{waited:?}"
        );
        drop(rx);
    }

    #[tokio::test(start_paused = true)]
    async fn a_gone_client_costs_nothing() {
        let (log, rx) = Transcript::new();
        drop(rx);
        fill(&log, 2 * STREAM_BUFFER);
        let started = tokio::time::Instant::now();
        assert!(!log.finish([Kind::LogChunk(vec![1])]).await);
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(
            log.state().dropped,
            0,
            "nothing is counted for a gone client"
        );
    }

    #[test]
    fn long_lines_are_cut_and_kept_logs_are_bounded() {
        let (log, mut rx) = Transcript::new();
        log.line("é".repeat(MAX_LINE));
        let got = drain(&mut rx);
        let line = text(&got[0]);
        assert!(line.len() <= MAX_LINE + " [cut]".len(), "{}", line.len());
        assert!(line.ends_with(" [cut]"));

        let mut state = TranscriptState::default();
        for _ in 0..(3 * MAX_FAILURE_LOGS / 1000) {
            state.keep("x".repeat(999));
        }
        assert!(state.kept_bytes <= MAX_FAILURE_LOGS);
        assert_eq!(
            state.kept_bytes,
            state.kept.iter().map(|l| l.len() + 1).sum::<usize>()
        );
        assert!(state.kept_bytes > MAX_FAILURE_LOGS - 1000);
    }
}
