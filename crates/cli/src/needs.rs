//! What a command needs from the process before it runs, declared by the command
//! ([`crate::Command::needs`]) and set up here, so that a new command says what it needs in one
//! place.

use std::sync::Arc;

use ember_train::distributed::{Collective, DistError};

/// A command's needs from the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// Freed memory stays with the allocator ([`crate::alloc::keep_freed_memory`]): steps allocate
    /// the same buffers again and again; a long-lived server keeps mimalloc's default of handing
    /// memory back after a spike.
    pub keep_freed_memory: bool,
    /// MPI starts before anything else, for the ranks of a data-parallel run (`mpirun -n N`).
    pub ranks: bool,
    /// Runs on a worker of the CPU kernels' thread pool (see `ember_kernels::on_cpu_workers`).
    /// A server waits on clients and must not hold a worker of the pool while it waits (the model
    /// server's engine enters the pool on a thread of its own).
    pub cpu_worker: bool,
}

impl Needs {
    /// Computes on the CPU pool, in one process.
    pub const COMPUTE: Self = Self { keep_freed_memory: false, ranks: false, cpu_worker: true };
    /// Serves: no pool worker, and memory handed back.
    pub const SERVER: Self = Self { keep_freed_memory: false, ranks: false, cpu_worker: false };
    /// Trains (or measures training): steps on the pool, on every rank of a run.
    pub const TRAINING: Self = Self { keep_freed_memory: true, ranks: true, cpu_worker: true };

    /// Sets the process up for the command: the allocator, MPI (and a panic hook that stops every
    /// rank), logging at `log` (on rank 0; the others warn), the CPU pool shared by the ranks on
    /// one machine. Returns the collective the command runs in.
    pub fn set_up(self, log: &str) -> Result<Arc<dyn Collective>, DistError> {
        if self.keep_freed_memory {
            crate::alloc::keep_freed_memory();
        }
        let collective = if self.ranks {
            ember_train::distributed::init(crate::env::launch())?
        } else {
            ember_train::distributed::solo()
        };
        // A rank that panics stops the job at once: the others would otherwise wait in their next
        // collective until the deadline and blame it on a hang.
        // (A weak reference: the hook must not keep MPI alive past `main`, where it is finalised.)
        if collective.world() > 1 {
            let weak = Arc::downgrade(&collective);
            let report = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                report(info);
                if let Some(c) = weak.upgrade() {
                    eprintln!("error: rank {} panicked; stopping every rank", c.rank());
                    c.abort(101);
                }
            }));
        }
        // Rank 0 speaks for the run; the others only warn (RUST_LOG still rules).
        let level = if collective.rank() == 0 { log } else { "warn" };
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(colour(&std::io::stderr()))
            .init();
        // Ranks on one machine share its cores.
        let local = collective.local_world();
        if local > 1 && !crate::env::threads_set() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            ember_kernels::init_cpu_workers(Some((cores / local).max(1)));
        }
        Ok(collective)
    }

    /// Runs `f` where the command computes: on a worker of the CPU pool, or on this thread.
    pub fn run<R: Send>(self, f: impl FnOnce() -> R + Send) -> R {
        if self.cpu_worker {
            ember_kernels::on_cpu_workers(f)
        } else {
            f()
        }
    }
}

/// Whether to colour what goes to `stream` (stdout or stderr): only on a terminal, and not where
/// `NO_COLOR` is set to anything but the empty string (https://no-color.org), so that redirected
/// output and logs stay plain text.
pub fn colour(stream: &impl std::io::IsTerminal) -> bool {
    stream.is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
