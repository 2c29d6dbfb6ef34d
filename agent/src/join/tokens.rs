//! The join service's bootstrap tokens, registered in batches: the tokens
//! of the tickets being issued while a `kubeadm token create` runs are
//! registered together by the next one ([`crate::batching`]), so a burst of
//! joins costs a few kubeadm runs instead of one process per ticket. Each
//! ticket still waits until its own token is registered, and no token is
//! registered for a ticket that was refused before it asked for one.

use std::path::PathBuf;
use std::sync::Arc;

use keel_installer::KubernetesVersion;
use tracing::Instrument as _;

use crate::batching::{AsyncBatcher, BatchError, BatchStats, RoundFuture};
use crate::kubeadm::token::MAX_TOKENS_PER_RUN;
use crate::kubeadm::{BootstrapToken, Kubeadm, KubeadmError};

/// Why a token was not registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The kubeadm run that held this token failed (its cause is shared by
    /// every token of that run).
    #[error("registering bootstrap tokens")]
    Kubeadm(#[source] Arc<KubeadmError>),
    /// The batch ended without this token's result.
    #[error("registering bootstrap tokens")]
    Batch(#[source] BatchError<KubeadmError>),
}

type Registered = Result<(), Arc<KubeadmError>>;

/// Registers bootstrap tokens with kubeadm, in batches.
pub struct TokenRegistrar {
    batches: Arc<AsyncBatcher<(BootstrapToken, KubernetesVersion), Registered, KubeadmError>>,
}

impl TokenRegistrar {
    /// A registrar running `kubeadm`, whose token files go to `config_dir`.
    pub fn new(kubeadm: Kubeadm, config_dir: PathBuf) -> Self {
        let kubeadm = Arc::new(kubeadm);
        let config_dir = Arc::new(config_dir);
        let batches = AsyncBatcher::new(MAX_TOKENS_PER_RUN, move |tokens| {
            let (kubeadm, config_dir) = (kubeadm.clone(), config_dir.clone());
            Box::pin(async move { Ok(register(&kubeadm, &config_dir, tokens).await) })
                as RoundFuture<Registered, KubeadmError>
        });
        Self {
            batches: Arc::new(batches),
        }
    }

    /// Registers `token` for a cluster running `version`; returns once it is
    /// registered (in a batch with the tokens of other tickets, if any).
    pub async fn register(
        &self,
        token: &BootstrapToken,
        version: KubernetesVersion,
    ) -> Result<(), TokenError> {
        let registered = self
            .batches
            .submit((token.clone(), version))
            .instrument(tracing::debug_span!("join.token"));
        match registered.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(TokenError::Kubeadm(e)),
            Err(e) => Err(TokenError::Batch(e)),
        }
    }

    /// How many kubeadm runs registered how many tokens.
    pub fn stats(&self) -> BatchStats {
        self.batches.stats()
    }
}

/// One round: a kubeadm run per stretch of tokens for one Kubernetes
/// version (one run, except while the cluster changes version); each token
/// gets the outcome of its run.
async fn register(
    kubeadm: &Kubeadm,
    config_dir: &std::path::Path,
    tokens: Vec<(BootstrapToken, KubernetesVersion)>,
) -> Vec<Registered> {
    let mut results = Vec::with_capacity(tokens.len());
    for group in tokens.chunk_by(|a, b| a.1 == b.1) {
        let Some((_, version)) = group.first() else {
            continue;
        };
        let batch: Vec<BootstrapToken> = group.iter().map(|(t, _)| t.clone()).collect();
        let outcome = kubeadm
            .create_tokens(&batch, *version, config_dir)
            .instrument(tracing::debug_span!(
                "kubeadm.token_create",
                tokens = batch.len()
            ))
            .await
            .map_err(Arc::new);
        tracing::debug!(
            tokens = batch.len(),
            ok = outcome.is_ok(),
            "registered bootstrap tokens"
        );
        results.extend(std::iter::repeat_n(outcome, group.len()));
    }
    results
}
