//! `keel-measure --epoch N` writes the epoch inside the signed bytes of the
//! measurements file, next to the same set as without it; an epoch out of
//! range writes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

use keel_image::predict::{measurements, FirmwareDrivers, Uki};
use keel_image::testpe;
use keel_verifier::config::NodeConfig;
use keel_verifier::signature::{detached_signature_path, SignedMeasurements, SigningPublicKey};

fn measure(dir: &Path, output: &Path, epoch: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_keel-measure"));
    command
        .arg("--uki")
        .arg(dir.join("keel.efi"))
        .arg("--node-config")
        .arg(dir.join("node-config.json"))
        .arg("--output")
        .arg(output)
        .arg("--signing-key")
        .arg(dir.join("keys/measurements-signing-key.pem"));
    if let Some(epoch) = epoch {
        // One argument, so that a negative value reaches the parser.
        command.arg(format!("--epoch={epoch}"));
    }
    command.output().unwrap()
}

fn signed(key: &SigningPublicKey, file: &Path) -> SignedMeasurements {
    let body = std::fs::read(file).unwrap();
    let signature = std::fs::read(detached_signature_path(file)).unwrap();
    SignedMeasurements::verify(key, &body, &signature).unwrap()
}

#[test]
fn the_epoch_is_written_inside_the_signed_file() {
    let dir = tempfile::tempdir().unwrap();
    let uki = testpe::synthetic_uki();
    std::fs::write(dir.path().join("keel.efi"), &uki).unwrap();
    let config = br#"{"node": {"name": "a"}}"#;
    std::fs::write(dir.path().join("node-config.json"), config).unwrap();
    let keygen = Command::new(env!("CARGO_BIN_EXE_keel-measure"))
        .args(["keygen", "--out"])
        .arg(dir.path().join("keys"))
        .output()
        .unwrap();
    assert!(keygen.status.success());
    let key = SigningPublicKey::from_pem(
        &std::fs::read(dir.path().join("keys/measurements-signing-key.pub.pem")).unwrap(),
    )
    .unwrap();
    let expected = measurements(
        &Uki::parse(&uki).unwrap(),
        &NodeConfig::parse(config, Path::new("node-config.json")).unwrap(),
        FirmwareDrivers::None,
    )
    .unwrap();

    let with = dir.path().join("with-epoch.json");
    let run = measure(dir.path(), &with, Some("7"));
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let seven = signed(&key, &with);
    assert_eq!(seven.epoch(), 7);
    assert_eq!(seven.measurements(), &expected);

    // Without --epoch: the same set, no epoch in the file.
    let without = dir.path().join("without-epoch.json");
    assert!(measure(dir.path(), &without, None).status.success());
    let zero = signed(&key, &without);
    assert_eq!(zero.epoch(), 0);
    assert_eq!(zero.measurements(), seven.measurements());
    assert!(!String::from_utf8(zero.body().to_vec())
        .unwrap()
        .contains("epoch"));

    // The epoch is signed: raising it in the file breaks the signature.
    let body = String::from_utf8(seven.body().to_vec()).unwrap();
    assert!(body.contains("\"epoch\": 7"), "{body}");
    let raised = body.replace("\"epoch\": 7", "\"epoch\": 8");
    assert!(SignedMeasurements::verify(&key, raised.as_bytes(), seven.signature()).is_err());

    // Past 2^53 - 1, or not a number: refused, nothing written.
    for bad in ["9007199254740992", "-1", "1.5"] {
        let out = dir.path().join(format!("bad-{bad}.json"));
        let run = measure(dir.path(), &out, Some(bad));
        assert!(!run.status.success(), "--epoch={bad} was taken");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            stderr.contains(&format!("invalid value '{bad}' for '--epoch")),
            "{stderr}"
        );
        assert!(!out.exists() && !detached_signature_path(&out).exists());
    }
    let largest = dir.path().join("largest.json");
    assert!(measure(dir.path(), &largest, Some("9007199254740991"))
        .status
        .success());
    assert_eq!(signed(&key, &largest).epoch(), (1 << 53) - 1);
}
