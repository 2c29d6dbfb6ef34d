//! The node side: an attestation document from the TPM and the event log.

use keel_proto::attestation::{AttestationDocument, MeasurementEvent, PcrValue};
use keel_verifier::cpu::binding::report_data;
use keel_verifier::quote::qualifying_data;
use prost::Message;

use crate::measured::SharedTpm;
use crate::tpm::TpmError;

/// PCRs every document quotes: the boot chain (0-7), the UKI and kernel
/// (4, 9, 11), the agent's own (12, 13, 15) and the rest of the static
/// range, so verifiers can log what they do not enforce.
pub const QUOTED_PCRS: [u32; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

/// Issuing failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IssueError {
    /// The TPM failed.
    #[error("attestation: TPM operation failed")]
    Tpm(#[from] TpmError),
    /// Another task panicked while holding the TPM.
    #[error("attestation: the TPM handle is poisoned")]
    Poisoned,
    /// The CPU evidence could not be obtained.
    #[error("attestation: CPU evidence unavailable")]
    Cpu(#[from] super::cpu::CpuReportError),
}

/// Makes attestation documents for a node.
#[derive(Clone)]
pub struct TpmIssuer {
    tpm: SharedTpm,
}

impl TpmIssuer {
    /// An issuer over the node's measured TPM.
    pub fn new(tpm: SharedTpm) -> Self {
        Self { tpm }
    }

    /// Quotes [`QUOTED_PCRS`] over `nonce` and `user_data` and returns the
    /// encoded document, with the CPU's evidence over `nonce` and the AK
    /// when the node has a CPU reporter. Blocks on the TPM.
    pub fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, IssueError> {
        let mut guard = self.tpm.lock().map_err(|_| IssueError::Poisoned)?;
        let measured = &mut *guard;
        let event_log = measured
            .events()
            .iter()
            .map(|e| MeasurementEvent {
                pcr: e.pcr,
                digest: e.digest.to_vec(),
                event_type: e.event_type.as_str().into(),
                description: e.description.clone(),
                data: e.data.clone(),
                seq: e.seq,
            })
            .collect();
        let tpm = measured.tpm();
        let endorsement = tpm.endorsement()?;
        let ak_public = tpm.attestation_key()?;
        let quote = tpm.quote(&qualifying_data(nonce, user_data), &QUOTED_PCRS)?;
        let cpu_evidence = match measured.cpu_reporter() {
            Some(cpu) => Some(cpu.report(&report_data(nonce, &ak_public), measured.tpm())?),
            None => None,
        };
        let tpm = measured.tpm();
        let pcrs = tpm
            .pcr_read(&QUOTED_PCRS)?
            .into_iter()
            .map(|(index, digest)| PcrValue {
                index,
                digest: digest.to_vec(),
            })
            .collect();
        let doc = AttestationDocument {
            ak_public,
            ek_public: endorsement.public,
            ek_certificate: endorsement.certificate.unwrap_or_default(),
            quote: quote.attest,
            signature: quote.signature,
            pcrs,
            event_log,
            user_data: user_data.to_vec(),
            cpu_evidence,
            image_measurements: measured.image().cloned(),
        };
        Ok(doc.encode_to_vec())
    }
}

impl keel_atls::Issuer for TpmIssuer {
    fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, keel_atls::IssueError> {
        TpmIssuer::issue(self, nonce, user_data).map_err(keel_atls::IssueError::new)
    }

    fn answer(
        &self,
        challenge: &[u8],
    ) -> Result<keel_atls::ResidencySecret, keel_atls::IssueError> {
        let mut guard = self
            .tpm
            .lock()
            .map_err(|_| keel_atls::IssueError::new(IssueError::Poisoned))?;
        super::credential::answer_residency(guard.tpm(), challenge)
            .map_err(keel_atls::IssueError::new)
    }
}
