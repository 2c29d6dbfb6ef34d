//! The measurements file verifiers read:
//! `{"<pcr>": {"expected": "<hex>", "warnOnly": bool}}`, PCRs as decimal
//! strings in ascending order.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::pcr::Digest;

/// One expected PCR value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Expected {
    /// The PCR value, lowercase hex.
    pub expected: String,
    /// Whether a mismatch only logs a warning instead of failing.
    pub warn_only: bool,
}

/// Expected values by PCR index.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Measurements(BTreeMap<u32, Expected>);

impl Measurements {
    /// Records an enforced expectation for `pcr`.
    pub fn enforce(&mut self, pcr: u32, value: &Digest) {
        self.0.insert(
            pcr,
            Expected {
                expected: hex::encode(value),
                warn_only: false,
            },
        );
    }

    /// The expectation for `pcr`, if any.
    pub fn get(&self, pcr: u32) -> Option<&Expected> {
        self.0.get(&pcr)
    }

    /// The file's JSON text, pretty-printed.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_decimal_keys_in_numeric_order() -> Result<(), serde_json::Error> {
        let mut m = Measurements::default();
        m.enforce(11, &[0x11; 32]);
        m.enforce(4, &[0x04; 32]);
        m.enforce(9, &[0x09; 32]);
        let json = m.to_json()?;
        let v: serde_json::Value = serde_json::from_str(&json)?;
        assert_eq!(v["4"]["expected"], hex::encode([0x04; 32]));
        assert_eq!(v["11"]["warnOnly"], false);
        let (four, nine, eleven) = (json.find("\"4\""), json.find("\"9\""), json.find("\"11\""));
        assert!(four < nine && nine < eleven, "{json}");
        Ok(())
    }
}
