//! The TDX checks against a generated Intel-like PKI (testkit's
//! `TestIntel`): a quote and collateral made here verify under the
//! generated root exactly as Intel's do under Intel's, and each property
//! the verifier enforces is refused by its own check when broken: another
//! root, a revoked PCK, a TCB level that is not up to date, a debuggable
//! TD, another MRTD or RTMR, collateral outside its window, a tampered QE
//! report or TD report.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_testkit::intel::{
    CollateralOptions, TdFields, TdxCollateral, TestIntel, TD_ATTRIBUTES, TD_DEBUG,
};
use keel_verifier::clock::now;
use keel_verifier::cpu::collateral::tdx_collateral_file;
use keel_verifier::cpu::policy::{Hex, TdxPolicy};
use keel_verifier::cpu::tdx::{self, IntelRoot, TdxClaims, TdxError};
use keel_verifier::cpu::{Collateral, CpuPolicy, CpuTrust};

const MRTD: [u8; 48] = [0x3d; 48];
const RTMR: [[u8; 48]; 4] = [[0x10; 48], [0x11; 48], [0x12; 48], [0u8; 48]];

fn fields() -> TdFields {
    TdFields {
        td_attributes: TD_ATTRIBUTES,
        mrtd: MRTD,
        rtmr: RTMR,
        report_data: [0xab; 64],
    }
}

fn policy() -> TdxPolicy {
    TdxPolicy {
        rtmr: RTMR.map(|r| Some(Hex(r))),
        ..TdxPolicy::new(Hex(MRTD))
    }
}

/// Writes `collateral` into a cache directory and reads it back as the
/// verifier does, so the file form is part of what is tested.
fn cached(intel: &TestIntel, collateral: &TdxCollateral) -> dcap_qvl::QuoteCollateralV3 {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{}.json", intel.fmspc_hex()));
    std::fs::write(&path, collateral.to_json()).unwrap();
    tdx_collateral_file(&path).unwrap()
}

fn verify_with(
    intel: &TestIntel,
    quote: &[u8],
    collateral: &TdxCollateral,
    policy: &TdxPolicy,
    now: u64,
) -> Result<TdxClaims, TdxError> {
    let root = IntelRoot::from_der(intel.root_der().to_vec());
    tdx::verify(quote, &cached(intel, collateral), &root, policy, now)
}

fn check(err: &TdxError) -> &'static str {
    match err {
        TdxError::Verification { check, .. } => check,
        other => panic!("not a DCAP verification error: {other}"),
    }
}

#[test]
fn a_generated_quote_verifies_under_its_root_and_no_other() {
    let intel = TestIntel::new().unwrap();
    let quote = intel.quote(&fields()).unwrap();
    let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
    let claims = verify_with(&intel, &quote, &collateral, &policy(), now()).unwrap();
    assert_eq!(claims.status, "UpToDate");
    assert_eq!(claims.mrtd, MRTD);
    assert_eq!(claims.rtmr, RTMR);
    assert_eq!(claims.report_data, [0xab; 64]);
    assert_eq!(claims.tee_tcb_svn, intel.platform().tee_tcb_svn);

    // Intel's pinned root refuses the generated chain.
    let err = tdx::verify(
        &quote,
        &cached(&intel, &collateral),
        &IntelRoot::pinned(),
        &policy(),
        now(),
    )
    .unwrap_err();
    assert_eq!(check(&err), "signature", "{err}");

    // So does another generated root, with its own collateral.
    let other = TestIntel::new().unwrap();
    let theirs = other.collateral(&CollateralOptions::default()).unwrap();
    let err = verify_with(&other, &quote, &theirs, &policy(), now()).unwrap_err();
    assert_eq!(check(&err), "signature", "{err}");

    // The cache names the file by the FMSPC of the quote's PCK certificate
    // and the CA that issued it. A cache filled before the names carried
    // the CA holds `tdx/<FMSPC>.json`: read only where the CA's own file
    // is missing.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tdx")).unwrap();
    let write = |name: String, collateral: &TdxCollateral| {
        std::fs::write(dir.path().join("tdx").join(name), collateral.to_json()).unwrap()
    };
    write(format!("{}.json", intel.fmspc_hex()), &collateral);
    let read = Collateral::at(dir.path()).tdx_collateral(&quote).unwrap();
    assert_eq!(read.tcb_info, collateral.tcb_info);
    let own = intel
        .collateral(&CollateralOptions {
            platform_status: "OutOfDate".into(),
            ..CollateralOptions::default()
        })
        .unwrap();
    write(format!("{}-platform.json", intel.fmspc_hex()), &own);
    let read = Collateral::at(dir.path()).tdx_collateral(&quote).unwrap();
    assert_eq!(read.tcb_info, own.tcb_info);
    assert_ne!(read.tcb_info, collateral.tcb_info);
    // With neither, the error names the CA's own file.
    let empty = tempfile::tempdir().unwrap();
    let err = Collateral::at(empty.path())
        .tdx_collateral(&quote)
        .unwrap_err();
    let expected = format!("tdx/{}-platform.json", intel.fmspc_hex());
    assert!(err.to_string().contains(&expected), "{err}");
}

#[test]
fn a_revoked_pck_certificate_is_refused() {
    let intel = TestIntel::new().unwrap();
    let quote = intel.quote(&fields()).unwrap();
    let collateral = intel
        .collateral(&CollateralOptions {
            revoke_pck: true,
            ..CollateralOptions::default()
        })
        .unwrap();
    let err = verify_with(&intel, &quote, &collateral, &policy(), now()).unwrap_err();
    assert_eq!(check(&err), "revocation", "{err}");
}

#[test]
fn an_out_of_date_tcb_is_refused_unless_allowed_by_name() {
    let intel = TestIntel::new().unwrap();
    let quote = intel.quote(&fields()).unwrap();
    let collateral = intel
        .collateral(&CollateralOptions {
            platform_status: "OutOfDate".into(),
            advisories: vec!["INTEL-SA-01234".into()],
            ..CollateralOptions::default()
        })
        .unwrap();
    let err = verify_with(&intel, &quote, &collateral, &policy(), now()).unwrap_err();
    match &err {
        TdxError::TcbStatus {
            actual, advisories, ..
        } => {
            assert_eq!(actual, "OutOfDate");
            assert_eq!(advisories, &["INTEL-SA-01234"]);
        }
        other => panic!("{other}"),
    }

    let mut allowing = policy();
    allowing.allow_tcb_status = vec!["OutOfDate".into()];
    let claims = verify_with(&intel, &quote, &collateral, &allowing, now()).unwrap();
    assert_eq!(claims.status, "OutOfDate");

    // Allowing another status does not admit this one.
    allowing.allow_tcb_status = vec!["SWHardeningNeeded".into()];
    let err = verify_with(&intel, &quote, &collateral, &allowing, now()).unwrap_err();
    assert!(matches!(err, TdxError::TcbStatus { .. }), "{err}");
}

#[test]
fn a_debuggable_td_is_refused() {
    let intel = TestIntel::new().unwrap();
    let quote = intel
        .quote(&TdFields {
            td_attributes: TD_ATTRIBUTES | TD_DEBUG,
            ..fields()
        })
        .unwrap();
    let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
    let err = verify_with(&intel, &quote, &collateral, &policy(), now()).unwrap_err();
    assert_eq!(check(&err), "TD attributes", "{err}");
}

#[test]
fn another_mrtd_or_rtmr_is_refused_naming_the_register() {
    let intel = TestIntel::new().unwrap();
    let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
    let quote = intel
        .quote(&TdFields {
            mrtd: [0x3e; 48],
            ..fields()
        })
        .unwrap();
    let err = verify_with(&intel, &quote, &collateral, &policy(), now()).unwrap_err();
    assert!(
        matches!(&err, TdxError::Mrtd { expected, actual }
            if *expected == hex::encode(MRTD) && *actual == hex::encode([0x3e; 48])),
        "{err}"
    );

    let mut rtmr = RTMR;
    rtmr[2][0] ^= 1;
    let quote = intel.quote(&TdFields { rtmr, ..fields() }).unwrap();
    let err = verify_with(&intel, &quote, &collateral, &policy(), now()).unwrap_err();
    assert!(matches!(err, TdxError::Rtmr { index: 2, .. }), "{err}");
}

#[test]
fn collateral_outside_its_window_is_refused() {
    let intel = TestIntel::new().unwrap();
    let quote = intel.quote(&fields()).unwrap();
    let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
    for at in [now() - 2 * 3600, now() + 31 * 86_400] {
        let err = verify_with(&intel, &quote, &collateral, &policy(), at).unwrap_err();
        assert_eq!(check(&err), "collateral time", "{at}: {err}");
        assert!(err.rests_on_the_clock(), "{at}: {err}");
    }
    let then = tdx::collateral_time(&cached(&intel, &collateral)).unwrap();
    assert!(then <= now() && then + 2 * 86_400 > now(), "{then}");
}

/// DCAP stops at a date before it checks the rest: a quote refused for a
/// date at the verifier's time is judged again at the collateral's, and
/// any other refusal then is the one reported, never one of the clock.
#[test]
fn a_refusal_for_a_date_rests_on_the_clock_only_when_the_rest_passes_at_the_collaterals_time() {
    let intel = TestIntel::new().unwrap();
    let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
    let revoked = intel
        .collateral(&CollateralOptions {
            revoke_pck: true,
            ..CollateralOptions::default()
        })
        .unwrap();
    let debug = intel
        .quote(&TdFields {
            td_attributes: TD_ATTRIBUTES | TD_DEBUG,
            ..fields()
        })
        .unwrap();
    let other_mrtd = intel
        .quote(&TdFields {
            mrtd: [0x3e; 48],
            ..fields()
        })
        .unwrap();
    let genuine = intel.quote(&fields()).unwrap();
    // Report data flipped: the QE's signature no longer covers the report.
    let mut other_signature = genuine.clone();
    other_signature[600] ^= 1;
    for at in [now() - 2 * 3600, now() + 31 * 86_400] {
        let err = verify_with(&intel, &debug, &collateral, &policy(), at).unwrap_err();
        assert_eq!(check(&err), "TD attributes", "{at}: {err}");
        let err = verify_with(&intel, &other_mrtd, &collateral, &policy(), at).unwrap_err();
        assert!(matches!(err, TdxError::Mrtd { .. }), "{at}: {err}");
        let err = verify_with(&intel, &genuine, &revoked, &policy(), at).unwrap_err();
        assert_eq!(check(&err), "revocation", "{at}: {err}");
        let err = verify_with(&intel, &other_signature, &collateral, &policy(), at).unwrap_err();
        assert!(!err.rests_on_the_clock(), "{at}: {err}");
    }
}

/// A platform certified after its collateral was fetched: its PCK
/// certificates start after the collateral's issue date. A control plane
/// whose clock its host moved past the collateral's next update still
/// finds a time when both were valid, and the refusal rests on the clock;
/// where there is none (collateral that ended before the platform was
/// certified), the refusal is not the clock's.
#[test]
fn a_platform_certified_after_its_collateral_was_fetched_is_judged_when_both_were_valid() {
    use time::{Duration, OffsetDateTime};
    let intel = TestIntel::new().unwrap();
    let quote = intel.quote(&fields()).unwrap();
    let at = OffsetDateTime::now_utc();
    let earlier = intel
        .collateral(&CollateralOptions {
            issued: at - Duration::days(10),
            next_update: at + Duration::days(20),
            ..CollateralOptions::default()
        })
        .unwrap();
    let later = u64::try_from((at + Duration::days(25)).unix_timestamp()).unwrap();
    let err = verify_with(&intel, &quote, &earlier, &policy(), later).unwrap_err();
    assert_eq!(check(&err), "collateral time", "{err}");
    assert!(err.rests_on_the_clock(), "{err}");

    let ended = intel
        .collateral(&CollateralOptions {
            issued: at - Duration::days(10),
            next_update: at - Duration::days(5),
            ..CollateralOptions::default()
        })
        .unwrap();
    let err = verify_with(&intel, &quote, &ended, &policy(), now()).unwrap_err();
    assert!(!err.rests_on_the_clock(), "{err}");
}

#[test]
fn tampered_reports_and_signatures_are_refused() {
    let intel = TestIntel::new().unwrap();
    let quote = intel.quote(&fields()).unwrap();
    let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
    // TD report (mrtd, report_data), the attestation key, the QE report.
    for (what, at) in [
        ("mrtd", 184),
        ("report_data", 600),
        ("AK", 700),
        ("QE report", 800),
    ] {
        let mut tampered = quote.clone();
        tampered[at] ^= 1;
        let err = verify_with(&intel, &tampered, &collateral, &policy(), now())
            .expect_err(&format!("{what} flipped was accepted"));
        assert!(
            matches!(err, TdxError::Verification { .. }),
            "{what}: {err}"
        );
    }
    // A TCB info whose signature no longer matches.
    let mut forged = collateral.clone();
    forged.tcb_info = forged.tcb_info.replace("OutOfDate", "UpToDate");
    let err = verify_with(&intel, &quote, &forged, &policy(), now()).unwrap_err();
    assert_eq!(check(&err), "signature", "{err}");
}

#[test]
fn the_cpu_trust_uses_the_configured_root_and_cache() {
    let intel = TestIntel::new().unwrap();
    let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tdx")).unwrap();
    std::fs::write(
        dir.path()
            .join("tdx")
            .join(format!("{}.json", intel.fmspc_hex())),
        collateral.to_json(),
    )
    .unwrap();
    let ak = b"ak public area";
    let nonce = b"nonce";
    let quote = intel
        .quote(&TdFields {
            report_data: keel_verifier::cpu::binding::report_data(nonce, ak),
            ..fields()
        })
        .unwrap();
    let evidence = keel_verifier::cpu::Evidence {
        binding: keel_verifier::cpu::Binding::Guest,
        report: quote,
        certificate: Vec::new(),
    };
    let trust = CpuTrust::new(CpuPolicy::Tdx(policy()), Collateral::at(dir.path()))
        .with_tdx_root(IntelRoot::from_der(intel.root_der().to_vec()));
    assert!(trust.verify(Some(&evidence), ak, nonce, now()).is_ok());
    // The same trust with the pinned root refuses it.
    let pinned = CpuTrust::new(CpuPolicy::Tdx(policy()), Collateral::at(dir.path()));
    assert!(pinned.verify(Some(&evidence), ak, nonce, now()).is_err());
}
