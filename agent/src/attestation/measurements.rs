//! The measurements file: the PCR values a verifier expects.
//!
//! JSON, `{"<pcr>": {"expected": "<hex>", "warnOnly": bool}}`, the format
//! Constellation's users already have; a plain hex string stands for an
//! enforced value. Parsing is strict: unknown keys, PCR indices outside
//! 0-23, bad hex and digests that are not 32 bytes are errors.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::measurement::{Digest32, HexDigest};

/// Largest accepted measurements file.
pub const MAX_MEASUREMENTS_BYTES: usize = 64 * 1024;

/// One expected PCR value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// The value.
    pub digest: Digest32,
    /// A mismatch is logged, not refused.
    pub warn_only: bool,
}

/// Expected values by PCR index.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
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
    /// A value is not 64 hex digits.
    #[error("measurements: PCR {pcr}: expected value is not 64 hex digits")]
    Digest {
        /// The PCR.
        pcr: u32,
    },
    /// The file is larger than [`MAX_MEASUREMENTS_BYTES`].
    #[error("measurements file is larger than {MAX_MEASUREMENTS_BYTES} bytes")]
    TooLarge,
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
            Some(a) => write!(f, "got {}", HexDigest(a)),
            None => f.write_str("not reported"),
        }
    }
}

impl Measurements {
    /// Parses a measurements file.
    pub fn parse(bytes: &[u8]) -> Result<Self, MeasurementsError> {
        if bytes.len() > MAX_MEASUREMENTS_BYTES {
            return Err(MeasurementsError::TooLarge);
        }
        let raw: BTreeMap<String, Entry> =
            serde_json::from_slice(bytes).map_err(MeasurementsError::Json)?;
        let mut out = BTreeMap::new();
        for (key, entry) in raw {
            let pcr: u32 = key
                .parse()
                .ok()
                .filter(|p: &u32| *p < 24 && key == p.to_string())
                .ok_or_else(|| MeasurementsError::Index(key.clone()))?;
            let (hex_value, warn_only) = match entry {
                Entry::Plain(h) => (h, false),
                Entry::Full(f) => (f.expected, f.warn_only),
            };
            let mut digest = [0u8; 32];
            hex::decode_to_slice(hex_value.trim(), &mut digest)
                .map_err(|_| MeasurementsError::Digest { pcr })?;
            out.insert(pcr, Expected { digest, warn_only });
        }
        Ok(Self(out))
    }

    /// Adds or replaces an expected value.
    pub fn insert(&mut self, pcr: u32, digest: Digest32, warn_only: bool) {
        self.0.insert(pcr, Expected { digest, warn_only });
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

    /// The file form, with every entry in the `{"expected", "warnOnly"}` shape.
    pub fn to_json(&self) -> String {
        let map: BTreeMap<String, FullEntry> = self
            .0
            .iter()
            .map(|(p, e)| {
                (
                    p.to_string(),
                    FullEntry {
                        expected: hex::encode(e.digest),
                        warn_only: e.warn_only,
                    },
                )
            })
            .collect();
        // Keys sorted numerically would need a custom map; lexical order is fine for JSON.
        serde_json::to_string_pretty(&map).unwrap_or_default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const H: &str = "0000000000000000000000000000000000000000000000000000000000000000";

    #[test]
    fn parses_both_forms_and_round_trips() {
        let m = Measurements::parse(
            format!(r#"{{"4": "{H}", "12": {{"expected": "{H}", "warnOnly": true}}}}"#).as_bytes(),
        )
        .unwrap();
        assert_eq!(m.iter().count(), 2);
        assert!(m.iter().any(|(p, e)| *p == 12 && e.warn_only));
        assert_eq!(Measurements::parse(m.to_json().as_bytes()).unwrap(), m);
    }

    #[test]
    fn strict_parsing() {
        let bad = [
            format!(r#"{{"24": "{H}"}}"#),
            format!(r#"{{"-1": "{H}"}}"#),
            format!(r#"{{"04": "{H}"}}"#),
            format!(r#"{{"pcr4": "{H}"}}"#),
            r#"{"4": "00"}"#.to_string(),
            format!(r#"{{"4": "{}"}}"#, "zz".repeat(32)),
            format!(r#"{{"4": {{"expected": "{H}", "warn": true}}}}"#),
            "[]".to_string(),
        ];
        for b in bad {
            assert!(Measurements::parse(b.as_bytes()).is_err(), "accepted {b}");
        }
    }

    #[test]
    fn compare_reports_each_mismatch() {
        let mut m = Measurements::default();
        m.insert(4, [1; 32], false);
        m.insert(9, [2; 32], true);
        m.insert(11, [3; 32], false);
        let actual = BTreeMap::from([(4, [1; 32]), (9, [0; 32])]);
        let mism = m.compare(&actual);
        assert_eq!(mism.len(), 2);
        assert_eq!(
            (mism[0].pcr, mism[0].warn_only, mism[0].actual),
            (9, true, Some([0; 32]))
        );
        assert_eq!((mism[1].pcr, mism[1].actual), (11, None));
        assert!(mism[1].to_string().contains("PCR 11: expected 0303"));
    }
}
