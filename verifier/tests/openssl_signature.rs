//! Measurements-file signatures interoperate with the `openssl` command
//! line both ways: what `openssl dgst -sha256 -sign` writes verifies here,
//! and what this crate signs `openssl dgst -sha256 -verify` accepts; a
//! changed file or another key is refused by both.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Command, Output};

use keel_verifier::signature::{SignatureError, SigningPrivateKey, SigningPublicKey};

fn openssl(dir: &Path, args: &[&str]) -> Output {
    Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command line is installed")
}

fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "openssl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn openssl_signs_and_keel_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let genpkey = [
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        "key.pem",
    ];
    ok(openssl(d, &genpkey));
    ok(openssl(
        d,
        &["pkey", "-in", "key.pem", "-pubout", "-out", "pub.pem"],
    ));
    let public = SigningPublicKey::from_pem(&std::fs::read(d.join("pub.pem")).unwrap()).unwrap();
    // We read openssl's private key file too.
    let ours = SigningPrivateKey::from_pem(&std::fs::read(d.join("key.pem")).unwrap()).unwrap();
    assert_eq!(ours.public_key(), public);

    // Several signatures: ECDSA is randomised, and openssl does not
    // normalise s, so high and low s both occur.
    for i in 0..16 {
        let file = format!("{{\"4\": \"{i:064x}\"}}\n");
        std::fs::write(d.join("m.json"), &file).unwrap();
        let sign = [
            "dgst",
            "-sha256",
            "-sign",
            "key.pem",
            "-out",
            "m.json.sig",
            "m.json",
        ];
        ok(openssl(d, &sign));
        let signature = std::fs::read(d.join("m.json.sig")).unwrap();
        public.verify(file.as_bytes(), &signature).unwrap();
        let mut changed = file.clone().into_bytes();
        changed.push(b' ');
        assert!(matches!(
            public.verify(&changed, &signature),
            Err(SignatureError::Mismatch)
        ));
    }
}

#[test]
fn keel_signs_and_openssl_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let key = SigningPrivateKey::generate();
    std::fs::write(d.join("key.pem"), key.to_pem().unwrap().as_bytes()).unwrap();
    std::fs::write(d.join("pub.pem"), key.public_key().to_pem().unwrap()).unwrap();
    // openssl derives the same public key from our private key file.
    let derived = ok(openssl(d, &["pkey", "-in", "key.pem", "-pubout"])).stdout;
    assert_eq!(
        SigningPublicKey::from_pem(&derived).unwrap(),
        key.public_key()
    );

    let file = b"{\"9\": {\"expected\": \"00\", \"warnOnly\": false}}\n";
    std::fs::write(d.join("m.json"), file).unwrap();
    std::fs::write(d.join("m.json.sig"), key.sign(file)).unwrap();
    let verify = |public: &str| {
        openssl(
            d,
            &[
                "dgst",
                "-sha256",
                "-verify",
                public,
                "-signature",
                "m.json.sig",
                "m.json",
            ],
        )
    };
    let out = ok(verify("pub.pem"));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "Verified OK");

    // openssl refuses the same signature over changed bytes and for
    // another key.
    std::fs::write(d.join("m.json"), b"{\"9\": \"01\"}\n").unwrap();
    assert!(!verify("pub.pem").status.success());
    std::fs::write(d.join("m.json"), file).unwrap();
    let other = SigningPrivateKey::generate();
    std::fs::write(d.join("other.pem"), other.public_key().to_pem().unwrap()).unwrap();
    assert!(!verify("other.pem").status.success());
    assert!(verify("pub.pem").status.success());
}
