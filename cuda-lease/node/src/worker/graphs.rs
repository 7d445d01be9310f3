//! A lease's graphs on its worker: a body recorded between `GraphBegin` and
//! `GraphEnd` (allocations made at once, other commands kept in wire form
//! with their upload bytes), replayed at each `GraphLaunch`, and freed with
//! the body's own frees. A prepared submission's body (from `PrepareBegin`)
//! is kept the same way without its upload bytes: each `Run` brings them,
//! and its reads go to that batch's reply. A body's allocations are zeroed
//! again at each replay or run, just before the body's first use of each
//! and on that use's stream, unless that use overwrites all of it. A device
//! may keep either natively (a CUDA graph, a prepared body's with staging
//! for its uploads and downloads, every stream of the body forked from its
//! first and joined back); otherwise, or while every instance of a prepared
//! body serves an earlier run, the kept commands replay one by one. The
//! lease's plan has checked every command already (ids, ranges, the body's
//! rules, a run's byte counts).

use super::enqueue::{enqueue, Payload};
use crate::device::{DeviceError, LeaseDevice};
use crate::proto::{
    postcard_decode, postcard_encode, Command, Id, Op, Role, Status, StreamId, FIRST_NODE_ID,
};

/// A recorded body.
#[derive(Default)]
struct Body {
    /// The body's commands, postcard-encoded (they outlive their message).
    commands: Vec<u8>,
    /// The body's upload bytes, in command order.
    data: Vec<u8>,
    /// Ids the body freed: freed with the graph.
    frees: Vec<Id>,
    /// The streams the body's commands run on, in first-use order.
    streams: Vec<StreamId>,
    /// How many times the device captured it natively (0: the commands
    /// replay); a prepared body's once per run in flight together, up to
    /// [`INSTANCES_MAX`], which a failed capture also sets (no more tries).
    instances: usize,
    /// A prepared submission's: its writes' bytes come with each run.
    prepared: bool,
    /// A prepared body's bytes: its uploads' (each run brings them) and
    /// its downloads' (each run's reply takes them).
    inputs: u64,
    outputs: u64,
    /// The body's allocations (with their size and stream) not zeroed
    /// yet: each is zeroed again at each replay or run just before the
    /// body's first use of it, on that use's stream, unless that use
    /// overwrites all of it (an upload's or a fill's); one the body never
    /// uses, at the body's end.
    unzeroed: Vec<(Id, u64, StreamId)>,
}

impl Body {
    /// Keeps `c`, after the zeroing of the allocations it is the first to use.
    fn keep(&mut self, c: &Command<'_>) {
        let mut k = 0;
        while let Some(&(buf, size, _)) = self.unzeroed.get(k) {
            let mut uses = false;
            c.op.buffers(|id, _| uses |= id == buf);
            if !uses {
                k += 1;
                continue;
            }
            self.unzeroed.swap_remove(k);
            let overwrites = c.op.sets() == Some((buf, 0, size));
            if !overwrites {
                // On the use's stream, just before it: stream-ordered, as a
                // native capture needs (it keeps no buffer's cross-stream
                // order, only the body's own events).
                self.zero(buf, size, c.stream);
            }
        }
        self.outputs += c.op.reply_len();
        postcard_encode(c, &mut self.commands);
    }

    fn zero(&mut self, buf: Id, len: u64, stream: StreamId) {
        let op = Op::Fill {
            buf,
            offset: 0,
            len,
            value: 0,
        };
        postcard_encode(&Command { stream, op }, &mut self.commands);
    }

    /// The device keeps it as a native graph.
    fn native(&self) -> bool {
        self.instances > 0
    }

    /// The body is complete: what it never used is zeroed at its end.
    fn close(&mut self) {
        for (buf, size, stream) in std::mem::take(&mut self.unzeroed) {
            self.zero(buf, size, stream);
        }
    }
}

/// Most native instances of one prepared body: runs in flight together
/// beyond these replay one by one.
const INSTANCES_MAX: usize = 4;

/// The lease's graphs, and the one being recorded.
#[derive(Default)]
pub(super) struct Graphs {
    live: crate::proto::IdMap<Id, Body>,
    open: Option<(Id, Body)>,
}

/// The node's own events that order a replay against its launch stream:
/// number 0 opens it, number `k` closes the body's `k`-th other stream.
fn fence(k: usize) -> Id {
    Id(FIRST_NODE_ID + k as u64)
}

impl Graphs {
    /// Runs `c` when graphs decide it (a body's command, a graph command, a
    /// graph's free): `Some` with its result, `None` for an ordinary command.
    /// A run's reads land at `read_at` in the reply's data, which they advance.
    pub(super) fn intercept(
        &mut self,
        dev: &mut dyn LeaseDevice,
        c: &Command<'_>,
        payload: &mut Payload<'_>,
        read_at: &mut usize,
    ) -> Option<Result<(), DeviceError>> {
        let ends = |g: &Id| c.op.role() == Role::End(*g);
        if self.open.as_ref().is_some_and(|(g, _)| ends(g)) {
            let (id, mut body) = self.open.take().expect("open");
            body.close();
            body.instances = usize::from(capture(dev, id, &body));
            self.live.insert(id, body);
            return Some(Ok(()));
        }
        if let Some((_, body)) = &mut self.open {
            if !body.streams.contains(&c.stream) {
                body.streams.push(c.stream);
            }
            let r = match c.op.role() {
                Role::Alloc { buf, size } => dev
                    .alloc(c.stream, buf, size)
                    .map(|()| body.unzeroed.push((buf, size, c.stream))),
                Role::Free(id) => {
                    body.frees.push(id);
                    Ok(())
                }
                Role::Write { len, .. } => payload.take(len).map(|d| {
                    if body.prepared {
                        body.inputs += len;
                    } else {
                        body.data.extend_from_slice(d);
                    }
                    body.keep(c);
                }),
                // Kept for each replay (the plan refused what a body cannot hold).
                Role::Read { .. }
                | Role::Begin { .. }
                | Role::End(_)
                | Role::Launch(_)
                | Role::Run { .. }
                | Role::Plain => {
                    body.keep(c);
                    Ok(())
                }
            };
            return Some(r);
        }
        match c.op.role() {
            Role::Begin {
                id: graph,
                prepared,
            } => {
                let body = Body {
                    prepared,
                    ..Body::default()
                };
                self.open = Some((graph, body));
                Some(Ok(()))
            }
            Role::Launch(graph) => Some(match self.live.get(&graph) {
                Some(body) if body.native() => dev.launch_graph(c.stream, graph),
                Some(body) => replay(dev, c.stream, body, Payload::new(&body.data), read_at),
                None => Err(crate::device::not_found("graph", graph)),
            }),
            Role::Run {
                id: prepared,
                inputs,
                ..
            } => Some(match self.live.get_mut(&prepared) {
                Some(body) => payload.take(inputs).and_then(|d| {
                    if body.native() && run_native(dev, c.stream, prepared, body, d, *read_at)? {
                        *read_at += body.outputs as usize;
                        return Ok(());
                    }
                    // Not captured, or no instance free: one by one.
                    replay(dev, c.stream, body, Payload::new(d), read_at)
                }),
                None => Err(crate::device::not_found("prepared submission", prepared)),
            }),
            Role::Free(id) => {
                let body = self.live.remove(&id)?;
                if body.native() {
                    dev.free_graph(id);
                }
                // Stream-ordered after the replays' uses, like any free.
                Some(body.frees.iter().try_for_each(|f| dev.free(c.stream, *f)))
            }
            Role::Alloc { .. }
            | Role::Write { .. }
            | Role::Read { .. }
            | Role::End(_)
            | Role::Plain => None,
        }
    }
}

/// Runs prepared body `id` natively: on a free instance, else on one
/// captured now (up to [`INSTANCES_MAX`]); whether it ran.
fn run_native(
    dev: &mut dyn LeaseDevice,
    stream: StreamId,
    id: Id,
    body: &mut Body,
    inputs: &[u8],
    at: usize,
) -> Result<bool, DeviceError> {
    if dev.run_prepared(stream, id, inputs, at)? {
        return Ok(true);
    }
    if body.instances >= INSTANCES_MAX {
        return Ok(false);
    }
    if !capture(dev, id, body) {
        // Not again: the next runs replay one by one.
        body.instances = INSTANCES_MAX;
        return Ok(false);
    }
    body.instances += 1;
    dev.run_prepared(stream, id, inputs, at)
}

/// Asks the device to capture `body` natively; whether it does. A capture
/// that fails leaves the commands to be replayed one by one (any error
/// they have shows at a launch).
fn capture(dev: &mut dyn LeaseDevice, graph: Id, body: &Body) -> bool {
    // A prepared body's uploads are captured from its staging (whose
    // bytes each run brings), not from these.
    let inputs = vec![
        0u8;
        if body.prepared {
            body.inputs as usize
        } else {
            0
        }
    ];
    let data = if body.prepared { &inputs } else { &body.data };
    let main = body.streams.first().copied().unwrap_or_default();
    let mut enqueue = |dev: &mut dyn LeaseDevice| {
        // Every stream of the body joins the capture before its first
        // command (and the first stream waits for each at the end), as a
        // replay's are ordered. A graph's body reads nothing; a prepared
        // body's reads land in its staging.
        fenced(dev, main, body, |dev| {
            enqueue_body(dev, body, Payload::new(data), &mut 0)
        })
    };
    let captured = if body.prepared {
        let bytes = (body.inputs, body.outputs);
        dev.capture_prepared(graph, &body.streams, bytes, &mut enqueue)
    } else {
        dev.capture_graph(graph, &body.streams, &mut enqueue)
    };
    match captured {
        Ok(native) => native,
        Err(e) => {
            // (Workers have no log of their own: their stderr is the node's.)
            eprintln!(
                "cuda-lease worker: graph {graph} was not captured natively ({}): its commands \
                 replay one by one",
                e.message
            );
            false
        }
    }
}

/// Enqueues the body's commands again, after the work on `stream` so far
/// and before what follows it there; its writes take `data`, its reads land
/// at `read_at`.
fn replay(
    dev: &mut dyn LeaseDevice,
    stream: StreamId,
    body: &Body,
    data: Payload<'_>,
    read_at: &mut usize,
) -> Result<(), DeviceError> {
    fenced(dev, stream, body, |dev| {
        enqueue_body(dev, body, data, read_at)
    })
}

/// Runs `enqueue` (the body's commands) after the work on `stream` so far
/// and before what follows it there: the body's other streams wait for
/// `stream` before it (the node's fence events), and `stream` for each of
/// them after it.
fn fenced(
    dev: &mut dyn LeaseDevice,
    stream: StreamId,
    body: &Body,
    enqueue: impl FnOnce(&mut dyn LeaseDevice) -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let others: Vec<StreamId> = body
        .streams
        .iter()
        .copied()
        .filter(|s| *s != stream)
        .collect();
    if !others.is_empty() {
        dev.record(stream, fence(0))?;
        for s in &others {
            dev.wait(*s, fence(0))?;
        }
    }
    enqueue(dev)?;
    for (k, s) in others.iter().enumerate() {
        dev.record(*s, fence(k + 1))?;
        dev.wait(stream, fence(k + 1))?;
    }
    Ok(())
}

/// Enqueues the body's kept commands, their writes taking `payload`, their
/// reads landing at `read_at`.
fn enqueue_body(
    dev: &mut dyn LeaseDevice,
    body: &Body,
    mut payload: Payload<'_>,
    read_at: &mut usize,
) -> Result<(), DeviceError> {
    let mut wire = &body.commands[..];
    while !wire.is_empty() {
        // The worker encoded these bytes itself.
        let c: Command<'_> = postcard_decode(&mut wire)
            .map_err(|e| DeviceError::new(Status::Internal, e.to_string()))?;
        enqueue(dev, &c, &mut payload, read_at)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{LaunchArg, LaunchSpec, ModuleHash};

    fn kept(body: &Body) -> Vec<Command<'_>> {
        let mut wire = &body.commands[..];
        let mut out = Vec::new();
        while !wire.is_empty() {
            out.push(postcard_decode(&mut wire).expect("decodes"));
        }
        out
    }

    #[test]
    fn a_bodys_zeroing_runs_on_the_stream_of_the_first_use_just_before_it() {
        for prepared in [true, false] {
            zeroing_on_the_first_use(prepared);
        }
    }

    #[test]
    fn a_graphs_allocation_is_zeroed_where_the_body_first_uses_it() {
        let mut dev = crate::device::MemoryDevice::new(1 << 20);
        let mut graphs = Graphs::default();
        let mut run = |c: Command<'_>| {
            let (mut payload, mut at) = (Payload::new(&[]), 0);
            let r = graphs.intercept(&mut dev, &c, &mut payload, &mut at);
            assert!(matches!(r, Some(Ok(()))), "{c:?}: {r:?}");
        };
        run(Command {
            stream: 0,
            op: Op::GraphBegin { graph: Id(1) },
        });
        run(Command {
            stream: 1,
            op: Op::Alloc {
                buf: Id(8),
                size: 64,
            },
        });
        run(Command {
            stream: 0,
            op: Op::Launch(launch_of(Id(8))),
        });
        let (_, body) = graphs.open.as_ref().expect("open");
        let cmds = kept(body);
        assert_eq!(cmds.len(), 2, "{cmds:?}");
        assert_eq!((cmds[0].stream, &cmds[0].op), (0, &zero_of(Id(8))));
    }

    fn launch_of(buf: Id) -> LaunchSpec<'static> {
        LaunchSpec {
            module: ModuleHash([0; 32]),
            kernel: "k".into(),
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem: 0,
            args: vec![LaunchArg::Mem { buf, offset: 0 }],
        }
    }

    fn zero_of(buf: Id) -> Op<'static> {
        Op::Fill {
            buf,
            offset: 0,
            len: 64,
            value: 0,
        }
    }

    fn zeroing_on_the_first_use(prepared: bool) {
        let mut body = Body {
            prepared,
            ..Body::default()
        };
        // Made on stream 1, first used by a launch on stream 0; another
        // made on stream 1 and first overwritten whole on stream 0.
        body.unzeroed = vec![(Id(8), 64, 1), (Id(9), 64, 1)];
        let spec = LaunchSpec {
            module: ModuleHash([0; 32]),
            kernel: "k".into(),
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem: 0,
            args: vec![LaunchArg::Mem {
                buf: Id(8),
                offset: 0,
            }],
        };
        body.keep(&Command {
            stream: 0,
            op: Op::Launch(spec),
        });
        let fill = Op::Fill {
            buf: Id(9),
            offset: 0,
            len: 64,
            value: 7,
        };
        body.keep(&Command {
            stream: 0,
            op: fill,
        });
        let cmds = kept(&body);
        assert_eq!(cmds.len(), 3, "{cmds:?}");
        let zero = Op::Fill {
            buf: Id(8),
            offset: 0,
            len: 64,
            value: 0,
        };
        assert_eq!((cmds[0].stream, &cmds[0].op), (0, &zero));
        assert!(matches!(cmds[1].op, Op::Launch(_)));
        assert!(matches!(
            cmds[2].op,
            Op::Fill {
                buf: Id(9),
                value: 7,
                ..
            }
        ));
        assert!(body.unzeroed.is_empty());
    }
}
