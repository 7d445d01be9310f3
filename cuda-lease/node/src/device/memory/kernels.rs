//! The test double's host kernels, and the entry names it reads from a
//! module's text (it runs no compiler).

use std::collections::HashMap;

use crate::proto::SourceKind;

/// How long loading a CUDA C module takes on the test double: `N` ms for
/// a line `// compile-ms: N`, else none.
pub(super) fn compile_time(text: &str) -> std::time::Duration {
    let ms = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("// compile-ms:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    std::time::Duration::from_millis(ms)
}

/// The entry names of a module's text: `.entry NAME` in PTX,
/// `__global__ ... NAME(` in CUDA C.
pub(super) fn entry_names(kind: &SourceKind, text: &str) -> Vec<String> {
    let ident = |rest: &str| -> Option<String> {
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        (!name.is_empty()).then_some(name)
    };
    match kind {
        SourceKind::Ptx => text.split(".entry").skip(1).filter_map(ident).collect(),
        SourceKind::Cuda { .. } => text
            .split("__global__")
            .skip(1)
            .filter_map(|rest| {
                let head = rest.split('(').next()?;
                ident(head.split_whitespace().last()?)
            })
            .collect(),
    }
}

#[derive(Debug, Clone)]
pub(super) enum HostArg {
    Scalar(Vec<u8>),
    Mem { slot: usize, offset: usize },
}

/// Runs a test kernel on the host; true when it touched memory outside a
/// buffer (an illegal address). Arguments were checked at enqueue.
pub(super) fn host_kernel(
    store: &mut HashMap<usize, Vec<u8>>,
    kernel: &str,
    threads: u64,
    args: &[HostArg],
) -> bool {
    let n = |a: &HostArg| u64::from(u32::from_le_bytes(scalar(a))).min(threads);
    let f = |a: &HostArg| f32::from_le_bytes(scalar(a));
    match (kernel, args) {
        ("iota", [out, count]) => {
            for i in 0..n(count) {
                let Some(o) = at(store, out, i) else {
                    return true;
                };
                put(store, o, (i as u32).to_le_bytes());
            }
        }
        ("vadd", [a, b, c, count]) => {
            for i in 0..n(count) {
                let (Some(ia), Some(ib), Some(ic)) =
                    (at(store, a, i), at(store, b, i), at(store, c, i))
                else {
                    return true;
                };
                let v = f32::from_le_bytes(get(store, ia)) + f32::from_le_bytes(get(store, ib));
                put(store, ic, v.to_le_bytes());
            }
        }
        ("fill", [out, v, count]) => {
            for i in 0..n(count) {
                let Some(o) = at(store, out, i) else {
                    return true;
                };
                put(store, o, f(v).to_le_bytes());
            }
        }
        ("axpy", [a, x, y, count]) => {
            for i in 0..n(count) {
                let (Some(ix), Some(iy)) = (at(store, x, i), at(store, y, i)) else {
                    return true;
                };
                let v =
                    f(a) * f32::from_le_bytes(get(store, ix)) + f32::from_le_bytes(get(store, iy));
                put(store, iy, v.to_le_bytes());
            }
        }
        ("copy", [src, dst, count]) => {
            for i in 0..n(count) {
                let (Some(is), Some(id)) = (at(store, src, i), at(store, dst, i)) else {
                    return true;
                };
                let v = get(store, is);
                put(store, id, v);
            }
        }
        ("bias_relu", [h, b, rows, cols]) => {
            // h (rows x cols, column-major) = max(h + b[row], 0)
            let (r, c) = (u64::from(u32::from_le_bytes(scalar(rows))), n(cols));
            for i in 0..(r * c).min(threads) {
                let (Some(ih), Some(ib)) = (at(store, h, i), at(store, b, i % r)) else {
                    return true;
                };
                let v = f32::from_le_bytes(get(store, ih)) + f32::from_le_bytes(get(store, ib));
                put(store, ih, v.max(0.0).to_le_bytes());
            }
        }
        ("softmax_columns", [z, rows, cols]) => {
            // Each column of z (rows x cols) becomes its softmax.
            let r = u64::from(u32::from_le_bytes(scalar(rows)));
            for j in 0..n(cols) {
                let Some(at_i): Option<Vec<_>> = (0..r).map(|i| at(store, z, j * r + i)).collect()
                else {
                    return true;
                };
                let v: Vec<f32> = at_i
                    .iter()
                    .map(|&p| f32::from_le_bytes(get(store, p)))
                    .collect();
                let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = v.iter().map(|x| (x - m).exp()).collect();
                let sum: f32 = e.iter().sum();
                for (p, x) in at_i.into_iter().zip(e) {
                    put(store, p, (x / sum).to_le_bytes());
                }
            }
        }
        _ => {}
    }
    false
}

/// A 4-byte scalar argument's bytes (zeros for any other argument).
fn scalar(a: &HostArg) -> [u8; 4] {
    match a {
        HostArg::Scalar(b) if b.len() == 4 => [b[0], b[1], b[2], b[3]],
        _ => [0; 4],
    }
}

/// Byte position of element `i` of a memory argument, if in bounds.
fn at(store: &HashMap<usize, Vec<u8>>, a: &HostArg, i: u64) -> Option<(usize, usize)> {
    let HostArg::Mem { slot, offset } = a else {
        return None;
    };
    let start = offset.checked_add(usize::try_from(i).ok()?.checked_mul(4)?)?;
    let b = store.get(slot)?;
    (start + 4 <= b.len()).then_some((*slot, start))
}

/// The 4 bytes at a position from [`at`].
fn get(store: &HashMap<usize, Vec<u8>>, (s, p): (usize, usize)) -> [u8; 4] {
    let b = &store[&s][p..p + 4];
    [b[0], b[1], b[2], b[3]]
}

/// Stores 4 bytes at a position from [`at`].
fn put(store: &mut HashMap<usize, Vec<u8>>, (s, p): (usize, usize), v: [u8; 4]) {
    if let Some(b) = store.get_mut(&s) {
        b[p..p + 4].copy_from_slice(&v);
    }
}

/// How long a launch of `kernel` takes on the test double's clock:
/// `delay(ms)` takes `ms` milliseconds of its stream's time, others none.
pub(super) fn host_kernel_time(kernel: &str, args: &[HostArg]) -> std::time::Duration {
    match (kernel, args) {
        ("delay", [ms]) => {
            std::time::Duration::from_millis(u64::from(u32::from_le_bytes(scalar(ms))))
        }
        _ => std::time::Duration::ZERO,
    }
}

/// The host test kernels' argument shapes: `m` memory, `s` a 4-byte scalar.
pub(super) fn host_kernel_shape(kernel: &str) -> Option<&'static str> {
    Some(match kernel {
        "iota" => "ms",
        "vadd" => "mmms",
        "fill" => "mss",
        "axpy" => "smms",
        "copy" => "mms",
        "bias_relu" => "mmss",
        "softmax_columns" => "mss",
        "delay" => "s",
        "spin" | "__fault" | "__hang" | "__exit" => "",
        _ => return None,
    })
}
