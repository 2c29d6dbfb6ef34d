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

use crate::measured::{MeasuredLogError, SharedTpm};

/// Why installing the components failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InstallComponentsError {
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
    let mut installed = Vec::with_capacity(components.len());
    for (index, component) in components.iter().enumerate() {
        let name = component.name().to_owned();
        let done = installer
            .install(component, progress)
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
