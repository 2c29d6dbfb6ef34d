//! AMD's Key Distribution Service: the VCEK that signed a SEV-SNP report
//! (named by chip and reported TCB), the product line's ASK/ARK chain and
//! its CRL. The chain must be the one pinned in `keel-verifier`, the VCEK
//! must verify the report against those pinned roots, and the CRL must be
//! the ARK's, signed by it, current, and revoke neither the ASK nor the
//! VCEK (the verifier's own check) before anything is written.
//!
//! KDS does not serve VLEKs (a cloud provider holds its own): for a report
//! a VLEK signed, the VLEK must be in the cache already, and the fetch
//! takes the line's ASVK/ARK chain and VLEK CRL, checked the same way.

use keel_verifier::cpu::binding::HclReport;
use keel_verifier::cpu::collateral::{snp_certificate_path, snp_crl_path, MAX_COLLATERAL_BYTES};
use keel_verifier::cpu::snp::{self, AmdRoots, SigningKey, SnpError};
use keel_verifier::cpu::{BindingError, MAX_CERTIFICATE_BYTES};
use x509_parser::prelude::{FromDer as _, X509Certificate};

use super::http::{Http, HttpError};
use super::{CacheFile, Kind};
use crate::printable::printable;

/// AMD's KDS.
pub const DEFAULT_URL: &str = "https://kdsintf.amd.com";

/// Largest ASK/ARK chain accepted (two RSA-4096 certificates, PEM).
const MAX_CHAIN_BYTES: usize = 16 * 1024;

/// An AMD EPYC product line, as KDS names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Product {
    /// EPYC 7003.
    Milan,
    /// EPYC 9004.
    Genoa,
    /// EPYC 9005.
    Turin,
}

impl Product {
    fn name(self) -> &'static str {
        match self {
            Self::Milan => "Milan",
            Self::Genoa => "Genoa",
            Self::Turin => "Turin",
        }
    }

    /// The product line of a CPUID family and model (reports of version 3
    /// and later carry them).
    fn from_cpuid(family: u8, model: u8) -> Option<Self> {
        match (family, model) {
            (0x19, 0x00..=0x0f) => Some(Self::Milan),
            (0x19, 0x10..=0x1f | 0xa0..=0xaf) => Some(Self::Genoa),
            (0x1a, 0x00..=0x11) => Some(Self::Turin),
            _ => None,
        }
    }
}

/// Why a report's endorsement key, chain or list could not be fetched or
/// was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KdsError {
    /// The evidence is neither an SNP report nor an Azure HCL report.
    #[error("the report does not parse")]
    Report(#[source] SnpError),
    /// The evidence looked like an HCL report and is malformed.
    #[error("the HCL report is malformed")]
    Hcl(#[source] BindingError),
    /// VLEKs are provisioned to a cloud provider, not served by chip.
    #[error("the report is signed by a VLEK, which AMD's KDS does not serve by chip: install the cloud provider's VLEK as {path}, then fetch again for the product line's VLEK CRL")]
    Vlek {
        /// Where the cache expects it.
        path: String,
    },
    /// The cached VLEK could not be read.
    #[error("reading the cached VLEK {path}")]
    VlekRead {
        /// Where the cache holds it.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The report does not name its product line and none was given.
    #[error("report version {version} does not name its product line: pass --product")]
    ProductUnknown {
        /// The report version.
        version: u32,
    },
    /// The report's CPUID names no product line KDS serves.
    #[error("report CPUID family {family:#x} model {model:#x}: no product line KDS serves")]
    Cpuid {
        /// CPUID family.
        family: u8,
        /// CPUID model.
        model: u8,
    },
    /// `--product` contradicts the report's CPUID.
    #[error("--product: expected {reported} (the report's CPUID), actual {given}")]
    ProductMismatch {
        /// What the report's CPUID says.
        reported: &'static str,
        /// What was given.
        given: &'static str,
    },
    /// A download failed.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// KDS served another chain than the pinned one.
    #[error(
        "cert_chain: expected AMD's pinned {intermediate} and ARK for {product}, actual {actual}"
    )]
    Chain {
        /// `ASK`, or `ASVK` for a VLEK.
        intermediate: &'static str,
        /// The product line.
        product: &'static str,
        /// What was served, described.
        actual: String,
    },
    /// The endorsement key (the fetched VCEK or the cached VLEK) does not
    /// verify the report against the pinned roots.
    #[error("the {key} does not verify the report against AMD's pinned roots")]
    EndorsementKey {
        /// `fetched VCEK` or `cached VLEK`.
        key: &'static str,
        /// Why.
        #[source]
        source: SnpError,
    },
    /// The endorsement key is certified for another product line than the
    /// report's (a version 2 report with the wrong `--product`).
    #[error("the {key} is certified for {actual}, not for {expected}, the report's product line (its CPUID or --product)")]
    KeyProduct {
        /// `fetched VCEK` or `cached VLEK`.
        key: &'static str,
        /// The product line fetched for.
        expected: &'static str,
        /// The product line of the key's chain.
        actual: String,
    },
    /// AMD's CRL (or VLEK CRL) is not the ARK's (its issuer or its
    /// signature), is not current, or revokes the ASK (ASVK) or the VCEK
    /// (VLEK).
    #[error(transparent)]
    Crl(SnpError),
}

/// Fetches what the cache at `cache` needs for `evidence` (a raw SNP report
/// or an Azure HCL report) from the KDS at `base`, checked at `now` against
/// `roots` (PEM bundles of an ASK or ASVK and its ARK: [`snp::PINNED`] but
/// in tests). A VLEK report's VLEK is read from the cache.
pub async fn fetch(
    http: &Http,
    base: &str,
    evidence: &[u8],
    product: Option<Product>,
    now: u64,
    roots: &[&str],
    cache: &std::path::Path,
) -> Result<Vec<CacheFile>, KdsError> {
    let raw = if evidence.starts_with(b"HCLA") {
        HclReport::parse(evidence).map_err(KdsError::Hcl)?.report
    } else {
        evidence
    };
    let report = snp::parse(raw).map_err(KdsError::Report)?;
    let vcek_path = snp_certificate_path(&report);
    let cached_vlek = if report.key_info.signing_key() == 1 {
        Some(read_vlek(cache, &vcek_path)?)
    } else {
        None
    };
    let product = match (report.cpuid_fam_id, report.cpuid_mod_id, product) {
        (Some(family), Some(model), given) => {
            let reported =
                Product::from_cpuid(family, model).ok_or(KdsError::Cpuid { family, model })?;
            if let Some(given) = given.filter(|g| *g != reported) {
                return Err(KdsError::ProductMismatch {
                    reported: reported.name(),
                    given: given.name(),
                });
            }
            reported
        }
        (_, _, Some(given)) => given,
        _ => {
            return Err(KdsError::ProductUnknown {
                version: report.version,
            })
        }
    };
    let name = product.name();
    let t = report.reported_tcb;
    let base = base.trim_end_matches('/');
    let max_crl = usize::try_from(MAX_COLLATERAL_BYTES).unwrap_or(usize::MAX);
    if let Some(vlek) = cached_vlek {
        eprintln!(
            "keel: SEV-SNP {name}, for the cached VLEK {vcek_path}, reported TCB \
             bootloader {} tee {} snp {} microcode {}",
            t.bootloader, t.tee, t.snp, t.microcode
        );
        // Nothing to fetch for a VLEK that does not verify the report.
        let key = verify_key(raw, vlek, SigningKey::Vlek, product, roots, now)?;
        let chain_url = format!("{base}/vlek/v1/{name}/cert_chain");
        let chain = super::get(http, "ASVK/ARK chain", &chain_url, MAX_CHAIN_BYTES)
            .await?
            .body;
        let crl_url = format!("{base}/vlek/v1/{name}/crl");
        let crl = super::get(http, "VLEK CRL", &crl_url, max_crl).await?.body;
        let files = checked(raw, product, Served { key, chain, crl }, now, roots)?;
        // The VLEK is in the cache already: only the chain and the list
        // are written.
        return Ok(files.into_iter().skip(1).collect());
    }
    eprintln!(
        "keel: SEV-SNP {name}, chip {}…, reported TCB bootloader {} tee {} snp {} microcode {}",
        hex::encode(report.chip_id.get(..8).unwrap_or_default()),
        t.bootloader,
        t.tee,
        t.snp,
        t.microcode
    );
    let vcek_url = match product {
        Product::Turin => format!(
            "{base}/vcek/v1/{name}/{}?fmcSPL={:02}&blSPL={:02}&teeSPL={:02}&snpSPL={:02}&ucodeSPL={:02}",
            hex::encode(report.chip_id.get(..8).unwrap_or_default()),
            t.fmc.unwrap_or(0),
            t.bootloader,
            t.tee,
            t.snp,
            t.microcode
        ),
        _ => format!(
            "{base}/vcek/v1/{name}/{}?blSPL={:02}&teeSPL={:02}&snpSPL={:02}&ucodeSPL={:02}",
            hex::encode(report.chip_id),
            t.bootloader,
            t.tee,
            t.snp,
            t.microcode
        ),
    };
    let vcek = super::get(http, "VCEK", &vcek_url, MAX_CERTIFICATE_BYTES)
        .await?
        .body;
    let key = verify_key(raw, vcek, SigningKey::Vcek, product, roots, now)?;
    let chain_url = format!("{base}/vcek/v1/{name}/cert_chain");
    let chain = super::get(http, "ASK/ARK chain", &chain_url, MAX_CHAIN_BYTES)
        .await?
        .body;
    let crl_url = format!("{base}/vcek/v1/{name}/crl");
    let crl = super::get(http, "CRL", &crl_url, max_crl).await?.body;
    checked(raw, product, Served { key, chain, crl }, now, roots)
}

/// An endorsement key (DER) that [`verify_key`] found to verify the report
/// against the pinned roots, certified for the line fetched for.
struct VerifiedKey {
    der: Vec<u8>,
    kind: SigningKey,
}

/// What the KDS served for a report (and, for a VLEK, what the cache held).
struct Served {
    /// The endorsement key, verified before the rest was fetched.
    key: VerifiedKey,
    /// The ASK or ASVK, then the ARK (PEM).
    chain: Vec<u8>,
    /// The list of the product line for `kind` (DER).
    crl: Vec<u8>,
}

/// The cache files for the report `raw` of `product`, once `served.chain`
/// is the pinned chain of the line for its (verified) key's kind, and the
/// list passes the verifier's revocation check: the endorsement key, the
/// chain and the list.
fn checked(
    raw: &[u8],
    product: Product,
    served: Served,
    now: u64,
    roots: &[&str],
) -> Result<Vec<CacheFile>, KdsError> {
    let report = snp::parse(raw).map_err(KdsError::Report)?;
    let Served {
        key: VerifiedKey { der: key, kind },
        chain,
        crl,
    } = served;
    let name = product.name();
    pinned_chain(product, kind, &chain, roots)?;
    let chain_file = match kind {
        SigningKey::Vcek => "cert_chain.pem",
        SigningKey::Vlek => "vlek_cert_chain.pem",
    };
    let revoked =
        snp::check_revocation(&crl, &key, &pinned_roots(roots), now).map_err(KdsError::Crl)?;
    eprintln!(
        "keel: the {name} {} is the ARK's, current, and names {revoked} revoked certificates, \
         neither the {} nor this {kind}",
        kind.crl_name(),
        kind.intermediate()
    );
    let crl_path = snp_crl_path(name, kind).ok_or(KdsError::ProductUnknown {
        version: report.version,
    })?;
    Ok(vec![
        CacheFile::new(snp_certificate_path(&report), key, Kind::Certificate),
        CacheFile::new(format!("snp/{name}/{chain_file}"), chain, Kind::Certificate),
        CacheFile::new(crl_path, crl, Kind::Crl),
    ])
}

/// Checks that `key`, of `kind`, verifies the report `raw` against the
/// pinned `roots` at `now` and is certified for `product`'s line.
fn verify_key(
    raw: &[u8],
    key: Vec<u8>,
    kind: SigningKey,
    product: Product,
    roots: &[&str],
    now: u64,
) -> Result<VerifiedKey, KdsError> {
    let label = key_label(kind);
    let report = snp::parse(raw).map_err(KdsError::Report)?;
    let claims = snp::verify_signed(raw, &report, &key, &pinned_roots(roots), now)
        .map_err(|source| KdsError::EndorsementKey { key: label, source })?;
    // Every pinned root is trusted, so the key may chain to another line's
    // ARK: its line's list must not be cached under this line's name.
    let line = snp::product_line(&claims.product);
    if line != product.name() {
        return Err(KdsError::KeyProduct {
            key: label,
            expected: product.name(),
            actual: line.to_owned(),
        });
    }
    eprintln!(
        "keel: the {label} verifies the report against AMD's pinned {} roots",
        product.name()
    );
    Ok(VerifiedKey { der: key, kind })
}

/// How the messages name the endorsement key of `kind`: the VCEK is
/// fetched, the VLEK read from the cache.
fn key_label(kind: SigningKey) -> &'static str {
    match kind {
        SigningKey::Vcek => "fetched VCEK",
        SigningKey::Vlek => "cached VLEK",
    }
}

/// The roots every fetched or cached key is checked against.
fn pinned_roots(roots: &[&str]) -> AmdRoots {
    AmdRoots::from_pem_bundles(&roots.iter().map(|r| r.as_bytes()).collect::<Vec<_>>())
}

/// The provider's VLEK for a report, from the cache at `relative`.
fn read_vlek(cache: &std::path::Path, relative: &str) -> Result<Vec<u8>, KdsError> {
    let path = cache.join(relative);
    let read_err = |source| KdsError::VlekRead {
        path: path.display().to_string(),
        source,
    };
    match keel_verifier::bounded::read_regular(&path, MAX_CERTIFICATE_BYTES as u64) {
        Ok(Some(vlek)) => Ok(vlek),
        Ok(None) => Err(read_err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {MAX_CERTIFICATE_BYTES} bytes"),
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(KdsError::Vlek {
            path: path.display().to_string(),
        }),
        Err(e) => Err(read_err(e)),
    }
}

/// The served chain as DER (ASK or ASVK, ARK), which must equal the one of
/// `roots` whose intermediate certifies `kind` for `product`.
fn pinned_chain(
    product: Product,
    kind: SigningKey,
    served: &[u8],
    roots: &[&str],
) -> Result<(), KdsError> {
    let ders = |pem: &[u8]| -> Vec<Vec<u8>> {
        x509_parser::pem::Pem::iter_from_buffer(pem)
            .filter_map(Result::ok)
            .map(|p| p.contents)
            .collect()
    };
    let served = ders(served);
    let ask_name = kind.issuer_name(product.name());
    let is_product = |chain: &Vec<Vec<u8>>| {
        chain
            .first()
            .and_then(|ask| X509Certificate::from_der(ask).ok())
            .and_then(|(_, ask)| {
                ask.subject()
                    .iter_common_name()
                    .next()
                    .and_then(|cn| cn.as_str().ok().map(|cn| cn == ask_name))
            })
            .unwrap_or(false)
    };
    roots
        .iter()
        .map(|pem| ders(pem.as_bytes()))
        .find(|pinned| is_product(pinned) && *pinned == served)
        .map(drop)
        .ok_or_else(|| KdsError::Chain {
            intermediate: kind.intermediate(),
            product: product.name(),
            actual: describe(&served),
        })
}

/// The subjects of a served chain, for an error message.
fn describe(chain: &[Vec<u8>]) -> String {
    if chain.is_empty() {
        return "no certificate".into();
    }
    chain
        .iter()
        .map(|der| match X509Certificate::from_der(der) {
            Ok((_, c)) => printable(&c.subject().to_string()).to_string(),
            Err(_) => "a certificate that does not parse".into(),
        })
        .collect::<Vec<_>>()
        .join(", then ")
}

/// The whole fetch against a generated look-alike of AMD's Milan chain,
/// whose ARK signs CRLs as AMD's does (AMD's own CRL is not among the test
/// vectors, and its ARK signs nothing here).
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use keel_testkit::amd::{ReportFields, TestAmd};
    use keel_testkit::mirror::MirrorServer;
    use keel_verifier::cpu::Collateral;
    use time::{Duration, OffsetDateTime};

    struct GeneratedKds {
        amd: TestAmd,
        report: Vec<u8>,
        mirror: MirrorServer,
        /// The cache the fetch reads a VLEK from.
        cache: tempfile::TempDir,
        /// Where KDS serves the line's list: `vcek` or `vlek`.
        kind: &'static str,
    }

    fn report_of(amd: &TestAmd) -> Vec<u8> {
        amd.report(&ReportFields::guest([1; 64], [2; 48])).unwrap()
    }

    impl GeneratedKds {
        /// A KDS for `amd`'s Milan line serving, under `/<kind>/v1/Milan/`,
        /// its chain and a current CRL, with an empty cache.
        fn serving(amd: TestAmd, kind: &'static str) -> Self {
            let report = report_of(&amd);
            let mirror = MirrorServer::start().unwrap();
            mirror.serve(
                &format!("/{kind}/v1/Milan/cert_chain"),
                amd.roots_pem().as_bytes().to_vec(),
            );
            let kds = Self {
                amd,
                report,
                mirror,
                cache: tempfile::tempdir().unwrap(),
                kind,
            };
            kds.serve_crl(&[], 7);
            kds
        }

        /// A KDS for a Milan chip's VCEK: it serves the VCEK, the ASK/ARK
        /// chain and the CRL.
        fn new() -> Self {
            let kds = Self::serving(TestAmd::for_line("Milan").unwrap(), "vcek");
            kds.serve_vcek("Milan");
            kds
        }

        /// Serves the report's VCEK where a fetch for `line` asks for it.
        fn serve_vcek(&self, line: &str) {
            let chip = snp::parse(&self.report).unwrap().chip_id;
            self.mirror.serve(
                &format!(
                    "/vcek/v1/{line}/{}?blSPL=03&teeSPL=00&snpSPL=08&ucodeSPL=115",
                    hex::encode(chip)
                ),
                self.amd.vcek_der().to_vec(),
            );
        }

        /// A KDS for a VLEK of Milan: it serves the ASVK/ARK chain and the
        /// VLEK CRL; the VLEK is not in the cache yet.
        fn vlek() -> Self {
            Self::serving(TestAmd::vlek_for_line("Milan").unwrap(), "vlek")
        }

        /// Where the fetch looks for the report's VLEK.
        fn vlek_path(&self) -> std::path::PathBuf {
            let relative = snp_certificate_path(&snp::parse(&self.report).unwrap());
            self.cache.path().join(relative)
        }

        /// Puts the VLEK into the cache where the fetch looks for it.
        fn cache_vlek(&self) {
            let path = self.vlek_path();
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, self.amd.vcek_der()).unwrap();
        }

        /// Serves a CRL revoking `revoked`, its next update `days` from now.
        fn serve_crl(&self, revoked: &[Vec<u8>], days: i64) {
            self.serve_crl_issued(revoked, 8, days);
        }

        /// Serves a CRL revoking `revoked`, issued `ago` days ago, its next
        /// update `days` from now.
        fn serve_crl_issued(&self, revoked: &[Vec<u8>], ago: i64, days: i64) {
            let now = OffsetDateTime::now_utc();
            let crl = self
                .amd
                .crl(
                    revoked,
                    now - Duration::days(ago),
                    now + Duration::days(days),
                )
                .unwrap();
            self.mirror
                .serve(&format!("/{}/v1/Milan/crl", self.kind), crl);
        }

        /// Fetches for Milan with this KDS's roots pinned.
        fn fetch(&self) -> Result<Vec<CacheFile>, KdsError> {
            self.fetch_with(Product::Milan, &[self.amd.roots_pem()])
        }

        /// Fetches for `product` with `roots` pinned.
        fn fetch_with(&self, product: Product, roots: &[&str]) -> Result<Vec<CacheFile>, KdsError> {
            let http = Http::new(std::time::Duration::from_secs(10)).unwrap();
            let now = u64::try_from(OffsetDateTime::now_utc().unix_timestamp()).unwrap();
            super::super::block_on(fetch(
                &http,
                &self.mirror.base_url(),
                &self.report,
                Some(product),
                now,
                roots,
                self.cache.path(),
            ))
        }
    }

    /// A CRL of `amd`'s ARK revoking nothing, current for a week.
    fn current_crl(amd: &TestAmd) -> Vec<u8> {
        let now = OffsetDateTime::now_utc();
        amd.crl(&[], now - Duration::days(1), now + Duration::days(7))
            .unwrap()
    }

    fn serial(der: &[u8]) -> Vec<u8> {
        X509Certificate::from_der(der)
            .unwrap()
            .1
            .raw_serial()
            .to_vec()
    }

    #[test]
    fn a_checked_crl_is_cached_where_the_verifier_reads_it() {
        let kds = GeneratedKds::new();
        let files = kds.fetch().unwrap();
        let names: Vec<&str> = files.iter().map(|f| f.relative.as_str()).collect();
        assert_eq!(
            names[1..],
            ["snp/Milan/cert_chain.pem", "snp/Milan/crl.der"]
        );
        let cache = tempfile::tempdir().unwrap();
        for f in &files {
            let path = cache.path().join(&f.relative);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, &f.bytes).unwrap();
        }
        let crl = Collateral::at(cache.path())
            .snp_crl(snp::product_line("SEV-Milan"), SigningKey::Vcek)
            .unwrap()
            .expect("the cached CRL");
        assert_eq!(crl, files[2].bytes);
    }

    #[test]
    fn a_crl_that_revokes_is_forged_or_stale_refuses_the_fetch() {
        let kds = GeneratedKds::new();
        kds.serve_crl(&[serial(kds.amd.vcek_der())], 7);
        let e = kds.fetch().unwrap_err().to_string();
        assert!(e.contains("Milan CRL revokes the endorsement key"), "{e}");

        kds.serve_crl(&[serial(kds.amd.ask_der())], 7);
        let e = kds.fetch().unwrap_err().to_string();
        assert!(e.contains("Milan CRL revokes the ASK"), "{e}");

        kds.serve_crl(&[], -1);
        let e = kds.fetch().unwrap_err().to_string();
        assert!(e.contains("fetch it again"), "{e}");

        let impostor = TestAmd::for_line("Milan").unwrap();
        let now = OffsetDateTime::now_utc();
        kds.mirror.serve(
            "/vcek/v1/Milan/crl",
            impostor
                .crl(&[], now - Duration::days(1), now + Duration::days(7))
                .unwrap(),
        );
        let e = kds.fetch().unwrap_err().to_string();
        assert!(e.contains("signature does not verify with the ARK"), "{e}");
    }

    #[test]
    fn a_crl_older_than_the_cached_one_is_refused_and_the_cache_kept() {
        let kds = GeneratedKds::new();
        let cache = tempfile::tempdir().unwrap();
        let crl_path = cache.path().join("snp/Milan/crl.der");
        // The cache holds a CRL from yesterday that revokes another chip's
        // VCEK.
        let other_chip = vec![0x42; 8];
        kds.serve_crl_issued(std::slice::from_ref(&other_chip), 1, 7);
        super::super::store(cache.path(), &kds.fetch().unwrap()).unwrap();
        let newer = std::fs::read(&crl_path).unwrap();

        // An older CRL, signed and current, that does not revoke it: every
        // check of the fetch passes, the cache refuses it.
        kds.serve_crl_issued(&[], 8, 7);
        let files = kds.fetch().unwrap();
        let e = super::super::store(cache.path(), &files).unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("refusing snp/Milan/crl.der: its CRL's thisUpdate is")
                && e.contains("older than the cached one's"),
            "{e}"
        );
        assert_eq!(std::fs::read(&crl_path).unwrap(), newer);
        let (_, kept) =
            x509_parser::revocation_list::CertificateRevocationList::from_der(&newer).unwrap();
        assert_eq!(kept.iter_revoked_certificates().count(), 1);

        // The same CRL again, and a newer one, replace it.
        kds.serve_crl_issued(std::slice::from_ref(&other_chip), 1, 7);
        super::super::store(cache.path(), &kds.fetch().unwrap()).unwrap();
        kds.serve_crl_issued(&[], 0, 7);
        let files = kds.fetch().unwrap();
        super::super::store(cache.path(), &files).unwrap();
        assert_eq!(std::fs::read(&crl_path).unwrap(), files[2].bytes);
    }

    /// Attacker's move (whoever answers for KDS), or an operator's slip: a
    /// version 2 report does not name its line, `--product` names another,
    /// and KDS serves that line's pinned chain with the report's own VCEK
    /// and list. The key verifies (every pinned root is trusted), but its
    /// line's list must not be cached as the other line's.
    #[test]
    fn a_key_of_another_line_than_the_product_is_refused() {
        let kds = GeneratedKds::new();
        let genoa = TestAmd::for_line("Genoa").unwrap();
        kds.serve_vcek("Genoa");
        kds.mirror.serve(
            "/vcek/v1/Genoa/cert_chain",
            genoa.roots_pem().as_bytes().to_vec(),
        );
        kds.mirror
            .serve("/vcek/v1/Genoa/crl", current_crl(&kds.amd));
        let e = kds
            .fetch_with(Product::Genoa, &[kds.amd.roots_pem(), genoa.roots_pem()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the fetched VCEK is certified for Milan, not for Genoa"),
            "{e}"
        );
    }

    /// A VLEK report: KDS does not serve the VLEK, so the fetch asks for
    /// it in the cache, then takes the line's ASVK chain and VLEK CRL,
    /// where the verifier reads the list for VLEK reports.
    #[test]
    fn a_vlek_reports_chain_and_list_are_cached_once_its_vlek_is() {
        let kds = GeneratedKds::vlek();
        let e = kds.fetch().unwrap_err().to_string();
        assert!(
            e.contains("signed by a VLEK") && e.contains("snp/vlek-3-0-8-115.der"),
            "{e}"
        );
        // Something other than a file in its place is no VLEK.
        std::fs::create_dir_all(kds.vlek_path()).unwrap();
        let e = kds.fetch().unwrap_err();
        assert!(matches!(e, KdsError::VlekRead { .. }), "{e:?}");
        std::fs::remove_dir(kds.vlek_path()).unwrap();
        kds.cache_vlek();
        let files = kds.fetch().unwrap();
        let names: Vec<&str> = files.iter().map(|f| f.relative.as_str()).collect();
        assert_eq!(
            names,
            ["snp/Milan/vlek_cert_chain.pem", "snp/Milan/vlek-crl.der"]
        );
        super::super::store(kds.cache.path(), &files).unwrap();
        let cached = Collateral::at(kds.cache.path());
        let list = cached.snp_crl("Milan", SigningKey::Vlek).unwrap();
        assert_eq!(list.as_deref(), Some(files[1].bytes.as_slice()));
        assert_eq!(cached.snp_crl("Milan", SigningKey::Vcek).unwrap(), None);
    }

    /// Attacker's move, or a provider's slip: a VLEK certified under
    /// another line's ASVK than the line the report's CPUID names, so that
    /// line's chain and list would be cached under the report's line.
    /// Refused before anything is fetched.
    #[test]
    fn a_cached_vlek_of_another_line_is_refused_before_any_fetch() {
        let kds = GeneratedKds::serving(TestAmd::vlek_for_line("Genoa").unwrap(), "vlek");
        kds.cache_vlek();
        let e = kds.fetch().unwrap_err().to_string();
        assert!(
            e.contains("the cached VLEK is certified for Genoa, not for Milan"),
            "{e}"
        );
        assert_eq!(kds.mirror.requests("/vlek/v1/Milan/cert_chain"), 0);
        assert_eq!(kds.mirror.requests("/vlek/v1/Milan/crl"), 0);
    }

    /// Attacker's move (whoever answers for KDS): serve a VLEK CRL that
    /// revokes the VLEK or its ASVK, one another ARK of the same name
    /// signed, or the VCEK chain. Each is refused, so there is nothing to
    /// write.
    #[test]
    fn a_vlek_fetch_that_does_not_check_out_is_refused() {
        let kds = GeneratedKds::vlek();
        kds.cache_vlek();
        kds.serve_crl(&[serial(kds.amd.vcek_der())], 7);
        let e = kds.fetch().unwrap_err().to_string();
        assert!(
            e.contains("Milan VLEK CRL revokes the endorsement key"),
            "{e}"
        );
        kds.serve_crl(&[serial(kds.amd.ask_der())], 7);
        let e = kds.fetch().unwrap_err().to_string();
        assert!(e.contains("Milan VLEK CRL revokes the ASVK"), "{e}");

        let vcek_line = TestAmd::for_line("Milan").unwrap();
        kds.mirror
            .serve("/vlek/v1/Milan/crl", current_crl(&vcek_line));
        let e = kds.fetch().unwrap_err().to_string();
        assert!(
            e.contains("Milan VLEK CRL: its signature does not verify with the ARK"),
            "{e}"
        );

        kds.serve_crl(&[], 7);
        kds.mirror.serve(
            "/vlek/v1/Milan/cert_chain",
            vcek_line.roots_pem().as_bytes().to_vec(),
        );
        // Both chains pinned: the served ASK chain is pinned, but not as
        // the line's ASVK.
        let e = kds
            .fetch_with(
                Product::Milan,
                &[kds.amd.roots_pem(), vcek_line.roots_pem()],
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("expected AMD's pinned ASVK and ARK for Milan"),
            "{e}"
        );
    }
}
