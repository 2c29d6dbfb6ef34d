//! `keel init`: create a cluster on its first node.

use std::io::Write as _;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use keel_atls::AtlsClient;
use keel_installer::durable::{parent_dir, sync_parent};
use keel_proto::init::init_response::Kind;
use keel_proto::init::init_service_client::InitServiceClient;
use keel_proto::init::{InitRequest, InitSecrets};
use keel_proto::MAX_FAILURE_LOG_BYTES;
use keel_verifier::cluster_settings::{
    check_cluster_name, check_cluster_network, DEFAULT_SERVICE_CIDR,
};
use keel_verifier::credential;
use keel_verifier::keys;
use keel_verifier::measurement::pcr;
use keel_verifier::signature::{SignedMeasurements, SigningPublicKey};
use keel_verifier::validator::Verified;
use prost::Message as _;
use rand::RngCore;
use tonic::transport::Endpoint;
use zeroize::{Zeroize as _, Zeroizing};

use crate::files::{create_temporary, remove_temporaries};
use crate::operator::{connection_failed, never_sent, transport_failure};
use crate::printable::printable;
use crate::settings::{read_bounded, Settings};
use crate::workspace::{
    IdFile, MasterSecretFile, FAILURE_LOG_FILE, ID_FILE, KUBECONFIG_FILE, MASTER_SECRET_FILE,
};

/// How long `keel init` waits before it sends again an init request the
/// node answered as busy.
const INIT_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

/// The shortest pause `keel init` takes before it sends again on a hold,
/// whatever the node says (the nodes say at least 1 s).
const MIN_HELD_BACK: std::time::Duration = std::time::Duration::from_secs(1);

/// The longest hold on this address that `keel init` waits out before it
/// sends again, on the same attested connection: well below the 30 s after
/// which a node closes a connection with no request in flight. A longer
/// one ends the run.
const MAX_HELD_BACK: std::time::Duration = std::time::Duration::from_secs(20);

/// The time a retry must have left for the node's answer: one sent later
/// would run into `--timeout` before a busy answer could say it was not
/// read. A node lets a request wait up to 10 s for a place among those it
/// reads before it answers busy.
const INIT_ANSWER_TIME: std::time::Duration = std::time::Duration::from_secs(11);

/// Writes `data` to `path` with mode 0600, refusing to replace an existing
/// file, and syncs the file and its directory: the secret is on disk before
/// any node can receive it. It is written whole to a temporary file first
/// and then linked into place, which fails if `path` exists: a crash or a
/// failed write never leaves a part of a secret at `path`, where it would
/// block every later run (an existing secret is never replaced). What an
/// earlier run that crashed left of its temporary files goes first. On a
/// file system without hard links, the file is created in place instead
/// (and removed again if it could not be written whole).
fn write_new_secret_file(path: &Path, data: &[u8], if_exists: &str) -> anyhow::Result<()> {
    let dir = parent_dir(path);
    let name = path.file_name().unwrap_or(path.as_os_str());
    remove_temporaries(dir, name, "new");
    if path.symlink_metadata().is_ok() {
        bail!("{} exists ({if_exists})", path.display());
    }
    let (temp, mut f) = create_temporary(dir, name, "new")
        .with_context(|| format!("creating a file in {}", dir.display()))?;
    let written = f
        .write_all(data)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {} (nothing was sent)", temp.display()));
    drop(f);
    let placed = written.and_then(|()| match std::fs::hard_link(&temp, path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            Err(anyhow::Error::new(e).context(format!("creating {} ({if_exists})", path.display())))
        }
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(nix::libc::EPERM | nix::libc::EOPNOTSUPP | nix::libc::ENOSYS)
            ) =>
        {
            write_in_place(path, data, if_exists)
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("creating {}", path.display()))),
    });
    let _ = std::fs::remove_file(&temp);
    placed?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing {}", dir.display()))?;
    Ok(())
}

/// Writes the secret `data` to `path` with mode 0600: a new file as
/// [`write_new_secret_file`] does (never over one, `if_exists` saying why
/// and what to do), or, with `replace`, over the file there, through a
/// temporary file renamed into place ([`write_atomic`]; never through a
/// symbolic link).
pub(crate) fn write_secret_file(
    path: &Path,
    data: &[u8],
    replace: bool,
    if_exists: &str,
) -> anyhow::Result<()> {
    if replace {
        write_atomic(path, data, 0o600)
    } else {
        write_new_secret_file(path, data, if_exists)
    }
}

/// [`write_new_secret_file`] where hard links are not supported: created
/// in place (never over a file), written, synced; removed again if it
/// could not be written whole.
fn write_in_place(path: &Path, data: &[u8], if_exists: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            let context = if e.kind() == std::io::ErrorKind::AlreadyExists {
                format!("creating {} ({if_exists})", path.display())
            } else {
                format!("creating {}", path.display())
            };
            anyhow::Error::new(e).context(context)
        })?;
    if let Err(e) = f.write_all(data).and_then(|()| f.sync_all()) {
        drop(f);
        let _ = std::fs::remove_file(path);
        return Err(e).with_context(|| {
            format!(
                "writing {} (removed again; nothing was sent)",
                path.display()
            )
        });
    }
    Ok(())
}

/// Why a workspace's master secret file is never written over.
const MASTER_SECRET_KEPT: &str = "an existing master secret is never replaced: if an earlier \
     init sent it, a node holds it; keep the file and give this init another --workspace";

/// The init secret in the settings' `init_secret_file`; refused when
/// shorter than [`MIN_INIT_SECRET_BYTES`].
pub(crate) fn read_init_secret(settings: &Settings) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    let Some(p) = &settings.init_secret_file else {
        bail!("the settings name no init_secret_file");
    };
    let path = settings.resolve(p);
    let secret = crate::settings::read_bounded_secret(&path)?;
    if secret.len() < MIN_INIT_SECRET_BYTES {
        bail!(
            "{} holds {} bytes; an init secret needs at least {MIN_INIT_SECRET_BYTES}: \
             its hash is in the node's measured config, which anyone who connects \
             to the node can read, so a short one can be guessed offline (make one \
             with `keel init-secret FILE`); nothing was sent",
            path.display(),
            secret.len()
        );
    }
    Ok(secret)
}

/// Checks `secret` against the hash in the node's measured config with
/// `matches` (memory-hard): a secret that does not match is said here,
/// with nothing sent, instead of costing the node a check and this
/// address a wait.
pub(crate) fn check_init_secret(
    verified: &Verified,
    secret: &[u8],
    matches: fn(&str, &[u8]) -> bool,
) -> anyhow::Result<()> {
    let node_hash = verified
        .cluster_config()
        .map(|c| c.init_secret_hash)
        .unwrap_or_default();
    if !matches(&node_hash, secret) {
        bail!(
            "the init secret does not match the hash in the node's measured config \
             (cluster.init_secret_hash), or the node names none it accepts; nothing was sent"
        );
    }
    Ok(())
}

/// `keel init-secret`: writes a new init secret (32 random bytes as 64 hex
/// digits) to `path`, mode 0600, never replacing a file; returns its hash
/// for the node config's `cluster.init_secret_hash`.
pub fn new_init_secret(path: &Path) -> anyhow::Result<String> {
    let secret = Zeroizing::new(hex::encode(&*random32()));
    let hash = keel_verifier::init_secret::hash(secret.as_bytes())
        .map_err(|e| anyhow::anyhow!("hashing the init secret: {e}"))?;
    write_new_secret_file(
        path,
        secret.as_bytes(),
        "an existing init secret is never replaced: its hash may be in a node config already",
    )?;
    Ok(hash)
}

/// Creates the workspace, mode 0700 for every directory created, and refuses
/// one that is not private ([`crate::workspace::check_private`]) or where a
/// file `keel init` writes is a symbolic link, before anything is written
/// or sent.
fn create_workspace(workspace: &Path) -> anyhow::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(workspace)
        .with_context(|| format!("creating {}", workspace.display()))?;
    crate::workspace::check_private(workspace)?;
    for name in [KUBECONFIG_FILE, ID_FILE, FAILURE_LOG_FILE] {
        refuse_link(&workspace.join(name))?;
    }
    Ok(())
}

/// Fails if `path` exists as anything but a regular file.
fn refuse_link(path: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => bail!(
            "{} is a symbolic link: refusing to write through it (remove it and retry)",
            path.display()
        ),
        Ok(meta) if !meta.is_file() => {
            bail!("{} exists and is not a regular file", path.display())
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("checking {}", path.display())),
    }
}

/// Writes `data` to `path` atomically and durably with `mode`
/// ([`keel_installer::durable::replace`]); `path` must not be a symbolic
/// link ([`refuse_link`]).
pub(crate) fn write_atomic(path: &Path, data: &[u8], mode: u32) -> anyhow::Result<()> {
    refuse_link(path)?;
    keel_installer::durable::replace(path, data, mode)
        .with_context(|| format!("writing {}", path.display()))
}

/// What [`ID_FILE`] records of a cluster whose secrets make `cluster_id`,
/// initialised through the settings' endpoint.
fn id_file(settings: &Settings, cluster_id: keys::ClusterId) -> IdFile {
    IdFile {
        cluster_id: hex::encode(cluster_id),
        endpoint: settings.endpoint.clone(),
    }
}

/// Records, for an init whose result did not arrive, the cluster ID its
/// secrets make, so that the workspace's operator commands (`status`,
/// `revoke`, `upgrade`) reach the cluster should the node have finished;
/// returns what to add to the error.
fn record_unconfirmed_id(
    workspace: &Path,
    settings: &Settings,
    cluster_id: keys::ClusterId,
) -> String {
    let id = id_file(settings, cluster_id);
    let path = workspace.join(ID_FILE);
    let written = serde_json::to_vec_pretty(&id)
        .map_err(anyhow::Error::from)
        .and_then(|json| Reserved::new(&path, 0o644, ID_ROOM)?.commit(&json));
    match written {
        Ok(()) => format!(
            ". The cluster ID its secrets make, {}, is recorded in {}: if the node \
             finished, {}, and `keel status` reaches it",
            id.cluster_id,
            path.display(),
            fetch_again(settings)
        ),
        Err(e) => format!(
            ". Recording the cluster ID its secrets make, {}, failed: {e:#}",
            id.cluster_id
        ),
    }
}

/// What an error says when the node read no init request: the master
/// secret written to `secret_path` was never used, and how to start over.
fn unused_secret(secret_path: &Path) -> String {
    format!(
        "the node took no init request, and the master secret in {} was never used; remove \
         that file (or give another --workspace) and run keel init again",
        secret_path.display()
    )
}

/// How the operator gets the admin kubeconfig of the cluster initialised
/// through the settings' endpoint when its init result was lost.
fn fetch_again(settings: &Settings) -> String {
    format!(
        "`keel kubeconfig --endpoint {}` (with this init's --settings and --workspace) \
         fetches its admin kubeconfig into the workspace",
        printable(&settings.endpoint)
    )
}

/// A file's replacement, made ready before its content exists: a new
/// temporary file in the same directory ([`create_temporary`]) with room
/// allocated for it, so that writing the content later does not fail for
/// want of space or of a writable directory. [`Reserved::commit`] writes
/// and syncs it, renames it over the file and syncs the directory: a
/// reader sees the old content or the new, never a part. Dropped without
/// a commit, the temporary file is removed.
struct Reserved {
    path: PathBuf,
    temp: PathBuf,
    file: std::fs::File,
    mode: u32,
    committed: bool,
}

impl Reserved {
    /// Reserves `room` bytes for `path`, which must not be a symbolic link
    /// (the rename would replace the link, not write through it, but a
    /// planted link means someone else can write in the workspace).
    fn new(path: &Path, mode: u32, room: u64) -> anyhow::Result<Self> {
        refuse_link(path)?;
        let dir = parent_dir(path);
        let name = path
            .file_name()
            .with_context(|| format!("{} names no file", path.display()))?;
        let (temp, file) = create_temporary(dir, name, "tmp").with_context(|| {
            format!(
                "creating a temporary file for {} in {}",
                path.display(),
                dir.display()
            )
        })?;
        let reserved = Self {
            path: path.to_owned(),
            temp,
            file,
            mode,
            committed: false,
        };
        let len = i64::try_from(room).unwrap_or(i64::MAX);
        if len > 0 {
            match nix::fcntl::posix_fallocate(reserved.file.as_raw_fd(), 0, len) {
                // Filesystems without allocation: the write may still find
                // room.
                Ok(()) | Err(nix::errno::Errno::EOPNOTSUPP | nix::errno::Errno::EINVAL) => {}
                Err(e) => {
                    return Err(std::io::Error::from(e))
                        .with_context(|| format!("allocating {room} bytes for {}", path.display()))
                }
            }
        }
        Ok(reserved)
    }

    /// Writes `data` as the file's content (see [`Reserved`]). Once the
    /// content is in the temporary file, nothing removes it: should the
    /// rename fail, the error names the file that holds it.
    fn commit(mut self, data: &[u8]) -> anyhow::Result<()> {
        let written = (|| {
            // Exactly `mode`, whatever the umask.
            self.file
                .set_permissions(std::fs::Permissions::from_mode(self.mode))?;
            self.file.write_all(data)?;
            self.file.set_len(data.len() as u64)?;
            self.file.sync_all()
        })();
        written.with_context(|| format!("writing {}", self.path.display()))?;
        self.committed = true;
        std::fs::rename(&self.temp, &self.path).with_context(|| {
            format!(
                "renaming {} to {}: the content is in the former",
                self.temp.display(),
                self.path.display()
            )
        })?;
        if let Err(e) = sync_parent(&self.path) {
            eprintln!(
                "warning: {} is written, but syncing its directory failed ({e}): a crash \
                 now may lose it",
                self.path.display()
            );
        }
        Ok(())
    }
}

impl Drop for Reserved {
    /// Removes the temporary file unless it holds content.
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

fn random32() -> Zeroizing<Vec<u8>> {
    let mut v = Zeroizing::new(vec![0u8; 32]);
    rand::rngs::OsRng.fill_bytes(&mut v);
    v
}

/// Binds an attested channel to the node at `name` (reached at
/// `endpoint`), retrying for up to `wait` while the node is unreachable
/// (still booting), and for at least 2 minutes while it says it is busy
/// ([`crate::reach::until_reachable`]); any other failure ends at once.
/// Errors and retries name the node: a command may reach several.
pub(crate) async fn connect(
    client: &AtlsClient<Verified>,
    name: &str,
    endpoint: Endpoint,
    wait: Duration,
) -> anyhow::Result<keel_atls::BoundChannel<Verified>> {
    crate::reach::until_reachable(name, wait, || client.bind_channel(endpoint.clone()))
        .await
        .map_err(|e| anyhow::anyhow!("{}", keel_atls::ErrorChain(&e)))
        .with_context(|| {
            format!(
                "{}: the node's attestation was not accepted or it was not reachable; nothing \
                 was sent",
                printable(name)
            )
        })
}

/// Runs `keel init`.
pub async fn run(
    settings_path: &Path,
    workspace: &Path,
    skip_helm_wait: bool,
    wait: Duration,
    deadline: Duration,
) -> anyhow::Result<()> {
    let settings = Settings::load(settings_path)?;
    // Read once: the node is validated against, and its join service gets,
    // the same measurements.
    let (measurements_body, mut measurements) = settings.measurements_file()?;
    // In no cluster, whatever the file says of PCR 15: a node that joined
    // one (or was initialised) has it set, and gets no secret of this one.
    measurements.require(pcr::CLUSTER_ID, [0; 32]);
    let validator = settings.validator(measurements)?;
    // Refuse a bad key before anything reaches the node.
    let signing_key = settings.signing_key()?;
    let init_secret = read_init_secret(&settings)?;
    let version = keel_installer::resolve(&settings.kubernetes_version)
        .map_err(|e| anyhow::anyhow!("{e}; nothing was sent"))?
        .version();
    // What the node would refuse is said here, before a master secret is
    // made for a request that cannot succeed.
    check_cluster_name(&settings.cluster_name)
        .and_then(|()| {
            check_cluster_network(
                if settings.service_cidr.is_empty() {
                    DEFAULT_SERVICE_CIDR
                } else {
                    &settings.service_cidr
                },
                &settings.api_server_cert_sans,
            )
        })
        .map_err(|e| anyhow::anyhow!("settings: {e}; nothing was sent"))?;
    create_workspace(workspace)?;

    // An earlier init's master secret is never replaced; said before
    // connecting (the new one is written once every check passed).
    let secret_path = workspace.join(MASTER_SECRET_FILE);
    if std::fs::symlink_metadata(&secret_path).is_ok() {
        bail!("{} exists: {MASTER_SECRET_KEPT}", secret_path.display());
    }
    // An admin kubeconfig without its master secret is an earlier
    // cluster's (the secret moved or removed by hand): never written over.
    let kubeconfig_path = workspace.join(KUBECONFIG_FILE);
    if std::fs::symlink_metadata(&kubeconfig_path).is_ok() {
        bail!(
            "{} exists without a master secret beside it: it is an earlier cluster's admin \
             kubeconfig, which this init would replace; move it away or use another workspace \
             (nothing was sent)",
            kubeconfig_path.display()
        );
    }

    let endpoint = Settings::grpc_endpoint(&settings.endpoint)?;
    eprintln!(
        "connecting to {} and verifying its attestation",
        printable(&settings.endpoint)
    );
    let client = AtlsClient::server_attested(Arc::new(validator));
    let bound = connect(&client, &settings.endpoint, endpoint, wait).await?;
    let attested = bound
        .attested
        .context("the node presented no attestation")?;
    let verified = attested.claims();
    settings
        .check_node_attestation(verified)
        .and_then(|()| check_control_plane(verified))
        .and_then(|()| settings.check_component_mirror(verified))
        .context("nothing was sent")?;
    for w in &verified.warnings {
        eprintln!("warning: {w}");
    }
    eprintln!(
        "node attested: {} PCRs match, event log replays ({} events), attestation key proven in its TPM",
        verified.pcrs.len(),
        verified.events.len()
    );
    check_init_secret(verified, &init_secret, keel_verifier::init_secret::matches)?;
    let join_measurements_signature = image_signature(
        &settings,
        verified,
        signing_key.as_ref(),
        &measurements_body,
    )?;
    // The operator's own components, signed where the settings' key (now
    // known to be the node's) is named.
    let components = match &settings.components_file {
        Some(p) => Some(crate::settings::read_components(
            &settings.resolve(p),
            version,
            None,
            signing_key.as_ref(),
        )?),
        None => None,
    };
    let (components, (components_file, components_signature)) = match components {
        Some(file) => (Some(file.components), file.signed.unwrap_or_default()),
        None => (None, Default::default()),
    };
    // Where the result goes is ready, with room for it, before anything
    // leaves this machine: once the node is initialised, its kubeconfig
    // is never sent again.
    let outputs = Outputs {
        kubeconfig: Reserved::new(&workspace.join(KUBECONFIG_FILE), 0o600, KUBECONFIG_ROOM)?,
        id: Reserved::new(&workspace.join(ID_FILE), 0o644, ID_ROOM)?,
    };
    // The master secret is on disk before anything leaves this machine.
    let master_secret = random32();
    let master_salt = random32();
    let measurement_salt = random32();
    let secret_file = MasterSecretFile {
        key: Zeroizing::new(hex::encode(&*master_secret)),
        salt: hex::encode(&*master_salt),
        measurement_salt: hex::encode(&*measurement_salt),
    };
    // Written into a wiped buffer with room for the whole file (about 250
    // bytes), so it never grows and leaves a copy of the key behind.
    let mut secret_json = Zeroizing::new(Vec::with_capacity(1024));
    serde_json::to_writer_pretty(&mut *secret_json, &secret_file)
        .context("encoding the master secret file")?;
    drop(secret_file);
    // The cluster ID these secrets make, which the node must report.
    let cluster_id =
        crate::workspace::derive_cluster_id(&master_secret, &master_salt, &measurement_salt)?;
    write_new_secret_file(&secret_path, &secret_json, MASTER_SECRET_KEPT)?;
    eprintln!(
        "master secret written to {} (mode 0600): keep it to recover the cluster",
        secret_path.display()
    );

    // Both secrets are sealed to the TPM whose EK and AK were just proven
    // (attested, and resident by credential activation in the handshake).
    let mut plain = InitSecrets {
        init_secret: init_secret.to_vec(),
        master_secret: master_secret.to_vec(),
    };
    let secrets = Zeroizing::new(plain.encode_to_vec());
    plain.init_secret.zeroize();
    plain.master_secret.zeroize();
    let sealed = credential::seal(&verified.ek, &verified.ak.name, &secrets)
        .context("sealing the init and master secrets to the node's TPM")?;

    let request = InitRequest {
        secrets: Some(sealed),
        master_salt: master_salt.to_vec(),
        measurement_salt: measurement_salt.to_vec(),
        // The version resolved here, whose components were checked above.
        kubernetes_version: version.to_string(),
        kubernetes_components: components,
        cluster_name: settings.cluster_name.clone(),
        api_server_cert_sans: settings.api_server_cert_sans.clone(),
        service_cidr: settings.service_cidr.clone(),
        // The node's join service admits nodes that match what this node
        // matched: the file as read, so its signature still covers it.
        join_measurements: measurements_body,
        join_measurements_signature,
        components_file,
        components_signature,
    };
    let ends = tokio::time::Instant::now() + deadline;
    let mut client = InitServiceClient::new(bound.channel)
        .max_decoding_message_size(keel_proto::MAX_INIT_RESPONSE_BYTES);
    // The node reads a few init requests at once, one per address: one
    // told to try again (others hold the places, perhaps someone else's
    // slow requests), or held back for a short while, is sent again until
    // the timeout.
    let answer = loop {
        let Ok(answer) = tokio::time::timeout_at(ends, client.init(request.clone())).await else {
            // Also a retry sent just before the timeout: the node may have
            // read it and gone on.
            bail!(
                "the node did not answer init within {} s (--timeout): it may have received \
                 the request and be setting up the cluster{}",
                deadline.as_secs(),
                record_unconfirmed_id(workspace, &settings, cluster_id)
            );
        };
        let Err(s) = &answer else { break answer };
        // Busy, or holding this address back after requests from it that
        // it refused (another client's, behind the same address): either
        // way the node did not read this request.
        let (pause, why) = if keel_proto::told_busy(s) {
            (
                INIT_RETRY,
                format!("the node is busy ({})", printable(s.message())),
            )
        } else if let Some(wait) = keel_proto::held_back_for(s).filter(|w| *w <= MAX_HELD_BACK) {
            (
                wait.max(MIN_HELD_BACK),
                "the node holds back init requests from this address, after requests from it \
                 that it refused"
                    .to_owned(),
            )
        } else {
            break answer;
        };
        if tokio::time::Instant::now() + pause + INIT_ANSWER_TIME >= ends {
            break answer;
        }
        eprintln!("{why}; trying again in {} s", pause.as_secs());
        tokio::time::sleep(pause).await;
    };
    let mut stream = match answer {
        Ok(answer) => answer.into_inner(),
        // No connection to send it on: any earlier attempt was answered
        // busy, unread, so the node took no init request.
        Err(s) if never_sent(&s) => bail!(
            "the connection to the node was gone before init could be sent ({}): {}",
            printable(&transport_failure(&s)),
            unused_secret(&secret_path)
        ),
        // The request may have reached the node, which then goes on: it is
        // not sent again (a second init would be refused, the first
        // continuing), and the operator learns how to find its result.
        Err(s) if connection_failed(&s) => bail!(
            "the connection to the node failed before it answered init ({}): it may have \
             received the request and be setting up the cluster{}",
            printable(&transport_failure(&s)),
            record_unconfirmed_id(workspace, &settings, cluster_id)
        ),
        // Held back longer than the run waits: this request was not read
        // either.
        Err(s) if keel_proto::held_back_for(&s).is_some() => bail!(
            "the node holds back init requests from this address ({}), after requests from it \
             that it refused: {}",
            printable(s.message()),
            unused_secret(&secret_path)
        ),
        // Still busy with too little time left to ask again: this request
        // was not read either.
        Err(s) if keel_proto::told_busy(&s) => bail!(
            "the node was still busy when --timeout ran out ({}): {}",
            printable(s.message()),
            unused_secret(&secret_path)
        ),
        // Refused by its checks, which all come before the node's lock:
        // the master secret is as unused as the node.
        Err(s) if !matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Internal) => bail!(
            "the node refused init ({:?}): {}; {}",
            s.code(),
            printable(s.message()),
            unused_secret(&secret_path)
        ),
        Err(s) => bail!(
            "the node refused init ({:?}): {}",
            s.code(),
            printable(s.message())
        ),
    };

    let mut outcome = Outcome::default();
    let followed = tokio::time::timeout_at(
        ends,
        follow(
            &mut stream,
            &mut outcome,
            workspace,
            outputs,
            &settings,
            skip_helm_wait,
            cluster_id,
        ),
    )
    .await;
    match followed {
        Ok(result) => result,
        Err(_) => {
            let logs = match &outcome.failure {
                Some(_) => format!("; partial node logs {}", failure_logs(workspace, &outcome)),
                None => String::new(),
            };
            bail!(
                "init did not end within {} s (--timeout){logs}. The node may still be \
                 working: its console shows where it stands, but its result, the kubeconfig \
                 included, no longer reaches this machine{}",
                deadline.as_secs(),
                // A node that reported a failure made no cluster.
                if outcome.failure.is_none() {
                    record_unconfirmed_id(workspace, &settings, cluster_id)
                } else {
                    String::new()
                }
            )
        }
    }
}

/// Room allocated for the kubeconfig before init (an admin kubeconfig is a
/// few KiB; a larger one is still written, into what room the disk has).
const KUBECONFIG_ROOM: u64 = 64 * 1024;
/// Room allocated for the cluster ID file before init.
const ID_ROOM: u64 = 4 * 1024;

/// The files a successful init writes, reserved before it is sent.
struct Outputs {
    kubeconfig: Reserved,
    id: Reserved,
}

/// What the node's init stream said so far.
#[derive(Default)]
struct Outcome {
    /// The node's error, and whether it resets.
    failure: Option<(String, bool)>,
    /// Its logs, at most [`MAX_FAILURE_LOG_BYTES`].
    logs: Vec<u8>,
    /// Log bytes beyond the bound, dropped.
    dropped: usize,
}

impl Outcome {
    fn take_logs(&mut self, chunk: &[u8]) {
        let room = MAX_FAILURE_LOG_BYTES.saturating_sub(self.logs.len());
        let kept = chunk.len().min(room);
        self.logs.extend_from_slice(&chunk[..kept]);
        self.dropped = self.dropped.saturating_add(chunk.len() - kept);
    }
}

/// Follows the node's init stream to its end: prints its lines, keeps its
/// logs in `outcome`, writes the kubeconfig and cluster ID to `outputs` on
/// success.
async fn follow(
    stream: &mut tonic::Streaming<keel_proto::init::InitResponse>,
    outcome: &mut Outcome,
    workspace: &Path,
    outputs: Outputs,
    settings: &Settings,
    skip_helm_wait: bool,
    cluster_id: keys::ClusterId,
) -> anyhow::Result<()> {
    loop {
        let message = match stream.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(s) => {
                if let Some((error, _)) = &outcome.failure {
                    bail!(
                        "init failed: {}; the log stream broke off ({}): partial logs {}",
                        printable(error),
                        printable(s.message()),
                        failure_logs(workspace, outcome)
                    );
                }
                bail!(
                    "the connection to the node was lost during init: {}{}",
                    printable(s.message()),
                    record_unconfirmed_id(workspace, settings, cluster_id)
                );
            }
        };
        match message.kind {
            Some(Kind::LogLine(line)) => eprintln!("  node: {}", printable(&line)),
            Some(Kind::Success(success)) => {
                // Nothing of a node that misreports is kept.
                if success.cluster_id != cluster_id {
                    bail!(
                        "the node reports cluster ID {}, but the master secret it was sent \
                         makes {}: it does not run the agent its measurements name, or \
                         misreports; do not use this cluster (its kubeconfig was not written)",
                        hex::encode(&success.cluster_id),
                        hex::encode(cluster_id)
                    );
                }
                if let Err(e) = crate::kubeconfig::check("the node", &success.kubeconfig) {
                    bail!(
                        "{e:#}. The node created the cluster, but does not run what its \
                         measurements name or was taken over since: do not use this cluster"
                    );
                }
                let kubeconfig = outputs.kubeconfig.path.clone();
                // The ID the workspace's secrets make is the one recorded.
                let id = id_file(settings, cluster_id);
                // Each file is tried whatever became of the other.
                let wrote_kubeconfig = outputs.kubeconfig.commit(&success.kubeconfig);
                let wrote_id = serde_json::to_vec_pretty(&id)
                    .map_err(anyhow::Error::from)
                    .and_then(|json| outputs.id.commit(&json));
                let again = match (&wrote_kubeconfig, &wrote_id) {
                    (Err(_), Ok(())) => format!(". {}", fetch_again(settings)),
                    (Err(_), Err(_)) => format!(
                        ". Once {ID_FILE} records this cluster ID, {}",
                        fetch_again(settings)
                    ),
                    _ => String::new(),
                };
                if let Err(e) = wrote_kubeconfig.and(wrote_id) {
                    bail!(
                        "the cluster was created (cluster ID {}), but writing its result \
                         failed: {e:#}{again}",
                        id.cluster_id
                    );
                }
                println!("cluster created");
                println!("cluster ID: {}", id.cluster_id);
                println!("kubeconfig: {}", kubeconfig.display());
                if skip_helm_wait {
                    eprintln!("(--skip-helm-wait: nothing to wait for)");
                }
                return Ok(());
            }
            Some(Kind::Failure(f)) => outcome.failure = Some((f.error, f.node_reset)),
            Some(Kind::LogChunk(chunk)) => outcome.take_logs(&chunk),
            None => {}
        }
    }
    match &outcome.failure {
        Some((error, reset)) => {
            let logs = failure_logs(workspace, outcome);
            let reset = if *reset {
                " The node reboots and starts over, with what this init set up on its state disk reset."
            } else {
                ""
            };
            bail!(
                "init failed on the node: {}.{reset} Node logs {}",
                printable(error),
                logs
            )
        }
        // A stream that ends cleanly without a result (a proxy or the
        // host cut it short) may come from a node that finished: its
        // cluster is reachable as after a lost connection.
        None => bail!(
            "the node ended the init stream without a result{}",
            record_unconfirmed_id(workspace, settings, cluster_id)
        ),
    }
}

/// Writes the node's logs kept in `outcome` ([`write_failure_logs`]) and
/// says where they are ("in PATH"), or why not: a workspace that
/// cannot take them never hides the failure they belong to.
fn failure_logs(workspace: &Path, outcome: &Outcome) -> String {
    match write_failure_logs(workspace, outcome) {
        Ok(path) => format!("in {}", path.display()),
        Err(e) => format!(
            "could not be saved to {} ({e:#})",
            workspace.join(FAILURE_LOG_FILE).display()
        ),
    }
}

/// Writes the node's logs kept in `outcome`, with a last line saying how
/// much was dropped, if anything was.
fn write_failure_logs(workspace: &Path, outcome: &Outcome) -> anyhow::Result<PathBuf> {
    let path = workspace.join(FAILURE_LOG_FILE);
    let mut logs = outcome.logs.clone();
    if outcome.dropped > 0 {
        logs.extend_from_slice(
            format!(
                "\n[keel: the node sent {} more bytes of logs than the {} kept; they were dropped]\n",
                outcome.dropped, MAX_FAILURE_LOG_BYTES
            )
            .as_bytes(),
        );
    }
    write_atomic(&path, &logs, 0o600)?;
    Ok(path)
}

/// The node's replayed identity must name the control-plane role: the
/// master secret goes to control planes only, and a worker's image and
/// cluster lock are the same as theirs.
pub fn check_control_plane(node: &Verified) -> anyhow::Result<()> {
    keel_verifier::validator::check_control_plane(node)
        .map_err(|why| anyhow::anyhow!("the node is not a control plane: {why}"))
}

/// Fewest bytes an init secret may have. Its hash is public (in the node
/// config every node measures and shows in its event log), so guessing it
/// is an offline search that no per-address backoff slows: 16 random bytes
/// put that out of reach.
pub const MIN_INIT_SECRET_BYTES: usize = 16;

/// The signature of the measurements file, when the node's measured config
/// names a measurements signing key: it must be the settings' key, and the
/// file must carry its signature (`FILE.sig`), so that nodes of a later
/// image accept this image's join services. Empty when neither names a
/// key; an error, before anything is sent, when they disagree.
fn image_signature(
    settings: &Settings,
    node: &Verified,
    settings_key: Option<&SigningPublicKey>,
    body: &[u8],
) -> anyhow::Result<Vec<u8>> {
    let config = node
        .cluster_config()
        .context("the node's event log holds no node config that parses; nothing was sent")?;
    let node_key = config
        .signing_key()
        .context("the node's config names an invalid measurements signing key")?;
    let fingerprint = |k: &SigningPublicKey| {
        k.fingerprint()
            .map(|f| format!("sha256:{}", hex::encode(f)))
            .unwrap_or_else(|_| "(unprintable)".into())
    };
    match (node_key, settings_key) {
        (None, None) => Ok(Vec::new()),
        (None, Some(_)) => bail!(
            "the settings name a measurements_signing_key, but the node's config does not \
             (cluster.measurements_signing_key): the cluster would refuse every image upgrade; \
             add the key to the node config or remove it from the settings. Nothing was sent"
        ),
        (Some(node_key), settings_key) if settings_key != Some(&node_key) => bail!(
            "the node's config names measurements signing key {}, the settings {}; \
             nothing was sent",
            fingerprint(&node_key),
            settings_key.map_or_else(|| "none".into(), fingerprint)
        ),
        (Some(key), _) => {
            let file = settings.resolve(&settings.measurements);
            let path = keel_verifier::signature::detached_signature_path(&file);
            let signature = read_bounded(&path).with_context(|| {
                format!(
                    "the node's config names a measurements signing key, so {} needs its \
                     signature (keel-measure --signing-key writes {}); nothing was sent",
                    file.display(),
                    path.display()
                )
            })?;
            SignedMeasurements::verify(&key, body, &signature).with_context(|| {
                format!(
                    "{} is not signed with the measurements signing key ({}); nothing was sent",
                    file.display(),
                    path.display()
                )
            })?;
            Ok(signature)
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::os::unix::fs::MetadataExt as _;

    use super::*;

    /// A transport failure that tonic turns into a status of `inner`'s
    /// code, with itself as the source (as a reset or a keep-alive timeout
    /// of the connection reaches the caller).
    #[derive(Debug)]
    struct Transport(tonic::Status);

    impl std::fmt::Display for Transport {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection lost")
        }
    }

    impl std::error::Error for Transport {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// Attacker's move, or a flaky network: a connection that fails after
    /// the request went out reads as `Unavailable`, like the node's busy
    /// answer; sent again, the init would be refused while the first goes
    /// on. Only the node's busy answer, which it marks, is retried; a
    /// failing TPM or disk is not; a channel that had no connection sent
    /// nothing.
    #[test]
    fn only_the_nodes_marked_busy_answer_is_sent_again() {
        let busy = keel_proto::busy("other init requests are in progress");
        assert!(keel_proto::told_busy(&busy));
        assert!(!never_sent(&busy));
        let failing = tonic::Status::unavailable("the TPM is unavailable");
        assert!(!keel_proto::told_busy(&failing));
        let lost = tonic::Status::from_error(Box::new(Transport(tonic::Status::unavailable(
            "connection reset",
        ))));
        assert_eq!(lost.code(), tonic::Code::Unavailable);
        assert!(!keel_proto::told_busy(&lost));
        assert!(!never_sent(&lost));
        let gone = tonic::Status::from_error(Box::new(tonic::ConnectError(Box::new(
            std::io::Error::other("connection gone"),
        ))));
        assert_eq!(gone.code(), tonic::Code::Unavailable);
        assert!(!keel_proto::told_busy(&gone));
        assert!(never_sent(&gone));
        assert_eq!(transport_failure(&gone), "connection gone");
    }

    /// A workspace that cannot take the node's logs (here a directory in
    /// their place) costs the logs, not the failure they belong to.
    #[test]
    fn logs_that_cannot_be_written_are_named_not_raised() {
        let ws = tempfile::tempdir().unwrap();
        let mut outcome = Outcome::default();
        outcome.take_logs(b"kubeadm init failed\n");
        assert_eq!(
            failure_logs(ws.path(), &outcome),
            format!("in {}", ws.path().join(FAILURE_LOG_FILE).display())
        );
        let blocked = tempfile::tempdir().unwrap();
        std::fs::create_dir(blocked.path().join(FAILURE_LOG_FILE)).unwrap();
        let said = failure_logs(blocked.path(), &outcome);
        assert!(said.starts_with("could not be saved to "), "{said}");
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    /// A secret file is written whole or not at all, never over another:
    /// a temporary file left by a run that crashed does not block the
    /// next, and a file already in place is kept as it is.
    #[test]
    fn a_secret_file_is_placed_whole_and_never_replaces_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel-master-secret.json");
        // What a run that crashed before placing its file left: removed;
        // a file of another name, or the user's own, stays.
        for leftover in [
            ".keel-master-secret.json.0123456789abcdef.new",
            ".keel-master-secret.json.mine.new",
            ".keel-master-secret.json.json.0123456789abcdef.new",
        ] {
            std::fs::write(dir.path().join(leftover), b"{\"ke").unwrap();
        }
        write_new_secret_file(&path, b"first", "kept").unwrap();
        assert_eq!(
            names(dir.path()),
            [
                ".keel-master-secret.json.json.0123456789abcdef.new",
                ".keel-master-secret.json.mine.new",
                "keel-master-secret.json"
            ]
        );
        for leftover in [
            ".keel-master-secret.json.json.0123456789abcdef.new",
            ".keel-master-secret.json.mine.new",
        ] {
            std::fs::remove_file(dir.path().join(leftover)).unwrap();
        }
        // A second link a run left after placing its file goes too, though
        // the file is there.
        std::fs::hard_link(
            &path,
            dir.path()
                .join(".keel-master-secret.json.fedcba9876543210.new"),
        )
        .unwrap();
        assert!(write_new_secret_file(&path, b"again", "kept").is_err());
        assert_eq!(names(dir.path()), ["keel-master-secret.json"]);
        // The fallback where hard links are not supported: the same
        // refusal of a file in place.
        let err = write_in_place(&path, b"second", "kept").unwrap_err();
        assert!(format!("{err:#}").contains("(kept)"), "{err:#}");
        let elsewhere = dir.path().join("no-such-dir/secret");
        let err = write_in_place(&elsewhere, b"second", "kept").unwrap_err();
        assert!(!format!("{err:#}").contains("(kept)"), "{err:#}");
        let other = dir.path().join("other-secret");
        write_in_place(&other, b"other", "kept").unwrap();
        assert_eq!(std::fs::metadata(&other).unwrap().mode() & 0o777, 0o600);
        std::fs::remove_file(&other).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let err = write_new_secret_file(&path, b"second", "kept").unwrap_err();
        assert!(format!("{err:#}").contains("(kept)"), "{err:#}");
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        // A dangling symbolic link in its place is not followed.
        let link = dir.path().join("keel-init-secret");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &link).unwrap();
        assert!(write_new_secret_file(&link, b"third", "kept").is_err());
        assert!(!dir.path().join("elsewhere").exists());
        assert_eq!(
            names(dir.path()),
            ["keel-init-secret", "keel-master-secret.json"]
        );
    }

    #[test]
    fn a_reservation_holds_its_room_and_commits_exactly_the_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel-admin.conf");
        let reserved = Reserved::new(&path, 0o600, KUBECONFIG_ROOM).unwrap();
        let temp = std::fs::metadata(&reserved.temp).unwrap();
        assert!(
            temp.blocks() * 512 >= KUBECONFIG_ROOM,
            "{} bytes allocated",
            temp.blocks() * 512
        );
        assert!(!path.exists());

        reserved.commit(b"apiVersion: v1\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"apiVersion: v1\n");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert_eq!(names(dir.path()), ["keel-admin.conf"]);
    }

    /// The content is written but cannot be renamed into place (here a
    /// directory took the name): it is kept, and the error says where.
    #[test]
    fn content_that_cannot_be_renamed_into_place_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel-admin.conf");
        let reserved = Reserved::new(&path, 0o600, KUBECONFIG_ROOM).unwrap();
        let temp = reserved.temp.clone();
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("x"), b"").unwrap();
        let err = format!("{:#}", reserved.commit(b"apiVersion: v1\n").unwrap_err());
        assert!(err.contains(&temp.display().to_string()), "{err}");
        assert_eq!(std::fs::read(&temp).unwrap(), b"apiVersion: v1\n");
    }

    #[test]
    fn a_reservation_dropped_without_its_content_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel-id.json");
        std::fs::write(&path, b"old").unwrap();
        drop(Reserved::new(&path, 0o644, ID_ROOM).unwrap());
        assert_eq!(names(dir.path()), ["keel-id.json"]);
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
    }

    /// A filesystem of 1 MiB mounted for the test, unmounted when dropped.
    struct SmallDisk(tempfile::TempDir);

    impl SmallDisk {
        /// `None` where this process may not mount (not root): said, and
        /// the test returns.
        fn mount() -> Option<Self> {
            let dir = tempfile::tempdir().unwrap();
            match nix::mount::mount(
                Some("tmpfs"),
                dir.path(),
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some("size=1m,mode=0700"),
            ) {
                Ok(()) => Some(Self(dir)),
                // Skipped only where it cannot run: as root (as CI runs)
                // a failed mount fails the test.
                Err(e) if !nix::unistd::geteuid().is_root() => {
                    eprintln!("skipped: mounting a tmpfs needs root ({e})");
                    None
                }
                Err(e) => panic!("mounting a tmpfs as root failed: {e}"),
            }
        }

        /// Fills the filesystem with one file until no byte fits.
        fn fill(&self) {
            let mut f = std::fs::File::create(self.0.path().join("filler")).unwrap();
            let chunk = [0u8; 4096];
            loop {
                if let Err(e) = f.write_all(&chunk) {
                    assert_eq!(e.raw_os_error(), Some(nix::libc::ENOSPC), "{e}");
                    break;
                }
            }
            // What partial block is left, too.
            while f.write_all(&[0]).is_ok() {}
        }
    }

    impl Drop for SmallDisk {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
        }
    }

    /// The disk fills up while the node initialises: the kubeconfig, which
    /// the node never sends again, still fits in the room reserved for it;
    /// without the reservation the same write fails.
    #[test]
    fn a_disk_that_fills_during_init_still_takes_the_kubeconfig() {
        let Some(disk) = SmallDisk::mount() else {
            return;
        };
        let path = disk.0.path().join("keel-admin.conf");
        let kubeconfig = vec![b'k'; 16 * 1024];
        let reserved = Reserved::new(&path, 0o600, KUBECONFIG_ROOM).unwrap();
        let unreserved = Reserved::new(&disk.0.path().join("other.conf"), 0o600, 0).unwrap();
        disk.fill();

        let refused = unreserved.commit(&kubeconfig).unwrap_err();
        assert!(
            format!("{refused:#}").contains("No space left"),
            "{refused:#}"
        );
        reserved.commit(&kubeconfig).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), kubeconfig);
    }
}
