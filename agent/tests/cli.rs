//! The agent binary's command line: help, version, and PCR reads through a
//! TCTI from the statically linked TSS stack.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use keel_testkit::swtpm::{EkCa, Swtpm};

fn agent(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keel-agent"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn help_and_version() {
    let help = agent(&["--help"]);
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for word in ["run", "pcrs", "eventlog", "--tcti"] {
        assert!(text.contains(word), "help lacks {word}: {text}");
    }
    let version = agent(&["--version"]);
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("keel-agent {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn reads_all_24_sha256_pcrs_from_swtpm() {
    let ca = EkCa::new().unwrap();
    let swtpm = Swtpm::start(&ca).unwrap();
    let out = agent(&["--tcti", &swtpm.tcti(), "pcrs"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 24);
    for (i, line) in lines.iter().enumerate() {
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields[..2], ["pcr", i.to_string().as_str()]);
        assert_eq!(fields[2].len(), 64);
    }
    // A fresh TPM after startup: PCRs 0-15 are zero, 17-22 are all ones.
    assert_eq!(lines[0], format!("pcr 0 {}", "0".repeat(64)));
    assert_eq!(lines[17], format!("pcr 17 {}", "f".repeat(64)));
}

#[test]
fn unreachable_tpm_is_a_clear_error() {
    let out = agent(&["--tcti", "swtpm:host=127.0.0.1,port=1", "pcrs"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot open TPM"), "{err}");
}

/// A machine without a TPM device: the agent says so in words an operator
/// can act on (not the TSS's bare I/O error) and exits with the status its
/// unit does not restart on (`RestartPreventExitStatus=78`); an unreachable
/// TPM of another kind is an ordinary failure, restarted.
#[test]
fn a_machine_without_a_tpm_says_so_and_is_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"cluster":{"control_plane_endpoints":["10.0.0.1:9090"]},"node":{"name":"a","role":"worker"}}"#,
    )
    .unwrap();
    let missing = dir.path().join("tpmrm0");
    let missing = missing.to_str().unwrap();
    let state = dir.path().join("state");
    let run_once = |tcti: &str| {
        agent(&[
            "--tcti",
            tcti,
            "--state-dir",
            state.to_str().unwrap(),
            "run",
            "--once",
            "--config",
            config.to_str().unwrap(),
        ])
    };
    let out = run_once(missing);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{err}");
    assert!(
        err.contains(&format!("no TPM 2.0 device at {missing}")),
        "{err}"
    );
    assert!(err.contains("give the machine a TPM 2.0 device"), "{err}");
    // Nothing was measured or recorded without a TPM.
    assert!(!state.join("eventlog.jsonl").exists());

    let unreachable = run_once("swtpm:host=127.0.0.1,port=1");
    assert_eq!(unreachable.status.code(), Some(1));
}
