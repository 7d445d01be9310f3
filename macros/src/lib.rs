//! Procedural macros of `cuda-async`: an implementation detail, used
//! through `cuda-async`'s re-exports (`cuda_async::kernels!`), never
//! directly.
//!
//! [`kernels!`] reads a CUDA C file at compile time, parses the signatures
//! of its `extern "C" __global__` kernels (`signature.rs`) and generates a
//! typed launcher per kernel. The generated code reaches the runtime only
//! through `cuda_async::__private`, so it has nothing backend-specific: the
//! launchers build the same lazy `Launch` op that `cuda_async::launch` does.

use std::path::PathBuf;

use proc_macro::{Delimiter, Group, Ident, Literal, Punct, Spacing, Span, TokenStream, TokenTree};

mod signature;

use signature::{CType, Kernel, Passing};

/// The most parameters a kernel may have (the arity of the argument tuples
/// `cuda-async` implements `KernelArgs` for).
const MAX_PARAMS: usize = 12;

/// Generates a typed launcher for every `extern "C" __global__` kernel of
/// a CUDA C file. See `cuda_async::kernels!` for the documentation.
#[proc_macro]
pub fn kernels(input: TokenStream) -> TokenStream {
    match expand(input) {
        Ok(ts) => ts,
        Err((span, msg)) => error(span, &msg),
    }
}

type Failure = (Span, String);

/// The macro's input: the `.cu` path and an optional precompiled PTX path.
struct Input {
    cu: (String, Span),
    ptx: Option<(String, Span)>,
}

fn expand(input: TokenStream) -> Result<TokenStream, Failure> {
    let input = parse_input(input)?;
    let (cu_rel, cu_span) = &input.cu;
    let cu_path = resolve(cu_rel);
    let source = std::fs::read_to_string(&cu_path).map_err(|e| {
        (
            *cu_span,
            format!(
                "kernels!: cannot read `{cu_rel}` ({}): {e}; the path is relative to the \
                 calling crate's directory (CARGO_MANIFEST_DIR)",
                cu_path.display()
            ),
        )
    })?;
    if source.contains('\0') {
        return Err((
            *cu_span,
            format!("kernels!: `{cu_rel}` contains a NUL byte"),
        ));
    }
    let kernels = signature::kernels(&source)
        .map_err(|e| (*cu_span, format!("kernels!: `{cu_rel}`: {e}")))?;
    if kernels.is_empty() {
        return Err((
            *cu_span,
            format!("kernels!: `{cu_rel}` has no `extern \"C\" __global__` kernel"),
        ));
    }
    for k in &kernels {
        check_kernel(k).map_err(|m| (*cu_span, format!("kernels!: `{cu_rel}`: {m}")))?;
    }
    let ptx = match &input.ptx {
        None => None,
        Some((rel, span)) => {
            let path = resolve(rel);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                (
                    *span,
                    format!(
                        "kernels!: cannot read the PTX `{rel}` ({}): {e}",
                        path.display()
                    ),
                )
            })?;
            if text.contains('\0') {
                return Err((*span, format!("kernels!: `{rel}` contains a NUL byte")));
            }
            for k in &kernels {
                if !ptx_has_entry(&text, &k.name) {
                    return Err((
                        *span,
                        format!(
                            "kernels!: the PTX `{rel}` has no `.entry {}` (is it compiled from \
                             `{cu_rel}`?)",
                            k.name
                        ),
                    ));
                }
            }
            Some(path)
        }
    };
    let code = generate(cu_rel, &cu_path, ptx.as_ref(), &kernels);
    code.parse::<TokenStream>().map_err(|e| {
        (
            Span::call_site(),
            format!("kernels!: internal error, generated code does not parse: {e}"),
        )
    })
}

fn resolve(rel: &str) -> PathBuf {
    let base = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(PathBuf::new, PathBuf::from);
    base.join(rel)
}

fn ptx_has_entry(ptx: &str, name: &str) -> bool {
    ptx.match_indices(".entry").any(|(i, m)| {
        let rest = ptx[i + m.len()..].trim_start();
        rest.strip_prefix(name)
            .is_some_and(|r| r.starts_with(|c: char| c == '(' || c.is_whitespace()))
    })
}

/// What the parser accepts but a launcher cannot take yet.
fn check_kernel(k: &Kernel) -> Result<(), String> {
    if k.params.len() > MAX_PARAMS {
        return Err(format!(
            "kernel `{}` has {} parameters; launchers take at most {MAX_PARAMS}",
            k.name,
            k.params.len()
        ));
    }
    for (i, p) in k.params.iter().enumerate() {
        if p.ty == CType::F16 {
            return Err(format!(
                "kernel `{}`: parameter {i} (`{}`): `__half` has no Rust type in cuda-async yet",
                k.name,
                c_decl(p, i)
            ));
        }
    }
    Ok(())
}

fn parse_input(input: TokenStream) -> Result<Input, Failure> {
    let mut tokens = flatten(input).into_iter().peekable();
    let cu = match tokens.next() {
        Some(TokenTree::Literal(l)) => (string_value(&l)?, l.span()),
        Some(t) => return Err((t.span(), usage())),
        None => return Err((Span::call_site(), usage())),
    };
    let mut ptx = None;
    match tokens.next() {
        None => {}
        Some(TokenTree::Punct(p)) if p.as_char() == ',' => match tokens.next() {
            None => {}
            Some(TokenTree::Ident(id)) if id.to_string() == "ptx" => {
                match tokens.next() {
                    Some(TokenTree::Punct(p)) if p.as_char() == '=' => {}
                    Some(t) => return Err((t.span(), usage())),
                    None => return Err((id.span(), usage())),
                }
                match tokens.next() {
                    Some(TokenTree::Literal(l)) => ptx = Some((string_value(&l)?, l.span())),
                    Some(t) => return Err((t.span(), usage())),
                    None => return Err((id.span(), usage())),
                }
                if let Some(TokenTree::Punct(p)) = tokens.peek() {
                    if p.as_char() == ',' {
                        tokens.next();
                    }
                }
            }
            Some(t) => return Err((t.span(), usage())),
        },
        Some(t) => return Err((t.span(), usage())),
    }
    if let Some(t) = tokens.next() {
        return Err((t.span(), usage()));
    }
    Ok(Input { cu, ptx })
}

fn usage() -> String {
    "kernels! takes a path to a CUDA C file, relative to the crate's directory: \
     `kernels!(\"kernels/saxpy.cu\")` or `kernels!(\"kernels/saxpy.cu\", ptx = \"kernels/saxpy.ptx\")`"
        .to_string()
}

/// The tokens, with invisible groups (from `macro_rules!` forwarding)
/// opened.
fn flatten(input: TokenStream) -> Vec<TokenTree> {
    let mut out = Vec::new();
    for t in input {
        match t {
            TokenTree::Group(g) if g.delimiter() == Delimiter::None => {
                out.extend(flatten(g.stream()));
            }
            t => out.push(t),
        }
    }
    out
}

/// The value of a plain or raw string literal.
fn string_value(l: &Literal) -> Result<String, Failure> {
    let s = l.to_string();
    let bad = || (l.span(), usage());
    if let Some(rest) = s.strip_prefix('r') {
        let hashes = rest.len() - rest.trim_start_matches('#').len();
        let inner = &rest[hashes..];
        let inner = inner
            .strip_prefix('"')
            .and_then(|r| r.strip_suffix(&"#".repeat(hashes)))
            .and_then(|r| r.strip_suffix('"'))
            .ok_or_else(bad)?;
        return Ok(inner.to_string());
    }
    let inner = s
        .strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .ok_or_else(bad)?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('\\') => out.push('\\'),
            Some('"') => out.push('"'),
            Some('\'') => out.push('\''),
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            _ => return Err((l.span(), "kernels!: use a path without escapes".into())),
        }
    }
    Ok(out)
}

/// `::core::compile_error! { "msg" }` at `span`.
fn error(span: Span, msg: &str) -> TokenStream {
    let mut lit = Literal::string(msg);
    lit.set_span(span);
    let punct = |c: char, spacing: Spacing| {
        let mut p = Punct::new(c, spacing);
        p.set_span(span);
        TokenTree::Punct(p)
    };
    let mut g = Group::new(Delimiter::Brace, TokenStream::from(TokenTree::Literal(lit)));
    g.set_span(span);
    [
        punct(':', Spacing::Joint),
        punct(':', Spacing::Alone),
        TokenTree::Ident(Ident::new("core", span)),
        punct(':', Spacing::Joint),
        punct(':', Spacing::Alone),
        TokenTree::Ident(Ident::new("compile_error", span)),
        punct('!', Spacing::Alone),
        TokenTree::Group(g),
    ]
    .into_iter()
    .collect()
}

/// The C spelling of a type, for the docs.
fn c_type(t: CType) -> &'static str {
    match t {
        CType::F32 => "float",
        CType::F64 => "double",
        CType::F16 => "__half",
        CType::I8 => "int8_t",
        CType::U8 => "uint8_t",
        CType::I16 => "short",
        CType::U16 => "unsigned short",
        CType::I32 => "int",
        CType::U32 => "unsigned int",
        CType::I64 => "long long",
        CType::U64 => "unsigned long long",
        CType::Usize => "size_t",
    }
}

fn c_decl(p: &signature::Param, i: usize) -> String {
    let name = p.name.clone().unwrap_or_else(|| format!("/* {i} */"));
    match p.passing {
        Passing::Scalar => format!("{} {name}", c_type(p.ty)),
        Passing::Reads => format!("const {}* {name}", c_type(p.ty)),
        Passing::Writes => format!("{}* {name}", c_type(p.ty)),
    }
}

const KEYWORDS: &[&str] = &[
    "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern",
    "false", "fn", "for", "gen", "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut",
    "pub", "ref", "return", "self", "Self", "static", "struct", "super", "trait", "true", "type",
    "unsafe", "use", "where", "while", "abstract", "become", "box", "do", "final", "macro",
    "override", "priv", "try", "typeof", "unsized", "virtual", "yield",
];

/// A Rust identifier for a C one.
fn rust_ident(name: &str) -> String {
    if KEYWORDS.contains(&name) {
        if matches!(name, "self" | "Self" | "super" | "crate") {
            format!("{name}_")
        } else {
            format!("r#{name}")
        }
    } else {
        name.to_string()
    }
}

/// Parameter names: the C names, made unique against the launcher's own
/// `config` (and named `argN` where the source gives none).
fn param_names(k: &Kernel) -> Vec<String> {
    k.params
        .iter()
        .enumerate()
        .map(|(i, p)| match &p.name {
            Some(n) if n == "config" => "config_".to_string(),
            Some(n) => rust_ident(n),
            None => format!("arg{i}"),
        })
        .collect()
}

fn generate(
    cu_rel: &str,
    cu_path: &std::path::Path,
    ptx: Option<&PathBuf>,
    kernels: &[Kernel],
) -> String {
    let lit = |s: &str| format!("{s:?}");
    let names: Vec<String> = kernels.iter().map(|k| lit(&k.name)).collect();
    let cell = match ptx {
        None => format!(
            "::cuda_async::__private::ModuleCell::new(::core::include_str!({}), &[{}])",
            lit(&cu_path.display().to_string()),
            names.join(", ")
        ),
        // The `.cu` is still included: a change to it rebuilds the crate.
        Some(p) => format!(
            "{{ const _: &str = ::core::include_str!({}); \
             ::cuda_async::__private::ModuleCell::new_ptx(::core::include_str!({}), &[{}]) }}",
            lit(&cu_path.display().to_string()),
            lit(&p.display().to_string()),
            names.join(", ")
        ),
    };
    let mut out = String::new();
    out.push_str(&format!(
        "#[doc(hidden)]\n\
         #[allow(unreachable_pub)]\n\
         pub static __CUDA_ASYNC_KERNELS: ::cuda_async::__private::ModuleCell = {cell};\n\
         /// The module of `{cu_rel}` (all of its kernels), e.g. to compile it \
         /// on a device at start-up: `module().load_on(&device)?`.\n\
         #[allow(unreachable_pub, dead_code)]\n\
         pub fn module() -> ::cuda_async::__private::Module {{ __CUDA_ASYNC_KERNELS.module() }}\n"
    ));
    for (ki, k) in kernels.iter().enumerate() {
        let pnames = param_names(k);
        let mut generics = Vec::new();
        let mut bounds = Vec::new();
        let mut params = vec!["config: ::cuda_async::__private::LaunchConfig".to_string()];
        let mut tuple_types = Vec::new();
        let mut rows = Vec::new();
        for (i, (p, name)) in k.params.iter().zip(&pnames).enumerate() {
            let rust = p.ty.rust();
            let c = c_decl(p, i);
            match p.passing {
                Passing::Scalar => {
                    params.push(format!("{name}: {rust}"));
                    tuple_types.push(rust.to_string());
                    rows.push(format!("/// | `{name}` | `{c}` | `{rust}`, by value |\n"));
                }
                Passing::Reads | Passing::Writes => {
                    let g = format!("B{i}");
                    let (tr, what) = if p.passing == Passing::Reads {
                        ("BufferIn", "a buffer it reads: `DeviceBuffer`, `&DeviceBuffer`, `&mut DeviceBuffer` or `Arc<DeviceBuffer>`")
                    } else {
                        (
                            "BufferOut",
                            "a buffer it may write: `DeviceBuffer` or `&mut DeviceBuffer`",
                        )
                    };
                    bounds.push(format!("{g}: ::cuda_async::__private::{tr}<{rust}>"));
                    params.push(format!("{name}: {g}"));
                    tuple_types.push(g.clone());
                    generics.push(g);
                    rows.push(format!("/// | `{name}` | `{c}` | {what} of `{rust}` |\n"));
                }
            }
        }
        let sig: Vec<String> = k
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| c_decl(p, i))
            .collect();
        let fn_name = rust_ident(&k.name);
        let generics = if generics.is_empty() {
            String::new()
        } else {
            format!("<{}>", generics.join(", "))
        };
        let where_clause = if bounds.is_empty() {
            String::new()
        } else {
            format!("where {}", bounds.join(", "))
        };
        let tuple: Vec<String> = pnames.iter().map(|n| format!("{n},")).collect();
        let tuple_ty: Vec<String> = tuple_types.iter().map(|t| format!("{t},")).collect();
        out.push_str(&format!(
            "/// Launches the CUDA C kernel `{kname}` of `{cu_rel}` with `config`:\n\
             ///\n\
             /// ```c\n\
             /// extern \"C\" __global__ void {kname}({sig})\n\
             /// ```\n\
             ///\n\
             /// | parameter | C | Rust |\n\
             /// | --- | --- | --- |\n\
             {rows}\
             ///\n\
             /// A lazy op (run it with `.sync()`, `.await`, `then`...) that yields its \
             /// arguments back, in order, so owned buffers flow on to the next op.\n\
             ///\n\
             /// # Safety\n\
             ///\n\
             /// The kernel is arbitrary device code, as with `cuda_async::launch`: \
             /// the caller guarantees that, with these arguments and `config`, it \
             /// accesses only memory inside the buffers passed (a length argument \
             /// matches the buffers' lengths) and does not race with itself. Checked \
             /// for you at compile time: the argument count, the scalar types, the \
             /// buffer element types, and that buffers the kernel may write (`T*`) \
             /// are passed owned or by `&mut`; at run time, the launch configuration \
             /// against the hardware limits.\n\
             #[allow(clippy::too_many_arguments, clippy::undocumented_unsafe_blocks, \
             non_snake_case, unreachable_pub, dead_code)]\n\
             pub unsafe fn {fn_name}{generics}({params}) -> \
             ::cuda_async::__private::Launch<({tuple_ty})> {where_clause} {{\n\
             unsafe {{ ::cuda_async::launch(__CUDA_ASYNC_KERNELS.kernel({ki}), config, ({tuple})) }}\n\
             }}\n",
            kname = k.name,
            sig = sig.join(", "),
            rows = rows.concat(),
            params = params.join(", "),
            tuple_ty = tuple_ty.concat(),
            tuple = tuple.concat(),
        ));
    }
    out
}
