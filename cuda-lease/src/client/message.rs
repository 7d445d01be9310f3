//! [`Message`]: one numbered BATCH on the wire (resent with every module
//! source when the node lacks one), and its commands' borrowed encoding.

use super::error::{protocol_error, ErrorKind};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::connection::ReplyInto;
use super::lease::LeaseInner;
use super::{Error, ModuleSpec, RecordedRead, Submitted};
use crate::proto::{
    self, from_body, to_body, Batch, BatchReply, Command, Id, ModuleText, ModuleUse, Op, Opcode,
};
use std::borrow::Cow;

/// One numbered BATCH, with what a resend with every source needs.
pub(crate) struct Message {
    inner: Arc<LeaseInner>,
    seq: u64,
    body: Vec<u8>,
    data: Vec<u8>,
    modules: Vec<ModuleSpec>,
    writes: usize,
    /// The node answered it (or its number was filled).
    answered: std::sync::atomic::AtomicBool,
}

impl Message {
    /// The BATCH of `frees` (as FREE commands on stream 0), then
    /// `commands`, launching from `modules`, with `writes` as its
    /// payloads. The sources of modules the node may lack go first in the
    /// data. `numbered`: numbered now; the node runs a lease's batches in
    /// the order of these calls, whatever order they are polled or arrive
    /// in. Otherwise outside the lease's order (number 0): the node runs it
    /// when it arrives, before or after the numbered ones; only for
    /// commands that depend on nothing sent before them and that nothing
    /// sent before them names (the allocations of fresh buffers).
    pub(crate) fn new(
        inner: &Arc<LeaseInner>,
        numbered: bool,
        modules: &[ModuleSpec],
        frees: &[u64],
        commands: &[Command<'_>],
        writes: Vec<u8>,
    ) -> Message {
        let seq = if numbered {
            inner.next_seq.fetch_add(1, Ordering::Relaxed)
        } else {
            0
        };
        let mut data = Vec::new();
        let known = inner.client.known_modules();
        let uses: Vec<ModuleUse> = modules
            .iter()
            .map(|m| {
                let source = (!known.contains(&m.hash())).then(|| {
                    data.extend_from_slice(m.text().as_bytes());
                    ModuleText {
                        kind: m.kind().clone(),
                        len: m.text().len() as u32,
                    }
                });
                ModuleUse {
                    hash: m.hash(),
                    source,
                }
            })
            .collect();
        drop(known);
        // About a launch's bytes per command: one allocation, not a
        // doubling per power of two.
        let mut body = Vec::with_capacity(96 + 64 * (frees.len() + commands.len()));
        // Frees read nothing.
        let reply_bytes = proto::reply_bytes(commands);
        proto::encode_batch_head(&mut body, inner.id, seq, &uses, reply_bytes);
        encode_commands(&mut body, frees, commands);
        let len = writes.len();
        if data.is_empty() {
            data = writes;
        } else {
            data.extend_from_slice(&writes);
        }
        Message {
            inner: inner.clone(),
            seq,
            body,
            data,
            modules: modules.to_vec(),
            writes: len,
            // An unnumbered message holds no place in the order.
            answered: std::sync::atomic::AtomicBool::new(seq == 0),
        }
    }

    /// Its number in the lease's order ([`Batch::seq`]).
    #[cfg(feature = "backend")]
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// Sends it, the reply's reads received straight into `dests` (one
    /// per read of `reads`, which is `None` when they do not match).
    pub(crate) async fn send_into<D>(
        self,
        reads: Option<Vec<RecordedRead>>,
        mut dests: Vec<D>,
    ) -> Result<(Submitted, Vec<D>), Error>
    where
        D: AsMut<[u8]>,
    {
        let Some(reads) = reads else {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                "the destinations do not match the recorded reads",
            ));
        };
        let reply = {
            let mut parts: Vec<&mut [u8]> = dests.iter_mut().map(|d| d.as_mut()).collect();
            self.send(Some(&mut parts)).await?.0
        };
        let submitted = Submitted {
            completed: reply.completed as usize,
            error: reply.error,
            reads,
            data: Vec::new(),
        };
        Ok((submitted, dests))
    }

    /// Sends it (again with every source if the node answers
    /// UNKNOWN_MODULE); the reply's data goes into `parts` when given.
    pub(super) async fn send(
        &self,
        mut parts: Option<&mut [&mut [u8]]>,
    ) -> Result<(BatchReply, Vec<u8>), Error> {
        let (body, data) = (&self.body, &self.data);
        fn into<'a, 'b>(parts: Option<&'a mut [&'b mut [u8]]>) -> ReplyInto<'a, 'b> {
            parts.map_or(ReplyInto::Owned, ReplyInto::Parts)
        }
        let mut r = self
            .inner
            .req_with(Opcode::Batch, body, data, into(parts.as_deref_mut()))
            .await;
        if matches!(&r, Err(e) if e.kind() == ErrorKind::ModuleUnknown) {
            // The node lost (or never had) a module: send the same
            // message again with every source.
            let writes = &data[data.len() - self.writes..];
            // Boxed, as the rare paths below are: each submission's future
            // is moved whole, so it keeps the common path's size.
            r = Box::pin(async {
                let (body, all) = with_every_source(body, &self.modules, writes)?;
                self.inner
                    .req_with(Opcode::Batch, &body, &all, into(parts))
                    .await
            })
            .await;
        }
        let (reply, data) = match r {
            Ok(r) => r,
            Err(e) => {
                // Answered now: a drop while the place is filled sends no
                // second empty batch.
                self.answered.store(true, Ordering::Release);
                if !e.lease_gone() && self.seq != 0 {
                    // The node may not have read this message, and the
                    // lease's later messages wait for its number: an empty
                    // batch of the same number takes its place (not when
                    // the lease or the connection is gone: nothing follows).
                    Box::pin(fill_place(&self.inner, self.seq)).await;
                }
                return Err(e);
            }
        };
        self.answered.store(true, Ordering::Release);
        let reply: BatchReply = from_body(&reply).map_err(protocol_error)?;
        let learned = self.modules.iter().map(|m| m.hash());
        self.inner.client.known_modules().extend(learned);
        Ok((reply, data))
    }
}

impl Drop for Message {
    /// A message dropped before its answer (its future dropped unsent, or
    /// in flight) leaves its number to an empty batch, sent in the
    /// background: the node runs at most one of the two, and the lease's
    /// later messages do not wait for a number that never comes.
    fn drop(&mut self) {
        if self.answered.load(Ordering::Acquire) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (inner, seq) = (self.inner.clone(), self.seq);
        rt.spawn(async move { fill_place(&inner, seq).await });
    }
}

/// Sends an empty batch numbered `seq` in `inner`'s lease: it takes the
/// number's place in the lease's order (the node answers it at once if
/// the number has run, or is on the node already). Retried while the node
/// is over the principal's budget.
async fn fill_place(inner: &LeaseInner, seq: u64) {
    let mut body = Vec::new();
    proto::encode_batch_head(&mut body, inner.id, seq, &[], 0);
    encode_commands(&mut body, &[], &[]);
    for pause_ms in [0u64, 20, 200, 1000] {
        tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
        let r = inner
            .req_with(Opcode::Batch, &body, &[], ReplyInto::Owned)
            .await;
        if !matches!(&r, Err(e) if e.kind() == ErrorKind::Capacity) {
            return;
        }
    }
}

/// A batch message (`body`, its data ending in `writes`) again, with the
/// source of every module.
fn with_every_source(
    body: &[u8],
    modules: &[ModuleSpec],
    writes: &[u8],
) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let mut batch: Batch<'_> = from_body(body).map_err(protocol_error)?;
    let mut data = Vec::with_capacity(writes.len());
    for (u, m) in batch.modules.iter_mut().zip(modules) {
        data.extend_from_slice(m.text().as_bytes());
        u.source = Some(ModuleText {
            kind: m.kind().clone(),
            len: m.text().len() as u32,
        });
    }
    data.extend_from_slice(writes);
    Ok((to_body(&batch), data))
}

/// Appends `frees` (as FREE commands on stream 0), then `commands`, as
/// postcard encodes the `Vec<Command>` of the same commands, without
/// collecting them.
pub(crate) fn encode_commands(out: &mut Vec<u8>, frees: &[u64], commands: &[Command<'_>]) {
    let frees = frees.iter().map(|&id| {
        Cow::Owned(Command {
            stream: 0,
            op: Op::Free { id: Id(id) },
        })
    });
    let n = frees.len() + commands.len();
    proto::encode_commands(out, n, frees.chain(commands.iter().map(Cow::Borrowed)));
}
