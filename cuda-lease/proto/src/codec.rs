//! One codec trait that every wire type implements ([`Codec`]), and its
//! implementations: postcard through serde for the message bodies, and by
//! hand for a batch's command list (the node and the worker decode every
//! BATCH's commands on the round trip's path, and the hand decoder takes a
//! third of serde's time). Both write the same bytes: the command types
//! keep their serde derive as the reference, and the test
//! `the_command_codec_agrees_with_serde` holds the hand codec to it on
//! every command kind and on damaged input.

use super::{Batch, Command, Id, KernelArg, LaunchSpec, ModuleHash, Op, ProtoError};
use super::{
    BatchReply, BulkOpen, BulkTickets, DeviceInfo, ErrorBody, GpuSubmit, Hello, HelloOk, IdOp,
    Inventory, LeaseAlloc,
};
use super::{LeaseGrant, LeaseId, LeaseRef, LeaseRenew, LeaseStatus, MemAlloc, MemRead, MemWrite};
use super::{ModuleUse, MAX_BATCH_OPS, MAX_KERNEL_ARGS, MAX_SCALAR_ARG};
use std::borrow::Cow;

/// A type with a wire form: every message body of the protocol (and of
/// the node-to-worker pipe) implements it, as quinn's frames implement
/// its `Codec`. [`to_body`](super::to_body) and
/// [`from_body`](super::from_body) go through it.
pub trait Codec<'a>: Sized {
    /// Appends the value's wire form to `out`.
    fn encode(&self, out: &mut Vec<u8>);

    /// Decodes one value from the front of `buf`, advancing `buf` past it.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Body`] for bytes that are not one value.
    fn decode(buf: &mut &'a [u8]) -> Result<Self, ProtoError>;
}

/// Appends `msg` as postcard writes it.
pub fn postcard_encode<T: serde::Serialize + ?Sized>(msg: &T, out: &mut Vec<u8>) {
    // Serializing our own plain-data types into a Vec cannot fail.
    if let Ok(v) = postcard::to_extend(msg, std::mem::take(out)) {
        *out = v;
    }
}

/// Decodes one postcard value from the front of `buf`.
pub fn postcard_decode<'a, T: serde::Deserialize<'a>>(buf: &mut &'a [u8]) -> Result<T, ProtoError> {
    let (v, rest) = postcard::take_from_bytes(buf).map_err(|e| ProtoError::Body(e.to_string()))?;
    *buf = rest;
    Ok(v)
}

/// Implements [`Codec`] through postcard for plain-data messages.
#[doc(hidden)]
#[macro_export]
macro_rules! postcard_codec {
    ($($t:ty),* $(,)?) => {$(
        impl<'a> $crate::Codec<'a> for $t {
            fn encode(&self, out: &mut Vec<u8>) {
                $crate::postcard_encode(self, out)
            }
            fn decode(buf: &mut &'a [u8]) -> Result<Self, $crate::ProtoError> {
                $crate::postcard_decode(buf)
            }
        }
    )*};
}

postcard_codec!(
    (),
    BatchReply,
    BulkOpen,
    BulkTickets,
    DeviceInfo,
    ErrorBody,
    Hello,
    HelloOk,
    IdOp,
    Inventory,
    LeaseAlloc,
    LeaseGrant,
    LeaseRef,
    LeaseRenew,
    LeaseStatus,
    MemAlloc,
    MemRead,
    MemWrite,
);

impl<'a> Codec<'a> for GpuSubmit<'a> {
    fn encode(&self, out: &mut Vec<u8>) {
        postcard_encode(self, out);
    }
    fn decode(buf: &mut &'a [u8]) -> Result<Self, ProtoError> {
        postcard_decode(buf)
    }
}

impl<'a> Codec<'a> for LaunchSpec<'a> {
    fn encode(&self, out: &mut Vec<u8>) {
        encode_launch(out, self);
    }
    fn decode(buf: &mut &'a [u8]) -> Result<Self, ProtoError> {
        WireReader::on(buf, decode_launch)
    }
}

impl<'a> Codec<'a> for Command<'a> {
    fn encode(&self, out: &mut Vec<u8>) {
        encode_command(out, self);
    }
    fn decode(buf: &mut &'a [u8]) -> Result<Self, ProtoError> {
        WireReader::on(buf, decode_command)
    }
}

/// A batch's command list: its length, then each command (refused over
/// [`MAX_BATCH_OPS`] on the length prefix, before any command is
/// decoded).
impl<'a> Codec<'a> for Vec<Command<'a>> {
    fn encode(&self, out: &mut Vec<u8>) {
        encode_commands(out, self.len(), self);
    }
    fn decode(buf: &mut &'a [u8]) -> Result<Self, ProtoError> {
        WireReader::on(buf, |r| {
            let n = r.len()?;
            if n > MAX_BATCH_OPS {
                return Err(r.error("too many commands"));
            }
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                out.push(decode_command(r)?);
            }
            Ok(out)
        })
    }
}

/// The fields of [`Batch`] before its commands, in its order.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct BatchHead {
    pub(crate) lease: LeaseId,
    pub(crate) seq: u64,
    #[serde(deserialize_with = "super::bounded::modules")]
    pub(crate) modules: Vec<ModuleUse>,
}

/// A BATCH body: its head through postcard, then its command list.
impl<'a> Codec<'a> for Batch<'a> {
    fn encode(&self, out: &mut Vec<u8>) {
        encode_batch_head(out, self.lease, self.seq, &self.modules);
        self.commands.encode(out);
    }
    fn decode(buf: &mut &'a [u8]) -> Result<Self, ProtoError> {
        let head: BatchHead = postcard_decode(buf)?;
        Ok(Batch {
            lease: head.lease,
            seq: head.seq,
            modules: head.modules,
            commands: Codec::decode(buf)?,
        })
    }
}

/// Appends a BATCH body's fields before its commands.
pub fn encode_batch_head(out: &mut Vec<u8>, lease: LeaseId, seq: u64, modules: &[ModuleUse]) {
    #[derive(serde::Serialize)]
    struct HeadRef<'m> {
        lease: LeaseId,
        seq: u64,
        modules: &'m [ModuleUse],
    }
    postcard_encode(
        &HeadRef {
            lease,
            seq,
            modules,
        },
        out,
    );
}

impl<'a> Batch<'a> {
    /// Decodes a BATCH body, and returns with it the bytes of its
    /// command list as they came: a node forwards them to its worker
    /// without encoding them again.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Body`] as [`from_body`](super::from_body).
    #[doc(hidden)]
    pub fn decode_keeping_wire(mut body: &'a [u8]) -> Result<(Self, &'a [u8]), ProtoError> {
        let head: BatchHead = postcard_decode(&mut body)?;
        let wire = body;
        let commands = super::from_body(wire)?;
        let batch = Batch {
            lease: head.lease,
            seq: head.seq,
            modules: head.modules,
            commands,
        };
        Ok((batch, wire))
    }
}

/// Appends `commands` (`n` of them) to `out` as a command list: the
/// client streams a submission's commands straight into its BATCH
/// through this, without collecting them first.
pub fn encode_commands<'c, 'a: 'c>(
    out: &mut Vec<u8>,
    n: usize,
    commands: impl IntoIterator<Item = impl std::borrow::Borrow<Command<'a>>>,
) {
    put_varint(out, n as u64);
    for c in commands {
        encode_command(out, c.borrow());
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn encode_command(out: &mut Vec<u8>, c: &Command<'_>) {
    let v = |out: &mut Vec<u8>, x: u64| put_varint(out, x);
    v(out, c.stream.into());
    match &c.op {
        Op::Alloc { buf, size } => {
            v(out, 0);
            v(out, buf.0);
            v(out, *size);
        }
        Op::Write { buf, offset, len } => {
            v(out, 1);
            v(out, buf.0);
            v(out, *offset);
            v(out, *len);
        }
        Op::Read { buf, offset, len } => {
            v(out, 2);
            v(out, buf.0);
            v(out, *offset);
            v(out, *len);
        }
        Op::Free { id } => {
            v(out, 3);
            v(out, id.0);
        }
        Op::Launch(l) => {
            v(out, 4);
            encode_launch(out, l);
        }
        Op::Record { event } => {
            v(out, 5);
            v(out, event.0);
        }
        Op::Wait { event } => {
            v(out, 6);
            v(out, event.0);
        }
        Op::Fill {
            buf,
            offset,
            len,
            value,
        } => {
            v(out, 7);
            v(out, buf.0);
            v(out, *offset);
            v(out, *len);
            out.push(*value);
        }
        Op::Copy {
            src,
            src_offset,
            dst,
            dst_offset,
            len,
        } => {
            v(out, 8);
            v(out, src.0);
            v(out, *src_offset);
            v(out, dst.0);
            v(out, *dst_offset);
            v(out, *len);
        }
        Op::TimerStart { timer } => {
            v(out, 9);
            v(out, timer.0);
        }
        Op::TimerEnd { timer } => {
            v(out, 10);
            v(out, timer.0);
        }
        Op::GraphBegin { graph } => {
            v(out, 11);
            v(out, graph.0);
        }
        Op::GraphEnd { graph } => {
            v(out, 12);
            v(out, graph.0);
        }
        Op::GraphLaunch { graph } => {
            v(out, 13);
            v(out, graph.0);
        }
    }
}

/// A launch's body after its command kind: module hash, kernel name,
/// grid, block, shared memory, then the argument list.
#[inline]
fn encode_launch(out: &mut Vec<u8>, l: &LaunchSpec<'_>) {
    let v = |out: &mut Vec<u8>, x: u64| put_varint(out, x);
    out.extend_from_slice(&l.module.0);
    put_bytes(out, l.kernel.as_bytes());
    for d in l.grid.iter().chain(&l.block) {
        v(out, (*d).into());
    }
    v(out, l.shared_mem.into());
    v(out, l.args.len() as u64);
    for a in &l.args {
        encode_arg(out, a);
    }
}

/// One kernel argument: its kind, then its fields.
#[inline]
fn encode_arg(out: &mut Vec<u8>, a: &KernelArg<'_>) {
    let v = |out: &mut Vec<u8>, x: u64| put_varint(out, x);
    match a {
        KernelArg::Scalar(b) => {
            v(out, 0);
            put_bytes(out, b);
        }
        KernelArg::Mem { buf, offset } => {
            v(out, 1);
            v(out, buf.0);
            v(out, *offset);
        }
        KernelArg::Input(n) => {
            v(out, 2);
            v(out, (*n).into());
        }
        KernelArg::Output => v(out, 3),
    }
}

/// One command: its stream, its kind, then that kind's fields.
#[inline]
fn decode_command<'a>(r: &mut WireReader<'a>) -> Result<Command<'a>, ProtoError> {
    let stream = r.u32()?;
    let op = match r.u32()? {
        0 => Op::Alloc {
            buf: Id(r.u64()?),
            size: r.u64()?,
        },
        1 => Op::Write {
            buf: Id(r.u64()?),
            offset: r.u64()?,
            len: r.u64()?,
        },
        2 => Op::Read {
            buf: Id(r.u64()?),
            offset: r.u64()?,
            len: r.u64()?,
        },
        3 => Op::Free { id: Id(r.u64()?) },
        4 => Op::Launch(decode_launch(r)?),
        5 => Op::Record {
            event: Id(r.u64()?),
        },
        6 => Op::Wait {
            event: Id(r.u64()?),
        },
        7 => Op::Fill {
            buf: Id(r.u64()?),
            offset: r.u64()?,
            len: r.u64()?,
            value: r.take(1)?[0],
        },
        8 => Op::Copy {
            src: Id(r.u64()?),
            src_offset: r.u64()?,
            dst: Id(r.u64()?),
            dst_offset: r.u64()?,
            len: r.u64()?,
        },
        9 => Op::TimerStart {
            timer: Id(r.u64()?),
        },
        10 => Op::TimerEnd {
            timer: Id(r.u64()?),
        },
        11 => Op::GraphBegin {
            graph: Id(r.u64()?),
        },
        12 => Op::GraphEnd {
            graph: Id(r.u64()?),
        },
        13 => Op::GraphLaunch {
            graph: Id(r.u64()?),
        },
        _ => return Err(r.error("unknown command kind")),
    };
    Ok(Command { stream, op })
}

/// A launch: module hash, kernel name, grid, block, shared memory, then
/// the argument list (refused over [`MAX_KERNEL_ARGS`] on its length
/// prefix).
#[inline]
fn decode_launch<'a>(r: &mut WireReader<'a>) -> Result<LaunchSpec<'a>, ProtoError> {
    let module = ModuleHash(r.take(32)?.try_into().expect("32 bytes"));
    let kernel = std::str::from_utf8(r.bytes()?).map_err(|_| r.error("a name is not UTF-8"))?;
    let grid = [r.u32()?, r.u32()?, r.u32()?];
    let block = [r.u32()?, r.u32()?, r.u32()?];
    let shared_mem = r.u32()?;
    let n = r.len()?;
    if n > MAX_KERNEL_ARGS {
        return Err(r.error("too many kernel arguments"));
    }
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        args.push(match r.u32()? {
            0 => KernelArg::Scalar(Cow::Borrowed(r.scalar()?)),
            1 => KernelArg::Mem {
                buf: Id(r.u64()?),
                offset: r.u64()?,
            },
            2 => KernelArg::Input(r.u32()?),
            3 => KernelArg::Output,
            _ => return Err(r.error("unknown argument kind")),
        });
    }
    Ok(LaunchSpec {
        module,
        kernel: Cow::Borrowed(kernel),
        grid,
        block,
        shared_mem,
        args,
    })
}

/// Postcard's encoding read by hand: unsigned integers as LEB128 varints
/// of at most their type's width (a longer one, or one whose last byte
/// overflows the type, is refused as postcard refuses it), `u8` as one
/// byte, byte strings and sequences after a varint length.
struct WireReader<'a> {
    b: &'a [u8],
}

impl<'a> WireReader<'a> {
    /// `read` from the front of `buf`, which then starts after what it read.
    #[inline]
    fn on<T>(
        buf: &mut &'a [u8],
        read: impl FnOnce(&mut WireReader<'a>) -> Result<T, ProtoError>,
    ) -> Result<T, ProtoError> {
        let mut r = WireReader { b: buf };
        let v = read(&mut r)?;
        *buf = r.b;
        Ok(v)
    }

    fn error(&self, what: &str) -> ProtoError {
        ProtoError::Body(format!("{what} ({} bytes left)", self.b.len()))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if n > self.b.len() {
            return Err(self.error("truncated"));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    /// A varint of at most `max` bytes whose last byte is at most `last`.
    #[inline]
    fn varint(&mut self, max: usize, last: u8) -> Result<u64, ProtoError> {
        let mut out = 0u64;
        for i in 0..max {
            let Some((&v, rest)) = self.b.split_first() else {
                return Err(self.error("truncated"));
            };
            self.b = rest;
            out |= u64::from(v & 0x7f) << (7 * i);
            if v & 0x80 == 0 {
                if i == max - 1 && v > last {
                    return Err(self.error("bad varint"));
                }
                return Ok(out);
            }
        }
        Err(self.error("bad varint"))
    }

    fn u32(&mut self) -> Result<u32, ProtoError> {
        // 5 bytes; the last carries 4 bits.
        self.varint(5, 0x0f).map(|v| v as u32)
    }

    fn u64(&mut self) -> Result<u64, ProtoError> {
        // 10 bytes; the last carries 1 bit.
        self.varint(10, 0x01)
    }

    fn len(&mut self) -> Result<usize, ProtoError> {
        self.u64().map(|v| v as usize)
    }

    fn bytes(&mut self) -> Result<&'a [u8], ProtoError> {
        let n = self.len()?;
        self.take(n)
    }

    /// A scalar argument's bytes (at most [`MAX_SCALAR_ARG`], as serde's
    /// `bounded::scalar` refuses a longer one).
    fn scalar(&mut self) -> Result<&'a [u8], ProtoError> {
        let b = self.bytes()?;
        if b.len() > MAX_SCALAR_ARG {
            return Err(self.error("a scalar argument is too long"));
        }
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{from_body, to_body};

    /// The serde derive's reading of a command list, the reference.
    #[derive(Debug, serde::Deserialize)]
    struct SerdeCommands<'a>(
        #[serde(borrow, deserialize_with = "crate::bounded::commands")] Vec<Command<'a>>,
    );

    fn serde_decode(wire: &[u8]) -> Result<Vec<Command<'_>>, String> {
        match postcard::take_from_bytes::<SerdeCommands<'_>>(wire) {
            Ok((c, [])) => Ok(c.0),
            Ok((_, rest)) => Err(format!("{} trailing bytes", rest.len())),
            Err(e) => Err(e.to_string()),
        }
    }

    fn serde_encode(commands: &[Command<'_>]) -> Vec<u8> {
        postcard::to_allocvec(commands).unwrap()
    }

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
                    KernelArg::bytes([1, 2, 3, 4, 5, 6, 7, 8, 9]),
                    KernelArg::mem(id(1)),
                    KernelArg::Mem {
                        buf: id(2),
                        offset: big,
                    },
                    KernelArg::Input(3),
                    KernelArg::Output,
                    KernelArg::bytes([]),
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
                src: id(1),
                src_offset: 1,
                dst: id(2),
                dst_offset: 2,
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

    /// The hand codec against the serde derive it stands in for: equal
    /// values, or both refused.
    fn agrees_with_serde(wire: &[u8]) {
        let fast = from_body::<Vec<Command<'_>>>(wire);
        let serde = serde_decode(wire);
        match (&fast, &serde) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "input {wire:?}"),
            (Err(_), Err(_)) => {}
            _ => panic!("the codec {fast:?} but serde {serde:?} for {wire:?}"),
        }
    }

    #[test]
    fn the_command_codec_agrees_with_serde() {
        let commands = every_command();
        let wire = serde_encode(&commands);
        assert_eq!(to_body(&commands), wire);
        let mut streamed = Vec::new();
        encode_commands(&mut streamed, commands.len(), &commands);
        assert_eq!(streamed, wire);
        let back = from_body::<Vec<Command<'_>>>(&wire).unwrap();
        assert_eq!(back, commands);
        // Every cut, every one-byte change, and one byte too many.
        for n in 0..wire.len() {
            agrees_with_serde(&wire[..n]);
        }
        for i in 0..wire.len() {
            for v in [0x00, 0x01, 0x0f, 0x10, 0x7f, 0x80, 0xff, wire[i] ^ 0x01] {
                let mut bad = wire.clone();
                bad[i] = v;
                agrees_with_serde(&bad);
            }
        }
        let mut long = wire.clone();
        long.push(0);
        agrees_with_serde(&long);
        // Varints at their width's edge: the last byte's spare bits set, and
        // one byte too long (a u32 stream id, then a u64 buffer id).
        for stream in [
            &[0xff, 0xff, 0xff, 0xff, 0x0f][..],
            &[0xff, 0xff, 0xff, 0xff, 0x10],
        ] {
            let mut w = vec![1];
            w.extend_from_slice(stream);
            w.extend_from_slice(&[3, 5]);
            agrees_with_serde(&w);
        }
        for id in [&[0xff; 9][..], &[0xff; 10][..]] {
            let mut w = vec![1, 0, 3];
            w.extend_from_slice(id);
            w.push(0x01);
            agrees_with_serde(&w);
            w.pop();
            w.push(0x02);
            agrees_with_serde(&w);
        }
        // Counts over the limits are refused before anything is decoded.
        let many = postcard::to_allocvec(&((MAX_BATCH_OPS + 1) as u64)).unwrap();
        assert!(from_body::<Vec<Command<'_>>>(&many).is_err());
        // A scalar argument over its limit, as serde refuses it.
        let mut long = every_command();
        if let Op::Launch(l) = &mut long[4].op {
            l.args[0] = KernelArg::bytes(vec![7; MAX_SCALAR_ARG + 1]);
        }
        let wire = serde_encode(&long);
        assert!(from_body::<Vec<Command<'_>>>(&wire).is_err());
        agrees_with_serde(&wire);
        // Pseudo-random bytes behind a plausible start.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            let len = (x % 64) as usize;
            let mut w = vec![(x >> 8) as u8 % 4];
            for _ in 0..len {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.push((x >> 24) as u8);
            }
            agrees_with_serde(&w);
        }
    }

    #[test]
    fn a_batch_encodes_as_serde_and_keeps_its_commands_wire() {
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
            // Trailing bytes are refused as by `from_body`.
            let mut long = body.clone();
            long.push(0);
            assert!(Batch::decode_keeping_wire(&long).is_err());
        }
    }
}
