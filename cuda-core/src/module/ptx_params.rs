//! The parameter lists of a PTX module's `.entry` points, read from its
//! text so launches can be checked against them.

use std::collections::HashMap;
use std::fmt;

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
/// [`Kernel::params`](super::Kernel::params)).
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
        // then the next symbol is `{` before any `(`.
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
