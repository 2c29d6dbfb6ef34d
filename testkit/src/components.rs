//! Stand-in Kubernetes components, built in-process and served by a
//! [`MirrorServer`], with the component lists that point at them.
//!
//! This environment cannot download Kubernetes, so tests (and the local
//! cluster) install stand-ins instead: for `kubeadm`, `kubelet` and `kubectl`
//! either small `#!/bin/sh` scripts that print their name and version, or
//! the `keel-standin` program ([`standin_binary`], see
//! `src/bin/keel-standin.rs`), which checks kubeadm configurations and writes
//! what kubeadm writes; and `.tgz` archives shaped like the upstream CNI
//! plugins and crictl releases. Their hashes are their own, not upstream's.
//!
//! Two lists are offered:
//! * [`stand_in_set`]: components whose URLs are on the mirror and whose
//!   install paths are under a caller-given root;
//! * [`stand_ins_for`]: a variant of a real versions-table entry. URLs and
//!   install paths stay the upstream ones (a mirror rewrite then fetches them
//!   from this server, which serves the stand-ins at the upstream paths); the
//!   hashes are replaced by the stand-ins' hashes, because the upstream bytes
//!   cannot be fetched here. `data:` components are kept as they are.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use flate2::write::GzEncoder;
use keel_proto::components::Component;
use sha2::{Digest as _, Sha256};

use crate::mirror::MirrorServer;

/// Names of the executables in the CNI plugins stand-in archive.
pub const CNI_PLUGINS: [&str; 4] = ["bridge", "host-local", "loopback", "portmap"];

/// Why a stand-in could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StandInError {
    /// Building an archive failed.
    #[error("building the stand-in archive {0}")]
    Archive(&'static str, #[source] std::io::Error),
    /// A component URL names nothing a stand-in exists for.
    #[error("no stand-in for component {0:?}")]
    Unknown(String),
    /// A component URL does not parse.
    #[error("component URL {0:?} has no path")]
    Url(String),
    /// Building or reading the `keel-standin` program failed.
    #[error("building the keel-standin program: {0}")]
    Build(String),
}

/// What is installed as `kubeadm`, `kubelet` and `kubectl`.
#[derive(Debug, Clone)]
pub enum KubeExecutables {
    /// Shell scripts printing their name and version ([`executable`]).
    Scripts,
    /// The given program (the `keel-standin` bytes), the same for all three;
    /// it picks its role from the name it is installed under.
    Program(Vec<u8>),
}

impl KubeExecutables {
    /// The `keel-standin` program, built if needed ([`standin_binary`]).
    pub fn standin() -> Result<Self, StandInError> {
        let path = standin_binary()?;
        std::fs::read(&path)
            .map(Self::Program)
            .map_err(|e| StandInError::Build(format!("reading {}: {e}", path.display())))
    }

    fn bytes(&self, name: &str, version: &str) -> Vec<u8> {
        match self {
            Self::Scripts => executable(name, version),
            Self::Program(bytes) => versioned(bytes, version),
        }
    }
}

/// The path of the `keel-standin` program, for the same target and profile
/// as the calling test binary (which lives in `<target>/<profile>/deps/`).
/// Unless the program there is newer than its source file and the testkit
/// manifest, it is built first, once per process, with the cargo that runs
/// the tests.
pub fn standin_binary() -> Result<PathBuf, StandInError> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(build_standin)
        .clone()
        .map_err(StandInError::Build)
}

fn build_standin() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("locating the test binary: {e}"))?;
    let profile_dir = exe
        .parent()
        .filter(|d| d.ends_with("deps"))
        .and_then(Path::parent)
        .ok_or_else(|| format!("{} is not in a cargo target directory", exe.display()))?;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let path = profile_dir.join("keel-standin");
    // Newer than its source and manifest: use it without waiting for the
    // target directory's lock (other builds may hold it for minutes).
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bin/keel-standin.rs");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if let (Some(built), Some(src), Some(man)) =
        (modified(&path), modified(&source), modified(&manifest))
    {
        if built > src && built > man {
            return Ok(path);
        }
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args([
            "build",
            "--quiet",
            "--bin",
            "keel-standin",
            "--manifest-path",
        ])
        .arg(&manifest);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build
        .status()
        .map_err(|e| format!("running cargo build: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build --bin keel-standin: {status}"));
    }
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("{} was not built", path.display()))
    }
}

/// Marks the version a `keel-standin` copy claims to be: appended after
/// the executable (the loader ignores it), read back by the program.
pub const VERSION_TRAILER: &str = "\nkeel-standin-version:";

/// `program` claiming to be `version`: each Kubernetes version gets its own
/// bytes (and hash), as upstream's binaries do.
pub fn versioned(program: &[u8], version: &str) -> Vec<u8> {
    let mut bytes = program.to_vec();
    bytes.extend_from_slice(VERSION_TRAILER.as_bytes());
    bytes.extend_from_slice(version.as_bytes());
    bytes.push(b'\n');
    bytes
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// A stand-in executable: a shell script printing `<name> <version> (stand-in)`.
pub fn executable(name: &str, version: &str) -> Vec<u8> {
    format!("#!/bin/sh\necho '{name} {version} (keel stand-in)'\n").into_bytes()
}

/// A gzip-compressed tar archive of regular files `(path, content, mode)`,
/// preceded by a `./` directory entry as upstream release archives have.
pub fn tgz(files: &[(&str, &[u8], u32)]) -> std::io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    let mut root = tar::Header::new_gnu();
    root.set_entry_type(tar::EntryType::Directory);
    root.set_path("./")?;
    root.set_mode(0o755);
    root.set_size(0);
    root.set_cksum();
    builder.append(&root, std::io::empty())?;
    for (path, content, mode) in files {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_path(path)?;
        header.set_mode(*mode);
        header.set_size(content.len() as u64);
        header.set_cksum();
        builder.append(&header, *content)?;
    }
    let mut gz = builder.into_inner()?;
    gz.flush()?;
    gz.finish()
}

/// The CNI plugins stand-in archive: `bridge`, `host-local`, … (0755).
pub fn cni_plugins_tgz() -> Result<Vec<u8>, StandInError> {
    let scripts: Vec<(String, Vec<u8>)> = CNI_PLUGINS
        .iter()
        .map(|name| (format!("./{name}"), executable(name, "v1.8.0")))
        .collect();
    let files: Vec<(&str, &[u8], u32)> = scripts
        .iter()
        .map(|(path, content)| (path.as_str(), content.as_slice(), 0o755))
        .collect();
    tgz(&files).map_err(|e| StandInError::Archive("cni-plugins", e))
}

/// The crictl stand-in archive: one executable `crictl`.
pub fn crictl_tgz() -> Result<Vec<u8>, StandInError> {
    let script = executable("crictl", "v1.33.0");
    tgz(&[("crictl", &script, 0o755)]).map_err(|e| StandInError::Archive("crictl", e))
}

/// Serves a stand-in for each kind of component on `mirror` and returns the
/// list: CNI plugins into `<root>/opt/cni/bin`, crictl into
/// `<root>/run/state/bin`, kubelet, kubeadm and kubectl (shell scripts) as
/// `<root>/run/state/bin/<name>`, in the order the versions table uses.
pub fn stand_in_set(
    mirror: &MirrorServer,
    root: &Path,
    version: &str,
) -> Result<Vec<Component>, StandInError> {
    stand_in_set_with(mirror, root, version, &KubeExecutables::Scripts)
}

/// [`stand_in_set`] with `kube` installed as kubelet, kubeadm and kubectl.
pub fn stand_in_set_with(
    mirror: &MirrorServer,
    root: &Path,
    version: &str,
    kube: &KubeExecutables,
) -> Result<Vec<Component>, StandInError> {
    let under = |p: &str| root.join(p).to_string_lossy().into_owned();
    let mut components = Vec::new();
    let mut add = |path: String, bytes: Vec<u8>, install_path: String, extract: bool| {
        let hash = sha256(&bytes);
        mirror.serve(&path, bytes);
        components.push(Component {
            url: mirror.url(&path),
            hash,
            install_path,
            extract,
        });
    };
    add(
        "/cni-plugins-linux-amd64.tgz".to_owned(),
        cni_plugins_tgz()?,
        under("opt/cni/bin"),
        true,
    );
    add(
        "/crictl-linux-amd64.tar.gz".to_owned(),
        crictl_tgz()?,
        under("run/state/bin"),
        true,
    );
    for name in ["kubelet", "kubeadm", "kubectl"] {
        add(
            format!("/{version}/bin/linux/amd64/{name}"),
            kube.bytes(name, version),
            under(&format!("run/state/bin/{name}")),
            false,
        );
    }
    Ok(components)
}

/// For a real table entry (`upstream`, of Kubernetes `version`): serves a
/// stand-in at each network component's upstream URL path on `mirror`, and
/// returns the same list with each hash replaced by its stand-in's hash.
/// `data:` components are returned unchanged. See the module docs for why.
pub fn stand_ins_for(
    mirror: &MirrorServer,
    upstream: &[Component],
    version: &str,
) -> Result<Vec<Component>, StandInError> {
    upstream
        .iter()
        .map(|c| {
            if c.url.starts_with("data:") {
                return Ok(c.clone());
            }
            let path = url_path(&c.url).ok_or_else(|| StandInError::Url(c.url.clone()))?;
            let file = path.rsplit('/').next().unwrap_or_default();
            let bytes = match file {
                "kubelet" | "kubeadm" | "kubectl" => executable(file, version),
                f if f.starts_with("cni-plugins-") && f.ends_with(".tgz") => cni_plugins_tgz()?,
                f if f.starts_with("crictl-") && f.ends_with(".tar.gz") => crictl_tgz()?,
                _ => return Err(StandInError::Unknown(c.url.clone())),
            };
            let hash = sha256(&bytes);
            mirror.serve(path, bytes);
            Ok(Component { hash, ..c.clone() })
        })
        .collect()
}

/// The path of an `http(s)://host/path` URL (query removed).
fn url_path(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let path = &rest[rest.find('/')?..];
    Some(path.split('?').next().unwrap_or(path))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::io::Read as _;

    use super::*;

    fn listing(archive: &[u8]) -> Vec<(String, u32)> {
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(archive));
        tar.entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let name = e.path().unwrap().to_string_lossy().into_owned();
                let mode = e.header().mode().unwrap();
                let mut content = String::new();
                e.read_to_string(&mut content).unwrap();
                (name, mode)
            })
            .collect()
    }

    #[test]
    fn archives_look_like_upstream_releases() {
        let cni = listing(&cni_plugins_tgz().unwrap());
        let names: Vec<&str> = cni.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["./", "bridge", "host-local", "loopback", "portmap"]);
        assert!(cni.iter().all(|(_, mode)| *mode == 0o755));
        assert_eq!(
            listing(&crictl_tgz().unwrap()),
            [("./".to_owned(), 0o755), ("crictl".to_owned(), 0o755)]
        );
    }

    #[test]
    fn table_variants_keep_urls_and_paths_and_swap_hashes() {
        let mirror = MirrorServer::start().unwrap();
        let kubelet = Component {
            url: "https://dl.k8s.io/v1.31.13/bin/linux/amd64/kubelet".into(),
            hash: "sha256:upstream".into(),
            install_path: "/run/state/bin/kubelet".into(),
            extract: false,
        };
        let patch = Component {
            url: "data:,x".into(),
            hash: "sha256:inline".into(),
            install_path: "/p".into(),
            extract: false,
        };
        let out = stand_ins_for(&mirror, &[kubelet.clone(), patch.clone()], "v1.31.13").unwrap();
        assert_eq!(out[0].url, kubelet.url);
        assert_eq!(out[0].install_path, kubelet.install_path);
        assert_eq!(out[0].hash, sha256(&executable("kubelet", "v1.31.13")));
        assert_eq!(out[1], patch);

        let unknown = Component {
            url: "https://example.invalid/other".into(),
            ..kubelet
        };
        assert!(matches!(
            stand_ins_for(&mirror, &[unknown], "v1.31.13"),
            Err(StandInError::Unknown(_))
        ));
    }
}
