//! AMD's Key Distribution Service: the VCEK that signed a SEV-SNP report
//! (named by chip and reported TCB), the product line's ASK/ARK chain and
//! its CRL. The chain must be the one pinned in `keel-verifier`, and the
//! VCEK must verify the report against those pinned roots before anything
//! is written.

use keel_verifier::cpu::binding::HclReport;
use keel_verifier::cpu::collateral::{snp_certificate_path, MAX_COLLATERAL_BYTES};
use keel_verifier::cpu::snp::{self, AmdRoots, SnpError, PINNED};
use keel_verifier::cpu::{BindingError, MAX_CERTIFICATE_BYTES};
use x509_parser::prelude::{FromDer as _, X509Certificate};
use x509_parser::revocation_list::CertificateRevocationList;

use super::http::{Http, HttpError};
use super::CacheFile;

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

/// Why the VCEK could not be fetched or was refused.
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
    #[error("the report is signed by a VLEK, which AMD's KDS does not serve by chip: install the cloud provider's VLEK as {path} in the cache")]
    Vlek {
        /// Where the cache expects it.
        path: String,
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
    #[error("cert_chain: expected AMD's pinned ASK and ARK for {product}, actual {actual}")]
    Chain {
        /// The product line.
        product: &'static str,
        /// What was served, described.
        actual: String,
    },
    /// The VCEK does not verify the report against the pinned roots.
    #[error("the fetched VCEK does not verify the report against AMD's pinned roots")]
    Vcek(#[source] SnpError),
    /// The CRL is malformed, from another issuer, or past its next update.
    #[error("{product} CRL: {reason}")]
    Crl {
        /// The product line.
        product: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The CRL lists the VCEK.
    #[error("{product} CRL revokes the VCEK (serial {serial})")]
    Revoked {
        /// The product line.
        product: &'static str,
        /// The VCEK's serial (hex).
        serial: String,
    },
}

/// Fetches what the cache needs for `evidence` (a raw SNP report or an Azure
/// HCL report) from the KDS at `base`, checked at `now`.
pub async fn fetch(
    http: &Http,
    base: &str,
    evidence: &[u8],
    product: Option<Product>,
    now: u64,
) -> Result<Vec<CacheFile>, KdsError> {
    let raw = if evidence.starts_with(b"HCLA") {
        HclReport::parse(evidence).map_err(KdsError::Hcl)?.report
    } else {
        evidence
    };
    let report = snp::parse(raw).map_err(KdsError::Report)?;
    let vcek_path = snp_certificate_path(&report);
    if report.key_info.signing_key() == 1 {
        return Err(KdsError::Vlek { path: vcek_path });
    }
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
    eprintln!(
        "keel: SEV-SNP {name}, chip {}…, reported TCB bootloader {} tee {} snp {} microcode {}",
        hex::encode(report.chip_id.get(..8).unwrap_or_default()),
        t.bootloader,
        t.tee,
        t.snp,
        t.microcode
    );

    let base = base.trim_end_matches('/');
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
    let chain_url = format!("{base}/vcek/v1/{name}/cert_chain");
    let chain = super::get(http, "ASK/ARK chain", &chain_url, MAX_CHAIN_BYTES)
        .await?
        .body;
    let crl_url = format!("{base}/vcek/v1/{name}/crl");
    let max_crl = usize::try_from(MAX_COLLATERAL_BYTES).unwrap_or(usize::MAX);
    let crl = super::get(http, "CRL", &crl_url, max_crl).await?.body;

    let pinned = pinned_chain(product, &chain)?;
    snp::verify_signed(raw, &report, &vcek, &AmdRoots::pinned(), now).map_err(KdsError::Vcek)?;
    eprintln!("keel: the VCEK verifies the report against AMD's pinned {name} roots");
    check_crl(product, &crl, &pinned, &vcek, now)?;

    Ok(vec![
        CacheFile::new(vcek_path, vcek),
        CacheFile::new(format!("snp/{name}/cert_chain.pem"), chain),
        CacheFile::new(format!("snp/{name}/crl.der"), crl),
    ])
}

/// The served chain as DER (ASK, ARK), which must equal the pinned one.
fn pinned_chain(product: Product, served: &[u8]) -> Result<Vec<Vec<u8>>, KdsError> {
    let ders = |pem: &[u8]| -> Vec<Vec<u8>> {
        x509_parser::pem::Pem::iter_from_buffer(pem)
            .filter_map(Result::ok)
            .map(|p| p.contents)
            .collect()
    };
    let served = ders(served);
    let ask_name = format!("SEV-{}", product.name());
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
    PINNED
        .iter()
        .map(|pem| ders(pem.as_bytes()))
        .find(|pinned| is_product(pinned) && *pinned == served)
        .ok_or_else(|| KdsError::Chain {
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
            Ok((_, c)) => c.subject().to_string(),
            Err(_) => "a certificate that does not parse".into(),
        })
        .collect::<Vec<_>>()
        .join(", then ")
}

/// The CRL must parse, be issued by the ARK, be current, and not list the
/// VCEK. Its RSA-PSS signature is not checked here (nothing reads the CRL
/// while verifying; see the collateral docs).
fn check_crl(
    product: Product,
    crl: &[u8],
    pinned: &[Vec<u8>],
    vcek: &[u8],
    now: u64,
) -> Result<(), KdsError> {
    let bad = |reason: String| KdsError::Crl {
        product: product.name(),
        reason,
    };
    let (_, crl) = CertificateRevocationList::from_der(crl)
        .map_err(|e| bad(format!("does not parse: {e}")))?;
    let ark = pinned
        .get(1)
        .and_then(|der| X509Certificate::from_der(der).ok())
        .map(|(_, ark)| ark.subject().to_string())
        .unwrap_or_default();
    let issuer = crl.issuer().to_string();
    if issuer != ark {
        return Err(bad(format!("issuer: expected {ark}, actual {issuer}")));
    }
    if let Some(next) = crl.next_update() {
        let next = next.timestamp();
        if next < i64::try_from(now).unwrap_or(i64::MAX) {
            return Err(bad(format!(
                "nextUpdate {next} is before the current time {now}"
            )));
        }
    }
    let serial = X509Certificate::from_der(vcek)
        .map(|(_, c)| c.raw_serial().to_vec())
        .unwrap_or_default();
    if crl
        .iter_revoked_certificates()
        .any(|r| r.raw_serial() == serial)
    {
        return Err(KdsError::Revoked {
            product: product.name(),
            serial: hex::encode(serial),
        });
    }
    eprintln!(
        "keel: the {} CRL names {} revoked certificates, not this VCEK",
        product.name(),
        crl.iter_revoked_certificates().count()
    );
    Ok(())
}
