use std::fmt;

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};

/// Op for [`DeviceOpExt::map`](crate::DeviceOpExt::map).
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Map<A, F> {
    op: A,
    f: F,
}

impl<A, F> Map<A, F> {
    pub(crate) fn new(op: A, f: F) -> Self {
        Map { op, f }
    }
}

impl<A, F> fmt::Debug for Map<A, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Map").finish_non_exhaustive()
    }
}

impl<A, U, F> DeviceOp for Map<A, F>
where
    A: DeviceOp,
    U: Send,
    F: FnOnce(<A as DeviceOp>::Output) -> U + Send,
{
    type Output = U;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<U> {
        // SAFETY: same context and caller contract, forwarded.
        let a = unsafe { self.op.execute(ctx) }?;
        Ok((self.f)(a))
    }
}

impl_into_future!(impl[A, U, F] for Map<A, F> where A: DeviceOp, U: Send, F: FnOnce(<A as DeviceOp>::Output) -> U + Send);
