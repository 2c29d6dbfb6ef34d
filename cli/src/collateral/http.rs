//! One bounded HTTP GET for the vendors' collateral services: rustls with
//! the *ring* provider and the Mozilla roots, a deadline on the whole
//! exchange, and a size limit checked before and while the body arrives.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use reqwest::StatusCode;

use crate::printable::printable;

/// Why a GET failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The TLS configuration could not be built.
    #[error("configuring TLS")]
    Tls(#[source] rustls::Error),
    /// The HTTP client could not be built.
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
    /// The request failed before a complete answer (connection, TLS, a
    /// body cut short).
    #[error("GET {url}")]
    Request {
        /// The URL.
        url: String,
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// No complete answer within the timeout.
    #[error("GET {url}: no complete answer within {after:?}")]
    Timeout {
        /// The URL.
        url: String,
        /// The timeout.
        after: Duration,
    },
    /// The server answered with a status other than 200.
    #[error("GET {url}: the server answered {status}{}", if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    Status {
        /// The URL.
        url: String,
        /// The status.
        status: StatusCode,
        /// The start of the server's body or its `Error-Message` header.
        detail: String,
    },
    /// The body is larger than the limit for what was asked.
    #[error("GET {url}: the answer is larger than {limit} bytes")]
    TooLarge {
        /// The URL.
        url: String,
        /// The limit.
        limit: usize,
    },
}

/// A complete answer.
#[derive(Debug)]
pub struct Answer {
    /// The body.
    pub body: Vec<u8>,
    /// The response headers.
    pub headers: HeaderMap,
    /// Time from the request to the last byte.
    pub elapsed: Duration,
}

/// A client for bounded GETs.
pub struct Http {
    client: reqwest::Client,
    timeout: Duration,
}

impl Http {
    /// A client whose every GET must complete within `timeout`.
    pub fn new(timeout: Duration) -> Result<Self, HttpError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(HttpError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let client = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(timeout)
            .redirect(keel_installer::redirect_policy(3))
            .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(HttpError::Client)?;
        Ok(Self { client, timeout })
    }

    /// GETs `url`; the body may hold at most `limit` bytes.
    pub async fn get(&self, url: &str, limit: usize) -> Result<Answer, HttpError> {
        let started = Instant::now();
        let exchange = self.exchange(url, limit);
        let (body, headers) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| HttpError::Timeout {
                url: url.to_owned(),
                after: self.timeout,
            })??;
        Ok(Answer {
            body,
            headers,
            elapsed: started.elapsed(),
        })
    }

    async fn exchange(&self, url: &str, limit: usize) -> Result<(Vec<u8>, HeaderMap), HttpError> {
        let request = |source| HttpError::Request {
            url: url.to_owned(),
            source,
        };
        let too_large = || HttpError::TooLarge {
            url: url.to_owned(),
            limit,
        };
        let mut response = self.client.get(url).send().await.map_err(request)?;
        let status = response.status();
        if status != StatusCode::OK {
            let header = response
                .headers()
                .get("Error-Message")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let mut detail = header.unwrap_or_default();
            if detail.is_empty() {
                if let Ok(Some(chunk)) = response.chunk().await {
                    let start = chunk.get(..chunk.len().min(120)).unwrap_or_default();
                    detail = String::from_utf8_lossy(start).trim().to_owned();
                }
            }
            // The server's words reach the operator's terminal.
            let detail = printable(&detail).to_string();
            return Err(HttpError::Status {
                url: url.to_owned(),
                status,
                detail,
            });
        }
        if response.content_length().is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let headers = response.headers().clone();
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(request)? {
            if body.len() + chunk.len() > limit {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok((body, headers))
    }
}

/// A header's value, percent-decoded (Intel's PCS sends certificate chains
/// URL-encoded); `None` when absent or not text.
pub fn decoded_header(headers: &HeaderMap, name: &str) -> Option<String> {
    let raw = headers.get(name)?.to_str().ok()?.as_bytes();
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        match (raw[i], raw.get(i + 1).copied(), raw.get(i + 2).copied()) {
            (b'%', Some(h), Some(l)) => match (hex(h), hex(l)) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                }
                _ => return None,
            },
            (b'%', _, _) => return None,
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_testkit::mirror::{Fault, MirrorServer};

    /// A collateral server's error page reaches the operator's terminal
    /// escaped: it may not set the window title or move the cursor.
    #[test]
    fn an_error_page_reaches_the_terminal_escaped() {
        let mirror = MirrorServer::start().unwrap();
        mirror.serve("/crl", &b"\x1b]0;owned\x07\x1b[2J denied"[..]);
        mirror.fail_always("/crl", Fault::StatusWithBody(403));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let http = Http::new(Duration::from_secs(5)).unwrap();
        let e = runtime
            .block_on(http.get(&mirror.url("/crl"), 1024))
            .unwrap_err();
        let shown = e.to_string();
        assert!(
            !shown.contains('\x1b') && !shown.contains('\x07'),
            "{shown:?}"
        );
        assert!(shown.contains("\\u{1b}]0;owned"), "{shown:?}");
    }

    #[test]
    fn percent_decoding_keeps_plus_signs_and_refuses_bad_escapes() {
        let mut headers = HeaderMap::new();
        headers.insert("a", "-----BEGIN%20CERT%2B+x%0A".parse().unwrap());
        headers.insert("b", "bad%2".parse().unwrap());
        headers.insert("c", "bad%zz".parse().unwrap());
        assert_eq!(
            decoded_header(&headers, "a").as_deref(),
            Some("-----BEGIN CERT++x\n")
        );
        assert_eq!(decoded_header(&headers, "b"), None);
        assert_eq!(decoded_header(&headers, "c"), None);
        assert_eq!(decoded_header(&headers, "missing"), None);
    }
}
