//! The batch planner: what a BATCH's commands do to its lease's ids, streams
//! and reservation, decided before any of them runs (pure logic over the
//! lease's state).

use std::collections::HashMap;

use super::submit::BudgetTurn;
use super::{IdKind, LeaseState, Shared};
use crate::proto::{ArgView, CommandView, Id, LeaseId, OpError, OpView, Status};

/// A command's effect on the lease's ids, applied when it ran.
#[derive(Debug, Clone, Copy)]
pub(super) enum Effect {
    None,
    Create(Id, IdKind),
    Free(Id),
}

/// What a batch's commands do to the lease, up to the first command the
/// node refuses (the commands before it go to the worker).
pub(super) struct Plan {
    pub(super) effects: Vec<Effect>,
    /// Bytes of the batch's write payloads the planned commands take.
    pub(super) write_bytes: usize,
    /// Allocations charged to the lease, by command index.
    pub(super) charged: Vec<(usize, u64)>,
    pub(super) error: Option<OpError>,
}

/// What `id` is after the commands planned so far: the batch's own
/// creations and frees over the lease's state.
pub(super) fn kind_of(
    overlay: &HashMap<Id, Option<IdKind>>,
    state: &LeaseState,
    id: Id,
) -> Option<IdKind> {
    match overlay.get(&id) {
        Some(k) => *k,
        None => state.ids.get(&id).copied(),
    }
}

pub(super) fn plan(
    shared: &Shared,
    lease: &LeaseId,
    state: &LeaseState,
    commands: &[CommandView<'_>],
    mut turn: Option<&mut BudgetTurn>,
) -> Plan {
    let mut overlay: HashMap<Id, Option<IdKind>> = HashMap::new();
    let mut live = state.ids.len();
    let mut streams = state.streams.clone();
    let mut p = Plan {
        effects: Vec::with_capacity(commands.len()),
        write_bytes: 0,
        charged: Vec::new(),
        error: None,
    };
    let mut read_total: u64 = 0;
    let now = shared.now();
    let cfg = &shared.cfg;
    for (i, c) in commands.iter().enumerate() {
        let fail = |status: Status, message: String| OpError {
            index: i as u32,
            status,
            message: format!("command {i}: {message}"),
        };
        let kind = |id: Id| kind_of(&overlay, state, id);
        let buffer = |id: Id| match kind(id) {
            Some(IdKind::Buffer(n)) => Ok(n),
            Some(IdKind::Event) => Err(fail(
                Status::BadRequest,
                format!("{id} is an event, not a buffer"),
            )),
            None => Err(fail(Status::NotFound, format!("unknown id {id}"))),
        };
        let in_range = |size: u64, offset: u64, len: u64| {
            if offset.checked_add(len).is_none_or(|end| end > size) {
                return Err(fail(
                    Status::BadRequest,
                    format!("range {offset}+{len} is outside a buffer of {size} bytes"),
                ));
            }
            Ok(())
        };
        let fresh = |id: Id| {
            if kind(id).is_some() {
                return Err(fail(
                    Status::BadRequest,
                    format!("id {id} is already in use"),
                ));
            }
            if live >= cfg.max_ids_per_lease {
                return Err(fail(
                    Status::CapacityExceeded,
                    format!("more than {} live ids in one lease", cfg.max_ids_per_lease),
                ));
            }
            Ok(())
        };
        let stream = c.stream;
        let step = (|| -> Result<Effect, OpError> {
            if !streams.contains(&stream) && streams.len() >= cfg.max_streams_per_lease {
                return Err(fail(
                    Status::CapacityExceeded,
                    format!(
                        "stream {stream} would be more than the lease's limit of {} streams",
                        cfg.max_streams_per_lease
                    ),
                ));
            }
            Ok(match &c.op {
                OpView::Alloc { buf, size } => {
                    fresh(*buf)?;
                    shared
                        .table()
                        .charge(lease, *size, now)
                        .map_err(|e| fail(e.status, e.message))?;
                    p.charged.push((i, *size));
                    Effect::Create(*buf, IdKind::Buffer(*size))
                }
                OpView::Write { buf, offset, len } => {
                    in_range(buffer(*buf)?, *offset, u64::from(*len))?;
                    p.write_bytes += *len as usize;
                    Effect::None
                }
                OpView::Read { buf, offset, len } => {
                    in_range(buffer(*buf)?, *offset, u64::from(*len))?;
                    read_total += u64::from(*len);
                    if read_total > u64::from(cfg.limits.max_data) {
                        return Err(fail(
                            Status::BadRequest,
                            "reads exceed the reply data limit".into(),
                        ));
                    }
                    // The bytes are held for the reply until it is taken:
                    // charged to the principal before they are read.
                    if let Some(t) = turn.as_deref_mut() {
                        t.grow(u64::from(*len))
                            .map_err(|m| fail(Status::CapacityExceeded, format!("read: {m}")))?;
                    }
                    Effect::None
                }
                OpView::Free { id } => {
                    if kind(*id).is_none() {
                        return Err(fail(Status::NotFound, format!("unknown id {id}")));
                    }
                    Effect::Free(*id)
                }
                OpView::Launch(spec) => {
                    for a in &spec.args {
                        match a {
                            ArgView::Scalar(_) => {}
                            ArgView::Mem { buf, offset } => in_range(buffer(*buf)?, *offset, 0)?,
                            ArgView::Input(_) | ArgView::Output => {
                                return Err(fail(
                                    Status::BadRequest,
                                    "Input/Output are for GPU_SUBMIT".into(),
                                ))
                            }
                        }
                    }
                    Effect::None
                }
                OpView::Fill {
                    buf, offset, len, ..
                } => {
                    in_range(buffer(*buf)?, *offset, *len)?;
                    Effect::None
                }
                OpView::Copy {
                    src,
                    src_offset,
                    dst,
                    dst_offset,
                    len,
                } => {
                    in_range(buffer(*src)?, *src_offset, *len)?;
                    in_range(buffer(*dst)?, *dst_offset, *len)?;
                    if src == dst {
                        return Err(fail(
                            Status::BadRequest,
                            format!("a copy from {src} to itself"),
                        ));
                    }
                    Effect::None
                }
                OpView::Record { event } => {
                    let effect = match kind(*event) {
                        Some(IdKind::Event) => Effect::None,
                        Some(IdKind::Buffer(_)) => {
                            return Err(fail(
                                Status::BadRequest,
                                format!("{event} is a buffer, not an event"),
                            ))
                        }
                        None => {
                            fresh(*event)?;
                            Effect::Create(*event, IdKind::Event)
                        }
                    };
                    effect
                }
                OpView::Wait { event } => {
                    match kind(*event) {
                        Some(IdKind::Event) => {}
                        Some(IdKind::Buffer(_)) => {
                            return Err(fail(
                                Status::BadRequest,
                                format!("{event} is a buffer, not an event"),
                            ))
                        }
                        None => return Err(fail(Status::NotFound, format!("unknown id {event}"))),
                    }
                    Effect::None
                }
            })
        })();
        match step {
            Ok(effect) => {
                match effect {
                    Effect::Create(id, k) => {
                        overlay.insert(id, Some(k));
                        live += 1;
                    }
                    Effect::Free(id) => {
                        overlay.insert(id, None);
                        live -= 1;
                    }
                    Effect::None => {}
                }
                streams.insert(stream);
                p.effects.push(effect);
            }
            Err(e) => {
                p.error = Some(e);
                break;
            }
        }
    }
    p
}
