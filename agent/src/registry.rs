//! A control plane's registry of member nodes: the verdict of each node's
//! continuous attestation, and the revocation list.
//!
//! A node is identified by the SHA-256 of its EK public area and its state
//! disk's UUID. It enters the registry when this control plane issues it a
//! ticket or first validates its evidence; each evidence updates its
//! verdict, time and reason. The revocation list names EKs that get no join
//! ticket, no rejoin ticket and no disk key here (and, for the record, the
//! disk bound to each).
//!
//! The registry lives on the control plane's state disk, so a reboot keeps
//! it: a snapshot ([`paths::NODE_REGISTRY`] under the node root) and a
//! journal beside it ([`crate::journal`]). A change is on disk when the
//! call that made it returns: the state of each node record it touched
//! (and each new revocation) is appended to the journal and synced, so a
//! write costs what changed, not the size of the cluster. Once the journal
//! outgrows the snapshot (and 1 MiB), the next write replaces the snapshot
//! atomically and empties the journal. Changes made while a write runs go
//! to disk together in the next one ([`crate::batching`]), so tickets and
//! evidence checks arriving together share one write instead of queueing
//! for a write each. Control planes share it: each pulls
//! the others' registries with its own evidence and merges them
//! ([`Registry::merge`]: revocations are a union, a node's newest evidence
//! wins), and `keel revoke` goes to every control plane. One store per file
//! and process ([`RegistryStore::shared`]): the join service, the evidence
//! service and the operator API of a control plane see the same list.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::batching::Batcher;
use crate::disk_bindings::{DiskBindings, DiskBindingsError, EkDigest};
use crate::journal::{self, Journal, JournalError};
use crate::paths;

/// Most nodes a registry holds; most revocations.
pub use keel_proto::{MAX_NODES, MAX_REVOCATIONS};
/// Of [`MAX_REVOCATIONS`], the room merges never take: a control plane
/// compromised after its attestation could otherwise fill every peer's
/// list with junk first, and then never be revoked itself, by the operator
/// or the policy (a revocation that does not fit is refused).
pub const RESERVED_REVOCATIONS: usize = 1_000;
/// How many revocations merges fill the list to; past it no ticket is
/// issued, as a peer's revocation may have been dropped.
const MERGED_REVOCATIONS: usize = MAX_REVOCATIONS - RESERVED_REVOCATIONS;
/// Largest registry file read, or accepted from another control plane.
pub use keel_proto::MAX_REGISTRY_BYTES;
/// Largest journal read: its records are node records and revocations,
/// each bounded, and a journal is folded into the snapshot once it
/// outgrows it. A fold first appends the records of its own write (which
/// may be the whole registry, a merge's), so the bound leaves room for the
/// snapshot's size twice over that.
/// How far ahead of this clock a node time may be before a sweep takes
/// the clock for stepped back ([`Registry::mark_silent`]).
const STEPPED_BACK: Duration = Duration::from_secs(60);
const MAX_JOURNAL_BYTES: u64 = 3 * MAX_REGISTRY_BYTES as u64;
/// The journal is folded into a new snapshot once it is larger than the
/// snapshot and than this.
const COMPACT_AT_LEAST: u64 = 1024 * 1024;
/// Longest stored reason, in bytes; longer ones are cut.
const MAX_REASON: usize = 256;
/// Longest stored name, disk UUID or version, in bytes.
const MAX_FIELD: usize = 64;
/// Most other names a node record holds ([`NodeRecord::other_names`]).
pub use keel_proto::MAX_OTHER_NAMES;
/// How far ahead of this control plane's clock another's records may be
/// dated and still be merged.
const MAX_CLOCK_SKEW: Duration = Duration::from_secs(300);

/// A node's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Registered (a ticket was issued), no evidence yet.
    Registered,
    /// Its last evidence validated.
    Trusted,
    /// Its last evidence failed validation.
    Drifted,
    /// It sent no evidence for three intervals.
    Silent,
}

impl Verdict {
    /// The kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Registered => "registered",
            Self::Trusted => "trusted",
            Self::Drifted => "drifted",
            Self::Silent => "silent",
        }
    }

    /// Whether the `revoke` policy acts on it: drifted or silent.
    pub fn fails(self) -> bool {
        matches!(self, Self::Drifted | Self::Silent)
    }
}

/// What a control plane knows about one node.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRecord {
    /// The node name from its measured identity.
    pub name: String,
    /// Its measured role.
    pub role: String,
    /// SHA-256 of its EK public area (hex).
    pub ek: String,
    /// Its state disk's UUID (empty: none reported).
    pub disk_uuid: String,
    /// The verdict.
    pub verdict: Verdict,
    /// When it entered the registry (Unix seconds).
    pub registered_at: u64,
    /// When its last evidence arrived (Unix seconds), if ever.
    pub last_evidence_at: Option<u64>,
    /// When its verdict last changed (Unix seconds): since when it is
    /// drifted, say.
    pub verdict_at: u64,
    /// Why its last evidence failed, or why it is silent.
    pub reason: Option<String>,
    /// The Kubernetes version its last evidence reported.
    pub kubernetes_version: String,
    /// SHA-256 (hex) of the measurements its last evidence was checked against.
    pub measurements: String,
    /// Other names other control planes hold this node's EK under (at most
    /// [`MAX_OTHER_NAMES`]): a node renamed by its host and admitted under
    /// the new name by a control plane that did not know it. Held here
    /// too, so that no other node gets them; the node stays drifted.
    /// Absent when empty, so registries without a conflict read as before.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "at_most_other_names"
    )]
    pub other_names: Vec<String>,
    /// Its drift rests on the clock of the control plane that judged it
    /// alone: its last evidence held but for a validity period (a
    /// certificate, revocation list or collateral outside its window at
    /// that control plane's time; `ValidationError::rests_on_the_clock`).
    /// A host can set its control plane's clock, so the `revoke` policy
    /// leaves such a node to the operator. Absent when not, so registries
    /// without such a drift read as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub on_clock: bool,
}

impl NodeRecord {
    /// Its name and role, as `name (role)`.
    fn identity(&self) -> String {
        shown_identity(&self.name, &self.role)
    }

    /// `name (role)` if `name` or `role` is another than the one recorded
    /// (a blank on either side is no other).
    fn other_identity(&self, name: &str, role: &str) -> Option<String> {
        let differs = |held: &str, asked: &str| {
            !held.is_empty() && !asked.is_empty() && cut(asked, MAX_FIELD) != held
        };
        (differs(&self.name, name) || differs(&self.role, role))
            .then(|| shown_identity(&cut(name, MAX_FIELD), &cut(role, MAX_FIELD)))
    }

    /// A record of `ek` alone, as a revocation by EK names it.
    fn named_by_ek(ek: &EkDigest) -> Self {
        Self {
            name: String::new(),
            role: String::new(),
            ek: ek.to_string(),
            disk_uuid: String::new(),
            verdict: Verdict::Registered,
            registered_at: 0,
            last_evidence_at: None,
            verdict_at: 0,
            reason: None,
            kubernetes_version: String::new(),
            measurements: String::new(),
            other_names: Vec::new(),
            on_clock: false,
        }
    }

    /// Whether its drift still stands at `at` (Unix seconds): it drifted
    /// less than `stands` ago, so trusted evidence does not clear it, here
    /// or from a peer ([`Registry::record_holding_drift`],
    /// [`Registry::merge_holding_drift`]). A drift that rests on the clock
    /// never stands: it says nothing of what the node ran, and trusted
    /// evidence clears it at once.
    fn drift_stands(&self, at: u64, stands: Duration) -> bool {
        self.verdict == Verdict::Drifted
            && !self.on_clock
            && at.saturating_sub(self.verdict_at) < stands.as_secs()
    }

    /// Its text fields cut to their bounds ([`cut`]).
    fn cut_fields(&mut self) {
        for field in [
            &mut self.name,
            &mut self.role,
            &mut self.disk_uuid,
            &mut self.kubernetes_version,
            &mut self.measurements,
        ] {
            *field = cut(field, MAX_FIELD);
        }
        if let Some(reason) = &mut self.reason {
            *reason = cut(reason, MAX_REASON);
        }
        self.other_names.truncate(MAX_OTHER_NAMES);
        for name in &mut self.other_names {
            *name = cut(name, MAX_FIELD);
        }
    }

    /// Whether it holds `name` (cut as stored): its own or another.
    fn holds(&self, name: &str) -> bool {
        self.name == name || self.other_names.iter().any(|n| n == name)
    }

    /// Takes the names `theirs` (a peer's record of the same EK) holds
    /// that this one does not, as other names (up to [`MAX_OTHER_NAMES`];
    /// a blank is no name). Returns whether it took any.
    fn take_other_names(&mut self, theirs: &Self) -> bool {
        let mut took = false;
        for name in std::iter::once(&theirs.name).chain(&theirs.other_names) {
            if name.is_empty() || self.holds(name) || self.other_names.len() >= MAX_OTHER_NAMES {
                continue;
            }
            self.other_names.push(name.clone());
            took = true;
        }
        took
    }

    /// Why a node that holds other names stands drifted.
    fn other_names_reason(&self) -> Option<String> {
        (!self.other_names.is_empty()).then(|| {
            format!(
                "other control planes admitted its EK under another name ({}); it joined here \
                 as {}: revoke it (its host renamed it)",
                self.other_names.join(", "),
                self.name
            )
        })
    }
}

/// [`NodeRecord::other_names`] as read: at most [`MAX_OTHER_NAMES`], so a
/// peer's document cannot make a list of millions of empty names.
fn at_most_other_names<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<String>, D::Error> {
    keel_verifier::bounded::at_most(deserializer, MAX_OTHER_NAMES, "names")
}

/// One entry of the revocation list.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Revocation {
    /// The node name, as the registry knew it.
    pub name: String,
    /// SHA-256 of the revoked EK public area (hex).
    pub ek: String,
    /// The revoked disk UUID (empty: none known).
    pub disk_uuid: String,
    /// Why: the operator, or the policy with the verdict's reason.
    pub reason: String,
    /// When (Unix seconds).
    pub at: u64,
}

impl Revocation {
    /// Its text fields cut to their bounds ([`cut`]).
    fn cut_fields(&mut self) {
        self.name = cut(&self.name, MAX_FIELD);
        self.disk_uuid = cut(&self.disk_uuid, MAX_FIELD);
        self.reason = cut(&self.reason, MAX_REASON);
    }
}

impl std::fmt::Display for Revocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "node {} (EK {}, disk {}) revoked at {}: {}",
            self.name.escape_debug(),
            self.ek,
            self.disk_uuid.escape_debug(),
            self.at,
            self.reason.escape_debug()
        )
    }
}

/// The registry's content: nodes by EK hash, and the revocation list.
/// Both change only through the methods here, which mark what a store's
/// journal must record.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registry {
    /// Nodes by the hex SHA-256 of their EK.
    nodes: BTreeMap<String, NodeRecord>,
    /// Revoked nodes, oldest first. Only ever appended to (a store journals
    /// the revocations past those it wrote).
    revoked: Vec<Revocation>,
    /// Keys of the node records the methods here changed since a store
    /// last took them to its journal.
    #[serde(skip)]
    changed: BTreeSet<String>,
    /// When this control plane took a peer's newer record of a node (Unix
    /// seconds, this clock), by the node's key; not written. A peer's
    /// clock may run behind this one (up to [`MAX_CLOCK_SKEW`]), and so
    /// do the evidence times on its records: counted from those alone, a
    /// node that only that peer hears would look quiet here for that much
    /// longer, and fall silent though it reports every interval.
    #[serde(skip)]
    heard_from_peers: BTreeMap<String, u64>,
    /// The evidence time of the last record dated ahead of this clock that
    /// counted a node as heard, by the node's key; not written. The same
    /// record served again counts no more.
    #[serde(skip)]
    heard_ahead: BTreeMap<String, u64>,
}

impl PartialEq for Registry {
    /// The same nodes and revocations (what is still to be written aside).
    fn eq(&self, other: &Self) -> bool {
        self.nodes == other.nodes && self.revoked == other.revoked
    }
}

impl Eq for Registry {}

/// One record of the registry's journal: the whole state of one entry, so
/// replaying it twice, or over a snapshot that already holds it, changes
/// nothing.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
enum Change {
    /// A node record as it is now.
    Node(NodeRecord),
    /// A revocation (revocations are never removed).
    Revoked(Revocation),
}

/// A registry operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The control plane whose registry was to be merged is on this
    /// registry's revocation list: nothing of it is taken.
    #[error("the other control plane is on this control plane's revocation list; its registry is not merged")]
    PeerRevoked,
    /// Reading the registry file failed.
    #[error("reading the node registry {path:?}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The registry file or a peer's registry is invalid.
    #[error("the node registry is invalid: {0}")]
    Invalid(String),
    /// Writing the registry failed.
    #[error("writing the node registry")]
    Write(#[from] crate::files::WriteFileError),
    /// The registry holds as many entries as it may.
    #[error("the node registry is full")]
    Full,
    /// The revocation list holds as many revocations as merges take
    /// ([`MAX_REVOCATIONS`] less [`RESERVED_REVOCATIONS`], which only this
    /// control plane's own revocations use), or [`MAX_REVOCATIONS`]: a
    /// revocation merged, or made, from now on may be lost, so no ticket is
    /// issued.
    #[error(
        "the revocation list is full ({} revocations{}): this control plane \
         issues no tickets",
        MAX_REVOCATIONS - RESERVED_REVOCATIONS,
        not_recorded(*.dropped)
    )]
    RevocationsFull {
        /// Revocations that were not recorded (0: none yet).
        dropped: usize,
    },
    /// Another node, not revoked, holds the name: a second EK with the same
    /// name would get a kubelet certificate for the first one's Node.
    #[error("the node name {name:?} is held by node {holder}; revoke that node to give its name to another")]
    NameTaken {
        /// The name asked for.
        name: String,
        /// The EK that holds it (`sha256:` and hex).
        holder: String,
    },
    /// The node's EK holds another name or role than the one asked for: a
    /// node keeps the identity it joined with. Renaming a member would free
    /// its name for a second TPM while the member still holds a kubelet
    /// certificate for it.
    #[error("the node's EK joined as {held:?}; it asks as {asked:?}: a node keeps the name and role it joined with (revoke it and replace the VM to rename it)")]
    Renamed {
        /// The recorded name and role (`name (role)`).
        held: String,
        /// The name and role asked for.
        asked: String,
    },
    /// A blocking registry task did not complete.
    #[error("the node registry task failed")]
    Task,
    /// No node matches the selector.
    #[error("no node {0:?} is known to this control plane")]
    UnknownNode(String),
    /// The write this change shared with others failed (the cause is the
    /// same for all of them).
    #[error(transparent)]
    Shared(Arc<RegistryError>),
    /// Reading or appending to the registry's journal failed.
    #[error("the node registry's journal")]
    Journal(#[from] JournalError),
    /// A ticket was to be recorded for a revoked node (revoked while its
    /// ticket was being made).
    #[error("the node is revoked: {0}")]
    Revoked(Box<Revocation>),
    /// Another node, not revoked, is recorded with the disk a node asks a
    /// ticket for ([`Registry::check_disk`]).
    #[error("disk {uuid} is recorded for node {holder}; a disk is bound to one node")]
    DiskHeld {
        /// The disk UUID (lower case).
        uuid: String,
        /// The EK of the node recorded with it (`sha256:` and hex).
        holder: String,
    },
}

/// A disk UUID that the disk binding store binds to one EK (the binding a
/// join ticket made): the only disk UUID evidence may record for that EK,
/// and the only one a revocation of it may name. A UUID a member reports
/// is only its claim: a compromised member could name another node's disk
/// and, once revoked, take that disk down with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundDisk {
    ek: EkDigest,
    uuid: String,
}

/// What the disk binding store says of a disk UUID reported for an EK.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiskClaim {
    /// The disk is bound to that EK.
    Bound(BoundDisk),
    /// No binding here: no UUID, a malformed one, or a disk that joined
    /// through another control plane. Nothing is recorded for it.
    Unbound,
    /// The disk is bound to another EK (given): the report is false.
    OtherEk(EkDigest),
}

impl BoundDisk {
    /// What `disks` says of the disk `uuid` reported for `ek`.
    pub fn check(
        disks: &DiskBindings,
        ek: &EkDigest,
        uuid: &str,
    ) -> Result<DiskClaim, DiskBindingsError> {
        if uuid.is_empty() {
            return Ok(DiskClaim::Unbound);
        }
        match disks.lookup(uuid) {
            Ok(Some(bound)) if bound.ct_eq(ek) => Ok(DiskClaim::Bound(Self {
                ek: *ek,
                uuid: cut(&uuid.to_ascii_lowercase(), MAX_FIELD),
            })),
            Ok(Some(bound)) => Ok(DiskClaim::OtherEk(bound)),
            Ok(None) | Err(DiskBindingsError::Uuid(_)) => Ok(DiskClaim::Unbound),
            Err(e) => Err(e),
        }
    }

    /// The disk a revocation of `record` may name: its recorded disk UUID
    /// if `disks` binds it to the record's EK, else none (logged, naming
    /// the EK: the revocation then names the EK alone).
    pub fn of_record(disks: Option<&DiskBindings>, record: &NodeRecord) -> Option<Self> {
        if record.disk_uuid.is_empty() {
            return None;
        }
        let ek = ek_digest(&record.ek)?;
        let claim = match disks {
            Some(disks) => Self::check(disks, &ek, &record.disk_uuid),
            None => Ok(DiskClaim::Unbound),
        };
        match claim {
            Ok(DiskClaim::Bound(disk)) => return Some(disk),
            Ok(claim) => tracing::warn!(
                ek = %ek,
                disk = %record.disk_uuid.escape_debug(),
                bound_to = ?match claim { DiskClaim::OtherEk(other) => Some(other), _ => None },
                "the node's recorded disk is not bound to its EK here; its revocation names the EK only"
            ),
            Err(e) => tracing::error!(
                ek = %ek,
                error = %keel_atls::ErrorChain(&e),
                "the disk bindings could not be read; the revocation names the EK only"
            ),
        }
        None
    }

    /// The disk UUID (lower case).
    pub fn uuid(&self) -> &str {
        &self.uuid
    }

    /// The EK it is bound to.
    pub fn ek(&self) -> &EkDigest {
        &self.ek
    }
}

/// What a node record is updated with after one evidence check.
#[derive(Clone, Debug)]
pub struct Evidence {
    /// The node's EK.
    pub ek: EkDigest,
    /// Its disk, if the disk binding store binds the UUID it reported to
    /// its EK; `None` keeps the disk UUID the record has.
    pub disk: Option<BoundDisk>,
    /// Its measured name.
    pub name: String,
    /// Its measured role.
    pub role: String,
    /// The Kubernetes version it reported.
    pub kubernetes_version: String,
    /// SHA-256 (hex) of the measurements it was checked against.
    pub measurements: String,
    /// `None` if it validated, else why not.
    pub failure: Option<String>,
    /// The failure rests on this control plane's clock alone
    /// ([`NodeRecord::on_clock`]).
    pub failure_on_clock: bool,
}

/// Unix seconds now.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A node name and role as messages show them: `name (role)`.
fn shown_identity(name: &str, role: &str) -> String {
    format!("{name} ({role})")
}

/// `text` as stored: control characters (which JSON would spell as six
/// bytes each) replaced with `?`, then cut to at most `max` bytes on a
/// character boundary. So a stored field is at most twice `max` bytes in
/// JSON (a quote or backslash is two).
fn cut(text: &str, max: usize) -> String {
    let mut stored = String::with_capacity(text.len().min(max));
    for c in text.chars().map(|c| if c.is_control() { '?' } else { c }) {
        if stored.len() + c.len_utf8() > max {
            break;
        }
        stored.push(c);
    }
    stored
}

/// The EK digest `text` is, if it is one exactly as [`EkDigest`] shows it
/// (as this registry stores them).
fn ek_digest(text: &str) -> Option<EkDigest> {
    text.strip_prefix("sha256:")
        .and_then(EkDigest::from_hex)
        .filter(|ek| ek.to_string() == text)
}

/// Whether the node record under `key` is one this code writes: under its
/// own EK digest.
fn well_formed_node(key: &str, record: &NodeRecord) -> bool {
    key == record.ek && ek_digest(&record.ek).is_some()
}

/// Whether a revocation is one this code writes: naming an EK digest.
fn well_formed_revocation(revocation: &Revocation) -> bool {
    ek_digest(&revocation.ek).is_some()
}

/// The error for a registry file or document over [`MAX_REGISTRY_BYTES`].
fn too_large() -> RegistryError {
    RegistryError::Invalid(format!("larger than {} MiB", MAX_REGISTRY_BYTES >> 20))
}

impl Registry {
    /// Parses a registry document (at most [`MAX_REGISTRY_BYTES`], at most
    /// [`MAX_NODES`] nodes and [`MAX_REVOCATIONS`] revocations).
    pub fn parse(bytes: &[u8]) -> Result<Self, RegistryError> {
        let mut registry = Self::parse_bounded(bytes)?;
        registry.check_entries()?;
        registry.cut_fields();
        Ok(registry)
    }

    /// A registry this node stored: as [`Registry::parse`], except that
    /// entries this code never writes are dropped and logged rather than
    /// refused (an older version merged a peer's revocations as sent), so
    /// a control plane always starts with what it holds.
    fn parse_stored(bytes: &[u8]) -> Result<Self, RegistryError> {
        let mut registry = Self::parse_bounded(bytes)?;
        let before = (registry.nodes.len(), registry.revoked.len());
        registry.nodes.retain(|key, r| well_formed_node(key, r));
        registry.revoked.retain(well_formed_revocation);
        let dropped = (
            before.0 - registry.nodes.len(),
            before.1 - registry.revoked.len(),
        );
        if dropped != (0, 0) {
            tracing::warn!(
                nodes = dropped.0,
                revocations = dropped.1,
                "dropped registry entries not under an EK digest"
            );
        }
        registry.cut_fields();
        Ok(registry)
    }

    fn parse_bounded(bytes: &[u8]) -> Result<Self, RegistryError> {
        if bytes.len() > MAX_REGISTRY_BYTES {
            return Err(too_large());
        }
        let registry: Self =
            serde_json::from_slice(bytes).map_err(|e| RegistryError::Invalid(e.to_string()))?;
        if registry.nodes.len() > MAX_NODES || registry.revoked.len() > MAX_REVOCATIONS {
            return Err(RegistryError::Invalid("too many entries".into()));
        }
        Ok(registry)
    }

    /// Refuses a document with an entry this code never writes: a node
    /// record not under its own EK digest, or an EK digest in another
    /// form. Another control plane's document (or a ticket's revocations)
    /// holds nothing else either.
    fn check_entries(&self) -> Result<(), RegistryError> {
        if let Some(key) = self
            .nodes
            .iter()
            .find_map(|(key, r)| (!well_formed_node(key, r)).then_some(key))
        {
            return Err(RegistryError::Invalid(format!(
                "a node record is not under its EK digest ({})",
                key.escape_debug()
            )));
        }
        if !self.revoked.iter().all(well_formed_revocation) {
            return Err(RegistryError::Invalid(
                "a revocation names no EK digest".into(),
            ));
        }
        Ok(())
    }

    /// Cuts every stored field to its bound, as this code stores it:
    /// documents written before the bounds were in bytes (reasons of up to
    /// 512 characters, pretty JSON) or by a peer that still writes them are
    /// taken, and a registry at every bound still fits
    /// [`MAX_REGISTRY_BYTES`].
    fn cut_fields(&mut self) {
        for r in self.nodes.values_mut() {
            r.cut_fields();
        }
        for r in &mut self.revoked {
            r.cut_fields();
        }
    }

    /// This registry's revocations alone, without node records: what a
    /// control-plane ticket carries, so that the new control plane refuses
    /// what this one refuses from its first ticket on.
    pub fn revocations_only(&self) -> Self {
        Self {
            nodes: BTreeMap::new(),
            revoked: self.revoked.clone(),
            ..Self::default()
        }
    }

    /// This registry's revocations, and its node records reduced to the
    /// names they hold (EK, name and role; registered at `at`, no
    /// evidence, no disk): what is taken from a registry that is no view
    /// of the nodes (a peer's clock too far from this one's, an answer
    /// that came late). Merged, such a record is taken only where this
    /// registry has none for the EK and never replaces one, so the names
    /// members hold stay held here. Such a node counts as registered now
    /// (heard, for one silence grace), without the peer's verdict.
    pub fn names_only(&self, at: u64) -> Self {
        let nodes = self
            .nodes
            .iter()
            .map(|(key, record)| {
                let named = NodeRecord {
                    name: record.name.clone(),
                    role: record.role.clone(),
                    ek: record.ek.clone(),
                    disk_uuid: String::new(),
                    verdict: Verdict::Registered,
                    registered_at: at,
                    last_evidence_at: None,
                    verdict_at: at,
                    reason: None,
                    kubernetes_version: String::new(),
                    measurements: String::new(),
                    other_names: record.other_names.clone(),
                    on_clock: false,
                };
                (key.clone(), named)
            })
            .collect();
        Self {
            nodes,
            revoked: self.revoked.clone(),
            ..Self::default()
        }
    }

    /// The JSON form, without whitespace: what the snapshot holds, and
    /// what another control plane, the operator or a control-plane ticket
    /// gets ([`MAX_REGISTRY_BYTES`] bounds it at every entry bound).
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Nodes by the hex SHA-256 of their EK.
    pub fn nodes(&self) -> &BTreeMap<String, NodeRecord> {
        &self.nodes
    }

    /// Revoked nodes, oldest first.
    pub fn revoked(&self) -> &[Revocation] {
        &self.revoked
    }

    /// The revocation of `ek`, if any. A revocation's disk is not matched
    /// on its own: the disk key is bound to the EK, so another EK naming
    /// that disk gets a key that does not open it; and a revocation a peer
    /// made of a disk it bound on a node's claim must not lock the disk's
    /// owner out.
    pub fn revocation(&self, ek: &EkDigest) -> Option<&Revocation> {
        let ek = ek.to_string();
        self.revoked.iter().find(|r| r.ek == ek)
    }

    /// Records that a ticket is issued to a node; keeps its verdict if it
    /// is known. `disk_uuid` is a disk bound to its EK, or empty (the
    /// recorded disk stays). Refuses a node whose EK a revocation names
    /// (a revocation's disk is not checked: a disk's key is bound to its
    /// EK): checked under the registry's lock, so a ticket
    /// still being made when the operator's revocation lands is not issued.
    /// Refuses every node once the revocation list is full: a revocation
    /// that no longer fits (the operator's, the policy's, a peer's) must
    /// not leave its node a ticket. Refuses a name another EK holds unless
    /// that EK is revoked: node names are Kubernetes Node names, one per
    /// node; and another name or role than the EK holds
    /// ([`Registry::check_identity`]).
    pub fn register(
        &mut self,
        ek: &EkDigest,
        disk_uuid: &str,
        name: &str,
        role: &str,
    ) -> Result<(), RegistryError> {
        if let Some(revocation) = self.revocation(ek) {
            return Err(RegistryError::Revoked(Box::new(revocation.clone())));
        }
        // Past the room merges take, a peer's revocation may have been
        // dropped: no ticket then.
        if self.revoked.len() >= MERGED_REVOCATIONS {
            return Err(RegistryError::RevocationsFull { dropped: 0 });
        }
        self.check_identity(ek, name, role)?;
        let disk = (!disk_uuid.is_empty()).then_some(disk_uuid);
        self.enter(ek, disk, name, role)
    }

    /// Refuses `disk_uuid` for `ek` where another node, not revoked, is
    /// recorded with that disk ([`RegistryError::DiskHeld`]). Each control
    /// plane binds disks on its own; the records, which control planes
    /// exchange, are how one learns of a disk that joined through another.
    /// Without this check a node could bind another node's disk at a
    /// control plane that never saw it join, and that control plane would
    /// refuse the owner's rejoin and evidence from then on (and, once the
    /// control plane that bound it truly is gone, revoke it for silence).
    /// A record holds only a disk bound to its EK where it was made. For a
    /// join, before the disk is bound; not again when the record is made:
    /// by then this control plane binds the disk to the node, and a record
    /// another made of it is a conflict this one cannot settle.
    pub fn check_disk(&self, ek: &EkDigest, disk_uuid: &str) -> Result<(), RegistryError> {
        if disk_uuid.is_empty() {
            return Ok(());
        }
        let key = ek.to_string();
        let holder = self.nodes.values().find(|r| {
            r.ek != key
                && r.disk_uuid.eq_ignore_ascii_case(disk_uuid)
                && !self.revoked.iter().any(|rev| rev.ek == r.ek)
        });
        match holder {
            Some(holder) => Err(RegistryError::DiskHeld {
                uuid: disk_uuid.to_ascii_lowercase(),
                holder: holder.ek.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Refuses `name` and `role` for `ek` where `ek` holds another name or
    /// role ([`RegistryError::Renamed`]): the host writes the node part of
    /// a node's config, and a member it renamed would free its name, for a
    /// second TPM to get a kubelet certificate of a Node whose certificate
    /// the member still holds. Then [`Registry::check_name`].
    pub fn check_identity(
        &self,
        ek: &EkDigest,
        name: &str,
        role: &str,
    ) -> Result<(), RegistryError> {
        self.check_own_identity(ek, name, role)?;
        self.check_name(ek, name)
    }

    /// The first half of [`Registry::check_identity`]: refuses `name` and
    /// `role` where `ek` holds another name or role. What a node checks of
    /// itself in its own registry before it serves again (a recovery, a
    /// restart, a rejoin).
    pub fn check_own_identity(
        &self,
        ek: &EkDigest,
        name: &str,
        role: &str,
    ) -> Result<(), RegistryError> {
        match self.nodes.get(&ek.to_string()) {
            Some(held) => match held.other_identity(name, role) {
                Some(asked) => Err(RegistryError::Renamed {
                    held: held.identity(),
                    asked,
                }),
                None => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// Refuses `name` for `ek` while another EK, not revoked, holds it
    /// ([`RegistryError::NameTaken`]), unless `ek` holds it too: a
    /// registry from before this rule, or merged from peers that each
    /// admitted one, may hold a name twice, and neither holder is locked
    /// out by the other.
    pub fn check_name(&self, ek: &EkDigest, name: &str) -> Result<(), RegistryError> {
        let key = ek.to_string();
        let wanted = cut(name, MAX_FIELD);
        let other = self.nodes.values().find(|r| {
            r.holds(&wanted) && r.ek != key && !self.revoked.iter().any(|rev| rev.ek == r.ek)
        });
        match other {
            Some(other) if self.nodes.get(&key).is_some_and(|own| own.holds(&wanted)) => {
                // Kept, but said: one of the two is not the node the name
                // is for, and only the operator can tell which.
                tracing::warn!(
                    name = %wanted.escape_debug(),
                    ek = %key,
                    other = %other.ek,
                    "two unrevoked nodes hold one name; revoke the one that is not this node"
                );
                Ok(())
            }
            Some(holder) => Err(RegistryError::NameTaken {
                name: wanted,
                holder: holder.ek.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Adds or updates the record of `ek`: its name, role and, if given,
    /// disk UUID (`None` keeps the recorded one). A recorded name or role
    /// is never replaced, only a blank one filled: evidence whose log names
    /// no single identity must not blank the node's name, which would free
    /// it for another node and hide this one from `keel revoke <name>`; and
    /// evidence under another name (its host renamed it) must not free it
    /// either ([`Registry::record`] judges that evidence drifted).
    fn enter(
        &mut self,
        ek: &EkDigest,
        disk_uuid: Option<&str>,
        name: &str,
        role: &str,
    ) -> Result<(), RegistryError> {
        let key = ek.to_string();
        if !self.nodes.contains_key(&key) && self.nodes.len() >= MAX_NODES {
            return Err(RegistryError::Full);
        }
        let at = now();
        self.changed.insert(key.clone());
        let record = self.nodes.entry(key.clone()).or_insert_with(|| NodeRecord {
            name: String::new(),
            role: String::new(),
            ek: key,
            disk_uuid: String::new(),
            verdict: Verdict::Registered,
            registered_at: at,
            last_evidence_at: None,
            verdict_at: at,
            reason: None,
            kubernetes_version: String::new(),
            measurements: String::new(),
            other_names: Vec::new(),
            on_clock: false,
        });
        if record.name.is_empty() {
            record.name = cut(name, MAX_FIELD);
        }
        if record.role.is_empty() {
            record.role = cut(role, MAX_FIELD);
        }
        if let Some(disk_uuid) = disk_uuid {
            record.disk_uuid = cut(&disk_uuid.to_ascii_lowercase(), MAX_FIELD);
        }
        Ok(())
    }

    /// Records one evidence check; returns the node's previous verdict
    /// (`None` for a node new to the registry). The disk UUID changes only
    /// to a disk bound to the evidence's EK.
    pub fn record(&mut self, evidence: &Evidence) -> Result<Option<Verdict>, RegistryError> {
        self.record_holding_drift(evidence, Duration::ZERO)
    }

    /// [`Registry::record`], where a drift stands for at least `stands`
    /// (`EvidenceConfig::drift_stands`, longer than the policy's hold by
    /// two sweeps): a trusted check within `stands` of the drift leaves the
    /// node drifted, so the `revoke` policy judges every drift, also one
    /// the node reset its TPM (and rejoined) to leave behind.
    pub fn record_holding_drift(
        &mut self,
        evidence: &Evidence,
        stands: Duration,
    ) -> Result<Option<Verdict>, RegistryError> {
        let held = self.nodes.get(&evidence.ek.to_string());
        let previous = held.map(|r| r.verdict);
        // Evidence under another name or role than the node holds: its
        // host renamed it (the name is in the host-written node config).
        // The record keeps its identity ([`Registry::enter`]) and the node
        // drifts.
        let renamed = held.and_then(|r| {
            r.other_identity(&evidence.name, &evidence.role)
                .map(|asked| {
                    format!(
                        "its evidence names it {asked}; it joined as {}",
                        r.identity()
                    )
                })
        });
        let held_apart = held.and_then(NodeRecord::other_names_reason);
        let failure = evidence
            .failure
            .as_ref()
            .or(renamed.as_ref())
            .or(held_apart.as_ref());
        let disk = evidence
            .disk
            .as_ref()
            .filter(|d| d.ek.ct_eq(&evidence.ek))
            .map(BoundDisk::uuid);
        self.enter(&evidence.ek, disk, &evidence.name, &evidence.role)?;
        let at = now();
        if let Some(record) = self.nodes.get_mut(&evidence.ek.to_string()) {
            record.last_evidence_at = Some(at);
            record.kubernetes_version = cut(&evidence.kubernetes_version, MAX_FIELD);
            record.measurements = cut(&evidence.measurements, MAX_FIELD);
            let drift_stands = record.drift_stands(at, stands);
            let verdict = match failure {
                None if drift_stands => Verdict::Drifted,
                None => {
                    record.reason = None;
                    record.on_clock = false;
                    Verdict::Trusted
                }
                Some(reason) => {
                    // Only the evidence's own failure can rest on the
                    // clock (a rename or a name held apart does not), and
                    // it does not make a drift that stands for another
                    // reason one that rests on the clock: that drift keeps
                    // its reason.
                    let on_clock =
                        evidence.failure_on_clock && renamed.is_none() && held_apart.is_none();
                    let other_drift = record.verdict == Verdict::Drifted && !record.on_clock;
                    if !(on_clock && other_drift) {
                        // A drift on the clock that becomes one of the
                        // node's own holds from now: the policy never acts
                        // on the first, so its time is no hold served.
                        if record.verdict == Verdict::Drifted && record.on_clock && !on_clock {
                            record.verdict_at = at;
                        }
                        record.reason = Some(cut(reason, MAX_REASON));
                        record.on_clock = on_clock;
                    }
                    Verdict::Drifted
                }
            };
            if record.verdict != verdict {
                record.verdict = verdict;
                record.verdict_at = at;
            }
        }
        Ok(previous)
    }

    /// Marks silent every node that is not revoked or drifted and sent no
    /// evidence since `since` (Unix seconds) and for `grace` before `now`;
    /// returns the nodes newly marked. A drifted node keeps its verdict:
    /// its drift's hold runs from the drift (a silence would restart it,
    /// under the silence's conditions), and trusted evidence within that
    /// hold does not clear a drift, as it would a silence. Not a drift that
    /// rests on the clock ([`NodeRecord::on_clock`]): the policy never acts
    /// on one, and a node that stopped reporting after one (say, its EK
    /// certificate lapsed) must fall silent like any other, or it would
    /// keep its keys for good by never reporting again. Times ahead of
    /// `now` are first moved back to it ([`Registry::times_not_after`]). Evidence that reached this registry through
    /// a peer counts from when it was taken here, if that is later than
    /// the peer's time for it. The record of `own` (the control plane
    /// whose registry this is) is never marked: its silence is for its
    /// peers to judge, and its evidence to itself may lapse (its loop
    /// restarting) while it serves.
    pub fn mark_silent(
        &mut self,
        now: u64,
        grace: Duration,
        since: u64,
        own: &EkDigest,
    ) -> Vec<NodeRecord> {
        let moved = self.times_not_after(now);
        if moved > 0 {
            tracing::warn!(
                records = moved,
                "node times ahead of this clock moved back to it (the clock was stepped back): silence and drift holds count from now"
            );
        }
        let revoked = self.revoked_eks();
        let own = own.to_string();
        let mut marked = Vec::new();
        for (key, record) in &mut self.nodes {
            let held_drift = record.verdict == Verdict::Drifted && !record.on_clock;
            if record.verdict == Verdict::Silent
                || held_drift
                || revoked.contains(&record.ek)
                || *key == own
            {
                continue;
            }
            let heard = record
                .last_evidence_at
                .unwrap_or(record.registered_at)
                .max(self.heard_from_peers.get(key).copied().unwrap_or(0))
                .max(since);
            let quiet = now.saturating_sub(heard);
            if quiet >= grace.as_secs() {
                self.changed.insert(record.ek.clone());
                record.verdict = Verdict::Silent;
                record.verdict_at = now;
                record.reason = Some(format!("no evidence for {quiet} s"));
                record.on_clock = false;
                marked.push(record.clone());
            }
        }
        marked
    }

    /// Moves every node time more than [`STEPPED_BACK`] ahead of `now` back
    /// to `now`; returns how many records it moved. After this clock was
    /// stepped back, silence and a drift's hold then count from the step,
    /// instead of from times the clock has yet to reach again (a host's
    /// step back would postpone a drifted node's revocation by as much).
    /// Times a little ahead are those recorded while a sweep that read the
    /// clock first waited for the registry.
    fn times_not_after(&mut self, now: u64) -> usize {
        let mut moved = 0;
        let limit = now.saturating_add(STEPPED_BACK.as_secs());
        for (key, record) in &mut self.nodes {
            let ahead = record.registered_at > limit
                || record.verdict_at > limit
                || record.last_evidence_at.is_some_and(|at| at > limit);
            if ahead {
                record.registered_at = record.registered_at.min(now);
                record.verdict_at = record.verdict_at.min(now);
                record.last_evidence_at = record.last_evidence_at.map(|at| at.min(now));
                self.changed.insert(record.ek.clone());
                moved += 1;
            }
            if let Some(heard) = self.heard_from_peers.get_mut(key) {
                if *heard > limit {
                    *heard = now;
                }
            }
        }
        moved
    }

    /// How the unrevoked nodes stand: how many there are, how many of them
    /// but `own_ek` are drifted and silent (the policy does not revoke
    /// `own_ek`, so it does not hold others back either), and how many are
    /// control planes other than `own_ek`.
    pub fn standing(&self, own_ek: &EkDigest) -> Standing {
        let revoked = self.revoked_eks();
        let own = own_ek.to_string();
        let mut standing = Standing::default();
        for r in self.nodes.values().filter(|r| !revoked.contains(&r.ek)) {
            standing.unrevoked += 1;
            match r.verdict {
                _ if r.ek == own => {}
                // A drift that rests on the clock is no failure the policy
                // acts on, and one control plane's clock or collateral must
                // not hold back every other drift's revocation.
                Verdict::Drifted if r.on_clock => {}
                Verdict::Drifted => standing.drifted += 1,
                Verdict::Silent => standing.silent += 1,
                _ => {}
            }
            if r.role == "control-plane" && r.ek != own {
                standing.peers += 1;
            }
        }
        standing
    }

    /// The nodes whose verdict is drifted or silent and whose EK no
    /// revocation covers, but `own` (the control plane whose registry this
    /// is): what the `revoke` policy has yet to revoke. A control plane
    /// never revokes itself: its peers judge it, and a lone control plane
    /// that revoked itself would serve no one again.
    pub fn failing_unrevoked(&self, own: &EkDigest) -> Vec<NodeRecord> {
        let revoked = self.revoked_eks();
        let own = own.to_string();
        self.nodes
            .values()
            .filter(|r| r.verdict.fails())
            .filter(|r| !revoked.contains(&r.ek) && r.ek != own)
            .cloned()
            .collect()
    }

    /// The node `selector` names: its name, its EK hash (hex) or its disk
    /// UUID.
    pub fn find(&self, selector: &str) -> Result<&NodeRecord, RegistryError> {
        let wanted = selector.trim();
        let mut matches = self.nodes.values().filter(|r| {
            r.name == wanted
                || r.ek.eq_ignore_ascii_case(wanted)
                || (!r.disk_uuid.is_empty() && r.disk_uuid.eq_ignore_ascii_case(wanted))
        });
        match (matches.next(), matches.next()) {
            (Some(record), None) => Ok(record),
            // Two nodes of one name (a node that came back with a new TPM
            // after the old one was revoked, or a registry from before one
            // name had one holder): the operator names the EK or the disk.
            (Some(_), Some(_)) => Err(RegistryError::UnknownNode(format!(
                "{} (ambiguous: name the EK hash or the disk UUID)",
                cut(wanted, MAX_FIELD)
            ))),
            _ => Err(RegistryError::UnknownNode(cut(wanted, MAX_FIELD))),
        }
    }

    /// Puts `record`'s EK on the revocation list for `reason`, with `disk`
    /// if it is bound to that EK ([`BoundDisk::of_record`]; the disk UUID
    /// the record names is not taken on its own word); returns the
    /// revocation (the existing one if it was revoked).
    pub fn revoke(
        &mut self,
        record: &NodeRecord,
        disk: Option<&BoundDisk>,
        reason: &str,
    ) -> Result<Revocation, RegistryError> {
        if let Some(existing) = self.revoked.iter().find(|r| r.ek == record.ek) {
            return Ok(existing.clone());
        }
        if self.revoked.len() >= MAX_REVOCATIONS {
            return Err(RegistryError::RevocationsFull { dropped: 1 });
        }
        let disk_uuid = disk
            .filter(|d| d.ek.to_string() == record.ek)
            .map(|d| d.uuid.clone())
            .unwrap_or_default();
        let revocation = Revocation {
            name: record.name.clone(),
            ek: record.ek.clone(),
            disk_uuid,
            reason: cut(reason, MAX_REASON),
            at: now(),
        };
        self.revoked.push(revocation.clone());
        Ok(revocation)
    }

    /// Puts `ek` on the revocation list for `reason`, under the name its
    /// record here holds, or no name where none does (no disk either way);
    /// returns the revocation (the existing one if it was revoked).
    pub fn revoke_ek(&mut self, ek: &EkDigest, reason: &str) -> Result<Revocation, RegistryError> {
        let record = self
            .nodes
            .get(&ek.to_string())
            .cloned()
            .unwrap_or_else(|| NodeRecord::named_by_ek(ek));
        self.revoke(&record, None, reason)
    }

    /// This registry as another control plane served it at `served_at`
    /// (Unix seconds, on its clock) when this one had asked for it at
    /// `asked_at` (this clock), its node records' times moved to this
    /// clock: `served_at` becomes `asked_at`. Two control planes' clocks
    /// differ, and a host can set one apart on purpose (within the skew
    /// allowed, gradually enough to pass as no jump). Compared as they
    /// are, the news of a peer whose clock runs behind would not count
    /// here until its time passed this clock's last time for the node,
    /// and the node could fall silent here though it reports to the peer
    /// every interval; a peer's clock ahead would let its stale record,
    /// silent even, replace this one's fresh one.
    ///
    /// The request's time, not the answer's: the registry was served after
    /// it was asked for, so its records come out at most as old as they
    /// are plus the call's duration, never newer. A host that delays the
    /// calls can only age them (by at most the call's timeout); were they
    /// dated from the answer, a record passed back and forth between two
    /// control planes through delayed calls would grow newer with every
    /// pass, and a node that stopped would never fall silent.
    ///
    /// Clocks further apart than [`MAX_CLOCK_SKEW`] are not moved by part
    /// of the gap (around three control planes, moves cut short would no
    /// longer sum to an ageing, and records passed around would grow newer
    /// each time): the registry is reduced to its revocations and the
    /// names its records hold ([`Registry::names_only`], dated
    /// `asked_at`); the second value says so, and the caller then takes it
    /// as no view of the nodes. 0 (a control plane of an earlier version
    /// sends no time) moves nothing.
    pub fn on_this_clock(mut self, served_at: u64, asked_at: u64) -> (Self, ClockGap) {
        if served_at == 0 {
            return (self, ClockGap::Within);
        }
        let offset = i128::from(asked_at) - i128::from(served_at);
        if offset.unsigned_abs() > u128::from(MAX_CLOCK_SKEW.as_secs()) {
            let apart = i64::try_from(offset).unwrap_or(i64::MAX);
            return (self.names_only(asked_at), ClockGap::Apart(apart));
        }
        let moved = |t: u64| u64::try_from((i128::from(t) + offset).max(0)).unwrap_or(u64::MAX);
        for record in self.nodes.values_mut() {
            record.registered_at = moved(record.registered_at);
            record.verdict_at = moved(record.verdict_at);
            record.last_evidence_at = record.last_evidence_at.map(moved);
        }
        (self, ClockGap::Within)
    }

    /// Takes in another control plane's registry: its revocations join
    /// this list (each one no revocation here covers: another EK, or
    /// another disk of a revoked EK), as many as the list holds, and each
    /// node record it has with newer evidence (or that
    /// this one lacks) replaces this one's, unless it is dated more than
    /// [`MAX_CLOCK_SKEW`] ahead of this clock (then it is taken only if
    /// this one lacks it, dated now).
    pub fn merge(&mut self, other: Self) -> Merged {
        self.merge_holding_drift(other, Duration::ZERO)
    }

    /// [`Registry::merge`], where a drift here stands for at least
    /// `stands` (as in [`Registry::record_holding_drift`]): a peer's newer
    /// record that is not a drift does not replace it, so a node that
    /// drifted before one control plane and then, after a TPM reset, sent
    /// trusted evidence to another is still judged here.
    pub fn merge_holding_drift(&mut self, other: Self, stands: Duration) -> Merged {
        let at = now();
        let mut merged = Merged::default();
        let mut covered = Covered::of(&self.revoked);
        for revocation in other.revoked {
            if covered.covers(&revocation) {
                continue;
            }
            if self.revoked.len() >= MERGED_REVOCATIONS {
                merged.dropped += 1;
                continue;
            }
            covered.add(&revocation);
            self.revoked.push(revocation);
            merged.added += 1;
        }
        // A record dated ahead of this clock (by more than the skew two
        // control planes may have) would win every later merge and never
        // fall silent here: it does not replace a record. One this registry
        // lacks is taken dated now, so that its EK and name are held here
        // all the same (a clock set back must not free a member's name).
        // One with newer evidence than this registry's still counts as the
        // node heard by a peer, now, once per evidence time (as a record
        // dated within the skew would, once taken): a clock set back must
        // not make the nodes only the peers hear look silent here either.
        // Not a record the peer calls silent, nor one of a drift standing
        // here.
        let latest = now().saturating_add(MAX_CLOCK_SKEW.as_secs());
        for (key, mut theirs) in other.nodes {
            if key == theirs.ek {
                self.take_identity(&key, &theirs, at);
            }
            let dated = [
                Some(theirs.registered_at),
                Some(theirs.verdict_at),
                theirs.last_evidence_at,
            ];
            if dated.into_iter().flatten().any(|t| t > latest) {
                if let Some(ours) = self.nodes.get(&key) {
                    let evidence = theirs.last_evidence_at.unwrap_or(0);
                    let news = self
                        .heard_ahead
                        .get(&key)
                        .is_none_or(|&seen| evidence > seen);
                    if key == theirs.ek
                        && news
                        && theirs.verdict != Verdict::Silent
                        && theirs.last_evidence_at > ours.last_evidence_at
                        && !ours.drift_stands(at, stands)
                    {
                        self.heard_from_peers.insert(key.clone(), at);
                        self.heard_ahead.insert(key, evidence);
                    }
                    continue;
                }
                theirs.registered_at = theirs.registered_at.min(at);
                theirs.last_evidence_at = theirs.last_evidence_at.map(|t| t.min(at));
            }
            let newer = match self.nodes.get(&key) {
                Some(ours) => {
                    let drift_stands =
                        theirs.verdict != Verdict::Drifted && ours.drift_stands(at, stands);
                    theirs.last_evidence_at > ours.last_evidence_at && !drift_stands
                }
                None => self.nodes.len() < MAX_NODES,
            };
            if newer && key == theirs.ek {
                // A verdict new here counts from now on this clock: a
                // peer's drift must hold an interval here too before this
                // control plane's policy acts on it. One this control plane
                // holds already keeps its time here: a peer's later time
                // for it would push back its hold and its stand.
                // A drift here on the clock that a peer holds for the
                // node's own reason is new here in what counts.
                theirs.verdict_at = match self.nodes.get(&key) {
                    Some(ours)
                        if ours.verdict == theirs.verdict
                            && (theirs.on_clock || !ours.on_clock) =>
                    {
                        ours.verdict_at
                    }
                    _ => now(),
                };
                // Counted from when it was taken here, but never more than
                // the skew past the peer's own time: a record a peer held
                // back (say, through a partition) buys no more than that.
                let heard = at.min(
                    theirs
                        .last_evidence_at
                        .unwrap_or(theirs.registered_at)
                        .saturating_add(MAX_CLOCK_SKEW.as_secs()),
                );
                // The name, role and other names recorded here stay
                // ([`Registry::take_identity`] took the peer's): a blank in
                // the peer's record would free the name for another node,
                // another name would free this one; and a node held under
                // two names stays drifted, whatever the peer's verdict.
                if let Some(ours) = self.nodes.get(&key) {
                    theirs.name.clone_from(&ours.name);
                    theirs.role.clone_from(&ours.role);
                    theirs.other_names.clone_from(&ours.other_names);
                    // A drift here for another reason than the clock
                    // stays one: a peer's drift on its clock keeps this
                    // one's reason (as a drift of the node's own would).
                    if theirs.on_clock && ours.verdict == Verdict::Drifted && !ours.on_clock {
                        theirs.on_clock = false;
                        theirs.reason.clone_from(&ours.reason);
                    }
                    if let Some(reason) = ours.other_names_reason() {
                        if theirs.verdict != Verdict::Drifted {
                            theirs.verdict = Verdict::Drifted;
                            theirs.verdict_at = ours.verdict_at;
                        }
                        theirs.reason = Some(reason);
                        theirs.on_clock = false;
                    }
                }
                self.changed.insert(key.clone());
                self.heard_from_peers.insert(key.clone(), heard);
                self.nodes.insert(key, theirs);
                merged.taken += 1;
            }
        }
        merged
    }

    /// Takes the identity a peer's record `theirs` holds for the node of
    /// `key` where this registry has a record of it, whatever the record's
    /// age: a name or role where this record has none, and a name other
    /// than this record's as one of its other names. A node held under
    /// two names (its host renamed it and a control plane that did not
    /// know it admitted it) is marked drifted at `at`: both names stay
    /// held here, for the node alone, until the operator revokes it.
    fn take_identity(&mut self, key: &str, theirs: &NodeRecord, at: u64) {
        let Some(ours) = self.nodes.get_mut(key) else {
            return;
        };
        let mut changed = false;
        for (field, offered) in [
            (&mut ours.name, &theirs.name),
            (&mut ours.role, &theirs.role),
        ] {
            if field.is_empty() && !offered.is_empty() {
                field.clone_from(offered);
                changed = true;
            }
        }
        if ours.take_other_names(theirs) {
            if ours.verdict != Verdict::Drifted {
                ours.verdict = Verdict::Drifted;
                ours.verdict_at = at;
            }
            ours.reason = ours.other_names_reason();
            tracing::warn!(
                node = %ours.name.escape_debug(),
                ek = %ours.ek,
                other_names = ?ours.other_names,
                "control planes hold one node under two names (its host renamed it): both are held for it; revoke it"
            );
            changed = true;
        }
        if changed {
            self.changed.insert(key.to_owned());
        }
    }

    /// The EKs on the revocation list.
    fn revoked_eks(&self) -> HashSet<String> {
        self.revoked.iter().map(|r| r.ek.clone()).collect()
    }

    /// Replays one journal record; `revoked` is what the revocation list
    /// covers.
    fn apply(&mut self, change: Change, revoked: &mut Covered) -> Result<(), RegistryError> {
        match change {
            // Entries this code never writes are skipped (see
            // `parse_stored`).
            Change::Node(record) if !well_formed_node(&record.ek, &record) => {}
            Change::Revoked(revocation) if !well_formed_revocation(&revocation) => {}
            Change::Node(mut record) => {
                record.cut_fields();
                if !self.nodes.contains_key(&record.ek) && self.nodes.len() >= MAX_NODES {
                    return Err(RegistryError::Invalid("journal: too many nodes".into()));
                }
                self.nodes.insert(record.ek.clone(), record);
            }
            Change::Revoked(mut revocation) => {
                revocation.cut_fields();
                if !revoked.covers(&revocation) {
                    if self.revoked.len() >= MAX_REVOCATIONS {
                        return Err(RegistryError::Invalid(
                            "journal: too many revocations".into(),
                        ));
                    }
                    revoked.add(&revocation);
                    self.revoked.push(revocation);
                }
            }
        }
        Ok(())
    }

    /// Reads the snapshot at `path` (none: empty) and replays the journal
    /// `records` over it.
    fn restore(path: &Path, records: Vec<Change>) -> Result<Self, RegistryError> {
        let mut registry = match keel_verifier::bounded::read(path, MAX_REGISTRY_BYTES as u64) {
            Ok(Some(bytes)) => Registry::parse_stored(&bytes)?,
            Ok(None) => return Err(too_large()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Registry::default(),
            Err(source) => {
                return Err(RegistryError::Read {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let mut revoked = Covered::of(&registry.revoked);
        for change in records {
            registry.apply(change, &mut revoked)?;
        }
        registry.changed.clear();
        Ok(registry)
    }

    /// The registry a restart would load from the snapshot at `path` and
    /// its journal, read without opening a store.
    pub fn on_disk(path: &Path) -> Result<Self, RegistryError> {
        Self::restore(
            path,
            journal::read(&journal::beside(path), MAX_JOURNAL_BYTES)?,
        )
    }
}

/// "; N more not recorded", or nothing for none.
fn not_recorded(dropped: usize) -> String {
    match dropped {
        0 => String::new(),
        n => format!("; {n} more not recorded"),
    }
}

/// How far a peer's clock was from this one's when it served its registry
/// ([`Registry::on_this_clock`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockGap {
    /// Within [`MAX_CLOCK_SKEW`] (or not known): its records were moved to
    /// this clock.
    Within,
    /// Further apart, by this many seconds (this clock minus the peer's):
    /// only its revocations were kept.
    Apart(i64),
}

/// What [`Registry::merge`] took from another registry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Merged {
    /// Revocations new to this list.
    pub added: usize,
    /// Node records taken.
    pub taken: usize,
    /// New revocations left out because the list is full.
    pub dropped: usize,
}

/// How a registry's unrevoked nodes stand ([`Registry::standing`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Standing {
    /// Nodes no revocation covers.
    pub unrevoked: usize,
    /// Of those, the drifted ones, but drifts that rest on the clock.
    pub drifted: usize,
    /// Of those, the silent ones.
    pub silent: usize,
    /// Of those, the control planes other than this one.
    pub peers: usize,
}

impl Standing {
    /// Whether `failing` nodes (drifted, or silent) are more than the
    /// `revoke` policy acts on alone: two or more, and more than half of
    /// the unrevoked ones. That many at once is likelier a fault of this
    /// control plane's view or inputs (a partition, stale CPU collateral,
    /// wrong measurements) than that many nodes compromised together.
    pub fn too_many(&self, failing: usize) -> bool {
        failing >= 2 && failing * 2 > self.unrevoked
    }
}

/// What a revocation list covers, to add to it without a scan per
/// revocation (quadratic in a list that may hold MAX_REVOCATIONS: 0.8 s
/// under the registry's lock to merge a full list).
struct Covered {
    /// Revoked EKs.
    eks: HashSet<String>,
    /// Revoked EKs with a disk, the disk UUID in lower case.
    disks: HashSet<(String, String)>,
}

impl Covered {
    fn of(revoked: &[Revocation]) -> Self {
        let mut covered = Self {
            eks: HashSet::with_capacity(revoked.len()),
            disks: HashSet::with_capacity(revoked.len()),
        };
        for revocation in revoked {
            covered.add(revocation);
        }
        covered
    }

    fn add(&mut self, revocation: &Revocation) {
        self.eks.insert(revocation.ek.clone());
        if !revocation.disk_uuid.is_empty() {
            self.disks.insert((
                revocation.ek.clone(),
                revocation.disk_uuid.to_ascii_lowercase(),
            ));
        }
    }

    /// Whether a revocation here already revokes all `revocation` does:
    /// its EK, and its disk if it names one.
    fn covers(&self, revocation: &Revocation) -> bool {
        if revocation.disk_uuid.is_empty() {
            self.eks.contains(&revocation.ek)
        } else {
            self.disks.contains(&(
                revocation.ek.clone(),
                revocation.disk_uuid.to_ascii_lowercase(),
            ))
        }
    }
}

/// The registry's files as the writer sees them.
struct Disk {
    /// Open once the first write needs it.
    journal: Option<Journal>,
    /// Revocations the snapshot and the journal hold.
    revoked_written: usize,
    /// Size of the snapshot last written or read.
    snapshot_bytes: u64,
    /// Size of the journal when the store was loaded, until it is opened:
    /// the first write after a restart folds a journal already due.
    unopened_journal_bytes: u64,
}

/// What one write takes from the registry, under its lock.
struct Round {
    /// The keys it writes (given back if the write fails).
    keys: BTreeSet<String>,
    /// The registry for a new snapshot, if the journal is to be folded
    /// into one: copied under the registry's lock, encoded after it.
    snapshot: Option<Box<Registry>>,
    /// The records of what changed (appended, and before a fold too).
    records: Vec<Change>,
    /// How many revocations the registry holds.
    revoked: usize,
}

impl Disk {
    fn take(&self, registry: &mut Registry) -> Round {
        let keys = std::mem::take(&mut registry.changed);
        let revoked = registry.revoked.len();
        let journal_bytes = self
            .journal
            .as_ref()
            .map_or(self.unopened_journal_bytes, Journal::len);
        let outgrown = journal::outgrown(journal_bytes, self.snapshot_bytes, COMPACT_AT_LEAST);
        let mut records: Vec<Change> = keys
            .iter()
            .filter_map(|k| registry.nodes.get(k).cloned().map(Change::Node))
            .collect();
        records.extend(
            registry
                .revoked
                .get(self.revoked_written..)
                .unwrap_or_default()
                .iter()
                .cloned()
                .map(Change::Revoked),
        );
        Round {
            keys,
            snapshot: outgrown.then(|| Box::new(registry.clone())),
            records,
            revoked,
        }
    }

    /// Makes `round` durable: its records appended, or the journal folded
    /// into its snapshot ([`Journal::fold`]).
    fn write(&mut self, path: &Path, round: &Round) -> Result<(), RegistryError> {
        let journal = journal::opened::<Change>(&mut self.journal, path, MAX_JOURNAL_BYTES)?;
        match &round.snapshot {
            Some(snapshot) => {
                let json = snapshot.to_json();
                let folded = journal.fold(&round.records, || {
                    crate::files::write_private(path, &json).map_err(RegistryError::from)
                })?;
                if folded {
                    self.snapshot_bytes = json.len() as u64;
                }
            }
            None => journal.append(&round.records)?,
        }
        self.revoked_written = round.revoked;
        Ok(())
    }
}

/// A registry on disk, changed under one lock; each change is on disk when
/// the call that made it returns.
pub struct RegistryStore {
    path: PathBuf,
    registry: Arc<Mutex<Registry>>,
    /// Writes of the registry as it is when each write starts.
    writes: Batcher<(), (), RegistryError>,
    /// When each other control plane's registry was last merged (Unix s),
    /// by its EK (`sha256:` and hex): one entry per control plane this one
    /// pulls from, so bounded by the registry's nodes.
    merged_at: Mutex<HashMap<String, u64>>,
}

impl std::fmt::Debug for RegistryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Most changes one write makes durable.
const MAX_CHANGES_PER_WRITE: usize = 1024;

/// The stores open in this process, by file.
static OPEN: OnceLock<Mutex<HashMap<PathBuf, Weak<RegistryStore>>>> = OnceLock::new();

impl RegistryStore {
    /// The store of the control plane whose node root is `root`
    /// ([`paths::NODE_REGISTRY`] under it), loaded on first use: one per
    /// file and process, so every service of a control plane sees the
    /// same list. A file that exists but does not load is an error (the
    /// revocations in it must not be forgotten).
    pub fn shared(root: &Path) -> Result<Arc<Self>, RegistryError> {
        let path = root.join(paths::NODE_REGISTRY);
        let mut open = OPEN
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(store) = open.get(&path).and_then(Weak::upgrade) {
            return Ok(store);
        }
        let store = Arc::new(Self::load(path.clone())?);
        open.retain(|_, weak| weak.strong_count() > 0);
        open.insert(path, Arc::downgrade(&store));
        Ok(store)
    }

    fn load(path: PathBuf) -> Result<Self, RegistryError> {
        let registry = Registry::on_disk(&path)?;
        let disk = Mutex::new(Disk {
            journal: None,
            revoked_written: registry.revoked.len(),
            snapshot_bytes: std::fs::metadata(&path).map_or(0, |m| m.len()),
            unopened_journal_bytes: std::fs::metadata(journal::beside(&path))
                .map_or(0, |m| m.len()),
        });
        let registry = Arc::new(Mutex::new(registry));
        let writes = {
            let (path, registry) = (path.clone(), registry.clone());
            Batcher::new(MAX_CHANGES_PER_WRITE, move |changes: Vec<()>| {
                let mut disk = disk.lock().unwrap_or_else(PoisonError::into_inner);
                let round = disk.take(&mut lock(&registry));
                let _span = tracing::debug_span!(
                    "registry.write",
                    changes = changes.len(),
                    records = round.records.len(),
                    snapshot = round.snapshot.is_some()
                )
                .entered();
                match disk.write(&path, &round) {
                    Ok(()) => Ok(changes),
                    Err(e) => {
                        // Still in effect here: the next write carries them.
                        lock(&registry).changed.extend(round.keys);
                        Err(e)
                    }
                }
            })
        };
        Ok(Self {
            path,
            registry,
            writes,
            merged_at: Mutex::new(HashMap::new()),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A copy of the registry.
    pub fn snapshot(&self) -> Registry {
        self.lock().clone()
    }

    /// A copy of the revocations alone ([`Registry::revocations_only`]).
    pub fn revocations(&self) -> Registry {
        self.lock().revocations_only()
    }

    /// A copy of the record `selector` names, if exactly one
    /// ([`Registry::find`]).
    pub fn snapshot_of(&self, selector: &str) -> Option<NodeRecord> {
        self.lock().find(selector).ok().cloned()
    }

    /// The revocation of `ek`, if any ([`Registry::revocation`]).
    pub fn revocation(&self, ek: &EkDigest) -> Option<Revocation> {
        self.lock().revocation(ek).cloned()
    }

    /// [`Registry::check_identity`].
    pub fn check_identity(
        &self,
        ek: &EkDigest,
        name: &str,
        role: &str,
    ) -> Result<(), RegistryError> {
        self.lock().check_identity(ek, name, role)
    }

    /// [`Registry::check_disk`].
    pub fn check_disk(&self, ek: &EkDigest, disk_uuid: &str) -> Result<(), RegistryError> {
        self.lock().check_disk(ek, disk_uuid)
    }

    /// [`Registry::failing_unrevoked`].
    pub fn failing_unrevoked(&self, own: &EkDigest) -> Vec<NodeRecord> {
        self.lock().failing_unrevoked(own)
    }

    /// Applies `change` and, if it succeeded, writes the registry; blocks on
    /// the file system. `change` must leave the registry as it found it
    /// when it fails, as every [`Registry`] method does. A failed write
    /// fails every change it carried; those changes stay in effect here
    /// and reach the disk with the next write.
    pub fn update<T>(
        &self,
        change: impl FnOnce(&mut Registry) -> Result<T, RegistryError>,
    ) -> Result<T, RegistryError> {
        let out = change(&mut self.lock())?;
        self.write()?;
        Ok(out)
    }

    /// Takes in another control plane's registry ([`Registry::merge`]);
    /// writes only if anything changed. Returns how many revocations were
    /// new; [`RegistryError::RevocationsFull`] (once what fits is written)
    /// if some did not fit.
    pub fn merge(&self, theirs: Registry) -> Result<usize, RegistryError> {
        self.merge_holding_drift(theirs, Duration::ZERO, None)
            .map(|merged| merged.added)
    }

    /// [`RegistryStore::merge`] with [`Registry::merge_holding_drift`];
    /// nothing is taken if this registry revokes `from`, the control plane
    /// that served `theirs` (checked under the same lock as the merge).
    /// Returns what it took.
    fn merge_holding_drift(
        &self,
        theirs: Registry,
        stands: Duration,
        from: Option<&EkDigest>,
    ) -> Result<Merged, RegistryError> {
        let merged = {
            let mut registry = self.lock();
            if from.is_some_and(|peer| registry.revocation(peer).is_some()) {
                return Err(RegistryError::PeerRevoked);
            }
            registry.merge_holding_drift(theirs, stands)
        };
        if merged.dropped > 0 {
            tracing::error!(
                added = merged.added,
                taken = merged.taken,
                dropped = merged.dropped,
                "merged what the revocation list holds; it is full"
            );
        }
        if merged.added + merged.taken > 0 {
            self.write()?;
        }
        if merged.dropped > 0 {
            return Err(RegistryError::RevocationsFull {
                dropped: merged.dropped,
            });
        }
        Ok(merged)
    }

    /// [`RegistryStore::merge`] of the registry the control plane of the
    /// EK `from` serves now, noting when ([`RegistryStore::merged_at`]):
    /// its node records are a current view of the nodes it hears. A drift
    /// here stands against the peer's records for `drift_stands`
    /// ([`Registry::merge_holding_drift`]). A control plane this registry
    /// revokes gets nothing merged and does not count as heard
    /// ([`RegistryError::PeerRevoked`]): revoking a compromised control
    /// plane ends what its registry can do to this one (fill its lists,
    /// re-date its nodes' verdicts).
    pub fn merge_from_peer(
        &self,
        theirs: Registry,
        drift_stands: Duration,
        from: &EkDigest,
    ) -> Result<usize, RegistryError> {
        self.merge_from_peer_noting(theirs, drift_stands, from, true)
    }

    /// [`RegistryStore::merge_from_peer`] of the registry a control-plane
    /// ticket carried from the control plane of the EK `from`: refused if
    /// this registry revokes it (a revoked control plane a host routes a
    /// rejoin to must not fill the lists or re-date the verdicts), not
    /// noted as a current view of the nodes. Returns what it took.
    pub fn merge_from_ticket(
        &self,
        theirs: Registry,
        drift_stands: Duration,
        from: &EkDigest,
    ) -> Result<Merged, RegistryError> {
        self.merge_holding_drift(theirs, drift_stands, Some(from))
    }

    /// [`RegistryStore::merge_from_peer`] of what a control plane serves
    /// one it revokes: its revocation list alone, which is no view of the
    /// nodes, so the merge is not noted as one ([`RegistryStore::merged_at`]).
    pub fn merge_revocations_from_peer(
        &self,
        theirs: Registry,
        drift_stands: Duration,
        from: &EkDigest,
    ) -> Result<usize, RegistryError> {
        self.merge_from_peer_noting(theirs, drift_stands, from, false)
    }

    fn merge_from_peer_noting(
        &self,
        theirs: Registry,
        drift_stands: Duration,
        from: &EkDigest,
        note: bool,
    ) -> Result<usize, RegistryError> {
        let merged = self
            .merge_holding_drift(theirs, drift_stands, Some(from))
            .map(|merged| merged.added);
        if !note || matches!(merged, Err(RegistryError::PeerRevoked)) {
            return merged;
        }
        self.merged_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(from.to_string(), now());
        merged
    }

    /// When another control plane's registry was last merged here by
    /// [`RegistryStore::merge_from_peer`] (Unix seconds), if ever since
    /// this process started.
    pub fn merged_at(&self) -> Option<u64> {
        self.merged_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .copied()
            .max()
    }

    /// Whether this control plane's view of the nodes is current at `now`,
    /// for judging silence: with other control planes (unrevoked ones other
    /// than `own`), a registry of one of them merged within `grace` before
    /// `now` (not after: a clock set back since), and of
    /// every one of them this control plane does not itself hold silent. A
    /// host that lets a peer's evidence reach this control plane but not
    /// its registry pulls must not make the nodes only that peer hears look
    /// silent here, whatever the other peers' registries say; a peer gone
    /// silent (down, cut off) holds nobody back once it is marked so.
    pub fn view_current(&self, own: &EkDigest, now: u64, grace: Duration) -> bool {
        let merged = self
            .merged_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        // A merge after `now` is no view: the clock went back since (its
        // host set it back), and what was merged then says nothing of the
        // nodes now.
        let recent = |ek: &str| {
            merged
                .get(ek)
                .is_some_and(|&at| at <= now && now - at <= grace.as_secs())
        };
        let registry = self.lock();
        let revoked = registry.revoked_eks();
        let own = own.to_string();
        let peers: Vec<&NodeRecord> = registry
            .nodes
            .values()
            .filter(|r| r.role == "control-plane" && r.ek != own && !revoked.contains(&r.ek))
            .collect();
        peers.is_empty()
            || (peers.iter().any(|r| recent(&r.ek))
                && peers
                    .iter()
                    .filter(|r| r.verdict != Verdict::Silent)
                    .all(|r| recent(&r.ek)))
    }

    /// Marks silent the nodes [`Registry::mark_silent`] finds; writes only
    /// if it found any. Returns them, and how the write went: they are
    /// marked here either way (a failed write's changes go with the next
    /// one), so they are reported either way.
    pub fn mark_silent(
        &self,
        now: u64,
        grace: Duration,
        since: u64,
        own: &EkDigest,
    ) -> (Vec<NodeRecord>, Result<(), RegistryError>) {
        let marked = self.lock().mark_silent(now, grace, since, own);
        let written = if marked.is_empty() {
            Ok(())
        } else {
            self.write()
        };
        (marked, written)
    }

    /// Writes the registry as it is now, with every change that comes
    /// before the write starts.
    fn write(&self) -> Result<(), RegistryError> {
        self.writes
            .submit(())
            .map_err(|e| e.into_cause(RegistryError::Shared, RegistryError::Task))
    }

    /// How many writes made how many changes durable.
    pub fn write_stats(&self) -> crate::batching::BatchStats {
        self.writes.stats()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        lock(&self.registry)
    }
}

fn lock(registry: &Mutex<Registry>) -> std::sync::MutexGuard<'_, Registry> {
    // Every change leaves the registry whole or as it was (see `update`).
    registry.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ek(n: u8) -> EkDigest {
        EkDigest::from_hex(&hex::encode([n; 32])).unwrap()
    }

    /// Disk `n`, bound to EK `n`.
    fn bound(n: u8) -> BoundDisk {
        BoundDisk {
            ek: ek(n),
            uuid: format!("0000000{n}-0000-4000-8000-000000000000"),
        }
    }

    fn evidence(n: u8, failure: Option<&str>) -> Evidence {
        Evidence {
            ek: ek(n),
            disk: Some(bound(n)),
            name: format!("w-{n}"),
            role: "worker".into(),
            kubernetes_version: "v1.31.13".into(),
            measurements: "ab".into(),
            failure: failure.map(str::to_owned),
            failure_on_clock: false,
        }
    }

    /// The host writes the node part of a member's config. Renamed and
    /// rebooted, the member must not get a ticket under its new name (its
    /// old one, whose kubelet certificate it keeps, would be free for a
    /// second TPM), nor free its name by evidence under the new one, nor
    /// through a peer's record; nor take another role.
    #[test]
    fn a_node_keeps_the_name_and_role_it_joined_with() {
        let mut r = Registry::default();
        r.register(&ek(1), "", "w-1", "worker").unwrap();
        for (name, role) in [("w-2", "worker"), ("w-1", "control-plane")] {
            match r.register(&ek(1), "", name, role) {
                Err(RegistryError::Renamed { held, asked }) => {
                    assert_eq!(held, "w-1 (worker)");
                    assert_eq!(asked, format!("{name} ({role})"));
                }
                other => panic!("{name} ({role}): {other:?}"),
            }
        }
        let holds = |r: &Registry| {
            let record = &r.nodes()[&ek(1).to_string()];
            assert_eq!(
                (record.name.as_str(), record.role.as_str()),
                ("w-1", "worker")
            );
            assert!(matches!(
                r.check_identity(&ek(2), "w-1", "worker"),
                Err(RegistryError::NameTaken { .. })
            ));
            assert!(r.check_identity(&ek(2), "w-2", "worker").is_ok());
        };
        holds(&r);
        // Its evidence under the new name drifts, and the name stays.
        let renamed = Evidence {
            name: "w-2".into(),
            ..evidence(1, None)
        };
        r.record(&renamed).unwrap();
        holds(&r);
        let record = &r.nodes()[&ek(1).to_string()];
        assert_eq!(record.verdict, Verdict::Drifted);
        assert_eq!(
            record.reason.as_deref(),
            Some("its evidence names it w-2 (worker); it joined as w-1 (worker)")
        );
        // Its evidence under its own name is trusted again.
        r.record(&evidence(1, None)).unwrap();
        assert_eq!(r.nodes()[&ek(1).to_string()].verdict, Verdict::Trusted);
    }

    /// The host renames a member and sends its rejoin to a control plane
    /// cut off from the one that admitted it, which has no record of it
    /// and admits it under the new name. Once their registries meet, each
    /// holds both names for it (no second TPM gets either, on either
    /// side) and judges it drifted, whatever verdict the other sends, and
    /// whatever its own evidence says, until the operator revokes it.
    #[test]
    fn a_node_two_control_planes_hold_under_two_names_holds_both_and_drifts() {
        let (mut a, mut b) = (Registry::default(), Registry::default());
        a.register(&ek(1), "", "w-1", "worker").unwrap();
        b.register(&ek(1), "", "w-9", "worker").unwrap();
        let renamed = Evidence {
            name: "w-9".into(),
            ..evidence(1, None)
        };
        b.record(&renamed).unwrap();
        assert_eq!(b.nodes()[&ek(1).to_string()].verdict, Verdict::Trusted);
        // A newer trusted record from each side.
        let newer = |r: &Registry| {
            let mut copy = r.clone();
            copy.nodes
                .get_mut(&ek(1).to_string())
                .unwrap()
                .last_evidence_at = Some(now() + 5);
            copy
        };
        let (from_a, from_b) = (newer(&a), newer(&b));
        a.merge(from_b);
        b.merge(from_a);
        for (r, own, other) in [(&a, "w-1", "w-9"), (&b, "w-9", "w-1")] {
            let record = &r.nodes()[&ek(1).to_string()];
            assert_eq!(record.name, own);
            assert_eq!(record.other_names, [other]);
            assert_eq!(record.verdict, Verdict::Drifted, "at {own}'s side");
            assert!(
                record.reason.as_deref().unwrap().contains(other),
                "{:?}",
                record.reason
            );
            for name in ["w-1", "w-9"] {
                assert!(
                    matches!(
                        r.check_identity(&ek(2), name, "worker"),
                        Err(RegistryError::NameTaken { .. })
                    ),
                    "{name} is free at {own}'s side"
                );
            }
            // The node itself gets no ticket under the other name.
            assert!(matches!(
                r.check_identity(&ek(1), other, "worker"),
                Err(RegistryError::Renamed { .. })
            ));
        }
        // Its own evidence, trusted, leaves it drifted.
        b.record(&renamed).unwrap();
        assert_eq!(b.nodes()[&ek(1).to_string()].verdict, Verdict::Drifted);
        // A peer of an earlier version, whose newer trusted record knows
        // one name only, neither clears the drift nor drops a name.
        let mut earlier = Registry::default();
        earlier.record(&renamed).unwrap();
        let earlier = newer(&earlier);
        b.nodes
            .get_mut(&ek(1).to_string())
            .unwrap()
            .last_evidence_at = Some(now());
        assert_eq!(b.merge(earlier).taken, 1);
        let record = &b.nodes()[&ek(1).to_string()];
        assert_eq!(record.verdict, Verdict::Drifted);
        assert_eq!(record.other_names, ["w-1"]);
        // Written as stored, and read back.
        assert_eq!(Registry::parse(&b.to_json()).unwrap(), b);
        // A record without other names writes none: earlier versions,
        // which know no such field, read it.
        let mut single = Registry::default();
        single.register(&ek(3), "", "w-3", "worker").unwrap();
        let single = String::from_utf8(single.to_json()).unwrap();
        assert!(!single.contains("other_names"), "{single}");
    }

    /// Evidence without an identity (its log names none, or two) keeps
    /// the node's recorded name and role: its name stays held, and found.
    #[test]
    fn evidence_without_an_identity_keeps_the_recorded_name() {
        let mut r = Registry::default();
        r.register(&ek(1), "", "w-1", "worker").unwrap();
        let nameless = Evidence {
            name: String::new(),
            role: String::new(),
            ..evidence(1, Some("PCR 13: no single node identity"))
        };
        r.record(&nameless).unwrap();
        let record = &r.nodes()[&ek(1).to_string()];
        assert_eq!(
            (record.name.as_str(), record.role.as_str()),
            ("w-1", "worker")
        );
        assert_eq!(record.verdict, Verdict::Drifted);
        assert!(r.find("w-1").is_ok());
        assert!(r.check_name(&ek(2), "w-1").is_err(), "the name was freed");
        // Nor does a peer's newer record that lacks them (an earlier
        // version blanked it) blank them here.
        let mut peer = Registry::default();
        peer.record(&nameless).unwrap();
        let record = peer.nodes.get_mut(&ek(1).to_string()).unwrap();
        (record.name, record.role) = (String::new(), String::new());
        record.last_evidence_at = Some(now() + 5);
        assert_eq!(r.merge(peer).taken, 1);
        let record = &r.nodes()[&ek(1).to_string()];
        assert_eq!(
            (record.name.as_str(), record.role.as_str()),
            ("w-1", "worker")
        );
    }

    /// A control plane holds its own record from the moment it serves,
    /// before any evidence of its own: its sweep never marks that record
    /// silent (it would revoke itself under the `revoke` policy, and
    /// spread the verdict to its peers), while others' records go silent
    /// as before.
    #[test]
    fn a_control_planes_own_record_is_never_marked_silent_by_it() {
        let mut r = Registry::default();
        r.register(&ek(7), "", "cp-7", "control-plane").unwrap();
        r.register(&ek(8), "", "w-8", "worker").unwrap();
        let later = now() + 3600;
        let marked = r.mark_silent(later, Duration::from_secs(10), 0, &ek(7));
        let names: Vec<&str> = marked.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["w-8"]);
        assert_eq!(r.find("cp-7").unwrap().verdict, Verdict::Registered);
        // Another control plane's sweep judges it like any node.
        let marked = r.mark_silent(later, Duration::from_secs(10), 0, &ek(9));
        assert_eq!(marked.len(), 1);
        assert_eq!(marked[0].name, "cp-7");
    }

    /// Attacker's move: a member whose evidence fails only for a date (its
    /// EK certificate lapsed, or the control planes' clocks were set) stops
    /// reporting. A drift on the clock is never revoked, and once it was
    /// never marked silent either: the node kept its keys for good. It
    /// falls silent like any other; a drift for its own reason keeps its
    /// verdict and hold.
    #[test]
    fn a_node_silent_after_a_drift_on_the_clock_is_marked_silent() {
        let mut r = Registry::default();
        r.record(&Evidence {
            failure_on_clock: true,
            ..evidence(1, Some("EK certificate is not valid at this time"))
        })
        .unwrap();
        r.record(&evidence(2, Some("PCR 4"))).unwrap();
        assert!(r.nodes[&ek(1).to_string()].on_clock);
        let later = now() + 3600;
        let marked = r.mark_silent(later, Duration::from_secs(10), 0, &ek(9));
        let names: Vec<&str> = marked.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["w-1"]);
        let silent = &r.nodes[&ek(1).to_string()];
        assert_eq!(silent.verdict, Verdict::Silent);
        assert!(!silent.on_clock);
        assert_eq!(r.nodes[&ek(2).to_string()].verdict, Verdict::Drifted);
    }

    /// Nor does its policy revoke it, silent (a peer's verdict merged in)
    /// or drifted (its own evidence to itself failing): its peers do.
    #[test]
    fn a_control_plane_never_revokes_itself() {
        let mut r = Registry::default();
        r.register(&ek(7), "", "cp-7", "control-plane").unwrap();
        r.record(&Evidence {
            ek: ek(7),
            disk: None,
            name: "cp-7".into(),
            role: "control-plane".into(),
            ..evidence(7, Some("PCR 4"))
        })
        .unwrap();
        r.record(&evidence(8, Some("PCR 13"))).unwrap();
        assert_eq!(r.find("cp-7").unwrap().verdict, Verdict::Drifted);
        let failing = |own: u8| -> Vec<String> {
            r.failing_unrevoked(&ek(own))
                .into_iter()
                .map(|n| n.name)
                .collect()
        };
        assert_eq!(failing(7), ["w-8"]);
        assert_eq!(failing(9), ["cp-7", "w-8"]);
    }

    /// Attacker's move: a host boots a second VM of the cluster's image
    /// under a member's node name, to get a kubelet certificate for that
    /// member's Node. Its ticket is refused while the member is not
    /// revoked; once it is, the name is free.
    #[test]
    fn a_name_another_unrevoked_ek_holds_is_refused() {
        let mut r = Registry::default();
        r.register(&ek(1), "", "w-1", "worker").unwrap();
        // The same node again (a rejoin) keeps its name.
        r.register(&ek(1), "", "w-1", "worker").unwrap();
        match r.register(&ek(2), "", "w-1", "worker") {
            Err(RegistryError::NameTaken { name, holder }) => {
                assert_eq!(name, "w-1");
                assert_eq!(holder, ek(1).to_string());
            }
            other => panic!("{other:?}"),
        }
        assert!(
            r.find(&ek(2).to_string()).is_err(),
            "the second EK was recorded"
        );
        // Two holders already (a registry from before the rule, or peers
        // that each admitted one): each keeps its name; a third does not.
        r.enter(&ek(3), None, "w-1", "worker").unwrap();
        r.register(&ek(3), "", "w-1", "worker").unwrap();
        r.register(&ek(1), "", "w-1", "worker").unwrap();
        assert!(r.register(&ek(4), "", "w-1", "worker").is_err());
        for n in [1, 3] {
            let holder = r.find(&ek(n).to_string()).unwrap().clone();
            r.revoke(&holder, None, "replaced").unwrap();
        }
        r.register(&ek(2), "", "w-1", "worker").unwrap();
    }

    /// Attacker's move: a peer's document (or a ticket's revocation list)
    /// with entries this registry never writes: a record under another
    /// node's key, an EK digest in another form. The whole document is
    /// refused. Fields beyond their bounds (as an older version of this
    /// code stored them, or a peer sends them) are cut as this code cuts
    /// them, so an old registry still loads and a new one stays bounded.
    #[test]
    fn a_document_with_entries_this_registry_never_writes_is_refused() {
        let mut r = Registry::default();
        r.record(&evidence(1, Some("PCR 13"))).unwrap();
        let node = r.find("w-1").unwrap().clone();
        r.revoke(&node, None, "operator").unwrap();
        assert_eq!(Registry::parse(&r.to_json()).unwrap(), r);

        let mut json: serde_json::Value = serde_json::from_slice(&r.to_json()).unwrap();
        let key = ek(1).to_string();
        type Edit = fn(&mut serde_json::Value, &str);
        let cases: [(&str, Edit); 3] = [
            ("moved", |j, key| {
                let record = j["nodes"][key].take();
                j["nodes"][ek(2).to_string()] = record;
            }),
            ("EK", |j, key| {
                let record = j["nodes"][key].take();
                j["nodes"] = serde_json::json!({ "sha256:XY": record });
                j["nodes"]["sha256:XY"]["ek"] = "sha256:XY".into();
            }),
            ("revoked EK", |j, _| j["revoked"][0]["ek"] = "junk".into()),
        ];
        for (what, change) in cases {
            let mut bad = json.clone();
            change(&mut bad, &key);
            let bytes = serde_json::to_vec(&bad).unwrap();
            assert!(
                matches!(Registry::parse(&bytes), Err(RegistryError::Invalid(_))),
                "{what}"
            );
        }
        // An older registry: pretty JSON, a 512-character reason, a long
        // name with control characters. It loads, cut to the bounds.
        json["nodes"][&key]["reason"] = "é".repeat(512).into();
        json["revoked"][0]["name"] = format!("n\u{1b}{}", "n".repeat(100)).into();
        let old = serde_json::to_vec_pretty(&json).unwrap();
        let loaded = Registry::parse(&old).unwrap();
        let reason = loaded.nodes[&key].reason.clone().unwrap();
        assert_eq!(reason, "é".repeat(MAX_REASON / 2));
        assert_eq!(
            loaded.revoked[0].name,
            format!("n?{}", "n".repeat(MAX_FIELD - 2))
        );
    }

    /// Attacker's move: a peer dates a node's record far ahead, so that it
    /// wins every later merge and the node never falls silent; or the host
    /// sets this control plane's clock back, so that every live record a
    /// peer (or a ticket) brings is "ahead" and a second TPM gets a ticket
    /// under a name this registry then lacks. A record dated ahead does not
    /// replace one held here; one this registry lacks is taken, dated now.
    #[test]
    fn a_record_dated_ahead_of_this_clock_replaces_nothing_and_holds_its_name() {
        let ahead = now() + MAX_CLOCK_SKEW.as_secs() + 60;
        let peer = || {
            let mut peer = Registry::default();
            peer.record(&evidence(1, None)).unwrap();
            peer.record(&evidence(2, None)).unwrap();
            let record = peer.nodes.get_mut(&ek(1).to_string()).unwrap();
            record.last_evidence_at = Some(ahead);
            record.registered_at = ahead;
            peer.nodes
                .get_mut(&ek(2).to_string())
                .unwrap()
                .last_evidence_at = Some(now() + 60);
            peer
        };
        let mut ours = Registry::default();
        let merged = ours.merge(peer());
        assert_eq!((merged.added, merged.taken), (0, 2));
        let taken = ours.find("w-1").unwrap();
        let dated = [Some(taken.registered_at), taken.last_evidence_at];
        assert!(dated.into_iter().flatten().all(|t| t <= now()), "{taken:?}");
        assert!(ours.check_name(&ek(9), "w-1").is_err(), "the name is held");
        assert!(ours.find("w-2").is_ok());
        // Held here now, it is not replaced by the record dated ahead, but
        // counts as heard by a peer: it does not fall silent here while
        // the peer hears it.
        let before = ours.find("w-1").unwrap().clone();
        ours.heard_from_peers.clear();
        ours.merge(peer());
        assert_eq!(ours.find("w-1").unwrap(), &before);
        let key = ek(1).to_string();
        assert!(ours
            .heard_from_peers
            .get(&key)
            .is_some_and(|&t| t + 5 >= now()));
        // The same record again counts no more: a peer serving one record
        // dated ahead does not keep the node heard for good.
        ours.heard_from_peers.clear();
        ours.merge(peer());
        assert!(!ours.heard_from_peers.contains_key(&key));
        // Nor does one the peer itself calls silent.
        let mut silent = peer();
        let record = silent.nodes.get_mut(&key).unwrap();
        record.last_evidence_at = Some(ahead + 60);
        record.verdict = Verdict::Silent;
        ours.merge(silent);
        assert!(!ours.heard_from_peers.contains_key(&key));
    }

    /// A host steps this control plane's clock back a day: a trusted node
    /// that stops reporting is silent a grace after the step, and a drift
    /// is held from the step, not from times the clock reaches a day on.
    #[test]
    fn a_clock_stepped_back_counts_silence_and_drift_from_the_step() {
        let grace = Duration::from_secs(180);
        let mut r = Registry::default();
        r.record(&evidence(1, None)).unwrap();
        r.record(&evidence(2, None)).unwrap();
        r.record(&evidence(2, Some("PCR 13"))).unwrap();
        let back = now() - 86_400;
        assert!(r.mark_silent(back, grace, 0, &ek(0)).is_empty());
        assert!(r.nodes.values().all(|n| n.verdict_at <= back
            && n.registered_at <= back
            && n.last_evidence_at.is_some_and(|at| at <= back)));
        let marked = r.mark_silent(back + 181, grace, 0, &ek(0));
        assert_eq!(marked.len(), 1);
        assert_eq!(marked[0].name, "w-1");
        let drifted = r.find("w-2").unwrap();
        assert_eq!(drifted.verdict, Verdict::Drifted);
        assert_eq!(drifted.verdict_at, back);
        // Evidence recorded while a sweep that read the clock first waited
        // for the registry is a second or so ahead: not moved.
        let mut waited = Registry::default();
        waited.record(&evidence(3, None)).unwrap();
        let sweep = now() - 2;
        let before = waited.find("w-3").unwrap().clone();
        assert_eq!(waited.times_not_after(sweep), 0);
        assert_eq!(*waited.find("w-3").unwrap(), before);
    }

    /// Attacker's move: partition a node from this control plane only,
    /// while the peer that still hears it has a clock behind this one's
    /// (within the skew control planes may have), so that its records make
    /// the node look quiet here and this control plane marks it silent
    /// (and under `revoke`, revokes it everywhere). A record taken from a
    /// peer counts as heard when it was taken; once no newer one comes,
    /// the node falls silent as before.
    #[test]
    fn a_peer_clock_behind_this_one_does_not_make_its_nodes_silent() {
        let grace = Duration::from_secs(180);
        let mut ours = Registry::default();
        for round in 1..=3 {
            let mut peer = Registry::default();
            peer.record(&evidence(1, None)).unwrap();
            // The peer's clock runs 250 s behind this one's.
            let lagging = now() - 250 + round;
            let record = peer.nodes.get_mut(&ek(1).to_string()).unwrap();
            record.last_evidence_at = Some(lagging);
            record.registered_at = lagging;
            record.verdict_at = lagging;
            assert_eq!(ours.merge(peer).taken, 1, "round {round}");
            // A sweep an interval after the merge: not silent.
            assert!(ours.mark_silent(now() + 60, grace, 0, &ek(0)).is_empty());
        }
        // No newer record comes: silent once the grace passed since the
        // last one was taken.
        assert!(ours.mark_silent(now() + 170, grace, 0, &ek(0)).is_empty());
        let marked = ours.mark_silent(now() + 190, grace, 0, &ek(0));
        assert_eq!(marked.len(), 1);
        assert_eq!(marked[0].verdict, Verdict::Silent);
        // A record a peer held back (a partition) counts as heard no later
        // than the skew past the peer's own time for it.
        let mut peer = Registry::default();
        peer.record(&evidence(2, None)).unwrap();
        let old = now() - 1000;
        let record = peer.nodes.get_mut(&ek(2).to_string()).unwrap();
        record.last_evidence_at = Some(old);
        record.registered_at = old;
        record.verdict_at = old;
        assert_eq!(ours.merge(peer).taken, 1);
        let marked = ours.mark_silent(now(), grace, 0, &ek(0));
        assert_eq!(marked.len(), 1, "{marked:?}");
        assert_eq!(marked[0].name, "w-2");
    }

    /// A peer's clock 250 s behind this one's: its record with newer
    /// evidence than this registry's (this clock) loses the comparison
    /// unless its times are moved to this clock, and the node the peer
    /// hears every interval would fall silent here. A peer's clock ahead:
    /// its stale silent record would replace this one's fresh one.
    #[test]
    fn a_peers_records_are_compared_on_this_clock() {
        let grace = Duration::from_secs(180);
        let served = |peer_clock: u64, last: u64, verdict: Verdict| {
            let mut peer = Registry::default();
            peer.record(&evidence(1, None)).unwrap();
            let record = peer.nodes.get_mut(&ek(1).to_string()).unwrap();
            (record.last_evidence_at, record.verdict) = (Some(last), verdict);
            (record.registered_at, record.verdict_at) = (last, last);
            (peer, peer_clock)
        };
        let heard_here = |at: u64| {
            let mut ours = Registry::default();
            ours.record(&evidence(1, None)).unwrap();
            ours.nodes
                .get_mut(&ek(1).to_string())
                .unwrap()
                .last_evidence_at = Some(at);
            ours
        };

        // `peer`, served at `served_at`, merged into `ours`, its times
        // moved to this clock or not.
        let merged = |mut ours: Registry, (peer, served_at): (Registry, u64), moved: bool| {
            ours.merge(if moved {
                peer.on_this_clock(served_at, now()).0
            } else {
                peer
            });
            ours
        };

        // Behind: the peer heard the node 10 s ago, on its clock.
        let behind = now() - 250;
        for moved in [false, true] {
            let peer = served(behind, behind - 10, Verdict::Trusted);
            let mut ours = merged(heard_here(now() - 120), peer, moved);
            let silent = ours.mark_silent(now() + 60, grace, 0, &ek(0));
            assert_eq!(silent.is_empty(), moved, "moved: {moved}, {silent:?}");
        }

        // Ahead: the peer's record is 200 s old on its clock, and silent.
        let ahead = now() + 250;
        for moved in [false, true] {
            let peer = served(ahead, ahead - 200, Verdict::Silent);
            let ours = merged(heard_here(now() - 10), peer, moved);
            let verdict = ours.nodes[&ek(1).to_string()].verdict;
            assert_eq!(verdict == Verdict::Trusted, moved, "moved: {moved}");
        }

        // An earlier version's registry (no time) is taken as it is.
        let (peer, _) = served(now(), 77, Verdict::Trusted);
        let (kept, gap) = peer.clone().on_this_clock(0, now());
        assert_eq!((kept, gap), (peer.clone(), ClockGap::Within));
        // Clocks further apart than the skew: the node records are not
        // moved by part of the gap (around three control planes such moves
        // would no longer sum to an ageing); only the revocations stay.
        let mut revoking = peer.clone();
        revoking
            .revoke_ek(&ek(5), "revoked by the operator")
            .unwrap();
        let t = now();
        for (served_at, asked_at, apart) in [(t + 301, t, -301), (1000, 1301, 301)] {
            let (kept, gap) = revoking.clone().on_this_clock(served_at, asked_at);
            assert_eq!(gap, ClockGap::Apart(apart));
            assert!(kept.revocation(&ek(5)).is_some());
            // The names its records hold stay, as news of nothing.
            let named = &kept.nodes()[&ek(1).to_string()];
            assert_eq!(
                (named.name.as_str(), named.verdict),
                ("w-1", Verdict::Registered)
            );
            assert_eq!(
                (named.registered_at, named.last_evidence_at),
                (asked_at, None)
            );
        }
        // Taken where this registry lacks the EK (its name then held here),
        // and never over a record it has.
        let (named, _) = revoking.clone().on_this_clock(t + 301, t);
        let mut lacking = Registry::default();
        lacking.merge(named.clone());
        assert!(
            lacking.check_name(&ek(7), "w-1").is_err(),
            "the name is free"
        );
        let mut holding = Registry::default();
        holding.record(&evidence(1, None)).unwrap();
        let before = holding.nodes()[&ek(1).to_string()].clone();
        holding.merge(named);
        assert_eq!(holding.nodes()[&ek(1).to_string()], before);
        let (moved, gap) = peer.clone().on_this_clock(1000, 1300);
        assert_eq!(gap, ClockGap::Within);
        assert_eq!(moved.nodes[&ek(1).to_string()].last_evidence_at, Some(377));
        // Dated from the request: a registry served 40 s after it was
        // asked for (the call held up) comes out older, not newer.
        let (mut passed, _) = served(now(), now() - 10, Verdict::Trusted);
        for _ in 0..3 {
            passed = passed.on_this_clock(now() + 40, now()).0;
        }
        let last = passed.nodes[&ek(1).to_string()].last_evidence_at.unwrap();
        assert!(last <= now() - 130, "{last}");
    }

    /// A registry at every bound (nodes, revocations, each field at its
    /// longest in JSON) is still one this registry reads back, sends, and
    /// a ticket carries: a control plane that filled it restarts.
    #[test]
    fn a_registry_at_every_bound_is_read_back() {
        let longest = |max: usize| cut(&"\"".repeat(max + 10), max);
        assert_eq!(longest(MAX_FIELD).len(), MAX_FIELD);
        let mut r = Registry::default();
        for i in 0..MAX_NODES {
            let mut digest = [0u8; 32];
            digest[..8].copy_from_slice(&(i as u64).to_le_bytes());
            let ek = EkDigest::from_hex(&hex::encode(digest))
                .unwrap()
                .to_string();
            r.nodes.insert(
                ek.clone(),
                NodeRecord {
                    name: longest(MAX_FIELD),
                    role: longest(MAX_FIELD),
                    ek: ek.clone(),
                    disk_uuid: longest(MAX_FIELD),
                    verdict: Verdict::Registered,
                    registered_at: u64::MAX,
                    last_evidence_at: Some(u64::MAX),
                    verdict_at: u64::MAX,
                    reason: Some(longest(MAX_REASON)),
                    kubernetes_version: longest(MAX_FIELD),
                    measurements: longest(MAX_FIELD),
                    other_names: vec![longest(MAX_FIELD); MAX_OTHER_NAMES],
                    on_clock: true,
                },
            );
            r.revoked.push(Revocation {
                name: longest(MAX_FIELD),
                ek,
                disk_uuid: longest(MAX_FIELD),
                reason: longest(MAX_REASON),
                at: u64::MAX,
            });
        }
        let json = r.to_json();
        assert!(json.len() <= MAX_REGISTRY_BYTES, "{} bytes", json.len());
        assert_eq!(Registry::parse(&json).unwrap(), r);
        // Stored text has no control characters, and is cut on a
        // character boundary.
        assert_eq!(cut("a\u{1b}[2Jb\n", 64), "a?[2Jb?");
        assert_eq!(cut("ééé", 5), "éé");
    }

    #[test]
    fn verdicts_silence_revocation_and_merge() {
        let mut r = Registry::default();
        assert_eq!(r.record(&evidence(1, None)).unwrap(), None);
        assert_eq!(
            r.record(&evidence(1, Some("PCR 13"))).unwrap(),
            Some(Verdict::Trusted)
        );
        let node = r.find("w-1").unwrap().clone();
        assert_eq!(node.verdict, Verdict::Drifted);
        assert_eq!(node.reason.as_deref(), Some("PCR 13"));
        assert!(r.find(&node.ek).is_ok());
        assert!(r.find(&node.disk_uuid.to_ascii_uppercase()).is_ok());
        assert!(matches!(r.find("w-9"), Err(RegistryError::UnknownNode(_))));

        // Silent only after the grace, counted from `since` too.
        let mut quiet = Registry::default();
        quiet.record(&evidence(1, None)).unwrap();
        let t = quiet.find("w-1").unwrap().last_evidence_at.unwrap();
        assert!(quiet
            .mark_silent(t + 5, Duration::from_secs(10), 0, &ek(0))
            .is_empty());
        assert!(quiet
            .mark_silent(t + 20, Duration::from_secs(10), t + 15, &ek(0))
            .is_empty());
        assert_eq!(
            quiet
                .mark_silent(t + 20, Duration::from_secs(10), 0, &ek(0))
                .len(),
            1
        );
        assert_eq!(quiet.find("w-1").unwrap().verdict, Verdict::Silent);
        // A drifted node that goes quiet keeps its verdict and reason: its
        // drift's hold runs on from the drift, and trusted evidence within
        // it does not clear it.
        let t = node.last_evidence_at.unwrap();
        assert!(r
            .mark_silent(t + 20, Duration::from_secs(10), 0, &ek(0))
            .is_empty());
        let drifted = r.find("w-1").unwrap();
        assert_eq!(drifted.verdict, Verdict::Drifted);
        assert_eq!(drifted.reason.as_deref(), Some("PCR 13"));
        assert_eq!(drifted.verdict_at, node.verdict_at);
        let stands = Duration::from_secs(3600);
        r.record_holding_drift(&evidence(1, None), stands).unwrap();
        assert_eq!(r.find("w-1").unwrap().verdict, Verdict::Drifted);

        let revocation = r.revoke(&node, Some(&bound(1)), "operator").unwrap();
        assert!(r.revocation(&ek(1)).is_some());
        assert!(r.revocation(&ek(2)).is_none());
        assert_eq!(r.revoke(&node, None, "again").unwrap(), revocation);

        // Another control plane's list: revocations join, newer evidence wins.
        let mut other = Registry::default();
        other.record(&evidence(2, None)).unwrap();
        let merged = other.merge(r.clone());
        assert_eq!((merged.added, merged.taken), (1, 1));
        assert!(other.revocation(&ek(1)).is_some());
        assert_eq!(other.nodes.len(), 2);
        assert_eq!(other.merge(r.clone()), Merged::default());
        let bytes = other.to_json();
        assert_eq!(Registry::parse(&bytes).unwrap(), other);
    }

    /// Attacker's move: a node asks a control plane that never saw a
    /// member's disk join for a ticket naming that disk, to bind it there
    /// to its own EK. The member's record, which reached this registry in
    /// an exchange, refuses it; a revoked holder and the member itself do
    /// not.
    #[test]
    fn a_disk_another_unrevoked_node_is_recorded_with_is_refused() {
        let mut r = Registry::default();
        let disk = bound(1).uuid;
        r.register(&ek(1), &disk, "w-1", "worker").unwrap();
        for asked in [disk.clone(), disk.to_ascii_uppercase()] {
            match r.check_disk(&ek(2), &asked) {
                Err(RegistryError::DiskHeld { uuid, holder }) => {
                    assert_eq!((uuid, holder), (disk.clone(), ek(1).to_string()))
                }
                other => panic!("{other:?}"),
            }
        }
        r.check_disk(&ek(1), &disk).unwrap();
        r.check_disk(&ek(2), &bound(2).uuid).unwrap();
        r.check_disk(&ek(2), "").unwrap();
        r.revoke_ek(&ek(1), "operator").unwrap();
        r.check_disk(&ek(2), &disk).unwrap();
    }

    #[test]
    fn only_a_disk_bound_to_the_nodes_ek_is_recorded_or_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let disks = DiskBindings::new(dir.path());
        let (victim, other) = (bound(2).uuid, bound(3).uuid);
        assert_eq!(
            disks.bind(&victim, &ek(2)).unwrap(),
            crate::disk_bindings::Bind::Recorded
        );
        // What the store says of a reported UUID.
        assert_eq!(
            BoundDisk::check(&disks, &ek(1), &victim).unwrap(),
            DiskClaim::OtherEk(ek(2))
        );
        assert_eq!(
            BoundDisk::check(&disks, &ek(2), &victim.to_ascii_uppercase()).unwrap(),
            DiskClaim::Bound(bound(2))
        );
        for unbound in [other.as_str(), "", "not-a-uuid"] {
            assert_eq!(
                BoundDisk::check(&disks, &ek(1), unbound).unwrap(),
                DiskClaim::Unbound,
                "{unbound:?}"
            );
        }

        // Evidence without a bound disk keeps the recorded disk; a bound
        // disk of another EK is not taken either.
        let mut r = Registry::default();
        r.register(&ek(1), &bound(1).uuid, "w-1", "worker").unwrap();
        let mut claimed = evidence(1, None);
        claimed.disk = None;
        r.record(&claimed).unwrap();
        assert_eq!(r.find("w-1").unwrap().disk_uuid, bound(1).uuid);
        claimed.disk = Some(bound(2));
        r.record(&claimed).unwrap();
        assert_eq!(r.find("w-1").unwrap().disk_uuid, bound(1).uuid);

        // A record naming another node's disk (a ticket's UUID taken on its
        // word): revoking it names the EK only, and the disk stays usable.
        r.register(&ek(1), &victim, "w-1", "worker").unwrap();
        let attacker = r.find("w-1").unwrap().clone();
        assert_eq!(BoundDisk::of_record(Some(&disks), &attacker), None);
        assert_eq!(BoundDisk::of_record(None, &attacker), None);
        let revocation = r.revoke(&attacker, Some(&bound(2)), "policy").unwrap();
        assert_eq!(revocation.disk_uuid, "");
        assert!(r.revocation(&ek(1)).is_some());
        assert!(r.revocation(&ek(2)).is_none());
        r.register(&ek(2), &victim, "w-2", "worker").unwrap();

        // The victim's own record: its bound disk goes on the list with it
        // (for the record: another EK naming that disk is not refused for
        // it, its key would not open the disk).
        let victim_record = r.find("w-2").unwrap().clone();
        let disk = BoundDisk::of_record(Some(&disks), &victim_record);
        assert_eq!(disk, Some(bound(2)));
        let revocation = r.revoke(&victim_record, disk.as_ref(), "operator").unwrap();
        assert_eq!(revocation.disk_uuid, victim);
        assert!(r.revocation(&ek(2)).is_some());
        assert!(r.revocation(&ek(9)).is_none());
        r.register(&ek(9), &victim, "w-9", "worker").unwrap();
    }

    /// Lock a disk's owner out by proxy: a node claims the victim's disk
    /// UUID at a control plane that never saw that disk (which binds it
    /// there to the claimant's EK), then gets itself revoked; that
    /// revocation names the disk and reaches every control plane. The
    /// victim, whose EK is not revoked, still gets its tickets.
    #[test]
    fn a_revocation_naming_a_disk_refuses_only_its_own_ek() {
        let victim_disk = bound(2).uuid;
        let mut elsewhere = Registry::default();
        elsewhere
            .register(&ek(1), &victim_disk, "w-x", "worker")
            .unwrap();
        let claimant = elsewhere.find("w-x").unwrap().clone();
        let claimed = BoundDisk {
            ek: ek(1),
            uuid: victim_disk.clone(),
        };
        let revocation = elsewhere
            .revoke(&claimant, Some(&claimed), "policy")
            .unwrap();
        assert_eq!(revocation.disk_uuid, victim_disk);

        let mut here = Registry::default();
        here.register(&ek(2), &victim_disk, "w-2", "worker")
            .unwrap();
        assert_eq!(here.merge(elsewhere).added, 1);
        assert!(here.revocation(&ek(1)).is_some());
        assert!(here.revocation(&ek(2)).is_none());
        here.register(&ek(2), &victim_disk, "w-2", "worker")
            .unwrap();
        assert!(matches!(
            here.register(&ek(1), "", "w-x", "worker"),
            Err(RegistryError::Revoked(_))
        ));
    }

    #[test]
    fn standing_counts_the_unrevoked_failing_nodes_and_peer_control_planes() {
        let mut r = Registry::default();
        for n in 1..=4 {
            r.record(&evidence(n, (n > 2).then_some("PCR 4"))).unwrap();
        }
        r.register(&ek(5), "", "cp-1", "control-plane").unwrap();
        r.register(&ek(6), "", "cp-0", "control-plane").unwrap();
        for n in [1, 2, 5] {
            r.nodes.get_mut(&ek(n).to_string()).unwrap().verdict = Verdict::Silent;
        }
        let standing = r.standing(&ek(6));
        assert_eq!(
            standing,
            Standing {
                unrevoked: 6,
                drifted: 2,
                silent: 3,
                peers: 1
            }
        );
        assert!(!standing.too_many(standing.drifted));
        assert!(!standing.too_many(standing.silent));
        r.nodes.get_mut(&ek(6).to_string()).unwrap().verdict = Verdict::Silent;
        assert!(r.standing(&ek(6)).too_many(4));
        r.nodes.get_mut(&ek(6).to_string()).unwrap().verdict = Verdict::Trusted;
        // A revoked node counts no more; two of four drifted is half.
        for n in [1, 5] {
            let node = r.find(&ek(n).to_string()).unwrap().clone();
            r.revoke(&node, None, "operator").unwrap();
        }
        let standing = r.standing(&ek(6));
        assert_eq!(
            (standing.unrevoked, standing.drifted, standing.peers),
            (4, 2, 0)
        );
        assert!(!standing.too_many(standing.drifted));
        // Three of four: too many at once. One alone never is.
        r.record(&evidence(2, Some("PCR 4"))).unwrap();
        let standing = r.standing(&ek(6));
        assert!(standing.too_many(standing.drifted));
        let one = Standing {
            unrevoked: 1,
            drifted: 1,
            silent: 0,
            peers: 0,
        };
        assert!(!one.too_many(one.drifted));
    }

    /// A drift stands for its hold: trusted evidence within it (the node
    /// reset its TPM and rejoined, say) leaves the node drifted, and after
    /// it clears the drift. A peer's drift counts from when it arrives.
    #[test]
    fn a_drift_stands_for_its_hold_and_a_peers_counts_from_its_arrival() {
        let hold = Duration::from_secs(90);
        let key = ek(1).to_string();
        let mut r = Registry::default();
        r.record(&evidence(1, Some("PCR 13"))).unwrap();
        r.record_holding_drift(&evidence(1, None), hold).unwrap();
        assert_eq!(r.nodes[&key].verdict, Verdict::Drifted);
        assert_eq!(r.nodes[&key].reason.as_deref(), Some("PCR 13"));
        r.nodes.get_mut(&key).unwrap().verdict_at = now() - 100;
        r.record_holding_drift(&evidence(1, None), hold).unwrap();
        assert_eq!(r.nodes[&key].verdict, Verdict::Trusted);

        let mut peer = Registry::default();
        peer.record(&evidence(1, Some("PCR 4"))).unwrap();
        let theirs = peer.nodes.get_mut(&key).unwrap();
        theirs.verdict_at = now() - 1000;
        theirs.last_evidence_at = Some(now() + 1);
        assert_eq!(r.merge(peer).taken, 1);
        assert_eq!(r.nodes[&key].verdict, Verdict::Drifted);
        assert!(r.nodes[&key].verdict_at + 5 >= now());

        // A drift held here already keeps its time: a peer's later first
        // drift (shown to it later, or re-dated by it) does not push back
        // its hold.
        let since = now() - 200;
        r.nodes.get_mut(&key).unwrap().verdict_at = since;
        let mut later = Registry::default();
        later.record(&evidence(1, Some("PCR 4"))).unwrap();
        let theirs = later.nodes.get_mut(&key).unwrap();
        theirs.verdict_at = now();
        theirs.last_evidence_at = Some(now() + 2);
        assert_eq!(r.merge(later).taken, 1);
        assert_eq!(r.nodes[&key].verdict, Verdict::Drifted);
        assert_eq!(r.nodes[&key].verdict_at, since);
    }

    /// A drift whose evidence failed only for a validity period at this
    /// control plane's time is tagged ([`NodeRecord::on_clock`]), and the
    /// tag travels with the record; it never covers a drift for another
    /// reason, here or taken from a peer; trusted evidence clears it; and
    /// a registry without such a drift is written as before.
    #[test]
    fn a_drift_on_the_clock_is_tagged_and_never_covers_another() {
        let key = ek(1).to_string();
        let on_clock = || Evidence {
            failure_on_clock: true,
            ..evidence(1, Some("EK certificate is not valid at this time"))
        };
        let mut r = Registry::default();
        r.record(&evidence(1, None)).unwrap();
        assert!(!String::from_utf8(r.to_json()).unwrap().contains("on_clock"));
        r.record(&on_clock()).unwrap();
        assert_eq!(r.nodes[&key].verdict, Verdict::Drifted);
        assert!(r.nodes[&key].on_clock);
        let read = Registry::parse(&r.to_json()).unwrap();
        assert!(read.nodes[&key].on_clock);
        // A drift for another reason replaces it, and its hold starts
        // then: the time on the clock served none.
        let long_ago = now() - 3600;
        r.nodes.get_mut(&key).unwrap().verdict_at = long_ago;
        r.record(&evidence(1, Some("PCR 4"))).unwrap();
        assert!(!r.nodes[&key].on_clock);
        assert!(r.nodes[&key].verdict_at > long_ago);
        // The same when a peer holds the node's own drift.
        let mut clocked = Registry::default();
        clocked.record(&on_clock()).unwrap();
        clocked.nodes.get_mut(&key).unwrap().verdict_at = long_ago;
        let mut peer = Registry::default();
        peer.record(&evidence(1, Some("PCR 4"))).unwrap();
        peer.nodes.get_mut(&key).unwrap().last_evidence_at = Some(now() + 5);
        assert_eq!(clocked.merge(peer).taken, 1);
        assert!(!clocked.nodes[&key].on_clock);
        assert!(clocked.nodes[&key].verdict_at > long_ago);
        // ...and is not replaced by one on the clock: it keeps its reason.
        r.record(&on_clock()).unwrap();
        assert!(!r.nodes[&key].on_clock);
        assert_eq!(r.nodes[&key].reason.as_deref(), Some("PCR 4"));
        let mut peer = Registry::default();
        peer.record(&on_clock()).unwrap();
        peer.nodes.get_mut(&key).unwrap().last_evidence_at = Some(now() + 5);
        assert_eq!(r.merge(peer).taken, 1);
        assert_eq!(r.nodes[&key].verdict, Verdict::Drifted);
        assert!(!r.nodes[&key].on_clock);
        assert_eq!(r.nodes[&key].reason.as_deref(), Some("PCR 4"));
        // A peer's on a node that validates here is taken with its tag.
        let mut fresh = Registry::default();
        fresh.record(&evidence(1, None)).unwrap();
        let mut peer = Registry::default();
        peer.record(&on_clock()).unwrap();
        peer.nodes.get_mut(&key).unwrap().last_evidence_at = Some(now() + 5);
        assert_eq!(fresh.merge(peer).taken, 1);
        assert!(fresh.nodes[&key].on_clock);
        // Trusted evidence clears it.
        r.record(&evidence(1, None)).unwrap();
        r.record(&on_clock()).unwrap();
        r.record(&evidence(1, None)).unwrap();
        assert_eq!(r.nodes[&key].verdict, Verdict::Trusted);
        assert!(!r.nodes[&key].on_clock);
    }

    /// Attacker's move, as the host of one control plane: let its CPU
    /// collateral go stale, so that every member's evidence fails there on
    /// the date alone, and let those drifts spread to every peer. Counted
    /// as drifts, they would make more than half of the nodes failing on
    /// every control plane, and the `revoke` policy would hold back the
    /// revocation of a node whose drift is real; standing against trusted
    /// evidence, they would also outlast the peers' own verdicts. Neither.
    #[test]
    fn drifts_on_the_clock_neither_hold_back_the_policy_nor_stand() {
        let hold = Duration::from_secs(210);
        let mut p = Registry::default();
        for n in 1..=5 {
            p.record(&evidence(n, None)).unwrap();
        }
        p.record(&evidence(6, Some("PCR 4"))).unwrap();
        let mut peer = Registry::default();
        for n in 1..=5 {
            peer.record(&Evidence {
                failure_on_clock: true,
                ..evidence(n, Some("CPU evidence rejected: TCB info expired"))
            })
            .unwrap();
            peer.nodes
                .get_mut(&ek(n).to_string())
                .unwrap()
                .last_evidence_at = Some(now() + 5);
        }
        p.merge_holding_drift(peer, hold);
        assert!(p.nodes[&ek(1).to_string()].on_clock);
        let standing = p.standing(&ek(100));
        assert_eq!(standing.drifted, 1, "{standing:?}");
        assert!(!standing.too_many(standing.drifted));
        // Trusted evidence here clears a drift on the clock at once.
        p.record_holding_drift(&evidence(1, None), hold).unwrap();
        assert_eq!(p.nodes[&ek(1).to_string()].verdict, Verdict::Trusted);
        // A drift of the node's own still stands against it.
        p.record_holding_drift(&evidence(6, None), hold).unwrap();
        assert_eq!(p.nodes[&ek(6).to_string()].verdict, Verdict::Drifted);
    }

    /// Sweeps run every interval, so the first to find a drift's hold over
    /// comes up to an interval after it: trusted evidence that arrives
    /// before that sweep (a TPM reset and a rejoin timed for the gap)
    /// leaves the node drifted, for the sweep to judge.
    #[test]
    fn a_drift_still_stands_when_the_first_sweep_after_its_hold_comes() {
        let config = keel_verifier::config::EvidenceConfig {
            interval_seconds: 60,
            policy: keel_verifier::config::EvidencePolicy::Revoke,
        };
        let latest_sweep = config.drift_hold() + config.interval();
        let key = ek(1).to_string();
        let mut r = Registry::default();
        r.record(&evidence(1, Some("PCR 13"))).unwrap();
        r.nodes.get_mut(&key).unwrap().verdict_at = now() - latest_sweep.as_secs() - 5;
        r.record_holding_drift(&evidence(1, None), config.drift_stands())
            .unwrap();
        assert_eq!(r.nodes[&key].verdict, Verdict::Drifted);
    }

    /// A node drifts before this control plane, resets its TPM and sends
    /// trusted evidence to another: the peer's newer trusted record does
    /// not replace the drift while it stands here, and does after.
    #[test]
    fn a_peers_trusted_record_does_not_replace_a_drift_that_stands() {
        let stands = Duration::from_secs(90 * 3 / 2 + 2 * 90);
        let key = ek(1).to_string();
        let mut r = Registry::default();
        r.record(&evidence(1, Some("PCR 13"))).unwrap();
        let trusted_elsewhere = || {
            let mut peer = Registry::default();
            peer.record(&evidence(1, None)).unwrap();
            peer.nodes.get_mut(&key).unwrap().last_evidence_at = Some(now() + 2);
            peer
        };
        assert_eq!(r.merge_holding_drift(trusted_elsewhere(), stands).taken, 0);
        assert_eq!(r.nodes[&key].verdict, Verdict::Drifted);
        assert_eq!(r.nodes[&key].reason.as_deref(), Some("PCR 13"));

        // A peer's drift of the node is still taken (the newer reason).
        let mut peer = Registry::default();
        peer.record(&evidence(1, Some("PCR 4"))).unwrap();
        peer.nodes.get_mut(&key).unwrap().last_evidence_at = Some(now() + 1);
        assert_eq!(r.merge_holding_drift(peer, stands).taken, 1);
        assert_eq!(r.nodes[&key].reason.as_deref(), Some("PCR 4"));

        // Once the drift no longer stands, the peer's newer record wins.
        r.nodes.get_mut(&key).unwrap().verdict_at = now() - stands.as_secs();
        assert_eq!(r.merge_holding_drift(trusted_elsewhere(), stands).taken, 1);
        assert_eq!(r.nodes[&key].verdict, Verdict::Trusted);
    }

    /// The verdict's time is when it changed: a node drifted for an
    /// interval keeps the time it drifted at through later evidence.
    #[test]
    fn a_verdict_keeps_the_time_it_changed() {
        let mut r = Registry::default();
        r.record(&evidence(1, Some("PCR 4"))).unwrap();
        let key = ek(1).to_string();
        r.nodes.get_mut(&key).unwrap().verdict_at = 5;
        r.record(&evidence(1, Some("PCR 4 again"))).unwrap();
        assert_eq!(r.nodes[&key].verdict_at, 5);
        r.record(&evidence(1, None)).unwrap();
        assert!(r.nodes[&key].verdict_at > 5);
    }

    #[test]
    fn no_ticket_is_recorded_for_a_revoked_node_and_no_disk_is_taken_from_nothing() {
        let mut r = Registry::default();
        r.register(&ek(1), &bound(1).uuid, "w-1", "worker").unwrap();
        // A ticket without a bound disk keeps the recorded one.
        r.register(&ek(1), "", "w-1", "worker").unwrap();
        assert_eq!(r.find("w-1").unwrap().disk_uuid, bound(1).uuid);
        // Revoked while a ticket was being made: it is not recorded, with
        // its disk or without.
        let record = r.find("w-1").unwrap().clone();
        r.revoke(&record, Some(&bound(1)), "operator").unwrap();
        let before = r.nodes().clone();
        for disk in ["", bound(1).uuid.as_str()] {
            match r.register(&ek(1), disk, "w-1", "worker") {
                Err(RegistryError::Revoked(revocation)) => {
                    assert_eq!(revocation.ek, ek(1).to_string())
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(r.nodes(), &before);
    }

    #[test]
    fn the_sweep_passes_over_revoked_nodes_and_a_merge_takes_each_revocation_once() {
        let mut r = Registry::default();
        for n in 1..=3 {
            r.record(&evidence(n, None)).unwrap();
        }
        let t = r
            .nodes()
            .values()
            .filter_map(|n| n.last_evidence_at)
            .max()
            .unwrap();
        let revoked = r.nodes()[&ek(2).to_string()].clone();
        r.revoke(&revoked, None, "operator").unwrap();
        let marked = r.mark_silent(t + 20, Duration::from_secs(10), 0, &ek(0));
        let mut names: Vec<_> = marked.iter().map(|n| n.ek.clone()).collect();
        names.sort();
        let mut expected = vec![ek(1).to_string(), ek(3).to_string()];
        expected.sort();
        assert_eq!(names, expected);
        assert_ne!(r.nodes()[&revoked.ek].verdict, Verdict::Silent);

        // A peer's list naming the same EK twice, and one this list has.
        let mut peer = r.clone();
        let again = peer.nodes()[&ek(1).to_string()].clone();
        peer.revoke(&again, None, "peer").unwrap();
        let twice = peer.revoked()[1].clone();
        peer.revoked.push(twice);
        let mut ours = r.clone();
        assert_eq!(ours.merge(peer).added, 1);
        assert_eq!(ours.revoked().len(), 2);
        assert!(ours.revocation(&ek(1)).is_some());
    }

    /// A revocation of the `i`th EK of a full list.
    fn numbered_revocation(i: usize) -> Revocation {
        let mut digest = [0xeeu8; 32];
        digest[..8].copy_from_slice(&(i as u64).to_le_bytes());
        Revocation {
            name: format!("gone-{i}"),
            ek: EkDigest::from_hex(&hex::encode(digest))
                .unwrap()
                .to_string(),
            disk_uuid: String::new(),
            reason: "operator".into(),
            at: 1,
        }
    }

    #[test]
    fn a_revoked_control_planes_registry_is_not_merged_nor_counted_as_heard() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        let full = || Registry {
            revoked: (0..100).map(numbered_revocation).collect(),
            ..Registry::default()
        };
        // Control plane 9, revoked here.
        store
            .update(|r| {
                r.register(&ek(9), "", "cp-9", "control-plane")?;
                let record = r.find("cp-9")?.clone();
                r.revoke(&record, None, "compromised")
            })
            .unwrap();
        let refused = store.merge_from_peer(full(), Duration::from_secs(60), &ek(9));
        assert!(
            matches!(refused, Err(RegistryError::PeerRevoked)),
            "{refused:?}"
        );
        assert_eq!(store.snapshot().revoked().len(), 1);
        assert_eq!(store.merged_at(), None);
        // Another control plane's is.
        assert_eq!(
            store
                .merge_from_peer(full(), Duration::from_secs(60), &ek(8))
                .unwrap(),
            100
        );
        assert!(store.merged_at().is_some());
    }

    /// Attacker's move (a host on the paths into this control plane, with
    /// three or more control planes): let one peer's evidence reach it but
    /// drop that peer's registry answers, while another peer's registry
    /// still arrives, so that the nodes only the first peer hears look
    /// silent here and are revoked. The view is current only with the
    /// registry of every peer this control plane does not hold silent
    /// merged within the grace.
    #[test]
    fn the_view_is_current_only_with_every_live_peers_registry_merged() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        let grace = Duration::from_secs(60);
        assert!(store.view_current(&ek(7), now(), grace), "no peers");
        store
            .update(|r| {
                for n in [7, 8, 9] {
                    r.register(&ek(n), "", &format!("cp-{n}"), "control-plane")?;
                }
                r.register(&ek(1), "", "w-1", "worker")
            })
            .unwrap();
        assert!(!store.view_current(&ek(7), now(), grace));
        store
            .merge_from_peer(Registry::default(), grace, &ek(8))
            .unwrap();
        assert!(
            !store.view_current(&ek(7), now(), grace),
            "cp-9's registry never merged"
        );
        store
            .merge_from_peer(Registry::default(), grace, &ek(9))
            .unwrap();
        assert!(store.view_current(&ek(7), now(), grace));
        assert!(!store.view_current(&ek(7), now() + 120, grace), "stale");
        assert!(
            !store.view_current(&ek(7), now() - 400, grace),
            "merged ahead of a clock set back"
        );
        // cp-9 silent here, or revoked: cp-8's merge is the view.
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        store
            .update(|r| {
                for n in [7, 8, 9] {
                    r.register(&ek(n), "", &format!("cp-{n}"), "control-plane")?;
                }
                Ok(())
            })
            .unwrap();
        store
            .merge_from_peer(Registry::default(), grace, &ek(8))
            .unwrap();
        store
            .update(|r| {
                let key = ek(9).to_string();
                if let Some(cp9) = r.nodes.get_mut(&key) {
                    cp9.verdict = Verdict::Silent;
                }
                Ok(())
            })
            .unwrap();
        assert!(store.view_current(&ek(7), now(), grace));
        // With every peer silent, no merge is no view.
        store
            .update(|r| {
                let key = ek(8).to_string();
                if let Some(cp8) = r.nodes.get_mut(&key) {
                    cp8.verdict = Verdict::Silent;
                }
                Ok(())
            })
            .unwrap();
        assert!(store.view_current(&ek(7), now(), grace));
        assert!(!store.view_current(&ek(7), now() + 120, grace));
    }

    /// Attacker's move: route a control plane's rejoin to a control plane
    /// this one revoked (compromised, still running), whose ticket brings
    /// a registry of junk records, or newer trusted records that would
    /// wipe a drift this control plane holds. Nothing is taken from a
    /// revoked issuer; from another, the drift held here stands, and the
    /// merge is no view of the nodes.
    #[test]
    fn a_tickets_registry_is_refused_from_a_revoked_issuer_and_keeps_a_held_drift() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        let key = ek(1).to_string();
        store
            .update(|r| {
                r.record(&evidence(1, Some("PCR 13")))?;
                r.register(&ek(9), "", "cp-9", "control-plane")?;
                let record = r.find("cp-9")?.clone();
                r.revoke(&record, None, "compromised")
            })
            .unwrap();
        let ticket = || {
            let mut theirs = Registry::default();
            theirs.record(&evidence(1, None)).unwrap();
            theirs.nodes.get_mut(&key).unwrap().last_evidence_at = Some(now() + 5);
            theirs.record(&evidence(2, None)).unwrap();
            theirs
        };
        let hold = Duration::from_secs(3600);
        let refused = store.merge_from_ticket(ticket(), hold, &ek(9));
        assert!(
            matches!(refused, Err(RegistryError::PeerRevoked)),
            "{refused:?}"
        );
        assert!(store.snapshot().find("w-2").is_err());
        let merged = store.merge_from_ticket(ticket(), hold, &ek(8)).unwrap();
        assert_eq!(merged.taken, 1, "{merged:?}");
        let now_held = store.snapshot();
        assert_eq!(now_held.nodes()[&key].verdict, Verdict::Drifted);
        assert!(now_held.find("w-2").is_ok());
        assert_eq!(store.merged_at(), None);
    }

    /// Attacker's move, as a control plane compromised after its
    /// attestation: serve a registry whose record holds millions of empty
    /// other names (3 bytes each in the document, 24 in memory, kept at
    /// that capacity once cut). A record holds at most two: more is a
    /// document this code never writes, refused as it is read.
    #[test]
    fn a_record_with_more_other_names_than_it_holds_is_refused_as_read() {
        let mut r = Registry::default();
        r.record(&evidence(1, None)).unwrap();
        let with_names = |names: Vec<&str>| {
            let mut doc: serde_json::Value = serde_json::from_slice(&r.to_json()).unwrap();
            doc["nodes"][ek(1).to_string()]["other_names"] = serde_json::json!(names);
            serde_json::to_vec(&doc).unwrap()
        };
        let two = Registry::parse(&with_names(vec!["w-8", "w-9"])).unwrap();
        assert_eq!(two.nodes[&ek(1).to_string()].other_names, ["w-8", "w-9"]);
        let refused = Registry::parse(&with_names(vec![""; 100_000])).unwrap_err();
        assert!(refused.to_string().contains("at most 2 names"), "{refused}");
    }

    #[test]
    fn a_full_revocation_list_refuses_every_ticket_and_reports_what_a_merge_drops() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        let full = Registry {
            revoked: (0..MERGED_REVOCATIONS - 1)
                .map(numbered_revocation)
                .collect(),
            ..Registry::default()
        };
        assert_eq!(store.merge(full).unwrap(), MERGED_REVOCATIONS - 1);
        store
            .update(|r| r.register(&ek(7), "", "w-7", "worker"))
            .unwrap();

        // A peer revoked w-1 and w-2; only one more fits here.
        let mut peer = Registry::default();
        peer.record(&evidence(1, None)).unwrap();
        peer.record(&evidence(2, None)).unwrap();
        for n in [1, 2] {
            let record = peer.nodes()[&ek(n).to_string()].clone();
            peer.revoke(&record, Some(&bound(n)), "drifted").unwrap();
        }
        let e = store.merge(peer).unwrap_err();
        assert!(
            matches!(e, RegistryError::RevocationsFull { dropped: 1 }),
            "{e}"
        );
        // The one left out gets no ticket; nor does any node, as another
        // revocation could not be kept either.
        for n in [1, 2, 7, 9] {
            let refused = store
                .update(|r| r.register(&ek(n), "", &format!("w-{n}"), "worker"))
                .unwrap_err();
            assert!(
                matches!(
                    refused,
                    RegistryError::Revoked(_) | RegistryError::RevocationsFull { .. }
                ),
                "w-{n}: {refused}"
            );
        }
        // The reserve: this control plane's own revocations still fit (a
        // control plane that filled its peers' lists is revoked all the
        // same), until the list holds MAX_REVOCATIONS.
        store
            .update(|r| {
                let record = r.find("w-7")?.clone();
                r.revoke(&record, None, "operator")
            })
            .unwrap();
        store
            .update(|r| {
                for n in MERGED_REVOCATIONS + 1..MAX_REVOCATIONS {
                    let ek = EkDigest::from_hex(&format!("{n:064x}")).unwrap();
                    r.revoke_ek(&ek, "operator")?;
                }
                Ok(())
            })
            .unwrap();
        let e = store
            .update(|r| r.revoke_ek(&ek(9), "operator"))
            .unwrap_err();
        assert!(e.to_string().contains("revocation list is full"), "{e}");
        // A restart holds the same.
        let path = store.path().to_owned();
        drop(store);
        let again = Registry::on_disk(&path).unwrap();
        assert_eq!(again.revoked().len(), MAX_REVOCATIONS);
    }

    #[test]
    fn a_peers_revocation_naming_a_disk_joins_one_of_the_same_ek_without_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        // Here w-1 was revoked before its disk was known; the peer knew it.
        store
            .update(|r| {
                r.record(&evidence(1, None))?;
                let record = r.nodes()[&ek(1).to_string()].clone();
                r.revoke(&record, None, "operator")
            })
            .unwrap();
        let mut peer = Registry::default();
        peer.record(&evidence(1, None)).unwrap();
        let record = peer.nodes()[&ek(1).to_string()].clone();
        peer.revoke(&record, Some(&bound(1)), "operator").unwrap();

        assert_eq!(store.merge(peer.clone()).unwrap(), 1);
        // The list names the disk too, after a restart as well (it is
        // matched with its EK only, see `Registry::revocation`).
        let disk = bound(1).uuid;
        let names_disk = |r: &Registry| r.revoked().iter().any(|v| v.disk_uuid == disk);
        assert!(names_disk(&store.snapshot()));
        assert!(store.snapshot().revocation(&ek(5)).is_none());
        let path = store.path().to_owned();
        drop(store);
        let again = Registry::on_disk(&path).unwrap();
        assert!(names_disk(&again));
        assert_eq!(again.revoked().len(), 2);
        // Merged again, nothing is new.
        let mut twice = again.clone();
        assert_eq!(twice.merge(peer).added, 0);
    }

    #[test]
    fn the_store_persists_and_is_shared() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        assert!(Arc::ptr_eq(
            &store,
            &RegistryStore::shared(dir.path()).unwrap()
        ));
        store.update(|r| r.record(&evidence(3, None))).unwrap();
        let path = store.path().to_owned();
        drop(store);
        let again = RegistryStore::shared(dir.path()).unwrap();
        assert_eq!(again.snapshot().nodes.len(), 1);
        std::fs::write(&path, b"{not json").unwrap();
        drop(again);
        assert!(RegistryStore::shared(dir.path()).is_err());
    }

    #[test]
    fn concurrent_changes_are_each_on_disk_when_their_call_returns() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        let threads: Vec<_> = (0..48u8)
            .map(|n| {
                let store = store.clone();
                std::thread::spawn(move || {
                    store
                        .update(|r| r.register(&ek(n), "", &format!("w-{n}"), "worker"))
                        .unwrap();
                    let on_disk = Registry::on_disk(store.path()).unwrap();
                    assert!(on_disk.find(&format!("w-{n}")).is_ok(), "w-{n} not on disk");
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let stats = store.write_stats();
        assert_eq!(stats.requests, 48);
        assert!(stats.rounds <= 48);
        let on_disk = Registry::on_disk(store.path()).unwrap();
        assert_eq!(on_disk.nodes.len(), 48);
        assert_eq!(on_disk, store.snapshot());
    }

    #[test]
    fn a_failed_write_fails_the_change_and_the_next_write_carries_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        // The journal's name is taken by a directory: the write fails.
        let path = store.path().to_owned();
        let journal = journal::beside(&path);
        std::fs::create_dir_all(&journal).unwrap();
        let failed = store.update(|r| r.record(&evidence(1, None)));
        assert!(
            matches!(failed, Err(RegistryError::Journal(_))),
            "{failed:?}"
        );
        std::fs::remove_dir(&journal).unwrap();
        let on_disk = || Registry::on_disk(&path).unwrap();
        assert_eq!(on_disk().nodes.len(), 0);
        // Still in effect here, and written with the next change.
        assert_eq!(store.snapshot().nodes.len(), 1);
        store.update(|r| r.record(&evidence(2, None))).unwrap();
        assert_eq!(on_disk().nodes.len(), 2);
        store.update(|r| r.record(&evidence(3, None))).unwrap();
        assert_eq!(on_disk().nodes.len(), 3);
        // A merge that brings nothing does not write.
        let rounds = store.write_stats().rounds;
        assert_eq!(store.merge(store.snapshot()).unwrap(), 0);
        assert_eq!(store.write_stats().rounds, rounds);
        let mut theirs = Registry::default();
        theirs.record(&evidence(4, None)).unwrap();
        assert_eq!(store.merge(theirs).unwrap(), 0);
        assert_eq!(store.write_stats().rounds, rounds + 1);
        assert_eq!(on_disk().nodes.len(), 4);
        // Nor does a sweep that finds nobody silent.
        let grace = Duration::from_secs(60);
        assert!(store.mark_silent(now(), grace, 0, &ek(0)).0.is_empty());
        assert_eq!(store.write_stats().rounds, rounds + 1);
        let (marked, written) = store.mark_silent(now() + 120, grace, 0, &ek(0));
        assert_eq!(marked.len(), 4);
        written.unwrap();
        assert_eq!(store.write_stats().rounds, rounds + 2);
        assert!(on_disk()
            .nodes
            .values()
            .all(|n| n.verdict == Verdict::Silent));
    }

    /// Registers `n` nodes from `first` in one change.
    fn register_many(store: &RegistryStore, first: u32, n: u32) {
        store
            .update(|r| {
                for i in first..first + n {
                    let ek = EkDigest::of_marshalled(&i.to_le_bytes());
                    r.register(&ek, "", &format!("n-{i}"), "worker")?;
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_write_appends_what_changed_and_the_journal_folds_into_a_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        let path = store.path().to_owned();
        let journal = journal::beside(&path);
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());

        // 3,000 nodes in one change: one append, no snapshot.
        register_many(&store, 0, 3000);
        assert_eq!(size(&path), 0);
        // One node's evidence appends that node's record, nothing more.
        let before = size(&journal);
        store.update(|r| r.record(&evidence(7, None))).unwrap();
        let appended = size(&journal) - before;
        assert!(appended < 1024, "{appended} bytes for one change");
        register_many(&store, 3000, 1000);
        let grown = size(&journal);
        assert!(grown > COMPACT_AT_LEAST, "{grown}");
        assert_eq!(size(&path), 0);
        // The journal outgrew 1 MiB (and the empty snapshot): this write
        // folds it into a snapshot.
        let kept = std::fs::read(&journal).unwrap();
        store.update(|r| r.record(&evidence(8, None))).unwrap();
        assert_eq!(size(&journal), 0);
        assert_eq!(
            Registry::parse(&std::fs::read(&path).unwrap())
                .unwrap()
                .nodes
                .len(),
            4002
        );
        store.update(|r| r.record(&evidence(9, None))).unwrap();
        assert_eq!(Registry::on_disk(&path).unwrap(), store.snapshot());

        // A crash between the snapshot and the emptied journal: replaying
        // records the snapshot holds changes nothing.
        let mut stale = kept;
        stale.extend(std::fs::read(&journal).unwrap());
        std::fs::write(&journal, stale).unwrap();
        assert_eq!(Registry::on_disk(&path).unwrap(), store.snapshot());
    }

    /// A journal already due to be folded when the agent restarts (its
    /// snapshots had failed, perhaps up to the journal's bound) is folded
    /// by the first write after the restart, not appended to.
    #[test]
    fn the_first_write_after_a_restart_folds_a_journal_already_due() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        let path = store.path().to_owned();
        let journal = journal::beside(&path);
        register_many(&store, 0, 4000);
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        assert!(size(&journal) > COMPACT_AT_LEAST);
        assert_eq!(size(&path), 0);
        drop(store);

        let store = RegistryStore::shared(dir.path()).unwrap();
        store.update(|r| r.record(&evidence(8, None))).unwrap();
        assert_eq!(size(&journal), 0);
        assert_eq!(Registry::on_disk(&path).unwrap(), store.snapshot());
        assert_eq!(store.snapshot().nodes.len(), 4001);
    }

    #[test]
    fn a_registry_an_older_version_stored_loads() {
        // Pretty JSON, a 512-character reason, and a revocation whose EK
        // is no digest (an older version merged a peer's list as sent); a
        // journal with another such revocation and a long record.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(paths::NODE_REGISTRY);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut old = Registry::default();
        old.record(&evidence(1, Some(&"r".repeat(512)))).unwrap();
        let record = old.find("w-1").unwrap().clone();
        old.revoke(&record, None, "operator").unwrap();
        let mut json: serde_json::Value = serde_json::from_slice(&old.to_json()).unwrap();
        json["nodes"][ek(1).to_string()]["reason"] = "r".repeat(512).into();
        json["revoked"].as_array_mut().unwrap().push(
            serde_json::json!({"name": "x", "ek": "junk", "disk_uuid": "", "reason": "", "at": 1}),
        );
        std::fs::write(&path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
        let mut long = record.clone();
        long.ek = ek(3).to_string();
        long.name = "w-3".into();
        long.reason = Some("q".repeat(512));
        let lines = [
            serde_json::json!({"revoked": {"name": "y", "ek": "also junk", "disk_uuid": "", "reason": "", "at": 2}}),
            serde_json::json!({"node": long}),
        ];
        let journal: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(journal::beside(&path), journal).unwrap();

        let store = RegistryStore::shared(dir.path()).unwrap();
        let loaded = store.snapshot();
        assert_eq!(loaded.revoked().len(), 1, "{:?}", loaded.revoked());
        assert_eq!(loaded.revoked()[0].ek, ek(1).to_string());
        let reason = |name: &str| loaded.find(name).unwrap().reason.clone().unwrap();
        assert_eq!(reason("w-1").len(), MAX_REASON);
        assert_eq!(reason("w-3").len(), MAX_REASON);
        // It keeps working: a change, a restart.
        store.update(|r| r.record(&evidence(4, None))).unwrap();
        drop(store);
        assert_eq!(
            RegistryStore::shared(dir.path())
                .unwrap()
                .snapshot()
                .nodes
                .len(),
            3
        );
    }

    #[test]
    fn a_restart_replays_the_journal_and_drops_an_append_cut_short() {
        let dir = tempfile::tempdir().unwrap();
        let store = RegistryStore::shared(dir.path()).unwrap();
        register_many(&store, 0, 3);
        let node = store.snapshot().find("n-1").unwrap().clone();
        let revocation = store.update(|r| r.revoke(&node, None, "operator")).unwrap();
        store
            .update(|r| r.record(&evidence(4, Some("PCR 9"))))
            .unwrap();
        let expected = store.snapshot();
        let journal = journal::beside(store.path());
        drop(store);

        // A crash in the middle of the next append.
        journal::append_cut_short(&journal, b"{\"node\":{\"name\":\"w-");
        let store = RegistryStore::shared(dir.path()).unwrap();
        assert_eq!(store.snapshot(), expected);
        assert_eq!(store.revocation(&ek(0)), None);
        assert_eq!(
            store
                .snapshot()
                .revocation(&EkDigest::of_marshalled(&1u32.to_le_bytes())),
            Some(&revocation)
        );
        assert_eq!(
            store.snapshot().find("w-4").unwrap().verdict,
            Verdict::Drifted
        );
        // The cut line is gone before the next append follows it.
        store.update(|r| r.record(&evidence(5, None))).unwrap();
        drop(store);
        let store = RegistryStore::shared(dir.path()).unwrap();
        assert_eq!(store.snapshot().nodes.len(), 5);

        // Corruption before the last line is not a crash: refused.
        drop(store);
        let mut bytes = std::fs::read(&journal).unwrap();
        bytes[2] = b'#';
        std::fs::write(&journal, bytes).unwrap();
        assert!(matches!(
            RegistryStore::shared(dir.path()),
            Err(RegistryError::Journal(JournalError::Corrupt {
                line: 1,
                ..
            }))
        ));
    }
}
