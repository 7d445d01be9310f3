//! Runnable examples of `cuda-async` live in this folder (`cargo run --release --example vecadd`).
//!
//! What they share: the command line of an example that takes no
//! arguments ([`no_arguments`]).

/// The command line of an example that takes no arguments: `-h` or
/// `--help` prints `about` (what it does, what it needs, what it prints)
/// and exits 0; any other argument is refused, exit 2.
pub fn no_arguments(name: &str, about: &str) {
    let Some(arg) = std::env::args().nth(1) else {
        return;
    };
    if arg == "-h" || arg == "--help" {
        println!("{name}: {about}\n\nUsage: cargo run --release --example {name}");
        std::process::exit(0);
    }
    eprintln!("{name}: unknown argument {arg} (it takes none; --help says what it does)");
    std::process::exit(2);
}
