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
        /// Bytes taken from [`Recording::data`].
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

/// Commands of one submission, their write payloads and their read slots.
#[derive(Debug, Default)]
pub struct Recording {
    commands: Vec<RemoteCommand>,
    data: Vec<u8>,
    reads: Vec<Arc<ReadSlot>>,
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

    /// Appends a write of `bytes` (copied into the message now).
    pub fn write(&mut self, stream: RemoteStream, id: u64, offset: u64, bytes: &[u8]) {
        self.data.extend_from_slice(bytes);
        self.commands.push(RemoteCommand::Write {
            stream,
            id,
            offset,
            len: bytes.len() as u64,
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

    /// The commands, in order.
    pub fn commands(&self) -> &[RemoteCommand] {
        &self.commands
    }

    /// The write payloads, back to back in command order.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Takes the write payloads out (back to back in command order), for a
    /// session that sends them without copying; [`Recording::data`] is
    /// empty afterwards.
    pub fn take_data(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.data)
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
        self.data.extend_from_slice(&other.data);
        self.reads.extend(other.reads);
    }
}
