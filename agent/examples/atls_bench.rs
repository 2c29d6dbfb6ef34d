//! Benchmark: mutual aTLS handshakes with TPM attestation (each side its own
//! swtpm), first-contact handshakes (both sides prove key residency with
//! TPM2_ActivateCredential) and cached ones (both AKs already proven), and
//! the CPU time of one validation and of one secret sealed to a TPM
//! (TPM2_MakeCredential in Rust: RSA-OAEP to the EK, then the AEAD).
//!
//! `cargo run --release -p keel-agent --example atls_bench -- [handshakes]`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_agent::attestation::issuer::TpmIssuer;
use keel_agent::measured::MeasuredTpm;
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_atls::{AtlsClient, AtlsServer};
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::ek::EkTrust;
use keel_verifier::measurement::EventType;
use keel_verifier::measurements::{Expected, Measurements};
use keel_verifier::validator::{Validator, Verified};

fn issuer(swtpm: &Swtpm, dir: &std::path::Path, config: &NodeConfig) -> Arc<TpmIssuer> {
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let mut m = MeasuredTpm::open(tpm, &dir.join("log")).unwrap();
    m.record(EventType::NodeConfig, "config", config.cluster_bytes())
        .unwrap();
    m.record(EventType::NodeIdentity, "node", config.node_bytes())
        .unwrap();
    Arc::new(TpmIssuer::new(m.shared()))
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn p95(v: &mut [Duration]) -> Duration {
    v.sort();
    v[(v.len() * 95 / 100).min(v.len() - 1)]
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(50);
    let ca = EkCa::new().unwrap();
    let (sw_server, sw_client) = (Swtpm::start(&ca).unwrap(), Swtpm::start(&ca).unwrap());
    // The runtime, and the servers' tasks with their TPM handles, end
    // before the swtpm processes do.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run(n, &ca, &sw_server, &sw_client));
}

async fn run(n: usize, ca: &EkCa, sw_server: &Swtpm, sw_client: &Swtpm) {
    let dir = tempfile::tempdir().unwrap();
    let config = NodeConfig::default();
    let server_issuer = issuer(sw_server, &dir.path().join("s"), &config);
    let client_issuer = issuer(sw_client, &dir.path().join("c"), &config);
    // swtpm: nothing measures into PCRs 4, 9 and 11, they stay zero.
    let m = Measurements::new([
        (4, Expected::enforced([0; 32])),
        (9, Expected::enforced([0; 32])),
        (11, Expected::enforced([0; 32])),
        (12, Expected::enforced(config.expected_config_pcr())),
    ])
    .unwrap();
    let validator = Arc::new(Validator::new(
        m,
        EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap(),
    ));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server: AtlsServer<Verified> = AtlsServer::mutual(server_issuer.clone(), validator.clone());
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let server = server.clone();
            tokio::spawn(async move {
                let _ = server.accept(tcp).await;
            });
        }
    });
    let client: AtlsClient<Verified> = AtlsClient::mutual(client_issuer.clone(), validator.clone());
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        let stream = client.connect("127.0.0.1", addr.port()).await.unwrap();
        times.push(start.elapsed());
        drop(stream);
    }
    // First contact: fresh validators on both sides for every connection,
    // so both challenge and both TPMs activate a credential.
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let fresh = {
        let (m, trust) = (validator.measurements().clone(), trust.clone());
        move || Arc::new(Validator::new(m.clone(), trust.clone()))
    };
    let first_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let first_addr = first_listener.local_addr().unwrap();
    tokio::spawn({
        let (server_issuer, fresh) = (server_issuer.clone(), fresh.clone());
        async move {
            loop {
                let (tcp, _) = first_listener.accept().await.unwrap();
                let server: AtlsServer<Verified> =
                    AtlsServer::mutual(server_issuer.clone(), fresh());
                tokio::spawn(async move {
                    let _ = server.accept(tcp).await;
                });
            }
        }
    });
    let mut first_times = Vec::with_capacity(n);
    for _ in 0..n {
        let client: AtlsClient<Verified> = AtlsClient::mutual(client_issuer.clone(), fresh());
        let start = Instant::now();
        let stream = client
            .connect("127.0.0.1", first_addr.port())
            .await
            .unwrap();
        first_times.push(start.elapsed());
        drop(stream);
    }

    let doc = server_issuer.issue(b"nonce", &[7; 32]).unwrap();
    let mut validations = Vec::with_capacity(n);
    let mut verified = None;
    for _ in 0..n {
        let start = Instant::now();
        verified = Some(validator.validate(&doc, b"nonce", &[7; 32]).unwrap());
        validations.push(start.elapsed());
    }
    let verified = verified.unwrap();
    let mut seals = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        keel_verifier::credential::seal(&verified.ek, &verified.ak.name, &[9; 64]).unwrap();
        seals.push(start.elapsed());
    }
    let mut quotes = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        server_issuer.issue(b"nonce", &[7; 32]).unwrap();
        quotes.push(start.elapsed());
    }
    println!(
        "mutual aTLS handshake with TPM attestation, AKs proven before ({n} runs): median {:?}, p95 {:?}",
        median(&mut times),
        p95(&mut times)
    );
    println!(
        "mutual aTLS handshake, first contact: both sides prove key residency ({n} runs): median {:?}, p95 {:?}",
        median(&mut first_times),
        p95(&mut first_times)
    );
    println!(
        "one attestation document (quote; PCR values read again only when they changed): median {:?}",
        median(&mut quotes)
    );
    println!(
        "one validation (single thread, CPU bound): median {:?}, p95 {:?}",
        median(&mut validations),
        p95(&mut validations)
    );
    println!(
        "one secret sealed to the peer's TPM (MakeCredential: RSA-OAEP to the EK; AEAD): median {:?}, p95 {:?}",
        median(&mut seals),
        p95(&mut seals)
    );
}
