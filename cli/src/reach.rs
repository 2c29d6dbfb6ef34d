//! Reaching a node that may still be booting: one place for the retry rule
//! every command that connects to a node follows.

use std::future::Future;
use std::time::{Duration, Instant};

use keel_atls::ConnectError;

/// The longest pause between two attempts.
const MAX_PAUSE: Duration = Duration::from_secs(10);

/// Runs `attempt` until it succeeds, fails for any reason other than the
/// node being unreachable (a refused attestation is never retried), or the
/// next attempt would start after `wait`. Pauses double from 1 s up to
/// [`MAX_PAUSE`]; each retry is announced on stderr with its reason.
pub(crate) async fn until_reachable<T, F, Fut>(
    wait: Duration,
    mut attempt: F,
) -> Result<T, ConnectError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ConnectError>>,
{
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_secs(1);
    loop {
        match attempt().await {
            Err(e) if e.is_unreachable() && Instant::now() + pause < deadline => {
                eprintln!(
                    "the node is not reachable yet ({}); retrying in {} s",
                    keel_atls::ErrorChain(&e),
                    pause.as_secs()
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
            outcome => return outcome,
        }
    }
}
