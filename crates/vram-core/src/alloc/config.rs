//! What an allocator is built with: the device's facts (granularity, address space, block
//! alignment), which no user chooses, and the few settings a user may change.

use crate::Bytes;

/// An allocator's configuration. The facts come from the device (`granularity`) or the design
/// (`va_bytes`, `align`); the settings are the fields that [`AllocConfig::set`] accepts by name.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct AllocConfig {
    /// The device's granularity: the smallest unit that can be granted, mapped or returned.
    #[serde(skip)]
    pub granularity: Bytes,
    /// Size of the virtual reservation that offsets are relative to.
    #[serde(skip)]
    pub va_bytes: Bytes,
    /// Block sizes are multiples of this, and blocks start at multiples of it.
    #[serde(skip)]
    pub align: Bytes,
    /// Setting: the least one growth adds. Larger means fewer requests to the daemon for a
    /// program whose memory grows a little at a time, and more memory held beyond its need.
    pub min_grow: Bytes,
    /// Setting: the largest handle (the unit memory is taken from the daemon, moved and given
    /// back in). A handle goes back only whole, so the free memory a live block strands beside it
    /// is at most a handle; smaller handles strand less and cost driver calls each. Grants are
    /// cut into handles between a quarter of it and all of it, as `driver_budget` affords, and
    /// never above 1/32 of the peak in use (rounded up to a power of two).
    pub max_handle: Bytes,
    /// Setting: the share of the program's time the allocator may spend in the calls that grant,
    /// map and give back memory (measured on a device, priced by the cost model in a replay).
    /// Time left under it buys smaller handles, which strand less free memory.
    pub driver_budget: f64,
    /// Setting: how far memory held may run above the peak in use (a fraction of that peak) while
    /// growth takes new memory; beyond it, growth reuses wholly free memory from elsewhere first.
    /// This bounds the free memory kept cached while the program grows.
    pub grow_slack: f64,
    /// Setting: free memory kept cached above the recent peak in use, as a fraction of it, when
    /// memory is given back.
    pub keep_fraction: f64,
    /// Setting: how long memory above the recent peak (plus `keep_fraction`) stays before it is
    /// given back, in microseconds of the allocator's time.
    pub release_delay_us: u64,
}

impl Default for AllocConfig {
    fn default() -> Self {
        Self {
            granularity: Bytes::mib(2),
            va_bytes: Bytes(Bytes::TIB),
            align: Bytes(512),
            min_grow: Bytes::mib(2),
            max_handle: Bytes::mib(64),
            driver_budget: 0.01,
            grow_slack: 0.01,
            keep_fraction: 0.0625,
            release_delay_us: 10_000_000,
        }
    }
}

impl AllocConfig {
    /// Changes one setting from text, as in `min_grow=16MiB` (a setting's name and a value: sizes
    /// with or without a unit, numbers). Unknown names, device facts and values that do not parse
    /// are errors that say so.
    pub fn set(&mut self, setting: &str) -> Result<(), String> {
        let (key, value) = setting
            .split_once('=')
            .ok_or_else(|| format!("`{setting}`: expected NAME=VALUE, e.g. min_grow=16MiB"))?;
        let (key, value) = (key.trim(), value.trim());
        let mut fields = match serde_json::to_value(&*self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => unreachable!("AllocConfig serialises as an object"),
        };
        if !fields.contains_key(key) {
            let mut names: Vec<&str> = fields.keys().map(String::as_str).collect();
            names.sort_unstable();
            return Err(format!(
                "`{key}` is not an allocator setting (known: {})",
                names.join(", ")
            ));
        }
        let parsed = serde_json::from_str::<serde_json::Value>(value)
            .unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
        fields.insert(key.to_string(), parsed);
        let changed: AllocConfig = serde_json::from_value(serde_json::Value::Object(fields))
            .map_err(|e| format!("`{setting}`: {e}"))?;
        for (name, f) in [
            ("grow_slack", changed.grow_slack),
            ("keep_fraction", changed.keep_fraction),
        ] {
            if !(f.is_finite() && f >= 0.0) {
                return Err(format!(
                    "`{setting}`: {name} must be a fraction of at least 0"
                ));
            }
        }
        if !(0.0..=1.0).contains(&changed.driver_budget) {
            return Err(format!(
                "`{setting}`: driver_budget must be a share of time from 0 to 1 (0.01 is 1 %)"
            ));
        }
        *self = AllocConfig {
            granularity: self.granularity,
            va_bytes: self.va_bytes,
            align: self.align,
            ..changed
        };
        Ok(())
    }

    /// Applies settings separated by commas (`min_grow=16MiB,max_handle=32MiB`).
    pub fn set_all(&mut self, settings: &str) -> Result<(), String> {
        settings
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .try_for_each(|s| self.set(s))
    }
}
