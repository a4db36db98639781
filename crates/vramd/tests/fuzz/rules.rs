//! The daemon the fuzz test runs against (small, with declared tenants, classes and per-uid
//! limits, so that every rule binds often), and what must hold in every status report it gives.

use std::collections::BTreeMap;

use vram_core::Bytes;
use vram_proto::StatusReport;

pub const CAPACITY: Bytes = Bytes::mib(48);
pub const GRANULARITY: Bytes = vram_device::host::DEFAULT_GRANULARITY;
/// What all tenants of the test's uid may hold together (`[users.default] max_memory`).
pub const USER_MAX_MEMORY: Bytes = Bytes::mib(40);
/// How many tenants the test's uid may have connected at once.
pub const USER_MAX_TENANTS: usize = 5;
/// The most handles the pool may keep (`[pool] max` over the granularity).
pub const POOL_HANDLES: usize = 4;

/// A declared tenant as configured.
pub struct Declared {
    pub name: &'static str,
    pub class: &'static str,
    pub guarantee: Bytes,
    pub limit: Bytes,
    /// Whether the test's uid may connect as it.
    pub ours: bool,
}

pub const DECLARED: [Declared; 3] = [
    Declared {
        name: "prod",
        class: "high",
        guarantee: Bytes::mib(8),
        limit: Bytes::mib(24),
        ours: true,
    },
    Declared {
        name: "locked",
        class: "high",
        guarantee: Bytes::mib(4),
        limit: Bytes::mib(8),
        ours: false,
    },
    Declared {
        name: "batch",
        class: "low",
        guarantee: Bytes::ZERO,
        limit: Bytes::mib(12),
        ours: true,
    },
];

/// The configuration: short deadlines (so that stalled frames and silent peers are cut off within
/// a round), a short reclaim wait, a small pool, the scrub on. No uid may make admin calls: the
/// peers are tenants, and random bytes that decode as an admin call must be refused.
pub fn config(uid: u32) -> String {
    let mut c = format!(
        "allowed_uids = [{uid}]\n\
         admin_uids = []\n\
         capacity = \"{}\"\n\
         priority_reserve = \"2 MiB\"\n\
         reclaim_timeout_ms = 5\n\
         metrics = \"127.0.0.1:0\"\n\
         [pool]\nmax = \"{}\"\nsizes = [\"2 MiB\"]\ninitial = 2\n\
         [shared]\nscrub_rate = \"64 MiB\"\nmax_lease_ms = 200\n\
         [connections]\nhello_timeout_ms = 1000\nframe_timeout_ms = 200\n\
         send_timeout_ms = 2000\nunread_timeout_ms = 2000\nmax_waits = 4\n\
         [classes.high]\npriority = 100\ndefault_limit = \"32 MiB\"\n\
         [classes.normal]\npriority = 50\ndefault_limit = \"16 MiB\"\n\
         [classes.low]\npriority = 10\ndefault_limit = \"8 MiB\"\n\
         [users.default]\nmax_memory = \"{}\"\nmax_tenants = {USER_MAX_TENANTS}\n",
        CAPACITY.get(),
        GRANULARITY.get() * POOL_HANDLES as u64,
        USER_MAX_MEMORY.get(),
    );
    for d in &DECLARED {
        let owner = if d.ours { uid } else { uid + 1 };
        c.push_str(&format!(
            "[tenants.{}]\nclass = \"{}\"\nguarantee = \"{}\"\nlimit = \"{}\"\nowners = [{owner}]\n",
            d.name,
            d.class,
            d.guarantee.get(),
            d.limit.get()
        ));
    }
    c
}

fn declared(name: &str) -> Option<&'static Declared> {
    DECLARED.iter().find(|d| d.name == name)
}

/// Every rule a status report must show kept, whatever the peers sent.
pub fn check_report(r: &StatusReport) -> Result<(), String> {
    let fail = |what: String| Err(format!("{what}\nstatus: {r:#?}"));
    if r.devices.len() != 1 {
        return fail(format!(
            "{} devices; the daemon serves one",
            r.devices.len()
        ));
    }
    let dev = &r.devices[0];
    let mut by_uid: BTreeMap<u32, (u128, usize)> = BTreeMap::new();
    let mut footprints: u128 = 0;
    let mut held: u128 = 0;
    for t in &r.tenants {
        let total = t.held.get() as u128 + t.charged.get() as u128 + t.outside.get() as u128;
        if total > t.limit.get() as u128 {
            return fail(format!(
                "tenant `{}` has {total} bytes (held {}, charged {}, outside {}) over its limit {}",
                t.name, t.held, t.charged, t.outside, t.limit
            ));
        }
        if t.guarantee > t.limit {
            return fail(format!("tenant `{}`: guarantee above its limit", t.name));
        }
        match declared(&t.name) {
            Some(d) if !d.ours => {
                return fail(format!("`{}` is connected by a uid not among its owners", t.name))
            }
            Some(d) if t.class != d.class || t.guarantee != d.guarantee || t.limit > d.limit => {
                return fail(format!(
                    "declared tenant `{}` runs as class {}, guarantee {}, limit {}; declared {}, {}, {}",
                    t.name, t.class, t.guarantee, t.limit, d.class, d.guarantee, d.limit
                ))
            }
            None if t.class == "high" => {
                return fail(format!(
                    "undeclared tenant `{}` got class high, which no uid may ask for",
                    t.name
                ))
            }
            _ => {}
        }
        let u = by_uid.entry(t.uid).or_default();
        u.0 += total;
        u.1 += 1;
        footprints += total.max(t.guarantee.get() as u128);
        held += t.held.get() as u128;
    }
    for (uid, (total, count)) in &by_uid {
        if *total > USER_MAX_MEMORY.get() as u128 || *count > USER_MAX_TENANTS {
            return fail(format!(
                "uid {uid} has {count} tenants holding {total} bytes; its limits are \
                 {USER_MAX_TENANTS} tenants and {USER_MAX_MEMORY}"
            ));
        }
    }
    let offline: u128 = DECLARED
        .iter()
        .filter(|d| !r.tenants.iter().any(|t| t.name == d.name))
        .map(|d| d.guarantee.get() as u128)
        .sum();
    if r.daemon.tenants_left_out == 0 && held != dev.held.get() as u128 {
        return fail(format!(
            "the tenants hold {held} bytes together; the device says {}",
            dev.held
        ));
    }
    let promised = footprints + offline + dev.outside_use.get() as u128;
    if dev.capacity != CAPACITY
        || dev.held > dev.capacity
        || dev.device_used > dev.capacity
        || promised > dev.capacity.get() as u128
    {
        return fail(format!(
            "device over its capacity {}: held {}, created {}, promised {promised}",
            dev.capacity, dev.held, dev.device_used
        ));
    }
    Ok(())
}

/// What a report must show once every peer has gone: nobody, nothing held or kept, nothing
/// shared, every declared guarantee reserved again.
pub fn check_idle(r: &StatusReport) -> Result<(), String> {
    let dev = &r.devices[0];
    let guarantees: u64 = DECLARED.iter().map(|d| d.guarantee.get()).sum();
    if !r.tenants.is_empty()
        || r.daemon.tenants_left_out != 0
        || dev.held != Bytes::ZERO
        || dev.kept != Bytes::ZERO
        || dev.reserved != Bytes(guarantees)
        || !r.shared.buffers.is_empty()
        || r.shared.buffers_left_out != 0
    {
        return Err(format!(
            "books not back to zero with every connection closed: {} tenants, held {}, kept {}, \
             reserved {} (declared guarantees {}), {} shared buffers\nstatus: {r:#?}",
            r.tenants.len(),
            dev.held,
            dev.kept,
            dev.reserved,
            Bytes(guarantees),
            r.shared.buffers.len()
        ));
    }
    Ok(())
}

/// What a tenant may be admitted as: a declared tenant as declared (and only by its owners), any
/// other in a class below `high`.
pub fn check_welcome(w: &vram_proto::Welcome) -> Result<(), String> {
    match declared(&w.name) {
        Some(d) if !d.ours => Err(format!(
            "admitted as `{}`, whose owners exclude this uid",
            w.name
        )),
        Some(d) if w.class != d.class || w.guarantee != d.guarantee || w.limit > d.limit => {
            Err(format!(
                "declared tenant admitted as {w:?}; declared {}, {}, {}",
                d.class, d.guarantee, d.limit
            ))
        }
        None if w.class == "high" => {
            Err(format!("undeclared tenant admitted in class high: {w:?}"))
        }
        _ if w.guarantee > w.limit => {
            Err(format!("admitted with a guarantee above its limit: {w:?}"))
        }
        _ => Ok(()),
    }
}
