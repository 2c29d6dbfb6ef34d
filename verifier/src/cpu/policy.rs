//! The attestation variant and its expected values, as the cluster config
//! states them (`cluster.attestation`, measured into PCR 12 with the rest of
//! the cluster part). The `vtpm` variant is the default and has no section.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which evidence roots a node's attestation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// The vTPM quote alone; its EK chains to a configured CA.
    #[default]
    Vtpm,
    /// The vTPM quote and an AMD SEV-SNP report that binds its AK.
    SevSnp,
    /// The vTPM quote and an Intel TDX quote that binds its AK.
    Tdx,
}

impl Variant {
    /// The kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vtpm => "vtpm",
            Self::SevSnp => "sev-snp",
            Self::Tdx => "tdx",
        }
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A fixed-size value written as hex in the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hex<const N: usize>(pub [u8; N]);

impl<const N: usize> Serialize for Hex<N> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(self.0))
    }
}

impl<'de, const N: usize> Deserialize<'de> for Hex<N> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let mut out = [0u8; N];
        hex::decode_to_slice(&text, &mut out).map_err(|_| {
            serde::de::Error::custom(format!("expected {N} bytes as {} hex digits", 2 * N))
        })?;
        Ok(Self(out))
    }
}

/// SEV-SNP TCB component SVNs (the report's `reported_tcb`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tcb {
    /// PSP bootloader SVN.
    pub bootloader: u8,
    /// PSP OS (TEE) SVN.
    pub tee: u8,
    /// SNP firmware SVN.
    pub snp: u8,
    /// Microcode SVN.
    pub microcode: u8,
}

impl From<[u8; 4]> for Tcb {
    /// Bootloader, TEE, SNP and microcode SVNs, in that order.
    fn from([bootloader, tee, snp, microcode]: [u8; 4]) -> Self {
        Self {
            bootloader,
            tee,
            snp,
            microcode,
        }
    }
}

/// What a SEV-SNP report must show.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnpPolicy {
    /// Every component of `reported_tcb` and of `launch_tcb` must be at
    /// least this.
    pub minimum_tcb: Tcb,
    /// The launch measurement (48 bytes).
    pub measurement: Hex<48>,
    /// The host data set at launch (32 bytes); absent means not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_data: Option<Hex<32>>,
    /// Accept a guest policy that allows a migration agent.
    #[serde(default)]
    pub allow_migration_agent: bool,
    /// The VMPL the report must have been requested for (0-3). 0, the
    /// default and left out of the canonical form, is the guest's most
    /// privileged level, where a guest without a paravisor or SVSM runs
    /// its kernel; a report for a less privileged level speaks for less
    /// privileged code.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub vmpl: u32,
}

/// Highest VMPL SEV-SNP defines.
pub const MAX_VMPL: u32 = 3;

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// TCB statuses the TCB info can give; only `UpToDate` is accepted unless
/// another is allowed by name.
pub const TDX_TCB_STATUSES: [&str; 9] = [
    "UpToDate",
    "SWHardeningNeeded",
    "ConfigurationNeeded",
    "ConfigurationAndSWHardeningNeeded",
    "OutOfDate",
    "OutOfDateConfigurationNeeded",
    "TDRelaunchAdvised",
    "TDRelaunchAdvisedConfigurationNeeded",
    "Revoked",
];

/// What a TDX quote must show.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TdxPolicy {
    /// MRTD: the initial TD contents (48 bytes).
    pub mrtd: Hex<48>,
    /// RTMR 0-3; `null` leaves that register unchecked.
    #[serde(default)]
    pub rtmr: [Option<Hex<48>>; 4],
    /// TCB statuses accepted besides `UpToDate`, by name (never `Revoked`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_tcb_status: Vec<String>,
}

/// `cluster.attestation` as written.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttestationConfig {
    /// The variant.
    #[serde(default)]
    pub variant: Variant,
    /// Expected values for `sev-snp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sev_snp: Option<SnpPolicy>,
    /// Expected values for `tdx`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tdx: Option<TdxPolicy>,
}

impl AttestationConfig {
    /// Whether this is the default (`vtpm`, nothing else): such a config is
    /// left out of the canonical form, so existing configs measure as before.
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// The checked policy: exactly the section its variant needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CpuPolicy {
    /// No CPU evidence.
    #[default]
    Vtpm,
    /// SEV-SNP with these expectations.
    SevSnp(SnpPolicy),
    /// TDX with these expectations.
    Tdx(TdxPolicy),
}

impl CpuPolicy {
    /// The variant.
    pub fn variant(&self) -> Variant {
        match self {
            Self::Vtpm => Variant::Vtpm,
            Self::SevSnp(_) => Variant::SevSnp,
            Self::Tdx(_) => Variant::Tdx,
        }
    }
}

impl TryFrom<&AttestationConfig> for CpuPolicy {
    type Error = String;

    /// Refuses a variant without its section, a section for another variant,
    /// and unknown or `Revoked` TCB statuses.
    fn try_from(c: &AttestationConfig) -> Result<Self, String> {
        let other = |name: &str| {
            format!(
                "a {name} section does not belong to the {} variant",
                c.variant
            )
        };
        match c.variant {
            Variant::Vtpm if c.sev_snp.is_some() => Err(other("sev_snp")),
            Variant::Vtpm if c.tdx.is_some() => Err(other("tdx")),
            Variant::Vtpm => Ok(Self::Vtpm),
            Variant::SevSnp if c.tdx.is_some() => Err(other("tdx")),
            Variant::SevSnp => {
                let snp = c
                    .sev_snp
                    .clone()
                    .ok_or_else(|| "the sev-snp variant needs a sev_snp section".to_string())?;
                if snp.vmpl > MAX_VMPL {
                    return Err(format!(
                        "sev_snp.vmpl {} is not a VMPL (0-{MAX_VMPL})",
                        snp.vmpl
                    ));
                }
                Ok(Self::SevSnp(snp))
            }
            Variant::Tdx if c.sev_snp.is_some() => Err(other("sev_snp")),
            Variant::Tdx => {
                let tdx = c
                    .tdx
                    .clone()
                    .ok_or_else(|| "the tdx variant needs a tdx section".to_string())?;
                for status in &tdx.allow_tcb_status {
                    if status == "Revoked" || !TDX_TCB_STATUSES.contains(&status.as_str()) {
                        return Err(format!("TCB status {status:?} cannot be allowed"));
                    }
                }
                Ok(Self::Tdx(tdx))
            }
        }
    }
}
