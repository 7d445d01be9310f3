//! Runnable examples of `cuda-async` live in this folder (`cargo run --release --example vecadd`).
