/* A stand-in for the CUDA runtime, built by tests/c_abi.rs as libcudart.so.13 for
 * local_runtime.c and stream_device.c: its allocation calls hand out host memory and count
 * themselves, so that a test can tell that a call passed through libvram.so reached this
 * library. */
#include <stdlib.h>

static int calls;

int fake_cudart_calls(void) { return __atomic_load_n(&calls, __ATOMIC_SEQ_CST); }

int cudaMalloc(void **ptr, size_t size) {
    __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST);
    *ptr = malloc(size);
    return *ptr == NULL ? 2 : 0;
}

int cudaFree(void *ptr) {
    __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST);
    free(ptr);
    return 0;
}

int cudaGetDevice(int *device) {
    *device = 0;
    return 0;
}

/* Streams: (void *)0x1234 is on device 1, every other on device 0. */
int cudaStreamGetDevice(void *stream, int *device) {
    *device = stream == (void *)0x1234 ? 1 : 0;
    return 0;
}

int cudaMallocAsync(void **ptr, size_t size, void *stream) {
    (void)stream;
    return cudaMalloc(ptr, size);
}

int cudaFreeAsync(void *ptr, void *stream) {
    (void)stream;
    return cudaFree(ptr);
}
