//! `keel init` as the operator runs it, and an init request made directly
//! over aTLS, whose gRPC status is the structured answer a refused init
//! gives.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use keel_atls::AtlsClient;

use keel_proto::init::init_service_client::InitServiceClient;
use keel_proto::init::{InitRequest, InitSecrets};
use keel_verifier::credential;
use keel_verifier::ek::EkTrust;
use keel_verifier::measurements::Measurements;
use keel_verifier::validator::Validator;
use prost::Message as _;
use rand::RngCore as _;
use serde::Deserialize;
use zeroize::Zeroizing;

use super::{io, MiniError};

/// The cluster ID file `keel init` writes into its workspace.
#[derive(Debug, Deserialize)]
pub struct IdFile {
    /// Hex.
    pub cluster_id: String,
    /// The node's init server.
    pub endpoint: String,
}

/// Runs `keel init --skip-helm-wait` with `settings` into `workspace`; its
/// output goes to `log` and, indented, to standard error. Returns whether
/// it exited with status 0.
pub fn run_cli(
    keel: &Path,
    settings: &Path,
    workspace: &Path,
    log: &Path,
    echo: bool,
) -> Result<bool, MiniError> {
    let mut file = std::fs::File::create(log).map_err(io(log))?;
    let mut child = Command::new(keel)
        .args(["init", "--skip-helm-wait", "--settings"])
        .arg(settings)
        .arg("--workspace")
        .arg(workspace)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| MiniError::Spawn {
            program: keel.display().to_string(),
            source,
        })?;
    // Standard output (three result lines) is read after standard error
    // closes, so neither pipe fills while the other is read.
    if let Some(err) = child.stderr.take() {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = writeln!(file, "{line}");
            if echo {
                eprintln!("    {line}");
            }
        }
    }
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = writeln!(file, "{line}");
            if echo {
                eprintln!("    {line}");
            }
        }
    }
    let status = child.wait().map_err(io(log))?;
    Ok(status.success())
}

/// Reads the cluster ID file.
pub fn id_file(path: &Path) -> Result<IdFile, MiniError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    serde_json::from_slice(&bytes).map_err(|source| MiniError::Json {
        path: path.to_owned(),
        source,
    })
}

/// What an init request needs, from the cluster's files.
pub struct InitInputs<'a> {
    /// The node's init server port on 127.0.0.1.
    pub port: u16,
    /// The measurements the node is validated against (and its join service
    /// would get).
    pub measurements: &'a Path,
    /// The EK CA certificate.
    pub ek_ca: &'a Path,
    /// The init secret file.
    pub init_secret: &'a Path,
    /// The component list.
    pub components: &'a Path,
}

fn read(path: &Path) -> Result<Vec<u8>, MiniError> {
    std::fs::read(path).map_err(io(path))
}

/// Sends the node a complete, valid init request, as `keel init` builds it
/// (a fresh master secret sealed to the node's TPM, the right init
/// secret), and returns the node's gRPC answer: `Ok(())` if it accepted
/// (its progress stream is dropped unread) or the status it refused with.
pub fn request(inputs: &InitInputs<'_>) -> Result<Result<(), tonic::Status>, MiniError> {
    let measurements_json = read(inputs.measurements)?;
    let measurements = Measurements::parse(&measurements_json)
        .map_err(|e| MiniError::Check(format!("{}: {e}", inputs.measurements.display())))?;
    let trust = EkTrust::from_pem(&read(inputs.ek_ca)?)
        .map_err(|e| MiniError::Check(format!("{}: {e}", inputs.ek_ca.display())))?;
    let init_secret = Zeroizing::new(read(inputs.init_secret)?);
    let components = keel_installer::components_file::parse(&read(inputs.components)?)
        .map_err(|e| MiniError::Check(format!("{}: {e}", inputs.components.display())))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| MiniError::Spawn {
            program: "the RPC runtime".into(),
            source,
        })?;
    let port = inputs.port;
    runtime.block_on(async move {
        let failed = |what: &str, e: &(dyn std::error::Error + 'static)| {
            MiniError::Check(format!(
                "init request to 127.0.0.1:{port}: {what}: {}",
                keel_atls::ErrorChain(e)
            ))
        };
        let client = AtlsClient::server_attested(Arc::new(Validator::new(measurements, trust)));
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .map_err(|e| failed("endpoint", &e))?;
        let bound = client
            .bind_channel(endpoint)
            .await
            .map_err(|e| failed("connecting over aTLS", &e))?;
        let Some(attested) = bound.attested else {
            return Err(MiniError::Check(format!(
                "init request to 127.0.0.1:{port}: the node presented no attestation"
            )));
        };
        let verified = attested.claims();
        let random = || {
            let mut v = Zeroizing::new(vec![0u8; 32]);
            rand::rngs::OsRng.fill_bytes(&mut v);
            v
        };
        let secrets = Zeroizing::new(
            InitSecrets {
                init_secret: init_secret.to_vec(),
                master_secret: random().to_vec(),
            }
            .encode_to_vec(),
        );
        let sealed = credential::seal(&verified.ek, &verified.ak.name, &secrets)
            .map_err(|e| failed("sealing the init and master secrets", &e))?;
        let request = InitRequest {
            // The local cluster names no measurements signing key: its
            // components need no signed file.
            components_file: Vec::new(),
            components_signature: Vec::new(),
            secrets: Some(sealed),
            master_salt: random().to_vec(),
            measurement_salt: random().to_vec(),
            kubernetes_version: "v1.31".into(),
            kubernetes_components: Some(components),
            cluster_name: "keel".into(),
            api_server_cert_sans: Vec::new(),
            service_cidr: String::new(),
            join_measurements: measurements_json,
            join_measurements_signature: Vec::new(),
        };
        Ok(InitServiceClient::new(bound.channel)
            .init(request)
            .await
            .map(|_| ()))
    })
}
