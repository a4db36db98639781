//! `vram_init`: the process's tenant set up now, from options a program passes in a struct
//! (`vram_options_t` in vram.h), the environment taking the place of every option left unset.
//!
//! The struct is extensible the way Linux's `openat2` and `clone3` take theirs: the caller says
//! how many bytes it passes (`size`, its `sizeof`). Fields added later go at the end, and a zero
//! in them means "unset", so a program built against an older vram.h (a smaller `size`) reads as
//! if it had left them zero. A program built against a newer one may pass more bytes than this
//! library knows: allowed only where those bytes are all zero, since an option the library cannot
//! see would otherwise be dropped silently; likewise an unknown bit in `flags`.

use std::ffi::{c_char, c_int};
use std::path::PathBuf;

use vram_client::TenantOptions;
use vram_core::Bytes;

use crate::{connect_now, guarded, optional_text, options_from_env, set_error, Connected};

/// `flags`: `gpu` is set; otherwise `VRAMD_GPU`, else device 0.
pub const VRAM_OPTION_GPU: u32 = 1;
const KNOWN_FLAGS: u32 = VRAM_OPTION_GPU;

/// `vram_init`'s answer when the process is a tenant already.
pub const VRAM_ERR_CONNECTED: c_int = -2;

/// `vram_options_t` (see `include/vram.h`). Every field zero or NULL is unset.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct VramOptions {
    /// The bytes the caller passes: `sizeof(vram_options_t)` of its vram.h.
    pub size: u32,
    /// `VRAM_OPTION_*` bits.
    pub flags: u32,
    /// The daemon's socket; NULL: `VRAMD_SOCKET`, else the default.
    pub socket: *const c_char,
    /// The tenant's name; NULL: `VRAMD_TENANT`, else `pid-<pid>`.
    pub tenant: *const c_char,
    /// The tenant's class; NULL: `VRAMD_CLASS`, else the daemon's default class.
    pub tenant_class: *const c_char,
    /// Bytes; 0: `VRAMD_GUARANTEE`, else none.
    pub guarantee: u64,
    /// Bytes; 0: `VRAMD_LIMIT`, else the class's.
    pub limit: u64,
    /// The daemon's device by index, read with `VRAM_OPTION_GPU`.
    pub gpu: u32,
    /// Must be 0.
    pub reserved: u32,
}

impl Default for VramOptions {
    /// Every option unset (the environment's), `size` this struct's.
    fn default() -> VramOptions {
        VramOptions {
            size: std::mem::size_of::<VramOptions>() as u32,
            ..VramOptions::UNSET
        }
    }
}

/// The struct's size in its first version: the least `size` a caller may pass.
const FIRST_SIZE: usize = 56;
const _: () = assert!(std::mem::size_of::<VramOptions>() == FIRST_SIZE);

impl VramOptions {
    const UNSET: VramOptions = VramOptions {
        size: 0,
        flags: 0,
        socket: std::ptr::null(),
        tenant: std::ptr::null(),
        tenant_class: std::ptr::null(),
        guarantee: 0,
        limit: 0,
        gpu: 0,
        reserved: 0,
    };

    /// The caller's options as this library knows them: the fields beyond what the caller
    /// passed unset.
    ///
    /// # Safety
    ///
    /// `p` is NULL or points to a `vram_options_t` whose first field, `size`, says how many
    /// bytes are readable there.
    unsafe fn read(p: *const VramOptions) -> Result<VramOptions, String> {
        if p.is_null() {
            return Ok(Self::UNSET);
        }
        // SAFETY: `p` points to a struct that begins with its `size` (this function's contract);
        // the struct's alignment is that of a pointer, so the first `u32` is aligned.
        let size = unsafe { p.cast::<u32>().read() } as usize;
        if size < FIRST_SIZE {
            return Err(format!(
                "vramd: vram_init: options of {size} bytes; vram_options_t has at least \
                 {FIRST_SIZE} (set its size to sizeof(vram_options_t))"
            ));
        }
        // SAFETY: `size` bytes are readable at `p` (this function's contract).
        let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), size) };
        let known = std::mem::size_of::<VramOptions>();
        if bytes[known.min(size)..].iter().any(|&b| b != 0) {
            return Err(format!(
                "vramd: vram_init: options of {size} bytes set fields beyond the {known} this \
                 libvram.so knows (it is older than the vram.h the program was built with)"
            ));
        }
        let mut o = Self::UNSET;
        // SAFETY: the first `min(size, known)` bytes of `p` are readable (above) and do not
        // overlap the local `o`; `VramOptions` is `repr(C)` of integers and raw pointers, for
        // which the caller's bytes are valid values (the caller wrote them as these fields).
        unsafe {
            std::ptr::copy_nonoverlapping(
                p.cast::<u8>(),
                (&raw mut o).cast::<u8>(),
                known.min(size),
            );
        }
        if o.flags & !KNOWN_FLAGS != 0 {
            return Err(format!(
                "vramd: vram_init: unknown flags {:#x}",
                o.flags & !KNOWN_FLAGS
            ));
        }
        if o.reserved != 0 {
            return Err("vramd: vram_init: `reserved` must be 0".into());
        }
        Ok(o)
    }

    /// `base` (the environment's options) with the fields set here in their place; the socket
    /// asked for, if any.
    ///
    /// # Safety
    ///
    /// Each string field is NULL or a NUL-terminated string alive for the call.
    unsafe fn over(
        &self,
        mut base: TenantOptions,
    ) -> Result<(Option<PathBuf>, TenantOptions), String> {
        // SAFETY: NULL or NUL-terminated and alive (this function's contract); as below.
        let socket = unsafe { optional_text(self.socket, "socket") }?.map(PathBuf::from);
        // SAFETY: as above.
        let tenant = unsafe { optional_text(self.tenant, "tenant") }?;
        // SAFETY: as above.
        let class = unsafe { optional_text(self.tenant_class, "class") }?;
        let guarantee = Some(Bytes(self.guarantee)).filter(|b| b.get() > 0);
        let limit = Some(Bytes(self.limit)).filter(|b| b.get() > 0);
        if base.join.is_some()
            && (tenant.is_some() || class.is_some() || guarantee.is_some() || limit.is_some())
        {
            return Err(format!(
                "vramd: vram_init: this process joins the tenant `vramd run` registered for it \
                 ({}), whose name, class, guarantee and limit are `vramd run`'s flags: leave them \
                 unset in vram_options_t",
                vram_proto::env::JOIN
            ));
        }
        base.name = tenant.unwrap_or(base.name);
        base.class = class.or(base.class);
        base.guarantee = guarantee.or(base.guarantee);
        base.limit = limit.or(base.limit);
        if self.flags & VRAM_OPTION_GPU != 0 {
            base.gpu = Some(self.gpu);
        }
        Ok((socket, base))
    }
}

/// See `include/vram.h`.
///
/// # Safety
///
/// `opts` is NULL or points to a `vram_options_t` whose `size` bytes are readable, and whose
/// string fields are each NULL or a NUL-terminated string alive for the call.
#[no_mangle]
pub unsafe extern "C" fn vram_init(opts: *const VramOptions) -> c_int {
    guarded(-1, || {
        // SAFETY: this function's contract is `read`'s.
        let o = unsafe { VramOptions::read(opts) }?;
        // SAFETY: the string fields are NULL or NUL-terminated and alive (this function's
        // contract).
        let (socket, tenant) = unsafe { o.over(options_from_env()?) }?;
        match connect_now(socket.as_deref(), &tenant)? {
            Connected::Now => Ok(0),
            Connected::Already(name) => {
                set_error(format!(
                    "vramd: vram_init: this process is tenant `{name}` already (set up by its \
                     first allocation, vram_connect or an earlier vram_init); call vram_init \
                     before anything that needs a tenant"
                ));
                Ok(VRAM_ERR_CONNECTED)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    fn sized() -> VramOptions {
        VramOptions::default()
    }

    fn base() -> TenantOptions {
        TenantOptions {
            name: "from-env".into(),
            class: Some("low".into()),
            guarantee: Some(Bytes::mib(1)),
            limit: Some(Bytes::mib(2)),
            gpu: Some(3),
            join: None,
        }
    }

    /// Name, class, guarantee and limit (in MiB) and GPU of `t`.
    fn fields(t: &TenantOptions) -> (&str, Option<&str>, u64, u64, Option<u32>) {
        let mib = |b: Option<Bytes>| b.map_or(0, |b| b.get() >> 20);
        (
            t.name.as_str(),
            t.class.as_deref(),
            mib(t.guarantee),
            mib(t.limit),
            t.gpu,
        )
    }

    #[test]
    fn fields_left_unset_take_the_environments_and_set_ones_replace_them() {
        let o = sized();
        // SAFETY: `o` is a whole struct of its own size.
        let read = unsafe { VramOptions::read(&o) }.unwrap();
        // SAFETY: no string fields.
        let (socket, t) = unsafe { read.over(base()) }.unwrap();
        assert_eq!(socket, None);
        assert_eq!(fields(&t), ("from-env", Some("low"), 1, 2, Some(3)));

        let (name, class, path) = (
            CString::new("asked").unwrap(),
            CString::new("high").unwrap(),
            CString::new("/tmp/x.sock").unwrap(),
        );
        let o = VramOptions {
            flags: VRAM_OPTION_GPU,
            socket: path.as_ptr(),
            tenant: name.as_ptr(),
            tenant_class: class.as_ptr(),
            guarantee: 5 << 20,
            limit: 6 << 20,
            gpu: 0,
            ..sized()
        };
        // SAFETY: as above; the strings live to the end of the test.
        let (socket, t) = unsafe { VramOptions::read(&o).unwrap().over(base()) }.unwrap();
        assert_eq!(socket, Some(PathBuf::from("/tmp/x.sock")));
        assert_eq!(fields(&t), ("asked", Some("high"), 5, 6, Some(0)));
    }

    #[test]
    fn sizes_flags_and_joined_tenants_are_checked() {
        let small = VramOptions {
            size: 8,
            ..VramOptions::UNSET
        };
        // SAFETY: `small` is a whole struct, more than its `size` says.
        let e = unsafe { VramOptions::read(&small) }.unwrap_err();
        assert!(e.contains("options of 8 bytes"), "{e}");

        // A newer vram.h's struct: this one followed by one more field.
        #[repr(C)]
        struct Newer {
            known: VramOptions,
            more: u64,
        }
        let mut newer = Newer {
            known: VramOptions {
                size: std::mem::size_of::<Newer>() as u32,
                ..VramOptions::UNSET
            },
            more: 0,
        };
        // SAFETY: `newer` is `size` bytes, beginning with the options.
        assert!(unsafe { VramOptions::read((&raw const newer).cast()) }.is_ok());
        newer.more = 1;
        // SAFETY: as above.
        let e = unsafe { VramOptions::read((&raw const newer).cast()) }.unwrap_err();
        assert!(e.contains("beyond the 56 this libvram.so knows"), "{e}");

        let flagged = VramOptions {
            flags: 0x10,
            ..sized()
        };
        // SAFETY: a whole struct.
        let e = unsafe { VramOptions::read(&flagged) }.unwrap_err();
        assert!(e.contains("unknown flags 0x10"), "{e}");

        let joined = TenantOptions {
            join: Some("token".into()),
            ..base()
        };
        let asks = VramOptions {
            limit: 1 << 30,
            ..sized()
        };
        // SAFETY: no string fields.
        let e = unsafe { asks.over(joined.clone()) }.unwrap_err();
        assert!(e.contains("joins the tenant `vramd run` registered"), "{e}");
        // SAFETY: as above.
        assert!(unsafe { sized().over(joined) }.is_ok());
    }
}
