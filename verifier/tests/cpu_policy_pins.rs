//! The policy's optional pins and per-line minimums, on the real SEV-SNP
//! reports and TDX quotes (`../shared/data/cvm`) where they carry the
//! field, and on generated reports (`keel_testkit::amd`) where none does:
//! each check passes with its pin absent, passes with the right pin, and
//! refuses a wrong one with its own error naming the field.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod vectors;

use std::collections::{BTreeMap, BTreeSet};

use keel_testkit::amd::{LaunchFields, ReportFields, TestAmd};
use keel_verifier::clock::now;
use keel_verifier::config::NodeConfig;
use keel_verifier::cpu::collateral::tdx_collateral_file;
use keel_verifier::cpu::policy::{
    AttestationConfig, Hex, LineTcb, PlatformFeature, ProductLine, SnpPolicy, Tcb, TdxPolicy,
    Variant, MAX_ALSO_MEASUREMENTS,
};
use keel_verifier::cpu::snp::{self, AmdRoots, SnpClaims, SnpError};
use keel_verifier::cpu::tdx::{self, IntelRoot, TdxClaims, TdxError};
use keel_verifier::cpu::{Binding, CpuPolicy};
use vectors::{data, data_path, h, tcb};

/// 2025-11-23T00:00:00Z: every real SNP endorsement certificate is valid.
const SNP_TIME: u64 = 1_763_856_000;

fn first_pem(path: &str) -> Vec<u8> {
    x509_parser::pem::Pem::iter_from_buffer(&data(path))
        .next()
        .unwrap()
        .unwrap()
        .contents
}

// ------------------------------------------------------- real SNP reports

/// A real report (the SNP report itself, out of an HCL report where it
/// came in one) with its endorsement key and the policy it meets exactly.
struct Real {
    report: Vec<u8>,
    vek: Vec<u8>,
    policy: SnpPolicy,
}

fn real(binding: Binding, report: &str, vek: Vec<u8>, tcb: Tcb, measurement: &str) -> Real {
    let whole = data(report);
    Real {
        report: binding.snp_report(&whole).unwrap().to_vec(),
        vek,
        policy: SnpPolicy::new(tcb, Hex(h(measurement))),
    }
}

/// Milan, no ID block, guest policy 0x30000 (SMT allowed), platform_info
/// 0x1 (SMT enabled).
fn milan_virtee() -> Real {
    real(
        Binding::Guest,
        "snp/milan-virtee/report_milan.bin",
        data("snp/milan-virtee/vcek_milan.der"),
        tcb(3, 0, 8, 115),
        "7a1e5c266c0108dbc9bb94fa926951320940915d0aafb42464bd88b579ea158d3e1a0dc39b2c60bd95b9c480cd81841f",
    )
}

/// Milan under Azure's paravisor: an ID block (guest SVN 5), policy 0x3001f.
fn azure_milan() -> Real {
    real(
        Binding::AzureHcl,
        "snp/azure-milan-hcl/hcl-report.bin",
        first_pem("snp/azure-milan-hcl/vcek-chain.pem"),
        tcb(3, 0, 8, 115),
        "9ac48fcac8a2d88aeeff8d427ad4f2be0e3917c748a18bdf52cc317e7fe20308b459d5ef1a12e0c22944eb386d17c315",
    )
}

/// Genoa under Azure's paravisor: an ID block (guest SVN 65547),
/// platform_info 0x24 (ECC, alias check complete).
fn azure_genoa() -> Real {
    real(
        Binding::AzureHcl,
        "snp/azure-genoa-hcl/hcl-report.bin",
        first_pem("snp/azure-genoa-hcl/vcek-genoa.pem"),
        tcb(10, 0, 23, 84),
        "f57dc09a507c6ecd82369bffb600f0003792f4d99bc26e985ec0c266fc34faf3706faf814c9e61065768a6ff917c89ae",
    )
}

/// AWS, VLEK-signed (`SEV-VLEK-Milan`) at VMPL 1, platform_info 0x27 (SMT,
/// TSME, ECC, alias check complete).
fn aws_vlek() -> Real {
    let mut v = real(
        Binding::Guest,
        "snp/aws-milan-vlek/test-vlek-report.bin",
        data("snp/aws-milan-vlek/test-vlek.der"),
        tcb(4, 0, 24, 217),
        "8922ebbdd00ec2c541f36a6e7a82a8773a7accb451ed67bc94e740dbe92c93c4e8c9af857f5ceeb5a493df2a570d7bf0",
    );
    v.policy.vmpl = 1;
    v
}

const AZURE_MILAN_ID_KEY: &str = "0356215882a825279a85b300b0b742931d113bf7e32dde2e50ffde7ec743ca491ecdd7f336dc28a6e0b2bb57af7a44a3";

/// The whole verification of `v` (pinned AMD roots) under `policy`.
fn verify(v: &Real, policy: &SnpPolicy) -> Result<SnpClaims, SnpError> {
    let parsed = snp::parse(&v.report)?;
    snp::verify(
        &v.report,
        &parsed,
        &v.vek,
        &AmdRoots::pinned(),
        policy,
        SNP_TIME,
    )
}

/// The report's guest SVN must reach `minimum_guest_svn`: Azure's Milan
/// guest has SVN 5, its Genoa guest 65547.
#[test]
fn the_guest_svn_minimum_is_checked() {
    for (v, svn) in [(azure_milan(), 5), (azure_genoa(), 65547)] {
        assert_eq!(verify(&v, &v.policy).unwrap().guest_svn, svn);
        let at_least = |minimum| SnpPolicy {
            minimum_guest_svn: minimum,
            ..v.policy.clone()
        };
        verify(&v, &at_least(svn)).unwrap();
        let err = verify(&v, &at_least(svn + 1)).unwrap_err();
        assert!(
            matches!(err, SnpError::GuestSvnBelowMinimum { minimum, actual }
                if minimum == svn + 1 && actual == svn),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!("SNP guest_svn: expected at least {}, actual {svn}", svn + 1)
        );
    }
}

/// The ID key digest: Azure's guest was launched with an ID block signed
/// by the key whose digest is pinned here; another digest, or a guest
/// launched without an ID block (zeros), is refused naming both values.
#[test]
fn the_id_key_digest_is_pinned() {
    let v = azure_milan();
    let claims = verify(&v, &v.policy).unwrap();
    assert_eq!(hex::encode(claims.id_key_digest), AZURE_MILAN_ID_KEY);
    let pinned = |digest: [u8; 48]| SnpPolicy {
        id_key_digest: Some(Hex(digest)),
        ..v.policy.clone()
    };
    verify(&v, &pinned(h(AZURE_MILAN_ID_KEY))).unwrap();
    for at in [0, 47] {
        let mut other = h::<48>(AZURE_MILAN_ID_KEY);
        other[at] ^= 1;
        let err = verify(&v, &pinned(other)).unwrap_err();
        assert!(
            matches!(&err, SnpError::IdKeyDigest { expected, actual }
                if *expected == hex::encode(other) && actual == AZURE_MILAN_ID_KEY),
            "byte {at}: {err:?}"
        );
        assert!(err.to_string().starts_with("SNP id_key_digest: expected"));
    }
    // No ID block at all: the report's digest is zeros.
    let plain = milan_virtee();
    let err = verify(
        &plain,
        &SnpPolicy {
            id_key_digest: Some(Hex(h(AZURE_MILAN_ID_KEY))),
            ..plain.policy.clone()
        },
    )
    .unwrap_err();
    assert!(
        matches!(&err, SnpError::IdKeyDigest { actual, .. } if *actual == "00".repeat(48)),
        "{err:?}"
    );
}

/// `require_platform` names the features `platform_info` must show:
/// Genoa's 0x24 has ECC and a completed alias check, AWS's 0x27 TSME as
/// well, Milan's 0x1 none of them.
#[test]
fn platform_features_are_required_by_name() {
    let requiring = |v: &Real, features: &[PlatformFeature]| SnpPolicy {
        require_platform: features.iter().copied().collect(),
        ..v.policy.clone()
    };
    use PlatformFeature::{AliasCheckComplete, CiphertextHiding, Ecc, RaplDisabled, Tsme};
    let genoa = azure_genoa();
    assert_eq!(verify(&genoa, &genoa.policy).unwrap().platform_info, 0x24);
    verify(&genoa, &requiring(&genoa, &[Ecc, AliasCheckComplete])).unwrap();
    let aws = aws_vlek();
    verify(&aws, &requiring(&aws, &[Tsme, Ecc, AliasCheckComplete])).unwrap();
    let milan = milan_virtee();
    for (v, features, missing, platform_info) in [
        (&genoa, &[Ecc, RaplDisabled][..], "rapl-disabled", 0x24),
        (&genoa, &[Tsme][..], "tsme", 0x24),
        (&aws, &[CiphertextHiding][..], "ciphertext-hiding", 0x27),
        (
            &milan,
            &[AliasCheckComplete][..],
            "alias-check-complete",
            0x1,
        ),
    ] {
        let err = verify(v, &requiring(v, features)).unwrap_err();
        assert!(
            matches!(err, SnpError::PlatformFeature { feature, platform_info: p }
                if feature == missing && p == platform_info),
            "{missing}: {err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "SNP platform_info.{missing}: expected 1, actual 0 (platform_info {platform_info:#x})"
            )
        );
    }
}

/// Every real guest's policy allows SMT (bit 16): accepted by default,
/// refused where the config does not allow it.
#[test]
fn a_real_guest_that_allows_smt_is_refused_where_smt_is_not_allowed() {
    for v in [milan_virtee(), azure_milan(), azure_genoa(), aws_vlek()] {
        let claims = verify(&v, &v.policy).unwrap();
        let err = verify(
            &v,
            &SnpPolicy {
                allow_smt: false,
                ..v.policy.clone()
            },
        )
        .unwrap_err();
        assert!(
            matches!(err, SnpError::SmtAllowed { policy } if policy == claims.policy),
            "{err:?}"
        );
        assert!(err.to_string().starts_with("SNP policy.smt: expected 0"));
        // Nor does any restrict the guest to one socket.
        let err = verify(
            &v,
            &SnpPolicy {
                require_single_socket: true,
                ..v.policy.clone()
            },
        )
        .unwrap_err();
        assert!(
            matches!(err, SnpError::SingleSocket { policy } if policy == claims.policy),
            "{err:?}"
        );
    }
}

/// Per-line minimums on real reports. A cluster of Milan and Genoa hosts
/// cannot state one minimum for both: Genoa's current microcode SVN (84)
/// is below Milan's (115). Genoa's own entry replaces the global minimum
/// for Genoa reports; once minimums are given by line, a report of a line
/// without an entry is refused.
#[test]
fn a_lines_entry_replaces_the_global_minimum_and_a_line_left_out_is_refused() {
    let genoa = azure_genoa();
    let milan = milan_virtee();
    // The global minimum alone, Milan's numbers: Genoa's report is refused.
    let global_only = SnpPolicy {
        minimum_tcb: tcb(3, 0, 8, 115),
        ..genoa.policy.clone()
    };
    let err = verify(&genoa, &global_only).unwrap_err();
    assert!(
        matches!(&err, SnpError::TcbBelowMinimum {
            line, setting: "minimum_tcb", component: "microcode", minimum: 115, actual: 84
        } if line == "Genoa"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "SNP Genoa reported_tcb.microcode: expected at least 115 (minimum_tcb), actual 84"
    );
    // Genoa's entry: its own numbers, met exactly.
    let by_line = |entry: LineTcb| SnpPolicy {
        minimum_tcb_by_line: BTreeMap::from([(ProductLine::Genoa, entry)]),
        ..global_only.clone()
    };
    verify(&genoa, &by_line(tcb(10, 0, 23, 84).into())).unwrap();
    // One component above the report: refused, naming line and setting.
    let err = verify(&genoa, &by_line(tcb(10, 0, 24, 84).into())).unwrap_err();
    assert!(
        matches!(&err, SnpError::TcbBelowMinimum {
            line, setting: "minimum_tcb_by_line", component: "snp", minimum: 24, actual: 23
        } if line == "Genoa"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "SNP Genoa reported_tcb.snp: expected at least 24 (minimum_tcb_by_line), actual 23"
    );
    // A Milan report under minimums by line that give none for Milan is
    // refused, whatever the global minimum: once an operator lists lines,
    // a line left out is not held to a global that may be set low.
    let milan_policy = |global: Tcb| SnpPolicy {
        minimum_tcb: global,
        minimum_tcb_by_line: BTreeMap::from([(ProductLine::Genoa, LineTcb::default())]),
        ..milan.policy.clone()
    };
    let err = verify(&milan, &milan_policy(tcb(0, 0, 0, 0))).unwrap_err();
    assert!(
        matches!(&err, SnpError::NoLineMinimum { line } if line == "Milan"),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("no entry for this product line"),
        "{err}"
    );
    // Without minimums by line, the global one holds Milan's report.
    let global = |minimum: Tcb| SnpPolicy {
        minimum_tcb_by_line: BTreeMap::new(),
        ..milan_policy(minimum)
    };
    verify(&milan, &global(tcb(3, 0, 8, 115))).unwrap();
    let err = verify(&milan, &global(tcb(3, 0, 8, 116))).unwrap_err();
    assert!(
        matches!(&err, SnpError::TcbBelowMinimum {
            line, setting: "minimum_tcb", component: "microcode", minimum: 116, actual: 115
        } if line == "Milan"),
        "{err:?}"
    );
}

/// A VLEK's chain (`SEV-VLEK-Milan`) is Milan's line: Milan's entry holds
/// AWS's report, and the launch TCB too (launched at microcode 219).
#[test]
fn a_vlek_report_takes_its_lines_entry() {
    let aws = aws_vlek();
    let milan_entry = |entry: LineTcb| SnpPolicy {
        minimum_tcb: tcb(10, 0, 30, 250),
        minimum_tcb_by_line: BTreeMap::from([(ProductLine::Milan, entry)]),
        ..aws.policy.clone()
    };
    verify(&aws, &milan_entry(tcb(4, 0, 24, 217).into())).unwrap();
    let err = verify(&aws, &milan_entry(tcb(4, 0, 24, 218).into())).unwrap_err();
    assert!(
        matches!(&err, SnpError::TcbBelowMinimum {
            line, setting: "minimum_tcb_by_line", component: "microcode", minimum: 218, actual: 217
        } if line == "Milan"),
        "{err:?}"
    );
    // The launch TCB is held to the same entry.
    let mut claims = verify(&aws, &milan_entry(tcb(4, 0, 24, 217).into())).unwrap();
    claims.launch_tcb.snp = 23;
    let err = claims
        .check(&milan_entry(tcb(4, 0, 24, 217).into()))
        .unwrap_err();
    assert!(
        matches!(&err, SnpError::LaunchTcbBelowMinimum {
            line, setting: "minimum_tcb_by_line", component: "snp", minimum: 24, actual: 23
        } if line == "Milan"),
        "{err:?}"
    );
}

/// Nodes of one cluster can measure differently (the launch measurement
/// covers one VMSA page per vCPU and the vCPU model): two Milan reports of
/// the same TCB (3/0/8/115) with different measurements are both accepted
/// by one policy that names one as `measurement` and the other in
/// `also_measurements`; a policy naming neither refuses each, naming the
/// report's value and how many were accepted.
#[test]
fn a_policy_accepts_each_listed_launch_measurement() {
    let milan = milan_virtee();
    let azure = azure_milan();
    assert_eq!(milan.policy.minimum_tcb, azure.policy.minimum_tcb);
    assert_ne!(milan.policy.measurement, azure.policy.measurement);
    let both = SnpPolicy {
        also_measurements: BTreeSet::from([azure.policy.measurement]),
        ..milan.policy.clone()
    };
    for v in [&milan, &azure] {
        let claims = verify(v, &both).unwrap();
        assert_eq!(Hex(claims.measurement), v.policy.measurement);
    }
    // The main measurement alone takes only its own report.
    verify(&milan, &milan.policy).unwrap();
    let err = verify(&azure, &milan.policy).unwrap_err();
    assert!(matches!(err, SnpError::Measurement { .. }), "{err:?}");

    let neither = SnpPolicy {
        also_measurements: BTreeSet::from([Hex([0x22; 48]), Hex([0x33; 48])]),
        ..SnpPolicy::new(milan.policy.minimum_tcb, Hex([0x11; 48]))
    };
    for v in [&milan, &azure] {
        let actual = hex::encode(v.policy.measurement.0);
        let err = verify(v, &neither).unwrap_err();
        assert!(
            matches!(&err, SnpError::Measurement { actual: a, .. } if *a == actual),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "SNP measurement: expected one of 3 accepted (measurement {} and 2 in \
                 also_measurements), actual {actual}",
                "11".repeat(48)
            )
        );
    }
}

// -------------------------------------------------- generated SNP reports

const MEASUREMENT: [u8; 48] = [7; 48];

/// A report of `amd`'s chip with guest policy `policy` and `launch`.
fn generated(amd: &TestAmd, policy: u64, launch: &LaunchFields) -> Vec<u8> {
    let fields = ReportFields {
        policy,
        ..ReportFields::guest([5; 64], MEASUREMENT)
    };
    amd.report_launched(&fields, launch).unwrap()
}

fn verify_generated(amd: &TestAmd, raw: &[u8], policy: &SnpPolicy) -> Result<SnpClaims, SnpError> {
    let roots = AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()]);
    snp::verify(
        raw,
        &snp::parse(raw)?,
        amd.vcek_der(),
        &roots,
        policy,
        now(),
    )
}

fn generated_policy(amd: &TestAmd) -> SnpPolicy {
    SnpPolicy::new(Tcb::from(amd.tcb()), Hex(MEASUREMENT))
}

/// Guest policy bits: no SMT (bit 16 clear), one socket (bit 20).
const NO_SMT: u64 = 0x20000;
const SINGLE_SOCKET: u64 = 1 << 20;

/// `allow_smt: false` takes a guest whose policy forbids SMT on a platform
/// that reports it disabled, and refuses the platform's own word that SMT
/// is on (the firmware would not have launched such a guest there; the
/// verifier does not take that on trust).
#[test]
fn smt_is_checked_in_the_guest_policy_and_the_platform() {
    let amd = TestAmd::for_line("Milan").unwrap();
    let no_smt = SnpPolicy {
        allow_smt: false,
        ..generated_policy(&amd)
    };
    let off = generated(&amd, NO_SMT, &LaunchFields::default());
    verify_generated(&amd, &off, &generated_policy(&amd)).unwrap();
    verify_generated(&amd, &off, &no_smt).unwrap();
    let platform_smt = LaunchFields {
        platform_info: 0x1,
        ..LaunchFields::default()
    };
    let on = generated(&amd, NO_SMT, &platform_smt);
    verify_generated(&amd, &on, &generated_policy(&amd)).unwrap();
    let err = verify_generated(&amd, &on, &no_smt).unwrap_err();
    assert!(
        matches!(err, SnpError::PlatformSmt { platform_info: 0x1 }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "SNP platform_info.smt_en: expected 0 (allow_smt is false), actual 1 (platform_info 0x1)"
    );
    // A guest policy that allows SMT is refused before the platform.
    let allowing = generated(&amd, NO_SMT | 1 << 16, &LaunchFields::default());
    let err = verify_generated(&amd, &allowing, &no_smt).unwrap_err();
    assert!(
        matches!(err, SnpError::SmtAllowed { policy: 0x30000 }),
        "{err:?}"
    );
}

#[test]
fn a_single_socket_guest_policy_is_required_where_configured() {
    let amd = TestAmd::new().unwrap();
    let required = SnpPolicy {
        require_single_socket: true,
        ..generated_policy(&amd)
    };
    let one = generated(&amd, 0x30000 | SINGLE_SOCKET, &LaunchFields::default());
    verify_generated(&amd, &one, &generated_policy(&amd)).unwrap();
    verify_generated(&amd, &one, &required).unwrap();
    let any = generated(&amd, 0x30000, &LaunchFields::default());
    verify_generated(&amd, &any, &generated_policy(&amd)).unwrap();
    let err = verify_generated(&amd, &any, &required).unwrap_err();
    assert!(
        matches!(err, SnpError::SingleSocket { policy: 0x30000 }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "SNP policy.single_socket: expected 1, actual 0 (policy 0x30000)"
    );
}

/// Each feature is read from its own `platform_info` bit (SEV-SNP ABI):
/// a platform reporting that bit alone meets it and no other.
#[test]
fn each_platform_feature_reads_its_own_bit() {
    use PlatformFeature::{AliasCheckComplete, CiphertextHiding, Ecc, RaplDisabled, Tsme};
    let features = [
        (Tsme, 1),
        (Ecc, 2),
        (RaplDisabled, 3),
        (CiphertextHiding, 4),
        (AliasCheckComplete, 5),
    ];
    let amd = TestAmd::new().unwrap();
    let requiring = |feature: PlatformFeature| SnpPolicy {
        require_platform: BTreeSet::from([feature]),
        ..generated_policy(&amd)
    };
    for (feature, bit) in features {
        let platform_info = 1u64 << bit;
        let raw = generated(
            &amd,
            0x30000,
            &LaunchFields {
                platform_info,
                ..LaunchFields::default()
            },
        );
        verify_generated(&amd, &raw, &requiring(feature)).unwrap();
        for (other, _) in features.iter().filter(|(f, _)| *f != feature) {
            let err = verify_generated(&amd, &raw, &requiring(*other)).unwrap_err();
            assert!(
                matches!(err, SnpError::PlatformFeature { feature: f, platform_info: p }
                    if f == other.as_str() && p == platform_info),
                "{feature:?} reported, {other:?} required: {err:?}"
            );
        }
    }
}

/// The author key digest (no real report has one): it counts only with
/// `AUTHOR_KEY_EN`; a report without an author key is refused as `none`.
#[test]
fn the_author_key_digest_is_pinned() {
    let amd = TestAmd::new().unwrap();
    let author = [9u8; 48];
    let with_author = generated(
        &amd,
        0x30000,
        &LaunchFields {
            id_key_digest: [8; 48],
            author_key_digest: Some(author),
            ..LaunchFields::default()
        },
    );
    let pinned = |digest: [u8; 48]| SnpPolicy {
        author_key_digest: Some(Hex(digest)),
        ..generated_policy(&amd)
    };
    let claims = verify_generated(&amd, &with_author, &generated_policy(&amd)).unwrap();
    assert_eq!(claims.author_key_digest, Some(author));
    verify_generated(&amd, &with_author, &pinned(author)).unwrap();
    let mut other = author;
    other[47] ^= 1;
    let err = verify_generated(&amd, &with_author, &pinned(other)).unwrap_err();
    assert!(
        matches!(&err, SnpError::AuthorKeyDigest { expected, actual }
            if *expected == hex::encode(other) && *actual == hex::encode(author)),
        "{err:?}"
    );
    // No author key (AUTHOR_KEY_EN 0): refused whatever the pin.
    let without = generated(&amd, 0x30000, &LaunchFields::default());
    let err = verify_generated(&amd, &without, &pinned(author)).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "SNP author_key_digest: expected {}, actual none (AUTHOR_KEY_EN is 0)",
            hex::encode(author)
        )
    );
    // The real Azure report has an ID key but no author key.
    let v = azure_milan();
    let err = verify(
        &v,
        &SnpPolicy {
            author_key_digest: Some(Hex(author)),
            ..v.policy.clone()
        },
    )
    .unwrap_err();
    assert!(matches!(err, SnpError::AuthorKeyDigest { .. }), "{err:?}");
}

/// Turin's FMC SVN (the generated Turin VCEK certifies 1) has a minimum
/// only in Turin's entry; the entry replaces the global minimum for Turin
/// reports, so a global minimum above them does not refuse them.
#[test]
fn turins_entry_sets_an_fmc_minimum() {
    let turin = TestAmd::for_line("Turin").unwrap();
    let raw = generated(&turin, 0x30000, &LaunchFields::default());
    let claims = verify_generated(&turin, &raw, &generated_policy(&turin)).unwrap();
    assert_eq!((claims.reported_fmc, claims.launch_fmc), (Some(1), Some(1)));
    let [bootloader, tee, snp, microcode] = turin.tcb();
    let entry = |fmc: Option<u8>| LineTcb {
        bootloader,
        tee,
        snp,
        microcode,
        fmc,
    };
    let by_line = |entry: LineTcb| SnpPolicy {
        minimum_tcb: tcb(bootloader + 1, tee, snp, microcode),
        minimum_tcb_by_line: BTreeMap::from([(ProductLine::Turin, entry)]),
        ..generated_policy(&turin)
    };
    for fmc in [None, Some(0), Some(1)] {
        verify_generated(&turin, &raw, &by_line(entry(fmc))).unwrap();
    }
    let err = verify_generated(&turin, &raw, &by_line(entry(Some(2)))).unwrap_err();
    assert!(
        matches!(&err, SnpError::TcbBelowMinimum {
            line, setting: "minimum_tcb_by_line", component: "fmc", minimum: 2, actual: 1
        } if line == "Turin"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "SNP Turin reported_tcb.fmc: expected at least 2 (minimum_tcb_by_line), actual 1"
    );
    let err = verify_generated(
        &turin,
        &raw,
        &by_line(LineTcb {
            microcode: microcode + 1,
            ..entry(Some(1))
        }),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            SnpError::TcbBelowMinimum {
                component: "microcode",
                ..
            }
        ),
        "{err:?}"
    );
    // The launch TCB's FMC SVN is held to the same minimum.
    let mut launched_lower = claims.clone();
    launched_lower.launch_fmc = Some(0);
    let err = launched_lower.check(&by_line(entry(Some(1)))).unwrap_err();
    assert!(
        matches!(&err, SnpError::LaunchTcbBelowMinimum {
            line, component: "fmc", minimum: 1, actual: 0, ..
        } if line == "Turin"),
        "{err:?}"
    );
    // Without minimums by line the global minimum applies, with no FMC
    // check: at the report's own four SVNs it passes, though its FMC SVN
    // (1) is below what an entry of 2 would require.
    verify_generated(
        &turin,
        &raw,
        &SnpPolicy {
            minimum_tcb: tcb(bootloader, tee, snp, microcode),
            minimum_tcb_by_line: BTreeMap::new(),
            ..by_line(entry(Some(2)))
        },
    )
    .unwrap();
    let err = verify_generated(
        &turin,
        &raw,
        &SnpPolicy {
            minimum_tcb_by_line: BTreeMap::new(),
            ..by_line(entry(Some(1)))
        },
    )
    .unwrap_err();
    assert!(
        matches!(&err, SnpError::TcbBelowMinimum {
            line, setting: "minimum_tcb", component: "bootloader", ..
        } if line == "Turin"),
        "{err:?}"
    );
}

// ------------------------------------------------------- the config text

fn snp_config(section: &str) -> Result<CpuPolicy, String> {
    let config: AttestationConfig = serde_json::from_str(&format!(
        r#"{{"variant":"sev-snp","sev_snp":{{"minimum_tcb":{{"bootloader":3,"tee":0,"snp":8,"microcode":115}},"measurement":"{}"{section}}}}}"#,
        "ab".repeat(48)
    ))
    .map_err(|e| format!("parse: {e}"))?;
    CpuPolicy::try_from(&config)
}

/// What the config text can and cannot say: per-line entries keyed by the
/// line's name, an FMC minimum in Turin's only, no all-zero key digests,
/// platform features by name.
#[test]
fn the_config_refuses_what_the_checks_cannot_mean() {
    let CpuPolicy::SevSnp(policy) = snp_config(
        r#","minimum_tcb_by_line":{"Turin":{"bootloader":1,"tee":0,"snp":2,"microcode":3,"fmc":4},"Genoa":{"bootloader":10,"tee":0,"snp":23,"microcode":84}},"require_platform":["alias-check-complete","ecc","ecc"],"allow_smt":false,"minimum_guest_svn":2"#,
    )
    .unwrap() else {
        panic!("not an SNP policy");
    };
    assert_eq!(policy.minimum_tcb_by_line[&ProductLine::Turin].fmc, Some(4));
    assert_eq!(
        policy.minimum_tcb_for("Genoa").unwrap().tcb.tcb(),
        tcb(10, 0, 23, 84)
    );
    // Minimums by line: a line left out has none (its reports are refused).
    assert_eq!(policy.minimum_tcb_for("Milan"), None);
    assert_eq!(policy.minimum_tcb_for("Venice"), None);
    let global = SnpPolicy {
        minimum_tcb_by_line: BTreeMap::new(),
        ..policy.clone()
    };
    assert_eq!(
        global.minimum_tcb_for("Milan").unwrap().setting,
        "minimum_tcb"
    );
    assert_eq!(
        policy.require_platform,
        BTreeSet::from([PlatformFeature::Ecc, PlatformFeature::AliasCheckComplete])
    );
    // Set pins are measured: the canonical form names them, in one order.
    let canonical = serde_json::to_string(&policy).unwrap();
    assert!(
        canonical.ends_with(r#""minimum_tcb_by_line":{"Genoa":{"bootloader":10,"tee":0,"snp":23,"microcode":84},"Turin":{"bootloader":1,"tee":0,"snp":2,"microcode":3,"fmc":4}},"minimum_guest_svn":2,"allow_smt":false,"require_platform":["ecc","alias-check-complete"]}"#),
        "{canonical}"
    );

    let err = snp_config(
        r#","minimum_tcb_by_line":{"Milan":{"bootloader":1,"tee":0,"snp":2,"microcode":3,"fmc":4}}"#,
    )
    .unwrap_err();
    assert_eq!(
        err,
        "sev_snp.minimum_tcb_by_line.Milan.fmc: only Turin's TCB has an FMC SVN"
    );
    for unknown in [
        r#","minimum_tcb_by_line":{"Milano":{"bootloader":1,"tee":0,"snp":2,"microcode":3}}"#,
        r#","minimum_tcb_by_line":{"Genoa":{"bootloader":1,"tee":0,"snp":2,"microcode":3,"pl":1}}"#,
        r#","require_platform":["smt"]"#,
        r#","id_key_digest":"abcd""#,
    ] {
        let err = snp_config(unknown).unwrap_err();
        assert!(err.starts_with("parse: "), "{unknown}: {err}");
    }
    for field in ["id_key_digest", "author_key_digest"] {
        let err = snp_config(&format!(r#","{field}":"{}""#, "00".repeat(48))).unwrap_err();
        assert!(
            err.starts_with(&format!("sev_snp.{field} is all zeros")),
            "{err}"
        );
        snp_config(&format!(r#","{field}":"{}""#, "01".repeat(48))).unwrap();
    }
    assert!(matches!(
        snp_config(r#","vmpl":4"#),
        Err(e) if e.starts_with("sev_snp.vmpl 4")
    ));
}

/// A policy written before the new fields existed parses to
/// [`SnpPolicy::new`]'s defaults and serialises back byte for byte; the
/// new fields written at their defaults mean and serialise the same.
#[test]
fn an_existing_policy_parses_to_the_same_value_and_bytes() {
    let m = "ab".repeat(48);
    let old = format!(
        r#"{{"minimum_tcb":{{"bootloader":3,"tee":0,"snp":8,"microcode":115}},"measurement":"{m}","allow_migration_agent":false,"vmpl":1}}"#
    );
    let parsed: SnpPolicy = serde_json::from_str(&old).unwrap();
    assert_eq!(
        parsed,
        SnpPolicy {
            vmpl: 1,
            ..SnpPolicy::new(tcb(3, 0, 8, 115), Hex(h(&m)))
        }
    );
    assert_eq!(serde_json::to_string(&parsed).unwrap(), old);
    let explicit = old.replace(
        r#""vmpl":1}"#,
        r#""vmpl":1,"minimum_tcb_by_line":{},"minimum_guest_svn":0,"allow_smt":true,"require_single_socket":false,"require_platform":[],"also_measurements":[]}"#,
    );
    let defaults: SnpPolicy = serde_json::from_str(&explicit).unwrap();
    assert_eq!(defaults, parsed);
    assert_eq!(serde_json::to_string(&defaults).unwrap(), old);

    let old = format!(r#"{{"mrtd":"{m}","rtmr":[null,"{m}",null,null]}}"#);
    let parsed: TdxPolicy = serde_json::from_str(&old).unwrap();
    assert_eq!(
        parsed,
        TdxPolicy {
            rtmr: [None, Some(Hex(h(&m))), None, None],
            ..TdxPolicy::new(Hex(h(&m)))
        }
    );
    assert_eq!(serde_json::to_string(&parsed).unwrap(), old);
    // The whole section, variant and all.
    let section = format!(r#"{{"variant":"tdx","tdx":{old}}}"#);
    let config: AttestationConfig = serde_json::from_str(&section).unwrap();
    assert_eq!(config.variant, Variant::Tdx);
    assert_eq!(serde_json::to_string(&config).unwrap(), section);
}

// ------------------------------------------------------------ real TDX

/// The TDX 1.5 quote whose MRCONFIGID is set (the others' are zeros);
/// every sample's XFAM is 0x602e7 and MROWNER zeros.
const TD15_MRTD: &str = "2a674327c50218dba880066b349b8d559d749ed68dce33fd651c184a877d084b07a9e583767a7ad5da13ed91deec2b70";
const TD15_XFAM: &str = "e702060000000000";
const TD15_MR_CONFIG_ID: &str = "0151ed70bddb5f12574176b37e3f53bbfc4ba15c33cbddc2d03d90b6de14596cc0000000000000000000000000000000";
const TD15_NOW: u64 = 1_794_008_710;

fn verify_td15(policy: &TdxPolicy) -> Result<TdxClaims, TdxError> {
    let collateral =
        tdx_collateral_file(&data_path("tdx/dcap-qvl/tdx_quote_td15ex_collateral.json")).unwrap();
    tdx::verify(
        &data("tdx/dcap-qvl/tdx_quote_td15ex"),
        &collateral,
        &IntelRoot::pinned(),
        policy,
        TD15_NOW,
    )
}

fn td15_policy() -> TdxPolicy {
    TdxPolicy::new(Hex(h(TD15_MRTD)))
}

#[test]
fn tdx_xfam_mr_config_id_and_mr_owner_are_pinned() {
    let claims = verify_td15(&td15_policy()).unwrap();
    assert_eq!(hex::encode(claims.xfam), TD15_XFAM);
    assert_eq!(hex::encode(claims.mr_config_id), TD15_MR_CONFIG_ID);
    assert_eq!(claims.mr_owner, [0; 48]);
    let right = TdxPolicy {
        xfam: Some(Hex(h(TD15_XFAM))),
        mr_config_id: Some(Hex(h(TD15_MR_CONFIG_ID))),
        mr_owner: Some(Hex([0; 48])),
        ..td15_policy()
    };
    verify_td15(&right).unwrap();

    let mut xfam = h::<8>(TD15_XFAM);
    xfam[0] ^= 0x80; // without AVX-512 Hi16_ZMM state (bit 7)
    let err = verify_td15(&TdxPolicy {
        xfam: Some(Hex(xfam)),
        ..right.clone()
    })
    .unwrap_err();
    assert!(
        matches!(&err, TdxError::Xfam { expected, actual }
            if *expected == hex::encode(xfam) && actual == TD15_XFAM),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "TDX XFAM: expected {}, actual {TD15_XFAM}",
            hex::encode(xfam)
        )
    );

    let mut config_id = h::<48>(TD15_MR_CONFIG_ID);
    config_id[47] ^= 1;
    let err = verify_td15(&TdxPolicy {
        mr_config_id: Some(Hex(config_id)),
        ..right.clone()
    })
    .unwrap_err();
    assert!(
        matches!(&err, TdxError::MrConfigId { expected, actual }
            if *expected == hex::encode(config_id) && actual == TD15_MR_CONFIG_ID),
        "{err}"
    );
    assert!(err.to_string().starts_with("TDX MRCONFIGID: expected"));

    let err = verify_td15(&TdxPolicy {
        mr_owner: Some(Hex([1; 48])),
        ..right.clone()
    })
    .unwrap_err();
    assert!(
        matches!(&err, TdxError::MrOwner { actual, .. } if *actual == "00".repeat(48)),
        "{err}"
    );
    assert!(err.to_string().starts_with("TDX MROWNER: expected 0101"));

    // The v4 sample has no MRCONFIGID: the td15 value is refused there.
    let collateral =
        tdx_collateral_file(&data_path("tdx/dcap-qvl/tdx_quote_collateral.json")).unwrap();
    let err = tdx::verify(
        &data("tdx/dcap-qvl/tdx_quote"),
        &collateral,
        &IntelRoot::pinned(),
        &TdxPolicy {
            mr_config_id: Some(Hex(h(TD15_MR_CONFIG_ID))),
            ..TdxPolicy::new(Hex(h("91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7")))
        },
        1_752_919_234,
    )
    .unwrap_err();
    assert!(matches!(err, TdxError::MrConfigId { .. }), "{err}");
}

/// The v4 TDX sample: another TD (MRTD) than the td15 one.
const V4_MRTD: &str = "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7";

fn verify_v4(policy: &TdxPolicy) -> Result<TdxClaims, TdxError> {
    let collateral =
        tdx_collateral_file(&data_path("tdx/dcap-qvl/tdx_quote_collateral.json")).unwrap();
    tdx::verify(
        &data("tdx/dcap-qvl/tdx_quote"),
        &collateral,
        &IntelRoot::pinned(),
        policy,
        1_752_919_234,
    )
}

/// MRTD changes with the TD firmware: two real quotes of different MRTDs
/// are both accepted by one policy that names one as `mrtd` and the other
/// in `also_mrtd`; a policy naming neither refuses each, naming the
/// quote's value and how many were accepted.
#[test]
fn a_policy_accepts_each_listed_mrtd() {
    let both = TdxPolicy {
        also_mrtd: BTreeSet::from([Hex(h(V4_MRTD))]),
        ..td15_policy()
    };
    assert_eq!(hex::encode(verify_td15(&both).unwrap().mrtd), TD15_MRTD);
    assert_eq!(hex::encode(verify_v4(&both).unwrap().mrtd), V4_MRTD);
    // The main MRTD alone takes only its own quote.
    verify_td15(&td15_policy()).unwrap();
    let err = verify_v4(&td15_policy()).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("TDX MRTD: expected {TD15_MRTD}, actual {V4_MRTD}")
    );

    let neither = TdxPolicy {
        also_mrtd: BTreeSet::from([Hex([0x22; 48])]),
        ..TdxPolicy::new(Hex([0x11; 48]))
    };
    for (actual, err) in [
        (TD15_MRTD, verify_td15(&neither).unwrap_err()),
        (V4_MRTD, verify_v4(&neither).unwrap_err()),
    ] {
        assert!(
            matches!(&err, TdxError::Mrtd { actual: a, .. } if a == actual),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "TDX MRTD: expected one of 2 accepted (mrtd {} and 1 in also_mrtd), actual \
                 {actual}",
                "11".repeat(48)
            )
        );
    }
}

/// The canonical (measured) order of every product line and platform
/// feature: reordering the enums would change PCR 12 of every config that
/// names them, so it is pinned here.
#[test]
fn lines_and_features_keep_their_canonical_order() {
    let all_lines: BTreeMap<ProductLine, LineTcb> =
        [ProductLine::Turin, ProductLine::Genoa, ProductLine::Milan]
            .into_iter()
            .map(|line| (line, LineTcb::default()))
            .collect();
    let lines = serde_json::to_string(&all_lines).unwrap();
    let zero = r#"{"bootloader":0,"tee":0,"snp":0,"microcode":0}"#;
    assert_eq!(
        lines,
        format!(r#"{{"Milan":{zero},"Genoa":{zero},"Turin":{zero}}}"#)
    );
    let features: BTreeSet<PlatformFeature> = serde_json::from_str(
        r#"["alias-check-complete","ciphertext-hiding","rapl-disabled","ecc","tsme"]"#,
    )
    .unwrap();
    assert_eq!(
        serde_json::to_string(&features).unwrap(),
        r#"["tsme","ecc","rapl-disabled","ciphertext-hiding","alias-check-complete"]"#
    );
}

fn tdx_config(section: &str) -> Result<CpuPolicy, String> {
    let config: AttestationConfig = serde_json::from_str(&format!(
        r#"{{"variant":"tdx","tdx":{{"mrtd":"{}"{section}}}}}"#,
        "ab".repeat(48)
    ))
    .map_err(|e| format!("parse: {e}"))?;
    CpuPolicy::try_from(&config)
}

/// `count` distinct 48-byte values as a JSON list, in descending order.
fn values(count: usize) -> String {
    let list: Vec<String> = (0..count)
        .rev()
        .map(|i| format!(r#""{}""#, hex::encode([u8::try_from(i).unwrap(); 48])))
        .collect();
    format!("[{}]", list.join(","))
}

/// `also_measurements` and `also_mrtd` are sets: duplicates collapse and
/// the canonical form lists them in order. More than
/// [`MAX_ALSO_MEASUREMENTS`] values are refused when the config is read.
#[test]
fn further_measurements_are_a_bounded_set() {
    let (cd, ef) = ("cd".repeat(48), "ef".repeat(48));
    let listed = format!(r#"["{ef}","{cd}","{ef}","{cd}"]"#);
    let CpuPolicy::SevSnp(snp) = snp_config(&format!(r#","also_measurements":{listed}"#)).unwrap()
    else {
        panic!("not an SNP policy");
    };
    assert_eq!(
        snp.also_measurements,
        BTreeSet::from([Hex(h(&cd)), Hex(h(&ef))])
    );
    assert!(
        serde_json::to_string(&snp)
            .unwrap()
            .ends_with(&format!(r#""also_measurements":["{cd}","{ef}"]}}"#)),
        "{snp:?}"
    );
    let CpuPolicy::Tdx(tdx) = tdx_config(&format!(r#","also_mrtd":{listed}"#)).unwrap() else {
        panic!("not a TDX policy");
    };
    assert_eq!(tdx.also_mrtd, BTreeSet::from([Hex(h(&cd)), Hex(h(&ef))]));
    assert!(
        serde_json::to_string(&tdx)
            .unwrap()
            .ends_with(&format!(r#""also_mrtd":["{cd}","{ef}"]}}"#)),
        "{tdx:?}"
    );

    // The bound counts distinct values.
    let at_most = values(MAX_ALSO_MEASUREMENTS);
    let CpuPolicy::SevSnp(snp) = snp_config(&format!(r#","also_measurements":{at_most}"#)).unwrap()
    else {
        panic!("not an SNP policy");
    };
    assert_eq!(snp.also_measurements.len(), MAX_ALSO_MEASUREMENTS);
    let CpuPolicy::Tdx(tdx) = tdx_config(&format!(r#","also_mrtd":{at_most}"#)).unwrap() else {
        panic!("not a TDX policy");
    };
    assert_eq!(tdx.also_mrtd.len(), MAX_ALSO_MEASUREMENTS);
    let too_many = values(MAX_ALSO_MEASUREMENTS + 1);
    assert_eq!(
        snp_config(&format!(r#","also_measurements":{too_many}"#)).unwrap_err(),
        "sev_snp.also_measurements lists 65 values, more than the 64 it may list"
    );
    assert_eq!(
        tdx_config(&format!(r#","also_mrtd":{too_many}"#)).unwrap_err(),
        "tdx.also_mrtd lists 65 values, more than the 64 it may list"
    );
    // A value of another length does not parse.
    let err = snp_config(r#","also_measurements":["abcd"]"#).unwrap_err();
    assert!(err.starts_with("parse: "), "{err}");
    let err = tdx_config(r#","also_mrtd":["abcd"]"#).unwrap_err();
    assert!(err.starts_with("parse: "), "{err}");
}

/// The cluster config is measured into PCR 12: one without
/// `also_measurements` or `also_mrtd` has the same canonical bytes, and so
/// the same PCR 12, as before they existed, and as one that lists them
/// empty; one that lists a value is measured with it.
#[test]
fn an_empty_list_of_further_measurements_measures_as_before() {
    let m = "ab".repeat(48);
    let cd = "cd".repeat(48);
    let config = |section: &str| {
        NodeConfig::parse(
            format!(r#"{{"cluster":{{"join_port":1,"attestation":{section}}}}}"#).as_bytes(),
            std::path::Path::new("test"),
        )
        .unwrap()
    };
    let head = r#"{"init_secret_hash":"","control_plane_endpoints":[],"init_port":9000,"join_port":1,"component_mirror":null,"ek_ca_pem":"","attestation":"#;
    for (old, field) in [
        (
            format!(
                r#"{{"variant":"sev-snp","sev_snp":{{"minimum_tcb":{{"bootloader":3,"tee":0,"snp":8,"microcode":115}},"measurement":"{m}","allow_migration_agent":false}}}}"#
            ),
            "also_measurements",
        ),
        (
            format!(r#"{{"variant":"tdx","tdx":{{"mrtd":"{m}","rtmr":[null,null,null,null]}}}}"#),
            "also_mrtd",
        ),
    ] {
        let before = config(&old);
        assert_eq!(
            String::from_utf8(before.cluster_bytes()).unwrap(),
            format!("{head}{old}}}")
        );
        let empty = config(&old.replacen("}}", &format!(r#","{field}":[]}}}}"#), 1));
        assert_eq!(empty, before);
        assert_eq!(empty.cluster_bytes(), before.cluster_bytes());
        assert_eq!(empty.expected_config_pcr(), before.expected_config_pcr());

        let listed = config(&old.replacen("}}", &format!(r#","{field}":["{cd}"]}}}}"#), 1));
        assert_eq!(
            String::from_utf8(listed.cluster_bytes()).unwrap(),
            format!(
                "{head}{}}}",
                old.replacen("}}", &format!(r#","{field}":["{cd}"]}}}}"#), 1)
            )
        );
        assert_ne!(listed.expected_config_pcr(), before.expected_config_pcr());
    }
}
