//! Layers 1 and 2 of the module docs: NVRTC options against the allow-list,
//! a source's includes against the headers the node offers.

use std::collections::BTreeSet;

/// Checks NVRTC options against the allow-list: architecture, language
/// standard, macros (`-D`, `-U`) and code-generation switches, in the long
/// and short spellings NVRTC accepts.
///
/// # Errors
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

/// Options allowed as they are.
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

/// Prefixes of the options that take `true` or `false`.
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

/// An option that takes a value: its spellings (prefixes up to the value)
/// and the value's check.
type ValueRule = (&'static [&'static str], fn(&str) -> bool);

/// The options that take a value; the first rule with a prefix the option
/// starts with decides.
const VALUED: [ValueRule; 7] = [
    (&BOOLS, |v| v == "true" || v == "false"),
    (&["--dopt=", "-dopt="], |v| v == "on" || v == "off"),
    (&["--maxrregcount=", "-maxrregcount="], |v| {
        !v.is_empty() && v.len() <= 4 && v.bytes().all(|b| b.is_ascii_digit())
    }),
    (&["--std=", "-std="], |v| {
        ["c++03", "c++11", "c++14", "c++17", "c++20"].contains(&v)
    }),
    (&["--gpu-architecture=", "-arch="], architecture_allowed),
    (&["--define-macro=", "-D"], |def| {
        let (name, value) = def.split_once('=').unwrap_or((def, ""));
        is_identifier(name) && forbidden_word(value).is_none()
    }),
    (&["--undefine-macro=", "-U"], is_identifier),
];

fn option_allowed(o: &str) -> bool {
    if o.contains(['\0', '\n', '\r']) {
        return false;
    }
    if FLAGS.contains(&o) {
        return true;
    }
    VALUED
        .iter()
        .find_map(|(prefixes, ok)| prefixes.iter().find_map(|p| o.strip_prefix(p)).map(ok))
        .unwrap_or(false)
}

/// `compute_` or `sm_`, then two or three digits, perhaps an `a` or `f`.
fn architecture_allowed(v: &str) -> bool {
    let Some(num) = v.strip_prefix("compute_").or_else(|| v.strip_prefix("sm_")) else {
        return false;
    };
    let num = num.strip_suffix(['a', 'f']).unwrap_or(num);
    (2..=3).contains(&num.len()) && num.bytes().all(|b| b.is_ascii_digit())
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

/// The text as the preprocessor's first phases see it: trigraphs and `%:`
/// replaced, carriage returns as line ends, line splices (a backslash,
/// optional blanks, a line end) joined. It may also rewrite text inside
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
/// Accepted: `#include <name>` or `#include "name"` alone on its line
/// (blanks and a trailing `//` comment allowed), `name` in `headers`.
/// Refused: any other `include`, `include_next`, `import`, `embed` or
/// `__has_include`, even in strings or block comments (a comment before `#`
/// can still start a directive); `#line` or a line marker `# 1 "file"` (they
/// rename the file diagnostics quote); a NUL byte. Lines starting with `//`
/// are not checked.
///
/// # Errors
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
}
