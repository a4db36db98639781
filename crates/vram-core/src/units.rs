//! `Bytes`: every size in vramd, parsed from and printed as `20 GiB`, `512MiB`, `4096`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes. Printed with binary units (`1.5 GiB`), parsed from the same forms.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bytes(pub u64);

impl Bytes {
    pub const ZERO: Bytes = Bytes(0);
    pub const KIB: u64 = 1 << 10;
    pub const MIB: u64 = 1 << 20;
    pub const GIB: u64 = 1 << 30;
    pub const TIB: u64 = 1 << 40;

    pub const fn kib(n: u64) -> Bytes {
        Bytes(n * Self::KIB)
    }
    pub const fn mib(n: u64) -> Bytes {
        Bytes(n * Self::MIB)
    }
    pub const fn gib(n: u64) -> Bytes {
        Bytes(n * Self::GIB)
    }
    pub const fn get(self) -> u64 {
        self.0
    }
    pub fn saturating_sub(self, other: Bytes) -> Bytes {
        Bytes(self.0.saturating_sub(other.0))
    }
    pub fn saturating_add(self, other: Bytes) -> Bytes {
        Bytes(self.0.saturating_add(other.0))
    }
    pub fn checked_add(self, other: Bytes) -> Option<Bytes> {
        self.0.checked_add(other.0).map(Bytes)
    }
    /// Rounds up to a multiple of `unit` (a power of two or any non-zero size); `None` on overflow.
    pub fn round_up(self, unit: Bytes) -> Option<Bytes> {
        let u = unit.0.max(1);
        self.0.checked_add(u - 1).map(|v| Bytes(v / u * u))
    }
}

impl std::ops::Add for Bytes {
    type Output = Bytes;
    fn add(self, rhs: Bytes) -> Bytes {
        Bytes(self.0 + rhs.0)
    }
}
impl std::ops::AddAssign for Bytes {
    fn add_assign(&mut self, rhs: Bytes) {
        self.0 += rhs.0;
    }
}
impl std::ops::Sub for Bytes {
    type Output = Bytes;
    fn sub(self, rhs: Bytes) -> Bytes {
        Bytes(self.0 - rhs.0)
    }
}
impl std::ops::SubAssign for Bytes {
    fn sub_assign(&mut self, rhs: Bytes) {
        self.0 -= rhs.0;
    }
}
impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(iter: I) -> Bytes {
        Bytes(iter.map(|b| b.0).sum())
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u64, &str); 4] = [
            (Bytes::TIB, "TiB"),
            (Bytes::GIB, "GiB"),
            (Bytes::MIB, "MiB"),
            (Bytes::KIB, "KiB"),
        ];
        for (size, name) in UNITS {
            if self.0 >= size {
                let v = self.0 as f64 / size as f64;
                return if self.0.is_multiple_of(size) {
                    write!(f, "{} {name}", self.0 / size)
                } else {
                    write!(f, "{v:.1} {name}")
                };
            }
        }
        write!(f, "{} B", self.0)
    }
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bytes({} = {})", self.0, self)
    }
}

/// Why a size could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size `{input}`: {reason} (examples: 4096, 512MiB, 20 GiB, 1.5GB)")]
pub struct ParseBytesError {
    input: String,
    reason: &'static str,
}

impl FromStr for Bytes {
    type Err = ParseBytesError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseBytesError {
            input: s.to_string(),
            reason,
        };
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        if num.is_empty() {
            return Err(err(if t.starts_with('-') {
                "a size cannot be negative"
            } else {
                "no number"
            }));
        }
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => Bytes::KIB,
            "m" | "mib" => Bytes::MIB,
            "g" | "gib" => Bytes::GIB,
            "t" | "tib" => Bytes::TIB,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            _ => return Err(err("unknown unit")),
        };
        if let Ok(n) = num.parse::<u64>() {
            return n
                .checked_mul(mult)
                .map(Bytes)
                .ok_or_else(|| err("too large"));
        }
        let v: f64 = num.parse().map_err(|_| err("not a number"))?;
        let total = v * mult as f64;
        if !total.is_finite() || total >= u64::MAX as f64 {
            return Err(err("too large"));
        }
        Ok(Bytes(total.round() as u64))
    }
}

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

/// Accepts a number of bytes or a string such as `"20 GiB"`, so configuration files read naturally.
impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size in bytes or a string such as \"20 GiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Bytes, E> {
                u64::try_from(v)
                    .map(Bytes)
                    .map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Bytes, E> {
                v.parse().map_err(E::custom)
            }
        }
        // Binary formats (the wire protocol) carry a plain u64 and cannot describe themselves.
        if d.is_human_readable() {
            d.deserialize_any(V)
        } else {
            u64::deserialize(d).map(Bytes)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!("4096".parse::<Bytes>().unwrap(), Bytes(4096));
        assert_eq!("512MiB".parse::<Bytes>().unwrap(), Bytes::mib(512));
        assert_eq!("20 GiB".parse::<Bytes>().unwrap(), Bytes::gib(20));
        assert_eq!("1.5g".parse::<Bytes>().unwrap(), Bytes(3 * Bytes::GIB / 2));
        assert_eq!("2GB".parse::<Bytes>().unwrap(), Bytes(2_000_000_000));
        assert!("".parse::<Bytes>().is_err());
        assert!("12 parsecs".parse::<Bytes>().is_err());
        assert!("99999999999 TiB".parse::<Bytes>().is_err());
        let negative = "-1".parse::<Bytes>().unwrap_err().to_string();
        assert!(negative.contains("cannot be negative"), "{negative}");
    }

    #[test]
    fn prints_human_readably_and_round_trips() {
        assert_eq!(Bytes::gib(20).to_string(), "20 GiB");
        assert_eq!(Bytes(1536 * Bytes::MIB).to_string(), "1.5 GiB");
        assert_eq!(Bytes(17).to_string(), "17 B");
        for b in [Bytes::gib(3), Bytes::mib(2), Bytes(5)] {
            assert_eq!(b.to_string().parse::<Bytes>().unwrap(), b);
        }
    }

    #[test]
    fn rounds_up() {
        assert_eq!(Bytes(1).round_up(Bytes::mib(2)), Some(Bytes::mib(2)));
        assert_eq!(Bytes::mib(2).round_up(Bytes::mib(2)), Some(Bytes::mib(2)));
        assert_eq!(Bytes(u64::MAX).round_up(Bytes::mib(2)), None);
    }

    #[test]
    fn deserializes_numbers_and_strings() {
        #[derive(serde::Deserialize)]
        struct C {
            a: Bytes,
            b: Bytes,
        }
        let c: C = toml::from_str("a = 1024\nb = \"2 GiB\"").unwrap();
        assert_eq!((c.a, c.b), (Bytes(1024), Bytes::gib(2)));
    }
}
