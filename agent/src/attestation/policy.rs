//! The verifier's policy as a running service holds it: the measurements
//! file, re-read while the service runs, behind a swappable validator.
//! While a new image rolls out, a second file next to it
//! ([`staged_path`]) holds the new image's measurements, and a peer that
//! matches either set is accepted (one [`Validator`], two sets).
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

use crate::files::WriteFileError;

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

/// The staged measurements file that belongs to the measurements file
/// `path`: `join-measurements.json` → `join-measurements.staged.json`.
pub fn staged_path(path: &Path) -> PathBuf {
    path.with_extension("staged.json")
}

/// Writes the accepted sets for a [`ReloadableValidator`] of `path`: the
/// current set to `path`, then the staged set to [`staged_path`] (removed
/// when there is none). Each file is replaced atomically; writers in this
/// process take turns over both, so the two files are one writer's pair.
pub fn write_accepted(
    path: &Path,
    current: &Measurements,
    staged: Option<&Measurements>,
) -> Result<(), WriteFileError> {
    static WRITING: Mutex<()> = Mutex::new(());
    let _turn = WRITING.lock().unwrap_or_else(PoisonError::into_inner);
    crate::files::write_private(path, current.to_json().as_bytes())?;
    let staged_file = staged_path(path);
    match staged {
        Some(staged) => crate::files::write_private(&staged_file, staged.to_json().as_bytes()),
        None => match std::fs::remove_file(&staged_file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(WriteFileError {
                path: staged_file,
                source: e,
            }),
            _ => Ok(()),
        },
    }
}

/// When the two files were last modified (`None`: absent or unknown).
type Modified = (Option<SystemTime>, Option<SystemTime>);

/// A validator built from a measurements file (and, if present, its staged
/// file) that can be re-read.
pub struct ReloadableValidator {
    path: PathBuf,
    ek_trust: EkTrust,
    cpu: Arc<CpuTrust>,
    required: Required,
    proven: Arc<ProvenKeys>,
    current: Arc<SwappableValidator<Validator>>,
    modified: Mutex<Modified>,
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

    /// What the policy requires of CPU evidence (the variant and its
    /// roots), for validators that hold the same nodes to it.
    pub fn cpu(&self) -> Arc<CpuTrust> {
        self.cpu.clone()
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

    /// Reloads when either file's modification time changed (or the
    /// staged file appeared or went).
    pub fn reload_if_changed(&self) -> Result<bool, PolicyError> {
        let modified = modified_times(&self.path);
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

fn modified_times(path: &Path) -> Modified {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    (modified(path), modified(&staged_path(path)))
}

fn build(
    path: &Path,
    ek_trust: &EkTrust,
    cpu: &Arc<CpuTrust>,
    required: &Required,
    proven: &Arc<ProvenKeys>,
) -> Result<(Validator, Modified), PolicyError> {
    let modified = modified_times(path);
    let current = read_measurements(path)?;
    let staged_file = staged_path(path);
    let staged = match std::fs::symlink_metadata(&staged_file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        _ => Some(read_measurements(&staged_file)?),
    };
    Ok((
        Validator::accepting(current, staged, required, ek_trust.clone(), proven.clone())
            .with_cpu(cpu.clone()),
        modified,
    ))
}

fn read_measurements(path: &Path) -> Result<Measurements, PolicyError> {
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
    Measurements::parse(&bytes).map_err(|source| PolicyError::Parse {
        path: path.to_owned(),
        source,
    })
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

    #[test]
    fn a_staged_file_adds_a_set_and_a_bad_one_keeps_the_old_validator() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("join-measurements.json");
        std::fs::write(&path, enforcing(1)).unwrap();
        let required = vec![(15, [0; 32])];
        let policy = ReloadableValidator::load(&path, EkTrust::default(), required).unwrap();
        assert!(policy.current().staged().is_none());

        // Written by the one writer: both sets, the required values in each.
        let staged = Measurements::parse(enforcing(2).as_bytes()).unwrap();
        let current = Measurements::parse(enforcing(1).as_bytes()).unwrap();
        write_accepted(&path, &current, Some(&staged)).unwrap();
        assert!(policy.reload_if_changed().unwrap());
        let validator = policy.current();
        let with_15 = validator.staged().unwrap();
        assert!(with_15.iter().any(|(p, e)| *p == 4 && e.digest == [2; 32]));
        assert!(with_15.iter().any(|(p, e)| *p == 15 && !e.warn_only));

        // A staged file that enforces too little: the old validator stays.
        std::fs::write(staged_path(&path), r#"{"4": "00"}"#).unwrap();
        assert!(policy.reload().is_err());
        assert_eq!(policy.current().staged(), Some(with_15));

        // No staged set: the file goes, and so does the second set.
        write_accepted(&path, &current, None).unwrap();
        assert!(!staged_path(&path).exists());
        policy.reload().unwrap();
        assert!(policy.current().staged().is_none());
    }
}
