//! The planner's rules, without a node or a worker.

use super::*;

const LIMITS: BatchLimits = BatchLimits {
    reserved: 1000,
    max_ids: 4,
    max_streams: 2,
    max_read: 1 << 20,
    reply_bytes: 1000,
};

fn budget() -> Charges {
    Charges {
        allocated: 0,
        reserved: 1000,
        held: 1000,
        read: 0,
    }
}

fn cmd(stream: StreamId, op: Op<'static>) -> Command<'static> {
    Command { stream, op }
}

/// A 2x2x2 f32 product with all three matrices in `buf`, at these byte
/// offsets and leading dimensions.
fn gemm_in(buf: Id, offsets: [u64; 3], ld: [u64; 3]) -> Op<'static> {
    let at = |offset| crate::proto::Operand { buf, offset };
    Op::Gemm(Box::new(crate::proto::GemmSpec {
        dtype: crate::proto::Dtype::F32,
        a: at(offsets[0]),
        b: at(offsets[1]),
        c: at(offsets[2]),
        m: 2,
        n: 2,
        k: 2,
        ld,
        transpose: [false; 2],
        scalars: [1f64.to_bits(), 0],
        batch: 1,
        strides: [0; 3],
    }))
}

/// A random f32 fill of `len` elements of `buf` at byte `offset`.
fn fill_in(buf: Id, offset: u64, len: u64, normal: bool) -> Op<'static> {
    let dist = if normal {
        crate::proto::RandDist::Normal {
            mean: 0,
            std_dev: 1f64.to_bits(),
        }
    } else {
        crate::proto::RandDist::Uniform
    };
    Op::RandFill(crate::proto::RandSpec {
        dtype: crate::proto::Dtype::F32,
        dst: crate::proto::Operand { buf, offset },
        len,
        seed: 1,
        dist,
    })
}

fn run(state: &LeaseObjects, commands: &[Command<'_>], b: &mut Charges) -> Plan {
    plan(&LIMITS, state, commands, b)
}

fn read(buf: Id, offset: u64, len: u64) -> Op<'static> {
    Op::Read { buf, offset, len }
}

fn write(buf: Id, offset: u64, len: u64) -> Op<'static> {
    Op::Write { buf, offset, len }
}

#[test]
fn a_chain_plans_whole_and_charges_its_allocations() {
    let state = LeaseObjects::default();
    let (a, e) = (Id(1), Id(2));
    let cmds = [
        cmd(0, Op::Alloc { buf: a, size: 100 }),
        cmd(0, write(a, 0, 100)),
        cmd(0, Op::Record { event: e }),
        cmd(1, Op::Wait { event: e }),
        cmd(1, read(a, 50, 50)),
        cmd(1, Op::Free { id: a }),
    ];
    let mut b = budget();
    let p = run(&state, &cmds, &mut b);
    assert!(p.error.is_none(), "{:?}", p.error);
    assert_eq!(p.effects.len(), 6);
    assert_eq!(p.effects[0], Effect::Create(a, IdKind::Buffer(100)));
    assert_eq!(p.effects[2], Effect::Create(e, IdKind::Event));
    assert_eq!(p.effects[5], Effect::Free(a));
    assert_eq!(p.charged, [(0, 100)]);
    assert_eq!((b.allocated, b.read), (100, 50));
}

#[test]
fn the_first_refused_command_ends_the_plan_and_is_named() {
    use crate::proto::Operand;
    use Status::{BadRequest as Bad, CapacityExceeded as Over, NotFound};
    let state = LeaseObjects::default();
    let a = Id(1);
    let bf16 = {
        let mut f = fill_in(a, 0, 8, false);
        if let Op::RandFill(r) = &mut f {
            r.dtype = crate::proto::Dtype::Bf16;
        }
        f
    };
    let (src, dst) = (Operand::new(a, 0), Operand::new(a, 50));
    #[rustfmt::skip]
    let cases: Vec<(Command<'static>, Status, &str)> = vec![
        (cmd(0, read(a, 90, 20)), Bad, "range 90+20"),
        (cmd(0, read(Id(9), 0, 1)), NotFound, "unknown id"),
        (cmd(0, Op::Alloc { buf: a, size: 1 }), Bad, "already in use"),
        (cmd(0, Op::Alloc { buf: Id(3), size: 5000 }), Over, "reserved 1000 bytes, 100 allocated, 5000 more"),
        (cmd(0, Op::Wait { event: a }), Bad, "a buffer, not an event"),
        (cmd(0, Op::Wait { event: Id(8) }), NotFound, "unknown id"),
        (cmd(5, Op::Free { id: a }), Over, "limit of 2 streams"),
        (cmd(0, Op::Copy { src, dst, len: 10 }), Bad, "to itself"),
        (cmd(0, read(a, 0, 100)), Bad, "reads exceed"),
        (cmd(0, gemm_in(a, [96, 0, 32], [2, 2, 2])), Bad, "gemm: A: range 96+16"),
        (cmd(0, gemm_in(a, [0, 16, 8], [2, 2, 2])), Bad, "C overlaps A"),
        (cmd(0, gemm_in(a, [0, 16, 34], [2, 2, 2])), Bad, "not at a whole element"),
        (cmd(0, gemm_in(a, [0, 16, 32], [1, 2, 2])), Bad, "leading dimension of A is 1"),
        (cmd(0, fill_in(a, 64, 10, false)), Bad, "random fill: range 64+40"),
        (cmd(0, fill_in(a, 2, 4, false)), Bad, "random fill: starts at byte 2"),
        (cmd(0, fill_in(a, 0, 7, true)), Bad, "in pairs"),
        (cmd(0, bf16), Bad, "cuRAND fills f32 and f64, not bf16"),
    ];
    for (bad, status, text) in cases {
        let cmds = [
            cmd(0, Op::Alloc { buf: a, size: 100 }),
            cmd(
                1,
                Op::Fill {
                    buf: a,
                    offset: 0,
                    len: 100,
                    value: 0,
                },
            ),
            bad.clone(),
            cmd(0, Op::Free { id: a }),
        ];
        let limits = BatchLimits {
            max_read: 99,
            ..LIMITS
        };
        let p = plan(&limits, &state, &cmds, &mut budget());
        let e = p.error.expect("refused");
        assert_eq!((e.index, e.status), (2, status), "{bad:?}: {}", e.message);
        assert!(e.message.starts_with("command 2: "), "{}", e.message);
        assert!(e.message.contains(text), "{bad:?}: {}", e.message);
        assert_eq!(p.effects.len(), 2, "{bad:?}");
    }
}

#[test]
fn ids_are_limited_and_a_free_makes_room() {
    let state = LeaseObjects::default();
    let alloc = |i| {
        cmd(
            0,
            Op::Alloc {
                buf: Id(i),
                size: 1,
            },
        )
    };
    let mut cmds: Vec<Command<'static>> = (1..=4).map(alloc).collect();
    cmds.push(cmd(0, Op::Record { event: Id(5) }));
    let e = run(&state, &cmds, &mut budget()).error.expect("refused");
    assert_eq!(
        (e.index, e.status),
        (4, Status::CapacityExceeded),
        "{}",
        e.message
    );
    cmds.insert(4, cmd(0, Op::Free { id: Id(1) }));
    let p = run(&state, &cmds, &mut budget());
    assert!(p.error.is_none(), "{:?}", p.error);
}

#[test]
fn reads_over_the_reply_budget_are_refused() {
    let mut state = LeaseObjects::default();
    state.ids.insert(Id(1), IdKind::Buffer(800));
    let cmds = [cmd(0, read(Id(1), 0, 800)), cmd(0, read(Id(1), 0, 800))];
    let e = run(&state, &cmds, &mut budget()).error.expect("refused");
    assert_eq!((e.index, e.status), (1, Status::CapacityExceeded));
    assert!(
        e.message.contains("read: the node holds 1000 bytes"),
        "{}",
        e.message
    );
}

#[test]
fn timers_are_ids_of_their_own_kind_and_end_once() {
    let state = LeaseObjects::default();
    let t = Id(1);
    let start = cmd(0, Op::TimerStart { timer: t });
    let end = cmd(0, Op::TimerEnd { timer: t });
    let p = run(&state, &[start.clone(), end.clone()], &mut budget());
    assert!(p.error.is_none(), "{:?}", p.error);
    assert_eq!(
        p.effects,
        [Effect::Create(t, IdKind::Timer), Effect::Free(t)]
    );
    // A timer is neither an event nor a buffer.
    let p = run(
        &state,
        &[start.clone(), cmd(1, Op::Wait { event: t })],
        &mut budget(),
    );
    let e = p.error.expect("refused");
    assert_eq!((e.index, e.status), (1, Status::BadRequest));
    assert!(e.message.contains("is a timer"), "{}", e.message);
    // Ended once: a second end names an unknown id.
    let p = run(
        &state,
        &[start.clone(), end.clone(), end.clone()],
        &mut budget(),
    );
    let e = p.error.expect("refused");
    assert_eq!((e.index, e.status), (2, Status::NotFound));
    // An event is not a timer.
    let p = run(
        &state,
        &[cmd(0, Op::Record { event: t }), end.clone()],
        &mut budget(),
    );
    let e = p.error.expect("refused");
    assert!(e.message.contains("not a timer"), "{}", e.message);
    // Its 8 bytes count against the reply budget.
    let mut small = Charges {
        held: 7,
        ..budget()
    };
    let p = run(&state, &[start, end], &mut small);
    let e = p.error.expect("refused");
    assert_eq!((e.index, e.status), (1, Status::CapacityExceeded));
}

#[test]
fn a_prepared_body_reads_only_when_run_and_a_run_gives_its_exact_bytes() {
    use Status::{BadRequest as Bad, CapacityExceeded as Over};
    let state = LeaseObjects::default();
    let (p, g, a) = (Id(1), Id(2), Id(3));
    let body = [
        cmd(0, Op::PrepareBegin { prepared: p }),
        cmd(0, Op::Alloc { buf: a, size: 100 }),
        cmd(0, write(a, 0, 40)),
        cmd(0, read(a, 10, 60)),
        cmd(0, Op::GraphEnd { graph: p }),
        cmd(0, Op::GraphBegin { graph: g }),
        cmd(0, write(a, 0, 4)),
        cmd(0, Op::GraphEnd { graph: g }),
    ];
    let run_it = |inputs, outputs| {
        cmd(
            1,
            Op::Run {
                prepared: p,
                inputs,
                outputs,
            },
        )
    };
    let mut b = budget();
    let plan = run(&state, &[&body[..], &[run_it(40, 60)]].concat(), &mut b);
    assert!(plan.error.is_none(), "{:?}", plan.error);
    // The body's read is charged by the run alone; its write keeps nothing.
    assert_eq!((b.read, b.allocated), (60, 104));
    #[rustfmt::skip]
    let cases: Vec<(Command<'static>, Status, &str)> = vec![
        (run_it(39, 60), Bad, "writes 40 bytes and reads 60; the run gives 39 and asks 60"),
        (run_it(40, 0), Bad, "the run gives 40 and asks 0"),
        (cmd(0, Op::GraphLaunch { graph: p }), Bad, "a prepared submission: run it with Run"),
        (cmd(0, Op::Run { prepared: g, inputs: 4, outputs: 0 }), Bad, "a graph: launch it with GraphLaunch"),
        (cmd(0, Op::Run { prepared: a, inputs: 0, outputs: 0 }), Bad, "a buffer, not a prepared"),
        (cmd(0, Op::Free { id: a }), Bad, "used by graph"),
    ];
    for (bad, status, text) in cases {
        let plan = run(
            &state,
            &[&body[..], std::slice::from_ref(&bad)].concat(),
            &mut budget(),
        );
        let e = plan.error.expect("refused");
        assert_eq!((e.index, e.status), (8, status), "{bad:?}: {}", e.message);
        assert!(e.message.contains(text), "{bad:?}: {}", e.message);
    }
    // Runs are charged to the reply like reads.
    let mut small = Charges {
        held: 100,
        ..budget()
    };
    let runs = [run_it(40, 60), run_it(40, 60)];
    let e = run(&state, &[&body[..], &runs[..]].concat(), &mut small)
        .error
        .expect("refused");
    assert_eq!((e.index, e.status), (9, Over), "{}", e.message);
    // A graph's body still cannot read, and a prepared body cannot time.
    for (inner, text) in [
        (read(a, 0, 1), "read into the reply"),
        (Op::TimerStart { timer: Id(4) }, "time itself"),
    ] {
        let (begin, id) = match inner {
            Op::Read { .. } => (Op::GraphBegin { graph: g }, g),
            _ => (Op::PrepareBegin { prepared: p }, p),
        };
        let cmds = [
            cmd(0, Op::Alloc { buf: a, size: 100 }),
            cmd(0, begin),
            cmd(0, inner),
            cmd(0, Op::GraphEnd { graph: id }),
        ];
        let e = run(&state, &cmds, &mut budget()).error.expect("refused");
        assert!(e.message.contains(text), "{}", e.message);
    }
}

#[test]
fn no_body_holds_a_curand_fill() {
    // The client's rule too (`Op::allowed_in_body`): it cannot be captured.
    let state = LeaseObjects::default();
    let (p, g, a) = (Id(1), Id(2), Id(3));
    for (begin, id) in [
        (Op::GraphBegin { graph: g }, g),
        (Op::PrepareBegin { prepared: p }, p),
    ] {
        let cmds = [
            cmd(0, Op::Alloc { buf: a, size: 100 }),
            cmd(0, begin),
            cmd(0, fill_in(a, 0, 8, false)),
            cmd(0, Op::GraphEnd { graph: id }),
        ];
        let e = run(&state, &cmds, &mut budget()).error.expect("refused");
        assert_eq!(
            (e.index, e.status),
            (2, Status::BadRequest),
            "{}",
            e.message
        );
        assert!(e.message.contains("fill with cuRAND"), "{}", e.message);
    }
}
