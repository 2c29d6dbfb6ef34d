//! Resetting the node after a fatal failure past the node lock: the state
//! disk is marked for reset and the node reboots, which zeroes the PCRs, so
//! it can be tried again from a clean state.

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

/// Marks the state disk (if any) for reset and schedules the reboot the
/// policy asks for. Returns what happened, one line each, for the report.
pub async fn reset_node(state_disk: Option<&StateDisk>, policy: RebootPolicy) -> Vec<String> {
    let mut report = Vec::new();
    if let Some(disk) = state_disk.cloned() {
        let marked =
            tokio::task::spawn_blocking(move || disk.cryptsetup.mark_for_reset(&disk.device)).await;
        if !matches!(marked, Ok(Ok(()))) {
            report.push("marking the state disk for reset failed".to_owned());
        }
    }
    match policy {
        RebootPolicy::After(grace) => {
            report.push(format!(
                "this node is unusable and reboots in {} s",
                grace.as_secs()
            ));
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                reboot_now();
            });
        }
        RebootPolicy::Never => {
            report.push("this node is unusable; reboot it to try again".to_owned())
        }
    }
    report
}

/// Syncs file systems and reboots immediately. Returns only if the reboot
/// was refused (e.g. not running as root); that is logged.
pub fn reboot_now() {
    nix::unistd::sync();
    let Err(e) = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    tracing::error!(error = %e, "reboot failed");
}
