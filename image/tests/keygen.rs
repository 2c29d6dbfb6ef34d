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
/// verifies over the components file as the file for the version named
/// (as a node checks it), and for no other version.
#[test]
fn sign_writes_a_signature_of_the_file_for_one_version() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("keys");
    let keygen = Command::new(env!("CARGO_BIN_EXE_keel-measure"))
        .args(["keygen", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(keygen.status.success());
    let file = dir.path().join("components.json");
    let sign = |version: &str| {
        Command::new(env!("CARGO_BIN_EXE_keel-measure"))
            .args(["sign", "--kubernetes-version", version, "--signing-key"])
            .arg(out.join("measurements-signing-key.pem"))
            .arg(&file)
            .output()
            .unwrap()
    };
    // Not a components file: nothing signed.
    std::fs::write(&file, b"{}\n").unwrap();
    assert!(!sign("v1.31").status.success());
    assert!(!dir.path().join("components.json.sig").exists());

    std::fs::write(&file, b"[]\n").unwrap();
    let signed = sign("v1.31");
    assert!(
        signed.status.success(),
        "{}",
        String::from_utf8_lossy(&signed.stderr)
    );
    let signature = std::fs::read(dir.path().join("components.json.sig")).unwrap();
    let public = keel_verifier::signature::SigningPublicKey::from_pem(
        &std::fs::read(out.join("measurements-signing-key.pub.pem")).unwrap(),
    )
    .unwrap();
    let for_version = |version: &str, bytes: &[u8]| {
        keel_installer::components_file::signed_message(
            keel_installer::resolve(version).unwrap().version(),
            bytes,
        )
    };
    public
        .verify(&for_version("v1.31", b"[]\n"), &signature)
        .unwrap();
    assert!(public
        .verify(&for_version("v1.32", b"[]\n"), &signature)
        .is_err());
    assert!(public
        .verify(&for_version("v1.31", b"[] \n"), &signature)
        .is_err());
    assert!(public.verify(b"[]\n", &signature).is_err());
    // An unknown version: refused.
    assert!(!sign("v0.1").status.success());
}
