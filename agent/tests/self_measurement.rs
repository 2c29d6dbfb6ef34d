//! The agent binary measures its config into the TPM before using it, and its
//! event log replays to the TPM's PCRs. Each test runs the real binary
//! against its own swtpm.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

use keel_agent::tpm::{TctiSpec, Tpm};
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::measurement::{event_digest, extend, pcr, replay, Event, EventType};

const CONFIG_A: &str = r#"{"cluster":{"control_plane_endpoints":["10.0.0.1:9090"]},"node":{"name":"a","role":"worker"}}"#;
const CONFIG_B: &str = r#"{"cluster":{"control_plane_endpoints":["10.0.0.2:9090"]},"node":{"name":"a","role":"worker"}}"#;

struct Node {
    _ca: EkCa,
    swtpm: Swtpm,
    dir: tempfile::TempDir,
}

impl Node {
    fn new() -> Self {
        let ca = EkCa::new().unwrap();
        let swtpm = Swtpm::start(&ca).unwrap();
        Self {
            _ca: ca,
            swtpm,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn agent(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_keel-agent"))
            .args(["--tcti", &self.swtpm.tcti(), "--state-dir"])
            .arg(self.dir.path().join("state"))
            .args(args)
            .output()
            .unwrap()
    }

    fn run_with(&self, config: &str) -> Output {
        let path = self.dir.path().join("config.json");
        std::fs::write(&path, config).unwrap();
        let out = self.agent(&["run", "--once", "--config", path.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn pcrs(&self) -> std::collections::BTreeMap<u32, [u8; 32]> {
        Tpm::open(&self.swtpm.tcti().parse::<TctiSpec>().unwrap())
            .unwrap()
            .pcr_read_all()
            .unwrap()
    }

    fn log_path(&self) -> std::path::PathBuf {
        self.dir.path().join("state/eventlog.jsonl")
    }

    fn events(&self) -> Vec<Event> {
        read_log(&self.log_path())
    }
}

fn read_log(path: &Path) -> Vec<Event> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn config_pcr_is_the_replay_of_the_logged_config() {
    let node = Node::new();
    let out = node.run_with(CONFIG_A);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("keel-agent: ready"));
    let pcrs = node.pcrs();
    let events = node.events();
    assert_eq!(events.len(), 2);
    assert_eq!(replay(&events).unwrap()[&pcr::CONFIG], pcrs[&pcr::CONFIG]);
    let expected = extend(
        &[0; 32],
        &event_digest(0, EventType::NodeConfig, &events[0].data),
    );
    assert_eq!(pcrs[&pcr::CONFIG], expected);
    assert!(stdout.contains(&format!(
        "pcr 12 sha256:{}",
        hex::encode(pcrs[&pcr::CONFIG])
    )));
    // The agent's own verdict agrees.
    let check = node.agent(&["eventlog"]);
    assert!(String::from_utf8_lossy(&check.stdout).contains("replay: ok (2 events)"));
}

#[test]
fn other_config_other_value_same_config_same_value() {
    let a1 = Node::new();
    let a2 = Node::new();
    let b = Node::new();
    a1.run_with(CONFIG_A);
    // Same config, different key order and spacing: the canonical form is the same.
    a2.run_with(&CONFIG_A.replace(
        "{\"name\":\"a\",\"role\":\"worker\"}",
        "{ \"role\": \"worker\", \"name\": \"a\" }",
    ));
    b.run_with(CONFIG_B);
    assert_eq!(a1.pcrs()[&pcr::CONFIG], a2.pcrs()[&pcr::CONFIG]);
    assert_ne!(a1.pcrs()[&pcr::CONFIG], b.pcrs()[&pcr::CONFIG]);
    assert_ne!(a1.pcrs()[&pcr::CONFIG], [0; 32]);
}

#[test]
fn restart_in_the_same_boot_does_not_measure_twice() {
    let node = Node::new();
    node.run_with(CONFIG_A);
    let first = node.pcrs();
    node.run_with(CONFIG_A);
    assert_eq!(node.pcrs(), first);
    assert_eq!(node.events().len(), 2);
    // A different config within the same boot is refused.
    let path = node.dir.path().join("config.json");
    std::fs::write(&path, CONFIG_B).unwrap();
    let out = node.agent(&["run", "--once", "--config", path.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already measured"));
}

#[test]
fn tampered_event_log_fails_replay() {
    let node = Node::new();
    node.run_with(CONFIG_A);
    let original = std::fs::read_to_string(node.log_path()).unwrap();
    let lines: Vec<&str> = original.lines().collect();

    let mut events = node.events();
    let changed = String::from_utf8(events[0].data.clone())
        .unwrap()
        .replace("10.0.0.1", "10.0.0.9");
    // Changed data with its digest left alone, and changed consistently.
    events[0].data = changed.clone().into_bytes();
    let stale_digest = serde_json::to_string(&events[0]).unwrap();
    let recomputed = serde_json::to_string(&Event::new(
        0,
        events[0].event_type,
        events[0].description.clone(),
        changed.into_bytes(),
    ))
    .unwrap();
    let cases = [
        ("changed data", format!("{stale_digest}\n{}\n", lines[1])),
        ("changed entry", format!("{recomputed}\n{}\n", lines[1])),
        ("removed", format!("{}\n", lines[1])),
        ("reordered", format!("{}\n{}\n", lines[1], lines[0])),
    ];
    for (what, content) in cases {
        std::fs::write(node.log_path(), content).unwrap();
        let out = node.agent(&["eventlog"]);
        assert!(!out.status.success(), "{what} log was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("does not replay"), "{what}: {stderr}");
    }
}

#[test]
fn measurement_interrupted_before_extend_is_completed() {
    let node = Node::new();
    node.run_with(CONFIG_A);
    let before = node.pcrs();
    // Simulate a crash after the write-ahead append of a new event.
    let extra = Event::new(2, EventType::Component, "kubelet", b"kubelet".to_vec());
    let mut content = std::fs::read_to_string(node.log_path()).unwrap();
    content.push_str(&serde_json::to_string(&extra).unwrap());
    content.push('\n');
    std::fs::write(node.log_path(), content).unwrap();
    // `eventlog` only reads: it names the pending event...
    let out = node.agent(&["eventlog"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("last event is not extended yet"),
        "{stderr}"
    );
    assert_eq!(node.pcrs(), before);
    // ...and the agent's next start completes it.
    node.run_with(CONFIG_A);
    let after = node.pcrs();
    assert_ne!(after[&pcr::NODE], before[&pcr::NODE]);
    assert_eq!(
        replay(&node.events()).unwrap()[&pcr::NODE],
        after[&pcr::NODE]
    );
}

/// Only a line the agent could have written is completed: a last line
/// naming another PCR (one the firmware owns), or whose digest is not over
/// its data, or out of sequence, is refused, and no PCR moves.
#[test]
fn a_pending_line_the_agent_did_not_write_is_not_extended() {
    let node = Node::new();
    node.run_with(CONFIG_A);
    let before = node.pcrs();
    let original = std::fs::read_to_string(node.log_path()).unwrap();
    let mut wrong_pcr = Event::new(2, EventType::Component, "kubelet", b"kubelet".to_vec());
    wrong_pcr.pcr = 4;
    let mut wrong_digest = Event::new(2, EventType::Component, "kubelet", b"kubelet".to_vec());
    wrong_digest.data = b"something else".to_vec();
    let wrong_seq = Event::new(7, EventType::Component, "kubelet", b"kubelet".to_vec());
    let path = node.dir.path().join("config.json");
    std::fs::write(&path, CONFIG_A).unwrap();
    for (what, event) in [
        ("another PCR", wrong_pcr),
        ("a digest not over its data", wrong_digest),
        ("out of sequence", wrong_seq),
    ] {
        let line = serde_json::to_string(&event).unwrap();
        std::fs::write(node.log_path(), format!("{original}{line}\n")).unwrap();
        let out = node.agent(&["run", "--once", "--config", path.to_str().unwrap()]);
        assert!(!out.status.success(), "{what}: the agent started");
        assert_eq!(node.pcrs(), before, "{what}: a PCR moved");
    }
}

#[test]
fn an_append_cut_short_by_a_crash_is_dropped_and_cut_off() {
    let node = Node::new();
    node.run_with(CONFIG_A);
    let before = node.pcrs();
    let original = std::fs::read(node.log_path()).unwrap();
    // A crash in the middle of appending an event: never extended.
    let extra = Event::new(2, EventType::Component, "kubelet", b"kubelet".to_vec());
    let line = serde_json::to_vec(&extra).unwrap();
    let mut content = original.clone();
    content.extend_from_slice(&line[..line.len() / 2]);
    std::fs::write(node.log_path(), content.clone()).unwrap();

    // `eventlog` reads past the cut line and leaves the file alone...
    let out = node.agent(&["eventlog"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("replay: ok (2 events)"));
    assert_eq!(std::fs::read(node.log_path()).unwrap(), content);
    // ...the agent's next start cuts it off.
    node.run_with(CONFIG_A);
    assert_eq!(std::fs::read(node.log_path()).unwrap(), original);
    assert_eq!(node.pcrs(), before);
    assert_eq!(
        replay(&node.events()).unwrap()[&pcr::CONFIG],
        node.pcrs()[&pcr::CONFIG]
    );
}

/// Under systemd the soft limit of open files is 1024, fewer than the
/// ports' bounds on open connections: the agent raises its own soft limit
/// (to 16384, within the hard limit) before it serves.
#[test]
fn the_agent_raises_its_open_file_limit_before_serving() {
    use std::io::BufRead as _;
    let node = Node::new();
    let port = keel_testkit::free_port().unwrap();
    let config = node.dir.path().join("config.json");
    let json =
        format!(r#"{{"cluster":{{"init_port":{port}}},"node":{{"name":"a","role":"worker"}}}}"#);
    std::fs::write(&config, json).unwrap();
    let mut agent = Command::new("prlimit")
        // The soft limit only: raising the hard one needs a privilege a
        // test may lack.
        .arg("--nofile=256:")
        .arg(env!("CARGO_BIN_EXE_keel-agent"))
        .args(["--tcti", &node.swtpm.tcti(), "--state-dir"])
        .arg(node.dir.path().join("state"))
        .args(["run", "--config"])
        .arg(&config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = agent.stdout.take().unwrap();
    let ready = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|line| line == "keel-agent: ready");
    // prlimit execs the agent: same process.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", agent.id())).unwrap();
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(ready, "the agent never got ready");
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let fields: Vec<&str> = open_files.split_whitespace().collect();
    let (soft, hard): (u64, u64) = (fields[3].parse().unwrap(), fields[4].parse().unwrap());
    assert!(hard > 256, "{open_files}");
    assert_eq!(soft, hard.min(16384), "{open_files}");
}

/// "ready" means the init port accepts connections: an operator who acts on
/// the line at once is not refused. A port the agent cannot bind is no
/// ready node: it exits with an error naming the port, having said nothing.
#[test]
fn the_agent_is_ready_only_once_its_init_port_listens() {
    use std::io::BufRead as _;
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let free = keel_testkit::free_port().unwrap();
    // A node per start: a boot measures one config.
    let start = |node: &Node, port: u16| {
        let config = node.dir.path().join("config.json");
        let json = format!(
            r#"{{"cluster":{{"init_port":{port}}},"node":{{"name":"a","role":"worker"}}}}"#
        );
        std::fs::write(&config, json).unwrap();
        Command::new(env!("CARGO_BIN_EXE_keel-agent"))
            .args(["--tcti", &node.swtpm.tcti(), "--state-dir"])
            .arg(node.dir.path().join("state"))
            .args(["run", "--config"])
            .arg(&config)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };

    let node = Node::new();
    let mut agent = start(&node, free);
    // Read on a thread, so an agent that stalls before the line fails the
    // test at a deadline instead of holding it.
    let stdout = agent.stdout.take().unwrap();
    let (said, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let ready = std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "keel-agent: ready");
        let _ = said.send(ready);
    });
    let ready = ready_rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .unwrap_or(false);
    let connected = std::net::TcpStream::connect(("127.0.0.1", free));
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(ready, "the agent never got ready");
    connected.expect("the init port refused a connection right after ready");

    let other = Node::new();
    let mut agent = start(&other, taken.local_addr().unwrap().port());
    // An agent that went on without its port would never exit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while agent.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = agent.kill();
            panic!("the agent kept running without its init port");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = agent.wait_with_output().unwrap();
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("keel-agent: ready"), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "binding the init port 0.0.0.0:{}",
            taken.local_addr().unwrap().port()
        )),
        "{stderr}"
    );
}
