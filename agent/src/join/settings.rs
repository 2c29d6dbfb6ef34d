//! The join client's settings: where it asks, whom it trusts, and how it
//! waits between rounds.

use std::time::Duration;

use keel_verifier::config::NodeConfig;
use keel_verifier::ek::EkTrust;
use rand::Rng as _;

use super::client::JoinError;

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
}

/// The join client's settings.
#[derive(Clone, Debug)]
pub struct JoinSettings {
    /// Join service endpoints (`host:port`), tried in turn.
    pub endpoints: Vec<String>,
    /// The CAs trusted to issue the join service's EK certificate.
    pub ek_trust: EkTrust,
    /// Pauses between rounds of attempts.
    pub backoff: Backoff,
    /// Bound of each connection and call.
    pub timeout: Duration,
}

impl JoinSettings {
    /// The settings of a node: endpoints and EK CA from its measured config.
    pub fn from_config(config: &NodeConfig) -> Result<Self, JoinError> {
        Ok(Self {
            endpoints: config.cluster.control_plane_endpoints.clone(),
            ek_trust: EkTrust::from_pem(config.cluster.ek_ca_pem.as_bytes())
                .map_err(|_| JoinError::NoEkCa)?,
            backoff: Backoff::default(),
            timeout: Duration::from_secs(30),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
}
