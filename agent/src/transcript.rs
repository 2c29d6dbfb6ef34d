//! The transcript of one long operation the operator's CLI watches (init,
//! an upgrade): every line is streamed to the CLI and kept for the failure
//! report, without ever holding the node up.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc::{self, error::TrySendError};

/// The messages of one kind of streamed operation.
pub trait Streamed: Sized + Send + 'static {
    /// What goes on the wire.
    type Message: Send + 'static;
    /// The operation's name, for the node's own log.
    const OPERATION: &'static str;
    /// Writes `line` to the node's own log, under the operation's target
    /// (the line alone: tools read reports off the console).
    fn log(line: &str);
    /// A progress line.
    fn log_line(line: String) -> Self;
    /// The wire message carrying `self`.
    fn into_message(self) -> Self::Message;
}

impl Streamed for keel_proto::init::init_response::Kind {
    type Message = keel_proto::init::InitResponse;
    const OPERATION: &'static str = "init";

    fn log(line: &str) {
        tracing::info!(target: "keel_agent::init", "{line}");
    }

    fn log_line(line: String) -> Self {
        Self::LogLine(line)
    }

    fn into_message(self) -> Self::Message {
        keel_proto::init::InitResponse { kind: Some(self) }
    }
}

impl Streamed for keel_proto::operator::upgrade_response::Event {
    type Message = keel_proto::operator::UpgradeResponse;
    const OPERATION: &'static str = "upgrade";

    fn log(line: &str) {
        tracing::info!(target: "keel_agent::upgrade", "{line}");
    }

    fn log_line(line: String) -> Self {
        Self::Log(line)
    }

    fn into_message(self) -> Self::Message {
        keel_proto::operator::UpgradeResponse { event: Some(self) }
    }
}

/// The receiving end of a transcript's stream.
pub type Receiver<K> = mpsc::Receiver<Result<<K as Streamed>::Message, tonic::Status>>;

/// Most bytes of node logs sent after a failure.
pub const MAX_FAILURE_LOGS: usize = keel_proto::MAX_FAILURE_LOG_BYTES;
/// Messages the stream holds for a slow client; lines beyond it are
/// dropped (and counted) rather than waited for.
const STREAM_BUFFER: usize = 256;
/// Longest log line streamed or kept; longer ones are cut.
const MAX_LINE: usize = 16 * 1024;
/// How long the final message (and after a failure, the log chunks) may
/// wait for a client that does not read, in all.
const FINAL_WAIT: Duration = Duration::from_secs(30);

/// The lines of one operation: streamed to the CLI and kept for the failure
/// report.
///
/// Streaming never holds the node up. A line that does not fit into the
/// stream's buffer ([`STREAM_BUFFER`] messages: the client is not reading)
/// is dropped and counted, and once there is room again one line says how
/// many were dropped. The final message, and after a failure the collected
/// logs, wait for room, at most [`FINAL_WAIT`] in all. The kept lines are
/// bounded to the [`MAX_FAILURE_LOGS`] most recent bytes.
pub struct Transcript<K: Streamed> {
    tx: mpsc::Sender<Result<K::Message, tonic::Status>>,
    state: Arc<Mutex<TranscriptState>>,
    kind: PhantomData<fn() -> K>,
}

impl<K: Streamed> Clone for Transcript<K> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            state: self.state.clone(),
            kind: PhantomData,
        }
    }
}

#[derive(Default)]
struct TranscriptState {
    kept: VecDeque<String>,
    kept_bytes: usize,
    /// Lines not streamed since the last one that was.
    dropped: u64,
}

impl TranscriptState {
    fn keep(&mut self, line: String) {
        self.kept_bytes += line.len() + 1;
        self.kept.push_back(line);
        while self.kept_bytes > MAX_FAILURE_LOGS {
            match self.kept.pop_front() {
                Some(old) => self.kept_bytes -= old.len() + 1,
                None => break,
            }
        }
    }
}

/// The line that stands for `n` lines the client did not get.
fn dropped_marker<K: Streamed>(n: u64) -> K {
    K::log_line(format!("… {n} log lines dropped (client not reading)"))
}

fn message<K: Streamed>(kind: K) -> Result<K::Message, tonic::Status> {
    Ok(kind.into_message())
}

/// `line` cut to at most [`MAX_LINE`] bytes, on a character boundary.
fn bounded_line(mut line: String) -> String {
    if line.len() > MAX_LINE {
        let mut end = MAX_LINE;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push_str(" [cut]");
    }
    line
}

impl<K: Streamed> Transcript<K> {
    /// A transcript streaming to a new channel, and that channel's receiver.
    pub fn new() -> (Self, Receiver<K>) {
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let transcript = Self {
            tx,
            state: Arc::default(),
            kind: PhantomData,
        };
        (transcript, rx)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, TranscriptState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Logs, keeps and streams `line`, without waiting for the client.
    pub fn line(&self, line: impl Into<String>) {
        let line = bounded_line(line.into());
        K::log(&line);
        let mut state = self.state();
        state.keep(line.clone());
        // A gone client does not stop the init: the node finishes (or
        // fails) either way.
        if state.dropped > 0 {
            match self
                .tx
                .try_send(message(dropped_marker::<K>(state.dropped)))
            {
                Ok(()) => state.dropped = 0,
                Err(TrySendError::Full(_)) => {
                    state.dropped += 1;
                    return;
                }
                Err(TrySendError::Closed(_)) => return,
            }
        }
        if let Err(TrySendError::Full(_)) = self.tx.try_send(message(K::log_line(line))) {
            state.dropped += 1;
        }
    }

    /// Streams the closing `messages` (after a marker for dropped lines),
    /// waiting for room at most [`FINAL_WAIT`] in all. Returns whether the
    /// client got them all.
    pub async fn finish(&self, messages: impl IntoIterator<Item = K>) -> bool {
        let deadline = tokio::time::Instant::now() + FINAL_WAIT;
        let dropped = std::mem::take(&mut self.state().dropped);
        let marker = (dropped > 0).then(|| dropped_marker(dropped));
        for kind in marker.into_iter().chain(messages) {
            match tokio::time::timeout_at(deadline, self.tx.send(message(kind))).await {
                Ok(Ok(())) => {}
                // The client is gone.
                Ok(Err(_)) => return false,
                Err(_) => {
                    tracing::warn!(
                        wait = ?FINAL_WAIT,
                        operation = K::OPERATION,
                        "the client is not reading; the rest of its stream is dropped"
                    );
                    return false;
                }
            }
        }
        true
    }

    /// The node's logs: this transcript, then the journal of this boot where
    /// there is one, at most [`MAX_FAILURE_LOGS`] bytes of whole lines, the
    /// most recent, with anything shaped like a bootstrap token redacted.
    pub async fn collected_logs(&self) -> Vec<u8> {
        let mut out: Vec<u8> = {
            let state = self.state();
            let mut text = String::with_capacity(state.kept_bytes);
            for line in &state.kept {
                text.push_str(line);
                text.push('\n');
            }
            text.into_bytes()
        };
        // journalctl reads the whole journal: not on a worker of the runtime.
        let journal = tokio::task::spawn_blocking(|| journal_of_this_boot(MAX_FAILURE_LOGS))
            .await
            .ok()
            .flatten();
        if let Some(journal) = journal {
            out.extend_from_slice(b"--- journal of this boot ---\n");
            out.extend_from_slice(&journal);
        }
        whole_lines_tail(&mut out, MAX_FAILURE_LOGS);
        out
    }
}

/// The last `limit` bytes of this boot's journal (other units' lines too),
/// tokens redacted; `None` where there is no journal to read.
fn journal_of_this_boot(limit: usize) -> Option<Vec<u8>> {
    let mut child = std::process::Command::new("journalctl")
        .args(["-b", "--no-pager", "-o", "short-monotonic"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let tail = child.stdout.take().map(|out| tail_of(out, limit));
    let status = child.wait().ok()?;
    let mut tail = tail.filter(|_| status.success())?;
    whole_lines_tail(&mut tail, limit);
    Some(crate::kubeadm::run::scrub_tokens(&String::from_utf8_lossy(&tail)).into_bytes())
}

/// The last bytes `reader` gives: all of them when they are at most
/// `limit`, otherwise more than `limit` (up to twice that), so that a cut
/// shows; at most about twice `limit` is held however much it gives.
fn tail_of(mut reader: impl std::io::Read, limit: usize) -> Vec<u8> {
    let mut tail = Vec::new();
    let mut chunk = vec![0; 64 * 1024];
    loop {
        match reader.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                tail.extend_from_slice(chunk.get(..n).unwrap_or_default());
                if tail.len() > limit.saturating_mul(2) {
                    tail.drain(..tail.len() - limit - 1);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    tail
}

/// Cuts `text` to its last `limit` bytes, starting at a line's start when
/// it had to be cut (a line cut in half could show half a token, which
/// the redaction would no longer recognise).
fn whole_lines_tail(text: &mut Vec<u8>, limit: usize) {
    if text.len() <= limit {
        return;
    }
    // The kept part starts after the first newline at or after the byte
    // before it: where that byte is one, the kept part starts a line.
    let first = text.len() - limit;
    let cut = text
        .get(first - 1..)
        .and_then(|rest| rest.iter().position(|b| *b == b'\n'))
        .map_or(text.len(), |newline| first + newline);
    text.drain(..cut);
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use keel_proto::init::init_response::Kind;
    use keel_proto::init::{InitFailure, InitSuccess};

    /// Most bytes of node logs sent after a failure (init's chunk size).
    const LOG_CHUNK: usize = 32 * 1024;

    type Rx = Receiver<Kind>;

    fn drain(rx: &mut Rx) -> Vec<Kind> {
        let mut out = Vec::new();
        while let Ok(m) = rx.try_recv() {
            out.push(m.unwrap().kind.unwrap());
        }
        out
    }

    fn text(kind: &Kind) -> &str {
        match kind {
            Kind::LogLine(line) => line,
            other => panic!("not a log line: {other:?}"),
        }
    }

    fn fill(log: &Transcript<Kind>, n: usize) {
        for i in 0..n {
            log.line(format!("line {i}"));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lines_to_a_client_that_does_not_read_are_dropped_and_counted() {
        let (log, mut rx) = Transcript::<Kind>::new();
        let total = 4 * STREAM_BUFFER;
        fill(&log, total);
        let got = drain(&mut rx);
        assert_eq!(got.len(), STREAM_BUFFER);
        assert_eq!(text(&got[0]), "line 0");
        assert_eq!(
            text(&got[STREAM_BUFFER - 1]),
            format!("line {}", STREAM_BUFFER - 1)
        );

        // Once the client reads again it learns how much it missed.
        log.line("after");
        let got = drain(&mut rx);
        let missed = total - STREAM_BUFFER;
        assert_eq!(
            got.iter().map(text).collect::<Vec<_>>(),
            [
                format!("… {missed} log lines dropped (client not reading)").as_str(),
                "after"
            ]
        );
        // The failure report still has every line.
        assert_eq!(log.state().kept.len(), total + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_final_message_reaches_a_client_that_reads_late() {
        let (log, mut rx) = Transcript::<Kind>::new();
        fill(&log, STREAM_BUFFER + 10);
        let reader = tokio::spawn(async move {
            tokio::time::sleep(FINAL_WAIT / 2).await;
            let mut all = Vec::new();
            while let Some(m) = rx.recv().await {
                all.push(m.unwrap().kind.unwrap());
            }
            all
        });
        let delivered = log
            .finish([Kind::Success(InitSuccess {
                kubeconfig: b"kubeconfig".to_vec(),
                cluster_id: vec![1; 32],
            })])
            .await;
        assert!(delivered);
        drop(log);
        let all = reader.await.unwrap();
        assert_eq!(all.len(), STREAM_BUFFER + 2);
        assert_eq!(
            text(&all[STREAM_BUFFER]),
            "… 10 log lines dropped (client not reading)"
        );
        assert!(
            matches!(all.last(), Some(Kind::Success(s)) if s.kubeconfig == b"kubeconfig"),
            "{:?}",
            all.last()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_closing_messages_give_up_on_a_client_that_does_not_read() {
        let (log, rx) = Transcript::<Kind>::new();
        fill(&log, STREAM_BUFFER);
        let started = tokio::time::Instant::now();
        let chunks = (0..100).map(|_| Kind::LogChunk(vec![0; LOG_CHUNK]));
        let failure = Kind::Failure(InitFailure {
            error: "kubeadm init: failed".into(),
            node_reset: true,
        });
        let delivered = log.finish(std::iter::once(failure).chain(chunks)).await;
        assert!(!delivered);
        let waited = started.elapsed();
        assert!(
            waited >= FINAL_WAIT && waited < FINAL_WAIT + Duration::from_secs(1),
            "{waited:?}"
        );
        drop(rx);
    }

    #[tokio::test(start_paused = true)]
    async fn a_gone_client_costs_nothing() {
        let (log, rx) = Transcript::<Kind>::new();
        drop(rx);
        fill(&log, 2 * STREAM_BUFFER);
        let started = tokio::time::Instant::now();
        assert!(!log.finish([Kind::LogChunk(vec![1])]).await);
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(
            log.state().dropped,
            0,
            "nothing is counted for a gone client"
        );
    }

    /// However long the journal, what is held while it is read stays
    /// near twice the bound, and what is kept is its end.
    #[test]
    fn the_journal_is_read_to_its_end_in_bounded_memory() {
        let long: Vec<u8> = (0..10_000_000u32).map(|i| (i % 251) as u8).collect();
        let tail = tail_of(std::io::Cursor::new(&long), 1000);
        assert!((1000..=2000).contains(&tail.len()), "{}", tail.len());
        assert!(long.ends_with(&tail));
        assert_eq!(tail_of(std::io::Cursor::new(b"short"), 1000), b"short");
    }

    /// A cut starts at a line's start, so no half of a token is shown
    /// where the redaction could not see it.
    #[test]
    fn logs_are_cut_at_a_line_start() {
        let mut text = b"abcdef.0123456789abcdef joined\nsecond\nthird\n".to_vec();
        whole_lines_tail(&mut text, 20);
        assert_eq!(text, b"second\nthird\n");
        let mut text = b"no newline at all".to_vec();
        whole_lines_tail(&mut text, 5);
        assert!(text.is_empty());
        let mut text = b"fits\n".to_vec();
        whole_lines_tail(&mut text, 5);
        assert_eq!(text, b"fits\n");
        // A cut that falls at a line's start keeps that line.
        let mut text = b"one\ntwo\nthree\n".to_vec();
        whole_lines_tail(&mut text, 10);
        assert_eq!(text, b"two\nthree\n");
    }

    /// Where the journal's last read is the one that trims what is held,
    /// the cut still shows: a token's line that the cut runs through is
    /// dropped whole, not kept from the middle of its secret half.
    #[test]
    fn a_journal_trimmed_by_its_last_read_is_cut_at_a_line_start() {
        let limit = 100 * 1024;
        // 64 KiB reads: the fourth and last one passes twice the limit.
        let total = 2 * limit + 10;
        // The token's line starts 10 bytes before the last `limit` bytes.
        let line_start = total - limit - 10;
        let mut journal = vec![b'x'; line_start - 1];
        journal.push(b'\n');
        journal.extend_from_slice(b"abcdef.0123456789abcdef joined\n");
        journal.resize(total - 1, b'y');
        journal.push(b'\n');
        let mut tail = tail_of(std::io::Cursor::new(&journal), limit);
        assert!(tail.len() > limit);
        whole_lines_tail(&mut tail, limit);
        let text = String::from_utf8_lossy(&tail);
        assert!(
            !text.contains("abcdef") && !text.contains("joined"),
            "{}",
            &text[..40]
        );
        assert!(text.starts_with('y') && text.ends_with("y\n"));
    }

    #[test]
    fn long_lines_are_cut_and_kept_logs_are_bounded() {
        let (log, mut rx) = Transcript::<Kind>::new();
        log.line("é".repeat(MAX_LINE));
        let got = drain(&mut rx);
        let line = text(&got[0]);
        assert!(line.len() <= MAX_LINE + " [cut]".len(), "{}", line.len());
        assert!(line.ends_with(" [cut]"));

        let mut state = TranscriptState::default();
        for _ in 0..(3 * MAX_FAILURE_LOGS / 1000) {
            state.keep("x".repeat(999));
        }
        assert!(state.kept_bytes <= MAX_FAILURE_LOGS);
        assert_eq!(
            state.kept_bytes,
            state.kept.iter().map(|l| l.len() + 1).sum::<usize>()
        );
        assert!(state.kept_bytes > MAX_FAILURE_LOGS - 1000);
    }
}
