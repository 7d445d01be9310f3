//! The process-wide cache of modules loaded per device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaModule;

use super::{ModuleInner, ParamSpec};
use crate::error::Result;

/// A module loaded in one device's context, with its PTX parameter lists.
pub(crate) struct LoadedModule {
    pub(crate) module: Arc<CudaModule>,
    pub(super) entries: Arc<HashMap<String, Vec<ParamSpec>>>,
}

type CacheSlot = Arc<Mutex<Option<Result<Arc<LoadedModule>>>>>;

type Buckets = HashMap<(usize, u64), Vec<(Arc<ModuleInner>, CacheSlot)>>;

fn module_cache() -> &'static Mutex<Buckets> {
    static CACHE: OnceLock<Mutex<Buckets>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The process-wide module cache: (device, content hash) picks a bucket;
/// within it the content (kind, options, text) is compared in full. Loaded
/// modules stay for the life of the process (unless evicted with
/// [`Module::evict_on`]), so a launched kernel's module never unloads under
/// it.
pub(super) fn cache_entry(ordinal: usize, module: &Arc<ModuleInner>) -> CacheSlot {
    let mut cache = module_cache().lock().unwrap_or_else(|e| e.into_inner());
    let bucket = cache.entry((ordinal, module.hash)).or_default();
    if let Some((_, slot)) = bucket.iter().find(|(m, _)| m.source == module.source) {
        return slot.clone();
    }
    let slot = CacheSlot::default();
    bucket.push((module.clone(), slot.clone()));
    slot
}

pub(super) fn evict(ordinal: usize, module: &ModuleInner) {
    let mut cache = module_cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(bucket) = cache.get_mut(&(ordinal, module.hash)) {
        bucket.retain(|(m, _)| m.source != module.source);
        if bucket.is_empty() {
            cache.remove(&(ordinal, module.hash));
        }
    }
}
