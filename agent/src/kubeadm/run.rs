//! Running the kubeadm program: `init` and `join`, output streamed line by
//! line, bounded in time, joins retried a bounded number of times.
//!
//! Command lines (flags allowed next to `--config` by kubeadm):
//! * `kubeadm init --config FILE --skip-token-print --skip-certificate-key-print
//!   [--skip-phases=...]`: the two `--skip-*-print` flags keep the bootstrap
//!   token and the certificate key out of kubeadm's output, which is streamed
//!   to the operator and the journal. Lines are also scrubbed of anything
//!   shaped like a bootstrap token, in case a kubeadm version prints one
//!   anyway.
//! * `kubeadm join --config FILE [--skip-phases=...]`. A failed join is
//!   followed by `kubeadm reset --force` (a half-done join leaves manifests
//!   and kubeconfigs that make the next attempt fail its preflight checks),
//!   then a pause that doubles after each attempt. The reset also empties
//!   the certificates directory and the kubelet's directory, which hold what
//!   the join ticket brought: the caller puts that back before each retry.
//! * `kubeadm upgrade apply VERSION --yes` on the first control plane of an
//!   upgrade, `kubeadm upgrade node` on every other node; neither retried
//!   (the agent switches the node back to its previous binaries instead).
//!
//! Nothing is skipped by default: preflight checks catch an image that lacks
//! what kubeadm needs (conntrack, a container runtime, free ports) with a
//! clear message.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use keel_installer::KubernetesVersion;
use tokio::io::{AsyncBufReadExt as _, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;
use zeroize::Zeroizing;

use super::config::ConfigError;
use crate::files::WriteFileError;
use crate::paths::ADMIN_CONF;

/// Longest output line passed on; longer lines are cut.
pub const MAX_LINE: usize = 4096;
/// Lines of output kept for an error message.
const TAIL_LINES: usize = 20;
/// Largest kubeconfig read back.
pub const MAX_KUBECONFIG: u64 = 1024 * 1024;
/// The system's directories in the `PATH` kubeadm runs with, after the
/// components' own (see [`Kubeadm::search_path`]).
pub const SYSTEM_PATH: [&str; 4] = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"];

/// A kubeadm run that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KubeadmError {
    /// kubeadm could not be started or waited for.
    #[error("running {program:?}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// kubeadm did not finish in time (it was killed).
    #[error("kubeadm {command} did not finish within {after:?}")]
    Timeout {
        /// `init`, `join`, `reset` or `token`.
        command: &'static str,
        /// The limit.
        after: Duration,
    },
    /// kubeadm exited unsuccessfully.
    #[error("kubeadm {command} failed ({status}): {}", summary(last_lines))]
    Failed {
        /// `init`, `join`, `reset` or `token`.
        command: &'static str,
        /// The exit status.
        status: ExitStatus,
        /// The last lines of its output.
        last_lines: Vec<String>,
    },
    /// Every join attempt failed.
    #[error("kubeadm join failed {attempts} times")]
    JoinAttempts {
        /// How many attempts were made.
        attempts: u32,
        /// The last attempt's error.
        #[source]
        last: Box<KubeadmError>,
    },
    /// The configuration for kubeadm cannot be made.
    #[error("kubeadm configuration")]
    Config(#[source] ConfigError),
    /// The configuration file could not be written.
    #[error("writing the kubeadm configuration")]
    WriteConfig(#[source] WriteFileError),
    /// What a reset removed could not be put back before the next join
    /// attempt.
    #[error("restoring the node's certificates after kubeadm reset")]
    Restore(#[source] WriteFileError),
    /// The admin kubeconfig could not be read after `init`.
    #[error("reading the admin kubeconfig {path:?}")]
    ReadKubeconfig {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// More tokens than one `kubeadm token create` registers.
    #[error("{0} bootstrap tokens for one kubeadm run; at most {max}", max = super::token::MAX_TOKENS_PER_RUN)]
    TooManyTokens(usize),
}

/// What becomes of kubeadm's standard output.
#[derive(Clone, Copy, Debug)]
pub(super) enum Stdout {
    /// Streamed line by line, like stderr.
    Stream,
    /// Never read (it carries a secret).
    Discard,
}

/// How kubeadm is run.
#[derive(Debug, Clone)]
pub struct Kubeadm {
    /// The kubeadm executable (installed as a component).
    pub program: PathBuf,
    /// The root that holds `etc/kubernetes` (`/` on a node).
    pub root: PathBuf,
    /// Limit for `kubeadm init`.
    pub init_timeout: Duration,
    /// Limit for each `kubeadm join` attempt (and each reset), and for a
    /// worker's `kubeadm upgrade node`.
    pub join_timeout: Duration,
    /// Limit for an upgrade of a control plane's static pods (`kubeadm
    /// upgrade apply`, and `upgrade node` on a control plane): above
    /// kubeadm's own waits, so that it rolls a component back itself.
    pub upgrade_timeout: Duration,
    /// Join attempts before giving up (at least 1).
    pub join_attempts: u32,
    /// Pause after the first failed join; doubled after each further one.
    pub join_backoff: Duration,
    /// Phases to skip (`--skip-phases`), empty by default.
    pub skip_phases: Vec<String>,
    /// Extra environment variables for kubeadm (`PATH` among them
    /// replaces [`Kubeadm::search_path`]).
    pub env: Vec<(String, String)>,
}

impl Kubeadm {
    /// `<bin_dir>/kubeadm` with the defaults: root `/`, init limit 10 min,
    /// a control plane's upgrade 25 min ([`CONTROL_PLANE_UPGRADE_LIMIT`]),
    /// 3 join attempts of at most 5 min each, 10 s initial backoff.
    pub fn new(bin_dir: &Path) -> Self {
        Self {
            program: bin_dir.join("kubeadm"),
            root: PathBuf::from("/"),
            init_timeout: Duration::from_secs(600),
            join_timeout: Duration::from_secs(300),
            upgrade_timeout: CONTROL_PLANE_UPGRADE_LIMIT,
            join_attempts: 3,
            join_backoff: Duration::from_secs(10),
            skip_phases: Vec::new(),
            env: Vec::new(),
        }
    }

    /// The arguments of `kubeadm init` (see the module docs).
    pub fn init_args(&self, config: &Path) -> Vec<String> {
        let mut args = vec![
            "init".to_owned(),
            "--config".to_owned(),
            config.to_string_lossy().into_owned(),
            "--skip-token-print".to_owned(),
            "--skip-certificate-key-print".to_owned(),
        ];
        args.extend(self.skip_phases_arg());
        args
    }

    /// The arguments of `kubeadm join` (see the module docs).
    pub fn join_args(&self, config: &Path) -> Vec<String> {
        let mut args = vec![
            "join".to_owned(),
            "--config".to_owned(),
            config.to_string_lossy().into_owned(),
        ];
        args.extend(self.skip_phases_arg());
        args
    }

    /// The `PATH` kubeadm runs with: the directory it is installed in,
    /// which holds the other components (kubelet, crictl), then
    /// [`SYSTEM_PATH`]. kubeadm finds the kubelet through `PATH` (its
    /// preflight runs `kubelet --version` and fails without it), and the
    /// service manager's default `PATH`, which the agent has, names no
    /// component directory.
    pub fn search_path(&self) -> std::ffi::OsString {
        let own = self
            .program
            .parent()
            .filter(|dir| !dir.as_os_str().is_empty());
        let dirs = own.into_iter().chain(SYSTEM_PATH.iter().map(Path::new));
        // A directory with a `:` in its name cannot be in a PATH: the
        // system's directories alone then.
        std::env::join_paths(dirs).unwrap_or_else(|_| SYSTEM_PATH.join(":").into())
    }

    fn skip_phases_arg(&self) -> Option<String> {
        (!self.skip_phases.is_empty())
            .then(|| format!("--skip-phases={}", self.skip_phases.join(",")))
    }

    /// Runs `kubeadm init` with the configuration file `config`, passing
    /// each output line to `on_line`, and returns the admin kubeconfig.
    pub async fn init(
        &self,
        config: &Path,
        on_line: &mut (dyn FnMut(&str) + Send),
    ) -> Result<Zeroizing<Vec<u8>>, KubeadmError> {
        self.run(
            "init",
            &self.init_args(config),
            self.init_timeout,
            Stdout::Stream,
            on_line,
        )
        .await?;
        let path = self.root.join(ADMIN_CONF);
        crate::files::read_secret_async(&path, MAX_KUBECONFIG)
            .await
            .map_err(|source| KubeadmError::ReadKubeconfig { path, source })
    }

    /// Runs `kubeadm join` with the configuration file `config`, up to
    /// [`Kubeadm::join_attempts`] times, with `kubeadm reset --force`,
    /// `restore` (which puts back the files the next attempt needs and the
    /// reset removed) and a pause between attempts. The last failed attempt
    /// is reset too: a control plane's reset takes its etcd member out of
    /// the cluster, which would otherwise keep a member that never comes
    /// back (the node starts over from a reboot) and count it against
    /// quorum.
    pub async fn join(
        &self,
        config: &Path,
        restore: &mut (dyn FnMut() -> Result<(), WriteFileError> + Send),
        on_line: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), KubeadmError> {
        let attempts = self.join_attempts.max(1);
        let mut pause = self.join_backoff;
        let mut attempt = 1;
        loop {
            let result = self
                .run(
                    "join",
                    &self.join_args(config),
                    self.join_timeout,
                    Stdout::Stream,
                    on_line,
                )
                .await;
            let err = match result {
                Ok(()) => return Ok(()),
                Err(err) => err,
            };
            tracing::warn!(attempt, error = %err, "kubeadm join failed; resetting");
            on_line(&format!(
                "keel: kubeadm join attempt {attempt} failed: {err}"
            ));
            let reset = ["reset".to_owned(), "--force".to_owned()];
            if let Err(err) = self
                .run("reset", &reset, self.join_timeout, Stdout::Stream, on_line)
                .await
            {
                tracing::warn!(error = %err, "kubeadm reset failed");
            }
            if attempt >= attempts {
                return Err(KubeadmError::JoinAttempts {
                    attempts,
                    last: Box::new(err),
                });
            }
            restore().map_err(KubeadmError::Restore)?;
            tokio::time::sleep(pause).await;
            pause = pause.saturating_mul(2);
            attempt += 1;
        }
    }

    /// Runs `kubeadm upgrade apply <version> --yes --patches <patches>`
    /// (the first control plane of an upgrade), within
    /// [`Self::upgrade_timeout`]. kubeadm keeps no patches between runs: without the
    /// directory it would write the static pods' manifests with its
    /// default, tag-only images, not the digests the patches pin (and
    /// PCR 13 measures).
    pub async fn upgrade_apply(
        &self,
        version: KubernetesVersion,
        patches: &Path,
        on_line: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), KubeadmError> {
        let args = [
            "upgrade".to_owned(),
            "apply".to_owned(),
            version.to_string(),
            "--yes".to_owned(),
            "--patches".to_owned(),
            patches.display().to_string(),
        ];
        self.upgrade(&args, self.upgrade_timeout, on_line).await
    }

    /// The limit of `kubeadm upgrade node` here: on a control plane (its
    /// API server's static pod manifest exists, which is how kubeadm
    /// tells) it upgrades the static pods as `upgrade apply` does,
    /// otherwise only the kubelet's configuration, limited like one join
    /// attempt.
    pub fn upgrade_node_limit(&self) -> Duration {
        if self.root.join(API_SERVER_MANIFEST).exists() {
            self.upgrade_timeout
        } else {
            self.join_timeout
        }
    }

    /// Runs `kubeadm upgrade node` (every other node of an upgrade),
    /// within [`Self::upgrade_node_limit`].
    pub async fn upgrade_node(
        &self,
        patches: &Path,
        on_line: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), KubeadmError> {
        let args = [
            "upgrade".to_owned(),
            "node".to_owned(),
            "--patches".to_owned(),
            patches.display().to_string(),
        ];
        self.upgrade(&args, self.upgrade_node_limit(), on_line)
            .await
    }

    /// Runs `kubeadm <args>` (an upgrade) with what earlier upgrades backed
    /// up cleared before and what this one backs up cleared after, however
    /// it ends ([`remove_upgrade_backups`]).
    async fn upgrade(
        &self,
        args: &[String],
        limit: Duration,
        on_line: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), KubeadmError> {
        self.clear_upgrade_backups().await;
        let ran = self
            .run("upgrade", args, limit, Stdout::Stream, on_line)
            .await;
        self.clear_upgrade_backups().await;
        ran
    }

    /// [`remove_upgrade_backups`] under this root, off the runtime (a copy
    /// of etcd's data takes a while to remove); a failure is logged, and
    /// tried again at the next upgrade.
    async fn clear_upgrade_backups(&self) {
        let root = self.root.clone();
        match tokio::task::spawn_blocking(move || remove_upgrade_backups(&root)).await {
            Ok(Ok(0)) => {}
            Ok(Ok(removed)) => {
                tracing::info!(removed, "removed what kubeadm's upgrades backed up");
            }
            Ok(Err(e)) => tracing::warn!(
                error = %e,
                "removing what kubeadm's upgrades backed up failed; tried again at the next upgrade"
            ),
            Err(e) => tracing::warn!(error = %e, "removing kubeadm's upgrade backups stopped"),
        }
    }

    /// Runs kubeadm with `args`, streaming output lines, killing it after
    /// `limit`. With [`Stdout::Discard`] only stderr is read.
    pub(super) async fn run(
        &self,
        command: &'static str,
        args: &[String],
        limit: Duration,
        stdout: Stdout,
        on_line: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), KubeadmError> {
        self.run_program(&self.program, command, args, limit, stdout, on_line)
            .await
    }

    /// [`Self::run`] with another of the components beside kubeadm
    /// (crictl), in kubeadm's environment.
    pub(super) async fn run_program(
        &self,
        program: &Path,
        command: &'static str,
        args: &[String],
        limit: Duration,
        stdout: Stdout,
        on_line: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), KubeadmError> {
        tracing::info!(program = %program.display(), ?args, "running {command}");
        let mut child = Command::new(program)
            .args(args)
            .env("PATH", self.search_path())
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(match stdout {
                Stdout::Stream => Stdio::piped(),
                Stdout::Discard => Stdio::null(),
            })
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| KubeadmError::Spawn {
                program: program.to_owned(),
                source,
            })?;
        let (tx, mut rx) = mpsc::channel::<String>(256);
        if let Some(out) = child.stdout.take() {
            tokio::spawn(forward_lines(out, tx.clone()));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(forward_lines(err, tx.clone()));
        }
        drop(tx);
        let mut tail: Vec<String> = Vec::new();
        let finished = tokio::time::timeout(limit, async {
            while let Some(line) = rx.recv().await {
                on_line(&line);
                if tail.len() == TAIL_LINES {
                    tail.remove(0);
                }
                tail.push(line);
            }
            child.wait().await
        })
        .await;
        let status = match finished {
            Err(_) => {
                let _ = child.kill().await;
                return Err(KubeadmError::Timeout {
                    command,
                    after: limit,
                });
            }
            Ok(status) => status.map_err(|source| KubeadmError::Spawn {
                program: program.to_owned(),
                source,
            })?,
        };
        if status.success() {
            Ok(())
        } else {
            Err(KubeadmError::Failed {
                command,
                status,
                last_lines: tail,
            })
        }
    }
}

/// The line that says why kubeadm failed: its last `error ...` line (kubeadm
/// prints `error execution phase ...: why`, then a hint), else its last line.
fn summary(lines: &[String]) -> &str {
    lines
        .iter()
        .rev()
        .find(|l| l.trim_start().to_ascii_lowercase().starts_with("error"))
        .or(lines.last())
        .map_or("no output", String::as_str)
}

/// Sends each line of `reader` (cut at [`MAX_LINE`], tokens scrubbed) to `tx`.
async fn forward_lines<R: AsyncRead + Unpin>(reader: R, tx: mpsc::Sender<String>) {
    let mut reader = BufReader::new(reader);
    let mut line = Vec::new();
    while let Ok(buf) = reader.fill_buf().await {
        if buf.is_empty() {
            break;
        }
        let newline = buf.iter().position(|&b| b == b'\n');
        let chunk = buf.get(..newline.unwrap_or(buf.len())).unwrap_or_default();
        let room = MAX_LINE.saturating_sub(line.len());
        line.extend_from_slice(chunk.get(..chunk.len().min(room)).unwrap_or_default());
        let consumed = newline.map_or(buf.len(), |i| i + 1);
        reader.consume(consumed);
        if newline.is_some() && tx.send(finish_line(&mut line)).await.is_err() {
            return;
        }
    }
    if !line.is_empty() {
        let _ = tx.send(finish_line(&mut line)).await;
    }
}

fn finish_line(line: &mut Vec<u8>) -> String {
    let text = String::from_utf8_lossy(line)
        .trim_end_matches('\r')
        .to_owned();
    line.clear();
    scrub_tokens(&text)
}

/// Replaces the secret half of anything shaped like a bootstrap token
/// (`[a-z0-9]{6}.[a-z0-9]{16}`) with `<redacted>`.
pub fn scrub_tokens(line: &str) -> String {
    let bytes = line.as_bytes();
    let token_char = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < bytes.len() {
        let is_token = i + 23 <= bytes.len()
            && (i == 0 || !token_char(bytes[i - 1]))
            && bytes[i..i + 6].iter().all(|&b| token_char(b))
            && bytes[i + 6] == b'.'
            && bytes[i + 7..i + 23].iter().all(|&b| token_char(b))
            && bytes.get(i + 23).is_none_or(|&b| !token_char(b));
        if is_token {
            out.push_str(&line[i..i + 7]);
            out.push_str("<redacted>");
            i += 23;
        } else {
            let ch = line[i..].chars().next().unwrap_or('\u{fffd}');
            out.push(ch);
            i += ch.len_utf8().max(1);
        }
    }
    out
}

/// The API server's static pod manifest under the node's root: kubeadm
/// upgrades a node's control plane where it exists.
const API_SERVER_MANIFEST: &str = "etc/kubernetes/manifests/kube-apiserver.yaml";

/// The default [`Kubeadm::upgrade_timeout`]. kubeadm waits up to 5 min for
/// each of the four static pods it upgrades (etcd, the API server, the
/// controller manager, the scheduler) before it rolls that one back from
/// its backup, and up to 150 s more for etcd's cluster: 22.5 min at worst.
/// Killed before, it leaves a component it could not start in place. The
/// operator's CLI waits 30 min for a node's upgrade, downloads included.
pub const CONTROL_PLANE_UPGRADE_LIMIT: Duration = Duration::from_secs(25 * 60);

/// Where kubeadm's upgrades put what they back up, under the node's root
/// (on the state disk, with the rest of `/etc/kubernetes`).
const UPGRADE_BACKUPS: &str = "etc/kubernetes/tmp";

/// The names kubeadm's upgrades give what they leave there: a copy of
/// etcd's data and of the static pods' manifests
/// (`kubeadm-backup-etcd-<time>`, `kubeadm-backup-manifests-<time>`), the
/// kubelet's configuration (`kubeadm-kubelet-config<n>`), and its working
/// copy of the new manifests (`kubeadm-upgraded-manifests<n>`, which it
/// removes itself unless it is killed).
const UPGRADE_BACKUP_PREFIXES: [&str; 3] = [
    "kubeadm-backup-",
    "kubeadm-kubelet-config",
    "kubeadm-upgraded-manifests",
];

/// Removes what kubeadm's upgrades left under `root`; returns how many
/// entries went. kubeadm keeps its backups after an upgrade, succeeded or
/// not, for an administrator to restore from or clear by hand: a node has
/// no shell for either, and a control plane would keep a copy of etcd's
/// data per upgrade on its state disk, beside etcd itself, until the disk
/// is full. kubeadm restores from them only within the run that made them.
fn remove_upgrade_backups(root: &Path) -> std::io::Result<usize> {
    let dir = root.join(UPGRADE_BACKUPS);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let ours = name.to_str().is_some_and(|name| {
            UPGRADE_BACKUP_PREFIXES
                .iter()
                .any(|prefix| name.starts_with(prefix))
        });
        if !ours {
            continue;
        }
        // Not followed if it is a link: only the entry itself goes.
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(entry.path())?;
        } else {
            std::fs::remove_file(entry.path())?;
        }
        removed += 1;
    }
    Ok(removed)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A control plane's `kubeadm upgrade node` upgrades its static pods,
    /// and kubeadm may wait 22.5 min before it rolls one back itself:
    /// killed before, it would leave a component it could not start. A
    /// worker's is limited like a join attempt.
    #[test]
    fn a_control_planes_upgrade_outlasts_kubeadms_own_rollback() {
        let root = tempfile::tempdir().unwrap();
        let mut kubeadm = Kubeadm::new(Path::new("/nonexistent"));
        kubeadm.root = root.path().to_owned();
        let kubeadms_worst = Duration::from_secs(4 * 5 * 60 + 150);
        assert_eq!(kubeadm.upgrade_node_limit(), kubeadm.join_timeout);
        let manifest = root.path().join(API_SERVER_MANIFEST);
        std::fs::create_dir_all(manifest.parent().unwrap()).unwrap();
        std::fs::write(&manifest, "").unwrap();
        assert!(kubeadm.upgrade_node_limit() > kubeadms_worst);
        assert!(kubeadm.upgrade_timeout > kubeadms_worst);
    }

    #[test]
    fn tokens_are_scrubbed_from_output() {
        assert_eq!(
            scrub_tokens("kubeadm join 10.0.0.1:6443 --token abcdef.0123456789abcdef --x"),
            "kubeadm join 10.0.0.1:6443 --token abcdef.<redacted> --x"
        );
        // Not token-shaped: left alone (versions, addresses, longer words).
        for line in [
            "v1.31.13",
            "10.0.0.1",
            "xabcdef.0123456789abcdef",
            "abcdef.0123456789abcdefx",
            "héllo",
        ] {
            assert_eq!(scrub_tokens(line), line);
        }
    }

    /// kubeadm's preflight runs `kubelet --version`, found through `PATH`:
    /// the kubelet is beside kubeadm, in the components' directory, which
    /// the agent's own `PATH` (the service manager's default) does not
    /// name.
    #[tokio::test]
    async fn kubeadm_finds_the_kubelet_beside_it() {
        use std::os::unix::fs::PermissionsExt as _;
        let bin = tempfile::tempdir().unwrap();
        for (name, script) in [
            ("kubeadm", "#!/bin/sh\nexec kubelet --version\n"),
            ("kubelet", "#!/bin/sh\necho 'Kubernetes v1.31.13'\n"),
        ] {
            let path = bin.path().join(name);
            std::fs::write(&path, script).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let k = Kubeadm::new(bin.path());
        let mut lines = Vec::new();
        k.run(
            "init",
            &[],
            Duration::from_secs(30),
            Stdout::Stream,
            &mut |l: &str| lines.push(l.to_owned()),
        )
        .await
        .unwrap();
        assert_eq!(lines, ["Kubernetes v1.31.13"]);
        let path = k.search_path();
        let dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
        assert_eq!(dirs.first().map(PathBuf::as_path), Some(bin.path()));
        assert!(dirs.iter().any(|d| d == Path::new("/usr/sbin")), "{dirs:?}");
    }

    #[test]
    fn command_lines_keep_secrets_out_of_the_output() {
        let mut k = Kubeadm::new(Path::new("/run/state/bin"));
        assert_eq!(k.program, Path::new("/run/state/bin/kubeadm"));
        assert_eq!(
            k.init_args(Path::new("/etc/kubernetes/keel/init.yaml")),
            [
                "init",
                "--config",
                "/etc/kubernetes/keel/init.yaml",
                "--skip-token-print",
                "--skip-certificate-key-print"
            ]
        );
        k.skip_phases = vec!["preflight".into(), "addon/kube-proxy".into()];
        assert_eq!(
            k.join_args(Path::new("/j.yaml")),
            [
                "join",
                "--config",
                "/j.yaml",
                "--skip-phases=preflight,addon/kube-proxy"
            ]
        );
    }
}
