//! A built image on disk, named by `KEEL_IMAGE_DIR`.

use std::path::{Path, PathBuf};

/// The variable naming the image directory (`scripts/image-build.sh` output).
pub const IMAGE_DIR_VAR: &str = "KEEL_IMAGE_DIR";

/// Why an image directory cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// The directory lacks an artifact the tests need.
    #[error("{dir} has no {file}: build the image with scripts/image-build.sh")]
    Missing {
        /// The image directory.
        dir: PathBuf,
        /// The missing file name.
        file: &'static str,
    },
}

/// The artifacts of one image build.
#[derive(Clone, Debug)]
pub struct ImageDir {
    dir: PathBuf,
}

impl ImageDir {
    /// The image named by `KEEL_IMAGE_DIR`, or `None` when it is unset or
    /// empty (the caller skips). A relative path is taken from the
    /// workspace root. A set variable naming an incomplete directory is an
    /// error: the caller asked for a boot and must not silently skip.
    pub fn from_env() -> Result<Option<Self>, ImageError> {
        match std::env::var_os(IMAGE_DIR_VAR) {
            Some(v) if !v.is_empty() => {
                let dir = workspace_root().join(v);
                Self::open(&dir).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Checks that `dir` holds a disk image and its UKI.
    pub fn open(dir: &Path) -> Result<Self, ImageError> {
        for file in ["keel.raw", "keel.efi"] {
            if !dir.join(file).is_file() {
                return Err(ImageError::Missing {
                    dir: dir.to_owned(),
                    file,
                });
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    /// The whole disk image (GPT: ESP, verity root, hash tree).
    pub fn disk(&self) -> PathBuf {
        self.dir.join("keel.raw")
    }

    /// The unified kernel image the firmware boots.
    pub fn uki(&self) -> PathBuf {
        self.dir.join("keel.efi")
    }

    /// The root partition alone (erofs; mkosi's split artifact).
    pub fn root(&self) -> PathBuf {
        self.dir.join("keel.root.raw")
    }
}

/// The workspace root (this crate's parent directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_names_the_missing_artifact() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let err = ImageDir::open(dir.path()).err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("keel.raw")),
            "{err:?}"
        );
        std::fs::write(dir.path().join("keel.raw"), b"")?;
        let err = ImageDir::open(dir.path()).err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("keel.efi")),
            "{err:?}"
        );
        std::fs::write(dir.path().join("keel.efi"), b"")?;
        let image = ImageDir::open(dir.path())?;
        assert_eq!(image.uki(), dir.path().join("keel.efi"));
        Ok(())
    }
}
