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

/// See [`printable`].
pub struct Printable<'a>(&'a str);

impl fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            match c {
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                c if c.is_control() || is_bidi_format(c) => write!(f, "{}", c.escape_unicode())?,
                c => f.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// Characters that reorder how the text around them is displayed.
fn is_bidi_format(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::printable;

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
