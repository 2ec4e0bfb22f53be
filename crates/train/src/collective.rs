//! The operations data parallelism needs, behind one trait ([`Collective`]), and the engine of a
//! single process ([`Solo`]): what the optimizers and the step call, whatever the engine
//! (`distributed` starts it).

use std::sync::Arc;
use std::time::Duration;

/// Why a collective operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("rank {rank}: {message}")]
    Rank { rank: usize, message: String },
    #[error("{0}")]
    Launch(String),
}

/// The operations data parallelism needs, over all ranks of the run. Each call is made by every
/// rank in the same order; `what` names the synchronisation point in errors ("step 12: gradients").
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Rank and number of ranks on this machine (for threads and GPU choice).
    fn local_rank(&self) -> usize;
    fn local_world(&self) -> usize;
    /// The engine, for logs: "single process", "MPI (Open MPI v4.1.4)".
    fn engine(&self) -> String;
    /// Sets the deadline of every later wait.
    fn set_timeout(&self, timeout: Duration);
    /// Every rank has reached synchronisation point `seq` (`what` describes it): each rank tells
    /// every other. Ranks that do not arrive within the timeout, or arrive at another point, are
    /// named, and the run is stopped.
    fn arrive(&self, seq: u64, what: &str) -> Result<(), DistError>;
    /// Element-wise sum over ranks, in place.
    fn all_reduce_f32(&self, buf: &mut [f32], what: &str) -> Result<(), DistError>;
    /// Element-wise sum over ranks of `send` into `recv` (of the same length), without a copy.
    fn all_reduce_f32_into(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError>;
    fn all_reduce_f64(&self, buf: &mut [f64], what: &str) -> Result<(), DistError>;
    /// `recv` (length `send.len() / world`) gets block `rank` of the element-wise sum of `send`.
    fn reduce_scatter_f32(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError>;
    /// `recv` (length `send.len() · world`) gets every rank's `send`, in rank order.
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError>;
    /// Every rank's `send` (all of the same length), in rank order.
    fn all_gather_bytes(&self, send: &[u8], what: &str) -> Result<Vec<Vec<u8>>, DistError>;
    /// Rank 0 gets every rank's `send` in rank order (`send.len() · world` values); the others get
    /// nothing and allocate nothing.
    fn gather_f32(&self, send: &[f32], what: &str) -> Result<Option<Vec<f32>>, DistError>;
    /// The engine's own blocking all-reduce (sum), without deadline or copies: the baseline
    /// `ember bench allreduce` measures ember's reduction against.
    fn all_reduce_baseline(&self, send: &[f32], recv: &mut [f32]);
    /// Stops every rank of the run (after this one has said why).
    fn abort(&self, code: i32) -> !;
}

impl std::fmt::Debug for dyn Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (rank {} of {})", self.engine(), self.rank(), self.world())
    }
}

/// One process: the whole run.
#[derive(Debug, Default)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn local_rank(&self) -> usize {
        0
    }
    fn local_world(&self) -> usize {
        1
    }
    fn engine(&self) -> String {
        "single process".into()
    }
    fn set_timeout(&self, _: Duration) {}
    fn arrive(&self, _: u64, _: &str) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_f32(&self, _: &mut [f32], _: &str) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_f32_into(&self, send: &[f32], recv: &mut [f32], _: &str) -> Result<(), DistError> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_reduce_f64(&self, _: &mut [f64], _: &str) -> Result<(), DistError> {
        Ok(())
    }
    fn reduce_scatter_f32(&self, send: &[f32], recv: &mut [f32], _: &str) -> Result<(), DistError> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], _: &str) -> Result<(), DistError> {
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_gather_bytes(&self, send: &[u8], _: &str) -> Result<Vec<Vec<u8>>, DistError> {
        Ok(vec![send.to_vec()])
    }
    fn gather_f32(&self, send: &[f32], _: &str) -> Result<Option<Vec<f32>>, DistError> {
        Ok(Some(send.to_vec()))
    }
    fn all_reduce_baseline(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// The single-process engine, shared.
pub fn solo() -> Arc<dyn Collective> {
    Arc::new(Solo)
}
