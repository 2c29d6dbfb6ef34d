//! `keel init` and `keel verify` refuse measurements that enforce too little
//! before they write or send anything: the settings point at a listener the
//! test holds, and no connection may reach it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use harness::text;

const H: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// A settings file naming `endpoint` and a measurements file; the EK CA and
/// init secret are usable, so only the measurements can stop the CLI.
struct Setup {
    dir: tempfile::TempDir,
    listener: TcpListener,
}

impl Setup {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test EK CA");
        let ca = params.self_signed(&key).unwrap();
        std::fs::write(dir.path().join("ek-ca.pem"), ca.pem()).unwrap();
        std::fs::write(
            dir.path().join("init-secret"),
            "an init secret, long enough",
        )
        .unwrap();
        let settings = serde_json::json!({
            "endpoint": listener.local_addr().unwrap().to_string(),
            "measurements": "measurements.json",
            "ek_ca": "ek-ca.pem",
            "init_secret_file": "init-secret",
        });
        std::fs::write(dir.path().join("keel.json"), settings.to_string()).unwrap();
        Self { dir, listener }
    }

    fn settings(&self, measurements: &str) -> PathBuf {
        std::fs::write(self.dir.path().join("measurements.json"), measurements).unwrap();
        self.dir.path().join("keel.json")
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

fn keel(args: &[&str], settings: &Path, workspace: Option<&Path>) -> Output {
    harness::keel(args, settings, workspace).output().unwrap()
}

fn entry(pcr: u32, warn_only: bool) -> String {
    format!(r#""{pcr}": {{"expected": "{H}", "warnOnly": {warn_only}}}"#)
}

fn file(entries: &[String]) -> String {
    format!("{{{}}}", entries.join(", "))
}

/// Files that enforce too little, and what the refusal must say.
fn refused_files() -> Vec<(&'static str, String, &'static str)> {
    let enforced =
        |pcrs: &[u32]| -> Vec<String> { pcrs.iter().map(|&p| entry(p, false)).collect() };
    let mut cases = vec![
        ("empty", "{}".to_owned(), "name no PCR"),
        (
            "all warn-only",
            file(&[4, 9, 11, 12, 15].map(|p| entry(p, true))),
            "enforce no PCR",
        ),
        (
            "PCR 12 warn-only",
            file(&[enforced(&[4, 9, 11]), vec![entry(12, true)]].concat()),
            "PCR 12 warn-only",
        ),
        (
            "repeated key",
            file(&[enforced(&[4, 9, 11, 12]), vec![entry(12, true)]].concat()),
            "\"12\" appears more than once",
        ),
    ];
    for (missing, expected) in [
        (4, "PCR 4 missing"),
        (9, "PCR 9 missing"),
        (11, "PCR 11 missing"),
        (12, "PCR 12 missing"),
    ] {
        let rest: Vec<u32> = [4, 9, 11, 12, 15]
            .into_iter()
            .filter(|&p| p != missing)
            .collect();
        cases.push(("a required PCR missing", file(&enforced(&rest)), expected));
    }
    cases
}

#[test]
fn init_refuses_them_before_writing_or_sending_anything() {
    let setup = Setup::new();
    for (case, measurements, expected) in refused_files() {
        let ws = tempfile::tempdir().unwrap();
        let out = keel(
            &["init", "--wait", "1"],
            &setup.settings(&measurements),
            Some(ws.path()),
        );
        let t = text(&out);
        assert!(!out.status.success(), "{case}: {t}");
        assert!(t.contains(expected), "{case}: {t}");
        assert!(t.contains("measurements.json are invalid"), "{case}: {t}");
        assert!(!setup.connected(), "{case}: the CLI connected");
        assert_eq!(
            std::fs::read_dir(ws.path()).unwrap().count(),
            0,
            "{case}: the CLI wrote into the workspace"
        );
    }
}

#[test]
fn verify_refuses_them_before_connecting() {
    let setup = Setup::new();
    for (case, measurements, expected) in refused_files() {
        let out = keel(&["verify"], &setup.settings(&measurements), None);
        let t = text(&out);
        assert!(!out.status.success(), "{case}: {t}");
        assert!(t.contains(expected), "{case}: {t}");
        assert!(!setup.connected(), "{case}: the CLI connected");
    }

    // With measurements that enforce enough, the same settings do connect:
    // the listener sees it (and hangs up, so verify fails).
    let good = file(&[4, 9, 11, 12].map(|p| entry(p, false)));
    let settings = setup.settings(&good);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["verify", "--wait", "0", "--settings"])
        .arg(&settings)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut connected = false;
    while Instant::now() < deadline {
        if setup.connected() {
            connected = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = child.wait().unwrap();
    assert!(connected, "verify never connected with good measurements");
    assert!(!status.success());
}
