//! The remote backend's seam: what a remote execution context records and
//! the trait of the session that sends it.
//!
//! A remote context records the protocol's [`Command`]s ([`proto`], the wire
//! protocol of `cuda-lease`) into a [`Recording`] instead of enqueueing on a
//! CUDA stream, naming buffers and events with ids the client picks
//! ([`RemoteSession::fresh_id`]), so a whole chain is recorded without
//! waiting for a reply. On the submission's first poll (or its blocking
//! call) the recording goes to the [`RemoteSession`] as one message; the
//! session delivers the reply's reads into their [`ReadSlot`]s, then
//! completes the submission's [`RemoteCompletion`], or fails it with a
//! remote [`Error`](crate::Error) variant.
//!
//! `cuda-async` has none of the transport (no QUIC, TLS or async-runtime
//! dependency); `cuda-lease` implements [`RemoteSession`] for a leased GPU.
//!
//! Every op of this crate records onto a remote context
//! ([`ExecutionContext::as_remote`](crate::ExecutionContext::as_remote));
//! [`RemotePolicy`] hands them out, round-robin over k streams of a session:
//!
//! ```no_run
//! # fn f(session: std::sync::Arc<dyn cuda_async::RemoteSession>) -> cuda_async::Result<()> {
//! use cuda_async::prelude::*;
//! use cuda_async::remote::RemotePolicy;
//! let remote = RemotePolicy::new(&session);
//! // blocking, no async runtime needed:
//! let y = h2d(vec![1.0f32; 4]).then(d2h).sync_with(&remote)?;
//! assert_eq!(y.to_vec()?, vec![1.0; 4]);
//! // or, in an async fn: h2d(..).then(d2h).schedule(&remote)?.await?
//! # Ok(()) }
//! ```

mod context;
mod error;
mod frees;
mod graph;
mod ledger;
mod memory;
mod modules;
mod policy;
mod prepared;
mod recording;
mod session;
mod work;

pub use crate::host::{HostBuffer, ReadBuf, ReadSlot};
pub use context::RemoteContext;
pub use cuda_lease_proto as proto;
pub use error::RemoteErrorExt;
pub use ledger::{Ledger, Ran, Sent};
pub use policy::{RemotePolicy, DEFAULT_REMOTE_STREAMS};
pub use prepared::{Outputs, Prepare, Prepared, Run};
pub use proto::{Command, Id, Op};
pub use recording::{KeptBytes, Recording, RemoteStream};
pub use session::{AsRemoteSession, RemoteCompletion, RemoteSession};

pub(crate) use context::{OnReply, RemoteEvent};
pub(crate) use frees::{free_remote, RecordingFrame};
pub(crate) use graph::{CaptureRemote, RemoteGraph};
pub(crate) use policy::send;

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::*;

    #[test]
    fn kept_and_copied_payloads_keep_their_order_through_append_and_take() {
        let w = |r: &mut Recording, id| r.write(0, id, 0, &[id as u8; 3]);
        let k = |r: &mut Recording, id| r.write_kept(0, id, 0, Box::new(vec![id as u8; 2]));
        let mut a = Recording::new();
        w(&mut a, 1);
        k(&mut a, 2);
        let mut b = Recording::new();
        k(&mut b, 3);
        w(&mut b, 4);
        a.append(b);
        let each: Vec<Vec<u8>> = a.payloads().map(<[u8]>::to_vec).collect();
        assert_eq!(each, [vec![1; 3], vec![2; 2], vec![3; 2], vec![4; 3]]);
        assert_eq!(a.payload(3), &[4; 3]);
        assert_eq!(a.take_data(), [1, 1, 1, 2, 2, 3, 3, 4, 4, 4]);
        assert_eq!(a.payloads().count(), 0);
    }

    #[test]
    fn an_abandoned_tail_keeps_only_the_frees_of_older_ids() {
        let mut rec = Recording::new();
        rec.push(
            0,
            Op::Alloc {
                buf: Id(1),
                size: 4,
            },
        );
        rec.write(0, 1, 0, &[1; 4]);
        let begin = rec.commands().len();
        rec.push(0, Op::GraphBegin { graph: Id(9) });
        rec.push(
            0,
            Op::Alloc {
                buf: Id(2),
                size: 4,
            },
        );
        rec.write(0, 2, 0, &[2; 4]);
        let _slot = rec.read(0, 2, 0, 4);
        rec.push(0, Op::Free { id: Id(2) });
        rec.push(0, Op::Free { id: Id(1) });
        rec.abandon_from(begin);
        let kinds: Vec<String> = rec
            .commands()
            .iter()
            .map(|c| format!("{:?}", c.op))
            .collect();
        assert_eq!(kinds.len(), 3, "{kinds:?}");
        assert!(
            matches!(rec.commands()[2].op, Op::Free { id: Id(1) }),
            "{kinds:?}"
        );
        assert_eq!(
            rec.payloads().map(<[u8]>::to_vec).collect::<Vec<_>>(),
            [vec![1; 4]]
        );
        assert!(rec.reads().is_empty());
        assert_eq!(rec.take_data(), [1; 4]);
    }

    #[test]
    fn a_remote_host_buffer_is_an_error_until_its_bytes_arrive() {
        let mut rec = Recording::new();
        rec.push(
            0,
            Op::Alloc {
                buf: Id(1),
                size: 12,
            },
        );
        rec.write(0, 1, 0, &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]);
        let slot = rec.read(0, 1, 0, 12);
        assert_eq!(rec.commands().len(), 3);
        assert_eq!(rec.payloads().map(<[u8]>::len).sum::<usize>(), 12);
        let host = HostBuffer::<u32>::remote(slot.clone()).unwrap();
        assert_eq!(host.len(), 3);
        let err = host.as_slice().unwrap_err();
        assert!(err.to_string().contains("before its submission completed"));
        slot.receive(|b| {
            b.copy_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]);
            Ok(())
        })
        .unwrap();
        assert_eq!(host.to_vec().unwrap(), [1, 2, 3]);
        assert!(slot.receive(|_| Ok(())).is_err(), "filled once");
        assert!(HostBuffer::<u64>::remote(Arc::new(ReadSlot::new(12))).is_err());
    }

    /// A session that keeps what it is sent and answers at once, keeping its
    /// ledger as a transport does.
    #[derive(Debug, Default)]
    struct Capture {
        next: std::sync::atomic::AtomicU64,
        ledger: Arc<Ledger>,
        sent: std::sync::Mutex<Vec<Vec<Command<'static>>>>,
        freed: std::sync::Mutex<Vec<u64>>,
    }

    impl RemoteSession for Capture {
        fn describe(&self) -> String {
            "capture".into()
        }
        fn fresh_id(&self) -> u64 {
            self.next.fetch_add(1, Ordering::Relaxed) + 1
        }
        fn submit(&self, r: Recording, done: RemoteCompletion) {
            for s in r.reads() {
                s.receive(|b| {
                    b.fill(0);
                    Ok(())
                })
                .unwrap();
            }
            // Numbered through the ledger, led by the queued frees; all run.
            let (sent, frees) = self.ledger.send(false, r.commands(), |frees| {
                self.freed.lock().unwrap().extend(frees);
                frees.len()
            });
            if !r.is_empty() {
                self.sent.lock().unwrap().push(r.commands().to_vec());
            }
            if self
                .ledger
                .settle(&sent, Some(Ran::all(frees + r.commands().len())))
            {
                self.submit(Recording::new(), RemoteCompletion::new());
            }
            done.complete();
        }
        fn ledger(&self) -> Option<Arc<Ledger>> {
            Some(self.ledger.clone())
        }
    }

    /// Each command's stream and op's name ("Alloc", "TimerStart"...).
    fn streams_and_kinds(cmds: &[Command<'_>]) -> Vec<(RemoteStream, &'static str)> {
        let kind = |op: &Op<'_>| {
            let debug = format!("{op:?}");
            &*Box::leak(debug.split([' ', '(']).next().unwrap_or_default().into())
        };
        cmds.iter().map(|c| (c.stream, kind(&c.op))).collect()
    }

    #[test]
    fn a_remote_zip_forks_its_arms_onto_other_streams_with_events() {
        use crate::prelude::*;
        let capture = Arc::new(Capture::default());
        let remote = RemotePolicy::new(&capture).with_streams(2);
        let (a, b) = zeros::<u8>(4)
            .then(d2h)
            .zip(zeros::<u8>(8).then(d2h))
            .sync_with(&remote)
            .unwrap();
        assert_eq!((a.len(), b.len()), (4, 8));
        let sent = capture.sent.lock().unwrap();
        assert_eq!(sent.len(), 1, "one message");
        assert_eq!(
            streams_and_kinds(&sent[0]),
            [
                (0, "Record"), // the fork, before arm 0
                (0, "Alloc"),
                (0, "Read"),
                (1, "Wait"), // arm 1 starts after the fork
                (1, "Alloc"),
                (1, "Read"),
                (1, "Record"), // arm 1's end
                (0, "Wait"),   // the join
                (0, "Free"),   // the fork and join events
                (0, "Free"),
                (0, "Free"), // the two buffers, dropped while recording
                (0, "Free"),
            ]
        );
        drop(sent);
        // With one stream the arms record in order, with no events.
        let one = RemotePolicy::new(&capture).with_streams(1);
        zeros::<u8>(4).zip(zeros::<u8>(4)).sync_with(&one).unwrap();
        let sent = capture.sent.lock().unwrap();
        assert_eq!(streams_and_kinds(&sent[1]), [(0, "Alloc"), (0, "Alloc")]);
        // Buffers dropped after their submission are freed through the session.
        assert_eq!(capture.freed.lock().unwrap().len(), 2);
        drop(sent);
        // A shared op: its consumer on another stream waits on the event
        // recorded after the producer; the event is freed with the op.
        let shared = zeros::<u8>(4).map(Arc::new).shared();
        let (x, y) = shared.clone().zip(shared).sync_with(&remote).unwrap();
        assert!(Arc::ptr_eq(&x, &y));
        let sent = capture.sent.lock().unwrap();
        let kinds = streams_and_kinds(&sent[2]);
        // The policy's second submission: stream 1; arm 1 forks onto 0.
        assert_eq!(
            kinds[..6],
            [
                (1, "Record"), // fork
                (1, "Alloc"),  // the producer, in arm 0
                (1, "Record"), // the shared op's event
                (0, "Wait"),   // arm 1 after the fork
                (0, "Wait"),   // and after the producer
                (0, "Record"), // arm 1's end
            ]
        );
        assert_eq!(
            kinds.iter().filter(|k| k.1 == "Free").count(),
            3,
            "the fork, join and shared events: {kinds:?}"
        );
    }

    #[test]
    fn a_buffer_dropped_inside_a_nested_submission_is_freed_by_the_outer_one() {
        use crate::prelude::*;
        let capture = Arc::new(Capture::default());
        let remote = Arc::new(RemotePolicy::new(&capture).with_streams(1));
        let inner = remote.clone();
        // The outer submission allocates `b`; a closure of it runs an inner
        // blocking submission, which drops `b` while it records. The inner
        // message is sent first: `b`'s free must ride the outer one.
        zeros::<u8>(4)
            .then(move |b| {
                let r = zeros::<u8>(2)
                    .then(move |c| {
                        drop(b);
                        d2h(c)
                    })
                    .sync_with(&*inner)
                    .unwrap();
                value(r.len())
            })
            .sync_with(&*remote)
            .unwrap();
        let sent = capture.sent.lock().unwrap();
        assert_eq!(sent.len(), 2);
        assert_eq!(streams_and_kinds(&sent[0]), [(0, "Alloc"), (0, "Read")]);
        assert_eq!(
            streams_and_kinds(&sent[1]),
            [(0, "Alloc"), (0, "Free"), (0, "Free")]
        );
    }

    #[test]
    #[should_panic(expected = "use Recording::write")]
    fn writes_go_through_write() {
        let (buf, offset, len) = (Id(1), 0, 4);
        Recording::new().push(0, Op::Write { buf, offset, len });
    }
}
