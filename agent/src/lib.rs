//! The keel node agent: measures its config, serves init, runs join, and
//! binds the node's secrets to what it booted.

pub mod address;
pub mod attestation;
pub mod cluster;
pub mod components;
pub mod disk;
pub mod disk_bindings;
pub mod files;
pub mod grpc;
pub mod init;
pub mod join;
pub mod join_service;
pub mod key_service;
pub mod kubeadm;
pub mod logging;
pub mod measured;
pub mod node;
pub mod nodelock;
pub mod reboot;
pub mod systemd;
pub mod throttle;
pub mod tpm;
