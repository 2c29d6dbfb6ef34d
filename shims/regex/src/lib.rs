//! The `regex` crate's interface as far as `regex-lite` has it, for the
//! workspace's dependencies (see this crate's Cargo.toml).
//!
//! Syntax, matching and replacement are `regex-lite`'s: `regex`'s syntax
//! without Unicode classes (`\w`, `\d`, `\s`, `\b` and case-insensitive
//! matching are ASCII only, `\p{..}` is refused), in time linear in the
//! input like `regex`. Not here: `regex::bytes`, `RegexSet`, the `Error`
//! enum's variants. A dependency that needs them does not compile, and
//! `tests/dependents.rs` names the dependents this was checked for.

pub use regex_lite::*;
