//! `keel-measure keygen` writes a key pair openssl reads as one (the
//! private key 0600), and never overwrites an existing key; `keel-measure
//! sign` signs a file with it.
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

/// `keel-measure sign` writes `FILE.sig`, a signature that the public key
/// verifies over the file's exact bytes (as a node checks a components
/// file) and that openssl verifies too.
#[test]
fn sign_writes_a_detached_signature_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("keys");
    let keygen = Command::new(env!("CARGO_BIN_EXE_keel-measure"))
        .args(["keygen", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(keygen.status.success());
    let file = dir.path().join("components.json");
    std::fs::write(&file, b"[]\n").unwrap();
    let sign = Command::new(env!("CARGO_BIN_EXE_keel-measure"))
        .args(["sign", "--signing-key"])
        .arg(out.join("measurements-signing-key.pem"))
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        sign.status.success(),
        "{}",
        String::from_utf8_lossy(&sign.stderr)
    );
    let signature = std::fs::read(dir.path().join("components.json.sig")).unwrap();
    let public = keel_verifier::signature::SigningPublicKey::from_pem(
        &std::fs::read(out.join("measurements-signing-key.pub.pem")).unwrap(),
    )
    .unwrap();
    public.verify(b"[]\n", &signature).unwrap();
    assert!(public.verify(b"[] \n", &signature).is_err());
    let openssl = Command::new("openssl")
        .args(["dgst", "-sha256", "-verify"])
        .arg(out.join("measurements-signing-key.pub.pem"))
        .arg("-signature")
        .arg(dir.path().join("components.json.sig"))
        .arg(&file)
        .output()
        .expect("the openssl command line is installed");
    assert!(openssl.status.success());
}
