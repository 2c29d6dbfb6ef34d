//! The join service's one durable state: which state disk belongs to which
//! TPM. A join ticket binds the disk's UUID to the joining TPM's endorsement
//! key (the SHA-256 of its marshalled TPMT_PUBLIC, see [`EkDigest`]) before
//! any key leaves, and a join or rejoin ticket for a disk bound to another
//! TPM is refused. A disk key is derived from the disk's UUID and the EK
//! it is issued to, so an attested node that names another node's UUID
//! (one this store has not seen included) gets a key that opens nothing.
//!
//! The store is a JSON snapshot on the control plane's state disk and a
//! journal beside it ([`crate::journal`]), both 0600, bounded in size,
//! entries and disks per EK; a corrupt store is refused loudly and left
//! alone for an operator. A new binding is appended to the journal and
//! synced, so a write costs the bindings it records, not the size of the
//! store; once the journal outgrows the snapshot (and 256 KiB), the next
//! write first replaces the snapshot atomically with the state the journal
//! leaves and empties the journal, then appends its own bindings, so a
//! crash at any point leaves files that replay to what was recorded. A
//! binding is never changed to another EK; it ends only when its EK, past
//! [`MAX_DISKS_PER_EK`], binds a new disk in its place (a freed UUID may
//! then be bound again). Each journal record must follow from the
//! journal's earlier ones, and the snapshot must hold the state before
//! the journal, or one the journal passes through or leaves (a crash
//! between a fold's snapshot and its emptied journal, an emptying that
//! failed, or an older agent's fold, which put its own round into the
//! snapshot); anything else is corruption. Bindings
//! requested while a write runs are checked and recorded together in the
//! next one ([`crate::batching`]). The process keeps the store it last read
//! or wrote in memory and reads the files again only when they are no
//! longer the files it left (another inode, size or modification time), so
//! a round costs no parse of the whole store.

use crate::paths::DISK_BINDINGS;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::batching::Batcher;
use crate::files::WriteFileError;
use crate::journal::{self, Journal, JournalError};
pub use keel_verifier::ek::EkDigest;
use keel_verifier::keys::DiskKeyIdError;

/// Most disks the binding store holds; further new disks are refused.
pub const MAX_DISK_BINDINGS: usize = 10_000;
/// Most disks bound to one endorsement key: attested nodes that keep
/// asking for join tickets with new disk UUIDs cannot fill the store short
/// of [`MAX_DISK_BINDINGS`] / this many VMs (1,250). Past it, each new disk
/// of the EK replaces one of its own, so a node whose joins keep failing
/// is not locked out.
pub const MAX_DISKS_PER_EK: usize = 8;
// Attacker's move: the host boots VMs of the cluster's image and joins each
// again and again with a blank disk, each join binding a fresh UUID for
// good, until the store is full and every new node is refused. The per-EK
// bound (`an_ek_past_its_bound_replaces_one_of_its_own_disks`) makes that
// take at least 1,000 VMs; the build fails if the two bounds drift apart.
const _: () = assert!(MAX_DISK_BINDINGS / MAX_DISKS_PER_EK >= 1000);
/// Largest accepted binding store file (10 000 entries take about 1.1 MB).
const MAX_DISK_BINDINGS_BYTES: u64 = 2 * 1024 * 1024;
/// Most bindings checked and recorded in one write.
const MAX_BINDINGS_PER_WRITE: usize = 256;
/// Format version of the binding store file.
const DISK_BINDINGS_VERSION: u32 = 1;
/// Largest journal read: one record per binding, and bindings are bounded.
const MAX_JOURNAL_BYTES: u64 = 2 * MAX_DISK_BINDINGS_BYTES;
/// The journal is folded into a new snapshot once it is larger than the
/// snapshot and than this.
const COMPACT_AT_LEAST: u64 = 256 * 1024;

/// Why a disk binding refused a ticket (the local log's detail; the peer
/// only learns that the disk is not bound to its TPM).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskBindingRefusal {
    /// The disk is bound to another endorsement key.
    #[error("disk {uuid} is bound to EK {bound}, the peer's EK is {peer}")]
    OtherEk {
        /// The disk UUID (lower case).
        uuid: String,
        /// The EK the disk is bound to.
        bound: EkDigest,
        /// The peer's EK.
        peer: EkDigest,
    },
}

/// The disk binding store failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskBindingsError {
    /// The disk UUID is malformed.
    #[error("invalid disk UUID")]
    Uuid(#[source] DiskKeyIdError),
    /// The store file could not be read.
    #[error("reading the disk bindings {path}")]
    Read {
        /// The store file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The store file exists but is not a valid store. It is left as it is
    /// for an operator to inspect; nothing is issued until it is fixed.
    #[error("the disk bindings {path} are corrupt: {reason}")]
    Corrupt {
        /// The store file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The store holds [`MAX_DISK_BINDINGS`] disks.
    #[error("the disk bindings are full ({MAX_DISK_BINDINGS} disks)")]
    Full,
    /// Writing the store failed; the binding was not recorded.
    #[error("writing the disk bindings")]
    Write(#[source] WriteFileError),
    /// Reading or appending to the store's journal failed; a binding of
    /// that write was not recorded.
    #[error("the disk bindings' journal")]
    Journal(#[from] JournalError),
    /// The blocking task running a store operation failed.
    #[error("the disk binding task failed")]
    Task,
    /// The write this binding shared with others failed (the cause is the
    /// same for all of them).
    #[error(transparent)]
    Shared(Arc<DiskBindingsError>),
}

/// The outcome of [`DiskBindings::bind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Bind {
    /// The disk was not bound; it is now bound to the EK, durably.
    Recorded,
    /// The disk was already bound to this EK.
    AlreadyBound,
    /// The disk is bound to another EK (given); nothing changed.
    OtherEk(EkDigest),
}

/// The file form of the store.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskBindingsFile {
    version: u32,
    /// Lower-case disk UUID to lower-case hex EK digest.
    disks: BTreeMap<String, String>,
}

/// One journal record: a binding, in the snapshot's form, or the end of
/// one (`unbound`).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BindingRecord {
    /// Lower-case disk UUID.
    disk: String,
    /// Lower-case hex EK digest.
    ek: String,
    /// The binding ends here: its EK bound a disk past
    /// [`MAX_DISKS_PER_EK`], which took its place.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    unbound: bool,
}

/// The stores this process read or wrote, by file, as it left them. The
/// mutex serialises every store operation in this process: a binding is
/// checked and recorded as one step, and one writer at a time uses the
/// temp file.
static STORES: std::sync::LazyLock<std::sync::Mutex<Stores>> =
    std::sync::LazyLock::new(std::sync::Mutex::default);

/// A store as this process last read or wrote it.
struct Cached {
    /// The files it was read from or written to.
    stamp: Stamps,
    disks: BTreeMap<String, EkDigest>,
    /// How many disks each EK has bound.
    per_ek: HashMap<EkDigest, usize>,
    /// The journal, open once a write needs it.
    journal: Option<Journal>,
}

impl Cached {
    fn new(stamp: Stamps, disks: BTreeMap<String, EkDigest>) -> Self {
        let mut per_ek = HashMap::new();
        for ek in disks.values() {
            *per_ek.entry(*ek).or_insert(0) += 1;
        }
        Self {
            stamp,
            disks,
            per_ek,
            journal: None,
        }
    }
}

/// The stamps of a store's snapshot and journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamps {
    snapshot: Option<Stamp>,
    journal: Option<Stamp>,
}

impl Stamps {
    fn of(snapshot: &Path) -> std::io::Result<Self> {
        Ok(Self {
            snapshot: Stamp::of(snapshot)?,
            journal: Stamp::of(&journal::beside(snapshot))?,
        })
    }
}

/// Which file a path named when it was read or written: a replaced file
/// (a new inode), or one written in place (size, times), differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    /// The file's stamp, or `None` if there is no file.
    fn of(path: &Path) -> std::io::Result<Option<Self>> {
        match std::fs::metadata(path) {
            Ok(m) => Ok(Some(Self::from_metadata(&m))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn from_metadata(m: &std::fs::Metadata) -> Self {
        Self {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// The disks of this cluster and the TPMs they belong to: disk UUID (lower
/// case, as the disk key derivation uses it) to [`EkDigest`], in a JSON
/// snapshot (replaced atomically, mode 0600) and its journal. Reads are
/// bounded ([`MAX_DISK_BINDINGS`] entries, 2 MiB). The methods block on
/// file I/O.
pub struct DiskBindings {
    file: StoreFile,
    binds: Batcher<(String, EkDigest), Result<Bind, DiskBindingsError>, DiskBindingsError>,
}

impl std::fmt::Debug for DiskBindings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskBindings")
            .field("path", &self.file.path)
            .finish_non_exhaustive()
    }
}

/// The store's file: reading and replacing it.
#[derive(Debug, Clone)]
struct StoreFile {
    path: PathBuf,
}

impl DiskBindings {
    /// The store of the node root `root`
    /// ([`DISK_BINDINGS`](crate::paths::DISK_BINDINGS) under it, on the
    /// state disk); nothing is read yet.
    pub fn new(root: &Path) -> Self {
        let file = StoreFile {
            path: root.join(DISK_BINDINGS),
        };
        let writer = file.clone();
        Self {
            file,
            binds: Batcher::new(MAX_BINDINGS_PER_WRITE, move |requests| {
                writer.bind_all(requests)
            }),
        }
    }

    /// The store's snapshot file (its journal is beside it).
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// How many writes recorded how many [`DiskBindings::bind`] requests.
    pub fn write_stats(&self) -> crate::batching::BatchStats {
        self.binds.stats()
    }

    /// How many disks are bound.
    pub fn len(&self) -> Result<usize, DiskBindingsError> {
        let mut stores = lock_stores();
        Ok(self.file.current(&mut stores)?.disks.len())
    }

    /// Whether no disk is bound yet.
    pub fn is_empty(&self) -> Result<bool, DiskBindingsError> {
        self.len().map(|n| n == 0)
    }

    /// The EK the disk `uuid` is bound to, if any.
    pub fn lookup(&self, uuid: &str) -> Result<Option<EkDigest>, DiskBindingsError> {
        let uuid = normalise_uuid(uuid)?;
        let mut stores = lock_stores();
        Ok(self.file.current(&mut stores)?.disks.get(&uuid).copied())
    }

    /// Binds the disk `uuid` to `ek` unless it is bound already; checks
    /// and records as one step. A new binding is on disk when this returns.
    /// Bindings asked for while another write runs are recorded together
    /// in the next one, in the order they were asked for.
    pub fn bind(&self, uuid: &str, ek: &EkDigest) -> Result<Bind, DiskBindingsError> {
        let uuid = normalise_uuid(uuid)?;
        self.binds
            .submit((uuid, *ek))
            .map_err(|e| e.into_cause(DiskBindingsError::Shared, DiskBindingsError::Task))?
    }
}

impl StoreFile {
    /// One round of [`DiskBindings::bind`]: checks and records each
    /// binding in turn, and writes the store once if any was recorded. A
    /// failed write records none of them (the next round reads the file).
    fn bind_all(
        &self,
        requests: Vec<(String, EkDigest)>,
    ) -> Result<Vec<Result<Bind, DiskBindingsError>>, DiskBindingsError> {
        let _span = tracing::debug_span!("join.disk_binding", disks = requests.len()).entered();
        let mut stores = lock_stores();
        let store = self.current(&mut stores)?;
        if let Err(e) = self.compact(store) {
            stores.remove(&self.path);
            return Err(e);
        }
        let mut recorded = Vec::new();
        let results = requests
            .into_iter()
            .map(|(uuid, ek)| {
                let (result, replaced) = bind_one(store, uuid.clone(), &ek);
                if let Some(disk) = replaced {
                    recorded.push(BindingRecord {
                        disk,
                        ek: hex::encode(ek.as_bytes()),
                        unbound: true,
                    });
                }
                if matches!(result, Ok(Bind::Recorded)) {
                    recorded.push(BindingRecord {
                        disk: uuid,
                        ek: hex::encode(ek.as_bytes()),
                        unbound: false,
                    });
                }
                result
            })
            .collect();
        if !recorded.is_empty() {
            if let Err(e) = self.persist(store, &recorded) {
                stores.remove(&self.path);
                return Err(e);
            }
        }
        Ok(results)
    }

    /// The store as the file holds it: the one this process last read or
    /// wrote if the file is still the one it left, else the file's.
    fn current<'a>(&self, stores: &'a mut Stores) -> Result<&'a mut Cached, DiskBindingsError> {
        let stamp = Stamps::of(&self.path).map_err(|source| self.read_error(source))?;
        let cached = match stores.remove(&self.path) {
            Some(cached) if cached.stamp == stamp => cached,
            _ => self.load(stamp)?,
        };
        Ok(stores.entry(self.path.clone()).or_insert(cached))
    }

    fn read_error(&self, source: std::io::Error) -> DiskBindingsError {
        DiskBindingsError::Read {
            path: self.path.clone(),
            source,
        }
    }

    fn corrupt(&self, reason: impl Into<String>) -> DiskBindingsError {
        DiskBindingsError::Corrupt {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    /// Folds the journal into a new snapshot once it outgrew the last one,
    /// before a round changes anything ([`Journal::compact`]): the
    /// snapshot holds the state the journal leaves, so a crash before the
    /// journal is emptied replays it to the same state.
    fn compact(&self, store: &mut Cached) -> Result<(), DiskBindingsError> {
        let journal =
            journal::opened::<BindingRecord>(&mut store.journal, &self.path, MAX_JOURNAL_BYTES)
                .map_err(DiskBindingsError::Journal)?;
        let snapshot_bytes = store.stamp.snapshot.map_or(0, |s| s.len);
        if journal.outgrows(snapshot_bytes, COMPACT_AT_LEAST) {
            journal.compact(|| self.store(&store.disks));
            store.stamp = Stamps::of(&self.path).map_err(|source| self.read_error(source))?;
        }
        Ok(())
    }

    /// Makes the bindings of one round (already in `store`) durable:
    /// appended to the journal. A journal at its bound (its snapshots kept
    /// failing) refuses them, and the round records nothing.
    fn persist(
        &self,
        store: &mut Cached,
        recorded: &[BindingRecord],
    ) -> Result<(), DiskBindingsError> {
        journal::opened::<BindingRecord>(&mut store.journal, &self.path, MAX_JOURNAL_BYTES)
            .and_then(|journal| journal.append(recorded))
            .map_err(DiskBindingsError::Journal)?;
        store.stamp = Stamps::of(&self.path).map_err(|source| self.read_error(source))?;
        Ok(())
    }

    /// Reads the store (its snapshot, then its journal), whose files had
    /// `stamp` before they were read; no files is an empty store.
    fn load(&self, stamp: Stamps) -> Result<Cached, DiskBindingsError> {
        let mut disks = self.load_snapshot()?;
        let records: Vec<BindingRecord> =
            journal::read(&journal::beside(&self.path), MAX_JOURNAL_BYTES).map_err(
                |e| match e {
                    JournalError::Corrupt { line, reason, .. } => {
                        self.corrupt(format!("journal line {line}: {reason}"))
                    }
                    other => DiskBindingsError::Journal(other),
                },
            )?;
        // The journal is checked on its own first: each record must follow
        // from the journal's earlier records of the disk (a binding ends
        // only while it holds, a new one only once the last ended).
        let mut touched: BTreeMap<String, Touched> = BTreeMap::new();
        for record in records {
            let unbound = record.unbound;
            let (uuid, ek) = self.binding(record.disk, &record.ek)?;
            let disk = touched.entry(uuid.clone()).or_insert_with(|| Touched {
                first: ek,
                seen: false,
                now: None,
                bound: Vec::new(),
            });
            let consistent = match (disk.now, unbound) {
                (Some(bound), _) => bound == ek,
                // Ended: in this journal, or before it (its first record).
                (None, true) => !disk.seen,
                (None, false) => true,
            };
            if !consistent {
                let what = if unbound { "ends" } else { "makes" };
                return Err(self.corrupt(format!(
                    "the journal {what} a binding of disk {uuid} that does not follow from its \
                     earlier records"
                )));
            }
            disk.seen = true;
            disk.now = (!unbound).then_some(ek);
            if !unbound && !disk.bound.contains(&ek) {
                disk.bound.push(ek);
            }
        }
        // Then against the snapshot, which holds the state before the
        // journal (the usual case: the disk unbound, or bound to its first
        // record's EK), or one the journal passes through or leaves (a
        // crash between a fold's new snapshot and its emptied journal, or
        // an emptying that failed before more records came); anything else
        // is corruption.
        for (uuid, disk) in touched {
            if let Some(before) = disks.get(&uuid).copied() {
                if before != disk.first && !disk.bound.contains(&before) {
                    return Err(self.corrupt(format!(
                        "the journal binds disk {uuid} to another EK than the snapshot does"
                    )));
                }
            }
            match disk.now {
                Some(ek) => disks.insert(uuid, ek),
                None => disks.remove(&uuid),
            };
        }
        if disks.len() > MAX_DISK_BINDINGS {
            return Err(self.corrupt(format!("more than {MAX_DISK_BINDINGS} disks")));
        }
        Ok(Cached::new(stamp, disks))
    }

    /// A stored binding, checked: a lower-case disk UUID and a lower-case
    /// hex EK digest.
    fn binding(&self, uuid: String, ek: &str) -> Result<(String, EkDigest), DiskBindingsError> {
        if normalise_uuid(&uuid).ok().as_deref() != Some(uuid.as_str()) {
            return Err(self.corrupt(format!(
                "invalid disk UUID {:?}",
                uuid.escape_debug().to_string()
            )));
        }
        let digest = (ek.len() == 64 && ek == ek.to_ascii_lowercase())
            .then(|| EkDigest::from_hex(ek))
            .flatten()
            .ok_or_else(|| self.corrupt(format!("invalid EK digest for disk {uuid}")))?;
        Ok((uuid, digest))
    }

    /// Reads the snapshot; a missing file is an empty store.
    fn load_snapshot(&self) -> Result<BTreeMap<String, EkDigest>, DiskBindingsError> {
        let bytes = match keel_verifier::bounded::read(&self.path, MAX_DISK_BINDINGS_BYTES) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => {
                return Err(self.corrupt(format!("larger than {MAX_DISK_BINDINGS_BYTES} bytes")))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(e) => return Err(self.read_error(e)),
        };
        let raw: DiskBindingsFile = serde_json::from_slice(&bytes)
            .map_err(|e| self.corrupt(format!("not a binding store: {e}")))?;
        if raw.version != DISK_BINDINGS_VERSION {
            return Err(self.corrupt(format!("unknown version {}", raw.version)));
        }
        if raw.disks.len() > MAX_DISK_BINDINGS {
            return Err(self.corrupt(format!("more than {MAX_DISK_BINDINGS} disks")));
        }
        let mut disks = BTreeMap::new();
        for (uuid, ek) in raw.disks {
            let (uuid, digest) = self.binding(uuid, &ek)?;
            disks.insert(uuid, digest);
        }
        Ok(disks)
    }

    /// Replaces the snapshot with `disks`.
    fn store(&self, disks: &BTreeMap<String, EkDigest>) -> Result<(), DiskBindingsError> {
        let file = DiskBindingsFile {
            version: DISK_BINDINGS_VERSION,
            disks: disks
                .iter()
                .map(|(uuid, ek)| (uuid.clone(), hex::encode(ek.as_bytes())))
                .collect(),
        };
        let mut json = serde_json::to_vec_pretty(&file).map_err(|e| {
            DiskBindingsError::Write(WriteFileError {
                path: self.path.clone(),
                source: std::io::Error::other(e),
            })
        })?;
        json.push(b'\n');
        crate::files::write_private(&self.path, &json).map_err(DiskBindingsError::Write)
    }
}

/// Checks and records one binding in `store` (in memory); also returns
/// the disk whose binding the new one replaced, if any.
///
/// An EK that has [`MAX_DISKS_PER_EK`] disks bound gives one of them up
/// for the new one. A node has one state disk; it binds a new one only
/// after a join failed past the lock, which resets the disk it had (the
/// next boot formats a disk with a new UUID), so every other disk of a
/// full EK is one it no longer has. Without the replacement, a node whose
/// joins keep failing (a mirror down for hours) would be refused for good
/// after as many boots. The replaced disk's key stays bound to the EK by
/// its derivation: another TPM that binds that UUID gets a key that opens
/// nothing.
fn bind_one(
    store: &mut Cached,
    uuid: String,
    ek: &EkDigest,
) -> (Result<Bind, DiskBindingsError>, Option<String>) {
    if let Some(bound) = store.disks.get(&uuid) {
        let bind = if bound.ct_eq(ek) {
            Bind::AlreadyBound
        } else {
            Bind::OtherEk(*bound)
        };
        return (Ok(bind), None);
    }
    let full = store.per_ek.get(ek).is_some_and(|n| *n >= MAX_DISKS_PER_EK);
    let replaced = if full {
        store
            .disks
            .iter()
            .find(|(_, bound)| *bound == ek)
            .map(|(disk, _)| disk.clone())
    } else {
        None
    };
    match &replaced {
        Some(disk) => {
            store.disks.remove(disk);
        }
        None if store.disks.len() >= MAX_DISK_BINDINGS => {
            return (Err(DiskBindingsError::Full), None)
        }
        None => *store.per_ek.entry(*ek).or_insert(0) += 1,
    }
    store.disks.insert(uuid, *ek);
    (Ok(Bind::Recorded), replaced)
}

/// What a journal says of one disk, while it is replayed.
struct Touched {
    /// The EK of its first record.
    first: EkDigest,
    /// Whether a record of it was replayed.
    seen: bool,
    /// The binding its records leave so far.
    now: Option<EkDigest>,
    /// Every EK its records bound it to.
    bound: Vec<EkDigest>,
}

type Stores = HashMap<PathBuf, Cached>;

fn lock_stores() -> std::sync::MutexGuard<'static, Stores> {
    // A panic while holding the lock can leave a cached store ahead of its
    // file: the entries are dropped then, so every store is read again.
    STORES.lock().unwrap_or_else(|poisoned| {
        let mut guard = poisoned.into_inner();
        guard.clear();
        STORES.clear_poison();
        guard
    })
}

/// The UUID in the form the disk key derivation uses (lower case), after
/// the same shape check.
fn normalise_uuid(uuid: &str) -> Result<String, DiskBindingsError> {
    keel_verifier::keys::disk_id(uuid).map_err(DiskBindingsError::Uuid)?;
    Ok(uuid.to_ascii_lowercase())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn ek(n: u8) -> EkDigest {
        EkDigest::of_marshalled(&[n])
    }

    /// The `n`th of many EKs, none of them an [`ek`].
    fn many(n: usize) -> EkDigest {
        EkDigest::of_marshalled(&(n as u64).to_be_bytes())
    }

    const DISK: &str = "0a1b2c3d-0000-4000-8000-00000000000a";

    #[test]
    fn bindings_record_refuse_and_persist() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        assert!(store.is_empty().unwrap());
        assert_eq!(store.lookup(DISK).unwrap(), None);
        assert_eq!(store.bind(DISK, &ek(1)).unwrap(), Bind::Recorded);
        assert_eq!(store.bind(DISK, &ek(1)).unwrap(), Bind::AlreadyBound);
        assert_eq!(store.bind(DISK, &ek(2)).unwrap(), Bind::OtherEk(ek(1)));
        // The key derivation lower-cases the UUID: so does the binding.
        let upper = DISK.to_ascii_uppercase();
        assert_eq!(store.bind(&upper, &ek(2)).unwrap(), Bind::OtherEk(ek(1)));
        assert_eq!(store.lookup(&upper).unwrap(), Some(ek(1)));
        assert!(matches!(
            store.bind("not-a-uuid", &ek(1)),
            Err(DiskBindingsError::Uuid(_))
        ));

        // A new store over the same directory reads the same bindings.
        let reopened = DiskBindings::new(dir.path());
        assert_eq!(reopened.lookup(DISK).unwrap(), Some(ek(1)));
        assert_eq!(reopened.len().unwrap(), 1);
        use std::os::unix::fs::PermissionsExt as _;
        let journal = journal::beside(store.path());
        let mode = std::fs::metadata(&journal).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(store.path().parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(names, [journal], "another file was left");
    }

    #[test]
    fn concurrent_bindings_share_writes_and_each_gets_its_own_answer() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(DiskBindings::new(dir.path()));
        // The store is busy (its lock held) while a first binding waits for
        // it and the others queue behind.
        let busy = lock_stores();
        let bind = |uuid: String, n: u8| {
            let store = store.clone();
            std::thread::spawn(move || store.bind(&uuid, &ek(n)).unwrap())
        };
        let mut threads = vec![bind(format!("00000000-0000-4000-8000-{:012x}", 0), 0)];
        while store.write_stats().rounds == 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for i in 1..32u8 {
            threads.push(bind(format!("00000000-0000-4000-8000-{i:012x}"), i));
        }
        // Two TPMs race for one disk: one gets it, the other is told whose it is.
        threads.push(bind(DISK.to_owned(), 100));
        threads.push(bind(DISK.to_owned(), 101));
        while store.binds.waiting() < 33 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        drop(busy);
        let results: Vec<Bind> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(results[..32].iter().all(|r| *r == Bind::Recorded));
        let winner = store.lookup(DISK).unwrap().unwrap();
        let race = &results[32..];
        assert_eq!(race.iter().filter(|r| **r == Bind::Recorded).count(), 1);
        assert!(race.contains(&Bind::OtherEk(winner)), "{race:?}");
        // Every binding is on disk, in fewer writes than bindings.
        let reopened = DiskBindings::new(dir.path());
        assert_eq!(reopened.len().unwrap(), 33);
        let stats = store.write_stats();
        assert_eq!((stats.rounds, stats.requests, stats.largest), (2, 34, 33));
    }

    #[test]
    fn a_store_changed_behind_the_process_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        let other = DISK.replace("000a", "000b");
        assert_eq!(store.bind(DISK, &ek(1)).unwrap(), Bind::Recorded);
        // A second store over the same directory (the init path's) sees the
        // binding at once, without a new file stamp.
        let second = DiskBindings::new(dir.path());
        assert_eq!(second.bind(DISK, &ek(2)).unwrap(), Bind::OtherEk(ek(1)));
        assert_eq!(second.bind(&other, &ek(2)).unwrap(), Bind::Recorded);
        assert_eq!(store.lookup(&other).unwrap(), Some(ek(2)));
        // An operator restores a store written elsewhere, in place: its
        // snapshot, and no journal.
        let restored = format!(
            "{{\"version\":1,\"disks\":{{\"{DISK}\":\"{}\"}}}}",
            hex::encode(ek(3).as_bytes())
        );
        let journal = journal::beside(store.path());
        let appended = std::fs::read(&journal).unwrap();
        std::fs::write(store.path(), restored).unwrap();
        std::fs::remove_file(&journal).unwrap();
        assert_eq!(store.lookup(DISK).unwrap(), Some(ek(3)));
        assert_eq!(store.lookup(&other).unwrap(), None);
        assert_eq!(store.bind(DISK, &ek(1)).unwrap(), Bind::OtherEk(ek(3)));
        // A journal that binds the disk to another EK than the snapshot:
        // corruption, not a second owner.
        std::fs::write(&journal, appended).unwrap();
        assert!(matches!(
            store.lookup(DISK),
            Err(DiskBindingsError::Corrupt { .. })
        ));
    }

    #[test]
    fn a_write_appends_its_bindings_and_the_journal_folds_into_a_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        let journal = journal::beside(store.path());
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        let uuid = |i: usize| format!("00000000-0000-4000-8000-{i:012x}");
        let mut i = 0;
        while size(&journal) <= COMPACT_AT_LEAST {
            let before = size(&journal);
            assert_eq!(
                store.bind(&uuid(i), &many(i / MAX_DISKS_PER_EK)).unwrap(),
                Bind::Recorded
            );
            assert!(
                size(&journal) - before < 200,
                "a binding appends one record"
            );
            i += 1;
        }
        assert_eq!(size(store.path()), 0);
        // The journal outgrew 256 KiB and the (empty) snapshot: the next
        // write first folds it into a new snapshot, then appends its own
        // binding. Should the snapshot fail (the temp file's name is
        // taken), the binding is recorded all the same, in the journal,
        // and the next write folds it.
        let file_name = store.path().file_name().unwrap().to_string_lossy();
        let temp = store
            .path()
            .with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
        std::fs::create_dir(&temp).unwrap();
        assert_eq!(store.bind(&uuid(i), &ek(200)).unwrap(), Bind::Recorded);
        assert_eq!(size(store.path()), 0);
        assert_eq!(DiskBindings::new(dir.path()).len().unwrap(), i + 1);
        std::fs::remove_dir(&temp).unwrap();
        let kept = std::fs::read(&journal).unwrap();
        i += 1;
        assert_eq!(store.bind(&uuid(i), &ek(201)).unwrap(), Bind::Recorded);
        assert!(size(&journal) < 200, "the journal holds the last binding");
        assert!(size(store.path()) > 0);
        assert_eq!(DiskBindings::new(dir.path()).len().unwrap(), i + 1);
        // A crash between the new snapshot and the emptied journal: the
        // snapshot holds what the journal leaves, replaying it is a no-op
        // (the last binding was not recorded yet).
        std::fs::write(&journal, &kept).unwrap();
        let reopened = DiskBindings::new(dir.path());
        assert_eq!(reopened.len().unwrap(), i);
        assert_eq!(reopened.lookup(&uuid(0)).unwrap(), Some(many(0)));
        assert_eq!(reopened.lookup(&uuid(i)).unwrap(), None);
        assert_eq!(reopened.bind(&uuid(i), &ek(201)).unwrap(), Bind::Recorded);
        assert_eq!(reopened.len().unwrap(), i + 1);
        // A crash in the middle of an append: the cut record is dropped.
        journal::append_cut_short(&journal, b"{\"disk\":\"00000000-");
        assert_eq!(reopened.len().unwrap(), i + 1);
        assert_eq!(
            reopened.bind(&uuid(i + 1), &ek(201)).unwrap(),
            Bind::Recorded
        );
        assert_eq!(DiskBindings::new(dir.path()).len().unwrap(), i + 2);
    }

    /// A journal at its bound (its snapshots kept failing), a freed disk in
    /// it, and a write that binds that disk to a third EK: the write folds
    /// the journal into a snapshot of what it leaves before it appends, so
    /// a crash before the journal is emptied replays to that state. A
    /// snapshot holding the write, with the old journal beside it, read as
    /// corruption and stopped every ticket.
    #[test]
    fn a_journal_at_its_bound_folds_before_the_write_that_finds_it_full() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        let journal_path = journal::beside(store.path());
        let hex_ek = |n: u8| hex::encode(ek(n).as_bytes());
        let line = |disk: &str, n: u8, unbound: bool, pad: usize| {
            format!(
                "{{{}\"disk\":\"{disk}\",\"ek\":\"{}\",\"unbound\":{unbound}}}\n",
                " ".repeat(pad),
                hex_ek(n)
            )
        };
        let limit = MAX_JOURNAL_BYTES as usize;
        let pair = |disk: &str, pad| line(disk, 1, false, 0) + &line(disk, 1, true, pad);
        let mut journal = String::with_capacity(limit);
        let mut k = 0;
        while journal.len() + 2 * pair(DISK, 0).len() <= limit {
            journal.push_str(&pair(&format!("00000000-0000-4000-8000-{k:012x}"), 0));
            k += 1;
        }
        // DISK bound to EK 1 and freed, padded to the journal's bound.
        let pad = limit - journal.len() - pair(DISK, 0).len();
        journal.push_str(&pair(DISK, pad));
        assert_eq!(journal.len(), limit);
        std::fs::create_dir_all(store.path().parent().unwrap()).unwrap();
        std::fs::write(&journal_path, &journal).unwrap();
        assert_eq!(store.lookup(DISK).unwrap(), None);

        // While the snapshot cannot be written, the full journal takes no
        // binding, and none is recorded.
        let file_name = store.path().file_name().unwrap().to_string_lossy();
        let temp = store
            .path()
            .with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
        std::fs::create_dir(&temp).unwrap();
        assert!(matches!(
            store.bind(DISK, &ek(3)),
            Err(DiskBindingsError::Journal(JournalError::TooLarge { .. }))
        ));
        assert_eq!(store.lookup(DISK).unwrap(), None);
        std::fs::remove_dir(&temp).unwrap();

        // Once it can, the write folds the journal and records.
        assert_eq!(store.bind(DISK, &ek(3)).unwrap(), Bind::Recorded);
        assert_eq!(
            DiskBindings::new(dir.path()).lookup(DISK).unwrap(),
            Some(ek(3))
        );
        // A crash between that snapshot and the emptied journal.
        std::fs::write(&journal_path, &journal).unwrap();
        lock_stores().clear();
        let reopened = DiskBindings::new(dir.path());
        assert_eq!(reopened.lookup(DISK).unwrap(), None);
        assert_eq!(reopened.len().unwrap(), 0);
        assert_eq!(reopened.bind(DISK, &ek(3)).unwrap(), Bind::Recorded);
        assert_eq!(reopened.bind(DISK, &ek(1)).unwrap(), Bind::OtherEk(ek(3)));
    }

    #[test]
    fn a_failed_write_records_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        // The journal's name is taken by a directory: the write fails.
        let journal = journal::beside(store.path());
        std::fs::create_dir_all(&journal).unwrap();
        assert!(matches!(
            store.bind(DISK, &ek(1)),
            Err(DiskBindingsError::Journal(_))
        ));
        std::fs::remove_dir(&journal).unwrap();
        assert_eq!(store.lookup(DISK).unwrap(), None);
        assert_eq!(store.len().unwrap(), 0);
        // Not recorded, so free for another TPM.
        assert_eq!(store.bind(DISK, &ek(2)).unwrap(), Bind::Recorded);
        assert_eq!(
            DiskBindings::new(dir.path()).lookup(DISK).unwrap(),
            Some(ek(2))
        );
    }

    /// One EK holds at most [`MAX_DISKS_PER_EK`] disks: a node whose joins
    /// keep failing binds a new disk per boot, and each one past the bound
    /// replaces one of its own (never another EK's), durably.
    #[test]
    fn an_ek_past_its_bound_replaces_one_of_its_own_disks() {
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        let disk = |i: usize| format!("00000000-0000-4000-8000-{i:012x}");
        assert_eq!(store.bind(&disk(9999), &ek(2)).unwrap(), Bind::Recorded);
        for i in 0..MAX_DISKS_PER_EK {
            assert_eq!(store.bind(&disk(i), &ek(1)).unwrap(), Bind::Recorded);
        }
        let past = MAX_DISKS_PER_EK + 5;
        for i in MAX_DISKS_PER_EK..past {
            assert_eq!(store.bind(&disk(i), &ek(1)).unwrap(), Bind::Recorded);
        }
        let held = |store: &DiskBindings| {
            (0..past)
                .filter(|i| store.lookup(&disk(*i)).unwrap() == Some(ek(1)))
                .count()
        };
        assert_eq!(held(&store), MAX_DISKS_PER_EK);
        assert_eq!(store.lookup(&disk(past - 1)).unwrap(), Some(ek(1)));
        assert_eq!(store.lookup(&disk(9999)).unwrap(), Some(ek(2)));
        assert_eq!(store.len().unwrap(), MAX_DISKS_PER_EK + 1);
        // Read again from its files (journal included): the same.
        lock_stores().clear();
        let again = DiskBindings::new(dir.path());
        assert_eq!(held(&again), MAX_DISKS_PER_EK);
        assert_eq!(again.lookup(&disk(past - 1)).unwrap(), Some(ek(1)));
        assert_eq!(again.len().unwrap(), MAX_DISKS_PER_EK + 1);
        // A replaced disk is free: its key stays bound to EK 1 by its
        // derivation, so another TPM binding it gains nothing.
        let freed = (0..past)
            .find(|i| again.lookup(&disk(*i)).unwrap().is_none())
            .unwrap();
        assert_eq!(again.bind(&disk(freed), &ek(3)).unwrap(), Bind::Recorded);
    }

    #[test]
    fn a_corrupt_store_is_refused_and_left_alone() {
        let good_ek = hex::encode([0xab_u8; 32]);
        let cases = [
            "".to_owned(),
            "[]".to_owned(),
            "{\"version\":1}".to_owned(),
            format!("{{\"version\":2,\"disks\":{{\"{DISK}\":\"{good_ek}\"}}}}"),
            format!("{{\"version\":1,\"disks\":{{\"{DISK}\":\"{good_ek}\"}},\"x\":1}}"),
            format!("{{\"version\":1,\"disks\":{{\"not-a-uuid\":\"{good_ek}\"}}}}"),
            format!(
                "{{\"version\":1,\"disks\":{{\"{}\":\"{good_ek}\"}}}}",
                DISK.to_ascii_uppercase()
            ),
            format!("{{\"version\":1,\"disks\":{{\"{DISK}\":\"00\"}}}}"),
            format!(
                "{{\"version\":1,\"disks\":{{\"{DISK}\":\"{}\"}}}}",
                good_ek.to_ascii_uppercase()
            ),
            " ".repeat(MAX_DISK_BINDINGS_BYTES as usize + 1),
        ];
        for text in cases {
            let dir = tempfile::tempdir().unwrap();
            let store = DiskBindings::new(dir.path());
            std::fs::create_dir_all(store.path().parent().unwrap()).unwrap();
            std::fs::write(store.path(), &text).unwrap();
            let shown = text.get(..60).unwrap_or(&text).to_owned();
            assert!(
                matches!(store.len(), Err(DiskBindingsError::Corrupt { .. })),
                "{shown}"
            );
            assert!(
                matches!(
                    store.bind(DISK, &ek(1)),
                    Err(DiskBindingsError::Corrupt { .. })
                ),
                "{shown}"
            );
            assert!(matches!(
                store.lookup(DISK),
                Err(DiskBindingsError::Corrupt { .. })
            ));
            assert_eq!(std::fs::read_to_string(store.path()).unwrap(), text);
        }
        // The well-formed version of the same loads.
        let dir = tempfile::tempdir().unwrap();
        let store = DiskBindings::new(dir.path());
        let text = format!("{{\"version\":1,\"disks\":{{\"{DISK}\":\"{good_ek}\"}}}}");
        std::fs::create_dir_all(store.path().parent().unwrap()).unwrap();
        std::fs::write(store.path(), text).unwrap();
        assert_eq!(
            store.lookup(DISK).unwrap(),
            Some(EkDigest::from_hex(&"ab".repeat(32)).unwrap())
        );
        // A journal that ends a binding of the disk to another EK is
        // refused; one that ends its own loads, and so does one that ends
        // a binding the snapshot no longer holds (a crash between a fold's
        // new snapshot and its emptied journal leaves the journal older
        // than the snapshot).
        let other_ek = hex::encode([0xcd_u8; 32]);
        let gone = "0f0f0f0f-0000-4000-8000-000000000000";
        for (disk, ends, corrupt) in [
            (DISK, &other_ek, true),
            (DISK, &good_ek, false),
            (gone, &other_ek, false),
        ] {
            lock_stores().clear();
            let line = format!("{{\"disk\":\"{disk}\",\"ek\":\"{ends}\",\"unbound\":true}}\n");
            std::fs::write(journal::beside(store.path()), line).unwrap();
            let reopened = DiskBindings::new(dir.path());
            let read = reopened.lookup(disk);
            if corrupt {
                assert!(
                    matches!(read, Err(DiskBindingsError::Corrupt { .. })),
                    "{read:?}"
                );
            } else {
                assert_eq!(read.unwrap(), None);
                let kept = if disk == DISK { 0 } else { 1 };
                assert_eq!(reopened.len().unwrap(), kept, "{disk}");
            }
        }
    }

    /// A freed disk bound again to another EK, and the journal of it left
    /// behind by a crash between the fold's snapshot and the emptied
    /// journal: the journal replays to the snapshot's state. A journal
    /// that contradicts itself, or a snapshot that holds neither its
    /// state before nor after, is corruption.
    #[test]
    fn a_journal_older_than_its_snapshot_replays_a_disk_bound_again() {
        let record = |n: u8, unbound: bool| {
            let ek = ek(n).to_string().trim_start_matches("sha256:").to_owned();
            format!("{{\"disk\":\"{DISK}\",\"ek\":\"{ek}\",\"unbound\":{unbound}}}\n")
        };
        let snapshot = |n: Option<u8>| match n {
            Some(n) => format!(
                "{{\"version\":1,\"disks\":{{\"{DISK}\":\"{}\"}}}}",
                ek(n).to_string().trim_start_matches("sha256:")
            ),
            None => "{\"version\":1,\"disks\":{}}".to_owned(),
        };
        let rebound = [record(1, false), record(1, true), record(2, false)].concat();
        let rebound_twice = [rebound.clone(), record(2, true), record(3, false)].concat();
        let cases = [
            // Newer than the snapshot, or older: both give EK 2.
            (snapshot(None), rebound.clone(), Some(Some(ek(2)))),
            (snapshot(Some(2)), rebound.clone(), Some(Some(ek(2)))),
            (snapshot(Some(1)), rebound.clone(), Some(Some(ek(2)))),
            (snapshot(Some(3)), rebound, None),
            (
                snapshot(Some(1)),
                [record(1, false), record(1, true)].concat(),
                Some(None),
            ),
            // A snapshot that holds a state the journal passes through (an
            // emptying failed, more records came).
            (snapshot(Some(2)), rebound_twice.clone(), Some(Some(ek(3)))),
            // Ended twice, the second time for an EK it was not bound to.
            (
                snapshot(None),
                [record(1, false), record(1, true), record(2, true)].concat(),
                None,
            ),
            // Bound to two EKs, or ended for another EK, in the journal.
            (
                snapshot(None),
                [record(1, false), record(2, false)].concat(),
                None,
            ),
            (
                snapshot(None),
                [record(1, false), record(2, true)].concat(),
                None,
            ),
        ];
        for (snapshot, journal, expected) in cases {
            lock_stores().clear();
            let dir = tempfile::tempdir().unwrap();
            let store = DiskBindings::new(dir.path());
            std::fs::create_dir_all(store.path().parent().unwrap()).unwrap();
            std::fs::write(store.path(), &snapshot).unwrap();
            std::fs::write(journal::beside(store.path()), &journal).unwrap();
            let read = store.lookup(DISK);
            match expected {
                Some(bound) => assert_eq!(read.unwrap(), bound, "{snapshot} {journal}"),
                None => assert!(
                    matches!(read, Err(DiskBindingsError::Corrupt { .. })),
                    "{snapshot} {journal}: {read:?}"
                ),
            }
        }
    }
}
