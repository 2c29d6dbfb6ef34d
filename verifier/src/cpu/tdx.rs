//! Intel TDX: a quote verified offline with `dcap-qvl` (no HTTP client)
//! against Intel's SGX root CA (pinned by the crate) and collateral from
//! the local cache: the PCK chain and CRLs, the TCB info and its status,
//! the QE identity, and TD attributes (debug, migration and profiling
//! refused). Then keel's own checks: the TCB status (only `UpToDate`
//! unless the config allows another by name), MRTD, RTMR 0-3 and, where the
//! config pins them, XFAM, MRCONFIGID and MROWNER.

use dcap_qvl::quote::TDReport10;
use dcap_qvl::verify::QuoteVerifier;
use dcap_qvl::QuoteCollateralV3;
use subtle::ConstantTimeEq as _;

use super::policy::{pinned, pinned_one_of, TdxPolicy};

/// Largest accepted quote.
pub const MAX_QUOTE_BYTES: usize = 16 * 1024;

/// Why a TDX quote was refused; each variant names its check.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TdxError {
    /// The quote is larger than [`MAX_QUOTE_BYTES`].
    #[error("TDX quote is {actual} bytes, more than {MAX_QUOTE_BYTES}")]
    QuoteSize {
        /// Its length.
        actual: usize,
    },
    /// The quote or its collateral failed DCAP verification.
    #[error("TDX {check}: {reason}")]
    Verification {
        /// Which check failed: `collateral time`, `revocation`,
        /// `TCB level`, `QE identity`, `TD attributes`, `signature` or
        /// `quote`.
        check: &'static str,
        /// The verifier's reason, with its context.
        reason: String,
    },
    /// The quote is not a TD quote.
    #[error("TDX quote carries no TD report")]
    NotTd,
    /// The TD is debuggable.
    #[error("TDX td_attributes.debug: expected 0, actual 1")]
    Debug,
    /// The TCB status is not accepted.
    #[error("TDX TCB status: expected UpToDate{}, actual {actual} (advisories {advisories:?})",
        if allowed.is_empty() { String::new() } else { format!(" or {}", allowed.join(", ")) })]
    TcbStatus {
        /// Statuses the config allows besides `UpToDate`.
        allowed: Vec<String>,
        /// The quote's status.
        actual: String,
        /// Intel security advisories that apply.
        advisories: Vec<String>,
    },
    /// MRTD is neither `mrtd` nor one of `also_mrtd`.
    #[error("TDX MRTD: expected {expected}, actual {actual}")]
    Mrtd {
        /// Configured (hex); where `also_mrtd` lists more, how many are
        /// accepted, with `mrtd` in hex.
        expected: String,
        /// Quoted (hex).
        actual: String,
    },
    /// XFAM differs.
    #[error("TDX XFAM: expected {expected}, actual {actual}")]
    Xfam {
        /// Configured (hex).
        expected: String,
        /// Quoted (hex).
        actual: String,
    },
    /// MRCONFIGID differs.
    #[error("TDX MRCONFIGID: expected {expected}, actual {actual}")]
    MrConfigId {
        /// Configured (hex).
        expected: String,
        /// Quoted (hex).
        actual: String,
    },
    /// MROWNER differs.
    #[error("TDX MROWNER: expected {expected}, actual {actual}")]
    MrOwner {
        /// Configured (hex).
        expected: String,
        /// Quoted (hex).
        actual: String,
    },
    /// An RTMR differs.
    #[error("TDX RTMR{index}: expected {expected}, actual {actual}")]
    Rtmr {
        /// The register.
        index: usize,
        /// Configured (hex).
        expected: String,
        /// Quoted (hex).
        actual: String,
    },
}

impl TdxError {
    /// Whether the refusal is of a validity period at the verification
    /// time (a certificate, CRL, TCB info or QE identity outside its
    /// window), which the verifier's clock decides.
    pub fn rests_on_the_clock(&self) -> bool {
        matches!(self, Self::Verification { check, .. } if *check == COLLATERAL_TIME)
    }
}

/// What a verified TDX quote establishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TdxClaims {
    /// The TCB status (`UpToDate` or one the config allows).
    pub status: String,
    /// Intel security advisories that apply.
    pub advisories: Vec<String>,
    /// TEE TCB SVN.
    pub tee_tcb_svn: [u8; 16],
    /// TD attributes.
    pub td_attributes: [u8; 8],
    /// XFAM.
    pub xfam: [u8; 8],
    /// MRTD.
    pub mrtd: [u8; 48],
    /// MRCONFIGID.
    pub mr_config_id: [u8; 48],
    /// MROWNER.
    pub mr_owner: [u8; 48],
    /// RTMR 0-3.
    pub rtmr: [[u8; 48]; 4],
    /// The 64 TD-chosen bytes.
    pub report_data: [u8; 64],
}

/// The Intel root CA a verifier trusts.
#[derive(Clone, Debug, Default)]
pub struct IntelRoot {
    /// DER of a replacement root; `None` is Intel's SGX Root CA.
    der: Option<Vec<u8>>,
}

impl IntelRoot {
    /// Intel's SGX Root CA, as `dcap-qvl` pins it.
    pub fn pinned() -> Self {
        Self { der: None }
    }

    /// Another root (DER): for test roots only.
    pub fn from_der(der: Vec<u8>) -> Self {
        Self { der: Some(der) }
    }
}

/// The report data a TD quote claims, before any of it is verified: for a
/// refusal that costs less than the verification. `None` if `quote` does
/// not parse (the verification refuses it); a quote of something other
/// than a TD is refused here.
pub fn claimed_report_data(quote: &[u8]) -> Result<Option<[u8; 64]>, TdxError> {
    if quote.len() > MAX_QUOTE_BYTES {
        return Ok(None);
    }
    let Ok(parsed) = dcap_qvl::quote::Quote::parse(quote) else {
        return Ok(None);
    };
    parsed
        .report
        .as_td10()
        .map(|td| Some(td.report_data))
        .ok_or(TdxError::NotTd)
}

/// Verifies `quote` with `collateral` at `now` against `root` and `policy`.
///
/// DCAP stops at its first refusal, and it checks the certificates' dates
/// before their signatures, and the collateral's before the quote's: a
/// refusal for a date says nothing of the rest. So a quote refused for a
/// date alone is verified again, the verifier's clock set aside, at a time
/// when the collateral is valid ([`times_apart_from_the_clock`]); the
/// refusal rests on the clock ([`TdxError::rests_on_the_clock`]) only when
/// every check passes at one of them. The checks other than dates do not
/// depend on the time, so a pass at any time means they held. Otherwise
/// the refusal of the last such verification is the one returned, never
/// one of the clock: a PCK certificate that was not valid at any time the
/// collateral was is the quote's failure, or the collateral's (a cache
/// older than the platform's certificate and past its next update).
pub fn verify(
    quote: &[u8],
    collateral: &QuoteCollateralV3,
    root: &IntelRoot,
    policy: &TdxPolicy,
    now: u64,
) -> Result<TdxClaims, TdxError> {
    match verify_at(quote, collateral, root, policy, now) {
        Err(refusal) if refusal.rests_on_the_clock() => {
            let mut last = None;
            for then in times_apart_from_the_clock(quote, collateral) {
                match verify_at(quote, collateral, root, policy, then) {
                    Ok(_) => return Err(refusal),
                    // Another check failed: that is the refusal.
                    Err(other) if !other.rests_on_the_clock() => return Err(other),
                    Err(other) => last = Some(other),
                }
            }
            Err(not_the_clock(last.unwrap_or(refusal)))
        }
        verified => verified,
    }
}

/// The times [`verify`] judges a quote refused for a date at: the
/// collateral's own time ([`collateral_time`]), and the latest start of
/// the quote's PCK certificates where that is later (a platform certified
/// after the collateral was fetched). Empty when the collateral's time
/// does not parse.
fn times_apart_from_the_clock(quote: &[u8], collateral: &QuoteCollateralV3) -> Vec<u64> {
    let Some(then) = collateral_time(collateral) else {
        return Vec::new();
    };
    let certified = dcap_qvl::quote::Quote::parse(quote)
        .ok()
        .and_then(|quote| dcap_qvl::intel::extract_cert_chain(&quote).ok())
        .into_iter()
        .flatten()
        .filter_map(|der| {
            let (_, cert) = x509_parser::parse_x509_certificate(&der).ok()?;
            u64::try_from(cert.validity().not_before.timestamp()).ok()
        })
        .max();
    match certified {
        Some(certified) if certified > then => vec![then, certified],
        _ => vec![then],
    }
}

/// `refusal` as one that does not rest on the clock: a date refusal of the
/// collateral's own time becomes [`OUTSIDE_EVEN_THEN`].
fn not_the_clock(refusal: TdxError) -> TdxError {
    match refusal {
        TdxError::Verification { check, reason } if check == COLLATERAL_TIME => {
            TdxError::Verification {
                check: OUTSIDE_EVEN_THEN,
                reason,
            }
        }
        other => other,
    }
}

/// The latest issue date of `collateral` (TCB info, QE identity, the two
/// CRLs), in seconds since the epoch: the time at which a collateral set
/// fetched together is valid as a whole. `None` when the TCB info or QE
/// identity has no issue date that parses.
pub fn collateral_time(collateral: &QuoteCollateralV3) -> Option<u64> {
    use super::collateral::{crl_this_update, Issued};
    let issued = |json: &str| {
        Issued::of(json, "")
            .ok()
            .and_then(|issued| u64::try_from(issued.date).ok())
    };
    let crls = [&collateral.pck_crl, &collateral.root_ca_crl]
        .into_iter()
        .filter_map(|der| {
            crl_this_update(der)
                .ok()
                .and_then(|at| u64::try_from(at).ok())
        });
    let latest = issued(&collateral.tcb_info)?.max(issued(&collateral.qe_identity)?);
    Some(crls.fold(latest, u64::max))
}

/// One verification of `quote` at `now` (see [`verify`]).
fn verify_at(
    quote: &[u8],
    collateral: &QuoteCollateralV3,
    root: &IntelRoot,
    policy: &TdxPolicy,
    now: u64,
) -> Result<TdxClaims, TdxError> {
    if quote.len() > MAX_QUOTE_BYTES {
        return Err(TdxError::QuoteSize {
            actual: quote.len(),
        });
    }
    let verifier = match &root.der {
        None => QuoteVerifier::new_prod(),
        Some(der) => QuoteVerifier::new(der.clone()),
    };
    let verified = verifier.verify(quote, collateral, now).map_err(|e| {
        let reason = format!("{e:#}");
        TdxError::Verification {
            check: classify(&reason),
            reason,
        }
    })?;
    let td = verified.report.as_td10().ok_or(TdxError::NotTd)?;
    if td.td_attributes[0] & 1 != 0 {
        return Err(TdxError::Debug);
    }
    if verified.status != "UpToDate" && !policy.allow_tcb_status.contains(&verified.status) {
        return Err(TdxError::TcbStatus {
            allowed: policy.allow_tcb_status.clone(),
            actual: verified.status,
            advisories: verified.advisory_ids,
        });
    }
    pinned_one_of(
        ("mrtd", &policy.mrtd),
        ("also_mrtd", &policy.also_mrtd),
        &td.mr_td,
        |expected, actual| TdxError::Mrtd { expected, actual },
    )?;
    let rtmr = [td.rt_mr0, td.rt_mr1, td.rt_mr2, td.rt_mr3];
    for (index, (expected, actual)) in policy.rtmr.iter().zip(&rtmr).enumerate() {
        if let Some(expected) = expected {
            if !bool::from(actual.ct_eq(&expected.0)) {
                return Err(TdxError::Rtmr {
                    index,
                    expected: hex::encode(expected.0),
                    actual: hex::encode(actual),
                });
            }
        }
    }
    check_pins(td, policy)?;
    Ok(TdxClaims {
        status: verified.status,
        advisories: verified.advisory_ids,
        tee_tcb_svn: td.tee_tcb_svn,
        td_attributes: td.td_attributes,
        xfam: td.xfam,
        mrtd: td.mr_td,
        mr_config_id: td.mr_config_id,
        mr_owner: td.mr_owner,
        rtmr,
        report_data: td.report_data,
    })
}

/// XFAM, MRCONFIGID and MROWNER against the values the config pins, each
/// in constant time; an absent pin is not compared.
fn check_pins(td: &TDReport10, policy: &TdxPolicy) -> Result<(), TdxError> {
    pinned(policy.xfam.as_ref(), &td.xfam, |expected, actual| {
        TdxError::Xfam { expected, actual }
    })?;
    pinned(
        policy.mr_config_id.as_ref(),
        &td.mr_config_id,
        |expected, actual| TdxError::MrConfigId { expected, actual },
    )?;
    pinned(
        policy.mr_owner.as_ref(),
        &td.mr_owner,
        |expected, actual| TdxError::MrOwner { expected, actual },
    )
}

/// The check of a certificate's, CRL's or collateral's validity period.
const COLLATERAL_TIME: &str = "collateral time";
/// A validity period refused at the verification time and again at the
/// collateral's own time ([`verify`]): not the verifier's clock alone.
const OUTSIDE_EVEN_THEN: &str = "collateral time, also at the collateral's issue date";

/// Names the check a DCAP verification error comes from (its messages are
/// text; the full text is kept as the reason).
fn classify(reason: &str) -> &'static str {
    let r = reason.to_ascii_lowercase();
    let any = |words: &[&str]| words.iter().any(|w| r.contains(w));
    if any(&[
        "expired",
        "in the future",
        "notvalidyet",
        "not valid yet",
        "crlexpired",
    ]) {
        COLLATERAL_TIME
    } else if any(&["revoked"]) {
        "revocation"
    } else if any(&["tcb level", "fmspc"]) {
        "TCB level"
    } else if any(&["qe identity", "qe report", "qe isvsvn", "qe vendor"]) {
        "QE identity"
    } else if any(&[
        "debug",
        "migration",
        "profiling",
        "td attributes",
        "sept_ve",
        "servtd",
    ]) {
        "TD attributes"
    } else if any(&["signature", "certificate", "chain"]) {
        "signature"
    } else {
        "quote"
    }
}
