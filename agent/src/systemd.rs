//! The service manager's side of the agent, without libsystemd: readiness
//! notification (`sd_notify`) and its file-descriptor store, which keeps
//! descriptors across a restart of the service (not across a reboot).

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixDatagram;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: i32 = 3;
/// Most passed descriptors taken: the unit stores two.
const MAX_LISTEN_FDS: i32 = 16;

/// Sends `state` (e.g. `READY=1`) to `$NOTIFY_SOCKET`, if systemd set one.
/// Returns whether a message was sent.
pub fn notify(state: &str) -> std::io::Result<bool> {
    let Some(socket) = manager_socket() else {
        return Ok(false);
    };
    send_to(&socket, state, &[])?;
    Ok(true)
}

/// The service manager's notification socket (`$NOTIFY_SOCKET`), if
/// systemd set one: a path, or `@` and an abstract name.
pub fn manager_socket() -> Option<String> {
    std::env::var_os("NOTIFY_SOCKET").map(|path| path.to_string_lossy().into_owned())
}

/// Sends `state`, with the descriptors `fds`, to the notification socket
/// `socket` (a path, or `@` and an abstract name).
fn send_to(socket: &str, state: &str, fds: &[RawFd]) -> std::io::Result<()> {
    let addr = match socket.strip_prefix('@') {
        Some(abstract_name) => UnixAddr::new_abstract(abstract_name.as_bytes())?,
        None => UnixAddr::new(socket)?,
    };
    let sender = UnixDatagram::unbound()?;
    let rights = [ControlMessage::ScmRights(fds)];
    let control: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    sendmsg(
        sender.as_raw_fd(),
        &[IoSlice::new(state.as_bytes())],
        control,
        MsgFlags::empty(),
        Some(&addr),
    )?;
    Ok(())
}

/// Hands `fd` to the file-descriptor store of the service manager
/// listening at `socket` under `name` (`FDSTORE=1`). The store keeps every
/// descriptor handed to it, names repeated or not, up to the unit's
/// `FileDescriptorStoreMax=`: replacing one is storing the new one, then
/// [`remove_fd_at`] of the old one's name.
pub fn store_fd_at(socket: &str, name: &str, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    check_fd_name(name)?;
    send_to(
        socket,
        &format!("FDSTORE=1\nFDNAME={name}"),
        &[fd.as_raw_fd()],
    )
}

/// Has the service manager listening at `socket` close and forget the
/// descriptors it stores under `name` (`FDSTOREREMOVE=1`).
pub fn remove_fd_at(socket: &str, name: &str) -> std::io::Result<()> {
    check_fd_name(name)?;
    send_to(socket, &format!("FDSTOREREMOVE=1\nFDNAME={name}"), &[])
}

/// A stored descriptor's name: 1-255 printable characters without `:`
/// (the separator of `$LISTEN_FDNAMES`).
fn check_fd_name(name: &str) -> std::io::Result<()> {
    if name.is_empty()
        || name.len() > 255
        || !name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
    {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a stored descriptor's name is 1-255 printable characters without ':'",
        ));
    }
    Ok(())
}

/// Takes the files the service manager passed to this process
/// (`$LISTEN_FDS`, named by `$LISTEN_FDNAMES`): those of its store, at a
/// restart. Each is opened again read-only through `/proc/self/fd` and the
/// passed descriptor closed; one that cannot be opened so (a socket) is
/// only closed. Empty when none were passed or they are another process's.
/// Call once, before other threads start: the variables are removed.
pub fn take_passed_fds() -> Vec<(String, std::fs::File)> {
    let var = |name| std::env::var(name).ok();
    let passed = passed_fds(
        var("LISTEN_PID").as_deref(),
        var("LISTEN_FDS").as_deref(),
        var("LISTEN_FDNAMES").as_deref(),
        std::process::id(),
    );
    for name in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(name);
    }
    passed
        .into_iter()
        .filter_map(|(name, fd)| {
            let file = std::fs::File::open(format!("/proc/self/fd/{fd}"));
            if let Err(e) = nix::unistd::close(fd) {
                tracing::warn!(fd, error = %e, "closing a passed descriptor failed");
            }
            file.map_err(|e| {
                tracing::warn!(fd, name, error = %e, "a passed descriptor cannot be read");
            })
            .ok()
            .map(|file| (name, file))
        })
        .collect()
}

/// The descriptors (names and numbers) that `LISTEN_*` values pass to the
/// process `own_pid`: none unless `listen_pid` is that process; unnamed
/// ones are called `unknown`, as systemd calls them.
pub fn passed_fds(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    listen_fdnames: Option<&str>,
    own_pid: u32,
) -> Vec<(String, i32)> {
    if listen_pid.and_then(|p| p.parse::<u32>().ok()) != Some(own_pid) {
        return Vec::new();
    }
    let count = listen_fds
        .and_then(|n| n.parse::<i32>().ok())
        .unwrap_or(0)
        .clamp(0, MAX_LISTEN_FDS);
    let mut names = listen_fdnames.unwrap_or_default().split(':');
    (0..count)
        .map(|i| {
            let name = names.next().filter(|n| !n.is_empty()).unwrap_or("unknown");
            (name.to_owned(), LISTEN_FDS_START + i)
        })
        .collect()
}

/// Time since the kernel started (`/proc/uptime`), for boot timelines.
pub fn since_boot() -> Option<std::time::Duration> {
    let text = std::fs::read_to_string("/proc/uptime").ok()?;
    let seconds: f64 = text.split_whitespace().next()?.parse().ok()?;
    std::time::Duration::try_from_secs_f64(seconds).ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::io::{Read as _, Write as _};
    use std::os::fd::AsFd as _;

    #[test]
    fn passed_descriptors_are_this_processs_only() {
        let fds = |pid, count, names| passed_fds(pid, count, names, 42);
        assert_eq!(
            fds(Some("42"), Some("2"), Some("keel-resume:")),
            [("keel-resume".to_owned(), 3), ("unknown".to_owned(), 4)]
        );
        assert!(fds(Some("41"), Some("1"), Some("keel-resume")).is_empty());
        assert!(fds(None, Some("1"), Some("keel-resume")).is_empty());
        assert!(fds(Some("42"), Some("-1"), None).is_empty());
        assert!(fds(Some("42"), Some("x"), None).is_empty());
        assert_eq!(
            fds(Some("42"), Some("1000"), None).len(),
            MAX_LISTEN_FDS as usize
        );
    }

    #[test]
    fn a_state_reaches_the_service_manager_at_a_path_and_an_abstract_name() {
        use std::os::linux::net::SocketAddrExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let at_path = UnixDatagram::bind(&path).unwrap();
        let name = format!("keel-test-notify-{}", std::process::id());
        let abstract_addr =
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let at_name = UnixDatagram::bind_addr(&abstract_addr).unwrap();
        for (socket, manager) in [
            (path.to_str().unwrap().to_owned(), &at_path),
            (format!("@{name}"), &at_name),
        ] {
            send_to(&socket, "READY=1", &[]).unwrap();
            let mut buf = [0u8; 64];
            let n = manager.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], b"READY=1", "{socket}");
        }
    }

    #[test]
    fn a_stored_descriptor_reaches_the_service_manager_with_its_name() {
        let manager = keel_testkit::notify::NotifySocket::new().unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"kept").unwrap();
        store_fd_at(manager.socket(), "keel-resume", file.as_fd()).unwrap();

        let (state, files) = manager.receive().unwrap();
        assert_eq!(state, "FDSTORE=1\nFDNAME=keel-resume");
        assert_eq!(files.len(), 1);
        let mut text = String::new();
        (&files[0]).read_to_string(&mut text).unwrap();
        assert_eq!(text, "kept");

        remove_fd_at(manager.socket(), "keel-resume").unwrap();
        let (state, files) = manager.receive().unwrap();
        assert_eq!(state, "FDSTOREREMOVE=1\nFDNAME=keel-resume");
        assert!(files.is_empty());
        assert!(manager.receive().is_none());

        // Names systemd refuses, and one with a space, are refused here.
        for name in ["", "a:b", "a b"] {
            assert!(store_fd_at(manager.socket(), name, file.as_fd()).is_err());
            assert!(remove_fd_at(manager.socket(), name).is_err());
        }
    }
}
