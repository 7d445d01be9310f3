//! The one encoding of every message body, the protocol's and the node's
//! pipe's: postcard, through serde (command lists, the bulk of a BATCH,
//! through a writer and a reader of postcard's format of their own).

use std::borrow::Borrow;

use serde::ser::Serialize;
use serde::Deserialize;

use super::batch::HeadRef;
use super::{Batch, BatchHead, Command, LaunchArg, LaunchSpec, LeaseId, ModuleUse, Op, ProtoError};

mod read;
use read::decode_commands;
pub use read::CommandSpares;

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

impl<'a> CommandList<'a> {
    /// Decodes `wire`, a command list and nothing after it: what
    /// `from_body::<CommandList>` returns, read field by field in
    /// postcard's format instead of through serde's generic visitors (the
    /// path every submission takes). `Gemm` and `RandFill` go through
    /// serde. A list longer than [`MAX_BATCH_OPS`](super::MAX_BATCH_OPS),
    /// or a launch with more than [`MAX_KERNEL_ARGS`](super::MAX_KERNEL_ARGS)
    /// arguments, is refused on its length prefix, before anything is
    /// allocated for it.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Body`] for bytes that are not one command list.
    pub fn from_wire(wire: &'a [u8]) -> Result<Self, ProtoError> {
        Self::from_wire_reusing(wire, &mut CommandSpares::new())
    }

    /// [`CommandList::from_wire`], its lists taken from `spares` where it
    /// has some (a decoder that gives each list back with
    /// [`CommandSpares::keep`] once done with it allocates for the first
    /// lists only).
    ///
    /// # Errors
    ///
    /// As [`CommandList::from_wire`].
    pub fn from_wire_reusing(
        mut wire: &'a [u8],
        spares: &mut CommandSpares,
    ) -> Result<Self, ProtoError> {
        let commands = decode_commands(&mut wire, spares)?;
        if !wire.is_empty() {
            return Err(ProtoError::Body(format!("{} trailing bytes", wire.len())));
        }
        Ok(CommandList(commands))
    }
}

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
        let CommandList(commands) = CommandList::from_wire(wire)?;
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
///
/// The commands a submission carries most are written here field by
/// field, in postcard's format (varints for integers and lengths, a
/// variant's index before its fields); the rest (`Gemm`, `RandFill`) go
/// through serde. Tests check the bytes against postcard's for every op.
pub fn encode_commands<'a, C: Borrow<Command<'a>>>(
    out: &mut Vec<u8>,
    n: usize,
    commands: impl IntoIterator<Item = C>,
) {
    varint(out, n as u64);
    for c in commands {
        encode_command(out, c.borrow());
    }
}

/// Appends `v` as postcard writes an unsigned integer (LEB128).
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Appends `b` as postcard writes a byte string or a `str`: its length, then it.
fn byte_string(out: &mut Vec<u8>, b: &[u8]) {
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// `Op`'s variant indices as postcard writes them (its variants in
/// declaration order): the one table of the hand-written encoder and
/// decoder, whose bytes the tests check against postcard's for every op.
mod index {
    pub(super) const ALLOC: u32 = 0;
    pub(super) const WRITE: u32 = 1;
    pub(super) const READ: u32 = 2;
    pub(super) const FREE: u32 = 3;
    pub(super) const LAUNCH: u32 = 4;
    pub(super) const RECORD: u32 = 5;
    pub(super) const WAIT: u32 = 6;
    pub(super) const FILL: u32 = 7;
    pub(super) const COPY: u32 = 8;
    pub(super) const TIMER_START: u32 = 9;
    pub(super) const TIMER_END: u32 = 10;
    pub(super) const GRAPH_BEGIN: u32 = 11;
    pub(super) const GRAPH_END: u32 = 12;
    pub(super) const GRAPH_LAUNCH: u32 = 13;
    pub(super) const GEMM: u32 = 14;
    pub(super) const RAND_FILL: u32 = 15;
    pub(super) const PREPARE_BEGIN: u32 = 16;
    pub(super) const RUN: u32 = 17;
    /// One past the last.
    pub(super) const END: u32 = 18;
}

/// Appends `c` as postcard writes it (see [`encode_commands`]).
fn encode_command(out: &mut Vec<u8>, c: &Command<'_>) {
    // The variant's index ([`index`]), then the integer fields, then a
    // launch's or a fill's own.
    let (index, fields): (u32, &[u64]) = match &c.op {
        Op::Alloc { buf, size } => (index::ALLOC, &[buf.0, *size]),
        Op::Write { buf, offset, len } => (index::WRITE, &[buf.0, *offset, *len]),
        Op::Read { buf, offset, len } => (index::READ, &[buf.0, *offset, *len]),
        Op::Free { id } => (index::FREE, &[id.0]),
        Op::Launch(_) => (index::LAUNCH, &[]),
        Op::Record { event } => (index::RECORD, &[event.0]),
        Op::Wait { event } => (index::WAIT, &[event.0]),
        Op::Fill {
            buf, offset, len, ..
        } => (index::FILL, &[buf.0, *offset, *len]),
        Op::Copy { src, dst, len } => (
            index::COPY,
            &[src.buf.0, src.offset, dst.buf.0, dst.offset, *len],
        ),
        Op::TimerStart { timer } => (index::TIMER_START, &[timer.0]),
        Op::TimerEnd { timer } => (index::TIMER_END, &[timer.0]),
        Op::GraphBegin { graph } => (index::GRAPH_BEGIN, &[graph.0]),
        Op::GraphEnd { graph } => (index::GRAPH_END, &[graph.0]),
        Op::GraphLaunch { graph } => (index::GRAPH_LAUNCH, &[graph.0]),
        Op::Gemm(_) | Op::RandFill(_) => {
            postcard_encode(c, out);
            return;
        }
        Op::PrepareBegin { prepared } => (index::PREPARE_BEGIN, &[prepared.0]),
        Op::Run {
            prepared,
            inputs,
            outputs,
        } => (index::RUN, &[prepared.0, *inputs, *outputs]),
    };
    varint(out, u64::from(c.stream));
    varint(out, u64::from(index));
    for &v in fields {
        varint(out, v);
    }
    match &c.op {
        Op::Launch(spec) => encode_launch(out, spec),
        // A `u8` is one byte, not a varint.
        Op::Fill { value, .. } => out.push(*value),
        // All in the fields above (`Gemm`, `RandFill`: encoded whole).
        Op::Alloc { .. }
        | Op::Write { .. }
        | Op::Read { .. }
        | Op::Free { .. }
        | Op::Record { .. }
        | Op::Wait { .. }
        | Op::Copy { .. }
        | Op::TimerStart { .. }
        | Op::TimerEnd { .. }
        | Op::GraphBegin { .. }
        | Op::GraphEnd { .. }
        | Op::GraphLaunch { .. }
        | Op::Gemm(_)
        | Op::RandFill(_)
        | Op::PrepareBegin { .. }
        | Op::Run { .. } => {}
    }
}

/// Appends a launch's fields as postcard writes a [`LaunchSpec`].
fn encode_launch(out: &mut Vec<u8>, spec: &LaunchSpec<'_>) {
    byte_string(out, &spec.module.0);
    byte_string(out, spec.kernel.as_bytes());
    // Arrays are tuples: no length.
    for d in spec.grid.iter().chain(&spec.block) {
        varint(out, u64::from(*d));
    }
    varint(out, u64::from(spec.shared_mem));
    varint(out, spec.args.len() as u64);
    for a in &spec.args {
        match a {
            LaunchArg::Scalar(b) => {
                varint(out, 0);
                byte_string(out, b);
            }
            LaunchArg::Mem { buf, offset } => {
                varint(out, 1);
                varint(out, buf.0);
                varint(out, *offset);
            }
            LaunchArg::Input(n) => {
                varint(out, 2);
                varint(out, u64::from(*n));
            }
            LaunchArg::Output => varint(out, 3),
        }
    }
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

#[cfg(test)]
mod written_by_hand {
    use std::borrow::Cow;

    use proptest::prelude::*;

    use super::{decode_commands, encode_commands, postcard_decode, CommandList, CommandSpares};
    use crate::{
        Command, Dtype, GemmSpec, Id, LaunchArg, LaunchSpec, ModuleHash, Op, Operand, RandDist,
        RandSpec, ScalarBytes,
    };

    /// Integers of every varint width, the widest and the edges among them.
    fn int() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..300,
            any::<u64>(),
            (0u32..64).prop_map(|b| 1u64 << b),
            (1u32..64).prop_map(|b| (1u64 << b) - 1),
            Just(u64::MAX),
        ]
    }

    fn id() -> impl Strategy<Value = Id> {
        int().prop_map(Id)
    }

    fn operand() -> impl Strategy<Value = Operand> {
        (id(), int()).prop_map(|(buf, offset)| Operand { buf, offset })
    }

    fn arg() -> impl Strategy<Value = LaunchArg<'static>> {
        prop_oneof![
            // Inline (up to 16 bytes) and owned scalars.
            proptest::collection::vec(any::<u8>(), 0..40)
                .prop_map(|b| LaunchArg::Scalar(ScalarBytes::copied(&b))),
            (id(), int()).prop_map(|(buf, offset)| LaunchArg::Mem { buf, offset }),
            any::<u32>().prop_map(LaunchArg::Input),
            Just(LaunchArg::Output),
        ]
    }

    fn launch() -> impl Strategy<Value = Op<'static>> {
        (
            any::<[u8; 32]>(),
            ".{0,200}",
            any::<[u32; 3]>(),
            any::<[u32; 3]>(),
            any::<u32>(),
            proptest::collection::vec(arg(), 0..20),
        )
            .prop_map(|(hash, kernel, grid, block, shared_mem, args)| {
                Op::Launch(LaunchSpec {
                    module: ModuleHash(hash),
                    kernel: Cow::Owned(kernel),
                    grid,
                    block,
                    shared_mem,
                    args,
                })
            })
    }

    fn library() -> impl Strategy<Value = Op<'static>> {
        let dtype = prop_oneof![
            Just(Dtype::F32),
            Just(Dtype::F64),
            Just(Dtype::Bf16),
            Just(Dtype::F16)
        ];
        prop_oneof![
            (
                dtype.clone(),
                operand(),
                operand(),
                operand(),
                int(),
                any::<[bool; 2]>()
            )
                .prop_map(|(dtype, a, b, c, m, transpose)| {
                    Op::Gemm(Box::new(GemmSpec {
                        dtype,
                        a,
                        b,
                        c,
                        m,
                        n: m / 3,
                        k: m / 7,
                        ld: [m, 1, 300],
                        transpose,
                        scalars: [m, u64::MAX],
                        batch: 1,
                        strides: [0, m, 2],
                    }))
                }),
            (
                dtype,
                operand(),
                int(),
                int(),
                proptest::option::of((int(), int()))
            )
                .prop_map(|(dtype, dst, len, seed, normal)| {
                    let dist = match normal {
                        Some((mean, std_dev)) => RandDist::Normal { mean, std_dev },
                        None => RandDist::Uniform,
                    };
                    Op::RandFill(RandSpec {
                        dtype,
                        dst,
                        len,
                        seed,
                        dist,
                    })
                }),
        ]
    }

    fn op() -> impl Strategy<Value = Op<'static>> {
        prop_oneof![
            (id(), int()).prop_map(|(buf, size)| Op::Alloc { buf, size }),
            (id(), int(), int()).prop_map(|(buf, offset, len)| Op::Write { buf, offset, len }),
            (id(), int(), int()).prop_map(|(buf, offset, len)| Op::Read { buf, offset, len }),
            id().prop_map(|id| Op::Free { id }),
            launch(),
            id().prop_map(|event| Op::Record { event }),
            id().prop_map(|event| Op::Wait { event }),
            (id(), int(), int(), any::<u8>()).prop_map(|(buf, offset, len, value)| Op::Fill {
                buf,
                offset,
                len,
                value
            }),
            (operand(), operand(), int()).prop_map(|(src, dst, len)| Op::Copy { src, dst, len }),
            id().prop_map(|timer| Op::TimerStart { timer }),
            id().prop_map(|timer| Op::TimerEnd { timer }),
            id().prop_map(|graph| Op::GraphBegin { graph }),
            id().prop_map(|graph| Op::GraphEnd { graph }),
            id().prop_map(|graph| Op::GraphLaunch { graph }),
            library(),
            id().prop_map(|prepared| Op::PrepareBegin { prepared }),
            (id(), int(), int()).prop_map(|(prepared, inputs, outputs)| Op::Run {
                prepared,
                inputs,
                outputs
            }),
        ]
    }

    fn command() -> impl Strategy<Value = Command<'static>> {
        (prop_oneof![0u32..4, any::<u32>(), Just(u32::MAX)], op())
            .prop_map(|(stream, op)| Command { stream, op })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The writer's bytes are postcard's, for every op and list length.
        #[test]
        fn a_command_list_is_written_as_postcard_writes_it(
            commands in proptest::collection::vec(command(), 0..200),
        ) {
            let mut hand = Vec::new();
            encode_commands(&mut hand, commands.len(), &commands);
            prop_assert_eq!(hand, postcard::to_stdvec(&commands).unwrap());
        }

        /// The reader gives back every list, and, from the list's bytes
        /// cut, damaged or lengthened, what serde gives (or refuses them as
        /// serde does).
        #[test]
        fn a_command_list_is_read_as_postcard_reads_it(
            commands in proptest::collection::vec(command(), 0..200),
            at in any::<usize>(),
            how in 0u8..4,
            byte in any::<u8>(),
        ) {
            let bytes = postcard::to_stdvec(&commands).unwrap();
            prop_assert_eq!(by_hand(&bytes), Some((commands, 0)));
            let mut bad = bytes;
            let i = at % (bad.len() + 1);
            match how {
                0 => bad.truncate(i),
                1 if i < bad.len() => bad[i] ^= byte.max(1),
                2 => bad.insert(i, byte),
                _ if i < bad.len() => bad[i] = byte,
                _ => bad.push(byte),
            }
            prop_assert_eq!(by_hand(&bad), by_serde(&bad));
        }

        /// Any bytes after a short count: read as serde reads them, or
        /// refused as serde refuses them.
        #[test]
        fn any_bytes_are_read_or_refused_as_postcard_does(
            count in 0u8..4,
            bytes in proptest::collection::vec(any::<u8>(), 0..96),
        ) {
            let mut b = vec![count];
            b.extend_from_slice(&bytes);
            prop_assert_eq!(by_hand(&b), by_serde(&b));
        }
    }

    thread_local! {
        /// The lists of the cases before, for the reader to reuse.
        static SPARES: std::cell::RefCell<CommandSpares> = Default::default();
    }

    /// What the reader makes of `b`: the commands and the bytes left after
    /// them. It reuses the storage of the lists read before (kept back
    /// after each case), so every case checks that what a reused list
    /// held does not show in the next.
    fn by_hand(b: &[u8]) -> Option<(Vec<Command<'_>>, usize)> {
        SPARES.with_borrow_mut(|spares| {
            let mut rest = b;
            let read = decode_commands(&mut rest, spares).ok()?;
            let copy = read.clone();
            spares.keep(CommandList(read));
            Some((copy, rest.len()))
        })
    }

    /// A list kept back is decoded into again: the same commands, in the
    /// lists (the commands' and each launch's arguments') of the one before.
    #[test]
    fn a_list_kept_back_is_reused_by_the_next() {
        let launch = |n: u64| Command {
            stream: 0,
            op: Op::Launch(LaunchSpec {
                module: ModuleHash([3; 32]),
                kernel: Cow::Borrowed("axpy"),
                grid: [1, 1, 1],
                block: [256, 1, 1],
                shared_mem: 0,
                args: vec![
                    LaunchArg::Scalar(ScalarBytes::copied(&0.5f32.to_le_bytes())),
                    LaunchArg::Mem {
                        buf: Id(n),
                        offset: 0,
                    },
                    LaunchArg::Mem {
                        buf: Id(n + 1),
                        offset: 8,
                    },
                ],
            }),
        };
        let first: Vec<Command<'static>> = (0..17).map(launch).collect();
        let second: Vec<Command<'static>> = (100..117).map(launch).collect();
        let wire = |c: &[Command<'_>]| {
            let mut out = Vec::new();
            encode_commands(&mut out, c.len(), c);
            out
        };
        let (w1, w2) = (wire(&first), wire(&second));
        let mut spares = CommandSpares::new();
        let a = CommandList::from_wire_reusing(&w1, &mut spares).unwrap();
        assert_eq!(a.0, first);
        let args = |l: &CommandList<'_>| -> Vec<*const LaunchArg<'static>> {
            let mut p: Vec<_> =
                l.0.iter()
                    .filter_map(|c| match &c.op {
                        Op::Launch(s) => Some(s.args.as_ptr().cast()),
                        _ => None,
                    })
                    .collect();
            p.sort();
            p
        };
        let (list, kept) = (a.0.as_ptr().cast::<Command<'static>>(), args(&a));
        spares.keep(a);
        let b = CommandList::from_wire_reusing(&w2, &mut spares).unwrap();
        assert_eq!(b.0, second);
        assert_eq!(b.0.as_ptr().cast(), list, "the list of commands is reused");
        assert_eq!(
            args(&b),
            kept,
            "each launch's arguments reuse one kept back"
        );
    }

    /// What serde makes of `b`, as [`by_hand`].
    fn by_serde(b: &[u8]) -> Option<(Vec<Command<'_>>, usize)> {
        let mut rest = b;
        postcard_decode::<CommandList<'_>>(&mut rest)
            .ok()
            .map(|c| (c.0, rest.len()))
    }

    /// Integers at the edges of their varints' widths (overlong, widest,
    /// one bit over) in a stream (`u32`), an id and a launch's dimension.
    #[test]
    fn varints_at_their_edges_are_read_as_postcard_reads_them() {
        let edges: [&[u8]; 9] = [
            &[0x00],
            &[0x80, 0x00],
            &[0xff, 0xff, 0xff, 0xff, 0x0f],
            &[0xff, 0xff, 0xff, 0xff, 0x10],
            &[0x80, 0x80, 0x80, 0x80, 0x00],
            &[0x80, 0x80, 0x80, 0x80, 0x80, 0x00],
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02],
            &[
                0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00,
            ],
        ];
        let launch = |dim: &[u8]| {
            // One launch on stream 0: module, kernel "k", grid (dim, 1, 1).
            let mut b = vec![1, 0, 4, 32];
            b.extend_from_slice(&[7; 32]);
            b.extend_from_slice(&[1, b'k']);
            b.extend_from_slice(dim);
            b.extend_from_slice(&[1, 1, 1, 1, 1, 0, 0]);
            b
        };
        let mut read = 0;
        for e in edges {
            let stream: Vec<u8> = [&[1][..], e, &[3, 5]].concat();
            let id: Vec<u8> = [&[1, 0, 3][..], e].concat();
            for b in [stream, id, launch(e)] {
                let hand = by_hand(&b);
                read += usize::from(hand.is_some());
                assert_eq!(hand, by_serde(&b), "{b:?}");
            }
        }
        // Both accepted and refused cases were met.
        assert!(read > 5 && read < 27, "{read} read");
    }
}
