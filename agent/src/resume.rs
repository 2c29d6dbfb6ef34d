//! Resuming after an agent restart within one boot.
//!
//! The node lock cannot be taken twice in a boot (PCR 15 holds the cluster
//! ID until the next reboot), so an agent that systemd restarts after a
//! crash finds its node locked and its disk open, but without what it held
//! in memory: a control plane's master secret (without it, no joins, keys,
//! operator requests or registry merges, and its evidence stops, so peers
//! record it silent and, under the `revoke` policy, revoke it), a member's
//! operator key.
//!
//! So once a node is a member, the agent keeps a [`ResumeRecord`] in the
//! service manager's file-descriptor store: a sealed memfd that systemd
//! holds while the service runs or restarts, drops when it is stopped, and
//! never keeps across a reboot. A restarted agent takes it back before its
//! flows start ([`take_kept`]) and resumes ([`resume`]) only if the record
//! names the cluster PCR 15 holds, and a control plane's master secret
//! derives that cluster ID from the facts on its disk.
//!
//! The record is as secret as the agent's memory and guarded alike: only
//! root reaches the store (PID 1's descriptors), as only root can read the
//! agent's memory.

use std::io::Write as _;
use std::os::fd::AsFd as _;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use keel_verifier::keys::{ClusterId, KeyService, OperatorKey};
use prost::Message as _;
use zeroize::{Zeroize as _, Zeroizing};

use crate::provision::{Node, ProvisionError, Provisioner};

/// The names of records in the descriptor store: this, `-` and the
/// record's generation (0, 1, …). A new record is stored under the next
/// generation before the earlier one is removed, so the store holds a
/// record at every moment; a restarted agent takes the newest.
pub const STORE_NAME: &str = "keel-resume";
/// Largest record read back: the longest master secret and salt the key
/// service takes, a cluster ID and an operator key are about 1 KiB.
const MAX_RECORD_BYTES: usize = 4096;

/// What a member needs to resume its role after an agent restart.
#[derive(Clone)]
pub struct ResumeRecord {
    cluster_id: ClusterId,
    /// A control plane's master secret and salt.
    keys: Option<Arc<KeyService>>,
    /// A member's operator key, from its ticket.
    operator_key: Option<OperatorKey>,
}

impl std::fmt::Debug for ResumeRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResumeRecord")
            .field("cluster_id", &hex::encode(self.cluster_id))
            .field("control_plane", &self.keys.is_some())
            .field("operator_key", &self.operator_key.is_some())
            .finish()
    }
}

/// The record as stored (protobuf).
#[derive(Clone, PartialEq, prost::Message)]
#[prost(skip_debug)]
struct Stored {
    #[prost(bytes = "vec", tag = "1")]
    cluster_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    master_secret: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    master_salt: Vec<u8>,
    #[prost(bytes = "vec", tag = "4")]
    operator_key: Vec<u8>,
}

impl std::fmt::Debug for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Stored(<redacted>)")
    }
}

impl Drop for Stored {
    fn drop(&mut self) {
        self.master_secret.zeroize();
        self.master_salt.zeroize();
        self.operator_key.zeroize();
    }
}

/// Why no record was kept or taken back, or the node did not resume.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResumeError {
    /// Making, writing or storing the record failed.
    #[error("keeping the resume record")]
    Keep(#[source] std::io::Error),
    /// The stored record could not be read.
    #[error("reading the resume record")]
    Read(#[source] std::io::Error),
    /// The stored record does not decode, or a field is invalid.
    #[error("the resume record is invalid: {0}")]
    Invalid(&'static str),
    /// The node is not locked: there is nothing to resume.
    #[error("the node is not locked")]
    NotLocked,
    /// PCR 15 holds another cluster ID than the record (or none the agent's
    /// event log names).
    #[error("the node is locked into cluster {locked}, the resume record names {kept}")]
    OtherCluster {
        /// The cluster ID of the lock (hex), or `unknown`.
        locked: String,
        /// The record's (hex).
        kept: String,
    },
    /// The record is a control plane's and the node is a worker's, or the
    /// other way round.
    #[error("the resume record is a {kept}'s, this node is a {node}")]
    Role {
        /// The record's role.
        kept: &'static str,
        /// The node's role.
        node: &'static str,
    },
    /// Reading the lock failed.
    #[error("reading the node lock")]
    Lock(#[source] crate::nodelock::LockError),
    /// Reading the node's own EK failed.
    #[error("reading this node's EK")]
    Tpm(#[source] crate::tpm::TpmError),
    /// The node config's measurements signing key is invalid.
    #[error("the node config's measurements signing key: {0}")]
    Config(String),
    /// The control plane's state could not be restored from its disk.
    #[error("restoring the control plane's state")]
    Restore(#[source] ProvisionError),
}

impl ResumeRecord {
    /// The record of a control plane serving `state`.
    pub fn of_control_plane(state: &crate::cluster::ClusterState) -> Self {
        Self {
            cluster_id: state.cluster_id,
            keys: Some(state.keys.clone()),
            operator_key: None,
        }
    }

    /// The record of a member of `cluster_id` whose ticket carried
    /// `operator_key`.
    pub fn of_member(cluster_id: ClusterId, operator_key: OperatorKey) -> Self {
        Self {
            cluster_id,
            keys: None,
            operator_key: Some(operator_key),
        }
    }

    /// The record's cluster ID.
    pub fn cluster_id(&self) -> ClusterId {
        self.cluster_id
    }

    /// Whether the record is a control plane's (holds the master secret).
    pub fn is_control_plane(&self) -> bool {
        self.keys.is_some()
    }

    /// `self`, with what `earlier` holds and `self` does not, when both
    /// are of one cluster.
    fn merged(mut self, earlier: Option<&Self>) -> Self {
        if let Some(earlier) = earlier.filter(|e| e.cluster_id == self.cluster_id) {
            self.keys = self.keys.or_else(|| earlier.keys.clone());
            self.operator_key = self.operator_key.or_else(|| earlier.operator_key.clone());
        }
        self
    }

    /// The stored form.
    pub fn encode(&self) -> Zeroizing<Vec<u8>> {
        let (secret, salt) = self
            .keys
            .as_ref()
            .map(|k| k.expose_master())
            .unwrap_or_default();
        let stored = Stored {
            cluster_id: self.cluster_id.to_vec(),
            master_secret: secret.to_vec(),
            master_salt: salt.to_vec(),
            operator_key: self
                .operator_key
                .as_ref()
                .map(|k| k.expose().to_vec())
                .unwrap_or_default(),
        };
        Zeroizing::new(stored.encode_to_vec())
    }

    /// A record from its stored form.
    pub fn decode(bytes: &[u8]) -> Result<Self, ResumeError> {
        if bytes.len() > MAX_RECORD_BYTES {
            return Err(ResumeError::Invalid("larger than 4 KiB"));
        }
        let stored = Stored::decode(bytes).map_err(|_| ResumeError::Invalid("does not decode"))?;
        let cluster_id = ClusterId::try_from(stored.cluster_id.as_slice())
            .map_err(|_| ResumeError::Invalid("cluster ID length"))?;
        let keys = match (
            stored.master_secret.is_empty(),
            stored.master_salt.is_empty(),
        ) {
            (true, true) => None,
            _ => Some(Arc::new(
                KeyService::new(&stored.master_secret, &stored.master_salt)
                    .map_err(|_| ResumeError::Invalid("master secret or salt length"))?,
            )),
        };
        let operator_key = match stored.operator_key.as_slice() {
            [] => None,
            key => Some(
                OperatorKey::from_slice(key).ok_or(ResumeError::Invalid("operator key length"))?,
            ),
        };
        if keys.is_none() && operator_key.is_none() {
            return Err(ResumeError::Invalid(
                "neither a master secret nor an operator key",
            ));
        }
        Ok(Self {
            cluster_id,
            keys,
            operator_key,
        })
    }
}

/// What this agent kept last.
#[derive(Default)]
struct Kept {
    /// The record: a later one of the same cluster keeps what it does not
    /// replace.
    record: Option<ResumeRecord>,
    /// The generation of the record in the service manager's store.
    stored: Option<u64>,
    /// Names in the store that should be gone, their removal to be tried
    /// again before the next record is stored (the unit's bound would
    /// otherwise refuse it).
    stale: Vec<String>,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    record: None,
    stored: None,
    stale: Vec::new(),
});

/// The file in the agent's runtime directory that says a flow took the
/// node lock in this boot and has not kept its record yet: a restart that
/// finds the node locked, no usable record and this file knows the flow
/// was cut off (a crash during a rejoin, whose disk is already a
/// member's), and reboots so the node starts over. Without it (the service
/// was stopped after the node became a member) the restart only says that
/// it cannot resume.
pub const UNKEPT: &str = "locked-unkept";

/// Takes the node lock with `cluster_id` for a flow that keeps a record
/// once the node is a member ([`keep`]), marking `run_dir` ([`UNKEPT`])
/// first. A mark that cannot be written is logged: a restart after a crash
/// then only says it cannot resume, as before there was a mark.
pub fn take_lock(
    lock: &crate::nodelock::NodeLock,
    cluster_id: ClusterId,
    run_dir: &Path,
) -> Result<(), crate::nodelock::LockError> {
    if !lock.is_locked() {
        if let Err(e) = crate::files::write_private(&run_dir.join(UNKEPT), b"") {
            tracing::warn!(
                error = %keel_atls::ErrorChain(&e),
                "marking the flow that takes the node lock failed: a crash before it \
                 finishes would not reboot the node"
            );
        }
    }
    lock.try_lock(cluster_id)
}

/// Keeps `record` (merged with the one kept before) in the service
/// manager's descriptor store, where a restarted agent finds it, and
/// removes the mark of a flow under way ([`UNKEPT`]) from `run_dir`.
/// Without a service manager (`$NOTIFY_SOCKET` unset) it is kept in memory
/// only. A failure is logged: the node works on, but a restart of its
/// agent would need a reboot.
pub fn keep(record: ResumeRecord, run_dir: &Path) {
    let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
    keep_at(
        &mut kept,
        record,
        crate::systemd::manager_socket().as_deref(),
    );
    clear_unkept(run_dir);
}

/// Removes `run_dir`'s [`UNKEPT`], if there.
fn clear_unkept(run_dir: &Path) {
    crate::files::remove_or_log(
        &run_dir.join(UNKEPT),
        "removing the mark of a finished flow failed",
    );
}

/// [`keep`] into `kept`, stored with the service manager at `socket`: the
/// new record under the next generation first, then the earlier one
/// removed. Should the agent stop between the two, the store holds both
/// and the restarted agent takes the newer ([`take_kept`]).
fn keep_at(kept: &mut Kept, record: ResumeRecord, socket: Option<&str>) {
    let record = record.merged(kept.record.as_ref());
    if let Some(socket) = socket {
        kept.stale.retain(|name| !remove_stored(socket, name));
        if !kept.stale.is_empty() {
            // The store may be full: the new record could be dropped, and
            // removing the one before would then leave an older one, or
            // none. It is sent once the older ones are gone; till then
            // the store keeps the last record it took.
            tracing::warn!(
                stale = kept.stale.len(),
                "earlier resume records could not be removed; the new record waits"
            );
            kept.record = Some(record);
            return;
        }
        let generation = kept.stored.map_or(0, |g| g.saturating_add(1));
        let stored = sealed(&record).and_then(|file| {
            crate::systemd::store_fd_at(socket, &store_name(generation), file.as_fd())
                .map_err(ResumeError::Keep)
        });
        match stored {
            Ok(()) => {
                tracing::info!(
                    control_plane = record.is_control_plane(),
                    generation,
                    "resume record sent to the service manager's descriptor store"
                );
                if let Some(earlier) = kept.stored.replace(generation) {
                    let earlier = store_name(earlier);
                    if !remove_stored(socket, &earlier) {
                        kept.stale.push(earlier);
                    }
                }
            }
            Err(e) => tracing::warn!(
                error = %keel_atls::ErrorChain(&e),
                "the resume record could not be kept: if the agent restarts, this node needs a reboot"
            ),
        }
    }
    kept.record = Some(record);
}

/// The store name of the record of `generation`.
fn store_name(generation: u64) -> String {
    format!("{STORE_NAME}-{generation}")
}

/// The generation a store name names, if it is a record's.
fn generation_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STORE_NAME)?.strip_prefix('-')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Removes the record stored as `name`; a failure is logged (the store
/// then holds one record more, up to the unit's bound). Returns whether
/// the removal was sent.
fn remove_stored(socket: &str, name: &str) -> bool {
    match crate::systemd::remove_fd_at(socket, name) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(name, error = %e, "removing an earlier resume record failed");
            false
        }
    }
}

/// `record` in a memfd sealed against every change (its size and bytes,
/// and its seals).
pub fn sealed(record: &ResumeRecord) -> Result<std::fs::File, ResumeError> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
    let io = |e: nix::Error| ResumeError::Keep(e.into());
    let fd = memfd_create(
        c"keel-resume",
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )
    .map_err(io)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(&record.encode())
        .map_err(ResumeError::Keep)?;
    fcntl(
        std::os::fd::AsRawFd::as_raw_fd(&file),
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_WRITE
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_SEAL,
        ),
    )
    .map_err(io)?;
    Ok(file)
}

/// The newest record among the descriptors passed to this process at
/// start ([`crate::systemd::take_passed_fds`]); older ones (left by an
/// agent that stopped while replacing its record) are removed from the
/// store, and later records continue from its generation. `None` when none
/// was passed.
pub fn take_kept(
    passed: Vec<(String, std::fs::File)>,
) -> Option<Result<ResumeRecord, ResumeError>> {
    let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
    take_kept_at(
        &mut kept,
        passed,
        crate::systemd::manager_socket().as_deref(),
    )
}

/// [`take_kept`] into `kept`, with the service manager at `socket`.
fn take_kept_at(
    kept: &mut Kept,
    passed: Vec<(String, std::fs::File)>,
    socket: Option<&str>,
) -> Option<Result<ResumeRecord, ResumeError>> {
    let mut records: Vec<(u64, std::fs::File)> = Vec::new();
    for (name, file) in passed {
        match generation_of(&name) {
            Some(generation) => records.push((generation, file)),
            // Not a name this agent stores under, but one of its kind:
            // it only takes room in the store.
            None if name.starts_with(STORE_NAME) => kept.stale.push(name),
            None => {}
        }
    }
    records.sort_by_key(|(generation, _)| *generation);
    let newest = records.pop();
    kept.stale
        .extend(records.iter().map(|(older, _)| store_name(*older)));
    if let Some(socket) = socket {
        kept.stale.retain(|name| !remove_stored(socket, name));
    }
    let (newest, file) = newest?;
    kept.stored = Some(newest);
    Some(read(&file))
}

/// Reads a stored record from `file`, from its start.
pub fn read(file: &std::fs::File) -> Result<ResumeRecord, ResumeError> {
    let mut bytes = Zeroizing::new(vec![0u8; MAX_RECORD_BYTES + 1]);
    let mut len = 0;
    while len < bytes.len() {
        match file.read_at(&mut bytes[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ResumeError::Read(e)),
        }
    }
    ResumeRecord::decode(&bytes[..len])
}

/// What a node resumed as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resumed {
    /// A control plane: its cluster state is back in its slot, so its
    /// join service, evidence service and operator API serve again.
    ControlPlane,
    /// A member: its operator key is back.
    Member,
}

/// Resumes the role `record` describes on `node`, locked within this boot
/// by the agent before it restarted: the record must name the cluster ID
/// of the lock; a control plane's master secret must derive the cluster ID
/// of the facts on its (still open) state disk.
pub async fn resume(node: &Node, record: ResumeRecord) -> Result<Resumed, ResumeError> {
    if !node.lock.is_locked() {
        return Err(ResumeError::NotLocked);
    }
    let locked = node.lock.cluster_id().map_err(ResumeError::Lock)?;
    if locked != Some(record.cluster_id) {
        return Err(ResumeError::OtherCluster {
            locked: locked.map_or_else(|| "unknown".to_owned(), hex::encode),
            kept: hex::encode(record.cluster_id),
        });
    }
    let control_plane = node.config.node.role == keel_verifier::config::Role::ControlPlane;
    let role = |cp: bool| if cp { "control plane" } else { "worker" };
    if record.is_control_plane() != control_plane {
        return Err(ResumeError::Role {
            kept: role(record.is_control_plane()),
            node: role(control_plane),
        });
    }
    let resumed = match &record.keys {
        Some(keys) => {
            let log = |line: String| tracing::info!(target: "keel_agent::provision", "{line}");
            let p = Provisioner::new(&node.env, &node.tpm, &log);
            let signing_key = node
                .config
                .cluster
                .signing_key()
                .map_err(|e| ResumeError::Config(e.to_string()))?;
            let state = p
                .restore_control_plane(keys.clone(), signing_key)
                .map_err(ResumeError::Restore)?;
            // The keys derive the facts' cluster ID (checked by the
            // restore); it must also be the lock's.
            if state.cluster_id != record.cluster_id {
                return Err(ResumeError::OtherCluster {
                    locked: hex::encode(record.cluster_id),
                    kept: hex::encode(state.cluster_id),
                });
            }
            // Revoked while it ran (or while its agent was down): it serves
            // nothing, as after a reboot.
            let own_ek =
                crate::attestation::shared_own_ek_digest(&node.tpm).map_err(ResumeError::Tpm)?;
            p.refuse_revoked_or_renamed(&own_ek, &node.config.node)
                .await
                .map_err(ResumeError::Restore)?;
            node.cluster.send_replace(Some(Arc::new(state)));
            Resumed::ControlPlane
        }
        None => Resumed::Member,
    };
    if let Some(key) = &record.operator_key {
        node.operator_key.set(key.clone());
    }
    // An upgrade's switch the restart cut off stays as it was: upgrades
    // are refused until a reboot, whose reinstall settles it.
    if let Ok(Some(_)) = crate::upgrade::Switching::load(node.env.root()) {
        tracing::error!(
            "an upgrade's switch was cut off by the agent's restart: this node may run \
             components of two versions, and refuses upgrades until it reboots; reboot it"
        );
    }
    KEPT.lock().unwrap_or_else(PoisonError::into_inner).record = Some(record);
    Ok(resumed)
}

/// At start, before the node's flows run: a node locked within this boot
/// (its agent restarted) resumes with the record kept before the restart.
/// If it cannot, and the flow that locked it was cut off before it kept a
/// record ([`UNKEPT`]), the node reboots to start over; otherwise the agent
/// says plainly what it cannot do until the node reboots. Returns whether
/// the node was reset (its reboot scheduled, under the node's policy).
pub async fn at_start(node: &Node, kept: Option<Result<ResumeRecord, ResumeError>>) -> bool {
    if !node.lock.is_locked() {
        return false;
    }
    let run_dir = node.env.work_dir.as_path();
    let cause = match kept {
        Some(Ok(record)) => match resume(node, record).await {
            Ok(resumed) => {
                clear_unkept(run_dir);
                match resumed {
                    Resumed::ControlPlane => tracing::info!(
                        "resumed after an agent restart: serving as a control plane again"
                    ),
                    Resumed::Member => {
                        tracing::info!("resumed after an agent restart: a member of the cluster")
                    }
                }
                return false;
            }
            Err(e) => keel_atls::ErrorChain(&e).to_string(),
        },
        Some(Err(e)) => keel_atls::ErrorChain(&e).to_string(),
        None => "no resume record was kept (the service was stopped, or the store refused it)"
            .to_owned(),
    };
    if run_dir.join(UNKEPT).exists() {
        for line in crate::reboot::reset_node(None, node.env.reboot, Some(run_dir)).await {
            tracing::error!(
                cause,
                "the agent restarted while the flow that locked the node in this boot was \
                 under way, and cannot resume it: {line}"
            );
        }
        return true;
    }
    tracing::error!(
        cause,
        "the agent restarted after the node was locked in this boot and cannot resume: \
         until the node reboots it takes no operator requests and, on a control plane, \
         serves no joins, keys or evidence; reboot it to rejoin (or recover a last control plane)"
    );
    false
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn keys() -> Arc<KeyService> {
        Arc::new(KeyService::new(&[7; 32], &[9; 32]).unwrap())
    }

    #[test]
    fn a_record_survives_its_sealed_memfd() {
        let record = ResumeRecord {
            cluster_id: [3; 32],
            keys: Some(keys()),
            operator_key: OperatorKey::from_slice(&[5; keel_verifier::keys::OPERATOR_KEY_LEN]),
        };
        let file = sealed(&record).unwrap();
        // Sealed: no byte of it changes.
        assert!(file.write_at(b"x", 0).is_err());
        assert!(file.set_len(1).is_err());
        let back = read(&file).unwrap();
        assert_eq!(back.cluster_id, [3; 32]);
        assert_eq!(back.keys.unwrap().expose_master(), keys().expose_master());
        assert_eq!(back.operator_key.unwrap().expose(), &[5; 32]);
    }

    #[test]
    fn a_later_record_keeps_what_an_earlier_one_of_its_cluster_held() {
        let key = OperatorKey::from_slice(&[5; keel_verifier::keys::OPERATOR_KEY_LEN]).unwrap();
        let control_plane = ResumeRecord {
            cluster_id: [3; 32],
            keys: Some(keys()),
            operator_key: None,
        };
        let merged = ResumeRecord::of_member([3; 32], key.clone()).merged(Some(&control_plane));
        assert!(merged.is_control_plane() && merged.operator_key.is_some());
        // Another cluster's record keeps nothing of it.
        let other = ResumeRecord::of_member([4; 32], key).merged(Some(&control_plane));
        assert!(!other.is_control_plane());
    }

    #[test]
    fn a_record_is_replaced_by_storing_the_new_one_before_removing_the_old() {
        let manager = keel_testkit::notify::NotifySocket::new().unwrap();
        let socket = Some(manager.socket());
        let mut kept = Kept::default();
        let member =
            || ResumeRecord::of_member([3; 32], OperatorKey::from_slice(&[6; 32]).unwrap());
        let states = || -> Vec<String> {
            std::iter::from_fn(|| manager.receive().map(|(s, _)| s)).collect()
        };
        let control_plane = ResumeRecord {
            cluster_id: [3; 32],
            keys: Some(keys()),
            operator_key: None,
        };
        let key = OperatorKey::from_slice(&[5; keel_verifier::keys::OPERATOR_KEY_LEN]).unwrap();
        keep_at(&mut kept, control_plane, socket);
        keep_at(&mut kept, ResumeRecord::of_member([3; 32], key), socket);
        let mut messages = Vec::new();
        while let Some((state, files)) = manager.receive() {
            messages.push((state, files));
        }
        let sent: Vec<&str> = messages.iter().map(|(s, _)| s.as_str()).collect();
        // At every moment the store holds a record: the second is stored
        // before the first goes.
        assert_eq!(
            sent,
            [
                "FDSTORE=1\nFDNAME=keel-resume-0",
                "FDSTORE=1\nFDNAME=keel-resume-1",
                "FDSTOREREMOVE=1\nFDNAME=keel-resume-0",
            ]
        );
        let second = read(&messages[1].1[0]).unwrap();
        assert!(second.is_control_plane() && second.operator_key.is_some());

        // An agent that stopped between the two leaves both: the restarted
        // one takes the newer, removes the older, and goes on from there.
        let first = std::mem::take(&mut messages[0].1).remove(0);
        let newer = std::mem::take(&mut messages[1].1).remove(0);
        let mut restarted = Kept::default();
        let passed = vec![
            ("keel-resume-1".to_owned(), newer),
            ("keel-resume-0".to_owned(), first),
            ("other".to_owned(), tempfile::tempfile().unwrap()),
        ];
        let taken = take_kept_at(&mut restarted, passed, socket)
            .unwrap()
            .unwrap();
        assert!(taken.is_control_plane() && taken.operator_key.is_some());
        let (state, _) = manager.receive().unwrap();
        assert_eq!(state, "FDSTOREREMOVE=1\nFDNAME=keel-resume-0");
        assert_eq!(restarted.stored, Some(1));
        keep_at(&mut restarted, member(), socket);
        assert_eq!(
            states(),
            [
                "FDSTORE=1\nFDNAME=keel-resume-2",
                "FDSTOREREMOVE=1\nFDNAME=keel-resume-1",
            ]
        );

        // Nothing of ours passed: nothing taken.
        let none = take_kept_at(
            &mut Kept::default(),
            vec![("keel-resume".to_owned(), tempfile::tempfile().unwrap())],
            socket,
        );
        assert!(none.is_none());
        // A name of its kind that is no generation's only takes room: it
        // goes.
        let (state, _) = manager.receive().unwrap();
        assert_eq!(state, "FDSTOREREMOVE=1\nFDNAME=keel-resume");
        // A removal that failed is tried again before the next record.
        let mut behind = Kept {
            stale: vec!["keel-resume-7".to_owned()],
            stored: Some(8),
            ..Kept::default()
        };
        keep_at(&mut behind, member(), socket);
        assert_eq!(
            states(),
            [
                "FDSTOREREMOVE=1\nFDNAME=keel-resume-7",
                "FDSTORE=1\nFDNAME=keel-resume-9",
                "FDSTOREREMOVE=1\nFDNAME=keel-resume-8",
            ]
        );
        assert!(behind.stale.is_empty());
        // While a removal keeps failing (here: no one listens), no new
        // record is sent, so the store keeps the last one it took; once
        // the removal goes through, the waiting record follows.
        let mut stuck = Kept {
            stale: vec!["keel-resume-3".to_owned()],
            stored: Some(4),
            ..Kept::default()
        };
        let gone = manager.socket().replace("notify", "gone");
        keep_at(&mut stuck, member(), Some(&gone));
        assert_eq!(stuck.stale, ["keel-resume-3"]);
        assert_eq!(stuck.stored, Some(4));
        assert!(stuck.record.is_some());
        keep_at(&mut stuck, member(), socket);
        assert_eq!(
            states(),
            [
                "FDSTOREREMOVE=1\nFDNAME=keel-resume-3",
                "FDSTORE=1\nFDNAME=keel-resume-5",
                "FDSTOREREMOVE=1\nFDNAME=keel-resume-4",
            ]
        );
        for (name, generation) in [
            ("keel-resume-0", Some(0)),
            ("keel-resume-17", Some(17)),
            ("keel-resume-", None),
            ("keel-resume-+1", None),
            ("keel-resume-1x", None),
            ("keel-resumed-1", None),
        ] {
            assert_eq!(generation_of(name), generation, "{name}");
        }
    }

    #[test]
    fn invalid_records_are_refused() {
        let stored = |f: &dyn Fn(&mut Stored)| {
            let mut s = Stored {
                cluster_id: vec![3; 32],
                master_secret: vec![7; 32],
                master_salt: vec![9; 32],
                operator_key: Vec::new(),
            };
            f(&mut s);
            ResumeRecord::decode(&s.encode_to_vec())
        };
        assert!(stored(&|_| {}).is_ok());
        for (what, f) in [
            (
                "short cluster ID",
                &(|s: &mut Stored| s.cluster_id.truncate(31)) as &dyn Fn(&mut Stored),
            ),
            ("short master secret", &|s| s.master_secret.truncate(8)),
            ("salt without a secret", &|s| s.master_secret.clear()),
            ("short operator key", &|s| s.operator_key = vec![1; 31]),
            ("nothing to resume with", &|s| {
                s.master_secret.clear();
                s.master_salt.clear();
            }),
        ] {
            assert!(
                matches!(stored(f), Err(ResumeError::Invalid(_))),
                "{what} accepted"
            );
        }
        assert!(ResumeRecord::decode(b"\xff\xff\xff").is_err());
        assert!(matches!(
            ResumeRecord::decode(&vec![0; MAX_RECORD_BYTES + 1]),
            Err(ResumeError::Invalid("larger than 4 KiB"))
        ));
    }

    #[test]
    fn the_debug_form_shows_no_secret() {
        let record = ResumeRecord {
            cluster_id: [3; 32],
            keys: Some(keys()),
            operator_key: None,
        };
        let shown = format!("{record:?}");
        for secret in [7u8, 9] {
            assert!(!shown.contains(&hex::encode([secret; 4])), "{shown}");
            assert!(!shown.contains(&format!("{secret}, {secret}")), "{shown}");
        }
        assert!(shown.contains(&hex::encode([3; 32])));
        let stored = Stored {
            cluster_id: Vec::new(),
            master_secret: vec![7; 32],
            master_salt: vec![9; 32],
            operator_key: Vec::new(),
        };
        let shown = format!("{stored:?}");
        assert!(
            !shown.contains("7, 7") && !shown.contains("9, 9"),
            "{shown}"
        );
    }
}
