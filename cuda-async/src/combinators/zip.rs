use std::fmt;

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::context::Fork;
use crate::op::{impl_into_future, DeviceOp};

/// Concurrent arms ([`DeviceOpExt::zip`](crate::DeviceOpExt::zip),
/// [`zip_all`], [`zip!`](crate::zip!)): a tuple of 2 to 12 ops, each on its own pool stream, joined
/// back to the parent stream.
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Zip<T>(T);

impl<T> Zip<T> {
    pub(crate) fn new(arms: T) -> Self {
        Zip(arms)
    }
}

impl<T> fmt::Debug for Zip<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Zip").finish_non_exhaustive()
    }
}

/// Zips a tuple of 2 to 12 ops: they run concurrently and the output is the
/// tuple of their outputs.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let (a, b, c) = zip_all((value(1), value("two"), zeros::<f32>(8))).sync()?;
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn zip_all<T>(arms: T) -> Zip<T>
where
    Zip<T>: DeviceOp,
{
    Zip(arms)
}

macro_rules! impl_zip {
    ($first:ident $fv:ident, $($name:ident $v:ident $idx:literal),+) => {
        impl<$first: DeviceOp, $($name: DeviceOp),+> DeviceOp for Zip<($first, $($name),+)> {
            type Output = (<$first as DeviceOp>::Output, $(<$name as DeviceOp>::Output),+);

            unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<<Self as DeviceOp>::Output> {
                let ($fv, $($v),+) = self.0;
                let mut fork = Fork::new();
                // Fork before arm 0 so the other arms do not wait for it.
                let mut arms = Vec::new();
                $( let _ = $idx; arms.push(fork.arm(ctx, $idx)?); )+
                // SAFETY: arm 0 runs on the parent context; caller contract forwarded.
                let $fv = unsafe { $fv.execute(ctx) };
                let mut arms = arms.into_iter();
                $(
                    let mut c = arms.next().expect("one context per arm");
                    // SAFETY: each arm runs on its own forked context; its
                    // retained values move into the parent's when it ends.
                    let $v = unsafe { $v.execute(&mut c) };
                    fork.end(ctx, c);
                )+
                fork.join(ctx)?;
                Ok(($fv?, $($v?),+))
            }
        }

        impl_into_future!(impl[$first: DeviceOp, $($name: DeviceOp),+] for Zip<($first, $($name),+)>);
    };
}

impl_zip!(A a, B b 1);
impl_zip!(A a, B b 1, C c 2);
impl_zip!(A a, B b 1, C c 2, D d 3);
impl_zip!(A a, B b 1, C c 2, D d 3, E e 4);
impl_zip!(A a, B b 1, C c 2, D d 3, E e 4, F f 5);
impl_zip!(A a, B b 1, C c 2, D d 3, E e 4, F f 5, G g 6);
impl_zip!(A a, B b 1, C c 2, D d 3, E e 4, F f 5, G g 6, H h 7);
impl_zip!(A a, B b 1, C c 2, D d 3, E e 4, F f 5, G g 6, H h 7, I i 8);
impl_zip!(A a, B b 1, C c 2, D d 3, E e 4, F f 5, G g 6, H h 7, I i 8, J j 9);
impl_zip!(A a, B b 1, C c 2, D d 3, E e 4, F f 5, G g 6, H h 7, I i 8, J j 9, K k 10);
impl_zip!(A a, B b 1, C c 2, D d 3, E e 4, F f 5, G g 6, H h 7, I i 8, J j 9, K k 10, L l 11);
