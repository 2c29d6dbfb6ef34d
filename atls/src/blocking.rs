//! Running the blocking issuer and validator from inside rustls callbacks.
//!
//! rustls calls certificate resolvers and verifiers synchronously from the
//! future that drives the handshake, so a TPM operation there would stall a
//! tokio worker and every task queued on it. On a multi-threaded runtime the
//! call is wrapped in [`tokio::task::block_in_place`], which hands the
//! worker's other tasks to another thread first. On a current-thread runtime
//! (where `block_in_place` is not available) or outside any runtime the call
//! simply runs: there is no other worker to protect. (tokio refuses
//! `block_in_place` inside a `LocalSet` on a multi-threaded runtime: do not
//! drive aTLS handshakes from one.)

use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `f`, moving the current tokio worker's other tasks away first when
/// possible.
pub(crate) fn run<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}
