//! The hand-written postcard codec of a batch's command list, byte for
//! byte what the serde derive writes and reads.

#[cfg(all(doc, feature = "node"))]
use super::Commands;
use super::{ArgView, CommandView, LaunchView, OpView};
#[cfg(feature = "node")]
use super::{Id, ModuleHash, ProtoError, MAX_BATCH_OPS, MAX_KERNEL_ARGS};

/// Appends `commands` (`n` of them) to `out` as postcard encodes a
/// `Vec<Command>` of the same commands: the inverse of
/// [`decode_commands`], without serde (the client encodes every
/// submission's commands on the round trip's path). The tests
/// `the_command_codec_agrees_with_serde` and `the_wire_form_is_the_protocols`
/// hold it to postcard's bytes.
pub(crate) fn encode_commands<'a>(
    out: &mut Vec<u8>,
    n: usize,
    commands: impl IntoIterator<Item = CommandView<'a>>,
) {
    put_varint(out, n as u64);
    for c in commands {
        encode_command(out, &c);
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

fn encode_command(out: &mut Vec<u8>, c: &CommandView<'_>) {
    let v = |out: &mut Vec<u8>, x: u64| put_varint(out, x);
    v(out, c.stream.into());
    match &c.op {
        OpView::Alloc { buf, size } => {
            v(out, 0);
            v(out, buf.0);
            v(out, *size);
        }
        OpView::Write { buf, offset, len } => {
            v(out, 1);
            v(out, buf.0);
            v(out, *offset);
            v(out, (*len).into());
        }
        OpView::Read { buf, offset, len } => {
            v(out, 2);
            v(out, buf.0);
            v(out, *offset);
            v(out, (*len).into());
        }
        OpView::Free { id } => {
            v(out, 3);
            v(out, id.0);
        }
        OpView::Launch(l) => {
            v(out, 4);
            encode_launch(out, l);
        }
        OpView::Record { event } => {
            v(out, 5);
            v(out, event.0);
        }
        OpView::Wait { event } => {
            v(out, 6);
            v(out, event.0);
        }
        OpView::Fill {
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
        OpView::Copy {
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
    }
}

/// A launch's body after its command kind: module hash, kernel name,
/// grid, block, shared memory, then the argument list.
#[inline]
fn encode_launch(out: &mut Vec<u8>, l: &LaunchView<'_>) {
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
fn encode_arg(out: &mut Vec<u8>, a: &ArgView<'_>) {
    let v = |out: &mut Vec<u8>, x: u64| put_varint(out, x);
    match a {
        ArgView::Scalar(b) => {
            v(out, 0);
            put_bytes(out, b);
        }
        ArgView::Mem { buf, offset } => {
            v(out, 1);
            v(out, buf.0);
            v(out, *offset);
        }
        ArgView::Input(n) => {
            v(out, 2);
            v(out, (*n).into());
        }
        ArgView::Output => v(out, 3),
    }
}

/// Decodes a batch's command list (a postcard `Vec<Command>`, the whole of
/// `wire`) as borrowed views, without serde: what the serde derive of
/// [`Commands`] does, value for value and error for error (the test
/// `the_command_codec_agrees_with_serde` holds it to that on every
/// command kind and on damaged input), in a third of the time. The node
/// and the worker each decode every BATCH's commands once, on the round
/// trip's path.
///
/// The list's length is refused over [`MAX_BATCH_OPS`], and a launch's
/// argument count over [`MAX_KERNEL_ARGS`], on the length prefix, before
/// any element is decoded.
///
/// # Errors
///
/// [`ProtoError::Body`] for input serde would refuse, or trailing bytes.
#[cfg(feature = "node")]
pub(crate) fn decode_commands(wire: &[u8]) -> Result<Vec<CommandView<'_>>, ProtoError> {
    let mut r = WireReader { b: wire };
    let n = r.len()?;
    if n > MAX_BATCH_OPS {
        return Err(r.error("too many commands"));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let stream = r.u32()?;
        let op = decode_op(&mut r)?;
        out.push(CommandView { stream, op });
    }
    if !r.b.is_empty() {
        return Err(ProtoError::Body(format!("{} trailing bytes", r.b.len())));
    }
    Ok(out)
}

/// One command's operation after its stream: the command kind, then that
/// kind's fields.
#[cfg(feature = "node")]
#[inline]
fn decode_op<'a>(r: &mut WireReader<'a>) -> Result<OpView<'a>, ProtoError> {
    Ok(match r.u32()? {
        0 => OpView::Alloc {
            buf: Id(r.u64()?),
            size: r.u64()?,
        },
        1 => OpView::Write {
            buf: Id(r.u64()?),
            offset: r.u64()?,
            len: r.u32()?,
        },
        2 => OpView::Read {
            buf: Id(r.u64()?),
            offset: r.u64()?,
            len: r.u32()?,
        },
        3 => OpView::Free { id: Id(r.u64()?) },
        4 => decode_launch(r)?,
        5 => OpView::Record {
            event: Id(r.u64()?),
        },
        6 => OpView::Wait {
            event: Id(r.u64()?),
        },
        7 => OpView::Fill {
            buf: Id(r.u64()?),
            offset: r.u64()?,
            len: r.u64()?,
            value: r.take(1)?[0],
        },
        8 => OpView::Copy {
            src: Id(r.u64()?),
            src_offset: r.u64()?,
            dst: Id(r.u64()?),
            dst_offset: r.u64()?,
            len: r.u64()?,
        },
        _ => return Err(r.error("unknown command kind")),
    })
}

/// A launch's body after its command kind: module hash, kernel name, grid,
/// block, shared memory, then the argument list (refused over
/// [`MAX_KERNEL_ARGS`] on its length prefix).
#[cfg(feature = "node")]
#[inline]
fn decode_launch<'a>(r: &mut WireReader<'a>) -> Result<OpView<'a>, ProtoError> {
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
            0 => ArgView::Scalar(r.bytes()?),
            1 => ArgView::Mem {
                buf: Id(r.u64()?),
                offset: r.u64()?,
            },
            2 => ArgView::Input(r.u32()?),
            3 => ArgView::Output,
            _ => return Err(r.error("unknown argument kind")),
        });
    }
    Ok(OpView::Launch(LaunchView {
        module,
        kernel,
        grid,
        block,
        shared_mem,
        args,
    }))
}

/// Postcard's encoding read by hand: unsigned integers as LEB128 varints
/// of at most their type's width (a longer one, or one whose last byte
/// overflows the type, is refused as postcard refuses it), `u8` as one
/// byte, byte strings and sequences after a varint length.
#[cfg(feature = "node")]
struct WireReader<'a> {
    b: &'a [u8],
}

#[cfg(feature = "node")]
impl<'a> WireReader<'a> {
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
}

#[cfg(all(test, feature = "node"))]
mod tests {
    use super::*;
    use crate::proto::{from_body, to_body, Command, Commands, KernelArg, LaunchSpec, Op};

    /// One command of every kind, and a launch with every kind of argument.
    #[cfg(feature = "node")]
    fn every_command() -> Vec<Command> {
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
                len: u32::MAX,
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
                    KernelArg::Scalar(vec![1, 2, 3, 4, 5, 6, 7, 8, 9]),
                    KernelArg::mem(id(1)),
                    KernelArg::Mem {
                        buf: id(2),
                        offset: big,
                    },
                    KernelArg::Input(3),
                    KernelArg::Output,
                    KernelArg::Scalar(Vec::new()),
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
        ]
        .into_iter()
        .enumerate()
        .map(|(i, op)| Command {
            stream: [0, 1, 200, u32::MAX][i % 4],
            op,
        })
        .collect()
    }

    /// `decode_commands` against the serde derive it stands in for: equal
    /// values, or both refused.
    #[cfg(feature = "node")]
    fn agrees_with_serde(wire: &[u8]) {
        let fast = decode_commands(wire);
        let serde = from_body::<Commands<'_>>(wire);
        match (&fast, &serde) {
            (Ok(a), Ok(Commands(b))) => assert_eq!(a, b, "input {wire:?}"),
            (Err(_), Err(_)) => {}
            _ => panic!("decode_commands {fast:?} but serde {serde:?} for {wire:?}"),
        }
    }

    #[test]
    #[cfg(feature = "node")]
    fn the_command_codec_agrees_with_serde() {
        let commands = every_command();
        let wire = to_body(&commands);
        let mut ours = Vec::new();
        encode_commands(
            &mut ours,
            commands.len(),
            commands.iter().map(CommandView::from),
        );
        assert_eq!(ours, wire);
        let back = decode_commands(&wire).unwrap();
        assert_eq!(
            back,
            commands.iter().map(CommandView::from).collect::<Vec<_>>()
        );
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
        let many = to_body(&((MAX_BATCH_OPS + 1) as u64));
        assert!(decode_commands(&many).is_err());
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
}
