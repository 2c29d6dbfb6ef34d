//! What the agent prints on the console at startup: `pcr N sha256:<hex>`
//! for PCRs 0-23, then `keel-agent: ready`. Lines may carry a journal or
//! kernel prefix (`[   16.7] keel-agent[144]: pcr 4 sha256:...`).

use std::collections::BTreeMap;

use keel_verifier::measurement::Digest32;

/// The line the agent prints once its config is measured and it is ready.
pub const READY_LINE: &str = "keel-agent: ready";

/// The keel initrd's first line (`keel-initrd`, crate `initrd/`): the kernel has
/// finished its own start.
pub const INITRD_STARTED_LINE: &str = "keel-initrd: started";

/// The keel initrd's line for an optional module that did not load, one per
/// module (`keel-initrd: optional module not loaded: <module>: <cause>`).
pub const INITRD_MODULE_SKIPPED_LINE: &str = "keel-initrd: optional module not loaded";

/// The PCR values in the agent's `pcr N sha256:<hex>` lines. A PCR printed
/// more than once (the agent restarted) keeps its last value; lines that do
/// not parse are ignored.
pub fn reported_pcrs<'a>(lines: impl IntoIterator<Item = &'a str>) -> BTreeMap<u32, Digest32> {
    lines.into_iter().filter_map(pcr_line).collect()
}

fn pcr_line(line: &str) -> Option<(u32, Digest32)> {
    let (_, rest) = line.split_once("pcr ")?;
    let (index, rest) = rest.split_once(" sha256:")?;
    let index: u32 = index.parse().ok().filter(|i| *i < 24)?;
    let hex_value = rest.get(..64)?;
    let mut digest = [0u8; 32];
    hex::decode_to_slice(hex_value, &mut digest).ok()?;
    Some((index, digest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prefixed_lines_and_keeps_the_last_value() {
        let a = "ab".repeat(32);
        let b = "cd".repeat(32);
        let lines = [
            format!("[   16.706308] keel-agent[144]: pcr 4 sha256:{a}"),
            format!("pcr 11 sha256:{a}"),
            format!("[   20.1] keel-agent[200]: pcr 4 sha256:{b}"),
            "keel-agent: ready".to_string(),
        ];
        let pcrs = reported_pcrs(lines.iter().map(String::as_str));
        assert_eq!(pcrs.len(), 2);
        assert_eq!(pcrs.get(&4), Some(&[0xcd; 32]));
        assert_eq!(pcrs.get(&11), Some(&[0xab; 32]));
    }

    #[test]
    fn ignores_lines_that_are_not_pcr_values() {
        let good = "00".repeat(32);
        let lines = [
            format!("pcr 24 sha256:{good}"),
            format!("pcr x sha256:{good}"),
            "pcr 4 sha256:00ff".to_string(),
            format!("pcr 4 sha1:{good}"),
            format!("pcr 5 sha256:{}", "zz".repeat(32)),
            "node config from built-in defaults pcr=12".to_string(),
        ];
        assert!(reported_pcrs(lines.iter().map(String::as_str)).is_empty());
    }
}
