//! The local collateral cache: certificates and collateral the CPU
//! evidence is checked with, read from a directory and never fetched while
//! verifying (a join must not depend on, or be slowed by, a vendor
//! service). An operator fills the cache once, e.g. from AMD's KDS and
//! Intel's PCS, and gives its path to the verifier.
//!
//! Layout under the cache directory:
//!
//! * `snp/vcek-<chip_id hex>-<bl>-<tee>-<snp>-<ucode>.der`: a VCEK for one
//!   chip and TCB; `snp/vlek-<bl>-<tee>-<snp>-<ucode>.der`: a VLEK (for a
//!   Turin report, `<fmc>-` before `<bl>`). Used only when the document
//!   does not carry the certificate itself.
//! * `tdx/<FMSPC, 12 upper-case hex digits>-<CA>.json`, the CA that
//!   issued the quote's PCK certificate being `platform` or `processor`:
//!   `dcap-qvl`'s `QuoteCollateralV3` (TCB info, QE identity, CRLs,
//!   issuer chains). The PCK CRL in it is that CA's, so the CA is part of
//!   the name. A cache filled before holds `tdx/<FMSPC>.json`, read where
//!   the CA's own file is missing.
//! * `snp/<product>/crl.der`: AMD's CRL for a product line (`Milan`,
//!   `Genoa`, `Turin`; KDS `/vcek/v1/<product>/crl`). When present, every
//!   VCEK-signed SNP report of that line is checked against it
//!   ([`super::snp::check_revocation`]): a CRL that is not the ARK's, not
//!   current, or revokes the ASK or the endorsement key refuses the
//!   evidence. When absent, revocation is not checked.
//! * `snp/<product>/vlek-crl.der`: the same for VLEK-signed reports, with
//!   AMD's list of revoked ASVKs and VLEKs (KDS `/vlek/v1/<product>/crl`).
//!   A VLEK report is never checked against `crl.der`, which lists
//!   neither.
//! * `snp/<product>/cert_chain.pem` and `vlek_cert_chain.pem`: AMD's
//!   ASK/ARK and ASVK/ARK chains, as `keel collateral fetch` stores them
//!   with a VCEK or for a VLEK. Kept for the operator; the verifier uses
//!   its pinned roots.
//!
//! [`snp_certificate_path`], [`snp_crl_path`], [`tdx_collateral_path`] and
//! [`earlier_tdx_collateral_path`] name the files, for the reader here and
//! for the command that fills the cache.

use std::path::{Path, PathBuf};

pub use dcap_qvl::config::PckCa;
use dcap_qvl::quote::Quote;
use dcap_qvl::QuoteCollateralV3;
use sev::firmware::guest::AttestationReport;

use super::snp::SigningKey;

/// Where a node's verifier (the join service, a joining node) reads its
/// collateral cache.
pub const DEFAULT_DIR: &str = "/var/lib/keel/collateral";

/// Largest accepted collateral file.
pub const MAX_COLLATERAL_BYTES: u64 = 256 * 1024;

/// Why the cache could not supply what the evidence needs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollateralError {
    /// No cache directory is configured.
    #[error("no collateral cache is configured and the evidence does not carry {what}")]
    NoCache {
        /// What was needed.
        what: &'static str,
    },
    /// A file could not be read.
    #[error("reading collateral {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file is larger than [`MAX_COLLATERAL_BYTES`].
    #[error("collateral {path} is larger than {MAX_COLLATERAL_BYTES} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A file does not parse.
    #[error("collateral {path} does not parse")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The quote's PCK certificate names no FMSPC or CA.
    #[error("TDX quote: no FMSPC or CA in its PCK certificate: {0}")]
    Fmspc(String),
}

impl CollateralError {
    /// Whether the file read does not exist.
    fn is_missing(&self) -> bool {
        matches!(self, Self::Read { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// A collateral cache directory, or none.
#[derive(Clone, Debug, Default)]
pub struct Collateral {
    dir: Option<PathBuf>,
}

impl Collateral {
    /// The cache at `dir`.
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: Some(dir.into()),
        }
    }

    fn path(&self, what: &'static str, relative: String) -> Result<PathBuf, CollateralError> {
        self.dir
            .as_ref()
            .map(|d| d.join(relative))
            .ok_or(CollateralError::NoCache { what })
    }

    /// The VCEK or VLEK (DER) for `report`'s chip and reported TCB.
    pub fn snp_certificate(&self, report: &AttestationReport) -> Result<Vec<u8>, CollateralError> {
        read_bounded(&self.path("a VCEK or VLEK certificate", snp_certificate_path(report))?)
    }

    /// AMD's revocation list for the `key`s of the product line `line`,
    /// if the cache holds one (none without a cache).
    pub fn snp_crl(&self, line: &str, key: SigningKey) -> Result<Option<Vec<u8>>, CollateralError> {
        let Some(relative) = snp_crl_path(line, key) else {
            return Ok(None);
        };
        let Some(path) = self.dir.as_ref().map(|d| d.join(relative)) else {
            return Ok(None);
        };
        match read_bounded(&path) {
            Err(e) if e.is_missing() => Ok(None),
            other => other.map(Some),
        }
    }

    /// The TDX collateral for `quote`'s FMSPC and the CA that issued its
    /// PCK certificate. A cache filled before the file names carried the
    /// CA holds one file per FMSPC: that file is read where the CA's own
    /// is missing (a CA's collateral never verifies the other's quotes).
    pub fn tdx_collateral(&self, quote: &[u8]) -> Result<QuoteCollateralV3, CollateralError> {
        let parsed = Quote::parse(quote).map_err(|e| CollateralError::Fmspc(format!("{e:#}")))?;
        let (fmspc, ca) = pck_platform(&parsed)?;
        let path = self.path("TDX collateral", tdx_collateral_path(&fmspc, ca))?;
        match tdx_collateral_file(&path) {
            Err(missing) if missing.is_missing() => {
                let earlier = self.path("TDX collateral", earlier_tdx_collateral_path(&fmspc))?;
                // Neither there: the error names the CA's own file.
                tdx_collateral_file(&earlier).map_err(|e| if e.is_missing() { missing } else { e })
            }
            read => read,
        }
    }
}

/// Where a cache keeps the VCEK (or VLEK) that signed `report`, relative to
/// the cache directory: named by chip (VCEK only) and reported TCB (with
/// the FMC SVN first where the report carries one, as Turin's do: two
/// VCEKs of one chip that differ in it do not share a name).
pub fn snp_certificate_path(report: &AttestationReport) -> String {
    let t = report.reported_tcb;
    let fmc = t.fmc.map(|f| format!("{f}-")).unwrap_or_default();
    let tcb = format!("{fmc}{}-{}-{}-{}", t.bootloader, t.tee, t.snp, t.microcode);
    if report.key_info.signing_key() == 1 {
        format!("snp/vlek-{tcb}.der")
    } else {
        format!("snp/vcek-{}-{tcb}.der", hex::encode(report.chip_id))
    }
}

/// Where a cache keeps AMD's revocation list for the `key`s of the
/// product line `line` (`Milan`), relative to the cache directory: its CRL
/// for VCEKs, its VLEK CRL for VLEKs; `None` for a name that is not a
/// plain word.
pub fn snp_crl_path(line: &str, key: SigningKey) -> Option<String> {
    let plain = !line.is_empty() && line.bytes().all(|b| b.is_ascii_alphanumeric());
    let file = match key {
        SigningKey::Vcek => "crl.der",
        SigningKey::Vlek => "vlek-crl.der",
    };
    plain.then(|| format!("snp/{line}/{file}"))
}

/// Where a cache keeps the TDX collateral for `fmspc` and PCK
/// certificates issued by `ca`, relative to the cache directory. Both name
/// the file: the collateral's PCK CRL is the CA's, and one FMSPC may have
/// platforms under both CAs.
pub fn tdx_collateral_path(fmspc: &[u8; 6], ca: PckCa) -> String {
    format!("tdx/{}-{}.json", hex::encode_upper(fmspc), ca.as_id_str())
}

/// The FMSPC of `quote`'s PCK certificate, and the CA that issued it by
/// the word Intel puts in the CA's name ("Intel SGX PCK Platform CA",
/// "... Processor CA"). The name is read with the certificate parser the
/// verifier already carries, not by printing the whole issuer name.
pub fn pck_platform(quote: &Quote) -> Result<([u8; 6], PckCa), CollateralError> {
    let unnamed = |what: String| CollateralError::Fmspc(what);
    let chain =
        dcap_qvl::intel::extract_cert_chain(quote).map_err(|e| unnamed(format!("{e:#}")))?;
    let leaf = chain
        .first()
        .ok_or_else(|| unnamed("the quote carries no PCK certificate".into()))?;
    let fmspc = dcap_qvl::intel::parse_pck_extension(leaf)
        .map_err(|e| unnamed(format!("{e:#}")))?
        .fmspc;
    let (_, certificate) = x509_parser::parse_x509_certificate(leaf)
        .map_err(|e| unnamed(format!("its PCK certificate does not parse: {e}")))?;
    for name in certificate.issuer().iter_common_name() {
        let name = name.as_str().unwrap_or_default();
        if name.contains("Processor") {
            return Ok((fmspc, PckCa::Processor));
        }
        if name.contains("Platform") {
            return Ok((fmspc, PckCa::Platform));
        }
    }
    Err(unnamed(
        "its PCK certificate's issuer is neither Intel's platform nor its processor CA".into(),
    ))
}

/// Where caches filled before [`tdx_collateral_path`] named the CA kept
/// the TDX collateral for `fmspc`, relative to the cache directory: read
/// where the CA's own file is missing ([`Collateral::tdx_collateral`]).
pub fn earlier_tdx_collateral_path(fmspc: &[u8; 6]) -> String {
    format!("tdx/{}.json", hex::encode_upper(fmspc))
}

/// How new a signed TCB info or QE identity body of TDX collateral is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Issued {
    /// Its `issueDate`, in Unix seconds.
    pub date: i64,
    /// Its `tcbEvaluationDataNumber`, which Intel raises with each TCB
    /// recovery (a body dated later may still be of an older evaluation),
    /// if it has one.
    pub evaluation: Option<i64>,
}

impl Issued {
    /// Reads the `issueDate` (RFC 3339) and `tcbEvaluationDataNumber` of a
    /// TCB info or QE identity body; `what` names it in the error.
    pub fn of(json: &str, what: &str) -> Result<Self, String> {
        #[derive(serde::Deserialize)]
        struct Fields {
            #[serde(rename = "issueDate")]
            issue_date: String,
            #[serde(rename = "tcbEvaluationDataNumber", default)]
            evaluation: Option<i64>,
        }
        let fields: Fields = serde_json::from_str(json).map_err(|e| format!("{what}: {e}"))?;
        let date = time::OffsetDateTime::parse(
            &fields.issue_date,
            &time::format_description::well_known::Rfc3339,
        )
        .map_err(|e| format!("{what}'s issueDate {:?}: {e}", fields.issue_date))?;
        Ok(Self {
            date: date.unix_timestamp(),
            evaluation: fields.evaluation,
        })
    }
}

/// A DER CRL's thisUpdate, in Unix seconds.
pub fn crl_this_update(der: &[u8]) -> Result<i64, String> {
    let (_, crl) = x509_parser::parse_x509_crl(der).map_err(|e| format!("a CRL: {e}"))?;
    Ok(crl.last_update().timestamp())
}

/// Reads one TDX collateral file (`QuoteCollateralV3` JSON).
pub fn tdx_collateral_file(path: &Path) -> Result<QuoteCollateralV3, CollateralError> {
    let bytes = read_bounded(path)?;
    serde_json::from_slice(&bytes).map_err(|source| CollateralError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// Reads a regular file of at most [`MAX_COLLATERAL_BYTES`].
fn read_bounded(path: &Path) -> Result<Vec<u8>, CollateralError> {
    let read = |source| CollateralError::Read {
        path: path.to_owned(),
        source,
    };
    crate::bounded::read_regular(path, MAX_COLLATERAL_BYTES)
        .map_err(read)?
        .ok_or_else(|| CollateralError::TooLarge {
            path: path.to_owned(),
        })
}
