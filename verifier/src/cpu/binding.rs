//! How CPU evidence commits to the vTPM's attestation key, so a quote
//! signed by that key is rooted in the CPU.
//!
//! * [`Binding::Guest`]: the guest asked the CPU for the report itself
//!   (Linux configfs-tsm) with `report_data` = [`report_data`]`(root, AK)`,
//!   `root` being the root of the quoted batch ([`crate::batch`]), which
//!   holds this handshake's nonce: the report is fresh for this handshake
//!   and names this AK, and one report serves a batch like one quote does.
//! * [`Binding::AzureHcl`]: Azure's paravisor wrote an HCL report to the
//!   vTPM's NV index 0x01400001: the SNP report at offset 32, then an IGVM
//!   request header and the runtime-data JSON whose `keys[]` holds the
//!   vTPM's AK (`kid` `HCLAkPub`) as an RSA JWK; `report_data[0..32]` is
//!   SHA-256 of that JSON. The report is made at boot and carries no nonce:
//!   freshness comes from the quote (its qualifying data holds the nonce),
//!   which must then be signed by exactly the AK the JSON names. The quote
//!   check takes only P-256 AKs and that AK is RSA, so no such document
//!   validates yet (docs/attestation.md, "Not yet").

use std::fmt;

use base64::Engine as _;
use serde::Deserialize;
use sha2::{Digest as _, Sha256, Sha512};
use subtle::ConstantTimeEq as _;

use crate::tpm_wire::{Public, PublicKey};

/// Domain separator of the guest binding.
const CONTEXT: &[u8] = b"keel-cpu-evidence-v2";

/// HCL report layout (Azure confidential VMs).
mod hcl {
    pub const MAGIC: &[u8; 4] = b"HCLA";
    pub const REPORT_AT: usize = 32;
    pub const REPORT_END: usize = REPORT_AT + super::super::snp::REPORT_BYTES;
    pub const HEADER_END: usize = REPORT_END + 20;
    pub const REPORT_TYPE_SNP: u32 = 2;
    pub const HASH_TYPE_SHA256: u32 = 1;
    pub const MAX_RUNTIME_DATA: usize = 8 * 1024;
    pub const AK_KID: &str = "HCLAkPub";
}

/// How `report_data` binds the attestation key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Binding {
    /// The guest's own report: `report_data` = [`report_data`]`(root, AK)`.
    #[default]
    Guest,
    /// Azure's HCL report: `report_data` holds SHA-256 of runtime data
    /// that names the AK.
    AzureHcl,
}

impl fmt::Display for Binding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Guest => "guest",
            Self::AzureHcl => "azure-hcl",
        })
    }
}

/// Why evidence does not bind the attestation key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BindingError {
    /// The binding is not available for this variant.
    #[error("the {binding} binding is not supported for the {variant} variant")]
    Unsupported {
        /// The binding.
        binding: Binding,
        /// The variant.
        variant: super::Variant,
    },
    /// `report_data` does not commit to this nonce and AK.
    #[error("report_data: expected {expected}, actual {actual}")]
    ReportData {
        /// What this nonce and AK give (hex).
        expected: String,
        /// What the CPU signed (hex).
        actual: String,
    },
    /// The HCL report is malformed.
    #[error("HCL report {field}: {reason}")]
    Hcl {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// `report_data` does not hold the hash of the runtime data.
    #[error(
        "HCL report_data: expected SHA-256(runtime data) {expected} then zeros, actual {actual}"
    )]
    RuntimeDataHash {
        /// SHA-256 of the runtime data (hex).
        expected: String,
        /// What the CPU signed (hex).
        actual: String,
    },
    /// The runtime data names another AK than the document's.
    #[error("HCL runtime data names another attestation key than the document's")]
    AkMismatch,
    /// An HCL report comes from Azure's paravisor, at VMPL 0, whatever the
    /// config's VMPL for the guest binding: one for a less privileged level
    /// was asked for by guest code over a blob of its choosing.
    #[error("HCL report vmpl: expected 0 (the paravisor's), actual {actual}")]
    HclVmpl {
        /// The report's VMPL.
        actual: u32,
    },
}

/// `report_data` of the guest binding:
/// `SHA-512("keel-cpu-evidence-v2" || u16be(len(nonce)) || nonce || ak_public)`,
/// where `nonce` is the root of the quoted batch ([`crate::batch`], 32
/// bytes) and `ak_public` the marshalled TPMT_PUBLIC the document carries.
pub fn report_data(nonce: &[u8], ak_public: &[u8]) -> [u8; 64] {
    let mut h = Sha512::new();
    h.update(CONTEXT);
    let len = u16::try_from(nonce.len()).unwrap_or(u16::MAX);
    h.update(len.to_be_bytes());
    h.update(nonce);
    h.update(ak_public);
    h.finalize().into()
}

/// An Azure HCL report, split into its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HclReport<'a> {
    /// The SNP report (1184 bytes).
    pub report: &'a [u8],
    /// The runtime-data JSON.
    pub runtime_data: &'a [u8],
}

impl<'a> HclReport<'a> {
    /// Splits an HCL report (NV index 0x01400001's contents). Only SNP
    /// reports with SHA-256 runtime-data hashes are accepted.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, BindingError> {
        let bad = |field, reason: &str| BindingError::Hcl {
            field,
            reason: reason.into(),
        };
        if bytes.get(..4) != Some(hcl::MAGIC.as_slice()) {
            return Err(bad("header", "does not start with HCLA"));
        }
        let header = bytes
            .get(hcl::REPORT_END..hcl::HEADER_END)
            .ok_or_else(|| bad("length", "shorter than its headers"))?;
        let word = |i: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&header[4 * i..4 * i + 4]);
            u32::from_le_bytes(w)
        };
        let (report_type, hash_type, size) = (word(2), word(3), word(4));
        if report_type != hcl::REPORT_TYPE_SNP {
            return Err(BindingError::Hcl {
                field: "report_type",
                reason: format!("expected {}, actual {report_type}", hcl::REPORT_TYPE_SNP),
            });
        }
        if hash_type != hcl::HASH_TYPE_SHA256 {
            return Err(BindingError::Hcl {
                field: "hash_type",
                reason: format!("expected {}, actual {hash_type}", hcl::HASH_TYPE_SHA256),
            });
        }
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        if size > hcl::MAX_RUNTIME_DATA {
            return Err(bad("variable_data_size", "larger than 8 KiB"));
        }
        let runtime_data = bytes
            .get(hcl::HEADER_END..hcl::HEADER_END + size)
            .ok_or_else(|| bad("variable_data_size", "beyond the end of the report"))?;
        Ok(Self {
            report: &bytes[hcl::REPORT_AT..hcl::REPORT_END],
            runtime_data,
        })
    }

    /// The AK the runtime data names: RSA modulus and public exponent,
    /// big-endian without leading zeros.
    pub fn attestation_key(&self) -> Result<(Vec<u8>, Vec<u8>), BindingError> {
        #[derive(Deserialize)]
        struct RuntimeData {
            keys: Vec<Jwk>,
        }
        #[derive(Deserialize)]
        struct Jwk {
            kid: String,
            kty: String,
            #[serde(default)]
            n: String,
            #[serde(default)]
            e: String,
        }
        let bad = |reason: String| BindingError::Hcl {
            field: "runtime data",
            reason,
        };
        let data: RuntimeData =
            serde_json::from_slice(self.runtime_data).map_err(|e| bad(e.to_string()))?;
        let mut named = data.keys.iter().filter(|k| k.kid == hcl::AK_KID);
        let key = match (named.next(), named.next()) {
            (Some(k), None) => k,
            (None, _) => return Err(bad(format!("no key {}", hcl::AK_KID))),
            (Some(_), Some(_)) => return Err(bad(format!("key {} repeated", hcl::AK_KID))),
        };
        if key.kty != "RSA" {
            return Err(bad(format!(
                "{} is a {} key, not RSA",
                hcl::AK_KID,
                key.kty
            )));
        }
        let b64 = |s: &str| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(s.trim_end_matches('='))
                .map(|v| strip_zeros(&v).to_vec())
                .map_err(|e| bad(format!("{} is not base64url: {e}", hcl::AK_KID)))
        };
        Ok((b64(&key.n)?, b64(&key.e)?))
    }
}

fn strip_zeros(v: &[u8]) -> &[u8] {
    let start = v.iter().position(|b| *b != 0).unwrap_or(v.len());
    &v[start..]
}

impl Binding {
    /// The SNP report within `evidence`.
    pub fn snp_report(self, evidence: &[u8]) -> Result<&[u8], BindingError> {
        match self {
            Self::Guest => Ok(evidence),
            Self::AzureHcl => Ok(HclReport::parse(evidence)?.report),
        }
    }

    /// Checks that `report_data`, which the CPU signed, commits to
    /// `ak_public` (and, for the guest binding, to `nonce`).
    pub fn check(
        self,
        evidence: &[u8],
        report_data: &[u8; 64],
        ak_public: &[u8],
        nonce: &[u8],
    ) -> Result<(), BindingError> {
        match self {
            Self::Guest => {
                let expected = self::report_data(nonce, ak_public);
                if bool::from(expected.ct_eq(report_data)) {
                    Ok(())
                } else {
                    Err(BindingError::ReportData {
                        expected: hex::encode(expected),
                        actual: hex::encode(report_data),
                    })
                }
            }
            Self::AzureHcl => {
                let hcl = HclReport::parse(evidence)?;
                let mut expected = [0u8; 64];
                expected[..32].copy_from_slice(&Sha256::digest(hcl.runtime_data));
                if !bool::from(expected.ct_eq(report_data)) {
                    return Err(BindingError::RuntimeDataHash {
                        expected: hex::encode(&expected[..32]),
                        actual: hex::encode(report_data),
                    });
                }
                let (n, e) = hcl.attestation_key()?;
                let ak = Public::parse(ak_public).map_err(|_| BindingError::AkMismatch)?;
                match ak.key {
                    PublicKey::Rsa {
                        modulus, exponent, ..
                    } => {
                        let exponent = if exponent == 0 { 65537 } else { exponent };
                        let exponent = exponent.to_be_bytes();
                        if strip_zeros(&modulus) == n.as_slice()
                            && strip_zeros(&exponent) == e.as_slice()
                        {
                            Ok(())
                        } else {
                            Err(BindingError::AkMismatch)
                        }
                    }
                    PublicKey::Ecc { .. } => Err(BindingError::AkMismatch),
                }
            }
        }
    }
}
