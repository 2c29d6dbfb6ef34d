//! Archives that try to escape their install directory, hold entries that
//! have no place in a component, or carry oversized or ambiguous metadata
//! (GNU long names and links, PAX headers) are refused whole: nothing is
//! installed and nothing is written outside. The hostile entries are written
//! with the tar crate's low-level header API, so they really are in the
//! archive bytes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{self, Read, Write as _};
use std::path::{Path, PathBuf};

use keel_installer::extract::{ExtractSummary, MetadataRecord};
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

/// A metadata record (GNU long name or link, PAX header) holding `data`.
fn meta(kind: EntryType, data: &[u8]) -> Entry {
    Entry {
        name: b"././@LongLink".to_vec(),
        kind,
        data: data.to_vec(),
        link: None,
        mode: 0o644,
    }
}

/// `name` with the closing NUL a GNU long-name or long-link record holds.
fn nul_terminated(name: &[u8]) -> Vec<u8> {
    [name, b"\0"].concat()
}

/// The body of a PAX header: a `"<length> <key>=<value>\n"` record per
/// pair, the length counting the whole record.
fn pax(pairs: &[(&str, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (key, value) in pairs {
        let rest = key.len() + value.len() + 3; // " ", "=", "\n"
        let mut length = rest + 1;
        while length != rest + length.to_string().len() {
            length += 1;
        }
        body.extend_from_slice(format!("{length} {key}=").as_bytes());
        body.extend_from_slice(value);
        body.push(b'\n');
    }
    body
}

/// A .tgz of `entries`, names and link targets copied into the header
/// fields as they are (no path checks, unlike `Header::set_path`).
fn tgz(entries: &[Entry]) -> Vec<u8> {
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    append_entries(&mut builder, entries);
    finish(builder)
}

/// A .tgz starting with a metadata record of `kind` whose header gives
/// `size` bytes and whose body is `body` (streamed through the compressor,
/// never held in memory whole), followed by `entries`.
fn tgz_with_record(kind: EntryType, size: u64, mut body: impl Read, entries: &[Entry]) -> Vec<u8> {
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::best(),
    ));
    let mut header = tar::Header::new_gnu();
    header.as_old_mut().name[..13].copy_from_slice(b"././@LongLink");
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(0o644);
    header.set_cksum();
    builder.append(&header, &mut body).unwrap();
    append_entries(&mut builder, entries);
    finish(builder)
}

/// A .tgz of a metadata record's header giving `size` bytes, then `body`,
/// and nothing else: the archive ends there.
fn tgz_cut_after_record(kind: EntryType, size: u64, body: &[u8]) -> Vec<u8> {
    let mut header = tar::Header::new_gnu();
    header.as_old_mut().name[..13].copy_from_slice(b"././@LongLink");
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(0o644);
    header.set_cksum();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(header.as_bytes()).unwrap();
    gz.write_all(body).unwrap();
    gz.finish().unwrap()
}

/// Appends `entries`, names and link targets copied byte for byte.
fn append_entries<W: io::Write>(builder: &mut tar::Builder<W>, entries: &[Entry]) {
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
}

/// Ends the archive and the gzip stream.
fn finish(builder: tar::Builder<flate2::write::GzEncoder<Vec<u8>>>) -> Vec<u8> {
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

async fn install_limited(bytes: Vec<u8>, limits: ExtractLimits) -> Attempt {
    install_with(bytes, tempfile::tempdir().unwrap(), |root, _| {
        Installer::new(InstallerConfig {
            extract: limits,
            root: root.to_path_buf(),
            ..InstallerConfig::default()
        })
        .unwrap()
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
    let a = install(tgz(&[file("bridge", b"1"), dir("bridge/")])).await;
    a.assert_refused();
    assert!(
        matches!(a.extract_error(), ExtractError::ThroughFile(_)),
        "{}",
        a.message()
    );
    // A directory named again changes nothing, and is taken.
    let a = install(tgz(&[dir("lib/"), file("lib/x", b"1"), dir("lib/")])).await;
    a.result.as_ref().unwrap();
    assert_eq!(
        std::fs::read(a.root.path().join("opt/cni/bin/lib/x")).unwrap(),
        b"1"
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
                ..ExtractLimits::default()
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

/// A merge into an existing directory is all or nothing: an archive with
/// a non-directory where the directory has a directory, or a directory
/// where it has a symlink to one, moves nothing into place (the symlink is
/// replaced, never followed, when the archive is otherwise fine).
#[tokio::test]
async fn a_refused_merge_moves_nothing_and_a_symlinked_directory_is_not_followed() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("opt/cni/bin");
    let outside = root.path().join("outside");
    std::fs::create_dir_all(target.join("plugins")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(target.join("bridge"), b"old").unwrap();
    std::os::unix::fs::symlink(&outside, target.join("lib")).unwrap();

    // "bridge" sorts before "plugins": a merge that checked as it moved
    // would have replaced it before refusing.
    let a = install_with(
        tgz(&[file("bridge", b"new"), file("plugins", b"not a directory")]),
        root,
        |root, _| installer(root, None, fast_retries()),
    )
    .await;
    assert!(
        matches!(a.extract_error(), ExtractError::WouldReplaceDirectory(_)),
        "{}",
        a.message()
    );
    assert_eq!(std::fs::read(target.join("bridge")).unwrap(), b"old");
    assert!(target.join("plugins").is_dir());
    assert_eq!(entries(&a.root.path().join("opt/cni")), ["bin"]);

    // A directory of the archive where the target has a symlink to one.
    let a = install_with(
        tgz(&[dir("lib/"), file("lib/tool", b"plugin")]),
        a.root,
        |root, _| installer(root, None, fast_retries()),
    )
    .await;
    a.result.as_ref().unwrap();
    assert!(std::fs::symlink_metadata(target.join("lib"))
        .unwrap()
        .is_dir());
    assert_eq!(std::fs::read(target.join("lib/tool")).unwrap(), b"plugin");
    assert!(entries(&outside).is_empty(), "written through the symlink");
}

/// Attacker's move (whoever writes a components list: an operator without
/// a signing key, or a mistake in a signed list): an archive extracted into
/// a directory that another component's file shares, with an entry of that
/// file's name. Listed after it, the archive would replace the file that
/// PCR 13 measures as the other component, at every boot. Refused before
/// anything of the archive is moved into place.
#[tokio::test]
async fn an_archive_entry_at_another_components_path_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let kubelet = b"the measured kubelet".to_vec();
    mirror.serve("/kubelet", kubelet.clone());
    let archive = tgz(&[
        file("crictl", b"crictl"),
        file("kubelet", b"another kubelet"),
    ]);
    let archive_hash = sha256(&archive);
    mirror.serve(ARCHIVE, archive);
    let list = [
        Component::new(
            &mirror.url("/kubelet"),
            &sha256(&kubelet),
            "/opt/cni/bin/kubelet",
            false,
        )
        .unwrap(),
        Component::new(&mirror.url(ARCHIVE), &archive_hash, TARGET, true).unwrap(),
    ];
    let installer = installer(root.path(), None, fast_retries());
    let result = installer.install_all(&list, &NoProgress).await;
    match result {
        Err(InstallError::Extract {
            source: ExtractError::WouldReplaceComponent(path),
            ..
        }) => assert!(path.ends_with("opt/cni/bin/kubelet"), "{path}"),
        other => panic!("not refused: {:?}", other.map(|_| ())),
    }
    let target = root.path().join("opt/cni/bin");
    assert_eq!(std::fs::read(target.join("kubelet")).unwrap(), kubelet);
    assert_eq!(entries(&target), ["kubelet"]);
    // Listed first, into a directory that does not exist yet, it is
    // refused as well: from the first install, not at the next boot.
    let fresh = tempfile::tempdir().unwrap();
    let reversed = [list[1].clone(), list[0].clone()];
    let first = installer_at(fresh.path())
        .install_all(&reversed, &NoProgress)
        .await;
    assert!(
        matches!(
            first,
            Err(InstallError::Extract {
                source: ExtractError::WouldReplaceComponent(_),
                ..
            })
        ),
        "{:?}",
        first.map(|_| ())
    );
    assert!(!fresh.path().join("opt/cni/bin").exists());
    // On its own, as an install that names no other component, the same
    // archive goes in.
    installer.install(&list[1], &NoProgress).await.unwrap();
    assert_eq!(entries(&target), ["crictl", "kubelet"]);
}

/// Whoever writes a components list lists two archives for one directory:
/// each would replace the other's files of the same name, and which one
/// wins would depend on the order they were installed in. The list is
/// refused at its first component (here a single file), before anything
/// is fetched.
#[tokio::test]
async fn two_archives_into_one_directory_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let mirror = MirrorServer::start().unwrap();
    let first = tgz(&[file("tool", b"first")]);
    let second = tgz(&[file("tool", b"second")]);
    let (first_hash, second_hash) = (sha256(&first), sha256(&second));
    mirror.serve("/first.tgz", first);
    mirror.serve("/second.tgz", second);
    mirror.serve("/kubelet", b"kubelet".to_vec());
    let list = [
        Component::new(
            &mirror.url("/kubelet"),
            &sha256(b"kubelet"),
            "/run/state/bin/kubelet",
            false,
        )
        .unwrap(),
        Component::new(&mirror.url("/first.tgz"), &first_hash, TARGET, true).unwrap(),
        Component::new(&mirror.url("/second.tgz"), &second_hash, TARGET, true).unwrap(),
    ];
    let result = installer_at(root.path())
        .install_all(&list, &NoProgress)
        .await;
    match result {
        Err(InstallError::SharedArchiveDirectory { path }) => {
            assert_eq!(path.as_str(), TARGET);
        }
        other => panic!("not refused: {:?}", other.map(|_| ())),
    }
    assert!(!root.path().join("opt/cni/bin").exists());
    assert!(!root.path().join("run/state/bin/kubelet").exists());
    assert_eq!(mirror.total_requests(), 0, "fetched before the refusal");
    // With one of them the list goes in.
    installer_at(root.path())
        .install_all(&[list[0].clone(), list[2].clone()], &NoProgress)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(root.path().join("opt/cni/bin/tool")).unwrap(),
        b"second"
    );
}

/// Whoever writes a components list (or a control plane that lies in a
/// join ticket) lists two kubelets at one install path, the new one first
/// and the old one last: both would be installed and measured, and the
/// node would run the old one while its event log shows the new one. The
/// list is refused as a whole before anything is fetched, and so is one
/// with a file and an archive at one path.
#[tokio::test]
async fn two_files_at_one_path_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let mirror = MirrorServer::start().unwrap();
    mirror.serve("/new/kubelet", b"new kubelet".to_vec());
    mirror.serve("/old/kubelet", b"old kubelet".to_vec());
    let kubelet = |version: &str, extract: bool| {
        Component::new(
            &mirror.url(&format!("/{version}/kubelet")),
            &sha256(format!("{version} kubelet").as_bytes()),
            "/run/state/bin/kubelet",
            extract,
        )
        .unwrap()
    };
    for list in [
        [kubelet("new", false), kubelet("old", false)],
        [kubelet("new", false), kubelet("old", true)],
    ] {
        match keel_installer::check_list(&list) {
            Err(InstallError::SharedInstallPath { path }) => {
                assert_eq!(path.as_str(), "/run/state/bin/kubelet");
            }
            other => panic!("not refused: {other:?}"),
        }
        let result = installer_at(root.path())
            .install_all(&list, &NoProgress)
            .await;
        assert!(
            matches!(result, Err(InstallError::SharedInstallPath { .. })),
            "{:?}",
            result.map(|_| ())
        );
        assert!(!root.path().join("run/state/bin/kubelet").exists());
        assert_eq!(mirror.total_requests(), 0, "fetched before the refusal");
    }
    // With one of them the list goes in.
    installer_at(root.path())
        .install_all(&[kubelet("new", false)], &NoProgress)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(root.path().join("run/state/bin/kubelet")).unwrap(),
        b"new kubelet"
    );
}

fn installer_at(root: &Path) -> Installer {
    installer(root, None, fast_retries())
}

/// More entries than the bound: refused whole.
#[tokio::test]
async fn refuses_an_archive_with_too_many_entries() {
    let many: Vec<Entry> = (0..11).map(|i| file(&format!("f{i}"), b"x")).collect();
    let a = install_limited(
        tgz(&many),
        ExtractLimits {
            max_entries: 10,
            ..ExtractLimits::default()
        },
    )
    .await;
    a.assert_refused();
    assert!(
        matches!(a.extract_error(), ExtractError::TooManyEntries(10)),
        "{}",
        a.message()
    );
    // Ten go in.
    let a = install_limited(
        tgz(&many[..10]),
        ExtractLimits {
            max_entries: 10,
            ..ExtractLimits::default()
        },
    )
    .await;
    a.result.as_ref().unwrap();
}

const MIB: u64 = 1024 * 1024;

/// Size of the hostile metadata records: far above their limits.
const HUGE: u64 = 64 * MIB;

/// The default limits, and the same with the decompressed stream bounded at
/// 1 MiB: far below a huge record, far above the metadata limits. Under the
/// second a record read (even in part) beyond 1 MiB before being refused
/// would show as [`ExtractError::TooLarge`] — the stream bound doubles as a
/// count of the bytes the extractor pulled from the decompressor, and
/// everything it can hold in memory came through it.
fn default_and_tight_limits() -> [ExtractLimits; 2] {
    [
        ExtractLimits::default(),
        ExtractLimits {
            max_unpacked_bytes: MIB,
            ..ExtractLimits::default()
        },
    ]
}

/// Installs `bytes` under each of [`default_and_tight_limits`] and checks the
/// archive is refused on the record's size, with a short message.
async fn assert_refused_on_size(bytes: &[u8], record: MetadataRecord, limit: u64) {
    assert!(
        bytes.len() < 256 * 1024,
        "a small archive: {} bytes",
        bytes.len()
    );
    for limits in default_and_tight_limits() {
        let a = install_limited(bytes.to_vec(), limits).await;
        a.assert_refused();
        match a.extract_error() {
            ExtractError::MetadataTooLarge {
                record: r,
                size,
                limit: l,
            } => assert_eq!((*r, *size, *l), (record, HUGE, limit), "{}", a.message()),
            _ => panic!("expected a refusal on the record's size: {}", a.message()),
        }
        assert!(
            a.message().contains(&format!(
                "archive {record} of {HUGE} bytes exceeds the limit of {limit} bytes"
            )),
            "{}",
            a.message()
        );
        assert!(a.message().len() < 300, "{}", a.message());
    }
}

#[tokio::test]
async fn refuses_a_huge_gnu_long_name_before_reading_it() {
    // 64 MiB of name, compressed to some 64 KiB.
    let contained = tgz_with_record(
        EntryType::GNULongName,
        HUGE,
        io::repeat(b'a').take(HUGE),
        &[file("bridge", b"ok")],
    );
    assert_refused_on_size(&contained, MetadataRecord::LongName, 4096).await;
    // Only claimed: the archive ends after the record's header.
    let claimed = tgz_cut_after_record(EntryType::GNULongName, HUGE, b"");
    assert_refused_on_size(&claimed, MetadataRecord::LongName, 4096).await;
}

#[tokio::test]
async fn refuses_a_huge_gnu_long_link_before_reading_it() {
    let bytes = tgz_with_record(
        EntryType::GNULongLink,
        HUGE,
        io::repeat(b'a').take(HUGE),
        &[link(EntryType::Symlink, "tool", "placeholder")],
    );
    assert_refused_on_size(&bytes, MetadataRecord::LongLink, 4096).await;
}

#[tokio::test]
async fn refuses_huge_pax_headers_before_reading_them() {
    for (kind, record, key) in [
        (EntryType::XHeader, MetadataRecord::PaxHeader, "path"),
        (
            EntryType::XGlobalHeader,
            MetadataRecord::PaxGlobalHeader,
            "comment",
        ),
    ] {
        // One well-formed record of exactly 64 MiB: "67108864 <key>=aaa…\n".
        let prefix = format!("{HUGE} {key}=");
        let value = HUGE - prefix.len() as u64 - 1;
        let body = prefix
            .as_bytes()
            .chain(io::repeat(b'a').take(value))
            .chain(&b"\n"[..]);
        let bytes = tgz_with_record(kind, HUGE, body, &[file("bridge", b"ok")]);
        assert_refused_on_size(&bytes, record, 64 * 1024).await;
    }
}

#[tokio::test]
async fn error_text_shows_a_hostile_path_escaped_and_cut() {
    // 10,000 characters: absolute (so refused), with a terminal title escape,
    // a bell and screen clears in it.
    let mut name = b"/\x1b]0;owned\x07".to_vec();
    while name.len() < 10_000 {
        name.extend_from_slice(b"dir\x1b[2J/");
    }
    name.truncate(10_000);
    let limits = ExtractLimits {
        max_name_bytes: 16 * 1024,
        ..ExtractLimits::default()
    };
    let a = install_limited(
        tgz(&[
            meta(EntryType::GNULongName, &nul_terminated(&name)),
            file("placeholder", b"x"),
        ]),
        limits,
    )
    .await;
    a.assert_refused();
    let ExtractError::EntryPath { path, reason } = a.extract_error() else {
        panic!("expected an entry path error: {}", a.message());
    };
    assert_eq!(*reason, "is absolute");
    // 128 characters: the 17 of `/\x1b]0;owned\x07` (11 bytes), ten times
    // the 11 of `dir\x1b[2J/` (8 bytes each), and `d`; 92 bytes shown.
    let expected = format!(
        r"/\x1b]0;owned\x07{}d…(+9908 bytes)",
        r"dir\x1b[2J/".repeat(10)
    );
    assert_eq!(path, &expected);
    let message = a.message();
    assert!(
        message.contains(&format!("archive entry \"{expected}\" is absolute")),
        "{message}"
    );
    assert!(!message.chars().any(char::is_control), "{message:?}");
    assert!(message.len() < 300, "{message}");

    // Short names from the header itself, and link targets, alike.
    let a = install(tgz(&[link(
        EntryType::Symlink,
        "l\x1b[8m",
        "/etc/\x07\"x\"",
    )]))
    .await;
    a.assert_refused();
    assert!(
        a.message().contains(
            r#"archive symlink "l\x1b[8m" -> "/etc/\x07\"x\"" points to an absolute path"#
        ),
        "{}",
        a.message()
    );

    // The tar crate names the header's path in its own errors (here a mode
    // field that is not octal); those reach the message escaped too.
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    let mut header = tar::Header::new_gnu();
    header.as_old_mut().name[..5].copy_from_slice(b"m\x1b[5m");
    header.set_entry_type(EntryType::Regular);
    header.set_size(0);
    header.as_old_mut().mode = *b"zzzzzzz\0";
    header.set_cksum();
    builder.append(&header, io::empty()).unwrap();
    let a = install(finish(builder)).await;
    a.assert_refused();
    assert!(
        matches!(a.extract_error(), ExtractError::ReadArchive(_)),
        "{}",
        a.message()
    );
    assert!(
        a.message().contains(r"when getting mode for m\x1b[5m"),
        "{}",
        a.message()
    );
    assert!(
        !a.message().chars().any(char::is_control),
        "{:?}",
        a.message()
    );
}

#[tokio::test]
async fn extracts_gnu_long_names_and_links() {
    // As GNU tar writes them (and the tar crate's builder, used here): an 'L'
    // record before an entry whose name does not fit the header, a 'K'
    // record before a symlink whose target does not.
    let deep = format!("{}/tool", ["component"; 15].join("/"));
    assert!(deep.len() > 100 && deep.len() < 4096, "{}", deep.len());
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(EntryType::Regular);
    header.set_size(10);
    header.set_mode(0o755);
    builder
        .append_data(&mut header, &deep, &b"#!/bin/sh\n"[..])
        .unwrap();
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(EntryType::Symlink);
    header.set_size(0);
    builder.append_link(&mut header, "tool", &deep).unwrap();
    let bytes = finish(builder);

    let a = install(bytes).await;
    let done = a.result.as_ref().unwrap();
    assert_eq!(
        done.outcome(),
        Outcome::Extracted(ExtractSummary {
            files: 1,
            directories: 0,
            symlinks: 1,
            bytes: 10
        })
    );
    let t = a.target();
    assert_eq!(std::fs::read(t.join(&deep)).unwrap(), b"#!/bin/sh\n");
    assert_eq!(mode(&t.join(&deep)), 0o755);
    assert_eq!(
        std::fs::read_link(t.join("tool")).unwrap(),
        Path::new(&deep)
    );
    assert_eq!(entries(&t), ["component", "tool"]);
}

#[tokio::test]
async fn extracts_entries_named_by_pax_headers() {
    let deep = format!("{}/bridge", ["plugins"; 20].join("/"));
    assert!(deep.len() > 100 && deep.len() < 4096, "{}", deep.len());
    let target = format!("./{deep}");
    let a = install(tgz(&[
        // As `git archive` writes: the commit in a global header.
        meta(
            EntryType::XGlobalHeader,
            &pax(&[("comment", b"4b825dc642cb6eb9a060e54bf8d69288fbee4904")]),
        ),
        meta(
            EntryType::XHeader,
            &pax(&[
                ("mtime", b"1700000000.25"),
                ("path", deep.as_bytes()),
                ("SCHILY.xattr.user.note", b"ignored"),
                ("size", b"3"),
            ]),
        ),
        file("placeholder-file", b"new"),
        meta(
            EntryType::XHeader,
            &pax(&[("path", b"bridge"), ("linkpath", target.as_bytes())]),
        ),
        link(EntryType::Symlink, "placeholder-link", "placeholder-target"),
    ]))
    .await;
    let done = a.result.as_ref().unwrap();
    assert_eq!(
        done.outcome(),
        Outcome::Extracted(ExtractSummary {
            files: 1,
            directories: 0,
            symlinks: 1,
            bytes: 3
        })
    );
    let t = a.target();
    assert_eq!(
        entries(&t),
        ["bridge", "plugins"],
        "the PAX names, not the header's"
    );
    assert_eq!(std::fs::read(t.join(&deep)).unwrap(), b"new");
    assert_eq!(
        std::fs::read_link(t.join("bridge")).unwrap(),
        Path::new(&target)
    );
    assert_eq!(std::fs::read(t.join("bridge")).unwrap(), b"new");
}

#[tokio::test]
async fn refuses_metadata_without_its_entry_or_with_two_meanings() {
    let long_name = |name: &[u8]| meta(EntryType::GNULongName, &nul_terminated(name));
    let pax_header = |pairs: &[(&str, &[u8])]| meta(EntryType::XHeader, &pax(pairs));
    let cases: Vec<(Vec<Entry>, &str)> = vec![
        (
            vec![file("bridge", b"ok"), long_name(b"x")],
            "archive GNU long-name record is not followed by an entry",
        ),
        (
            vec![pax_header(&[("path", b"x")])],
            "archive PAX extended header is not followed by an entry",
        ),
        (
            vec![long_name(b"a"), long_name(b"b"), file("c", b"")],
            "archive GNU long-name record appears twice for one entry",
        ),
        (
            vec![
                long_name(b"a"),
                pax_header(&[("path", b"b")]),
                file("c", b""),
            ],
            r#"archive GNU long-name record and a PAX "path" both name one entry"#,
        ),
        (
            vec![
                meta(EntryType::GNULongLink, &nul_terminated(b"a")),
                pax_header(&[("linkpath", b"b")]),
                link(EntryType::Symlink, "c", "d"),
            ],
            r#"archive GNU long-link record and a PAX "linkpath" both give one entry's link target"#,
        ),
        (
            vec![
                long_name(b"a"),
                meta(EntryType::XGlobalHeader, &pax(&[("comment", b"x")])),
                file("c", b""),
            ],
            "archive PAX global header lies between another metadata record and its entry",
        ),
        (
            vec![meta(EntryType::GNULongName, b"a\0b\0"), file("c", b"")],
            "archive GNU long-name record contains a NUL byte",
        ),
        (
            vec![
                meta(EntryType::GNULongLink, &nul_terminated(b"bridge")),
                file("c", b""),
            ],
            "archive GNU long-link record gives a link target to an entry that is not a symlink",
        ),
        (
            vec![pax_header(&[("linkpath", b"bridge")]), dir("c/")],
            "archive PAX extended header gives a link target to an entry that is not a symlink",
        ),
        (
            // The next header would be found elsewhere by a reader that
            // honours the PAX size.
            vec![pax_header(&[("size", b"1")]), file("c", b"22")],
            r#"archive PAX extended header key "size" differs from the size in the entry's header"#,
        ),
        (
            vec![pax_header(&[("GNU.sparse.map", b"0,2")]), file("c", b"22")],
            r#"archive PAX extended header key "GNU.sparse.map" describes a sparse file; sparse files are not allowed"#,
        ),
        (
            vec![special(EntryType::GNUSparse, "holes")],
            r#"archive entry "holes" is a sparse file"#,
        ),
        (
            vec![
                meta(EntryType::XGlobalHeader, &pax(&[("path", b"evil")])),
                file("c", b""),
            ],
            r#"archive PAX global header key "path" is not allowed in a global header"#,
        ),
        (
            vec![meta(EntryType::XHeader, b"5 a=b\n"), file("c", b"")],
            "archive PAX extended header holds a malformed record",
        ),
        (
            vec![pax_header(&[("path", &[b'a'; 4097])]), file("c", b"")],
            "archive PAX extended header gives a path of 4097 bytes, more than the limit of 4096",
        ),
        // The names that replace the header's obey the path rules.
        (
            vec![pax_header(&[("path", b"../x")]), file("harmless", b"")],
            r#"archive entry "../x" contains "..""#,
        ),
        (
            vec![long_name(b"/etc/x"), file("harmless", b"")],
            r#"archive entry "/etc/x" is absolute"#,
        ),
        (
            vec![
                pax_header(&[("linkpath", b"/")]),
                link(EntryType::Symlink, "evil", "harmless"),
            ],
            r#"archive symlink "evil" -> "/" points to an absolute path"#,
        ),
    ];
    for (entries, expected) in cases {
        let a = install(tgz(&entries)).await;
        a.assert_refused();
        assert!(a.message().contains(expected), "{}", a.message());
    }

    // A record under its limit that the archive cuts short.
    let a = install(tgz_cut_after_record(EntryType::GNULongName, 100, b"bin/to")).await;
    a.assert_refused();
    assert!(
        a.message()
            .contains("archive GNU long-name record is truncated"),
        "{}",
        a.message()
    );
}

/// A compressed stream damaged inside a file's data (a kept archive
/// damaged on disk: the state disk has no integrity protection) fails as
/// a read of the archive, never as a write to the target: the installer
/// fetches a kept archive again on the first, and gives up on the second
/// ("a fetched copy would fare no better").
#[test]
fn a_stream_damaged_inside_a_files_data_is_the_archives_fault() {
    // Compressible, so the damage lands in Huffman-coded data, inside the
    // file's: before the read side was told apart, this very stream failed
    // as `WriteEntry` for `bin/tool`.
    let data: Vec<u8> = (0..400_000u32)
        .map(|i| b"kubelet "[(i % 8) as usize] ^ ((i / 4096) as u8 & 3))
        .collect();
    let mut bytes = tgz(&[file("bin/tool", &data)]);
    let middle = bytes.len() / 2;
    for b in &mut bytes[middle..middle + 32] {
        *b ^= 0xa5;
    }
    let dir = tempfile::tempdir().unwrap();
    let (kept, target) = (dir.path().join("kept.tgz"), dir.path().join("bin"));
    std::fs::write(&kept, &bytes).unwrap();
    let refused = keel_installer::extract::extract_tgz_verified(
        std::fs::File::open(&kept).unwrap(),
        keel_installer::Sha256Digest::of(&bytes),
        &target,
        &ExtractLimits::default(),
    )
    .unwrap_err();
    assert!(
        matches!(refused, ExtractError::ReadArchive(_)),
        "{refused:?}"
    );
    assert!(!refused.is_at_target());
    assert!(!target.exists());
    assert_eq!(entries(dir.path()), ["kept.tgz"]);
}
