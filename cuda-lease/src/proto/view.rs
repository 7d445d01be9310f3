//! Borrowed views of commands and batches: the same wire form as the
//! owned messages, decoded without allocating names and scalars.

use serde::{Deserialize, Serialize};

#[cfg(all(doc, feature = "node"))]
use super::from_body;
use super::messages::validate_launch;
use super::{bounded, Command, Id, KernelArg, LaunchSpec, ModuleHash, Op, ProtoError, StreamId};
#[cfg(feature = "node")]
use super::{decode_commands, validate_batch, Batch, LeaseId, ModuleUse};

/// A [`Command`] that borrows its kernel name and scalar arguments: it
/// encodes to the same bytes, and decodes from a message without
/// allocating them (the node plans and the worker runs these).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CommandView<'a> {
    pub(crate) stream: StreamId,
    #[serde(borrow)]
    pub(crate) op: OpView<'a>,
}

/// [`Op`], borrowed: the same variants in the same order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub(crate) enum OpView<'a> {
    Alloc {
        buf: Id,
        size: u64,
    },
    Write {
        buf: Id,
        offset: u64,
        len: u32,
    },
    Read {
        buf: Id,
        offset: u64,
        len: u32,
    },
    Free {
        id: Id,
    },
    Launch(#[serde(borrow)] LaunchView<'a>),
    Record {
        event: Id,
    },
    Wait {
        event: Id,
    },
    Fill {
        buf: Id,
        offset: u64,
        len: u64,
        value: u8,
    },
    Copy {
        src: Id,
        src_offset: u64,
        dst: Id,
        dst_offset: u64,
        len: u64,
    },
}

/// [`LaunchSpec`], borrowed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LaunchView<'a> {
    pub(crate) module: ModuleHash,
    pub(crate) kernel: &'a str,
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) shared_mem: u32,
    #[serde(borrow, deserialize_with = "bounded::arg_views")]
    pub(crate) args: Vec<ArgView<'a>>,
}

impl LaunchView<'_> {
    /// As [`LaunchSpec::validate`].
    pub(crate) fn validate(&self, submit: bool) -> Result<(), ProtoError> {
        validate_launch(self.kernel, self.grid, self.block, &self.args, submit)
    }
}

/// [`KernelArg`], borrowed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ArgView<'a> {
    Scalar(&'a [u8]),
    Mem { buf: Id, offset: u64 },
    Input(u32),
    Output,
}

impl<'a> From<&'a KernelArg> for ArgView<'a> {
    fn from(a: &'a KernelArg) -> Self {
        match a {
            KernelArg::Scalar(b) => ArgView::Scalar(b),
            KernelArg::Mem { buf, offset } => ArgView::Mem {
                buf: *buf,
                offset: *offset,
            },
            KernelArg::Input(n) => ArgView::Input(*n),
            KernelArg::Output => ArgView::Output,
        }
    }
}

impl<'a> From<&'a LaunchSpec> for LaunchView<'a> {
    fn from(l: &'a LaunchSpec) -> Self {
        LaunchView {
            module: l.module,
            kernel: &l.kernel,
            grid: l.grid,
            block: l.block,
            shared_mem: l.shared_mem,
            args: l.args.iter().map(ArgView::from).collect(),
        }
    }
}

impl<'a> From<&'a Command> for CommandView<'a> {
    fn from(c: &'a Command) -> Self {
        let op = match &c.op {
            Op::Alloc { buf, size } => OpView::Alloc {
                buf: *buf,
                size: *size,
            },
            Op::Write { buf, offset, len } => OpView::Write {
                buf: *buf,
                offset: *offset,
                len: *len,
            },
            Op::Read { buf, offset, len } => OpView::Read {
                buf: *buf,
                offset: *offset,
                len: *len,
            },
            Op::Free { id } => OpView::Free { id: *id },
            Op::Launch(l) => OpView::Launch(l.into()),
            Op::Record { event } => OpView::Record { event: *event },
            Op::Wait { event } => OpView::Wait { event: *event },
            Op::Fill {
                buf,
                offset,
                len,
                value,
            } => OpView::Fill {
                buf: *buf,
                offset: *offset,
                len: *len,
                value: *value,
            },
            Op::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            } => OpView::Copy {
                src: *src,
                src_offset: *src_offset,
                dst: *dst,
                dst_offset: *dst_offset,
                len: *len,
            },
        };
        CommandView {
            stream: c.stream,
            op,
        }
    }
}

/// A decoded BATCH whose commands borrow from the message.
#[cfg(feature = "node")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BatchView<'a> {
    pub(crate) lease: LeaseId,
    pub(crate) seq: u64,
    pub(crate) modules: Vec<ModuleUse>,
    pub(crate) commands: Vec<CommandView<'a>>,
}

#[cfg(feature = "node")]
impl<'a> BatchView<'a> {
    /// Decodes a BATCH body, and returns with it the bytes of its
    /// `commands` as they came (a postcard `Vec<Command>`): a node forwards
    /// them to its worker without encoding them again.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Body`] as [`from_body`].
    pub(crate) fn decode(body: &'a [u8]) -> Result<(Self, &'a [u8]), ProtoError> {
        let (head, wire) = postcard::take_from_bytes::<BatchHead>(body)
            .map_err(|e| ProtoError::Body(e.to_string()))?;
        let commands = decode_commands(wire)?;
        let batch = BatchView {
            lease: head.lease,
            seq: head.seq,
            modules: head.modules,
            commands,
        };
        Ok((batch, wire))
    }

    /// The view of `b`.
    pub(crate) fn of(b: &'a Batch) -> Self {
        BatchView {
            lease: b.lease,
            seq: b.seq,
            modules: b.modules.clone(),
            commands: b.commands.iter().map(CommandView::from).collect(),
        }
    }

    /// As [`Batch::validate`].
    pub(crate) fn validate(&self, data_len: usize) -> Result<(), ProtoError> {
        validate_batch(&self.modules, &self.commands, data_len)
    }
}

/// The fields of [`Batch`] before its commands, in its order.
#[cfg(feature = "node")]
#[derive(Deserialize)]
struct BatchHead {
    lease: LeaseId,
    seq: u64,
    #[serde(deserialize_with = "bounded::modules")]
    modules: Vec<ModuleUse>,
}

/// A batch's commands alone, borrowed, encoded as in [`Batch`] (the node
/// to worker message carries them so).
#[cfg(feature = "node")]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Commands<'a>(
    #[serde(borrow, deserialize_with = "bounded::command_views")] pub(crate) Vec<CommandView<'a>>,
);

#[cfg(all(test, feature = "node"))]
mod tests {
    use super::*;
    use crate::proto::{from_body, to_body};

    #[test]
    #[cfg(feature = "node")]
    fn a_batchs_commands_come_back_as_they_were_encoded() {
        let batch = Batch {
            lease: LeaseId::random(),
            seq: 7,
            modules: vec![ModuleUse {
                hash: ModuleHash([3; 32]),
                source: None,
            }],
            commands: vec![
                Command {
                    stream: 1,
                    op: Op::Alloc {
                        buf: Id(5),
                        size: 64,
                    },
                },
                Command {
                    stream: 2,
                    op: Op::Launch(LaunchSpec {
                        module: ModuleHash([3; 32]),
                        kernel: "k".into(),
                        grid: [1, 2, 3],
                        block: [4, 5, 6],
                        shared_mem: 0,
                        args: vec![KernelArg::u32(9), KernelArg::mem(Id(5))],
                    }),
                },
            ],
        };
        let body = to_body(&batch);
        let (back, wire) = BatchView::decode(&body).unwrap();
        assert_eq!(back, BatchView::of(&batch));
        assert_eq!(wire, &to_body(&batch.commands)[..]);
        assert_eq!(to_body(&Commands(back.commands.clone())), wire);
        assert_eq!(from_body::<Batch>(&body).unwrap(), batch);
        // Trailing bytes are refused as by `from_body`.
        let mut long = body.clone();
        long.push(0);
        assert!(BatchView::decode(&long).is_err());
    }
}
