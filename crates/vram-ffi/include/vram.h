/* libvram.so: vramd's caching allocator for tenant processes.
 *
 * The two allocation functions have PyTorch's CUDAPluggableAllocator signatures:
 *   torch.cuda.memory.CUDAPluggableAllocator("libvram.so", "vram_alloc", "vram_free")
 * On first use the library connects to the daemon named by VRAMD_SOCKET (default
 * /run/vramd/vramd.sock) as tenant VRAMD_TENANT (default "pid-<pid>"), asking for VRAMD_LIMIT,
 * VRAMD_GUARANTEE and class VRAMD_PRIORITY where set (sizes like "20GiB").
 *
 * No function aborts the process or lets a panic cross this boundary. A refused allocation returns
 * NULL and leaves the reason, with the numbers in it, in vram_last_error().
 */
#ifndef VRAM_H
#define VRAM_H

#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A block of at least `size` bytes for use on `stream` (an opaque cudaStream_t; any value on the
 * host backend), or NULL. `device` must be the daemon device this process was admitted on. */
void *vram_alloc(ssize_t size, int device, void *stream);

/* Frees a block from vram_alloc, last used on `stream`. `size` is the size asked for (unused:
 * the allocator knows). A bad pointer is reported through vram_last_error, never a crash. */
void vram_free(void *ptr, ssize_t size, int device, void *stream);

/* The calling thread's last error, or NULL. Valid until this thread's next call into libvram. */
const char *vram_last_error(void);

/* The allocator's statistics as a JSON object; free it with vram_string_free. NULL on error. */
char *vram_stats_json(void);

/* Gives every idle byte back to the daemon now; returns the bytes given back, or -1. */
long long vram_trim(void);

void vram_string_free(char *s);

#ifdef __cplusplus
}
#endif

#endif
