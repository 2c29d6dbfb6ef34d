//! The LUKS2 header check: an existing disk is key-checked or opened only if
//! its header is one the agent itself creates (see [`Cryptsetup::args`] for
//! `luksFormat`), and only through a detached copy of that header.
//!
//! The host can write the disk. Without this check it could put a header
//! whose keyslot uses `cipher_null` (which cryptsetup before 2.8.1 opens with
//! any passphrase) in front of a plaintext file system of its own, or keep
//! the genuine keyslot and switch the data segment to `cipher_null`
//! (CVE-2025-59054, CVE-2025-58356): the node would mount and run
//! attacker-chosen data. So [`Cryptsetup::detached_header`] copies the
//! header into a private directory, checks the copy's binary header
//! ([`check_version`]) and JSON metadata ([`check_metadata`]), and the key
//! check and `open` then use that copy (`--header`): a header swapped on
//! the disk after the check is never read. The agent copies the header
//! itself, the first [`HEADER_COPY_BYTES`] of the device and no more:
//! `luksHeaderBackup` would copy as much as the header on the disk claims
//! (its keyslot area can be up to 128 MiB), into memory and into `/run`,
//! before anything checked it.
//!
//! [`Cryptsetup::args`]: super::Cryptsetup::args
//! [`Cryptsetup::detached_header`]: super::Cryptsetup::detached_header

use std::fmt::Display;
use std::io::Read as _;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::DiskError;

/// Data and keyslot cipher of every disk the agent formats.
pub const CIPHER: &str = "aes-xts-plain64";
/// Volume key size in bytes (`--key-size 512`: AES-256 in XTS mode).
pub const KEY_SIZE: u64 = 64;
/// Hash of the keyslot KDF, anti-forensic splitter and digest.
pub const HASH: &str = "sha256";
/// Encryption sector sizes `luksFormat` picks for the device by itself.
pub const SECTOR_SIZES: [u64; 2] = [512, 4096];
/// Most JSON metadata accepted from `luksDump`; an agent-made header has
/// 12 KiB of JSON area.
pub const MAX_METADATA_JSON: usize = 64 * 1024;
/// The JSON area of each metadata copy, as `luksFormat` makes it (LUKS2's
/// default 16 KiB metadata copy less its 4 KiB binary header).
pub const JSON_SIZE: u64 = 12_288;
/// The keyslot area `luksFormat` makes (16 MiB less both metadata copies):
/// a larger one only makes the header copy larger.
pub const MAX_KEYSLOTS_SIZE: u64 = 16_744_448;
/// The header copy: both metadata copies (a 4 KiB binary header and
/// [`JSON_SIZE`] each) and the keyslot area, 16 MiB, which is where the
/// data of every disk the agent formats starts. For such a header the
/// copy is byte for byte what `luksHeaderBackup` writes; a header whose
/// areas are larger does not fit in it, and cryptsetup refuses the copy.
pub const HEADER_COPY_BYTES: u64 = 2 * (4096 + JSON_SIZE) + MAX_KEYSLOTS_SIZE;
/// PBKDF2 iterations of the volume key's digest: cryptsetup's minimum,
/// which it uses when `luksFormat` is told its iterations
/// (`--pbkdf-force-iterations`) instead of benchmarking them.
pub const DIGEST_ITERATIONS: u64 = 1000;
/// Longest header value quoted in an error.
const MAX_QUOTED: usize = 64;

/// Why a header is not one the agent creates: the field (a JSON path such as
/// `segments.0.encryption`) and what is wrong with it. Holds no key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct HeaderMismatch {
    /// The offending field.
    pub field: String,
    /// What is wrong with it.
    pub problem: String,
}

fn mismatch(field: impl Display, problem: impl Into<String>) -> HeaderMismatch {
    HeaderMismatch {
        field: field.to_string(),
        problem: problem.into(),
    }
}

/// A JSON value for an error message: short, escaped.
fn quoted(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(MAX_QUOTED) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// Checks the start of a binary LUKS header: the LUKS magic and version 2.
pub fn check_version(start: &[u8]) -> Result<(), HeaderMismatch> {
    const MAGIC: &[u8] = b"LUKS\xba\xbe";
    match start {
        [m0, m1, m2, m3, m4, m5, v0, v1, ..] => {
            if [*m0, *m1, *m2, *m3, *m4, *m5] != MAGIC {
                return Err(mismatch("magic", "not a LUKS header"));
            }
            match u16::from_be_bytes([*v0, *v1]) {
                2 => Ok(()),
                v => Err(mismatch("version", format!("LUKS{v}, expected LUKS2"))),
            }
        }
        _ => Err(mismatch("magic", "header too short")),
    }
}

/// Checks the JSON metadata of a LUKS2 header (`luksDump
/// --dump-json-metadata`) against what the agent creates:
/// * `keyslots`: at least one, each `luks2` with a `raw` area encrypted with
///   [`CIPHER`], [`KEY_SIZE`] keys, PBKDF2 with [`HASH`] and the agent's
///   iteration count, an AF with [`HASH`];
/// * `segments`: exactly one, `crypt` with [`CIPHER`], a sector size of
///   [`SECTOR_SIZES`], no integrity, no flags, IV tweak 0, dynamic size,
///   data after the keyslot area;
/// * `digests`: at least one, PBKDF2 with [`HASH`] and
///   [`DIGEST_ITERATIONS`], each bound to keyslots and segments;
/// * `tokens`: none; `config`: [`JSON_SIZE`], at most
///   [`MAX_KEYSLOTS_SIZE`], no `requirements` (reencryption), no flags;
/// * `cipher_null` nowhere.
pub fn check_metadata(json: &[u8]) -> Result<(), HeaderMismatch> {
    if json.len() > MAX_METADATA_JSON {
        return Err(mismatch(
            "metadata",
            format!("{} bytes, more than {MAX_METADATA_JSON}", json.len()),
        ));
    }
    let root: Value =
        serde_json::from_slice(json).map_err(|_| mismatch("metadata", "not valid JSON"))?;
    let root = object(&root, "metadata")?;

    let config = object(member(root, "", "config")?, "config")?;
    if config.contains_key("requirements") {
        return Err(mismatch(
            "config.requirements",
            "present (e.g. online reencryption)",
        ));
    }
    if let Some(flags) = config.get("flags") {
        if flags.as_array().is_none_or(|f| !f.is_empty()) {
            return Err(mismatch("config.flags", quoted(flags)));
        }
    }
    // The sizes and iteration counts the agent formats with: larger ones
    // would only make every key check slower (a host setting 2^32 PBKDF2
    // iterations would keep the node busy for hours at each attempt) and
    // the header copy larger.
    let json_size = u64_string(member(config, "config", "json_size")?, "config.json_size")?;
    if json_size != JSON_SIZE {
        return Err(mismatch(
            "config.json_size",
            format!("{json_size}, expected {JSON_SIZE}"),
        ));
    }
    let keyslots_size = u64_string(
        member(config, "config", "keyslots_size")?,
        "config.keyslots_size",
    )?;
    if keyslots_size > MAX_KEYSLOTS_SIZE {
        return Err(mismatch(
            "config.keyslots_size",
            format!("{keyslots_size}, more than {MAX_KEYSLOTS_SIZE}"),
        ));
    }
    // Both metadata copies (4 KiB binary header plus JSON area each), then
    // the keyslot area: the data must start after them.
    let header_end = json_size
        .checked_add(4096)
        .and_then(|m| m.checked_mul(2))
        .and_then(|m| m.checked_add(keyslots_size))
        .ok_or_else(|| mismatch("config", "sizes overflow"))?;

    let keyslots = nonempty(member(root, "", "keyslots")?, "keyslots")?;
    for (id, slot) in keyslots {
        let at = format!("keyslots.{id}");
        let slot = object(slot, &at)?;
        expect_str(slot, &at, "type", "luks2")?;
        expect_u64(slot, &at, "key_size", KEY_SIZE)?;
        let area_at = format!("{at}.area");
        let area = object(member(slot, &at, "area")?, &area_at)?;
        expect_str(area, &area_at, "type", "raw")?;
        expect_str(area, &area_at, "encryption", CIPHER)?;
        expect_u64(area, &area_at, "key_size", KEY_SIZE)?;
        let kdf_at = format!("{at}.kdf");
        let kdf = object(member(slot, &at, "kdf")?, &kdf_at)?;
        expect_str(kdf, &kdf_at, "type", "pbkdf2")?;
        expect_str(kdf, &kdf_at, "hash", HASH)?;
        expect_u64(
            kdf,
            &kdf_at,
            "iterations",
            u64::from(super::cryptsetup::PBKDF2_ITERATIONS),
        )?;
        let af_at = format!("{at}.af");
        let af = object(member(slot, &at, "af")?, &af_at)?;
        expect_str(af, &af_at, "type", "luks1")?;
        expect_str(af, &af_at, "hash", HASH)?;
    }

    let segments = nonempty(member(root, "", "segments")?, "segments")?;
    if segments.len() != 1 {
        return Err(mismatch(
            "segments",
            format!("{} segments, expected 1", segments.len()),
        ));
    }
    for (id, segment) in segments {
        let at = format!("segments.{id}");
        let segment = object(segment, &at)?;
        expect_str(segment, &at, "type", "crypt")?;
        expect_str(segment, &at, "encryption", CIPHER)?;
        let sector = member(segment, &at, "sector_size")?;
        if !sector.as_u64().is_some_and(|s| SECTOR_SIZES.contains(&s)) {
            return Err(mismatch(
                format!("{at}.sector_size"),
                format!("{}, expected one of {SECTOR_SIZES:?}", quoted(sector)),
            ));
        }
        expect_str(segment, &at, "iv_tweak", "0")?;
        expect_str(segment, &at, "size", "dynamic")?;
        for absent in ["integrity", "flags"] {
            if segment.contains_key(absent) {
                return Err(mismatch(format!("{at}.{absent}"), "present"));
            }
        }
        let offset = u64_string(member(segment, &at, "offset")?, &format!("{at}.offset"))?;
        if offset < header_end {
            return Err(mismatch(
                format!("{at}.offset"),
                format!("{offset} overlaps the header (ends at {header_end})"),
            ));
        }
    }

    let digests = nonempty(member(root, "", "digests")?, "digests")?;
    for (id, digest) in digests {
        let at = format!("digests.{id}");
        let digest = object(digest, &at)?;
        expect_str(digest, &at, "type", "pbkdf2")?;
        expect_str(digest, &at, "hash", HASH)?;
        expect_u64(digest, &at, "iterations", DIGEST_ITERATIONS)?;
        for list in ["keyslots", "segments"] {
            let value = member(digest, &at, list)?;
            if value.as_array().is_none_or(|l| l.is_empty()) {
                return Err(mismatch(format!("{at}.{list}"), "empty or not a list"));
            }
        }
    }

    let tokens = object(member(root, "", "tokens")?, "tokens")?;
    if !tokens.is_empty() {
        return Err(mismatch(
            "tokens",
            format!("{} present, expected none", tokens.len()),
        ));
    }

    // Anything the checks above did not reach (unknown fields included).
    if json
        .windows(b"cipher_null".len())
        .any(|w| w.eq_ignore_ascii_case(b"cipher_null"))
    {
        return Err(mismatch("metadata", "names cipher_null"));
    }
    Ok(())
}

fn object<'a>(value: &'a Value, at: &str) -> Result<&'a Map<String, Value>, HeaderMismatch> {
    value
        .as_object()
        .ok_or_else(|| mismatch(at, "not a JSON object"))
}

fn nonempty<'a>(value: &'a Value, at: &str) -> Result<&'a Map<String, Value>, HeaderMismatch> {
    let map = object(value, at)?;
    if map.is_empty() {
        return Err(mismatch(at, "empty"));
    }
    Ok(map)
}

fn member<'a>(
    map: &'a Map<String, Value>,
    at: &str,
    key: &str,
) -> Result<&'a Value, HeaderMismatch> {
    map.get(key).ok_or_else(|| {
        let field = if at.is_empty() {
            key.to_owned()
        } else {
            format!("{at}.{key}")
        };
        mismatch(field, "missing")
    })
}

fn expect_str(
    map: &Map<String, Value>,
    at: &str,
    key: &str,
    expected: &str,
) -> Result<(), HeaderMismatch> {
    let value = member(map, at, key)?;
    if value.as_str() == Some(expected) {
        Ok(())
    } else {
        Err(mismatch(
            format!("{at}.{key}"),
            format!("{}, expected {expected:?}", quoted(value)),
        ))
    }
}

fn expect_u64(
    map: &Map<String, Value>,
    at: &str,
    key: &str,
    expected: u64,
) -> Result<(), HeaderMismatch> {
    let value = member(map, at, key)?;
    if value.as_u64() == Some(expected) {
        Ok(())
    } else {
        Err(mismatch(
            format!("{at}.{key}"),
            format!("{}, expected {expected}", quoted(value)),
        ))
    }
}

/// LUKS2 writes 64-bit sizes and offsets as decimal strings.
fn u64_string(value: &Value, at: &str) -> Result<u64, HeaderMismatch> {
    value
        .as_str()
        .filter(|s| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| mismatch(at, format!("{}, expected a decimal size", quoted(value))))
}

/// A checked copy of a disk's LUKS2 header, in a private (0700) directory
/// that is removed when this is dropped. Pass [`DetachedHeader::path`] as
/// `--header`.
#[derive(Debug)]
pub struct DetachedHeader {
    dir: PathBuf,
    file: PathBuf,
}

impl DetachedHeader {
    /// A fresh private directory under `/run` (a tmpfs that systemd mounts
    /// before any unit, unlike `/tmp`, which the agent does not wait for;
    /// the temporary directory where there is no `/run`), with the path
    /// the copy is to be written to.
    fn new_dir() -> Result<Self, DiskError> {
        let mut random = [0u8; 12];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut random);
        let run = Path::new("/run");
        let base = if run.is_dir() {
            run.to_owned()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("keel-luks-{}", hex::encode(random)));
        // Fails if the path exists (a symlink included): nobody else's
        // directory is ever used.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|source| DiskError::HeaderCopy {
                path: dir.clone(),
                source,
            })?;
        let file = dir.join("luks-header");
        Ok(Self { dir, file })
    }

    /// The header copy.
    pub fn path(&self) -> &Path {
        &self.file
    }

    /// Copies the first [`HEADER_COPY_BYTES`] of `device` (fewer if it is
    /// shorter) into a fresh private directory; returns the copy and its
    /// first bytes (magic and version), for [`check_version`]. The file is
    /// created new, readable by root alone.
    pub(super) fn copy_of(device: &Path) -> Result<(Self, Vec<u8>), DiskError> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let copy = Self::new_dir()?;
        let err = |path: &Path| {
            let path = path.to_owned();
            move |source| DiskError::HeaderCopy { path, source }
        };
        let device_file = std::fs::File::open(device).map_err(err(device))?;
        // cryptsetup writes headers past the page cache (O_DIRECT): what a
        // reader cached of the device before is dropped, so the copy is
        // what the device holds.
        if let Err(error) = rustix::fs::fadvise(
            &device_file,
            0,
            std::num::NonZeroU64::new(HEADER_COPY_BYTES),
            rustix::fs::Advice::DontNeed,
        ) {
            tracing::debug!(device = %device.display(), %error, "dropping cached pages before the header copy");
        }
        let mut from = device_file.take(HEADER_COPY_BYTES);
        let mut to = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o400)
            .open(&copy.file)
            .map_err(err(&copy.file))?;
        let mut buf = vec![0u8; 64 * 1024];
        let mut start = Vec::with_capacity(8);
        loop {
            let read = read_up_to(&mut from, &mut buf).map_err(err(device))?;
            let Some(chunk) = buf.get(..read).filter(|c| !c.is_empty()) else {
                break;
            };
            if start.is_empty() {
                start.extend_from_slice(chunk.get(..8).unwrap_or(chunk));
            }
            to.write_all(chunk).map_err(err(&copy.file))?;
        }
        Ok((copy, start))
    }
}

/// Reads until `buf` is full or the reader ends; how many bytes it read.
fn read_up_to(reader: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while let Some(rest) = buf.get_mut(filled..).filter(|rest| !rest.is_empty()) {
        match reader.read(rest) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

impl Drop for DetachedHeader {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), %error, "removing the LUKS header copy");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// `luksDump --dump-json-metadata` of a disk formatted by the agent
    /// (cryptsetup 2.6.1).
    const GENUINE: &str = r#"{
      "keyslots":{"0":{"type":"luks2","key_size":64,
        "af":{"type":"luks1","stripes":4000,"hash":"sha256"},
        "area":{"type":"raw","offset":"32768","size":"258048",
                "encryption":"aes-xts-plain64","key_size":64},
        "kdf":{"type":"pbkdf2","hash":"sha256","iterations":1000,
               "salt":"h6cjiuMW5eMSfVcRqf82LgaU5dF7EBdh/+24Izbz3Ac="}}},
      "tokens":{},
      "segments":{"0":{"type":"crypt","offset":"16777216","size":"dynamic",
        "iv_tweak":"0","encryption":"aes-xts-plain64","sector_size":4096}},
      "digests":{"0":{"type":"pbkdf2","keyslots":["0"],"segments":["0"],
        "hash":"sha256","iterations":1000,
        "salt":"+NIr2xb8hAVsrk+GXDmfbBxRKz1lF+UfhEtuIYPgcN0=",
        "digest":"uXvAtx9ohr+M98y9MxaYStU1lStwjGUJNgzKgMnMyZY="}},
      "config":{"json_size":"12288","keyslots_size":"16744448"}
    }"#;

    fn genuine() -> Value {
        serde_json::from_str(GENUINE).unwrap()
    }

    /// The genuine metadata changed by `edit`, checked.
    fn check_edited(edit: impl FnOnce(&mut Value)) -> Result<(), HeaderMismatch> {
        let mut v = genuine();
        edit(&mut v);
        check_metadata(&serde_json::to_vec(&v).unwrap())
    }

    fn refused_at(edit: impl FnOnce(&mut Value), field: &str) -> HeaderMismatch {
        let err = check_edited(edit).unwrap_err();
        assert_eq!(err.field, field, "{err}");
        err
    }

    #[test]
    fn the_agents_own_header_passes() {
        check_metadata(GENUINE.as_bytes()).unwrap();
        check_edited(|v| v["segments"]["0"]["sector_size"] = 512.into()).unwrap();
    }

    /// A host that raises the cost of a key check (hours of PBKDF2 at every
    /// attempt) or the size of the header copy gets a refusal.
    #[test]
    fn costs_and_sizes_above_the_agents_own_are_refused() {
        refused_at(
            |v| v["keyslots"]["0"]["kdf"]["iterations"] = 4_000_000_000u64.into(),
            "keyslots.0.kdf.iterations",
        );
        refused_at(
            |v| v["digests"]["0"]["iterations"] = 4_000_000_000u64.into(),
            "digests.0.iterations",
        );
        refused_at(
            |v| v["config"]["keyslots_size"] = "134217728".into(),
            "config.keyslots_size",
        );
        refused_at(
            |v| v["config"]["json_size"] = "4182016".into(),
            "config.json_size",
        );
        // A smaller keyslot area is no cost.
        check_edited(|v| v["config"]["keyslots_size"] = "8388608".into()).unwrap();
    }

    #[test]
    fn cipher_null_data_segment_is_refused() {
        let err = refused_at(
            |v| v["segments"]["0"]["encryption"] = "cipher_null-ecb".into(),
            "segments.0.encryption",
        );
        assert!(err.to_string().contains("cipher_null-ecb"), "{err}");
        assert!(err.to_string().contains(CIPHER), "{err}");
    }

    #[test]
    fn cipher_null_keyslot_is_refused() {
        refused_at(
            |v| v["keyslots"]["0"]["area"]["encryption"] = "cipher_null-ecb".into(),
            "keyslots.0.area.encryption",
        );
        // A second, hostile keyslot next to the genuine one.
        refused_at(
            |v| {
                let mut slot = v["keyslots"]["0"].clone();
                slot["area"]["encryption"] = "cipher_null-ecb".into();
                v["keyslots"]["7"] = slot;
            },
            "keyslots.7.area.encryption",
        );
    }

    #[test]
    fn other_ciphers_and_key_sizes_are_refused() {
        refused_at(
            |v| v["segments"]["0"]["encryption"] = "aes-cbc-essiv:sha256".into(),
            "segments.0.encryption",
        );
        refused_at(
            |v| v["keyslots"]["0"]["area"]["encryption"] = "aes-cbc-plain".into(),
            "keyslots.0.area.encryption",
        );
        refused_at(
            |v| v["keyslots"]["0"]["key_size"] = 32.into(),
            "keyslots.0.key_size",
        );
        refused_at(
            |v| v["keyslots"]["0"]["area"]["key_size"] = 32.into(),
            "keyslots.0.area.key_size",
        );
        refused_at(
            |v| v["segments"]["0"]["sector_size"] = 1024.into(),
            "segments.0.sector_size",
        );
        refused_at(
            |v| v["keyslots"]["0"]["kdf"]["type"] = "argon2id".into(),
            "keyslots.0.kdf.type",
        );
    }

    #[test]
    fn reencryption_and_extra_segments_are_refused() {
        refused_at(
            |v| {
                v["config"]["requirements"] =
                    serde_json::json!({"mandatory": ["online-reencrypt-v2"]})
            },
            "config.requirements",
        );
        refused_at(
            |v| {
                v["segments"]["1"] =
                    serde_json::json!({"type": "linear", "offset": "16777216", "size": "dynamic"});
            },
            "segments",
        );
        refused_at(
            |v| v["segments"]["0"]["type"] = "linear".into(),
            "segments.0.type",
        );
        refused_at(
            |v| v["keyslots"]["0"]["type"] = "reencrypt".into(),
            "keyslots.0.type",
        );
        refused_at(
            |v| v["segments"]["0"]["integrity"] = serde_json::json!({"type": "hmac(sha256)", "journal_encryption": "none", "journal_integrity": "none"}),
            "segments.0.integrity",
        );
    }

    #[test]
    fn layout_tokens_flags_and_digests_are_checked() {
        refused_at(
            |v| v["segments"]["0"]["iv_tweak"] = "8".into(),
            "segments.0.iv_tweak",
        );
        refused_at(
            |v| v["segments"]["0"]["offset"] = "32768".into(),
            "segments.0.offset",
        );
        refused_at(
            |v| v["segments"]["0"]["offset"] = "-1".into(),
            "segments.0.offset",
        );
        refused_at(
            |v| v["config"]["flags"] = serde_json::json!(["allow-discards"]),
            "config.flags",
        );
        check_edited(|v| v["config"]["flags"] = serde_json::json!([])).unwrap();
        refused_at(
            |v| v["tokens"]["0"] = serde_json::json!({"type": "systemd-tpm2", "keyslots": ["0"]}),
            "tokens",
        );
        refused_at(|v| v["digests"] = serde_json::json!({}), "digests");
        refused_at(
            |v| v["digests"]["0"]["segments"] = serde_json::json!([]),
            "digests.0.segments",
        );
        refused_at(
            |v| {
                v.as_object_mut().unwrap().remove("keyslots");
            },
            "keyslots",
        );
    }

    #[test]
    fn cipher_null_anywhere_and_oversized_or_broken_metadata_are_refused() {
        refused_at(
            |v| v["unknown"] = serde_json::json!({"x": "CIPHER_NULL"}),
            "metadata",
        );
        let big = format!("{{\"pad\":\"{}\"}}", "a".repeat(MAX_METADATA_JSON));
        assert_eq!(
            check_metadata(big.as_bytes()).unwrap_err().field,
            "metadata"
        );
        assert_eq!(
            check_metadata(b"{\"keyslots\":").unwrap_err().field,
            "metadata"
        );
        assert_eq!(check_metadata(b"[]").unwrap_err().field, "metadata");
    }

    #[test]
    fn error_values_are_short() {
        let long = "x".repeat(10_000);
        let err = refused_at(
            |v| v["segments"]["0"]["encryption"] = long.into(),
            "segments.0.encryption",
        );
        assert!(err.to_string().len() < 200, "{err}");
    }

    #[test]
    fn only_luks2_binary_headers_pass() {
        check_version(b"LUKS\xba\xbe\x00\x02rest").unwrap();
        let luks1 = check_version(b"LUKS\xba\xbe\x00\x01").unwrap_err();
        assert_eq!(luks1.field, "version");
        assert!(luks1.to_string().contains("LUKS1"), "{luks1}");
        assert_eq!(
            check_version(b"SKUL\xba\xbe\x00\x02").unwrap_err().field,
            "magic"
        );
        assert_eq!(check_version(b"LUKS").unwrap_err().field, "magic");
    }
}
