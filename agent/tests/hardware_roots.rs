//! The end-to-end binding for the `sev-snp` and `tdx` variants: CPU
//! evidence → AK → quote, with a test-only AMD-like or Intel-like root
//! generated here and configured as the verifier's roots (with, for TDX,
//! generated collateral in a collateral cache), evidence produced by the
//! node's issuer over a real swtpm, and the one validator judging the
//! document. Then over aTLS, and the join path: a join service and a joining
//! node, each with its own swtpm and generated CPU, over mutual aTLS.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use join_common::{issuing_node as node, IssuingNode as Node};

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_agent::attestation::cpu::{CpuReportError, CpuReporter};
use keel_agent::tpm::Tpm;
use keel_proto::attestation::{cpu_evidence, AttestationDocument, CpuEvidence};
use keel_testkit::amd::{ReportFields, RootValidity, TestAmd};
use keel_testkit::intel::{CollateralOptions, TdFields, TestIntel, TD_ATTRIBUTES, TD_DEBUG};
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::cpu::policy::{Hex, SnpPolicy, Tcb, TdxPolicy};
use keel_verifier::cpu::snp::{AmdRoots, SnpError};
use keel_verifier::cpu::tdx::{IntelRoot, TdxError};
use keel_verifier::cpu::{BindingError, Collateral, CpuClaims, CpuError, CpuPolicy, CpuTrust};
use keel_verifier::ek::EkTrust;
use keel_verifier::measurements::{Expected, Measurements};
use keel_verifier::validator::{ValidationError, Validator};
use prost::Message;

const MEASUREMENT: [u8; 48] = [0x5a; 48];

/// The node's CPU: a generated chip that signs what the guest asks for.
struct GeneratedSnp {
    amd: Arc<TestAmd>,
    policy: u64,
}

impl CpuReporter for GeneratedSnp {
    fn report(
        &self,
        report_data: &[u8; 64],
        _tpm: &mut Tpm,
    ) -> Result<CpuEvidence, CpuReportError> {
        let report = self
            .amd
            .report(&ReportFields {
                policy: self.policy,
                ..ReportFields::guest(*report_data, MEASUREMENT)
            })
            .unwrap();
        Ok(CpuEvidence {
            binding: cpu_evidence::Binding::Guest.into(),
            report,
            certificate: self.amd.vcek_der().to_vec(),
        })
    }
}

/// A node whose CPU is `amd`'s chip, launched with guest `policy`.
fn snp_node(ca: &EkCa, amd: &Arc<TestAmd>, policy: u64) -> Node {
    node(
        ca,
        Some(Arc::new(GeneratedSnp {
            amd: amd.clone(),
            policy,
        })),
    )
}

fn snp_policy(amd: &TestAmd) -> SnpPolicy {
    SnpPolicy {
        host_data: Some(Hex([0; 32])),
        ..SnpPolicy::new(Tcb::from(amd.tcb()), Hex(MEASUREMENT))
    }
}

fn validator(ca: &EkCa, config: &NodeConfig, cpu: CpuTrust) -> Validator {
    let mut entries: BTreeMap<u32, Expected> = [4, 9, 11]
        .into_iter()
        .map(|pcr| (pcr, Expected::enforced([0; 32])))
        .collect();
    entries.insert(12, Expected::enforced(config.expected_config_pcr()));
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    Validator::new(Measurements::new(entries).unwrap(), trust).with_cpu(Arc::new(cpu))
}

fn generated_trust(amd: &TestAmd) -> CpuTrust {
    CpuTrust::new(CpuPolicy::SevSnp(snp_policy(amd)), Collateral::default())
        .with_snp_roots(AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()]))
}

/// A node's generated SNP chip (guest policy 0x30000) and the trust in it.
fn snp_hardware(amd: &Arc<TestAmd>) -> join_common::Hardware {
    join_common::Hardware {
        reporter: Arc::new(GeneratedSnp {
            amd: amd.clone(),
            policy: 0x30000,
        }),
        trust: Arc::new(generated_trust(amd)),
    }
}

fn cpu_error(e: ValidationError) -> CpuError {
    match e {
        ValidationError::Cpu(e) => e,
        other => panic!("not a CPU evidence error: {other:?}"),
    }
}

#[test]
fn snp_evidence_roots_the_quote_and_every_substitution_is_refused() {
    let ca = EkCa::new().unwrap();
    let amd = Arc::new(TestAmd::new().unwrap());
    let n1 = snp_node(&ca, &amd, 0x30000);
    let v = validator(&ca, &n1.config, generated_trust(&amd));

    // The whole chain: CPU report → binds AK and nonce → AK signs the quote.
    let doc = n1.issuer.issue(b"nonce-1", b"user").unwrap();
    let verified = v.validate(&doc, b"nonce-1", b"user").unwrap();
    let Some(CpuClaims::Snp(claims)) = &verified.cpu else {
        panic!("no CPU claims: {:?}", verified.cpu);
    };
    assert_eq!(claims.product, "SEV-Test");
    assert_eq!(claims.measurement, MEASUREMENT);

    // Replay: this document's CPU evidence moved into a fresh one (another
    // nonce). The quote is fresh, the report is not.
    let fresh = n1.issuer.issue(b"nonce-2", b"user").unwrap();
    let mut replayed = AttestationDocument::decode(fresh.as_slice()).unwrap();
    replayed.cpu_evidence = AttestationDocument::decode(doc.as_slice())
        .unwrap()
        .cpu_evidence;
    let err = cpu_error(
        v.validate(&replayed.encode_to_vec(), b"nonce-2", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(err, CpuError::Binding(BindingError::ReportData { .. })),
        "{err:?}"
    );

    // Move: the CPU evidence of one node in the document of another (a
    // vTPM the hypervisor controls, on a machine that is not this CPU).
    let n2 = node(&ca, None);
    let mut moved =
        AttestationDocument::decode(n2.issuer.issue(b"nonce-3", b"user").unwrap().as_slice())
            .unwrap();
    let genuine =
        AttestationDocument::decode(n1.issuer.issue(b"nonce-3", b"user").unwrap().as_slice())
            .unwrap();
    moved.cpu_evidence = genuine.cpu_evidence;
    let err = cpu_error(
        v.validate(&moved.encode_to_vec(), b"nonce-3", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(err, CpuError::Binding(BindingError::ReportData { .. })),
        "{err:?}"
    );

    // Strip: a document without CPU evidence under the sev-snp variant.
    let bare = n2.issuer.issue(b"nonce-4", b"user").unwrap();
    let err = cpu_error(v.validate(&bare, b"nonce-4", b"user").unwrap_err());
    assert!(matches!(err, CpuError::Missing { .. }), "{err:?}");

    // Forge: the report's signature no longer matches after a change.
    let mut forged = AttestationDocument::decode(doc.as_slice()).unwrap();
    if let Some(e) = forged.cpu_evidence.as_mut() {
        e.report[0x90] ^= 1; // measurement
    }
    let err = cpu_error(
        v.validate(&forged.encode_to_vec(), b"nonce-1", b"user")
            .unwrap_err(),
    );
    assert!(matches!(err, CpuError::Snp(SnpError::Signature)), "{err:?}");

    // The production roots do not accept the generated chip.
    let pinned = CpuTrust::new(CpuPolicy::SevSnp(snp_policy(&amd)), Collateral::default());
    let err = cpu_error(
        validator(&ca, &n1.config, pinned)
            .validate(&doc, b"nonce-1", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(err, CpuError::Snp(SnpError::UntrustedIssuer { .. })),
        "{err:?}"
    );

    // The vtpm variant is unchanged: the same document, the evidence unused.
    let vtpm = validator(&ca, &n1.config, CpuTrust::default());
    assert!(vtpm
        .validate(&doc, b"nonce-1", b"user")
        .unwrap()
        .cpu
        .is_none());
}

#[test]
fn a_debuggable_guest_is_refused_even_with_a_valid_report() {
    let ca = EkCa::new().unwrap();
    let amd = Arc::new(TestAmd::new().unwrap());
    let n = snp_node(&ca, &amd, 0x30000 | 1 << 19);
    let v = validator(&ca, &n.config, generated_trust(&amd));
    let doc = n.issuer.issue(b"nonce", b"user").unwrap();
    let err = cpu_error(v.validate(&doc, b"nonce", b"user").unwrap_err());
    assert!(
        matches!(err, CpuError::Snp(SnpError::Debug { policy: 0xb0000 })),
        "{err:?}"
    );

    // And a TCB below the configured minimum.
    let mut policy = snp_policy(&amd);
    policy.minimum_tcb.snp += 1;
    let n = snp_node(&ca, &amd, 0x30000);
    let trust = CpuTrust::new(CpuPolicy::SevSnp(policy), Collateral::default())
        .with_snp_roots(AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()]));
    let doc = n.issuer.issue(b"nonce", b"user").unwrap();
    let err = cpu_error(
        validator(&ca, &n.config, trust)
            .validate(&doc, b"nonce", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(
            err,
            CpuError::Snp(SnpError::TcbBelowMinimum {
                component: "snp",
                ..
            })
        ),
        "{err:?}"
    );
}

/// Attacker's move: the host of one control plane sets its clock past the
/// end of a member's chain (here its ASK), so that the member's evidence
/// is refused for the time and, under the `revoke` policy, the member
/// revoked. Such a refusal is told apart ([`ValidationError::rests_on_the_clock`])
/// and reported only once every other check held: a document that also
/// shows another PCR 4, belongs to another channel, or comes from a guest
/// the policy refuses, is refused for that, so the tag never hides a
/// drift behind the clock.
#[test]
fn a_refusal_for_the_time_is_reported_only_when_the_rest_holds() {
    let ca = EkCa::new().unwrap();
    let now = time::OffsetDateTime::now_utc();
    let lapsed = RootValidity {
        ask: Some((
            now - time::Duration::days(400),
            now - time::Duration::days(1),
        )),
        ..RootValidity::default()
    };
    let amd = Arc::new(TestAmd::with_root_validity(false, lapsed).unwrap());
    let n = snp_node(&ca, &amd, 0x30000);
    let doc = n.issuer.issue(b"nonce", b"user").unwrap();
    let v = validator(&ca, &n.config, generated_trust(&amd));
    let refused = v.validate(&doc, b"nonce", b"user").unwrap_err();
    assert!(
        matches!(
            &refused,
            ValidationError::Cpu(CpuError::Snp(SnpError::RootTime { .. }))
        ),
        "{refused:?}"
    );
    assert!(refused.rests_on_the_clock());
    // For a caller with checks of its own (continuous attestation), the
    // refusal comes with what the other checks established: the quoted
    // PCRs and the replayed log, and no CPU claims.
    let (verified, untimely) = v
        .validate_but_for_the_clock(&doc, b"nonce", b"user")
        .unwrap();
    assert!(untimely.is_some_and(|e| e.rests_on_the_clock()));
    assert!(verified.cpu.is_none());
    assert!(verified.pcrs.contains_key(&12) && !verified.events.is_empty());

    // The same chain, and a PCR 4 the validator does not expect.
    let mut entries: BTreeMap<u32, Expected> = [4, 9, 11]
        .into_iter()
        .map(|pcr| (pcr, Expected::enforced([u8::from(pcr == 4); 32])))
        .collect();
    entries.insert(12, Expected::enforced(n.config.expected_config_pcr()));
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let drifted = Validator::new(Measurements::new(entries).unwrap(), trust)
        .with_cpu(Arc::new(generated_trust(&amd)));
    let refused = drifted.validate(&doc, b"nonce", b"user").unwrap_err();
    assert!(
        matches!(&refused, ValidationError::Measurements(m) if m.iter().any(|m| m.pcr == 4)),
        "{refused:?}"
    );
    assert!(!refused.rests_on_the_clock());
    assert!(drifted
        .validate_but_for_the_clock(&doc, b"nonce", b"user")
        .is_err());

    // Another channel's user data.
    let refused = v.validate(&doc, b"nonce", b"other").unwrap_err();
    assert!(matches!(refused, ValidationError::UserData), "{refused:?}");

    // A debuggable guest under the lapsed chain.
    let debug = snp_node(&ca, &amd, 0x30000 | 1 << 19);
    let doc = debug.issuer.issue(b"nonce", b"user").unwrap();
    let refused = validator(&ca, &debug.config, generated_trust(&amd))
        .validate(&doc, b"nonce", b"user")
        .unwrap_err();
    assert!(
        matches!(
            &refused,
            ValidationError::Cpu(CpuError::Snp(SnpError::Debug { .. }))
        ),
        "{refused:?}"
    );
    assert!(!refused.rests_on_the_clock());
}

/// Answers every call; the test looks at the handshake only.
struct Empty;

#[tonic::async_trait]
impl keel_proto::kms::key_service_server::KeyService for Empty {
    async fn get_data_key(
        &self,
        _: tonic::Request<keel_proto::kms::GetDataKeyRequest>,
    ) -> Result<tonic::Response<keel_proto::kms::GetDataKeyResponse>, tonic::Status> {
        Ok(tonic::Response::new(Default::default()))
    }
}

/// Serves `issuer` over server-attested aTLS; returns its endpoint.
async fn serve(
    issuer: keel_atls::DynIssuer,
) -> (tonic::transport::Endpoint, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming =
        keel_atls::AtlsServer::<keel_verifier::validator::Verified>::server_attested(issuer)
            .incoming(listener);
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(keel_proto::kms::key_service_server::KeyServiceServer::new(
                Empty,
            ))
            .serve_with_incoming(incoming)
            .await;
    });
    (
        tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap(),
        task,
    )
}

/// Over aTLS, through the agent's reloadable policy with the `sev-snp`
/// variant (as a joining node verifies its join service): a server whose
/// documents carry a report binding its AK is accepted, with its CPU claims;
/// one without CPU evidence is refused before any request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atls_requires_the_cpu_evidence_of_the_variant() {
    let ca = EkCa::new().unwrap();
    let amd = Arc::new(TestAmd::new().unwrap());
    let with_cpu = snp_node(&ca, &amd, 0x30000);
    let without = node(&ca, None);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("measurements.json");
    let entries = [4, 9, 11]
        .map(|pcr| (pcr, Expected::enforced([0; 32])))
        .into_iter()
        .chain([(
            12,
            Expected::enforced(with_cpu.config.expected_config_pcr()),
        )]);
    std::fs::write(&path, Measurements::new(entries).unwrap().to_json()).unwrap();
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    let policy =
        keel_agent::attestation::policy::ReloadableValidator::load(&path, trust, Vec::new())
            .unwrap()
            .with_cpu(Arc::new(generated_trust(&amd)));
    let client = keel_atls::AtlsClient::server_attested(policy.validator());

    let (endpoint, task) = serve(Arc::new(with_cpu.issuer.clone())).await;
    let bound = client.bind_channel(endpoint).await.unwrap();
    let claims = bound.attested.unwrap().claims().clone();
    assert!(
        matches!(claims.cpu, Some(CpuClaims::Snp(_))),
        "{:?}",
        claims.cpu
    );
    task.abort();

    let (endpoint, task) = serve(Arc::new(without.issuer.clone())).await;
    let err = client.bind_channel(endpoint).await.unwrap_err();
    let chain = keel_atls::ErrorChain(&err).to_string();
    assert!(chain.contains("requires CPU evidence"), "{chain}");
    task.abort();

    // A reload keeps the variant.
    policy.reload().unwrap();
    let (endpoint, task) = serve(Arc::new(without.issuer.clone())).await;
    assert!(client.bind_channel(endpoint).await.is_err());
    task.abort();
}

/// The join path with the `sev-snp` variant: the joining node proves its
/// CPU to the join service and the service proves its CPU to the node; a
/// node without CPU evidence gets no ticket, and a node does not take a
/// ticket from a service without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_join_path_runs_with_the_sev_snp_variant() {
    use join_common::{config, free_port, measured_with, start_service, start_service_hardware};
    use keel_agent::join::{service_validator, KubeletKey, TicketClient, TicketError};
    use keel_proto::join::IssueJoinTicketRequest;
    use std::time::Duration;

    let ca = EkCa::new().unwrap();
    let amd = Arc::new(TestAmd::new().unwrap());
    let hardware = snp_hardware(&amd);
    let port = free_port();
    let service = start_service_hardware(&ca, port, &hardware).await;

    // A joining node: its own swtpm, the same generated CPU family.
    let tickets = |cpu: Option<Arc<dyn CpuReporter>>, port: u16| {
        let swtpm = Swtpm::start(&ca).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let tpm = measured_with(
            &swtpm,
            &dir.path().join("log"),
            &config(&ca, port, "w-1", "worker"),
            cpu,
        );
        let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
        let validator = service_validator(&tpm, trust, None)
            .unwrap()
            .with_cpu(hardware.trust.clone());
        (
            TicketClient::new(tpm, validator, Duration::from_secs(60)),
            swtpm,
            dir,
        )
    };
    let request = || {
        let key = KubeletKey::generate("w-1").unwrap();
        IssueJoinTicketRequest {
            disk_uuid: join_common::uuid(),
            kubelet_csr: key.csr_pem().as_bytes().to_vec(),
            is_control_plane: false,
            node_name: "w-1".into(),
            file_discovery: true,
        }
    };

    let (client, _sw, _dir) = tickets(Some(hardware.reporter.clone()), port);
    let mut raw = client
        .request_join_ticket(&service.endpoint, request())
        .await
        .unwrap();
    let secrets = client.open(raw.response.secrets.take()).await.unwrap();
    assert_eq!(secrets.state_disk_key.len(), 32);

    // A node without CPU evidence: the service refuses it in the handshake.
    let (bare, _sw2, _dir2) = tickets(None, port);
    let Err(err) = bare.request_join_ticket(&service.endpoint, request()).await else {
        panic!("a ticket was issued");
    };
    assert!(
        matches!(err, TicketError::Connect(_)),
        "{}",
        keel_atls::ErrorChain(&err)
    );

    // A join service without CPU evidence: the node refuses it.
    let plain_port = free_port();
    let plain = start_service(&ca, plain_port).await;
    let (client, _sw3, _dir3) = tickets(Some(hardware.reporter.clone()), plain_port);
    let Err(err) = client.request_join_ticket(&plain.endpoint, request()).await else {
        panic!("a ticket was issued");
    };
    let chain = keel_atls::ErrorChain(&err).to_string();
    assert!(chain.contains("requires CPU evidence"), "{chain}");
}

/// Continuous attestation holds a member to the variant on every document
/// it sends, as the join service holds a joining node: the members'
/// validator (the evidence loop's, built as on a control plane with the
/// join policy's CPU trust) refuses a member's document without CPU
/// evidence, and one carrying the CPU evidence of an earlier document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_evidence_is_held_to_the_variant_on_every_document() {
    use join_common::{free_port, measured_with, start_service_hardware};
    use keel_agent::attestation::issuer::TpmIssuer;
    use keel_agent::evidence::admission::{check_member, MemberPolicy};
    use keel_agent::nodelock::NodeLock;

    let ca = EkCa::new().unwrap();
    let amd = Arc::new(TestAmd::new().unwrap());
    let hardware = snp_hardware(&amd);
    let service = start_service_hardware(&ca, free_port(), &hardware).await;
    let members = MemberPolicy::new(
        &service.slot,
        EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap(),
        service.config.expected_config_pcr(),
        service.policy.cpu(),
    );
    // A member: the cluster's config measured, locked into its ID.
    let member = |cpu: Option<Arc<dyn CpuReporter>>| {
        let swtpm = Swtpm::start(&ca).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let tpm = measured_with(&swtpm, &dir.path().join("log"), &service.config, cpu);
        NodeLock::new(tpm.clone())
            .unwrap()
            .try_lock(service.state.cluster_id)
            .unwrap();
        (TpmIssuer::new(tpm), swtpm, dir)
    };
    let validator = members.current().unwrap().validator;

    let (honest, _swtpm, _dir) = member(Some(hardware.reporter.clone()));
    let doc = honest.issue(b"nonce-1", b"user").unwrap();
    let verified = validator.validate(&doc, b"nonce-1", b"user").unwrap();
    assert!(
        matches!(verified.cpu, Some(CpuClaims::Snp(_))),
        "{:?}",
        verified.cpu
    );
    check_member(&verified, &service.state.cluster_id).unwrap();

    // Strip: a member whose documents carry no CPU evidence.
    let (bare, _swtpm2, _dir2) = member(None);
    let stripped = bare.issue(b"nonce-2", b"user").unwrap();
    let err = cpu_error(
        validator
            .validate(&stripped, b"nonce-2", b"user")
            .unwrap_err(),
    );
    assert!(matches!(err, CpuError::Missing { .. }), "{err:?}");

    // Replay: the CPU evidence of an earlier document in a fresh one.
    let fresh = honest.issue(b"nonce-3", b"user").unwrap();
    let mut replayed = AttestationDocument::decode(fresh.as_slice()).unwrap();
    replayed.cpu_evidence = AttestationDocument::decode(doc.as_slice())
        .unwrap()
        .cpu_evidence;
    let err = cpu_error(
        validator
            .validate(&replayed.encode_to_vec(), b"nonce-3", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(err, CpuError::Binding(BindingError::ReportData { .. })),
        "{err:?}"
    );
}

// ---------------------------------------------------------------- TDX

const MRTD: [u8; 48] = [0x3d; 48];
const RTMR: [[u8; 48]; 4] = [[0x10; 48], [0x11; 48], [0x12; 48], [0; 48]];

/// The node's CPU: a generated TDX platform whose quoting enclave signs
/// what the guest asks for.
struct GeneratedTdx {
    intel: Arc<TestIntel>,
    td_attributes: u64,
    /// Ignore the requested `report_data` and sign this instead (a report
    /// that does not bind the AK).
    report_data: Option<[u8; 64]>,
}

impl GeneratedTdx {
    fn honest(intel: &Arc<TestIntel>) -> Self {
        Self {
            intel: intel.clone(),
            td_attributes: TD_ATTRIBUTES,
            report_data: None,
        }
    }
}

impl CpuReporter for GeneratedTdx {
    fn report(
        &self,
        report_data: &[u8; 64],
        _tpm: &mut Tpm,
    ) -> Result<CpuEvidence, CpuReportError> {
        let quote = self
            .intel
            .quote(&TdFields {
                td_attributes: self.td_attributes,
                mrtd: MRTD,
                rtmr: RTMR,
                report_data: self.report_data.unwrap_or(*report_data),
            })
            .unwrap();
        Ok(CpuEvidence {
            binding: cpu_evidence::Binding::Guest.into(),
            report: quote,
            certificate: Vec::new(),
        })
    }
}

fn tdx_policy() -> TdxPolicy {
    TdxPolicy {
        rtmr: RTMR.map(|r| Some(Hex(r))),
        ..TdxPolicy::new(Hex(MRTD))
    }
}

/// A collateral cache holding `intel`'s collateral as `options` judges the
/// platform, as `keel collateral fetch` lays it out.
fn tdx_cache(intel: &TestIntel, options: &CollateralOptions) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tdx")).unwrap();
    let collateral = intel.collateral(options).unwrap();
    std::fs::write(
        dir.path()
            .join("tdx")
            .join(format!("{}-platform.json", intel.fmspc_hex())),
        collateral.to_json(),
    )
    .unwrap();
    dir
}

/// The `tdx` variant with `policy`, the cache at `cache` and `intel`'s root
/// in place of Intel's.
fn tdx_trust(intel: &TestIntel, cache: &tempfile::TempDir, policy: TdxPolicy) -> CpuTrust {
    CpuTrust::new(CpuPolicy::Tdx(policy), Collateral::at(cache.path()))
        .with_tdx_root(IntelRoot::from_der(intel.root_der().to_vec()))
}

fn tdx_error(e: ValidationError) -> TdxError {
    match cpu_error(e) {
        CpuError::Tdx(e) => e,
        other => panic!("not a TDX error: {other:?}"),
    }
}

#[test]
fn tdx_evidence_roots_the_quote_and_every_substitution_is_refused() {
    let ca = EkCa::new().unwrap();
    let intel = Arc::new(TestIntel::new().unwrap());
    let cache = tdx_cache(&intel, &CollateralOptions::default());
    let n1 = node(&ca, Some(Arc::new(GeneratedTdx::honest(&intel))));
    let v = validator(&ca, &n1.config, tdx_trust(&intel, &cache, tdx_policy()));

    // The whole chain: TD quote → binds AK and nonce → AK signs the TPM quote.
    let doc = n1.issuer.issue(b"nonce-1", b"user").unwrap();
    let verified = v.validate(&doc, b"nonce-1", b"user").unwrap();
    let Some(CpuClaims::Tdx(claims)) = &verified.cpu else {
        panic!("no TDX claims: {:?}", verified.cpu);
    };
    assert_eq!(claims.status, "UpToDate");
    assert_eq!(claims.mrtd, MRTD);
    assert_eq!(claims.rtmr, RTMR);

    // Replay: this document's TD quote in a fresh document (another nonce).
    let fresh = n1.issuer.issue(b"nonce-2", b"user").unwrap();
    let mut replayed = AttestationDocument::decode(fresh.as_slice()).unwrap();
    replayed.cpu_evidence = AttestationDocument::decode(doc.as_slice())
        .unwrap()
        .cpu_evidence;
    let err = cpu_error(
        v.validate(&replayed.encode_to_vec(), b"nonce-2", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(err, CpuError::Binding(BindingError::ReportData { .. })),
        "{err:?}"
    );

    // Strip: no CPU evidence under the tdx variant.
    let bare = node(&ca, None);
    let err = cpu_error(
        v.validate(
            &bare.issuer.issue(b"nonce-3", b"user").unwrap(),
            b"nonce-3",
            b"user",
        )
        .unwrap_err(),
    );
    assert!(matches!(err, CpuError::Missing { .. }), "{err:?}");

    // Wrong root: Intel's pinned root, and another generated root with its
    // own (valid) collateral, both refuse the generated PCK chain.
    let pinned = CpuTrust::new(CpuPolicy::Tdx(tdx_policy()), Collateral::at(cache.path()));
    let err = tdx_error(
        validator(&ca, &n1.config, pinned)
            .validate(&doc, b"nonce-1", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(
            err,
            TdxError::Verification {
                check: "signature",
                ..
            }
        ),
        "{err}"
    );
    let other = TestIntel::for_platform(intel.platform()).unwrap();
    let other_cache = tdx_cache(&other, &CollateralOptions::default());
    let err = tdx_error(
        validator(
            &ca,
            &n1.config,
            tdx_trust(&other, &other_cache, tdx_policy()),
        )
        .validate(&doc, b"nonce-1", b"user")
        .unwrap_err(),
    );
    assert!(
        matches!(
            err,
            TdxError::Verification {
                check: "signature",
                ..
            }
        ),
        "{err}"
    );

    // Another MRTD than the config's.
    let mut policy = tdx_policy();
    policy.mrtd = Hex([0x3e; 48]);
    let err = tdx_error(
        validator(&ca, &n1.config, tdx_trust(&intel, &cache, policy))
            .validate(&doc, b"nonce-1", b"user")
            .unwrap_err(),
    );
    assert!(matches!(err, TdxError::Mrtd { .. }), "{err}");
    assert!(err.to_string().contains(&hex::encode([0x3e; 48])), "{err}");

    // The vtpm variant is unchanged: the same document, the evidence unused.
    let vtpm = validator(&ca, &n1.config, CpuTrust::default());
    assert!(vtpm
        .validate(&doc, b"nonce-1", b"user")
        .unwrap()
        .cpu
        .is_none());
}

#[test]
fn tdx_refuses_an_unbound_report_a_debug_td_a_revoked_pck_and_an_old_tcb() {
    let ca = EkCa::new().unwrap();
    let intel = Arc::new(TestIntel::new().unwrap());
    let cache = tdx_cache(&intel, &CollateralOptions::default());
    let trust = || tdx_trust(&intel, &cache, tdx_policy());

    // A genuine quote whose report_data does not commit to this AK.
    let n = node(
        &ca,
        Some(Arc::new(GeneratedTdx {
            report_data: Some([0x77; 64]),
            ..GeneratedTdx::honest(&intel)
        })),
    );
    let doc = n.issuer.issue(b"nonce", b"user").unwrap();
    let err = cpu_error(
        validator(&ca, &n.config, trust())
            .validate(&doc, b"nonce", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(&err, CpuError::Binding(BindingError::ReportData { actual, .. })
            if *actual == hex::encode([0x77; 64])),
        "{err:?}"
    );

    // A debuggable TD.
    let n = node(
        &ca,
        Some(Arc::new(GeneratedTdx {
            td_attributes: TD_ATTRIBUTES | TD_DEBUG,
            ..GeneratedTdx::honest(&intel)
        })),
    );
    let doc = n.issuer.issue(b"nonce", b"user").unwrap();
    let err = tdx_error(
        validator(&ca, &n.config, trust())
            .validate(&doc, b"nonce", b"user")
            .unwrap_err(),
    );
    assert!(
        matches!(
            err,
            TdxError::Verification {
                check: "TD attributes",
                ..
            }
        ),
        "{err}"
    );

    // An honest node, judged with other collateral.
    let n = node(&ca, Some(Arc::new(GeneratedTdx::honest(&intel))));
    let doc = n.issuer.issue(b"nonce", b"user").unwrap();
    let judged = |options: CollateralOptions, policy: TdxPolicy| {
        let cache = tdx_cache(&intel, &options);
        validator(&ca, &n.config, tdx_trust(&intel, &cache, policy))
            .validate(&doc, b"nonce", b"user")
            .map(|v| v.cpu)
    };

    // The PCK certificate is on the PCK CRL.
    let revoked = CollateralOptions {
        revoke_pck: true,
        ..CollateralOptions::default()
    };
    let err = tdx_error(judged(revoked, tdx_policy()).unwrap_err());
    assert!(
        matches!(
            err,
            TdxError::Verification {
                check: "revocation",
                ..
            }
        ),
        "{err}"
    );

    // The platform's TCB level is out of date: refused, unless the config
    // allows that status by name.
    let outdated = || CollateralOptions {
        platform_status: "OutOfDate".into(),
        advisories: vec!["INTEL-SA-01234".into()],
        ..CollateralOptions::default()
    };
    let err = tdx_error(judged(outdated(), tdx_policy()).unwrap_err());
    assert!(
        matches!(&err, TdxError::TcbStatus { actual, advisories, .. }
            if actual == "OutOfDate" && advisories == &["INTEL-SA-01234"]),
        "{err}"
    );
    let mut allowing = tdx_policy();
    allowing.allow_tcb_status = vec!["OutOfDate".into()];
    let Some(CpuClaims::Tdx(claims)) = judged(outdated(), allowing).unwrap() else {
        panic!("no TDX claims");
    };
    assert_eq!(claims.status, "OutOfDate");
    assert_eq!(claims.advisories, ["INTEL-SA-01234"]);
}

/// The join path with the `tdx` variant: the joining node proves its TD to
/// the join service and the service proves its TD to the node; a node
/// without CPU evidence gets no ticket, nor does a node whose quote chains
/// to another root, whose TD is debuggable or whose quote does not bind its
/// AK; and a node does not take a ticket from a service without CPU
/// evidence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_join_path_runs_with_the_tdx_variant() {
    use join_common::{
        config, free_port, measured_with, start_service, start_service_hardware, Hardware,
    };
    use keel_agent::join::{service_validator, KubeletKey, TicketClient, TicketError};
    use keel_proto::join::IssueJoinTicketRequest;
    use std::time::Duration;

    let ca = EkCa::new().unwrap();
    let intel = Arc::new(TestIntel::new().unwrap());
    let cache = tdx_cache(&intel, &CollateralOptions::default());
    let hardware = Hardware {
        reporter: Arc::new(GeneratedTdx::honest(&intel)),
        trust: Arc::new(tdx_trust(&intel, &cache, tdx_policy())),
    };
    let port = free_port();
    let service = start_service_hardware(&ca, port, &hardware).await;

    let tickets = |cpu: Option<Arc<dyn CpuReporter>>, port: u16| {
        let swtpm = Swtpm::start(&ca).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let tpm = measured_with(
            &swtpm,
            &dir.path().join("log"),
            &config(&ca, port, "w-1", "worker"),
            cpu,
        );
        let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
        let validator = service_validator(&tpm, trust, None)
            .unwrap()
            .with_cpu(hardware.trust.clone());
        (
            TicketClient::new(tpm, validator, Duration::from_secs(60)),
            swtpm,
            dir,
        )
    };
    let request = || {
        let key = KubeletKey::generate("w-1").unwrap();
        IssueJoinTicketRequest {
            disk_uuid: join_common::uuid(),
            kubelet_csr: key.csr_pem().as_bytes().to_vec(),
            is_control_plane: false,
            node_name: "w-1".into(),
            file_discovery: true,
        }
    };

    let (client, _sw, _dir) = tickets(Some(hardware.reporter.clone()), port);
    let mut raw = client
        .request_join_ticket(&service.endpoint, request())
        .await
        .unwrap();
    let secrets = client.open(raw.response.secrets.take()).await.unwrap();
    assert_eq!(secrets.state_disk_key.len(), 32);

    // A node without CPU evidence: refused in the handshake.
    let (bare, _sw2, _dir2) = tickets(None, port);
    let Err(err) = bare.request_join_ticket(&service.endpoint, request()).await else {
        panic!("a ticket was issued");
    };
    assert!(
        matches!(err, TicketError::Connect(_)),
        "{}",
        keel_atls::ErrorChain(&err)
    );

    // Nodes whose TD evidence is refused in the handshake: a quote chaining
    // to another root (the same platform certified by someone else's PKI),
    // a debuggable TD, a quote whose report_data does not bind the node's
    // AK.
    let foreign = Arc::new(TestIntel::for_platform(intel.platform()).unwrap());
    let refused: [(&str, GeneratedTdx); 3] = [
        ("another root", GeneratedTdx::honest(&foreign)),
        (
            "a debug TD",
            GeneratedTdx {
                td_attributes: TD_ATTRIBUTES | TD_DEBUG,
                ..GeneratedTdx::honest(&intel)
            },
        ),
        (
            "an unbound report",
            GeneratedTdx {
                report_data: Some([0x77; 64]),
                ..GeneratedTdx::honest(&intel)
            },
        ),
    ];
    for (what, reporter) in refused {
        let (client, _sw, _dir) = tickets(Some(Arc::new(reporter)), port);
        let Err(err) = client
            .request_join_ticket(&service.endpoint, request())
            .await
        else {
            panic!("{what}: a ticket was issued");
        };
        assert!(
            matches!(err, TicketError::Connect(_)),
            "{what}: {}",
            keel_atls::ErrorChain(&err)
        );
    }

    // A join service without CPU evidence: the node refuses it.
    let plain_port = free_port();
    let plain = start_service(&ca, plain_port).await;
    let (client, _sw3, _dir3) = tickets(Some(hardware.reporter.clone()), plain_port);
    let Err(err) = client.request_join_ticket(&plain.endpoint, request()).await else {
        panic!("a ticket was issued");
    };
    let chain = keel_atls::ErrorChain(&err).to_string();
    assert!(chain.contains("requires CPU evidence"), "{chain}");
}
