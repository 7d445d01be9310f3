//! Prepared submissions' bodies as native graphs: each keeps page-locked
//! staging that its captured copies read and write at every replay (the
//! body's uploads from `input`, in order; its downloads into `output`, in
//! order), so a run is a host copy of its inputs, one `cuGraphLaunch`, and,
//! once its batch is done, a host copy of its outputs into the reply.
//!
//! One run at a time uses an instance's staging: from the launch until its
//! batch has copied the outputs out, the instance is busy. A body may be
//! captured more than once (each instance with staging of its own), so
//! runs in flight together each find one; where none is free the worker
//! captures another or replays the commands one by one (its fallback,
//! which stages through the batch's own memory). The staging is a
//! `SharedPinnedBuffer`: the host's copies wait for the replays' copies
//! they conflict with, and a replay is ordered after the host's copies.
//!
//! The staging is page-locked host memory that no lease's reservation
//! covers: a worker keeps at most [`STAGING_MAX`] bytes of it, and an
//! instance that would pass that is not captured.

use std::cell::Cell;
use std::rc::Rc;

use cuda_core::cudarc::driver::{DevicePtr, DevicePtrMut};
use cuda_core::{SharedPinnedBuffer, TrackedGraph};

use super::CudaDevice;
use crate::device::error::{map, not_found};
use crate::device::DeviceError;
use crate::proto::{Id, Status, StreamId};

/// Most bytes of prepared bodies' staging a worker keeps, all instances
/// of all bodies together.
pub(super) const STAGING_MAX: usize = 64 << 20;

/// A prepared body captured natively (one instance).
#[derive(Debug)]
pub(super) struct PreparedGraph {
    graph: TrackedGraph,
    input: SharedPinnedBuffer<u8>,
    output: SharedPinnedBuffer<u8>,
    inputs: usize,
    outputs: usize,
    /// From a run's launch until its batch has copied the outputs out
    /// (forever after a batch whose wait failed: its copies may still run).
    busy: Cell<bool>,
}

/// A run's outputs, copied into its batch's reply at `at` once the batch
/// is done.
pub(super) type PreparedRead = (Rc<PreparedGraph>, usize);

/// The staging of the prepared body being captured, and where its next
/// upload reads and its next download lands.
#[derive(Debug)]
pub(super) struct Staging {
    input: SharedPinnedBuffer<u8>,
    output: SharedPinnedBuffer<u8>,
    in_at: usize,
    out_at: usize,
}

fn pinned(device: &cuda_async::Device, len: usize) -> Result<SharedPinnedBuffer<u8>, DeviceError> {
    // One byte at least: a body may upload or download nothing.
    SharedPinnedBuffer::filled(device, len.max(1), 0u8)
        .map_err(|e| map(Status::Internal, "pinned allocation", e))
}

impl CudaDevice {
    /// Forgets prepared body `graph`'s instances (released after their
    /// last runs), and their staging from the bytes kept.
    pub(super) fn forget_prepared(&mut self, graph: Id) {
        if let Some(instances) = self.prepared.remove(&graph) {
            self.staged -= instances.iter().map(|p| p.bytes()).sum::<usize>();
        }
    }

    /// Captures prepared body `graph` (see `LeaseDevice::capture_prepared`).
    pub(super) fn capture_staged(
        &mut self,
        graph: Id,
        streams: &[StreamId],
        (inputs, outputs): (u64, u64),
        enqueue: &mut dyn FnMut(&mut dyn crate::device::LeaseDevice) -> Result<(), DeviceError>,
    ) -> Result<bool, DeviceError> {
        let too_big = |_| DeviceError::new(Status::BadRequest, "a prepared body's bytes overflow");
        let (inputs, outputs) = (
            usize::try_from(inputs).map_err(too_big)?,
            usize::try_from(outputs).map_err(too_big)?,
        );
        if self.staged.saturating_add(staged_bytes(inputs, outputs)) > STAGING_MAX {
            return Ok(false);
        }
        let (input, output) = (
            pinned(&self.device, inputs)?,
            pinned(&self.device, outputs)?,
        );
        self.staging = Some(Staging {
            input: input.clone(),
            output: output.clone(),
            in_at: 0,
            out_at: 0,
        });
        let captured = self.capture_tracked(streams, enqueue);
        let staging = self.staging.take().expect("set above");
        let Some(captured) = captured? else {
            return Ok(false);
        };
        if (staging.in_at, staging.out_at) != (inputs, outputs) {
            // The plan counted the body's bytes: a mismatch is ours.
            return Err(DeviceError::new(
                Status::Internal,
                format!(
                    "prepared body {graph}: {} bytes uploaded and {} downloaded, {inputs} and \
                     {outputs} counted",
                    staging.in_at, staging.out_at
                ),
            ));
        }
        let prepared = PreparedGraph {
            graph: captured,
            input,
            output,
            inputs,
            outputs,
            busy: Cell::new(false),
        };
        self.staged += prepared.bytes();
        self.prepared
            .entry(graph)
            .or_default()
            .push(Rc::new(prepared));
        Ok(true)
    }

    /// During a prepared body's capture: the copy of `len` bytes between
    /// buffer `id` at `start` and the next bytes of the staging (out of the
    /// buffer into the output staging for a `download`, else into it from
    /// the input staging). `None` outside one.
    pub(super) fn copy_staged(
        &mut self,
        sid: StreamId,
        id: Id,
        (start, len): (usize, usize),
        download: bool,
    ) -> Option<Result<(), DeviceError>> {
        let staging = self.staging.as_mut()?;
        let (cursor, host) = if download {
            (&mut staging.out_at, &staging.output)
        } else {
            (&mut staging.in_at, &staging.input)
        };
        let at = *cursor;
        *cursor += len;
        let host = host.clone();
        Some(self.staged_copy(sid, id, &host, at, start, len, download))
    }

    /// A captured copy between `host[at..at + len]` and buffer `id`'s
    /// `[start..start + len]` (range-checked by the caller): into the host
    /// memory when `download`.
    #[allow(clippy::too_many_arguments)]
    fn staged_copy(
        &mut self,
        sid: StreamId,
        id: Id,
        host: &SharedPinnedBuffer<u8>,
        at: usize,
        start: usize,
        len: usize,
        download: bool,
    ) -> Result<(), DeviceError> {
        if at.checked_add(len).is_none_or(|end| end > host.len()) {
            return Err(DeviceError::new(
                Status::Internal,
                "a prepared body copies more bytes than were counted",
            ));
        }
        let stream = self.stream(sid)?;
        self.use_on(id, sid, &stream)?;
        let buf = Self::raw_mut(
            self.buffers
                .get_mut(&id)
                .ok_or_else(|| not_found("buffer", id))?,
        );
        let (what, st) = if download {
            ("cuMemcpyDtoHAsync", Status::ReadFailed)
        } else {
            ("cuMemcpyHtoDAsync", Status::Internal)
        };
        let copy = |ptr: *mut u8| {
            // SAFETY: `ptr + at` addresses `len` bytes of `host` (checked
            // above), which the capture keeps with the graph and which the
            // host reaches only through the buffer's gate after the
            // replays' copies; `dptr + start` as many inside `buf` (the
            // caller checked the range), ordered as a use of it
            // (`use_on`); the capture's stream is live.
            unsafe {
                let ptr = ptr.add(at);
                if download {
                    let (dptr, _read) = buf.as_cuda_slice().device_ptr(&stream);
                    cuda_core::copy::dtoh_async(ptr, dptr + start as u64, len, &stream)
                } else {
                    let (dptr, _write) = buf.as_cuda_slice_mut().device_ptr_mut(&stream);
                    cuda_core::copy::htod_async(dptr + start as u64, ptr, len, &stream)
                }
            }
        };
        // SAFETY: the copy accesses `len` bytes of the host memory on
        // `stream` only, writing them only for a download.
        unsafe { host.enqueue_use(&stream, download, copy) }.map_err(|e| map(st, what, e))
    }

    /// Runs prepared body `graph` natively (see `LeaseDevice::run_prepared`).
    pub(super) fn run_staged(
        &mut self,
        sid: StreamId,
        graph: Id,
        inputs: &[u8],
        at: usize,
    ) -> Result<bool, DeviceError> {
        let Some(instances) = self.prepared.get(&graph) else {
            return Ok(false);
        };
        // A free instance, if any (each is busy until its run's outputs
        // are copied out).
        let Some(p) = instances.iter().find(|p| !p.busy.get()).cloned() else {
            return Ok(false);
        };
        if inputs.len() != p.inputs {
            return Err(DeviceError::new(
                Status::BadRequest,
                format!(
                    "prepared submission {graph} takes {} bytes of inputs, not {}",
                    p.inputs,
                    inputs.len()
                ),
            ));
        }
        let stream = self.stream(sid)?;
        p.busy.set(true);
        // (Waits for nothing: the last run's batch is done.)
        p.input
            .write(|host| host[..inputs.len()].copy_from_slice(inputs))
            .map_err(|e| map(Status::Internal, "staging a prepared run's inputs", e))?;
        // Pending uses elsewhere are recorded, so the replay waits for them.
        self.flush_elsewhere(sid)?;
        p.graph
            .launch_on(&stream)
            .map_err(|e| map(Status::LaunchFailed, "cuGraphLaunch", e))?;
        self.prepared_reads.push((p, at));
        Ok(true)
    }
}

/// What an instance's staging holds, in bytes (at least one each way).
fn staged_bytes(inputs: usize, outputs: usize) -> usize {
    inputs.max(1).saturating_add(outputs.max(1))
}

impl PreparedGraph {
    fn bytes(&self) -> usize {
        staged_bytes(self.inputs, self.outputs)
    }
}

/// Copies done runs' outputs to their places in the reply's data, and
/// frees their bodies for the next run.
pub(super) fn prepared_reads_into(
    out: &mut [u8],
    reads: Vec<PreparedRead>,
) -> Result<(), DeviceError> {
    for (p, at) in reads {
        // (Waits for nothing: the batch is done.)
        p.output
            .read(|host| {
                if let Some(dst) = out.get_mut(at..at + p.outputs) {
                    dst.copy_from_slice(&host[..p.outputs]);
                }
            })
            .map_err(|e| map(Status::ReadFailed, "device-to-host copy", e))?;
        p.busy.set(false);
    }
    Ok(())
}
