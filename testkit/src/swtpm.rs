//! swtpm instances for tests: each with its own TPM state, manufactured with
//! an EK certificate from a test-owned CA, on its own loopback ports, stopped
//! through the control channel on drop (killed if that fails).
//!
//! Stopping through the control channel ends the process with its state
//! saved, but it is not a TPM2_Shutdown: to the TPM the next start follows
//! an unorderly shutdown unless a client sent TPM2_Shutdown first.
//! [`Swtpm::kill_hard`] and [`Swtpm::restart`] model a VM that is killed
//! and booted again on the same TPM state.

use std::fs;
use std::io;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// Errors starting swtpm.
#[derive(Debug, thiserror::Error)]
pub enum SwtpmError {
    /// A file or process operation failed.
    #[error("{what}")]
    Io {
        /// What was attempted.
        what: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// swtpm_setup failed.
    #[error("swtpm_setup failed: {0}")]
    Setup(String),
    /// swtpm did not come up on any tried port pair.
    #[error("swtpm did not start: {0}")]
    Start(String),
    /// A tpm2-tools command against the TPM failed.
    #[error("{0}")]
    Tool(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> SwtpmError {
    let what = what.into();
    move |source| SwtpmError::Io { what, source }
}

/// A local CA that issues EK certificates (swtpm_localca), in its own directory.
pub struct EkCa {
    dir: CaDir,
}

/// Where a CA lives: a temporary directory removed with it, or a kept one.
enum CaDir {
    Temp(TempDir),
    Kept(PathBuf),
}

impl CaDir {
    fn path(&self) -> &Path {
        match self {
            Self::Temp(dir) => dir.path(),
            Self::Kept(dir) => dir,
        }
    }
}

impl EkCa {
    /// A new, empty CA in a temporary directory; its keys are created when
    /// the first TPM is manufactured.
    pub fn new() -> Result<Self, SwtpmError> {
        let dir = tempfile::tempdir().map_err(io_err("creating CA directory"))?;
        Self::create(CaDir::Temp(dir))
    }

    /// A new, empty CA in `dir` (created; absolute, since swtpm_localca
    /// reads the paths from its config), kept after the [`EkCa`] is dropped,
    /// e.g. for a local cluster whose TPMs outlive the process.
    pub fn in_dir(dir: &Path) -> Result<Self, SwtpmError> {
        fs::create_dir_all(dir).map_err(io_err("creating CA directory"))?;
        let dir = dir
            .canonicalize()
            .map_err(io_err("resolving CA directory"))?;
        Self::create(CaDir::Kept(dir))
    }

    /// The CA's directory (configs, and under `ca/` its keys and certificates).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn create(dir: CaDir) -> Result<Self, SwtpmError> {
        let root = dir.path();
        let ca = root.join("ca");
        fs::create_dir_all(&ca).map_err(io_err("creating CA directory"))?;
        let p = |name: &str| ca.join(name).display().to_string();
        fs::write(
            root.join("localca.conf"),
            format!(
                "statedir = {}\nsigningkey = {}\nissuercert = {}\ncertserial = {}\n",
                ca.display(),
                p("signkey.pem"),
                p("issuercert.pem"),
                p("certserial")
            ),
        )
        .map_err(io_err("writing CA config"))?;
        fs::write(
            root.join("setup.conf"),
            format!(
                "create_certs_tool = /usr/bin/swtpm_localca\n\
                 create_certs_tool_config = {}\n\
                 create_certs_tool_options = /etc/swtpm-localca.options\n\
                 active_pcr_banks = sha256\n",
                root.join("localca.conf").display()
            ),
        )
        .map_err(io_err("writing swtpm_setup config"))?;
        Ok(Self { dir })
    }

    /// PEM of the certificate that signs EK certificates (valid after the
    /// first [`Swtpm::start`] with this CA).
    pub fn issuer_pem(&self) -> Result<Vec<u8>, SwtpmError> {
        fs::read(self.dir().join("ca/issuercert.pem")).map_err(io_err("reading CA issuer cert"))
    }

    /// PEM of the CA's root certificate.
    pub fn root_pem(&self) -> Result<Vec<u8>, SwtpmError> {
        fs::read(self.dir().join("ca/swtpm-localca-rootca-cert.pem"))
            .map_err(io_err("reading CA root cert"))
    }

    /// Manufactures a TPM state in `state_dir` with EK certificates from this CA.
    pub fn manufacture(&self, state_dir: &Path) -> Result<(), SwtpmError> {
        let out = Command::new("swtpm_setup")
            .args([
                "--tpm2",
                "--create-ek-cert",
                "--create-platform-cert",
                "--lock-nvram",
                "--overwrite",
            ])
            .arg("--tpmstate")
            .arg(state_dir)
            .arg("--config")
            .arg(self.dir().join("setup.conf"))
            .output()
            .map_err(io_err("running swtpm_setup"))?;
        if !out.status.success() {
            return Err(SwtpmError::Setup(
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ));
        }
        Ok(())
    }
}

/// A running swtpm with a TCP server and control port on 127.0.0.1.
pub struct Swtpm {
    child: Option<Child>,
    port: u16,
    state: TempDir,
}

impl Swtpm {
    /// Manufactures a fresh TPM with an EK certificate from `ca` and starts it.
    pub fn start(ca: &EkCa) -> Result<Self, SwtpmError> {
        let state = tempfile::tempdir().map_err(io_err("creating TPM state directory"))?;
        ca.manufacture(state.path())?;
        Self::start_with_state(state)
    }

    /// Starts a fresh TPM without EK certificate (and no persistent EK).
    pub fn start_bare() -> Result<Self, SwtpmError> {
        let state = tempfile::tempdir().map_err(io_err("creating TPM state directory"))?;
        Self::start_with_state(state)
    }

    /// The swtpm process's ID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// Kills the swtpm process with SIGKILL: no TPM2_Shutdown, no control
    /// channel, as when the VM holding the TPM is killed. Only what the TPM
    /// had already written to its NV state survives.
    pub fn kill_hard(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the TPM again on its state (stopping it through the control
    /// channel first if it still runs): a new TPM cycle, PCRs reset, the
    /// same keys and NV. The ports may change; see [`Swtpm::tcti`].
    pub fn restart(&mut self) -> Result<(), SwtpmError> {
        self.stop();
        let (child, port) = spawn(self.state.path())?;
        self.child = Some(child);
        self.port = port;
        Ok(())
    }

    fn start_with_state(state: TempDir) -> Result<Self, SwtpmError> {
        let (child, port) = spawn(state.path())?;
        Ok(Self {
            child: Some(child),
            port,
            state,
        })
    }

    /// Stops the process through the control channel (it saves its state
    /// and exits); kills it if it has not exited within 2 s.
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("swtpm_ioctl")
                .arg("--tcp")
                .arg(format!("127.0.0.1:{}", self.port + 1))
                .arg("-s")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The TCP port of the TPM command channel.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The TCTI string for tss-esapi / tpm2-tools.
    pub fn tcti(&self) -> String {
        format!("swtpm:host=127.0.0.1,port={}", self.port)
    }

    /// Runs a tpm2-tools command (`args[0]` is the program) against this
    /// TPM; fails with its error output unless it succeeds.
    pub fn tool(&self, args: &[&str]) -> Result<(), SwtpmError> {
        let (program, rest) = args
            .split_first()
            .ok_or_else(|| SwtpmError::Tool("no program".into()))?;
        let out = Command::new(program)
            .args(rest)
            .env("TPM2TOOLS_TCTI", self.tcti())
            .output()
            .map_err(io_err(format!("running {program}")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(SwtpmError::Tool(format!(
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }

    /// Directory holding the TPM state.
    pub fn state_dir(&self) -> PathBuf {
        self.state.path().to_path_buf()
    }
}

impl Drop for Swtpm {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts swtpm on the state in `state` on a free port pair; returns the
/// process and its command port once both ports accept connections.
fn spawn(state: &Path) -> Result<(Child, u16), SwtpmError> {
    let mut last = String::new();
    for _ in 0..20 {
        let port = crate::free_ports(2).map_err(io_err("choosing swtpm's ports"))?;
        let mut child = Command::new("swtpm")
            .args(["socket", "--tpm2", "--flags", "not-need-init,startup-clear"])
            .arg("--server")
            .arg(format!("type=tcp,port={port},bindaddr=127.0.0.1"))
            .arg("--ctrl")
            .arg(format!("type=tcp,port={},bindaddr=127.0.0.1", port + 1))
            .arg("--tpmstate")
            .arg(format!("dir={}", state.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io_err("starting swtpm"))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                last = format!("swtpm exited with {status} on port {port}");
                break;
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok()
                && TcpStream::connect(("127.0.0.1", port + 1)).is_ok()
            {
                return Ok((child, port));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                last = format!("swtpm did not listen on port {port} within 5 s");
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Err(SwtpmError::Start(last))
}
