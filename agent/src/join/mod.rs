//! Joining a cluster, from both ends.
//!
//! * [`client`]: the node side, the state machine that gets a ticket, takes
//!   the node lock and hands over to the provisioning pipeline (join and
//!   rejoin).
//! * [`transport`]: fetching a ticket over mutual aTLS and opening its
//!   sealed secrets with the TPM.
//! * [`settings`]: the client's endpoints, trust and backoff.
//! * [`ticket`]: what a ticket carries and the checks the node makes of it.
//! * [`kubelet`]: the kubelet's client key, CSR and certificate.
//! * [`service`]: the control-plane side, which issues tickets, with
//!   [`tokens`] (bootstrap tokens registered in batches), and [`refusal`],
//!   what it tells a node it refuses.
//!
//! The client and the service share only the ticket and kubelet
//! definitions; neither uses the other's code.

pub mod client;
pub mod kubelet;
pub mod refusal;
pub mod service;
pub mod settings;
pub mod ticket;
pub mod tokens;
pub mod transport;

pub use client::{JoinClient, JoinOutcome};
pub use kubelet::KubeletKey;
pub use service::JoinService;
pub use settings::{service_validator, JoinError, JoinSettings};
pub use ticket::{JoinTicket, RejoinTicket, TicketError, TicketMeasurements};
pub use transport::TicketClient;
