//! VLEK-signed reports, with generated AMD-like roots whose ARK certifies
//! an ASVK: the report verifies under the ASVK, and the key a report names
//! as its signer must be the kind its certificate's intermediate
//! certifies (the VLEK report's chip ID is not checked, so a report naming
//! a VLEK must not pass under an ASK).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_testkit::amd::{LaunchFields, ReportFields, RootValidity, TestAmd};
use keel_verifier::clock::now;
use keel_verifier::cpu::snp::{self, AmdRoots, SigningKey, SnpError};

fn fields() -> ReportFields {
    ReportFields::guest([5; 64], [7; 48])
}

/// A report of `amd`'s naming `signing_key` (`None`: the key that signs
/// it), verified with `amd`'s roots and endorsement key.
fn verify(amd: &TestAmd, signing_key: Option<u8>) -> Result<snp::SnpClaims, SnpError> {
    let launch = LaunchFields {
        signing_key,
        ..LaunchFields::default()
    };
    let raw = amd.report_launched(&fields(), &launch).unwrap();
    let report = snp::parse(&raw).unwrap();
    let roots = AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()]);
    snp::verify_signed(&raw, &report, amd.vcek_der(), &roots, now())
}

#[test]
fn a_vlek_report_verifies_under_its_asvk() {
    let amd = TestAmd::vlek().unwrap();
    let claims = verify(&amd, None).unwrap();
    assert_eq!(claims.signing_key, SigningKey::Vlek);
    assert_eq!(claims.product, "SEV-VLEK-Test");
    assert_eq!(claims.chip_id, [0; 64]);
    assert_eq!(snp::product_line(&claims.product), "Test");
}

/// Attacker's move, with a leaked VCEK private key: sign a report that
/// names a VLEK as its signer, so that its chip ID is not held to the
/// VCEK's and the line's VLEK CRL is consulted in place of its CRL (a
/// revoked ASK would then go unnoticed); or the other way round. No
/// firmware writes either, so both are refused, though validly signed.
#[test]
fn a_report_naming_the_other_kind_of_key_is_refused() {
    let vcek = TestAmd::new().unwrap();
    assert_eq!(verify(&vcek, None).unwrap().signing_key, SigningKey::Vcek);
    match verify(&vcek, Some(1)) {
        Err(SnpError::SigningKeyIssuer {
            signing_key: SigningKey::Vlek,
            issuer,
        }) => assert_eq!(issuer, "SEV-Test"),
        other => panic!("{other:?}"),
    }
    let vlek = TestAmd::vlek().unwrap();
    match verify(&vlek, Some(0)) {
        Err(SnpError::SigningKeyIssuer {
            signing_key: SigningKey::Vcek,
            issuer,
        }) => assert_eq!(issuer, "SEV-VLEK-Test"),
        other => panic!("{other:?}"),
    }
}

/// Attacker's move: keep using a chain AMD let lapse (an ASVK or ARK past
/// its end, or one not valid yet against a clock set back). The pinned
/// ones run to 2045-2048; each link is held to its dates all the same, the
/// ARK's and the ASK's as the endorsement key's.
#[test]
fn a_root_outside_its_validity_is_refused() {
    let day = time::Duration::days(1);
    let today = time::OffsetDateTime::now_utc();
    let lapsed = (today - 30 * day, today - day);
    let future = (today + day, today + 30 * day);
    for (vlek, validity, lapsed_name) in [
        (
            true,
            RootValidity {
                ask: Some(lapsed),
                ..RootValidity::default()
            },
            "SEV-VLEK-Test",
        ),
        (
            false,
            RootValidity {
                ark: Some(future),
                ..RootValidity::default()
            },
            "ARK-Test",
        ),
    ] {
        let amd = TestAmd::with_root_validity(vlek, validity).unwrap();
        let err = verify(&amd, None).unwrap_err();
        assert!(
            matches!(&err, SnpError::RootTime { name, .. } if name == lapsed_name),
            "{err:?}"
        );
    }
    // The same chain within its dates verifies.
    let amd = TestAmd::with_root_validity(
        false,
        RootValidity {
            ark: Some((today - day, today + day)),
            ask: Some((today - day, today + day)),
        },
    )
    .unwrap();
    verify(&amd, None).unwrap();
}
