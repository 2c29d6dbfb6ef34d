//! CPU evidence: what roots a vTPM quote in the confidential-VM hardware.
//!
//! The hypervisor provides the vTPM, so a quote alone proves nothing the
//! host could not fake. The hardware variants add the CPU's own evidence (an
//! AMD SEV-SNP attestation report, an Intel TDX quote) whose `report_data`
//! commits to the vTPM's attestation key, so a quote signed by that key is
//! rooted in the CPU:
//!
//! * [`policy`]: the variant and its expected values, as the cluster config
//!   states them (measured into PCR 12);
//! * [`snp`]: a report against the pinned AMD roots (VCEK/VLEK → ASK/ASVK →
//!   ARK), the minimum TCB of its product line, the guest policy, the
//!   platform, the launch measurement and the pinned launch identity;
//! * [`tdx`]: a quote against Intel's SGX root CA with local collateral
//!   (`dcap-qvl`): PCK chain, CRLs, TCB status, QE identity, TD attributes,
//!   MRTD, RTMRs and the pinned XFAM, MRCONFIGID and MROWNER;
//! * [`binding`]: how `report_data` commits to the attestation key (the
//!   guest's own configfs-tsm report, or Azure's HCL report);
//! * [`collateral`]: the local cache of certificates and collateral, read
//!   by path and never fetched while verifying.
//!
//! Verification takes the time as an argument: collateral and certificates
//! are judged at that time (the validator passes the wall clock; tests pin
//! the time recorded evidence was valid at).

pub mod binding;
pub mod collateral;
pub mod policy;
pub mod snp;
pub mod tdx;

pub use binding::{Binding, BindingError};
pub use collateral::{Collateral, CollateralError};
pub use policy::{AttestationConfig, CpuPolicy, SnpPolicy, TdxPolicy, Variant};

/// Largest accepted CPU evidence blob (report, quote or HCL report).
pub const MAX_EVIDENCE_BYTES: usize = 32 * 1024;
/// Largest accepted endorsement certificate (VCEK/VLEK, DER).
pub const MAX_CERTIFICATE_BYTES: usize = 8 * 1024;

/// CPU evidence as a document carries it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Evidence {
    /// How `report_data` binds the attestation key.
    pub binding: Binding,
    /// The SEV-SNP report or TDX quote; with [`Binding::AzureHcl`], the
    /// whole HCL report (the SNP report at offset 32).
    pub report: Vec<u8>,
    /// The VCEK or VLEK (DER) for SEV-SNP, when the issuer has it; empty
    /// means the verifier's collateral cache supplies it.
    pub certificate: Vec<u8>,
}

/// Why CPU evidence was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CpuError {
    /// The variant requires CPU evidence and the document has none.
    #[error("the {variant} variant requires CPU evidence and the document carries none")]
    Missing {
        /// The configured variant.
        variant: Variant,
    },
    /// A blob is larger than its bound.
    #[error("CPU evidence {what} is {actual} bytes, more than {limit}")]
    TooLarge {
        /// Which blob.
        what: &'static str,
        /// Its size.
        actual: usize,
        /// The bound.
        limit: usize,
    },
    /// The SEV-SNP report was refused.
    #[error("SEV-SNP evidence refused")]
    Snp(#[from] snp::SnpError),
    /// The TDX quote was refused.
    #[error("TDX evidence refused")]
    Tdx(#[from] tdx::TdxError),
    /// `report_data` does not bind the attestation key (and nonce).
    #[error("CPU evidence does not bind the attestation key")]
    Binding(#[from] BindingError),
    /// The collateral cache could not supply what the evidence needs.
    #[error("CPU collateral unavailable")]
    Collateral(#[from] CollateralError),
}

impl CpuError {
    /// Whether the refusal is of a validity period at the verification
    /// time, which the verifier's clock decides ([`snp::SnpError::rests_on_the_clock`],
    /// [`tdx::TdxError::rests_on_the_clock`]).
    pub fn rests_on_the_clock(&self) -> bool {
        match self {
            Self::Snp(e) => e.rests_on_the_clock(),
            Self::Tdx(e) => e.rests_on_the_clock(),
            _ => false,
        }
    }
}

/// What verified CPU evidence establishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CpuClaims {
    /// A verified SEV-SNP report.
    Snp(snp::SnpClaims),
    /// A verified TDX quote.
    Tdx(tdx::TdxClaims),
}

impl CpuClaims {
    /// The 64 `report_data` bytes the CPU signed.
    pub fn report_data(&self) -> &[u8; 64] {
        match self {
            Self::Snp(c) => &c.report_data,
            Self::Tdx(c) => &c.report_data,
        }
    }
}

/// What a verifier trusts for CPU evidence: the configured policy, the
/// collateral cache and the hardware roots (pinned vendor roots unless a
/// test replaces them).
#[derive(Clone, Debug, Default)]
pub struct CpuTrust {
    policy: CpuPolicy,
    collateral: Collateral,
    snp_roots: snp::AmdRoots,
    tdx_root: tdx::IntelRoot,
}

impl CpuTrust {
    /// Trust for `policy` with the pinned AMD and Intel roots.
    pub fn new(policy: CpuPolicy, collateral: Collateral) -> Self {
        Self {
            policy,
            collateral,
            snp_roots: snp::AmdRoots::pinned(),
            tdx_root: tdx::IntelRoot::pinned(),
        }
    }

    /// Replaces the AMD roots (test roots generated by a test harness).
    pub fn with_snp_roots(mut self, roots: snp::AmdRoots) -> Self {
        self.snp_roots = roots;
        self
    }

    /// Replaces the Intel root CA (a test root generated by a harness).
    pub fn with_tdx_root(mut self, root: tdx::IntelRoot) -> Self {
        self.tdx_root = root;
        self
    }

    /// The configured variant.
    pub fn variant(&self) -> Variant {
        self.policy.variant()
    }

    /// Verifies `evidence` at `now` (seconds since the Unix epoch) and that
    /// it binds `ak_public` and `nonce`. `None` for the `vtpm` variant,
    /// which ignores CPU evidence.
    ///
    /// The binding the evidence claims is checked first: a report copied
    /// from another node is refused for one hash, before the vendor's
    /// chain, its revocation list and its collateral cost anything. It is
    /// checked again on the verified claims.
    pub fn verify(
        &self,
        evidence: Option<&Evidence>,
        ak_public: &[u8],
        nonce: &[u8],
        now: u64,
    ) -> Result<Option<CpuClaims>, CpuError> {
        let variant = self.variant();
        if variant == Variant::Vtpm {
            return Ok(None);
        }
        let evidence = evidence.ok_or(CpuError::Missing { variant })?;
        bounded("report", evidence.report.len(), MAX_EVIDENCE_BYTES)?;
        bounded(
            "certificate",
            evidence.certificate.len(),
            MAX_CERTIFICATE_BYTES,
        )?;
        if let Some(claimed) = self.claimed_report_data(evidence)? {
            evidence
                .binding
                .check(&evidence.report, &claimed, ak_public, nonce)?;
        }
        let Some(claims) = self.vendor_claims(evidence, now)? else {
            return Ok(None);
        };
        evidence
            .binding
            .check(&evidence.report, claims.report_data(), ak_public, nonce)?;
        Ok(Some(claims))
    }

    /// The report data `evidence` claims, before any of it is verified;
    /// `None` where it cannot be read (the verification refuses it).
    fn claimed_report_data(&self, evidence: &Evidence) -> Result<Option<[u8; 64]>, CpuError> {
        Ok(match &self.policy {
            CpuPolicy::Vtpm => None,
            CpuPolicy::SevSnp(_) => {
                let report = evidence.binding.snp_report(&evidence.report)?;
                Some(snp::parse(report)?.report_data)
            }
            CpuPolicy::Tdx(_) => tdx::claimed_report_data(&evidence.report)?,
        })
    }

    /// The vendor's verification of `evidence` at `now` alone (its chain,
    /// revocation list, collateral and this policy), without its binding
    /// to a TPM key: what [`CpuTrust::verify`] does between the binding's
    /// two checks. `None` for the `vtpm` variant.
    pub fn vendor_claims(
        &self,
        evidence: &Evidence,
        now: u64,
    ) -> Result<Option<CpuClaims>, CpuError> {
        let variant = self.variant();
        Ok(Some(match &self.policy {
            CpuPolicy::Vtpm => return Ok(None),
            CpuPolicy::SevSnp(policy) => {
                let report = evidence.binding.snp_report(&evidence.report)?;
                let parsed = snp::parse(report)?;
                let certificate = if evidence.certificate.is_empty() {
                    self.collateral.snp_certificate(&parsed)?
                } else {
                    evidence.certificate.clone()
                };
                let (claims, times) =
                    snp::verify_untimed(report, &parsed, &certificate, &self.snp_roots, policy)?;
                if evidence.binding == Binding::AzureHcl && claims.vmpl != 0 {
                    return Err(BindingError::HclVmpl {
                        actual: claims.vmpl,
                    }
                    .into());
                }
                // The list follows from the verified chain (which `verify`
                // has matched to the key the report names).
                let line = snp::product_line(&claims.product);
                let kind = snp::SigningKey::certified_by(&claims.product);
                match self.collateral.snp_crl(line, kind)? {
                    Some(crl) => {
                        snp::check_revocation(&crl, &certificate, &self.snp_roots, now)?;
                    }
                    None => no_crl_warning(line, kind),
                }
                // Last: a refusal for the time alone means the rest held.
                times.check(now)?;
                CpuClaims::Snp(claims)
            }
            CpuPolicy::Tdx(policy) => {
                if evidence.binding != Binding::Guest {
                    return Err(BindingError::Unsupported {
                        binding: evidence.binding,
                        variant,
                    }
                    .into());
                }
                let collateral = self.collateral.tdx_collateral(&evidence.report)?;
                CpuClaims::Tdx(tdx::verify(
                    &evidence.report,
                    &collateral,
                    &self.tdx_root,
                    policy,
                    now,
                )?)
            }
        }))
    }
}

fn bounded(what: &'static str, actual: usize, limit: usize) -> Result<(), CpuError> {
    if actual > limit {
        return Err(CpuError::TooLarge {
            what,
            actual,
            limit,
        });
    }
    Ok(())
}

/// Says, once per process and kind of key, that SEV-SNP reports are taken
/// without a revocation check: no list of their product line and key is
/// cached (a node's cache is empty unless provisioned;
/// docs/attestation.md).
fn no_crl_warning(line: &str, key: snp::SigningKey) {
    static VCEK: std::sync::Once = std::sync::Once::new();
    static VLEK: std::sync::Once = std::sync::Once::new();
    let once = match key {
        snp::SigningKey::Vcek => &VCEK,
        snp::SigningKey::Vlek => &VLEK,
    };
    once.call_once(|| {
        tracing::warn!(
            product_line = line,
            list = key.crl_name(),
            "no AMD revocation list cached for this product line and key: SEV-SNP certificates are not checked for revocation"
        );
    });
}
