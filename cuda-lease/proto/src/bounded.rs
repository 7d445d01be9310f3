//! Deserializers that check a sequence's length prefix against its limit
//! before decoding (or allocating for) any element.

use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

use super::{ScalarBytes, MAX_SCALAR_ARG};

struct Bounded<T>(usize, PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for Bounded<T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a sequence of at most {} elements", self.0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let hint = seq.size_hint().unwrap_or(0);
        if hint > self.0 {
            return Err(A::Error::invalid_length(hint, &self));
        }
        let mut v = Vec::with_capacity(hint);
        while let Some(x) = seq.next_element()? {
            if v.len() == self.0 {
                return Err(A::Error::invalid_length(self.0 + 1, &self));
            }
            v.push(x);
        }
        Ok(v)
    }
}

/// A sequence of at most `N` elements.
pub(super) fn at_most<'de, D: Deserializer<'de>, T: Deserialize<'de>, const N: usize>(
    d: D,
) -> Result<Vec<T>, D::Error> {
    d.deserialize_seq(Bounded(N, PhantomData))
}

pub(super) fn options<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let v: Vec<String> = at_most::<_, _, { super::MAX_MODULE_OPTIONS }>(d)?;
    if v.iter().any(|o| o.len() > super::MAX_OPTION_LEN) {
        return Err(D::Error::custom("NVRTC option too long"));
    }
    Ok(v)
}

/// A scalar's bytes, borrowed (nothing allocated, so checked once in hand).
pub(super) fn scalar<'de: 'a, 'a, D: Deserializer<'de>>(d: D) -> Result<ScalarBytes<'a>, D::Error> {
    let b = <&'de [u8]>::deserialize(d)?;
    if b.len() > MAX_SCALAR_ARG {
        return Err(D::Error::invalid_length(b.len(), &"at most 4096 bytes"));
    }
    Ok(ScalarBytes::borrowed(b))
}
