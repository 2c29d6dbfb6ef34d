//! Test support: swtpm instances with their own EK CA, the local component mirror.

pub mod swtpm;
