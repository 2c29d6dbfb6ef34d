//! Strict extraction of `.tgz` components.
//!
//! Rules (anything else refuses the whole archive):
//! * entry paths are relative and have no `..` part (`.` parts are dropped);
//! * entries are regular files, directories or symbolic links; hard links,
//!   device nodes, fifos, sparse files (GNU `S` entries, PAX `GNU.sparse.*`
//!   keys) and other special entries are refused;
//! * a symlink's target is relative, stays inside the install directory when
//!   read lexically, and after extraction resolves — following the archive's
//!   own links — to an existing entry inside it;
//! * no entry is written through a symlink, and no file or symlink path
//!   appears twice (a directory may be named again: it changes nothing);
//! * files become mode 0755 when the archive gives any execute bit, else
//!   0644; directories 0755; ownership is not taken from the archive;
//! * the archive file, the decompressed stream and the entry count are
//!   bounded;
//! * archive metadata is bounded before any of it is read: a GNU long-name
//!   (`L`) or long-link (`K`) record larger than
//!   [`ExtractLimits::max_name_bytes`], or a PAX extended (`x`) or global
//!   (`g`) header larger than [`ExtractLimits::max_pax_bytes`], is refused
//!   on the size in its header;
//! * a PAX `path` or `linkpath` replaces the header's name or link target and
//!   is bounded like a long name; a PAX `size` must equal the header's; a
//!   global header sets none of the three;
//! * a name given twice for one entry (two records of one kind, or a GNU long
//!   name and a PAX `path`), an empty name or one with a NUL byte, a link
//!   target given to an entry that is not a symlink, a malformed PAX record,
//!   and metadata records not followed by their entry are refused;
//! * paths from the archive appear in errors escaped and cut short
//!   ([`display_archive_path`]), so a hostile name reaches the logs and the
//!   init failure report neither whole nor with its control characters.
//!
//! The tar crate's default iterator reads long names and PAX headers into
//! memory whole, bounded only by the stream. Entries are therefore iterated
//! raw (`Entries::raw`): the crate then reads nothing but 512-byte headers
//! itself, and the metadata records are checked, read and applied here.
//!
//! The archive is unpacked into a fresh staging directory next to the target
//! and checked in full before anything moves. If the target does not exist
//! the staging directory is renamed into place (atomic); if it exists (e.g.
//! `/run/state/bin`, shared with single-file components) each top-level entry
//! is renamed into it, replacing files of the same name. A failure before
//! that step leaves the target untouched.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::fmt::{self, Write as _};
use std::fs::{self, DirBuilder, OpenOptions, Permissions};
use std::io::{self, BufReader, Read};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Component as PathPart, Path, PathBuf};

use tar::EntryType;

use crate::digest::{HashingReader, Sha256Digest};

/// Bounds on one archive.
#[derive(Debug, Clone, Copy)]
pub struct ExtractLimits {
    /// Largest archive file, in bytes: no more of it than this is read (or
    /// hashed). The installer sets it to the download bound
    /// ([`DownloadConfig::max_bytes`](crate::DownloadConfig::max_bytes)),
    /// so a kept archive is read no further than a download may take.
    pub max_archive_bytes: u64,
    /// Largest decompressed tar stream, in bytes.
    pub max_unpacked_bytes: u64,
    /// Most entries. PAX global headers count; the long-name, long-link and
    /// PAX records of an entry do not (each may appear once per entry).
    pub max_entries: u64,
    /// Largest GNU long-name or long-link record (its size field, the
    /// closing NUL included) and longest PAX `path` or `linkpath`, in bytes.
    pub max_name_bytes: u64,
    /// Largest PAX extended or global header (all its records), in bytes.
    pub max_pax_bytes: u64,
}

impl Default for ExtractLimits {
    fn default() -> Self {
        Self {
            max_archive_bytes: crate::download::DEFAULT_MAX_BYTES,
            max_unpacked_bytes: 2 * 1024 * 1024 * 1024,
            max_entries: 100_000,
            // PATH_MAX, the closing NUL included.
            max_name_bytes: 4096,
            // A path and a link target at the limit, times and a few xattrs
            // fit many times over.
            max_pax_bytes: 64 * 1024,
        }
    }
}

/// What an extraction wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExtractSummary {
    /// Regular files.
    pub files: u64,
    /// Directories (the archive root excluded).
    pub directories: u64,
    /// Symbolic links.
    pub symlinks: u64,
    /// Bytes of file content.
    pub bytes: u64,
}

/// An archive record that describes other entries instead of being one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetadataRecord {
    /// GNU long name (`L`): the next entry's path.
    LongName,
    /// GNU long link (`K`): the next entry's link target.
    LongLink,
    /// PAX extended header (`x`): key/value records for the next entry.
    PaxHeader,
    /// PAX global header (`g`): key/value records for every later entry.
    PaxGlobalHeader,
}

impl MetadataRecord {
    fn of(kind: EntryType) -> Option<Self> {
        if kind.is_gnu_longname() {
            Some(Self::LongName)
        } else if kind.is_gnu_longlink() {
            Some(Self::LongLink)
        } else if kind.is_pax_local_extensions() {
            Some(Self::PaxHeader)
        } else if kind.is_pax_global_extensions() {
            Some(Self::PaxGlobalHeader)
        } else {
            None
        }
    }
}

impl fmt::Display for MetadataRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::LongName => "GNU long-name record",
            Self::LongLink => "GNU long-link record",
            Self::PaxHeader => "PAX extended header",
            Self::PaxGlobalHeader => "PAX global header",
        })
    }
}

/// Why an archive was refused or could not be installed.
///
/// Paths taken from the archive are held as [`display_archive_path`] renders
/// them: escaped and at most [`MAX_SHOWN_PATH_CHARS`] characters long.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExtractError {
    /// The target exists and is not a directory.
    #[error("{0:?} exists and is not a directory")]
    TargetNotDirectory(PathBuf),
    /// The staging directory could not be created.
    #[error("creating a staging directory in {dir:?}")]
    CreateStaging {
        /// Where.
        dir: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The archive is not valid gzip/tar or could not be read.
    #[error("reading the archive")]
    ReadArchive(#[source] io::Error),
    /// The archive's bytes do not have the expected hash; nothing was put
    /// in place.
    #[error("the archive's hash is {actual}, not the expected {expected}")]
    HashMismatch {
        /// The hash expected.
        expected: Box<Sha256Digest>,
        /// The hash of the bytes read.
        actual: Box<Sha256Digest>,
    },
    /// The archive file is larger than
    /// [`ExtractLimits::max_archive_bytes`]; no more of it than that was
    /// read, and nothing was put in place. Not the target's fault: another
    /// copy of the archive may fit.
    #[error("the archive is larger than {0} bytes")]
    ArchiveTooLarge(u64),
    /// The decompressed archive is larger than the limit.
    #[error("the archive unpacks to more than {0} bytes")]
    TooLarge(u64),
    /// The archive has more entries than the limit.
    #[error("the archive has more than {0} entries")]
    TooManyEntries(u64),
    /// A metadata record's header gives a size above its limit; none of the
    /// record was read.
    #[error("archive {record} of {size} bytes exceeds the limit of {limit} bytes")]
    MetadataTooLarge {
        /// Which kind of record.
        record: MetadataRecord,
        /// The size its header gives.
        size: u64,
        /// The limit for that kind.
        limit: u64,
    },
    /// A metadata record is malformed, repeated, in conflict with another, or
    /// not followed by its entry.
    #[error("archive {record} {reason}")]
    Metadata {
        /// Which kind of record.
        record: MetadataRecord,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A PAX header sets a key in a way that is refused.
    #[error("archive {record} key \"{key}\" {reason}")]
    PaxKey {
        /// Which kind of PAX header.
        record: MetadataRecord,
        /// The key, display-safe.
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A PAX `path` or `linkpath` is longer than the name limit.
    #[error("archive {record} gives a {key} of {size} bytes, more than the limit of {limit}")]
    NameTooLong {
        /// Which kind of PAX header.
        record: MetadataRecord,
        /// `path` or `linkpath`.
        key: &'static str,
        /// The value's length.
        size: u64,
        /// [`ExtractLimits::max_name_bytes`].
        limit: u64,
    },
    /// An entry path breaks the path rules.
    #[error("archive entry \"{path}\" {reason}")]
    EntryPath {
        /// The entry path as stored, display-safe.
        path: String,
        /// Which rule it broke.
        reason: &'static str,
    },
    /// An entry is of a refused type.
    #[error("archive entry \"{path}\" is a {kind}; only regular files, directories and contained symlinks are allowed")]
    EntryType {
        /// The entry path as stored, display-safe.
        path: String,
        /// The refused type.
        kind: String,
    },
    /// A symlink points outside the install directory or nowhere.
    #[error("archive symlink \"{path}\" -> \"{target}\" {reason}")]
    SymlinkTarget {
        /// The symlink's path, display-safe.
        path: String,
        /// Its target, display-safe.
        target: String,
        /// Which rule it broke.
        reason: &'static str,
    },
    /// An entry would be written through a symlink of the archive.
    #[error("archive entry \"{0}\" lies beneath a symlink")]
    ThroughSymlink(String),
    /// An entry would be written beneath a non-directory entry.
    #[error("archive entry \"{0}\" lies beneath a file")]
    ThroughFile(String),
    /// An entry path appears twice.
    #[error("archive entry \"{0}\" appears twice")]
    Duplicate(String),
    /// A file entry ended before its size.
    #[error("archive entry \"{0}\" is truncated")]
    TruncatedEntry(String),
    /// Writing an entry into the staging directory failed.
    #[error("writing archive entry \"{path}\"")]
    WriteEntry {
        /// The entry path, display-safe.
        path: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// An existing directory would be replaced by a non-directory.
    #[error("\"{0}\" is a directory and the archive has a non-directory there")]
    WouldReplaceDirectory(String),
    /// The archive has an entry at another component's install path: it
    /// would replace what that component installed, which is measured as
    /// that component.
    #[error("the archive has an entry at \"{0}\", another component's install path")]
    WouldReplaceComponent(String),
    /// Moving extracted entries into the target failed.
    #[error("moving extracted entries into \"{path}\"")]
    Install {
        /// The destination (ends in names from the archive), display-safe.
        path: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

impl ExtractError {
    /// Whether the error is the place the archive goes to (the target, the
    /// staging directory, the disk), not the archive: another copy of the
    /// same archive would fail the same way.
    pub fn is_at_target(&self) -> bool {
        matches!(
            self,
            Self::TargetNotDirectory(_)
                | Self::CreateStaging { .. }
                | Self::WriteEntry { .. }
                | Self::WouldReplaceDirectory(_)
                | Self::WouldReplaceComponent(_)
                | Self::Install { .. }
        )
    }
}

/// Most characters [`display_archive_path`] keeps, escapes included; a cut
/// path is followed by a `…(+N bytes)` marker.
pub const MAX_SHOWN_PATH_CHARS: usize = 128;

/// Renders bytes from an archive (a path, a link target, a PAX key) for an
/// error message or a log line: ASCII control characters and bytes that are
/// not UTF-8 as `\x1b`, other non-printable characters (bidirectional
/// overrides, zero-width marks, C1 controls) as `\u{202e}`, `\` and `"` as
/// `\\` and `\"`, and cut after at most [`MAX_SHOWN_PATH_CHARS`] characters
/// with `…(+N bytes)` telling how many bytes of the original were left out.
pub fn display_archive_path(bytes: &[u8]) -> String {
    escape_bounded(bytes, MAX_SHOWN_PATH_CHARS)
}

fn display_path(path: &Path) -> String {
    display_archive_path(path.as_os_str().as_bytes())
}

/// [`display_archive_path`] with `max_chars` as the bound.
fn escape_bounded(bytes: &[u8], max_chars: usize) -> String {
    let mut out = String::new();
    let mut chars = 0usize;
    let mut consumed = 0usize;
    for chunk in bytes.utf8_chunks() {
        let valid = chunk
            .valid()
            .chars()
            .map(|c| (Piece::Char(c), c.len_utf8()));
        let invalid = chunk.invalid().iter().map(|&b| (Piece::Byte(b), 1));
        for (piece, len) in valid.chain(invalid) {
            if !push_escaped(&mut out, &mut chars, max_chars, piece) {
                let _ = write!(out, "…(+{} bytes)", bytes.len() - consumed);
                return out;
            }
            consumed += len;
        }
    }
    out
}

/// One character or one byte that is not UTF-8.
#[derive(Clone, Copy)]
enum Piece {
    Char(char),
    Byte(u8),
}

/// Appends `piece`, escaped, unless that would take `out` past `max_chars`
/// characters (counted in `chars`); says whether it did.
fn push_escaped(out: &mut String, chars: &mut usize, max_chars: usize, piece: Piece) -> bool {
    let before = out.len();
    // Writing to a String cannot fail.
    let _ = match piece {
        Piece::Byte(b) => write!(out, "\\x{b:02x}"),
        Piece::Char('\\') => out.write_str("\\\\"),
        Piece::Char('"') => out.write_str("\\\""),
        Piece::Char(c) if c.is_ascii_control() => write!(out, "\\x{:02x}", u32::from(c)),
        Piece::Char(c) if c.is_ascii() => out.write_char(c),
        // Printable characters as they are, the rest as `\u{…}`.
        Piece::Char(c) => write!(out, "{}", c.escape_debug()),
    };
    let added = out[before..].chars().count();
    if *chars + added > max_chars {
        out.truncate(before);
        return false;
    }
    *chars += added;
    true
}

/// Unpacks the gzip-compressed tar archive `archive` (an open file, read
/// from where it stands) into the directory `target`, whose parent must
/// exist, if its bytes hash to `expected`: they are hashed as they are
/// read, to the file's end, and nothing reaches `target` unless they
/// match. One read serves both, so the bytes extracted are the bytes
/// hashed, whatever happens to the file meanwhile. A file longer than
/// [`ExtractLimits::max_archive_bytes`] (it may grow as it is read) is
/// [`ExtractError::ArchiveTooLarge`], read no further than one byte past
/// the limit.
pub fn extract_tgz_verified(
    archive: fs::File,
    expected: Sha256Digest,
    target: &Path,
    limits: &ExtractLimits,
) -> Result<ExtractSummary, ExtractError> {
    extract_tgz_verified_sparing(archive, expected, target, limits, &[])
}

/// [`extract_tgz_verified`], refusing (before anything reaches `target`)
/// an archive with an entry at any of `spare`: the install paths of the
/// other components of the node's list, which an archive extracted into a
/// directory they share must not replace.
pub fn extract_tgz_verified_sparing(
    archive: fs::File,
    expected: Sha256Digest,
    target: &Path,
    limits: &ExtractLimits,
    spare: &[PathBuf],
) -> Result<ExtractSummary, ExtractError> {
    let target_exists = match fs::symlink_metadata(target) {
        Ok(meta) if meta.is_dir() => true,
        Ok(_) => return Err(ExtractError::TargetNotDirectory(target.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(source) => {
            return Err(ExtractError::Install {
                path: display_path(target),
                source,
            })
        }
    };
    let parent = target
        .parent()
        .ok_or_else(|| ExtractError::TargetNotDirectory(target.to_owned()))?;
    let staging_error = |source| ExtractError::CreateStaging {
        dir: parent.to_owned(),
        source,
    };
    let staging = tempfile::Builder::new()
        .prefix(&temporary_prefix(target.file_name().unwrap_or_default()))
        .rand_bytes(crate::installer::RANDOM_CHARS)
        .suffix(STAGING_SUFFIX)
        .tempdir_in(parent)
        .map_err(staging_error)?;
    fs::set_permissions(staging.path(), Permissions::from_mode(0o755)).map_err(staging_error)?;

    // One byte past the limit tells a file longer than it from one that
    // ends there.
    let archive_limit = limits.max_archive_bytes;
    let mut source = HashingReader::new(archive).take(archive_limit.saturating_add(1));
    let gunzip = flate2::read::GzDecoder::new(BufReader::with_capacity(256 * 1024, &mut source));
    let bounded = Bounded {
        inner: gunzip,
        remaining: limits.max_unpacked_bytes,
        limit: limits.max_unpacked_bytes,
    };
    let unpacked = unpack(bounded, staging.path(), limits).and_then(|(summary, symlinks)| {
        for link in &symlinks {
            check_symlink_resolves(staging.path(), link)?;
        }
        Ok(summary)
    });
    // What the gzip and tar readers left is hashed too: the hash is of
    // the whole file, and it decides before anything moves. It decides
    // first also when unpacking failed: bytes that are not the archive
    // are said to be so, whatever they did to the unpacking (a name too
    // long for the file system, a disk filled), so that a kept copy that
    // is not the archive is fetched again rather than failing the install.
    // The bound decides before the hash: a file past it was not read whole.
    io::copy(&mut source, &mut io::sink()).map_err(ExtractError::ReadArchive)?;
    if source.limit() == 0 {
        return Err(ExtractError::ArchiveTooLarge(archive_limit));
    }
    let actual = source.into_inner().digest();
    if actual != expected {
        return Err(ExtractError::HashMismatch {
            expected: Box::new(expected),
            actual: Box::new(actual),
        });
    }
    let summary = unpacked?;

    // Every refusal comes before the first entry moves: a merge stops part
    // way only on an I/O error. The spared paths are checked also when the
    // target is new, so a list whose archive would replace another
    // component's file is refused from its first install.
    check_merge(staging.path(), target, spare, target_exists)?;
    if target_exists {
        merge_dir(staging.path(), target)?;
        // `staging` is now empty of entries; dropping it removes it.
    } else {
        let staged = staging.keep();
        fs::rename(&staged, target).map_err(|source| {
            let _ = fs::remove_dir_all(&staged);
            ExtractError::Install {
                path: display_path(target),
                source,
            }
        })?;
    }
    Ok(summary)
}

/// The start of the name of a temporary file or directory for `name`, in
/// its directory: a dot, the name and a dot.
pub(crate) fn temporary_prefix(name: &std::ffi::OsStr) -> OsString {
    let mut prefix = OsString::from(".");
    prefix.push(name);
    prefix.push(".");
    prefix
}

/// The name of an extraction's staging directory ends with this; it
/// starts with [`temporary_prefix`].
pub(crate) const STAGING_SUFFIX: &str = ".keel-extract";

/// Unpacks every entry into `root`; returns the summary and the symlinks
/// (relative paths) to check once the tree is complete.
fn unpack<R: Read>(
    reader: R,
    root: &Path,
    limits: &ExtractLimits,
) -> Result<(ExtractSummary, Vec<PathBuf>), ExtractError> {
    let mut archive = tar::Archive::new(reader);
    let mut summary = ExtractSummary::default();
    let mut symlinks = Vec::new();
    let mut count = 0u64;
    let mut pending = Pending::default();
    // Raw: long-name, long-link and PAX records come as entries of their own
    // instead of being read whole by the crate.
    let entries = archive.entries().map_err(read_error)?.raw(true);
    for entry in entries {
        let mut entry = entry.map_err(read_error)?;
        let kind = entry.header().entry_type();
        match MetadataRecord::of(kind) {
            Some(record @ MetadataRecord::PaxGlobalHeader) => {
                // pax global metadata (e.g. a commit id from `git archive`):
                // checked, nothing in it is used.
                count_entry(&mut count, limits)?;
                if pending.first().is_some() {
                    return Err(ExtractError::Metadata {
                        record,
                        reason: "lies between another metadata record and its entry",
                    });
                }
                let body = read_metadata(&mut entry, record, limits.max_pax_bytes)?;
                parse_pax(&body, record, limits)?;
                continue;
            }
            Some(record) => {
                pending.add(record, &mut entry, limits)?;
                continue;
            }
            None => {}
        }
        count_entry(&mut count, limits)?;
        let names = std::mem::take(&mut pending).into_names(&entry, limits)?;
        let shown = display_archive_path(&names.path);
        let stored = Path::new(OsStr::from_bytes(&names.path));
        let relative = relative_entry_path(stored).map_err(|reason| ExtractError::EntryPath {
            path: shown.clone(),
            reason,
        })?;
        match kind {
            EntryType::Directory => {
                names.refuse_link_metadata()?;
                if relative.as_os_str().is_empty() {
                    continue; // the archive root, "./"
                }
                make_dirs(root, &relative, &shown)?;
                summary.directories += 1;
            }
            EntryType::Regular => {
                names.refuse_link_metadata()?;
                let parent = nonempty_parent(&relative, &shown)?;
                make_dirs(root, parent, &shown)?;
                let mode = if entry.header().mode().map_err(read_error)? & 0o111 != 0 {
                    0o755
                } else {
                    0o644
                };
                summary.bytes += write_file(&mut entry, &root.join(&relative), mode, &shown)?;
                summary.files += 1;
            }
            EntryType::Symlink => {
                let parent = nonempty_parent(&relative, &shown)?;
                let target = names
                    .link
                    .as_deref()
                    .ok_or_else(|| ExtractError::EntryPath {
                        path: shown.clone(),
                        reason: "is a symlink without a target",
                    })?;
                let target = Path::new(OsStr::from_bytes(target));
                check_symlink_lexically(&relative, target)?;
                make_dirs(root, parent, &shown)?;
                std::os::unix::fs::symlink(target, root.join(&relative)).map_err(|e| {
                    if e.kind() == io::ErrorKind::AlreadyExists {
                        ExtractError::Duplicate(shown.clone())
                    } else {
                        ExtractError::WriteEntry {
                            path: shown.clone(),
                            source: e,
                        }
                    }
                })?;
                symlinks.push(relative);
                summary.symlinks += 1;
            }
            other => {
                return Err(ExtractError::EntryType {
                    path: shown,
                    kind: kind_name(other),
                })
            }
        }
    }
    if let Some(record) = pending.first() {
        return Err(ExtractError::Metadata {
            record,
            reason: "is not followed by an entry",
        });
    }
    Ok((summary, symlinks))
}

fn count_entry(count: &mut u64, limits: &ExtractLimits) -> Result<(), ExtractError> {
    *count += 1;
    if *count > limits.max_entries {
        return Err(ExtractError::TooManyEntries(limits.max_entries));
    }
    Ok(())
}

/// Metadata records read for the next entry.
#[derive(Default)]
struct Pending {
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
    pax: Option<Vec<u8>>,
}

/// An entry's path and link target, metadata records applied.
struct Names {
    path: Vec<u8>,
    link: Option<Vec<u8>>,
    /// The record the link target came from, if not the header.
    link_record: Option<MetadataRecord>,
}

impl Names {
    /// Refuses a link target given by a metadata record to an entry that is
    /// not a symlink: such an archive means something else to other readers.
    fn refuse_link_metadata(&self) -> Result<(), ExtractError> {
        match self.link_record {
            Some(record) => Err(ExtractError::Metadata {
                record,
                reason: "gives a link target to an entry that is not a symlink",
            }),
            None => Ok(()),
        }
    }
}

impl Pending {
    /// The first record waiting for an entry, if any.
    fn first(&self) -> Option<MetadataRecord> {
        if self.long_name.is_some() {
            Some(MetadataRecord::LongName)
        } else if self.long_link.is_some() {
            Some(MetadataRecord::LongLink)
        } else if self.pax.is_some() {
            Some(MetadataRecord::PaxHeader)
        } else {
            None
        }
    }

    /// Reads the per-entry metadata record `entry` (not a global header).
    fn add<R: Read>(
        &mut self,
        record: MetadataRecord,
        entry: &mut tar::Entry<'_, R>,
        limits: &ExtractLimits,
    ) -> Result<(), ExtractError> {
        let (slot, limit) = match record {
            MetadataRecord::LongName => (&mut self.long_name, limits.max_name_bytes),
            MetadataRecord::LongLink => (&mut self.long_link, limits.max_name_bytes),
            MetadataRecord::PaxHeader | MetadataRecord::PaxGlobalHeader => {
                (&mut self.pax, limits.max_pax_bytes)
            }
        };
        if slot.is_some() {
            return Err(ExtractError::Metadata {
                record,
                reason: "appears twice for one entry",
            });
        }
        *slot = Some(read_metadata(entry, record, limit)?);
        Ok(())
    }

    /// The path and link target of `entry`, the records read for it applied.
    fn into_names<R: Read>(
        self,
        entry: &tar::Entry<'_, R>,
        limits: &ExtractLimits,
    ) -> Result<Names, ExtractError> {
        let Pending {
            long_name,
            long_link,
            pax,
        } = self;
        let pax = match &pax {
            Some(body) => parse_pax(body, MetadataRecord::PaxHeader, limits)?,
            None => PaxFields::default(),
        };
        // The crate steps to the next header by the header's size; a reader
        // that honours the PAX size would see another archive.
        if pax.size.is_some_and(|size| size != entry.size()) {
            return Err(ExtractError::PaxKey {
                record: MetadataRecord::PaxHeader,
                key: "size".to_owned(),
                reason: "differs from the size in the entry's header",
            });
        }
        let path = match (long_name, pax.path) {
            (Some(_), Some(_)) => {
                return Err(ExtractError::Metadata {
                    record: MetadataRecord::LongName,
                    reason: "and a PAX \"path\" both name one entry",
                })
            }
            (Some(name), None) => gnu_name(name, MetadataRecord::LongName)?,
            (None, Some(path)) => path.to_vec(),
            (None, None) => entry.header().path_bytes().into_owned(),
        };
        let (link, link_record) = match (long_link, pax.linkpath) {
            (Some(_), Some(_)) => {
                return Err(ExtractError::Metadata {
                    record: MetadataRecord::LongLink,
                    reason: "and a PAX \"linkpath\" both give one entry's link target",
                })
            }
            (Some(target), None) => (
                Some(gnu_name(target, MetadataRecord::LongLink)?),
                Some(MetadataRecord::LongLink),
            ),
            (None, Some(target)) => (Some(target.to_vec()), Some(MetadataRecord::PaxHeader)),
            (None, None) => (
                entry.header().link_name_bytes().map(|b| b.into_owned()),
                None,
            ),
        };
        Ok(Names {
            path,
            link,
            link_record,
        })
    }
}

/// Reads the body of the metadata record `entry`, refusing it on its
/// header's size before reading anything if that is above `limit`.
fn read_metadata<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    record: MetadataRecord,
    limit: u64,
) -> Result<Vec<u8>, ExtractError> {
    let size = entry.size();
    if size > limit {
        return Err(ExtractError::MetadataTooLarge {
            record,
            size,
            limit,
        });
    }
    // `size` is at most the configured limit.
    let mut body = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    entry
        .by_ref()
        .take(size)
        .read_to_end(&mut body)
        .map_err(read_error)?;
    if body.len() as u64 != size {
        return Err(ExtractError::Metadata {
            record,
            reason: "is truncated",
        });
    }
    Ok(body)
}

/// A GNU long name or link: NUL-terminated, without NULs inside.
fn gnu_name(mut name: Vec<u8>, record: MetadataRecord) -> Result<Vec<u8>, ExtractError> {
    while name.last() == Some(&0) {
        name.pop();
    }
    let refuse = |reason| Err(ExtractError::Metadata { record, reason });
    if name.is_empty() {
        return refuse("is empty");
    }
    if name.contains(&0) {
        return refuse("contains a NUL byte");
    }
    Ok(name)
}

/// The PAX keys that change how an entry is read.
#[derive(Default)]
struct PaxFields<'a> {
    path: Option<&'a [u8]>,
    linkpath: Option<&'a [u8]>,
    size: Option<u64>,
}

/// Parses and checks the records of a PAX header. Keys other than `path`,
/// `linkpath`, `size` and `GNU.sparse.*` (times, owners, xattrs, comments)
/// change nothing this extractor writes and are ignored.
fn parse_pax<'a>(
    body: &'a [u8],
    record: MetadataRecord,
    limits: &ExtractLimits,
) -> Result<PaxFields<'a>, ExtractError> {
    let mut fields = PaxFields::default();
    let mut rest = body;
    while let Some((key, value)) = next_pax_record(&mut rest, record)? {
        let refuse = |reason| ExtractError::PaxKey {
            record,
            key: display_archive_path(key),
            reason,
        };
        let global = record == MetadataRecord::PaxGlobalHeader;
        match key {
            b"path" | b"linkpath" => {
                if global {
                    return Err(refuse("is not allowed in a global header"));
                }
                if value.is_empty() {
                    return Err(refuse("is empty"));
                }
                if value.contains(&0) {
                    return Err(refuse("contains a NUL byte"));
                }
                let (slot, name) = if key == b"path" {
                    (&mut fields.path, "path")
                } else {
                    (&mut fields.linkpath, "linkpath")
                };
                let size = value.len() as u64;
                if size > limits.max_name_bytes {
                    return Err(ExtractError::NameTooLong {
                        record,
                        key: name,
                        size,
                        limit: limits.max_name_bytes,
                    });
                }
                if slot.replace(value).is_some() {
                    return Err(refuse("is set twice"));
                }
            }
            b"size" => {
                if global {
                    return Err(refuse("is not allowed in a global header"));
                }
                let size = parse_decimal(value).ok_or_else(|| refuse("is not a decimal number"))?;
                if fields.size.replace(size).is_some() {
                    return Err(refuse("is set twice"));
                }
            }
            _ if key.starts_with(b"GNU.sparse.") => {
                return Err(refuse(
                    "describes a sparse file; sparse files are not allowed",
                ))
            }
            _ => {}
        }
    }
    Ok(fields)
}

/// A PAX record's key and value.
type PaxPair<'a> = (&'a [u8], &'a [u8]);

/// Splits the next `"<length> <key>=<value>\n"` record off `rest`; `None` at
/// the end (NUL padding after the last record is allowed). The length counts
/// the whole record, so a value may hold newlines.
fn next_pax_record<'a>(
    rest: &mut &'a [u8],
    record: MetadataRecord,
) -> Result<Option<PaxPair<'a>>, ExtractError> {
    let malformed = || ExtractError::Metadata {
        record,
        reason: "holds a malformed record",
    };
    match rest.first() {
        None => return Ok(None),
        Some(0) if rest.iter().all(|&b| b == 0) => return Ok(None),
        Some(_) => {}
    }
    // A length of up to 20 digits, then a space.
    let space = rest
        .iter()
        .take(21)
        .position(|&b| b == b' ')
        .ok_or_else(malformed)?;
    let length = parse_decimal(&rest[..space])
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > space + 1 && n <= rest.len())
        .ok_or_else(malformed)?;
    let (line, tail) = rest.split_at(length);
    let Some((b'\n', pair)) = line[space + 1..].split_last() else {
        return Err(malformed());
    };
    let equals = pair
        .iter()
        .position(|&b| b == b'=')
        .filter(|&i| i > 0)
        .ok_or_else(malformed)?;
    *rest = tail;
    Ok(Some((&pair[..equals], &pair[equals + 1..])))
}

/// A non-empty run of ASCII digits as a number.
fn parse_decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// Most characters kept of a read error's text.
const MAX_ERROR_TEXT_CHARS: usize = 512;

fn read_error(e: io::Error) -> ExtractError {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<LimitExceeded>())
    {
        Some(limit) => ExtractError::TooLarge(limit.0),
        None => ExtractError::ReadArchive(display_safe(e)),
    }
}

/// `e`, or if its text needs escaping an error of the same kind with the
/// text escaped and bounded: the tar crate puts the header's name, as
/// stored, into some of its errors (a bad mode or size field).
fn display_safe(e: io::Error) -> io::Error {
    let text = e.to_string();
    let safe = escape_bounded(text.as_bytes(), MAX_ERROR_TEXT_CHARS);
    if safe == text {
        e
    } else {
        io::Error::new(e.kind(), safe)
    }
}

fn kind_name(kind: EntryType) -> String {
    match kind {
        EntryType::Link => "hard link".to_owned(),
        EntryType::Char => "character device".to_owned(),
        EntryType::Block => "block device".to_owned(),
        EntryType::Fifo => "fifo".to_owned(),
        EntryType::Continuous => "contiguous file".to_owned(),
        EntryType::GNUSparse => "sparse file".to_owned(),
        other => format!("entry of type {:?}", other.as_byte() as char),
    }
}

/// The entry path with `.` parts dropped; refuses absolute paths and `..`
/// (the error is the rule broken).
fn relative_entry_path(stored: &Path) -> Result<PathBuf, &'static str> {
    let mut relative = PathBuf::new();
    for part in stored.components() {
        match part {
            PathPart::Normal(name) => relative.push(name),
            PathPart::CurDir => {}
            PathPart::RootDir | PathPart::Prefix(_) => return Err("is absolute"),
            PathPart::ParentDir => return Err("contains \"..\""),
        }
    }
    Ok(relative)
}

/// The parent of a non-directory entry; refuses an entry naming the root.
fn nonempty_parent<'a>(relative: &'a Path, shown: &str) -> Result<&'a Path, ExtractError> {
    match relative.parent() {
        Some(parent) if !relative.as_os_str().is_empty() => Ok(parent),
        _ => Err(ExtractError::EntryPath {
            path: shown.to_owned(),
            reason: "names the archive root",
        }),
    }
}

/// Creates `relative` (a directory path) under `root`, refusing to pass
/// through symlinks or files. `shown` is the entry for errors.
fn make_dirs(root: &Path, relative: &Path, shown: &str) -> Result<(), ExtractError> {
    let mut current = root.to_path_buf();
    for part in relative.components() {
        current.push(part);
        match fs::symlink_metadata(&current) {
            Ok(meta) if meta.is_dir() => {}
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(ExtractError::ThroughSymlink(shown.to_owned()))
            }
            Ok(_) => return Err(ExtractError::ThroughFile(shown.to_owned())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let write_error = |source| ExtractError::WriteEntry {
                    path: shown.to_owned(),
                    source,
                };
                DirBuilder::new()
                    .mode(0o755)
                    .create(&current)
                    .map_err(write_error)?;
                fs::set_permissions(&current, Permissions::from_mode(0o755))
                    .map_err(write_error)?;
            }
            Err(source) => {
                return Err(ExtractError::WriteEntry {
                    path: shown.to_owned(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// A reader that remembers whether it failed: `io::copy` returns read and
/// write errors alike.
struct ReadSide<R> {
    inner: R,
    failed: bool,
}

impl<R: Read> Read for ReadSide<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // An interrupted read is retried by `io::copy`: not a failure.
        self.inner
            .read(buf)
            .inspect_err(|e| self.failed |= e.kind() != io::ErrorKind::Interrupted)
    }
}

/// Writes one regular file; `create_new` refuses an existing path, including
/// a symlink there, so nothing is written through a link.
fn write_file<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    path: &Path,
    mode: u32,
    shown: &str,
) -> Result<u64, ExtractError> {
    let write_error = |source| ExtractError::WriteEntry {
        path: shown.to_owned(),
        source,
    };
    let size = entry.size();
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                ExtractError::Duplicate(shown.to_owned())
            } else {
                write_error(e)
            }
        })?;
    // A read error is the archive's (a bomb, a cut or damaged stream: a
    // kept copy damaged on disk is fetched again), a write error the
    // target's.
    let mut source = ReadSide {
        inner: entry,
        failed: false,
    };
    let copied = io::copy(&mut source, &mut file).map_err(|e| {
        if source.failed {
            read_error(e)
        } else {
            write_error(e)
        }
    })?;
    if copied != size {
        return Err(ExtractError::TruncatedEntry(shown.to_owned()));
    }
    file.set_permissions(Permissions::from_mode(mode))
        .map_err(write_error)?;
    Ok(copied)
}

/// A symlink target must be relative and, read lexically from the link's
/// directory, stay inside the root. Catches `/`, `../..` and the like early
/// with a clear message; [`check_symlink_resolves`] is the complete check.
fn check_symlink_lexically(link: &Path, target: &Path) -> Result<(), ExtractError> {
    let refuse = |reason| ExtractError::SymlinkTarget {
        path: display_path(link),
        target: display_path(target),
        reason,
    };
    if target.as_os_str().is_empty() {
        return Err(refuse("has an empty target"));
    }
    if target.is_absolute() {
        return Err(refuse("points to an absolute path"));
    }
    let mut depth = link.parent().map_or(0, |p| p.components().count());
    for part in target.components() {
        match part {
            PathPart::ParentDir if depth == 0 => {
                return Err(refuse("points outside the install directory"))
            }
            PathPart::ParentDir => depth -= 1,
            PathPart::Normal(_) => depth += 1,
            PathPart::CurDir => {}
            PathPart::RootDir | PathPart::Prefix(_) => {
                return Err(refuse("points to an absolute path"))
            }
        }
    }
    Ok(())
}

/// Most symlinks followed while resolving one link (as Linux's MAXSYMLINKS).
const MAX_LINK_HOPS: u32 = 40;

/// Resolves the symlink at `link` inside the extracted tree `root` exactly as
/// the kernel would — following links, `..` after a link applying to the
/// link's target — and requires every step to stay inside `root` and the end
/// to exist. The lexical check alone is not enough: with `d -> ..` in `x/`,
/// `x/d/..` leaves the root although it reads as `x`.
fn check_symlink_resolves(root: &Path, link: &Path) -> Result<(), ExtractError> {
    let target = fs::read_link(root.join(link)).map_err(|source| ExtractError::WriteEntry {
        path: display_path(link),
        source,
    })?;
    let refuse = |reason| ExtractError::SymlinkTarget {
        path: display_path(link),
        target: display_path(&target),
        reason,
    };
    let mut resolved: Vec<OsString> = link
        .parent()
        .map(|p| p.iter().map(OsString::from).collect())
        .unwrap_or_default();
    let mut pending: VecDeque<OsString> = target.iter().map(OsString::from).collect();
    let mut hops = 0u32;
    while let Some(part) = pending.pop_front() {
        match part.to_str() {
            Some(".") => continue,
            Some("..") => {
                if resolved.pop().is_none() {
                    return Err(refuse("resolves outside the install directory"));
                }
                continue;
            }
            Some("/") => return Err(refuse("points to an absolute path")),
            _ => {}
        }
        let mut candidate: PathBuf = root.to_path_buf();
        candidate.extend(&resolved);
        candidate.push(&part);
        match fs::symlink_metadata(&candidate) {
            Ok(meta) if meta.file_type().is_symlink() => {
                hops += 1;
                if hops > MAX_LINK_HOPS {
                    return Err(refuse("is part of a symlink loop"));
                }
                let next =
                    fs::read_link(&candidate).map_err(|source| ExtractError::WriteEntry {
                        path: display_path(link),
                        source,
                    })?;
                if next.is_absolute() {
                    return Err(refuse("resolves through an absolute symlink"));
                }
                for p in next.iter().rev() {
                    pending.push_front(OsString::from(p));
                }
            }
            Ok(meta) if meta.is_dir() => resolved.push(part),
            Ok(_) if pending.is_empty() => resolved.push(part),
            Ok(_) => return Err(refuse("resolves through a file")),
            Err(_) => return Err(refuse("does not resolve to an entry of the archive")),
        }
    }
    Ok(())
}

/// Refuses what moving the entries of `from` into `into` must not do:
/// replace a directory with a non-directory, or put an entry at any of
/// `spare`. `into` is `existing` or does not exist yet (then nothing
/// below it does either).
fn check_merge(
    from: &Path,
    into: &Path,
    spare: &[PathBuf],
    existing: bool,
) -> Result<(), ExtractError> {
    for entry in fs::read_dir(from).map_err(install_error(from))? {
        let entry = entry.map_err(install_error(from))?;
        let dest = into.join(entry.file_name());
        if spare.contains(&dest) {
            return Err(ExtractError::WouldReplaceComponent(display_path(&dest)));
        }
        let source_is_dir = entry
            .file_type()
            .map_err(install_error(&entry.path()))?
            .is_dir();
        let dest_is_dir = match existing.then(|| fs::symlink_metadata(&dest)) {
            None => false,
            Some(Ok(meta)) => meta.is_dir(),
            Some(Err(e)) if e.kind() == io::ErrorKind::NotFound => false,
            Some(Err(e)) => return Err(install_error(&dest)(e)),
        };
        match (dest_is_dir, source_is_dir) {
            (true, true) => check_merge(&entry.path(), &dest, spare, true)?,
            (true, false) => return Err(ExtractError::WouldReplaceDirectory(display_path(&dest))),
            // Moved whole (new, or replacing a file): nothing below it
            // exists, but a spared path may lie below.
            (false, true) => check_merge(&entry.path(), &dest, spare, false)?,
            (false, false) => {}
        }
    }
    Ok(())
}

/// The error of an install step on `path`.
fn install_error(path: &Path) -> impl FnOnce(io::Error) -> ExtractError {
    let path = display_path(path);
    move |source| ExtractError::Install { path, source }
}

/// Moves every entry of `from` into the existing directory `into`, merging
/// directories and replacing files and symlinks of the same name.
fn merge_dir(from: &Path, into: &Path) -> Result<(), ExtractError> {
    for entry in fs::read_dir(from).map_err(install_error(from))? {
        let entry = entry.map_err(install_error(from))?;
        let source = entry.path();
        let dest = into.join(entry.file_name());
        let source_is_dir = entry.file_type().map_err(install_error(&source))?.is_dir();
        match fs::symlink_metadata(&dest) {
            Ok(meta) if meta.is_dir() && source_is_dir => merge_dir(&source, &dest)?,
            Ok(meta) if meta.is_dir() => {
                return Err(ExtractError::WouldReplaceDirectory(display_path(&dest)))
            }
            Ok(_) if source_is_dir => {
                fs::remove_file(&dest).map_err(install_error(&dest))?;
                fs::rename(&source, &dest).map_err(install_error(&dest))?;
            }
            Ok(_) => fs::rename(&source, &dest).map_err(install_error(&dest))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::rename(&source, &dest).map_err(install_error(&dest))?;
            }
            Err(e) => return Err(install_error(&dest)(e)),
        }
    }
    Ok(())
}

/// The decompressed stream exceeded its bound.
#[derive(Debug)]
struct LimitExceeded(u64);

impl std::fmt::Display for LimitExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "decompressed archive exceeds {} bytes", self.0)
    }
}

impl std::error::Error for LimitExceeded {}

/// A reader that fails (rather than ending quietly) past `limit` bytes, so
/// a gzip bomb is an error and not a truncated archive.
struct Bounded<R> {
    inner: R,
    remaining: u64,
    limit: u64,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.remaining == 0 {
            // Allow a clean end of stream exactly at the limit.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::other(LimitExceeded(self.limit))),
            };
        }
        let max = usize::try_from(self.remaining)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self.inner.read(&mut buf[..max])?;
        self.remaining -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_paths() {
        assert_eq!(
            relative_entry_path(Path::new("./a/./b")).unwrap(),
            Path::new("a/b")
        );
        assert_eq!(relative_entry_path(Path::new("./")).unwrap(), Path::new(""));
        assert!(relative_entry_path(Path::new("/etc/x")).is_err());
        assert!(relative_entry_path(Path::new("a/../x")).is_err());
    }

    #[test]
    fn archive_paths_are_escaped_and_cut_for_display() {
        assert_eq!(display_archive_path(b"bin/tool"), "bin/tool");
        assert_eq!(display_archive_path(b""), "");
        assert_eq!(
            display_archive_path(b"a\x1b[31m\x07\n\x7f\"q\"\\b"),
            r#"a\x1b[31m\x07\x0a\x7f\"q\"\\b"#
        );
        // Not UTF-8; printable and non-printable non-ASCII characters.
        assert_eq!(display_archive_path(b"\xff\xfeok"), r"\xff\xfeok");
        assert_eq!(
            display_archive_path("é\u{202e}txt.exe\u{200b}\u{85}".as_bytes()),
            r"é\u{202e}txt.exe\u{200b}\u{85}"
        );

        let exact = "a".repeat(MAX_SHOWN_PATH_CHARS);
        assert_eq!(display_archive_path(exact.as_bytes()), exact);
        let long = "b".repeat(MAX_SHOWN_PATH_CHARS + 10);
        assert_eq!(
            display_archive_path(long.as_bytes()),
            format!("{}…(+10 bytes)", "b".repeat(MAX_SHOWN_PATH_CHARS))
        );
        // An escape is never split: 127 characters, then a 4-character
        // escape that does not fit; 2 bytes left out.
        let mut edge = vec![b'c'; MAX_SHOWN_PATH_CHARS - 1];
        edge.extend_from_slice(b"\x1bd");
        assert_eq!(
            display_archive_path(&edge),
            format!("{}…(+2 bytes)", "c".repeat(MAX_SHOWN_PATH_CHARS - 1))
        );
        // Escapes count towards the bound.
        let shown = display_archive_path(&[0x1b; 10_000]);
        assert_eq!(
            shown,
            format!("{}…(+9968 bytes)", r"\x1b".repeat(MAX_SHOWN_PATH_CHARS / 4))
        );
    }

    fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
        let rest = key.len() + value.len() + 3; // " ", "=", "\n"
        let mut length = rest + 1;
        while length != rest + length.to_string().len() {
            length += 1;
        }
        let mut record = format!("{length} {key}=").into_bytes();
        record.extend_from_slice(value);
        record.push(b'\n');
        assert_eq!(record.len(), length);
        record
    }

    #[test]
    fn pax_records() {
        let limits = ExtractLimits::default();
        let local = MetadataRecord::PaxHeader;
        let mut body = pax_record("mtime", b"1700000000.5");
        body.extend(pax_record("path", b"dir/a\nb=c"));
        body.extend(pax_record("linkpath", b"t"));
        body.extend(pax_record("size", b"42"));
        body.extend(pax_record("SCHILY.xattr.user.x", b"\0\xff"));
        body.extend([0u8; 7]);
        let fields = parse_pax(&body, local, &limits).unwrap();
        assert_eq!(fields.path, Some(&b"dir/a\nb=c"[..]));
        assert_eq!(fields.linkpath, Some(&b"t"[..]));
        assert_eq!(fields.size, Some(42));

        let reason = |body: &[u8], record| match parse_pax(body, record, &limits) {
            Err(ExtractError::Metadata { reason, .. }) => reason.to_owned(),
            Err(ExtractError::PaxKey { key, reason, .. }) => format!("{key} {reason}"),
            Err(ExtractError::NameTooLong { key, size, .. }) => format!("{key} {size}"),
            Err(other) => panic!("unexpected error {other}"),
            Ok(_) => "ok".to_owned(),
        };
        let malformed = "holds a malformed record";
        assert_eq!(reason(b"", local), "ok");
        assert_eq!(reason(b"12 path=abc\n", local), "ok");
        assert_eq!(
            reason(b"11 path=abc\n", local),
            malformed,
            "length too short"
        );
        assert_eq!(
            reason(b"13 path=abc\n", local),
            malformed,
            "length too long"
        );
        assert_eq!(
            reason(b"12 path=abc\nx", local),
            malformed,
            "trailing garbage"
        );
        assert_eq!(reason(b"11 path=abc", local), malformed, "no newline");
        assert_eq!(reason(b"7 =abc\n", local), malformed, "empty key");
        assert_eq!(reason(b"9 pathab\n", local), malformed, "no =");
        assert_eq!(reason(b"+9 path=a\n", local), malformed, "sign");
        assert_eq!(reason(b"99999999999999999999999 a=b\n", local), malformed);
        assert_eq!(reason(&pax_record("path", b""), local), "path is empty");
        assert_eq!(
            reason(&pax_record("linkpath", b"a\0b"), local),
            "linkpath contains a NUL byte"
        );
        assert_eq!(
            reason(&pax_record("path", &[b'a'; 4097]), local),
            "path 4097"
        );
        assert_eq!(reason(&pax_record("path", &[b'a'; 4096]), local), "ok");
        assert_eq!(
            reason(
                &[pax_record("path", b"a"), pax_record("path", b"b")].concat(),
                local
            ),
            "path is set twice"
        );
        assert_eq!(
            reason(&pax_record("size", b"0x10"), local),
            "size is not a decimal number"
        );
        assert_eq!(
            reason(&pax_record("GNU.sparse.map", b"0,1"), local),
            "GNU.sparse.map describes a sparse file; sparse files are not allowed"
        );
        let global = MetadataRecord::PaxGlobalHeader;
        assert_eq!(reason(&pax_record("comment", b"4b825dc6"), global), "ok");
        for key in ["path", "linkpath", "size"] {
            assert_eq!(
                reason(&pax_record(key, b"1"), global),
                format!("{key} is not allowed in a global header")
            );
        }
    }

    #[test]
    fn gnu_names() {
        let name = |b: &[u8]| gnu_name(b.to_vec(), MetadataRecord::LongName);
        assert_eq!(name(b"a/b\0").unwrap(), b"a/b");
        assert_eq!(name(b"a/b\0\0\0").unwrap(), b"a/b");
        assert_eq!(name(b"a/b").unwrap(), b"a/b");
        assert!(name(b"\0").is_err());
        assert!(name(b"a\0b\0").is_err());
    }

    #[test]
    fn lexical_symlink_rule() {
        let ok = |l: &str, t: &str| check_symlink_lexically(Path::new(l), Path::new(t)).is_ok();
        assert!(ok("bin/tool", "../lib/tool"));
        assert!(ok("tool", "bin/tool"));
        assert!(!ok("tool", "../tool"));
        assert!(!ok("bin/tool", "../../tool"));
        assert!(!ok("evil", "/"));
        assert!(!ok("evil", ""));
    }

    /// A one-file `.tgz`, then `trailing` bytes after the gzip stream.
    fn small_tgz(trailing: &[u8]) -> Vec<u8> {
        let gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        let mut tar = tar::Builder::new(gzip);
        let mut header = tar::Header::new_gnu();
        header.set_size(5);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, "tool", &b"hello"[..]).unwrap();
        let mut bytes = tar.into_inner().unwrap().finish().unwrap();
        bytes.extend_from_slice(trailing);
        bytes
    }

    #[test]
    fn an_archive_longer_than_the_limit_is_too_large_and_not_the_targets_fault() {
        let dir = tempfile::tempdir().unwrap();
        let extract = |bytes: &[u8], max_archive_bytes: u64| {
            let path = dir.path().join("archive.tgz");
            fs::write(&path, bytes).unwrap();
            let target = dir.path().join("target");
            let limits = ExtractLimits {
                max_archive_bytes,
                ..ExtractLimits::default()
            };
            let file = fs::File::open(&path).unwrap();
            let result = extract_tgz_verified(file, Sha256Digest::of(bytes), &target, &limits);
            let extracted = target.exists();
            let _ = fs::remove_dir_all(&target);
            (result, extracted)
        };
        // The genuine archive, one byte over the limit: refused before its
        // hash is taken, nothing put in place.
        let genuine = small_tgz(b"");
        let len = u64::try_from(genuine.len()).unwrap();
        let (result, extracted) = extract(&genuine, len - 1);
        let error = result.unwrap_err();
        assert!(
            matches!(error, ExtractError::ArchiveTooLarge(limit) if limit == len - 1),
            "{error}"
        );
        assert!(!error.is_at_target());
        assert!(!extracted);
        // At the limit exactly, it is extracted.
        let (result, extracted) = extract(&genuine, len);
        assert_eq!(result.unwrap().files, 1);
        assert!(extracted);
        // A gzip stream within the limit, the file past it (as a file grown
        // after its size was checked): too large as well.
        let grown = small_tgz(&[0; 4096]);
        let (result, extracted) = extract(&grown, len + 100);
        assert!(
            matches!(result, Err(ExtractError::ArchiveTooLarge(_))),
            "{result:?}"
        );
        assert!(!extracted);
    }
}
