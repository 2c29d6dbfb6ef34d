//! The node's state disk: a LUKS2 volume set up on first boot or unlocked on
//! later ones, its ext4 file system, and where it and its directories are
//! mounted.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use super::process::run_tool;
use super::{Cryptsetup, DiskError};

/// Name of the opened state disk under `/dev/mapper`.
pub const STATE_MAPPING: &str = "keel-state";

/// A node's state disk: the block device, the tools, and where the opened
/// volume is mounted.
#[derive(Clone, Debug)]
pub struct StateDisk {
    /// The block device.
    pub device: PathBuf,
    /// The cryptsetup program.
    pub cryptsetup: Cryptsetup,
    /// Where the opened volume goes. `None`: the volume is formatted and its
    /// key checked, but never opened (no device-mapper, as in host tests).
    pub mount: Option<StateMount>,
}

/// Where an opened state disk is mounted, and which of its directories are
/// bind-mounted over the paths Kubernetes expects (the image's root is
/// read-only; what must persist and stay confidential lives on the disk),
/// inside the tmpfs the node's components are installed in.
#[derive(Clone, Debug)]
pub struct StateMount {
    /// The tmpfs for what the node runs (`/run/state` on a node), mounted
    /// before the disk: the disk's mount point is inside it.
    pub memory: PathBuf,
    /// `(directory in the tmpfs, relative to it; target path)`.
    pub memory_binds: Vec<(PathBuf, PathBuf)>,
    /// The disk's mount point (`/run/state/disk` on a node).
    pub point: PathBuf,
    /// `(directory on the disk, relative to the mount point; target path)`.
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// Directories of `binds` (on the disk, relative to the mount point)
    /// made mode 0700 before they are bound: etcd's data directory.
    pub private: Vec<PathBuf>,
    /// systemd units that keep their data in those directories, started
    /// (`systemctl start`, in order) once the disk and its binds are
    /// mounted: the container runtime. Nothing else starts them, so they
    /// never write to the image's volatile `/var` instead.
    pub services: Vec<String>,
}

/// What a boot finds on the state disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskState {
    /// No LUKS header: a new disk, or one marked for reset.
    Fresh,
    /// The disk of a node that finished its provisioning.
    Member {
        /// The LUKS header's UUID.
        uuid: String,
    },
    /// Set up by a provisioning that never finished (the node stopped
    /// during init or join): it holds nothing a member relies on.
    Unfinished {
        /// The LUKS header's UUID.
        uuid: String,
    },
}

impl StateDisk {
    /// The UUID of the disk's LUKS header, `None` for a fresh disk (no
    /// header): whether the node was a member before this boot.
    pub fn initialised_uuid(&self) -> Result<Option<String>, DiskError> {
        if self.cryptsetup.is_luks(&self.device)? {
            self.cryptsetup.uuid(&self.device).map(Some)
        } else {
            Ok(None)
        }
    }

    /// What the disk holds: fresh, a member's, or an unfinished set-up
    /// (its header still labelled [`super::PROVISIONING_LABEL`]). A disk
    /// with any other label, none included, is a member's.
    pub fn inspect(&self) -> Result<DiskState, DiskError> {
        let Some(uuid) = self.initialised_uuid()? else {
            return Ok(DiskState::Fresh);
        };
        Ok(
            if self.cryptsetup.label(&self.device)? == super::PROVISIONING_LABEL {
                DiskState::Unfinished { uuid }
            } else {
                DiskState::Member { uuid }
            },
        )
    }

    /// Resets the disk if its set-up never finished ([`DiskState::Unfinished`]:
    /// the node stopped during an earlier init or join); returns what it
    /// found. Run at start, before anything can take the node lock: an
    /// unfinished set-up found later may be one in progress.
    pub fn reset_unfinished(&self) -> Result<DiskState, DiskError> {
        let found = self.inspect()?;
        if let DiskState::Unfinished { .. } = found {
            self.cryptsetup.mark_for_reset(&self.device)?;
        }
        Ok(found)
    }

    /// Records that the node's provisioning finished: the header's label
    /// becomes [`super::PROVISIONED_LABEL`].
    pub fn finish(&self) -> Result<(), DiskError> {
        self.cryptsetup
            .relabel(&self.device, super::PROVISIONED_LABEL)
    }

    /// Sets up a fresh disk: [`Self::format`], then [`Self::fill`].
    /// Destroys whatever the device held. Returns the mount point.
    pub fn set_up(&self, uuid: &str, key: &[u8]) -> Result<Option<PathBuf>, DiskError> {
        self.format(uuid, key)?;
        self.fill(key)
    }

    /// Formats a fresh disk: LUKS2 with header UUID `uuid` and `key`.
    /// Destroys whatever the device held.
    pub fn format(&self, uuid: &str, key: &[u8]) -> Result<(), DiskError> {
        self.cryptsetup.format_with_uuid(&self.device, uuid, key)
    }

    /// After [`Self::format`], with a [`StateMount`]: opens the disk with
    /// `key`, creates the file system and mounts it. Returns the mount
    /// point; without a mount, nothing happens.
    pub fn fill(&self, key: &[u8]) -> Result<Option<PathBuf>, DiskError> {
        let Some(at) = &self.mount else {
            return Ok(None);
        };
        let mapped = self.cryptsetup.open(&self.device, STATE_MAPPING, key)?;
        make_filesystem(Path::new("mkfs.ext4"), &mapped)?;
        at.mount(&mapped)?;
        Ok(Some(at.point.clone()))
    }

    /// Unlocks a disk set up before: with a [`StateMount`], opens it with
    /// `key` and mounts it; returns the mount point. Without one, nothing
    /// happens.
    pub fn unlock(&self, key: &[u8]) -> Result<Option<PathBuf>, DiskError> {
        let Some(at) = &self.mount else {
            return Ok(None);
        };
        let mapped = self.cryptsetup.open(&self.device, STATE_MAPPING, key)?;
        at.mount(&mapped)?;
        Ok(Some(at.point.clone()))
    }
}

impl StateMount {
    /// Mounts the tmpfs, then `device` at the mount point inside it, then
    /// makes the bind mounts (creating their directories; what is bound
    /// from the tmpfs is checked to be on it), then starts the services.
    fn mount(&self, device: &Path) -> Result<(), DiskError> {
        let memory = mount_memory(&self.memory)?;
        mount(device, &self.point)?;
        let binds = self.memory_binds.iter().map(|b| (&self.memory, b));
        for (root, (inside, target)) in binds.chain(self.binds.iter().map(|b| (&self.point, b))) {
            let source = root.join(inside);
            for dir in [&source, target] {
                std::fs::create_dir_all(dir).map_err(|source| DiskError::CreateMountPoint {
                    path: dir.clone(),
                    source,
                })?;
            }
            if *root == self.point && self.private.contains(inside) {
                make_private(&source)?;
            }
            run_tool(
                Path::new("mount"),
                "mount --bind",
                [OsStr::new("--bind"), source.as_os_str(), target.as_os_str()],
                &source,
            )?;
        }
        for (_, target) in &self.memory_binds {
            if device_of(target)? != memory {
                return Err(DiskError::NotInMemory {
                    path: target.clone(),
                    why: format!("it is not on the tmpfs at {}", self.memory.display()),
                });
            }
        }
        for unit in &self.services {
            run_tool(
                Path::new("systemctl"),
                "systemctl start",
                [OsStr::new("start"), OsStr::new(unit)],
                &self.point,
            )?;
            tracing::info!(unit, "started on the mounted state disk");
        }
        Ok(())
    }
}

/// Makes the directory `dir` mode 0700 (owner only).
fn make_private(dir: &Path) -> Result<(), DiskError> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|source| {
        DiskError::CreateMountPoint {
            path: dir.to_owned(),
            source,
        }
    })
}

/// Largest share of the node's memory the components' tmpfs may take: a
/// Kubernetes version's components take about 330 MiB, twice that while
/// an upgrade stages the next one beside them.
const MEMORY_SIZE: &str = "size=50%";

/// Mounts a tmpfs at `target` (`nosuid,nodev`, mode 0755), creating
/// `target` if needed, and checks that a tmpfs of its own is mounted there:
/// the node must not install what it runs on a disk. Refuses a `target`
/// that is a mount point already (a second mount would hide the first,
/// and the disk mounted inside it). Returns the tmpfs's device.
fn mount_memory(target: &Path) -> Result<u64, DiskError> {
    std::fs::create_dir_all(target).map_err(|source| DiskError::CreateMountPoint {
        path: target.to_owned(),
        source,
    })?;
    if is_mount_point(target)? {
        return Err(DiskError::NotInMemory {
            path: target.to_owned(),
            why: "something is mounted there already".into(),
        });
    }
    let options = format!("nosuid,nodev,mode=0755,{MEMORY_SIZE}");
    run_tool(
        Path::new("mount"),
        "mount",
        [
            OsStr::new("-t"),
            OsStr::new("tmpfs"),
            OsStr::new("-o"),
            OsStr::new(&options),
            OsStr::new("keel-components"),
            target.as_os_str(),
        ],
        target,
    )?;
    check_in_memory(target)?;
    // `/run` is a tmpfs too: the check above holds for a mount that did
    // not happen.
    if !is_mount_point(target)? {
        return Err(DiskError::NotInMemory {
            path: target.to_owned(),
            why: "no file system of its own is mounted there".into(),
        });
    }
    device_of(target)
}

/// The device of the file system `path` is on.
fn device_of(path: &Path) -> Result<u64, DiskError> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path)
        .map(|m| m.dev())
        .map_err(|e| DiskError::NotInMemory {
            path: path.to_owned(),
            why: e.to_string(),
        })
}

/// Whether a file system is mounted at `path`: it is on another device
/// than its parent directory.
fn is_mount_point(path: &Path) -> Result<bool, DiskError> {
    let parent = path.parent().unwrap_or(Path::new("/"));
    Ok(device_of(path)? != device_of(parent)?)
}

/// Refuses unless `path` is on a tmpfs.
fn check_in_memory(path: &Path) -> Result<(), DiskError> {
    /// `TMPFS_MAGIC` of `statfs(2)`.
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    let stat = rustix::fs::statfs(path).map_err(|e| DiskError::NotInMemory {
        path: path.to_owned(),
        why: e.to_string(),
    })?;
    // `f_type`'s integer type differs between C libraries.
    let is_tmpfs = u64::try_from(stat.f_type).is_ok_and(|t| t == TMPFS_MAGIC);
    if is_tmpfs {
        Ok(())
    } else {
        Err(DiskError::NotInMemory {
            path: path.to_owned(),
            why: format!("its file system type is {:#x}, not tmpfs", stat.f_type),
        })
    }
}

/// Creates an ext4 file system labelled `keel-state` on `device` (the opened
/// mapper device of a freshly formatted disk).
pub fn make_filesystem(mkfs: &Path, device: &Path) -> Result<(), DiskError> {
    run_tool(
        mkfs,
        "mkfs.ext4",
        [
            OsStr::new("-q"),
            OsStr::new("-L"),
            OsStr::new("keel-state"),
            device.as_os_str(),
        ],
        device,
    )
}

/// Mounts the ext4 file system on `device` at `target` (`nosuid,nodev`),
/// creating `target` if needed.
pub fn mount(device: &Path, target: &Path) -> Result<(), DiskError> {
    std::fs::create_dir_all(target).map_err(|source| DiskError::CreateMountPoint {
        path: target.to_owned(),
        source,
    })?;
    run_tool(
        Path::new("mount"),
        "mount",
        [
            OsStr::new("-t"),
            OsStr::new("ext4"),
            OsStr::new("-o"),
            OsStr::new("nosuid,nodev"),
            device.as_os_str(),
            target.as_os_str(),
        ],
        device,
    )
}

/// A random (version 4) UUID for a new state disk's LUKS header.
pub fn new_uuid() -> String {
    let mut b = [0u8; 16];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_mount_point_is_told_from_a_directory() {
        assert!(is_mount_point(Path::new("/dev/shm")).unwrap());
        assert!(!is_mount_point(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap());
    }

    #[test]
    fn only_a_tmpfs_counts_as_memory() {
        // /dev/shm is a tmpfs wherever the tests run (the swtpm tests use
        // it); a temporary directory of the build is not.
        check_in_memory(Path::new("/dev/shm")).unwrap();
        let on_disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let refused = check_in_memory(on_disk.path()).unwrap_err();
        assert!(refused.to_string().contains("not tmpfs"), "{refused}");
    }

    #[test]
    fn new_uuids_are_fresh_valid_disk_ids() {
        let a = new_uuid();
        assert!(keel_verifier::keys::disk_id(&a).is_ok());
        assert_ne!(a, new_uuid());
    }
}
