//! [`LeaseDevice`] on [`CudaDevice`]: each op checked, ordered by its
//! buffers' use events and enqueued on the device's streams.

use cuda_async::{Module, PinnedBuffer};
use cuda_core::blas::blas_handle;
use cuda_core::cudarc::driver::DevicePtr;
use cuda_core::half::{bf16, f16};
use cuda_core::rand::rand_generator;
use cuda_core::{HostRegistration, TrackedGraph};

use super::launch::launch_config;
use super::{bind, sealed, CudaDevice, TIMING, UPLOAD_STREAM};
use crate::device::error::{check_event, check_fresh, driver, map, not_found, range, same_buffer};
use crate::device::{
    core_fill, core_gemm, fill_bytes, gemm_spans, DeviceError, LeaseDevice, Ticket,
};
use crate::lock;
use crate::proto::{
    DeviceInfo, DeviceLimits, Dtype, GemmSpec, Id, LaunchArg, LaunchSpec, ModuleHash, RandSpec,
    SourceKind, Status, StreamId,
};

impl LeaseDevice for CudaDevice {
    fn info(&mut self) -> Result<DeviceInfo, DeviceError> {
        let st = Status::Internal;
        let info = self.device.info().map_err(|e| map(st, "device info", e))?;
        let (free, total) = self
            .device
            .memory()
            .map_err(|e| map(st, "memory info", e))?;
        Ok(DeviceInfo {
            ordinal: info.ordinal as u32,
            name: info.name,
            total_bytes: total as u64,
            free_bytes: free as u64,
            compute_capability: info.compute_capability,
            limits: DeviceLimits {
                multiprocessors: info.multiprocessors,
                warp_size: info.warp_size,
                max_threads_per_block: info.max_threads_per_block,
                max_threads_per_multiprocessor: info.max_threads_per_multiprocessor,
                shared_memory_per_block: info.shared_memory_per_block as u32,
                shared_memory_per_block_optin: info.shared_memory_per_block_optin as u32,
                shared_memory_per_multiprocessor: info.shared_memory_per_multiprocessor as u32,
                l2_cache_bytes: info.l2_cache_bytes as u32,
                memory_bus_width_bits: info.memory_bus_width_bits,
                clock_khz: info.clock_khz.unwrap_or(0),
                memory_clock_khz: info.memory_clock_khz.unwrap_or(0),
            },
        })
    }

    fn alloc(&mut self, stream: StreamId, id: Id, size: u64) -> Result<(), DeviceError> {
        self.alloc_buffer(stream, id, size, true)
    }

    /// Not zeroed: the write of all its bytes comes next on `stream`.
    fn alloc_overwritten(
        &mut self,
        stream: StreamId,
        id: Id,
        size: u64,
    ) -> Result<(), DeviceError> {
        self.alloc_buffer(stream, id, size, false)
    }

    fn free(&mut self, _stream: StreamId, id: Id) -> Result<(), DeviceError> {
        if self.events.remove(&id).is_some() || self.timers.remove(&id).is_some() {
            // The driver releases a pending event when it completes.
            return Ok(());
        }
        // Freed after every use on any stream: its events are recorded
        // before it is dropped or handed out again.
        self.flush_use(id)?;
        let buf = self
            .buffers
            .remove(&id)
            .ok_or_else(|| not_found("buffer", id))?;
        // A buffer not kept is freed on its home stream, which the batch's end
        // waits for, so the memory is back in the pool by the reply.
        let home = Self::raw(&buf).home_stream().clone();
        self.touch(&home);
        self.spare.keep(buf);
        Ok(())
    }

    /// Small writes staged in the batch arena, larger ones through
    /// `cuda-core`'s pooled staging.
    fn write(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let r = range(self.buffer(id)?.len(), offset, data.len() as u64)?;
        if r.is_empty() {
            return Ok(());
        }
        if let Some(staged) = self.copy_staged(sid, id, (r.start, r.len()), false) {
            return staged;
        }
        if let Some(slot) = self.arena_take(r.len())? {
            self.use_on(id, sid, &stream)?;
            let buf = Self::raw_mut(self.buffers.get_mut(&id).expect("checked above"));
            let arena = self.arena.as_mut().expect("made by arena_take");
            // A host memcpy, then an async copy to `r.start` (range checked)
            // after the buffer's other uses (`use_on`); the arena's bytes
            // stay untouched until the batch's end has waited for the copy.
            return arena
                .upload(slot, data, buf, r.start, &stream)
                .map_err(|e| map(Status::Internal, "cuMemcpyHtoDAsync", e));
        }
        self.flush_use(id)?;
        let buf = self.buffers.get_mut(&id).expect("checked above");
        cuda_core::staging::upload_at(data, Self::raw_mut(buf), r.start, &stream)
            .map_err(|e| map(Status::BadRequest, "host-to-device copy", e))
    }

    /// Small reads land in the batch arena, larger ones in a pooled
    /// `PinnedBuffer`; both are delivered at finish.
    fn read(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        at: usize,
    ) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let r = range(self.buffer(id)?.len(), offset, len)?;
        if r.is_empty() {
            return Ok(());
        }
        let st = Status::ReadFailed;
        if let Some(staged) = self.copy_staged(sid, id, (r.start, r.len()), true) {
            return staged;
        }
        if let Some(slot) = self.arena_take(r.len())? {
            self.use_on(id, sid, &stream)?;
            let buf = &self.buffers[&id];
            let arena = self.arena.as_mut().expect("made by arena_take");
            // Range checked, after the buffer's writes (`use_on`); the arena
            // is read only after the batch's end waited for the copy.
            let read = arena
                .download(slot, Self::raw(buf), r.start, &stream)
                .map_err(|e| map(st, "cuMemcpyDtoHAsync", e))?;
            self.arena_reads.push((at, read));
            return Ok(());
        }
        self.flush_use(id)?;
        let buf = self.buffer(id)?;
        // SAFETY: the download below overwrites every byte before any
        // host access, which waits for it.
        let mut host = unsafe { PinnedBuffer::<u8>::uninit(&self.device, r.len()) }
            .map_err(|e| map(st, "pinned allocation", e))?;
        host.download_from(Self::raw(buf), r.start, &stream)
            .map_err(|e| map(st, "device-to-host copy", e))?;
        self.reads.push((host, at));
        Ok(())
    }

    /// A memset ordered by the buffer.
    fn fill(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        value: u8,
    ) -> Result<(), DeviceError> {
        let stream = self.stream(stream)?;
        self.flush_use(id)?;
        let buf = self
            .buffers
            .get_mut(&id)
            .ok_or_else(|| not_found("buffer", id))?;
        let r = range(buf.len(), offset, len)?;
        if r.is_empty() {
            return Ok(());
        }
        let st = Status::Internal;
        let buf = Self::raw_mut(buf);
        buf.before_write(&stream).map_err(|e| map(st, "fill", e))?;
        // `r` is inside the buffer (checked above); the buffer orders the
        // write against its other uses.
        let filled = buf.memset_unordered(r.clone(), value, &stream);
        let after = buf.after_write(&stream);
        filled.map_err(|e| map(st, "cuMemsetD8Async", e))?;
        after.map_err(|e| map(st, "fill", e))
    }

    /// A device-to-device copy ordered by both buffers.
    fn copy(
        &mut self,
        stream: StreamId,
        src: (Id, u64),
        dst: (Id, u64),
        len: u64,
    ) -> Result<(), DeviceError> {
        if src.0 == dst.0 {
            return Err(same_buffer());
        }
        let stream = self.stream(stream)?;
        self.flush_use(src.0)?;
        self.flush_use(dst.0)?;
        let rs = range(self.buffer(src.0)?.len(), src.1, len)?;
        let rd = range(self.buffer(dst.0)?.len(), dst.1, len)?;
        if rs.is_empty() {
            return Ok(());
        }
        // Out of the map while borrowed mutably next to the source.
        let mut to = self.buffers.remove(&dst.0).expect("checked above");
        let from = Self::raw(&self.buffers[&src.0]);
        let st = Status::Internal;
        let r = (|| {
            let to = Self::raw_mut(&mut to);
            from.before_read(&stream).map_err(|e| map(st, "copy", e))?;
            to.before_write(&stream).map_err(|e| map(st, "copy", e))?;
            let copied = stream.memcpy_dtod(
                &from.as_cuda_slice().slice(rs.clone()),
                &mut to.as_cuda_slice_mut().slice_mut(rd.clone()),
            );
            let read = from.after_read(&stream);
            let wrote = to.after_write(&stream);
            copied.map_err(|e| driver(st, "cuMemcpyDtoDAsync", e))?;
            read.map_err(|e| map(st, "copy", e))?;
            wrote.map_err(|e| map(st, "copy", e))
        })();
        self.buffers.insert(dst.0, to);
        r
    }

    /// By the node's cuBLAS: the operands' ranges checked, their uses ordered
    /// like a launch's (`use_on`), the product enqueued on the stream's handle.
    fn gemm(&mut self, stream: StreamId, g: &GemmSpec) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let bytes = gemm_spans(g).map_err(|e| DeviceError::new(Status::BadRequest, e))?;
        for (i, (_, o)) in g.operands().into_iter().enumerate() {
            range(self.buffer(o.buf)?.len(), o.offset, bytes[i])?;
        }
        for (_, o) in g.operands() {
            self.use_on(o.buf, sid, &stream)?;
        }
        let mut addrs = [0u64; 3];
        for (addr, (_, o)) in addrs.iter_mut().zip(g.operands()) {
            let (base, _use) = Self::raw(self.buffer(o.buf)?)
                .as_cuda_slice()
                .device_ptr(&stream);
            *addr = base + o.offset;
        }
        bind(&self.device)?;
        let handle = blas_handle(&stream).map_err(|e| map(Status::LaunchFailed, "gemm", e))?;
        let mut handle = lock(&handle);
        let [a, b, c] = addrs;
        // SAFETY: live buffers of this context at offsets whose matrices lie
        // inside them (checked above, as the worker's plan did), on the handle's
        // stream; their uses elsewhere come before and frees after (`use_on`).
        let done = unsafe {
            match g.dtype {
                Dtype::F32 => handle.gemm(&core_gemm(g, |v| v as f32), a, b, c),
                Dtype::F64 => handle.gemm(&core_gemm(g, |v| v), a, b, c),
                Dtype::Bf16 => handle.gemm(&core_gemm(g, bf16::from_f64), a, b, c),
                Dtype::F16 => handle.gemm(&core_gemm(g, f16::from_f64), a, b, c),
            }
        };
        done.map_err(|e| map(Status::LaunchFailed, "gemm", e))
    }

    /// By the node's cuRAND: the range checked, the buffer's uses ordered like
    /// a launch's (`use_on`), the fill enqueued on the stream's generator.
    fn rand_fill(&mut self, stream: StreamId, r: &RandSpec) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let bytes = fill_bytes(r).map_err(|e| DeviceError::new(Status::BadRequest, e))?;
        range(self.buffer(r.dst.buf)?.len(), r.dst.offset, bytes)?;
        self.use_on(r.dst.buf, sid, &stream)?;
        let (base, _use) = Self::raw(self.buffer(r.dst.buf)?)
            .as_cuda_slice()
            .device_ptr(&stream);
        let addr = base + r.dst.offset;
        bind(&self.device)?;
        let generator =
            rand_generator(&stream).map_err(|e| map(Status::LaunchFailed, "random fill", e))?;
        let mut generator = lock(&generator);
        let len = r.len as usize;
        // SAFETY: a live buffer of this context, its `len` elements inside it
        // (checked above, as the worker's plan did), on the generator's stream;
        // its uses elsewhere come before and its free after (`use_on`).
        let done = unsafe {
            match r.dtype {
                Dtype::F32 => generator.fill(&core_fill(r, |v| v as f32), addr, len),
                Dtype::F64 => generator.fill(&core_fill(r, |v| v), addr, len),
                Dtype::Bf16 | Dtype::F16 => unreachable!("refused by `fill_bytes` above"),
            }
        };
        done.map_err(|e| map(Status::LaunchFailed, "random fill", e))
    }

    unsafe fn register_ring(&mut self, ptr: *mut u8, len: usize) -> bool {
        // SAFETY: the caller keeps the ring mapped for the device's life;
        // the registration is dropped with the device.
        match unsafe { HostRegistration::new(&self.device, ptr, len) } {
            Ok(r) => {
                self.ring = Some(r);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "the shared ring could not be registered: chunks are staged");
                false
            }
        }
    }

    fn write_chunk(&mut self, id: Id, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        // On a stream of its own (the buffer orders it after its earlier
        // uses), not behind the lease's other work on its streams.
        if !self.ring.as_ref().is_some_and(|r| r.contains(data)) {
            return self.write(UPLOAD_STREAM, id, offset, data);
        }
        let stream = self.stream(UPLOAD_STREAM)?;
        self.flush_use(id)?;
        let buf = self
            .buffers
            .get_mut(&id)
            .ok_or_else(|| not_found("buffer", id))?;
        let r = range(buf.len(), offset, data.len() as u64)?;
        let ring = self.ring.as_ref().expect("checked above");
        // SAFETY: the worker replies (and the node reuses the slot) only
        // after `chunks_done` has waited for the stream.
        unsafe { ring.upload(data, Self::raw_mut(buf), r.start, &stream) }
            .map_err(|e| map(Status::BadRequest, "host-to-device copy", e))
    }

    fn read_chunk(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        if !self.ring.as_ref().is_some_and(|r| r.contains(out)) {
            return self.read_now(id, offset, out);
        }
        // On a stream of its own (the buffer orders it after its writes).
        let stream = self.stream(StreamId::MAX)?;
        self.flush_use(id)?;
        let buf = self.buffer(id)?;
        let r = range(buf.len(), offset, out.len() as u64)?;
        let ring = self.ring.as_ref().expect("checked above");
        // SAFETY: nothing reads the slot (the worker replies, and the node
        // sends it) before `chunks_done` has waited for the stream.
        unsafe { ring.download(Self::raw(buf), r.start, out, &stream) }
            .map_err(|e| map(Status::ReadFailed, "device-to-host copy", e))
    }

    fn chunks_done(&mut self) -> Result<(), DeviceError> {
        self.finish(&mut [])
    }

    fn read_now(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        // On a stream of its own (the buffer orders it after its writes).
        self.read(StreamId::MAX, id, offset, out.len() as u64, 0)?;
        self.finish(out)
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
        let st = Status::LoadFailed;
        let name = format!("module {hash}");
        let (ptx, compiled) = match kind {
            SourceKind::Ptx => (text.to_owned(), false),
            SourceKind::Cuda { options } => {
                // In a confined child process (`crate::sandbox`).
                let (major, minor) = self
                    .device
                    .compute_capability()
                    .map_err(|e| map(st, "compute capability", e))?;
                let arch = format!("compute_{major}{minor}");
                let ptx = self
                    .compiler
                    .compile(&name, text, options, &arch)
                    .map_err(|log| {
                        DeviceError::new(st, format!("module `{name}` failed to compile:\n{log}"))
                    })?;
                (ptx, true)
            }
        };
        let module = Module::ptx(ptx.as_str())
            .map_err(|e| map(st, "PTX", e))?
            .named(name);
        // JIT-loaded now (once per content in this process), so the
        // log of a bad module comes back with this request.
        module
            .load_on(&self.device)
            .map_err(|e| map(st, "load", e))?;
        self.modules.insert(hash, module);
        Ok(compiled.then_some(ptx))
    }

    fn unload_module(&mut self, hash: ModuleHash) -> Result<(), DeviceError> {
        let module = self
            .modules
            .remove(&hash)
            .ok_or_else(|| not_found("module", hash))?;
        // Nothing of it may run when it unloads: wait for every stream,
        // then let go of its kernels and its cache entry.
        self.sync_all()?;
        self.kernels.remove(&hash);
        self.last_kernel = None;
        // SAFETY: every stream of this context is idle, and the kernels
        // resolved from this module are dropped.
        unsafe { module.evict_on(&self.device) };
        Ok(())
    }

    /// Arguments checked against the kernel's PTX parameters (`launchable`),
    /// each buffer's use ordered (`use_on`), values laid out in `ArgList`
    /// storage reused by every launch.
    fn launch(&mut self, stream: StreamId, spec: &LaunchSpec<'_>) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let config = launch_config(spec)?;
        let args = &spec.args;
        self.launchable(spec.module, &spec.kernel, args)?;
        for a in args {
            if let LaunchArg::Mem { buf, .. } = a {
                self.use_on(*buf, sid, &stream)?;
            }
        }
        // 8-byte aligned words; no allocation once the storage has grown.
        let mut list = self.arg_list.start(&stream);
        Self::push_args(&self.buffers, &mut list, args)?;
        bind(&self.device)?;
        let kernel = &self.last_kernel.as_ref().expect("set by launchable").kernel;
        // SAFETY: the client's kernel, launched with the client's arguments
        // as `cuda-core` checks them against its PTX parameters (as
        // `launchable` did); what it does with memory is the client's
        // business: a fault poisons only this worker, whose context serves
        // one lease. Buffer addresses are this context's live buffers, whose
        // uses on other streams this launch waits for (`use_on`,
        // `before_write`) and whose frees come after it (`use_on` marks the
        // use pending; `flush_use` records it before anything could depend
        // on it).
        let launched = unsafe { kernel.launch_with(&self.device, &config, list) };
        launched.map_err(|e| map(Status::LaunchFailed, "cuLaunchKernel", e))
    }

    fn record(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError> {
        check_event(self.buffers.contains_key(&event), event)?;
        let stream = self.stream(stream)?;
        let st = Status::Internal;
        match self.events.get(&event) {
            Some(ev) => ev
                .record(&stream)
                .map_err(|e| driver(st, "cuEventRecord", e)),
            None => {
                let ev = stream
                    .record_event(None)
                    .map_err(|e| driver(st, "cuEventRecord", e))?;
                self.events.insert(event, ev);
                Ok(())
            }
        }
    }

    fn wait(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError> {
        let stream = self.stream(stream)?;
        let ev = self
            .events
            .get(&event)
            .ok_or_else(|| not_found("event", event))?;
        stream
            .wait(ev)
            .map_err(|e| driver(Status::Internal, "cuStreamWaitEvent", e))
    }

    fn timer_start(&mut self, stream: StreamId, timer: Id) -> Result<(), DeviceError> {
        let taken = self.buffers.contains_key(&timer)
            || self.events.contains_key(&timer)
            || self.timers.contains_key(&timer);
        check_fresh(taken, timer)?;
        let stream = self.stream(stream)?;
        let ev = stream
            .record_event(Some(TIMING))
            .map_err(|e| driver(Status::Internal, "cuEventRecord", e))?;
        self.timers.insert(timer, ev);
        Ok(())
    }

    fn timer_end(&mut self, stream: StreamId, timer: Id, at: usize) -> Result<(), DeviceError> {
        let stream = self.stream(stream)?;
        let start = self
            .timers
            .remove(&timer)
            .ok_or_else(|| not_found("timer", timer))?;
        let end = stream
            .record_event(Some(TIMING))
            .map_err(|e| driver(Status::Internal, "cuEventRecord", e))?;
        // (`stream()` noted the stream: the batch's end waits for it.)
        self.timer_reads.push((start, end, at));
        Ok(())
    }

    /// Captured once into a `cuda-core` `TrackedGraph`, which logs the buffers
    /// it uses and orders each replay as a use of each.
    fn capture_graph(
        &mut self,
        graph: Id,
        streams: &[StreamId],
        enqueue: &mut dyn FnMut(&mut dyn LeaseDevice) -> Result<(), DeviceError>,
    ) -> Result<bool, DeviceError> {
        let Some(captured) = self.capture_tracked(streams, enqueue)? else {
            return Ok(false);
        };
        self.graphs.insert(graph, captured);
        Ok(true)
    }

    /// Captured as a graph is, its uploads and downloads staged in
    /// page-locked memory of its own (see `prepared`).
    fn capture_prepared(
        &mut self,
        graph: Id,
        streams: &[StreamId],
        bytes: (u64, u64),
        enqueue: &mut dyn FnMut(&mut dyn LeaseDevice) -> Result<(), DeviceError>,
    ) -> Result<bool, DeviceError> {
        self.capture_staged(graph, streams, bytes, enqueue)
    }

    fn run_prepared(
        &mut self,
        stream: StreamId,
        graph: Id,
        inputs: &[u8],
        at: usize,
    ) -> Result<bool, DeviceError> {
        self.run_staged(stream, graph, inputs, at)
    }

    /// A graph captured natively, replayed with one `cuGraphLaunch`.
    fn launch_graph(&mut self, stream: StreamId, graph: Id) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        // Pending uses elsewhere are recorded, so the replay waits for them.
        self.flush_elsewhere(sid)?;
        let g = self.graphs.get(&graph).ok_or_else(|| {
            DeviceError::new(Status::NotFound, format!("no graph {graph} on this device"))
        })?;
        g.launch_on(&stream)
            .map_err(|e| map(Status::LaunchFailed, "cuGraphLaunch", e))
    }

    fn free_graph(&mut self, graph: Id) {
        // Released after its last replay, on the reclaimer thread (a
        // prepared body's once its last run's outputs are copied out).
        self.graphs.remove(&graph);
        self.forget_prepared(graph);
    }

    fn staging_bytes(&self) -> u64 {
        self.staged as u64
    }

    fn seal(&mut self, out_len: usize) -> Ticket {
        self.seal_batch(out_len)
    }

    fn poll_sealed(&mut self, ticket: Ticket) -> Option<Result<Vec<u8>, DeviceError>> {
        self.poll_batch(ticket)
    }

    fn wake_when_done(&mut self, ticket: Ticket) -> Option<std::os::fd::RawFd> {
        self.arm_wake(ticket)
    }

    fn finish(&mut self, out: &mut [u8]) -> Result<(), DeviceError> {
        // Waits for the copies (and surfaces kernel faults here).
        let synced = self.sync_touched();
        self.spare.settle(synced.is_ok());
        if synced.is_ok() && self.sealed.is_empty() {
            // Every use is done: nothing needs their events.
            self.pending.clear();
        } else {
            // Sealed batches may still use them (`sync_touched` waited
            // only for streams touched since the last seal): record their
            // uses so later copies, frees and other streams wait for them.
            // (On a dead context the buffers are marked broken and leaked
            // when freed, never freed before their uses.)
            let _ = self.flush_all();
        }
        let reads = std::mem::take(&mut self.reads);
        let timers = std::mem::take(&mut self.timer_reads);
        let arena_reads = std::mem::take(&mut self.arena_reads);
        let prepared_reads = std::mem::take(&mut self.prepared_reads);
        if synced.is_err() {
            // Copies may still use it: never reuse or free it.
            std::mem::forget(self.arena.take());
        }
        synced?;
        if let Some(arena) = &self.arena {
            // The arena waited for every copy of the batch in `sync_touched`.
            sealed::arena_reads_into(out, arena, arena_reads)?;
        }
        sealed::reads_into(out, reads, timers)?;
        super::prepared::prepared_reads_into(out, prepared_reads)
    }
}

impl CudaDevice {
    /// Captures what `enqueue` enqueues while `streams` (the first one
    /// first) capture into a `TrackedGraph`; `None` for a body on no stream.
    pub(super) fn capture_tracked(
        &mut self,
        streams: &[StreamId],
        enqueue: &mut dyn FnMut(&mut dyn LeaseDevice) -> Result<(), DeviceError>,
    ) -> Result<Option<TrackedGraph>, DeviceError> {
        let Some((&first, rest)) = streams.split_first() else {
            return Ok(None);
        };
        // Made before the capture starts (no stream is created inside it).
        let main = self.stream(first)?;
        let side = rest
            .iter()
            .map(|s| self.stream(*s))
            .collect::<Result<Vec<_>, _>>()?;
        let alloc = self.capture_alloc_stream()?;
        // Uses before the capture are recorded outside it.
        self.flush_all()?;
        let mut failed = None;
        self.capturing = true;
        let captured = TrackedGraph::capture(&main, &side, &alloc, |_| {
            // The body's uses are logged for the graph before it ends.
            let r = enqueue(self).and_then(|()| self.flush_all());
            r.map_err(|e| {
                let message = e.message.clone();
                failed = Some(e);
                cuda_core::Error::Capture(message)
            })
        });
        self.capturing = false;
        if let Some(e) = failed {
            return Err(e);
        }
        captured
            .map(Some)
            .map_err(|e| map(Status::Internal, "graph capture", e))
    }
}
