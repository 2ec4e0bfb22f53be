//! Data parallelism across processes, on an established engine (llm.c's layout: MPI starts the
//! ranks and carries the host-side reductions).
//!
//! A run of N ranks is one run of `grad_accum_steps × N` micro-batches per optimizer step: rank r
//! draws micro-batches r, r+N, r+2N, … of the step's global list from the same deterministic
//! stream, the gradients are summed over ranks in flattened buckets ([`buckets`]), clipped after
//! the reduction, and every rank applies the same AdamW update (or, with `shard_optimizer`, its
//! share of it: ZeRO-1, [`zero`]). Rank 0 alone writes checkpoints, metrics and samples.
//!
//! The engine is behind [`Collective`]: [`Solo`] for one process (every call a no-op), and MPI
//! (`--features mpi`, `mpirun -n N ember train …`). Every wait on other ranks has a deadline: a rank
//! that hangs or dies makes the others stop with a message that names it, instead of waiting forever.

pub mod bench;
pub(crate) mod buckets;
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
pub(crate) mod zero;

use std::sync::Arc;

use sha2::{Digest, Sha256};

pub use crate::collective::{solo, Collective, DistError, Solo};
pub use crate::config::DistributedConfig;

/// What a launcher (mpirun, srun) said about the ranks it started, read from its environment by
/// the binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// How many ranks it started: 1 outside a launcher.
    pub world_size: usize,
    /// Whether Open MPI's `mpirun` started this process (even as one rank).
    pub open_mpi: bool,
}

/// The engine of this process: MPI when a launcher started several ranks (and this binary has
/// MPI), else [`Solo`]. Several ranks without MPI is an error: they would train N copies into
/// one run directory.
pub fn init(launch: Launch) -> Result<Arc<dyn Collective>, DistError> {
    let n = launch.world_size;
    #[cfg(feature = "mpi")]
    if n > 1 || launch.open_mpi {
        return Ok(Arc::new(mpi::MpiCollective::init()?));
    }
    if n > 1 {
        return Err(DistError::Launch(format!(
            "started as one of {n} ranks, but this ember was built without MPI; build it with \
             `cargo build --release --features mpi` (needs Open MPI: libopenmpi-dev and libclang-dev)"
        )));
    }
    Ok(solo())
}

/// Checks that every rank holds the same `bytes` (a digest): the mismatching ranks are named.
pub fn check_same(c: &dyn Collective, bytes: &[u8], what: &str) -> Result<(), DistError> {
    if c.world() == 1 {
        return Ok(());
    }
    let all = c.all_gather_bytes(bytes, what)?;
    let differ: Vec<String> =
        all.iter().enumerate().filter(|(_, b)| *b != &all[0]).map(|(r, _)| r.to_string()).collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(DistError::Rank {
        rank: c.rank(),
        message: format!("{what}: rank(s) {} differ from rank 0", differ.join(", ")),
    })
}

/// ember's version and the SHA-256 of the running binary (the first 12 hex digits): ranks built
/// from different code disagree here.
pub(crate) fn code_version() -> String {
    let exe = std::env::current_exe().and_then(std::fs::read);
    let build = match exe {
        Ok(bytes) => {
            let h = digest([bytes.as_slice()]);
            h[..6].iter().map(|b| format!("{b:02x}")).collect::<String>()
        }
        Err(_) => "unknown build".into(),
    };
    format!("ember {} {build}", env!("CARGO_PKG_VERSION"))
}

/// SHA-256 of byte slices, for [`check_same`].
pub(crate) fn digest<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().into()
}

/// Bus bandwidth of an all-reduce of `bytes` over `world` ranks in `seconds` (nccl-tests' busbw:
/// the algorithm bandwidth times `2(n-1)/n`, what a ring moves per rank).
pub(crate) fn bus_bandwidth(bytes: usize, world: usize, seconds: f64) -> f64 {
    let n = world.max(1) as f64;
    bytes as f64 / seconds.max(1e-12) * 2.0 * (n - 1.0) / n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solo_is_the_identity() {
        let s = Solo;
        let mut a = [1.0f32, 2.0];
        s.all_reduce_f32(&mut a, "x").unwrap();
        assert_eq!(a, [1.0, 2.0]);
        let mut out = [0.0f32; 2];
        s.reduce_scatter_f32(&a, &mut out, "x").unwrap();
        assert_eq!(out, a);
        assert!(check_same(&s, b"anything", "x").is_ok());
    }

    #[test]
    fn config_rules_name_the_key() {
        let message = |c: DistributedConfig| c.validate().unwrap_err().to_string();
        let bad = DistributedConfig { bucket_mib: 0, ..Default::default() };
        assert_eq!(message(bad), "distributed.bucket_mib must be in 1..=4096, found 0");
        let bad = DistributedConfig { timeout_s: -1.0, ..Default::default() };
        assert!(message(bad).contains("distributed.timeout_s"));
        let bad = DistributedConfig { bucket_mib: 8192, ..Default::default() };
        assert!(message(bad).contains("1..=4096"));
        assert_eq!(DistributedConfig::default().bucket_elems(), 25 * 1024 * 1024 / 4);
    }

    #[test]
    fn bus_bandwidth_follows_nccl_tests() {
        // 1 GB in 1 s over 8 ranks: 2·7/8 GB/s.
        assert!((bus_bandwidth(1_000_000_000, 8, 1.0) - 1.75e9).abs() < 1.0);
        assert_eq!(bus_bandwidth(100, 1, 1.0), 0.0);
    }

    #[test]
    fn digests_separate_their_parts() {
        assert_ne!(digest([&b"ab"[..], b"c"]), digest([&b"a"[..], b"bc"]));
    }
}
