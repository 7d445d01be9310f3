//! The library-call primitive (features `blas`, `rand`): a cuBLAS or
//! cuRAND call on the local stream, or recorded for the node's own library.

use std::sync::Arc;

use cuda_core::cudarc::driver::CudaStream;
use cuda_core::Result;

use super::ExecutionContext;
use crate::foreign::{run_foreign, StreamUses};
use crate::remote::RemoteContext;

impl ExecutionContext {
    /// A library call (cuBLAS, cuRAND...) over `uses`: locally `local` runs
    /// on the stream between the uses' ordering and their recording;
    /// remotely `remote` records the call for the node's own library.
    pub(crate) fn library_call<U: StreamUses>(
        &mut self,
        name: &str,
        uses: &U,
        remote: impl FnOnce(&mut RemoteContext, &U) -> Result<()>,
        local: impl FnOnce(&Arc<CudaStream>, U::Ptrs) -> Result<()>,
    ) -> Result<()> {
        if let Some(r) = self.as_remote() {
            return remote(r, uses);
        }
        run_foreign(self, name, uses, local)
    }
}
