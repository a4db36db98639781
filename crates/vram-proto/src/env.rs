//! The environment a tenant process is set up from: one table, read by libvram.so and
//! `vram-client` and written by `vramd run`, the Kubernetes plugin's CDI spec and `vramd.ray`, so
//! that the writer and the reader name each variable the same way. Every variable is optional;
//! flags, the C ABI's `vram_connect` and `TenantOptions` say the same things in code.

/// One variable and what it sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variable {
    pub name: &'static str,
    pub sets: &'static str,
}

/// The daemon's socket (default [`crate::DEFAULT_SOCKET`]).
pub const SOCKET: &str = "VRAMD_SOCKET";
/// The tenant's name (default `pid-<pid>`).
pub const TENANT: &str = "VRAMD_TENANT";
/// The tenant's class (a class of the daemon's configuration, which gives it its priority).
pub const CLASS: &str = "VRAMD_CLASS";
/// The guarantee the tenant asks for (a size: `20GiB`).
pub const GUARANTEE: &str = "VRAMD_GUARANTEE";
/// The limit the tenant asks for (a size).
pub const LIMIT: &str = "VRAMD_LIMIT";
/// Which of the daemon's devices, by index (default 0).
pub const GPU: &str = "VRAMD_GPU";
/// The invitation to join a tenant `vramd run` registered (`Role::Join`).
pub const JOIN: &str = "VRAMD_JOIN";
/// The tenant allocator's settings, comma-separated `NAME=VALUE` pairs.
pub const ALLOC: &str = "VRAMD_ALLOC";
/// `full` or `pool`: how PyTorch takes vramd's allocator (`vramd run --torch-mode`).
pub const TORCH_MODE: &str = "VRAMD_TORCH_MODE";
/// Where libvram.so is (default: beside the `vramd` executable).
pub const LIB: &str = "VRAMD_LIB";
/// `1`: the tenant's allocator times every call that passes its thread caches (a diagnostic).
pub const TIME_CORE: &str = "VRAMD_TIME_CORE";
/// Where `vramd_torch` keeps the small C++ shim it builds for full mode's out-of-memory errors
/// (default `~/.cache/vramd_torch`).
pub const TORCH_CACHE: &str = "VRAMD_TORCH_CACHE";

/// Names no longer read, each with the variable that sets what it set. A tenant whose environment
/// has one is refused at start, told the name to set instead (`check_renamed`, called by
/// `vram_client::TenantOptions::from_env` and `vramd run`), rather than running with the setting
/// silently dropped.
pub const RENAMED: [(&str, &str); 1] = [("VRAMD_PRIORITY", CLASS)];

/// An error naming the first variable of [`RENAMED`] set in this process's environment and the
/// one to set instead.
pub fn check_renamed() -> Result<(), String> {
    let Some((old, new)) = RENAMED
        .iter()
        .find(|(old, _)| std::env::var_os(old).is_some())
    else {
        return Ok(());
    };
    let sets = ALL.iter().find(|v| v.name == *new).map_or("", |v| v.sets);
    Err(format!(
        "{old} was renamed {new} ({sets}); set {new} instead and unset {old}"
    ))
}

/// Every variable above, for documentation and checks.
pub const ALL: [Variable; 12] = [
    Variable {
        name: SOCKET,
        sets: "the daemon's socket",
    },
    Variable {
        name: TENANT,
        sets: "the tenant's name",
    },
    Variable {
        name: CLASS,
        sets: "the tenant's class",
    },
    Variable {
        name: GUARANTEE,
        sets: "the guarantee asked for",
    },
    Variable {
        name: LIMIT,
        sets: "the limit asked for",
    },
    Variable {
        name: GPU,
        sets: "the daemon's device, by index",
    },
    Variable {
        name: JOIN,
        sets: "the invitation to join a registered tenant",
    },
    Variable {
        name: ALLOC,
        sets: "the tenant allocator's settings",
    },
    Variable {
        name: TORCH_MODE,
        sets: "how PyTorch takes vramd's allocator",
    },
    Variable {
        name: LIB,
        sets: "where libvram.so is",
    },
    Variable {
        name: TIME_CORE,
        sets: "whether the allocator times its calls",
    },
    Variable {
        name: TORCH_CACHE,
        sets: "where vramd_torch keeps the shim it builds",
    },
];

#[cfg(test)]
mod tests {
    #[test]
    fn the_operators_guide_names_every_variable() {
        let guide = include_str!("../../../docs/operations.md");
        for v in super::ALL {
            assert!(
                guide.contains(v.name),
                "docs/operations.md does not name {}",
                v.name
            );
        }
    }
}
