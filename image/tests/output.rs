//! `keel-measure --output FILE` replaces FILE through a new file (a symlink
//! at FILE is replaced, not written through), and never leaves a
//! signature of an earlier file beside it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

use keel_image::testpe;
use keel_verifier::signature::detached_signature_path;

fn measure(dir: &Path, output: &Path, signed: bool) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_keel-measure"));
    command
        .arg("--uki")
        .arg(dir.join("keel.efi"))
        .arg("--node-config")
        .arg(dir.join("node-config.json"))
        .arg("--output")
        .arg(output);
    if signed {
        command
            .arg("--signing-key")
            .arg(dir.join("keys/measurements-signing-key.pem"));
    }
    let run = command.output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    run
}

/// A directory with a UKI and a node config to measure.
fn image_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keel.efi"), testpe::synthetic_uki()).unwrap();
    std::fs::write(
        dir.path().join("node-config.json"),
        br#"{"node": {"name": "a"}}"#,
    )
    .unwrap();
    dir
}

#[test]
fn an_unsigned_run_removes_the_signature_of_an_earlier_file() {
    let dir = image_dir();
    let keygen = Command::new(env!("CARGO_BIN_EXE_keel-measure"))
        .args(["keygen", "--out"])
        .arg(dir.path().join("keys"))
        .output()
        .unwrap();
    assert!(keygen.status.success());

    let out = dir.path().join("measurements.json");
    let signature = detached_signature_path(&out);
    measure(dir.path(), &out, true);
    assert!(signature.exists());
    let unsigned = measure(dir.path(), &out, false);
    assert!(out.exists());
    assert!(
        !signature.exists(),
        "a signature of the earlier file remains"
    );
    let stderr = String::from_utf8_lossy(&unsigned.stderr);
    assert!(stderr.contains("removed"), "{stderr}");
    // No temporary file is left behind.
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["keel.efi", "keys", "measurements.json", "node-config.json"]
    );
}

#[test]
fn the_output_replaces_a_symlink_instead_of_writing_through_it() {
    let dir = image_dir();
    let target = dir.path().join("elsewhere");
    std::fs::write(&target, b"untouched").unwrap();
    let out = dir.path().join("measurements.json");
    std::os::unix::fs::symlink(&target, &out).unwrap();
    measure(dir.path(), &out, false);
    assert_eq!(std::fs::read(&target).unwrap(), b"untouched");
    assert!(!std::fs::symlink_metadata(&out)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(std::fs::read_to_string(&out).unwrap().contains("\"12\""));
}
