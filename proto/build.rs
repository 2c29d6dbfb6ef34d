//! Generates the prost messages and tonic services from `keel/*.proto`.
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
    tonic_prost_build::configure().compile_protos(&protos, &["."])?;
    Ok(())
}
