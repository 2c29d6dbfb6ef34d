//! Downloads that must fail cleanly — nothing at the install path, no
//! temporary file left, a clear error — and transient failures that must
//! be retried. All against the local mirror on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, Instant};

use keel_installer::{
    Component, ComponentError, DownloadError, InstallError, NoProgress, ParseDigestError,
    RetryPolicy, Sha256Digest,
};
use keel_proto::components::Component as WireComponent;
use keel_testkit::components::sha256;
use keel_testkit::mirror::{Fault, MirrorServer};
use support::{assert_nothing_installed, chain, fast_retries, file_component, installer, mode};

/// Records progress events as text.
#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<String>>);

impl keel_installer::Progress for Recorder {
    fn started(&self, _: &str, total: Option<u64>) {
        self.0
            .lock()
            .unwrap()
            .push(format!("start {}", total.unwrap()));
    }
    fn advanced(&self, _: &str, done: u64, _: Option<u64>) {
        self.0.lock().unwrap().push(format!("advance {done}"));
    }
    fn retrying(
        &self,
        _: &str,
        attempt: u32,
        _: Duration,
        error: &(dyn std::error::Error + 'static),
    ) {
        let status = error.to_string().contains("503");
        self.0.lock().unwrap().push(format!(
            "retry {attempt} {}",
            if status { "503" } else { "?" }
        ));
    }
    fn finished(&self, _: &str, bytes: u64, _: Duration) {
        self.0.lock().unwrap().push(format!("finish {bytes}"));
    }
}

/// Records the errors that retries were for, as the node logs them.
#[derive(Default)]
struct RetryLog(std::sync::Mutex<Vec<String>>);

impl keel_installer::Progress for RetryLog {
    fn started(&self, _: &str, _: Option<u64>) {}
    fn advanced(&self, _: &str, _: u64, _: Option<u64>) {}
    fn retrying(&self, _: &str, _: u32, _: Duration, error: &(dyn std::error::Error + 'static)) {
        self.0.lock().unwrap().push(chain(error));
    }
    fn finished(&self, _: &str, _: u64, _: Duration) {}
}

const PATH: &str = "/v1.31.13/bin/linux/amd64/kubelet";

fn body() -> Vec<u8> {
    (0..64 * 1024u32).flat_map(|i| i.to_le_bytes()).collect()
}

fn download_error(err: &InstallError) -> &DownloadError {
    match err {
        InstallError::Download { source, .. } => source,
        other => panic!("expected a download error, got {}", chain(other)),
    }
}

#[tokio::test]
async fn a_wrong_hash_installs_nothing_and_is_not_retried() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    let wrong = sha256(b"something else");
    let component = file_component(&mirror, PATH, &wrong, "kubelet");

    let err = installer(root.path(), None, fast_retries())
        .install(&component, &NoProgress)
        .await
        .unwrap_err();

    assert!(matches!(
        download_error(&err),
        DownloadError::HashMismatch { .. }
    ));
    let text = chain(&err);
    assert!(text.contains("hash mismatch"), "{text}");
    assert!(
        text.contains(&format!("expected {wrong}, got {}", sha256(&body()))),
        "{text}"
    );
    assert_nothing_installed(&root.path().join("run/state/bin/kubelet"));
    assert_eq!(mirror.requests(PATH), 1);
}

#[tokio::test]
async fn a_component_without_a_hash_is_refused_before_any_download() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    let install = root.path().join("run/state/bin/kubelet");
    let wire = WireComponent {
        url: mirror.url(PATH),
        hash: String::new(),
        install_path: "/run/state/bin/kubelet".to_owned(),
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
    let text = chain(&err);
    assert!(
        text.contains("the hash is empty; every component needs a sha256:<hex> hash"),
        "{text}"
    );
    assert_nothing_installed(&install);
    assert_eq!(mirror.total_requests(), 0);
}

/// Installs the kubelet stand-in from a mirror that shows `fault` on every
/// request; checks that nothing was installed and returns the mirror and
/// the error.
async fn install_failing_always(fault: Fault) -> (MirrorServer, InstallError) {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    mirror.fail_always(PATH, fault);
    let component = file_component(&mirror, PATH, &sha256(&body()), "kubelet");
    let err = installer(root.path(), None, fast_retries())
        .install(&component, &NoProgress)
        .await
        .unwrap_err();
    assert_nothing_installed(&root.path().join("run/state/bin/kubelet"));
    (mirror, err)
}

/// Installs the kubelet stand-in from a mirror that shows `fault` on its
/// first `times` requests, reporting to `progress`; the install must
/// succeed. Returns the mirror and the root it installed under.
async fn install_after_faults(
    fault: Fault,
    times: usize,
    progress: &dyn keel_installer::Progress,
) -> (MirrorServer, tempfile::TempDir) {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    mirror.fail_next(PATH, fault, times);
    let component = file_component(&mirror, PATH, &sha256(&body()), "kubelet");
    installer(root.path(), None, fast_retries())
        .install(&component, progress)
        .await
        .unwrap_or_else(|e| panic!("{}", chain(&e)));
    (mirror, root)
}

/// The last failure of an install that used up its 3 attempts.
fn last_of_three(err: &InstallError) -> &DownloadError {
    match download_error(err) {
        DownloadError::AttemptsExhausted {
            attempts: 3, last, ..
        } => last,
        _ => panic!("{}", chain(err)),
    }
}

#[tokio::test]
async fn a_truncated_body_is_retried_then_refused() {
    let (mirror, err) = install_failing_always(Fault::Truncate(1000)).await;

    assert!(last_of_three(&err).is_transient());
    let text = chain(&err);
    assert!(text.contains("giving up after 3 attempts"), "{text}");
    assert!(
        text.contains("body truncated: received 1000 of 262144 bytes"),
        "{text}"
    );
    assert_eq!(mirror.requests(PATH), 3);
}

/// Without Content-Length or chunked framing a body ends when the server
/// closes the connection, so a connection cut part-way looks like a
/// complete body: its hash mismatch is retried, and the next whole body
/// installs.
#[tokio::test]
async fn a_close_delimited_body_cut_short_is_retried() {
    let progress = RetryLog::default();
    let (mirror, root) = install_after_faults(Fault::TruncateUnannounced(1000), 1, &progress).await;

    let installed = std::fs::read(root.path().join("run/state/bin/kubelet")).unwrap();
    assert_eq!(installed, body());
    assert_eq!(mirror.requests(PATH), 2);
    let logged = progress.0.lock().unwrap().join("\n");
    assert!(
        logged.contains("after 1000 bytes of a body that ends with its connection"),
        "{logged}"
    );
}

/// A server that never sends the right bytes is still refused, after the
/// retries, with the mismatch named; nothing is installed.
#[tokio::test]
async fn a_close_delimited_body_that_never_matches_is_refused() {
    let (mirror, err) = install_failing_always(Fault::TruncateUnannounced(1000)).await;

    assert!(
        matches!(
            last_of_three(&err),
            DownloadError::CloseDelimitedMismatch { received: 1000, .. }
        ),
        "{}",
        chain(&err)
    );
    let text = chain(&err);
    assert!(
        text.contains(&format!(
            "expected {}, got {}",
            sha256(&body()),
            sha256(&body()[..1000])
        )),
        "{text}"
    );
    assert_eq!(mirror.requests(PATH), 3);
}

/// A chunked body ends with its last chunk, so a cut shows as a transport
/// error: a whole chunked body of other bytes is a hash mismatch, final at
/// once like one of announced length.
#[tokio::test]
async fn a_chunked_body_of_other_bytes_is_not_retried() {
    let (mirror, err) = install_failing_always(Fault::ChunkedPrefix(1000)).await;

    assert!(
        matches!(download_error(&err), DownloadError::HashMismatch { .. }),
        "{}",
        chain(&err)
    );
    assert_eq!(mirror.requests(PATH), 1);
}

/// A signed URL's query is a credential: it reaches neither the retry
/// progress (the node's log) nor the error, whichever way the request
/// fails (refused connection, body cut short; reqwest's own errors name
/// the whole URL).
#[tokio::test]
async fn a_query_in_the_url_reaches_neither_log_nor_error() {
    const SECRET: &str = "X-Amz-Signature=d0c5ec7e7";
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    mirror.fail_always(PATH, Fault::Truncate(1000));
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    for url in [
        format!("{}?{SECRET}", mirror.url(PATH)),
        format!("http://{closed}/kubelet?{SECRET}"),
    ] {
        let component =
            Component::new(&url, &sha256(&body()), "/run/state/bin/kubelet", false).unwrap();
        let progress = RetryLog::default();
        let err = installer(root.path(), None, fast_retries())
            .install(&component, &progress)
            .await
            .unwrap_err();
        let text = chain(&err);
        assert!(text.contains("giving up after 3 attempts"), "{text}");
        assert!(!text.contains("d0c5ec7e7"), "{text}");
        let logged = progress.0.lock().unwrap().join("\n");
        assert!(
            !logged.is_empty() && !logged.contains("d0c5ec7e7"),
            "{logged}"
        );
    }
}

#[tokio::test]
async fn a_404_is_not_retried() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    let component = file_component(&mirror, PATH, &sha256(&body()), "kubelet");

    let err = installer(root.path(), None, fast_retries())
        .install(&component, &NoProgress)
        .await
        .unwrap_err();

    assert!(
        matches!(download_error(&err), DownloadError::Status { status, .. } if status.as_u16() == 404)
    );
    let text = chain(&err);
    assert!(text.contains("the server answered 404 Not Found"), "{text}");
    assert!(text.contains("downloading kubelet for"), "{text}");
    assert_nothing_installed(&root.path().join("run/state/bin/kubelet"));
    assert_eq!(mirror.total_requests(), 1);
}

#[tokio::test]
async fn a_503_twice_then_200_succeeds() {
    let progress = Recorder::default();
    let (mirror, root) = install_after_faults(Fault::Status(503), 2, &progress).await;

    let path = root.path().join("run/state/bin/kubelet");
    assert_eq!(std::fs::read(&path).unwrap(), body());
    let events = progress.0.lock().unwrap().clone();
    let len = body().len() as u64;
    assert_eq!(events.first().unwrap(), "retry 1 503");
    assert_eq!(events.get(1).unwrap(), "retry 2 503");
    assert_eq!(events.get(2).unwrap(), &format!("start {len}"));
    assert_eq!(events.last().unwrap(), &format!("finish {len}"));
    let done: Vec<u64> = events
        .iter()
        .filter_map(|e| e.strip_prefix("advance ")?.parse().ok())
        .collect();
    assert!(done.windows(2).all(|w| w[0] < w[1]), "{done:?}");
    assert_eq!(done.last(), Some(&len));
    assert_eq!(mode(&path), 0o755);
    assert_eq!(mirror.requests(PATH), 3);
    assert_eq!(support::entries(path.parent().unwrap()), ["kubelet"]);
}

#[tokio::test]
async fn transient_statuses_are_retried_and_others_are_not() {
    for (code, transient) in [
        (408, true),
        (425, true),
        (429, true),
        (500, true),
        (502, true),
        (403, false),
        (410, false),
    ] {
        let mirror = MirrorServer::start().unwrap();
        let root = tempfile::tempdir().unwrap();
        mirror.serve(PATH, body());
        mirror.fail_next(PATH, Fault::Status(code), 1);
        let component = file_component(&mirror, PATH, &sha256(&body()), "kubelet");
        let result = installer(root.path(), None, fast_retries())
            .install(&component, &NoProgress)
            .await;
        assert_eq!(result.is_ok(), transient, "status {code}");
        assert_eq!(
            mirror.requests(PATH),
            if transient { 2 } else { 1 },
            "status {code}"
        );
    }
}

#[tokio::test]
async fn a_server_that_never_answers_hits_the_deadline() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    mirror.fail_always(PATH, Fault::Hang);
    let component = file_component(&mirror, PATH, &sha256(&body()), "kubelet");
    let policy = RetryPolicy {
        deadline: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(60),
        ..fast_retries()
    };

    let started = Instant::now();
    let err = installer(root.path(), None, policy)
        .install(&component, &NoProgress)
        .await
        .unwrap_err();

    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
    assert!(matches!(
        download_error(&err),
        DownloadError::Deadline { attempts: 1, .. }
    ));
    let text = chain(&err);
    assert!(
        text.contains("no complete download within the deadline of 1s"),
        "{text}"
    );
    assert_nothing_installed(&root.path().join("run/state/bin/kubelet"));
}

#[tokio::test]
async fn a_silent_server_trips_the_idle_timeout_on_each_attempt() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    mirror.fail_always(PATH, Fault::Hang);
    let component = file_component(&mirror, PATH, &sha256(&body()), "kubelet");
    let policy = RetryPolicy {
        idle_timeout: Duration::from_millis(200),
        max_attempts: 2,
        ..fast_retries()
    };

    let err = installer(root.path(), None, policy)
        .install(&component, &NoProgress)
        .await
        .unwrap_err();

    let text = chain(&err);
    assert!(text.contains("giving up after 2 attempts"), "{text}");
    assert!(text.contains("no data for 200ms"), "{text}");
    assert_eq!(mirror.requests(PATH), 2);
    assert_nothing_installed(&root.path().join("run/state/bin/kubelet"));
}

#[tokio::test]
async fn a_body_over_the_size_limit_is_refused() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    let component = file_component(&mirror, PATH, &sha256(&body()), "kubelet");
    let installer = keel_installer::Installer::new(keel_installer::InstallerConfig {
        download: keel_installer::DownloadConfig {
            retry: fast_retries(),
            max_bytes: 1024,
            ..Default::default()
        },
        root: root.path().to_path_buf(),
        ..Default::default()
    })
    .unwrap();

    let err = installer
        .install(&component, &NoProgress)
        .await
        .unwrap_err();

    assert!(matches!(
        download_error(&err),
        DownloadError::TooLarge { limit: 1024, .. }
    ));
    assert_nothing_installed(&root.path().join("run/state/bin/kubelet"));
    assert_eq!(mirror.requests(PATH), 1);
}

#[tokio::test]
async fn inline_content_is_checked_against_its_hash() {
    let root = tempfile::tempdir().unwrap();
    let install = root.path().join("opt/kubernetes/patches/etcd+json.json");
    let component = Component::new(
        "data:,%5B%5D",
        &sha256(b"{}"),
        "/opt/kubernetes/patches/etcd+json.json",
        false,
    )
    .unwrap();
    let err = installer(root.path(), None, fast_retries())
        .install(&component, &NoProgress)
        .await
        .unwrap_err();
    assert!(
        matches!(err, InstallError::InlineHashMismatch { .. }),
        "{}",
        chain(&err)
    );
    assert_nothing_installed(&install);

    let good = Component::new(
        "data:,%5B%5D",
        &Sha256Digest::of(b"[]").to_string(),
        "/opt/kubernetes/patches/etcd+json.json",
        false,
    )
    .unwrap();
    installer(root.path(), None, fast_retries())
        .install(&good, &NoProgress)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&install).unwrap(), b"[]");
    assert_eq!(mode(&install), 0o644);
}

/// An installer below `root` that trusts the HTTPS mirror `tls`.
fn trusting(root: &std::path::Path, tls: &MirrorServer) -> keel_installer::Installer {
    keel_installer::Installer::new(keel_installer::InstallerConfig {
        download: keel_installer::DownloadConfig {
            retry: fast_retries(),
            extra_roots: vec![tls.tls_root().unwrap()],
            ..keel_installer::DownloadConfig::default()
        },
        root: root.to_path_buf(),
        ..keel_installer::InstallerConfig::default()
    })
    .unwrap()
}

/// Download servers (CDNs) offer HTTP/2 by ALPN; the installer asks for
/// HTTP/1.1 alone, whatever HTTP/2 support the build happens to contain,
/// so a server's choice never takes it down a path it was not built for.
#[tokio::test]
async fn a_server_that_offers_http2_is_fetched_over_http1() {
    let tls = MirrorServer::start_tls_offering(&[b"h2", b"http/1.1"]).unwrap();
    tls.serve(PATH, body());
    let root = tempfile::tempdir().unwrap();
    let component = Component::new(
        &tls.url(PATH),
        &sha256(&body()),
        "/run/state/bin/fetched",
        false,
    )
    .unwrap();
    trusting(root.path(), &tls)
        .install(&component, &NoProgress)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(root.path().join("run/state/bin/fetched")).unwrap(),
        body()
    );
}

#[tokio::test]
async fn redirects_never_leave_https_and_are_bounded() {
    let plain = MirrorServer::start().unwrap();
    plain.serve(PATH, body());
    let tls = MirrorServer::start_tls().unwrap();
    let hash = sha256(&body());
    // /hop0 → /hop1 → … → /hopN, the body at the end: N redirects.
    let chain_of = |name: &str, redirects: usize| {
        for hop in 0..redirects {
            let next = tls.url(&format!("/{name}{}", hop + 1));
            tls.redirect(&format!("/{name}{hop}"), &next);
        }
        tls.serve(&format!("/{name}{redirects}"), body());
        Component::new(
            &tls.url(&format!("/{name}0")),
            &hash,
            &format!("/run/state/bin/{name}"),
            false,
        )
        .unwrap()
    };
    let root = tempfile::tempdir().unwrap();
    let installer = trusting(root.path(), &tls);

    // HTTPS to HTTPS is followed, up to the bound.
    let within = chain_of("within", keel_installer::MAX_REDIRECTS);
    installer.install(&within, &NoProgress).await.unwrap();
    assert_eq!(
        std::fs::read(root.path().join("run/state/bin/within")).unwrap(),
        body()
    );

    // One more is refused, at once (not retried).
    let beyond = chain_of("beyond", keel_installer::MAX_REDIRECTS + 1);
    let err = installer.install(&beyond, &NoProgress).await.unwrap_err();
    let text = chain(&err);
    assert!(text.contains("more than 5 redirects"), "{text}");
    assert!(!download_error(&err).is_transient(), "{text}");
    assert_nothing_installed(&root.path().join("run/state/bin/beyond"));

    // HTTPS to HTTP is refused before the plain mirror sees a request,
    // even where the bytes there have the right hash.
    tls.redirect("/down", &plain.url(PATH));
    let down = Component::new(&tls.url("/down"), &hash, "/run/state/bin/down", false).unwrap();
    let err = installer.install(&down, &NoProgress).await.unwrap_err();
    let text = chain(&err);
    assert!(
        text.contains("a redirect from https to http is refused"),
        "{text}"
    );
    assert_eq!(plain.total_requests(), 0);
    assert_eq!(tls.requests("/down"), 1, "not retried");
    assert_nothing_installed(&root.path().join("run/state/bin/down"));
}

/// Anyone on the path of a plain-HTTP download can answer with a redirect:
/// followed anywhere, it would make the node send requests to addresses
/// only the node reaches. Within the mirror's own origin, or up to HTTPS,
/// a redirect is followed; to any other plain-HTTP origin it is refused
/// before that origin sees a request.
#[tokio::test]
async fn plain_http_redirects_do_not_leave_their_origin_in_the_clear() {
    let mirror = MirrorServer::start().unwrap();
    let elsewhere = MirrorServer::start().unwrap();
    let tls = MirrorServer::start_tls().unwrap();
    let hash = sha256(&body());
    for server in [&mirror, &elsewhere, &tls] {
        server.serve(PATH, body());
    }
    mirror.redirect("/here", &mirror.url(PATH));
    mirror.redirect("/up", &tls.url(PATH));
    mirror.redirect("/away", &elsewhere.url(PATH));
    let root = tempfile::tempdir().unwrap();
    let installer = trusting(root.path(), &tls);
    let component = |path: &str, name: &str| {
        Component::new(
            &mirror.url(path),
            &hash,
            &format!("/run/state/bin/{name}"),
            false,
        )
        .unwrap()
    };

    installer
        .install(&component("/here", "here"), &NoProgress)
        .await
        .unwrap();
    installer
        .install(&component("/up", "up"), &NoProgress)
        .await
        .unwrap();
    assert_eq!(tls.requests(PATH), 1);
    assert_eq!(
        std::fs::read(root.path().join("run/state/bin/up")).unwrap(),
        body()
    );

    let err = installer
        .install(&component("/away", "away"), &NoProgress)
        .await
        .unwrap_err();
    let text = chain(&err);
    assert!(
        text.contains("a plain http redirect to another origin"),
        "{text}"
    );
    assert!(
        text.contains(&format!("({})", elsewhere.base_url())),
        "{text}"
    );
    assert_eq!(elsewhere.total_requests(), 0);
    assert_eq!(mirror.requests("/away"), 1, "not retried");
    assert_nothing_installed(&root.path().join("run/state/bin/away"));
}

/// A crash (or a power cut) during a download or an extraction leaves the
/// temporary file or staging directory beside the components: unmeasured
/// bytes in a directory the kubelet or the CNI runs from. The next install
/// of the component removes them, and only them.
#[tokio::test]
async fn partial_downloads_an_interrupted_install_left_are_removed() {
    let mirror = MirrorServer::start().unwrap();
    let root = tempfile::tempdir().unwrap();
    mirror.serve(PATH, body());
    let component = file_component(&mirror, PATH, &sha256(&body()), "kubelet");
    let dir = root.path().join("run/state/bin");
    std::fs::create_dir_all(&dir).unwrap();
    let leftover = dir.join(".kubelet.Ab3dE9.keel-part");
    std::fs::write(&leftover, &body()[..1000]).unwrap();
    // Not this component's, or not a file: kept.
    let others = [
        dir.join(".kubeadm.Zz9yX8.keel-part"),
        dir.join(".kubelet.notes"),
        // Component "kubelet.d"'s download, not "kubelet"'s.
        dir.join(".kubelet.d.Zz9yX8.keel-part"),
    ];
    for other in &others {
        std::fs::write(other, b"keep").unwrap();
    }
    let a_dir = dir.join(".kubelet.Qq1wE2.keel-part");
    std::fs::create_dir(&a_dir).unwrap();
    // An extraction's staging directory cut short: removed with what it holds.
    let staging = dir.join(".kubelet.Rt5yU6.keel-extract");
    std::fs::create_dir_all(staging.join("bin")).unwrap();
    std::fs::write(staging.join("bin/half"), b"half").unwrap();

    installer(root.path(), None, fast_retries())
        .install(&component, &NoProgress)
        .await
        .unwrap();

    assert!(!leftover.exists() && !staging.exists());
    assert!(others.iter().all(|o| o.exists()) && a_dir.is_dir());
    assert_eq!(std::fs::read(dir.join("kubelet")).unwrap(), body());
}
