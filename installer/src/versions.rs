//! The supported Kubernetes versions and their components.
//!
//! The table is `data/k8s-components.json`, embedded at build time: upstream
//! URLs, `sha256:` hashes and install paths for one pinned patch per
//! supported minor version, and a default. It is parsed and checked on first
//! use. To add a version, add an entry to that file (one `"vX.Y.Z"` key with
//! its components) and run this crate's tests.
//!
//! Rules:
//! * `vX.Y` resolves to the pinned patch of that minor; `vX.Y.Z` is accepted
//!   only when it is that pinned patch; anything else is refused with the
//!   list of supported versions.
//! * Every component has a hash. The control-plane image pins are `data:`
//!   URLs whose content is inline; where the file leaves their hash empty it
//!   is computed from that content, so no entry of the table is unchecked.
//!   An empty hash on a network URL is a table error.
//! * `sandbox_image`, where given, is the pod sandbox ("pause") image the
//!   node's container runtime uses with that version, pinned by digest
//!   (`name:tag@sha256:<hex>`). The image's containerd configuration names
//!   the same one (a test checks that every version agrees with it).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use serde::Deserialize;

use crate::component::{Component, ComponentError, Source};
use crate::digest::Sha256Digest;

/// The embedded versions table.
const EMBEDDED: &str = include_str!("../data/k8s-components.json");

/// A Kubernetes version `vMAJOR.MINOR.PATCH`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KubernetesVersion {
    major: u32,
    minor: u32,
    patch: u32,
}

/// A requested version: a minor (`v1.31`) or a patch (`v1.31.13`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Requested {
    Minor(u32, u32),
    Patch(KubernetesVersion),
}

impl KubernetesVersion {
    /// `vMAJOR.MINOR`.
    pub fn minor_string(&self) -> String {
        format!("v{}.{}", self.major, self.minor)
    }

    /// Whether a running cluster may move from `self` to `target`, by
    /// Kubernetes' version skew policy for `kubeadm upgrade`: forward only,
    /// within the major version, at most one minor version at a time.
    pub fn upgrade_to(&self, target: KubernetesVersion) -> Result<(), UpgradeStepError> {
        if target == *self {
            return Err(UpgradeStepError::Same(*self));
        }
        if target < *self {
            return Err(UpgradeStepError::Downgrade {
                from: *self,
                to: target,
            });
        }
        if target.major != self.major || target.minor > self.minor + 1 {
            return Err(UpgradeStepError::SkipsMinor {
                from: *self,
                to: target,
            });
        }
        Ok(())
    }
}

/// Why one version may not follow another in an upgrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UpgradeStepError {
    /// The node already runs the version.
    #[error("the node already runs Kubernetes {0}")]
    Same(KubernetesVersion),
    /// An older version.
    #[error("Kubernetes {to} is older than {from}: downgrades are refused")]
    Downgrade {
        /// The running version.
        from: KubernetesVersion,
        /// The requested version.
        to: KubernetesVersion,
    },
    /// More than one minor version ahead, or another major version.
    #[error("Kubernetes {from} can move to the next minor version at most, not {to}")]
    SkipsMinor {
        /// The running version.
        from: KubernetesVersion,
        /// The requested version.
        to: KubernetesVersion,
    },
}

impl fmt::Display for KubernetesVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// A version string is not `vMAJOR.MINOR.PATCH`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not a vMAJOR.MINOR.PATCH version")]
pub struct ParseVersionError;

impl FromStr for KubernetesVersion {
    type Err = ParseVersionError;

    fn from_str(s: &str) -> Result<Self, ParseVersionError> {
        match parse_requested(s) {
            Some(Requested::Patch(v)) => Ok(v),
            _ => Err(ParseVersionError),
        }
    }
}

/// Parses `vX.Y` or `vX.Y.Z` (decimal, no leading zeros, no sign).
fn parse_requested(s: &str) -> Option<Requested> {
    let number = |p: &str| -> Option<u32> {
        let canonical = !p.is_empty()
            && p.bytes().all(|b| b.is_ascii_digit())
            && (p == "0" || !p.starts_with('0'));
        canonical.then(|| p.parse().ok()).flatten()
    };
    let parts: Vec<&str> = s.strip_prefix('v')?.split('.').collect();
    match parts.as_slice() {
        [major, minor] => Some(Requested::Minor(number(major)?, number(minor)?)),
        [major, minor, patch] => Some(Requested::Patch(KubernetesVersion {
            major: number(major)?,
            minor: number(minor)?,
            patch: number(patch)?,
        })),
        _ => None,
    }
}

/// One supported version and its components, in install order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionEntry {
    version: KubernetesVersion,
    components: Vec<Component>,
    sandbox_image: Option<String>,
}

impl VersionEntry {
    /// The pinned patch version.
    pub fn version(&self) -> KubernetesVersion {
        self.version
    }

    /// The components, in install order.
    pub fn components(&self) -> &[Component] {
        &self.components
    }

    /// The pod sandbox image pinned for this version, if the table names one.
    pub fn sandbox_image(&self) -> Option<&str> {
        self.sandbox_image.as_deref()
    }
}

/// The table: one pinned patch per supported minor version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionsTable {
    default: KubernetesVersion,
    by_minor: BTreeMap<(u32, u32), VersionEntry>,
}

/// Why a versions table was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    /// The JSON does not have the expected shape.
    #[error("parsing the versions table")]
    Parse(#[source] serde_json::Error),
    /// A key is not `vX.Y.Z`.
    #[error("versions table key {0:?} is not a vX.Y.Z version")]
    VersionKey(String),
    /// Two patches of one minor.
    #[error("versions table pins two patches of {0}")]
    DuplicateMinor(String),
    /// A version has no components.
    #[error("versions table entry {0} has no components")]
    NoComponents(String),
    /// A sandbox image that is not pinned by a SHA-256 digest.
    #[error("versions table entry {0}: sandbox_image must be name:tag@sha256:<64 hex digits>")]
    SandboxImage(String),
    /// A component is invalid.
    #[error("versions table entry {version}, component {index}")]
    Component {
        /// The version.
        version: String,
        /// The component's position.
        index: usize,
        /// What is wrong.
        #[source]
        source: ComponentError,
    },
    /// A network component without a hash.
    #[error(
        "versions table entry {version}, component {index}: a downloaded component needs a hash"
    )]
    MissingHash {
        /// The version.
        version: String,
        /// The component's position.
        index: usize,
    },
    /// A `decoded` annotation does not match the inline content.
    #[error("versions table entry {version}, component {index}: \"decoded\" does not match the data: URL")]
    DecodedMismatch {
        /// The version.
        version: String,
        /// The component's position.
        index: usize,
    },
    /// The default is not one of the versions.
    #[error("the default version {0:?} is not in the versions table")]
    Default(String),
}

/// Why a requested version was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// The embedded table is invalid (a build defect; its tests catch it).
    #[error("loading the embedded versions table")]
    Table(#[source] &'static TableError),
    /// The requested version is not supported.
    #[error("Kubernetes version {requested:?} is not supported; supported versions: {supported}")]
    Unsupported {
        /// The request (cut to 64 characters).
        requested: String,
        /// The supported minors and their pinned patches.
        supported: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FactFile {
    #[serde(rename = "source")]
    _source: Option<String>,
    default: String,
    versions: BTreeMap<String, FactVersion>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FactVersion {
    components: Vec<FactComponent>,
    /// The pod sandbox image, pinned by digest.
    sandbox_image: Option<String>,
    /// Add-on image pins (cloud controller managers, autoscaler): kept in the
    /// file as facts, not installed by the node agent.
    #[serde(rename = "images")]
    _images: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FactComponent {
    url: String,
    hash: String,
    install_path: String,
    extract: bool,
    /// For `data:` URLs: the decoded JSON, for reviewers. Checked on load.
    decoded: Option<serde_json::Value>,
}

impl VersionsTable {
    /// The embedded table, parsed and checked once.
    pub fn embedded() -> Result<&'static Self, &'static TableError> {
        static TABLE: OnceLock<Result<VersionsTable, TableError>> = OnceLock::new();
        TABLE.get_or_init(|| Self::parse(EMBEDDED)).as_ref()
    }

    /// Parses and checks a table in the format of `data/k8s-components.json`.
    pub fn parse(json: &str) -> Result<Self, TableError> {
        let file: FactFile = serde_json::from_str(json).map_err(TableError::Parse)?;
        let mut by_minor = BTreeMap::new();
        for (key, entry) in file.versions {
            let version: KubernetesVersion = key
                .parse()
                .map_err(|ParseVersionError| TableError::VersionKey(key.clone()))?;
            if entry.components.is_empty() {
                return Err(TableError::NoComponents(key));
            }
            if entry
                .sandbox_image
                .as_deref()
                .is_some_and(|i| !pinned_by_digest(i))
            {
                return Err(TableError::SandboxImage(key));
            }
            let components = entry
                .components
                .into_iter()
                .enumerate()
                .map(|(index, c)| table_component(&key, index, c))
                .collect::<Result<Vec<_>, _>>()?;
            let previous = by_minor.insert(
                (version.major, version.minor),
                VersionEntry {
                    version,
                    components,
                    sandbox_image: entry.sandbox_image,
                },
            );
            if previous.is_some() {
                return Err(TableError::DuplicateMinor(version.minor_string()));
            }
        }
        let default = file
            .default
            .parse::<KubernetesVersion>()
            .ok()
            .filter(|v| {
                by_minor
                    .get(&(v.major, v.minor))
                    .is_some_and(|e| e.version == *v)
            })
            .ok_or(TableError::Default(file.default))?;
        Ok(Self { default, by_minor })
    }

    /// Resolves a requested version: `v1.31` to its pinned patch, the pinned
    /// patch itself as given; anything else is refused.
    pub fn resolve(&self, requested: &str) -> Result<&VersionEntry, ResolveError> {
        let entry = match parse_requested(requested) {
            Some(Requested::Minor(major, minor)) => self.by_minor.get(&(major, minor)),
            Some(Requested::Patch(v)) => self
                .by_minor
                .get(&(v.major, v.minor))
                .filter(|e| e.version == v),
            None => None,
        };
        entry.ok_or_else(|| ResolveError::Unsupported {
            requested: requested.chars().take(64).collect(),
            supported: self.supported_list(),
        })
    }

    /// The version used when none is requested.
    pub fn default_entry(&self) -> Option<&VersionEntry> {
        self.by_minor.get(&(self.default.major, self.default.minor))
    }

    /// The default version.
    pub fn default_version(&self) -> KubernetesVersion {
        self.default
    }

    /// Every supported version, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = &VersionEntry> {
        self.by_minor.values()
    }

    /// "v1.30 (v1.30.14), v1.31 (v1.31.13), …"
    fn supported_list(&self) -> String {
        self.entries()
            .map(|e| format!("{} ({})", e.version.minor_string(), e.version))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Resolves `requested` in the embedded table.
pub fn resolve(requested: &str) -> Result<&'static VersionEntry, ResolveError> {
    VersionsTable::embedded()
        .map_err(ResolveError::Table)?
        .resolve(requested)
}

/// `name:tag@sha256:<64 lowercase hex>`, without whitespace.
fn pinned_by_digest(image: &str) -> bool {
    let Some((name, digest)) = image.split_once("@sha256:") else {
        return false;
    };
    !name.is_empty()
        && !name.contains(char::is_whitespace)
        && digest.len() == 64
        && digest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn table_component(
    version: &str,
    index: usize,
    fact: FactComponent,
) -> Result<Component, TableError> {
    let component_error = |source| TableError::Component {
        version: version.to_owned(),
        index,
        source,
    };
    // Parse with a placeholder hash first to learn the source; the real hash
    // is then either the file's or, for inline content only, computed.
    let placeholder = Sha256Digest::of(b"").to_string();
    let parsed = Component::new(&fact.url, &placeholder, &fact.install_path, fact.extract)
        .map_err(component_error)?;
    let hash = match (parsed.source(), fact.hash.as_str()) {
        (Source::Inline(content), "") => Sha256Digest::of(content),
        (Source::Remote(_), "") => {
            return Err(TableError::MissingHash {
                version: version.to_owned(),
                index,
            })
        }
        (_, given) => given.parse().map_err(|source| {
            component_error(ComponentError::ParseHash {
                url: crate::component::redact(&fact.url),
                source,
            })
        })?,
    };
    if let (Some(decoded), Source::Inline(content)) = (&fact.decoded, parsed.source()) {
        let actual: Option<serde_json::Value> = serde_json::from_slice(content).ok();
        if actual.as_ref() != Some(decoded) {
            return Err(TableError::DecodedMismatch {
                version: version.to_owned(),
                index,
            });
        }
    }
    Ok(parsed.with_hash(hash))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> &'static VersionsTable {
        VersionsTable::embedded().unwrap()
    }

    #[test]
    fn upgrades_move_forward_one_minor_at_most() {
        let v = |s: &str| s.parse::<KubernetesVersion>().unwrap();
        assert_eq!(v("v1.30.14").upgrade_to(v("v1.31.13")), Ok(()));
        assert_eq!(v("v1.31.2").upgrade_to(v("v1.31.13")), Ok(()));
        assert!(matches!(
            v("v1.31.13").upgrade_to(v("v1.30.14")),
            Err(UpgradeStepError::Downgrade { .. })
        ));
        assert!(matches!(
            v("v1.31.13").upgrade_to(v("v1.31.2")),
            Err(UpgradeStepError::Downgrade { .. })
        ));
        assert!(matches!(
            v("v1.30.14").upgrade_to(v("v1.32.9")),
            Err(UpgradeStepError::SkipsMinor { .. })
        ));
        assert!(matches!(
            v("v1.31.13").upgrade_to(v("v2.0.0")),
            Err(UpgradeStepError::SkipsMinor { .. })
        ));
        assert_eq!(
            v("v1.31.13").upgrade_to(v("v1.31.13")),
            Err(UpgradeStepError::Same(v("v1.31.13")))
        );
    }

    #[test]
    fn the_embedded_table_is_valid_and_complete() {
        let versions: Vec<String> = table().entries().map(|e| e.version().to_string()).collect();
        assert_eq!(versions, ["v1.30.14", "v1.31.13", "v1.32.9"]);
        assert_eq!(table().default_version().to_string(), "v1.31.13");
        assert_eq!(
            table().default_entry().unwrap().version().to_string(),
            "v1.31.13"
        );
        for entry in table().entries() {
            let paths: Vec<&str> = entry
                .components()
                .iter()
                .map(|c| c.install_path().as_str())
                .collect();
            for want in [
                "/opt/cni/bin",
                "/run/state/bin",
                "/run/state/bin/kubelet",
                "/run/state/bin/kubeadm",
                "/run/state/bin/kubectl",
                "/opt/kubernetes/patches/kube-apiserver+json.json",
                "/opt/kubernetes/patches/etcd+json.json",
            ] {
                assert!(paths.contains(&want), "{} lacks {want}", entry.version());
            }
        }
    }

    /// One image serves every supported version: its containerd
    /// configuration names the sandbox image each version pins.
    #[test]
    fn every_version_pins_the_sandbox_image_the_image_configures() {
        let config = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../mkosi/mkosi.extra/etc/containerd/config.toml"
        ))
        .unwrap();
        let configured: Vec<&str> = config
            .lines()
            .filter_map(|l| l.trim().strip_prefix("sandbox_image = "))
            .map(|v| v.trim_matches('"'))
            .collect();
        assert_eq!(configured.len(), 1, "{configured:?}");
        for entry in table().entries() {
            assert_eq!(
                entry.sandbox_image(),
                Some(configured[0]),
                "{}",
                entry.version()
            );
        }
    }

    /// kubeadm (init and join) starts the kubelet through the image's unit
    /// and expects it to read what kubeadm wrote: the bootstrap kubeconfig
    /// a join's TLS bootstrap starts from, and the per-node flags
    /// (`--hostname-override`, `--node-ip`) of kubeadm-flags.env. A unit
    /// without them leaves a joining kubelet with no credentials and
    /// registers every kubelet under the VM's hostname instead of the node
    /// name its certificate holds.
    #[test]
    fn the_kubelet_unit_takes_kubeadms_flags_and_bootstrap_kubeconfig() {
        let unit = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../mkosi/mkosi.extra/usr/lib/systemd/system/kubelet.service"
        ))
        .unwrap();
        let lines: Vec<&str> = unit.lines().map(str::trim).collect();
        assert!(
            lines.contains(&"EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env"),
            "{unit}"
        );
        let exec: Vec<&str> = lines
            .iter()
            .filter_map(|l| l.strip_prefix("ExecStart="))
            .collect();
        assert_eq!(exec.len(), 1, "{unit}");
        let args: Vec<&str> = exec[0].split_whitespace().collect();
        for wanted in [
            "--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf",
            "--kubeconfig=/etc/kubernetes/kubelet.conf",
            "--config=/var/lib/kubelet/config.yaml",
            "$KUBELET_KUBEADM_ARGS",
        ] {
            assert!(args.contains(&wanted), "{wanted} missing: {unit}");
        }
    }

    /// A file of the image's build, relative to the repository root.
    fn image_file(path: &str) -> String {
        let full = format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
    }

    /// What the components and the pods kubeadm writes need of the host,
    /// on a read-only root: the components table's URLs and containerd's
    /// pulls (registry.k8s.io) need a resolver and CA roots; kubeadm mounts
    /// the volume plugin directory into kube-controller-manager
    /// (DirectoryOrCreate, which cannot create it on erofs); its preflight
    /// reads the kernel configuration, which the root leaves out with
    /// /boot/ unless it is copied beside the modules.
    #[test]
    fn the_image_gives_kubernetes_what_it_needs_from_the_host() {
        let conf = image_file("mkosi/mkosi.conf");
        let packages: Vec<&str> = conf
            .lines()
            .skip_while(|l| l.trim() != "Packages=")
            .skip(1)
            .take_while(|l| {
                l.trim().is_empty() || l.starts_with(char::is_whitespace) || l.starts_with('#')
            })
            .filter(|l| !l.starts_with('#'))
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        for wanted in [
            "systemd",
            "containerd",
            "ca-certificates",
            "systemd-resolved",
        ] {
            assert!(packages.contains(&wanted), "{wanted} not in {packages:?}");
        }
        let resolv = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../mkosi/mkosi.extra/etc/resolv.conf");
        assert_eq!(
            std::fs::read_link(&resolv).ok(),
            Some(std::path::PathBuf::from(
                "../run/systemd/resolve/stub-resolv.conf"
            )),
            "{}",
            resolv.display()
        );
        let preset = image_file("mkosi/mkosi.extra/usr/lib/systemd/system-preset/10-keel.preset");
        assert!(
            preset
                .lines()
                .any(|l| l.trim() == "enable systemd-resolved.service"),
            "{preset}"
        );
        let resolved = image_file("mkosi/mkosi.extra/usr/lib/systemd/resolved.conf.d/10-keel.conf");
        for off in ["LLMNR=no", "MulticastDNS=no"] {
            assert!(resolved.lines().any(|l| l.trim() == off), "{resolved}");
        }
        let lib = image_file("scripts/image-lib.sh");
        assert!(
            lib.contains("FLEXVOLUME_DIR=usr/libexec/kubernetes/kubelet-plugins/volume/exec")
                && lib.contains("\"$1/$FLEXVOLUME_DIR\""),
            "image-lib.sh does not stage the volume plugin directory"
        );
        let postinst = image_file("mkosi/mkosi.postinst");
        assert!(
            postinst.contains("/boot/config-")
                && postinst.contains("/usr/lib/modules/$release/config"),
            "{postinst}"
        );
    }

    #[test]
    fn refuses_a_sandbox_image_without_digest() {
        let component = r#"{"url":"data:application/json;base64,W10=","hash":"","install_path":"/x","extract":false}"#;
        let with = |image: &str| {
            VersionsTable::parse(&ONE.replace("COMPONENT", component).replace(
                r#""components""#,
                &format!(r#""sandbox_image":"{image}","components""#),
            ))
        };
        let digest = "ab".repeat(32);
        assert!(with(&format!("registry.k8s.io/pause:3.10@sha256:{digest}")).is_ok());
        for bad in [
            "registry.k8s.io/pause:3.10".to_owned(),
            format!("@sha256:{digest}"),
            format!("registry.k8s.io/pause:3.10@sha256:{}", "AB".repeat(32)),
            format!("registry.k8s.io/pause:3.10@sha256:{}", &digest[2..]),
        ] {
            assert!(
                matches!(with(&bad), Err(TableError::SandboxImage(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn resolves_minor_and_pinned_patch_only() {
        assert_eq!(
            table().resolve("v1.31").unwrap().version().to_string(),
            "v1.31.13"
        );
        assert_eq!(
            table().resolve("v1.31.13").unwrap().version().to_string(),
            "v1.31.13"
        );
        assert_eq!(resolve("v1.32").unwrap().version().to_string(), "v1.32.9");
        for bad in [
            "v1.31.12",
            "v1.29",
            "1.31",
            "v1.31.013",
            "v1",
            "v1.31.13.1",
            "",
            "latest",
            "v1.31 ",
        ] {
            let err = table().resolve(bad).unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains("v1.30 (v1.30.14), v1.31 (v1.31.13), v1.32 (v1.32.9)"),
                "{bad:?}: {text}"
            );
        }
    }

    #[test]
    fn inline_components_get_their_hash_from_their_content() {
        let entry = table().resolve("v1.31").unwrap();
        let inline: Vec<&Component> = entry
            .components()
            .iter()
            .filter(|c| matches!(c.source(), Source::Inline(_)))
            .collect();
        assert_eq!(inline.len(), 4);
        for c in inline {
            let Source::Inline(content) = c.source() else {
                unreachable!()
            };
            assert_eq!(c.hash(), Sha256Digest::of(content));
            assert!(String::from_utf8_lossy(content).contains("registry.k8s.io/"));
        }
    }

    const ONE: &str = r#"{"default":"v1.31.1","versions":{"v1.31.1":{"components":[COMPONENT]}}}"#;

    fn with_component(c: &str) -> Result<VersionsTable, TableError> {
        VersionsTable::parse(&ONE.replace("COMPONENT", c))
    }

    #[test]
    fn refuses_a_downloaded_component_without_hash() {
        let err = with_component(
            r#"{"url":"https://dl.k8s.io/x","hash":"","install_path":"/x","extract":false}"#,
        )
        .unwrap_err();
        assert!(
            matches!(err, TableError::MissingHash { index: 0, .. }),
            "{err}"
        );
    }

    #[test]
    fn refuses_a_wrong_decoded_annotation_and_bad_defaults() {
        let err = with_component(
            r#"{"url":"data:application/json;base64,W10=","hash":"","install_path":"/x","extract":false,"decoded":{}}"#,
        )
        .unwrap_err();
        assert!(matches!(err, TableError::DecodedMismatch { .. }), "{err}");
        let ok = r#"{"url":"data:application/json;base64,W10=","hash":"","install_path":"/x","extract":false,"decoded":[]}"#;
        assert!(with_component(ok).is_ok());
        let bad_default = ONE
            .replace("COMPONENT", ok)
            .replace(r#""default":"v1.31.1""#, r#""default":"v1.31""#);
        assert!(matches!(
            VersionsTable::parse(&bad_default),
            Err(TableError::Default(_))
        ));
    }
}
