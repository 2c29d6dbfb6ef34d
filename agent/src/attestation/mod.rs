//! Attestation on the node: the document it presents, issued from the TPM,
//! the TPM half of sealed secrets, and the verifier's reloadable policy.
//! How a document is checked is [`keel_verifier`]'s.

pub mod credential;
pub mod issuer;
pub mod policy;
