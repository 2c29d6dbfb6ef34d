//! Whole-image tests: boot a built keel image under QEMU + OVMF + swtpm and
//! check what the agent reports against what was predicted from the image
//! files. See tests/README.md.
//!
//! [`image`] finds a built image, [`vm`] boots one and watches its serial
//! console, [`report`] reads the agent's console lines.

#![forbid(unsafe_code)]

pub mod image;
pub mod report;
pub mod vm;
