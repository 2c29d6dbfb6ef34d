//! The init secret's hash in the node config: argon2id, salted, in the
//! PHC string form (`$argon2id$v=19$m=…,t=…,p=…$salt$hash`).
//!
//! The hash is no secret: the config is measured, and every node shows it
//! in its event log to anyone who completes a handshake with it. So a
//! guess at the init secret is an offline search that no backoff on the
//! node slows; a salt makes each config its own search, and the memory and
//! passes each guess costs keep a secret that is shorter than it should be
//! out of reach for longer. A config whose cost is below
//! [`MIN_MEMORY_KIB`] or [`MIN_PASSES`] is refused, as is one above the
//! bounds a node is willing to spend on checking a request.

use argon2::password_hash::{PasswordHash, PasswordHasher as _, PasswordVerifier as _, SaltString};
use argon2::{Algorithm, Argon2, Params, Version};
use rand::RngCore as _;

/// Memory per guess of a new hash, in KiB.
pub const MEMORY_KIB: u32 = 16 * 1024;
/// Passes over that memory of a new hash.
pub const PASSES: u32 = 3;
/// Lowest memory cost a config may name, in KiB.
pub const MIN_MEMORY_KIB: u32 = 8 * 1024;
/// Highest memory cost a config may name, in KiB: what a node spends on
/// checking one init request.
pub const MAX_MEMORY_KIB: u32 = 64 * 1024;
/// Fewest passes a config may name.
pub const MIN_PASSES: u32 = 2;
/// Most passes a config may name.
pub const MAX_PASSES: u32 = 8;
/// Most lanes a config may name.
pub const MAX_LANES: u32 = 4;
/// Fewest salt bytes a config may name.
pub const MIN_SALT_BYTES: usize = 16;
/// Length of the hash, in bytes.
pub const HASH_BYTES: usize = 32;

/// Why a config's init secret hash is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum InitSecretHashError {
    /// Not a PHC string of argon2id, version 19.
    #[error("expected an argon2id hash ($argon2id$v=19$m=…,t=…,p=…$salt$hash)")]
    Format,
    /// A cost outside the bounds.
    #[error(
        "its cost is out of bounds: memory {MIN_MEMORY_KIB}-{MAX_MEMORY_KIB} KiB, \
         {MIN_PASSES}-{MAX_PASSES} passes, at most {MAX_LANES} lanes"
    )]
    Cost,
    /// A salt shorter than [`MIN_SALT_BYTES`] or a hash of another length.
    #[error("expected a salt of at least {MIN_SALT_BYTES} bytes and a hash of {HASH_BYTES}")]
    Lengths,
}

/// A new hash of `secret` for a node config: a fresh salt, [`MEMORY_KIB`]
/// and [`PASSES`].
pub fn hash(secret: &[u8]) -> Result<String, argon2::password_hash::Error> {
    let mut salt = [0u8; MIN_SALT_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut salt);
    let params = Params::new(MEMORY_KIB, PASSES, 1, Some(HASH_BYTES))?;
    let salt = SaltString::encode_b64(&salt)?;
    Ok(Argon2::new(Algorithm::Argon2id, Version::V0x13, params)
        .hash_password(secret, &salt)?
        .to_string())
}

/// Whether `value` is the SHA-256 form (`sha256:` and 64 hex digits) that
/// configs named before argon2id: still parsed, so that a cluster's locked
/// members keep their measured config across an image upgrade, but no
/// secret matches it, so a node whose config names one takes no init.
pub fn is_legacy_sha256(value: &str) -> bool {
    value
        .strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Checks that `phc` is a hash [`matches`] accepts.
pub fn check(phc: &str) -> Result<(), InitSecretHashError> {
    parse(phc).map(|_| ())
}

/// Whether `secret` hashes to `phc` (compared in constant time). False if
/// `phc` is not an acceptable hash ([`check`]). Costs what `phc` names:
/// call it off an async runtime.
pub fn matches(phc: &str, secret: &[u8]) -> bool {
    match parse(phc) {
        Ok(parsed) => Argon2::default().verify_password(secret, &parsed).is_ok(),
        Err(_) => false,
    }
}

fn parse(phc: &str) -> Result<PasswordHash<'_>, InitSecretHashError> {
    let parsed = PasswordHash::new(phc).map_err(|_| InitSecretHashError::Format)?;
    if parsed.algorithm != argon2::ARGON2ID_IDENT || parsed.version != Some(0x13) {
        return Err(InitSecretHashError::Format);
    }
    let params = Params::try_from(&parsed).map_err(|_| InitSecretHashError::Format)?;
    if !(MIN_MEMORY_KIB..=MAX_MEMORY_KIB).contains(&params.m_cost())
        || !(MIN_PASSES..=MAX_PASSES).contains(&params.t_cost())
        || params.p_cost() > MAX_LANES
    {
        return Err(InitSecretHashError::Cost);
    }
    let salt_bytes = parsed
        .salt
        .map(|s| {
            let mut buf = [0u8; 64];
            s.decode_b64(&mut buf).map(|b| b.len()).unwrap_or(0)
        })
        .unwrap_or(0);
    let hash_bytes = parsed.hash.map(|h| h.len()).unwrap_or(0);
    if salt_bytes < MIN_SALT_BYTES || hash_bytes != HASH_BYTES {
        return Err(InitSecretHashError::Lengths);
    }
    Ok(parsed)
}

/// Whether `secret` is the init secret that `value` names, in either form
/// a config may carry: [`matches`] for an argon2id hash, a constant-time
/// compare of the secret's SHA-256 for the older form. For recovery, which
/// the members of an existing cluster (whose measured config may keep the
/// older form) must still be able to take; init takes argon2id only.
pub fn matches_any_form(value: &str, secret: &[u8]) -> bool {
    use sha2::Digest as _;
    use subtle::ConstantTimeEq as _;
    if is_legacy_sha256(value) {
        let expected = value
            .strip_prefix("sha256:")
            .and_then(|h| hex::decode(h).ok());
        return expected.is_some_and(|expected| {
            bool::from(
                expected
                    .as_slice()
                    .ct_eq(sha2::Sha256::digest(secret).as_slice()),
            )
        });
    }
    matches(value, secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn a_hash_matches_its_secret_only() {
        let phc = hash(SECRET).unwrap();
        assert!(phc.starts_with("$argon2id$v=19$m=16384,t=3,p=1$"), "{phc}");
        assert_eq!(check(&phc), Ok(()));
        assert!(matches(&phc, SECRET));
        assert!(!matches(&phc, b"0123456789abcdef0123456789abcdeX"));
        assert!(!matches(&phc, b""));
    }

    #[test]
    fn the_sha256_form_is_recognised_and_matches_nothing() {
        let digest = "ab".repeat(32);
        assert!(is_legacy_sha256(&format!("sha256:{digest}")));
        assert!(!matches(&format!("sha256:{digest}"), SECRET));
        for other in [
            format!("sha256:{}", &digest[1..]),
            format!("sha256:{digest}0"),
            format!("sha256:{}", "zz".repeat(32)),
            format!("SHA256:{digest}"),
            String::new(),
        ] {
            assert!(!is_legacy_sha256(&other), "{other}");
        }
    }

    #[test]
    fn recovery_takes_either_form_and_only_its_secret() {
        use sha2::Digest as _;
        let legacy = format!("sha256:{}", hex::encode(sha2::Sha256::digest(SECRET)));
        let upper = legacy.to_uppercase().replace("SHA256:", "sha256:");
        let phc = hash(SECRET).unwrap();
        for value in [&legacy, &upper, &phc] {
            assert!(matches_any_form(value, SECRET), "{value}");
            assert!(!matches_any_form(
                value,
                b"0123456789abcdef0123456789abcdeX"
            ));
            assert!(!matches_any_form(value, b""));
        }
        assert!(!matches_any_form("", b""));
        assert!(!matches_any_form("", SECRET));
    }

    #[test]
    fn each_hash_has_its_own_salt() {
        let (a, b) = (hash(SECRET).unwrap(), hash(SECRET).unwrap());
        assert_ne!(a, b);
        assert!(matches(&a, SECRET) && matches(&b, SECRET));
    }

    /// A config cannot name a hash cheaper to search than the bounds (a
    /// fast hash, argon2 of another kind, a low cost, no salt) nor one that
    /// costs a node more than it spends on a request.
    #[test]
    fn weak_or_costly_hashes_are_refused() {
        let with = |m: u32, t: u32, p: u32| {
            let params = Params::new(m, t, p, Some(HASH_BYTES)).unwrap();
            let salt = SaltString::encode_b64(&[7u8; 16]).unwrap();
            Argon2::new(Algorithm::Argon2id, Version::V0x13, params)
                .hash_password(SECRET, &salt)
                .unwrap()
                .to_string()
        };
        let sha256 = format!("sha256:{}", "00".repeat(32));
        assert_eq!(check(&sha256), Err(InitSecretHashError::Format));
        assert_eq!(check(""), Err(InitSecretHashError::Format));
        let argon2i = with(MEMORY_KIB, PASSES, 1).replacen("argon2id", "argon2i", 1);
        assert_eq!(check(&argon2i), Err(InitSecretHashError::Format));
        assert!(!matches(&argon2i, SECRET));
        for (m, t, p) in [
            (MIN_MEMORY_KIB - 1024, PASSES, 1),
            (MAX_MEMORY_KIB + 1024, PASSES, 1),
            (MEMORY_KIB, 1, 1),
            (MEMORY_KIB, MAX_PASSES + 1, 1),
            (MEMORY_KIB, PASSES, MAX_LANES + 1),
        ] {
            let phc = with(m, t, p);
            assert_eq!(check(&phc), Err(InitSecretHashError::Cost), "{phc}");
            assert!(!matches(&phc, SECRET), "{phc}");
        }
        assert_eq!(check(&with(MIN_MEMORY_KIB, MIN_PASSES, 1)), Ok(()));
        let shaped = |salt_bytes: usize, hash_bytes: usize| {
            let params = Params::new(MEMORY_KIB, PASSES, 1, Some(hash_bytes)).unwrap();
            let salt = SaltString::encode_b64(&vec![7u8; salt_bytes]).unwrap();
            Argon2::new(Algorithm::Argon2id, Version::V0x13, params)
                .hash_password(SECRET, &salt)
                .unwrap()
                .to_string()
        };
        for (salt, out) in [
            (8, HASH_BYTES),
            (MIN_SALT_BYTES - 1, HASH_BYTES),
            (16, 16),
            (16, 64),
        ] {
            let phc = shaped(salt, out);
            assert_eq!(check(&phc), Err(InitSecretHashError::Lengths), "{phc}");
            assert!(!matches(&phc, SECRET), "{phc}");
        }
        assert_eq!(check(&shaped(MIN_SALT_BYTES, HASH_BYTES)), Ok(()));
    }
}
