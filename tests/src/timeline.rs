//! Where a boot's time goes, read from its serial log (`vm` writes each
//! console line with its arrival time since QEMU started).
//!
//! The anchors: OVMF's boot manager lines, the keel initrd's two lines and
//! the agent's `agent started` and `agent ready` lines (all give
//! `since_boot_s`, the guest's time since the kernel started; the initrd's
//! first line, which it writes to the console itself, places the kernel's
//! start on the host's clock), and the arrival of the agent's ready line.
//!
//! The agent's output reaches the console through journald, which runs a
//! little after the agent: its lines arrive later than they were written,
//! so the agent's own times come from `since_boot_s`, and the wait for
//! journald is a phase of its own.

use std::fmt;
use std::time::Duration;

use crate::report::{INITRD_STARTED_LINE, READY_LINE};

/// The phases of a boot, in order, each with the line that ends it.
pub const PHASES: [&str; 8] = [
    "OVMF to its boot manager",
    "UKI read, measured into PCR 4",
    "stub: PCRs 11, 4, 9; kernel unpacked",
    "kernel init until the initrd runs",
    "initrd: modules, dm-verity, mount",
    "systemd until the agent starts",
    "agent: TPM, PCRs 12 and 13, ready",
    "journald: ready line to the console",
];

/// The index in [`PHASES`] of the phase that ends when the agent is ready.
const AGENT_READY: usize = 6;

/// One boot's phases: when each ended, in seconds since QEMU started.
#[derive(Debug, Clone, PartialEq)]
pub struct BootTimeline {
    ends: [f64; PHASES.len()],
}

/// A serial log without one of the anchors.
#[derive(Debug, thiserror::Error)]
#[error("the serial log has no {0} line")]
pub struct MissingAnchor(&'static str);

/// The arrival time and text of each line of a serial log.
fn lines(serial_log: &str) -> impl Iterator<Item = (f64, &str)> {
    serial_log.lines().filter_map(|l| {
        let l = l.trim_start();
        let (at, text) = l.split_once(' ')?;
        Some((at.parse().ok()?, text))
    })
}

/// The value of `since_boot_s=` in `text`.
fn since_boot(text: &str) -> Option<f64> {
    let (_, rest) = text.split_once("since_boot_s=")?;
    rest.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .next()?
        .parse()
        .ok()
}

impl BootTimeline {
    /// Reads the timeline of the first boot in `serial_log`.
    pub fn parse(serial_log: &str) -> Result<Self, MissingAnchor> {
        let arrival = |needle: &'static str| {
            lines(serial_log)
                .find(|(_, t)| t.contains(needle))
                .ok_or(MissingAnchor(needle))
        };
        let guest = |needle: &'static str| {
            lines(serial_log)
                .find_map(|(at, t)| Some((at, since_boot(t.split_once(needle)?.1)?)))
                .ok_or(MissingAnchor(needle))
        };
        let firmware = arrival("BdsDxe: loading")?.0;
        let loaded = arrival("BdsDxe: starting")?.0;
        let (initrd_at, initrd) = guest(INITRD_STARTED_LINE)?;
        // The initrd writes to the console itself, so its line arrives when
        // it is written: the kernel started `initrd` seconds before.
        let kernel = initrd_at - initrd;
        let (_, switched) = guest("keel-initrd: root opened")?;
        let (_, agent) = guest("agent started")?;
        let on_console = arrival(READY_LINE)?.0;
        // An agent that does not log its ready time: its line's arrival.
        let ready = guest("agent ready").map_or(on_console, |(_, t)| kernel + t);
        Ok(Self {
            ends: [
                firmware,
                loaded,
                kernel,
                kernel + initrd,
                kernel + switched,
                kernel + agent,
                ready,
                on_console,
            ],
        })
    }

    /// How long each phase took.
    pub fn durations(&self) -> [f64; PHASES.len()] {
        let mut d = [0.0; PHASES.len()];
        let mut previous = 0.0;
        for (i, end) in self.ends.iter().enumerate() {
            d[i] = end - previous;
            previous = *end;
        }
        d
    }

    /// Time from QEMU's start to the ready line's arrival on the console.
    pub fn total(&self) -> Duration {
        Duration::from_secs_f64(self.ends[PHASES.len() - 1].max(0.0))
    }

    /// Time from QEMU's start to the agent being ready (its own clock).
    pub fn ready(&self) -> Duration {
        Duration::from_secs_f64(self.ends[AGENT_READY].max(0.0))
    }
}

impl fmt::Display for BootTimeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let durations = self.durations();
        for ((name, end), took) in PHASES.iter().zip(self.ends).zip(durations) {
            writeln!(f, "  {name:<38} {took:6.2} s  (until {end:6.2} s)")?;
        }
        Ok(())
    }
}

/// The median of each phase over `boots`, and of the total, as a table.
pub fn median_table(boots: &[BootTimeline]) -> String {
    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    let mut out = String::new();
    if boots.is_empty() {
        return out;
    }
    for (i, name) in PHASES.iter().enumerate() {
        let m = median(boots.iter().map(|b| b.durations()[i]).collect());
        out.push_str(&format!("  {name:<38} {m:6.2} s\n"));
    }
    let ready = median(boots.iter().map(|b| b.ready().as_secs_f64()).collect());
    out.push_str(&format!(
        "  {:<38} {ready:6.2} s\n",
        "VM start to agent ready"
    ));
    let total = median(boots.iter().map(|b| b.total().as_secs_f64()).collect());
    out.push_str(&format!(
        "  {:<38} {total:6.2} s\n",
        "VM start to the ready line on console"
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "   2.214 [2J[01;01HBdsDxe: loading Boot0001 \"UEFI Misc Device\"
   2.967 BdsDxe: starting Boot0001 \"UEFI Misc Device\"
   5.100 keel-initrd: started since_boot_s=0.44
   6.000 keel-initrd: root opened, starting systemd since_boot_s=1.30
   9.799 [    5.169746] keel-agent[146]: 2026-11-25T10:46:43.326116Z  INFO keel_agent: agent started since_boot_s=4.70
   9.901 [    5.230000] keel-agent[146]: 2026-11-25T10:46:43.860000Z  INFO keel_agent: agent ready since_boot_s=5.24
   9.950 [    5.287143] keel-agent[146]: keel-agent: ready
";

    #[test]
    fn phases_follow_the_anchors() {
        let t = BootTimeline::parse(LOG).unwrap();
        let d = t.durations();
        let expect = [2.214, 0.753, 1.693, 0.44, 0.86, 3.40, 0.54, 0.05];
        for (got, want) in d.iter().zip(expect) {
            assert!((got - want).abs() < 1e-9, "{d:?}");
        }
        assert_eq!(t.total(), Duration::from_secs_f64(9.95));
        assert!((t.ready().as_secs_f64() - 9.90).abs() < 1e-9);
        let table = median_table(&[t.clone(), t]);
        assert!(table.contains("VM start to agent ready"), "{table}");
        assert!(table.contains("on console"), "{table}");
    }

    #[test]
    fn without_a_ready_time_the_agent_phase_ends_at_its_line() {
        let log = LOG.replace("agent ready", "agent set");
        let t = BootTimeline::parse(&log).unwrap();
        assert_eq!(t.ready(), t.total());
        assert_eq!(t.durations()[PHASES.len() - 1], 0.0);
    }

    #[test]
    fn a_missing_anchor_is_named() {
        let log = LOG.replace("agent started", "agent begun");
        let e = BootTimeline::parse(&log).unwrap_err();
        assert!(e.to_string().contains("agent started"), "{e}");
    }
}
