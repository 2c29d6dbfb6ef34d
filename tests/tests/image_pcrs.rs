//! Boots a built image under QEMU + OVMF + swtpm with a node config passed
//! by fw_cfg, and checks that the PCRs the agent reports equal the
//! prediction made from the image files alone (4, 9, 11 from the UKI, 12
//! from the node config, 2 with no firmware driver from outside OVMF), and that the agent's startup measurements replay
//! to PCRs 12, 13 and 15, and that the initrd loaded every optional
//! module. Reports the time from VM start to `keel-agent: ready`, and
//! where it went ([`keel_e2e::timeline`]). Then
//! boots a copy whose root partition has one byte changed, which must not
//! get past the initrd.
//!
//! Opt-in: set `KEEL_IMAGE_DIR` (e.g. `build/image`); without it the test
//! says so and passes. `KEEL_VM_BOOTS` boots more than once and reports the
//! median; `KEEL_VM_PATIENCE_S` bounds each wait (default 600 s);
//! `KEEL_VM_WORK` keeps the VM's logs there instead of a temporary
//! directory. `scripts/vm-boot.sh` runs it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_e2e::image::{workspace_root, ImageDir, IMAGE_DIR_VAR};
use keel_e2e::report::{reported_pcrs, INITRD_MODULE_SKIPPED_LINE, READY_LINE};
use keel_e2e::timeline::{self, BootTimeline};
use keel_e2e::vm::{Vm, VmBuilder, VmError};
use keel_image::predict::{self, Uki};
use keel_verifier::config::NodeConfig;
use keel_verifier::measurement::{self, Event, EventType, HexDigest};
use keel_verifier::measurements::Measurements;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn env_number(name: &str, default: u64) -> Result<u64, Box<dyn std::error::Error>> {
    match std::env::var(name) {
        Ok(v) => Ok(v
            .parse()
            .map_err(|_| format!("{name}={v:?} is not a number"))?),
        Err(_) => Ok(default),
    }
}

/// The measurements file for `image` booted with `config`.
fn predict(
    image: &ImageDir,
    config: &NodeConfig,
) -> Result<Measurements, Box<dyn std::error::Error>> {
    let bytes = std::fs::read(image.uki())?;
    let uki = Uki::parse(&bytes)?;
    // keel-measure's own construction.
    Ok(predict::measurements(
        &uki,
        config,
        predict::FirmwareDrivers::None,
    )?)
}

/// The agent's startup log for `config`: the cluster part, then the node
/// part, as `keel-agent run` records them on a fresh boot.
fn startup_events(config: &NodeConfig) -> Vec<Event> {
    vec![
        Event::new(
            0,
            EventType::NodeConfig,
            "node config",
            config.cluster_bytes(),
        ),
        Event::new(
            1,
            EventType::NodeIdentity,
            "node identity",
            config.node_bytes(),
        ),
    ]
}

fn boot_once(
    image: &ImageDir,
    config_path: &Path,
    work: &Path,
    patience: Duration,
) -> Result<(Vm, Duration), Box<dyn std::error::Error>> {
    let vm = VmBuilder::new(image.disk(), work)
        .node_config(config_path)
        .start()?;
    let ready = vm.wait_for_line(READY_LINE, patience)?;
    // The PCR lines precede the ready line; give the console a moment to
    // flush anything printed after it (a restart would print again).
    std::thread::sleep(Duration::from_millis(300));
    Ok((vm, ready))
}

#[test]
fn booted_pcrs_match_the_prediction() -> TestResult {
    let Some(image) = ImageDir::from_env()? else {
        eprintln!(
            "skipped: no image to boot. Set {IMAGE_DIR_VAR}=build/image after `make image` \
             (scripts/vm-boot.sh does both)."
        );
        return Ok(());
    };
    let boots = env_number("KEEL_VM_BOOTS", 1)?.max(1);
    let patience = Duration::from_secs(env_number("KEEL_VM_PATIENCE_S", 600)?);
    let config_path = workspace_root().join("tests/fixtures/node-config.json");
    let (config, _) = NodeConfig::load(Some(&config_path))?;
    let expected = predict(&image, &config)?;
    let tmp = tempfile::tempdir()?;
    let work_root = work_root(tmp.path());

    let mut times = Vec::new();
    let mut timelines = Vec::new();
    for boot in 1..=boots {
        let work = work_root.join(format!("boot{boot}"));
        let (vm, ready) = boot_once(&image, &config_path, &work, patience)?;
        let lines = vm.lines();
        let reported = reported_pcrs(lines.iter().map(String::as_str));

        let mismatches = expected.compare(&reported);
        for m in &mismatches {
            eprintln!("boot {boot}: {m}");
        }
        assert!(
            mismatches.is_empty(),
            "boot {boot}: predicted and booted PCRs differ; serial log {}",
            vm.serial_log().display()
        );
        // On QEMU every optional module of the initrd loads: one that does
        // not is missing from mkosi.conf's KernelModulesInitrdInclude, and
        // the boot falls back to slower paths without failing.
        let skipped: Vec<&String> = lines
            .iter()
            .filter(|l| l.contains(INITRD_MODULE_SKIPPED_LINE))
            .collect();
        assert!(
            skipped.is_empty(),
            "boot {boot}: the initrd skipped optional modules: {skipped:?}"
        );
        measurement::verify_replay(&startup_events(&config), &reported).map_err(|e| {
            format!(
                "boot {boot}: the agent's startup measurements do not replay: {e}; serial log {}",
                vm.serial_log().display()
            )
        })?;
        eprintln!(
            "boot {boot}: ready {:.1} s after VM start ({:?}); PCRs 2, 4, 9, 11, 12 as predicted; \
             startup log replays to PCRs 12, 13, 15",
            ready.as_secs_f64(),
            vm.accel()
        );
        times.push(ready);
        let serial = std::fs::read_to_string(vm.serial_log())?;
        match BootTimeline::parse(&serial) {
            Ok(t) => {
                eprint!("{t}");
                timelines.push(t);
            }
            Err(e) => eprintln!("boot {boot}: no breakdown: {e}"),
        }
    }

    for (pcr, e) in expected.iter() {
        eprintln!("pcr {pcr:>2} predicted = booted {}", HexDigest(&e.digest));
    }
    eprintln!(
        "VM start -> {READY_LINE:?}: {} over {} boot(s)",
        spread(times.iter().map(Duration::as_secs_f64).collect()),
        times.len()
    );
    if !timelines.is_empty() {
        eprintln!(
            "VM start -> agent ready (the guest's clock, before journald shows the line): {}",
            spread(timelines.iter().map(|t| t.ready().as_secs_f64()).collect())
        );
        eprint!(
            "where the time goes, median of {} boot(s):\n{}",
            timelines.len(),
            timeline::median_table(&timelines)
        );
    }
    Ok(())
}

/// What a single-boot test needs: the built image (none: the test is
/// skipped), the patience for its boot, the node config, a temporary
/// directory and the boot's work directory in it (named `name`).
struct Boot {
    image: ImageDir,
    patience: Duration,
    config_path: std::path::PathBuf,
    tmp: tempfile::TempDir,
    work: std::path::PathBuf,
}

impl Boot {
    fn new(name: &str) -> Result<Option<Self>, Box<dyn std::error::Error>> {
        let Some(image) = ImageDir::from_env()? else {
            eprintln!("skipped: no image to boot (set {IMAGE_DIR_VAR}=build/image)");
            return Ok(None);
        };
        let tmp = tempfile::tempdir()?;
        let work = work_root(tmp.path()).join(name);
        Ok(Some(Self {
            image,
            patience: Duration::from_secs(env_number("KEEL_VM_PATIENCE_S", 600)?),
            config_path: workspace_root().join("tests/fixtures/node-config.json"),
            tmp,
            work,
        }))
    }

    /// A VM booting `disk` with the fixture config, its files in this
    /// boot's work directory.
    fn vm(&self, disk: impl Into<PathBuf>) -> VmBuilder {
        VmBuilder::new(disk, &self.work).node_config(&self.config_path)
    }
}

/// The attacker's move against the root file system: change it on disk and
/// leave the UKI, and with it every PCR, as it is. One byte changes in the
/// root partition's first block, in the 1 KiB erofs leaves unused before its
/// superblock: without dm-verity the root would mount and boot as before.
/// With it the initrd's mount reads a block that fails its hash, and the
/// kernel panics (`panic_on_corruption`: a host that could make chosen
/// blocks fail to read could hide chosen directories from systemd), so
/// nothing on the root runs.
#[test]
fn a_changed_root_does_not_boot() -> TestResult {
    let Some(boot) = Boot::new("changed-root")? else {
        return Ok(());
    };
    std::fs::create_dir_all(&boot.work)?;
    // The copy is large: it lives in the temporary directory, not the logs.
    let disk = boot.tmp.path().join("changed-root.raw");
    std::fs::copy(boot.image.disk(), &disk)?;
    let root = partition_offset(&disk, ROOT_PARTITION)?;
    flip_byte(&disk, root + 512)?;

    let vm = boot.vm(&disk).start()?;
    vm.wait_for_line("dm-verity device corrupted", boot.patience)?;
    let lines = vm.lines();
    let refusal = lines
        .iter()
        .find(|l| l.contains("dm-verity device corrupted"))
        .ok_or("no refusal line")?;
    assert!(refusal.contains("Kernel panic"), "{refusal}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("verity") && l.contains("block 0 is corrupted")),
        "no corrupted block named; serial log {}",
        vm.serial_log().display()
    );
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("root opened") || l.contains(READY_LINE)),
        "the changed root was opened; serial log {}",
        vm.serial_log().display()
    );
    eprintln!("changed root refused: {}", refusal.trim());
    Ok(())
}

/// A mask is a file the host can hide: dm-verity panics on a block that
/// fails its hash but passes a read error from the disk below on as EIO,
/// and systemd runs a generator or unit whose mask it cannot read. So what
/// the image masks to keep logins, shells, partitions-by-type and PCR
/// extensions away is not on its root at all; the masks stay, and the
/// control shows that the listing finds what is there.
#[test]
fn what_the_image_masks_is_not_on_its_root() -> TestResult {
    let Some(image) = ImageDir::from_env()? else {
        eprintln!("skipped: no image to read (set {IMAGE_DIR_VAR}=build/image)");
        return Ok(());
    };
    let root = image.root();
    // The names in a directory of the root, by dump.erofs (erofs-utils);
    // an error for a directory it cannot list.
    let listing = |dir: &str| -> Result<Vec<String>, Box<dyn std::error::Error>> {
        let out = std::process::Command::new("dump.erofs")
            .args(["--ls", &format!("--path={dir}")])
            .arg(&root)
            .output()
            .map_err(|e| format!("dump.erofs (erofs-utils): {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let (_, entries) = text
            .split_once("FILENAME\n")
            .ok_or_else(|| format!("dump.erofs cannot list {dir}: {text}"))?;
        Ok(entries
            .lines()
            .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
            .collect())
    };
    let conf = std::fs::read_to_string(workspace_root().join("mkosi/mkosi.conf"))?;
    // The entries of the one RemoveFiles=, comments skipped, up to the next
    // setting or section; globs would be compared as names, so none.
    assert_eq!(conf.matches("RemoveFiles=").count(), 1);
    let removed: Vec<&str> = conf
        .split_once("RemoveFiles=\n")
        .ok_or("mkosi.conf has no RemoveFiles=")?
        .1
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map_while(|l| l.strip_prefix("        ").map(str::trim))
        .filter(|p| p.starts_with("/usr/"))
        .collect();
    assert!(removed.len() >= 20, "{removed:?}");
    assert!(
        !removed.iter().any(|p| p.contains(['*', '?', '['])),
        "{removed:?}"
    );
    // Each directory listed once.
    let mut by_dir: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for path in &removed {
        let (dir, name) = path.rsplit_once('/').ok_or(*path)?;
        by_dir.entry(dir).or_default().push(name);
    }
    for (dir, names) in by_dir {
        let there = listing(dir)?;
        for name in names {
            assert!(
                !there.iter().any(|n| n == name),
                "{dir}/{name} is on the root of {}",
                root.display()
            );
        }
    }
    // The control: what is there is listed, the masks among it.
    for (dir, name) in [
        ("/etc/systemd/system", "emergency.service"),
        (
            "/etc/systemd/system-generators",
            "systemd-gpt-auto-generator",
        ),
        ("/usr/lib/systemd/system", "keel-agent.service"),
        ("/usr/sbin", "cryptsetup"),
    ] {
        assert!(
            listing(dir)?.iter().any(|n| n == name),
            "{dir}/{name} is not on the root of {}",
            root.display()
        );
    }
    Ok(())
}

/// The host can hand a VM systemd credentials without changing anything
/// measured: SMBIOS type 11 strings and fw_cfg items. systemd imports them
/// by default, and its units act on them (`tmpfiles.extra` lines run as
/// root, `sysctl.extra` settings such as `kernel.modprobe`, a root password
/// for the console), so a host could run code in an attested node. The
/// image's measured command line turns the import off. Here the host offers
/// a `tmpfiles.extra` line that writes a marker to the console: the node
/// boots to ready and the marker never shows.
#[test]
fn host_credentials_are_not_imported() -> TestResult {
    let Some(boot) = Boot::new("host-credentials")? else {
        return Ok(());
    };
    const MARKER: &str = "keel-test: a host credential was imported";
    let vm = boot
        .vm(boot.image.disk())
        .host_credential(
            "tmpfiles.extra",
            &format!("w /dev/console - - - - {MARKER}"),
        )
        .start()?;
    vm.wait_for_line(READY_LINE, boot.patience)?;
    // systemd-tmpfiles-setup runs during sysinit, seconds after the agent
    // (which starts before it) is ready.
    // The wait must end by running out of time, with the VM still up: a
    // VM that stopped would show no marker either.
    let shown = vm.wait_for_line(MARKER, Duration::from_secs(40));
    assert!(
        matches!(shown, Err(VmError::Timeout { .. })),
        "the host's credential was imported and acted on, or the VM stopped: {shown:?}; \
         serial log {}",
        vm.serial_log().display()
    );
    Ok(())
}

/// Attacker's move: put `SystemdOptions` (systemd's EFI variable of extra
/// kernel command line options, which no PCR covers and systemd reads
/// when Secure Boot is off) in the VM's firmware variable store, asking
/// for the emergency target with a passwordless root shell on the serial
/// console. The node must boot as if the variable were not there: its
/// agent comes up and reports ready.
#[test]
fn host_efi_options_are_ignored() -> TestResult {
    let Some(boot) = Boot::new("host-efi-options")? else {
        return Ok(());
    };
    let options = "systemd.unit=emergency.target systemd.setenv=SYSTEMD_SULOGIN_FORCE=1";
    let utf16: Vec<u8> = options.encode_utf16().flat_map(u16::to_le_bytes).collect();
    let vm = boot
        .vm(boot.image.disk())
        .host_efi_variable(
            "SystemdOptions",
            "8cf2644b-4b0b-428f-9387-6d876050dc67",
            &utf16,
        )
        .start()?;
    let ready = vm.wait_for_line(READY_LINE, boot.patience);
    assert!(
        ready.is_ok(),
        "the node did not come up with the host's SystemdOptions in its firmware \
         variables ({ready:?}); serial log {}",
        vm.serial_log().display()
    );
    Ok(())
}

/// A machine with no TPM at all: the node cannot measure or attest, and
/// must say so on its console (where an operator without a shell looks),
/// once: the agent's unit does not restart it for a TPM no restart brings.
#[test]
fn a_machine_without_a_tpm_says_so_on_its_console() -> TestResult {
    let Some(boot) = Boot::new("no-tpm")? else {
        return Ok(());
    };
    const NO_TPM: &str = "no TPM 2.0 device at /dev/tpmrm0";
    let vm = boot.vm(boot.image.disk()).without_tpm().start()?;
    vm.wait_for_line(NO_TPM, boot.patience)?;
    let told = |vm: &Vm| vm.lines().iter().filter(|l| l.contains(NO_TPM)).count();
    let first = told(&vm);
    // The unit's RestartSec is 3 s: a restart would show within this wait,
    // which ends by running out of time with the VM still up.
    let ready = vm.wait_for_line(READY_LINE, Duration::from_secs(20));
    assert!(
        matches!(ready, Err(VmError::Timeout { .. })),
        "a node without a TPM came up, or the VM stopped: {ready:?}; serial log {}",
        vm.serial_log().display()
    );
    assert_eq!(
        told(&vm),
        first,
        "the agent was restarted on a machine without a TPM; serial log {}",
        vm.serial_log().display()
    );
    Ok(())
}

/// The UEFI driver QEMU gives a virtio NIC by default (Debian's
/// ipxe-qemu, which qemu-system-x86 depends on).
const IPXE_VIRTIO_ROM: &str = "/usr/lib/ipxe/qemu/efi-virtio.rom";

/// Attacker's move: make the firmware run a UEFI driver of the host's
/// choice before the UKI. Here it is a PCI option ROM; a `Driver####`
/// variable naming a file on the ESP works alike. EDK2 measures such a
/// driver into PCR 2, not PCR 4, and the driver stays resident while the
/// firmware starts the UKI, so PCRs 4, 9, 11 and 12 come out as predicted.
/// A driver could patch the kernel after the stub measured it. The image's
/// measurements enforce PCR 2 at its value when no such driver ran, so the
/// node is refused, on PCR 2 alone.
#[test]
fn a_driver_the_host_adds_to_the_firmware_is_refused_by_pcr_2() -> TestResult {
    let Some(boot) = Boot::new("option-rom")? else {
        return Ok(());
    };
    let rom = Path::new(IPXE_VIRTIO_ROM);
    if !rom.is_file() {
        return Err(format!(
            "{} missing (package ipxe-qemu, a dependency of qemu-system-x86)",
            rom.display()
        )
        .into());
    }
    let (config, _) = NodeConfig::load(Some(&boot.config_path))?;
    let expected = predict(&boot.image, &config)?;
    let vm = boot.vm(boot.image.disk()).nic_option_rom(rom).start()?;
    vm.wait_for_line(READY_LINE, boot.patience)?;
    let reported = reported_pcrs(vm.lines().iter().map(String::as_str));
    let mismatches = expected.compare(&reported);
    for m in &mismatches {
        eprintln!("with the option ROM: {m}");
    }
    let pcrs: Vec<u32> = mismatches.iter().map(|m| m.pcr).collect();
    assert_eq!(
        pcrs,
        [predict::PCR_DRIVER_CODE],
        "the firmware's driver must show in PCR 2 and only there; serial log {}",
        vm.serial_log().display()
    );
    assert!(!mismatches[0].warn_only, "PCR 2 must be enforced");
    Ok(())
}

/// The root is the image's second partition (`mkosi/mkosi.repart`).
const ROOT_PARTITION: u64 = 2;
const SECTOR: u64 = 512;

/// The byte offset of GPT partition `number` (from 1) in `disk`.
fn partition_offset(disk: &Path, number: u64) -> Result<u64, Box<dyn std::error::Error>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(disk)?;
    let mut header = [0u8; 92];
    file.seek(SeekFrom::Start(SECTOR))?;
    file.read_exact(&mut header)?;
    if &header[..8] != b"EFI PART" {
        return Err(format!("{} has no GPT header", disk.display()).into());
    }
    let u64_at = |b: &[u8], at: usize| -> Result<u64, Box<dyn std::error::Error>> {
        Ok(u64::from_le_bytes(b[at..at + 8].try_into()?))
    };
    let entries = u64_at(&header, 72)?;
    let entry_size = u64::from(u32::from_le_bytes(header[84..88].try_into()?));
    let mut entry = [0u8; 48];
    file.seek(SeekFrom::Start(
        entries * SECTOR + (number - 1) * entry_size,
    ))?;
    file.read_exact(&mut entry)?;
    Ok(u64_at(&entry, 32)? * SECTOR)
}

fn flip_byte(path: &Path, offset: u64) -> Result<(), Box<dyn std::error::Error>> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset)?;
    file.write_all_at(&[byte[0] ^ 0xff], offset)?;
    Ok(())
}

/// Where the VMs' logs go: `KEEL_VM_WORK`, else `tmp`.
fn work_root(tmp: &Path) -> PathBuf {
    std::env::var_os("KEEL_VM_WORK").map_or_else(|| tmp.into(), Into::into)
}

/// "median M s (min A, max B)" of `seconds` (not empty).
fn spread(mut seconds: Vec<f64>) -> String {
    seconds.sort_by(f64::total_cmp);
    format!(
        "median {:.1} s (min {:.1}, max {:.1})",
        seconds[seconds.len() / 2],
        seconds[0],
        seconds[seconds.len() - 1]
    )
}

/// The check above can fail: a config that differs only in the cluster
/// part predicts another PCR 12, and a log claiming another config does not
/// replay to the PCRs the real one produced.
#[test]
fn another_config_predicts_and_replays_differently() -> TestResult {
    let path = workspace_root().join("tests/fixtures/node-config.json");
    let (config, _) = NodeConfig::load(Some(&path))?;
    let mut other = config.clone();
    other.cluster.init_port += 1;
    assert_ne!(predict::pcr12(&config), predict::pcr12(&other));

    let reported = measurement::replay(&startup_events(&config))?;
    assert!(measurement::verify_replay(&startup_events(&config), &reported).is_ok());
    assert!(measurement::verify_replay(&startup_events(&other), &reported).is_err());
    Ok(())
}
