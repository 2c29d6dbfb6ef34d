//! keel: the operator CLI.
fn main() {}
