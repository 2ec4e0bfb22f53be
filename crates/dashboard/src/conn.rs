//! The open connections: a fixed number at most, each watched for progress. A connection that
//! neither sends nor takes bytes for a while, or whose answer the client does not take within the
//! write deadline, is closed; when every place is taken, the connection that has waited longest
//! without a request being worked on makes room for the new one (so a crowd of idle sockets cannot
//! lock out a real client), and only when all of them are being answered is the newcomer turned
//! away.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, OwnedSemaphorePermit};

/// One connection's state, shared by its task, its I/O and the reaper.
pub struct ConnState {
    epoch: Instant,
    /// Requests being worked on (not yet handed to the connection to write).
    busy: AtomicUsize,
    /// Milliseconds since `epoch` of the last byte read or written.
    last_progress: AtomicU64,
    /// Milliseconds since `epoch` (plus one; zero: none) since output has been waiting for the
    /// client to take it.
    write_blocked: AtomicU64,
    /// Told to close.
    pub close: Notify,
    /// The share of the response budget the last answer holds until the client has taken it.
    response_bytes: Mutex<Option<OwnedSemaphorePermit>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ConnState {
    fn new(epoch: Instant) -> Self {
        let now = epoch.elapsed().as_millis() as u64;
        Self {
            epoch,
            busy: AtomicUsize::new(0),
            last_progress: AtomicU64::new(now),
            write_blocked: AtomicU64::new(0),
            close: Notify::new(),
            response_bytes: Mutex::new(None),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn progressed(&self) {
        self.last_progress.store(self.now(), Ordering::Relaxed);
    }

    /// Marks a request as being worked on until the guard drops.
    pub fn busy(self: &Arc<Self>) -> BusyGuard {
        self.busy.fetch_add(1, Ordering::AcqRel);
        BusyGuard(self.clone())
    }

    /// Keeps `permit` (the answer's bytes) until the client has taken the answer.
    pub fn hold(&self, permit: OwnedSemaphorePermit) {
        *lock(&self.response_bytes) = Some(permit);
    }
}

pub struct BusyGuard(Arc<ConnState>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
        self.0.progressed();
    }
}

/// How long connections may stay silent.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// No byte in either direction and no request being worked on.
    pub idle: Duration,
    /// Output waiting for the client to take it.
    pub write: Duration,
}

/// The open connections, at most `max`.
pub struct Conns {
    max: usize,
    epoch: Instant,
    next_id: AtomicU64,
    live: Mutex<HashMap<u64, Arc<ConnState>>>,
}

/// A connection's place; dropping it frees the place.
pub struct Place {
    conns: Arc<Conns>,
    id: u64,
    pub state: Arc<ConnState>,
}

impl Drop for Place {
    fn drop(&mut self) {
        lock(&self.conns.live).remove(&self.id);
    }
}

impl Conns {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            epoch: Instant::now(),
            next_id: AtomicU64::new(0),
            live: Mutex::new(HashMap::new()),
        })
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.live).len()
    }

    /// A place for a new connection, making room by closing the longest-idle one when all are
    /// taken; `None` when every connection is being answered.
    pub fn admit(self: &Arc<Self>) -> Option<Place> {
        let mut live = lock(&self.live);
        if live.len() >= self.max && !Self::evict_idlest(&mut live) {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState::new(self.epoch));
        live.insert(id, state.clone());
        Some(Place { conns: self.clone(), id, state })
    }

    /// Closes the connection that has gone longest without progress and without a request being
    /// worked on (out of file descriptors, say); whether there was one.
    pub fn evict_one(&self) -> bool {
        Self::evict_idlest(&mut lock(&self.live))
    }

    fn evict_idlest(live: &mut HashMap<u64, Arc<ConnState>>) -> bool {
        let idlest = live
            .iter()
            .filter(|(_, c)| c.busy.load(Ordering::Acquire) == 0)
            .min_by_key(|(_, c)| c.last_progress.load(Ordering::Relaxed))
            .map(|(&id, _)| id);
        match idlest.and_then(|id| live.remove(&id)) {
            Some(c) => {
                c.close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Closes the connections past a deadline and frees the response budget of answers the client
    /// has taken. Called every fraction of the shortest deadline.
    pub fn reap(&self, deadlines: Deadlines) {
        let mut live = lock(&self.live);
        let now = self.epoch.elapsed().as_millis() as u64;
        let idle = deadlines.idle.as_millis() as u64;
        let write = deadlines.write.as_millis() as u64;
        let mut expired = Vec::new();
        for (&id, c) in live.iter() {
            if c.busy.load(Ordering::Acquire) > 0 {
                continue;
            }
            let blocked = c.write_blocked.load(Ordering::Relaxed);
            let silent = now.saturating_sub(c.last_progress.load(Ordering::Relaxed));
            if blocked != 0 && now.saturating_sub(blocked - 1) > write {
                tracing::debug!("dashboard: closing a connection whose client does not read");
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

/// A TCP stream that records progress in its [`ConnState`].
pub struct Watched<S> {
    inner: S,
    state: Arc<ConnState>,
}

impl<S> Watched<S> {
    pub fn new(inner: S, state: Arc<ConnState>) -> Self {
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

    #[test]
    fn a_full_house_makes_room_by_closing_the_idlest() {
        let conns = Conns::new(2);
        let a = conns.admit().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let b = conns.admit().unwrap();
        let _busy = b.state.busy();
        // `a` has been idle longest and nothing is being answered on it.
        let c = conns.admit().unwrap();
        assert_eq!(conns.len(), 2);
        assert!(!lock(&conns.live).contains_key(&a.id));
        // Both places are now held by requests being answered: the next one is turned away.
        let _busy_c = c.state.busy();
        assert!(conns.admit().is_none());
        drop(_busy_c);
        let d = conns.admit();
        assert!(d.is_some(), "c is idle again, and makes room");
        drop(a);
        assert_eq!(conns.len(), 2, "a's place was already given up");
    }

    #[test]
    fn silent_and_unread_connections_are_reaped() {
        let conns = Conns::new(8);
        let idle = conns.admit().unwrap();
        let unread = conns.admit().unwrap();
        let working = conns.admit().unwrap();
        let _busy = working.state.busy();
        unread.state.write_blocked.store(unread.state.now() + 1, Ordering::Relaxed);
        let deadlines = Deadlines { idle: Duration::from_millis(200), write: Duration::from_millis(50) };
        std::thread::sleep(Duration::from_millis(100));
        unread.state.progressed();
        conns.reap(deadlines);
        assert_eq!(conns.len(), 2, "the unread one is closed though it made progress");
        assert!(!lock(&conns.live).contains_key(&unread.id));
        std::thread::sleep(Duration::from_millis(150));
        conns.reap(deadlines);
        assert_eq!(conns.len(), 1, "then the idle one; the one being answered stays");
        assert!(lock(&conns.live).contains_key(&working.id));
        drop(idle);
    }
}
