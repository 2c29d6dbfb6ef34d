//! Writing the node's private files: kubeadm configurations (they carry the
//! bootstrap token), keys and certificates, the join measurements; and
//! reading secret ones back.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use keel_installer::durable::{self, parent_dir};
use zeroize::Zeroizing;

/// Writing a file failed.
#[derive(Debug, thiserror::Error)]
#[error("writing {path:?}")]
pub struct WriteFileError {
    /// The file.
    pub path: PathBuf,
    /// The cause.
    #[source]
    pub source: std::io::Error,
}

/// Writes `data` to `path` atomically with mode 0600
/// ([`keel_installer::durable::replace`]): a reader sees the old content or
/// the new, never a part, and the new survives a crash once this returns.
/// Creates the directory (0700) if needed. Writers of one path in this
/// process take turns; each write is whole.
pub fn write_private(path: &Path, data: &[u8]) -> Result<(), WriteFileError> {
    let fail = |source| WriteFileError {
        path: path.to_owned(),
        source,
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(parent_dir(path))
        .map_err(fail)?;
    durable::replace(path, data, 0o600).map_err(fail)
}

/// Removes the file at `path`, if there is one, and syncs its directory:
/// once this returns, a crash does not bring the file back.
pub fn remove_durably(path: &Path) -> std::io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        removed => removed.and_then(|()| durable::sync_parent(path)),
    }
}

/// A private file written for one run of a tool (kubeadm's configuration
/// and discovery kubeconfig, which hold a token or a key), removed when
/// this drops: after the run, on an error before it, and when the run is
/// cancelled (the agent stopping, its task aborted).
pub struct TransientFile(PathBuf);

impl TransientFile {
    /// Writes `data` to `path` as [`write_private`] does. On an error the
    /// file is removed too: the rename may have put it in place before the
    /// directory's sync failed.
    pub fn write(path: PathBuf, data: &[u8]) -> Result<Self, WriteFileError> {
        let file = Self(path);
        write_private(&file.0, data)?;
        Ok(file)
    }

    /// Writes `data` to `path` as [`write_private_scratch`] does (read
    /// once by the run, not synced).
    pub fn scratch(path: PathBuf, data: &[u8]) -> Result<Self, WriteFileError> {
        write_private_scratch(&path, data)?;
        Ok(Self(path))
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TransientFile {
    fn drop(&mut self) {
        remove_or_log(
            &self.0,
            "removing a file written for one kubeadm run failed",
        );
    }
}

/// Removes the file at `path` if there is one, without syncing (a file of
/// the agent's runtime directory); a failure is logged as `what`, since
/// only the file is left behind.
pub fn remove_or_log(path: &Path, what: &str) {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "{what}"),
    }
}

/// Writes `data` to a new file `path` with mode 0600, without syncing it:
/// for a file that lives only as long as one program run reads it (such as
/// a kubeadm configuration that carries a token) and is removed after, so
/// surviving a crash would only leave a secret behind. Creates the
/// directory (0700) if needed; an existing file is an error.
pub fn write_private_scratch(path: &Path, data: &[u8]) -> Result<(), WriteFileError> {
    let fail = |source| WriteFileError {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(fail)?;
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(fail)?;
    file.write_all(data).map_err(|e| {
        let _ = fs::remove_file(path);
        fail(e)
    })
}

/// Reads a secret file of at most `limit` bytes (larger: an error) into
/// one buffer allocated once at its full size and wiped when dropped, so
/// no partial copy of the secret is left in freed memory (a growing buffer,
/// or an async file's own buffer, would leave some; std reads a `limit`
/// under 32 bytes through a stack probe first, so keep the bounds above
/// that). Only a regular file is read, through no symbolic link in its
/// last component and never waiting on a FIFO: what is checked is what is
/// read ([`std::io::ErrorKind::InvalidInput`] otherwise). Blocks; call it
/// off the async runtime.
pub fn read_secret(path: &Path, limit: u64) -> std::io::Result<Zeroizing<Vec<u8>>> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let capacity = usize::try_from(limit.saturating_add(1))
        .map_err(|_| std::io::Error::other("the bound does not fit in memory"))?;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut data = Zeroizing::new(Vec::with_capacity(capacity));
    file.take(limit.saturating_add(1)).read_to_end(&mut data)?;
    if data.len() as u64 > limit {
        return Err(std::io::Error::other(format!("larger than {limit} bytes")));
    }
    Ok(data)
}

/// [`read_secret`] on a blocking thread.
pub async fn read_secret_async(path: &Path, limit: u64) -> std::io::Result<Zeroizing<Vec<u8>>> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || read_secret(&path, limit))
        .await
        .map_err(std::io::Error::other)?
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn a_secret_is_read_whole_up_to_its_bound_and_refused_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.key");
        std::fs::write(&path, [7u8; 64]).unwrap();
        let read = read_secret(&path, 64).unwrap();
        assert_eq!(read.as_slice(), [7u8; 64]);
        // Read into the buffer it was given, never a grown one.
        assert_eq!(read.capacity(), 65);
        let refused = read_secret(&path, 63).unwrap_err();
        assert!(
            refused.to_string().contains("larger than 63 bytes"),
            "{refused}"
        );
        assert!(read_secret(&dir.path().join("missing"), 64).is_err());
        // A link to the secret, a directory and a FIFO are not read (the
        // FIFO, with no writer, would block a plain open for good).
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRUSR).unwrap();
        for other in [&link, &dir.path().to_path_buf(), &fifo] {
            assert!(read_secret(other, 64).is_err(), "{}", other.display());
        }
    }

    #[test]
    fn files_are_0600_and_replaced_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/key.pem");
        write_private(&path, b"one").unwrap();
        write_private(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["key.pem"], "no temporary file left");
    }

    #[test]
    fn scratch_files_are_0600_new_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/token.yaml");
        write_private_scratch(&path, b"one").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"one");
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // An existing file is neither replaced nor removed.
        assert!(write_private_scratch(&path, b"two").is_err());
        assert_eq!(fs::read(&path).unwrap(), b"one");
    }

    #[test]
    fn a_file_where_a_directory_must_be_fails_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        write_private(&path, b"x").unwrap();
        let err = write_private(&path.join("y"), b"x").unwrap_err();
        assert_eq!(err.path, path.join("y"));
    }
}
