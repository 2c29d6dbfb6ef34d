//! The join service under load, and its refusals, over real mutual aTLS
//! with swtpm on both sides.
//!
//! Load: 100 ticket requests at once, each on its own aTLS connection with
//! a fresh quote over the service's nonce, from 4 swtpm-backed members (25
//! concurrent requests per TPM; a swtpm per client is too heavy for two
//! cores). The quotes are real and per handshake, not precomputed; what is
//! shared is the TPM (and so the EK, AK and node name) behind a request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::collections::HashSet;
use std::time::Instant;

use join_common::{member, start_service, start_service_slow_tokens, uuid, Member, Service};
use keel_agent::join::{KubeletKey, TicketClient, TicketError};
use keel_atls::ConnectError;
use keel_proto::join::{IssueJoinTicketRequest, IssueJoinTicketResponse};
use keel_testkit::swtpm::EkCa;
use keel_verifier::measurement::EventType;
use x509_parser::prelude::FromDer as _;

const CONCURRENT: usize = 100;
const MEMBERS: usize = 4;

fn request(m: &Member) -> (IssueJoinTicketRequest, KubeletKey) {
    let key = KubeletKey::generate(&m.name).unwrap();
    let req = IssueJoinTicketRequest {
        disk_uuid: uuid(),
        kubelet_csr: key.csr_pem().as_bytes().to_vec(),
        is_control_plane: false,
        node_name: m.name.clone(),
        file_discovery: false,
    };
    (req, key)
}

/// `n` concurrent requests spread over `members`; returns each member index,
/// request and response.
async fn round(
    service: &Service,
    members: &[(Member, keel_agent::join::TicketClient)],
    n: usize,
) -> Vec<(usize, IssueJoinTicketRequest, IssueJoinTicketResponse)> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let which = i % members.len();
            let (m, tickets) = &members[which];
            let (req, _key) = request(m);
            let tickets = tickets.clone();
            let endpoint = service.endpoint.clone();
            tokio::spawn(async move {
                let raw = tickets
                    .request_join_ticket(&endpoint, req.clone())
                    .await
                    .unwrap_or_else(|e| panic!("{}", keel_atls::ErrorChain(&e)));
                (which, req, raw.response)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_concurrent_requests_all_get_their_own_ticket() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service(&ca, port).await;
    service.serving_older_members().await;
    let members: Vec<_> = (0..MEMBERS)
        .map(|i| {
            let m = member(&ca, port, &format!("w-{i}"), "worker");
            let t = m.tickets(&ca);
            (m, t)
        })
        .collect();

    let start = Instant::now();
    let results = round(&service, &members, CONCURRENT).await;
    let elapsed = start.elapsed();
    assert_eq!(results.len(), CONCURRENT);
    eprintln!("{CONCURRENT} concurrent tickets in {elapsed:?}");

    // Every ticket opens on the TPM it was sealed to, and is its own.
    let mut tokens = HashSet::new();
    let mut serials = HashSet::new();
    for (which, req, mut response) in results {
        let (member, tickets) = &members[which];
        let secrets = tickets.open(response.secrets.take()).await.unwrap();
        let ek = join_common::ek_digest(&member.tpm);
        let expected = service.state.keys.disk_key(&req.disk_uuid, &ek).unwrap();
        assert_eq!(secrets.state_disk_key.as_slice(), expected.as_slice());
        assert!(
            tokens.insert(secrets.bootstrap_token.clone()),
            "token issued twice"
        );
        let (_, pem) = x509_parser::pem::parse_x509_pem(&secrets.kubelet_cert).unwrap();
        let (_, cert) = x509_parser::certificate::X509Certificate::from_der(&pem.contents).unwrap();
        assert!(
            serials.insert(cert.raw_serial().to_vec()),
            "certificate issued twice"
        );
        // Nothing control-plane travels to a worker.
        assert!(secrets.control_plane.is_none() && response.join_measurements.is_empty());
    }
    let registered: HashSet<String> = service.registered_tokens().into_iter().collect();
    assert_eq!(
        registered, tokens,
        "each ticket's token registered exactly once"
    );

    // Memory stays bounded: more rounds do not grow the process.
    let before = join_common::rss_kib();
    for _ in 0..2 {
        round(&service, &members, CONCURRENT).await;
    }
    let after = join_common::rss_kib();
    eprintln!("RSS after round 1: {before} KiB, after round 3: {after} KiB");
    assert!(
        after < before + 32 * 1024,
        "RSS grew from {before} KiB to {after} KiB"
    );
    assert_eq!(service.registered_tokens().len(), 3 * CONCURRENT);
}

/// Sends `req` and asserts the service refused it with `code`; returns
/// the refusal.
async fn assert_refused(
    tickets: &TicketClient,
    service: &Service,
    req: IssueJoinTicketRequest,
    code: tonic::Code,
) -> tonic::Status {
    refusal(
        tickets.request_join_ticket(&service.endpoint, req).await,
        code,
    )
}

/// A fresh member `name` of the service on `port`, with its join ticket.
async fn admitted(ca: &EkCa, port: u16, service: &Service, name: &str) -> Member {
    let m = member(ca, port, name, "worker");
    let (req, _key) = request(&m);
    m.tickets(ca)
        .request_join_ticket(&service.endpoint, req)
        .await
        .unwrap();
    m
}

/// The join ticket `m` asks for (as a control plane if `control_plane`)
/// is refused with `PermissionDenied`, saying `why`.
async fn denied_saying(ca: &EkCa, service: &Service, m: &Member, control_plane: bool, why: &str) {
    let (mut req, _key) = request(m);
    req.is_control_plane = control_plane;
    let denied = tonic::Code::PermissionDenied;
    let status = assert_refused(&m.tickets(ca), service, req, denied).await;
    assert!(status.message().contains(why), "{status:?}");
}

/// The refusal `answer` is, with `code`.
fn refusal<T>(answer: Result<T, TicketError>, code: tonic::Code) -> tonic::Status {
    match answer {
        Err(TicketError::Refused(status)) if status.code() == code => status,
        Err(e) => panic!("not refused with {code:?}: {e}"),
        Ok(_) => panic!("a ticket was issued"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_get_nothing() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service(&ca, port).await;
    service.serving_older_members().await;
    let m = member(&ca, port, "w-0", "worker");
    let tickets = m.tickets(&ca);

    // Another node's name, and a control-plane ticket for a worker config:
    // refused against the measured identity.
    let (mut req, _key) = request(&m);
    req.node_name = "w-9".into();
    assert_refused(&tickets, &service, req, tonic::Code::PermissionDenied).await;
    let (mut req, _key) = request(&m);
    req.is_control_plane = true;
    assert_refused(&tickets, &service, req, tonic::Code::PermissionDenied).await;
    // A CSR for another name, a malformed UUID.
    let (mut req, _key) = request(&m);
    req.kubelet_csr = KubeletKey::generate("w-9")
        .unwrap()
        .csr_pem()
        .as_bytes()
        .to_vec();
    assert_refused(&tickets, &service, req, tonic::Code::InvalidArgument).await;
    let (mut req, _key) = request(&m);
    req.disk_uuid = "measurementSecret".into();
    assert_refused(&tickets, &service, req, tonic::Code::InvalidArgument).await;
    assert!(service.registered_tokens().is_empty());

    // A locked node (PCR 15 non-zero) is refused in the handshake.
    let locked = member(&ca, port, "w-1", "worker");
    let locked_tickets = locked.tickets(&ca);
    locked
        .tpm
        .lock()
        .unwrap()
        .record(EventType::ClusterId, "other cluster", vec![7; 32])
        .unwrap();
    let (req, _key) = request(&locked);
    let err = locked_tickets
        .request_join_ticket(&service.endpoint, req)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&err, TicketError::Connect(ConnectError::RefusedByServer(_))),
        "{err}"
    );

    // The service answers again after all of this.
    let (req, _key) = request(&m);
    assert!(tickets
        .request_join_ticket(&service.endpoint, req)
        .await
        .is_ok());
    assert_eq!(service.registered_tokens().len(), 1);
}

/// Attacker's move: a host boots a second VM of the cluster's image under
/// a member's node name, for a kubelet certificate of that member's Node.
/// Refused before a token is made while the member is not revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_tpm_under_a_members_name_gets_no_ticket() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service(&ca, port).await;
    service.serving_older_members().await;
    let first = admitted(&ca, port, &service, "w-0").await;
    let second = member(&ca, port, "w-0", "worker");
    denied_saying(&ca, &service, &second, false, "holds this node's name").await;
    assert_eq!(service.registered_tokens().len(), 1, "a token was made");
    // The first again (a rejoin's name) is no conflict.
    let (req, _key) = request(&first);
    first
        .tickets(&ca)
        .request_join_ticket(&service.endpoint, req)
        .await
        .unwrap();
}

/// The host rewrites a member's node config to another name and reboots
/// it: the renamed member gets no ticket, so its name (whose kubelet
/// certificate it keeps) is not freed, and a second TPM under that name
/// gets none either. Nor does it get one as a control plane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_renamed_by_its_host_gets_no_ticket_and_keeps_its_name() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service(&ca, port).await;
    service.serving_older_members().await;
    let first = admitted(&ca, port, &service, "w-0").await;
    let renamed = first.rebooted_with(join_common::config(&ca, port, "w-9", "worker"));
    let other_name = "under another name or role";
    denied_saying(&ca, &service, &renamed, false, other_name).await;
    // Its rejoin (the reboot's usual way back) neither.
    let rejoin = renamed
        .tickets(&ca)
        .rejoin_ticket(&service.endpoint, &uuid())
        .await;
    let status = refusal(rejoin, tonic::Code::PermissionDenied);
    assert!(status.message().contains(other_name), "{status:?}");
    let promoted = renamed.rebooted_with(join_common::config(&ca, port, "w-0", "control-plane"));
    denied_saying(&ca, &service, &promoted, true, other_name).await;
    let second = member(&ca, port, "w-0", "worker");
    denied_saying(&ca, &service, &second, false, "holds this node's name").await;
    assert_eq!(service.registered_tokens().len(), 1, "a token was made");
}

/// A node that joins with kubeadm's file discovery (every node of this
/// version) gets no bootstrap token and has none registered: the token's
/// group may get node certificates of any name, while the kubelet
/// certificate its discovery kubeconfig holds names this node alone. A
/// node of an earlier version, which does not ask for it, still gets one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_discovery_ticket_carries_no_token_and_registers_none() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service(&ca, port).await;
    service.serving_older_members().await;
    let m = member(&ca, port, "w-0", "worker");
    let ticket = joins_with_file_discovery(&ca, &service, &m).await;
    assert!(ticket.kubelet_cert.contains("BEGIN CERTIFICATE"));
    assert!(service.registered_tokens().is_empty(), "a token was made");
    let (req, key) = request(&m);
    let ticket = m
        .tickets(&ca)
        .join_ticket(&service.endpoint, req, &key.spki())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(ticket.token.is_some());
    assert_eq!(service.registered_tokens().len(), 1);
}

/// Attacker's move: on a node of the control plane's own image, whoever
/// controls it asks without file discovery, as a node of an earlier
/// release would, for the bootstrap token whose group gets node
/// certificates of any name. The agent of that image never asks so: the
/// request is refused before anything is made, bound or recorded, and the
/// same node joins with file discovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_the_services_own_image_gets_no_token() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let service = start_service(&ca, port).await;
    let m = member(&ca, port, "w-0", "worker");
    denied_saying(&ca, &service, &m, false, "joins with file discovery").await;
    assert!(service.registered_tokens().is_empty(), "a token was made");
    let bindings = keel_agent::disk_bindings::DiskBindings::new(&service.root);
    assert_eq!(bindings.len().unwrap(), 0, "a disk was bound");
    let registry = keel_agent::registry::RegistryStore::shared(&service.root).unwrap();
    let recorded = registry.snapshot();
    assert!(recorded.nodes().values().all(|r| r.name != "w-0"));

    joins_with_file_discovery(&ca, &service, &m).await;
    assert_eq!(bindings.len().unwrap(), 1);
}

/// The registry's refusals come before the token's: a second TPM of the
/// service's own image under a member's name, asking for a token, is told
/// the name is held (as a revoked node is told it is revoked), not how to
/// ask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registrys_refusals_come_before_the_token_downgrade() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let service = start_service(&ca, port).await;
    let first = member(&ca, port, "w-0", "worker");
    joins_with_file_discovery(&ca, &service, &first).await;
    let second = member(&ca, port, "w-0", "worker");
    denied_saying(&ca, &service, &second, false, "holds this node's name").await;
    assert!(service.registered_tokens().is_empty(), "a token was made");
}

/// Attacker's move: ask for a bootstrap token of a control plane whose own
/// image the cluster retired (a rollout withdrew it before this node
/// rebooted): judging by an image no node presents, it would give one to
/// a node of any other. It gives none; file discovery still joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_of_a_retired_image_gives_no_token() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service(&ca, port).await;
    service.serving_older_members().await;
    retire_the_staged_image(&service);
    let m = member(&ca, port, "w-0", "worker");
    let (req, _key) = request(&m);
    let unavailable = tonic::Code::Unavailable;
    let status = assert_refused(&m.tickets(&ca), &service, req, unavailable).await;
    assert!(status.message().contains("retired"), "{status:?}");
    assert!(service.registered_tokens().is_empty(), "a token was made");
    joins_with_file_discovery(&ca, &service, &m).await;
}

/// `m`'s ticket with kubeadm's file discovery, as its agent asks: no
/// token.
async fn joins_with_file_discovery(
    ca: &EkCa,
    service: &Service,
    m: &Member,
) -> keel_agent::join::JoinTicket {
    let (mut req, key) = request(m);
    req.file_discovery = true;
    let ticket = m
        .tickets(ca)
        .join_ticket(&service.endpoint, req, &key.spki())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(ticket.token.is_none());
    ticket
}

/// A control plane that learned more endpoints than a ticket may name
/// (its config's and those its own ticket named) names the first 16: a
/// joining node refuses a ticket naming more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_names_no_more_endpoints_than_a_node_takes() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service(&ca, port).await;
    service.serving_older_members().await;
    let state = service.slot.borrow().clone().unwrap();
    let many: Vec<String> = (0..20).map(|i| format!("cp-{i}.example:9001")).collect();
    service.slot.send_replace(Some(std::sync::Arc::new(
        keel_agent::cluster::ClusterState {
            control_plane_endpoints: many.clone(),
            ..(*state).clone()
        },
    )));
    let m = member(&ca, port, "w-0", "worker");
    let (req, key) = request(&m);
    let ticket = m
        .tickets(&ca)
        .join_ticket(&service.endpoint, req, &key.spki())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ticket.control_plane_endpoints, many[..16]);
}

/// Whether a stand-in kubeadm of `service` runs now (a child of this
/// process whose `KEEL_STANDIN_ROOT` is the service's).
fn kubeadm_runs(service: &Service) -> bool {
    let root = format!("KEEL_STANDIN_ROOT={}", service.root.display());
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return false;
    };
    processes.flatten().any(|p| {
        let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
        // pid (comm) state ppid ...
        let ppid = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split(' ').nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        ppid == Some(std::process::id())
            && std::fs::read(p.path().join("environ"))
                .unwrap_or_default()
                .split(|b| *b == 0)
                .any(|v| v == root.as_bytes())
    })
}

/// Race: the operator revokes a known node while its join ticket waits
/// for its bootstrap token (a kubeadm run, here slowed to 3 s): the ticket
/// is refused as revoked, not sealed and sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_while_the_token_is_registered_refuses_the_ticket() {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service_slow_tokens(&ca, port, 3).await;
    service.serving_older_members().await;
    let m = member(&ca, port, "w-1", "worker");
    let ek = join_common::ek_digest(&m.tpm);
    // The node is known: it joined before (and was reset since).
    let registry = keel_agent::registry::RegistryStore::shared(&service.root).unwrap();
    registry
        .update(|r| r.register(&ek, "", "w-1", "worker"))
        .unwrap();

    let pending = waiting_for_its_token(&service, &m, &ca).await;
    registry
        .update(|r| {
            let record = r.find(&ek.to_string())?.clone();
            r.revoke(&record, None, "test: revoked by the operator")
        })
        .unwrap();

    refused_with(pending, "revoked").await;
}

/// Asks for `m`'s join ticket and returns once the service runs kubeadm
/// for its token (slowed), the request still waiting.
async fn waiting_for_its_token(
    service: &Service,
    m: &Member,
    ca: &EkCa,
) -> tokio::task::JoinHandle<Result<impl Sized, TicketError>> {
    let tickets = m.tickets(ca);
    let (req, _key) = request(m);
    let endpoint = service.endpoint.clone();
    let pending = tokio::spawn(async move { tickets.request_join_ticket(&endpoint, req).await });
    let waiting = Instant::now();
    while !kubeadm_runs(service) {
        assert!(
            waiting.elapsed() < std::time::Duration::from_secs(60),
            "no kubeadm run"
        );
        assert!(!pending.is_finished(), "answered before its token");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    pending
}

/// A service mid-upgrade (kubeadm slowed to 3 s) and the ticket request
/// of a node of the older image, waiting for its token.
async fn an_older_nodes_ticket_waiting_for_its_token() -> (
    Service,
    tokio::task::JoinHandle<Result<impl Sized, TicketError>>,
) {
    let ca = EkCa::new().unwrap();
    let port = join_common::free_port();
    let mut service = start_service_slow_tokens(&ca, port, 3).await;
    service.serving_older_members().await;
    let m = member(&ca, port, "w-1", "worker");
    let pending = waiting_for_its_token(&service, &m, &ca).await;
    (service, pending)
}

/// Ends the upgrade `service` serves by withdrawing the image it staged,
/// the service's own: its members' older image stays.
fn retire_the_staged_image(service: &Service) {
    let mut retired = (*service.slot.borrow().clone().unwrap()).clone();
    retired.staged_measurements = None;
    service
        .slot
        .send_replace(Some(std::sync::Arc::new(retired)));
}

/// Asserts that `pending` ended refused (`PermissionDenied`), saying `why`.
async fn refused_with<T>(pending: tokio::task::JoinHandle<Result<T, TicketError>>, why: &str) {
    let status = refusal(pending.await.unwrap(), tonic::Code::PermissionDenied);
    assert!(status.message().contains(why), "{status:?}");
}

/// Race: the rollout retires the service's own image (the staged one is
/// withdrawn) while a node of the older image waits for its bootstrap
/// token: the service can no longer tell which images ask for tokens, and
/// the token is not sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_services_image_retired_while_the_token_is_registered_sends_no_token() {
    let (service, pending) = an_older_nodes_ticket_waiting_for_its_token().await;
    retire_the_staged_image(&service);
    let status = refusal(pending.await.unwrap(), tonic::Code::Unavailable);
    assert!(status.message().contains("retired"), "{status:?}");
}

/// Race: the operator withdraws the node's image (new join measurements)
/// while its join ticket waits for its bootstrap token: the ticket is
/// refused, not built from the state it was admitted by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_withdrawn_while_the_token_is_registered_refuses_the_ticket() {
    let (service, pending) = an_older_nodes_ticket_waiting_for_its_token().await;
    // Another image's measurements replace the node's.
    let state = service.slot.borrow().clone().unwrap();
    let mut other = state.join_measurements.clone();
    other.require(4, [0xee; 32]);
    service.slot.send_replace(Some(std::sync::Arc::new(
        keel_agent::cluster::ClusterState {
            join_measurements: other,
            staged_measurements: None,
            ..(*state).clone()
        },
    )));

    refused_with(pending, "no longer accepted").await;
}
