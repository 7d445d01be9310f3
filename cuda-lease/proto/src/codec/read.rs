//! Command lists read by hand, as postcard reads them through serde: the
//! same values from the same bytes, and the same bytes refused (tests
//! compare the two on valid lists and on cut and damaged ones).

use std::borrow::Cow;

use super::index;

use crate::{
    Command, Id, LaunchArg, LaunchSpec, ModuleHash, Op, Operand, ProtoError, ScalarBytes,
    MAX_BATCH_OPS, MAX_KERNEL_ARGS, MAX_SCALAR_ARG,
};

/// Decodes a command list off the front of `buf`, advancing `buf` (see
/// [`CommandList::from_wire`](super::CommandList::from_wire)); its lists
/// are taken from `spares` where it has some.
pub(crate) fn decode_commands<'a>(
    buf: &mut &'a [u8],
    spares: &mut CommandSpares,
) -> Result<Vec<Command<'a>>, ProtoError> {
    let mut r = Reader { buf, spares };
    let n = r.len()?;
    if n > MAX_BATCH_OPS {
        return Err(too_long(n, MAX_BATCH_OPS));
    }
    let mut commands = emptied(std::mem::take(&mut r.spares.commands));
    commands.reserve(n);
    for _ in 0..n {
        commands.push(r.command()?);
    }
    *buf = r.buf;
    Ok(commands)
}

/// Argument lists a [`CommandSpares`] keeps at most.
const SPARE_ARG_LISTS: usize = 256;

/// Argument lists of at most this capacity are kept (a launch's usual few).
const SPARE_ARGS_CAPACITY: usize = 16;

/// The emptied lists of decoded command lists, which the next lists
/// decoded with them reuse instead of allocating their own (see
/// [`CommandList::from_wire_reusing`](super::CommandList::from_wire_reusing)).
/// Bounded: at most 256 argument lists of up to 16 arguments each, and
/// one list of commands.
#[derive(Debug, Default)]
pub struct CommandSpares {
    commands: Vec<Command<'static>>,
    args: Vec<Vec<LaunchArg<'static>>>,
}

impl CommandSpares {
    /// No spares.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes back `list`'s storage; its commands are dropped.
    pub fn keep(&mut self, list: super::CommandList<'_>) {
        let mut commands = list.0;
        for c in commands.drain(..) {
            if let Op::Launch(spec) = c.op {
                let args = spec.args;
                if self.args.len() < SPARE_ARG_LISTS
                    && (1..=SPARE_ARGS_CAPACITY).contains(&args.capacity())
                {
                    self.args.push(emptied(args));
                }
            }
        }
        if commands.capacity() > self.commands.capacity() {
            self.commands = emptied(commands);
        }
    }

    /// An empty argument list with room for `n`.
    fn args<'a>(&mut self, n: usize) -> Vec<LaunchArg<'a>> {
        match self.args.pop() {
            Some(spare) => {
                let mut args = emptied(spare);
                args.reserve(n);
                args
            }
            None => Vec::with_capacity(n),
        }
    }
}

/// `v` emptied, as a list of the same type of another lifetime, in the
/// same allocation (collected in place: the layouts are the same).
fn emptied<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

/// The bytes not read yet.
struct Reader<'a, 's> {
    buf: &'a [u8],
    spares: &'s mut CommandSpares,
}

impl<'a> Reader<'a, '_> {
    #[inline]
    fn byte(&mut self) -> Result<u8, ProtoError> {
        let (&b, rest) = self.buf.split_first().ok_or_else(ended)?;
        self.buf = rest;
        Ok(b)
    }

    /// An unsigned LEB128 integer of at most `bytes` bytes, the last of
    /// which may carry at most `last` (postcard's bounds for a type).
    #[inline]
    fn varint(&mut self, bytes: u32, last: u8) -> Result<u64, ProtoError> {
        // Most integers of a command list take one byte.
        if let Some((&b, rest)) = self.buf.split_first() {
            if b < 0x80 {
                self.buf = rest;
                return Ok(u64::from(b));
            }
        }
        self.wide_varint(bytes, last)
    }

    #[cold]
    fn wide_varint(&mut self, bytes: u32, last: u8) -> Result<u64, ProtoError> {
        let mut out = 0u64;
        for i in 0..bytes {
            let b = self.byte()?;
            out |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                if i == bytes - 1 && b > last {
                    break;
                }
                return Ok(out);
            }
        }
        Err(ProtoError::Body("a varint out of its type's range".into()))
    }

    fn u64(&mut self) -> Result<u64, ProtoError> {
        self.varint(10, 0x01)
    }

    fn u32(&mut self) -> Result<u32, ProtoError> {
        // At most 32 bits: checked by the last byte's bound.
        self.varint(5, 0x0f).map(|v| v as u32)
    }

    fn id(&mut self) -> Result<Id, ProtoError> {
        self.u64().map(Id)
    }

    /// A sequence's or a byte string's length.
    fn len(&mut self) -> Result<usize, ProtoError> {
        let n = self.u64()?;
        usize::try_from(n).map_err(|_| ended())
    }

    /// A byte string or a `str`'s bytes: its length, then them.
    fn bytes(&mut self) -> Result<&'a [u8], ProtoError> {
        let n = self.len()?;
        if n > self.buf.len() {
            return Err(ended());
        }
        let (b, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(b)
    }

    fn operand(&mut self) -> Result<Operand, ProtoError> {
        Ok(Operand {
            buf: self.id()?,
            offset: self.u64()?,
        })
    }

    fn command(&mut self) -> Result<Command<'a>, ProtoError> {
        let start = self.buf;
        let stream = self.u32()?;
        // The variant's index (the encoder's table, [`index`]).
        let op = match self.u32()? {
            index::ALLOC => Op::Alloc {
                buf: self.id()?,
                size: self.u64()?,
            },
            index::WRITE => Op::Write {
                buf: self.id()?,
                offset: self.u64()?,
                len: self.u64()?,
            },
            index::READ => Op::Read {
                buf: self.id()?,
                offset: self.u64()?,
                len: self.u64()?,
            },
            index::FREE => Op::Free { id: self.id()? },
            index::LAUNCH => Op::Launch(self.launch()?),
            index::RECORD => Op::Record { event: self.id()? },
            index::WAIT => Op::Wait { event: self.id()? },
            index::FILL => Op::Fill {
                buf: self.id()?,
                offset: self.u64()?,
                len: self.u64()?,
                // A `u8` is one byte, not a varint.
                value: self.byte()?,
            },
            index::COPY => Op::Copy {
                src: self.operand()?,
                dst: self.operand()?,
                len: self.u64()?,
            },
            index::TIMER_START => Op::TimerStart { timer: self.id()? },
            index::TIMER_END => Op::TimerEnd { timer: self.id()? },
            index::GRAPH_BEGIN => Op::GraphBegin { graph: self.id()? },
            index::GRAPH_END => Op::GraphEnd { graph: self.id()? },
            index::GRAPH_LAUNCH => Op::GraphLaunch { graph: self.id()? },
            index::GEMM | index::RAND_FILL => {
                // `Gemm`, `RandFill`: the whole command again, through serde.
                self.buf = start;
                return super::postcard_decode(&mut self.buf);
            }
            index::PREPARE_BEGIN => Op::PrepareBegin {
                prepared: self.id()?,
            },
            index::RUN => Op::Run {
                prepared: self.id()?,
                inputs: self.u64()?,
                outputs: self.u64()?,
            },
            v => {
                return Err(ProtoError::Body(format!(
                    "unknown op: variant index {v}, expected 0 to {}",
                    index::END - 1
                )))
            }
        };
        Ok(Command { stream, op })
    }

    fn launch(&mut self) -> Result<LaunchSpec<'a>, ProtoError> {
        let hash = self.bytes()?;
        let module = ModuleHash(hash.try_into().map_err(|_| {
            ProtoError::Body(format!(
                "a module hash of {} bytes, expected 32",
                hash.len()
            ))
        })?);
        let kernel = std::str::from_utf8(self.bytes()?)
            .map_err(|_| ProtoError::Body("a kernel name that is not UTF-8".into()))?;
        let mut dims = [0u32; 6];
        for d in &mut dims {
            *d = self.u32()?;
        }
        let shared_mem = self.u32()?;
        let n = self.len()?;
        if n > MAX_KERNEL_ARGS {
            return Err(too_long(n, MAX_KERNEL_ARGS));
        }
        let mut args = self.spares.args(n);
        for _ in 0..n {
            args.push(self.arg()?);
        }
        Ok(LaunchSpec {
            module,
            kernel: Cow::Borrowed(kernel),
            grid: [dims[0], dims[1], dims[2]],
            block: [dims[3], dims[4], dims[5]],
            shared_mem,
            args,
        })
    }

    fn arg(&mut self) -> Result<LaunchArg<'a>, ProtoError> {
        Ok(match self.u32()? {
            0 => {
                let b = self.bytes()?;
                if b.len() > MAX_SCALAR_ARG {
                    return Err(ProtoError::Body(format!(
                        "a scalar argument of {} bytes, at most {MAX_SCALAR_ARG}",
                        b.len()
                    )));
                }
                LaunchArg::Scalar(ScalarBytes::borrowed(b))
            }
            1 => LaunchArg::Mem {
                buf: self.id()?,
                offset: self.u64()?,
            },
            2 => LaunchArg::Input(self.u32()?),
            3 => LaunchArg::Output,
            v => {
                return Err(ProtoError::Body(format!(
                    "unknown kernel argument: variant index {v}, expected 0 to 3"
                )))
            }
        })
    }
}

fn ended() -> ProtoError {
    ProtoError::Body("the command list ends early".into())
}

fn too_long(n: usize, max: usize) -> ProtoError {
    ProtoError::Body(format!(
        "invalid length {n}, expected a sequence of at most {max} elements"
    ))
}
