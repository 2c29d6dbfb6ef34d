//! `keel kubeconfig`: fetch the cluster's admin kubeconfig again from a
//! control plane, for a workspace whose `keel init` result was lost (the
//! connection broke, or the init outlasted `--timeout`, after the node
//! finished). The control planes named are asked in turn, each attested
//! as a member of the workspace's cluster and asked with the operator's
//! proof; the first kubeconfig sent is written to the workspace's
//! `keel-admin.conf` with mode 0600, never over a file there unless
//! `--force`.

use std::path::Path;
use std::time::Duration;

use anyhow::bail;
use keel_proto::operator::AdminKubeconfigRequest;
use keel_proto::MAX_ADMIN_KUBECONFIG_BYTES;
use keel_verifier::keys::kind::ADMIN_KUBECONFIG;
use zeroize::Zeroizing;

use crate::init::write_secret_file;
use crate::operator::{answer, Operator};
use crate::workspace::KUBECONFIG_FILE;

/// Why an existing kubeconfig is kept, and what to do.
const KUBECONFIG_KEPT: &str =
    "an existing kubeconfig is replaced only with --force: move it away, or pass --force";

/// Runs `keel kubeconfig`: `force` replaces a kubeconfig the workspace
/// holds.
pub async fn run(
    settings_path: &Path,
    workspace: &Path,
    endpoints: &[String],
    force: bool,
    wait: Duration,
) -> anyhow::Result<()> {
    crate::operator::require_endpoints(endpoints)?;
    let path = workspace.join(KUBECONFIG_FILE);
    // Said before anything is asked (the write refuses it again).
    let exists = path.symlink_metadata().is_ok();
    if exists && !force {
        bail!(
            "{} exists ({KUBECONFIG_KEPT}); nothing was fetched",
            path.display()
        );
    }
    let operator = Operator::load(settings_path, workspace, wait)?;
    // One control plane that does not answer (down, not finished) does not
    // keep the kubeconfig from the others.
    for endpoint in endpoints {
        let kubeconfig = match fetch(&operator, endpoint).await {
            Ok(kubeconfig) => kubeconfig,
            Err(e) => {
                eprintln!("{endpoint}: FAILED: {e:#}");
                continue;
            }
        };
        write_secret_file(&path, &kubeconfig, force, KUBECONFIG_KEPT)?;
        let replaced = if exists {
            "; replaced the one there"
        } else {
            ""
        };
        println!(
            "kubeconfig: {} (mode 0600, from {endpoint}{replaced})",
            path.display()
        );
        return Ok(());
    }
    bail!(
        "no control plane named sent the admin kubeconfig (each one's reason is above); \
         nothing was written"
    )
}

/// The admin kubeconfig of the control plane at `endpoint`.
async fn fetch(operator: &Operator, endpoint: &str) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    let (mut cp, challenge, proof) = operator.authorise(endpoint, ADMIN_KUBECONFIG, &[]).await?;
    let kubeconfig = Zeroizing::new(
        answer(
            endpoint,
            cp.client
                .admin_kubeconfig(AdminKubeconfigRequest { challenge, proof }),
        )
        .await?
        .kubeconfig,
    );
    check_size(endpoint, &kubeconfig)?;
    Ok(kubeconfig)
}

/// Refuses an empty kubeconfig, and one larger than a control plane sends.
fn check_size(endpoint: &str, kubeconfig: &[u8]) -> anyhow::Result<()> {
    if kubeconfig.is_empty() {
        bail!("{endpoint} sent an empty kubeconfig");
    }
    if kubeconfig.len() > MAX_ADMIN_KUBECONFIG_BYTES {
        bail!(
            "{endpoint} sent a kubeconfig of {} bytes, more than the {MAX_ADMIN_KUBECONFIG_BYTES} \
             a control plane sends",
            kubeconfig.len()
        );
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::MetadataExt as _;

    use super::*;

    fn write(path: &Path, data: &[u8], force: bool) -> anyhow::Result<()> {
        write_secret_file(path, data, force, KUBECONFIG_KEPT)
    }

    /// The kubeconfig goes in with mode 0600; a file there is kept unless
    /// `--force`, which replaces it whole; a link is never written
    /// through; no temporary file is left.
    #[test]
    fn the_kubeconfig_is_written_private_and_replaced_only_when_forced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(KUBECONFIG_FILE);
        write(&path, b"first", false).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);

        let refused = format!("{:#}", write(&path, b"second", false).unwrap_err());
        assert!(refused.contains("pass --force"), "{refused}");
        assert!(refused.contains(KUBECONFIG_FILE), "{refused}");
        assert_eq!(std::fs::read(&path).unwrap(), b"first");

        // A file of another mode, replaced: the new one is 0600.
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        write(&path, b"second", true).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);

        // A planted link, with --force or without: not followed.
        let link = dir.path().join("linked").join(KUBECONFIG_FILE);
        std::fs::create_dir(link.parent().unwrap()).unwrap();
        let target = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for force in [false, true] {
            assert!(write(&link, b"third", force).is_err(), "force {force}");
        }
        assert!(!target.exists());

        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, [KUBECONFIG_FILE, "linked"]);
    }

    #[test]
    fn an_empty_or_oversized_kubeconfig_is_refused() {
        check_size("cp:9000", b"apiVersion: v1\n").unwrap();
        check_size("cp:9000", &[b'k'; MAX_ADMIN_KUBECONFIG_BYTES]).unwrap();
        let e = check_size("cp:9000", b"").unwrap_err().to_string();
        assert_eq!(e, "cp:9000 sent an empty kubeconfig");
        let e = check_size("cp:9000", &[b'k'; MAX_ADMIN_KUBECONFIG_BYTES + 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("65537 bytes"), "{e}");
    }
}
