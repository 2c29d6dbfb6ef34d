//! Group commit: work that costs the same for one request as for many (a
//! TPM quote, a durable file write, a kubeadm run) is done once for every
//! request that arrived while the previous round was running.
//!
//! The first request of an idle batcher is processed at once, alone: no
//! added latency at low load. Requests that arrive while a round runs wait
//! in a queue, and the next round takes them all, up to the batcher's
//! bound; the rest wait for the round after. A round's work function gets
//! the requests in arrival order and returns one result per request, or one
//! error for all of them.
//!
//! [`Batcher`] is for blocking callers (the aTLS issuer runs on blocking
//! threads): one waiting caller runs the next round itself. [`AsyncBatcher`]
//! is for async callers: a round runs in its own task, so a caller that
//! gives up does not stop the round others wait for; a run cut short (its
//! task cancelled with the runtime) abandons what it held and frees the
//! batcher.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

/// Why a request got no result of its own.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError<E: std::error::Error + 'static> {
    /// The round that held the request failed; every request of that round
    /// gets the same error.
    #[error("the batch this request was part of failed")]
    Failed(#[source] Arc<E>),
    /// The round ended without a result for the request (its work function
    /// panicked or returned too few results).
    #[error("the batch this request was part of ended without its result")]
    Abandoned,
}

impl<E: std::error::Error + 'static> BatchError<E> {
    /// The error to give the request's caller: the round's own error when
    /// the request was alone in it, else `shared` of the error it shares
    /// with the others; `abandoned` when the round left it without a result.
    pub fn into_cause(self, shared: impl FnOnce(Arc<E>) -> E, abandoned: E) -> E {
        match self {
            Self::Failed(e) => Arc::try_unwrap(e).unwrap_or_else(shared),
            Self::Abandoned => abandoned,
        }
    }
}

impl<E: std::error::Error + 'static> Clone for BatchError<E> {
    fn clone(&self) -> Self {
        match self {
            Self::Failed(e) => Self::Failed(e.clone()),
            Self::Abandoned => Self::Abandoned,
        }
    }
}

/// What a batcher has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Rounds run.
    pub rounds: u64,
    /// Requests processed in them.
    pub requests: u64,
    /// The most requests one round took.
    pub largest: u64,
}

#[derive(Debug, Default)]
struct Counters {
    rounds: AtomicU64,
    requests: AtomicU64,
    largest: AtomicU64,
}

impl Counters {
    fn record(&self, size: usize) {
        let size = size as u64;
        self.rounds.fetch_add(1, Ordering::Relaxed);
        self.requests.fetch_add(size, Ordering::Relaxed);
        self.largest.fetch_max(size, Ordering::Relaxed);
    }

    fn snapshot(&self) -> BatchStats {
        BatchStats {
            rounds: self.rounds.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            largest: self.largest.load(Ordering::Relaxed),
        }
    }
}

type Outcome<O, E> = Result<O, BatchError<E>>;
type Work<I, O, E> = dyn Fn(Vec<I>) -> Result<Vec<O>, E> + Send + Sync;

/// A group-commit queue for blocking callers (see the module docs).
pub struct Batcher<I, O, E: std::error::Error + 'static> {
    state: Mutex<State<I, O, E>>,
    changed: Condvar,
    max: usize,
    work: Box<Work<I, O, E>>,
    counters: Counters,
}

struct State<I, O, E: std::error::Error + 'static> {
    next_id: u64,
    queue: VecDeque<(u64, I)>,
    done: HashMap<u64, Outcome<O, E>>,
    running: bool,
}

impl<I, O, E> Batcher<I, O, E>
where
    E: std::error::Error + 'static,
{
    /// A batcher whose rounds take at most `max` requests (at least one)
    /// and run `work` over them.
    pub fn new(
        max: usize,
        work: impl Fn(Vec<I>) -> Result<Vec<O>, E> + Send + Sync + 'static,
    ) -> Self {
        Self {
            state: Mutex::new(State {
                next_id: 0,
                queue: VecDeque::new(),
                done: HashMap::new(),
                running: false,
            }),
            changed: Condvar::new(),
            max: max.max(1),
            work: Box::new(work),
            counters: Counters::default(),
        }
    }

    /// Processes `item` in the next round and returns its result. Blocks
    /// until then; if no round is running, the caller runs it.
    pub fn submit(&self, item: I) -> Outcome<O, E> {
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.queue.push_back((id, item));
        loop {
            if let Some(outcome) = state.done.remove(&id) {
                return outcome;
            }
            if !state.running && !state.queue.is_empty() {
                state = self.lead(state);
                continue;
            }
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// What this batcher has done so far.
    pub fn stats(&self) -> BatchStats {
        self.counters.snapshot()
    }

    /// Requests queued for the next round.
    pub fn waiting(&self) -> usize {
        self.lock().queue.len()
    }

    /// Runs one round over the head of the queue and posts its results.
    fn lead<'a>(
        &'a self,
        mut state: MutexGuard<'a, State<I, O, E>>,
    ) -> MutexGuard<'a, State<I, O, E>> {
        state.running = true;
        let take = state.queue.len().min(self.max);
        let (ids, items): (Vec<u64>, Vec<I>) = state.queue.drain(..take).unzip();
        drop(state);
        // Posts `Abandoned` to the round's requests if `work` unwinds.
        let mut round = Round {
            batcher: self,
            ids,
            posted: false,
        };
        self.counters.record(items.len());
        let results = (self.work)(items);
        let mut state = self.lock();
        round.post(&mut state, results);
        state
    }

    fn lock(&self) -> MutexGuard<'_, State<I, O, E>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One round's requests, until their results are posted.
struct Round<'a, I, O, E: std::error::Error + 'static> {
    batcher: &'a Batcher<I, O, E>,
    ids: Vec<u64>,
    posted: bool,
}

impl<I, O, E: std::error::Error + 'static> Round<'_, I, O, E> {
    fn post(&mut self, state: &mut State<I, O, E>, results: Result<Vec<O>, E>) {
        let ids = std::mem::take(&mut self.ids);
        match results {
            Ok(results) => {
                let mut results = results.into_iter();
                for id in ids {
                    let outcome = results.next().ok_or(BatchError::Abandoned);
                    state.done.insert(id, outcome);
                }
            }
            Err(e) => {
                let e = Arc::new(e);
                for id in ids {
                    state.done.insert(id, Err(BatchError::Failed(e.clone())));
                }
            }
        }
        state.running = false;
        self.posted = true;
        self.batcher.changed.notify_all();
    }
}

impl<I, O, E: std::error::Error + 'static> Drop for Round<'_, I, O, E> {
    fn drop(&mut self) {
        if self.posted {
            return;
        }
        let mut state = self.batcher.lock();
        for id in std::mem::take(&mut self.ids) {
            state.done.insert(id, Err(BatchError::Abandoned));
        }
        state.running = false;
        self.batcher.changed.notify_all();
    }
}

/// The future of one async round.
pub type RoundFuture<O, E> = Pin<Box<dyn Future<Output = Result<Vec<O>, E>> + Send>>;
type AsyncWork<I, O, E> = dyn Fn(Vec<I>) -> RoundFuture<O, E> + Send + Sync;

/// A group-commit queue for async callers (see the module docs). Rounds run
/// in a task of their own on the current tokio runtime.
pub struct AsyncBatcher<I, O, E: std::error::Error + 'static> {
    state: Mutex<AsyncState<I, O, E>>,
    max: usize,
    work: Box<AsyncWork<I, O, E>>,
    counters: Counters,
}

type Reply<O, E> = oneshot::Sender<Outcome<O, E>>;

struct AsyncState<I, O, E: std::error::Error + 'static> {
    queue: VecDeque<(I, Reply<O, E>)>,
    running: bool,
}

impl<I, O, E> AsyncBatcher<I, O, E>
where
    I: Send + 'static,
    O: Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    /// A batcher whose rounds take at most `max` requests (at least one)
    /// and run `work` over them.
    pub fn new(
        max: usize,
        work: impl Fn(Vec<I>) -> RoundFuture<O, E> + Send + Sync + 'static,
    ) -> Self {
        Self {
            state: Mutex::new(AsyncState {
                queue: VecDeque::new(),
                running: false,
            }),
            max: max.max(1),
            work: Box::new(work),
            counters: Counters::default(),
        }
    }

    /// Processes `item` in the next round and returns its result. A caller
    /// that stops waiting leaves its request in the round.
    pub async fn submit(self: &Arc<Self>, item: I) -> Outcome<O, E> {
        let (reply, result) = oneshot::channel();
        let start = {
            let mut state = self.lock();
            state.queue.push_back((item, reply));
            !std::mem::replace(&mut state.running, true)
        };
        if start {
            // Made before the task: a task dropped before it first ran
            // frees the batcher too.
            tokio::spawn(Self::run(Unfinished(Some(self.clone()))));
        }
        result.await.unwrap_or(Err(BatchError::Abandoned))
    }

    /// What this batcher has done so far.
    pub fn stats(&self) -> BatchStats {
        self.counters.snapshot()
    }

    /// Runs rounds until the queue is empty.
    async fn run(mut unfinished: Unfinished<I, O, E>) {
        let Some(this) = unfinished.0.clone() else {
            return;
        };
        loop {
            let (items, replies): (Vec<I>, Vec<Reply<O, E>>) = {
                let mut state = this.lock();
                if state.queue.is_empty() {
                    state.running = false;
                    unfinished.0 = None;
                    return;
                }
                let take = state.queue.len().min(this.max);
                state.queue.drain(..take).unzip()
            };
            this.counters.record(items.len());
            match (this.work)(items).await {
                Ok(results) => {
                    let mut results = results.into_iter();
                    for reply in replies {
                        let _ = reply.send(results.next().ok_or(BatchError::Abandoned));
                    }
                }
                Err(e) => {
                    let e = Arc::new(e);
                    for reply in replies {
                        let _ = reply.send(Err(BatchError::Failed(e.clone())));
                    }
                }
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, AsyncState<I, O, E>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Frees an [`AsyncBatcher`] whose run ended before its queue did: its task
/// was cancelled (the runtime shut down), maybe before it first ran, or a
/// round panicked. The round's own requests lost their replies with it;
/// the queued ones are abandoned too, and the next request starts a run
/// again.
struct Unfinished<I, O, E: std::error::Error + 'static>(Option<Arc<AsyncBatcher<I, O, E>>>);

impl<I, O, E: std::error::Error + 'static> Drop for Unfinished<I, O, E> {
    fn drop(&mut self) {
        let Some(batcher) = self.0.take() else {
            return;
        };
        let queued = {
            let mut state = batcher.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.running = false;
            std::mem::take(&mut state.queue)
        };
        for (_, reply) in queued {
            let _ = reply.send(Err(BatchError::Abandoned));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use std::sync::Barrier;
    use std::time::Duration;

    #[derive(Debug, thiserror::Error)]
    #[error("round failed")]
    struct Boom;

    #[test]
    fn an_idle_batcher_runs_a_request_at_once_and_alone() {
        let batcher = Batcher::new(8, |items: Vec<u32>| Ok::<_, Boom>(items));
        assert_eq!(batcher.submit(7).unwrap(), 7);
        assert_eq!(batcher.submit(8).unwrap(), 8);
        assert_eq!(
            batcher.stats(),
            BatchStats {
                rounds: 2,
                requests: 2,
                largest: 1
            }
        );
    }

    #[test]
    fn requests_that_arrive_during_a_round_share_the_next_and_rounds_are_bounded() {
        // The first round blocks until every other request is queued.
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let work_gate = gate.clone();
        let batcher = Arc::new(Batcher::new(4, move |items: Vec<u32>| {
            let (open, cv) = &*work_gate;
            let mut open = open.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            Ok::<_, Boom>(items.iter().map(|i| i * 10).collect())
        }));
        let first = {
            let b = batcher.clone();
            std::thread::spawn(move || b.submit(0).unwrap())
        };
        while batcher.stats().rounds == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let others: Vec<_> = (1..=9)
            .map(|i| {
                let b = batcher.clone();
                std::thread::spawn(move || b.submit(i).unwrap())
            })
            .collect();
        while batcher.lock().queue.len() < 9 {
            std::thread::sleep(Duration::from_millis(1));
        }
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        assert_eq!(first.join().unwrap(), 0);
        for (i, t) in (1..=9).zip(others) {
            assert_eq!(t.join().unwrap(), i * 10, "each gets its own result");
        }
        // 1 alone, then 9 queued in rounds of at most 4: 4, 4, 1.
        let stats = batcher.stats();
        assert_eq!(stats.requests, 10);
        assert_eq!(stats.rounds, 4);
        assert_eq!(stats.largest, 4);
    }

    #[test]
    fn a_failed_round_fails_each_of_its_requests_and_the_next_round_runs() {
        let batcher = Batcher::new(8, |items: Vec<u32>| {
            if items.contains(&13) {
                Err(Boom)
            } else {
                Ok(items)
            }
        });
        assert!(matches!(batcher.submit(13), Err(BatchError::Failed(_))));
        assert_eq!(batcher.submit(1).unwrap(), 1);
        // Too few results: the request without one is abandoned.
        let short = Batcher::new(8, |_: Vec<u32>| Ok::<Vec<u32>, Boom>(Vec::new()));
        assert!(matches!(short.submit(1), Err(BatchError::Abandoned)));
    }

    #[test]
    fn a_round_that_panics_abandons_its_requests_and_frees_the_batcher() {
        let batcher = Arc::new(Batcher::new(8, |items: Vec<u32>| {
            if items.contains(&13) {
                panic!("work panicked");
            }
            Ok::<_, Boom>(items)
        }));
        let b = batcher.clone();
        let panicked = std::thread::spawn(move || b.submit(13)).join();
        assert!(panicked.is_err(), "the leader's own call unwinds");
        assert_eq!(batcher.submit(2).unwrap(), 2);
    }

    #[test]
    fn many_threads_each_get_their_own_result() {
        let batcher = Arc::new(Batcher::new(16, |items: Vec<u64>| {
            std::thread::sleep(Duration::from_millis(2));
            Ok::<_, Boom>(items.iter().map(|i| i + 1000).collect())
        }));
        let start = Arc::new(Barrier::new(64));
        let threads: Vec<_> = (0..64u64)
            .map(|i| {
                let (b, start) = (batcher.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    (i, b.submit(i).unwrap())
                })
            })
            .collect();
        for t in threads {
            let (i, out) = t.join().unwrap();
            assert_eq!(out, i + 1000);
        }
        let stats = batcher.stats();
        assert_eq!(stats.requests, 64);
        assert!(stats.rounds < 64, "{stats:?}");
        assert!(stats.largest <= 16, "{stats:?}");
    }

    #[test]
    fn a_round_cancelled_with_its_runtime_frees_the_batcher() {
        // Rounds of value 0 never end; the runtime that runs one shuts down
        // under it, cancelling its task.
        let batcher = Arc::new(AsyncBatcher::new(8, |items: Vec<u32>| {
            Box::pin(async move {
                if items.contains(&0) {
                    std::future::pending::<()>().await;
                }
                Ok(items)
            }) as RoundFuture<u32, Boom>
        }));
        let doomed = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (stuck, queued) = doomed.block_on(async {
            let stuck = tokio::spawn({
                let b = batcher.clone();
                async move { b.submit(0).await }
            });
            while batcher.stats().rounds == 0 {
                tokio::task::yield_now().await;
            }
            // Queued behind the round that never ends.
            let queued = tokio::spawn({
                let b = batcher.clone();
                async move { b.submit(1).await }
            });
            while batcher.lock().queue.is_empty() {
                tokio::task::yield_now().await;
            }
            (stuck, queued)
        });
        drop(doomed);
        let next = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        next.block_on(async {
            assert!(stuck.await.is_err(), "its task ended with the runtime");
            assert!(queued.await.is_err(), "its task ended with the runtime");
            let again = tokio::time::timeout(Duration::from_secs(5), batcher.submit(2)).await;
            assert_eq!(again.expect("the batcher is free again").unwrap(), 2);
        });
        assert!(batcher.lock().queue.is_empty());
    }

    #[test]
    fn a_run_whose_task_never_ran_frees_the_batcher() {
        let batcher = Arc::new(AsyncBatcher::new(8, |items: Vec<u32>| {
            Box::pin(async move { Ok(items) }) as RoundFuture<u32, Boom>
        }));
        // The request is queued and its run's task spawned, not yet run,
        // when the runtime shuts down.
        let doomed = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        doomed.block_on(async {
            let mut submit = std::pin::pin!(batcher.submit(1));
            std::future::poll_fn(|cx| {
                assert!(submit.as_mut().poll(cx).is_pending(), "answered at once");
                std::task::Poll::Ready(())
            })
            .await;
        });
        assert_eq!(batcher.stats().rounds, 0, "the run's task ran");
        drop(doomed);
        let next = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let again = next.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), batcher.submit(2)).await
        });
        assert_eq!(again.expect("the batcher is free again").unwrap(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn async_requests_share_rounds_and_get_their_own_results() {
        let batcher = Arc::new(AsyncBatcher::new(8, |items: Vec<u32>| {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                if items.contains(&13) {
                    return Err(Boom);
                }
                Ok(items.iter().map(|i| i * 2).collect())
            }) as RoundFuture<u32, Boom>
        }));
        assert_eq!(batcher.submit(1).await.unwrap(), 2);
        let tasks: Vec<_> = (0..20u32)
            .map(|i| {
                let b = batcher.clone();
                tokio::spawn(async move { (i, b.submit(i).await) })
            })
            .collect();
        // 13's round fails for every request in it; every other request
        // gets its own result: at least the 12 of the 19 others that 13's
        // round (at most 8 requests) could not hold.
        let mut succeeded = 0;
        for t in tasks {
            let (i, out) = t.await.unwrap();
            match out {
                Ok(v) => {
                    assert_ne!(i, 13, "13's round did not fail");
                    assert_eq!(v, i * 2);
                    succeeded += 1;
                }
                Err(BatchError::Failed(_)) => {}
                Err(e) => panic!("{i}: {e:?}"),
            }
        }
        assert!(succeeded >= 19 - 7, "{succeeded} succeeded");
        let stats = batcher.stats();
        assert_eq!(stats.requests, 21);
        assert!(stats.rounds < 21 && stats.largest <= 8, "{stats:?}");
    }
}
