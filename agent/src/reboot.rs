//! Resetting the node after a fatal failure past the node lock: the state
//! disk is marked for reset and the node reboots, which zeroes the PCRs, so
//! it can be tried again from a clean state.
//!
//! The reboot waits out a grace period on a thread of the agent's process.
//! So that an agent that restarts within it (a crash, systemd restarting
//! it) still reboots, the deadline is also written to a file in the agent's
//! runtime directory ([`REBOOT_PENDING`]), which the next start reads first
//! of all ([`resume_pending`]), before anything that could fail; that
//! directory is a tmpfs, so the file is gone once the node rebooted.

use std::path::Path;
use std::time::Duration;

use crate::disk::StateDisk;

/// What to do after a fatal failure.
#[derive(Clone, Copy, Debug)]
pub enum RebootPolicy {
    /// Reboot after this grace period (a node).
    After(Duration),
    /// Never reboot (host tests); the failure is still reported.
    Never,
}

/// The file in the agent's runtime directory that holds a scheduled
/// reboot: the boot's ID (`/proc/sys/kernel/random/boot_id`) and the
/// deadline in seconds on the boot-time clock. A record of another boot
/// (a runtime directory that outlived the reboot) is ignored.
pub const REBOOT_PENDING: &str = "reboot-pending";

/// Marks the state disk (if any) for reset and schedules the reboot the
/// policy asks for, recording it in `record_in` (the agent's runtime
/// directory, [`REBOOT_PENDING`]) if given: a start within the grace then
/// reboots too. Returns what happened, one line each, for the report.
pub async fn reset_node(
    state_disk: Option<&StateDisk>,
    policy: RebootPolicy,
    record_in: Option<&Path>,
) -> Vec<String> {
    let mut report = Vec::new();
    if let Some(disk) = state_disk.cloned() {
        let marked =
            tokio::task::spawn_blocking(move || disk.cryptsetup.mark_for_reset(&disk.device)).await;
        let failed = match marked {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(keel_atls::ErrorChain(&e).to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(cause) = failed {
            report.push(format!(
                "marking the state disk for reset failed ({cause}); its header still says its \
                 set-up is unfinished, so the next start resets it"
            ));
        }
    }
    match policy {
        RebootPolicy::After(grace) => {
            if let Err(e) = record_in.map_or(Ok(()), |dir| record_pending(dir, grace)) {
                report.push(format!(
                    "recording the pending reboot failed ({}): an agent restarted before it \
                     does not reboot",
                    keel_atls::ErrorChain(&e)
                ));
            }
            report.push(format!(
                "this node is unusable and reboots in {} s",
                grace.as_secs()
            ));
            schedule(grace);
        }
        RebootPolicy::Never => {
            report.push("this node is unusable; reboot it to try again".to_owned())
        }
    }
    report
}

/// At start, before anything that could fail: schedules the reboot that
/// an earlier run of the agent in this boot recorded in `run_dir`, after
/// what is left of its grace period. Returns what is left, `None` if no
/// reboot is pending. Only a node's agent records one.
pub fn resume_pending(run_dir: &Path) -> Option<Duration> {
    let left = pending(run_dir)?;
    schedule(left);
    Some(left)
}

/// Reboots after `grace`, on a thread of its own: it happens whatever the
/// agent's runtime does meanwhile (a runtime that ends drops its tasks).
fn schedule(grace: Duration) {
    let spawned = std::thread::Builder::new()
        .name("keel-reboot".into())
        .spawn(move || {
            std::thread::sleep(grace);
            reboot_now();
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "scheduling the reboot failed; rebooting now");
        reboot_now();
    }
}

/// Writes the deadline `grace` from now to `run_dir`'s [`REBOOT_PENDING`].
fn record_pending(run_dir: &Path, grace: Duration) -> Result<(), crate::files::WriteFileError> {
    let deadline = boot_time().saturating_add(grace).as_secs();
    crate::files::write_private(
        &run_dir.join(REBOOT_PENDING),
        format!("{} {deadline}\n", boot_id()).as_bytes(),
    )
}

/// What is left of the grace of the reboot recorded in `run_dir` in this
/// boot (zero if its deadline passed); `None` if there is none, or the
/// record is another boot's or not one this agent wrote (it writes whole
/// records only, [`crate::files::write_private`]).
fn pending(run_dir: &Path) -> Option<Duration> {
    let path = run_dir.join(REBOOT_PENDING);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "reading the pending reboot failed");
            return None;
        }
    };
    let (boot, deadline) = text.trim().split_once(' ')?;
    if boot.is_empty() || boot != boot_id() {
        return None;
    }
    let deadline = deadline.parse::<u64>().ok()?;
    Some(Duration::from_secs(deadline).saturating_sub(boot_time()))
}

/// This boot's ID, empty if it cannot be read.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_default()
}

/// Time since boot, suspend included (`CLOCK_BOOTTIME`): the clock an
/// agent that restarted within this boot reads alike.
fn boot_time() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map(Duration::from)
        .unwrap_or_default()
}

/// Syncs file systems and reboots immediately. Returns only if the reboot
/// was refused (e.g. not running as root); that is logged.
pub fn reboot_now() {
    nix::unistd::sync();
    let Err(e) = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    tracing::error!(error = %e, "reboot failed");
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A recorded reboot is found again with what is left of its grace:
    /// nothing left (reboot at once) once its deadline passed.
    #[test]
    fn a_recorded_reboot_is_found_with_what_is_left_of_its_grace() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(pending(dir.path()), None);
        record_pending(dir.path(), Duration::from_secs(3600)).unwrap();
        let left = pending(dir.path()).unwrap();
        assert!(
            (Duration::from_secs(3590)..=Duration::from_secs(3600)).contains(&left),
            "{left:?}"
        );
        record_pending(dir.path(), Duration::ZERO).unwrap();
        assert_eq!(pending(dir.path()), Some(Duration::ZERO));
        let past = format!("{} 12", boot_id());
        std::fs::write(dir.path().join(REBOOT_PENDING), past).unwrap();
        assert_eq!(pending(dir.path()), Some(Duration::ZERO));
    }

    /// A record of another boot (a runtime directory that is not a tmpfs,
    /// kept over the reboot) would reboot the node again and again: it is
    /// ignored, as is one this agent did not write.
    #[test]
    fn a_record_of_another_boot_or_not_the_agents_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!boot_id().is_empty());
        let deadline = boot_time().as_secs() + 3600;
        for text in [
            format!("00000000-0000-0000-0000-000000000000 {deadline}"),
            format!(" {deadline}"),
            format!("{deadline}"),
            format!("{} soon", boot_id()),
            String::new(),
        ] {
            std::fs::write(dir.path().join(REBOOT_PENDING), &text).unwrap();
            assert_eq!(pending(dir.path()), None, "{text:?}");
        }
    }
}
