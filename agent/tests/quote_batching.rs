//! Quote batching against a real swtpm and the real validator: requests
//! that arrive while the TPM is busy share the next quote, each document
//! proves its own nonce through its inclusion path, and every way of
//! presenting a batch's evidence for a nonce outside it is refused.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod join_common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_agent::attestation::cpu::{CpuReportError, CpuReporter};
use keel_agent::tpm::Tpm;
use keel_proto::attestation::{cpu_evidence, AttestationDocument, CpuEvidence};
use keel_testkit::amd::{ReportFields, TestAmd};
use keel_testkit::swtpm::EkCa;
use keel_verifier::batch::{BatchError, MAX_DEPTH};
use keel_verifier::cpu::policy::{Hex, SnpPolicy, Tcb};
use keel_verifier::cpu::snp::AmdRoots;
use keel_verifier::cpu::{BindingError, Collateral, CpuError, CpuPolicy, CpuTrust};
use keel_verifier::ek::EkTrust;
use keel_verifier::measurement::EventType;
use keel_verifier::measurements::{Expected, Measurements};
use keel_verifier::quote::QuoteError;
use keel_verifier::validator::{ValidationError, Validator};
use prost::Message;

use join_common::{issuing_node as node, IssuingNode as Node};

fn validator(ca: &EkCa, node: &Node) -> Validator {
    let mut entries: BTreeMap<u32, Expected> = [4, 9, 11]
        .into_iter()
        .map(|pcr| (pcr, Expected::enforced([0; 32])))
        .collect();
    entries.insert(12, Expected::enforced(node.config.expected_config_pcr()));
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();
    Validator::new(Measurements::new(entries).unwrap(), trust)
}

/// One handshake's request: its nonce and user data (the key binding).
#[derive(Clone, Debug)]
struct Request {
    nonce: Vec<u8>,
    user_data: Vec<u8>,
}

fn requests(tag: &str, n: usize) -> Vec<Request> {
    (0..n)
        .map(|i| Request {
            nonce: format!("{tag}-nonce-{i}").into_bytes(),
            user_data: format!("{tag}-key-{i}").into_bytes(),
        })
        .collect()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Issues `batch` from concurrent threads so that all of it is quoted at
/// once: the TPM is held while a first request (quoted alone) waits for it
/// and `batch` queues behind. Returns each request's document, in order.
fn issue_as_one_batch(node: &Node, batch: &[Request]) -> Vec<Vec<u8>> {
    let before = node.issuer.stats();
    let guard = node.tpm.lock().unwrap();
    let first = {
        let issuer = node.issuer.clone();
        std::thread::spawn(move || issuer.issue(b"first", b"first-key").unwrap())
    };
    wait_for("the first quote to start", || {
        node.issuer.stats().rounds == before.rounds + 1
    });
    let threads: Vec<_> = batch
        .iter()
        .cloned()
        .map(|r| {
            let issuer = node.issuer.clone();
            std::thread::spawn(move || issuer.issue(&r.nonce, &r.user_data).unwrap())
        })
        .collect();
    wait_for("the batch to queue", || {
        node.issuer.waiting() == batch.len()
    });
    drop(guard);
    first.join().unwrap();
    let documents = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let after = node.issuer.stats();
    assert_eq!(after.rounds, before.rounds + 2, "one quote for the batch");
    assert_eq!(after.requests, before.requests + 1 + batch.len() as u64);
    documents
}

fn decode(document: &[u8]) -> AttestationDocument {
    AttestationDocument::decode(document).unwrap()
}

fn nonce_refused(result: Result<impl std::fmt::Debug, ValidationError>) {
    match result {
        Err(ValidationError::Quote(QuoteError::QualifyingData)) => {}
        other => panic!("expected the nonce to be refused as not in the batch: {other:?}"),
    }
}

#[test]
fn a_batch_shares_one_quote_and_each_document_proves_its_own_nonce() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, None);
    let v = validator(&ca, &n);

    // Alone, a request is quoted at once: a batch of one, an empty path.
    let alone = decode(&n.issuer.issue(b"alone", b"key").unwrap());
    assert!(alone.quote_batch_path.is_empty() && alone.quote_batch_index == 0);
    v.validate(&alone.encode_to_vec(), b"alone", b"key")
        .unwrap();

    let batch = requests("a", 11);
    let documents = issue_as_one_batch(&n, &batch);
    let decoded: Vec<_> = documents.iter().map(|d| decode(d)).collect();
    let mut indices: Vec<u32> = decoded.iter().map(|d| d.quote_batch_index).collect();
    indices.sort_unstable();
    assert_eq!(indices, (0..11).collect::<Vec<u32>>(), "one leaf each");
    for (r, (document, d)) in batch.iter().zip(documents.iter().zip(&decoded)) {
        // One quote, signature and set of PCRs for the whole batch.
        assert_eq!(d.quote, decoded[0].quote);
        assert_eq!(d.signature, decoded[0].signature);
        assert_eq!(d.quote_batch_path.len(), 4, "11 leaves: 4 steps");
        let verified = v.validate(document, &r.nonce, &r.user_data).unwrap();
        assert!(verified.warnings.is_empty());
    }
}

#[test]
fn a_document_after_an_extend_carries_the_new_pcr_values() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, None);
    let v = validator(&ca, &n);
    let pcr13 = |d: &AttestationDocument| {
        d.pcrs
            .iter()
            .find(|p| p.index == 13)
            .map(|p| p.digest.clone())
            .unwrap()
    };
    let before = decode(&n.issuer.issue(b"n1", b"k").unwrap());
    let again = decode(&n.issuer.issue(b"n2", b"k").unwrap());
    assert_eq!(pcr13(&before), pcr13(&again));
    // The issuer reads the PCRs again only when the quote says they
    // changed; after this extend, the document must carry the new value.
    n.tpm
        .lock()
        .unwrap()
        .record(EventType::Component, "component", b"kubelet".to_vec())
        .unwrap();
    let after = n.issuer.issue(b"n3", b"k").unwrap();
    let verified = v.validate(&after, b"n3", b"k").unwrap();
    assert_eq!(verified.events.len(), 2);
    assert_ne!(pcr13(&decode(&after)), pcr13(&before));
}

#[test]
fn evidence_for_a_nonce_outside_the_batch_is_refused() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, None);
    let v = validator(&ca, &n);
    let early = requests("early", 5);
    let early_docs = issue_as_one_batch(&n, &early);
    let late = requests("late", 5);
    let late_docs = issue_as_one_batch(&n, &late);
    let d = decode(&late_docs[1]);

    // A nonce that was in no batch.
    nonce_refused(v.validate(&late_docs[1], b"never sent", &late[1].user_data));
    // Another leaf's nonce of the same batch, with this leaf's path.
    nonce_refused(v.validate(&late_docs[1], &late[2].nonce, &late[1].user_data));
    // An earlier batch's document presented to a later handshake: its tree
    // does not hold the later nonce, whichever leaf it is taken from.
    for (r, doc) in late.iter().zip(&early_docs) {
        nonce_refused(v.validate(doc, &r.nonce, &early[0].user_data));
    }
    // And the other way: a later batch does not vouch for an earlier nonce.
    nonce_refused(v.validate(&late_docs[0], &early[0].nonce, &late[0].user_data));

    // The path, tampered: a flipped bit in each sibling.
    for step in 0..d.quote_batch_path.len() {
        let mut t = d.clone();
        t.quote_batch_path[step][7] ^= 0x10;
        nonce_refused(v.validate(&t.encode_to_vec(), &late[1].nonce, &late[1].user_data));
    }
    // Any other index that fits the path, siblings swapped, a step dropped
    // or one added.
    for index in (0..8).filter(|i| *i != d.quote_batch_index) {
        let mut t = d.clone();
        t.quote_batch_index = index;
        nonce_refused(v.validate(&t.encode_to_vec(), &late[1].nonce, &late[1].user_data));
    }
    let mut t = d.clone();
    t.quote_batch_path.swap(0, 1);
    nonce_refused(v.validate(&t.encode_to_vec(), &late[1].nonce, &late[1].user_data));
    let mut t = d.clone();
    t.quote_batch_path.pop();
    t.quote_batch_index &= 0b11;
    nonce_refused(v.validate(&t.encode_to_vec(), &late[1].nonce, &late[1].user_data));
    let mut t = d.clone();
    t.quote_batch_path.push(vec![0; 32]);
    nonce_refused(v.validate(&t.encode_to_vec(), &late[1].nonce, &late[1].user_data));

    // Out of bounds: refused before any hashing.
    let mut t = d.clone();
    t.quote_batch_path = vec![vec![0; 32]; MAX_DEPTH + 1];
    let err = v
        .validate(&t.encode_to_vec(), &late[1].nonce, &late[1].user_data)
        .unwrap_err();
    assert!(
        matches!(err, ValidationError::BatchPath(BatchError::PathTooLong(9))),
        "{err}"
    );
    let mut t = d.clone();
    t.quote_batch_index = 8;
    let err = v
        .validate(&t.encode_to_vec(), &late[1].nonce, &late[1].user_data)
        .unwrap_err();
    assert!(
        matches!(
            err,
            ValidationError::BatchPath(BatchError::IndexOutOfRange { index: 8, depth: 3 })
        ),
        "{err}"
    );
    let mut t = d.clone();
    t.quote_batch_path[2].pop();
    let err = v
        .validate(&t.encode_to_vec(), &late[1].nonce, &late[1].user_data)
        .unwrap_err();
    assert!(
        matches!(
            err,
            ValidationError::BatchPath(BatchError::SiblingLength(2))
        ),
        "{err}"
    );

    // The untouched document still validates: each refusal above was the
    // change, not the document.
    v.validate(&late_docs[1], &late[1].nonce, &late[1].user_data)
        .unwrap();
}

#[test]
fn the_key_binding_cannot_move_between_leaves() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, None);
    let v = validator(&ca, &n);
    let batch = requests("b", 4);
    let docs = issue_as_one_batch(&n, &batch);
    let (a, b) = (decode(&docs[0]), decode(&docs[1]));

    // A's document presented on a connection whose key is B's: A's nonce
    // is in the batch, but the document binds A's key.
    let err = v
        .validate(&docs[0], &batch[0].nonce, &batch[1].user_data)
        .unwrap_err();
    assert!(matches!(err, ValidationError::UserData), "{err}");

    // A's document rewritten to carry B's key (B's user data is in the
    // batch, but never with A's nonce): with A's path, with B's path.
    let mut moved = a.clone();
    moved.user_data = b.user_data.clone();
    nonce_refused(v.validate(&moved.encode_to_vec(), &batch[0].nonce, &batch[1].user_data));
    moved.quote_batch_index = b.quote_batch_index;
    moved.quote_batch_path = b.quote_batch_path.clone();
    nonce_refused(v.validate(&moved.encode_to_vec(), &batch[0].nonce, &batch[1].user_data));

    // And through the aTLS interface the refusal is a nonce mismatch or a
    // key-binding mismatch, as for an unbatched document.
    let atls = keel_atls::Validator::validate(
        &v,
        &moved.encode_to_vec(),
        &batch[0].nonce,
        &batch[1].user_data,
    );
    assert!(
        matches!(atls, Err(keel_atls::ValidationError::NonceMismatch)),
        "{atls:?}"
    );
    let atls = keel_atls::Validator::validate(&v, &docs[0], &batch[0].nonce, &batch[1].user_data);
    assert!(
        matches!(atls, Err(keel_atls::ValidationError::KeyBindingMismatch)),
        "{atls:?}"
    );
}

/// A leaf encodes its nonce's length in 16 bits, so a longer nonce would
/// share its leaf with a cut nonce followed by other user data: the
/// issuer refuses to quote one (a control plane's evidence loop hands the
/// node nonces of its choosing), as the validator refuses to check one.
#[test]
fn a_nonce_longer_than_a_leaf_encodes_is_not_quoted() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca, None);
    let longest = vec![7u8; keel_verifier::batch::MAX_NONCE_BYTES];
    n.issuer.issue(&longest, b"key").unwrap();
    let longer = vec![7u8; keel_verifier::batch::MAX_NONCE_BYTES + 1];
    let err = n.issuer.issue(&longer, b"key").unwrap_err();
    assert!(
        matches!(
            err,
            keel_agent::attestation::issuer::IssueError::Tree(
                keel_verifier::batch::BatchError::NonceTooLong(65_536)
            )
        ),
        "{err}"
    );
}

/// A generated SEV-SNP chip that signs whatever `report_data` it is asked
/// for, and counts the reports.
struct GeneratedSnp {
    amd: Arc<TestAmd>,
    reports: std::sync::atomic::AtomicUsize,
}

const MEASUREMENT: [u8; 48] = [0x5a; 48];

impl CpuReporter for GeneratedSnp {
    fn report(
        &self,
        report_data: &[u8; 64],
        _tpm: &mut Tpm,
    ) -> Result<CpuEvidence, CpuReportError> {
        self.reports
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let report = self
            .amd
            .report(&ReportFields::guest(*report_data, MEASUREMENT))
            .unwrap();
        Ok(CpuEvidence {
            binding: cpu_evidence::Binding::Guest.into(),
            report,
            certificate: self.amd.vcek_der().to_vec(),
        })
    }
}

#[test]
fn one_cpu_report_binds_the_batch_root_and_not_another_batch() {
    let ca = EkCa::new().unwrap();
    let amd = Arc::new(TestAmd::new().unwrap());
    let chip = Arc::new(GeneratedSnp {
        amd: amd.clone(),
        reports: Default::default(),
    });
    let n = node(&ca, Some(chip.clone()));
    let trust = CpuTrust::new(
        CpuPolicy::SevSnp(SnpPolicy {
            host_data: Some(Hex([0; 32])),
            ..SnpPolicy::new(Tcb::from(amd.tcb()), Hex(MEASUREMENT))
        }),
        Collateral::default(),
    )
    .with_snp_roots(AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()]));
    let v = validator(&ca, &n).with_cpu(Arc::new(trust));

    let first = requests("c1", 3);
    let first_docs = issue_as_one_batch(&n, &first);
    let second = requests("c2", 3);
    let second_docs = issue_as_one_batch(&n, &second);
    // Four quotes (two alone, two batches), four CPU reports.
    assert_eq!(chip.reports.load(std::sync::atomic::Ordering::SeqCst), 4);
    for (r, doc) in first.iter().zip(&first_docs) {
        v.validate(doc, &r.nonce, &r.user_data).unwrap();
    }
    let shared = decode(&first_docs[0]).cpu_evidence;
    assert!(first_docs.iter().all(|d| decode(d).cpu_evidence == shared));

    // The first batch's report in a document of the second: the quote is
    // fresh and holds the nonce, the report binds the other root.
    let mut replayed = decode(&second_docs[0]);
    replayed.cpu_evidence = shared;
    let err = v
        .validate(
            &replayed.encode_to_vec(),
            &second[0].nonce,
            &second[0].user_data,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            ValidationError::Cpu(CpuError::Binding(BindingError::ReportData { .. }))
        ),
        "{err}"
    );
}
