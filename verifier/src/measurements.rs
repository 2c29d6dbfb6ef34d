//! The measurements file: the PCR values a verifier expects.
//!
//! JSON, `{"<pcr>": {"expected": "<hex>", "warnOnly": bool}}`, the format
//! Constellation's users already have; a plain hex string stands for an
//! enforced value. Parsing is strict: unknown keys, repeated keys, PCR
//! indices outside 0-23, bad hex and digests that are not 32 bytes are
//! errors.
//!
//! A signed file may also carry `"epoch": <integer>`, the image's rollback
//! epoch: the operator raises it with each image that must replace the
//! ones before, and a control plane refuses a signed file whose epoch is
//! below that of an image it already made current (docs/attestation.md,
//! "Image rollback"). The epoch is not part of the set: [`Measurements`]
//! compare, digest and serialise without it ([`Measurements::parse_file`]
//! returns it beside the set).
//!
//! A set of measurements must also enforce something: it is refused when it
//! is empty, when every entry is warn-only, or when any PCR of
//! [`REQUIRED_PCRS`] (what the image and the agent measure) has no enforced
//! entry. A verifier holding such a set would accept a node that booted
//! anything. Every way to build a [`Measurements`] ([`Measurements::parse`],
//! [`Measurements::new`]) applies the rule, and the only mutation,
//! [`Measurements::require`], adds an enforced value, so no code can hold a
//! set that enforces less.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::measurement::{pcr, Digest32, HexDigest};

/// Largest accepted measurements file.
pub const MAX_MEASUREMENTS_BYTES: usize = 64 * 1024;

/// PCRs every set of measurements must enforce: the UKI as the firmware
/// loaded it (4), the kernel command line and initrd (9), the UKI's
/// sections (11) and the cluster part of the node config (12).
pub const REQUIRED_PCRS: [u32; 4] = [4, 9, 11, pcr::CONFIG];

/// The top-level key of a file's rollback epoch.
pub const EPOCH_KEY: &str = "epoch";

/// Number of PCRs of a bank; indices are below it.
const PCR_COUNT: u32 = 24;

/// One expected PCR value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// The value.
    pub digest: Digest32,
    /// A mismatch is logged, not refused.
    pub warn_only: bool,
}

impl Expected {
    /// An enforced value: a mismatch is refused.
    pub fn enforced(digest: Digest32) -> Self {
        Self {
            digest,
            warn_only: false,
        }
    }

    /// A warn-only value: a mismatch is logged.
    pub fn warn_only(digest: Digest32) -> Self {
        Self {
            digest,
            warn_only: true,
        }
    }
}

/// Expected values by PCR index; always enforces every PCR of
/// [`REQUIRED_PCRS`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Measurements(BTreeMap<u32, Expected>);

/// Why a measurements file was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MeasurementsError {
    /// Not JSON of the expected shape.
    #[error("measurements are not valid JSON of the form {{\"<pcr>\": {{\"expected\": \"<hex>\", \"warnOnly\": bool}}}}")]
    Json(#[source] serde_json::Error),
    /// A key is not a PCR index 0-23.
    #[error("measurements: {0:?} is not a PCR index (0 to 23)")]
    Index(String),
    /// A PCR is listed twice (JSON would silently keep the last).
    #[error("measurements: PCR key {0:?} appears more than once")]
    DuplicateKey(String),
    /// The rollback epoch is not an integer from 0 to 2^53 - 1 (what
    /// every JSON reader holds exactly).
    #[error("measurements: \"epoch\" is not an integer from 0 to 2^53 - 1")]
    Epoch,
    /// A value is not 64 hex digits.
    #[error("measurements: PCR {pcr}: expected value is not 64 hex digits")]
    Digest {
        /// The PCR.
        pcr: u32,
    },
    /// The file is larger than [`MAX_MEASUREMENTS_BYTES`].
    #[error("measurements file is larger than {MAX_MEASUREMENTS_BYTES} bytes")]
    TooLarge,
    /// No PCR is listed.
    #[error("measurements name no PCR: a verifier would accept a node that booted anything")]
    Empty,
    /// Every listed PCR is warn-only.
    #[error("measurements enforce no PCR (every entry is warnOnly): a verifier would accept a node that booted anything")]
    NothingEnforced,
    /// Some PCRs of [`REQUIRED_PCRS`] have no enforced entry.
    #[error(
        "measurements must enforce PCRs 4, 9, 11 and 12 (the image and the agent measure them): {}",
        unenforced(.missing, .warn_only)
    )]
    NotEnforced {
        /// Required PCRs that are not listed.
        missing: Vec<u32>,
        /// Required PCRs that are listed as warn-only.
        warn_only: Vec<u32>,
    },
}

fn unenforced(missing: &[u32], warn_only: &[u32]) -> String {
    let list = |pcrs: &[u32]| {
        pcrs.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("PCR {} missing", list(missing)));
    }
    if !warn_only.is_empty() {
        parts.push(format!("PCR {} warn-only", list(warn_only)));
    }
    parts.join("; ")
}

#[derive(Deserialize, Serialize)]
#[serde(untagged)]
enum Entry {
    Plain(String),
    Full(FullEntry),
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FullEntry {
    expected: String,
    #[serde(default)]
    warn_only: bool,
}

/// The file's top-level object with every key as written, in order, repeats
/// included, so that a repeated key can be refused by name; the epoch's
/// values apart.
struct RawEntries {
    entries: Vec<(String, Entry)>,
    epochs: Vec<serde_json::Number>,
}

/// Largest epoch: 2^53 - 1, the largest integer a JSON reader that keeps
/// numbers as doubles holds exactly.
pub const MAX_EPOCH: u64 = (1 << 53) - 1;

impl<'de> Deserialize<'de> for RawEntries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;

        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = RawEntries;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of PCR indices to expected values")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawEntries, A::Error> {
                let (mut entries, mut epochs) = (Vec::new(), Vec::new());
                while let Some(key) = map.next_key::<String>()? {
                    if key == EPOCH_KEY {
                        epochs.push(map.next_value()?);
                    } else {
                        entries.push((key, map.next_value()?));
                    }
                }
                Ok(RawEntries { entries, epochs })
            }
        }

        deserializer.deserialize_map(EntriesVisitor)
    }
}

/// A PCR whose value differs from the expected one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// The PCR.
    pub pcr: u32,
    /// The expected value.
    pub expected: Digest32,
    /// The value the node reported (`None`: not reported).
    pub actual: Option<Digest32>,
    /// Whether the mismatch is only logged.
    pub warn_only: bool,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PCR {}: expected {}, ",
            self.pcr,
            HexDigest(&self.expected)
        )?;
        match &self.actual {
            Some(a) => write!(f, "got {}", HexDigest(a))?,
            None => f.write_str("not reported")?,
        }
        if self.pcr == pcr::CLUSTER_ID && self.expected == [0; 32] && self.actual.is_some() {
            // Zero is required of a node outside any cluster.
            f.write_str(
                " (the node is already in a cluster: it was initialised, joined or recovered \
                 since it booted)",
            )?;
        }
        Ok(())
    }
}

impl Measurements {
    /// Parses a measurements file and checks that it enforces
    /// [`REQUIRED_PCRS`]; an epoch in it is checked and left out.
    pub fn parse(bytes: &[u8]) -> Result<Self, MeasurementsError> {
        Self::parse_file(bytes).map(|(set, _)| set)
    }

    /// [`Measurements::parse`], also returning the file's rollback epoch
    /// (0 where it names none).
    pub fn parse_file(bytes: &[u8]) -> Result<(Self, u64), MeasurementsError> {
        if bytes.len() > MAX_MEASUREMENTS_BYTES {
            return Err(MeasurementsError::TooLarge);
        }
        let RawEntries { entries, epochs } =
            serde_json::from_slice(bytes).map_err(MeasurementsError::Json)?;
        let epoch = match epochs.as_slice() {
            [] => 0,
            [one] => one
                .as_u64()
                .filter(|e| *e <= MAX_EPOCH)
                .ok_or(MeasurementsError::Epoch)?,
            _ => return Err(MeasurementsError::DuplicateKey(EPOCH_KEY.into())),
        };
        let mut out = BTreeMap::new();
        for (key, entry) in entries {
            let pcr: u32 = key
                .parse()
                .ok()
                .filter(|p: &u32| *p < PCR_COUNT && key == p.to_string())
                .ok_or_else(|| MeasurementsError::Index(key.clone()))?;
            let (hex_value, warn_only) = match entry {
                Entry::Plain(h) => (h, false),
                Entry::Full(f) => (f.expected, f.warn_only),
            };
            let mut digest = [0u8; 32];
            hex::decode_to_slice(hex_value.trim(), &mut digest)
                .map_err(|_| MeasurementsError::Digest { pcr })?;
            if out.insert(pcr, Expected { digest, warn_only }).is_some() {
                return Err(MeasurementsError::DuplicateKey(key));
            }
        }
        Ok((Self::checked(out)?, epoch))
    }

    /// A set from `entries`, under the same rules as [`Measurements::parse`]:
    /// indices 0-23, each PCR once, [`REQUIRED_PCRS`] enforced.
    pub fn new(
        entries: impl IntoIterator<Item = (u32, Expected)>,
    ) -> Result<Self, MeasurementsError> {
        let mut out = BTreeMap::new();
        for (pcr, expected) in entries {
            if pcr >= PCR_COUNT {
                return Err(MeasurementsError::Index(pcr.to_string()));
            }
            if out.insert(pcr, expected).is_some() {
                return Err(MeasurementsError::DuplicateKey(pcr.to_string()));
            }
        }
        Self::checked(out)
    }

    fn checked(map: BTreeMap<u32, Expected>) -> Result<Self, MeasurementsError> {
        if map.is_empty() {
            return Err(MeasurementsError::Empty);
        }
        if map.values().all(|e| e.warn_only) {
            return Err(MeasurementsError::NothingEnforced);
        }
        let (mut missing, mut warn_only) = (Vec::new(), Vec::new());
        for pcr in REQUIRED_PCRS {
            match map.get(&pcr) {
                None => missing.push(pcr),
                Some(e) if e.warn_only => warn_only.push(pcr),
                Some(_) => {}
            }
        }
        if !missing.is_empty() || !warn_only.is_empty() {
            return Err(MeasurementsError::NotEnforced { missing, warn_only });
        }
        Ok(Self(map))
    }

    /// Sets `pcr` to the enforced value `digest`, replacing any entry for it.
    /// The set only gets stricter: nothing can make an entry warn-only or
    /// remove it.
    pub fn require(&mut self, pcr: u32, digest: Digest32) {
        self.0.insert(pcr, Expected::enforced(digest));
    }

    /// The expected value of `pcr`, if the set has one.
    pub fn get(&self, pcr: u32) -> Option<&Expected> {
        self.0.get(&pcr)
    }

    /// The expected values.
    pub fn iter(&self) -> impl Iterator<Item = (&u32, &Expected)> {
        self.0.iter()
    }

    /// Compares reported values with the expected ones; returns every mismatch.
    pub fn compare(&self, actual: &BTreeMap<u32, Digest32>) -> Vec<Mismatch> {
        self.0
            .iter()
            .filter_map(|(&pcr, e)| {
                let got = actual.get(&pcr).copied();
                (got != Some(e.digest)).then_some(Mismatch {
                    pcr,
                    expected: e.digest,
                    actual: got,
                    warn_only: e.warn_only,
                })
            })
            .collect()
    }

    /// SHA-256 of [`Measurements::to_json`]: the name of a set, as the
    /// operator API reports it and as [`crate::validator::Verified`] says
    /// which set a node matched.
    pub fn digest(&self) -> Digest32 {
        use sha2::Digest as _;
        sha2::Sha256::digest(self.to_json().as_bytes()).into()
    }

    /// Whether this set enforces every PCR of `pcrs` with the value `own`
    /// holds for it: the image of a node whose PCRs are `own`.
    pub fn describes(&self, pcrs: &[u32], own: &BTreeMap<u32, Digest32>) -> bool {
        pcrs.iter().all(|index| {
            self.get(*index)
                .is_some_and(|e| !e.warn_only && own.get(index) == Some(&e.digest))
        })
    }

    /// The entries in the file's `{"expected", "warnOnly"}` shape, by PCR.
    fn entries(&self) -> BTreeMap<String, FullEntry> {
        self.0
            .iter()
            .map(|(p, e)| {
                let entry = FullEntry {
                    expected: hex::encode(e.digest),
                    warn_only: e.warn_only,
                };
                (p.to_string(), entry)
            })
            .collect()
    }

    /// The file form, with every entry in the `{"expected", "warnOnly"}` shape.
    pub fn to_json(&self) -> String {
        // Keys sorted numerically would need a custom map; lexical order is fine for JSON.
        serde_json::to_string_pretty(&self.entries()).unwrap_or_default()
    }

    /// The file form with the rollback epoch `epoch` (no key where it is 0,
    /// which is what a file without one means).
    pub fn to_json_with_epoch(&self, epoch: u64) -> String {
        if epoch == 0 {
            return self.to_json();
        }
        let mut map = serde_json::Map::new();
        map.insert(EPOCH_KEY.into(), epoch.into());
        for (pcr, entry) in self.entries() {
            map.insert(pcr, serde_json::to_value(entry).unwrap_or_default());
        }
        serde_json::to_string_pretty(&map).unwrap_or_default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    const H: &str = "0000000000000000000000000000000000000000000000000000000000000000";

    /// Entries for the required PCRs (all enforced) followed by `extra`.
    fn file(extra: &str) -> String {
        let required: Vec<String> = REQUIRED_PCRS
            .iter()
            .map(|p| format!(r#""{p}": "{H}""#))
            .collect();
        let mut all = required.join(", ");
        if !extra.is_empty() {
            all.push_str(", ");
            all.push_str(extra);
        }
        format!("{{{all}}}")
    }

    fn enforced(pcrs: &[u32]) -> Vec<(u32, Expected)> {
        pcrs.iter()
            .map(|&p| (p, Expected::enforced([0; 32])))
            .collect()
    }

    #[test]
    fn parses_both_forms_and_round_trips() {
        let m = Measurements::parse(
            file(&format!(r#""13": {{"expected": "{H}", "warnOnly": true}}"#)).as_bytes(),
        )
        .unwrap();
        assert_eq!(m.iter().count(), 5);
        assert!(m.iter().any(|(p, e)| *p == 13 && e.warn_only));
        assert!(m
            .iter()
            .filter(|(p, _)| **p != 13)
            .all(|(_, e)| !e.warn_only));
        assert_eq!(Measurements::parse(m.to_json().as_bytes()).unwrap(), m);
    }

    #[test]
    fn strict_parsing() {
        let bad = [
            file(&format!(r#""24": "{H}""#)),
            file(&format!(r#""-1": "{H}""#)),
            file(&format!(r#""04": "{H}""#)),
            file(&format!(r#""pcr4": "{H}""#)),
            file(r#""13": "00""#),
            file(&format!(r#""13": "{}""#, "zz".repeat(32))),
            file(&format!(r#""13": {{"expected": "{H}", "warn": true}}"#)),
            file(&format!(
                r#""13": {{"expected": "{H}", "expected": "{H}"}}"#
            )),
            "[]".to_string(),
            format!("{H:?}"),
        ];
        for b in bad {
            assert!(Measurements::parse(b.as_bytes()).is_err(), "accepted {b}");
        }
        // The same files without the bad entry are fine: the rejections
        // above are for that entry.
        Measurements::parse(file("").as_bytes()).unwrap();
    }

    #[test]
    fn an_epoch_is_read_apart_from_the_set_and_checked() {
        let plain = Measurements::parse(file("").as_bytes()).unwrap();
        assert_eq!(Measurements::parse_file(file("").as_bytes()).unwrap().1, 0);
        let (set, epoch) = Measurements::parse_file(file(r#""epoch": 7"#).as_bytes()).unwrap();
        assert_eq!((&set, epoch), (&plain, 7));
        // The set, its digest and its JSON are those of the file without
        // the epoch; the file form with one reads back to both.
        assert_eq!(set.digest(), plain.digest());
        let with = set.to_json_with_epoch(7);
        assert_eq!(
            Measurements::parse_file(with.as_bytes()).unwrap(),
            (plain.clone(), 7)
        );
        assert_eq!(set.to_json_with_epoch(0), set.to_json());
        let largest = format!(r#""epoch": {MAX_EPOCH}"#);
        assert_eq!(
            Measurements::parse_file(file(&largest).as_bytes())
                .unwrap()
                .1,
            MAX_EPOCH
        );
        // Numbers that are no such integer; values that are no number.
        for bad in [
            r#""epoch": -1"#.to_string(),
            r#""epoch": 1.5"#.to_string(),
            format!(r#""epoch": {}"#, MAX_EPOCH + 1),
            "\"epoch\": 1e3".to_string(),
        ] {
            let err = Measurements::parse(file(&bad).as_bytes()).unwrap_err();
            assert!(matches!(err, MeasurementsError::Epoch), "{bad}: {err:?}");
        }
        for bad in [r#""epoch": "7""#, r#""epoch": null"#, r#""epoch": [7]"#] {
            let err = Measurements::parse(file(bad).as_bytes()).unwrap_err();
            assert!(matches!(err, MeasurementsError::Json(_)), "{bad}: {err:?}");
        }
        // Twice, even with one value: which one counts would be the
        // reader's choice.
        let err = Measurements::parse(file(r#""epoch": 7, "epoch": 7"#).as_bytes()).unwrap_err();
        assert!(
            matches!(err, MeasurementsError::DuplicateKey(ref k) if k == EPOCH_KEY),
            "{err:?}"
        );
    }

    #[test]
    fn an_empty_set_is_refused() {
        let err = Measurements::parse(b"{}").unwrap_err();
        assert!(matches!(err, MeasurementsError::Empty), "{err:?}");
        assert!(err.to_string().contains("name no PCR"), "{err}");
        let err = Measurements::new([]).unwrap_err();
        assert!(matches!(err, MeasurementsError::Empty), "{err:?}");
    }

    #[test]
    fn an_all_warn_only_set_is_refused() {
        let entries: Vec<String> = [4, 9, 11, 12, 13]
            .iter()
            .map(|p| format!(r#""{p}": {{"expected": "{H}", "warnOnly": true}}"#))
            .collect();
        let json = format!("{{{}}}", entries.join(", "));
        let err = Measurements::parse(json.as_bytes()).unwrap_err();
        assert!(matches!(err, MeasurementsError::NothingEnforced), "{err:?}");
        assert!(err.to_string().contains("enforce no PCR"), "{err}");
        let err = Measurements::new([(12, Expected::warn_only([0; 32]))]).unwrap_err();
        assert!(matches!(err, MeasurementsError::NothingEnforced), "{err:?}");
    }

    #[test]
    fn each_missing_required_pcr_is_refused_by_name() {
        for missing in REQUIRED_PCRS {
            let entries: Vec<String> = REQUIRED_PCRS
                .iter()
                .chain(&[15])
                .filter(|&&p| p != missing)
                .map(|p| format!(r#""{p}": "{H}""#))
                .collect();
            let json = format!("{{{}}}", entries.join(", "));
            let err = Measurements::parse(json.as_bytes()).unwrap_err();
            match &err {
                MeasurementsError::NotEnforced {
                    missing: m,
                    warn_only,
                } => {
                    assert_eq!(
                        (m.as_slice(), warn_only.as_slice()),
                        (&[missing][..], &[][..])
                    );
                }
                other => panic!("PCR {missing}: {other:?}"),
            }
            let text = err.to_string();
            assert!(text.contains(&format!("PCR {missing} missing")), "{text}");

            let others: Vec<u32> = REQUIRED_PCRS
                .into_iter()
                .filter(|&p| p != missing)
                .collect();
            let err = Measurements::new(enforced(&others)).unwrap_err();
            assert!(
                matches!(&err, MeasurementsError::NotEnforced { missing: m, .. } if m == &[missing]),
                "PCR {missing}: {err:?}"
            );
        }
    }

    #[test]
    fn a_warn_only_required_pcr_is_refused_by_name() {
        let json = format!(
            r#"{{"4": "{H}", "9": "{H}", "11": "{H}", "12": {{"expected": "{H}", "warnOnly": true}}}}"#
        );
        let err = Measurements::parse(json.as_bytes()).unwrap_err();
        match &err {
            MeasurementsError::NotEnforced { missing, warn_only } => {
                assert!(missing.is_empty(), "{err:?}");
                assert_eq!(warn_only, &[12]);
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("PCR 12 warn-only"), "{err}");

        // Several at once are all named.
        let err = Measurements::parse(
            format!(r#"{{"4": "{H}", "11": {{"expected": "{H}", "warnOnly": true}}}}"#).as_bytes(),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("PCR 9, 12 missing; PCR 11 warn-only"),
            "{text}"
        );
    }

    #[test]
    fn a_repeated_key_is_refused_by_name() {
        // serde_json into a map would keep the second, warn-only, entry.
        let json = file(&format!(r#""12": {{"expected": "{H}", "warnOnly": true}}"#));
        let err = Measurements::parse(json.as_bytes()).unwrap_err();
        assert!(
            matches!(&err, MeasurementsError::DuplicateKey(k) if k == "12"),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("\"12\" appears more than once"),
            "{err}"
        );
        // The same key spelled with a JSON escape is the same key.
        let json = file(&format!(r#""\u0031\u0033": "{H}", "13": "{H}""#));
        let err = Measurements::parse(json.as_bytes()).unwrap_err();
        assert!(
            matches!(&err, MeasurementsError::DuplicateKey(k) if k == "13"),
            "{err:?}"
        );
        let mut entries = enforced(&REQUIRED_PCRS);
        entries.push((4, Expected::warn_only([1; 32])));
        let err = Measurements::new(entries).unwrap_err();
        assert!(
            matches!(&err, MeasurementsError::DuplicateKey(k) if k == "4"),
            "{err:?}"
        );
    }

    #[test]
    fn new_applies_the_index_rule_and_require_only_strengthens() {
        let mut entries = enforced(&REQUIRED_PCRS);
        entries.push((24, Expected::enforced([0; 32])));
        assert!(matches!(
            Measurements::new(entries).unwrap_err(),
            MeasurementsError::Index(_)
        ));
        let mut entries = enforced(&REQUIRED_PCRS);
        entries.push((15, Expected::warn_only([0; 32])));
        let mut m = Measurements::new(entries).unwrap();
        m.require(15, [5; 32]);
        m.require(16, [6; 32]);
        assert!(m.iter().all(|(_, e)| !e.warn_only));
        assert!(m.iter().any(|(p, e)| *p == 15 && e.digest == [5; 32]));
        assert_eq!(m.iter().count(), 6);
    }

    #[test]
    fn compare_reports_each_mismatch() {
        let mut entries = enforced(&REQUIRED_PCRS);
        entries.push((13, Expected::warn_only([2; 32])));
        let m = Measurements::new(entries).unwrap();
        let actual = BTreeMap::from([(4, [0; 32]), (9, [0; 32]), (12, [0; 32]), (13, [1; 32])]);
        let mism = m.compare(&actual);
        assert_eq!(mism.len(), 2);
        assert_eq!((mism[0].pcr, mism[0].actual), (11, None));
        assert!(!mism[0].warn_only);
        assert!(mism[0].to_string().contains("PCR 11: expected 0000"));
        assert_eq!(
            (mism[1].pcr, mism[1].warn_only, mism[1].actual),
            (13, true, Some([1; 32]))
        );
        assert!(!mism[1].to_string().contains("already in a cluster"));
    }

    /// A PCR 15 that is not the zero a node outside any cluster has says
    /// why: the node is in a cluster (a second init, a recovery of a node
    /// that rejoined).
    #[test]
    fn a_set_cluster_id_pcr_is_explained() {
        let mut m = Measurements::new(enforced(&REQUIRED_PCRS)).unwrap();
        m.require(pcr::CLUSTER_ID, [0; 32]);
        let mut actual: BTreeMap<u32, Digest32> =
            REQUIRED_PCRS.iter().map(|&p| (p, [0; 32])).collect();
        actual.insert(pcr::CLUSTER_ID, [7; 32]);
        let mism = m.compare(&actual);
        assert_eq!(mism.len(), 1);
        let text = mism[0].to_string();
        assert!(text.starts_with("PCR 15: expected 0000"), "{text}");
        assert!(text.ends_with("(the node is already in a cluster: it was initialised, joined or recovered since it booted)"), "{text}");
    }
}
