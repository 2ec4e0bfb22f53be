//! The MPI engine (Open MPI through the `mpi` crate): ranks, world and local sizes from the
//! launcher, host-memory reductions with MPI's own algorithms.
//!
//! Never a silent hang: each step's arrival check is non-blocking point-to-point messages polled
//! against a deadline, so the ranks that did not arrive are named, and `MPI_Abort` stops the job.
//! The reductions themselves are MPI's blocking calls (its own algorithms, at its own latency),
//! watched by a thread that ends the process past the deadline with a message naming the
//! collective and the other ranks; the launcher then ends the rest (a rank that dies is noticed by
//! the launcher itself). MPI calls are serialised by a mutex (`MPI_THREAD_SERIALIZED`): the trainer
//! calls from one thread at a time, not always the one that initialised MPI.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::environment::{Threading, Universe};
use mpi::point_to_point::{Destination, Source};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;

use super::{Collective, DistError};

const ARRIVE_TAG: i32 = 0x656d; // "em"

struct Inner {
    // Declared before `universe`: the communicators go before MPI_Finalize.
    world: SimpleCommunicator,
    timeout: Duration,
    /// Rank -> "host pid N", for messages.
    names: Vec<String>,
    /// The other ranks, named, for the watchdog's message.
    others: String,
    _universe: Universe,
}

/// What the watchdog thread watches: a collective in progress and its deadline.
struct Armed {
    what: String,
    deadline: Instant,
    timeout: Duration,
    others: String,
}

/// A thread that ends the process when an armed collective passes its deadline.
struct Watchdog {
    state: Arc<Mutex<Option<Armed>>>,
}

/// Disarms the watchdog when the collective returns.
struct ArmGuard<'a>(&'a Watchdog);

impl Drop for ArmGuard<'_> {
    fn drop(&mut self) {
        *self.0.state.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl Watchdog {
    fn start(rank: usize) -> Self {
        let state: Arc<Mutex<Option<Armed>>> = Arc::new(Mutex::new(None));
        let watched = state.clone();
        std::thread::Builder::new()
            .name("ember-mpi-watchdog".into())
            .spawn(move || {
                loop {
                    let armed = watched.lock().unwrap_or_else(|p| p.into_inner());
                    let wait = match &*armed {
                        Some(a) if Instant::now() >= a.deadline => {
                            let message = format!(
                                "{} within {:.0} s: {} hung or died",
                                a.what,
                                a.timeout.as_secs_f64(),
                                a.others
                            );
                            tracing::error!("rank {rank}: {message}; stopping every rank");
                            eprintln!("error: rank {rank}: {message}; stopping every rank");
                            // SAFETY: ends the process at once, from this thread, while another is
                            // inside MPI; the launcher sees the exit and ends the other ranks.
                            unsafe { libc::_exit(3) }
                        }
                        // Not woken by `arm` (a wake-up per collective would cost the ranks CPU time):
                        // a deadline is seen within 50 ms.
                        Some(a) => (a.deadline - Instant::now()).min(Duration::from_millis(50)),
                        None => Duration::from_millis(50),
                    };
                    drop(armed);
                    std::thread::sleep(wait);
                }
            })
            .expect("spawn the MPI watchdog thread");
        Self { state }
    }

    fn arm(&self, what: String, timeout: Duration, others: &str) -> ArmGuard<'_> {
        let armed = Armed { what, deadline: Instant::now() + timeout, timeout, others: others.to_string() };
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(armed);
        ArmGuard(self)
    }
}

pub(crate) struct MpiCollective {
    inner: Mutex<Inner>,
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    version: String,
    watchdog: Watchdog,
}

// SAFETY: the MPI handles inside are only used under the mutex, one thread at a time, and MPI was
// initialised with MPI_THREAD_SERIALIZED (checked in `init`), which allows calls from any thread as
// long as they do not overlap.
unsafe impl Send for MpiCollective {}
unsafe impl Sync for MpiCollective {}

impl MpiCollective {
    /// Initialises MPI (once per process) and learns this rank's place.
    pub(crate) fn init() -> Result<Self, DistError> {
        let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| DistError::Launch("MPI was already initialised in this process".into()))?;
        if provided < Threading::Serialized {
            return Err(DistError::Launch(format!(
                "the MPI library gives thread support {provided:?}; ember needs MPI_THREAD_SERIALIZED"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let node = world.split_shared(world.rank());
        let (local_rank, local_size) = (node.rank() as usize, node.size() as usize);
        drop(node);
        let version = mpi::environment::library_version()
            .map(|v| v.lines().next().unwrap_or("").split(',').next().unwrap_or("").trim().to_string())
            .unwrap_or_else(|_| "MPI".into());
        let me =
            format!("{} pid {}", mpi::environment::processor_name().unwrap_or_else(|_| "?".into()), std::process::id());
        let inner = Inner {
            world,
            timeout: Duration::from_secs(300),
            names: Vec::new(),
            others: String::new(),
            _universe: universe,
        };
        let watchdog = Watchdog::start(rank);
        let c = Self { inner: Mutex::new(inner), rank, size, local_rank, local_size, version, watchdog };
        // Who is who, for every later message (fixed-size records: 64 bytes each).
        let mut record = [b' '; 64];
        let n = me.len().min(64);
        record[..n].copy_from_slice(&me.as_bytes()[..n]);
        let names = c.all_gather_bytes(&record, "start-up: rank names")?;
        let mut inner = c.lock();
        inner.names = names.iter().map(|b| String::from_utf8_lossy(b).trim_end().to_string()).collect();
        let others: Vec<String> = (0..size).filter(|&r| r != rank).map(|r| inner.name(r)).collect();
        inner.others = match others.len() {
            1 => format!("{} has", others[0]),
            _ => format!("one of {} has", others.join(", ")),
        };
        drop(inner);
        Ok(c)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves MPI as it was; the data is only handles.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs why the run stops and aborts every rank (MPI_Abort: the launcher ends the others).
    fn fail(&self, message: String) -> ! {
        tracing::error!("rank {}: {message}; stopping every rank", self.rank);
        eprintln!("error: rank {}: {message}; stopping every rank", self.rank);
        self.abort(3)
    }
}

impl Inner {
    fn name(&self, rank: usize) -> String {
        match self.names.get(rank) {
            Some(n) => format!("rank {rank} ({n})"),
            None => format!("rank {rank}"),
        }
    }
}

/// Polls `requests` until all complete or `deadline` passes; returns the indices still pending
/// (their requests forgotten: the caller aborts before their scope ends). Spins with yields: the waits are where MPI
/// progresses its non-blocking collectives, and a sleeping rank would slow its peers.
fn wait_all<'a, D: ?Sized, S: Scope<'a>>(requests: Vec<Request<'a, D, S>>, deadline: Instant) -> Vec<usize> {
    let mut pending: Vec<(usize, Request<'a, D, S>)> = requests.into_iter().enumerate().collect();
    let mut polls = 0u64;
    loop {
        let mut still = Vec::with_capacity(pending.len());
        for (i, r) in pending {
            match r.test() {
                Ok(_) => {}
                Err(r) => still.push((i, r)),
            }
        }
        if still.is_empty() {
            return Vec::new();
        }
        pending = still;
        polls += 1;
        if polls.is_multiple_of(256) {
            if Instant::now() >= deadline {
                let late = pending.iter().map(|(i, _)| *i).collect();
                // The requests cannot be completed: forget them, the caller aborts.
                for (_, r) in pending {
                    std::mem::forget(r);
                }
                return late;
            }
            std::thread::yield_now();
        }
    }
}

/// One blocking collective under the watchdog: past the deadline the watchdog thread says which
/// collective and which ranks, and ends this process (the launcher then ends the others).
macro_rules! timed {
    ($self:ident, $what:expr, |$world:ident| $call:expr) => {{
        let inner = $self.lock();
        let _armed = $self.watchdog.arm(format!("{} did not complete", $what), inner.timeout, &inner.others);
        let $world = &inner.world;
        $call;
        Ok(())
    }};
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.size
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn local_world(&self) -> usize {
        self.local_size
    }
    fn engine(&self) -> String {
        format!("MPI ({})", self.version)
    }
    fn set_timeout(&self, timeout: Duration) {
        self.lock().timeout = timeout;
    }

    fn arrive(&self, seq: u64, what: &str) -> Result<(), DistError> {
        if self.size == 1 {
            return Ok(());
        }
        let inner = self.lock();
        let deadline = Instant::now() + inner.timeout;
        let peers: Vec<usize> = (0..self.size).filter(|&p| p != self.rank).collect();
        let mine = [seq];
        let mut theirs = vec![u64::MAX; peers.len()];
        let t = inner.timeout.as_secs_f64();
        mpi::request::scope(|scope| {
            let sends: Vec<_> = peers
                .iter()
                .map(|&p| inner.world.process_at_rank(p as i32).immediate_send_with_tag(scope, &mine[..], ARRIVE_TAG))
                .collect();
            let recvs: Vec<_> = theirs
                .chunks_mut(1)
                .zip(&peers)
                .map(|(slot, &p)| {
                    inner.world.process_at_rank(p as i32).immediate_receive_into_with_tag(scope, slot, ARRIVE_TAG)
                })
                .collect();
            let mut late: Vec<usize> = wait_all(recvs, deadline).into_iter().map(|i| peers[i]).collect();
            late.extend(wait_all(sends, deadline).into_iter().map(|i| peers[i]));
            if !late.is_empty() {
                late.sort_unstable();
                late.dedup();
                let names: Vec<String> = late.iter().map(|&r| inner.name(r)).collect();
                self.fail(format!("{} did not reach {what} within {t:.0} s (it has hung or died)", names.join(", ")));
            }
        });
        let elsewhere: Vec<String> = theirs
            .iter()
            .zip(&peers)
            .filter(|(s, _)| **s != seq)
            .map(|(s, &p)| format!("{} is at point {s}", inner.name(p)))
            .collect();
        if !elsewhere.is_empty() {
            let message = format!("ranks out of step at {what} (point {seq}): {}", elsewhere.join(", "));
            drop(inner);
            self.fail(message);
        }
        Ok(())
    }

    fn all_reduce_f32(&self, buf: &mut [f32], what: &str) -> Result<(), DistError> {
        if self.size == 1 {
            return Ok(());
        }
        let send = buf.to_vec();
        timed!(self, what, |world| world.all_reduce_into(&send[..], buf, SystemOperation::sum()))
    }

    fn all_reduce_f32_into(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError> {
        if send.len() != recv.len() {
            return Err(DistError::Rank {
                rank: self.rank,
                message: format!("{what}: all-reduce of {} values into {}", send.len(), recv.len()),
            });
        }
        timed!(self, what, |world| world.all_reduce_into(send, recv, SystemOperation::sum()))
    }

    fn all_reduce_f64(&self, buf: &mut [f64], what: &str) -> Result<(), DistError> {
        if self.size == 1 {
            return Ok(());
        }
        let send = buf.to_vec();
        timed!(self, what, |world| world.all_reduce_into(&send[..], buf, SystemOperation::sum()))
    }

    fn reduce_scatter_f32(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError> {
        if send.len() != recv.len() * self.size {
            return Err(DistError::Rank {
                rank: self.rank,
                message: format!("{what}: reduce-scatter of {} values into {} per rank", send.len(), recv.len()),
            });
        }
        timed!(self, what, |world| world.reduce_scatter_block_into(send, recv, SystemOperation::sum()))
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError> {
        if recv.len() != send.len() * self.size {
            return Err(DistError::Rank {
                rank: self.rank,
                message: format!("{what}: all-gather of {} values into {}", send.len(), recv.len()),
            });
        }
        timed!(self, what, |world| world.all_gather_into(send, recv))
    }

    fn all_gather_bytes(&self, send: &[u8], what: &str) -> Result<Vec<Vec<u8>>, DistError> {
        let mut recv = vec![0u8; send.len() * self.size];
        let r: Result<(), DistError> = timed!(self, what, |world| world.all_gather_into(send, &mut recv[..]));
        r?;
        Ok(recv.chunks(send.len().max(1)).map(<[u8]>::to_vec).collect())
    }

    fn gather_f32(&self, send: &[f32], what: &str) -> Result<Option<Vec<f32>>, DistError> {
        use mpi::traits::Root;
        if send.len() * self.size > i32::MAX as usize {
            return Err(DistError::Rank {
                rank: self.rank,
                message: format!("{what}: {} values per rank is more than one MPI gather carries", send.len()),
            });
        }
        let mut out = (self.rank == 0).then(|| vec![0.0f32; send.len() * self.size]);
        let r: Result<(), DistError> = timed!(self, what, |world| {
            let root = world.process_at_rank(0);
            match out.as_mut() {
                Some(recv) => root.gather_into_root(send, &mut recv[..]),
                None => root.gather_into(send),
            }
        });
        r?;
        Ok(out)
    }

    fn all_reduce_baseline(&self, send: &[f32], recv: &mut [f32]) {
        self.lock().world.all_reduce_into(send, recv, SystemOperation::sum());
    }

    fn abort(&self, code: i32) -> ! {
        // Without the lock (a rank may stop while it holds it): MPI_Abort on the world, and the
        // launcher ends every rank.
        // SAFETY: MPI is initialised (this value exists only then); MPI_Abort does not return.
        unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code) };
        std::process::exit(code)
    }
}
