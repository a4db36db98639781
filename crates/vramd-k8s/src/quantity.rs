//! Kubernetes quantities (`16Gi`, `1.5G`, `512Mi`, `1e9`) as bytes, and bytes as a quantity.

use vram_core::Bytes;

/// Why a quantity is not a byte count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not a memory quantity: {reason}")]
pub struct QuantityError {
    pub input: String,
    pub reason: &'static str,
}

/// `q` in bytes. Fractions of a byte are rounded up (a request is never made smaller).
pub fn parse(q: &str) -> Result<Bytes, QuantityError> {
    let err = |reason| QuantityError {
        input: q.to_string(),
        reason,
    };
    let s = q.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    if number.is_empty() {
        return Err(err("no number"));
    }
    let (whole, frac) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    // (multiplier, or a decimal exponent)
    let (mult, exp10): (u128, u32) = match suffix {
        "" => (1, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        "E" => (1, 18),
        s if s.starts_with(['e', 'E']) => {
            let e: u32 = s[1..].parse().map_err(|_| err("bad exponent"))?;
            if e > 18 {
                return Err(err("more than 64 bits of bytes"));
            }
            (1, e)
        }
        "m" | "u" | "n" => return Err(err("fractions of a byte")),
        _ => return Err(err("unknown suffix")),
    };
    if frac.len() > 18 || whole.len() > 20 {
        return Err(err("too many digits"));
    }
    let digits = |d: &str| -> Result<u128, QuantityError> {
        if d.is_empty() {
            Ok(0)
        } else {
            d.parse::<u128>().map_err(|_| err("not a number"))
        }
    };
    let scale = 10u128.pow(frac.len() as u32);
    // value = (whole + frac / scale) * mult * 10^exp10, computed over `scale` and rounded up.
    let numerator = (digits(whole)? * scale + digits(frac)?)
        .checked_mul(mult)
        .and_then(|n| n.checked_mul(10u128.pow(exp10)))
        .ok_or_else(|| err("more than 64 bits of bytes"))?;
    let bytes = numerator.div_ceil(scale);
    u64::try_from(bytes)
        .map(Bytes)
        .map_err(|_| err("more than 64 bits of bytes"))
}

/// `b` as a quantity, in the form the API server keeps it in (its canonical form), so that a
/// quantity read back compares equal to the one written: in the largest binary unit that
/// divides it exactly (`16Gi`, `1536Mi`), else in the largest decimal unit that does (`1500M`,
/// `1k`), else in bytes.
pub fn format(b: Bytes) -> String {
    let n = b.get();
    if n == 0 {
        return "0".into();
    }
    for (shift, unit) in [
        (60, "Ei"),
        (50, "Pi"),
        (40, "Ti"),
        (30, "Gi"),
        (20, "Mi"),
        (10, "Ki"),
    ] {
        if n.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    for (exp, unit) in [
        (18, "E"),
        (15, "P"),
        (12, "T"),
        (9, "G"),
        (6, "M"),
        (3, "k"),
    ] {
        let scale = 10u64.pow(exp);
        if n.is_multiple_of(scale) {
            return format!("{}{unit}", n / scale);
        }
    }
    n.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_as_the_api_server_writes_them() {
        assert_eq!(parse("16Gi").unwrap(), Bytes::gib(16));
        assert_eq!(parse("512Mi").unwrap(), Bytes::mib(512));
        assert_eq!(parse("1.5Gi").unwrap(), Bytes::mib(1536));
        assert_eq!(parse("1G").unwrap(), Bytes(1_000_000_000));
        assert_eq!(parse("1e9").unwrap(), Bytes(1_000_000_000));
        assert_eq!(parse("1024").unwrap(), Bytes(1024));
        assert_eq!(parse("0.5").unwrap(), Bytes(1), "rounded up");
        for bad in [
            "",
            "Gi",
            "12 parsecs",
            "100m",
            "99999999999999999999Ei",
            "1e40",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bytes_format_in_the_largest_exact_unit() {
        assert_eq!(format(Bytes::gib(16)), "16Gi");
        assert_eq!(format(Bytes::mib(1536)), "1536Mi");
        assert_eq!(format(Bytes(1000)), "1k");
        assert_eq!(format(Bytes(1_500_000_000)), "1500M");
        assert_eq!(format(Bytes(75_000_000_000)), "75G");
        assert_eq!(format(Bytes(1001)), "1001");
        assert_eq!(format(Bytes::ZERO), "0");
        for b in [Bytes::gib(141), Bytes::mib(3), Bytes(12345)] {
            assert_eq!(parse(&format(b)).unwrap(), b);
        }
    }
}
