//! The one translation from `cuda-async`'s recorded commands to the
//! protocol's, streamed into a BATCH.

use cuda_async::remote::{RemoteArg, RemoteCommand};
use cuda_core::{Kernel, LaunchConfig};

use crate::client::EncodeCommands;
use crate::proto::{self, Command, Id, KernelArg, LaunchSpec, ModuleHash, Op};

/// A recording's commands, after the queued frees (on stream 0), encoded
/// straight into the BATCH as the protocol's command list: each is
/// translated ([`to_wire`]) and encoded in turn, without collecting them
/// first (see the test `the_wire_form_is_the_protocols`).
pub(super) struct WireCommands<'a> {
    pub(super) frees: &'a [u64],
    pub(super) commands: &'a [RemoteCommand],
    /// The module of each launch, in order.
    pub(super) launches: &'a [ModuleHash],
}

impl EncodeCommands for WireCommands<'_> {
    fn encode_into(&self, out: &mut Vec<u8>) {
        let frees = self.frees.iter().map(|id| Command {
            stream: 0,
            op: Op::Free { id: Id(*id) },
        });
        let mut launches = self.launches.iter();
        let commands = self.commands.iter().map(|c| to_wire(c, &mut launches));
        let n = self.frees.len() + self.commands.len();
        proto::encode_commands(out, n, frees.chain(commands));
    }
}

/// The one translation from cuda-async's [`RemoteCommand`] to the
/// protocol's [`Command`], borrowing its kernel name and scalars; a
/// launch takes the next of `launches` as its module.
fn to_wire<'a>(
    c: &'a RemoteCommand,
    launches: &mut std::slice::Iter<'_, ModuleHash>,
) -> Command<'a> {
    let (stream, op) = match c {
        RemoteCommand::Alloc { stream, id, bytes } => (
            *stream,
            Op::Alloc {
                buf: Id(*id),
                size: *bytes,
            },
        ),
        RemoteCommand::Write {
            stream,
            id,
            offset,
            len,
        } => (
            *stream,
            Op::Write {
                buf: Id(*id),
                offset: *offset,
                len: *len as u32,
            },
        ),
        RemoteCommand::Read {
            stream,
            id,
            offset,
            len,
        } => (
            *stream,
            Op::Read {
                buf: Id(*id),
                offset: *offset,
                len: *len as u32,
            },
        ),
        RemoteCommand::Fill {
            stream,
            id,
            offset,
            len,
            value,
        } => (
            *stream,
            Op::Fill {
                buf: Id(*id),
                offset: *offset,
                len: *len,
                value: *value,
            },
        ),
        RemoteCommand::Copy {
            stream,
            src,
            dst,
            len,
        } => (
            *stream,
            Op::Copy {
                src: Id(src.0),
                src_offset: src.1,
                dst: Id(dst.0),
                dst_offset: dst.1,
                len: *len,
            },
        ),
        RemoteCommand::Free { stream, id } => (*stream, Op::Free { id: Id(*id) }),
        RemoteCommand::Launch {
            stream,
            kernel,
            config,
            args,
        } => (*stream, launch_to_wire(launches, kernel, config, args)),
        RemoteCommand::Record { stream, event } => (*stream, Op::Record { event: Id(*event) }),
        RemoteCommand::Wait { stream, event } => (*stream, Op::Wait { event: Id(*event) }),
        RemoteCommand::TimerStart { stream, timer } => {
            (*stream, Op::TimerStart { timer: Id(*timer) })
        }
        RemoteCommand::TimerEnd { stream, timer } => (*stream, Op::TimerEnd { timer: Id(*timer) }),
        RemoteCommand::GraphBegin { stream, graph } => {
            (*stream, Op::GraphBegin { graph: Id(*graph) })
        }
        RemoteCommand::GraphEnd { stream, graph } => (*stream, Op::GraphEnd { graph: Id(*graph) }),
        RemoteCommand::GraphLaunch { stream, graph } => {
            (*stream, Op::GraphLaunch { graph: Id(*graph) })
        }
    };
    Command { stream, op }
}

/// A recorded launch as the protocol's [`Op::Launch`], its module the
/// next of `launches`.
fn launch_to_wire<'a>(
    launches: &mut std::slice::Iter<'_, ModuleHash>,
    kernel: &'a Kernel,
    c: &LaunchConfig,
    args: &'a [RemoteArg],
) -> Op<'a> {
    // `modules_of` names the module of every launch.
    let module = *launches.next().expect("a launch without its module");
    let args = args
        .iter()
        .map(|a| match a {
            RemoteArg::Bytes(b) => KernelArg::Scalar(b.as_slice().into()),
            RemoteArg::Buffer { id, offset } => KernelArg::Mem {
                buf: Id(*id),
                offset: *offset,
            },
        })
        .collect();
    let launch = LaunchSpec {
        module,
        kernel: kernel.name().into(),
        grid: [c.grid_dim.0, c.grid_dim.1, c.grid_dim.2],
        block: [c.block_dim.0, c.block_dim.1, c.block_dim.2],
        shared_mem: c.shared_mem_bytes,
        args,
    };
    Op::Launch(launch)
}

#[cfg(test)]
mod tests {
    use cuda_async::remote::{Recording, RemoteArg, RemoteCommand};
    use cuda_async::{LaunchConfig, Module as CoreModule};

    use super::WireCommands;
    use crate::client::EncodeCommands;
    use crate::proto::{from_body, to_body, Command, Id, KernelArg, LaunchSpec, ModuleHash, Op};

    /// Every kind of command, encoded by `WireCommands` and as the
    /// protocol's own `Vec<Command>` built field by field: the same bytes.
    #[test]
    fn the_wire_form_is_the_protocols() {
        let kernel = CoreModule::cuda("__global__ void k(int* p, int n) {}", &[])
            .unwrap()
            .kernel("k")
            .unwrap();
        let config = LaunchConfig {
            grid_dim: (2, 3, 4),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 128,
        };
        let mut rec = Recording::new();
        rec.push(RemoteCommand::Alloc {
            stream: 1,
            id: 10,
            bytes: 64,
        });
        rec.write(1, 10, 8, &[1, 2, 3, 4]);
        rec.push(RemoteCommand::Fill {
            stream: 2,
            id: 10,
            offset: 4,
            len: 12,
            value: 7,
        });
        rec.push(RemoteCommand::Copy {
            stream: 2,
            src: (10, 0),
            dst: (11, 16),
            len: 8,
        });
        rec.push(RemoteCommand::Launch {
            stream: 3,
            kernel,
            config,
            args: vec![
                RemoteArg::Buffer { id: 10, offset: 4 },
                RemoteArg::Bytes(5i32.to_le_bytes().to_vec()),
            ],
        });
        rec.push(RemoteCommand::Record {
            stream: 3,
            event: 12,
        });
        rec.push(RemoteCommand::Wait {
            stream: 1,
            event: 12,
        });
        let _slot = rec.read(1, 10, 0, 16);
        rec.push(RemoteCommand::Free { stream: 1, id: 10 });
        let hash = ModuleHash([9; 32]);
        let wire = WireCommands {
            frees: &[5, 6],
            commands: rec.commands(),
            launches: &[hash],
        };
        let c = |stream, op| Command { stream, op };
        let expected = vec![
            c(0, Op::Free { id: Id(5) }),
            c(0, Op::Free { id: Id(6) }),
            c(
                1,
                Op::Alloc {
                    buf: Id(10),
                    size: 64,
                },
            ),
            c(
                1,
                Op::Write {
                    buf: Id(10),
                    offset: 8,
                    len: 4,
                },
            ),
            c(
                2,
                Op::Fill {
                    buf: Id(10),
                    offset: 4,
                    len: 12,
                    value: 7,
                },
            ),
            c(
                2,
                Op::Copy {
                    src: Id(10),
                    src_offset: 0,
                    dst: Id(11),
                    dst_offset: 16,
                    len: 8,
                },
            ),
            c(
                3,
                Op::Launch(LaunchSpec {
                    module: hash,
                    kernel: "k".into(),
                    grid: [2, 3, 4],
                    block: [32, 1, 1],
                    shared_mem: 128,
                    args: vec![
                        KernelArg::Mem {
                            buf: Id(10),
                            offset: 4,
                        },
                        KernelArg::bytes(5i32.to_le_bytes()),
                    ],
                }),
            ),
            c(3, Op::Record { event: Id(12) }),
            c(1, Op::Wait { event: Id(12) }),
            c(
                1,
                Op::Read {
                    buf: Id(10),
                    offset: 0,
                    len: 16,
                },
            ),
            c(1, Op::Free { id: Id(10) }),
        ];
        let mut bytes = Vec::new();
        wire.encode_into(&mut bytes);
        assert_eq!(bytes, to_body(&expected));
        assert_eq!(from_body::<Vec<Command<'_>>>(&bytes).unwrap(), expected);
    }
}
