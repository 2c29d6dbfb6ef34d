//! The CLI's settings file and the validator it implies.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use keel_verifier::cpu::{AttestationConfig, Collateral, CpuPolicy, CpuTrust};
use keel_verifier::ek::EkTrust;
use keel_verifier::measurements::Measurements;
use keel_verifier::signature::SigningPublicKey;
use keel_verifier::validator::{Validator, Verified};
use serde::Deserialize;

use crate::printable::printable;

/// Largest settings, measurements or secret file read.
const MAX_FILE: u64 = 1024 * 1024;

/// What `keel init` and `keel verify` need. Relative paths are relative to
/// the settings file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The node's init server, `host:port`.
    pub endpoint: String,
    /// "v1.31" or a pinned "v1.31.13".
    #[serde(default = "default_version")]
    pub kubernetes_version: String,
    /// Measurements file the node must match.
    pub measurements: PathBuf,
    /// PEM bundle of the CAs that issue TPM EK certificates.
    pub ek_ca: PathBuf,
    /// File holding the init secret.
    #[serde(default)]
    pub init_secret_file: Option<PathBuf>,
    /// Kubernetes cluster name.
    #[serde(default = "default_name")]
    pub cluster_name: String,
    /// Extra API server certificate SANs.
    #[serde(default)]
    pub api_server_cert_sans: Vec<String>,
    /// Service CIDR (default 10.96.0.0/12).
    #[serde(default)]
    pub service_cidr: String,
    /// A components file (JSON list of {url, hash, install_path, extract})
    /// replacing the version's pinned set, e.g. for a local mirror. With a
    /// measurements_signing_key, it needs its signature for the version
    /// (`FILE.sig`, `keel-measure sign --kubernetes-version`).
    #[serde(default)]
    pub components_file: Option<PathBuf>,
    /// The base URL replacing the upstream download hosts that the nodes'
    /// measured config names (`cluster.component_mirror`), where it names
    /// one: the nodes download only from that. `keel init` checks that
    /// the node's config names this one, so that a mirror set here and not
    /// in the image's config is said before anything is sent.
    #[serde(default)]
    pub component_mirror: Option<String>,
    /// The public key (PEM, ECDSA P-256) that measurements files of a new
    /// image, and components files, must be signed with (`keel-measure
    /// --signing-key`, `keel-measure sign`): the nodes' measured config
    /// names the same key; without it, the cluster refuses image upgrades.
    #[serde(default)]
    pub measurements_signing_key: Option<PathBuf>,
    /// The cluster's attestation variant and expected CPU values (the
    /// nodes' `cluster.attestation`); absent is `vtpm`.
    #[serde(default)]
    pub attestation: AttestationConfig,
    /// The CPU collateral cache (VCEKs, TDX collateral), see
    /// `keel_verifier::cpu::collateral`.
    #[serde(default)]
    pub collateral: Option<PathBuf>,
    #[serde(skip)]
    dir: PathBuf,
}

fn default_version() -> String {
    "v1.31".into()
}

fn default_name() -> String {
    "keel".into()
}

/// Reads a file of bounded size.
pub fn read_bounded(path: &Path) -> anyhow::Result<Vec<u8>> {
    read_bounded_into(path, Vec::new())
}

/// As [`read_bounded`], for a file that holds a secret: read into a wiped
/// buffer with room for the whole bound, so that it never grows and leaves
/// no copy behind.
pub fn read_bounded_secret(path: &Path) -> anyhow::Result<zeroize::Zeroizing<Vec<u8>>> {
    let room = usize::try_from(MAX_FILE + 1).context("the file bound")?;
    let mut bytes = zeroize::Zeroizing::new(Vec::with_capacity(room));
    let read = read_bounded_into(path, std::mem::take(&mut *bytes))?;
    *bytes = read;
    Ok(bytes)
}

fn read_bounded_into(path: &Path, mut bytes: Vec<u8>) -> anyhow::Result<Vec<u8>> {
    use std::io::Read as _;
    // Bounded as it is read: a pipe (`<(...)`) or a growing file reports
    // no size that holds.
    let result = std::fs::File::open(path)
        .and_then(|f| f.take(MAX_FILE + 1).read_to_end(&mut bytes))
        .with_context(|| format!("reading {}", path.display()));
    if let Err(e) = result {
        zeroize::Zeroize::zeroize(&mut bytes);
        return Err(e);
    }
    if bytes.len() as u64 > MAX_FILE {
        zeroize::Zeroize::zeroize(&mut bytes);
        anyhow::bail!("{} is larger than {MAX_FILE} bytes", path.display());
    }
    Ok(bytes)
}

impl Settings {
    /// Loads and checks a settings file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let bytes = read_bounded(path)?;
        let mut s: Self = serde_json::from_slice(&bytes)
            .with_context(|| format!("settings {} are invalid", path.display()))?;
        s.dir = path.parent().map(Path::to_owned).unwrap_or_default();
        Ok(s)
    }

    /// A path from the settings, resolved against the settings' directory.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        self.dir.join(p)
    }

    /// The expected measurements of the node.
    pub fn measurements(&self) -> anyhow::Result<Measurements> {
        self.measurements_file().map(|(_, parsed)| parsed)
    }

    /// The measurements file's exact bytes (what a signature covers) and
    /// the set they describe.
    pub fn measurements_file(&self) -> anyhow::Result<(Vec<u8>, Measurements)> {
        let m = self.resolve(&self.measurements);
        let body = read_bounded(&m)?;
        let parsed = Measurements::parse(&body)
            .with_context(|| format!("measurements {} are invalid", m.display()))?;
        Ok((body, parsed))
    }

    /// The validator for the node: `measurements` (from
    /// [`Settings::measurements`]) and the EK CAs.
    pub fn validator(&self, measurements: Measurements) -> anyhow::Result<Validator> {
        Ok(Validator::new(measurements, self.ek_trust()?).with_cpu(self.cpu_trust()?))
    }

    /// A diagnostic validator (`keel verify -o json`): reports measurement
    /// mismatches instead of refusing; see [`Validator::diagnostic`].
    pub fn diagnostic_validator(&self, measurements: Measurements) -> anyhow::Result<Validator> {
        Ok(Validator::diagnostic(measurements, self.ek_trust()?).with_cpu(self.cpu_trust()?))
    }

    /// The CPU evidence the node must show: the variant, the pinned roots,
    /// the collateral cache (refused if another user could write into it:
    /// [`crate::collateral::check_cache`]).
    fn cpu_trust(&self) -> anyhow::Result<Arc<CpuTrust>> {
        let policy = CpuPolicy::try_from(&self.attestation)
            .map_err(|reason| anyhow::anyhow!("settings attestation: {reason}"))?;
        let collateral = match &self.collateral {
            Some(dir) => {
                let dir = self.resolve(dir);
                crate::collateral::check_cache(&dir)?;
                Collateral::at(dir)
            }
            None => Collateral::default(),
        };
        Ok(Arc::new(CpuTrust::new(policy, collateral)))
    }

    fn ek_trust(&self) -> anyhow::Result<EkTrust> {
        let ca = self.resolve(&self.ek_ca);
        EkTrust::from_pem(&read_bounded(&ca)?)
            .with_context(|| format!("EK CA bundle {}", ca.display()))
    }

    /// Refuses a node whose measured config names other attestation
    /// settings (`cluster.attestation`: the variant and the expected CPU
    /// values) than these settings, which decide what CPU evidence the
    /// node must bring: a `sev-snp` or `tdx` cluster checked with settings
    /// that leave `attestation` out (`vtpm`) would take a host's software
    /// TPM, with a copied event log and no CPU evidence, for the node.
    pub fn check_node_attestation(&self, node: &Verified) -> anyhow::Result<()> {
        check_node_attestation(&self.attestation, node)
    }

    /// Where the settings name a component mirror, the node's measured
    /// config must name the same one (the node takes no mirror from init).
    pub fn check_component_mirror(&self, node: &Verified) -> anyhow::Result<()> {
        let Some(own) = &self.component_mirror else {
            return Ok(());
        };
        let node_mirror = node
            .cluster_config()
            .context("the node's event log holds no node config that parses")?
            .component_mirror;
        // Compared as the node uses them: `http://m/k8s` is `http://m/k8s/`.
        let own_parsed = keel_installer::Mirror::new(own)
            .with_context(|| format!("the settings' component_mirror {}", printable(own)))?;
        let same = node_mirror
            .as_deref()
            .and_then(|m| keel_installer::Mirror::new(m).ok())
            .is_some_and(|m| m == own_parsed);
        if !same {
            anyhow::bail!(
                "the settings' component_mirror is {}, the node's measured config names {}: \
                 a node downloads only from the mirror its config names \
                 (cluster.component_mirror); set the same in both",
                printable(own),
                match &node_mirror {
                    Some(m) => printable(m).to_string(),
                    None => "none".to_owned(),
                }
            );
        }
        Ok(())
    }

    /// The measurements signing key the settings name, if any.
    pub fn signing_key(&self) -> anyhow::Result<Option<SigningPublicKey>> {
        let Some(path) = &self.measurements_signing_key else {
            return Ok(None);
        };
        let path = self.resolve(path);
        let pem = read_bounded(&path)?;
        SigningPublicKey::from_pem(&pem)
            .with_context(|| format!("measurements signing key {}", path.display()))
            .map(Some)
    }

    /// The endpoint as host and port: `host:port`, an IPv6 address in
    /// brackets (`[fd00::1]:9000`), which the host keeps.
    pub fn host_port(endpoint: &str) -> anyhow::Result<(String, u16)> {
        let (host, port) = endpoint
            .rsplit_once(':')
            .context("endpoint must be host:port")?;
        if host.is_empty() {
            anyhow::bail!("endpoint {} names no host", printable(endpoint));
        }
        if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
            anyhow::bail!(
                "endpoint {}: an IPv6 address goes in brackets, as in [fd00::1]:9000",
                printable(endpoint)
            );
        }
        Ok((
            host.to_owned(),
            port.parse().context("endpoint port is not a number")?,
        ))
    }

    /// The endpoint ([`Settings::host_port`]) as a gRPC channel's.
    pub fn grpc_endpoint(endpoint: &str) -> anyhow::Result<tonic::transport::Endpoint> {
        let (host, port) = Self::host_port(endpoint)?;
        tonic::transport::Endpoint::from_shared(format!("http://{host}:{port}"))
            .context("invalid endpoint")
    }
}

/// A components file as a request carries it.
pub struct ComponentsFile {
    /// The components it lists (the node checks each again).
    pub components: keel_proto::components::Components,
    /// The file's bytes and their detached signature, where a measurements
    /// signing key is named: nodes of such a cluster take the operator's
    /// own components only with them.
    pub signed: Option<(Vec<u8>, Vec<u8>)>,
}

/// Reads the components file at `path` (a JSON list of `{url, hash,
/// install_path, extract}`) and, with `key` (the settings' measurements
/// signing key), its signature (`signature`, default the file + `.sig`),
/// which must verify as the file for `version`: checked before anything
/// is sent.
pub fn read_components(
    path: &Path,
    version: keel_installer::KubernetesVersion,
    signature: Option<&Path>,
    key: Option<&SigningPublicKey>,
) -> anyhow::Result<ComponentsFile> {
    let body = read_bounded(path)?;
    let components = keel_installer::components_file::parse(&body)
        .with_context(|| format!("components file {} is invalid", path.display()))?;
    let Some(key) = key else {
        return Ok(ComponentsFile {
            components,
            signed: None,
        });
    };
    let signature_path = signature.map_or_else(
        || keel_verifier::signature::detached_signature_path(path),
        Path::to_owned,
    );
    let signature = read_bounded(&signature_path).with_context(|| {
        format!(
            "no signature for {} (`keel-measure sign --signing-key KEY --kubernetes-version \
             {version} {}` writes {}): where the settings name a measurements signing key, the \
             cluster's nodes take no other components; nothing was sent",
            path.display(),
            path.display(),
            signature_path.display()
        )
    })?;
    let message = keel_installer::components_file::signed_message(version, &body);
    key.verify(&message, &signature).with_context(|| {
        format!(
            "{} is not a signature of {} for Kubernetes {version} with the settings' \
             measurements signing key; nothing was sent",
            signature_path.display(),
            path.display()
        )
    })?;
    Ok(ComponentsFile {
        components,
        signed: Some((body, signature)),
    })
}

/// [`Settings::check_node_attestation`] with the settings' attestation
/// section `own_config`.
pub fn check_node_attestation(
    own_config: &AttestationConfig,
    node: &Verified,
) -> anyhow::Result<()> {
    let config = node
        .cluster_config()
        .context("the node's event log holds no node config that parses")?;
    // Compared as checked policies: the variant's own section only,
    // the TDX statuses allowed as a set.
    let policy = |c: &AttestationConfig| {
        CpuPolicy::try_from(c).map(|mut p| {
            if let CpuPolicy::Tdx(tdx) = &mut p {
                tdx.allow_tcb_status.sort();
                tdx.allow_tcb_status.dedup();
            }
            p
        })
    };
    let node_policy = policy(&config.attestation)
        .map_err(|reason| anyhow::anyhow!("the node's cluster.attestation: {reason}"))?;
    let own =
        policy(own_config).map_err(|reason| anyhow::anyhow!("settings attestation: {reason}"))?;
    if node_policy != own {
        anyhow::bail!(
            "the node's config names attestation variant {}, the settings {}{}: set the \
             settings' attestation to the cluster's cluster.attestation",
            node_policy.variant().as_str(),
            own.variant().as_str(),
            if node_policy.variant() == own.variant() {
                ", with other expected CPU values"
            } else {
                ""
            }
        );
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A secret file is read into the buffer it started with: no copy of
    /// it is left in a buffer that grew and was freed. Past the bound it is
    /// refused, as any file.
    #[test]
    fn a_secret_file_is_read_without_growing_its_buffer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret.json");
        std::fs::write(&path, "{\"key\": \"00\"}").unwrap();
        let read = read_bounded_secret(&path).unwrap();
        assert_eq!(&**read, b"{\"key\": \"00\"}");
        assert_eq!(read.capacity() as u64, MAX_FILE + 1);
        std::fs::write(&path, vec![b' '; MAX_FILE as usize + 1]).unwrap();
        let e = read_bounded_secret(&path).unwrap_err();
        assert!(format!("{e:#}").contains("is larger than"), "{e:#}");
    }

    #[test]
    fn files_without_a_size_are_bounded_as_they_are_read() {
        // A device (like a pipe) reports size 0 and never ends.
        let refused = read_bounded(Path::new("/dev/zero")).unwrap_err();
        assert!(refused.to_string().contains("larger than"), "{refused:#}");
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small");
        std::fs::write(&small, b"secret").unwrap();
        assert_eq!(read_bounded(&small).unwrap(), b"secret");
        let large = dir.path().join("large");
        std::fs::write(&large, vec![0; MAX_FILE as usize + 1]).unwrap();
        assert!(read_bounded(&large).is_err());
    }

    /// An EK CA bundle that cannot be used is named with what is wrong in
    /// it (the verifier's reason), not always as one without certificates.
    #[test]
    fn an_unusable_ek_ca_bundle_is_named_with_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        let settings = dir.path().join("keel.json");
        std::fs::write(
            &settings,
            r#"{"endpoint": "n:9000", "measurements": "m.json", "ek_ca": "ca.pem"}"#,
        )
        .unwrap();
        let settings = Settings::load(&settings).unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let e = format!("{:#}", settings.ek_trust().unwrap_err());
        assert!(!e.contains("holds no certificate"), "{e}");
        assert_eq!(
            e,
            format!(
                "EK CA bundle {}: EK CA bundle, block 0 (from 0): a \"PRIVATE KEY\" block, not a \
                 CERTIFICATE",
                ca.display()
            )
        );
        std::fs::write(&ca, "").unwrap();
        let e = format!("{:#}", settings.ek_trust().unwrap_err());
        assert_eq!(
            e,
            format!(
                "EK CA bundle {}: no trusted EK CA certificate configured",
                ca.display()
            )
        );
    }
}
