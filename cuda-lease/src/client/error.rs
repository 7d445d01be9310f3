//! Client-side errors and the mapping of reply statuses to them.

use crate::proto::Status;

/// Client-side errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Credentials were rejected.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// The lease's TTL ran out.
    #[error("lease expired: {0}")]
    LeaseExpired(String),
    /// A kernel fault or dead worker poisoned the lease; free it and lease again.
    #[error("{0}")]
    LeasePoisoned(String),
    /// The request exceeds the reservation or the node's capacity.
    #[error("capacity exceeded: {0}")]
    CapacityExceeded(String),
    /// A module did not load; holds the compile or JIT log.
    #[error("module load failed: {0}")]
    LoadFailed(String),
    /// The node does not have a module and was not sent its source
    /// ([`Recorder::submit`](super::Recorder::submit) resends with it by itself).
    #[error("unknown module: {0}")]
    UnknownModule(String),
    /// A launch or kernel failed.
    #[error("launch failed: {0}")]
    LaunchFailed(String),
    /// Reading device memory failed.
    #[error("read failed: {0}")]
    ReadFailed(String),
    /// No such lease, handle or kernel.
    #[error("not found: {0}")]
    NotFound(String),
    /// The node rejected the request as malformed.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The connection is gone or could not be made.
    #[error("disconnected: {0}")]
    Disconnected(String),
    /// The node replied with something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// TLS or local configuration problem.
    #[error("config: {0}")]
    Config(String),
    /// A node-side failure.
    #[error("node error: {0}")]
    Internal(String),
}

impl Error {
    /// Maps a reply status and message to an error.
    pub fn from_status(status: Status, message: String) -> Self {
        match status {
            Status::Unauthorized => Error::Unauthorized(message),
            Status::LoadFailed => Error::LoadFailed(message),
            Status::LaunchFailed => Error::LaunchFailed(message),
            Status::ReadFailed => Error::ReadFailed(message),
            Status::LeaseExpired => Error::LeaseExpired(message),
            Status::CapacityExceeded => Error::CapacityExceeded(message),
            Status::BadRequest => Error::BadRequest(message),
            Status::NotFound => Error::NotFound(message),
            Status::LeasePoisoned => Error::LeasePoisoned(message),
            Status::UnknownModule => Error::UnknownModule(message),
            Status::Ok | Status::Internal => Error::Internal(message),
        }
    }
}

pub(super) fn disconnected(e: impl std::fmt::Display) -> Error {
    Error::Disconnected(e.to_string())
}
