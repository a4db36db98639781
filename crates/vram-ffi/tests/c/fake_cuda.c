/* A stand-in for the NVIDIA driver library, built by tests/driver_abi.rs as libcuda.so.1 and
 * found through LD_LIBRARY_PATH, so that libvram.so's driver interposition can be tested on a
 * machine without a GPU. It checks the mechanics only: which lookups and calls reach
 * libvram.so's hooks, what the hooks pass on to the driver and what they never pass on. Its
 * "device memory" is malloc'd host memory and it knows nothing of contexts or streams; the proof
 * against the real driver is the GPU run.
 *
 * Every function counts its calls; fake_calls(name) reads a count and fake_own(name) gives this
 * library's own function, so that a test can tell it from libvram.so's hook. */
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
    C_DEVICE_GET_COUNT,
    C_CTX_SYNCHRONIZE,
    C_MEM_ALLOC,
    C_MEM_ALLOC_PITCH,
    C_MEM_FREE,
    C_MEM_ALLOC_ASYNC,
    C_MEM_FREE_ASYNC,
    C_MEM_ALLOC_MANAGED,
    C_MEM_CREATE,
    C_MEM_RELEASE,
    C_MEM_GET_INFO,
    C_MEM_MAP,
    C_MEM_UNMAP,
    C_MEM_ALLOC_FROM_POOL,
    C_MEM_POOL_CREATE,
    C_MEM_POOL_DESTROY,
    C_STREAM_DESTROY,
    C_COUNT
};
static const char *const NAMES[C_COUNT] = {
    "cuDeviceGetCount", "cuCtxSynchronize", "cuMemAlloc_v2",    "cuMemAllocPitch_v2",
    "cuMemFree_v2",     "cuMemAllocAsync",  "cuMemFreeAsync",   "cuMemAllocManaged",
    "cuMemCreate",      "cuMemRelease",     "cuMemGetInfo_v2",  "cuMemMap",
    "cuMemUnmap",       "cuMemAllocFromPoolAsync", "cuMemPoolCreate", "cuMemPoolDestroy",
    "cuStreamDestroy_v2",
};
static int calls[C_COUNT];

int fake_calls(const char *name) {
    for (int i = 0; i < C_COUNT; i++)
        if (strcmp(NAMES[i], name) == 0)
            return __atomic_load_n(&calls[i], __ATOMIC_SEQ_CST);
    return -1;
}

static void count(int i) { __atomic_add_fetch(&calls[i], 1, __ATOMIC_SEQ_CST); }

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return 0;
}

CUresult cuStreamDestroy_v2(void *stream) {
    (void)stream;
    count(C_STREAM_DESTROY);
    return 0;
}

/* Not hooked by libvram.so: proves that lookups of other names pass through. */
CUresult cuDeviceGetCount(int *n) {
    count(C_DEVICE_GET_COUNT);
    *n = 7;
    return 0;
}

CUresult cuDeviceGet(int *device, int ordinal) {
    *device = ordinal;
    return 0;
}

CUresult cuCtxGetDevice(int *device) {
    *device = 0;
    return 0;
}

CUresult cuCtxSynchronize(void) {
    count(C_CTX_SYNCHRONIZE);
    return 0;
}

static void unpool(CUdeviceptr p);

static CUresult host_alloc(CUdeviceptr *p, size_t n) {
    void *m = malloc(n);
    if (m == NULL)
        return 2;
    *p = (CUdeviceptr)m;
    return 0;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    count(C_MEM_ALLOC);
    return host_alloc(p, n);
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height,
                            unsigned int element) {
    (void)element;
    count(C_MEM_ALLOC_PITCH);
    *pitch = (width + 511) / 512 * 512;
    return host_alloc(p, *pitch * height);
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    count(C_MEM_FREE);
    unpool(p);
    free((void *)p);
    return 0;
}

static CUresult pool_alloc(CUdeviceptr *p, size_t n, void *pool);

/* Device 0's current pool (none: its default pool, which the stand-in does not keep). */
static void *current_pool;

CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *stream) {
    (void)stream;
    count(C_MEM_ALLOC_ASYNC);
    return current_pool ? pool_alloc(p, n, current_pool) : host_alloc(p, n);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, void *stream) {
    return cuMemAllocAsync(p, n, stream);
}

CUresult cuMemFreeAsync(CUdeviceptr p, void *stream) {
    (void)stream;
    count(C_MEM_FREE_ASYNC);
    unpool(p);
    free((void *)p);
    return 0;
}
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, void *stream) { return cuMemFreeAsync(p, stream); }

/* Allocations from pools (a handful is all the tests make): what each pool reserves is what
 * is allocated from it, rounded up to 32 MiB, as a real pool rounds; a free gives it back at once. */
static struct {
    CUdeviceptr ptr;
    void *pool;
    size_t size;
} pooled[16];

static size_t pool_reserved(void *pool) {
    size_t n = 0, step = (size_t)32 << 20;
    for (int i = 0; i < 16; i++)
        if (pooled[i].ptr && pooled[i].pool == pool)
            n += pooled[i].size;
    return (n + step - 1) / step * step;
}

/* Forgets a pool allocation being freed (nothing if `p` is none). */
static void unpool(CUdeviceptr p) {
    for (int i = 0; i < 16; i++)
        if (pooled[i].ptr == p)
            pooled[i].ptr = 0;
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, void *pool, void *stream) {
    (void)stream;
    count(C_MEM_ALLOC_FROM_POOL);
    return pool_alloc(p, n, pool);
}

static CUresult pool_alloc(CUdeviceptr *p, size_t n, void *pool) {
    CUresult r = host_alloc(p, n);
    for (int i = 0; r == 0 && i < 16; i++)
        if (pooled[i].ptr == 0) {
            pooled[i].ptr = *p;
            pooled[i].pool = pool;
            pooled[i].size = n;
            break;
        }
    return r;
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, void *pool, void *stream) {
    return cuMemAllocFromPoolAsync(p, n, pool, stream);
}

/* A pool is a number; its properties are libvram.so's to read. */
static unsigned long long next_pool = 0x5000;

/* CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT (5) only. */
CUresult cuMemPoolGetAttribute(void *pool, int attr, void *value) {
    if (attr != 5)
        return 1;
    *(unsigned long long *)value = pool_reserved(pool);
    return 0;
}

CUresult cuMemPoolTrimTo(void *pool, size_t keep) {
    (void)pool;
    (void)keep;
    return 0;
}

CUresult cuMemPoolCreate(void **pool, const void *props) {
    (void)props;
    count(C_MEM_POOL_CREATE);
    *pool = (void *)__atomic_add_fetch(&next_pool, 1, __ATOMIC_SEQ_CST);
    return 0;
}

struct location {
    unsigned int type;
    int id;
};

/* The driver's own pool of a location: a number of its own per location and type. */
CUresult cuMemGetDefaultMemPool(void **pool, const struct location *at, unsigned int type) {
    *pool = (void *)(0x4000ULL + type * 0x100 + at->type * 0x10 + (unsigned)at->id);
    return 0;
}

CUresult cuMemGetMemPool(void **pool, const struct location *at, unsigned int type) {
    if (current_pool && at->type == 1 && at->id == 0 && type == 1) {
        *pool = current_pool;
        return 0;
    }
    return cuMemGetDefaultMemPool(pool, at, type);
}

CUresult cuDeviceSetMemPool(int device, void *pool) {
    if (device != 0)
        return 1;
    current_pool = pool;
    return 0;
}

CUresult cuMemSetMemPool(const struct location *at, unsigned int type, void *pool) {
    if (at->type != 1 || type != 1)
        return 1;
    return cuDeviceSetMemPool(at->id, pool);
}

CUresult cuMemPoolDestroy(void *pool) {
    (void)pool;
    count(C_MEM_POOL_DESTROY);
    return 0;
}

CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int flags) {
    (void)flags;
    count(C_MEM_ALLOC_MANAGED);
    return host_alloc(p, n);
}

static unsigned long long next_handle = 0x1000;

CUresult cuMemCreate(unsigned long long *handle, size_t size, const void *prop,
                     unsigned long long flags) {
    (void)size;
    (void)prop;
    (void)flags;
    count(C_MEM_CREATE);
    *handle = __atomic_add_fetch(&next_handle, 1, __ATOMIC_SEQ_CST);
    return 0;
}

CUresult cuMemRelease(unsigned long long handle) {
    (void)handle;
    count(C_MEM_RELEASE);
    return 0;
}

/* Mappings of handles, by address (a handful is all the tests make). */
static struct {
    unsigned long long ptr, handle;
} mapped[16];

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, unsigned long long handle,
                  unsigned long long flags) {
    (void)size;
    (void)offset;
    (void)flags;
    count(C_MEM_MAP);
    for (int i = 0; i < 16; i++)
        if (mapped[i].ptr == 0) {
            mapped[i].ptr = ptr;
            mapped[i].handle = handle;
            return 0;
        }
    return 2;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    (void)size;
    count(C_MEM_UNMAP);
    for (int i = 0; i < 16; i++)
        if (mapped[i].ptr == ptr) {
            mapped[i].ptr = 0;
            return 0;
        }
    return 1;
}

CUresult cuMemRetainAllocationHandle(unsigned long long *handle, void *addr) {
    for (int i = 0; i < 16; i++)
        if (mapped[i].ptr == (CUdeviceptr)addr) {
            *handle = mapped[i].handle;
            return 0;
        }
    return 1;
}

/* An export's descriptor: none is made, the call only succeeds. */
CUresult cuMemExportToShareableHandle(void *shareable, unsigned long long handle, int type,
                                      unsigned long long flags) {
    (void)handle;
    (void)type;
    (void)flags;
    *(int *)shareable = -1;
    return 0;
}

/* The whole stand-in "GPU": 80 GiB, 70 GiB of it free. */
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    count(C_MEM_GET_INFO);
    *total = (size_t)80 << 30;
    *free_bytes = (size_t)70 << 30;
    return 0;
}

CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], int device) {
    for (int i = 0; i < 16; i++)
        uuid[i] = (unsigned char)(device * 16 + i);
    return 0;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);

/* This library's functions by the names cuGetProcAddress takes (without version suffixes), with
 * the CUDA version from which each is the one given; the per-thread forms after their base. */
struct entry {
    const char *name;
    int since;
    int per_thread;
    void *fn;
};
static const struct entry TABLE[] = {
    {"cuInit", 2000, 0, (void *)cuInit},
    {"cuDeviceGetCount", 2000, 0, (void *)cuDeviceGetCount},
    {"cuDeviceGet", 2000, 0, (void *)cuDeviceGet},
    {"cuCtxGetDevice", 2000, 0, (void *)cuCtxGetDevice},
    {"cuCtxSynchronize", 2000, 0, (void *)cuCtxSynchronize},
    {"cuMemAlloc", 3020, 0, (void *)cuMemAlloc_v2},
    {"cuMemAllocPitch", 3020, 0, (void *)cuMemAllocPitch_v2},
    {"cuMemFree", 3020, 0, (void *)cuMemFree_v2},
    {"cuMemGetInfo", 3020, 0, (void *)cuMemGetInfo_v2},
    {"cuMemAllocManaged", 6000, 0, (void *)cuMemAllocManaged},
    {"cuMemCreate", 10020, 0, (void *)cuMemCreate},
    {"cuMemRelease", 10020, 0, (void *)cuMemRelease},
    {"cuMemMap", 10020, 0, (void *)cuMemMap},
    {"cuMemUnmap", 10020, 0, (void *)cuMemUnmap},
    {"cuMemRetainAllocationHandle", 11000, 0, (void *)cuMemRetainAllocationHandle},
    {"cuMemExportToShareableHandle", 10020, 0, (void *)cuMemExportToShareableHandle},
    {"cuMemAllocAsync", 11020, 0, (void *)cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, (void *)cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, (void *)cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, (void *)cuMemFreeAsync_ptsz},
    {"cuMemAllocFromPoolAsync", 11020, 0, (void *)cuMemAllocFromPoolAsync},
    {"cuMemAllocFromPoolAsync", 11020, 1, (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuMemPoolCreate", 11020, 0, (void *)cuMemPoolCreate},
    {"cuMemPoolDestroy", 11020, 0, (void *)cuMemPoolDestroy},
    {"cuMemPoolTrimTo", 11020, 0, (void *)cuMemPoolTrimTo},
    {"cuMemPoolGetAttribute", 11020, 0, (void *)cuMemPoolGetAttribute},
    {"cuDeviceSetMemPool", 11020, 0, (void *)cuDeviceSetMemPool},
    {"cuMemGetDefaultMemPool", 13000, 0, (void *)cuMemGetDefaultMemPool},
    {"cuMemGetMemPool", 13000, 0, (void *)cuMemGetMemPool},
    {"cuMemSetMemPool", 13000, 0, (void *)cuMemSetMemPool},
    {"cuDeviceGetUuid", 11040, 0, (void *)cuDeviceGetUuid_v2},
    {"cuStreamDestroy", 4000, 0, (void *)cuStreamDestroy_v2},
    {"cuGetProcAddress", 11030, 0, (void *)cuGetProcAddress},
    {"cuGetProcAddress", 12000, 0, (void *)cuGetProcAddress_v2},
};

static void *find(const char *symbol, int version, int per_thread) {
    void *best = NULL;
    for (size_t i = 0; i < sizeof TABLE / sizeof TABLE[0]; i++) {
        const struct entry *e = &TABLE[i];
        if (strcmp(e->name, symbol) == 0 && e->since <= version &&
            (e->per_thread == per_thread || (!best && !e->per_thread)))
            best = e->fn;
    }
    return best;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status) {
    void *f = find(symbol, version, (flags & 2) != 0);
    *pfn = f;
    if (status)
        *status = f ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / _SYMBOL_NOT_FOUND */
    return f ? 0 : 500;      /* CUDA_ERROR_NOT_FOUND */
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* This library's own function of an exported name (a lookup libvram.so does not see). */
void *fake_own(const char *name) {
    static const struct {
        const char *name;
        void *fn;
    } OWN[] = {
        {"cuDeviceGetCount", (void *)cuDeviceGetCount},
        {"cuMemAlloc_v2", (void *)cuMemAlloc_v2},
        {"cuMemFree_v2", (void *)cuMemFree_v2},
        {"cuMemAllocAsync_ptsz", (void *)cuMemAllocAsync_ptsz},
        {"cuMemCreate", (void *)cuMemCreate},
        {"cuGetProcAddress_v2", (void *)cuGetProcAddress_v2},
    };
    for (size_t i = 0; i < sizeof OWN / sizeof OWN[0]; i++)
        if (strcmp(OWN[i].name, name) == 0)
            return OWN[i].fn;
    return NULL;
}
