//! The one encoding of every message body, the protocol's and the node's
//! pipe's: postcard through serde.

use std::borrow::Borrow;
use std::cell::Cell;

use serde::ser::{Serialize, SerializeSeq, Serializer};
use serde::Deserialize;

use super::batch::HeadRef;
use super::{Batch, BatchHead, Command, LeaseId, ModuleUse, ProtoError};

/// Appends `msg` as postcard writes it.
pub fn postcard_encode<T: Serialize + ?Sized>(msg: &T, out: &mut Vec<u8>) {
    // Serializing our own plain-data types into a Vec cannot fail.
    if let Ok(v) = postcard::to_extend(msg, std::mem::take(out)) {
        *out = v;
    }
}

/// Decodes one postcard value off the front of `buf`, advancing `buf`.
///
/// # Errors
///
/// [`ProtoError::Body`] for bytes that are not one value.
pub fn postcard_decode<'a, T: Deserialize<'a>>(buf: &mut &'a [u8]) -> Result<T, ProtoError> {
    let (v, rest) = postcard::take_from_bytes(buf).map_err(|e| ProtoError::Body(e.to_string()))?;
    *buf = rest;
    Ok(v)
}

/// A BATCH's or worker batch's command list: a length (refused over
/// [`MAX_BATCH_OPS`](super::MAX_BATCH_OPS) before decoding), then commands.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct CommandList<'a>(
    #[serde(borrow, deserialize_with = "super::bounded::commands")] pub Vec<Command<'a>>,
);

/// Appends a BATCH body's fields before its commands ([`BatchHead`]).
pub fn encode_batch_head(
    out: &mut Vec<u8>,
    lease: LeaseId,
    seq: u64,
    modules: &[ModuleUse],
    reply_bytes: u64,
) {
    postcard_encode(
        &HeadRef {
            lease,
            seq,
            modules,
            reply_bytes,
        },
        out,
    );
}

impl BatchHead {
    /// Decodes a BATCH body up to its commands; returns with it the bytes
    /// of its [`CommandList`] as they came, for the node to forward undecoded.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Body`] as [`from_body`](super::from_body).
    pub fn decode(mut body: &[u8]) -> Result<(Self, &[u8]), ProtoError> {
        let head: BatchHead = postcard_decode(&mut body)?;
        Ok((head, body))
    }
}

/// An encoded [`CommandList`]'s length prefix, without decoding the commands.
///
/// # Errors
///
/// [`ProtoError::Body`] when the prefix is not a count or exceeds
/// [`MAX_BATCH_OPS`](super::MAX_BATCH_OPS).
pub fn command_count(mut wire: &[u8]) -> Result<u64, ProtoError> {
    let n = postcard_decode::<u64>(&mut wire)?;
    let max = super::MAX_BATCH_OPS;
    if n > max as u64 {
        return Err(ProtoError::Body(format!(
            "invalid length {n}, expected a sequence of at most {max} elements"
        )));
    }
    Ok(n)
}

impl<'a> Batch<'a> {
    /// Decodes a BATCH body; returns with it its command list's bytes as sent.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Body`] as [`from_body`](super::from_body).
    pub fn decode_keeping_wire(body: &'a [u8]) -> Result<(Self, &'a [u8]), ProtoError> {
        let (head, wire) = BatchHead::decode(body)?;
        let CommandList(commands) = super::from_body(wire)?;
        let batch = Batch {
            lease: head.lease,
            seq: head.seq,
            modules: head.modules,
            commands,
        };
        Ok((batch, wire))
    }
}

/// Appends `commands` (`n` of them) to `out` as postcard writes a
/// `Vec<Command>`, without collecting them first.
pub fn encode_commands<'a, C: Borrow<Command<'a>>>(
    out: &mut Vec<u8>,
    n: usize,
    commands: impl IntoIterator<Item = C>,
) {
    /// The commands as a sequence of known length, serialized once.
    struct Seq<I>(usize, Cell<Option<I>>);
    impl<'a, C: Borrow<Command<'a>>, I: Iterator<Item = C>> Serialize for Seq<I> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut seq = s.serialize_seq(Some(self.0))?;
            for c in self.1.take().into_iter().flatten() {
                seq.serialize_element(c.borrow())?;
            }
            seq.end()
        }
    }
    postcard_encode(&Seq(n, Cell::new(Some(commands.into_iter()))), out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{from_body, to_body, Id, LaunchArg, LaunchSpec, ModuleHash, Op, Operand};

    /// One command of every kind, and a launch with every kind of argument.
    fn every_command() -> Vec<Command<'static>> {
        let id = |n| Id(n);
        let big = u64::MAX - 3;
        [
            Op::Alloc {
                buf: id(1),
                size: 1 << 40,
            },
            Op::Write {
                buf: id(1),
                offset: big,
                len: u64::MAX,
            },
            Op::Read {
                buf: id(300),
                offset: 0,
                len: 128,
            },
            Op::Free { id: id(big) },
            Op::Launch(LaunchSpec {
                module: ModuleHash([0xa5; 32]),
                kernel: "kernel_\u{e9}".into(),
                grid: [1, 70_000, u32::MAX],
                block: [128, 1, 1],
                shared_mem: 49_152,
                args: vec![
                    LaunchArg::bytes([1, 2, 3, 4, 5, 6, 7, 8, 9]),
                    LaunchArg::mem(id(1)),
                    LaunchArg::Mem {
                        buf: id(2),
                        offset: big,
                    },
                    LaunchArg::Input(3),
                    LaunchArg::Output,
                    LaunchArg::bytes([]),
                ],
            }),
            Op::Record { event: id(9) },
            Op::Wait { event: id(9) },
            Op::Fill {
                buf: id(1),
                offset: 7,
                len: 9,
                value: 0xfe,
            },
            Op::Copy {
                src: Operand::new(id(1), 1),
                dst: Operand::new(id(2), 2),
                len: 3,
            },
            Op::TimerStart { timer: id(11) },
            Op::TimerEnd { timer: id(11) },
            Op::GraphBegin { graph: id(12) },
            Op::GraphEnd { graph: id(12) },
            Op::GraphLaunch { graph: id(12) },
        ]
        .into_iter()
        .enumerate()
        .map(|(i, op)| Command {
            stream: [0, 1, 200, u32::MAX][i % 4],
            op,
        })
        .collect()
    }

    /// A BATCH round trips, and the bytes the node forwards are its
    /// command list as the client streamed it.
    #[test]
    fn a_batch_round_trips_and_keeps_its_commands_wire() {
        let batch = Batch {
            lease: LeaseId::random(),
            seq: 7,
            modules: vec![ModuleUse {
                hash: ModuleHash([3; 32]),
                source: None,
            }],
            commands: every_command(),
        };
        let body = to_body(&batch);
        assert_eq!(body, postcard::to_allocvec(&batch).unwrap());
        assert_eq!(from_body::<Batch<'_>>(&body).unwrap(), batch);
        {
            let (back, wire) = Batch::decode_keeping_wire(&body).unwrap();
            assert_eq!(back, batch);
            assert_eq!(wire, &to_body(&batch.commands)[..]);
            let mut streamed = Vec::new();
            encode_commands(&mut streamed, batch.commands.len(), &batch.commands);
            assert_eq!(wire, &streamed[..]);
            // Trailing bytes are refused as by `from_body`.
            let mut long = body.clone();
            long.push(0);
            assert!(Batch::decode_keeping_wire(&long).is_err());
        }
        // The node's part: the head, with the bytes the reads return
        // (one 128-byte read and one timer), and the count of commands.
        let (head, wire) = BatchHead::decode(&body).unwrap();
        assert_eq!((head.lease, head.seq), (batch.lease, batch.seq));
        assert_eq!(head.modules, batch.modules);
        assert_eq!(head.reply_bytes, 128 + crate::TIMER_BYTES as u64);
        assert_eq!(command_count(wire).unwrap(), batch.commands.len() as u64);
        let long = to_body(&vec![batch.commands[0].clone(); crate::MAX_BATCH_OPS + 1]);
        assert!(command_count(&long).is_err());
        let mut again = Vec::new();
        encode_batch_head(
            &mut again,
            batch.lease,
            batch.seq,
            &batch.modules,
            head.reply_bytes,
        );
        encode_commands(&mut again, batch.commands.len(), &batch.commands);
        assert_eq!(again, body);
    }
}
