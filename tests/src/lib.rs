//! Whole-image tests: boot a built keel image under QEMU + OVMF + swtpm and
//! check what the agent reports against what was predicted from the image
//! files; and the local cluster built on the same parts. See tests/README.md.
//!
//! [`image`] finds a built image, [`vm`] boots one and watches its serial
//! console, [`report`] reads the agent's console lines,
//! [`timeline`] splits a boot's time into its phases, [`mini`] runs the
//! local cluster (`keel-mini`, the end-to-end scenarios).

#![forbid(unsafe_code)]

pub mod image;
pub mod mini;
pub mod report;
pub mod timeline;
pub mod vm;
