//! The kernel modules the root needs, loaded from the modules initrd that
//! mkosi adds beside this one (`KernelModulesInitrdInclude=` in
//! `mkosi/mkosi.conf`). The distribution kernel builds them as modules.

use std::ffi::CStr;
use std::fs::File;
use std::path::Path;

use nix::errno::Errno;
use nix::kmod::{finit_module, ModuleInitFlags};

use crate::error::{Context, Error};

/// Needed to open the root, in dependency order (the kernel does not
/// resolve dependencies: each must follow the modules it uses).
const REQUIRED: &[&str] = &[
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_pci_legacy_dev",
    "drivers/virtio/virtio_pci_modern_dev",
    "drivers/virtio/virtio_pci",
    "drivers/block/virtio_blk",
    "drivers/md/dm-mod",
    "drivers/md/dm-bufio",
    "lib/reed_solomon/reed_solomon",
    "drivers/md/dm-verity",
    "lib/libcrc32c",
    "fs/erofs/erofs",
];

/// Loaded early when the machine has the device, skipped when the module
/// is absent or finds nothing:
/// - the firmware config interface carries the node config on QEMU, so the
///   agent can read it before systemd runs; elsewhere the agent falls back
///   to the image's default;
/// - the virtio NIC's driver, so the interface exists when systemd starts:
///   udev handles network devices first in its coldplug, where left to udev
///   the driver loads only when its turn among all devices comes (tens of
///   seconds under emulation);
/// - autofs4 and ip_tables (with x_tables), which systemd loads itself
///   before anything else when they are missing, through a libkmod context
///   over the module indexes of the verity root; with both loaded, systemd
///   never creates that context.
///
/// Not efivarfs: the image boots with `efi=noruntime` (no EFI variables),
/// so systemd finds no efivars mount point and mounts nothing there.
const OPTIONAL: &[&str] = &[
    "drivers/firmware/qemu_fw_cfg",
    "net/core/failover",
    "drivers/net/net_failover",
    "drivers/net/virtio_net",
    "fs/autofs/autofs4",
    "net/netfilter/x_tables",
    "net/ipv4/netfilter/ip_tables",
];

/// Loads every required module (failing on the first that does not load)
/// and then every optional one that does, from `release_dir`
/// (`/usr/lib/modules/<kernel release>`). Returns why each optional module
/// that did not load failed (`module: cause`), for the console: a module
/// missing from mkosi's include list shows there, not only as a slower boot.
pub fn load_all(release_dir: &Path) -> Result<Vec<String>, Error> {
    let kernel = release_dir.join("kernel");
    for module in REQUIRED {
        let path = kernel.join(format!("{module}.ko"));
        load(&path).with_context(|| format!("loading {}", path.display()))?;
    }
    Ok(OPTIONAL
        .iter()
        .filter_map(|module| {
            load(&kernel.join(format!("{module}.ko")))
                .err()
                .map(|e| format!("{module}: {e}"))
        })
        .collect())
}

/// One module, without parameters; one already loaded counts as loaded.
fn load(path: &Path) -> Result<(), Error> {
    const NO_PARAMETERS: &CStr = c"";
    let file = File::open(path).context("open")?;
    match finit_module(&file, NO_PARAMETERS, ModuleInitFlags::empty()) {
        Ok(()) | Err(Errno::EEXIST) => Ok(()),
        Err(errno) => Err(Error::new(format!("finit_module: {errno}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_required_module_names_its_path() {
        let dir = std::env::temp_dir().join("keel-initrd-no-modules");
        let err = load_all(&dir).err().map(|e| e.to_string());
        let expected = format!(
            "loading {}/kernel/drivers/virtio/virtio_ring.ko: open: No such file or directory (os error 2)",
            dir.display()
        );
        assert_eq!(err.as_deref(), Some(expected.as_str()));
    }

    #[test]
    fn a_file_that_is_no_module_is_refused() -> Result<(), Box<dyn std::error::Error>> {
        // As root the kernel parses the file and refuses it (ENOEXEC); as
        // anyone else it refuses the call (EPERM). Either way: an error.
        let file = std::env::temp_dir().join(format!("keel-initrd-{}.ko", std::process::id()));
        std::fs::write(&file, b"not an ELF module")?;
        let result = load(&file);
        std::fs::remove_file(&file)?;
        let err = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.starts_with("finit_module: "), "{err}");
        Ok(())
    }
}
