//! `keel collateral fetch`: fills the verifier's collateral cache once, from
//! AMD's KDS or Intel's PCS, for the evidence of one node. This is the only
//! place keel talks to a vendor service: verifiers (join services, joining
//! nodes, `keel verify`) read the cache and never fetch.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::Args;

mod freshness;
mod http;
mod kds;
mod pcs;

use freshness::Kind;

use http::{Answer, Http, HttpError};

/// `keel collateral` subcommands.
#[derive(clap::Subcommand)]
pub enum CollateralCommand {
    /// Download the certificates and collateral one node's CPU evidence is
    /// verified with into a collateral cache directory.
    ///
    /// SEV-SNP (--vcek-from-report): from AMD's KDS, the VCEK for the
    /// report's chip and reported TCB (snp/vcek-<chip>-<bl>-<tee>-<snp>-<ucode>.der;
    /// for Turin, snp/vcek-<chip>-<fmc>-<bl>-<tee>-<snp>-<ucode>.der),
    /// the product line's ASK/ARK chain (snp/<product>/cert_chain.pem) and
    /// its CRL (snp/<product>/crl.der). The chain must be AMD's roots pinned
    /// in keel, the VCEK must verify the report against them, and the CRL
    /// must be signed by the ARK, be current and revoke neither the ASK nor
    /// the VCEK; otherwise nothing is written. Verifiers check every VCEK
    /// report of the product line against the cached CRL from then on.
    ///
    /// For a report a VLEK signed (AMD's KDS does not serve VLEKs), first
    /// place the cloud provider's VLEK where the command says
    /// (snp/vlek-<bl>-<tee>-<snp>-<ucode>.der; for Turin,
    /// snp/vlek-<fmc>-<bl>-<tee>-<snp>-<ucode>.der); it then fetches the
    /// line's ASVK/ARK chain (snp/<product>/vlek_cert_chain.pem) and VLEK
    /// CRL (snp/<product>/vlek-crl.der), checked the same way with the
    /// VLEK, against the ASVK pinned in keel for the line (Milan, Genoa,
    /// Turin). Verifiers check every VLEK report of the line against that
    /// list. Both lists are signed by
    /// the line's ARK, so the CRL served in place of the VLEK CRL is not
    /// told apart (it revokes no ASVK or VLEK).
    ///
    /// TDX (--tdx-quote): from Intel's PCS, the TCB info for the quote's
    /// FMSPC, the TD quoting enclave's identity, the CRL of the CA that
    /// issued the quote's PCK certificate, and the SGX root CA's CRL, as
    /// one file tdx/<FMSPC>-<CA>.json (CA: platform or processor). The
    /// quote must verify with it against
    /// Intel's root now, as verifiers check it; otherwise nothing is
    /// written. The command prints the collateral's validity.
    ///
    /// Name the cache as `collateral` in the CLI settings: `keel init` and
    /// `keel verify` check CPU evidence with it. Nodes do not take it yet
    /// (their cache, /var/lib/keel/collateral, is on a memory file system
    /// that nothing fills: see "collateral on nodes" in
    /// docs/attestation.md). Fetch again before the collateral's next
    /// update. Each download must finish within
    /// --timeout and stay under a size bound; files are written only when
    /// every download and check succeeded, each replaced atomically. A CRL,
    /// TCB info or QE identity older than the one already cached (issued
    /// before it, or of a lower TCB evaluation; for TDX, also the one in
    /// tdx/<FMSPC>.json, which an earlier version wrote) is refused: an
    /// older answer may be a replay that drops a revocation. Remove the
    /// cached file to take it on purpose. One fetch at a time checks and
    /// writes a cache (it locks the directory); another waits for it.
    #[command(verbatim_doc_comment)]
    Fetch(FetchArgs),
}

/// What `keel collateral fetch` fetches, and from where.
#[derive(Args)]
#[command(group(clap::ArgGroup::new("evidence").required(true).args(["vcek_from_report", "tdx_quote"])))]
pub struct FetchArgs {
    /// The collateral cache directory (created if missing); refused if
    /// another user could write into it.
    #[arg(long, value_name = "DIR")]
    cache: PathBuf,
    /// A SEV-SNP attestation report (raw 1184 bytes, or an Azure HCL
    /// report) whose VCEK (or, for a VLEK's report, VLEK CRL) to fetch.
    #[arg(long, value_name = "REPORT")]
    vcek_from_report: Option<PathBuf>,
    /// The report's product line; needed for version 2 reports, which do
    /// not carry their CPUID.
    #[arg(long, value_enum, requires = "vcek_from_report")]
    product: Option<kds::Product>,
    /// A TDX quote (version 4 or 5, the PCK chain inside) whose collateral
    /// to fetch.
    #[arg(long, value_name = "QUOTE")]
    tdx_quote: Option<PathBuf>,
    /// Base URL of AMD's Key Distribution Service (or a mirror of it).
    #[arg(long, value_name = "URL", default_value = kds::DEFAULT_URL)]
    kds_url: String,
    /// Base URL of Intel's Provisioning Certification Service, API v4 (or a
    /// PCCS).
    #[arg(long, value_name = "URL", default_value = pcs::DEFAULT_URL)]
    pcs_url: String,
    /// Where the SGX root CA's CRL is published.
    #[arg(long, value_name = "URL", default_value = pcs::DEFAULT_ROOT_CA_CRL_URL)]
    root_ca_crl_url: String,
    /// Seconds each download may take, connection included.
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = crate::seconds())]
    timeout: u64,
}

/// One file for the cache, relative to its directory.
#[derive(Debug)]
pub struct CacheFile {
    relative: String,
    bytes: Vec<u8>,
    kind: Kind,
    /// Where a cache filled by an earlier version may hold the same
    /// collateral, which verifiers read while the file is missing: not
    /// written, but compared with ([`freshness::refuse_rollback`]).
    earlier: Option<String>,
}

impl CacheFile {
    fn new(relative: impl Into<String>, bytes: Vec<u8>, kind: Kind) -> Self {
        Self {
            relative: relative.into(),
            bytes,
            kind,
            earlier: None,
        }
    }

    /// The file, which a cache may hold at `earlier` too ([`CacheFile::earlier`]).
    fn or_earlier_at(self, earlier: impl Into<String>) -> Self {
        Self {
            earlier: Some(earlier.into()),
            ..self
        }
    }
}

/// Runs a `keel collateral` command.
pub async fn run(command: CollateralCommand) -> anyhow::Result<()> {
    match command {
        CollateralCommand::Fetch(args) => fetch(args).await,
    }
}

async fn fetch(args: FetchArgs) -> anyhow::Result<()> {
    check_cache(&args.cache)?;
    let http = Http::new(Duration::from_secs(args.timeout.max(1)))?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let limit = keel_verifier::cpu::MAX_EVIDENCE_BYTES as u64;
    let files = match (&args.vcek_from_report, &args.tdx_quote) {
        (Some(report), _) => {
            let evidence = read_evidence(report, limit)?;
            eprintln!("keel: fetching from AMD's KDS at {}", args.kds_url);
            kds::fetch(
                &http,
                &args.kds_url,
                &evidence,
                args.product,
                now,
                &keel_verifier::cpu::snp::PINNED,
                &args.cache,
            )
            .await?
        }
        (None, Some(quote)) => {
            let quote = read_evidence(quote, limit)?;
            eprintln!("keel: fetching from Intel's PCS at {}", args.pcs_url);
            pcs::fetch(
                &http,
                &args.pcs_url,
                &args.root_ca_crl_url,
                &quote,
                now,
                &keel_verifier::cpu::tdx::IntelRoot::pinned(),
            )
            .await?
        }
        (None, None) => anyhow::bail!("name --vcek-from-report or --tdx-quote"),
    };
    for (path, file) in store(&args.cache, &files)?.iter().zip(&files) {
        eprintln!(
            "keel: wrote {} ({} bytes)",
            path.display(),
            file.bytes.len()
        );
    }
    Ok(())
}

/// One GET with a progress line.
async fn get(http: &Http, what: &str, url: &str, limit: usize) -> Result<Answer, HttpError> {
    eprintln!("  {what}: GET {url}");
    let answer = http.get(url, limit).await?;
    eprintln!(
        "    {} bytes in {} ms",
        answer.body.len(),
        answer.elapsed.as_millis()
    );
    Ok(answer)
}

/// Reads an evidence file of at most `limit` bytes.
fn read_evidence(path: &Path, limit: u64) -> anyhow::Result<Vec<u8>> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(
        bytes.len() as u64 <= limit,
        "{} is larger than {limit} bytes, the bound on CPU evidence",
        path.display()
    );
    Ok(bytes)
}

/// Puts `files` into `cache`, unless another user could write there
/// ([`check_cache_dirs`]) or one of them is older than the file it would
/// replace ([`freshness::refuse_rollback`]). The checks and the writes
/// hold the cache's lock ([`lock`]): two fetches into one cache cannot
/// check, then write one after the other, an older set last.
fn store(cache: &Path, files: &[CacheFile]) -> anyhow::Result<Vec<PathBuf>> {
    let _held = lock(cache)?;
    check_cache_dirs(cache, files)?;
    freshness::refuse_rollback(cache, files)?;
    write_all(cache, files)
}

/// Refuses a collateral cache directory that another user could write
/// into ([`crate::workspace::check_trusted_dir`]): they could put older
/// collateral there (a CRL that drops a revocation) for the CLI to verify
/// with, and to copy to nodes. A cache not made yet is not refused.
pub fn check_cache(cache: &Path) -> anyhow::Result<()> {
    match std::fs::metadata(cache) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        _ => crate::workspace::check_trusted_dir(cache, "collateral cache"),
    }
}

/// Refuses `cache`, or a directory in it that `files` are read from or
/// written to, that another user could write into
/// ([`crate::workspace::check_trusted_dir`]).
fn check_cache_dirs(cache: &Path, files: &[CacheFile]) -> anyhow::Result<()> {
    crate::workspace::check_trusted_dir(cache, "collateral cache")?;
    let places = files
        .iter()
        .flat_map(|f| std::iter::once(&f.relative).chain(&f.earlier));
    for place in places {
        let mut dir = cache.to_owned();
        for part in Path::new(place).parent().into_iter().flat_map(Path::iter) {
            dir.push(part);
            if !dir.exists() {
                break;
            }
            crate::workspace::check_trusted_dir(&dir, "collateral cache directory")?;
        }
    }
    Ok(())
}

/// Creates `dir` and its missing parents, mode 0755 at most (under a
/// umask of 0 too): verifiers read the cache, only its owner writes it.
fn create_dirs(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

/// Takes the cache's lock: an exclusive `flock` on the cache directory
/// itself (created if missing), held until the value is dropped. Waits,
/// saying so, while another fetch holds it.
fn lock(cache: &Path) -> anyhow::Result<nix::fcntl::Flock<std::fs::File>> {
    use nix::fcntl::{Flock, FlockArg};
    use std::os::unix::fs::OpenOptionsExt as _;
    create_dirs(cache)?;
    let directory = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY)
        .open(cache)
        .with_context(|| format!("opening {}", cache.display()))?;
    let locked = |(_, errno): (std::fs::File, nix::errno::Errno)| {
        anyhow::Error::new(errno).context(format!("locking {}", cache.display()))
    };
    match Flock::lock(directory, FlockArg::LockExclusiveNonblock) {
        Ok(held) => Ok(held),
        Err((directory, nix::errno::Errno::EWOULDBLOCK)) => {
            eprintln!(
                "keel: another fetch is writing {}; waiting for it",
                cache.display()
            );
            Flock::lock(directory, FlockArg::LockExclusive).map_err(locked)
        }
        Err(e) => Err(locked(e)),
    }
}

/// Writes `files` under `cache`: each first to a temporary file of its
/// own, and only when all were written are they renamed into place, so a
/// failure leaves the cache as it was and a verifier never reads half a
/// file. Limitation: the renames are atomic one by one, not as a set.
fn write_all(cache: &Path, files: &[CacheFile]) -> anyhow::Result<Vec<PathBuf>> {
    let mut staged: Vec<(PathBuf, PathBuf)> = Vec::with_capacity(files.len());
    let mut renamed = 0;
    let outcome = (|| {
        for file in files {
            staged.push(stage(cache, file)?);
        }
        for (temporary, path) in &staged {
            std::fs::rename(temporary, path).with_context(|| {
                format!(
                    "renaming {} to {} ({renamed} of {} files already in place)",
                    temporary.display(),
                    path.display(),
                    staged.len()
                )
            })?;
            renamed += 1;
        }
        Ok(())
    })();
    if outcome.is_err() {
        for (temporary, _) in staged.iter().skip(renamed) {
            let _ = std::fs::remove_file(temporary);
        }
    }
    outcome.map(|()| staged.into_iter().map(|(_, path)| path).collect())
}

/// Writes `file` to a new temporary file beside its place in `cache`;
/// returns the temporary file and the place.
fn stage(cache: &Path, file: &CacheFile) -> anyhow::Result<(PathBuf, PathBuf)> {
    use std::io::Write as _;
    let path = cache.join(&file.relative);
    let dir = path
        .parent()
        .with_context(|| format!("{} has no parent directory", path.display()))?;
    create_dirs(dir)?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("collateral");
    let (temporary, mut out) = create_temporary(dir, name)?;
    let written = out
        .write_all(&file.bytes)
        .and_then(|()| out.sync_all())
        .with_context(|| format!("writing {}", temporary.display()));
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written.map(|()| (temporary, path))
}

/// A new file `.<name>.<random>.partial` in `dir`, mode 0644, created
/// exclusively ([`crate::files::create_temporary`]): whatever is at that
/// name (a file, a symbolic link) is never written through.
fn create_temporary(dir: &Path, name: &str) -> anyhow::Result<(PathBuf, std::fs::File)> {
    use std::os::unix::fs::PermissionsExt as _;
    let (temporary, file) =
        crate::files::create_temporary(dir, std::ffi::OsStr::new(name), "partial")
            .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    if let Err(e) = file.set_permissions(std::fs::Permissions::from_mode(0o644)) {
        let _ = std::fs::remove_file(&temporary);
        return Err(e).with_context(|| format!("setting the mode of {}", temporary.display()));
    }
    Ok((temporary, file))
}

/// Runs `future` (a fetch of the unit tests) on a runtime of its own.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// Every entry under `dir` (files and links), relative, sorted.
    fn entries(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut pending = vec![dir.to_owned()];
        while let Some(d) = pending.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() && !path.is_symlink() {
                    pending.push(path);
                } else {
                    out.push(path.strip_prefix(dir).unwrap().display().to_string());
                }
            }
        }
        out.sort();
        out
    }

    #[test]
    fn a_link_at_the_target_is_replaced_not_written_through() {
        let cache = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let victim = elsewhere.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::fs::create_dir_all(cache.path().join("tdx")).unwrap();
        let target = cache.path().join("tdx/B0C06F000000-platform.json");
        std::os::unix::fs::symlink(&victim, &target).unwrap();

        let files = [CacheFile::new(
            "tdx/B0C06F000000-platform.json",
            b"fresh".to_vec(),
            Kind::TdxCollateral,
        )];
        let written = write_all(cache.path(), &files).unwrap();
        assert_eq!(written, std::slice::from_ref(&target));
        assert!(!target.is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"fresh");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(entries(cache.path()), ["tdx/B0C06F000000-platform.json"]);
    }

    #[test]
    fn temporary_files_are_new_and_unpredictable() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = create_temporary(dir.path(), "crl.der").unwrap();
        let (b, _) = create_temporary(dir.path(), "crl.der").unwrap();
        assert_ne!(a, b);
        for path in [&a, &b] {
            let name = path.file_name().unwrap().to_str().unwrap();
            assert!(
                name.starts_with(".crl.der.") && name.ends_with(".partial"),
                "{name}"
            );
        }
    }

    /// A fetch that finds the cache locked by another checks and writes
    /// only once that one is done.
    #[test]
    fn a_fetch_waits_for_another_holding_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let held = lock(cache.path()).unwrap();
        let dir = cache.path().to_owned();
        let (done, finished) = std::sync::mpsc::channel();
        let writer = std::thread::spawn(move || {
            let files = [CacheFile::new(
                "snp/Milan/cert_chain.pem",
                b"chain".to_vec(),
                Kind::Certificate,
            )];
            let stored = store(&dir, &files).map(|_| ());
            done.send(()).unwrap();
            stored
        });
        let waited = finished.recv_timeout(Duration::from_millis(300));
        assert!(waited.is_err(), "stored while the cache was locked");
        assert!(entries(cache.path()).is_empty());
        drop(held);
        finished.recv_timeout(Duration::from_secs(10)).unwrap();
        writer.join().unwrap().unwrap();
        assert_eq!(entries(cache.path()), ["snp/Milan/cert_chain.pem"]);
    }

    /// Attacker's move, as another user who can write into the cache or a
    /// directory in it: put older collateral there (a CRL that drops a
    /// revocation) for the CLI to verify with and to copy to nodes. Such a
    /// cache is refused before anything is compared or written.
    #[test]
    fn a_cache_another_user_could_write_into_is_refused() {
        use std::os::unix::fs::{chown, PermissionsExt as _};
        let files = [CacheFile::new(
            "snp/Milan/crl.der",
            b"crl".to_vec(),
            Kind::Crl,
        )];
        let cache = tempfile::tempdir().unwrap();
        let dir = cache.path().join("cache");
        std::fs::create_dir(&dir).unwrap();
        let refused = || format!("{:#}", store(&dir, &files).unwrap_err());

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = refused();
        assert!(
            e.contains(&format!(
                "the collateral cache {} is writable by every user (mode 777)",
                dir.display()
            )),
            "{e}"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        chown(&dir, Some(12345), None).unwrap();
        let e = refused();
        assert!(
            e.contains(&format!(
                "the collateral cache {} belongs to another user (uid 12345)",
                dir.display()
            )),
            "{e}"
        );
        // What `keel collateral fetch` and the settings' cache check first.
        assert_eq!(format!("{:#}", check_cache(&dir).unwrap_err()), e);
        let me = nix::unistd::geteuid().as_raw();
        chown(&dir, Some(me), None).unwrap();
        // A directory in it that files go into.
        std::fs::create_dir_all(dir.join("snp/Milan")).unwrap();
        chown(dir.join("snp"), Some(12345), None).unwrap();
        let e = refused();
        assert!(
            e.contains(&format!(
                "the collateral cache directory {} belongs to another user",
                dir.join("snp").display()
            )),
            "{e}"
        );
        assert!(entries(&dir).is_empty());

        chown(dir.join("snp"), Some(me), None).unwrap();
        store(&dir, &files).unwrap();
        assert_eq!(entries(&dir), ["snp/Milan/crl.der"]);
        // A cache not made yet is made private.
        let new = cache.path().join("new/cache");
        check_cache(&new).unwrap();
        store(&new, &files).unwrap();
        check_cache(&new).unwrap();
    }

    #[test]
    fn a_failure_midway_leaves_the_cache_as_it_was() {
        let cache = tempfile::tempdir().unwrap();
        let chain = cache.path().join("snp/Milan/cert_chain.pem");
        std::fs::create_dir_all(chain.parent().unwrap()).unwrap();
        std::fs::write(&chain, b"old chain").unwrap();
        // A file where the third one's directory must be.
        std::fs::write(cache.path().join("blocked"), b"").unwrap();
        let files = [
            CacheFile::new(
                "snp/Milan/cert_chain.pem",
                b"new chain".to_vec(),
                Kind::Certificate,
            ),
            CacheFile::new("snp/vcek.der", b"new vcek".to_vec(), Kind::Certificate),
            CacheFile::new("blocked/crl.der", b"new crl".to_vec(), Kind::Crl),
        ];
        let e = write_all(cache.path(), &files).unwrap_err();
        assert!(format!("{e:#}").contains("blocked"), "{e:#}");
        assert_eq!(std::fs::read(&chain).unwrap(), b"old chain");
        // Neither the new files nor temporary files remain.
        assert_eq!(
            entries(cache.path()),
            ["blocked", "snp/Milan/cert_chain.pem"]
        );
    }
}
