//! A batch's commands onto the device, for the worker's batches and its
//! graphs' bodies.

use crate::device::{DeviceError, LeaseDevice};
use crate::proto::{Command, Op, Status};

/// The batch's data, taken front to back by its module sources and writes.
pub(super) struct Payload<'d> {
    data: &'d [u8],
    cursor: usize,
}

impl<'d> Payload<'d> {
    pub(super) fn new(data: &'d [u8]) -> Self {
        Payload { data, cursor: 0 }
    }

    pub(super) fn take(&mut self, len: u64) -> Result<&'d [u8], DeviceError> {
        let end = usize::try_from(len)
            .ok()
            .and_then(|len| self.cursor.checked_add(len));
        let s = end
            .and_then(|end| self.data.get(self.cursor..end))
            .ok_or_else(|| DeviceError::new(Status::BadRequest, "batch data too short"))?;
        self.cursor += s.len();
        Ok(s)
    }
}

/// Enqueues `c`, its write's bytes taken from `payload`; a read lands at
/// `read_at` in the reply's data, which it advances.
pub(super) fn enqueue(
    dev: &mut dyn LeaseDevice,
    c: &Command<'_>,
    payload: &mut Payload<'_>,
    read_at: &mut usize,
) -> Result<(), DeviceError> {
    // Only a write carries bytes of the batch's data.
    let data = if let Op::Write { len, .. } = c.op {
        payload.take(len)?
    } else {
        &[]
    };
    dev.enqueue(c, data, *read_at)?;
    *read_at += c.op.reply_len() as usize;
    Ok(())
}
