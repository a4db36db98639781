"""vramd from Python: this process as a tenant of its node's daemon, the daemon's status, and
shared buffers, over libvram.so (ctypes; no build step, no PyTorch needed).

    import vramd
    with vramd.connect(name="trainer", guarantee="4GiB", limit="8GiB") as t:
        p = t.alloc(64 << 20)        # device memory (host memory on the host backend)
        ...
        t.free(p)
    vramd.status()["tenants"]        # what `vramd status --json` shows

A process is one tenant at a time; `Tenant.close` (or leaving the `with` block) ends it and gives
everything back, and the process may then connect as another. PyTorch: `vramd_torch.install()`
(see that package). Ray: `vramd.ray`. Sizes are bytes (int) or strings such as "20GiB"
(`parse_size`).
"""

import ctypes
import re
import threading
import time
import weakref

from . import _lib
from ._lib import load

__all__ = [
    "VramdError",
    "Tenant",
    "SharedBuffer",
    "connect",
    "current",
    "load",
    "parse_size",
    "status",
]


class VramdError(RuntimeError):
    """A call libvram.so refused, with its reason (tenant, limit, what it holds...)."""


_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def parse_size(v):
    """Bytes from an int or a string such as "20GiB", "512MiB", "1.5GiB", "4GB" (the forms the
    daemon's flags and configuration take)."""
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 0:
            raise ValueError(f"vramd: a size cannot be negative ({v})")
        return _fits(v, v)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(v))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"vramd: `{v}` is not a size (such as 20GiB, 512MiB or a number of bytes)")
    num, mult = m.group(1), _UNITS[m.group(2).lower()]
    if num.isdigit():
        return _fits(int(num) * mult, v)
    try:
        return _fits(round(float(num) * mult), v)
    except (ValueError, OverflowError):
        raise ValueError(f"vramd: `{v}` is not a size") from None


# The largest size the C ABI takes (ssize_t): a larger one would wrap around in ctypes.
_MAX_SIZE = (1 << 63) - 1


def _fits(n, asked):
    if n > _MAX_SIZE:
        raise ValueError(f"vramd: {asked} is more bytes than any device has")
    return n


def _millis(what, ms):
    """`ms` as the C ABI's uint32 milliseconds: a negative or too long a time would wrap."""
    ms = int(ms)
    if not 0 <= ms <= 0xFFFF_FFFF:
        raise ValueError(f"vramd: {what} of {ms} ms is not between 0 and {0xFFFF_FFFF} ms")
    return ms


def _size_arg(v):
    return None if v is None else str(parse_size(v)).encode()


def status(socket=None, lib=None):
    """The daemon's status as `vramd status --json` prints it (devices, tenants, shared buffers),
    asked as a tool asks: this process does not become a tenant."""
    l = load(lib)
    return _lib.take_json(l.vram_status_json(_lib.text(socket)), "status")


class _Closes:
    """`with X(...) as x:` closes x at the end of the block."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# Counts the tenants this process ended or replaced through this package: a `Tenant` object
# speaks for the process's tenant only while the count is the one it was made under.
_ended_tenants = 0


def _tenant_ends():
    global _ended_tenants
    _ended_tenants += 1


class Tenant(_Closes):
    """This process as a tenant. Made by `connect` (or `current`); one per process at a time:
    every object made for a tenant is closed with it."""

    # vram_alloc's device for the tenant's own GPU, whatever its CUDA ordinal in this process
    # (`stats()["gpu"]` is the daemon's number for it, which CUDA_VISIBLE_DEVICES may change).
    _DEVICE = -1

    def __init__(self):
        self._ended = False
        self._of = _ended_tenants
        # Connects now, as first use would, so that a refusal is this call's error.
        self.stats()

    @property
    def _closed(self):
        return self._ended or self._of != _ended_tenants

    def _live(self):
        # After close (this object's, or another's for the same tenant), libvram.so's first use
        # would make a new tenant of this process, one no `close` of this object would end.
        if self._closed:
            raise VramdError("vramd: this tenant was closed; vramd.connect() makes a new one")

    def stats(self):
        """{"tenant", "gpu", "limit", "guarantee", "stats": {...}}: the allocator's figures."""
        self._live()
        return _lib.take_json(_lib.lib().vram_stats_json(), "vram_stats_json")

    # The tenant's name, limit and guarantee (bytes) and daemon device, as its welcome said.
    name = property(lambda self: self.stats()["tenant"])
    limit = property(lambda self: self.stats()["limit"])
    guarantee = property(lambda self: self.stats()["guarantee"])
    gpu = property(lambda self: self.stats()["gpu"])

    def alloc(self, size, stream=None):
        """The address of a block of at least `size` bytes on the tenant's device; VramdError
        (tenant, limit, what it holds) when refused."""
        self._live()
        p = _lib.lib().vram_alloc(parse_size(size), self._DEVICE, stream)
        _lib.check(p, "vram_alloc")
        return p

    def free(self, ptr, stream=None):
        """Frees a block from `alloc` (a pointer it never gave is logged by libvram, not fatal)."""
        self._live()
        _lib.lib().vram_free(ptr, 0, self._DEVICE, stream)

    def mem_get_info(self):
        """(free, total) as this tenant sees it: total is its limit, free what it may still take."""
        self._live()
        free, total = ctypes.c_uint64(), ctypes.c_uint64()
        _lib.check(
            _lib.lib().vram_mem_get_info(ctypes.byref(free), ctypes.byref(total)) == 0,
            "vram_mem_get_info",
        )
        return free.value, total.value

    def trim(self):
        """Gives every idle byte back to the daemon now; returns the bytes. Memory freed on a
        stream whose queued work the GPU has not finished goes back once it is done: the call
        waits for that work, at most 500 ms a stream."""
        self._live()
        n = _lib.lib().vram_trim()
        _lib.check(n >= 0, "vram_trim")
        return n

    def close(self):
        """Ends the tenant: everything goes back to the daemon. Refused (VramdError) while memory
        is still allocated or a shared buffer is open, naming what is left."""
        if self._closed:
            return
        _lib.check(_lib.lib().vram_disconnect() == 0, "vram_disconnect")
        self._ended = True
        _tenant_ends()

    def __repr__(self):
        if self._closed:
            return "<vramd.Tenant (ended)>"
        s = self.stats()
        return f"<vramd.Tenant {s['tenant']!r} gpu {s['gpu']} limit {s['limit']}>"


def connect(name=None, guarantee=None, limit=None, priority=None, gpu=None, socket=None, lib=None):
    """Makes this process a tenant of the daemon at `socket` now. With no argument it is the
    tenant libvram.so's first use would make (under `vramd run`, the run's). With any argument it
    is a tenant of its own, each argument left out taken as first use would (VRAMD_SOCKET,
    VRAMD_TENANT, VRAMD_GUARANTEE, VRAMD_LIMIT, VRAMD_CLASS, VRAMD_GPU, then the defaults).
    VramdError with the daemon's reason when it does not admit the tenant (a guarantee it cannot
    give, a name in use, no daemon)."""
    l = load(lib)
    ok = l.vram_connect(
        _lib.text(socket),
        _lib.text(name),
        _lib.text(priority),
        _size_arg(guarantee),
        _size_arg(limit),
        -1 if gpu is None else int(gpu),
    )
    _lib.check(ok == 0, "vram_connect")
    # A `Tenant` made before (of a tenant ended outside this package) speaks for this one no more.
    _tenant_ends()
    return Tenant()


def current():
    """The process's tenant, set up as at libvram.so's first use if it is none yet."""
    return Tenant()


class Pin:
    """A published version pinned read-only: `ptr`, `version`, `checksum`, `size`; `view()` is a
    read-only memoryview of it on the host backend (`ptr` is device memory elsewhere).

    `release()` gives the pin back once nothing made from `view()` is left (the memoryviews,
    their slices, arrays over them): until then the memory stays mapped, so that no view ever
    reads memory that is gone. Closing the buffer releases its pins the same way."""

    def __init__(self, buf, ptr, version, checksum, size):
        self._buf, self.ptr, self.version, self.checksum, self.size = buf, ptr, version, checksum, size
        self._pinned = ptr
        self._released = False
        # The pinned memory as a ctypes array while a view of it lives, held weakly: every view
        # and every object made from one holds it, so its end says that nothing reads the pin.
        self._mem = None

    def view(self):
        with self._buf._lock:
            if self._released:
                raise VramdError("vramd: this pin was released")
            self._buf._check_open()
            mem = self._mem() if self._mem is not None else None
            if mem is None:
                backend = _lib.take_json(_lib.lib().vram_stats_json(), "vram_stats_json")["backend"]
                if backend != "host":
                    raise VramdError(
                        f"vramd: a view of shared buffer `{self._buf.name}` is host memory, and "
                        f"this tenant's device is `{backend}`: `ptr` is device memory (copy it "
                        "with the device's own calls)"
                    )
                mem = (ctypes.c_char * self.size).from_address(self._pinned)
                self._mem = weakref.ref(mem)
                self._buf._viewed += 1
                weakref.finalize(mem, self._views_gone)
            return memoryview(mem).toreadonly()

    def _views_gone(self):
        with self._buf._lock:
            self._buf._viewed -= 1
            try:
                if self._released:
                    self._buf._release_pin(self._pinned)
            finally:
                self._buf._close_if_done()

    def release(self):
        """Gives the pin back: now if no view of it is left, else once the last one is gone."""
        with self._buf._lock:
            if self._released:
                return
            self._released = True
            self.ptr = None
            if self._mem is None or self._mem() is None:
                self._buf._release_pin(self._pinned)
            # Else `_views_gone` releases it.


class SharedBuffer(_Closes):
    """A named shared buffer (one writer at a time under a lease, readers pinning published
    versions; see docs/protocol.md). `create` or `open`, then `close` (or a `with` block).

    One buffer's calls are serialised by a lock, since a pin's release may come from whichever
    thread drops its last view. `close` releases the pins and the lease at once and ends the
    buffer's handle once no pin's view is left."""

    def __init__(self, handle, name):
        self._h, self.name = handle, name
        # A buffer dropped without `close` still ends its handle (else the tenant could not end).
        self._finalizer = weakref.finalize(self, _lib.lib().vram_shared_close, handle)
        self._draft = None
        self._lock = threading.RLock()
        self._pins = weakref.WeakSet()
        # Pins with a view alive, and whether close() waits for them.
        self._viewed = 0
        self._closing = False

    def _check_open(self):
        if not self._h or self._closing:
            raise VramdError(f"vramd: shared buffer `{self.name}` was closed")

    def _release_pin(self, ptr):
        if self._h:
            ok = _lib.lib().vram_shared_release(self._h, ptr) == 0
            _lib.check(ok, "vram_shared_release")

    def _close_if_done(self):
        if self._closing and self._viewed == 0:
            self._close_now()

    def _call(self, name, *args):
        with self._lock:
            self._check_open()
            return getattr(_lib.lib(), name)(self._h, *args)

    @classmethod
    def create(cls, name, size, readers=None, writers=None):
        """A buffer owned by this tenant, each version `size` bytes. `readers`/`writers`: lists of
        "tenant:NAME", "class:NAME" or "*"."""
        join = lambda xs: None if not xs else ",".join(xs).encode()
        h = _lib.lib().vram_shared_create(name.encode(), parse_size(size), join(readers), join(writers))
        _lib.check(h, "vram_shared_create")
        return cls(h, name)

    @classmethod
    def open(cls, name):
        h = _lib.lib().vram_shared_open(name.encode())
        _lib.check(h, "vram_shared_open")
        return cls(h, name)

    def lease(self, ttl_ms=10_000):
        ttl_ms = _millis("a lease", ttl_ms)
        _lib.check(self._call("vram_shared_lease", ttl_ms) == 0, "vram_shared_lease")

    def release_lease(self):
        _lib.check(self._call("vram_shared_release_lease") == 0, "vram_shared_release_lease")

    def begin_write(self, base=0):
        """Fresh memory for the next version, from version `base` (0 before the first publish):
        (pointer, the new version's number)."""
        v = ctypes.c_uint64()
        p = self._call("vram_shared_begin_write", base, ctypes.byref(v))
        _lib.check(p, "vram_shared_begin_write")
        return p, v.value

    def publish(self):
        """Publishes the draft; the daemon's checksum of it."""
        c = ctypes.c_uint64()
        _lib.check(self._call("vram_shared_publish", ctypes.byref(c)) == 0, "vram_shared_publish")
        return c.value

    def pin(self):
        v, c, n = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        p = self._call("vram_shared_pin", ctypes.byref(v), ctypes.byref(c), ctypes.byref(n))
        _lib.check(p, "vram_shared_pin")
        pin = Pin(self, p, v.value, c.value, n.value)
        self._pins.add(pin)
        return pin

    def verify(self, version):
        r = self._call("vram_shared_verify", version)
        _lib.check(r >= 0, "vram_shared_verify")
        return r == 1

    def wait(self, than=0, timeout_s=1.0):
        """The number of a version newer than `than`, or None after `timeout_s`. Waits in slices
        of at most 50 ms, so that the buffer's other calls (another thread's) go on meanwhile."""
        v = ctypes.c_uint64()
        timeout_ms = _millis("a wait", timeout_s * 1000)
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            r = self._call("vram_shared_wait", than, min(left, 50), ctypes.byref(v))
            _lib.check(r >= 0, "vram_shared_wait")
            if r == 1:
                return v.value
            if left <= 50:
                return None

    def close(self):
        """Ends the buffer's handle: its pins, draft and lease go back; while a pin's view is
        alive, the lease at once and the rest once the last view is gone."""
        with self._lock:
            if not self._h or self._closing:
                return
            for pin in list(self._pins):
                try:
                    pin.release()
                except VramdError:
                    # The handle's close below gives back whatever pin is left.
                    pass
            if self._viewed:
                self._closing = True
                # Another writer need not wait for this process's readers: no error if no lease.
                _lib.lib().vram_shared_release_lease(self._h)
            else:
                self._close_now()

    def _close_now(self):
        if self._h:
            self._finalizer.detach()
            _lib.lib().vram_shared_close(self._h)
            self._h = None
