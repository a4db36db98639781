/* Pool mode's segment source: a program calling the CUDA runtime's cudaMalloc / cudaFree gets
 * libvram.so's (here linked directly; `vramd run --torch-mode pool` preloads the library). Run with
 * VRAMD_TORCH_MODE=pool and VRAMD_LIMIT=256MiB against a host-backend daemon. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vram.h"
#include "check.h"

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);


int main(void) {
    CHECK(vram_interposing() == 1);
    size_t len = (size_t)64 << 20;
    void *a = NULL, *b = NULL;
    CHECK(cudaMalloc(&a, len) == 0 && a != NULL);
    CHECK(cudaMalloc(&b, len) == 0 && b != NULL && b != a);
    memset(a, 0xab, len);
    memset(b, 0xcd, len);
    for (size_t i = 0; i < len; i += 4093) {
        CHECK(((unsigned char *)a)[i] == 0xab && ((unsigned char *)b)[i] == 0xcd);
    }
    /* Over the tenant's limit: refused with cudaErrorMemoryAllocation and the reason. */
    void *big = NULL;
    CHECK(cudaMalloc(&big, (size_t)512 << 20) == 2 && big == NULL);
    CHECK(strstr(vram_last_error(), "limit") != NULL);
    printf("refused as expected: %s\n", vram_last_error());
    CHECK(cudaFree(a) == 0);
    CHECK(cudaFree(a) == 1); /* a second free is refused, not passed on */
    CHECK(cudaFree(b) == 0);
    CHECK(cudaMalloc(NULL, 16) == 1);
    /* Memory freed through cudaFree is vramd's again: it goes back to the daemon on a trim. */
    CHECK(vram_trim() >= (long long)len);
    printf("served %llu runtime calls\n", vram_interposed_calls());
    CHECK(vram_interposed_calls() == 4);
    /* A caching layer above says what of its segments is in use; `vramd status` shows it. */
    void *c = NULL;
    CHECK(cudaMalloc(&c, len) == 0);
    vram_report_in_use((unsigned long long)16 << 20);
    printf("interpose: ok\n");
    fflush(stdout);
    char line[16];
    /* The test reads the daemon's status meanwhile, then writes a line or closes stdin (either
     * ends the wait; a cast to void does not silence gcc's unused-result warning everywhere). */
    if (fgets(line, sizeof line, stdin) == NULL)
        line[0] = '\0';
    CHECK(cudaFree(c) == 0);
    return 0;
}
