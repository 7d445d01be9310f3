//! A worker past its spin budget sleeps until the device wakes it for a
//! done batch: the wake-up descriptor of `CudaDevice`.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use cuda_lease::proto::{LaunchArg, LaunchSpec, ModuleHash, SourceKind};
use cuda_lease_node::device::{CudaDevice, LeaseDevice};

/// Spins until `%globaltimer` has moved on `ns` nanoseconds.
const SPIN_PTX: &str = r"
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 ns)
{
    .reg .pred %p;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
LOOP:
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd3, %rd3, %rd2;
    setp.lt.u64 %p, %rd3, %rd1;
    @%p bra LOOP;
    ret;
}
";

/// Whether `fd` is readable within `ms` milliseconds.
fn readable_within(fd: RawFd, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid `pollfd`, alive across the call.
    unsafe { libc::poll(&mut p, 1, ms) == 1 }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_sealed_batch_wakes_its_descriptor_once_its_work_is_done_and_not_before() {
    let mut dev = CudaDevice::open(0).expect("device 0");
    let kind = SourceKind::Ptx;
    let hash = ModuleHash::of(&kind, SPIN_PTX);
    dev.load_module(hash, &kind, SPIN_PTX)
        .expect("the spin PTX loads");
    let spin = |dev: &mut CudaDevice, stream, ms: u64| {
        let spec = LaunchSpec {
            module: hash,
            kernel: "spin".into(),
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem: 0,
            args: vec![LaunchArg::u64(ms * 1_000_000)],
        };
        dev.launch(stream, &spec).expect("the spin launches");
    };
    // A batch on two streams, one kernel of 300 ms on the second.
    spin(&mut dev, 0, 1);
    spin(&mut dev, 1, 300);
    let t = Instant::now();
    let ticket = dev.seal(0);
    let fd = dev
        .wake_when_done(ticket)
        .expect("a CUDA device arms a wake-up");
    assert!(!readable_within(fd, 50), "woken while the batch ran");
    assert!(
        dev.poll_sealed(ticket).is_none(),
        "the batch is not done yet"
    );
    assert!(readable_within(fd, 10_000), "not woken within 10 s");
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(250), "woken after {took:?}");
    let done = dev.poll_sealed(ticket).expect("done once woken");
    assert_eq!(done.expect("the batch ran"), Vec::<u8>::new());
    // Drained, the descriptor sleeps again until the next armed batch.
    let mut count = 0u64;
    // SAFETY: reads 8 bytes into `count` from the eventfd.
    assert_eq!(unsafe { libc::read(fd, (&raw mut count).cast(), 8) }, 8);
    assert!(!readable_within(fd, 0));
    spin(&mut dev, 0, 20);
    let ticket = dev.seal(0);
    assert_eq!(dev.wake_when_done(ticket), Some(fd), "one descriptor");
    assert!(readable_within(fd, 10_000), "a done batch did not wake");
    assert!(dev.poll_sealed(ticket).expect("done").is_ok());
}
