use std::fmt;

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};

/// The object-safe face of [`DeviceOp`].
trait DynOp<T>: Send {
    /// # Safety
    /// As [`DeviceOp::execute`].
    unsafe fn execute_boxed(self: Box<Self>, ctx: &mut ExecutionContext) -> Result<T>;
}

impl<O: DeviceOp> DynOp<<O as DeviceOp>::Output> for O {
    unsafe fn execute_boxed(
        self: Box<Self>,
        ctx: &mut ExecutionContext,
    ) -> Result<<O as DeviceOp>::Output> {
        // SAFETY: forwarded.
        unsafe { (*self).execute(ctx) }
    }
}

/// A type-erased op ([`DeviceOpExt::boxed`](crate::DeviceOpExt::boxed)).
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Boxed<'a, T>(Box<dyn DynOp<T> + 'a>);

/// Alias of [`Boxed`], the name used in signatures.
pub type BoxedOp<'a, T> = Boxed<'a, T>;

impl<'a, T> Boxed<'a, T> {
    pub(crate) fn new<O: DeviceOp<Output = T> + 'a>(op: O) -> Self {
        Boxed(Box::new(op))
    }
}

impl<T> fmt::Debug for Boxed<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Boxed").finish_non_exhaustive()
    }
}

impl<T: Send> DeviceOp for Boxed<'_, T> {
    type Output = T;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<T> {
        // SAFETY: forwarded.
        unsafe { self.0.execute_boxed(ctx) }
    }
}

impl_into_future!(impl['a, T: Send] for Boxed<'a, T>);
