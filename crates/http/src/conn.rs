//! The open connections: a fixed number at most, each watched for progress. Under
//! [`Idle::Closed`], a connection that neither sends nor takes bytes for a while, or whose answer
//! the client does not take within the write deadline, is closed. Under either policy, when every
//! place is taken, the connection that has waited longest without a request being worked on makes
//! room for the new one (so a crowd of idle sockets cannot lock out a real client), and only when
//! all of them are being answered is the newcomer turned away.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// What happens to connections that hold a place without using it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    /// Kept open however long they wait (for answers that may wait on work for minutes without a
    /// byte either way), until a full house needs the place of one with no request in work.
    Kept,
    /// Closed when silent or when the client does not take its answer, and a full house makes room
    /// by closing the idlest.
    Closed {
        /// No byte in either direction and no request being worked on for this long.
        idle: Duration,
        /// Output the client has not taken within this is dropped with its connection: a client
        /// that never reads is cut off, and one that reads an answer written in pieces must take
        /// each piece within this.
        write: Duration,
    },
}

/// One connection, as its task, its I/O, the reaper and the service answering it share it.
pub struct Conn {
    epoch: Instant,
    /// Requests being worked on (not yet handed to the connection to write).
    busy: AtomicUsize,
    /// Milliseconds since `epoch` of the last byte read or written.
    last_progress: AtomicU64,
    /// Milliseconds since `epoch` (plus one; zero: none) since output has been waiting for the
    /// client to take it.
    write_blocked: AtomicU64,
    /// Told to close.
    pub(crate) close: Notify,
    /// KiB of whole answers that may wait for their clients, shared by every connection.
    budget: Arc<Budget>,
    /// The share of the response budget the last answer holds until the client has taken it.
    response_bytes: Mutex<Option<OwnedSemaphorePermit>>,
}

/// KiB of whole answers that may wait for their clients ([`crate::Limits::response_budget`]).
struct Budget {
    kib: Arc<Semaphore>,
    max_kib: u32,
}

fn kib(bytes: usize) -> u32 {
    bytes.div_ceil(1024).clamp(1, u32::MAX as usize) as u32
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Conn {
    fn new(epoch: Instant, budget: Arc<Budget>) -> Self {
        let now = epoch.elapsed().as_millis() as u64;
        Self {
            epoch,
            busy: AtomicUsize::new(0),
            last_progress: AtomicU64::new(now),
            write_blocked: AtomicU64::new(0),
            close: Notify::new(),
            budget,
            response_bytes: Mutex::new(None),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn progressed(&self) {
        self.last_progress.store(self.now(), Ordering::Relaxed);
    }

    /// Marks a request as being worked on until the guard drops: the connection is neither
    /// closed for silence nor evicted to make room, and a draining server waits for it. A service
    /// whose answer outlives its handler (a streamed body) keeps a guard in the body.
    pub fn working(self: &Arc<Self>) -> Working {
        self.busy.fetch_add(1, Ordering::AcqRel);
        Working(self.clone())
    }

    /// Takes `bytes` of the response budget for a whole answer about to be written on this
    /// connection, held until the client has taken it (as the reaper sees) or the connection ends;
    /// `false` when the budget is spent (answer 503). An answer larger than the whole budget takes
    /// all of it.
    pub fn reserve(&self, bytes: usize) -> bool {
        let want = kib(bytes).min(self.budget.max_kib);
        match self.budget.kib.clone().try_acquire_many_owned(want) {
            Ok(permit) => {
                *lock(&self.response_bytes) = Some(permit);
                true
            }
            Err(_) => false,
        }
    }
}

/// A request in work on a connection ([`Conn::working`]).
pub struct Working(Arc<Conn>);

impl Drop for Working {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
        self.0.progressed();
    }
}

/// The open connections, at most `max`.
pub(crate) struct Conns {
    max: usize,
    idle: Idle,
    epoch: Instant,
    budget: Arc<Budget>,
    next_id: AtomicU64,
    live: Mutex<HashMap<u64, Arc<Conn>>>,
}

/// A connection's place; dropping it frees the place.
pub(crate) struct Place {
    conns: Arc<Conns>,
    id: u64,
    pub(crate) state: Arc<Conn>,
}

impl Drop for Place {
    fn drop(&mut self) {
        lock(&self.conns.live).remove(&self.id);
    }
}

impl Conns {
    /// At most `max` connections, treated as `idle` says, sharing `budget` bytes of whole answers.
    pub(crate) fn new(max: usize, idle: Idle, budget: usize) -> Arc<Self> {
        let max_kib = kib(budget);
        Arc::new(Self {
            max: max.max(1),
            idle,
            epoch: Instant::now(),
            budget: Arc::new(Budget { kib: Arc::new(Semaphore::new(max_kib as usize)), max_kib }),
            next_id: AtomicU64::new(0),
            live: Mutex::new(HashMap::new()),
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.live).len()
    }

    /// A place for a new connection, making room by closing the longest-idle one when all are
    /// taken; `None` when every connection has a request in work.
    pub(crate) fn admit(self: &Arc<Self>) -> Option<Place> {
        let mut live = lock(&self.live);
        if live.len() >= self.max && !self.evict_idlest(&mut live) {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(Conn::new(self.epoch, self.budget.clone()));
        live.insert(id, state.clone());
        Some(Place { conns: self.clone(), id, state })
    }

    /// Closes the connection that has gone longest without progress and without a request being
    /// worked on (out of file descriptors, say); whether there was one.
    pub(crate) fn evict_one(&self) -> bool {
        self.evict_idlest(&mut lock(&self.live))
    }

    /// Requests in work over every connection.
    pub(crate) fn working(&self) -> usize {
        lock(&self.live).values().map(|c| c.busy.load(Ordering::Acquire)).sum()
    }

    /// Closes every connection with no request in work (a draining server).
    pub(crate) fn close_idle(&self) {
        let mut live = lock(&self.live);
        live.retain(|_, c| {
            let idle = c.busy.load(Ordering::Acquire) == 0;
            if idle {
                c.close.notify_one();
            }
            !idle
        });
    }

    fn evict_idlest(&self, live: &mut HashMap<u64, Arc<Conn>>) -> bool {
        let idlest = live
            .iter()
            .filter(|(_, c)| c.busy.load(Ordering::Acquire) == 0)
            .min_by_key(|(_, c)| c.last_progress.load(Ordering::Relaxed))
            .map(|(&id, _)| id);
        match idlest.and_then(|id| live.remove(&id)) {
            Some(c) => {
                tracing::debug!("a full house closes its idlest connection to make room");
                c.close.notify_one();
                true
            }
            None => false,
        }
    }

    /// How often [`Conns::reap`] should run: a fraction of the shortest deadline.
    pub(crate) fn reap_period(&self) -> Duration {
        match self.idle {
            Idle::Kept => Duration::from_secs(1),
            Idle::Closed { idle, write } => {
                (idle.min(write) / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
            }
        }
    }

    /// Closes the connections past a deadline (under [`Idle::Closed`]) and frees the response
    /// budget of answers the client has taken. Called every [`Conns::reap_period`].
    pub(crate) fn reap(&self) {
        let mut live = lock(&self.live);
        let now = self.epoch.elapsed().as_millis() as u64;
        let (idle, write) = match self.idle {
            Idle::Kept => (u64::MAX, u64::MAX),
            Idle::Closed { idle, write } => (idle.as_millis() as u64, write.as_millis() as u64),
        };
        let mut expired = Vec::new();
        for (&id, c) in live.iter() {
            if c.busy.load(Ordering::Acquire) > 0 {
                continue;
            }
            let blocked = c.write_blocked.load(Ordering::Relaxed);
            let silent = now.saturating_sub(c.last_progress.load(Ordering::Relaxed));
            if blocked != 0 && now.saturating_sub(blocked - 1) > write {
                tracing::debug!("closing a connection whose client does not read");
                expired.push(id);
            } else if silent > idle {
                expired.push(id);
            } else if blocked == 0 && silent >= 50 {
                // Everything written has been taken by the kernel (and nothing was offered since a
                // moment ago, so the answer is not about to be written): its bytes are free.
                lock(&c.response_bytes).take();
            }
        }
        for id in expired {
            if let Some(c) = live.remove(&id) {
                c.close.notify_one();
            }
        }
    }
}

/// A TCP stream that records progress in its [`Conn`].
pub(crate) struct Watched<S> {
    inner: S,
    state: Arc<Conn>,
}

impl<S> Watched<S> {
    pub(crate) fn new(inner: S, state: Arc<Conn>) -> Self {
        Self { inner, state }
    }

    /// After a write of `offered` bytes returned `result`: a write that took everything clears the
    /// blocked mark, one that took part or nothing sets it (if not set already).
    fn wrote(&self, offered: usize, result: &Poll<io::Result<usize>>) {
        match result {
            Poll::Ready(Ok(n)) if *n == offered => {
                self.state.write_blocked.store(0, Ordering::Relaxed);
                self.state.progressed();
            }
            Poll::Ready(Ok(n)) => {
                if *n > 0 {
                    self.state.progressed();
                }
                let _ = self.state.write_blocked.compare_exchange(
                    0,
                    self.state.now() + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            Poll::Pending => {
                let _ = self.state.write_blocked.compare_exchange(
                    0,
                    self.state.now() + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            Poll::Ready(Err(_)) => {}
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state.progressed();
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(buf.len(), &result);
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let offered = bufs.iter().map(|b| b.len()).sum();
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(offered, &result);
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLOSED: Idle = Idle::Closed { idle: Duration::from_millis(200), write: Duration::from_millis(50) };

    #[test]
    fn a_full_house_makes_room_by_closing_the_idlest() {
        let conns = Conns::new(2, CLOSED, 1 << 20);
        let a = conns.admit().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let b = conns.admit().unwrap();
        let _busy = b.state.working();
        // `a` has been idle longest and nothing is being answered on it.
        let c = conns.admit().unwrap();
        assert_eq!(conns.len(), 2);
        assert!(!lock(&conns.live).contains_key(&a.id));
        // Both places are now held by requests being answered: the next one is turned away.
        let _busy_c = c.state.working();
        assert!(conns.admit().is_none());
        drop(_busy_c);
        let d = conns.admit();
        assert!(d.is_some(), "c is idle again, and makes room");
        drop(a);
        assert_eq!(conns.len(), 2, "a's place was already given up");
    }

    #[test]
    fn silent_and_unread_connections_are_reaped() {
        let conns = Conns::new(8, CLOSED, 1 << 20);
        let idle = conns.admit().unwrap();
        let unread = conns.admit().unwrap();
        let working = conns.admit().unwrap();
        let _busy = working.state.working();
        unread.state.write_blocked.store(unread.state.now() + 1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        unread.state.progressed();
        conns.reap();
        assert_eq!(conns.len(), 2, "the unread one is closed though it made progress");
        assert!(!lock(&conns.live).contains_key(&unread.id));
        std::thread::sleep(Duration::from_millis(150));
        conns.reap();
        assert_eq!(conns.len(), 1, "then the idle one; the one being answered stays");
        assert!(lock(&conns.live).contains_key(&working.id));
        drop(idle);
    }

    #[test]
    fn a_house_that_keeps_idle_connections_still_makes_room_for_a_newcomer() {
        let conns = Conns::new(2, Idle::Kept, 1 << 20);
        let (a, b) = (conns.admit().unwrap(), conns.admit().unwrap());
        a.state.write_blocked.store(a.state.now() + 1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(20));
        conns.reap();
        assert_eq!(conns.len(), 2, "never closed for silence or an unread answer");
        let (_a_works, _b_works) = (a.state.working(), b.state.working());
        assert!(conns.admit().is_none(), "every connection has a request in work");
        assert!(!conns.evict_one());
        assert_eq!(conns.working(), 2);
        drop(_a_works);
        let c = conns.admit().expect("a is idle and gives its place up");
        assert!(!lock(&conns.live).contains_key(&a.id));
        conns.close_idle();
        assert_eq!(conns.len(), 1, "draining closes c, idle; b is still answered");
        assert!(lock(&conns.live).contains_key(&b.id));
        drop(c);
    }

    #[test]
    fn whole_answers_share_the_budget_until_taken() {
        let conns = Conns::new(4, CLOSED, 64 << 10);
        let (a, b) = (conns.admit().unwrap(), conns.admit().unwrap());
        assert!(a.state.reserve(1 << 20), "an answer larger than the budget takes all of it");
        assert!(!b.state.reserve(1));
        a.state.write_blocked.store(a.state.now() + 1, Ordering::Relaxed);
        conns.reap();
        assert!(!b.state.reserve(1), "held while the client has not taken it");
        a.state.write_blocked.store(0, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(60));
        b.state.progressed();
        conns.reap();
        assert!(b.state.reserve(1), "freed once taken");
    }
}
