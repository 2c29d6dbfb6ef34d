//! Progress reporting for the operator. The installer reports each
//! component's bytes as they arrive; a [`Progress`] decides what to show.
//! [`LogProgress`] writes throttled `tracing` events (bytes and MB/s); a
//! terminal progress bar can implement the same trait.

use std::error::Error;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Receives progress of component installs. Every method has a no-op default.
pub trait Progress: Send + Sync {
    /// A download of `name` starts; `total` is the announced size, if any.
    fn started(&self, name: &str, total: Option<u64>) {
        let _ = (name, total);
    }

    /// `done` bytes of `name` have been received and hashed.
    fn advanced(&self, name: &str, done: u64, total: Option<u64>) {
        let _ = (name, done, total);
    }

    /// Attempt `attempt` of `name` failed transiently; the next starts after `delay`.
    fn retrying(&self, name: &str, attempt: u32, delay: Duration, error: &(dyn Error + 'static)) {
        let _ = (name, attempt, delay, error);
    }

    /// `name` was received completely (`bytes` in `elapsed`) and its hash matched.
    fn finished(&self, name: &str, bytes: u64, elapsed: Duration) {
        let _ = (name, bytes, elapsed);
    }

    /// A component is in place, its hash verified, whichever way it got
    /// there ([`Outcome`](crate::Outcome): downloaded, written from inline
    /// content, copied from its kept copy, or found in place).
    fn installed(&self, installed: &crate::InstalledComponent) {
        let _ = installed;
    }
}

/// Reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}

/// Logs progress through `tracing`: one event per `interval` at most while a
/// download runs, and one when it ends.
#[derive(Debug)]
pub struct LogProgress {
    interval: Duration,
    state: Mutex<Option<Window>>,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    started: Instant,
    last_report: Instant,
}

impl LogProgress {
    /// Logs at most once per `interval` per download.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new(None),
        }
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Option<Window>> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Default for LogProgress {
    fn default() -> Self {
        Self::new(Duration::from_secs(2))
    }
}

/// Megabytes (10^6 bytes) per second.
pub fn megabytes_per_second(bytes: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64().max(1e-9);
    // Precision loss above 2^53 bytes is irrelevant for a rate.
    #[allow(clippy::cast_precision_loss)]
    let bytes = bytes as f64;
    bytes / secs / 1e6
}

impl Progress for LogProgress {
    fn started(&self, name: &str, total: Option<u64>) {
        let now = Instant::now();
        *self.window() = Some(Window {
            started: now,
            last_report: now,
        });
        tracing::info!(component = name, total_bytes = total, "download started");
    }

    fn advanced(&self, name: &str, done: u64, total: Option<u64>) {
        let mut guard = self.window();
        let Some(window) = guard.as_mut() else { return };
        let now = Instant::now();
        if now.duration_since(window.last_report) < self.interval {
            return;
        }
        window.last_report = now;
        let rate = megabytes_per_second(done, now.duration_since(window.started));
        tracing::info!(
            component = name,
            done_bytes = done,
            total_bytes = total,
            mb_per_s = format_args!("{rate:.1}"),
            "downloading"
        );
    }

    fn retrying(&self, name: &str, attempt: u32, delay: Duration, error: &(dyn Error + 'static)) {
        tracing::warn!(
            component = name,
            attempt,
            retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            error = %crate::ErrorChain(error),
            "download attempt failed, retrying"
        );
    }

    fn finished(&self, name: &str, bytes: u64, elapsed: Duration) {
        *self.window() = None;
        let rate = megabytes_per_second(bytes, elapsed);
        tracing::info!(
            component = name,
            bytes,
            elapsed_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
            mb_per_s = format_args!("{rate:.1}"),
            "download verified"
        );
    }
}
