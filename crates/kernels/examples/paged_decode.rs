//! Times the paged attention kernel alone on a decode step's shape: SmolLM2-135M's heads (9 query,
//! 3 key/value, 64 wide), blocks of 64, one new position a sequence, 30 layers' pools cycled as in
//! the model (so that the pools come from memory, not cache), the best of 20 passes.
//!
//!     cargo run --release -p ember-kernels --example paged_decode -- [SEQUENCES] [CONTEXT] [SHARED_BLOCKS]
//!
//! (defaults 16, 201, 0: `SHARED_BLOCKS` of each table's first blocks are one prefix all sequences
//! share, as a served system prompt is.)
use std::time::Instant;

use ember_kernels::paged::{attention, Heads, PagedLayout};
use ember_kernels::Cpu;

fn main() {
    let args: Vec<usize> = match std::env::args().skip(1).map(|a| a.parse()).collect() {
        Ok(args) => args,
        Err(_) => {
            eprintln!("usage: paged_decode [SEQUENCES] [CONTEXT] [SHARED_BLOCKS] (whole numbers)");
            std::process::exit(2);
        }
    };
    let (batch, ctx, shared_blocks) =
        (args.first().copied().unwrap_or(16), args.get(1).copied().unwrap_or(201), args.get(2).copied().unwrap_or(0));
    let (bs, layers) = (64, 30);
    let s = Heads { heads: 9, kv_heads: 3, head_dim: 64, scale: 0.125 };
    let width = s.kv_heads * s.head_dim;
    let per = ctx.div_ceil(bs);
    if batch == 0 || ctx == 0 || shared_blocks * bs >= ctx {
        eprintln!("need at least one sequence and one position, and a position past the shared blocks");
        std::process::exit(2);
    }
    let private = per - shared_blocks;
    let blocks = shared_blocks + batch * private;
    let tables: Vec<Vec<usize>> = (0..batch)
        .map(|b| (0..shared_blocks).chain((0..private).map(|i| shared_blocks + b * private + i)).collect())
        .collect();
    let layout = PagedLayout {
        block_size: bs,
        tables,
        starts: vec![ctx - 1; batch],
        totals: vec![ctx; batch],
        queries: 1,
        window: None,
    };
    let mut seed = 1u32;
    let mut noise = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    };
    let pools: Vec<(Vec<f32>, Vec<f32>)> =
        (0..layers).map(|_| (noise(blocks * bs * width), noise(blocks * bs * width))).collect();
    let q = noise(batch * s.heads * s.head_dim);
    let cpu = Cpu::detect();
    let mut best = f64::INFINITY;
    let mut check = 0.0f32;
    for _ in 0..20 {
        let start = Instant::now();
        for (k, v) in &pools {
            let out = attention(cpu, &q, k, v, &layout, s);
            check += out[0];
        }
        best = best.min(start.elapsed().as_secs_f64() * 1e6 / layers as f64);
    }
    println!("batch {batch} ctx {ctx} shared blocks {shared_blocks}: {best:.1} µs a call (best of 20 × {layers} layers) [{check}]");
}
