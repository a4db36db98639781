//! What of the configuration a running daemon can put in force (SIGHUP), and what only a restart
//! can: the socket, its mode, the backend, the capacity, the metrics endpoint (its address, its
//! per-tenant series, who may read `/status`) and the pool are fixed when the daemon starts
//! (they shape what it bound and created); everything else is live.

use super::Config;
use crate::server::Reload;

impl Config {
    /// The live part of this configuration, as a reload puts it in force (each device's policy
    /// comes from [`Config::policy`] at that device's capacity).
    pub fn live(&self) -> Reload {
        Reload {
            allowed_uids: self.allowed_uids.clone(),
            reclaim_timeout: self.reclaim_timeout(),
            connections: self.connections,
            shared: self.shared.clone(),
            admin_uids: self.admin_uids.clone(),
        }
    }

    /// The keys set differently in `new` that cannot change while serving.
    pub fn fixed_changes(&self, new: &Config) -> Vec<&'static str> {
        let mut keys = Vec::new();
        if self.socket != new.socket {
            keys.push("socket");
        }
        if self.socket_mode != new.socket_mode {
            keys.push("socket_mode");
        }
        if self.backend != new.backend {
            keys.push("backend");
        }
        if self.capacity != new.capacity {
            keys.push("capacity");
        }
        if self.metrics != new.metrics {
            keys.push("metrics");
        }
        if self.metrics_tenants != new.metrics_tenants {
            keys.push("metrics_tenants");
        }
        if self.http_status != new.http_status {
            keys.push("http_status");
        }
        if self.pool != new.pool {
            keys.push("[pool]");
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_keys_are_told_apart_from_live_ones() {
        let a: Config = toml::from_str("capacity = \"1 GiB\"\nreclaim_timeout_ms = 100\n").unwrap();
        let b: Config = toml::from_str(
            "capacity = \"2 GiB\"\nreclaim_timeout_ms = 300\nmetrics_tenants = true\n\
             http_status = \"any\"\n[pool]\nmax = \"0\"\n",
        )
        .unwrap();
        assert_eq!(
            a.fixed_changes(&b),
            vec!["capacity", "metrics_tenants", "http_status", "[pool]"]
        );
        assert!(a.fixed_changes(&a).is_empty());
        assert_eq!(b.live().reclaim_timeout.as_millis(), 300);
    }
}
