//! A tenant's options read from its environment: the variables of `vram_proto::env`, the same
//! table `vramd run`, the Kubernetes plugin's CDI spec and `vramd.ray` write.

use vram_core::Bytes;
use vram_proto::env;

use crate::{ClientError, TenantOptions};

/// The variable's value; `None` if unset or empty; an error if it is not UTF-8 (never taken as
/// unset: an unreadable `VRAMD_LIMIT` is no reason to hold the whole device).
fn var(name: &str) -> Result<Option<String>, ClientError> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v).filter(|v| !v.is_empty())),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(ClientError::Environment(format!(
            "{name} {v:?} is not UTF-8"
        ))),
    }
}

fn bytes(name: &str) -> Result<Option<Bytes>, ClientError> {
    var(name)?
        .map(|v| {
            v.parse()
                .map_err(|e| ClientError::Environment(format!("{name} `{v}`: {e}")))
        })
        .transpose()
}

impl TenantOptions {
    /// What this process's environment asks for: `VRAMD_TENANT` (default `pid-<pid>`),
    /// `VRAMD_CLASS`, `VRAMD_GUARANTEE`, `VRAMD_LIMIT`, `VRAMD_GPU` and `VRAMD_JOIN`; a variable
    /// unset or empty leaves its field to the default. `VRAMD_JOIN` counts only without
    /// `VRAMD_TENANT`: `vramd run` never sets the name, so a process given one (a second process
    /// of the program, which the run's one-time invitation cannot admit) is a tenant of its own. A
    /// value that does not parse, or a variable of `vram_proto::env::RENAMED` still set, is an
    /// error naming it.
    pub fn from_env() -> Result<TenantOptions, ClientError> {
        env::check_renamed().map_err(ClientError::Environment)?;
        let gpu = var(env::GPU)?
            .map(|v| {
                v.parse::<u32>()
                    .map_err(|e| ClientError::Environment(format!("{} `{v}`: {e}", env::GPU)))
            })
            .transpose()?;
        let name = var(env::TENANT)?;
        Ok(TenantOptions {
            join: var(env::JOIN)?.filter(|_| name.is_none()),
            name: name.unwrap_or_else(|| format!("pid-{}", std::process::id())),
            class: var(env::CLASS)?,
            guarantee: bytes(env::GUARANTEE)?,
            limit: bytes(env::LIMIT)?,
            gpu,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test sets and reads the variables, so that no other test of this binary sees them
    /// half set.
    #[test]
    fn the_environment_sets_each_option_and_the_old_class_name_is_refused() {
        let read = [
            env::TENANT,
            env::CLASS,
            env::GUARANTEE,
            env::LIMIT,
            env::GPU,
            env::JOIN,
        ];
        for v in read {
            std::env::remove_var(v);
        }
        let o = TenantOptions::from_env().unwrap();
        assert_eq!(o.name, format!("pid-{}", std::process::id()));
        assert_eq!(
            (o.class, o.guarantee, o.limit, o.gpu, o.join),
            (None, None, None, None, None)
        );

        std::env::set_var(env::TENANT, "trainer");
        std::env::set_var(env::CLASS, "batch");
        std::env::set_var(env::GUARANTEE, "2GiB");
        std::env::set_var(env::LIMIT, "4GiB");
        std::env::set_var(env::GPU, "1");
        let o = TenantOptions::from_env().unwrap();
        assert_eq!(o.name, "trainer");
        assert_eq!(o.class.as_deref(), Some("batch"));
        assert_eq!(
            (o.guarantee, o.limit),
            (Some(Bytes::gib(2)), Some(Bytes::gib(4)))
        );
        assert_eq!(o.gpu, Some(1));

        // An invitation is `vramd run`'s, which sets no name: with a name the process is its own.
        std::env::set_var(env::JOIN, "token");
        assert_eq!(TenantOptions::from_env().unwrap().join, None);
        std::env::remove_var(env::TENANT);
        assert_eq!(
            TenantOptions::from_env().unwrap().join.as_deref(),
            Some("token")
        );
        std::env::remove_var(env::JOIN);

        std::env::set_var(env::LIMIT, "lots");
        let e = TenantOptions::from_env().unwrap_err().to_string();
        assert!(e.contains("VRAMD_LIMIT `lots`"), "{e}");
        {
            use std::os::unix::ffi::OsStrExt;
            let not_utf8 = std::ffi::OsStr::from_bytes(b"8\xffGiB");
            std::env::set_var(env::LIMIT, not_utf8);
        }
        let e = TenantOptions::from_env().unwrap_err().to_string();
        assert!(e.contains("VRAMD_LIMIT") && e.contains("not UTF-8"), "{e}");
        std::env::remove_var(env::LIMIT);

        std::env::set_var("VRAMD_PRIORITY", "batch");
        let e = TenantOptions::from_env().unwrap_err().to_string();
        assert!(e.contains("VRAMD_PRIORITY was renamed VRAMD_CLASS"), "{e}");
        std::env::remove_var("VRAMD_PRIORITY");
        for v in read {
            std::env::remove_var(v);
        }
    }
}
