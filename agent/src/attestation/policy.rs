//! The verifier's policy as a running service holds it: the measurements
//! file, re-read while the service runs, behind a swappable validator.
//!
//! A new file is parsed and a new [`Validator`] built before anything is
//! swapped; a file that does not parse, or that does not enforce the PCRs
//! every set must enforce
//! ([`keel_verifier::measurements::REQUIRED_PCRS`]), leaves the old
//! validator in place and is logged. Handshakes in flight finish on
//! the validator they started with.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use keel_atls::SwappableValidator;
use keel_verifier::config::{ConfigError, NodeConfig};
use keel_verifier::cpu::{Collateral, CpuTrust};
use keel_verifier::ek::EkTrust;
use keel_verifier::measurement::Digest32;
use keel_verifier::measurements::{Measurements, MeasurementsError, MAX_MEASUREMENTS_BYTES};
use keel_verifier::validator::{ProvenKeys, Validator, Verified};

/// Loading a policy failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The measurements file could not be read.
    #[error("reading measurements file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The measurements file is invalid.
    #[error("measurements file {path} is invalid")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: MeasurementsError,
    },
}

/// The CPU evidence a node's verifiers (its join service, its join client)
/// require: the cluster's variant and expected values, the pinned hardware
/// roots, and the collateral cache at
/// [`DEFAULT_DIR`](keel_verifier::cpu::collateral::DEFAULT_DIR).
pub fn cpu_trust(config: &NodeConfig) -> Result<Arc<CpuTrust>, ConfigError> {
    Ok(Arc::new(CpuTrust::new(
        config.cluster.cpu_policy()?,
        Collateral::at(keel_verifier::cpu::collateral::DEFAULT_DIR),
    )))
}

/// Values every accepted peer must show in addition to the file's, e.g.
/// PCR 15 = zero for nodes that ask to join.
pub type Required = Vec<(u32, Digest32)>;

/// A validator built from a measurements file that can be re-read.
pub struct ReloadableValidator {
    path: PathBuf,
    ek_trust: EkTrust,
    cpu: Arc<CpuTrust>,
    required: Required,
    proven: Arc<ProvenKeys>,
    current: Arc<SwappableValidator<Validator>>,
    modified: Mutex<Option<SystemTime>>,
}

impl ReloadableValidator {
    /// Loads `path`; fails if the first file is invalid.
    pub fn load(path: &Path, ek_trust: EkTrust, required: Required) -> Result<Self, PolicyError> {
        let proven = Arc::new(ProvenKeys::default());
        let cpu = Arc::<CpuTrust>::default();
        let (validator, modified) = build(path, &ek_trust, &cpu, &required, &proven)?;
        Ok(Self {
            path: path.to_owned(),
            ek_trust,
            cpu,
            required,
            proven,
            current: Arc::new(SwappableValidator::new(validator)),
            modified: Mutex::new(modified),
        })
    }

    /// The same policy requiring CPU evidence as `cpu` says (the default
    /// is the `vtpm` variant), now and after every reload.
    pub fn with_cpu(mut self, cpu: Arc<CpuTrust>) -> Self {
        let current = self
            .current
            .current()
            .as_ref()
            .clone()
            .with_cpu(cpu.clone());
        self.current.replace(current);
        self.cpu = cpu;
        self
    }

    /// The validator to give aTLS servers and clients.
    pub fn validator(&self) -> keel_atls::DynValidator<Verified> {
        self.current.clone()
    }

    /// The validator in force now.
    pub fn current(&self) -> Arc<Validator> {
        self.current.current()
    }

    /// Re-reads the file and swaps in its validator. On error the old
    /// validator stays and the error is returned (and logged).
    pub fn reload(&self) -> Result<(), PolicyError> {
        match build(
            &self.path,
            &self.ek_trust,
            &self.cpu,
            &self.required,
            &self.proven,
        ) {
            Ok((validator, modified)) => {
                self.current.replace(validator);
                *self.modified.lock().unwrap_or_else(PoisonError::into_inner) = modified;
                tracing::info!(path = %self.path.display(), "measurements reloaded");
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    path = %self.path.display(),
                    error = %keel_atls::ErrorChain(&e),
                    "new measurements rejected; keeping the previous ones"
                );
                Err(e)
            }
        }
    }

    /// Reloads when the file's modification time changed.
    pub fn reload_if_changed(&self) -> Result<bool, PolicyError> {
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        let last = *self.modified.lock().unwrap_or_else(PoisonError::into_inner);
        if modified == last {
            return Ok(false);
        }
        let result = self.reload();
        // Remember a rejected file too, so it is reported once, not every poll.
        *self.modified.lock().unwrap_or_else(PoisonError::into_inner) = modified;
        result.map(|()| true)
    }

    /// Polls the file every `interval` until the returned task is aborted.
    pub fn watch(self: Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let _ = self.reload_if_changed();
            }
        })
    }
}

fn build(
    path: &Path,
    ek_trust: &EkTrust,
    cpu: &Arc<CpuTrust>,
    required: &Required,
    proven: &Arc<ProvenKeys>,
) -> Result<(Validator, Option<SystemTime>), PolicyError> {
    let read = |source| PolicyError::Read {
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(read)?;
    if meta.len() > MAX_MEASUREMENTS_BYTES as u64 {
        return Err(PolicyError::Parse {
            path: path.to_owned(),
            source: MeasurementsError::TooLarge,
        });
    }
    let bytes = std::fs::read(path).map_err(read)?;
    let mut measurements = Measurements::parse(&bytes).map_err(|source| PolicyError::Parse {
        path: path.to_owned(),
        source,
    })?;
    for (pcr, digest) in required {
        measurements.require(*pcr, *digest);
    }
    Ok((
        Validator::with_proven_keys(measurements, ek_trust.clone(), proven.clone())
            .with_cpu(cpu.clone()),
        meta.modified().ok(),
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use keel_verifier::measurements::{Expected, REQUIRED_PCRS};

    const H: &str = "0000000000000000000000000000000000000000000000000000000000000000";

    fn enforcing(value: u8) -> String {
        Measurements::new(REQUIRED_PCRS.map(|p| (p, Expected::enforced([value; 32]))))
            .unwrap()
            .to_json()
    }

    #[test]
    fn a_new_file_that_enforces_too_little_keeps_the_old_validator() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("measurements.json");
        std::fs::write(&path, enforcing(1)).unwrap();
        let policy =
            ReloadableValidator::load(&path, EkTrust::default(), vec![(15, [0; 32])]).unwrap();
        let before = policy.current().measurements().clone();
        assert!(before.iter().any(|(p, e)| *p == 15 && !e.warn_only));

        let warn = |p: u32| format!(r#""{p}": {{"expected": "{H}", "warnOnly": true}}"#);
        type Check = fn(&MeasurementsError) -> bool;
        let cases: [(&str, String, Check); 5] = [
            ("empty", "{}".into(), |e| {
                matches!(e, MeasurementsError::Empty)
            }),
            (
                "all warn-only",
                format!("{{{}, {}, {}, {}}}", warn(4), warn(9), warn(11), warn(12)),
                |e| matches!(e, MeasurementsError::NothingEnforced),
            ),
            (
                "PCR 12 missing",
                format!(r#"{{"4": "{H}", "9": "{H}", "11": "{H}"}}"#),
                |e| matches!(e, MeasurementsError::NotEnforced { missing, .. } if missing == &[12]),
            ),
            (
                "PCR 12 warn-only",
                format!(r#"{{"4": "{H}", "9": "{H}", "11": "{H}", {}}}"#, warn(12)),
                |e| matches!(e, MeasurementsError::NotEnforced { warn_only, .. } if warn_only == &[12]),
            ),
            (
                "repeated key",
                format!(
                    r#"{{"4": "{H}", "9": "{H}", "11": "{H}", "12": "{H}", {}}}"#,
                    warn(4)
                ),
                |e| matches!(e, MeasurementsError::DuplicateKey(k) if k == "4"),
            ),
        ];
        for (case, text, expected) in cases {
            std::fs::write(&path, text).unwrap();
            let err = policy.reload().unwrap_err();
            let PolicyError::Parse { source, .. } = &err else {
                panic!("{case}: {err:?}");
            };
            assert!(expected(source), "{case}: {source:?}");
            assert_eq!(policy.current().measurements(), &before, "{case}");
            // A refused file is also refused when it is the first one.
            assert!(
                ReloadableValidator::load(&path, EkTrust::default(), Vec::new()).is_err(),
                "{case}"
            );
        }

        // A file that enforces enough is taken.
        std::fs::write(&path, enforcing(2)).unwrap();
        policy.reload().unwrap();
        let after = policy.current().measurements().clone();
        assert_ne!(after, before);
        assert!(after.iter().any(|(p, e)| *p == 4 && e.digest == [2; 32]));
    }
}
