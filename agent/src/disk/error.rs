//! [`DiskError`]: what every disk operation fails with.

use std::path::PathBuf;
use std::process::ExitStatus;

use super::cryptsetup::{MAX_KEY_LEN, MIN_KEY_LEN};
use super::header::HeaderMismatch;

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
    /// What should be in memory (the tmpfs the components are installed
    /// in) is not.
    #[error("{path:?} is not in memory: {why}")]
    NotInMemory {
        /// The path.
        path: PathBuf,
        /// Why not.
        why: String,
    },
    /// The disk's LUKS header is not one the agent creates: refused before
    /// any key check or open.
    #[error("refusing the LUKS header of {device:?}: {mismatch}")]
    Header {
        /// The device.
        device: PathBuf,
        /// The offending field and what is wrong with it.
        mismatch: HeaderMismatch,
    },
    /// The private copy of the LUKS header could not be made or read.
    #[error("LUKS header copy {path:?}")]
    HeaderCopy {
        /// The directory or file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `cryptsetup` does not read the device as LUKS, yet a LUKS signature
    /// is on it: both header copies are damaged. Not an empty disk: it is
    /// neither formatted nor opened until someone restores its header
    /// from a backup of their own (`cryptsetup luksHeaderRestore`; the agent
    /// keeps none) or wipes it.
    #[error("{device:?} carries a LUKS signature (at byte {offset}) that cryptsetup cannot read: its header is damaged; restore the header from a backup, or wipe the disk")]
    DamagedHeader {
        /// The device.
        device: PathBuf,
        /// Where the signature is.
        offset: u64,
    },
    /// Reading the device to look for LUKS signatures, or clearing them,
    /// failed.
    #[error("looking for or clearing LUKS signatures on {device:?}")]
    SignatureIo {
        /// The device.
        device: PathBuf,
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
    /// `luksDump` printed no label line.
    #[error("luksDump of {device:?} printed no label")]
    Label {
        /// The device.
        device: PathBuf,
    },
}

/// A LUKS header the node neither formats nor opens, whatever it retries:
/// the disk must be wiped, or its header restored, before the node can
/// use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnusableHeader {
    /// A LUKS signature that cryptsetup does not read as a header
    /// ([`DiskError::DamagedHeader`]).
    Damaged,
    /// A header cryptsetup reads but keel cannot use: its dump has no label
    /// line (a LUKS1 header) or its UUID does not read as one. (A LUKS2
    /// header without a label is a member's as far as the disk tells.)
    Foreign,
}

impl DiskError {
    /// The lasting header problem this error is, if it is one rather than
    /// a failure a retry may get past.
    pub fn unusable_header(&self) -> Option<UnusableHeader> {
        match self {
            DiskError::DamagedHeader { .. } => Some(UnusableHeader::Damaged),
            DiskError::Uuid { .. } | DiskError::Label { .. } => Some(UnusableHeader::Foreign),
            _ => None,
        }
    }
}
