//! The VMPL a SEV-SNP report was requested for, with generated AMD-like
//! roots (no real report comes from a VMPL other than 0 and 1): held to
//! the config's for the guest binding, and to 0, the paravisor's, for
//! Azure's HCL reports whatever the config says.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_testkit::amd::{ReportFields, TestAmd};
use keel_verifier::clock::now;
use keel_verifier::cpu::binding::{Binding, BindingError};
use keel_verifier::cpu::policy::{Hex, Tcb};
use keel_verifier::cpu::snp::{AmdRoots, SnpError};
use keel_verifier::cpu::{Collateral, CpuError, CpuPolicy, CpuTrust, Evidence, SnpPolicy};
use sha2::{Digest as _, Sha256};

const MEASUREMENT: [u8; 48] = [7; 48];

/// A verifier of `amd`'s chips that expects reports for `vmpl`.
fn trust(amd: &TestAmd, vmpl: u32) -> CpuTrust {
    let policy = SnpPolicy {
        vmpl,
        ..SnpPolicy::new(Tcb::from(amd.tcb()), Hex(MEASUREMENT))
    };
    CpuTrust::new(CpuPolicy::SevSnp(policy), Collateral::default())
        .with_snp_roots(AmdRoots::from_pem_bundles(&[amd.roots_pem().as_bytes()]))
}

/// A report for `vmpl` whose report data is `report_data`.
fn report(amd: &TestAmd, vmpl: u32, report_data: [u8; 64]) -> Vec<u8> {
    amd.report(&ReportFields {
        vmpl,
        ..ReportFields::guest(report_data, MEASUREMENT)
    })
    .unwrap()
}

/// An HCL report around `report`: the header, the report at 32, the IGVM
/// request header at 1216 (SNP, SHA-256) and `runtime_data` at 1236.
fn hcl(report: &[u8], runtime_data: &[u8]) -> Vec<u8> {
    let mut blob = b"HCLA".to_vec();
    blob.resize(32, 0);
    blob.extend_from_slice(report);
    let size = u32::try_from(runtime_data.len()).unwrap();
    for word in [20 + size, 1, 2, 1, size] {
        blob.extend_from_slice(&word.to_le_bytes());
    }
    blob.extend_from_slice(runtime_data);
    blob
}

fn evidence(amd: &TestAmd, binding: Binding, report: Vec<u8>) -> Evidence {
    Evidence {
        binding,
        report,
        certificate: amd.vcek_der().to_vec(),
    }
}

/// Attacker's move: guest code at VMPL 2 asks for a report over a blob
/// shaped like the paravisor's, naming a key of its choosing, in a cluster
/// whose guests run at VMPL 2 (under an SVSM). The report is genuine and
/// its VMPL is the config's; as an HCL report it is refused.
#[test]
fn an_hcl_report_must_come_from_vmpl_0_whatever_the_config_names() {
    let amd = TestAmd::new().unwrap();
    let runtime_data = br#"{"keys":[{"kid":"HCLAkPub","kty":"RSA","n":"AQAB","e":"AQAB"}]}"#;
    let mut bound = [0u8; 64];
    bound[..32].copy_from_slice(&Sha256::digest(runtime_data));

    let at_two = trust(&amd, 2);
    let forged = hcl(&report(&amd, 2, bound), runtime_data);
    let err = at_two
        .vendor_claims(&evidence(&amd, Binding::AzureHcl, forged), now())
        .unwrap_err();
    assert!(
        matches!(err, CpuError::Binding(BindingError::HclVmpl { actual: 2 })),
        "{err:?}"
    );
    let CpuError::Binding(cause) = &err else {
        unreachable!()
    };
    assert_eq!(
        cause.to_string(),
        "HCL report vmpl: expected 0 (the paravisor's), actual 2"
    );
    // The same report through the guest binding is the config's level.
    at_two
        .vendor_claims(
            &evidence(&amd, Binding::Guest, report(&amd, 2, bound)),
            now(),
        )
        .unwrap();

    // The paravisor's own report, at VMPL 0, under a config at 0.
    let genuine = hcl(&report(&amd, 0, bound), runtime_data);
    trust(&amd, 0)
        .vendor_claims(&evidence(&amd, Binding::AzureHcl, genuine), now())
        .unwrap();
}

/// Reports for another VMPL than the config's are refused either way: a
/// VMPL-0 guest's config does not take a report for VMPL 1, nor one at 2
/// a report for VMPL 0.
#[test]
fn a_guest_report_for_another_vmpl_than_the_configs_is_refused() {
    let amd = TestAmd::new().unwrap();
    for (configured, requested) in [(0, 1), (2, 0), (2, 3)] {
        let err = trust(&amd, configured)
            .vendor_claims(
                &evidence(&amd, Binding::Guest, report(&amd, requested, [0; 64])),
                now(),
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                CpuError::Snp(SnpError::Vmpl { expected, actual })
                    if expected == configured && actual == requested
            ),
            "{configured}/{requested}: {err:?}"
        );
    }
}
