//! A small YAML writer for kubeadm's configuration files.
//!
//! The documents are built as an ordered tree ([`Yaml`]) and written in
//! block style. Every string is written as a double-quoted scalar with JSON
//! escaping, which YAML accepts as is: no value (a node name, a SAN, a token)
//! can change the structure of the document, and no field is reordered.

/// A YAML value with ordered mappings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Yaml {
    /// A string, always quoted.
    Str(String),
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
        Self::Str(s.into())
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
        Self::List(items.into_iter().map(|s| Self::Str(s.into())).collect())
    }

    /// Writes documents separated by `---`.
    pub fn documents(docs: &[Yaml]) -> String {
        let mut out = String::new();
        for (i, doc) in docs.iter().enumerate() {
            if i > 0 {
                out.push_str("---\n");
            }
            doc.write_block(&mut out, 0);
        }
        out
    }

    fn scalar(&self) -> Option<String> {
        match self {
            // Serialising a string to JSON cannot fail.
            Self::Str(s) => Some(serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())),
            Self::Int(i) => Some(i.to_string()),
            Self::Bool(b) => Some(b.to_string()),
            Self::List(l) if l.is_empty() => Some("[]".into()),
            Self::Map(m) if m.is_empty() => Some("{}".into()),
            Self::List(_) | Self::Map(_) => None,
        }
    }

    /// Writes a mapping or list at `indent`; a scalar on its own line.
    fn write_block(&self, out: &mut String, indent: usize) {
        let pad = " ".repeat(indent);
        match (self, self.scalar()) {
            (_, Some(scalar)) => {
                out.push_str(&pad);
                out.push_str(&scalar);
                out.push('\n');
            }
            (Self::Map(entries), None) => {
                for (key, value) in entries {
                    out.push_str(&pad);
                    out.push_str(&key_text(key));
                    out.push(':');
                    match value.scalar() {
                        Some(scalar) => {
                            out.push(' ');
                            out.push_str(&scalar);
                            out.push('\n');
                        }
                        None => {
                            out.push('\n');
                            value.write_block(out, indent + 2);
                        }
                    }
                }
            }
            (Self::List(items), None) => {
                for item in items {
                    let mut nested = String::new();
                    item.write_block(&mut nested, indent + 2);
                    // "- " takes the place of the item's first indentation.
                    out.push_str(&pad);
                    out.push_str("- ");
                    out.push_str(nested.get(indent + 2..).unwrap_or_default());
                }
            }
            _ => {}
        }
    }
}

/// A key as written: plain when it is a simple word, quoted otherwise.
fn key_text(key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if plain {
        key.to_owned()
    } else {
        Yaml::Str(key.to_owned()).scalar().unwrap_or_default()
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
            Yaml::documents(&[doc.clone(), doc]).split("---\n").next().unwrap(),
            "kind: \"X\"\nport: 6443\nempty: []\nlist:\n  - \"a\"\n  - name: \"n\"\n    value: \"v\"\nnested:\n  b: -1\n"
        );
    }

    #[test]
    fn strings_cannot_break_the_structure() {
        let doc = Yaml::map(vec![
            ("name", Yaml::str("a\"\nkind: Evil #")),
            ("x: y", Yaml::Int(1)),
        ]);
        assert_eq!(
            Yaml::documents(&[doc]),
            "name: \"a\\\"\\nkind: Evil #\"\n\"x: y\": 1\n"
        );
    }
}
