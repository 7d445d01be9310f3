//! Parses the `extern "C" __global__` kernel signatures of CUDA C source.
//!
//! Only what a typed launcher needs is read: each kernel's name and, per
//! parameter, its element type and how it is passed. `T*` is a buffer the
//! kernel may write, `const T*` (or `T const*`) one it only reads, anything
//! else a scalar by value. Comments, `__restrict__`/`restrict`, `volatile`,
//! `const` in either position and parameter names are tolerated; bodies are
//! skipped. What cannot be mapped (templates, structs by value, unknown
//! types, pointers to pointers, default arguments) is an error naming the
//! kernel and the parameter, so the macro can report it at its call site.

use std::fmt;

/// An element or scalar type a kernel parameter can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CType {
    F32,
    F64,
    F16,
    I8,
    U8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    Usize,
}

impl CType {
    /// The Rust type a launcher uses for it.
    pub(crate) fn rust(self) -> &'static str {
        match self {
            CType::F32 => "f32",
            CType::F64 => "f64",
            CType::F16 => "half::f16",
            CType::I8 => "i8",
            CType::U8 => "u8",
            CType::I16 => "i16",
            CType::U16 => "u16",
            CType::I32 => "i32",
            CType::U32 => "u32",
            CType::I64 => "i64",
            CType::U64 => "u64",
            CType::Usize => "usize",
        }
    }
}

/// How a parameter is passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Passing {
    /// By value.
    Scalar,
    /// `const T*`: a buffer the kernel reads.
    Reads,
    /// `T*`: a buffer the kernel may write.
    Writes,
}

/// One kernel parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Param {
    /// Its name in the source, if it has one.
    pub(crate) name: Option<String>,
    pub(crate) ty: CType,
    pub(crate) passing: Passing,
}

/// One `extern "C" __global__` kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kernel {
    pub(crate) name: String,
    pub(crate) params: Vec<Param>,
}

/// Why a source could not be mapped, naming the kernel and parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParseError {
    pub(crate) kernel: Option<String>,
    pub(crate) message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kernel {
            Some(k) => write!(f, "kernel `{k}`: {}", self.message),
            None => write!(f, "{}", self.message),
        }
    }
}

/// The source with comments replaced by spaces (string literals kept).
fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                i += 1;
            }
            i += 2;
            out.push(' ');
        } else if b[i] == b'"' {
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str(&src[start..i.min(b.len())]);
        } else {
            let c = src[i..].chars().next().expect("in bounds");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// C tokens: identifiers, string literals, and single punctuation chars.
fn tokens(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = src.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c.is_whitespace() {
            continue;
        }
        if c.is_alphanumeric() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if d.is_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(src[i..end].to_string());
        } else if c == '"' {
            let mut end = i + 1;
            let mut escaped = false;
            for (j, d) in chars.by_ref() {
                end = j + 1;
                match d {
                    _ if escaped => escaped = false,
                    '\\' => escaped = true,
                    '"' => break,
                    _ => {}
                }
            }
            out.push(src[i..end].to_string());
        } else {
            out.push(c.to_string());
        }
    }
    out
}

/// The `extern "C" __global__` kernels of `src`, in source order.
///
/// A kernel counts when `__global__` appears in a declaration that also
/// says `extern "C"`, or inside an `extern "C" { ... }` block.
pub(crate) fn kernels(src: &str) -> Result<Vec<Kernel>, ParseError> {
    // Preprocessor lines (`#include`, `#define`...) are not declarations.
    let code: String = strip_comments(src)
        .lines()
        .map(|l| {
            if l.trim_start().starts_with('#') {
                ""
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let t = tokens(&code);
    let mut out = Vec::new();
    // Depth of `extern "C" {` blocks we are in, as brace depths.
    let mut extern_blocks: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    // Start of the current declaration (after the last `;`, `{` or `}`).
    let mut decl_start = 0usize;
    let mut i = 0;
    while i < t.len() {
        match t[i].as_str() {
            "{" => {
                if i >= 2 && t[i - 1] == "\"C\"" && t[i - 2] == "extern" {
                    extern_blocks.push(depth);
                }
                depth += 1;
                decl_start = i + 1;
            }
            "}" => {
                depth = depth.saturating_sub(1);
                if extern_blocks.last() == Some(&depth) {
                    extern_blocks.pop();
                }
                decl_start = i + 1;
            }
            ";" => decl_start = i + 1,
            "__global__" => {
                let decl = &t[decl_start..i];
                let is_extern_c = !extern_blocks.is_empty()
                    || decl.windows(2).any(|w| w[0] == "extern" && w[1] == "\"C\"");
                let is_template = t[decl_start..i].iter().any(|w| w == "template");
                let next = if is_extern_c || is_template {
                    let (k, next) = kernel_at(&t, decl_start, i)?;
                    out.push(k);
                    next
                } else {
                    // A C++ kernel (mangled name): not launchable by name.
                    let open = (i..t.len()).find(|&j| t[j] == "(").unwrap_or(t.len());
                    skip_group(&t, open).unwrap_or(t.len())
                };
                i = next;
                decl_start = next;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    Ok(out)
}

/// Parses the kernel whose `__global__` is at `g`; returns it and the index
/// after its parameter list.
fn kernel_at(t: &[String], decl_start: usize, g: usize) -> Result<(Kernel, usize), ParseError> {
    let no_list = || ParseError {
        kernel: None,
        message: "a `__global__` declaration without a parameter list".into(),
    };
    // The words up to the parameter list, `__launch_bounds__(...)` skipped.
    let mut words: Vec<&str> = Vec::new();
    let mut j = g + 1;
    let open = loop {
        match t.get(j).map(String::as_str) {
            None => return Err(no_list()),
            Some("__launch_bounds__") => j = skip_group(t, j + 1).ok_or_else(no_list)?,
            Some("(") => break j,
            Some(w) => {
                words.push(w);
                j += 1;
            }
        }
    };
    let name = words.pop().ok_or_else(no_list)?.to_string();
    let err = |message: String| ParseError {
        kernel: Some(name.clone()),
        message,
    };
    if t[decl_start..g].iter().any(|w| w == "template") {
        return Err(err(
            "templates cannot be launched through extern \"C\" signatures; instantiate it in a \
             non-template extern \"C\" kernel"
                .into(),
        ));
    }
    let before: Vec<&str> = t[decl_start..g].iter().map(String::as_str).collect();
    let returns_void = words.contains(&"void") || before.contains(&"void");
    let others = words.iter().chain(&before).any(|w| {
        !matches!(
            *w,
            "void" | "extern" | "\"C\"" | "static" | "__noinline__" | "__forceinline__"
        )
    });
    if !returns_void || others {
        return Err(err("a kernel returns `void`".into()));
    }
    // The parameter list, split at top-level commas.
    let mut params = Vec::new();
    let mut cur: Vec<&str> = Vec::new();
    let mut nest = 0usize;
    let mut j = open + 1;
    loop {
        let Some(w) = t.get(j) else {
            return Err(err("unterminated parameter list".into()));
        };
        match w.as_str() {
            "(" | "[" | "<" => {
                nest += 1;
                cur.push(w);
            }
            ")" if nest == 0 => {
                if !cur.is_empty() {
                    params.push(std::mem::take(&mut cur));
                }
                break;
            }
            ")" | "]" | ">" => {
                nest = nest.saturating_sub(1);
                cur.push(w);
            }
            "," if nest == 0 => params.push(std::mem::take(&mut cur)),
            _ => cur.push(w),
        }
        j += 1;
    }
    // `f(void)` takes nothing.
    if params.len() == 1 && params[0] == ["void"] {
        params.clear();
    }
    let params = params
        .iter()
        .enumerate()
        .map(|(n, p)| param(p).map_err(|m| err(format!("parameter {n} (`{}`): {m}", p.join(" ")))))
        .collect::<Result<_, _>>()?;
    Ok((Kernel { name, params }, j + 1))
}

/// The index after the parenthesised group that opens at `open`.
fn skip_group(t: &[String], open: usize) -> Option<usize> {
    if t.get(open)? != "(" {
        return None;
    }
    let mut nest = 0usize;
    for (j, w) in t.iter().enumerate().skip(open) {
        match w.as_str() {
            "(" => nest += 1,
            ")" => {
                nest -= 1;
                if nest == 0 {
                    return Some(j + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// One parameter's tokens.
fn param(p: &[&str]) -> Result<Param, String> {
    if p.contains(&"=") {
        return Err("default arguments are not supported".into());
    }
    if p.contains(&"[") || p.contains(&"&") {
        return Err("arrays and references are not supported: pass a pointer".into());
    }
    let stars = p.iter().filter(|w| **w == "*").count();
    if stars > 1 {
        return Err("pointers to pointers are not supported".into());
    }
    // `const` before the `*` makes the pointee read-only; after it, only
    // the pointer itself.
    let star = p.iter().position(|w| *w == "*");
    let before = &p[..star.unwrap_or(p.len())];
    let pointee_const = before.contains(&"const");
    let mut words: Vec<&str> = before
        .iter()
        .copied()
        .filter(|w| !matches!(*w, "const" | "volatile" | "__restrict__" | "restrict"))
        .collect();
    let after: Vec<&str> = star
        .map(|s| &p[s + 1..])
        .unwrap_or(&[])
        .iter()
        .copied()
        .filter(|w| !matches!(*w, "const" | "volatile" | "__restrict__" | "restrict"))
        .collect();
    // The name: the last identifier after the `*`, or (by value) the last
    // word when more than the type is written.
    let name = match star {
        Some(_) => match after.as_slice() {
            [] => None,
            [n] => Some(n.to_string()),
            _ => return Err(format!("unexpected `{}`", after.join(" "))),
        },
        None if words.len() > 1 && ctype(&words).is_none() => words.pop().map(str::to_string),
        None => None,
    };
    let ty = ctype(&words).ok_or_else(|| {
        format!(
            "`{}` is not a supported type (integers, float, double, size_t, \
             int8_t..uint64_t; structs are not)",
            words.join(" ")
        )
    })?;
    let passing = match (star, pointee_const) {
        (None, _) => Passing::Scalar,
        (Some(_), true) => Passing::Reads,
        (Some(_), false) => Passing::Writes,
    };
    Ok(Param { name, ty, passing })
}

/// The type named by `words` (qualifiers removed), if supported.
fn ctype(words: &[&str]) -> Option<CType> {
    use CType::*;
    Some(match words {
        ["float"] => F32,
        ["double"] => F64,
        ["__half"] | ["half"] => F16,
        ["char"] | ["signed", "char"] | ["int8_t"] => I8,
        ["unsigned", "char"] | ["uint8_t"] => U8,
        ["short"] | ["short", "int"] | ["signed", "short"] | ["int16_t"] => I16,
        ["unsigned", "short"] | ["unsigned", "short", "int"] | ["uint16_t"] => U16,
        ["int"] | ["signed"] | ["signed", "int"] | ["int32_t"] => I32,
        ["unsigned"] | ["unsigned", "int"] | ["uint32_t"] => U32,
        ["long", "long"] | ["long", "long", "int"] | ["signed", "long", "long"] | ["int64_t"] => {
            I64
        }
        ["unsigned", "long", "long"] | ["unsigned", "long", "long", "int"] | ["uint64_t"] => U64,
        ["size_t"] => Usize,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(name: &str, ty: CType, passing: Passing) -> Param {
        Param {
            name: Some(name.into()),
            ty,
            passing,
        }
    }

    #[test]
    fn a_corpus_of_real_world_signatures() {
        let src = r#"
            #include <cuda_fp16.h>
            // saxpy: y = a*x + y
            extern "C" __global__ void saxpy(float a, const float* __restrict__ x,
                                             float* __restrict__ y, unsigned n) {
                unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
                if (i < n) { y[i] = a * x[i] + y[i]; }
            }
            /* a reduction, multi-line,
               with a block comment */
            extern "C" __global__ void
            sum_reduce(
                const double *in,   // input
                double *out,        /* one per block */
                unsigned long long n
            ) { extern __shared__ double s[]; }
            extern "C" {
                __global__ void blur2d(const float* src, float* dst, int w, int h, size_t pitch) {}
                __global__ void fill_u8(uint8_t* p, uint8_t v, uint64_t n) {}
            }
            extern "C" __global__ void __launch_bounds__(256, 2)
                bounded(float const* a, float* const b, int32_t n) {}
            extern "C" __global__ void halves(const __half* a, __half* b, short k, unsigned short u) {}
            extern "C" __global__ void nothing(void) {}
            extern "C" __global__ void unnamed(const float*, float*, unsigned int) {}
            extern "C" __global__ void ints(signed char a, unsigned char b, long long c,
                                            int8_t d, int16_t e, int64_t f) {}
            extern "C" __global__ void vol(volatile int* flag, const volatile unsigned* seen) {}
            // Not extern "C": skipped (its name is mangled).
            __global__ void mangled(float* p) {}
            __device__ float helper(float x) { return x; }
            extern "C" __global__ void after_helper(double scale, double* v) {}
        "#;
        let ks = kernels(src).unwrap();
        let names: Vec<&str> = ks.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "saxpy",
                "sum_reduce",
                "blur2d",
                "fill_u8",
                "bounded",
                "halves",
                "nothing",
                "unnamed",
                "ints",
                "vol",
                "after_helper"
            ]
        );
        use CType::*;
        use Passing::*;
        assert_eq!(
            ks[0].params,
            [
                p("a", F32, Scalar),
                p("x", F32, Reads),
                p("y", F32, Writes),
                p("n", U32, Scalar)
            ]
        );
        assert_eq!(
            ks[1].params,
            [
                p("in", F64, Reads),
                p("out", F64, Writes),
                p("n", U64, Scalar)
            ]
        );
        assert_eq!(ks[2].params[4], p("pitch", Usize, Scalar));
        assert_eq!(ks[3].params[1], p("v", U8, Scalar));
        // `float const*` reads; `float* const` is a const pointer to
        // writable data.
        assert_eq!(ks[4].params[0], p("a", F32, Reads));
        assert_eq!(ks[4].params[1], p("b", F32, Writes));
        assert_eq!(ks[5].params[0], p("a", F16, Reads));
        assert_eq!(ks[5].params[3], p("u", U16, Scalar));
        assert!(ks[6].params.is_empty());
        assert_eq!(
            ks[7]
                .params
                .iter()
                .map(|p| (p.name.clone(), p.passing))
                .collect::<Vec<_>>(),
            [(None, Reads), (None, Writes), (None, Scalar)]
        );
        assert_eq!(
            ks[8].params.iter().map(|p| p.ty).collect::<Vec<_>>(),
            [I8, U8, I64, I8, I16, I64]
        );
        assert_eq!(ks[9].params[0], p("flag", I32, Writes));
        assert_eq!(ks[9].params[1], p("seen", U32, Reads));
        assert_eq!(ks[10].params[0], p("scale", F64, Scalar));
    }

    #[test]
    fn what_cannot_be_mapped_names_the_kernel_and_parameter() {
        let cases = [
            (
                r#"extern "C" __global__ void k(float* p, struct Foo f) {}"#,
                "kernel `k`: parameter 1 (`struct Foo f`)",
            ),
            (
                r#"extern "C" __global__ void k(float** pp) {}"#,
                "pointers to pointers",
            ),
            (
                r#"extern "C" __global__ void k(int n = 4) {}"#,
                "default arguments",
            ),
            (
                r#"extern "C" __global__ void k(float4 v) {}"#,
                "`float4` is not a supported type",
            ),
            (
                r#"template <typename T> __global__ void k(T* p) {}
                   extern "C" __global__ void ok(float* p) {}"#,
                "kernel `k`: templates",
            ),
            (
                r#"extern "C" __global__ int k(float* p) {}"#,
                "returns `void`",
            ),
        ];
        for (src, want) in cases {
            let e = kernels(src).unwrap_err().to_string();
            assert!(e.contains(want), "{src}\n  gave {e:?}, wanted {want:?}");
        }
    }

    #[test]
    fn comments_and_strings_do_not_confuse_it() {
        let src = r#"
            // extern "C" __global__ void commented(float* p) {}
            /* extern "C" __global__ void also(float* p) {} */
            const char* s = "extern \"C\" __global__ void in_a_string(int x)";
            extern "C" __global__ void real(const unsigned long long* t) {}
        "#;
        let ks = kernels(src).unwrap();
        assert_eq!(ks.len(), 1);
        assert_eq!(ks[0].name, "real");
        assert_eq!(ks[0].params[0].ty.rust(), "u64");
        assert_eq!(ks[0].params[0].passing, Passing::Reads);
    }
}
