//! The `regex` crate's interface, backed by `regex-lite`.
//!
//! Syntax, matching and replacement are `regex-lite`'s: the same syntax as
//! `regex` but for Unicode classes (`\w`, `\d` and `\s` are ASCII), and
//! linear time in the input like `regex`.

pub use regex_lite::{
    escape, CaptureLocations, CaptureMatches, CaptureNames, Captures, Error, Match, Matches,
    NoExpand, Regex, RegexBuilder, Replacer, ReplacerRef, Split, SplitN,
};
