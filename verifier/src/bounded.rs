//! Reading files whose size is bounded before their contents are parsed.

use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// Reads `path` if it holds at most `limit` bytes; `Ok(None)` when it holds
/// more (only `limit + 1` bytes are ever read). A pipe is read like a file
/// (`--config <(...)`; kernel interfaces such as configfs-tsm).
pub fn read(path: &Path, limit: u64) -> std::io::Result<Option<Vec<u8>>> {
    up_to(std::fs::File::open(path)?, limit)
}

/// As [`read`], for a directory of files such as the collateral cache:
/// anything but a regular file (or a link to one) is refused with
/// `InvalidInput`, before it is opened when it is so as it is looked up (an
/// open may have effects, and a FIFO's may wait for a writer). One swapped
/// in after the look is opened without waiting and refused; a regular file
/// swapped in (a cache updated by rename) is read.
pub fn read_regular(path: &Path, limit: u64) -> std::io::Result<Option<Vec<u8>>> {
    let not_regular =
        || std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file");
    let looked = std::fs::metadata(path)?;
    if !looked.is_file() {
        return Err(not_regular());
    }
    // Should the name be swapped for a FIFO between the look and the
    // open, O_NONBLOCK keeps the open from waiting (reads of a regular
    // file ignore it), and what was opened is looked at again.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(not_regular());
    }
    up_to(file, limit)
}

fn up_to(file: std::fs::File, limit: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= limit).then_some(bytes))
}

/// Deserializes a list of at most `most` elements (`what` names them in
/// the error), refusing the next one before it is read: a document cannot
/// make a list of millions of tiny elements (an empty string is 3 bytes in
/// JSON and 24 in memory).
pub fn at_most<'de, D, T>(
    deserializer: D,
    most: usize,
    what: &'static str,
) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    deserializer.deserialize_seq(AtMost {
        most,
        what,
        elements: std::marker::PhantomData,
    })
}

struct AtMost<T> {
    most: usize,
    what: &'static str,
    elements: std::marker::PhantomData<T>,
}

impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for AtMost<T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a list of at most {} {}", self.most, self.what)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut elements = Vec::new();
        loop {
            if elements.len() == self.most {
                return match seq.next_element::<serde::de::IgnoredAny>()? {
                    Some(_) => Err(serde::de::Error::invalid_length(self.most + 1, &self)),
                    None => Ok(elements),
                };
            }
            match seq.next_element()? {
                Some(element) => elements.push(element),
                None => return Ok(elements),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{read, read_regular};
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::time::Duration;

    #[test]
    fn a_file_or_a_link_to_one_is_read_up_to_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"four").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        for read in [read, read_regular] {
            for path in [&path, &link] {
                assert_eq!(read(path, 4).unwrap().as_deref(), Some(&b"four"[..]));
                assert_eq!(read(path, 3).unwrap(), None);
            }
            let missing = read(&dir.path().join("missing"), 4).unwrap_err();
            assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
        }
    }

    /// A FIFO made in `dir`.
    fn fifo_in(dir: &std::path::Path) -> std::path::PathBuf {
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        fifo
    }

    /// A FIFO with no writer would block a plain open (and a reader) for
    /// ever; a directory is no file to parse. The check runs on a thread
    /// of its own, so a regression fails the test instead of hanging it.
    #[test]
    fn read_regular_refuses_a_fifo_or_a_directory_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = fifo_in(dir.path());
        let (done, finished) = std::sync::mpsc::channel();
        let paths = [fifo, dir.path().to_owned()];
        std::thread::spawn(move || {
            let kinds: Vec<_> = paths
                .iter()
                .map(|p| read_regular(p, 4).map_err(|e| e.kind()))
                .collect();
            let _ = done.send(kinds);
        });
        let kinds = finished
            .recv_timeout(Duration::from_secs(10))
            .expect("read_regular waited on a FIFO");
        for kind in kinds {
            assert_eq!(kind.unwrap_err(), std::io::ErrorKind::InvalidInput);
        }
    }

    /// What is not a regular file is refused before it is opened: a
    /// writer waiting for a FIFO's reader is not released by the refusal.
    #[test]
    fn read_regular_does_not_open_what_it_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = fifo_in(dir.path());
        let (opened, writer_released) = std::sync::mpsc::channel();
        let writer_path = fifo.clone();
        let writer = std::thread::spawn(move || {
            let file = std::fs::OpenOptions::new().write(true).open(writer_path);
            let _ = opened.send(());
            file
        });
        // Time for the writer to reach its wait in open().
        std::thread::sleep(Duration::from_millis(200));
        let refused = read_regular(&fifo, 4).unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::InvalidInput);
        assert!(
            writer_released
                .recv_timeout(Duration::from_millis(300))
                .is_err(),
            "the FIFO was opened before it was refused"
        );
        // Releases the writer: a reader opens the FIFO.
        let _reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        writer.join().unwrap().unwrap();
    }
}
