//! Replies whose data the worker keeps ([`crate::worker::FLAG_HELD`]), read
//! part by part as the client takes them.

use std::time::Duration;

use super::Slot;
use crate::worker::WorkerError;

/// Bytes of a held reply read from the worker at a time (what an unread
/// reply holds on the node, beside the connection's buffers).
const HELD_CHUNK: u32 = 1 << 20;

/// A reply's data kept in the worker; dropped there if this drops unread.
pub(super) struct HeldData {
    pub(super) slot: Slot,
    /// The worker request whose reply it is.
    pub(super) request: u64,
    pub(super) len: u64,
    /// Bytes read so far (the worker drops its copy after the last).
    pub(super) read: u64,
}

impl HeldData {
    /// The next part (at most [`HELD_CHUNK`] bytes), or `None` at the end.
    pub(super) async fn next(&mut self, timeout: Duration) -> Option<Result<Vec<u8>, WorkerError>> {
        if self.read >= self.len {
            return None;
        }
        let n = (self.len - self.read).min(u64::from(HELD_CHUNK)) as u32;
        let part = self
            .slot
            .worker
            .read_held(self.request, self.read, n, timeout)
            .await;
        Some(match part {
            Ok(p) if p.len() == n as usize => {
                self.read += u64::from(n);
                Ok(p)
            }
            Ok(p) => Err(WorkerError::Dead(format!(
                "held reply {}: {} bytes where {n} were asked for",
                self.request,
                p.len()
            ))),
            Err(e) => Err(e),
        })
    }
}

impl Drop for HeldData {
    fn drop(&mut self) {
        if self.read >= self.len {
            return;
        }
        let (slot, request) = (self.slot.clone(), self.request);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = slot
                    .worker
                    .read_held(request, 0, 0, Duration::from_secs(60))
                    .await;
            });
        }
    }
}
