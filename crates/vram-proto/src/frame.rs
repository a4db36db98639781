//! The fixed frame header.

use crate::{ProtoError, MAX_FDS, MAX_PAYLOAD, PROTOCOL_VERSION};

pub const MAGIC: [u8; 4] = *b"VRMD";
pub const HEADER_LEN: usize = 12;

/// `magic[4] | version u16 LE | fd count u16 LE | payload length u32 LE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub version: u16,
    pub fds: u16,
    pub len: u32,
}

impl FrameHeader {
    pub fn new(fds: usize, len: usize) -> FrameHeader {
        FrameHeader {
            version: PROTOCOL_VERSION,
            fds: fds as u16,
            len: len as u32,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0; HEADER_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.fds.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses and checks a header. The version is checked by the caller, which may still want to
    /// answer a peer of another version with an error it can read.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<FrameHeader, ProtoError> {
        let magic: [u8; 4] = b[..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(ProtoError::BadMagic(magic));
        }
        let h = FrameHeader {
            version: u16::from_le_bytes([b[4], b[5]]),
            fds: u16::from_le_bytes([b[6], b[7]]),
            len: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
        };
        if h.len as usize > MAX_PAYLOAD {
            return Err(ProtoError::Oversized {
                len: h.len as usize,
                max: MAX_PAYLOAD,
            });
        }
        if h.fds as usize > MAX_FDS {
            return Err(ProtoError::TooManyFds {
                count: h.fds as usize,
                max: MAX_FDS,
            });
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects() {
        let h = FrameHeader::new(1, 300);
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(matches!(
            FrameHeader::decode(&bad),
            Err(ProtoError::BadMagic(_))
        ));
        let big = FrameHeader::new(0, MAX_PAYLOAD + 1).encode();
        assert!(matches!(
            FrameHeader::decode(&big),
            Err(ProtoError::Oversized { .. })
        ));
        let fds = FrameHeader::new(MAX_FDS + 1, 4).encode();
        assert!(matches!(
            FrameHeader::decode(&fds),
            Err(ProtoError::TooManyFds { .. })
        ));
    }
}
