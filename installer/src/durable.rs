//! Files written so that a crash leaves the old content or the new, never a
//! part, and a finished write survives the crash: the one implementation
//! the agent, the CLI and the image tool share.

use std::fs::{File, Permissions};
use std::io::{self, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

/// The directory `path` is in (`.` for a bare name).
pub fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Syncs the directory `path` is in: a rename into it, or a removal from
/// it, done before this returns survives a crash.
pub fn sync_parent(path: &Path) -> io::Result<()> {
    File::open(parent_dir(path))?.sync_all()
}

/// Replaces `path` with `data`, whose mode becomes exactly `mode` (the
/// umask aside): a new temporary file in the same directory (random name,
/// created 0600, so no one reads the content before its mode is set),
/// written and synced, renamed over `path`, then the directory synced. A
/// symbolic link at `path` is replaced, not followed. On an error the
/// temporary file is removed and `path` is as it was.
pub fn replace(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(name);
    prefix.push(".");
    let mut temp = tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".tmp")
        .tempfile_in(parent_dir(path))?;
    temp.as_file()
        .set_permissions(Permissions::from_mode(mode))?;
    temp.write_all(data)?;
    temp.as_file().sync_all()?;
    temp.persist(path).map_err(|e| e.error)?;
    sync_parent(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt as _;

    #[test]
    fn a_file_is_replaced_whole_with_exactly_its_mode_and_nothing_left_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("measurements.json");
        replace(&path, b"one", 0o644).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o644);
        replace(&path, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["measurements.json"]);
    }

    #[test]
    fn a_link_in_the_files_place_is_replaced_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"theirs").unwrap();
        let path = dir.path().join("file");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        replace(&path, b"ours", 0o644).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"theirs");
        assert!(!std::fs::symlink_metadata(&path).unwrap().is_symlink());
        assert_eq!(std::fs::read(&path).unwrap(), b"ours");
    }

    #[test]
    fn a_failed_write_leaves_the_old_content_and_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory in the file's place: the rename fails after the
        // temporary file was written.
        let path = dir.path().join("taken");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), b"kept").unwrap();
        assert!(replace(&path, b"new", 0o644).is_err());
        assert_eq!(std::fs::read(path.join("inside")).unwrap(), b"kept");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert!(replace(Path::new("/"), b"x", 0o644).is_err());
    }
}
