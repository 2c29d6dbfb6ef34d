//! State-disk encryption: LUKS2 through the `cryptsetup` program.
//!
//! The disk key is handed to `cryptsetup` on its standard input
//! (`--key-file=-`), never in its arguments (visible in `/proc/*/cmdline`)
//! and never in logs or error messages. Arguments are built by a pure
//! function ([`Cryptsetup::args`]) that never sees the key.
//!
//! Choices:
//! * **KDF: PBKDF2-SHA256 with the minimum 1000 iterations.** The key is 32
//!   random bytes from the key service, not a password: a slow or
//!   memory-hard KDF adds no strength and costs boot time, and Argon2's
//!   default memory cost (up to 1 GiB) can fail in small VMs.
//! * **Reset marker: the LUKS header is destroyed.** [`Cryptsetup::mark_for_reset`]
//!   erases every keyslot (`cryptsetup erase`), then removes the LUKS
//!   signatures (`wipefs --all`). The next boot finds no LUKS header
//!   ([`Cryptsetup::is_luks`] is false) and formats the disk afresh; the old
//!   contents are unrecoverable, since the volume key lived only in the
//!   erased keyslots. A flag file would need a writable place outside the
//!   disk and could survive a failed format; the header is the one place
//!   every boot reads anyway.
//!
//! Opening a volume needs device-mapper (VMs only): a [`StateDisk`] without
//! a [`StateMount`] (host tests) is formatted and key-checked, never opened.

use std::ffi::{OsStr, OsString};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

/// Shortest accepted disk key.
pub const MIN_KEY_LEN: usize = 16;
/// Largest accepted disk key (cryptsetup's key-file limit is far higher).
pub const MAX_KEY_LEN: usize = 512;
/// PBKDF2 iterations for the keyslot (cryptsetup's minimum).
pub const PBKDF2_ITERATIONS: u32 = 1000;
/// Most stderr kept in an error.
const MAX_STDERR: usize = 2048;

/// A disk operation that failed; each variant names the operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskError {
    /// The key is shorter than [`MIN_KEY_LEN`] or longer than [`MAX_KEY_LEN`].
    #[error("disk key must be {MIN_KEY_LEN} to {MAX_KEY_LEN} bytes, got {0}")]
    KeyLength(usize),
    /// The program could not be started or waited for.
    #[error("running {program:?} for {operation}")]
    Spawn {
        /// What was being done.
        operation: &'static str,
        /// The program.
        program: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing the key to the program's standard input failed.
    #[error("passing the key to {operation}")]
    WriteKey {
        /// What was being done.
        operation: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The program exited unsuccessfully.
    #[error("{operation} on {device:?} failed ({status}): {stderr}")]
    Failed {
        /// What was being done.
        operation: &'static str,
        /// The device.
        device: PathBuf,
        /// The exit status.
        status: ExitStatus,
        /// The end of the program's standard error.
        stderr: String,
    },
    /// The mount point could not be created.
    #[error("creating mount point {path:?}")]
    CreateMountPoint {
        /// The mount point.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `luksUUID` printed something that is not a UUID.
    #[error("luksUUID of {device:?} printed no UUID")]
    Uuid {
        /// The device.
        device: PathBuf,
    },
}

/// A cryptsetup operation, without its key. The key of keyed operations is
/// sent on standard input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation<'a> {
    /// `isLuks`.
    IsLuks,
    /// `luksFormat` (keyed).
    Format,
    /// `luksFormat --uuid` (keyed): the header gets a UUID chosen in advance,
    /// so the key derived from it can be used for the format itself.
    FormatWithUuid {
        /// The UUID.
        uuid: &'a str,
    },
    /// `luksUUID`.
    Uuid,
    /// `open --test-passphrase` (keyed).
    TestKey,
    /// `open` as `/dev/mapper/<name>` (keyed).
    Open {
        /// The mapping name.
        name: &'a str,
    },
    /// `close`.
    Close {
        /// The mapping name.
        name: &'a str,
    },
    /// `erase`: destroys every keyslot.
    Erase,
}

impl Operation<'_> {
    /// The operation's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::IsLuks => "isLuks",
            Self::Format | Self::FormatWithUuid { .. } => "luksFormat",
            Self::Uuid => "luksUUID",
            Self::TestKey => "open --test-passphrase",
            Self::Open { .. } => "open",
            Self::Close { .. } => "close",
            Self::Erase => "erase",
        }
    }

    /// Whether the key goes to standard input.
    pub fn keyed(self) -> bool {
        matches!(
            self,
            Self::Format | Self::FormatWithUuid { .. } | Self::TestKey | Self::Open { .. }
        )
    }
}

/// The `cryptsetup` program.
#[derive(Debug, Clone)]
pub struct Cryptsetup {
    program: PathBuf,
    wipefs: PathBuf,
}

impl Default for Cryptsetup {
    /// `cryptsetup` and `wipefs` from `PATH`.
    fn default() -> Self {
        Self::new("cryptsetup", "wipefs")
    }
}

impl Cryptsetup {
    /// Uses the given `cryptsetup` and `wipefs` programs.
    pub fn new(program: impl Into<PathBuf>, wipefs: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            wipefs: wipefs.into(),
        }
    }

    /// The arguments of `operation` on `device`. Pure; never contains a key:
    /// keyed operations read it from standard input (`--key-file=-`).
    pub fn args(operation: Operation<'_>, device: &Path) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |a: &str| args.push(a.into());
        match operation {
            Operation::IsLuks => push("isLuks"),
            Operation::Format | Operation::FormatWithUuid { .. } => {
                if let Operation::FormatWithUuid { uuid } = operation {
                    push("--uuid");
                    push(uuid);
                }
                for a in [
                    "luksFormat",
                    "--batch-mode",
                    "--type",
                    "luks2",
                    "--pbkdf",
                    "pbkdf2",
                    "--pbkdf-force-iterations",
                ] {
                    push(a);
                }
                push(&PBKDF2_ITERATIONS.to_string());
            }
            Operation::Uuid => push("luksUUID"),
            Operation::TestKey => {
                push("open");
                push("--test-passphrase");
            }
            Operation::Open { .. } => {
                push("open");
                push("--type");
                push("luks2");
            }
            Operation::Close { name } => {
                push("close");
                push(name);
                return args;
            }
            Operation::Erase => {
                push("erase");
                push("--batch-mode");
            }
        }
        if operation.keyed() {
            args.push("--key-file=-".into());
        }
        args.push(device.as_os_str().to_owned());
        if let Operation::Open { name } = operation {
            args.push(name.into());
        }
        args
    }

    /// Whether `device` carries a LUKS header.
    pub fn is_luks(&self, device: &Path) -> Result<bool, DiskError> {
        let out = self.run(Operation::IsLuks, device, None)?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(failed(Operation::IsLuks, device, &out)),
        }
    }

    /// Formats `device` as LUKS2 with `key` in keyslot 0 (PBKDF2, see the
    /// module docs). Destroys whatever the device held.
    pub fn format(&self, device: &Path, key: &[u8]) -> Result<(), DiskError> {
        self.run_ok(Operation::Format, device, Some(key)).map(drop)
    }

    /// Formats `device` like [`Cryptsetup::format`], with the header UUID `uuid`.
    pub fn format_with_uuid(&self, device: &Path, uuid: &str, key: &[u8]) -> Result<(), DiskError> {
        self.run_ok(Operation::FormatWithUuid { uuid }, device, Some(key))
            .map(drop)
    }

    /// The LUKS header's UUID, lower-case.
    pub fn uuid(&self, device: &Path) -> Result<String, DiskError> {
        let out = self.run_ok(Operation::Uuid, device, None)?;
        let uuid = String::from_utf8_lossy(&out.stdout)
            .trim()
            .to_ascii_lowercase();
        crate::key_service::disk_key_id(&uuid).map_err(|_| DiskError::Uuid {
            device: device.to_owned(),
        })?;
        Ok(uuid)
    }

    /// Whether `key` opens a keyslot of `device` (nothing is activated).
    pub fn key_matches(&self, device: &Path, key: &[u8]) -> Result<bool, DiskError> {
        let out = self.run(Operation::TestKey, device, Some(key))?;
        match out.status.code() {
            Some(0) => Ok(true),
            // cryptsetup: 2 = no key available with this passphrase.
            Some(2) => Ok(false),
            _ => Err(failed(Operation::TestKey, device, &out)),
        }
    }

    /// Opens `device` as `/dev/mapper/<name>` and returns that path. Needs
    /// device-mapper.
    pub fn open(&self, device: &Path, name: &str, key: &[u8]) -> Result<PathBuf, DiskError> {
        self.run_ok(Operation::Open { name }, device, Some(key))?;
        Ok(Path::new("/dev/mapper").join(name))
    }

    /// Closes the mapping `name`.
    pub fn close(&self, name: &str) -> Result<(), DiskError> {
        self.run_ok(Operation::Close { name }, Path::new(name), None)
            .map(drop)
    }

    /// Marks `device` for reset: erases its keyslots and removes its LUKS
    /// signatures, so the next boot formats it (see the module docs). The
    /// data becomes unrecoverable.
    pub fn mark_for_reset(&self, device: &Path) -> Result<(), DiskError> {
        if self.is_luks(device)? {
            self.run_ok(Operation::Erase, device, None)?;
        }
        // --force: the device may still be held open by dm-crypt; the node
        // reboots right after this.
        run_tool(
            &self.wipefs,
            "wipefs",
            [
                OsStr::new("--all"),
                OsStr::new("--force"),
                OsStr::new("--quiet"),
                device.as_os_str(),
            ],
            device,
        )
    }

    fn run(
        &self,
        operation: Operation<'_>,
        device: &Path,
        key: Option<&[u8]>,
    ) -> Result<std::process::Output, DiskError> {
        if let Some(key) = key {
            if !(MIN_KEY_LEN..=MAX_KEY_LEN).contains(&key.len()) {
                return Err(DiskError::KeyLength(key.len()));
            }
        }
        run_program(
            &self.program,
            operation.name(),
            Self::args(operation, device),
            key,
        )
    }

    fn run_ok(
        &self,
        operation: Operation<'_>,
        device: &Path,
        key: Option<&[u8]>,
    ) -> Result<std::process::Output, DiskError> {
        let out = self.run(operation, device, key)?;
        if out.status.success() {
            Ok(out)
        } else {
            Err(failed(operation, device, &out))
        }
    }
}

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
/// read-only; what must persist and stay confidential lives on the disk).
#[derive(Clone, Debug)]
pub struct StateMount {
    /// The mount point (`/run/state` on a node).
    pub point: PathBuf,
    /// `(directory on the disk, relative to the mount point; target path)`.
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// systemd units that keep their data in those directories, started
    /// (`systemctl start`, in order) once the disk and its binds are
    /// mounted: the container runtime. Nothing else starts them, so they
    /// never write to the image's volatile `/var` instead.
    pub services: Vec<String>,
}

impl StateDisk {
    /// Sets up a fresh disk: LUKS2 with header UUID `uuid` and `key`, then,
    /// with a [`StateMount`], opens it, creates the file system and mounts
    /// it. Destroys whatever the device held. Returns the mount point.
    pub fn set_up(&self, uuid: &str, key: &[u8]) -> Result<Option<PathBuf>, DiskError> {
        self.cryptsetup.format_with_uuid(&self.device, uuid, key)?;
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
    /// Mounts `device` at the mount point, makes the bind mounts (creating
    /// their directories on the disk), then starts the services.
    fn mount(&self, device: &Path) -> Result<(), DiskError> {
        mount(device, &self.point)?;
        for (inside, target) in &self.binds {
            let source = self.point.join(inside);
            for dir in [&source, target] {
                std::fs::create_dir_all(dir).map_err(|source| DiskError::CreateMountPoint {
                    path: dir.clone(),
                    source,
                })?;
            }
            run_tool(
                Path::new("mount"),
                "mount --bind",
                [OsStr::new("--bind"), source.as_os_str(), target.as_os_str()],
                &source,
            )?;
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

/// Runs a keyless tool on `device` and requires it to succeed.
fn run_tool<I, S>(
    program: &Path,
    operation: &'static str,
    args: I,
    device: &Path,
) -> Result<(), DiskError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = run_program(program, operation, args, None)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(failed_named(operation, device, &out))
    }
}

/// Runs `program` with `args`, writing `stdin` (the key) to its standard
/// input and closing it; collects its output.
fn run_program<I, S>(
    program: &Path,
    operation: &'static str,
    args: I,
    stdin: Option<&[u8]>,
) -> Result<std::process::Output, DiskError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let spawn_err = |source| DiskError::Spawn {
        operation,
        program: program.to_owned(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
        match pipe.write_all(bytes) {
            // The program may exit before reading (a missing device): its
            // exit status says why.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            Err(source) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(DiskError::WriteKey { operation, source });
            }
            Ok(()) => {}
        }
        // Dropping the pipe closes it: cryptsetup reads the key to EOF.
    }
    child.wait_with_output().map_err(spawn_err)
}

fn failed(operation: Operation<'_>, device: &Path, out: &std::process::Output) -> DiskError {
    failed_named(operation.name(), device, out)
}

fn failed_named(operation: &'static str, device: &Path, out: &std::process::Output) -> DiskError {
    let text = String::from_utf8_lossy(&out.stderr);
    let text = text.trim();
    let start = text.len().saturating_sub(MAX_STDERR);
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    DiskError::Failed {
        operation,
        device: device.to_owned(),
        status: out.status,
        stderr: text.get(start..).unwrap_or_default().to_owned(),
    }
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
    fn keyed_operations_read_the_key_from_stdin() {
        let dev = Path::new("/dev/vdb");
        let all = [
            Operation::IsLuks,
            Operation::Format,
            Operation::Uuid,
            Operation::TestKey,
            Operation::Open { name: "state" },
            Operation::Close { name: "state" },
            Operation::Erase,
        ];
        for op in all {
            let args = Cryptsetup::args(op, dev);
            let has_stdin_key = args.iter().any(|a| a == "--key-file=-");
            assert_eq!(has_stdin_key, op.keyed(), "{op:?}: {args:?}");
            assert!(
                !args.iter().any(|a| {
                    let a = a.to_string_lossy();
                    a.starts_with("--key-file") && a != "--key-file=-"
                }),
                "{args:?}"
            );
        }
        assert_eq!(
            Cryptsetup::args(Operation::Open { name: "state" }, dev),
            [
                "open",
                "--type",
                "luks2",
                "--key-file=-",
                "/dev/vdb",
                "state"
            ]
        );
        assert_eq!(
            Cryptsetup::args(Operation::Format, dev),
            [
                "luksFormat",
                "--batch-mode",
                "--type",
                "luks2",
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                "--key-file=-",
                "/dev/vdb"
            ]
        );
    }
}
