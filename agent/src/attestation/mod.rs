//! Attestation: the document a node presents, how it is issued from the TPM
//! and how a verifier checks it.

pub mod credential;
pub mod ek;
pub mod issuer;
pub mod measurements;
pub mod policy;
pub mod quote;
pub mod tpm_wire;
pub mod validator;
