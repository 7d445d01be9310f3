use std::fmt;

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};

/// Op for [`DeviceOpExt::then`](crate::DeviceOpExt::then).
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Then<A, F> {
    first: A,
    f: F,
}

impl<A, F> Then<A, F> {
    pub(crate) fn new(first: A, f: F) -> Self {
        Then { first, f }
    }
}

impl<A, F> fmt::Debug for Then<A, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Then").finish_non_exhaustive()
    }
}

impl<A, B, F> DeviceOp for Then<A, F>
where
    A: DeviceOp,
    B: DeviceOp,
    F: FnOnce(<A as DeviceOp>::Output) -> B + Send,
{
    type Output = <B as DeviceOp>::Output;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<<B as DeviceOp>::Output> {
        // SAFETY: same context and caller contract, forwarded.
        let a = unsafe { self.first.execute(ctx) }?;
        let next = (self.f)(a);
        // SAFETY: as above; `next` is enqueued after `first` on the same stream.
        unsafe { next.execute(ctx) }
    }
}

impl_into_future!(impl[A, B, F] for Then<A, F> where A: DeviceOp, B: DeviceOp, F: FnOnce(<A as DeviceOp>::Output) -> B + Send);
