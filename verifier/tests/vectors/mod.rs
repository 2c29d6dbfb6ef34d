//! The shared test vectors (real SEV-SNP reports and TDX quotes with their
//! certificates and collateral), read where they sit beside the clone.
#![allow(dead_code, clippy::unwrap_used, clippy::panic)]

use std::path::PathBuf;

use keel_verifier::cpu::policy::Tcb;

/// A file of the shared test vectors (`shared/` sits beside the clone).
pub fn data_path(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/cvm")
        .join(path)
}

/// The bytes of [`data_path`]`(path)`.
pub fn data(path: &str) -> Vec<u8> {
    std::fs::read(data_path(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `s` as `N` bytes of hex.
pub fn h<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).unwrap();
    out
}

/// An SEV-SNP TCB of these SVNs.
pub fn tcb(bootloader: u8, tee: u8, snp: u8, microcode: u8) -> Tcb {
    Tcb {
        bootloader,
        tee,
        snp,
        microcode,
    }
}
