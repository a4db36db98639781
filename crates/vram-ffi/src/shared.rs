//! Shared buffers behind the C ABI (`vram_shared_*` in `include/vram.h`), on the process's tenant.
//! A `vram_shared_t` owns what the program took through it: the lease, the draft, the pins; all
//! go back when it is closed.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vram_client::{Acl, Client, Draft, Pinned, Principal, SharedBuffer, Version, WriterLease};
use vram_core::Bytes;

use crate::{guarded, tenant};

/// An open shared buffer and what this program holds of it.
pub struct VramShared {
    pins: Vec<Pinned<'static>>,
    draft: Option<Draft<'static>>,
    lease: Option<WriterLease<'static>>,
    buffer: SharedBuffer<'static>,
    /// The connection `buffer` (and everything taken through it) calls through: kept alive by
    /// this handle even if the process's tenant ends meanwhile, and dropped last (fields drop in
    /// the order they are declared).
    _client: Arc<Client>,
}

/// The tenant's connection, and a reference to it that lives as long as the handle made from it.
fn connection() -> Result<(Arc<Client>, &'static Client), String> {
    let client = tenant()?.client()?;
    // SAFETY: the reference points into the `Arc` returned with it, which `opened` stores in the
    // handle after every field that borrows through the reference, so it outlives them all.
    let borrowed: &'static Client = unsafe { &*Arc::as_ptr(&client) };
    Ok((client, borrowed))
}

/// # Safety
///
/// `s` is NULL or a NUL-terminated string alive for the call.
unsafe fn text(s: *const c_char, what: &str) -> Result<String, String> {
    if s.is_null() {
        return Err(format!("vramd: {what} is NULL"));
    }
    // SAFETY: not NULL, so NUL-terminated and alive for the call (this function's contract).
    let s = unsafe { CStr::from_ptr(s) };
    Ok(s.to_string_lossy().into_owned())
}

/// `"tenant:NAME,class:NAME,*"` into principals; NULL or empty is nobody.
///
/// # Safety
///
/// As [`text`].
unsafe fn principals(list: *const c_char) -> Result<Vec<Principal>, String> {
    if list.is_null() {
        return Ok(Vec::new());
    }
    // SAFETY: this function's contract is `text`'s.
    unsafe { text(list, "access list") }?
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once(':') {
            _ if p == "*" => Ok(Principal::Anyone),
            Some(("tenant", n)) => Ok(Principal::Tenant(n.to_string())),
            Some(("class", c)) => Ok(Principal::Class(c.to_string())),
            _ => Err(format!(
                "vramd: `{p}` in an access list is not `tenant:NAME`, `class:NAME` or `*`"
            )),
        })
        .collect()
}

/// The handle behind `h`, for the length of one C call.
///
/// # Safety
///
/// `h` is NULL or a handle from `vram_shared_create`/`vram_shared_open` not yet closed, and no
/// other thread uses it while the returned reference lives (the caller's C call).
unsafe fn handle<'a>(h: *mut VramShared) -> Result<&'a mut VramShared, String> {
    if h.is_null() {
        return Err("vramd: NULL vram_shared_t".into());
    }
    // A forked child's copy of a handle speaks on its parent's connection: never used.
    if crate::FORKED.load(Ordering::Relaxed) {
        return Err(crate::forked_error());
    }
    // SAFETY: not NULL, so a live handle used by this thread alone (this function's contract).
    Ok(unsafe { &mut *h })
}

/// # Safety
///
/// `out` is NULL or points to a writable `uint64_t`.
unsafe fn put(out: *mut u64, value: u64) {
    if !out.is_null() {
        // SAFETY: not NULL, so writable (this function's contract).
        unsafe { out.write(value) };
    }
}

/// Handles open now: a tenant ends only with none (its pins and drafts are mapped here).
pub(crate) static OPEN: AtomicUsize = AtomicUsize::new(0);

fn opened(buffer: SharedBuffer<'static>, client: Arc<Client>) -> *mut VramShared {
    OPEN.fetch_add(1, Ordering::Relaxed);
    Box::into_raw(Box::new(VramShared {
        pins: Vec::new(),
        draft: None,
        lease: None,
        buffer,
        _client: client,
    }))
}

fn err(e: impl std::fmt::Display) -> String {
    format!("vramd: {e}")
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_create(
    name: *const c_char,
    size: u64,
    readers: *const c_char,
    writers: *const c_char,
) -> *mut VramShared {
    guarded(std::ptr::null_mut(), || {
        let (owned, client) = connection()?;
        // SAFETY: the access lists and the name are NULL or NUL-terminated strings alive for
        // the call (this function's contract).
        let (readers, writers) = unsafe { (principals(readers)?, principals(writers)?) };
        let acl = Acl { readers, writers };
        // SAFETY: as above.
        let name = unsafe { text(name, "name") }?;
        let buffer = client.create_shared(&name, Bytes(size), acl).map_err(err)?;
        Ok(opened(buffer, owned))
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_open(name: *const c_char) -> *mut VramShared {
    guarded(std::ptr::null_mut(), || {
        let (owned, client) = connection()?;
        // SAFETY: `name` is NULL or a NUL-terminated string alive for the call (this function's
        // contract).
        let name = unsafe { text(name, "name") }?;
        let buffer = client.open_shared(&name).map_err(err)?;
        Ok(opened(buffer, owned))
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_close(h: *mut VramShared) {
    guarded((), || {
        if h.is_null() {
            return Ok(());
        }
        // SAFETY: `h` came from Box::into_raw in `opened` and is closed once (vram.h).
        let handle = unsafe { Box::from_raw(h) };
        if crate::FORKED.load(Ordering::Relaxed) {
            // A forked child's copy: dropping it would unpin, unmap and give back the lease of
            // its parent, on its parent's connection. Its memory goes with the child.
            std::mem::forget(handle);
            return Ok(());
        }
        drop(handle);
        OPEN.fetch_sub(1, Ordering::Relaxed);
        Ok(())
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_lease(h: *mut VramShared, ttl_ms: u32) -> c_int {
    guarded(-1, || {
        // SAFETY: `h` is NULL or a live handle of this thread (this function\'s contract).
        let s = unsafe { handle(h) }?;
        if s.lease.is_none() {
            let ttl = Duration::from_millis(u64::from(ttl_ms));
            s.lease = Some(s.buffer.lease(ttl).map_err(err)?);
        }
        Ok(0)
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_release_lease(h: *mut VramShared) -> c_int {
    guarded(-1, || {
        // SAFETY: `h` is NULL or a live handle of this thread (this function\'s contract).
        let s = unsafe { handle(h) }?;
        s.draft = None;
        match s.lease.take() {
            Some(l) => l.release().map_err(err).map(|()| 0),
            None => Ok(0),
        }
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_begin_write(
    h: *mut VramShared,
    base: u64,
    version: *mut u64,
) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        // SAFETY: `h` is NULL or a live handle of this thread (this function\'s contract).
        let s = unsafe { handle(h) }?;
        let lease = s
            .lease
            .as_ref()
            .ok_or("vramd: begin_write without the lease (call vram_shared_lease first)")?;
        let base = (base != 0).then_some(Version(base));
        let draft = lease.begin_write(base).map_err(err)?;
        // SAFETY: `version` is NULL or writable (this function\'s contract).
        unsafe { put(version, draft.version().0) };
        let ptr = draft.ptr() as *mut c_void;
        s.draft = Some(draft);
        Ok(ptr)
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_publish(h: *mut VramShared, checksum: *mut u64) -> c_int {
    guarded(-1, || {
        // SAFETY: `h` is NULL or a live handle of this thread (this function\'s contract).
        let s = unsafe { handle(h) }?;
        let draft = s
            .draft
            .take()
            .ok_or("vramd: nothing to publish (call vram_shared_begin_write first)")?;
        // SAFETY: `checksum` is NULL or writable (this function\'s contract).
        unsafe { put(checksum, draft.publish().map_err(err)?) };
        Ok(0)
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_pin(
    h: *mut VramShared,
    version: *mut u64,
    checksum: *mut u64,
    size: *mut u64,
) -> *const c_void {
    guarded(std::ptr::null(), || {
        // SAFETY: `h` is NULL or a live handle of this thread (this function\'s contract).
        let s = unsafe { handle(h) }?;
        let pinned = s.buffer.pin().map_err(err)?;
        // SAFETY: `version` is NULL or writable (this function\'s contract).
        unsafe { put(version, pinned.version().0) };
        // SAFETY: `checksum` is NULL or writable (this function\'s contract).
        unsafe { put(checksum, pinned.checksum()) };
        // SAFETY: `size` is NULL or writable (this function\'s contract).
        unsafe { put(size, pinned.size().get()) };
        let ptr = pinned.ptr() as *const c_void;
        s.pins.push(pinned);
        Ok(ptr)
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_release(h: *mut VramShared, ptr: *const c_void) -> c_int {
    guarded(-1, || {
        // SAFETY: `h` is NULL or a live handle of this thread (this function\'s contract).
        let s = unsafe { handle(h) }?;
        let at = s
            .pins
            .iter()
            .position(|p| p.ptr() == ptr as usize)
            .ok_or_else(|| format!("vramd: {ptr:?} is not a pinned version of this buffer"))?;
        drop(s.pins.swap_remove(at));
        Ok(0)
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_verify(h: *mut VramShared, version: u64) -> c_int {
    guarded(-1, || {
        // SAFETY: `h` is NULL or a live handle of this thread (this function\'s contract).
        let s = unsafe { handle(h) }?;
        let ok = s.buffer.verify(Version(version)).map_err(err)?;
        Ok(c_int::from(ok))
    })
}

/// See `include/vram.h`.
///
/// # Safety
///
/// The pointers are NULL or as `include/vram.h` says: strings NUL-terminated and alive for the
/// call, a handle from `vram_shared_create`/`vram_shared_open` not yet closed and used by one
/// thread at a time, out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn vram_shared_wait(
    h: *mut VramShared,
    than: u64,
    timeout_ms: u32,
    version: *mut u64,
) -> c_int {
    guarded(-1, || {
        // SAFETY: `h` is NULL or a live handle of this thread (this function\'s contract).
        let s = unsafe { handle(h) }?;
        let than = (than != 0).then_some(Version(than));
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        match s.buffer.wait_newer(than, timeout).map_err(err)? {
            Some(v) => {
                // SAFETY: `version` is NULL or writable (this function\'s contract).
                unsafe { put(version, v.0) };
                Ok(1)
            }
            None => Ok(0),
        }
    })
}
