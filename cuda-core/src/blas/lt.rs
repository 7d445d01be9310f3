//! Products through cuBLASLt (`cublasLtMatmul`): each shape's descriptors
//! and algorithm are chosen once, on its first product, and kept by the
//! handle. The legacy API (`cublasSgemm` and the rest) chooses them again
//! inside every call, so a chain of small products spends most of its time
//! on the host; with a kept plan the call only validates and launches.
//!
//! A shape cuBLASLt has no algorithm for (or a handle past
//! [`MAX_PLANS`] shapes, or a machine without `libcublasLt`) takes the
//! legacy call instead, with the same results up to the algorithm's
//! rounding.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::mem::size_of;
use std::ptr;
use std::sync::OnceLock;

use cudarc::cublaslt::{result, sys};

use super::{BlasScalar, Element, Gemm};
use crate::per_stream::failed;
use crate::Result;

/// Shapes one handle keeps plans for; products of later shapes take the
/// legacy call (plans are never destroyed: see [`Lt`]).
pub(super) const MAX_PLANS: usize = 256;

/// Whether cuBLASLt can be loaded (asked once).
fn lt_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to load the library; no cuBLASLt call is made.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// What a plan is chosen for: everything of a product but its addresses
/// and scalars, and the alignment of its addresses (an algorithm may need
/// more than an address has).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Key {
    element: Element,
    transpose: [bool; 2],
    /// Stored rows, columns and leading dimension of `A`, `B` and `C`
    /// (which give `m`, `n` and `k`).
    layouts: [(u64, u64, i64); 3],
    batch: i32,
    strides: [i64; 3],
    /// Bytes each of `A`, `B` and `C`'s addresses is aligned to (at most
    /// 256, the most an algorithm asks).
    align: [u32; 3],
}

impl Key {
    /// The key of `g` at addresses `a`, `b`, `c`, or `None` for a product
    /// the legacy call takes: an empty one (cuBLASLt has no empty
    /// layouts) or one whose numbers do not fit cuBLASLt's types.
    pub(super) fn of<T: BlasScalar>(g: &Gemm<T>, a: u64, b: u64, c: u64) -> Option<Key> {
        if g.m == 0 || g.n == 0 || g.k == 0 {
            return None;
        }
        let u = |v: usize| u64::try_from(v).ok();
        let i = |v: usize| i64::try_from(v).ok();
        let layout = |(rows, cols): (usize, usize), ld: usize| Some((u(rows)?, u(cols)?, i(ld)?));
        let align = |p: u64| 1u32 << p.trailing_zeros().min(8);
        Some(Key {
            element: T::ELEMENT,
            transpose: [g.transpose_a, g.transpose_b],
            layouts: [
                layout(g.a_shape(), g.lda)?,
                layout(g.b_shape(), g.ldb)?,
                layout((g.m, g.n), g.ldc)?,
            ],
            batch: i32::try_from(g.batch).ok()?,
            strides: [i(g.stride_a)?, i(g.stride_b)?, i(g.stride_c)?],
            align: [align(a), align(b), align(c)],
        })
    }
}

/// The data, compute and scale types of an element.
fn types(
    e: Element,
) -> (
    sys::cudaDataType,
    sys::cublasComputeType_t,
    sys::cudaDataType,
) {
    use sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F};
    use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F, CUDA_R_64F};
    match e {
        Element::F32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        Element::F64 => (CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F),
        Element::Bf16 => (CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        Element::F16 => (CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F),
    }
}

/// A shape's descriptors and algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

/// Descriptors made so far for a plan, destroyed if it is abandoned.
#[derive(Default)]
struct Parts {
    desc: Option<sys::cublasLtMatmulDesc_t>,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: Option<sys::cublasLtMatmulPreference_t>,
}

impl Drop for Parts {
    fn drop(&mut self) {
        // SAFETY: each was made by cuBLASLt and is destroyed once; they
        // are host objects no enqueued work refers to (a plan that was
        // kept took its own out before this runs).
        unsafe {
            if let Some(d) = self.desc.take() {
                let _ = result::destroy_matmul_desc(d);
            }
            for l in self.layouts.drain(..) {
                let _ = result::destroy_matrix_layout(l);
            }
            if let Some(p) = self.pref.take() {
                let _ = result::destroy_matmul_pref(p);
            }
        }
    }
}

/// Why a plan could not be made.
type Status = sys::cublasStatus_t;

/// The pointer and size of `v`, for an attribute setter.
fn raw<V>(v: &V) -> (*const c_void, usize) {
    (ptr::from_ref(v).cast(), size_of::<V>())
}

/// Sets attribute `attr` of matmul descriptor `d` to `v`.
///
/// # Safety
///
/// `d` is live; `V` is the type cuBLASLt documents for `attr`.
unsafe fn desc_attr<V>(
    d: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: V,
) -> std::result::Result<(), Status> {
    let (p, n) = raw(&v);
    // SAFETY: the caller's contract; `v` outlives the call.
    unsafe { result::set_matmul_desc_attribute(d, attr, p, n) }.map_err(|e| e.0)
}

/// Sets attribute `attr` of matrix layout `l` to `v`.
///
/// # Safety
///
/// As [`desc_attr`], for a layout.
unsafe fn layout_attr<V>(
    l: sys::cublasLtMatrixLayout_t,
    attr: sys::cublasLtMatrixLayoutAttribute_t,
    v: V,
) -> std::result::Result<(), Status> {
    let (p, n) = raw(&v);
    // SAFETY: the caller's contract; `v` outlives the call.
    unsafe { result::set_matrix_layout_attribute(l, attr, p, n) }.map_err(|e| e.0)
}

/// Sets attribute `attr` of matmul preference `pref` to `v`.
///
/// # Safety
///
/// As [`desc_attr`], for a preference.
unsafe fn pref_attr<V>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    v: V,
) -> std::result::Result<(), Status> {
    let (p, n) = raw(&v);
    // SAFETY: the caller's contract; `v` outlives the call.
    unsafe { result::set_matmul_pref_attribute(pref, attr, p, n) }.map_err(|e| e.0)
}

/// The plan of `key` for a workspace of `workspace` bytes.
fn plan(
    handle: sys::cublasLtHandle_t,
    key: &Key,
    workspace: usize,
) -> std::result::Result<Plan, Status> {
    use sys::cublasLtMatmulDescAttributes_t::{
        CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB,
    };
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    use sys::cublasLtMatrixLayoutAttribute_t::{
        CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
    };
    let (data, compute, scale) = types(key.element);
    // `cublasOperation_t` as the `i32` the attribute holds: `CUBLAS_OP_N`
    // is 0, `CUBLAS_OP_T` 1.
    let op = |t: bool| i32::from(t);
    let mut parts = Parts::default();
    let desc = result::create_matmul_desc(compute, scale).map_err(|e| e.0)?;
    parts.desc = Some(desc);
    // Each attribute below: its descriptor, layout or preference was just
    // made, and the value is of the attribute's documented type
    // (`cublasOperation_t`s as `i32`s, an `i32` count, an `i64` stride, a
    // `u64` byte count, `u32` alignments).
    // SAFETY: as said.
    unsafe {
        desc_attr(desc, CUBLASLT_MATMUL_DESC_TRANSA, op(key.transpose[0]))?;
        desc_attr(desc, CUBLASLT_MATMUL_DESC_TRANSB, op(key.transpose[1]))?;
    }
    for (&(rows, cols, ld), &stride) in key.layouts.iter().zip(&key.strides) {
        let l = result::create_matrix_layout(data, rows, cols, ld).map_err(|e| e.0)?;
        parts.layouts.push(l);
        if key.batch > 1 {
            // SAFETY: as above.
            unsafe {
                layout_attr(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, key.batch)?;
                layout_attr(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride)?;
            }
        }
    }
    let pref = result::create_matmul_pref().map_err(|e| e.0)?;
    parts.pref = Some(pref);
    let [a, b, c] = key.align;
    // SAFETY: as above.
    unsafe {
        pref_attr(
            pref,
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            workspace as u64,
        )?;
        pref_attr(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a)?;
        pref_attr(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b)?;
        pref_attr(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c)?;
        pref_attr(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c)?;
    }
    let [la, lb, lc] = [parts.layouts[0], parts.layouts[1], parts.layouts[2]];
    // SAFETY: every descriptor was made above and is live.
    let found = unsafe { result::get_matmul_algo_heuristic(handle, desc, la, lb, lc, lc, pref) }
        .map_err(|e| e.0)?;
    // Kept: the plan owns the descriptors from here (the preference goes).
    parts.desc = None;
    parts.layouts.clear();
    Ok(Plan {
        desc,
        layouts: [la, lb, lc],
        algo: found.algo,
    })
}

/// A handle's cuBLASLt handle and plans. Neither is ever destroyed (as
/// the cuBLAS handle is not): graphs captured with a plan's products may
/// outlive anything that would drop them.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    /// `None`: a shape cuBLASLt has no algorithm for.
    plans: HashMap<Key, Option<Plan>>,
}

impl fmt::Debug for Lt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lt")
            .field("plans", &self.planned())
            .finish_non_exhaustive()
    }
}

impl Lt {
    /// A cuBLASLt handle, or `None` where the library is missing or the
    /// handle cannot be made (the legacy calls serve every product then).
    pub(super) fn new() -> Option<Lt> {
        if !lt_present() {
            return None;
        }
        let handle = result::create_handle().ok()?;
        Some(Lt {
            handle,
            plans: HashMap::new(),
        })
    }

    /// The shapes with a plan.
    pub(super) fn planned(&self) -> usize {
        self.plans.values().filter(|p| p.is_some()).count()
    }

    /// Enqueues `g` on `stream` through its shape's plan (made now on its
    /// first product), with `workspace` (address, bytes); `None` when the
    /// legacy call must take it.
    ///
    /// # Safety
    ///
    /// As [`BlasScalar::gemm`]; `stream` is the stream of the handle the
    /// workspace belongs to, and no other work uses the workspace.
    pub(super) unsafe fn gemm<T: BlasScalar>(
        &mut self,
        g: &Gemm<T>,
        [a, b, c]: [u64; 3],
        workspace: (u64, usize),
        stream: sys::cudaStream_t,
    ) -> Option<Result<()>> {
        let key = Key::of(g, a, b, c)?;
        // One lookup for a shape already planned.
        let full = self.plans.len() >= MAX_PLANS;
        let p = match self.plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(_) if full => return None,
            Entry::Vacant(e) => e.insert(plan(self.handle, &key, workspace.1).ok()),
        };
        let p = p.as_ref()?;
        // `f64` products take `f64` scalars; every other element `f32`
        // ones (exact: each of their values is an `f32`).
        let scalars = match key.element {
            Element::F64 => Scalars::F64(g.alpha.to_f64(), g.beta.to_f64()),
            _ => Scalars::F32(g.alpha.to_f64() as f32, g.beta.to_f64() as f32),
        };
        let (alpha, beta) = scalars.pointers();
        let [la, lb, lc] = p.layouts;
        // SAFETY: the caller's contract for the addresses and the
        // workspace; the plan's descriptors are live and describe `g` at
        // these addresses' alignment; `alpha` and `beta` point at host
        // values of the plan's scale type that outlive the call (the
        // descriptor's pointer mode is host); `C` is also `D`, with the
        // same layout.
        let r = unsafe {
            result::matmul(
                self.handle,
                p.desc,
                alpha,
                beta,
                a as *const c_void,
                la,
                b as *const c_void,
                lb,
                c as *const c_void,
                lc,
                c as *mut c_void,
                lc,
                &p.algo,
                workspace.0 as *mut c_void,
                workspace.1,
                stream,
            )
        };
        match r {
            Ok(()) => Some(Ok(())),
            // Refused before anything was enqueued: the legacy call
            // takes this shape from now on.
            Err(e)
                if matches!(
                    e.0,
                    sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                        | sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
                ) =>
            {
                self.plans.insert(key, None);
                None
            }
            Err(e) => Some(Err(failed("cublasLtMatmul", e.0))),
        }
    }
}

/// A product's scalars in its plan's scale type.
enum Scalars {
    F32(f32, f32),
    F64(f64, f64),
}

impl Scalars {
    fn pointers(&self) -> (*const c_void, *const c_void) {
        match self {
            Scalars::F32(a, b) => (ptr::from_ref(a).cast(), ptr::from_ref(b).cast()),
            Scalars::F64(a, b) => (ptr::from_ref(a).cast(), ptr::from_ref(b).cast()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_has_the_stored_shapes_and_the_addresses_alignment() {
        let g = Gemm::<f32>::new(4, 2, 3).transpose_a();
        let k = Key::of(&g, 0x1000, 0x1004, 0x1010).unwrap();
        // `A` transposed is stored `k` x `m`.
        assert_eq!(k.layouts, [(3, 4, 3), (3, 2, 3), (4, 2, 4)]);
        assert_eq!(k.align, [256, 4, 16]);
        assert_eq!(k.transpose, [true, false]);
        let b = Gemm::<f32>::new(4, 2, 3).transpose_b().batched(5);
        let kb = Key::of(&b, 256, 256, 256).unwrap();
        assert_eq!(kb.layouts[1], (2, 3, 2), "B transposed is stored n x k");
        assert_eq!((kb.batch, kb.strides), (5, [12, 6, 8]));
        // Another alignment is another plan.
        assert_ne!(Key::of(&g, 0x1000, 0x1008, 0x1010), Some(k));
    }

    #[test]
    fn empty_products_take_the_legacy_call() {
        assert_eq!(Key::of(&Gemm::<f32>::new(0, 2, 3), 256, 256, 256), None);
        assert_eq!(Key::of(&Gemm::<f64>::new(4, 2, 0), 256, 256, 256), None);
    }
}
