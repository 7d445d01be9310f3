//! A by-value kernel argument's bytes ([`ScalarBytes`]): borrowed from a
//! decoded message, inline when small (up to 16 bytes), owned otherwise.

use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;

use serde::{Serialize, Serializer};

/// Bytes held inline by a recorded scalar.
const INLINE: usize = 16;

/// A scalar argument's bytes; on the wire a byte string, as postcard writes `&[u8]`.
#[derive(Clone)]
pub struct ScalarBytes<'a>(Repr<'a>);

#[derive(Clone)]
enum Repr<'a> {
    Inline { len: u8, bytes: [u8; INLINE] },
    Cow(Cow<'a, [u8]>),
}

impl<'a> ScalarBytes<'a> {
    /// Bytes borrowed from a message.
    pub fn borrowed(b: &'a [u8]) -> Self {
        ScalarBytes(Repr::Cow(Cow::Borrowed(b)))
    }
}

impl ScalarBytes<'static> {
    /// A copy of `b`: inline up to 16 bytes (no allocation), else owned.
    pub fn copied(b: &[u8]) -> Self {
        if b.len() <= INLINE {
            let mut bytes = [0; INLINE];
            bytes[..b.len()].copy_from_slice(b);
            // At most 16: fits a `u8`.
            let len = b.len() as u8;
            ScalarBytes(Repr::Inline { len, bytes })
        } else {
            ScalarBytes(Repr::Cow(Cow::Owned(b.to_vec())))
        }
    }
}

impl Deref for ScalarBytes<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Repr::Cow(c) => c,
        }
    }
}

impl PartialEq for ScalarBytes<'_> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for ScalarBytes<'_> {}

impl fmt::Debug for ScalarBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

impl Serialize for ScalarBytes<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_scalars_are_inline_and_every_kind_encodes_as_the_bytes_did() {
        for len in [1, 4, 8, 16, 17, 4096] {
            let b: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let s = ScalarBytes::copied(&b);
            assert_eq!(matches!(s.0, Repr::Inline { .. }), len <= INLINE);
            assert_eq!(&*s, &b[..]);
            assert_eq!(s, ScalarBytes::borrowed(&b));
            // The wire form is that of the byte string it replaced.
            let as_bytes = postcard::to_allocvec(&Cow::<[u8]>::Borrowed(&b)).unwrap();
            assert_eq!(postcard::to_allocvec(&s).unwrap(), as_bytes);
        }
    }
}
