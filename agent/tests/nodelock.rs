//! The node lock against a real swtpm: one winner, PCR 15 equals the replay
//! of the event log, and the lock survives an agent restart.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Barrier};

use keel_agent::measured::{MeasuredTpm, SharedTpm};
use keel_agent::nodelock::{LockError, NodeLock};
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_testkit::swtpm::Swtpm;
use keel_verifier::measurement::{self, event_digest, extend, pcr, EventType};

struct Node {
    swtpm: Swtpm,
    dir: tempfile::TempDir,
}

impl Node {
    fn start() -> Self {
        Self {
            swtpm: Swtpm::start_bare().unwrap(),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Opens the TPM and the event log, as the agent does at start.
    fn open(&self) -> SharedTpm {
        let tpm = Tpm::open(&self.swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
        MeasuredTpm::open(tpm, &self.dir.path().join("events.jsonl"))
            .unwrap()
            .shared()
    }
}

fn pcr15(tpm: &SharedTpm) -> [u8; 32] {
    tpm.lock()
        .unwrap()
        .tpm()
        .pcr_read(&[pcr::CLUSTER_ID])
        .unwrap()[&pcr::CLUSTER_ID]
}

/// A lock being recorded waits for the TPM, which a batch of quotes may
/// hold a while; whether the node is locked (asked on async threads by the
/// join client and init) is answered meanwhile, not after it, and the
/// answer turns once the lock lands.
#[test]
fn whether_the_node_is_locked_is_answered_while_a_lock_waits_for_the_tpm() {
    let node = Node::start();
    let tpm = node.open();
    let lock = Arc::new(NodeLock::new(tpm.clone()).unwrap());
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let holder = {
        let tpm = tpm.clone();
        std::thread::spawn(move || {
            let _tpm = tpm.lock().unwrap();
            held_tx.send(()).unwrap();
            let _ = release_rx.recv();
        })
    };
    held_rx.recv().unwrap();
    let locking = {
        let lock = Arc::clone(&lock);
        std::thread::spawn(move || lock.try_lock([7; 32]))
    };
    // Give the locking thread time to take the lock's mutex and wait.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let (answer_tx, answer_rx) = std::sync::mpsc::channel();
    {
        let lock = Arc::clone(&lock);
        std::thread::spawn(move || answer_tx.send(lock.is_locked()).unwrap());
    }
    let answered = answer_rx.recv_timeout(std::time::Duration::from_secs(2));
    release_tx.send(()).unwrap();
    holder.join().unwrap();
    assert_eq!(answered, Ok(false), "is_locked waited for the TPM");
    locking.join().unwrap().unwrap();
    assert!(lock.is_locked());
}

#[test]
fn exactly_one_of_twenty_racing_callers_wins() {
    let node = Node::start();
    let tpm = node.open();
    // Something measured before the lock, so the event is not at seq 0.
    tpm.lock()
        .unwrap()
        .record(EventType::NodeConfig, "config", b"{}".to_vec())
        .unwrap();
    let lock = Arc::new(NodeLock::new(tpm.clone()).unwrap());
    assert!(!lock.is_locked());
    assert_eq!(pcr15(&tpm), [0; 32]);

    let barrier = Arc::new(Barrier::new(20));
    let handles: Vec<_> = (0u8..20)
        .map(|i| {
            let lock = Arc::clone(&lock);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                (i, lock.try_lock([i; 32]))
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let winners: Vec<u8> = results
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    for (_, result) in &results {
        assert!(matches!(result, Ok(()) | Err(LockError::AlreadyLocked)));
    }
    let cluster_id = [winners[0]; 32];
    assert!(lock.is_locked());
    assert_eq!(lock.cluster_id().unwrap(), Some(cluster_id));

    // One ClusterId event, at seq 1, and PCR 15 is its single extend.
    let events = tpm.lock().unwrap().events().to_vec();
    let locks: Vec<_> = events
        .iter()
        .filter(|e| e.event_type == EventType::ClusterId)
        .collect();
    assert_eq!(locks.len(), 1);
    assert_eq!(locks[0].seq, 1);
    assert_eq!(locks[0].data, cluster_id);
    let expected = extend(
        &[0; 32],
        &event_digest(1, EventType::ClusterId, &cluster_id),
    );
    assert_eq!(pcr15(&tpm), expected);
    assert_eq!(
        measurement::replay(&events).unwrap()[&pcr::CLUSTER_ID],
        expected
    );

    // A loser changes nothing.
    assert!(matches!(
        lock.try_lock([0xff; 32]),
        Err(LockError::AlreadyLocked)
    ));
    assert_eq!(pcr15(&tpm), expected);
    assert_eq!(tpm.lock().unwrap().events().len(), 2);
}

#[test]
fn a_restarted_agent_finds_the_node_locked() {
    let node = Node::start();
    {
        let tpm = node.open();
        NodeLock::new(tpm).unwrap().try_lock([7; 32]).unwrap();
    }
    // The agent restarts in the same boot: same TPM, same log.
    let tpm = node.open();
    let lock = NodeLock::new(tpm.clone()).unwrap();
    assert!(lock.is_locked());
    assert_eq!(lock.cluster_id().unwrap(), Some([7; 32]));
    assert!(matches!(
        lock.try_lock([7; 32]),
        Err(LockError::AlreadyLocked)
    ));
    assert_eq!(tpm.lock().unwrap().events().len(), 1);
}

#[test]
fn a_pcr15_extended_elsewhere_counts_as_locked() {
    let node = Node::start();
    let tpm = node.open();
    tpm.lock()
        .unwrap()
        .tpm()
        .pcr_extend(pcr::CLUSTER_ID, &[1; 32])
        .unwrap();
    let lock = NodeLock::new(tpm.clone()).unwrap();
    assert!(lock.is_locked());
    assert_eq!(lock.cluster_id().unwrap(), None);
    assert!(matches!(
        lock.try_lock([2; 32]),
        Err(LockError::AlreadyLocked)
    ));
    assert!(tpm.lock().unwrap().events().is_empty());
}
