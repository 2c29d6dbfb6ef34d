//! Benchmark: join tickets per second and latency at 1, 10 and 100
//! concurrent clients.
//!
//! `cargo run --release -p keel-agent --example join_bench -- [tickets per level]`
//!
//! One join service (its own swtpm, stand-in kubeadm registering each
//! ticket's bootstrap token) and 4 swtpm-backed members; each client task
//! uses one member's TPM, so 100 clients share 4 TPMs. Every request is a
//! full mutual aTLS handshake (a fresh quote on each side over the peer's
//! nonce) plus `IssueJoinTicket`; latency is measured from connect to the
//! received ticket (opening it with the TPM is not included).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

#[path = "../tests/join_common/mod.rs"]
mod join_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_agent::join::KubeletKey;
use keel_proto::join::IssueJoinTicketRequest;
use keel_testkit::swtpm::EkCa;
use tokio::sync::Mutex;

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// Builds `keel-standin` with this example's profile; returns its path.
fn build_standin() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let mut build = std::process::Command::new(std::env::var_os("CARGO").unwrap_or("cargo".into()));
    build.args([
        "build",
        "--quiet",
        "-p",
        "keel-testkit",
        "--bin",
        "keel-standin",
    ]);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    assert!(build.status().unwrap().success(), "building keel-standin");
    profile_dir.join("keel-standin")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let per_level: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    join_common::STANDIN.set(build_standin()).unwrap();
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let service = join_common::start_service(&ca, port).await;
    let members: Vec<_> = (0..4)
        .map(|i| {
            let m = join_common::member(&ca, port, &format!("w-{i}"), "worker");
            let t = m.tickets(&ca);
            (m, t)
        })
        .collect();
    let members = Arc::new(members);
    println!("tickets per level: {per_level}; 4 member TPMs; service TPM quotes per handshake");
    println!("clients  tickets/s  median    p95");
    for clients in [1usize, 10, 100] {
        let remaining = Arc::new(Mutex::new(per_level));
        let latencies = Arc::new(Mutex::new(Vec::with_capacity(per_level)));
        let start = Instant::now();
        let tasks: Vec<_> = (0..clients)
            .map(|c| {
                let (members, remaining, latencies) =
                    (members.clone(), remaining.clone(), latencies.clone());
                let endpoint = service.endpoint.clone();
                tokio::spawn(async move {
                    let (m, tickets) = &members[c % members.len()];
                    loop {
                        {
                            let mut left = remaining.lock().await;
                            if *left == 0 {
                                return;
                            }
                            *left -= 1;
                        }
                        let key = KubeletKey::generate(&m.name).unwrap();
                        let request = IssueJoinTicketRequest {
                            disk_uuid: join_common::uuid(),
                            kubelet_csr: key.csr_pem().as_bytes().to_vec(),
                            is_control_plane: false,
                            node_name: m.name.clone(),
                        };
                        let t = Instant::now();
                        tickets
                            .request_join_ticket(&endpoint, request)
                            .await
                            .unwrap_or_else(|e| panic!("{}", keel_atls::ErrorChain(&e)));
                        latencies.lock().await.push(t.elapsed());
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let wall = start.elapsed();
        let mut l = latencies.lock().await.clone();
        l.sort();
        println!(
            "{clients:>7}  {:>9.1}  {:>7.1?}  {:>7.1?}",
            l.len() as f64 / wall.as_secs_f64(),
            percentile(&l, 50),
            percentile(&l, 95)
        );
    }
    println!(
        "tokens registered: {}, RSS {} KiB",
        service.registered_tokens().len(),
        join_common::rss_kib()
    );
}
