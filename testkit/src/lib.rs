//! Test support: swtpm instances with their own EK CA, the local component mirror.

pub mod components;
pub mod mirror;
pub mod swtpm;
