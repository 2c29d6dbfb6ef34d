//! The agent's measurement log on disk, kept consistent with the TPM.
//!
//! Recording is write-ahead: the event is appended (and synced) to the log
//! file first, then extended into its PCR. After a crash between the two,
//! [`MeasuredLog::open`] finds the log one event ahead of the TPM and
//! completes the extend; any other difference means the log or the PCRs
//! were tampered with, and the log is refused. A last line without its end
//! of line is an append that never completed, so never extended: `open`
//! drops it and cuts it off the file. A record that fails once its append
//! began leaves the log unsettled: the next record first settles it as
//! `open` does, and writes nothing if that fails.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use keel_verifier::measurement::{self, pcr, Event, EventType, ReplayError};

use crate::tpm::{Tpm, TpmError};

/// Largest accepted log file.
const MAX_LOG_BYTES: u64 = 4 * 1024 * 1024;

/// Errors of the measurement log.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MeasuredLogError {
    /// Reading or writing the log file failed.
    #[error("event log {path}")]
    Io {
        /// The log file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A log line does not parse.
    #[error("event log {path} line {line} is not an event")]
    Parse {
        /// The log file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The log does not replay to the TPM's PCRs.
    #[error("event log does not match the TPM")]
    Replay(#[source] ReplayError),
    /// A TPM operation failed.
    #[error(transparent)]
    Tpm(#[from] TpmError),
    /// The same kind of one-off event was recorded before with other data.
    #[error("{0} was already measured with different content in this boot")]
    Conflict(&'static str),
    /// An earlier record failed after its append began, and the log could
    /// not be settled since.
    #[error("an earlier measurement did not complete, and the event log could not be settled")]
    Unsettled(#[source] Box<MeasuredLogError>),
}

/// The log file and its events.
pub struct MeasuredLog {
    path: PathBuf,
    events: Vec<Event>,
    /// A record failed after its append began: the file may hold a line
    /// that is not in `events`, cut short or not extended.
    unsettled: bool,
}

impl MeasuredLog {
    /// Opens (or creates) the log at `path` and reconciles it with the TPM.
    pub fn open(path: &Path, tpm: &mut Tpm) -> Result<Self, MeasuredLogError> {
        let io = |source| MeasuredLogError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io)?;
        }
        let (events, whole) = read_events(path)?;
        if let Some(whole) = whole {
            tracing::warn!(
                path = %path.display(),
                "dropping the event log's last line, cut short by a crash while it was appended"
            );
            OpenOptions::new()
                .write(true)
                .open(path)
                .and_then(|f| f.set_len(whole).and_then(|()| f.sync_all()))
                .map_err(io)?;
        }
        let reported = tpm.pcr_read(&pcr::AGENT_OWNED)?;
        let log = Self {
            path: path.to_owned(),
            events,
            unsettled: false,
        };
        match measurement::verify_replay(&log.events, &reported) {
            Ok(()) => Ok(log),
            Err(err) => log
                .complete_pending(tpm, &reported)
                .map_err(|_| MeasuredLogError::Replay(err)),
        }
    }

    /// If all but the last event replay to the TPM ([`pending`]), extends
    /// the last one.
    fn complete_pending(
        self,
        tpm: &mut Tpm,
        reported: &BTreeMap<u32, measurement::Digest32>,
    ) -> Result<Self, MeasuredLogError> {
        let Some(last) = pending(&self.events, reported) else {
            return Err(MeasuredLogError::Conflict("the event log"));
        };
        tracing::warn!(
            event = last.event_type.as_str(),
            "completing an interrupted measurement"
        );
        tpm.pcr_extend(last.pcr, &last.digest)?;
        let reported = tpm.pcr_read(&pcr::AGENT_OWNED)?;
        measurement::verify_replay(&self.events, &reported)
            .map_err(|_| MeasuredLogError::Conflict("the event log"))?;
        Ok(self)
    }

    /// The events so far.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The events of the log at `path` as they are, without settling it
    /// against a TPM or changing the file (a last line cut short is left
    /// out): for a reader beside the agent, which may be appending.
    pub fn read(path: &Path) -> Result<Vec<Event>, MeasuredLogError> {
        read_events(path).map(|(events, _)| events)
    }

    /// Records a new event: appends it to the log, then extends its PCR.
    /// Once an append began, a failure leaves the log unsettled: the next
    /// record first settles it as [`MeasuredLog::open`] does (a line cut
    /// short dropped, a logged event not yet extended extended), and fails
    /// ([`MeasuredLogError::Unsettled`]) without writing if it cannot.
    pub fn record(
        &mut self,
        tpm: &mut Tpm,
        event_type: EventType,
        description: impl Into<String>,
        data: Vec<u8>,
    ) -> Result<(), MeasuredLogError> {
        self.settle(tpm)?;
        let seq = u32::try_from(self.events.len())
            .map_err(|_| MeasuredLogError::Conflict("the event log"))?;
        let event = Event::new(seq, event_type, description, data);
        let io = |source| MeasuredLogError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_vec(&event).map_err(|source| MeasuredLogError::Parse {
            path: self.path.clone(),
            line: self.events.len() + 1,
            source,
        })?;
        line.push(b'\n');
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(io)?;
        self.unsettled = true;
        file.write_all(&line).map_err(io)?;
        file.sync_data().map_err(io)?;
        tpm.pcr_extend(event.pcr, &event.digest)?;
        self.unsettled = false;
        tracing::info!(
            pcr = event.pcr,
            event_type = event.event_type.as_str(),
            digest = %measurement::HexDigest(&event.digest),
            "{}",
            event.description
        );
        self.events.push(event);
        Ok(())
    }

    /// If a record failed once its append began, settles the log as
    /// [`MeasuredLog::open`] does; fails ([`MeasuredLogError::Unsettled`])
    /// if it cannot.
    fn settle(&mut self, tpm: &mut Tpm) -> Result<(), MeasuredLogError> {
        if self.unsettled {
            *self = Self::open(&self.path, tpm)
                .map_err(|e| MeasuredLogError::Unsettled(Box::new(e)))?;
        }
        Ok(())
    }

    /// Records an event unless one of its type was recorded in this boot:
    /// then it must carry the same data (an agent restart), or the call fails.
    pub fn record_once(
        &mut self,
        tpm: &mut Tpm,
        event_type: EventType,
        description: impl Into<String>,
        data: Vec<u8>,
    ) -> Result<(), MeasuredLogError> {
        // A failed record of this event may be pending in the file: settled
        // first, it counts as recorded (the node lock's retry must not add
        // a second cluster ID).
        self.settle(tpm)?;
        match self.events.iter().find(|e| e.event_type == event_type) {
            Some(existing) if existing.data == data => Ok(()),
            Some(_) => Err(MeasuredLogError::Conflict(event_type.as_str())),
            None => self.record(tpm, event_type, description, data),
        }
    }
}

/// The last of `events` if every event before it replays to `reported`:
/// logged ahead of its extend, which has not happened yet.
pub fn pending<'a>(
    events: &'a [Event],
    reported: &BTreeMap<u32, measurement::Digest32>,
) -> Option<&'a Event> {
    let (last, applied) = events.split_last()?;
    // The last event must be one the log could hold (its sequence number,
    // its digest over its data, its type's PCR): only a line whose extend
    // was cut off is completed, never one written by anyone else.
    measurement::replay(events).ok()?;
    measurement::verify_replay(applied, reported)
        .is_ok()
        .then_some(last)
}

/// The events of the log at `path`, and if its last line has no end of
/// line (an append cut short), the length of the whole lines before it.
fn read_events(path: &Path) -> Result<(Vec<Event>, Option<u64>), MeasuredLogError> {
    let io = |source| MeasuredLogError::Io {
        path: path.to_owned(),
        source,
    };
    let bytes = match keel_verifier::bounded::read(path, MAX_LOG_BYTES) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return Err(io(std::io::Error::other("event log too large"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), None)),
        Err(e) => return Err(io(e)),
    };
    let (whole, cut_short) = match bytes.iter().rposition(|b| *b == b'\n') {
        Some(end) if end + 1 == bytes.len() => (&bytes[..], None),
        Some(end) => (&bytes[..=end], Some(end as u64 + 1)),
        None if bytes.is_empty() => (&bytes[..], None),
        None => (&bytes[..0], Some(0)),
    };
    let mut events = Vec::new();
    for (i, line) in whole.split(|b| *b == b'\n').enumerate() {
        if line.trim_ascii().is_empty() {
            continue;
        }
        let event = serde_json::from_slice(line).map_err(|source| MeasuredLogError::Parse {
            path: path.to_owned(),
            line: i + 1,
            source,
        })?;
        events.push(event);
    }
    Ok((events, cut_short))
}

/// The TPM together with the measurement log that describes its agent-owned
/// PCRs. Every extend and every quote goes through one value of this type,
/// so a quote and the log it ships with always agree.
pub struct MeasuredTpm {
    tpm: Tpm,
    log: MeasuredLog,
    cpu: Option<std::sync::Arc<dyn crate::attestation::cpu::CpuReporter>>,
    image: Option<keel_proto::attestation::SignedMeasurements>,
}

/// A [`MeasuredTpm`] shared between the agent's tasks.
pub type SharedTpm = std::sync::Arc<std::sync::Mutex<MeasuredTpm>>;

/// Ends the TPM's cycle for the agent's clean exit ([`Tpm::shutdown`]:
/// flush, then TPM2_Shutdown(CLEAR)), once the TPM is free. Every later use
/// of `tpm` fails. A lock poisoned by a panicked task is taken anyway: each
/// TPM call either completed or failed, and the shutdown is still owed.
pub fn shutdown(tpm: &SharedTpm) -> Result<(), TpmError> {
    let mut guard = tpm
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    guard.tpm.shutdown()
}

impl MeasuredTpm {
    /// Opens the log at `log_path` against `tpm` (see [`MeasuredLog::open`]).
    pub fn open(mut tpm: Tpm, log_path: &Path) -> Result<Self, MeasuredLogError> {
        let log = MeasuredLog::open(log_path, &mut tpm)?;
        Ok(Self {
            tpm,
            log,
            cpu: None,
            image: None,
        })
    }

    /// The same TPM with a source of CPU evidence: every attestation
    /// document then carries the CPU's report binding the attestation key
    /// (the `sev-snp` and `tdx` variants).
    pub fn with_cpu_reporter(
        self,
        cpu: std::sync::Arc<dyn crate::attestation::cpu::CpuReporter>,
    ) -> Self {
        Self {
            cpu: Some(cpu),
            ..self
        }
    }

    /// The source of CPU evidence, if the node has one.
    pub fn cpu_reporter(&self) -> Option<std::sync::Arc<dyn crate::attestation::cpu::CpuReporter>> {
        self.cpu.clone()
    }

    /// The signed measurements of this node's own image, which every
    /// attestation document carries from now on (`None`: none).
    pub fn present_image(&mut self, image: Option<keel_proto::attestation::SignedMeasurements>) {
        self.image = image;
    }

    /// The signed measurements of this node's own image, if presented.
    pub fn image(&self) -> Option<&keel_proto::attestation::SignedMeasurements> {
        self.image.as_ref()
    }

    /// Records a new measurement.
    pub fn record(
        &mut self,
        event_type: EventType,
        description: impl Into<String>,
        data: Vec<u8>,
    ) -> Result<(), MeasuredLogError> {
        self.log
            .record(&mut self.tpm, event_type, description, data)
    }

    /// Records a one-off measurement (see [`MeasuredLog::record_once`]).
    pub fn record_once(
        &mut self,
        event_type: EventType,
        description: impl Into<String>,
        data: Vec<u8>,
    ) -> Result<(), MeasuredLogError> {
        self.log
            .record_once(&mut self.tpm, event_type, description, data)
    }

    /// The events so far.
    pub fn events(&self) -> &[Event] {
        self.log.events()
    }

    /// The TPM, for reads, quotes and credential activation.
    pub fn tpm(&mut self) -> &mut Tpm {
        &mut self.tpm
    }

    /// Shares this value between tasks.
    pub fn shared(self) -> SharedTpm {
        std::sync::Arc::new(std::sync::Mutex::new(self))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::tpm::TctiSpec;
    use keel_testkit::swtpm::{EkCa, Swtpm};

    #[test]
    fn a_record_after_one_that_failed_settles_the_log_first_or_writes_nothing() {
        let ca = EkCa::new().unwrap();
        let swtpm = Swtpm::start(&ca).unwrap();
        let mut tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
        let before = tpm.pcr_read(&pcr::AGENT_OWNED).unwrap();
        // /dev/full fails every write: the append begins and fails.
        let mut log = MeasuredLog {
            path: "/dev/full".into(),
            events: Vec::new(),
            unsettled: false,
        };
        let e = log
            .record(&mut tpm, EventType::Component, "kubelet", b"a".to_vec())
            .unwrap_err();
        assert!(matches!(e, MeasuredLogError::Io { .. }), "{e}");
        // Unsettled, and it cannot be settled (nor written): nothing is.
        let e = log
            .record(&mut tpm, EventType::Component, "kubeadm", b"b".to_vec())
            .unwrap_err();
        assert!(matches!(e, MeasuredLogError::Unsettled(_)), "{e}");
        assert!(log.events().is_empty());
        assert_eq!(tpm.pcr_read(&pcr::AGENT_OWNED).unwrap(), before);

        // What a failed extend leaves (a whole line, not extended) and a
        // write that failed after it (a line cut short): the next record
        // settles both, and is written after them.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("eventlog.jsonl");
        let pending = Event::new(0, EventType::Component, "kubelet", b"a".to_vec());
        let mut text = serde_json::to_vec(&pending).unwrap();
        text.extend_from_slice(b"\n{\"seq\":1,\"ev");
        std::fs::write(&path, text).unwrap();
        log.path = path.clone();
        log.record(&mut tpm, EventType::Component, "kubeadm", b"b".to_vec())
            .unwrap();
        let described: Vec<&str> = log
            .events()
            .iter()
            .map(|e| e.description.as_str())
            .collect();
        assert_eq!(described, ["kubelet", "kubeadm"]);
        let reported = tpm.pcr_read(&pcr::AGENT_OWNED).unwrap();
        measurement::verify_replay(log.events(), &reported).unwrap();
        let (on_disk, cut_short) = read_events(&path).unwrap();
        assert_eq!((on_disk.len(), cut_short), (2, None));
    }

    /// The node lock's retry after a record of its cluster ID failed once
    /// appended (the extend failed): the pending event is settled and
    /// counts as the lock; a second cluster ID is never added.
    #[test]
    fn a_one_off_event_left_pending_is_settled_not_recorded_twice() {
        let ca = EkCa::new().unwrap();
        let swtpm = Swtpm::start(&ca).unwrap();
        let mut tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("eventlog.jsonl");
        let pending = Event::new(0, EventType::ClusterId, "node lock", vec![0xa; 32]);
        let mut text = serde_json::to_vec(&pending).unwrap();
        text.push(b'\n');
        std::fs::write(&path, text).unwrap();
        let mut log = MeasuredLog {
            path,
            events: Vec::new(),
            unsettled: true,
        };

        log.record_once(&mut tpm, EventType::ClusterId, "node lock", vec![0xa; 32])
            .unwrap();
        assert_eq!(log.events().len(), 1);
        let reported = tpm.pcr_read(&pcr::AGENT_OWNED).unwrap();
        measurement::verify_replay(log.events(), &reported).unwrap();
        let e = log
            .record_once(&mut tpm, EventType::ClusterId, "node lock", vec![0xb; 32])
            .unwrap_err();
        assert!(matches!(e, MeasuredLogError::Conflict(_)), "{e}");
        assert_eq!(log.events().len(), 1);
    }
}
