//! Reaching a node that may still be booting: one place for the retry rule
//! every command that connects to a node follows.

use std::future::Future;
use std::time::{Duration, Instant};

use keel_atls::ConnectError;

/// The longest pause between two attempts at an unreachable node.
const MAX_PAUSE: Duration = Duration::from_secs(10);
/// How long a busy node is asked again at least, whatever the wait for an
/// unreachable one: a node answers only so many key residency challenges
/// for a while, and past that bound it takes the addresses that ask in
/// turn, this one's turn coming after those that asked before it.
const BUSY_WAIT: Duration = Duration::from_secs(120);
/// The longest pause between two attempts at a busy node, well within the
/// 30 s for which the node keeps this address's turn after it last asked.
const BUSY_MAX_PAUSE: Duration = Duration::from_secs(4);

/// Runs `attempt` until it succeeds, fails for any reason other than the
/// node being unreachable or busy (a refused attestation is never
/// retried), or the next attempt would start after `wait` (unreachable)
/// or after `wait` and at least [`BUSY_WAIT`] (busy). Pauses double from
/// 1 s up to [`MAX_PAUSE`], for a busy node up to [`BUSY_MAX_PAUSE`]; each
/// retry is announced on stderr with the node's `endpoint` and the reason,
/// and so is giving up on a node that stayed busy.
pub(crate) async fn until_reachable<T, F, Fut>(
    endpoint: &str,
    wait: Duration,
    attempt: F,
) -> Result<T, ConnectError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ConnectError>>,
{
    Retry {
        wait,
        busy_wait: wait.max(BUSY_WAIT),
        first_pause: Duration::from_secs(1),
        max_pause: MAX_PAUSE,
        busy_max_pause: BUSY_MAX_PAUSE,
    }
    .run(endpoint, attempt)
    .await
}

/// When to try again, and for how long.
struct Retry {
    /// How long an unreachable node is tried again.
    wait: Duration,
    /// How long a busy node is tried again.
    busy_wait: Duration,
    first_pause: Duration,
    max_pause: Duration,
    busy_max_pause: Duration,
}

/// Pauses that double from a first one up to a cap.
struct Backoff(Duration);

impl Backoff {
    /// The next pause, at most `cap`.
    fn next(&mut self, cap: Duration) -> Duration {
        let pause = self.0.min(cap);
        self.0 = (pause * 2).min(cap);
        pause
    }
}

impl Retry {
    async fn run<T, F, Fut>(&self, endpoint: &str, attempt: F) -> Result<T, ConnectError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ConnectError>>,
    {
        self.run_saying(endpoint, attempt, |line| eprintln!("{line}"))
            .await
    }

    /// [`Retry::run`], each announcement given to `say`.
    async fn run_saying<T, F, Fut>(
        &self,
        endpoint: &str,
        mut attempt: F,
        mut say: impl FnMut(String),
    ) -> Result<T, ConnectError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ConnectError>>,
    {
        let endpoint = crate::printable::printable(endpoint);
        let start = Instant::now();
        let mut unreachable = Backoff(self.first_pause);
        let mut busy = Backoff(self.first_pause);
        loop {
            let e = match attempt().await {
                Ok(value) => return Ok(value),
                Err(e) => e,
            };
            let pause = if e.is_busy() {
                let pause = busy.next(self.busy_max_pause);
                if start.elapsed() + pause >= self.busy_wait {
                    say(format!(
                        "{endpoint}: the node stayed busy for {} s: it answers only so many key \
                         residency challenges for a while (someone may be flooding its port); \
                         this says nothing against its attestation. Try again later",
                        start.elapsed().as_secs()
                    ));
                    return Err(e);
                }
                say(format!(
                    "{endpoint}: the node is busy ({}); retrying in {} s",
                    keel_atls::ErrorChain(&e),
                    pause.as_secs()
                ));
                pause
            } else if e.is_unreachable() {
                let pause = unreachable.next(self.max_pause);
                if start.elapsed() + pause >= self.wait {
                    return Err(e);
                }
                say(format!(
                    "{endpoint}: the node is not reachable yet ({}); retrying in {} s",
                    keel_atls::ErrorChain(&e),
                    pause.as_secs()
                ));
                pause
            } else {
                return Err(e);
            };
            tokio::time::sleep(pause).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use keel_atls::ResidencyError;

    use super::*;

    /// The CLI's schedule, in milliseconds instead of seconds.
    fn quick(wait_ms: u64, busy_wait_ms: u64) -> Retry {
        Retry {
            wait: Duration::from_millis(wait_ms),
            busy_wait: Duration::from_millis(busy_wait_ms),
            first_pause: Duration::from_millis(1),
            max_pause: Duration::from_millis(10),
            busy_max_pause: Duration::from_millis(4),
        }
    }

    fn busy() -> ConnectError {
        ConnectError::Residency(ResidencyError::Busy)
    }

    /// An attempt that fails with `errors` in turn, then succeeds; counts
    /// its calls in `calls`.
    fn failing<'a>(
        calls: &'a Cell<usize>,
        errors: impl Fn(usize) -> Option<ConnectError> + 'a,
    ) -> impl FnMut() -> std::future::Ready<Result<usize, ConnectError>> + 'a {
        move || {
            let n = calls.get();
            calls.set(n + 1);
            std::future::ready(errors(n).map_or(Ok(n), Err))
        }
    }

    #[tokio::test]
    async fn a_busy_node_is_asked_again_even_without_a_wait() {
        let calls = Cell::new(0);
        let outcome = quick(0, 1000)
            .run("n:9000", failing(&calls, |n| (n < 3).then(busy)))
            .await;
        assert_eq!(outcome.unwrap(), 3);
    }

    #[tokio::test]
    async fn a_node_that_stays_busy_is_given_up_on_as_busy() {
        let calls = Cell::new(0);
        let started = Instant::now();
        let outcome = quick(0, 100)
            .run("n:9000", failing(&calls, |_| Some(busy())))
            .await;
        let e = outcome.unwrap_err();
        assert!(e.is_busy(), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(1));
        // Pauses of 1, 2 and then 4 ms within 100 ms.
        assert!((5..=100).contains(&calls.get()), "{} attempts", calls.get());
    }

    #[tokio::test]
    async fn a_node_that_did_not_answer_is_not_asked_again() {
        let calls = Cell::new(0);
        let outcome = quick(1000, 1000)
            .run(
                "n:9000",
                failing(&calls, |_| {
                    Some(ConnectError::Residency(ResidencyError::NoAnswer))
                }),
            )
            .await;
        assert!(!outcome.unwrap_err().is_busy());
        assert_eq!(calls.get(), 1);
    }

    #[tokio::test]
    async fn an_unreachable_node_is_asked_again_within_the_wait() {
        let calls = Cell::new(0);
        let timeout = || ConnectError::Timeout(Duration::from_secs(10));
        let outcome = quick(1000, 1000)
            .run("n:9000", failing(&calls, |n| (n < 2).then(timeout)))
            .await;
        assert_eq!(outcome.unwrap(), 2);
        let calls = Cell::new(0);
        let outcome = quick(0, 1000)
            .run("n:9000", failing(&calls, |_| Some(timeout())))
            .await;
        assert!(outcome.is_err());
        assert_eq!(calls.get(), 1, "no wait, no retry");
    }

    /// A command may reach several nodes: each line about one names it.
    #[tokio::test]
    async fn each_retry_names_the_node() {
        let calls = Cell::new(0);
        let mut said = Vec::new();
        let timeout = || ConnectError::Timeout(Duration::from_secs(10));
        let outcome = quick(1000, 1000)
            .run_saying(
                "cp-1:9000",
                failing(&calls, |n| match n {
                    0 => Some(timeout()),
                    1 => Some(busy()),
                    _ => None,
                }),
                |line| said.push(line),
            )
            .await;
        assert_eq!(outcome.unwrap(), 2);
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(
            said[0].starts_with("cp-1:9000: the node is not reachable yet ("),
            "{said:?}"
        );
        assert!(
            said[1].starts_with("cp-1:9000: the node is busy ("),
            "{said:?}"
        );
        said.clear();
        let outcome = quick(0, 10)
            .run_saying("cp-2:9000", failing(&calls, |_| Some(busy())), |line| {
                said.push(line)
            })
            .await;
        assert!(outcome.is_err());
        assert!(
            said.last()
                .unwrap()
                .starts_with("cp-2:9000: the node stayed busy"),
            "{said:?}"
        );
    }
}
