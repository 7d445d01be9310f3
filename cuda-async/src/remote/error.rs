//! A leased GPU's failures as this crate's [`Error`]: the protocol's
//! [`RemoteError`] travels inside [`Error::Remote`] as it was, and
//! [`RemoteErrorExt`] reads it back.

use cuda_core::{Error, RemoteFailure};

use super::proto::{RemoteError, RemoteErrorKind};

/// Reads a leased GPU's [`RemoteError`] out of an [`Error`], and makes one.
/// In the prelude.
///
/// # Examples
///
/// ```
/// use cuda_async::{Error, RemoteError, RemoteErrorExt, RemoteErrorKind};
/// let e = Error::from_remote(RemoteError::new(RemoteErrorKind::LeaseExpired, "ttl"));
/// assert_eq!(e.remote_kind(), Some(RemoteErrorKind::LeaseExpired));
/// assert!(!e.is_retryable());
/// assert_eq!(Error::InvalidArgument("n".into()).remote_kind(), None);
/// ```
pub trait RemoteErrorExt: sealed::Sealed {
    /// The error of a remote failure: `e` whole, as [`Error::Remote`].
    fn from_remote(e: RemoteError) -> Self;

    /// The lease's failure this is, if it is one.
    fn remote(&self) -> Option<&RemoteError>;

    /// The kind of the lease's failure this is, if it is one.
    fn remote_kind(&self) -> Option<RemoteErrorKind> {
        self.remote().map(RemoteError::kind)
    }
}

impl RemoteErrorExt for Error {
    fn from_remote(e: RemoteError) -> Self {
        let retryable = e.is_retryable();
        Error::Remote(RemoteFailure::new(e, retryable))
    }

    fn remote(&self) -> Option<&RemoteError> {
        self.remote_failure()?.downcast_ref()
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for cuda_core::Error {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_error_keeps_its_words_its_hint_and_its_retry_answer() {
        use RemoteErrorKind as K;
        let cases = [
            (K::LeaseExpired, "lease again", false),
            (K::Capacity, "lease more", true),
        ];
        for (kind, advice, retry) in cases {
            let inner = RemoteError::new(kind, "lease 1").with_node("n");
            let e = Error::from_remote(inner.clone());
            assert_eq!(e.to_string(), inner.to_string());
            assert!(e.to_string().contains(advice), "{e}");
            assert_eq!(e.is_retryable(), retry, "{e}");
            assert!(!e.is_sticky(), "{e}");
            assert_eq!(e.remote(), Some(&inner));
        }
    }
}
