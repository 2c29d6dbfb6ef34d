//! Installs components: fetch (or decode) into a temporary file (on the
//! target's file system, or beside the component's kept copy), verify the
//! hash, then rename or copy into place with the right mode — or, for
//! archives, extract strictly and move into place.
//!
//! * Single files get mode 0755 (downloaded executables) or 0644 (inline
//!   `data:` content: kubeadm patches, configuration).
//! * An existing file with the expected hash is left alone (a no-op); any
//!   other file at the path is replaced atomically. Archives are always
//!   extracted again and replace what they contain.
//! * With [`InstallerConfig::kept`] set, each verified downloaded component
//!   (file or archive) is kept there under its hash, and installing it
//!   again takes the kept copy (its hash checked again, in the same read
//!   that copies or extracts it) instead of fetching it: a node that
//!   reboots needs no network for what it already had. On a node the kept
//!   copies are on the state disk and the install paths in guest memory,
//!   so what runs is always bytes hashed on their way into memory. A
//!   download goes beside the kept copy first, so memory takes only
//!   bytes whose hash matched; a kept components' directory that cannot
//!   be made or written fails the install rather than send the download
//!   into memory. A kept archive is the exception: it is extracted into a
//!   staging directory beside its install path (in memory) in the read
//!   that hashes it, within the extraction limits, and nothing of it moves
//!   into place unless the hash matched; a state disk whose sectors were
//!   put back can cost the node that much memory and time, no more.
//! * A failure leaves nothing at the install path: the temporary file or
//!   staging directory is removed.
//!
//! Each install returns an [`InstalledComponent`], the record a node measures
//! so its attestation shows which binaries it runs.

use std::fs::{self, File, Permissions};
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::component::{redact, Component, InstallPath, Source};
use crate::digest::{HashingReader, Sha256Digest};
use crate::download::{DownloadConfig, DownloadError, Downloader};
use crate::extract::{
    extract_tgz_verified_sparing, temporary_prefix, ExtractError, ExtractLimits, ExtractSummary,
    STAGING_SUFFIX,
};
use crate::mirror::Mirror;
use crate::progress::Progress;

/// Mode of a downloaded single-file component (an executable).
pub const EXECUTABLE_MODE: u32 = 0o755;
/// Mode of an inline (`data:`) single-file component (configuration).
pub const DATA_MODE: u32 = 0o644;

/// Installer settings.
#[derive(Debug, Clone)]
pub struct InstallerConfig {
    /// Download, retry and TLS settings.
    pub download: DownloadConfig,
    /// Archive bounds, but for the archive file's size: that is
    /// `download.max_bytes`, for a fetched archive and a kept one alike
    /// (its [`ExtractLimits::max_archive_bytes`] is not used).
    pub extract: ExtractLimits,
    /// Fetch from this mirror instead of the upstream hosts.
    pub mirror: Option<Mirror>,
    /// Install below this directory instead of `/` (image builds, tests).
    /// Measurements record the component's own install path, not this prefix.
    pub root: PathBuf,
    /// Keep each verified downloaded component in this directory (below
    /// `root`, as install paths are), named `<sha256 hex>.tgz` (archives)
    /// or `<sha256 hex>.bin` (single files), and install from the kept copy
    /// when the component is installed again. Downloads are written here
    /// first and reach the install path only once their hash matched; a
    /// directory that cannot be made fails the install. `None`: components
    /// not in place are fetched on every install, into the install path's
    /// directory.
    pub kept: Option<InstallPath>,
}

impl Default for InstallerConfig {
    fn default() -> Self {
        Self {
            download: DownloadConfig::default(),
            extract: ExtractLimits::default(),
            mirror: None,
            root: PathBuf::from("/"),
            kept: None,
        }
    }
}

/// What happened at the install path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The file was written (or replaced).
    Written {
        /// Bytes fetched.
        bytes: u64,
    },
    /// The archive was fetched (or decoded) and extracted.
    Extracted(ExtractSummary),
    /// The kept copy of the archive had the expected hash and was
    /// extracted; nothing was fetched.
    ExtractedKept(ExtractSummary),
    /// The kept copy of the file had the expected hash and was copied into
    /// place; nothing was fetched.
    CopiedKept {
        /// Bytes copied.
        bytes: u64,
    },
    /// A file with the expected hash was already there.
    AlreadyPresent,
}

/// An installed component: what a node measures. The record does not depend
/// on [`Outcome`] or on the mirror, so nodes that installed the same
/// components measure the same bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledComponent {
    component: Component,
    outcome: Outcome,
}

/// A component's measurement record, the data of its PCR 13 event:
/// written by [`Component::measurement_record`] (compact JSON, the fields in
/// this order), read back by [`MeasuredComponent::parse`] (these four
/// fields, each exactly once, nothing else).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredComponent {
    /// Where it came from (redacted; the hash fixes the bytes).
    pub url: String,
    /// Its SHA-256.
    pub hash: Sha256Digest,
    /// Where it was installed.
    pub install_path: String,
    /// Whether it is an archive extracted there.
    pub extract: bool,
}

impl MeasuredComponent {
    /// `data` as a record, or `None` if it is not exactly one.
    pub fn parse(data: &[u8]) -> Option<Self> {
        serde_json::from_slice(data).ok()
    }

    /// Whether this is a record of `component`: the same bytes (hash),
    /// installed at the same path the same way. The URL only says where
    /// they came from.
    pub fn records(&self, component: &Component) -> bool {
        self.hash == component.hash()
            && self.install_path == component.install_path().as_str()
            && self.extract == component.extract()
    }
}

impl InstalledComponent {
    /// The component as listed (upstream URL, expected hash, install path).
    pub fn component(&self) -> &Component {
        &self.component
    }

    /// What the install did.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// The canonical bytes to measure ([`Component::measurement_record`]).
    pub fn measurement_record(&self) -> Vec<u8> {
        self.component.measurement_record()
    }

    /// One line for an event log ([`Component::description`]).
    pub fn description(&self) -> String {
        self.component.description()
    }
}

impl Component {
    /// The canonical bytes to measure: compact JSON with the fields `url`,
    /// `hash`, `install_path`, `extract` in that order. The URL is
    /// [`redact`]ed (no user, password or query): the event log goes to
    /// everyone who attests the node, and the hash fixes the bytes.
    pub fn measurement_record(&self) -> Vec<u8> {
        let record = MeasuredComponent {
            url: redact(self.url()),
            hash: self.hash(),
            install_path: self.install_path().as_str().to_owned(),
            extract: self.extract(),
        };
        // Serialising strings and a bool cannot fail; fall back to empty
        // rather than panic should serde ever say otherwise.
        serde_json::to_vec(&record).unwrap_or_default()
    }

    /// One line for an event log: `component <path> sha256:<hex> from <url>`.
    pub fn description(&self) -> String {
        format!(
            "component {}{} {} from {}",
            self.install_path(),
            if self.extract() { " (extracted)" } else { "" },
            self.hash(),
            redact(self.url())
        )
    }
}

/// Why a component could not be installed. Messages name the component.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InstallError {
    /// The HTTP client could not be set up.
    #[error("setting up the downloader")]
    Setup(#[source] DownloadError),
    /// The install path's parent directory could not be created.
    #[error("creating directory {path:?}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The kept components' directory (on the state disk, on a node) could
    /// not be made: the install fails rather than fetch into the install
    /// path's directory.
    #[error("making the kept components' directory {path:?}")]
    KeptDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The existing file at the install path could not be checked or given
    /// its mode.
    #[error("checking the existing file {path:?}")]
    CheckExisting {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The temporary file could not be created or written.
    #[error("writing a temporary file next to {path:?}")]
    WriteTemp {
        /// The install path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Downloading failed.
    #[error("downloading {name} for {path}")]
    Download {
        /// The component's short name.
        name: String,
        /// Its install path.
        path: InstallPath,
        /// What failed.
        #[source]
        source: Box<DownloadError>,
    },
    /// Inline content does not match its hash.
    #[error("inline content for {path}: hash mismatch: expected {expected}, got {actual}")]
    InlineHashMismatch {
        /// The install path.
        path: InstallPath,
        /// The listed hash.
        expected: Sha256Digest,
        /// The content's hash.
        actual: Sha256Digest,
    },
    /// Setting the mode of an already installed file failed.
    #[error("setting the mode of {path:?}")]
    SetMode {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Renaming the verified file into place failed.
    #[error("moving the verified file into place at {path:?}")]
    Rename {
        /// The destination.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Extraction failed.
    #[error("extracting {name} into {path}")]
    Extract {
        /// The component's short name.
        name: String,
        /// Its install path.
        path: InstallPath,
        /// What failed.
        #[source]
        source: ExtractError,
    },
    /// A blocking file-system task did not complete.
    #[error("running a blocking file-system task")]
    Blocking(#[source] tokio::task::JoinError),
    /// The download, verified as it was written to the kept components'
    /// directory, could not be read back from there with its hash to be
    /// copied into place (it changed, or reading it failed: the log says
    /// which).
    #[error(
        "the download for {path} could not be read back with its hash from the kept components' directory"
    )]
    ChangedOnDisk {
        /// The install path.
        path: InstallPath,
    },
    /// The list has more than one archive to extract into this directory:
    /// each would replace the files of the others it shares a name with.
    #[error("more than one archive in the list extracts into {path}")]
    SharedArchiveDirectory {
        /// The directory.
        path: InstallPath,
    },
    /// The list has more than one component at this install path, not
    /// all of them archives: the one installed last would replace the
    /// others, all of them measured.
    #[error("more than one component in the list installs at {path}")]
    SharedInstallPath {
        /// The install path.
        path: InstallPath,
    },
}

/// Installs components.
#[derive(Debug, Clone)]
pub struct Installer {
    downloader: Downloader,
    mirror: Option<Mirror>,
    root: PathBuf,
    extract_limits: ExtractLimits,
    kept: Option<PathBuf>,
}

impl Installer {
    /// Sets up the installer (builds the HTTP client).
    pub fn new(config: InstallerConfig) -> Result<Self, InstallError> {
        // An archive, kept or fetched, is read no further than a download
        // may take.
        let extract_limits = ExtractLimits {
            max_archive_bytes: config.download.max_bytes,
            ..config.extract
        };
        Ok(Self {
            downloader: Downloader::new(config.download).map_err(InstallError::Setup)?,
            mirror: config.mirror,
            kept: config.kept.map(|dir| dir.under(&config.root)),
            root: config.root,
            extract_limits,
        })
    }

    /// Installs every component in order, stopping at the first failure.
    pub async fn install_all(
        &self,
        components: &[Component],
        progress: &dyn Progress,
    ) -> Result<Vec<InstalledComponent>, InstallError> {
        let mut installed = Vec::with_capacity(components.len());
        for component in components {
            installed.push(self.install_among(component, components, progress).await?);
        }
        Ok(installed)
    }

    /// Removes the kept copies that none of `components` (a node's whole
    /// list) installs, such as those of a version the node left, and what
    /// interrupted downloads and copies into the directory left. Call it
    /// with no install running. Only files named as kept copies or as
    /// their temporary files are touched; a failure to remove one is
    /// logged.
    pub async fn keep_only_copies_of(&self, components: &[Component]) {
        let Some(dir) = self.kept.clone() else {
            return;
        };
        let wanted: Vec<String> = components.iter().filter_map(kept_name).collect();
        let removed = tokio::task::spawn_blocking(move || {
            let entries = match fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return,
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot list the kept components");
                    return;
                }
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(name) = name.to_str() else {
                    continue;
                };
                let stale = match kept_file_of(name) {
                    Some(KeptFile::Copy) => !wanted.iter().any(|w| w == name),
                    Some(KeptFile::Temporary) => true,
                    None => false,
                };
                if !stale {
                    continue;
                }
                match fs::remove_file(entry.path()) {
                    Ok(()) => tracing::info!(file = name, "removed a kept component no longer listed"),
                    Err(e) => tracing::warn!(
                        file = name,
                        error = %e,
                        "could not remove a kept component no longer listed"
                    ),
                }
            }
        })
        .await;
        if let Err(e) = removed {
            tracing::warn!(error = %e, "removing kept components did not complete");
        }
    }

    /// Installs one component, on its own ([`Installer::install_among`]
    /// with no other components to spare).
    pub async fn install(
        &self,
        component: &Component,
        progress: &dyn Progress,
    ) -> Result<InstalledComponent, InstallError> {
        self.install_among(component, &[], progress).await
    }

    /// Installs `component`, one of the node's list `components`: an
    /// archive that has an entry at another component's install path is
    /// refused before anything of it is moved into place (it would replace
    /// a file measured as that component). A list that [`check_list`]
    /// refuses is refused here whatever `component` is, so a caller that
    /// installs a list in turn has it refused at its first component,
    /// before anything is fetched.
    #[tracing::instrument(
        name = "install",
        skip_all,
        fields(component = component.name(), path = %component.install_path(), hash = %component.hash())
    )]
    pub async fn install_among(
        &self,
        component: &Component,
        components: &[Component],
        progress: &dyn Progress,
    ) -> Result<InstalledComponent, InstallError> {
        let started = Instant::now();
        check_list(components)?;
        let dest = component.install_path().under(&self.root);
        let parent = dest
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| self.root.clone());
        prepare_dir(
            parent.clone(),
            dest.file_name().unwrap_or_default().to_owned(),
        )
        .await?;

        let outcome = if !component.extract()
            && keep_if_matching(&dest, component.hash(), file_mode(component)).await?
        {
            tracing::info!("already installed with the expected hash");
            Outcome::AlreadyPresent
        } else if component.extract() {
            let spare: Vec<PathBuf> = components
                .iter()
                .filter(|other| other.install_path() != component.install_path())
                .map(|other| other.install_path().under(&self.root))
                .collect();
            self.install_archive(component, &dest, &parent, &spare, progress)
                .await?
        } else {
            self.install_file(component, &dest, &parent, progress)
                .await?
        };
        if outcome != Outcome::AlreadyPresent {
            tracing::info!(
                elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                ?outcome,
                "installed"
            );
        }
        let installed = InstalledComponent {
            component: component.clone(),
            outcome,
        };
        progress.installed(&installed);
        Ok(installed)
    }

    /// Installs a single-file component at `dest`: from its kept copy when
    /// that hashes right as it is copied into a temporary file beside
    /// `dest` (in `parent`); else fetched (or decoded) into a temporary
    /// file, there or, with a kept components' directory, in that
    /// directory, copied into place hashed again, and then kept. As for
    /// archives, a kept copy that is missing, unreadable, larger than a
    /// download may be ([`DownloadConfig::max_bytes`]) or not the file is a
    /// miss, never a failure.
    ///
    /// On a node the kept components' directory is on the state disk and
    /// `dest` in guest memory: what a mirror sends reaches memory only once
    /// its hash matched, so one that sends the most bytes a download may
    /// take (during an upgrade, say, while the running version fills the
    /// same memory) costs the disk. A failure to write the disk fails the
    /// install, as for archives: it never sends the fetch into memory.
    async fn install_file(
        &self,
        component: &Component,
        dest: &Path,
        parent: &Path,
        progress: &dyn Progress,
    ) -> Result<Outcome, InstallError> {
        let (mode, expected) = (file_mode(component), component.hash());
        // A kept copy is bounded as a download is.
        let limit = self.downloader.config().max_bytes;
        let kept = self.kept_path(component).await?;
        if let Some(kept) = &kept {
            let copied =
                copy_into_place(kept, "the kept file", dest, parent, expected, limit, mode).await?;
            if let Some(Outcome::Written { bytes }) = copied {
                tracing::info!("copied the kept file");
                return Ok(Outcome::CopiedKept { bytes });
            }
        }
        let temp = self
            .fetch(component, kept.as_deref(), dest, parent, progress)
            .await?;
        let Some(kept) = kept else {
            let target = dest.to_owned();
            return blocking(move || place_file(temp, &target, mode)).await;
        };
        // Hashed again as it is copied: it sat on the disk.
        let outcome = copy_into_place(
            temp.path(),
            "the downloaded file",
            dest,
            parent,
            expected,
            limit,
            mode,
        )
        .await?
        .ok_or_else(|| InstallError::ChangedOnDisk {
            path: component.install_path().clone(),
        })?;
        // Keeping is a saving for the next install, not part of this one.
        if let Err(e) = blocking(move || place_file(temp, &kept, DATA_MODE)).await {
            tracing::warn!(error = %crate::ErrorChain(&e), "could not keep the verified file");
        }
        Ok(outcome)
    }

    /// Extracts an archive component into `dest`: from its kept copy when
    /// that hashes right as it is extracted, else fetched into a temporary
    /// file (in the kept components' directory, to be kept there once
    /// extracted; without one, in `parent`). What the kept copy lacks (it
    /// is not a regular file, unreadable, larger than a download may be
    /// ([`DownloadConfig::max_bytes`], also as it is read) or not the
    /// archive) makes it a miss, never a failure; a kept components'
    /// directory that cannot be made fails the install.
    async fn install_archive(
        &self,
        component: &Component,
        dest: &Path,
        parent: &Path,
        spare: &[PathBuf],
        progress: &dyn Progress,
    ) -> Result<Outcome, InstallError> {
        let extract_error = |source| InstallError::Extract {
            name: component.name().to_owned(),
            path: component.install_path().clone(),
            source,
        };
        let limits = self.extract_limits;
        let kept = self.kept_path(component).await?;
        if let Some(kept) = kept.clone() {
            let (target, expected, spare) = (dest.to_owned(), component.hash(), spare.to_vec());
            let extracted = blocking(move || {
                Ok(
                    open_bounded(&kept, "the kept archive", limits.max_archive_bytes).map(|file| {
                        extract_tgz_verified_sparing(file, expected, &target, &limits, &spare)
                    }),
                )
            })
            .await?;
            match extracted {
                Some(Ok(summary)) => {
                    tracing::info!("extracted the kept archive");
                    return Ok(Outcome::ExtractedKept(summary));
                }
                None => {}
                // The target's fault: a fetched copy would fare no better.
                Some(Err(e)) if e.is_at_target() => return Err(extract_error(e)),
                Some(Err(e)) => tracing::warn!(
                    error = %crate::ErrorChain(&e),
                    "the kept archive will not do; fetching it again"
                ),
            }
        }
        let temp = self
            .fetch(component, kept.as_deref(), dest, parent, progress)
            .await?;
        let (target, expected, spare) = (dest.to_owned(), component.hash(), spare.to_vec());
        let (summary, temp) = blocking(move || {
            // Hashed again as it is extracted: the file sat on the disk
            // between its download and now.
            let summary = temp
                .reopen()
                .map_err(ExtractError::ReadArchive)
                .and_then(|file| {
                    extract_tgz_verified_sparing(file, expected, &target, &limits, &spare)
                });
            Ok((summary, temp))
        })
        .await?;
        let summary = summary.map_err(extract_error)?;
        if let Some(kept) = kept {
            // Keeping is a saving for the next install, not part of this one.
            if let Err(e) = blocking(move || place_file(temp, &kept, DATA_MODE)).await {
                tracing::warn!(error = %crate::ErrorChain(&e), "could not keep the verified archive");
            }
        }
        Ok(Outcome::Extracted(summary))
    }

    /// Where the kept copy of `component` is, its directory made and
    /// cleared of an interrupted download's or copy's leftovers; `None`
    /// for an inline component (the list that names it carries it) and
    /// without a kept components' directory. A kept components' directory
    /// that cannot be made fails the install: fetching into the install
    /// path's directory instead would send what a mirror sends into the
    /// memory the directory keeps it out of.
    async fn kept_path(&self, component: &Component) -> Result<Option<PathBuf>, InstallError> {
        let (Some(name), Some(dir)) = (kept_name(component), self.kept.clone()) else {
            return Ok(None);
        };
        let path = dir.join(&name);
        prepare_dir(dir, name.into()).await.map_err(|e| match e {
            InstallError::CreateDir { path, source } => InstallError::KeptDir { path, source },
            other => other,
        })?;
        Ok(Some(path))
    }

    /// Fetches or decodes the component into a verified temporary file
    /// beside its `kept` copy when it has one, else beside `dest` (in
    /// `parent`, the install path's directory): the directory the file is
    /// renamed within.
    async fn fetch(
        &self,
        component: &Component,
        kept: Option<&Path>,
        dest: &Path,
        parent: &Path,
        progress: &dyn Progress,
    ) -> Result<tempfile::NamedTempFile, InstallError> {
        let path = kept.unwrap_or(dest).to_owned();
        let dir = kept.and_then(Path::parent).unwrap_or(parent).to_owned();
        let inline = match component.source() {
            Source::Inline(content) => {
                let actual = Sha256Digest::of(content);
                if actual != component.hash() {
                    return Err(InstallError::InlineHashMismatch {
                        path: component.install_path().clone(),
                        expected: component.hash(),
                        actual,
                    });
                }
                Some(content.clone())
            }
            Source::Remote(_) => None,
        };
        let temp = blocking(move || {
            let temp_error = |source| InstallError::WriteTemp {
                path: path.clone(),
                source,
            };
            let temp = temporary_file(&path, &dir).map_err(temp_error)?;
            if let Some(content) = inline {
                temp.as_file().write_all(&content).map_err(temp_error)?;
            }
            Ok(temp)
        })
        .await?;
        if let Source::Remote(upstream) = component.source() {
            let url = match &self.mirror {
                Some(mirror) => mirror.rewrite(upstream),
                None => upstream.clone(),
            };
            let fetched = self
                .downloader
                .download_into(
                    &url,
                    component.hash(),
                    temp.as_file(),
                    component.name(),
                    progress,
                )
                .await
                .map_err(|source| InstallError::Download {
                    name: component.name().to_owned(),
                    path: component.install_path().clone(),
                    source: Box::new(source),
                })?;
            tracing::debug!(
                bytes = fetched.bytes,
                attempts = fetched.attempts,
                "fetched"
            );
        }
        Ok(temp)
    }
}

/// Creates `dir` and removes what an interrupted install of `name` there
/// left ([`remove_leftovers`]).
async fn prepare_dir(dir: PathBuf, name: std::ffi::OsString) -> Result<(), InstallError> {
    blocking(move || {
        fs::create_dir_all(&dir).map_err(|source| InstallError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        remove_leftovers(&dir, &name);
        Ok(())
    })
    .await
}

/// Opens `path` for reading if it is a regular file: `None` if there is
/// none, or something else is there (a symlink, a FIFO, a socket, a
/// directory). Opened without following a symlink and without blocking on
/// a FIFO, then checked on the open handle, so whatever is read (or given
/// a mode) through it is that file, whatever the path names meanwhile.
fn open_regular_file(path: &Path) -> io::Result<Option<File>> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        // A symlink (ELOOP with O_NOFOLLOW) or a UNIX socket (ENXIO).
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENXIO)) => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(file.metadata()?.is_file().then_some(file))
}

/// The file at `path` (`what` it is, for the log: a kept copy, a download
/// to read back), opened as [`open_regular_file`] opens it, if it is a
/// regular file of at most `limit` bytes (what a download may take);
/// `None` (logged, but for a missing file) when it is not there, cannot be
/// read or is larger. Its reader must bound it again: it may grow once
/// opened.
fn open_bounded(path: &Path, what: &str, limit: u64) -> Option<File> {
    let file = match open_regular_file(path) {
        Ok(file) => file?,
        Err(e) => {
            warn_unreadable(what, &e);
            return None;
        }
    };
    match file.metadata() {
        Ok(meta) if meta.len() > limit => {
            warn_too_large(what, limit);
            None
        }
        Ok(_) => Some(file),
        Err(e) => {
            warn_unreadable(what, &e);
            None
        }
    }
}

/// Logs that `what` cannot be read, which makes it a miss.
fn warn_unreadable(what: &str, error: &io::Error) {
    tracing::warn!(error = %error, "{what} cannot be read");
}

/// Logs that `what` is larger than a download may be (`limit`), which
/// makes it a miss.
fn warn_too_large(what: &str, limit: u64) {
    tracing::warn!(limit, "{what} is larger than a download may be");
}

/// The name of a download in progress ends with this; it starts with
/// [`temporary_prefix`].
const PART_SUFFIX: &str = ".keel-part";

/// The name of a kept archive ends with this, after its hash's hex.
const KEPT_ARCHIVE_SUFFIX: &str = ".tgz";
/// The name of a kept single file ends with this, after its hash's hex.
const KEPT_FILE_SUFFIX: &str = ".bin";

/// The file name of the kept copy of `component` in the kept components'
/// directory ([`InstallerConfig::kept`]): `<sha256 hex>.tgz` for an
/// archive, `<sha256 hex>.bin` for a single file; `None` for an inline
/// component, which is never kept (the list that names it carries it).
pub fn kept_name(component: &Component) -> Option<String> {
    if let Source::Inline(_) = component.source() {
        return None;
    }
    let suffix = if component.extract() {
        KEPT_ARCHIVE_SUFFIX
    } else {
        KEPT_FILE_SUFFIX
    };
    Some(format!("{}{suffix}", component.hash().to_hex()))
}

/// What a file in the kept components' directory is, by its name.
enum KeptFile {
    /// A kept copy: `<sha256 hex>.tgz` or `<sha256 hex>.bin`.
    Copy,
    /// A download or copy into the directory that did not end:
    /// `.<kept copy's name>.<random>.keel-part`.
    Temporary,
}

/// What the file `name` in the kept components' directory is, if it is one
/// the installer writes there.
fn kept_file_of(name: &str) -> Option<KeptFile> {
    let is_copy = |n: &str| {
        [KEPT_ARCHIVE_SUFFIX, KEPT_FILE_SUFFIX]
            .iter()
            .any(|suffix| {
                n.strip_suffix(suffix).is_some_and(|hex| {
                    hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())
                })
            })
    };
    if is_copy(name) {
        return Some(KeptFile::Copy);
    }
    // A temporary file's name: the temporary prefix of a copy's name, then
    // the random part and the suffix (both suffixes are 4 bytes long).
    let rest = name.strip_prefix('.')?;
    let copy_len = 64 + KEPT_ARCHIVE_SUFFIX.len();
    let (copy, after) = (rest.get(..copy_len)?, rest.get(copy_len..)?);
    let random_and_suffix = after.strip_prefix('.')?;
    (is_copy(copy) && random_then(random_and_suffix.as_bytes(), PART_SUFFIX))
        .then_some(KeptFile::Temporary)
}

/// Refuses a list with two components at one install path: two archives
/// for one directory would each replace the other's files of the same
/// name, and of two files (or a file and an archive) the one installed
/// last would win while both are measured. Which one won would depend on
/// the order they were installed in. (A component inside an archive's
/// directory is spared by the archive's extraction.)
pub fn check_list(components: &[Component]) -> Result<(), InstallError> {
    for (i, component) in components.iter().enumerate() {
        let path = component.install_path();
        let later = components.get(i + 1..).unwrap_or_default();
        if let Some(other) = later.iter().find(|other| other.install_path() == path) {
            let path = path.clone();
            return Err(if component.extract() && other.extract() {
                InstallError::SharedArchiveDirectory { path }
            } else {
                InstallError::SharedInstallPath { path }
            });
        }
    }
    Ok(())
}

/// Copies `from` (`what` it is, for the log) into place at `dest` with
/// `mode` through [`copy_verified`]; `None` when it is not there, cannot be
/// read, is larger than `limit` bytes or is not the file.
async fn copy_into_place(
    from: &Path,
    what: &'static str,
    dest: &Path,
    dir: &Path,
    expected: Sha256Digest,
    limit: u64,
    mode: u32,
) -> Result<Option<Outcome>, InstallError> {
    let (from, target, dir) = (from.to_owned(), dest.to_owned(), dir.to_owned());
    blocking(move || {
        copy_verified(&from, what, &target, &dir, expected, limit)?
            .map(|temp| place_file(temp, &target, mode))
            .transpose()
    })
    .await
}

/// A temporary file beside `dest` (in `dir`) holding the file at `from`
/// (`what` it is, for the log), if that is a regular file of at most
/// `limit` bytes (what a download may take) whose bytes hash to
/// `expected`: they are hashed as they are copied, so the bytes in the
/// temporary file are the bytes hashed, whatever happens to `from`
/// meanwhile. `None` when there is no file there, or it cannot be read, is
/// too large or is not the file (logged); an error only when the temporary
/// file cannot be written.
fn copy_verified(
    from: &Path,
    what: &str,
    dest: &Path,
    dir: &Path,
    expected: Sha256Digest,
    limit: u64,
) -> Result<Option<tempfile::NamedTempFile>, InstallError> {
    let Some(from) = open_bounded(from, what, limit) else {
        return Ok(None);
    };
    let temp_error = |source| InstallError::WriteTemp {
        path: dest.to_owned(),
        source,
    };
    let mut temp = temporary_file(dest, dir).map_err(temp_error)?;
    let mut source = HashingReader::new(&from);
    let mut buf = vec![0u8; 256 * 1024];
    // Bounded also as it is read: the file may grow meanwhile.
    let mut copied = 0u64;
    loop {
        let n = match source.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                warn_unreadable(what, &e);
                return Ok(None);
            }
        };
        copied = copied.saturating_add(u64::try_from(n).unwrap_or(u64::MAX));
        if copied > limit {
            warn_too_large(what, limit);
            return Ok(None);
        }
        temp.write_all(buf.get(..n).unwrap_or_default())
            .map_err(temp_error)?;
    }
    if source.digest() != expected {
        tracing::warn!("{what} is not the file");
        return Ok(None);
    }
    Ok(Some(temp))
}

/// A temporary file in `dir` named for `dest` ([`temporary_prefix`], random
/// characters, [`PART_SUFFIX`]), so that an install that does not end
/// leaves a file the next one removes.
fn temporary_file(dest: &Path, dir: &Path) -> io::Result<tempfile::NamedTempFile> {
    tempfile::Builder::new()
        .prefix(&temporary_prefix(dest.file_name().unwrap_or_default()))
        .rand_bytes(RANDOM_CHARS)
        .suffix(PART_SUFFIX)
        .tempfile_in(dir)
}

/// Removes what an install of `name` in `dir` that did not end (a crash, a
/// power cut) left behind: unmeasured bytes beside the components. Only
/// regular files named as its downloads and directories named as its
/// extraction staging ([`temporary_prefix`], [`PART_SUFFIX`],
/// [`STAGING_SUFFIX`]) are touched; a failure to remove one is logged.
fn remove_leftovers(dir: &Path, name: &std::ffi::OsStr) {
    use std::os::unix::ffi::OsStrExt as _;
    let prefix = temporary_prefix(name);
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(rest) = file_name.as_bytes().strip_prefix(prefix.as_bytes()) else {
            continue;
        };
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let removed = if kind.is_file() && random_then(rest, PART_SUFFIX) {
            fs::remove_file(entry.path())
        } else if kind.is_dir() && random_then(rest, STAGING_SUFFIX) {
            fs::remove_dir_all(entry.path())
        } else {
            continue;
        };
        match removed {
            Ok(()) => tracing::warn!(
                path = %entry.path().display(),
                "removed what an interrupted install left"
            ),
            Err(e) => tracing::warn!(
                path = %entry.path().display(),
                error = %e,
                "could not remove what an interrupted install left"
            ),
        }
    }
}

/// Whether `rest` is the random part of a temporary name (as many
/// alphanumerics as [`RANDOM_CHARS`]) and then `suffix`: so the leftovers
/// of a component `a` are never those of a component `a.b`.
fn random_then(rest: &[u8], suffix: &str) -> bool {
    rest.strip_suffix(suffix.as_bytes()).is_some_and(|random| {
        random.len() == RANDOM_CHARS && random.iter().all(u8::is_ascii_alphanumeric)
    })
}

/// Random characters in a temporary name.
pub(crate) const RANDOM_CHARS: usize = 6;

/// The mode a single-file component is installed with.
fn file_mode(component: &Component) -> u32 {
    match component.source() {
        Source::Remote(_) => EXECUTABLE_MODE,
        Source::Inline(_) => DATA_MODE,
    }
}

/// Runs blocking file-system work off the async runtime.
async fn blocking<T, F>(work: F) -> Result<T, InstallError>
where
    F: FnOnce() -> Result<T, InstallError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(InstallError::Blocking)?
}

/// Whether `dest` is a regular file (not a symlink) with the expected hash;
/// if so, gives it `mode`. The file is opened without following a symlink
/// and checked, hashed and changed through that one descriptor, so a path
/// swapped in between cannot have its target hashed or its mode changed.
async fn keep_if_matching(
    dest: &Path,
    expected: Sha256Digest,
    mode: u32,
) -> Result<bool, InstallError> {
    let path = dest.to_path_buf();
    blocking(move || {
        let check_error = |source| InstallError::CheckExisting {
            path: path.clone(),
            source,
        };
        let Some(file) = open_regular_file(&path).map_err(check_error)? else {
            return Ok(false);
        };
        let mut source = HashingReader::new(&file);
        io::copy(&mut source, &mut io::sink()).map_err(check_error)?;
        if source.digest() != expected {
            return Ok(false);
        }
        file.set_permissions(Permissions::from_mode(mode))
            .map_err(check_error)?;
        Ok(true)
    })
    .await
}

/// Sets the mode, makes the content durable, renames into place and makes
/// the rename durable.
fn place_file(
    temp: tempfile::NamedTempFile,
    dest: &Path,
    mode: u32,
) -> Result<Outcome, InstallError> {
    let rename_error = |source| InstallError::Rename {
        path: dest.to_owned(),
        source,
    };
    let file = temp.as_file();
    file.set_permissions(Permissions::from_mode(mode))
        .map_err(rename_error)?;
    file.sync_all().map_err(rename_error)?;
    let bytes = file.metadata().map_err(rename_error)?.len();
    temp.persist(dest).map_err(|e| rename_error(e.error))?;
    crate::durable::sync_parent(dest).map_err(rename_error)?;
    Ok(Outcome::Written { bytes })
}
