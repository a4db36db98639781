/* A stand-in for the CUDA runtime, built by tests/c_abi.rs as libcudart.so.13 for
 * local_runtime.c and stream_device.c, and by tests/driver_abi.rs for driver.c: its allocation
 * calls count themselves, so that a test can tell that a call passed through libvram.so reached
 * this library. They hand out host memory, except that the stream-ordered ones go on to the
 * driver's cuMemAllocAsync and cuMemFreeAsync where a driver library is loaded (looked up in it
 * by name, so that libvram.so's lookup hooks answer), as the real runtime's do. */
#include <dlfcn.h>
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

/* The loaded driver library's `name`, or NULL where none is loaded. */
static void *driver_fn(const char *name) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda == NULL)
        return NULL;
    void *f = dlsym(cuda, name);
    dlclose(cuda);
    return f;
}

int cudaMallocAsync(void **ptr, size_t size, void *stream) {
    int (*alloc)(unsigned long long *, size_t, void *) =
        (int (*)(unsigned long long *, size_t, void *))driver_fn("cuMemAllocAsync");
    if (alloc == NULL)
        return cudaMalloc(ptr, size);
    __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST);
    unsigned long long p = 0;
    int r = alloc(&p, size, stream);
    *ptr = (void *)p;
    return r;
}

int cudaFreeAsync(void *ptr, void *stream) {
    int (*free_async)(unsigned long long, void *) =
        (int (*)(unsigned long long, void *))driver_fn("cuMemFreeAsync");
    if (free_async == NULL)
        return cudaFree(ptr);
    __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST);
    return free_async((unsigned long long)ptr, stream);
}
