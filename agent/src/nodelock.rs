//! The node lock: the one-way switch from "fresh node" to "member of a
//! cluster".
//!
//! The init flow and the join flow run at the same time; the first to reach
//! the point of no return takes the lock and the other gives up. Taking the
//! lock records a [`EventType::ClusterId`] event, which extends PCR 15 with
//! the cluster ID. PCR 15 is zero exactly while the node belongs to no
//! cluster, so the lock is visible to every verifier, and it cannot be
//! released: only a reboot resets the PCR (and with it the lock).
//!
//! The lock's state lives in the TPM, not only in memory: a [`NodeLock`]
//! made while PCR 15 is non-zero (the agent restarted after locking in this
//! boot, or something else extended the PCR) starts locked.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use keel_verifier::measurement::{pcr, EventType};

use crate::measured::{MeasuredLogError, SharedTpm};
use crate::tpm::TpmError;

/// Why the lock was not taken (or its state not read).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The node is already locked (into this or another cluster).
    #[error("the node is already part of a cluster")]
    AlreadyLocked,
    /// Reading PCR 15 failed.
    #[error("reading the node lock PCR")]
    ReadPcr(#[source] TpmError),
    /// Measuring the cluster ID failed. Whether the node ended up locked is
    /// decided by PCR 15 afterwards, see [`NodeLock::try_lock`].
    #[error("measuring the cluster ID into the node lock PCR")]
    Record {
        /// Why.
        #[source]
        source: MeasuredLogError,
        /// PCR 15 was set (or could not be read) after the failure: this
        /// attempt left the node locked for good.
        locked: bool,
    },
    /// Another thread panicked while holding the TPM.
    #[error("the TPM handle is poisoned")]
    Poisoned,
}

impl LockError {
    /// This failed attempt itself left the node locked (its PCR 15 set):
    /// nothing this boot can do lets the node start over. Decided under the
    /// lock's own mutex, so a later winner's lock is not mistaken for it.
    pub fn left_locked(&self) -> bool {
        matches!(self, Self::Record { locked: true, .. })
    }
}

/// The node lock over the node's measured TPM.
pub struct NodeLock {
    tpm: SharedTpm,
    /// `true` once locked. Held while the cluster ID is recorded, so exactly
    /// one caller can win.
    locked: Mutex<bool>,
    /// The value of `locked`, set under it: read without waiting for a
    /// recording in progress, which holds `locked` while it waits for the
    /// TPM (a batch of quotes, say), so that async callers asking whether
    /// the node is locked never block a runtime thread on it.
    known: AtomicBool,
}

impl NodeLock {
    /// Reads PCR 15: a non-zero value means the node is already locked.
    pub fn new(tpm: SharedTpm) -> Result<Self, LockError> {
        let locked = pcr15_set(&tpm)?;
        Ok(Self {
            tpm,
            locked: Mutex::new(locked),
            known: AtomicBool::new(locked),
        })
    }

    /// Locks the node into the cluster `cluster_id`. Exactly one caller
    /// succeeds; every other gets [`LockError::AlreadyLocked`] and changes
    /// nothing. Blocks on the TPM.
    ///
    /// If recording fails, PCR 15 decides: when it is no longer zero the
    /// node counts as locked (the extend may have happened; it cannot be
    /// undone), otherwise it stays unlocked and the call may be retried.
    pub fn try_lock(&self, cluster_id: [u8; 32]) -> Result<(), LockError> {
        let mut locked = self.locked.lock().unwrap_or_else(PoisonError::into_inner);
        if *locked {
            return Err(LockError::AlreadyLocked);
        }
        let recorded = {
            let mut tpm = self.tpm.lock().map_err(|_| LockError::Poisoned)?;
            // One-off: a cluster ID whose record failed once appended is
            // settled first and counts, rather than being followed by a
            // second one.
            tpm.record_once(
                EventType::ClusterId,
                format!("node lock: cluster ID {}", hex::encode(cluster_id)),
                cluster_id.to_vec(),
            )
        };
        match recorded {
            Ok(()) => {
                *locked = true;
                self.known.store(true, Ordering::Release);
                tracing::info!(cluster_id = %hex::encode(cluster_id), "node locked");
                Ok(())
            }
            Err(source) => {
                *locked = pcr15_set(&self.tpm).unwrap_or(true);
                self.known.store(*locked, Ordering::Release);
                Err(LockError::Record {
                    source,
                    locked: *locked,
                })
            }
        }
    }

    /// Whether the node is locked, as of the last lock that ended (one in
    /// progress is not waited for: [`NodeLock::try_lock`] decides the race).
    pub fn is_locked(&self) -> bool {
        self.known.load(Ordering::Acquire)
    }

    /// The cluster ID this node was locked into, if the agent's event log
    /// has it (it does not when PCR 15 was extended by someone else).
    pub fn cluster_id(&self) -> Result<Option<[u8; 32]>, LockError> {
        let tpm = self.tpm.lock().map_err(|_| LockError::Poisoned)?;
        Ok(tpm
            .events()
            .iter()
            .find(|e| e.event_type == EventType::ClusterId)
            .and_then(|e| <[u8; 32]>::try_from(e.data.as_slice()).ok()))
    }
}

/// Whether PCR 15 is non-zero.
fn pcr15_set(tpm: &SharedTpm) -> Result<bool, LockError> {
    let mut tpm = tpm.lock().map_err(|_| LockError::Poisoned)?;
    let values = tpm
        .tpm()
        .pcr_read(&[pcr::CLUSTER_ID])
        .map_err(LockError::ReadPcr)?;
    Ok(values
        .get(&pcr::CLUSTER_ID)
        .is_none_or(|value| *value != [0; 32]))
}
