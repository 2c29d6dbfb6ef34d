//! The cache never goes back in time: a fetched CRL, TCB info or QE
//! identity issued before the one the cache holds is refused.
//!
//! An older answer is still signed and may still be inside its validity
//! window, so the fetch's own checks pass it. But whoever answers for the
//! vendor (a mirror, a PCCS, a proxy) could replay it to drop a revocation
//! or a TCB recovery that the cached one carries.

use std::path::Path;

use dcap_qvl::QuoteCollateralV3;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use x509_parser::prelude::FromDer as _;
use x509_parser::revocation_list::CertificateRevocationList;

use super::CacheFile;
use crate::printable::printable;

/// What a cache file holds, as far as its dates go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A certificate or chain: replaced as fetched.
    Certificate,
    /// A DER CRL: dated by its thisUpdate.
    Crl,
    /// A TDX collateral file: dated by the TCB info's and QE identity's
    /// issueDate and both CRLs' thisUpdate.
    TdxCollateral,
}

/// One dated part of a cache file: what it is and when it was issued
/// (Unix seconds).
type Dated = (&'static str, i64);

/// Refuses `files` if any of them holds a part issued before the same part
/// of the file the cache already holds at its place. A cached file that
/// cannot be read or dated is replaced (it is of no use as it is).
pub fn refuse_rollback(cache: &Path, files: &[CacheFile]) -> anyhow::Result<()> {
    for file in files {
        if file.kind == Kind::Certificate {
            continue;
        }
        let path = cache.join(&file.relative);
        let cached = match keel_verifier::bounded::read(
            &path,
            keel_verifier::cpu::collateral::MAX_COLLATERAL_BYTES,
        ) {
            Ok(Some(bytes)) => bytes,
            Ok(None) | Err(_) => continue,
        };
        let Ok(before) = dates(file.kind, &cached) else {
            eprintln!(
                "keel: the cached {} cannot be dated; replacing it",
                file.relative
            );
            continue;
        };
        let now = dates(file.kind, &file.bytes)
            .map_err(|e| anyhow::anyhow!("the fetched {} cannot be dated: {e}", file.relative))?;
        for ((what, fetched), (_, held)) in now.iter().zip(&before) {
            anyhow::ensure!(
                fetched >= held,
                "refusing {}: its {what} is {}, older than the cached one's {}; an older \
                 answer may be a replay that drops a revocation or a TCB update (the cache is \
                 unchanged; remove {} to take the older one on purpose)",
                file.relative,
                iso(*fetched),
                iso(*held),
                path.display()
            );
        }
    }
    Ok(())
}

/// The dated parts of a file of `kind`, in a fixed order.
fn dates(kind: Kind, bytes: &[u8]) -> Result<Vec<Dated>, String> {
    match kind {
        Kind::Certificate => Ok(Vec::new()),
        Kind::Crl => Ok(vec![("CRL's thisUpdate", this_update(bytes)?)]),
        Kind::TdxCollateral => {
            let collateral: QuoteCollateralV3 =
                serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
            Ok(vec![
                (
                    "TCB info's issueDate",
                    issue_date(&collateral.tcb_info, "TCB info")?,
                ),
                (
                    "QE identity's issueDate",
                    issue_date(&collateral.qe_identity, "QE identity")?,
                ),
                ("PCK CRL's thisUpdate", this_update(&collateral.pck_crl)?),
                (
                    "root CA CRL's thisUpdate",
                    this_update(&collateral.root_ca_crl)?,
                ),
            ])
        }
    }
}

/// A DER CRL's thisUpdate.
fn this_update(der: &[u8]) -> Result<i64, String> {
    let (_, crl) = CertificateRevocationList::from_der(der).map_err(|e| format!("a CRL: {e}"))?;
    Ok(crl.last_update().timestamp())
}

/// The `issueDate` of a signed TCB info or QE identity body.
fn issue_date(json: &str, what: &str) -> Result<i64, String> {
    #[derive(serde::Deserialize)]
    struct Issued {
        #[serde(rename = "issueDate")]
        issue_date: String,
    }
    let issued: Issued =
        serde_json::from_str(json).map_err(|e| format!("{what}'s issueDate: {e}"))?;
    OffsetDateTime::parse(&issued.issue_date, &Rfc3339)
        .map(OffsetDateTime::unix_timestamp)
        .map_err(|e| {
            format!(
                "{what}'s issueDate \"{}\": {e}",
                printable(&issued.issue_date)
            )
        })
}

/// `at` as an RFC 3339 time, or the number if it has none.
fn iso(at: i64) -> String {
    OffsetDateTime::from_unix_timestamp(at)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| at.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_file_that_cannot_be_dated_is_replaced_a_fetched_one_refused() {
        let cache = tempfile::tempdir().unwrap();
        let place = cache.path().join("snp/Milan/crl.der");
        std::fs::create_dir_all(place.parent().unwrap()).unwrap();
        let now = OffsetDateTime::now_utc();
        let crl = keel_testkit::amd::TestAmd::for_line("Milan")
            .unwrap()
            .crl(
                &[],
                now - time::Duration::days(1),
                now + time::Duration::days(7),
            )
            .unwrap();
        let fetched = |bytes: &[u8]| {
            [CacheFile::new(
                "snp/Milan/crl.der",
                bytes.to_vec(),
                Kind::Crl,
            )]
        };

        // Nothing cached, or junk cached: nothing holds the fetch back.
        refuse_rollback(cache.path(), &fetched(&crl)).unwrap();
        std::fs::write(&place, b"junk").unwrap();
        refuse_rollback(cache.path(), &fetched(&crl)).unwrap();
        // A CRL cached: a fetched file that cannot be dated is refused.
        std::fs::write(&place, &crl).unwrap();
        refuse_rollback(cache.path(), &fetched(&crl)).unwrap();
        let e = refuse_rollback(cache.path(), &fetched(b"junk")).unwrap_err();
        assert!(format!("{e:#}").contains("cannot be dated"), "{e:#}");
    }

    #[test]
    fn dates_print_as_rfc3339() {
        assert_eq!(iso(1_752_919_234), "2025-07-19T10:00:34Z");
        assert_eq!(
            issue_date(r#"{"issueDate":"2025-07-19T10:00:34Z"}"#, "TCB info").unwrap(),
            1_752_919_234
        );
        assert!(issue_date(r#"{"issueDate":"yesterday"}"#, "TCB info").is_err());
    }
}
