//! A small YAML writer for kubeadm's configuration files.
//!
//! The documents are built as an ordered tree ([`Yaml`]) and written in
//! block style. Every string is written as a double-quoted scalar with JSON
//! escaping, which YAML accepts as is: no value (a node name, a SAN, a token)
//! can change the structure of the document, and no field is reordered.

use zeroize::Zeroizing;

/// A YAML value with ordered mappings (no `Debug`: a value may be a token).
#[derive(Clone, PartialEq, Eq)]
pub enum Yaml {
    /// A string, always quoted; wiped when dropped (a value may be a
    /// bootstrap token).
    Str(Zeroizing<String>),
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
    /// A sequence.
    List(Vec<Yaml>),
    /// A mapping in the order given.
    Map(Vec<(String, Yaml)>),
}

impl Yaml {
    /// A string value.
    pub fn str(s: impl Into<String>) -> Self {
        Self::Str(Zeroizing::new(s.into()))
    }

    /// A mapping with the entries in the order given.
    pub fn map<K, I>(entries: I) -> Self
    where
        I: IntoIterator<Item = (K, Yaml)>,
        K: Into<String>,
    {
        Self::Map(entries.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    /// A list of strings.
    pub fn strs<I, S>(items: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::List(items.into_iter().map(Self::str).collect())
    }

    /// Writes documents separated by `---`. The text is measured first and
    /// written into a buffer of its size, so no copy of a value is left
    /// behind by a growing buffer, and the buffer is wiped when dropped.
    pub fn documents(docs: &[Yaml]) -> Zeroizing<String> {
        let mut length = Length(0);
        Self::write_documents(docs, &mut length);
        let mut out = Zeroizing::new(String::with_capacity(length.0));
        Self::write_documents(docs, &mut *out);
        out
    }

    fn write_documents(docs: &[Yaml], out: &mut impl Sink) {
        for (i, doc) in docs.iter().enumerate() {
            if i > 0 {
                out.put("---\n");
            }
            doc.write_block(out, 0, true);
        }
    }

    /// Whether the value is written on the line of its key.
    fn is_scalar(&self) -> bool {
        match self {
            Self::Str(_) | Self::Int(_) | Self::Bool(_) => true,
            Self::List(l) => l.is_empty(),
            Self::Map(m) => m.is_empty(),
        }
    }

    fn write_scalar(&self, out: &mut impl Sink) {
        match self {
            Self::Str(s) => quoted(s, out),
            Self::Int(i) => out.put(&i.to_string()),
            Self::Bool(b) => out.put(if *b { "true" } else { "false" }),
            Self::List(_) => out.put("[]"),
            Self::Map(_) => out.put("{}"),
        }
    }

    /// Writes a mapping or list at `indent`, a scalar on its own line;
    /// `pad_first` false when the first line's indentation is written
    /// already (a list item's, after its "- ").
    fn write_block(&self, out: &mut impl Sink, indent: usize, pad_first: bool) {
        let pad = " ".repeat(indent);
        let line_pad = |i: usize| if pad_first || i > 0 { pad.as_str() } else { "" };
        match self {
            Self::Map(entries) if !entries.is_empty() => {
                for (i, (key, value)) in entries.iter().enumerate() {
                    out.put(line_pad(i));
                    key_text(key, out);
                    out.put(":");
                    if value.is_scalar() {
                        out.put(" ");
                        value.write_scalar(out);
                        out.put("\n");
                    } else {
                        out.put("\n");
                        value.write_block(out, indent + 2, true);
                    }
                }
            }
            Self::List(items) if !items.is_empty() => {
                for (i, item) in items.iter().enumerate() {
                    out.put(line_pad(i));
                    // "- " takes the place of the item's first indentation.
                    out.put("- ");
                    item.write_block(out, indent + 2, false);
                }
            }
            _ => {
                out.put(line_pad(0));
                self.write_scalar(out);
                out.put("\n");
            }
        }
    }
}

/// Where text is written: a string, or a count of its length.
trait Sink {
    fn put(&mut self, s: &str);
}

impl Sink for String {
    fn put(&mut self, s: &str) {
        self.push_str(s);
    }
}

/// Counts the bytes that would be written.
struct Length(usize);

impl Sink for Length {
    fn put(&mut self, s: &str) {
        self.0 += s.len();
    }
}

/// Writes `s` as a double-quoted scalar with JSON's escapes (as
/// `serde_json` writes a string), and `\uXXXX` for the characters a YAML
/// 1.1 reader may fold (NEL, line and paragraph separators) or refuse
/// raw (DEL, C1 controls, the BOM, U+FFFE and U+FFFF): YAML reads it back
/// as the same string.
fn quoted(s: &str, out: &mut impl Sink) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.put("\"");
    let mut plain = 0;
    for (i, c) in s.char_indices() {
        let escape = match c {
            '"' => "\\\"",
            '\\' => "\\\\",
            '\n' => "\\n",
            '\r' => "\\r",
            '\t' => "\\t",
            '\u{8}' => "\\b",
            '\u{c}' => "\\f",
            '\0'..='\u{1f}'
            | '\u{7f}'..='\u{9f}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{feff}'
            | '\u{fffe}'
            | '\u{ffff}' => "",
            _ => continue,
        };
        out.put(s.get(plain..i).unwrap_or_default());
        plain = i + c.len_utf8();
        if escape.is_empty() {
            // Every character above is in the BMP: four hex digits.
            let code = u32::from(c);
            let mut text = *b"\\u0000";
            for (k, digit) in text[2..].iter_mut().enumerate() {
                *digit = HEX[((code >> (12 - 4 * k)) & 0xf) as usize];
            }
            out.put(std::str::from_utf8(&text).unwrap_or_default());
        } else {
            out.put(escape);
        }
    }
    out.put(s.get(plain..).unwrap_or_default());
    out.put("\"");
}

/// Writes a key: plain when it is a simple word, quoted otherwise.
fn key_text(key: &str, out: &mut impl Sink) {
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if plain {
        out.put(key);
    } else {
        quoted(key, out);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn writes_block_yaml_with_quoted_strings() {
        let doc = Yaml::map(vec![
            ("kind", Yaml::str("X")),
            ("port", Yaml::Int(6443)),
            ("empty", Yaml::List(vec![])),
            (
                "list",
                Yaml::List(vec![
                    Yaml::str("a"),
                    Yaml::map(vec![("name", Yaml::str("n")), ("value", Yaml::str("v"))]),
                ]),
            ),
            ("nested", Yaml::map(vec![("b", Yaml::Int(-1))])),
        ]);
        assert_eq!(
            Yaml::documents(&[doc.clone(), doc])
                .split("---\n")
                .next()
                .unwrap(),
            "kind: \"X\"\nport: 6443\nempty: []\nlist:\n  - \"a\"\n  - name: \"n\"\n    value: \"v\"\nnested:\n  b: -1\n"
        );
    }

    /// Strings are quoted as JSON writes them: every control character,
    /// quotes and backslashes escaped, the rest of ASCII as it is; the
    /// characters YAML reads differently are escaped too.
    #[test]
    fn strings_are_quoted_as_json_quotes_them() {
        let mut samples: Vec<String> = (0u8..0x7f).map(|b| char::from(b).to_string()).collect();
        samples.extend(["", "plain", "a\"b\\c", "ü€𝄞\n\u{1}x", "\u{1f}\u{0}"].map(String::from));
        for sample in samples {
            let mut out = String::new();
            quoted(&sample, &mut out);
            assert_eq!(out, serde_json::to_string(&sample).unwrap(), "{sample:?}");
        }
        let mut out = String::new();
        quoted("\u{7f}\u{85}\u{2028}\u{2029}\u{feff}\u{ffff}x", &mut out);
        assert_eq!(out, r#""\u007f\u0085\u2028\u2029\ufeff\uffffx""#);
    }

    /// The text is written into a buffer of its measured size: a buffer
    /// that grew would leave copies of a token behind in freed memory.
    #[test]
    fn documents_are_written_into_a_buffer_of_their_size() {
        let doc = Yaml::map(vec![
            ("token", Yaml::str("abcdef.0123456789abcdef")),
            (
                "list",
                Yaml::List(vec![
                    Yaml::str("a\tb"),
                    Yaml::map(vec![("k", Yaml::Int(-12))]),
                ]),
            ),
            ("empty", Yaml::Map(vec![])),
            ("quoted key", Yaml::Bool(true)),
        ]);
        let out = Yaml::documents(&[doc.clone(), doc]);
        assert_eq!(out.capacity(), out.len());
        assert!(out.contains("\"quoted key\": true\n"), "{}", *out);
    }

    /// A YAML 1.1 reader (libyaml, as kubeadm's go-yaml) reads every
    /// string back as it was written: line separators are not folded and
    /// characters YAML does not allow raw (DEL, C1 controls, BOM,
    /// non-characters) are escaped instead of failing the document.
    #[test]
    fn a_yaml_reader_reads_every_string_back_unchanged() {
        let specials = [
            '\u{7f}',
            '\u{80}',
            '\u{85}',
            '\u{9f}',
            '\u{a0}',
            '\u{2028}',
            '\u{2029}',
            '\u{feff}',
            '\u{fffe}',
            '\u{ffff}',
            '\u{d7ff}',
            '\u{e000}',
            '\u{10ffff}',
            '\u{1f600}',
        ];
        let mut samples: Vec<String> = (0u8..0x80).map(|b| char::from(b).to_string()).collect();
        samples.extend(specials.iter().map(|c| format!("a{c}b")));
        samples.push(specials.iter().collect());
        for sample in samples {
            let text = Yaml::documents(&[Yaml::map(vec![("v", Yaml::str(sample.clone()))])]);
            let read: std::collections::BTreeMap<String, String> = serde_yaml::from_str(&text)
                .unwrap_or_else(|e| panic!("{sample:?} written as {:?}: {e}", *text));
            assert_eq!(read["v"], sample, "written as {:?}", *text);
        }
    }

    #[test]
    fn strings_cannot_break_the_structure() {
        let doc = Yaml::map(vec![
            ("name", Yaml::str("a\"\nkind: Evil #")),
            ("x: y", Yaml::Int(1)),
        ]);
        assert_eq!(
            *Yaml::documents(&[doc]),
            "name: \"a\\\"\\nkind: Evil #\"\n\"x: y\": 1\n"
        );
    }
}
