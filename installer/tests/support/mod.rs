//! Shared helpers of the installer tests: an installer pointed at the local
//! mirror with short retry delays, and filesystem checks.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_installer::{Component, DownloadConfig, Installer, InstallerConfig, Mirror, RetryPolicy};
use keel_testkit::mirror::MirrorServer;

/// Retries that keep tests fast: 3 attempts, 10–50 ms apart, 10 s in all.
pub fn fast_retries() -> RetryPolicy {
    RetryPolicy {
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        max_attempts: 3,
        deadline: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(2),
    }
}

/// An installer writing below `root`, fetching through `mirror` if given.
pub fn installer(root: &Path, mirror: Option<&MirrorServer>, retry: RetryPolicy) -> Installer {
    Installer::new(InstallerConfig {
        download: DownloadConfig {
            retry,
            ..DownloadConfig::default()
        },
        mirror: mirror.map(|m| Mirror::new(&m.base_url()).unwrap()),
        root: root.to_path_buf(),
        ..InstallerConfig::default()
    })
    .unwrap()
}

/// An installer like [`installer`] that keeps verified components in
/// `/var/lib/keel/kept` below `root`.
pub fn keeping_installer(root: &Path, mirror: &MirrorServer, retry: RetryPolicy) -> Installer {
    keeping_installer_with(
        root,
        mirror,
        DownloadConfig {
            retry,
            ..DownloadConfig::default()
        },
    )
}

/// [`keeping_installer`] with the download settings `download`.
pub fn keeping_installer_with(
    root: &Path,
    mirror: &MirrorServer,
    download: DownloadConfig,
) -> Installer {
    Installer::new(InstallerConfig {
        download,
        mirror: Some(Mirror::new(&mirror.base_url()).unwrap()),
        root: root.to_path_buf(),
        kept: Some(keel_installer::InstallPath::new(KEPT).unwrap()),
        ..InstallerConfig::default()
    })
    .unwrap()
}

/// [`keeping_installer_with`] fast retries and downloads of at most
/// `max_bytes`, the bound a kept copy is read to as well.
pub fn keeping_installer_limited(root: &Path, mirror: &MirrorServer, max_bytes: u64) -> Installer {
    keeping_installer_with(
        root,
        mirror,
        DownloadConfig {
            retry: fast_retries(),
            max_bytes,
            ..DownloadConfig::default()
        },
    )
}

/// Where [`keeping_installer`] keeps components (below its root).
pub const KEPT: &str = "/var/lib/keel/kept";

/// Where a keeping installer with its root at `root` keeps `component`,
/// a file of `extension` (`bin`, `tgz`) named by its hash.
pub fn kept_copy(root: &Path, component: &Component, extension: &str) -> PathBuf {
    root.join(KEPT.trim_start_matches('/'))
        .join(format!("{}.{extension}", component.hash().to_hex()))
}

/// A single-file component served by the mirror at `path`, installed at
/// `/run/state/bin/<name>` (below the installer's root) with the hash `hash`.
pub fn file_component(mirror: &MirrorServer, path: &str, hash: &str, name: &str) -> Component {
    let install = format!("/run/state/bin/{name}");
    Component::new(&mirror.url(path), hash, &install, false).unwrap()
}

/// The error and its causes, `: `-joined.
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    keel_installer::ErrorChain(error).to_string()
}

/// The permission bits of `path`.
pub fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

/// Every entry left in `dir` (names), sorted; empty if `dir` is missing.
pub fn entries(dir: &Path) -> Vec<String> {
    let Ok(read) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = read
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Asserts nothing is at `path` (not even a dangling symlink) and no
/// temporary file or staging directory is left beside it.
pub fn assert_nothing_installed(path: &Path) {
    assert!(
        std::fs::symlink_metadata(path).is_err(),
        "{path:?} exists after a failed install"
    );
    let parent: PathBuf = path.parent().unwrap().to_path_buf();
    let left: Vec<String> = entries(&parent)
        .into_iter()
        .filter(|n| n.contains("keel"))
        .collect();
    assert!(
        left.is_empty(),
        "temporary files left in {parent:?}: {left:?}"
    );
}
