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
                eprintln!("{endpoint}: FAILED: {}", crate::printable::error_chain(&e));
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
    let (cp, challenge, proof) = operator.authorise(endpoint, ADMIN_KUBECONFIG, &[]).await?;
    // Held to the kubeconfig's bound as it arrives: the member's client
    // takes a whole registry (32 MiB).
    let mut client = cp
        .client
        .clone()
        .max_decoding_message_size(MAX_ADMIN_KUBECONFIG_BYTES + 1024);
    let kubeconfig = Zeroizing::new(
        answer(
            endpoint,
            client.admin_kubeconfig(AdminKubeconfigRequest { challenge, proof }),
        )
        .await?
        .kubeconfig,
    );
    check(endpoint, &kubeconfig)?;
    Ok(kubeconfig)
}

/// What a user of an admin kubeconfig may hold: kubeadm's client
/// certificate and key, as data. Every other credential field makes
/// kubectl run a command (`exec`, an `auth-provider`, whose configuration
/// can name one) or read a file of the operator's (`tokenFile`,
/// `client-key`) and send what it read to the server the file names.
const USER_FIELDS: [&str; 2] = ["client-certificate-data", "client-key-data"];

/// Refuses an admin kubeconfig the operator should not keep: empty, larger
/// than a control plane sends, not a YAML mapping, with a YAML merge key
/// (`<<`, which kubectl applies and this parser does not, so a field could
/// hide behind it) or tag anywhere, or with a user holding anything but
/// [`USER_FIELDS`]. kubeadm's admin kubeconfig carries a client
/// certificate and key; a node compromised after its attestation could
/// otherwise have the operator's next kubectl run a program of its choice
/// on the operator's machine, or send it one of the operator's files.
pub(crate) fn check(endpoint: &str, kubeconfig: &[u8]) -> anyhow::Result<()> {
    check_size(endpoint, kubeconfig)?;
    let parsed: serde_yaml::Value = serde_yaml::from_slice(kubeconfig)
        .map_err(|_| anyhow::anyhow!("{endpoint} sent a kubeconfig that is not YAML"))?;
    if let Some(what) = beyond_plain_yaml(&parsed) {
        bail!(
            "{endpoint} sent a kubeconfig with {what}, which kubectl may read otherwise than \
             this check: a control plane sends plain YAML; nothing was written"
        );
    }
    let serde_yaml::Value::Mapping(top) = parsed else {
        bail!("{endpoint} sent a kubeconfig that is not a YAML mapping");
    };
    let users = match top.get("users") {
        None | Some(serde_yaml::Value::Null) => return Ok(()),
        Some(serde_yaml::Value::Sequence(users)) => users,
        Some(_) => bail!("{endpoint} sent a kubeconfig whose users are not a list"),
    };
    for user in users {
        let credentials = match user.get("user") {
            None | Some(serde_yaml::Value::Null) => continue,
            Some(serde_yaml::Value::Mapping(credentials)) => credentials,
            Some(_) => bail!("{endpoint} sent a kubeconfig with a user that is not a mapping"),
        };
        for (key, value) in credentials {
            let key = key.as_str().unwrap_or("a field that is not a string");
            if USER_FIELDS.contains(&key) || value.is_null() {
                continue;
            }
            if ["exec", "auth-provider"].contains(&key) {
                bail!(
                    "{endpoint} sent a kubeconfig whose user gets its credentials from a \
                     command (`{key}`), which kubectl would run on this machine: a control \
                     plane sends a client certificate; nothing was written"
                );
            }
            bail!(
                "{endpoint} sent a kubeconfig whose user holds `{}`: a control plane sends a \
                 client certificate and key alone, and kubectl could read a file of this \
                 machine's or run a command for another field; nothing was written",
                key.escape_debug()
            );
        }
    }
    Ok(())
}

/// The first YAML merge key (`<<`) or tag in `value`, named; `None` if
/// it has neither.
fn beyond_plain_yaml(value: &serde_yaml::Value) -> Option<&'static str> {
    match value {
        serde_yaml::Value::Mapping(map) => map.iter().find_map(|(key, value)| {
            if key.as_str() == Some("<<") {
                Some("a YAML merge key (`<<`)")
            } else {
                beyond_plain_yaml(key).or_else(|| beyond_plain_yaml(value))
            }
        }),
        serde_yaml::Value::Sequence(items) => items.iter().find_map(beyond_plain_yaml),
        serde_yaml::Value::Tagged(_) => Some("a YAML tag"),
        _ => None,
    }
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

    /// Attacker's move, from a control plane compromised after it was
    /// attested: send an admin kubeconfig whose user runs a command, so
    /// that the operator's next kubectl runs it. Refused, in block and
    /// flow style; kubeadm's shape (certificate data) is taken.
    #[test]
    fn a_kubeconfig_that_would_run_a_command_is_refused() {
        let kubeadms = b"apiVersion: v1\nkind: Config\nclusters:\n- name: k\n  cluster:\n    server: https://10.0.0.1:6443\nusers:\n- name: kubernetes-admin\n  user:\n    client-certificate-data: AAAA\n    client-key-data: BBBB\n";
        check("cp:9000", kubeadms).unwrap();
        check("cp:9000", b"apiVersion: v1\n").unwrap();
        for hostile in [
            &b"users:\n- name: a\n  user:\n    exec:\n      command: sh\n      args: [-c, id]\n"[..],
            b"users: [{name: a, user: {auth-provider: {name: gcp, config: {cmd-path: /bin/sh}}}}]",
            b"{\"users\": [{\"name\": \"a\", \"user\": {\"exec\": {\"command\": \"sh\"}}}]}",
        ] {
            let e = check("cp:9000", hostile).unwrap_err().to_string();
            assert!(e.contains("from a command"), "{e}");
        }
        for odd in [&b"- a list\n"[..], b"users: 3\n", b"{unclosed"] {
            assert!(check("cp:9000", odd).is_err());
        }
    }

    /// The same move behind what this parser reads otherwise than kubectl
    /// (a merge key, which kubectl applies; a tag), and a user that makes
    /// kubectl send one of the operator's files as its token: refused.
    #[test]
    fn a_kubeconfig_hiding_a_credential_or_reading_a_local_file_is_refused() {
        for (hostile, said) in [
            (
                &b"users:\n- name: a\n  user:\n    <<: {exec: {command: sh, args: [-c, id]}}\n"[..],
                "merge key",
            ),
            (
                b"users:\n- name: a\n  user: {<<: {client-key-data: AA}, client-certificate-data: AA}\n",
                "merge key",
            ),
            (b"users:\n- name: a\n  user: !cmd {client-key-data: AA}\n", "YAML tag"),
            (
                b"users:\n- name: a\n  user:\n    tokenFile: /home/op/.vault-token\n",
                "`tokenFile`",
            ),
            (
                b"users:\n- name: a\n  user:\n    client-key: /home/op/.ssh/id_ed25519\n",
                "`client-key`",
            ),
            (b"users:\n- name: a\n  user: [exec]\n", "not a mapping"),
        ] {
            let e = check("cp:9000", hostile).unwrap_err().to_string();
            assert!(e.contains(said), "{said}: {e}");
        }
        // A user with no credentials, as a stand-in sends before it has any.
        check("cp:9000", b"users:\n- name: a\n  user:\n").unwrap();
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
