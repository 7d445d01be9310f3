//! Golden byte vectors: the wire format of every message is pinned here.
//! A change that breaks one of these breaks compatibility: bump `VERSION`.

use cuda_lease::proto::*;
use std::fmt::Debug;

fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// `msg` encodes to `hex` and decodes back. (The bytes are leaked so that
/// a message that borrows from its body can be decoded as its `'static`
/// owned form; it is a test.)
fn golden<T: serde::Serialize + serde::Deserialize<'static> + PartialEq + Debug>(
    msg: T,
    hex: &str,
) {
    let bytes: &'static [u8] = unhex(hex).leak();
    assert_eq!(to_body(&msg), bytes, "encoding of {msg:?}");
    assert_eq!(from_body::<T>(bytes).unwrap(), msg);
    // Trailing bytes and truncation are rejected.
    let mut longer = bytes.to_vec();
    longer.push(0);
    assert!(from_body::<T>(longer.leak()).is_err());
    if !bytes.is_empty() {
        assert!(from_body::<T>(&bytes[..bytes.len() - 1]).is_err());
    }
}

const L: LeaseId = LeaseId([0x11; 16]);
const B: Id = Id(0x22);
const E: Id = Id(3);
const M: ModuleHash = ModuleHash([0x33; 32]);

#[test]
fn header_golden() {
    let h = Header::request(Opcode::Batch, 0x0102030405060708, 9, 10);
    assert_eq!(
        h.encode().to_vec(),
        unhex("43554c5307170000000000000807060504030201090000000a000000")
    );
    let r = Header::reply(
        &Header::request(Opcode::MemRead, 7, 0, 0),
        Status::NotFound,
        5,
        0,
    );
    let bytes = unhex("43554c53071201000800000007000000000000000500000000000000");
    assert_eq!(r.encode().to_vec(), bytes);
    assert_eq!(Header::decode(&bytes, &Limits::default()).unwrap(), r);
    assert!(r.is_reply());
}

#[test]
fn opcode_and_status_values_are_stable() {
    let ops: Vec<u8> = Opcode::ALL.iter().map(|o| *o as u8).collect();
    assert_eq!(ops, vec![1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 18, 19, 23, 32]);
    for (i, name) in [
        "OK",
        "UNAUTHORIZED",
        "LOAD_FAILED",
        "LAUNCH_FAILED",
        "READ_FAILED",
        "LEASE_EXPIRED",
        "CAPACITY_EXCEEDED",
        "BAD_REQUEST",
        "NOT_FOUND",
        "LEASE_POISONED",
        "INTERNAL",
        "UNKNOWN_MODULE",
        "LEASE_NOT_FOUND",
        "MALFORMED",
    ]
    .iter()
    .enumerate()
    {
        assert_eq!(Status::from_u16(i as u16).to_string(), *name);
        assert_eq!(Status::from_u16(i as u16) as u16, i as u16);
    }
    assert_eq!(Status::from_u16(999), Status::Internal);
}

#[test]
fn unknown_version_and_opcode_rejected() {
    let mut b = Header::request(Opcode::Hello, 1, 0, 0).encode();
    b[4] = 1;
    let e = Header::decode(&b, &Limits::default()).unwrap_err();
    assert_eq!(e, ProtoError::UnsupportedVersion(1));
    assert_eq!(
        e.to_string(),
        "unsupported protocol version 1: this node speaks 7"
    );
    let mut b = Header::request(Opcode::Hello, 1, 0, 0).encode();
    b[5] = 99;
    assert_eq!(
        Header::decode(&b, &Limits::default()),
        Err(ProtoError::UnknownOpcode(99))
    );
    let mut b = Header::request(Opcode::Hello, 1, 0, 0).encode();
    b[0] = b'X';
    assert_eq!(
        Header::decode(&b, &Limits::default()),
        Err(ProtoError::BadMagic)
    );
    let mut b = Header::request(Opcode::Hello, 1, 0, 0).encode();
    b[10] = 1;
    assert_eq!(
        Header::decode(&b, &Limits::default()),
        Err(ProtoError::Reserved)
    );
}

#[test]
fn bodies_golden() {
    golden(
        ErrorBody {
            message: "no".into(),
        },
        "026e6f",
    );
    golden(
        Hello {
            token: "tok".into(),
            client: "c".into(),
        },
        "03746f6b0163",
    );
    golden(HelloOk { node: "n".into() }, "016e");
    golden(
        Inventory {
            node: "n".into(),
            devices: vec![DeviceInfo {
                ordinal: 0,
                name: "H".into(),
                total_bytes: 1000,
                free_bytes: 300,
                compute_capability: (9, 0),
                limits: cuda_lease::proto::DeviceLimits {
                    multiprocessors: 132,
                    warp_size: 32,
                    ..Default::default()
                },
            }],
            reservable_bytes: 200,
            active_leases: 2,
        },
        "016e01000148e807ac020900840120000000000000000000c80102",
    );
    golden(
        LeaseAlloc {
            min_vram: 1 << 20,
            ttl_secs: 30,
        },
        "8080401e",
    );
    golden(
        LeaseGrant {
            lease: L,
            generation: 1,
            reserved: 1 << 20,
            ttl_ms: 30000,
        },
        "1111111111111111111111111111111101808040b0ea01",
    );
    golden(
        LeaseRenew {
            lease: L,
            ttl_secs: 60,
        },
        "111111111111111111111111111111113c",
    );
    golden(LeaseRef { lease: L }, "11111111111111111111111111111111");
    golden(
        LeaseStatus {
            lease: L,
            generation: 2,
            reserved: 4096,
            allocated: 1024,
            allocated_high: 2048,
            remaining_ms: 500,
            state: LeaseState::Poisoned,
        },
        "1111111111111111111111111111111102802080088010f40301",
    );
    golden(
        MemAlloc {
            lease: L,
            buf: B,
            size: 256,
        },
        "11111111111111111111111111111111228002",
    );
    golden(
        MemWrite {
            lease: L,
            buf: B,
            offset: 4,
            after: 9,
        },
        "11111111111111111111111111111111220409",
    );
    golden(
        MemRead {
            lease: L,
            buf: B,
            offset: 4,
            len: 8,
            after: 0,
        },
        "1111111111111111111111111111111122040800",
    );
    golden(
        IdOp { lease: L, id: B },
        "1111111111111111111111111111111122",
    );
    golden(
        Batch {
            lease: L,
            seq: 5,
            modules: vec![
                ModuleUse {
                    hash: M,
                    source: Some(ModuleText {
                        kind: SourceKind::Cuda {
                            options: vec!["-G".into()],
                        },
                        len: 5,
                    }),
                },
                ModuleUse {
                    hash: M,
                    source: None,
                },
            ],
            commands: vec![
                Command {
                    stream: 0,
                    op: Op::Alloc { buf: B, size: 64 },
                },
                Command {
                    stream: 0,
                    op: Op::Write {
                        buf: B,
                        offset: 0,
                        len: 4,
                    },
                },
                Command {
                    stream: 0,
                    op: Op::Record { event: E },
                },
                Command {
                    stream: 1,
                    op: Op::Wait { event: E },
                },
                Command {
                    stream: 1,
                    op: Op::Launch(LaunchSpec {
                        module: M,
                        kernel: "k".into(),
                        grid: [2, 1, 1],
                        block: [128, 1, 1],
                        shared_mem: 0,
                        args: vec![LaunchArg::u32(5), LaunchArg::Mem { buf: B, offset: 8 }],
                    }),
                },
                Command {
                    stream: 1,
                    op: Op::Read {
                        buf: B,
                        offset: 0,
                        len: 4,
                    },
                },
                Command {
                    stream: 2,
                    op: Op::Free { id: B },
                },
            ],
        },
        concat!(
            "1111111111111111111111111111111105022033333333333333333333333333",
            "33333333333333333333333333333333333333010101022d4705203333333333",
            // the modules, then the reply's bytes (4: one read), then the
            // commands (7)
            "333333333333333333333333333333333333333333333333333333000407",
            "0000224000012200040005030106030104203333333333333333333333333333333333",
            "333333333333333333333333333333016b020101800101010002000405000000",
            "0122080102220004020322"
        ),
    );
    golden(
        Command {
            stream: 4,
            op: Op::Fill {
                buf: B,
                offset: 1,
                len: 2,
                value: 0xAB,
            },
        },
        "04072201 02ab",
    );
    golden(
        Command {
            stream: 0,
            op: Op::Copy {
                src: Operand::new(B, 1),
                dst: Operand::new(E, 2),
                len: 300,
            },
        },
        "0008220103 02ac02",
    );
    golden(
        Command {
            stream: 1,
            op: Op::TimerStart { timer: B },
        },
        "010922",
    );
    golden(
        Command {
            stream: 1,
            op: Op::TimerEnd { timer: E },
        },
        "010a03",
    );
    golden(
        Command {
            stream: 2,
            op: Op::GraphBegin { graph: B },
        },
        "020b22",
    );
    golden(
        Command {
            stream: 2,
            op: Op::GraphEnd { graph: B },
        },
        "020c22",
    );
    golden(
        Command {
            stream: 0,
            op: Op::GraphLaunch { graph: E },
        },
        "000d03",
    );
    golden(
        BatchReply {
            completed: 3,
            error: Some(OpError {
                index: 3,
                status: Status::LaunchFailed,
                message: "x".into(),
            }),
        },
        "030103030178",
    );
    golden(
        BatchReply {
            completed: 7,
            error: None,
        },
        "0700",
    );
    golden(
        GpuSubmit {
            kernel: "iota".into(),
            grid: [1, 1, 1],
            block: [256, 1, 1],
            shared_mem: 0,
            args: vec![LaunchArg::Output, LaunchArg::Input(0), LaunchArg::f32(1.5)],
            ptx_len: 10,
            input_lens: vec![16],
            output_size: 1024,
            output_fill: 255,
        },
        "04696f746101010180020101000303020000040000c03f0a01108008ff",
    );
}

#[test]
fn whole_frame_round_trip() {
    let body = to_body(&LeaseRef { lease: L });
    let f = Frame {
        header: Header::request(Opcode::Batch, 3, body.len() as u32, 4),
        body,
        data: b"ptx!".to_vec(),
    };
    let bytes = f.encode();
    assert_eq!(Frame::decode(&bytes, &Limits::default()).unwrap(), f);
    assert_eq!(
        Frame::decode(&bytes[..bytes.len() - 1], &Limits::default()),
        Err(ProtoError::Truncated)
    );
}

#[test]
fn batch_and_submit_validation() {
    let cmd = |op| Command { stream: 0, op };
    let launch = |module| {
        Op::Launch(LaunchSpec {
            module,
            kernel: "k".into(),
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem: 0,
            args: vec![],
        })
    };
    let mut b = Batch {
        lease: L,
        seq: 1,
        modules: vec![],
        commands: vec![cmd(Op::Write {
            buf: B,
            offset: 0,
            len: 1,
        })],
    };
    assert!(b.validate(1).is_ok());
    assert!(b.validate(2).is_err(), "data length mismatch");
    b.commands.push(cmd(launch(M)));
    assert!(b.validate(1).is_err(), "module not listed");
    b.modules.push(ModuleUse {
        hash: M,
        source: Some(ModuleText {
            kind: SourceKind::Ptx,
            len: 3,
        }),
    });
    assert!(b.validate(4).is_ok(), "module text counts in the data");
    b.modules.push(b.modules[0].clone());
    assert!(b.validate(7).is_err(), "module listed twice");
    b.modules.pop();
    b.commands.push(cmd(Op::Alloc { buf: E, size: 0 }));
    assert!(b.validate(4).is_err(), "zero alloc");
    let s = GpuSubmit {
        kernel: "k".into(),
        grid: [1, 1, 1],
        block: [0, 1, 1],
        shared_mem: 0,
        args: vec![],
        ptx_len: 1,
        input_lens: vec![],
        output_size: 4,
        output_fill: 0,
    };
    assert!(s.validate(1, &Limits::default()).is_err(), "zero block");
}
