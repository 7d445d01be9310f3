use std::fmt;

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::context::Fork;
use crate::op::{impl_into_future, DeviceOp};

/// Op for [`join_all`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct JoinAll<O>(Vec<O>);

impl<O> fmt::Debug for JoinAll<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinAll")
            .field("len", &self.0.len())
            .finish()
    }
}

/// Runs every op concurrently, spread round-robin over the pool's streams
/// (forked from and joined back to the parent stream); outputs in order.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let bufs = join_all((0..8).map(|i| h2d(vec![i as u32; 1024])).collect()).sync()?;
/// assert_eq!(bufs.len(), 8);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn join_all<O: DeviceOp>(ops: Vec<O>) -> JoinAll<O> {
    JoinAll(ops)
}

impl<O: DeviceOp> DeviceOp for JoinAll<O> {
    type Output = Vec<<O as DeviceOp>::Output>;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<Vec<<O as DeviceOp>::Output>> {
        let n = self.0.len();
        let mut fork = Fork::new();
        let contexts = (1..n)
            .map(|i| fork.arm(ctx, i))
            .collect::<Result<Vec<_>>>()?;
        let mut ops = self.0.into_iter();
        let mut out = Vec::with_capacity(n);
        if let Some(first) = ops.next() {
            // SAFETY: arm 0 runs on the parent context; contract forwarded.
            out.push(unsafe { first.execute(ctx) });
        }
        for (op, mut c) in ops.zip(contexts) {
            // SAFETY: each arm on its own forked context; contract forwarded.
            out.push(unsafe { op.execute(&mut c) });
            fork.end(ctx, c);
        }
        fork.join(ctx)?;
        out.into_iter().collect()
    }
}

impl_into_future!(impl[O: DeviceOp] for JoinAll<O>);
