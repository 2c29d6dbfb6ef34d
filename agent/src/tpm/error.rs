//! [`TpmError`]: what every TPM operation fails with.

/// A TPM operation that failed; each variant names the operation and keeps
/// the TSS error as its source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TpmError {
    /// The TCTI string could not be parsed.
    #[error("invalid TCTI {tcti:?}")]
    Tcti {
        /// The TCTI string.
        tcti: String,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
    /// The TCTI names a device node that does not exist: the machine has
    /// no TPM 2.0 (or its driver is not loaded). Waiting does not help.
    #[error(
        "no TPM 2.0 device at {path}: a keel node measures its config into a TPM and \
         attests with it, and cannot run without one; give the machine a TPM 2.0 \
         device (QEMU: a swtpm `-tpmdev emulator` with `-device tpm-tis`)"
    )]
    NoDevice {
        /// The device path the TCTI names.
        path: String,
    },
    /// The TPM could not be opened.
    #[error("cannot open TPM through {tcti:?}")]
    Open {
        /// The TCTI string.
        tcti: String,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
    /// A PCR index outside 0..=23.
    #[error("PCR {0} does not exist (0 to 23)")]
    NoSuchPcr(u32),
    /// Reading PCRs failed.
    #[error("reading PCRs failed")]
    PcrRead(#[source] tss_esapi::Error),
    /// Extending a PCR failed.
    #[error("extending PCR {pcr} failed")]
    PcrExtend {
        /// The PCR.
        pcr: u32,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
    /// Loading or creating the endorsement key failed.
    #[error("endorsement key unavailable")]
    EndorsementKey(#[source] tss_esapi::Error),
    /// Reading the EK certificate's NV index failed (a TPM without the
    /// index is not an error: it has no certificate).
    #[error("reading the EK certificate failed")]
    EkCertificate(#[source] tss_esapi::Error),
    /// Creating or loading the attestation key failed.
    #[error("creating the attestation key failed")]
    AttestationKey(#[source] tss_esapi::Error),
    /// The quote command failed.
    #[error("quote failed")]
    Quote(#[source] tss_esapi::Error),
    /// ActivateCredential failed: the credential was not made for this
    /// TPM's EK and AK, or the TPM failed (the source says which).
    #[error("credential activation failed")]
    ActivateCredential(#[source] tss_esapi::Error),
    /// Reading the TPM's properties (TPM2_GetCapability) failed.
    #[error("reading TPM properties failed")]
    Properties(#[source] tss_esapi::Error),
    /// TPM2_Shutdown failed.
    #[error("TPM2_Shutdown failed")]
    Shutdown(#[source] tss_esapi::Error),
    /// The TPM was shut down with [`Tpm::shutdown`](super::Tpm::shutdown); it takes no more commands
    /// through this handle.
    #[error("the TPM was shut down")]
    ShutDown,
    /// Reading an NV index failed.
    #[error("reading NV index {index:#010x} failed")]
    NvRead {
        /// The index.
        index: u32,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
    /// An NV index holds more than [`MAX_NV_BYTES`](super::nv::MAX_NV_BYTES).
    #[error(
        "NV index {index:#010x} holds {actual} bytes, more than {}",
        super::nv::MAX_NV_BYTES
    )]
    NvTooLarge {
        /// The index.
        index: u32,
        /// Its size.
        actual: usize,
    },
    /// A structure could not be marshalled or converted.
    #[error("marshalling {what} failed")]
    Marshal {
        /// What was marshalled.
        what: &'static str,
        /// The cause.
        #[source]
        source: tss_esapi::Error,
    },
}
