//! Sealed batches: a batch's work left running while the worker enqueues
//! the next, its completion found by events, never by waiting for the
//! streams (later batches run on them too).

use cuda_async::{DeviceBuffer, PinnedBuffer};
use cuda_core::{ArenaEnd, ArenaRead, CudaEvent, StagingArena};

use super::CudaDevice;
use crate::device::error::{driver, map};
use crate::device::{DeviceError, Ticket};
use crate::proto::{Status, StreamId};

/// Most spare arenas a device keeps (each holds
/// [`super::staging::ARENA_BYTES`] of page-locked memory).
const SPARE_ARENAS: usize = 8;

/// Most spare done events a device keeps.
const SPARE_EVENTS: usize = 64;

/// A sealed batch's staging arena: the arena, the end of its epoch, and
/// where each of its downloads goes in the reply's data.
type SealedArena = (StagingArena, ArenaEnd, Vec<(usize, ArenaRead)>);

/// A sealed batch whose work may still run.
#[derive(Debug)]
pub(super) struct InFlight {
    /// Recorded after the batch's work on every stream it touched (none
    /// when its arena's end is: see `in_flight_batch`).
    pub(super) done: Vec<CudaEvent>,
    /// Where its reads land in its reply's data: pinned downloads,
    /// timers, and (with its arena) the arena's downloads.
    reads: Vec<(PinnedBuffer<u8>, usize)>,
    timers: Vec<(CudaEvent, CudaEvent, usize)>,
    arena: Option<SealedArena>,
    /// Its runs of prepared bodies (see `prepared`).
    prepared: Vec<super::prepared::PreparedRead>,
    /// Buffers it freed: spare once it is done.
    freed: Vec<DeviceBuffer<u8>>,
    out_len: usize,
}

impl CudaDevice {
    /// Seals what was enqueued since the last seal (see `LeaseDevice::seal`).
    pub(super) fn seal_batch(&mut self, out_len: usize) -> Ticket {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        let sealed = self.in_flight_batch(out_len);
        self.sealed.insert(ticket, sealed);
        ticket
    }

    fn in_flight_batch(&mut self, out_len: usize) -> Result<InFlight, DeviceError> {
        let touched = std::mem::take(&mut self.touched);
        let reads = std::mem::take(&mut self.reads);
        let timers = std::mem::take(&mut self.timer_reads);
        let arena_reads = std::mem::take(&mut self.arena_reads);
        let prepared = std::mem::take(&mut self.prepared_reads);
        let freed = self.spare.take_freed();
        // A batch with staging copies is marked by its arena's end,
        // recorded on every stream the batch touched; one without, by done
        // events of its own. The arena goes with the batch (its copies may
        // still run); the next batch takes a spare one, or makes one on
        // first use.
        let mut failed = None;
        let arena = match self.arena.take() {
            Some(mut a) if a.used() > 0 => match a.mark_end_with(&touched) {
                Ok(end) => {
                    self.arena = self.spare_arenas.pop();
                    Some((a, end, arena_reads))
                }
                Err(e) => {
                    // Copies may still use it: never reuse or free it.
                    std::mem::forget(a);
                    failed = Some(sync_failed(map(Status::Internal, "cuEventRecord", e)));
                    None
                }
            },
            other => {
                self.arena = other;
                None
            }
        };
        let mut done = Vec::new();
        if arena.is_none() && failed.is_none() {
            done.reserve(touched.len());
            for s in &touched {
                let event = match self.spare_events.pop() {
                    Some(e) => Ok(e),
                    None => self.device.context().new_event(None),
                };
                match event.and_then(|e| e.record(s).map(|()| e)) {
                    Ok(e) => done.push(e),
                    Err(e) => {
                        failed = Some(sync_failed(driver(Status::Internal, "cuEventRecord", e)));
                        break;
                    }
                }
            }
        }
        if let Some(e) = failed {
            self.spare.settle_these(freed, false);
            let _ = self.flush_all();
            return Err(e);
        }
        Ok(InFlight {
            done,
            reads,
            timers,
            arena,
            prepared,
            freed,
            out_len,
        })
    }

    /// Polls sealed batch `ticket` (see `LeaseDevice::poll_sealed`).
    pub(super) fn poll_batch(&mut self, ticket: Ticket) -> Option<Result<Vec<u8>, DeviceError>> {
        let Some(entry) = self.sealed.get(&ticket) else {
            return Some(Err(DeviceError::new(
                Status::Internal,
                format!("no sealed batch {}", ticket.0),
            )));
        };
        let done = entry.as_ref().map_or(Ok(true), InFlight::is_done);
        if matches!(done, Ok(false)) {
            return None;
        }
        Some(match (self.sealed.remove(&ticket)?, done) {
            (Ok(f), Ok(_)) => self.complete(f),
            (Ok(f), Err(e)) => {
                self.abandon(f);
                Err(e)
            }
            (Err(e), _) => Err(e),
        })
    }

    /// A done batch: its reads delivered, its arena, frees and done
    /// events reusable.
    fn complete(&mut self, f: InFlight) -> Result<Vec<u8>, DeviceError> {
        // Passed: recorded again, they wait for the next batches' work (a
        // wait enqueued on one earlier keeps the record it saw).
        let room = SPARE_EVENTS.saturating_sub(self.spare_events.len());
        self.spare_events.extend(f.done.into_iter().take(room));
        let mut out = vec![0u8; f.out_len];
        if let Some((mut arena, end, arena_reads)) = f.arena {
            if let Err(e) = arena.settle(end) {
                std::mem::forget(arena);
                self.spare.settle_these(f.freed, false);
                return Err(sync_failed(map(
                    Status::LaunchFailed,
                    "cuEventSynchronize",
                    e,
                )));
            }
            arena_reads_into(&mut out, &arena, arena_reads)?;
            if self.spare_arenas.len() < SPARE_ARENAS {
                self.spare_arenas.push(arena);
            }
        }
        self.spare.settle_these(f.freed, true);
        reads_into(&mut out, f.reads, f.timers)?;
        super::prepared::prepared_reads_into(&mut out, f.prepared)?;
        Ok(out)
    }

    /// A batch whose wait failed (a sticky fault): nothing of it is reused
    /// or freed under copies that may still run.
    fn abandon(&mut self, f: InFlight) {
        if let Some((arena, _, _)) = f.arena {
            std::mem::forget(arena);
        }
        self.spare.settle_these(f.freed, false);
        let _ = self.flush_all();
    }

    /// Records every buffer's pending uses in its use events (or, on a
    /// dead context, marks it broken), so that no free runs before them;
    /// the first failure, once every buffer has been tried.
    pub(super) fn flush_all(&mut self) -> Result<(), DeviceError> {
        self.flush_pending(|_| true)
    }

    /// Records the pending uses on other streams than `stream`, before a
    /// graph's replay there: the replay waits for the recorded uses of its
    /// buffers, and follows those pending on its own stream in the stream's
    /// order (recorded later, their events mark a point after the replay:
    /// what waits for them waits for more, never less).
    pub(super) fn flush_elsewhere(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        self.flush_pending(|s| s != stream)
    }

    /// Records the pending uses on the streams `on` picks; the first
    /// failure, once each of them has been tried.
    fn flush_pending(&mut self, on: impl Fn(StreamId) -> bool) -> Result<(), DeviceError> {
        let ids: Vec<_> = self
            .pending
            .iter()
            .filter(|(_, s)| on(**s))
            .map(|(id, _)| *id)
            .collect();
        let flushed = ids.into_iter().map(|id| self.flush_use(id));
        flushed.fold(Ok(()), Result::and)
    }
}

impl InFlight {
    /// Makes `stream` wait for every stream the batch touched to pass it.
    pub(super) fn wait_on(&self, stream: &cuda_async::CudaStream) -> Result<(), DeviceError> {
        for e in &self.done {
            stream
                .wait(e)
                .map_err(|e| driver(Status::Internal, "cuStreamWaitEvent", e))?;
        }
        match &self.arena {
            Some((_, end, _)) => end
                .wait_on(stream)
                .map_err(|e| map(Status::Internal, "cuStreamWaitEvent", e)),
            None => Ok(()),
        }
    }

    /// Whether every stream it touched has passed it (never waits).
    fn is_done(&self) -> Result<bool, DeviceError> {
        for e in &self.done {
            match e.try_is_complete() {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(e) => return Err(sync_failed(driver(Status::LaunchFailed, "cuEventQuery", e))),
            }
        }
        match &self.arena {
            Some((_, end, _)) => end
                .is_done()
                .map_err(|e| sync_failed(map(Status::LaunchFailed, "cuEventQuery", e))),
            None => Ok(true),
        }
    }
}

/// Copies a batch's arena downloads (each to its place in the reply's
/// data) once the arena's copies are done.
pub(super) fn arena_reads_into(
    out: &mut [u8],
    arena: &StagingArena,
    reads: Vec<(usize, ArenaRead)>,
) -> Result<(), DeviceError> {
    for (at, read) in reads {
        let bytes = arena
            .read(read)
            .map_err(|e| map(Status::ReadFailed, "device-to-host copy", e))?;
        if let Some(dst) = out.get_mut(at..at + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
    }
    Ok(())
}

/// Copies a batch's pinned downloads and timer readings (nanoseconds) to
/// their places in the reply's data, once the batch is done.
pub(super) fn reads_into(
    out: &mut [u8],
    reads: Vec<(PinnedBuffer<u8>, usize)>,
    timers: Vec<(CudaEvent, CudaEvent, usize)>,
) -> Result<(), DeviceError> {
    for (host, at) in reads {
        let bytes = host
            .as_slice()
            .map_err(|e| map(Status::ReadFailed, "device-to-host copy", e))?;
        if let Some(dst) = out.get_mut(at..at + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
    }
    for (start, end, at) in timers {
        // Both recorded on streams the batch's end waited for.
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| driver(Status::Internal, "cuEventElapsedTime", e))?;
        let ns = (f64::from(ms.max(0.0)) * 1e6) as u64;
        if let Some(dst) = out.get_mut(at..at + 8) {
            dst.copy_from_slice(&ns.to_le_bytes());
        }
    }
    Ok(())
}

/// A failed wait or record: sticky (a kernel fault poisons the context).
fn sync_failed(mut e: DeviceError) -> DeviceError {
    e.sticky = true;
    e
}
