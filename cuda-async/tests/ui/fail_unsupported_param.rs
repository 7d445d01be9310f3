mod k {
    cuda_async::kernels!("../../../../cuda-async/tests/ui/kernels/struct_param.cu");
}

fn main() {}
