//! Quotes: the SHA-256 PCRs signed by the attestation key over
//! caller-chosen qualifying data.

use keel_verifier::measurement::Digest32;
use tss_esapi::structures::{Data, SignatureScheme};
use tss_esapi::traits::Marshall;

use super::pcr::sha256_selection;
use super::{Tpm, TpmError};

/// A quote and its signature, both marshalled.
#[derive(Clone, Debug)]
pub struct Quote {
    /// TPMS_ATTEST.
    pub attest: Vec<u8>,
    /// TPMT_SIGNATURE.
    pub signature: Vec<u8>,
}

impl Tpm {
    /// Quotes the SHA-256 `pcrs` with the attestation key over `qualifying_data`.
    pub fn quote(&mut self, qualifying_data: &Digest32, pcrs: &[u32]) -> Result<Quote, TpmError> {
        let ak = self.loaded_ak(TpmError::Quote)?;
        let selection = sha256_selection(pcrs, TpmError::Quote)?;
        let data = Data::try_from(qualifying_data.to_vec()).map_err(TpmError::Quote)?;
        let (attest, signature) = self
            .with_empty_password(|c| c.quote(ak, data, SignatureScheme::Null, selection))
            .map_err(TpmError::Quote)?;
        Ok(Quote {
            attest: attest.marshall().map_err(|source| TpmError::Marshal {
                what: "quote",
                source,
            })?,
            signature: signature.marshall().map_err(|source| TpmError::Marshal {
                what: "signature",
                source,
            })?,
        })
    }
}
