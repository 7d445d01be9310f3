//! A failure of work run somewhere other than this process's GPUs, carried
//! whole and opaque: the crate that runs the work defines the error type,
//! and reads it back by type ([`RemoteFailure::downcast_ref`]).

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

/// A failure of remote execution, as [`Error::Remote`](crate::Error::Remote)
/// carries it: the backend's own error value, and whether the same work may
/// succeed if sent again unchanged.
///
/// # Examples
///
/// ```
/// use cuda_core::{Error, RemoteFailure};
///
/// #[derive(Debug)]
/// struct Gone;
/// impl std::fmt::Display for Gone {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("the remote GPU is gone")
///     }
/// }
/// impl std::error::Error for Gone {}
///
/// let e = Error::Remote(RemoteFailure::new(Gone, false));
/// assert_eq!(e.to_string(), "the remote GPU is gone");
/// assert!(e.remote_failure().unwrap().downcast_ref::<Gone>().is_some());
/// assert!(!e.is_retryable());
/// ```
#[derive(Clone)]
pub struct RemoteFailure {
    cause: Arc<dyn StdError + Send + Sync>,
    retryable: bool,
}

impl RemoteFailure {
    /// Carries `cause`; `retryable` says whether the same work may succeed
    /// if sent again later, unchanged.
    pub fn new(cause: impl StdError + Send + Sync + 'static, retryable: bool) -> Self {
        Self {
            cause: Arc::new(cause),
            retryable,
        }
    }

    /// The backend's error, if it is an `E`.
    pub fn downcast_ref<E: StdError + 'static>(&self) -> Option<&E> {
        let cause: &(dyn StdError + 'static) = &*self.cause;
        cause.downcast_ref()
    }

    /// Whether the same work may succeed if sent again later, unchanged.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The backend's error.
    pub fn cause(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.cause
    }
}

impl fmt::Debug for RemoteFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.cause, f)
    }
}

impl fmt::Display for RemoteFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.cause, f)
    }
}
