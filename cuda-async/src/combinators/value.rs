use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};

/// Op for [`value`]: yields a host value, enqueues nothing.
#[derive(Debug, Clone)]
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Value<T>(T);

/// An op that yields `v` (to start a chain, or as a `then` result).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// assert_eq!(value("hi").sync()?, "hi");
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn value<T: Send>(v: T) -> Value<T> {
    Value(v)
}

impl<T: Send> DeviceOp for Value<T> {
    type Output = T;

    unsafe fn execute(self, _ctx: &mut ExecutionContext) -> Result<T> {
        Ok(self.0)
    }
}

impl_into_future!(impl[T: Send] for Value<T>);
