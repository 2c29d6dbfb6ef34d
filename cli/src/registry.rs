//! A control plane's node registry, as `keel status`, `keel revoke` and
//! `keel upgrade` read it from its answer ([`Registry::parse`]): typed and
//! bounded like the document a control plane writes, so that an answer
//! of [`MAX_REGISTRY_BYTES`] takes memory of about its size. Fields are
//! declared in the order a control plane writes them: written back as
//! JSON (`keel status -o json`), a registry reads as its document does
//! (fields of another version left out). Every string in it is the
//! node's to choose: escape it for the terminal.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use anyhow::ensure;
use keel_proto::{MAX_NODES, MAX_OTHER_NAMES, MAX_REGISTRY_BYTES, MAX_REVOCATIONS};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

/// A node registry: nodes by EK hash, and the revocation list. A field the
/// document lacks is empty, as an earlier version may have written it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Registry {
    /// Node records by their EK hash (at most [`MAX_NODES`]).
    #[serde(deserialize_with = "at_most_nodes")]
    pub nodes: BTreeMap<String, NodeRecord>,
    /// Revoked nodes, oldest first (at most [`MAX_REVOCATIONS`]).
    #[serde(deserialize_with = "at_most_revocations")]
    pub revoked: Vec<Revocation>,
}

/// What a control plane records of one node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeRecord {
    /// Its name.
    pub name: String,
    /// Its measured role (`control-plane`, `worker`).
    pub role: String,
    /// Its EK hash (`sha256:` and hex).
    pub ek: String,
    /// Its state disk's UUID (empty: none reported).
    pub disk_uuid: String,
    /// Its verdict (`registered`, `trusted`, `drifted`, `silent`).
    pub verdict: String,
    /// When it entered the registry (Unix seconds).
    pub registered_at: u64,
    /// When its last evidence arrived (Unix seconds, the control plane's
    /// clock), if ever.
    pub last_evidence_at: Option<u64>,
    /// When its verdict last changed (Unix seconds).
    pub verdict_at: u64,
    /// Why its last evidence failed, or why it is silent.
    pub reason: Option<String>,
    /// The Kubernetes version its last evidence reported.
    pub kubernetes_version: String,
    /// SHA-256 (hex) of the measurements its last evidence was checked
    /// against.
    pub measurements: String,
    /// Other names other control planes hold its EK under (at most
    /// [`MAX_OTHER_NAMES`]).
    #[serde(
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "at_most_other_names"
    )]
    pub other_names: Vec<String>,
    /// Its drift rests on the judging control plane's clock alone.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub on_clock: bool,
}

/// One entry of the revocation list.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Revocation {
    /// The node's name, as the registry knew it.
    pub name: String,
    /// The revoked EK hash.
    pub ek: String,
    /// The revoked disk UUID (empty: none known).
    pub disk_uuid: String,
    /// Why.
    pub reason: String,
    /// When (Unix seconds).
    pub at: u64,
}

impl Registry {
    /// Parses a registry document of at most [`MAX_REGISTRY_BYTES`]; more
    /// entries than a control plane keeps are refused while reading.
    pub fn parse(bytes: &[u8]) -> anyhow::Result<Self> {
        ensure!(
            bytes.len() <= MAX_REGISTRY_BYTES,
            "it is {} bytes, more than a registry's {MAX_REGISTRY_BYTES}",
            bytes.len()
        );
        Ok(serde_json::from_slice(bytes)?)
    }
}

/// Reads a map of at most `most` entries, refusing the next one before it
/// is read; a key given twice keeps its last value.
struct AtMostMap<V> {
    most: usize,
    values: PhantomData<V>,
}

impl<'de, V: Deserialize<'de>> Visitor<'de> for AtMostMap<V> {
    type Value = BTreeMap<String, V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a map of at most {} entries", self.most)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            if entries.len() == self.most && !entries.contains_key(&key) {
                return Err(de::Error::invalid_length(self.most + 1, &self));
            }
            entries.insert(key, map.next_value()?);
        }
        Ok(entries)
    }
}

fn at_most_nodes<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, NodeRecord>, D::Error> {
    deserializer.deserialize_map(AtMostMap {
        most: MAX_NODES,
        values: PhantomData,
    })
}

fn at_most_revocations<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<Revocation>, D::Error> {
    keel_verifier::bounded::at_most(deserializer, MAX_REVOCATIONS, "revocations")
}

fn at_most_other_names<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<String>, D::Error> {
    keel_verifier::bounded::at_most(deserializer, MAX_OTHER_NAMES, "names")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A registry document of `nodes` node records and `revoked`
    /// revocations, each as short as its fields allow.
    fn document(nodes: usize, revoked: usize) -> Vec<u8> {
        let nodes: Vec<String> = (0..nodes).map(|i| format!(r#""{i}":{{}}"#)).collect();
        let revoked = vec!["{}"; revoked];
        format!(
            r#"{{"nodes":{{{}}},"revoked":[{}]}}"#,
            nodes.join(","),
            revoked.join(",")
        )
        .into_bytes()
    }

    /// Attacker's move, as a control plane answering `keel status` (or the
    /// registry read of `keel revoke` and `keel upgrade`): an answer of up
    /// to 32 MiB of tiny entries, which as a JSON value would take many
    /// times that in memory. Entries past a registry's bounds are refused
    /// while reading, as is a document larger than a registry.
    #[test]
    fn a_registry_past_its_bounds_is_refused() {
        let full = Registry::parse(&document(MAX_NODES, MAX_REVOCATIONS)).unwrap();
        assert_eq!(
            (full.nodes.len(), full.revoked.len()),
            (MAX_NODES, MAX_REVOCATIONS)
        );
        for (nodes, revoked) in [(MAX_NODES + 1, 0), (0, MAX_REVOCATIONS + 1)] {
            let e = format!(
                "{:#}",
                Registry::parse(&document(nodes, revoked)).unwrap_err()
            );
            assert!(e.contains("invalid length"), "{e}");
        }
        // Tiny entries that are not a registry's are refused too.
        let e = Registry::parse(br#"{"revoked":[0,0,0]}"#).unwrap_err();
        assert!(format!("{e:#}").contains("invalid type"), "{e:#}");
        let names = |n: usize| vec![r#""n""#; n].join(",");
        let record = |n| format!(r#"{{"nodes":{{"a":{{"other_names":[{}]}}}}}}"#, names(n));
        Registry::parse(record(MAX_OTHER_NAMES).as_bytes()).unwrap();
        Registry::parse(record(MAX_OTHER_NAMES + 1).as_bytes()).unwrap_err();
        // Fields of another version are skipped, not kept.
        let other = format!(
            r#"{{"later":[{}],"nodes":{{}}}}"#,
            vec!["0"; 100_000].join(",")
        );
        assert_eq!(
            Registry::parse(other.as_bytes()).unwrap(),
            Registry::default()
        );

        let mut large = vec![b' '; MAX_REGISTRY_BYTES + 1];
        large[..2].copy_from_slice(b"{}");
        let e = format!("{:#}", Registry::parse(&large).unwrap_err());
        assert!(e.contains("more than a registry's"), "{e}");
        Registry::parse(&large[..MAX_REGISTRY_BYTES]).unwrap();
    }
}
