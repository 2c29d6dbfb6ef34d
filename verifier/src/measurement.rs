//! The agent's own measurement log and its replay.
//!
//! Every runtime measurement the agent makes (its node config, the node's
//! identity, installed components, the cluster ID) is one [`Event`]: the
//! SHA-256 of its bytes is extended into a PCR of the SHA-256 bank and the
//! event is appended to an append-only log. A verifier replays the log
//! ([`replay`]) and compares the result with quoted PCR values. This module
//! is pure: the TPM side lives in the agent (`keel_agent::tpm`), the wiring
//! in `keel_agent::measured`.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// A SHA-256 digest (a PCR value or an event digest).
pub type Digest32 = [u8; 32];

/// The PCRs the agent extends. See `docs/pcr-map.md`.
pub mod pcr {
    /// UEFI drivers the firmware loads from outside its own volume (PCI
    /// option ROMs, `Driver####` entries), then the separator. Enforced at
    /// [`no_firmware_drivers`] unless the platform's firmware loads such
    /// drivers by design.
    pub const DRIVER_CODE: u32 = 2;
    /// The node config, measured before the agent uses it. Enforced.
    pub const CONFIG: u32 = 12;
    /// Per-node facts (name, role) and installed Kubernetes components. Logged, not enforced.
    pub const NODE: u32 = 13;
    /// The cluster ID, extended once when the node lock is taken.
    pub const CLUSTER_ID: u32 = 15;
    /// Every PCR this log may touch.
    pub const AGENT_OWNED: [u32; 3] = [CONFIG, NODE, CLUSTER_ID];

    /// [`DRIVER_CODE`] when the firmware ran no driver from outside its
    /// volume: only the EV_SEPARATOR (four zero bytes) it measures into
    /// PCRs 0-7 before it starts the boot option.
    pub fn no_firmware_drivers() -> super::Digest32 {
        use sha2::{Digest as _, Sha256};
        super::extend(&[0; 32], &Sha256::digest([0u8; 4]).into())
    }
}

/// What an event measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventType {
    /// The canonical node config.
    NodeConfig,
    /// The node's name and role.
    NodeIdentity,
    /// One installed Kubernetes component (URL, hash, install path).
    Component,
    /// The cluster ID, extended by the node lock.
    ClusterId,
}

impl EventType {
    /// The kebab-case name used in logs and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NodeConfig => "node-config",
            Self::NodeIdentity => "node-identity",
            Self::Component => "component",
            Self::ClusterId => "cluster-id",
        }
    }

    /// Parses the wire name.
    pub fn parse(name: &str) -> Option<Self> {
        [
            Self::NodeConfig,
            Self::NodeIdentity,
            Self::Component,
            Self::ClusterId,
        ]
        .into_iter()
        .find(|t| t.as_str() == name)
    }

    /// The PCR events of this type extend.
    pub fn pcr(self) -> u32 {
        match self {
            Self::NodeConfig => pcr::CONFIG,
            Self::NodeIdentity | Self::Component => pcr::NODE,
            Self::ClusterId => pcr::CLUSTER_ID,
        }
    }
}

/// One measurement: `pcr` was extended with
/// `digest = SHA-256(u32be(seq) || event_type || 0x00 || data)`.
///
/// The sequence number and type are part of what is measured, so an entry
/// cannot be moved, dropped or relabelled without the replay noticing, even
/// between PCRs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Position in the log, from 0.
    pub seq: u32,
    /// The PCR extended.
    pub pcr: u32,
    /// The measured digest (see the type's documentation).
    #[serde(with = "hex_digest")]
    pub digest: Digest32,
    /// What was measured.
    pub event_type: EventType,
    /// One line for an operator.
    pub description: String,
    /// The measured bytes.
    #[serde(with = "hex::serde")]
    pub data: Vec<u8>,
}

impl Event {
    /// Creates event number `seq` for `data`, extending the PCR its type owns.
    pub fn new(
        seq: u32,
        event_type: EventType,
        description: impl Into<String>,
        data: Vec<u8>,
    ) -> Self {
        Self {
            seq,
            pcr: event_type.pcr(),
            digest: event_digest(seq, event_type, &data),
            event_type,
            description: description.into(),
            data,
        }
    }
}

/// The digest an event extends: `SHA-256(u32be(seq) || type || 0x00 || data)`.
pub fn event_digest(seq: u32, event_type: EventType, data: &[u8]) -> Digest32 {
    let mut h = Sha256::new();
    h.update(seq.to_be_bytes());
    h.update(event_type.as_str().as_bytes());
    h.update([0]);
    h.update(data);
    h.finalize().into()
}

/// Why a log does not replay.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayError {
    /// An entry is out of place: removed, inserted or reordered.
    #[error("event {index} carries sequence number {seq}: the log was reordered or cut")]
    Sequence {
        /// Position in the log.
        index: usize,
        /// The sequence number it carries.
        seq: u32,
    },
    /// An entry's digest does not match its content (the entry was changed).
    #[error("event {index} ({event_type}): digest does not match its data")]
    DigestMismatch {
        /// Position in the log.
        index: usize,
        /// The event's type.
        event_type: &'static str,
    },
    /// An entry names a PCR its type does not extend.
    #[error("event {index} ({event_type}): PCR {pcr} is not the PCR this event type extends")]
    WrongPcr {
        /// Position in the log.
        index: usize,
        /// The event's type.
        event_type: &'static str,
        /// The PCR the entry named.
        pcr: u32,
    },
    /// The replayed value differs from the value the TPM reports.
    #[error("PCR {pcr}: log replays to {replayed} but the TPM reports {actual}")]
    ValueMismatch {
        /// The PCR.
        pcr: u32,
        /// Hex of the replayed value.
        replayed: String,
        /// Hex of the reported value.
        actual: String,
    },
    /// The reported PCR values lack an agent-owned PCR.
    #[error("PCR {pcr} is not among the reported values")]
    MissingPcr {
        /// The PCR.
        pcr: u32,
    },
}

/// `SHA-256(old || digest)`: the TPM's extend operation.
pub fn extend(old: &Digest32, digest: &Digest32) -> Digest32 {
    let mut h = Sha256::new();
    h.update(old);
    h.update(digest);
    h.finalize().into()
}

/// Recomputes every agent-owned PCR from zero. Entries must be numbered
/// 0, 1, 2, ... in order, each digest must match its content and each entry
/// must name the PCR of its type; PCRs without entries replay to zero.
pub fn replay(events: &[Event]) -> Result<BTreeMap<u32, Digest32>, ReplayError> {
    let mut pcrs: BTreeMap<u32, Digest32> =
        pcr::AGENT_OWNED.iter().map(|&p| (p, [0; 32])).collect();
    for (index, event) in events.iter().enumerate() {
        let event_type = event.event_type.as_str();
        if usize::try_from(event.seq).ok() != Some(index) {
            return Err(ReplayError::Sequence {
                index,
                seq: event.seq,
            });
        }
        if event_digest(event.seq, event.event_type, &event.data) != event.digest {
            return Err(ReplayError::DigestMismatch { index, event_type });
        }
        if event.pcr != event.event_type.pcr() {
            return Err(ReplayError::WrongPcr {
                index,
                event_type,
                pcr: event.pcr,
            });
        }
        let value = pcrs.entry(event.pcr).or_insert([0; 32]);
        *value = extend(value, &event.digest);
    }
    Ok(pcrs)
}

/// Replays `events` and checks the result against reported PCR values,
/// which must include every agent-owned PCR.
pub fn verify_replay(
    events: &[Event],
    reported: &BTreeMap<u32, Digest32>,
) -> Result<(), ReplayError> {
    for (pcr, replayed) in replay(events)? {
        let actual = reported.get(&pcr).ok_or(ReplayError::MissingPcr { pcr })?;
        if *actual != replayed {
            return Err(ReplayError::ValueMismatch {
                pcr,
                replayed: hex::encode(replayed),
                actual: hex::encode(actual),
            });
        }
    }
    Ok(())
}

/// A PCR value printed as lowercase hex.
pub struct HexDigest<'a>(pub &'a Digest32);

impl fmt::Display for HexDigest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

mod hex_digest {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let s = <&str>::deserialize(d)?;
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(serde::de::Error::custom)?;
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn log() -> Vec<Event> {
        vec![
            Event::new(0, EventType::NodeConfig, "config", b"{\"a\":1}".to_vec()),
            Event::new(1, EventType::NodeIdentity, "node", b"worker-1".to_vec()),
            Event::new(2, EventType::Component, "kubelet", b"kubelet".to_vec()),
            Event::new(3, EventType::ClusterId, "cluster", vec![7; 32]),
        ]
    }

    #[test]
    fn replay_matches_manual_extends() {
        let events = log();
        let pcrs = replay(&events).unwrap();
        let zero = [0; 32];
        let d = |seq, t, data: &[u8]| event_digest(seq, t, data);
        assert_eq!(
            pcrs[&pcr::CONFIG],
            extend(&zero, &d(0, EventType::NodeConfig, b"{\"a\":1}"))
        );
        let node = extend(
            &extend(&zero, &d(1, EventType::NodeIdentity, b"worker-1")),
            &d(2, EventType::Component, b"kubelet"),
        );
        assert_eq!(pcrs[&pcr::NODE], node);
        assert_eq!(
            pcrs[&pcr::CLUSTER_ID],
            extend(&zero, &d(3, EventType::ClusterId, &[7; 32]))
        );
        verify_replay(&events, &pcrs).unwrap();
    }

    #[test]
    fn changed_entry_fails() {
        let mut events = log();
        events[0].data = b"{\"a\":2}".to_vec();
        assert!(matches!(
            replay(&events),
            Err(ReplayError::DigestMismatch { index: 0, .. })
        ));
    }

    #[test]
    fn consistently_changed_entry_fails_against_tpm_values() {
        let reported = replay(&log()).unwrap();
        let mut events = log();
        events[0] = Event::new(0, EventType::NodeConfig, "config", b"{\"a\":2}".to_vec());
        assert!(matches!(
            verify_replay(&events, &reported),
            Err(ReplayError::ValueMismatch {
                pcr: pcr::CONFIG,
                ..
            })
        ));
    }

    #[test]
    fn removed_or_reordered_entries_fail() {
        let reported = replay(&log()).unwrap();
        let mut removed = log();
        removed.remove(2);
        assert!(matches!(
            verify_replay(&removed, &reported),
            Err(ReplayError::Sequence { index: 2, seq: 3 })
        ));
        let mut truncated = log();
        truncated.pop();
        assert!(matches!(
            verify_replay(&truncated, &reported),
            Err(ReplayError::ValueMismatch {
                pcr: pcr::CLUSTER_ID,
                ..
            })
        ));
        // Reordering across PCRs is caught too: the sequence is measured.
        let mut reordered = log();
        reordered.swap(0, 3);
        assert!(matches!(
            verify_replay(&reordered, &reported),
            Err(ReplayError::Sequence { index: 0, seq: 3 })
        ));
        let mut renumbered = log();
        renumbered.swap(0, 3);
        renumbered[0].seq = 0;
        assert!(matches!(
            verify_replay(&renumbered, &reported),
            Err(ReplayError::DigestMismatch { index: 0, .. })
        ));
    }

    #[test]
    fn entry_moved_to_another_pcr_fails() {
        let mut events = log();
        events[1].pcr = pcr::CONFIG;
        assert!(matches!(
            replay(&events),
            Err(ReplayError::WrongPcr { index: 1, .. })
        ));
    }

    #[test]
    fn missing_reported_pcr_fails() {
        let mut reported = replay(&log()).unwrap();
        reported.remove(&pcr::CLUSTER_ID);
        assert_eq!(
            verify_replay(&log(), &reported),
            Err(ReplayError::MissingPcr {
                pcr: pcr::CLUSTER_ID
            })
        );
    }
}
