//! Installing a whole Kubernetes version from the local mirror, and
//! installing it again.
//!
//! The versions table holds upstream hashes, and upstream cannot be reached
//! from the test environment. The tests therefore install a variant of the
//! real v1.31 entry built by `keel_testkit::components::stand_ins_for`: same
//! upstream URLs (fetched through a mirror rewrite from the local mirror,
//! which serves stand-ins at the upstream paths), same install paths (below a
//! temporary root), and the stand-ins' hashes in place of upstream's. The
//! `data:` control-plane patches are the table's own, hashes included.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;
use std::process::Command;

use keel_installer::{
    Component, InstalledComponent, LogProgress, NoProgress, Outcome, Sha256Digest, Source,
};
use keel_proto::components::Component as WireComponent;
use keel_testkit::components::{self, CNI_PLUGINS};
use keel_testkit::mirror::MirrorServer;
use support::{chain, entries, fast_retries, installer, keeping_installer, mode, KEPT};

const VERSION: &str = "v1.31.13";

/// The v1.31 entry with stand-in hashes, served by `mirror`.
fn v1_31_stand_ins(mirror: &MirrorServer) -> Vec<Component> {
    let entry = keel_installer::resolve("v1.31").unwrap();
    assert_eq!(entry.version().to_string(), VERSION);
    let wire: Vec<WireComponent> = entry.components().iter().map(Into::into).collect();
    components::stand_ins_for(mirror, &wire, VERSION)
        .unwrap()
        .iter()
        .map(|c| Component::try_from(c).unwrap())
        .collect()
}

/// A local mirror serving the v1.31 stand-ins, a temporary root, the list,
/// and an installer below the root that keeps what it installs ([`KEPT`]).
fn keeping_setup() -> (
    MirrorServer,
    tempfile::TempDir,
    Vec<Component>,
    keel_installer::Installer,
) {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    let list = v1_31_stand_ins(&mirror);
    let installer = keeping_installer(root.path(), &mirror, fast_retries());
    (mirror, root, list, installer)
}

/// Runs a stand-in script. Through `sh` rather than exec: exec of a file
/// written moments ago can fail with ETXTBSY while another test thread forks.
fn run(path: &Path) -> String {
    let out = Command::new("/bin/sh").arg(path).output().unwrap();
    assert!(out.status.success(), "{path:?} failed");
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn installs_every_v1_31_component_from_the_mirror() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    let list = v1_31_stand_ins(&mirror);
    let installer = installer(root.path(), Some(&mirror), fast_retries());

    let installed = installer
        .install_all(&list, &LogProgress::default())
        .await
        .unwrap();

    let r = root.path();
    for name in ["kubelet", "kubeadm", "kubectl"] {
        let path = r.join("run/state/bin").join(name);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            components::executable(name, VERSION)
        );
        assert_eq!(mode(&path), 0o755, "{name}");
        assert_eq!(run(&path), format!("{name} {VERSION} (keel stand-in)\n"));
    }
    for plugin in CNI_PLUGINS {
        let path = r.join("opt/cni/bin").join(plugin);
        assert_eq!(mode(&path), 0o755, "{plugin}");
        assert!(run(&path).starts_with(plugin));
    }
    assert_eq!(mode(&r.join("opt/cni/bin")), 0o755);
    assert!(run(&r.join("run/state/bin/crictl")).starts_with("crictl v1.33.0"));
    for (patch, image) in [
        ("kube-apiserver+json.json", "kube-apiserver"),
        (
            "kube-controller-manager+json.json",
            "kube-controller-manager",
        ),
        ("kube-scheduler+json.json", "kube-scheduler"),
        ("etcd+json.json", "etcd"),
    ] {
        let path = r.join("opt/kubernetes/patches").join(patch);
        assert_eq!(mode(&path), 0o644, "{patch}");
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let pinned = json[0]["value"].as_str().unwrap();
        assert!(
            pinned.starts_with(&format!("registry.k8s.io/{image}:")),
            "{pinned}"
        );
        assert!(pinned.contains("@sha256:"), "{pinned}");
    }
    // Five downloads; the data: patches never touched the network.
    assert_eq!(mirror.total_requests(), 5);

    // The measurement records list each component, as listed (upstream URL,
    // hash, install path without the test root), in install order.
    assert_eq!(installed.len(), list.len());
    assert_eq!(list.len(), 9);
    for (record, component) in installed.iter().zip(&list) {
        assert_eq!(record.component(), component);
        let json: serde_json::Value = serde_json::from_slice(&record.measurement_record()).unwrap();
        assert_eq!(
            json["url"],
            keel_installer::component::redact(component.url())
        );
        assert!(!component.url().contains("127.0.0.1"));
        assert_eq!(json["hash"], component.hash().to_string());
        assert_eq!(json["install_path"], component.install_path().as_str());
        assert!(
            json["install_path"].as_str().unwrap().starts_with("/opt/")
                || json["install_path"]
                    .as_str()
                    .unwrap()
                    .starts_with("/run/state/")
        );
        assert_eq!(json["extract"], component.extract());
        let line = record.description();
        assert!(line.contains(component.install_path().as_str()), "{line}");
        assert!(line.contains(&component.hash().to_string()), "{line}");
        assert!(!line.contains('\n'));
        match component.source() {
            Source::Remote(_) => assert!(!matches!(record.outcome(), Outcome::AlreadyPresent)),
            Source::Inline(_) => assert!(matches!(record.outcome(), Outcome::Written { .. })),
        }
    }
    // Field order is fixed: the record is canonical.
    let first = String::from_utf8(installed[2].measurement_record()).unwrap();
    assert!(
        first.starts_with(
            r#"{"url":"https://dl.k8s.io/v1.31.13/bin/linux/amd64/kubelet","hash":"sha256:"#
        ),
        "{first}"
    );
    assert!(
        first.ends_with(r#","install_path":"/run/state/bin/kubelet","extract":false}"#),
        "{first}"
    );
}

#[tokio::test]
async fn a_second_install_is_a_no_op_and_a_changed_file_is_replaced() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    let list = v1_31_stand_ins(&mirror);
    let installer = installer(root.path(), Some(&mirror), fast_retries());
    let first = installer.install_all(&list, &NoProgress).await.unwrap();
    let kubelet = root.path().join("run/state/bin/kubelet");
    let kubelet_path = "/v1.31.13/bin/linux/amd64/kubelet";
    assert_eq!(mirror.requests(kubelet_path), 1);

    // Unchanged files: nothing fetched, the same records.
    let second = installer.install_all(&list, &NoProgress).await.unwrap();
    let records = |v: &[InstalledComponent]| {
        v.iter()
            .map(InstalledComponent::measurement_record)
            .collect::<Vec<_>>()
    };
    assert_eq!(records(&first), records(&second));
    assert_eq!(mirror.requests(kubelet_path), 1);
    for record in &second {
        if !record.component().extract() {
            assert_eq!(
                record.outcome(),
                Outcome::AlreadyPresent,
                "{:?}",
                record.component()
            );
        }
    }
    // Archives are extracted again, cleanly replacing their files, and the
    // single files sharing their directory survive.
    assert_eq!(
        run(&root.path().join("run/state/bin/crictl")),
        "crictl v1.33.0 (keel stand-in)\n"
    );
    assert_eq!(
        run(&kubelet),
        format!("kubelet {VERSION} (keel stand-in)\n")
    );

    // A tampered file with the wrong mode is replaced.
    std::fs::write(&kubelet, b"#!/bin/sh\necho tampered\n").unwrap();
    std::fs::set_permissions(
        &kubelet,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let third = installer.install_all(&list, &NoProgress).await.unwrap();
    assert!(matches!(third[2].outcome(), Outcome::Written { .. }));
    assert_eq!(mirror.requests(kubelet_path), 2);
    assert_eq!(
        std::fs::read(&kubelet).unwrap(),
        components::executable("kubelet", VERSION)
    );
    assert_eq!(mode(&kubelet), 0o755);
    assert_eq!(records(&first), records(&third));
    // A right file with a wrong mode gets its mode back without a download.
    std::fs::set_permissions(
        &kubelet,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    installer.install(&list[2], &NoProgress).await.unwrap();
    assert_eq!(mode(&kubelet), 0o755);
    assert_eq!(mirror.requests(kubelet_path), 2);

    // A symlink to a right copy is neither followed nor its target's mode
    // changed: the file is fetched again in its place.
    let elsewhere = root.path().join("kubelet-elsewhere");
    std::fs::rename(&kubelet, &elsewhere).unwrap();
    std::fs::set_permissions(
        &elsewhere,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    std::os::unix::fs::symlink(&elsewhere, &kubelet).unwrap();
    let fourth = installer.install(&list[2], &NoProgress).await.unwrap();
    assert!(matches!(fourth.outcome(), Outcome::Written { .. }));
    assert_eq!(mirror.requests(kubelet_path), 3);
    assert!(std::fs::symlink_metadata(&kubelet).unwrap().is_file());
    assert_eq!(mode(&elsewhere), 0o600);

    // A FIFO is opened without waiting for a writer and replaced.
    std::fs::remove_file(&kubelet).unwrap();
    let fifo = std::process::Command::new("mkfifo")
        .arg(&kubelet)
        .status()
        .unwrap();
    assert!(fifo.success());
    let fifth = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        installer.install(&list[2], &NoProgress),
    )
    .await
    .expect("the install waited on the FIFO")
    .unwrap();
    assert!(matches!(fifth.outcome(), Outcome::Written { .. }));
    assert_eq!(mirror.requests(kubelet_path), 4);
    assert!(std::fs::symlink_metadata(&kubelet).unwrap().is_file());

    // A UNIX socket, which cannot be opened: replaced too.
    std::fs::remove_file(&kubelet).unwrap();
    let socket = std::os::unix::net::UnixListener::bind(&kubelet).unwrap();
    let sixth = installer.install(&list[2], &NoProgress).await.unwrap();
    assert!(matches!(sixth.outcome(), Outcome::Written { .. }));
    assert_eq!(mirror.requests(kubelet_path), 5);
    assert!(std::fs::symlink_metadata(&kubelet).unwrap().is_file());
    drop(socket);
}

#[tokio::test]
async fn a_kept_archive_is_extracted_without_a_fetch_and_a_wrong_copy_is_fetched_again() {
    let (mirror, root, list, installer) = keeping_setup();
    let r = root.path();
    let kept_dir = r.join(KEPT.trim_start_matches('/'));
    let kept = |c: &Component| kept_dir.join(format!("{}.tgz", c.hash().to_hex()));
    let (cni, crictl) = (&list[0], &list[1]);
    assert!(cni.install_path().as_str().ends_with("/cni/bin") && cni.extract());
    assert!(crictl.extract());
    let kept_hash = |c: &Component| Sha256Digest::of(&std::fs::read(kept(c)).unwrap());
    let outcomes = |v: &[InstalledComponent]| (v[0].outcome(), v[1].outcome());

    // First install: both archives fetched, extracted and kept under their
    // hash, byte for byte what was verified; beside them only the kept
    // single files (the three downloaded executables; the inline patches
    // are not kept).
    let first = installer.install_all(&list, &NoProgress).await.unwrap();
    assert!(matches!(
        outcomes(&first),
        (Outcome::Extracted(_), Outcome::Extracted(_))
    ));
    let fetched = mirror.total_requests();
    let kept_names = entries(&kept_dir);
    assert_eq!(
        kept_names.iter().filter(|n| n.ends_with(".tgz")).count(),
        2,
        "{kept_names:?}"
    );
    assert_eq!(
        kept_names.iter().filter(|n| n.ends_with(".bin")).count(),
        3,
        "{kept_names:?}"
    );
    assert_eq!(kept_names.len(), 5, "{kept_names:?}");
    assert_eq!(kept_hash(cni), cni.hash());
    assert_eq!(kept_hash(crictl), crictl.hash());

    // As after a reboot whose extracted files are gone: extracted again
    // from the kept copies, nothing fetched.
    std::fs::remove_file(r.join("run/state/bin/crictl")).unwrap();
    std::fs::remove_dir_all(r.join("opt/cni/bin")).unwrap();
    let again = installer.install_all(&list, &NoProgress).await.unwrap();
    assert!(matches!(
        outcomes(&again),
        (Outcome::ExtractedKept(_), Outcome::ExtractedKept(_))
    ));
    assert_eq!(mirror.total_requests(), fetched);
    assert_eq!(entries(&r.join("opt/cni/bin")), CNI_PLUGINS);
    assert!(run(&r.join("run/state/bin/crictl")).starts_with("crictl v1.33.0"));
    let records = |v: &[InstalledComponent]| {
        v.iter()
            .map(InstalledComponent::measurement_record)
            .collect::<Vec<_>>()
    };
    assert_eq!(records(&first), records(&again));

    // A copy that is not the archive (another archive moved to its name,
    // or damaged bytes) is never extracted: fetched again and replaced.
    std::fs::copy(kept(crictl), kept(cni)).unwrap();
    std::fs::remove_dir_all(r.join("opt/cni/bin")).unwrap();
    let replaced = installer.install_all(&list, &NoProgress).await.unwrap();
    assert!(matches!(
        outcomes(&replaced),
        (Outcome::Extracted(_), Outcome::ExtractedKept(_))
    ));
    assert_eq!(mirror.total_requests(), fetched + 1);
    assert_eq!(kept_hash(cni), cni.hash());
    assert_eq!(entries(&r.join("opt/cni/bin")), CNI_PLUGINS);
    assert!(!r.join("opt/cni/bin/crictl").exists());

    // Nor is a copy whose unpacking fails in a way that looks like the
    // target's fault (an entry name longer than the file system takes,
    // as a disk filled by a bomb would): the hash says first that it is
    // not the archive, and it is fetched again.
    let mut long_name = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    let mut header = tar::Header::new_gnu();
    header.set_size(1);
    header.set_mode(0o755);
    long_name
        .append_data(&mut header, "n".repeat(300), &b"x"[..])
        .unwrap();
    let long_name = long_name.into_inner().unwrap().finish().unwrap();
    std::fs::write(kept(crictl), long_name).unwrap();
    std::fs::remove_file(r.join("run/state/bin/crictl")).unwrap();
    let refetched = installer.install(crictl, &NoProgress).await.unwrap();
    assert!(matches!(refetched.outcome(), Outcome::Extracted(_)));
    assert_eq!(mirror.total_requests(), fetched + 2);
    assert_eq!(kept_hash(crictl), crictl.hash());
    assert!(run(&r.join("run/state/bin/crictl")).starts_with("crictl v1.33.0"));

    // With the mirror gone the whole version still installs.
    drop(mirror);
    std::fs::remove_dir_all(r.join("opt/cni/bin")).unwrap();
    installer.install_all(&list, &NoProgress).await.unwrap();
    assert_eq!(entries(&r.join("opt/cni/bin")), CNI_PLUGINS);
    // A fault of the target (a file where the directory goes) is the
    // install's error, not a reason to fetch the archive again (which,
    // with the mirror gone, would hide it behind a download error).
    std::fs::remove_dir_all(r.join("opt/cni/bin")).unwrap();
    std::fs::write(r.join("opt/cni/bin"), b"in the way").unwrap();
    let refused = installer.install(cni, &NoProgress).await.unwrap_err();
    assert!(
        chain(&refused).contains("exists and is not a directory"),
        "{}",
        chain(&refused)
    );
    std::fs::remove_file(r.join("opt/cni/bin")).unwrap();

    // Only the listed version's archives stay: a kept archive no longer
    // listed goes, as does an interrupted download; files not named as
    // the installer names them stay.
    let stray = kept_dir.join(format!("{}.tgz", "0".repeat(64)));
    std::fs::write(&stray, b"left by an earlier version").unwrap();
    let part = kept_dir.join(format!(".{}.tgz.a1B2c3.keel-part", "1".repeat(64)));
    std::fs::write(&part, b"half a download").unwrap();
    for other in ["notes", ".notes.a1B2c3.keel-part"] {
        std::fs::write(kept_dir.join(other), b"not the installer's").unwrap();
    }
    let stray_file = kept_dir.join(format!("{}.bin", "2".repeat(64)));
    std::fs::write(&stray_file, b"a kubelet of an earlier version").unwrap();
    let kept_file = |c: &Component| kept_dir.join(format!("{}.bin", c.hash().to_hex()));
    let listed_file = list.iter().find(|c| c.name() == "kubelet").unwrap();
    installer.keep_only_copies_of(&list[1..]).await;
    assert!(!stray.exists() && !part.exists() && !stray_file.exists());
    assert!(!kept(cni).exists());
    assert!(kept(crictl).exists());
    assert!(kept_file(listed_file).exists());
    assert!(kept_dir.join("notes").exists());
    assert!(kept_dir.join(".notes.a1B2c3.keel-part").exists());
}

/// A single file is kept as archives are: after a reboot (its install path
/// in memory, empty) it is copied from the kept copy, hashed as it is
/// copied, with nothing fetched; a copy that is not the file (another
/// file, damaged or truncated bytes, a symlink) is never installed: the
/// file is fetched again and the copy replaced.
#[tokio::test]
async fn a_kept_file_is_copied_without_a_fetch_and_a_wrong_copy_is_fetched_again() {
    let (mirror, root, list, installer) = keeping_setup();
    let r = root.path();
    let kept_dir = r.join(KEPT.trim_start_matches('/'));
    let find = |name: &str| list.iter().find(|c| c.name() == name).unwrap();
    let (kubelet, kubeadm) = (find("kubelet"), find("kubeadm"));
    let kept = |c: &Component| kept_dir.join(format!("{}.bin", c.hash().to_hex()));
    let installed = |c: &Component| c.install_path().under(r);
    let kubelet_path = "/v1.31.13/bin/linux/amd64/kubelet";

    let first = installer.install(kubelet, &NoProgress).await.unwrap();
    assert!(matches!(first.outcome(), Outcome::Written { .. }));
    assert_eq!(mirror.requests(kubelet_path), 1);
    assert_eq!(
        Sha256Digest::of(&std::fs::read(kept(kubelet)).unwrap()),
        kubelet.hash()
    );
    assert_eq!(mode(&kept(kubelet)), 0o644, "a kept copy is not run");

    // As after a reboot: the install path is empty, the kept copy is
    // copied into place with the executable's mode; nothing fetched.
    std::fs::remove_file(installed(kubelet)).unwrap();
    let again = installer.install(kubelet, &NoProgress).await.unwrap();
    assert!(
        matches!(again.outcome(), Outcome::CopiedKept { .. }),
        "{:?}",
        again.outcome()
    );
    assert_eq!(mirror.requests(kubelet_path), 1);
    assert_eq!(mode(&installed(kubelet)), 0o755);
    assert_eq!(
        Sha256Digest::of(&std::fs::read(installed(kubelet)).unwrap()),
        kubelet.hash()
    );
    assert_eq!(first.measurement_record(), again.measurement_record());

    // Not the file: another component's copy under its name, the file
    // with a byte changed, the file cut short, a symlink to the file.
    // Each time the file is fetched again, and what is installed and
    // kept is the file.
    let wrong: [&dyn Fn(&Path); 4] = [
        &|at| {
            std::fs::copy(kept(kubeadm), at).unwrap();
        },
        &|at| {
            let mut bytes = std::fs::read(at).unwrap();
            bytes[0] ^= 1;
            std::fs::write(at, bytes).unwrap();
        },
        &|at| {
            let bytes = std::fs::read(at).unwrap();
            std::fs::write(at, &bytes[..bytes.len() / 2]).unwrap();
        },
        &|at| {
            let elsewhere = r.join("elsewhere.bin");
            std::fs::rename(at, &elsewhere).unwrap();
            std::os::unix::fs::symlink(&elsewhere, at).unwrap();
        },
    ];
    installer.install(kubeadm, &NoProgress).await.unwrap();
    for (fetches, damage) in (2..).zip(wrong) {
        damage(&kept(kubelet));
        std::fs::remove_file(installed(kubelet)).unwrap();
        let refetched = installer.install(kubelet, &NoProgress).await.unwrap();
        assert!(matches!(refetched.outcome(), Outcome::Written { .. }));
        assert_eq!(mirror.requests(kubelet_path), fetches);
        assert_eq!(
            Sha256Digest::of(&std::fs::read(installed(kubelet)).unwrap()),
            kubelet.hash()
        );
        assert!(std::fs::symlink_metadata(kept(kubelet)).unwrap().is_file());
        assert_eq!(
            Sha256Digest::of(&std::fs::read(kept(kubelet)).unwrap()),
            kubelet.hash()
        );
    }

    // With the mirror gone, the kept copy still installs the file.
    drop(mirror);
    std::fs::remove_file(installed(kubelet)).unwrap();
    let offline = installer.install(kubelet, &NoProgress).await.unwrap();
    assert!(matches!(offline.outcome(), Outcome::CopiedKept { .. }));
    assert!(run(&installed(kubelet)).starts_with("kubelet v1.31.13"));
    // No temporary file is left beside the install path or the copies.
    for dir in [installed(kubelet).parent().unwrap(), &kept_dir] {
        assert!(
            !entries(dir).iter().any(|n| n.ends_with(".keel-part")),
            "{:?}",
            entries(dir)
        );
    }
}

/// Attacker's move: whoever can write the state disk (the host, were the
/// disk not encrypted; root on the node) makes a kept file larger than a
/// download may be, so that each boot copies it whole into memory before
/// its hash is checked. A kept file is read no further than that limit:
/// one larger is a miss, nothing of it is left beside the install path,
/// and the file is fetched again and kept in its place. Even the genuine
/// file, kept, is not copied once the limit is below its size.
#[tokio::test]
async fn a_kept_file_larger_than_the_limit_is_refused() {
    const LIMIT: u64 = 1 << 20;
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let list = v1_31_stand_ins(&mirror);
    let kubelet = list.iter().find(|c| c.name() == "kubelet").unwrap();
    let kubelet_path = "/v1.31.13/bin/linux/amd64/kubelet";
    let kept = support::kept_copy(r, kubelet, "bin");
    let installed = kubelet.install_path().under(r);
    let limited = |max_bytes| support::keeping_installer_limited(r, &mirror, max_bytes);
    limited(LIMIT).install(kubelet, &NoProgress).await.unwrap();
    assert_eq!(mirror.requests(kubelet_path), 1);
    let genuine = std::fs::read(&kept).unwrap();

    // Grown past the limit: fetched again, and the copy replaced.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&kept)
        .unwrap()
        .set_len(LIMIT + 1)
        .unwrap();
    std::fs::remove_file(&installed).unwrap();
    let refetched = limited(LIMIT).install(kubelet, &NoProgress).await.unwrap();
    assert!(
        matches!(refetched.outcome(), Outcome::Written { .. }),
        "{:?}",
        refetched.outcome()
    );
    assert_eq!(mirror.requests(kubelet_path), 2);
    assert_eq!(std::fs::read(&installed).unwrap(), genuine);
    assert_eq!(std::fs::read(&kept).unwrap(), genuine);

    // The genuine copy, with a limit below its size: not copied; the
    // download is refused as too large, and nothing is installed.
    std::fs::remove_file(&installed).unwrap();
    let size = u64::try_from(genuine.len()).unwrap();
    let refused = limited(size - 1)
        .install(kubelet, &NoProgress)
        .await
        .unwrap_err();
    assert_download_too_large(&refused);
    assert_eq!(mirror.requests(kubelet_path), 3);
    support::assert_nothing_installed(&installed);
    assert_eq!(std::fs::read(&kept).unwrap(), genuine);
}

#[tokio::test]
async fn a_kept_archive_larger_than_the_limit_is_a_miss() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let list = v1_31_stand_ins(&mirror);
    let cni = &list[0];
    assert!(cni.install_path().as_str().ends_with("/cni/bin") && cni.extract());
    let Source::Remote(url) = cni.source() else {
        panic!("the CNI archive is fetched");
    };
    let cni_path = url.path();
    let kept = support::kept_copy(r, cni, "tgz");
    let installed = cni.install_path().under(r);
    let limited = |max_bytes| support::keeping_installer_limited(r, &mirror, max_bytes);
    limited(keel_installer::download::DEFAULT_MAX_BYTES)
        .install(cni, &NoProgress)
        .await
        .unwrap();
    assert_eq!(mirror.requests(cni_path), 1);
    let genuine = std::fs::read(&kept).unwrap();
    let size = u64::try_from(genuine.len()).unwrap();

    // The genuine copy, with a limit below its size: not extracted; the
    // archive is fetched again, the download refused as too large, and
    // nothing is installed.
    std::fs::remove_dir_all(&installed).unwrap();
    let refused = limited(size - 1)
        .install(cni, &NoProgress)
        .await
        .unwrap_err();
    assert_download_too_large(&refused);
    assert_eq!(mirror.requests(cni_path), 2);
    support::assert_nothing_installed(&installed);
    assert_eq!(std::fs::read(&kept).unwrap(), genuine);
}

/// Where a download's bytes are while it runs: the part files in the
/// install directory and in the kept components' directory at each report.
struct PartFiles {
    install_dir: std::path::PathBuf,
    kept_dir: std::path::PathBuf,
    seen: std::sync::Mutex<Vec<(Vec<String>, Vec<String>)>>,
}

impl PartFiles {
    fn new(install_dir: &Path, kept_dir: &Path) -> Self {
        Self {
            install_dir: install_dir.to_owned(),
            kept_dir: kept_dir.to_owned(),
            seen: std::sync::Mutex::default(),
        }
    }

    /// Every report: (part files beside the install path, in the kept
    /// directory).
    fn seen(&self) -> Vec<(Vec<String>, Vec<String>)> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

impl keel_installer::Progress for PartFiles {
    fn advanced(&self, _: &str, _: u64, _: Option<u64>) {
        let parts = |dir: &Path| -> Vec<String> {
            entries(dir)
                .into_iter()
                .filter(|n| n.ends_with(".keel-part"))
                .collect()
        };
        let seen = (parts(&self.install_dir), parts(&self.kept_dir));
        self.seen.lock().unwrap().push(seen);
    }
}

/// Attacker's move: a hostile mirror (or whoever answers for it) sends the
/// most bytes a download may take, of another hash, for a single-file
/// component, as an upgrade fetches the next version while the running one
/// fills the same memory. The bytes go to the kept components' directory
/// (the state disk on a node), and reach the install directory (memory on
/// a node) only once their hash matched: while a download runs, its part
/// file is in the kept directory and none is beside the install path. A
/// kept path that cannot take the file (a directory there) does not
/// change that: the file is installed from the download, fetched once, and
/// not kept.
#[tokio::test]
async fn a_file_is_fetched_onto_the_disk_and_reaches_memory_verified() {
    let (mirror, root, list, installer) = keeping_setup();
    let r = root.path();
    let kept_dir = r.join(KEPT.trim_start_matches('/'));
    let kubelet = list.iter().find(|c| c.name() == "kubelet").unwrap();
    let installed = kubelet.install_path().under(r);
    let kept = kept_dir.join(format!("{}.bin", kubelet.hash().to_hex()));
    let kubelet_path = "/v1.31.13/bin/linux/amd64/kubelet";
    let watch = PartFiles::new(installed.parent().unwrap(), &kept_dir);

    let first = installer.install(kubelet, &watch).await.unwrap();
    assert!(matches!(first.outcome(), Outcome::Written { .. }));
    let seen = watch.seen();
    assert!(!seen.is_empty());
    for (beside_install_path, in_kept_dir) in &seen {
        assert!(beside_install_path.is_empty(), "{seen:?}");
        assert_eq!(in_kept_dir.len(), 1, "{seen:?}");
    }
    for file in [&installed, &kept] {
        assert_eq!(
            Sha256Digest::of(&std::fs::read(file).unwrap()),
            kubelet.hash()
        );
    }
    assert_eq!(mode(&installed), 0o755);

    let genuine = std::fs::read(&installed).unwrap();
    std::fs::remove_file(&installed).unwrap();
    std::fs::remove_file(&kept).unwrap();
    mirror.serve(kubelet_path, vec![0x5a; 4 << 20]);
    let refused = installer.install(kubelet, &watch).await.unwrap_err();
    assert!(
        chain(&refused).contains("hash mismatch"),
        "{}",
        chain(&refused)
    );
    let seen = watch.seen();
    assert!(!seen.is_empty());
    for (beside_install_path, in_kept_dir) in &seen {
        assert!(beside_install_path.is_empty(), "{seen:?}");
        assert_eq!(in_kept_dir.len(), 1, "{seen:?}");
    }
    assert!(!installed.exists());
    assert!(!kept.exists());
    for dir in [installed.parent().unwrap(), &kept_dir] {
        assert!(
            !entries(dir).iter().any(|n| n.ends_with(".keel-part")),
            "{:?}",
            entries(dir)
        );
    }

    // A directory at the kept path.
    mirror.serve(kubelet_path, genuine);
    std::fs::create_dir_all(kept.join("in-the-way")).unwrap();
    let fetches = mirror.requests(kubelet_path);
    let unkept = installer.install(kubelet, &watch).await.unwrap();
    assert!(matches!(unkept.outcome(), Outcome::Written { .. }));
    assert_eq!(mirror.requests(kubelet_path), fetches + 1);
    let seen = watch.seen();
    assert!(!seen.is_empty());
    assert!(
        seen.iter()
            .all(|(beside, kept)| beside.is_empty() && kept.len() == 1),
        "{seen:?}"
    );
    assert_eq!(
        Sha256Digest::of(&std::fs::read(&installed).unwrap()),
        kubelet.hash()
    );
    assert!(kept.is_dir());
    assert!(
        !entries(&kept_dir).iter().any(|n| n.ends_with(".keel-part")),
        "{:?}",
        entries(&kept_dir)
    );
}

/// Overwrites each download's part file in the kept components'
/// directory, keeping its length, as the download is reported finished:
/// after its hash matched and before the installer reads it back.
struct ChangeOnDisk {
    kept_dir: std::path::PathBuf,
    changed: std::sync::atomic::AtomicUsize,
}

impl keel_installer::Progress for ChangeOnDisk {
    fn finished(&self, _: &str, _: u64, _: std::time::Duration) {
        for name in entries(&self.kept_dir) {
            if name.ends_with(".keel-part") {
                let path = self.kept_dir.join(name);
                let len = std::fs::metadata(&path).unwrap().len();
                std::fs::write(&path, vec![0x5a; usize::try_from(len).unwrap()]).unwrap();
                self.changed
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }
}

/// Attacker's move: whoever can write the state disk (the host, were the
/// disk not encrypted; a bug in the node) changes a download there after
/// its hash matched, for the changed bytes to reach memory. The installer
/// reads the download back hashing it again, and refuses it: a single file
/// with `ChangedOnDisk` naming its install path, an archive with a hash
/// mismatch; nothing is installed or kept.
#[tokio::test]
async fn the_download_is_read_back_from_the_disk_with_its_hash() {
    let (_mirror, root, list, installer) = keeping_setup();
    let r = root.path();
    let kept_dir = r.join(KEPT.trim_start_matches('/'));
    let tamper = ChangeOnDisk {
        kept_dir: kept_dir.clone(),
        changed: std::sync::atomic::AtomicUsize::new(0),
    };
    let kubelet = list.iter().find(|c| c.name() == "kubelet").unwrap();
    let crictl = &list[1];
    assert!(crictl.extract());
    for component in [crictl, kubelet] {
        let name = component.name();
        let refused = installer.install(component, &tamper).await.unwrap_err();
        if component.extract() {
            assert!(
                matches!(&refused, keel_installer::InstallError::Extract { .. })
                    && chain(&refused).contains("not the expected"),
                "{}",
                chain(&refused)
            );
        } else {
            assert!(
                matches!(
                    &refused,
                    keel_installer::InstallError::ChangedOnDisk { path }
                        if path == component.install_path()
                ),
                "{}",
                chain(&refused)
            );
        }
        support::assert_nothing_installed(&component.install_path().under(r));
        assert_eq!(entries(&kept_dir), Vec::<String>::new(), "{name}");
    }
    assert_eq!(tamper.changed.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// What is at a kept archive's path is never a reason to fail: the
/// archive is fetched (and kept where it can be).
#[tokio::test]
async fn whatever_is_at_the_kept_path_the_archive_installs() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let list = v1_31_stand_ins(&mirror);
    let crictl = &list[1];
    let installer = keeping_installer(r, &mirror, fast_retries());
    let kept_dir = r.join(KEPT.trim_start_matches('/'));
    let kept = kept_dir.join(format!("{}.tgz", crictl.hash().to_hex()));
    std::fs::create_dir_all(&kept_dir).unwrap();
    let elsewhere = r.join("elsewhere.tgz");
    let mut fetched = mirror.total_requests();

    // A symlink to the very archive: not followed, replaced by a copy.
    installer.install(crictl, &NoProgress).await.unwrap();
    fetched += 1;
    std::fs::rename(&kept, &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &kept).unwrap();
    let installed = installer.install(crictl, &NoProgress).await.unwrap();
    assert!(matches!(installed.outcome(), Outcome::Extracted(_)));
    fetched += 1;
    assert_eq!(mirror.total_requests(), fetched);
    assert!(std::fs::symlink_metadata(&kept).unwrap().is_file());

    // A FIFO: opened without blocking, not read.
    std::fs::remove_file(&kept).unwrap();
    let fifo = std::process::Command::new("mkfifo")
        .arg(&kept)
        .status()
        .unwrap();
    assert!(fifo.success());
    // Were the open to block, a writer after the timeout below releases
    // it, so that the test fails instead of hanging.
    let release = kept.clone();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(25));
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(release);
    });
    let installed = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        installer.install(crictl, &NoProgress),
    )
    .await
    .expect("blocked on the FIFO")
    .unwrap();
    assert!(matches!(installed.outcome(), Outcome::Extracted(_)));
    assert!(std::fs::symlink_metadata(&kept).unwrap().is_file());

    // A directory there cannot be replaced: installed, not kept.
    std::fs::remove_file(&kept).unwrap();
    std::fs::create_dir(&kept).unwrap();
    let installed = installer.install(crictl, &NoProgress).await.unwrap();
    assert!(matches!(installed.outcome(), Outcome::Extracted(_)));
    assert!(kept.is_dir());
}

/// A kept components' directory that cannot be made (a file in the way)
/// fails the install before anything is fetched, for an archive and a
/// single file alike: fetching beside the install path instead would put
/// what a mirror sends in memory.
#[tokio::test]
async fn a_kept_directory_that_cannot_be_made_fails_the_install() {
    let (mirror, root, list, installer) = keeping_setup();
    let r = root.path();
    let kept_dir = r.join(KEPT.trim_start_matches('/'));
    std::fs::create_dir_all(kept_dir.parent().unwrap()).unwrap();
    std::fs::write(&kept_dir, b"in the way").unwrap();
    let kubelet = list.iter().find(|c| c.name() == "kubelet").unwrap();
    let crictl = &list[1];
    assert!(crictl.extract());
    // crictl's directory first: kubelet's install makes it (its parent).
    for component in [crictl, kubelet] {
        let dest = component.install_path().under(r);
        let refused = installer.install(component, &NoProgress).await.unwrap_err();
        assert!(
            matches!(
                &refused,
                keel_installer::InstallError::KeptDir { path, .. } if *path == kept_dir
            ),
            "{}",
            chain(&refused)
        );
        assert!(!dest.exists(), "{}", dest.display());
        assert_eq!(mirror.total_requests(), 0);
    }
}

#[tokio::test]
async fn installs_the_stand_in_set_under_a_root_without_a_mirror_rewrite() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    let wire = components::stand_in_set(&mirror, root.path(), VERSION).unwrap();
    let list: Vec<Component> = wire
        .iter()
        .map(|c| Component::try_from(c).unwrap())
        .collect();
    let installer = installer(Path::new("/"), None, fast_retries());
    let installed = installer.install_all(&list, &NoProgress).await.unwrap();
    assert_eq!(installed.len(), 5);
    assert_eq!(
        run(&root.path().join("run/state/bin/kubeadm")),
        format!("kubeadm {VERSION} (keel stand-in)\n")
    );
    assert_eq!(
        support::entries(&root.path().join("opt/cni/bin")),
        CNI_PLUGINS
    );
}

/// `refused` is the download refused as larger than its limit.
fn assert_download_too_large(refused: &keel_installer::InstallError) {
    assert!(
        matches!(
            refused,
            keel_installer::InstallError::Download { source, .. }
                if matches!(**source, keel_installer::DownloadError::TooLarge { .. })
        ),
        "{}",
        chain(refused)
    );
}
