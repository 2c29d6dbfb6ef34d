//! AMD SEV-SNP: an attestation report verified offline against the AMD
//! roots pinned here (ARK, ASK and ASVK for Milan, Genoa and Turin; the
//! ASVK issues the VLEKs of VLEK-signed reports).
//!
//! `sev` parses the report. The RSASSA-PSS SHA-384 chain (ARK self-signed,
//! ARK → ASK/ASVK → VCEK/VLEK) and the report's own ECDSA P-384 signature
//! are checked here with `ring`, over the bytes exactly as received (`sev`
//! verifies a re-encoding of its parsed form, which need not cover every
//! byte). The two links between pinned certificates are checked once, when
//! the roots are loaded: only the endorsement key's link is per report. The
//! endorsement key certificate must be valid at the verification time,
//! certify this chip (`hwID`, VCEK only: a VLEK report masks the chip ID)
//! and certify exactly the reported TCB. [`SnpClaims::check`] then holds
//! the authentic report to the policy: the TCB to the minimum of its
//! product line (the chain names the line), the guest policy and platform
//! bits, the guest SVN, the measurement and the pinned key digests.
//!
//! [`check_revocation`] checks one of AMD's two revocation lists for a
//! product line, both issued by its ARK: the CRL for a VCEK's chain, the
//! VLEK CRL for a VLEK's. The list must be signed by the ARK with RSASSA-PSS
//! SHA-384, be current, and list neither the ASK (or ASVK) nor the
//! endorsement key. AMD revokes intermediates this way; endorsement keys
//! carry serial 0 and are not expected to be listed, but their serial is
//! checked all the same.

use ring::signature::{UnparsedPublicKey, ECDSA_P384_SHA384_FIXED, RSA_PSS_2048_8192_SHA384};
use sev::firmware::guest::{AttestationReport, GuestPolicy, PlatformInfo};
use sev::parser::ByteParser as _;
use subtle::ConstantTimeEq as _;
use x509_parser::prelude::{FromDer as _, X509Certificate};
use x509_parser::revocation_list::CertificateRevocationList;

use super::policy::{pinned, pinned_one_of, MinimumTcb, SnpPolicy, Tcb};

/// Size of an SNP attestation report.
pub const REPORT_BYTES: usize = 1184;
/// The signed part of a report: bytes 0 to 0x29F.
const SIGNED_BYTES: usize = 0x2a0;
/// ECDSA P-384 with SHA-384, the only signature algorithm reports use.
const SIG_ALGO_ECDSA_P384_SHA384: u32 = 1;

/// AMD's pinned roots: each ASK (or ASVK) with the ARK that signs it, PEM,
/// as AMD's KDS serves them (`cert_chain`).
pub const PINNED: [&str; 6] = [
    include_str!("amd/ask_ark_milan.pem"),
    include_str!("amd/ask_ark_genoa.pem"),
    include_str!("amd/ask_ark_turin.pem"),
    include_str!("amd/ask_ark_milan_vlek.pem"),
    include_str!("amd/ask_ark_genoa_vlek.pem"),
    include_str!("amd/ask_ark_turin_vlek.pem"),
];

/// AMD's certificate extensions (VCEK/VLEK specification, chapter 3).
mod oid {
    pub const BOOTLOADER: &str = "1.3.6.1.4.1.3704.1.3.1";
    pub const TEE: &str = "1.3.6.1.4.1.3704.1.3.2";
    pub const SNP: &str = "1.3.6.1.4.1.3704.1.3.3";
    pub const MICROCODE: &str = "1.3.6.1.4.1.3704.1.3.8";
    /// The FMC SVN, in Turin's VCEKs (and its reports' TCB) only.
    pub const FMC: &str = "1.3.6.1.4.1.3704.1.3.9";
    pub const HW_ID: &str = "1.3.6.1.4.1.3704.1.4";
    /// RSASSA-PSS, the algorithm of every certificate in AMD's chains.
    pub const RSASSA_PSS: &str = "1.2.840.113549.1.1.10";
}

/// Why a SEV-SNP report was refused; each variant names its check.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnpError {
    /// The report is not [`REPORT_BYTES`] long.
    #[error("SNP report is {actual} bytes, expected {REPORT_BYTES}")]
    ReportSize {
        /// Its length.
        actual: usize,
    },
    /// The report does not parse.
    #[error("SNP report does not parse")]
    ReportParse(#[source] std::io::Error),
    /// The report is signed with another algorithm than ECDSA P-384.
    #[error("SNP report sig_algo: expected {SIG_ALGO_ECDSA_P384_SHA384}, actual {actual}")]
    SigAlgo {
        /// The report's value.
        actual: u32,
    },
    /// The report names no VCEK or VLEK as its signing key.
    #[error("SNP report signing_key: expected 0 (VCEK) or 1 (VLEK), actual {actual}")]
    SigningKey {
        /// The report's value.
        actual: u32,
    },
    /// The report names one kind of endorsement key and its certificate
    /// chains to the other kind's intermediate (a VCEK under an ASVK, a
    /// VLEK under an ASK).
    #[error(
        "SNP report signing_key names a {signing_key}, but its certificate was issued by {issuer} \
         (a VCEK is issued by an ASK, SEV-<line>; a VLEK by an ASVK, SEV-VLEK-<line>)"
    )]
    SigningKeyIssuer {
        /// The key the report names.
        signing_key: SigningKey,
        /// The intermediate's common name, e.g. `SEV-Milan`.
        issuer: String,
    },
    /// The endorsement key certificate does not parse.
    #[error("SNP endorsement key certificate does not parse")]
    Certificate,
    /// No pinned ASK or ASVK issued the endorsement key certificate.
    #[error("SNP endorsement key issuer {issuer:?} is no pinned AMD signing key")]
    UntrustedIssuer {
        /// The certificate's issuer.
        issuer: String,
    },
    /// A signature of the chain is not RSASSA-PSS SHA-384 or does not
    /// verify.
    #[error("SNP certificate chain: {link} signature does not verify (RSASSA-PSS SHA-384)")]
    Chain {
        /// Which link: `ARK self-signature`, `ARK -> ASK`, `ASK -> VEK`.
        link: &'static str,
    },
    /// The endorsement key certificate is outside its validity period.
    #[error(
        "SNP endorsement key certificate valid {not_before}..{not_after}, verification time {now}"
    )]
    CertificateTime {
        /// Start of validity (Unix seconds).
        not_before: i64,
        /// End of validity (Unix seconds).
        not_after: i64,
        /// The verification time (Unix seconds).
        now: u64,
    },
    /// A pinned certificate of the chain (the ARK, or the ASK or ASVK)
    /// is outside its validity period.
    #[error("SNP root {name} valid {not_before}..{not_after}, verification time {now}")]
    RootTime {
        /// The certificate's common name, e.g. `ARK-Milan`.
        name: String,
        /// Start of validity (Unix seconds).
        not_before: i64,
        /// End of validity (Unix seconds).
        not_after: i64,
        /// The verification time (Unix seconds).
        now: u64,
    },
    /// An AMD extension is missing or malformed in the certificate.
    #[error("SNP endorsement key certificate extension {oid}: {reason}")]
    Extension {
        /// The extension.
        oid: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// The report's TCB layout is not its chain's product line's (Turin's
    /// carries an FMC SVN, the others' do not).
    #[error("SNP report: its TCB layout is not that of {product}'s reports")]
    TcbLayout {
        /// The ASK (or ASVK) that issued the endorsement key.
        product: String,
    },
    /// The VCEK was issued for another chip.
    #[error("SNP chip_id: VCEK certifies {expected}, report has {actual}")]
    ChipId {
        /// The VCEK's hwID (hex).
        expected: String,
        /// The report's chip_id (hex).
        actual: String,
    },
    /// The certificate certifies another TCB than the report states.
    #[error("SNP reported_tcb.{component}: certificate certifies {expected}, report has {actual}")]
    CertifiedTcb {
        /// The TCB component.
        component: &'static str,
        /// The certificate's SPL.
        expected: u8,
        /// The report's SVN.
        actual: u8,
    },
    /// The report's signature does not verify with the endorsement key.
    #[error("SNP report signature does not verify with the endorsement key")]
    Signature,
    /// The guest policy allows debugging.
    #[error("SNP policy.debug: expected 0, actual 1 (policy {policy:#x})")]
    Debug {
        /// The policy.
        policy: u64,
    },
    /// The guest policy allows a migration agent and the config does not.
    #[error("SNP policy.migrate_ma: expected 0, actual 1 (policy {policy:#x})")]
    MigrationAgent {
        /// The policy.
        policy: u64,
    },
    /// The policy gives minimums by product line, none for the report's.
    #[error(
        "SNP {line}: minimum_tcb_by_line has no entry for this product line (once minimums are \
         given by line, every line the cluster runs on needs one)"
    )]
    NoLineMinimum {
        /// The report's product line, e.g. `Milan`.
        line: String,
    },
    /// A TCB component is below the configured minimum for the report's
    /// product line.
    #[error(
        "SNP {line} reported_tcb.{component}: expected at least {minimum} ({setting}), actual {actual}"
    )]
    TcbBelowMinimum {
        /// The product line, e.g. `Turin`.
        line: String,
        /// Where the minimum comes from: `minimum_tcb` or
        /// `minimum_tcb_by_line`.
        setting: &'static str,
        /// The TCB component.
        component: &'static str,
        /// The configured minimum.
        minimum: u8,
        /// The report's SVN.
        actual: u8,
    },
    /// The guest was launched under a TCB component below the configured
    /// minimum for the report's product line (firmware updated while it
    /// ran does not undo its launch).
    #[error(
        "SNP {line} launch_tcb.{component}: expected at least {minimum} ({setting}), actual {actual}"
    )]
    LaunchTcbBelowMinimum {
        /// The product line, e.g. `Turin`.
        line: String,
        /// Where the minimum comes from: `minimum_tcb` or
        /// `minimum_tcb_by_line`.
        setting: &'static str,
        /// The TCB component.
        component: &'static str,
        /// The configured minimum.
        minimum: u8,
        /// The SVN at launch.
        actual: u8,
    },
    /// The guest policy allows SMT and the config does not.
    #[error("SNP policy.smt: expected 0 (allow_smt is false), actual 1 (policy {policy:#x})")]
    SmtAllowed {
        /// The policy.
        policy: u64,
    },
    /// The platform runs with SMT enabled and the config does not allow it.
    #[error(
        "SNP platform_info.smt_en: expected 0 (allow_smt is false), actual 1 (platform_info {platform_info:#x})"
    )]
    PlatformSmt {
        /// The platform info.
        platform_info: u64,
    },
    /// The guest policy does not restrict the guest to one socket and the
    /// config requires it.
    #[error("SNP policy.single_socket: expected 1, actual 0 (policy {policy:#x})")]
    SingleSocket {
        /// The policy.
        policy: u64,
    },
    /// A platform feature the config requires is not enabled.
    #[error(
        "SNP platform_info.{feature}: expected 1, actual 0 (platform_info {platform_info:#x})"
    )]
    PlatformFeature {
        /// The feature, e.g. `alias-check-complete`.
        feature: &'static str,
        /// The platform info.
        platform_info: u64,
    },
    /// The guest SVN is below the configured minimum.
    #[error("SNP guest_svn: expected at least {minimum}, actual {actual}")]
    GuestSvnBelowMinimum {
        /// The configured minimum.
        minimum: u32,
        /// The report's guest SVN.
        actual: u32,
    },
    /// The ID key digest differs.
    #[error("SNP id_key_digest: expected {expected}, actual {actual}")]
    IdKeyDigest {
        /// Configured (hex).
        expected: String,
        /// Reported (hex).
        actual: String,
    },
    /// The author key digest differs, or the report has no author key.
    #[error("SNP author_key_digest: expected {expected}, actual {actual}")]
    AuthorKeyDigest {
        /// Configured (hex).
        expected: String,
        /// Reported (hex), or `none` when `AUTHOR_KEY_EN` is 0.
        actual: String,
    },
    /// The report was requested for another VMPL than the config names.
    #[error("SNP vmpl: expected {expected}, actual {actual}")]
    Vmpl {
        /// Configured.
        expected: u32,
        /// Reported.
        actual: u32,
    },
    /// The launch measurement is neither `measurement` nor one of
    /// `also_measurements`.
    #[error("SNP measurement: expected {expected}, actual {actual}")]
    Measurement {
        /// Configured (hex); where `also_measurements` lists more, how
        /// many are accepted, with `measurement` in hex.
        expected: String,
        /// Reported (hex).
        actual: String,
    },
    /// The host data differ.
    #[error("SNP host_data: expected {expected}, actual {actual}")]
    HostData {
        /// Configured (hex).
        expected: String,
        /// Reported (hex).
        actual: String,
    },
    /// The line's revocation list for the chain's kind of key (CRL or VLEK
    /// CRL) is malformed, not the ARK's, not signed by it, or not current.
    #[error("AMD {line} {list}: {reason}")]
    Crl {
        /// The product line, e.g. `Milan`.
        line: String,
        /// Which of the line's lists: `CRL` (ASKs and VCEKs) or `VLEK CRL`
        /// (ASVKs and VLEKs).
        list: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The line's revocation list for the chain's kind of key is not
    /// current at the verification time (`thisUpdate` after it, or
    /// `nextUpdate` before it).
    #[error("AMD {line} {list}: {reason}")]
    CrlTime {
        /// The product line, e.g. `Milan`.
        line: String,
        /// Which of the line's lists: `CRL` or `VLEK CRL`.
        list: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The line's revocation list for the chain's kind of key revokes a
    /// certificate of the chain.
    #[error("AMD {line} {list} revokes the {certificate} (serial {serial})")]
    Revoked {
        /// The product line.
        line: String,
        /// Which of the line's lists, as for [`SnpError::Crl`].
        list: &'static str,
        /// `ASK` or `ASVK` (the chain's intermediate, [`SigningKey::intermediate`])
        /// or `endorsement key` (the VCEK or VLEK).
        certificate: &'static str,
        /// Its serial number (hex).
        serial: String,
    },
}

impl SnpError {
    /// Whether the refusal is of a validity period at the verification
    /// time (a certificate of the chain, or the revocation list), which the
    /// verifier's clock decides.
    pub fn rests_on_the_clock(&self) -> bool {
        matches!(
            self,
            Self::CertificateTime { .. } | Self::RootTime { .. } | Self::CrlTime { .. }
        )
    }
}

/// Which key signed a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SigningKey {
    /// The chip's versioned chip endorsement key.
    Vcek,
    /// A cloud provider's versioned loaded endorsement key.
    Vlek,
}

/// The start of an ASVK's common name (`SEV-VLEK-Milan`); an ASK's is
/// `SEV-` alone (`SEV-Milan`).
const ASVK_PREFIX: &str = "SEV-VLEK-";

impl SigningKey {
    /// The kind of key the intermediate named `issuer` (its common name)
    /// certifies: an ASVK (`SEV-VLEK-Milan`) certifies VLEKs, an ASK
    /// (`SEV-Milan`) VCEKs.
    pub fn certified_by(issuer: &str) -> Self {
        if issuer.starts_with(ASVK_PREFIX) {
            Self::Vlek
        } else {
            Self::Vcek
        }
    }

    /// The common name of the intermediate that certifies this kind of key
    /// in product line `line`: `SEV-Milan` (ASK) or `SEV-VLEK-Milan` (ASVK).
    pub fn issuer_name(self, line: &str) -> String {
        match self {
            Self::Vcek => format!("SEV-{line}"),
            Self::Vlek => format!("{ASVK_PREFIX}{line}"),
        }
    }

    /// The kind of intermediate that certifies this kind of key: `ASK`
    /// for a VCEK, `ASVK` for a VLEK.
    pub fn intermediate(self) -> &'static str {
        match self {
            Self::Vcek => "ASK",
            Self::Vlek => "ASVK",
        }
    }

    /// The name of AMD's revocation list for this kind of key in a
    /// product line: KDS serves `CRL` under `/vcek/v1/<line>/crl` and
    /// `VLEK CRL` under `/vlek/v1/<line>/crl`.
    pub fn crl_name(self) -> &'static str {
        match self {
            Self::Vcek => "CRL",
            Self::Vlek => "VLEK CRL",
        }
    }
}

impl std::fmt::Display for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Vcek => "VCEK",
            Self::Vlek => "VLEK",
        })
    }
}

/// What a verified report establishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnpClaims {
    /// The ASK/ASVK that issued the endorsement key, e.g. `SEV-Milan`.
    pub product: String,
    /// Report version.
    pub version: u32,
    /// VCEK or VLEK.
    pub signing_key: SigningKey,
    /// The chip ID (zero for VLEK reports).
    pub chip_id: [u8; 64],
    /// The TCB the endorsement key was derived for.
    pub reported_tcb: Tcb,
    /// The FMC SVN of `reported_tcb` (Turin only).
    pub reported_fmc: Option<u8>,
    /// The TCB when the guest was launched.
    pub launch_tcb: Tcb,
    /// The FMC SVN of `launch_tcb` (Turin only).
    pub launch_fmc: Option<u8>,
    /// The guest policy.
    pub policy: u64,
    /// The platform info.
    pub platform_info: u64,
    /// The VMPL that requested the report.
    pub vmpl: u32,
    /// The guest SVN.
    pub guest_svn: u32,
    /// The launch measurement.
    pub measurement: [u8; 48],
    /// Host data set at launch.
    pub host_data: [u8; 32],
    /// SHA-384 digest of the ID key that signed the ID block (zeros
    /// without one).
    pub id_key_digest: [u8; 48],
    /// SHA-384 digest of the author key that certified the ID key; `None`
    /// when `AUTHOR_KEY_EN` is 0.
    pub author_key_digest: Option<[u8; 48]>,
    /// The 64 guest-chosen bytes.
    pub report_data: [u8; 64],
}

/// One ASK (or ASVK) with its ARK.
#[derive(Clone, Debug)]
struct AmdChain {
    /// The first link between the two that did not verify when the roots
    /// were loaded (`ARK self-signature` or `ARK -> ASK`): every report
    /// under this chain is refused with it.
    broken: Option<&'static str>,
    /// The ASK's public key (PKCS #1 `RSAPublicKey`).
    ask_key: Vec<u8>,
    /// DER of the ASK's subject name.
    ask_subject: Vec<u8>,
    /// The ASK's serial number (DER integer content).
    ask_serial: Vec<u8>,
    /// DER of the ARK's subject name, the issuer of its CRL.
    ark_subject: Vec<u8>,
    /// The ARK's public key (PKCS #1 `RSAPublicKey`).
    ark_key: Vec<u8>,
    /// The ASK's common name, e.g. `SEV-Milan`.
    product: String,
    /// The ASK's, then the ARK's common name and validity (Unix seconds).
    validity: [(String, i64, i64); 2],
}

/// The AMD roots a verifier trusts.
#[derive(Clone, Debug)]
pub struct AmdRoots {
    chains: Vec<AmdChain>,
}

impl Default for AmdRoots {
    fn default() -> Self {
        Self::pinned()
    }
}

impl AmdRoots {
    /// AMD's roots for Milan, Genoa and Turin: each line's ASK and ASVK.
    pub fn pinned() -> Self {
        Self {
            chains: PINNED
                .iter()
                .filter_map(|pem| AmdChain::from_pem(pem.as_bytes()))
                .collect(),
        }
    }

    /// Roots from PEM bundles of an ASK (or ASVK) followed by its ARK, as
    /// AMD publishes them; bundles that do not hold two certificates are
    /// skipped. For test roots; production uses [`AmdRoots::pinned`].
    pub fn from_pem_bundles(bundles: &[&[u8]]) -> Self {
        Self {
            chains: bundles
                .iter()
                .filter_map(|pem| AmdChain::from_pem(pem))
                .collect(),
        }
    }

    /// How many chains are trusted.
    pub fn len(&self) -> usize {
        self.chains.len()
    }

    /// Whether no chain is trusted.
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty()
    }
}

impl AmdChain {
    fn from_pem(pem: &[u8]) -> Option<Self> {
        let ders: Vec<Vec<u8>> = x509_parser::pem::Pem::iter_from_buffer(pem)
            .filter_map(Result::ok)
            .map(|p| p.contents)
            .collect();
        let [ask_der, ark_der] = ders.as_slice() else {
            return None;
        };
        let (_, ask) = X509Certificate::from_der(ask_der).ok()?;
        let (_, ark) = X509Certificate::from_der(ark_der).ok()?;
        let product = common_name(&ask).unwrap_or_default();
        let ark_key = &ark.public_key().subject_public_key.data;
        let broken = if !signed_by(&ark, ark_key) {
            Some("ARK self-signature")
        } else if !signed_by(&ask, ark_key) {
            Some("ARK -> ASK")
        } else {
            None
        };
        let validity = |cert: &X509Certificate<'_>| {
            (
                common_name(cert).unwrap_or_default(),
                cert.validity().not_before.timestamp(),
                cert.validity().not_after.timestamp(),
            )
        };
        Some(Self {
            broken,
            validity: [validity(&ask), validity(&ark)],
            ask_key: ask.public_key().subject_public_key.data.to_vec(),
            ask_subject: ask.subject().as_raw().to_vec(),
            ask_serial: ask.raw_serial().to_vec(),
            ark_subject: ark.subject().as_raw().to_vec(),
            ark_key: ark_key.to_vec(),
            product,
        })
    }
}

fn common_name(cert: &X509Certificate<'_>) -> Option<String> {
    cert.subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned)
}

/// Parses a raw report of exactly [`REPORT_BYTES`].
pub fn parse(report: &[u8]) -> Result<AttestationReport, SnpError> {
    if report.len() != REPORT_BYTES {
        return Err(SnpError::ReportSize {
            actual: report.len(),
        });
    }
    AttestationReport::from_bytes(report).map_err(SnpError::ReportParse)
}

/// Verifies `raw` (parsed as `report`) signed by the endorsement key in
/// `certificate` (DER) against `roots` and the time `now`, then checks it
/// against `policy`.
pub fn verify(
    raw: &[u8],
    report: &AttestationReport,
    certificate: &[u8],
    roots: &AmdRoots,
    policy: &SnpPolicy,
    now: u64,
) -> Result<SnpClaims, SnpError> {
    let (claims, times) = verify_untimed(raw, report, certificate, roots, policy)?;
    times.check(now)?;
    Ok(claims)
}

/// [`verify`] but for the validity periods of the chain, which it returns
/// for the caller to check last ([`ChainTimes::check`]), after whatever
/// else it checks (the revocation list).
pub fn verify_untimed(
    raw: &[u8],
    report: &AttestationReport,
    certificate: &[u8],
    roots: &AmdRoots,
    policy: &SnpPolicy,
) -> Result<(SnpClaims, ChainTimes), SnpError> {
    let (claims, times) = authentic(raw, report, certificate, roots)?;
    claims.check(policy)?;
    Ok((claims, times))
}

/// The validity periods of a verified report's chain: the endorsement
/// key's certificate, then the ASK's (or ASVK's) and the ARK's. Checked
/// after everything else, so that a refusal for the time alone
/// ([`SnpError::rests_on_the_clock`]) means the rest held.
#[derive(Clone, Debug)]
pub struct ChainTimes {
    /// The endorsement key certificate's `notBefore` and `notAfter`.
    endorsement: (i64, i64),
    /// The ASK's (or ASVK's), then the ARK's common name and validity.
    roots: [(String, i64, i64); 2],
}

impl ChainTimes {
    /// Checks that every certificate of the chain is valid at `now`.
    pub fn check(&self, now: u64) -> Result<(), SnpError> {
        let (not_before, not_after) = self.endorsement;
        if !within(now, not_before, not_after) {
            return Err(SnpError::CertificateTime {
                not_before,
                not_after,
                now,
            });
        }
        for (name, not_before, not_after) in &self.roots {
            if !within(now, *not_before, *not_after) {
                return Err(SnpError::RootTime {
                    name: name.clone(),
                    not_before: *not_before,
                    not_after: *not_after,
                    now,
                });
            }
        }
        Ok(())
    }
}

/// The hardware half of [`verify`]: the chain, the endorsement key's
/// validity, chip and TCB, and the signature, with no expectations about
/// the guest. What it returns is authentic, not yet acceptable.
pub fn verify_signed(
    raw: &[u8],
    report: &AttestationReport,
    certificate: &[u8],
    roots: &AmdRoots,
    now: u64,
) -> Result<SnpClaims, SnpError> {
    let (claims, times) = authentic(raw, report, certificate, roots)?;
    times.check(now)?;
    Ok(claims)
}

/// [`verify_signed`] but for the validity periods, which it returns.
fn authentic(
    raw: &[u8],
    report: &AttestationReport,
    certificate: &[u8],
    roots: &AmdRoots,
) -> Result<(SnpClaims, ChainTimes), SnpError> {
    if raw.len() != REPORT_BYTES {
        return Err(SnpError::ReportSize { actual: raw.len() });
    }
    if report.sig_algo != SIG_ALGO_ECDSA_P384_SHA384 {
        return Err(SnpError::SigAlgo {
            actual: report.sig_algo,
        });
    }
    let signing_key = match report.key_info.signing_key() {
        0 => SigningKey::Vcek,
        1 => SigningKey::Vlek,
        actual => return Err(SnpError::SigningKey { actual }),
    };
    let (_, vek) = X509Certificate::from_der(certificate).map_err(|_| SnpError::Certificate)?;
    let chain = verify_chain(&vek, roots)?;
    let product = chain.product.clone();
    // The firmware names the key it signed with; a report naming a VLEK
    // must be under an ASVK (its chip ID is then not checked) and one
    // naming a VCEK under an ASK, and the revocation list that applies
    // follows from it.
    if SigningKey::certified_by(&product) != signing_key {
        return Err(SnpError::SigningKeyIssuer {
            signing_key,
            issuer: product,
        });
    }
    if signing_key == SigningKey::Vcek {
        check_chip_id(extension(&vek, oid::HW_ID)?, &report.chip_id, &product)?;
    }
    // The report's TCB layout (sev reads it from the CPUID fields, or for
    // a version 2 report from the chip ID) must be the chain's line's:
    // Turin's, with the FMC SVN, under Turin's ASK, another under another.
    let turin = product_line(&product) == "Turin";
    if turin != report.reported_tcb.fmc.is_some() {
        return Err(SnpError::TcbLayout { product });
    }
    let tcb = tcb_of(&report.reported_tcb);
    // A Turin report's FMC SVN is certified by its VCEK too.
    let fmc = report.reported_tcb.fmc.map(|fmc| ("fmc", oid::FMC, fmc));
    for (component, id, actual) in components(&tcb).into_iter().chain(fmc) {
        let expected = der_small_integer(extension(&vek, id)?).ok_or(SnpError::Extension {
            oid: id,
            reason: "not a DER integer of at most 255",
        })?;
        if expected != actual {
            return Err(SnpError::CertifiedTcb {
                component,
                expected,
                actual,
            });
        }
    }
    verify_signature(raw, &vek)?;
    let times = ChainTimes {
        endorsement: (
            vek.validity().not_before.timestamp(),
            vek.validity().not_after.timestamp(),
        ),
        roots: chain.validity.clone(),
    };
    let claims = SnpClaims {
        product,
        version: report.version,
        signing_key,
        chip_id: report.chip_id,
        reported_tcb: tcb,
        reported_fmc: report.reported_tcb.fmc,
        launch_tcb: tcb_of(&report.launch_tcb),
        launch_fmc: report.launch_tcb.fmc,
        policy: u64::from(report.policy),
        platform_info: u64::from(report.plat_info),
        vmpl: report.vmpl,
        guest_svn: report.guest_svn,
        measurement: report.measurement,
        host_data: report.host_data,
        id_key_digest: report.id_key_digest,
        author_key_digest: report
            .key_info
            .author_key_en()
            .then_some(report.author_key_digest),
        report_data: report.report_data,
    };
    Ok((claims, times))
}

/// Checks the chip ID a VCEK of the ASK named `product` certifies (its
/// hwID extension, as an OCTET STRING or bare) against the report's: all
/// 64 bytes, or for Turin, whose VCEKs certify 8, the report's first 8
/// with the other 56 zero.
fn check_chip_id(hw_id: &[u8], chip_id: &[u8; 64], product: &str) -> Result<(), SnpError> {
    let len = if product_line(product) == "Turin" {
        8
    } else {
        64
    };
    let hw_id = match hw_id {
        [0x04, n, rest @ ..] if usize::from(*n) == len && rest.len() == len => rest,
        raw => raw,
    };
    let (head, tail) = chip_id.split_at(len);
    if hw_id != head || tail.iter().any(|&b| b != 0) {
        return Err(SnpError::ChipId {
            expected: hex::encode(hw_id),
            actual: hex::encode(chip_id),
        });
    }
    Ok(())
}

/// The four SVNs keel's policy names, from one of the report's TCB fields.
fn tcb_of(version: &sev::firmware::host::TcbVersion) -> Tcb {
    Tcb {
        bootloader: version.bootloader,
        tee: version.tee,
        snp: version.snp,
        microcode: version.microcode,
    }
}

/// The trusted chain whose ASK (by name) issued `vek`.
fn chain_of<'r>(vek: &X509Certificate<'_>, roots: &'r AmdRoots) -> Result<&'r AmdChain, SnpError> {
    let issuer = vek.issuer().as_raw();
    roots
        .chains
        .iter()
        .find(|c| c.ask_subject == issuer)
        .ok_or_else(|| SnpError::UntrustedIssuer {
            issuer: vek.issuer().to_string(),
        })
}

/// Whether `now` (Unix seconds) lies in `not_before..=not_after`.
fn within(now: u64, not_before: i64, not_after: i64) -> bool {
    let now = i64::try_from(now).unwrap_or(i64::MAX);
    not_before <= now && now <= not_after
}

/// The pinned chain whose ASK issued `vek`, with every link verified (the
/// ARK's and the ASK's when the roots were loaded, the endorsement key's
/// here).
fn verify_chain<'r>(
    vek: &X509Certificate<'_>,
    roots: &'r AmdRoots,
) -> Result<&'r AmdChain, SnpError> {
    let chain = chain_of(vek, roots)?;
    if let Some(link) = chain.broken {
        return Err(SnpError::Chain { link });
    }
    if !signed_by(vek, &chain.ask_key) {
        return Err(SnpError::Chain { link: "ASK -> VEK" });
    }
    Ok(chain)
}

/// Whether `certificate` declares RSASSA-PSS and its signature over the
/// to-be-signed bytes as received verifies with `issuer_key` (PKCS #1
/// `RSAPublicKey`) as RSASSA-PSS SHA-384 with MGF1 SHA-384 and a 48-byte
/// salt, the only parameters AMD signs with.
fn signed_by(certificate: &X509Certificate<'_>, issuer_key: &[u8]) -> bool {
    certificate.signature_algorithm.algorithm.to_id_string() == oid::RSASSA_PSS
        && UnparsedPublicKey::new(&RSA_PSS_2048_8192_SHA384, issuer_key)
            .verify(
                certificate.tbs_certificate.as_ref(),
                &certificate.signature_value.data,
            )
            .is_ok()
}

/// Checks AMD's revocation list `crl` (DER) for the chain of the endorsement key
/// `certificate` (DER) at `now`: it must parse whole, be issued by that
/// chain's ARK and signed by it with RSASSA-PSS SHA-384 (AMD's only
/// algorithm, whatever the CRL declares), have `thisUpdate <= now <=
/// nextUpdate`, and list neither the ASK (or ASVK) nor the endorsement
/// key. Returns how many certificates it revokes. The chain itself is
/// checked by [`verify_signed`]. `crl` must be the list of the chain's
/// kind ([`SigningKey::crl_name`]): the ARK issues both, so the two are
/// not told apart here; the line's CRL lists no ASVK.
pub fn check_revocation(
    crl: &[u8],
    certificate: &[u8],
    roots: &AmdRoots,
    now: u64,
) -> Result<usize, SnpError> {
    let (_, vek) = X509Certificate::from_der(certificate).map_err(|_| SnpError::Certificate)?;
    let chain = chain_of(&vek, roots)?;
    let line = product_line(&chain.product);
    let kind = SigningKey::certified_by(&chain.product);
    let list = kind.crl_name();
    let bad = |reason: String| SnpError::Crl {
        line: line.to_owned(),
        list,
        reason,
    };
    let (rest, crl) = CertificateRevocationList::from_der(crl)
        .map_err(|e| bad(format!("does not parse: {e}")))?;
    if !rest.is_empty() {
        return Err(bad(format!("{} bytes after the CRL", rest.len())));
    }
    if crl.issuer().as_raw() != chain.ark_subject {
        return Err(bad(format!(
            "issued by {}, not by the ARK of {}",
            crl.issuer(),
            chain.product
        )));
    }
    UnparsedPublicKey::new(&RSA_PSS_2048_8192_SHA384, &chain.ark_key)
        .verify(crl.tbs_cert_list.as_ref(), &crl.signature_value.data)
        .map_err(|_| {
            bad("its signature does not verify with the ARK (RSASSA-PSS SHA-384)".into())
        })?;
    let untimely = |reason: String| SnpError::CrlTime {
        line: line.to_owned(),
        list,
        reason,
    };
    let next_update = crl
        .next_update()
        .ok_or_else(|| bad("it has no nextUpdate".into()))?
        .timestamp();
    for (what, serial) in [
        (kind.intermediate(), chain.ask_serial.as_slice()),
        ("endorsement key", vek.raw_serial()),
    ] {
        if crl
            .iter_revoked_certificates()
            .any(|r| same_serial(r.raw_serial(), serial))
        {
            return Err(SnpError::Revoked {
                line: line.to_owned(),
                list,
                certificate: what,
                serial: hex::encode(serial),
            });
        }
    }
    // Last, so that a list out of date at `now` is a refusal for the time
    // alone: it is the ARK's, and it revokes none of the chain.
    let now_signed = i64::try_from(now).unwrap_or(i64::MAX);
    let this_update = crl.last_update().timestamp();
    if this_update > now_signed {
        return Err(untimely(format!(
            "thisUpdate {this_update} is after the verification time {now}"
        )));
    }
    if next_update < now_signed {
        return Err(untimely(format!(
            "nextUpdate {next_update} is before the verification time {now}: fetch it again"
        )));
    }
    Ok(crl.iter_revoked_certificates().count())
}

/// Whether two DER integer contents name the same serial (leading zero
/// octets aside).
fn same_serial(a: &[u8], b: &[u8]) -> bool {
    let trim = |s: &[u8]| -> Vec<u8> { s.iter().copied().skip_while(|b| *b == 0).collect() };
    trim(a) == trim(b)
}

/// The product line an ASK's common name names: `SEV-Milan` and
/// `SEV-VLEK-Milan` are `Milan`.
pub fn product_line(ask_common_name: &str) -> &str {
    ask_common_name
        .strip_prefix(ASVK_PREFIX)
        .or_else(|| ask_common_name.strip_prefix("SEV-"))
        .unwrap_or(ask_common_name)
}

fn components(tcb: &Tcb) -> [(&'static str, &'static str, u8); 4] {
    [
        ("bootloader", oid::BOOTLOADER, tcb.bootloader),
        ("tee", oid::TEE, tcb.tee),
        ("snp", oid::SNP, tcb.snp),
        ("microcode", oid::MICROCODE, tcb.microcode),
    ]
}

/// The first component of `tcb` (with the FMC SVN `fmc`, Turin's) below
/// `minimum`: its name, the minimum and its SVN. An FMC minimum holds a
/// report without an FMC SVN to 0 (the policy allows one for Turin only,
/// whose reports always carry it).
fn below(tcb: &Tcb, fmc: Option<u8>, minimum: &MinimumTcb) -> Option<(&'static str, u8, u8)> {
    let fmc = minimum
        .tcb
        .fmc
        .map(|minimum| (("fmc", fmc.unwrap_or(0)), minimum));
    components(tcb)
        .into_iter()
        .zip(components(&minimum.tcb.tcb()))
        .map(|((component, _, actual), (_, _, minimum))| ((component, actual), minimum))
        .chain(fmc)
        .find(|((_, actual), minimum)| actual < minimum)
        .map(|((component, actual), minimum)| (component, minimum, actual))
}

fn extension<'a>(cert: &'a X509Certificate<'_>, id: &'static str) -> Result<&'a [u8], SnpError> {
    let mut found = cert
        .extensions()
        .iter()
        .filter(|e| e.oid.to_id_string() == id);
    match (found.next(), found.next()) {
        (Some(e), None) => Ok(e.value),
        (None, _) => Err(SnpError::Extension {
            oid: id,
            reason: "missing",
        }),
        (Some(_), Some(_)) => Err(SnpError::Extension {
            oid: id,
            reason: "repeated",
        }),
    }
}

/// A DER INTEGER that fits a `u8` (AMD's SPL extensions).
fn der_small_integer(value: &[u8]) -> Option<u8> {
    match value {
        [0x02, 1, v] if *v < 0x80 => Some(*v),
        [0x02, 2, 0, v] if *v >= 0x80 => Some(*v),
        _ => None,
    }
}

/// The report's ECDSA P-384 signature over its first 0x2A0 bytes, with the
/// endorsement key. r and s are 72-byte little-endian fields of which only
/// the low 48 bytes may be non-zero.
fn verify_signature(raw: &[u8], vek: &X509Certificate<'_>) -> Result<(), SnpError> {
    let scalar = |at: usize| -> Option<[u8; 48]> {
        let field = raw.get(at..at + 72)?;
        if field[48..].iter().any(|b| *b != 0) {
            return None;
        }
        let mut be = [0u8; 48];
        for (dst, src) in be.iter_mut().zip(field[..48].iter().rev()) {
            *dst = *src;
        }
        Some(be)
    };
    let (r, s) = scalar(SIGNED_BYTES)
        .zip(scalar(SIGNED_BYTES + 72))
        .ok_or(SnpError::Signature)?;
    let mut signature = [0u8; 96];
    signature[..48].copy_from_slice(&r);
    signature[48..].copy_from_slice(&s);
    UnparsedPublicKey::new(
        &ECDSA_P384_SHA384_FIXED,
        &vek.public_key().subject_public_key.data,
    )
    .verify(&raw[..SIGNED_BYTES], &signature)
    .map_err(|_| SnpError::Signature)
}

impl SnpClaims {
    /// The product line of the chain that verified the report, e.g.
    /// `Milan` (a VLEK's too).
    pub fn product_line(&self) -> &str {
        product_line(&self.product)
    }

    /// Checks the guest against `policy`: the VMPL the report was requested
    /// at, the guest policy (debugging refused, a migration agent refused
    /// unless allowed, SMT and a single socket as configured), the platform
    /// features required, every component of the reported and of the
    /// launch TCB at least the minimum for the report's product line, the
    /// guest SVN, the launch measurement and (where configured) the host
    /// data and the ID and author key digests.
    pub fn check(&self, policy: &SnpPolicy) -> Result<(), SnpError> {
        if self.vmpl != policy.vmpl {
            return Err(SnpError::Vmpl {
                expected: policy.vmpl,
                actual: self.vmpl,
            });
        }
        self.check_guest_policy(policy)?;
        self.check_platform(policy)?;
        self.check_tcb(policy)?;
        if self.guest_svn < policy.minimum_guest_svn {
            return Err(SnpError::GuestSvnBelowMinimum {
                minimum: policy.minimum_guest_svn,
                actual: self.guest_svn,
            });
        }
        pinned_one_of(
            ("measurement", &policy.measurement),
            ("also_measurements", &policy.also_measurements),
            &self.measurement,
            |expected, actual| SnpError::Measurement { expected, actual },
        )?;
        pinned(
            policy.host_data.as_ref(),
            &self.host_data,
            |expected, actual| SnpError::HostData { expected, actual },
        )?;
        self.check_keys(policy)
    }

    /// The guest policy's bits: debug, migration agent, SMT, single socket.
    fn check_guest_policy(&self, policy: &SnpPolicy) -> Result<(), SnpError> {
        let guest = GuestPolicy::from(self.policy);
        let bits = self.policy;
        if guest.debug_allowed() {
            return Err(SnpError::Debug { policy: bits });
        }
        if guest.migrate_ma_allowed() && !policy.allow_migration_agent {
            return Err(SnpError::MigrationAgent { policy: bits });
        }
        if guest.smt_allowed() && !policy.allow_smt {
            return Err(SnpError::SmtAllowed { policy: bits });
        }
        if !guest.single_socket_required() && policy.require_single_socket {
            return Err(SnpError::SingleSocket { policy: bits });
        }
        Ok(())
    }

    /// `platform_info`: SMT off where SMT is not allowed (the guest policy
    /// already guarantees it; this is the platform's own word), and every
    /// required feature on.
    fn check_platform(&self, policy: &SnpPolicy) -> Result<(), SnpError> {
        let platform_info = self.platform_info;
        if !policy.allow_smt && PlatformInfo::from(platform_info).smt_enabled() {
            return Err(SnpError::PlatformSmt { platform_info });
        }
        match policy
            .require_platform
            .iter()
            .find(|feature| platform_info & (1 << feature.bit()) == 0)
        {
            Some(feature) => Err(SnpError::PlatformFeature {
                feature: feature.as_str(),
                platform_info,
            }),
            None => Ok(()),
        }
    }

    /// The reported and the launch TCB against the minimum for this
    /// report's product line.
    fn check_tcb(&self, policy: &SnpPolicy) -> Result<(), SnpError> {
        let line = self.product_line();
        let minimum = policy
            .minimum_tcb_for(line)
            .ok_or_else(|| SnpError::NoLineMinimum {
                line: line.to_owned(),
            })?;
        if let Some((component, min, actual)) =
            below(&self.reported_tcb, self.reported_fmc, &minimum)
        {
            return Err(SnpError::TcbBelowMinimum {
                line: line.to_owned(),
                setting: minimum.setting,
                component,
                minimum: min,
                actual,
            });
        }
        if let Some((component, min, actual)) = below(&self.launch_tcb, self.launch_fmc, &minimum) {
            return Err(SnpError::LaunchTcbBelowMinimum {
                line: line.to_owned(),
                setting: minimum.setting,
                component,
                minimum: min,
                actual,
            });
        }
        Ok(())
    }

    /// The ID and author key digests, where configured, in constant time.
    fn check_keys(&self, policy: &SnpPolicy) -> Result<(), SnpError> {
        pinned(
            policy.id_key_digest.as_ref(),
            &self.id_key_digest,
            |expected, actual| SnpError::IdKeyDigest { expected, actual },
        )?;
        if let Some(expected) = &policy.author_key_digest {
            let matches = self
                .author_key_digest
                .is_some_and(|actual| bool::from(actual.ct_eq(&expected.0)));
            if !matches {
                return Err(SnpError::AuthorKeyDigest {
                    expected: hex::encode(expected.0),
                    actual: self
                        .author_key_digest
                        .map_or_else(|| "none (AUTHOR_KEY_EN is 0)".to_owned(), hex::encode),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// SHA-256 of each line's ARK public key (PKCS #1), as AMD publishes
    /// the ARK (the `sev` crate's copies give the same).
    const ARK_KEYS: [(&str, &str); 3] = [
        (
            "Milan",
            "20dc23483bddbb9947909070d49dfb5a7ff4ea41481e38cdeb8970d90a26feea",
        ),
        (
            "Genoa",
            "052e0377922344bbddefdd8cec21947094d658436c0defe1355864ca024fcc2b",
        ),
        (
            "Turin",
            "c4a6c5980e27b97470c948beb8810461150851826891ed5f04b7401edba34c6c",
        ),
    ];

    /// Every pinned chain loads whole (its ARK signed itself and its ASK or
    /// ASVK), each line has both intermediates, and both are under that
    /// line's one ARK, the key AMD publishes for it: an ASVK bundle with
    /// another self-signed ARK of the same name would fail here.
    #[test]
    fn every_pinned_chain_links_to_its_lines_ark() {
        use sha2::Digest as _;
        let roots = AmdRoots::pinned();
        let mut found: Vec<(String, String)> = roots
            .chains
            .iter()
            .map(|chain| {
                assert_eq!(chain.broken, None, "{}", chain.product);
                let line = chain
                    .product
                    .trim_start_matches(ASVK_PREFIX)
                    .trim_start_matches("SEV-");
                let (_, key) = ARK_KEYS
                    .iter()
                    .find(|(name, _)| *name == line)
                    .unwrap_or_else(|| panic!("{} is of no known line", chain.product));
                assert_eq!(
                    hex::encode(sha2::Sha256::digest(&chain.ark_key)),
                    *key,
                    "the ARK of {}",
                    chain.product
                );
                (line.to_owned(), chain.product.clone())
            })
            .collect();
        found.sort();
        let mut expected: Vec<(String, String)> = ARK_KEYS
            .iter()
            .flat_map(|(line, _)| {
                [format!("SEV-{line}"), format!("{ASVK_PREFIX}{line}")]
                    .map(|product| (line.to_string(), product))
            })
            .collect();
        expected.sort();
        assert_eq!(found, expected);
    }
}
