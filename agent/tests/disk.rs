//! LUKS2 state-disk operations with the real `cryptsetup` on a regular file
//! (no loop device or device-mapper here, so `open` itself is left to the
//! VM tests; where device-mapper works, a genuine disk is opened too).
//! Hostile headers the CLI cannot write without device-mapper are made by
//! editing a genuine header's JSON and checksums.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use std::process::{Command, Stdio};

use keel_agent::disk::{make_filesystem, Cryptsetup, DiskError};
use sha2::{Digest as _, Sha256};

const KEY: [u8; 32] = *b"0123456789abcdef\x00\x01\x02\xff-not-a-key!!";

fn disk(dir: &Path) -> PathBuf {
    let path = dir.join("state.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(32 * 1024 * 1024)
        .unwrap();
    path
}

/// The installed `cryptsetup` program, for tests that put a stand-in
/// beside it.
fn real_cryptsetup() -> &'static str {
    [
        "/usr/sbin/cryptsetup",
        "/sbin/cryptsetup",
        "/usr/bin/cryptsetup",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("cryptsetup installed")
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
    assert_eq!(refused_field(cs.key_matches(&dev, &KEY)), "magic");
    // A reset disk can be formatted again, with a new UUID.
    cs.format(&dev, &KEY).unwrap();
    assert_ne!(cs.uuid(&dev).unwrap(), uuid);
}

/// A disk the agent formats says its set-up is unfinished until the
/// provisioning relabels it; only an unfinished one is reset at start.
#[test]
fn an_unfinished_set_up_is_told_from_a_members_disk() {
    use keel_agent::disk::{DiskState, StateDisk, PROVISIONED_LABEL, PROVISIONING_LABEL};

    let dir = tempfile::tempdir().unwrap();
    let disk = StateDisk {
        device: disk(dir.path()),
        cryptsetup: Cryptsetup::default(),
        mount: None,
    };
    assert_eq!(disk.inspect().unwrap(), DiskState::Fresh);
    assert_eq!(disk.reset_unfinished().unwrap(), DiskState::Fresh);

    let uuid = keel_agent::disk::new_uuid();
    disk.set_up(&uuid, &KEY).unwrap();
    assert_eq!(
        disk.cryptsetup.label(&disk.device).unwrap(),
        PROVISIONING_LABEL
    );
    assert_eq!(
        disk.inspect().unwrap(),
        DiskState::Unfinished { uuid: uuid.clone() }
    );
    disk.finish().unwrap();
    assert_eq!(
        disk.cryptsetup.label(&disk.device).unwrap(),
        PROVISIONED_LABEL
    );
    let member = DiskState::Member { uuid: uuid.clone() };
    assert_eq!(disk.inspect().unwrap(), member);
    assert_eq!(disk.reset_unfinished().unwrap(), member);
    assert!(disk.cryptsetup.key_matches(&disk.device, &KEY).unwrap());

    // A disk formatted before the label existed (none) is a member's.
    let device = disk.device.to_str().unwrap();
    assert!(raw_cryptsetup(&["config", "--label", "", device], &[]));
    assert_eq!(disk.cryptsetup.label(&disk.device).unwrap(), "");
    assert_eq!(disk.inspect().unwrap(), DiskState::Member { uuid });

    // Unfinished: reset at start, and fresh afterwards.
    let uuid = keel_agent::disk::new_uuid();
    disk.set_up(&uuid, &KEY).unwrap();
    assert_eq!(
        disk.reset_unfinished().unwrap(),
        DiskState::Unfinished { uuid }
    );
    assert_eq!(disk.inspect().unwrap(), DiskState::Fresh);
}

/// Failure (or the host's move, to make a node format its own data): both
/// copies of a member's LUKS2 header damaged, their magic intact.
/// `cryptsetup isLuks` then says "not LUKS"; the disk is still not taken
/// for an empty one, so neither init nor a join formats it, and the
/// erase that marks a disk for reset still works on it.
#[test]
fn a_damaged_header_is_not_taken_for_an_empty_disk() {
    use keel_agent::disk::StateDisk;

    let dir = tempfile::tempdir().unwrap();
    let dev = disk(dir.path());
    let cs = Cryptsetup::default();
    cs.format(&dev, &KEY).unwrap();
    let damage = |at: u64, bytes: &[u8]| {
        use std::os::unix::fs::FileExt as _;
        let file = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
        file.write_all_at(bytes, at).unwrap();
    };
    // The primary's JSON alone: cryptsetup reads (and may repair it from)
    // the secondary copy.
    damage(4096 + 2, b"{{{{damaged");
    assert!(cs.is_luks(&dev).unwrap());
    // Both copies (the secondary right after a 16 KiB primary).
    damage(4096 + 2, b"{{{{damaged");
    damage(16384 + 4096 + 2, b"{{{{damaged");
    let err = cs.is_luks(&dev).unwrap_err();
    assert!(
        matches!(err, DiskError::DamagedHeader { offset: 0, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("header is damaged"), "{err}");
    let state = StateDisk {
        device: dev.clone(),
        cryptsetup: Cryptsetup::default(),
        mount: None,
    };
    assert!(matches!(
        state.inspect(),
        Err(DiskError::DamagedHeader { .. })
    ));
    // Only the secondary's magic left (the primary's wiped by hand): still
    // a signature.
    damage(0, &[0; 6]);
    assert!(matches!(
        cs.is_luks(&dev),
        Err(DiskError::DamagedHeader { offset: 16384, .. })
    ));

    // Marking it for reset removes every signature: then it is empty.
    cs.mark_for_reset(&dev).unwrap();
    assert!(!cs.is_luks(&dev).unwrap());
    assert_eq!(state.inspect().unwrap(), keel_agent::disk::DiskState::Fresh);

    // Both magics there, both headers damaged, and a wipefs that leaves
    // them (newer util-linux skips a LUKS2 header whose recorded offset is
    // not where it lies; here a wipefs that does nothing): the reset still
    // leaves no signature behind.
    cs.format(&dev, &KEY).unwrap();
    damage(4096 + 2, b"{{{{damaged");
    damage(16384 + 4096 + 2, b"{{{{damaged");
    let idle_wipefs = Cryptsetup::new(real_cryptsetup(), "true");
    assert!(matches!(
        idle_wipefs.is_luks(&dev),
        Err(DiskError::DamagedHeader { offset: 0, .. })
    ));
    idle_wipefs.mark_for_reset(&dev).unwrap();
    assert!(!cs.is_luks(&dev).unwrap());
    assert_eq!(state.inspect().unwrap(), keel_agent::disk::DiskState::Fresh);
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
    let real = real_cryptsetup();
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
    // The key check read the checked, detached header copy.
    let test = std::fs::read_dir(&log)
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap_or_default())
        .find(|a| a.contains("--test-passphrase"))
        .unwrap();
    assert!(test.contains("--header\n"), "{test}");
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

/// Runs the real `cryptsetup` with `key` on stdin; whether it succeeded.
fn raw_cryptsetup(args: &[&str], key: &[u8]) -> bool {
    use std::io::Write as _;
    let mut child = Command::new("cryptsetup")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(key);
    child.wait().unwrap().success()
}

/// Replaces, in both LUKS2 metadata copies of `dev`, the first `from` after
/// `after` in the JSON area by `to` (same length), and fixes the header
/// checksums: what a host that can write the disk can do.
fn edit_header(dev: &Path, after: &str, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(dev).unwrap();
    assert_eq!(&bytes[..8], b"LUKS\xba\xbe\x00\x02");
    let hdr_size = u64::from_be_bytes(bytes[8..16].try_into().unwrap()) as usize;
    for copy in [0, hdr_size] {
        let hdr = &mut bytes[copy..copy + hdr_size];
        assert!(hdr[72..78].starts_with(b"sha256"));
        let json = &hdr[4096..];
        let start = find(json, after.as_bytes()).unwrap();
        let at = start + find(&json[start..], from.as_bytes()).unwrap();
        hdr[4096 + at..4096 + at + to.len()].copy_from_slice(to.as_bytes());
        hdr[448..512].fill(0);
        let sum = Sha256::digest(&*hdr);
        hdr[448..480].copy_from_slice(&sum);
    }
    std::fs::write(dev, bytes).unwrap();
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The header error `result` must be, with the field it names.
fn refused_field<T: std::fmt::Debug>(result: Result<T, DiskError>) -> String {
    match result {
        Err(DiskError::Header { mismatch, .. }) => mismatch.field,
        other => panic!("expected a header refusal, got {other:?}"),
    }
}

/// Whether device-mapper works here (root in a VM): `open` can run.
fn device_mapper() -> bool {
    Command::new("dmsetup")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_genuine_disk_passes_the_header_check_and_opens() {
    let dir = tempfile::tempdir().unwrap();
    let dev = disk(dir.path());
    let cs = Cryptsetup::default();
    cs.format(&dev, &KEY).unwrap();
    let copy = cs.detached_header(&dev).unwrap();
    let copy_dir = copy.path().parent().unwrap().to_owned();
    let mode = std::fs::metadata(&copy_dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    // Byte for byte what cryptsetup's own header backup writes.
    let backup = dir.path().join("backup");
    assert!(raw_cryptsetup(
        &[
            "luksHeaderBackup",
            "--header-backup-file",
            backup.to_str().unwrap(),
            dev.to_str().unwrap()
        ],
        &[]
    ));
    assert!(
        std::fs::read(copy.path()).unwrap() == std::fs::read(&backup).unwrap(),
        "the copy differs from luksHeaderBackup's"
    );
    // The copy alone is the header: the key check works on it even after
    // the disk's own header is gone.
    cs.mark_for_reset(&dev).unwrap();
    let header = copy.path().to_str().unwrap();
    let dev_str = dev.to_str().unwrap();
    assert!(raw_cryptsetup(
        &[
            "open",
            "--test-passphrase",
            "--type",
            "luks2",
            "--header",
            header,
            "--key-file=-",
            dev_str
        ],
        &KEY
    ));
    drop(copy);
    assert!(!copy_dir.exists(), "the header copy is removed");

    cs.format(&dev, &KEY).unwrap();
    assert!(cs.key_matches(&dev, &KEY).unwrap());
    let name = format!("keel-test-{}", std::process::id());
    match cs.open(&dev, &name, &KEY) {
        Ok(mapped) => {
            assert!(mapped.exists());
            cs.close(&name).unwrap();
        }
        // No device-mapper: the header check passed, `open` itself failed.
        Err(DiskError::Failed {
            operation: "open", ..
        }) if !device_mapper() => {
            eprintln!("no device-mapper: the genuine disk passed the header check, not opened");
        }
        Err(e) => panic!("opening a genuine disk: {e:?}"),
    }
}

/// A header that claims a keyslot area twice the agent's: the agent copies
/// no more than its own header's 16 MiB (`luksHeaderBackup` would copy all
/// of it, up to 128 MiB, before the check), and the disk is refused.
#[test]
fn a_header_claiming_a_larger_keyslot_area_is_copied_no_further_than_16_mib() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("large-keyslots.img");
    std::fs::File::create(&dev)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    assert!(raw_cryptsetup(
        &[
            "luksFormat",
            "--batch-mode",
            "--type",
            "luks2",
            "--luks2-keyslots-size=32M",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file=-",
            dev.to_str().unwrap()
        ],
        &KEY
    ));
    // Every file cryptsetup is handed, with its size, as it starts.
    let sizes = dir.path().join("sizes");
    let wrapper = dir.path().join("cryptsetup");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh
printf '%s\n' \"$1\" >> {sizes}
for a in \"$@\"; do
               [ -f \"$a\" ] && stat -c '%s %n' \"$a\" >> {sizes}
done
exec {real} \"$@\"
",
            sizes = sizes.display(),
            real = real_cryptsetup()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cs = Cryptsetup::new(&wrapper, "wipefs");

    let refused = cs.key_matches(&dev, &KEY);
    assert!(refused.is_err(), "{refused:?}");
    let log = std::fs::read_to_string(&sizes).unwrap();
    assert!(!log.contains("luksHeaderBackup"), "{log}");
    let copies: Vec<u64> = log
        .lines()
        .filter_map(|line| line.split_once(' '))
        .filter(|(_, path)| Path::new(path) != dev)
        .map(|(size, _)| size.parse().unwrap())
        .collect();
    assert!(!copies.is_empty(), "cryptsetup read a header copy: {log}");
    assert!(copies.iter().all(|&size| size <= 16 << 20), "{log}");
}

/// The genuine keyslot kept, the data segment switched to `cipher_null`
/// (CVE-2025-59054): the key still passes `--test-passphrase`, so that
/// check alone would mount plaintext the host wrote.
#[test]
fn a_cipher_null_data_segment_is_refused_before_the_key_check_and_open() {
    let dir = tempfile::tempdir().unwrap();
    let dev = disk(dir.path());
    let cs = Cryptsetup::default();
    cs.format(&dev, &KEY).unwrap();
    edit_header(&dev, "\"segments\"", "aes-xts-plain64", "cipher_null-ecb");
    let dev_str = dev.to_str().unwrap();
    assert!(
        raw_cryptsetup(
            &["open", "--test-passphrase", "--key-file=-", dev_str],
            &KEY
        ),
        "the forged header is valid to cryptsetup and the key test alone passes"
    );
    assert_eq!(
        refused_field(cs.key_matches(&dev, &KEY)),
        "segments.0.encryption"
    );
    assert_eq!(
        refused_field(cs.open(&dev, "keel-never", &KEY)),
        "segments.0.encryption"
    );
    let err = cs.key_matches(&dev, &KEY).unwrap_err().to_string();
    assert!(
        err.contains("cipher_null-ecb") && err.contains("segments.0.encryption"),
        "{err}"
    );
}

#[test]
fn a_cipher_null_keyslot_is_refused_before_the_key_check_and_open() {
    let dir = tempfile::tempdir().unwrap();
    let cs = Cryptsetup::default();

    let dev = disk(dir.path());
    cs.format(&dev, &KEY).unwrap();
    edit_header(&dev, "\"keyslots\"", "aes-xts-plain64", "cipher_null-ecb");
    let mut wrong = KEY;
    wrong[0] ^= 1;
    for key in [&KEY, &wrong] {
        assert_eq!(
            refused_field(cs.key_matches(&dev, key)),
            "keyslots.0.area.encryption"
        );
        assert_eq!(
            refused_field(cs.open(&dev, "keel-never", key)),
            "keyslots.0.area.encryption"
        );
    }

    // The same made by the CLI: needs device-mapper (the kernel's user-space
    // crypto API has no cipher_null, so cryptsetup writes the keyslot
    // through dm-crypt).
    let null = dir.path().join("null.img");
    std::fs::File::create(&null)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let formatted = raw_cryptsetup(
        &[
            "luksFormat",
            "--batch-mode",
            "--type",
            "luks2",
            "--cipher",
            "cipher_null-ecb",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file=-",
            null.to_str().unwrap(),
        ],
        &KEY,
    );
    if formatted {
        for key in [&KEY, &wrong] {
            assert!(refused_field(cs.key_matches(&null, key)).ends_with("encryption"));
            assert!(refused_field(cs.open(&null, "keel-never", key)).ends_with("encryption"));
        }
    } else {
        assert!(
            !device_mapper(),
            "luksFormat --cipher cipher_null-ecb failed"
        );
        eprintln!("no device-mapper: cipher_null luksFormat skipped (edited header tested)");
    }
}

#[test]
fn luks1_and_reencrypting_headers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cs = Cryptsetup::default();

    let dev = disk(dir.path());
    assert!(raw_cryptsetup(
        &[
            "luksFormat",
            "--batch-mode",
            "--type",
            "luks1",
            "--key-file=-",
            dev.to_str().unwrap()
        ],
        &KEY
    ));
    assert_eq!(refused_field(cs.key_matches(&dev, &KEY)), "version");

    let dev = dir.path().join("reencrypt.img");
    std::fs::File::create(&dev)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    cs.format(&dev, &KEY).unwrap();
    assert!(raw_cryptsetup(
        &[
            "reencrypt",
            "--init-only",
            "--batch-mode",
            "--key-file=-",
            dev.to_str().unwrap()
        ],
        &KEY
    ));
    assert_eq!(
        refused_field(cs.key_matches(&dev, &KEY)),
        "config.requirements"
    );
    assert_eq!(
        refused_field(cs.open(&dev, "keel-never", &KEY)),
        "config.requirements"
    );
}
