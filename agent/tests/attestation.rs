//! Attestation documents issued by a node's swtpm and judged by the validator.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod join_common;

use std::collections::BTreeMap;

use join_common::{issuing_node_on, IssuingNode as Node};
use keel_proto::attestation::AttestationDocument;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::ek::{EkError, EkTrust};
use keel_verifier::measurement::{event_digest, EventType, ReplayError};
use keel_verifier::measurements::{Expected, Measurements};
use keel_verifier::quote::QuoteError;
use keel_verifier::validator::{ValidationError, Validator};
use prost::Message;

fn node(ca: &EkCa) -> Node {
    node_on(Swtpm::start(ca).unwrap())
}

/// An issuing node on `swtpm` that also recorded its identity.
fn node_on(swtpm: Swtpm) -> Node {
    let n = issuing_node_on(swtpm, None);
    n.tpm
        .lock()
        .unwrap()
        .record(EventType::NodeIdentity, "identity", n.config.node_bytes())
        .unwrap();
    n
}

/// What a swtpm node with `config` measures, all enforced: PCRs 4, 9 and
/// 11 are zero there, PCR 12 is the config's; then `extra`, added or
/// replacing.
fn expected(config: &NodeConfig, extra: &[(u32, Expected)]) -> Measurements {
    let mut entries: BTreeMap<u32, Expected> = [4, 9, 11]
        .into_iter()
        .map(|pcr| (pcr, Expected::enforced([0; 32])))
        .collect();
    entries.insert(12, Expected::enforced(config.expected_config_pcr()));
    entries.extend(extra.iter().cloned());
    Measurements::new(entries).unwrap()
}

fn validator(ca: &EkCa, node: &Node) -> Validator {
    let m = expected(&node.config, &[(15, Expected::enforced([0; 32]))]);
    Validator::new(m, EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap())
}

#[test]
fn a_fresh_document_validates() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca);
    let doc = n.issuer.issue(b"nonce", b"key hash").unwrap();
    let verified = validator(&ca, &n)
        .validate(&doc, b"nonce", b"key hash")
        .unwrap();
    assert_eq!(verified.events.len(), 2);
    assert_eq!(verified.pcrs.len(), 16);
    assert!(verified.warnings.is_empty());
}

#[test]
fn replayed_document_fails_on_the_nonce() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca);
    let doc = n.issuer.issue(b"old nonce", b"k").unwrap();
    let err = validator(&ca, &n)
        .validate(&doc, b"new nonce", b"k")
        .unwrap_err();
    assert!(
        matches!(err, ValidationError::Quote(QuoteError::QualifyingData)),
        "{err}"
    );
}

#[test]
fn document_for_another_key_fails() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca);
    let doc = n.issuer.issue(b"n", b"key A").unwrap();
    let err = validator(&ca, &n)
        .validate(&doc, b"n", b"key B")
        .unwrap_err();
    assert!(matches!(err, ValidationError::UserData), "{err}");
}

#[test]
fn enforced_mismatch_fails_and_names_the_pcr_warn_only_passes() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca);
    let doc = n.issuer.issue(b"n", b"k").unwrap();
    let trust = EkTrust::from_pem(&ca.issuer_pem().unwrap()).unwrap();

    let enforced = expected(&n.config, &[(12, Expected::enforced([7; 32]))]);
    let err = Validator::new(enforced, trust.clone())
        .validate(&doc, b"n", b"k")
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("PCR 12: expected 0707"), "{text}");

    // PCR 13 (the node's identity) differs per node: expected only warn-only.
    let warn = expected(&n.config, &[(13, Expected::warn_only([7; 32]))]);
    let ok = Validator::new(warn, trust)
        .validate(&doc, b"n", b"k")
        .unwrap();
    assert_eq!(ok.warnings.len(), 1);
    assert_eq!(ok.warnings[0].pcr, 13);
}

#[test]
fn ek_from_an_untrusted_ca_or_without_certificate_fails() {
    let ca = EkCa::new().unwrap();
    let other_ca = EkCa::new().unwrap();
    // swtpm_localca creates its CA when it manufactures the first TPM.
    let _trusted = node(&ca);
    let n = node(&other_ca);
    let doc = n.issuer.issue(b"n", b"k").unwrap();
    let err = validator(&ca, &n).validate(&doc, b"n", b"k").unwrap_err();
    // Both CAs are named swtpm-localca: the signature check is what tells them apart.
    assert!(
        matches!(
            err,
            ValidationError::Endorsement(EkError::Signature | EkError::UntrustedIssuer(_))
        ),
        "{err}"
    );

    let bare = node_on(Swtpm::start_bare().unwrap());
    let doc = bare.issuer.issue(b"n", b"k").unwrap();
    let err = validator(&ca, &bare)
        .validate(&doc, b"n", b"k")
        .unwrap_err();
    assert!(
        matches!(err, ValidationError::Endorsement(EkError::NoCertificate)),
        "{err}"
    );
}

#[test]
fn forged_signature_and_tampered_log_fail() {
    let ca = EkCa::new().unwrap();
    let n = node(&ca);
    let v = validator(&ca, &n);
    let doc = AttestationDocument::decode(n.issuer.issue(b"n", b"k").unwrap().as_slice()).unwrap();

    let mut forged = doc.clone();
    let last = forged.signature.len() - 1;
    forged.signature[last] ^= 0x55;
    let err = v.validate(&forged.encode_to_vec(), b"n", b"k").unwrap_err();
    assert!(
        matches!(err, ValidationError::Quote(QuoteError::Signature)),
        "{err}"
    );

    // An entry edited but its digest left: the entry itself is refused.
    let mut tampered = doc.clone();
    let entry = &mut tampered.event_log[1];
    let evil = b"{\"name\":\"evil\"}".to_vec();
    entry.description = "edited".into();
    entry.data = evil.clone();
    let err = v
        .validate(&tampered.encode_to_vec(), b"n", b"k")
        .unwrap_err();
    assert!(
        matches!(
            err,
            ValidationError::EventLog(ReplayError::DigestMismatch { index: 1, .. })
        ),
        "{err}"
    );

    // The same edit with the entry's digest recomputed, as anyone can: the
    // log is consistent in itself, and only its replay against the quoted
    // PCR refuses it.
    let entry = &mut tampered.event_log[1];
    let event_type = EventType::parse(&entry.event_type).unwrap();
    entry.digest = event_digest(entry.seq, event_type, &evil).to_vec();
    let pcr = entry.pcr;
    let err = v
        .validate(&tampered.encode_to_vec(), b"n", b"k")
        .unwrap_err();
    assert!(
        matches!(
            &err,
            ValidationError::EventLog(ReplayError::ValueMismatch { pcr: p, .. }) if *p == pcr
        ),
        "{err}"
    );

    let err = v.validate(b"\xff\xff\xff", b"n", b"k").unwrap_err();
    assert!(matches!(err, ValidationError::Decode(_)), "{err}");
}
