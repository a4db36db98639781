//! An in-process daemon on the host backend, for tests and benches of the C ABI.
#![allow(dead_code)] // each test binary uses part of it

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use vram_core::Bytes;
use vram_device::{Device, HostDevice};
use vramd::config::{Config, PoolConfig};
use vramd::server::{ServeOptions, Server, Shutdown};

pub struct Daemon {
    pub socket: PathBuf,
    pub shutdown: Shutdown,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Daemon {
    pub fn start(capacity: Bytes) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vramd.sock");
        Self::start_in(dir, socket, capacity)
    }

    /// A daemon listening on `socket`, inside `dir` (kept while the daemon runs).
    pub fn start_in(dir: tempfile::TempDir, socket: PathBuf, capacity: Bytes) -> Daemon {
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new(capacity, Bytes::mib(2)).unwrap());
        let config = Config::default();
        let opts = ServeOptions {
            socket: socket.clone(),
            socket_mode: 0o600,
            allowed_uids: None,
            devices: vec![dev],
            policy: Box::new(move |d: &dyn Device| config.policy(d.info().capacity)),
            pool: PoolConfig::default(),
            reclaim_timeout: Duration::from_millis(250),
            probe: None,
            probe_period: Duration::from_secs(1),
        };
        let server = Server::bind(opts).unwrap();
        let shutdown = server.shutdown_handle();
        let thread = std::thread::spawn(move || server.run().unwrap());
        Daemon {
            socket,
            shutdown,
            thread: Some(thread),
            _dir: dir,
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.shutdown.trigger();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
