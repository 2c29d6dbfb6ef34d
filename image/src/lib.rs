//! Predicts the PCR values a keel image produces when booted, from the
//! image's files alone.
//!
//! The boot path is OVMF booting a unified kernel image (UKI) directly:
//! the firmware measures the UKI (PCR 4), systemd-stub measures the UKI's
//! sections (PCR 11) and starts the Linux EFI stub, which measures the
//! kernel command line and the initrd (PCR 9). The agent then measures its
//! node config (PCR 12), predicted with the agent's own code.
//! `docs/measured-boot.md` lists every modelled event.
//!
//! Modules: [`pe`] parses the few PE/COFF headers needed, [`authenticode`]
//! computes the image hash firmware measures, [`pcr`] replays extends and
//! [`predict`] models each PCR's events. The measurements file verifiers
//! read is the agent's
//! [`Measurements`](keel_verifier::measurements::Measurements).

#![forbid(unsafe_code)]

pub mod authenticode;
pub mod pcr;
pub mod pe;
pub mod predict;

#[cfg(any(test, feature = "test-support"))]
#[doc(hidden)]
pub mod testpe;
