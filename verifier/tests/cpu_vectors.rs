//! Real SEV-SNP reports and TDX quotes (`../shared/data/cvm`, see its
//! README) verified offline: each reproduces the facts the README lists,
//! and each tampering is refused with its own error.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod vectors;

use keel_testkit::amd::certificate_pem;
use keel_verifier::cpu::binding::{report_data, HclReport};
use keel_verifier::cpu::collateral::tdx_collateral_file;
use keel_verifier::cpu::policy::{Hex, SnpPolicy, Tcb, TdxPolicy};
use keel_verifier::cpu::snp::{self, AmdRoots, SigningKey, SnpClaims, SnpError};
use keel_verifier::cpu::tdx::{self, IntelRoot, TdxClaims, TdxError};
use keel_verifier::cpu::{Binding, BindingError, CollateralError};
use vectors::{data, data_path, h, tcb};

/// 2025-11-23T00:00:00Z: every SNP endorsement certificate here is valid
/// (the AWS VLEK expires on 2025-12-10).
const SNP_TIME: u64 = 1_763_856_000;
/// 2026-11-23T00:00:00Z: after the VLEK expired.
const SNP_LATER: u64 = 1_795_392_000;
const DAY: u64 = 86_400;

fn pem_certs(path: &str) -> Vec<Vec<u8>> {
    x509_parser::pem::Pem::iter_from_buffer(&data(path))
        .map(|p| p.unwrap().contents)
        .collect()
}

struct SnpVector {
    name: &'static str,
    report: Vec<u8>,
    binding: Binding,
    vek: Vec<u8>,
    product: &'static str,
    version: u32,
    signing_key: SigningKey,
    chip_prefix: &'static str,
    tcb: Tcb,
    measurement: &'static str,
    report_data: &'static str,
    policy: u64,
    vmpl: u32,
    guest_svn: u32,
}

fn snp_vectors() -> Vec<SnpVector> {
    vec![
        SnpVector {
            name: "milan-virtee",
            report: data("snp/milan-virtee/report_milan.bin"),
            binding: Binding::Guest,
            vek: data("snp/milan-virtee/vcek_milan.der"),
            product: "SEV-Milan",
            version: 2,
            signing_key: SigningKey::Vcek,
            chip_prefix: "d49554ec717f4e5b",
            tcb: tcb(3, 0, 8, 115),
            measurement: "7a1e5c266c0108dbc9bb94fa926951320940915d0aafb42464bd88b579ea158d3e1a0dc39b2c60bd95b9c480cd81841f",
            report_data: "d447b55d197491bfe15cf298f9de9986b7a7c4be2468b4f6e2d53b71d7c645810b0f2cdfca0040433be063fc1a8293f0f3f8dae7b79fecb3d1cd82bd6a93ebfd",
            policy: 0x30000,
            vmpl: 0,
            guest_svn: 0,
        },
        SnpVector {
            name: "milan-gosevguest",
            report: data("snp/milan-gosevguest/attestation.bin"),
            binding: Binding::Guest,
            vek: data("snp/milan-gosevguest/vcek.der"),
            product: "SEV-Milan",
            version: 2,
            signing_key: SigningKey::Vcek,
            chip_prefix: "3ac3fe21e13fb099",
            tcb: tcb(2, 0, 5, 68),
            measurement: "b07af9620f3b839b47996422ddec6058338951d984e312115131ea82705eaf5b6bdf8a9ece31a5a608eb0cf2e4872b01",
            report_data: "01020304050000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000",
            policy: 0xb0000,
            vmpl: 0,
            guest_svn: 0,
        },
        SnpVector {
            name: "azure-milan-hcl",
            report: data("snp/azure-milan-hcl/hcl-report.bin"),
            binding: Binding::AzureHcl,
            vek: pem_certs("snp/azure-milan-hcl/vcek-chain.pem").remove(0),
            product: "SEV-Milan",
            version: 2,
            signing_key: SigningKey::Vcek,
            chip_prefix: "19752a447db501a3",
            tcb: tcb(3, 0, 8, 115),
            measurement: "9ac48fcac8a2d88aeeff8d427ad4f2be0e3917c748a18bdf52cc317e7fe20308b459d5ef1a12e0c22944eb386d17c315",
            report_data: "b3fbad6514c83caeb0380882145e49f794229ef37c421b91fc47ff93556bafac0000000000000000000000000000000000000000000000000000000000000000",
            policy: 0x3001f,
            vmpl: 0,
            guest_svn: 5,
        },
        SnpVector {
            name: "azure-genoa-hcl",
            report: data("snp/azure-genoa-hcl/hcl-report.bin"),
            binding: Binding::AzureHcl,
            vek: pem_certs("snp/azure-genoa-hcl/vcek-genoa.pem").remove(0),
            product: "SEV-Genoa",
            version: 3,
            signing_key: SigningKey::Vcek,
            chip_prefix: "0506ffba875e939c",
            tcb: tcb(10, 0, 23, 84),
            measurement: "f57dc09a507c6ecd82369bffb600f0003792f4d99bc26e985ec0c266fc34faf3706faf814c9e61065768a6ff917c89ae",
            report_data: "b581f12e29a2d7d64e5e0b738d563879a78b51c644d0fa0cce02b48699f6bf5f0000000000000000000000000000000000000000000000000000000000000000",
            policy: 0x3001f,
            vmpl: 0,
            guest_svn: 65547,
        },
        SnpVector {
            name: "aws-milan-vlek",
            report: data("snp/aws-milan-vlek/test-vlek-report.bin"),
            binding: Binding::Guest,
            vek: data("snp/aws-milan-vlek/test-vlek.der"),
            product: "SEV-VLEK-Milan",
            version: 3,
            signing_key: SigningKey::Vlek,
            chip_prefix: "0000000000000000",
            tcb: tcb(4, 0, 24, 217),
            measurement: "8922ebbdd00ec2c541f36a6e7a82a8773a7accb451ed67bc94e740dbe92c93c4e8c9af857f5ceeb5a493df2a570d7bf0",
            report_data: "819770b7e6ea6df8dd8fd4dd146b073c0bf4f3ce5b0977ecac486e3a05ed1bd54e2a7ac1f5d1ca02e7d7d5ef9f73b8574fd9359e3a480d741a4478e8a7bc27ca",
            policy: 0x30000,
            vmpl: 1,
            guest_svn: 0,
        },
    ]
}

/// A policy that the vector meets exactly: its own TCB as the minimum, its
/// own measurement and VMPL.
fn policy_for(v: &SnpVector) -> SnpPolicy {
    SnpPolicy {
        vmpl: v.vmpl,
        ..SnpPolicy::new(v.tcb, Hex(h(v.measurement)))
    }
}

fn verify_snp(
    report: &[u8],
    binding: Binding,
    vek: &[u8],
    roots: &AmdRoots,
    policy: &SnpPolicy,
    now: u64,
) -> Result<SnpClaims, SnpError> {
    let raw = binding.snp_report(report).unwrap();
    let parsed = snp::parse(raw)?;
    snp::verify(raw, &parsed, vek, roots, policy, now)
}

/// [`verify_snp`] of vector `v` under the pinned AMD roots.
fn verify_pinned(
    v: &SnpVector,
    vek: &[u8],
    policy: &SnpPolicy,
    now: u64,
) -> Result<SnpClaims, SnpError> {
    verify_snp(&v.report, v.binding, vek, &AmdRoots::pinned(), policy, now)
}

/// Vector `v` with its own VEK and policy under `roots`.
fn verify_under(v: &SnpVector, roots: &AmdRoots) -> Result<SnpClaims, SnpError> {
    verify_snp(
        &v.report,
        v.binding,
        &v.vek,
        roots,
        &policy_for(v),
        SNP_TIME,
    )
}

#[test]
fn every_snp_vector_verifies_with_the_readme_facts() {
    let roots = AmdRoots::pinned();
    assert_eq!(roots.len(), 6, "the ASK and ASVK of Milan, Genoa and Turin");
    for v in snp_vectors() {
        let raw = v.binding.snp_report(&v.report).unwrap();
        let parsed = snp::parse(raw).unwrap();
        let claims = snp::verify_signed(raw, &parsed, &v.vek, &roots, SNP_TIME)
            .unwrap_or_else(|e| panic!("{}: {e:?}", v.name));
        assert_eq!(claims.product, v.product, "{}", v.name);
        assert_eq!(claims.version, v.version, "{}", v.name);
        assert_eq!(claims.signing_key, v.signing_key, "{}", v.name);
        assert!(
            hex::encode(claims.chip_id).starts_with(v.chip_prefix),
            "{}",
            v.name
        );
        assert_eq!(claims.reported_tcb, v.tcb, "{}", v.name);
        assert_eq!(hex::encode(claims.measurement), v.measurement, "{}", v.name);
        assert_eq!(hex::encode(claims.report_data), v.report_data, "{}", v.name);
        assert_eq!(claims.policy, v.policy, "{}", v.name);
        assert_eq!(claims.vmpl, v.vmpl, "{}", v.name);
        assert_eq!(claims.guest_svn, v.guest_svn, "{}", v.name);
        // go-sev-guest's report was made by a debuggable guest (policy
        // 0xb0000 has DEBUG, bit 19): authentic, and refused.
        let accepted = claims.check(&policy_for(&v));
        if v.name == "milan-gosevguest" {
            let err = accepted.unwrap_err();
            assert!(
                matches!(err, SnpError::Debug { policy: 0xb0000 }),
                "{err:?}"
            );
            let err = verify_snp(
                &v.report,
                v.binding,
                &v.vek,
                &roots,
                &policy_for(&v),
                SNP_TIME,
            )
            .unwrap_err();
            assert!(matches!(err, SnpError::Debug { .. }), "{err:?}");
        } else {
            accepted.unwrap_or_else(|e| panic!("{}: {e:?}", v.name));
            verify_snp(
                &v.report,
                v.binding,
                &v.vek,
                &roots,
                &policy_for(&v),
                SNP_TIME,
            )
            .unwrap();
        }
    }
}

/// The report's VMPL must be the one the policy names. AWS's VLEK report
/// was requested at VMPL 1: refused under the default (0), accepted where
/// the config names 1; a VMPL-0 report is refused where it names 1.
#[test]
fn a_report_from_another_vmpl_is_refused() {
    let vectors = snp_vectors();
    let named = |name: &str| vectors.iter().find(|v| v.name == name).unwrap();
    let aws = named("aws-milan-vlek");
    assert_eq!(aws.vmpl, 1);
    verify_pinned(aws, &aws.vek, &policy_for(aws), SNP_TIME).unwrap();
    for (v, configured) in [(aws, 0), (named("milan-virtee"), 1)] {
        let policy = SnpPolicy {
            vmpl: configured,
            ..policy_for(v)
        };
        let err = verify_pinned(v, &v.vek, &policy, SNP_TIME).unwrap_err();
        assert!(
            matches!(err, SnpError::Vmpl { expected, actual }
                if expected == configured && actual == v.vmpl),
            "{}: {err:?}",
            v.name
        );
        assert_eq!(
            err.to_string(),
            format!("SNP vmpl: expected {configured}, actual {}", v.vmpl)
        );
    }
}

/// One SVN of a TCB, to read or set.
type Component = fn(&mut Tcb) -> &mut u8;

/// Firmware updated while a guest runs raises its reported TCB, not the
/// TCB it was launched under: a launch TCB below the minimum is refused,
/// naming the component. Every real vector was launched at or above its
/// reported TCB (AWS's at microcode 219, above the 217 it reports).
#[test]
fn a_launch_tcb_below_the_minimum_is_refused() {
    let roots = AmdRoots::pinned();
    for v in snp_vectors()
        .into_iter()
        .filter(|v| v.name != "milan-gosevguest")
    {
        let raw = v.binding.snp_report(&v.report).unwrap();
        let parsed = snp::parse(raw).unwrap();
        let claims = snp::verify_signed(raw, &parsed, &v.vek, &roots, SNP_TIME).unwrap();
        if v.name == "aws-milan-vlek" {
            assert_eq!(claims.launch_tcb, tcb(4, 0, 24, 219));
        } else {
            assert_eq!(claims.launch_tcb, v.tcb, "{}", v.name);
        }
        claims.check(&policy_for(&v)).unwrap();
        let fields: [(&str, Component); 3] = [
            ("bootloader", |t| &mut t.bootloader),
            ("snp", |t| &mut t.snp),
            ("microcode", |t| &mut t.microcode),
        ];
        for (component, field) in fields {
            let minimum = *field(&mut policy_for(&v).minimum_tcb);
            let mut launched_lower = claims.clone();
            *field(&mut launched_lower.launch_tcb) = minimum - 1;
            let err = launched_lower.check(&policy_for(&v)).unwrap_err();
            assert!(
                matches!(
                    err,
                    SnpError::LaunchTcbBelowMinimum { component: c, minimum: m, actual: a, .. }
                        if c == component && m == minimum && a == minimum - 1
                ),
                "{}: {err:?}",
                v.name
            );
        }
    }
}

#[test]
fn a_vcek_from_another_chip_is_refused() {
    // The kinvolk fixture: a valid chain whose VCEK belongs to another chip.
    let report = data("snp/azure-milan-hcl-mismatch/hcl-report-snp.bin");
    let vek = pem_certs("snp/azure-milan-hcl-mismatch/certs.pem").remove(0);
    let policy = SnpPolicy::new(
        tcb(3, 0, 8, 115),
        Hex(h("5a71e4ba7e0b83e44c8e853130a65557db0a7782cdb2d906c54b0bf5878202805ab159bfe0cf7d5749aa6f62b7094508")),
    );
    let err = verify_snp(
        &report,
        Binding::AzureHcl,
        &vek,
        &AmdRoots::pinned(),
        &policy,
        SNP_TIME,
    )
    .unwrap_err();
    let SnpError::ChipId { expected, actual } = &err else {
        panic!("{err:?}");
    };
    assert!(expected.starts_with("da8a5695b5aeafdb"), "{err}");
    assert!(actual.starts_with("3a5d5b1d059d193e"), "{err}");

    // And a real VCEK of one Milan chip against a real report of another.
    let v = &snp_vectors()[0];
    let other = data("snp/milan-gosevguest/vcek.der");
    let err = verify_pinned(v, &other, &policy_for(v), SNP_TIME).unwrap_err();
    assert!(matches!(err, SnpError::ChipId { .. }), "{err:?}");
}

/// Every field the signature covers, by offset in the report: a flipped bit
/// in any of them is refused.
#[test]
fn one_bit_flipped_in_each_signed_field_is_refused() {
    let fields: [(&str, usize); 24] = [
        ("version", 0x00),
        ("guest_svn", 0x04),
        ("policy", 0x08),
        ("family_id", 0x10),
        ("image_id", 0x20),
        ("vmpl", 0x30),
        ("sig_algo", 0x34),
        ("current_tcb", 0x38),
        ("plat_info", 0x40),
        ("key_info", 0x48),
        ("report_data", 0x50),
        ("measurement", 0x90),
        ("host_data", 0xc0),
        ("id_key_digest", 0xe0),
        ("author_key_digest", 0x110),
        ("report_id", 0x140),
        ("report_id_ma", 0x160),
        ("reported_tcb", 0x180),
        ("chip_id", 0x1a0),
        ("committed_tcb", 0x1e0),
        ("current_build", 0x1e8),
        ("committed_build", 0x1ec),
        ("launch_tcb", 0x1f0),
        ("signature.r", 0x2a0),
    ];
    for v in snp_vectors() {
        let raw = v.binding.snp_report(&v.report).unwrap().to_vec();
        for (field, at) in fields {
            let mut tampered = raw.clone();
            tampered[at] ^= 1;
            let err = verify_snp(
                &tampered,
                Binding::Guest,
                &v.vek,
                &AmdRoots::pinned(),
                &policy_for(&v),
                SNP_TIME,
            )
            .expect_err(&format!("{}: {field} flipped was accepted", v.name));
            let own_error = match field {
                "sig_algo" => matches!(err, SnpError::SigAlgo { actual: 0 }),
                "chip_id" if v.signing_key == SigningKey::Vcek => {
                    matches!(err, SnpError::ChipId { .. })
                }
                "reported_tcb" => matches!(
                    err,
                    SnpError::CertifiedTcb {
                        component: "bootloader",
                        ..
                    }
                ),
                "version" => matches!(err, SnpError::Signature | SnpError::ReportParse(_)),
                _ => matches!(err, SnpError::Signature),
            };
            assert!(own_error, "{} {field}: {err:?}", v.name);
        }
    }
}

#[test]
fn a_chain_with_the_wrong_root_is_refused() {
    let v = &snp_vectors()[0];
    // Only the Genoa roots: nothing issued a Milan VCEK.
    let genoa = data("snp/amd-roots/ask_ark_genoa.pem");
    let roots = AmdRoots::from_pem_bundles(&[&genoa]);
    let err = verify_under(v, &roots).unwrap_err();
    assert!(
        matches!(&err, SnpError::UntrustedIssuer { issuer } if issuer.contains("SEV-Milan")),
        "{err:?}"
    );
    // The Milan ASK under the Genoa ARK: the ARK does not sign that ASK.
    let milan = pem_certs("snp/amd-roots/ask_ark_milan.pem");
    let genoa_ark = pem_certs("snp/amd-roots/ask_ark_genoa.pem").remove(1);
    let bundle = format!(
        "{}{}",
        certificate_pem(&milan[0]),
        certificate_pem(&genoa_ark)
    );
    let roots = AmdRoots::from_pem_bundles(&[bundle.as_bytes()]);
    let err = verify_under(v, &roots).unwrap_err();
    assert!(
        matches!(
            err,
            SnpError::Chain {
                link: "ARK -> ASK",
                ..
            }
        ),
        "{err:?}"
    );
    // The VLEK is issued by the ASVK, not by the Milan ASK.
    let vlek = &snp_vectors()[4];
    let milan = data("snp/amd-roots/ask_ark_milan.pem");
    let roots = AmdRoots::from_pem_bundles(&[&milan]);
    let err = verify_under(vlek, &roots).unwrap_err();
    assert!(matches!(err, SnpError::UntrustedIssuer { .. }), "{err:?}");
}

/// The position of `needle`'s last occurrence in `haystack`.
fn last_position(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .rposition(|w| w == needle)
        .unwrap()
}

/// The links between pinned certificates are verified once, when the roots
/// load; the endorsement key's on every report. Each refuses by name.
#[test]
fn a_tampered_certificate_in_the_chain_is_refused_with_its_link() {
    let v = &snp_vectors()[0];
    let vek_link = |err: SnpError| matches!(err, SnpError::Chain { link: "ASK -> VEK" });
    // A bit of the VCEK's public key (inside what the ASK signed).
    let (_, parsed) =
        <x509_parser::certificate::X509Certificate as x509_parser::prelude::FromDer<_>>::from_der(
            &v.vek,
        )
        .unwrap();
    let key = parsed.public_key().subject_public_key.data.to_vec();
    let mut vek = v.vek.clone();
    vek[last_position(&v.vek, &key) + key.len() - 1] ^= 1;
    let err = verify_pinned(v, &vek, &policy_for(v), SNP_TIME).unwrap_err();
    assert!(vek_link(err), "public key");
    // A bit of the ASK's signature over the VCEK.
    let mut vek = v.vek.clone();
    *vek.last_mut().unwrap() ^= 1;
    let err = verify_pinned(v, &vek, &policy_for(v), SNP_TIME).unwrap_err();
    assert!(vek_link(err), "signature");
    // The same signature declared as another algorithm (sha256WithRSA):
    // only RSASSA-PSS is AMD's.
    let pss = [
        0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0a,
    ];
    let mut vek = v.vek.clone();
    vek[last_position(&v.vek, &pss) + pss.len() - 1] = 0x0b;
    let err = verify_pinned(v, &vek, &policy_for(v), SNP_TIME).unwrap_err();
    assert!(vek_link(err), "algorithm");

    // An ARK whose self-signature is broken: every report under it is
    // refused, though its key still verifies the ASK.
    let milan = pem_certs("snp/amd-roots/ask_ark_milan.pem");
    let mut ark = milan[1].clone();
    *ark.last_mut().unwrap() ^= 1;
    let bundle = format!("{}{}", certificate_pem(&milan[0]), certificate_pem(&ark));
    let roots = AmdRoots::from_pem_bundles(&[bundle.as_bytes()]);
    let err = verify_under(v, &roots).unwrap_err();
    assert!(
        matches!(
            err,
            SnpError::Chain {
                link: "ARK self-signature"
            }
        ),
        "{err:?}"
    );
    // The untampered bundle verifies the same report.
    let bundle = format!(
        "{}{}",
        certificate_pem(&milan[0]),
        certificate_pem(&milan[1])
    );
    verify_under(v, &AmdRoots::from_pem_bundles(&[bundle.as_bytes()])).unwrap();
}

#[test]
fn a_tcb_below_the_minimum_is_refused_per_component() {
    let v = &snp_vectors()[0];
    for (component, minimum) in [
        ("bootloader", tcb(4, 0, 8, 115)),
        ("tee", tcb(3, 1, 8, 115)),
        ("snp", tcb(3, 0, 9, 115)),
        ("microcode", tcb(3, 0, 8, 116)),
    ] {
        let policy = SnpPolicy {
            minimum_tcb: minimum,
            ..policy_for(v)
        };
        let err = verify_pinned(v, &v.vek, &policy, SNP_TIME).unwrap_err();
        assert!(
            matches!(err, SnpError::TcbBelowMinimum { component: c, .. } if c == component),
            "{component}: {err:?}"
        );
    }
}

#[test]
fn measurement_host_data_and_migration_agent_are_checked() {
    let v = &snp_vectors()[0];
    let mut policy = policy_for(v);
    policy.measurement.0[47] ^= 1;
    let err = verify_pinned(v, &v.vek, &policy, SNP_TIME).unwrap_err();
    assert!(matches!(err, SnpError::Measurement { .. }), "{err:?}");
    assert!(err.to_string().contains(v.measurement), "{err}");

    let mut policy = policy_for(v);
    policy.host_data = Some(Hex([1; 32]));
    let err = verify_pinned(v, &v.vek, &policy, SNP_TIME).unwrap_err();
    assert!(matches!(err, SnpError::HostData { .. }), "{err:?}");

    // No real report here allows a migration agent; the check on the
    // verified claims, with MIGRATE_MA (bit 18) set:
    let raw = v.binding.snp_report(&v.report).unwrap();
    let mut claims = snp::verify_signed(
        raw,
        &snp::parse(raw).unwrap(),
        &v.vek,
        &AmdRoots::pinned(),
        SNP_TIME,
    )
    .unwrap();
    claims.policy |= 1 << 18;
    let err = claims.check(&policy_for(v)).unwrap_err();
    assert!(
        matches!(err, SnpError::MigrationAgent { policy: 0x70000 }),
        "{err:?}"
    );
    let allowed = SnpPolicy {
        allow_migration_agent: true,
        vmpl: 0,
        ..policy_for(v)
    };
    claims.check(&allowed).unwrap();
}

#[test]
fn an_expired_endorsement_certificate_is_refused() {
    let v = &snp_vectors()[4];
    let err = verify_pinned(v, &v.vek, &policy_for(v), SNP_LATER).unwrap_err();
    assert!(matches!(err, SnpError::CertificateTime { .. }), "{err:?}");
}

#[test]
fn a_truncated_report_is_refused() {
    let v = &snp_vectors()[0];
    let err = verify_snp(
        &v.report[..1000],
        v.binding,
        &v.vek,
        &AmdRoots::pinned(),
        &policy_for(v),
        SNP_TIME,
    )
    .unwrap_err();
    assert!(
        matches!(err, SnpError::ReportSize { actual: 1000 }),
        "{err:?}"
    );
}

#[test]
fn guest_report_data_must_bind_the_ak_and_nonce() {
    let v = &snp_vectors()[0];
    let claims = verify_pinned(v, &v.vek, &policy_for(v), SNP_TIME).unwrap();
    // This real report was not made for a keel AK: its report_data binds nothing of ours.
    let err = Binding::Guest
        .check(
            &v.report,
            &claims.report_data,
            b"some AK public area",
            b"nonce",
        )
        .unwrap_err();
    assert!(matches!(err, BindingError::ReportData { .. }), "{err:?}");
    // The binding is over nonce and AK: each changes it.
    let rd = report_data(b"nonce", b"ak");
    assert_ne!(rd, report_data(b"nonce2", b"ak"));
    assert_ne!(rd, report_data(b"nonce", b"ak2"));
    Binding::Guest
        .check(&v.report, &rd, b"ak", b"nonce")
        .unwrap();
}

/// A TPMT_PUBLIC for an RSA-2048 restricted signing key with `modulus`.
fn rsa_ak_public(modulus: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&0x0001u16.to_be_bytes()); // RSA
    out.extend_from_slice(&0x000bu16.to_be_bytes()); // SHA-256
    out.extend_from_slice(&0x0005_0072u32.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes()); // empty auth policy
    out.extend_from_slice(&0x0010u16.to_be_bytes()); // no symmetric
    out.extend_from_slice(&0x0014u16.to_be_bytes()); // RSASSA
    out.extend_from_slice(&0x000bu16.to_be_bytes()); // SHA-256
    out.extend_from_slice(&2048u16.to_be_bytes());
    out.extend_from_slice(&0u32.to_be_bytes()); // 65537
    out.extend_from_slice(&(modulus.len() as u16).to_be_bytes());
    out.extend_from_slice(modulus);
    out
}

#[test]
fn azure_hcl_runtime_data_binds_the_ak() {
    for (name, path) in [
        ("milan", "snp/azure-milan-hcl/hcl-report.bin"),
        ("genoa", "snp/azure-genoa-hcl/hcl-report.bin"),
        (
            "mismatch",
            "snp/azure-milan-hcl-mismatch/hcl-report-snp.bin",
        ),
    ] {
        let hcl_bytes = data(path);
        let hcl = HclReport::parse(&hcl_bytes).unwrap();
        let report = snp::parse(hcl.report).unwrap();
        let (n, e) = hcl.attestation_key().unwrap();
        assert_eq!(n.len(), 256, "{name}");
        assert_eq!(e, [1, 0, 1], "{name}");
        let ak = rsa_ak_public(&n);
        Binding::AzureHcl
            .check(&hcl_bytes, &report.report_data, &ak, b"any nonce")
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));

        // Another AK: the runtime data does not name it.
        let mut other = n.clone();
        other[100] ^= 1;
        let err = Binding::AzureHcl
            .check(&hcl_bytes, &report.report_data, &rsa_ak_public(&other), b"")
            .unwrap_err();
        assert_eq!(err, BindingError::AkMismatch, "{name}");

        // Runtime data changed after the report was made: its hash differs.
        let mut tampered = hcl_bytes.clone();
        let at = tampered.len().min(1236 + 40);
        tampered[at] ^= 1;
        let err = Binding::AzureHcl
            .check(&tampered, &report.report_data, &ak, b"")
            .unwrap_err();
        assert!(
            matches!(err, BindingError::RuntimeDataHash { .. }),
            "{name}: {err:?}"
        );
    }
}

// ---------------------------------------------------------------- TDX

struct TdxVector {
    name: &'static str,
    quote: &'static str,
    collateral: &'static str,
    now: u64,
    tee_tcb_svn: &'static str,
    mrtd: &'static str,
    rtmr: [&'static str; 4],
    report_data: &'static str,
}

const ZERO48: &str = "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000";

fn tdx_vectors() -> [TdxVector; 3] {
    [
        TdxVector {
            name: "tdx_quote (v4)",
            quote: "tdx/dcap-qvl/tdx_quote",
            collateral: "tdx/dcap-qvl/tdx_quote_collateral.json",
            now: 1_752_919_234,
            tee_tcb_svn: "06010300000000000000000000000000",
            mrtd: "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7",
            rtmr: [
                "44c0197b39157fdd7a4dcc44767f9d6b0bb3977c7a8e347b8492f827fe9d9e5c48aca29b220b80b6a540cf994b9bc9c0",
                "0084452c01668329d4bc06acdf58a7205c26743304509973949e5619bf81a6a7aea8c323c173019b3093d54e579e9378",
                "d833feef2cd945148aa38ead2c53e9b7f138190aaaebfc551dccd829fc207aa3ba80b70870d7330733642e01d48c3132",
                ZERO48,
            ],
            report_data: "9a9d48e7f6799642d3d1b34e1e5e1742d4bb02dd6ddd551862c1211d35c304f9eca3efdbb481601c163cf52493d6e44aed55d51ec39b7e518fadb92c2b523f20",
        },
        TdxVector {
            name: "tdx_quote_td15ex (v5, type 4)",
            quote: "tdx/dcap-qvl/tdx_quote_td15ex",
            collateral: "tdx/dcap-qvl/tdx_quote_td15ex_collateral.json",
            now: 1_794_008_710,
            tee_tcb_svn: "0f010400000000000000000000000000",
            mrtd: "2a674327c50218dba880066b349b8d559d749ed68dce33fd651c184a877d084b07a9e583767a7ad5da13ed91deec2b70",
            rtmr: [
                "0345d2a146eec673fb3861a4d88c5093ef0934b142884294377628cf09fb21bfa979acec61e79f925f5fccaad0827165",
                "3484cd07ba093cede0938303617d6da58f3c6a895ddd5461b3bdd0b29f40e869d4c92642867b44bd3619451bd78ff2d0",
                "83b7a9a35ed613c17a8b9d36a49f28b095f54daa78b328c93eef10ae3e21094c1411467e3371157c4cde5e0beb72dcb8",
                "556d4986cae57e7e3756b6471e4951be6f5f1b4e70942c72325223d6af239da90f1484eeb627727e6d2c0755393b5fdf",
            ],
            report_data: "2945321c99222c3622a14cf7feaab073e799be14b5f3e73cd2e6cad64e5f062463ad204f33f0a39e47d098330db88ca5b5d0a7afce540dfe4c4fe4a377190731",
        },
        TdxVector {
            name: "quote_v5_sample (v5, type 3)",
            quote: "tdx/go-tdx-guest/quote_v5_sample.dat",
            collateral: "tdx/dcap-qvl/tdx_quote_outdated_collateral.json",
            now: 1_774_003_274,
            tee_tcb_svn: "0b010400000000000000000000000000",
            mrtd: "7348651a34b2d2d3462822e3a750ec6110125f36757c78480bbfc69cc0d21fb001a1ced3ee19747dda8f750c3bc8f876",
            rtmr: [
                "5c8daf76063a71ac8fcef4067564661fc682ed7944c7a5d21dbbced02f61ceff4ba0678c6aef3bdae8cbc614cec24619",
                "463acaace1b6e97c76e92e41fe312aa66f3fd4dad60ec7acf169859db0343e3d1e591646795cdc80fbc0ca5f7041d253",
                "6369b9c9a3b791ebcbdc5a0bb9536cfb57f50df2b393b33c8b29616d3568baa61f4b59dc6092e31ea8764bcbdfc69f20",
                ZERO48,
            ],
            report_data: "945eaacf5abc1f719d8666a942fda03d1edcb4490277396093dc5a5289ab9f1e094aed63060cd4a4933a4dd537ed1255c9c79ecb3ed82cd1b486233e31c25c3a",
        },
    ]
}

fn tdx_policy_for(v: &TdxVector) -> TdxPolicy {
    TdxPolicy {
        rtmr: v.rtmr.map(|r| Some(Hex(h(r)))),
        ..TdxPolicy::new(Hex(h(v.mrtd)))
    }
}

fn verify_tdx(
    v: &TdxVector,
    quote: &[u8],
    policy: &TdxPolicy,
    now: u64,
) -> Result<TdxClaims, TdxError> {
    let collateral = tdx_collateral_file(&data_path(v.collateral)).unwrap();
    tdx::verify(quote, &collateral, &IntelRoot::pinned(), policy, now)
}

#[test]
fn every_tdx_vector_verifies_with_the_readme_facts() {
    for v in tdx_vectors() {
        let claims = verify_tdx(&v, &data(v.quote), &tdx_policy_for(&v), v.now)
            .unwrap_or_else(|e| panic!("{}: {e}", v.name));
        assert_eq!(claims.status, "UpToDate", "{}", v.name);
        assert!(claims.advisories.is_empty(), "{}", v.name);
        assert_eq!(hex::encode(claims.tee_tcb_svn), v.tee_tcb_svn, "{}", v.name);
        assert_eq!(hex::encode(claims.mrtd), v.mrtd, "{}", v.name);
        for (i, r) in claims.rtmr.iter().enumerate() {
            assert_eq!(hex::encode(r), v.rtmr[i], "{} RTMR{i}", v.name);
        }
        assert_eq!(hex::encode(claims.report_data), v.report_data, "{}", v.name);
        assert_eq!(claims.td_attributes[0] & 1, 0, "{}: not debug", v.name);
    }
}

#[test]
fn tdx_collateral_outside_its_window_is_refused() {
    let v = &tdx_vectors()[0];
    let quote = data(v.quote);
    for now in [v.now + DAY, 1_750_329_147 - DAY] {
        let err = verify_tdx(v, &quote, &tdx_policy_for(v), now).unwrap_err();
        assert!(
            matches!(
                err,
                TdxError::Verification {
                    check: "collateral time",
                    ..
                }
            ),
            "{now}: {err}"
        );
    }
}

#[test]
fn a_tdx_quote_without_a_matching_tcb_level_is_refused() {
    let v = TdxVector {
        name: "tdx_quote_outdated",
        quote: "tdx/dcap-qvl/tdx_quote_outdated",
        collateral: "tdx/dcap-qvl/tdx_quote_outdated_collateral.json",
        now: 1_774_003_274,
        tee_tcb_svn: "",
        mrtd: "273828c46252fcbdd8ad2dd907130222b03466d52a2911d70c1a5950895d6bd1ae451d382d5a9b1b4c0ed0e5ae9a3dbd",
        rtmr: [ZERO48; 4],
        report_data: "",
    };
    let err = verify_tdx(&v, &data(v.quote), &tdx_policy_for(&v), v.now).unwrap_err();
    assert!(
        matches!(
            err,
            TdxError::Verification {
                check: "TCB level",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn one_bit_flipped_in_each_signed_tdx_field_is_refused() {
    // TD report fields of a v4 quote (header 48 bytes, then the body).
    let fields: [(&str, usize); 14] = [
        ("header.version", 0),
        ("header.user_data", 28),
        ("tee_tcb_svn", 48),
        ("mr_seam", 64),
        ("seam_attributes", 160),
        ("td_attributes", 168 + 3),
        ("xfam", 176),
        ("mrtd", 184),
        ("mr_config_id", 232),
        ("mr_owner", 280),
        ("rtmr0", 376),
        ("rtmr2", 472),
        ("rtmr3", 520),
        ("report_data", 568),
    ];
    let v = &tdx_vectors()[0];
    let quote = data(v.quote);
    for (field, at) in fields {
        let mut tampered = quote.clone();
        tampered[at] ^= 1;
        let err = verify_tdx(v, &tampered, &tdx_policy_for(v), v.now)
            .expect_err(&format!("{field} flipped was accepted"));
        assert!(
            matches!(err, TdxError::Verification { .. }),
            "{field}: {err}"
        );
    }
}

#[test]
fn tdx_measurements_are_checked_each_with_its_register() {
    let v = &tdx_vectors()[1];
    let quote = data(v.quote);
    let mut policy = tdx_policy_for(v);
    policy.mrtd.0[0] ^= 1;
    let err = verify_tdx(v, &quote, &policy, v.now).unwrap_err();
    assert!(matches!(err, TdxError::Mrtd { .. }), "{err}");
    for index in 0..4 {
        let mut policy = tdx_policy_for(v);
        if let Some(r) = policy.rtmr[index].as_mut() {
            r.0[47] ^= 1;
        }
        let err = verify_tdx(v, &quote, &policy, v.now).unwrap_err();
        assert!(
            matches!(err, TdxError::Rtmr { index: i, .. } if i == index),
            "{err}"
        );
        assert!(err.to_string().contains(v.rtmr[index]), "{err}");
    }
    // An unchecked RTMR (null) is not compared.
    let mut policy = tdx_policy_for(v);
    policy.rtmr[3] = None;
    verify_tdx(v, &quote, &policy, v.now).unwrap();
}

#[test]
fn a_tdx_quote_under_another_root_is_refused() {
    let v = &tdx_vectors()[0];
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "Intel SGX Root CA");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let other_root = params.self_signed(&key).unwrap().der().to_vec();
    let collateral = tdx_collateral_file(&data_path(v.collateral)).unwrap();
    let err = tdx::verify(
        &data(v.quote),
        &collateral,
        &IntelRoot::from_der(other_root),
        &tdx_policy_for(v),
        v.now,
    )
    .unwrap_err();
    assert!(matches!(err, TdxError::Verification { .. }), "{err}");
}

#[test]
fn tdx_report_data_must_bind_the_ak_and_nonce() {
    let v = &tdx_vectors()[0];
    let claims = verify_tdx(v, &data(v.quote), &tdx_policy_for(v), v.now).unwrap();
    let err = Binding::Guest
        .check(&data(v.quote), &claims.report_data, b"ak", b"nonce")
        .unwrap_err();
    assert!(matches!(err, BindingError::ReportData { .. }), "{err}");
}

#[test]
fn cpu_trust_bounds_evidence_before_parsing_and_requires_it() {
    use keel_verifier::cpu::{Collateral, CpuError, CpuPolicy, CpuTrust, Evidence};
    let v = &snp_vectors()[0];
    let trust = CpuTrust::new(CpuPolicy::SevSnp(policy_for(v)), Collateral::default());
    let err = trust.verify(None, b"ak", b"nonce", SNP_TIME).unwrap_err();
    assert!(matches!(err, CpuError::Missing { .. }), "{err:?}");
    let huge = Evidence {
        binding: Binding::Guest,
        report: vec![0; 40 * 1024],
        certificate: Vec::new(),
    };
    let err = trust
        .verify(Some(&huge), b"ak", b"nonce", SNP_TIME)
        .unwrap_err();
    assert!(
        matches!(err, CpuError::TooLarge { what: "report", .. }),
        "{err:?}"
    );
    // The real report through the whole CpuTrust path: it verifies, and
    // then fails only on the binding (it was not made for this AK).
    let real = Evidence {
        binding: Binding::Guest,
        report: v.report.clone(),
        certificate: v.vek.clone(),
    };
    let err = trust
        .verify(Some(&real), b"ak", b"nonce", SNP_TIME)
        .unwrap_err();
    assert!(
        matches!(err, CpuError::Binding(BindingError::ReportData { .. })),
        "{err:?}"
    );
    // Without the certificate, the cache must supply it; none is configured.
    // A report copied from another node is refused on its binding before
    // any of that is looked for; the vendor's verification alone needs it.
    let no_cert = Evidence {
        certificate: Vec::new(),
        ..real
    };
    let err = trust
        .verify(Some(&no_cert), b"ak", b"nonce", SNP_TIME)
        .unwrap_err();
    assert!(
        matches!(err, CpuError::Binding(BindingError::ReportData { .. })),
        "{err:?}"
    );
    let err = trust.vendor_claims(&no_cert, SNP_TIME).unwrap_err();
    assert!(matches!(err, CpuError::Collateral(_)), "{err:?}");
    // The vtpm variant ignores CPU evidence.
    assert!(CpuTrust::default()
        .verify(Some(&huge), b"ak", b"nonce", SNP_TIME)
        .unwrap()
        .is_none());
}

#[test]
fn the_collateral_cache_supplies_a_vcek_and_tdx_collateral_by_fmspc() {
    use keel_verifier::cpu::{Collateral, CpuClaims, CpuError, CpuPolicy, CpuTrust, Evidence};
    let cache = tempfile::tempdir().unwrap();
    let v = &snp_vectors()[0];
    std::fs::create_dir_all(cache.path().join("snp")).unwrap();
    let chip = hex::encode(snp::parse(&v.report).unwrap().chip_id);
    std::fs::write(
        cache.path().join(format!("snp/vcek-{chip}-3-0-8-115.der")),
        &v.vek,
    )
    .unwrap();
    let trust = CpuTrust::new(
        CpuPolicy::SevSnp(policy_for(v)),
        Collateral::at(cache.path()),
    );
    let evidence = Evidence {
        binding: Binding::Guest,
        report: v.report.clone(),
        certificate: Vec::new(),
    };
    // The VCEK came from the cache: the report verifies.
    assert!(matches!(
        trust.vendor_claims(&evidence, SNP_TIME).unwrap(),
        Some(CpuClaims::Snp(_))
    ));

    let t = &tdx_vectors()[0];
    std::fs::create_dir_all(cache.path().join("tdx")).unwrap();
    std::fs::write(
        cache.path().join("tdx/B0C06F000000.json"),
        data(t.collateral),
    )
    .unwrap();
    let trust = CpuTrust::new(
        CpuPolicy::Tdx(tdx_policy_for(t)),
        Collateral::at(cache.path()),
    );
    let evidence = Evidence {
        binding: Binding::Guest,
        report: data(t.quote),
        certificate: Vec::new(),
    };
    assert!(matches!(
        trust.vendor_claims(&evidence, t.now).unwrap(),
        Some(CpuClaims::Tdx(_))
    ));
    // A quote copied from another node is refused on its binding, before
    // its collateral is read.
    std::fs::remove_file(cache.path().join("tdx/B0C06F000000.json")).unwrap();
    let err = trust
        .verify(Some(&evidence), b"ak", b"nonce", t.now)
        .unwrap_err();
    assert!(matches!(err, CpuError::Binding(_)), "{err:?}");
    // An oversized collateral file is refused before parsing.
    std::fs::write(
        cache.path().join("tdx/B0C06F000000.json"),
        vec![b' '; 300 * 1024],
    )
    .unwrap();
    let err = trust.vendor_claims(&evidence, t.now).unwrap_err();
    assert!(
        matches!(err, CpuError::Collateral(CollateralError::TooLarge { .. })),
        "{err:?}"
    );
}

/// A quote of an SGX enclave, not a TD, is refused as such before its
/// collateral is looked for (none is configured here).
#[test]
fn a_quote_that_is_not_a_tds_is_refused_before_its_collateral() {
    use keel_verifier::cpu::tdx::TdxError;
    use keel_verifier::cpu::{Collateral, CpuError, CpuPolicy, CpuTrust, Evidence};
    let t = &tdx_vectors()[0];
    let td = data(t.quote);
    // A version 4 quote: a 48-byte header, the TD report (584 bytes), then
    // the signature data. An SGX quote has TEE type 0 in its header and a
    // 384-byte enclave report in its place.
    let mut quote = td[..48].to_vec();
    quote[4..8].copy_from_slice(&0u32.to_le_bytes());
    quote.extend_from_slice(&td[48..48 + 384]);
    quote.extend_from_slice(&td[48 + 584..]);
    let claimed = keel_verifier::cpu::tdx::claimed_report_data(&quote);
    assert!(matches!(claimed, Err(TdxError::NotTd)), "{claimed:?}");
    let trust = CpuTrust::new(CpuPolicy::Tdx(tdx_policy_for(t)), Collateral::default());
    let evidence = Evidence {
        binding: Binding::Guest,
        report: quote,
        certificate: Vec::new(),
    };
    let err = trust
        .verify(Some(&evidence), b"ak", b"nonce", t.now)
        .unwrap_err();
    assert!(matches!(err, CpuError::Tdx(TdxError::NotTd)), "{err:?}");
}
