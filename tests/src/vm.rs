//! One keel VM: QEMU (q35) booting a disk image through OVMF, swtpm as its
//! TPM (a fresh one, or a TPM state manufactured elsewhere, e.g. with a
//! cluster's own EK CA), and its serial console captured line by line, with
//! the time each line arrived, into a log file. Optionally a state disk, a
//! firmware variable store and QEMU user networking with host port
//! forwards (loopback only). Dropping the [`Vm`] kills QEMU and swtpm;
//! [`Vm::detach`] leaves them running.
//!
//! ```no_run
//! # use std::time::Duration;
//! # use keel_e2e::vm::VmBuilder;
//! # fn main() -> Result<(), keel_e2e::vm::VmError> {
//! let vm = VmBuilder::new("build/image/keel.raw", "/tmp/vm").start()?;
//! let after = vm.wait_for_line("keel-agent: ready", Duration::from_secs(300))?;
//! println!("ready {:.1} s after VM start", after.as_secs_f64());
//! # Ok(()) }
//! ```

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Environment variable forcing the accelerator: `kvm` or `tcg`.
pub const ACCEL_VAR: &str = "KEEL_VM_ACCEL";

/// The environment variable that names QEMU's CPU model under TCG
/// (default `max`). `max,-la57,-erms,-fsrm` boots to ready about 10%
/// sooner (no five-level page tables, no `rep movsb` memcpy in the guest),
/// but one boot in about twenty with it stalled in the kernel
/// (docs/measured-boot.md), so it is not the default.
pub const TCG_CPU_VAR: &str = "KEEL_VM_CPU";
/// Size of the blank state disk (`/dev/vdb`) each VM gets.
const STATE_DISK_BYTES: u64 = 256 * 1024 * 1024;
/// How long swtpm may take to create its control socket.
const SWTPM_PATIENCE: Duration = Duration::from_secs(10);
/// How long the KVM probe waits for the firmware's boot manager.
const KVM_PROBE_PATIENCE: Duration = Duration::from_secs(15);
/// Longest console line kept; longer ones are cut (a guest cannot make the
/// harness allocate without bound).
const MAX_LINE_BYTES: usize = 16 * 1024;

/// VM failures. Each names the log to read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VmError {
    /// A program could not be started.
    #[error("start {program}")]
    Spawn {
        /// The program.
        program: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A setup program exited with a failure.
    #[error("{program} failed ({status}); see {log}")]
    Setup {
        /// The program.
        program: &'static str,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its output.
        log: PathBuf,
    },
    /// swtpm did not create its socket in time.
    #[error("swtpm did not create {socket} within {SWTPM_PATIENCE:?}; see {log}")]
    SwtpmSocket {
        /// The expected socket.
        socket: PathBuf,
        /// swtpm's log.
        log: PathBuf,
    },
    /// Preparing a file of the VM's work directory failed.
    #[error("prepare {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `renice` failed (raising a priority needs root).
    #[error("renice failed ({0})")]
    Renice(std::process::ExitStatus),
    /// The console closed (QEMU exited) before the awaited line.
    #[error("QEMU exited before printing {needle:?}; serial log {serial}, QEMU log {qemu}")]
    Exited {
        /// The awaited text.
        needle: String,
        /// The serial log.
        serial: PathBuf,
        /// QEMU's own output.
        qemu: PathBuf,
    },
    /// A host variable is not in the store made with it, as it was asked
    /// for: a boot with it would test nothing.
    #[error("the variable store {store} lacks the host's variable {name} as asked for")]
    VariableMissing {
        /// The variable's name.
        name: String,
        /// The store.
        store: PathBuf,
    },
    /// The awaited line did not come in time.
    #[error("no {needle:?} on the console within {patience:?}; serial log {serial}")]
    Timeout {
        /// The awaited text.
        needle: String,
        /// How long was waited.
        patience: Duration,
        /// The serial log.
        serial: PathBuf,
    },
}

/// The UEFI firmware: read-only code and a variable store template.
#[derive(Clone, Debug)]
pub struct Firmware {
    /// The code volume (read-only pflash).
    pub code: PathBuf,
    /// The variable store template, copied for each VM.
    pub vars: PathBuf,
}

impl Firmware {
    /// Debian's 2 MB OVMF build (package `ovmf`): TPM 2.0 measured boot, no
    /// Secure Boot. Under TCG it reaches its boot manager about 3 s sooner
    /// than the 4 MB build, and measures the boot path identically.
    pub fn ovmf() -> Self {
        Self {
            code: "/usr/share/OVMF/OVMF_CODE.fd".into(),
            vars: "/usr/share/OVMF/OVMF_VARS.fd".into(),
        }
    }
}

/// The QEMU accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation (`-accel kvm -cpu host`).
    Kvm,
    /// QEMU's emulator (`-accel tcg -cpu max`, or the CPU model in
    /// [`TCG_CPU_VAR`]).
    Tcg,
}

impl Accel {
    /// `KEEL_VM_ACCEL` when set to `kvm` or `tcg`; otherwise KVM if a probe
    /// VM boots OVMF to its boot manager with it (a usable `/dev/kvm` is not
    /// enough: nested KVM can fail inside the firmware), else TCG. The probe
    /// runs once per process.
    pub fn detect(firmware: &Firmware) -> Self {
        static DETECTED: OnceLock<Accel> = OnceLock::new();
        match std::env::var(ACCEL_VAR).as_deref() {
            Ok("kvm") => Self::Kvm,
            Ok("tcg") => Self::Tcg,
            _ => *DETECTED.get_or_init(|| {
                if kvm_boots_firmware(firmware) {
                    Self::Kvm
                } else {
                    Self::Tcg
                }
            }),
        }
    }

    fn args(self) -> [String; 4] {
        let (accel, cpu) = match self {
            Self::Kvm => ("kvm", "host".to_string()),
            Self::Tcg => (
                "tcg",
                std::env::var(TCG_CPU_VAR)
                    .ok()
                    .filter(|cpu| !cpu.is_empty())
                    .unwrap_or_else(|| "max".to_string()),
            ),
        };
        ["-accel".into(), accel.into(), "-cpu".into(), cpu]
    }
}

/// Boots OVMF alone under KVM and waits for its boot manager's first line.
fn kvm_boots_firmware(firmware: &Firmware) -> bool {
    let usable = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !usable {
        return false;
    }
    let dir = std::env::temp_dir().join(format!("keel-kvm-probe-{}", std::process::id()));
    if fs::create_dir_all(&dir).is_err() {
        return false;
    }
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args([
        "-machine",
        "q35",
        "-m",
        "256",
        "-nodefaults",
        "-display",
        "none",
    ])
    .args(Accel::Kvm.args())
    .args(["-no-reboot", "-serial", "stdio"])
    .arg("-drive")
    .arg(pflash(&firmware.code, "readonly=on"))
    .arg("-drive")
    .arg(pflash(&firmware.vars, "snapshot=on"));
    let booted = match Console::spawn(
        cmd,
        &dir.join("console.raw"),
        &dir.join("serial.log"),
        &dir.join("qemu.log"),
    ) {
        Ok(mut probe) => {
            let booted = probe.wait_for("BdsDxe", KVM_PROBE_PATIENCE).is_ok();
            probe.stop();
            booted
        }
        Err(_) => false,
    };
    // Best effort: the probe's logs are only of use while it runs.
    let _ = fs::remove_dir_all(&dir);
    booted
}

/// Runs the setup program `cmd` (`program`, no input) to completion; a
/// failure names `log`, where its output went.
fn run_setup(program: &'static str, cmd: &mut Command, log: PathBuf) -> Result<(), VmError> {
    let status = cmd
        .stdin(Stdio::null())
        .status()
        .map_err(|source| VmError::Spawn { program, source })?;
    if status.success() {
        Ok(())
    } else {
        Err(VmError::Setup {
            program,
            status,
            log,
        })
    }
}

/// `s` as a value in QEMU's option syntax, which doubles a comma inside a
/// value.
fn qemu_value(s: &str) -> String {
    s.replace(',', ",,")
}

fn pflash(file: &Path, option: &str) -> String {
    format!("if=pflash,format=raw,{option},file={}", file.display())
}

/// What to boot and how.
#[derive(Clone, Debug)]
pub struct VmBuilder {
    disk: PathBuf,
    work_dir: PathBuf,
    firmware: Firmware,
    node_config: Option<PathBuf>,
    accel: Option<Accel>,
    cpus: u32,
    memory_mib: u32,
    tpm: TpmChoice,
    state_disk: Option<PathBuf>,
    vars: Option<PathBuf>,
    network: bool,
    forwards: Vec<(u16, u16)>,
    nic_option_rom: Option<PathBuf>,
    niceness: i32,
    credentials: Vec<(String, String)>,
    efi_variables: Vec<EfiVariable>,
}

/// The VM's TPM.
#[derive(Clone, Debug)]
enum TpmChoice {
    /// A fresh swtpm, provisioned in the work directory.
    Fresh,
    /// A swtpm on the TPM state in this directory, kept.
    State(PathBuf),
    /// No TPM device at all.
    None,
}

/// A UEFI variable the host puts in the VM's firmware variable store.
#[derive(Clone, Debug)]
struct EfiVariable {
    name: String,
    guid: String,
    data: Vec<u8>,
}

impl VmBuilder {
    /// A VM booting `disk` (never written: QEMU snapshot mode), keeping its
    /// TPM state, variable store, state disk and logs in `work_dir`.
    pub fn new(disk: impl Into<PathBuf>, work_dir: impl Into<PathBuf>) -> Self {
        Self {
            disk: disk.into(),
            work_dir: work_dir.into(),
            firmware: Firmware::ovmf(),
            node_config: None,
            accel: None,
            cpus: 2,
            memory_mib: 2048,
            tpm: TpmChoice::Fresh,
            state_disk: None,
            vars: None,
            network: false,
            forwards: Vec::new(),
            nic_option_rom: None,
            niceness: 0,
            credentials: Vec::new(),
            efi_variables: Vec::new(),
        }
    }

    /// Runs QEMU at a lower CPU priority (`nice -n niceness`, every thread):
    /// on a machine with few cores, a VM that boots at the same time as a
    /// more urgent one leaves it the CPU. [`Vm::renice`] changes it later.
    pub fn niceness(mut self, niceness: i32) -> Self {
        self.niceness = niceness;
        self
    }

    /// Other firmware than [`Firmware::ovmf`].
    pub fn firmware(mut self, firmware: Firmware) -> Self {
        self.firmware = firmware;
        self
    }

    /// Passes `path` as fw_cfg item `opt/keel/node-config`, where the agent
    /// looks for its node config first.
    pub fn node_config(mut self, path: impl Into<PathBuf>) -> Self {
        self.node_config = Some(path.into());
        self
    }

    /// Fixes the accelerator instead of [`Accel::detect`].
    pub fn accel(mut self, accel: Accel) -> Self {
        self.accel = Some(accel);
        self
    }

    /// Virtual CPUs (default 2).
    pub fn cpus(mut self, cpus: u32) -> Self {
        self.cpus = cpus;
        self
    }

    /// Memory in MiB (default 2048).
    pub fn memory_mib(mut self, memory_mib: u32) -> Self {
        self.memory_mib = memory_mib;
        self
    }

    /// Uses the TPM state in `dir`, already manufactured (e.g. by
    /// `keel_testkit::swtpm::EkCa::manufacture`), instead of a fresh TPM;
    /// it is kept, so a later VM can boot on the same TPM.
    pub fn tpm_state(mut self, dir: impl Into<PathBuf>) -> Self {
        self.tpm = TpmChoice::State(dir.into());
        self
    }

    /// Gives the VM no TPM at all (no swtpm, no TPM device): a machine a
    /// keel node cannot run on, which must say so.
    pub fn without_tpm(mut self) -> Self {
        self.tpm = TpmChoice::None;
        self
    }

    /// Uses `path` as the state disk (`/dev/vdb`), created blank if it does
    /// not exist and kept as it is otherwise (a reboot), instead of a fresh
    /// blank disk in the work directory.
    pub fn state_disk(mut self, path: impl Into<PathBuf>) -> Self {
        self.state_disk = Some(path.into());
        self
    }

    /// Uses `path` as the firmware variable store, copied from the
    /// firmware's template only if it does not exist yet.
    pub fn vars(mut self, path: impl Into<PathBuf>) -> Self {
        self.vars = Some(path.into());
        self
    }

    /// Gives the VM a NIC on QEMU user networking: the VM is 10.0.2.15
    /// behind its own NAT and reaches the host's loopback as 10.0.2.2.
    pub fn user_network(mut self) -> Self {
        self.network = true;
        self
    }

    /// Forwards `127.0.0.1:host_port` to the VM's TCP `guest_port` (implies
    /// [`VmBuilder::user_network`]).
    pub fn host_forward(mut self, host_port: u16, guest_port: u16) -> Self {
        self.network = true;
        self.forwards.push((host_port, guest_port));
        self
    }

    /// Gives the VM's NIC the option ROM at `rom` (implies
    /// [`VmBuilder::user_network`]), as QEMU does by default with its iPXE
    /// ROMs: the firmware loads the UEFI driver in it. Without this the NIC
    /// has none (`romfile=`).
    pub fn nic_option_rom(mut self, rom: impl Into<PathBuf>) -> Self {
        self.network = true;
        self.nic_option_rom = Some(rom.into());
        self
    }

    /// Offers the guest a systemd credential `name` = `value` the way a host
    /// can without changing anything measured: as an SMBIOS type 11 string
    /// (`io.systemd.credential:name=value`) and as fw_cfg item
    /// `opt/io.systemd.credentials/name`.
    pub fn host_credential(mut self, name: &str, value: &str) -> Self {
        self.credentials.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Puts UEFI variable `name` of vendor `guid` (non-volatile, boot and
    /// runtime access) with `data` into the variable store made from the
    /// firmware's template, as a host can without changing anything the
    /// guest's verifiers enforce. Written with `virt-fw-vars`
    /// (python3-virt-firmware, `make deps`).
    pub fn host_efi_variable(mut self, name: &str, guid: &str, data: &[u8]) -> Self {
        self.efi_variables.push(EfiVariable {
            name: name.to_owned(),
            guid: guid.to_owned(),
            data: data.to_vec(),
        });
        self
    }

    /// Makes the variable store `vars` from the firmware's template, with
    /// the host's variables in it.
    fn make_vars(&self, vars: &Path) -> Result<(), VmError> {
        if self.efi_variables.is_empty() {
            return fs::copy(&self.firmware.vars, vars)
                .map(drop)
                .map_err(io(vars));
        }
        let variables: Vec<_> = self
            .efi_variables
            .iter()
            .map(|v| {
                serde_json::json!({
                    "name": v.name,
                    "guid": v.guid,
                    // non-volatile, boot-service and runtime access
                    "attr": 7,
                    "data": hex::encode(&v.data),
                })
            })
            .collect();
        let json = self.work_dir.join("efi-variables.json");
        fs::write(
            &json,
            serde_json::json!({ "version": 2, "variables": variables }).to_string(),
        )
        .map_err(io(&json))?;
        let log = self.work_dir.join("virt-fw-vars.log");
        let log_file = File::create(&log).map_err(io(&log))?;
        let mut cmd = Command::new("virt-fw-vars");
        cmd.arg("--input")
            .arg(&self.firmware.vars)
            .arg("--output")
            .arg(vars)
            .arg("--set-json")
            .arg(&json)
            .stdout(log_file.try_clone().map_err(io(&log))?)
            .stderr(log_file.try_clone().map_err(io(&log))?);
        run_setup("virt-fw-vars", &mut cmd, log.clone())?;
        // Read back: each variable is in the store, with its attributes
        // and data, or the boot would not be the attack it stands for.
        let dump = self.work_dir.join("efi-variables-readback.json");
        let mut cmd = Command::new("virt-fw-vars");
        cmd.arg("--input")
            .arg(vars)
            .arg("--output-json")
            .arg(&dump)
            .stdout(log_file.try_clone().map_err(io(&log))?)
            .stderr(log_file);
        run_setup("virt-fw-vars", &mut cmd, log)?;
        let read = fs::read(&dump).map_err(io(&dump))?;
        let stored: serde_json::Value = serde_json::from_slice(&read).unwrap_or_default();
        let stored = stored["variables"].as_array().cloned().unwrap_or_default();
        for v in &self.efi_variables {
            let present = stored.iter().any(|s| {
                s["name"] == v.name.as_str()
                    && s["guid"].as_str().map(str::to_ascii_lowercase)
                        == Some(v.guid.to_ascii_lowercase())
                    && s["attr"] == 7
                    && s["data"].as_str().map(str::to_ascii_lowercase) == Some(hex::encode(&v.data))
            });
            if !present {
                return Err(VmError::VariableMissing {
                    name: v.name.clone(),
                    store: vars.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Provisions a TPM (unless one was given or the VM has none), starts
    /// swtpm and QEMU. The
    /// VM's clock (see [`Vm::wait_for_line`]) starts when QEMU is spawned.
    pub fn start(self) -> Result<Vm, VmError> {
        let work = &self.work_dir;
        fs::create_dir_all(work).map_err(io(work))?;
        let accel = self.accel.unwrap_or_else(|| Accel::detect(&self.firmware));
        let swtpm = match &self.tpm {
            TpmChoice::Fresh => Some(Swtpm::start_fresh(work)?),
            TpmChoice::State(state) => Some(Swtpm::start(state, &work.join("tpm"))?),
            TpmChoice::None => None,
        };

        let vars = self.vars.clone().unwrap_or_else(|| work.join("vars.fd"));
        if self.vars.is_none() || !vars.exists() {
            self.make_vars(&vars)?;
        }
        let state = self
            .state_disk
            .clone()
            .unwrap_or_else(|| work.join("state.raw"));
        if self.state_disk.is_none() || !state.exists() {
            File::create(&state)
                .and_then(|f| f.set_len(STATE_DISK_BYTES))
                .map_err(io(&state))?;
        }

        let mut cmd = if self.niceness == 0 {
            Command::new("qemu-system-x86_64")
        } else {
            let mut nice = Command::new("nice");
            nice.args(["-n", &self.niceness.to_string(), "qemu-system-x86_64"]);
            nice
        };
        cmd.args(["-machine", "q35"])
            .args(accel.args())
            .args(["-smp", &self.cpus.to_string()])
            .args(["-m", &self.memory_mib.to_string()])
            .args([
                "-nodefaults",
                "-display",
                "none",
                "-no-reboot",
                "-serial",
                "stdio",
            ])
            .arg("-drive")
            .arg(pflash(&self.firmware.code, "readonly=on"))
            .arg("-drive")
            .arg(pflash(&vars, "snapshot=off"));
        if let Some(swtpm) = &swtpm {
            cmd.arg("-chardev")
                .arg(format!("socket,id=chrtpm,path={}", swtpm.socket.display()))
                .args(["-tpmdev", "emulator,id=tpm0,chardev=chrtpm"])
                .args(["-device", "tpm-tis,tpmdev=tpm0"]);
        }
        cmd.arg("-drive")
            .arg(format!(
                "if=none,id=os,format=raw,snapshot=on,file={}",
                self.disk.display()
            ))
            .args(["-device", "virtio-blk-pci,drive=os,bootindex=1"])
            .arg("-drive")
            .arg(format!(
                "if=none,id=state,format=raw,file={}",
                state.display()
            ))
            .args(["-device", "virtio-blk-pci,drive=state"]);
        if self.network {
            let mut netdev = String::from("user,id=n0,net=10.0.2.0/24");
            for (host, guest) in &self.forwards {
                netdev.push_str(&format!(",hostfwd=tcp:127.0.0.1:{host}-:{guest}"));
            }
            let rom = self
                .nic_option_rom
                .as_ref()
                .map(|r| qemu_value(&r.display().to_string()))
                .unwrap_or_default();
            cmd.arg("-netdev")
                .arg(netdev)
                .arg("-device")
                .arg(format!("virtio-net-pci,netdev=n0,romfile={rom}"));
        }
        for (name, value) in &self.credentials {
            cmd.arg("-smbios").arg(format!(
                "type=11,value=io.systemd.credential:{}={}",
                qemu_value(name),
                qemu_value(value)
            ));
            cmd.arg("-fw_cfg").arg(format!(
                "name=opt/io.systemd.credentials/{},string={}",
                qemu_value(name),
                qemu_value(value)
            ));
        }
        if let Some(config) = &self.node_config {
            cmd.arg("-fw_cfg").arg(format!(
                "name=opt/keel/node-config,file={}",
                config.display()
            ));
        }
        let console = Console::spawn(
            cmd,
            &work.join("console.raw"),
            &work.join("serial.log"),
            &work.join("qemu.log"),
        )?;
        Ok(Vm {
            console,
            swtpm,
            accel,
            state_disk: state,
        })
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> VmError {
    let path = path.to_owned();
    move |source| VmError::Io { path, source }
}

/// A running VM. Dropping it kills QEMU and swtpm.
pub struct Vm {
    // Field order is drop order: QEMU goes before its TPM.
    console: Console,
    swtpm: Option<Swtpm>,
    accel: Accel,
    state_disk: PathBuf,
}

/// The processes of a VM left running by [`Vm::detach`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmPids {
    /// QEMU.
    pub qemu: u32,
    /// swtpm, unless the VM has no TPM.
    pub swtpm: Option<u32>,
}

impl Vm {
    /// Waits until a console line contains `needle`, for at most `patience`;
    /// returns when that line arrived, measured from QEMU's start. Lines
    /// already received count.
    pub fn wait_for_line(&self, needle: &str, patience: Duration) -> Result<Duration, VmError> {
        self.console.wait_for(needle, patience)
    }

    /// Waits until a console line contains one of `needles`, for at most
    /// `patience`; returns which one (its index) and when its line arrived.
    /// For an outcome that can go either way ("joined" or "failed").
    pub fn wait_for_any(
        &self,
        needles: &[&str],
        patience: Duration,
    ) -> Result<(usize, Duration), VmError> {
        self.console.wait_for_any(needles, patience)
    }

    /// Waits until a console line satisfies `matches` (called once per
    /// line, in order), for at most `patience`; returns the line and when
    /// it arrived. `awaited` says what the line shows, for the error.
    pub fn wait_for_line_where(
        &self,
        mut matches: impl FnMut(&str) -> bool,
        awaited: &str,
        patience: Duration,
    ) -> Result<(String, Duration), VmError> {
        self.console.wait_for_match(
            |line| matches(line).then(|| line.to_owned()),
            awaited,
            patience,
        )
    }

    /// Every console line so far.
    pub fn lines(&self) -> Vec<String> {
        self.console.lines()
    }

    /// Time since QEMU started (the clock of [`Vm::wait_for_line`]).
    pub fn uptime(&self) -> Duration {
        self.console.start.elapsed()
    }

    /// Sets the CPU priority of every QEMU thread (see
    /// [`VmBuilder::niceness`]). Raising it (a lower value) needs root.
    pub fn renice(&self, niceness: i32) -> Result<(), VmError> {
        let tasks = PathBuf::from(format!("/proc/{}/task", self.console.child.id()));
        let tids: Vec<String> = fs::read_dir(&tasks)
            .map_err(io(&tasks))?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        let status = Command::new("renice")
            .args(["-n", &niceness.to_string(), "-p"])
            .args(&tids)
            .stdout(Stdio::null())
            .status()
            .map_err(io(Path::new("renice")))?;
        if status.success() {
            Ok(())
        } else {
            Err(VmError::Renice(status))
        }
    }

    /// QEMU's and swtpm's process IDs.
    pub fn pids(&self) -> VmPids {
        VmPids {
            qemu: self.console.child.id(),
            swtpm: self.swtpm.as_ref().map(|s| s.child.id()),
        }
    }

    /// The state disk image.
    pub fn state_disk(&self) -> &Path {
        &self.state_disk
    }

    /// QEMU's raw console output. Unlike the serial log it keeps growing
    /// after [`Vm::detach`].
    pub fn console_file(&self) -> &Path {
        &self.console.raw
    }

    /// Stops watching the console and returns without stopping QEMU or
    /// swtpm: they run on, also after this process exits, until killed by
    /// their IDs (QEMU's console goes to a file, not a pipe).
    pub fn detach(self) -> VmPids {
        let pids = self.pids();
        let Self {
            mut console,
            mut swtpm,
            ..
        } = self;
        console.detach();
        if let Some(swtpm) = &mut swtpm {
            swtpm.detached = true;
        }
        pids
    }

    /// The serial log: one line per console line, prefixed with its arrival
    /// time in seconds since QEMU's start.
    pub fn serial_log(&self) -> &Path {
        &self.console.serial_log
    }

    /// The accelerator in use.
    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// swtpm's working directory (state, socket, log), unless the VM has
    /// no TPM.
    pub fn tpm_dir(&self) -> Option<&Path> {
        self.swtpm.as_ref().map(|s| s.dir.as_path())
    }
}

/// A QEMU process whose standard output (the serial console) goes to a
/// file, which a thread reads line by line as it grows.
struct Console {
    child: Child,
    start: Instant,
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
    raw: PathBuf,
    serial_log: PathBuf,
    qemu_log: PathBuf,
    detached: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<Lines>,
    changed: Condvar,
    /// Set to make the reader stop (detach or stop).
    quit: AtomicBool,
}

#[derive(Default)]
struct Lines {
    /// Each line with its arrival time since the process started.
    lines: Vec<(Duration, String)>,
    closed: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Lines> {
        // A poisoned lock only means the reader panicked mid-push: the
        // lines are still valid.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Console {
    fn spawn(
        mut cmd: Command,
        raw: &Path,
        serial_log: &Path,
        qemu_log: &Path,
    ) -> Result<Self, VmError> {
        let log = File::create(serial_log).map_err(io(serial_log))?;
        let out = File::create(raw).map_err(io(raw))?;
        let tail = File::open(raw).map_err(io(raw))?;
        let stderr = File::create(qemu_log).map_err(io(qemu_log))?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(stderr);
        let start = Instant::now();
        let child = cmd.spawn().map_err(|source| VmError::Spawn {
            program: "qemu-system-x86_64",
            source,
        })?;
        let shared = Arc::new(Shared::default());
        let pid = child.id();
        let reader = {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || read_console(tail, log, start, pid, &shared))
        };
        Ok(Self {
            child,
            start,
            shared,
            reader: Some(reader),
            raw: raw.to_owned(),
            serial_log: serial_log.to_owned(),
            qemu_log: qemu_log.to_owned(),
            detached: false,
        })
    }

    fn wait_for(&self, needle: &str, patience: Duration) -> Result<Duration, VmError> {
        self.wait_for_any(&[needle], patience).map(|(_, at)| at)
    }

    fn wait_for_any(
        &self,
        needles: &[&str],
        patience: Duration,
    ) -> Result<(usize, Duration), VmError> {
        self.wait_for_match(
            |line| needles.iter().position(|n| line.contains(n)),
            &needles.join("\" or \""),
            patience,
        )
    }

    /// Waits until `matches` returns `Some` for a console line; `awaited`
    /// names what was awaited in the error.
    fn wait_for_match<T>(
        &self,
        mut matches: impl FnMut(&str) -> Option<T>,
        awaited: &str,
        patience: Duration,
    ) -> Result<(T, Duration), VmError> {
        let deadline = Instant::now() + patience;
        let mut seen = 0;
        let mut state = self.shared.lock();
        loop {
            for (at, line) in state.lines.get(seen..).unwrap_or_default() {
                if let Some(found) = matches(line) {
                    return Ok((found, *at));
                }
            }
            seen = state.lines.len();
            if state.closed {
                return Err(VmError::Exited {
                    needle: awaited.to_owned(),
                    serial: self.serial_log.clone(),
                    qemu: self.qemu_log.clone(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(VmError::Timeout {
                    needle: awaited.to_owned(),
                    patience,
                    serial: self.serial_log.clone(),
                });
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    fn lines(&self) -> Vec<String> {
        self.shared
            .lock()
            .lines
            .iter()
            .map(|(_, l)| l.clone())
            .collect()
    }

    fn join_reader(&mut self) {
        self.shared.quit.store(true, Ordering::Relaxed);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }

    fn stop(&mut self) {
        // Errors mean the process is already gone.
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.join_reader();
    }

    fn detach(&mut self) {
        self.detached = true;
        self.join_reader();
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        if !self.detached {
            self.stop();
        }
    }
}

/// How often the console file is polled once its end is reached.
const CONSOLE_POLL: Duration = Duration::from_millis(50);

/// Whether process `pid` has exited (gone, or a zombie not yet waited for).
fn exited(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

/// Reads the console file as QEMU writes it, until QEMU exited and the file
/// is read to its end, or until asked to quit: splits it into lines
/// (carriage returns dropped, at most [`MAX_LINE_BYTES`] each) and records
/// each with its arrival time, in the log file and the shared list.
fn read_console(mut raw: File, mut log: File, start: Instant, pid: u32, shared: &Shared) {
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut emit = |bytes: &[u8]| {
        let at = start.elapsed();
        let text = String::from_utf8_lossy(bytes);
        let line = text.trim_end_matches(['\n', '\r']).replace('\r', "");
        // The log is for people; a failed write must not stop the capture.
        let _ = writeln!(log, "{:8.3} {line}", at.as_secs_f64());
        let mut state = shared.lock();
        state.lines.push((at, line));
        shared.changed.notify_all();
    };
    let mut finishing = false;
    loop {
        match raw.read(&mut buf) {
            Ok(0) | Err(_) => {
                if finishing || shared.quit.load(Ordering::Relaxed) {
                    break;
                }
                // Read once more after seeing the exit: QEMU may have
                // written its last lines just before.
                if exited(pid) {
                    finishing = true;
                } else {
                    std::thread::sleep(CONSOLE_POLL);
                }
            }
            Ok(n) => {
                pending.extend_from_slice(buf.get(..n).unwrap_or_default());
                while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    emit(line.get(..MAX_LINE_BYTES).unwrap_or(&line));
                }
                if pending.len() >= MAX_LINE_BYTES {
                    let line = std::mem::take(&mut pending);
                    emit(line.get(..MAX_LINE_BYTES).unwrap_or(&line));
                }
            }
        }
    }
    if !pending.is_empty() && !shared.quit.load(Ordering::Relaxed) {
        emit(&pending);
    }
    shared.lock().closed = true;
    shared.changed.notify_all();
}

/// A provisioned swtpm serving one VM over a Unix socket.
struct Swtpm {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
    detached: bool,
}

impl Swtpm {
    /// Manufactures a TPM like a cloud vTPM (SHA-256 PCR bank, endorsement
    /// key persisted at 0x81010001) in `work/tpm/state` and starts it.
    fn start_fresh(work: &Path) -> Result<Self, VmError> {
        let dir = work.join("tpm");
        let state = dir.join("state");
        fs::create_dir_all(&state).map_err(io(&state))?;
        let setup_log = dir.join("swtpm_setup.log");
        let mut cmd = Command::new("swtpm_setup");
        cmd.args([
            "--tpm2",
            "--createek",
            "--pcr-banks",
            "sha256",
            "--overwrite",
        ])
        .arg("--tpmstate")
        .arg(&state)
        .arg("--logfile")
        .arg(&setup_log)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        run_setup("swtpm_setup", &mut cmd, setup_log)?;
        Self::start(&state, &dir)
    }

    /// Starts swtpm on the manufactured TPM state in `state`, with its
    /// socket and log in `dir`.
    fn start(state: &Path, dir: &Path) -> Result<Self, VmError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let socket = dir.join("swtpm.sock");
        let log = dir.join("swtpm.log");
        // A socket left by an earlier run would look ready at once.
        let _ = fs::remove_file(&socket);
        let child = Command::new("swtpm")
            .args(["socket", "--tpm2", "--terminate"])
            .arg("--tpmstate")
            .arg(format!("dir={}", state.display()))
            .arg("--ctrl")
            .arg(format!("type=unixio,path={}", socket.display()))
            .arg("--log")
            .arg(format!("file={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| VmError::Spawn {
                program: "swtpm",
                source,
            })?;
        let swtpm = Self {
            child,
            dir: dir.to_owned(),
            socket,
            detached: false,
        };
        let deadline = Instant::now() + SWTPM_PATIENCE;
        while !swtpm.socket.exists() {
            if Instant::now() >= deadline {
                return Err(VmError::SwtpmSocket {
                    socket: swtpm.socket.clone(),
                    log,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(swtpm)
    }
}

impl Drop for Swtpm {
    fn drop(&mut self) {
        if !self.detached {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        cmd
    }

    #[test]
    fn console_captures_lines_with_times_and_finds_them() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let console = Console::spawn(
            shell("printf 'BdsDxe: loading\\r\\n'; sleep 0.3; echo 'keel-agent: ready'; exec sleep 30"),
            &dir.path().join("console.raw"),
            &dir.path().join("serial.log"),
            &dir.path().join("qemu.log"),
        )?;
        let at = console.wait_for("keel-agent: ready", Duration::from_secs(10))?;
        assert!(at >= Duration::from_millis(300), "{at:?}");
        assert_eq!(console.lines(), ["BdsDxe: loading", "keel-agent: ready"]);
        // An earlier line is found again, at its own time.
        assert!(console.wait_for("BdsDxe", Duration::ZERO)? < at);
        let log = fs::read_to_string(dir.path().join("serial.log"))?;
        assert!(
            log.lines()
                .nth(1)
                .is_some_and(|l| l.ends_with(" keel-agent: ready")),
            "{log}"
        );
        Ok(())
    }

    /// The store a boot with host variables starts from holds them, as
    /// asked for (the read-back check passes on the real tool's output).
    #[test]
    fn host_variables_are_in_the_store_made_with_them() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let data: Vec<u8> = "quiet".encode_utf16().flat_map(u16::to_le_bytes).collect();
        let builder = VmBuilder::new(dir.path().join("disk.raw"), dir.path()).host_efi_variable(
            "SystemdOptions",
            "8CF2644B-4B0B-428F-9387-6D876050DC67",
            &data,
        );
        let vars = dir.path().join("vars.fd");
        builder.make_vars(&vars)?;
        let dump = fs::read_to_string(dir.path().join("efi-variables-readback.json"))?;
        assert!(dump.contains("SystemdOptions"), "{dump}");
        Ok(())
    }

    #[test]
    fn waiting_is_bounded() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let console = Console::spawn(
            shell("echo booting; exec sleep 30"),
            &dir.path().join("console.raw"),
            &dir.path().join("serial.log"),
            &dir.path().join("qemu.log"),
        )?;
        let started = Instant::now();
        let err = console.wait_for("ready", Duration::from_millis(300)).err();
        assert!(matches!(err, Some(VmError::Timeout { .. })), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        Ok(())
    }

    #[test]
    fn an_exit_before_the_line_is_reported_at_once() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let console = Console::spawn(
            shell("echo 'keel-initrd: cannot open the verity root'"),
            &dir.path().join("console.raw"),
            &dir.path().join("serial.log"),
            &dir.path().join("qemu.log"),
        )?;
        let started = Instant::now();
        let err = console.wait_for("ready", Duration::from_secs(60)).err();
        assert!(matches!(err, Some(VmError::Exited { .. })), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        Ok(())
    }

    #[test]
    fn dropping_the_console_kills_the_process() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let console = Console::spawn(
            shell("echo up; exec sleep 600"),
            &dir.path().join("console.raw"),
            &dir.path().join("serial.log"),
            &dir.path().join("qemu.log"),
        )?;
        console.wait_for("up", Duration::from_secs(10))?;
        let pid = console.child.id();
        drop(console);
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} survived"
        );
        Ok(())
    }

    #[test]
    fn long_lines_are_cut_not_buffered_whole() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let console = Console::spawn(
            shell("head -c 100000 /dev/zero | tr '\\0' x; echo; echo end"),
            &dir.path().join("console.raw"),
            &dir.path().join("serial.log"),
            &dir.path().join("qemu.log"),
        )?;
        console.wait_for("end", Duration::from_secs(10))?;
        let lines = console.lines();
        assert!(
            lines.iter().all(|l| l.len() <= MAX_LINE_BYTES),
            "a line exceeds the bound"
        );
        Ok(())
    }
}
