//! A version's components installed beside the running ones, and the
//! switch between the two.
//!
//! Components install into a few directories (the versions table uses
//! `/run/state/bin`, `/opt/cni/bin` and `/opt/kubernetes/patches`: a
//! component's own directory when it is an archive, its parent otherwise).
//! The new version goes into a twin of each, `<dir>.keel-next`, on the same
//! file system (the components' tmpfs, or the same bind mount of it), so
//! the running binaries are untouched while it downloads. The switch
//! exchanges each twin with its directory in one
//! `renameat2(RENAME_EXCHANGE)`: each directory moves from old to new at
//! once, never through a state where a binary is missing or half written.
//! The directories switch one after another, not as a set: a reboot
//! between them finds the upgrade's switch record, and the directories are
//! emptied and installed again from the version record.
//! Switching back exchanges them again; [`Staging::discard`] removes the
//! twins (after a switch: the previous version).

use std::path::{Path, PathBuf};

use keel_installer::Component;
use rustix::fs::{renameat_with, RenameFlags, CWD};

/// Suffix of a staged directory.
pub const STAGED_SUFFIX: &str = ".keel-next";

/// Where component directories may be: the binaries' directory in the
/// components' tmpfs itself or below it, or strictly below the tmpfs
/// directories bind-mounted at `/opt/cni` and `/opt/kubernetes` (the
/// versions table uses `/run/state/bin`, `/opt/cni/bin` and
/// `/opt/kubernetes/patches`). A switch, and the emptying of an
/// interrupted one, never reaches a mount point, the state disk's other
/// directories or the records under `/etc/kubernetes`. A directory named
/// like a twin (`….keel-next`, or below one) is not switchable: it would be
/// another directory's twin, removed when that one is staged or discarded.
pub fn switchable(dir: &str) -> bool {
    let below = |parent: &str| dir.strip_prefix(parent).is_some_and(|r| r.starts_with('/'));
    keel_installer::InstallPath::new(dir).is_ok()
        && !dir.split('/').any(|part| part.ends_with(STAGED_SUFFIX))
        && (dir == crate::paths::BIN_DIR
            || below(crate::paths::BIN_DIR)
            || below("/opt/cni")
            || below("/opt/kubernetes"))
}

/// A component directory and its staged twin.
#[derive(Debug)]
struct Twin {
    /// The directory as install paths name it (`/run/state/bin`).
    dir: String,
    /// The directory under the node root.
    live: PathBuf,
    /// Its twin under the node root.
    next: PathBuf,
    /// What the switch did: `None` before it, else whether the live
    /// directory existed (exchanged) or not (moved into place).
    switched: Option<bool>,
}

/// The staged directories of one upgrade.
#[derive(Debug)]
pub struct Staging {
    twins: Vec<Twin>,
}

/// Why staging or switching failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StagingError {
    /// Two component directories nest; they cannot be switched apart.
    #[error("component directories {0} and {1} nest")]
    Nested(String, String),
    /// A component directory is not one a switch may touch.
    #[error(
        "component directory {0} is not /run/state/bin or below it, nor below /opt/cni or /opt/kubernetes, or it is named like a staged twin (*.keel-next)"
    )]
    NotSwitchable(String),
    /// A component path could not be rewritten into the staged directory.
    #[error("component {0}: staged install path")]
    Path(String, #[source] keel_installer::ComponentError),
    /// A file system operation failed.
    #[error("{what} {path:?}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The directories `components` install into, sorted, each once.
pub fn component_dirs(components: &[Component]) -> Vec<String> {
    let mut dirs: Vec<String> = components.iter().map(component_dir).collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// The directories `components` install into ([`component_dirs`]), if an
/// upgrade can switch them: none nests in another and each is
/// [`switchable`]. Init checks a cluster's components with it, so that no
/// cluster starts with components no upgrade could replace.
pub fn check_switchable(components: &[Component]) -> Result<Vec<String>, StagingError> {
    let dirs = component_dirs(components);
    for (i, a) in dirs.iter().enumerate() {
        for b in dirs.iter().skip(i + 1) {
            if a == "/" || b.starts_with(&format!("{a}/")) {
                return Err(StagingError::Nested(a.clone(), b.clone()));
            }
        }
    }
    if let Some(dir) = dirs.iter().find(|d| !switchable(d)) {
        return Err(StagingError::NotSwitchable(dir.clone()));
    }
    Ok(dirs)
}

/// The directory a component installs into.
fn component_dir(component: &Component) -> String {
    let path = component.install_path().as_str();
    if component.extract() {
        return path.trim_end_matches('/').to_owned();
    }
    match path.rsplit_once('/') {
        Some(("", _)) | None => "/".to_owned(),
        Some((dir, _)) => dir.to_owned(),
    }
}

impl Staging {
    /// The twins for `components` under the node `root`, emptied (a stale
    /// twin of an earlier attempt is removed), and the components with
    /// their install paths moved into the twins, in the same order.
    pub fn prepare(
        root: &Path,
        components: &[Component],
    ) -> Result<(Self, Vec<Component>), StagingError> {
        let dirs = check_switchable(components)?;
        let twins: Vec<Twin> = dirs
            .iter()
            .map(|dir| {
                let (live, next) = twin_paths(root, dir);
                Twin {
                    dir: dir.clone(),
                    live,
                    next,
                    switched: None,
                }
            })
            .collect();
        for twin in &twins {
            remove_dir(&twin.next)?;
            std::fs::create_dir_all(&twin.next).map_err(|source| StagingError::Io {
                what: "creating",
                path: twin.next.clone(),
                source,
            })?;
        }
        let staged = components
            .iter()
            .map(|c| {
                let dir = component_dir(c);
                let rest =
                    &c.install_path().as_str()[dir.len().min(c.install_path().as_str().len())..];
                let path = format!("{dir}{STAGED_SUFFIX}{rest}");
                Component::new(c.url(), &c.hash().to_string(), &path, c.extract())
                    .map_err(|e| StagingError::Path(c.name().to_owned(), e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((Self { twins }, staged))
    }

    /// The component directories, as install paths name them.
    pub fn directories(&self) -> Vec<String> {
        self.twins.iter().map(|t| t.dir.clone()).collect()
    }

    /// Puts into the CNI directories' twins (below `/opt/cni`) what a
    /// network plugin put into the live directory and the staged version
    /// does not have: a plugin's DaemonSet copies its binary there from an
    /// init container, which runs again only when its pod is recreated,
    /// not when the kubelet restarts; without it every new pod on the node
    /// would fail to get a network after the switch. Hard links (the twin
    /// is on the same file system), a copy where that fails; symbolic
    /// links as links; directories and other entries are not carried.
    /// Returns how many entries were carried.
    pub fn carry_network_plugins(&self) -> Result<usize, StagingError> {
        let mut carried = 0;
        for twin in self.twins.iter().filter(|t| t.dir.starts_with("/opt/cni/")) {
            let entries = match std::fs::read_dir(&twin.live) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(StagingError::Io {
                        what: "reading",
                        path: twin.live.clone(),
                        source,
                    })
                }
            };
            for entry in entries {
                let io = |what, path: &Path| {
                    let path = path.to_owned();
                    move |source| StagingError::Io { what, path, source }
                };
                let entry = entry.map_err(io("reading", &twin.live))?;
                let (from, to) = (entry.path(), twin.next.join(entry.file_name()));
                if to.symlink_metadata().is_ok() {
                    continue; // the staged version's own
                }
                let kind = entry.file_type().map_err(io("reading", &from))?;
                if kind.is_symlink() {
                    let target = std::fs::read_link(&from).map_err(io("reading", &from))?;
                    std::os::unix::fs::symlink(target, &to).map_err(io("linking", &to))?;
                } else if kind.is_file() {
                    if std::fs::hard_link(&from, &to).is_err() {
                        std::fs::copy(&from, &to).map_err(io("copying", &to))?;
                    }
                } else {
                    continue;
                }
                carried += 1;
            }
        }
        Ok(carried)
    }

    /// Switches every directory to its twin. On an error the directories
    /// switched so far stay switched: call [`Staging::switch_back`].
    pub fn switch(&mut self) -> Result<(), StagingError> {
        for twin in &mut self.twins {
            if twin.switched.is_some() {
                continue;
            }
            let existed = twin.live.exists();
            if existed {
                renameat_with(CWD, &twin.next, CWD, &twin.live, RenameFlags::EXCHANGE)
            } else {
                if let Some(parent) = twin.live.parent() {
                    std::fs::create_dir_all(parent).map_err(|source| StagingError::Io {
                        what: "creating",
                        path: parent.to_owned(),
                        source,
                    })?;
                }
                renameat_with(CWD, &twin.next, CWD, &twin.live, RenameFlags::NOREPLACE)
            }
            .map_err(|errno| StagingError::Io {
                what: "switching",
                path: twin.live.clone(),
                source: errno.into(),
            })?;
            twin.switched = Some(existed);
            tracing::info!(dir = %twin.dir, "component directory switched");
        }
        Ok(())
    }

    /// Undoes [`Staging::switch`] for every directory it switched.
    pub fn switch_back(&mut self) -> Result<(), StagingError> {
        for twin in self.twins.iter_mut().rev() {
            let Some(existed) = twin.switched else {
                continue;
            };
            let flags = if existed {
                RenameFlags::EXCHANGE
            } else {
                RenameFlags::NOREPLACE
            };
            renameat_with(CWD, &twin.live, CWD, &twin.next, flags).map_err(|errno| {
                StagingError::Io {
                    what: "switching back",
                    path: twin.live.clone(),
                    source: errno.into(),
                }
            })?;
            twin.switched = None;
            tracing::info!(dir = %twin.dir, "component directory switched back");
        }
        Ok(())
    }

    /// Removes the twins: the staged version if nothing was switched, the
    /// previous one after a switch.
    pub fn discard(self) -> Result<(), StagingError> {
        for twin in &self.twins {
            remove_dir(&twin.next)?;
        }
        Ok(())
    }
}

/// Removes each of `directories` (install paths) under the node `root`,
/// and its twin: what a switch left half done, before its version is
/// installed again. Nothing is removed if any of them is not
/// [`switchable`].
pub fn clear(root: &Path, directories: &[String]) -> Result<(), StagingError> {
    if let Some(dir) = directories.iter().find(|d| !switchable(d)) {
        return Err(StagingError::NotSwitchable(dir.clone()));
    }
    for dir in directories {
        let (live, next) = twin_paths(root, dir);
        remove_dir(&live)?;
        remove_dir(&next)?;
    }
    Ok(())
}

/// The component directory `dir` (an install path) under the node `root`,
/// and its staged twin.
fn twin_paths(root: &Path, dir: &str) -> (PathBuf, PathBuf) {
    let under = |dir: &str| root.join(dir.trim_start_matches('/'));
    (under(dir), under(&format!("{dir}{STAGED_SUFFIX}")))
}

fn remove_dir(path: &Path) -> Result<(), StagingError> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(StagingError::Io {
            what: "removing",
            path: path.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn component(path: &str, extract: bool) -> Component {
        Component::new(
            "https://example.com/x",
            &format!("sha256:{}", "ab".repeat(32)),
            path,
            extract,
        )
        .unwrap()
    }

    #[test]
    fn twins_switch_at_once_and_back() {
        let root = tempfile::tempdir().unwrap();
        let bin = root.path().join("run/state/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("kubelet"), "old").unwrap();
        let components = [
            component("/run/state/bin/kubelet", false),
            component("/run/state/bin", true),
            component("/opt/cni/bin", true),
        ];
        let (mut staging, staged) = Staging::prepare(root.path(), &components).unwrap();
        let paths: Vec<&str> = staged.iter().map(|c| c.install_path().as_str()).collect();
        assert_eq!(
            paths,
            [
                "/run/state/bin.keel-next/kubelet",
                "/run/state/bin.keel-next",
                "/opt/cni/bin.keel-next"
            ]
        );
        std::fs::write(root.path().join("run/state/bin.keel-next/kubelet"), "new").unwrap();
        std::fs::write(root.path().join("opt/cni/bin.keel-next/bridge"), "new").unwrap();

        staging.switch().unwrap();
        assert_eq!(std::fs::read_to_string(bin.join("kubelet")).unwrap(), "new");
        assert!(root.path().join("opt/cni/bin/bridge").exists());
        staging.switch_back().unwrap();
        assert_eq!(std::fs::read_to_string(bin.join("kubelet")).unwrap(), "old");
        assert!(!root.path().join("opt/cni/bin").exists());

        staging.switch().unwrap();
        staging.discard().unwrap();
        assert_eq!(std::fs::read_to_string(bin.join("kubelet")).unwrap(), "new");
        assert!(!root.path().join("run/state/bin.keel-next").exists());
    }

    #[test]
    fn only_component_directories_are_switched_or_cleared() {
        for dir in [
            "/run/state/bin",
            "/run/state/bin/x",
            "/opt/cni/bin",
            "/opt/kubernetes/patches",
        ] {
            assert!(switchable(dir), "{dir}");
        }
        for dir in [
            "/opt/cni",
            "/opt/kubernetes",
            "/run/state",
            "/run/state/kubernetes",
            "/run/state/binary",
            "/etc/kubernetes/keel",
            "/var/lib/kubelet",
            "/opt/cni/../../etc",
            "/",
            // Another directory's twin, or below one.
            "/opt/cni/bin.keel-next",
            "/opt/cni/bin.keel-next/x",
            "/run/state/bin/x.keel-next",
        ] {
            assert!(!switchable(dir), "{dir}");
        }
        let root = tempfile::tempdir().unwrap();
        let canary = root.path().join("opt/cni/canary");
        std::fs::create_dir_all(canary.parent().unwrap()).unwrap();
        std::fs::write(&canary, "kept").unwrap();
        assert!(matches!(
            clear(root.path(), &["/opt/cni/bin".into(), "/opt/cni".into()]),
            Err(StagingError::NotSwitchable(_))
        ));
        assert!(canary.exists());
        assert!(matches!(
            Staging::prepare(root.path(), &[component("/opt/cni/x", false)]),
            Err(StagingError::NotSwitchable(_))
        ));
    }

    #[test]
    fn nested_directories_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let components = [component("/opt/a", true), component("/opt/a/b/file", false)];
        assert!(matches!(
            Staging::prepare(root.path(), &components),
            Err(StagingError::Nested(..))
        ));
    }
}
