//! The local cluster: two control-plane VMs and a worker VM of the built
//! image under QEMU + OVMF, each with an swtpm whose EK certificate comes
//! from a cluster-owned CA, a state disk, its node config by fw_cfg and
//! QEMU user networking; on the host, the component mirror and the
//! operator CLI (`keel init`, `keel verify -o json`, `keel recover`) over
//! aTLS. Everything stays on this machine: each VM is 10.0.2.15 behind its
//! own NAT and reaches the host's loopback as 10.0.2.2; joining nodes reach
//! each control plane's join service through a host port forwarded to it,
//! and every node config lists all of them.
//!
//! [`Cluster::up`] runs the phases (build, EK CA + TPMs, mirror, configs +
//! measurements, boot, `keel init` of the first control plane, the joins
//! of the second control plane and the worker, summary), each reported
//! with its time. Dropping the [`Cluster`] stops every process it started;
//! [`Cluster::keep`] leaves them running and records them in
//! `build/mini/state.json` for [`procs::down`] and [`procs::status`].
//! `keel-mini` (src/bin/keel-mini.rs) is the command line; the end-to-end
//! scenarios (tests/e2e.rs) run on a [`Cluster`] too.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use crate::image::ImageError;
use crate::vm::VmError;

pub mod cluster;
pub mod config;
pub mod disk;
pub mod init;
pub mod operator;
pub mod procs;
pub mod recover;
pub mod verify;

pub use cluster::{Cluster, Node, UpOptions};

/// Why a step of the local cluster failed. Each names what to read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MiniError {
    /// A VM could not be started or did not print what was awaited.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The image directory is incomplete.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The EK CA or a TPM could not be made.
    #[error("EK CA or TPM: {0}")]
    Swtpm(#[from] keel_testkit::swtpm::SwtpmError),
    /// A file operation failed.
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A program could not be started.
    #[error("start {program}")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A program exited with a failure.
    #[error("{what} failed ({status}); see {log}")]
    Failed {
        /// What ran.
        what: String,
        /// Its exit status.
        status: ExitStatus,
        /// Its output.
        log: PathBuf,
    },
    /// Something awaited did not happen in time.
    #[error("{what} within {patience:?}; see {log}")]
    Timeout {
        /// What did not happen.
        what: String,
        /// How long was waited.
        patience: Duration,
        /// The log to read.
        log: PathBuf,
    },
    /// A JSON document could not be read or written.
    #[error("{path}: {source}")]
    Json {
        /// The document.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A host program the cluster needs is not installed.
    #[error("{tool} is missing: run `make deps`")]
    MissingTool {
        /// The program or file.
        tool: String,
    },
    /// A result is not what it must be (the message names the log).
    #[error("{0}")]
    Check(String),
    /// No kept cluster is recorded.
    #[error("no cluster is running ({0} does not exist); `keel-mini up --keep` starts one")]
    NotRunning(PathBuf),
}

/// Maps an I/O error on `path`.
/// Runs `keel` with `args` to its end and writes what it printed (stdout,
/// then stderr) to `log`, for people; returns the output.
pub(crate) fn run_keel(
    keel: &std::path::Path,
    args: impl IntoIterator<Item = impl AsRef<std::ffi::OsStr>>,
    log: &std::path::Path,
) -> Result<std::process::Output, MiniError> {
    let output = std::process::Command::new(keel)
        .args(args)
        .output()
        .map_err(|source| MiniError::Spawn {
            program: keel.display().to_string(),
            source,
        })?;
    let mut text = output.stdout.clone();
    text.extend_from_slice(b"\n--- stderr\n");
    text.extend_from_slice(&output.stderr);
    std::fs::write(log, &text).map_err(io(log))?;
    Ok(output)
}

pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> MiniError {
    let path = path.into();
    move |source| MiniError::Io { path, source }
}

/// The phases of a run with their times, each reported as it ends.
#[derive(Debug, Default)]
pub struct Phases {
    done: Vec<(String, Duration)>,
    quiet: bool,
}

impl Phases {
    /// Phases reported on standard error as they end (`quiet`: not reported).
    pub fn new(quiet: bool) -> Self {
        Self {
            done: Vec::new(),
            quiet,
        }
    }

    /// Runs `f` as phase `name` and records (and reports) its time.
    pub fn run<T>(
        &mut self,
        name: &str,
        f: impl FnOnce() -> Result<T, MiniError>,
    ) -> Result<T, MiniError> {
        let start = Instant::now();
        let result = f();
        let took = start.elapsed();
        if !self.quiet {
            let outcome = if result.is_ok() { "" } else { "  (failed)" };
            eprintln!(
                "keel-mini: {name:<28} {:6.1} s{outcome}",
                took.as_secs_f64()
            );
        }
        self.done.push((name.to_owned(), took));
        result
    }

    /// The finished phases in order.
    pub fn done(&self) -> &[(String, Duration)] {
        &self.done
    }

    /// The sum of the phase times.
    pub fn total(&self) -> Duration {
        self.done.iter().map(|(_, d)| *d).sum()
    }
}
