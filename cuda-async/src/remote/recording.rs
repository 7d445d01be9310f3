//! What a remote context records: [`RemoteCommand`]s (with their
//! [`RemoteArg`]s, on client-named [`RemoteStream`]s) into a
//! [`Recording`], with the write payloads and the read slots of one
//! submission.

use std::sync::Arc;

use cuda_core::{Kernel, LaunchConfig};

use crate::host::ReadSlot;

/// A client-named stream of a remote session.
pub type RemoteStream = u32;

/// One recorded command.
#[derive(Debug, Clone)]
pub enum RemoteCommand {
    /// Allocate `bytes` zeroed bytes as buffer `id`.
    Alloc {
        /// Stream.
        stream: RemoteStream,
        /// New buffer id.
        id: u64,
        /// Size in bytes.
        bytes: u64,
    },
    /// Write the next `len` bytes of the recording's data at `offset`.
    Write {
        /// Stream.
        stream: RemoteStream,
        /// Target buffer.
        id: u64,
        /// Byte offset.
        offset: u64,
        /// Bytes: the write's payload ([`Recording::payload`]).
        len: u64,
    },
    /// Read `len` bytes at `offset` into the next [`ReadSlot`].
    Read {
        /// Stream.
        stream: RemoteStream,
        /// Source buffer.
        id: u64,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Set `len` bytes at `offset` to `value`.
    Fill {
        /// Stream.
        stream: RemoteStream,
        /// Target buffer.
        id: u64,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// The byte.
        value: u8,
    },
    /// Copy `len` bytes between two buffers.
    Copy {
        /// Stream.
        stream: RemoteStream,
        /// Source buffer and byte offset.
        src: (u64, u64),
        /// Destination buffer and byte offset.
        dst: (u64, u64),
        /// Bytes.
        len: u64,
    },
    /// Free a buffer or an event after its queued uses.
    Free {
        /// Stream.
        stream: RemoteStream,
        /// The buffer or event.
        id: u64,
    },
    /// Launch a kernel (a description: its module's source travels).
    Launch {
        /// Stream.
        stream: RemoteStream,
        /// The kernel.
        kernel: Kernel,
        /// Grid, block and shared memory.
        config: LaunchConfig,
        /// Arguments in order.
        args: Vec<RemoteArg>,
    },
    /// Record event `event` on the stream.
    Record {
        /// Stream.
        stream: RemoteStream,
        /// The event.
        event: u64,
    },
    /// Make the stream wait for the last record of `event`.
    Wait {
        /// Stream.
        stream: RemoteStream,
        /// The event.
        event: u64,
    },
    /// Start timer `timer` (a fresh id) on the stream.
    TimerStart {
        /// Stream.
        stream: RemoteStream,
        /// The timer.
        timer: u64,
    },
    /// End timer `timer` on the stream: the GPU time since its start, in
    /// nanoseconds (a little-endian `u64`), goes into the next
    /// [`ReadSlot`], as a read's bytes do. The node forgets the timer.
    TimerEnd {
        /// Stream.
        stream: RemoteStream,
        /// The timer.
        timer: u64,
    },
    /// Begin the body of graph `graph` (a fresh id): the commands up to
    /// its [`RemoteCommand::GraphEnd`] are kept on the node and run at
    /// each [`RemoteCommand::GraphLaunch`] (their allocations at once).
    GraphBegin {
        /// Stream.
        stream: RemoteStream,
        /// The graph.
        graph: u64,
    },
    /// End the body of graph `graph`.
    GraphEnd {
        /// Stream.
        stream: RemoteStream,
        /// The graph.
        graph: u64,
    },
    /// Replay graph `graph` on the stream.
    GraphLaunch {
        /// Stream.
        stream: RemoteStream,
        /// The graph.
        graph: u64,
    },
}

/// A kernel argument of a remote launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteArg {
    /// Bytes passed by value.
    Bytes(Vec<u8>),
    /// The address of a remote buffer plus a byte offset.
    Buffer {
        /// The buffer.
        id: u64,
        /// Byte offset.
        offset: u64,
    },
}

/// Bytes a recording keeps for a write instead of copying them (the
/// `Vec` an `h2d` was given, say).
pub type KeptBytes = Box<dyn AsRef<[u8]> + Send + Sync>;

/// The bytes of one write: copied into the recording's data, or kept.
enum Payload {
    Copied(std::ops::Range<usize>),
    Kept(KeptBytes),
}

/// Commands of one submission, their write payloads and their read slots.
#[derive(Default)]
pub struct Recording {
    commands: Vec<RemoteCommand>,
    data: Vec<u8>,
    payloads: Vec<Payload>,
    reads: Vec<Arc<ReadSlot>>,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("commands", &self.commands)
            .field(
                "data_bytes",
                &self.payloads().map(<[u8]>::len).sum::<usize>(),
            )
            .field("reads", &self.reads.len())
            .finish()
    }
}

impl Recording {
    /// An empty recording.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a command that carries no data.
    ///
    /// # Panics
    ///
    /// For [`RemoteCommand::Write`] and [`RemoteCommand::Read`]: use
    /// [`Recording::write`] and [`Recording::read`], which keep the data
    /// and the slots in step.
    pub fn push(&mut self, command: RemoteCommand) {
        assert!(
            !matches!(
                command,
                RemoteCommand::Write { .. } | RemoteCommand::Read { .. }
            ),
            "use Recording::write / Recording::read"
        );
        self.commands.push(command);
    }

    /// Appends a write of `bytes` (copied into the recording now).
    pub fn write(&mut self, stream: RemoteStream, id: u64, offset: u64, bytes: &[u8]) {
        let start = self.data.len();
        self.data.extend_from_slice(bytes);
        self.payloads.push(Payload::Copied(start..self.data.len()));
        self.commands.push(RemoteCommand::Write {
            stream,
            id,
            offset,
            len: bytes.len() as u64,
        });
    }

    /// Appends a write of `bytes`, which the recording keeps (no copy):
    /// what an `h2d` of an owned `Vec` records, so a large upload is never
    /// held twice on the client.
    pub fn write_kept(&mut self, stream: RemoteStream, id: u64, offset: u64, bytes: KeptBytes) {
        let len = (*bytes).as_ref().len() as u64;
        self.payloads.push(Payload::Kept(bytes));
        self.commands.push(RemoteCommand::Write {
            stream,
            id,
            offset,
            len,
        });
    }

    /// Appends a read of `len` bytes; the returned slot receives them. An
    /// empty read records nothing: its slot is filled already.
    pub fn read(&mut self, stream: RemoteStream, id: u64, offset: u64, len: u64) -> Arc<ReadSlot> {
        if len == 0 {
            let slot = Arc::new(ReadSlot::new(0));
            let _ = slot.receive(|_| Ok(()));
            return slot;
        }
        let slot = Arc::new(ReadSlot::new(len as usize));
        self.reads.push(slot.clone());
        self.commands.push(RemoteCommand::Read {
            stream,
            id,
            offset,
            len,
        });
        slot
    }

    /// Appends the end of timer `timer` (started by a
    /// [`RemoteCommand::TimerStart`] on the same stream); the returned
    /// slot receives its 8 bytes.
    pub fn timer_end(&mut self, stream: RemoteStream, timer: u64) -> Arc<ReadSlot> {
        let slot = Arc::new(ReadSlot::new(8));
        self.reads.push(slot.clone());
        self.commands
            .push(RemoteCommand::TimerEnd { stream, timer });
        slot
    }

    /// The commands, in order.
    pub fn commands(&self) -> &[RemoteCommand] {
        &self.commands
    }

    /// The bytes of each write, in command order.
    pub fn payloads(&self) -> impl Iterator<Item = &[u8]> {
        self.payloads.iter().map(|p| self.bytes_of(p))
    }

    /// The bytes of write number `i` (counting writes only).
    ///
    /// # Panics
    ///
    /// If there are not that many writes.
    pub fn payload(&self, i: usize) -> &[u8] {
        self.bytes_of(&self.payloads[i])
    }

    fn bytes_of<'a>(&'a self, p: &'a Payload) -> &'a [u8] {
        match p {
            Payload::Copied(r) => &self.data[r.clone()],
            Payload::Kept(b) => (**b).as_ref(),
        }
    }

    /// Takes the write payloads out, back to back in command order, for a
    /// session that sends them in one message: without copying when every
    /// write was copied in; the payloads are empty afterwards.
    pub fn take_data(&mut self) -> Vec<u8> {
        let data = if self
            .payloads
            .iter()
            .all(|p| matches!(p, Payload::Copied(_)))
        {
            std::mem::take(&mut self.data)
        } else {
            let mut out = Vec::with_capacity(self.payloads().map(<[u8]>::len).sum());
            for bytes in self.payloads() {
                out.extend_from_slice(bytes);
            }
            out
        };
        self.payloads.clear();
        self.data = Vec::new();
        data
    }

    /// A copy to send again (a retry elsewhere): the same commands and
    /// read slots (the copy's reads land where the original's would),
    /// every payload copied.
    pub fn duplicate(&self) -> Recording {
        let mut data = Vec::with_capacity(self.payloads().map(<[u8]>::len).sum());
        let mut payloads = Vec::with_capacity(self.payloads.len());
        for bytes in self.payloads() {
            let start = data.len();
            data.extend_from_slice(bytes);
            payloads.push(Payload::Copied(start..data.len()));
        }
        Recording {
            commands: self.commands.clone(),
            data,
            payloads,
            reads: self.reads.clone(),
        }
    }

    /// The read slots, in command order.
    pub fn reads(&self) -> &[Arc<ReadSlot>] {
        &self.reads
    }

    /// True when nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }
}

impl Recording {
    /// Appends `other`'s commands, data and read slots after this one's.
    pub fn append(&mut self, other: Recording) {
        self.commands.extend(other.commands);
        let base = self.data.len();
        self.data.extend_from_slice(&other.data);
        self.payloads
            .extend(other.payloads.into_iter().map(|p| match p {
                Payload::Copied(r) => Payload::Copied(base + r.start..base + r.end),
                kept => kept,
            }));
        self.reads.extend(other.reads);
    }
}
