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
    #[serde(
        borrow,
        deserialize_with = "super::bounded::at_most::<_, _, { super::MAX_BATCH_OPS }>"
    )]
    pub Vec<Command<'a>>,
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
#[test]
fn a_batch_written_in_parts_is_the_batch_and_its_head_reads_back() {
    // (The reply bytes it declares skip a prepared body's reads.)
    use crate::{to_body, Id, ModuleHash, Op};
    let op = |op| Command { stream: 1, op };
    let commands = vec![
        op(Op::Alloc {
            buf: Id(1),
            size: 1 << 40,
        }),
        op(Op::Read {
            buf: Id(1),
            offset: 0,
            len: 128,
        }),
        op(Op::TimerEnd { timer: Id(2) }),
        // A prepared body's read returns bytes at each run, not now.
        op(Op::PrepareBegin { prepared: Id(3) }),
        op(Op::Read {
            buf: Id(1),
            offset: 0,
            len: 1000,
        }),
        op(Op::GraphEnd { graph: Id(3) }),
        op(Op::Run {
            prepared: Id(3),
            inputs: 0,
            outputs: 1000,
        }),
    ];
    let modules = vec![ModuleUse {
        hash: ModuleHash([3; 32]),
        source: None,
    }];
    let batch = Batch {
        lease: LeaseId::random(),
        seq: 7,
        modules,
        commands,
    };
    let body = to_body(&batch);
    let (head, wire) = BatchHead::decode(&body).unwrap();
    assert_eq!(
        (head.lease, head.seq, &head.modules),
        (batch.lease, 7, &batch.modules)
    );
    assert_eq!(head.reply_bytes, 128 + crate::TIMER_BYTES as u64 + 1000);
    assert_eq!(wire, &to_body(&batch.commands)[..]);
    assert_eq!(command_count(wire).unwrap(), 7);
    let mut again = Vec::new();
    encode_batch_head(&mut again, batch.lease, 7, &batch.modules, head.reply_bytes);
    encode_commands(&mut again, 7, &batch.commands);
    assert_eq!(again, body);
    let long = to_body(&vec![batch.commands[0].clone(); crate::MAX_BATCH_OPS + 1]);
    assert!(command_count(&long).is_err());
}
