//! What is mapped where in one reservation: the bookkeeping that turns a bad call into an error
//! instead of a fault. Pure; the backends do the OS or driver call and then record it here.

use std::collections::BTreeMap;

use vram_core::Bytes;

use crate::{Access, DeviceError, Result};

/// One mapped handle: its length and access, keyed in [`Mappings`] by its offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub len: u64,
    pub access: Access,
}

/// The mappings of one reservation, by offset; they never overlap.
#[derive(Debug, Default)]
pub(crate) struct Mappings(BTreeMap<u64, Mapping>);

impl Mappings {
    /// Every mapping that overlaps `[offset, offset+len)`, in order.
    fn overlapping(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, Mapping)> + '_ {
        let end = offset + len;
        let before = self
            .0
            .range(..offset)
            .next_back()
            .filter(|(&o, m)| o + m.len > offset);
        before
            .into_iter()
            .chain(self.0.range(offset..end))
            .map(|(&o, &m)| (o, m))
    }

    /// Records a new mapping, refusing one that overlaps any other.
    pub fn insert(&mut self, offset: u64, len: u64, access: Access) -> Result<()> {
        self.check_free(offset, len)?;
        self.0.insert(offset, Mapping { len, access });
        Ok(())
    }

    /// Refuses a range that overlaps any mapping.
    pub fn check_free(&self, offset: u64, len: u64) -> Result<()> {
        match self.overlapping(offset, len).next() {
            None => Ok(()),
            Some((o, m)) => Err(DeviceError::AlreadyMapped {
                offset: Bytes(offset),
                len: Bytes(len),
                mapped_offset: Bytes(o),
                mapped_len: Bytes(m.len),
            }),
        }
    }

    /// The mappings in `[offset, offset+len)`, refusing a range that cuts one of them; with
    /// `covered`, also a range with a hole.
    pub fn whole(&self, offset: u64, len: u64, covered: bool) -> Result<Vec<(u64, Mapping)>> {
        let found: Vec<_> = self.overlapping(offset, len).collect();
        if let Some(&(o, m)) = found
            .iter()
            .find(|(o, m)| *o < offset || o + m.len > offset + len)
        {
            return Err(DeviceError::SplitsMapping {
                offset: Bytes(offset),
                len: Bytes(len),
                mapped_offset: Bytes(o),
                mapped_len: Bytes(m.len),
            });
        }
        if covered {
            self.check_covered(offset, len, false)?;
        }
        Ok(found)
    }

    /// Refuses a range with a hole, or (with `write`) one that reaches a read-only mapping.
    pub fn check_covered(&self, offset: u64, len: u64, write: bool) -> Result<()> {
        let mut at = offset;
        for (o, m) in self.overlapping(offset, len) {
            if o > at {
                break;
            }
            if write && m.access == Access::ReadOnly {
                return Err(DeviceError::ReadOnly {
                    offset: Bytes(offset),
                    len: Bytes(len),
                    mapped_offset: Bytes(o),
                });
            }
            at = o + m.len;
        }
        if at < offset + len {
            return Err(DeviceError::NotMapped {
                offset: Bytes(offset),
                len: Bytes(len),
                gap: Bytes(at),
            });
        }
        Ok(())
    }

    pub fn set_access(&mut self, offsets: &[(u64, Mapping)], access: Access) {
        for (o, _) in offsets {
            if let Some(m) = self.0.get_mut(o) {
                m.access = access;
            }
        }
    }

    pub fn remove(&mut self, offsets: &[(u64, Mapping)]) {
        for (o, _) in offsets {
            self.0.remove(o);
        }
    }

    /// Every mapping, in order: what a reservation must unmap when it is dropped.
    pub fn iter(&self) -> impl Iterator<Item = (u64, Mapping)> + '_ {
        self.0.iter().map(|(&o, &m)| (o, m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Access::*;

    fn table() -> Mappings {
        let mut t = Mappings::default();
        t.insert(0, 4, ReadWrite).unwrap();
        t.insert(4, 4, ReadOnly).unwrap();
        t.insert(12, 4, ReadWrite).unwrap();
        t
    }

    #[test]
    fn insert_refuses_overlap() {
        let mut t = table();
        assert!(matches!(
            t.insert(2, 2, ReadWrite),
            Err(DeviceError::AlreadyMapped { .. })
        ));
        assert!(matches!(
            t.insert(10, 4, ReadWrite),
            Err(DeviceError::AlreadyMapped { .. })
        ));
        t.insert(8, 4, ReadWrite).unwrap();
    }

    #[test]
    fn covered_finds_holes_and_read_only() {
        let t = table();
        t.check_covered(0, 8, false).unwrap();
        t.check_covered(1, 2, true).unwrap();
        assert!(matches!(
            t.check_covered(2, 4, true),
            Err(DeviceError::ReadOnly {
                mapped_offset: Bytes(4),
                ..
            })
        ));
        assert!(matches!(
            t.check_covered(6, 8, false),
            Err(DeviceError::NotMapped { gap: Bytes(8), .. })
        ));
        assert!(matches!(
            t.check_covered(16, 1, false),
            Err(DeviceError::NotMapped { gap: Bytes(16), .. })
        ));
    }

    #[test]
    fn whole_refuses_cuts() {
        let t = table();
        assert_eq!(t.whole(0, 16, false).unwrap().len(), 3);
        assert!(matches!(
            t.whole(0, 16, true),
            Err(DeviceError::NotMapped { gap: Bytes(8), .. })
        ));
        assert!(matches!(
            t.whole(2, 6, false),
            Err(DeviceError::SplitsMapping {
                mapped_offset: Bytes(0),
                ..
            })
        ));
        assert!(t.whole(8, 4, false).unwrap().is_empty());
    }
}
