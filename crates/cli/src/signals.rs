//! SIGTERM and SIGINT (Ctrl-C) as a request to stop, for commands that stop gracefully: the first
//! one is noted ([`stop_requested`]) and the command finishes its work in hand; a second one ends
//! the process at once, as the default action would have.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);
/// The first signal's number (0: none yet).
static FIRST_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    // Only async-signal-safe work here: atomics, and `_exit` on the second signal.
    if STOP.swap(true, Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe and takes no pointers.
        unsafe { libc::_exit(128 + signal) };
    }
    FIRST_SIGNAL.store(signal, Ordering::SeqCst);
}

/// Routes SIGTERM and SIGINT to [`stop_requested`] from now on. An error when the system refuses.
pub fn catch_stop() -> std::io::Result<()> {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        install(signal, on_signal)?;
    }
    Ok(())
}

/// Makes `handler` the action of `signal` (restarting interrupted system calls). `handler` must be
/// async-signal-safe: ember's only touch atomics and call `_exit`.
fn install(signal: libc::c_int, handler: extern "C" fn(libc::c_int)) -> std::io::Result<()> {
    // SAFETY: `sigaction` reads the struct it is given, which is fully initialised here; the
    // handler is an `extern "C" fn` that lives for the whole program.
    let failed = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(signal, &action, std::ptr::null_mut()) != 0
    };
    if failed {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether SIGTERM or SIGINT has arrived since [`catch_stop`].
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// The exit status of a command that stopped early on a signal, as shells report one killed by it
/// (128 + its number: 130 for SIGINT, 143 for SIGTERM), so that `ember train … && ember export …`
/// does not go on with a run cut short; 130 when no signal of this process's asked for the stop.
pub fn stopped_status() -> u8 {
    let signal = FIRST_SIGNAL.load(Ordering::SeqCst);
    u8::try_from(128 + if signal > 0 { signal } else { libc::SIGINT }).unwrap_or(130)
}

static INTERRUPT: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(signal: libc::c_int) {
    // As `on_signal`: a second Ctrl-C before the first was taken ends the process.
    if INTERRUPT.swap(true, Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe and takes no pointers.
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Routes SIGINT (Ctrl-C) alone to [`interrupted`] from now on, for `ember chat`: a Ctrl-C stops the
/// answer in progress and the session goes on ([`take_interrupt`] clears it for the next answer);
/// a second one before that ends the process. SIGTERM keeps its default action (the session ends).
pub fn catch_interrupt() -> std::io::Result<()> {
    install(libc::SIGINT, on_interrupt)
}

/// Whether a Ctrl-C has arrived since [`catch_interrupt`] or the last [`take_interrupt`].
pub fn interrupted() -> bool {
    INTERRUPT.load(Ordering::SeqCst)
}

/// Whether a Ctrl-C had arrived, and clears it.
pub fn take_interrupt() -> bool {
    INTERRUPT.swap(false, Ordering::SeqCst)
}
