//! `kubeadm token create`: registers join tickets' bootstrap tokens with
//! the cluster.
//!
//! The tokens go to kubeadm in a configuration file (an
//! `InitConfiguration` holding just those tokens, mode 0600, removed after
//! the run), never in an argument. kubeadm creates every token the file's
//! `bootstrapTokens` list holds (its `token create` runs the same token
//! phase as `init`) and prints the first on stdout, which is never read.
//! stderr is kept for the error, scrubbed of tokens like every kubeadm
//! line. One run registers up to [`MAX_TOKENS_PER_RUN`] tokens: the join
//! service batches the tokens of the tickets being issued at once.

use std::path::Path;
use std::time::Duration;

use keel_installer::KubernetesVersion;
use zeroize::Zeroizing;

use super::config::{BootstrapToken, ConfigApi};
use super::run::{Kubeadm, KubeadmError, Stdout};
use super::yaml::Yaml;
use crate::paths::ADMIN_CONF;

/// Lifetime of a ticket's bootstrap token: the node's `kubeadm join` must
/// start within it (the ticket comes first, then the state disk and the
/// downloads). Short, because kubeadm's default approval signs a node
/// client certificate of any node name for a CSR under such a token: a
/// node compromised while its token lives could ask for another node's.
pub const TOKEN_TTL: &str = "15m0s";
/// Most tokens registered by one `kubeadm token create`.
pub const MAX_TOKENS_PER_RUN: usize = 64;
/// Limit for one `kubeadm token create`.
const TOKEN_CREATE_TIMEOUT: Duration = Duration::from_secs(60);

/// The `InitConfiguration` registering `tokens`, written by the one YAML
/// writer into a buffer of its size that is wiped when dropped.
fn tokens_config(api_version: &str, tokens: &[BootstrapToken]) -> Zeroizing<String> {
    let entries = tokens
        .iter()
        .map(|token| token.config_entry(TOKEN_TTL, "keel join ticket"))
        .collect();
    Yaml::documents(&[Yaml::map(vec![
        ("apiVersion", Yaml::str(api_version)),
        ("kind", Yaml::str("InitConfiguration")),
        ("bootstrapTokens", Yaml::List(entries)),
    ])])
}

/// A `token create` configuration is `token-<first token's ID>.yaml`.
const CONFIG_PREFIX: &str = "token-";
const CONFIG_SUFFIX: &str = ".yaml";

/// Removes the `token create` configurations in `config_dir` that a run the
/// agent did not outlive left behind (a SIGKILL skips their removal); they
/// hold tokens. Call once when the agent starts, before any run (a join
/// service set up again within the agent may follow a run still under
/// way). Failures are logged: only the files stay.
pub fn remove_stale_configs(config_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(config_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let is_config = name.starts_with(CONFIG_PREFIX)
            && name.ends_with(CONFIG_SUFFIX)
            && entry.file_type().is_ok_and(|t| t.is_file());
        if is_config {
            tracing::warn!(
                file = name,
                "removing a token configuration left by an earlier run"
            );
            crate::files::remove_or_log(
                &entry.path(),
                "removing a token configuration left by an earlier run failed",
            );
        }
    }
}

impl Kubeadm {
    /// Registers `token` with the cluster of this control plane (running
    /// Kubernetes `version`); see [`Kubeadm::create_tokens`].
    pub async fn create_token(
        &self,
        token: &BootstrapToken,
        version: KubernetesVersion,
        config_dir: &Path,
    ) -> Result<(), KubeadmError> {
        self.create_tokens(std::slice::from_ref(token), version, config_dir)
            .await
    }

    /// Registers `tokens` (1 to [`MAX_TOKENS_PER_RUN`]) with the cluster of
    /// this control plane (running Kubernetes `version`) in one run:
    /// `kubeadm token create --config F --kubeconfig <admin.conf>`, F
    /// written into `config_dir` and named after the first token's ID.
    pub async fn create_tokens(
        &self,
        tokens: &[BootstrapToken],
        version: KubernetesVersion,
        config_dir: &Path,
    ) -> Result<(), KubeadmError> {
        let Some(first) = tokens.first() else {
            return Ok(());
        };
        if tokens.len() > MAX_TOKENS_PER_RUN {
            return Err(KubeadmError::TooManyTokens(tokens.len()));
        }
        let api = ConfigApi::for_version(version).map_err(KubeadmError::Config)?;
        let yaml = tokens_config(api.api_version(), tokens);
        let path = config_dir.join(format!("{CONFIG_PREFIX}{}{CONFIG_SUFFIX}", first.id()));
        // Read by this one run and removed after it: not synced.
        let config = crate::files::TransientFile::scratch(path, yaml.as_bytes())
            .map_err(KubeadmError::WriteConfig)?;
        let args = [
            "token".to_owned(),
            "create".to_owned(),
            "--config".to_owned(),
            config.path().to_string_lossy().into_owned(),
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
        drop(config);
        result
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn stale_token_configurations_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let token = BootstrapToken::generate();
        let stale = dir.path().join(format!("token-{}.yaml", token.id()));
        std::fs::write(&stale, "a token").unwrap();
        for other in ["join.yaml", "token-list.txt", "tokens.yaml"] {
            std::fs::write(dir.path().join(other), "x").unwrap();
        }
        std::fs::create_dir(dir.path().join("token-dir.yaml")).unwrap();
        remove_stale_configs(dir.path());
        let mut left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "join.yaml",
                "token-dir.yaml",
                "token-list.txt",
                "tokens.yaml"
            ]
        );
        // A missing directory is no error.
        remove_stale_configs(&dir.path().join("missing"));
    }

    /// The configuration lists every token, and is written into a buffer
    /// of its size: a buffer that grew would leave copies of its tokens in
    /// freed memory.
    #[test]
    fn the_tokens_config_lists_each_token_in_a_buffer_of_its_size() {
        for n in [1, 2, MAX_TOKENS_PER_RUN] {
            let tokens: Vec<_> = (0..n).map(|_| BootstrapToken::generate()).collect();
            let yaml = tokens_config("kubeadm.k8s.io/v1beta4", &tokens);
            assert_eq!(yaml.capacity(), yaml.len(), "{n} tokens");
            for token in &tokens {
                let entry = format!(
                    "  - token: \"{}\"\n    ttl: \"{TOKEN_TTL}\"\n",
                    token.expose()
                );
                assert!(yaml.contains(&entry), "{}", *yaml);
            }
            assert!(yaml.starts_with(
                "apiVersion: \"kubeadm.k8s.io/v1beta4\"\nkind: \"InitConfiguration\"\nbootstrapTokens:\n"
            ));
        }
    }
}
