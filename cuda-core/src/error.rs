//! The one error type of `cuda-core` (and of `cuda-async`, which re-exports it).

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{sys::CUresult, DriverError};

use crate::RemoteFailure;

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `cuda-core` and `cuda-async`.
///
/// Driver failures name the call that failed, so a message reads
/// `cuMemAllocAsync failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
/// The type is `Clone` (a shared op hands the same error to every consumer).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Error {
    /// `libcuda` could not be loaded: no NVIDIA driver on this machine.
    NoDriver,
    /// `libnvrtc` could not be loaded: CUDA C cannot be compiled at run time.
    NoNvrtc,
    /// The driver reports fewer devices than the ordinal asked for.
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    Driver {
        /// The driver entry point that failed (e.g. `cuLaunchKernel`).
        call: &'static str,
        /// The driver's status code.
        code: DriverError,
    },
    /// A CUDA context hit a sticky error earlier (an illegal address, say):
    /// CUDA state of the whole process is unusable from then on.
    Poisoned {
        /// The sticky error first seen.
        code: DriverError,
    },
    /// NVRTC rejected a CUDA C source (or the driver's JIT rejected PTX);
    /// `log` is the compiler's log.
    Compile {
        /// The module's name ([`Module::name`](crate::Module::name)), also
        /// the program name given to NVRTC, so the log's lines name it.
        program: String,
        /// NVRTC's log, verbatim.
        log: String,
    },
    /// A module does not contain the named kernel.
    KernelNotFound {
        /// The kernel name asked for.
        name: String,
        /// The module's name ([`Module::name`](crate::Module::name)).
        module: String,
        /// The kernels the module does have (sorted; empty if not known
        /// without compiling it).
        entries: Vec<String>,
    },
    /// Kernel arguments do not match the kernel's parameter list.
    ArgumentMismatch {
        /// The kernel launched.
        kernel: String,
        /// What does not match.
        detail: String,
    },
    /// A caller-supplied value is out of range (lengths, sizes, strings).
    InvalidArgument(String),
    /// A shared op panicked while it was first executed; its result is gone.
    SharedPoisoned,
    /// A CUDA graph capture failed: the work cannot be captured (a
    /// synchronize, a pageable copy, a host read...), or the stream was
    /// already capturing. The capture has ended; the stream is usable.
    Capture(String),
    /// Any other error, boxed.
    Other(Arc<dyn std::error::Error + Send + Sync>),
    /// Work run on another machine's GPU failed. The [`RemoteFailure`]
    /// carries the backend's own error as it was; the backend's crate reads
    /// it back by type (`cuda-async`'s `RemoteErrorExt`).
    Remote(RemoteFailure),
    /// An op needs a local CUDA stream (a hand-written op calling
    /// `cuda_stream()`, interop) but runs on a remote context.
    NeedsLocalStream {
        /// What needed the stream.
        op: String,
        /// Where the op runs (the remote context).
        context: String,
    },
    /// A buffer is used where it does not live: a local buffer in a remote
    /// op, a remote buffer in a local op, or a buffer of another remote GPU.
    WrongHome {
        /// Where the buffer lives.
        buffer: String,
        /// Where the op runs.
        context: String,
    },
    /// A wait with a time bound (`sync_timeout`) ran out: the work goes
    /// on, and the memory it uses stays allocated until it ends.
    Timeout {
        /// How long the caller waited.
        waited: std::time::Duration,
    },
    /// Peer access between two devices could not be enabled
    /// ([`enable_peer_access`](crate::enable_peer_access), or a peer copy
    /// enabling it by itself): the driver refused the named call.
    PeerAccess {
        /// The driver entry point that failed (`cuCtxEnablePeerAccess`,
        /// `cuMemPoolSetAccess`, ...).
        call: &'static str,
        /// The device given access.
        from: usize,
        /// The device whose memory it was to reach.
        to: usize,
        /// The driver's status code.
        code: DriverError,
    },
    /// A CUDA library (cuBLAS, say) could not be loaded: it is not
    /// installed where the dynamic loader looks.
    NoLibrary {
        /// The library (`cuBLAS (libcublas)`).
        library: &'static str,
    },
    /// A CUDA library call returned an error status.
    Library {
        /// The library call (`cublasSgemm_v2`).
        call: &'static str,
        /// The library's status, by name.
        status: String,
    },
    /// A host step's closure (`host_step`, `host_step_with`) panicked; the
    /// stream went on after it.
    HostStep {
        /// The op.
        op: &'static str,
        /// The panic's message.
        message: String,
    },
}

impl Error {
    /// The remote failure this is, if it is one.
    pub fn remote_failure(&self) -> Option<&RemoteFailure> {
        match self {
            Error::Remote(e) => Some(e),
            _ => None,
        }
    }

    /// Wraps a driver error with the name of the call that produced it.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_core::Error;
    /// use cudarc::driver::{sys::CUresult, DriverError};
    /// let e = Error::driver("cuMemAlloc", DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    /// assert!(e.to_string().starts_with("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"));
    /// ```
    pub fn driver(call: &'static str, code: DriverError) -> Self {
        if is_sticky(code.0) {
            Error::Poisoned { code }
        } else {
            Error::Driver { call, code }
        }
    }

    /// A failure to give device `from` access to device `to`'s memory
    /// (a sticky code is [`Error::Poisoned`], as with [`Error::driver`]).
    pub fn peer_access(call: &'static str, from: usize, to: usize, code: DriverError) -> Self {
        if is_sticky(code.0) {
            Error::Poisoned { code }
        } else {
            Error::PeerAccess {
                call,
                from,
                to,
                code,
            }
        }
    }

    /// Whether this error leaves the process's CUDA state unusable: every
    /// later CUDA call of this process fails, so a service should restart
    /// the process (a fault on another machine's GPU is an
    /// [`Error::Remote`] instead: it does not touch this process).
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_core::Error;
    /// use cudarc::driver::{sys::CUresult, DriverError};
    /// let fault = Error::driver("cuStreamSynchronize", DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
    /// assert!(fault.is_sticky() && !fault.is_retryable());
    /// ```
    pub fn is_sticky(&self) -> bool {
        matches!(self, Error::Poisoned { .. })
    }

    /// Whether the same op may succeed if run again later, unchanged, in
    /// this process: out of device memory, or a remote failure its backend
    /// calls retryable ([`RemoteFailure::is_retryable`]: a lost connection,
    /// say). Everything else needs a change first: a fix to the call
    /// (arguments, kernels, modules), an install (driver, NVRTC), or a new
    /// process ([`Error::is_sticky`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_core::Error;
    /// use cudarc::driver::{sys::CUresult, DriverError};
    /// let oom = Error::driver("cuMemAllocAsync", DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    /// assert!(oom.is_retryable() && !oom.is_sticky());
    /// assert!(!Error::InvalidArgument("length 3, expected 4".into()).is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Remote(e) => e.is_retryable(),
            _ => self.is_out_of_memory(),
        }
    }

    /// Whether this is the driver running out of device memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.driver_code() == Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// The driver status code, if this is a driver error (or a refused
    /// peer access).
    pub fn driver_code(&self) -> Option<CUresult> {
        match self {
            Error::Driver { code, .. }
            | Error::PeerAccess { code, .. }
            | Error::Poisoned { code } => Some(code.0),
            _ => None,
        }
    }
}

/// Whether a driver status is one of the sticky errors that corrupt the
/// context (and, measured on H100/H200 with driver 580, the whole process).
pub fn is_sticky(code: CUresult) -> bool {
    use CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
            | CUDA_ERROR_LAUNCH_TIMEOUT
    )
}

/// `CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)`.
fn describe(code: &DriverError) -> String {
    let name = format!("{:?}", code.0);
    // `error_string` calls into the driver, which cudarc would panic to load
    // on a machine without one (errors are also built in CPU-only tests).
    if !crate::device::driver_present() {
        return name;
    }
    match code.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDriver => write!(
                f,
                "no NVIDIA driver found: libcuda could not be loaded (install the NVIDIA driver, \
                 or run on a machine with an NVIDIA GPU)"
            ),
            Error::NoNvrtc => write!(
                f,
                "NVRTC not found: libnvrtc could not be loaded (install the CUDA toolkit's NVRTC \
                 library, or load PTX instead of CUDA C)"
            ),
            Error::NoSuchDevice { ordinal, count } => {
                write!(
                    f,
                    "no CUDA device {ordinal}: the driver reports {count} device(s) (use an \
                     ordinal below {count}; `nvidia-smi -L` lists them)"
                )
            }
            Error::Driver { call, code } => {
                write!(f, "{call} failed: {}", describe(code))?;
                if code.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    write!(f, " (free device buffers, or retry when other work has)")?;
                }
                Ok(())
            }
            Error::Poisoned { code } => write!(
                f,
                "CUDA state is poisoned by a sticky error ({}); every later CUDA call in this \
                 process fails, restart the process",
                describe(code)
            ),
            Error::Compile { program, log } => {
                write!(f, "module `{program}` failed to compile:\n{log}")
            }
            Error::KernelNotFound {
                name,
                module,
                entries,
            } => {
                write!(f, "kernel `{name}` is not in module `{module}`")?;
                if entries.is_empty() {
                    Ok(())
                } else {
                    write!(f, "; its kernels are: {}", entries.join(", "))
                }
            }
            Error::ArgumentMismatch { kernel, detail } => write!(
                f,
                "arguments do not match kernel `{kernel}`: {detail} (pass what its PTX \
                 parameter list declares)"
            ),
            Error::InvalidArgument(what) => write!(f, "invalid argument: {what}"),
            Error::NoLibrary { library } => write!(
                f,
                "{library} not found: it could not be loaded (install the CUDA toolkit's \
                 library, or add its folder to LD_LIBRARY_PATH)"
            ),
            Error::Library { call, status } => write!(
                f,
                "{call} failed: {status} (check the call's sizes and leading dimensions)"
            ),
            Error::Capture(what) => write!(
                f,
                "graph capture failed: {what} (capture only stream-ordered work: kernels, \
                 async copies between device and pinned memory, memsets, events)"
            ),
            Error::Remote(e) => write!(f, "{e}"),
            Error::NeedsLocalStream { op, context } => write!(
                f,
                "{op} needs a local CUDA stream, but runs on {context} (run it with a local \
                 policy, or build it from the crate's ops)"
            ),
            Error::WrongHome { buffer, context } => write!(
                f,
                "a buffer of {buffer} is used by an op that runs on {context} (run the op \
                 where the buffer lives, or move the data with d2h and h2d)"
            ),
            Error::Timeout { waited } => write!(
                f,
                "the GPU work did not finish within {waited:?}; it goes on, and what it uses \
                 stays allocated until it ends (wait longer, or check the work's size)"
            ),
            Error::PeerAccess {
                call,
                from,
                to,
                code,
            } => write!(
                f,
                "peer access from GPU {from} to GPU {to} could not be enabled: {call} failed: \
                 {} (copies between them still work, staged by the driver: call \
                 `set_auto_peer_access(false)` to stop trying)",
                describe(code)
            ),
            Error::HostStep { op, message } => write!(
                f,
                "the closure of a {op} panicked: {message} (the stream went on after it: fix \
                 the closure; what it was to write may be missing)"
            ),
            Error::SharedPoisoned => {
                write!(
                    f,
                    "a shared op panicked when it first ran; its result is unavailable \
                     (build the op again)"
                )
            }
            Error::Other(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Driver { code, .. } | Error::Poisoned { code } => Some(code),
            Error::Other(e) => Some(&**e),
            Error::Remote(e) => Some(e.cause()),
            _ => None,
        }
    }
}

/// Adds `.call("cuFoo")` to driver results: names the failing call.
pub(crate) trait DriverResultExt<T> {
    fn call(self, call: &'static str) -> Result<T>;
}

impl<T> DriverResultExt<T> for std::result::Result<T, DriverError> {
    #[inline]
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|code| Error::driver(call, code))
    }
}

/// Turns a panic payload into a message.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_name_the_call() {
        let e = Error::driver(
            "cuMemcpyHtoDAsync",
            DriverError(CUresult::CUDA_ERROR_INVALID_VALUE),
        );
        let s = e.to_string();
        assert!(
            s.starts_with("cuMemcpyHtoDAsync failed: CUDA_ERROR_INVALID_VALUE"),
            "{s}"
        );
        assert!(!e.is_sticky());
        assert!(!e.is_retryable());
    }

    #[test]
    fn a_compile_errors_message_carries_the_compilers_log_verbatim() {
        let log = "kernels.cu(3): error: identifier \"undefined_thing\" is undefined\n\
                   1 error detected in the compilation of \"kernels.cu\".";
        let e = Error::Compile {
            program: "kernels.cu".into(),
            log: log.into(),
        };
        let s = e.to_string();
        assert!(s.contains("kernels.cu"), "{s}");
        assert!(s.contains(log), "the log is not in the message: {s}");
    }

    #[test]
    fn sticky_codes_become_poisoned() {
        let e = Error::driver(
            "cuStreamSynchronize",
            DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
        );
        assert!(e.is_sticky());
        assert!(e.to_string().contains("poisoned"), "{e}");
        assert_eq!(e.driver_code(), Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
    }

    #[test]
    fn every_error_says_what_to_do_and_whether_to_retry() {
        let s = |v: &str| v.to_string();
        #[derive(Debug)]
        struct Far(&'static str);
        impl fmt::Display for Far {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Far {}
        let remote = |words, retry| Error::Remote(RemoteFailure::new(Far(words), retry));
        let oom = Error::driver(
            "cuMemAllocAsync",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        // (error, a phrase of its advice, retryable)
        let cases = [
            (Error::NoDriver, "install the NVIDIA driver", false),
            (Error::NoNvrtc, "NVRTC", false),
            (
                Error::NoSuchDevice {
                    ordinal: 3,
                    count: 1,
                },
                "ordinal below 1",
                false,
            ),
            (oom, "free device buffers", true),
            (
                Error::ArgumentMismatch {
                    kernel: s("axpy"),
                    detail: s("argument 2 is 4 bytes, the kernel's is 8"),
                },
                "argument 2",
                false,
            ),
            (remote("gone: start over", false), "start over", false),
            (remote("lost: reconnect", true), "reconnect", true),
            (
                Error::NeedsLocalStream {
                    op: s("interop"),
                    context: s("remote stream 0"),
                },
                "local policy",
                false,
            ),
            (
                Error::WrongHome {
                    buffer: s("local GPU 0"),
                    context: s("remote stream 0"),
                },
                "move the data",
                false,
            ),
            (Error::SharedPoisoned, "build the op again", false),
            (
                Error::Timeout {
                    waited: std::time::Duration::from_millis(5),
                },
                "wait longer",
                false,
            ),
            (
                Error::HostStep {
                    op: "host_step",
                    message: s("boom"),
                },
                "fix the closure",
                false,
            ),
            (
                Error::peer_access(
                    "cuCtxEnablePeerAccess",
                    0,
                    1,
                    DriverError(CUresult::CUDA_ERROR_TOO_MANY_PEERS),
                ),
                "GPU 0 to GPU 1",
                false,
            ),
            (
                Error::Capture(s("cuStreamSynchronize")),
                "capture only",
                false,
            ),
        ];
        for (e, advice, retry) in cases {
            let m = e.to_string();
            assert!(m.contains(advice), "{m:?} lacks {advice:?}");
            assert_eq!(e.is_retryable(), retry, "{m}");
            assert!(!e.is_sticky(), "{m}");
        }
    }

    #[test]
    fn no_driver_message_is_clear() {
        assert!(Error::NoDriver
            .to_string()
            .starts_with("no NVIDIA driver found"));
    }
}
