//! Handing over to the real root: what `switch_root` does, in order.

use std::convert::Infallible;
use std::ffi::CString;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::mount::{mount, umount, MsFlags};
use nix::sys::statfs::statfs;
use nix::unistd::{chdir, chroot, execv};

use crate::error::{Context, Error};

/// Moves `/dev` into `new_root`, frees the initramfs, makes `new_root` the
/// root and executes `init` there as PID 1. Returns only on failure.
pub fn into(new_root: &str, init: &str) -> Result<Infallible, Error> {
    for api in ["/proc", "/sys"] {
        umount(api).with_context(|| format!("unmounting {api}"))?;
    }
    let new_dev = format!("{new_root}/dev");
    mount(
        Some("/dev"),
        new_dev.as_str(),
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .with_context(|| format!("moving /dev to {new_dev}"))?;
    chdir(new_root).with_context(|| format!("entering {new_root}"))?;
    free_initramfs();
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .with_context(|| format!("moving {new_root} to /"))?;
    chroot(".").context("chroot")?;
    chdir("/").context("chdir /")?;
    let path = CString::new(init).context("init path")?;
    let Err(errno) = execv(&path, &[&path]);
    Err(Error::new(format!("starting {init}: {errno}")))
}

/// Deletes the initramfs's files (its memory is not freed otherwise),
/// staying on its file system: the new root, mounted below it, is not
/// touched. Only when `/` is a RAM file system: run anywhere else by
/// mistake, it deletes nothing. Best effort: what cannot be deleted only
/// costs memory.
fn free_initramfs() {
    let Ok(root) = statfs("/") else { return };
    // The initramfs is tmpfs, or ramfs in a kernel without tmpfs.
    const RAMFS_MAGIC: u64 = 0x8584_58f6;
    let kind = root.filesystem_type().0;
    if kind != RAMFS_MAGIC && kind != libc::TMPFS_MAGIC as u64 {
        return;
    }
    let Ok(meta) = fs::symlink_metadata("/") else {
        return;
    };
    remove_below(Path::new("/"), meta.dev());
}

fn remove_below(dir: &Path, dev: u64) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.dev() != dev {
            continue;
        }
        if meta.is_dir() {
            remove_below(&path, dev);
            let _ = fs::remove_dir(&path);
        } else {
            let _ = fs::remove_file(&path);
        }
    }
}
