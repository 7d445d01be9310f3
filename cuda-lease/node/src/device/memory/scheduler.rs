//! The test double's deterministic scheduler: enqueued commands with their
//! dependencies, run at [`LeaseDevice::finish`](crate::device::LeaseDevice::finish)
//! or [`LeaseDevice::seal`](crate::device::LeaseDevice::seal), and its
//! clock: a command is done after its stream's, buffers' and dependencies'
//! earlier work plus what it takes (only `delay(ms)` takes time), so
//! streams overlap in time as a GPU's do.

use std::time::{Duration, Instant};

use super::kernels::{host_kernel, host_kernel_time, HostArg};
use super::MemoryDevice;
use crate::proto::StreamId;

#[derive(Debug)]
pub(super) struct Queued {
    stream: StreamId,
    deps: Vec<usize>,
    work: Work,
    done: bool,
    /// When it is done, on the test double's clock.
    pub(super) ready: Instant,
}

#[derive(Debug)]
pub(super) enum Work {
    Write {
        slot: usize,
        at: usize,
        data: Vec<u8>,
    },
    Fill {
        slot: usize,
        range: std::ops::Range<usize>,
        value: u8,
    },
    Copy {
        src: (usize, usize),
        dst: (usize, usize),
        len: usize,
    },
    Read {
        slot: usize,
        range: std::ops::Range<usize>,
        at: usize,
    },
    Free {
        slot: usize,
    },
    /// A timer's start: when the scheduler runs it (there is no GPU clock).
    TimerStart {
        key: u64,
    },
    /// A timer's end: the nanoseconds since its start land at `at`.
    TimerEnd {
        key: u64,
        at: usize,
    },
    Launch {
        kernel: String,
        threads: u64,
        args: Vec<HostArg>,
    },
    /// A matrix product on the buffers of `slots` (`A`, `B`, `C`).
    Gemm {
        spec: crate::proto::GemmSpec,
        slots: [usize; 3],
    },
    /// A random fill of the buffer of `slot`.
    RandFill {
        spec: crate::proto::RandSpec,
        slot: usize,
    },
    Nothing,
}

impl MemoryDevice {
    /// Queues `work` on `stream` after `extra` and the conflicting uses of
    /// the slots it reads and writes, done no earlier than `not_before` (an
    /// event recorded by an earlier batch).
    pub(super) fn enqueue(
        &mut self,
        stream: StreamId,
        work: Work,
        reads: &[usize],
        writes: &[usize],
        extra: Option<usize>,
        not_before: Option<Instant>,
    ) -> usize {
        let i = self.queue.len();
        let mut deps: Vec<usize> = self.tails.get(&stream).copied().into_iter().collect();
        deps.extend(extra);
        for s in reads {
            let h = self.hazards.entry(*s).or_default();
            deps.extend(h.0);
            h.1.push(i);
        }
        for s in writes {
            let h = self.hazards.entry(*s).or_default();
            deps.extend(h.0);
            deps.append(&mut h.1);
            h.0 = Some(i);
        }
        // A buffer named twice would otherwise depend on itself.
        deps.retain(|&d| d < i);
        let takes = match &work {
            Work::Launch { kernel, args, .. } => host_kernel_time(kernel, args),
            _ => Duration::ZERO,
        };
        let slots = reads.iter().chain(writes);
        let start = std::iter::once(Instant::now())
            .chain(self.stream_clock.get(&stream).copied())
            .chain(
                slots
                    .clone()
                    .filter_map(|s| self.slot_clock.get(s).copied()),
            )
            .chain(deps.iter().map(|&d| self.queue[d].ready))
            .chain(not_before)
            .max()
            .unwrap_or_else(Instant::now);
        let ready = start + takes;
        self.stream_clock.insert(stream, ready);
        for s in slots {
            self.slot_clock.insert(*s, ready);
        }
        self.tails.insert(stream, i);
        self.queue.push(Queued {
            stream,
            deps,
            work,
            done: false,
            ready,
        });
        i
    }

    /// Runs every queued command, honouring its dependencies; among ready
    /// commands, the one of the highest stream id goes first. Returns when
    /// the last of them is done on the test double's clock.
    pub(super) fn drain(&mut self, out: &mut [u8]) -> Instant {
        let mut queue = std::mem::take(&mut self.queue);
        let until = queue
            .iter()
            .map(|q| q.ready)
            .max()
            .unwrap_or_else(Instant::now);
        for _ in 0..queue.len() {
            let next = (0..queue.len())
                .filter(|&i| !queue[i].done && queue[i].deps.iter().all(|&d| queue[d].done))
                .max_by_key(|&i| (queue[i].stream, std::cmp::Reverse(i)));
            // Dependencies always point at earlier commands, so the oldest
            // unfinished command is ready: there is always a next one.
            let Some(i) = next else {
                debug_assert!(false, "no ready command");
                break;
            };
            let work = std::mem::replace(&mut queue[i].work, Work::Nothing);
            self.run(work, out);
            queue[i].done = true;
        }
        self.tails.clear();
        self.hazards.clear();
        for last in self.events.values_mut() {
            *last = None;
        }
        until
    }

    fn run(&mut self, work: Work, out: &mut [u8]) {
        match work {
            Work::Write { slot, at, data } => {
                if let Some(b) = self.store.get_mut(&slot) {
                    b[at..at + data.len()].copy_from_slice(&data);
                }
            }
            Work::Fill { slot, range, value } => {
                if let Some(b) = self.store.get_mut(&slot) {
                    b[range].fill(value);
                }
            }
            Work::Copy { src, dst, len } => {
                let bytes = self
                    .store
                    .get(&src.0)
                    .map(|b| b[src.1..src.1 + len].to_vec());
                if let (Some(bytes), Some(d)) = (bytes, self.store.get_mut(&dst.0)) {
                    d[dst.1..dst.1 + len].copy_from_slice(&bytes);
                }
            }
            Work::Gemm { spec, slots } => {
                let tail = |slot: usize, offset: u64| {
                    self.store.get(&slot).map(|b| b[offset as usize..].to_vec())
                };
                let (a, b) = (tail(slots[0], spec.a.offset), tail(slots[1], spec.b.offset));
                if let (Some(a), Some(b), Some(c)) = (a, b, self.store.get_mut(&slots[2])) {
                    super::library::host_gemm(&spec, &a, &b, &mut c[spec.c.offset as usize..]);
                }
            }
            Work::RandFill { spec, slot } => {
                if let Some(b) = self.store.get_mut(&slot) {
                    super::library::host_fill(&spec, &mut b[spec.dst.offset as usize..]);
                }
            }
            Work::Read { slot, range, at } => {
                if let (Some(b), Some(dst)) =
                    (self.store.get(&slot), out.get_mut(at..at + range.len()))
                {
                    dst.copy_from_slice(&b[range]);
                }
            }
            Work::Free { slot } => {
                self.store.remove(&slot);
                self.slot_clock.remove(&slot);
            }
            Work::TimerStart { key } => {
                self.stamps.insert(key, std::time::Instant::now());
            }
            Work::TimerEnd { key, at } => {
                let ns = self.stamps.remove(&key).map_or(0, |t| {
                    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
                });
                if let Some(dst) = out.get_mut(at..at + 8) {
                    dst.copy_from_slice(&ns.to_le_bytes());
                }
            }
            Work::Launch {
                kernel,
                threads,
                args,
            } => match kernel.as_str() {
                "__fault" => self.faulted = true,
                "__hang" => loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                },
                "__exit" => std::process::exit(3),
                _ => {
                    if !self.faulted && host_kernel(&mut self.store, &kernel, threads, &args) {
                        self.faulted = true;
                    }
                }
            },
            Work::Nothing => {}
        }
    }
}
