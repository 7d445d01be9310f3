//! CUDA graphs kept on a remote node: the capture sends the op's commands
//! once, between `GraphBegin` and `GraphEnd` (the node makes the body's
//! allocations and keeps the rest); each launch is one `GraphLaunch`.
//!
//! What the body names lives on the node as long as the graph: the body's
//! own frees wait on the node for the graph's free, later ones in the
//! session's [`Ledger`](super::Ledger) until the graph is dropped.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use cuda_core::{Error, Result};

use super::frees::RecordingFrame;
use super::proto::{Command, Id, Op};
use super::session::RemoteSession;
use crate::context::ExecutionContext;
use crate::op::DeviceOp;

/// A graph kept on a remote session's node; freed there when dropped
/// (after the launches submitted before), then the ids it held go.
pub(crate) struct RemoteGraph {
    pub(crate) session: Arc<dyn RemoteSession>,
    pub(crate) id: u64,
    /// The ids the body names, held while the graph lives.
    held: Vec<u64>,
    /// Commands kept in the body.
    pub(crate) commands: usize,
    /// Buffers the body uses, and how many of them it writes.
    pub(crate) buffers: (usize, usize),
}

impl fmt::Debug for RemoteGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteGraph")
            .field("home", &self.session.describe())
            .field("id", &self.id)
            .field("commands", &self.commands)
            .finish()
    }
}

impl RemoteGraph {
    /// Records one replay on `r`; false when `r` is another session's.
    pub(crate) fn record_launch(&self, r: &mut super::RemoteContext) -> bool {
        if !crate::buffer::same_session(&self.session, r.session()) {
            return false;
        }
        let stream = r.stream();
        let graph = Id(self.id);
        r.recording().push(stream, Op::GraphLaunch { graph });
        true
    }
}

impl Drop for RemoteGraph {
    fn drop(&mut self) {
        // Straight to the session (never into a submission being recorded):
        // the graph's free must reach the node before the frees it held.
        if let Some(ledger) = self.session.ledger() {
            if ledger.free_graph(self.id, std::mem::take(&mut self.held)) {
                super::frees::send_frees(&self.session);
            }
        }
    }
}

/// The op a remote capture runs: `op` recorded as a graph's body.
pub(crate) struct CaptureRemote<O> {
    pub(crate) op: O,
}

impl<O: DeviceOp> DeviceOp for CaptureRemote<O> {
    type Output = (<O as DeviceOp>::Output, RemoteGraph);

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<<Self as DeviceOp>::Output> {
        // SAFETY: the caller's contract, forwarded.
        let (out, graph, _) = unsafe { capture(self.op, ctx, false, |out| out) }?;
        Ok((out, graph))
    }
}

/// Records `op` as the body of a graph kept on the context's node, or of a
/// prepared submission (`prepared`); `keep` makes what the caller keeps of
/// the op's output inside the body (what it drops is freed with the
/// graph). Returns that, the graph, and for a prepared submission the byte
/// counts of its body's writes and reads, in order.
///
/// # Safety
///
/// As [`DeviceOp::execute`].
pub(super) unsafe fn capture<O: DeviceOp, R>(
    op: O,
    ctx: &mut ExecutionContext,
    prepared: bool,
    keep: impl FnOnce(<O as DeviceOp>::Output) -> R,
) -> Result<(R, RemoteGraph, Io)> {
    let what = if prepared { "prepare" } else { "graph_with" };
    let here = ctx.describe();
    let r = ctx.as_remote().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{what}: the policy runs ops on {here}, not on a remote session"
        ))
    })?;
    let session = r.session().clone();
    let Some(ledger) = session.ledger() else {
        return Err(Error::InvalidArgument(format!(
            "{} cannot keep graphs or prepared submissions on its node",
            session.describe()
        )));
    };
    let (stream, graph) = (r.stream(), session.fresh_id());
    let begin = r.recording().commands().len();
    let steps = r.on_reply.len();
    let begin_op = match prepared {
        true => Op::PrepareBegin {
            prepared: Id(graph),
        },
        false => Op::GraphBegin { graph: Id(graph) },
    };
    r.recording().push(stream, begin_op);
    // Buffers dropped during the capture are freed in the body.
    let frame = RecordingFrame::push(&session, true);
    // SAFETY: same context and caller contract, forwarded.
    let out = unsafe { op.execute(ctx) }.map(keep)?;
    let r = ctx
        .as_remote()
        .ok_or_else(|| Error::InvalidArgument("the capture left the lease".into()))?;
    let stream = r.stream();
    frame.finish(r.recording(), stream);
    let stepped = r.on_reply.len() > steps;
    let body = &r.recording().commands()[begin + 1..];
    let refused = match body.iter().find_map(|c| uncapturable(c, prepared)) {
        Some(what) => Some(what),
        None if prepared && stepped => {
            Some("a step on the client (a host step, or a copy into host memory)")
        }
        None => None,
    };
    if let Some(what) = refused {
        // Nothing of the body is sent (the frees of what it was handed are).
        r.recording().abandon_from(begin);
        let (into, then) = match prepared {
            true => (
                "a prepared submission",
                "its downloads come back in each run's outputs",
            ),
            false => (
                "a graph kept on a node",
                "read the graph's output with an op after a launch",
            ),
        };
        return Err(Error::Capture(format!(
            "{what} cannot be captured into {into}: {then}"
        )));
    }
    let (held, buffers) = names(body);
    let commands = body
        .iter()
        .filter(|c| !matches!(c.op, Op::Alloc { .. } | Op::Free { .. }))
        .count();
    let mut io = Io::default();
    for c in body.iter().filter(|_| prepared) {
        match c.op {
            Op::Write { len, .. } => io.inputs.push(len),
            Op::Read { len, .. } => io.outputs.push(len),
            _ => {}
        }
    }
    // Their reads return nothing now.
    r.recording().forget_reads(io.outputs.len());
    r.recording()
        .push(stream, Op::GraphEnd { graph: Id(graph) });
    ledger.hold(&held);
    let graph = RemoteGraph {
        session,
        id: graph,
        held,
        commands,
        buffers,
    };
    Ok((out, graph, io))
}

/// A prepared submission's byte counts at each run: its body's writes' and
/// reads', in body order.
#[derive(Debug, Default, Clone)]
pub(super) struct Io {
    pub(super) inputs: Vec<u64>,
    pub(super) outputs: Vec<u64>,
}

crate::op::impl_into_future!(impl[O] for CaptureRemote<O> where O: DeviceOp);

/// What a body cannot hold, named (a prepared one may download): the
/// protocol's one rule ([`Op::allowed_in_body`](super::proto::Op::allowed_in_body)),
/// in this crate's words.
fn uncapturable(c: &Command<'_>, prepared: bool) -> Option<&'static str> {
    use super::proto::NotInBody;
    let not = c.op.allowed_in_body(prepared).err()?;
    Some(match not {
        NotInBody::Read => "a download (d2h, copy_d2h)",
        NotInBody::Timer => "timed()",
        NotInBody::Begin => "another capture",
        NotInBody::Launch => "a graph's launch or a prepared run",
        NotInBody::RandFill => "a cuRAND fill (fill before capturing, as locally)",
    })
}

/// The ids `body` names (held while the graph lives), and the buffers it
/// uses and writes.
fn names(body: &[Command<'_>]) -> (Vec<u64>, (usize, usize)) {
    let (mut ids, mut buffers, mut written) = (HashSet::new(), HashSet::new(), HashSet::new());
    for c in body {
        c.op.buffers(|id, writes| {
            buffers.insert(id.0);
            if writes {
                written.insert(id.0);
            }
        });
        match c.op {
            Op::Free { id } | Op::Record { event: id } | Op::Wait { event: id } => {
                ids.insert(id.0);
            }
            _ => {}
        }
    }
    let counts = (buffers.len(), written.len());
    ids.extend(buffers);
    (ids.into_iter().collect(), counts)
}
