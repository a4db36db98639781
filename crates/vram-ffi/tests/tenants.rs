//! One process, tenants one after another (`vram_connect`, `vram_disconnect`): what a Ray worker
//! running one task after another does. Nothing of one tenant (name, limit, memory) reaches the
//! next, and the daemon holds nothing between them.

use std::ffi::CString;

use vram_client::Observer;
use vram_core::Bytes;

mod common;

fn text(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn stats() -> serde_json::Value {
    common::take_json(vram::vram_stats_json())
}

#[test]
fn a_process_ends_one_tenant_and_becomes_another() {
    let daemon = common::Daemon::start(Bytes::gib(4));
    let socket = text(daemon.socket.to_str().unwrap());
    let tenants = || {
        Observer::connect(Some(&daemon.socket))
            .unwrap()
            .status()
            .unwrap()
            .tenants
    };
    // The daemon learns of the close when it reads it: within a second.
    let gone = || {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while !tenants().is_empty() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        tenants().is_empty()
    };
    let connect = |name: &str, limit: &str| {
        let (name, limit) = (text(name), text(limit));
        // SAFETY: NUL-terminated strings alive for the call, or NULL.
        unsafe {
            vram::vram_connect(
                socket.as_ptr(),
                name.as_ptr(),
                std::ptr::null(),
                std::ptr::null(),
                limit.as_ptr(),
                -1,
            )
        }
    };
    let stream = std::ptr::null_mut();

    assert_eq!(vram::vram_disconnect(), 0, "ending no tenant is no error");
    assert_eq!(connect("first", "64MiB"), 0, "{:?}", vram::last_error());
    assert_eq!(connect("again", "64MiB"), -1);
    let e = vram::last_error().unwrap();
    assert!(e.contains("tenant `first` already"), "{e}");

    let p = vram::vram_alloc(8 << 20, 0, stream);
    assert!(!p.is_null(), "{:?}", vram::last_error());
    assert_eq!(vram::vram_disconnect(), -1, "memory in use");
    let e = vram::last_error().unwrap();
    assert!(
        e.contains(
            "tenant `first` cannot end while its memory is in use: 8 MiB allocated and not freed"
        ),
        "{e}"
    );
    vram::vram_free(p, 0, 0, stream);
    assert_eq!(vram::vram_disconnect(), 0, "{:?}", vram::last_error());
    assert!(
        gone(),
        "the daemon holds nothing between tenants: {:?}",
        tenants()
    );

    // The next tenant has its own name and limit, and starts with nothing.
    assert_eq!(vram::vram_disconnect(), 0);
    assert_eq!(connect("second", "16MiB"), 0, "{:?}", vram::last_error());
    let s = stats();
    assert_eq!(s["tenant"], "second");
    assert_eq!(s["limit"], 16 << 20);
    assert_eq!(s["stats"]["in_use"], 0);
    let t = tenants();
    assert_eq!(t.len(), 1);
    assert_eq!((t[0].name.as_str(), t[0].held), ("second", Bytes::ZERO));
    assert!(vram::vram_alloc(32 << 20, 0, stream).is_null());
    let e = vram::last_error().unwrap();
    assert!(
        e.contains("tenant `second` could not allocate 32 MiB"),
        "{e}"
    );
    let p = vram::vram_alloc(8 << 20, 0, stream);
    assert!(!p.is_null(), "{:?}", vram::last_error());
    vram::vram_free(p, 0, 0, stream);
    // VRAM_TENANT_DEVICE (-1) is the tenant's GPU whatever its number; another is refused.
    let p = vram::vram_alloc(8 << 20, -1, stream);
    assert!(!p.is_null(), "{:?}", vram::last_error());
    vram::vram_free(p, 0, -1, stream);
    assert!(vram::vram_alloc(8 << 20, 5, stream).is_null());
    let e = vram::last_error().unwrap();
    assert!(e.contains("device 5 asked for"), "{e}");
    assert_eq!(vram::vram_disconnect(), 0, "{:?}", vram::last_error());
    assert!(gone(), "{:?}", tenants());
}
