//! Parsing of the few TPM 2.0 structures a verifier needs (TPMT_PUBLIC,
//! TPMS_ATTEST for quotes, TPMT_SIGNATURE for ECDSA), in pure Rust with
//! bounds checks on every read: the bytes come from a peer.

use sha2::{Digest as _, Sha256};

/// TPM_ALG_ID values used here.
pub mod alg {
    /// RSA.
    pub const RSA: u16 = 0x0001;
    /// AES.
    pub const AES: u16 = 0x0006;
    /// SHA-256.
    pub const SHA256: u16 = 0x000B;
    /// No algorithm.
    pub const NULL: u16 = 0x0010;
    /// ECDSA.
    pub const ECDSA: u16 = 0x0018;
    /// Elliptic-curve key.
    pub const ECC: u16 = 0x0023;
    /// CFB mode.
    pub const CFB: u16 = 0x0043;
}

/// TPMA_OBJECT bits.
pub mod attr {
    /// The key cannot be duplicated out of this TPM.
    pub const FIXED_TPM: u32 = 1 << 1;
    /// The key's parent cannot change.
    pub const FIXED_PARENT: u32 = 1 << 4;
    /// The TPM generated the sensitive part.
    pub const SENSITIVE_DATA_ORIGIN: u32 = 1 << 5;
    /// The admin role (ActivateCredential, among others) is given by the
    /// object's authPolicy rather than its authValue.
    pub const ADMIN_WITH_POLICY: u32 = 1 << 7;
    /// Signs only TPM-generated structures (quotes) when also `SIGN`.
    pub const RESTRICTED: u32 = 1 << 16;
    /// A decryption key.
    pub const DECRYPT: u32 = 1 << 17;
    /// A signing key.
    pub const SIGN: u32 = 1 << 18;
}

const TPM_GENERATED_VALUE: u32 = 0xff54_4347;
const TPM_ST_ATTEST_QUOTE: u16 = 0x8018;
/// Most bytes of a PCR selection bitmap a TPM takes (32 PCRs; TPMs with
/// the usual 24 take 3).
const PCR_SELECT_MAX: usize = 4;
const TPM_ECC_NIST_P256: u16 = 0x0003;

/// A structure that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {structure}: {reason}")]
pub struct WireError {
    /// Which structure.
    pub structure: &'static str,
    /// What is wrong.
    pub reason: &'static str,
}

struct Reader<'a> {
    buf: &'a [u8],
    structure: &'static str,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], structure: &'static str) -> Self {
        Self { buf, structure }
    }

    fn err(&self, reason: &'static str) -> WireError {
        WireError {
            structure: self.structure,
            reason,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(self.err("truncated"));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        let hi = u64::from(self.u32()?);
        let lo = u64::from(self.u32()?);
        Ok(hi << 32 | lo)
    }

    fn tpm2b(&mut self) -> Result<&'a [u8], WireError> {
        let n = usize::from(self.u16()?);
        self.take(n)
    }

    fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(self.err("trailing bytes"))
        }
    }
}

/// The public key a TPMT_PUBLIC carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublicKey {
    /// An ECC key: curve ID and the point's coordinates.
    Ecc {
        /// TPM_ECC_CURVE.
        curve: u16,
        /// X coordinate.
        x: Vec<u8>,
        /// Y coordinate.
        y: Vec<u8>,
        /// Signing scheme (TPM_ALG_ID) and its hash, if any.
        scheme: Option<(u16, u16)>,
    },
    /// An RSA key.
    Rsa {
        /// Key size in bits.
        bits: u16,
        /// Public exponent (0 in the structure means 65537).
        exponent: u32,
        /// Modulus, big-endian.
        modulus: Vec<u8>,
    },
}

/// A parsed TPMT_PUBLIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Public {
    /// The object's name algorithm.
    pub name_alg: u16,
    /// TPMA_OBJECT.
    pub attributes: u32,
    /// Symmetric algorithm of a storage/decryption key: (alg, key bits, mode).
    pub symmetric: Option<(u16, u16, u16)>,
    /// The key.
    pub key: PublicKey,
    /// The object's TPM name: nameAlg || SHA-256(TPMT_PUBLIC).
    pub name: Vec<u8>,
}

impl Public {
    /// Parses a marshalled TPMT_PUBLIC (SHA-256 name algorithm only).
    pub fn parse(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes, "TPMT_PUBLIC");
        let kind = r.u16()?;
        let name_alg = r.u16()?;
        if name_alg != alg::SHA256 {
            return Err(r.err("name algorithm is not SHA-256"));
        }
        let attributes = r.u32()?;
        let _auth_policy = r.tpm2b()?;
        let sym_alg = r.u16()?;
        let symmetric = if sym_alg == alg::NULL {
            None
        } else {
            Some((sym_alg, r.u16()?, r.u16()?))
        };
        let scheme_alg = r.u16()?;
        let scheme = if scheme_alg == alg::NULL {
            None
        } else {
            Some((scheme_alg, r.u16()?))
        };
        let key = match kind {
            alg::ECC => {
                let curve = r.u16()?;
                if r.u16()? != alg::NULL {
                    return Err(r.err("ECC KDF scheme is not NULL"));
                }
                let x = r.tpm2b()?.to_vec();
                let y = r.tpm2b()?.to_vec();
                PublicKey::Ecc {
                    curve,
                    x,
                    y,
                    scheme,
                }
            }
            alg::RSA => {
                let bits = r.u16()?;
                let exponent = r.u32()?;
                let modulus = r.tpm2b()?.to_vec();
                PublicKey::Rsa {
                    bits,
                    exponent,
                    modulus,
                }
            }
            _ => return Err(r.err("key type is neither RSA nor ECC")),
        };
        r.finish()?;
        let mut name = alg::SHA256.to_be_bytes().to_vec();
        name.extend_from_slice(&Sha256::digest(bytes));
        Ok(Self {
            name_alg,
            attributes,
            symmetric,
            key,
            name,
        })
    }

    /// The P-256 verifying key of an ECC NIST P-256 key.
    pub fn p256_key(&self) -> Result<p256::ecdsa::VerifyingKey, WireError> {
        let err = |reason| WireError {
            structure: "TPMT_PUBLIC",
            reason,
        };
        let PublicKey::Ecc { curve, x, y, .. } = &self.key else {
            return Err(err("not an ECC key"));
        };
        if *curve != TPM_ECC_NIST_P256 {
            return Err(err("curve is not NIST P-256"));
        }
        let point = p256::EncodedPoint::from_affine_coordinates(
            &left_pad32(x).ok_or(err("X coordinate too long"))?.into(),
            &left_pad32(y).ok_or(err("Y coordinate too long"))?.into(),
            false,
        );
        p256::ecdsa::VerifyingKey::from_encoded_point(&point).map_err(|_| err("point not on curve"))
    }
}

/// A parsed TPMS_ATTEST of type quote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuoteInfo {
    /// The signer's qualified name.
    pub qualified_signer: Vec<u8>,
    /// The caller's qualifying data (our nonce binding).
    pub extra_data: Vec<u8>,
    /// TPM clock in milliseconds.
    pub clock: u64,
    /// TPM reset counter.
    pub reset_count: u32,
    /// TPM restart counter.
    pub restart_count: u32,
    /// Quoted SHA-256 PCR indices, ascending.
    pub pcrs: Vec<u32>,
    /// SHA-256 over the quoted PCR values, in ascending index order.
    pub pcr_digest: Vec<u8>,
}

impl QuoteInfo {
    /// Parses a marshalled TPMS_ATTEST and requires it to be a TPM-generated quote.
    pub fn parse(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes, "TPMS_ATTEST");
        if r.u32()? != TPM_GENERATED_VALUE {
            return Err(r.err("magic is not TPM_GENERATED_VALUE"));
        }
        if r.u16()? != TPM_ST_ATTEST_QUOTE {
            return Err(r.err("not a quote"));
        }
        let qualified_signer = r.tpm2b()?.to_vec();
        let extra_data = r.tpm2b()?.to_vec();
        let clock = r.u64()?;
        let reset_count = r.u32()?;
        let restart_count = r.u32()?;
        let _safe = r.u8()?;
        let _firmware = r.u64()?;
        // Exactly one selection, of the SHA-256 bank. The TPM hashes the
        // selected values selection by selection, in the order the caller
        // gave them, so a quote over several selections of one bank (a TPM
        // takes up to one per bank it implements, repeats allowed) digests
        // its values in an order of the caller's choosing: with values
        // reported in ascending order, two PCRs' values could be swapped.
        // One selection is digested in ascending PCR order, as
        // [`crate::quote::pcr_digest`] recomputes it.
        if r.u32()? != 1 {
            return Err(r.err("not exactly one PCR selection"));
        }
        if r.u16()? != alg::SHA256 {
            return Err(r.err("selection of a bank other than SHA-256"));
        }
        let size = usize::from(r.u8()?);
        if size > PCR_SELECT_MAX {
            return Err(r.err("PCR selection larger than 32 PCRs"));
        }
        let select = r.take(size)?;
        let mut pcrs = Vec::new();
        for (byte_index, byte) in select.iter().enumerate() {
            for bit in 0..8 {
                if byte & (1 << bit) != 0 {
                    pcrs.push(u32::try_from(byte_index * 8 + bit).map_err(|_| r.err("PCR index"))?);
                }
            }
        }
        let pcr_digest = r.tpm2b()?.to_vec();
        r.finish()?;
        Ok(Self {
            qualified_signer,
            extra_data,
            clock,
            reset_count,
            restart_count,
            pcrs,
            pcr_digest,
        })
    }
}

/// An ECDSA signature from a TPMT_SIGNATURE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EcdsaSignature {
    /// The r scalar, 32 bytes.
    pub r: [u8; 32],
    /// The s scalar, 32 bytes.
    pub s: [u8; 32],
}

impl EcdsaSignature {
    /// Parses a marshalled TPMT_SIGNATURE that must be ECDSA with SHA-256.
    pub fn parse(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes, "TPMT_SIGNATURE");
        if r.u16()? != alg::ECDSA {
            return Err(r.err("not an ECDSA signature"));
        }
        if r.u16()? != alg::SHA256 {
            return Err(r.err("signature hash is not SHA-256"));
        }
        let sig_r = left_pad32(r.tpm2b()?).ok_or(r.err("r too long"))?;
        let sig_s = left_pad32(r.tpm2b()?).ok_or(r.err("s too long"))?;
        r.finish()?;
        Ok(Self { r: sig_r, s: sig_s })
    }
}

fn left_pad32(v: &[u8]) -> Option<[u8; 32]> {
    let v = match v.iter().position(|&b| b != 0) {
        Some(first) if v.len() > 32 => &v[first..],
        _ => v,
    };
    if v.len() > 32 {
        return None;
    }
    let mut out = [0u8; 32];
    out[32 - v.len()..].copy_from_slice(v);
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn truncated_structures_are_errors_not_panics() {
        let public = [0u8, 0x23, 0, 0x0b, 0, 0];
        for n in 0..public.len() {
            assert!(Public::parse(&public[..n]).is_err());
        }
        assert!(QuoteInfo::parse(&[0xff, 0x54, 0x43, 0x47, 0x80, 0x18, 0, 5, 1]).is_err());
        assert!(EcdsaSignature::parse(&[0, 0x18, 0, 0x0b, 0, 40]).is_err());
    }

    #[test]
    fn pads_short_scalars() {
        assert_eq!(left_pad32(&[1]).unwrap()[31], 1);
        let mut v = vec![0u8];
        v.extend_from_slice(&[0xff; 32]);
        assert_eq!(left_pad32(&v), Some([0xff; 32]));
        assert_eq!(left_pad32(&[1; 33]), None);
    }
}
