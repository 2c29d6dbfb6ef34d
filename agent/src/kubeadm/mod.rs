//! Driving kubeadm: its configuration files and its command line.
//!
//! * [`config`]: `InitConfiguration`/`ClusterConfiguration` for `kubeadm
//!   init` and `JoinConfiguration` for `kubeadm join`, in the API version
//!   the Kubernetes version needs, from checked inputs.
//! * [`write_config`]: puts a configuration file in place atomically, mode
//!   0600 (it carries the bootstrap token).
//! * [`run`]: runs `kubeadm init`/`join` with a time limit, streaming its
//!   output, and returns the admin kubeconfig after `init`.
//!
//! kubeadm is an external program (installed as a verified, measured
//! component); keel drives it through its documented command line and
//! configuration files only.

pub mod config;
pub mod run;
mod yaml;

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

pub use config::{
    BootstrapToken, CaCertHash, CertificateKey, ConfigApi, ConfigError, ControlPlaneJoin,
    InitConfig, JoinConfig, ParseSecretError, DEFAULT_PATCHES_DIR,
};
pub use run::{Kubeadm, KubeadmError};

/// Writing a configuration file failed.
#[derive(Debug, thiserror::Error)]
#[error("writing kubeadm configuration {path:?}")]
pub struct WriteConfigError {
    /// The file.
    pub path: PathBuf,
    /// The cause.
    #[source]
    pub source: std::io::Error,
}

/// Writes `contents` to `path` atomically with mode 0600: a temporary file
/// in the same directory (created 0600, written, synced), renamed over
/// `path`, then the directory synced. Creates the directory (0700) if needed.
pub fn write_config(path: &Path, contents: &str) -> Result<(), WriteConfigError> {
    let fail = |source| WriteConfigError {
        path: path.to_owned(),
        source,
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(fail)?;
    let name = path
        .file_name()
        .ok_or_else(|| fail(std::io::Error::other("no file name")))?;
    let mut temp_name = std::ffi::OsString::from(".");
    temp_name.push(name);
    temp_name.push(format!(".tmp-{}", std::process::id()));
    let temp = dir.join(temp_name);
    let _ = fs::remove_file(&temp);
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()?;
        fs::rename(&temp, path)?;
        fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = fs::remove_file(&temp);
    }
    written.map_err(fail)
}
