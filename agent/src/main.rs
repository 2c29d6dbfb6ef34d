//! keel-agent entry point.
fn main() {}
