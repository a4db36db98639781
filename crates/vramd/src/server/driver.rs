//! Reads a GPU's memory from the driver, so the daemon can check its books against it
//! ([`vram_core::books::reconcile`]).
//!
//! [`NvmlProbe`] asks NVML (`libnvidia-ml`, loaded at run time: a machine without the library
//! builds and runs, and opening the probe there is an error value). [`ScriptedProbe`] returns
//! readings a test sets. Devices are named by UUID as the daemon names them
//! (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`); the `GPU-` prefix is optional and case does not
//! matter.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, Nvml};
use vram_core::books::{DriverReading, ProcessUse};
use vram_core::Bytes;

/// Why a device could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// NVML could not be loaded or initialised (no library, no driver, no permission).
    #[error("NVML is unavailable: {0}")]
    Unavailable(String),
    #[error("no GPU with UUID {uuid} (NVML lists {found:?})")]
    NoSuchDevice { uuid: String, found: Vec<String> },
    /// An NVML call failed.
    #[error("{call} failed for {uuid}: {reason}")]
    Call {
        call: &'static str,
        uuid: String,
        reason: String,
    },
    /// A scripted probe with no reading set for the device.
    #[error("no reading scripted for {uuid}")]
    NotScripted { uuid: String },
}

/// Reads a device's memory: its used total and what each process on it uses.
pub trait DriverProbe: Send + Sync {
    /// One reading of the device named `uuid`.
    fn read(&self, uuid: &str) -> Result<DriverReading, ProbeError>;

    /// The device's memory as tenants can have it: installed memory less what the driver sets
    /// aside for itself. `held` is memory known to be in use that no process is listed with:
    /// what tenants of a daemon before still hold (imported memory is attributed to no process).
    fn total_memory(&self, uuid: &str, held: Bytes) -> Result<Bytes, ProbeError> {
        let _ = held;
        let r = self.read(uuid)?;
        Ok(r.total.saturating_sub(r.reserved))
    }
}

/// The UUID's comparable form: trimmed, lower case, without the `GPU-` prefix.
pub fn normalise_uuid(uuid: &str) -> String {
    let lower = uuid.trim().to_ascii_lowercase();
    match lower.strip_prefix("gpu-") {
        Some(rest) => rest.to_owned(),
        None => lower,
    }
}

/// The driver's view through NVML. Calls made per reading: `nvmlDeviceGetMemoryInfo_v2`
/// (total, reserved, used; `used` excludes `reserved`), `nvmlDeviceGetComputeRunningProcesses_v3`
/// and `nvmlDeviceGetGraphicsRunningProcesses_v3` (merged by pid), then the memory info again. Devices are found by
/// enumerating (`nvmlDeviceGetCount_v2`, `nvmlDeviceGetHandleByIndex_v2`, `nvmlDeviceGetUUID`)
/// once per unknown UUID; the index found is kept.
///
/// The driver keeps a little memory of its own in use that no process accounts for, and it grows
/// as tenants create contexts and map memory (page tables). What is in use when
/// [`NvmlProbe::total_memory`] measures a device (before the daemon hands out anything) is that
/// device's overhead, and [`DRIVER_HEADROOM`] of the device's memory is room for its growth: both
/// are taken off the memory tenants can have, and each reading's `allowance` says so, so that
/// only what appears beyond them counts as outside use.
pub struct NvmlProbe {
    nvml: Nvml,
    /// Normalised UUID → NVML index.
    index: Mutex<HashMap<String, u32>>,
    /// Normalised UUID → the driver's allowance (overhead at start and headroom), set by
    /// `total_memory`.
    overhead: Mutex<HashMap<String, Bytes>>,
}

impl std::fmt::Debug for NvmlProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlProbe")
            .field("index", &*lock(&self.index))
            .finish_non_exhaustive()
    }
}

/// The share of a device's memory left for the driver's own growth (see [`NvmlProbe`]): 1/1024
/// (about 140 MB on an H200), room for the page tables and context state the driver adds as
/// tenants map memory.
pub const DRIVER_HEADROOM: u64 = 1024;

/// Memory in use at start that no process accounts for is logged as a warning beyond 1/32 of the
/// device: the driver's own is far less (12 MiB on an idle H200, docs/benchmarks.md), so more is
/// likely memory of tenants the daemon cannot know of (an earlier daemon's, its state file lost).
const UNLISTED_WARNING: u64 = 32;

/// Tries of a process list whose length changed between NVML's count and its fill.
const LIST_TRIES: usize = 3;

impl NvmlProbe {
    /// Loads and initialises NVML. A missing library or driver is [`ProbeError::Unavailable`].
    pub fn open() -> Result<NvmlProbe, ProbeError> {
        let nvml = Nvml::init().map_err(|e| ProbeError::Unavailable(e.to_string()))?;
        Ok(NvmlProbe {
            nvml,
            index: Mutex::new(HashMap::new()),
            overhead: Mutex::new(HashMap::new()),
        })
    }

    /// The UUIDs of every device NVML can open, as NVML prints them.
    pub fn uuids(&self) -> Result<Vec<String>, ProbeError> {
        Ok(self.enumerate()?.into_iter().map(|(u, _)| u).collect())
    }

    /// Every device NVML can open: its UUID as NVML prints it and its index. Devices that fail
    /// to open are left out.
    fn enumerate(&self) -> Result<Vec<(String, u32)>, ProbeError> {
        let count = self.nvml.device_count().map_err(|e| ProbeError::Call {
            call: "nvmlDeviceGetCount",
            uuid: String::new(),
            reason: e.to_string(),
        })?;
        Ok((0..count)
            .filter_map(|i| {
                let uuid = self.nvml.device_by_index(i).and_then(|d| d.uuid()).ok()?;
                Some((uuid, i))
            })
            .collect())
    }

    fn device(&self, uuid: &str) -> Result<Device<'_>, ProbeError> {
        let key = normalise_uuid(uuid);
        let known = lock(&self.index).get(&key).copied();
        let index = match known {
            Some(i) => i,
            None => {
                let all = self.enumerate()?;
                let mut index = lock(&self.index);
                for (u, i) in &all {
                    index.insert(normalise_uuid(u), *i);
                }
                match index.get(&key) {
                    Some(i) => *i,
                    None => {
                        return Err(ProbeError::NoSuchDevice {
                            uuid: uuid.to_owned(),
                            found: all.into_iter().map(|(u, _)| u).collect(),
                        })
                    }
                }
            }
        };
        self.nvml
            .device_by_index(index)
            .map_err(|e| call_error("nvmlDeviceGetHandleByIndex", uuid, e))
    }

    /// The device's memory as tenants can have it: `total − reserved` from
    /// `nvmlDeviceGetMemoryInfo_v2`, less the driver's overhead in use now that no process
    /// accounts for (recorded for later readings; see the type's documentation), `held` (what
    /// tenants of a daemon before still hold) not counted as overhead. Meant to be called before
    /// the daemon hands out memory on the device.
    pub fn total_memory(&self, uuid: &str, held: Bytes) -> Result<Bytes, ProbeError> {
        let r = self.read_raw(uuid)?;
        let listed = r
            .processes
            .iter()
            .filter_map(|p| p.used)
            .fold(Bytes::ZERO, Bytes::saturating_add);
        let headroom = Bytes(r.total.get() / DRIVER_HEADROOM);
        let allowance = r
            .used
            .saturating_sub(listed)
            .saturating_sub(held)
            .saturating_add(headroom);
        lock(&self.overhead).insert(normalise_uuid(uuid), allowance);
        let unlisted = r.used.saturating_sub(listed).saturating_sub(held);
        if unlisted > Bytes(r.total.get() / UNLISTED_WARNING) {
            tracing::warn!(
                uuid, used = %r.used, by_processes = %listed, held_by_tenants_before = %held,
                unlisted = %unlisted,
                "memory in use that no process accounts for is taken for the driver's own and \
                 not served; if tenants of an earlier daemon whose state file is gone still hold \
                 it, it stays unserved until the daemon restarts after they end"
            );
        }
        Ok(r.total.saturating_sub(r.reserved).saturating_sub(allowance))
    }

    fn read_raw(&self, uuid: &str) -> Result<DriverReading, ProbeError> {
        let device = self.device(uuid)?;
        let memory = device
            .memory_info()
            .map_err(|e| call_error("nvmlDeviceGetMemoryInfo_v2", uuid, e))?;
        let compute = Self::processes(uuid, "nvmlDeviceGetComputeRunningProcesses_v3", || {
            device.running_compute_processes()
        })?;
        // Data-centre GPUs may not support the graphics list: nothing listed, then.
        let graphics =
            Self::processes(
                uuid,
                "nvmlDeviceGetGraphicsRunningProcesses_v3",
                || match device.running_graphics_processes() {
                    Err(NvmlError::NotSupported) => Ok(Vec::new()),
                    other => other,
                },
            )?;
        // Used memory read again after the lists, the smaller taken: a process that ended in
        // between would otherwise be in `used` and in no list, outside use of nobody's for one
        // reading. (One that started in between shows as surplus, which is only logged.)
        let used_after = device
            .memory_info()
            .map_err(|e| call_error("nvmlDeviceGetMemoryInfo_v2", uuid, e))?
            .used;
        Ok(DriverReading {
            total: Bytes(memory.total),
            reserved: Bytes(memory.reserved),
            used: Bytes(memory.used.min(used_after)),
            allowance: Bytes::ZERO,
            processes: merge(compute.iter().chain(&graphics))
                .into_iter()
                .map(|(pid, used)| ProcessUse {
                    pid,
                    used,
                    name: comm(pid),
                })
                .collect(),
        })
    }

    /// One process list, tried again if it grew between NVML's count and its fill.
    fn processes(
        uuid: &str,
        call: &'static str,
        list: impl Fn() -> Result<Vec<ProcessInfo>, NvmlError>,
    ) -> Result<Vec<ProcessInfo>, ProbeError> {
        let mut last = None;
        for _ in 0..LIST_TRIES {
            match list() {
                Ok(v) => return Ok(v),
                Err(NvmlError::InsufficientSize(n)) => last = Some(NvmlError::InsufficientSize(n)),
                Err(e) => return Err(call_error(call, uuid, e)),
            }
        }
        Err(call_error(
            call,
            uuid,
            last.unwrap_or(NvmlError::InsufficientSize(None)),
        ))
    }
}

impl DriverProbe for NvmlProbe {
    fn read(&self, uuid: &str) -> Result<DriverReading, ProbeError> {
        let mut r = self.read_raw(uuid)?;
        r.allowance = lock(&self.overhead)
            .get(&normalise_uuid(uuid))
            .copied()
            .unwrap_or(Bytes::ZERO);
        Ok(r)
    }

    fn total_memory(&self, uuid: &str, held: Bytes) -> Result<Bytes, ProbeError> {
        NvmlProbe::total_memory(self, uuid, held)
    }
}

/// Processes by pid, in pid order; a pid in both lists keeps its larger figure (a known figure
/// over an unknown one).
fn merge<'a>(list: impl Iterator<Item = &'a ProcessInfo>) -> Vec<(u32, Option<Bytes>)> {
    let mut by_pid: std::collections::BTreeMap<u32, Option<Bytes>> = Default::default();
    for p in list {
        let used = match p.used_gpu_memory {
            UsedGpuMemory::Used(b) => Some(Bytes(b)),
            UsedGpuMemory::Unavailable => None,
        };
        let e = by_pid.entry(p.pid).or_insert(used);
        *e = (*e).max(used);
    }
    by_pid.into_iter().collect()
}

/// The process's command name from `/proc/PID/comm`; empty if it cannot be read (gone, or in
/// another pid namespace).
fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim_end_matches('\n').to_owned())
        .unwrap_or_default()
}

fn call_error(call: &'static str, uuid: &str, e: NvmlError) -> ProbeError {
    ProbeError::Call {
        call,
        uuid: uuid.to_owned(),
        reason: e.to_string(),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Readings set by a test. Clones share the readings, so a test keeps one and gives the daemon
/// another.
#[derive(Debug, Clone, Default)]
pub struct ScriptedProbe {
    readings: Arc<Mutex<HashMap<String, Result<DriverReading, ProbeError>>>>,
    reads: Arc<AtomicU64>,
}

impl ScriptedProbe {
    pub fn new() -> ScriptedProbe {
        ScriptedProbe::default()
    }

    /// What the next reads of `uuid` return, until set again.
    pub fn set(&self, uuid: &str, reading: DriverReading) {
        lock(&self.readings).insert(normalise_uuid(uuid), Ok(reading));
    }

    /// Makes the next reads of `uuid` fail with `error`, until set again.
    pub fn fail(&self, uuid: &str, error: ProbeError) {
        lock(&self.readings).insert(normalise_uuid(uuid), Err(error));
    }

    /// Forgets `uuid`: its reads fail with [`ProbeError::NotScripted`].
    pub fn clear(&self, uuid: &str) {
        lock(&self.readings).remove(&normalise_uuid(uuid));
    }

    /// Reads made so far, of any device, by this probe and its clones.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

impl DriverProbe for ScriptedProbe {
    fn read(&self, uuid: &str) -> Result<DriverReading, ProbeError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        lock(&self.readings)
            .get(&normalise_uuid(uuid))
            .cloned()
            .unwrap_or_else(|| {
                Err(ProbeError::NotScripted {
                    uuid: uuid.to_owned(),
                })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-5f0c1a2b-3c4d-5e6f-7081-92a3b4c5d6e7";

    fn reading(used: Bytes) -> DriverReading {
        DriverReading {
            total: Bytes::gib(141),
            reserved: Bytes::mib(512),
            used,
            allowance: Bytes::ZERO,
            processes: vec![ProcessUse {
                pid: 42,
                used: Some(Bytes::mib(600)),
                name: "python3".into(),
            }],
        }
    }

    #[test]
    fn uuids_compare_without_prefix_or_case() {
        assert_eq!(normalise_uuid(UUID), "5f0c1a2b-3c4d-5e6f-7081-92a3b4c5d6e7");
        assert_eq!(
            normalise_uuid(" gpu-5F0C1A2B-3c4d-5e6f-7081-92a3b4c5d6e7 "),
            normalise_uuid(UUID)
        );
        assert_eq!(
            normalise_uuid("5f0c1a2b-3c4d-5e6f-7081-92a3b4c5d6e7"),
            normalise_uuid(UUID)
        );
        assert_eq!(normalise_uuid("MIG-abc"), "mig-abc");
    }

    #[test]
    fn scripted_probe_returns_what_was_set_through_any_clone() {
        let probe = ScriptedProbe::new();
        let daemon_side: Arc<dyn DriverProbe> = Arc::new(probe.clone());
        assert_eq!(
            daemon_side.read(UUID),
            Err(ProbeError::NotScripted { uuid: UUID.into() })
        );
        probe.set(UUID, reading(Bytes::gib(7)));
        assert_eq!(
            daemon_side.read(&UUID.to_lowercase()),
            Ok(reading(Bytes::gib(7)))
        );
        assert_eq!(
            daemon_side.total_memory(UUID, Bytes::ZERO),
            Ok(Bytes::gib(141) - Bytes::mib(512))
        );
        probe.set(UUID, reading(Bytes::gib(8)));
        assert_eq!(daemon_side.read(UUID).map(|r| r.used), Ok(Bytes::gib(8)));
        let gone = ProbeError::Call {
            call: "nvmlDeviceGetMemoryInfo_v2",
            uuid: UUID.into(),
            reason: "GPU is lost".into(),
        };
        probe.fail(UUID, gone.clone());
        assert_eq!(daemon_side.read(UUID), Err(gone));
        probe.clear(UUID);
        assert!(matches!(
            daemon_side.read(UUID),
            Err(ProbeError::NotScripted { .. })
        ));
        assert_eq!(probe.reads(), 6);
    }

    #[test]
    fn merged_lists_keep_one_entry_per_pid() {
        let info = |pid, used| ProcessInfo {
            pid,
            used_gpu_memory: used,
            gpu_instance_id: None,
            compute_instance_id: None,
        };
        let compute = [
            info(7, UsedGpuMemory::Used(10)),
            info(3, UsedGpuMemory::Unavailable),
        ];
        let graphics = [
            info(3, UsedGpuMemory::Used(5)),
            info(7, UsedGpuMemory::Used(4)),
        ];
        assert_eq!(
            merge(compute.iter().chain(&graphics)),
            vec![(3, Some(Bytes(5))), (7, Some(Bytes(10)))]
        );
    }

    #[test]
    fn own_command_name_is_read_and_a_missing_pid_is_empty() {
        assert!(!comm(std::process::id()).is_empty());
        assert_eq!(comm(u32::MAX), "");
    }

    /// Without NVML (no GPU here) opening is an error value; with it, every device it lists can
    /// be read and its figures are consistent.
    #[test]
    fn nvml_opens_or_says_why() {
        let probe = match NvmlProbe::open() {
            Err(e) => {
                assert!(matches!(e, ProbeError::Unavailable(_)), "{e}");
                return;
            }
            Ok(p) => p,
        };
        let uuids = probe.uuids().expect("NVML lists its devices");
        for uuid in &uuids {
            let r = probe.read(uuid).expect("a listed device can be read");
            assert!(
                r.used.saturating_add(r.reserved) <= r.total,
                "{uuid}: {r:?}"
            );
            let total = probe
                .total_memory(&uuid.to_lowercase(), Bytes::ZERO)
                .expect("by lower-case UUID");
            // Less the driver's overhead now and its headroom, never more.
            let headroom = Bytes(r.total.get() / DRIVER_HEADROOM);
            assert!(total <= r.total - r.reserved - headroom, "{total} {r:?}");
            let allowance = probe.read(uuid).unwrap().allowance;
            assert_eq!(total, r.total - r.reserved - allowance);
            eprintln!("{uuid}: {r:?}");
        }
        assert!(matches!(
            probe.read("GPU-00000000-0000-0000-0000-000000000000"),
            Err(ProbeError::NoSuchDevice { .. })
        ));
    }

    /// With a GPU: the UUID the CUDA backend names a device by finds it in NVML, and a process
    /// with a CUDA context on it is listed with a figure.
    #[test]
    fn cuda_device_is_found_and_its_context_listed() {
        use vram_device::Device as _;
        let Ok(probe) = NvmlProbe::open() else {
            return;
        };
        let Ok(gpu) = vram_device::CudaDevice::open("0") else {
            return;
        };
        let uuid = gpu.info().uuid.clone();
        let r = probe
            .read(&uuid)
            .expect("the CUDA backend's UUID names an NVML device");
        let me = std::process::id();
        let mine = r.processes.iter().find(|p| p.pid == me);
        eprintln!("{uuid}: this process {mine:?}; reading {r:?}");
        let mine = mine.expect("a process with a CUDA context is listed");
        assert!(mine.used.is_some_and(|b| b > Bytes::ZERO), "{mine:?}");
        assert!(!mine.name.is_empty());
    }
}
