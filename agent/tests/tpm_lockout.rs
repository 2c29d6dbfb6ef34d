//! A node's TPM survives crashes: a VM killed again and again without
//! TPM2_Shutdown still attests (a document the validator accepts) and still
//! opens secrets sealed to its EK and AK; and the agent, stopped cleanly,
//! ends the TPM's cycle with TPM2_Shutdown. Against real swtpm, whose
//! dictionary-attack defaults (3 tries, 1000 s recovery) would lock a TPM
//! out after three unorderly shutdowns if the attestation key were
//! DA-protected.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keel_agent::attestation::credential;
use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::measured::MeasuredTpm;
use keel_agent::tpm::{LockoutState, TctiSpec, Tpm, TpmError};
use keel_atls::ErrorChain;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::ek::EkTrust;
use keel_verifier::measurement::{pcr, EventType};
use keel_verifier::measurements::Measurements;
use keel_verifier::validator::Validator;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Hard kills in a row; more than swtpm's default of 3 tries.
const KILLS: usize = 4;

/// The node config: a worker whose init port is free (an agent that
/// cannot bind its init port stops before it is ready).
fn config_json() -> &'static str {
    static CONFIG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CONFIG.get_or_init(|| {
        let port = keel_testkit::free_port().unwrap();
        format!(r#"{{"cluster":{{"init_port":{port}}},"node":{{"name":"n1","role":"worker"}}}}"#)
    })
}

fn open(swtpm: &Swtpm) -> Tpm {
    Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap()
}

fn config() -> NodeConfig {
    NodeConfig::parse(config_json().as_bytes(), "test".as_ref()).unwrap()
}

/// What a swtpm node with `config` measures, enforced: PCRs 4, 9, 11 and
/// 15 zero, PCR 12 the config's.
fn validator(ca: &EkCa, config: &NodeConfig) -> Validator {
    let zero = hex::encode([0u8; 32]);
    let mut expected = serde_json::Map::new();
    for index in [4, 9, 11, pcr::CLUSTER_ID] {
        expected.insert(index.to_string(), zero.clone().into());
    }
    expected.insert(
        pcr::CONFIG.to_string(),
        hex::encode(config.expected_config_pcr()).into(),
    );
    let measurements =
        Measurements::parse(serde_json::Value::Object(expected).to_string().as_bytes()).unwrap();
    Validator::new(
        measurements,
        EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap(),
    )
}

/// One boot of the node, as the agent runs it: open the TPM, measure the
/// config, attest over a fresh nonce; the verifier validates the document
/// and seals a secret to the EK and AK it accepted; the TPM opens it.
/// Returns the TPM's lockout state at boot and the handle, still open
/// (the crash comes while the agent runs).
fn boot(
    swtpm: &Swtpm,
    dir: &Path,
    n: usize,
    validator: &Validator,
) -> (LockoutState, Result<MeasuredTpm, String>) {
    let mut tpm = open(swtpm);
    let state = tpm.lockout_state().unwrap();
    let attested = (|| {
        let log = dir.join(format!("eventlog-{n}.jsonl"));
        let mut measured = MeasuredTpm::open(tpm, &log).map_err(|e| ErrorChain(&e).to_string())?;
        let config = config();
        measured
            .record(EventType::NodeConfig, "config", config.cluster_bytes())
            .map_err(|e| ErrorChain(&e).to_string())?;
        measured
            .record(EventType::NodeIdentity, "node", config.node_bytes())
            .map_err(|e| ErrorChain(&e).to_string())?;
        let shared = measured.shared();
        let nonce = format!("nonce of boot {n}");
        let document = TpmIssuer::new(shared.clone())
            .issue(nonce.as_bytes(), b"user data")
            .map_err(|e| ErrorChain(&e).to_string())?;
        let verified = validator
            .validate(&document, nonce.as_bytes(), b"user data")
            .map_err(|e| format!("validation: {}", ErrorChain(&e)))?;
        let secret = format!("secret of boot {n}");
        let sealed =
            keel_verifier::credential::seal(&verified.ek, &verified.ak.name, secret.as_bytes())
                .unwrap();
        let opened = credential::open(shared.lock().unwrap().tpm(), &sealed)
            .map_err(|e| format!("opening the sealed secret: {}", ErrorChain(&e)))?;
        if opened.as_slice() != secret.as_bytes() {
            return Err("the opened secret differs".to_owned());
        }
        std::sync::Arc::try_unwrap(shared)
            .map_err(|_| "the TPM is still shared".to_owned())?
            .into_inner()
            .map_err(|_| "the TPM lock is poisoned".to_owned())
    })();
    (state, attested)
}

#[test]
fn four_hard_kills_in_a_row_do_not_lock_the_tpm_out() {
    let ca = EkCa::new().unwrap();
    let mut swtpm = Swtpm::start(&ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let validator = validator(&ca, &config());

    let mut report = Vec::new();
    let mut outcomes = Vec::new();
    for n in 0..=KILLS {
        let (state, attested) = boot(&swtpm, dir.path(), n, &validator);
        report.push(format!(
            "boot {n}: failed_tries={} max_tries={} recovery={}s in_lockout={} \
             orderly_startup={} -> {}",
            state.failed_tries,
            state.max_tries,
            state.recovery_seconds,
            state.in_lockout,
            state.orderly_startup,
            attested.as_ref().map(|_| "attested").unwrap_or_else(|e| e)
        ));
        let ok = attested.is_ok();
        if n < KILLS {
            // The VM dies with the agent running: SIGKILL, no TPM2_Shutdown,
            // no control channel, and nothing of the agent runs afterwards
            // (its handle is forgotten, not dropped: no flushes).
            swtpm.kill_hard();
            std::mem::forget(attested);
            swtpm.restart().unwrap();
        }
        outcomes.push((state, ok));
    }
    let report = report.join("\n");
    eprintln!("{report}");

    // The test can tell: with DA counting, these kills would reach lockout.
    let first = outcomes[0].0;
    assert!(
        first.max_tries as usize <= KILLS,
        "max tries {} is out of reach of {KILLS} kills\n{report}",
        first.max_tries
    );
    for (n, (_, ok)) in outcomes.iter().enumerate() {
        assert!(ok, "boot {n} did not attest\n{report}");
    }
    for (n, (state, _)) in outcomes.iter().enumerate().skip(1) {
        assert!(
            !state.orderly_startup,
            "boot {n} followed an orderly shutdown: the kill did not model a crash\n{report}"
        );
    }
    for (n, (state, _)) in outcomes.iter().enumerate() {
        assert_eq!(
            (state.failed_tries, state.in_lockout),
            (0, false),
            "boot {n}: the kills were counted as failed authorisations\n{report}"
        );
    }
}

#[test]
fn shutdown_ends_the_tpm_cycle_orderly_and_retires_the_handle() {
    let ca = EkCa::new().unwrap();
    let mut swtpm = Swtpm::start(&ca).unwrap();
    let mut tpm = open(&swtpm);
    tpm.quote(&[1; 32], &[0, 12]).unwrap();
    tpm.shutdown().unwrap();
    assert!(matches!(
        tpm.quote(&[1; 32], &[0, 12]),
        Err(TpmError::ShutDown)
    ));
    assert!(matches!(tpm.pcr_read(&[0]), Err(TpmError::ShutDown)));
    assert!(matches!(tpm.shutdown(), Err(TpmError::ShutDown)));
    drop(tpm);

    // Even killed right after, the TPM's next cycle starts orderly.
    swtpm.kill_hard();
    swtpm.restart().unwrap();
    let mut tpm = open(&swtpm);
    assert!(tpm.lockout_state().unwrap().orderly_startup);
    tpm.quote(&[2; 32], &[0, 12]).unwrap();
    drop(tpm);

    // Without it, not.
    swtpm.kill_hard();
    swtpm.restart().unwrap();
    assert!(!open(&swtpm).lockout_state().unwrap().orderly_startup);
}

/// The agent binary running `run` on `swtpm` with its own state directory
/// (a boot: the event log starts empty), once it reported readiness.
fn start_agent(swtpm: &Swtpm, dir: &Path, boot: &str) -> Child {
    let config = dir.join("config.json");
    std::fs::write(&config, config_json()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel-agent"))
        .args(["--tcti", &swtpm.tcti(), "--state-dir"])
        .arg(dir.join(boot))
        .args(["run", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|line| line == "keel-agent: ready");
    assert!(ready, "the agent exited before it was ready");
    // Keep reading, so the agent never writes to a closed pipe.
    std::thread::spawn(move || lines.for_each(drop));
    child
}

fn wait(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the agent did not exit within 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_agent_stopped_by_sigterm_shuts_the_tpm_down() {
    let ca = EkCa::new().unwrap();
    let mut swtpm = Swtpm::start(&ca).unwrap();
    let dir = tempfile::tempdir().unwrap();

    // systemd stops the agent; then the VM is killed (or powers off without
    // the kernel's own TPM2_Shutdown): the TPM's next cycle is orderly.
    let mut agent = start_agent(&swtpm, dir.path(), "boot-1");
    kill(Pid::from_raw(agent.id() as i32), Signal::SIGTERM).unwrap();
    let status = wait(&mut agent);
    assert!(status.success(), "{status}");
    swtpm.kill_hard();
    swtpm.restart().unwrap();
    assert!(open(&swtpm).lockout_state().unwrap().orderly_startup);

    // An agent that is killed sends nothing: the next cycle is not orderly.
    let mut agent = start_agent(&swtpm, dir.path(), "boot-2");
    agent.kill().unwrap();
    let status = wait(&mut agent);
    assert!(!status.success());
    swtpm.kill_hard();
    swtpm.restart().unwrap();
    assert!(!open(&swtpm).lockout_state().unwrap().orderly_startup);
}
