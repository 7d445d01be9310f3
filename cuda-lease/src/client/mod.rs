//! The client: a QUIC connection to a node, leases with background renewal,
//! sessions with RAII memory and module handles, batches, and the stateless
//! [`Client::gpu_call`].

// Layout: `error` (Error, reply status to error), `config` (ClientConfig:
// trust, credentials, striping), `connection` (Client: the QUIC connection,
// HELLO, one request per stream and its reply), `stripe` (transfers striped
// over several connections), `gpu_call` (GpuCall), `lease` (LeaseBuilder,
// Lease, renewal, the state a lease's handles share), `session` (Session,
// LeaseBuffer, single requests), `recorder` (Recorder,
// RecordedRead, Submitted), `message` (a numbered BATCH on the wire).

mod bulk;
mod config;
mod connection;
mod direct;
mod error;
mod gpu_call;
mod lease;
mod message;
mod recorder;
mod session;
mod stripe;

pub use config::{
    BulkUse, ClientConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_DATA_PATH_MIN_BYTES, DEFAULT_STRIPES,
    DEFAULT_STRIPE_MIN_BYTES,
};
pub use connection::Client;
pub use direct::DIRECT_CONNECT_TIMEOUT;
#[cfg(feature = "backend")]
pub(crate) use error::config_error;
#[cfg(feature = "backend")]
pub(crate) use error::protocol_error;
pub use error::{Credentials, Disconnect, Error, ErrorKind};
pub use gpu_call::GpuCall;
pub use lease::{Lease, LeaseBuilder};
// Named outside the client only by `remote` (the `backend` feature).
pub use crate::proto::ModuleSpec;
pub(crate) use message::Message;
pub use recorder::{RecordedRead, Recorder, Submitted};
pub use session::{LeaseBuffer, Session};
