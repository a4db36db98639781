/* A program whose CUDA runtime is a library's dependency loaded with RTLD_LOCAL (the way Python
 * loads an extension module and the runtime it links), with libvram.so linked (as if preloaded).
 * The library's cudaMalloc and cudaFree bind to libvram.so's, which pass them on (outside pool
 * mode) to the runtime's own: found although RTLD_NEXT does not reach it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#define CHECK(cond)                                                          \
    do {                                                                     \
        if (!(cond)) {                                                       \
            printf("FAILED line %d: %s\n", __LINE__, #cond);                 \
            return 1;                                                        \
        }                                                                    \
    } while (0)

int main(int argc, char **argv) {
    /* The runtime's file name: as the CUDA toolkit names it, or renamed as wheels bundle it. */
    const char *name = argc > 1 ? argv[1] : "libcudart.so.13";
    void *user = dlopen("libruntime_user.so", RTLD_NOW | RTLD_LOCAL);
    CHECK(user != NULL);
    /* The runtime is loaded, and only locally. */
    CHECK(dlsym(RTLD_DEFAULT, "fake_cudart_calls") == NULL);
    void *runtime = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    CHECK(runtime != NULL);
    int (*calls)(void) = (int (*)(void))dlsym(runtime, "fake_cudart_calls");
    int (*user_malloc)(void **, size_t) = (int (*)(void **, size_t))dlsym(user, "user_malloc");
    int (*user_free)(void *) = (int (*)(void *))dlsym(user, "user_free");
    CHECK(calls != NULL && user_malloc != NULL && user_free != NULL);
    /* The library's calls go through libvram.so's functions... */
    void *linked = dlsym(RTLD_DEFAULT, "cudaMalloc");
    Dl_info where;
    CHECK(linked != NULL && dladdr(linked, &where) != 0);
    CHECK(strstr(where.dli_fname, "libvram.so") != NULL);
    /* ...and reach the runtime's own. */
    void *p = NULL;
    int r = user_malloc(&p, 4096);
    printf("cudaMalloc: %d\n", r);
    CHECK(r == 0 && p != NULL);
    memset(p, 0x5a, 4096);
    CHECK(user_free(p) == 0);
    CHECK(calls() == 2);
    printf("local_runtime: ok\n");
    return 0;
}
