//! The attestation variant and its expected values, as the cluster config
//! states them (`cluster.attestation`, measured into PCR 12 with the rest of
//! the cluster part). The `vtpm` variant is the default and has no section.

use std::collections::{BTreeMap, BTreeSet};
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

/// A fixed-size value written as hex in the config. Ordered by its bytes,
/// which is the order of a set of them in the canonical (measured) form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Hex<const N: usize>(pub [u8; N]);

/// `actual` against `expected` where it is set, in constant time; a
/// difference is refused with `error(expected, actual)` in hex.
pub(crate) fn pinned<const N: usize, E>(
    expected: Option<&Hex<N>>,
    actual: &[u8; N],
    error: impl FnOnce(String, String) -> E,
) -> Result<(), E> {
    use subtle::ConstantTimeEq as _;
    match expected {
        Some(expected) if !bool::from(actual.ct_eq(&expected.0)) => {
            Err(error(hex::encode(expected.0), hex::encode(actual)))
        }
        _ => Ok(()),
    }
}

/// Most values `also_measurements` (SEV-SNP) or `also_mrtd` (TDX) may list
/// besides the main one.
pub const MAX_ALSO_MEASUREMENTS: usize = 64;

/// `actual` against `main` (the setting `main_name`) and every value of
/// `also` (the setting `also_name`): each compared in constant time, all
/// of them, as [`pinned`] compares one. None equal is refused with
/// `error(expected, actual)` in hex; with `also` empty, `expected` is
/// `main` as [`pinned`] gives it, else it says how many values are
/// accepted.
pub(crate) fn pinned_one_of<const N: usize, E>(
    (main_name, main): (&str, &Hex<N>),
    (also_name, also): (&str, &BTreeSet<Hex<N>>),
    actual: &[u8; N],
    error: impl FnOnce(String, String) -> E,
) -> Result<(), E> {
    use subtle::ConstantTimeEq as _;
    let equal = also
        .iter()
        .fold(actual.ct_eq(&main.0), |equal, v| equal | actual.ct_eq(&v.0));
    if bool::from(equal) {
        return Ok(());
    }
    let expected = if also.is_empty() {
        hex::encode(main.0)
    } else {
        let accepted = also.len() + usize::from(!also.contains(main));
        format!(
            "one of {accepted} accepted ({main_name} {} and {} in {also_name})",
            hex::encode(main.0),
            also.len()
        )
    };
    Err(error(expected, hex::encode(actual)))
}

/// `also` refused where it lists more than [`MAX_ALSO_MEASUREMENTS`]
/// values; `name` is the setting, e.g. `sev_snp.also_measurements`.
fn check_also<const N: usize>(name: &str, also: &BTreeSet<Hex<N>>) -> Result<(), String> {
    if also.len() > MAX_ALSO_MEASUREMENTS {
        return Err(format!(
            "{name} lists {} values, more than the {MAX_ALSO_MEASUREMENTS} it may list",
            also.len()
        ));
    }
    Ok(())
}

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

/// An AMD product line, as the ASK (or ASVK) that issued a report's
/// endorsement key names it (`SEV-Milan` and `SEV-VLEK-Milan` are
/// `Milan`): TCB SVNs are comparable only within one line. Append new
/// lines only: the declaration order is the order of
/// `minimum_tcb_by_line`'s keys in the canonical (measured) form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ProductLine {
    /// EPYC 7003.
    Milan,
    /// EPYC 9004.
    Genoa,
    /// EPYC 9005: its TCB carries an FMC SVN.
    Turin,
}

impl ProductLine {
    /// The line's name, as its ASK's common name carries it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Milan => "Milan",
            Self::Genoa => "Genoa",
            Self::Turin => "Turin",
        }
    }

    /// The line named `name` (e.g. `Milan`); `None` for any other name.
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Milan, Self::Genoa, Self::Turin]
            .into_iter()
            .find(|line| line.as_str() == name)
    }
}

impl fmt::Display for ProductLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One product line's minimum TCB: the four SVNs of [`Tcb`] and, for
/// Turin only, the FMC SVN.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LineTcb {
    /// PSP bootloader SVN.
    pub bootloader: u8,
    /// PSP OS (TEE) SVN.
    pub tee: u8,
    /// SNP firmware SVN.
    pub snp: u8,
    /// Microcode SVN.
    pub microcode: u8,
    /// FMC SVN (Turin only); absent means no minimum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fmc: Option<u8>,
}

impl LineTcb {
    /// The four SVNs every line has.
    pub fn tcb(&self) -> Tcb {
        Tcb {
            bootloader: self.bootloader,
            tee: self.tee,
            snp: self.snp,
            microcode: self.microcode,
        }
    }
}

impl From<Tcb> for LineTcb {
    /// The four SVNs, without an FMC minimum.
    fn from(tcb: Tcb) -> Self {
        Self {
            bootloader: tcb.bootloader,
            tee: tcb.tee,
            snp: tcb.snp,
            microcode: tcb.microcode,
            fmc: None,
        }
    }
}

/// The minimum TCB a report is held to, and the setting it comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MinimumTcb {
    /// The SVNs.
    pub tcb: LineTcb,
    /// `minimum_tcb` or `minimum_tcb_by_line`.
    pub setting: &'static str,
}

/// A platform feature the report's `platform_info` can show enabled. Append
/// new features only: the declaration order is the order of
/// `require_platform` in the canonical (measured) form. `rapl-disabled`
/// and `ciphertext-hiding` are the platform's state when the report was
/// made; the guest policy bits that hold them for the guest's life are not
/// checked here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlatformFeature {
    /// Transparent SME: all host memory encrypted (bit 1).
    Tsme,
    /// ECC memory in use (bit 2).
    Ecc,
    /// RAPL, a power side channel, disabled (bit 3).
    RaplDisabled,
    /// Ciphertext hiding for DRAM enabled (bit 4).
    CiphertextHiding,
    /// Alias detection completed since reset and found no aliased
    /// addresses (bit 5; the BadRAM mitigation).
    AliasCheckComplete,
}

impl PlatformFeature {
    /// The `platform_info` bit.
    pub fn bit(self) -> u32 {
        match self {
            Self::Tsme => 1,
            Self::Ecc => 2,
            Self::RaplDisabled => 3,
            Self::CiphertextHiding => 4,
            Self::AliasCheckComplete => 5,
        }
    }

    /// The kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tsme => "tsme",
            Self::Ecc => "ecc",
            Self::RaplDisabled => "rapl-disabled",
            Self::CiphertextHiding => "ciphertext-hiding",
            Self::AliasCheckComplete => "alias-check-complete",
        }
    }
}

/// What a SEV-SNP report must show. Only `minimum_tcb` and `measurement`
/// are required. The fields after `vmpl` came later: each is left out of
/// the canonical form at its default, which checks nothing, so a policy
/// written before them parses to the same value and measures the same.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnpPolicy {
    /// Every component of `reported_tcb` and of `launch_tcb` must be at
    /// least this, unless `minimum_tcb_by_line` has an entry for the
    /// report's product line, which then applies instead.
    pub minimum_tcb: Tcb,
    /// The launch measurement (48 bytes); `also_measurements` may accept
    /// more.
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
    /// The minimum TCB of reports of one product line, replacing
    /// `minimum_tcb` for that line (SVNs of different lines are not
    /// comparable); lines without an entry keep `minimum_tcb`. Turin's
    /// entry may also set `fmc`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub minimum_tcb_by_line: BTreeMap<ProductLine, LineTcb>,
    /// The guest SVN (set by the ID block at launch) must be at least
    /// this; 0, the default, checks nothing.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub minimum_guest_svn: u32,
    /// The SHA-384 digest of the ID key that signed the guest's ID block;
    /// absent means not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_key_digest: Option<Hex<48>>,
    /// The SHA-384 digest of the author key that certified the ID key
    /// (the report must have `AUTHOR_KEY_EN`); absent means not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub author_key_digest: Option<Hex<48>>,
    /// Accept a guest that may run on SMT siblings (default). `false`
    /// requires a guest policy that forbids SMT, which the firmware
    /// enforces for the guest's life, and a platform that reports SMT
    /// disabled.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub allow_smt: bool,
    /// Require a guest policy that restricts the guest to one socket.
    #[serde(default, skip_serializing_if = "is_false")]
    pub require_single_socket: bool,
    /// Platform features `platform_info` must show enabled.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub require_platform: BTreeSet<PlatformFeature>,
    /// Further launch measurements accepted besides `measurement` (at
    /// most [`MAX_ALSO_MEASUREMENTS`]). The measurement covers one VMSA
    /// page per vCPU and the vCPU model, so nodes of different sizes or
    /// CPU models, or a firmware rollout, each need their own.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub also_measurements: BTreeSet<Hex<48>>,
}

impl SnpPolicy {
    /// A policy of `minimum_tcb` and `measurement` that checks nothing
    /// else beyond what every report must show (no debugging, no migration
    /// agent, VMPL 0): the base for a struct update.
    pub fn new(minimum_tcb: Tcb, measurement: Hex<48>) -> Self {
        Self {
            minimum_tcb,
            measurement,
            host_data: None,
            allow_migration_agent: false,
            vmpl: 0,
            minimum_tcb_by_line: BTreeMap::new(),
            minimum_guest_svn: 0,
            id_key_digest: None,
            author_key_digest: None,
            allow_smt: true,
            require_single_socket: false,
            require_platform: BTreeSet::new(),
            also_measurements: BTreeSet::new(),
        }
    }

    /// The minimum a report of the product line `line` (as
    /// [`super::snp::product_line`] names it) is held to: `minimum_tcb`
    /// where `minimum_tcb_by_line` is empty, else the line's entry there;
    /// `None` for a line without one. Once an operator gives minimums by
    /// line, a line left out (a host of another line, or one this code
    /// does not know) is refused rather than held to a global minimum that
    /// may have been set low for the lines listed.
    pub fn minimum_tcb_for(&self, line: &str) -> Option<MinimumTcb> {
        if self.minimum_tcb_by_line.is_empty() {
            return Some(MinimumTcb {
                tcb: self.minimum_tcb.into(),
                setting: "minimum_tcb",
            });
        }
        let entry = ProductLine::from_name(line).and_then(|l| self.minimum_tcb_by_line.get(&l))?;
        Some(MinimumTcb {
            tcb: *entry,
            setting: "minimum_tcb_by_line",
        })
    }

    /// What parsing cannot refuse: a VMPL SNP does not define, an FMC
    /// minimum for a line without an FMC SVN, a key digest of zeros (the
    /// report's value when no key was given, so it would name no key),
    /// more further measurements than [`MAX_ALSO_MEASUREMENTS`].
    fn validate(&self) -> Result<(), String> {
        check_also("sev_snp.also_measurements", &self.also_measurements)?;
        if self.vmpl > MAX_VMPL {
            return Err(format!(
                "sev_snp.vmpl {} is not a VMPL (0-{MAX_VMPL})",
                self.vmpl
            ));
        }
        if let Some((line, _)) = self
            .minimum_tcb_by_line
            .iter()
            .find(|(line, tcb)| **line != ProductLine::Turin && tcb.fmc.is_some())
        {
            return Err(format!(
                "sev_snp.minimum_tcb_by_line.{line}.fmc: only Turin's TCB has an FMC SVN"
            ));
        }
        for (name, digest) in [
            ("id_key_digest", &self.id_key_digest),
            ("author_key_digest", &self.author_key_digest),
        ] {
            if digest.is_some_and(|d| d.0 == [0; 48]) {
                return Err(format!(
                    "sev_snp.{name} is all zeros, what a report without that key shows: \
                     name the key's SHA-384 digest or leave it out"
                ));
            }
        }
        Ok(())
    }
}

/// Highest VMPL SEV-SNP defines.
pub const MAX_VMPL: u32 = 3;

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn is_true(v: &bool) -> bool {
    *v
}

fn yes() -> bool {
    true
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

/// What a TDX quote must show. `xfam`, `mr_config_id`, `mr_owner` and
/// `also_mrtd` came later: each is left out of the canonical form when
/// absent (or empty), so a policy written before them parses to the same
/// value and measures the same.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TdxPolicy {
    /// MRTD: the initial TD contents (48 bytes); `also_mrtd` may accept
    /// more.
    pub mrtd: Hex<48>,
    /// RTMR 0-3; `null` leaves that register unchecked.
    #[serde(default)]
    pub rtmr: [Option<Hex<48>>; 4],
    /// TCB statuses accepted besides `UpToDate`, by name (never `Revoked`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_tcb_status: Vec<String>,
    /// XFAM, the extended features the TD may use (8 bytes as the quote
    /// carries them, little-endian); absent means not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xfam: Option<Hex<8>>,
    /// MRCONFIGID, the TD's configuration as its creator set it (48
    /// bytes); absent means not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mr_config_id: Option<Hex<48>>,
    /// MROWNER, the TD owner's identity as its creator set it (48 bytes);
    /// absent means not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mr_owner: Option<Hex<48>>,
    /// Further MRTDs accepted besides `mrtd` (at most
    /// [`MAX_ALSO_MEASUREMENTS`]): MRTD changes with the TD firmware
    /// (TDVF), so nodes on different firmware builds each need their own.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub also_mrtd: BTreeSet<Hex<48>>,
}

impl TdxPolicy {
    /// A policy of `mrtd` that checks nothing else beyond what every quote
    /// must show (no debugging, `UpToDate`): the base for a struct update.
    pub fn new(mrtd: Hex<48>) -> Self {
        Self {
            mrtd,
            rtmr: [None; 4],
            allow_tcb_status: Vec::new(),
            xfam: None,
            mr_config_id: None,
            mr_owner: None,
            also_mrtd: BTreeSet::new(),
        }
    }

    /// What parsing cannot refuse: an unknown TCB status, or `Revoked`;
    /// more further MRTDs than [`MAX_ALSO_MEASUREMENTS`].
    fn validate(&self) -> Result<(), String> {
        check_also("tdx.also_mrtd", &self.also_mrtd)?;
        match self
            .allow_tcb_status
            .iter()
            .find(|s| *s == "Revoked" || !TDX_TCB_STATUSES.contains(&s.as_str()))
        {
            Some(status) => Err(format!("TCB status {status:?} cannot be allowed")),
            None => Ok(()),
        }
    }
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

    /// Refuses a variant without its section, a section for another
    /// variant, and values parsing takes but the variant cannot use (an
    /// unknown or `Revoked` TCB status, a VMPL above 3, an FMC minimum for
    /// a line other than Turin, a key digest of zeros, more than
    /// [`MAX_ALSO_MEASUREMENTS`] further measurements or MRTDs).
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
                snp.validate()?;
                Ok(Self::SevSnp(snp))
            }
            Variant::Tdx if c.sev_snp.is_some() => Err(other("sev_snp")),
            Variant::Tdx => {
                let tdx = c
                    .tdx
                    .clone()
                    .ok_or_else(|| "the tdx variant needs a tdx section".to_string())?;
                tdx.validate()?;
                Ok(Self::Tdx(tdx))
            }
        }
    }
}
