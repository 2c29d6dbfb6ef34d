//! `keel upgrade apply` (and `keel push-measurements`, when the settings
//! name a signing key) refuses measurements whose signature
//! is wrong, missing or by another key (and a phase it cannot run) before
//! it contacts any node: the endpoint is a listener the test holds, and no
//! connection may reach it. The workspace and settings are complete, so a
//! file that passes the checks does reach it, as each test shows last.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::{Path, PathBuf};

use harness::text;
use keel_verifier::measurements::{Expected, Measurements, REQUIRED_PCRS};
use keel_verifier::signature::SigningPrivateKey;

struct Setup {
    dir: tempfile::TempDir,
    listener: TcpListener,
    key: SigningPrivateKey,
}

impl Setup {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let key = SigningPrivateKey::generate();
        std::fs::write(
            d.join("signing.pub.pem"),
            key.public_key().to_pem().unwrap(),
        )
        .unwrap();
        let set =
            Measurements::new(REQUIRED_PCRS.map(|p| (p, Expected::enforced([1; 32])))).unwrap();
        std::fs::write(d.join("measurements.json"), set.to_json()).unwrap();
        // An EK CA no node here has a certificate of: the settings load.
        let ca = rcgen::generate_simple_self_signed(["keel test EK CA".to_owned()]).unwrap();
        std::fs::write(d.join("ek-ca.pem"), ca.cert.pem()).unwrap();
        // A workspace `keel init` could have left: without one, every run
        // would stop before it connects, whatever it checked first.
        let (master, salt, measurement_salt) = ([0x11; 32], [0x22; 32], [0x33; 32]);
        let keys = keel_verifier::keys::KeyService::new(&master, &salt).unwrap();
        let id =
            keel_verifier::keys::cluster_id(&keys.measurement_secret().unwrap(), &measurement_salt)
                .unwrap();
        let secret = serde_json::json!({
            "key": hex::encode(master),
            "salt": hex::encode(salt),
            "measurement_salt": hex::encode(measurement_salt),
        });
        std::fs::write(d.join("keel-master-secret.json"), secret.to_string()).unwrap();
        let endpoint = listener.local_addr().unwrap().to_string();
        let id_file = serde_json::json!({ "cluster_id": hex::encode(id), "endpoint": endpoint });
        std::fs::write(d.join("keel-id.json"), id_file.to_string()).unwrap();
        Self { dir, listener, key }
    }

    /// Settings naming the signing key (or not).
    fn settings(&self, with_key: bool) -> PathBuf {
        let mut settings = serde_json::json!({
            "endpoint": self.endpoint(),
            "measurements": "measurements.json",
            "ek_ca": "ek-ca.pem",
        });
        if with_key {
            settings["measurements_signing_key"] = "signing.pub.pem".into();
        }
        let path = self.dir.path().join(format!("keel-{with_key}.json"));
        std::fs::write(&path, settings.to_string()).unwrap();
        path
    }

    fn endpoint(&self) -> String {
        self.listener.local_addr().unwrap().to_string()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Whether any connection reached the listener.
    fn connected(&self) -> bool {
        match self.listener.accept() {
            Ok(_) => true,
            Err(e) if e.kind() == ErrorKind::WouldBlock => false,
            Err(e) => panic!("{e}"),
        }
    }
}

/// A refused run: its name, the file, the signature at `FILE.sig` (`None`:
/// absent), further arguments, and what the refusal must say.
type Case<'a> = (&'a str, Vec<u8>, Option<Vec<u8>>, Vec<&'a str>, &'a str);

/// A new image's measurements file that enforces what it must.
fn new_image() -> Vec<u8> {
    let set = Measurements::new(REQUIRED_PCRS.map(|p| (p, Expected::enforced([2; 32])))).unwrap();
    format!("{}\n", set.to_json()).into_bytes()
}

fn apply(setup: &Setup, settings: &Path, extra: &[&str]) -> std::process::Output {
    let endpoint = setup.endpoint();
    let mut args = vec!["upgrade", "apply", "--endpoint", &endpoint, "--wait", "1"];
    args.extend_from_slice(extra);
    harness::keel(&args, settings, Some(setup.dir.path()))
        .output()
        .unwrap()
}

/// Signatures of `body`: by the setup's key, the same with its last byte
/// flipped, and by another key.
fn signatures(setup: &Setup, body: &[u8]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let good = setup.key.sign(body);
    let mut flipped = good.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    let other = SigningPrivateKey::generate().sign(body);
    (good, flipped, other)
}

#[test]
fn upgrade_apply_refuses_a_bad_signature_before_contacting_any_node() {
    let setup = Setup::new();
    let settings = setup.settings(true);
    let body = new_image();
    let (good, flipped, other) = signatures(&setup, &body);
    let mut weak: serde_json::Value = serde_json::from_slice(&body).unwrap();
    weak.as_object_mut().unwrap().remove("12").unwrap();
    let weak = serde_json::to_vec(&weak).unwrap();

    let skip = ["--skip-phases", "kubernetes"];
    let cases: Vec<Case> = vec![
        (
            "wrong signature",
            body.clone(),
            Some(flipped),
            skip.to_vec(),
            "is not signed with the measurements signing key",
        ),
        (
            "signature by another key",
            body.clone(),
            Some(other),
            skip.to_vec(),
            "is not signed with the measurements signing key",
        ),
        (
            "file changed after signing",
            [body.as_slice(), b" "].concat(),
            Some(good.clone()),
            skip.to_vec(),
            "is not signed with the measurements signing key",
        ),
        (
            "missing signature",
            body.clone(),
            None,
            skip.to_vec(),
            "no signature for",
        ),
        (
            "empty signature",
            body.clone(),
            Some(Vec::new()),
            skip.to_vec(),
            "is not signed with the measurements signing key",
        ),
        (
            "signed file that enforces less",
            weak.clone(),
            Some(setup.key.sign(&weak)),
            skip.to_vec(),
            "is not a measurements file",
        ),
        (
            "an unsupported kubernetes version",
            body.clone(),
            Some(good.clone()),
            vec!["--kubernetes", "v1.29"],
            "is not supported",
        ),
        (
            "every phase skipped",
            body.clone(),
            Some(good.clone()),
            vec!["--skip-phases", "kubernetes,image"],
            "nothing to do",
        ),
    ];
    for (case, file, signature, extra, expected) in cases {
        let path = setup.path("new.json");
        std::fs::write(&path, &file).unwrap();
        let sig = setup.path("new.json.sig");
        let _ = std::fs::remove_file(&sig);
        if let Some(signature) = signature {
            std::fs::write(&sig, signature).unwrap();
        }
        let mut args = vec!["--image-measurements", path.to_str().unwrap()];
        args.extend(extra);
        let out = apply(&setup, &settings, &args);
        let t = text(&out);
        assert!(!out.status.success(), "{case}: {t}");
        assert!(t.contains(expected), "{case}: {t}");
        assert!(!setup.connected(), "{case}: the CLI connected");
    }

    // A signature named explicitly is the one checked.
    let path = setup.path("new.json");
    std::fs::write(&path, &body).unwrap();
    std::fs::write(setup.path("new.json.sig"), &good).unwrap();
    std::fs::write(setup.path("elsewhere.sig"), b"junk").unwrap();
    let out = apply(
        &setup,
        &settings,
        &[
            "--image-measurements",
            path.to_str().unwrap(),
            "--image-measurements-signature",
            setup.path("elsewhere.sig").to_str().unwrap(),
            "--skip-phases",
            "kubernetes",
        ],
    );
    assert!(text(&out).contains("is not signed"), "{}", text(&out));
    assert!(!setup.connected());

    // The same file with its own signature gets past every check and
    // reaches the node (here: a listener that never answers), so the
    // refusals above were made before any connection, not for want of a
    // workspace.
    let out = apply(
        &setup,
        &settings,
        &[
            "--image-measurements",
            path.to_str().unwrap(),
            "--skip-phases",
            "kubernetes",
        ],
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(setup.connected(), "{}", text(&out));

    // Settings without a signing key: refused, naming the missing key.
    let out = apply(
        &setup,
        &setup.settings(false),
        &[
            "--image-measurements",
            path.to_str().unwrap(),
            "--skip-phases",
            "kubernetes",
        ],
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("no measurements_signing_key"),
        "{}",
        text(&out)
    );
    assert!(!setup.connected());
}

/// A refused push: its name, the file, the signature at `FILE.sig`
/// (`None`: absent), and what the refusal must say.
type PushCase<'a> = (&'a str, Vec<u8>, Option<Vec<u8>>, &'a str);

#[test]
fn push_measurements_refuses_a_bad_signature_before_contacting_any_node() {
    let setup = Setup::new();
    let settings = setup.settings(true);
    let body = new_image();
    let (good, flipped, other) = signatures(&setup, &body);
    let push = |extra: &[&str]| {
        let endpoint = setup.endpoint();
        let path = setup.path("new.json");
        let mut args = vec![
            "push-measurements",
            "--file",
            path.to_str().unwrap(),
            "--endpoint",
            &endpoint,
            "--wait",
            "1",
        ];
        args.extend_from_slice(extra);
        harness::keel(&args, &settings, Some(setup.dir.path()))
            .output()
            .unwrap()
    };
    let cases: Vec<PushCase> = vec![
        ("missing signature", body.clone(), None, "no signature for"),
        (
            "wrong signature",
            body.clone(),
            Some(flipped),
            "is not signed with the measurements signing key",
        ),
        (
            "signature by another key",
            body.clone(),
            Some(other),
            "is not signed with the measurements signing key",
        ),
        (
            "file changed after signing",
            [body.as_slice(), b" "].concat(),
            Some(good.clone()),
            "is not signed with the measurements signing key",
        ),
    ];
    for (case, file, signature, expected) in cases {
        std::fs::write(setup.path("new.json"), &file).unwrap();
        let sig = setup.path("new.json.sig");
        let _ = std::fs::remove_file(&sig);
        if let Some(signature) = signature {
            std::fs::write(&sig, signature).unwrap();
        }
        let out = push(&[]);
        let t = text(&out);
        assert!(!out.status.success(), "{case}: {t}");
        assert!(t.contains(expected), "{case}: {t}");
        assert!(!setup.connected(), "{case}: the CLI connected");
    }

    // A signature named explicitly is the one checked.
    std::fs::write(setup.path("new.json"), &body).unwrap();
    std::fs::write(setup.path("new.json.sig"), &good).unwrap();
    std::fs::write(setup.path("elsewhere.sig"), b"junk").unwrap();
    let elsewhere = setup.path("elsewhere.sig");
    let out = push(&["--signature", elsewhere.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(text(&out).contains("is not signed"), "{}", text(&out));
    assert!(!setup.connected());
    // With its own signature, the push reaches the node.
    let out = push(&[]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(setup.connected(), "{}", text(&out));
}

/// Where the settings name a signing key, `--components` needs the file's
/// signature (nodes of such a cluster take no other components): missing,
/// by another key, or over other bytes, the run stops before it contacts
/// any node.
#[test]
fn upgrade_apply_refuses_unsigned_components_before_contacting_any_node() {
    let setup = Setup::new();
    let settings = setup.settings(true);
    let file = setup.path("components.json");
    let body = br#"[{"url":"https://example.org/kubelet","hash":"sha256:0000000000000000000000000000000000000000000000000000000000000000","install_path":"/run/state/bin/kubelet"}]"#.to_vec();
    std::fs::write(&file, &body).unwrap();
    let for_version = |version: &str| {
        keel_installer::components_file::signed_message(
            keel_installer::resolve(version).unwrap().version(),
            &body,
        )
    };
    let (good, flipped, other) = signatures(&setup, &for_version("v1.31"));
    let other_version = setup.key.sign(&for_version("v1.32"));
    let signature = setup.path("components.json.sig");
    let args = [
        "--kubernetes",
        "v1.31",
        "--components",
        file.to_str().unwrap(),
        "--skip-phases",
        "image",
    ];
    for (case, sig, expected) in [
        ("missing", None, "no signature for"),
        (
            "flipped",
            Some(flipped),
            "with the settings' measurements signing key",
        ),
        (
            "another key",
            Some(other),
            "with the settings' measurements signing key",
        ),
        (
            "the file alone",
            Some(setup.key.sign(&body)),
            "with the settings' measurements signing key",
        ),
        (
            "as another version's file",
            Some(other_version),
            "for Kubernetes v1.31",
        ),
    ] {
        let _ = std::fs::remove_file(&signature);
        if let Some(sig) = sig {
            std::fs::write(&signature, sig).unwrap();
        }
        let out = apply(&setup, &settings, &args);
        assert!(!out.status.success(), "{case}");
        assert!(text(&out).contains(expected), "{case}: {}", text(&out));
        assert!(
            text(&out).contains("nothing was sent"),
            "{case}: {}",
            text(&out)
        );
        assert!(!setup.connected(), "{case}: a node was contacted");
    }
    // Signed, but changed since: refused as well.
    std::fs::write(&signature, &good).unwrap();
    std::fs::write(&file, [body.as_slice(), b" "].concat()).unwrap();
    let out = apply(&setup, &settings, &args);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("with the settings' measurements signing key"),
        "{}",
        text(&out)
    );
    assert!(!setup.connected());
    // The file as it was signed reaches the node.
    std::fs::write(&file, &body).unwrap();
    let out = apply(&setup, &settings, &args);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(setup.connected(), "{}", text(&out));
}
