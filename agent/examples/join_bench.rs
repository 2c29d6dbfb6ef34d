//! Benchmark: join tickets per second and latency at 1, 10 and 100
//! concurrent clients, and where the time of a ticket goes.
//!
//! `cargo run --release -p keel-agent --example join_bench -- [tickets per level [clients ...]]`
//! (levels default to 1, 10 and 100 clients)
//!
//! One join service (its own swtpm, a node registry recording each ticket
//! as on a control plane; the requests ask for file discovery, as nodes do,
//! so no bootstrap token is made and no kubeadm runs) and, per level, 4
//! fresh swtpm-backed members;
//! tickets go to the members in turn, so 100 clients share 4 TPMs (and one
//! EK never has more disks bound than the service allows). Every request is
//! a full mutual aTLS handshake (a fresh quote on each side, each covering
//! the peer's nonce; both sides' TPM issuers batch concurrent requests into
//! one quote) plus `IssueJoinTicket`; latency is measured from connect to
//! the received ticket (opening it with the TPM is not included). Each
//! client connects from its own loopback address (127.1.0.N), as distinct
//! nodes would: the service's per-source handshake bounds apply to each. The
//! members' AKs are proven resident once, at their first handshake, and
//! cached by the service like any verifier's.
//!
//! The service runs on its own runtime (threads `keel-service`), the
//! clients on another (`keel-client`), each with two workers, as two
//! processes would. After each level the bench prints the CPU time per
//! ticket of each party: the service's threads, the clients' threads, the
//! service's swtpm, the members' swtpms, and the kubeadm runs (children
//! that ended). The breakdown after it sums the agent's tracing spans over
//! the level (both sides) and divides by the tickets: time inside each
//! operation, not CPU time, so on a loaded machine it includes waiting for
//! a core.
//!
//! The service's stores, the stand-in kubeadm's token records and the TPMs'
//! state are files in the system's temporary directory (`TMPDIR`). On an
//! ext4 without a journal the kernel does not reuse an inode freed in the
//! last minute or more, and scans past every such inode when it creates a
//! file: the more files the bench (or anything else) deleted lately, the
//! more each new file costs, mostly in the kubeadm runs. A node's state
//! disk is ext4 with a journal; `TMPDIR=/dev/shm` measures without that
//! cost (and without a disk under `fsync`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

#[path = "../tests/join_common/mod.rs"]
mod join_common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use keel_agent::disk_bindings::MAX_DISKS_PER_EK;
use keel_agent::join::KubeletKey;
use keel_proto::join::IssueJoinTicketRequest;
use keel_testkit::swtpm::EkCa;
use tokio::sync::Mutex;
use tracing::span;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer;

/// Busy and total jiffies of all CPUs so far (`/proc/stat`).
fn cpu_jiffies() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// CPU time so far, in ns, of the parties of a level.
#[derive(Clone, Copy, Default)]
struct PartyCpu {
    service: u64,
    clients: u64,
    other_threads: u64,
    service_tpm: u64,
    member_tpms: u64,
    /// Children that ended and were waited for: the kubeadm runs.
    ended_children: u64,
}

impl PartyCpu {
    /// Reads this process's threads and the given swtpm processes. A
    /// thread that ended takes its time with it: the runtimes keep theirs
    /// (blocking threads live 10 s after their last task).
    fn now(service_tpm: Option<u32>, member_tpms: &[Option<u32>]) -> Self {
        let mut cpu = Self::default();
        if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
            for task in tasks.flatten() {
                let Some(tid) = task
                    .file_name()
                    .to_str()
                    .and_then(|t| t.parse::<i32>().ok())
                else {
                    continue;
                };
                let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
                // CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED of thread `tid`.
                let ns = cpu_clock_ns((!tid << 3) | 6);
                match comm.trim_end() {
                    "keel-service" => cpu.service += ns,
                    "keel-client" => cpu.clients += ns,
                    _ => cpu.other_threads += ns,
                }
            }
        }
        // CPUCLOCK_SCHED of process `pid`.
        let process = |pid: u32| i32::try_from(pid).map_or(0, |pid| cpu_clock_ns((!pid << 3) | 2));
        cpu.service_tpm = service_tpm.map_or(0, process);
        cpu.member_tpms = member_tpms.iter().flatten().map(|&p| process(p)).sum();
        cpu.ended_children = ended_children_ns();
        cpu
    }

    /// Prints `self - before` per ticket, in ms.
    fn print_since(&self, before: &Self, tickets: usize) {
        let per = |after: u64, before: u64| {
            after.saturating_sub(before) as f64 / 1e6 / tickets.max(1) as f64
        };
        let parts = [
            ("service threads", per(self.service, before.service)),
            ("client threads", per(self.clients, before.clients)),
            ("service swtpm", per(self.service_tpm, before.service_tpm)),
            ("member swtpms", per(self.member_tpms, before.member_tpms)),
            (
                "kubeadm runs",
                per(self.ended_children, before.ended_children),
            ),
            (
                "other threads",
                per(self.other_threads, before.other_threads),
            ),
        ];
        let total: f64 = parts.iter().map(|p| p.1).sum();
        let shown: Vec<String> = parts
            .iter()
            .map(|(name, ms)| format!("{name} {ms:.2}"))
            .collect();
        println!(
            "    CPU per ticket, ms: {}; in all {total:.2}",
            shown.join(", ")
        );
    }
}

/// The time on the CPU clock `clock` (a thread's or a process's scheduler
/// clock, exact to the ns, unlike `/proc`'s clock ticks), 0 if it is gone.
fn cpu_clock_ns(clock: i32) -> u64 {
    // An unknown clock (an ended thread or process) fails with EINVAL.
    nix::time::clock_gettime(nix::time::ClockId::from_raw(clock)).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}

/// The CPU time of this process's children that ended and were waited for.
fn ended_children_ns() -> u64 {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_CHILDREN).map_or(0, |usage| {
        let ns = |t: nix::sys::time::TimeVal| {
            t.tv_sec() as u64 * 1_000_000_000 + t.tv_usec() as u64 * 1_000
        };
        ns(usage.user_time()) + ns(usage.system_time())
    })
}

/// The loopback address client `i` connects from: the service bounds
/// handshakes per source address, and these clients stand in for as many
/// nodes, each with its own address.
fn source(i: usize) -> std::net::IpAddr {
    std::net::Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8).into()
}

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

/// Time spent in spans of one name.
#[derive(Clone, Copy, Default)]
struct SpanTotal {
    count: u64,
    /// Inside the span (entered), summed.
    busy: Duration,
    /// From creation to close, summed (for async spans: including waits).
    wall: Duration,
    /// The `leaves` field (a quote's batch size): summed, and the largest.
    leaves: u64,
    most_leaves: u64,
}

/// Sums the time spent in the agent's spans, by name.
#[derive(Clone, Default)]
struct Timings(Arc<StdMutex<BTreeMap<&'static str, SpanTotal>>>);

struct Open {
    created: Instant,
    entered: Option<Instant>,
    busy: Duration,
    leaves: u64,
}

/// Reads a span's `leaves` field.
struct Leaves(u64);

impl tracing::field::Visit for Leaves {
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "leaves" {
            self.0 = value;
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl Timings {
    fn take(&self) -> BTreeMap<&'static str, SpanTotal> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Timings {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let mut leaves = Leaves(0);
        attrs.record(&mut leaves);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Open {
                created: Instant::now(),
                entered: None,
                busy: Duration::ZERO,
                leaves: leaves.0,
            });
        }
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(open) = span.extensions_mut().get_mut::<Open>() {
                open.entered = Some(Instant::now());
            }
        }
    }

    fn on_exit(&self, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(open) = span.extensions_mut().get_mut::<Open>() {
                if let Some(entered) = open.entered.take() {
                    open.busy += entered.elapsed();
                }
            }
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(open) = span.extensions_mut().remove::<Open>() else {
            return;
        };
        let mut totals = self.0.lock().unwrap();
        let total = totals.entry(span.metadata().name()).or_default();
        total.count += 1;
        total.busy += open.busy;
        total.wall += open.created.elapsed();
        total.leaves += open.leaves;
        total.most_leaves = total.most_leaves.max(open.leaves);
    }
}

/// What each span name stands for in the breakdown, in print order.
const BREAKDOWN: &[(&str, &str)] = &[
    ("join.ticket", "IssueJoinTicket handler (service)"),
    (
        "join.slot",
        "  waiting for one of the ticket slots (service)",
    ),
    (
        "atls.certificate",
        "  aTLS certificate: key, document, self-signature (both sides)",
    ),
    (
        "attest.issue",
        "    document from the issuer, batch wait included (both sides)",
    ),
    (
        "attest.quote",
        "      TPM: quote + PCR read under the TPM lock, per batch (both sides)",
    ),
    (
        "atls.peer_certificate",
        "  peer certificate: parse, key and algorithm checks (both sides)",
    ),
    (
        "attest.validate",
        "  validation of the peer's document (both sides)",
    ),
    (
        "attest.validate.ek_certificate",
        "    EK certificate chain (RSA signature)",
    ),
    (
        "attest.validate.quote",
        "    quote signature (ECDSA P-256), qualifying data, PCR digest",
    ),
    (
        "join.kubelet_cert",
        "  kubelet certificate: CSR check and signature (service)",
    ),
    (
        "join.disk_binding",
        "  disk binding store: read, record, durable write, per round (service)",
    ),
    (
        "join.seal",
        "  sealing the secrets to the node's TPM (service)",
    ),
    (
        "registry.write",
        "  node registry: durable write, per round (service)",
    ),
];

fn print_breakdown(totals: &BTreeMap<&'static str, SpanTotal>, tickets: usize) {
    let per = |d: Duration| d.as_secs_f64() * 1e3 / tickets as f64;
    println!("    per ticket (sum over spans / tickets):        count   inside ms  span mean ms");
    for (name, what) in BREAKDOWN {
        let Some(t) = totals.get(name) else { continue };
        let mean = t.wall.as_secs_f64() * 1e3 / t.count.max(1) as f64;
        println!(
            "    {what:<75} {:>6}  {:>9.3}  {:>11.3}",
            t.count,
            per(t.busy),
            mean
        );
    }
}

/// A runtime with two workers whose threads (blocking ones included) are
/// called `name`.
fn runtime(name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap()
}

fn main() {
    let service_runtime = runtime("keel-service");
    let client_runtime = runtime("keel-client");
    let service = client_runtime.block_on(run(&service_runtime));
    // The clients' tasks end with their runtime, then the service's, and
    // then its swtpm.
    drop(client_runtime);
    drop(service_runtime);
    drop(service);
}

async fn run(service_runtime: &tokio::runtime::Runtime) -> join_common::Service {
    let per_level: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let mut levels: Vec<usize> = std::env::args()
        .skip(2)
        .filter_map(|a| a.parse().ok())
        .collect();
    if levels.is_empty() {
        levels = vec![1, 10, 100];
    }
    let timings = Timings::default();
    tracing_subscriber::registry()
        .with(
            timings
                .clone()
                .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                    m.is_span() && (m.target().starts_with("keel"))
                })),
        )
        .init();
    join_common::STANDIN.set(build_standin()).unwrap();
    let ca = Arc::new(EkCa::new().unwrap());
    let port = join_common::free_port();
    let service = {
        let ca = ca.clone();
        service_runtime
            .spawn(async move { join_common::start_service(&ca, port).await })
            .await
            .unwrap()
    };
    let service_tpm = service.swtpm_pid();
    // Enough members that none has more disks than the service binds to
    // one EK (the warm-up ticket included).
    let members_per_level = 4.max((per_level + 8).div_ceil(MAX_DISKS_PER_EK - 1));
    println!(
        "tickets per level: {per_level}; {members_per_level} member TPMs per level; \
         quotes batched on both sides"
    );
    let mut summary = Vec::new();
    for &clients in &levels {
        // Fresh members per level (their first handshake proves their AK);
        // the ticket clients go first so the TPMs outlive them.
        let members: Vec<_> = (0..members_per_level)
            .map(|i| {
                let m = join_common::member(&ca, port, &format!("w-{clients}-{i}"), "worker");
                (m.tickets(&ca), m)
            })
            .collect();
        let member_tpms: Vec<Option<u32>> = members.iter().map(|(_, m)| m.swtpm_pid()).collect();
        let members = Arc::new(members);
        // Warm-up: one ticket per member, outside the figures, each from a
        // source of its own (one source gets a bounded burst of answers).
        for (i, (tickets, m)) in members.iter().enumerate() {
            let tickets = tickets.clone().with_local_address(source(i));
            let key = KubeletKey::generate(&m.name).unwrap();
            let request = IssueJoinTicketRequest {
                disk_uuid: join_common::uuid(),
                kubelet_csr: key.csr_pem().as_bytes().to_vec(),
                is_control_plane: false,
                node_name: m.name.clone(),
                file_discovery: true,
            };
            tickets
                .request_join_ticket(&service.endpoint, request)
                .await
                .unwrap_or_else(|e| panic!("{}", keel_atls::ErrorChain(&e)));
        }
        timings.take();
        let remaining = Arc::new(Mutex::new(per_level));
        let latencies = Arc::new(Mutex::new(Vec::with_capacity(per_level)));
        let start = Instant::now();
        let cpu_before = cpu_jiffies();
        let parties_before = PartyCpu::now(service_tpm, &member_tpms);
        let tasks: Vec<_> = (0..clients)
            .map(|client| {
                let (members, remaining, latencies) =
                    (members.clone(), remaining.clone(), latencies.clone());
                let endpoint = service.endpoint.clone();
                tokio::spawn(async move {
                    loop {
                        let n = {
                            let mut left = remaining.lock().await;
                            if *left == 0 {
                                return Ok(());
                            }
                            *left -= 1;
                            *left
                        };
                        let (tickets, m) = &members[n % members.len()];
                        let tickets = tickets.clone().with_local_address(source(client));
                        let key = KubeletKey::generate(&m.name).unwrap();
                        let request = IssueJoinTicketRequest {
                            disk_uuid: join_common::uuid(),
                            kubelet_csr: key.csr_pem().as_bytes().to_vec(),
                            is_control_plane: false,
                            node_name: m.name.clone(),
                            file_discovery: true,
                        };
                        let t = Instant::now();
                        if let Err(e) = tickets.request_join_ticket(&endpoint, request).await {
                            // Stop every client; the TPMs are dropped (and
                            // their swtpm stopped) on the way out.
                            *remaining.lock().await = 0;
                            return Err(keel_atls::ErrorChain(&e).to_string());
                        }
                        latencies.lock().await.push(t.elapsed());
                    }
                })
            })
            .collect();
        let mut failed = None;
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                failed = Some(e);
            }
        }
        if let Some(e) = failed {
            eprintln!("a ticket request failed at {clients} clients: {e}");
            // Stops the swtpm processes, which exiting would not.
            drop(members);
            drop(service);
            std::process::exit(1);
        }
        let wall = start.elapsed();
        let cpu_after = cpu_jiffies();
        let busy = (cpu_after.0 - cpu_before.0) as f64 / (cpu_after.1 - cpu_before.1).max(1) as f64
            * 100.0;
        let parties = PartyCpu::now(service_tpm, &member_tpms);
        let totals = timings.take();
        let mut l = latencies.lock().await.clone();
        l.sort();
        let rate = l.len() as f64 / wall.as_secs_f64();
        let (p50, p95) = (percentile(&l, 50), percentile(&l, 95));
        let count = |name: &str| totals.get(name).map_or(0, |t| t.count);
        let quotes = totals.get("attest.quote").copied().unwrap_or_default();
        println!(
            "\n{clients} clients: {rate:.1} tickets/s, median {p50:.1?}, p95 {p95:.1?}; \
             {} documents from {} quotes (at most {} in one), {} tokens in {} kubeadm runs, \
             {} disk binding writes, {} registry writes; CPUs {busy:.0}% busy (all processes)",
            quotes.leaves,
            quotes.count,
            quotes.most_leaves,
            count("join.token"),
            count("kubeadm.token_create"),
            count("join.disk_binding"),
            count("registry.write"),
        );
        parties.print_since(&parties_before, l.len());
        print_breakdown(&totals, l.len());
        summary.push((clients, rate, p50, p95));
    }
    println!("\nclients  tickets/s  median    p95");
    for (clients, rate, p50, p95) in &summary {
        println!("{clients:>7}  {rate:>9.1}  {p50:>7.1?}  {p95:>7.1?}");
    }
    let rate = |n: usize| summary.iter().find(|s| s.0 == n).map(|s| s.1);
    if let (Some(one), Some(hundred)) = (rate(1), rate(100)) {
        println!("100 clients / 1 client: {:.1}x", hundred / one);
    }
    println!("tokens registered: {}", service.registered_tokens().len());
    service
}
