//! Striped transfers: a large MEM_WRITE or MEM_READ split over several
//! connections ([`ClientConfig::stripes`](super::ClientConfig::stripes)),
//! the reads landing in one [`StripeBuffer`].

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::connection::{connect_timed_out, dial};
use super::error::{disconnected, protocol_error};
use super::{Client, Error};
use crate::proto::{to_body, Id, LeaseId, MemRead, MemWrite, Opcode};

impl Client {
    /// The connections a transfer of `len` bytes is striped over: the main
    /// one below the data path's threshold; one of the main one and the
    /// extra ones, in turn, below the striping threshold (so many tasks'
    /// mid-size transfers spread over every connection); else the main
    /// one and the extra ones. The extra ones are opened and authenticated
    /// on first use.
    async fn stripe_set(&self, len: usize) -> Result<Vec<&quinn::Connection>, Error> {
        let n = self.config.stripes.max(1);
        if n == 1 || len < self.config.data_path_min_bytes.max(1) {
            return Ok(vec![&self.conn]);
        }
        let all = self.stripe_conns_all(n).await?;
        if len < self.config.stripe_min_bytes.max(1) {
            let i = self.next_stripe.fetch_add(1, Ordering::Relaxed) % all.len();
            return Ok(vec![all[i]]);
        }
        Ok(all)
    }

    /// The main connection and the `n - 1` extra ones.
    async fn stripe_conns_all(&self, n: usize) -> Result<Vec<&quinn::Connection>, Error> {
        let extra = self
            .stripe_conns
            .get_or_try_init(|| async {
                let mut v = Vec::with_capacity(n - 1);
                let timeout = self.config.connect_timeout;
                let refused = std::sync::atomic::AtomicU32::new(0);
                let open = async {
                    for _ in 1..n {
                        let conn = dial(
                            &self.endpoint,
                            self.addr,
                            &self.config.server_name,
                            &refused,
                        )
                        .await?;
                        self.hello(&conn).await?;
                        v.push(conn);
                    }
                    Ok::<_, Error>(())
                };
                tokio::time::timeout(timeout, open)
                    .await
                    .map_err(|_| connect_timed_out(self.addr, timeout, refused.into_inner()))??;
                Ok::<_, Error>(v)
            })
            .await?;
        Ok(std::iter::once(&self.conn).chain(extra).collect())
    }

    /// How many stripes a transfer of `len` bytes takes.
    fn stripe_count(&self, len: usize) -> usize {
        let n = self.config.stripes.max(1);
        if len < self.config.stripe_min_bytes.max(1) {
            1
        } else {
            n
        }
    }

    /// The connections a transfer of `len` bytes goes over, each with its
    /// part: bulk-data ones when the node has the channel and the transfer
    /// is large enough (`up`: a write), else QUIC ones ([`Client::stripe_set`]).
    async fn lanes(&self, up: bool, len: usize) -> Result<Vec<(Lane, Range<usize>)>, Error> {
        let (lanes, parts): (Vec<Lane>, _) = match self.bulk_for(up, len).await {
            Some(bulk) => {
                let parts = stripe_bounds(len, self.stripe_count(len));
                let conns = bulk.take(self, parts.len()).await?;
                (conns.into_iter().map(Lane::Bulk).collect(), parts)
            }
            None => {
                let conns = self.stripe_set(len).await?;
                let parts = stripe_bounds(len, conns.len());
                (
                    conns.into_iter().map(|c| Lane::Quic(c.clone())).collect(),
                    parts,
                )
            }
        };
        Ok(lanes.into_iter().zip(parts).collect())
    }

    /// Runs `pieces` (opcode, body, data, where a read's data lands) in
    /// turn on `lane`.
    async fn run_lane<'a>(
        &self,
        lane: Lane,
        pieces: impl IntoIterator<Item = (Opcode, Vec<u8>, &'a [u8], &'a mut [u8])>,
    ) -> Result<(), Error> {
        match lane {
            Lane::Bulk(conn) => self.bulk_run(conn, pieces).await,
            Lane::Quic(conn) => {
                for (op, body, data, into) in pieces {
                    let into = (op == Opcode::MemRead).then_some(into);
                    self.request_on(&conn, op, &body, data, into).await?;
                }
                Ok(())
            }
        }
    }

    /// Writes `bytes` to memory at `offset`, striped over the connections
    /// of [`ClientConfig::stripes`](super::ClientConfig::stripes) when large enough
    /// (bulk-data connections when the node has them). One task polls
    /// every stripe (the bytes are borrowed), so a bulk-data channel's
    /// encryption runs on one thread: `write_shared` spreads it.
    pub(super) async fn striped_write(&self, to: Target, bytes: &[u8]) -> Result<(), Error> {
        let lanes = self.lanes(true, bytes.len()).await?;
        let futs = lanes.into_iter().map(|(lane, r)| {
            let pieces =
                requests(r).map(|r| (Opcode::MemWrite, write_body(to, &r), &bytes[r], &mut [][..]));
            self.run_lane(lane, pieces)
        });
        futures::future::join_all(futs).await.into_iter().collect()
    }

    /// [`Client::striped_write`] of bytes the stripes share, each stripe
    /// running (and encrypting) on its own task.
    #[cfg(feature = "backend")]
    pub(crate) async fn write_shared(
        self: &Arc<Self>,
        to: Target,
        bytes: super::bulk::SharedBytes,
    ) -> Result<(), Error> {
        let lanes = self.lanes(true, (*bytes).as_ref().len()).await?;
        let tasks = lanes.into_iter().map(|(lane, r)| {
            let client = self.clone();
            let bytes = bytes.clone();
            async move {
                let data = (*bytes).as_ref();
                let pieces = requests(r)
                    .map(|r| (Opcode::MemWrite, write_body(to, &r), &data[r], &mut [][..]));
                client.run_lane(lane, pieces).await
            }
        });
        join_tasks(tasks).await
    }

    /// Reads `out.as_mut().len()` bytes of memory at `offset` straight
    /// into `out` (no second buffer), striped like
    /// [`Client::striped_write`], and gives `out` back.
    pub(crate) async fn striped_read_to<B>(
        self: &Arc<Self>,
        to: Target,
        mut out: B,
    ) -> Result<B, Error>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        let len = out.as_mut().len();
        let lanes = self.lanes(false, len).await?;
        if let [(Lane::Quic(conn), _)] = &lanes[..] {
            // One stripe: its reads in turn, on this task.
            for r in requests(0..len) {
                let body = read_body(to, &r);
                let into = Some(&mut out.as_mut()[r]);
                self.request_on(conn, Opcode::MemRead, &body, &[], into)
                    .await?;
            }
            return Ok(out);
        }
        // One task per stripe, so the connections' reads (and copies, and
        // the page faults of a fresh buffer) run on several threads, all
        // into one buffer, with no concatenation after.
        let out = Arc::new(StripeBuffer::over(out));
        let tasks = lanes.into_iter().map(|(lane, r)| {
            let client = self.clone();
            let out = out.clone();
            async move {
                let pieces = requests(r).map(|r| {
                    let body = read_body(to, &r);
                    // SAFETY: the stripes' ranges are disjoint (from
                    // `stripe_bounds`), their requests' too, and this
                    // task alone touches this range, one piece at a time.
                    let part = unsafe { out.range_mut(r) };
                    (Opcode::MemRead, body, &[][..], part)
                });
                client.run_lane(lane, pieces).await
            }
        });
        join_tasks(tasks).await?;
        StripeBuffer::into_inner(out)
    }
}

/// A connection a stripe of a transfer goes over.
// A few per transfer, moved once each: not worth a box.
#[allow(clippy::large_enum_variant)]
enum Lane {
    Quic(quinn::Connection),
    Bulk(super::bulk::Conn),
}

/// Where a streamed transfer goes: a lease's buffer from a byte offset,
/// after one of the lease's numbered batches ([`MemWrite::after`]; 0:
/// none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub(crate) lease: LeaseId,
    pub(crate) buf: Id,
    pub(crate) offset: u64,
    pub(crate) after: u64,
}

fn write_body(to: Target, r: &std::ops::Range<usize>) -> Vec<u8> {
    to_body(&MemWrite {
        lease: to.lease,
        buf: to.buf,
        offset: to.offset + r.start as u64,
        after: to.after,
    })
}

fn read_body(to: Target, r: &std::ops::Range<usize>) -> Vec<u8> {
    to_body(&MemRead {
        lease: to.lease,
        buf: to.buf,
        offset: to.offset + r.start as u64,
        len: r.len() as u32,
        after: to.after,
    })
}

/// Runs each stripe's future as a task of its own, waits for every task
/// (all of them, even after one failed, so none outlives the transfer) and
/// returns the first error.
async fn join_tasks<F>(tasks: impl IntoIterator<Item = F>) -> Result<(), Error>
where
    F: std::future::Future<Output = Result<(), Error>> + Send + 'static,
{
    let tasks = tasks.into_iter().map(tokio::spawn);
    let mut done = futures::future::join_all(tasks).await.into_iter();
    done.try_for_each(|r| r.unwrap_or_else(|e| Err(disconnected(format!("stripe task: {e}")))))
}

/// One buffer that several stripe tasks fill, each in its own range.
struct StripeBuffer<B> {
    ptr: *mut u8,
    len: usize,
    /// Boxed, so its bytes stay where `ptr` points however the box moves.
    buf: std::cell::UnsafeCell<Box<B>>,
}

// SAFETY: the buffer owns a `B` (which is `Send`); it is reached from
// several threads only through `range_mut`, whose contract makes the ranges
// disjoint, so sharing it is sharing disjoint `&mut [u8]`s (which are
// `Send`), and `into_inner` needs sole ownership.
unsafe impl<B: Send> Send for StripeBuffer<B> {}
// SAFETY: as above.
unsafe impl<B: Send> Sync for StripeBuffer<B> {}

impl<B: AsMut<[u8]>> StripeBuffer<B> {
    fn over(b: B) -> Self {
        let mut b = Box::new(b);
        let bytes = (*b).as_mut();
        StripeBuffer {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
            buf: std::cell::UnsafeCell::new(b),
        }
    }

    /// # Safety
    /// No two slices returned for overlapping ranges may be alive at once,
    /// and `r` lies inside the buffer.
    #[allow(clippy::mut_from_ref)] // disjoint ranges, by the contract above
    unsafe fn range_mut(&self, r: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "range outside the buffer"
        );
        // SAFETY: inside the bytes (checked), which live as long as `self`
        // and never move (the boxed `B` is not touched until
        // `into_inner`); disjointness is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }

    /// The buffer, once every stripe task has let go of it.
    fn into_inner(this: Arc<Self>) -> Result<B, Error> {
        let this = Arc::try_unwrap(this)
            .map_err(|_| protocol_error("a stripe task outlived its transfer"))?;
        Ok(*this.buf.into_inner())
    }
}

/// The most bytes one MEM_WRITE or MEM_READ carries (a node refuses
/// requests above its frame limit, 512 MiB by default).
const MAX_REQUEST_BYTES: usize = 256 << 20;

/// `r` cut into requests of at most [`MAX_REQUEST_BYTES`].
fn requests(r: std::ops::Range<usize>) -> impl Iterator<Item = std::ops::Range<usize>> {
    (r.start..r.end)
        .step_by(MAX_REQUEST_BYTES)
        .map(move |s| s..(s + MAX_REQUEST_BYTES).min(r.end))
}

/// Splits `len` bytes into at most `n` contiguous ranges whose inner
/// bounds fall on 2 MiB (the node's chunk size); one empty range for 0.
fn stripe_bounds(len: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    const ALIGN: usize = 2 << 20;
    let per = len.div_ceil(n.max(1)).div_ceil(ALIGN).max(1) * ALIGN;
    (0..len.max(1))
        .step_by(per)
        .map(|start| start..(start + per).min(len))
        .collect()
}

#[cfg(test)]
mod stripe_tests {
    use super::stripe_bounds;

    #[test]
    fn stripes_cover_the_range_in_aligned_parts() {
        const M: usize = 2 << 20;
        assert_eq!(stripe_bounds(0, 4), vec![0..0]);
        assert_eq!(stripe_bounds(5, 4), vec![0..5]);
        assert_eq!(
            stripe_bounds(8 * M, 4),
            vec![0..2 * M, 2 * M..4 * M, 4 * M..6 * M, 6 * M..8 * M]
        );
        assert_eq!(
            stripe_bounds(3 * M + 1, 4),
            vec![0..M, M..2 * M, 2 * M..3 * M, 3 * M..3 * M + 1]
        );
        for (len, n) in [(1, 1), (M - 1, 3), (256 * M / 2 + 7, 4), (9 * M, 8)] {
            let parts = stripe_bounds(len, n);
            assert!(parts.len() <= n);
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts.last().unwrap().end, len);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[0].end % M, 0);
            }
        }
    }
}
