//! The verifier side of keel's attestation, pure Rust and without a TPM:
//! the node config's canonical form, the measurement log and its replay,
//! the measurements file, TPM wire formats, quote and EK certificate
//! checks, quote batches ([`batch`]), the attestation [`validator`], and
//! sealing secrets to a TPM (MakeCredential), the cluster's key derivation
//! ([`keys`]), and the detached signatures of measurements files
//! ([`signature`]). The CLI and `keel-measure` need no TPM crate for
//! these; the agent adds the TPM half (issuing, opening, answering). The
//! node config's component mirror is checked by the installer's own rule
//! ([`keel_installer::Mirror`]).

pub mod batch;
pub mod bounded;
pub mod clock;
pub mod cluster_settings;
pub mod config;
pub mod cpu;
pub mod credential;
pub mod ek;
pub mod init_secret;
pub mod keys;
pub mod measurement;
pub mod measurements;
pub mod quote;
mod rsa_oaep;
pub mod signature;
pub mod tpm_wire;
pub mod validator;
