use super::*;

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

const CU: &str = "extern \"C\" __global__ void fill(float* out, float v, unsigned n) {}\n\
                  extern \"C\" __global__ void axpy(float a, const float* x, float* y, unsigned n) {}\n\
                  extern \"C\" __global__ void copy(const float* s, float* d, unsigned n) {}\n";

/// Launches `kernel` of `m` on `n` threads.
fn launch(
    d: &mut MemoryDevice,
    stream: StreamId,
    m: ModuleHash,
    kernel: &str,
    n: u32,
    args: Vec<LaunchArg<'static>>,
) -> Result<(), DeviceError> {
    let spec = LaunchSpec {
        module: m,
        kernel: kernel.to_owned().into(),
        grid: [n.div_ceil(32), 1, 1],
        block: [32, 1, 1],
        shared_mem: 0,
        args,
    };
    d.launch(stream, &spec)
}

fn device() -> (MemoryDevice, ModuleHash) {
    let mut d = MemoryDevice::new(1 << 20);
    let kind = SourceKind::Cuda { options: vec![] };
    let h = ModuleHash::of(&kind, CU);
    assert_eq!(d.load_module(h, &kind, CU).unwrap(), None);
    (d, h)
}

#[test]
fn a_free_waits_for_queued_uses_and_the_id_can_be_named_again() {
    let (mut d, m) = device();
    d.alloc(0, Id(1), 8).unwrap();
    d.write(0, Id(1), 0, &f32s(&[1.0, 2.0])).unwrap();
    d.read(1, Id(1), 0, 8, 0).unwrap();
    d.free(2, Id(1)).unwrap();
    d.alloc(2, Id(1), 8).unwrap();
    let args = vec![
        LaunchArg::mem(Id(1)),
        LaunchArg::f32(9.0),
        LaunchArg::u32(2),
    ];
    launch(&mut d, 2, m, "fill", 2, args).unwrap();
    d.read(2, Id(1), 0, 8, 8).unwrap();
    let mut out = vec![0u8; 16];
    d.finish(&mut out).unwrap();
    assert_eq!(to_f32(&out), [1.0, 2.0, 9.0, 9.0]);
    assert_eq!(d.store.len(), 1, "the first storage is freed");
}

#[test]
fn a_buffer_named_twice_in_one_launch_does_not_wait_for_itself() {
    let (mut d, m) = device();
    d.alloc(0, Id(1), 8).unwrap();
    d.write(0, Id(1), 0, &f32s(&[1.0, 2.0])).unwrap();
    let x = LaunchArg::mem(Id(1));
    let args = vec![LaunchArg::f32(1.0), x.clone(), x, LaunchArg::u32(2)];
    launch(&mut d, 0, m, "axpy", 2, args).unwrap();
    d.read(0, Id(1), 0, 8, 0).unwrap();
    let mut out = vec![0u8; 8];
    d.finish(&mut out).unwrap();
    assert_eq!(to_f32(&out), [2.0, 4.0]);
}

#[test]
fn fill_and_copy_are_ordered_like_every_other_use() {
    let (mut d, _) = device();
    d.alloc(0, Id(1), 8).unwrap();
    d.alloc(1, Id(2), 8).unwrap();
    d.fill(0, Id(1), 2, 4, 0xAB).unwrap();
    // Stream 1 (which runs first when nothing orders it) reads Id(1):
    // the buffer orders the copy after stream 0's fill.
    d.copy(1, (Id(1), 0), (Id(2), 2), 6).unwrap();
    d.read(1, Id(2), 0, 8, 0).unwrap();
    let mut out = vec![0u8; 8];
    d.finish(&mut out).unwrap();
    assert_eq!(out, [0, 0, 0, 0, 0xAB, 0xAB, 0xAB, 0xAB]);
    assert_eq!(
        d.copy(0, (Id(1), 0), (Id(1), 4), 4).unwrap_err().status,
        Status::BadRequest
    );
    assert_eq!(
        d.fill(0, Id(1), 4, 5, 0).unwrap_err().status,
        Status::BadRequest
    );
    assert_eq!(
        d.copy(0, (Id(1), 0), (Id(2), 4), 5).unwrap_err().status,
        Status::BadRequest
    );
}

#[test]
fn unknown_ids_wrong_arguments_and_faults_are_errors() {
    let (mut d, m) = device();
    assert_eq!(
        d.read(0, Id(3), 0, 4, 0).unwrap_err().status,
        Status::NotFound
    );
    assert_eq!(d.wait(0, Id(4)).unwrap_err().status, Status::NotFound);
    d.alloc(0, Id(1), 4).unwrap();
    assert_eq!(d.alloc(0, Id(1), 4).unwrap_err().status, Status::BadRequest);
    assert_eq!(d.record(0, Id(1)).unwrap_err().status, Status::BadRequest);
    let e = launch(&mut d, 0, m, "fill", 1, vec![LaunchArg::mem(Id(1))]).unwrap_err();
    assert_eq!(e.status, Status::BadRequest);
    let e = launch(&mut d, 0, m, "fill", 1, vec![LaunchArg::Output]).unwrap_err();
    assert_eq!(e.status, Status::BadRequest);
    assert!(e.message.contains("GPU_SUBMIT"), "{e}");
    // Writing 8 floats into a 1-float buffer faults at finish, sticky.
    let args = vec![
        LaunchArg::mem(Id(1)),
        LaunchArg::f32(0.0),
        LaunchArg::u32(8),
    ];
    launch(&mut d, 0, m, "fill", 8, args).unwrap();
    let e = d.finish(&mut []).unwrap_err();
    assert!(e.sticky && e.status == Status::LaunchFailed, "{e}");
}
