//! The node side: an attestation document from the TPM and the event log.
//!
//! Documents are issued in batches ([`keel_verifier::batch`]): requests that
//! arrive while the TPM is quoting for others wait, and the next quote
//! covers all of them (at most [`MAX_LEAVES`]), over the root of a hash tree
//! of their (nonce, user data) leaves; each document carries its own leaf's
//! inclusion path. A request that finds the TPM idle is quoted at once, in a
//! batch of one. The CPU evidence and the event log are made once per batch
//! too, so a handshake costs the TPM one quote only when it arrives alone.
//! The PCR values are read only when the quote's PCR digest shows they
//! changed since the last read: usually a batch is one TPM command.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use keel_proto::attestation::{AttestationDocument, MeasurementEvent, PcrValue};
use keel_verifier::batch::{self, Tree, MAX_LEAVES};
use keel_verifier::cpu::binding::report_data;
use keel_verifier::measurement::Digest32;
use keel_verifier::quote::{pcr_digest, qualifying_data};
use keel_verifier::tpm_wire::QuoteInfo;
use prost::Message;

use crate::batching::{BatchError, BatchStats, Batcher};
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
    /// The batch could not be arranged into a tree.
    #[error("attestation: quote batch")]
    Tree(#[from] keel_verifier::batch::BatchError),
    /// The TPM's quote does not parse.
    #[error("attestation: the TPM's quote does not parse")]
    Quote(#[from] keel_verifier::tpm_wire::WireError),
    /// The quote of the batch this request was part of failed.
    #[error("attestation: the quote of this request's batch failed")]
    Batch(#[source] BatchError<IssueError>),
}

/// One quote and what every document of its batch shares.
struct QuotedBatch {
    tree: Tree,
    /// The encoded document without the per-request fields (user data,
    /// leaf index, path): protobuf fields concatenate, so each request's
    /// document is this followed by its own fields.
    shared: Vec<u8>,
}

/// A request's place in a quoted batch.
#[derive(Clone)]
struct Included {
    batch: Arc<QuotedBatch>,
    index: usize,
}

/// Makes attestation documents for a node. Clones share one batch queue;
/// separate issuers over one TPM take turns at its lock.
#[derive(Clone)]
pub struct TpmIssuer {
    tpm: SharedTpm,
    batches: Arc<Batcher<Digest32, Included, IssueError>>,
}

impl TpmIssuer {
    /// An issuer over the node's measured TPM.
    pub fn new(tpm: SharedTpm) -> Self {
        let quoting = tpm.clone();
        let pcrs = PcrCache::default();
        let batches = Batcher::new(MAX_LEAVES, move |leaves: Vec<Digest32>| {
            let n = leaves.len();
            let batch = Arc::new(quote_batch(&quoting, &pcrs, Tree::new(&leaves)?)?);
            Ok((0..n)
                .map(|index| Included {
                    batch: batch.clone(),
                    index,
                })
                .collect())
        });
        Self {
            tpm,
            batches: Arc::new(batches),
        }
    }

    /// A document over `nonce` and `user_data`: a quote of [`QUOTED_PCRS`]
    /// over the root of this request's batch, with the CPU's evidence over
    /// that root and the AK when the node has a CPU reporter, and this
    /// request's inclusion path. Blocks on the TPM (and on the batch ahead
    /// of this one, if any).
    pub fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, IssueError> {
        let _span = tracing::debug_span!("attest.issue").entered();
        let included = self
            .batches
            .submit(batch::leaf(nonce, user_data)?)
            .map_err(IssueError::Batch)?;
        let path = included
            .batch
            .tree
            .path(included.index)
            .ok_or(IssueError::Batch(BatchError::Abandoned))?;
        let own = AttestationDocument {
            user_data: user_data.to_vec(),
            quote_batch_index: path.index(),
            quote_batch_path: path.siblings().iter().map(|s| s.to_vec()).collect(),
            ..AttestationDocument::default()
        };
        let mut document = included.batch.shared.clone();
        document.extend_from_slice(&own.encode_to_vec());
        Ok(document)
    }

    /// How many quotes this issuer made for how many documents.
    pub fn stats(&self) -> BatchStats {
        self.batches.stats()
    }

    /// Requests waiting for the next quote.
    pub fn waiting(&self) -> usize {
        self.batches.waiting()
    }
}

/// The PCR values last read, to ship with a quote whose PCR digest they
/// match without reading them again.
#[derive(Default)]
struct PcrCache(Mutex<Option<BTreeMap<u32, Digest32>>>);

impl PcrCache {
    /// The values the quote `attest` covers: the cached ones if they hash
    /// to its PCR digest, else read from `tpm` (and cached).
    fn values(
        &self,
        attest: &[u8],
        tpm: &mut crate::tpm::Tpm,
    ) -> Result<BTreeMap<u32, Digest32>, IssueError> {
        let quoted = QuoteInfo::parse(attest)?;
        let mut cached = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(values) = cached.as_ref() {
            if pcr_digest(values).as_slice() == quoted.pcr_digest.as_slice() {
                return Ok(values.clone());
            }
        }
        let values = tpm.pcr_read(&QUOTED_PCRS)?;
        *cached = Some(values.clone());
        Ok(values)
    }
}

/// Quotes the batch `tree` under the TPM lock; with the PCR values, the
/// event log and the CPU evidence taken under the same lock, so they agree
/// with the quote (PCR values that the quote's digest shows unchanged come
/// from `pcrs`).
fn quote_batch(tpm: &SharedTpm, pcrs: &PcrCache, tree: Tree) -> Result<QuotedBatch, IssueError> {
    let _span = tracing::debug_span!("attest.quote", leaves = tree.len()).entered();
    let root = tree.root();
    let mut guard = tpm.lock().map_err(|_| IssueError::Poisoned)?;
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
    let quote = tpm.quote(&qualifying_data(&root), &QUOTED_PCRS)?;
    let cpu_evidence = match measured.cpu_reporter() {
        Some(cpu) => Some(cpu.report(&report_data(&root, &ak_public), measured.tpm())?),
        None => None,
    };
    let image_measurements = measured.image().cloned();
    let pcrs = pcrs
        .values(&quote.attest, measured.tpm())?
        .into_iter()
        .map(|(index, digest)| PcrValue {
            index,
            digest: digest.to_vec(),
        })
        .collect();
    drop(guard);
    let shared = AttestationDocument {
        ak_public,
        ek_public: endorsement.public,
        ek_certificate: endorsement.certificate.unwrap_or_default(),
        quote: quote.attest,
        signature: quote.signature,
        pcrs,
        event_log,
        cpu_evidence,
        image_measurements,
        ..AttestationDocument::default()
    }
    .encode_to_vec();
    Ok(QuotedBatch { tree, shared })
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
