//! Compile-time tests of `kernels!`, `zip!` and the typed launchers
//! (trybuild): what compiles, and the exact compiler messages of what must
//! not (checked in as `tests/ui/*.stderr`). Regenerate the messages with
//! `TRYBUILD=overwrite cargo test -p cuda-async --test ui` and review them.
//!
//! The `.cu` paths in the cases are relative to trybuild's project
//! directory (`target/tests/trybuild/cuda-async`), four levels below the
//! workspace root.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass_*.rs");
    t.compile_fail("tests/ui/fail_*.rs");
}
