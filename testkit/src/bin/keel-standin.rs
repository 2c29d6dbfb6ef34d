//! `keel-standin`: a stand-in for `kubeadm`, `kubelet` and `kubectl`.
//!
//! Real Kubernetes cannot be downloaded or run in this environment, so tests
//! and the local demo install this program (from the local component mirror,
//! with its own hash) under the names `kubeadm`, `kubelet` and `kubectl`. It
//! picks its role from the name it was started as, or from its first
//! argument when started as `keel-standin`.
//!
//! It is honest about what it is: it does not run a control plane. As
//! `kubeadm` it checks what a real kubeadm would need from its command line
//! and configuration file and writes what kubeadm writes, so the agent's
//! side can be exercised end to end:
//! * `init --config F`: checks the `InitConfiguration` and
//!   `ClusterConfiguration` (API version against the Kubernetes version,
//!   node name, advertise address, bootstrap tokens, extra-argument shapes,
//!   patches directory, networking, certificate SANs), then writes a cluster
//!   CA, an API server certificate carrying the SANs and `admin.conf`, and
//!   prints kubeadm-like progress lines (including the token line kubeadm
//!   prints, which the agent must scrub);
//! * `join --config F`: checks the `JoinConfiguration` (token discovery,
//!   or file discovery, whose kubeconfig must hold the cluster's server and
//!   CA and a client certificate for `system:node:<the node's name>` in
//!   `system:nodes`, as the kubelet's TLS bootstrap would use it) and
//!   writes `kubelet.conf`, and what it joined with (the token's ID, or
//!   `file`) to `var/lib/keel-standin/joined-with`;
//! * `reset --force`: removes what `init`/`join` wrote and empties the
//!   certificates directory and `var/lib/kubelet`, as kubeadm does;
//! * `upgrade apply VERSION --yes` and `upgrade node`: check that the node
//!   is in a cluster, that this kubeadm is the target version and that the
//!   target follows the cluster's version (recorded at init, join and each
//!   upgrade in `etc/kubernetes/keel-standin-version`) by one minor version at
//!   most; write the static pods' manifest (`upgrade apply`), the version
//!   and the kubelet's configuration; `KEEL_STANDIN_FAIL` applies here
//!   too, before anything is written, and `KEEL_STANDIN_FAIL_POST_UPGRADE`
//!   fails after it is written, as kubeadm's post-upgrade phase may;
//! * `token create --config F [--kubeconfig K]`: checks that the cluster
//!   exists (`admin.conf`), then, as kubeadm's token phase does for every
//!   token of the `InitConfiguration`'s list, checks it (format, TTL,
//!   usages, not already there), records it as the cluster would, under
//!   `var/lib/keel-standin/tokens/<id>` (mode 0600), and prints its ID
//!   only;
//! * `version`.
//!
//! On a node (`KEEL_STANDIN_ROOT` unset), `init` and `join` also run the
//! host part of kubeadm's preflight: the executables it looks for,
//! `kubelet --version` through `PATH`, the kernel configuration, IPv4
//! forwarding, and the container runtime, checked by importing and running
//! a locally built image (`keel_testkit::container`); the report is one
//! output line, which the agent passes on to the console. They also check
//! what the cluster needs of the host that a stand-in run would not
//! notice: a resolver configuration, CA roots, the volume plugin directory
//! and, on a control plane, etcd's data directory on the state disk.
//!
//! As `kubelet` with `--config` (as its systemd unit starts it) it says
//! what it is and waits until stopped, as a service does; otherwise, and as
//! `kubectl`, it prints a version line and exits 0.
//!
//! Environment: `KEEL_STANDIN_ROOT` (default `/`) is where `etc/kubernetes`
//! lives; `KEEL_STANDIN_FAIL` makes `init`/`join` fail: `always`, or a
//! number N to fail the first N runs under the root; `KEEL_STANDIN_SLEEP`
//! (seconds) delays `init`/`join` and `token create`; `KEEL_STANDIN_VERSION` is the version it
//! claims to be (a config asking for another one is refused); without it,
//! the version the component mirror appended to this copy.

use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use base64::Engine as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use serde::Deserialize as _;
use serde_yaml::Value;
use sha2::Digest as _;

const ROOT_ENV: &str = "KEEL_STANDIN_ROOT";
const FAIL_ENV: &str = "KEEL_STANDIN_FAIL";
/// Set: `upgrade` fails after writing the new version's files.
const FAIL_POST_UPGRADE_ENV: &str = "KEEL_STANDIN_FAIL_POST_UPGRADE";
const SLEEP_ENV: &str = "KEEL_STANDIN_SLEEP";
const VERSION_ENV: &str = "KEEL_STANDIN_VERSION";
/// Days the leaf certificates `init` issues are valid (as kubeadm's, for a
/// year, when unset); `certs renew all` issues them for a year.
const CERT_DAYS_ENV: &str = "KEEL_STANDIN_CERT_DAYS";
/// What kubeadm's leaf certificates last.
const CERT_DAYS: i64 = 365;
/// Largest configuration file read.
const MAX_CONFIG: u64 = 1024 * 1024;

/// An error for the operator, printed as kubeadm prints its errors.
struct Failure(String);

type Result<T> = std::result::Result<T, Failure>;

fn fail<T>(message: impl Into<String>) -> Result<T> {
    Err(Failure(message.into()))
}

/// The kubelet's service mode: runs no pods, just stays up until stopped.
fn kubelet_service() -> Result<()> {
    println!(
        "kubelet {} (keel stand-in): service started; it runs no pods",
        version_claim()
    );
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let invoked = args
        .first()
        .and_then(|a| Path::new(a).file_name())
        .and_then(|n| n.to_str())
        .unwrap_or("keel-standin")
        .to_owned();
    let (role, rest) = if invoked == "keel-standin" {
        (
            args.get(1).cloned().unwrap_or_default(),
            args.get(2..).unwrap_or_default(),
        )
    } else {
        (invoked, args.get(1..).unwrap_or_default())
    };
    let result = match role.as_str() {
        "kubeadm" => kubeadm(rest),
        "kubelet" if rest.iter().any(|a| a.starts_with("--config")) => kubelet_service(),
        "kubelet" | "kubectl" => {
            println!("{role} {} (keel stand-in)", version_claim());
            Ok(())
        }
        other => fail(format!(
            "keel-standin: unknown role {other:?} (kubeadm, kubelet, kubectl)"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(message)) => {
            eprintln!("error execution phase: {message}");
            eprintln!("To see the stack trace of this error execute with --v=5 or higher");
            ExitCode::FAILURE
        }
    }
}

fn version_claim() -> String {
    std::env::var(VERSION_ENV)
        .ok()
        .or_else(own_version)
        .unwrap_or_else(|| "v0.0.0-standin".into())
}

/// The version this copy was built for: the trailer the component mirror
/// appends to the program (`keel_testkit::components::versioned`).
fn own_version() -> Option<String> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let mut exe = std::fs::File::open("/proc/self/exe").ok()?;
    let len = exe.metadata().ok()?.len();
    exe.seek(SeekFrom::Start(len.saturating_sub(64))).ok()?;
    let mut tail = Vec::new();
    exe.read_to_end(&mut tail).ok()?;
    let tail = String::from_utf8_lossy(&tail);
    let (_, version) = tail.rsplit_once("keel-standin-version:")?;
    let version = version.trim();
    parse_version(version).map(|_| version.to_owned())
}

/// Where the stand-in keeps the cluster version it set up or upgraded to,
/// as the cluster's kubeadm-config would: under `/etc/kubernetes`, which
/// outlives a reboot (it is on the state disk).
fn version_record() -> PathBuf {
    kube_dir().join("keel-standin-version")
}

fn root() -> PathBuf {
    std::env::var_os(ROOT_ENV).map_or_else(|| PathBuf::from("/"), PathBuf::from)
}

fn kube_dir() -> PathBuf {
    root().join("etc/kubernetes")
}

/// Parsed flags of a kubeadm subcommand.
#[derive(Default)]
struct Flags {
    config: Option<PathBuf>,
    skip_phases: Vec<String>,
    skip_token_print: bool,
    force: bool,
    kubeconfig: Option<PathBuf>,
}

fn parse_flags(args: &[String], allowed: &[&str]) -> Result<Flags> {
    let mut flags = Flags::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n, Some(v.to_owned())),
            None => (arg.as_str(), None),
        };
        if !allowed.contains(&name) {
            return fail(format!("unknown flag: {name}"));
        }
        let mut value = || -> Result<String> {
            match inline.clone().or_else(|| it.next().cloned()) {
                Some(v) => Ok(v),
                None => fail(format!("flag needs an argument: {name}")),
            }
        };
        match name {
            "--config" => flags.config = Some(PathBuf::from(value()?)),
            "--skip-phases" => {
                flags.skip_phases = value()?.split(',').map(str::to_owned).collect();
            }
            "--skip-token-print" => flags.skip_token_print = true,
            "--force" => flags.force = true,
            "--kubeconfig" => flags.kubeconfig = Some(PathBuf::from(value()?)),
            _ => {}
        }
    }
    Ok(flags)
}

fn kubeadm(args: &[String]) -> Result<()> {
    let Some((command, rest)) = args.split_first() else {
        return fail("kubeadm: missing command (init, join, reset, token, upgrade, version)");
    };
    match command.as_str() {
        "version" => {
            println!(
                "kubeadm version: &version.Info{{GitVersion:\"{}\", Platform:\"linux/amd64\"}} (keel stand-in)",
                version_claim()
            );
            Ok(())
        }
        "init" => init(&parse_flags(
            rest,
            &[
                "--config",
                "--skip-phases",
                "--skip-token-print",
                "--skip-certificate-key-print",
                "--v",
            ],
        )?),
        "join" => join(&parse_flags(rest, &["--config", "--skip-phases", "--v"])?),
        "reset" => reset(&parse_flags(rest, &["--force", "--v"])?),
        "upgrade" => upgrade(rest),
        "certs" => match rest.first().map(String::as_str) {
            Some("renew") if rest.get(1).is_some_and(|w| w == "all") => renew_certs(),
            _ => fail("kubeadm certs: only \"renew all\" is supported by the stand-in"),
        },
        "token" => match rest.split_first() {
            Some((sub, rest)) if sub == "create" => {
                if rest.first().is_some_and(|a| !a.starts_with("--")) {
                    return fail(
                        "token create: pass the token in the --config file, not as an argument",
                    );
                }
                token_create(&parse_flags(rest, &["--config", "--kubeconfig", "--v"])?)
            }
            _ => fail("kubeadm token: only \"create\" is supported by the stand-in"),
        },
        other => fail(format!("unknown command {other:?} for \"kubeadm\"")),
    }
}

/// Applies `KEEL_STANDIN_SLEEP`.
fn injected_delay() {
    if let Some(secs) = std::env::var(SLEEP_ENV).ok().and_then(|s| s.parse().ok()) {
        std::thread::sleep(Duration::from_secs(secs));
    }
}

/// Applies `KEEL_STANDIN_SLEEP` and `KEEL_STANDIN_FAIL`.
fn injected_faults(phase: &str) -> Result<()> {
    injected_delay();
    let Ok(spec) = std::env::var(FAIL_ENV) else {
        return Ok(());
    };
    let injected = || fail(format!("{phase}: failure injected by {FAIL_ENV}"));
    if spec == "always" {
        return injected();
    }
    let Ok(times) = spec.parse::<u32>() else {
        return fail(format!(
            "{FAIL_ENV}={spec:?}: expected \"always\" or a number"
        ));
    };
    let counter = root().join("var/lib/keel-standin/failures");
    let done: u32 = std::fs::read_to_string(&counter)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if done < times {
        write_file(&counter, (done + 1).to_string().as_bytes(), 0o644)?;
        return injected();
    }
    Ok(())
}

fn read_config(flags: &Flags) -> Result<Vec<Value>> {
    let Some(path) = &flags.config else {
        return fail("--config is required (keel always passes a configuration file)");
    };
    let text = read_private(path, "config file", "a token")?;
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_yaml::Value::deserialize(doc)
            .or_else(|e| fail(format!("invalid YAML in {path:?}: {e}")))?;
        docs.push(value);
    }
    Ok(docs)
}

/// The text of `path`, the `what` that holds `secret`: a regular file of
/// at most 1 MiB that only its owner may read, as kubeadm's own files are
/// (and the agent writes them).
fn read_private(path: &Path, what: &str, secret: &str) -> Result<String> {
    let meta = std::fs::symlink_metadata(path)
        .or_else(|e| fail(format!("couldn't load the {what} {path:?}: {e}")))?;
    if !meta.is_file() || meta.len() > MAX_CONFIG {
        return fail(format!(
            "the {what} {path:?} is not a file of at most 1 MiB"
        ));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return fail(format!(
            "the {what} {path:?} is readable by others (mode {:o}); it holds {secret}",
            meta.permissions().mode() & 0o777
        ));
    }
    std::fs::read_to_string(path)
        .or_else(|e| fail(format!("couldn't load the {what} {path:?}: {e}")))
}

fn get<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.get(*key))
}

fn string(doc: &Value, kind: &str, path: &[&str]) -> Result<String> {
    match get(doc, path).and_then(Value::as_str) {
        Some(s) if !s.is_empty() => Ok(s.to_owned()),
        _ => fail(format!("{kind}: {} is required", path.join("."))),
    }
}

/// The kubeadm API version of `doc`: `v1beta3` or `v1beta4`.
fn api_version(doc: &Value, kind: &str) -> Result<&'static str> {
    match get(doc, &["apiVersion"]).and_then(Value::as_str) {
        Some("kubeadm.k8s.io/v1beta3") => Ok("v1beta3"),
        Some("kubeadm.k8s.io/v1beta4") => Ok("v1beta4"),
        other => fail(format!(
            "{kind}: unsupported apiVersion {other:?} (kubeadm.k8s.io/v1beta3 or v1beta4)"
        )),
    }
}

/// The one document of `kind` in the config.
fn document<'a>(docs: &'a [Value], kind: &str) -> Result<&'a Value> {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| get(d, &["kind"]).and_then(Value::as_str) == Some(kind))
        .collect();
    match found.as_slice() {
        [] => fail(format!("no {kind} in the config")),
        [one] => Ok(one),
        _ => fail(format!("more than one {kind} in the config")),
    }
}

fn known_kinds(docs: &[Value], allowed: &[&str]) -> Result<()> {
    for doc in docs {
        let kind = get(doc, &["kind"]).and_then(Value::as_str).unwrap_or("");
        if !allowed.contains(&kind) {
            return fail(format!("unexpected document kind {kind:?}"));
        }
    }
    Ok(())
}

fn token_ok(token: &str) -> bool {
    let part = |p: &str, n: usize| {
        p.len() == n
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    };
    token
        .split_once('.')
        .is_some_and(|(id, secret)| part(id, 6) && part(secret, 16))
}

/// `(major, minor)` of a pinned `vX.Y.Z`.
fn parse_version(v: &str) -> Option<(u32, u32)> {
    let mut parts = v.strip_prefix('v')?.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    parts.next()?.parse::<u32>().ok()?;
    parts.next().is_none().then_some((major, minor))
}

/// kubeadm's key algorithm setting, as kubeadm validates it; this stand-in
/// makes ECDSA P-256 keys only, so a config that asks for anything else
/// (or for kubeadm's default, RSA-2048) fails here rather than pass with
/// keys of another kind than a real cluster would have.
fn check_key_algorithm(cluster: &Value, api: &str) -> Result<()> {
    let algorithm = get(cluster, &["encryptionAlgorithm"]);
    let ecdsa_gate = get(cluster, &["featureGates", "PublicKeysECDSA"]).and_then(Value::as_bool);
    let asked = if api.ends_with("v1beta3") {
        if algorithm.is_some() {
            return fail("ClusterConfiguration: unknown field \"encryptionAlgorithm\" in v1beta3");
        }
        if ecdsa_gate == Some(true) {
            "ECDSA-P256"
        } else {
            "RSA-2048"
        }
    } else {
        if ecdsa_gate.is_some() {
            return fail("ClusterConfiguration: the PublicKeysECDSA feature gate is replaced by encryptionAlgorithm in v1beta4");
        }
        match algorithm.map(|a| a.as_str()) {
            None => "RSA-2048",
            Some(Some(
                a @ ("RSA-2048" | "RSA-3072" | "RSA-4096" | "ECDSA-P256" | "ECDSA-P384"),
            )) => a,
            Some(_) => return fail("ClusterConfiguration: encryptionAlgorithm: Unsupported value"),
        }
    };
    if asked != "ECDSA-P256" {
        return fail(format!(
            "keel-standin makes ECDSA-P256 keys only; the config asks for {asked}"
        ));
    }
    Ok(())
}

fn check_version(api: &str, version: &str) -> Result<()> {
    let Some((major, minor)) = parse_version(version) else {
        return fail(format!(
            "ClusterConfiguration: kubernetesVersion {version:?} is not a pinned vX.Y.Z"
        ));
    };
    let claim = version_claim();
    if std::env::var(VERSION_ENV).is_ok() && claim != version {
        return fail(format!(
            "this kubeadm is {claim}, the config asks for Kubernetes {version}"
        ));
    }
    match (api, major, minor) {
        ("v1beta4", 1, m) if m >= 31 => Ok(()),
        ("v1beta3", 1, 22..=33) => Ok(()),
        _ => fail(format!(
            "kubeadm.k8s.io/{api} is not accepted for Kubernetes {version}"
        )),
    }
}

/// kubelet extra arguments: a map in v1beta3, a list of {name, value} in v1beta4.
fn check_extra_args(doc: &Value, kind: &str, api: &str) -> Result<()> {
    let Some(args) = get(doc, &["nodeRegistration", "kubeletExtraArgs"]) else {
        return Ok(());
    };
    let ok = match api {
        "v1beta3" => args.is_mapping(),
        _ => args.as_sequence().is_some_and(|items| {
            items
                .iter()
                .all(|i| i.get("name").is_some_and(Value::is_string) && i.get("value").is_some())
        }),
    };
    if ok {
        Ok(())
    } else {
        fail(format!(
            "{kind}: nodeRegistration.kubeletExtraArgs has the wrong shape for {api}"
        ))
    }
}

/// `--patches DIR` among an upgrade's flags: required, as the patch files
/// are what pin the control plane's images by digest and kubeadm keeps none
/// between runs; the directory must exist. Returns the other flags.
fn upgrade_patches(kind: &str, flags: &[String]) -> Result<Vec<String>> {
    let mut rest = Vec::new();
    let mut dir = None;
    let mut flags = flags.iter();
    while let Some(flag) = flags.next() {
        if flag == "--patches" {
            dir = flags.next().map(PathBuf::from);
        } else {
            rest.push(flag.clone());
        }
    }
    let Some(dir) = dir else {
        return fail(format!(
            "{kind}: no --patches: the static pods would lose their pinned image digests"
        ));
    };
    if !dir.is_dir() {
        return fail(format!("could not list patch files for path {dir:?}"));
    }
    Ok(rest)
}

fn check_patches(doc: &Value) -> Result<Option<PathBuf>> {
    let Some(dir) = get(doc, &["patches", "directory"]).and_then(Value::as_str) else {
        return Ok(None);
    };
    let dir = PathBuf::from(dir);
    if !dir.is_dir() {
        return fail(format!("could not list patch files for path {dir:?}"));
    }
    Ok(Some(dir))
}

/// Whether the node runs a control plane (`init`, a control-plane
/// `join`): its etcd member's data is checked too.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    ControlPlane,
    Worker,
}

fn check_preflight(flags: &Flags, files: &[&str], role: Role) -> Result<()> {
    if flags.skip_phases.iter().any(|p| p == "preflight") {
        return Ok(());
    }
    println!("[preflight] Running pre-flight checks");
    if std::env::var_os(ROOT_ENV).is_none() {
        node_preflight(role)?;
    }
    for file in files {
        let path = kube_dir().join(file);
        if path.exists() {
            return fail(format!(
                "preflight: [ERROR FileAvailable--etc-kubernetes-{}]: {} already exists",
                file.replace(['/', '.'], "-"),
                path.display()
            ));
        }
    }
    Ok(())
}

/// Executables kubeadm's preflight looks for on the host.
const PREFLIGHT_EXECUTABLES: [&str; 9] = [
    "conntrack",
    "ip",
    "iptables",
    "mount",
    "nsenter",
    "ethtool",
    "socat",
    "tc",
    "touch",
];

/// Where kubeadm's SystemVerification preflight looks for the kernel's
/// build configuration (k8s.io/system-validators), for kernel `release`.
fn kernel_config_paths(release: &str) -> Vec<PathBuf> {
    [
        "/proc/config.gz".to_owned(),
        format!("/boot/config-{release}"),
        format!("/usr/src/linux-{release}/.config"),
        "/usr/src/linux/.config".to_owned(),
        format!("/usr/lib/modules/{release}/config"),
        format!("/usr/lib/ostree-boot/config-{release}"),
        format!("/usr/lib/kernel/config-{release}"),
        format!("/usr/src/linux-headers-{release}/.config"),
        format!("/lib/modules/{release}/build/.config"),
    ]
    .into_iter()
    .map(PathBuf::from)
    .collect()
}

/// The kubelet's and kube-controller-manager's volume plugin directory: a
/// hostPath volume (`DirectoryOrCreate`) of the controller manager kubeadm
/// writes, which cannot be created on a read-only root.
const FLEXVOLUME_DIR: &str = "/usr/libexec/kubernetes/kubelet-plugins/volume/exec";
/// The CA roots containerd pulls images with, and the directory kubeadm
/// mounts into the API server and controller manager (`DirectoryOrCreate`).
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// etcd's data directory (kubeadm's `etcd.local.dataDir` default).
const ETCD_DATA_DIR: &str = "/var/lib/etcd";

/// What the host gives the cluster's pods and downloads beyond kubeadm's
/// own checks, which a real node needs and a stand-in run would not
/// notice: a resolver configuration and CA roots (pulls from
/// registry.k8s.io, downloads from dl.k8s.io), the volume plugin
/// directory, and the kernel configuration kubeadm's SystemVerification
/// reads.
fn host_problems() -> Vec<String> {
    let mut problems = Vec::new();
    // Followed through its link: the resolver's stub file must be there.
    if !Path::new("/etc/resolv.conf").is_file() {
        problems.push("/etc/resolv.conf: no resolver configuration".to_owned());
    }
    if std::fs::metadata(CA_BUNDLE).map_or(true, |m| m.len() == 0) {
        problems.push(format!("{CA_BUNDLE}: no CA roots"));
    }
    if !Path::new(FLEXVOLUME_DIR).is_dir() {
        problems.push(format!("{FLEXVOLUME_DIR}: not a directory"));
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let paths = kernel_config_paths(release.trim());
    if !paths.iter().any(|p| std::fs::File::open(p).is_ok()) {
        problems.push(format!(
            "[ERROR SystemVerification]: failed to parse kernel config: none of {}",
            paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    problems
}

/// On a control plane: etcd's data directory is on the state disk (not the
/// volatile `/var`), mode 0700.
fn etcd_problems() -> Vec<String> {
    use std::os::unix::fs::MetadataExt as _;
    let state = match std::fs::metadata(keel_testkit::container::STATE_MOUNT) {
        Ok(m) => m.dev(),
        Err(e) => return vec![format!("{}: {e}", keel_testkit::container::STATE_MOUNT)],
    };
    match std::fs::metadata(ETCD_DATA_DIR) {
        Err(e) => vec![format!("{ETCD_DATA_DIR} is not on the state disk: {e}")],
        Ok(m) if m.dev() != state => vec![format!(
            "{ETCD_DATA_DIR} is not on the state disk (device {:#x}, the disk is {state:#x})",
            m.dev()
        )],
        Ok(m) if m.mode() & 0o7777 != 0o700 => vec![format!(
            "{ETCD_DATA_DIR} has mode {:o}, not 700",
            m.mode() & 0o7777
        )],
        Ok(_) => Vec::new(),
    }
}

/// On a node (no `KEEL_STANDIN_ROOT`), what a real kubeadm's preflight
/// checks on the host: the executables it looks for, the kubelet's version
/// (`kubelet --version`, found through `PATH`), the kernel configuration,
/// IPv4 forwarding, and the container runtime; and what the cluster needs
/// of the host besides ([`host_problems`], [`etcd_problems`] on a control
/// plane). The stand-in cannot pull images, so it checks the
/// runtime by importing and running a locally built image
/// (`keel_testkit::container`), and prints the report for the VM tests.
fn node_preflight(role: Role) -> Result<()> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for exe in PREFLIGHT_EXECUTABLES {
        if !std::env::split_paths(&path).any(|dir| dir.join(exe).is_file()) {
            return fail(format!(
                "preflight: [ERROR FileExisting-{exe}]: {exe} not found in system path"
            ));
        }
    }
    match std::process::Command::new("kubelet")
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            return fail(format!(
                "preflight: [ERROR KubeletVersion]: couldn't get kubelet version: {}",
                out.status
            ))
        }
        Err(e) => {
            return fail(format!(
                "preflight: [ERROR KubeletVersion]: couldn't get kubelet version: cannot execute 'kubelet --version': {e}"
            ))
        }
    }
    let mut problems = host_problems();
    if role == Role::ControlPlane {
        problems.extend(etcd_problems());
    }
    if !problems.is_empty() {
        return fail(format!(
            "preflight: the node is not ready for Kubernetes: {}",
            problems.join("; ")
        ));
    }
    let forward = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap_or_default();
    if forward.trim() != "1" {
        return fail(
            "preflight: [ERROR FileContent--proc-sys-net-ipv4-ip_forward]: /proc/sys/net/ipv4/ip_forward contents are not set to 1",
        );
    }
    let check =
        keel_testkit::container::check_node(&root().join("var/lib/keel-standin")).or_else(|e| {
            fail(format!(
                "preflight: [ERROR CRI]: container runtime check: {e}"
            ))
        })?;
    let json =
        serde_json::to_string(&check).or_else(|e| fail(format!("container check report: {e}")))?;
    println!(
        "[preflight] {}{json}",
        keel_testkit::container::REPORT_PREFIX
    );
    Ok(())
}

fn init(flags: &Flags) -> Result<()> {
    let docs = read_config(flags)?;
    known_kinds(&docs, &["InitConfiguration", "ClusterConfiguration"])?;
    let init = document(&docs, "InitConfiguration")?;
    let cluster = document(&docs, "ClusterConfiguration")?;
    let api = api_version(init, "InitConfiguration")?;
    if api_version(cluster, "ClusterConfiguration")? != api {
        return fail("InitConfiguration and ClusterConfiguration use different API versions");
    }
    let version = string(cluster, "ClusterConfiguration", &["kubernetesVersion"])?;
    check_version(api, &version)?;
    let node = string(init, "InitConfiguration", &["nodeRegistration", "name"])?;
    let advertise = string(
        init,
        "InitConfiguration",
        &["localAPIEndpoint", "advertiseAddress"],
    )?;
    let advertise: IpAddr = advertise.parse().or_else(|_| {
        fail(format!(
            "InitConfiguration: advertiseAddress {advertise:?} is not an IP address"
        ))
    })?;
    let port = get(init, &["localAPIEndpoint", "bindPort"])
        .and_then(Value::as_u64)
        .map_or(Ok(6443), |p| {
            u16::try_from(p)
                .or_else(|_| fail(format!("InitConfiguration: bindPort {p} is not a port")))
        })?;
    let tokens = get(init, &["bootstrapTokens"])
        .and_then(Value::as_sequence)
        .cloned()
        .unwrap_or_default();
    for t in &tokens {
        let token = t.get("token").and_then(Value::as_str).unwrap_or("");
        if !token_ok(token) {
            return fail(
                "InitConfiguration: a bootstrap token does not match [a-z0-9]{6}.[a-z0-9]{16}",
            );
        }
    }
    check_extra_args(init, "InitConfiguration", api)?;
    let cluster_name = string(cluster, "ClusterConfiguration", &["clusterName"])?;
    for field in ["serviceSubnet", "podSubnet"] {
        let cidr = string(cluster, "ClusterConfiguration", &["networking", field])?;
        if cidr
            .split_once('/')
            .is_none_or(|(a, p)| a.parse::<IpAddr>().is_err() || p.parse::<u8>().is_err())
        {
            return fail(format!(
                "ClusterConfiguration: networking.{field} {cidr:?} is not a CIDR"
            ));
        }
    }
    let Some(sans) = get(cluster, &["apiServer", "certSANs"]).and_then(Value::as_sequence) else {
        return fail("ClusterConfiguration: apiServer.certSANs is required");
    };
    let sans: Vec<String> = sans
        .iter()
        .map(|s| s.as_str().map(str::to_owned))
        .collect::<Option<_>>()
        .map_or_else(
            || fail("ClusterConfiguration: certSANs must be strings"),
            Ok,
        )?;

    check_key_algorithm(cluster, api)?;

    injected_faults("init")?;
    check_preflight(
        flags,
        &["admin.conf", "manifests/kube-apiserver.yaml"],
        Role::ControlPlane,
    )?;
    println!("[init] Using Kubernetes version: {version}");
    let pki = kube_dir().join("pki");
    println!("[certs] Using certificateDir folder \"{}\"", pki.display());
    let ca = Ca::load_or_create(&pki)?;
    let mut dns = vec![
        node.clone(),
        "kubernetes".to_owned(),
        "kubernetes.default".to_owned(),
        "kubernetes.default.svc".to_owned(),
        "kubernetes.default.svc.cluster.local".to_owned(),
    ];
    let mut ips = vec![advertise.to_string()];
    for san in &sans {
        if san.parse::<IpAddr>().is_ok() {
            if !ips.contains(san) {
                ips.push(san.clone());
            }
        } else if !dns.contains(san) {
            dns.push(san.clone());
        }
    }
    println!("[certs] Generating \"apiserver\" certificate and key");
    println!("[certs] apiserver serving cert is signed for DNS names {dns:?} and IPs {ips:?}");
    let days = init_certificate_days();
    let apiserver = ca.issue("kube-apiserver", None, &dns, &ips, true, days)?;
    write_file(&pki.join("apiserver.crt"), apiserver.0.as_bytes(), 0o644)?;
    write_file(&pki.join("apiserver.key"), apiserver.1.as_bytes(), 0o600)?;
    if let Some(dir) = check_patches(init)? {
        println!("[patches] Reading patches from path \"{}\"", dir.display());
    }
    let server = format!("https://{}", std::net::SocketAddr::new(advertise, port));
    println!("[kubeconfig] Writing \"admin.conf\" kubeconfig file");
    let admin = ca.issue(
        "kubernetes-admin",
        Some("kubeadm:cluster-admins"),
        &[],
        &[],
        false,
        days,
    )?;
    let kubeconfig = kubeconfig(
        &cluster_name,
        &server,
        &ca.cert_pem,
        "kubernetes-admin",
        Some(&admin),
    );
    write_file(&kube_dir().join("admin.conf"), kubeconfig.as_bytes(), 0o600)?;
    write_file(&version_record(), version.as_bytes(), 0o644)?;
    write_file(
        &kube_dir().join("manifests/kube-apiserver.yaml"),
        b"# keel stand-in: no static pods run here\n",
        0o600,
    )?;
    for t in &tokens {
        // As kubeadm does in its bootstrap-token phase.
        let token = t.get("token").and_then(Value::as_str).unwrap_or("");
        println!("[bootstrap-token] Using token: {token}");
    }
    println!("[addons] Applied essential addon: CoreDNS (stand-in: nothing runs)");
    println!();
    println!("Your Kubernetes control-plane has initialized successfully!");
    if !flags.skip_token_print {
        if let Some(token) = tokens
            .first()
            .and_then(|t| t.get("token"))
            .and_then(Value::as_str)
        {
            println!(
                "kubeadm join {} --token {token} --discovery-token-ca-cert-hash {}",
                server.trim_start_matches("https://"),
                ca.spki_hash
            );
        }
    }
    Ok(())
}

/// What a join's discovery established.
struct Discovered {
    /// `host:port` of the API server.
    endpoint: String,
    /// The cluster CA (file discovery carries it).
    ca_pem: Option<String>,
    /// The token's ID, or `file`.
    joined_with: String,
}

/// Token discovery: a token of kubeadm's form and pinned CA hashes.
fn token_discovery(join: &Value) -> Result<Discovered> {
    let kind = "JoinConfiguration";
    let token = string(join, kind, &["discovery", "bootstrapToken", "token"])?;
    if !token_ok(&token) {
        return fail(
            "JoinConfiguration: the discovery token does not match [a-z0-9]{6}.[a-z0-9]{16}",
        );
    }
    let endpoint = string(
        join,
        kind,
        &["discovery", "bootstrapToken", "apiServerEndpoint"],
    )?;
    check_host_port(&endpoint)?;
    let hashes = get(join, &["discovery", "bootstrapToken", "caCertHashes"])
        .and_then(Value::as_sequence)
        .cloned()
        .unwrap_or_default();
    let hash_ok = |h: &Value| {
        h.as_str()
            .and_then(|s| s.strip_prefix("sha256:"))
            .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    if hashes.is_empty() || !hashes.iter().all(hash_ok) {
        return fail("JoinConfiguration: discovery.bootstrapToken.caCertHashes must list sha256:<hex> hashes (unsafe discovery is not allowed)");
    }
    let id = token.split('.').next().unwrap_or_default().to_owned();
    Ok(Discovered {
        endpoint,
        ca_pem: None,
        joined_with: id,
    })
}

fn check_host_port(endpoint: &str) -> Result<()> {
    if endpoint
        .rsplit_once(':')
        .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
    {
        return fail(format!(
            "JoinConfiguration: apiServerEndpoint {endpoint:?} is not host:port"
        ));
    }
    Ok(())
}

/// File discovery: the kubeconfig at `path` (private, bounded) names an
/// `https://host:port` server and the cluster CA, and its current
/// context's user holds a client certificate and key: the certificate is
/// for `system:node:<node>` in `system:nodes` (the kubelet's TLS bootstrap
/// would ask as that node, and the cluster approves a certificate of that
/// name only), is not a CA, is signed by the kubeconfig's CA and is the
/// key's (the API server would take it from nothing else).
fn file_discovery(path: &Path, node: &str) -> Result<Discovered> {
    let what = "discovery kubeconfig";
    let text = read_private(path, what, "a private key")?;
    let config: Value =
        serde_yaml::from_str(&text).or_else(|e| fail(format!("invalid {what}: {e}")))?;
    let context = get(&config, &["current-context"])
        .and_then(Value::as_str)
        .unwrap_or_default();
    let named = |list: &str, name: &str, field: &str| -> Option<Value> {
        get(&config, &[list])?
            .as_sequence()?
            .iter()
            .find(|e| get(e, &["name"]).and_then(Value::as_str) == Some(name))
            .and_then(|e| e.get(field))
            .cloned()
    };
    let Some(ctx) = named("contexts", context, "context") else {
        return fail(format!("{what}: no context {context:?}"));
    };
    let (cluster, user) = (
        get(&ctx, &["cluster"])
            .and_then(Value::as_str)
            .unwrap_or_default(),
        get(&ctx, &["user"])
            .and_then(Value::as_str)
            .unwrap_or_default(),
    );
    let (Some(cluster), Some(user)) = (
        named("clusters", cluster, "cluster"),
        named("users", user, "user"),
    ) else {
        return fail(format!(
            "{what}: its context names no cluster or user it holds"
        ));
    };
    let server = string(&cluster, what, &["server"])?;
    let Some(endpoint) = server.strip_prefix("https://") else {
        return fail(format!(
            "{what}: server {server:?} is not https://host:port"
        ));
    };
    check_host_port(endpoint)?;
    let pem = |v: &Value, field: &str, label: &str| -> Result<String> {
        let data = string(v, what, &[field])?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data)
            .or_else(|_| fail(format!("{what}: {field} is not base64")))?;
        match String::from_utf8(bytes) {
            Ok(text) if text.contains(&format!("-----BEGIN {label}")) => Ok(text),
            _ => fail(format!("{what}: {field} is not a PEM {label}")),
        }
    };
    let ca_pem = pem(&cluster, "certificate-authority-data", "CERTIFICATE")?;
    let cert_pem = pem(&user, "client-certificate-data", "CERTIFICATE")?;
    let key_pem = pem(&user, "client-key-data", "PRIVATE KEY")?;
    let expected = format!("system:node:{node}");
    let client = client_identity(&cert_pem, &ca_pem, &key_pem)?;
    if client != (expected.clone(), "system:nodes".to_owned()) {
        return fail(format!(
            "{what}: its client certificate is not {expected} in system:nodes: the TLS bootstrap would not get this node a certificate"
        ));
    }
    Ok(Discovered {
        endpoint: endpoint.to_owned(),
        ca_pem: Some(ca_pem),
        joined_with: "file".to_owned(),
    })
}

/// The common name and organisation of the client certificate `cert_pem`
/// (one of each; empty where it names none or several); refused where it
/// is a CA, is not signed by `ca_pem`'s key or is not `key_pem`'s.
fn client_identity(cert_pem: &str, ca_pem: &str, key_pem: &str) -> Result<(String, String)> {
    let what = "discovery kubeconfig";
    let parse = |pem: &str| {
        x509_parser::pem::parse_x509_pem(pem.as_bytes())
            .map(|(_, pem)| pem)
            .or_else(|e| fail(format!("{what}: a certificate does not parse: {e}")))
    };
    let (cert_pem, ca_pem) = (parse(cert_pem)?, parse(ca_pem)?);
    let (Ok(cert), Ok(ca)) = (cert_pem.parse_x509(), ca_pem.parse_x509()) else {
        return fail(format!("{what}: a certificate does not parse"));
    };
    if cert.is_ca() {
        return fail(format!("{what}: its client certificate is a CA"));
    }
    if cert.verify_signature(Some(ca.public_key())).is_err() {
        return fail(format!(
            "{what}: its client certificate is not signed by its CA"
        ));
    }
    let key = KeyPair::from_pem(key_pem)
        .or_else(|e| fail(format!("{what}: its client key does not parse: {e}")))?;
    if rcgen::PublicKeyData::subject_public_key_info(&key) != cert.public_key().raw {
        return fail(format!(
            "{what}: its client key is not its client certificate's"
        ));
    }
    let one = |mut values: std::vec::IntoIter<&str>| match (values.next(), values.next()) {
        (Some(v), None) => v.to_owned(),
        _ => String::new(),
    };
    let subject = cert.subject();
    let names: Vec<&str> = subject
        .iter_common_name()
        .filter_map(|n| n.as_str().ok())
        .collect();
    let orgs: Vec<&str> = subject
        .iter_organization()
        .filter_map(|n| n.as_str().ok())
        .collect();
    Ok((one(names.into_iter()), one(orgs.into_iter())))
}

fn join(flags: &Flags) -> Result<()> {
    let docs = read_config(flags)?;
    known_kinds(&docs, &["JoinConfiguration"])?;
    let join = document(&docs, "JoinConfiguration")?;
    let api = api_version(join, "JoinConfiguration")?;
    let kind = "JoinConfiguration";
    let node = string(join, kind, &["nodeRegistration", "name"])?;
    let discovery = match get(join, &["discovery", "file"]) {
        Some(_) => {
            let path = string(join, kind, &["discovery", "file", "kubeConfigPath"])?;
            file_discovery(Path::new(&path), &node)?
        }
        None => token_discovery(join)?,
    };
    let endpoint = discovery.endpoint;
    check_extra_args(join, kind, api)?;
    let control_plane = get(join, &["controlPlane"]);
    if let Some(cp) = control_plane {
        let addr = string(cp, kind, &["localAPIEndpoint", "advertiseAddress"])?;
        if addr.parse::<IpAddr>().is_err() {
            return fail(format!(
                "JoinConfiguration: controlPlane advertiseAddress {addr:?} is not an IP address"
            ));
        }
        match get(cp, &["certificateKey"]).and_then(Value::as_str) {
            Some(key) if key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()) => {}
            Some(_) => return fail("JoinConfiguration: certificateKey is not 64 hex digits"),
            None => {
                let pki = kube_dir().join("pki");
                if !pki.join("ca.crt").exists() || !pki.join("ca.key").exists() {
                    return fail(format!(
                        "failure loading certificate authority: {}/ca.crt and ca.key are needed for a control-plane join without certificateKey",
                        pki.display()
                    ));
                }
            }
        }
    }
    check_patches(join)?;

    let role = if control_plane.is_some() {
        Role::ControlPlane
    } else {
        Role::Worker
    };
    check_preflight(flags, &["kubelet.conf"], role)?;
    println!("[preflight] Reading configuration from the cluster (stand-in: {endpoint})");
    if control_plane.is_some() {
        println!(
            "[control-plane] Using manifest folder \"{}\"",
            kube_dir().join("manifests").display()
        );
    }
    println!(
        "[kubelet-start] Writing kubelet configuration to file \"/var/lib/kubelet/config.yaml\""
    );
    let ca_pem = discovery.ca_pem.unwrap_or_else(|| {
        std::fs::read_to_string(kube_dir().join("pki/ca.crt")).unwrap_or_default()
    });
    let conf = kubeconfig(
        "kubernetes",
        &format!("https://{endpoint}"),
        &ca_pem,
        &format!("system:node:{node}"),
        None,
    );
    write_file(&kube_dir().join("kubelet.conf"), conf.as_bytes(), 0o600)?;
    write_file(&version_record(), version_claim().as_bytes(), 0o644)?;
    // Which token the join used, by its ID (the secret half stays out),
    // or `file`.
    write_file(
        &root().join("var/lib/keel-standin/joined-with"),
        format!("{}\n", discovery.joined_with).as_bytes(),
        0o644,
    )?;
    if control_plane.is_some() {
        // A control plane gets its own admin kubeconfig, as kubeadm writes
        // one on every control-plane node (the stand-in adds no client
        // certificate: nothing here talks to an API server).
        println!("[kubeconfig] Writing \"admin.conf\" kubeconfig file");
        let admin = kubeconfig(
            "kubernetes",
            &format!("https://{endpoint}"),
            &ca_pem,
            "kubernetes-admin",
            None,
        );
        write_file(&kube_dir().join("admin.conf"), admin.as_bytes(), 0o600)?;
    }
    // An injected failure comes after kubelet.conf is written, as a real
    // join that times out in the TLS bootstrap leaves it behind: a retry
    // then needs `kubeadm reset` first.
    injected_faults(
        "kubelet-start: timed out waiting for the kubelet to perform the TLS Bootstrap",
    )?;
    println!();
    println!("This node has joined the cluster.");
    Ok(())
}

fn token_create(flags: &Flags) -> Result<()> {
    injected_delay();
    let docs = read_config(flags)?;
    known_kinds(&docs, &["InitConfiguration"])?;
    let init = document(&docs, "InitConfiguration")?;
    api_version(init, "InitConfiguration")?;
    let tokens = get(init, &["bootstrapTokens"])
        .and_then(Value::as_sequence)
        .cloned()
        .unwrap_or_default();
    if tokens.is_empty() {
        return fail("InitConfiguration: token create needs a bootstrap token");
    }
    let kubeconfig = flags
        .kubeconfig
        .clone()
        .unwrap_or_else(|| kube_dir().join("admin.conf"));
    if !kubeconfig.is_file() {
        return fail(format!(
            "failed to load admin kubeconfig: open {}: no such file or directory",
            kubeconfig.display()
        ));
    }
    // Like kubeadm's token phase: every token of the list, each checked
    // and created in turn.
    let mut seen = std::collections::BTreeSet::new();
    for token in &tokens {
        let secret = token.get("token").and_then(Value::as_str).unwrap_or("");
        if !token_ok(secret) {
            return fail(
                "InitConfiguration: the bootstrap token does not match [a-z0-9]{6}.[a-z0-9]{16}",
            );
        }
        let ttl = token.get("ttl").and_then(Value::as_str).unwrap_or("");
        if ttl.is_empty() || !ttl.ends_with('s') {
            return fail(format!(
                "InitConfiguration: bootstrap token ttl {ttl:?} is not a duration"
            ));
        }
        let usages: Vec<&str> = token
            .get("usages")
            .and_then(Value::as_sequence)
            .map(|u| u.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !usages.contains(&"authentication") || !usages.contains(&"signing") {
            return fail(
                "InitConfiguration: a join token needs the usages signing and authentication",
            );
        }
        let id = secret.split('.').next().unwrap_or_default();
        let record = root().join("var/lib/keel-standin/tokens").join(id);
        if !seen.insert(id.to_owned()) || record.exists() {
            return fail(format!("a token with id {id:?} already exists"));
        }
        write_file(&record, format!("{secret} ttl={ttl}\n").as_bytes(), 0o600)?;
        // kubeadm prints the whole token; the stand-in prints the ID only.
        println!("[token] created bootstrap token {id}.<redacted> (ttl {ttl})");
    }
    Ok(())
}

fn reset(flags: &Flags) -> Result<()> {
    if !flags.force {
        return fail("reset needs --force (no terminal to confirm on)");
    }
    let dir = kube_dir();
    println!("[reset] Deleting contents of {}", dir.display());
    for entry in [
        "admin.conf",
        "super-admin.conf",
        "kubelet.conf",
        "manifests",
        "pki",
    ] {
        let path = dir.join(entry);
        match remove(&path) {
            Ok(()) => println!("[reset] Deleted {}", path.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return fail(format!("removing {}: {e}", path.display())),
        }
    }
    // As kubeadm empties the kubelet's directory (its certificates too).
    let kubelet = root().join("var/lib/kubelet");
    println!("[reset] Deleting contents of {}", kubelet.display());
    if let Ok(entries) = std::fs::read_dir(&kubelet) {
        for entry in entries.flatten() {
            let path = entry.path();
            if let Err(e) = remove(&path) {
                return fail(format!("removing {}: {e}", path.display()));
            }
        }
    }
    Ok(())
}

/// Removes `path`: a directory with what it holds, anything else itself.
fn remove(path: &Path) -> std::io::Result<()> {
    if std::fs::symlink_metadata(path)?.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

/// `upgrade apply VERSION --yes` (the first control plane) and
/// `upgrade node` (every other node), checked as kubeadm checks them: the
/// node is in a cluster, this kubeadm is the target version, and the target
/// follows the cluster's version by one minor version at most, never back.
fn upgrade(args: &[String]) -> Result<()> {
    let recorded = std::fs::read_to_string(version_record()).ok();
    let claim = version_claim();
    match args.split_first() {
        Some((sub, rest)) if sub == "apply" => {
            let Some(current) = recorded.as_deref().map(str::trim) else {
                return fail("upgrade apply: this node has no record of the cluster's version (it did not run kubeadm init)");
            };
            let (target, flags) = match rest.split_first() {
                Some((v, flags)) if !v.starts_with("--") => (v.clone(), flags),
                _ => return fail("upgrade apply: the version to upgrade to is required"),
            };
            let flags = upgrade_patches("upgrade apply", flags)?;
            for flag in flags {
                if flag != "--yes" && !flag.starts_with("--v") {
                    return fail(format!("unknown flag: {flag}"));
                }
            }
            if !kube_dir().join("admin.conf").exists() {
                return fail("upgrade apply: runs on a control plane (no admin.conf)");
            }
            let (Some(to), Some(from)) = (parse_version(&target), parse_version(current)) else {
                return fail(format!(
                    "upgrade apply: {target:?} is not a pinned vX.Y.Z version"
                ));
            };
            if claim != target {
                return fail(format!(
                    "upgrade apply: this kubeadm is {claim}; the version to upgrade to must be {claim} too, not {target}"
                ));
            }
            if to < from || to.0 != from.0 || to.1 > from.1 + 1 {
                return fail(format!(
                    "[upgrade/version] FATAL: the cluster runs {current}; {target} is a downgrade or skips a minor version"
                ));
            }
            injected_faults("upgrade")?;
            leave_upgrade_backups()?;
            println!(
                "[upgrade/version] You have chosen to change the cluster version to {target:?}"
            );
            println!("[upgrade/versions] Cluster version: {current}");
            write_file(
                &kube_dir().join("manifests/kube-apiserver.yaml"),
                format!("# keel stand-in: the static pods of {target}\n").as_bytes(),
                0o600,
            )?;
            write_file(&version_record(), target.as_bytes(), 0o644)?;
            upgrade_kubelet_config(&target)?;
            println!(
                "[upgrade/successful] SUCCESS! Your cluster was upgraded to {target:?}. Enjoy!"
            );
            Ok(())
        }
        Some((sub, rest)) if sub == "node" => {
            let rest = upgrade_patches("upgrade node", rest)?;
            if let Some(flag) = rest.iter().find(|f| !f.starts_with("--v")) {
                return fail(format!("unknown flag: {flag}"));
            }
            if !kube_dir().join("kubelet.conf").exists() && !kube_dir().join("admin.conf").exists()
            {
                return fail("upgrade node: this node is not part of a cluster (no kubelet.conf)");
            }
            // The cluster's version comes from the cluster for a real
            // kubeadm; the stand-in checks the step where it kept one.
            match recorded.as_deref().map(str::trim).map(|r| (r, parse_version(r))) {
                Some((current, Some(from))) => match parse_version(&claim) {
                    Some(to) if to >= from && to.0 == from.0 && to.1 <= from.1 + 1 => {}
                    _ => {
                        return fail(format!(
                            "[upgrade/version] FATAL: this node runs {current}; {claim} is a downgrade or skips a minor version"
                        ))
                    }
                },
                _ => println!("[upgrade] no local record of the cluster version; upgrading to {claim}"),
            }
            injected_faults("upgrade")?;
            leave_upgrade_backups()?;
            write_file(&version_record(), claim.as_bytes(), 0o644)?;
            println!("[upgrade] Upgrading the kubelet configuration of this node for {claim}");
            upgrade_kubelet_config(&claim)?;
            println!("[upgrade] The configuration for this node was successfully updated!");
            Ok(())
        }
        _ => fail(
            "kubeadm upgrade: only \"apply VERSION\" and \"node\" are supported by the stand-in",
        ),
    }
}

/// Backs up what kubeadm's upgrade backs up, under the names it uses, and
/// leaves it, as kubeadm does (also after a success): on a control plane
/// (it has `admin.conf`) etcd's data and the static pods' manifests, on
/// every node the kubelet's configuration.
fn leave_upgrade_backups() -> Result<()> {
    let tmp = kube_dir().join("tmp");
    let stamp = format!(
        "{}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
        std::process::id()
    );
    if kube_dir().join("admin.conf").exists() {
        write_file(
            &tmp.join(format!("kubeadm-backup-etcd-{stamp}/etcd/member/wal/0.wal")),
            b"keel stand-in: a copy of etcd's data",
            0o600,
        )?;
        write_file(
            &tmp.join(format!(
                "kubeadm-backup-manifests-{stamp}/kube-apiserver.yaml"
            )),
            b"# keel stand-in: the static pod before the upgrade\n",
            0o600,
        )?;
    }
    write_file(
        &tmp.join(format!("kubeadm-kubelet-config{stamp}/config.yaml")),
        b"# keel stand-in: the kubelet configuration before the upgrade\n",
        0o644,
    )
}

/// Writes the kubelet's configuration for `version`, as kubeadm's
/// kubelet-config phase does after the static pods are upgraded; with
/// `KEEL_STANDIN_FAIL_POST_UPGRADE` set, then fails as kubeadm's
/// post-upgrade phase may, undoing nothing.
/// Days the leaf certificates `init` issues are valid: a year, as
/// kubeadm's, unless [`CERT_DAYS_ENV`] says otherwise.
fn init_certificate_days() -> i64 {
    std::env::var(CERT_DAYS_ENV)
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(CERT_DAYS)
}

/// `kubeadm certs renew all`: each leaf certificate under `pki` issued
/// again by the cluster's CA for a year, with its names (the stand-in's
/// only one is the API server's).
fn renew_certs() -> Result<()> {
    let pki = kube_dir().join("pki");
    if !pki.join("ca.crt").exists() || !pki.join("ca.key").exists() {
        return fail(format!(
            "failure loading certificate authority: {}/ca.crt and ca.key are needed",
            pki.display()
        ));
    }
    let ca = Ca::load_or_create(&pki)?;
    let path = pki.join("apiserver.crt");
    let pem = std::fs::read_to_string(&path)
        .map_err(|e| Failure(format!("reading {}: {e}", path.display())))?;
    let unreadable = |why: &str| Failure(format!("reading {}: {why}", path.display()));
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .map_err(|_| unreadable("not a PEM block"))?;
    let old = pem
        .parse_x509()
        .map_err(|_| unreadable("not a certificate"))?;
    let (mut dns, mut ips) = (Vec::new(), Vec::new());
    if let Ok(Some(san)) = old.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                x509_parser::extensions::GeneralName::DNSName(d) => dns.push((*d).to_owned()),
                x509_parser::extensions::GeneralName::IPAddress(b) => {
                    let ip = match *b {
                        [a, b, c, d] => Some(IpAddr::from([*a, *b, *c, *d])),
                        _ => <[u8; 16]>::try_from(*b).ok().map(IpAddr::from),
                    };
                    ips.extend(ip.map(|ip| ip.to_string()));
                }
                _ => {}
            }
        }
    }
    let (cert, key) = ca.issue("kube-apiserver", None, &dns, &ips, true, CERT_DAYS)?;
    write_file(&path, cert.as_bytes(), 0o644)?;
    write_file(&pki.join("apiserver.key"), key.as_bytes(), 0o600)?;
    println!("certificate for serving the Kubernetes API renewed");
    println!(
        "Done renewing certificates. You must restart the kube-apiserver, kube-controller-manager, kube-scheduler and etcd, so that they can use the new certificates."
    );
    Ok(())
}

fn upgrade_kubelet_config(version: &str) -> Result<()> {
    write_file(
        &root().join("var/lib/kubelet/config.yaml"),
        format!("# keel stand-in: the kubelet configuration of {version}\n").as_bytes(),
        0o644,
    )?;
    if std::env::var_os(FAIL_POST_UPGRADE_ENV).is_some() {
        return fail(format!(
            "[upgrade/postupgrade] FATAL post-upgrade error: failure injected by {FAIL_POST_UPGRADE_ENV}"
        ));
    }
    Ok(())
}

fn write_file(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    let io = |e: std::io::Error| Failure(format!("writing {}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    std::fs::write(path, contents).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io)
}

/// A kubeconfig with one cluster, one user and one context.
fn kubeconfig(
    cluster: &str,
    server: &str,
    ca_pem: &str,
    user: &str,
    client: Option<&(String, String)>,
) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let ca = if ca_pem.is_empty() {
        String::new()
    } else {
        format!("    certificate-authority-data: {}\n", b64(ca_pem))
    };
    let creds = client.map_or_else(String::new, |(cert, key)| {
        format!(
            "    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(cert),
            b64(key)
        )
    });
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n{ca}    server: {server}\n  name: {cluster}\n\
         contexts:\n- context:\n    cluster: {cluster}\n    user: {user}\n  name: {user}@{cluster}\n\
         current-context: {user}@{cluster}\npreferences: {{}}\nusers:\n- name: {user}\n  user:\n{creds}"
    )
}

/// The cluster CA.
struct Ca {
    cert_pem: String,
    params: CertificateParams,
    key: KeyPair,
    /// `sha256:<hex>` of the CA's SubjectPublicKeyInfo (kubeadm discovery).
    spki_hash: String,
}

impl Ca {
    /// Reuses `pki/ca.{crt,key}` when present (as kubeadm does), else makes them.
    fn load_or_create(pki: &Path) -> Result<Self> {
        let tls = |e: rcgen::Error| Failure(format!("generating certificates: {e}"));
        let (crt, key_path) = (pki.join("ca.crt"), pki.join("ca.key"));
        let (cert_pem, key) = if crt.exists() && key_path.exists() {
            println!("[certs] Using existing ca certificate authority");
            let read = |p: &Path| {
                std::fs::read_to_string(p)
                    .map_err(|e| Failure(format!("reading {}: {e}", p.display())))
            };
            (
                read(&crt)?,
                KeyPair::from_pem(&read(&key_path)?).map_err(tls)?,
            )
        } else {
            println!("[certs] Generating \"ca\" certificate and key");
            let key = KeyPair::generate().map_err(tls)?;
            let cert = Self::ca_params()?.self_signed(&key).map_err(tls)?;
            write_file(&crt, cert.pem().as_bytes(), 0o644)?;
            write_file(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
            (cert.pem(), key)
        };
        let spki = rcgen::PublicKeyData::subject_public_key_info(&key);
        let spki_hash = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&spki)));
        Ok(Self {
            cert_pem,
            params: Self::ca_params()?,
            key,
            spki_hash,
        })
    }

    fn ca_params() -> Result<CertificateParams> {
        let mut params = CertificateParams::new(Vec::<String>::new())
            .map_err(|e| Failure(format!("CA parameters: {e}")))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "kubernetes");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        Ok(params)
    }

    /// A leaf certificate and key (PEM), server or client, valid for
    /// `days`.
    fn issue(
        &self,
        cn: &str,
        org: Option<&str>,
        dns: &[String],
        ips: &[String],
        server: bool,
        days: i64,
    ) -> Result<(String, String)> {
        let tls = |e: rcgen::Error| Failure(format!("generating certificates: {e}"));
        let mut params = CertificateParams::new(dns.to_vec()).map_err(tls)?;
        for ip in ips {
            if let Ok(ip) = ip.parse() {
                params.subject_alt_names.push(SanType::IpAddress(ip));
            }
        }
        params.distinguished_name.push(DnType::CommonName, cn);
        if let Some(org) = org {
            params
                .distinguished_name
                .push(DnType::OrganizationName, org);
        }
        params.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        self.sign(params, days)
    }

    /// `params` signed for `days` from now, with a new key (PEM).
    fn sign(&self, mut params: CertificateParams, days: i64) -> Result<(String, String)> {
        let tls = |e: rcgen::Error| Failure(format!("generating certificates: {e}"));
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(days);
        let key = KeyPair::generate().map_err(tls)?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).map_err(tls)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}
