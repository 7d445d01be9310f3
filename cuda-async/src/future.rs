//! [`DeviceFuture`]: an op in flight, completed by a host callback.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use cuda_core::reclaim::Readiness;
use cuda_core::{Error, Result};

use crate::completion::{watchdog, Completion, Status};
use crate::context::{ExecutionContext, Retained};
use crate::exec::{check_poison, execute_guarded, note, release_after};
use crate::op::DeviceOp;
use crate::policy::{default_policy, SchedulingPolicy};
use crate::reactor::{CompletionMode, StreamSlot};
use crate::remote::OnReply;

/// A [`DeviceOp`] being executed: Idle -> Executing -> Complete.
///
/// The first poll enqueues the op's work on its stream, then one completion
/// signal after it, and returns `Pending`. The policy picks the signal
/// ([`CompletionMode`]): a host callback (`cuLaunchHostFunc`) that flips a
/// flag and wakes the task, or a sequence number the stream writes into
/// pinned memory, watched by the reactor thread and checked by every poll.
/// No executor thread blocks while the GPU works (an inline spin, if
/// configured, is bounded), and the future runs on any executor. If the op
/// enqueued nothing (`value`, a `then` returning only `value`s, a `shared`
/// op that already finished), the first poll returns `Ready` with no signal.
///
/// # Cancel safety
///
/// Dropping the future before its first poll enqueues nothing. Dropping it
/// (or `mem::forget`ting it) after the first poll does not cancel GPU work
/// already enqueued: that work runs to completion. Nothing it uses is freed
/// or reused before the GPU has passed it: device buffers are freed
/// stream-ordered after their last use, pinned host buffers wait for their
/// copies on a background thread, and other retained values (kernel modules)
/// are handed to that thread until the host callback reports completion.
/// Dropping never blocks the dropping thread. `mem::forget` leaks them.
#[must_use = "futures do nothing unless polled; a DeviceFuture enqueues its work on first poll"]
pub struct DeviceFuture<O: DeviceOp> {
    state: State<O>,
}

enum State<O: DeviceOp> {
    /// Not yet submitted; the default policy picks the stream on first poll.
    Lazy(O),
    /// Not yet submitted; the stream is chosen.
    Ready(O, ExecutionContext),
    /// Submitted; waiting for the host callback or the stream's word.
    Executing {
        output: Option<<O as DeviceOp>::Output>,
        completion: Arc<Completion>,
        retained: Retained,
        signal: Signal,
    },
    /// Submitted, and nothing was enqueued: the output is ready now.
    Done(<O as DeviceOp>::Output),
    /// Output handed out.
    Complete,
}

// The future never pins its fields (nothing is polled in place), so it can
// be moved freely between polls.
impl<O: DeviceOp> Unpin for DeviceFuture<O> {}

impl<O: DeviceOp> fmt::Debug for DeviceFuture<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match &self.state {
            State::Lazy(_) | State::Ready(..) => "Idle",
            State::Executing { .. } => "Executing",
            State::Done(_) | State::Complete => "Complete",
        };
        f.debug_struct("DeviceFuture").field("state", &s).finish()
    }
}

impl<O: DeviceOp> DeviceFuture<O> {
    pub(crate) fn lazy(op: O) -> Self {
        DeviceFuture {
            state: State::Lazy(op),
        }
    }

    pub(crate) fn ready(op: O, ctx: ExecutionContext) -> Self {
        DeviceFuture {
            state: State::Ready(op, ctx),
        }
    }

    /// Whether the work has been enqueued.
    pub fn is_submitted(&self) -> bool {
        matches!(
            self.state,
            State::Executing { .. } | State::Done(_) | State::Complete
        )
    }

    /// Enqueues the op now, on this thread, without waiting for it: what
    /// the first poll does, minus the wait (an inline spin, if the mode has
    /// one, is left to the first poll). A later poll, on any thread, waits.
    pub(crate) fn enqueue(&mut self) -> Result<()> {
        loop {
            match std::mem::replace(&mut self.state, State::Complete) {
                State::Lazy(op) => {
                    let ctx = default_policy().and_then(|p| p.select())?;
                    self.state = State::Ready(op, ctx);
                }
                State::Ready(op, ctx) => {
                    self.state = Self::submit(op, ctx)?;
                    return Ok(());
                }
                other => {
                    self.state = other;
                    return Ok(());
                }
            }
        }
    }

    /// Records the op on a remote context and sends it as one message; the
    /// reply completes the same `Completion` the local modes complete.
    fn submit_remote(op: O, mut ctx: ExecutionContext) -> Result<State<O>> {
        // SAFETY: retained values stay in the `Executing` state until the
        // reply (nothing of them is read remotely anyway); the output's host
        // data is reachable only once the reply has filled it.
        let out = unsafe { execute_guarded(op, &mut ctx) };
        // Sent even after an error: later frees name the ids it creates.
        let done = crate::remote::send(&mut ctx);
        let retained = ctx.take_retained();
        let output = out?;
        let (completion, on_reply) = match done {
            Some((done, on_reply)) => (done.completion().clone(), on_reply),
            None => {
                // Nothing recorded: no message, done now.
                let c = Arc::new(Completion::new());
                c.complete();
                (c, OnReply::default())
            }
        };
        Ok(State::Executing {
            output: Some(output),
            completion,
            retained,
            signal: Signal::Reply(Some(on_reply)),
        })
    }

    fn submit(op: O, mut ctx: ExecutionContext) -> Result<State<O>> {
        if ctx.is_remote() {
            return Self::submit_remote(op, ctx);
        }
        check_poison()?;
        // SAFETY: retained values stay in the `Executing` state until the
        // host callback reports completion (or go to the reclaimer on drop,
        // which waits for the same callback); the output is only handed out
        // once the callback has run.
        let out = unsafe { execute_guarded(op, &mut ctx) };
        let mut retained = ctx.take_retained();
        let output = match out {
            Ok(o) => o,
            Err(e) => {
                release_after(&ctx, retained);
                return Err(note(e));
            }
        };
        if !ctx.touched() {
            // No op enqueued anything: no completion signal to wait for, and
            // the GPU uses nothing retained (buffers in the output order
            // their own later uses).
            drop(retained);
            return Ok(State::Done(output));
        }
        let completion = Arc::new(Completion::new());
        let signal = match (ctx.completion_mode(), ctx.slot()) {
            (mode, Some(slot)) if mode.uses_reactor() => match slot.signal(&completion) {
                Ok(seq) => {
                    let spin = match mode {
                        CompletionMode::ReactorInlineSpin(d) => Some(d),
                        _ => None,
                    };
                    Signal::Reactor {
                        slot: slot.clone(),
                        seq,
                        spin,
                    }
                }
                Err(e) => {
                    release_after(&ctx, std::mem::take(&mut retained));
                    drop(output);
                    return Err(note(e));
                }
            },
            _ => {
                let stream = ctx.stream().expect("a local context");
                let c = completion.clone();
                if let Err(e) = cuda_core::launch_host_callback(stream, move || c.complete()) {
                    release_after(&ctx, std::mem::take(&mut retained));
                    drop(output);
                    return Err(note(e));
                }
                // Host callbacks never run after a sticky fault: the watchdog
                // notices. (The reactor checks its own streams.)
                Signal::Callback(watchdog::watch(&completion, stream))
            }
        };
        Ok(State::Executing {
            output: Some(output),
            completion,
            retained,
            signal,
        })
    }
}

impl<O: DeviceOp> Future for DeviceFuture<O> {
    type Output = Result<<O as DeviceOp>::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match std::mem::replace(&mut this.state, State::Complete) {
                State::Lazy(op) => {
                    let ctx = match default_policy().and_then(|p| p.select()) {
                        Ok(ctx) => ctx,
                        Err(e) => return Poll::Ready(Err(e)),
                    };
                    this.state = State::Ready(op, ctx);
                }
                State::Ready(op, ctx) => match Self::submit(op, ctx) {
                    Ok(s) => this.state = s,
                    Err(e) => return Poll::Ready(Err(e)),
                },
                State::Executing {
                    output,
                    completion,
                    retained,
                    mut signal,
                } => {
                    signal.check(&completion);
                    match completion.poll_status(cx.waker()) {
                        Status::Pending => {
                            this.state = State::Executing {
                                output,
                                completion,
                                retained,
                                signal,
                            };
                            return Poll::Pending;
                        }
                        Status::Done => {
                            signal.finish();
                            if let Signal::Reply(on_reply) = &mut signal {
                                if let Some(steps) = on_reply.take() {
                                    steps.run();
                                }
                            }
                            drop(retained);
                            return Poll::Ready(output.ok_or_else(polled_after_completion));
                        }
                        Status::Failed => {
                            signal.finish();
                            if signal.is_reply() {
                                // A remote failure: nothing local is in use.
                                drop(retained);
                            } else {
                                // The GPU faulted: it may never release what it used.
                                std::mem::forget(retained);
                            }
                            return Poll::Ready(Err(completion.error()));
                        }
                    }
                }
                State::Done(output) => return Poll::Ready(Ok(output)),
                State::Complete => return Poll::Ready(Err(polled_after_completion())),
            }
        }
    }
}

fn polled_after_completion() -> Error {
    Error::InvalidArgument("DeviceFuture polled after it completed".into())
}

impl<O: DeviceOp> Drop for DeviceFuture<O> {
    fn drop(&mut self) {
        if let State::Executing {
            output,
            completion,
            retained,
            signal,
        } = std::mem::replace(&mut self.state, State::Complete)
        {
            // The output's buffers order their own release after the GPU.
            drop(output);
            // Still in flight: the watchdog keeps watching it (and forgets it
            // once it finishes), so a fault still completes it.
            if completion.is_finished() {
                signal.finish();
            }
            if signal.is_reply() {
                // The remote GPU reads nothing of the client's memory: the
                // node's own buffers order their frees after their uses.
                drop(retained);
                return;
            }
            if retained.is_empty() || completion.is_finished() {
                if completion.status() == Status::Failed {
                    std::mem::forget(retained);
                }
                return;
            }
            cuda_core::reclaim::defer_until(
                move || match completion.status() {
                    Status::Pending => Readiness::Pending,
                    Status::Done => Readiness::Ready,
                    // The GPU faulted: it may never release what it used.
                    Status::Failed => Readiness::Failed,
                },
                move || drop(retained),
            );
        }
    }
}

/// How the submission reports completion.
enum Signal {
    /// The host callback completes `completion`; the watchdog watches it
    /// under this key until the future finishes.
    Callback(watchdog::WatchKey),
    /// The stream writes `seq` into the slot's word; the reactor (or a poll
    /// that sees the word) completes `completion`.
    Reactor {
        slot: Arc<StreamSlot>,
        seq: u64,
        spin: Option<Duration>,
    },
    /// A remote session's reply completes `completion`; the steps run on
    /// the host after it, before the output is handed out.
    Reply(Option<OnReply>),
}

impl Signal {
    fn is_reply(&self) -> bool {
        matches!(self, Signal::Reply(_))
    }

    /// The future is done with its completion: stop watching it.
    fn finish(&self) {
        if let Signal::Callback(key) = self {
            watchdog::unwatch(*key);
        }
    }

    /// Completes `c` if the stream's word shows the work is done; with an
    /// inline spin budget, waits that long for it (first poll only). For a
    /// reply: a consumer woken by its transport's nudge (the reply has
    /// begun to arrive) spins for the finish a little while.
    #[inline]
    fn check(&mut self, c: &Completion) {
        if let Signal::Reply(_) = self {
            c.spin_if_nudged(crate::completion::NUDGE_SPIN);
            return;
        }
        if let Signal::Reactor { slot, seq, spin } = self {
            if slot.reached() >= *seq {
                c.complete();
                return;
            }
            // Spin only when nothing else is ahead of us on the stream: then
            // the wait is about one op long. Behind a queue, spinning would
            // burn the executor thread for nothing.
            if let Some(budget) = spin.take().filter(|_| slot.reached() + 1 >= *seq) {
                let start = Instant::now();
                while start.elapsed() < budget {
                    std::hint::spin_loop();
                    if slot.reached() >= *seq {
                        c.complete();
                        return;
                    }
                }
            }
        }
    }
}

/// Executes `op` under `policy` and awaits it: `op.schedule(policy)?.await`
/// as one call.
///
/// # Errors
/// As [`crate::DeviceOpExt::schedule`] and the op.
///
/// # Cancel safety
/// As [`DeviceFuture`].
pub async fn run_on<O: DeviceOp, P: SchedulingPolicy + ?Sized>(
    op: O,
    policy: &P,
) -> Result<<O as DeviceOp>::Output> {
    DeviceFuture::ready(op, policy.select()?).await
}
