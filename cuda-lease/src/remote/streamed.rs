//! Large transfers of a submission on the data path: which of a recording's
//! writes and reads leave the BATCH and travel as streamed, striped
//! MEM_WRITEs and MEM_READs (pure planning over the commands; the session
//! runs the plan).
//!
//! Such a submission takes its place in the lease's order when made: its
//! commands' BATCH is numbered then, and later submissions wait on the node
//! for that number. Its steps:
//!
//! 1. at once, a BATCH outside the order with the allocations of the fresh
//!    buffers its large writes fill (nothing else can name them yet), and
//!    the writes into buffers of earlier submissions as MEM_WRITEs the node
//!    runs after the batch numbered before the commands' ([`MemWrite::after`]);
//! 2. once the allocations are answered, the writes into fresh buffers;
//! 3. once every write is in, the commands' BATCH (with every other command,
//!    even when there is none), and at once the large reads as MEM_READs the
//!    node runs after it.
//!
//! So streamed submissions move their bytes concurrently, yet the node
//! applies them in the order made. The transfers' buffers are held in the
//! ledger while they move: a free asked meanwhile waits for the last step.
//!
//! A write moves only when nothing before it in the recording uses its
//! buffer (one the recording allocates, or one of an earlier submission); a
//! read only when nothing after it touches its buffer but a free (which then
//! waits for the MEM_READ, queued like a dropped buffer's). Other transfers,
//! and those below the threshold, stay in the message.

use std::future::Future;
use std::sync::Arc;

use cuda_async::remote::{Command, Op, ReadBuf, Recording};

use super::{FailOnDrop, LeaseBackend};
use crate::client::{protocol_error, Error, Submitted};
#[cfg(doc)]
use crate::proto::MemWrite;
use crate::proto::{Id, Role};

/// A large write that goes as a MEM_WRITE: the recording's write number
/// `write` into buffer `id` at `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StreamedWrite {
    pub(super) id: u64,
    pub(super) offset: u64,
    /// Its index among the recording's writes (its payload).
    pub(super) write: usize,
}

/// A large read that goes as a MEM_READ into read slot `slot`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StreamedRead {
    pub(super) id: u64,
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Its index among the recording's read slots.
    pub(super) slot: usize,
}

/// How a recording is split (see the module docs).
#[derive(Debug, Default)]
pub(super) struct StreamPlan {
    /// Step 1: the allocations of the streamed writes' buffers.
    pub(super) allocs: Vec<Command<'static>>,
    pub(super) writes: Vec<StreamedWrite>,
    /// Step 3: every other command, in order.
    pub(super) commands: Vec<Command<'static>>,
    /// The payloads of the writes left in `commands` (indices among the
    /// recording's writes), in order.
    pub(super) data: Vec<usize>,
    /// The read slots of the reads left in `commands`, in order.
    pub(super) slots: Vec<usize>,
    pub(super) reads: Vec<StreamedRead>,
    /// Frees of the streamed reads' buffers, queued after the reads.
    pub(super) frees_after: Vec<u64>,
}

/// Whether a command uses buffer `id` (a launch's buffer arguments and a
/// free included).
fn uses(c: &Command<'_>, id: u64) -> bool {
    if let Op::Free { id: x } = c.op {
        return x.0 == id;
    }
    let mut used = false;
    c.op.buffers(|b, _| used |= b.0 == id);
    used
}

/// Splits `commands` when a write or a read of at least `threshold` bytes (and
/// at least one byte) can take the data path; `None` when none can.
pub(super) fn plan(commands: &[Command<'static>], threshold: usize) -> Option<StreamPlan> {
    /// Where a command goes.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Route {
        Message,
        /// An allocation sent first (a streamed write's buffer).
        Hoisted,
        Streamed,
        /// A streamed read's buffer's free, queued after the read.
        FreeAfter,
    }
    let threshold = threshold.max(1) as u64;
    // The common case, on every submission's path: nothing large.
    if !commands
        .iter()
        .any(|c| matches!(c.op, Op::Write { len, .. } | Op::Read { len, .. } if len >= threshold))
    {
        return None;
    }
    let mut route = vec![Route::Message; commands.len()];
    // A graph's or prepared submission's body stays whole in the message:
    // the node keeps it.
    let mut in_body = false;
    for (i, c) in commands.iter().enumerate() {
        match c.op.role() {
            Role::Begin { .. } => in_body = true,
            Role::End(_) => in_body = false,
            Role::Alloc { .. }
            | Role::Write { .. }
            | Role::Read { .. }
            | Role::Free(_)
            | Role::Launch(_)
            | Role::Run { .. }
            | Role::Plain => {}
        }
        if in_body {
            continue;
        }
        match c.op.role() {
            Role::Write { buf, len, .. } if len >= threshold => {
                let id = buf.0;
                let alloc = commands[..i]
                    .iter()
                    .rposition(|p| matches!(p.op, Op::Alloc { buf: a, .. } if a == buf));
                match alloc {
                    // Allocated here, unused between its allocation and this write.
                    Some(a) => {
                        if !commands[a + 1..i].iter().any(|p| uses(p, id))
                            && route[a] == Route::Message
                        {
                            route[i] = Route::Streamed;
                            route[a] = Route::Hoisted;
                        }
                    }
                    // A buffer of an earlier submission (the node runs the
                    // write after every earlier message), first used here.
                    None => {
                        if !commands[..i].iter().any(|p| uses(p, id)) {
                            route[i] = Route::Streamed;
                        }
                    }
                }
            }
            // Its buffer's free (a `d2h` consumes its buffer) waits for the
            // MEM_READ; any other later use keeps the read in the message.
            Role::Read { buf, len, .. }
                if len >= threshold
                    && !commands[i + 1..]
                        .iter()
                        .any(|p| uses(p, buf.0) && !matches!(p.op, Op::Free { .. })) =>
            {
                route[i] = Route::Streamed;
                for (j, p) in commands.iter().enumerate().skip(i + 1) {
                    if uses(p, buf.0) {
                        route[j] = Route::FreeAfter;
                    }
                }
            }
            // Small, or kept in the message (see above).
            Role::Write { .. }
            | Role::Read { .. }
            | Role::Alloc { .. }
            | Role::Free(_)
            | Role::Begin { .. }
            | Role::End(_)
            | Role::Launch(_)
            | Role::Run { .. }
            | Role::Plain => {}
        }
    }
    if !route.contains(&Route::Streamed) {
        return None;
    }
    let mut p = StreamPlan::default();
    let (mut write, mut slot) = (0usize, 0usize);
    // A prepared body's reads have no slots: they return nothing now.
    let mut now = vec![false; commands.len()];
    for (i, _) in crate::proto::replying_now(commands) {
        now[i] = true;
    }
    for ((c, &r), now) in commands.iter().zip(&route).zip(now) {
        match (c.op.role(), r) {
            (Role::Read { .. }, _) if !now => p.commands.push(c.clone()),
            (Role::Run { outputs, .. }, _) => {
                p.data.push(write);
                write += 1;
                if outputs > 0 {
                    p.slots.push(slot);
                    slot += 1;
                }
                p.commands.push(c.clone());
            }
            (Role::Free(id), Route::FreeAfter) => p.frees_after.push(id.0),
            (Role::Alloc { .. }, Route::Hoisted) => p.allocs.push(c.clone()),
            (Role::Write { buf, offset, .. }, _) => {
                if r == Route::Streamed {
                    let id = buf.0;
                    p.writes.push(StreamedWrite { id, offset, write });
                } else {
                    p.data.push(write);
                    p.commands.push(c.clone());
                }
                write += 1;
            }
            (Role::Read { buf, offset, len }, _) => {
                if r == Route::Streamed {
                    p.reads.push(StreamedRead {
                        id: buf.0,
                        offset,
                        len,
                        slot,
                    });
                } else {
                    p.slots.push(slot);
                    p.commands.push(c.clone());
                }
                slot += 1;
            }
            // Another command that replies (a timer's end) is a small
            // read of the message's reply.
            (Role::Plain, _) if c.op.reply_len() > 0 => {
                p.slots.push(slot);
                p.commands.push(c.clone());
                slot += 1;
            }
            (
                Role::Alloc { .. }
                | Role::Free(_)
                | Role::Begin { .. }
                | Role::End(_)
                | Role::Launch(_)
                | Role::Plain,
                _,
            ) => p.commands.push(c.clone()),
        }
    }
    Some(p)
}

// The session's side: the steps.

impl LeaseBackend {
    /// Sends `recording` now as one message, or starts it on the data path.
    pub(super) fn submit_or_stream(&self, recording: Recording, done: FailOnDrop) {
        match plan(recording.commands(), self.session.stream_min_bytes()) {
            Some(plan) => self.start_streamed(recording, plan, done),
            None => self.submit_now(recording, done),
        }
    }

    /// Starts a submission whose large transfers take the data path (see the
    /// module docs); the steps after the first run on the session's runtime.
    fn start_streamed(&self, recording: Recording, plan: StreamPlan, mut done: FailOnDrop) {
        let Some(this) = self.me.upgrade() else {
            // The session is going away: `done` fails as dropped.
            return;
        };
        // The hoisted allocations' buffers.
        let mut fresh = Vec::new();
        for c in &plan.allocs {
            c.op.buffers(|id, _| fresh.push(id.0));
        }
        let allocs = (!plan.allocs.is_empty()).then(|| {
            self.send_as(false, &plan.allocs, &[], Vec::new(), Vec::new())
                .1
        });
        // The commands' message, also when empty: its number holds the
        // later submissions until the writes are in, and its reply says
        // every earlier submission of the lease has run.
        let slots = recording.reads();
        let parts: Vec<&[u8]> = plan.data.iter().map(|&i| recording.payload(i)).collect();
        let writes = parts.concat();
        let bufs: Vec<_> = plan.slots.iter().map(|&i| slots[i].buffer()).collect();
        // Numbered, checked against the downloads before it and its own
        // downloads registered, under one lock (see `reading`).
        let (commands, waits, reads) = {
            let mut reading = self.reading();
            let sent = &plan.commands;
            let commands = self.send_as(true, sent, recording.modules(), writes, bufs);
            let waits = reading.conflicts(recording.commands());
            let reads = reading.start(plan.reads.iter().map(|r| r.id).collect());
            (commands, waits, reads)
        };
        // The transfers' buffers are not freed while they move (a free
        // sent meanwhile could reach the node first).
        let moving: Vec<u64> = plan
            .writes
            .iter()
            .map(|w| w.id)
            .chain(plan.reads.iter().map(|r| r.id))
            .collect();
        self.ledger.hold(&moving);
        let recording = Arc::new(recording);
        self.runtime.spawn(async move {
            let r = this
                .run_streamed(allocs, &fresh, waits, commands, &recording, &plan)
                .await;
            if let Some(reads) = reads {
                this.reading().end(reads);
            }
            // Whatever happened: the ledger frees only ids that exist.
            let flush = this.ledger.free_and_release(&plan.frees_after, &moving);
            done.finish(r);
            if flush {
                this.spawn_queued_frees();
            }
        });
    }

    /// Runs the steps of a streamed submission (see the module docs).
    async fn run_streamed(
        &self,
        allocs: Option<impl Future<Output = Result<(Submitted, Vec<Vec<u8>>), Error>>>,
        fresh: &[u64],
        waits: Vec<tokio::sync::watch::Receiver<()>>,
        commands: (
            u64,
            impl Future<Output = Result<(Submitted, Vec<ReadBuf>), Error>>,
        ),
        recording: &Arc<Recording>,
        plan: &StreamPlan,
    ) -> Result<(), Error> {
        let (seq, commands) = commands;
        let write = |w: &StreamedWrite, after: u64| {
            let payload = PayloadOf {
                recording: recording.clone(),
                write: w.write,
            };
            self.session
                .write_id_shared(Id(w.id), w.offset, after, Arc::new(payload))
        };
        let into_fresh = async {
            if let Some(reply) = allocs {
                reply.await?.0.ok()?;
            }
            for w in plan.writes.iter().filter(|w| fresh.contains(&w.id)) {
                write(w, 0).await?;
            }
            Ok::<_, Error>(())
        };
        // The earlier submissions' downloads of the buffers it uses end before
        // it writes any of them (so before its commands go).
        let into_earlier = async {
            super::reading::done(waits).await;
            for w in plan.writes.iter().filter(|w| !fresh.contains(&w.id)) {
                write(w, seq - 1).await?;
            }
            Ok::<_, Error>(())
        };
        let (into_fresh, into_earlier) = tokio::join!(into_fresh, into_earlier);
        // The allocations' failure explains the writes'. A failure drops
        // the commands' message unsent (its number's place is filled).
        into_fresh?;
        into_earlier?;
        let slots = recording.reads();
        let read = async {
            let mut bufs = Vec::with_capacity(plan.reads.len());
            for r in &plan.reads {
                let out = slots[r.slot].buffer();
                bufs.push(
                    self.session
                        .read_id_after(Id(r.id), r.offset, seq, out)
                        .await?,
                );
            }
            Ok::<_, Error>(bufs)
        };
        let (reply, read) = tokio::join!(commands, read);
        // The batch's failure explains the reads'.
        let (reply, bufs) = reply?;
        reply.ok()?;
        for (&i, buf) in plan.slots.iter().zip(bufs) {
            slots[i].commit(buf).map_err(protocol_error)?;
        }
        for (r, buf) in plan.reads.iter().zip(read?) {
            slots[r.slot].commit(buf).map_err(protocol_error)?;
        }
        Ok(())
    }
}

/// One write's payload, shared with the stripes that send it.
struct PayloadOf {
    recording: Arc<Recording>,
    write: usize,
}

impl AsRef<[u8]> for PayloadOf {
    fn as_ref(&self) -> &[u8] {
        self.recording.payload(self.write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuda_async::remote::Id;

    type C = Command<'static>;

    fn on_0(op: Op<'static>) -> C {
        Command { stream: 0, op }
    }
    fn alloc(id: u64) -> C {
        on_0(Op::Alloc {
            buf: Id(id),
            size: 1 << 20,
        })
    }
    fn write(id: u64, len: u64) -> C {
        let (buf, offset) = (Id(id), 0);
        on_0(Op::Write { buf, offset, len })
    }
    fn read(id: u64, len: u64) -> C {
        let (buf, offset) = (Id(id), 0);
        on_0(Op::Read { buf, offset, len })
    }
    fn fill(id: u64) -> C {
        on_0(Op::Fill {
            buf: Id(id),
            offset: 0,
            len: 4,
            value: 1,
        })
    }

    #[test]
    fn small_transfers_stay_in_the_message() {
        let cmds = [alloc(1), write(1, 99), read(1, 99)];
        assert!(plan(&cmds, 100).is_none());
        assert!(plan(&cmds, 99).is_some());
        // Zero bytes never stream, whatever the threshold.
        assert!(plan(&[alloc(1), write(1, 0), read(1, 0)], 0).is_none());
    }

    #[test]
    fn a_write_into_a_buffer_used_before_it_stays() {
        // The buffer is older than the recording: its first use streams,
        // with nothing hoisted; a use before it keeps it in the message.
        let p = plan(&[write(1, 100), fill(1)], 1).unwrap();
        assert!(p.allocs.is_empty());
        assert_eq!(p.writes.len(), 1);
        assert_eq!(p.commands.len(), 1);
        assert!(plan(&[fill(1), write(1, 100)], 1).is_none());
        // Used between its allocation and the write.
        assert!(plan(&[alloc(1), fill(1), write(1, 100)], 1).is_none());
        // Only the first write after the allocation can go.
        let p = plan(&[alloc(1), write(1, 100), write(1, 100)], 1).unwrap();
        assert_eq!(p.writes.len(), 1);
        assert_eq!(p.data, vec![1]);
    }

    #[test]
    fn a_read_followed_by_a_use_of_its_buffer_stays() {
        assert!(plan(&[read(1, 100), fill(1)], 1).is_none());
        let launch_like = on_0(Op::Copy {
            src: crate::proto::Operand::new(Id(2), 0),
            dst: crate::proto::Operand::new(Id(1), 0),
            len: 4,
        });
        assert!(plan(&[read(1, 100), launch_like], 1).is_none());
        // A free of it waits for the read.
        let free = on_0(Op::Free { id: Id(1) });
        let p = plan(&[read(1, 100), free.clone(), fill(2)], 1).unwrap();
        assert_eq!(p.frees_after, vec![1]);
        assert_eq!(p.commands.len(), 1);
        assert!(plan(&[read(1, 100), free, fill(1)], 1).is_none());
        // A use of another buffer does not hold it.
        assert!(plan(&[read(1, 100), fill(2)], 1).is_some());
    }
}
