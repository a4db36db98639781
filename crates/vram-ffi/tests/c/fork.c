/* A preloaded tenant forks; the child makes driver calls while the parent allocates. The child's
 * copy of the parent's connection must stay unused: the parent's calls must all succeed and the
 * child must end by itself. Prints "fork: ok" and exits 0 when both hold. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "vram.h"

typedef unsigned long long CUdeviceptr;
typedef int (*alloc_fn)(CUdeviceptr *, size_t);
typedef int (*free_fn)(CUdeviceptr);
typedef int (*info_fn)(size_t *, size_t *);

static const char *err(void) { return vram_last_error() ? vram_last_error() : "-"; }

int main(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) { printf("fork: no libcuda.so.1: %s\n", dlerror()); return 1; }
    alloc_fn alloc = (alloc_fn)dlsym(cuda, "cuMemAlloc_v2");
    free_fn mfree = (free_fn)dlsym(cuda, "cuMemFree_v2");
    info_fn info = (info_fn)dlsym(cuda, "cuMemGetInfo_v2");
    CUdeviceptr p = 0;
    if (alloc(&p, 1 << 20) != 0) { printf("fork: first alloc failed: %s\n", err()); return 1; }
    /* A shared buffer with a version pinned: the child's copy of its handle must not be used. */
    vram_shared_t *h = vram_shared_create("forked", 2 << 20, NULL, NULL);
    uint64_t v = 0, sum = 0, size = 0;
    if (!h || vram_shared_lease(h, 10000) != 0 || !vram_shared_begin_write(h, 0, &v) ||
        vram_shared_publish(h, &sum) != 0 || !vram_shared_pin(h, &v, &sum, &size)) {
        printf("fork: shared buffer setup failed: %s\n", err());
        return 1;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    pid_t c = fork();
    if (c == 0) {
        alarm(10);
        size_t f = 0, t = 0;
        CUdeviceptr q = 0;
        for (int i = 0; i < 100; i++) info(&f, &t);
        int r = alloc(&q, 4 << 20);
        printf("child: alloc %d (%s)\n", r, r ? err() : "served");
        const void *pin = vram_shared_pin(h, &v, &sum, &size);
        printf("child: pin %s (%s)\n", pin ? "served" : "refused", pin ? "-" : err());
        vram_shared_close(h);
        exit(r == 0 || pin ? 3 : 0);
    }
    alarm(20);
    int bad = 0;
    for (int i = 0; i < 500; i++) {
        CUdeviceptr q = 0;
        size_t f = 0, t = 0;
        int r1 = alloc(&q, (size_t)(1 + i % 7) << 22);
        int r2 = r1 == 0 ? mfree(q) : -1;
        int r3 = info(&f, &t);
        if ((r1 || r2 || r3 || t != (size_t)256 << 20) && bad++ < 3)
            printf("parent: iteration %d: alloc %d free %d info %d total %zu (%s)\n", i, r1, r2, r3,
                   t, err());
    }
    int st = 0;
    waitpid(c, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("fork: the child ended with status %d\n", st);
        return 1;
    }
    if (bad) { printf("fork: %d of 500 parent iterations failed\n", bad); return 1; }
    if (mfree(p) != 0) { printf("fork: free failed: %s\n", err()); return 1; }
    /* The parent's handle, its pin and its lease are as they were. */
    const void *again = vram_shared_pin(h, &v, &sum, &size);
    if (!again || vram_shared_begin_write(h, v, &v) == NULL) {
        printf("fork: the parent's shared buffer after the child: %s\n", err());
        return 1;
    }
    vram_shared_close(h);
    printf("fork: ok\n");
    return 0;
}
