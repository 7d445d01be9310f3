//! The direct path's tasks: connections, their HELLO, and each BATCH
//! checked as the node would, put in the lease's order and handed to the
//! device loop ([`Served`]: their shared state).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, Notify, Semaphore};

use crate::budget::{Charged, WorkerBudget};

use super::{DirectLimits, ToDevice, DIRECT_HELLO_TIMEOUT, MAX_DIRECT_CONNECTIONS};
use crate::device::DeviceError;
use crate::lock;
use crate::order::{Arrival, LeaseOrder, Stalled};
use crate::proto::{
    self, from_body, to_body, BatchHead, BatchReply, DirectHello, ErrorBody, Header, LeaseId,
    Limits, ModuleHash, Opcode, Status, DIRECT_STAMPS, DIRECT_TICKET_LEN, FLAG_STAMPS,
};
use crate::stamps::now_ns;
use crate::worker::messages::{encode_worker_batch, BatchLimits, WorkerBatchReply, WorkerLoad};

/// The lease's tasks' state.
pub(super) struct Served {
    pub(super) lease: LeaseId,
    pub(super) ticket: [u8; DIRECT_TICKET_LEN],
    pub(super) limits: DirectLimits,
    pub(super) order: LeaseOrder,
    /// Modules handed to the device loop to load (or loaded).
    pub(super) known: Mutex<HashSet<ModuleHash>>,
    /// The principal's budget, which the lease's requests are charged to.
    pub(super) budget: Arc<WorkerBudget>,
    pub(super) requests: Semaphore,
    /// A fault poisoned the lease's context: later batches are refused.
    pub(super) poisoned: AtomicBool,
    /// What was handed to the device loop and not yet taken, in order;
    /// `any_handed` says whether there is any, `notify` wakes a sleep.
    pub(super) handed: Mutex<Vec<ToDevice>>,
    pub(super) any_handed: AtomicBool,
    pub(super) notify: Notify,
    /// BATCHes accepted on the path and their commands, since it opened
    /// (the node adds them to its metrics: [`DirectLink::served`]).
    pub(super) batches: AtomicU64,
    pub(super) commands: AtomicU64,
    pub(super) compiled: AtomicU64,
}

impl Served {
    pub(super) fn hand(&self, work: ToDevice) {
        lock(&self.handed).push(work);
        self.any_handed.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    fn frame_limits(&self) -> Limits {
        Limits {
            max_body: self.limits.max_body,
            max_data: self.limits.max_data,
        }
    }
}

pub(super) async fn serve(served: Arc<Served>, endpoint: quinn::Endpoint) {
    let mut next_conn = 0usize;
    let open = Arc::new(Semaphore::new(MAX_DIRECT_CONNECTIONS));
    while let Some(incoming) = endpoint.accept().await {
        let Ok(place) = open.clone().try_acquire_owned() else {
            incoming.refuse();
            continue;
        };
        next_conn += 1;
        let served = served.clone();
        tokio::spawn(async move {
            connection(served, incoming, next_conn).await;
            drop(place);
        });
    }
}

async fn connection(served: Arc<Served>, incoming: quinn::Incoming, id: usize) {
    let opened = async {
        let conn = incoming.await.ok()?;
        let ok = hello(&served, &conn).await;
        Some((conn, ok))
    };
    let Ok(Some((conn, ok))) = tokio::time::timeout(DIRECT_HELLO_TIMEOUT, opened).await else {
        return;
    };
    if !ok {
        conn.close(1u32.into(), b"send HELLO with the lease's ticket first");
        return;
    }
    while let Ok((send, recv)) = conn.accept_bi().await {
        tokio::spawn(request(served.clone(), send, recv, id));
    }
    // Numbers that have not come on it never will.
    served.order.update(|s| s.closed(id));
}

/// Reads the connection's first stream: a HELLO with the lease's ticket.
async fn hello(served: &Served, conn: &quinn::Connection) -> bool {
    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
        return false;
    };
    let small = Limits {
        max_body: 256,
        max_data: 0,
    };
    let Ok(proto::Frame {
        header: h, body, ..
    }) = proto::read_frame(&mut recv, &small).await
    else {
        return false;
    };
    let ok = h.opcode == Opcode::Hello
        && !h.is_reply()
        && from_body::<DirectHello>(&body).is_ok_and(|d| {
            d.lease == served.lease && crate::same_secret(&served.ticket, &d.ticket)
        });
    let status = if ok { Status::Ok } else { Status::Unauthorized };
    let reply = if ok {
        Vec::new()
    } else {
        to_body(&ErrorBody {
            message: "not this lease's ticket".into(),
        })
    };
    let rh = Header::reply(&h, status, reply.len() as u32, 0);
    let _ = crate::proto::write_frame(&mut send, &rh, &reply, &[]).await;
    let _ = send.finish();
    if !ok {
        // The refusal is read before the connection closes (bounded: a
        // peer that never reads it is closed on anyway).
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), send.stopped()).await;
    }
    ok
}

/// A refusal: status and message.
type Refusal = (Status, String);

fn refused(status: Status, message: impl Into<String>) -> Refusal {
    (status, message.into())
}

/// Serves one stream: one BATCH of the lease.
async fn request(
    served: Arc<Served>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    conn: usize,
) {
    let Ok(h) = proto::read_header(&mut recv, &served.frame_limits()).await else {
        let _ = send.reset(0u32.into());
        return;
    };
    let r = run(&served, &h, &mut recv, conn).await;
    let stamps = r.as_ref().ok().and_then(|ran| ran.stamps);
    // A reply's bytes stay charged until they are written (or the client
    // is gone): `_charge` lives to the end.
    let (status, mut body, data, _charge) = match r {
        Ok(ran) => (Status::Ok, to_body(&ran.reply), ran.data, ran.charge),
        Err((status, message)) => (status, to_body(&ErrorBody { message }), Vec::new(), None),
    };
    if let Some(stamps) = stamps {
        // The last: the reply's write starts.
        for t in stamps.into_iter().chain([now_ns()]) {
            body.extend_from_slice(&t.to_le_bytes());
        }
    }
    let mut rh = Header::reply(&h, status, body.len() as u32, data.len() as u32);
    if stamps.is_some() {
        rh.flags |= FLAG_STAMPS;
    }
    if crate::proto::write_frame(&mut send, &rh, &body, &data)
        .await
        .is_ok()
    {
        let _ = send.finish();
        let _ = send.stopped().await;
    }
}

/// A batch that ran: its reply, its reads' data and, if the client asked
/// ([`FLAG_STAMPS`]), its stamps but the last (taken as the reply's write starts).
struct Ran {
    reply: BatchReply,
    data: Vec<u8>,
    stamps: Option<[u64; DIRECT_STAMPS - 1]>,
    /// Its reply's bytes, charged to the principal.
    charge: Option<Charged>,
}

async fn run(
    served: &Served,
    h: &Header,
    recv: &mut quinn::RecvStream,
    conn: usize,
) -> Result<Ran, Refusal> {
    if h.opcode != Opcode::Batch || h.is_reply() {
        return Err(refused(
            Status::BadRequest,
            format!(
                "a lease's direct connection takes BATCH only, not {:?}",
                h.opcode
            ),
        ));
    }
    let Ok(_request) = served.requests.try_acquire() else {
        return Err(refused(
            Status::CapacityExceeded,
            format!(
                "{} requests of the lease are in flight, its limit",
                served.limits.max_requests
            ),
        ));
    };
    let over = |what: u64| {
        refused(
            Status::CapacityExceeded,
            format!(
                "{what} more bytes would pass its principal's limit of {} in flight \
                 (max_bytes_per_principal, counted across its leases)",
                served.budget.limit()
            ),
        )
    };
    let declared = u64::from(h.body_len) + u64::from(h.data_len);
    let Some(_held) = served.budget.charge(declared) else {
        return Err(over(declared));
    };
    let mut body = vec![0u8; h.body_len as usize];
    let mut data = vec![0u8; h.data_len as usize];
    let read = async {
        recv.read_exact(&mut body).await?;
        recv.read_exact(&mut data).await
    };
    read.await
        .map_err(|e| refused(Status::BadRequest, format!("request cut short: {e}")))?;
    cuda_lease::transport::read_end_if_here(recv);
    let read_at = (h.flags & FLAG_STAMPS != 0).then(now_ns);
    let (head, wire) = BatchHead::decode(&body).map_err(bad)?;
    head.validate(data.len()).map_err(bad)?;
    let commands = proto::command_count(wire).map_err(bad)?;
    if head.lease == served.lease {
        served.batches.fetch_add(1, Ordering::Relaxed);
        served.commands.fetch_add(commands, Ordering::Relaxed);
    }
    if head.lease != served.lease {
        return Err(refused(
            Status::BadRequest,
            format!(
                "this connection serves lease {}, not {}",
                served.lease, head.lease
            ),
        ));
    }
    if served.poisoned.load(Ordering::Acquire) {
        return Err(refused(
            Status::LeasePoisoned,
            "lease poisoned: a fault ended its context",
        ));
    }
    let reply_bytes = head.reply_bytes.min(u64::from(served.limits.max_data));
    let Some(charge) = served.budget.charge(reply_bytes) else {
        return Err(over(reply_bytes));
    };
    let seq = head.seq;
    if seq == u64::MAX {
        return Err(refused(
            Status::BadRequest,
            format!("batch number {seq} has no successor: numbers wrap"),
        ));
    }
    let mut place = None;
    if seq != 0 {
        let (arrival, p) = served.order.arrive(seq, conn);
        if arrival == Arrival::Passed {
            if commands == 0 && head.modules.is_empty() {
                return Ok(Ran {
                    reply: BatchReply::default(),
                    data: Vec::new(),
                    stamps: None,
                    charge: None,
                });
            }
            return Err(refused(
                Status::BadRequest,
                format!("batch number {seq} of the lease has run already, or is here"),
            ));
        }
        place = Some(p);
    }
    // Its modules are settled in its turn: the ones before it may load some.
    if let Some(p) = place.as_mut() {
        p.turn().await.map_err(stalled)?;
    }
    let Settled {
        loads,
        sources,
        writes,
    } = match modules(served, &head, &data) {
        Ok(m) => m,
        Err(r) => {
            if let (Some(p), Status::UnknownModule) = (place.take(), r.0) {
                // Sent again with its sources, the batch keeps its place.
                p.withdraw();
            }
            return Err(r);
        }
    };
    let limits = BatchLimits {
        reserved: served.limits.reserved,
        max_ids: served.limits.max_ids,
        max_streams: served.limits.max_streams,
        max_read: u64::from(served.limits.max_data),
        reply_bytes,
    };
    let hashes: Vec<ModuleHash> = head.modules.iter().map(|m| m.hash).collect();
    let mut worker_body = Vec::with_capacity(wire.len() + 64);
    encode_worker_batch(&mut worker_body, &loads, &limits, &hashes, wire);
    let mut worker_data =
        Vec::with_capacity(sources.iter().map(|s| s.len()).sum::<usize>() + writes.len());
    for s in &sources {
        worker_data.extend_from_slice(s);
    }
    worker_data.extend_from_slice(writes);
    drop(data);
    let (tx, rx) = oneshot::channel();
    served.hand(ToDevice::Batch {
        body: worker_body,
        data: worker_data,
        answer: tx,
        stamps: read_at.is_some(),
    });
    let handed_at = read_at.map(|_| now_ns());
    // Handed over: the device loop plans in this order.
    drop(place);
    let answer = rx
        .await
        .map_err(|_| refused(Status::Internal, "the worker's device loop is gone"))?;
    if answer.status != Status::Ok {
        forget(served, &loads);
        let message = from_body::<DeviceError>(&answer.body)
            .map(|e| e.message)
            .unwrap_or_default();
        return Err((answer.status, message));
    }
    let reply: WorkerBatchReply = from_body(&answer.body)
        .map_err(|e| refused(Status::Internal, format!("worker reply: {e}")))?;
    served
        .compiled
        .fetch_add(reply.compiled.len() as u64, Ordering::Relaxed);
    let loaded = (reply.loaded as usize).min(loads.len());
    forget(served, &loads[loaded..]);
    if reply.sticky && reply.error.is_some() {
        served.poisoned.store(true, Ordering::Release);
    }
    let stamps = read_at.zip(handed_at).map(|(read, handed)| {
        let [w0, w1, w2, w3, w4, w5] = reply.stamps.unwrap_or_default();
        [read, handed, w0, w1, w2, w3, w4, w5]
    });
    Ok(Ran {
        reply: BatchReply {
            completed: reply.completed,
            error: reply.error,
        },
        data: answer.data,
        stamps,
        charge: Some(charge),
    })
}

fn bad(e: impl std::fmt::Display) -> Refusal {
    refused(Status::BadRequest, e.to_string())
}

fn stalled(e: Stalled) -> Refusal {
    match e {
        Stalled::Ended => refused(Status::LeaseNotFound, "the lease ended"),
        Stalled::Disconnected { missing } => refused(
            Status::BadRequest,
            format!(
                "batch {missing} of the lease never came: the connection that carried \
                 the lease's batches closed"
            ),
        ),
    }
}

/// Modules the device loop did not load are not the lease's.
fn forget(served: &Served, loads: &[WorkerLoad]) {
    let mut known = lock(&served.known);
    for l in loads {
        known.remove(&l.hash);
    }
}

/// A batch's modules to load, their sources, and its writes' data.
struct Settled<'d> {
    loads: Vec<WorkerLoad>,
    sources: Vec<&'d [u8]>,
    writes: &'d [u8],
}

/// The modules of `head` the lease lacks (marked known: later batches
/// skip them), their sources (hash-checked), and the writes' data.
fn modules<'d>(served: &Served, head: &BatchHead, data: &'d [u8]) -> Result<Settled<'d>, Refusal> {
    let (given, rest) = head.sources(data).map_err(bad)?;
    let mut loads = Vec::new();
    let mut sources = Vec::new();
    let mut known = lock(&served.known);
    for (m, given) in head.modules.iter().zip(given) {
        // (A batch names a module once: `BatchHead::validate`.)
        if known.contains(&m.hash) {
            continue;
        }
        let Some((kind, text)) = given else {
            return Err(refused(
                Status::UnknownModule,
                format!(
                    "module {} is not loaded in the lease: send the batch again with its source",
                    m.hash
                ),
            ));
        };
        loads.push(WorkerLoad {
            hash: m.hash,
            kind: kind.clone(),
            len: text.len() as u32,
        });
        sources.push(text.as_bytes());
    }
    for l in &loads {
        known.insert(l.hash);
    }
    Ok(Settled {
        loads,
        sources,
        writes: rest,
    })
}
