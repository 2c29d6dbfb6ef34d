//! The `regex` crate's interface as far as `regex-lite` has it, for the
//! workspace's dependencies (see this crate's Cargo.toml).
//!
//! Syntax, matching and replacement are `regex-lite`'s: `regex`'s syntax
//! without Unicode classes (`\w`, `\d`, `\s`, `\b` and case-insensitive
//! matching are ASCII only, `\p{..}` is refused), in time linear in the
//! input like `regex`. Not here: `regex::bytes`, `RegexSet`, the `Error`
//! enum's variants, some builder options, class set operations. A
//! dependency that names a missing item does not compile; a missing piece
//! of syntax fails only when the expression is compiled, and a Perl class
//! changes its meaning silently. So `tests/dependents.rs` names the
//! dependents, at the versions whose expressions it checks.

pub use regex_lite::*;
