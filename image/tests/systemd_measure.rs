//! Cross-checks the PCR 11 prediction against systemd's own calculator.
//!
//! Needs a built UKI and `systemd-measure` (systemd >= 252):
//! `KEEL_UKI=build/image/keel.efi cargo test -p keel-image -- --ignored`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

use keel_image::pcr::replay;
use keel_image::predict::{pcr11, Uki, STUB_MEASURED_SECTIONS};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const SYSTEMD_MEASURE: &str = "/usr/lib/systemd/systemd-measure";

#[test]
#[ignore = "needs a built UKI: set KEEL_UKI=build/image/keel.efi"]
fn pcr11_matches_systemd_measure() -> TestResult {
    // A relative path is taken from the workspace root.
    let uki_path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(std::env::var("KEEL_UKI")?);
    let bytes = std::fs::read(&uki_path)?;
    let uki = Uki::parse(&bytes)?;
    let dir = tempfile::tempdir()?;

    let mut cmd = Command::new(SYSTEMD_MEASURE);
    cmd.args(["calculate", "--bank=sha256", "--phase="]);
    let mut given = 0;
    for name in STUB_MEASURED_SECTIONS {
        if let Some(content) = uki.section(name)? {
            let option = name.trim_start_matches('.');
            let file = dir.path().join(option);
            std::fs::write(&file, content)?;
            cmd.arg(format!("--{option}={}", file.display()));
            given += 1;
        }
    }
    assert!(
        given >= 4,
        "the UKI should have .linux .osrel .cmdline .initrd at least"
    );

    let output = cmd.output()?;
    assert!(
        output.status.success(),
        "systemd-measure failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout)?;
    // Output: "11:sha256=<hex>" (one line for the empty phase path).
    let theirs = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("11:sha256="))
        .ok_or_else(|| format!("no PCR 11 line in: {stdout}"))?;
    let ours = hex::encode(replay(&pcr11(&uki)?));
    assert_eq!(ours, theirs);
    Ok(())
}
