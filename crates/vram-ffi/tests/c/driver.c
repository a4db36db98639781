/* libvram.so's driver-level interposition, as a program that loads the driver itself sees it.
 * Run by tests/driver_abi.rs with LD_PRELOAD=libvram.so, LD_LIBRARY_PATH naming the directory of
 * the stand-in driver, NVML and runtime (fake_cuda.c, fake_nvml.c, fake_cudart.c: mechanics only,
 * the proof on a real driver is the GPU run), VRAMD_LIMIT=256MiB, VRAMD_TORCH_MODE=pool (which
 * only the runtime's calls heed), against a host-backend daemon, whose memory the program can
 * write with memset.
 *
 *   driver            every hook; prints "driver: ok", then waits for a line on stdin while the
 *                     test reads the daemon's status (66 MiB charged through cuMemCreate)
 *   driver nodaemon   VRAMD_SOCKET names no daemon: allocations are refused, never passed on */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vram.h"
#include "check.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*pitch_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, void *);
typedef CUresult (*free_async_fn)(CUdeviceptr, void *);
typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*pool_create_fn)(void **, const void *);
typedef CUresult (*pool_destroy_fn)(void *);
typedef CUresult (*from_pool_fn)(CUdeviceptr *, size_t, void *, void *);
struct location {
    unsigned int type;
    int id;
};
typedef CUresult (*get_pool_fn)(void **, const struct location *, unsigned int);
typedef CUresult (*set_pool_fn)(const struct location *, unsigned int, void *);
typedef CUresult (*device_set_pool_fn)(int, void *);
typedef CUresult (*create_fn)(unsigned long long *, size_t, const void *, unsigned long long);
typedef CUresult (*release_fn)(unsigned long long);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
typedef CUresult (*unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*retain_fn)(unsigned long long *, void *);
typedef CUresult (*export_fn)(void *, unsigned long long, int, unsigned long long);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef CUresult (*count_fn)(int *);
typedef CUresult (*proc_v2_fn)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*proc_fn)(const char *, void **, int, unsigned long long);

/* CUmemAllocationProp: pinned device memory on device 0. */
struct prop {
    unsigned int type, handle_types, location_type;
    int location_id;
    void *win32;
    unsigned char flags[8];
};
static const struct prop DEVICE0 = {1, 0, 1, 0, NULL, {0}};

/* CUmemPoolProps: pinned memory, handle types (1: a POSIX file descriptor), location type
 * (1: a device, 2: the host) and id. */
struct pool_props {
    unsigned int type, handle_types, location_type;
    int location_id;
    void *win32;
    size_t max_size;
    unsigned short usage;
    unsigned char reserved[54];
};

typedef struct {
    unsigned long long total, free, used;
} nvml_memory;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvml_memory_v2;


static void *cuda;
static int (*calls)(const char *);
static void *(*own)(const char *);

static void *sym(const char *name) { return dlsym(cuda, name); }

static int no_daemon(void) {
    alloc_fn alloc = (alloc_fn)sym("cuMemAlloc_v2");
    create_fn create = (create_fn)sym("cuMemCreate");
    CUdeviceptr p = 0;
    CHECK(alloc(&p, 1 << 20) == 2 && p == 0);
    CHECK(strstr(vram_last_error(), "cannot reach vramd") != NULL);
    CHECK(alloc(&p, 1 << 20) == 2);
    unsigned long long h = 0;
    CHECK(create(&h, 2 << 20, &DEVICE0, 0) == 2);
    /* Nothing reached the driver: no silent escape. */
    CHECK(calls("cuMemAlloc_v2") == 0 && calls("cuMemCreate") == 0);
    printf("nodaemon: ok\n");
    return 0;
}

/* A process of `vramd run` that has not joined the run's tenant asks about memory: the driver's
 * and NVML's own figures, and nothing asked of the daemon (the question must not take the run's
 * invitation, which is for the process that first allocates). */
static int query(void) {
    info_fn info = (info_fn)sym("cuMemGetInfo_v2");
    size_t free_bytes = 0, total = 0;
    CHECK(info(&free_bytes, &total) == 0);
    CHECK(total == (size_t)80 << 30);
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    CHECK(nvml != NULL);
    int (*handle_by_index)(unsigned int, void **) =
        (int (*)(unsigned int, void **))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    int (*nvml_info)(void *, nvml_memory *) =
        (int (*)(void *, nvml_memory *))dlsym(nvml, "nvmlDeviceGetMemoryInfo");
    CHECK(handle_by_index && nvml_info);
    void *dev0 = NULL;
    nvml_memory mem = {0};
    CHECK(handle_by_index(0, &dev0) == 0 && nvml_info(dev0, &mem) == 0);
    CHECK(mem.total == 80ULL << 30);
    printf("query: ok\n");
    return 0;
}

int main(int argc, char **argv) {
    cuda = dlopen("libcuda.so.1", RTLD_NOW);
    CHECK(cuda != NULL);
    /* Names libvram.so does not hook come from the driver unchanged. */
    calls = (int (*)(const char *))sym("fake_calls");
    own = (void *(*)(const char *))sym("fake_own");
    CHECK(calls != NULL && own != NULL);
    CHECK(sym("cuDeviceGetCount") == own("cuDeviceGetCount"));
    CHECK(sym("no_such_symbol") == NULL);
    int n = 0;
    CHECK(((count_fn)sym("cuDeviceGetCount"))(&n) == 0 && n == 7);
    if (argc > 1 && strcmp(argv[1], "nodaemon") == 0)
        return no_daemon();
    if (argc > 1 && strcmp(argv[1], "query") == 0)
        return query();

    /* Hooked names: libvram.so's function, the same one a direct link reaches. */
    alloc_fn alloc = (alloc_fn)sym("cuMemAlloc_v2");
    free_fn mem_free = (free_fn)sym("cuMemFree_v2");
    CHECK(alloc != NULL && alloc != own("cuMemAlloc_v2"));
    CHECK((void *)alloc == dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"));
    CHECK((void *)mem_free != own("cuMemFree_v2"));
    /* RTLD_NEXT is resolved from the caller's place, not libvram.so's: libvram.so itself comes
     * after this program (from libvram.so, nothing after it has the name). */
    CHECK(dlsym(RTLD_NEXT, "vram_last_error") != NULL);
    CHECK(dlsym(RTLD_NEXT, "vram_last_error") == dlsym(RTLD_DEFAULT, "vram_last_error"));
    CHECK(dlsym(RTLD_NEXT, "cuMemAlloc_v2") == (void *)alloc);
    /* A library without the name still has none. */
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    CHECK(nvml != NULL);
    CHECK(dlsym(nvml, "cuMemAlloc_v2") == NULL);

    /* cuGetProcAddress: the hooks for hooked functions, the driver's for the rest. */
    proc_v2_fn proc = (proc_v2_fn)sym("cuGetProcAddress_v2");
    CHECK(proc != NULL && (void *)proc != own("cuGetProcAddress_v2"));
    void *f = NULL;
    int status = -1;
    CHECK(proc("cuMemAlloc", &f, 12000, 0, &status) == 0 && status == 0);
    CHECK(f == (void *)alloc);
    CHECK(proc("cuMemFree", &f, 12000, 0, NULL) == 0 && f == (void *)mem_free);
    CHECK(proc("cuGetProcAddress", &f, 12000, 0, NULL) == 0 && f == (void *)proc);
    CHECK(proc("cuDeviceGetCount", &f, 12000, 0, NULL) == 0 && f == own("cuDeviceGetCount"));
    CHECK(proc("cuMemAllocAsync", &f, 12000, 2, NULL) == 0);
    CHECK(f != own("cuMemAllocAsync_ptsz") && f == dlsym(RTLD_DEFAULT, "cuMemAllocAsync_ptsz"));
    CHECK(proc("cuNoSuchCall", &f, 12000, 0, &status) == 500 && status == 1);
    proc_fn proc_v1 = NULL;
    CHECK(proc("cuGetProcAddress", (void **)&proc_v1, 11030, 0, NULL) == 0);
    CHECK((void *)proc_v1 == dlsym(RTLD_DEFAULT, "cuGetProcAddress"));
    alloc_fn alloc2 = NULL;
    CHECK(proc_v1("cuMemAlloc", (void **)&alloc2, 11030, 0) == 0 && alloc2 == alloc);
    CHECK(proc("cuMemCreate", &f, 12000, 0, NULL) == 0 && f == sym("cuMemCreate"));
    /* A stream's destroy goes through vramd (which fences the frees booked on it) to the
     * driver's. */
    typedef CUresult (*destroy_fn)(void *);
    CHECK(proc("cuStreamDestroy", &f, 12000, 0, NULL) == 0);
    CHECK(f != own("cuStreamDestroy_v2") && f == dlsym(RTLD_DEFAULT, "cuStreamDestroy_v2"));
    CHECK(((destroy_fn)f)((void *)0x5000) == 0 && calls("cuStreamDestroy_v2") == 1);

    /* Allocations through both routes are vramd's: writable, distinct, never the driver's. */
    size_t len = (size_t)64 << 20;
    CUdeviceptr a = 0, b = 0;
    CHECK(alloc(&a, len) == 0 && a != 0);
    CHECK(alloc2(&b, len) == 0 && b != 0 && b != a);
    memset((void *)a, 0xab, len);
    memset((void *)b, 0xcd, len);
    for (size_t i = 0; i < len; i += 4093)
        CHECK(((unsigned char *)a)[i] == 0xab && ((unsigned char *)b)[i] == 0xcd);
    CHECK(calls("cuMemAlloc_v2") == 0);
    CHECK(alloc(&a, 0) == 1);
    /* Past the limit: out of memory (2), the reason in vram_last_error. */
    CUdeviceptr big = 0;
    CHECK(alloc(&big, (size_t)512 << 20) == 2 && big == 0);
    CHECK(strstr(vram_last_error(), "limit") != NULL);
    printf("refused as expected: %s\n", vram_last_error());

    /* cuMemFree synchronises, then frees into vramd; a second free is refused, not passed on. */
    CHECK(mem_free(a) == 0);
    CHECK(calls("cuCtxSynchronize") == 1);
    CHECK(mem_free(a) == 1);
    CHECK(mem_free(b) == 0);
    CHECK(calls("cuMemFree_v2") == 0);
    /* Memory vramd did not hand out goes to the driver. */
    CUdeviceptr theirs = 0;
    CHECK(((alloc_fn)own("cuMemAlloc_v2"))(&theirs, 4096) == 0);
    CHECK(mem_free(theirs) == 0 && calls("cuMemFree_v2") == 1);

    /* Stream-ordered, on a stream and on the per-thread default stream. */
    alloc_async_fn alloc_async = (alloc_async_fn)sym("cuMemAllocAsync");
    free_async_fn free_async = (free_async_fn)sym("cuMemFreeAsync");
    alloc_async_fn alloc_ptsz = (alloc_async_fn)sym("cuMemAllocAsync_ptsz");
    free_async_fn free_ptsz = (free_async_fn)sym("cuMemFreeAsync_ptsz");
    void *stream = (void *)0x1234;
    CUdeviceptr c = 0, d = 0;
    CHECK(alloc_async(&c, 1 << 20, stream) == 0 && c != 0);
    CHECK(alloc_ptsz(&d, 1 << 20, NULL) == 0 && d != 0 && d != c);
    memset((void *)c, 1, 1 << 20);
    memset((void *)d, 2, 1 << 20);
    CHECK(free_async(c, stream) == 0);
    CHECK(free_ptsz(d, NULL) == 0);
    CHECK(calls("cuMemAllocAsync") == 0 && calls("cuMemFreeAsync") == 0);

    /* Pools the program makes: from one on the device vramd serves; from one on the host, one
     * whose allocations may be exported and one of managed memory, the driver does, charging
     * the latter two by what the pool reserves (the stand-in rounds to 32 MiB) until the pool
     * gives it back (the stand-in does at the free, by cuMemFreeAsync or cuMemFree). */
    pool_create_fn pool_create = (pool_create_fn)sym("cuMemPoolCreate");
    pool_destroy_fn pool_destroy = (pool_destroy_fn)sym("cuMemPoolDestroy");
    from_pool_fn from_pool = (from_pool_fn)sym("cuMemAllocFromPoolAsync");
    CHECK(pool_create && (void *)pool_create == dlsym(RTLD_DEFAULT, "cuMemPoolCreate"));
    CHECK(proc("cuMemPoolCreate", &f, 12000, 0, NULL) == 0 && f == (void *)pool_create);
    struct pool_props on_device = {1, 0, 1, 0, NULL, 0, 0, {0}};
    struct pool_props on_host = {1, 0, 2, 0, NULL, 0, 0, {0}};
    struct pool_props exportable = {1, 1, 1, 0, NULL, 0, 0, {0}};
    struct pool_props managed_pool = {2, 0, 1, 0, NULL, 0, 0, {0}};
    void *device_pool = NULL, *host_pool = NULL, *export_pool = NULL, *managed_p = NULL;
    CHECK(pool_create(&device_pool, &on_device) == 0 && pool_create(&host_pool, &on_host) == 0);
    CHECK(pool_create(&export_pool, &exportable) == 0);
    CHECK(pool_create(&managed_p, &managed_pool) == 0 && calls("cuMemPoolCreate") == 4);
    CUdeviceptr pd = 0, ph = 0, pe = 0, pm = 0, pbig = 0;
    CHECK(from_pool(&pd, 1 << 20, device_pool, stream) == 0 && pd != 0);
    CHECK(calls("cuMemAllocFromPoolAsync") == 0);
    CHECK(from_pool(&ph, 1 << 20, host_pool, stream) == 0 && ph != 0);
    CHECK(calls("cuMemAllocFromPoolAsync") == 1);
    memset((void *)ph, 5, 1 << 20);
    info_fn pool_info = (info_fn)sym("cuMemGetInfo_v2");
    size_t before = 0, now = 0, pool_total = 0;
    const size_t mib32 = (size_t)32 << 20;
    CHECK(pool_info(&before, &pool_total) == 0);
    CHECK(from_pool(&pe, (size_t)8 << 20, export_pool, stream) == 0 && pe != 0);
    CHECK(calls("cuMemAllocFromPoolAsync") == 2);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - mib32);
    CHECK(from_pool(&pm, (size_t)4 << 20, managed_p, stream) == 0 && pm != 0);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - 2 * mib32);
    /* Past the limit: the driver's memory is freed again and the call fails. */
    CHECK(from_pool(&pbig, (size_t)512 << 20, export_pool, stream) == 2 && pbig == 0);
    CHECK(strstr(vram_last_error(), "cuMemAllocFromPoolAsync") != NULL);
    CHECK(calls("cuMemAllocFromPoolAsync") == 4 && calls("cuMemFreeAsync") == 1);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - 2 * mib32);
    CHECK(free_async(pd, stream) == 0 && calls("cuMemFreeAsync") == 1);
    CHECK(free_async(ph, stream) == 0 && calls("cuMemFreeAsync") == 2);
    CHECK(free_async(pe, stream) == 0 && calls("cuMemFreeAsync") == 3);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - mib32);
    CHECK(calls("cuMemFree_v2") == 1);
    CHECK(mem_free(pm) == 0 && calls("cuMemFree_v2") == 2);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before);

    /* The driver's own pools of other locations than a device are placed as made ones: the
     * host's default pool is the driver's, uncharged; a device's default pool is served. */
    get_pool_fn get_default = (get_pool_fn)sym("cuMemGetDefaultMemPool");
    get_pool_fn get_current = (get_pool_fn)sym("cuMemGetMemPool");
    CHECK(get_default && (void *)get_default == dlsym(RTLD_DEFAULT, "cuMemGetDefaultMemPool"));
    CHECK(proc("cuMemGetDefaultMemPool", &f, 13000, 0, NULL) == 0 && f == (void *)get_default);
    const struct location host0 = {2, 0}, numa1 = {3, 1}, device0 = {1, 0};
    void *host_default = NULL, *numa_current = NULL, *device_default = NULL;
    CHECK(get_default(&host_default, &host0, 1) == 0 && host_default != NULL);
    CHECK(get_current(&numa_current, &numa1, 1) == 0 && numa_current != NULL);
    CHECK(get_default(&device_default, &device0, 1) == 0 && device_default != NULL);
    int from_pool_calls = calls("cuMemAllocFromPoolAsync");
    CUdeviceptr hd = 0, hn = 0, dd = 0;
    CHECK(from_pool(&hd, 1 << 20, host_default, stream) == 0 && hd != 0);
    CHECK(from_pool(&hn, 1 << 20, numa_current, stream) == 0 && hn != 0);
    CHECK(calls("cuMemAllocFromPoolAsync") == from_pool_calls + 2);
    memset((void *)hd, 6, 1 << 20);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before);
    CHECK(from_pool(&dd, 1 << 20, device_default, stream) == 0 && dd != 0);
    CHECK(calls("cuMemAllocFromPoolAsync") == from_pool_calls + 2);
    CHECK(free_async(hd, stream) == 0 && free_async(hn, stream) == 0 && free_async(dd, stream) == 0);

    /* A pool made current for the device: cuMemAllocAsync takes from it, the driver's when vramd
     * cannot stand in for it (charged by its reservation), vramd's again once the device's own
     * pool or one vramd serves is current. */
    device_set_pool_fn device_set = (device_set_pool_fn)sym("cuDeviceSetMemPool");
    set_pool_fn mem_set = (set_pool_fn)sym("cuMemSetMemPool");
    CHECK(device_set && (void *)device_set == dlsym(RTLD_DEFAULT, "cuDeviceSetMemPool"));
    CHECK(proc("cuDeviceSetMemPool", &f, 12000, 0, NULL) == 0 && f == (void *)device_set);
    int async_calls = calls("cuMemAllocAsync");
    CUdeviceptr ca = 0, cb = 0, cbig = 0;
    CHECK(device_set(0, export_pool) == 0);
    CHECK(alloc_async(&ca, (size_t)8 << 20, stream) == 0 && ca != 0);
    CHECK(calls("cuMemAllocAsync") == async_calls + 1);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - mib32);
    CHECK(alloc_async(&cbig, (size_t)512 << 20, stream) == 2 && cbig == 0);
    CHECK(calls("cuMemAllocAsync") == async_calls + 2);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - mib32);
    CHECK(free_async(ca, stream) == 0);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before);
    /* Pool mode's cudaMallocAsync takes from the same pool: the call goes on to the runtime
     * (the stand-in, loaded as a Python extension loads it), whose cuMemAllocAsync is the
     * driver's, charged by the pool's reservation. */
    void *runtime = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
    CHECK(runtime != NULL);
    int (*runtime_calls)(void) = (int (*)(void))dlsym(runtime, "fake_cudart_calls");
    int (*cuda_malloc_async)(void **, size_t, void *) =
        (int (*)(void **, size_t, void *))dlsym(RTLD_DEFAULT, "cudaMallocAsync");
    int (*cuda_free_async)(void *, void *) =
        (int (*)(void *, void *))dlsym(RTLD_DEFAULT, "cudaFreeAsync");
    CHECK(runtime_calls && cuda_malloc_async && cuda_free_async);
    CHECK(cuda_malloc_async != dlsym(runtime, "cudaMallocAsync"));
    void *on_device0 = (void *)0x5678, *rt = NULL;
    CHECK(cuda_malloc_async(&rt, (size_t)8 << 20, on_device0) == 0 && rt != NULL);
    CHECK(runtime_calls() == 1 && calls("cuMemAllocAsync") == async_calls + 3);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - mib32);
    CHECK(cuda_free_async(rt, on_device0) == 0 && runtime_calls() == 2);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before);
    CHECK(mem_set(&device0, 1, device_pool) == 0);
    CHECK(alloc_async(&cb, 1 << 20, stream) == 0 && cb != 0);
    CHECK(calls("cuMemAllocAsync") == async_calls + 3);
    CHECK(free_async(cb, stream) == 0);
    /* With vramd's pool current again, vramd serves the runtime's call. */
    CHECK(cuda_malloc_async(&rt, 1 << 20, on_device0) == 0 && rt != NULL);
    CHECK(runtime_calls() == 2 && calls("cuMemAllocAsync") == async_calls + 3);
    CHECK(cuda_free_async(rt, on_device0) == 0 && runtime_calls() == 2);

    /* A pool destroyed while an allocation from it is out: the driver frees its memory once
     * that is freed, and the charge stays until then. */
    CUdeviceptr left = 0;
    CHECK(from_pool(&left, (size_t)8 << 20, export_pool, stream) == 0 && left != 0);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - mib32);
    CHECK(pool_destroy(export_pool) == 0 && calls("cuMemPoolDestroy") == 1);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before - mib32);
    CHECK(free_async(left, stream) == 0);
    CHECK(pool_info(&now, &pool_total) == 0 && now == before);
    CHECK(pool_destroy(managed_p) == 0);
    CHECK(pool_destroy(host_pool) == 0 && pool_destroy(device_pool) == 0);

    /* Pitched: rows of 1000 bytes 1024 apart. */
    CUdeviceptr e = 0;
    size_t pitch = 0;
    CHECK(((pitch_fn)sym("cuMemAllocPitch_v2"))(&e, &pitch, 1000, 64, 4) == 0 && pitch == 1024);
    memset((void *)e, 3, pitch * 64);
    CHECK(mem_free(e) == 0 && calls("cuMemAllocPitch_v2") == 0);

    /* cuMemCreate: made by the driver, charged to the tenant; refused past the limit, when the
     * handle goes back to the driver at once. The charge lasts until the driver frees the memory:
     * h is mapped and its handle released (the test sees it still charged), h2 is released
     * unmapped (freed at once). */
    create_fn create = (create_fn)sym("cuMemCreate");
    release_fn release = (release_fn)sym("cuMemRelease");
    map_fn map = (map_fn)sym("cuMemMap");
    unmap_fn unmap = (unmap_fn)sym("cuMemUnmap");
    retain_fn retain = (retain_fn)sym("cuMemRetainAllocationHandle");
    CHECK(map && unmap && retain && (void *)map == dlsym(RTLD_DEFAULT, "cuMemMap"));
    const CUdeviceptr va = 0x7f0000000000ULL;
    unsigned long long h = 0, h2 = 0, hbig = 0;
    CHECK(create(&h, len, &DEVICE0, 0) == 0 && h != 0 && calls("cuMemCreate") == 1);
    CHECK(map(va, len, 0, h, 0) == 0 && calls("cuMemMap") == 1);
    CHECK(release(h) == 0 && calls("cuMemRelease") == 1);
    CHECK(create(&h2, (size_t)2 << 20, &DEVICE0, 0) == 0);
    CHECK(release(h2) == 0 && calls("cuMemRelease") == 2);
    CHECK(create(&hbig, (size_t)512 << 20, &DEVICE0, 0) == 2);
    CHECK(calls("cuMemCreate") == 3 && calls("cuMemRelease") == 3);
    printf("charge refused as expected: %s\n", vram_last_error());
    /* An exported handle may live on in an importer after its last release here: h3 stays
     * charged (2 MiB more in the test's figure). */
    export_fn export_handle = (export_fn)sym("cuMemExportToShareableHandle");
    CHECK(export_handle && (void *)export_handle == dlsym(RTLD_DEFAULT, "cuMemExportToShareableHandle"));
    unsigned long long h3 = 0;
    int fd = 0;
    CHECK(create(&h3, (size_t)2 << 20, &DEVICE0, 0) == 0);
    CHECK(export_handle(&fd, h3, 1, 0) == 0);
    CHECK(release(h3) == 0);

    /* Managed memory: the driver's, charged; its free uncharges. */
    managed_fn managed = (managed_fn)sym("cuMemAllocManaged");
    CUdeviceptr m = 0;
    CHECK(managed(&m, (size_t)16 << 20, 1) == 0 && m != 0 && calls("cuMemAllocManaged") == 1);
    memset((void *)m, 4, (size_t)16 << 20);
    CHECK(mem_free(m) == 0 && calls("cuMemFree_v2") == 3);
    CUdeviceptr mbig = 0;
    CHECK(managed(&mbig, (size_t)512 << 20, 1) == 2 && mbig == 0);
    CHECK(calls("cuMemFree_v2") == 4);

    /* The tenant's view: total its limit, free what it could still get; NVML agrees exactly
     * for its GPU and passes other GPUs through. */
    info_fn info = (info_fn)sym("cuMemGetInfo_v2");
    size_t free_bytes = 0, total = 0;
    CHECK(info(&free_bytes, &total) == 0);
    printf("cuMemGetInfo: free %zu total %zu\n", free_bytes, total);
    CHECK(total == (size_t)256 << 20);
    CHECK(free_bytes <= total - len); /* the 64 MiB charged through cuMemCreate */
    int (*handle_by_index)(unsigned int, void **) =
        (int (*)(unsigned int, void **))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    int (*nvml_info)(void *, nvml_memory *) =
        (int (*)(void *, nvml_memory *))dlsym(nvml, "nvmlDeviceGetMemoryInfo");
    int (*nvml_info_v2)(void *, nvml_memory_v2 *) =
        (int (*)(void *, nvml_memory_v2 *))dlsym(nvml, "nvmlDeviceGetMemoryInfo_v2");
    CHECK(handle_by_index && nvml_info && nvml_info_v2);
    CHECK((void *)nvml_info == dlsym(RTLD_DEFAULT, "nvmlDeviceGetMemoryInfo"));
    void *dev0 = NULL, *dev1 = NULL;
    CHECK(handle_by_index(0, &dev0) == 0 && handle_by_index(1, &dev1) == 0);
    nvml_memory mem = {0};
    CHECK(nvml_info(dev0, &mem) == 0);
    CHECK(mem.total == total && mem.free == free_bytes && mem.used == total - free_bytes);
    nvml_memory_v2 mem2 = {0};
    mem2.version = (unsigned int)sizeof(nvml_memory_v2) | (2u << 24);
    CHECK(nvml_info_v2(dev0, &mem2) == 0);
    CHECK(mem2.total == total && mem2.free == free_bytes && mem2.reserved == 0 &&
          mem2.used == total - free_bytes);
    mem2.version = 1;
    CHECK(nvml_info_v2(dev0, &mem2) == 25); /* NVML's own error, unchanged */
    CHECK(nvml_info(dev1, &mem) == 0 && mem.total == 80ULL << 30 && mem.free == 70ULL << 30);

    char *stats = vram_interposer_stats_json();
    CHECK(stats != NULL && strstr(stats, "\"preloaded\":true") != NULL);
    printf("stats: %s\n", stats);
    vram_string_free(stats);
    printf("interposed calls: %llu\n", vram_interposed_calls());
    CHECK(vram_interposed_calls() == 18); /* the allocations and frees vramd served */
    printf("driver: ok\n");
    fflush(stdout);
    /* The test reads the daemon's status meanwhile, then writes a line or closes stdin. */
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL)
        line[0] = '\0';
    /* Another reference to h (as NCCL takes before it frees) and its release: still mapped, still
     * charged. The unmap frees it: the charge goes back, and the tenant may have 64 MiB more. */
    size_t charged_free = 0, now_free = 0;
    CHECK(info(&charged_free, &total) == 0);
    unsigned long long again = 0;
    CHECK(retain(&again, (void *)va) == 0 && again == h);
    CHECK(release(again) == 0);
    CHECK(info(&now_free, &total) == 0 && now_free == charged_free);
    CHECK(unmap(va, len) == 0 && calls("cuMemUnmap") == 1);
    CHECK(info(&now_free, &total) == 0 && now_free == charged_free + len);
    printf("unmapped: free %zu, was %zu\n", now_free, charged_free);
    /* Everything freed but h3, exported and let go here (its charge an importer's now): the
     * tenant may end. */
    CHECK(vram_disconnect() == 0);
    printf("disconnected\n");
    return 0;
}
