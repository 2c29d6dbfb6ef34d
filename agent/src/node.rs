//! The running agent: after the config is measured, serve the init API over
//! server-attested aTLS until the node joins or creates a cluster.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel_atls::AtlsServer;
use keel_installer::{InstallerConfig, Mirror};
use tonic::transport::Server;

use crate::attestation::issuer::TpmIssuer;
use crate::cluster::ClusterSlot;
use crate::config::NodeConfig;
use crate::disk::Cryptsetup;
use crate::init::{InitServer, NodeEnv, RebootPolicy, StateDisk};
use crate::kubeadm::Kubeadm;
use crate::measured::SharedTpm;
use crate::nodelock::NodeLock;

/// Where components install their binaries on a node (see the versions table).
pub const BIN_DIR: &str = "/run/state/bin";

/// The address this node reaches others from: the source address the kernel
/// picks for a route to `toward` (a UDP connect sends nothing).
pub fn local_address(toward: IpAddr) -> IpAddr {
    UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|s| s.connect((toward, 9)).and_then(|()| s.local_addr()))
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// The environment of a real node: installs under `/`, kubeadm from
/// [`BIN_DIR`], the configured state disk, reboot after 60 s on failure.
pub fn node_env(config: &NodeConfig, state_dir: PathBuf) -> anyhow::Result<NodeEnv> {
    let mut installer = InstallerConfig::default();
    if let Some(m) = &config.cluster.component_mirror {
        installer.mirror = Some(Mirror::new(m)?);
    }
    let toward = config
        .cluster
        .control_plane_endpoints
        .first()
        .and_then(|e| e.parse::<SocketAddr>().ok())
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::new(10, 0, 2, 2)));
    Ok(NodeEnv {
        installer,
        kubeadm: Kubeadm::new(std::path::Path::new(BIN_DIR)),
        work_dir: state_dir,
        advertise_address: local_address(toward),
        state_disk: config.node.state_disk.as_ref().map(|d| StateDisk {
            device: d.into(),
            cryptsetup: Cryptsetup::default(),
        }),
        reboot: RebootPolicy::After(Duration::from_secs(60)),
    })
}

/// Serves the init API on `addr` until the task is dropped.
pub async fn serve_init(
    addr: SocketAddr,
    config: NodeConfig,
    tpm: SharedTpm,
    lock: Arc<NodeLock>,
    env: NodeEnv,
    cluster: Arc<ClusterSlot>,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "init server listening (server-attested aTLS)");
    let issuer = Arc::new(TpmIssuer::new(tpm.clone()));
    let incoming = AtlsServer::<()>::server_attested(issuer).incoming(listener);
    let init = InitServer::new(config, tpm, lock, env, cluster);
    Server::builder()
        .add_service(init.into_service())
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}
