use cuda_async::{DeviceBuffer, LaunchConfig};

mod k {
    cuda_async::kernels!("../../../../cuda-async/tests/ui/kernels/good.cu");
}

fn f(x: DeviceBuffer<f32>, y: DeviceBuffer<f32>) {
    // SAFETY: never run (a compile test).
    let _ = unsafe { k::scale(LaunchConfig::for_num_elems(4), x, y, 2.0) };
}

fn main() {}
