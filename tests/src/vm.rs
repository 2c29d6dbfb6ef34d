//! One keel VM: QEMU (q35) booting a disk image through OVMF, a fresh swtpm
//! as its TPM, and its serial console captured line by line, with the time
//! each line arrived, into a log file. Dropping the [`Vm`] kills QEMU and
//! swtpm.
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
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Environment variable forcing the accelerator: `kvm` or `tcg`.
pub const ACCEL_VAR: &str = "KEEL_VM_ACCEL";
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
    /// QEMU's emulator (`-accel tcg -cpu max`).
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

    fn args(self) -> [&'static str; 4] {
        match self {
            Self::Kvm => ["-accel", "kvm", "-cpu", "host"],
            Self::Tcg => ["-accel", "tcg", "-cpu", "max"],
        }
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
    let booted = match Console::spawn(cmd, &dir.join("serial.log"), &dir.join("qemu.log")) {
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
        }
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

    /// Provisions a TPM, starts swtpm and QEMU. The VM's clock (see
    /// [`Vm::wait_for_line`]) starts when QEMU is spawned.
    pub fn start(self) -> Result<Vm, VmError> {
        let work = &self.work_dir;
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| VmError::Io { path, source }
        };
        fs::create_dir_all(work).map_err(io(work))?;
        let accel = self.accel.unwrap_or_else(|| Accel::detect(&self.firmware));
        let swtpm = Swtpm::start(work)?;

        let vars = work.join("vars.fd");
        fs::copy(&self.firmware.vars, &vars).map_err(io(&vars))?;
        let state = work.join("state.raw");
        File::create(&state)
            .and_then(|f| f.set_len(STATE_DISK_BYTES))
            .map_err(io(&state))?;

        let mut cmd = Command::new("qemu-system-x86_64");
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
            .arg(pflash(&vars, "snapshot=off"))
            .arg("-chardev")
            .arg(format!("socket,id=chrtpm,path={}", swtpm.socket.display()))
            .args(["-tpmdev", "emulator,id=tpm0,chardev=chrtpm"])
            .args(["-device", "tpm-tis,tpmdev=tpm0"])
            .arg("-drive")
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
        if let Some(config) = &self.node_config {
            cmd.arg("-fw_cfg").arg(format!(
                "name=opt/keel/node-config,file={}",
                config.display()
            ));
        }
        let console = Console::spawn(cmd, &work.join("serial.log"), &work.join("qemu.log"))?;
        Ok(Vm {
            console,
            swtpm,
            accel,
        })
    }
}

/// A running VM. Dropping it kills QEMU and swtpm.
pub struct Vm {
    // Field order is drop order: QEMU goes before its TPM.
    console: Console,
    swtpm: Swtpm,
    accel: Accel,
}

impl Vm {
    /// Waits until a console line contains `needle`, for at most `patience`;
    /// returns when that line arrived, measured from QEMU's start. Lines
    /// already received count.
    pub fn wait_for_line(&self, needle: &str, patience: Duration) -> Result<Duration, VmError> {
        self.console.wait_for(needle, patience)
    }

    /// Every console line so far.
    pub fn lines(&self) -> Vec<String> {
        self.console.lines()
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

    /// swtpm's working directory (state, socket, log).
    pub fn tpm_dir(&self) -> &Path {
        &self.swtpm.dir
    }
}

/// A QEMU process whose standard output (the serial console) is read line
/// by line on a thread.
struct Console {
    child: Child,
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
    serial_log: PathBuf,
    qemu_log: PathBuf,
}

#[derive(Default)]
struct Shared {
    state: Mutex<Lines>,
    changed: Condvar,
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
    fn spawn(mut cmd: Command, serial_log: &Path, qemu_log: &Path) -> Result<Self, VmError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| VmError::Io { path, source }
        };
        let log = File::create(serial_log).map_err(io(serial_log))?;
        let stderr = File::create(qemu_log).map_err(io(qemu_log))?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let start = Instant::now();
        let mut child = cmd.spawn().map_err(|source| VmError::Spawn {
            program: "qemu-system-x86_64",
            source,
        })?;
        let shared = Arc::new(Shared::default());
        let reader = child.stdout.take().map(|out| {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || read_console(out, log, start, &shared))
        });
        Ok(Self {
            child,
            shared,
            reader,
            serial_log: serial_log.to_owned(),
            qemu_log: qemu_log.to_owned(),
        })
    }

    fn wait_for(&self, needle: &str, patience: Duration) -> Result<Duration, VmError> {
        let deadline = Instant::now() + patience;
        let mut seen = 0;
        let mut state = self.shared.lock();
        loop {
            if let Some((at, _)) = state.lines[seen..].iter().find(|(_, l)| l.contains(needle)) {
                return Ok(*at);
            }
            seen = state.lines.len();
            if state.closed {
                return Err(VmError::Exited {
                    needle: needle.into(),
                    serial: self.serial_log.clone(),
                    qemu: self.qemu_log.clone(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(VmError::Timeout {
                    needle: needle.into(),
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

    fn stop(&mut self) {
        // Errors mean the process is already gone.
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Reads the console until QEMU closes it: splits it into lines (carriage
/// returns dropped, at most [`MAX_LINE_BYTES`] each) and records each with
/// its arrival time, in the log file and the shared list.
fn read_console(out: impl Read, mut log: File, start: Instant, shared: &Shared) {
    let mut reader = BufReader::new(out);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match (&mut reader)
            .take(MAX_LINE_BYTES as u64)
            .read_until(b'\n', &mut buf)
        {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let at = start.elapsed();
        let text = String::from_utf8_lossy(&buf);
        let line = text.trim_end_matches(['\n', '\r']).replace('\r', "");
        // The log is for people; a failed write must not stop the capture.
        let _ = writeln!(log, "{:8.3} {line}", at.as_secs_f64());
        let mut state = shared.lock();
        state.lines.push((at, line));
        shared.changed.notify_all();
    }
    shared.lock().closed = true;
    shared.changed.notify_all();
}

/// A provisioned swtpm serving one VM over a Unix socket.
struct Swtpm {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
}

impl Swtpm {
    /// Manufactures a TPM like a cloud vTPM (SHA-256 PCR bank, endorsement
    /// key persisted at 0x81010001) and starts it.
    fn start(work: &Path) -> Result<Self, VmError> {
        let dir = work.join("tpm");
        let state = dir.join("state");
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| VmError::Io { path, source }
        };
        fs::create_dir_all(&state).map_err(io(&state))?;
        let setup_log = dir.join("swtpm_setup.log");
        let status = Command::new("swtpm_setup")
            .args([
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
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|source| VmError::Spawn {
                program: "swtpm_setup",
                source,
            })?;
        if !status.success() {
            return Err(VmError::Setup {
                program: "swtpm_setup",
                status,
                log: setup_log,
            });
        }
        let socket = dir.join("swtpm.sock");
        let log = dir.join("swtpm.log");
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
        let swtpm = Self { child, dir, socket };
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
        let _ = self.child.kill();
        let _ = self.child.wait();
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

    #[test]
    fn waiting_is_bounded() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let console = Console::spawn(
            shell("echo booting; exec sleep 30"),
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
