//! Files written so that a crash leaves the old content or the new, never a
//! part, and a finished write survives the crash: the one implementation
//! the agent, the CLI and the image tool share.

use std::fs::{File, OpenOptions, Permissions};
use std::io::{self, Write as _};
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, PoisonError};

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
/// umask aside): a temporary file beside it, `.<name>.tmp-<pid>`, created
/// 0600 (no one reads the content before its mode is set), written and
/// synced, renamed over `path`, then the directory synced. A symbolic link
/// at `path` is replaced, not followed. On an error the temporary file is
/// removed and `path` is as it was. Writers of one path in this process
/// take turns ([`Turn`]); a temporary file of that name left by an earlier
/// process of the same pid is removed first.
pub fn replace(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let mut temp_name = std::ffi::OsString::from(".");
    temp_name.push(name);
    temp_name.push(format!(".tmp-{}", std::process::id()));
    let temp = parent_dir(path).join(temp_name);
    let _turn = Turn::take(path);
    let _ = std::fs::remove_file(&temp);
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)?;
        file.set_permissions(Permissions::from_mode(mode))?;
        file.write_all(data)?;
        file.sync_all()?;
        std::fs::rename(&temp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written?;
    sync_parent(path)
}

/// The paths [`replace`] is writing now, and the signal that one of them
/// is done.
static WRITING: (Mutex<Vec<PathBuf>>, Condvar) = (Mutex::new(Vec::new()), Condvar::new());

/// One writer's turn at a path: while it is held, no other writer in this
/// process removes or renames the path's temporary file.
struct Turn<'a>(&'a Path);

impl<'a> Turn<'a> {
    /// Waits until no other writer holds `path`, then holds it.
    fn take(path: &'a Path) -> Self {
        let (writing, done) = &WRITING;
        let mut paths = writing.lock().unwrap_or_else(PoisonError::into_inner);
        while paths.iter().any(|p| p == path) {
            paths = done.wait(paths).unwrap_or_else(PoisonError::into_inner);
        }
        paths.push(path.to_owned());
        Self(path)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let (writing, done) = &WRITING;
        let mut paths = writing.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = paths.iter().position(|p| p == self.0) {
            paths.swap_remove(i);
        }
        done.notify_all();
    }
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

    /// Writers of one path in one process share the temporary name: they
    /// take turns, every write succeeds, and the file is always one
    /// writer's whole content.
    #[test]
    fn concurrent_writers_of_one_path_all_succeed_and_never_mix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry.json");
        std::thread::scope(|scope| {
            for writer in 0..8u8 {
                let path = &path;
                scope.spawn(move || {
                    for _ in 0..20 {
                        replace(path, &[b'a' + writer; 64 * 1024], 0o600).unwrap();
                        let read = std::fs::read(path).unwrap();
                        assert_eq!(read.len(), 64 * 1024);
                        assert!(read.iter().all(|b| *b == read[0]));
                    }
                });
            }
        });
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
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
