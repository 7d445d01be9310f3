//! Tenants' CUDA C, compiled without reaching the node's files.
//!
//! NVRTC opens any file a source names (`#include "/etc/passwd"`,
//! `/proc/self/environ`) and quotes it in the log returned to the tenant.
//! Three layers keep it to the headers the node offers
//! ([`CompileSandbox::include_dirs`]):
//!
//! 1. **Options are allow-listed** ([`check_options`]): no include path,
//!    pre-include, response file or output file option reaches the compiler;
//!    the node adds `-I` for the header directories itself.
//! 2. **Includes are checked before compiling** ([`check_source`]): a source
//!    names only those headers, by relative name, in plain `#include` lines;
//!    any other route to a file, in any spelling (line splices, trigraphs,
//!    digraphs), refuses the module.
//! 3. **The compiler runs in a confined child** ([`Compiler::compile`]): the
//!    worker re-executes its program with [`COMPILER_ENV`] set, no arguments
//!    and only the library search (and compute-sanitizer) variables. The
//!    child loads NVRTC, forbids itself all file access but reading the
//!    header directories (Landlock where the kernel has it, with
//!    `no_new_privs`), then compiles. The worker kills it after
//!    [`CompileSandbox::timeout`] and keeps at most
//!    [`CompileSandbox::max_log_bytes`] of its log.
//!
//! Layers 1 and 2 hold on any kernel and on the in-memory test device too;
//! layer 3 holds even if the source check has a gap.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

mod check;
mod child;

pub use self::check::{check_options, check_source};
pub(crate) use self::child::child_main;
pub use self::child::{landlock_abi, probe, Confinement};
use self::child::{run_child, ChildRequest};

/// Environment variable that turns a worker program into the sandboxed
/// compiler (see [`crate::worker::main_if_worker`]).
pub const COMPILER_ENV: &str = "CUDA_LEASE_COMPILER";

/// Variables carrying the sandbox's settings to a worker.
const INCLUDE_ENV: &str = "CUDA_LEASE_INCLUDE";
const TIMEOUT_ENV: &str = "CUDA_LEASE_COMPILE_TIMEOUT_MS";
const LOG_ENV: &str = "CUDA_LEASE_COMPILE_LOG_BYTES";

/// Variables the compiler child keeps (to find `libnvrtc`); others are cleared.
const KEPT_ENV: [&str; 5] = [
    "LD_LIBRARY_PATH",
    "CUDA_PATH",
    "CUDA_HOME",
    "CUDA_ROOT",
    "CUDA_TOOLKIT_ROOT_DIR",
];

/// Prefixes of the variables compute-sanitizer gives a process tree
/// (`--target-processes all`). The compiler child keeps them: the sanitizer
/// injects itself whatever the environment, and without them the child
/// blocks waiting for it until the compile time limit. Present only under a
/// sanitizer; they carry nothing of the node's.
const SANITIZER_ENV_PREFIXES: [&str; 3] = [
    "NV_SANITIZER_",
    "NVIDIA_PROCESS_INJECTION_",
    "NVTX_INJECTION",
];

/// Largest PTX a compile may return.
const MAX_PTX_BYTES: usize = 256 << 20;

/// How the node compiles tenants' CUDA C.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileSandbox {
    /// Header directories tenants may include from (e.g. the toolkit's
    /// `include`): the only files the compiler may read. Empty: no `#include`.
    pub include_dirs: Vec<PathBuf>,
    /// Longest one compile may take; the compiler is killed after it.
    pub timeout: Duration,
    /// Most bytes of compiler log returned to a tenant (the rest is cut, noted).
    pub max_log_bytes: usize,
}

impl Default for CompileSandbox {
    /// No headers, 5 s, 16 KiB of log.
    fn default() -> Self {
        Self {
            include_dirs: Vec::new(),
            timeout: Duration::from_secs(5),
            max_log_bytes: 16 << 10,
        }
    }
}

impl CompileSandbox {
    /// The settings as environment variables for a worker process.
    pub(crate) fn to_env(&self) -> Vec<(&'static str, std::ffi::OsString)> {
        let dirs = std::env::join_paths(&self.include_dirs).unwrap_or_default();
        vec![
            (INCLUDE_ENV, dirs),
            (TIMEOUT_ENV, self.timeout.as_millis().to_string().into()),
            (LOG_ENV, self.max_log_bytes.to_string().into()),
        ]
    }

    /// The settings a worker was started with (defaults where unset).
    pub(crate) fn from_env() -> Self {
        let d = Self::default();
        let num = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        Self {
            include_dirs: std::env::var_os(INCLUDE_ENV)
                .map(|v| {
                    std::env::split_paths(&v)
                        .filter(|p| !p.as_os_str().is_empty())
                        .collect()
                })
                .unwrap_or_default(),
            timeout: num(TIMEOUT_ENV).map_or(d.timeout, Duration::from_millis),
            max_log_bytes: num(LOG_ENV).map_or(d.max_log_bytes, |n| n as usize),
        }
    }
}

/// A worker's compiler: its settings and their headers (listed on first use).
#[derive(Debug, Default)]
pub struct Compiler {
    settings: CompileSandbox,
    headers: OnceLock<BTreeSet<String>>,
    /// The compiler child's program (`None`: this process's own executable).
    program: Option<PathBuf>,
}

impl Compiler {
    /// A compiler with these settings.
    pub fn new(settings: CompileSandbox) -> Self {
        Self {
            settings,
            headers: OnceLock::new(),
            program: None,
        }
    }

    /// Runs `program` as the compiler child instead of this process's own
    /// executable; it must call [`crate::worker::main_if_worker`] first.
    pub fn with_program(mut self, program: PathBuf) -> Self {
        self.program = Some(program);
        self
    }

    /// The header names a source may include: each regular file under the
    /// include directories, by relative path (a symbolic link only if it
    /// resolves inside its directory).
    pub fn headers(&self) -> &BTreeSet<String> {
        self.headers
            .get_or_init(|| list_headers(&self.settings.include_dirs))
    }

    /// Checks a module's options and source (layers 1 and 2 of the module docs).
    ///
    /// # Errors
    /// A message naming the refused option or line.
    pub fn check(&self, source: &str, options: &[String]) -> Result<(), String> {
        check_options(options)?;
        check_source(source, self.headers())
    }

    /// Compiles `source` with `options` (already checked) in a confined child,
    /// adding `-I` for the include directories and `--gpu-architecture=<arch>`
    /// unless the options name one.
    ///
    /// # Errors
    /// The compiler's log (bounded), or why the child failed or was killed.
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        options: &[String],
        arch: &str,
    ) -> Result<String, String> {
        let mut opts = options.to_vec();
        if !opts.iter().any(|o| is_arch_option(o)) {
            opts.push(format!("--gpu-architecture={arch}"));
        }
        for d in &self.settings.include_dirs {
            opts.push(format!("-I{}", d.display()));
        }
        let request = ChildRequest {
            name: name.to_owned(),
            source: source.to_owned(),
            options: opts,
            readable: self.settings.include_dirs.clone(),
            probe: Vec::new(),
        };
        let reply = run_child(self.program.as_deref(), &request, &self.settings)?;
        reply
            .result
            .map_err(|log| bound(log, self.settings.max_log_bytes))
    }
}

/// `text` cut to at most `max` bytes, on a character boundary, with a note.
fn bound(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let total = text.len();
    let mut cut = max;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    text.push_str(&format!("\n[log cut: {total} bytes, {max} shown]"));
    text
}

fn list_headers(dirs: &[PathBuf]) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for dir in dirs {
        let Ok(root) = dir.canonicalize() else {
            continue;
        };
        let mut stack = vec![root.clone()];
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in entries.flatten() {
                let path = e.path();
                // Symbolic links count only where they lead inside.
                let Ok(real) = path.canonicalize() else {
                    continue;
                };
                if !real.starts_with(&root) {
                    continue;
                }
                if real.is_dir() {
                    // Links to directories are not followed (no loops).
                    if !path.is_symlink() {
                        stack.push(path);
                    }
                } else if real.is_file() {
                    if let Some(rel) = path.strip_prefix(&root).ok().and_then(|r| r.to_str()) {
                        found.insert(rel.to_owned());
                    }
                }
            }
        }
    }
    found
}

fn is_arch_option(o: &str) -> bool {
    o.starts_with("--gpu-architecture") || o.starts_with("-arch")
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn headers_are_the_files_under_the_include_dirs_and_links_stay_inside() {
        let dir = std::env::temp_dir().join(format!("cuda-lease-hdr-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("a.h"), "").unwrap();
        std::fs::write(dir.join("sub/b.h"), "").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("passwd")).unwrap();
        std::os::unix::fs::symlink(dir.join("a.h"), dir.join("alias.h")).unwrap();
        let c = Compiler::new(CompileSandbox {
            include_dirs: vec![dir.clone()],
            ..CompileSandbox::default()
        });
        let found: Vec<&str> = c.headers().iter().map(String::as_str).collect();
        assert_eq!(found, ["a.h", "alias.h", "sub/b.h"]);
        assert!(c.check("#include \"sub/b.h\"\n", &[]).is_ok());
        assert!(c.check("#include \"passwd\"\n", &[]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn logs_are_bounded_on_a_character_boundary() {
        let log = "é".repeat(100);
        let b = bound(log, 11);
        assert!(
            b.starts_with("ééééé\n[log cut: 200 bytes, 11 shown]"),
            "{b}"
        );
        assert_eq!(bound("short".into(), 11), "short");
    }
}
