//! [`ModuleSpec`]: a module as a description (source and content hash).

use std::sync::Arc;

use crate::{ModuleHash, SourceKind};

/// A module's source (PTX, or CUDA C with NVRTC options) and content hash,
/// bound to no node: a batch carries the source the first time a node needs
/// it. Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleSpec {
    hash: ModuleHash,
    kind: SourceKind,
    text: Arc<str>,
}

impl ModuleSpec {
    /// A PTX module.
    pub fn ptx(text: impl Into<Arc<str>>) -> Self {
        Self::new(SourceKind::Ptx, text.into())
    }

    /// A CUDA C module with NVRTC options (the node adds its GPU's
    /// architecture unless an option names one).
    pub fn cuda(source: impl Into<Arc<str>>, options: &[&str]) -> Self {
        let options = options.iter().map(|o| (*o).to_owned()).collect();
        Self::new(SourceKind::Cuda { options }, source.into())
    }

    fn new(kind: SourceKind, text: Arc<str>) -> Self {
        Self {
            hash: ModuleHash::of(&kind, &text),
            kind,
            text,
        }
    }

    /// The content hash that names it on the wire.
    pub fn hash(&self) -> ModuleHash {
        self.hash
    }

    /// What its text is.
    pub fn kind(&self) -> &SourceKind {
        &self.kind
    }

    /// Its source text.
    pub fn text(&self) -> &str {
        &self.text
    }
}
