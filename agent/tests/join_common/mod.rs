//! A join service and joining nodes for tests and the join benchmark: each
//! party has its own swtpm with an EK certificate from one test CA; the
//! service runs over real mutual aTLS on loopback; bootstrap tokens are
//! registered with the `keel-standin` kubeadm.
//!
//! The service's cluster is made here rather than by `keel init` (the CLI
//! tests do that): a random master secret, a cluster CA made with rcgen in
//! `etc/kubernetes/pki`, and the service node locked into the cluster ID,
//! so its PCR 15 is what a joining node expects.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel_agent::address::AdvertiseAddress;
use keel_agent::attestation::cpu::CpuReporter;
use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::attestation::policy::ReloadableValidator;
use keel_agent::backoff::Backoff;
use keel_agent::cluster::{ClusterSlot, ClusterState};
use keel_agent::disk::Cryptsetup;
use keel_agent::disk::StateDisk;
use keel_agent::disk_bindings::DiskBindings;
use keel_agent::init::InitServer;
use keel_agent::join::JoinService;
use keel_agent::join::{service_validator, TicketClient};
use keel_agent::join::{JoinClient, JoinSettings};
use keel_agent::kubeadm::Kubeadm;
use keel_agent::measured::{MeasuredTpm, SharedTpm};
use keel_agent::nodelock::NodeLock;
use keel_agent::provision::{KubeletStart, Node, NodeEnv};
use keel_agent::reboot::RebootPolicy;
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_installer::{Component, InstallerConfig};
use keel_proto::attestation::SealedSecret;
use keel_testkit::components::{stand_in_set_with, KubeExecutables};
use keel_testkit::mirror::MirrorServer;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::cpu::CpuTrust;
use keel_verifier::credential;
use keel_verifier::ek::EkTrust;
use keel_verifier::keys::{self as key_service, KeyService};
use keel_verifier::measurement::EventType;
use keel_verifier::measurements::{Expected, Measurements};
use keel_verifier::tpm_wire::Public;
use rand::RngCore as _;

/// The digest of the EK of the TPM behind `tpm`: what its disk keys are
/// bound to.
pub fn ek_digest(tpm: &SharedTpm) -> keel_verifier::ek::EkDigest {
    keel_agent::attestation::shared_own_ek_digest(tpm).unwrap()
}

/// Measurements enforcing the current values of `pcrs` in `tpm`: what a
/// verifier that knows this very node expects.
pub fn measurements_of(tpm: &SharedTpm, pcrs: &[u32]) -> Measurements {
    let values = tpm.lock().unwrap().tpm().pcr_read(pcrs).unwrap();
    Measurements::new(values.into_iter().map(|(i, v)| (i, Expected::enforced(v)))).unwrap()
}

/// A free port ([`keel_testkit::free_port`]).
pub fn free_port() -> u16 {
    keel_testkit::free_port().unwrap()
}

/// The node config of one member: the cluster part is the same for all.
pub fn config(ca: &EkCa, join_port: u16, name: &str, role: &str) -> NodeConfig {
    config_for(ca, &[join_port], name, role)
}

/// [`config`] for a cluster whose control planes serve joins on `ports`.
pub fn config_for(ca: &EkCa, join_ports: &[u16], name: &str, role: &str) -> NodeConfig {
    let ek_ca = String::from_utf8(ca.issuer_pem().unwrap()).unwrap();
    let endpoints: Vec<String> = join_ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let doc = serde_json::json!({
        "cluster": {
            "control_plane_endpoints": endpoints,
            "ek_ca_pem": ek_ca,
        },
        "node": {"name": name, "role": role},
    });
    NodeConfig::parse(doc.to_string().as_bytes(), "test".as_ref()).unwrap()
}

/// Opens `swtpm` and measures `config` as the agent does at start.
pub fn measured(swtpm: &Swtpm, log: &Path, config: &NodeConfig) -> SharedTpm {
    measured_with(swtpm, log, config, None)
}

/// [`measured`] with a source of CPU evidence (the hardware variants).
pub fn measured_with(
    swtpm: &Swtpm,
    log: &Path,
    config: &NodeConfig,
    cpu: Option<Arc<dyn CpuReporter>>,
) -> SharedTpm {
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let mut m = MeasuredTpm::open(tpm, log).unwrap();
    if let Some(cpu) = cpu {
        m = m.with_cpu_reporter(cpu);
    }
    m.record(EventType::NodeConfig, "config", config.cluster_bytes())
        .unwrap();
    m.record(EventType::NodeIdentity, "node", config.node_bytes())
        .unwrap();
    m.shared()
}

/// Measurements for swtpm nodes with `config`'s cluster part, all enforced:
/// PCRs 4, 9 and 11 are zero there (no firmware or stub measures into
/// them), PCR 12 is the config's.
pub fn boot_measurements(config: &NodeConfig) -> Measurements {
    boot_measurements_with(config, [])
}

/// [`boot_measurements`] with `extra` entries added or replacing.
pub fn boot_measurements_with(
    config: &NodeConfig,
    extra: impl IntoIterator<Item = (u32, Expected)>,
) -> Measurements {
    let mut entries: BTreeMap<u32, Expected> = [4, 9, 11]
        .into_iter()
        .map(|pcr| (pcr, Expected::enforced([0; 32])))
        .collect();
    entries.insert(
        keel_verifier::measurement::pcr::CONFIG,
        Expected::enforced(config.expected_config_pcr()),
    );
    entries.extend(extra);
    Measurements::new(entries).unwrap()
}

/// PCRs 4, 9 and 11 of an image other than the swtpm nodes' (zero there,
/// as nothing measures into them).
pub fn newer_image() -> BTreeMap<u32, [u8; 32]> {
    keel_agent::cluster::IMAGE_PCRS
        .into_iter()
        .map(|pcr| (pcr, [0x4e; 32]))
        .collect()
}

/// A running join service.
pub struct Service {
    /// `127.0.0.1:port`.
    pub endpoint: String,
    /// The cluster it serves (as started).
    pub state: Arc<ClusterState>,
    /// The cluster slot its tickets follow (the operator API changes it).
    pub slot: Arc<ClusterSlot>,
    /// Its validator (reloadable).
    pub policy: Arc<ReloadableValidator>,
    /// The measurements file behind `policy`.
    pub measurements: PathBuf,
    /// The stand-in kubeadm's root (token records under `var/lib/keel-standin/tokens`).
    pub root: PathBuf,
    pub config: NodeConfig,
    pub tpm: SharedTpm,
    /// The stand-in kubeadm's extra environment.
    kubeadm_env: Vec<(String, String)>,
    /// The image it serves as, if not its TPM's ([`Service::serving_older_members`]).
    own_image: Option<BTreeMap<u32, [u8; 32]>>,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
    _swtpm: Swtpm,
}

impl Service {
    /// The process ID of its swtpm.
    pub fn swtpm_pid(&self) -> Option<u32> {
        self._swtpm.pid()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Service {
    /// The join service's work directory (token files; the tmpfs
    /// `/run/keel` on a node).
    pub fn work_dir(&self) -> PathBuf {
        self._dir.path().join("work")
    }

    /// This service as on a control plane of a newer image than its
    /// members ([`newer_image`]; an upgrade from a release whose agent
    /// joins with a bootstrap token): a ticket request without file
    /// discovery then gets a token, as such a member's does. Restarts it.
    pub async fn serving_older_members(&mut self) {
        self.own_image = Some(newer_image());
        // The cluster stages the newer image, this control plane's own,
        // while its members still run the older: an upgrade under way.
        let current = self.slot.borrow().clone().unwrap_or(self.state.clone());
        let mut upgrading = (*current).clone();
        let newer = newer_image()
            .into_iter()
            .map(|(pcr, value)| (pcr, Expected::enforced(value)));
        upgrading.staged_measurements = Some(boot_measurements_with(&self.config, newer));
        self.slot.send_replace(Some(Arc::new(upgrading)));
        self.restart().await;
    }

    /// Stops the join service (its node stays up).
    pub async fn stop(&mut self) {
        self.task.abort();
        let stopped = std::mem::replace(&mut self.task, tokio::spawn(async {}));
        let _ = stopped.await;
    }

    /// Stops the join service and starts a new one on the same port, over
    /// the same cluster and work directory: what an agent restart serves.
    pub async fn restart(&mut self) {
        self.restart_with(|service| service).await;
    }

    /// [`Service::restart`], the new service made by `adjust` from the one
    /// an agent restart serves.
    pub async fn restart_with(&mut self, adjust: impl FnOnce(JoinService) -> JoinService) {
        self.stop().await;
        let addr: SocketAddr = self.endpoint.parse().unwrap();
        // The listener goes with the server's accept task, aborted in turn.
        for _ in 0..250 {
            if std::net::TcpListener::bind(addr).is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut kubeadm = standin_kubeadm(&self.root);
        kubeadm.env.extend_from_slice(&self.kubeadm_env);
        let own_image = match &self.own_image {
            Some(image) => image.clone(),
            None => keel_agent::cluster::own_image(&self.tpm).await.unwrap(),
        };
        let service = JoinService::new(
            self.state.clone(),
            kubeadm,
            self.work_dir(),
            Arc::new(DiskBindings::new(&self.root)),
            own_image,
        )
        .unwrap()
        .following(&self.slot)
        .with_registry(
            keel_agent::registry::RegistryStore::shared(&self.root).unwrap(),
            keel_agent::attestation::shared_own_ek_digest(&self.tpm).unwrap(),
        );
        let service = adjust(service);
        self.task = tokio::spawn({
            let (tpm, policy) = (self.tpm.clone(), self.policy.clone());
            async move {
                keel_agent::node::serve_join(addr, tpm, policy, service)
                    .await
                    .unwrap();
            }
        });
        wait_for_port(addr).await;
    }

    /// Bootstrap tokens the stand-in recorded.
    pub fn registered_tokens(&self) -> Vec<String> {
        let dir = self.root.join("var/lib/keel-standin/tokens");
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        entries
            .map(|e| {
                let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
                text.split_whitespace().next().unwrap().to_owned()
            })
            .collect()
    }
}

/// The `keel-standin` program, when not found next to a test binary (the
/// benchmark is an example and builds it itself).
pub static STANDIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// A `kubeadm` that is the stand-in (a symlink, so it runs as `kubeadm`).
pub fn standin_kubeadm(root: &Path) -> Kubeadm {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let standin = STANDIN
        .get()
        .cloned()
        .unwrap_or_else(|| keel_testkit::components::standin_binary().unwrap());
    let link = bin.join("kubeadm");
    if !link.exists() {
        std::os::unix::fs::symlink(standin, &link).unwrap();
    }
    let mut kubeadm = Kubeadm::new(&bin);
    kubeadm.root = root.to_owned();
    kubeadm.env = vec![(
        "KEEL_STANDIN_ROOT".into(),
        root.to_string_lossy().into_owned(),
    )];
    kubeadm
}

/// Starts a join service on `port` for a new cluster; the service node is
/// `cp-0` with the cluster config of `port`. Tickets name the versions
/// table's components (never installed by the tests that use this).
pub async fn start_service(ca: &EkCa, port: u16) -> Service {
    start_service_with(ca, port, None, false).await
}

/// [`start_service`] with the ticket's components (`None`: the versions
/// table's); `foreign_lock` locks the service node into another cluster
/// than the one it serves, so its attestation does not match its tickets.
pub async fn start_service_with(
    ca: &EkCa,
    port: u16,
    components: Option<Vec<Component>>,
    foreign_lock: bool,
) -> Service {
    start_service_for(ca, &[port], components, foreign_lock).await
}

/// [`start_service_with`] for a cluster whose control planes serve joins
/// on `ports`; this one listens on the first.
pub async fn start_service_for(
    ca: &EkCa,
    ports: &[u16],
    components: Option<Vec<Component>>,
    foreign_lock: bool,
) -> Service {
    start_service_on(ca, ports, components, foreign_lock, None).await
}

/// A node's CPU (its evidence) and what its verifiers trust of CPUs.
pub struct Hardware {
    /// The node's source of CPU evidence.
    pub reporter: Arc<dyn CpuReporter>,
    /// The variant and roots the verifiers require.
    pub trust: Arc<CpuTrust>,
}

/// [`start_service`] on a node whose documents carry CPU evidence and whose
/// policy requires it of joining nodes.
pub async fn start_service_hardware(ca: &EkCa, port: u16, hardware: &Hardware) -> Service {
    start_service_on(ca, &[port], None, false, Some(hardware)).await
}

/// [`start_service`] whose stand-in kubeadm takes `secs` seconds to
/// register each batch of bootstrap tokens.
pub async fn start_service_slow_tokens(ca: &EkCa, port: u16, secs: u64) -> Service {
    let swtpm = Swtpm::start(ca).unwrap();
    let config = config_for(ca, &[port], "cp-0", "control-plane");
    let env = [("KEEL_STANDIN_SLEEP".to_owned(), secs.to_string())];
    start_service_node(port, config, swtpm, None, false, None, &env).await
}

async fn start_service_on(
    ca: &EkCa,
    ports: &[u16],
    components: Option<Vec<Component>>,
    foreign_lock: bool,
    hardware: Option<&Hardware>,
) -> Service {
    // The CA's certificates (in the config) exist once it made a TPM.
    let swtpm = Swtpm::start(ca).unwrap();
    let config = config_for(ca, ports, "cp-0", "control-plane");
    start_service_node(
        ports[0],
        config,
        swtpm,
        components,
        foreign_lock,
        hardware,
        &[],
    )
    .await
}

/// [`start_service_for`] with the node config `config` (its cluster part
/// is every member's) and the TPM `swtpm`, listening on `port`.
pub async fn start_service_config(
    port: u16,
    config: NodeConfig,
    swtpm: Swtpm,
    components: Option<Vec<Component>>,
    foreign_lock: bool,
) -> Service {
    start_service_node(port, config, swtpm, components, foreign_lock, None, &[]).await
}

async fn start_service_node(
    port: u16,
    config: NodeConfig,
    swtpm: Swtpm,
    components: Option<Vec<Component>>,
    foreign_lock: bool,
    hardware: Option<&Hardware>,
    kubeadm_env: &[(String, String)],
) -> Service {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let tpm = measured_with(
        &swtpm,
        &dir.path().join("log"),
        &config,
        hardware.map(|h| h.reporter.clone()),
    );

    let random = |n: usize| {
        let mut v = vec![0u8; n];
        rand::rngs::OsRng.fill_bytes(&mut v);
        v
    };
    let keys = KeyService::new(&random(32), &random(32)).unwrap();
    let measurement_secret = keys.measurement_secret().unwrap();
    let measurement_salt = random(32);
    let cluster_id = key_service::cluster_id(&measurement_secret, &measurement_salt).unwrap();
    let lock_id = if foreign_lock { [0x5a; 32] } else { cluster_id };
    NodeLock::new(tpm.clone())
        .unwrap()
        .try_lock(lock_id)
        .unwrap();

    let pki = root.join("etc/kubernetes/pki");
    std::fs::create_dir_all(&pki).unwrap();
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kubernetes");
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = params.self_signed(&ca_key).unwrap();
    std::fs::write(pki.join("ca.crt"), ca_cert.pem()).unwrap();
    std::fs::write(pki.join("ca.key"), ca_key.serialize_pem()).unwrap();
    std::fs::write(root.join("etc/kubernetes/admin.conf"), "apiVersion: v1\n").unwrap();

    let entry = keel_installer::resolve("v1.31").unwrap();
    let state = Arc::new(ClusterState {
        keys: Arc::new(keys),
        measurement_salt,
        measurement_secret,
        cluster_id,
        kubernetes_version: entry.version(),
        components: components.unwrap_or_else(|| entry.components().to_vec()),
        authorised_components: Vec::new(),
        api_server: "127.0.0.1:6443".parse().unwrap(),
        pki_dir: pki,
        join_measurements: boot_measurements(&config),
        staged_measurements: None,
        measurements_key: None,
        signed_measurements: Vec::new(),
        image_epoch: 0,
        control_plane_endpoints: config.cluster.control_plane_endpoints.clone(),
    });

    let measurements = dir.path().join("measurements.json");
    std::fs::write(&measurements, boot_measurements(&config).to_json()).unwrap();
    let mut policy = keel_agent::node::join_service_policy(&config, &measurements).unwrap();
    if let Some(h) = hardware {
        let only = Arc::try_unwrap(policy).ok().unwrap();
        policy = Arc::new(only.with_cpu(h.trust.clone()));
    }
    let slot = Arc::new(ClusterSlot::new(Some(state.clone())));
    let mut kubeadm = standin_kubeadm(&root);
    kubeadm.env.extend_from_slice(kubeadm_env);
    let service = JoinService::new(
        state.clone(),
        kubeadm,
        dir.path().join("work"),
        Arc::new(DiskBindings::new(&root)),
        // As on a control plane: no bootstrap token for a node of its image.
        keel_agent::cluster::own_image(&tpm).await.unwrap(),
    )
    .unwrap()
    .following(&slot)
    // As on a control plane: each ticket is recorded in the node registry.
    .with_registry(
        keel_agent::registry::RegistryStore::shared(&root).unwrap(),
        keel_agent::attestation::shared_own_ek_digest(&tpm).unwrap(),
    );
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let task = tokio::spawn({
        let (tpm, policy) = (tpm.clone(), policy.clone());
        async move {
            keel_agent::node::serve_join(addr, tpm, policy, service)
                .await
                .unwrap();
        }
    });
    wait_for_port(addr).await;
    Service {
        endpoint: addr.to_string(),
        state,
        slot,
        policy,
        measurements,
        root,
        config,
        tpm,
        kubeadm_env: kubeadm_env.to_vec(),
        own_image: None,
        task,
        _dir: dir,
        _swtpm: swtpm,
    }
}

/// Waits until something listens on `addr` (at most 5 s).
pub async fn wait_for_port(addr: SocketAddr) {
    for _ in 0..250 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("nothing listens on {addr}");
}

/// A joining node's TPM, with its config measured.
pub struct Member {
    pub name: String,
    pub config: NodeConfig,
    pub tpm: SharedTpm,
    _dir: tempfile::TempDir,
    _swtpm: Swtpm,
}

impl Member {
    /// The process ID of its swtpm.
    pub fn swtpm_pid(&self) -> Option<u32> {
        self._swtpm.pid()
    }

    /// The same TPM rebooted (PCRs reset, same EK) with `config`: as when
    /// the host rewrites the node part of the config and reboots the VM.
    pub fn rebooted_with(self, config: NodeConfig) -> Member {
        let Member {
            tpm, mut _swtpm, ..
        } = self;
        drop(tpm);
        _swtpm.restart().unwrap();
        member_on(_swtpm, config)
    }
}

/// A fresh member `name` of the cluster whose join service is on `port`.
pub fn member(ca: &EkCa, port: u16, name: &str, role: &str) -> Member {
    // The TPM first: the CA's certificate, which the config names, exists
    // once it manufactured one.
    let swtpm = Swtpm::start(ca).unwrap();
    member_on(swtpm, config(ca, port, name, role))
}

/// A fresh member with `config` (of a CA that manufactured a TPM).
pub fn member_with(ca: &EkCa, config: NodeConfig) -> Member {
    member_on(Swtpm::start(ca).unwrap(), config)
}

fn member_on(swtpm: Swtpm, config: NodeConfig) -> Member {
    let dir = tempfile::tempdir().unwrap();
    let tpm = measured(&swtpm, &dir.path().join("log"), &config);
    Member {
        name: config.node.name.clone(),
        config,
        tpm,
        _dir: dir,
        _swtpm: swtpm,
    }
}

impl Member {
    /// A ticket client validating the service as the join client does.
    pub fn tickets(&self, ca: &EkCa) -> TicketClient {
        let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
        let validator = service_validator(&self.tpm, trust, None).unwrap();
        TicketClient::new(self.tpm.clone(), validator, Duration::from_secs(60))
    }
}

/// A random version-4 UUID.
pub fn uuid() -> String {
    keel_agent::disk::new_uuid()
}

/// Resident set size of this process in KiB.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// The Kubernetes version of the stand-in components.
pub const VERSION: &str = "v1.31.13";

/// Stand-in components on `mirror`, installed under each node's root.
pub fn stand_in_components(mirror: &MirrorServer) -> Vec<Component> {
    stand_in_set_with(
        mirror,
        Path::new("/"),
        VERSION,
        &KubeExecutables::standin().unwrap(),
    )
    .unwrap()
    .into_iter()
    .map(|c| Component::try_from(c).unwrap())
    .collect()
}

/// The environment of a node under `root`: components install there,
/// kubeadm is the installed stand-in, the state disk is `disk`.
pub fn node_env(root: &Path, work: &Path, disk: Option<&Path>) -> NodeEnv {
    let installer = InstallerConfig {
        root: root.to_owned(),
        kept: Some(keel_installer::InstallPath::new(keel_agent::paths::KEPT_COMPONENTS).unwrap()),
        ..InstallerConfig::default()
    };
    let mut kubeadm = Kubeadm::new(&root.join("run/state/bin"));
    kubeadm.root = root.to_owned();
    kubeadm.env = vec![
        (
            "KEEL_STANDIN_ROOT".into(),
            root.to_string_lossy().into_owned(),
        ),
        ("KEEL_STANDIN_VERSION".into(), VERSION.into()),
    ];
    kubeadm.join_backoff = Duration::from_millis(100);
    NodeEnv {
        installer,
        kubeadm,
        work_dir: work.to_owned(),
        advertise_address: AdvertiseAddress::Fixed("127.0.0.1".parse().unwrap()),
        // No device-mapper here: the disk is formatted and its key checked.
        state_disk: disk.map(|d| StateDisk {
            device: d.to_owned(),
            cryptsetup: Cryptsetup::default(),
            mount: None,
        }),
        kubelet: KubeletStart::Program(root.join("run/state/bin/kubelet")),
        reboot: RebootPolicy::Never,
    }
}

/// A node that joins: its own swtpm, root, work directory and a 20 MiB
/// state-disk image file.
pub struct Joiner {
    pub config: NodeConfig,
    pub tpm: SharedTpm,
    pub lock: Arc<NodeLock>,
    pub root: PathBuf,
    pub work: PathBuf,
    pub disk: PathBuf,
    pub dir: NodeDir,
}

/// What of a node outlives its reboot: its directory (root, work
/// directory, state disk image, event logs) and its TPM.
pub struct NodeDir {
    // Declared first: stopped before the directory goes.
    swtpm: Swtpm,
    dir: tempfile::TempDir,
    boots: usize,
}

impl NodeDir {
    /// The node's directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The node's TPM.
    pub fn swtpm(&self) -> &Swtpm {
        &self.swtpm
    }
}

/// A joining node `name` with a TPM whose EK certificate comes from `tpm_ca`
/// (the cluster's CA, or another one for an untrusted EK).
pub fn joiner(cluster_ca: &EkCa, tpm_ca: &EkCa, port: u16, name: &str, role: &str) -> Joiner {
    // The CA's certificates exist once it manufactured a TPM.
    let swtpm = Swtpm::start(tpm_ca).unwrap();
    let config = config(cluster_ca, port, name, role);
    joiner_with(config, swtpm)
}

/// Reads an init response stream to its end (within 90 s); panics on a
/// failure, returns whether the init reported success.
pub async fn init_succeeds(
    stream: tonic::Response<
        tokio_stream::wrappers::ReceiverStream<
            Result<keel_proto::init::InitResponse, tonic::Status>,
        >,
    >,
) -> bool {
    use keel_proto::init::init_response::Kind;
    let mut stream = stream.into_inner();
    let mut succeeded = false;
    let drained = tokio::time::timeout(Duration::from_secs(90), async {
        while let Some(response) = tokio_stream::StreamExt::next(&mut stream).await {
            match response.unwrap().kind {
                Some(Kind::Success(_)) => succeeded = true,
                Some(Kind::Failure(failure)) => panic!("init failed: {failure:?}"),
                _ => {}
            }
        }
    })
    .await;
    assert!(drained.is_ok(), "the init did not end");
    succeeded
}

/// Creates `path` as a fresh 20 MiB state-disk image (zeros, no header).
pub fn fresh_disk(path: &Path) {
    std::fs::File::create(path)
        .unwrap()
        .set_len(20 << 20)
        .unwrap();
}

/// Writes a LUKS1 header on `disk` (one keel never writes: it has no
/// label), with the key on standard input.
pub fn format_luks1(disk: &Path) {
    use std::io::Write as _;
    let mut child = std::process::Command::new("cryptsetup")
        .args([
            "luksFormat",
            "--type",
            "luks1",
            "--batch-mode",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file=-",
        ])
        .arg(disk)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"a key").unwrap();
    assert!(child.wait().unwrap().success(), "luksFormat --type luks1");
}

/// Damages the JSON of both copies of the LUKS2 header on `disk` (the
/// secondary right after a 16 KiB primary), their magic left: cryptsetup
/// then reads no header there.
pub fn damage_luks_headers(disk: &Path) {
    use std::os::unix::fs::FileExt as _;
    let file = std::fs::OpenOptions::new().write(true).open(disk).unwrap();
    for header in [0, 16384] {
        file.write_all_at(b"{{{{damaged", header + 4096 + 2)
            .unwrap();
    }
}

/// A joining node with `config` and the TPM `swtpm`.
pub fn joiner_with(config: NodeConfig, swtpm: Swtpm) -> Joiner {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("state.img");
    fresh_disk(&disk);
    let dir = NodeDir {
        swtpm,
        dir,
        boots: 0,
    };
    with_tpm(config, dir, disk)
}

/// The node of `dir` after a reboot: its own TPM started again (PCRs zero,
/// the same EK), a new event log, the same root and state disk. (`_tpm_ca`
/// is not needed: the TPM is the node's, made when it was first started.)
pub fn reboot(config: NodeConfig, _tpm_ca: &EkCa, mut dir: NodeDir, disk: PathBuf) -> Joiner {
    dir.swtpm.restart().unwrap();
    dir.boots += 1;
    with_tpm(config, dir, disk)
}

fn with_tpm(config: NodeConfig, dir: NodeDir, disk: PathBuf) -> Joiner {
    let log = dir.path().join(format!("log-boot-{}", dir.boots));
    let tpm = measured(&dir.swtpm, &log, &config);
    on_tpm(config, dir, disk, tpm)
}

/// The node of `dir` with its measured TPM `tpm`.
fn on_tpm(config: NodeConfig, dir: NodeDir, disk: PathBuf, tpm: SharedTpm) -> Joiner {
    let lock = Arc::new(NodeLock::new(tpm.clone()).unwrap());
    Joiner {
        config,
        tpm,
        lock,
        root: dir.path().join("root"),
        work: dir.path().join("work"),
        disk,
        dir,
    }
}

impl Joiner {
    /// The join client, with short pauses.
    pub fn client(&self, ca: &EkCa) -> JoinClient {
        self.client_with_kubeadm_env(ca, &[])
    }

    /// [`Joiner::client`] with `extra` in the stand-in kubeadm's environment.
    pub fn client_with_kubeadm_env(&self, ca: &EkCa, extra: &[(&str, &str)]) -> JoinClient {
        let mut env = self.env();
        env.kubeadm
            .env
            .extend(extra.iter().map(|(k, v)| ((*k).into(), (*v).into())));
        self.client_in(ca, env)
    }

    /// [`Joiner::client`] provisioning in `env`.
    pub fn client_in(&self, ca: &EkCa, env: NodeEnv) -> JoinClient {
        self.client_backing_off(
            ca,
            env,
            Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_millis(500),
            },
        )
    }

    /// [`Joiner::client_in`] with `backoff` between its tries.
    pub fn client_backing_off(&self, ca: &EkCa, env: NodeEnv, backoff: Backoff) -> JoinClient {
        let mut settings = JoinSettings::from_config(&self.config).unwrap();
        settings.ek_trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
        settings.backoff = backoff;
        settings.timeout = Duration::from_secs(20);
        JoinClient::new(
            self.config.clone(),
            self.tpm.clone(),
            self.lock.clone(),
            env,
            settings,
        )
        .unwrap()
    }

    pub fn pcr15(&self) -> [u8; 32] {
        pcr15(&self.tpm)
    }

    /// Replaces the node's event log by a directory: recording an event
    /// (the node lock's) fails, with PCR 15 still zero.
    pub fn make_event_log_unwritable(&self) {
        let log = self.dir.path().join("log-boot-0");
        assert!(
            log.is_file(),
            "{} is not the node's event log",
            log.display()
        );
        std::fs::remove_file(&log).unwrap();
        std::fs::create_dir(&log).unwrap();
    }

    /// The init server of this node, accepting `secret` (its hash goes
    /// into the config); with the state disk when `disk`.
    pub fn init_server(&self, secret: &[u8], disk: bool) -> InitServer {
        self.init_server_in(
            secret,
            node_env(&self.root, &self.work, disk.then_some(self.disk.as_path())),
        )
    }

    /// The init server of this node, accepting `secret`, provisioning in `env`.
    pub fn init_server_in(&self, secret: &[u8], env: NodeEnv) -> InitServer {
        let mut config = self.config.clone();
        config.cluster.init_secret_hash = keel_verifier::init_secret::hash(secret).unwrap();
        InitServer::new(Node {
            config,
            tpm: self.tpm.clone(),
            lock: self.lock.clone(),
            env,
            cluster: Arc::new(ClusterSlot::new(None)),
            operator_key: Default::default(),
        })
    }

    /// Kills the node's swtpm ([`keel_testkit::swtpm::Swtpm::kill_hard`]):
    /// every TPM command after fails.
    pub fn kill_tpm(&mut self) {
        self.dir.swtpm.kill_hard();
    }

    /// This node as its flows see it, its cluster state going to `cluster`.
    pub fn node(&self, cluster: Arc<ClusterSlot>) -> Node {
        Node {
            config: self.config.clone(),
            tpm: self.tpm.clone(),
            lock: self.lock.clone(),
            env: self.env(),
            cluster,
            operator_key: Default::default(),
        }
    }

    /// The node's state disk opens with the key `service`'s cluster derives
    /// for its UUID and this node's EK.
    pub fn assert_disk_opens(&self, service: &Service) {
        let cs = Cryptsetup::default();
        let uuid = cs.uuid(&self.disk).unwrap();
        let key = service
            .state
            .keys
            .disk_key(&uuid, &ek_digest(&self.tpm))
            .unwrap();
        assert!(cs.key_matches(&self.disk, &key).unwrap(), "{uuid}");
    }

    /// The environment this node's join client provisions in.
    pub fn env(&self) -> NodeEnv {
        node_env(&self.root, &self.work, Some(&self.disk))
    }

    /// Serves this node's join service on `port` once `slot` has its
    /// cluster state, as the agent of a control plane does.
    pub async fn serve_join(
        &self,
        port: u16,
        slot: Arc<ClusterSlot>,
    ) -> tokio::task::JoinHandle<()> {
        let places = keel_agent::node::EVIDENCE_REQUESTS_IN_FLIGHT;
        self.serve_join_with_evidence_places(port, slot, places)
            .await
    }

    /// [`Joiner::serve_join`] with `places` evidence requests held at once.
    pub async fn serve_join_with_evidence_places(
        &self,
        port: u16,
        slot: Arc<ClusterSlot>,
        places: usize,
    ) -> tokio::task::JoinHandle<()> {
        let task = self.start_join_service_with(port, slot, places);
        wait_for_port(format!("127.0.0.1:{port}").parse().unwrap()).await;
        task
    }

    /// Starts the node's join service on `port` (once it has a cluster
    /// state in `slot`), without waiting for it to listen.
    pub fn start_join_service(
        &self,
        port: u16,
        slot: Arc<ClusterSlot>,
    ) -> tokio::task::JoinHandle<()> {
        let places = keel_agent::node::EVIDENCE_REQUESTS_IN_FLIGHT;
        self.start_join_service_with(port, slot, places)
    }

    /// [`Joiner::start_join_service`] with `places` evidence requests held
    /// at once.
    fn start_join_service_with(
        &self,
        port: u16,
        slot: Arc<ClusterSlot>,
        places: usize,
    ) -> tokio::task::JoinHandle<()> {
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let serve = keel_agent::node::serve_join_as_control_plane_with(
            addr,
            self.config.clone(),
            self.tpm.clone(),
            self.env(),
            slot,
            self.work.join("join-measurements.json"),
            places,
        );
        tokio::spawn(async move {
            if let Err(e) = serve.await {
                panic!("join service: {e:#}");
            }
        })
    }

    /// Reboots the node: its TPM restarts (PCRs zero), its disk and
    /// directory stay.
    pub fn reboot(self, tpm_ca: &EkCa) -> Joiner {
        reboot(self.config, tpm_ca, self.dir, self.disk)
    }

    /// Restarts the node's agent within its boot: its TPM keeps its PCRs,
    /// the agent opens its event log again and measures its config only if
    /// the log lacks it, as the agent does at start.
    pub fn restart_agent(self) -> Joiner {
        let Joiner {
            config,
            tpm,
            lock,
            disk,
            dir,
            ..
        } = self;
        drop(lock);
        drop(tpm);
        let log = dir.path().join(format!("log-boot-{}", dir.boots));
        let tpm = Tpm::open(&dir.swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
        let mut m = MeasuredTpm::open(tpm, &log).unwrap();
        m.record_once(EventType::NodeConfig, "config", config.cluster_bytes())
            .unwrap();
        m.record_once(EventType::NodeIdentity, "node", config.node_bytes())
            .unwrap();
        on_tpm(config, dir, disk, m.shared())
    }

    /// Revokes this control plane in its own registry, as when another
    /// control plane's revocation reached it, with the reason
    /// `test: revoked by the operator`.
    pub fn revoke_in_own_registry(&self) {
        let registry = keel_agent::registry::RegistryStore::shared(&self.root).unwrap();
        let own = ek_digest(&self.tpm);
        registry
            .update(|r| {
                r.register(&own, "", &self.config.node.name, "control-plane")?;
                let record = r.find(&own.to_string())?.clone();
                r.revoke(&record, None, "test: revoked by the operator")
            })
            .unwrap();
    }

    /// `secret` sealed to this node's TPM, as the CLI seals the master secret.
    pub fn sealed(&self, secret: &[u8]) -> SealedSecret {
        let mut m = self.tpm.lock().unwrap();
        let ek = Public::parse(&m.tpm().endorsement().unwrap().public).unwrap();
        let ak = Public::parse(&m.tpm().attestation_key().unwrap()).unwrap();
        credential::seal(&ek, &ak.name, secret).unwrap()
    }

    /// A ticket client validating the service as the join client does.
    pub fn tickets(&self, ca: &EkCa) -> TicketClient {
        let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
        let validator = service_validator(&self.tpm, trust, None).unwrap();
        TicketClient::new(self.tpm.clone(), validator, Duration::from_secs(60))
    }

    /// Nothing was written: no root, no work directory, no LUKS header,
    /// PCR 15 zero.
    pub fn assert_untouched(&self) {
        assert_eq!(self.pcr15(), [0; 32], "the node got locked");
        assert!(!self.lock.is_locked());
        assert!(!self.root.exists(), "files were written under the root");
        assert!(!self.work.exists(), "files were written to the work dir");
        assert!(
            !Cryptsetup::default().is_luks(&self.disk).unwrap(),
            "the state disk was formatted"
        );
    }
}

/// PCR 15 of `tpm`.
pub fn pcr15(tpm: &SharedTpm) -> [u8; 32] {
    tpm.lock()
        .unwrap()
        .tpm()
        .pcr_read(&[keel_verifier::measurement::pcr::CLUSTER_ID])
        .unwrap()[&keel_verifier::measurement::pcr::CLUSTER_ID]
}

/// A measured node that issues attestation documents (its config in
/// PCR 12), optionally with CPU evidence from `cpu`.
pub struct IssuingNode {
    pub issuer: TpmIssuer,
    pub tpm: SharedTpm,
    pub config: NodeConfig,
    _dir: tempfile::TempDir,
    _swtpm: Swtpm,
}

/// Starts an [`IssuingNode`] on a fresh swtpm of `ca`.
pub fn issuing_node(ca: &EkCa, cpu: Option<Arc<dyn CpuReporter>>) -> IssuingNode {
    issuing_node_on(Swtpm::start(ca).unwrap(), cpu)
}

/// Starts an [`IssuingNode`] on `swtpm`.
pub fn issuing_node_on(swtpm: Swtpm, cpu: Option<Arc<dyn CpuReporter>>) -> IssuingNode {
    let dir = tempfile::tempdir().unwrap();
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let mut measured = MeasuredTpm::open(tpm, &dir.path().join("log")).unwrap();
    let config = NodeConfig::parse(br#"{"node":{"name":"n1"}}"#, "t".as_ref()).unwrap();
    measured
        .record(EventType::NodeConfig, "config", config.cluster_bytes())
        .unwrap();
    if let Some(cpu) = cpu {
        measured = measured.with_cpu_reporter(cpu);
    }
    let tpm = measured.shared();
    IssuingNode {
        issuer: TpmIssuer::new(tpm.clone()),
        tpm,
        config,
        _dir: dir,
        _swtpm: swtpm,
    }
}
