//! Installs the Kubernetes components and measures each one.
//!
//! Every component is installed by [`keel_installer`] (verified by SHA-256,
//! placed atomically) and then recorded as an [`EventType::Component`] event
//! in PCR 13, in list order, before the next one is installed. The measured
//! bytes are [`InstalledComponent::measurement_record`] (upstream URL, hash,
//! install path, extract flag), so a verifier replaying the log sees exactly
//! which binaries the node runs, whatever mirror served them. A failure
//! stops at that component: the ones before it stay installed and measured.

use keel_installer::{Component, InstallError, InstalledComponent, Installer, Progress};
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
