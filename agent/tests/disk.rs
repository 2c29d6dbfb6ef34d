//! LUKS2 state-disk operations with the real `cryptsetup` on a regular file
//! (no loop device or device-mapper here, so `open` itself is left to the
//! VM tests).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use keel_agent::disk::{make_filesystem, Cryptsetup, DiskError};

const KEY: [u8; 32] = *b"0123456789abcdef\x00\x01\x02\xff-not-a-key!!";

fn disk(dir: &Path) -> PathBuf {
    let path = dir.join("state.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(32 * 1024 * 1024)
        .unwrap();
    path
}

#[test]
fn format_open_check_and_reset() {
    let dir = tempfile::tempdir().unwrap();
    let dev = disk(dir.path());
    let cs = Cryptsetup::default();
    assert!(!cs.is_luks(&dev).unwrap());

    cs.format(&dev, &KEY).unwrap();
    assert!(cs.is_luks(&dev).unwrap());
    let uuid = cs.uuid(&dev).unwrap();
    assert_eq!(uuid.len(), 36);
    assert!(keel_verifier::keys::disk_id(&uuid).is_ok());

    assert!(cs.key_matches(&dev, &KEY).unwrap());
    let mut wrong = KEY;
    wrong[0] ^= 1;
    assert!(!cs.key_matches(&dev, &wrong).unwrap());

    cs.mark_for_reset(&dev).unwrap();
    assert!(!cs.is_luks(&dev).unwrap());
    assert!(matches!(
        cs.key_matches(&dev, &KEY),
        Err(DiskError::Failed { .. })
    ));
    // A reset disk can be formatted again, with a new UUID.
    cs.format(&dev, &KEY).unwrap();
    assert_ne!(cs.uuid(&dev).unwrap(), uuid);
}

#[test]
fn bad_inputs_fail_with_the_operation_named() {
    let dir = tempfile::tempdir().unwrap();
    let cs = Cryptsetup::default();
    let missing = dir.path().join("missing.img");
    let err = cs.is_luks(&missing).unwrap_err();
    assert!(
        matches!(
            &err,
            DiskError::Failed {
                operation: "isLuks",
                ..
            }
        ),
        "{err:?}"
    );
    let err = cs.format(&missing, &KEY).unwrap_err();
    assert!(
        matches!(
            &err,
            DiskError::Failed {
                operation: "luksFormat",
                ..
            }
        ),
        "{err:?}"
    );
    let dev = disk(dir.path());
    assert!(matches!(
        cs.format(&dev, &KEY[..15]),
        Err(DiskError::KeyLength(15))
    ));
    assert!(matches!(
        cs.uuid(&dev),
        Err(DiskError::Failed {
            operation: "luksUUID",
            ..
        })
    ));
    let absent = Cryptsetup::new(dir.path().join("no-cryptsetup"), "wipefs");
    assert!(matches!(absent.is_luks(&dev), Err(DiskError::Spawn { .. })));
}

/// A real `cryptsetup` behind a wrapper that records its arguments and
/// standard input: the key must arrive on stdin and nowhere in argv.
#[test]
fn the_key_travels_on_stdin_only() {
    let dir = tempfile::tempdir().unwrap();
    let dev = disk(dir.path());
    let real = [
        "/usr/sbin/cryptsetup",
        "/sbin/cryptsetup",
        "/usr/bin/cryptsetup",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("cryptsetup installed");
    let log = dir.path().join("log");
    std::fs::create_dir(&log).unwrap();
    let wrapper = dir.path().join("cryptsetup");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nn=$(ls {log} | wc -l)\nprintf '%s\\n' \"$@\" > {log}/$n.args\n\
             cat > {log}/$n.stdin\nexec {real} \"$@\" < {log}/$n.stdin\n",
            log = log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cs = Cryptsetup::new(&wrapper, "wipefs");

    cs.format(&dev, &KEY).unwrap();
    assert!(cs.key_matches(&dev, &KEY).unwrap());
    assert!(cs.is_luks(&dev).unwrap());

    let mut keyed = 0;
    for entry in std::fs::read_dir(&log).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        if path.extension().unwrap() == "args" {
            assert!(
                !bytes.windows(16).any(|w| w == &KEY[..16]),
                "key in argv: {path:?}"
            );
            assert!(!String::from_utf8_lossy(&bytes).contains(&hex::encode(&KEY[..8])));
        } else if !bytes.is_empty() {
            assert_eq!(bytes, KEY, "stdin carries exactly the key");
            keyed += 1;
        }
    }
    assert_eq!(keyed, 2, "format and the key check read the key");
}

#[test]
fn mkfs_makes_an_ext4_file_system() {
    let dir = tempfile::tempdir().unwrap();
    let dev = disk(dir.path());
    make_filesystem(Path::new("mkfs.ext4"), &dev).unwrap();
    let magic = {
        let bytes = std::fs::read(&dev).unwrap();
        // ext4 superblock at 1024, magic 0xEF53 at offset 0x38.
        u16::from_le_bytes([bytes[1024 + 0x38], bytes[1024 + 0x39]])
    };
    assert_eq!(magic, 0xef53);
    let err = make_filesystem(Path::new("mkfs.ext4"), &dir.path().join("nope/x")).unwrap_err();
    assert!(
        matches!(
            err,
            DiskError::Failed {
                operation: "mkfs.ext4",
                ..
            }
        ),
        "{err:?}"
    );
}
