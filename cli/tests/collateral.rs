//! `keel collateral fetch` against a local server laid out like AMD's KDS
//! and Intel's PCS: real evidence from `shared/data/cvm` and a generated
//! Intel-like PKI; every refusal (collateral that does not verify against
//! the pinned roots now included) leaves the cache untouched. What a fetch
//! writes is checked against the verifier in the unit tests, which can
//! name generated roots.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Output;

use keel_testkit::intel::{CollateralOptions, PcsParts, TdFields, TestIntel, TD_ATTRIBUTES};
use keel_testkit::mirror::{Fault, MirrorServer};
use keel_verifier::clock::now;
use keel_verifier::cpu::collateral::tdx_collateral_file;
use keel_verifier::cpu::policy::{Hex, TdxPolicy};
use keel_verifier::cpu::snp::{self, AmdRoots};
use keel_verifier::cpu::tdx::{self, IntelRoot};
use keel_verifier::cpu::Collateral;

/// The time the real TDX collateral was valid at (see the vectors' README).
const TDX_TIME: u64 = 1_752_919_234;

fn data(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/cvm")
        .join(relative)
}

fn read(relative: &str) -> Vec<u8> {
    std::fs::read(data(relative)).unwrap()
}

fn keel(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every file under `dir`, relative, sorted.
fn files(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(base, &path, out);
            } else {
                out.push(path.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

// ---------------------------------------------------------------- SEV-SNP

const MILAN_CHIP: &str = "d49554ec717f4e5b";

/// KDS for the milan-virtee report: its VCEK, AMD's Milan chain, a CRL.
struct Kds {
    mirror: MirrorServer,
    vcek_target: String,
}

impl Kds {
    fn new() -> Self {
        let mirror = MirrorServer::start().unwrap();
        let report = snp::parse(&read("snp/milan-virtee/report_milan.bin")).unwrap();
        assert!(hex::encode(report.chip_id).starts_with(MILAN_CHIP));
        let vcek_target = format!(
            "/vcek/v1/Milan/{}?blSPL=03&teeSPL=00&snpSPL=08&ucodeSPL=115",
            hex::encode(report.chip_id)
        );
        mirror.serve(&vcek_target, read("snp/milan-virtee/vcek_milan.der"));
        serve_milan_chain(&mirror, "vcek");
        Self {
            mirror,
            vcek_target,
        }
    }

    fn fetch(&self, cache: &Path, extra: &[&str]) -> Output {
        let report = data("snp/milan-virtee/report_milan.bin");
        fetch_snp(&self.mirror, cache, &report, extra)
    }
}

/// Serves AMD's Milan chain for `kind` (`vcek`: the ASK's, `vlek`: the
/// ASVK's) and a stand-in list ([`ark_crl`]) where KDS serves them.
fn serve_milan_chain(mirror: &MirrorServer, kind: &str) {
    let chain = match kind {
        "vlek" => "snp/amd-roots/ask_ark_milan_vlek.pem",
        _ => "snp/amd-roots/ask_ark_milan.pem",
    };
    mirror.serve(&format!("/{kind}/v1/Milan/cert_chain"), read(chain));
    mirror.serve(&format!("/{kind}/v1/Milan/crl"), ark_crl(&[]));
}

/// `keel collateral fetch` into `cache` for the SEV-SNP evidence at
/// `report`, from `mirror` as KDS, with `extra` arguments.
fn fetch_snp(mirror: &MirrorServer, cache: &Path, report: &Path, extra: &[&str]) -> Output {
    let base = mirror.base_url();
    let mut args = vec![
        "collateral",
        "fetch",
        "--cache",
        cache.to_str().unwrap(),
        "--vcek-from-report",
        report.to_str().unwrap(),
        "--kds-url",
        &base,
    ];
    args.extend_from_slice(extra);
    keel(&args)
}

/// A CRL in the name of AMD's Milan ARK listing `revoked` serials, signed
/// by a stand-in key: AMD's own CRL is not among the test vectors, so every
/// fetch of the real vectors ends at the CRL's signature. The fetch with a
/// CRL that verifies (and revokes) runs against a generated look-alike of
/// the Milan chain, in `kds.rs`.
fn ark_crl(revoked: &[Vec<u8>]) -> Vec<u8> {
    let pem = read("snp/amd-roots/ask_ark_milan.pem");
    let ark = x509_parser::pem::Pem::iter_from_buffer(&pem)
        .nth(1)
        .unwrap()
        .unwrap()
        .contents;
    keel_testkit::amd::crl_in_the_name_of(&ark, revoked).unwrap()
}

#[test]
fn a_real_vcek_verifies_and_a_crl_amds_ark_did_not_sign_writes_nothing() {
    let kds = Kds::new();
    let cache = tempfile::tempdir().unwrap();
    let out = kds.fetch(cache.path(), &["--product", "milan"]);
    let log = stderr(&out);
    assert!(!out.status.success(), "accepted: {log}");
    assert!(log.contains(&kds.vcek_target), "{log}");
    assert_eq!(kds.mirror.requests(&kds.vcek_target), 1);
    // The real VCEK verifies the real report against the pinned roots ...
    assert!(
        log.contains("verifies the report against AMD's pinned Milan roots"),
        "{log}"
    );
    // ... and the CRL, named after AMD's Milan ARK, is not signed by it.
    assert!(
        log.contains("AMD Milan CRL: its signature does not verify with the ARK"),
        "{log}"
    );
    assert!(files(cache.path()).is_empty(), "{:?}", files(cache.path()));

    // The VCEK itself, placed where the verifier reads it, is found by the
    // report alone and verifies it offline.
    let report_bytes = read("snp/milan-virtee/report_milan.bin");
    let report = snp::parse(&report_bytes).unwrap();
    let vcek_path = cache
        .path()
        .join(keel_verifier::cpu::collateral::snp_certificate_path(
            &report,
        ));
    assert!(vcek_path.ends_with(format!(
        "snp/vcek-{}-3-0-8-115.der",
        hex::encode(report.chip_id)
    )));
    std::fs::create_dir_all(vcek_path.parent().unwrap()).unwrap();
    std::fs::write(&vcek_path, read("snp/milan-virtee/vcek_milan.der")).unwrap();
    let vcek = Collateral::at(cache.path())
        .snp_certificate(&report)
        .unwrap();
    let claims =
        snp::verify_signed(&report_bytes, &report, &vcek, &AmdRoots::pinned(), now()).unwrap();
    assert_eq!(claims.product, "SEV-Milan");
}

/// The AWS VLEK report: KDS does not serve VLEKs, so the fetch asks for
/// the provider's VLEK in the cache; with it there, it checks the report
/// with the cached VLEK before it fetches the Milan ASVK chain and VLEK
/// CRL. That VLEK expired in 2025 (see the vectors' README): nothing is
/// fetched, and nothing written beside it.
#[test]
fn a_vlek_report_needs_its_vlek_cached_and_an_expired_one_writes_nothing() {
    let mirror = MirrorServer::start().unwrap();
    serve_milan_chain(&mirror, "vlek");
    let cache = tempfile::tempdir().unwrap();
    let report = data("snp/aws-milan-vlek/test-vlek-report.bin");
    let fetch = || fetch_snp(&mirror, cache.path(), &report, &[]);
    let out = fetch();
    let log = stderr(&out);
    assert!(!out.status.success(), "accepted: {log}");
    assert!(log.contains("signed by a VLEK"), "{log}");
    assert_eq!(mirror.requests("/vlek/v1/Milan/cert_chain"), 0, "{log}");
    assert_eq!(mirror.requests("/vlek/v1/Milan/crl"), 0, "{log}");
    assert!(files(cache.path()).is_empty(), "{:?}", files(cache.path()));

    let parsed = snp::parse(&read("snp/aws-milan-vlek/test-vlek-report.bin")).unwrap();
    let relative = keel_verifier::cpu::collateral::snp_certificate_path(&parsed);
    let vlek_path = cache.path().join(&relative);
    std::fs::create_dir_all(vlek_path.parent().unwrap()).unwrap();
    std::fs::write(&vlek_path, read("snp/aws-milan-vlek/test-vlek.der")).unwrap();
    let out = fetch();
    let log = stderr(&out);
    assert!(!out.status.success(), "accepted: {log}");
    // The VLEK is checked before anything is fetched for it.
    assert_eq!(mirror.requests("/vlek/v1/Milan/cert_chain"), 0, "{log}");
    assert_eq!(mirror.requests("/vlek/v1/Milan/crl"), 0, "{log}");
    assert!(
        log.contains("the cached VLEK does not verify the report against AMD's pinned roots"),
        "{log}"
    );
    assert!(
        log.contains("SNP endorsement key certificate valid"),
        "{log}"
    );
    assert_eq!(files(cache.path()), [relative], "only the VLEK placed");
}

#[test]
fn a_vcek_fetch_that_does_not_check_out_writes_nothing() {
    let refused = |kds: &Kds, extra: &[&str], expected: &str| {
        let cache = tempfile::tempdir().unwrap();
        let out = kds.fetch(cache.path(), extra);
        let log = stderr(&out);
        assert!(!out.status.success(), "accepted: {log}");
        assert!(log.contains(expected), "expected {expected:?} in: {log}");
        assert!(files(cache.path()).is_empty(), "{:?}", files(cache.path()));
    };
    let milan = ["--product", "milan"];

    // A version 2 report does not say which product line it is from.
    refused(&Kds::new(), &[], "pass --product");

    // The VCEK of another chip.
    let kds = Kds::new();
    kds.mirror
        .serve(&kds.vcek_target, read("snp/milan-gosevguest/vcek.der"));
    refused(&kds, &milan, "does not verify the report");

    // A chain that is not AMD's pinned Milan chain.
    let kds = Kds::new();
    kds.mirror.serve(
        "/vcek/v1/Milan/cert_chain",
        read("snp/amd-roots/ask_ark_genoa.pem"),
    );
    refused(
        &kds,
        &milan,
        "cert_chain: expected AMD's pinned ASK and ARK for Milan",
    );

    // A CRL that would revoke the VCEK, from a key that is not AMD's ARK:
    // its signature is checked before its entries.
    let kds = Kds::new();
    let vcek = read("snp/milan-virtee/vcek_milan.der");
    let (_, parsed) = x509_parser::parse_x509_certificate(&vcek).unwrap();
    kds.mirror.serve(
        "/vcek/v1/Milan/crl",
        ark_crl(&[parsed.raw_serial().to_vec()]),
    );
    refused(&kds, &milan, "its signature does not verify with the ARK");

    // Not a CRL.
    let kds = Kds::new();
    kds.mirror.serve("/vcek/v1/Milan/crl", &b"<html>"[..]);
    refused(&kds, &milan, "Milan CRL: does not parse");

    // KDS does not know the chip and TCB.
    let kds = Kds::new();
    kds.mirror.fail_always(&kds.vcek_target, Fault::Status(404));
    refused(&kds, &milan, "the server answered 404");

    // A VCEK larger than any certificate.
    let kds = Kds::new();
    kds.mirror.serve(&kds.vcek_target, vec![0x30; 9000]);
    refused(&kds, &milan, "larger than 8192 bytes");

    // A server that never answers, within the timeout.
    let kds = Kds::new();
    kds.mirror.fail_always(&kds.vcek_target, Fault::Hang);
    let started = std::time::Instant::now();
    refused(
        &kds,
        &["--product", "milan", "--timeout", "1"],
        "no complete answer within 1s",
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));

    // Nothing listens.
    let kds = Kds::new();
    let cache = tempfile::tempdir().unwrap();
    let report = data("snp/milan-virtee/report_milan.bin");
    let out = keel(&[
        "collateral",
        "fetch",
        "--cache",
        cache.path().to_str().unwrap(),
        "--vcek-from-report",
        report.to_str().unwrap(),
        "--product",
        "milan",
        "--kds-url",
        "http://127.0.0.1:1",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("GET http://127.0.0.1:1/vcek/v1/Milan/"),
        "{}",
        stderr(&out)
    );
    drop(kds);
}

#[test]
fn an_azure_hcl_report_names_its_vcek_through_the_snp_report_inside() {
    let mirror = MirrorServer::start().unwrap();
    let hcl = read("snp/azure-milan-hcl/hcl-report.bin");
    let report = snp::parse(&hcl[32..1216]).unwrap();
    let chain = read("snp/azure-milan-hcl/vcek-chain.pem");
    let vcek = x509_parser::pem::Pem::iter_from_buffer(&chain)
        .next()
        .unwrap()
        .unwrap()
        .contents;
    let t = report.reported_tcb;
    mirror.serve(
        &format!(
            "/vcek/v1/Milan/{}?blSPL={:02}&teeSPL={:02}&snpSPL={:02}&ucodeSPL={:02}",
            hex::encode(report.chip_id),
            t.bootloader,
            t.tee,
            t.snp,
            t.microcode
        ),
        vcek,
    );
    serve_milan_chain(&mirror, "vcek");
    let cache = tempfile::tempdir().unwrap();
    let path = data("snp/azure-milan-hcl/hcl-report.bin");
    let out = fetch_snp(&mirror, cache.path(), &path, &["--product", "milan"]);
    // The VCEK named through the SNP report inside verifies it; the
    // stand-in CRL then stops the fetch.
    let log = stderr(&out);
    assert!(!out.status.success(), "accepted: {log}");
    assert!(
        log.contains("verifies the report against AMD's pinned Milan roots"),
        "{log}"
    );
    assert!(
        log.contains("its signature does not verify with the ARK"),
        "{log}"
    );
    assert!(files(cache.path()).is_empty());
}

// ---------------------------------------------------------------- TDX

fn fetch_tdx(mirror: &MirrorServer, cache: &Path, quote: &Path) -> Output {
    let base = mirror.base_url();
    let root_crl = mirror.url("/IntelSGXRootCA.der");
    keel(&[
        "collateral",
        "fetch",
        "--cache",
        cache.to_str().unwrap(),
        "--tdx-quote",
        quote.to_str().unwrap(),
        "--pcs-url",
        &base,
        "--root-ca-crl-url",
        &root_crl,
        "--timeout",
        "5",
    ])
}

/// A good entry already in the cache, where the fetch would write.
fn planted_entry(cache: &Path, fmspc: &str) -> (PathBuf, Vec<u8>) {
    let path = cache.join(format!("tdx/{fmspc}-platform.json"));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let good = br#"{"the":"good collateral"}"#.to_vec();
    std::fs::write(&path, &good).unwrap();
    (path, good)
}

#[test]
fn real_collateral_that_has_expired_is_refused_and_the_cache_entry_kept() {
    let original: serde_json::Value =
        serde_json::from_slice(&read("tdx/dcap-qvl/tdx_quote_collateral.json")).unwrap();
    let mirror = MirrorServer::start().unwrap();
    PcsParts::from_collateral_json(&original)
        .unwrap()
        .serve(&mirror, "B0C06F000000", "platform");
    let cache = tempfile::tempdir().unwrap();
    let (entry, good) = planted_entry(cache.path(), "B0C06F000000");
    let out = fetch_tdx(&mirror, cache.path(), &data("tdx/dcap-qvl/tdx_quote"));
    let log = stderr(&out);
    // Genuine, but expired: the quote does not verify with it now, as a
    // verifier would find; the entry in the cache is kept.
    assert!(!out.status.success(), "accepted: {log}");
    assert!(log.contains("FMSPC B0C06F000000"), "{log}");
    assert!(
        log.contains("the quote does not verify with the served collateral against Intel's root now, so nothing was written"),
        "{log}"
    );
    assert!(log.contains("TDX collateral time"), "{log}");
    assert_eq!(std::fs::read(&entry).unwrap(), good);
    assert_eq!(files(cache.path()), ["tdx/B0C06F000000-platform.json"]);
    // (The same collateral verifies the quote offline at a time it was
    // valid: `collateral::pcs` unit tests.)
    let quote = read("tdx/dcap-qvl/tdx_quote");
    let policy = TdxPolicy::new(Hex(hex::decode("91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7").unwrap().try_into().unwrap()));
    let collateral = tdx_collateral_file(&data("tdx/dcap-qvl/tdx_quote_collateral.json")).unwrap();
    let claims = tdx::verify(&quote, &collateral, &IntelRoot::pinned(), &policy, TDX_TIME).unwrap();
    assert_eq!(claims.status, "UpToDate");
}

#[test]
fn fetching_tdx_collateral_for_a_generated_platform_and_refusals() {
    let intel = TestIntel::new().unwrap();
    let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
    let parts =
        PcsParts::from_collateral_json(&serde_json::from_str(&collateral.to_json()).unwrap())
            .unwrap();
    let fields = TdFields {
        td_attributes: TD_ATTRIBUTES,
        mrtd: [1; 48],
        rtmr: [[0; 48]; 4],
        report_data: [2; 64],
    };
    let dir = tempfile::tempdir().unwrap();
    let quote_path = dir.path().join("quote");
    let quote = intel.quote(&fields).unwrap();
    std::fs::write(&quote_path, &quote).unwrap();
    let fmspc = intel.fmspc_hex();

    // Current collateral that verifies the quote, but against a generated
    // root, not Intel's: a PCS (--pcs-url) serving it overwrites nothing.
    let root = IntelRoot::from_der(intel.root_der().to_vec());
    let policy = TdxPolicy::new(Hex([1; 48]));
    let served = dir.path().join("served.json");
    std::fs::write(&served, collateral.to_json()).unwrap();
    let served = tdx_collateral_file(&served).unwrap();
    let claims = tdx::verify(&quote, &served, &root, &policy, now());
    assert_eq!(claims.unwrap().status, "UpToDate");
    let mirror = MirrorServer::start().unwrap();
    parts.serve(&mirror, &fmspc, "platform");
    let cache = tempfile::tempdir().unwrap();
    let (entry, good) = planted_entry(cache.path(), &fmspc);
    let out = fetch_tdx(&mirror, cache.path(), &quote_path);
    let log = stderr(&out);
    assert!(!out.status.success(), "accepted: {log}");
    assert!(log.contains("nothing was written"), "{log}");
    assert!(log.contains("TDX "), "{log}");
    assert_eq!(std::fs::read(&entry).unwrap(), good);
    assert_eq!(files(cache.path()), [format!("tdx/{fmspc}-platform.json")]);

    let refused = |mirror: &MirrorServer, expected: &str| {
        let cache = tempfile::tempdir().unwrap();
        let out = fetch_tdx(mirror, cache.path(), &quote_path);
        let log = stderr(&out);
        assert!(!out.status.success(), "accepted: {log}");
        assert!(log.contains(expected), "expected {expected:?} in: {log}");
        assert!(files(cache.path()).is_empty());
    };

    // TCB info for another platform, served under this FMSPC.
    let other = TestIntel::for_platform(keel_testkit::intel::Platform {
        fmspc: [0x90, 0xc0, 0x6f, 0, 0, 0],
        ..intel.platform()
    })
    .unwrap();
    let theirs = other.collateral(&CollateralOptions::default()).unwrap();
    let mirror = MirrorServer::start().unwrap();
    PcsParts {
        tcb_info: theirs.tcb_info.clone(),
        ..PcsParts::from_collateral_json(&serde_json::from_str(&collateral.to_json()).unwrap())
            .unwrap()
    }
    .serve(&mirror, &fmspc, "platform");
    refused(
        &mirror,
        &format!("TCB info fmspc: expected {fmspc}, actual 90C06F000000"),
    );

    // The issuer chain header is missing.
    let mirror = MirrorServer::start().unwrap();
    parts.serve(&mirror, &fmspc, "platform");
    mirror.serve_with_headers(
        &format!("/tdx/certification/v4/tcb?fmspc={fmspc}"),
        format!(
            r#"{{"tcbInfo":{},"signature":"{}"}}"#,
            parts.tcb_info, parts.tcb_info_signature
        ),
        &[],
    );
    refused(&mirror, "has no TCB-Info-Issuer-Chain header");

    // The service is unavailable.
    let mirror = MirrorServer::start().unwrap();
    parts.serve(&mirror, &fmspc, "platform");
    mirror.fail_always("/tdx/certification/v4/qe/identity", Fault::Status(503));
    refused(&mirror, "the server answered 503");

    // A TCB info answer beyond the bound.
    let mirror = MirrorServer::start().unwrap();
    parts.serve(&mirror, &fmspc, "platform");
    mirror.serve_with_headers(
        &format!("/tdx/certification/v4/tcb?fmspc={fmspc}"),
        vec![b' '; 200 * 1024],
        &[("TCB-Info-Issuer-Chain", "x")],
    );
    refused(&mirror, "larger than 131072 bytes");

    // Not a CRL where the root CA's CRL should be.
    let mirror = MirrorServer::start().unwrap();
    parts.serve(&mirror, &fmspc, "platform");
    mirror.serve("/IntelSGXRootCA.der", &b"not a crl"[..]);
    refused(&mirror, "root CA CRL: neither a DER CRL nor hex");
}

#[test]
fn the_fetch_command_explains_itself() {
    let out = keel(&["collateral", "fetch", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--vcek-from-report",
        "--tdx-quote",
        "https://kdsintf.amd.com",
        "https://api.trustedservices.intel.com",
        "snp/vcek-<chip>-<bl>-<tee>-<snp>-<ucode>.der",
        "tdx/<FMSPC>-<CA>.json",
        "/var/lib/keel/collateral",
        // Nodes take no cache yet: the help must not tell operators to
        // copy one there.
        "Nodes do not take it yet",
    ] {
        assert!(help.contains(needle), "{needle} missing from: {help}");
    }
    // Exactly one kind of evidence.
    let out = keel(&["collateral", "fetch", "--cache", "/nonexistent"]);
    assert!(!out.status.success());
}
