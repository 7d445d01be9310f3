//! What the CUDA libraries' ops share (features `blas`, `rand`, `fft`): a
//! library handle kept per stream (and per key, for a library with one
//! handle per shape of call), made on the stream's first use with the
//! thread's capture mode relaxed, and the library errors.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;

use crate::tracking::{keep_with_graph, search_kept};
use crate::{Error, Result};

/// Handles of one library, one per (context, stream, key), kept for the
/// process's life: destroying a library handle synchronizes the device,
/// and run on a background thread it made the process crash at exit under
/// compute-sanitizer. `K` tells apart the handles of one stream (a cuFFT
/// plan per transform shape); a library with one handle per stream keeps
/// `()`. A handle made while its stream is captured into a graph is kept
/// by the graph instead (see [`PerStream::get_keyed`]); it is not destroyed
/// either.
#[derive(Debug)]
pub(crate) struct PerStream<H, K = ()> {
    kept: Mutex<Kept<H, K>>,
}

/// The handles by (context, stream, key).
type Kept<H, K> = HashMap<(usize, usize, K), Arc<Mutex<H>>>;

#[cfg(any(feature = "blas", feature = "rand"))]
impl<H: Send + 'static> PerStream<H> {
    /// The handle of `stream`: [`PerStream::get_keyed`] with no key.
    pub(crate) fn get(
        &self,
        stream: &CudaStream,
        make: impl FnOnce() -> Result<H>,
    ) -> Result<Arc<Mutex<H>>> {
        self.get_keyed(stream, (), make)
    }
}

impl<H: Send + 'static, K: Eq + Hash + Send + 'static> PerStream<H, K> {
    pub(crate) fn new() -> Self {
        Self {
            kept: Mutex::new(HashMap::new()),
        }
    }

    /// The handle of `stream` for `key`, or a new one from `make` (run with
    /// the stream's context current and the thread's capture mode relaxed,
    /// so that a handle is made also while the stream is being captured
    /// into a graph), kept for later calls on that stream with that key.
    pub(crate) fn get_keyed(
        &self,
        stream: &CudaStream,
        key: K,
        make: impl FnOnce() -> Result<H>,
    ) -> Result<Arc<Mutex<H>>> {
        // A capture's stream: its handle is kept by the graph (the replays
        // use its workspace) and never enters the cache, where a stream
        // made later at the same address would find it and share that
        // workspace with the replays.
        let raw = stream.cu_stream() as usize;
        let captured = search_kept(stream, |kept| {
            kept.iter().find_map(|v| {
                v.downcast_ref::<Captured<H, K>>()
                    .filter(|c| c.stream == raw && c.key == key)
                    .map(|c| c.handle.clone())
            })
        });
        match captured {
            Some(Some(h)) => return Ok(h),
            Some(None) => {
                let h = made(stream, make)?;
                let kept = Captured {
                    stream: raw,
                    key,
                    handle: h.clone(),
                };
                if keep_with_graph(stream, kept).is_err() {
                    return Err(Error::Capture(
                        "a library handle made for a capture could not be kept with its graph"
                            .into(),
                    ));
                }
                return Ok(h);
            }
            None => {}
        }
        let key = (
            stream.context().cu_ctx() as usize,
            stream.cu_stream() as usize,
            key,
        );
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = kept.get(&key) {
            return Ok(h.clone());
        }
        let h = made(stream, make)?;
        kept.insert(key, h.clone());
        Ok(h)
    }
}

/// A handle made for a capture, kept by its graph: for one of the
/// capture's streams and one key.
struct Captured<H, K> {
    stream: usize,
    key: K,
    handle: Arc<Mutex<H>>,
}

/// A new handle from `make`, run with `stream`'s context current and the
/// thread's capture mode relaxed.
fn made<H>(stream: &CudaStream, make: impl FnOnce() -> Result<H>) -> Result<Arc<Mutex<H>>> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| Error::driver("cuCtxSetCurrent", e))?;
    Ok(Arc::new(Mutex::new(relaxed(make)??)))
}

/// Runs `f` with this thread's stream-capture mode relaxed (and restores
/// it): a library allocates a handle's workspace when it makes it, which a
/// thread capturing a graph may not do otherwise.
fn relaxed<R>(f: impl FnOnce() -> R) -> Result<R> {
    use cudarc::driver::sys as driver;
    let mut mode = driver::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: exchanges this thread's mode through a valid pointer.
    unsafe { driver::cuThreadExchangeStreamCaptureMode(&mut mode) }
        .result()
        .map_err(|e| Error::driver("cuThreadExchangeStreamCaptureMode", e))?;
    let r = f();
    // SAFETY: as above; puts the thread's own mode back.
    let _ = unsafe { driver::cuThreadExchangeStreamCaptureMode(&mut mode) };
    Ok(r)
}

/// A library call's failure status as an [`Error`].
pub(crate) fn failed(call: &'static str, status: impl std::fmt::Debug) -> Error {
    Error::Library {
        call,
        status: format!("{status:?}"),
    }
}
