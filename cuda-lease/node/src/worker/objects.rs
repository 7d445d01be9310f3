//! A lease's client-named objects as its worker holds them: its ids (with
//! what each is), streams and graphs.

use crate::proto::{Id, IdMap, IdSet, StreamId};

/// What a client-named id of a lease is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IdKind {
    /// A buffer of this many bytes (charged to the lease).
    Buffer(u64),
    /// An event.
    Event,
    /// A started timer.
    Timer,
    /// A graph (its body is in [`LeaseObjects::graphs`]).
    Graph,
}

impl IdKind {
    /// What it is, for messages: "a buffer", "an event"...
    pub(super) fn noun(self) -> &'static str {
        match self {
            IdKind::Buffer(_) => "a buffer",
            IdKind::Event => "an event",
            IdKind::Timer => "a timer",
            IdKind::Graph => "a graph",
        }
    }
}

/// What a graph of a lease holds on to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct GraphIds {
    /// The ids its body names: none of them can be freed while it lives.
    pub(super) uses: IdSet<Id>,
    /// The frees its body asked for, run with its own.
    pub(super) frees: Vec<Id>,
    /// Its body's upload bytes, kept by the worker for its replays and
    /// charged to the lease's reservation.
    pub(super) kept: u64,
    /// A prepared submission's: the bytes its writes take from each run's
    /// data and its reads return (a graph has none).
    pub(super) prepared: Option<Io>,
}

/// A prepared submission's bytes in and out at each run.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Io {
    pub(super) inputs: u64,
    pub(super) outputs: u64,
}

/// A lease's live ids, with a count of its buffers.
#[derive(Debug, Default)]
pub(super) struct Ids {
    map: IdMap<Id, IdKind>,
    /// How many of them are buffers.
    pub(super) buffers: u32,
}

impl Ids {
    pub(super) fn get(&self, id: &Id) -> Option<&IdKind> {
        self.map.get(id)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn insert(&mut self, id: Id, k: IdKind) -> Option<IdKind> {
        let old = self.map.insert(id, k);
        self.count(Some(k), old);
        old
    }

    pub(super) fn remove(&mut self, id: &Id) -> Option<IdKind> {
        let old = self.map.remove(id);
        self.count(None, old);
        old
    }

    fn count(&mut self, new: Option<IdKind>, old: Option<IdKind>) {
        let buffer = |k: Option<IdKind>| u32::from(matches!(k, Some(IdKind::Buffer(_))));
        self.buffers = self.buffers + buffer(new) - buffer(old);
    }
}

/// A lease's client-named objects: its ids, streams and graphs.
#[derive(Debug, Default)]
pub(super) struct LeaseObjects {
    pub(super) ids: Ids,
    /// Streams the lease has used.
    pub(super) streams: IdSet<StreamId>,
    /// The lease's live graphs.
    pub(super) graphs: IdMap<Id, GraphIds>,
}
