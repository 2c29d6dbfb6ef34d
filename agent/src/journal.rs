//! An append-only journal of JSON records, one per line, kept beside a
//! snapshot file: a store appends what changed and syncs it (one small
//! write and one `fdatasync`), instead of rewriting its whole file for
//! every change; now and then it writes a new snapshot and empties the
//! journal. Reading a store is its snapshot, then its journal replayed in
//! order, so records must be idempotent (the state of an entry, not a
//! delta). A fold appends the changes it is made for before it writes the
//! snapshot, so the last record of each entry in the journal is the state
//! the snapshot holds: a crash between a new snapshot and the emptied
//! journal, or a failure to empty it, replays records to the same result,
//! never to an older state of an entry.
//!
//! A crash can cut the last append short. [`Journal::open`] drops a last
//! line that is incomplete or does not parse, and cuts it off the file,
//! keeping its bytes in `<journal>.cut` where it can (a whole line this
//! agent cannot read may be a newer agent's record, written before the
//! node went back to an older image; that file holds at most the
//! journal's bound, and the log says when keeping fails); a bad line
//! before the last is corruption, and an error. A failed append
//! is cut off at once; if that fails too, no later append is written
//! until the cut succeeds, so a good record never follows a partial line.
//!
//! A journal never grows past the bound it is read with: an append that
//! would is refused, so a store whose snapshots keep failing stops taking
//! changes instead of writing a file it could not load again.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// A journal operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// Opening, reading, appending to or truncating the file failed.
    #[error("{what} the journal {path:?}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A line other than the last does not parse.
    #[error("line {line} of the journal {path:?} is corrupt: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The line (from 1).
        line: usize,
        /// Why it does not parse.
        reason: String,
    },
    /// The file is larger than the store allows, or an append would make
    /// it so.
    #[error("the journal {path:?} is (or would grow) larger than {limit} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The bound.
        limit: u64,
    },
}

/// A journal open for appending.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    len: u64,
    /// The most bytes the file may hold: what it is read with.
    limit: u64,
    /// A failed append may have left bytes past `len` that could not be cut.
    torn: bool,
}

/// The journal of the snapshot at `snapshot`: the same name with
/// `.journal` appended, in the same directory.
pub fn beside(snapshot: &Path) -> PathBuf {
    with_suffix(snapshot, ".journal")
}

/// Whether a journal of `journal_bytes` is due to be folded into a new
/// snapshot ([`Journal::outgrows`]), for one not opened yet.
pub fn outgrown(journal_bytes: u64, snapshot_bytes: u64, at_least: u64) -> bool {
    journal_bytes > at_least.max(snapshot_bytes)
}

/// `path` with `suffix` appended to its file name.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// The journal in `slot`, first opened (see [`Journal::open`]) beside
/// `snapshot` if the slot is empty: a store opens its journal for its first
/// write, having replayed it when it loaded.
pub fn opened<'a, R: DeserializeOwned>(
    slot: &'a mut Option<Journal>,
    snapshot: &Path,
    limit: u64,
) -> Result<&'a mut Journal, JournalError> {
    match slot {
        Some(journal) => Ok(journal),
        None => {
            let (journal, _replayed_at_load) = Journal::open::<R>(&beside(snapshot), limit)?;
            Ok(slot.insert(journal))
        }
    }
}

/// The records of the journal at `path` (none if there is no file), in
/// order, without changing the file; a last line cut short is left out.
pub fn read<R: DeserializeOwned>(path: &Path, limit: u64) -> Result<Vec<R>, JournalError> {
    match contents(path, limit)? {
        Some(bytes) => Ok(parse(path, &bytes)?.0),
        None => Ok(Vec::new()),
    }
}

impl Journal {
    /// Opens the journal at `path`, creating it (0600, and its directory,
    /// 0700) if needed, and reads its records (at most `limit` bytes of
    /// them; appends that would grow it past `limit` are refused). A last
    /// line cut short is cut off the file.
    pub fn open<R: DeserializeOwned>(
        path: &Path,
        limit: u64,
    ) -> Result<(Self, Vec<R>), JournalError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| io("creating", path, source))?;
        let existed = path.exists();
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| io("opening", path, source))?;
        if !existed {
            // The new file's name must survive a crash as its content will.
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|source| io("creating", path, source))?;
        }
        let bytes = contents(path, limit)?.unwrap_or_default();
        let (records, good) = parse(path, &bytes)?;
        let mut journal = Self {
            path: path.to_owned(),
            file,
            len: bytes.len() as u64,
            limit,
            torn: false,
        };
        if good < journal.len {
            let dropped = bytes.get(usize::try_from(good).unwrap_or(usize::MAX)..);
            let aside = set_aside(path, dropped.unwrap_or_default(), limit);
            match &aside {
                Ok(aside) => tracing::warn!(
                    path = %path.display(),
                    dropped = journal.len - good,
                    set_aside = %aside.display(),
                    "the journal's last line does not parse (cut short by a crash while appending, or written by another version of the agent): cut off the journal, its bytes kept beside it"
                ),
                Err(e) => tracing::error!(
                    path = %path.display(),
                    dropped = journal.len - good,
                    error = %e,
                    "the journal's last line does not parse (cut short by a crash while appending, or written by another version of the agent): cut off the journal, and keeping its bytes beside it failed"
                ),
            }
            journal.cut(good)?;
        }
        Ok((journal, records))
    }

    /// Appends one line per record and syncs them: when it returns `Ok`,
    /// the records survive a crash. On failure the file is cut back to
    /// what it was (and, should that fail, before the next append).
    /// Records that would grow the file past its limit are refused, and
    /// nothing is written.
    pub fn append<'a, R: Serialize + 'a>(
        &mut self,
        records: impl IntoIterator<Item = &'a R>,
    ) -> Result<(), JournalError> {
        if self.torn {
            self.cut(self.len)?;
        }
        let mut lines = Vec::new();
        for record in records {
            serde_json::to_writer(&mut lines, record).map_err(|e| JournalError::Io {
                what: "encoding a record for",
                path: self.path.clone(),
                source: e.into(),
            })?;
            lines.push(b'\n');
        }
        if lines.is_empty() {
            return Ok(());
        }
        if self.len.saturating_add(lines.len() as u64) > self.limit {
            return Err(JournalError::TooLarge {
                path: self.path.clone(),
                limit: self.limit,
            });
        }
        let written = self
            .file
            .write_all(&lines)
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += lines.len() as u64;
                Ok(())
            }
            Err(source) => {
                let failed = io("appending to", &self.path, source);
                self.torn = true;
                if let Err(e) = self.cut(self.len) {
                    tracing::error!(error = %keel_atls::ErrorChain(&e), "cutting a failed append off the journal; retried before the next append");
                }
                Err(failed)
            }
        }
    }

    /// Empties the journal (its records are in a new snapshot), durably.
    pub fn clear(&mut self) -> Result<(), JournalError> {
        self.cut(0)
    }

    /// Whether the journal is due to be folded into a new snapshot: once
    /// it is larger than the snapshot (`snapshot_bytes`) and than
    /// `at_least`, so a fold costs no more than the appends it replaces.
    pub fn outgrows(&self, snapshot_bytes: u64, at_least: u64) -> bool {
        outgrown(self.len, snapshot_bytes, at_least)
    }

    /// Makes `records` (the changes of one write) durable and folds the
    /// journal into a new snapshot that `write_snapshot` writes, holding
    /// every record; returns whether it did fold.
    ///
    /// The records are appended first: once that succeeds the write is
    /// durable, and the snapshot only compacts. A snapshot that fails
    /// (which may be in place already, its directory not synced) is logged
    /// and tried again by the next write; a failure to empty the journal
    /// after it is logged. Either way the journal's last record of each
    /// entry is the state the newest snapshot holds, so a restart replays
    /// it to that state. Only a journal at its bound (snapshots kept
    /// failing) refuses the append: then only a snapshot makes room, and
    /// it is written and the journal emptied, or the fold fails; a crash
    /// between the two can replay older states. Any other failure of the
    /// append fails the fold before a snapshot is written.
    pub fn fold<'a, R: Serialize + 'a, E: From<JournalError> + std::error::Error + 'static>(
        &mut self,
        records: impl IntoIterator<Item = &'a R>,
        write_snapshot: impl FnOnce() -> Result<(), E>,
    ) -> Result<bool, E> {
        match self.append(records) {
            // The journal now leaves the state the snapshot is to hold.
            Ok(()) => Ok(self.compact(write_snapshot)),
            Err(JournalError::TooLarge { .. }) => {
                write_snapshot()?;
                self.clear()?;
                Ok(true)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Folds the journal into a snapshot of the state it leaves, before a
    /// write adds anything: `write_snapshot` writes that state, then the
    /// journal is emptied. A crash between the two replays the journal onto
    /// the state it leaves, which changes nothing, whatever the journal
    /// holds; the write's own records go to the emptied journal after.
    /// A snapshot that fails is logged and the journal kept (its next
    /// append may then find it at its bound); returns whether it folded.
    pub fn compact<E: std::error::Error + 'static>(
        &mut self,
        write_snapshot: impl FnOnce() -> Result<(), E>,
    ) -> bool {
        if let Err(e) = write_snapshot() {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "writing a snapshot failed; the journal keeps the changes, and the next write tries again");
            return false;
        }
        if let Err(e) = self.clear() {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "emptying a journal folded into its snapshot");
        }
        true
    }

    /// Bytes in the journal.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the journal holds no record.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn cut(&mut self, len: u64) -> Result<(), JournalError> {
        self.file
            .set_len(len)
            .and_then(|()| self.file.sync_all())
            .map_err(|source| io("truncating", &self.path, source))?;
        self.len = len;
        self.torn = false;
        Ok(())
    }
}

/// Keeps `bytes`, a last line cut off the journal at `path`, as a line at
/// the end of `<path>.cut` (0600, synced): a record this agent cannot read
/// may be one a newer agent wrote before the node went back to this image.
/// The file is started afresh (what it kept is lost) when it would grow
/// past `limit`; returns its path.
fn set_aside(path: &Path, bytes: &[u8], limit: u64) -> std::io::Result<PathBuf> {
    let aside = with_suffix(path, ".cut");
    let held = match std::fs::symlink_metadata(&aside) {
        Ok(meta) => meta.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(e),
    };
    let mut options = OpenOptions::new();
    options
        .create(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW);
    if held.saturating_add(bytes.len() as u64) > limit {
        options.write(true).truncate(true);
    } else {
        options.append(true);
    }
    let mut file = options.open(&aside)?;
    file.write_all(bytes)?;
    if !bytes.ends_with(b"\n") {
        // One line per cut, a torn one included.
        file.write_all(b"\n")?;
    }
    file.sync_data()?;
    if held == 0 {
        File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()?;
    }
    Ok(aside)
}

fn io(what: &'static str, path: &Path, source: std::io::Error) -> JournalError {
    JournalError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// The journal's bytes, at most `limit` of them; `None` if there is no
/// file.
fn contents(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, JournalError> {
    match keel_verifier::bounded::read(path, limit) {
        Ok(Some(bytes)) => Ok(Some(bytes)),
        Ok(None) => Err(JournalError::TooLarge {
            path: path.to_owned(),
            limit,
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(io("reading", path, source)),
    }
}

/// The records of `bytes` and how many bytes hold whole, parsed lines.
fn parse<R: DeserializeOwned>(path: &Path, bytes: &[u8]) -> Result<(Vec<R>, u64), JournalError> {
    let mut records = Vec::new();
    let mut good = 0;
    let mut rest = bytes;
    let mut line = 0;
    while !rest.is_empty() {
        line += 1;
        let (text, after, whole) = match rest.iter().position(|b| *b == b'\n') {
            Some(end) => (&rest[..end], &rest[end + 1..], true),
            None => (rest, &rest[rest.len()..], false),
        };
        let parsed = if whole {
            serde_json::from_slice::<R>(text).map_err(|e| e.to_string())
        } else {
            Err("no end of line".to_owned())
        };
        match parsed {
            Ok(record) => {
                records.push(record);
                good += text.len() as u64 + 1;
            }
            // The last line: an append a crash cut short.
            Err(_) if after.is_empty() => break,
            Err(reason) => {
                return Err(JournalError::Corrupt {
                    path: path.to_owned(),
                    line,
                    reason,
                })
            }
        }
        rest = after;
    }
    Ok((records, good))
}

/// Appends `bytes` to the journal at `path` without an end of line, as a
/// crash in the middle of an append leaves it.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn append_cut_short(path: &Path, bytes: &[u8]) {
    let mut file = OpenOptions::new().append(true).open(path).unwrap();
    file.write_all(bytes).unwrap();
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn records_survive_reopening_and_a_cut_last_line_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let (mut j, none) = Journal::open::<u32>(&path, 1024).unwrap();
        assert!(none.is_empty() && j.is_empty());
        j.append(&[1u32, 2]).unwrap();
        j.append(&[3u32]).unwrap();
        drop(j);
        assert_eq!(read::<u32>(&path, 1024).unwrap(), [1, 2, 3]);

        // A crash in the middle of an append.
        append_cut_short(&path, b"4");
        assert_eq!(read::<u32>(&path, 1024).unwrap(), [1, 2, 3]);
        let (mut j, records) = Journal::open::<u32>(&path, 1024).unwrap();
        assert_eq!(records, [1, 2, 3]);
        assert_eq!(std::fs::read(&path).unwrap(), b"1\n2\n3\n");
        j.append(&[5u32]).unwrap();
        assert_eq!(read::<u32>(&path, 1024).unwrap(), [1, 2, 3, 5]);
        j.clear().unwrap();
        assert_eq!(read::<u32>(&path, 1024).unwrap(), Vec::<u32>::new());
    }

    /// A last line this agent cannot read (a newer agent's record, before
    /// the node went back to this image) is cut off so the store loads,
    /// and kept beside the journal: appended to what is kept already,
    /// bounded by the journal's own limit.
    #[test]
    fn a_last_line_cut_off_is_kept_beside_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let aside = dir.path().join("j.cut");
        std::fs::write(&path, b"1\n{\"newer\":2}\n").unwrap();
        let (mut j, records) = Journal::open::<u32>(&path, 64).unwrap();
        assert_eq!(records, [1]);
        assert_eq!(std::fs::read(&path).unwrap(), b"1\n");
        assert_eq!(std::fs::read(&aside).unwrap(), b"{\"newer\":2}\n");
        assert_eq!(
            std::fs::metadata(&aside).unwrap().permissions().mode() & 0o777,
            0o600
        );

        // A torn append later: kept after the first.
        j.append(&[3u32]).unwrap();
        drop(j);
        append_cut_short(&path, b"4");
        assert_eq!(Journal::open::<u32>(&path, 64).unwrap().1, [1, 3]);
        assert_eq!(std::fs::read(&aside).unwrap(), b"{\"newer\":2}\n4\n");

        // What would grow the kept bytes past the bound starts them afresh.
        std::fs::write(&path, [b"1\n".as_slice(), &[b'x'; 60]].concat()).unwrap();
        assert_eq!(Journal::open::<u32>(&path, 64).unwrap().1, [1]);
        assert_eq!(
            std::fs::read(&aside).unwrap(),
            [[b'x'; 60].as_slice(), b"\n"].concat()
        );
    }

    #[test]
    fn a_bad_line_before_the_last_and_an_oversized_journal_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        std::fs::write(&path, b"1\nx\n3\n").unwrap();
        assert!(matches!(
            Journal::open::<u32>(&path, 1024),
            Err(JournalError::Corrupt { line: 2, .. })
        ));
        // A whole last line that does not parse is what a crash leaves too.
        std::fs::write(&path, b"1\n\0\0\0\n").unwrap();
        assert_eq!(Journal::open::<u32>(&path, 1024).unwrap().1, [1]);
        assert_eq!(std::fs::read(&path).unwrap(), b"1\n");
        std::fs::remove_file(dir.path().join("j.cut")).unwrap();
        std::fs::write(&path, vec![b'\n'; 2000]).unwrap();
        assert!(matches!(
            read::<u32>(&path, 1024),
            Err(JournalError::TooLarge { .. })
        ));
    }

    #[test]
    fn an_append_past_the_limit_is_refused_and_the_journal_still_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let (mut j, _) = Journal::open::<u32>(&path, 8).unwrap();
        j.append(&[1u32, 22]).unwrap();
        // "1\n22\n" is 5 bytes; "333\n" would make 9.
        assert!(matches!(
            j.append(&[333u32]),
            Err(JournalError::TooLarge { limit: 8, .. })
        ));
        assert_eq!(std::fs::read(&path).unwrap(), b"1\n22\n");
        assert_eq!(j.len(), 5);
        // Exactly up to the limit is fine, and the file loads again.
        j.append(&[33u32]).unwrap();
        assert_eq!(Journal::open::<u32>(&path, 8).unwrap().1, [1, 22, 33]);
        // Once emptied (its records in a new snapshot), it takes appends.
        j.clear().unwrap();
        j.append(&[333u32]).unwrap();
        assert_eq!(read::<u32>(&path, 8).unwrap(), [333]);
    }

    /// Replays `records` ((entry, state) pairs) over `snapshot`.
    fn replayed(mut snapshot: Vec<(u8, u32)>, records: Vec<(u8, u32)>) -> Vec<(u8, u32)> {
        for (entry, state) in records {
            match snapshot.iter_mut().find(|(e, _)| *e == entry) {
                Some(held) => held.1 = state,
                None => snapshot.push((entry, state)),
            }
        }
        snapshot
    }

    #[test]
    fn a_crash_or_a_failure_after_a_folds_snapshot_replays_to_the_snapshots_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let (mut j, _) = Journal::open::<(u8, u32)>(&path, 1024).unwrap();
        j.append(&[(1u8, 10u32), (2, 20)]).unwrap();
        // Entry 1 changes again; the change is folded into a snapshot. The
        // journal as the snapshot is written is what a crash (or a failure
        // to empty it) leaves beside the snapshot.
        let snapshot = vec![(1u8, 11u32), (2, 20)];
        let mut left = Vec::new();
        j.fold(&[(1u8, 11u32)], || {
            left = read::<(u8, u32)>(&path, 1024)?;
            Ok::<(), JournalError>(())
        })
        .unwrap();
        assert_eq!(replayed(snapshot.clone(), left), snapshot);
        assert!(j.is_empty());

        // A snapshot that failed: the write is durable in the journal all
        // the same, and the snapshot may be in place (renamed, its
        // directory not synced); the journal keeps the records of its
        // state.
        j.append(&[(2u8, 21u32)]).unwrap();
        let folded = j.fold(&[(2u8, 22u32)], || {
            Err(io("writing", &path, std::io::ErrorKind::Other.into()))
        });
        assert!(!folded.unwrap());
        let left = read::<(u8, u32)>(&path, 1024).unwrap();
        assert_eq!(left, [(2, 21), (2, 22)]);
        let in_place = vec![(1u8, 11u32), (2, 22)];
        assert_eq!(replayed(in_place.clone(), left), in_place);
    }

    /// A journal on /dev/full, which fails every write and cannot be
    /// truncated.
    fn on_dev_full() -> Journal {
        let file = OpenOptions::new().append(true).open("/dev/full").unwrap();
        Journal {
            path: "/dev/full".into(),
            file,
            len: 0,
            limit: 1024,
            torn: false,
        }
    }

    #[test]
    fn after_an_append_that_could_not_be_cut_off_nothing_is_appended_until_it_is() {
        let mut j = on_dev_full();
        let e = j.append(&[1u32]).unwrap_err();
        assert!(
            matches!(
                e,
                JournalError::Io {
                    what: "appending to",
                    ..
                }
            ),
            "{e}"
        );
        // The next append first cuts the journal back, and writes nothing
        // when it cannot.
        let e = j.append(&[2u32]).unwrap_err();
        assert!(
            matches!(
                e,
                JournalError::Io {
                    what: "truncating",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn a_fold_at_the_bound_makes_room_and_any_other_failed_append_writes_no_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let (mut j, _) = Journal::open::<u32>(&path, 8).unwrap();
        j.append(&[1u32, 22]).unwrap();
        // "333\n" would pass the bound: the snapshot is written, the
        // journal emptied.
        let mut written = false;
        let folded = j.fold(&[333u32], || {
            written = true;
            Ok::<(), JournalError>(())
        });
        assert!(folded.unwrap() && written && j.is_empty());

        // A write that fails (not the bound): no snapshot.
        let mut full = on_dev_full();
        let mut written = false;
        let folded = full.fold(&[1u32], || {
            written = true;
            Ok::<(), JournalError>(())
        });
        assert!(folded.is_err() && !written);
    }
}
