//! Mirror rewriting for air-gapped clusters: a base URL replaces the scheme
//! and host of every upstream URL, keeping the path, so
//! `https://dl.k8s.io/v1.31.13/bin/linux/amd64/kubelet` with the mirror
//! `http://10.0.0.5:8080/k8s/` is fetched from
//! `http://10.0.0.5:8080/k8s/v1.31.13/bin/linux/amd64/kubelet`.
//!
//! The upstream query is dropped: it is where a signed URL carries its
//! credential, which is for the upstream host, not for a mirror (that may
//! be reached over plain http).
//!
//! Only where the bytes come from changes: the expected hash, and the URL that
//! is measured, stay the upstream ones, so nodes behind different mirrors
//! produce the same measurements. `data:` URLs are never rewritten.

use url::Url;

/// A mirror base URL.
#[derive(Clone, PartialEq, Eq)]
pub struct Mirror {
    base: Url,
}

/// Why a mirror base URL was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MirrorError {
    /// The base URL does not parse.
    #[error("parsing the mirror base URL")]
    Parse(#[source] url::ParseError),
    /// The base URL is not http or https.
    #[error("the mirror base URL must be http or https, not {0:?}")]
    Scheme(String),
    /// The base URL has a query or fragment, which a path cannot be appended to.
    #[error("the mirror base URL must not have a query or fragment")]
    QueryOrFragment,
    /// The base URL carries a user name or password: it is part of the
    /// measured node config, which every node shows anyone who attests it.
    #[error(
        "the mirror base URL must not carry a user name or password (the node config, and so \
         the URL, is shown to anyone who attests the node)"
    )]
    Credentials,
}

impl Mirror {
    /// Parses a base URL such as `https://mirror.internal/k8s/`.
    pub fn new(base: &str) -> Result<Self, MirrorError> {
        let mut base = Url::parse(base).map_err(MirrorError::Parse)?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(MirrorError::Scheme(base.scheme().to_owned()));
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(MirrorError::QueryOrFragment);
        }
        if !base.username().is_empty() || base.password().is_some() {
            return Err(MirrorError::Credentials);
        }
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        Ok(Self { base })
    }

    /// The URL to fetch `upstream` from: its path below the base, without
    /// its query (a credential for the upstream host).
    pub fn rewrite(&self, upstream: &Url) -> Url {
        let mut url = self.base.clone();
        let path = format!(
            "{}{}",
            self.base.path(),
            upstream.path().trim_start_matches('/')
        );
        url.set_path(&path);
        url
    }
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Mirror")
            .field(&crate::component::redact(self.base.as_str()))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewrite(base: &str, upstream: &str) -> String {
        Mirror::new(base)
            .unwrap()
            .rewrite(&Url::parse(upstream).unwrap())
            .to_string()
    }

    #[test]
    fn replaces_scheme_and_host_and_keeps_the_path() {
        let up = "https://dl.k8s.io/v1.31.13/bin/linux/amd64/kubelet";
        assert_eq!(
            rewrite("http://127.0.0.1:8080", up),
            "http://127.0.0.1:8080/v1.31.13/bin/linux/amd64/kubelet"
        );
        assert_eq!(
            rewrite("http://127.0.0.1:8080/k8s", up),
            "http://127.0.0.1:8080/k8s/v1.31.13/bin/linux/amd64/kubelet"
        );
    }

    /// A signed upstream URL's query is a credential for the upstream
    /// host: a mirror (over plain http, anyone on the path) never sees it.
    #[test]
    fn the_upstream_query_is_not_sent_to_the_mirror() {
        let signed = "https://bucket.example/a/b.tgz?X-Amz-Signature=d0c5ec7e7#part";
        for base in ["http://10.0.0.5:8080/k8s/", "https://m.internal/"] {
            let url = Mirror::new(base)
                .unwrap()
                .rewrite(&Url::parse(signed).unwrap());
            assert_eq!(url.query(), None, "{base}");
            assert!(!url.as_str().contains("d0c5ec7e7"), "{url}");
            assert!(url.as_str().ends_with("/a/b.tgz"), "{url}");
        }
    }

    #[test]
    fn refuses_unusable_bases() {
        assert!(matches!(
            Mirror::new("ftp://m/"),
            Err(MirrorError::Scheme(_))
        ));
        assert!(matches!(
            Mirror::new("http://m/?a=b"),
            Err(MirrorError::QueryOrFragment)
        ));
        assert!(matches!(
            Mirror::new("not a url"),
            Err(MirrorError::Parse(_))
        ));
        for base in [
            "http://user:secret@m/k8s/",
            "https://user@m/",
            "http://:secret@m/",
        ] {
            assert!(
                matches!(Mirror::new(base), Err(MirrorError::Credentials)),
                "{base}"
            );
        }
    }
}
