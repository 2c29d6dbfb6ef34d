//! Files the CLI writes where others may have planted something.

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use rand::RngCore as _;

/// Creates a new file `.<name>.<random>.<suffix>` in `dir`, mode 0600:
/// `O_CREAT | O_EXCL | O_NOFOLLOW`, so it never opens an existing file and
/// never follows a symbolic link, whatever was planted in the directory.
/// The caller sets the final mode, writes, and renames it into place.
pub fn create_temporary(
    dir: &Path,
    name: &OsStr,
    suffix: &str,
) -> std::io::Result<(PathBuf, std::fs::File)> {
    let mut attempt = 0;
    loop {
        let mut temp_name = OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(".{:016x}.{suffix}", rand::rngs::OsRng.next_u64()));
        let temp = dir.join(temp_name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&temp)
        {
            Ok(file) => return Ok((temp, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 8 => {
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}
