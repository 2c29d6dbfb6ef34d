//! The PCRs: reading and extending the SHA-256 bank, and the mapping from a
//! PCR number to the TSS slot and handle types.

use std::collections::BTreeMap;

use keel_verifier::measurement::Digest32;
use tss_esapi::handles::PcrHandle;
use tss_esapi::interface_types::algorithm::HashingAlgorithm;
use tss_esapi::structures::{Digest, DigestValues, PcrSelectionList, PcrSlot};

use super::{wrapper_error, Tpm, TpmError};

/// Number of PCRs in a bank.
pub const PCR_COUNT: u32 = 24;
/// The TPM returns at most 8 digests per PCR_Read.
const PCRS_PER_READ: usize = 8;

impl Tpm {
    /// Reads SHA-256 PCR values.
    pub fn pcr_read(&mut self, pcrs: &[u32]) -> Result<BTreeMap<u32, Digest32>, TpmError> {
        self.live()?;
        let mut out = BTreeMap::new();
        let mut wanted: Vec<u32> = pcrs.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        for chunk in wanted.chunks(PCRS_PER_READ) {
            let selection = sha256_selection(chunk, TpmError::PcrRead)?;
            let (_, _, digests) = self
                .ctx
                .execute_without_session(|c| c.pcr_read(selection))
                .map_err(TpmError::PcrRead)?;
            // The TPM returns the selected PCRs in ascending order.
            for (&pcr, digest) in chunk.iter().zip(digests.value()) {
                let mut value = [0u8; 32];
                if digest.len() != 32 {
                    return Err(TpmError::PcrRead(wrapper_error(
                        tss_esapi::WrapperErrorKind::WrongValueFromTpm,
                    )));
                }
                value.copy_from_slice(digest.value());
                out.insert(pcr, value);
            }
        }
        Ok(out)
    }

    /// Reads all 24 SHA-256 PCRs.
    pub fn pcr_read_all(&mut self) -> Result<BTreeMap<u32, Digest32>, TpmError> {
        let all: Vec<u32> = (0..PCR_COUNT).collect();
        self.pcr_read(&all)
    }

    /// Extends `pcr` of the SHA-256 bank with `digest`.
    pub fn pcr_extend(&mut self, pcr: u32, digest: &Digest32) -> Result<(), TpmError> {
        self.live()?;
        let handle = pcr_handle(pcr)?;
        let err = |source| TpmError::PcrExtend { pcr, source };
        let mut values = DigestValues::new();
        values.set(
            HashingAlgorithm::Sha256,
            Digest::try_from(digest.to_vec()).map_err(err)?,
        );
        self.with_empty_password(|c| c.pcr_extend(handle, values))
            .map_err(err)
    }
}

pub(super) fn pcr_slot(pcr: u32) -> Result<PcrSlot, TpmError> {
    if pcr >= PCR_COUNT {
        return Err(TpmError::NoSuchPcr(pcr));
    }
    PcrSlot::try_from(1u32 << pcr).map_err(|_| TpmError::NoSuchPcr(pcr))
}

fn pcr_handle(pcr: u32) -> Result<PcrHandle, TpmError> {
    const HANDLES: [PcrHandle; PCR_COUNT as usize] = [
        PcrHandle::Pcr0,
        PcrHandle::Pcr1,
        PcrHandle::Pcr2,
        PcrHandle::Pcr3,
        PcrHandle::Pcr4,
        PcrHandle::Pcr5,
        PcrHandle::Pcr6,
        PcrHandle::Pcr7,
        PcrHandle::Pcr8,
        PcrHandle::Pcr9,
        PcrHandle::Pcr10,
        PcrHandle::Pcr11,
        PcrHandle::Pcr12,
        PcrHandle::Pcr13,
        PcrHandle::Pcr14,
        PcrHandle::Pcr15,
        PcrHandle::Pcr16,
        PcrHandle::Pcr17,
        PcrHandle::Pcr18,
        PcrHandle::Pcr19,
        PcrHandle::Pcr20,
        PcrHandle::Pcr21,
        PcrHandle::Pcr22,
        PcrHandle::Pcr23,
    ];
    HANDLES
        .get(pcr as usize)
        .copied()
        .ok_or(TpmError::NoSuchPcr(pcr))
}

/// The SHA-256 bank's selection of `pcrs`; `error` names the operation.
pub(super) fn sha256_selection(
    pcrs: &[u32],
    error: fn(tss_esapi::Error) -> TpmError,
) -> Result<PcrSelectionList, TpmError> {
    let slots = pcrs
        .iter()
        .map(|&p| pcr_slot(p))
        .collect::<Result<Vec<_>, _>>()?;
    PcrSelectionList::builder()
        .with_selection(HashingAlgorithm::Sha256, &slots)
        .build()
        .map_err(error)
}
