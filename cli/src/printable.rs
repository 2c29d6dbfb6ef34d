//! Text from a node (log lines, errors, names, event descriptions) shown
//! on the operator's terminal: a node that passed attestation is still not
//! trusted to send the terminal control sequences, or to fake lines.

use std::fmt::{self, Write as _};

/// `text` for the terminal: printable characters as they are; control
/// characters (C0 including ESC, CR and newline, DEL, C1) and bidirectional
/// formatting characters escaped as `\n`, `\r`, `\t` or `\u{..}`.
pub fn printable(text: &str) -> Printable<'_> {
    Printable(text)
}

/// An error with its causes (`{:#}`), [`printable`]: errors carry text
/// that nodes and collateral servers sent (a refusal's message, a field a
/// parser quotes before any signature was checked).
pub fn error_chain(error: &anyhow::Error) -> String {
    printable(&format!("{error:#}")).to_string()
}

/// See [`printable`].
pub struct Printable<'a>(&'a str);

impl fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            match c {
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                c if escaped(c) => write!(f, "{}", c.escape_unicode())?,
                c => f.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// `value` as pretty JSON for the terminal: as `serde_json` writes it,
/// but with every character [`printable`] escapes written as a `\uXXXX`
/// escape, not only the C0 controls JSON requires escaped. The text
/// parses back to the same strings.
pub fn json_pretty<T: serde::Serialize>(value: &T) -> serde_json::Result<String> {
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(
        &mut out,
        TerminalFormatter(serde_json::ser::PrettyFormatter::new()),
    );
    value.serialize(&mut serializer)?;
    // The serializer writes only UTF-8.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// serde_json's pretty formatter, escaping what [`printable`] escapes.
struct TerminalFormatter<'a>(serde_json::ser::PrettyFormatter<'a>);

impl serde_json::ser::Formatter for TerminalFormatter<'_> {
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        let mut rest = fragment;
        while let Some((at, c)) = rest.char_indices().find(|(_, c)| escaped(*c)) {
            writer.write_all(rest.get(..at).unwrap_or_default().as_bytes())?;
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(writer, "\\u{unit:04x}")?;
            }
            rest = rest.get(at + c.len_utf8()..).unwrap_or_default();
        }
        writer.write_all(rest.as_bytes())
    }

    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

/// Whether the terminal gets `c` escaped: a control character or a
/// bidirectional formatting character.
fn escaped(c: char) -> bool {
    c.is_control() || is_bidi_format(c) || is_invisible(c)
}

/// Characters that show as nothing, or break a line, where a terminal
/// prints them: two node names that differ only by one look alike, and a
/// line separator can start a line that looks like the CLI's own.
fn is_invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200d}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{2060}'..='\u{2064}'
            | '\u{feff}'
            | '\u{e0000}'..='\u{e007f}'
    )
}

/// Characters that reorder how the text around them is displayed.
fn is_bidi_format(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {

    /// A terminal control sequence from a collateral server's answer (an
    /// OSC 52 that sets the clipboard), reaching an error's chain: printed
    /// escaped.
    #[test]
    fn an_error_chain_carries_no_control_sequence() {
        let e = anyhow::anyhow!("unknown variant `\x1b]52;c;QUFB\x07`")
            .context("the TCB info does not parse");
        let line = super::error_chain(&e);
        assert!(!line.contains('\x1b') && !line.contains('\x07'), "{line:?}");
        assert!(
            line.starts_with("the TCB info does not parse: unknown variant"),
            "{line}"
        );
    }

    use super::printable;

    #[test]
    fn json_for_the_terminal_escapes_what_printable_escapes_and_parses_back() {
        let raw =
            "ok \u{1b}[2J \u{7f} \u{9b}31m a\u{202e}b ünï 日本 \"q\" \\ \n w\u{200b}\u{e0041}";
        let value = serde_json::json!({ "event": raw, "list": [raw] });
        let shown = super::json_pretty(&value).unwrap();
        assert!(
            !shown
                .chars()
                .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
            "{shown:?}"
        );
        assert!(
            shown.contains("\\u009b31m") && shown.contains("\\u202e"),
            "{shown}"
        );
        assert!(shown.contains("ünï 日本"), "{shown}");
        let back: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(back, value);
        // Laid out as serde_json's pretty printer does.
        assert_eq!(
            super::json_pretty(&serde_json::json!({"a": [1, 2]})).unwrap(),
            serde_json::to_string_pretty(&serde_json::json!({"a": [1, 2]})).unwrap()
        );
    }

    /// A name that differs from another only by an invisible character
    /// (a merged registry's record, say) does not look the same.
    #[test]
    fn invisible_characters_are_escaped() {
        for c in [
            '\u{200b}',
            '\u{200d}',
            '\u{2028}',
            '\u{2060}',
            '\u{feff}',
            '\u{e0041}',
            '\u{00ad}',
        ] {
            let shown = printable(&format!("w-1{c}")).to_string();
            assert_ne!(shown, format!("w-1{c}"), "{c:?}");
            assert!(shown.starts_with("w-1\\u{"), "{shown}");
        }
    }

    #[test]
    fn printable_text_is_kept() {
        let text = "[init] Using Kubernetes version: v1.31.13 \"quoted\" C:\\path ünïcødé 日本";
        assert_eq!(printable(text).to_string(), text);
    }

    #[test]
    fn control_characters_are_escaped() {
        let cases = [
            (
                "\u{1b}[2J\u{1b}]0;title\u{7}",
                "\\u{1b}[2J\\u{1b}]0;title\\u{7}",
            ),
            ("ok\rfake", "ok\\rfake"),
            ("one\ntwo\tthree", "one\\ntwo\\tthree"),
            ("\0\u{8}\u{7f}", "\\u{0}\\u{8}\\u{7f}"),
            // C1: CSI and OSC as single characters.
            ("\u{9b}31m\u{9d}", "\\u{9b}31m\\u{9d}"),
            ("a\u{202e}b\u{2066}", "a\\u{202e}b\\u{2066}"),
        ];
        for (raw, shown) in cases {
            let out = printable(raw).to_string();
            assert_eq!(out, shown);
            assert!(!out.chars().any(char::is_control), "{out:?}");
        }
    }
}
