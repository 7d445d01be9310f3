//! The protocol's form of a `cuda-core` module (its source, named by its
//! content hash), made once per module: launches name their module by hash,
//! and hashing its text on every submission would cost more than recording it.

use std::sync::Mutex;

use cuda_core::{Module, ModuleSource};

use super::proto;

/// Modules whose protocol form is kept; past this the oldest goes (remade on use).
const KEPT: usize = 64;

static MODULES: Mutex<Vec<(Module, proto::ModuleSpec)>> = Mutex::new(Vec::new());

/// `m` as the protocol describes it: its source and its content hash.
pub(crate) fn wire_module(m: &Module) -> proto::ModuleSpec {
    let mut kept = MODULES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, w)) = kept.iter().find(|(k, _)| k == m) {
        return w.clone();
    }
    let wire = match m.source() {
        ModuleSource::Cuda { source, options } => {
            let opts: Vec<&str> = options.iter().map(String::as_str).collect();
            proto::ModuleSpec::cuda(source.as_str(), &opts)
        }
        other => proto::ModuleSpec::ptx(other.text()),
    };
    if kept.len() == KEPT {
        kept.remove(0);
    }
    kept.push((m.clone(), wire.clone()));
    wire
}
