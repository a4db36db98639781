//! Whether a configuration can work, before the daemon starts with it (or reloads it): every
//! problem named with its setting and numbers. A configuration that parses is not yet one that
//! works: a capacity of 0, a capacity or limit below one granule, an empty `allowed_uids`, a pool
//! that can hold no handle, a declared tenant no process can connect as, guarantees that do not
//! fit, all start a daemon that serves nobody, so they are refused here.

use vram_core::Bytes;

use super::Config;

/// The longest `reclaim_timeout_ms`: a grant that waits longer than this for other tenants'
/// memory is a hung allocation to its program.
pub const MAX_RECLAIM_TIMEOUT_MS: u64 = 60_000;

/// The shortest writer lease on a shared buffer, and so the least `[shared] max_lease_ms`: a
/// lease shorter than this would run out before a writer could renew it.
pub const MIN_LEASE_MS: u64 = 10;

/// The slowest scrub that is not a mistake for a unit left out: a 1 GiB version in about 17 min.
pub const MIN_SCRUB_RATE: Bytes = Bytes::mib(1);

/// The longest of the `[connections]` timeouts.
pub const MAX_CONNECTION_TIMEOUT_MS: u64 = 3_600_000;

/// Said of a size below one granule that reads like a number written without its unit (under
/// 1 KiB): "8" is 8 bytes.
pub fn bare_size_hint(size: Bytes) -> &'static str {
    if size.get() < Bytes::KIB {
        " (a size without a unit is in bytes: write \"8 GiB\", not 8)"
    } else {
        ""
    }
}

/// What is known of a device the configuration would run on. `None`: not known without starting
/// (a GPU's memory is measured at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    pub capacity: Option<Bytes>,
    pub granularity: Option<Bytes>,
}

/// Why a configuration cannot work.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("capacity is 0: there would be nothing to serve")]
    ZeroCapacity,
    #[error(
        "{key} = {size} is below the device's granularity ({granularity}): {why}{}",
        bare_size_hint(*size)
    )]
    SizeBelowGranularity {
        key: String,
        size: Bytes,
        granularity: Bytes,
        why: &'static str,
    },
    #[error("[users.{key}]: a user is a uid (a number) or `default`")]
    UserKey { key: String },
    #[error(
        "allowed_uids is empty: no one could connect (leave it out for root and the daemon's own \
         uid)"
    )]
    AllowedUidsEmpty,
    #[error(
        "admin_uids {uids:?} are not in allowed_uids: they could not connect to make admin calls \
         (add them to allowed_uids)"
    )]
    AdminNotAllowed { uids: Vec<u32> },
    #[error("socket_mode `{mode}` is {reason}")]
    SocketMode { mode: String, reason: &'static str },
    #[error(
        "reclaim_timeout_ms = {ms} is above {max}: a grant would wait that long for other \
         tenants' memory"
    )]
    ReclaimTimeoutTooLong { ms: u64, max: u64 },
    #[error(
        "[shared] scrub_rate = {rate} a second is below {min}: a pass over a 1 GiB version would \
         take {days} days (0 turns the scrub off){}",
        bare_size_hint(*rate),
        days = Bytes::GIB / rate.get().max(1) / 86_400
    )]
    ScrubTooSlow { rate: Bytes, min: Bytes },
    #[error("[shared] max_lease_ms = {ms} is below {min}: no writer lease could be that short")]
    LeaseTooShort { ms: u64, min: u64 },
    #[error("[connections] {key} = 0: {why}")]
    ZeroLimit {
        key: &'static str,
        why: &'static str,
    },
    #[error("[connections] {key} = {ms} is above {max} ms")]
    TimeoutTooLong {
        key: &'static str,
        ms: u64,
        max: u64,
    },
    #[error(
        "[pool] max = {max} is below the device's granularity ({granularity}): the pool could hold \
         no handle (0 turns the pool off)"
    )]
    PoolMaxBelowGranularity { max: Bytes, granularity: Bytes },
    #[error("[pool] sizes: {size} is below the device's granularity ({granularity})")]
    PoolSizeBelowGranularity { size: Bytes, granularity: Bytes },
    #[error(
        "[pool] sizes: {size} is not a multiple of the device's granularity ({granularity}): no \
         grant would ever take it"
    )]
    PoolSizeNotMultiple { size: Bytes, granularity: Bytes },
    /// The broker's policy (classes, declared tenants, guarantees, reserve) cannot work.
    #[error(transparent)]
    Policy(Box<dyn std::error::Error + Send + Sync>),
}

impl Config {
    /// Every reason this configuration cannot work on `devices` (empty: it can). Checks that
    /// need a device's capacity or granularity are made where it is known.
    pub fn problems(&self, devices: &[Device]) -> Vec<ConfigError> {
        let mut out = Vec::new();
        if let Err(e) = self.socket_mode() {
            out.push(e);
        }
        if self.allowed_uids.as_ref().is_some_and(Vec::is_empty) {
            out.push(ConfigError::AllowedUidsEmpty);
        }
        if let (Some(allowed), Some(admins)) = (&self.allowed_uids, &self.admin_uids) {
            let shut_out: Vec<u32> = admins
                .iter()
                .copied()
                .filter(|u| !allowed.contains(u))
                .collect();
            if !shut_out.is_empty() {
                out.push(ConfigError::AdminNotAllowed { uids: shut_out });
            }
        }
        if let Some(ms) = self
            .reclaim_timeout_ms
            .filter(|ms| *ms > MAX_RECLAIM_TIMEOUT_MS)
        {
            out.push(ConfigError::ReclaimTimeoutTooLong {
                ms,
                max: MAX_RECLAIM_TIMEOUT_MS,
            });
        }
        let rate = self.shared.scrub_rate;
        if rate > Bytes::ZERO && rate < MIN_SCRUB_RATE {
            out.push(ConfigError::ScrubTooSlow {
                rate,
                min: MIN_SCRUB_RATE,
            });
        }
        if self.shared.max_lease_ms < MIN_LEASE_MS {
            out.push(ConfigError::LeaseTooShort {
                ms: self.shared.max_lease_ms,
                min: MIN_LEASE_MS,
            });
        }
        self.connection_problems(&mut out);
        for key in self.users.keys() {
            if key != "default" && key.parse::<u32>().is_err() {
                out.push(ConfigError::UserKey { key: key.clone() });
            }
        }
        if self.capacity == Some(Bytes::ZERO) {
            out.push(ConfigError::ZeroCapacity);
            return out;
        }
        let mut said = Vec::new();
        for d in devices {
            let mut found = Vec::new();
            if let Some(g) = d.granularity {
                self.pool_problems(g, &mut found);
                self.size_problems(d.capacity, g, &mut found);
            }
            // Without the capacity, what does not depend on it: names, classes, overflow.
            let capacity = d.capacity.unwrap_or(Bytes(u64::MAX));
            found.extend(
                self.policy(capacity)
                    .problems()
                    .into_iter()
                    .map(|e| ConfigError::Policy(Box::new(e))),
            );
            // Devices alike give the same problems: each is said once.
            for p in found {
                let text = p.to_string();
                if !said.contains(&text) {
                    said.push(text);
                    out.push(p);
                }
            }
        }
        out
    }

    fn connection_problems(&self, out: &mut Vec<ConfigError>) {
        let c = &self.connections;
        let counts = [
            ("max_total", c.max_total, "no connection could be accepted"),
            ("max_per_uid", c.max_per_uid, "no uid could connect"),
            (
                "max_waits",
                c.max_waits,
                "no shared-buffer wait, publish or verify could be served",
            ),
        ];
        for (key, v, why) in counts {
            if v == 0 {
                out.push(ConfigError::ZeroLimit { key, why });
            }
        }
        let timeouts = [
            ("hello_timeout_ms", c.hello_timeout_ms),
            ("frame_timeout_ms", c.frame_timeout_ms),
            ("send_timeout_ms", c.send_timeout_ms),
            ("unread_timeout_ms", c.unread_timeout_ms),
        ];
        for (key, ms) in timeouts {
            if ms == 0 {
                out.push(ConfigError::ZeroLimit {
                    key,
                    why: "every peer would be cut off at once",
                });
            } else if ms > MAX_CONNECTION_TIMEOUT_MS {
                out.push(ConfigError::TimeoutTooLong {
                    key,
                    ms,
                    max: MAX_CONNECTION_TIMEOUT_MS,
                });
            }
        }
    }

    /// The device's `capacity` and the limits, where one byte to below a granule: a size written
    /// without its unit (0 is taken as meant, a capacity of 0 refused on its own).
    fn size_problems(
        &self,
        capacity: Option<Bytes>,
        granularity: Bytes,
        out: &mut Vec<ConfigError>,
    ) {
        let capacity = ("capacity".to_string(), capacity, "nothing could be granted");
        let sizes = std::iter::once(capacity)
            .chain(self.tenants.iter().map(|(n, t)| {
                let why = "the tenant could hold nothing";
                (format!("[tenants.{n}] limit"), t.limit, why)
            }))
            .chain(self.tenants.iter().map(|(n, t)| {
                let why = "it would reserve less than one granule";
                (format!("[tenants.{n}] guarantee"), Some(t.guarantee), why)
            }))
            .chain(self.classes.iter().map(|(n, c)| {
                let why = "a tenant of the class that asks for no limit could hold nothing";
                (format!("[classes.{n}] default_limit"), c.default_limit, why)
            }))
            .chain(self.classes.iter().map(|(n, c)| {
                let why = "it would reserve less than one granule for each tenant of the class";
                (
                    format!("[classes.{n}] default_guarantee"),
                    Some(c.default_guarantee),
                    why,
                )
            }))
            .chain(self.users.iter().map(|(n, u)| {
                let why = "the uid's tenants could hold nothing";
                (format!("[users.{n}] max_memory"), u.max_memory, why)
            }))
            .chain(std::iter::once((
                "priority_reserve".to_string(),
                self.priority_reserve,
                "it could keep no grant from a lower class (0 keeps none)",
            )));
        for (key, size, why) in sizes {
            if let Some(size) = size.filter(|s| *s > Bytes::ZERO && *s < granularity) {
                out.push(ConfigError::SizeBelowGranularity {
                    key,
                    size,
                    granularity,
                    why,
                });
            }
        }
    }

    fn pool_problems(&self, granularity: Bytes, out: &mut Vec<ConfigError>) {
        let g = granularity.get().max(1);
        let max = self.pool.max;
        if max > Bytes::ZERO && max < granularity {
            out.push(ConfigError::PoolMaxBelowGranularity { max, granularity });
        }
        for &size in &self.pool.sizes {
            if size < granularity {
                out.push(ConfigError::PoolSizeBelowGranularity { size, granularity });
            } else if size.get() % g != 0 {
                out.push(ConfigError::PoolSizeNotMultiple { size, granularity });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: Device = Device {
        capacity: Some(Bytes::gib(8)),
        granularity: Some(Bytes::mib(2)),
    };

    fn problems(toml: &str) -> Vec<String> {
        let c: Config = toml::from_str(toml).unwrap();
        c.problems(&[HOST, HOST])
            .iter()
            .map(|p| p.to_string())
            .collect()
    }

    #[test]
    fn a_sound_file_has_no_problems() {
        assert!(problems("").is_empty());
        assert!(problems(
            "[tenants.a]\nclass = \"high\"\nguarantee = \"4 GiB\"\n[pool]\nsizes = [\"2 MiB\", \
             \"64 MiB\"]\n"
        )
        .is_empty());
    }

    #[test]
    fn each_problem_is_named_once_with_its_numbers() {
        let p = problems(
            "allowed_uids = []\nreclaim_timeout_ms = 70000\n[pool]\nmax = \"1 KiB\"\nsizes = \
             [\"1 KiB\", \"3 MiB\"]\n[connections]\nmax_waits = 0\n[tenants.a]\nclass = \
             \"normal\"\nguarantee = \"9 GiB\"\n[shared]\nmax_lease_ms = 0\n",
        );
        let want = [
            "allowed_uids is empty",
            "reclaim_timeout_ms = 70000 is above 60000",
            "[shared] max_lease_ms = 0 is below 10",
            "[connections] max_waits = 0",
            "[pool] max = 1 KiB is below the device's granularity (2 MiB)",
            "[pool] sizes: 1 KiB is below the device's granularity (2 MiB)",
            "[pool] sizes: 3 MiB is not a multiple of the device's granularity (2 MiB)",
            "[tenants.a]: guarantee 9 GiB is above its limit 8 GiB",
            "declared guarantees sum to 9 GiB, above the capacity 8 GiB",
        ];
        assert_eq!(p.len(), want.len(), "{p:#?}");
        for (got, want) in p.iter().zip(want) {
            assert!(got.starts_with(want), "`{got}` is not `{want}…`");
        }
    }

    /// A guarantee written without a unit (8 meaning 8 GiB) is 8 bytes: refused with the unit it
    /// lacks, as limits are; admin uids that may not connect are named.
    #[test]
    fn guarantees_without_a_unit_and_admins_who_cannot_connect_are_refused() {
        let p = problems(
            "allowed_uids = [0, 1000]\nadmin_uids = [0, 2000]\n[tenants.a]\nguarantee = 8\n\
             [classes.batch]\npriority = 20\ndefault_guarantee = 1024\n",
        );
        assert_eq!(p.len(), 3, "{p:#?}");
        assert!(
            p[0].starts_with("admin_uids [2000] are not in allowed_uids"),
            "{}",
            p[0]
        );
        assert!(p[1].starts_with("[tenants.a] guarantee = 8 B"), "{}", p[1]);
        assert!(p[1].contains("GiB"), "{}", p[1]);
        assert!(
            p[2].starts_with("[classes.batch] default_guarantee = 1 KiB"),
            "{}",
            p[2]
        );
    }

    /// A scrub rate or priority reserve written without a unit is bytes: refused, with the unit
    /// it lacks, where that makes it useless.
    #[test]
    fn a_scrub_rate_or_reserve_without_a_unit_is_refused() {
        let c: Config = toml::from_str(
            "priority_reserve = 512
[shared]
scrub_rate = 256
",
        )
        .unwrap();
        let host = Device {
            capacity: Some(Bytes::gib(8)),
            granularity: Some(Bytes::mib(2)),
        };
        let p: Vec<String> = c.problems(&[host]).iter().map(|e| e.to_string()).collect();
        assert_eq!(p.len(), 2, "{p:#?}");
        assert!(
            p[0].starts_with("[shared] scrub_rate = 256 B a second is below 1 MiB"),
            "{}",
            p[0]
        );
        assert!(p[0].contains("write \"8 GiB\""), "{}", p[0]);
        assert!(
            p[1].starts_with("priority_reserve = 512 B is below the device's granularity"),
            "{}",
            p[1]
        );
        let c: Config = toml::from_str(
            "priority_reserve = 0
[shared]
scrub_rate = \"0\"
",
        )
        .unwrap();
        assert!(c.problems(&[host]).is_empty());
    }

    #[test]
    fn a_capacity_below_one_granule_is_refused_with_the_unit_it_lacks() {
        let c: Config = toml::from_str("capacity = 8\n").unwrap();
        let host = Device {
            capacity: c.capacity,
            granularity: Some(Bytes::mib(2)),
        };
        let p = c.problems(&[host]);
        assert!(
            matches!(
                p.as_slice(),
                [ConfigError::SizeBelowGranularity { key, size, .. }]
                    if key == "capacity" && *size == Bytes(8)
            ),
            "{p:?}"
        );
        assert!(p[0].to_string().contains("write \"8 GiB\""), "{}", p[0]);
        let one_granule = Device {
            capacity: Some(Bytes::mib(2)),
            ..host
        };
        assert!(c.problems(&[one_granule]).is_empty());
    }

    #[test]
    fn limits_below_one_granule_are_refused_and_zero_is_taken_as_meant() {
        let got = problems(
            "[tenants.a]\nclass = \"normal\"\nlimit = 8\n\
             [classes.tiny]\npriority = 1\ndefault_limit = 1024\n\
             [users.1001]\nmax_memory = 0\n",
        );
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            got[0].starts_with("[tenants.a] limit = 8 B is below"),
            "{got:?}"
        );
        assert!(
            got[1].starts_with("[classes.tiny] default_limit = 1 KiB is below"),
            "{got:?}"
        );
    }

    #[test]
    fn without_a_capacity_names_classes_and_overflow_are_still_checked() {
        let c: Config = toml::from_str("[tenants.\"no way\"]\nclass = \"normal\"\n").unwrap();
        let unknown = Device {
            capacity: None,
            granularity: None,
        };
        let p = c.problems(&[unknown]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0]
            .to_string()
            .contains("`no way` is not a valid tenant name"));
        let zero: Config = toml::from_str("capacity = \"0\"\n").unwrap();
        assert!(matches!(
            zero.problems(&[unknown]).as_slice(),
            [ConfigError::ZeroCapacity]
        ));
    }
}
