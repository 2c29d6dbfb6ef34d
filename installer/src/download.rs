//! The one downloader: streams a URL into a file while hashing it, retries
//! transient failures with capped exponential backoff and jitter, and gives
//! up at an overall deadline.
//!
//! * Transient (retried): connection and transport errors, a body cut short,
//!   no data for [`RetryPolicy::idle_timeout`], HTTP 408, 425, 429 and 5xx
//!   (a `Retry-After` in seconds is honoured up to the backoff cap), and a
//!   hash mismatch of a body delimited by the end of its connection (HTTP/1.x
//!   with neither Content-Length nor chunked framing): a connection cut
//!   part-way looks like the end of such a body.
//! * Permanent (returned at once): other HTTP statuses (404, 403, …), a body
//!   larger than [`DownloadConfig::max_bytes`], a hash mismatch of a body
//!   whose end is framed (Content-Length, chunked as the last transfer
//!   coding, HTTP/2), a local write error.
//!
//! Every attempt starts from byte zero: the file is truncated and the hash
//! restarted, so a retried download is verified as a whole.
//!
//! Redirects are followed, [`MAX_REDIRECTS`] at most, and never from HTTPS
//! to another scheme: the hash already fixes the bytes, but a download
//! begun over TLS does not go on in the clear, where anyone on the path
//! sees what the node fetches and can cut or stall it unnoticed. A plain
//! HTTP answer may redirect only within its own origin (scheme, host and
//! port) or to HTTPS: anyone on the path can forge that answer, and the
//! node must not become their way to send requests to addresses only it
//! reaches (its own loopback services, the cluster's network, a cloud's
//! metadata endpoint). Over HTTPS the target must prove a trusted name
//! before it sees any request.
//!
//! TLS is rustls with the *ring* provider and the Mozilla roots (plus any
//! extra roots for a private mirror), configured here rather than through a
//! process-wide default provider.

use std::fs::File;
use std::io::{Seek as _, SeekFrom, Write as _};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::Rng as _;
use reqwest::StatusCode;
use rustls::pki_types::CertificateDer;
use sha2::{Digest as _, Sha256};
use tokio::sync::mpsc;
use tokio::time::timeout;
use tracing::Instrument as _;
use url::Url;

use crate::component::redact;
use crate::digest::Sha256Digest;
use crate::progress::Progress;

/// When and how often to retry.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Backoff before the second attempt; doubled after each failure.
    pub initial_backoff: Duration,
    /// Upper bound of one backoff.
    pub max_backoff: Duration,
    /// Attempts in all, the first included.
    pub max_attempts: u32,
    /// Bound on the whole download, retries and backoff included.
    pub deadline: Duration,
    /// Bound on waiting for the response head or for the next body chunk.
    pub idle_timeout: Duration,
    /// Bound on establishing a connection (TCP and TLS).
    pub connect_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            max_attempts: 10,
            deadline: Duration::from_secs(15 * 60),
            idle_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(15),
        }
    }
}

/// Downloader settings.
#[derive(Debug, Clone)]
pub struct DownloadConfig {
    /// Retry and timeout policy.
    pub retry: RetryPolicy,
    /// Largest body accepted, in bytes.
    pub max_bytes: u64,
    /// Extra trusted root certificates (DER), e.g. a private mirror's CA.
    pub extra_roots: Vec<CertificateDer<'static>>,
}

/// Redirects one download follows at most (dl.k8s.io takes one or two).
pub const MAX_REDIRECTS: usize = 5;

/// Default bound on one component: the largest upstream binary (kubelet) is
/// under 100 MiB.
pub const DEFAULT_MAX_BYTES: u64 = 512 * 1024 * 1024;

impl Default for DownloadConfig {
    fn default() -> Self {
        Self {
            retry: RetryPolicy::default(),
            max_bytes: DEFAULT_MAX_BYTES,
            extra_roots: Vec::new(),
        }
    }
}

/// Why a download failed. URLs in messages are redacted (no credentials, no
/// query).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DownloadError {
    /// An extra root certificate was refused.
    #[error("adding an extra root certificate")]
    AddRoot(#[source] rustls::Error),
    /// The TLS configuration could not be built.
    #[error("configuring TLS")]
    ConfigureTls(#[source] rustls::Error),
    /// The HTTP client could not be built.
    #[error("building the HTTP client")]
    BuildClient(#[source] reqwest::Error),
    /// Sending the request or receiving the response head failed.
    #[error("requesting {url}")]
    Request {
        /// The URL (redacted).
        url: String,
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// The server answered with a status other than 200.
    #[error("{url}: the server answered {status}")]
    Status {
        /// The URL (redacted).
        url: String,
        /// The HTTP status.
        status: StatusCode,
        /// The server's `Retry-After`, when it gave one in seconds.
        retry_after: Option<Duration>,
    },
    /// Reading the body failed part-way.
    #[error("{url}: reading the body after {received} bytes")]
    ReadBody {
        /// The URL (redacted).
        url: String,
        /// Bytes received before the failure.
        received: u64,
        /// The transport error.
        #[source]
        source: reqwest::Error,
    },
    /// No response head or body data arrived for the idle timeout.
    #[error("{url}: no data for {idle:?}")]
    Idle {
        /// The URL (redacted).
        url: String,
        /// The idle timeout.
        idle: Duration,
    },
    /// The body ended, or broke off, before its announced length.
    #[error("{url}: body truncated: received {received} of {expected} bytes")]
    Truncated {
        /// The URL (redacted).
        url: String,
        /// Bytes received.
        received: u64,
        /// Bytes announced by Content-Length.
        expected: u64,
        /// The transport error that ended it, if any.
        #[source]
        source: Option<reqwest::Error>,
    },
    /// The body is larger than the limit.
    #[error("{url}: body larger than the limit of {limit} bytes")]
    TooLarge {
        /// The URL (redacted).
        url: String,
        /// The limit.
        limit: u64,
    },
    /// Writing the temporary file failed.
    #[error("writing the downloaded bytes")]
    Write(#[source] std::io::Error),
    /// The bytes do not have the expected hash.
    #[error("{url}: hash mismatch: expected {expected}, got {actual}")]
    HashMismatch {
        /// The URL (redacted).
        url: String,
        /// The hash the component list requires.
        expected: Sha256Digest,
        /// The hash of what was received.
        actual: Sha256Digest,
    },
    /// A body delimited by the end of its connection (HTTP/1.x, neither
    /// Content-Length nor chunked framing) ended with bytes of another hash:
    /// a cut connection looks the same as its end, so this is retried.
    #[error(
        "{url}: hash mismatch after {received} bytes of a body that ends with its connection \
         (no Content-Length, not chunked; the connection may have been cut): \
         expected {expected}, got {actual}"
    )]
    CloseDelimitedMismatch {
        /// The URL (redacted).
        url: String,
        /// Bytes received before the server closed the connection.
        received: u64,
        /// The hash the component list requires.
        expected: Sha256Digest,
        /// The hash of what was received.
        actual: Sha256Digest,
    },
    /// The overall deadline passed.
    #[error(
        "{url}: no complete download within the deadline of {deadline:?} ({attempts} attempts)"
    )]
    Deadline {
        /// The URL (redacted).
        url: String,
        /// The deadline.
        deadline: Duration,
        /// Attempts started.
        attempts: u32,
        /// The last transient failure, if an attempt had finished.
        #[source]
        last: Option<Box<DownloadError>>,
    },
    /// Every allowed attempt failed transiently.
    #[error("{url}: giving up after {attempts} attempts")]
    AttemptsExhausted {
        /// The URL (redacted).
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        #[source]
        last: Box<DownloadError>,
    },
}

/// Why a redirect was not followed (the source of a redirect error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedirectRefused {
    /// A redirect from HTTPS to another scheme.
    #[error("a redirect from https to {0} is refused")]
    Downgrade(String),
    /// More redirects than allowed.
    #[error("more than {0} redirects")]
    TooMany(usize),
    /// A plain-HTTP redirect to another origin over a scheme other than
    /// HTTPS.
    #[error("a plain http redirect to another origin ({0}) is refused; only https may leave it")]
    LeavesOrigin(String),
}

/// Follows at most `max` redirects, none of which leaves HTTPS once the
/// chain has used it, and none from plain HTTP to another origin unless to
/// HTTPS. The downloader's policy (with [`MAX_REDIRECTS`]), and the CLI's
/// for attestation collateral.
pub fn redirect_policy(max: usize) -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(move |attempt| {
        match refusal(attempt.url(), attempt.previous(), max) {
            Some(refused) => attempt.error(refused),
            None => attempt.follow(),
        }
    })
}

/// Why the redirect to `next` after the chain `previous` (the first URL
/// first) is not followed, if it is not.
fn refusal(next: &Url, previous: &[Url], max: usize) -> Option<RedirectRefused> {
    if previous.len() > max {
        return Some(RedirectRefused::TooMany(max));
    }
    let scheme = next.scheme();
    if scheme == "https" {
        return None;
    }
    if previous.iter().any(|u| u.scheme() == "https") {
        return Some(RedirectRefused::Downgrade(scheme.to_owned()));
    }
    match previous.last() {
        Some(from) if from.origin() == next.origin() => None,
        _ => Some(RedirectRefused::LeavesOrigin(
            next.origin().ascii_serialization(),
        )),
    }
}

impl DownloadError {
    /// Whether another attempt may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Request { source, .. } => !source.is_builder() && !source.is_redirect(),
            Self::Status { status, .. } => is_transient_status(*status),
            Self::ReadBody { .. }
            | Self::Idle { .. }
            | Self::Truncated { .. }
            | Self::CloseDelimitedMismatch { .. } => true,
            _ => false,
        }
    }
}

/// 408 Request Timeout, 425 Too Early, 429 Too Many Requests and every 5xx.
pub fn is_transient_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 425 | 429) || status.is_server_error()
}

/// What a finished download reports.
#[derive(Debug, Clone, Copy)]
pub struct Fetched {
    /// Bytes written (the whole body).
    pub bytes: u64,
    /// Attempts it took.
    pub attempts: u32,
    /// Time from the first request to the verified end.
    pub elapsed: Duration,
}

/// Streams URLs into files with verification and retries. Cheap to share:
/// it holds one connection pool.
#[derive(Debug, Clone)]
pub struct Downloader {
    client: reqwest::Client,
    config: DownloadConfig,
}

impl Downloader {
    /// Builds the HTTP client.
    pub fn new(config: DownloadConfig) -> Result<Self, DownloadError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        for cert in &config.extra_roots {
            roots.add(cert.clone()).map_err(DownloadError::AddRoot)?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(DownloadError::ConfigureTls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // HTTP/1.1 alone: one large body per request gains nothing from
        // HTTP/2, and whether this build could speak HTTP/2 at all depends
        // on which features other crates of the binary switch on in hyper.
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let client = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .redirect(redirect_policy(MAX_REDIRECTS))
            .connect_timeout(config.retry.connect_timeout)
            .user_agent(concat!("keel-installer/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(DownloadError::BuildClient)?;
        Ok(Self { client, config })
    }

    /// The settings in force.
    pub fn config(&self) -> &DownloadConfig {
        &self.config
    }

    /// Downloads `url` into `file` (truncating it first) and checks that the
    /// bytes hash to `expected`. On error the file's content is unspecified:
    /// the caller discards it.
    pub async fn download_into(
        &self,
        url: &Url,
        expected: Sha256Digest,
        file: &File,
        name: &str,
        progress: &dyn Progress,
    ) -> Result<Fetched, DownloadError> {
        let policy = &self.config.retry;
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(started + policy.deadline);
        let shown = redact(url.as_str());
        let mut last: Option<DownloadError> = None;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let span = tracing::debug_span!("attempt", url = %shown, attempt = attempts);
            let attempt = self
                .attempt(url, &shown, file, name, progress)
                .instrument(span);
            let outcome = tokio::time::timeout_at(deadline, attempt).await;
            let error = match outcome {
                Err(_elapsed) => {
                    return Err(DownloadError::Deadline {
                        url: shown,
                        deadline: policy.deadline,
                        attempts,
                        last: last.map(Box::new),
                    });
                }
                Ok(Ok(body)) if body.digest != expected => {
                    if !body.close_delimited {
                        return Err(DownloadError::HashMismatch {
                            url: shown,
                            expected,
                            actual: body.digest,
                        });
                    }
                    DownloadError::CloseDelimitedMismatch {
                        url: shown.clone(),
                        received: body.bytes,
                        expected,
                        actual: body.digest,
                    }
                }
                Ok(Ok(Body { bytes, .. })) => {
                    let elapsed = started.elapsed();
                    progress.finished(name, bytes, elapsed);
                    return Ok(Fetched {
                        bytes,
                        attempts,
                        elapsed,
                    });
                }
                Ok(Err(error)) => error,
            };
            if !error.is_transient() {
                return Err(error);
            }
            if attempts >= policy.max_attempts {
                return Err(DownloadError::AttemptsExhausted {
                    url: shown,
                    attempts,
                    last: Box::new(error),
                });
            }
            let delay = backoff(policy, attempts, &error);
            if tokio::time::Instant::now() + delay >= deadline {
                return Err(DownloadError::Deadline {
                    url: shown,
                    deadline: policy.deadline,
                    attempts,
                    last: Some(Box::new(error)),
                });
            }
            progress.retrying(name, attempts, delay, &error);
            tokio::time::sleep(delay).await;
            last = Some(error);
        }
    }

    /// One attempt: request, stream, hash.
    async fn attempt(
        &self,
        url: &Url,
        shown: &str,
        file: &File,
        name: &str,
        progress: &dyn Progress,
    ) -> Result<Body, DownloadError> {
        let idle = self.config.retry.idle_timeout;
        let idle_error = || DownloadError::Idle {
            url: shown.to_owned(),
            idle,
        };
        let mut response = timeout(idle, self.client.get(url.clone()).send())
            .await
            .map_err(|_| idle_error())?
            .map_err(|source| DownloadError::Request {
                url: shown.to_owned(),
                source: source.without_url(),
            })?;
        let status = response.status();
        if status != StatusCode::OK {
            return Err(DownloadError::Status {
                url: shown.to_owned(),
                status,
                retry_after: retry_after(&response),
            });
        }
        let total = response.content_length();
        let close_delimited =
            total.is_none() && ends_with_connection(response.version(), response.headers());
        let limit = self.config.max_bytes;
        if total.is_some_and(|t| t > limit) {
            return Err(DownloadError::TooLarge {
                url: shown.to_owned(),
                limit,
            });
        }
        progress.started(name, total);

        let writer = Writer::start(file)?;
        let mut received = 0u64;
        let streamed: Result<(), DownloadError> = async {
            loop {
                let chunk = timeout(idle, response.chunk())
                    .await
                    .map_err(|_| idle_error())?
                    .map_err(|source| {
                        // reqwest's errors show the whole URL, query
                        // included: the redacted one is in ours.
                        let source = source.without_url();
                        match total {
                            Some(expected) if received < expected => DownloadError::Truncated {
                                url: shown.to_owned(),
                                received,
                                expected,
                                source: Some(source),
                            },
                            _ => DownloadError::ReadBody {
                                url: shown.to_owned(),
                                received,
                                source,
                            },
                        }
                    })?;
                let Some(chunk) = chunk else { return Ok(()) };
                received = received.saturating_add(chunk.len() as u64);
                if received > limit {
                    return Err(DownloadError::TooLarge {
                        url: shown.to_owned(),
                        limit,
                    });
                }
                if !writer.push(chunk).await {
                    // The writer stopped on an error; `finish` reports it.
                    return Ok(());
                }
                progress.advanced(name, received, total);
            }
        }
        .await;
        let written = writer.finish().await;
        streamed?;
        let (digest, written) = written?;
        if let Some(expected) = total {
            if written < expected {
                return Err(DownloadError::Truncated {
                    url: shown.to_owned(),
                    received: written,
                    expected,
                    source: None,
                });
            }
        }
        Ok(Body {
            digest,
            bytes: written,
            close_delimited,
        })
    }
}

/// What one attempt received.
struct Body {
    digest: Sha256Digest,
    bytes: u64,
    /// Whether the body's end was only the end of its connection.
    close_delimited: bool,
}

/// Whether a response without Content-Length ends its body by closing the
/// connection: HTTP/1.x unless chunked is its last transfer coding (HTTP/2
/// ends a stream with a flag, and a chunked body with a last chunk, so a
/// cut there is an error, not an end).
fn ends_with_connection(version: reqwest::Version, headers: &reqwest::header::HeaderMap) -> bool {
    let http1 = matches!(
        version,
        reqwest::Version::HTTP_09 | reqwest::Version::HTTP_10 | reqwest::Version::HTTP_11
    );
    // As hyper reads it: the last Transfer-Encoding line's last coding.
    let chunked = headers
        .get_all(reqwest::header::TRANSFER_ENCODING)
        .iter()
        .next_back()
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.rsplit(',').next())
        .is_some_and(|coding| coding.trim().eq_ignore_ascii_case("chunked"));
    http1 && !chunked
}

/// Hashes and writes chunks on a blocking thread, so hashing and disk writes
/// overlap with receiving the next chunk and never block the async runtime.
struct Writer {
    sender: mpsc::Sender<Bytes>,
    task: tokio::task::JoinHandle<std::io::Result<(Sha256Digest, u64)>>,
}

/// Chunks in flight between the network and the writer thread.
const WRITER_QUEUE: usize = 64;

impl Writer {
    fn start(file: &File) -> Result<Self, DownloadError> {
        let mut file = file.try_clone().map_err(DownloadError::Write)?;
        let (sender, mut receiver) = mpsc::channel::<Bytes>(WRITER_QUEUE);
        let task = tokio::task::spawn_blocking(move || {
            file.set_len(0)?;
            file.seek(SeekFrom::Start(0))?;
            let mut hasher = Sha256::new();
            let mut written = 0u64;
            while let Some(chunk) = receiver.blocking_recv() {
                hasher.update(&chunk);
                file.write_all(&chunk)?;
                written += chunk.len() as u64;
            }
            file.flush()?;
            Ok((Sha256Digest::from_hasher(hasher), written))
        });
        Ok(Self { sender, task })
    }

    /// Queues a chunk; false when the writer has stopped.
    async fn push(&self, chunk: Bytes) -> bool {
        self.sender.send(chunk).await.is_ok()
    }

    /// Waits for every queued chunk to be written.
    async fn finish(self) -> Result<(Sha256Digest, u64), DownloadError> {
        drop(self.sender);
        match self.task.await {
            Ok(result) => result.map_err(DownloadError::Write),
            Err(join) => Err(DownloadError::Write(std::io::Error::other(join))),
        }
    }
}

/// The delay before attempt `failed + 1`: exponential from the initial
/// backoff, capped, with "equal jitter" (half fixed, half random) so that many
/// nodes retrying one mirror spread out. A server's `Retry-After` raises the
/// delay up to the cap.
fn backoff(policy: &RetryPolicy, failed: u32, error: &DownloadError) -> Duration {
    let exponent = failed.saturating_sub(1).min(30);
    let base = policy
        .initial_backoff
        .saturating_mul(1u32 << exponent)
        .min(policy.max_backoff);
    let half = base / 2;
    let jitter = if half.is_zero() {
        Duration::ZERO
    } else {
        rand::thread_rng().gen_range(Duration::ZERO..=half)
    };
    let delay = half + jitter;
    match error {
        DownloadError::Status {
            retry_after: Some(after),
            ..
        } => delay.max((*after).min(policy.max_backoff)),
        _ => delay,
    }
}

/// `Retry-After` given in seconds (the HTTP-date form is ignored).
fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    let value = response.headers().get(reqwest::header::RETRY_AFTER)?;
    let secs: u64 = value.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(list: &[&str]) -> Vec<Url> {
        list.iter().map(|u| Url::parse(u).unwrap()).collect()
    }

    #[test]
    fn only_an_http1_body_not_chunked_ends_with_its_connection() {
        use reqwest::header::{HeaderMap, HeaderValue, TRANSFER_ENCODING};
        use reqwest::Version;
        let coded = |codings: &[&'static str]| {
            let mut headers = HeaderMap::new();
            for coding in codings {
                headers.append(TRANSFER_ENCODING, HeaderValue::from_static(coding));
            }
            headers
        };
        assert!(ends_with_connection(Version::HTTP_11, &coded(&[])));
        assert!(ends_with_connection(Version::HTTP_10, &coded(&[])));
        assert!(!ends_with_connection(Version::HTTP_2, &coded(&[])));
        assert!(!ends_with_connection(
            Version::HTTP_11,
            &coded(&["chunked"])
        ));
        assert!(!ends_with_connection(
            Version::HTTP_11,
            &coded(&["gzip, Chunked"])
        ));
        assert!(!ends_with_connection(
            Version::HTTP_11,
            &coded(&["gzip", "chunked"])
        ));
        // Chunked not last: the body still ends with the connection.
        assert!(ends_with_connection(
            Version::HTTP_11,
            &coded(&["chunked, gzip"])
        ));
        assert!(ends_with_connection(Version::HTTP_11, &coded(&["gzip"])));
    }

    #[test]
    fn plain_http_redirects_stay_in_their_origin_or_go_to_https() {
        let refused = |next: &str, previous: &[&str]| {
            refusal(&Url::parse(next).unwrap(), &urls(previous), MAX_REDIRECTS)
        };
        let mirror = "http://mirror.example:8080/v1/kubelet";
        // Within the origin, or up to HTTPS anywhere: followed.
        assert!(refused("http://mirror.example:8080/blobs/1", &[mirror]).is_none());
        assert!(refused("https://cdn.example/kubelet", &[mirror]).is_none());
        // Anywhere else in the clear: the node's own loopback, another
        // port of the same host, another host, a link-local address.
        for next in [
            "http://127.0.0.1:10248/healthz",
            "http://mirror.example:8081/v1/kubelet",
            "http://mirror.example/v1/kubelet",
            "http://other.example:8080/v1/kubelet",
            "http://169.254.169.254/latest/meta-data/",
            "ftp://mirror.example:8080/v1/kubelet",
        ] {
            assert!(
                matches!(
                    refused(next, &[mirror]),
                    Some(RedirectRefused::LeavesOrigin(_))
                ),
                "{next}"
            );
        }
        // The origin as the URL standard has it: case, a default port
        // spelled out and credentials do not make another origin.
        let plain = "http://mirror.example/v1/kubelet";
        for next in [
            "HTTP://MIRROR.example/blobs/1",
            "http://mirror.example:80/blobs/1",
            "http://user:pass@mirror.example/blobs/1",
        ] {
            assert!(refused(next, &[plain]).is_none(), "{next}");
        }
        // Hops within the origin go on within it.
        let within = [mirror, "http://mirror.example:8080/blobs/1"];
        assert!(refused("http://mirror.example:8080/blobs/2", &within).is_none());
        assert!(refused("http://127.0.0.1/", &within).is_some());
        // Once HTTPS, always HTTPS, same origin or not.
        let via_tls = [mirror, "https://cdn.example/kubelet"];
        assert!(matches!(
            refused("http://cdn.example/kubelet", &via_tls),
            Some(RedirectRefused::Downgrade(_))
        ));
        // The refusal names the origin only: no path or query (which may
        // carry a credential) reaches the log.
        let text = refused("http://127.0.0.1:10248/x?token=secret", &[mirror])
            .unwrap()
            .to_string();
        assert!(text.contains("http://127.0.0.1:10248"), "{text}");
        assert!(!text.contains("secret") && !text.contains("/x"), "{text}");
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
            ..RetryPolicy::default()
        };
        let err = DownloadError::Write(std::io::Error::other("x"));
        for failed in 1..40 {
            let base = Duration::from_millis(100)
                .saturating_mul(1 << (failed - 1).min(30))
                .min(Duration::from_millis(1000));
            let d = backoff(&policy, failed, &err);
            assert!(d >= base / 2 && d <= base, "attempt {failed}: {d:?}");
        }
    }

    #[test]
    fn classifies_statuses() {
        for code in [408, 425, 429, 500, 502, 503, 504] {
            assert!(
                is_transient_status(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
        for code in [301, 400, 401, 403, 404, 410] {
            assert!(
                !is_transient_status(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
    }
}
