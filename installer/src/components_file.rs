//! The components file an operator names (`keel init`'s settings,
//! `keel upgrade apply --components`): a JSON list of
//! `{url, hash, install_path, extract}`, one entry per component. The node
//! checks each component again ([`crate::Component::try_from`]); where the
//! cluster has a measurements signing key, a node takes such a list only
//! with a detached signature of [`signed_message`] (the file for one pinned
//! Kubernetes version), and parses the signed bytes itself with [`parse`].

use keel_proto::components::{Component, Components};

use crate::KubernetesVersion;

/// Largest components file read: a request carries the file beside the
/// list it parses to, within the operator API's bound on a request.
pub const MAX_COMPONENTS_FILE_BYTES: usize = 48 * 1024;

/// What a components file's signature covers: a fixed prefix (no other
/// signed document of the key starts with it), the pinned version the file
/// is for, and the file's exact bytes. A file signed for one version is no
/// signed list of another's: a plan cannot label old binaries as new.
pub fn signed_message(version: KubernetesVersion, file: &[u8]) -> Vec<u8> {
    let mut message = format!("keel components file\nkubernetes {version}\n").into_bytes();
    message.extend_from_slice(file);
    message
}

/// Why a components file does not parse.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ComponentsFileError {
    /// Larger than [`MAX_COMPONENTS_FILE_BYTES`].
    #[error("a components file is at most {MAX_COMPONENTS_FILE_BYTES} bytes")]
    TooLarge,
    /// Not a JSON list of components.
    #[error("not a components file (a JSON list of {{url, hash, install_path, extract}}): {0}")]
    Json(#[from] serde_json::Error),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ComponentJson {
    url: String,
    hash: String,
    install_path: String,
    #[serde(default)]
    extract: bool,
}

/// The components `bytes` (a components file) lists, in its order.
pub fn parse(bytes: &[u8]) -> Result<Components, ComponentsFileError> {
    if bytes.len() > MAX_COMPONENTS_FILE_BYTES {
        return Err(ComponentsFileError::TooLarge);
    }
    let list: Vec<ComponentJson> = serde_json::from_slice(bytes)?;
    Ok(Components {
        components: list
            .into_iter()
            .map(|c| Component {
                url: c.url,
                hash: c.hash,
                install_path: c.install_path,
                extract: c.extract,
            })
            .collect(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_signed_message_names_the_version() {
        let v = |s: &str| s.parse::<KubernetesVersion>().unwrap();
        let a = signed_message(v("v1.31.13"), b"[]");
        assert_eq!(a, b"keel components file\nkubernetes v1.31.13\n[]");
        assert_ne!(a, signed_message(v("v1.32.9"), b"[]"));
    }

    #[test]
    fn a_file_parses_to_its_list_and_nothing_else_does() {
        let file = br#"[{"url":"https://a/kubelet","hash":"sha256:00","install_path":"/run/state/bin/kubelet"},
            {"url":"https://a/cni.tgz","hash":"sha256:11","install_path":"/opt/cni/bin","extract":true}]"#;
        let parsed = parse(file).unwrap().components;
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].install_path, "/run/state/bin/kubelet");
        assert!(!parsed[0].extract && parsed[1].extract);
        for bad in [
            &br#"[{"url":"u","hash":"h","install_path":"p","other":1}]"#[..],
            br#"{"url":"u"}"#,
            b"",
        ] {
            assert!(matches!(parse(bad), Err(ComponentsFileError::Json(_))));
        }
        let huge = vec![b' '; MAX_COMPONENTS_FILE_BYTES + 1];
        assert!(matches!(parse(&huge), Err(ComponentsFileError::TooLarge)));
    }
}
