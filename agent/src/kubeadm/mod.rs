//! Driving kubeadm: its configuration files and its command line.
//!
//! * [`config`]: `InitConfiguration`/`ClusterConfiguration` for `kubeadm
//!   init` and `JoinConfiguration` for `kubeadm join`, in the API version
//!   the Kubernetes version needs, from checked inputs.
//!   Configuration files go in place with [`crate::files::write_private`]
//!   (they carry the bootstrap token).
//! * [`run`]: runs `kubeadm init`/`join` with a time limit, streaming its
//!   output, and returns the admin kubeconfig after `init`.
//! * [`token`]: `kubeadm token create` for a join ticket's bootstrap token.
//!
//! Every kubeadm call of the agent goes through [`Kubeadm`].
//!
//! kubeadm is an external program (installed as a verified, measured
//! component); keel drives it through its documented command line and
//! configuration files only.

pub mod certs;
pub mod config;
pub mod run;
pub mod token;
mod yaml;

pub use config::{
    BootstrapToken, CaCertHash, CertificateKey, ConfigApi, ConfigError, ControlPlaneJoin,
    Discovery, DiscoveryKubeconfig, InitConfig, JoinConfig, ParseSecretError,
};
pub use run::{Kubeadm, KubeadmError};
