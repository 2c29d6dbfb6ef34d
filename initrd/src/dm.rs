//! A read-only device-mapper device with one target, created through the
//! kernel's ioctl interface (`include/uapi/linux/dm-ioctl.h`): the three
//! calls `dmsetup create --readonly` makes (create the device, load its
//! table, resume it).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use crate::error::{Context, Error};

const CONTROL: &str = "/dev/mapper/control";
/// `sizeof(struct dm_ioctl)`: the header of every call.
const HEADER_LEN: usize = 312;
/// `sizeof(struct dm_target_spec)`: each target's header in a table.
const TARGET_SPEC_LEN: usize = 40;
const NAME_LEN: usize = 128;
const TARGET_TYPE_LEN: usize = 16;
/// The interface version this speaks: the kernel accepts any 4.x at or
/// below its own.
const VERSION: [u32; 3] = [4, 0, 0];

const DEV_CREATE: u8 = 3;
const DEV_SUSPEND: u8 = 6;
const TABLE_LOAD: u8 = 9;
const READONLY_FLAG: u32 = 1 << 0;

/// The ioctl request for command `nr`: `_IOWR(0xfd, nr, struct dm_ioctl)`.
const fn request(nr: u8) -> u32 {
    const READ_WRITE: u32 = 3;
    (READ_WRITE << 30) | ((HEADER_LEN as u32) << 16) | (0xfd << 8) | nr as u32
}

/// One target: `sectors` 512-byte sectors from sector 0, of type `kind`
/// (`verity`) with the kernel's parameter string `params`.
#[derive(Debug)]
pub struct Target {
    /// The device's length in sectors.
    pub sectors: u64,
    /// The target type (at most 15 bytes).
    pub kind: &'static str,
    /// The target's parameters, as `dmsetup table` shows them.
    pub params: String,
}

/// Creates device `name` with `target` as its only, read-only table and
/// activates it; returns its node under `/dev` (devtmpfs creates it).
pub fn create_read_only(name: &str, target: &Target) -> Result<PathBuf, Error> {
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open(CONTROL)
        .context(CONTROL)?;

    let mut create = header(name, 0, 0, HEADER_LEN)?;
    call(&control, DEV_CREATE, &mut create).with_context(|| format!("creating device {name}"))?;
    let minor = minor(u64::from_ne_bytes(field(&create, 40)));

    let mut load = table(name, target)?;
    call(&control, TABLE_LOAD, &mut load)
        .with_context(|| format!("loading the {} table of {name}", target.kind))?;

    let mut resume = header(name, 0, 0, HEADER_LEN)?;
    call(&control, DEV_SUSPEND, &mut resume).with_context(|| format!("activating {name}"))?;
    Ok(PathBuf::from(format!("/dev/dm-{minor}")))
}

/// A call's buffer: the header for device `name` with `flags`, announcing
/// `targets` targets, `len` bytes long in all.
fn header(name: &str, flags: u32, targets: u32, len: usize) -> Result<Vec<u8>, Error> {
    if name.is_empty() || name.len() >= NAME_LEN || name.contains('\0') {
        return Err(Error::new(format!(
            "device name {name:?} is not 1-127 bytes"
        )));
    }
    let mut buf = vec![0u8; len];
    for (i, part) in VERSION.iter().enumerate() {
        put(&mut buf, 4 * i, &part.to_ne_bytes());
    }
    // data_size (12) is set by `call`, from the buffer's length.
    put(&mut buf, 16, &(HEADER_LEN as u32).to_ne_bytes()); // data_start
    put(&mut buf, 20, &targets.to_ne_bytes()); // target_count
    put(&mut buf, 28, &flags.to_ne_bytes());
    put(&mut buf, 48, name.as_bytes()); // name[128], NUL-padded
    Ok(buf)
}

/// A `DM_TABLE_LOAD` buffer: the header, then one `dm_target_spec` and its
/// NUL-terminated parameters, padded to 8 bytes.
fn table(name: &str, target: &Target) -> Result<Vec<u8>, Error> {
    if target.kind.is_empty() || target.kind.len() >= TARGET_TYPE_LEN {
        return Err(Error::new(format!(
            "target type {:?} is too long",
            target.kind
        )));
    }
    if target.params.contains('\0') {
        return Err(Error::new("target parameters contain a NUL byte"));
    }
    let spec_len = (TARGET_SPEC_LEN + target.params.len() + 1).next_multiple_of(8);
    let mut buf = header(name, READONLY_FLAG, 1, HEADER_LEN + spec_len)?;
    let spec = HEADER_LEN;
    // sector_start (+0), length (+8); status (+16) stays 0; next (+20):
    // the offset of a following target.
    put(&mut buf, spec, &0u64.to_ne_bytes());
    put(&mut buf, spec + 8, &target.sectors.to_ne_bytes());
    put(&mut buf, spec + 20, &(spec_len as u32).to_ne_bytes());
    put(&mut buf, spec + 24, target.kind.as_bytes()); // target_type[16]
    put(&mut buf, spec + TARGET_SPEC_LEN, target.params.as_bytes());
    Ok(buf)
}

fn put(buf: &mut [u8], at: usize, bytes: &[u8]) {
    buf[at..at + bytes.len()].copy_from_slice(bytes);
}

fn field<const N: usize>(buf: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&buf[at..at + N]);
    out
}

/// The minor number in the kernel's encoding of a device number
/// (`huge_encode_dev`: minor bits 0-7 and 20-31, major bits 8-19).
fn minor(dev: u64) -> u64 {
    (dev & 0xff) | ((dev >> 12) & 0xfff00)
}

/// Issues command `nr` with `buf`, whose header `header` wrote; the kernel
/// reads and writes back at most `buf.len()` bytes.
#[allow(unsafe_code)]
fn call(control: &File, nr: u8, buf: &mut [u8]) -> io::Result<()> {
    if buf.len() < HEADER_LEN {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let len = u32::try_from(buf.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // data_size: how far the kernel may read and write.
    put(buf, 12, &len.to_ne_bytes());
    // SAFETY: `buf` is exclusively borrowed for the call and `buf.len()`
    // bytes long, at least a full `struct dm_ioctl`; its `data_size`, the
    // bound the kernel honours for both reading and writing back, was just
    // set to `buf.len()`. The kernel keeps no reference after returning.
    let rc = unsafe {
        libc::ioctl(
            control.as_raw_fd(),
            request(nr) as libc::Ioctl,
            buf.as_mut_ptr(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            sectors: 728_008,
            kind: "verity",
            params: "1 /dev/vda2 /dev/vda3 4096 4096 91001 1 sha256 ab -".into(),
        }
    }

    #[test]
    fn requests_are_the_kernel_header_values() {
        // DM_DEV_CREATE, DM_DEV_SUSPEND and DM_TABLE_LOAD as the kernel's
        // headers compute them on x86-64.
        assert_eq!(request(DEV_CREATE), 0xc138_fd03);
        assert_eq!(request(DEV_SUSPEND), 0xc138_fd06);
        assert_eq!(request(TABLE_LOAD), 0xc138_fd09);
    }

    #[test]
    fn a_table_is_header_spec_and_terminated_parameters() -> Result<(), Error> {
        let t = target();
        let buf = table("root", &t)?;
        let spec_len = (40 + t.params.len() + 1).next_multiple_of(8);
        assert_eq!(buf.len(), HEADER_LEN + spec_len);
        assert_eq!(buf.len() % 8, 0);
        assert_eq!(field::<4>(&buf, 0), 4u32.to_ne_bytes());
        assert_eq!(u32::from_ne_bytes(field(&buf, 16)), 312); // data_start
        assert_eq!(u32::from_ne_bytes(field(&buf, 20)), 1); // target_count
        assert_eq!(u32::from_ne_bytes(field(&buf, 28)), READONLY_FLAG);
        assert_eq!(&buf[48..53], b"root\0");
        assert_eq!(u64::from_ne_bytes(field(&buf, 312)), 0);
        assert_eq!(u64::from_ne_bytes(field(&buf, 320)), 728_008);
        assert_eq!(u32::from_ne_bytes(field(&buf, 332)), spec_len as u32);
        assert_eq!(&buf[336..343], b"verity\0");
        let params = &buf[352..352 + t.params.len() + 1];
        assert_eq!(&params[..t.params.len()], t.params.as_bytes());
        assert_eq!(params[t.params.len()], 0);
        Ok(())
    }

    #[test]
    fn names_and_targets_the_kernel_would_refuse_are_refused_here() {
        assert!(header("", 0, 0, HEADER_LEN).is_err());
        assert!(header(&"n".repeat(128), 0, 0, HEADER_LEN).is_err());
        assert!(header("ro\0ot", 0, 0, HEADER_LEN).is_err());
        assert!(header(&"n".repeat(127), 0, 0, HEADER_LEN).is_ok());
        let mut t = target();
        t.kind = "a-type-name-of-16";
        assert!(table("root", &t).is_err());
        let mut t = target();
        t.params.push('\0');
        assert!(table("root", &t).is_err());
    }

    #[test]
    fn the_minor_number_is_decoded_from_the_kernel_encoding() {
        assert_eq!(minor(253 << 8), 0);
        assert_eq!(minor((253 << 8) | 7), 7);
        assert_eq!(minor((253 << 8) | 0x34 | (0x12 << 20)), 0x1234);
    }

    #[test]
    fn a_call_without_a_device_mapper_fails_cleanly() -> Result<(), Box<dyn std::error::Error>> {
        // /dev/null takes no device-mapper ioctl: the error comes back, the
        // buffer is left as it was apart from data_size.
        let null = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        let mut buf = header("root", 0, 0, HEADER_LEN)?;
        assert!(call(&null, DEV_CREATE, &mut buf).is_err());
        assert_eq!(u32::from_ne_bytes(field(&buf, 12)), HEADER_LEN as u32);
        assert!(call(&null, DEV_CREATE, &mut [0u8; 8]).is_err());
        Ok(())
    }
}
