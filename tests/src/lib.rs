//! Whole-image tests under QEMU + swtpm; see tests/README.md.
