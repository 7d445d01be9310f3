//! Property tests: the decoders never panic and never allocate much more than
//! the input they are given, whatever the bytes (random, truncated, oversized).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use cuda_lease::proto::*;
use proptest::prelude::*;

/// Tracks the largest single allocation made on this thread while armed.
struct Tracking;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; only records sizes in
// thread-locals (const-initialized, so no allocation happens while recording).
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ARMED.try_with(|a| {
            if a.get() {
                let _ = LARGEST.try_with(|l| l.set(l.get().max(layout.size())));
            }
        });
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// Runs `f` and returns the largest allocation it made.
fn largest_alloc(f: impl FnOnce()) -> usize {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    f();
    ARMED.with(|a| a.set(false));
    LARGEST.with(|l| l.get())
}

/// serde caps pre-allocation of sequences at 1 MiB; everything else is bounded by the input.
const SLACK: usize = (1 << 20) + 4096;

fn decode_all(bytes: &[u8]) {
    let limits = Limits::default();
    let _ = Header::decode(bytes, &limits);
    let _ = Frame::decode(bytes, &limits);
    let _ = from_body::<Hello>(bytes);
    let _ = from_body::<Inventory>(bytes);
    let _ = from_body::<LeaseAlloc>(bytes);
    let _ = from_body::<LeaseGrant>(bytes);
    let _ = from_body::<LeaseStatus>(bytes);
    let _ = from_body::<MemWrite>(bytes);
    let _ = from_body::<MemRead>(bytes);
    let _ = from_body::<MemAlloc>(bytes);
    let _ = from_body::<IdOp>(bytes);
    let _ = from_body::<LaunchSpec<'_>>(bytes).map(|l| l.validate(false));
    let _ = from_body::<Batch<'_>>(bytes).map(|b| b.validate(bytes.len()));
    let _ = from_body::<BatchReply>(bytes);
    let _ = from_body::<GpuSubmit<'_>>(bytes).map(|s| s.validate(bytes.len(), &limits));
    let _ = from_body::<ErrorBody>(bytes);
    // The hand-written command reader: serde's values, serde's refusals.
    assert_eq!(
        CommandList::from_wire(bytes).ok(),
        from_body::<CommandList<'_>>(bytes).ok()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic_or_overallocate(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let n = largest_alloc(|| decode_all(&bytes));
        prop_assert!(n <= bytes.len() + SLACK, "allocated {n} for {} input bytes", bytes.len());
    }

    #[test]
    fn valid_header_random_tail(op in 0usize..Opcode::ALL.len(), body in proptest::collection::vec(any::<u8>(), 0..256), cut in 0usize..300) {
        let h = Header::request(Opcode::ALL[op], 1, body.len() as u32, 0);
        let mut bytes = h.encode().to_vec();
        bytes.extend_from_slice(&body);
        let cut = cut.min(bytes.len());
        let n = largest_alloc(|| decode_all(&bytes[..cut]));
        prop_assert!(n <= cut + SLACK);
        let n = largest_alloc(|| decode_all(&bytes[HEADER_LEN..]));
        prop_assert!(n <= body.len() + SLACK);
    }

    #[test]
    fn oversized_lengths_rejected_before_allocation(body_len in any::<u32>(), data_len in any::<u32>()) {
        let limits = Limits::default();
        let bytes = Header::request(Opcode::MemWrite, 1, body_len, data_len).encode();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let mut reader: &[u8] = &bytes;
        let n = largest_alloc(|| {
            let r = rt.block_on(read_frame(&mut reader, &limits));
            let over = body_len > limits.max_body || data_len > limits.max_data;
            assert_eq!(over, matches!(&r, Err(e) if proto_error(e).is_some()));
            assert!(r.is_err(), "no body/data bytes follow, so reading must fail");
        });
        // Within the limits the reader may allocate what the header announces, never more.
        let allowed = if body_len <= limits.max_body && data_len <= limits.max_data {
            body_len.max(data_len) as usize
        } else {
            0
        };
        prop_assert!(n <= allowed + 4096, "allocated {n}");
    }

    #[test]
    fn v2_batches_round_trip_and_validate(
        cmds in proptest::collection::vec((0u32..4, 0u8..14, 1u64..64, any::<u32>()), 0..40),
        cuda in any::<bool>(),
        flips in proptest::collection::vec((any::<proptest::sample::Index>(), any::<u8>()), 8),
    ) {
        let kind = if cuda {
            SourceKind::Cuda { options: vec!["-default-device".into()] }
        } else {
            SourceKind::Ptx
        };
        let text = "extern \"C\" __global__ void k() {}";
        let hash = ModuleHash::of(&kind, text);
        let mut need = text.len();
        let commands: Vec<Command<'_>> = cmds
            .iter()
            .map(|&(stream, op, id, n)| {
                let (buf, len) = (Id(id), n % 64);
                let op = match op {
                    0 => Op::Alloc { buf, size: u64::from(len) + 1 },
                    1 => {
                        need += len as usize;
                        Op::Write { buf, offset: 0, len: len.into() }
                    }
                    2 => Op::Read { buf, offset: u64::from(n), len: len.into() },
                    3 => Op::Free { id: buf },
                    4 => Op::Record { event: buf },
                    5 => Op::Wait { event: buf },
                    6 => Op::Fill { buf, offset: u64::from(n), len: u64::from(len), value: n as u8 },
                    7 => Op::Copy { src: Operand::new(buf, 0), dst: Operand::new(Id(id + 1), u64::from(n)), len: u64::from(len) },
                    8 => Op::TimerStart { timer: buf },
                    9 => Op::TimerEnd { timer: buf },
                    10 => Op::GraphBegin { graph: buf },
                    11 => Op::GraphEnd { graph: buf },
                    12 => Op::GraphLaunch { graph: buf },
                    _ => Op::Launch(LaunchSpec {
                        module: hash,
                        kernel: "k".into(),
                        grid: [1, 1, 1],
                        block: [32, 1, 1],
                        shared_mem: 0,
                        args: vec![LaunchArg::mem(buf), LaunchArg::u32(n)],
                    }),
                };
                Command { stream, op }
            })
            .collect();
        let batch = Batch {
            lease: LeaseId([7; 16]),
            seq: 1,
            modules: vec![ModuleUse { hash, source: Some(ModuleText { kind, len: text.len() as u32 }) }],
            commands,
        };
        let body = to_body(&batch);
        let back = from_body::<Batch<'_>>(&body).unwrap();
        prop_assert_eq!(&back, &batch);
        prop_assert!(back.validate(need).is_ok());
        prop_assert!(back.validate(need + 1).is_err());
        // Any cut of a valid body fails cleanly.
        for cut in 0..body.len() {
            prop_assert!(from_body::<Batch<'_>>(&body[..cut]).is_err());
        }
        // One-byte changes of the body decode to some batch or are
        // refused; the node's forwarding decoder agrees.
        for (at, v) in flips {
            let i = at.index(body.len());
            let mut bad = body.clone();
            bad[i] = v;
            let whole = from_body::<Batch<'_>>(&bad).ok();
            let kept = Batch::decode_keeping_wire(&bad).ok().map(|(b, _)| b);
            prop_assert_eq!(whole, kept, "byte {} set to {:#x}", i, v);
        }
    }

    #[test]
    fn the_op_limit_is_exactly_max_batch_ops_on_every_decode_path(extra in 0usize..2) {
        let n = MAX_BATCH_OPS + extra;
        let free = Command { stream: 0, op: Op::Free { id: Id(1) } };
        let batch = Batch { lease: LeaseId([1; 16]), seq: 1, modules: vec![], commands: vec![free; n] };
        let body = postcard::to_allocvec(&batch).unwrap();
        let ok = extra == 0;
        prop_assert_eq!(from_body::<Batch<'_>>(&body).is_ok(), ok, "the node's decoder, {} ops", n);
        prop_assert_eq!(postcard::from_bytes::<Batch<'_>>(&body).is_ok(), ok, "serde, {} ops", n);
        prop_assert_eq!(batch.validate(0).is_ok(), ok, "validate, {} ops", n);
    }

    #[test]
    fn body_round_trips(min_vram in any::<u64>(), ttl in any::<u32>(), id in any::<[u8; 16]>()) {
        let a = LeaseAlloc { min_vram, ttl_secs: ttl };
        prop_assert_eq!(from_body::<LeaseAlloc>(&to_body(&a)).unwrap(), a);
        let g = LeaseGrant { lease: LeaseId(id), generation: ttl.into(), reserved: min_vram, ttl_ms: 1 };
        prop_assert_eq!(from_body::<LeaseGrant>(&to_body(&g)).unwrap(), g);
    }
}

#[test]
fn huge_sequence_length_prefix_is_cheap() {
    // A Batch claiming 2^32-1 modules, then one claiming 2^32-1 commands,
    // in a few bytes.
    let mut b = vec![0x11; 16];
    b.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
    let n = largest_alloc(|| assert!(from_body::<Batch<'_>>(&b).is_err()));
    assert!(n <= SLACK, "allocated {n}");
    let mut b = vec![0x11; 16];
    b.extend_from_slice(&[0x00, 0xff, 0xff, 0xff, 0xff, 0x0f]);
    let n = largest_alloc(|| assert!(from_body::<Batch<'_>>(&b).is_err()));
    assert!(n <= SLACK, "allocated {n}");
    // A string claiming 4 GiB.
    let s = [0xff, 0xff, 0xff, 0xff, 0x0f, b'a'];
    let n = largest_alloc(|| assert!(from_body::<ErrorBody>(&s).is_err()));
    assert!(n <= SLACK, "allocated {n}");
}
