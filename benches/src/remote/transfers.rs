//! Lease allocation, the one-kernel BATCH round trip and MEM_WRITE /
//! MEM_READ, on one connection and striped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_lease::client::{Client, Lease, Session};
use cuda_lease::proto::LaunchArg;
use cuda_lease::ptx::TEST_KERNELS;
use cuda_lease::stamps::{self, stamp, Point};

use super::baselines::Raw;
use super::chain::timed_then_stamped;
use super::raw::RawQuinn;
use super::{detail, detail_steps, detail_times, gib_s, rates, size_label, times, Ctx};
use crate::report::{Goal, Row, Unit};
use crate::Result;

/// `remote_alloc`: lease allocation with a pre-started worker, then cold
/// (worker start + context creation).
pub(super) async fn alloc_rows(ctx: &Ctx) -> Result<Vec<Row>> {
    let (client, refill) = (&ctx.client, ctx.cfg.refill);
    tokio::time::sleep(refill).await; // let the pre-started worker come up
    let mut warm = Vec::new();
    let mut cold = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let l = Lease::builder()
            .min_vram(1 << 20)
            .on(client.clone())
            .await?;
        warm.push(t.elapsed());
        l.free().await?;
        tokio::time::sleep(refill).await; // refill
    }
    for _ in 0..5 {
        let t = Instant::now();
        let a = Lease::builder()
            .min_vram(1 << 20)
            .on(client.clone())
            .await?;
        let b = Lease::builder()
            .min_vram(1 << 20)
            .on(client.clone())
            .await?; // pool is empty now
        cold.push(t.elapsed());
        a.free().await?;
        b.free().await?;
        tokio::time::sleep(refill).await;
    }
    detail_times("LEASE_ALLOC with a pre-started worker", &warm);
    detail_times(
        "two LEASE_ALLOCs, the second cold (worker start + context)",
        &cold,
    );
    Ok(vec![
        Row::new(
            "remote_alloc",
            "LEASE_ALLOC with a pre-started worker",
            Unit::Millis,
        )
        .lib(times(Unit::Millis, &warm)),
        Row::new(
            "remote_alloc",
            "two LEASE_ALLOCs, the second cold (worker start + context)",
            Unit::Millis,
        )
        .lib(times(Unit::Millis, &cold)),
    ])
}

/// The lease path's samples: BATCH round trips, MEM_WRITE and MEM_READ.
#[derive(Debug)]
pub(super) struct LeaseRows {
    batch: Vec<Duration>,
    /// The raw 64 B request/reply, timed interleaved with `batch`.
    batch_raw: Vec<Duration>,
    write: Vec<Duration>,
    read: Vec<Duration>,
}

/// One-kernel BATCH round trip, then MEM_WRITE / MEM_READ of the bulk size,
/// on the single-connection client.
pub(super) async fn lease_rows(ctx: &Ctx) -> Result<LeaseRows> {
    let (iters, size) = (ctx.cfg.iters, ctx.cfg.bytes);
    let lease = Lease::builder()
        .min_vram(size + (16 << 20))
        .ttl(Duration::from_secs(120))
        .on(ctx.client.clone())
        .await?;
    let s = lease.session();
    let module = s.load_module(TEST_KERNELS).await?;
    let out = s.alloc(4096).await?;

    // One-kernel BATCH: a launch, replied to when it is done.
    let mut batch = s.recorder();
    batch.launch(
        0,
        &module,
        "iota",
        [1, 1, 1],
        [256, 1, 1],
        vec![out.arg(), LaunchArg::u32(256)],
    );
    for _ in 0..100 {
        batch.submit().await?.ok()?;
    }
    // Timed in blocks in turn with its reference, a raw 64 B
    // request/reply, so that both see the same host.
    let raw = RawQuinn::start_with(1, &ctx.cfg.transport.1).await?;
    let (mut rtt, mut raw_rtt) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    let mut steps = Vec::new();
    for (path, keep, stamping) in timed_then_stamped(iters, 2, ctx.cfg.stamps, &[1]) {
        stamps::set_enabled(stamping);
        stamps::clear();
        let d = if path == 0 {
            raw.round_trip(64).await?
        } else {
            stamp(Point::Start);
            let t = Instant::now();
            batch.submit().await?.ok()?;
            let d = t.elapsed();
            stamp(Point::End);
            d
        };
        match (keep, stamping, path) {
            (false, _, _) => {}
            (true, true, _) => steps.push(stamps::take()),
            (true, false, 0) => raw_rtt.push(d),
            (true, false, _) => rtt.push(d),
        }
    }
    stamps::set_enabled(false);
    raw.close().await;
    detail_steps("one-kernel BATCH", &steps);
    detail_times(
        "one-kernel BATCH (launch, reply when done) round trip",
        &rtt,
    );
    detail_times(
        "raw quinn 64 B request/reply, interleaved with the BATCH",
        &raw_rtt,
    );

    let (write, read) = transfer_rates(&s, "", ctx).await?;
    drop((out, module));
    lease.free().await?;
    Ok(LeaseRows {
        batch: rtt,
        batch_raw: raw_rtt,
        write,
        read,
    })
}

/// MEM_WRITE / MEM_READ on a lease of the striped client.
pub(super) async fn striped_rates(ctx: &Ctx) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let lease = Lease::builder()
        .min_vram(ctx.cfg.bytes + (16 << 20))
        .ttl(Duration::from_secs(120))
        .on(Arc::<Client>::clone(&ctx.quic_striped))
        .await?;
    let label = format!(" striped over {}", ctx.stripes);
    let rates = transfer_rates(&lease.session(), &label, ctx).await?;
    lease.free().await?;
    Ok(rates)
}

/// MEM_WRITE (after one warm-up) then MEM_READ of the bulk size on `s`:
/// each one's times.
async fn transfer_rates(
    s: &Session,
    label: &str,
    ctx: &Ctx,
) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let (size, xfer_iters) = (ctx.cfg.bytes, ctx.cfg.xfer_iters);
    let big = s.alloc(size).await?;
    let data = vec![0x5Au8; size as usize];
    s.write(&big, 0, &data).await?; // warm-up
    let mut w = Vec::new();
    for _ in 0..xfer_iters {
        let t = Instant::now();
        s.write(&big, 0, &data).await?;
        w.push(t.elapsed());
    }
    detail_rate(&format!("MEM_WRITE {}{label}", size_label(size)), size, &w);
    let mut r = Vec::new();
    for _ in 0..xfer_iters {
        let t = Instant::now();
        let back = s.read(&big, 0, size as u32).await?;
        r.push(t.elapsed());
        if back != data {
            return Err("MEM_READ returned other bytes than MEM_WRITE wrote".into());
        }
    }
    detail_rate(&format!("MEM_READ {}{label}", size_label(size)), size, &r);
    // The same reads into one destination used again: without the page
    // faults and zeroing of a fresh buffer each time.
    let mut into = Vec::new();
    let mut out = vec![0u8; size as usize];
    for _ in 0..xfer_iters {
        let t = Instant::now();
        out = s.read_into(&big, 0, out).await?;
        into.push(t.elapsed());
        if out != data {
            return Err("MEM_READ into a buffer returned other bytes than MEM_WRITE wrote".into());
        }
    }
    detail_rate(
        &format!(
            "MEM_READ {}{label} into a buffer used again",
            size_label(size)
        ),
        size,
        &into,
    );
    drop(big);
    Ok((w, r))
}

fn detail_rate(name: &str, size: u64, v: &[Duration]) {
    let mut v = v.to_vec();
    v.sort();
    let med = v[v.len() / 2];
    detail(format_args!(
        "{name}: median {med:?} = {:.2} GiB/s (best {:?})",
        gib_s(size, med),
        v[0]
    ));
}

/// The rows of the BATCH round trip and the transfers against the raw
/// transport (goals: issue 19).
pub(super) fn rows(
    ctx: &Ctx,
    raw: &Raw,
    lease: &LeaseRows,
    (sw, sr): &(Vec<Duration>, Vec<Duration>),
) -> Vec<Row> {
    let size = ctx.cfg.bytes;
    let mib = size_label(size);
    let n = ctx.stripes;
    let rate = |metric: String, raw: &[Duration], lib: &[Duration], goal: f64| {
        Row::new("remote", metric, Unit::GiBps)
            .raw(rates(size, raw))
            .lib(rates(size, lib))
            .goal(Goal::AtLeast(goal))
            .goal_from("issue 19")
    };
    vec![
        Row::new(
            "remote",
            "one-kernel BATCH p50 vs raw quinn 64 B request/reply (interleaved)",
            Unit::Micros,
        )
        .raw(times(Unit::Micros, &lease.batch_raw))
        .lib(times(Unit::Micros, &lease.batch))
        .goal(Goal::AtMost(1.25))
        .goal_from("issue 61"),
        Row::new(
            "remote",
            "one-kernel BATCH p50 vs raw quinn 64 B request/reply relayed through a child process",
            Unit::Micros,
        )
        .raw(times(Unit::Micros, &raw.relayed))
        .lib(times(Unit::Micros, &lease.batch))
        .note("the raw side crosses a process boundary both ways, as the lease's worker does"),
        rate(
            format!("MEM_WRITE {mib} vs raw one connection up"),
            &raw.up1,
            &lease.write,
            0.9,
        ),
        rate(
            format!("MEM_READ {mib} vs raw one connection down"),
            &raw.down1,
            &lease.read,
            0.9,
        ),
        rate(
            format!("MEM_WRITE {mib} striped over {n} vs raw one connection up"),
            &raw.up1,
            sw,
            2.0,
        ),
        rate(
            format!("MEM_READ {mib} striped over {n} vs raw one connection down"),
            &raw.down1,
            sr,
            2.0,
        ),
    ]
}
