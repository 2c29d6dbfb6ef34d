//! State-disk encryption: LUKS2 through the `cryptsetup` program.
//!
//! The disk key is handed to `cryptsetup` on its standard input
//! (`--key-file=-`), never in its arguments (visible in `/proc/*/cmdline`)
//! and never in logs or error messages. Arguments are built by a pure
//! function ([`Cryptsetup::args`]) that never sees the key.
//!
//! * [`cryptsetup`]: the `cryptsetup` program's operations on a LUKS2
//!   device, the reset marker, and the choices behind them (KDF, reset);
//! * [`header`]: an existing disk's LUKS2 header, checked against what the
//!   agent creates on a private copy that the key check and `open` then use;
//! * [`state`]: the node's state disk: set up or unlocked, its file
//!   system, its mount and bind mounts;
//! * [`error`] holds [`DiskError`];
//! * `process`: running the programs, the key on standard input, the end
//!   of their standard error in errors.
//!
//! Opening a volume needs device-mapper (VMs only): a [`StateDisk`] without
//! a [`StateMount`] (host tests) is formatted and key-checked, never opened.

pub mod cryptsetup;
pub mod error;
pub mod header;
mod process;
pub mod state;

pub use cryptsetup::{
    Cryptsetup, Operation, MAX_KEY_LEN, MIN_KEY_LEN, PBKDF2_ITERATIONS, PROVISIONED_LABEL,
    PROVISIONING_LABEL,
};
pub use error::{DiskError, UnusableHeader};
pub use header::{DetachedHeader, HeaderMismatch};
pub use state::{
    make_filesystem, mount, new_uuid, DiskState, StateDisk, StateMount, STATE_MAPPING,
};
