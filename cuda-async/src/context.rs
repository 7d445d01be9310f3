//! [`ExecutionContext`]: what an op is executed against.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use cuda_core::cudarc::driver::CudaStream;
use cuda_core::{Device, Result};

use crate::policy::StreamPool;
use crate::reactor::{CompletionMode, StreamSlot};

/// What an op executes against: a device, a stream on it, and the pool that
/// concurrent combinators fork onto. Ops enqueue their work on the stream;
/// whatever must outlive that work is handed to [`ExecutionContext::retain`].
///
/// Today every context is a local CUDA stream. The type is built so that a
/// stream of a remote leased GPU can become a second backend: ops reach the
/// CUDA stream only through [`ExecutionContext::cuda_stream`], which will
/// return an error for a remote context, so local-only ops fail cleanly.
pub struct ExecutionContext {
    device: Device,
    stream: Arc<CudaStream>,
    pool: Arc<StreamPool>,
    retained: Vec<Box<dyn Any + Send>>,
    completion: CompletionMode,
    slot: Option<Arc<StreamSlot>>,
}

impl fmt::Debug for ExecutionContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutionContext")
            .field("device", &self.device.ordinal())
            .field("stream", &self.stream.cu_stream())
            .field("retained", &self.retained.len())
            .finish()
    }
}

impl ExecutionContext {
    pub(crate) fn new(device: Device, stream: Arc<CudaStream>, pool: Arc<StreamPool>) -> Self {
        ExecutionContext {
            device,
            stream,
            pool,
            retained: Vec::new(),
            completion: CompletionMode::HostCallback,
            slot: None,
        }
    }

    /// Sets how a future on this context learns of completion (the reactor
    /// needs the stream's slot; without one, the host callback is used).
    pub(crate) fn with_completion(
        mut self,
        mode: CompletionMode,
        slot: Option<Arc<StreamSlot>>,
    ) -> Self {
        match (mode.uses_reactor(), slot) {
            (true, Some(slot)) => {
                self.completion = mode;
                self.slot = Some(slot);
            }
            _ => {
                self.completion = CompletionMode::HostCallback;
                self.slot = None;
            }
        }
        self
    }

    /// How a future on this context learns that its work is done.
    pub fn completion_mode(&self) -> CompletionMode {
        self.completion
    }

    pub(crate) fn slot(&self) -> Option<&Arc<StreamSlot>> {
        self.slot.as_ref()
    }

    /// A context on a stream that other code created (interop), forking
    /// concurrent arms onto the device's default pool.
    ///
    /// # Errors
    /// As [`StreamPool::default_for`].
    pub fn on_stream(stream: &Arc<CudaStream>) -> Result<Self> {
        let device = Device::of_stream(stream);
        let pool = StreamPool::default_for(&device)?;
        Ok(Self::new(device, stream.clone(), pool))
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The local CUDA stream work is enqueued on.
    ///
    /// # Errors
    /// Never for a local context; a remote context (a later backend) will
    /// return an error here, so ops that need a CUDA stream fail cleanly.
    pub fn cuda_stream(&self) -> Result<&Arc<CudaStream>> {
        Ok(&self.stream)
    }

    /// The pool concurrent combinators fork onto.
    pub fn pool(&self) -> &Arc<StreamPool> {
        &self.pool
    }

    /// Keeps `value` alive until the GPU has passed everything enqueued in
    /// this submission (kernel modules, staging buffers...).
    pub fn retain(&mut self, value: impl Any + Send) {
        self.retained.push(Box::new(value));
    }

    /// A context on another stream of the same pool, for a concurrent arm.
    pub(crate) fn fork(&self, stream: Arc<CudaStream>) -> Self {
        Self::new(self.device.clone(), stream, self.pool.clone())
    }

    /// Moves a finished arm's retained values into this context.
    pub(crate) fn absorb(&mut self, mut other: ExecutionContext) {
        self.retained.append(&mut other.retained);
    }

    pub(crate) fn take_retained(&mut self) -> Retained {
        Retained(std::mem::take(&mut self.retained))
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// What a submission keeps alive until the GPU has passed it.
#[derive(Default)]
pub(crate) struct Retained(Vec<Box<dyn Any + Send>>);

impl fmt::Debug for Retained {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Retained({})", self.0.len())
    }
}

impl Retained {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
