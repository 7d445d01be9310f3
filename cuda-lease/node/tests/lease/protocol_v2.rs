//! Protocol v2 against an embedded node with the in-memory device (host
//! memory, real streams and events, test kernels run on the host): a whole
//! pipeline in one message, client-named ids, streams and events, modules
//! by content, failures that keep what ran.

use crate::common::*;
use cuda_lease::client::{Error, ErrorKind, ModuleSpec, Session};

use cuda_lease::proto::{
    self, Batch, Command, Id, LaunchArg, ModuleHash, ModuleUse, Op, Opcode, SourceKind, Status,
};

/// CUDA C for the in-memory device's host kernels (it compiles nothing:
/// it finds the `__global__` names and runs kernels of those names).
const KERNELS: &str = r#"
extern "C" __global__ void fill(float* out, float v, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = v;
}
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void copy(const float* src, float* dst, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
"#;

const N: u32 = 1000;
const BYTES: u64 = N as u64 * 4;
const GRID: [u32; 3] = [N.div_ceil(128), 1, 1];
const BLOCK: [u32; 3] = [128, 1, 1];

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn float_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn fill(rec: &mut cuda_lease::client::Recorder, stream: u32, m: &ModuleSpec, buf: Id, v: f32) {
    rec.launch(
        stream,
        m,
        "fill",
        GRID,
        BLOCK,
        vec![LaunchArg::mem(buf), LaunchArg::f32(v), LaunchArg::u32(N)],
    );
}

fn axpy(rec: &mut cuda_lease::client::Recorder, stream: u32, m: &ModuleSpec, a: f32, x: Id, y: Id) {
    rec.launch(
        stream,
        m,
        "axpy",
        GRID,
        BLOCK,
        vec![
            LaunchArg::f32(a),
            LaunchArg::mem(x),
            LaunchArg::mem(y),
            LaunchArg::u32(N),
        ],
    );
}

#[tokio::test]
async fn a_twenty_command_pipeline_in_two_submissions_sent_without_waiting_is_one_round_trip_each()
{
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let m = ModuleSpec::cuda(KERNELS, &[]);
    let x0: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let before = batches(&fx.node);

    // First submission: 10 commands on two streams.
    let mut first = s.recorder();
    let x = first.alloc(0, BYTES); // 1
    let y = first.alloc(1, BYTES); // 2
    let t = first.alloc(1, BYTES); // 3
    first.write(0, x, 0, &float_bytes(&x0)); // 4
    fill(&mut first, 1, &m, y, 1.0); // 5
    let x_ready = first.record(0); // 6
    first.wait(1, x_ready); // 7
    axpy(&mut first, 1, &m, 2.0, x, y); // 8: y = 2x + 1
    let rx = first.read(0, x, 0, 8); // 9
    fill(&mut first, 0, &m, t, 5.0); // 10
    assert_eq!(first.len(), 10);

    // Second submission, recorded and sent before the first's reply: it
    // names the first's buffers and event.
    let mut second = s.recorder();
    second.wait(2, x_ready); // 1
    let z = second.alloc(2, BYTES); // 2
    second.launch(
        2,
        &m,
        "copy",
        GRID,
        BLOCK,
        vec![LaunchArg::mem(x), LaunchArg::mem(z), LaunchArg::u32(N)],
    ); // 3: z = x
    let y_done = second.record(1); // 4
    second.wait(2, y_done); // 5
    axpy(&mut second, 2, &m, 1.0, y, z); // 6: z = y + x = 3x + 1
    axpy(&mut second, 0, &m, -1.0, t, t); // 7: t = 0
    let rz = second.read(2, z, 0, BYTES as u32); // 8
    let rt = second.read(0, t, 0, 8); // 9
    second.free(2, z); // 10
    assert_eq!(second.len(), 10);

    let (f1, f2) = (first.submit(), second.submit());
    // Polled second-first: the node still runs them in submission order.
    let (r2, r1) = tokio::join!(f2, f1);
    let (r1, r2) = (r1.unwrap().ok().unwrap(), r2.unwrap().ok().unwrap());
    assert_eq!(floats(r1.read(rx).unwrap()), [0.0, 1.0]);
    let want: Vec<f32> = x0.iter().map(|v| 3.0 * v + 1.0).collect();
    assert_eq!(floats(r2.read(rz).unwrap()), want);
    assert_eq!(floats(r2.read(rt).unwrap()), [0.0, 0.0]);
    let after = batches(&fx.node);
    eprintln!(
        "BATCH requests at the node: {} for {} commands",
        after.0 - before.0,
        after.1 - before.1
    );
    assert_eq!(after.0 - before.0, 2, "one round trip per submission");
    assert_eq!(after.1 - before.1, 20);
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn two_streams_with_an_event_between_them_give_the_right_data() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let m = ModuleSpec::cuda(KERNELS, &[]);
    let mut rec = s.recorder();
    let x = rec.alloc(0, BYTES);
    let y = rec.alloc(1, BYTES);
    fill(&mut rec, 0, &m, x, 3.0);
    let e = rec.record(0);
    fill(&mut rec, 1, &m, y, 1.0);
    rec.wait(1, e);
    axpy(&mut rec, 1, &m, 2.0, x, y);
    // Stream 0 goes on with x meanwhile; y must not see it (x is read by
    // stream 1's axpy, which was queued first).
    fill(&mut rec, 0, &m, x, 100.0);
    let ry = rec.read(1, y, 0, BYTES as u32);
    let rx = rec.read(0, x, 0, 4);
    let out = rec.submit().await.unwrap().ok().unwrap();
    assert_eq!(floats(out.read(ry).unwrap()), vec![7.0; N as usize]);
    assert_eq!(floats(out.read(rx).unwrap()), [100.0]);
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn a_failing_command_reports_its_index_and_keeps_what_ran_before_it() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let m = ModuleSpec::cuda(KERNELS, &[]);
    let mut rec = s.recorder();
    let a = rec.alloc(0, 8); // 0
    rec.write(0, a, 0, &float_bytes(&[4.0, 2.0])); // 1
    let early = rec.read(0, a, 0, 8); // 2
    rec.launch(0, &m, "no_such_kernel", GRID, BLOCK, vec![]); // 3
    let late = rec.read(0, a, 0, 8); // 4
    let reply = rec.submit().await.unwrap();
    assert_eq!(reply.completed(), 3);
    let e = reply.error().unwrap().clone();
    assert_eq!((e.index, e.status), (3, Status::NotFound));
    assert!(e.message.starts_with("command 3:"), "{}", e.message);
    assert_eq!(floats(reply.read(early).unwrap()), [4.0, 2.0]);
    assert_eq!(
        reply.read(late),
        None,
        "commands after the failure did not run"
    );
    assert!(
        matches!(reply.ok(), Err(e) if e.kind() == ErrorKind::InvalidRequest && e.message().contains("command 3"))
    );
    // What ran stays: the buffer and its data.
    assert_eq!(floats(&s.read_id(a, 0, 8).await.unwrap()), [4.0, 2.0]);
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn reused_unknown_and_wrong_kind_ids_are_errors_naming_the_id_and_command() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let mut rec = s.recorder();
    let a = rec.alloc(0, 8);
    rec.command(0, Op::Alloc { buf: a, size: 8 });
    let r = rec.submit().await.unwrap();
    let e = r.error().unwrap();
    assert_eq!((e.index, e.status), (1, Status::BadRequest));
    assert_eq!(e.message, format!("command 1: id {a} is already in use"));
    // Reused across submissions too (the first alloc ran and stays).
    let mut rec = s.recorder();
    rec.command(3, Op::Alloc { buf: a, size: 8 });
    let e = rec.submit().await.unwrap().error().unwrap().clone();
    assert_eq!(e.message, format!("command 0: id {a} is already in use"));
    // Unknown ids.
    let ghost = Id(999_999);
    for (op, index) in [
        (
            Op::Read {
                buf: ghost,
                offset: 0,
                len: 4,
            },
            1,
        ),
        (Op::Wait { event: ghost }, 1),
        (Op::Free { id: ghost }, 1),
    ] {
        let mut rec = s.recorder();
        rec.record(0);
        rec.command(0, op);
        let e = rec.submit().await.unwrap().error().unwrap().clone();
        assert_eq!((e.index, e.status), (index, Status::NotFound));
        assert_eq!(e.message, format!("command {index}: unknown id {ghost}"));
    }
    // An event is not a buffer, and a buffer is not an event.
    let mut rec = s.recorder();
    let ev = rec.record(0);
    rec.read(0, ev, 0, 4);
    let e = rec.submit().await.unwrap().error().unwrap().clone();
    assert_eq!(
        e.message,
        format!("command 1: {ev} is an event, not a buffer")
    );
    let mut rec = s.recorder();
    rec.wait(0, a);
    let e = rec.submit().await.unwrap().error().unwrap().clone();
    assert_eq!(
        e.message,
        format!("command 0: {a} is a buffer, not an event")
    );
    // A freed id may be named again.
    let mut rec = s.recorder();
    rec.free(0, a);
    rec.command(0, Op::Alloc { buf: a, size: 4 });
    rec.submit().await.unwrap().ok().unwrap();
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn streams_are_made_on_demand_up_to_the_lease_limit() {
    let fx = Fixture::node_path(1 << 20)
        .config(|cfg| cfg.max_streams_per_lease = 2)
        .lease(1 << 20)
        .start()
        .await;
    let s = fx.session();
    let mut rec = s.recorder();
    rec.record(7);
    rec.record(3);
    rec.record(7);
    rec.record(4);
    let e = rec.submit().await.unwrap().error().unwrap().clone();
    assert_eq!((e.index, e.status), (3, Status::CapacityExceeded));
    assert!(e.message.contains("limit of 2 streams"), "{}", e.message);
    // The two streams that ran stay the lease's.
    let mut rec = s.recorder();
    rec.record(3);
    rec.submit().await.unwrap().ok().unwrap();
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn modules_travel_by_content_and_bad_sources_come_back_with_their_log() {
    let mut fx = Fixture::node_path(4 << 20)
        // No node-wide cache: a lease that has not loaded a module must get
        // its source again.
        .config(|cfg| cfg.module_cache_bytes = 0)
        .lease(1 << 20)
        .start()
        .await;
    let lease_a = fx.take_lease();
    let lease_b = fx.another_lease(1 << 20).await;
    let client = fx.client();
    let m = ModuleSpec::cuda(KERNELS, &["-default-device"]);
    assert_eq!(
        m.hash(),
        ModuleHash::of(
            &SourceKind::Cuda {
                options: vec!["-default-device".into()]
            },
            KERNELS
        )
    );
    let run = |s: Session| {
        let m = m.clone();
        async move {
            let mut rec = s.recorder();
            let x = rec.alloc(0, BYTES);
            fill(&mut rec, 0, &m, x, 9.0);
            let r = rec.read(0, x, 4, 4);
            let out = rec.submit().await?.ok()?;
            Ok::<_, Error>(floats(out.read(r).unwrap())[0])
        }
    };
    // Lease A: the client sends the source (first use on this node).
    assert_eq!(run(lease_a.session()).await.unwrap(), 9.0);
    // Lease B: the client believes the node has it and sends the hash
    // alone; the node does not (no cache), answers UNKNOWN_MODULE, and the
    // recorder resends with the source, transparently.
    assert_eq!(run(lease_b.session()).await.unwrap(), 9.0);
    // A raw batch naming a module nobody sent is refused with that status,
    // and nothing of it runs.
    let other = ModuleSpec::cuda(format!("{KERNELS}// other"), &[]);
    let raw = Batch {
        lease: lease_b.id(),
        seq: 0,
        modules: vec![ModuleUse {
            hash: other.hash(),
            source: None,
        }],
        commands: vec![Command {
            stream: 0,
            op: Op::Alloc {
                buf: Id(1 << 40),
                size: 4,
            },
        }],
    };
    let err = client
        .request(Opcode::Batch, &proto::to_body(&raw), &[])
        .await
        .unwrap_err();
    assert!(
        matches!(err, ref e if matches!(e.kind(), ErrorKind::ModuleUnknown) && e.message().contains("send the batch again with its source")),
        "{err:?}"
    );
    // A source that does not hash to its name is refused.
    let mut forged = raw.clone();
    forged.modules[0].source = Some(proto::ModuleText {
        kind: SourceKind::Ptx,
        len: 4,
    });
    let err = client
        .request(Opcode::Batch, &proto::to_body(&forged), b"evil")
        .await
        .unwrap_err();
    assert!(
        matches!(err, ref e if matches!(e.kind(), ErrorKind::InvalidRequest) && e.message().contains("hashes to")),
        "{err:?}"
    );
    // A compile error names the launch and carries the compiler's log.
    let bad = ModuleSpec::cuda("#error boom\n__global__ void k() {}", &[]);
    let mut rec = lease_a.session().recorder();
    rec.alloc(0, 4);
    rec.launch(0, &bad, "k", [1, 1, 1], [1, 1, 1], vec![]);
    let reply = rec.submit().await.unwrap();
    let e = reply.error().unwrap();
    assert_eq!((e.index, e.status), (1, Status::LoadFailed));
    assert!(e.message.contains("NVRTC log"), "{}", e.message);
    assert_eq!(
        reply.completed(),
        0,
        "a module that fails to load runs nothing"
    );
    lease_a.free().await.unwrap();
    lease_b.free().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test]
async fn fill_and_copy_run_in_a_batch_and_check_their_ranges() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let mut rec = s.recorder();
    let a = rec.alloc(0, 16);
    let b = rec.alloc(1, 16);
    rec.write(0, a, 0, &(0u8..16).collect::<Vec<_>>());
    rec.fill(0, a, 4, 4, 0xEE);
    let done = rec.record(0);
    rec.wait(1, done);
    rec.copy(1, (a, 2), (b, 8), 8);
    let r = rec.read(1, b, 0, 16);
    let out = rec.submit().await.unwrap().ok().unwrap();
    assert_eq!(
        out.read(r).unwrap(),
        &[0, 0, 0, 0, 0, 0, 0, 0, 2, 3, 0xEE, 0xEE, 0xEE, 0xEE, 8, 9]
    );
    let mut rec = s.recorder();
    rec.fill(0, a, 10, 7, 0);
    rec.copy(0, (a, 0), (a, 8), 8);
    let e = rec.submit().await.unwrap().error().unwrap().clone();
    assert_eq!((e.index, e.status), (0, Status::BadRequest));
    assert!(
        e.message.contains("outside a buffer of 16 bytes"),
        "{}",
        e.message
    );
    let mut rec = s.recorder();
    rec.copy(0, (a, 0), (a, 8), 8);
    let e = rec.submit().await.unwrap().error().unwrap().clone();
    assert_eq!(e.message, format!("command 0: a copy from {a} to itself"));
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn reads_can_land_straight_in_the_callers_buffers() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let mut rec = s.recorder();
    let a = rec.alloc(0, 8);
    rec.write(0, a, 0, &[1, 2, 3, 4, 5, 6, 7, 8]);
    rec.read(0, a, 0, 8);
    rec.read(0, a, 2, 3);
    rec.launch(
        0,
        &ModuleSpec::cuda(KERNELS, &[]),
        "nope",
        GRID,
        BLOCK,
        vec![],
    );
    rec.read(0, a, 0, 1);
    let dests = vec![vec![0u8; 8], vec![0u8; 3], vec![0xEEu8; 1]];
    let (reply, dests) = rec.submit_into(dests).await.unwrap();
    assert_eq!(reply.completed(), 4);
    assert_eq!(dests[0], [1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(dests[1], [3, 4, 5]);
    assert_eq!(dests[2], [0xEE], "the read after the failure did not run");
    // Destinations that do not match the reads are refused before sending.
    let mut rec = s.recorder();
    rec.read(0, a, 0, 8);
    let err = rec.submit_into(vec![vec![0u8; 4]]).await.unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::InvalidRequest), "{err:?}");
    fx.free_and_shutdown().await;
}

/// A graph recorded once on the node replays 100 times, each launch one
/// small message with a changed input before it; its body's allocation is
/// made at capture and nothing else of it runs then; a body's arm on a
/// second stream joins back; a buffer the graph uses cannot be freed while
/// it lives; freeing the graph runs the body's frees and the node's
/// accounting is back where it was.
#[tokio::test]
async fn a_graph_recorded_once_replays_with_inputs_changed_between_launches() {
    use cuda_lease_node::node::LeaseUsage;
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let usage = || -> LeaseUsage { fx.node.lease_usage(&fx.lease().id()).expect("alive") };
    let s = fx.session();
    let m = ModuleSpec::cuda(KERNELS, &[]);
    let mut rec = s.recorder();
    let x = rec.alloc(0, BYTES);
    let y = rec.alloc(0, BYTES);
    rec.use_module(&m);
    rec.submit().await.unwrap().ok().unwrap();
    let before = usage();

    // y += 2x + 1, through an intermediate t and an arm on stream 1.
    let mut rec = s.recorder();
    let g = rec.graph_begin(0);
    let t = rec.alloc(0, BYTES);
    fill(&mut rec, 0, &m, t, 1.0);
    axpy(&mut rec, 0, &m, 2.0, x, t);
    let fork = rec.record(0);
    rec.wait(1, fork);
    axpy(&mut rec, 1, &m, 1.0, t, y);
    let join = rec.record(1);
    rec.wait(0, join);
    rec.free(0, t);
    rec.graph_end(0, g);
    let captured = rec.read(0, y, 0, 4);
    let out = rec.submit().await.unwrap().ok().unwrap();
    assert_eq!(
        floats(out.read(captured).unwrap()),
        [0.0],
        "capture runs nothing"
    );
    assert_eq!(usage().buffers, before.buffers + 1, "t is made at capture");

    let mut want = 0.0f32;
    for i in 0..100 {
        let xi = i as f32;
        want += 2.0 * xi + 1.0;
        let mut rec = s.recorder();
        rec.write(0, x, 0, &float_bytes(&vec![xi; N as usize]));
        rec.graph_launch(0, g);
        let r = rec.read(0, y, (N as u64 - 1) * 4, 4);
        let out = rec.submit().await.unwrap().ok().unwrap();
        assert_eq!(floats(out.read(r).unwrap()), [want], "launch {i}");
    }

    // What the graph uses lives as long as it does.
    let mut rec = s.recorder();
    rec.free(0, y);
    let e = rec.submit().await.unwrap().error().unwrap().clone();
    assert_eq!(e.status, Status::BadRequest);
    assert!(
        e.message.contains(&format!("used by graph {g}")),
        "{}",
        e.message
    );
    // Freed with its body's frees (t), then y can go.
    let mut rec = s.recorder();
    rec.free(0, g);
    rec.free(0, y);
    rec.free(0, x);
    rec.submit().await.unwrap().ok().unwrap();
    let after = usage();
    assert_eq!(after.buffers, before.buffers - 2);
    assert_eq!(after.graphs, 0);
    assert_eq!(after.allocated, before.allocated - 2 * BYTES);
    fx.free_and_shutdown().await;
}

/// A prepared submission recorded by hand: its body's read returns nothing
/// in the batch that records it (a read after the body is the reply's
/// first); two runs in one batch each take their own input bytes and
/// return their own outputs, in order; a run whose byte counts are not
/// the body's is refused by name.
#[tokio::test]
async fn a_prepared_body_runs_twice_in_one_batch_with_its_own_inputs_each() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let m = ModuleSpec::cuda(KERNELS, &[]);
    let mut rec = s.recorder();
    // y = 2x + y, x uploaded and y filled with 1 at each run; y read back.
    let p = rec.prepare_begin(0);
    let x = rec.alloc(0, BYTES);
    let y = rec.alloc(0, BYTES);
    rec.write(0, x, 0, &float_bytes(&vec![0.0; N as usize]));
    fill(&mut rec, 0, &m, y, 1.0);
    axpy(&mut rec, 0, &m, 2.0, x, y);
    rec.read(0, y, 0, 8);
    rec.graph_end(0, p);
    let other = rec.alloc(0, 8);
    rec.write(0, other, 0, &float_bytes(&[7.0, 8.0]));
    let after = rec.read(0, other, 0, 8);
    let out = rec.submit().await.unwrap().ok().unwrap();
    assert_eq!(floats(out.read(after).unwrap()), [7.0, 8.0]);

    let mut rec = s.recorder();
    let first = rec.run(0, p, &float_bytes(&vec![3.0; N as usize]), 8);
    let second = rec.run(1, p, &float_bytes(&vec![5.0; N as usize]), 8);
    let out = rec.submit().await.unwrap().ok().unwrap();
    assert_eq!(floats(out.read(first).unwrap()), [7.0, 7.0]);
    assert_eq!(floats(out.read(second).unwrap()), [11.0, 11.0]);

    let mut rec = s.recorder();
    rec.run(0, p, &[0; 4], 8);
    let e = rec.submit().await.unwrap().error().unwrap().clone();
    assert_eq!((e.index, e.status), (0, Status::BadRequest));
    assert!(
        e.message.contains("the run gives 4 and asks 8"),
        "{}",
        e.message
    );
    fx.free_and_shutdown().await;
}

/// A graph's body cannot read, time itself, nest or stay open; launching
/// or ending what is not a graph is refused; each refusal names it, and
/// nothing of a refused body runs.
#[tokio::test]
async fn graph_bodies_that_break_the_rules_are_refused_by_name() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let refused = |rec: cuda_lease::client::Recorder| async move {
        let reply = rec.submit().await.unwrap();
        let e = reply.error().expect("refused").clone();
        (e.index, e.message)
    };
    let mut rec = s.recorder();
    let a = rec.alloc(0, 64);
    rec.submit().await.unwrap().ok().unwrap();

    let mut rec = s.recorder();
    let g = rec.graph_begin(0);
    rec.read(0, a, 0, 4);
    rec.graph_end(0, g);
    let (i, m) = refused(rec).await;
    assert_eq!(i, 1);
    assert!(m.contains("cannot read"), "{m}");

    let mut rec = s.recorder();
    let g = rec.graph_begin(0);
    rec.graph_begin(1);
    rec.graph_end(0, g);
    let (_, m) = refused(rec).await;
    assert!(m.contains("cannot begin another graph"), "{m}");

    let mut rec = s.recorder();
    rec.graph_begin(0);
    rec.fill(0, a, 0, 64, 1);
    let (i, m) = refused(rec).await;
    assert_eq!(i, 0, "an open body is refused at its beginning");
    assert!(m.contains("does not end in its batch"), "{m}");

    let mut rec = s.recorder();
    rec.graph_launch(0, a);
    let (_, m) = refused(rec).await;
    assert!(m.contains("is not a graph"), "{m}");

    let mut rec = s.recorder();
    rec.graph_end(0, a);
    let (_, m) = refused(rec).await;
    assert!(m.contains("no body being recorded"), "{m}");

    // The node's own ids (its replay fences) are not the client's to name.
    let mut rec = s.recorder();
    rec.command(
        0,
        Op::Record {
            event: Id(proto::FIRST_NODE_ID),
        },
    );
    let (_, m) = refused(rec).await;
    assert!(m.contains("reserved for the node"), "{m}");
    fx.free_and_shutdown().await;
}

/// An allocation reads as zeros wherever nothing wrote it, also when the
/// next command writes it: written whole, it reads the write (the worker
/// then skips its zeroing); written in part, or not at all while the next
/// command writes another buffer, it reads zeros past the write.
#[tokio::test]
async fn an_allocation_reads_zeros_wherever_the_write_after_it_does_not_reach() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 20).start().await;
    let s = fx.session();
    let mut rec = s.recorder();
    let whole = rec.alloc(0, 64);
    rec.write(0, whole, 0, &[1; 64]);
    let head = rec.alloc(0, 64);
    rec.write(0, head, 0, &[2; 32]);
    let tail = rec.alloc(0, 64);
    rec.write(0, tail, 32, &[3; 32]);
    let untouched = rec.alloc(0, 64);
    rec.write(0, whole, 0, &[4; 64]);
    let reads = [whole, head, tail, untouched].map(|b| rec.read(0, b, 0, 64));
    let out = rec.submit().await.unwrap().ok().unwrap();
    let [whole, head, tail, untouched] = reads.map(|r| out.read(r).unwrap().to_vec());
    assert_eq!(whole, [4; 64]);
    assert_eq!(head, [[2; 32], [0; 32]].concat(), "written in part");
    assert_eq!(tail, [[0; 32], [3; 32]].concat(), "written at an offset");
    assert_eq!(untouched, [0; 64], "another buffer written after it");
    fx.free_and_shutdown().await;
}
