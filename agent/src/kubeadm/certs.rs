//! The certificates kubeadm issues a control plane, and their renewal.
//!
//! kubeadm's leaf certificates (the API server's, its clients' of etcd and
//! the kubelets, etcd's own, the front proxy's client) and the kubeconfigs
//! of the admin, the controller manager and the scheduler are valid for a
//! year; its CAs for ten. kubeadm renews the leaves only during `kubeadm
//! upgrade` or on `kubeadm certs renew`: a cluster that does not upgrade
//! Kubernetes within a year loses its control plane at the first
//! anniversary, and a node has no shell to renew them by hand. So a
//! control plane renews them itself once the first of them is within
//! [`RENEW_BEFORE`] of its end, and restarts its control-plane pods, which
//! read them only as they start.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::run::{Kubeadm, KubeadmError, Stdout};

/// How long before the first of kubeadm's certificates ends it is renewed.
pub const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);

/// kubeadm's certificate directory under the node's root.
const PKI: &str = "etc/kubernetes/pki";
/// Most certificate files looked at (kubeadm writes about twenty).
const MAX_CERTIFICATES: usize = 128;
/// Most bytes of one certificate file read.
const MAX_CERTIFICATE_BYTES: u64 = 64 << 10;
/// containerd's CRI socket, which crictl is pointed at.
const CRI_ENDPOINT: &str = "unix:///run/containerd/containerd.sock";
/// The label kubeadm puts on its static pods (etcd, the API server, the
/// controller manager, the scheduler).
const CONTROL_PLANE_LABEL: &str = "tier=control-plane";
/// Most control-plane pods restarted (kubeadm runs four).
const MAX_PODS: usize = 16;

/// A certificate file and the time it ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    /// The file, under the node's root.
    pub path: PathBuf,
    /// Its `notAfter`.
    pub at: SystemTime,
}

/// The kubeadm leaf certificate under `root` that ends first; `None` where
/// there is none (a worker: its only certificate there is the cluster CA).
/// The CAs (`ca.crt`, `front-proxy-ca.crt`, `etcd/ca.crt`) are left out:
/// kubeadm does not renew them.
pub fn first_to_end(root: &Path) -> std::io::Result<Option<Ending>> {
    let pki = root.join(PKI);
    let mut first: Option<Ending> = None;
    let mut seen = 0usize;
    for dir in [pki.clone(), pki.join("etcd")] {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let path = entry?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !name.ends_with(".crt") || name == "ca.crt" || name.ends_with("-ca.crt") {
                continue;
            }
            seen += 1;
            if seen > MAX_CERTIFICATES {
                return Err(std::io::Error::other("too many certificates"));
            }
            let at = ends_at(&path)?;
            if first.as_ref().is_none_or(|f| at < f.at) {
                first = Some(Ending { path, at });
            }
        }
    }
    Ok(first)
}

/// The `notAfter` of the PEM certificate in `path`.
fn ends_at(path: &Path) -> std::io::Result<SystemTime> {
    let unreadable = |why: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {why}", path.display()),
        )
    };
    let bytes = keel_verifier::bounded::read_regular(path, MAX_CERTIFICATE_BYTES)?
        .ok_or_else(|| unreadable("larger than a certificate"))?;
    let (_, pem) =
        x509_parser::pem::parse_x509_pem(&bytes).map_err(|_| unreadable("not a PEM block"))?;
    let cert = pem
        .parse_x509()
        .map_err(|_| unreadable("not an X.509 certificate"))?;
    let seconds = cert.validity().not_after.timestamp();
    Ok(u64::try_from(seconds).map_or(UNIX_EPOCH, |s| UNIX_EPOCH + Duration::from_secs(s)))
}

/// Whether `ending` is due for renewal at `now`.
pub fn due(ending: &Ending, now: SystemTime) -> bool {
    ending
        .at
        .duration_since(now)
        .map_or(true, |left| left <= RENEW_BEFORE)
}

impl Kubeadm {
    /// Runs `kubeadm certs renew all`: every leaf certificate and the
    /// kubeconfigs kubeadm wrote, each signed anew for another year by the
    /// cluster's CAs, with the same names and keys' use.
    pub async fn renew_certificates(
        &self,
        on_line: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), KubeadmError> {
        let args = ["certs", "renew", "all"].map(String::from);
        self.run(
            "certs renew",
            &args,
            self.join_timeout,
            Stdout::Stream,
            on_line,
        )
        .await
    }

    /// Stops the sandboxes of the control-plane pods (crictl, beside
    /// kubeadm): the kubelet starts them again, and they read the renewed
    /// certificates as they start. Returns how many were stopped.
    pub async fn restart_control_plane_pods(&self) -> Result<usize, KubeadmError> {
        let crictl = self.program.with_file_name("crictl");
        let endpoint = format!("--runtime-endpoint={CRI_ENDPOINT}");
        let list = [
            endpoint.clone(),
            "pods".into(),
            format!("--label={CONTROL_PLANE_LABEL}"),
            "--state=ready".into(),
            "--quiet".into(),
        ];
        let mut pods: Vec<String> = Vec::new();
        self.run_program(
            &crictl,
            "crictl pods",
            &list,
            self.join_timeout,
            Stdout::Stream,
            &mut |line: &str| {
                let id = line.trim();
                let plausible = !id.is_empty()
                    && id.len() <= 128
                    && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
                if plausible && pods.len() < MAX_PODS {
                    pods.push(id.to_owned());
                }
            },
        )
        .await?;
        if pods.is_empty() {
            return Ok(0);
        }
        let mut stop = vec![endpoint, "stopp".into()];
        stop.extend(pods.iter().cloned());
        self.run_program(
            &crictl,
            "crictl stopp",
            &stop,
            self.join_timeout,
            Stdout::Stream,
            &mut |line: &str| tracing::debug!(line, "crictl"),
        )
        .await?;
        Ok(pods.len())
    }

    /// Renews kubeadm's certificates under this root if the first of them
    /// ends within [`RENEW_BEFORE`] of `now`, and restarts the control-plane
    /// pods. Returns the certificate that was due, `None` if none was.
    pub async fn renew_certificates_if_due(
        &self,
        now: SystemTime,
    ) -> Result<Option<Ending>, RenewalError> {
        let root = self.root.clone();
        let first = tokio::task::spawn_blocking(move || first_to_end(&root))
            .await
            .map_err(|e| RenewalError::Read(std::io::Error::other(e.to_string())))?
            .map_err(RenewalError::Read)?;
        let Some(first) = first.filter(|f| due(f, now)) else {
            return Ok(None);
        };
        tracing::warn!(
            certificate = %first.path.display(),
            ends = %unix_seconds(first.at),
            "kubeadm's certificates end soon; renewing them"
        );
        self.renew_certificates(&mut |line: &str| tracing::info!(line, "kubeadm certs renew"))
            .await
            .map_err(RenewalError::Renew)?;
        let restarted = self
            .restart_control_plane_pods()
            .await
            .map_err(RenewalError::Restart)?;
        tracing::info!(
            restarted,
            "kubeadm's certificates renewed; the control-plane pods restarted with them"
        );
        Ok(Some(first))
    }
}

/// Seconds since the Unix epoch, for a log line.
fn unix_seconds(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Why a renewal of kubeadm's certificates did not complete.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RenewalError {
    /// The certificates could not be read.
    #[error("reading kubeadm's certificates")]
    Read(#[source] std::io::Error),
    /// `kubeadm certs renew all` failed.
    #[error("renewing kubeadm's certificates")]
    Renew(#[source] KubeadmError),
    /// The renewed certificates are in place, but the control-plane pods
    /// could not be restarted to read them.
    #[error("restarting the control-plane pods after the renewal")]
    Restart(#[source] KubeadmError),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A certificate is due within 30 days of its end and after it; not
    /// before.
    #[test]
    fn a_certificate_is_due_within_thirty_days_of_its_end() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let ending = |days: i64| Ending {
            path: PathBuf::from("apiserver.crt"),
            at: if days >= 0 {
                now + Duration::from_secs(days.unsigned_abs() * 86_400)
            } else {
                now - Duration::from_secs(days.unsigned_abs() * 86_400)
            },
        };
        assert!(!due(&ending(31), now));
        assert!(due(&ending(30), now));
        assert!(due(&ending(1), now));
        assert!(due(&ending(-5), now));
    }
}
