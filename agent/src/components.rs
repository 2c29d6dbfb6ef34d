//! Installs the Kubernetes components and measures each one.
//!
//! Every component is installed by [`keel_installer`] (verified by SHA-256,
//! placed atomically) and then recorded as an [`EventType::Component`] event
//! in PCR 13, in list order, before the next one is installed. The measured
//! bytes are [`InstalledComponent::measurement_record`] (upstream URL, hash,
//! install path, extract flag), so a verifier replaying the log sees exactly
//! which binaries the node runs, whatever mirror served them. A failure
//! stops at that component: the ones before it stay installed and measured.

use std::error::Error;
use std::time::Duration;

use keel_installer::{
    Component, InstallError, InstalledComponent, Installer, LogProgress, Outcome, Progress, Source,
};
use keel_verifier::measurement::EventType;
use keel_verifier::signature::SigningPublicKey;

use crate::measured::{MeasuredLogError, SharedTpm};

/// Why installing the components failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InstallComponentsError {
    /// The list as a whole is refused ([`keel_installer::check_list`]):
    /// nothing of it was installed.
    #[error("the component list")]
    List(#[source] InstallError),
    /// Installing a component failed.
    #[error("installing component {index} ({name})")]
    Install {
        /// Position in the list.
        index: usize,
        /// The component's short name.
        name: String,
        /// The cause.
        #[source]
        source: Box<InstallError>,
    },
    /// Measuring an installed component failed.
    #[error("measuring component {index} ({name})")]
    Measure {
        /// Position in the list.
        index: usize,
        /// The component's short name.
        name: String,
        /// The cause.
        #[source]
        source: MeasuredLogError,
    },
    /// Another thread panicked while holding the TPM.
    #[error("the TPM handle is poisoned")]
    Poisoned,
    /// The blocking measurement task did not complete.
    #[error("running the measurement task")]
    Blocking(#[source] tokio::task::JoinError),
}

/// Download progress told both to the node's log (everything
/// [`LogProgress`] logs) and to `log`, the stream the operator follows
/// (`keel init`, `keel upgrade`): one line per failed attempt, with why and
/// when the next starts, and one per verified download. A mirror that does
/// not answer is then seen at the operator's terminal within its first
/// retry, not when the download's deadline ends.
pub struct StreamedProgress<'a> {
    log: &'a (dyn Fn(String) + Sync),
    node: LogProgress,
}

impl<'a> StreamedProgress<'a> {
    /// Progress told to `log` as well as to the node's log.
    pub fn new(log: &'a (dyn Fn(String) + Sync)) -> Self {
        Self {
            log,
            node: LogProgress::default(),
        }
    }
}

impl Progress for StreamedProgress<'_> {
    fn started(&self, name: &str, total: Option<u64>) {
        self.node.started(name, total);
    }

    fn advanced(&self, name: &str, done: u64, total: Option<u64>) {
        self.node.advanced(name, done, total);
    }

    fn retrying(&self, name: &str, attempt: u32, delay: Duration, error: &(dyn Error + 'static)) {
        self.node.retrying(name, attempt, delay, error);
        (self.log)(format!(
            "{name}: download attempt {attempt} failed ({}); trying again in {:.1} s",
            keel_installer::ErrorChain(error),
            delay.as_secs_f64()
        ));
    }

    fn finished(&self, name: &str, bytes: u64, elapsed: Duration) {
        self.node.finished(name, bytes, elapsed);
        // Display only: a size in MB, rounded.
        #[allow(clippy::cast_precision_loss)]
        let megabytes = bytes as f64 / 1e6;
        (self.log)(format!(
            "{name}: {megabytes:.1} MB downloaded and verified in {:.1} s",
            elapsed.as_secs_f64()
        ));
    }

    fn installed(&self, installed: &InstalledComponent) {
        if let Some(line) = installed_without_download(installed) {
            (self.log)(line);
        }
    }
}

/// Installs `components` in order and measures each into PCR 13 right after
/// it is in place. Returns what was installed.
pub async fn install_and_measure(
    installer: &Installer,
    tpm: &SharedTpm,
    components: &[Component],
    progress: &dyn Progress,
) -> Result<Vec<InstalledComponent>, InstallComponentsError> {
    keel_installer::check_list(components).map_err(InstallComponentsError::List)?;
    let mut installed = Vec::with_capacity(components.len());
    for (index, component) in components.iter().enumerate() {
        let name = component.name().to_owned();
        let done = installer
            .install_among(component, components, progress)
            .await
            .map_err(|source| InstallComponentsError::Install {
                index,
                name: name.clone(),
                source: Box::new(source),
            })?;
        let record = done.measurement_record();
        let description = done.description();
        let tpm = SharedTpm::clone(tpm);
        // The TPM is a blocking device behind a std mutex: keep it off the
        // async workers.
        tokio::task::spawn_blocking(move || {
            let mut tpm = tpm.lock().map_err(|_| InstallComponentsError::Poisoned)?;
            tpm.record(EventType::Component, description, record)
                .map_err(|source| InstallComponentsError::Measure {
                    index,
                    name,
                    source,
                })
        })
        .await
        .map_err(InstallComponentsError::Blocking)??;
        installed.push(done);
    }
    Ok(installed)
}

/// Why a list of components the operator chose is not taken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignedListError {
    /// No components file or no signature came with the list.
    #[error(
        "the request lists its own components, and this cluster takes them only with their \
         components file signed by its measurements signing key (name it as the settings' \
         measurements_signing_key; `keel-measure sign` signs the file)"
    )]
    Unsigned,
    /// The signature does not verify with the key (or not for the
    /// request's version).
    #[error(
        "the components file's signature does not verify with the cluster's measurements \
         signing key as the file for this Kubernetes version"
    )]
    Signature,
    /// The signed file does not parse.
    #[error("the signed components file: {0}")]
    File(#[source] keel_installer::components_file::ComponentsFileError),
    /// The signed file lists other components than the request.
    #[error("the request's components are not the ones its signed components file lists")]
    Mismatch,
}

/// Checks that `file` (a components file) carries `signature` by `key`,
/// the cluster's measurements signing key, as the file for `version`
/// ([`keel_installer::components_file::signed_message`]), and lists
/// exactly `listed`: where a cluster has that key, the operator key alone
/// chooses no binaries, as it admits no image, and a file signed for one
/// version does not pass as another's.
pub fn check_signed_list(
    key: &SigningPublicKey,
    version: keel_installer::KubernetesVersion,
    file: &[u8],
    signature: &[u8],
    listed: &[keel_proto::components::Component],
) -> Result<(), SignedListError> {
    if file.is_empty() || signature.is_empty() {
        return Err(SignedListError::Unsigned);
    }
    let message = keel_installer::components_file::signed_message(version, file);
    key.verify(&message, signature)
        .map_err(|_| SignedListError::Signature)?;
    let signed = keel_installer::components_file::parse(file).map_err(SignedListError::File)?;
    if signed.components != listed {
        return Err(SignedListError::Mismatch);
    }
    Ok(())
}

/// The operator's line for a component installed without a download (its
/// inline content, its kept copy, or the file already in place, hashed
/// right); `None` for a download, which [`StreamedProgress`] has told
/// already.
fn installed_without_download(installed: &InstalledComponent) -> Option<String> {
    let name = installed.component().name();
    match installed.outcome() {
        Outcome::Written { .. } | Outcome::Extracted(_) => {
            matches!(installed.component().source(), Source::Inline(_))
                .then(|| format!("{name}: written from the list's inline content, hash verified"))
        }
        Outcome::CopiedKept { .. } | Outcome::ExtractedKept(_) => Some(format!(
            "{name}: installed from the copy kept on the state disk, hash verified"
        )),
        Outcome::AlreadyPresent => Some(format!("{name}: already in place, hash verified")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A component installed without a download gets the operator's line
    /// that says how (inline content, already in place); a download gets
    /// none here, its progress told it.
    #[tokio::test]
    async fn components_installed_without_a_download_are_told_how() {
        let root = tempfile::tempdir().unwrap();
        let installer = Installer::new(keel_installer::InstallerConfig {
            root: root.path().to_owned(),
            ..keel_installer::InstallerConfig::default()
        })
        .unwrap();
        let inline = Component::new(
            "data:,%5B%5D",
            &keel_installer::Sha256Digest::of(b"[]").to_string(),
            "/opt/kubernetes/patches/etcd+json.json",
            false,
        )
        .unwrap();
        let lines = Mutex::new(Vec::<String>::new());
        let log = |line: String| lines.lock().unwrap().push(line);
        // Installed twice: written, then found in place.
        for _ in 0..2 {
            installer
                .install(&inline, &StreamedProgress::new(&log))
                .await
                .unwrap();
        }
        assert_eq!(
            lines.into_inner().unwrap(),
            [
                "etcd+json.json: written from the list's inline content, hash verified",
                "etcd+json.json: already in place, hash verified",
            ]
        );
    }

    /// The operator's stream gets a line per failed attempt (why, and when
    /// the next starts) and per verified download; not one per chunk.
    #[test]
    fn downloads_are_told_to_the_operators_stream() {
        let lines = Mutex::new(Vec::<String>::new());
        let log = |line: String| lines.lock().unwrap().push(line);
        let progress = StreamedProgress::new(&log);
        progress.started("kubelet", Some(58_000_000));
        progress.advanced("kubelet", 1_000, Some(58_000_000));
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        progress.retrying("kubelet", 1, Duration::from_millis(1500), &refused);
        progress.finished("kubelet", 58_000_000, Duration::from_millis(3200));
        let lines = lines.into_inner().unwrap();
        assert_eq!(
            lines,
            [
                "kubelet: download attempt 1 failed (refused); trying again in 1.5 s",
                "kubelet: 58.0 MB downloaded and verified in 3.2 s",
            ]
        );
    }
}
