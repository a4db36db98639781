//! NVML's `nvmlDeviceGetMemoryInfo` and `nvmlDeviceGetMemoryInfo_v2` for the tenant's GPU: the
//! same view as `cuMemGetInfo_v2` ([`super::info`]), total the tenant's limit, free what it could
//! still get, used the difference (and `reserved` zero in the `_v2` form), so that a framework
//! that reads both (vLLM) sees figures that agree. Other GPUs, and every error, are NVML's own.
//!
//! The device is recognised by the UUID NVML gives it (`nvmlDeviceGetUUID`), compared with the
//! one the daemon named at admission. NVML's functions are found through glibc's `dlsym` on the
//! NVML library the process loaded (`RTLD_NOLOAD`), else after libvram.so in the lookup order.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use super::stats::{self, Hook};
use super::{dlsym, same_uuid, tenant_for_query, tenant_view};
use crate::guarded;

/// `nvmlMemory_t`.
#[repr(C)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

type NvmlDevice = *mut c_void;
type GetMemoryInfo = unsafe extern "C" fn(NvmlDevice, *mut NvmlMemory) -> c_int;
type GetMemoryInfoV2 = unsafe extern "C" fn(NvmlDevice, *mut NvmlMemoryV2) -> c_int;
type GetUuid = unsafe extern "C" fn(NvmlDevice, *mut c_char, c_uint) -> c_int;

const NVML_SUCCESS: c_int = 0;
const NVML_ERROR_FUNCTION_NOT_FOUND: c_int = 13;
/// `NVML_DEVICE_UUID_V2_BUFFER_SIZE`.
const UUID_BUFFER: usize = 96;

struct Nvml {
    memory_info: Option<GetMemoryInfo>,
    memory_info_v2: Option<GetMemoryInfoV2>,
    uuid: Option<GetUuid>,
}

fn nvml() -> &'static Nvml {
    static NVML: OnceLock<Nvml> = OnceLock::new();
    NVML.get_or_init(|| {
        // SAFETY: dlopen with RTLD_NOLOAD only looks for a library the process already loaded.
        let lib = unsafe {
            libc::dlopen(
                c"libnvidia-ml.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_NOLOAD,
            )
        };
        let find = |name: &CStr| {
            let p = if lib.is_null() {
                std::ptr::null_mut()
            } else {
                dlsym::lookup(lib, name)
            };
            if p.is_null() {
                dlsym::lookup(libc::RTLD_NEXT, name)
            } else {
                p
            }
        };
        let (info, info_v2, uuid) = (
            find(c"nvmlDeviceGetMemoryInfo"),
            find(c"nvmlDeviceGetMemoryInfo_v2"),
            find(c"nvmlDeviceGetUUID"),
        );
        // SAFETY: each non-null pointer is NVML's function of that name, whose C signature is
        // the one transmuted to (nvml.h).
        unsafe {
            Nvml {
                memory_info: (!info.is_null())
                    .then(|| std::mem::transmute::<*mut c_void, GetMemoryInfo>(info)),
                memory_info_v2: (!info_v2.is_null())
                    .then(|| std::mem::transmute::<*mut c_void, GetMemoryInfoV2>(info_v2)),
                uuid: (!uuid.is_null()).then(|| std::mem::transmute::<*mut c_void, GetUuid>(uuid)),
            }
        }
    })
}

/// The tenant's (total, free) if `device` is its GPU.
fn view_for(device: NvmlDevice) -> Option<(u64, u64)> {
    let get_uuid = nvml().uuid?;
    let mut buf = [0 as c_char; UUID_BUFFER];
    let len = (UUID_BUFFER - 1) as c_uint;
    // SAFETY: NVML's own function with the caller's device and a buffer longer than `len`.
    if unsafe { get_uuid(device, buf.as_mut_ptr(), len) } != NVML_SUCCESS {
        return None;
    }
    // SAFETY: `buf` was zeroed and NVML wrote at most `len` bytes, so its last byte is a NUL.
    let uuid = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    guarded(None, || {
        let Some(t) = tenant_for_query() else {
            return Ok(None);
        };
        let t = t?;
        if !same_uuid(&uuid, &t.device.uuid) {
            return Ok(None);
        }
        tenant_view(t).map(Some)
    })
}

/// See the module documentation.
///
/// # Safety
/// As for NVML's `nvmlDeviceGetMemoryInfo`: `memory` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: NvmlDevice,
    memory: *mut NvmlMemory,
) -> c_int {
    let Some(real) = nvml().memory_info else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    // SAFETY: NVML's own function with the caller's arguments.
    let r = unsafe { real(device, memory) };
    if r != NVML_SUCCESS || memory.is_null() {
        return r;
    }
    match view_for(device) {
        Some((total, free)) => {
            // SAFETY: NVML just filled the caller's valid structure; its fields are overwritten.
            unsafe {
                (*memory).total = total;
                (*memory).free = free;
                (*memory).used = total - free;
            }
            stats::served(Hook::NvmlMemoryInfo);
        }
        None => stats::passed(Hook::NvmlMemoryInfo),
    }
    r
}

/// See the module documentation.
///
/// # Safety
/// As for NVML's `nvmlDeviceGetMemoryInfo_v2`: `memory` is valid for one write, its `version`
/// set by the caller.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: NvmlDevice,
    memory: *mut NvmlMemoryV2,
) -> c_int {
    let Some(real) = nvml().memory_info_v2 else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    // SAFETY: NVML's own function with the caller's arguments.
    let r = unsafe { real(device, memory) };
    if r != NVML_SUCCESS || memory.is_null() {
        return r;
    }
    match view_for(device) {
        Some((total, free)) => {
            // SAFETY: NVML just filled the caller's valid structure; its fields are overwritten.
            unsafe {
                (*memory).total = total;
                (*memory).reserved = 0;
                (*memory).free = free;
                (*memory).used = total - free;
            }
            stats::served(Hook::NvmlMemoryInfoV2);
        }
        None => stats::passed(Hook::NvmlMemoryInfoV2),
    }
    r
}
