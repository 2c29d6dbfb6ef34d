//! The key service: data keys derived from the cluster's master secret.
//!
//! Every key the cluster needs is `HKDF-SHA256(ikm = master secret, salt =
//! master salt, info = key ID)`, so control-plane nodes that hold the master
//! secret derive the same key for the same ID and nothing is stored. Key IDs
//! in use:
//!
//! * [`disk_key_id`]: `"disk:" + UUID + "/ek:" + EK digest` names a node's
//!   state-disk key. The prefix keeps the IDs a peer can ask for through a
//!   join ticket (the disk UUID comes from the joining node) apart from
//!   every other ID: with bare UUIDs as IDs, a node announcing the "disk
//!   UUID" `measurementSecret` would receive the measurement secret as its
//!   disk key. The UUID is checked and lower-cased first, so one disk has
//!   one ID. The EK part binds the key to the TPM the disk belongs to, with
//!   no state: any control plane derives the same key for the same node,
//!   and a node with another TPM that names the disk's UUID gets a key that
//!   does not open it.
//! * [`MEASUREMENT_SECRET_ID`]: the measurement secret, which with the
//!   measurement salt gives the [`cluster_id`].
//! * [`operator_key_id`]: `"operator:ek:" + EK digest` names the key a
//!   node checks the operator's requests with ([`OperatorKey`]). One key
//!   per node: a node (a worker holds only its own) can check proofs made
//!   for it, never make a proof another node accepts.
//!
//! The key service runs in-process on every node that holds the master
//! secret (the join service derives disk keys through it). Key bytes never
//! appear in logs, errors or `Debug` output.

use std::fmt;
use std::ops::RangeInclusive;

use hkdf::Hkdf;
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::ek::EkDigest;

/// Accepted master secret length in bytes.
pub const MASTER_SECRET_LEN: RangeInclusive<usize> = 16..=512;
/// Accepted master salt length in bytes.
pub const MASTER_SALT_LEN: RangeInclusive<usize> = 32..=512;
/// Accepted data key length in bytes.
pub const DATA_KEY_LEN: RangeInclusive<usize> = 16..=64;
/// Longest key ID in bytes.
pub const MAX_KEY_ID_LEN: usize = 256;
/// Accepted measurement secret length in bytes.
pub const MEASUREMENT_SECRET_LEN: RangeInclusive<usize> = 16..=512;
/// Accepted measurement salt length in bytes.
pub const MEASUREMENT_SALT_LEN: RangeInclusive<usize> = 32..=512;
/// Key ID of the measurement secret.
pub const MEASUREMENT_SECRET_ID: &str = "measurementSecret";
/// Prefix of operator key IDs (see [`operator_key_id`]).
pub const OPERATOR_KEY_PREFIX: &str = "operator:ek:";
/// Length of an operator key.
pub const OPERATOR_KEY_LEN: usize = 32;
/// Prefix of state-disk key IDs (see [`disk_key_id`]).
pub const DISK_KEY_PREFIX: &str = "disk:";
/// Between the disk and the EK part of a disk key ID.
const EK_INFIX: &str = "/ek:";
/// Length of a state-disk key in bytes.
pub const DISK_KEY_LEN: usize = 32;
/// Length of the measurement secret in bytes.
pub const MEASUREMENT_SECRET_KEY_LEN: usize = 32;
/// HKDF info of the cluster ID.
const CLUSTER_ID_INFO: &[u8] = b"clusterID";

/// A cluster ID: `HKDF-SHA256(measurement secret, measurement salt, "clusterID")`.
pub type ClusterId = [u8; 32];

/// Why a [`KeyService`] could not be created.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum NewKeyServiceError {
    /// The master secret has a length outside [`MASTER_SECRET_LEN`].
    #[error("master secret must be 16 to 512 bytes, got {0}")]
    SecretLength(usize),
    /// The master salt has a length outside [`MASTER_SALT_LEN`].
    #[error("master salt must be 32 to 512 bytes, got {0}")]
    SaltLength(usize),
}

/// Why a data key could not be derived.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DataKeyError {
    /// The key ID is empty.
    #[error("data key ID is empty")]
    EmptyId,
    /// The key ID is longer than [`MAX_KEY_ID_LEN`].
    #[error("data key ID is longer than {MAX_KEY_ID_LEN} bytes")]
    IdTooLong,
    /// The requested length is outside [`DATA_KEY_LEN`].
    #[error("data key length must be 16 to 64 bytes, got {0}")]
    Length(usize),
}

/// Why a cluster ID could not be derived.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClusterIdError {
    /// The measurement secret has a length outside [`MEASUREMENT_SECRET_LEN`].
    #[error("measurement secret must be 16 to 512 bytes, got {0}")]
    SecretLength(usize),
    /// The measurement salt has a length outside [`MEASUREMENT_SALT_LEN`].
    #[error("measurement salt must be 32 to 512 bytes, got {0}")]
    SaltLength(usize),
}

/// Why a disk UUID does not name a disk key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiskKeyIdError {
    /// The UUID is not in the form `8-4-4-4-12` hex digits.
    #[error("disk UUID is not of the form xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")]
    Uuid,
}

/// Derives data keys from the master secret and salt.
pub struct KeyService {
    master_secret: Zeroizing<Vec<u8>>,
    master_salt: Zeroizing<Vec<u8>>,
}

impl fmt::Debug for KeyService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyService")
            .field("master_secret", &"<redacted>")
            .field("master_salt", &"<redacted>")
            .finish()
    }
}

impl KeyService {
    /// Holds a copy of the master secret and salt (zeroed on drop).
    pub fn new(master_secret: &[u8], master_salt: &[u8]) -> Result<Self, NewKeyServiceError> {
        if !MASTER_SECRET_LEN.contains(&master_secret.len()) {
            return Err(NewKeyServiceError::SecretLength(master_secret.len()));
        }
        if !MASTER_SALT_LEN.contains(&master_salt.len()) {
            return Err(NewKeyServiceError::SaltLength(master_salt.len()));
        }
        Ok(Self {
            master_secret: Zeroizing::new(master_secret.to_vec()),
            master_salt: Zeroizing::new(master_salt.to_vec()),
        })
    }

    /// `HKDF-SHA256(master secret, master salt, info = id)`, `len` bytes.
    /// `id` must be 1 to 256 bytes, `len` 16 to 64.
    pub fn data_key(&self, id: &str, len: usize) -> Result<Zeroizing<Vec<u8>>, DataKeyError> {
        if id.is_empty() {
            return Err(DataKeyError::EmptyId);
        }
        if id.len() > MAX_KEY_ID_LEN {
            return Err(DataKeyError::IdTooLong);
        }
        if !DATA_KEY_LEN.contains(&len) {
            return Err(DataKeyError::Length(len));
        }
        let mut key = Zeroizing::new(vec![0u8; len]);
        Hkdf::<Sha256>::new(Some(&self.master_salt), &self.master_secret)
            .expand(id.as_bytes(), &mut key)
            // 64 bytes is far below HKDF-SHA256's limit of 255 * 32.
            .map_err(|_| DataKeyError::Length(len))?;
        Ok(key)
    }

    /// The state-disk key of the disk with `uuid` of the node whose
    /// endorsement key is `ek` ([`DISK_KEY_LEN`] bytes).
    pub fn disk_key(&self, uuid: &str, ek: &EkDigest) -> Result<Zeroizing<Vec<u8>>, DiskKeyError> {
        let id = disk_key_id(uuid, ek)?;
        Ok(self.data_key(&id, DISK_KEY_LEN)?)
    }

    /// The master secret and salt themselves: only to seal them to another
    /// control plane's TPM.
    pub fn expose_master(&self) -> (&[u8], &[u8]) {
        (&self.master_secret, &self.master_salt)
    }

    /// The operator key of the node whose endorsement key is `ek`
    /// ([`operator_key_id`]).
    pub fn operator_key(&self, ek: &EkDigest) -> Result<OperatorKey, DataKeyError> {
        let derived = self.data_key(&operator_key_id(ek), OPERATOR_KEY_LEN)?;
        OperatorKey::from_slice(&derived).ok_or(DataKeyError::Length(derived.len()))
    }

    /// The cluster's measurement secret ([`MEASUREMENT_SECRET_KEY_LEN`] bytes).
    pub fn measurement_secret(&self) -> Result<Zeroizing<Vec<u8>>, DataKeyError> {
        self.data_key(MEASUREMENT_SECRET_ID, MEASUREMENT_SECRET_KEY_LEN)
    }
}

/// Why a disk key could not be derived.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiskKeyError {
    /// The UUID is malformed.
    #[error(transparent)]
    Id(#[from] DiskKeyIdError),
    /// Derivation failed.
    #[error(transparent)]
    Derive(#[from] DataKeyError),
}

/// The key ID of a node's operator key: `"operator:ek:"` + the hex digest
/// of the node's endorsement key.
pub fn operator_key_id(ek: &EkDigest) -> String {
    format!("{OPERATOR_KEY_PREFIX}{}", hex::encode(ek.as_bytes()))
}

/// The key a node checks the operator's requests with: the operator's CLI
/// derives it from the master secret for the node it attested, a control
/// plane derives its own, a worker receives its own sealed in its join and
/// rejoin tickets. Zeroed on drop, redacted in `Debug`.
#[derive(Clone)]
pub struct OperatorKey(Zeroizing<[u8; OPERATOR_KEY_LEN]>);

impl fmt::Debug for OperatorKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OperatorKey(<redacted>)")
    }
}

impl OperatorKey {
    /// The key from its bytes; `None` unless exactly [`OPERATOR_KEY_LEN`].
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        let mut key = Zeroizing::new([0u8; OPERATOR_KEY_LEN]);
        if bytes.len() != OPERATOR_KEY_LEN {
            return None;
        }
        key.copy_from_slice(bytes);
        Some(Self(key))
    }

    /// The key's bytes: only to seal them to the node they are for.
    pub fn expose(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// The proof for one request ([`operator_proof`]).
    pub fn prove(&self, kind: &str, challenge: &[u8], body: &[u8]) -> [u8; 32] {
        operator_proof(self.0.as_slice(), kind, challenge, body).unwrap_or([0; 32])
    }

    /// Whether `proof` is this key's proof for the request (constant time).
    pub fn verifies(&self, kind: &str, challenge: &[u8], body: &[u8], proof: &[u8]) -> bool {
        use subtle::ConstantTimeEq as _;
        // No proof computed (a key HMAC refused) verifies nothing.
        operator_proof(self.0.as_slice(), kind, challenge, body)
            .is_some_and(|expected| bool::from(expected.as_slice().ct_eq(proof)))
    }
}

/// The key ID of a state disk: `"disk:"` + the UUID in lower case +
/// `"/ek:"` + the hex digest of the node's endorsement key. The UUID must be
/// 8-4-4-4-12 hex digits (as `cryptsetup luksUUID` prints it).
pub fn disk_key_id(uuid: &str, ek: &EkDigest) -> Result<String, DiskKeyIdError> {
    Ok(format!(
        "{}{EK_INFIX}{}",
        disk_id(uuid)?,
        hex::encode(ek.as_bytes())
    ))
}

/// `"disk:"` + the UUID in lower case: the disk part of [`disk_key_id`],
/// and how a disk is named in logs and records.
pub fn disk_id(uuid: &str) -> Result<String, DiskKeyIdError> {
    let groups: Vec<&str> = uuid.split('-').collect();
    let shape_ok = groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()));
    if !shape_ok {
        return Err(DiskKeyIdError::Uuid);
    }
    Ok(format!("{DISK_KEY_PREFIX}{}", uuid.to_ascii_lowercase()))
}

/// The cluster ID: `HKDF-SHA256(ikm = measurement secret, salt = measurement
/// salt, info = "clusterID")`, 32 bytes. Every node of a cluster extends it
/// into PCR 15 when it takes its node lock.
pub fn cluster_id(
    measurement_secret: &[u8],
    measurement_salt: &[u8],
) -> Result<ClusterId, ClusterIdError> {
    if !MEASUREMENT_SECRET_LEN.contains(&measurement_secret.len()) {
        return Err(ClusterIdError::SecretLength(measurement_secret.len()));
    }
    if !MEASUREMENT_SALT_LEN.contains(&measurement_salt.len()) {
        return Err(ClusterIdError::SaltLength(measurement_salt.len()));
    }
    let mut id = [0u8; 32];
    // 32 bytes is a valid HKDF-SHA256 output length; expand cannot fail.
    let _ = Hkdf::<Sha256>::new(Some(measurement_salt), measurement_secret)
        .expand(CLUSTER_ID_INFO, &mut id);
    Ok(id)
}

/// The request kinds an operator's proof names (the `kind` of
/// [`operator_proof`]): the CLI proves and the node checks the same string,
/// so a proof for one kind proves nothing for another.
pub mod kind {
    /// `SetJoinMeasurements` (body: the measurements).
    pub const SET_JOIN_MEASUREMENTS: &str = "set-join-measurements";
    /// `Upgrade` (body: the encoded plan).
    pub const UPGRADE: &str = "upgrade";
    /// `StageImageMeasurements` (body: the measurements).
    pub const STAGE_IMAGE_MEASUREMENTS: &str = "stage-image-measurements";
    /// `FinishImageUpgrade` (body: SHA-256 of the staged set it finishes).
    pub const FINISH_IMAGE_UPGRADE: &str = "finish-image-upgrade";
    /// `RevokeNode` (body: the node selector).
    pub const REVOKE_NODE: &str = "revoke-node";
    /// `NodeStatus` (body: empty).
    pub const NODE_STATUS: &str = "node-status";
    /// `AdminKubeconfig` (body: empty).
    pub const ADMIN_KUBECONFIG: &str = "admin-kubeconfig";
}

/// The operator's proof for one request: HMAC-SHA256 under the operator
/// key over a label naming the request kind, the server's single-use
/// `challenge` and the SHA-256 of the request `body`. It binds the proof to
/// one request on one node, so a recorded proof is useless. `None` only if
/// HMAC refused the key, which it does for no length.
pub fn operator_proof(
    operator_key: &[u8],
    kind: &str,
    challenge: &[u8],
    body: &[u8],
) -> Option<[u8; 32]> {
    use hmac::Mac as _;
    use sha2::Digest as _;
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(operator_key).ok()?;
    mac.update(b"keel operator v1\0");
    mac.update(kind.as_bytes());
    mac.update(b"\0");
    mac.update(&(challenge.len() as u64).to_be_bytes());
    mac.update(challenge);
    mac.update(&Sha256::digest(body));
    Some(mac.finalize().into_bytes().into())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn service() -> KeyService {
        let secret: Vec<u8> = (0u8..32).collect();
        let salt: Vec<u8> = (0x40u8..0x60).collect();
        KeyService::new(&secret, &salt).unwrap()
    }

    // Expected values computed independently with Python's `hmac` module,
    // HKDF written out per RFC 5869 (PRK = HMAC(salt, ikm); T(i) =
    // HMAC(PRK, T(i-1) || info || i)), and cross-checked with
    // `cryptography.hazmat.primitives.kdf.hkdf.HKDF`:
    //   master = bytes(range(32)); salt = bytes(range(0x40, 0x60))
    //   measurement secret = b"\xaa" * 32; measurement salt = b"\x55" * 32
    //   EK digest = b"\x11" * 32
    const DISK_KEY: &str = "9848026df76f62a918c01b76f2893ca7dc503ac2af67a8629d1ef7cf224a2ca3";
    const MEASUREMENT_SECRET_48: &str = "8bbac9fa7a535a5c99730127304c1a6f9fabae01cef2e0a7\
                                         080a31f51cede05f52485227b35c109f304eeaa805ee91b2";
    const CLUSTER_ID: &str = "a0f816365f877b0d2bf731adb25c417df323357ea7bc3a0f53b248f3a2b8a9d0";
    const UUID: &str = "3B1F6C1E-6D2A-4C8E-9F10-2A7B5C4D9E01";

    fn ek(byte: u8) -> EkDigest {
        EkDigest::from_hex(&hex::encode([byte; 32])).unwrap()
    }

    #[test]
    fn data_keys_match_the_independent_vectors() {
        let keys = service();
        assert_eq!(
            hex::encode(keys.disk_key(UUID, &ek(0x11)).unwrap()),
            DISK_KEY
        );
        // Another TPM naming the same disk gets an unrelated key.
        assert_ne!(
            keys.disk_key(UUID, &ek(0x12)).unwrap().as_slice(),
            keys.disk_key(UUID, &ek(0x11)).unwrap().as_slice()
        );
        assert_eq!(
            hex::encode(keys.data_key(MEASUREMENT_SECRET_ID, 48).unwrap()),
            MEASUREMENT_SECRET_48
        );
        // A shorter key is the prefix (HKDF output stream).
        assert_eq!(
            hex::encode(keys.data_key(MEASUREMENT_SECRET_ID, 32).unwrap()),
            &MEASUREMENT_SECRET_48[..64]
        );
        assert_eq!(
            keys.measurement_secret().unwrap().as_slice(),
            keys.data_key(MEASUREMENT_SECRET_ID, 32).unwrap().as_slice()
        );
    }

    #[test]
    fn cluster_id_matches_the_independent_vector() {
        let id = cluster_id(&[0xaa; 32], &[0x55; 32]).unwrap();
        assert_eq!(hex::encode(id), CLUSTER_ID);
        assert_ne!(cluster_id(&[0xaa; 32], &[0x56; 32]).unwrap(), id);
    }

    #[test]
    fn different_ids_give_unrelated_keys() {
        let keys = service();
        let a = keys.data_key("a", 32).unwrap();
        let b = keys.data_key("b", 32).unwrap();
        assert_ne!(a.as_slice(), b.as_slice());
        let other = KeyService::new(&[1; 32], &[0x40; 32]).unwrap();
        assert_ne!(other.data_key("a", 32).unwrap().as_slice(), a.as_slice());
    }

    #[test]
    fn bad_inputs_are_refused() {
        assert_eq!(
            KeyService::new(&[1; 15], &[0; 32]).unwrap_err(),
            NewKeyServiceError::SecretLength(15)
        );
        assert_eq!(
            KeyService::new(&[1; 513], &[0; 32]).unwrap_err(),
            NewKeyServiceError::SecretLength(513)
        );
        assert_eq!(
            KeyService::new(&[1; 16], &[0; 31]).unwrap_err(),
            NewKeyServiceError::SaltLength(31)
        );
        let keys = service();
        assert_eq!(keys.data_key("", 32).unwrap_err(), DataKeyError::EmptyId);
        assert_eq!(
            keys.data_key(&"x".repeat(257), 32).unwrap_err(),
            DataKeyError::IdTooLong
        );
        assert!(keys.data_key(&"x".repeat(256), 32).is_ok());
        assert_eq!(
            keys.data_key("a", 15).unwrap_err(),
            DataKeyError::Length(15)
        );
        assert_eq!(
            keys.data_key("a", 65).unwrap_err(),
            DataKeyError::Length(65)
        );
        assert_eq!(
            cluster_id(&[1; 15], &[0; 32]).unwrap_err(),
            ClusterIdError::SecretLength(15)
        );
        assert_eq!(
            cluster_id(&[1; 32], &[0; 16]).unwrap_err(),
            ClusterIdError::SaltLength(16)
        );
    }

    #[test]
    fn disk_key_ids_are_namespaced_and_canonical() {
        assert_eq!(
            disk_key_id(UUID, &ek(0xab)).unwrap(),
            format!(
                "disk:3b1f6c1e-6d2a-4c8e-9f10-2a7b5c4d9e01/ek:{}",
                "ab".repeat(32)
            )
        );
        for bad in [
            "",
            MEASUREMENT_SECRET_ID,
            "3b1f6c1e6d2a4c8e9f102a7b5c4d9e01",
            "3b1f6c1e-6d2a-4c8e-9f10-2a7b5c4d9e0",
            "3b1f6c1e-6d2a-4c8e-9f10-2a7b5c4d9e0g",
            "3b1f6c1e-6d2a-4c8e-9f10-2a7b5c4d9e01-00",
        ] {
            assert_eq!(
                disk_key_id(bad, &ek(0xab)),
                Err(DiskKeyIdError::Uuid),
                "{bad:?}"
            );
        }
        let keys = service();
        assert_eq!(
            keys.disk_key(MEASUREMENT_SECRET_ID, &ek(0xab)).unwrap_err(),
            DiskKeyError::Id(DiskKeyIdError::Uuid)
        );
    }

    #[test]
    fn operator_proofs_bind_key_kind_challenge_and_body() {
        let keys = service();
        let owner = keys.operator_key(&ek(0xab)).unwrap();
        let key = owner.expose().to_vec();
        assert_ne!(
            key.as_slice(),
            keys.measurement_secret().unwrap().as_slice()
        );
        // One key per node: another node's key proves nothing here.
        let other_node = keys.operator_key(&ek(0xac)).unwrap();
        assert_ne!(other_node.expose(), owner.expose());
        let proof = operator_proof(&key, "set-join-measurements", &[1; 32], b"{}");
        assert!(owner.verifies("set-join-measurements", &[1; 32], b"{}", &proof.unwrap()));
        assert!(!other_node.verifies("set-join-measurements", &[1; 32], b"{}", &proof.unwrap()));
        assert!(!owner.verifies("set-join-measurements", &[1; 32], b"{}", &[0; 31]));
        assert_eq!(
            proof,
            operator_proof(&key, "set-join-measurements", &[1; 32], b"{}")
        );
        for other in [
            operator_proof(&[0; 32], "set-join-measurements", &[1; 32], b"{}"),
            operator_proof(&key, "upgrade", &[1; 32], b"{}"),
            operator_proof(&key, "set-join-measurements", &[2; 32], b"{}"),
            operator_proof(&key, "set-join-measurements", &[1; 32], b"{ }"),
        ] {
            assert_ne!(other, proof);
        }
    }

    #[test]
    fn debug_output_is_redacted() {
        let keys = KeyService::new(&[0x41; 32], &[0x42; 32]).unwrap();
        let text = format!("{keys:?}");
        assert!(text.contains("redacted"), "{text}");
        assert!(!text.contains("65, 65") && !text.contains("AAAA"), "{text}");
    }
}
