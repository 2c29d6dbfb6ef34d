//! AMD's revocation lists (the CRL and the VLEK CRL): checked on their
//! own (`snp::check_revocation`) and by the verifier whenever its
//! collateral cache holds one, with generated AMD-like roots whose ARK
//! signs lists as AMD's does, and against AMD's pinned Milan roots with a
//! CRL that only claims to be the ARK's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use keel_testkit::amd::{ReportFields, TestAmd};
use keel_verifier::cpu::binding::{report_data, Binding};
use keel_verifier::cpu::collateral::snp_crl_path;
use keel_verifier::cpu::policy::{Hex, Tcb};
use keel_verifier::cpu::snp::{self, AmdRoots, SigningKey, SnpError};
use keel_verifier::cpu::{Collateral, CpuError, CpuPolicy, CpuTrust, Evidence, SnpPolicy};
use time::{Duration, OffsetDateTime};

const MEASUREMENT: [u8; 48] = [7; 48];
const AK: &[u8] = b"attestation key";
const NONCE: &[u8] = b"nonce";

fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

fn unix(t: OffsetDateTime) -> u64 {
    u64::try_from(t.unix_timestamp()).unwrap()
}

fn roots(amd: &TestAmd) -> AmdRoots {
    AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()])
}

fn serial(der: &[u8]) -> Vec<u8> {
    use x509_parser::prelude::FromDer as _;
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(der).unwrap();
    cert.raw_serial().to_vec()
}

/// A CRL of `amd`'s ARK, current for a week, revoking `revoked`.
fn current_crl(amd: &TestAmd, revoked: &[Vec<u8>]) -> Vec<u8> {
    amd.crl(
        revoked,
        now() - Duration::days(1),
        now() + Duration::days(7),
    )
    .unwrap()
}

fn check(crl: &[u8], amd: &TestAmd) -> Result<usize, SnpError> {
    snp::check_revocation(crl, amd.vcek_der(), &roots(amd), unix(now()))
}

fn refused(result: Result<usize, SnpError>, expected: &str) {
    let e = result.expect_err(expected);
    assert!(
        e.to_string().contains(expected),
        "{e} (expected {expected:?})"
    );
}

#[test]
fn a_current_crl_of_the_ark_that_lists_neither_certificate_passes() {
    let amd = TestAmd::new().unwrap();
    let other = TestAmd::new().unwrap();
    assert_eq!(check(&current_crl(&amd, &[]), &amd).unwrap(), 0);
    // Another chain's VCEK listed: not this one.
    let crl = current_crl(&amd, &[serial(other.vcek_der())]);
    assert_eq!(check(&crl, &amd).unwrap(), 1);
}

#[test]
fn a_crl_revoking_the_ask_or_the_vcek_refuses() {
    let amd = TestAmd::new().unwrap();
    let revoked_vcek = current_crl(&amd, &[serial(amd.vcek_der())]);
    match check(&revoked_vcek, &amd) {
        Err(SnpError::Revoked { certificate, .. }) => assert_eq!(certificate, "endorsement key"),
        other => panic!("{other:?}"),
    }
    let revoked_ask = current_crl(&amd, &[vec![0x42], serial(amd.ask_der())]);
    match check(&revoked_ask, &amd) {
        Err(SnpError::Revoked { certificate, .. }) => assert_eq!(certificate, "ASK"),
        other => panic!("{other:?}"),
    }
    // The same serial with a leading zero octet is the same certificate.
    let mut padded = vec![0];
    padded.extend(serial(amd.vcek_der()));
    refused(
        check(&current_crl(&amd, &[padded]), &amd),
        "revokes the endorsement key",
    );
}

#[test]
fn a_forged_altered_or_stale_crl_refuses() {
    let amd = TestAmd::new().unwrap();
    // Another ARK of the same name: the issuer matches, the key does not.
    let impostor = TestAmd::new().unwrap();
    refused(
        check(&current_crl(&impostor, &[]), &amd),
        "signature does not verify with the ARK",
    );
    // Another product line's ARK.
    let milan = TestAmd::for_line("Milan").unwrap();
    refused(
        check(&current_crl(&milan, &[]), &amd),
        "not by the ARK of SEV-Test",
    );
    // The revocation of the VCEK cut out of a signed CRL: every byte of the
    // list is signed. Flip each byte of a revoked serial in turn.
    let listed = serial(amd.vcek_der());
    let crl = current_crl(&amd, std::slice::from_ref(&listed));
    let at = crl
        .windows(listed.len())
        .position(|w| w == listed.as_slice())
        .unwrap();
    for i in at..at + listed.len() {
        let mut altered = crl.clone();
        altered[i] ^= 0x01;
        refused(check(&altered, &amd), "signature does not verify");
    }
    // Not yet valid, and past its next update.
    let future = amd
        .crl(&[], now() + Duration::days(1), now() + Duration::days(8))
        .unwrap();
    refused(check(&future, &amd), "thisUpdate");
    let stale = amd
        .crl(&[], now() - Duration::days(8), now() - Duration::days(1))
        .unwrap();
    refused(check(&stale, &amd), "fetch it again");
    // Bytes after it, and no CRL at all.
    let mut trailing = current_crl(&amd, &[]);
    trailing.push(0);
    refused(check(&trailing, &amd), "1 bytes after the CRL");
    refused(check(b"<html>", &amd), "does not parse");
}

fn data(relative: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/data/cvm")
            .join(relative),
    )
    .unwrap()
}

/// A CRL in the exact name of AMD's Milan ARK, signed by another key, is
/// refused for a VCEK of the line and, as its VLEK CRL, for a VLEK.
#[test]
fn a_crl_in_the_name_of_amds_milan_ark_not_signed_by_it_refuses() {
    use x509_parser::prelude::FromDer as _;
    for (chain, certificate, list) in [
        (
            "snp/amd-roots/ask_ark_milan.pem",
            "snp/milan-virtee/vcek_milan.der",
            "AMD Milan CRL",
        ),
        (
            "snp/amd-roots/ask_ark_milan_vlek.pem",
            "snp/aws-milan-vlek/test-vlek.der",
            "AMD Milan VLEK CRL",
        ),
    ] {
        let chain = data(chain);
        let ark = x509_parser::pem::Pem::iter_from_buffer(&chain)
            .nth(1)
            .unwrap()
            .unwrap()
            .contents;
        let crl = keel_testkit::amd::crl_in_the_name_of(&ark, &[]).unwrap();
        let (_, parsed) =
            x509_parser::revocation_list::CertificateRevocationList::from_der(&crl).unwrap();
        let (_, ark) = x509_parser::certificate::X509Certificate::from_der(&ark).unwrap();
        assert_eq!(
            parsed.issuer(),
            ark.subject(),
            "the CRL names AMD's Milan ARK"
        );
        let e = snp::check_revocation(&crl, &data(certificate), &AmdRoots::pinned(), unix(now()))
            .unwrap_err();
        assert!(
            e.to_string().contains(&format!(
                "{list}: its signature does not verify with the ARK"
            )),
            "{e}"
        );
    }
}

/// A verifier of `amd`'s chips whose collateral cache is `cache`.
fn trust(amd: &TestAmd, cache: &Path) -> CpuTrust {
    let policy = SnpPolicy::new(Tcb::from(amd.tcb()), Hex(MEASUREMENT));
    CpuTrust::new(CpuPolicy::SevSnp(policy), Collateral::at(cache)).with_snp_roots(roots(amd))
}

/// The verifier's revocation check of `amd`'s reports, whose endorsement
/// key is of kind `key`, through its collateral cache: the list of that
/// kind counts, the other kind's is never read.
fn the_cached_list_of_the_key_is_checked(amd: &TestAmd, key: SigningKey) {
    let report = amd
        .report(&ReportFields::guest(report_data(NONCE, AK), MEASUREMENT))
        .unwrap();
    let evidence = Evidence {
        binding: Binding::Guest,
        report,
        certificate: amd.vcek_der().to_vec(),
    };
    let cache = tempfile::tempdir().unwrap();
    let path = |key| cache.path().join(snp_crl_path("Test", key).unwrap());
    let (crl_path, other_path) = match key {
        SigningKey::Vcek => (path(SigningKey::Vcek), path(SigningKey::Vlek)),
        SigningKey::Vlek => (path(SigningKey::Vlek), path(SigningKey::Vcek)),
    };
    let verify = || trust(amd, cache.path()).verify(Some(&evidence), AK, NONCE, unix(now()));

    // No list cached: revocation is not checked.
    verify().unwrap();
    std::fs::create_dir_all(crl_path.parent().unwrap()).unwrap();
    // The other kind's list is not read, whatever it holds.
    std::fs::write(&other_path, b"garbage").unwrap();
    verify().unwrap();
    std::fs::write(&crl_path, current_crl(amd, &[vec![0x42]])).unwrap();
    verify().unwrap();
    // The cached list revokes the endorsement key, then the ASK (ASVK).
    for (revoked, named) in [
        (serial(amd.vcek_der()), "endorsement key"),
        (serial(amd.ask_der()), key.intermediate()),
    ] {
        std::fs::write(&crl_path, current_crl(amd, &[revoked])).unwrap();
        match verify() {
            Err(CpuError::Snp(SnpError::Revoked {
                list, certificate, ..
            })) => {
                assert_eq!(list, key.crl_name());
                assert_eq!(certificate, named);
            }
            other => panic!("{other:?}"),
        }
    }
    // A stale or forged list in the cache fails closed.
    let stale = amd
        .crl(&[], now() - Duration::days(8), now() - Duration::days(1))
        .unwrap();
    std::fs::write(&crl_path, stale).unwrap();
    match verify() {
        Err(CpuError::Snp(SnpError::CrlTime { list, .. })) => assert_eq!(list, key.crl_name()),
        other => panic!("{other:?}"),
    }
    let forged = current_crl(&TestAmd::new().unwrap(), &[]);
    for crl in [forged, b"garbage".to_vec()] {
        std::fs::write(&crl_path, crl).unwrap();
        match verify() {
            Err(CpuError::Snp(SnpError::Crl { list, .. })) => assert_eq!(list, key.crl_name()),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn the_verifier_checks_the_cached_crl_of_the_product_line() {
    the_cached_list_of_the_key_is_checked(&TestAmd::new().unwrap(), SigningKey::Vcek);
}

/// Attacker's move: a report signed by a VLEK under an ASVK that AMD
/// revoked. AMD lists revoked ASVKs in the product line's VLEK CRL, not in
/// its CRL, so a verifier that checked VLEK reports against the CRL would
/// pass it: a VLEK report is checked against the VLEK CRL alone (the
/// VLEK's own serial too, though AMD is not expected to list one).
#[test]
fn a_vlek_report_is_checked_against_the_vlek_crl_only() {
    the_cached_list_of_the_key_is_checked(&TestAmd::vlek().unwrap(), SigningKey::Vlek);
}
