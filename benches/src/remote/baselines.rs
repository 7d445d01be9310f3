//! The raw transports, measured in the same run as the node: quinn with
//! the node's transport settings (one connection and striped over four),
//! quinn with its defaults and with [`TransportSettings::loopback`] on one
//! connection, and plain TCP on loopback (`tokio::net`, no TLS), the host's
//! reference. Their rows compare raw with raw and carry no goal.

use std::future::Future;
use std::time::Duration;

use super::raw::legs::{self, Leg};
use super::raw::{RawQuinn, RawTcp};
use cuda_lease::TransportSettings;

use super::{detail, detail_times, gib_s, rates, size_label, times, Ctx};
use crate::report::{Row, Unit};
use crate::Result;

/// The raw transports' samples: 64 B request/reply and the bulk size each
/// way.
#[derive(Debug)]
pub(super) struct Raw {
    /// The node's settings, a new stream per request.
    pub(super) rtt: Vec<Duration>,
    /// The same, the server relaying each request through a child process
    /// and back ([`RawQuinn::start_relayed`]).
    pub(super) relayed: Vec<Duration>,
    /// With busy polling on (`RemoteConfig::busy_poll`), `rtt` is raw
    /// quinn awake at both ends; this is the same with the threads asleep
    /// ([`RawQuinn::start_asleep`]). `None` with busy polling off.
    asleep: Option<Vec<Duration>>,
    /// The node's settings, one connection, client -> server.
    pub(super) up1: Vec<Duration>,
    /// The node's settings, one connection, server -> client.
    pub(super) down1: Vec<Duration>,
    up4: Vec<Duration>,
    down4: Vec<Duration>,
    /// quinn's default settings, one connection.
    pub(super) default: OneWay,
    /// [`TransportSettings::loopback`], one connection.
    tuned: OneWay,
    /// TCP on loopback, one connection.
    pub(super) tcp: OneWay,
}

/// One transport's 64 B round trips and bulk times each way.
#[derive(Debug)]
pub(super) struct OneWay {
    pub(super) rtt: Vec<Duration>,
    pub(super) up: Vec<Duration>,
    pub(super) down: Vec<Duration>,
}

/// `iters` times of `f` after 100 unmeasured calls.
async fn round_trips<F, Fut>(iters: usize, mut f: F) -> Result<Vec<Duration>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<Duration, super::raw::BoxError>>,
{
    for _ in 0..100 {
        f().await?;
    }
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        v.push(f().await?);
    }
    Ok(v)
}

/// `iters` 64 B round trips on `q` (see [`round_trips`]), then `q` closed
/// and the times printed as `what`.
async fn closed_round_trips(q: RawQuinn, iters: usize, what: &str) -> Result<Vec<Duration>> {
    let v = round_trips(iters, || q.round_trip(64)).await?;
    q.close().await;
    detail_times(what, &v);
    Ok(v)
}

/// Where a raw 64 B request/reply's time goes, on stderr, in the format of
/// the lease's steps: `iters` more round trips on `q`, one at a time,
/// stamped at the points that match a lease's (see [`legs`]); they are
/// not part of any row.
async fn raw_legs(q: &RawQuinn, iters: usize) -> Result<()> {
    legs::set_enabled(true);
    let mut runs = Vec::with_capacity(iters);
    for _ in 0..iters {
        legs::clear();
        legs::stamp(Leg::Start);
        let r = q.round_trip(64).await;
        legs::stamp(Leg::End);
        if let Err(e) = r {
            legs::set_enabled(false);
            return Err(e);
        }
        runs.push(legs::take());
    }
    legs::set_enabled(false);
    super::print_steps(
        "raw quinn 64 B request/reply",
        runs.len(),
        &legs::steps(&runs),
        Leg::name,
    );
    Ok(())
}

/// `xfer_iters` times of `f` after one unmeasured call, with a progress
/// line naming `what`.
async fn transfers<F, Fut>(ctx: &Ctx, what: &str, mut f: F) -> Result<Vec<Duration>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<Duration, super::raw::BoxError>>,
{
    let size = ctx.cfg.bytes;
    f().await?; // warm-up
    let mut v = Vec::new();
    for _ in 0..ctx.cfg.xfer_iters {
        v.push(f().await?);
    }
    let mut sorted = v.clone();
    sorted.sort();
    detail(format_args!(
        "{what} {}: median {:.2} GiB/s",
        size_label(size),
        gib_s(size, sorted[sorted.len() / 2])
    ));
    Ok(v)
}

/// Measures every raw transport, one after the other.
pub(super) async fn raw_baseline(ctx: &Ctx) -> Result<Raw> {
    let (iters, size) = (ctx.cfg.iters, ctx.cfg.bytes);
    // With the node's settings: the lease rows' reference.
    let raw = RawQuinn::start_with(4, &ctx.cfg.transport.1).await?;
    let quinn = &raw;
    let rtt = round_trips(iters, || raw.round_trip(64)).await?;
    detail_times("raw quinn 64 B request/reply, new stream", &rtt);
    if ctx.cfg.stamps {
        raw_legs(&raw, iters).await?;
    }
    let mut runs = Vec::new();
    for (up, stripes) in [(true, 1), (false, 1), (true, 4), (false, 4)] {
        let dir = if up {
            "client -> server"
        } else {
            "server -> client"
        };
        let what = format!("raw quinn {dir} over {stripes} connection(s)");
        runs.push(
            transfers(ctx, &what, || async move {
                if up {
                    quinn.send(size, stripes).await
                } else {
                    quinn.receive(size, stripes).await
                }
            })
            .await?,
        );
    }
    raw.close().await;
    let asleep = match ctx.cfg.busy_poll {
        Some(_) => Some(
            closed_round_trips(
                RawQuinn::start_asleep(1, &ctx.cfg.transport.1).await?,
                iters,
                "raw quinn 64 B request/reply, new stream, threads asleep",
            )
            .await?,
        ),
        None => None,
    };
    let relayed = closed_round_trips(
        RawQuinn::start_relayed(1, &ctx.cfg.transport.1).await?,
        iters,
        "raw quinn 64 B request/reply relayed through a child process",
    )
    .await?;
    let [up1, down1, up4, down4] = <[Vec<Duration>; 4]>::try_from(runs).expect("four runs");

    let mut one_way = Vec::new();
    for (name, settings) in [
        ("default", TransportSettings::default()),
        ("loopback", TransportSettings::loopback()),
    ] {
        let q = RawQuinn::start_with(1, &settings).await?;
        let w = OneWay {
            rtt: round_trips(iters, || q.round_trip(64)).await?,
            up: transfers(ctx, &format!("raw quinn, {name} settings, up"), || {
                q.send(size, 1)
            })
            .await?,
            down: transfers(ctx, &format!("raw quinn, {name} settings, down"), || {
                q.receive(size, 1)
            })
            .await?,
        };
        q.close().await;
        detail_times(
            &format!("raw quinn, {name} settings, 64 B request/reply"),
            &w.rtt,
        );
        one_way.push(w);
    }
    let tuned = one_way.pop().expect("two runs");
    let default = one_way.pop().expect("two runs");

    let t = RawTcp::start().await?;
    let tcp = OneWay {
        rtt: round_trips(iters, || t.round_trip(64)).await?,
        up: transfers(ctx, "TCP on loopback, up", || t.send(size)).await?,
        down: transfers(ctx, "TCP on loopback, down", || t.receive(size)).await?,
    };
    t.close().await;
    detail_times("TCP on loopback, 64 B request/reply", &tcp.rtt);
    Ok(Raw {
        rtt,
        relayed,
        asleep,
        up1,
        down1,
        up4,
        down4,
        default,
        tuned,
        tcp,
    })
}

/// Raw quinn striped over 4 connections against one (both sides raw).
pub(super) fn raw_striping_row(ctx: &Ctx, raw: &Raw, up: bool) -> Row {
    let size = ctx.cfg.bytes;
    let (one, four, dir) = if up {
        (&raw.up1, &raw.up4, "up")
    } else {
        (&raw.down1, &raw.down4, "down")
    };
    Row::new(
        "remote",
        format!("raw quinn {} {dir}: 4 connections vs 1", size_label(size)),
        Unit::GiBps,
    )
    .raw(rates(size, one))
    .lib(rates(size, four))
    .note("both sides raw quinn: what striping can reach (>= 2x one connection)")
}

/// Raw quinn whose server relays each request through a child process
/// (`cat`, pipes both ways) against raw quinn direct: what crossing a
/// process boundary costs with no protocol on top (raw against raw).
pub(super) fn relay_row(raw: &Raw) -> Row {
    Row::new(
        "remote",
        "raw quinn 64 B request/reply: the server relaying through a child process (pipe both ways) vs direct",
        Unit::Micros,
    )
    .raw(times(Unit::Micros, &raw.rtt))
    .lib(times(Unit::Micros, &raw.relayed))
    .note("both sides raw quinn with the node's settings: the cost of a process boundary, as a lease's worker adds")
}

/// With busy polling on: raw quinn awake at both ends against raw quinn
/// whose threads sleep (raw against raw): what the awake threads give raw
/// quinn, beside what they give the lease.
pub(super) fn awake_row(raw: &Raw) -> Option<Row> {
    let asleep = raw.asleep.as_ref()?;
    Some(
        Row::new(
            "remote",
            "raw quinn 64 B request/reply: awake at both ends (busy polling) vs threads asleep",
            Unit::Micros,
        )
        .raw(times(Unit::Micros, asleep))
        .lib(times(Unit::Micros, &raw.rtt))
        .note("both sides raw quinn with the node's settings: the client busy-polls and the server keeps polling for the workers' spin after each request"),
    )
}

/// The transports against each other, one connection each: quinn with
/// the loopback settings against its defaults, and against TCP (raw
/// against raw: no goals).
pub(super) fn transport_rows(ctx: &Ctx, raw: &Raw) -> Vec<Row> {
    let size = ctx.cfg.bytes;
    let mib = size_label(size);
    let rtt = |metric: &str, base: &[Duration], note: &str| {
        Row::new("remote", metric, Unit::Micros)
            .raw(times(Unit::Micros, base))
            .lib(times(Unit::Micros, &raw.tuned.rtt))
            .note(note)
    };
    let rate = |metric: String, base: &[Duration], lib: &[Duration], note: &str| {
        Row::new("remote", metric, Unit::GiBps)
            .raw(rates(size, base))
            .lib(rates(size, lib))
            .note(note)
    };
    let vs_default = "both sides raw quinn, one connection: what the loopback settings gain";
    let vs_tcp =
        "raw quinn with the loopback settings against TCP on loopback: the host's reference";
    vec![
        rtt(
            "raw quinn 64 B request/reply: loopback settings vs default",
            &raw.default.rtt,
            vs_default,
        ),
        rate(
            format!("raw quinn {mib} up: loopback settings vs default"),
            &raw.default.up,
            &raw.tuned.up,
            vs_default,
        ),
        rate(
            format!("raw quinn {mib} down: loopback settings vs default"),
            &raw.default.down,
            &raw.tuned.down,
            vs_default,
        ),
        rtt(
            "raw quinn 64 B request/reply, loopback settings, vs TCP on loopback",
            &raw.tcp.rtt,
            vs_tcp,
        ),
        rate(
            format!("raw quinn {mib} up, loopback settings, vs TCP on loopback"),
            &raw.tcp.up,
            &raw.tuned.up,
            vs_tcp,
        ),
        rate(
            format!("raw quinn {mib} down, loopback settings, vs TCP on loopback"),
            &raw.tcp.down,
            &raw.tuned.down,
            vs_tcp,
        ),
    ]
}
