use std::fmt;

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};

/// Op for [`with_context`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct WithContext<F>(F);

impl<F> fmt::Debug for WithContext<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WithContext").finish_non_exhaustive()
    }
}

/// Builds an op from the execution context it will run in (its device,
/// stream, pool), at execution time.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let place = with_context(|ctx| value(ctx.describe())).sync()?;
/// assert!(place.starts_with("local GPU"));
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn with_context<B, F>(f: F) -> WithContext<F>
where
    B: DeviceOp,
    F: FnOnce(&ExecutionContext) -> B + Send,
{
    WithContext(f)
}

impl<B, F> DeviceOp for WithContext<F>
where
    B: DeviceOp,
    F: FnOnce(&ExecutionContext) -> B + Send,
{
    type Output = <B as DeviceOp>::Output;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<<B as DeviceOp>::Output> {
        let op = (self.0)(ctx);
        // SAFETY: same context and caller contract, forwarded.
        unsafe { op.execute(ctx) }
    }
}

impl_into_future!(impl[B, F] for WithContext<F> where B: DeviceOp, F: FnOnce(&ExecutionContext) -> B + Send);
