//! The expressions the workspace's dependencies compile, with the results
//! they rely on.
#![allow(clippy::unwrap_used)]

use regex::Regex;

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
