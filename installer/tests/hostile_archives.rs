//! Archives that try to escape their install directory, or hold entries that
//! have no place in a component, are refused whole: nothing is installed and
//! nothing is written outside. The hostile entries are written with the tar
//! crate's low-level header API, so they really are in the archive bytes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Write as _;
use std::path::{Path, PathBuf};

use keel_installer::extract::ExtractSummary;
use keel_installer::{
    Component, ExtractError, ExtractLimits, InstallError, InstalledComponent, Installer,
    InstallerConfig, NoProgress, Outcome,
};
use keel_testkit::components::sha256;
use keel_testkit::mirror::MirrorServer;
use support::{assert_nothing_installed, chain, entries, fast_retries, installer, mode};
use tar::EntryType;

const ARCHIVE: &str = "/cni-plugins-linux-amd64.tgz";
const TARGET: &str = "/opt/cni/bin";

/// One archive entry, written byte for byte.
struct Entry {
    name: Vec<u8>,
    kind: EntryType,
    data: Vec<u8>,
    link: Option<Vec<u8>>,
    mode: u32,
}

fn file(name: &str, data: &[u8]) -> Entry {
    Entry {
        name: name.into(),
        kind: EntryType::Regular,
        data: data.to_vec(),
        link: None,
        mode: 0o755,
    }
}

fn dir(name: &str) -> Entry {
    Entry {
        name: name.into(),
        kind: EntryType::Directory,
        data: Vec::new(),
        link: None,
        mode: 0o755,
    }
}

fn link(kind: EntryType, name: &str, target: &str) -> Entry {
    Entry {
        name: name.into(),
        kind,
        data: Vec::new(),
        link: Some(target.into()),
        mode: 0o777,
    }
}

fn special(kind: EntryType, name: &str) -> Entry {
    Entry {
        name: name.into(),
        kind,
        data: Vec::new(),
        link: None,
        mode: 0o644,
    }
}

/// A .tgz of `entries`, names and link targets copied into the header
/// fields as they are (no path checks, unlike `Header::set_path`).
fn tgz(entries: &[Entry]) -> Vec<u8> {
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    for e in entries {
        let mut header = tar::Header::new_gnu();
        {
            let raw = header.as_old_mut();
            raw.name[..e.name.len()].copy_from_slice(&e.name);
            if let Some(target) = &e.link {
                raw.linkname[..target.len()].copy_from_slice(target);
            }
        }
        header.set_entry_type(e.kind);
        header.set_size(e.data.len() as u64);
        header.set_mode(e.mode);
        if matches!(e.kind, EntryType::Char | EntryType::Block) {
            header.set_device_major(1).unwrap();
            header.set_device_minor(3).unwrap();
        }
        header.set_cksum();
        builder.append(&header, e.data.as_slice()).unwrap();
    }
    let mut gz = builder.into_inner().unwrap();
    gz.flush().unwrap();
    gz.finish().unwrap()
}

/// A test root, the mirror serving `archive`, and the install result.
struct Attempt {
    root: tempfile::TempDir,
    _mirror: MirrorServer,
    result: Result<InstalledComponent, InstallError>,
}

impl Attempt {
    fn target(&self) -> PathBuf {
        self.root.path().join("opt/cni/bin")
    }

    fn extract_error(&self) -> &ExtractError {
        match &self.result {
            Err(InstallError::Extract { source, .. }) => source,
            Err(other) => panic!("expected an extraction error, got {}", chain(other)),
            Ok(done) => panic!("expected an extraction error, got {:?}", done.outcome()),
        }
    }

    fn message(&self) -> String {
        match &self.result {
            Err(e) => chain(e),
            Ok(_) => String::from("<installed>"),
        }
    }

    /// The install failed with nothing in place and nothing left over.
    fn assert_refused(&self) {
        let _ = self.extract_error();
        assert_nothing_installed(&self.target());
    }
}

async fn install_with(
    bytes: Vec<u8>,
    root: tempfile::TempDir,
    installer: impl FnOnce(&Path, &MirrorServer) -> Installer,
) -> Attempt {
    let mirror = MirrorServer::start().unwrap();
    let hash = sha256(&bytes);
    mirror.serve(ARCHIVE, bytes);
    let component = Component::new(&mirror.url(ARCHIVE), &hash, TARGET, true).unwrap();
    let installer = installer(root.path(), &mirror);
    let result = installer.install(&component, &NoProgress).await;
    Attempt {
        root,
        _mirror: mirror,
        result,
    }
}

async fn install(bytes: Vec<u8>) -> Attempt {
    install_with(bytes, tempfile::tempdir().unwrap(), |root, _| {
        installer(root, None, fast_retries())
    })
    .await
}

#[tokio::test]
async fn refuses_a_parent_directory_entry() {
    let a = install(tgz(&[file("./bridge", b"ok"), file("../x", b"escaped")])).await;
    a.assert_refused();
    assert!(matches!(a.extract_error(), ExtractError::EntryPath { .. }));
    assert!(
        a.message()
            .contains(r#"archive entry "../x" contains "..""#),
        "{}",
        a.message()
    );
    assert!(!a.root.path().join("opt/cni/x").exists());
    assert_eq!(
        entries(&a.root.path().join("opt/cni")),
        Vec::<String>::new()
    );
}

#[tokio::test]
async fn refuses_an_absolute_entry() {
    let existed = Path::new("/etc/x").exists();
    let a = install(tgz(&[file("/etc/x", b"escaped")])).await;
    a.assert_refused();
    assert!(
        a.message()
            .contains(r#"archive entry "/etc/x" is absolute"#),
        "{}",
        a.message()
    );
    if !existed {
        assert!(!Path::new("/etc/x").exists());
    }
}

#[tokio::test]
async fn refuses_a_symlink_to_root_and_a_file_through_it() {
    let outside = tempfile::tempdir().unwrap();
    let through = format!(
        "evil/{}/pwned",
        outside.path().to_str().unwrap().trim_start_matches('/')
    );
    let a = install(tgz(&[
        link(EntryType::Symlink, "evil", "/"),
        file(&through, b"escaped"),
    ]))
    .await;
    a.assert_refused();
    assert!(matches!(
        a.extract_error(),
        ExtractError::SymlinkTarget { .. }
    ));
    assert!(
        a.message()
            .contains(r#"archive symlink "evil" -> "/" points to an absolute path"#),
        "{}",
        a.message()
    );
    assert_eq!(entries(outside.path()), Vec::<String>::new());
}

#[tokio::test]
async fn refuses_a_file_written_through_a_contained_symlink() {
    let a = install(tgz(&[
        dir("d/"),
        link(EntryType::Symlink, "l", "d"),
        file("l/x", b"x"),
    ]))
    .await;
    a.assert_refused();
    assert!(
        matches!(a.extract_error(), ExtractError::ThroughSymlink(_)),
        "{}",
        a.message()
    );
}

#[tokio::test]
async fn refuses_device_nodes_fifos_and_hard_links() {
    for (entry, kind) in [
        (special(EntryType::Char, "null"), "character device"),
        (special(EntryType::Block, "sda"), "block device"),
        (special(EntryType::Fifo, "pipe"), "fifo"),
        (link(EntryType::Link, "passwd", "/etc/passwd"), "hard link"),
        (link(EntryType::Link, "again", "bridge"), "hard link"),
    ] {
        let a = install(tgz(&[file("bridge", b"ok"), entry])).await;
        a.assert_refused();
        assert!(matches!(a.extract_error(), ExtractError::EntryType { .. }));
        assert!(
            a.message().contains(&format!("is a {kind}")),
            "{}",
            a.message()
        );
    }
}

#[tokio::test]
async fn refuses_symlinks_that_leave_the_directory() {
    for entries in [
        vec![link(EntryType::Symlink, "up", "../../..")],
        vec![dir("a/"), link(EntryType::Symlink, "a/up", "../..")],
        // Reads as "x" but resolves through x/d (the root) to its parent.
        vec![
            dir("x/"),
            link(EntryType::Symlink, "x/d", ".."),
            link(EntryType::Symlink, "e", "x/d/.."),
        ],
        // A chain of links back out.
        vec![
            link(EntryType::Symlink, "a", "b"),
            link(EntryType::Symlink, "b", ".."),
            dir("c/"),
            link(EntryType::Symlink, "c/e", "../a/x"),
        ],
        // Dangling: nothing in the archive to point at.
        vec![link(EntryType::Symlink, "l", "missing")],
        // A loop.
        vec![
            link(EntryType::Symlink, "p", "q"),
            link(EntryType::Symlink, "q", "p"),
        ],
    ] {
        let a = install(tgz(&entries)).await;
        a.assert_refused();
        assert!(
            matches!(a.extract_error(), ExtractError::SymlinkTarget { .. }),
            "{}",
            a.message()
        );
    }
}

#[tokio::test]
async fn refuses_duplicates_and_files_beneath_files() {
    let a = install(tgz(&[file("bridge", b"1"), file("./bridge", b"2")])).await;
    a.assert_refused();
    assert!(
        matches!(a.extract_error(), ExtractError::Duplicate(_)),
        "{}",
        a.message()
    );
    let a = install(tgz(&[file("bridge", b"1"), file("bridge/x", b"2")])).await;
    a.assert_refused();
    assert!(
        matches!(a.extract_error(), ExtractError::ThroughFile(_)),
        "{}",
        a.message()
    );
}

#[tokio::test]
async fn refuses_garbage_and_bombs() {
    let a = install(b"not a gzip stream".to_vec()).await;
    a.assert_refused();
    assert!(
        matches!(a.extract_error(), ExtractError::ReadArchive(_)),
        "{}",
        a.message()
    );

    let bomb = tgz(&[file("zeros", &vec![0u8; 1024 * 1024])]);
    assert!(bomb.len() < 16 * 1024);
    let a = install_with(bomb, tempfile::tempdir().unwrap(), |root, _| {
        Installer::new(InstallerConfig {
            extract: ExtractLimits {
                max_unpacked_bytes: 64 * 1024,
                max_entries: 10,
            },
            root: root.to_path_buf(),
            ..InstallerConfig::default()
        })
        .unwrap()
    })
    .await;
    a.assert_refused();
    assert!(
        matches!(a.extract_error(), ExtractError::TooLarge(65536)),
        "{}",
        a.message()
    );
}

#[tokio::test]
async fn extracts_files_directories_and_contained_symlinks() {
    let a = install(tgz(&[
        dir("./"),
        dir("./lib/"),
        file("./lib/tool", b"#!/bin/sh\n"),
        Entry {
            mode: 0o644,
            ..file("./lib/README", b"doc")
        },
        Entry {
            mode: 0o4777,
            ..file("./lib/setuid", b"x")
        },
        link(EntryType::Symlink, "./tool", "lib/tool"),
        dir("bin/"),
        link(EntryType::Symlink, "bin/tool", "../lib/tool"),
        link(EntryType::Symlink, "libdir", "./lib"),
    ]))
    .await;
    let done = a.result.as_ref().unwrap();
    assert_eq!(
        done.outcome(),
        Outcome::Extracted(ExtractSummary {
            files: 3,
            directories: 2,
            symlinks: 3,
            bytes: 14
        })
    );
    let t = a.target();
    assert_eq!(entries(&t), ["bin", "lib", "libdir", "tool"]);
    assert_eq!(mode(&t), 0o755);
    assert_eq!(mode(&t.join("lib/tool")), 0o755);
    assert_eq!(mode(&t.join("lib/README")), 0o644);
    assert_eq!(
        mode(&t.join("lib/setuid")),
        0o755,
        "no setuid bit from an archive"
    );
    assert_eq!(
        std::fs::read_link(t.join("bin/tool")).unwrap(),
        Path::new("../lib/tool")
    );
    assert_eq!(std::fs::read(t.join("bin/tool")).unwrap(), b"#!/bin/sh\n");
    assert_eq!(
        entries(&a.root.path().join("opt/cni")),
        ["bin"],
        "no staging directory left"
    );
}

#[tokio::test]
async fn merges_into_an_existing_directory() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("opt/cni/bin");
    std::fs::create_dir_all(&target).unwrap();
    std::fs::write(target.join("kubelet"), b"kept").unwrap();
    std::fs::write(target.join("bridge"), b"old").unwrap();
    std::os::unix::fs::symlink("/etc", target.join("loopback")).unwrap();

    let a = install_with(
        tgz(&[file("bridge", b"new"), file("loopback", b"plugin")]),
        root,
        |root, _| installer(root, None, fast_retries()),
    )
    .await;

    a.result.as_ref().unwrap();
    assert_eq!(std::fs::read(target.join("kubelet")).unwrap(), b"kept");
    assert_eq!(std::fs::read(target.join("bridge")).unwrap(), b"new");
    // The old symlink was replaced, not followed.
    assert!(std::fs::symlink_metadata(target.join("loopback"))
        .unwrap()
        .is_file());
    assert_eq!(std::fs::read(target.join("loopback")).unwrap(), b"plugin");
    assert!(!Path::new("/etc/plugin").exists());
    assert_eq!(entries(&target), ["bridge", "kubelet", "loopback"]);
    assert_eq!(entries(&a.root.path().join("opt/cni")), ["bin"]);
}
