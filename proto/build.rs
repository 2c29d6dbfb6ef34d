//! Generates the prost messages and tonic services from `keel/*.proto`.

/// The messages whose fields are secrets (keys, tokens, kubeconfigs with
/// client keys, PKI files with CA keys); `src/lib.rs` gives each a Debug
/// without fields.
const SECRET_MESSAGES: [&str; 8] = [
    ".keel.join.v1.JoinSecrets",
    ".keel.join.v1.ControlPlaneSecrets",
    ".keel.join.v1.ControlPlaneFile",
    ".keel.init.v1.InitSecrets",
    ".keel.recovery.v1.RecoverySecrets",
    ".keel.init.v1.InitSuccess",
    ".keel.operator.v1.AdminKubeconfigResponse",
    ".keel.kms.v1.GetDataKeyResponse",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "keel/components.proto",
        "keel/attestation.proto",
        "keel/init.proto",
        "keel/join.proto",
        "keel/kms.proto",
        "keel/recovery.proto",
        "keel/operator.proto",
        "keel/evidence.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    // Messages that carry secrets get a Debug that prints none of their
    // fields (`src/lib.rs`), so that no `{:?}` can log a key.
    tonic_prost_build::configure()
        .skip_debug(SECRET_MESSAGES)
        .compile_protos(&protos, &["."])?;
    Ok(())
}
