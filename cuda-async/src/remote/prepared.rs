//! Prepared submissions: an op recorded once and kept on a remote session's
//! node as its checked commands, then run again by id with new bytes for
//! its uploads, its downloads coming back in each run's reply.
//!
//! The body is kept as a graph's is (its allocations made once and held,
//! its frees run when the prepared submission is dropped), but its commands
//! run one by one, so it may download; neither the client nor the node
//! records, encodes or checks them again at a run.

use std::fmt;
use std::sync::Arc;

use cuda_core::{AnyBitPattern, Error, Result};

use super::graph::{capture, Io, RemoteGraph};
use crate::buffer::{same_session, wrong_home};
use crate::context::ExecutionContext;
use crate::host::ReadSlot;
use crate::memory::as_bytes;
use crate::op::DeviceOp;

/// The op [`DeviceOpExt::prepare`](crate::DeviceOpExt::prepare) returns:
/// records its op as a prepared submission on the remote session it is
/// scheduled on.
#[must_use = "an op does nothing until it is run"]
pub struct Prepare<O> {
    pub(crate) op: O,
}

impl<O: DeviceOp> DeviceOp for Prepare<O> {
    type Output = Prepared;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<Prepared> {
        // The op's output is dropped in the body: its buffers live, and are
        // freed, with the prepared submission.
        // SAFETY: the caller's contract, forwarded.
        let ((), graph, io) = unsafe { capture(self.op, ctx, true, drop) }?;
        Ok(Prepared {
            kept: Arc::new(Kept { graph, io }),
        })
    }
}

crate::op::impl_into_future!(impl[O] for Prepare<O> where O: DeviceOp);

impl<O> fmt::Debug for Prepare<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prepare")
            .field("op", &std::any::type_name::<O>())
            .finish()
    }
}

/// A submission kept on a remote session's node: run it with
/// [`Prepared::run`], any number of times; dropping it frees it there
/// (after the runs submitted before) with the buffers its body made.
///
/// Its *inputs* are the bytes of its body's uploads (`h2d`, `copy_h2d`,
/// in the order they were recorded), given anew at each run; its
/// *outputs* are the bytes of its body's downloads (`d2h`, in order),
/// returned by each run as [`Outputs`]. The uploads' bytes recorded when it
/// was prepared are sent once and not kept.
///
/// # Examples
///
/// ```no_run
/// # fn f(remote: &cuda_async::RemotePolicy, k: cuda_async::Kernel) -> cuda_async::Result<()> {
/// use cuda_async::prelude::*;
/// use cuda_async::LaunchConfig;
/// let n = 1024u32;
/// // SAFETY: the kernel touches x[0..n) of an n-element buffer.
/// let scale = h2d(vec![0f32; n as usize])
///     .then(move |x| unsafe { launch(&k, LaunchConfig::for_num_elems(n), (x, 2.0f32, n)) })
///     .then(|(x, _, _)| d2h(x))
///     .prepare()
///     .sync_with(remote)?;
/// for i in 0..10 {
///     let input = vec![i as f32; n as usize];
///     let out = scale.run(&[&input[..]])?.sync_with(remote)?;
///     let y: Vec<f32> = out.to_vec(0)?;
/// }
/// # Ok(()) }
/// ```
pub struct Prepared {
    kept: Arc<Kept>,
}

/// What a prepared submission and its runs in flight share: the node frees
/// it once the last of them is gone.
struct Kept {
    graph: RemoteGraph,
    io: Io,
}

impl fmt::Debug for Prepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prepared")
            .field("graph", &self.kept.graph)
            .field("inputs", &self.kept.io.inputs)
            .field("outputs", &self.kept.io.outputs)
            .finish()
    }
}

impl Prepared {
    /// The byte length of each input (each upload of the body, in order).
    pub fn inputs(&self) -> &[u64] {
        &self.kept.io.inputs
    }

    /// The byte length of each output (each download of the body, in order).
    pub fn outputs(&self) -> &[u64] {
        &self.kept.io.outputs
    }

    /// Commands kept in the body (allocations and frees not counted).
    pub fn commands(&self) -> usize {
        self.kept.graph.commands
    }

    /// The op that runs it once with `inputs`, one slice per input; run it on
    /// a policy of the session it was prepared on. Its output is the run's
    /// [`Outputs`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `inputs` are not one slice of each
    /// input's length, in bytes, in order.
    pub fn run<T: AnyBitPattern>(&self, inputs: &[&[T]]) -> Result<Run> {
        let want = &self.kept.io.inputs;
        let given: Vec<u64> = inputs.iter().map(|i| size_of_val(*i) as u64).collect();
        if given != *want {
            return Err(Error::InvalidArgument(format!(
                "a prepared submission takes inputs of {want:?} bytes; given {given:?}"
            )));
        }
        let mut data = Vec::with_capacity(want.iter().sum::<u64>() as usize);
        for i in inputs {
            data.extend_from_slice(as_bytes(i));
        }
        Ok(Run {
            kept: self.kept.clone(),
            data,
        })
    }
}

/// One run of a [`Prepared`] submission (see [`Prepared::run`]).
#[must_use = "an op does nothing until it is run"]
pub struct Run {
    kept: Arc<Kept>,
    data: Vec<u8>,
}

impl DeviceOp for Run {
    type Output = Outputs;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<Outputs> {
        let graph = &self.kept.graph;
        let Some(r) = ctx
            .as_remote()
            .filter(|r| same_session(&graph.session, r.session()))
        else {
            let what = format!("a prepared submission of {}", graph.session.describe());
            return Err(wrong_home(what, &ctx.describe()));
        };
        let lens = self.kept.io.outputs.clone();
        let total = lens.iter().sum();
        let stream = r.stream();
        let slot = r.recording().run(stream, graph.id, &self.data, total);
        // Freed on the node only after this run.
        let kept = self.kept;
        r.on_reply(move || drop(kept));
        Ok(Outputs { slot, lens })
    }
}

crate::op::impl_into_future!(Run);

impl fmt::Debug for Run {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Run")
            .field("prepared", &self.kept.graph.id)
            .field("input_bytes", &self.data.len())
            .finish()
    }
}

/// The bytes a run of a [`Prepared`] submission downloaded: one output per
/// download of its body, in order.
pub struct Outputs {
    slot: Arc<ReadSlot>,
    lens: Vec<u64>,
}

impl fmt::Debug for Outputs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outputs").field("lens", &self.lens).finish()
    }
}

impl Outputs {
    /// How many outputs.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// True when the body downloads nothing.
    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    /// Output `i`'s bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there is no output `i`, or the run's
    /// reply did not arrive.
    pub fn bytes(&self, i: usize) -> Result<&[u8]> {
        let Some(&len) = self.lens.get(i) else {
            return Err(Error::InvalidArgument(format!(
                "output {i} of a prepared run with {}",
                self.lens.len()
            )));
        };
        let start: u64 = self.lens[..i].iter().sum();
        let all = self.slot.bytes().ok_or_else(|| {
            Error::InvalidArgument("the prepared run's reply did not arrive".into())
        })?;
        Ok(&all[start as usize..(start + len) as usize])
    }

    /// Output `i` as `T`s.
    ///
    /// # Errors
    ///
    /// As [`Outputs::bytes`], and [`Error::InvalidArgument`] when its length
    /// is not a whole number of `T`s.
    pub fn to_vec<T: AnyBitPattern>(&self, i: usize) -> Result<Vec<T>> {
        let bytes = self.bytes(i)?;
        let size = size_of::<T>();
        if size == 0 || !bytes.len().is_multiple_of(size) {
            return Err(Error::InvalidArgument(format!(
                "output {i} of {} bytes is not a whole number of {}",
                bytes.len(),
                std::any::type_name::<T>()
            )));
        }
        let n = bytes.len() / size;
        let mut v = Vec::<T>::with_capacity(n);
        // SAFETY: `v` has room for `n` `T`s (`n * size` bytes, those of
        // `bytes`, another allocation); any bit pattern is a `T`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr().cast::<u8>(), bytes.len());
            v.set_len(n);
        }
        Ok(v)
    }
}
