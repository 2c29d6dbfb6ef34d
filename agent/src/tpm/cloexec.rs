//! Keeping the TPM connection out of child processes.
//!
//! tpm2-tss opens its connection (`/dev/tpmrm0`, or the swtpm socket)
//! without close-on-exec, so every program the agent runs afterwards
//! (kubeadm, cryptsetup, systemctl) would inherit it: through the resource
//! manager a child holding the descriptor shares the agent's connection and
//! its loaded keys, and a socket held by a child keeps a single-client swtpm
//! from ever seeing the agent close it. [`CloseOnExec`] marks every
//! descriptor a TPM context opened as close-on-exec. A program started by
//! another thread between the open and the marking could still inherit it;
//! the agent opens its TPM before it starts any.

use std::collections::BTreeSet;
use std::os::fd::RawFd;

use nix::fcntl::{fcntl, FcntlArg, FdFlag};

/// The descriptors open before a TPM context was created.
pub struct CloseOnExec(BTreeSet<RawFd>);

impl CloseOnExec {
    /// Notes the descriptors open now.
    pub fn before() -> Self {
        Self(open_fds())
    }

    /// Marks every descriptor opened since [`CloseOnExec::before`] as
    /// close-on-exec; returns how many lacked the flag.
    pub fn mark_new(self) -> usize {
        open_fds()
            .difference(&self.0)
            .filter(|&&fd| set_cloexec(fd))
            .count()
    }
}

/// The process's open descriptors (empty where `/proc` is not mounted),
/// without the one the listing itself used, which is closed by then.
fn open_fds() -> BTreeSet<RawFd> {
    let listed: BTreeSet<RawFd> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    listed
        .into_iter()
        .filter(|&fd| fcntl(fd, FcntlArg::F_GETFD).is_ok())
        .collect()
}

/// Sets FD_CLOEXEC on `fd`; true when it was not set. A descriptor that
/// closed meanwhile (e.g. the directory listing's own) is skipped.
fn set_cloexec(fd: RawFd) -> bool {
    let Ok(flags) = fcntl(fd, FcntlArg::F_GETFD) else {
        return false;
    };
    let flags = FdFlag::from_bits_truncate(flags);
    if flags.contains(FdFlag::FD_CLOEXEC) {
        return false;
    }
    fcntl(fd, FcntlArg::F_SETFD(flags | FdFlag::FD_CLOEXEC)).is_ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd as _;

    #[test]
    fn a_descriptor_opened_without_the_flag_gets_it() {
        let guard = CloseOnExec::before();
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let fd = file.as_raw_fd();
        // std opens with O_CLOEXEC; clear it, as C code that does not ask
        // for it leaves it.
        fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty())).unwrap();
        assert_eq!(guard.mark_new(), 1);
        let flags = FdFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFD).unwrap());
        assert!(flags.contains(FdFlag::FD_CLOEXEC));
        // Nothing new: nothing marked.
        assert_eq!(CloseOnExec::before().mark_new(), 0);
    }
}
