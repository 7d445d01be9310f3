//! [`Recorder`]: the batch being recorded, and [`Submitted`]: its reply and
//! the bytes of its reads.

use std::sync::Arc;

use super::lease::LeaseInner;
use super::{Error, Message, ModuleSpec};
use crate::proto::{Command, Id, LaunchArg, LaunchSpec, Op, OpError, Operand, StreamId};

/// A read recorded in a [`Recorder`]: where its bytes are in the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordedRead {
    command: usize,
    len: u64,
}

/// Records commands on client-named streams of a lease and sends them as
/// one BATCH: one round trip for the whole pipeline. Ids are picked here
/// (the lease's counter), so a command can name what an earlier command of
/// this or an earlier submission made without waiting for a reply, and a
/// second recording can be sent before the first one's reply is back.
///
/// ```no_run
/// # async fn demo(session: cuda_lease::Session) -> Result<(), cuda_lease::Error> {
/// use cuda_lease::client::ModuleSpec;
/// use cuda_lease::proto::LaunchArg;
/// let module = ModuleSpec::cuda(
///     r#"extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
///         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
///         if (i < n) y[i] = a * x[i] + y[i];
///     }"#,
///     &[],
/// );
/// let x: Vec<u8> = [1.0f32; 256].iter().flat_map(|v| v.to_le_bytes()).collect();
/// let mut rec = session.recorder();
/// let (bx, by) = (rec.alloc(0, 1024), rec.alloc(1, 1024));
/// rec.write(0, bx, 0, &x);
/// let ready = rec.record(0); // stream 1 waits for stream 0's upload
/// rec.wait(1, ready);
/// rec.launch(1, &module, "axpy", [1, 1, 1], [256, 1, 1], vec![
///     LaunchArg::f32(2.0), LaunchArg::mem(bx), LaunchArg::mem(by), LaunchArg::u32(256),
/// ]);
/// let y = rec.read(1, by, 0, 1024);
/// let reply = rec.submit().await?.ok()?;
/// assert_eq!(reply.read(y).unwrap()[..4], 2.0f32.to_le_bytes());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Recorder {
    pub(super) inner: Arc<LeaseInner>,
    pub(super) modules: Vec<ModuleSpec>,
    pub(super) commands: Vec<Command<'static>>,
    pub(super) writes: Vec<u8>,
}

impl Recorder {
    /// A fresh id of this lease (for [`Op::Alloc`] or a first
    /// [`Op::Record`] pushed by hand).
    pub fn fresh_id(&self) -> Id {
        self.inner.fresh_id()
    }

    /// Allocates `size` zeroed bytes; the id names the buffer from now on
    /// (it is not freed by itself: record [`Recorder::free`]).
    pub fn alloc(&mut self, stream: StreamId, size: u64) -> Id {
        let buf = self.fresh_id();
        self.command(stream, Op::Alloc { buf, size });
        buf
    }

    /// Writes `bytes` into `buf` at `offset` (copied into the message now).
    pub fn write(&mut self, stream: StreamId, buf: Id, offset: u64, bytes: &[u8]) -> &mut Self {
        self.writes.extend_from_slice(bytes);
        let len = bytes.len() as u64;
        self.command(stream, Op::Write { buf, offset, len })
    }

    /// Reads `len` bytes of `buf` at `offset`; the bytes are in the reply
    /// ([`Submitted::read`]).
    pub fn read(&mut self, stream: StreamId, buf: Id, offset: u64, len: u32) -> RecordedRead {
        let len = u64::from(len);
        self.command(stream, Op::Read { buf, offset, len });
        RecordedRead {
            command: self.commands.len() - 1,
            len,
        }
    }

    /// Frees a buffer (after every queued use of it) or an event.
    pub fn free(&mut self, stream: StreamId, id: Id) -> &mut Self {
        self.command(stream, Op::Free { id })
    }

    /// Launches `kernel` of `module`; the module's source goes with this
    /// message if the node may not have it.
    pub fn launch(
        &mut self,
        stream: StreamId,
        module: &ModuleSpec,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: Vec<LaunchArg<'static>>,
    ) -> &mut Self {
        self.launch_spec(
            stream,
            module,
            LaunchSpec {
                module: module.hash(),
                kernel: kernel.to_owned().into(),
                grid,
                block,
                shared_mem: 0,
                args,
            },
        )
    }

    /// Launches with a full [`LaunchSpec`] (its `module` is set from
    /// `module`).
    pub fn launch_spec(
        &mut self,
        stream: StreamId,
        module: &ModuleSpec,
        mut spec: LaunchSpec<'static>,
    ) -> &mut Self {
        spec.module = module.hash();
        self.use_module(module);
        self.command(stream, Op::Launch(spec))
    }

    /// Lists `module` in the message (a launch does this itself; alone, it
    /// loads the module, so a bad one fails now with its log).
    pub fn use_module(&mut self, module: &ModuleSpec) -> &mut Self {
        if !self.modules.iter().any(|m| m.hash() == module.hash()) {
            self.modules.push(module.clone());
        }
        self
    }

    /// Sets `len` bytes of `buf` at `offset` to `value`.
    pub fn fill(
        &mut self,
        stream: StreamId,
        buf: Id,
        offset: u64,
        len: u64,
        value: u8,
    ) -> &mut Self {
        self.command(
            stream,
            Op::Fill {
                buf,
                offset,
                len,
                value,
            },
        )
    }

    /// Copies `len` bytes from `src` (a buffer and a byte offset) to
    /// another buffer's `dst`.
    pub fn copy(
        &mut self,
        stream: StreamId,
        (src, src_at): (Id, u64),
        (dst, dst_at): (Id, u64),
        len: u64,
    ) -> &mut Self {
        let (src, dst) = (Operand::new(src, src_at), Operand::new(dst, dst_at));
        self.command(stream, Op::Copy { src, dst, len })
    }

    /// Records a new event on `stream` and returns it.
    pub fn record(&mut self, stream: StreamId) -> Id {
        let event = self.fresh_id();
        self.command(stream, Op::Record { event });
        event
    }

    /// Makes `stream` wait for the last record of `event`.
    pub fn wait(&mut self, stream: StreamId, event: Id) -> &mut Self {
        self.command(stream, Op::Wait { event })
    }

    /// Begins recording graph (returned) on `stream`: the commands recorded
    /// next, up to [`Recorder::graph_end`], are its body (see
    /// [`Op::GraphBegin`]): its allocations are made now, the rest runs at
    /// each [`Recorder::graph_launch`].
    pub fn graph_begin(&mut self, stream: StreamId) -> Id {
        let graph = self.fresh_id();
        self.command(stream, Op::GraphBegin { graph });
        graph
    }

    /// Ends the body of `graph`.
    pub fn graph_end(&mut self, stream: StreamId, graph: Id) -> &mut Self {
        self.command(stream, Op::GraphEnd { graph })
    }

    /// Replays `graph` on `stream`.
    pub fn graph_launch(&mut self, stream: StreamId, graph: Id) -> &mut Self {
        self.command(stream, Op::GraphLaunch { graph })
    }

    /// Begins recording a prepared submission (returned) on `stream`: the
    /// commands recorded next, up to [`Recorder::graph_end`], are its body
    /// (see [`Op::PrepareBegin`]): its allocations are made now, the rest
    /// runs at each [`Recorder::run`], its reads then.
    pub fn prepare_begin(&mut self, stream: StreamId) -> Id {
        let prepared = self.fresh_id();
        self.command(stream, Op::PrepareBegin { prepared });
        prepared
    }

    /// Runs `prepared` on `stream` with `inputs`, the bytes of its body's
    /// writes back to back (copied into the message now); its body's
    /// reads, `outputs` bytes back to back, are one read of the reply.
    pub fn run(
        &mut self,
        stream: StreamId,
        prepared: Id,
        inputs: &[u8],
        outputs: u64,
    ) -> RecordedRead {
        self.writes.extend_from_slice(inputs);
        let inputs = inputs.len() as u64;
        self.command(
            stream,
            Op::Run {
                prepared,
                inputs,
                outputs,
            },
        );
        RecordedRead {
            command: self.commands.len() - 1,
            len: outputs,
        }
    }

    /// Appends a command built by hand.
    pub fn command(&mut self, stream: StreamId, op: Op<'static>) -> &mut Self {
        self.commands.push(Command { stream, op });
        self
    }

    /// The reads recorded so far (timers' ends and runs of prepared
    /// submissions among them; a prepared body's reads return nothing
    /// until it runs), in order.
    pub fn reads(&self) -> Vec<RecordedRead> {
        crate::proto::replying_now(&self.commands)
            .filter(|(_, c)| matches!(c.op, Op::Read { .. } | Op::TimerEnd { .. } | Op::Run { .. }))
            .map(|(i, c)| RecordedRead {
                command: i,
                len: c.op.reply_len(),
            })
            .collect()
    }

    /// Commands recorded so far.
    pub fn len(&self) -> usize {
        self.commands.len()
    }

    /// True when nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty() && self.modules.is_empty()
    }

    /// Sends everything recorded as one message; the future resolves with
    /// the node's reply once every command ran (or one failed). The
    /// message is built and numbered when this is called (the recorder may
    /// be changed or submitted again afterwards): the node runs a lease's
    /// submissions in the order of these calls, so a second recording may
    /// be sent before this one's reply arrives and name what it creates.
    /// A submission dropped before its answer leaves its place in the
    /// order to an empty batch, so the lease's later ones do not wait for
    /// it.
    ///
    /// A module the client believes the node has travels without its
    /// source; if the node answers UNKNOWN_MODULE (nothing ran), the
    /// message is sent once more with every source.
    ///
    /// # Errors
    ///
    /// Errors of the request itself (lease gone, disconnected, malformed).
    /// A failing command is not an error here: see [`Submitted::ok`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after its first poll abandons the reply; the
    /// node runs the batch anyway. (On a client with
    /// [`ClientConfig::busy_poll`](super::ClientConfig::busy_poll), the
    /// reply is still read, on the client's endpoint thread, and dropped.)
    pub fn submit(
        &self,
    ) -> impl std::future::Future<Output = Result<Submitted, Error>> + Send + 'static {
        let client = &self.inner.client;
        // In flight from here (a busy poller wakes while the message is
        // encoded), until the exchange counts itself.
        let early = client.busy.enter();
        let message = self.numbered();
        let reads = self.reads();
        let request = async move {
            let (reply, data) = message.send(None).await?;
            Ok(Submitted {
                completed: reply.completed as usize,
                error: reply.error,
                reads,
                data,
            })
        };
        // Counted by the exchange from here on.
        let submitted = client.on_io(request);
        drop(early);
        submitted
    }

    /// [`Recorder::submit`], with the reads received straight into `dests`
    /// (one per read, in order, each exactly its read's length) instead of
    /// the reply's own buffer: no copy on the client. The destinations come
    /// back with the reply; those of reads that did not run are untouched.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidRequest`](crate::client::ErrorKind::InvalidRequest) when `dests` do not match the reads; the rest
    /// as [`Recorder::submit`].
    pub fn submit_into<D>(
        &self,
        mut dests: Vec<D>,
    ) -> impl std::future::Future<Output = Result<(Submitted, Vec<D>), Error>> + Send + 'static
    where
        D: AsMut<[u8]> + Send + 'static,
    {
        let client = &self.inner.client;
        // As in `submit`: in flight from here.
        let early = client.busy.enter();
        let reads = self.reads();
        let shape_ok = reads.len() == dests.len()
            && reads
                .iter()
                .zip(dests.iter_mut())
                .all(|(r, d)| d.as_mut().len() == r.len as usize);
        let request = self.numbered().send_into(shape_ok.then_some(reads), dests);
        let submitted = client.on_io(request);
        drop(early);
        submitted
    }

    /// The message, numbered now: the node runs the lease's batches in the
    /// order of these calls, whatever order they are polled or arrive in.
    fn numbered(&self) -> Message {
        Message::new(
            &self.inner,
            true,
            &self.modules,
            &[],
            &self.commands[..],
            self.writes.clone(),
        )
    }
}

/// The reply to a [`Recorder::submit`].
#[derive(Debug, Clone)]
pub struct Submitted {
    pub(super) completed: usize,
    pub(super) error: Option<OpError>,
    pub(super) reads: Vec<RecordedRead>,
    pub(super) data: Vec<u8>,
}

impl Submitted {
    /// Commands that ran, in order (`0..completed`): what they created
    /// stays valid even when a later command failed.
    pub fn completed(&self) -> usize {
        self.completed
    }

    /// The command that stopped the batch: its index, status and message.
    pub fn error(&self) -> Option<&OpError> {
        self.error.as_ref()
    }

    /// `Ok(self)` when every command ran, else the failing command's error
    /// (its message names its index).
    ///
    /// # Errors
    ///
    /// The error of the command that stopped the batch.
    pub fn ok(self) -> Result<Self, Error> {
        match &self.error {
            Some(e) => Err(super::error::from_status(e.status, e.message.clone())),
            None => Ok(self),
        }
    }

    /// The bytes of a read, if its command ran (they were received
    /// straight into the reply's one buffer: no copy here).
    pub fn read(&self, slot: RecordedRead) -> Option<&[u8]> {
        if slot.command >= self.completed {
            return None;
        }
        let mut start = 0usize;
        for r in &self.reads {
            if r.command >= self.completed {
                return None;
            }
            let end = start + r.len as usize;
            if *r == slot {
                return self.data.get(start..end);
            }
            start = end;
        }
        None
    }
}
