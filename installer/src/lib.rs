//! Kubernetes versions table, verified downloads and safe archive extraction.
//!
//! * [`versions`]: the supported Kubernetes versions, each pinned to a patch,
//!   each with its components (URL, `sha256:` hash, install path, extract).
//! * [`component`]: the component type and its wire conversions; a component
//!   without a hash does not exist.
//! * [`download`]: streaming, hashing, retrying HTTP(S) downloads.
//! * [`durable`]: files replaced atomically and durably.
//! * [`extract`]: `.tgz` extraction that keeps every entry inside its directory.
//! * [`mirror`]: rewriting upstream URLs to a mirror for air-gapped clusters.
//! * [`installer`]: putting components in place atomically and returning
//!   what to measure.
//! * [`progress`]: progress reporting for the operator.
//!
//! See `installer/README.md` for the rules in one place.
#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod component;
pub mod components_file;
pub mod digest;
pub mod download;
pub mod durable;
pub mod extract;
pub mod installer;
pub mod mirror;
pub mod progress;
pub mod versions;

pub use component::{Component, ComponentError, InstallPath, Source};
pub use digest::{ParseDigestError, Sha256Digest};
pub use download::{
    redirect_policy, DownloadConfig, DownloadError, Downloader, RedirectRefused, RetryPolicy,
    MAX_REDIRECTS,
};
pub use extract::{ExtractError, ExtractLimits};
pub use installer::{
    check_list, kept_name, InstallError, InstalledComponent, Installer, InstallerConfig,
    MeasuredComponent, Outcome,
};
pub use mirror::Mirror;
pub use progress::{LogProgress, NoProgress, Progress};
pub use versions::{
    resolve, KubernetesVersion, ResolveError, UpgradeStepError, VersionEntry, VersionsTable,
};

/// Displays an error with its chain of causes: `a: b: c`.
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(err) = cause {
            write!(f, ": {err}")?;
            cause = err.source();
        }
        Ok(())
    }
}
