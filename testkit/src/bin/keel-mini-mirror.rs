//! `keel-mini-mirror`: the component mirror of the local cluster
//! (`scripts/mini-up.sh`).
//!
//! ```text
//! keel-mini-mirror --standin FILE --guest-host 10.0.2.2 --components OUT.json [--version v1.31.13]
//!                  [--upgrade-version v1.32.9 --upgrade-components OUT2.json]
//! ```
//!
//! Serves the stand-in component set on an ephemeral 127.0.0.1 port, with
//! `FILE` (a static `keel-standin`) as kubeadm, kubelet and kubectl, and
//! install paths on the node itself (`/opt/cni/bin`, `/run/state/bin/...`).
//! Writes the list (`[{url, hash, install_path, extract}]`, the format of
//! `keel init`'s `components_file`) to `OUT.json` with each URL's host
//! replaced by `--guest-host` (QEMU user networking maps guest connections
//! to 10.0.2.2 onto the host's loopback), prints `mirror: <base URL>` and
//! serves until it is killed. With `--upgrade-version` it also serves the
//! set of that version (stand-ins claiming it, with their own hashes) and
//! writes its list to `--upgrade-components`, for `keel upgrade apply`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use keel_testkit::components::{stand_in_set_with, KubeExecutables};
use keel_testkit::mirror::MirrorServer;

/// Largest stand-in program accepted.
const MAX_STANDIN_BYTES: u64 = 256 * 1024 * 1024;

struct Args {
    standin: PathBuf,
    guest_host: String,
    components: PathBuf,
    version: String,
    upgrade: Option<(String, PathBuf)>,
}

fn parse_args() -> Result<Args, String> {
    let mut standin = None;
    let mut guest_host = None;
    let mut components = None;
    let mut version = "v1.31.13".to_owned();
    let mut upgrade_version = None;
    let mut upgrade_components = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--standin" => standin = Some(PathBuf::from(value)),
            "--guest-host" => guest_host = Some(value),
            "--components" => components = Some(PathBuf::from(value)),
            "--version" => version = value,
            "--upgrade-version" => upgrade_version = Some(value),
            "--upgrade-components" => upgrade_components = Some(PathBuf::from(value)),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Args {
        standin: standin.ok_or("--standin is required")?,
        guest_host: guest_host.ok_or("--guest-host is required")?,
        components: components.ok_or("--components is required")?,
        version,
        upgrade: match (upgrade_version, upgrade_components) {
            (Some(v), Some(f)) => Some((v, f)),
            (None, None) => None,
            _ => return Err("--upgrade-version and --upgrade-components go together".into()),
        },
    })
}

fn run(args: &Args) -> Result<MirrorServer, String> {
    let len = std::fs::metadata(&args.standin)
        .map_err(|e| format!("reading {}: {e}", args.standin.display()))?
        .len();
    if len > MAX_STANDIN_BYTES {
        return Err(format!("{} is too large", args.standin.display()));
    }
    let program = std::fs::read(&args.standin)
        .map_err(|e| format!("reading {}: {e}", args.standin.display()))?;
    let mirror = MirrorServer::start().map_err(|e| format!("starting the mirror: {e}"))?;
    let program = KubeExecutables::Program(program);
    write_set(&mirror, args, &args.version, &args.components, &program)?;
    if let Some((version, file)) = &args.upgrade {
        write_set(&mirror, args, version, file, &program)?;
    }
    Ok(mirror)
}

/// Serves the stand-in set of `version` on `mirror` and writes its list,
/// as the guest reaches it, to `file`.
fn write_set(
    mirror: &MirrorServer,
    args: &Args,
    version: &str,
    file: &Path,
    program: &KubeExecutables,
) -> Result<(), String> {
    let set = stand_in_set_with(mirror, Path::new("/"), version, program)
        .map_err(|e| format!("building the stand-ins: {e}"))?;
    let local = mirror.base_url();
    let guest = format!("http://{}:{}", args.guest_host, mirror.addr().port());
    let list: Vec<serde_json::Value> = set
        .iter()
        .map(|c| {
            serde_json::json!({
                "url": c.url.replacen(&local, &guest, 1),
                "hash": c.hash,
                "install_path": c.install_path,
                "extract": c.extract,
            })
        })
        .collect();
    let json = serde_json::to_vec_pretty(&list).map_err(|e| e.to_string())?;
    std::fs::write(file, json).map_err(|e| format!("writing {}: {e}", file.display()))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("keel-mini-mirror: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(mirror) => {
            println!("mirror: {}", mirror.base_url());
            loop {
                std::thread::park();
            }
        }
        Err(e) => {
            eprintln!("keel-mini-mirror: {e}");
            ExitCode::FAILURE
        }
    }
}
