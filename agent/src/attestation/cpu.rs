//! The node side of CPU evidence: asking the CPU for a report that binds
//! the attestation key ([`keel_verifier::cpu::binding`]).
//!
//! * [`ConfigfsTsm`]: Linux's configfs-tsm interface
//!   (`/sys/kernel/config/tsm/report`): a directory made per request, the
//!   64 `report_data` bytes written to `inblob`, the report (SNP) or quote
//!   (TDX) read from `outblob`, the SNP certificate table from `auxblob`;
//!   `privlevel` written first where the config names a VMPL other than 0.
//!   The kernel counts writes in `generation`; unless the count read after
//!   the report moved by exactly this request's own writes, another writer
//!   raced this one, and the report is refused rather than shipped with
//!   someone else's `report_data`.
//! * [`AzureHcl`]: the report Azure's paravisor stores in the vTPM's NV
//!   index 0x01400001.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use keel_proto::attestation::{cpu_evidence, CpuEvidence};
use keel_verifier::cpu::{Variant, MAX_CERTIFICATE_BYTES, MAX_EVIDENCE_BYTES};

use crate::tpm::nv::HCL_REPORT_INDEX;
use crate::tpm::{Tpm, TpmError};

/// Where the kernel's configfs-tsm report interface lives.
pub const CONFIGFS_TSM_ROOT: &str = "/sys/kernel/config/tsm/report";

/// The SNP certificate table's GUID of the VCEK
/// (63da758d-e664-4564-adc5-f4b93be8accd, in its on-the-wire byte order).
const VCEK_GUID: [u8; 16] = [
    0x8d, 0x75, 0xda, 0x63, 0x64, 0xe6, 0x64, 0x45, 0xad, 0xc5, 0xf4, 0xb9, 0x3b, 0xe8, 0xac, 0xcd,
];
/// The VLEK's GUID (a8074bc2-a25a-483e-aae6-39c045a0b8a1).
const VLEK_GUID: [u8; 16] = [
    0xc2, 0x4b, 0x07, 0xa8, 0x5a, 0xa2, 0x3e, 0x48, 0xaa, 0xe6, 0x39, 0xc0, 0x45, 0xa0, 0xb8, 0xa1,
];

/// Getting CPU evidence failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CpuReportError {
    /// A configfs-tsm file could not be used.
    #[error("configfs-tsm {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A blob is larger than the verifier accepts.
    #[error("configfs-tsm {path} is larger than {limit} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The bound.
        limit: usize,
    },
    /// The report comes from another provider than the variant needs.
    #[error("configfs-tsm provider: expected {expected}, actual {actual}")]
    Provider {
        /// What the variant needs.
        expected: &'static str,
        /// What the kernel reports.
        actual: String,
    },
    /// Another writer changed the request while this report was made.
    #[error(
        "configfs-tsm generation went from {before} to {after}, not one write: another writer raced this report"
    )]
    Raced {
        /// Before this request's write.
        before: String,
        /// After reading the report.
        after: String,
    },
    /// `generation` is not a count.
    #[error("configfs-tsm {path} is not a count")]
    Generation {
        /// The file.
        path: PathBuf,
    },
    /// The TPM failed (reading the HCL report).
    #[error("reading the HCL report from the vTPM")]
    Tpm(#[from] TpmError),
}

/// A source of CPU evidence whose `report_data` the caller chooses.
pub trait CpuReporter: Send + Sync {
    /// Evidence that carries `report_data` (or, for a binding made at boot,
    /// the evidence as it is). `tpm` is the node's TPM, held by the caller.
    fn report(&self, report_data: &[u8; 64], tpm: &mut Tpm) -> Result<CpuEvidence, CpuReportError>;
}

/// What one configfs-tsm request returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TsmReport {
    /// The SNP report or TDX quote.
    pub outblob: Vec<u8>,
    /// Auxiliary data (SNP: the certificate table); empty when absent.
    pub auxblob: Vec<u8>,
}

/// The configfs-tsm report interface.
#[derive(Debug, Clone)]
pub struct ConfigfsTsm {
    root: PathBuf,
    provider: &'static str,
    /// The privilege level to request the report at, when not the kernel's
    /// default 0 (SEV-SNP: the VMPL the report names).
    privlevel: Option<u32>,
}

impl ConfigfsTsm {
    /// The interface under `root` for `variant` (`sev-snp` expects the
    /// `sev_guest` provider, `tdx` the `tdx_guest` one); `None` for `vtpm`.
    pub fn new(root: impl Into<PathBuf>, variant: Variant) -> Option<Self> {
        let provider = match variant {
            Variant::SevSnp => "sev_guest",
            Variant::Tdx => "tdx_guest",
            Variant::Vtpm => return None,
        };
        Some(Self {
            root: root.into(),
            provider,
            privlevel: None,
        })
    }

    /// Requests reports at `level` (written to `privlevel` before each
    /// request) instead of the kernel's default 0: a guest that runs above
    /// VMPL 0 (under an SVSM) asks at its own level, which its config names.
    #[must_use]
    pub fn with_privlevel(mut self, level: u32) -> Self {
        self.privlevel = (level != 0).then_some(level);
        self
    }

    /// One request in an existing report directory `entry`: checks the
    /// provider, writes `privlevel` (if not the default) and `inblob`, reads
    /// `outblob` and `auxblob`, and refuses the report unless `generation`
    /// moved by exactly these writes.
    pub fn report_in(
        &self,
        entry: &Path,
        report_data: &[u8; 64],
    ) -> Result<TsmReport, CpuReportError> {
        let provider = read_bounded(&entry.join("provider"), 64)?;
        let provider = String::from_utf8_lossy(&provider).trim().to_owned();
        if provider != self.provider {
            return Err(CpuReportError::Provider {
                expected: self.provider,
                actual: provider,
            });
        }
        let generation = entry.join("generation");
        let before = read_generation(&generation)?;
        let mut writes = 1u64;
        if let Some(level) = self.privlevel {
            let path = entry.join("privlevel");
            fs::write(&path, level.to_string())
                .map_err(|source| CpuReportError::Io { path, source })?;
            writes += 1;
        }
        let inblob = entry.join("inblob");
        fs::write(&inblob, report_data).map_err(|source| CpuReportError::Io {
            path: inblob,
            source,
        })?;
        let outblob = read_bounded(&entry.join("outblob"), MAX_EVIDENCE_BYTES)?;
        let aux_path = entry.join("auxblob");
        let auxblob = if aux_path.exists() {
            read_bounded(&aux_path, MAX_EVIDENCE_BYTES)?
        } else {
            Vec::new()
        };
        let after = read_generation(&generation)?;
        if before.checked_add(writes) != Some(after) {
            return Err(CpuReportError::Raced {
                before: before.to_string(),
                after: after.to_string(),
            });
        }
        Ok(TsmReport { outblob, auxblob })
    }
}

impl CpuReporter for ConfigfsTsm {
    fn report(
        &self,
        report_data: &[u8; 64],
        _tpm: &mut Tpm,
    ) -> Result<CpuEvidence, CpuReportError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let entry = self.root.join(format!(
            "keel-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir(&entry).map_err(|source| CpuReportError::Io {
            path: entry.clone(),
            source,
        })?;
        let result = self.report_in(&entry, report_data);
        // The kernel frees the request with its directory; a failure to
        // remove it leaks one entry, not the report.
        if let Err(e) = fs::remove_dir(&entry) {
            tracing::warn!(path = %entry.display(), error = %e, "removing a configfs-tsm entry failed");
        }
        let report = result?;
        Ok(CpuEvidence {
            binding: cpu_evidence::Binding::Guest.into(),
            certificate: endorsement_certificate(&report.auxblob).unwrap_or_default(),
            report: report.outblob,
        })
    }
}

/// The VCEK (or VLEK) from an SNP certificate table: entries of a GUID, a
/// little-endian offset and length (from the table's start), ended by an
/// all-zero GUID. `None` when the table holds neither.
pub fn endorsement_certificate(table: &[u8]) -> Option<Vec<u8>> {
    let mut found = None;
    for entry in table.chunks_exact(24) {
        let guid = &entry[..16];
        if guid.iter().all(|b| *b == 0) {
            break;
        }
        if guid != VCEK_GUID && guid != VLEK_GUID {
            continue;
        }
        let word = |at: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&entry[at..at + 4]);
            usize::try_from(u32::from_le_bytes(w)).ok()
        };
        let (offset, length) = (word(16)?, word(20)?);
        if length > MAX_CERTIFICATE_BYTES {
            return None;
        }
        found = Some(table.get(offset..offset.checked_add(length)?)?.to_vec());
    }
    found
}

/// Azure's HCL report from the vTPM.
#[derive(Debug, Clone, Copy, Default)]
pub struct AzureHcl;

impl CpuReporter for AzureHcl {
    fn report(
        &self,
        _report_data: &[u8; 64],
        tpm: &mut Tpm,
    ) -> Result<CpuEvidence, CpuReportError> {
        Ok(CpuEvidence {
            binding: cpu_evidence::Binding::AzureHcl.into(),
            report: tpm.nv_read(HCL_REPORT_INDEX)?,
            certificate: Vec::new(),
        })
    }
}

/// The write count in a request's `generation` file.
fn read_generation(path: &Path) -> Result<u64, CpuReportError> {
    let text = read_bounded(path, 32)?;
    std::str::from_utf8(&text)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| CpuReportError::Generation {
            path: path.to_owned(),
        })
}

fn read_bounded(path: &Path, limit: usize) -> Result<Vec<u8>, CpuReportError> {
    let io = |source| CpuReportError::Io {
        path: path.to_owned(),
        source,
    };
    keel_verifier::bounded::read(path, limit as u64)
        .map_err(io)?
        .ok_or_else(|| CpuReportError::TooLarge {
            path: path.to_owned(),
            limit,
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn table(entries: &[([u8; 16], &[u8])]) -> Vec<u8> {
        let header = 24 * (entries.len() + 1);
        let mut head = Vec::new();
        let mut body = Vec::new();
        for (guid, cert) in entries {
            head.extend_from_slice(guid);
            head.extend_from_slice(&((header + body.len()) as u32).to_le_bytes());
            head.extend_from_slice(&(cert.len() as u32).to_le_bytes());
            body.extend_from_slice(cert);
        }
        head.extend_from_slice(&[0; 24]);
        head.extend_from_slice(&body);
        head
    }

    #[test]
    fn the_vcek_is_found_in_the_certificate_table() {
        let ask_guid = [7u8; 16];
        let t = table(&[(ask_guid, b"ask"), (VCEK_GUID, b"vcek")]);
        assert_eq!(endorsement_certificate(&t).unwrap(), b"vcek");
        let t = table(&[(VLEK_GUID, b"vlek")]);
        assert_eq!(endorsement_certificate(&t).unwrap(), b"vlek");
        assert!(endorsement_certificate(&table(&[(ask_guid, b"ask")])).is_none());
        // An entry pointing past the table's end is not read.
        let mut t = table(&[(VCEK_GUID, b"vcek")]);
        t.truncate(t.len() - 1);
        assert!(endorsement_certificate(&t).is_none());
        assert!(endorsement_certificate(&[]).is_none());
    }
}
