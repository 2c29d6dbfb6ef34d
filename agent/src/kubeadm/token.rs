//! `kubeadm token create`: registers a join ticket's bootstrap token with
//! the cluster.
//!
//! The token goes to kubeadm in a configuration file (an
//! `InitConfiguration` holding just that token, mode 0600, removed after the
//! run), never in an argument; kubeadm prints the token on stdout, which is
//! never read. stderr is kept for the error, scrubbed of tokens like every
//! kubeadm line.

use std::path::Path;
use std::time::Duration;

use keel_installer::KubernetesVersion;
use zeroize::Zeroizing;

use super::config::{BootstrapToken, ConfigApi};
use super::run::{Kubeadm, KubeadmError, Stdout};
use crate::paths::ADMIN_CONF;

/// Lifetime of a ticket's bootstrap token.
pub const TOKEN_TTL: &str = "1h0m0s";
/// The kubeadm group of bootstrap tokens for joining nodes.
const TOKEN_GROUP: &str = "system:bootstrappers:kubeadm:default-node-token";
/// Limit for one `kubeadm token create`.
const TOKEN_CREATE_TIMEOUT: Duration = Duration::from_secs(60);

impl Kubeadm {
    /// Registers `token` with the cluster of this control plane (running
    /// Kubernetes `version`): `kubeadm token create --config F --kubeconfig
    /// <admin.conf>`, F written into `config_dir`.
    pub async fn create_token(
        &self,
        token: &BootstrapToken,
        version: KubernetesVersion,
        config_dir: &Path,
    ) -> Result<(), KubeadmError> {
        let api = ConfigApi::for_version(version).map_err(KubeadmError::Config)?;
        let yaml = Zeroizing::new(format!(
            "apiVersion: {api}\nkind: InitConfiguration\nbootstrapTokens:\n- token: \"{token}\"\n  \
             ttl: \"{TOKEN_TTL}\"\n  usages: [\"signing\", \"authentication\"]\n  groups: [\"{TOKEN_GROUP}\"]\n  \
             description: \"keel join ticket\"\n",
            api = api.api_version(),
            token = token.expose(),
        ));
        let path = config_dir.join(format!("token-{}.yaml", token.id()));
        crate::files::write_private(&path, yaml.as_bytes()).map_err(KubeadmError::WriteConfig)?;
        let args = [
            "token".to_owned(),
            "create".to_owned(),
            "--config".to_owned(),
            path.to_string_lossy().into_owned(),
            "--kubeconfig".to_owned(),
            self.root.join(ADMIN_CONF).to_string_lossy().into_owned(),
        ];
        let mut on_line = |line: &str| tracing::debug!(target: "keel_agent::kubeadm", "{line}");
        let result = self
            .run(
                "token",
                &args,
                TOKEN_CREATE_TIMEOUT,
                Stdout::Discard,
                &mut on_line,
            )
            .await;
        let _ = tokio::fs::remove_file(&path).await;
        result
    }
}
