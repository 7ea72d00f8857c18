//! What every device's `restore` shares: the error for a saved state that cannot be
//! loaded, and serde support for the fixed-size arrays serde does not derive.

/// A saved device state that cannot be restored: a field holds a value the device could
/// never have produced (a corrupt, truncated or foreign snapshot). The device is left as it
/// was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {device} state: {detail}")]
pub struct StateError {
    /// The device whose state was refused.
    pub device: &'static str,
    /// Which field, and its value.
    pub detail: String,
}

impl StateError {
    pub fn new(device: &'static str, detail: impl Into<String>) -> Self {
        StateError {
            device,
            detail: detail.into(),
        }
    }
}

/// `#[serde(with = "crate::state::byte_array")]` for `[u8; N]` of any `N` (serde derives
/// arrays only up to 32 elements). Serialized as a byte sequence; a sequence of the wrong
/// length is a deserialization error.
pub(crate) mod byte_array {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer, const N: usize>(
        bytes: &[u8; N],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>, const N: usize>(
        d: D,
    ) -> Result<[u8; N], D::Error> {
        let v = Vec::<u8>::deserialize(d)?;
        let len = v.len();
        v.try_into()
            .map_err(|_| serde::de::Error::invalid_length(len, &format!("{N} bytes").as_str()))
    }
}
