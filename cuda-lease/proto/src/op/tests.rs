//! One command of each kind against the body rule and its role.

use super::*;
use crate::{Dtype, RandDist};
use crate::{GemmSpec, Id, LaunchArg, LaunchSpec, ModuleHash, NotInBody, Operand, RandSpec};

/// One op of each kind, with the rule for a graph's body and a prepared
/// one's (`None`: allowed).
fn every_op() -> Vec<(Op<'static>, Option<NotInBody>, Option<NotInBody>)> {
    let (a, b) = (Id(1), Id(2));
    let at = |buf| Operand::new(buf, 0);
    let launch = LaunchSpec {
        module: ModuleHash([0; 32]),
        kernel: "k".into(),
        grid: [1; 3],
        block: [1; 3],
        shared_mem: 0,
        args: vec![LaunchArg::Mem { buf: a, offset: 0 }],
    };
    let gemm = GemmSpec {
        dtype: Dtype::F32,
        a: at(a),
        b: at(a),
        c: at(b),
        m: 1,
        n: 1,
        k: 1,
        ld: [1; 3],
        transpose: [false; 2],
        scalars: [1f64.to_bits(), 0],
        batch: 1,
        strides: [0; 3],
    };
    let rand = RandSpec {
        dtype: Dtype::F32,
        dst: at(a),
        len: 2,
        seed: 1,
        dist: RandDist::Uniform,
    };
    use NotInBody::{Begin, Launch, RandFill, Read, Timer};
    vec![
        (Op::Alloc { buf: a, size: 8 }, None, None),
        (
            Op::Write {
                buf: a,
                offset: 0,
                len: 8,
            },
            None,
            None,
        ),
        (
            Op::Read {
                buf: a,
                offset: 0,
                len: 8,
            },
            Some(Read),
            None,
        ),
        (Op::Free { id: a }, None, None),
        (Op::Launch(launch), None, None),
        (Op::Record { event: b }, None, None),
        (Op::Wait { event: b }, None, None),
        (
            Op::Fill {
                buf: a,
                offset: 0,
                len: 8,
                value: 0,
            },
            None,
            None,
        ),
        (
            Op::Copy {
                src: at(a),
                dst: at(b),
                len: 8,
            },
            None,
            None,
        ),
        (Op::TimerStart { timer: b }, Some(Timer), Some(Timer)),
        (Op::TimerEnd { timer: b }, Some(Timer), Some(Timer)),
        (Op::GraphBegin { graph: b }, Some(Begin), Some(Begin)),
        (Op::GraphEnd { graph: b }, None, None),
        (Op::GraphLaunch { graph: b }, Some(Launch), Some(Launch)),
        (Op::Gemm(Box::new(gemm)), None, None),
        (Op::RandFill(rand), Some(RandFill), Some(RandFill)),
        (Op::PrepareBegin { prepared: b }, Some(Begin), Some(Begin)),
        (
            Op::Run {
                prepared: b,
                inputs: 0,
                outputs: 0,
            },
            Some(Launch),
            Some(Launch),
        ),
    ]
}

#[test]
fn a_body_holds_no_read_of_a_graph_timer_nested_body_launch_or_curand_fill() {
    // One of each kind (a new kind fails to compile here).
    let kind = |op: &Op<'_>| match op {
        Op::Alloc { .. } => 0,
        Op::Write { .. } => 1,
        Op::Read { .. } => 2,
        Op::Free { .. } => 3,
        Op::Launch(_) => 4,
        Op::Record { .. } => 5,
        Op::Wait { .. } => 6,
        Op::Fill { .. } => 7,
        Op::Copy { .. } => 8,
        Op::TimerStart { .. } => 9,
        Op::TimerEnd { .. } => 10,
        Op::GraphBegin { .. } => 11,
        Op::GraphEnd { .. } => 12,
        Op::GraphLaunch { .. } => 13,
        Op::Gemm(_) => 14,
        Op::RandFill(_) => 15,
        Op::PrepareBegin { .. } => 16,
        Op::Run { .. } => 17,
    };
    let ops = every_op();
    let kinds: Vec<usize> = ops.iter().map(|(op, ..)| kind(op)).collect();
    assert_eq!(kinds, (0..18).collect::<Vec<_>>());
    for (op, graph, prepared) in ops {
        assert_eq!(op.allowed_in_body(false).err(), graph, "{op:?} in a graph");
        assert_eq!(op.allowed_in_body(true).err(), prepared, "{op:?} prepared");
    }
    assert_eq!(NotInBody::RandFill.to_string(), NotInBody::RandFill.what());
    assert!(NotInBody::RandFill.what().contains("cuRAND"));
}

#[test]
fn each_command_has_its_role() {
    let (a, b) = (Id(1), Id(2));
    let roles: Vec<Role> = every_op().iter().map(|(op, ..)| op.role()).collect();
    let read = |buf| Role::Read {
        buf,
        offset: 0,
        len: 8,
    };
    assert_eq!(
        roles,
        vec![
            Role::Alloc { buf: a, size: 8 },
            Role::Write {
                buf: a,
                offset: 0,
                len: 8
            },
            read(a),
            Role::Free(a),
            Role::Plain,
            Role::Plain,
            Role::Plain,
            Role::Plain,
            Role::Plain,
            Role::Plain,
            Role::Plain,
            Role::Begin {
                id: b,
                prepared: false
            },
            Role::End(b),
            Role::Launch(b),
            Role::Plain,
            Role::Plain,
            Role::Begin {
                id: b,
                prepared: true
            },
            Role::Run {
                id: b,
                inputs: 0,
                outputs: 0
            },
        ]
    );
    let data: Vec<u64> = every_op().iter().map(|(op, ..)| op.data_len()).collect();
    assert_eq!(
        data.iter().sum::<u64>(),
        8,
        "a write's 8 bytes alone: {data:?}"
    );
}
