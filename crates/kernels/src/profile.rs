//! Where a forward pass's time goes, by part, for `ember bench decode` and `ember bench prefill`:
//! the model times its projections, its attention and its LM head when [`set`] has switched the
//! timers on (off, a timer is one relaxed load). The times are wall-clock around the calls, so they
//! are the parts' costs on the CPU backends, whose ops run as they are called; on a GPU they would
//! time the launches. A part inside another (the LM head's own linear layer) counts for the outer
//! one only.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The parts timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The linear layers of the blocks (attention's and the MLP's, experts included).
    Projections = 0,
    /// Positions, the cache write and the attention over the keys.
    Attention = 1,
    /// The final projection to the vocabulary.
    Head = 2,
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

thread_local! {
    /// Whether a timed part is running on this thread (an inner one is not timed again).
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Switches the timers on or off (process-wide).
pub fn set(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Seconds spent in each part since the last call, in [`Part`]'s order; the counts start again.
pub fn take() -> [f64; 3] {
    NANOS.each_ref().map(|n| n.swap(0, Ordering::Relaxed) as f64 * 1e-9)
}

/// Runs `f`, its time added to `part` when the timers are on and no other part is running on this
/// thread.
pub fn time<R>(part: Part, f: impl FnOnce() -> R) -> R {
    if !ON.load(Ordering::Relaxed) || INSIDE.with(Cell::get) {
        return f();
    }
    /// Counts the part's time when dropped, after `f` returns or unwinds.
    struct Timing(Part, Instant);
    impl Drop for Timing {
        fn drop(&mut self) {
            NANOS[self.0 as usize].fetch_add(self.1.elapsed().as_nanos() as u64, Ordering::Relaxed);
            INSIDE.with(|c| c.set(false));
        }
    }
    INSIDE.with(|c| c.set(true));
    let _timing = Timing(part, Instant::now());
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_add_up_once_and_only_when_on() {
        let spin = |ms: u64| std::thread::sleep(std::time::Duration::from_millis(ms));
        // The only test here that switches the timers (they are process-wide).
        set(false);
        let _ = take();
        time(Part::Head, || spin(5));
        assert_eq!(take(), [0.0; 3], "off: nothing counted");
        set(true);
        time(Part::Head, || time(Part::Projections, || spin(20)));
        time(Part::Attention, || spin(10));
        set(false);
        let [projections, attention, head] = take();
        assert_eq!(projections, 0.0, "inside the head: counted for the head only");
        assert!((0.02..0.5).contains(&head), "{head}");
        assert!((0.01..0.5).contains(&attention), "{attention}");
        assert_eq!(take(), [0.0; 3], "taken: the counts start again");
    }
}
