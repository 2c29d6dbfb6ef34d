//! The events each boot stage measures, modelled from the UKI file.
//!
//! Each function returns the ordered events of one PCR; [`crate::pcr::replay`]
//! turns them into the predicted value. The model is for OVMF booting the
//! UKI directly as the first boot option, systemd-stub 254 and the Linux 6.1
//! EFI stub, with no add-ons, credentials or SMBIOS command-line extras, and
//! with systemd's PCR-extending units (pcrphase, pcrmachine, pcrfs) masked.
//! `docs/measured-boot.md` documents the same list for readers.

use thiserror::Error;

use keel_verifier::config::NodeConfig;
use keel_verifier::measurements::{Expected, Measurements, MeasurementsError};

use crate::authenticode::{self, AuthenticodeError};
use crate::pcr::{replay, Digest, Event};
use crate::pe::{PeError, PeFile, Section};

/// The PCR the firmware measures UEFI drivers into that it loads from
/// outside its own volume: `Driver####` entries and PCI option ROMs.
pub const PCR_DRIVER_CODE: u32 = keel_verifier::measurement::pcr::DRIVER_CODE;
/// The PCR the firmware measures boot applications into.
pub const PCR_BOOT_LOADER_CODE: u32 = 4;
/// The PCR the Linux EFI stub measures the command line and initrd into.
pub const PCR_KERNEL_PARAMETERS: u32 = 9;
/// The PCR systemd-stub measures the UKI's sections into.
pub const PCR_KERNEL_BOOT: u32 = 11;
/// The PCR the keel agent measures its node config into.
pub const PCR_NODE_CONFIG: u32 = keel_verifier::measurement::pcr::CONFIG;

/// The UKI sections systemd-stub measures, in measurement order (`.pcrsig`
/// is never measured: it holds signatures over these very values).
pub const STUB_MEASURED_SECTIONS: [&str; 9] = [
    ".linux", ".osrel", ".cmdline", ".initrd", ".splash", ".dtb", ".uname", ".sbat", ".pcrpkey",
];

/// Sections the stub or a later stub acts on that the prediction does not
/// model: systemd-stub 254 packs `.pcrsig` and `.pcrpkey` into a cpio
/// appended to the initrd (PCR 9), and `.ucode` is covered by PCR 4 alone.
pub const UNMODELLED_SECTIONS: [&str; 3] = [".pcrsig", ".pcrpkey", ".ucode"];

/// The EV_EFI_ACTION string OVMF logs before starting a boot option.
pub const CALLING_EFI_APPLICATION: &str = "Calling EFI Application from Boot Option";

/// A prediction failure.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PredictError {
    /// The UKI is not a PE image.
    #[error("parse the UKI")]
    ParseUki(#[source] PeError),
    /// A section the boot path needs is absent.
    #[error("the UKI has no {0} section")]
    MissingSection(&'static str),
    /// A section's data lies outside the file.
    #[error("read the UKI's {name} section")]
    ReadSection {
        /// The section.
        name: &'static str,
        /// The bounds failure.
        #[source]
        source: PeError,
    },
    /// The UKI's Authenticode hash failed.
    #[error("hash the UKI (Authenticode)")]
    HashUki(#[source] AuthenticodeError),
    /// The embedded kernel is not a PE image.
    #[error("parse the kernel in the .linux section")]
    ParseKernel(#[source] PeError),
    /// The kernel's Authenticode hash failed.
    #[error("hash the kernel (Authenticode)")]
    HashKernel(#[source] AuthenticodeError),
    /// `.cmdline` is not UTF-8.
    #[error("the .cmdline section is not UTF-8")]
    CmdlineEncoding,
    /// Two sections have the same measured name: which one the stub uses is
    /// not what a prediction should guess.
    #[error("the UKI has more than one section named like {0}")]
    AmbiguousSection(&'static str),
    /// A section's name begins with a name the stub acts on without being
    /// it: systemd-stub 254 compares only the known name's length.
    #[error("the UKI's section {name:?} begins with {known}: systemd-stub 254 takes it for {known}, the prediction does not")]
    LookalikeSection {
        /// The section's name.
        name: String,
        /// The name the stub knows.
        known: &'static str,
    },
    /// A measured section has a `VirtualSize` of 0: the stub skips it.
    #[error("the UKI's {0} section is empty (VirtualSize 0): systemd-stub 254 skips it, the prediction does not")]
    EmptySection(&'static str),
    /// A section the prediction does not model.
    #[error("the UKI has a {0} section, which the predictor does not model (systemd-stub 254 appends .pcrsig and .pcrpkey to the initrd it measures into PCR 9; .ucode only PCR 4 covers)")]
    UnmodelledSection(&'static str),
    /// The command line lacks an option the image's security rests on, or
    /// overrides it.
    #[error("the UKI's command line {0}")]
    UnsafeCmdline(String),
    /// The predicted values do not make a measurements file verifiers accept.
    #[error("build the measurements file")]
    Measurements(#[source] MeasurementsError),
    /// The UKI's stub is not the one the prediction models.
    #[error("the UKI's stub is {0:?}, not {STUB_MAGIC:?}: the prediction models systemd-stub 254 alone (later stubs act on sections and load options it does not know)")]
    OtherStub(String),
}

/// The start of the `.sdmagic` section of the stub the prediction models,
/// before its package version (`254.26-1~bpo12+1`, say).
pub const STUB_MAGIC: &str = "#### LoaderInfo: systemd-stub 254";

/// Refuses a UKI whose stub (its `.sdmagic`) is not systemd-stub 254: a
/// later one acts on sections and load options this model does not know
/// (`.profile`, `.dtbauto`, `.hwids`, `.efifw`), and an earlier one
/// measures otherwise.
pub fn check_stub(uki: &Uki<'_>) -> Result<(), PredictError> {
    let magic = uki
        .section(".sdmagic")?
        .ok_or(PredictError::MissingSection(".sdmagic"))?;
    let text = magic.split(|&b| b == 0).next().unwrap_or_default();
    let modelled = text
        .strip_prefix(STUB_MAGIC.as_bytes())
        .is_some_and(|rest| matches!(rest.first(), Some(b'.' | b' ')));
    if modelled {
        Ok(())
    } else {
        Err(PredictError::OtherStub(
            String::from_utf8_lossy(text).chars().take(64).collect(),
        ))
    }
}

/// A UKI file and the section contents the stubs see.
#[derive(Debug)]
pub struct Uki<'a> {
    pe: PeFile<'a>,
}

impl<'a> Uki<'a> {
    /// Parses a UKI, refusing one whose sections the stub would read
    /// otherwise than the prediction: see [`check_sections`].
    pub fn parse(bytes: &'a [u8]) -> Result<Self, PredictError> {
        let pe = PeFile::parse(bytes).map_err(PredictError::ParseUki)?;
        check_sections(pe.sections())?;
        Ok(Self { pe })
    }

    /// The section `name` as loaded in memory, if present.
    pub fn section(&self, name: &'static str) -> Result<Option<Vec<u8>>, PredictError> {
        self.pe
            .section(name)
            .map(|s| self.pe.loaded_data(s))
            .transpose()
            .map_err(|source| PredictError::ReadSection { name, source })
    }

    fn required(&self, name: &'static str) -> Result<Vec<u8>, PredictError> {
        self.section(name)?
            .ok_or(PredictError::MissingSection(name))
    }

    /// The kernel command line as the stub hands it to the kernel.
    pub fn cmdline(&self) -> Result<String, PredictError> {
        let raw = self.required(".cmdline")?;
        let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        let text = std::str::from_utf8(&raw[..end]).map_err(|_| PredictError::CmdlineEncoding)?;
        Ok(mangle_cmdline(text))
    }
}

/// Refuses sections the stub reads otherwise than the prediction: a name
/// that begins with one systemd-stub 254 knows without being it, a known
/// name twice, an empty (`VirtualSize` 0) measured section, or an
/// [`UNMODELLED_SECTIONS`] one.
fn check_sections(sections: &[Section]) -> Result<(), PredictError> {
    const PCRSIG: [&str; 1] = [".pcrsig"];
    for &known in STUB_MEASURED_SECTIONS.iter().chain(&PCRSIG) {
        if let Some(section) = sections
            .iter()
            .find(|s| s.name.starts_with(known) && s.name != known)
        {
            return Err(PredictError::LookalikeSection {
                name: section.name.clone(),
                known,
            });
        }
    }
    for name in UNMODELLED_SECTIONS {
        if sections.iter().any(|s| s.name == name) {
            return Err(PredictError::UnmodelledSection(name));
        }
    }
    for name in STUB_MEASURED_SECTIONS {
        let mut named = sections.iter().filter(|s| s.name == name);
        match (named.next(), named.next()) {
            (Some(_), Some(_)) => return Err(PredictError::AmbiguousSection(name)),
            (Some(s), None) if s.virtual_size == 0 => return Err(PredictError::EmptySection(name)),
            _ => {}
        }
    }
    Ok(())
}

/// Options the measured command line must carry, each once and never
/// given another value: without them a node of the image would take what
/// the host hands it (credentials, partitions by type, EFI variables; see
/// docs/measured-boot.md).
pub const REQUIRED_CMDLINE_OPTIONS: [&str; 3] = [
    "systemd.import_credentials=no",
    "systemd.gpt_auto=0",
    "efi=noruntime",
];

/// Refuses a command line without [`REQUIRED_CMDLINE_OPTIONS`] or without
/// exactly one `roothash=` of 64 hex digits (the root it pins). The line
/// must be one the kernel and systemd split as this check does: printable
/// ASCII words between spaces, no quotes (both readers strip them, so a
/// quoted option counts for them and not here), no `--` (the kernel stops
/// there); keys are compared as systemd compares them, `-` the same as
/// `_` (`systemd.gpt-auto=1` overrides `systemd.gpt_auto=0`).
pub fn check_cmdline(cmdline: &str) -> Result<(), PredictError> {
    if let Some(b) = cmdline
        .bytes()
        .find(|b| !(*b == b' ' || b.is_ascii_graphic()) || matches!(b, b'"' | b'\''))
    {
        return Err(PredictError::UnsafeCmdline(format!(
            "holds the byte {b:#04x}: only printable ASCII without quotes is read alike by the kernel, systemd and this check"
        )));
    }
    let words: Vec<&str> = cmdline.split(' ').filter(|w| !w.is_empty()).collect();
    if words.contains(&"--") {
        return Err(PredictError::UnsafeCmdline(
            "holds `--`: the kernel reads no option after it".into(),
        ));
    }
    let key_of = |word: &str| word.split('=').next().unwrap_or(word).replace('-', "_");
    for required in REQUIRED_CMDLINE_OPTIONS {
        let key = key_of(required);
        let given: Vec<&&str> = words.iter().filter(|w| key_of(w) == key).collect();
        if given.as_slice() != [&required] {
            return Err(PredictError::UnsafeCmdline(format!(
                "must carry {required} once and no other {key}"
            )));
        }
    }
    let roots: Vec<&str> = words
        .iter()
        .filter_map(|w| w.strip_prefix("roothash="))
        .collect();
    match roots.as_slice() {
        [root] if root.len() == 64 && root.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(()),
        _ => Err(PredictError::UnsafeCmdline(
            "must pin the root with one roothash= of 64 hex digits".into(),
        )),
    }
}

/// systemd-stub's `mangle_stub_cmdline`: control characters become spaces
/// and trailing whitespace is dropped.
fn mangle_cmdline(text: &str) -> String {
    let replaced: String = text
        .chars()
        .map(|c| if u32::from(c) <= 0x1f { ' ' } else { c })
        .collect();
    replaced.trim_end_matches([' ', '\t']).to_owned()
}

/// PCR 4: the firmware's boot-application measurements.
///
/// OVMF logs the EV_EFI_ACTION "Calling EFI Application from Boot Option"
/// and the EV_SEPARATOR (four zero bytes) when it starts the boot option,
/// then the Authenticode hash of the UKI (EV_EFI_BOOT_SERVICES_APPLICATION).
/// systemd-stub starts the kernel with `LoadImage`, so the firmware also
/// measures the Authenticode hash of the `.linux` section.
pub fn pcr4(uki: &Uki<'_>) -> Result<Vec<Event>, PredictError> {
    let uki_hash = authenticode::sha256(&uki.pe).map_err(PredictError::HashUki)?;
    let kernel = uki.required(".linux")?;
    let kernel_pe = PeFile::parse(&kernel).map_err(PredictError::ParseKernel)?;
    let kernel_hash = authenticode::sha256(&kernel_pe).map_err(PredictError::HashKernel)?;
    Ok(vec![
        Event::of_data(
            format!("EV_EFI_ACTION {CALLING_EFI_APPLICATION:?}"),
            CALLING_EFI_APPLICATION.as_bytes(),
        ),
        separator(),
        Event::of_digest(
            "EV_EFI_BOOT_SERVICES_APPLICATION UKI (Authenticode)",
            uki_hash,
        ),
        Event::of_digest(
            "EV_EFI_BOOT_SERVICES_APPLICATION .linux (Authenticode)",
            kernel_hash,
        ),
    ])
}

/// PCR 9: the Linux EFI stub's measurements (EV_EVENT_TAG).
///
/// The kernel measures its load options, the command line systemd-stub
/// passes as UTF-16LE including the terminating NUL, then the initrd it
/// receives through the LoadFile2 protocol: the `.initrd` section (no
/// credentials or system extensions are appended here, and [`Uki::parse`]
/// refuses the `.pcrsig` and `.pcrpkey` sections the stub would append).
pub fn pcr9(uki: &Uki<'_>) -> Result<Vec<Event>, PredictError> {
    let cmdline = uki.cmdline()?;
    let mut utf16: Vec<u8> = cmdline.encode_utf16().flat_map(u16::to_le_bytes).collect();
    utf16.extend_from_slice(&[0, 0]);
    let initrd = uki.required(".initrd")?;
    Ok(vec![
        Event::of_data("EV_EVENT_TAG kernel command line (UTF-16LE)", &utf16),
        Event::of_data("EV_EVENT_TAG initrd", &initrd),
    ])
}

/// PCR 11: systemd-stub's measurements (EV_IPL): for every section present,
/// in [`STUB_MEASURED_SECTIONS`] order, the section name with its NUL, then
/// the section's content. Nothing else, as the pcrphase units are masked.
pub fn pcr11(uki: &Uki<'_>) -> Result<Vec<Event>, PredictError> {
    let mut events = Vec::new();
    for name in STUB_MEASURED_SECTIONS {
        if let Some(content) = uki.section(name)? {
            let mut tagged = name.as_bytes().to_vec();
            tagged.push(0);
            events.push(Event::of_data(
                format!("EV_IPL section name {name}"),
                &tagged,
            ));
            events.push(Event::of_data(format!("EV_IPL section {name}"), &content));
        }
    }
    Ok(events)
}

/// PCR 2 when the firmware loads no UEFI driver from outside its own
/// volume: only the EV_SEPARATOR it measures into PCRs 0-7 before it
/// starts the boot option. A driver the host adds (a `Driver####` variable
/// pointing at a file on the ESP, a device's option ROM) is measured here,
/// not into PCR 4, and keeps running after it starts the UKI itself: with
/// PCR 2 enforced, a node whose firmware ran one is refused.
pub fn pcr2() -> Vec<Event> {
    vec![separator()]
}

/// The EV_SEPARATOR (four zero bytes) the firmware measures into each of
/// PCRs 0-7 before it starts the boot option.
fn separator() -> Event {
    Event::of_data("EV_SEPARATOR", &[0u8; 4])
}

/// PCR 12: the value the agent's measurement of `config` gives. It comes
/// from the agent's own code: the event binds the canonical bytes of the
/// config's cluster part to its place in the agent's event log, and only the
/// agent's canonical form and event encoding reproduce it.
pub fn pcr12(config: &NodeConfig) -> Digest {
    config.expected_config_pcr()
}

/// Whether the platform's firmware may load UEFI drivers from outside its
/// own volume (and PCR 2 is then left out of the measurements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirmwareDrivers {
    /// None: PCR 2 is enforced at [`pcr2`] (OVMF with no option ROMs, as
    /// the local cluster boots).
    None,
    /// Some, by the platform's design: PCR 2 is not checked, and a driver
    /// the host adds goes unseen.
    Allowed,
}

/// The measurements file for `uki` booted with `config`: PCRs 4, 9, 11 and
/// 12, and PCR 2 unless `drivers` allows firmware drivers, each enforced.
/// Built by the verifiers' own type, so a file that the CLI or a join
/// service would refuse is never produced; refused for a UKI whose command
/// line fails [`check_cmdline`].
pub fn measurements(
    uki: &Uki<'_>,
    config: &NodeConfig,
    drivers: FirmwareDrivers,
) -> Result<Measurements, PredictError> {
    check_stub(uki)?;
    check_cmdline(&uki.cmdline()?)?;
    let driver_code = (drivers == FirmwareDrivers::None)
        .then(|| (PCR_DRIVER_CODE, Expected::enforced(replay(&pcr2()))));
    Measurements::new(driver_code.into_iter().chain([
        (
            PCR_BOOT_LOADER_CODE,
            Expected::enforced(replay(&pcr4(uki)?)),
        ),
        (
            PCR_KERNEL_PARAMETERS,
            Expected::enforced(replay(&pcr9(uki)?)),
        ),
        (PCR_KERNEL_BOOT, Expected::enforced(replay(&pcr11(uki)?))),
        (PCR_NODE_CONFIG, Expected::enforced(pcr12(config))),
    ]))
    .map_err(PredictError::Measurements)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testpe::{self, SectionSpec};

    use crate::testpe::SAFE_CMDLINE;

    #[test]
    fn a_command_line_without_what_the_image_rests_on_is_refused() {
        // As the stub hands it on (and `Uki::cmdline` gives it).
        let safe = mangle_cmdline(SAFE_CMDLINE);
        check_cmdline(&safe).unwrap();
        let refusal = |line: &str| match check_cmdline(&mangle_cmdline(line)) {
            Err(e) => e.to_string(),
            Ok(()) => panic!("taken: {line}"),
        };
        let root = "roothash=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        for option in REQUIRED_CMDLINE_OPTIONS {
            let key = option.split('=').next().unwrap();
            for bad in [
                safe.replace(option, ""),
                format!("{safe} {key}=1"),
                // systemd takes `-` for `_` in its keys, the last value winning.
                format!("{safe} {}=1", key.replace('_', "-")),
                format!("{safe} {option}"),
            ] {
                assert!(refusal(&bad).contains(option), "{bad}");
            }
        }
        for (bad, why) in [
            (safe.replace(root, ""), "roothash"),
            (safe.replace(root, &format!("{root} {root}")), "roothash"),
            (safe.replace(root, "roothash=abc"), "roothash"),
            // Read otherwise by the kernel or systemd than split here.
            (format!("{safe} \"efi=runtime\""), "0x22"),
            (format!("{safe} x='a efi=noruntime'"), "0x27"),
            (safe.replace("efi=noruntime", "-- efi=noruntime"), "--"),
            // The kernel's isspace() takes 0xa0 for a space: a UTF-8
            // character holding that byte splits a word for it alone.
            (format!("{safe} foo\u{2020}efi=runtime"), "0xe2"),
            (format!("{safe} foo\u{a0}efi=runtime"), "0xc2"),
            // A tab becomes a space in the stub: another efi= then.
            (format!("{safe}\tefi=runtime"), "efi=noruntime"),
        ] {
            assert!(refusal(&bad).contains(why), "{bad}: {}", refusal(&bad));
        }
    }

    #[test]
    fn a_uki_with_two_sections_named_alike_is_refused() {
        let uki = |second: &'static str| {
            testpe::build(
                &[
                    SectionSpec::new(".linux", b"kernel", 0x200),
                    SectionSpec::new(".cmdline", SAFE_CMDLINE.as_bytes(), 0x600),
                    SectionSpec::new(second, b"other", 0x800),
                ],
                b"",
                b"",
                0,
            )
        };
        for (second, named) in [
            (".cmdline", ".cmdline"),
            (".linux", ".linux"),
            (".linuxx", ".linux"),
        ] {
            let refused = Uki::parse(&uki(second)).unwrap_err();
            assert!(refused.to_string().contains(named), "{second}: {refused}");
        }
        // A name no measured section begins: a section the stub ignores.
        Uki::parse(&uki(".cmdlin2")).unwrap();
    }

    /// A UKI with `.linux`, a safe `.cmdline`, `.initrd` and `extra`.
    fn uki_with(extra: SectionSpec) -> Vec<u8> {
        testpe::build(
            &[
                SectionSpec::new(".linux", b"kernel", 0x200),
                SectionSpec::new(".cmdline", SAFE_CMDLINE.as_bytes(), 0x400),
                SectionSpec::new(".initrd", b"initrd", 0x600),
                extra,
            ],
            b"",
            b"",
            0,
        )
    }

    #[test]
    fn a_lone_section_named_with_a_measured_prefix_is_refused() {
        for (name, known) in [
            (".osrelX", ".osrel"),
            (".dtbX", ".dtb"),
            (".sbatX", ".sbat"),
            (".splash2", ".splash"),
            (".unameX", ".uname"),
            (".pcrsigX", ".pcrsig"),
        ] {
            match Uki::parse(&uki_with(SectionSpec::new(name, b"x", 0x800))) {
                Err(PredictError::LookalikeSection { name: n, known: k }) => {
                    assert_eq!((n.as_str(), k), (name, known));
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        // The sections of the project's own UKI (systemd-stub 254, ukify),
        // and the other measured names, are taken.
        for name in [
            ".text", ".rodata", ".data", ".sdmagic", ".sbat", ".reloc", ".osrel", ".uname",
            ".splash", ".dtb",
        ] {
            let bytes = uki_with(SectionSpec::new(name, b"x", 0x800));
            if let Err(e) = Uki::parse(&bytes) {
                panic!("{name}: {e}");
            }
        }
    }

    #[test]
    fn an_empty_measured_section_is_refused() {
        let empty = |name| SectionSpec {
            virtual_size: 0,
            ..SectionSpec::new(name, b"x", 0x800)
        };
        for name in [".osrel", ".uname", ".sbat"] {
            assert!(
                matches!(Uki::parse(&uki_with(empty(name))), Err(PredictError::EmptySection(n)) if n == name),
                "{name}"
            );
        }
        let empty_linux = testpe::build(
            &[
                SectionSpec {
                    virtual_size: 0,
                    ..SectionSpec::new(".linux", b"kernel", 0x200)
                },
                SectionSpec::new(".cmdline", SAFE_CMDLINE.as_bytes(), 0x400),
                SectionSpec::new(".initrd", b"initrd", 0x600),
            ],
            b"",
            b"",
            0,
        );
        assert!(matches!(
            Uki::parse(&empty_linux),
            Err(PredictError::EmptySection(".linux"))
        ));
        // An empty section the stub does not measure is no concern.
        Uki::parse(&uki_with(empty(".bss"))).unwrap();
    }

    #[test]
    fn a_uki_with_sections_the_prediction_does_not_model_is_refused() {
        for name in UNMODELLED_SECTIONS {
            let refused = Uki::parse(&uki_with(SectionSpec::new(name, b"x", 0x800))).unwrap_err();
            assert!(
                matches!(refused, PredictError::UnmodelledSection(n) if n == name),
                "{name}: {refused:?}"
            );
            assert!(refused.to_string().contains("does not model"), "{refused}");
        }
    }

    /// A UKI of another stub, or of none that says which, is refused:
    /// the prediction models systemd-stub 254 alone.
    #[test]
    fn a_uki_of_another_stub_is_refused() {
        let config = NodeConfig::parse(
            br#"{"node": {"name": "a"}}"#,
            std::path::Path::new("node-config.json"),
        )
        .unwrap();
        let with_magic = |magic: Option<&[u8]>| {
            let mut sections = vec![
                SectionSpec::new(".linux", b"kernel", 0x200),
                SectionSpec::new(".cmdline", SAFE_CMDLINE.as_bytes(), 0x400),
                SectionSpec::new(".initrd", b"initrd", 0x600),
            ];
            sections.extend(magic.map(|m| SectionSpec::new(".sdmagic", m, 0x800)));
            testpe::build(&sections, b"", b"", 0)
        };
        for (magic, why) in [
            (
                Some(&b"#### LoaderInfo: systemd-stub 257.9-1 ####\0"[..]),
                "systemd-stub 257",
            ),
            (Some(b"#### LoaderInfo: systemd-stub 2540 ####\0"), "2540"),
            (
                Some(b"#### LoaderInfo: systemd-boot 254.26 ####\0"),
                "systemd-boot",
            ),
            (None, ".sdmagic"),
        ] {
            let bytes = with_magic(magic);
            let uki = Uki::parse(&bytes).unwrap();
            let refused = measurements(&uki, &config, FirmwareDrivers::None).unwrap_err();
            assert!(refused.to_string().contains(why), "{why}: {refused}");
        }
        let bytes = with_magic(Some(testpe::STUB_254_MAGIC));
        check_stub(&Uki::parse(&bytes).unwrap()).unwrap();
    }

    #[test]
    fn mangling_replaces_controls_and_trims_the_end() {
        assert_eq!(mangle_cmdline("a\nb c \n"), "a b c");
        assert_eq!(mangle_cmdline("console=ttyS0"), "console=ttyS0");
    }

    #[test]
    fn pcr12_follows_the_cluster_part_only() -> Result<(), Box<dyn std::error::Error>> {
        let path = std::path::Path::new("node-config.json");
        let a = NodeConfig::parse(
            br#"{"cluster": {"init_port": 9000}, "node": {"name": "a"}}"#,
            path,
        )?;
        let b = NodeConfig::parse(br#"{"node": {"name": "b", "role": "control-plane"}}"#, path)?;
        let c = NodeConfig::parse(br#"{"cluster": {"init_port": 9001}}"#, path)?;
        // Same cluster part (defaults spelled out or not): same PCR 12.
        assert_eq!(pcr12(&a), pcr12(&b));
        assert_ne!(pcr12(&a), pcr12(&c));
        assert_ne!(pcr12(&a), [0; 32]);
        Ok(())
    }

    #[test]
    fn the_measurements_file_enforces_what_verifiers_require(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let kernel = testpe::build(
            &[SectionSpec::new(".text", b"kernel code", 0x200)],
            b"",
            b"",
            0,
        );
        let uki = testpe::build(
            &[
                SectionSpec::new(".linux", &kernel, 0x200),
                SectionSpec::new(".cmdline", SAFE_CMDLINE.as_bytes(), 0x600),
                SectionSpec::new(".initrd", b"initrd", 0x800),
                SectionSpec::new(".sdmagic", testpe::STUB_254_MAGIC, 0xa00),
            ],
            b"",
            b"",
            0,
        );
        let uki = Uki::parse(&uki)?;
        let config = NodeConfig::parse(
            br#"{"node": {"name": "a"}}"#,
            std::path::Path::new("node-config.json"),
        )?;
        let m = measurements(&uki, &config, FirmwareDrivers::None)?;
        let pcrs: Vec<(u32, bool)> = m.iter().map(|(p, e)| (*p, e.warn_only)).collect();
        assert_eq!(
            pcrs,
            [(2, false), (4, false), (9, false), (11, false), (12, false)]
        );
        // The separator alone: SHA-256(32 zero bytes || SHA-256(00000000)).
        assert_eq!(
            hex::encode(m.get(PCR_DRIVER_CODE).unwrap().digest),
            "3d458cfe55cc03ea1f443f1562beec8df51c75e14a9fcf9a7234a13f198e7969"
        );
        // The value the agent's join client compares its own PCR 2 with.
        assert_eq!(
            replay(&pcr2()),
            keel_verifier::measurement::pcr::no_firmware_drivers()
        );
        let allowed = measurements(&uki, &config, FirmwareDrivers::Allowed)?;
        let pcrs: Vec<u32> = allowed.iter().map(|(p, _)| *p).collect();
        assert_eq!(pcrs, [4, 9, 11, 12]);
        assert!(m
            .iter()
            .any(|(p, e)| *p == PCR_NODE_CONFIG && e.digest == pcr12(&config)));
        let pcr11_value = replay(&pcr11(&uki)?);
        assert!(m
            .iter()
            .any(|(p, e)| *p == PCR_KERNEL_BOOT && e.digest == pcr11_value));
        // What keel-measure writes is what the CLI and the node read back.
        assert_eq!(Measurements::parse(m.to_json().as_bytes())?, m);
        Ok(())
    }
}
