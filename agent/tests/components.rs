//! Installing and measuring a stand-in component set from the loopback
//! mirror, against a real swtpm.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_agent::components::{install_and_measure, InstallComponentsError, StreamedProgress};
use keel_agent::measured::{MeasuredTpm, SharedTpm};
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_installer::{Component, InstallError, Installer, InstallerConfig, NoProgress};
use keel_testkit::components::stand_in_set;
use keel_testkit::mirror::{Fault, MirrorServer};
use keel_testkit::swtpm::Swtpm;
use keel_verifier::measurement::{self, pcr, EventType};

fn open(swtpm: &Swtpm, dir: &std::path::Path) -> SharedTpm {
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    MeasuredTpm::open(tpm, &dir.join("events.jsonl"))
        .unwrap()
        .shared()
}

fn installer() -> Installer {
    let mut config = InstallerConfig::default();
    config.download.retry.max_attempts = 1;
    Installer::new(config).unwrap()
}

fn components(mirror: &MirrorServer, root: &std::path::Path) -> Vec<Component> {
    stand_in_set(mirror, root, "v1.31.13")
        .unwrap()
        .iter()
        .map(|c| Component::try_from(c).unwrap())
        .collect()
}

/// A swtpm and its measured-log TPM, a temporary directory, a mirror, and
/// the root to install below.
fn setup() -> (
    Swtpm,
    tempfile::TempDir,
    SharedTpm,
    MirrorServer,
    std::path::PathBuf,
) {
    let swtpm = Swtpm::start_bare().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tpm = open(&swtpm, dir.path());
    let mirror = MirrorServer::start().unwrap();
    let root = dir.path().join("root");
    (swtpm, dir, tpm, mirror, root)
}

fn pcr13(tpm: &SharedTpm) -> [u8; 32] {
    tpm.lock().unwrap().tpm().pcr_read(&[pcr::NODE]).unwrap()[&pcr::NODE]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_component_is_installed_and_measured_in_order() {
    let (_swtpm, _dir, tpm, mirror, root) = setup();
    let list = components(&mirror, &root);
    assert!(list.len() >= 5);

    let installed = install_and_measure(&installer(), &tpm, &list, &NoProgress)
        .await
        .unwrap();
    assert_eq!(installed.len(), list.len());

    let events = tpm.lock().unwrap().events().to_vec();
    assert_eq!(events.len(), list.len());
    for ((event, component), done) in events.iter().zip(&list).zip(&installed) {
        assert_eq!(event.event_type, EventType::Component);
        assert_eq!(event.pcr, pcr::NODE);
        assert_eq!(event.data, done.measurement_record());
        assert_eq!(event.description, done.description());
        let record: serde_json::Value = serde_json::from_slice(&event.data).unwrap();
        assert_eq!(
            record["url"],
            keel_installer::component::redact(component.url())
        );
        assert_eq!(record["hash"], component.hash().to_string());
        assert!(component.install_path().as_path().exists());
    }
    assert_eq!(
        measurement::replay(&events).unwrap()[&pcr::NODE],
        pcr13(&tpm)
    );
    assert_ne!(pcr13(&tpm), [0; 32]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_component_stops_the_run_after_measuring_the_ones_before() {
    let (_swtpm, _dir, tpm, mirror, root) = setup();
    let list = components(&mirror, &root);
    // The third component (kubelet) is gone from the mirror.
    let kubelet = &list[2];
    assert!(kubelet.url().ends_with("/kubelet"));
    let path = kubelet
        .url()
        .trim_start_matches(&mirror.base_url())
        .to_owned();
    mirror.fail_always(&path, Fault::Status(404));

    let err = install_and_measure(&installer(), &tpm, &list, &NoProgress)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            InstallComponentsError::Install { index: 2, source, .. }
                if matches!(**source, InstallError::Download { .. })
        ),
        "{err:?}"
    );
    assert!(!kubelet.install_path().as_path().exists());
    let events = tpm.lock().unwrap().events().to_vec();
    assert_eq!(events.len(), 2);
    assert_eq!(
        measurement::replay(&events).unwrap()[&pcr::NODE],
        pcr13(&tpm)
    );
}

/// Attacker's move: a list (the operator's own, or one an upgrade plan
/// carries) with a second archive for a directory another archive fills,
/// so that which binaries end up there depends on the order they are
/// installed in. The list is refused whole, before anything is fetched,
/// installed or measured, with an error that names the list rather than
/// its first component.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_with_two_archives_for_one_directory_installs_nothing() {
    let (_swtpm, _dir, tpm, mirror, root) = setup();
    let mut list = components(&mirror, &root);
    let archive = list.iter().find(|c| c.extract()).unwrap().clone();
    let other = keel_proto::components::Component {
        url: format!("{}/other.tgz", mirror.base_url()),
        hash: format!("sha256:{}", "a".repeat(64)),
        install_path: archive.install_path().to_string(),
        extract: true,
    };
    list.push(Component::try_from(&other).unwrap());
    let before = pcr13(&tpm);

    let err = install_and_measure(&installer(), &tpm, &list, &NoProgress)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            InstallComponentsError::List(InstallError::SharedArchiveDirectory { path })
                if *path == *archive.install_path()
        ),
        "{err:?}"
    );
    assert_eq!(mirror.total_requests(), 0);
    assert!(!list[0].install_path().as_path().exists());
    assert!(tpm.lock().unwrap().events().is_empty());
    assert_eq!(pcr13(&tpm), before);
}

/// The init server runs this on a tokio task: the future must be `Send`.
#[test]
fn install_and_measure_is_send() {
    fn send<T: Send>(_: &T) {}
    fn check(installer: &Installer, tpm: &SharedTpm) {
        send(&install_and_measure(installer, tpm, &[], &NoProgress));
    }
    let _ = check;
}

/// What an init or a join streams to the operator while it installs: a
/// line for every component, however it came to be in place (downloaded,
/// written from the list's inline content, found in place on a second
/// run), so that no component is installed unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_stream_tells_every_component_however_it_is_installed() {
    let (_swtpm, _dir, tpm, mirror, root) = setup();
    let mut list = components(&mirror, &root);
    let patch = root.join("patches/etcd+json.json");
    list.push(
        Component::new(
            "data:,%5B%5D",
            &keel_installer::Sha256Digest::of(b"[]").to_string(),
            patch.to_str().unwrap(),
            false,
        )
        .unwrap(),
    );
    for run in 0..2 {
        let lines = std::sync::Mutex::new(Vec::<String>::new());
        let log = |line: String| lines.lock().unwrap().push(line);
        install_and_measure(&installer(), &tpm, &list, &StreamedProgress::new(&log))
            .await
            .unwrap();
        let lines = lines.into_inner().unwrap();
        for component in &list {
            let told: Vec<&String> = lines
                .iter()
                .filter(|l| l.starts_with(&format!("{}: ", component.name())))
                .collect();
            assert_eq!(told.len(), 1, "run {run}, {}: {lines:?}", component.name());
        }
        let inline = if run == 0 {
            "etcd+json.json: written from the list's inline content, hash verified"
        } else {
            "etcd+json.json: already in place, hash verified"
        };
        assert!(lines.iter().any(|l| l == inline), "run {run}: {lines:?}");
    }
}
