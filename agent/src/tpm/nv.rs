//! Reading NV indices: Azure's paravisor writes its HCL report (the SNP
//! report that binds the vTPM's attestation key) to [`HCL_REPORT_INDEX`].

use tss_esapi::abstraction::nv;
use tss_esapi::handles::NvIndexTpmHandle;
use tss_esapi::interface_types::resource_handles::NvAuth;

use super::{Tpm, TpmError};

/// The NV index of Azure's HCL report.
pub const HCL_REPORT_INDEX: u32 = 0x0140_0001;
/// Largest NV index content read (an HCL report is a few KiB; a TPM's own
/// limit on an index is smaller still).
pub const MAX_NV_BYTES: usize = 16 * 1024;

impl Tpm {
    /// Reads the whole of NV index `index` with owner authorisation (empty
    /// owner auth, as on a cloud vTPM), in chunks the TPM accepts.
    pub fn nv_read(&mut self, index: u32) -> Result<Vec<u8>, TpmError> {
        self.live()?;
        let handle =
            NvIndexTpmHandle::new(index).map_err(|source| TpmError::NvRead { index, source })?;
        let bytes = self
            .ctx
            .execute_with_nullauth_session(|c| nv::read_full(c, NvAuth::Owner, handle))
            .map_err(|source| TpmError::NvRead { index, source })?;
        if bytes.len() > MAX_NV_BYTES {
            return Err(TpmError::NvTooLarge {
                index,
                actual: bytes.len(),
            });
        }
        Ok(bytes)
    }
}
