//! Time to verify CPU evidence per variant, on the real vectors in
//! `../shared/data/cvm`: `cargo run --release -p keel-verifier --example cpu_bench`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::PathBuf;
use std::time::Instant;

use keel_verifier::cpu::binding::HclReport;
use keel_verifier::cpu::collateral::tdx_collateral_file;
use keel_verifier::cpu::policy::{Hex, SnpPolicy, Tcb, TdxPolicy};
use keel_verifier::cpu::snp::{self, AmdRoots};
use keel_verifier::cpu::tdx::{self, IntelRoot};
use keel_verifier::cpu::Binding;

fn data(path: &str) -> Vec<u8> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/cvm");
    std::fs::read(root.join(path)).unwrap()
}

fn hex48(s: &str) -> [u8; 48] {
    let mut out = [0u8; 48];
    hex::decode_to_slice(s, &mut out).unwrap();
    out
}

fn time(name: &str, rounds: u32, mut f: impl FnMut()) {
    f();
    let start = Instant::now();
    for _ in 0..rounds {
        f();
    }
    let each = start.elapsed() / rounds;
    println!("{name:<40} {:>9.3} ms", each.as_secs_f64() * 1e3);
}

fn main() {
    let roots = AmdRoots::pinned();
    let now = 1_763_856_000;

    let report = data("snp/milan-virtee/report_milan.bin");
    let vcek = data("snp/milan-virtee/vcek_milan.der");
    let policy = SnpPolicy::new(
        Tcb { bootloader: 3, tee: 0, snp: 8, microcode: 115 },
        Hex(hex48("7a1e5c266c0108dbc9bb94fa926951320940915d0aafb42464bd88b579ea158d3e1a0dc39b2c60bd95b9c480cd81841f")),
    );
    time("sev-snp (guest report, Milan VCEK)", 50, || {
        let parsed = snp::parse(&report).unwrap();
        snp::verify(&report, &parsed, &vcek, &roots, &policy, now).unwrap();
    });

    let hcl = data("snp/azure-genoa-hcl/hcl-report.bin");
    let der = x509_parser::pem::Pem::iter_from_buffer(&data("snp/azure-genoa-hcl/vcek-genoa.pem"))
        .next()
        .unwrap()
        .unwrap()
        .contents;
    time("sev-snp (Azure HCL, Genoa VCEK + binding)", 50, || {
        let parsed_hcl = HclReport::parse(&hcl).unwrap();
        let parsed = snp::parse(parsed_hcl.report).unwrap();
        let claims = snp::verify_signed(parsed_hcl.report, &parsed, &der, &roots, now).unwrap();
        let _ = Binding::AzureHcl.check(&hcl, &claims.report_data, b"", b"");
        parsed_hcl.attestation_key().unwrap();
    });

    let quote = data("tdx/dcap-qvl/tdx_quote");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/cvm");
    let collateral =
        tdx_collateral_file(&root.join("tdx/dcap-qvl/tdx_quote_collateral.json")).unwrap();
    let tdx_policy = TdxPolicy::new(Hex(hex48("91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7")));
    time("tdx (v4 quote, collateral from cache)", 50, || {
        tdx::verify(
            &quote,
            &collateral,
            &IntelRoot::pinned(),
            &tdx_policy,
            1_752_919_234,
        )
        .unwrap();
    });
    time("tdx (collateral file read + parse)", 50, || {
        tdx_collateral_file(&root.join("tdx/dcap-qvl/tdx_quote_collateral.json")).unwrap();
    });
}
