/* A stand-in for the CUDA runtime, built by tests/c_abi.rs as libcudart.so.13 for
 * local_runtime.c: its allocation calls hand out host memory and count themselves, so that a
 * test can tell that a call passed through libvram.so reached this library. */
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
