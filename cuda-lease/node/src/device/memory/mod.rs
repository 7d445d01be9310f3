//! The in-memory test double of a device, [`MemoryDevice`].

use std::collections::HashMap;
use std::time::Instant;

use super::error::{
    check_event, check_fresh, mem_arg, not_found, range, same_buffer, submit_only, too_many_streams,
};
use super::{fill_bytes, gemm_spans, DeviceError, LeaseDevice, Ticket, MAX_DEVICE_STREAMS};
use crate::proto::{
    DeviceInfo, GemmSpec, Id, LaunchArg, LaunchSpec, ModuleHash, RandSpec, SourceKind, Status,
    StreamId,
};

mod kernels;
mod library;
mod scheduler;
#[cfg(test)]
mod tests;

use kernels::{compile_time, entry_names, host_kernel_shape, HostArg};
use scheduler::{Queued, Work};

/// The in-memory test double of a device: memory is host `Vec`s, streams
/// and events are real, and a few named test kernels run on the host, so
/// data flow, ordering and failures are testable without a GPU.
///
/// Enqueued commands wait with their dependencies (the earlier command of
/// their stream, the record a wait names, conflicting earlier uses of their
/// buffers); [`LeaseDevice::finish`] runs them, each time picking a ready
/// command of the highest stream id, so independent streams do not simply
/// run in submission order and a missing dependency shows up as wrong data.
///
/// Modules: PTX must hold `.entry`, CUDA C `__global__` and no `#error`
/// (else LOAD_FAILED with a fake log). Host kernels, one element per thread
/// (`i < n`): `iota(u32* out, u32 n)`: `out[i] = i`; `vadd(f32* a, f32* b,
/// f32* c, u32 n)`: `c = a + b`; `fill(f32* out, f32 v, u32 n)`;
/// `axpy(f32 a, f32* x, f32* y, u32 n)`: `y = a * x + y`; `copy(f32* src,
/// f32* dst, u32 n)`; `bias_relu(f32* h, f32* b, u32 rows, u32 cols)`:
/// `h = max(h + b[row], 0)`, column-major; `softmax_columns(f32* z, u32
/// rows, u32 cols)`: each column its softmax (one thread a column);
/// `delay(u32 ms)` takes `ms` milliseconds; `spin` does nothing. A CUDA C
/// module with a line `// compile-ms: N` takes `N` milliseconds to load,
/// as a slow compile would. An access
/// outside a buffer faults like an illegal address (sticky LAUNCH_FAILED at
/// the next finish). Magic names for supervisor tests: `__fault` faults
/// likewise, `__hang` never returns, `__exit` ends the worker process.
#[derive(Debug, Default)]
pub struct MemoryDevice {
    capacity: u64,
    used: u64,
    /// Live buffer ids -> storage slots (a freed id may be named again
    /// while its old storage waits for its queued free).
    buffers: HashMap<Id, (usize, usize)>,
    store: HashMap<usize, Vec<u8>>,
    next_slot: usize,
    /// Live event ids -> the queue index of their last record (None: done
    /// before this queue).
    events: HashMap<Id, Option<usize>>,
    /// Started timers -> their key in `stamps`.
    timers: HashMap<Id, u64>,
    next_timer: u64,
    /// When the scheduler ran each started timer's start.
    stamps: HashMap<u64, std::time::Instant>,
    modules: HashMap<ModuleHash, Vec<String>>,
    queue: Vec<Queued>,
    /// Per stream: index of its last queued command.
    tails: HashMap<StreamId, usize>,
    /// Per storage slot: the last queued write and the reads since.
    hazards: HashMap<usize, (Option<usize>, Vec<usize>)>,
    faulted: bool,
    /// When each stream's, storage slot's and event's last work is done,
    /// on the test double's clock (see the scheduler).
    stream_clock: HashMap<StreamId, Instant>,
    slot_clock: HashMap<usize, Instant>,
    event_clock: HashMap<Id, Instant>,
    /// Sealed batches: when they are done, and their reads (or fault).
    sealed: HashMap<Ticket, (Instant, Result<Vec<u8>, DeviceError>)>,
    next_ticket: u64,
}

impl MemoryDevice {
    /// A device with `capacity` bytes of memory.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    fn check_fault(&self) -> Result<(), DeviceError> {
        if self.faulted {
            return Err(DeviceError::sticky(
                Status::LaunchFailed,
                "an illegal memory access was encountered (test double)",
            ));
        }
        Ok(())
    }

    /// Refuses work after a fault, and a stream past the limit.
    fn ready(&self, stream: StreamId) -> Result<(), DeviceError> {
        self.check_fault()?;
        self.check_stream(stream)
    }

    fn check_stream(&self, stream: StreamId) -> Result<(), DeviceError> {
        if !self.tails.contains_key(&stream) && self.tails.len() >= MAX_DEVICE_STREAMS {
            return Err(too_many_streams());
        }
        Ok(())
    }

    fn slot(&self, id: Id) -> Result<(usize, usize), DeviceError> {
        self.buffers
            .get(&id)
            .copied()
            .ok_or_else(|| not_found("buffer", id))
    }

    /// A fresh buffer of `size` bytes of `value`.
    fn alloc_filled(
        &mut self,
        stream: StreamId,
        id: Id,
        size: u64,
        value: u8,
    ) -> Result<(), DeviceError> {
        self.ready(stream)?;
        let taken = self.buffers.contains_key(&id) || self.events.contains_key(&id);
        check_fresh(taken, id)?;
        if size > self.capacity - self.used {
            return Err(DeviceError::new(Status::CapacityExceeded, "out of memory"));
        }
        self.used += size;
        let slot = self.next_slot;
        self.next_slot += 1;
        // A fresh slot has no earlier uses: filled now, in order for all.
        self.store.insert(slot, vec![value; size as usize]);
        self.buffers.insert(id, (slot, size as usize));
        Ok(())
    }
}

/// What the memory device's [`LeaseDevice::alloc_overwritten`] fills a
/// buffer with: bytes a GPU would leave unspecified.
const UNSPECIFIED: u8 = 0xA5;

impl LeaseDevice for MemoryDevice {
    fn info(&mut self) -> Result<DeviceInfo, DeviceError> {
        Ok(DeviceInfo {
            ordinal: 0,
            name: "MemoryDevice (test double)".into(),
            total_bytes: self.capacity,
            free_bytes: self.capacity - self.used,
            compute_capability: (0, 0),
            limits: Default::default(),
        })
    }

    fn alloc(&mut self, stream: StreamId, id: Id, size: u64) -> Result<(), DeviceError> {
        self.alloc_filled(stream, id, size, 0)
    }

    /// Filled with 0xA5 (`UNSPECIFIED`), which tests can tell from zeros.
    fn alloc_overwritten(
        &mut self,
        stream: StreamId,
        id: Id,
        size: u64,
    ) -> Result<(), DeviceError> {
        self.alloc_filled(stream, id, size, UNSPECIFIED)
    }

    fn free(&mut self, stream: StreamId, id: Id) -> Result<(), DeviceError> {
        self.check_stream(stream)?;
        if self.events.remove(&id).is_some() || self.timers.remove(&id).is_some() {
            self.event_clock.remove(&id);
            return Ok(());
        }
        let (slot, len) = self
            .buffers
            .remove(&id)
            .ok_or_else(|| not_found("buffer", id))?;
        self.used -= len as u64;
        self.enqueue(stream, Work::Free { slot }, &[], &[slot], None, None);
        Ok(())
    }

    fn write(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        self.ready(stream)?;
        let (slot, len) = self.slot(id)?;
        let r = range(len, offset, data.len() as u64)?;
        let work = Work::Write {
            slot,
            at: r.start,
            data: data.to_vec(),
        };
        self.enqueue(stream, work, &[], &[slot], None, None);
        Ok(())
    }

    fn read(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        at: usize,
    ) -> Result<(), DeviceError> {
        self.ready(stream)?;
        let (slot, size) = self.slot(id)?;
        let range = range(size, offset, len)?;
        let work = Work::Read { slot, range, at };
        self.enqueue(stream, work, &[slot], &[], None, None);
        Ok(())
    }

    fn fill(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        value: u8,
    ) -> Result<(), DeviceError> {
        self.ready(stream)?;
        let (slot, size) = self.slot(id)?;
        let range = range(size, offset, len)?;
        let work = Work::Fill { slot, range, value };
        self.enqueue(stream, work, &[], &[slot], None, None);
        Ok(())
    }

    fn copy(
        &mut self,
        stream: StreamId,
        src: (Id, u64),
        dst: (Id, u64),
        len: u64,
    ) -> Result<(), DeviceError> {
        self.ready(stream)?;
        if src.0 == dst.0 {
            return Err(same_buffer());
        }
        let (s, s_size) = self.slot(src.0)?;
        let (d, d_size) = self.slot(dst.0)?;
        let rs = range(s_size, src.1, len)?;
        let rd = range(d_size, dst.1, len)?;
        let work = Work::Copy {
            src: (s, rs.start),
            dst: (d, rd.start),
            len: rs.len(),
        };
        self.enqueue(stream, work, &[s], &[d], None, None);
        Ok(())
    }

    fn gemm(&mut self, stream: StreamId, g: &GemmSpec) -> Result<(), DeviceError> {
        self.ready(stream)?;
        let bytes = gemm_spans(g).map_err(|e| DeviceError::new(Status::BadRequest, e))?;
        let mut slots = [0; 3];
        for (i, (_, o)) in g.operands().into_iter().enumerate() {
            let (slot, size) = self.slot(o.buf)?;
            range(size, o.offset, bytes[i])?;
            slots[i] = slot;
        }
        let work = Work::Gemm { spec: *g, slots };
        self.enqueue(stream, work, &slots[..2], &slots[2..], None, None);
        Ok(())
    }

    fn rand_fill(&mut self, stream: StreamId, r: &RandSpec) -> Result<(), DeviceError> {
        self.ready(stream)?;
        let bytes = fill_bytes(r).map_err(|e| DeviceError::new(Status::BadRequest, e))?;
        let (slot, size) = self.slot(r.dst.buf)?;
        range(size, r.dst.offset, bytes)?;
        let work = Work::RandFill { spec: *r, slot };
        self.enqueue(stream, work, &[], &[slot], None, None);
        Ok(())
    }

    fn read_now(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        let (slot, size) = self.slot(id)?;
        let r = range(size, offset, out.len() as u64)?;
        self.finish(&mut [])?;
        // After the buffer's last use, on the test double's clock.
        if let Some(t) = self.slot_clock.get(&slot) {
            std::thread::sleep(t.saturating_duration_since(Instant::now()));
        }
        out.copy_from_slice(&self.store[&slot][r]);
        Ok(())
    }

    fn load_module(
        &mut self,
        hash: ModuleHash,
        kind: &SourceKind,
        text: &str,
    ) -> Result<Option<String>, DeviceError> {
        if self.modules.contains_key(&hash) {
            return Ok(None);
        }
        let log = match kind {
            SourceKind::Ptx if !text.contains(".entry") => {
                Some("ptxas fatal: no .entry in module (test double JIT log)".to_owned())
            }
            SourceKind::Cuda { .. } if text.contains("#error") || !text.contains("__global__") => {
                // Like NVRTC's, the log quotes the `#error` line and its number
                // (tests see the user's own text reach them).
                let quoted = text
                    .lines()
                    .enumerate()
                    .find(|(_, l)| l.trim_start().starts_with("#error"))
                    .map_or_else(
                        || "no __global__ function".to_owned(),
                        |(n, l)| format!("line {}: {}", n + 1, l.trim()),
                    );
                Some(format!(
                    "module {hash}(1): error: {quoted} (test double NVRTC log)"
                ))
            }
            _ => None,
        };
        if let Some(log) = log {
            return Err(DeviceError::new(Status::LoadFailed, log));
        }
        if let SourceKind::Cuda { .. } = kind {
            std::thread::sleep(compile_time(text));
        }
        self.modules.insert(hash, entry_names(kind, text));
        Ok(None)
    }

    fn unload_module(&mut self, hash: ModuleHash) -> Result<(), DeviceError> {
        self.modules
            .remove(&hash)
            .map(|_| ())
            .ok_or_else(|| not_found("module", hash))
    }

    fn launch(&mut self, stream: StreamId, spec: &LaunchSpec<'_>) -> Result<(), DeviceError> {
        self.ready(stream)?;
        let (args, kernel) = (&spec.args, &*spec.kernel);
        let entries = self
            .modules
            .get(&spec.module)
            .ok_or_else(|| not_found("module", spec.module))?;
        if !entries.iter().any(|e| e == kernel) {
            return Err(DeviceError::new(
                Status::NotFound,
                format!("no kernel {kernel} in module {}", spec.module),
            ));
        }
        let mut host = Vec::with_capacity(args.len());
        let mut touched = Vec::new();
        for a in args {
            host.push(match a {
                LaunchArg::Scalar(b) => HostArg::Scalar(b.to_vec()),
                LaunchArg::Mem { buf, offset } => {
                    let &(slot, _) = mem_arg(&self.buffers, *buf, *offset, |b| b.1)?;
                    touched.push(slot);
                    HostArg::Mem {
                        slot,
                        offset: *offset as usize,
                    }
                }
                LaunchArg::Input(_) | LaunchArg::Output => return Err(submit_only()),
            });
        }
        if let Some(shape) = host_kernel_shape(kernel) {
            let ok = shape.len() == host.len()
                && shape.chars().zip(&host).all(|(c, a)| match (c, a) {
                    ('m', HostArg::Mem { .. }) => true,
                    ('s', HostArg::Scalar(b)) => b.len() == 4,
                    _ => false,
                });
            if !ok {
                return Err(DeviceError::new(
                    Status::BadRequest,
                    format!("test double: wrong arguments for {kernel}"),
                ));
            }
        }
        let threads = spec
            .grid
            .iter()
            .chain(&spec.block)
            .map(|&d| u64::from(d))
            .product::<u64>();
        let work = Work::Launch {
            kernel: kernel.to_owned(),
            threads,
            args: host,
        };
        // Every memory argument may be written.
        self.enqueue(stream, work, &[], &touched, None, None);
        Ok(())
    }

    fn record(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError> {
        self.check_stream(stream)?;
        check_event(self.buffers.contains_key(&event), event)?;
        let i = self.enqueue(stream, Work::Nothing, &[], &[], None, None);
        self.events.insert(event, Some(i));
        self.event_clock.insert(event, self.queue[i].ready);
        Ok(())
    }

    fn wait(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError> {
        self.check_stream(stream)?;
        let last = *self
            .events
            .get(&event)
            .ok_or_else(|| not_found("event", event))?;
        let at = self.event_clock.get(&event).copied();
        self.enqueue(stream, Work::Nothing, &[], &[], last, at);
        Ok(())
    }

    fn timer_start(&mut self, stream: StreamId, timer: Id) -> Result<(), DeviceError> {
        self.check_stream(stream)?;
        let taken = self.buffers.contains_key(&timer)
            || self.events.contains_key(&timer)
            || self.timers.contains_key(&timer);
        check_fresh(taken, timer)?;
        let key = self.next_timer;
        self.next_timer += 1;
        self.timers.insert(timer, key);
        self.enqueue(stream, Work::TimerStart { key }, &[], &[], None, None);
        Ok(())
    }

    fn timer_end(&mut self, stream: StreamId, timer: Id, at: usize) -> Result<(), DeviceError> {
        self.check_stream(stream)?;
        let key = self
            .timers
            .remove(&timer)
            .ok_or_else(|| not_found("timer", timer))?;
        self.enqueue(stream, Work::TimerEnd { key, at }, &[], &[], None, None);
        Ok(())
    }

    fn finish(&mut self, out: &mut [u8]) -> Result<(), DeviceError> {
        let until = self.drain(out);
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
        self.check_fault()
    }

    fn seal(&mut self, out_len: usize) -> Ticket {
        let mut out = vec![0; out_len];
        let until = self.drain(&mut out);
        let result = self.check_fault().map(|()| out);
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        self.sealed.insert(ticket, (until, result));
        ticket
    }

    fn poll_sealed(&mut self, ticket: Ticket) -> Option<Result<Vec<u8>, DeviceError>> {
        match self.sealed.get(&ticket) {
            Some((until, _)) if Instant::now() < *until => None,
            Some(_) => self.sealed.remove(&ticket).map(|(_, r)| r),
            None => Some(Err(DeviceError::new(
                Status::Internal,
                format!("no sealed batch {}", ticket.0),
            ))),
        }
    }
}
