//! A stand-in for systemd's notification socket: it collects what a
//! process sends to `$NOTIFY_SOCKET` (states such as `READY=1`, and the
//! descriptors handed to the file-descriptor store).

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd as _, RawFd};
use std::os::unix::net::UnixDatagram;

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};

/// A bound notification socket in a temporary directory of its own.
pub struct NotifySocket {
    socket: UnixDatagram,
    path: String,
    _dir: tempfile::TempDir,
}

impl NotifySocket {
    /// Binds the socket (non-blocking) at a path in a new temporary
    /// directory.
    pub fn new() -> std::io::Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("notify");
        let socket = UnixDatagram::bind(&path)?;
        socket.set_nonblocking(true)?;
        let path = path
            .to_str()
            .ok_or_else(|| std::io::Error::other("the temporary path is not UTF-8"))?
            .to_owned();
        Ok(Self {
            socket,
            path,
            _dir: dir,
        })
    }

    /// The socket's address, as `$NOTIFY_SOCKET` names it.
    pub fn socket(&self) -> &str {
        &self.path
    }

    /// The next message, with the files its descriptors open (read-only,
    /// through `/proc/self/fd`; the received descriptors are closed);
    /// `None` when none is waiting.
    pub fn receive(&self) -> Option<(String, Vec<std::fs::File>)> {
        let mut buf = [0u8; 256];
        let mut space = nix::cmsg_space!([RawFd; 4]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            self.socket.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::empty(),
        )
        .ok()?;
        let fds: Vec<RawFd> = msg
            .cmsgs()
            .into_iter()
            .flatten()
            .flat_map(|c| match c {
                ControlMessageOwned::ScmRights(fds) => fds,
                _ => Vec::new(),
            })
            .collect();
        let len = msg.bytes;
        let files = fds
            .into_iter()
            .filter_map(|fd| {
                let file = std::fs::File::open(format!("/proc/self/fd/{fd}")).ok();
                let _ = nix::unistd::close(fd);
                file
            })
            .collect();
        Some((String::from_utf8_lossy(&buf[..len]).into_owned(), files))
    }
}
