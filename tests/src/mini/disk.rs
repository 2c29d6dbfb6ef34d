//! The host's look at a node's state disk: is it LUKS2, which header UUID
//! does it carry, does the key the cluster derives for it open it. Uses
//! `cryptsetup` on the disk image (header reads only; nothing is mapped).

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;
use std::process::{Command, Stdio};

use keel_verifier::keys::{self as key_service, KeyService};
use serde::Deserialize;
use zeroize::Zeroizing;

use super::{io, MiniError};

/// The master secret file `keel init` writes into its workspace.
#[derive(Deserialize)]
pub struct MasterSecret {
    /// Hex.
    pub key: String,
    /// Hex.
    pub salt: String,
    /// Hex.
    pub measurement_salt: String,
}

impl MasterSecret {
    /// Reads the file.
    pub fn load(path: &Path) -> Result<Self, MiniError> {
        let bytes = Zeroizing::new(std::fs::read(path).map_err(io(path))?);
        serde_json::from_slice(&bytes).map_err(|source| MiniError::Json {
            path: path.to_owned(),
            source,
        })
    }

    fn keys(&self) -> Result<KeyService, MiniError> {
        let key = Zeroizing::new(hex_field(&self.key, "key")?);
        let salt = hex_field(&self.salt, "salt")?;
        KeyService::new(&key, &salt)
            .map_err(|e| MiniError::Check(format!("the master secret is unusable: {e}")))
    }

    /// The state-disk key the cluster derives for a disk with header `uuid`.
    pub fn disk_key(&self, uuid: &str, ek_hex: &str) -> Result<Zeroizing<Vec<u8>>, MiniError> {
        let ek = keel_verifier::ek::EkDigest::from_hex(ek_hex)
            .ok_or_else(|| MiniError::Check(format!("{ek_hex:?} is not an EK digest")))?;
        self.keys()?
            .disk_key(uuid, &ek)
            .map_err(|e| MiniError::Check(format!("deriving the key of disk {uuid}: {e}")))
    }

    /// The cluster ID (hex) this master secret gives.
    pub fn cluster_id(&self) -> Result<String, MiniError> {
        let secret = self
            .keys()?
            .measurement_secret()
            .map_err(|e| MiniError::Check(format!("deriving the measurement secret: {e}")))?;
        let salt = hex_field(&self.measurement_salt, "measurement_salt")?;
        key_service::cluster_id(&secret, &salt)
            .map(hex::encode)
            .map_err(|e| MiniError::Check(format!("deriving the cluster ID: {e}")))
    }
}

fn hex_field(value: &str, name: &str) -> Result<Vec<u8>, MiniError> {
    hex::decode(value)
        .map_err(|_| MiniError::Check(format!("master secret file: {name} is not hex")))
}

fn cryptsetup(args: &[&str], disk: &Path) -> Result<std::process::Output, MiniError> {
    Command::new("cryptsetup")
        .args(args)
        .arg(disk)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| MiniError::Spawn {
            program: "cryptsetup".into(),
            source,
        })
}

/// Whether `disk` carries a LUKS2 header.
pub fn is_luks2(disk: &Path) -> Result<bool, MiniError> {
    Ok(cryptsetup(&["isLuks", "--type", "luks2"], disk)?
        .status
        .success())
}

/// The UUID of `disk`'s LUKS header.
pub fn luks_uuid(disk: &Path) -> Result<String, MiniError> {
    let out = cryptsetup(&["luksUUID"], disk)?;
    if !out.status.success() {
        return Err(MiniError::Check(format!(
            "{} has no LUKS header: {}",
            disk.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Whether `key` opens a key slot of `disk`. The key goes through a file
/// (mode 0600) in `scratch`, removed afterwards.
pub fn opens_with(disk: &Path, key: &[u8], scratch: &Path) -> Result<bool, MiniError> {
    let key_file = scratch.join(".disk-key");
    let _ = std::fs::remove_file(&key_file);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&key_file)
        .map_err(io(&key_file))?;
    f.write_all(key).map_err(io(&key_file))?;
    drop(f);
    let key_arg = key_file.display().to_string();
    let result = cryptsetup(&["open", "--test-passphrase", "--key-file", &key_arg], disk);
    let _ = std::fs::remove_file(&key_file);
    Ok(result?.status.success())
}
