//! Wire types of keel. Every field is documented in `proto/keel/*.proto`;
//! the modules here are generated from those files at build time and
//! re-exported under short names (`keel_proto::init`, `keel_proto::join`, ...).
#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// Generated code, nested as the protobuf packages are.
pub mod keel {
    pub mod components {
        pub mod v1 {
            tonic::include_proto!("keel.components.v1");
        }
    }
    pub mod attestation {
        pub mod v1 {
            tonic::include_proto!("keel.attestation.v1");
        }
    }
    pub mod evidence {
        pub mod v1 {
            tonic::include_proto!("keel.evidence.v1");
        }
    }
    pub mod init {
        pub mod v1 {
            tonic::include_proto!("keel.init.v1");
        }
    }
    pub mod join {
        pub mod v1 {
            tonic::include_proto!("keel.join.v1");
        }
    }
    pub mod kms {
        pub mod v1 {
            tonic::include_proto!("keel.kms.v1");
        }
    }
    pub mod operator {
        pub mod v1 {
            tonic::include_proto!("keel.operator.v1");
        }
    }
    pub mod recovery {
        pub mod v1 {
            tonic::include_proto!("keel.recovery.v1");
        }
    }
}

/// Attestation documents, measurement events and TPM-sealed secrets.
pub use keel::attestation::v1 as attestation;
/// Kubernetes components to download and install.
pub use keel::components::v1 as components;
/// Continuous attestation (member node → every control plane).
pub use keel::evidence::v1 as evidence;
/// The init API (operator CLI → first node).
pub use keel::init::v1 as init;
/// The join API (node → control plane).
pub use keel::join::v1 as join;
/// The key service (data keys derived from the master secret).
pub use keel::kms::v1 as kms;
/// The operator API (operator CLI → every control plane).
pub use keel::operator::v1 as operator;
/// The recovery API (operator CLI → a control plane that lost its cluster).
pub use keel::recovery::v1 as recovery;

/// A Debug for messages that carry secrets (`SECRET_MESSAGES` in
/// `build.rs`): the type's name alone, none of its fields.
macro_rules! debug_without_fields {
    ($($message:ty),* $(,)?) => {$(
        impl std::fmt::Debug for $message {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($message)).finish_non_exhaustive()
            }
        }
    )*};
}

debug_without_fields!(
    join::JoinSecrets,
    join::ControlPlaneSecrets,
    join::ControlPlaneFile,
    init::InitSecrets,
    init::InitSuccess,
    recovery::RecoverySecrets,
    operator::AdminKubeconfigResponse,
    kms::GetDataKeyResponse,
);

/// Largest init response message a node sends and `keel init` reads: the
/// admin kubeconfig is at most 1 MiB, log chunks 32 KiB.
pub const MAX_INIT_RESPONSE_BYTES: usize = 2 * 1024 * 1024;

/// Largest recovery response a control plane sends and `keel recover`
/// reads: it carries a 32-byte cluster ID.
pub const MAX_RECOVER_RESPONSE_BYTES: usize = 4 * 1024;

/// Most bytes of node logs an init failure sends, and `keel init` keeps.
pub const MAX_FAILURE_LOG_BYTES: usize = 1024 * 1024;

/// Largest node registry document a control plane keeps, sends another
/// control plane (`Registry`) or the operator (`GetRegistry`), or puts in a
/// control-plane ticket. A registry at every bound its entries have
/// ([`MAX_NODES`] nodes and [`MAX_REVOCATIONS`] revocations, every field
/// at its longest) stays below it.
pub const MAX_REGISTRY_BYTES: usize = 32 * 1024 * 1024;
/// Most node records a registry document holds.
pub const MAX_NODES: usize = 10_000;
/// Most revocations a registry document holds.
pub const MAX_REVOCATIONS: usize = 10_000;
/// Most other names a registry's node record holds (names other control
/// planes hold its EK under).
pub const MAX_OTHER_NAMES: usize = 2;

/// Response metadata key of a node's busy answer (`Unavailable`: its
/// places for requests in flight are taken, the request was not read): a
/// client may send the same request again. Other `Unavailable` answers
/// (the node's TPM or disk failing) and transport failures carry none.
pub const BUSY_METADATA: &str = "keel-busy";

/// A busy answer saying `message`, marked with [`BUSY_METADATA`].
pub fn busy(message: impl Into<String>) -> tonic::Status {
    let mut status = tonic::Status::unavailable(message);
    status.metadata_mut().insert(
        BUSY_METADATA,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    status
}

/// Whether `status` is a node's busy answer ([`busy`]: its places for
/// requests in flight were taken and it did not read the request), which
/// is worth sending the request again for. Its other `Unavailable` answers
/// (its TPM or state disk failing) are not, nor is a connection that
/// failed (tonic makes it a status with the transport error as its
/// source).
pub fn told_busy(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable
        && std::error::Error::source(status).is_none()
        && status.metadata().get(BUSY_METADATA).is_some()
}

/// Response metadata key of a refusal that holds back the client's address
/// (`ResourceExhausted`: requests from it were refused, e.g. for a wrong
/// secret, and the next is not looked at before the wait ends): the whole
/// seconds left. The request was not read, so a client may send it again
/// once they have passed.
pub const RETRY_AFTER_METADATA: &str = "keel-retry-after";

/// A refusal saying `message` that holds the client's address back for
/// `seconds`, marked with [`RETRY_AFTER_METADATA`].
pub fn held_back(message: impl Into<String>, seconds: u64) -> tonic::Status {
    let mut status = tonic::Status::resource_exhausted(message);
    status
        .metadata_mut()
        .insert(RETRY_AFTER_METADATA, seconds.into());
    status
}

/// How long the node holds the client's address back, if `status` is such
/// a refusal ([`held_back`]); `None` for any other answer, and for a
/// transport failure.
pub fn held_back_for(status: &tonic::Status) -> Option<std::time::Duration> {
    if status.code() != tonic::Code::ResourceExhausted
        || std::error::Error::source(status).is_some()
    {
        return None;
    }
    let seconds: u64 = status
        .metadata()
        .get(RETRY_AFTER_METADATA)?
        .to_str()
        .ok()?
        .parse()
        .ok()?;
    Some(std::time::Duration::from_secs(seconds))
}

/// Largest admin kubeconfig a control plane sends the operator
/// (`AdminKubeconfig`), and `keel kubeconfig` takes: kubeadm's is a few
/// KiB.
pub const MAX_ADMIN_KUBECONFIG_BYTES: usize = 64 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    /// A `{:?}` of a message that carries secrets prints none of them,
    /// also where it sits inside another message.
    #[test]
    fn messages_that_carry_secrets_debug_without_their_fields() {
        let key = vec![0xAB; 32];
        let token = "abcdef.0123456789abcdef";
        let secrets = join::JoinSecrets {
            state_disk_key: key.clone(),
            bootstrap_token: token.into(),
            control_plane: Some(join::ControlPlaneSecrets {
                master_secret: key.clone(),
                master_salt: key.clone(),
            }),
            control_plane_files: vec![join::ControlPlaneFile {
                name: "ca.key".into(),
                data: b"-----BEGIN PRIVATE KEY-----".to_vec(),
            }],
            ..Default::default()
        };
        let kubeconfig = b"client-key-data: c2VjcmV0".to_vec();
        let response = init::InitResponse {
            kind: Some(init::init_response::Kind::Success(init::InitSuccess {
                kubeconfig: kubeconfig.clone(),
                ..Default::default()
            })),
        };
        for shown in [
            format!("{secrets:?}"),
            format!(
                "{:?}",
                init::InitSecrets {
                    init_secret: key.clone(),
                    master_secret: key.clone()
                }
            ),
            format!("{response:?}"),
            format!(
                "{:?}",
                recovery::RecoverySecrets {
                    master_secret: key.clone(),
                    master_salt: key.clone(),
                    init_secret: key.clone(),
                }
            ),
            format!(
                "{:?}",
                operator::AdminKubeconfigResponse {
                    kubeconfig: kubeconfig.clone()
                }
            ),
            format!(
                "{:?}",
                kms::GetDataKeyResponse {
                    data_key: key.clone()
                }
            ),
        ] {
            for secret in ["171", "abcdef", "PRIVATE", "client-key", "99, 108"] {
                assert!(!shown.contains(secret), "{shown}");
            }
        }
    }
}
