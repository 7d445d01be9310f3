//! Modules as descriptions (PTX text, or CUDA C with NVRTC options, and a
//! content hash; no device), kernels (a module and a name) resolved per
//! device on first use through a process-wide cache, and the parameter
//! lists read from the PTX so launches can be checked.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaFunction};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::device::Device;
use crate::error::{Error, Result};

mod cache;
mod ptx_params;

use cache::{cache_entry, evict, LoadedModule};
pub use ptx_params::{parse_ptx_entries, ParamClass, ParamSpec};

/// What a [`Module`] is made of: PTX text, or CUDA C with NVRTC options.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ModuleSource {
    /// PTX text, JIT-compiled by the driver of each device that loads it.
    Ptx(String),
    /// CUDA C, compiled by NVRTC for each device's architecture.
    Cuda {
        /// The CUDA C source.
        source: String,
        /// NVRTC options as given (the architecture flag is added per
        /// device unless one is given here).
        options: Vec<String>,
    },
}

impl ModuleSource {
    /// The PTX text or the CUDA C source.
    pub fn text(&self) -> &str {
        match self {
            ModuleSource::Ptx(t) => t,
            ModuleSource::Cuda { source, .. } => source,
        }
    }

    /// The stable content hash: FNV-1a over the kind, the options and the
    /// text, the same in every process and on every machine.
    fn content_hash(&self) -> u64 {
        let mut h = Fnv1a::new();
        match self {
            ModuleSource::Ptx(t) => {
                h.write(b"ptx\0");
                h.write(t.as_bytes());
            }
            ModuleSource::Cuda { source, options } => {
                h.write(b"cuda\0");
                for o in options {
                    h.write(o.as_bytes());
                    h.write(b"\0");
                }
                h.write(b"\0");
                h.write(source.as_bytes());
            }
        }
        h.finish()
    }
}

/// A GPU module as a description: its source (CUDA C with options, or PTX)
/// and the content hash, bound to no device. Cheap to clone.
///
/// Making a module needs no driver and no NVRTC, so a machine without a GPU
/// can build kernel values (to send to another machine's GPU, say). The module is
/// compiled and loaded per device when a kernel of it first runs there, or
/// when [`Module::load_on`] asks for it.
///
/// # Performance
///
/// Compilation happens on first use per device: NVRTC took about 50 ms for
/// a small module on an H100 host (PTX JIT is faster, but not free). The
/// result is cached process-wide by source, options and device, so each
/// distinct module compiles once per device, however many `Module` values
/// or threads ask for it. A first launch inside an async task would block
/// that executor thread for the compile: call [`Module::load_on`] (or
/// [`Kernel::load_on`]) at start-up to compile early and see compile
/// errors there. After the first use a launch finds its function with two
/// atomic loads, without a lock.
///
/// # Examples
///
/// ```
/// use cuda_core::Module;
/// // No driver needed: nothing is compiled yet.
/// let m = Module::cuda(r#"extern "C" __global__ void k(int* p) { *p = 7; }"#, &[])?
///     .named("seven.cu");
/// let k = m.kernel("k")?;
/// assert_eq!((k.name(), m.name()), ("k", "seven.cu"));
/// let m2 = Module::cuda(r#"extern "C" __global__ void k(int* p) { *p = 7; }"#, &["-lineinfo"])?;
/// assert_ne!(m.hash(), m2.hash()); // options are part of the content
/// # Ok::<(), cuda_core::Error>(())
/// ```
///
/// Compiling eagerly for one device, in one line:
///
/// ```no_run
/// use cuda_core::{Device, Module};
/// let dev = Device::new(0)?;
/// let k = Module::cuda(r#"extern "C" __global__ void k(int* p) { *p = 7; }"#, &[])?
///     .load_on(&dev)?
///     .kernel("k")?;
/// # Ok::<(), cuda_core::Error>(())
/// ```
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

#[derive(Clone)]
struct ModuleInner {
    source: ModuleSource,
    hash: u64,
    name: String,
    /// PTX modules: the `.entry` parameter lists, parsed once from the text.
    ptx_entries: Option<Arc<HashMap<String, Vec<ParamSpec>>>>,
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Module")
            .field("name", &self.inner.name)
            .field("hash", &format_args!("{:016x}", self.inner.hash))
            .field("bytes", &self.inner.source.text().len())
            .finish()
    }
}

impl PartialEq for Module {
    /// Same content (kind, options and text); the name is not compared.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.hash == other.inner.hash && self.inner.source == other.inner.source)
    }
}
impl Eq for Module {}

fn reject_nul(what: &str, s: &str) -> Result<()> {
    if s.as_bytes().contains(&0) {
        Err(Error::InvalidArgument(format!(
            "{what} contains a NUL byte"
        )))
    } else {
        Ok(())
    }
}

impl Module {
    /// A CUDA C module, compiled by NVRTC with `options` (e.g.
    /// `"-default-device"`, `"-lineinfo"`) for each device that runs it.
    /// Needs no driver.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the source or an option contains a NUL
    /// byte. Compile errors show when the module is first loaded.
    ///
    /// # Examples
    ///
    /// ```
    /// let m = cuda_core::Module::cuda(r#"
    ///     extern "C" __global__ void scale(float* x, float a, unsigned n) {
    ///         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    ///         if (i < n) x[i] *= a;
    ///     }"#, &[])?;
    /// let scale = m.kernel("scale")?;
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn cuda(source: impl Into<String>, options: &[&str]) -> Result<Self> {
        let source = source.into();
        reject_nul("CUDA C source", &source)?;
        for o in options {
            reject_nul("NVRTC option", o)?;
        }
        let options = options.iter().map(|o| o.to_string()).collect();
        Ok(Self::new(ModuleSource::Cuda { source, options }, None))
    }

    /// A PTX module, JIT-compiled by the driver of each device that runs
    /// it. The `.entry` parameter lists are parsed now, so an unknown
    /// kernel name is an error at [`Module::kernel`]. Needs no driver.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the text contains a NUL byte.
    ///
    /// # Examples
    ///
    /// ```
    /// let m = cuda_core::Module::ptx(".version 7.0\n.target sm_70\n.address_size 64\n\
    ///     .visible .entry noop() { ret; }")?;
    /// assert_eq!(m.kernel("noop")?.params().map(|p| p.len()), Some(0));
    /// assert!(m.kernel("nope").is_err());
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn ptx(text: impl Into<String>) -> Result<Self> {
        let text = text.into();
        reject_nul("PTX text", &text)?;
        let entries = Arc::new(parse_ptx_entries(&text));
        Ok(Self::new(ModuleSource::Ptx(text), Some(entries)))
    }

    fn new(
        source: ModuleSource,
        ptx_entries: Option<Arc<HashMap<String, Vec<ParamSpec>>>>,
    ) -> Self {
        let hash = source.content_hash();
        let kind = match source {
            ModuleSource::Ptx(_) => "ptx",
            ModuleSource::Cuda { .. } => "cuda",
        };
        Module {
            inner: Arc::new(ModuleInner {
                source,
                hash,
                name: format!("{kind}-{hash:016x}"),
                ptx_entries,
            }),
        }
    }

    /// Gives the module a name for error messages and NVRTC logs (e.g. the
    /// file it came from). The default is its kind and content hash
    /// (`cuda-1a2b...`). The name is not part of the content.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        let name: String = name.into();
        Arc::make_mut(&mut self.inner).name = name.replace('\0', "");
        self
    }

    /// The module's name (see [`Module::named`]).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The content hash: FNV-1a over kind, options and text; stable across
    /// processes and machines (a remote node caches compiled modules by it).
    pub fn hash(&self) -> u64 {
        self.inner.hash
    }

    /// What the module is made of.
    pub fn source(&self) -> &ModuleSource {
        &self.inner.source
    }

    /// Compiles (CUDA C, through the per-device NVRTC cache) or JIT-loads
    /// (PTX) the module on `device` now, so the first launch there does
    /// not, and compile errors show here. Returns `self` for chaining.
    ///
    /// # Errors
    /// [`Error::NoDriver`], [`Error::NoNvrtc`] (CUDA C without NVRTC),
    /// [`Error::Compile`] naming the module with NVRTC's (or the JIT's) log,
    /// or the failing driver call.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let dev = cuda_core::Device::new(0)?;
    /// let m = cuda_core::Module::cuda(r#"extern "C" __global__ void k() {}"#, &[])?;
    /// m.load_on(&dev)?; // compiles now; launches of `k` on `dev` will not
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn load_on(&self, device: &Device) -> Result<&Self> {
        self.loaded_on(device)?;
        Ok(self)
    }

    /// Forgets this module's load on `device` in the process-wide cache, so
    /// the driver unloads it once no [`Kernel`] value that resolved it there
    /// is left (each holds the loaded module), and the next use loads it
    /// again. For long-lived processes that load many distinct modules (a
    /// server that runs kernels others send).
    ///
    /// # Safety
    /// No kernel of this module may still be running or queued on `device`
    /// when the last such [`Kernel`] is dropped (synchronize its streams
    /// first): unloading a module under a running kernel is undefined.
    pub unsafe fn evict_on(&self, device: &Device) {
        evict(device.ordinal(), &self.inner);
    }

    /// The names of the module's kernels, compiling it on `device` first
    /// if it is CUDA C. Sorted.
    ///
    /// # Errors
    /// As [`Module::load_on`].
    pub fn kernel_names_on(&self, device: &Device) -> Result<Vec<String>> {
        Ok(sorted_names(&self.loaded_on(device)?.entries))
    }

    /// The kernel `name` of this module (an `extern "C"` name, or the
    /// mangled one). Resolved on each device when it first runs there.
    ///
    /// # Errors
    /// [`Error::KernelNotFound`] (naming the module and listing its
    /// kernels) if this is PTX without such an entry, or the name is empty
    /// or contains a NUL byte. CUDA C is only compiled when loaded, so a
    /// wrong name there shows at [`Kernel::load_on`] or the first launch.
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        let params = OnceLock::new();
        let known = match &self.inner.ptx_entries {
            Some(entries) => match entries.get(name) {
                Some(p) => {
                    let _ = params.set(Some(p.clone()));
                    true
                }
                // A `.entry` whose parameter list the parser could not read
                // is missing from the map: only an absent name is an error.
                None => !name.is_empty() && self.inner.source.text().contains(name),
            },
            None => !name.is_empty(),
        };
        if !known || name.as_bytes().contains(&0) {
            let entries = self
                .inner
                .ptx_entries
                .as_ref()
                .map(|e| sorted_names(e))
                .unwrap_or_default();
            return Err(self.not_found(name, entries));
        }
        Ok(Kernel {
            inner: Arc::new(KernelInner {
                module: self.clone(),
                name: name.to_string(),
                params,
                functions: OnceLock::new(),
            }),
        })
    }

    fn not_found(&self, name: &str, entries: Vec<String>) -> Error {
        Error::KernelNotFound {
            name: name.into(),
            module: self.inner.name.clone(),
            entries,
        }
    }

    /// The module's PTX for `device`: its text for a PTX module; for CUDA C,
    /// NVRTC's output for the device's architecture (compiled now, outside
    /// the cache: a caller that keeps PTX for later processes, such as a
    /// server of remote GPUs, loads it with [`Module::ptx`]).
    ///
    /// # Errors
    ///
    /// [`Error::Compile`] with NVRTC's log, [`Error::NoNvrtc`], or a driver
    /// error reading the architecture.
    pub fn ptx_for(&self, device: &Device) -> Result<String> {
        match &self.inner.source {
            ModuleSource::Ptx(text) => Ok(text.clone()),
            ModuleSource::Cuda { source, options } => self.compile(device, source, options),
        }
    }

    /// The module loaded on `device`, from the process-wide cache (compiled
    /// or JIT-loaded once per content and device).
    pub(crate) fn loaded_on(&self, device: &Device) -> Result<Arc<LoadedModule>> {
        crate::device::require_driver()?;
        let entry = cache_entry(device.ordinal(), &self.inner);
        // One compile per content and device: threads that ask at once wait
        // here for the first one's result.
        let mut slot = entry.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = &*slot {
            return done.clone();
        }
        let loaded = self.load_uncached(device);
        // Compile errors are deterministic: cache them so a bad module does
        // not recompile on every launch. Anything else may be retried.
        if matches!(loaded, Ok(_) | Err(Error::Compile { .. })) {
            *slot = Some(loaded.clone());
        }
        loaded
    }

    fn load_uncached(&self, device: &Device) -> Result<Arc<LoadedModule>> {
        let ptx_owned;
        let (ptx, entries) = match &self.inner.source {
            ModuleSource::Ptx(text) => (
                text.as_str(),
                self.inner.ptx_entries.clone().unwrap_or_default(),
            ),
            ModuleSource::Cuda { source, options } => {
                ptx_owned = self.compile(device, source, options)?;
                let entries = Arc::new(parse_ptx_entries(&ptx_owned));
                (ptx_owned.as_str(), entries)
            }
        };
        let module = match device.context().load_module(Ptx::from_src(ptx)) {
            Ok(m) => m,
            Err(code) => {
                let err = Error::driver("cuModuleLoadData", code);
                return Err(match (err, jit_error_log(device, ptx)) {
                    (Error::Driver { .. }, Some(log)) if !log.is_empty() => Error::Compile {
                        program: self.inner.name.clone(),
                        log: format!("cuModuleLoadData failed: {code:?}\n{log}"),
                    },
                    (err, _) => err,
                });
            }
        };
        Ok(Arc::new(LoadedModule { module, entries }))
    }

    fn compile(&self, device: &Device, source: &str, options: &[String]) -> Result<String> {
        if !crate::device::nvrtc_present() {
            return Err(Error::NoNvrtc);
        }
        let (major, minor) = device.compute_capability()?;
        let mut opts: Vec<String> = options.to_vec();
        if !opts
            .iter()
            .any(|o| o.starts_with("--gpu-architecture") || o.starts_with("-arch"))
        {
            opts.push(format!("--gpu-architecture=compute_{major}{minor}"));
        }
        compile_ptx(&self.inner.name, source, &opts)
    }
}

/// Compiles CUDA C `source` to PTX with NVRTC and exactly `options` (add
/// `--gpu-architecture=compute_XY` for the GPU it will run on); `name` is
/// the program name NVRTC puts in its log. Needs `libnvrtc`, not a driver or
/// a device: a process that only compiles (a sandboxed compiler, say) never
/// creates a CUDA context.
///
/// Prefer [`Module::cuda`] with [`Module::ptx_for`], which picks the
/// architecture of the device and caches the result.
///
/// # Examples
///
/// ```no_run
/// let ptx = cuda_core::compile_ptx(
///     "scale.cu",
///     r#"extern "C" __global__ void scale(float* x) { x[threadIdx.x] *= 2.0f; }"#,
///     &["--gpu-architecture=compute_80".to_string()],
/// )?;
/// assert!(ptx.contains(".entry scale"));
/// # Ok::<(), cuda_core::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::NoNvrtc`] without `libnvrtc`; [`Error::Compile`] with NVRTC's
/// log when the source does not compile.
pub fn compile_ptx(name: &str, source: &str, options: &[String]) -> Result<String> {
    if !crate::device::nvrtc_present() {
        return Err(Error::NoNvrtc);
    }
    NVRTC_COMPILATIONS.fetch_add(1, Ordering::Relaxed);
    let compiled = cudarc::nvrtc::compile_ptx_with_opts(
        source,
        CompileOptions {
            options: options.to_vec(),
            name: Some(name.to_owned()),
            ..Default::default()
        },
    );
    match compiled {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(CompileError::CompileError { log, .. }) => Err(Error::Compile {
            program: name.to_owned(),
            log: log.to_string_lossy().into_owned(),
        }),
        Err(e) => Err(Error::Compile {
            program: name.to_owned(),
            log: format!("{e:?}"),
        }),
    }
}

fn sorted_names(entries: &HashMap<String, Vec<ParamSpec>>) -> Vec<String> {
    let mut names: Vec<String> = entries.keys().cloned().collect();
    names.sort();
    names
}

static NVRTC_COMPILATIONS: AtomicU64 = AtomicU64::new(0);

/// How many NVRTC compilations this process has run (a diagnostic: each
/// distinct CUDA C module compiles once per device).
pub fn nvrtc_compilations() -> u64 {
    NVRTC_COMPILATIONS.load(Ordering::Relaxed)
}

/// A kernel: a [`Module`] and an entry name. Cheap to clone, `Send +
/// Sync`, and not bound to a device: each device it runs on resolves it
/// once (compiling the module there if needed), then finds it lock-free.
///
/// # Examples
///
/// ```
/// let m = cuda_core::Module::cuda(r#"extern "C" __global__ void k(int* p) { *p = 7; }"#, &[])?;
/// let k = m.kernel("k")?;
/// let k2 = k.clone(); // shares the per-device functions
/// std::thread::spawn(move || assert_eq!(k2.name(), "k")).join().unwrap();
/// # Ok::<(), cuda_core::Error>(())
/// ```
#[derive(Clone)]
pub struct Kernel {
    inner: Arc<KernelInner>,
}

struct KernelInner {
    module: Module,
    name: String,
    /// The PTX parameter list: known at construction for PTX, after the
    /// first load for CUDA C; `Some(None)` if it could not be parsed.
    params: OnceLock<Option<Vec<ParamSpec>>>,
    /// One slot per device ordinal, made on first use.
    functions: OnceLock<Box<[OnceLock<CudaFunction>]>>,
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernel")
            .field("name", &self.inner.name)
            .field("module", &self.inner.module.name())
            .field("params", &self.params())
            .finish()
    }
}

impl Kernel {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The module it belongs to.
    pub fn module(&self) -> &Module {
        &self.inner.module
    }

    /// The parameter list read from the PTX: known from the start for a
    /// PTX module, after the first load for CUDA C; `None` before that or
    /// if it could not be parsed.
    pub fn params(&self) -> Option<&[ParamSpec]> {
        self.inner.params.get().and_then(|p| p.as_deref())
    }

    /// Loads the kernel on `device` now (compiling its module there if
    /// needed), so a wrong name or a compile error shows here and the first
    /// launch does not compile. See [`Module`]'s `# Performance`.
    ///
    /// # Errors
    /// As [`Module::load_on`]; [`Error::KernelNotFound`] naming the module
    /// and listing its kernels.
    pub fn load_on(&self, device: &Device) -> Result<()> {
        self.function_on(device).map(|_| ())
    }

    /// The cudarc function of this kernel on `device`, resolving it the
    /// first time (for interop with code that launches through cudarc).
    ///
    /// # Errors
    /// As [`Kernel::load_on`].
    #[inline]
    pub fn function_on(&self, device: &Device) -> Result<&CudaFunction> {
        let found = self
            .inner
            .functions
            .get()
            .and_then(|slots| slots.get(device.ordinal()))
            .and_then(OnceLock::get);
        match found {
            Some(f) => Ok(f),
            None => self.resolve(device),
        }
    }

    #[cold]
    fn resolve(&self, device: &Device) -> Result<&CudaFunction> {
        let module = &self.inner.module;
        let loaded = module.loaded_on(device)?;
        let func = match loaded.module.load_function(&self.inner.name) {
            Ok(f) => f,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_FOUND => {
                return Err(module.not_found(&self.inner.name, sorted_names(&loaded.entries)))
            }
            Err(e) => return Err(Error::driver("cuModuleGetFunction", e)),
        };
        let _ = self
            .inner
            .params
            .set(loaded.entries.get(&self.inner.name).cloned());
        if self.inner.functions.get().is_none() {
            let n = crate::device::device_count()?.max(device.ordinal() + 1);
            let _ = self
                .inner
                .functions
                .set((0..n).map(|_| OnceLock::new()).collect());
        }
        let slot = self
            .inner
            .functions
            .get()
            .and_then(|s| s.get(device.ordinal()))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "device ordinal {} is past the devices counted when kernel `{}` was first \
                     loaded",
                    device.ordinal(),
                    self.inner.name
                ))
            })?;
        Ok(slot.get_or_init(|| func))
    }

    /// Checks arguments given as `(size, class)` pairs against the PTX
    /// parameter list.
    ///
    /// # Errors
    /// [`Error::ArgumentMismatch`] naming the first mismatch. A kernel whose
    /// PTX parameter list could not be parsed (or, for CUDA C, was not
    /// loaded yet) is checked by nothing: launches load it before checking.
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

/// FNV-1a, 64 bit: a hash that is the same in every process and release
/// (unlike `DefaultHasher`), so it can name cached modules anywhere.
///
/// # Examples
///
/// ```
/// assert_eq!(cuda_core::fnv1a64(b""), 0xcbf29ce484222325);
/// assert_eq!(cuda_core::fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
/// ```
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a::new();
    h.write(bytes);
    h.finish()
}

struct Fnv1a(u64);

impl Fnv1a {
    fn new() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
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
mod tests;
