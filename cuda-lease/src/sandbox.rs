//! Tenants' CUDA C, compiled without reaching the node's files.
//!
//! A tenant's module is source text and NVRTC options. NVRTC is a C++
//! compiler: left alone it opens any file a source names (`#include
//! "/etc/passwd"`, `/proc/self/environ`) and quotes it in the log that goes
//! back to the tenant. Three layers keep it to what the node offers:
//!
//! 1. **Options are allow-listed** ([`check_options`]): architecture,
//!    optimization and code-generation switches, the language standard,
//!    macro definitions. No include path, pre-include, response file or
//!    output file option reaches the compiler; the node adds `-I` for the
//!    CUDA header directories it offers ([`CompileSandbox::include_dirs`]).
//! 2. **Includes are checked before compiling** ([`check_source`]): the
//!    only way a source may name a file is a plain `#include <name>` or
//!    `#include "name"` line whose name is a header found under those
//!    directories (no absolute path, no `..`, no symbolic link leading
//!    out). Any other appearance of `include`, `include_next`, `import`,
//!    `embed`, `__has_include`, a `#line` directive or a line marker, in
//!    any spelling (line splices, trigraphs, digraphs), refuses the module
//!    with a message naming the line.
//! 3. **The compiler runs in a confined child process** ([`Compiler::compile`]): the
//!    worker re-executes its own program with [`COMPILER_ENV`] set, an
//!    empty environment (only the library search variables pass) and no
//!    arguments. The child loads NVRTC, then forbids itself every file
//!    access but reading the header directories (Landlock, where the kernel
//!    has it, with `no_new_privs`), then compiles. The worker kills it after
//!    [`CompileSandbox::timeout`] and keeps at most
//!    [`CompileSandbox::max_log_bytes`] of its log.
//!
//! Layers 1 and 2 hold on any kernel and are what the in-memory test device
//! checks too; layer 3 holds even if the source check has a gap.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Environment variable that turns a worker program into the sandboxed
/// compiler (see [`crate::worker::main_if_worker`]).
pub const COMPILER_ENV: &str = "CUDA_LEASE_COMPILER";

/// Environment variables the node passes the sandbox's settings to its
/// workers in.
const INCLUDE_ENV: &str = "CUDA_LEASE_INCLUDE";
const TIMEOUT_ENV: &str = "CUDA_LEASE_COMPILE_TIMEOUT_MS";
const LOG_ENV: &str = "CUDA_LEASE_COMPILE_LOG_BYTES";

/// Variables the compiler child keeps (where to find `libnvrtc`); every
/// other variable of the node is cleared.
const KEPT_ENV: [&str; 5] = [
    "LD_LIBRARY_PATH",
    "CUDA_PATH",
    "CUDA_HOME",
    "CUDA_ROOT",
    "CUDA_TOOLKIT_ROOT_DIR",
];

/// Largest PTX a compile may return.
const MAX_PTX_BYTES: usize = 256 << 20;

/// How the node compiles tenants' CUDA C.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileSandbox {
    /// Directories of headers tenants may include (for example the CUDA
    /// toolkit's `include`): the compiler may read these and nothing else.
    /// Empty: no `#include` compiles.
    pub include_dirs: Vec<PathBuf>,
    /// Longest one compile may take; the compiler is killed after it.
    pub timeout: Duration,
    /// Most bytes of compiler log returned to a tenant (the rest is cut,
    /// with a note saying how much).
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

/// A worker's compiler: the sandbox's settings and the headers found under
/// its directories (listed on first use).
#[derive(Debug, Default)]
pub struct Compiler {
    settings: CompileSandbox,
    headers: OnceLock<BTreeSet<String>>,
    /// The program run as the compiler child (`None`: this process's own
    /// executable, as in a worker).
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
    /// executable; it must call [`crate::worker::main_if_worker`] first
    /// (the `cuda-lease-node` binary does).
    pub fn with_program(mut self, program: PathBuf) -> Self {
        self.program = Some(program);
        self
    }

    /// The settings.
    pub fn settings(&self) -> &CompileSandbox {
        &self.settings
    }

    /// The header names a source may include: every regular file under the
    /// include directories, by its path relative to its directory (a
    /// symbolic link counts only if it resolves inside that directory).
    pub fn headers(&self) -> &BTreeSet<String> {
        self.headers
            .get_or_init(|| list_headers(&self.settings.include_dirs))
    }

    /// Checks a CUDA C module's options and source (layers 1 and 2 of the
    /// module docs).
    ///
    /// # Errors
    ///
    /// A message naming the refused option or line.
    pub fn check(&self, source: &str, options: &[String]) -> Result<(), String> {
        check_options(options)?;
        check_source(source, self.headers())
    }

    /// Compiles `source` with `options` (already checked) in a confined
    /// child process, adding `-I` for the include directories and
    /// `--gpu-architecture=<arch>` unless the options name one.
    ///
    /// # Errors
    ///
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
        reply.result.map_err(|log| self.bound_log(log))
    }

    fn bound_log(&self, log: String) -> String {
        bound(log, self.settings.max_log_bytes)
    }
}

/// `text` cut to at most `max` bytes (on a character boundary) with a note
/// saying how many were cut.
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

/// Checks NVRTC options against the allow-list: architecture
/// (`--gpu-architecture=compute_90`, `-arch=sm_90a`), language standard
/// (`--std=c++17`), macros (`-DNAME`, `-DNAME=value`, `-UNAME` and their
/// long forms), and code generation (`--use_fast_math`, `--ftz=`,
/// `--prec-div=`, `--prec-sqrt=`, `--fmad=`, `--maxrregcount=`,
/// `--device-debug`, `--generate-line-info`, `--dopt=`,
/// `--relocatable-device-code=`, `--extra-device-vectorization`,
/// `--restrict`, `--device-as-default-execution-space`, `--device-int128`,
/// `--disable-warnings`, `--builtin-move-forward=`,
/// `--builtin-initializer-list=`, and the short spellings NVRTC accepts).
///
/// # Errors
///
/// A message naming the first option refused.
pub fn check_options(options: &[String]) -> Result<(), String> {
    for o in options {
        if !option_allowed(o) {
            return Err(format!(
                "NVRTC option {o:?} is not allowed on this node (allowed: architecture, \
                 --std, -D/-U macros, optimization and code-generation switches; the node \
                 sets include paths itself)"
            ));
        }
    }
    Ok(())
}

fn option_allowed(o: &str) -> bool {
    const FLAGS: [&str; 20] = [
        "--use_fast_math",
        "-use_fast_math",
        "--device-debug",
        "-G",
        "--generate-line-info",
        "-lineinfo",
        "--extra-device-vectorization",
        "-extra-device-vectorization",
        "--restrict",
        "-restrict",
        "--device-as-default-execution-space",
        "-default-device",
        "--device-int128",
        "-device-int128",
        "--disable-warnings",
        "-w",
        "--minimal",
        "-minimal",
        "--no-source-include",
        "-no-source-include",
    ];
    const BOOLS: [&str; 14] = [
        "--ftz=",
        "-ftz=",
        "--prec-div=",
        "-prec-div=",
        "--prec-sqrt=",
        "-prec-sqrt=",
        "--fmad=",
        "-fmad=",
        "--relocatable-device-code=",
        "-rdc=",
        "--builtin-move-forward=",
        "-builtin-move-forward=",
        "--builtin-initializer-list=",
        "-builtin-initializer-list=",
    ];
    if o.contains(['\0', '\n', '\r']) {
        return false;
    }
    if FLAGS.contains(&o) {
        return true;
    }
    if let Some(v) = BOOLS.iter().find_map(|p| o.strip_prefix(p)) {
        return v == "true" || v == "false";
    }
    if let Some(v) = ["--dopt=", "-dopt="].iter().find_map(|p| o.strip_prefix(p)) {
        return v == "on" || v == "off";
    }
    if let Some(v) = ["--maxrregcount=", "-maxrregcount="]
        .iter()
        .find_map(|p| o.strip_prefix(p))
    {
        return !v.is_empty() && v.len() <= 4 && v.bytes().all(|b| b.is_ascii_digit());
    }
    if let Some(v) = ["--std=", "-std="].iter().find_map(|p| o.strip_prefix(p)) {
        return ["c++03", "c++11", "c++14", "c++17", "c++20"].contains(&v);
    }
    if let Some(v) = ["--gpu-architecture=", "-arch="]
        .iter()
        .find_map(|p| o.strip_prefix(p))
    {
        let Some(num) = v.strip_prefix("compute_").or_else(|| v.strip_prefix("sm_")) else {
            return false;
        };
        let num = num.strip_suffix(['a', 'f']).unwrap_or(num);
        return (2..=3).contains(&num.len()) && num.bytes().all(|b| b.is_ascii_digit());
    }
    if let Some(def) = ["--define-macro=", "-D"]
        .iter()
        .find_map(|p| o.strip_prefix(p))
    {
        let (name, value) = def.split_once('=').unwrap_or((def, ""));
        return is_identifier(name) && forbidden_word(value).is_none();
    }
    if let Some(name) = ["--undefine-macro=", "-U"]
        .iter()
        .find_map(|p| o.strip_prefix(p))
    {
        return is_identifier(name);
    }
    false
}

fn is_identifier(s: &str) -> bool {
    let mut b = s.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// Words that name files to the preprocessor, wherever they appear.
const FILE_WORDS: [&str; 7] = [
    "include",
    "include_next",
    "import",
    "embed",
    "__has_include",
    "__has_include_next",
    "__has_embed",
];

/// The first identifier of `text` that is one of [`FILE_WORDS`].
fn forbidden_word(text: &str) -> Option<&'static str> {
    identifiers(text).find_map(|w| FILE_WORDS.iter().find(|f| **f == w).copied())
}

fn identifiers(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
}

/// The text as the preprocessor's first phases see it, for checking:
/// trigraphs replaced, `%:` (the digraph of `#`) replaced by `#`, carriage
/// returns taken as line ends, and line splices (a backslash, optional
/// blanks, a line end) joined. Over-approximates: it may turn text inside
/// literals, which only makes the check stricter.
fn normalized(text: &str) -> String {
    let mut s = text.replace("\r\n", "\n").replace('\r', "\n");
    for (tri, c) in [
        ("??=", "#"),
        ("??/", "\\"),
        ("??'", "^"),
        ("??(", "["),
        ("??)", "]"),
        ("??!", "|"),
        ("??<", "{"),
        ("??>", "}"),
        ("??-", "~"),
    ] {
        s = s.replace(tri, c);
    }
    s = s.replace("%:", "#");
    // Line splices: `\`, then blanks, then a line end.
    let mut out = String::with_capacity(s.len());
    let mut rest = s.as_str();
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let blanks = after.len() - after.trim_start_matches([' ', '\t', '\x0b', '\x0c']).len();
        if after[blanks..].starts_with('\n') {
            rest = &after[blanks + 1..];
        } else {
            out.push('\\');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Checks that a CUDA C source names no file but the headers in `headers`.
///
/// Accepted: `#include <name>` and `#include "name"` alone on their line
/// (blanks and a trailing `//` comment allowed), where `name` is in
/// `headers`. Refused: any other occurrence of `include`, `include_next`,
/// `import`, `embed` or `__has_include` (in code, strings or block
/// comments: a comment before `#` can still start a directive), a
/// directive `#line` or a line marker `# 1 "file"` (they rename the file
/// that diagnostics quote), and a NUL byte. A line whose text starts with
/// `//` is a comment and is not checked.
///
/// # Errors
///
/// A message naming the line and what was refused.
pub fn check_source(source: &str, headers: &BTreeSet<String>) -> Result<(), String> {
    if source.contains('\0') {
        return Err("the source contains a NUL byte".into());
    }
    let text = normalized(source);
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        if let Some(name) = include_line(trimmed) {
            if name_allowed(name, headers) {
                continue;
            }
            return Err(format!(
                "line {n}: `#include {name}` is not a header this node offers ({}); \
                 include only the node's CUDA headers, by a relative name",
                if headers.is_empty() {
                    "it offers none".to_string()
                } else {
                    format!(
                        "it offers {} under its CUDA include directories",
                        headers.len()
                    )
                }
            ));
        }
        if let Some(word) = forbidden_word(line) {
            return Err(format!(
                "line {n}: `{word}` may appear only in an `#include <header>` line of its own \
                 (sources cannot name files on the node)"
            ));
        }
        if renames_file(line) {
            return Err(format!(
                "line {n}: `#line` directives and line markers are not allowed"
            ));
        }
    }
    Ok(())
}

/// `name` with its delimiters if `line` is exactly `# include <name>` or
/// `# include "name"` (blanks between, and a trailing `//` comment).
fn include_line(line: &str) -> Option<&str> {
    let rest = line.strip_prefix('#')?.trim_start();
    let rest = rest.strip_prefix("include")?;
    let rest = rest.trim_start();
    let close = match rest.chars().next()? {
        '<' => '>',
        '"' => '"',
        _ => return None,
    };
    let end = rest[1..].find(close)? + 2;
    let (quoted, tail) = rest.split_at(end);
    let tail = tail.trim();
    (tail.is_empty() || tail.starts_with("//")).then_some(quoted)
}

fn name_allowed(quoted: &str, headers: &BTreeSet<String>) -> bool {
    let name = &quoted[1..quoted.len() - 1];
    !name.is_empty()
        && !name.starts_with('/')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.+-/".contains(&b))
        && name.split('/').all(|part| !part.is_empty() && part != "..")
        && headers.contains(name)
}

/// Whether `line` holds `#` followed (after blanks) by `line` or a digit:
/// a `#line` directive or a line marker, wherever on the line it starts.
fn renames_file(line: &str) -> bool {
    line.match_indices('#').any(|(i, _)| {
        let after = line[i + 1..].trim_start();
        after.starts_with(|c: char| c.is_ascii_digit())
            || (after.starts_with("line")
                && !after[4..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_'))
    })
}

/// What the worker asks its compiler child for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChildRequest {
    name: String,
    /// Empty: only confine and probe (the tests' use).
    source: String,
    options: Vec<String>,
    /// Directories the confined child may still read.
    readable: Vec<PathBuf>,
    /// Paths to try to open once confined (the tests' use).
    probe: Vec<PathBuf>,
}

/// The child's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChildReply {
    /// How the child was confined ([`Confinement`]).
    confinement: Confinement,
    /// For each probe path: whether it opened.
    probed: Vec<bool>,
    /// PTX, or the compiler's log.
    result: Result<String, String>,
}

/// How far the compiler child could confine itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Confinement {
    /// Landlock (at this ABI version) forbids every file access but reading
    /// the include directories.
    Landlock(u32),
    /// The kernel has no Landlock: the source and option checks, the empty
    /// environment and the time bound are what hold.
    Unavailable,
}

/// Runs the child with `request`, killing it after the sandbox's timeout.
fn run_child(
    program: Option<&Path>,
    request: &ChildRequest,
    s: &CompileSandbox,
) -> Result<ChildReply, String> {
    let program = match program {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe().map_err(|e| format!("the compiler program: {e}"))?,
    };
    let mut cmd = Command::new(program);
    cmd.env_clear();
    for k in KEPT_ENV {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    cmd.env(COMPILER_ENV, "1")
        .current_dir(
            s.include_dirs
                .first()
                .map_or(Path::new("/"), PathBuf::as_path),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let input = postcard::to_stdvec(request).map_err(|e| e.to_string())?;
    let out = run_bounded(
        cmd,
        &input,
        s.timeout,
        MAX_PTX_BYTES + s.max_log_bytes + 4096,
    )?;
    postcard::from_bytes(&out).map_err(|e| format!("the compiler's answer: {e}"))
}

/// Runs `cmd` with `input` on its stdin and returns its stdout (at most
/// `max_out` bytes), killing it at `timeout`.
///
/// # Errors
///
/// When it cannot start, is killed at the time bound, writes more than
/// `max_out` bytes, or exits with a failure.
pub(crate) fn run_bounded(
    mut cmd: Command,
    input: &[u8],
    timeout: Duration,
    max_out: usize,
) -> Result<Vec<u8>, String> {
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting the compiler: {e}"))?;
    let pid = child.id();
    let (done, watch) = std::sync::mpsc::channel::<()>();
    // The watchdog kills the child at the deadline unless told it is done;
    // the child is reaped only after the watchdog ended, so its pid cannot
    // have been reused when the watchdog kills it.
    let watchdog = std::thread::spawn(move || {
        if watch.recv_timeout(timeout) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            // SAFETY: `pid` is our child, not yet reaped (see above); a
            // signal has no memory-safety effect on this process.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            true
        } else {
            false
        }
    });
    let mut stdin = child.stdin.take();
    let mut stdout = child.stdout.take();
    // The child reads its whole request before it writes: write, then read.
    let wrote = stdin.as_mut().map(|s| s.write_all(input));
    drop(stdin);
    let mut out = Vec::new();
    let read = stdout
        .as_mut()
        .map(|s| s.take(max_out as u64 + 1).read_to_end(&mut out));
    drop(stdout);
    let _ = done.send(());
    let killed = watchdog.join().unwrap_or(true);
    if out.len() > max_out && !killed {
        // SAFETY: as in the watchdog: our child, not yet reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if killed {
        return Err(format!(
            "the compile did not finish within {:?} and was stopped (the node's compile time \
             limit)",
            timeout
        ));
    }
    if out.len() > max_out {
        return Err(format!("the compiler wrote more than {max_out} bytes"));
    }
    if let Some(Err(e)) = read {
        return Err(format!("reading the compiler: {e}"));
    }
    if !status.success() {
        let why = match wrote {
            Some(Err(e)) => format!(" (writing its input: {e})"),
            _ => String::new(),
        };
        return Err(format!(
            "the compiler process failed ({status}) after {:?}{why}",
            started.elapsed()
        ));
    }
    Ok(out)
}

/// Checks that a confined compiler child can open only what it should:
/// runs `program` (which must call [`crate::worker::main_if_worker`]
/// first, as the node binary does) as a child with no source, `readable`
/// directories allowed, tries to open each `probe` path, and returns its
/// confinement and, per path, whether it opened.
///
/// # Errors
///
/// When the child cannot run.
pub fn probe(
    program: &Path,
    readable: &[PathBuf],
    probe: &[PathBuf],
) -> Result<(Confinement, Vec<bool>), String> {
    let request = ChildRequest {
        name: "probe".into(),
        source: String::new(),
        options: Vec::new(),
        readable: readable.to_vec(),
        probe: probe.to_vec(),
    };
    let reply = run_child(Some(program), &request, &CompileSandbox::default())?;
    Ok((reply.confinement, reply.probed))
}

/// The compiler child's `main` (entered by [`crate::worker::main_if_worker`]
/// when [`COMPILER_ENV`] is set): reads a request from stdin, loads NVRTC,
/// confines itself, compiles, writes the answer to stdout. Returns the exit
/// code.
pub(crate) fn child_main() -> i32 {
    let mut input = Vec::new();
    if std::io::stdin().read_to_end(&mut input).is_err() {
        return 2;
    }
    let Ok(req) = postcard::from_bytes::<ChildRequest>(&input) else {
        return 2;
    };
    limit_resources();
    // NVRTC and its built-ins are loaded by a first compile, before the
    // process loses access to the library directories.
    if !req.source.is_empty() {
        let arch: Vec<String> = req
            .options
            .iter()
            .filter(|o| is_arch_option(o))
            .cloned()
            .collect();
        let _ = cuda_core::compile_ptx("warm-up", "extern \"C\" __global__ void k() {}", &arch);
    }
    let confinement = match confine(&req.readable) {
        Ok(c) => c,
        Err(e) => {
            // Landlock exists but could not be applied: do not compile.
            let reply = ChildReply {
                confinement: Confinement::Unavailable,
                probed: Vec::new(),
                result: Err(format!("the compiler could not be confined: {e}")),
            };
            return write_reply(&reply);
        }
    };
    let probed = req
        .probe
        .iter()
        .map(|p| std::fs::File::open(p).is_ok())
        .collect();
    let result = if req.source.is_empty() {
        Ok(String::new())
    } else {
        cuda_core::compile_ptx(&req.name, &req.source, &req.options).map_err(|e| match e {
            cuda_core::Error::Compile { log, .. } => log,
            other => other.to_string(),
        })
    };
    write_reply(&ChildReply {
        confinement,
        probed,
        result,
    })
}

fn write_reply(reply: &ChildReply) -> i32 {
    let Ok(bytes) = postcard::to_stdvec(reply) else {
        return 2;
    };
    let mut out = std::io::stdout().lock();
    if out.write_all(&bytes).and_then(|()| out.flush()).is_err() {
        return 2;
    }
    0
}

/// No core files, no files written, and a CPU-time backstop behind the
/// worker's watchdog.
fn limit_resources() {
    let set = |resource, value: libc::rlim_t| {
        let lim = libc::rlimit {
            rlim_cur: value,
            rlim_max: value,
        };
        // SAFETY: `lim` is a valid rlimit for the duration of the call.
        unsafe { libc::setrlimit(resource, &lim) };
    };
    set(libc::RLIMIT_CORE, 0);
    set(libc::RLIMIT_FSIZE, 0);
    set(libc::RLIMIT_CPU, 600);
}

/// Landlock's ABI, as `linux/landlock.h` declares it.
mod landlock {
    pub(super) const CREATE_RULESET_VERSION: u32 = 1;
    pub(super) const RULE_PATH_BENEATH: libc::c_int = 1;
    pub(super) const ACCESS_FS_READ_FILE: u64 = 1 << 2;
    pub(super) const ACCESS_FS_READ_DIR: u64 = 1 << 3;

    #[repr(C)]
    pub(super) struct RulesetAttr {
        pub(super) handled_access_fs: u64,
    }

    #[repr(C, packed)]
    pub(super) struct PathBeneathAttr {
        pub(super) allowed_access: u64,
        pub(super) parent_fd: i32,
    }

    /// Every file-system access right the kernel's ABI version knows.
    pub(super) fn all_fs_access(abi: u32) -> u64 {
        match abi {
            1 => (1 << 13) - 1,
            2 => (1 << 14) - 1,
            3 | 4 => (1 << 15) - 1,
            _ => (1 << 16) - 1,
        }
    }
}

/// The kernel's Landlock ABI version, if it has Landlock enabled.
pub fn landlock_abi() -> Option<u32> {
    // SAFETY: with a null attribute and size 0, this call only returns
    // the ABI version (or an error); it reads no memory.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<landlock::RulesetAttr>(),
            0usize,
            landlock::CREATE_RULESET_VERSION,
        )
    };
    u32::try_from(v).ok().filter(|v| *v > 0)
}

/// Forbids this process every file access but reading under `readable`.
fn confine(readable: &[PathBuf]) -> Result<Confinement, String> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    let Some(abi) = landlock_abi() else {
        return Ok(Confinement::Unavailable);
    };
    let attr = landlock::RulesetAttr {
        handled_access_fs: landlock::all_fs_access(abi),
    };
    // SAFETY: `attr` is a valid ruleset attribute of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const landlock::RulesetAttr,
            std::mem::size_of::<landlock::RulesetAttr>(),
            0u32,
        )
    };
    if fd < 0 {
        return Err(format!(
            "landlock_create_ruleset: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: the call returned a new descriptor that nothing else owns.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    for dir in readable {
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
            continue;
        };
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        let dfd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if dfd < 0 {
            // A missing directory simply grants nothing.
            continue;
        }
        // SAFETY: `open` returned a new descriptor that nothing else owns.
        let dfd = unsafe { OwnedFd::from_raw_fd(dfd) };
        let rule = landlock::PathBeneathAttr {
            allowed_access: landlock::ACCESS_FS_READ_FILE | landlock::ACCESS_FS_READ_DIR,
            parent_fd: dfd.as_raw_fd(),
        };
        // SAFETY: `rule` is a valid path-beneath attribute and both
        // descriptors are open for the duration of the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset.as_raw_fd(),
                landlock::RULE_PATH_BENEATH,
                &rule as *const landlock::PathBeneathAttr,
                0u32,
            )
        };
        if r < 0 {
            return Err(format!(
                "landlock_add_rule({}): {}",
                dir.display(),
                std::io::Error::last_os_error()
            ));
        }
    }
    // SAFETY: PR_SET_NO_NEW_PRIVS takes plain integers.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(format!("no_new_privs: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the ruleset descriptor is open for the duration of the call.
    let r = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0u32) };
    if r < 0 {
        return Err(format!(
            "landlock_restrict_self: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(Confinement::Landlock(abi))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> BTreeSet<String> {
        ["cuda_fp16.h", "cuda/std/cstdint"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    #[test]
    fn options_are_allow_listed() {
        let ok = [
            "--gpu-architecture=compute_90",
            "-arch=sm_90a",
            "--std=c++17",
            "-DN=4",
            "-DFAST",
            "--define-macro=T=float",
            "-UX",
            "--use_fast_math",
            "--ftz=true",
            "--maxrregcount=64",
            "-lineinfo",
            "--dopt=on",
        ];
        for o in ok {
            assert!(check_options(&[o.to_string()]).is_ok(), "{o}");
        }
        let refused = [
            "-I/",
            "--include-path=/etc",
            "--pre-include=/etc/passwd",
            "-include",
            "/etc/passwd",
            "@/etc/options",
            "--options-file=/etc/x",
            "--time=/tmp/t.csv",
            "--fdevice-time-trace=/tmp/x",
            "-arch=compute_90;x",
            "--gpu-architecture=../x",
            "--std=gnu++17",
            "-DX=__has_include(\"/etc/passwd\")",
            "-DP=include",
            "-D/etc=1",
            "--ftz=maybe",
            "--maxrregcount=",
            "-Xptxas",
            "--ptxas-options=-v",
            "-DX\n#include </etc/passwd>",
        ];
        for o in refused {
            let e = check_options(&[o.to_string()]).unwrap_err();
            assert!(e.contains("not allowed"), "{o}: {e}");
        }
    }

    #[test]
    fn includes_of_the_nodes_headers_pass() {
        let src = "#include <cuda_fp16.h>\n  #  include \"cuda/std/cstdint\" // ints\n\
                   // a comment may say include\n\
                   extern \"C\" __global__ void k(int* x) { x[0] = 1; }\n";
        check_source(src, &headers()).unwrap();
    }

    #[test]
    fn every_route_to_a_file_is_refused() {
        let attacks = [
            "#include \"/etc/passwd\"",
            "#include </etc/passwd>",
            "#include \"../../etc/passwd\"",
            "#include <cuda/../../../etc/passwd>",
            "#include \"passwd\"",
            "#include </proc/self/environ>",
            "#include </dev/zero>",
            "#include_next <cuda_fp16.h>",
            "#import \"/etc/passwd\"",
            "#embed \"/etc/passwd\"",
            "#define F \"/etc/passwd\"\n#include F",
            "#if __has_include(\"/etc/shadow\")\n#endif",
            "/* a comment */ #include \"/etc/passwd\"",
            "/* start\nend */ #include \"/etc/passwd\"",
            "#inc\\\nlude \"/etc/passwd\"",
            "#inc\\  \nlude \"/etc/passwd\"",
            "??=include \"/etc/passwd\"",
            "%:include \"/etc/passwd\"",
            "#include <cuda_fp16.h> /* x */ #include \"/etc/passwd\"",
            "#include <cuda_fp16.h> \"/etc/passwd\"",
            "#line 1 \"/etc/passwd\"",
            "# 1 \"/etc/passwd\"",
            "/**/ #line 1 \"/etc/passwd\"",
            "#  line 7",
            "_Pragma(\"x\") include",
            "#include",
            "#include <>",
            "#include <a//b>",
            "x\0y",
        ];
        for a in attacks {
            let src = format!("{a}\nextern \"C\" __global__ void k() {{}}\n");
            assert!(check_source(&src, &headers()).is_err(), "accepted: {a:?}");
        }
    }

    #[test]
    fn refusals_name_the_line_and_never_quote_a_file() {
        let e = check_source("int a;\n#include \"/etc/passwd\"\n", &headers()).unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
        let e = check_source("int a;\n#include \"/etc/passwd\"\n", &BTreeSet::new()).unwrap_err();
        assert!(e.contains("it offers none"), "{e}");
        assert!(!e.contains("root:"), "{e}");
    }

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

    #[test]
    fn a_process_past_its_time_bound_is_killed() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30").stdin(Stdio::piped()).stdout(Stdio::piped());
        let t = Instant::now();
        let e = run_bounded(cmd, b"", Duration::from_millis(200), 1024).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(e.contains("did not finish within 200ms"), "{e}");
    }

    #[test]
    fn output_past_its_bound_is_refused() {
        let mut cmd = Command::new("head");
        cmd.args(["-c", "100000", "/dev/zero"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let e = run_bounded(cmd, b"", Duration::from_secs(10), 1000).unwrap_err();
        assert!(e.contains("more than 1000 bytes"), "{e}");
    }
}
