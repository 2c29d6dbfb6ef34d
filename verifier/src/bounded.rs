//! Reading files whose size is bounded before their contents are parsed.

use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// Reads `path` if it holds at most `limit` bytes; `Ok(None)` when it holds
/// more (only `limit + 1` bytes are ever read). Anything but a regular file
/// (a FIFO, a device, a directory) is refused with `InvalidInput`, and
/// opening it never waits for a writer.
pub fn read(path: &Path, limit: u64) -> std::io::Result<Option<Vec<u8>>> {
    // O_NONBLOCK keeps the open of a FIFO from waiting; reads of a regular
    // file ignore it.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= limit).then_some(bytes))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::read;

    #[test]
    fn a_file_is_read_up_to_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"four").unwrap();
        assert_eq!(read(&path, 4).unwrap().as_deref(), Some(&b"four"[..]));
        assert_eq!(read(&path, 3).unwrap(), None);
        let missing = read(&dir.path().join("missing"), 4).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    }

    /// A FIFO with no writer would block a plain open (and a reader) for
    /// ever; a directory is no file to parse.
    #[test]
    fn a_fifo_or_a_directory_is_refused_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        for path in [fifo.as_path(), dir.path()] {
            let e = read(path, 4).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{path:?}");
        }
    }
}
