//! The operator's workspace: the files `keel init` writes and `keel recover`
//! and `keel push-measurements` read back, in one format.

use std::path::Path;

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::settings::read_bounded;

/// The file the master secret goes to, before anything is sent.
pub const MASTER_SECRET_FILE: &str = "keel-master-secret.json";
/// The admin kubeconfig.
pub const KUBECONFIG_FILE: &str = "keel-admin.conf";
/// The cluster ID and the node's attested PCRs.
pub const ID_FILE: &str = "keel-id.json";
/// The node's logs after a failed init.
pub const FAILURE_LOG_FILE: &str = "keel-init-failure.log";
/// The image measurement sets the cluster accepts, as this workspace last
/// changed them ([`ImageRecord`]).
pub const IMAGE_FILE: &str = "keel-image.json";

/// The EKs this workspace revoked ([`RevokedRecord`]).
pub const REVOKED_FILE: &str = "keel-revoked.json";
/// The lock file that orders changes to [`REVOKED_FILE`].
const REVOKED_LOCK_FILE: &str = ".keel-revoked.lock";
/// The lock file that serialises changes to [`IMAGE_FILE`].
const IMAGE_LOCK_FILE: &str = ".keel-image.lock";

/// [`MASTER_SECRET_FILE`] as stored: hex fields; the key's is wiped when
/// dropped, also when the rest of the file fails to parse.
#[derive(Serialize, Deserialize)]
pub struct MasterSecretFile {
    /// Hex, 32 bytes.
    pub key: Zeroizing<String>,
    /// Hex, 32 bytes.
    pub salt: String,
    /// Hex, 32 bytes.
    pub measurement_salt: String,
}

/// [`ID_FILE`].
#[derive(Serialize, Deserialize)]
pub struct IdFile {
    /// The cluster ID (hex).
    pub cluster_id: String,
    /// The node `keel init` ran against.
    pub endpoint: String,
}

/// The master secret and its salts, decoded; the secret is wiped when
/// dropped.
pub struct MasterSecret {
    /// The master secret.
    pub key: Zeroizing<Vec<u8>>,
    /// The master salt.
    pub salt: Vec<u8>,
    /// The measurement salt.
    pub measurement_salt: Vec<u8>,
}

/// Refuses a workspace that someone else could write into
/// ([`check_private_dir`]). Whoever can write there can remove the master
/// secret, replace the admin kubeconfig (with one that runs a command of
/// theirs when kubectl reads it), or hold the workspace's locks.
pub fn check_private(workspace: &Path) -> anyhow::Result<()> {
    check_private_dir(workspace, "workspace")
}

/// Refuses a directory (a symbolic link to one is judged by the
/// directory) that someone else could write into: owned by another user
/// than this one, writable by everyone, writable by a group that is not
/// this user's private one, or whose access ACL lets another user or such
/// a group write (a default ACL of a shared parent directory, say). A
/// user's private group (named as the user, listing no members, no other
/// user's primary group), as under umask 002, is taken. `what` names the
/// directory in errors ("workspace").
pub fn check_private_dir(dir: &Path, what: &str) -> anyhow::Result<()> {
    check_dir(dir, what, false)
}

/// [`check_private_dir`], except that the directory may also be root's:
/// one this user only reads from (a collateral cache an administrator
/// keeps for every operator), which root could change either way.
pub fn check_trusted_dir(dir: &Path, what: &str) -> anyhow::Result<()> {
    check_dir(dir, what, true)
}

fn check_dir(dir: &Path, what: &str, root_may_own: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let meta =
        std::fs::metadata(dir).with_context(|| format!("reading the {what} {}", dir.display()))?;
    if !meta.is_dir() {
        bail!("the {what} {} is not a directory", dir.display());
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me && !(root_may_own && meta.uid() == 0) {
        bail!(
            "the {what} {} belongs to another user (uid {}), who could remove or replace \
             what keel keeps there: use a directory of your own",
            dir.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o002 != 0 {
        bail!(
            "the {what} {} is writable by every user (mode {:o}), who could remove or \
             replace what keel keeps there: run chmod o-w on it, or use another",
            dir.display(),
            meta.mode() & 0o7777
        );
    }
    if meta.mode() & 0o020 != 0 && !is_private_group(meta.gid(), me) {
        bail!(
            "the {what} {} is writable by its group (gid {}, mode {:o}), whose other \
             members could remove or replace what keel keeps there: run chmod g-w on it, \
             or use another",
            dir.display(),
            meta.gid(),
            meta.mode() & 0o7777
        );
    }
    if let Some(writer) = acl_writer(dir, me, what)? {
        bail!(
            "the {what} {} has an access ACL that lets {writer} write there, who could \
             remove or replace what keel keeps there: remove the entry (setfacl -x) or use \
             another directory",
            dir.display()
        );
    }
    Ok(())
}

/// The extended attribute of a POSIX access ACL.
const ACL_XATTR: &str = "system.posix_acl_access";
/// Largest access ACL read (8 bytes per entry after a 4-byte header).
const MAX_ACL_BYTES: usize = 8 * 1024;

/// Whom besides this user (`me`) the access ACL of `path` (the `what`)
/// lets write: a named user, or a named group other than this user's
/// private one, whose entry grants write within the ACL's mask. `None`
/// where there is no ACL or the file system keeps none.
fn acl_writer(path: &Path, me: u32, what: &str) -> anyhow::Result<Option<String>> {
    use rustix::io::Errno;
    let mut acl = vec![0u8; MAX_ACL_BYTES];
    let len = match rustix::fs::getxattr(path, ACL_XATTR, &mut acl[..]) {
        Ok(len) => len,
        Err(Errno::NODATA | Errno::NOTSUP) => return Ok(None),
        Err(e) => {
            return Err(std::io::Error::from(e))
                .with_context(|| format!("reading the ACL of the {what} {}", path.display()))
        }
    };
    let unreadable =
        || anyhow::anyhow!("the {what} {} has an ACL keel cannot read", path.display());
    let (version, entries) = acl
        .get(..len)
        .and_then(|a| a.split_first_chunk::<4>())
        .ok_or_else(unreadable)?;
    if u32::from_le_bytes(*version) != 2 || entries.len() % 8 != 0 {
        return Err(unreadable());
    }
    // Entries: tag, permissions (u16 each) and an ID (u32), little-endian.
    let entries: Vec<(u16, u16, u32)> = entries
        .chunks_exact(8)
        .map(|e| {
            let half = |at: usize| {
                e.get(at..at + 2)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u16::from_le_bytes)
            };
            let id = e
                .get(4..8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u32::from_le_bytes);
            (half(0), half(2), id)
        })
        .collect();
    const USER: u16 = 0x02;
    const GROUP: u16 = 0x08;
    const MASK: u16 = 0x10;
    const WRITE: u16 = 0x02;
    let mask = entries
        .iter()
        .find(|(tag, ..)| *tag == MASK)
        .map_or(0x07, |(_, perm, _)| *perm);
    Ok(entries.iter().find_map(|&(tag, perm, id)| {
        let writes = perm & mask & WRITE != 0;
        match tag {
            USER if writes && id != me => Some(format!("the user with uid {id}")),
            GROUP if writes && !is_private_group(id, me) => {
                Some(format!("the group with gid {id}"))
            }
            _ => None,
        }
    }))
}

/// Whether `gid` is the private group of the user `uid`: a group of the
/// user's name that lists no members. A group that cannot be looked up is
/// not.
fn is_private_group(gid: u32, uid: u32) -> bool {
    use nix::unistd::{Gid, Group, Uid, User};
    let (Ok(Some(group)), Ok(Some(user))) = (
        Group::from_gid(Gid::from_raw(gid)),
        User::from_uid(Uid::from_raw(uid)),
    ) else {
        return false;
    };
    group.name == user.name
        && group.mem.iter().all(|member| *member == user.name)
        && !std::fs::read_to_string("/etc/passwd").map_or(true, |passwd| {
            others_of_primary_group(&passwd, gid, &user.name)
        })
}

/// Whether a user other than `name` in `passwd` (the text of
/// `/etc/passwd`) has `gid` as the primary group: such users are members
/// that the group's own member list does not name.
fn others_of_primary_group(passwd: &str, gid: u32, name: &str) -> bool {
    passwd.lines().any(|line| {
        let mut fields = line.split(':');
        let user = fields.next().unwrap_or_default();
        let primary = fields.nth(2).and_then(|g| g.parse::<u32>().ok());
        user != name && !user.is_empty() && primary == Some(gid)
    })
}

impl MasterSecret {
    /// Reads [`MASTER_SECRET_FILE`] from `workspace`, which must be
    /// private ([`check_private`]).
    pub fn load(workspace: &Path) -> anyhow::Result<Self> {
        check_private(workspace)?;
        let path = workspace.join(MASTER_SECRET_FILE);
        let bytes = crate::settings::read_bounded_secret(&path)
            .with_context(|| format!("reading the master secret {}", path.display()))?;
        let MasterSecretFile {
            key,
            salt,
            measurement_salt,
        } = serde_json::from_slice(&bytes).map_err(|e| {
            // The parser's own message may quote the secret: only where
            // it stopped is said.
            anyhow::anyhow!(
                "{} is not a master secret file (at line {}, column {})",
                path.display(),
                e.line(),
                e.column()
            )
        })?;
        let hex_field = |value: &str, name: &str| {
            hex::decode(value).with_context(|| format!("{}: {name} is not hex", path.display()))
        };
        // Decoded into a wiped buffer of its final size; as above, the
        // decoder's message would name a character of it.
        let mut decoded = Zeroizing::new(vec![0; key.len() / 2]);
        hex::decode_to_slice(&*key, &mut decoded)
            .map_err(|_| anyhow::anyhow!("{}: key is not hex", path.display()))?;
        Ok(Self {
            key: decoded,
            salt: hex_field(&salt, "salt")?,
            measurement_salt: hex_field(&measurement_salt, "measurement_salt")?,
        })
    }
}

/// The cluster ID a master secret, its salt and the measurement salt make:
/// the ID a node that holds them reports.
pub fn derive_cluster_id(
    master_secret: &[u8],
    master_salt: &[u8],
    measurement_salt: &[u8],
) -> anyhow::Result<[u8; 32]> {
    keel_verifier::keys::KeyService::new(master_secret, master_salt)
        .ok()
        .and_then(|keys| keys.measurement_secret().ok())
        .and_then(|secret| keel_verifier::keys::cluster_id(&secret, measurement_salt).ok())
        .context("deriving the cluster ID")
}

impl MasterSecret {
    /// The cluster ID these secrets make ([`derive_cluster_id`]).
    pub fn cluster_id(&self) -> anyhow::Result<[u8; 32]> {
        derive_cluster_id(&self.key, &self.salt, &self.measurement_salt)
    }
}

/// The cluster ID `secret` makes, checked against the workspace's
/// [`ID_FILE`] where it has one: the two files must be of one cluster.
pub fn checked_cluster_id(workspace: &Path, secret: &MasterSecret) -> anyhow::Result<[u8; 32]> {
    let cluster_id = secret.cluster_id()?;
    if let Some(recorded) = recorded_cluster_id(workspace)? {
        if recorded != cluster_id {
            anyhow::bail!(
                "the workspace's master secret file makes cluster {}, but its {ID_FILE} names {}: \
                 they are not of one cluster",
                hex::encode(cluster_id),
                hex::encode(&recorded)
            );
        }
    }
    Ok(cluster_id)
}

/// The cluster ID [`ID_FILE`] in `workspace` names; `None` where the
/// workspace has none.
pub fn recorded_cluster_id(workspace: &Path) -> anyhow::Result<Option<Vec<u8>>> {
    let path = workspace.join(ID_FILE);
    let Some(body) = read_if_there(&path)? else {
        return Ok(None);
    };
    let id: IdFile = serde_json::from_slice(&body)
        .with_context(|| format!("{} is not a cluster ID file", path.display()))?;
    hex::decode(&id.cluster_id)
        .map(Some)
        .with_context(|| format!("{}: the cluster ID is not hex", path.display()))
}

/// [`IMAGE_FILE`]: the sets of measurements the cluster's control planes
/// accept, as this workspace last changed them: the current set (made so
/// by `keel upgrade finish` or `keel push-measurements`) and, during a
/// rollout, the staged one. Written first by a finished rollout; until
/// then the workspace holds none, and the settings' measurements alone
/// decide.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageRecord {
    /// SHA-256 of the current set's canonical JSON (hex), as the control
    /// planes name it.
    pub digest: String,
    /// The highest rollback epoch of a file this workspace made current.
    pub epoch: u64,
    /// SHA-256 of the staged set (hex), while a rollout runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged: Option<String>,
}

impl ImageRecord {
    /// Writes the record to `workspace` (atomically).
    fn save(&self, workspace: &Path) -> anyhow::Result<()> {
        let body = serde_json::to_vec_pretty(self).context("encoding the image record")?;
        crate::init::write_atomic(&workspace.join(IMAGE_FILE), &body, 0o644)
    }

    /// The record in `workspace`; `None` where no image rollout was
    /// finished from it.
    pub fn load(workspace: &Path) -> anyhow::Result<Option<Self>> {
        let path = workspace.join(IMAGE_FILE);
        let Some(body) = read_if_there(&path)? else {
            return Ok(None);
        };
        serde_json::from_slice(&body)
            .map(Some)
            .with_context(|| format!("{} is not an image record", path.display()))
    }

    /// Applies `change` to the record in `workspace`, if there is one.
    pub fn update(workspace: &Path, change: impl FnOnce(&mut Self)) -> anyhow::Result<()> {
        let _lock = lock_beside(workspace, IMAGE_LOCK_FILE, IMAGE_FILE)?;
        if let Some(mut record) = Self::load(workspace)? {
            change(&mut record);
            record.save(workspace)?;
        }
        Ok(())
    }

    /// Applies `change` to the record in `workspace`, or to an empty one
    /// if there is none (`change` must then set the current set).
    pub fn update_or_create(
        workspace: &Path,
        change: impl FnOnce(&mut Self),
    ) -> anyhow::Result<()> {
        let _lock = lock_beside(workspace, IMAGE_LOCK_FILE, IMAGE_FILE)?;
        let mut record = Self::load(workspace)?.unwrap_or(Self {
            digest: String::new(),
            epoch: 0,
            staged: None,
        });
        change(&mut record);
        record.save(workspace)
    }

    /// Refuses `measurements` (the set the operator's settings name) unless
    /// it is the current or the staged set: a node of a retired image is
    /// never sent the master secret because the settings still name its
    /// measurements.
    pub fn require(
        &self,
        measurements: &keel_verifier::measurements::Measurements,
    ) -> anyhow::Result<()> {
        let named = hex::encode(measurements.digest());
        if named != self.digest && self.staged.as_deref() != Some(named.as_str()) {
            anyhow::bail!(
                "the settings' measurements (sha256:{named}) are not an image this cluster \
                 accepts (sha256:{}, epoch {}, as `keel upgrade finish` or `keel \
                 push-measurements` left it{}): point `measurements` in the settings at \
                 that image's file",
                self.digest,
                self.epoch,
                self.staged
                    .as_deref()
                    .map(|s| format!("; staged sha256:{s}"))
                    .unwrap_or_default()
            );
        }
        Ok(())
    }
}

/// The bytes of `path` (bounded), `None` if there is no such file.
fn read_if_there(path: &Path) -> anyhow::Result<Option<Vec<u8>>> {
    match read_bounded(path) {
        Ok(body) => Ok(Some(body)),
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The EKs `keel revoke` revoked from this workspace, as the control
/// planes named them (`sha256:` and the hex of the EK public area's
/// SHA-256). `keel recover` seals the master secret to none of them: a
/// recovery checks no registry before the secret is sent, and a control
/// plane revoked while it was cut off may not know it is.
#[derive(Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RevokedRecord {
    /// The revoked EKs.
    pub eks: std::collections::BTreeSet<String>,
}

impl RevokedRecord {
    /// The record in `workspace`; empty where nothing was revoked from it.
    pub fn load(workspace: &Path) -> anyhow::Result<Self> {
        let path = workspace.join(REVOKED_FILE);
        let Some(body) = read_if_there(&path)? else {
            return Ok(Self::default());
        };
        serde_json::from_slice(&body)
            .with_context(|| format!("{} is not a record of revoked EKs", path.display()))
    }

    /// Adds `ek` (as a control plane named it) to the record in
    /// `workspace`; refuses anything but an EK digest as it prints itself
    /// (`sha256:` and 64 lower-case hex digits).
    pub fn add(workspace: &Path, ek: &str) -> anyhow::Result<()> {
        let well_formed = ek
            .strip_prefix("sha256:")
            .and_then(keel_verifier::ek::EkDigest::from_hex)
            .is_some_and(|digest| digest.to_string() == ek);
        if !well_formed {
            anyhow::bail!("the EK to revoke is not of the form sha256:<64 hex digits>");
        }
        // Two `keel revoke` runs at once (a script revoking several nodes)
        // must not lose each other's EK: the read, the change and the
        // write happen under an exclusive lock on a file beside the record.
        let lock = lock_beside(workspace, REVOKED_LOCK_FILE, REVOKED_FILE)?;
        let mut record = Self::load(workspace)?;
        if record.eks.insert(ek.to_owned()) {
            let body = serde_json::to_vec_pretty(&record).context("encoding the revoked EKs")?;
            crate::init::write_atomic(&workspace.join(REVOKED_FILE), &body, 0o644)?;
        }
        drop(lock);
        Ok(())
    }

    /// Refuses `ek` if this workspace revoked it.
    pub fn refuse(&self, ek: &keel_verifier::ek::EkDigest) -> anyhow::Result<()> {
        let ek = ek.to_string();
        if self.eks.contains(&ek) {
            anyhow::bail!(
                "the node's EK ({ek}) was revoked from this workspace (`keel revoke`, {REVOKED_FILE})"
            );
        }
        Ok(())
    }
}

/// Takes an exclusive lock on the file `lock_name` in `workspace` (0600,
/// created if needed, never through a symbolic link), held until the
/// returned file is dropped: two runs of the CLI that change the record
/// `record` (named in the error) read, change and write it in turn, and
/// neither loses the other's change.
fn lock_beside(workspace: &Path, lock_name: &str, record: &str) -> anyhow::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(workspace.join(lock_name))
        .and_then(|file| file.lock().map(|()| file))
        .with_context(|| format!("locking {record} in {}", workspace.display()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use keel_verifier::measurements::{Expected, Measurements, REQUIRED_PCRS};

    fn set(byte: u8) -> Measurements {
        Measurements::new(
            REQUIRED_PCRS
                .iter()
                .map(|&pcr| (pcr, Expected::enforced([byte; 32]))),
        )
        .unwrap()
    }

    /// A damaged master secret file is refused without its error quoting
    /// the secret: the JSON parser's and the hex decoder's messages would.
    #[test]
    fn a_damaged_master_secret_is_refused_without_quoting_it() {
        let ws = tempfile::tempdir().unwrap();
        let path = ws.path().join(MASTER_SECRET_FILE);
        for (file, secret_part) in [
            (
                r#"{"key": "41424344qx", "salt": "00", "measurement_salt": "00"}"#,
                "'q'",
            ),
            (
                r#"{"key": 98765432101, "salt": "00", "measurement_salt": "00"}"#,
                "98765432101",
            ),
            (
                r#"{"key": "4142434", "salt": "00", "measurement_salt": "00"}"#,
                "4142434",
            ),
        ] {
            std::fs::write(&path, file).unwrap();
            let Err(e) = MasterSecret::load(ws.path()) else {
                panic!("{file} accepted");
            };
            let e = format!("{e:#}");
            assert!(e.contains(MASTER_SECRET_FILE), "{e}");
            assert!(!e.contains(secret_part), "{e}");
        }
    }

    /// The operator commands read the master secret only from a private
    /// workspace: one every user can write, or another user's, is refused
    /// with the reason, whatever it holds.
    #[test]
    fn a_workspace_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let ws = tempfile::tempdir().unwrap();
        std::fs::write(ws.path().join(MASTER_SECRET_FILE), "{}").unwrap();
        std::fs::set_permissions(ws.path(), std::fs::Permissions::from_mode(0o757)).unwrap();
        let e = format!("{:#}", MasterSecret::load(ws.path()).err().unwrap());
        assert!(e.contains("writable by every user (mode 757)"), "{e}");
        // Group-writable by this user's private group (umask 002) is
        // taken: the file's own content is what fails here.
        std::fs::set_permissions(ws.path(), std::fs::Permissions::from_mode(0o770)).unwrap();
        let me = nix::unistd::User::from_uid(nix::unistd::geteuid())
            .unwrap()
            .unwrap();
        let own = nix::unistd::Group::from_name(&me.name).unwrap();
        if let Some(own) = own.filter(|g| g.mem.iter().all(|m| *m == me.name)) {
            std::os::unix::fs::chown(ws.path(), None, Some(own.gid.as_raw())).unwrap();
            let e = format!("{:#}", MasterSecret::load(ws.path()).err().unwrap());
            assert!(e.contains("is not a master secret file"), "{e}");
        }
        if nix::unistd::geteuid().is_root() {
            // Writable by a shared group (nogroup here): refused, and taken
            // again once the group may no longer write.
            std::os::unix::fs::chown(ws.path(), None, Some(65534)).unwrap();
            let e = format!("{:#}", MasterSecret::load(ws.path()).err().unwrap());
            assert!(
                e.contains("writable by its group (gid 65534, mode 770)"),
                "{e}"
            );
            std::fs::set_permissions(ws.path(), std::fs::Permissions::from_mode(0o750)).unwrap();
            let e = format!("{:#}", MasterSecret::load(ws.path()).err().unwrap());
            assert!(e.contains("is not a master secret file"), "{e}");
            std::os::unix::fs::chown(ws.path(), Some(65534), None).unwrap();
            let e = format!("{:#}", MasterSecret::load(ws.path()).err().unwrap());
            assert!(e.contains("belongs to another user (uid 65534)"), "{e}");
        }
    }

    /// Attacker's move, as another user: a workspace made under a shared
    /// project directory inherits its default ACL, which lets that user
    /// write, while the mode shows only the owner's private group. The
    /// ACL is read: a named user or a shared group that may write is
    /// refused; one that may only read, or whose write the mask takes
    /// away, is not.
    #[test]
    fn a_workspace_whose_acl_lets_another_user_write_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let ws = tempfile::tempdir().unwrap();
        std::fs::set_permissions(ws.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let entry = |tag: u16, perm: u16, id: u32| {
            [
                &tag.to_le_bytes()[..],
                &perm.to_le_bytes(),
                &id.to_le_bytes(),
            ]
            .concat()
        };
        // The kernel takes entries in the order of their tags.
        let acl = |named: Vec<u8>, mask: u16| {
            let mut entries = [
                entry(0x01, 7, u32::MAX),
                named,
                entry(0x04, 5, u32::MAX),
                entry(0x10, mask, u32::MAX),
                entry(0x20, 0, u32::MAX),
            ];
            entries.sort_by_key(|e| u16::from_le_bytes([e[0], e[1]]));
            [2u32.to_le_bytes().to_vec(), entries.concat()].concat()
        };
        let set = |value: &[u8]| {
            rustix::fs::setxattr(ws.path(), ACL_XATTR, value, rustix::fs::XattrFlags::empty())
                .unwrap()
        };
        set(&acl(entry(0x02, 7, 65534), 7));
        let e = format!("{:#}", check_private(ws.path()).unwrap_err());
        assert!(
            e.contains("ACL that lets the user with uid 65534 write"),
            "{e}"
        );
        set(&acl(entry(0x08, 7, 65534), 7));
        let e = format!("{:#}", check_private(ws.path()).unwrap_err());
        assert!(
            e.contains("ACL that lets the group with gid 65534 write"),
            "{e}"
        );
        set(&acl(entry(0x02, 5, 65534), 7));
        assert!(acl_writer(ws.path(), me, "workspace").unwrap().is_none());
        set(&acl(entry(0x02, 7, 65534), 5));
        assert!(acl_writer(ws.path(), me, "workspace").unwrap().is_none());
        set(&acl(entry(0x02, 7, me), 7));
        assert!(acl_writer(ws.path(), me, "workspace").unwrap().is_none());
    }

    /// A group named as the user, listing no one, is still shared when it
    /// is another user's primary group.
    #[test]
    fn a_group_that_is_another_users_primary_group_is_shared() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\nop:x:1000:1000::/home/op:/bin/sh\n\
                      bob:x:1001:1000::/home/bob:/bin/sh\n";
        assert!(others_of_primary_group(passwd, 1000, "op"));
        assert!(!others_of_primary_group(passwd, 0, "root"));
        assert!(!others_of_primary_group(passwd, 1001, "bob"));
    }

    /// Two runs that change the image record at once (a push and an
    /// upgrade's finish): each reads, changes and writes under the lock,
    /// so neither's change is lost. Each change here reads the record,
    /// waits, and adds its own bit to the epoch.
    #[test]
    fn changes_to_the_image_record_at_once_lose_nothing() {
        let ws = tempfile::tempdir().unwrap();
        ImageRecord::update_or_create(ws.path(), |r| r.digest = hex::encode(set(4).digest()))
            .unwrap();
        let threads: Vec<_> = (0..8u32)
            .map(|bit| {
                let ws = ws.path().to_owned();
                std::thread::spawn(move || {
                    ImageRecord::update(&ws, |r| {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        r.epoch |= 1 << bit;
                    })
                    .unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(ImageRecord::load(ws.path()).unwrap().unwrap().epoch, 0xff);
    }

    /// A lock file's name planted as a symbolic link: the CLI neither
    /// follows it (creating or locking the file it names) nor changes the
    /// record.
    #[test]
    fn a_planted_lock_link_is_not_followed() {
        let ws = tempfile::tempdir().unwrap();
        let target = ws.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, ws.path().join(REVOKED_LOCK_FILE)).unwrap();
        let ek = keel_verifier::ek::EkDigest::of_marshalled(b"revoked").to_string();
        assert!(RevokedRecord::add(ws.path(), &ek).is_err());
        assert!(!target.exists(), "the link was followed");
        assert!(RevokedRecord::load(ws.path()).unwrap().eks.is_empty());
        std::os::unix::fs::symlink(&target, ws.path().join(IMAGE_LOCK_FILE)).unwrap();
        assert!(ImageRecord::update_or_create(ws.path(), |r| r.epoch = 1).is_err());
        assert!(!target.exists(), "the link was followed");
    }

    /// A revoked EK is refused, another is not; the record survives a round
    /// trip and takes only EK digests.
    #[test]
    fn a_revoked_ek_is_refused_from_the_workspace() {
        let ws = tempfile::tempdir().unwrap();
        let (revoked, other) = (
            keel_verifier::ek::EkDigest::of_marshalled(b"revoked"),
            keel_verifier::ek::EkDigest::of_marshalled(b"other"),
        );
        RevokedRecord::load(ws.path())
            .unwrap()
            .refuse(&revoked)
            .unwrap();
        RevokedRecord::add(ws.path(), &revoked.to_string()).unwrap();
        RevokedRecord::add(ws.path(), &revoked.to_string()).unwrap();
        let record = RevokedRecord::load(ws.path()).unwrap();
        assert_eq!(record.eks.len(), 1);
        assert!(record.refuse(&revoked).is_err());
        record.refuse(&other).unwrap();
        for bad in ["w-1", "sha256:abc", &format!("sha256:{}", "G".repeat(64))] {
            assert!(RevokedRecord::add(ws.path(), bad).is_err(), "{bad}");
        }
    }

    /// The record takes the current and the staged set, nothing else, and
    /// survives a round trip through the workspace; a workspace without one
    /// has none until a push makes one.
    #[test]
    fn the_record_takes_the_current_and_the_staged_set_only() {
        let ws = tempfile::tempdir().unwrap();
        assert_eq!(ImageRecord::load(ws.path()).unwrap(), None);
        ImageRecord::update(ws.path(), |r| r.epoch = 9).unwrap();
        assert_eq!(
            ImageRecord::load(ws.path()).unwrap(),
            None,
            "update made one"
        );
        // A push makes one where there was none.
        ImageRecord::update_or_create(ws.path(), |r| r.digest = hex::encode(set(4).digest()))
            .unwrap();
        let made = ImageRecord::load(ws.path()).unwrap().unwrap();
        made.require(&set(4)).unwrap();
        made.require(&set(1)).unwrap_err();
        let (current, staged, retired) = (set(1), set(2), set(3));
        let record = ImageRecord {
            digest: hex::encode(current.digest()),
            epoch: 2,
            staged: None,
        };
        record.save(ws.path()).unwrap();
        let staged_digest = hex::encode(staged.digest());
        ImageRecord::update(ws.path(), |r| r.staged = Some(staged_digest)).unwrap();
        let record = ImageRecord::load(ws.path()).unwrap().unwrap();
        record.require(&current).unwrap();
        record.require(&staged).unwrap();
        let refused = record.require(&retired).unwrap_err().to_string();
        assert!(
            refused.contains(&format!("sha256:{}", hex::encode(retired.digest())))
                && refused.contains(&format!("staged sha256:{}", hex::encode(staged.digest()))),
            "{refused}"
        );
    }
}
