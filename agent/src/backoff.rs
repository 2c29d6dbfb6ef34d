//! Capped exponential backoff with jitter, and the one loop that tries a
//! task again with it until it succeeds.

use std::future::Future;
use std::time::Duration;

use rand::Rng as _;

/// Capped exponential backoff with jitter.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    /// Pause after the first failure.
    pub initial: Duration,
    /// Longest pause.
    pub max: Duration,
}

impl Default for Backoff {
    /// 1 s, doubling, capped at 30 s.
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// The pause after failure number `attempt` (from 0): uniformly drawn
    /// from the upper half of `min(max, initial * 2^attempt)`, so clients
    /// that failed together spread out.
    pub fn delay(&self, attempt: u32) -> Duration {
        let full = self
            .initial
            .saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
            .min(self.max);
        let half = full / 2;
        half + rand::thread_rng().gen_range(Duration::ZERO..=half)
    }

    /// Runs `attempt` until it succeeds and returns what it made. Each
    /// failure is logged as `what` failing, then paused on as
    /// [`Backoff::delay`] says, counting the failures since the last
    /// attempt that ran longer than the longest pause: a service that
    /// served for a while before it failed is set up again after a short
    /// pause, not the longest.
    pub async fn retry<T, F, Fut>(&self, what: &str, mut attempt: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = anyhow::Result<T>>,
    {
        let mut failures = 0u32;
        loop {
            let started = tokio::time::Instant::now();
            match attempt().await {
                Ok(made) => return made,
                Err(e) => {
                    if started.elapsed() > self.max {
                        failures = 0;
                    }
                    let pause = self.delay(failures);
                    tracing::error!(
                        error = format!("{e:#}"),
                        retry_in = ?pause,
                        "{what} failed; trying again"
                    );
                    tokio::time::sleep(pause).await;
                    failures = failures.saturating_add(1);
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tokio::time::Instant;

    #[test]
    fn backoff_is_capped_and_jittered() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
        };
        for attempt in 0..64 {
            let full = (Duration::from_millis(100) * 2u32.saturating_pow(attempt.min(20)))
                .min(Duration::from_secs(2));
            let d = b.delay(attempt);
            assert!(d >= full / 2 && d <= full, "{attempt}: {d:?}");
        }
        let draws: std::collections::BTreeSet<_> = (0..20).map(|_| b.delay(10)).collect();
        assert!(draws.len() > 1, "no jitter");
    }

    /// Runs `Backoff::retry` with attempts that last and fail as `run`
    /// says (given the attempt's number, from 1); returns the attempts'
    /// start times since the first and what the loop returned.
    async fn attempts(
        backoff: Backoff,
        run: impl Fn(usize) -> (Duration, bool),
    ) -> (Vec<Duration>, usize) {
        let start = Instant::now();
        let starts = Mutex::new(Vec::new());
        let made = backoff
            .retry("the test task", || {
                let n = {
                    let mut starts = starts.lock().unwrap();
                    starts.push(start.elapsed());
                    starts.len()
                };
                let (lasts, fails) = run(n);
                async move {
                    tokio::time::sleep(lasts).await;
                    if fails {
                        anyhow::bail!("attempt {n} failed");
                    }
                    Ok(n)
                }
            })
            .await;
        (starts.into_inner().unwrap(), made)
    }

    /// Failures are tried again after pauses in 0.5-1, 1-2, 2-4 s …; what
    /// the attempt that succeeded made is returned.
    #[tokio::test(start_paused = true)]
    async fn failures_are_tried_again_with_growing_pauses() {
        let (starts, made) = attempts(Backoff::default(), |n| (Duration::ZERO, n < 4)).await;
        assert_eq!(made, 4);
        let gaps: Vec<_> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(gaps.len(), 3, "{gaps:?}");
        for (gap, low_ms) in gaps.iter().zip([500, 1000, 2000]) {
            let low = Duration::from_millis(low_ms);
            assert!((low..=low * 2).contains(gap), "{gaps:?}");
        }
    }

    /// Past the cap the pauses stop growing; an attempt that ran longer
    /// than the cap before it failed starts them over.
    #[tokio::test(start_paused = true)]
    async fn pauses_are_capped_and_start_over_after_a_long_run() {
        let backoff = Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(8),
        };
        // Attempts 1-6 fail at once, 7 serves 100 s and fails, 8 fails at
        // once, 9 succeeds.
        let (starts, made) = attempts(backoff, |n| match n {
            7 => (Duration::from_secs(100), true),
            n => (Duration::ZERO, n < 9),
        })
        .await;
        assert_eq!(made, 9);
        let gaps: Vec<_> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        // Pauses after attempts 1-6: from 0.5-1 s up to the cap's 4-8 s.
        for (gap, full_s) in gaps[..6].iter().zip([1, 2, 4, 8, 8, 8]) {
            let full = Duration::from_secs(full_s);
            assert!((full / 2..=full).contains(gap), "{gaps:?}");
        }
        // Attempt 7's 100 s, then a first pause again.
        let after_long = gaps[6] - Duration::from_secs(100);
        assert!(
            (Duration::from_millis(500)..=Duration::from_secs(1)).contains(&after_long),
            "{gaps:?}"
        );
        // And the second pause after it.
        assert!(
            (Duration::from_secs(1)..=Duration::from_secs(2)).contains(&gaps[7]),
            "{gaps:?}"
        );
    }
}
