//! Benchmark: the agent's footprint. Starts the release `keel-agent` binary
//! (built here) against a freshly manufactured swtpm and prints
//!
//! * the time from exec to its init port listening, and to the first
//!   completed attested handshake (key creation in the TPM, the quote and the
//!   key residency proof included);
//! * its resident memory when idle, before and after load;
//! * its peak resident memory while 100 clients at once make attested
//!   handshakes and a call on it, several rounds, and the most threads it
//!   ran meanwhile.
//!
//! `cargo run --release -p keel-agent --example footprint_bench -- [rounds]`
//! (`KEEL_AGENT=<path>` measures another build of the agent instead)
//!
//! The load is on the init port, which every node serves: server-attested
//! aTLS (each handshake a document from the agent's TPM issuer, batched like
//! the join service's, and a residency proof the first time a verifier sees
//! its key) and the operator API's `Challenge`. Outside a VM the agent
//! cannot become a control plane (that installs Kubernetes under `/` and
//! runs kubeadm), so it cannot serve joins here; `join_bench` measures the
//! join service itself, in-process.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_atls::AtlsClient;
use keel_proto::operator::operator_service_client::OperatorServiceClient;
use keel_proto::operator::ChallengeRequest;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::ek::EkTrust;
use keel_verifier::measurements::{Expected, Measurements};
use keel_verifier::validator::{Validator, Verified};
use tonic::transport::Endpoint;

const CLIENTS: usize = 100;

/// Builds the `keel-agent` binary with this example's profile; returns its
/// path.
fn build_agent() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or("cargo".into()));
    build.args([
        "build",
        "--quiet",
        "-p",
        "keel-agent",
        "--bin",
        "keel-agent",
    ]);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    assert!(build.status().unwrap().success(), "building keel-agent");
    profile_dir.join("keel-agent")
}

fn free_port() -> u16 {
    keel_testkit::free_port().unwrap()
}

/// `/proc/<pid>/status`, read once.
struct Status(String);

impl Status {
    fn of(pid: u32) -> Self {
        Self(std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap())
    }

    /// A number field (memory fields are in KiB).
    fn number(&self, name: &str) -> u64 {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

/// RSS with its parts: anonymous memory (heap, stacks) and file pages (the
/// binary's code and data that were touched).
fn rss(pid: u32) -> String {
    let status = Status::of(pid);
    format!(
        "{} (anonymous {}, file {})",
        mib(status.number("VmRSS:")),
        mib(status.number("RssAnon:")),
        mib(status.number("RssFile:"))
    )
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// The agent process; stopped (SIGTERM, then waited for) when dropped.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// One attested handshake and a `Challenge` call on it.
async fn call(client: &AtlsClient<Verified>, port: u16) -> Result<(), String> {
    let uri = Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap();
    let bound = client
        .bind_channel(uri)
        .await
        .map_err(|e| keel_atls::ErrorChain(&e).to_string())?;
    OperatorServiceClient::new(bound.channel)
        .challenge(ChallengeRequest {})
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn config_json(ca: &EkCa, init_port: u16, join_port: u16) -> String {
    let ek_ca = String::from_utf8(ca.issuer_pem().unwrap()).unwrap();
    serde_json::json!({
        "cluster": {
            "ek_ca_pem": ek_ca,
            "init_port": init_port,
            "join_port": join_port,
            "init_secret_hash": keel_verifier::init_secret::hash(b"footprint").unwrap(),
        },
        "node": {"name": "cp-0", "role": "control-plane"},
    })
    .to_string()
}

fn validator(ca: &EkCa, config: &NodeConfig) -> Validator {
    // swtpm: nothing measures into PCRs 4, 9 and 11, they stay zero.
    let m = Measurements::new([
        (4, Expected::enforced([0; 32])),
        (9, Expected::enforced([0; 32])),
        (11, Expected::enforced([0; 32])),
        (12, Expected::enforced(config.expected_config_pcr())),
        (15, Expected::enforced([0; 32])),
    ])
    .unwrap();
    Validator::new(m, EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap())
}

fn start(binary: &Path, swtpm: &Swtpm, dir: &Path, config: &Path) -> Agent {
    Agent(
        Command::new(binary)
            .args(["--tcti", &swtpm.tcti(), "--state-dir"])
            .arg(dir)
            .arg("run")
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// What the benchmark measured.
struct Figures {
    listening: Duration,
    first_handshake: Duration,
    first_call: Duration,
    idle_start: String,
    idle_served: String,
    peak: u64,
    sampled_peak: u64,
    /// The most threads sampled under load.
    threads: u64,
    calls: Vec<Duration>,
    load_time: Duration,
    idle_after: String,
}

/// Waits until something listens on `port` (at most 10 s); returns when.
async fn listening(port: u16, since: Instant) -> Result<Duration, String> {
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(since.elapsed());
        }
        if since.elapsed() > Duration::from_secs(10) {
            return Err(format!("the agent did not listen on {port}"));
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
}

/// A node config for an agent on `ca`'s TPMs, written to `dir`.
fn write_config(ca: &EkCa, dir: &Path) -> (PathBuf, NodeConfig, u16) {
    let (init_port, join_port) = (free_port(), free_port());
    let json = config_json(ca, init_port, join_port);
    let path = dir.join("node-config.json");
    std::fs::write(&path, &json).unwrap();
    let config = NodeConfig::parse(json.as_bytes(), "bench".as_ref()).unwrap();
    (path, config, init_port)
}

/// Runs every measurement; the agents and TPMs it starts are stopped when
/// it returns, also on failure.
async fn measure(binary: &Path, rounds: usize) -> Result<Figures, String> {
    let ca = EkCa::new().map_err(|e| e.to_string())?;
    // A freshly manufactured TPM: the agent creates its attestation key at
    // its first quote.
    let swtpm = Swtpm::start(&ca).map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().unwrap();
    let (config_path, config, init_port) = write_config(&ca, dir.path());
    let validator = Arc::new(validator(&ca, &config));
    let client: AtlsClient<Verified> = AtlsClient::server_attested(validator.clone());

    let exec = Instant::now();
    let agent = start(binary, &swtpm, dir.path(), &config_path);
    let pid = agent.0.id();
    let listening_after = listening(init_port, exec).await?;
    let uri = Endpoint::from_shared(format!("http://127.0.0.1:{init_port}")).unwrap();
    let first = client
        .bind_channel(uri)
        .await
        .map_err(|e| keel_atls::ErrorChain(&e).to_string())?;
    let first_handshake = exec.elapsed();
    drop(first);
    call(&client, init_port).await?;
    let first_call = exec.elapsed();

    // Idle before any connection: a second agent on its own fresh TPM,
    // left alone for a second after it listens.
    let idle_start = {
        let swtpm = Swtpm::start(&ca).map_err(|e| e.to_string())?;
        let dir = tempfile::tempdir().unwrap();
        let (config_path, _, init_port) = write_config(&ca, dir.path());
        let quiet = start(binary, &swtpm, dir.path(), &config_path);
        listening(init_port, Instant::now()).await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        rss(quiet.0.id())
    };
    let idle_served = rss(pid);

    // Load: CLIENTS at once, `rounds` times, each a new handshake and call
    // (the verifier's key cache spares the agent a residency proof after
    // the first); RSS sampled meanwhile, and the kernel's peak after.
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        std::thread::spawn(move || {
            let (mut peak, mut threads) = (0, 0);
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                let status = Status::of(pid);
                peak = peak.max(status.number("VmRSS:"));
                threads = threads.max(status.number("Threads:"));
                std::thread::sleep(Duration::from_millis(2));
            }
            (peak, threads)
        })
    };
    let load = Instant::now();
    let mut calls = Vec::new();
    let mut failure = None;
    for _ in 0..rounds {
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|i| {
                // Each from its own loopback address, as distinct clients
                // would be: the init port holds a source to 2 connections.
                let last = u8::try_from(i % 250).unwrap_or(0) + 1;
                let client = client
                    .clone()
                    .with_local_address(std::net::IpAddr::from([127, 2, 0, last]));
                tokio::spawn(async move {
                    let t = Instant::now();
                    call(&client, init_port).await.map(|()| t.elapsed())
                })
            })
            .collect();
        for t in tasks {
            match t.await.map_err(|e| e.to_string()).and_then(|r| r) {
                Ok(latency) => calls.push(latency),
                Err(e) => failure = Some(e),
            }
        }
    }
    let load_time = load.elapsed();
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let (sampled_peak, threads) = sampler.join().unwrap_or((0, 0));
    if let Some(e) = failure {
        return Err(format!("a call failed under load: {e}"));
    }
    let peak = Status::of(pid).number("VmHWM:");
    // The runtime's blocking threads end after 10 s without work.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let idle_after = rss(pid);
    calls.sort();
    Ok(Figures {
        listening: listening_after,
        first_handshake,
        first_call,
        idle_start,
        idle_served,
        peak,
        sampled_peak,
        threads,
        calls,
        load_time,
        idle_after,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let binary = std::env::var_os("KEEL_AGENT").map_or_else(build_agent, PathBuf::from);
    let f = match measure(&binary, rounds).await {
        Ok(f) => f,
        Err(e) => {
            eprintln!("footprint_bench: {e}");
            std::process::exit(1);
        }
    };
    let p = |q: usize| f.calls[(f.calls.len() * q / 100).min(f.calls.len() - 1)];
    println!("keel-agent footprint ({}, swtpm)", binary.display());
    println!(
        "  exec -> init port listening                          {:.1?}",
        f.listening
    );
    println!(
        "  exec -> first attested handshake (fresh TPM: AK created, quote, residency proof)  {:.1?}",
        f.first_handshake
    );
    println!(
        "  exec -> first handshake and call completed           {:.1?}",
        f.first_call
    );
    println!(
        "  RSS idle after start, no connection yet              {}",
        f.idle_start
    );
    println!(
        "  RSS idle after its first handshake and call          {}",
        f.idle_served
    );
    println!(
        "  RSS peak, {CLIENTS} concurrent attested handshakes + call, {rounds} rounds: {} \
         (sampled max {}, at most {} threads); {} calls in {:.2?}, median {:.1?}, p95 {:.1?}",
        mib(f.peak),
        mib(f.sampled_peak),
        f.threads,
        f.calls.len(),
        f.load_time,
        p(50),
        p(95)
    );
    println!(
        "  RSS idle 12 s after the load                         {}",
        f.idle_after
    );
}
