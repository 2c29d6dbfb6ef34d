//! Rebooting the node after a fatal failure: a reboot zeroes the PCRs, so
//! the node can be tried again from a clean state.

/// Syncs file systems and reboots immediately. Returns only if the reboot
/// was refused (e.g. not running as root); that is logged.
pub fn reboot_now() {
    nix::unistd::sync();
    let Err(e) = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    tracing::error!(error = %e, "reboot failed");
}
