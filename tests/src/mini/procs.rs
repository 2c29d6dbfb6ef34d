//! The processes of a local cluster: a guard that stops a host process
//! when dropped, and the record of a kept cluster (`build/mini/state.json`)
//! that lets another process report on it or stop it, by process ID only.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::{io, MiniError};

/// The record of a kept cluster, in the cluster directory.
pub const STATE_FILE: &str = "state.json";
/// How long stopped processes get to exit before they are killed.
const STOP_PATIENCE: Duration = Duration::from_secs(5);

/// A host process of the cluster (the component mirror), stopped when
/// dropped unless detached.
#[derive(Debug)]
pub struct Process {
    child: Child,
    detached: bool,
}

impl Process {
    /// Guards `child`.
    pub fn new(child: Child) -> Self {
        Self {
            child,
            detached: false,
        }
    }

    /// The process ID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Leaves the process running.
    pub fn detach(mut self) {
        self.detached = true;
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if !self.detached {
            // Errors mean the process is already gone.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One process of a kept cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptProcess {
    /// What it is (`cp qemu`, `worker swtpm`, `mirror`).
    pub name: String,
    /// The program's file name, checked before signalling the ID (a
    /// reused ID is left alone).
    pub program: String,
    /// The process ID.
    pub pid: u32,
}

/// A node of a kept cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptNode {
    /// Its directory under the cluster directory (`cp`, `worker`).
    pub dir: String,
    /// Kubernetes node name.
    pub name: String,
    /// Role.
    pub role: String,
    /// Host port forwarded to its init server.
    pub init_port: u16,
    /// The `keel verify` settings for it.
    pub verify_settings: String,
}

/// What `keel-mini up --keep` leaves running.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptCluster {
    /// The accelerator the VMs run with.
    pub accel: String,
    /// The cluster ID (hex).
    pub cluster_id: String,
    /// Host ports forwarded to the control planes' join services.
    pub join_ports: Vec<u16>,
    /// The nodes.
    pub nodes: Vec<KeptNode>,
    /// Every process left running.
    pub processes: Vec<KeptProcess>,
}

impl KeptCluster {
    /// Writes the record into `dir`.
    pub fn save(&self, dir: &Path) -> Result<PathBuf, MiniError> {
        let path = dir.join(STATE_FILE);
        let json = serde_json::to_vec_pretty(self).map_err(|source| MiniError::Json {
            path: path.clone(),
            source,
        })?;
        std::fs::write(&path, json).map_err(io(&path))?;
        Ok(path)
    }

    /// Reads the record from `dir`; `None` when there is none.
    pub fn load(dir: &Path) -> Result<Option<Self>, MiniError> {
        let path = dir.join(STATE_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| MiniError::Json { path, source })
    }
}

/// Whether `pid` is a running process started from `program`.
pub fn running(pid: u32, program: &str) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let zombie = stat
        .rsplit_once(") ")
        .is_some_and(|(_, rest)| rest.starts_with(['Z', 'X']));
    if zombie {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
    let argv0 = String::from_utf8_lossy(argv0);
    Path::new(argv0.as_ref())
        .file_name()
        .is_some_and(|name| name == program)
}

/// Stops `processes` by ID (SIGTERM, then SIGKILL after a grace period),
/// each only while it still runs the recorded program. Returns how many
/// were running.
pub fn stop(processes: &[KeptProcess]) -> usize {
    let live: Vec<&KeptProcess> = processes
        .iter()
        .filter(|p| running(p.pid, &p.program))
        .collect();
    let signal = |p: &KeptProcess, s: Signal| {
        if let Ok(pid) = i32::try_from(p.pid) {
            // Gone meanwhile: nothing to do.
            let _ = kill(Pid::from_raw(pid), s);
        }
    };
    for p in &live {
        signal(p, Signal::SIGTERM);
    }
    let deadline = Instant::now() + STOP_PATIENCE;
    while Instant::now() < deadline && live.iter().any(|p| running(p.pid, &p.program)) {
        std::thread::sleep(Duration::from_millis(100));
    }
    for p in live.iter().filter(|p| running(p.pid, &p.program)) {
        signal(p, Signal::SIGKILL);
    }
    live.len()
}

/// Processes an earlier run left in `dir` without a record (it was killed,
/// or aborted on a panic, before it stopped them): every process but this
/// one with an argument naming a path in `dir`, as the VMs' disks and TPM
/// state and the mirror's files do.
pub fn strays(dir: &Path) -> Vec<KeptProcess> {
    let inside = format!("{}/", dir.display());
    let own = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| {
            let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            if pid == own {
                return None;
            }
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let mut args = cmdline.split(|b| *b == 0);
            let argv0 = String::from_utf8_lossy(args.next()?).into_owned();
            let program = Path::new(&argv0)
                .file_name()?
                .to_string_lossy()
                .into_owned();
            // A path starts an argument or one of its `key=value,...`
            // parts (QEMU's and swtpm's options), so another directory
            // whose path merely contains this one's is not taken for it.
            args.any(|arg| {
                String::from_utf8_lossy(arg)
                    .split(['=', ','])
                    .any(|part| part.starts_with(&inside))
            })
            .then(|| KeptProcess {
                name: format!("left by an earlier run: {program}"),
                program,
                pid,
            })
        })
        .collect()
}

/// `keel-mini down`: stops what a kept cluster in `dir` left running and
/// removes its record. Returns how many processes were running.
pub fn down(dir: &Path) -> Result<usize, MiniError> {
    let Some(kept) = KeptCluster::load(dir)? else {
        return Err(MiniError::NotRunning(dir.join(STATE_FILE)));
    };
    let stopped = stop(&kept.processes);
    let path = dir.join(STATE_FILE);
    std::fs::remove_file(&path).map_err(io(&path))?;
    Ok(stopped)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A process of an earlier run (its argument a path in the cluster
    /// directory) is found and stopped; one naming a path elsewhere, in a
    /// directory whose name merely starts the same or whose path contains
    /// this one's, is left alone.
    #[test]
    fn a_process_an_earlier_run_left_in_the_directory_is_found_and_stopped() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("x/mini");
        let beside = root.path().join("x/mini-other");
        let containing = root.path().join("y").join(dir.strip_prefix("/").unwrap());
        for d in [&dir, &beside, &containing] {
            std::fs::create_dir_all(d).unwrap();
        }
        // Guarded: a failing assertion leaves no process holding the
        // test's output open.
        let follow = |path: &Path| {
            std::fs::write(path, b"").unwrap();
            Process::new(
                std::process::Command::new("tail")
                    .arg("-f")
                    .arg(path)
                    .spawn()
                    .unwrap(),
            )
        };
        let mut stray = follow(&dir.join("disk.raw"));
        let others = [
            follow(&beside.join("disk.raw")),
            follow(&containing.join("disk.raw")),
        ];
        // Until tail has exec'd, its command line is this test's.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut found = strays(&dir);
        while found.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            found = strays(&dir);
        }
        let pids: Vec<u32> = found.iter().map(|p| p.pid).collect();
        assert_eq!(pids, [stray.pid()]);
        assert_eq!(found[0].program, "tail");
        assert_eq!(stop(&found), 1);
        // Its command line goes as it exits, a moment before it is a
        // zombie: wait a little for the exit itself.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !stray.exited() {
            assert!(Instant::now() < deadline, "the stray was not stopped");
            std::thread::sleep(Duration::from_millis(20));
        }
        for mut alive in others {
            assert!(!alive.exited());
        }
    }
}
