/* libvram.so: vramd's caching allocator for tenant processes.
 *
 * The two allocation functions have PyTorch's CUDAPluggableAllocator signatures:
 *   torch.cuda.memory.CUDAPluggableAllocator("libvram.so", "vram_alloc", "vram_free")
 * The process's tenant is set up by vram_init (below), or on first use: then the library connects
 * to the daemon named by VRAMD_SOCKET (default /run/vramd/vramd.sock) as tenant VRAMD_TENANT
 * (default "pid-<pid>"), asking for VRAMD_LIMIT, VRAMD_GUARANTEE and class VRAMD_CLASS where set
 * (sizes like "20GiB"). VRAMD_PRIORITY is not read: a process that has it set is refused, told
 * to set VRAMD_CLASS instead.
 *
 * No function aborts the process or lets a panic cross this boundary. A refused allocation returns
 * NULL and leaves the reason, with the numbers in it, in vram_last_error().
 */
#ifndef VRAM_H
#define VRAM_H

#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The tenant's options for vram_init. Zero every field (`vram_options_t o = {0};` or memset),
 * set `size` to sizeof(vram_options_t), then set what the program chooses: every field left zero
 * or NULL takes what first use would (the environment variable named, then the default).
 *
 * The struct grows at its end in later versions, a zero always meaning "unset" in the fields
 * added, and `size` tells the library which version the program was built with: a program built
 * against an older vram.h keeps working with a newer libvram.so. A newer program on an older
 * libvram.so works as long as it leaves the fields the library does not know zero; otherwise
 * vram_init refuses (-1), rather than drop an option silently, as it refuses flags it does not
 * know and a `size` below the first version's (56 bytes). */
typedef struct vram_options {
    uint32_t size;            /* sizeof(vram_options_t) */
    uint32_t flags;           /* VRAM_OPTION_* bits, or 0 */
    const char *socket;       /* the daemon's socket; NULL: VRAMD_SOCKET, else the default */
    const char *tenant;       /* the tenant's name; NULL: VRAMD_TENANT, else "pid-<pid>" */
    const char *tenant_class; /* its class; NULL: VRAMD_CLASS, else the daemon's default class */
    uint64_t guarantee;       /* bytes; 0: VRAMD_GUARANTEE, else none */
    uint64_t limit;           /* bytes; 0: VRAMD_LIMIT, else its class's */
    uint32_t gpu;             /* the daemon's device by index, read with VRAM_OPTION_GPU */
    uint32_t reserved;        /* 0 */
} vram_options_t;

/* `gpu` is set; without it: VRAMD_GPU, else device 0. */
#define VRAM_OPTION_GPU 1u

/* vram_init's answer when the process is a tenant already. */
#define VRAM_ERR_CONNECTED (-2)

/* Sets the process's tenant up now, with `opts` (NULL: every option from the environment), so
 * that a program chooses its tenant in code rather than through variables. Call it before
 * anything that needs a tenant (an allocation, vram_stats_json, a shared buffer...): once the
 * process is a tenant (set up by its first allocation, vram_connect or an earlier vram_init) it
 * returns VRAM_ERR_CONNECTED and changes nothing. Under `vramd run` (VRAMD_JOIN set) the process
 * joins the tenant `vramd run` registered, whose name, class, guarantee and limit are `vramd
 * run`'s flags: setting one of them here is refused. A failed vram_init (-1) leaves the process
 * as it was; nothing is retried, and a later call that needs a tenant connects as first use does.
 * After vram_disconnect it may be called again (the same device: see vram_connect).
 * `opts` is NULL or points to `opts->size` readable bytes; its strings are NULL or
 * NUL-terminated, and read during the call only. 0; -1 with the reason in vram_last_error();
 * VRAM_ERR_CONNECTED, the tenant named in vram_last_error(). */
int vram_init(const vram_options_t *opts);

/* `device` for vram_alloc and vram_free: the GPU this process was admitted on, whatever its
 * ordinal here (for callers that do not know CUDA's numbering). */
#define VRAM_TENANT_DEVICE (-1)

/* A block of at least `size` bytes for use on `stream` (an opaque cudaStream_t; any value on the
 * host backend), or NULL. `device` is VRAM_TENANT_DEVICE, or the program's CUDA device ordinal
 * (as cudaGetDevice gives it, after CUDA_VISIBLE_DEVICES), which must be the GPU this process was
 * admitted on, compared by UUID; on the host backend the daemon's device index. */
void *vram_alloc(ssize_t size, int device, void *stream);

/* Frees a block from vram_alloc, last used on `stream`. `size` is the size asked for (unused:
 * the allocator knows). A bad pointer is reported through vram_last_error, never a crash. */
void vram_free(void *ptr, ssize_t size, int device, void *stream);

/* The calling thread's last error, or NULL. Valid until this thread's next call into libvram. */
const char *vram_last_error(void);

/* The version of this C ABI: raised whenever a function here changes its signature or meaning,
 * goes, or comes. A caller built for one version (the Python package checks) refuses another. */
uint32_t vram_abi_version(void);

/* The allocator's statistics as a JSON object ({"tenant", "gpu", "limit", "guarantee",
 * "backend": "cuda" or "host", "stats"}); free it with vram_string_free. NULL on error. */
char *vram_stats_json(void);

/* Gives every idle byte back to the daemon now; returns the bytes given back (0 in a process that
 * is no tenant, which this does not make one), or -1. Memory freed on a stream whose queued work
 * the GPU has not yet finished goes back once that work is done: the call waits for it, at most
 * 500 ms a stream, after giving back what was free at once. */
long long vram_trim(void);

void vram_string_free(char *s);

/* How many times the daemon has asked this process for memory back. A caching layer above
 * libvram (PyTorch's, in its pool mode) watches it, releases its idle segments, then calls
 * vram_trim. */
unsigned long long vram_reclaim_requests(void);

/* Waits, at most timeout_ms, until the count of vram_reclaim_requests differs from `seen`;
 * returns the count. Lets such a layer wait for a request without waking up to poll. */
unsigned long long vram_wait_reclaim(unsigned long long seen, unsigned int timeout_ms);

/* Pool mode (`vramd run --torch-mode pool` preloads libvram.so with VRAMD_TORCH_MODE=pool):
 * libvram.so also defines the CUDA runtime's
 *     cudaError_t cudaMalloc(void **ptr, size_t size);
 *     cudaError_t cudaFree(void *ptr);
 *     cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream);
 *     cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream);
 * so that PyTorch's own caching allocator, and any library allocating through the runtime, gets
 * its segments from vramd. Calls vramd does not serve here (cudaFree(NULL), memory it did not
 * hand out, another GPU than the tenant's, any call outside pool mode) go on to the runtime's own
 * functions, and from there to the driver's, which libvram.so interposes too (below): a block is
 * served once, by whichever entry point sees it first. A refused allocation returns
 * cudaErrorMemoryAllocation (2) with the reason in vram_last_error; cudaFree synchronises the
 * device first, as the runtime's does; cudaFreeAsync does not (the block stays with its stream
 * until the stream has passed the free).
 *
 * 1 if this process's cudaMalloc is libvram.so's and pool mode is on, else 0. */
int vram_interposing(void);

/* Driver-level interposition, whenever libvram.so is preloaded (`vramd run` does so in both torch
 * modes). libvram.so defines dlsym, so that a library that loads the driver itself and looks its
 * functions up by name (XLA, ctypes) gets libvram.so's, and cuGetProcAddress / _v2, through which
 * the CUDA runtime (however it was loaded or linked), PyTorch and NCCL find driver functions:
 * where the driver's answer is a function hooked here, the caller gets the hook. Other names
 * pass through unchanged, and libvram.so's own lookups get the driver's functions. The hooks,
 * with the driver's signatures (CUresult; CUDA_ERROR_OUT_OF_MEMORY = 2 when refused):
 *
 *   cuMemAlloc_v2, cuMemAllocPitch_v2 (rows rounded up to 512 bytes), cuMemFree_v2,
 *   cuMemAllocAsync, cuMemFreeAsync, cuMemAllocFromPoolAsync (and their _ptsz forms): served
 *   by the tenant's caching allocator, stream-ordered where the call is. cuMemFree_v2
 *   synchronises the context first; memory vramd did not hand out goes to the driver.
 *   cuMemPoolCreate, cuMemPoolDestroy, cuMemPoolTrimTo: the driver's, the pool's place kept.
 *   cuMemGetDefaultMemPool, cuMemGetMemPool: the driver's; a pool of the host or of managed
 *   memory they hand out is placed as a made one. cuDeviceSetMemPool, cuMemSetMemPool: the
 *   driver's; cuMemAllocAsync on the tenant's GPU takes from the current pool as
 *   cuMemAllocFromPoolAsync would.
 *   An allocation from a pool on the host, on another GPU, of managed memory, whose allocations
 *   may be exported, or from a pool of the tenant's GPU on another GPU's stream is the driver's;
 *   a pool that may hold the tenant's GPU memory is charged, as below, by what it reserves
 *   (read after each allocation, free and trim; taken back at its destroy). Other pools'
 *   settings (release threshold, maximum size) do not apply to vramd's memory.
 *   cuMemCreate, cuMemAllocManaged: the driver makes the memory; its size is then charged to the
 *   tenant against its limit (on the tenant's GPU; cuMemCreate elsewhere is not charged), and
 *   taken back when the driver frees it: for cuMemCreate, once every reference to the handle is
 *   released and every mapping gone (cuMemRelease, cuMemRetainAllocationHandle, cuMemMap and
 *   cuMemUnmap are hooked to count them); managed memory at its cuMemFree_v2. A refused charge
 *   frees the memory at once and fails the call. Managed memory is charged in full when made,
 *   wherever the driver keeps it until touched.
 *   cuMemGetInfo_v2, and NVML's nvmlDeviceGetMemoryInfo / _v2 for the tenant's GPU: the
 *   tenant's view, total = its limit, free = what it could still get, used = total - free (NVML
 *   _v2: reserved = 0). Both give the same figures.
 *
 * Allocations on another GPU than the tenant's go to the driver (logged once). When no tenant can
 * be set up (no daemon), the allocation calls are refused with the reason in vram_last_error and
 * on stderr once: such memory never escapes vramd's books silently. Refusals libvram.so makes itself
 * are reported to the daemon (`vramd status` refusals). */

/* Allocations and frees vramd's allocator served through the interposed runtime and driver entry
 * points in this process (0 where libvram.so was not preloaded). */
unsigned long long vram_interposed_calls(void);

/* What each interposed entry point did, as JSON; free it with vram_string_free. NULL on error.
 *   {"preloaded": bool, "allocator_calls": N, "dlsym_answered": N,
 *    "proc_address_replaced": {"by_pointer": N, "by_name": N},
 *    "hooks": {"cuMemAlloc_v2": {"served": N, "passed": N, "refused": N}, ...}}
 * "served": by vramd (allocated, freed, charged, uncharged, answered with the tenant's view);
 * "passed": to the function underneath, unchanged; "refused": failed by vramd. Besides the
 * entry points' names: "cuMemFree_v2_managed" (frees of charged managed memory) and
 * "cuMemAllocFromPoolAsync_driver_pool" (allocations from pools whose memory is the driver's:
 * "served" when the pool is charged, "passed" when not). */
char *vram_interposer_stats_json(void);

/* For a caching layer above libvram (PyTorch's, in pool mode): how many of the bytes it holds
 * from libvram are in use by the application. `vramd status` then shows that as the tenant's
 * "in use" and the rest of what it holds as cached (by default both come from libvram's own
 * books, where a cached segment of the layer above counts as in use). */
void vram_report_in_use(unsigned long long bytes);

/* CUDA-graph capture notices. A free on a stream being captured must stay with that stream for
 * good (the graph's replays use the memory), so by default libvram asks the driver
 * (cuStreamIsCapturing) on every allocation and free that reaches its shared books. A framework
 * that announces every capture it makes can spare those calls: after vram_announce_captures(),
 * the driver is asked only between a vram_capture_begin (called before the stream enters capture
 * mode) and the matching vram_capture_end. Only for programs whose every capture is announced:
 * PyTorch's full mode wires them to its allocator's beginAllocateToPool / endAllocateToPool
 * hooks, which every torch.cuda.graph capture calls (PyTorch's own caching allocator relies on the
 * same hooks). While an announced capture is underway, libvram queries and records no event on
 * any stream (a query from any thread would invalidate a capture in the default global mode).
 * The calls may come before the first allocation. vram_announce_captures returns 0. */
int vram_announce_captures(void);
void vram_capture_begin(int device);
void vram_capture_end(int device);

/* Private pools, for CUDA graphs: a graph's replays write the memory its capture allocated at
 * the addresses it had then, even after the program freed it, so that memory must stay the
 * graph's. A pool is named by two numbers (PyTorch's MempoolId_t) and counts its uses:
 * vram_pool_begin starts one (before a capture into the pool; the pool is made if not in use),
 * vram_pool_release ends one (when a graph captured into it is released). vram_pool_alloc
 * allocates as vram_alloc does, from the pool: the block goes back to the pool when it is freed
 * (with vram_free, during the capture or after it), and only allocations into the same pool
 * reuse it; the daemon's reclaim requests do not take it. A pool takes fresh memory, or memory
 * whose earlier work has completed. After a pool's last use ends, its memory becomes everyone's
 * once libvram has waited for the device to finish the work queued so far (a replay may still
 * run): at that release, unless an announced capture is underway (see below; a device
 * synchronisation would invalidate it), else at a later release. Without announced captures a
 * released pool's memory stays the pool's until the process ends. Blocks of a pool still live at
 * its last release are freed as any block. vram_pool_alloc of a pool not in use fails (NULL,
 * vram_last_error says why). vram_pool_begin and vram_pool_release return 0, or -1 on error. */
int vram_pool_begin(int device, unsigned long long pool_a, unsigned long long pool_b);
void *vram_pool_alloc(ssize_t size, int device, void *stream, unsigned long long pool_a,
                      unsigned long long pool_b);
int vram_pool_release(int device, unsigned long long pool_a, unsigned long long pool_b);

/* Starts the peak statistics over from their current values. 0, or -1 on error. */
int vram_reset_peak(void);

/* The allocator's memory as JSON, for snapshots; free it with vram_string_free. NULL on error.
 *   {"gpu": N, "segments": [{"address", "size", "small": bool,
 *     "blocks": [{"address", "size", "requested_size",
 *                 "state": "allocated" | "pending_free" | "free"}]}]}
 * A segment is a contiguous mapped range; its blocks tile it in address order. */
char *vram_snapshot_json(void);

/* Shared buffers: one writer at a time under a lease, readers pinning published versions.
 *
 * A writer takes the lease (renewed in the background while the handle is open; a writer that
 * dies or hangs loses it after ttl_ms), begins a write (fresh memory for the next version, mapped
 * read-write), fills it and publishes it; the daemon records its checksum. A reader pins the
 * current version (mapped read-only: a stray write faults) and keeps it until it releases it,
 * however many versions are published meanwhile. Pointers are host pointers on the host backend.
 * Functions returning int give -1 on error, pointers NULL; the reason is in vram_last_error()
 * (a writer conflict names the lease holder and the current version). Versions start at 1; 0
 * means "none". One handle must not be used from two threads at once. A child forked from the
 * process gets an error from every handle it inherited (they speak on its parent's connection),
 * and vram_shared_close of one there frees only the child's copy. */
typedef struct VramShared vram_shared_t;

/* Creates a buffer owned by this process, each version `size` bytes (rounded up to the device
 * granularity). `readers` and `writers` are NULL or comma-separated lists of "tenant:NAME",
 * "class:NAME" or "*"; the owner may always read and write. */
vram_shared_t *vram_shared_create(const char *name, uint64_t size, const char *readers,
                                  const char *writers);
/* Opens a buffer this process may read or write. */
vram_shared_t *vram_shared_open(const char *name);
/* Releases the pins, the draft and the lease taken through `h`, and frees it. */
void vram_shared_close(vram_shared_t *h);

/* Takes the writer lease (or keeps it, if held). */
int vram_shared_lease(vram_shared_t *h, uint32_t ttl_ms);
/* Gives the lease up; an unpublished draft is discarded. */
int vram_shared_release_lease(vram_shared_t *h);
/* Fresh memory for the next version, written from version `base` (0 before the first publish;
 * a base that is no longer current is a conflict). Stores the new version in *version. */
void *vram_shared_begin_write(vram_shared_t *h, uint64_t base, uint64_t *version);
/* Publishes the draft; stores the daemon's checksum (vram_core::shared::checksum) in *checksum if not NULL. */
int vram_shared_publish(vram_shared_t *h, uint64_t *checksum);

/* Pins the current version; stores its number, checksum and size where not NULL. */
const void *vram_shared_pin(vram_shared_t *h, uint64_t *version, uint64_t *checksum,
                            uint64_t *size);
/* Releases a pin by the pointer vram_shared_pin returned. */
int vram_shared_release(vram_shared_t *h, const void *ptr);
/* The daemon re-reads `version`: 1 if it matches its checksum at publish, 0 if not, -1 on error. */
int vram_shared_verify(vram_shared_t *h, uint64_t version);
/* Waits up to timeout_ms for a version newer than `than` (0: any): 1 and *version set, 0 on
 * time-out, -1 on error. */
int vram_shared_wait(vram_shared_t *h, uint64_t than, uint32_t timeout_ms, uint64_t *version);

/* Tenants one after another. A process is one tenant at a time; the first is set up on first use
 * (above) or here. vram_connect makes this process a tenant now, as the daemon at `socket` admits
 * it. With every argument NULL (and `gpu` -1) it is first use's tenant (under `vramd run`, the
 * run's); with any argument given, a tenant of its own, each argument NULL (or `gpu` -1) taking
 * what first use would (VRAMD_SOCKET, VRAMD_TENANT, VRAMD_CLASS, VRAMD_GUARANTEE, VRAMD_LIMIT,
 * VRAMD_GPU, then the defaults); sizes like "20GiB". It fails while the process is a tenant already. vram_disconnect ends the tenant: every
 * idle byte goes back, the daemon hears Bye and closes the registration (the call returns once
 * the daemon has released what the tenant held, or after 5 s if it does not answer), and the
 * process is no tenant until vram_connect or the next call that needs one (which connects as at first use).
 * It refuses while memory from the tenant is in use (allocated and not freed, charged) or a
 * vram_shared_t is open, naming what is left; shared buffers the tenant owns end with it, as at
 * its exit, and so does the charge of cuMemCreate memory it exported and let go (no reference
 * or mapping left in this process), which only an importer may still hold. Ending nothing (no tenant) succeeds. Every tenant of
 * one process is on the same device (the allocator's memory is mapped from it): a tenant admitted
 * on another is refused. No other thread may allocate while vram_disconnect runs; calls that need
 * a tenant afterwards connect anew. 0, or -1 with the reason in vram_last_error(). */
int vram_connect(const char *socket, const char *name, const char *tenant_class,
                 const char *guarantee, const char *limit, int gpu);
int vram_disconnect(void);

/* The daemon's status (at `socket`, NULL: VRAMD_SOCKET or the default), as `vramd status --json`
 * prints it: devices, tenants, shared buffers. Asked as a tool asks (no tenant is set up). Free it
 * with vram_string_free; NULL with the reason in vram_last_error(). */
char *vram_status_json(const char *socket);

/* The tenant's view of its memory, as cuMemGetInfo_v2 and NVML's memory info answer it inside a
 * tenant: *total is its limit, *free what it could still get now (its limit less what it holds,
 * charged and uses outside vramd, within what the device has free for it). 0, or -1 with the
 * reason in vram_last_error(). */
int vram_mem_get_info(uint64_t *free, uint64_t *total);

#ifdef __cplusplus
}
#endif

#endif
