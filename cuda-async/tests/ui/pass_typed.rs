// Every accepted way to pass buffers to a typed launcher.
use std::sync::Arc;

use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, LaunchConfig};

mod k {
    cuda_async::kernels!("../../../../cuda-async/tests/ui/kernels/good.cu");
}

#[allow(dead_code)]
fn owned(x: DeviceBuffer<f32>, y: DeviceBuffer<f32>) -> impl DeviceOp {
    // SAFETY: never run (a compile test).
    unsafe { k::scale(LaunchConfig::for_num_elems(4), x, y, 2.0, 4) }
}

#[allow(dead_code)]
fn borrowed<'a>(x: &'a mut DeviceBuffer<f32>, y: &'a DeviceBuffer<f32>) -> impl DeviceOp + 'a {
    // SAFETY: never run (a compile test).
    unsafe { k::scale(LaunchConfig::for_num_elems(4), x, y, 2.0, 4) }
}

#[allow(dead_code)]
fn shared_input(x: DeviceBuffer<f32>, y: Arc<DeviceBuffer<f32>>) -> impl DeviceOp {
    // SAFETY: never run (a compile test).
    unsafe { k::scale(LaunchConfig::for_num_elems(4), x, y, 2.0, 4) }
}

#[allow(dead_code)]
fn zipped(a: BoxedOp<'static, u32>, b: BoxedOp<'static, u32>, c: BoxedOp<'static, u32>) -> impl DeviceOp<Output = (u32, u32, u32)> {
    cuda_async::zip!(a, b, c)
}

fn main() {
    let _ = k::module();
}
