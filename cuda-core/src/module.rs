//! Modules (PTX text, or CUDA C compiled by NVRTC and cached) and kernels
//! with the parameter list read from the PTX, so launches can be checked.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::device::Device;
use crate::error::{Error, Result};

/// How a kernel parameter's bits are interpreted, as declared in PTX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamClass {
    /// `.u*`, `.s*` (integers and pointers).
    Int,
    /// `.f*`.
    Float,
    /// `.b*` (untyped bits, also structs passed by value).
    Bits,
}

/// One kernel parameter: its byte size and class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    /// Size in bytes.
    pub size: usize,
    /// How PTX declares its bits.
    pub class: ParamClass,
}

impl ParamSpec {
    /// Whether an argument of `size` bytes and class `class` may be passed
    /// for this parameter: sizes must be equal; integers and floats must not
    /// be mixed (`.b*` accepts either).
    pub fn accepts(&self, size: usize, class: ParamClass) -> bool {
        self.size == size
            && (self.class == class || self.class == ParamClass::Bits || class == ParamClass::Bits)
    }
}

impl fmt::Display for ParamSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = match self.class {
            ParamClass::Int => "int",
            ParamClass::Float => "float",
            ParamClass::Bits => "bits",
        };
        write!(f, "{c}{}", self.size * 8)
    }
}

/// Parses the `.entry` parameter lists of a PTX module.
///
/// Returns kernel name -> parameters. Unknown syntax yields no entry for
/// that kernel (launches of it are then unchecked for types, see
/// [`Kernel::params`]).
///
/// # Examples
///
/// ```
/// let ptx = ".visible .entry axpy(\n .param .f32 axpy_param_0,\n .param .u64 axpy_param_1\n)\n{ ret; }";
/// let entries = cuda_core::parse_ptx_entries(ptx);
/// let p = &entries["axpy"];
/// assert_eq!(p.len(), 2);
/// assert_eq!((p[0].size, p[1].size), (4, 8));
/// ```
pub fn parse_ptx_entries(ptx: &str) -> HashMap<String, Vec<ParamSpec>> {
    let mut out = HashMap::new();
    let mut rest = ptx;
    while let Some(pos) = rest.find(".entry") {
        rest = &rest[pos + ".entry".len()..];
        let Some(open) = rest.find('(') else { break };
        let name = rest[..open].trim().to_string();
        let body_start = open + 1;
        // A kernel with no parameters may omit the parentheses entirely;
        // then the next token is `{` before any `(`.
        if let Some(brace) = rest.find('{') {
            if brace < open {
                let name = rest[..brace].trim().to_string();
                if !name.is_empty() && !name.contains(char::is_whitespace) {
                    out.insert(name, Vec::new());
                }
                rest = &rest[brace..];
                continue;
            }
        }
        let Some(close) = rest[body_start..].find(')') else {
            break;
        };
        let list = &rest[body_start..body_start + close];
        rest = &rest[body_start + close..];
        if name.is_empty() || name.contains(char::is_whitespace) {
            continue;
        }
        let params: Option<Vec<ParamSpec>> = list
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(parse_param)
            .collect();
        if let Some(params) = params {
            out.insert(name, params);
        }
    }
    out
}

fn parse_param(decl: &str) -> Option<ParamSpec> {
    let mut class_size: Option<(ParamClass, usize)> = None;
    let mut count = 1usize;
    for tok in decl.split_whitespace() {
        if let Some(t) = tok.strip_prefix('.') {
            let (class, bits) = match t.as_bytes().first() {
                Some(b'u') | Some(b's') => (ParamClass::Int, &t[1..]),
                Some(b'f') => (ParamClass::Float, &t[1..]),
                Some(b'b') => (ParamClass::Bits, &t[1..]),
                _ => continue,
            };
            if let Ok(bits) = bits.parse::<usize>() {
                if class_size.is_none() && bits % 8 == 0 && bits > 0 {
                    class_size = Some((class, bits / 8));
                }
            }
        } else if let Some(open) = tok.find('[') {
            let n = tok[open + 1..].trim_end_matches(']');
            count = n.parse().ok()?;
        }
    }
    let (class, size) = class_size?;
    Some(ParamSpec {
        size: size.checked_mul(count)?,
        class,
    })
}

/// A loaded module: its kernels and their PTX parameter lists.
#[derive(Clone)]
pub struct Module {
    inner: Arc<CudaModule>,
    device: Device,
    entries: Arc<HashMap<String, Vec<ParamSpec>>>,
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<_> = self.entries.keys().collect();
        names.sort();
        f.debug_struct("Module")
            .field("device", &self.device.ordinal())
            .field("kernels", &names)
            .finish()
    }
}

impl Module {
    /// Loads PTX text on `device`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the text contains a NUL byte; a driver
    /// error naming `cuModuleLoadData` with the JIT's error log if the driver
    /// rejects the PTX.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let dev = cuda_core::Device::new(0)?;
    /// let m = cuda_core::Module::from_ptx(&dev, ".version 7.0\n.target sm_70\n.address_size 64\n\
    ///     .visible .entry noop() { ret; }")?;
    /// let k = m.kernel("noop")?;
    /// assert_eq!(k.params().map(|p| p.len()), Some(0));
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn from_ptx(device: &Device, ptx: &str) -> Result<Self> {
        crate::device::require_driver()?;
        if ptx.as_bytes().contains(&0) {
            return Err(Error::InvalidArgument(
                "PTX text contains a NUL byte".into(),
            ));
        }
        let entries = parse_ptx_entries(ptx);
        let inner = match device.context().load_module(Ptx::from_src(ptx)) {
            Ok(m) => m,
            Err(code) => {
                let log = jit_error_log(device, ptx);
                let err = Error::driver("cuModuleLoadData", code);
                return Err(match (err, log) {
                    (Error::Driver { .. }, Some(log)) if !log.is_empty() => Error::Compile {
                        program: "PTX module".into(),
                        log: format!("cuModuleLoadData failed: {code:?}\n{log}"),
                    },
                    (err, _) => err,
                });
            }
        };
        Ok(Module {
            inner,
            device: device.clone(),
            entries: Arc::new(entries),
        })
    }

    /// Compiles CUDA C with NVRTC for `device`'s architecture and loads it;
    /// cached per device by a stable hash of source and options, so the same
    /// source is compiled once per process.
    ///
    /// `options` are NVRTC flags (e.g. `"-default-device"`); the
    /// architecture flag is added from the device's compute capability.
    ///
    /// # Errors
    /// [`Error::NoNvrtc`] if NVRTC is missing; [`Error::Compile`] with
    /// NVRTC's log if the source does not compile; as [`Module::from_ptx`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let dev = cuda_core::Device::new(0)?;
    /// let m = cuda_core::Module::from_cuda(&dev, r#"
    ///     extern "C" __global__ void scale(float* x, float a, unsigned n) {
    ///         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    ///         if (i < n) x[i] *= a;
    ///     }"#, &[])?;
    /// assert_eq!(m.kernel("scale")?.params().unwrap().len(), 3);
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn from_cuda(device: &Device, source: &str, options: &[&str]) -> Result<Self> {
        crate::device::require_driver()?;
        if !crate::device::nvrtc_present() {
            return Err(Error::NoNvrtc);
        }
        if source.as_bytes().contains(&0) || options.iter().any(|o| o.as_bytes().contains(&0)) {
            return Err(Error::InvalidArgument(
                "CUDA source or option contains a NUL byte".into(),
            ));
        }
        let (major, minor) = device.compute_capability()?;
        let mut opts: Vec<String> = options.iter().map(|s| s.to_string()).collect();
        if !opts
            .iter()
            .any(|o| o.starts_with("--gpu-architecture") || o.starts_with("-arch"))
        {
            opts.push(format!("--gpu-architecture=compute_{major}{minor}"));
        }
        let key = CacheKey::new(device.ordinal(), source, &opts);
        let cache = module_cache();
        if let Some(m) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(m.clone());
        }
        let compiled = cudarc::nvrtc::compile_ptx_with_opts(
            source,
            CompileOptions {
                options: opts,
                name: Some("cuda_async_module.cu".into()),
                ..Default::default()
            },
        );
        let ptx = match compiled {
            Ok(ptx) => ptx,
            Err(CompileError::CompileError { log, .. }) => {
                return Err(Error::Compile {
                    program: "cuda_async_module.cu".into(),
                    log: log.to_string_lossy().into_owned(),
                })
            }
            Err(e) => {
                return Err(Error::Compile {
                    program: "cuda_async_module.cu".into(),
                    log: format!("{e:?}"),
                })
            }
        };
        let module = Module::from_ptx(device, &ptx.to_src())?;
        cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, module.clone());
        Ok(module)
    }

    /// The kernel `name` (an `extern "C"` name, or the mangled one).
    ///
    /// # Errors
    /// [`Error::KernelNotFound`] if the module has no such kernel.
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        if name.as_bytes().contains(&0) {
            return Err(Error::KernelNotFound { name: name.into() });
        }
        let func = match self.inner.load_function(name) {
            Ok(f) => f,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_FOUND => {
                return Err(Error::KernelNotFound { name: name.into() })
            }
            Err(e) => return Err(Error::driver("cuModuleGetFunction", e)),
        };
        Ok(Kernel {
            inner: Arc::new(KernelInner {
                func,
                name: name.to_string(),
                params: self.entries.get(name).cloned(),
                device: self.device.clone(),
            }),
        })
    }

    /// The device this module is loaded on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Kernel names found in the PTX.
    pub fn kernel_names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }
}

/// A kernel of a loaded module; cheap to clone, keeps its module loaded.
#[derive(Clone)]
pub struct Kernel {
    inner: Arc<KernelInner>,
}

struct KernelInner {
    func: CudaFunction,
    name: String,
    params: Option<Vec<ParamSpec>>,
    device: Device,
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernel")
            .field("name", &self.inner.name)
            .field("params", &self.inner.params)
            .field("device", &self.inner.device.ordinal())
            .finish()
    }
}

impl Kernel {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The parameter list read from the PTX, if it could be parsed.
    pub fn params(&self) -> Option<&[ParamSpec]> {
        self.inner.params.as_deref()
    }

    /// The device the kernel's module is loaded on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The cudarc function handle.
    pub fn function(&self) -> &CudaFunction {
        &self.inner.func
    }

    /// Checks arguments given as `(size, class)` pairs against the PTX
    /// parameter list.
    ///
    /// # Errors
    /// [`Error::ArgumentMismatch`] naming the first mismatch. A kernel whose
    /// PTX parameter list could not be parsed is checked by nothing.
    pub fn check_args(&self, args: &[(usize, ParamClass, &'static str)]) -> Result<()> {
        let Some(params) = self.params() else {
            return Ok(());
        };
        if params.len() != args.len() {
            return Err(Error::ArgumentMismatch {
                kernel: self.name().into(),
                detail: format!(
                    "kernel takes {} argument(s), {} given",
                    params.len(),
                    args.len()
                ),
            });
        }
        for (i, (p, (size, class, rust))) in params.iter().zip(args).enumerate() {
            if !p.accepts(*size, *class) {
                return Err(Error::ArgumentMismatch {
                    kernel: self.name().into(),
                    detail: format!(
                        "argument {i} is `{rust}` ({size} bytes), the kernel's parameter {i} is {p}"
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The NVRTC cache key: device, source and options, compared in full;
/// the stable FNV-1a hash only picks the bucket.
#[derive(PartialEq, Eq, Hash)]
struct CacheKey {
    hash: u64,
    ordinal: usize,
    text: String,
}

impl CacheKey {
    fn new(ordinal: usize, source: &str, options: &[String]) -> Self {
        let mut text = String::with_capacity(source.len() + 64);
        for o in options {
            text.push_str(o);
            text.push('\0');
        }
        text.push_str(source);
        CacheKey {
            hash: fnv1a64(text.as_bytes()),
            ordinal,
            text,
        }
    }
}

/// FNV-1a, 64 bit: a hash that is the same in every process and release
/// (unlike `DefaultHasher`), so it can also name on-disk caches.
///
/// # Examples
///
/// ```
/// assert_eq!(cuda_core::fnv1a64(b""), 0xcbf29ce484222325);
/// assert_eq!(cuda_core::fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
/// ```
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn module_cache() -> &'static Mutex<HashMap<CacheKey, Module>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, Module>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Re-runs the failed PTX load with the JIT's error log enabled.
fn jit_error_log(device: &Device, ptx: &str) -> Option<String> {
    let src = std::ffi::CString::new(ptx).ok()?;
    device.context().bind_to_thread().ok()?;
    let mut log = vec![0u8; 16 * 1024];
    let mut opts = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut vals: [*mut std::ffi::c_void; 2] = [
        log.as_mut_ptr() as *mut _,
        log.len() as *mut std::ffi::c_void,
    ];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `src` is NUL-terminated PTX; `opts`/`vals` are two matching
    // option/value pairs; the log buffer outlives the call and its size is
    // passed by value as the JIT API requires.
    let rc = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            src.as_ptr() as *const _,
            opts.len() as u32,
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
        )
    };
    if rc == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: `module` was just loaded by us and is not shared.
        unsafe { sys::cuModuleUnload(module) };
        return None;
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    Some(String::from_utf8_lossy(&log[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NVRTC_LIKE: &str = r#"
.version 8.0
.target sm_90
.address_size 64

	// .globl	axpy
.visible .entry axpy(
	.param .f32 axpy_param_0,
	.param .u64 .ptr .global .align 4 axpy_param_1,
	.param .u64 axpy_param_2,
	.param .u32 axpy_param_3
)
{
	ret;
}
.visible .entry noargs()
{
	ret;
}
.entry bystruct(
	.param .align 8 .b8 bystruct_param_0[24],
	.param .s32 bystruct_param_1
)
{ ret; }
"#;

    #[test]
    fn parses_entries_like_nvrtc_output() {
        let e = parse_ptx_entries(NVRTC_LIKE);
        assert_eq!(
            e["axpy"],
            vec![
                ParamSpec {
                    size: 4,
                    class: ParamClass::Float
                },
                ParamSpec {
                    size: 8,
                    class: ParamClass::Int
                },
                ParamSpec {
                    size: 8,
                    class: ParamClass::Int
                },
                ParamSpec {
                    size: 4,
                    class: ParamClass::Int
                },
            ]
        );
        assert_eq!(e["noargs"], vec![]);
        assert_eq!(
            e["bystruct"],
            vec![
                ParamSpec {
                    size: 24,
                    class: ParamClass::Bits
                },
                ParamSpec {
                    size: 4,
                    class: ParamClass::Int
                },
            ]
        );
    }

    #[test]
    fn param_acceptance() {
        let f32p = ParamSpec {
            size: 4,
            class: ParamClass::Float,
        };
        assert!(f32p.accepts(4, ParamClass::Float));
        assert!(!f32p.accepts(4, ParamClass::Int));
        assert!(!f32p.accepts(8, ParamClass::Float));
        let b = ParamSpec {
            size: 8,
            class: ParamClass::Bits,
        };
        assert!(b.accepts(8, ParamClass::Int) && b.accepts(8, ParamClass::Float));
    }

    #[test]
    fn garbage_ptx_does_not_panic() {
        for s in [
            "",
            ".entry",
            ".entry (",
            ".entry x(.param .u64",
            ".entry x(.param .q7 a)",
            ".entry x(.param .b8 a[zz])",
        ] {
            let _ = parse_ptx_entries(s);
        }
        assert!(!parse_ptx_entries(".entry x(.param .b8 a[zz])").contains_key("x"));
    }

    #[test]
    fn cache_key_separates_options_and_devices() {
        let a = CacheKey::new(0, "src", &["-O3".into()]);
        let b = CacheKey::new(0, "src", &["-O2".into()]);
        let c = CacheKey::new(1, "src", &["-O3".into()]);
        assert!(a != b && a != c);
        assert!(a == CacheKey::new(0, "src", &["-O3".into()]));
    }
}
