//! The keel node agent: measures its config, serves init, runs join, and
//! binds the node's secrets to what it booted.
//!
//! The modules, from the bottom up:
//!
//! * the TPM: [`tpm`] (the one wrapper), [`measured`] (TPM plus event log),
//!   [`nodelock`] (PCR 15, the one-way switch), [`attestation`] (quotes as
//!   aTLS evidence, the join service's policy);
//! * the node: [`paths`], [`disk`], [`components`], [`kubeadm`] (every
//!   kubeadm call), [`provision`] (the steps after the lock);
//! * the flows: [`init`], [`join`] (client, ticket, service), [`recovery`],
//!   with
//!   [`operator`], [`disk_bindings`] and [`cluster`] for a control plane
//!   (its keys are derived by [`keel_verifier::keys`]);
//! * continuous attestation: [`evidence`] (the node's loop and the control
//!   plane's endpoint) and [`registry`] (verdicts and revocations);
//! * the cluster's life: [`upgrade`] (another Kubernetes version, with
//!   rollback);
//! * serving: [`grpc`] (limits), [`node`] (what runs on a booted node),
//!   [`transcript`] (progress streamed to the operator), [`batching`]
//!   (group commit of quotes, disk bindings and bootstrap tokens),
//!   [`backoff`] (pauses between tries, and the loop that keeps a set-up
//!   trying).

pub mod address;
pub mod attestation;
pub mod backoff;
pub mod batching;
pub mod cluster;
pub mod components;
pub mod disk;
pub mod disk_bindings;
pub mod evidence;
pub mod files;
pub mod grpc;
pub mod init;
pub mod join;
pub mod journal;
pub mod kubeadm;
pub mod logging;
pub mod measured;
pub mod node;
pub mod nodelock;
pub mod operator;
pub mod paths;
pub mod provision;
pub mod reboot;
pub mod recovery;
pub mod registry;
pub mod resume;
pub mod systemd;
mod throttle;
pub mod tpm;
pub mod transcript;
pub mod upgrade;
