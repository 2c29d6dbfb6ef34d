//! A container check for the VM tests: a tiny OCI image built in Rust,
//! imported into a node's containerd with `ctr images import` and run with
//! `ctr run`, and the facts that show where containerd keeps its data.
//!
//! Nothing comes from a registry. The image holds one static x86-64
//! executable of a few hundred bytes ([`hello_elf`]) that writes a message
//! chosen at check time, so its output proves that this very image ran.
//!
//! [`check_node`] runs in the guest, as part of the stand-in kubeadm's
//! preflight (a real kubeadm checks the container runtime there too); it
//! prints the [`ContainerCheck`] as one line after [`REPORT_PREFIX`], which
//! the agent passes on to the console with the rest of kubeadm's output.
//! The host reads it back with [`ContainerCheck::from_lines`] and judges it
//! with [`ContainerCheck::problems`].

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// Precedes the JSON report on its output line.
pub const REPORT_PREFIX: &str = "keel-standin container check: ";
/// The name the test image is imported under.
pub const IMAGE_NAME: &str = "keel.local/container-check:1";
/// The executable in the image.
pub const EXECUTABLE: &str = "keel-hello";
/// containerd's namespace for Kubernetes, where kubelet's images live.
pub const NAMESPACE: &str = "k8s.io";
/// containerd's root (its configuration in the image).
pub const CONTAINERD_ROOT: &str = "/var/lib/containerd";
/// Where the overlayfs snapshotter keeps its snapshots.
pub const SNAPSHOTS: &str = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots";
/// The state disk's mount point on a node.
pub const STATE_MOUNT: &str = "/run/state/disk";
/// The systemd mount unit of [`STATE_MOUNT`].
const STATE_MOUNT_UNIT: &str = "run-state-disk.mount";

/// What the check found on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerCheck {
    /// The runtime's name and server version, as it answered on its socket
    /// (`containerd 1.6.20~ds1`).
    pub runtime: String,
    /// The image imported and run.
    pub image: String,
    /// The message the image's executable was built to print.
    pub expected_output: String,
    /// What the container printed.
    pub output: String,
    /// The unpacked snapshot directory holding the image's executable.
    pub snapshot: String,
    /// Device (`major:minor`) of that directory.
    pub snapshot_device: String,
    /// Device of the metadata database the running containerd has open.
    pub metadata_device: String,
    /// Device of the state disk's mount.
    pub state_device: String,
    /// What is mounted there (`/dev/mapper/keel-state`).
    pub state_source: String,
    /// The device-mapper UUID of that device (`CRYPT-LUKS2-…` for LUKS2).
    pub state_dm_uuid: String,
    /// When systemd saw the state disk mounted (monotonic µs).
    pub state_mounted_us: u64,
    /// When containerd.service became active (monotonic µs).
    pub containerd_active_us: u64,
    /// The executable running the check (the stand-in kubeadm, a
    /// component the agent installed).
    pub running_from: String,
    /// Which of that executable and the other directories components
    /// install into ([`COMPONENT_DIRS`]) are not on a tmpfs (in memory):
    /// none, on a node that runs nothing from a disk.
    pub outside_memory: Vec<String>,
}

/// Directories components install into besides the stand-in's own: the CNI
/// plugins and kubeadm's patches.
pub const COMPONENT_DIRS: [&str; 2] = ["/opt/cni/bin", "/opt/kubernetes/patches"];

impl ContainerCheck {
    /// The last report among console `lines`, if any parses.
    pub fn from_lines<'a>(lines: impl IntoIterator<Item = &'a str>) -> Option<Self> {
        lines
            .into_iter()
            .filter_map(|l| {
                let (_, json) = l.split_once(REPORT_PREFIX)?;
                serde_json::from_str(json.trim()).ok()
            })
            .last()
    }

    /// Everything that falls short: the runtime did not answer, the image
    /// did not print its message, or containerd's data (the image's
    /// snapshot, the database it has open) is not on the LUKS2 state disk,
    /// or containerd became active before the disk was mounted, or the
    /// stand-in running the check or a component directory is not in
    /// memory. Empty when
    /// all holds.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.runtime.starts_with("containerd ") {
            out.push(format!("runtime {:?} is not containerd", self.runtime));
        }
        if self.output.trim_end() != self.expected_output {
            out.push(format!(
                "the container printed {:?}, not {:?}",
                self.output, self.expected_output
            ));
        }
        if !self.snapshot.starts_with(SNAPSHOTS) {
            out.push(format!(
                "snapshot {} is not under {SNAPSHOTS}",
                self.snapshot
            ));
        }
        if !self.state_dm_uuid.starts_with("CRYPT-LUKS2-") {
            out.push(format!(
                "{STATE_MOUNT} is on {} ({:?}), not a LUKS2 mapping",
                self.state_source, self.state_dm_uuid
            ));
        }
        for (what, device) in [
            ("the image's snapshot", &self.snapshot_device),
            ("containerd's open metadata database", &self.metadata_device),
        ] {
            if device != &self.state_device {
                out.push(format!(
                    "{what} is on device {device}, the state disk is {}",
                    self.state_device
                ));
            }
        }
        if !self.outside_memory.is_empty() {
            out.push(format!(
                "not in memory (tmpfs): {}",
                self.outside_memory.join(", ")
            ));
        }
        if self.state_mounted_us == 0 || self.containerd_active_us <= self.state_mounted_us {
            out.push(format!(
                "containerd became active at {} µs, the state disk was mounted at {} µs",
                self.containerd_active_us, self.state_mounted_us
            ));
        }
        out
    }

    /// One line for a summary.
    pub fn describe(&self) -> String {
        format!(
            "{}; image {} ran (printed {:?}); snapshots and metadata on {} ({})",
            self.runtime,
            self.image,
            self.output.trim_end(),
            self.state_source,
            self.state_dm_uuid
                .split('-')
                .take(2)
                .collect::<Vec<_>>()
                .join("-")
        )
    }
}

/// A static x86-64 Linux executable that writes `message` to standard
/// output and exits 0: one ELF header, one loadable segment, 33 bytes of
/// code (`write(1, message, len)`, `exit(0)`), then the message.
pub fn hello_elf(message: &[u8]) -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const HEADERS: u64 = 64 + 56;
    const CODE: usize = 33;
    let len = u32::try_from(message.len()).unwrap_or(u32::MAX);
    let size = HEADERS + CODE as u64 + u64::from(len);
    let mut f = Vec::with_capacity(usize::try_from(size).unwrap_or_default());
    // ELF header: 64-bit, little endian, System V, executable, x86-64.
    f.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    f.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    f.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&(BASE + HEADERS).to_le_bytes()); // entry
    f.extend_from_slice(&64u64.to_le_bytes()); // program headers
    f.extend_from_slice(&0u64.to_le_bytes()); // no section headers
    f.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 1, 64, 0, 0] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    // One PT_LOAD segment, read + execute, the whole file at BASE.
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&5u32.to_le_bytes());
    for v in [0, BASE, BASE, size, size, 0x1000] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    // mov eax, 1; mov edi, 1; lea rsi, [rip + 16]; mov edx, len; syscall
    f.extend_from_slice(&[0xb8, 1, 0, 0, 0, 0xbf, 1, 0, 0, 0]);
    f.extend_from_slice(&[0x48, 0x8d, 0x35, 16, 0, 0, 0]);
    f.push(0xba);
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(&[0x0f, 0x05]);
    // mov eax, 60; xor edi, edi; syscall
    f.extend_from_slice(&[0xb8, 60, 0, 0, 0, 0x31, 0xff, 0x0f, 0x05]);
    f.extend_from_slice(message);
    f
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

fn descriptor(media_type: &str, blob: &[u8]) -> serde_json::Value {
    serde_json::json!({ "mediaType": media_type, "digest": sha256(blob), "size": blob.len() })
}

/// An OCI image layout as a tar archive (what `ctr images import` reads):
/// one uncompressed layer with `files` (`(path, content, mode)`), a config
/// running `entrypoint`, and an index naming the image `name`.
pub fn oci_archive(
    name: &str,
    files: &[(&str, &[u8], u32)],
    entrypoint: &[&str],
) -> std::io::Result<Vec<u8>> {
    let mut layer = tar::Builder::new(Vec::new());
    for (path, content, mode) in files {
        let mut header = tar::Header::new_ustar();
        header.set_path(path)?;
        header.set_mode(*mode);
        header.set_size(content.len() as u64);
        header.set_cksum();
        layer.append(&header, *content)?;
    }
    let layer = layer.into_inner()?;
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Entrypoint": entrypoint },
        "rootfs": { "type": "layers", "diff_ids": [sha256(&layer)] },
    }))?;
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", &config),
        "layers": [descriptor("application/vnd.oci.image.layer.v1.tar", &layer)],
    }))?;
    let mut manifest_descriptor =
        descriptor("application/vnd.oci.image.manifest.v1+json", &manifest);
    manifest_descriptor["platform"] = serde_json::json!({ "architecture": "amd64", "os": "linux" });
    manifest_descriptor["annotations"] = serde_json::json!({
        "io.containerd.image.name": name,
        "org.opencontainers.image.ref.name": name.rsplit(':').next().unwrap_or(name),
    });
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [manifest_descriptor],
    }))?;

    let mut archive = tar::Builder::new(Vec::new());
    let mut add = |path: &str, content: &[u8]| -> std::io::Result<()> {
        let mut header = tar::Header::new_ustar();
        header.set_path(path)?;
        header.set_mode(0o644);
        header.set_size(content.len() as u64);
        header.set_cksum();
        archive.append(&header, content)
    };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json", &index)?;
    for blob in [&layer, &config, &manifest] {
        let digest = sha256(blob);
        let hex = digest.trim_start_matches("sha256:");
        add(&format!("blobs/sha256/{hex}"), blob)?;
    }
    archive.into_inner()
}

/// Runs `program` with `args`; its standard output, or why it failed.
fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {program}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn device_of(path: &Path) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let dev = meta.dev();
    // glibc's major/minor encoding (as the kernel's new_encode_dev).
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    Ok(format!("{major}:{minor}"))
}

/// The `major:minor` and source of the mount at `point` (last one wins).
fn mount_of(point: &str) -> Result<(String, String), String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
    info.lines()
        .rev()
        .find_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let dash = f.iter().position(|x| *x == "-")?;
            (f.get(4) == Some(&point)).then(|| {
                (
                    f.get(2).copied().unwrap_or_default().to_owned(),
                    f.get(dash + 2).copied().unwrap_or_default().to_owned(),
                )
            })
        })
        .ok_or_else(|| format!("{point} is not mounted"))
}

fn monotonic_us(unit: &str) -> Result<u64, String> {
    let out = run(
        "systemctl",
        &[
            "show",
            "-p",
            "ActiveEnterTimestampMonotonic",
            "--value",
            unit,
        ],
    )?;
    out.trim()
        .parse()
        .map_err(|e| format!("{unit}: ActiveEnterTimestampMonotonic {out:?}: {e}"))
}

/// The device of the metadata database the running containerd has open.
fn metadata_device() -> Result<String, String> {
    let pid = run(
        "systemctl",
        &["show", "-p", "MainPID", "--value", "containerd.service"],
    )?;
    let fds = PathBuf::from(format!("/proc/{}/fd", pid.trim()));
    for fd in std::fs::read_dir(&fds).map_err(|e| format!("{}: {e}", fds.display()))? {
        let fd = fd.map_err(|e| e.to_string())?.path();
        if std::fs::read_link(&fd).is_ok_and(|t| t.ends_with("meta.db")) {
            return device_of(&fd);
        }
    }
    Err(format!(
        "containerd (pid {}) has no meta.db open",
        pid.trim()
    ))
}

/// The snapshot directory holding the image's executable with `content`.
fn snapshot_with(content: &[u8]) -> Result<PathBuf, String> {
    let dirs = std::fs::read_dir(SNAPSHOTS).map_err(|e| format!("{SNAPSHOTS}: {e}"))?;
    for dir in dirs.flatten() {
        let fs = dir.path().join("fs");
        if std::fs::read(fs.join(EXECUTABLE)).is_ok_and(|c| c == content) {
            return Ok(fs);
        }
    }
    Err(format!("no snapshot under {SNAPSHOTS} holds /{EXECUTABLE}"))
}

/// The check on a node (as root, containerd running): imports an image
/// built here from `work_dir`, runs it, and collects the facts.
pub fn check_node(work_dir: &Path) -> Result<ContainerCheck, String> {
    // Each `ctr` is a Go program's start, seconds under emulation: the
    // version query runs beside the image's import and run.
    let version = std::thread::spawn(|| run("ctr", &["version"]));
    let nonce: [u8; 8] = rand::random();
    let expected = format!("hello from a keel container {}", hex::encode(nonce));
    let elf = hello_elf(format!("{expected}\n").as_bytes());
    let archive = oci_archive(
        IMAGE_NAME,
        &[(EXECUTABLE, &elf, 0o755)],
        &[&format!("/{EXECUTABLE}")],
    )
    .map_err(|e| format!("building the image: {e}"))?;
    std::fs::create_dir_all(work_dir).map_err(|e| format!("{}: {e}", work_dir.display()))?;
    let tar = work_dir.join("container-check.tar");
    std::fs::File::create(&tar)
        .and_then(|mut f| f.write_all(&archive))
        .map_err(|e| format!("{}: {e}", tar.display()))?;
    let tar_arg = tar.to_string_lossy().into_owned();
    run("ctr", &["-n", NAMESPACE, "images", "import", &tar_arg])?;
    let id = format!("keel-container-check-{}", std::process::id());
    let output = run("ctr", &["-n", NAMESPACE, "run", "--rm", IMAGE_NAME, &id])?;
    let version = version
        .join()
        .map_err(|_| "the `ctr version` thread panicked".to_owned())??;
    let server = version
        .split("Server:")
        .nth(1)
        .and_then(|s| s.lines().find_map(|l| l.trim().strip_prefix("Version:")))
        .map(str::trim)
        .ok_or_else(|| format!("no server version in `ctr version`: {version:?}"))?;

    let snapshot = snapshot_with(&elf)?;
    let running = std::env::current_exe().map_err(|e| format!("the running executable: {e}"))?;
    let mut outside_memory = Vec::new();
    for path in std::iter::once(running.as_path()).chain(COMPONENT_DIRS.iter().map(Path::new)) {
        let on = nix::sys::statfs::statfs(path).map_err(|e| format!("{}: {e}", path.display()))?;
        if on.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC {
            outside_memory.push(path.display().to_string());
        }
    }
    let (state_device, state_source) = mount_of(STATE_MOUNT)?;
    let dm_uuid_path = format!("/sys/dev/block/{state_device}/dm/uuid");
    let state_dm_uuid = std::fs::read_to_string(&dm_uuid_path)
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    Ok(ContainerCheck {
        runtime: format!("containerd {server}"),
        image: IMAGE_NAME.to_owned(),
        expected_output: expected,
        output,
        snapshot_device: device_of(&snapshot)?,
        snapshot: snapshot.to_string_lossy().into_owned(),
        metadata_device: metadata_device()?,
        state_device,
        state_source,
        state_dm_uuid,
        state_mounted_us: monotonic_us(STATE_MOUNT_UNIT)?,
        containerd_active_us: monotonic_us("containerd.service")?,
        running_from: running.to_string_lossy().into_owned(),
        outside_memory,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn the_hello_executable_runs_and_prints_its_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hello");
        std::fs::write(&path, hello_elf(b"hello, 1 2 3\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = Command::new(&path).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(out.stdout, b"hello, 1 2 3\n");
    }

    #[test]
    fn the_archive_is_an_oci_layout_whose_digests_match() {
        let archive = oci_archive("keel.local/x:1", &[("x", b"abc", 0o755)], &["/x"]).unwrap();
        let mut entries = std::collections::BTreeMap::new();
        let mut a = tar::Archive::new(archive.as_slice());
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().to_string_lossy().into_owned();
            let mut content = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut content).unwrap();
            entries.insert(path, content);
        }
        for (path, content) in &entries {
            if let Some(hex) = path.strip_prefix("blobs/sha256/") {
                assert_eq!(sha256(content), format!("sha256:{hex}"));
            }
        }
        let index: serde_json::Value = serde_json::from_slice(&entries["index.json"]).unwrap();
        let m = &index["manifests"][0];
        assert_eq!(
            m["annotations"]["io.containerd.image.name"],
            "keel.local/x:1"
        );
        let digest = m["digest"].as_str().unwrap().trim_start_matches("sha256:");
        let manifest: serde_json::Value =
            serde_json::from_slice(&entries[&format!("blobs/sha256/{digest}")]).unwrap();
        let layer = manifest["layers"][0]["digest"].as_str().unwrap();
        let config = manifest["config"]["digest"].as_str().unwrap();
        let config: serde_json::Value = serde_json::from_slice(
            &entries[&format!("blobs/sha256/{}", config.trim_start_matches("sha256:"))],
        )
        .unwrap();
        assert_eq!(config["rootfs"]["diff_ids"][0], layer);
        assert_eq!(config["config"]["Entrypoint"][0], "/x");
    }

    fn good() -> ContainerCheck {
        ContainerCheck {
            runtime: "containerd 1.6.20~ds1".into(),
            image: IMAGE_NAME.into(),
            expected_output: "hello 1".into(),
            output: "hello 1\n".into(),
            snapshot: format!("{SNAPSHOTS}/1/fs"),
            snapshot_device: "254:0".into(),
            metadata_device: "254:0".into(),
            state_device: "254:0".into(),
            state_source: "/dev/mapper/keel-state".into(),
            state_dm_uuid: "CRYPT-LUKS2-abc-keel-state".into(),
            state_mounted_us: 10,
            containerd_active_us: 20,
            running_from: "/run/state/bin/kubeadm".into(),
            outside_memory: Vec::new(),
        }
    }

    #[test]
    fn a_report_round_trips_through_a_console_line_and_is_judged() {
        let line = format!(
            "[ 1.0] keel-agent[1]: INFO kubeadm: {REPORT_PREFIX}{}",
            serde_json::to_string(&good()).unwrap()
        );
        let parsed = ContainerCheck::from_lines(["noise", line.as_str()]).unwrap();
        assert_eq!(parsed, good());
        assert!(parsed.problems().is_empty(), "{:?}", parsed.problems());

        let mut on_tmpfs = good();
        on_tmpfs.metadata_device = "0:25".into();
        on_tmpfs.containerd_active_us = 5;
        on_tmpfs.state_dm_uuid = String::new();
        on_tmpfs.output = "other".into();
        assert_eq!(on_tmpfs.problems().len(), 4, "{:?}", on_tmpfs.problems());

        let mut on_disk = good();
        on_disk.outside_memory = vec!["/opt/cni/bin".into()];
        let problems = on_disk.problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("not in memory"), "{problems:?}");
    }
}
