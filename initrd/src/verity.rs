//! The dm-verity root: its root hash from the kernel command line and its
//! layout from the superblock `veritysetup format` writes at the start of
//! the hash partition (cryptsetup's `struct verity_sb`).

use std::fmt::Write as _;

use crate::dm::Target;
use crate::error::Error;

/// The superblock's size on disk; the hash tree starts in the next block.
pub const SUPERBLOCK_LEN: usize = 512;
const SIGNATURE: &[u8; 8] = b"verity\0\0";
const SALT_MAX: usize = 256;
/// The only hash the root hash on the command line can be for (64 hex
/// digits).
const ALGORITHM: &str = "sha256";
const SECTOR: u64 = 512;
/// The data and hash block size of the image's verity root
/// (`VerityDataBlockSizeBytes` and `VerityHashBlockSizeBytes` in
/// `mkosi/mkosi.repart`): the superblock, which the host can write, does
/// not get to choose another layout for the tree the root hash pins.
const BLOCK_SIZE: u32 = 4096;
/// The hash format of the image's verity root (1, systemd-repart's: each
/// block hashed after the salt); the superblock does not get to choose
/// format 0, which hashes the salt after the block.
const HASH_TYPE: u32 = 1;

/// The value of the single `roothash=` on the kernel command line: 64 hex
/// digits, returned in lower case. None, two, or a malformed one is an
/// error.
pub fn root_hash(cmdline: &str) -> Result<String, Error> {
    let mut values = cmdline
        .split_ascii_whitespace()
        .filter_map(|arg| arg.strip_prefix("roothash="));
    let value = values
        .next()
        .ok_or_else(|| Error::new("no roothash= on the kernel command line"))?;
    if values.next().is_some() {
        return Err(Error::new(
            "more than one roothash= on the kernel command line",
        ));
    }
    if value.len() != 64 || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::new(
            "roothash= on the kernel command line is not 64 hex digits",
        ));
    }
    Ok(value.to_ascii_lowercase())
}

/// The fields of a verity superblock that the kernel's table needs.
#[derive(Debug, PartialEq, Eq)]
pub struct Superblock {
    hash_type: u32,
    data_block_size: u32,
    hash_block_size: u32,
    data_blocks: u64,
    salt: Vec<u8>,
}

impl Superblock {
    /// Parses the superblock: version 1, the image's hash format
    /// ([`HASH_TYPE`]), SHA-256, the image's block sizes ([`BLOCK_SIZE`]
    /// for data and hash blocks), a salt of at most 256 bytes.
    pub fn parse(block: &[u8; SUPERBLOCK_LEN]) -> Result<Self, Error> {
        let u16_at = |at: usize| u16::from_le_bytes([block[at], block[at + 1]]);
        let u32_at = |at: usize| {
            u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
        };
        let u64_at = |at: usize| u64::from(u32_at(at)) | u64::from(u32_at(at + 4)) << 32;

        if &block[..8] != SIGNATURE {
            return Err(Error::new("the hash partition has no verity superblock"));
        }
        let version = u32_at(8);
        if version != 1 {
            return Err(Error::new(format!(
                "verity superblock version {version}, expected 1"
            )));
        }
        // The image's format (systemd-repart writes 1: the salt before each
        // block). Format 0 puts it after: with the salt the host chooses, a
        // tree of the other format can end in the pinned root hash.
        let hash_type = u32_at(12);
        if hash_type != HASH_TYPE {
            return Err(Error::new(format!(
                "verity hash type {hash_type}, the image's is {HASH_TYPE}"
            )));
        }
        let algorithm = &block[32..64];
        let name_len = algorithm.iter().position(|&b| b == 0).unwrap_or(32);
        if &algorithm[..name_len] != ALGORITHM.as_bytes() {
            return Err(Error::new(format!(
                "verity hash {:?}, expected {ALGORITHM}",
                String::from_utf8_lossy(&algorithm[..name_len])
            )));
        }
        let (data_block_size, hash_block_size) = (u32_at(64), u32_at(68));
        if (data_block_size, hash_block_size) != (BLOCK_SIZE, BLOCK_SIZE) {
            return Err(Error::new(format!(
                "verity block sizes {data_block_size}/{hash_block_size}, the image's are {BLOCK_SIZE}/{BLOCK_SIZE}"
            )));
        }
        let data_blocks = u64_at(72);
        if data_blocks == 0 {
            return Err(Error::new("the verity superblock describes no data blocks"));
        }
        let salt_len = usize::from(u16_at(80));
        if salt_len > SALT_MAX {
            return Err(Error::new(format!(
                "verity salt of {salt_len} bytes, at most {SALT_MAX}"
            )));
        }
        Ok(Self {
            hash_type,
            data_block_size,
            hash_block_size,
            data_blocks,
            salt: block[88..88 + salt_len].to_vec(),
        })
    }

    /// The read-only `verity` target over all data blocks, the hash tree
    /// starting in the block after the superblock. A block that fails its
    /// hash panics the kernel (`panic_on_corruption`) instead of failing
    /// the read: with plain I/O errors, a host that corrupts chosen blocks
    /// could make chosen directories unreadable, and systemd skips a unit
    /// or generator directory it cannot read (the image's masks among
    /// them), while every PCR stays as predicted.
    pub fn target(&self, data: &str, hash: &str, root_hash: &str) -> Result<Target, Error> {
        let bytes = self
            .data_blocks
            .checked_mul(u64::from(self.data_block_size))
            .ok_or_else(|| Error::new("the verity data area's size overflows"))?;
        let salt = if self.salt.is_empty() {
            "-".to_string()
        } else {
            self.salt.iter().fold(String::new(), |mut hex, b| {
                let _ = write!(hex, "{b:02x}");
                hex
            })
        };
        Ok(Target {
            sectors: bytes / SECTOR,
            kind: "verity",
            params: format!(
                "{} {data} {hash} {} {} {} 1 {ALGORITHM} {root_hash} {salt} 1 panic_on_corruption",
                self.hash_type, self.data_block_size, self.hash_block_size, self.data_blocks
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "7aa1ff230381a03b347efd87266d5ef771362f765c8c6848cb8e1c02a57bd552";

    /// A superblock as `veritysetup format` writes it.
    fn superblock(salt: &[u8]) -> [u8; SUPERBLOCK_LEN] {
        let mut b = [0u8; SUPERBLOCK_LEN];
        b[..8].copy_from_slice(SIGNATURE);
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[12..16].copy_from_slice(&1u32.to_le_bytes());
        b[16..32].copy_from_slice(&[0xab; 16]);
        b[32..38].copy_from_slice(b"sha256");
        b[64..68].copy_from_slice(&4096u32.to_le_bytes());
        b[68..72].copy_from_slice(&4096u32.to_le_bytes());
        b[72..80].copy_from_slice(&91_126u64.to_le_bytes());
        b[80..82].copy_from_slice(&(salt.len() as u16).to_le_bytes());
        b[88..88 + salt.len()].copy_from_slice(salt);
        b
    }

    fn refusal(block: &[u8; SUPERBLOCK_LEN]) -> String {
        Superblock::parse(block)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn the_root_hash_is_the_single_roothash_argument() -> Result<(), Error> {
        let cmdline = format!("roothash={} console=ttyS0 quiet\n", HASH.to_uppercase());
        assert_eq!(root_hash(&cmdline)?, HASH);
        Ok(())
    }

    #[test]
    fn a_missing_repeated_or_malformed_root_hash_is_refused() {
        for (cmdline, why) in [
            ("console=ttyS0 quiet".to_string(), "no roothash="),
            (format!("roothash={HASH} roothash={HASH}"), "more than one"),
            (format!("roothash={}", &HASH[1..]), "not 64 hex digits"),
            (format!("roothash={}0", HASH), "not 64 hex digits"),
            (format!("roothash={}g", &HASH[1..]), "not 64 hex digits"),
            (format!("xroothash={HASH}"), "no roothash="),
        ] {
            let err = root_hash(&cmdline)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains(why), "{cmdline:?}: {err:?}");
        }
    }

    #[test]
    fn the_table_matches_what_veritysetup_would_load() -> Result<(), Error> {
        let sb = Superblock::parse(&superblock(&[0x01, 0xfe, 0x7a]))?;
        let target = sb.target("/dev/vda2", "/dev/vda3", HASH)?;
        assert_eq!(target.sectors, 91_126 * 8);
        assert_eq!(target.kind, "verity");
        assert_eq!(
            target.params,
            format!(
                "1 /dev/vda2 /dev/vda3 4096 4096 91126 1 sha256 {HASH} 01fe7a 1 panic_on_corruption"
            )
        );
        Ok(())
    }

    #[test]
    fn an_empty_salt_is_a_dash() -> Result<(), Error> {
        let target = Superblock::parse(&superblock(&[]))?.target("d", "h", HASH)?;
        assert!(
            target
                .params
                .ends_with(&format!("{HASH} - 1 panic_on_corruption")),
            "{}",
            target.params
        );
        Ok(())
    }

    #[test]
    fn a_superblock_the_kernel_would_not_take_is_refused() {
        type Change = fn(&mut [u8; SUPERBLOCK_LEN]);
        let cases: [(Change, &str); 11] = [
            (|b| b[0] = b'V', "no verity superblock"),
            (|b| b[8] = 2, "version 2"),
            (|b| b[12] = 7, "hash type 7"),
            // The kernel's other format: the salt after each block.
            (|b| b[12] = 0, "hash type 0, the image's is 1"),
            (
                |b| b[32..38].copy_from_slice(b"sha1\0\0"),
                "\"sha1\", expected sha256",
            ),
            (|b| b[32..64].fill(b'a'), "expected sha256"),
            (
                |b| b[64..68].copy_from_slice(&4095u32.to_le_bytes()),
                "block sizes 4095/4096",
            ),
            (
                |b| b[68..72].copy_from_slice(&8192u32.to_le_bytes()),
                "block sizes 4096/8192",
            ),
            // A size the kernel takes, but not the image's.
            (
                |b| b[64..68].copy_from_slice(&512u32.to_le_bytes()),
                "block sizes 512/4096, the image's are 4096/4096",
            ),
            (|b| b[72..80].fill(0), "no data blocks"),
            (
                |b| b[80..82].copy_from_slice(&257u16.to_le_bytes()),
                "salt of 257 bytes",
            ),
        ];
        for (change, why) in cases {
            let mut block = superblock(&[1]);
            change(&mut block);
            let err = refusal(&block);
            assert!(err.contains(why), "expected {why:?}, got {err:?}");
        }
    }

    #[test]
    fn a_data_area_too_large_to_address_is_refused() -> Result<(), Error> {
        let mut b = superblock(&[1]);
        b[72..80].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = Superblock::parse(&b)?.target("d", "h", HASH).err();
        assert!(err.is_some_and(|e| e.to_string().contains("overflows")));
        Ok(())
    }
}
