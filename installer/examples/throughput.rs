//! Install throughput against `curl -s URL | sha256sum`.
//!
//! Serves a 200 MiB file from the local mirror on loopback, then times, on
//! the same file in the same run, (a) `curl -s URL | sha256sum` and (b) the
//! installer downloading, hashing, writing, syncing and renaming it into a
//! temporary root. Each is run several times, alternating; the best run of
//! each is reported with the ratio installer / curl, and the median of the
//! per-run ratios (the machine may be shared, so single runs are noisy).
//! A third line, "download only", times the downloader into a temporary
//! file without the final sync and rename, to show what durability costs.
//!
//! `cargo run --release -p keel-installer --example throughput [MiB] [runs]`

use std::error::Error;
use std::io::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use keel_installer::progress::megabytes_per_second;
use keel_installer::{
    Component, DownloadConfig, Downloader, Installer, InstallerConfig, NoProgress, Sha256Digest,
};
use keel_testkit::mirror::MirrorServer;

const PATH: &str = "/v1.31.13/bin/linux/amd64/kubelet";

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(200);
    let runs: u32 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(5);
    let bytes = mib * 1024 * 1024;

    let work = tempfile::tempdir()?;
    let source = work.path().join("component.bin");
    let digest = write_pseudo_random(&source, bytes)?;
    let mirror = MirrorServer::start()?;
    mirror.serve_file(PATH, &source);
    let url = mirror.url(PATH);
    println!("component: {mib} MiB at {url}");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut best_curl = Duration::MAX;
    let mut best_install = Duration::MAX;
    let mut best_download = Duration::MAX;
    let mut ratios = Vec::new();
    for run in 1..=runs {
        let curl = time_curl(&url, &digest)?;
        let install = runtime.block_on(time_install(&url, &digest, work.path(), run))?;
        let download = runtime.block_on(time_download(&url, &digest, work.path()))?;
        let rate = |t| megabytes_per_second(bytes, t);
        println!(
            "run {run}: curl|sha256sum {:.0} MB/s, installer {:.0} MB/s, download only {:.0} MB/s",
            rate(curl),
            rate(install),
            rate(download)
        );
        best_curl = best_curl.min(curl);
        best_install = best_install.min(install);
        best_download = best_download.min(download);
        ratios.push(curl.as_secs_f64() / install.as_secs_f64());
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN);
    let curl_rate = megabytes_per_second(bytes, best_curl);
    let install_rate = megabytes_per_second(bytes, best_install);
    println!(
        "best: curl|sha256sum {curl_rate:.0} MB/s ({best_curl:.2?}), installer {install_rate:.0} MB/s ({best_install:.2?}), download only {:.0} MB/s",
        megabytes_per_second(bytes, best_download)
    );
    println!(
        "ratio installer/curl: best {:.2}, median of runs {median:.2} (goal: at least 0.8)",
        install_rate / curl_rate
    );
    Ok(())
}

/// Writes `bytes` of xorshift output (incompressible, cheap to make) and
/// returns its digest.
fn write_pseudo_random(path: &Path, bytes: u64) -> Result<Sha256Digest, Box<dyn Error>> {
    use sha2::Digest as _;
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut hasher = sha2::Sha256::new();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut block = vec![0u8; 1024 * 1024];
    let mut left = bytes;
    while left > 0 {
        for word in block.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        let n = usize::try_from(left.min(block.len() as u64))?;
        let chunk = block.get(..n).ok_or("block")?;
        hasher.update(chunk);
        file.write_all(chunk)?;
        left -= n as u64;
    }
    file.flush()?;
    Ok(Sha256Digest::from_hasher(hasher))
}

fn time_curl(url: &str, digest: &Sha256Digest) -> Result<Duration, Box<dyn Error>> {
    let started = Instant::now();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("curl -s '{url}' | sha256sum"))
        .output()?;
    let elapsed = started.elapsed();
    let printed = String::from_utf8(out.stdout)?;
    if !out.status.success() || !printed.starts_with(&digest.to_hex()) {
        return Err(format!("curl | sha256sum printed {printed:?}").into());
    }
    Ok(elapsed)
}

async fn time_install(
    url: &str,
    digest: &Sha256Digest,
    work: &Path,
    run: u32,
) -> Result<Duration, Box<dyn Error>> {
    let root = work.join(format!("root-{run}"));
    let installer = Installer::new(InstallerConfig {
        root: root.clone(),
        ..InstallerConfig::default()
    })?;
    let component = Component::new(url, &digest.to_string(), "/run/state/bin/kubelet", false)?;
    let started = Instant::now();
    installer.install(&component, &NoProgress).await?;
    let elapsed = started.elapsed();
    std::fs::remove_dir_all(root)?;
    Ok(elapsed)
}

async fn time_download(
    url: &str,
    digest: &Sha256Digest,
    work: &Path,
) -> Result<Duration, Box<dyn Error>> {
    let downloader = Downloader::new(DownloadConfig::default())?;
    let temp = tempfile::tempfile_in(work)?;
    let url = url::Url::parse(url)?;
    let started = Instant::now();
    downloader
        .download_into(&url, *digest, &temp, "component", &NoProgress)
        .await?;
    Ok(started.elapsed())
}
