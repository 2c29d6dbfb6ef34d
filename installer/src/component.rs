//! The domain type of a Kubernetes component and its conversions to and from
//! the wire message `keel.components.v1.Component`.
//!
//! Parsing happens once, here: a [`Component`] always has a supported URL, a
//! real SHA-256 digest and an absolute, normalised install path. A wire
//! message with an empty hash is refused, unlike the reference system, which
//! silently installs such a component unchecked.

use std::fmt;
use std::path::{Component as PathPart, Path, PathBuf};

use base64::Engine as _;
use url::Url;

use crate::digest::{ParseDigestError, Sha256Digest};

/// Upper bound on the decoded content of a `data:` URL. Inline components are
/// small kubeadm patches; anything large belongs on a server.
pub const MAX_INLINE_BYTES: usize = 1024 * 1024;

/// Upper bound on the media type of a `data:` URL (the part before the
/// comma, `;base64` included). It is measured and logged as it is; the
/// longest one of RFC 2397's kind a component needs,
/// `text/plain;charset=utf-8;base64`, is 31 bytes.
pub const MAX_DATA_MEDIA_TYPE_BYTES: usize = 127;

/// Where a component's bytes come from.
#[derive(Clone, PartialEq, Eq)]
pub enum Source {
    /// Fetched over HTTP(S), possibly through a mirror.
    Remote(Url),
    /// Carried inline by a `data:` URL; never touches the network.
    Inline(Vec<u8>),
}

/// An absolute, normalised path to install a component at: no `.` or `..`
/// parts, not `/` itself, valid UTF-8 (it travels as a protobuf string).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct InstallPath(String);

/// One component: what to fetch, its digest, and where it goes. Its JSON
/// form is the four fields of the versions table (`url`, `hash`,
/// `install_path`, `extract`), checked on the way in as the wire form is.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "ComponentFields", into = "ComponentFields")]
pub struct Component {
    url: String,
    source: Source,
    hash: Sha256Digest,
    install_path: InstallPath,
    extract: bool,
}

/// Why a component was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ComponentError {
    /// The URL does not parse.
    #[error("parsing the component URL")]
    ParseUrl(#[source] url::ParseError),
    /// The URL scheme is not https, http or data.
    #[error("unsupported URL scheme {0:?}: only https, http and data are allowed")]
    Scheme(String),
    /// A `data:` URL is malformed.
    #[error("decoding the data: URL: {0}")]
    DecodeDataUrl(&'static str),
    /// A `data:` URL carries more than [`MAX_INLINE_BYTES`].
    #[error("the data: URL carries more than {MAX_INLINE_BYTES} bytes")]
    InlineTooLarge,
    /// The hash is missing or malformed.
    #[error("parsing the hash of {url}")]
    ParseHash {
        /// The component's URL (redacted).
        url: String,
        /// What was wrong with it.
        #[source]
        source: ParseDigestError,
    },
    /// The install path is not absolute and normalised.
    #[error("install path {path:?} {reason}")]
    InstallPath {
        /// The refused path.
        path: String,
        /// Which rule it broke.
        reason: &'static str,
    },
}

impl InstallPath {
    /// Checks and wraps an install path.
    pub fn new(path: &str) -> Result<Self, ComponentError> {
        let refuse = |reason| ComponentError::InstallPath {
            path: path.to_owned(),
            reason,
        };
        let p = Path::new(path);
        if !p.is_absolute() {
            return Err(refuse("is not absolute"));
        }
        let mut normal_parts = 0usize;
        for part in p.components() {
            match part {
                PathPart::RootDir => {}
                PathPart::Normal(_) => normal_parts += 1,
                PathPart::CurDir | PathPart::ParentDir | PathPart::Prefix(_) => {
                    return Err(refuse("contains . or .."));
                }
            }
        }
        // Path::components hides "a/./b" and "a//b"; the text must be canonical.
        if path.contains("/./")
            || path.contains("//")
            || path.ends_with("/.")
            || path.ends_with('/')
        {
            return Err(refuse("is not normalised"));
        }
        if normal_parts == 0 {
            return Err(refuse("names the root directory"));
        }
        Ok(Self(path.to_owned()))
    }

    /// The path as given (absolute).
    pub fn as_path(&self) -> &Path {
        Path::new(&self.0)
    }

    /// The path as text (always UTF-8).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The path below another root directory (as `DESTDIR` does):
    /// `/run/state/bin/kubelet` under `/tmp/x` is `/tmp/x/run/state/bin/kubelet`.
    pub fn under(&self, root: &Path) -> PathBuf {
        root.join(self.0.trim_start_matches('/'))
    }
}

impl fmt::Debug for InstallPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for InstallPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Component {
    /// Parses and checks a component.
    pub fn new(
        url: &str,
        hash: &str,
        install_path: &str,
        extract: bool,
    ) -> Result<Self, ComponentError> {
        let source = parse_source(url)?;
        let hash = hash.parse().map_err(|source| ComponentError::ParseHash {
            url: redact(url),
            source,
        })?;
        Ok(Self {
            url: url.to_owned(),
            source,
            hash,
            install_path: InstallPath::new(install_path)?,
            extract,
        })
    }

    /// The URL exactly as the component list gives it (upstream, before any
    /// mirror rewriting). This is what gets measured.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Where the bytes come from.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The expected SHA-256 of the downloaded (or inline) bytes.
    pub fn hash(&self) -> Sha256Digest {
        self.hash
    }

    /// The file to write, or with [`Component::extract`] the directory to
    /// unpack into.
    pub fn install_path(&self) -> &InstallPath {
        &self.install_path
    }

    /// Whether the payload is a gzip-compressed tar archive to unpack.
    pub fn extract(&self) -> bool {
        self.extract
    }

    /// A short name for logs and progress: the last URL path segment, or the
    /// install file name for inline content.
    pub fn name(&self) -> &str {
        let from_path = || {
            self.install_path
                .as_path()
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("component")
        };
        match &self.source {
            Source::Remote(url) => url
                .path_segments()
                .and_then(|mut s| s.next_back())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(from_path),
            Source::Inline(_) => from_path(),
        }
    }

    /// The same component with another expected hash (the versions table
    /// fills in the hash of inline content this way).
    pub(crate) fn with_hash(mut self, hash: Sha256Digest) -> Self {
        self.hash = hash;
        self
    }
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Remote(url) => f
                .debug_tuple("Remote")
                .field(&redact(url.as_str()))
                .finish(),
            Self::Inline(content) => write!(f, "Inline({} bytes)", content.len()),
        }
    }
}

impl fmt::Debug for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Component")
            .field("url", &redact(&self.url))
            .field("hash", &self.hash)
            .field("install_path", &self.install_path)
            .field("extract", &self.extract)
            .finish()
    }
}

/// The JSON form of a [`Component`].
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ComponentFields {
    url: String,
    hash: String,
    install_path: String,
    extract: bool,
}

impl TryFrom<ComponentFields> for Component {
    type Error = ComponentError;

    fn try_from(f: ComponentFields) -> Result<Self, Self::Error> {
        Self::new(&f.url, &f.hash, &f.install_path, f.extract)
    }
}

impl From<Component> for ComponentFields {
    fn from(c: Component) -> Self {
        Self {
            hash: c.hash.to_string(),
            install_path: c.install_path.as_str().to_owned(),
            extract: c.extract,
            url: c.url,
        }
    }
}

impl TryFrom<keel_proto::components::Component> for Component {
    type Error = ComponentError;

    fn try_from(wire: keel_proto::components::Component) -> Result<Self, Self::Error> {
        Self::new(&wire.url, &wire.hash, &wire.install_path, wire.extract)
    }
}

impl TryFrom<&keel_proto::components::Component> for Component {
    type Error = ComponentError;

    fn try_from(wire: &keel_proto::components::Component) -> Result<Self, Self::Error> {
        Self::new(&wire.url, &wire.hash, &wire.install_path, wire.extract)
    }
}

impl From<&Component> for keel_proto::components::Component {
    fn from(c: &Component) -> Self {
        Self {
            url: c.url.clone(),
            hash: c.hash.to_string(),
            install_path: c.install_path.as_str().to_owned(),
            extract: c.extract,
        }
    }
}

impl From<Component> for keel_proto::components::Component {
    fn from(c: Component) -> Self {
        Self::from(&c)
    }
}

/// Parses a component URL into its source.
fn parse_source(url: &str) -> Result<Source, ComponentError> {
    if let Some(rest) = strip_prefix_ignore_case(url, "data:") {
        return decode_data_url(rest).map(Source::Inline);
    }
    let parsed = Url::parse(url).map_err(ComponentError::ParseUrl)?;
    match parsed.scheme() {
        "https" | "http" => Ok(Source::Remote(parsed)),
        other => Err(ComponentError::Scheme(other.to_owned())),
    }
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// Decodes the part of a `data:` URL after the scheme (RFC 2397):
/// `[<mediatype>][;base64],<data>`.
fn decode_data_url(rest: &str) -> Result<Vec<u8>, ComponentError> {
    let (header, data) = rest
        .split_once(',')
        .ok_or(ComponentError::DecodeDataUrl("no comma before the data"))?;
    check_media_type(header)?;
    // Base64 needs 4 characters per 3 bytes; percent-encoding up to 3 per byte.
    if data.len() > MAX_INLINE_BYTES.saturating_mul(3) {
        return Err(ComponentError::InlineTooLarge);
    }
    let is_base64 = header
        .rsplit(';')
        .next()
        .is_some_and(|p| p.eq_ignore_ascii_case("base64"));
    let content = if is_base64 {
        base64::engine::general_purpose::STANDARD
            .decode(data)
            .map_err(|_| ComponentError::DecodeDataUrl("invalid base64"))?
    } else {
        percent_decode(data)?
    };
    if content.len() > MAX_INLINE_BYTES {
        return Err(ComponentError::InlineTooLarge);
    }
    Ok(content)
}

/// Refuses a `data:` URL's media type that is longer than
/// [`MAX_DATA_MEDIA_TYPE_BYTES`] or holds anything but printable ASCII
/// (no spaces or control characters): it goes into measurement records and
/// log lines unescaped.
fn check_media_type(header: &str) -> Result<(), ComponentError> {
    if header.len() > MAX_DATA_MEDIA_TYPE_BYTES {
        return Err(ComponentError::DecodeDataUrl(
            "the media type is longer than 127 bytes",
        ));
    }
    if !header.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ComponentError::DecodeDataUrl(
            "the media type holds a character that is not printable ASCII",
        ));
    }
    Ok(())
}

fn percent_decode(data: &str) -> Result<Vec<u8>, ComponentError> {
    let bytes = data.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex_pair = bytes
                .get(i + 1..i + 3)
                .ok_or(ComponentError::DecodeDataUrl("truncated percent escape"))?;
            let mut byte = [0u8; 1];
            hex::decode_to_slice(hex_pair, &mut byte)
                .map_err(|_| ComponentError::DecodeDataUrl("invalid percent escape"))?;
            out.push(byte[0]);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    Ok(out)
}

/// A URL fit for logs and error messages: user name, password and query
/// (where tokens live) are removed. Unparseable text is shown as a marker.
pub fn redact(url: &str) -> String {
    if let Some(rest) = strip_prefix_ignore_case(url, "data:") {
        // Inline content is not secret but can be long: show its media
        // type, if it is one a component may have.
        let media_type = rest.split(',').next().unwrap_or_default();
        if check_media_type(media_type).is_err() {
            return "data:<refused media type>,…".to_owned();
        }
        let header = url.split(',').next().unwrap_or("data:");
        return format!("{header},…");
    }
    match Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            let had_query = u.query().is_some();
            u.set_query(None);
            u.set_fragment(None);
            let mut shown = u.to_string();
            if had_query {
                shown.push_str("?…");
            }
            shown
        }
        Err(_) => "<unparseable URL>".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    /// Attacker's move: a component event that names an authorised hash
    /// at another path (a CNI plugin's bytes as the kubelet), or names the
    /// hash twice, so that a reader taking the last key sees another.
    /// Read back, a record is only of the component it was written for.
    #[test]
    fn a_measured_record_is_read_back_as_of_its_component_only() {
        use crate::installer::MeasuredComponent;
        let kubelet = Component::new(
            "https://dl.example/kubelet",
            H,
            "/run/state/bin/kubelet",
            false,
        )
        .unwrap();
        let record = MeasuredComponent::parse(&kubelet.measurement_record()).unwrap();
        assert!(record.records(&kubelet));
        let other = H.replace("e3b0", "e3b1");
        let component = |url: &str, hash: &str, path: &str, extract: bool| {
            Component::new(url, hash, path, extract).unwrap()
        };
        let kubelet_path = "/run/state/bin/kubelet";
        for (elsewhere, why) in [
            (
                component(
                    "https://dl.example/kubelet",
                    H,
                    "/opt/cni/bin/kubelet",
                    false,
                ),
                "path",
            ),
            (
                component("https://dl.example/kubelet", H, kubelet_path, true),
                "extracted",
            ),
            (
                component("https://dl.example/kubelet", &other, kubelet_path, false),
                "hash",
            ),
        ] {
            assert!(!record.records(&elsewhere), "{why}");
        }
        // From another mirror, the same bytes at the same place.
        assert!(record.records(&component(
            "https://mirror.example/k",
            H,
            kubelet_path,
            false
        )));
        let other = component("https://dl.example/kubelet", &other, kubelet_path, false);
        let text = String::from_utf8(kubelet.measurement_record()).unwrap();
        let twice = text.replacen(
            r#""hash":"#,
            &format!(r#""hash":"{}","hash":"#, other.hash()),
            1,
        );
        assert!(
            MeasuredComponent::parse(twice.as_bytes()).is_none(),
            "{twice}"
        );
        let more = text.replacen('{', r#"{"mode":"0755","#, 1);
        assert!(
            MeasuredComponent::parse(more.as_bytes()).is_none(),
            "{more}"
        );
        assert!(MeasuredComponent::parse(b"kubelet").is_none());
    }

    /// A signed mirror URL's credential is not measured: the event log
    /// goes to everyone who attests the node.
    #[test]
    fn the_measured_record_names_no_credential() {
        let c = Component::new(
            "https://user:pw123@mirror.example/v1/kubelet?X-Amz-Signature=d0c5ec7e7",
            H,
            "/run/state/bin/kubelet",
            false,
        )
        .unwrap();
        let record = String::from_utf8(c.measurement_record()).unwrap();
        assert!(
            record.starts_with(r#"{"url":"https://mirror.example/v1/kubelet?…","hash":"#),
            "{record}"
        );
        for secret in ["d0c5ec7e7", "pw123", "user"] {
            assert!(!record.contains(secret), "{record}");
            assert!(!c.description().contains(secret));
        }
    }

    #[test]
    fn round_trips_through_the_wire_type() {
        let c = Component::new(
            "https://dl.k8s.io/v1/kubelet",
            H,
            "/run/state/bin/kubelet",
            false,
        )
        .unwrap();
        let wire = keel_proto::components::Component::from(&c);
        assert_eq!(wire.hash, H);
        assert_eq!(Component::try_from(wire).unwrap(), c);
        assert_eq!(c.name(), "kubelet");
    }

    #[test]
    fn refuses_a_component_without_a_hash() {
        let wire = keel_proto::components::Component {
            url: "https://dl.k8s.io/v1/kubelet".into(),
            hash: String::new(),
            install_path: "/run/state/bin/kubelet".into(),
            extract: false,
        };
        let err = Component::try_from(wire).unwrap_err();
        assert!(matches!(
            err,
            ComponentError::ParseHash {
                source: ParseDigestError::Empty,
                ..
            }
        ));
    }

    #[test]
    fn json_is_the_four_table_fields_checked_on_the_way_in() {
        let c = Component::new(
            "https://example.com/kubelet",
            H,
            "/run/state/bin/kubelet",
            false,
        )
        .unwrap();
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"url": "https://example.com/kubelet", "hash": H,
                "install_path": "/run/state/bin/kubelet", "extract": false})
        );
        assert_eq!(
            serde_json::from_value::<Component>(json.clone()).unwrap(),
            c
        );
        let mut bad = json.clone();
        bad["hash"] = "sha256:00".into();
        assert!(serde_json::from_value::<Component>(bad).is_err());
        let mut extra = json;
        extra["decoded"] = serde_json::Value::Null;
        assert!(serde_json::from_value::<Component>(extra).is_err());
    }

    #[test]
    fn refuses_bad_install_paths_and_schemes() {
        for path in [
            "relative/x",
            "/",
            "/a/../b",
            "/a/./b",
            "/a//b",
            "/a/.",
            "/a/b/",
        ] {
            assert!(
                matches!(
                    Component::new("https://h/x", H, path, false),
                    Err(ComponentError::InstallPath { .. })
                ),
                "{path}"
            );
        }
        for url in ["file:///etc/passwd", "ftp://h/x"] {
            assert!(matches!(
                Component::new(url, H, "/x", false),
                Err(ComponentError::Scheme(_))
            ));
        }
    }

    #[test]
    fn decodes_data_urls() {
        let c = Component::new("data:application/json;base64,W10=", H, "/p.json", false).unwrap();
        assert_eq!(c.source(), &Source::Inline(b"[]".to_vec()));
        let c = Component::new("data:,a%20b", H, "/p", false).unwrap();
        assert_eq!(c.source(), &Source::Inline(b"a b".to_vec()));
        assert!(matches!(
            Component::new("data:;base64,!!", H, "/p", false),
            Err(ComponentError::DecodeDataUrl(_))
        ));
        assert!(matches!(
            Component::new("data:,%2", H, "/p", false),
            Err(ComponentError::DecodeDataUrl(_))
        ));
    }

    /// Whoever writes a components list gives an inline component a media
    /// type that forges lines in the node's log, or bloats every
    /// measurement record and log line that names it.
    #[test]
    fn a_data_url_media_type_that_is_long_or_has_control_characters_is_refused() {
        let longest = format!("text/plain;x={}", "a".repeat(127 - 13));
        for media_type in [
            "",
            ";base64",
            "text/plain;charset=utf-8;base64",
            longest.as_str(),
        ] {
            let url = format!("data:{media_type},YWJj");
            assert!(Component::new(&url, H, "/p", false).is_ok(), "{url}");
            assert_eq!(redact(&url), format!("data:{media_type},…"));
        }
        let too_long = format!("{longest}a");
        for media_type in [
            too_long.as_str(),
            "text/plain\n2024-01-01 INFO forged line",
            "text/plain\x1b[2J",
            "text/plain;charset=utf-8\r",
            "text/plain;x=a b",
            "text/plain;x=\u{e9}",
            "text/plain\u{7f}",
        ] {
            let url = format!("data:{media_type},YWJj");
            assert!(
                matches!(
                    Component::new(&url, H, "/p", false),
                    Err(ComponentError::DecodeDataUrl(_))
                ),
                "{url:?}"
            );
            assert_eq!(redact(&url), "data:<refused media type>,…");
        }
    }

    #[test]
    fn redacts_credentials_and_queries() {
        assert_eq!(
            redact("https://user:secret@mirror.example/x?token=abc"),
            "https://mirror.example/x?…"
        );
    }
}
