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

use super::CacheFile;

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

/// How new a part of a cache file is: when it was issued, or a number its
/// issuer only ever raises. A date and a number do not compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stamp {
    /// Unix seconds.
    Date(i64),
    /// Intel's `tcbEvaluationDataNumber`.
    Number(i64),
}

impl PartialOrd for Stamp {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        match (self, other) {
            (Self::Date(a), Self::Date(b)) | (Self::Number(a), Self::Number(b)) => Some(a.cmp(b)),
            _ => None,
        }
    }
}

impl std::fmt::Display for Stamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Date(at) => f.write_str(&iso(*at)),
            Self::Number(n) => write!(f, "{n}"),
        }
    }
}

/// One dated part of a cache file: what it is, how new, and who issued
/// it where that tells two files' parts apart (a CRL's issuer: the list of
/// another CA does not compare).
struct Dated {
    what: &'static str,
    stamp: Stamp,
    issuer: Vec<u8>,
}

impl Dated {
    fn new(what: &'static str, stamp: Stamp) -> Self {
        Self {
            what,
            stamp,
            issuer: Vec::new(),
        }
    }

    /// A DER CRL, dated by its thisUpdate.
    fn crl(what: &'static str, der: &[u8]) -> Result<Self, String> {
        let (_, crl) = x509_parser::parse_x509_crl(der).map_err(|e| format!("a CRL: {e}"))?;
        Ok(Self {
            what,
            stamp: Stamp::Date(keel_verifier::cpu::collateral::crl_this_update(der)?),
            issuer: crl.issuer().as_raw().to_vec(),
        })
    }
}

/// Refuses `files` if any of them holds a part issued before the same part
/// of a file the cache already holds: at its place, or at the earlier
/// place verifiers read where that is missing ([`CacheFile::earlier`]). A
/// cached file that cannot be read or dated is not compared (at its
/// place it is replaced: it is of no use as it is).
pub fn refuse_rollback(cache: &Path, files: &[CacheFile]) -> anyhow::Result<()> {
    for file in files.iter().filter(|f| f.kind != Kind::Certificate) {
        for place in std::iter::once(&file.relative).chain(&file.earlier) {
            refuse_older_than_cached(cache, file, place)?;
        }
    }
    Ok(())
}

/// Refuses `file` if it holds a part issued before the same part of the
/// file the cache holds at `place` (relative to `cache`).
fn refuse_older_than_cached(cache: &Path, file: &CacheFile, place: &str) -> anyhow::Result<()> {
    let path = cache.join(place);
    let skipped = if *place == file.relative {
        "replacing it"
    } else {
        "not comparing with it"
    };
    let cached = match keel_verifier::bounded::read_regular(
        &path,
        keel_verifier::cpu::collateral::MAX_COLLATERAL_BYTES,
    ) {
        Ok(Some(bytes)) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Ok(None) => {
            eprintln!("keel: the cached {place} is larger than a verifier reads; {skipped}");
            return Ok(());
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "reading the cached {} to compare the fetched one with it; nothing was written",
                path.display()
            )))
        }
    };
    let Ok(before) = dates(file.kind, &cached) else {
        eprintln!("keel: the cached {place} cannot be dated; {skipped}");
        return Ok(());
    };
    let now = dates(file.kind, &file.bytes)
        .map_err(|e| anyhow::anyhow!("the fetched {} cannot be dated: {e}", file.relative))?;
    for (fetched, held) in now.iter().zip(&before) {
        anyhow::ensure!(
            fetched.issuer != held.issuer || fetched.stamp >= held.stamp,
            "refusing {}: its {} is {}, older than the cached one's {}; an older answer may be \
             a replay that drops a revocation or a TCB update (the cache is unchanged; remove \
             {} to take the older one on purpose)",
            file.relative,
            fetched.what,
            fetched.stamp,
            held.stamp,
            path.display()
        );
    }
    Ok(())
}

/// The dated parts of a file of `kind`, in a fixed order.
fn dates(kind: Kind, bytes: &[u8]) -> Result<Vec<Dated>, String> {
    match kind {
        Kind::Certificate => Ok(Vec::new()),
        Kind::Crl => Ok(vec![Dated::crl("CRL's thisUpdate", bytes)?]),
        Kind::TdxCollateral => {
            let collateral: QuoteCollateralV3 =
                serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
            let tcb = Issued::of(&collateral.tcb_info, "TCB info")?;
            let qe = Issued::of(&collateral.qe_identity, "QE identity")?;
            Ok(vec![
                Dated::new("TCB info's issueDate", tcb.date),
                Dated::new("TCB info's tcbEvaluationDataNumber", tcb.evaluation),
                Dated::new("QE identity's issueDate", qe.date),
                Dated::new("QE identity's tcbEvaluationDataNumber", qe.evaluation),
                Dated::crl("PCK CRL's thisUpdate", &collateral.pck_crl)?,
                Dated::crl("root CA CRL's thisUpdate", &collateral.root_ca_crl)?,
            ])
        }
    }
}

/// How new a signed TCB info or QE identity body is.
struct Issued {
    /// Its `issueDate`.
    date: Stamp,
    /// Its `tcbEvaluationDataNumber`, which Intel raises with each TCB
    /// recovery: a body dated later may still be of an older evaluation.
    evaluation: Stamp,
}

impl Issued {
    fn of(json: &str, what: &str) -> Result<Self, String> {
        let issued = keel_verifier::cpu::collateral::Issued::of(json, what)?;
        let evaluation = issued
            .evaluation
            .ok_or_else(|| format!("{what}: no tcbEvaluationDataNumber"))?;
        Ok(Self {
            date: Stamp::Date(issued.date),
            evaluation: Stamp::Number(evaluation),
        })
    }
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

    /// A CRL issued yesterday, current for a week.
    fn current_crl() -> Vec<u8> {
        let now = OffsetDateTime::now_utc();
        keel_testkit::amd::TestAmd::for_line("Milan")
            .unwrap()
            .crl(
                &[],
                now - time::Duration::days(1),
                now + time::Duration::days(7),
            )
            .unwrap()
    }

    #[test]
    fn a_cached_file_that_cannot_be_dated_is_replaced_a_fetched_one_refused() {
        let cache = tempfile::tempdir().unwrap();
        let place = cache.path().join("snp/Milan/crl.der");
        std::fs::create_dir_all(place.parent().unwrap()).unwrap();
        let crl = current_crl();
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
        let issued = Issued::of(
            r#"{"issueDate":"2025-07-19T10:00:34Z","tcbEvaluationDataNumber":17}"#,
            "TCB info",
        )
        .unwrap();
        assert_eq!(issued.date.to_string(), "2025-07-19T10:00:34Z");
        assert_eq!(issued.evaluation, Stamp::Number(17));
        let yesterday = r#"{"issueDate":"yesterday","tcbEvaluationDataNumber":17}"#;
        assert!(Issued::of(yesterday, "TCB info").is_err());
    }

    /// A PCCS or proxy serves TCB info dated later than the cached one but
    /// of an older TCB evaluation (Intel publishes more than one
    /// evaluation at a time): a TCB recovery the cached one carries would
    /// be undone.
    /// TDX collateral (unsigned) whose TCB info and QE identity are issued
    /// at `date` of `evaluation`, with `pck_crl` and `root_crl`.
    fn tdx_collateral(date: &str, evaluation: u32, pck_crl: &[u8], root_crl: &[u8]) -> Vec<u8> {
        let body = format!(r#"{{"issueDate":"{date}","tcbEvaluationDataNumber":{evaluation}}}"#);
        let collateral = QuoteCollateralV3 {
            pck_crl_issuer_chain: String::new(),
            root_ca_crl: root_crl.to_vec(),
            pck_crl: pck_crl.to_vec(),
            tcb_info_issuer_chain: String::new(),
            tcb_info: body.clone(),
            tcb_info_signature: Vec::new(),
            qe_identity_issuer_chain: String::new(),
            qe_identity: body,
            qe_identity_signature: Vec::new(),
            pck_certificate_chain: None,
        };
        serde_json::to_vec(&collateral).unwrap()
    }

    #[test]
    fn an_older_tcb_evaluation_is_refused_however_it_is_dated() {
        let crl = current_crl();
        let collateral = |date: &str, evaluation: u32| tdx_collateral(date, evaluation, &crl, &crl);
        let cache = tempfile::tempdir().unwrap();
        let place = cache.path().join("tdx/00806F050000-platform.json");
        std::fs::create_dir_all(place.parent().unwrap()).unwrap();
        std::fs::write(&place, collateral("2025-07-01T00:00:00Z", 18)).unwrap();
        let fetched = |bytes| {
            [CacheFile::new(
                "tdx/00806F050000-platform.json",
                bytes,
                Kind::TdxCollateral,
            )]
        };
        let later_but_older = fetched(collateral("2025-07-19T00:00:00Z", 17));
        let e = format!(
            "{:#}",
            refuse_rollback(cache.path(), &later_but_older).unwrap_err()
        );
        assert!(
            e.contains(
                "its TCB info's tcbEvaluationDataNumber is 17, older than the cached one's 18"
            ),
            "{e}"
        );
        let later = fetched(collateral("2025-07-19T00:00:00Z", 18));
        refuse_rollback(cache.path(), &later).unwrap();
    }

    /// A cache filled by an earlier version holds TDX collateral for the
    /// FMSPC under a name without the CA, which verifiers read while the
    /// CA's own file is missing. Fetched collateral is compared with it
    /// too; its PCK CRL only where it is the same CA's (the earlier file
    /// may be the other CA's, whose list is another).
    #[test]
    fn collateral_under_the_earlier_name_is_compared_but_another_cas_crl() {
        let now = OffsetDateTime::now_utc();
        let list = |line: &str, days_ago: i64| {
            keel_testkit::amd::TestAmd::for_line(line)
                .unwrap()
                .crl(
                    &[],
                    now - time::Duration::days(days_ago),
                    now + time::Duration::days(7),
                )
                .unwrap()
        };
        let (root_crl, newer_pck_crl) = (list("Milan", 1), list("Genoa", 1));
        let cache = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(cache.path().join("tdx")).unwrap();
        std::fs::write(
            cache.path().join("tdx/00806F050000.json"),
            tdx_collateral("2025-07-19T00:00:00Z", 18, &newer_pck_crl, &root_crl),
        )
        .unwrap();
        let fetched = |bytes| {
            [
                CacheFile::new("tdx/00806F050000-platform.json", bytes, Kind::TdxCollateral)
                    .or_earlier_at("tdx/00806F050000.json"),
            ]
        };
        let e = format!(
            "{:#}",
            refuse_rollback(
                cache.path(),
                &fetched(tdx_collateral(
                    "2025-07-01T00:00:00Z",
                    18,
                    &newer_pck_crl,
                    &root_crl
                ))
            )
            .unwrap_err()
        );
        assert!(
            e.contains("its TCB info's issueDate is 2025-07-01T00:00:00Z, older than")
                && e.contains("tdx/00806F050000.json to take the older one"),
            "{e}"
        );
        // The same CA's older list is refused; another CA's is not compared.
        let older_same_ca = list("Genoa", 3);
        let e = format!(
            "{:#}",
            refuse_rollback(
                cache.path(),
                &fetched(tdx_collateral(
                    "2025-07-19T00:00:00Z",
                    18,
                    &older_same_ca,
                    &root_crl
                ))
            )
            .unwrap_err()
        );
        assert!(e.contains("its PCK CRL's thisUpdate is"), "{e}");
        let other_ca = list("Turin", 3);
        refuse_rollback(
            cache.path(),
            &fetched(tdx_collateral(
                "2025-07-19T00:00:00Z",
                18,
                &other_ca,
                &root_crl,
            )),
        )
        .unwrap();
    }
}
