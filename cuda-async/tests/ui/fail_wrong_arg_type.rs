// A buffer the kernel writes (`float* x`) passed through a shared
// reference, and a scalar of the wrong type.
use cuda_async::{DeviceBuffer, LaunchConfig};

mod k {
    cuda_async::kernels!("../../../../cuda-async/tests/ui/kernels/good.cu");
}

fn shared_output(x: &DeviceBuffer<f32>, y: &DeviceBuffer<f32>) {
    // SAFETY: never run (a compile test).
    let _ = unsafe { k::scale(LaunchConfig::for_num_elems(4), x, y, 2.0, 4) };
}

fn wrong_scalar(x: DeviceBuffer<f32>, y: DeviceBuffer<f32>) {
    // SAFETY: never run (a compile test).
    let _ = unsafe { k::scale(LaunchConfig::for_num_elems(4), x, y, 2.0f64, 4) };
}

fn wrong_element(x: DeviceBuffer<f32>, y: DeviceBuffer<u32>) {
    // SAFETY: never run (a compile test).
    let _ = unsafe { k::scale(LaunchConfig::for_num_elems(4), x, y, 2.0, 4) };
}

fn main() {}
