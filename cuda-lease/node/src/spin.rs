//! Waiting for a worker pipe without sleeping, for a bounded time.
//!
//! Waking a blocked thread costs latency on each pipe crossing, so after
//! each message both sides poll with a zero timeout for a bounded budget,
//! then block: an idle lease costs one budget of CPU per message.
//!
//! The budget is [`WorkerSpec::spin`](crate::worker::WorkerSpec::spin);
//! [`default_spin`] turns it off on small machines, where the spinner would
//! take the core the other side needs.

use std::time::{Duration, Instant};

/// Cores below which [`default_spin`] is zero: the client, the node and a
/// worker each want a core while a batch is in flight.
pub const SPIN_MIN_CORES: usize = 8;

/// The default spin budget: 1 ms with at least [`SPIN_MIN_CORES`] cores, else 0.
pub fn default_spin() -> Duration {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores >= SPIN_MIN_CORES {
        Duration::from_millis(1)
    } else {
        Duration::ZERO
    }
}

fn poll_in(fd: std::os::fd::RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Polls `fds` (negative ones are ignored) with `timeout_ms` (-1: no
/// limit); whether any can be read without blocking (data, end of file or
/// an error all count: the read that follows reports them).
fn poll_any(fds: &[std::os::fd::RawFd], timeout_ms: libc::c_int) -> bool {
    let mut p = [poll_in(-1); 3];
    let n = fds.len().min(p.len());
    for (slot, fd) in p.iter_mut().zip(&fds[..n]) {
        *slot = poll_in(*fd);
    }
    // SAFETY: `p` holds `n` valid `pollfd`s that live across the call;
    // `poll` only writes their `revents`. A closed descriptor is reported
    // in `revents` (POLLNVAL), not undefined behaviour; a negative one is
    // skipped.
    let r = unsafe { libc::poll(p.as_mut_ptr(), n as libc::nfds_t, timeout_ms) };
    r != 0 && (r < 0 || p[..n].iter().any(|p| p.revents != 0))
}

/// Whether any of `fds` can be read without blocking now.
pub(crate) fn ready_now(fds: &[std::os::fd::RawFd]) -> bool {
    poll_any(fds, 0)
}

/// Blocks until any of `fds` can be read; true (an interrupted wait too).
pub(crate) fn wait_readable(fds: &[std::os::fd::RawFd]) -> bool {
    poll_any(fds, -1);
    true
}

/// One poll of a spin begun at `start`: `Some(readable)` when done, else `None`.
fn spin_step(fds: &[std::os::fd::RawFd], start: Instant, budget: Duration) -> Option<bool> {
    if budget.is_zero() {
        Some(false)
    } else if ready_now(fds) {
        Some(true)
    } else if start.elapsed() >= budget {
        Some(false)
    } else {
        None
    }
}

/// Polls `fds` without sleeping until one is readable or `budget` passed;
/// returns whether one became readable. A zero budget returns at once.
pub(crate) fn readable_within(fds: &[std::os::fd::RawFd], budget: Duration) -> bool {
    let start = Instant::now();
    loop {
        if let Some(readable) = spin_step(fds, start, budget) {
            return readable;
        }
        std::hint::spin_loop();
    }
}

/// Sleeps until one of `fds` is readable, `wake` (an eventfd, whose count
/// is taken) fires, or about 1 ms passes; returns whether one of `fds` is
/// readable.
pub(crate) fn readable_soon(
    fds: [std::os::fd::RawFd; 2],
    wake: Option<std::os::fd::RawFd>,
) -> bool {
    let mut p = [
        poll_in(fds[0]),
        poll_in(fds[1]),
        poll_in(wake.unwrap_or(-1)),
    ];
    // SAFETY: as in `poll_any`, for the three `pollfd`s (a negative fd is
    // ignored by `poll`); a 1 ms timeout blocks at most that long.
    let n = unsafe { libc::poll(p.as_mut_ptr(), 3, 1) };
    if n < 0 {
        return true;
    }
    if let (Some(w), true) = (wake, p[2].revents != 0) {
        take_count(w);
    }
    p[0].revents != 0 || p[1].revents != 0
}

/// [`readable_within`] for a tokio task, yielding between polls.
pub(crate) async fn readable_within_async(fd: std::os::fd::RawFd, budget: Duration) -> bool {
    within_async(budget, || ready_now(&[fd]).then_some(()))
        .await
        .is_some()
}

/// Polls `poll` from a tokio task, yielding between polls, until it gives
/// a value or `budget` passed (`None`; a zero budget polls not at all).
pub(crate) async fn within_async<T>(
    budget: Duration,
    mut poll: impl FnMut() -> Option<T>,
) -> Option<T> {
    let start = Instant::now();
    while start.elapsed() < budget {
        if let Some(v) = poll() {
            return Some(v);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// A new non-blocking eventfd (count 0).
pub(crate) fn eventfd() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: `eventfd` takes two integers and returns a new descriptor
    // (or -1), owned here from then on.
    let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) })
}

/// Takes (resets) the count of the non-blocking eventfd `fd`; nothing to
/// take leaves it.
pub(crate) fn take_count(fd: std::os::fd::RawFd) {
    let mut count = 0u64;
    // SAFETY: reads at most 8 bytes into `count` from a non-blocking
    // eventfd the caller owns; a failed read (EAGAIN) leaves it.
    let _ = unsafe { libc::read(fd, (&raw mut count).cast(), 8) };
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_pipe_is_readable_once_written_and_not_before() {
        let (r, mut w) = std::io::pipe().expect("pipe");
        let t = Instant::now();
        assert!(!readable_within(&[r.as_raw_fd()], Duration::from_millis(2)));
        assert!(t.elapsed() >= Duration::from_millis(2), "spun the budget");
        assert!(!readable_within(&[r.as_raw_fd()], Duration::ZERO));
        w.write_all(b"x").expect("write");
        assert!(readable_within(&[r.as_raw_fd()], Duration::from_millis(2)));
        drop(w);
        // The end of file counts as readable too.
        let (r2, w2) = std::io::pipe().expect("pipe");
        drop(w2);
        assert!(readable_within(&[r2.as_raw_fd()], Duration::from_millis(2)));
    }

    #[tokio::test]
    async fn the_async_form_yields_and_sees_a_write_from_another_thread() {
        let (r, mut w) = std::io::pipe().expect("pipe");
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_micros(300));
            w.write_all(b"x").expect("write");
            w
        });
        assert!(readable_within_async(r.as_raw_fd(), Duration::from_secs(5)).await);
        drop(writer.join());
    }
}
