//! The compiler child: layer 3 of the module docs.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{
    is_arch_option, CompileSandbox, COMPILER_ENV, KEPT_ENV, MAX_PTX_BYTES, SANITIZER_ENV_PREFIXES,
};

/// What the worker asks its compiler child for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChildRequest {
    pub(super) name: String,
    /// Empty: only confine and probe (the tests' use).
    pub(super) source: String,
    pub(super) options: Vec<String>,
    /// Directories the confined child may still read.
    pub(super) readable: Vec<PathBuf>,
    /// Paths to try to open once confined (the tests' use).
    pub(super) probe: Vec<PathBuf>,
}

/// The child's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChildReply {
    /// How the child was confined.
    pub(super) confinement: Confinement,
    /// For each probe path: whether it opened.
    pub(super) probed: Vec<bool>,
    /// PTX, or the compiler's log.
    pub(super) result: Result<String, String>,
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
pub(super) fn run_child(
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
    for (k, v) in std::env::vars_os() {
        let name = k.to_string_lossy();
        if SANITIZER_ENV_PREFIXES.iter().any(|p| name.starts_with(p)) {
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
/// When it cannot start, is killed, writes more than `max_out` bytes, or
/// exits with a failure.
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

/// Checks what a confined compiler child can open: runs `program` (which
/// must call [`crate::worker::main_if_worker`] first) with no source and
/// `readable` allowed, tries to open each `probe` path, and returns its
/// confinement and, per path, whether it opened.
///
/// # Errors
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

/// The compiler child's `main`, entered when [`COMPILER_ENV`] is set: reads
/// a request from stdin, loads NVRTC, confines itself, compiles, writes the
/// answer to stdout; returns the exit code.
pub(crate) fn child_main() -> i32 {
    let mut input = Vec::new();
    if std::io::stdin().read_to_end(&mut input).is_err() {
        return 2;
    }
    let Ok(req) = postcard::from_bytes::<ChildRequest>(&input) else {
        return 2;
    };
    limit_resources();
    // A first compile loads NVRTC and its built-ins while the library
    // directories are still readable.
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

pub(super) fn write_reply(reply: &ChildReply) -> i32 {
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
pub(super) fn limit_resources() {
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
pub(super) fn confine(readable: &[PathBuf]) -> Result<Confinement, String> {
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
        return Err(os_error("landlock_create_ruleset"));
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
        // SAFETY: `rule` is a valid path-beneath attribute; both descriptors
        // stay open for the call.
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
            return Err(os_error(format_args!(
                "landlock_add_rule({})",
                dir.display()
            )));
        }
    }
    // SAFETY: PR_SET_NO_NEW_PRIVS takes plain integers.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(os_error("no_new_privs"));
    }
    // SAFETY: the ruleset descriptor is open for the duration of the call.
    let r = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0u32) };
    if r < 0 {
        return Err(os_error("landlock_restrict_self"));
    }
    Ok(Confinement::Landlock(abi))
}

/// `what` failed: the OS's error for the last call.
fn os_error(what: impl std::fmt::Display) -> String {
    let e = std::io::Error::last_os_error();
    format!("{what}: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;
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
