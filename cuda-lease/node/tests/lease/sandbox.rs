//! Tenants' CUDA C cannot reach the node's files (CPU: the in-memory
//! device, loopback, and the confined compiler child of the node binary).

use std::path::PathBuf;

use crate::common::*;
use cuda_lease::client::{ErrorKind, ModuleSpec};
use cuda_lease_node::sandbox::{self, CompileSandbox, Confinement};

const KERNEL: &str = "extern \"C\" __global__ void fill(float* out, float v, unsigned n) {}\n";

/// A folder of offered headers: `offered.h`, and `passwd` (a link to
/// `/etc/passwd`, which must not count as offered).
fn header_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cuda-lease-sandbox-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("offered.h"), "#define OFFERED 1\n").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", dir.join("passwd")).unwrap();
    dir
}

#[tokio::test]
async fn tenant_sources_that_name_the_nodes_files_are_refused_without_quoting_them() {
    let dir = header_dir("node");
    let fx = Fixture::memory(4 << 20)
        .config(|cfg| {
            cfg.worker.compile = CompileSandbox {
                include_dirs: vec![dir.clone()],
                ..CompileSandbox::default()
            }
        })
        .lease(1 << 20)
        .start()
        .await;
    let s = fx.session();
    let secrets = node_secrets();
    let attacks: [(&str, &[&str]); 9] = [
        ("#include \"/etc/passwd\"\n", &[]),
        ("#include </proc/self/environ>\n", &[]),
        ("#include \"/proc/self/cmdline\"\n", &[]),
        ("#include </dev/zero>\n", &[]),
        ("#include \"passwd\"\n", &[]),
        ("#include \"passwd\"\n", &["-I/etc"]),
        ("#include \"offered.h\"\n", &["--pre-include=/etc/passwd"]),
        ("/* */ #include \"../../../../etc/passwd\"\n", &[]),
        ("#define P \"/etc/passwd\"\n#include P\n", &[]),
    ];
    for (head, options) in attacks {
        let m = ModuleSpec::cuda(format!("{head}{KERNEL}"), options);
        let e = s.load(&m).await.unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e.kind(), ErrorKind::LoadFailed),
            "{head:?} {options:?}: {e}"
        );
        assert!(text.contains("refused"), "{head:?} {options:?}: {text}");
        for line in &secrets {
            assert!(
                !text.contains(line.as_str()),
                "{head:?}: {text} quotes {line:?}"
            );
        }
    }
    // What the node offers still loads, and the lease is still usable.
    let ok = ModuleSpec::cuda(
        format!("#include \"offered.h\"\n{KERNEL}"),
        &["--std=c++17"],
    );
    s.load(&ok).await.unwrap();
    fx.free_and_shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_confined_compiler_cannot_open_the_nodes_files() {
    let dir = header_dir("probe");
    let probes: Vec<PathBuf> = [
        "/etc/passwd",
        "/proc/self/environ",
        "/proc/self/cmdline",
        "/etc/hostname",
    ]
    .iter()
    .map(PathBuf::from)
    .chain([dir.join("offered.h"), dir.join("passwd")])
    .collect();
    let (confinement, opened) =
        sandbox::probe(&worker_exe(), std::slice::from_ref(&dir), &probes).unwrap();
    match confinement {
        Confinement::Landlock(abi) => {
            // Everything outside the offered folder is closed, also through
            // a link inside it; the offered header opens.
            assert_eq!(
                opened,
                [false, false, false, false, true, false],
                "{probes:?}"
            );
            eprintln!("confined by Landlock ABI {abi}");
        }
        Confinement::Unavailable => {
            assert!(sandbox::landlock_abi().is_none());
            eprintln!("no Landlock on this kernel: the source check alone holds here");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
