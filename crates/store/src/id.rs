//! Content ids: BLAKE3-256 digests wrapped in one newtype per kind of object.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::Error;

macro_rules! content_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name([u8; 32]);

        impl $name {
            /// The id of `data`: its BLAKE3-256 digest.
            pub fn of(data: &[u8]) -> Self {
                Self(*blake3::hash(data).as_bytes())
            }

            /// Wraps a digest computed elsewhere.
            pub const fn from_bytes(bytes: [u8; 32]) -> Self {
                Self(bytes)
            }

            /// The raw digest.
            pub const fn as_bytes(&self) -> &[u8; 32] {
                &self.0
            }

            /// Lower-case hex, 64 characters.
            pub fn to_hex(&self) -> String {
                blake3::Hash::from_bytes(self.0).to_hex().to_string()
            }

            /// The first 12 hex characters, for humans.
            pub fn short(&self) -> String {
                self.to_hex()[..12].to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.to_hex())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.short())
            }
        }

        /// Hex in human-readable formats (JSON refs, `--json`), 32 raw bytes in postcard.
        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                if s.is_human_readable() {
                    s.serialize_str(&self.to_hex())
                } else {
                    self.0.serialize(s)
                }
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                if d.is_human_readable() {
                    let s = String::deserialize(d)?;
                    s.parse().map_err(serde::de::Error::custom)
                } else {
                    <[u8; 32]>::deserialize(d).map(Self)
                }
            }
        }

        impl FromStr for $name {
            type Err = Error;

            fn from_str(s: &str) -> Result<Self, Error> {
                blake3::Hash::from_hex(s)
                    .map(|h| Self(*h.as_bytes()))
                    .map_err(|_| Error::invalid(concat!($what, " id"), format!("{s:?} is not 64 hex digits")))
            }
        }
    };
}

content_id!(
    /// Id of a chunk: BLAKE3 of its plain (uncompressed) bytes.
    ChunkId,
    "chunk"
);
content_id!(
    /// Id of a pack object: BLAKE3 of the whole pack as stored.
    PackId,
    "pack"
);
content_id!(
    /// Id of a snapshot: BLAKE3 of its encoded top object. Equal trees give equal ids.
    SnapshotId,
    "snapshot"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let id = ChunkId::of(b"hello");
        assert_eq!(
            id.to_hex(),
            "ea8f163db38682925e4491c5e58d4bb3506ef8c14eb78a86e908c5624a67200f"
        );
        assert_eq!(id.to_hex().parse::<ChunkId>().unwrap(), id);
        assert_eq!(id.short().len(), 12);
    }

    #[test]
    fn serde_is_hex_in_json_and_raw_in_postcard() {
        let id = SnapshotId::of(b"x");
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        assert_eq!(serde_json::from_str::<SnapshotId>(&json).unwrap(), id);
        let bin = postcard::to_stdvec(&id).unwrap();
        assert_eq!(bin.len(), 32);
        assert_eq!(postcard::from_bytes::<SnapshotId>(&bin).unwrap(), id);
    }

    #[test]
    fn bad_hex_is_invalid() {
        let err = "xyz".parse::<PackId>().unwrap_err();
        assert!(err.to_string().contains("pack id"), "{err}");
    }
}
