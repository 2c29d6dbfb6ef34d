//! The join client's settings: where it asks, whom it trusts (the join
//! service's validator, from this node's own PCRs), and how it waits
//! between rounds.

use std::sync::Arc;
use std::time::Duration;

use keel_verifier::config::NodeConfig;
use keel_verifier::cpu::CpuTrust;
use keel_verifier::ek::EkTrust;

use keel_verifier::measurement::pcr;
use keel_verifier::measurements::{Expected, Measurements, MeasurementsError};
use keel_verifier::signature::SigningPublicKey;
use keel_verifier::validator::Validator;

use crate::backoff::Backoff;

use crate::attestation::policy::cpu_trust;
use crate::measured::SharedTpm;
use crate::tpm::TpmError;

/// PCRs the join service must share with this node: the boot chain the
/// image predicts and the cluster config; and the firmware's drivers
/// ([`pcr::DRIVER_CODE`]) where this node's firmware ran none
/// ([`shared_expectations`]).
pub const SHARED_PCRS: [u32; 5] = [pcr::DRIVER_CODE, 4, 9, 11, pcr::CONFIG];

/// The longest pause after a round in which every connection was refused
/// at once.
pub const REFUSED_AT_ONCE_MAX_PAUSE: Duration = Duration::from_secs(4);

/// Where a join client is in its rounds of attempts.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Rounds {
    /// Rounds that ended in a failure that cost a service work.
    backed_off: u32,
    /// Rounds in which every connection was refused at once.
    refused_at_once: u32,
}

impl Rounds {
    /// The pause after a round that failed. A round in which every
    /// attempt was refused at once (no route yet while this node's network
    /// comes up, or no service listening yet while a control plane boots)
    /// costs the services nothing, so it backs off on its own short scale,
    /// capped at [`REFUSED_AT_ONCE_MAX_PAUSE`]: the node asks within
    /// seconds of its network or a service coming up, and a long outage
    /// still logs a round only every few seconds. Any other failure backs
    /// off on the settings' scale.
    pub(crate) fn after(&mut self, backoff: &Backoff, refused_at_once: bool) -> Duration {
        let (count, backoff) = if refused_at_once {
            let short = Backoff {
                initial: backoff.initial,
                max: backoff.max.min(REFUSED_AT_ONCE_MAX_PAUSE),
            };
            (&mut self.refused_at_once, short)
        } else {
            (&mut self.backed_off, *backoff)
        };
        let pause = backoff.delay(*count);
        *count = count.saturating_add(1);
        pause
    }
}

/// The join client's settings.
#[derive(Clone, Debug)]
pub struct JoinSettings {
    /// Join service endpoints (`host:port`), tried in turn.
    pub endpoints: Vec<String>,
    /// The CAs trusted to issue the join service's EK certificate.
    pub ek_trust: EkTrust,
    /// The CPU evidence the join service must show (the cluster's variant).
    pub cpu: Arc<CpuTrust>,
    /// The key that signs the measurements of every image of the cluster:
    /// a join service of another image is accepted when it presents its
    /// image's measurements signed with it.
    pub measurements_key: Option<SigningPublicKey>,
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
            cpu: cpu_trust(config).map_err(JoinError::Attestation)?,
            measurements_key: config
                .cluster
                .signing_key()
                .map_err(JoinError::Attestation)?,
            backoff: Backoff::default(),
            timeout: Duration::from_secs(30),
        })
    }
}

/// Why the join client cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The config names no join service endpoint.
    #[error("no control-plane endpoints configured")]
    NoEndpoints,
    /// The config's attestation variant or measurements signing key is
    /// invalid.
    #[error("the attestation settings in the config are invalid")]
    Attestation(#[source] keel_verifier::config::ConfigError),
    /// The config has no usable EK CA, so the join service cannot be verified.
    #[error("no EK CA configured: the join service cannot be verified")]
    NoEkCa,
    /// Reading this node's own PCRs failed.
    #[error("reading this node's PCRs")]
    ReadPcrs(#[source] TpmError),
    /// Another thread panicked while holding the TPM.
    #[error("the TPM handle is poisoned")]
    Poisoned,
    /// This node's own PCRs do not make a set of measurements a join
    /// service can be validated with.
    #[error("this node's PCRs do not make usable measurements")]
    OwnMeasurements(#[source] MeasurementsError),
    /// Making the kubelet key or CSR failed.
    #[error("making the kubelet key")]
    KubeletKey(#[source] rcgen::Error),
}

impl JoinSettings {
    /// The validator of join services these settings imply (see
    /// [`service_validator`]), with the cluster's CPU evidence policy.
    pub fn service_validator(&self, tpm: &SharedTpm) -> Result<Validator, JoinError> {
        Ok(
            service_validator(tpm, self.ek_trust.clone(), self.measurements_key.as_ref())?
                .with_cpu(self.cpu.clone()),
        )
    }
}

/// A validator of join services: EK trust and this node's own PCRs
/// [`SHARED_PCRS`] as enforced values, or, with a measurements signing key,
/// the image measurements signed with it that the service presents and this
/// node's own config PCR (a join service of the image before or after this
/// one, during a rollout). Either way a service whose firmware ran a driver
/// is refused where this node's ran none ([`shared_expectations`]): a
/// signed file need not name PCR 2 (one signed before it was predicted, or
/// for a platform that loads drivers by design). Reads the PCRs from `tpm`.
pub fn service_validator(
    tpm: &SharedTpm,
    ek_trust: EkTrust,
    measurements_key: Option<&SigningPublicKey>,
) -> Result<Validator, JoinError> {
    let own = tpm
        .lock()
        .map_err(|_| JoinError::Poisoned)?
        .tpm()
        .pcr_read(&SHARED_PCRS)
        .map_err(JoinError::ReadPcrs)?;
    let own_config = own.get(&pcr::CONFIG).copied();
    let clean = pcr::no_firmware_drivers();
    let no_drivers = own.get(&pcr::DRIVER_CODE) == Some(&clean);
    let expected = shared_expectations(own).map_err(JoinError::OwnMeasurements)?;
    let validator = Validator::new(expected, ek_trust);
    Ok(match (measurements_key, own_config) {
        (Some(key), Some(config)) => {
            let mut required = vec![(pcr::CONFIG, config)];
            if no_drivers {
                required.push((pcr::DRIVER_CODE, clean));
            }
            validator.with_signed_images(key.clone(), &required)
        }
        _ => validator,
    })
}

/// What a join service must show of this node's own PCRs `own`
/// ([`SHARED_PCRS`]): each enforced, except the firmware's drivers where
/// this node's firmware ran some (a platform that loads them by design,
/// whose value may differ from host to host). Where it ran none, a service
/// whose firmware ran one is refused.
fn shared_expectations(
    own: std::collections::BTreeMap<u32, [u8; 32]>,
) -> Result<Measurements, keel_verifier::measurements::MeasurementsError> {
    let clean = pcr::no_firmware_drivers();
    Measurements::new(
        own.into_iter()
            .filter(|(index, value)| *index != pcr::DRIVER_CODE || *value == clean)
            .map(|(index, value)| (index, Expected::enforced(value))),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_service_shares_the_firmware_drivers_pcr_only_where_this_node_ran_none() {
        let own = |pcr2: [u8; 32]| {
            SHARED_PCRS
                .iter()
                .map(|&i| {
                    (
                        i,
                        if i == pcr::DRIVER_CODE {
                            pcr2
                        } else {
                            [i as u8; 32]
                        },
                    )
                })
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        let clean = shared_expectations(own(pcr::no_firmware_drivers())).unwrap();
        let enforced: Vec<u32> = clean.iter().map(|(i, _)| *i).collect();
        assert_eq!(enforced, [2, 4, 9, 11, 12]);
        // A service whose firmware ran a driver is refused.
        let mut service = own(pcr::no_firmware_drivers());
        service.insert(pcr::DRIVER_CODE, [9; 32]);
        let mismatches = clean.compare(&service);
        assert_eq!(mismatches.len(), 1);
        assert_eq!(mismatches[0].pcr, pcr::DRIVER_CODE);
        // Where this node's own firmware ran drivers, PCR 2 is not shared.
        let drivers = shared_expectations(own([9; 32])).unwrap();
        let enforced: Vec<u32> = drivers.iter().map(|(i, _)| *i).collect();
        assert_eq!(enforced, [4, 9, 11, 12]);
    }

    #[test]
    fn rounds_refused_at_once_back_off_on_a_short_scale_and_others_on_theirs() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(30),
        };
        let mut rounds = Rounds::default();
        let refused: Vec<_> = (0..50).map(|_| rounds.after(&b, true)).collect();
        assert!(refused[0] <= Duration::from_millis(100));
        assert!(refused.iter().all(|p| *p <= REFUSED_AT_ONCE_MAX_PAUSE));
        assert!(refused[49] >= REFUSED_AT_ONCE_MAX_PAUSE / 2);
        // The first failure that cost a service work starts its own
        // backoff from the first step; it grows past the short cap.
        assert!(rounds.after(&b, false) <= Duration::from_millis(100));
        for _ in 0..10 {
            rounds.after(&b, false);
        }
        assert!(rounds.after(&b, false) >= Duration::from_secs(15));
        // A round refused at once in between neither resets it nor waits
        // as long.
        assert!(rounds.after(&b, true) <= REFUSED_AT_ONCE_MAX_PAUSE);
        assert!(rounds.after(&b, false) >= Duration::from_secs(15));
    }
}
