//! The `cryptsetup` program: LUKS2 operations on a block device, and the
//! erase (with `wipefs`) that marks a disk for reset.
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
//!   every boot reads anyway. A disk whose signatures are there but whose
//!   header cryptsetup cannot read is not taken for such an empty one: it
//!   is a damaged header ([`DiskError::DamagedHeader`]), which nothing
//!   formats.
//! * **Unfinished set-up: the header's label.** A disk is formatted with the
//!   label [`PROVISIONING_LABEL`] and relabelled [`PROVISIONED_LABEL`]
//!   ([`Cryptsetup::relabel`]) once the node's provisioning has finished,
//!   so a boot tells a disk whose set-up a crash or power cut interrupted
//!   from a member's ([`Cryptsetup::label`]). The label is outside the
//!   encryption and anyone who can write the disk can change it; so can
//!   they erase the disk, and a changed label gains no more.
//! * **Cipher pinned: `aes-xts-plain64`, 512-bit key, SHA-256** (cryptsetup's
//!   own defaults, spelt out): an existing disk is key-checked and opened
//!   only if its header says exactly that, through a checked copy of the
//!   header ([`Cryptsetup::detached_header`], [`super::header`]).

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use super::header::{self, DetachedHeader, CIPHER, HASH, KEY_SIZE};
use super::process::{failed_named, run_program, run_tool};
use super::DiskError;

/// Shortest accepted disk key.
pub const MIN_KEY_LEN: usize = 16;
/// Largest accepted disk key (cryptsetup's key-file limit is far higher).
pub const MAX_KEY_LEN: usize = 512;
/// PBKDF2 iterations for the keyslot (cryptsetup's minimum).
pub const PBKDF2_ITERATIONS: u32 = 1000;

/// The LUKS label of a disk whose provisioning has not finished.
pub const PROVISIONING_LABEL: &str = "keel-provisioning";
/// The LUKS label of a disk whose node finished its provisioning.
pub const PROVISIONED_LABEL: &str = "keel-state";
/// Most `luksDump` output read for the label.
const MAX_DUMP: usize = 64 * 1024;

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
    /// `open --test-passphrase` (keyed), with a detached header.
    TestKey {
        /// The checked header copy (`--header`).
        header: &'a Path,
    },
    /// `open` as `/dev/mapper/<name>` (keyed), with a detached header.
    Open {
        /// The mapping name.
        name: &'a str,
        /// The checked header copy (`--header`).
        header: &'a Path,
    },
    /// `luksDump --dump-json-metadata`: the header's JSON metadata.
    DumpMetadata,
    /// `luksDump`: the header's summary, which names its label.
    Dump,
    /// `config --label`: sets the header's label.
    Relabel {
        /// The new label.
        label: &'a str,
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
            Self::TestKey { .. } => "open --test-passphrase",
            Self::Open { .. } => "open",
            Self::DumpMetadata | Self::Dump => "luksDump",
            Self::Relabel { .. } => "config --label",
            Self::Close { .. } => "close",
            Self::Erase => "erase",
        }
    }

    /// Whether the key goes to standard input.
    pub fn keyed(self) -> bool {
        matches!(
            self,
            Self::Format | Self::FormatWithUuid { .. } | Self::TestKey { .. } | Self::Open { .. }
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
                    "--label",
                    PROVISIONING_LABEL,
                    "--cipher",
                    CIPHER,
                    "--key-size",
                ] {
                    push(a);
                }
                push(&(KEY_SIZE * 8).to_string());
                for a in [
                    "--hash",
                    HASH,
                    "--pbkdf",
                    "pbkdf2",
                    "--pbkdf-force-iterations",
                ] {
                    push(a);
                }
                push(&PBKDF2_ITERATIONS.to_string());
            }
            Operation::Uuid => push("luksUUID"),
            Operation::TestKey { header } | Operation::Open { header, .. } => {
                push("open");
                if matches!(operation, Operation::TestKey { .. }) {
                    push("--test-passphrase");
                }
                push("--type");
                push("luks2");
                push("--header");
                args.push(header.as_os_str().to_owned());
            }
            Operation::DumpMetadata => {
                push("luksDump");
                push("--dump-json-metadata");
            }
            Operation::Dump => push("luksDump"),
            Operation::Relabel { label } => {
                push("config");
                push("--label");
                push(label);
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
        if let Operation::Open { name, .. } = operation {
            args.push(name.into());
        }
        args
    }

    /// Whether `device` carries a LUKS header. A device that `cryptsetup`
    /// does not read as LUKS but that still carries a LUKS signature (both
    /// header copies damaged) is [`DiskError::DamagedHeader`], never taken
    /// for an empty disk: formatting it would end any chance of restoring
    /// its header. A disk marked for reset carries none
    /// ([`Cryptsetup::mark_for_reset`]).
    pub fn is_luks(&self, device: &Path) -> Result<bool, DiskError> {
        let out = self.run(Operation::IsLuks, device, None)?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(1) => match luks_signature(device)? {
                Some(offset) => Err(DiskError::DamagedHeader {
                    device: device.to_owned(),
                    offset,
                }),
                None => Ok(false),
            },
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
        keel_verifier::keys::disk_id(&uuid).map_err(|_| DiskError::Uuid {
            device: device.to_owned(),
        })?;
        Ok(uuid)
    }

    /// The LUKS header's label, empty for none.
    pub fn label(&self, device: &Path) -> Result<String, DiskError> {
        let out = self.run_ok(Operation::Dump, device, None)?;
        let dump = out.stdout.get(..MAX_DUMP).unwrap_or(&out.stdout);
        let label = String::from_utf8_lossy(dump)
            .lines()
            .find_map(|line| line.strip_prefix("Label:").map(str::trim))
            .map(str::to_owned)
            .ok_or_else(|| DiskError::Label {
                device: device.to_owned(),
            })?;
        Ok(if label == "(no label)" {
            String::new()
        } else {
            label
        })
    }

    /// Sets the LUKS header's label to `label`.
    pub fn relabel(&self, device: &Path, label: &str) -> Result<(), DiskError> {
        self.run_ok(Operation::Relabel { label }, device, None)
            .map(drop)
    }

    /// A private copy of `device`'s LUKS header, checked against what
    /// [`Cryptsetup::format`] creates ([`super::header`]); fails with
    /// [`DiskError::Header`] naming the first field that differs. The copy
    /// is what the key check and `open` use, so a header changed on the
    /// disk afterwards is never read.
    pub fn detached_header(&self, device: &Path) -> Result<DetachedHeader, DiskError> {
        let (copy, start) = DetachedHeader::copy_of(device)?;
        let refused = |mismatch| DiskError::Header {
            device: device.to_owned(),
            mismatch,
        };
        header::check_version(&start).map_err(refused)?;
        let out = self.run_ok(Operation::DumpMetadata, copy.path(), None)?;
        header::check_metadata(&out.stdout).map_err(refused)?;
        Ok(copy)
    }

    /// Whether `key` opens a keyslot of `device` (nothing is activated),
    /// after the header check ([`Cryptsetup::detached_header`]).
    pub fn key_matches(&self, device: &Path, key: &[u8]) -> Result<bool, DiskError> {
        Self::check_key_len(key)?;
        let copy = self.detached_header(device)?;
        let operation = Operation::TestKey {
            header: copy.path(),
        };
        let out = self.run(operation, device, Some(key))?;
        match out.status.code() {
            Some(0) => Ok(true),
            // cryptsetup: 2 = no key available with this passphrase.
            Some(2) => Ok(false),
            _ => Err(failed(operation, device, &out)),
        }
    }

    /// Opens `device` as `/dev/mapper/<name>` and returns that path, after
    /// the header check ([`Cryptsetup::detached_header`]) and with the
    /// checked copy as its header. Needs device-mapper.
    pub fn open(&self, device: &Path, name: &str, key: &[u8]) -> Result<PathBuf, DiskError> {
        Self::check_key_len(key)?;
        let copy = self.detached_header(device)?;
        let operation = Operation::Open {
            name,
            header: copy.path(),
        };
        self.run_ok(operation, device, Some(key))?;
        Ok(Path::new("/dev/mapper").join(name))
    }

    /// Closes the mapping `name`.
    pub fn close(&self, name: &str) -> Result<(), DiskError> {
        self.run_ok(Operation::Close { name }, Path::new(name), None)
            .map(drop)
    }

    /// Marks `device` for reset: erases its keyslots and removes its LUKS
    /// signatures, so the next boot formats it (see the module docs). The
    /// data becomes unrecoverable, except on a disk whose header was
    /// damaged already: cryptsetup cannot erase keyslots it cannot read.
    pub fn mark_for_reset(&self, device: &Path) -> Result<(), DiskError> {
        match self.is_luks(device) {
            Ok(true) => self.run_ok(Operation::Erase, device, None).map(drop)?,
            // No keyslot to erase that cryptsetup could read; wipefs
            // removes the signatures.
            Ok(false) | Err(DiskError::DamagedHeader { .. }) => {}
            Err(e) => return Err(e),
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
        )?;
        // A wipefs that leaves a signature it does not take for a LUKS
        // header (newer util-linux skips a secondary header whose recorded
        // offset is not where it lies) would leave the disk refused as
        // damaged on every boot.
        clear_luks_signatures(device)
    }

    fn run(
        &self,
        operation: Operation<'_>,
        device: &Path,
        key: Option<&[u8]>,
    ) -> Result<std::process::Output, DiskError> {
        if let Some(key) = key {
            Self::check_key_len(key)?;
        }
        run_program(
            &self.program,
            operation.name(),
            Self::args(operation, device),
            key,
        )
    }

    fn check_key_len(key: &[u8]) -> Result<(), DiskError> {
        if (MIN_KEY_LEN..=MAX_KEY_LEN).contains(&key.len()) {
            Ok(())
        } else {
            Err(DiskError::KeyLength(key.len()))
        }
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

fn failed(operation: Operation<'_>, device: &Path, out: &std::process::Output) -> DiskError {
    failed_named(operation.name(), device, out)
}

/// The LUKS magic of a primary header (LUKS1 and LUKS2), at offset 0.
const PRIMARY_MAGIC: &[u8; 6] = b"LUKS\xba\xbe";
/// The magic of a LUKS2 secondary header.
const SECONDARY_MAGIC: &[u8; 6] = b"SKUL\xba\xbe";
/// Where a LUKS2 secondary header can start: right after the primary,
/// whose size is one of 16 KiB to 4 MiB, doubling.
const SECONDARY_OFFSETS: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];

/// The offsets of the LUKS signatures on `device`: the primary magic at 0
/// and secondary ones where LUKS2 puts them.
fn luks_signatures(device: &Path) -> Result<Vec<u64>, DiskError> {
    use std::os::unix::fs::FileExt as _;
    let file = std::fs::File::open(device).map_err(|e| signature_error(device, e))?;
    let candidates =
        std::iter::once((0, PRIMARY_MAGIC)).chain(SECONDARY_OFFSETS.map(|o| (o, SECONDARY_MAGIC)));
    let mut found = Vec::new();
    for (offset, magic) in candidates {
        let mut bytes = [0u8; 6];
        match file.read_exact_at(&mut bytes, offset) {
            Ok(()) if &bytes == magic => found.push(offset),
            Ok(()) => {}
            // The device ends before this offset.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(signature_error(device, e)),
        }
    }
    Ok(found)
}

/// The offset of the first LUKS signature on `device`, if any.
fn luks_signature(device: &Path) -> Result<Option<u64>, DiskError> {
    Ok(luks_signatures(device)?.first().copied())
}

/// Overwrites every LUKS signature left on `device` with zeros.
fn clear_luks_signatures(device: &Path) -> Result<(), DiskError> {
    use std::os::unix::fs::FileExt as _;
    let left = luks_signatures(device)?;
    if left.is_empty() {
        return Ok(());
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(device)
        .map_err(|e| signature_error(device, e))?;
    for offset in left {
        file.write_all_at(&[0; PRIMARY_MAGIC.len()], offset)
            .map_err(|e| signature_error(device, e))?;
    }
    file.sync_all().map_err(|e| signature_error(device, e))
}

fn signature_error(device: &Path, source: std::io::Error) -> DiskError {
    DiskError::SignatureIo {
        device: device.to_owned(),
        source,
    }
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
            Operation::TestKey {
                header: Path::new("/tmp/h"),
            },
            Operation::Open {
                name: "state",
                header: Path::new("/tmp/h"),
            },
            Operation::DumpMetadata,
            Operation::Dump,
            Operation::Relabel {
                label: PROVISIONED_LABEL,
            },
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
            Cryptsetup::args(
                Operation::Open {
                    name: "state",
                    header: Path::new("/tmp/h")
                },
                dev
            ),
            [
                "open",
                "--type",
                "luks2",
                "--header",
                "/tmp/h",
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
                "--label",
                "keel-provisioning",
                "--cipher",
                "aes-xts-plain64",
                "--key-size",
                "512",
                "--hash",
                "sha256",
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                "--key-file=-",
                "/dev/vdb"
            ]
        );
        assert_eq!(
            Cryptsetup::args(
                Operation::TestKey {
                    header: Path::new("/tmp/h")
                },
                dev
            ),
            [
                "open",
                "--test-passphrase",
                "--type",
                "luks2",
                "--header",
                "/tmp/h",
                "--key-file=-",
                "/dev/vdb"
            ]
        );
    }
}
