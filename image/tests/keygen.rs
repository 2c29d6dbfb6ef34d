//! `keel-measure keygen` writes a key pair openssl reads as one (the
//! private key 0600), and never overwrites an existing key.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt as _;
use std::process::Command;

#[test]
fn keygen_writes_a_pair_openssl_reads_and_keeps_existing_keys() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("keys");
    let keygen = || {
        Command::new(env!("CARGO_BIN_EXE_keel-measure"))
            .args(["keygen", "--out"])
            .arg(&out)
            .output()
            .unwrap()
    };
    let first = keygen();
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let private = out.join("measurements-signing-key.pem");
    let public = out.join("measurements-signing-key.pub.pem");
    let mode = std::fs::metadata(&private).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);

    let derived = Command::new("openssl")
        .args(["pkey", "-pubout", "-in"])
        .arg(&private)
        .output()
        .expect("the openssl command line is installed");
    assert!(derived.status.success());
    assert_eq!(derived.stdout, std::fs::read(&public).unwrap());

    // A second run refuses and leaves the key as it was.
    let before = std::fs::read(&private).unwrap();
    let second = keygen();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("not overwritten"));
    assert_eq!(std::fs::read(&private).unwrap(), before);
}
