//! Hand-written PTX kernels for tests, examples and smoke checks of a node
//! (`.version 7.0`, `.target sm_70`: any Volta or newer GPU JIT-compiles them).

/// One module with three kernels:
///
/// - `iota(u32* out, u32 n)`: `out[i] = i` for `i < n`;
/// - `vadd(const f32* a, const f32* b, f32* c, u32 n)`: `c[i] = a[i] + b[i]`;
/// - `fault()`: stores to address 0, an illegal address (for fault isolation tests).
pub const TEST_KERNELS: &str = r#".version 7.0
.target sm_70
.address_size 64

.visible .entry iota(
    .param .u64 out,
    .param .u32 n
)
{
    .reg .pred %p;
    .reg .b32 %r<6>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p, %r5, %r1;
    @%p bra IOTA_DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd4, %rd2, %rd3;
    st.global.u32 [%rd4], %r5;
IOTA_DONE:
    ret;
}

.visible .entry vadd(
    .param .u64 a,
    .param .u64 b,
    .param .u64 c,
    .param .u32 n
)
{
    .reg .pred %p;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<11>;

    ld.param.u64 %rd1, [a];
    ld.param.u64 %rd2, [b];
    ld.param.u64 %rd3, [c];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p, %r5, %r1;
    @%p bra VADD_DONE;
    cvta.to.global.u64 %rd4, %rd1;
    cvta.to.global.u64 %rd5, %rd2;
    cvta.to.global.u64 %rd6, %rd3;
    mul.wide.u32 %rd7, %r5, 4;
    add.s64 %rd8, %rd4, %rd7;
    add.s64 %rd9, %rd5, %rd7;
    add.s64 %rd10, %rd6, %rd7;
    ld.global.f32 %f1, [%rd8];
    ld.global.f32 %f2, [%rd9];
    add.f32 %f3, %f1, %f2;
    st.global.f32 [%rd10], %f3;
VADD_DONE:
    ret;
}

.visible .entry fault()
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<2>;

    mov.u64 %rd1, 0;
    mov.u32 %r1, 42;
    st.global.u32 [%rd1], %r1;
    ret;
}
"#;

/// Threads per block used with [`TEST_KERNELS`] by the tests and examples.
pub const BLOCK: u32 = 256;

/// Blocks needed to cover `n` elements with [`BLOCK`] threads each.
pub fn grid_for(n: u32) -> u32 {
    n.div_ceil(BLOCK)
}
