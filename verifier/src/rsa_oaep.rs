//! RSA-OAEP encryption (RFC 8017, section 7.1.1; SHA-256 and MGF1-SHA-256)
//! to a TPM's RSA-2048 endorsement key, the first step of
//! TPM2_MakeCredential.
//!
//! The `rsa` crate computes the same, but its public-key operation is
//! num-bigint-dig's general `modpow`: a division to enter the Montgomery
//! domain, then every bit of the exponent's 64-bit word in 4-bit windows,
//! about 95 products where the EK's exponent, 65537, needs 17. A join
//! service makes two credentials per ticket (the residency challenge and
//! the ticket), so that was a large share of what a ticket costs it.
//!
//! This module raises to the exponent by square-and-multiply over its bits
//! in crypto-bigint's fixed-size Montgomery arithmetic, constant-time in
//! the encrypted seed: for 65537, 64 modular doublings and 24 products (6
//! to enter the Montgomery domain, 17, and 1 to leave it). OAEP is encoded
//! as the RFC says. The unit tests check ciphertexts against the `rsa`
//! crate's OAEP decryption; the TPM tests against TPM2_ActivateCredential.

use crypto_bigint::modular::montgomery_reduction;
use crypto_bigint::{Encoding, Limb, Word, U2048};
use rand::{CryptoRng, RngCore};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::ek::strip_zeros;

const HASH_LEN: usize = 32;
/// Bytes of an RSA-2048 modulus, and of a ciphertext.
const KEY_LEN: usize = 256;
/// Longest message OAEP with SHA-256 carries under a 2048-bit key.
pub const MAX_MESSAGE_LEN: usize = KEY_LEN - 2 * HASH_LEN - 2;

/// The public key is not one this module encrypts to.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("RSA-OAEP: {0}")]
pub struct OaepError(&'static str);

/// Encrypts `message` under the RSA-2048 key (`modulus` big-endian,
/// `exponent`) with OAEP, SHA-256 and `label`; the ciphertext is 256 bytes.
pub fn encrypt(
    rng: &mut (impl RngCore + CryptoRng),
    modulus: &[u8],
    exponent: u32,
    label: &[u8],
    message: &[u8],
) -> Result<[u8; KEY_LEN], OaepError> {
    if exponent < 3 || exponent & 1 == 0 {
        return Err(OaepError("the public exponent is not odd and at least 3"));
    }
    if message.len() > MAX_MESSAGE_LEN {
        return Err(OaepError("the message is too long for the key"));
    }
    let key = Modulus::new(modulus)?;

    // EM = 0x00 || maskedSeed || maskedDB, DB = lHash || PS || 0x01 || M.
    let mut encoded = Zeroizing::new([0u8; KEY_LEN]);
    let (seed, db) = encoded[1..].split_at_mut(HASH_LEN);
    rng.fill_bytes(seed);
    db[..HASH_LEN].copy_from_slice(&Sha256::digest(label));
    let message_at = db.len() - message.len();
    db[message_at - 1] = 0x01;
    db[message_at..].copy_from_slice(message);
    mgf1_xor(seed, db);
    mgf1_xor(db, seed);

    let m = Zeroizing::new(U2048::from_be_slice(encoded.as_ref()));
    Ok(key.pow(&m, exponent).to_be_bytes())
}

/// An odd 2048-bit modulus n, with what Montgomery products mod n need
/// (R = 2^2048).
struct Modulus {
    n: U2048,
    /// -n^-1 mod 2^64.
    neg_inv: Limb,
    /// R^2 mod n.
    r2: U2048,
}

impl Modulus {
    fn new(modulus: &[u8]) -> Result<Self, OaepError> {
        let modulus = strip_zeros(modulus);
        if modulus.len() != KEY_LEN || modulus[0] < 0x80 || modulus[KEY_LEN - 1] & 1 == 0 {
            return Err(OaepError("the modulus is not an odd 2048-bit number"));
        }
        let n = U2048::from_be_slice(modulus);
        let inv = n.inv_mod2k_vartime(Word::BITS as usize).as_words()[0];
        let mut key = Modulus {
            n,
            neg_inv: Limb(inv.wrapping_neg()),
            r2: U2048::ZERO,
        };
        // R mod n is R - n, as n > R/2. Doubled 64 times, it is 2^64 in
        // Montgomery form; five squarings make that 2^2048 = R, in
        // Montgomery form R^2 (64 doublings cost about one product).
        let mut r2 = n.wrapping_neg();
        for _ in 0..64 {
            r2 = r2.add_mod(&r2, &n);
        }
        for _ in 0..5 {
            r2 = key.product(&r2, &r2);
        }
        key.r2 = r2;
        Ok(key)
    }

    /// a * b / R mod n.
    fn product(&self, a: &U2048, b: &U2048) -> U2048 {
        montgomery_reduction(&a.mul_wide(b), &self.n, self.neg_inv)
    }

    /// base^exponent mod n (base < n, exponent > 0), left-to-right
    /// square-and-multiply.
    fn pow(&self, base: &U2048, exponent: u32) -> U2048 {
        let base = Zeroizing::new(self.product(base, &self.r2));
        let mut result = Zeroizing::new(*base);
        for bit in (0..exponent.ilog2()).rev() {
            *result = self.product(&result, &result);
            if exponent >> bit & 1 == 1 {
                *result = self.product(&result, &base);
            }
        }
        self.product(&result, &U2048::ONE)
    }
}

/// XORs MGF1-SHA-256(`seed`) into `out`.
fn mgf1_xor(seed: &[u8], out: &mut [u8]) {
    for (counter, chunk) in (0u32..).zip(out.chunks_mut(HASH_LEN)) {
        let mask = Sha256::new()
            .chain_update(seed)
            .chain_update(counter.to_be_bytes())
            .finalize();
        chunk.iter_mut().zip(mask).for_each(|(b, m)| *b ^= m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::OsRng;
    use rsa::traits::PublicKeyParts;
    use rsa::{BigUint, Oaep, RsaPrivateKey};
    use std::sync::OnceLock;

    /// One 2048-bit key for every test (generating one takes seconds).
    fn key() -> &'static RsaPrivateKey {
        static KEY: OnceLock<RsaPrivateKey> = OnceLock::new();
        KEY.get_or_init(|| RsaPrivateKey::new(&mut OsRng, 2048).expect("RSA key"))
    }

    fn encrypt_to(label: &[u8], message: &[u8]) -> [u8; KEY_LEN] {
        let exponent = key()
            .e()
            .to_bytes_be()
            .iter()
            .fold(0u32, |e, &b| e << 8 | u32::from(b));
        encrypt(
            &mut OsRng,
            &key().n().to_bytes_be(),
            exponent,
            label,
            message,
        )
        .expect("encrypt")
    }

    #[test]
    fn the_rsa_crate_decrypts_what_it_encrypts() {
        for message in [&b""[..], b"x", &[0u8; 32], &[0xffu8; MAX_MESSAGE_LEN]] {
            let ciphertext = encrypt_to(b"IDENTITY\0", message);
            let padding = Oaep::new_with_label::<Sha256, _>("IDENTITY\0");
            assert_eq!(
                key().decrypt(padding, &ciphertext).expect("decrypt"),
                message
            );
        }
    }

    #[test]
    fn another_label_does_not_decrypt() {
        let ciphertext = encrypt_to(b"IDENTITY\0", b"seed");
        let padding = Oaep::new_with_label::<Sha256, _>("DUPLICATE\0");
        assert!(key().decrypt(padding, &ciphertext).is_err());
    }

    #[test]
    fn two_encryptions_of_one_message_differ() {
        assert_ne!(encrypt_to(b"L", b"same"), encrypt_to(b"L", b"same"));
    }

    #[test]
    fn pow_agrees_with_the_general_modpow() {
        let n = key().n();
        let modulus = Modulus::new(&n.to_bytes_be()).expect("modulus");
        for base in [[0x5au8; KEY_LEN - 1].as_slice(), &[1], &[0], &[2; 40]] {
            let big = BigUint::from_bytes_be(base);
            let mut padded = [0u8; KEY_LEN];
            padded[KEY_LEN - base.len()..].copy_from_slice(base);
            for e in [1u32, 3, 17, 65537, 0xffff_ffff] {
                let expected = big.modpow(&BigUint::from(e), n).to_bytes_be();
                let got = modulus.pow(&U2048::from_be_slice(&padded), e).to_be_bytes();
                let first = got.iter().position(|&b| b != 0).unwrap_or(KEY_LEN - 1);
                assert_eq!(got[first..], expected[..], "e = {e}");
            }
        }
    }

    #[test]
    fn refuses_bad_keys_and_long_messages() {
        let n = key().n().to_bytes_be();
        let mut even = n.clone();
        even[KEY_LEN - 1] &= 0xfe;
        let mut short = n.clone();
        short[0] = 0x7f;
        let cases: [(&[u8], u32, usize); 6] = [
            (&even, 65537, 32),
            (&short, 65537, 32),
            (&n[..128], 65537, 32),
            (&n, 65536, 32),
            (&n, 1, 32),
            (&n, 65537, MAX_MESSAGE_LEN + 1),
        ];
        for (modulus, exponent, len) in cases {
            assert!(encrypt(&mut OsRng, modulus, exponent, b"", &vec![1; len]).is_err());
        }
        let mut padded = vec![0, 0];
        padded.extend_from_slice(&n);
        assert!(encrypt(&mut OsRng, &padded, 65537, b"", b"m").is_ok());
    }
}
