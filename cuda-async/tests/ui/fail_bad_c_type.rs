mod k {
    cuda_async::kernels!("../../../../cuda-async/tests/ui/kernels/bad_type.cu");
}

fn main() {}
