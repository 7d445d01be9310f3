//! Client-side errors: the protocol's [`RemoteError`](crate::proto::RemoteError)
//! itself (`cuda-async` carries the same value in its `Error::Remote`), and
//! the mapping of reply statuses to its kinds.

pub use crate::proto::{
    Credentials, Disconnect, RemoteError as Error, RemoteErrorKind as ErrorKind,
};

use crate::proto::Status;

/// The error of a reply whose status is not OK, or of the command of a
/// batch that failed (the reply's `OpError`, whose message names it).
pub(crate) fn from_status(status: Status, message: String) -> Error {
    let kind = match status {
        Status::Unauthorized => ErrorKind::Unauthorized(Credentials::Refused),
        Status::LoadFailed => ErrorKind::LoadFailed,
        Status::LaunchFailed => ErrorKind::LaunchFailed,
        Status::LeaseExpired => ErrorKind::LeaseExpired,
        Status::CapacityExceeded => ErrorKind::Capacity,
        Status::BadRequest | Status::NotFound | Status::ReadFailed => ErrorKind::InvalidRequest,
        Status::LeaseNotFound => ErrorKind::LeaseNotFound,
        Status::LeasePoisoned => ErrorKind::LeasePoisoned,
        Status::UnknownModule => ErrorKind::ModuleUnknown,
        Status::Malformed => ErrorKind::Protocol,
        Status::Ok | Status::Internal => ErrorKind::NodeInternal,
    };
    Error::new(kind, message)
}

/// A reply this client does not understand.
pub(crate) fn protocol_error(e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Protocol, e.to_string())
}

/// An unusable configuration.
pub(crate) fn config_error(e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Config, e.to_string())
}

/// A connection lost to the network.
pub(super) fn disconnected(e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Disconnected(Disconnect::Network), e.to_string())
}

/// A request on `conn` that failed with `e` because the connection is gone:
/// the node shut down if it closed the connection saying so, the network
/// otherwise.
pub(super) fn lost(conn: &quinn::Connection, e: impl std::fmt::Display) -> Error {
    let cause = match conn.close_reason() {
        Some(quinn::ConnectionError::ApplicationClosed(c))
            if c.error_code == crate::proto::CLOSE_NODE_SHUTDOWN.into() =>
        {
            Disconnect::NodeShutdown
        }
        _ => Disconnect::Network,
    };
    Error::new(ErrorKind::Disconnected(cause), e.to_string())
}
