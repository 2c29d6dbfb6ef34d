//! keel-measure: predicts the PCR values a keel image produces when booted
//! and writes them as a measurements file.
//!
//! ```text
//! keel-measure --uki build/image/keel.efi --node-config FILE [--output FILE] [--events]
//!              [--signing-key KEY.pem] [--epoch N]
//! keel-measure keygen --out DIR
//! keel-measure sign --signing-key KEY.pem --kubernetes-version VERSION FILE
//! ```

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};
use keel_image::pcr::{replay, Event};
use keel_image::predict::{self, Uki};
use keel_verifier::config::NodeConfig;
use keel_verifier::signature::SigningPrivateKey;

/// Predicts PCRs 4, 9, 11 and 12 from a built image and a node config, and
/// PCR 2 as firmware that runs no driver from outside its volume leaves it.
///
/// With `--signing-key`, also writes a detached signature of the file to
/// `<output>.sig`: ECDSA P-256 with SHA-256 over the exact file bytes, DER,
/// as `openssl dgst -sha256 -sign KEY -out FILE.sig FILE` writes it, and
/// checked by `openssl dgst -sha256 -verify PUB.pem -signature FILE.sig FILE`.
/// A running cluster admits a new image only with measurements signed by
/// the key it was initialised with (settings: `measurements_signing_key`).
/// `keel-measure keygen --out DIR` makes a key pair; openssl makes one too:
/// `openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out key.pem`
/// and `openssl pkey -in key.pem -pubout -out pub.pem`.
#[derive(Debug, Parser)]
#[command(name = "keel-measure", version, subcommand_negates_reqs = true)]
struct Args {
    /// Other commands.
    #[command(subcommand)]
    command: Option<Command>,
    /// The image's unified kernel image (build/image/keel.efi).
    #[arg(long, required = true)]
    uki: Option<PathBuf>,
    /// A node config document, as given to the VM (fw_cfg
    /// `opt/keel/node-config`) or installed in the image. It is read and
    /// validated as the agent does, and PCR 12 predicted from its canonical
    /// form. Required: verifiers refuse a measurements file that does not
    /// enforce PCR 12.
    #[arg(long, required = true)]
    node_config: Option<PathBuf>,
    /// Where to write the measurements JSON (default: standard output).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Also print every modelled event to standard error.
    #[arg(long)]
    events: bool,
    /// Sign the written file with this key (PEM PKCS#8, ECDSA P-256) and
    /// write the signature to `<output>.sig`. Needs --output.
    #[arg(long, value_name = "KEY", requires = "output")]
    signing_key: Option<PathBuf>,
    /// The image's rollback epoch, written into the file (`"epoch": N`). A
    /// control plane that made an image of epoch N current (at init, or
    /// by finishing its rollout) stages and sets no signed file of a lower
    /// epoch, so a known-bad older image cannot be brought back with the
    /// operator's credentials alone. Raise it with an image that must
    /// replace every one before it (a security fix); keep it for one
    /// that may be rolled back from. Default 0: no epoch in the file.
    #[arg(long, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=keel_verifier::measurements::MAX_EPOCH))]
    epoch: u64,
    /// The platform's firmware loads UEFI drivers from outside its own
    /// volume by design (option ROMs, `Driver####` entries): leave PCR 2 out
    /// of the file. By default PCR 2 is enforced at its value when no such
    /// driver runs (OVMF without option ROMs, as the local cluster boots),
    /// so that a node whose host made its firmware run one (a driver stays
    /// resident while the UKI boots, and is measured into PCR 2, not 4) is
    /// refused.
    #[arg(long)]
    firmware_drivers_allowed: bool,
}

/// Commands other than predicting.
#[derive(Debug, Subcommand)]
enum Command {
    /// Make a measurements signing key pair: `DIR/measurements-signing-key.pem`
    /// (private, mode 0600; keep it off the cluster's machines) and
    /// `DIR/measurements-signing-key.pub.pem` (the settings'
    /// `measurements_signing_key`). Existing files are never overwritten.
    Keygen {
        /// Directory for the two files.
        #[arg(long)]
        out: PathBuf,
    },
    /// Sign FILE, a components file for `keel init` or `keel upgrade
    /// apply --components` where the cluster has a measurements signing
    /// key, as the file for one Kubernetes version, writing the detached
    /// signature to `FILE.sig`. The signature covers a fixed prefix, the
    /// pinned version and the file's bytes, so it is valid for that
    /// version only. An existing FILE.sig is replaced.
    Sign {
        /// The private key (PEM PKCS#8, ECDSA P-256).
        #[arg(long, value_name = "KEY")]
        signing_key: PathBuf,
        /// The Kubernetes version the file is for (`vX.Y` or its pinned
        /// `vX.Y.Z`).
        #[arg(long, value_name = "VERSION")]
        kubernetes_version: String,
        /// The components file to sign.
        file: PathBuf,
    },
}

/// Largest key file read.
const MAX_KEY_FILE: u64 = 16 * 1024;

fn main() -> Result<()> {
    let args = Args::parse();
    match &args.command {
        Some(Command::Keygen { out }) => return keygen(out),
        Some(Command::Sign {
            signing_key,
            kubernetes_version,
            file,
        }) => return sign(signing_key, kubernetes_version, file),
        None => {}
    }
    let (Some(uki_path), Some(path)) = (&args.uki, &args.node_config) else {
        bail!("--uki and --node-config are required");
    };
    // Read the key first: a bad key fails before any work.
    let signing_key = match &args.signing_key {
        Some(key) => Some(read_signing_key(key)?),
        None => None,
    };
    let bytes = std::fs::read(uki_path).with_context(|| format!("read {}", uki_path.display()))?;
    let uki = Uki::parse(&bytes).with_context(|| format!("{}", uki_path.display()))?;
    // The agent's own loader: same size bound, validation and canonical form.
    let (config, _) =
        NodeConfig::load(Some(path)).with_context(|| format!("node config {}", path.display()))?;

    if args.events {
        let pcrs: [(u32, Vec<Event>); 4] = [
            (predict::PCR_DRIVER_CODE, predict::pcr2()),
            (predict::PCR_BOOT_LOADER_CODE, predict::pcr4(&uki)?),
            (predict::PCR_KERNEL_PARAMETERS, predict::pcr9(&uki)?),
            (predict::PCR_KERNEL_BOOT, predict::pcr11(&uki)?),
        ];
        for (pcr, events) in &pcrs {
            eprintln!("pcr {pcr} = {}", hex::encode(replay(events)));
            for event in events {
                eprintln!("  {event}");
            }
        }
        eprintln!(
            "pcr {} = {}",
            predict::PCR_NODE_CONFIG,
            hex::encode(predict::pcr12(&config))
        );
        eprintln!("  keel-agent node-config event for {}", path.display());
    }
    let drivers = if args.firmware_drivers_allowed {
        predict::FirmwareDrivers::Allowed
    } else {
        predict::FirmwareDrivers::None
    };
    let measurements = predict::measurements(&uki, &config, drivers)?;

    let json = measurements.to_json_with_epoch(args.epoch) + "\n";
    match &args.output {
        Some(path) => write_output(path, json.as_bytes(), signing_key.as_ref())?,
        None => print!("{json}"),
    }
    Ok(())
}

/// Writes `json` to `path` and, with `key`, its signature to `<path>.sig`,
/// each through a temporary file renamed into place. Any existing
/// `<path>.sig` is removed first: it signs other bytes, and the CLI sends
/// whatever signature lies beside the file.
fn write_output(path: &Path, json: &[u8], key: Option<&SigningPrivateKey>) -> Result<()> {
    let signature = keel_verifier::signature::detached_signature_path(path);
    let stale = match std::fs::remove_file(&signature) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(e).with_context(|| format!("remove {}", signature.display())),
    };
    write_replacing(path, json)?;
    match key {
        Some(key) => {
            write_replacing(&signature, &key.sign(json))?;
            eprintln!("signature: {}", signature.display());
        }
        None if stale => eprintln!(
            "removed {}: it signed an earlier file (no --signing-key given)",
            signature.display()
        ),
        None => {}
    }
    Ok(())
}

/// Replaces `path` with `data` atomically and durably, mode 0644 (a
/// symlink at `path` is replaced, not followed).
fn write_replacing(path: &Path, data: &[u8]) -> Result<()> {
    keel_installer::durable::replace(path, data, 0o644)
        .with_context(|| format!("write {}", path.display()))
}

/// Creates `path` (never over an existing file) with `mode`, writes `data`
/// and syncs it.
fn write_new(path: &Path, mode: u32, data: &[u8]) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .and_then(|mut f| f.write_all(data).and_then(|()| f.sync_all()))
}

/// `keel-measure sign`: a detached signature by the key at `key` of the
/// components file `file` as the file for `version`, in `file` + `.sig`.
fn sign(key: &Path, version: &str, file: &Path) -> Result<()> {
    let key = read_signing_key(key)?;
    let version = keel_installer::resolve(version)?.version();
    let bytes = std::fs::read(file).with_context(|| format!("read {}", file.display()))?;
    keel_installer::components_file::parse(&bytes)
        .with_context(|| format!("{} is not a components file", file.display()))?;
    let signature = keel_verifier::signature::detached_signature_path(file);
    let message = keel_installer::components_file::signed_message(version, &bytes);
    std::fs::write(&signature, key.sign(&message))
        .with_context(|| format!("write {}", signature.display()))?;
    eprintln!(
        "signature of {} for Kubernetes {version}: {}",
        file.display(),
        signature.display()
    );
    Ok(())
}

fn read_signing_key(path: &Path) -> Result<SigningPrivateKey> {
    use std::io::Read as _;
    // Sized for the largest accepted file up front: a buffer that grew
    // would leave copies of the key in the memory it freed.
    let mut pem = zeroize::Zeroizing::new(Vec::with_capacity(MAX_KEY_FILE as usize + 1));
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_KEY_FILE).read_to_end(&mut pem))
        .with_context(|| format!("read {}", path.display()))?;
    SigningPrivateKey::from_pem(&pem).with_context(|| format!("signing key {}", path.display()))
}

fn keygen(out: &Path) -> Result<()> {
    let key = SigningPrivateKey::generate();
    let private = out.join("measurements-signing-key.pem");
    let public = out.join("measurements-signing-key.pub.pem");
    for path in [&private, &public] {
        if path.exists() {
            bail!("{} exists; not overwritten", path.display());
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    let create = |path: &Path, mode: u32, data: &[u8]| {
        write_new(path, mode, data).with_context(|| format!("write {}", path.display()))
    };
    create(&private, 0o600, key.to_pem()?.as_bytes())?;
    create(&public, 0o644, key.public_key().to_pem()?.as_bytes())?;
    println!("private key: {}", private.display());
    println!("public key:  {}", public.display());
    Ok(())
}
