//! Turin's VCEKs, with generated AMD-like roots under Turin's names (no
//! real Turin report is among the samples): an 8-byte chip ID, which the
//! report's 64 bytes carry first with 56 zeros after, and an FMC SVN,
//! which the report's Turin TCB layout carries too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_testkit::amd::{ReportFields, TestAmd};
use keel_verifier::clock::now;
use keel_verifier::cpu::snp::{self, AmdRoots, SnpError};

fn fields() -> ReportFields {
    ReportFields::guest([5; 64], [7; 48])
}

fn verify(amd: &TestAmd, raw: &[u8]) -> Result<snp::SnpClaims, SnpError> {
    let report = snp::parse(raw).unwrap();
    let roots = AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()]);
    snp::verify_signed(raw, &report, amd.vcek_der(), &roots, now())
}

#[test]
fn a_turin_report_verifies_with_its_8_byte_chip_id_and_fmc() {
    let amd = TestAmd::for_line("Turin").unwrap();
    assert_eq!(amd.chip_id()[8..], [0; 56]);
    let claims = verify(&amd, &amd.report(&fields()).unwrap()).unwrap();
    assert_eq!(claims.product, "SEV-Turin");
    assert_eq!(claims.version, 3);
    assert_eq!(claims.chip_id, amd.chip_id());
    let [bootloader, tee, snp, microcode] = amd.tcb();
    assert_eq!(
        (
            claims.reported_tcb.bootloader,
            claims.reported_tcb.tee,
            claims.reported_tcb.snp,
            claims.reported_tcb.microcode
        ),
        (bootloader, tee, snp, microcode)
    );
}

/// Attacker's move: a report of another chip presented with this chip's
/// Turin VCEK, which certifies 8 bytes only: another first 8 bytes, or the
/// same 8 followed by anything but zeros (a chip ID the certificate does
/// not name).
#[test]
fn a_turin_report_of_another_chip_id_is_refused() {
    let amd = TestAmd::for_line("Turin").unwrap();
    for at in [0, 7, 8, 63] {
        let mut chip_id = amd.chip_id();
        chip_id[at] ^= 1;
        let raw = amd
            .report_claiming(&fields(), &chip_id, amd.tcb_bytes())
            .unwrap();
        let err = verify(&amd, &raw).unwrap_err();
        assert!(matches!(err, SnpError::ChipId { .. }), "byte {at}: {err:?}");
    }
}

/// Attacker's move: a report whose FMC SVN is not the one the VCEK
/// certifies (the key is derived from the whole TCB, so only a report of
/// another TCB could carry it).
#[test]
fn a_turin_report_with_another_fmc_is_refused() {
    let amd = TestAmd::for_line("Turin").unwrap();
    let mut tcb = amd.tcb_bytes();
    tcb[0] += 1;
    let raw = amd.report_claiming(&fields(), &amd.chip_id(), tcb).unwrap();
    let err = verify(&amd, &raw).unwrap_err();
    assert!(
        matches!(
            err,
            SnpError::CertifiedTcb {
                component: "fmc",
                expected: 1,
                actual: 2
            }
        ),
        "{err:?}"
    );
}

/// Other lines keep their 64-byte chip ID: a Milan-named chain's VCEK
/// certifies all 64, and a report matching only its first 8 is refused.
#[test]
fn other_lines_compare_all_64_bytes() {
    let amd = TestAmd::for_line("Milan").unwrap();
    verify(&amd, &amd.report(&fields()).unwrap()).unwrap();
    let mut chip_id = amd.chip_id();
    chip_id[8..].fill(0);
    let raw = amd
        .report_claiming(&fields(), &chip_id, amd.tcb_bytes())
        .unwrap();
    let err = verify(&amd, &raw).unwrap_err();
    assert!(matches!(err, SnpError::ChipId { .. }), "{err:?}");
}

/// A VCEK is valid only within its dates: a report verified before the
/// certificate's start (a clock set back, a certificate issued ahead) is
/// refused as one verified after its end is.
#[test]
fn a_vcek_before_its_validity_is_refused() {
    let amd = TestAmd::for_line("Turin").unwrap();
    let raw = amd.report(&fields()).unwrap();
    let report = snp::parse(&raw).unwrap();
    let roots = AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()]);
    // rcgen's default validity starts in 1975.
    let err = snp::verify_signed(&raw, &report, amd.vcek_der(), &roots, 100).unwrap_err();
    assert!(
        matches!(err, SnpError::CertificateTime { now: 100, .. }),
        "{err:?}"
    );
}

/// Attacker's move: a report read in another line's TCB layout than its
/// chain's (the layout comes from the report's CPUID fields, or for
/// version 2 from its chip ID): under a Turin VCEK, the FMC SVN would go
/// unchecked and the other SVNs be read from the wrong bytes; under
/// another line's, the reverse. Refused either way.
#[test]
fn a_report_in_another_lines_tcb_layout_is_refused() {
    let turin = TestAmd::for_line("Turin").unwrap();
    let as_genoa = turin
        .report_of_cpu(
            &fields(),
            &turin.chip_id(),
            turin.tcb_bytes(),
            Some((0x19, 0x11)),
        )
        .unwrap();
    let err = verify(&turin, &as_genoa).unwrap_err();
    assert!(matches!(err, SnpError::TcbLayout { .. }), "{err:?}");

    let milan = TestAmd::for_line("Milan").unwrap();
    let as_turin = milan
        .report_of_cpu(
            &fields(),
            &milan.chip_id(),
            milan.tcb_bytes(),
            Some((0x1a, 0x02)),
        )
        .unwrap();
    let err = verify(&milan, &as_turin).unwrap_err();
    assert!(matches!(err, SnpError::TcbLayout { .. }), "{err:?}");
}
