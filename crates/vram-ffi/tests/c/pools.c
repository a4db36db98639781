/* Private pools through the C ABI, as PyTorch's full mode uses them for CUDA graphs: a pool's
 * blocks go back to the pool, not to the program's other allocations, until its last use ends;
 * then they are everyone's and a trim gives them back. Captures are announced, none underway at
 * the releases, so a release settles the pool at once. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vram.h"
#include "check.h"

#define SIZES 3

/* The bytes the allocator holds ("held" of its core statistics); -1 if unreadable. */
static long long held(void) {
    char *json = vram_stats_json();
    if (json == NULL) {
        return -1;
    }
    const char *at = strstr(json, "\"held\":");
    long long n = at ? strtoll(at + strlen("\"held\":"), NULL, 10) : -1;
    vram_string_free(json);
    return n;
}

int main(void) {
    static const long sizes[SIZES] = {4096, 65536, 4L << 20};
    void *stream = (void *)0x10;
    CHECK(vram_announce_captures() == 0);
    CHECK(vram_pool_alloc(4096, 0, stream, 0, 9) == NULL);
    CHECK(strstr(vram_last_error(), "no private pool") != NULL);
    printf("unknown pool refused: %s\n", vram_last_error());
    for (int i = 0; i < SIZES; i++) {
        long size = sizes[i];
        CHECK(vram_pool_begin(0, 0, 1) == 0);
        vram_capture_begin(0);
        void *p = vram_pool_alloc(size, 0, stream, 0, 1);
        CHECK(p != NULL);
        vram_free(p, size, 0, stream);
        vram_capture_end(0);
        /* Eager work on the capture's stream after the capture does not get the graph's block. */
        for (int k = 0; k < 3; k++) {
            void *q = vram_alloc(size, 0, stream);
            CHECK(q != NULL && q != p);
            vram_free(q, size, 0, stream);
        }
        /* A later capture into the same pool does. */
        CHECK(vram_pool_begin(0, 0, 1) == 0);
        vram_capture_begin(0);
        void *again = vram_pool_alloc(size, 0, stream, 0, 1);
        CHECK(again == p);
        vram_capture_end(0);
        vram_free(again, size, 0, stream);
        /* One graph still uses the pool: nothing else gets its block, a trim leaves it. */
        CHECK(vram_pool_release(0, 0, 1) == 0);
        void *still = vram_alloc(size, 0, stream);
        CHECK(still != p);
        vram_free(still, size, 0, stream);
        CHECK(vram_trim() >= 0);
        CHECK(held() > 0);
        /* The last release: the block is everyone's, and a trim gives everything back. */
        CHECK(vram_pool_release(0, 0, 1) == 0);
        CHECK(vram_pool_alloc(size, 0, stream, 0, 1) == NULL);
        CHECK(vram_trim() >= 0);
        CHECK(held() == 0);
        printf("size %ld: kept for the pool, then everyone's\n", size);
    }
    /* Releasing a pool not in use is nothing. */
    CHECK(vram_pool_release(0, 5, 5) == 0);
    printf("pools: ok\n");
    return 0;
}
