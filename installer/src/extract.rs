//! Strict extraction of `.tgz` components.
//!
//! Rules (anything else refuses the whole archive):
//! * entry paths are relative and have no `..` part (`.` parts are dropped);
//! * entries are regular files, directories or symbolic links; hard links,
//!   device nodes, fifos, sparse and other special entries are refused;
//! * a symlink's target is relative, stays inside the install directory when
//!   read lexically, and after extraction resolves — following the archive's
//!   own links — to an existing entry inside it;
//! * no entry is written through a symlink, and no path appears twice;
//! * files become mode 0755 when the archive gives any execute bit, else
//!   0644; directories 0755; ownership is not taken from the archive;
//! * the decompressed stream and the entry count are bounded.
//!
//! The archive is unpacked into a fresh staging directory next to the target
//! and checked in full before anything moves. If the target does not exist
//! the staging directory is renamed into place (atomic); if it exists (e.g.
//! `/run/state/bin`, shared with single-file components) each top-level entry
//! is renamed into it, replacing files of the same name. A failure before
//! that step leaves the target untouched.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{self, DirBuilder, OpenOptions, Permissions};
use std::io::{self, BufReader, Read};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Component as PathPart, Path, PathBuf};

use tar::EntryType;

/// Bounds on one archive.
#[derive(Debug, Clone, Copy)]
pub struct ExtractLimits {
    /// Largest decompressed tar stream, in bytes.
    pub max_unpacked_bytes: u64,
    /// Most entries.
    pub max_entries: u64,
}

impl Default for ExtractLimits {
    fn default() -> Self {
        Self {
            max_unpacked_bytes: 2 * 1024 * 1024 * 1024,
            max_entries: 100_000,
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

/// Why an archive was refused or could not be installed.
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
    /// The decompressed archive is larger than the limit.
    #[error("the archive unpacks to more than {0} bytes")]
    TooLarge(u64),
    /// The archive has more entries than the limit.
    #[error("the archive has more than {0} entries")]
    TooManyEntries(u64),
    /// An entry path breaks the path rules.
    #[error("archive entry {path:?} {reason}")]
    EntryPath {
        /// The entry path as stored.
        path: PathBuf,
        /// Which rule it broke.
        reason: &'static str,
    },
    /// An entry is of a refused type.
    #[error("archive entry {path:?} is a {kind}; only regular files, directories and contained symlinks are allowed")]
    EntryType {
        /// The entry path as stored.
        path: PathBuf,
        /// The refused type.
        kind: String,
    },
    /// A symlink points outside the install directory or nowhere.
    #[error("archive symlink {path:?} -> {target:?} {reason}")]
    SymlinkTarget {
        /// The symlink's path.
        path: PathBuf,
        /// Its target.
        target: PathBuf,
        /// Which rule it broke.
        reason: &'static str,
    },
    /// An entry would be written through a symlink of the archive.
    #[error("archive entry {0:?} lies beneath a symlink")]
    ThroughSymlink(PathBuf),
    /// An entry would be written beneath a non-directory entry.
    #[error("archive entry {0:?} lies beneath a file")]
    ThroughFile(PathBuf),
    /// An entry path appears twice.
    #[error("archive entry {0:?} appears twice")]
    Duplicate(PathBuf),
    /// A file entry ended before its size.
    #[error("archive entry {0:?} is truncated")]
    TruncatedEntry(PathBuf),
    /// Writing an entry into the staging directory failed.
    #[error("writing archive entry {path:?}")]
    WriteEntry {
        /// The entry path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// An existing directory would be replaced by a non-directory.
    #[error("{0:?} is a directory and the archive has a non-directory there")]
    WouldReplaceDirectory(PathBuf),
    /// Moving extracted entries into the target failed.
    #[error("moving extracted entries into {path:?}")]
    Install {
        /// The destination.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// Unpacks the gzip-compressed tar archive at `archive` into the directory
/// `target`, whose parent must exist.
pub fn extract_tgz(
    archive: &Path,
    target: &Path,
    limits: &ExtractLimits,
) -> Result<ExtractSummary, ExtractError> {
    let target_exists = match fs::symlink_metadata(target) {
        Ok(meta) if meta.is_dir() => true,
        Ok(_) => return Err(ExtractError::TargetNotDirectory(target.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(source) => {
            return Err(ExtractError::Install {
                path: target.to_owned(),
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
        .prefix(&staging_prefix(target))
        .suffix(".keel-extract")
        .tempdir_in(parent)
        .map_err(staging_error)?;
    fs::set_permissions(staging.path(), Permissions::from_mode(0o755)).map_err(staging_error)?;

    let file = fs::File::open(archive).map_err(ExtractError::ReadArchive)?;
    let gunzip = flate2::read::GzDecoder::new(BufReader::with_capacity(256 * 1024, file));
    let bounded = Bounded {
        inner: gunzip,
        remaining: limits.max_unpacked_bytes,
        limit: limits.max_unpacked_bytes,
    };
    let (summary, symlinks) = unpack(bounded, staging.path(), limits)?;
    for link in &symlinks {
        check_symlink_resolves(staging.path(), link)?;
    }

    if target_exists {
        merge_dir(staging.path(), target)?;
        // `staging` is now empty of entries; dropping it removes it.
    } else {
        let staged = staging.keep();
        fs::rename(&staged, target).map_err(|source| {
            let _ = fs::remove_dir_all(&staged);
            ExtractError::Install {
                path: target.to_owned(),
                source,
            }
        })?;
    }
    Ok(summary)
}

fn staging_prefix(target: &Path) -> OsString {
    let mut prefix = OsString::from(".");
    prefix.push(target.file_name().unwrap_or_default());
    prefix.push(".");
    prefix
}

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
    let entries = archive.entries().map_err(read_error)?;
    for entry in entries {
        let mut entry = entry.map_err(read_error)?;
        count += 1;
        if count > limits.max_entries {
            return Err(ExtractError::TooManyEntries(limits.max_entries));
        }
        let stored = entry.path().map_err(read_error)?.into_owned();
        let kind = entry.header().entry_type();
        if kind == EntryType::XGlobalHeader {
            // pax global metadata (e.g. a commit id from `git archive`): no file.
            continue;
        }
        let relative = relative_entry_path(&stored)?;
        match kind {
            EntryType::Directory => {
                if relative.as_os_str().is_empty() {
                    continue; // the archive root, "./"
                }
                make_dirs(root, &relative, &stored)?;
                summary.directories += 1;
            }
            EntryType::Regular => {
                let parent = nonempty_parent(&relative, &stored)?;
                make_dirs(root, parent, &stored)?;
                let mode = if entry.header().mode().map_err(read_error)? & 0o111 != 0 {
                    0o755
                } else {
                    0o644
                };
                summary.bytes += write_file(&mut entry, &root.join(&relative), mode, &stored)?;
                summary.files += 1;
            }
            EntryType::Symlink => {
                let parent = nonempty_parent(&relative, &stored)?;
                let target = entry
                    .link_name()
                    .map_err(read_error)?
                    .ok_or_else(|| ExtractError::EntryPath {
                        path: stored.clone(),
                        reason: "is a symlink without a target",
                    })?
                    .into_owned();
                check_symlink_lexically(&relative, &target)?;
                make_dirs(root, parent, &stored)?;
                std::os::unix::fs::symlink(&target, root.join(&relative)).map_err(|e| {
                    if e.kind() == io::ErrorKind::AlreadyExists {
                        ExtractError::Duplicate(stored.clone())
                    } else {
                        ExtractError::WriteEntry {
                            path: stored.clone(),
                            source: e,
                        }
                    }
                })?;
                symlinks.push(relative);
                summary.symlinks += 1;
            }
            other => {
                return Err(ExtractError::EntryType {
                    path: stored,
                    kind: kind_name(other),
                })
            }
        }
    }
    Ok((summary, symlinks))
}

fn read_error(e: io::Error) -> ExtractError {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<LimitExceeded>())
    {
        Some(limit) => ExtractError::TooLarge(limit.0),
        None => ExtractError::ReadArchive(e),
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

/// The entry path with `.` parts dropped; refuses absolute paths and `..`.
fn relative_entry_path(stored: &Path) -> Result<PathBuf, ExtractError> {
    let mut relative = PathBuf::new();
    for part in stored.components() {
        match part {
            PathPart::Normal(name) => relative.push(name),
            PathPart::CurDir => {}
            PathPart::RootDir | PathPart::Prefix(_) => {
                return Err(ExtractError::EntryPath {
                    path: stored.to_owned(),
                    reason: "is absolute",
                })
            }
            PathPart::ParentDir => {
                return Err(ExtractError::EntryPath {
                    path: stored.to_owned(),
                    reason: "contains \"..\"",
                })
            }
        }
    }
    Ok(relative)
}

/// The parent of a non-directory entry; refuses an entry naming the root.
fn nonempty_parent<'a>(relative: &'a Path, stored: &Path) -> Result<&'a Path, ExtractError> {
    match relative.parent() {
        Some(parent) if !relative.as_os_str().is_empty() => Ok(parent),
        _ => Err(ExtractError::EntryPath {
            path: stored.to_owned(),
            reason: "names the archive root",
        }),
    }
}

/// Creates `relative` (a directory path) under `root`, refusing to pass
/// through symlinks or files.
fn make_dirs(root: &Path, relative: &Path, stored: &Path) -> Result<(), ExtractError> {
    let mut current = root.to_path_buf();
    for part in relative.components() {
        current.push(part);
        match fs::symlink_metadata(&current) {
            Ok(meta) if meta.is_dir() => {}
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(ExtractError::ThroughSymlink(stored.to_owned()))
            }
            Ok(_) => return Err(ExtractError::ThroughFile(stored.to_owned())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let write_error = |source| ExtractError::WriteEntry {
                    path: stored.to_owned(),
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
                    path: stored.to_owned(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// Writes one regular file; `create_new` refuses an existing path, including
/// a symlink there, so nothing is written through a link.
fn write_file<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    path: &Path,
    mode: u32,
    stored: &Path,
) -> Result<u64, ExtractError> {
    let write_error = |source| ExtractError::WriteEntry {
        path: stored.to_owned(),
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
                ExtractError::Duplicate(stored.to_owned())
            } else {
                write_error(e)
            }
        })?;
    // Read errors (a bomb, a cut archive) and write errors look alike here;
    // the bound is the one worth naming.
    let copied = io::copy(entry, &mut file).map_err(|e| match read_error(e) {
        ExtractError::ReadArchive(e) => write_error(e),
        too_large => too_large,
    })?;
    if copied != size {
        return Err(ExtractError::TruncatedEntry(stored.to_owned()));
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
        path: link.to_owned(),
        target: target.to_owned(),
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
        path: link.to_owned(),
        source,
    })?;
    let refuse = |reason| ExtractError::SymlinkTarget {
        path: link.to_owned(),
        target: target.clone(),
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
                        path: link.to_owned(),
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

/// Moves every entry of `from` into the existing directory `into`, merging
/// directories and replacing files and symlinks of the same name.
fn merge_dir(from: &Path, into: &Path) -> Result<(), ExtractError> {
    let install_error = |path: &Path| {
        let path = path.to_owned();
        move |source| ExtractError::Install { path, source }
    };
    for entry in fs::read_dir(from).map_err(install_error(from))? {
        let entry = entry.map_err(install_error(from))?;
        let source = entry.path();
        let dest = into.join(entry.file_name());
        let source_is_dir = entry.file_type().map_err(install_error(&source))?.is_dir();
        match fs::symlink_metadata(&dest) {
            Ok(meta) if meta.is_dir() && source_is_dir => merge_dir(&source, &dest)?,
            Ok(meta) if meta.is_dir() => return Err(ExtractError::WouldReplaceDirectory(dest)),
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
    fn lexical_symlink_rule() {
        let ok = |l: &str, t: &str| check_symlink_lexically(Path::new(l), Path::new(t)).is_ok();
        assert!(ok("bin/tool", "../lib/tool"));
        assert!(ok("tool", "bin/tool"));
        assert!(!ok("tool", "../tool"));
        assert!(!ok("bin/tool", "../../tool"));
        assert!(!ok("evil", "/"));
        assert!(!ok("evil", ""));
    }
}
