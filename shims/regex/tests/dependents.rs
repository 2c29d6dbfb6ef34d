//! The crates that use `regex` in this workspace, and some of the
//! expressions they compile (copied from their sources at the versions
//! named below), with the results they rely on. The agent's TCTI test runs
//! tss-esapi's parsers whole.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::path::Path;

use regex::Regex;

/// The crates that depend on `regex`, at the versions whose expressions
/// this file checks.
const DEPENDENTS: [(&str, &str); 2] = [("prost-build", "0.14.4"), ("tss-esapi", "7.7.0")];

fn workspace_file(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// A new dependent of `regex` may need what `regex-lite` lacks, and a new
/// version of a dependent may compile other expressions: either fails
/// here once the lock file has it, to be checked.
#[test]
fn regex_is_this_crate_and_its_dependents_are_the_checked_ones() {
    let lock = std::fs::read_to_string(workspace_file("Cargo.lock")).unwrap();
    let mut dependents = Vec::new();
    let mut regex_entries = 0;
    for package in lock.split("[[package]]").skip(1) {
        let field = |key: &str| {
            package.lines().find_map(|l| {
                l.strip_prefix(key)?
                    .trim_start()
                    .strip_prefix("= ")
                    .map(|v| v.trim_matches('"').to_owned())
            })
        };
        let name = field("name").unwrap();
        if name == "regex" {
            regex_entries += 1;
            assert_eq!(field("source"), None, "regex is not the path shim");
        }
        let uses_regex = package
            .lines()
            .map(|l| l.trim().trim_end_matches(',').trim_matches('"'))
            .any(|dep| dep == "regex" || dep.starts_with("regex "));
        if uses_regex {
            dependents.push((name, field("version").unwrap()));
        }
    }
    assert_eq!(regex_entries, 1);
    let expected: Vec<_> = DEPENDENTS
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect();
    assert_eq!(
        dependents, expected,
        "check what these crates need of regex before they use this shim"
    );
}

/// prost-build's URL expression stops at Unicode white space in `regex`,
/// at ASCII white space here: the same on ASCII input.
#[test]
fn the_protobuf_definitions_are_ascii() {
    let dir = workspace_file("proto/keel");
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "proto") {
            let text = std::fs::read(&path).unwrap();
            if let Some(b) = text.iter().find(|b| !b.is_ascii()) {
                panic!("{} holds the non-ASCII byte {b:#x}", path.display());
            }
            files += 1;
        }
    }
    assert!(files > 0, "no .proto files in {}", dir.display());
}

/// tss-esapi's TCTI parsers: a name with optional settings, and one
/// setting out of a comma-separated list.
#[test]
fn tcti_strings_split_as_the_tss_parser_expects() {
    let name = Regex::new(r"^swtpm(:(.*))?$").unwrap();
    let settings = name.captures("swtpm:host=127.0.0.1,port=2331").unwrap();
    assert_eq!(
        settings.get(2).unwrap().as_str(),
        "host=127.0.0.1,port=2331"
    );
    assert!(name.captures("swtpm").unwrap().get(2).is_none());
    assert!(!name.is_match("swtpmx"));

    let port = Regex::new(r"(,|^)port=(.*?)(,|$)").unwrap();
    let of = |s| {
        port.captures(s)
            .map(|c| c.get(2).unwrap().as_str().to_owned())
    };
    assert_eq!(of("host=a,port=2331"), Some("2331".into()));
    assert_eq!(of("port=1,host=a"), Some("1".into()));
    assert_eq!(of("sport=1"), None);

    let bus = Regex::new(r"^[a-zA-Z0-9\-_]+(\.[a-zA-Z0-9\-_]+)+$").unwrap();
    assert!(bus.is_match("com.intel.tss2.Tabrmd"));
    assert!(!bus.is_match("tabrmd"));
}

/// prost-build's doc-comment escaping: URLs in angle brackets, and
/// brackets that are not a link escaped.
#[test]
fn doc_comments_are_escaped_as_prost_build_expects() {
    let url = Regex::new(r"https?://[^\s)]+").unwrap();
    assert_eq!(
        url.replace_all("see https://example.com/a (b) and http://x/y)", r"<$0>"),
        "see <https://example.com/a> (b) and <http://x/y>)"
    );
    let brackets = Regex::new(r"(^|[^\]\\])\[(([^\]]*[^\\])?)\]([^(\[]|$)").unwrap();
    let escape = |s| brackets.replace_all(s, r"$1\[$2\]$4").into_owned();
    assert_eq!(escape("a [b] c"), r"a \[b\] c");
    assert_eq!(escape("[start]"), r"\[start\]");
    assert_eq!(escape("a [link](url)"), "a [link](url)");
    assert_eq!(escape(r"a \[b\] c"), r"a \[b\] c");
}
