//! A counting global allocator: the CPU backends keep tensors on the heap, so the live heap and its
//! high-water mark are the memory numbers of `ember bench` on the CPU.
//!
//! Underneath is mimalloc rather than glibc's malloc: a training step frees and reallocates the same
//! multi-megabyte buffers every step, which glibc hands back to the kernel and faults in again
//! (297k page faults against 76k over ten steps of configs/bench-cpu-large.toml), and the nano step
//! is steadier with it (experiments/cpu-speed.md). mimalloc too hands freed memory back after 10 ms
//! ("purging"), so a step that frees its activations faults them in again, zeroed, in the next:
//! [`keep_freed_memory`] turns that off.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};

use ember_train::bench::MemoryProbe;

pub struct Counting;

/// The allocator underneath.
const INNER: mimalloc::MiMalloc = mimalloc::MiMalloc;

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method hands the request to mimalloc unchanged and only counts bytes beside it,
// so `Counting` keeps `GlobalAlloc`'s contract exactly as mimalloc does.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` (a non-zero-size layout) is passed on unchanged.
        let p = unsafe { INNER.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size() as u64, Ordering::Relaxed) + layout.size() as u64;
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`: the caller's layout, passed on unchanged.
        let p = unsafe { INNER.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size() as u64, Ordering::Relaxed) + layout.size() as u64;
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, hence from `INNER`, with this `layout` (the
        // caller's contract for `dealloc`).
        unsafe { INNER.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size() as u64, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `INNER` with `layout`, and `new_size` is the caller's, valid for
        // it (the caller's contract for `realloc`).
        let p = unsafe { INNER.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let grow = (new_size - layout.size()) as u64;
                let now = CURRENT.fetch_add(grow, Ordering::Relaxed) + grow;
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                CURRENT.fetch_sub((layout.size() - new_size) as u64, Ordering::Relaxed);
            }
        }
        p
    }
}

/// The heap of this process, as a [`MemoryProbe`].
pub struct HeapProbe;

impl MemoryProbe for HeapProbe {
    fn current_bytes(&self) -> Option<u64> {
        Some(CURRENT.load(Ordering::Relaxed))
    }
    fn reset_peak(&self) {
        PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    fn peak_bytes(&self) -> Option<u64> {
        Some(PEAK.load(Ordering::Relaxed))
    }
}

/// mimalloc's `mi_option_purge_delay` (its `mi_option_e` enum in `mimalloc.h`, v3): the libmimalloc-sys
/// bindings name no constant for it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps the memory freed by this process instead of returning it to the kernel (purge delay -1):
/// the steps of a run allocate the same buffers again and again, and each purged page costs a page
/// fault and its zeroing when touched again (on the SmolLM2-135M LoRA step, 15 % of the time went to
/// the kernel's page clearing). The peak is what the process holds either way.
pub fn keep_freed_memory() {
    // SAFETY: a plain option setter of the allocator; any value is valid for this option.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// Returns the memory this thread's heap holds freed to the kernel now (`mi_collect(true)`): called
/// once a model is loaded for inference, where the loading's temporary buffers (the tokenizer's
/// vocabulary as parsed, the weights' conversions) would otherwise still be held while the
/// weights' file pages come in, raising the peak by tens of MB.
pub fn release_freed_memory() {
    // SAFETY: a plain call into the allocator; it only returns pages no allocation holds.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        super::keep_freed_memory();
        // SAFETY: a plain option getter.
        let delay = unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        assert_eq!(delay, -1);
        // Its neighbours in the enum keep their defaults: the index is not off by one.
        // SAFETY: a plain option getter.
        let numa = unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY + 1) };
        assert_eq!(numa, 0, "mi_option_use_numa_nodes");
    }
}
