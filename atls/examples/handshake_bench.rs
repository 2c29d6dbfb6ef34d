//! Measures aTLS on loopback: the median time of a mutual aTLS handshake
//! (TCP connect, both documents issued and validated, confirmation), of a
//! handshake followed by one unary gRPC call, and the median CPU time of one
//! validation of a peer certificate (parse, key and algorithm checks, document).
//!
//! Uses the Ed25519 test attestation scheme of the tests; swap in another
//! issuer and validator in `main` to measure those.
//!
//! ```text
//! cargo run --release -p keel-atls --example handshake_bench -- [ROUNDS]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::{mutual_client, mutual_server, TestIssuer, TestServer};
use keel_atls::{cert, danger, Issuer, Nonce, Validator};
use keel_proto::kms::key_service_client::KeyServiceClient;
use keel_proto::kms::GetDataKeyRequest;
use nix::time::{clock_gettime, ClockId};

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn percentile(mut samples: Vec<Duration>, p: usize) -> Duration {
    samples.sort();
    samples[(samples.len() * p / 100).min(samples.len() - 1)]
}

fn thread_cpu_time() -> Duration {
    let t = clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).expect("thread CPU clock");
    Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32)
}

/// CPU time of what a verifier does with one peer certificate.
fn validation_cpu_times<I: Issuer, V: Validator>(
    issuer: &I,
    validator: &V,
    rounds: usize,
) -> Vec<Duration> {
    let rng = danger::provider().secure_random;
    (0..rounds)
        .map(|_| {
            let nonce = Nonce::generate(rng).unwrap();
            let certified = danger::attested_certificate(issuer, &nonce).unwrap();
            let der = certified.cert[0].as_ref().to_vec();
            let start = thread_cpu_time();
            let embedded = cert::extract(&der).unwrap();
            validator
                .validate(&embedded.document, nonce.as_bytes(), &embedded.user_data)
                .unwrap_or_else(|e| panic!("validation failed: {e}"));
            thread_cpu_time() - start
        })
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("ROUNDS is a number"))
        .unwrap_or(200);
    let server_issuer = TestIssuer::generate();
    let client_issuer = TestIssuer::generate();
    let server = TestServer::start(mutual_server(&server_issuer, &client_issuer)).await;
    let client = mutual_client(&client_issuer, &server_issuer);

    // Warm up.
    for _ in 0..10 {
        client
            .connect("127.0.0.1", server.addr.port())
            .await
            .unwrap();
    }

    let mut handshakes = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = std::time::Instant::now();
        let stream = client
            .connect("127.0.0.1", server.addr.port())
            .await
            .unwrap();
        handshakes.push(start.elapsed());
        drop(stream);
    }

    let mut with_call = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = std::time::Instant::now();
        let bound = client.bind_channel(server.endpoint()).await.unwrap();
        KeyServiceClient::new(bound.channel)
            .get_data_key(GetDataKeyRequest {
                data_key_id: "bench".into(),
                length: 32,
            })
            .await
            .unwrap();
        with_call.push(start.elapsed());
    }

    let validations =
        validation_cpu_times(server_issuer.as_ref(), &server_issuer.validator(), rounds);

    println!("rounds: {rounds}");
    println!(
        "mutual aTLS handshake: median {:?}, p90 {:?}",
        median(handshakes.clone()),
        percentile(handshakes, 90)
    );
    println!(
        "mutual aTLS handshake + one unary gRPC call: median {:?}, p90 {:?}",
        median(with_call.clone()),
        percentile(with_call, 90)
    );
    println!(
        "one validation (certificate checks + validator), CPU time: median {:?}, p90 {:?}",
        median(validations.clone()),
        percentile(validations, 90)
    );
}
