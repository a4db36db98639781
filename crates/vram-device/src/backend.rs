//! The registry of backends: which kinds of device there are, their names, the devices each
//! has, and how one is opened. Everything outside this crate names a backend through
//! [`BackendKind`] (parsed from and printed as its lowercase name, the same form on the wire, in
//! the configuration and in flags) and opens a device through [`open`] or [`open_for_handles`].

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use vram_core::Bytes;

use crate::{cuda, host, ByteAccess, Device, DeviceInfo, Result};

/// Which backend a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    /// memfd-backed shared memory: no GPU needed.
    Host,
    /// NVIDIA GPUs through the driver's virtual-memory API.
    Cuda,
}

impl BackendKind {
    /// Every backend, in the order [`BackendSelection::Auto`] tries them.
    pub const ALL: [BackendKind; 2] = [BackendKind::Cuda, BackendKind::Host];

    /// The name the backend goes by everywhere: flags, configuration, the wire, logs.
    pub const fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
        }
    }

    /// Every backend's name, comma-separated, in [`BackendKind::ALL`]'s order.
    pub fn known() -> String {
        let names: Vec<&str> = BackendKind::ALL.iter().map(|k| k.name()).collect();
        names.join(", ")
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, so that widths and alignment (`{:<8}`) apply as to a string.
        f.pad(self.name())
    }
}

/// A backend name that is none of [`BackendKind::ALL`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device backend `{name}`; known: {known}")]
pub struct UnknownBackend {
    pub name: String,
    /// The names that would have been accepted.
    pub known: String,
}

impl FromStr for BackendKind {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        BackendKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownBackend {
                name: s.to_owned(),
                known: BackendKind::known(),
            })
    }
}

/// Serialized as its name, so that a message or a report carries the same string in any format.
impl serde::Serialize for BackendKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for BackendKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// Which backend a daemon serves: one by name, or `auto`, the first of [`BackendKind::ALL`]
/// that has a device (cuda where a GPU is found, else host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendSelection {
    #[default]
    Auto,
    Only(BackendKind),
}

impl BackendSelection {
    /// The backend a daemon started here would serve, and its devices as the driver describes
    /// them (none where it does not answer): the one named, or for `auto` the first of
    /// [`BackendKind::ALL`] with a device (the host backend always has one).
    pub fn resolve(self, host_capacity: Bytes) -> (BackendKind, Vec<DeviceInfo>) {
        let found = |k| devices(k, host_capacity).unwrap_or_default();
        match self {
            BackendSelection::Only(kind) => (kind, found(kind)),
            BackendSelection::Auto => BackendKind::ALL
                .into_iter()
                .map(|k| (k, found(k)))
                .find(|(_, d)| !d.is_empty())
                .unwrap_or((BackendKind::Host, Vec::new())),
        }
    }
}

impl fmt::Display for BackendSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendSelection::Auto => f.pad("auto"),
            BackendSelection::Only(k) => k.fmt(f),
        }
    }
}

impl FromStr for BackendSelection {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        if s == "auto" {
            return Ok(BackendSelection::Auto);
        }
        s.parse()
            .map(BackendSelection::Only)
            .map_err(|e: UnknownBackend| UnknownBackend {
                known: format!("auto, {}", e.known),
                ..e
            })
    }
}

impl<'de> serde::Deserialize<'de> for BackendSelection {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// The devices of `kind` this machine has: the GPUs the driver lists on cuda (possibly none);
/// on host one memfd device of `host_capacity` with the default granularity.
pub fn devices(kind: BackendKind, host_capacity: Bytes) -> Result<Vec<DeviceInfo>> {
    match kind {
        BackendKind::Host => Ok(vec![host::describe(
            host_capacity,
            host::DEFAULT_GRANULARITY,
        )]),
        BackendKind::Cuda => cuda::probe(),
    }
}

/// Opens the device `info` describes, able to copy bytes ([`ByteAccess`]): what a tenant, a
/// replay or the daemon's shared-buffer checksums use. On cuda `info.uuid` names the GPU (the
/// rest is the driver's) and the device's primary context is retained; on host `info.capacity`
/// is what it may create (zero for a process that only imports) and `info.granularity` its unit.
pub fn open(info: &DeviceInfo) -> Result<Arc<dyn ByteAccess>> {
    Ok(match info.kind {
        BackendKind::Host => Arc::new(host::HostDevice::new(info.capacity, info.granularity)?),
        BackendKind::Cuda => Arc::new(cuda::CudaDevice::open(&info.uuid)?),
    })
}

/// Opens the device `info` describes for handles only (create, export, import, reserve, map):
/// the daemon's. On cuda no context is made, which saves its device memory; the device cannot
/// copy, which its type says. Otherwise as [`open`].
pub fn open_for_handles(info: &DeviceInfo) -> Result<Arc<dyn Device>> {
    Ok(match info.kind {
        BackendKind::Host => Arc::new(host::HostDevice::new(info.capacity, info.granularity)?),
        BackendKind::Cuda => Arc::new(cuda::CudaHandles::open(&info.uuid)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_through_its_name() {
        for kind in BackendKind::ALL {
            assert_eq!(kind.to_string().parse::<BackendKind>(), Ok(kind));
            assert_eq!(kind.to_string(), kind.name());
            let sel = BackendSelection::Only(kind);
            assert_eq!(sel.to_string().parse::<BackendSelection>(), Ok(sel));
        }
        assert_eq!("host".parse(), Ok(BackendKind::Host));
        assert_eq!("cuda".parse(), Ok(BackendKind::Cuda));
        assert_eq!("auto".parse(), Ok(BackendSelection::Auto));
        assert_eq!(BackendSelection::Auto.to_string(), "auto");
        assert_eq!(format!("[{:<6}]", BackendKind::Cuda), "[cuda  ]");
    }

    #[test]
    fn an_unknown_name_is_an_error_listing_the_known_ones() {
        let e = "rocm".parse::<BackendKind>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown device backend `rocm`; known: cuda, host"
        );
        // Names are exact: no case folding, no blanks.
        assert!("Host".parse::<BackendKind>().is_err());
        assert!(" host".parse::<BackendKind>().is_err());
        assert!("auto".parse::<BackendKind>().is_err());
        let e = "gpu".parse::<BackendSelection>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown device backend `gpu`; known: auto, cuda, host"
        );
    }

    #[test]
    fn the_host_backend_has_one_device_of_the_asked_capacity() {
        let infos = devices(BackendKind::Host, Bytes::gib(3)).unwrap();
        assert_eq!(infos.len(), 1);
        assert_eq!(infos[0].kind, BackendKind::Host);
        assert_eq!(infos[0].capacity, Bytes::gib(3));
        let dev = open(&infos[0]).unwrap();
        assert_eq!(dev.info().capacity, Bytes::gib(3));
        let handles = open_for_handles(&infos[0]).unwrap();
        assert_eq!(handles.info().granularity, host::DEFAULT_GRANULARITY);
    }
}
