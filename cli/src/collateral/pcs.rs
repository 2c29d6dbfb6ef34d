//! Intel's Provisioning Certification Service (API v4): the TCB info for a
//! TDX quote's FMSPC, the TD quoting enclave's identity, the CRL of the CA
//! that issued the quote's PCK certificate, and the root CA's CRL,
//! assembled into the `QuoteCollateralV3` file the verifier reads. The
//! signed TCB info and QE identity are kept byte for byte as served. The
//! quote must verify with the assembled collateral against Intel's root
//! now (the verifier's own check) before anything is written.

use dcap_qvl::quote::Quote;
use dcap_qvl::QuoteCollateralV3;
use keel_verifier::cpu::collateral::{
    earlier_tdx_collateral_path, pck_platform, tdx_collateral_path, MAX_COLLATERAL_BYTES,
};
use keel_verifier::cpu::policy::{Hex, TdxPolicy};
use keel_verifier::cpu::tdx::{self, IntelRoot, TdxError};
use serde::Deserialize;
use serde_json::value::RawValue;
use x509_parser::prelude::FromDer as _;
use x509_parser::revocation_list::CertificateRevocationList;

use super::http::{decoded_header, Answer, Http, HttpError};
use super::{CacheFile, Kind};
use crate::printable::printable;

/// Intel's PCS.
pub const DEFAULT_URL: &str = "https://api.trustedservices.intel.com";
/// Where Intel publishes the SGX root CA's CRL (PCS has no endpoint for it).
pub const DEFAULT_ROOT_CA_CRL_URL: &str =
    "https://certificates.trustedservices.intel.com/IntelSGXRootCA.der";

/// Largest TCB info, QE identity or CRL answer accepted.
const MAX_ANSWER_BYTES: usize = 128 * 1024;

/// Why the TDX collateral could not be fetched or was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PcsError {
    /// The quote does not parse, or names no FMSPC or PCK CA.
    #[error("the TDX quote: {0}")]
    Quote(String),
    /// A download failed.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// An answer lacks the header with its issuer chain.
    #[error("{what}: the answer has no {header} header (a URL-encoded PEM chain)")]
    Header {
        /// What was fetched.
        what: &'static str,
        /// The header expected.
        header: &'static str,
    },
    /// An answer's body does not parse.
    #[error("{what}: {reason}")]
    Body {
        /// What was fetched.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A field of the served collateral is not what the quote needs.
    #[error("{what} {field}: expected {expected}, actual {actual}")]
    Field {
        /// What was fetched.
        what: &'static str,
        /// The field.
        field: &'static str,
        /// What the quote needs.
        expected: String,
        /// What was served.
        actual: String,
    },
    /// The assembled file would be larger than the verifier reads.
    #[error(
        "the collateral is {actual} bytes, more than the verifier reads ({MAX_COLLATERAL_BYTES})"
    )]
    TooLarge {
        /// Its size.
        actual: usize,
    },
    /// The quote does not verify with the served collateral against the
    /// Intel root now: verifiers would refuse it, so it is not cached.
    #[error("the quote does not verify with the served collateral against Intel's root now, so nothing was written (a verifier would refuse it; check --pcs-url and fetch again): {0}")]
    Unverified(TdxError),
}

/// A PCS answer holding one signed JSON object and its signature.
#[derive(Deserialize)]
struct Signed<'a> {
    #[serde(borrow, alias = "tcbInfo", alias = "enclaveIdentity")]
    object: &'a RawValue,
    signature: String,
}

/// Fetches the collateral for `quote` from the PCS at `base` (and the root
/// CA's CRL from `root_ca_crl_url`); returns it only if the quote verifies
/// with it against `root` at `now`.
pub async fn fetch(
    http: &Http,
    base: &str,
    root_ca_crl_url: &str,
    quote: &[u8],
    now: u64,
    root: &IntelRoot,
) -> Result<Vec<CacheFile>, PcsError> {
    let parsed = Quote::parse(quote).map_err(|e| PcsError::Quote(format!("{e:#}")))?;
    let mrtd = parsed
        .report
        .as_td10()
        .map(|td| td.mr_td)
        .ok_or_else(|| PcsError::Quote("carries no TD report".into()))?;
    let (fmspc, pck_ca) = pck_platform(&parsed).map_err(|e| PcsError::Quote(e.to_string()))?;
    let ca = pck_ca.as_id_str();
    let fmspc_hex = hex::encode_upper(fmspc);
    eprintln!("keel: TDX quote, FMSPC {fmspc_hex}, PCK certificate issued by the {ca} CA");

    let base = base.trim_end_matches('/');
    let tcb = super::get(
        http,
        "TCB info",
        &format!("{base}/tdx/certification/v4/tcb?fmspc={fmspc_hex}"),
        MAX_ANSWER_BYTES,
    )
    .await?;
    let qe = super::get(
        http,
        "QE identity",
        &format!("{base}/tdx/certification/v4/qe/identity"),
        MAX_ANSWER_BYTES,
    )
    .await?;
    let pck_crl = super::get(
        http,
        "PCK CRL",
        &format!("{base}/sgx/certification/v4/pckcrl?ca={ca}&encoding=der"),
        MAX_ANSWER_BYTES,
    )
    .await?;
    let root_crl = super::get(http, "root CA CRL", root_ca_crl_url, MAX_ANSWER_BYTES).await?;

    let (tcb_info, tcb_info_signature) = signed("TCB info", &tcb.body)?;
    let (qe_identity, qe_identity_signature) = signed("QE identity", &qe.body)?;
    expect_field("TCB info", &tcb_info, "id", "TDX")?;
    expect_field("TCB info", &tcb_info, "fmspc", &fmspc_hex)?;
    expect_field("QE identity", &qe_identity, "id", "TD_QE")?;

    let collateral = QuoteCollateralV3 {
        pck_crl_issuer_chain: chain(&pck_crl, "PCK CRL", &["SGX-PCK-CRL-Issuer-Chain"])?,
        root_ca_crl: crl("root CA CRL", &root_crl.body)?,
        pck_crl: crl("PCK CRL", &pck_crl.body)?,
        tcb_info_issuer_chain: chain(
            &tcb,
            "TCB info",
            &["TCB-Info-Issuer-Chain", "SGX-TCB-Info-Issuer-Chain"],
        )?,
        tcb_info,
        tcb_info_signature,
        qe_identity_issuer_chain: chain(
            &qe,
            "QE identity",
            &["SGX-Enclave-Identity-Issuer-Chain"],
        )?,
        qe_identity,
        qe_identity_signature,
        pck_certificate_chain: None,
    };
    let json = serde_json::to_vec(&collateral).map_err(|e| PcsError::Body {
        what: "collateral",
        reason: e.to_string(),
    })?;
    if json.len() as u64 > MAX_COLLATERAL_BYTES {
        return Err(PcsError::TooLarge { actual: json.len() });
    }
    for (what, text) in [
        ("TCB info", &collateral.tcb_info),
        ("QE identity", &collateral.qe_identity),
    ] {
        let window = |field| {
            serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| v.get(field).and_then(|d| d.as_str()).map(str::to_owned))
                .unwrap_or_default()
        };
        eprintln!(
            "keel: {what} issued {}, next update {}",
            printable(&window("issueDate")),
            printable(&window("nextUpdate"))
        );
    }
    check(quote, &collateral, mrtd, root, now)?;
    Ok(vec![CacheFile::new(
        tdx_collateral_path(&fmspc, pck_ca),
        json,
        Kind::TdxCollateral,
    )
    .or_earlier_at(earlier_tdx_collateral_path(&fmspc))])
}

/// The verifier's check of `quote` with `collateral` (the quote's own MRTD,
/// no RTMRs): the collateral is good when the DCAP verification passes,
/// whatever the TCB status or TD attributes the verifier's policy then
/// judges.
fn check(
    quote: &[u8],
    collateral: &QuoteCollateralV3,
    mrtd: [u8; 48],
    root: &IntelRoot,
    now: u64,
) -> Result<(), PcsError> {
    let policy = TdxPolicy::new(Hex(mrtd));
    let verdict = "keel: the quote verifies with this collateral against Intel's root now";
    match tdx::verify(quote, collateral, root, &policy, now) {
        Ok(claims) => eprintln!("{verdict}: TCB status {}", claims.status),
        Err(TdxError::TcbStatus {
            actual, advisories, ..
        }) => eprintln!(
            "{verdict}: TCB status {actual} (advisories {advisories:?}); verifiers accept it only if cluster.attestation allows it"
        ),
        Err(TdxError::Debug) => {
            eprintln!("{verdict}; note: the TD is debuggable, which verifiers refuse")
        }
        Err(e) => return Err(PcsError::Unverified(e)),
    }
    Ok(())
}

/// The signed object's exact text and its raw `r || s` signature.
fn signed(what: &'static str, body: &[u8]) -> Result<(String, Vec<u8>), PcsError> {
    let bad = |reason: String| PcsError::Body { what, reason };
    let answer: Signed<'_> =
        serde_json::from_slice(body).map_err(|e| bad(format!("not the expected JSON: {e}")))?;
    let signature =
        hex::decode(&answer.signature).map_err(|e| bad(format!("signature is not hex: {e}")))?;
    if signature.len() != 64 {
        return Err(PcsError::Field {
            what,
            field: "signature",
            expected: "64 bytes (ECDSA P-256 r || s)".into(),
            actual: format!("{} bytes", signature.len()),
        });
    }
    Ok((answer.object.get().to_owned(), signature))
}

/// A string field of a signed object must be `expected` (ignoring case).
fn expect_field(
    what: &'static str,
    object: &str,
    field: &'static str,
    expected: &str,
) -> Result<(), PcsError> {
    let value: serde_json::Value = serde_json::from_str(object).map_err(|e| PcsError::Body {
        what,
        reason: e.to_string(),
    })?;
    let actual = value
        .get(field)
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    if !actual.eq_ignore_ascii_case(expected) {
        return Err(PcsError::Field {
            what,
            field,
            expected: expected.to_owned(),
            actual: printable(actual).to_string(),
        });
    }
    Ok(())
}

/// The issuer chain from the first of `headers` present: PEM holding at
/// least one certificate.
fn chain(
    answer: &Answer,
    what: &'static str,
    headers: &[&'static str],
) -> Result<String, PcsError> {
    let header = headers.first().copied().unwrap_or_default();
    let pem = headers
        .iter()
        .find_map(|h| decoded_header(&answer.headers, h))
        .ok_or(PcsError::Header { what, header })?;
    let certificates = x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes())
        .filter(|p| p.as_ref().is_ok_and(|p| p.label == "CERTIFICATE"))
        .count();
    if certificates == 0 {
        return Err(PcsError::Body {
            what,
            reason: format!("the {header} header holds no PEM certificate"),
        });
    }
    Ok(pem)
}

/// A CRL served as DER (PCS with `encoding=der`, Intel's certificate site)
/// or as hex (a PCCS); it must parse.
fn crl(what: &'static str, body: &[u8]) -> Result<Vec<u8>, PcsError> {
    let der = if body.first() == Some(&0x30) {
        body.to_vec()
    } else {
        let text = std::str::from_utf8(body).unwrap_or_default().trim();
        hex::decode(text).map_err(|_| PcsError::Body {
            what,
            reason: "neither a DER CRL nor hex".into(),
        })?
    };
    CertificateRevocationList::from_der(&der).map_err(|e| PcsError::Body {
        what,
        reason: format!("does not parse as a CRL: {e}"),
    })?;
    Ok(der)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use keel_testkit::intel::{
        CollateralOptions, PcsParts, TdFields, TdxCollateral, TestIntel, TD_ATTRIBUTES,
    };
    use keel_testkit::mirror::MirrorServer;
    use keel_verifier::cpu::Collateral;

    /// The time the real TDX collateral was valid at (see the vectors' README).
    const TDX_TIME: u64 = 1_752_919_234;

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    fn fetch_from(
        mirror: &MirrorServer,
        quote: &[u8],
        now: u64,
        root: &IntelRoot,
    ) -> Result<Vec<CacheFile>, PcsError> {
        let http = Http::new(std::time::Duration::from_secs(10)).unwrap();
        super::super::block_on(fetch(
            &http,
            &mirror.base_url(),
            &mirror.url("/IntelSGXRootCA.der"),
            quote,
            now,
            root,
        ))
    }

    /// The TD report of the generated quotes.
    fn fields() -> TdFields {
        TdFields {
            td_attributes: TD_ATTRIBUTES,
            mrtd: [1; 48],
            rtmr: [[0; 48]; 4],
            report_data: [2; 64],
        }
    }

    /// A generated platform, its quote, and a PCS serving its collateral.
    fn generated(options: &CollateralOptions) -> (TestIntel, Vec<u8>, MirrorServer) {
        let intel = TestIntel::new().unwrap();
        let collateral = intel.collateral(options).unwrap();
        let quote = intel.quote(&fields()).unwrap();
        let mirror = MirrorServer::start().unwrap();
        serve(&mirror, &intel, &collateral);
        (intel, quote, mirror)
    }

    /// Serves `collateral` of `intel`'s platform from `mirror`, as a PCS.
    fn serve(mirror: &MirrorServer, intel: &TestIntel, collateral: &TdxCollateral) {
        let json = serde_json::from_str(&collateral.to_json()).unwrap();
        PcsParts::from_collateral_json(&json).unwrap().serve(
            mirror,
            &intel.fmspc_hex(),
            "platform",
        );
    }

    /// The policy a verifier of the generated quote holds.
    fn policy(mrtd: [u8; 48]) -> TdxPolicy {
        TdxPolicy::new(Hex(mrtd))
    }

    /// Writes `files` into a new cache directory.
    fn cache_of(files: &[CacheFile]) -> tempfile::TempDir {
        let cache = tempfile::tempdir().unwrap();
        super::super::write_all(cache.path(), files).unwrap();
        cache
    }

    #[test]
    fn collateral_that_verifies_with_the_root_is_returned_where_the_verifier_reads_it() {
        let (intel, quote, mirror) = generated(&CollateralOptions::default());
        let root = IntelRoot::from_der(intel.root_der().to_vec());
        let files = fetch_from(&mirror, &quote, now(), &root).unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(
            files[0].relative,
            format!("tdx/{}-platform.json", intel.fmspc_hex())
        );
        let cache = cache_of(&files);
        let cached = Collateral::at(cache.path()).tdx_collateral(&quote).unwrap();
        let claims = tdx::verify(&quote, &cached, &root, &policy([1; 48]), now()).unwrap();
        assert_eq!(claims.status, "UpToDate");
    }

    /// Intel certifies some platforms of an FMSPC by its platform CA and
    /// some by its processor CA; each CA's collateral carries its own PCK
    /// CRL. Fetched into one cache, neither overwrites the other.
    #[test]
    fn platforms_of_one_fmspc_under_both_cas_keep_their_own_collateral() {
        let by_platform_ca = TestIntel::new().unwrap();
        let by_processor_ca = by_platform_ca.under_processor_ca().unwrap();
        let root = IntelRoot::from_der(by_platform_ca.root_der().to_vec());
        let cache = tempfile::tempdir().unwrap();
        let mut quotes = Vec::new();
        for intel in [&by_platform_ca, &by_processor_ca] {
            let collateral = intel.collateral(&CollateralOptions::default()).unwrap();
            let json = serde_json::from_str(&collateral.to_json()).unwrap();
            let mirror = MirrorServer::start().unwrap();
            PcsParts::from_collateral_json(&json).unwrap().serve(
                &mirror,
                &intel.fmspc_hex(),
                intel.pck_issuer().id(),
            );
            let quote = intel.quote(&fields()).unwrap();
            let files = fetch_from(&mirror, &quote, now(), &root).unwrap();
            let ca = intel.pck_issuer().id();
            assert_eq!(
                files[0].relative,
                format!("tdx/{}-{ca}.json", intel.fmspc_hex())
            );
            super::super::store(cache.path(), &files).unwrap();
            quotes.push(quote);
        }
        for quote in &quotes {
            let cached = Collateral::at(cache.path()).tdx_collateral(quote).unwrap();
            let claims = tdx::verify(quote, &cached, &root, &policy([1; 48]), now()).unwrap();
            assert_eq!(claims.status, "UpToDate");
        }
    }

    #[test]
    fn an_out_of_date_tcb_still_caches_its_collateral() {
        // The collateral is good; whether OutOfDate is accepted is the
        // verifier's policy.
        let (intel, quote, mirror) = generated(&CollateralOptions {
            platform_status: "OutOfDate".into(),
            ..CollateralOptions::default()
        });
        let root = IntelRoot::from_der(intel.root_der().to_vec());
        assert_eq!(fetch_from(&mirror, &quote, now(), &root).unwrap().len(), 1);
    }

    /// Collateral of the generated platform issued `days` ago, signed and
    /// current, as a fetch from `mirror` returns it.
    fn issued_days_ago(
        days: i64,
        intel: &TestIntel,
        quote: &[u8],
        mirror: &MirrorServer,
    ) -> Vec<CacheFile> {
        let older = intel
            .collateral(&CollateralOptions {
                issued: time::OffsetDateTime::now_utc() - time::Duration::days(days),
                ..CollateralOptions::default()
            })
            .unwrap();
        serve(mirror, intel, &older);
        let root = IntelRoot::from_der(intel.root_der().to_vec());
        fetch_from(mirror, quote, now(), &root).unwrap()
    }

    #[test]
    fn collateral_older_than_the_cached_one_is_refused_and_the_cache_kept() {
        let (intel, quote, mirror) = generated(&CollateralOptions::default());
        let root = IntelRoot::from_der(intel.root_der().to_vec());
        let cache = tempfile::tempdir().unwrap();
        let newer = fetch_from(&mirror, &quote, now(), &root).unwrap();
        super::super::store(cache.path(), &newer).unwrap();
        let path = cache.path().join(&newer[0].relative);

        // Collateral of the same platform issued five days ago, signed and
        // current: the fetch's checks pass it, the cache refuses it.
        let e = format!(
            "{:#}",
            super::super::store(cache.path(), &issued_days_ago(5, &intel, &quote, &mirror))
                .unwrap_err()
        );
        assert!(
            e.contains("its TCB info's issueDate is") && e.contains("older than the cached one's"),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), newer[0].bytes);

        // The same collateral again is taken.
        super::super::store(cache.path(), &newer).unwrap();
    }

    /// A cache filled by an earlier version holds the collateral under the
    /// FMSPC's name alone, which verifiers read while the CA's own file is
    /// missing: older collateral is refused as if it were at the CA's name,
    /// and the cache kept as it was.
    #[test]
    fn collateral_older_than_the_one_under_the_earlier_name_is_refused() {
        let (intel, quote, mirror) = generated(&CollateralOptions::default());
        let root = IntelRoot::from_der(intel.root_der().to_vec());
        let newer = fetch_from(&mirror, &quote, now(), &root).unwrap();
        let cache = tempfile::tempdir().unwrap();
        let earlier = cache.path().join(format!("tdx/{}.json", intel.fmspc_hex()));
        std::fs::create_dir_all(earlier.parent().unwrap()).unwrap();
        std::fs::write(&earlier, &newer[0].bytes).unwrap();

        let files = issued_days_ago(5, &intel, &quote, &mirror);
        let e = format!(
            "{:#}",
            super::super::store(cache.path(), &files).unwrap_err()
        );
        assert!(
            e.contains("its TCB info's issueDate is")
                && e.contains(&format!("remove {}", earlier.display())),
            "{e}"
        );
        assert_eq!(std::fs::read(&earlier).unwrap(), newer[0].bytes);
        assert!(!cache.path().join(&files[0].relative).exists());
        // Collateral as new as it is taken.
        super::super::store(cache.path(), &newer).unwrap();
    }

    #[test]
    fn collateral_that_does_not_verify_is_refused() {
        // Signed by a root that is not Intel's.
        let (intel, quote, mirror) = generated(&CollateralOptions::default());
        let e = fetch_from(&mirror, &quote, now(), &IntelRoot::pinned()).unwrap_err();
        assert!(matches!(e, PcsError::Unverified(_)), "{e}");
        assert!(e.to_string().contains("nothing was written"), "{e}");

        // Signed by another generated root.
        let other = TestIntel::new().unwrap();
        let root = IntelRoot::from_der(other.root_der().to_vec());
        let e = fetch_from(&mirror, &quote, now(), &root).unwrap_err();
        assert!(matches!(e, PcsError::Unverified(_)), "{e}");

        // Expired.
        let now_utc = time::OffsetDateTime::now_utc();
        let (intel2, quote2, mirror2) = generated(&CollateralOptions {
            issued: now_utc - time::Duration::days(30),
            next_update: now_utc - time::Duration::days(1),
            ..CollateralOptions::default()
        });
        let root2 = IntelRoot::from_der(intel2.root_der().to_vec());
        let e = fetch_from(&mirror2, &quote2, now(), &root2).unwrap_err();
        assert!(
            e.to_string().contains("TDX collateral time"),
            "expired collateral: {e}"
        );

        // The PCK certificate revoked.
        let (intel3, quote3, mirror3) = generated(&CollateralOptions {
            revoke_pck: true,
            ..CollateralOptions::default()
        });
        let root3 = IntelRoot::from_der(intel3.root_der().to_vec());
        let e = fetch_from(&mirror3, &quote3, now(), &root3).unwrap_err();
        assert!(matches!(e, PcsError::Unverified(_)), "{e}");
        drop(intel);
    }

    #[test]
    fn real_collateral_verifies_a_real_quote_at_its_time_and_is_refused_now() {
        let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/data/cvm/tdx/dcap-qvl");
        let original: serde_json::Value =
            serde_json::from_slice(&std::fs::read(data.join("tdx_quote_collateral.json")).unwrap())
                .unwrap();
        let quote = std::fs::read(data.join("tdx_quote")).unwrap();
        let mirror = MirrorServer::start().unwrap();
        PcsParts::from_collateral_json(&original).unwrap().serve(
            &mirror,
            "B0C06F000000",
            "platform",
        );

        // At a time the collateral was valid, against Intel's pinned root.
        let files = fetch_from(&mirror, &quote, TDX_TIME, &IntelRoot::pinned()).unwrap();
        assert_eq!(files[0].relative, "tdx/B0C06F000000-platform.json");
        let cache = cache_of(&files);
        let cached = Collateral::at(cache.path()).tdx_collateral(&quote).unwrap();
        assert_eq!(cached.tcb_info, original["tcb_info"].as_str().unwrap());
        assert_eq!(
            cached.qe_identity,
            original["qe_identity"].as_str().unwrap()
        );
        let mrtd = hex::decode("91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7").unwrap();
        let claims = tdx::verify(
            &quote,
            &cached,
            &IntelRoot::pinned(),
            &policy(mrtd.try_into().unwrap()),
            TDX_TIME,
        )
        .unwrap();
        assert_eq!(claims.status, "UpToDate");

        // Now it has expired.
        let e = fetch_from(&mirror, &quote, now(), &IntelRoot::pinned()).unwrap_err();
        assert!(e.to_string().contains("TDX collateral time"), "{e}");
    }
}
