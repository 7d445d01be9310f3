//! What a remote context records: the protocol's [`Command`]s (on
//! client-named streams) into a [`Recording`], with the modules its
//! launches use, the write payloads and the read slots of one submission.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use cuda_core::{Kernel, LaunchConfig};

use crate::host::ReadSlot;

use super::modules::wire_module;
use super::proto::{self, Command, Id, LaunchSpec, ModuleHash, Op};

/// A client-named stream of a remote session.
pub type RemoteStream = proto::StreamId;

/// `name`, kept for the life of the process once per distinct name, so each
/// launch's command borrows it; the thread's last name is checked first, so
/// a chain of launches of one kernel takes no lock.
fn interned(name: &str) -> &'static str {
    static NAMES: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());
    thread_local! {
        static LAST: Cell<Option<&'static str>> = const { Cell::new(None) };
    }
    if let Some(last) = LAST.get().filter(|last| *last == name) {
        return last;
    }
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let kept = match names.get(name) {
        Some(kept) => *kept,
        None => {
            let kept: &'static str = Box::leak(name.into());
            names.insert(kept);
            kept
        }
    };
    LAST.set(Some(kept));
    kept
}

/// Bytes a recording keeps for a write instead of copying them (the
/// `Vec` an `h2d` was given, say).
pub type KeptBytes = Box<dyn AsRef<[u8]> + Send + Sync>;

/// The bytes of one write: copied into the recording's data, or kept.
enum Payload {
    Copied(std::ops::Range<usize>),
    Kept(KeptBytes),
}

/// Commands of one submission, the modules they launch from, their write
/// payloads and their read slots.
#[derive(Default)]
pub struct Recording {
    commands: Vec<Command<'static>>,
    /// Each module a launch uses, once, in order of first use.
    modules: Vec<proto::ModuleSpec>,
    /// The module of the last launch: a chain from one module looks it up once.
    last_module: Option<(cuda_core::Module, ModuleHash)>,
    data: Vec<u8>,
    payloads: Vec<Payload>,
    reads: Vec<Arc<ReadSlot>>,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("commands", &self.commands)
            .field("modules", &self.modules.len())
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

    /// Appends `op` on `stream`: a command with no data that launches nothing.
    ///
    /// # Panics
    ///
    /// For [`Op::Write`], [`Op::Read`], [`Op::TimerEnd`], [`Op::Run`] and
    /// [`Op::Launch`]: use [`Recording::write`], [`Recording::read`],
    /// [`Recording::timer_end`], [`Recording::run`] and
    /// [`Recording::launch`], which keep the data, the read slots and the
    /// modules in step.
    pub fn push(&mut self, stream: RemoteStream, op: Op<'static>) {
        assert!(
            !matches!(
                op,
                Op::Write { .. }
                    | Op::Read { .. }
                    | Op::TimerEnd { .. }
                    | Op::Run { .. }
                    | Op::Launch(_)
            ),
            "use Recording::write / read / timer_end / run / launch"
        );
        self.commands.push(Command { stream, op });
    }

    /// Appends a write of `bytes` (copied into the recording now).
    pub fn write(&mut self, stream: RemoteStream, id: u64, offset: u64, bytes: &[u8]) {
        let start = self.data.len();
        self.data.extend_from_slice(bytes);
        self.payloads.push(Payload::Copied(start..self.data.len()));
        self.push_write(stream, id, offset, bytes.len());
    }

    /// Appends a write of `bytes`, kept without a copy (what an `h2d` of an
    /// owned `Vec` records: a large upload is never held twice on the client).
    pub fn write_kept(&mut self, stream: RemoteStream, id: u64, offset: u64, bytes: KeptBytes) {
        let len = (*bytes).as_ref().len();
        self.payloads.push(Payload::Kept(bytes));
        self.push_write(stream, id, offset, len);
    }

    fn push_write(&mut self, stream: RemoteStream, id: u64, offset: u64, len: usize) {
        let op = Op::Write {
            buf: Id(id),
            offset,
            len: len as u64,
        };
        self.commands.push(Command { stream, op });
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
        let op = Op::Read {
            buf: Id(id),
            offset,
            len,
        };
        self.commands.push(Command { stream, op });
        slot
    }

    /// Appends a run of prepared submission `prepared` (see [`Op::Run`]):
    /// `inputs` are its body's upload bytes, back to back (copied into the
    /// recording now); the returned slot receives the `outputs` bytes its
    /// body's reads return, back to back.
    pub fn run(
        &mut self,
        stream: RemoteStream,
        prepared: u64,
        inputs: &[u8],
        outputs: u64,
    ) -> Arc<ReadSlot> {
        let start = self.data.len();
        self.data.extend_from_slice(inputs);
        self.payloads.push(Payload::Copied(start..self.data.len()));
        let slot = Arc::new(ReadSlot::new(outputs as usize));
        if outputs == 0 {
            let _ = slot.receive(|_| Ok(()));
        } else {
            self.reads.push(slot.clone());
        }
        let op = Op::Run {
            prepared: Id(prepared),
            inputs: inputs.len() as u64,
            outputs,
        };
        self.commands.push(Command { stream, op });
        slot
    }

    /// Forgets the last `n` read slots: the reads of a prepared
    /// submission's body, which return nothing until it runs.
    pub(crate) fn forget_reads(&mut self, n: usize) {
        self.reads.truncate(self.reads.len().saturating_sub(n));
    }

    /// Appends the end of timer `timer` (started by an [`Op::TimerStart`]
    /// on the same stream); the returned slot receives its 8 bytes.
    pub fn timer_end(&mut self, stream: RemoteStream, timer: u64) -> Arc<ReadSlot> {
        let slot = Arc::new(ReadSlot::new(proto::TIMER_BYTES));
        self.reads.push(slot.clone());
        let op = Op::TimerEnd { timer: Id(timer) };
        self.commands.push(Command { stream, op });
        slot
    }

    /// Appends a launch of `kernel` (a description: its module's source
    /// travels with the submission, named by its hash).
    pub fn launch(
        &mut self,
        stream: RemoteStream,
        kernel: &Kernel,
        config: &LaunchConfig,
        args: Vec<proto::LaunchArg<'static>>,
    ) {
        let module = self.module_of(kernel.module());
        let c = config;
        let op = Op::Launch(LaunchSpec {
            module,
            kernel: Cow::Borrowed(interned(kernel.name())),
            grid: [c.grid_dim.0, c.grid_dim.1, c.grid_dim.2],
            block: [c.block_dim.0, c.block_dim.1, c.block_dim.2],
            shared_mem: c.shared_mem_bytes,
            args,
        });
        self.commands.push(Command { stream, op });
    }

    /// The hash of `m`, listed in [`Recording::modules`] from now on.
    fn module_of(&mut self, m: &cuda_core::Module) -> ModuleHash {
        if let Some((last, hash)) = &self.last_module {
            if last == m {
                return *hash;
            }
        }
        let wire = wire_module(m);
        let hash = wire.hash();
        if !self.modules.iter().any(|w| w.hash() == hash) {
            self.modules.push(wire);
        }
        self.last_module = Some((m.clone(), hash));
        hash
    }

    /// The commands, in order.
    pub fn commands(&self) -> &[Command<'static>] {
        &self.commands
    }

    /// The modules the launches use, each once, in order of first use.
    pub fn modules(&self) -> &[proto::ModuleSpec] {
        &self.modules
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

    /// Takes the write payloads out, back to back in command order (no copy
    /// when every write was copied in); the payloads are empty afterwards.
    pub fn take_data(&mut self) -> Vec<u8> {
        let data = if self
            .payloads
            .iter()
            .all(|p| matches!(p, Payload::Copied(_)))
        {
            std::mem::take(&mut self.data)
        } else {
            self.payloads().collect::<Vec<_>>().concat()
        };
        self.payloads.clear();
        self.data = Vec::new();
        data
    }

    /// A copy to send again (a retry elsewhere): the same commands and read
    /// slots (its reads land where the original's would), payloads copied.
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
            modules: self.modules.clone(),
            last_module: self.last_module.clone(),
            data,
            payloads,
            reads: self.reads.clone(),
        }
    }

    /// The read slots, in command order.
    pub fn reads(&self) -> &[Arc<ReadSlot>] {
        &self.reads
    }

    /// Takes the read slots out (in command order), leaving none: for a
    /// session that keeps only them until the reply and drops the rest of
    /// the recording once its message is written, on the thread that
    /// recorded it.
    pub fn take_reads(&mut self) -> Vec<Arc<ReadSlot>> {
        std::mem::take(&mut self.reads)
    }

    /// True when nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// Drops the commands from index `start` on, with their payloads and read
    /// slots, but keeps the frees of ids created before `start`: a refused
    /// capture never reaches the node, yet the buffers it was handed are freed.
    pub(crate) fn abandon_from(&mut self, start: usize) {
        let tail = self.commands.split_off(start.min(self.commands.len()));
        let mut made = std::collections::HashSet::new();
        let (mut writes, mut reads) = (0, 0);
        let mut kept = Vec::new();
        for c in tail {
            match c.op {
                Op::Alloc { buf: id, .. }
                | Op::Record { event: id }
                | Op::GraphBegin { graph: id }
                | Op::PrepareBegin { prepared: id }
                | Op::TimerStart { timer: id } => {
                    made.insert(id);
                }
                Op::Write { .. } => writes += 1,
                Op::Read { .. } | Op::TimerEnd { .. } => reads += 1,
                Op::Run { outputs, .. } => {
                    writes += 1;
                    reads += usize::from(outputs > 0);
                }
                Op::Free { id } if !made.contains(&id) => kept.push(c),
                _ => {}
            }
        }
        for _ in 0..writes {
            if let Some(Payload::Copied(r)) = self.payloads.pop() {
                self.data.truncate(r.start);
            }
        }
        self.reads.truncate(self.reads.len().saturating_sub(reads));
        self.commands.extend(kept);
    }

    /// Appends `other`'s commands, data and read slots after this one's.
    pub fn append(&mut self, other: Recording) {
        self.commands.extend(other.commands);
        for m in other.modules {
            if !self.modules.iter().any(|w| w.hash() == m.hash()) {
                self.modules.push(m);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::interned;

    #[test]
    fn a_kernel_name_is_kept_once_and_found_again_after_another() {
        let a = interned("kept_once_a");
        assert!(std::ptr::eq(a, interned(&String::from("kept_once_a"))));
        let b = interned("kept_once_b");
        assert_eq!(b, "kept_once_b");
        assert!(std::ptr::eq(interned("kept_once_a"), a));
        let elsewhere = std::thread::spawn(|| interned("kept_once_b"))
            .join()
            .unwrap();
        assert!(std::ptr::eq(elsewhere, b));
    }
}
