mod k {
    cuda_async::kernels!("../../../../cuda-async/tests/ui/kernels/no_such_file.cu");
}

fn main() {}
