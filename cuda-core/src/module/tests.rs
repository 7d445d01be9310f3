//! Unit tests of module descriptions, PTX parameter lists and the cache.

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
fn modules_and_kernels_are_made_without_a_driver() {
    let m = Module::cuda("extern \"C\" __global__ void k(int* p) { *p = 1; }", &[]).unwrap();
    let k = m.kernel("k").unwrap();
    assert_eq!(k.name(), "k");
    assert_eq!(k.module(), &m);
    assert!(
        k.params().is_none(),
        "CUDA C params are known after loading"
    );
    let p = Module::ptx(NVRTC_LIKE).unwrap();
    assert_eq!(p.kernel("axpy").unwrap().params().unwrap().len(), 4);
}

#[test]
fn hashes_cover_kind_options_and_text_but_not_the_name() {
    let a = Module::cuda("src", &["-O3"]).unwrap();
    let b = Module::cuda("src", &["-O2"]).unwrap();
    let c = Module::cuda("src2", &["-O3"]).unwrap();
    let d = Module::ptx("src").unwrap();
    let e = Module::cuda("src", &[]).unwrap();
    let hashes = [a.hash(), b.hash(), c.hash(), d.hash(), e.hash()];
    for i in 0..hashes.len() {
        for j in i + 1..hashes.len() {
            assert_ne!(hashes[i], hashes[j], "{i} vs {j}");
        }
    }
    // Option boundaries are part of the content.
    assert_ne!(
        Module::cuda("s", &["ab", "c"]).unwrap().hash(),
        Module::cuda("s", &["a", "bc"]).unwrap().hash()
    );
    let named = a.clone().named("kernels.cu");
    assert_eq!(named.hash(), a.hash());
    assert_eq!(named, a);
    assert_eq!(named.name(), "kernels.cu");
    assert!(a.name().starts_with("cuda-"), "{}", a.name());
    // Stable across processes: a fixed value.
    assert_eq!(Module::ptx("").unwrap().hash(), fnv1a64(b"ptx\0"));
}

#[test]
fn unknown_ptx_kernels_name_the_module_and_list_its_entries() {
    let m = Module::ptx(NVRTC_LIKE).unwrap().named("test.ptx");
    let e = m.kernel("axpz").unwrap_err();
    match &e {
        Error::KernelNotFound {
            name,
            module,
            entries,
        } => {
            assert_eq!((name.as_str(), module.as_str()), ("axpz", "test.ptx"));
            assert_eq!(entries, &["axpy", "bystruct", "noargs"]);
        }
        other => panic!("{other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("`axpz`")
            && msg.contains("test.ptx")
            && msg.contains("axpy, bystruct, noargs"),
        "{msg}"
    );
    assert!(Module::cuda("x", &[]).unwrap().kernel("").is_err());
    assert!(Module::cuda("x", &[]).unwrap().kernel("a\0b").is_err());
}

#[test]
fn nul_bytes_are_rejected_when_the_module_is_made() {
    assert!(Module::cuda("a\0b", &[]).is_err());
    assert!(Module::cuda("ab", &["-O\0"]).is_err());
    assert!(Module::ptx("a\0b").is_err());
}
