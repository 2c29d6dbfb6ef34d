//! Quote verification without a TPM: the attestation key's properties, the
//! ECDSA signature, the qualifying data and the PCR digest.

use std::collections::BTreeMap;

use sha2::{Digest as _, Sha256};

use crate::measurement::Digest32;
use crate::tpm_wire::{alg, attr, EcdsaSignature, Public, PublicKey, QuoteInfo, WireError};

/// Domain separator of the qualifying data.
const QUALIFYING_DATA_CONTEXT: &[u8] = b"keel-quote-v2";

/// Why a quote does not verify. Each check has its own variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuoteError {
    /// A structure does not parse.
    #[error(transparent)]
    Malformed(#[from] WireError),
    /// The AK lacks a required attribute or has a forbidden one.
    #[error("attestation key attributes: {0}")]
    AkAttributes(&'static str),
    /// The AK is not a P-256 ECDSA-SHA256 key.
    #[error("attestation key is not an ECC P-256 ECDSA-SHA256 signing key")]
    AkKeyType,
    /// The signature does not verify with the AK.
    #[error("quote signature does not verify with the attestation key")]
    Signature,
    /// The quote was made for another batch: the root recomputed from
    /// this nonce, the user data and the inclusion path is not the one it
    /// carries.
    #[error(
        "quote qualifying data does not match this nonce, user data and batch path \
         (the nonce is not in the quoted batch)"
    )]
    QualifyingData,
    /// The quoted PCR set differs from the reported values.
    #[error("quote covers PCRs {quoted:?} but values are given for {reported:?}")]
    PcrSelection {
        /// PCRs in the quote.
        quoted: Vec<u32>,
        /// PCRs with reported values.
        reported: Vec<u32>,
    },
    /// The reported PCR values do not hash to the quoted digest.
    #[error("reported PCR values do not match the quoted PCR digest")]
    PcrDigest,
}

/// The qualifying data of a quote over the batch whose tree has `root`
/// ([`crate::batch`]): `SHA-256("keel-quote-v2" || root)`.
pub fn qualifying_data(root: &Digest32) -> Digest32 {
    let mut h = Sha256::new();
    h.update(QUALIFYING_DATA_CONTEXT);
    h.update(root);
    h.finalize().into()
}

/// The TPM's PCR digest: SHA-256 over the values in ascending index order.
pub fn pcr_digest(values: &BTreeMap<u32, Digest32>) -> Digest32 {
    let mut h = Sha256::new();
    for v in values.values() {
        h.update(v);
    }
    h.finalize().into()
}

/// Checks that `ak` is fit to attest: a TPM-resident, restricted signing key.
pub fn check_ak(ak: &Public) -> Result<(), QuoteError> {
    let required = [
        (attr::FIXED_TPM, "not fixedTPM"),
        (attr::FIXED_PARENT, "not fixedParent"),
        (attr::SENSITIVE_DATA_ORIGIN, "not sensitiveDataOrigin"),
        (attr::RESTRICTED, "not restricted"),
        (attr::SIGN, "not a signing key"),
    ];
    for (bit, what) in required {
        if ak.attributes & bit == 0 {
            return Err(QuoteError::AkAttributes(what));
        }
    }
    if ak.attributes & attr::DECRYPT != 0 {
        return Err(QuoteError::AkAttributes("is also a decryption key"));
    }
    // Key residency (ActivateCredential on the AK, an admin-role command)
    // must rest on the AK's authValue, which lives in its sensitive area:
    // an object loaded from its public area alone has none, so a TPM
    // cannot activate a credential for it. An authPolicy is in the public
    // area, where anyone who writes the area can set it.
    if ak.attributes & attr::ADMIN_WITH_POLICY != 0 {
        return Err(QuoteError::AkAttributes("admin role by policy"));
    }
    // A restricted signing key has no symmetric algorithm (a TPM refuses
    // one), and a parser reads its fields by the algorithm: none is one
    // reading of the public area for every reader.
    if ak.symmetric.is_some() {
        return Err(QuoteError::AkAttributes("has a symmetric algorithm"));
    }
    match &ak.key {
        PublicKey::Ecc {
            scheme: Some((alg::ECDSA, alg::SHA256)),
            ..
        } => Ok(()),
        _ => Err(QuoteError::AkKeyType),
    }
}

/// Verifies a quote made by `ak` over `values` for `qualifying`.
/// Returns the parsed quote.
pub fn verify_quote(
    ak: &Public,
    attest: &[u8],
    signature: &[u8],
    qualifying: &Digest32,
    values: &BTreeMap<u32, Digest32>,
) -> Result<QuoteInfo, QuoteError> {
    check_ak(ak)?;
    // Parsing the key checks that the point is on the curve.
    let key = ak.p256_key().map_err(|_| QuoteError::AkKeyType)?;
    let sig = EcdsaSignature::parse(signature)?;
    let mut fixed = [0u8; 64];
    fixed[..32].copy_from_slice(&sig.r);
    fixed[32..].copy_from_slice(&sig.s);
    // ECDSA over SHA-256(attest), as the TPM signs it.
    ring::signature::UnparsedPublicKey::new(
        &ring::signature::ECDSA_P256_SHA256_FIXED,
        key.to_encoded_point(false).as_bytes(),
    )
    .verify(attest, &fixed)
    .map_err(|_| QuoteError::Signature)?;
    let info = QuoteInfo::parse(attest)?;
    if info.extra_data.as_slice() != qualifying.as_slice() {
        return Err(QuoteError::QualifyingData);
    }
    let reported: Vec<u32> = values.keys().copied().collect();
    if info.pcrs != reported {
        return Err(QuoteError::PcrSelection {
            quoted: info.pcrs.clone(),
            reported,
        });
    }
    if info.pcr_digest.as_slice() != pcr_digest(values).as_slice() {
        return Err(QuoteError::PcrDigest);
    }
    Ok(info)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use ring::rand::SystemRandom;
    use ring::signature::{EcdsaKeyPair, KeyPair as _, ECDSA_P256_SHA256_FIXED_SIGNING};

    use super::*;

    /// A software P-256 key and the TPMT_PUBLIC of an AK with its point
    /// (the attributes a TPM-resident AK has: only residency tells them
    /// apart, and that is not this module's check).
    fn ak() -> (EcdsaKeyPair, Public) {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .unwrap();
        let point = key.public_key().as_ref();
        let attributes = attr::FIXED_TPM
            | attr::FIXED_PARENT
            | attr::SENSITIVE_DATA_ORIGIN
            | (1 << 6) // userWithAuth
            | attr::RESTRICTED
            | attr::SIGN;
        let mut public = Vec::new();
        public.extend_from_slice(&alg::ECC.to_be_bytes());
        public.extend_from_slice(&alg::SHA256.to_be_bytes());
        public.extend_from_slice(&attributes.to_be_bytes());
        public.extend_from_slice(&0u16.to_be_bytes()); // authPolicy
        public.extend_from_slice(&alg::NULL.to_be_bytes()); // symmetric
        public.extend_from_slice(&alg::ECDSA.to_be_bytes());
        public.extend_from_slice(&alg::SHA256.to_be_bytes());
        public.extend_from_slice(&0x0003u16.to_be_bytes()); // NIST P-256
        public.extend_from_slice(&alg::NULL.to_be_bytes()); // KDF
        for coordinate in [&point[1..33], &point[33..65]] {
            public.extend_from_slice(&32u16.to_be_bytes());
            public.extend_from_slice(coordinate);
        }
        (key, Public::parse(&public).unwrap())
    }

    /// A TPMS_ATTEST of a quote with these SHA-256 selections, its digest
    /// made as a TPM makes it: selection by selection, each in ascending
    /// PCR order.
    fn attest(
        qualifying: &Digest32,
        selections: &[&[u32]],
        pcrs: &BTreeMap<u32, Digest32>,
    ) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&0xff54_4347u32.to_be_bytes());
        a.extend_from_slice(&0x8018u16.to_be_bytes());
        a.extend_from_slice(&0u16.to_be_bytes()); // qualifiedSigner
        a.extend_from_slice(&32u16.to_be_bytes());
        a.extend_from_slice(qualifying);
        a.extend_from_slice(&[0; 8 + 4 + 4 + 1 + 8]); // clock info, firmware
        a.extend_from_slice(&(selections.len() as u32).to_be_bytes());
        let mut digest = Sha256::new();
        for selection in selections {
            let mut bitmap = [0u8; 3];
            for &pcr in *selection {
                bitmap[pcr as usize / 8] |= 1 << (pcr % 8);
            }
            a.extend_from_slice(&alg::SHA256.to_be_bytes());
            a.push(3);
            a.extend_from_slice(&bitmap);
            let mut sorted = selection.to_vec();
            sorted.sort_unstable();
            for pcr in sorted {
                digest.update(pcrs[&pcr]);
            }
        }
        a.extend_from_slice(&32u16.to_be_bytes());
        a.extend_from_slice(&digest.finalize());
        a
    }

    fn sign(key: &EcdsaKeyPair, attest: &[u8]) -> Vec<u8> {
        let rs = key.sign(&SystemRandom::new(), attest).unwrap();
        let mut signature = Vec::new();
        signature.extend_from_slice(&alg::ECDSA.to_be_bytes());
        signature.extend_from_slice(&alg::SHA256.to_be_bytes());
        for scalar in [&rs.as_ref()[..32], &rs.as_ref()[32..]] {
            signature.extend_from_slice(&32u16.to_be_bytes());
            signature.extend_from_slice(scalar);
        }
        signature
    }

    fn values(pcrs: std::ops::RangeInclusive<u32>) -> BTreeMap<u32, Digest32> {
        pcrs.map(|i| (i, [i as u8 + 1; 32])).collect()
    }

    /// An AK must be a TPM-resident, restricted, signing-only key; each
    /// property is checked on its own. Without fixedTPM, fixedParent or
    /// sensitiveDataOrigin, the key may have been made outside the TPM or
    /// duplicated out of it, and whoever holds a copy could sign quotes
    /// (credential activation proves the key is loaded in the EK's TPM,
    /// not that it never left one).
    #[test]
    fn an_ak_lacking_any_required_property_is_refused() {
        let (key, ak) = ak();
        assert_eq!(check_ak(&ak), Ok(()));
        let qualifying = [9; 32];
        let pcrs = values(0..=3);
        let all: Vec<u32> = pcrs.keys().copied().collect();
        let attest = attest(&qualifying, &[&all], &pcrs);
        let signature = sign(&key, &attest);
        assert!(verify_quote(&ak, &attest, &signature, &qualifying, &pcrs).is_ok());
        for (bit, what) in [
            (attr::FIXED_TPM, "not fixedTPM"),
            (attr::FIXED_PARENT, "not fixedParent"),
            (attr::SENSITIVE_DATA_ORIGIN, "not sensitiveDataOrigin"),
            (attr::RESTRICTED, "not restricted"),
            (attr::SIGN, "not a signing key"),
        ] {
            let mut weak = ak.clone();
            weak.attributes &= !bit;
            assert_eq!(check_ak(&weak), Err(QuoteError::AkAttributes(what)));
            // A quote it signed is refused, its signature good.
            assert_eq!(
                verify_quote(&weak, &attest, &signature, &qualifying, &pcrs),
                Err(QuoteError::AkAttributes(what))
            );
        }
        let mut decrypting = ak.clone();
        decrypting.attributes |= attr::DECRYPT;
        assert_eq!(
            check_ak(&decrypting),
            Err(QuoteError::AkAttributes("is also a decryption key"))
        );
        // Whoever writes a public area can give it a policy for the admin
        // role; residency must not depend on whether a TPM honours one for
        // an object it holds only the public area of.
        let mut by_policy = ak.clone();
        by_policy.attributes |= attr::ADMIN_WITH_POLICY;
        assert_eq!(
            verify_quote(&by_policy, &attest, &signature, &qualifying, &pcrs),
            Err(QuoteError::AkAttributes("admin role by policy"))
        );
        // A symmetric algorithm (XOR, whose mode a TPM does not read)
        // would let two parsers read different public areas.
        let mut symmetric = ak.clone();
        symmetric.symmetric = Some((0x000a, 128, alg::CFB));
        assert_eq!(
            verify_quote(&symmetric, &attest, &signature, &qualifying, &pcrs),
            Err(QuoteError::AkAttributes("has a symmetric algorithm"))
        );
        for scheme in [
            None,
            Some((alg::ECDSA, 0x000c)),
            Some((0x001a, alg::SHA256)),
        ] {
            let mut other = ak.clone();
            if let PublicKey::Ecc { scheme: s, .. } = &mut other.key {
                *s = scheme;
            }
            assert_eq!(check_ak(&other), Err(QuoteError::AkKeyType), "{scheme:?}");
        }
    }

    #[test]
    fn a_quote_of_one_selection_verifies() {
        let (key, ak) = ak();
        let qualifying = [9; 32];
        let pcrs = values(0..=16);
        let all: Vec<u32> = pcrs.keys().copied().collect();
        let attest = attest(&qualifying, &[&all], &pcrs);
        let info = verify_quote(&ak, &attest, &sign(&key, &attest), &qualifying, &pcrs).unwrap();
        assert_eq!(info.pcrs, all);
        // The same quote with two values swapped no longer matches.
        let mut swapped = pcrs.clone();
        swapped.insert(4, pcrs[&16]);
        swapped.insert(16, pcrs[&4]);
        assert_eq!(
            verify_quote(&ak, &attest, &sign(&key, &attest), &qualifying, &swapped),
            Err(QuoteError::PcrDigest)
        );
    }

    /// The attack: a quote whose selections put PCR 16 (resettable, so
    /// free to hold anything) where PCR 4 goes in ascending order, and PCR
    /// 4 last. Its digest is that of the values in ascending order with
    /// PCRs 4 and 16 swapped, so reporting them swapped would pass a
    /// verifier that merges the selections: PCR 4 would read as the value
    /// in PCR 16.
    #[test]
    fn a_quote_of_several_selections_of_one_bank_is_refused() {
        let (key, ak) = ak();
        let qualifying = [9; 32];
        let real = values(0..=16);
        let attest = attest(
            &qualifying,
            &[
                &[0, 1, 2, 3, 16],
                &[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
                &[4],
            ],
            &real,
        );
        let mut reported = real.clone();
        reported.insert(4, real[&16]);
        reported.insert(16, real[&4]);
        // The reported values in ascending order hash to the quoted digest.
        assert_eq!(
            pcr_digest(&reported).as_slice(),
            &attest[attest.len() - 32..]
        );
        let refused = verify_quote(&ak, &attest, &sign(&key, &attest), &qualifying, &reported);
        assert!(
            matches!(refused, Err(QuoteError::Malformed(_))),
            "{refused:?}"
        );
        // Two selections that do not overlap, in ascending order, are
        // refused all the same: one selection is the only shape a node's
        // quote has.
        let attest = attest_split(&qualifying, &real);
        let refused = verify_quote(&ak, &attest, &sign(&key, &attest), &qualifying, &real);
        assert!(
            matches!(refused, Err(QuoteError::Malformed(_))),
            "{refused:?}"
        );
    }

    fn attest_split(qualifying: &Digest32, pcrs: &BTreeMap<u32, Digest32>) -> Vec<u8> {
        let low: Vec<u32> = (0..8).collect();
        let high: Vec<u32> = (8..=16).collect();
        attest(qualifying, &[&low, &high], pcrs)
    }

    #[test]
    fn an_oversized_or_foreign_selection_is_refused() {
        let (key, ak) = ak();
        let qualifying = [9; 32];
        let pcrs = values(0..=3);
        let good = attest(&qualifying, &[&[0, 1, 2, 3]], &pcrs);
        // The selection starts after magic, type, the two 2Bs (0 and 32
        // bytes), clock info and firmware, and the count.
        let hash_at = 4 + 2 + 2 + 2 + 32 + 25 + 4;
        let mut foreign = good.clone();
        foreign[hash_at..hash_at + 2].copy_from_slice(&0x0004u16.to_be_bytes()); // SHA-1
        let mut oversized = good[..hash_at + 2].to_vec();
        oversized.push(255);
        oversized.extend_from_slice(&[0xff; 255]);
        oversized.extend_from_slice(&good[hash_at + 6..]);
        for attest in [foreign, oversized] {
            let refused = verify_quote(&ak, &attest, &sign(&key, &attest), &qualifying, &pcrs);
            assert!(
                matches!(refused, Err(QuoteError::Malformed(_))),
                "{refused:?}"
            );
        }
    }
}
