//! An in-process daemon on the host backend, for tests and benches of the C ABI.
#![allow(dead_code)] // each test binary uses part of it

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vram_core::Bytes;
use vram_device::{Device, HostDevice};
use vramd::config::Config;
use vramd::own_daemon::OwnDaemon;

/// A daemon of the test's own (`vramd::own_daemon`, the one starter), in this process: serving
/// a host device of `capacity` on `socket`, with the default configuration.
pub struct Daemon {
    pub socket: PathBuf,
    _own: OwnDaemon,
}

impl Daemon {
    pub fn start(capacity: Bytes) -> Daemon {
        Self::start_in(tempfile::tempdir().unwrap(), capacity)
    }

    /// A daemon listening on `vramd.sock` inside `dir`.
    pub fn start_in(dir: tempfile::TempDir, capacity: Bytes) -> Daemon {
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new(capacity, Bytes::mib(2)).unwrap());
        let own = OwnDaemon::in_process(dir, vec![dev], &Config::default()).unwrap();
        Daemon {
            socket: own.socket().to_path_buf(),
            _own: own,
        }
    }

    /// Where [`Daemon::start_in`] listens.
    pub fn socket_in(dir: &Path) -> PathBuf {
        dir.join("vramd.sock")
    }
}

/// Reads a JSON string libvram returned (it must not be NULL) and frees it.
pub fn take_json(p: *mut std::ffi::c_char) -> serde_json::Value {
    assert!(!p.is_null(), "{:?}", vram::last_error());
    // SAFETY: `p` is a live string from libvram, read once and freed right after.
    let v =
        serde_json::from_str(&unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy()).unwrap();
    // SAFETY: returned by libvram and not freed before.
    unsafe { vram::vram_string_free(p) };
    v
}
