//! `keel-initrd`: the init of the keel image's initrd.
//!
//! The kernel runs it as PID 1 from the initramfs. It loads the drivers the
//! root needs, opens the root partition with dm-verity against the root
//! hash on the kernel command line, mounts it read-only and hands over to
//! systemd on it. Nothing else: no shell, no dynamic loader, no libraries.
//!
//! Trust does not depend on anything it reads from disk. The root hash
//! comes from the kernel command line, which is inside the measured UKI;
//! the verity superblock it reads from the hash partition only describes
//! the layout, and dm-verity checks every block read from the root against
//! the root hash, so a changed root fails to read. (A superblock with a
//! smaller block count can open a verified prefix of the root, whose reads
//! past it fail; see docs/measured-boot.md.)
//!
//! PID 1 must not exit: on any failure it prints why on the console and
//! powers the machine off.

mod dm;
mod error;
mod modules;
mod switch_root;
mod verity;

use std::convert::Infallible;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};
use nix::time::{clock_gettime, ClockId};

use crate::error::{Context, Error};

/// The image's fixed partition layout (`mkosi/mkosi.repart`): the erofs
/// root and its dm-verity hash tree.
const DATA_PARTITION: &str = "/dev/vda2";
const HASH_PARTITION: &str = "/dev/vda3";
/// How long the hash partition may take to appear once its driver loads.
const PARTITION_WAIT: Duration = Duration::from_secs(30);
/// The device-mapper name of the opened root.
const ROOT_NAME: &str = "root";
const NEW_ROOT: &str = "/sysroot";
const SYSTEMD: &str = "/sbin/init";
/// Starts the console line for an optional module that did not load (the
/// image's boot test looks for it: on QEMU every one should load).
const OPTIONAL_MODULE_SKIPPED: &str = "keel-initrd: optional module not loaded: ";

fn main() {
    if std::process::id() != 1 {
        not_pid_one();
    }
    match boot() {
        Ok(never) => match never {},
        Err(err) => power_off(&err),
    }
}

/// Run anywhere but as PID 1, it does nothing (it would unmount and delete
/// the file system it runs from).
fn not_pid_one() -> ! {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("--version") {
        println!("keel-initrd {}", env!("CARGO_PKG_VERSION"));
        std::process::exit(0);
    }
    eprintln!(
        "keel-initrd is the keel image's initrd init and runs only as PID 1 there:\n\
         it loads the root's drivers, opens the dm-verity root given by roothash= on\n\
         the kernel command line ({DATA_PARTITION} data, {HASH_PARTITION} hash tree),\n\
         mounts it on {NEW_ROOT} and starts {SYSTEMD} on it."
    );
    std::process::exit(2);
}

fn boot() -> Result<Infallible, Error> {
    mount_api_filesystems()?;
    say(&format!(
        "keel-initrd: started since_boot_s={}",
        since_boot()
    ));

    let release = nix::sys::utsname::uname()
        .context("uname")?
        .release()
        .to_string_lossy()
        .into_owned();
    let skipped = modules::load_all(Path::new("/usr/lib/modules").join(release).as_path())?;
    for reason in skipped {
        say(&format!("{OPTIONAL_MODULE_SKIPPED}{reason}"));
    }

    let cmdline = fs::read_to_string("/proc/cmdline").context("reading /proc/cmdline")?;
    let root_hash = verity::root_hash(&cmdline)?;
    wait_for_block_device(HASH_PARTITION, PARTITION_WAIT)?;
    let superblock = verity::Superblock::parse(&read_first_block(HASH_PARTITION)?)?;
    let target = superblock.target(DATA_PARTITION, HASH_PARTITION, &root_hash)?;
    let root = dm::create_read_only(ROOT_NAME, &target)?;

    fs::create_dir_all(NEW_ROOT).context("creating /sysroot")?;
    mount(
        Some(root.as_path()),
        NEW_ROOT,
        Some("erofs"),
        MsFlags::MS_RDONLY,
        None::<&str>,
    )
    .with_context(|| format!("mounting {} (erofs) on {NEW_ROOT}", root.display()))?;

    say(&format!(
        "keel-initrd: root opened, starting systemd since_boot_s={}",
        since_boot()
    ));
    switch_root::into(NEW_ROOT, SYSTEMD)
}

/// `/dev` (devtmpfs: device nodes appear as drivers create them), `/proc`
/// and `/sys`.
fn mount_api_filesystems() -> Result<(), Error> {
    let nosuid = MsFlags::MS_NOSUID;
    let hardened = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    for (fstype, target, flags, data) in [
        ("devtmpfs", "/dev", nosuid, Some("mode=0755")),
        ("proc", "/proc", hardened, None),
        ("sysfs", "/sys", hardened, None),
    ] {
        mount(Some(fstype), target, Some(fstype), flags, data)
            .with_context(|| format!("mounting {fstype} on {target}"))?;
    }
    Ok(())
}

fn wait_for_block_device(path: &str, patience: Duration) -> Result<(), Error> {
    let started = Instant::now();
    loop {
        if fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device()) {
            return Ok(());
        }
        if started.elapsed() >= patience {
            return Err(Error::new(format!(
                "{path} did not appear within {} s",
                patience.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_first_block(path: &str) -> Result<[u8; verity::SUPERBLOCK_LEN], Error> {
    let mut block = [0u8; verity::SUPERBLOCK_LEN];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut block))
        .with_context(|| format!("reading the verity superblock from {path}"))?;
    Ok(block)
}

/// Seconds since the kernel started (the clock of `/proc/uptime`), which
/// `make vm-check` reads from the console to place the boot's phases.
fn since_boot() -> String {
    clock_gettime(ClockId::CLOCK_BOOTTIME)
        .map(|t| format!("{:.2}", Duration::from(t).as_secs_f64()))
        .unwrap_or_else(|_| "unknown".into())
}

/// One line on the console. The kernel opened `/dev/console` (a node in the
/// initramfs) as this process's standard output; a console that cannot be
/// written to must not stop the boot.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn power_off(err: &Error) -> ! {
    say(&format!("keel-initrd: {err}; powering off in 10 s"));
    std::thread::sleep(Duration::from_secs(10));
    nix::unistd::sync();
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    // Only reached if the kernel refused: PID 1 must not exit.
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
