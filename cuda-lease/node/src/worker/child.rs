//! The worker process: opens its device, then serves the node's requests
//! from its stdin (batches, streamed chunks, GPU_SUBMIT).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::direct::{Answer, DirectLink, DirectOpen, DirectPort, ToDevice};
use super::enqueue::{enqueue, Payload};
use super::graphs::Graphs;
use super::lease::{Planned, WorkerLease};
use super::messages::{
    ChunkOps, HeldRead, WorkerBatch, WorkerBatchReply, FLAG_AFTER, FLAG_HELD, FLAG_STAMPS,
    HELD_MIN, MAX_CHUNKS_PER_CALL,
};
use super::{DeviceSpec, SPIN_ENV, WORKER_ENV, WORKER_LIMITS};
use crate::device::{CudaDevice, DeviceError, LeaseDevice, MemoryDevice, Ticket};
use crate::proto::{
    self, from_body, to_body, CommandSpares, Frame, GpuSubmit, Header, Id, LaunchArg, LaunchSpec,
    ModuleHash, Op, OpError, Opcode, SourceKind, Status,
};
use crate::sandbox::{CompileSandbox, Compiler};
use crate::shm::{WorkerRing, SHM_ENV};
use crate::stamps::now_ns;

pub(super) fn run_worker(spec: &str) -> i32 {
    // The node's shared ring for streamed transfers (absent: they fail),
    // mapped before we report ready: the node removes its file then.
    let mut ring = std::env::var_os(SHM_ENV).map(|p| WorkerRing::open(std::path::Path::new(&p)));
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let mut input = std::io::BufReader::with_capacity(1 << 20, stdin.lock());
    let mut output = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
    let ready = Header::request(Opcode::GetInventory, 0, 0, 0);
    // Tenants' CUDA C is checked here and compiled in a confined child.
    let compiler = Arc::new(Compiler::new(CompileSandbox::from_env()));
    let device: Result<Box<dyn LeaseDevice>, DeviceError> = match DeviceSpec::parse(spec) {
        Some(DeviceSpec::Cuda { ordinal }) => CudaDevice::open(ordinal).map(|mut d| {
            d.set_compiler(compiler.clone());
            Box::new(d) as Box<dyn LeaseDevice>
        }),
        Some(DeviceSpec::Memory { capacity }) => Ok(Box::new(MemoryDevice::new(capacity))),
        None => Err(DeviceError::new(
            Status::Internal,
            format!("bad {WORKER_ENV} value {spec:?}"),
        )),
    };
    let (status, body, device) = match device.and_then(|mut d| d.info().map(|i| (d, i))) {
        Ok((d, info)) => (Status::Ok, to_body(&info), Some(d)),
        Err(e) => (Status::Internal, to_body(&e), None),
    };
    let h = Header::reply(&ready, status, body.len() as u32, 0);
    let wrote = proto::write_frame_blocking(&mut output, &h, &body, &[]);
    let (Some(mut device), Ok(())) = (device, wrote) else {
        return 1;
    };
    // Chunks copied straight from and to the ring where the device can.
    if let Some(Ok(r)) = &mut ring {
        let (ptr, len) = r.raw_parts();
        // SAFETY: the ring is mapped until this function returns, after
        // `device` (declared later) is dropped.
        unsafe { device.register_ring(ptr, len) };
    }
    let mut submit_modules: HashSet<ModuleHash> = HashSet::new();
    let mut graphs = Graphs::default();
    // Decoded batches' command lists, reused by the next batches.
    let mut spares = CommandSpares::new();
    // The lease this worker serves (a submit worker serves none).
    let mut lease = WorkerLease::default();
    // The node's spin budget (absent: block at once).
    let spin = std::env::var(SPIN_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::ZERO, Duration::from_micros);
    // Sealed batches whose work runs on while the next requests are read.
    let mut running: Vec<Running> = Vec::new();
    // Large replies' data, read by the node as its clients take it.
    let mut held = Held::default();
    // The device's wake-up descriptor, once it has armed one.
    let mut wake = None;
    let stdin_fd = std::os::fd::AsRawFd::as_raw_fd(&std::io::stdin());
    // The lease's direct path, once the node opened it.
    let mut direct: Option<DirectLink> = None;
    loop {
        let Ok(answers) = answer_done(
            device.as_mut(),
            &mut lease,
            &mut running,
            &mut held,
            &mut output,
        ) else {
            return 1;
        };
        if let Some(link) = &direct {
            link.deliver(answers);
            let mut dev = Dev {
                dev: device.as_mut(),
                graphs: &mut graphs,
                compiler: &compiler,
                spares: &mut spares,
            };
            if take_direct(link, &mut dev, &mut lease, &mut running, &mut output).is_err() {
                return 1;
            }
        }
        if input.buffer().is_empty() {
            let mut waits = match &mut direct {
                Some(link) => Waits::Direct(link),
                None => Waits::Pipe(stdin_fd),
            };
            let readable = if running.is_empty() {
                waits.within(spin) || waits.wait()
            } else {
                match wait_for_work(
                    device.as_mut(),
                    &mut lease,
                    &mut running,
                    &mut held,
                    &mut output,
                    &mut waits,
                    spin,
                    &mut wake,
                ) {
                    Ok(readable) => readable,
                    Err(()) => return 1,
                }
            };
            // Only what came on the direct path (or every batch answered).
            if !readable || !waits.pipe_ready() {
                continue;
            }
        }
        // End of file: the node is gone or done with us.
        let Ok(header) = proto::read_header_blocking(&mut input, &WORKER_LIMITS) else {
            return 0;
        };
        let read_at = (header.flags & FLAG_STAMPS != 0).then(now_ns);
        let Ok(frame) = proto::read_rest_blocking(&mut input, header) else {
            return 0;
        };
        if frame.header.flags & FLAG_HELD != 0 {
            if held.read(&mut output, &frame).is_err() {
                return 1;
            }
            continue;
        }
        let (status, body, data) = if frame.header.flags & FLAG_AFTER != 0 {
            // Answered once the direct path has handed over the numbers
            // below it (at once with no direct path: the node orders them).
            match (&direct, from_body::<u64>(&frame.body)) {
                (Some(link), Ok(upto)) => {
                    link.after(frame.header, upto);
                    continue;
                }
                (None, Ok(_)) => (Status::Ok, Vec::new(), Vec::new()),
                (_, Err(e)) => {
                    let e = DeviceError::new(Status::BadRequest, e.to_string());
                    (e.status, to_body(&e), Vec::new())
                }
            }
        } else if frame.header.opcode == Opcode::LeaseQuery {
            // What the lease holds now, and whether a fault ended its
            // context (its batches may not pass the node).
            let served = direct.as_ref().map(DirectLink::served).unwrap_or_default();
            let answer = (
                lease.usage(device.staging_bytes()),
                lease.poisoned.clone(),
                served,
            );
            (Status::Ok, to_body(&answer), Vec::new())
        } else if frame.header.opcode == Opcode::LeaseDirect {
            match open_direct(&mut direct, &frame.body, stdin_fd) {
                Ok(port) => (Status::Ok, to_body(&DirectPort { port }), Vec::new()),
                Err(e) => (e.status, to_body(&e), Vec::new()),
            }
        } else if frame.header.opcode == Opcode::Batch {
            // Planned, enqueued and sealed now, answered when its work is
            // done; refused whole at once.
            let mut dev = Dev {
                dev: device.as_mut(),
                graphs: &mut graphs,
                compiler: &compiler,
                spares: &mut spares,
            };
            match start_batch(&mut dev, &mut lease, &frame, read_at, direct.as_ref()) {
                Ok(r) => {
                    running.push(r);
                    continue;
                }
                Err((status, body)) => (status, body, Vec::new()),
            }
        } else if matches!(frame.header.opcode, Opcode::MemWrite | Opcode::MemRead) {
            // Enqueued and sealed now, answered when the copies are done
            // (the node reuses or sends the ring's slots only then).
            match enqueue_chunks(device.as_mut(), &lease, &mut ring, &frame) {
                Some((status, body)) => (status, body, Vec::new()),
                None => {
                    running.push(Running {
                        request: frame.header,
                        to: ReplyTo::Pipe,
                        ticket: device.seal(0),
                        work: Sealed::Chunks,
                        armed: false,
                        stamps: None,
                    });
                    continue;
                }
            }
        } else {
            serve(device.as_mut(), &mut submit_modules, &frame)
        };
        let h = Header::reply(&frame.header, status, body.len() as u32, data.len() as u32);
        if proto::write_frame_blocking(&mut output, &h, &body, &data).is_err() {
            return 1;
        }
    }
}

/// Opens the lease's direct path (once), which watches the node's `pipe`
/// too; the port it serves on.
fn open_direct(
    direct: &mut Option<DirectLink>,
    body: &[u8],
    pipe: std::os::fd::RawFd,
) -> Result<u16, DeviceError> {
    if direct.is_some() {
        return Err(DeviceError::new(
            Status::BadRequest,
            "the lease's direct path is open already",
        ));
    }
    let open: DirectOpen =
        from_body(body).map_err(|e| DeviceError::new(Status::BadRequest, e.to_string()))?;
    let (link, port) = DirectLink::open(open, pipe)
        .map_err(|e| DeviceError::new(Status::Internal, format!("opening the direct path: {e}")))?;
    *direct = Some(link);
    Ok(port)
}

/// Plans, enqueues and seals a batch (a [`WorkerBatch`] frame): its
/// [`Running`], answered on the pipe when its work is done; `Err`: refused
/// whole, answered now.
///
/// On a lease with a direct path (`link`), a batch that loads modules is
/// enqueued [beside](DirectLink::beside) the path's tasks.
fn start_batch(
    dev: &mut Dev<'_>,
    lease: &mut WorkerLease,
    frame: &Frame,
    read_at: Option<u64>,
    link: Option<&DirectLink>,
) -> Result<Running, (Status, Vec<u8>)> {
    if let Some(why) = &lease.poisoned {
        // A fault on its direct path: the node hears it here first.
        let e = DeviceError::new(Status::LeasePoisoned, format!("lease poisoned: {why}"));
        return Err((e.status, to_body(&e)));
    }
    let batch = WorkerBatch::decode_reusing(&frame.body, dev.spares)
        .map_err(|e| DeviceError::new(Status::BadRequest, e.to_string()));
    let enqueued = batch.and_then(|b| {
        let mut enqueue = || enqueue_batch(dev, lease, &b, &frame.data, read_at.is_some());
        let enqueued = match link {
            Some(link) if !b.loads.is_empty() => link.beside(enqueue),
            _ => enqueue(),
        };
        dev.spares.keep(b.commands);
        enqueued
    });
    match enqueued {
        Ok(enqueued) => {
            let ticket = dev.dev.seal(enqueued.read_at);
            let [planned, launched] = enqueued.at;
            Ok(Running {
                request: frame.header,
                to: ReplyTo::Pipe,
                ticket,
                work: Sealed::Batch(Box::new(enqueued)),
                armed: false,
                stamps: read_at.map(|t| [t, planned, launched, now_ns()]),
            })
        }
        Err(f) => Err((f.status, to_body(&f))),
    }
}

/// Starts what the lease's direct path handed over, in order: its batches
/// (answered on the direct path when done, or now if refused) and its
/// answers to the node's requests. `Err` when the node's pipe broke.
fn take_direct(
    link: &DirectLink,
    dev: &mut Dev<'_>,
    lease: &mut WorkerLease,
    running: &mut Vec<Running>,
    output: &mut impl std::io::Write,
) -> Result<(), ()> {
    for work in link.take() {
        match work {
            ToDevice::Batch {
                body,
                data,
                answer,
                stamps,
            } => {
                let frame = Frame {
                    header: Header::request(Opcode::Batch, 0, 0, 0),
                    body,
                    data,
                };
                match start_batch(dev, lease, &frame, stamps.then(now_ns), Some(link)) {
                    Ok(r) => running.push(Running {
                        to: ReplyTo::Direct(answer),
                        ..r
                    }),
                    Err((status, body)) => {
                        let _ = answer.send(Answer {
                            status,
                            body,
                            data: Vec::new(),
                        });
                    }
                }
            }
            ToDevice::Pipe { request, status } => {
                let h = Header::reply(&request, status, 0, 0);
                proto::write_frame_blocking(output, &h, &[], &[]).map_err(|_| ())?;
            }
        }
    }
    Ok(())
}

/// Batch replies' data kept for the node to read as its clients take it
/// ([`FLAG_HELD`]), by request id.
#[derive(Default)]
struct Held(std::collections::HashMap<u64, Vec<u8>>);

impl Held {
    /// Writes the reply to `request`: with its data, or, past
    /// [`HELD_MIN`], keeping the data here and saying how long it is.
    fn reply(
        &mut self,
        output: &mut impl std::io::Write,
        request: &Header,
        status: Status,
        body: &[u8],
        data: Vec<u8>,
    ) -> std::io::Result<()> {
        let mut h = Header::reply(request, status, body.len() as u32, data.len() as u32);
        if data.len() <= HELD_MIN {
            return proto::write_frame_blocking(output, &h, body, &data);
        }
        h.flags |= FLAG_HELD;
        self.0.insert(request.request_id, data);
        proto::write_frame_blocking(output, &h, body, &[])
    }

    /// Answers a [`HeldRead`] with the part of the held data it asks for
    /// (none if the reply is not held, or the read is past its end).
    fn read(&mut self, output: &mut impl std::io::Write, f: &Frame) -> std::io::Result<()> {
        let r = from_body::<HeldRead>(&f.body).ok();
        let held = r.as_ref().and_then(|r| Some((r, self.0.get(&r.request)?)));
        let (part, done) = match held {
            Some((r, data)) => {
                let start = usize::try_from(r.offset)
                    .unwrap_or(usize::MAX)
                    .min(data.len());
                let end = start.saturating_add(r.len as usize).min(data.len());
                (&data[start..end], r.len == 0 || end == data.len())
            }
            None => (&[][..], true),
        };
        let h = Header::reply(&f.header, Status::Ok, 0, part.len() as u32);
        let written = proto::write_frame_blocking(output, &h, &[], part);
        if let (true, Some(r)) = (done, r) {
            self.0.remove(&r.request);
        }
        written
    }
}

/// What the device loop waits on between requests: the node's pipe, and
/// the lease's direct path once it is open (whose tasks run while the
/// loop waits).
enum Waits<'a> {
    Pipe(std::os::fd::RawFd),
    Direct(&'a mut DirectLink),
}

impl Waits<'_> {
    /// Delivers answers to the direct path's tasks.
    fn deliver(&mut self, answers: DirectAnswers) {
        match self {
            Waits::Direct(link) => link.deliver(answers),
            // (None without a direct path.)
            Waits::Pipe(_) => {
                for (to, answer) in answers {
                    let _ = to.send(answer);
                }
            }
        }
    }

    /// After a wait said yes: whether to read the pipe now (what the
    /// direct path handed over is taken first; the pipe then waits for
    /// the next turn of the loop).
    fn pipe_ready(&self) -> bool {
        match self {
            Waits::Pipe(_) => true,
            Waits::Direct(link) => !link.handed() && link.pipe_ready(),
        }
    }

    /// Whether a request can be read or was handed over now (without
    /// sleeping; the direct path's tasks run once).
    fn ready_now(&mut self) -> bool {
        match self {
            Waits::Pipe(fd) => crate::spin::ready_now(&[*fd]),
            Waits::Direct(link) => link.turn_due(),
        }
    }

    /// [`Waits::ready_now`] until it says yes or `budget` passed.
    fn within(&mut self, budget: Duration) -> bool {
        match self {
            Waits::Pipe(fd) => crate::spin::readable_within(&[*fd], budget),
            Waits::Direct(link) => link.within(budget),
        }
    }

    /// Sleeps until a request can be read or was handed over; true.
    fn wait(&mut self) -> bool {
        match self {
            Waits::Pipe(fd) => crate::spin::wait_readable(&[*fd]),
            Waits::Direct(link) => link.sleep(None, None),
        }
    }

    /// Sleeps until a request can be read or was handed over (true), or
    /// `wake` (the device's eventfd, whose count is taken) fired or about
    /// 1 ms passed (false).
    fn soon(&mut self, wake: Option<std::os::fd::RawFd>) -> bool {
        match self {
            Waits::Pipe(fd) => crate::spin::readable_soon([*fd, -1], wake),
            Waits::Direct(link) => link.sleep(wake, Some(Duration::from_millis(1))),
        }
    }
}

/// Sealed work that may still run, and the request it answers.
struct Running {
    request: Header,
    /// Where its answer goes.
    to: ReplyTo,
    ticket: Ticket,
    work: Sealed,
    /// Its wake-up is armed (see `LeaseDevice::wake_when_done`).
    armed: bool,
    /// When it was read, planned, its commands enqueued and it was
    /// sealed, if the request asked ([`FLAG_STAMPS`]).
    stamps: Option<[u64; 4]>,
}

/// Where a [`Running`]'s answer goes.
enum ReplyTo {
    /// The node's pipe.
    Pipe,
    /// The lease's direct path.
    Direct(tokio::sync::oneshot::Sender<Answer>),
}

/// What a [`Running`] answers when its work is done.
enum Sealed {
    /// A batch: its reads and what ran of it.
    Batch(Box<Enqueued>),
    /// A call of streamed chunks: done, or the failure.
    Chunks,
}

/// Answers for the lease's direct path, to deliver in its runtime
/// ([`DirectLink::deliver`]).
type DirectAnswers = Vec<(tokio::sync::oneshot::Sender<Answer>, Answer)>;

/// Answers every running batch whose work is done, in the order they
/// finish: on the pipe, or, for the direct path, returned. `Err` when the
/// node's pipe broke.
fn answer_done(
    dev: &mut dyn LeaseDevice,
    lease: &mut WorkerLease,
    running: &mut Vec<Running>,
    held: &mut Held,
    output: &mut impl std::io::Write,
) -> Result<DirectAnswers, ()> {
    let mut direct = Vec::new();
    let mut i = 0;
    while i < running.len() {
        let Some(finished) = dev.poll_sealed(running[i].ticket) else {
            i += 1;
            continue;
        };
        let r = running.remove(i);
        let done = r.stamps.map(|_| now_ns());
        let (status, body, out) = match r.work {
            Sealed::Batch(enqueued) => {
                let (mut reply, out) = enqueued.reply(lease, finished, dev.staging_bytes());
                if let (Some([read, planned, launched, sealed]), Some(done)) = (r.stamps, done) {
                    reply.stamps = Some([read, planned, launched, sealed, done, now_ns()]);
                }
                (Status::Ok, to_body(&reply), out)
            }
            Sealed::Chunks => match finished {
                Ok(_) => (Status::Ok, Vec::new(), Vec::new()),
                Err(e) => (e.status, to_body(&e), Vec::new()),
            },
        };
        match r.to {
            ReplyTo::Pipe => held
                .reply(output, &r.request, status, &body, out)
                .map_err(|_| ())?,
            ReplyTo::Direct(answer) => direct.push((
                answer,
                Answer {
                    status,
                    body,
                    data: out,
                },
            )),
        }
    }
    Ok(direct)
}

/// While batches run: polls them and the pipe, spinning for `spin`, then
/// sleeps until the pipe is readable, the device wakes it for a done batch
/// (wake-ups armed then), or a millisecond passes (for a batch the device
/// could not arm, or a dead context). `Ok(true)`: a request can be read;
/// `Ok(false)`: every batch is answered.
#[allow(clippy::too_many_arguments)]
fn wait_for_work(
    dev: &mut dyn LeaseDevice,
    lease: &mut WorkerLease,
    running: &mut Vec<Running>,
    held: &mut Held,
    output: &mut impl std::io::Write,
    waits: &mut Waits<'_>,
    spin: Duration,
    wake: &mut Option<std::os::fd::RawFd>,
) -> Result<bool, ()> {
    let start = std::time::Instant::now();
    loop {
        let answers = answer_done(dev, lease, running, held, output)?;
        waits.deliver(answers);
        if running.is_empty() {
            return Ok(false);
        }
        if start.elapsed() < spin {
            if waits.ready_now() {
                return Ok(true);
            }
            std::hint::spin_loop();
            continue;
        }
        for r in running.iter_mut().filter(|r| !r.armed) {
            r.armed = true;
            if let Some(w) = dev.wake_when_done(r.ticket) {
                *wake = Some(w);
            }
        }
        if waits.soon(*wake) {
            return Ok(true);
        }
    }
}

/// Enqueues the chunks of a streamed transfer, through the shared ring,
/// in order; stops at the first that fails, and then waits for what was
/// enqueued and answers the failure (`Some`). `None`: every chunk is
/// enqueued, to be sealed and answered when its copies are done.
pub(super) fn enqueue_chunks(
    dev: &mut dyn LeaseDevice,
    lease: &WorkerLease,
    ring: &mut Option<std::io::Result<WorkerRing>>,
    f: &Frame,
) -> Option<(Status, Vec<u8>)> {
    let fail =
        |status, message: String| Some((status, to_body(&DeviceError::new(status, message))));
    let ops: ChunkOps = match from_body(&f.body) {
        Ok(ops) => ops,
        Err(e) => return fail(Status::BadRequest, e.to_string()),
    };
    if ops.ops.len() > MAX_CHUNKS_PER_CALL {
        return fail(
            Status::BadRequest,
            format!("{} chunks in one call", ops.ops.len()),
        );
    }
    // The transfer's range lies inside the lease's buffer (its chunks,
    // which the node cuts from it, the device checks as it copies).
    if let Some((id, offset, len)) = ops.range {
        if let Err(e) = lease.check_range(id, offset, len) {
            return Some((e.status, to_body(&e)));
        }
    }
    if ops.ops.is_empty() {
        return None;
    }
    let ring = match ring {
        Some(Ok(r)) => r,
        Some(Err(e)) => return fail(Status::Internal, format!("shared ring: {e}")),
        None => return fail(Status::Internal, "no shared ring".into()),
    };
    for op in ops.ops {
        let slot = match ring.slot(op.slot, op.len) {
            Ok(s) => s,
            Err(e) => return fail(Status::BadRequest, e),
        };
        let r = if f.header.opcode == Opcode::MemWrite {
            // A copy stream; the buffer orders it after its earlier uses
            // and later uses on any stream after it.
            dev.write_chunk(op.id, op.offset, slot)
        } else {
            dev.read_chunk(op.id, op.offset, slot)
        };
        if let Err(e) = r {
            // What was enqueued is waited for before the slots go back.
            let _ = dev.chunks_done();
            return Some((e.status, to_body(&e)));
        }
    }
    None
}

/// Serves a request that is answered at once (the inventory, GPU_SUBMIT).
pub(super) fn serve(
    dev: &mut dyn LeaseDevice,
    cache: &mut HashSet<ModuleHash>,
    f: &Frame,
) -> (Status, Vec<u8>, Vec<u8>) {
    let fail = |e: DeviceError| (e.status, to_body(&e), Vec::new());
    match f.header.opcode {
        Opcode::GetInventory => match dev.info() {
            Ok(info) => (Status::Ok, to_body(&info), Vec::new()),
            Err(e) => fail(e),
        },
        Opcode::GpuSubmit => match from_body::<GpuSubmit<'_>>(&f.body) {
            Ok(s) => match submit(dev, cache, &s, &f.data) {
                Ok(out) => (Status::Ok, Vec::new(), out),
                Err(e) => fail(e),
            },
            Err(e) => fail(DeviceError::new(Status::BadRequest, e.to_string())),
        },
        op => fail(DeviceError::new(
            Status::BadRequest,
            format!("worker does not serve {op:?}"),
        )),
    }
}

/// A worker's device and what runs beside it.
pub(super) struct Dev<'a> {
    pub(super) dev: &'a mut dyn LeaseDevice,
    pub(super) graphs: &'a mut Graphs,
    pub(super) compiler: &'a Compiler,
    /// The lists of batches decoded before, for the next to reuse.
    pub(super) spares: &'a mut CommandSpares,
}

/// What enqueueing a batch did: its plan, the modules it compiled, the
/// first failure and where its reads end.
pub(super) struct Enqueued {
    planned: Planned,
    /// A module that failed to load (nothing of the batch ran), as the
    /// client sees it: by the first command that launches it.
    load_failed: Option<(usize, OpError, bool)>,
    /// A command that failed to enqueue (the ones before it run).
    failed: Option<(usize, DeviceError)>,
    compiled: Vec<(ModuleHash, String)>,
    /// Bytes of the reads (and timers) in the reply's data.
    pub(super) read_at: usize,
    /// When it was planned and its commands enqueued ([`FLAG_STAMPS`];
    /// 0 when not stamped).
    at: [u64; 2],
}

impl Enqueued {
    /// The reply once the batch's work finished (`finished`: its reads,
    /// or the failure found waiting for it; `staging`: the device's
    /// prepared staging now); the lease is settled.
    fn reply(
        self,
        lease: &mut WorkerLease,
        finished: Result<Vec<u8>, DeviceError>,
        staging: u64,
    ) -> (WorkerBatchReply, Vec<u8>) {
        let (finished, out) = match finished {
            Ok(out) => (Ok(()), out),
            Err(e) => (Err(e), Vec::new()),
        };
        let (loaded, completed, error, sticky) = if let Some((i, e, sticky)) = self.load_failed {
            (i, 0, Some(e), sticky)
        } else {
            let (completed, failure) = match (self.failed, finished) {
                // A fault while waiting outranks an enqueue error: it is sticky.
                (Some((i, _)), Err(e)) if e.sticky => (i, Some(e)),
                (Some((i, e)), _) => (i, Some(e)),
                (None, Err(e)) => (self.planned.commands(), Some(e)),
                (None, Ok(())) => (self.planned.commands(), None),
            };
            let sticky = failure.as_ref().is_some_and(|e| e.sticky);
            let error = failure.map(|e| OpError {
                index: completed as u32,
                status: e.status,
                message: format!("command {completed}: {}", e.message),
            });
            // What the plan refused comes after what ran.
            let error = error.or_else(|| self.planned.plan.error.clone());
            (self.planned.loads.len(), completed, error, sticky)
        };
        if let (true, Some(e)) = (sticky, &error) {
            lease.poisoned.get_or_insert_with(|| e.message.clone());
        }
        lease.settle(&self.planned, loaded, completed);
        let reply = WorkerBatchReply {
            loaded: loaded as u32,
            completed: completed as u32,
            compiled: self.compiled,
            error,
            sticky,
            usage: lease.usage(staging),
            stamps: None,
        };
        (reply, out)
    }
}

/// Checks and plans a batch against the lease, loads its modules and
/// enqueues its planned commands, stopping at the first failure; what was
/// enqueued runs to its end (a failure stops only what comes after it).
/// `Err`: the batch is refused whole, nothing of it charged or run.
pub(super) fn enqueue_batch(
    d: &mut Dev<'_>,
    lease: &mut WorkerLease,
    batch: &WorkerBatch<'_>,
    data: &[u8],
    stamped: bool,
) -> Result<Enqueued, DeviceError> {
    let now = || if stamped { now_ns() } else { 0 };
    let commands = &batch.commands.0[..];
    let sources: u64 = batch.loads.iter().map(|l| u64::from(l.len)).sum();
    let writes_len = (data.len() as u64).checked_sub(sources).ok_or_else(|| {
        DeviceError::new(Status::BadRequest, "the modules' sources pass the data")
    })?;
    let planned = lease.plan(
        &batch.limits,
        &batch.modules,
        &batch.loads,
        commands,
        writes_len,
    )?;
    let mut payload = Payload::new(data);
    let mut e = Enqueued {
        planned,
        load_failed: None,
        failed: None,
        compiled: Vec::new(),
        read_at: 0,
        at: [now(), 0],
    };
    for (i, l) in batch.loads.iter().enumerate() {
        let r = payload
            .take(l.len.into())
            .and_then(|src| {
                let text = module_text(src)?;
                check_module(d.compiler, &l.kind, text)?;
                d.dev.load_module(l.hash, &l.kind, text)
            })
            .map(|ptx| e.compiled.extend(ptx.map(|p| (l.hash, p))));
        if let Err(err) = r {
            // The first command that launches the module (0 if none).
            let index = commands
                .iter()
                .position(|c| matches!(&c.op, Op::Launch(s) if s.module == l.hash))
                .unwrap_or(0) as u32;
            let message = format!("module {}: {}", l.hash, err.message);
            let error = OpError {
                index,
                status: err.status,
                message,
            };
            e.load_failed = Some((i, error, err.sticky));
            return Ok(e);
        }
    }
    let planned = &commands[..e.planned.commands()];
    // An allocation that the next command writes whole is not zeroed (one
    // fill fewer per upload); it is zeroed after all if that write fails.
    let mut unzeroed = None;
    for (i, c) in planned.iter().enumerate() {
        // The allocation just before this command, left for it to write.
        let to_write = unzeroed.take();
        let r = match d.graphs.intercept(d.dev, c, &mut payload, &mut e.read_at) {
            Some(r) => r,
            None => match overwritten(planned, i) {
                Some((buf, size)) => {
                    let r = d.dev.alloc_overwritten(c.stream, buf, size);
                    unzeroed = r.is_ok().then_some((c.stream, buf, size));
                    r
                }
                None => enqueue(d.dev, c, &mut payload, &mut e.read_at),
            },
        };
        if let Err(err) = r {
            if let Some((stream, buf, size)) = to_write {
                // (A fill fails only on a dead context, which nothing reads.)
                let _ = d.dev.fill(stream, buf, 0, size, 0);
            }
            e.failed = Some((i, err));
            break;
        }
    }
    e.at[1] = now();
    Ok(e)
}

/// The buffer and size that command `i` allocates when command `i + 1`
/// writes it whole, on the same stream, before any other use.
fn overwritten(commands: &[crate::proto::Command<'_>], i: usize) -> Option<(Id, u64)> {
    let (a, w) = (commands.get(i)?, commands.get(i + 1)?);
    let Op::Alloc { buf, size } = a.op else {
        return None;
    };
    let Op::Write {
        buf: to,
        offset: 0,
        len,
    } = w.op
    else {
        return None;
    };
    (a.stream == w.stream && buf == to && size == len).then_some((buf, size))
}

pub(super) fn submit(
    dev: &mut dyn LeaseDevice,
    cache: &mut HashSet<ModuleHash>,
    s: &GpuSubmit<'_>,
    data: &[u8],
) -> Result<Vec<u8>, DeviceError> {
    let bad = |m: &str| DeviceError::new(Status::BadRequest, m);
    let ptx = data
        .get(..s.ptx_len as usize)
        .ok_or_else(|| bad("data too short"))?;
    let text = module_text(ptx)?;
    let module = ModuleHash::of(&SourceKind::Ptx, text);
    if !cache.contains(&module) {
        if cache.len() >= 32 {
            for m in cache.drain() {
                let _ = dev.unload_module(m);
            }
        }
        dev.load_module(module, &SourceKind::Ptx, text)?;
        cache.insert(module);
    }
    // Buffer ids of this call alone (a submit worker serves no lease).
    let mut owned: Vec<Id> = Vec::new();
    let result = (|| {
        let mut next = 0u64;
        let mut fresh = |dev: &mut dyn LeaseDevice, size: u64| -> Result<Id, DeviceError> {
            let id = Id(next);
            next += 1;
            dev.alloc(0, id, size)?;
            Ok(id)
        };
        let mut cursor = s.ptx_len as usize;
        let mut inputs = Vec::with_capacity(s.input_lens.len());
        for len in &s.input_lens {
            let bytes = data
                .get(cursor..cursor + *len as usize)
                .ok_or_else(|| bad("data too short"))?;
            cursor += *len as usize;
            let id = fresh(dev, u64::from((*len).max(1)))?;
            owned.push(id);
            dev.write(0, id, 0, bytes)?;
            inputs.push(id);
        }
        let output = fresh(dev, u64::from(s.output_size))?;
        owned.push(output);
        if s.output_fill != 0 {
            dev.write(0, output, 0, &vec![s.output_fill; s.output_size as usize])?;
        }
        // The inputs and the output become this call's buffers.
        let args = s
            .args
            .iter()
            .map(|a| match a {
                LaunchArg::Scalar(b) => Ok(LaunchArg::Scalar(b.clone())),
                LaunchArg::Input(n) => inputs
                    .get(*n as usize)
                    .map(|id| LaunchArg::mem(*id))
                    .ok_or_else(|| bad("no such input")),
                LaunchArg::Output => Ok(LaunchArg::mem(output)),
                LaunchArg::Mem { .. } => Err(bad("GPU_SUBMIT has no lease memory")),
            })
            .collect::<Result<_, _>>()?;
        let spec = LaunchSpec {
            module,
            kernel: std::borrow::Cow::Borrowed(&s.kernel),
            grid: s.grid,
            block: s.block,
            shared_mem: s.shared_mem,
            args,
        };
        dev.launch(0, &spec)?;
        let mut out = vec![0u8; s.output_size as usize];
        dev.read(0, output, 0, s.output_size.into(), 0)?;
        dev.finish(&mut out)?;
        Ok(out)
    })();
    for id in owned {
        let _ = dev.free(0, id);
    }
    // The frees run before the next call's work (same stream).
    result
}

/// A module's text as the devices take it.
fn module_text(src: &[u8]) -> Result<&str, DeviceError> {
    std::str::from_utf8(src)
        .map_err(|_| DeviceError::new(Status::LoadFailed, "module text is not UTF-8"))
}

/// Refuses a CUDA C module whose options or includes could reach the
/// node's files ([`crate::sandbox`]), before any device sees it.
pub(super) fn check_module(
    compiler: &Compiler,
    kind: &SourceKind,
    text: &str,
) -> Result<(), DeviceError> {
    let SourceKind::Cuda { options } = kind else {
        return Ok(());
    };
    compiler
        .check(text, options)
        .map_err(|e| DeviceError::new(Status::LoadFailed, format!("module refused: {e}")))
}
