/* Pool mode's cudaMallocAsync serves the stream's device: a stream on another GPU than the
 * tenant's gets the runtime's own memory, whichever device is current. The runtime is the
 * stand-in (fake_cudart.c: stream 0x1234 on device 1, the rest on device 0), loaded with
 * RTLD_LOCAL. Run with VRAMD_TORCH_MODE=pool against a host-backend daemon (device 0). */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "vram.h"
#include "check.h"

int cudaMallocAsync(void **ptr, size_t size, void *stream);
int cudaFreeAsync(void *ptr, void *stream);

int main(void) {
    void *runtime = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
    CHECK(runtime != NULL);
    int (*calls)(void) = (int (*)(void))dlsym(runtime, "fake_cudart_calls");
    CHECK(calls != NULL);
    void *other = (void *)0x1234, *ours = (void *)0x5678;
    size_t len = (size_t)1 << 20;
    /* On device 1: the runtime's. */
    void *a = NULL;
    CHECK(cudaMallocAsync(&a, len, other) == 0 && a != NULL);
    CHECK(calls() == 1);
    memset(a, 0x11, len);
    CHECK(cudaFreeAsync(a, other) == 0);
    CHECK(calls() == 2);
    /* On device 0, the tenant's: vramd's. */
    void *b = NULL;
    CHECK(cudaMallocAsync(&b, len, ours) == 0 && b != NULL);
    CHECK(calls() == 2);
    CHECK(cudaFreeAsync(b, ours) == 0);
    CHECK(calls() == 2);
    CHECK(vram_interposed_calls() == 2);
    printf("stream_device: ok\n");
    return 0;
}
