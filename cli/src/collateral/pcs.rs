//! Intel's Provisioning Certification Service (API v4): the TCB info for a
//! TDX quote's FMSPC, the TD quoting enclave's identity, the CRL of the CA
//! that issued the quote's PCK certificate, and the root CA's CRL,
//! assembled into the `QuoteCollateralV3` file the verifier reads. The
//! signed TCB info and QE identity are kept byte for byte as served.

use dcap_qvl::quote::Quote;
use dcap_qvl::verify::QuoteVerifier;
use dcap_qvl::QuoteCollateralV3;
use keel_verifier::cpu::collateral::{tdx_collateral_path, MAX_COLLATERAL_BYTES};
use serde::Deserialize;
use serde_json::value::RawValue;
use x509_parser::prelude::FromDer as _;
use x509_parser::revocation_list::CertificateRevocationList;

use super::http::{decoded_header, Answer, Http, HttpError};
use super::CacheFile;

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
}

/// A PCS answer holding one signed JSON object and its signature.
#[derive(Deserialize)]
struct Signed<'a> {
    #[serde(borrow, alias = "tcbInfo", alias = "enclaveIdentity")]
    object: &'a RawValue,
    signature: String,
}

/// Fetches the collateral for `quote` from the PCS at `base` (and the root
/// CA's CRL from `root_ca_crl_url`). When `check_at` is given, the quote
/// is verified with it against Intel's pinned root at that time, and the
/// outcome printed.
pub async fn fetch(
    http: &Http,
    base: &str,
    root_ca_crl_url: &str,
    quote: &[u8],
    check_at: Option<u64>,
) -> Result<Vec<CacheFile>, PcsError> {
    let parsed = Quote::parse(quote).map_err(|e| PcsError::Quote(format!("{e:#}")))?;
    let fmspc =
        dcap_qvl::intel::quote_fmspc(&parsed).map_err(|e| PcsError::Quote(format!("{e:#}")))?;
    let ca = dcap_qvl::intel::quote_ca(&parsed)
        .map_err(|e| PcsError::Quote(format!("{e:#}")))?
        .as_id_str();
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
            window("issueDate"),
            window("nextUpdate")
        );
    }
    if let Some(now) = check_at {
        match QuoteVerifier::new_prod().verify(quote, &collateral, now) {
            Ok(verified) => eprintln!(
                "keel: the quote verifies with this collateral against Intel's root now: TCB status {}",
                verified.status
            ),
            Err(e) => eprintln!(
                "keel: note: the quote does not verify with this collateral against Intel's root now: {e:#}"
            ),
        }
    }
    Ok(vec![CacheFile::new(tdx_collateral_path(&fmspc), json)])
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
            actual: actual.to_owned(),
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
