//! The combinators, one per file (futures-rs layout).

mod boxed;
mod join_all;
mod map;
mod shared;
mod then;
mod timed;
mod value;
mod with_context;
mod zip;

pub use self::boxed::{Boxed, BoxedOp};
pub use self::join_all::{join_all, JoinAll};
pub use self::map::Map;
pub use self::shared::{Shared, SharedCell};
pub use self::then::Then;
pub use self::timed::{GpuTime, Timed};
pub use self::value::{value, Value};
pub use self::with_context::{with_context, WithContext};
pub use self::zip::{zip_all, Zip};
