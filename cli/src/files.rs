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

/// Removes the files `.<name>.<16 hex digits>.<suffix>` in `dir` that
/// [`create_temporary`] made for runs that did not finish (they may hold a
/// secret, or be a second link to one, if a run stopped between placing
/// its file and removing its temporary one).
pub fn remove_temporaries(dir: &Path, name: &OsStr, suffix: &str) {
    let (prefix, suffix) = (
        format!(".{}.", name.to_string_lossy()),
        format!(".{suffix}"),
    );
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let file = file.to_string_lossy();
        let random = file
            .strip_prefix(prefix.as_str())
            .and_then(|rest| rest.strip_suffix(suffix.as_str()));
        if random.is_some_and(|r| r.len() == 16 && r.bytes().all(|b| b.is_ascii_hexdigit())) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
