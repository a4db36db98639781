/* Allocator settings from VRAMD_ALLOC: a bad one is a clear error, not a crash. Capture notices
 * may come before the first allocation. */
#include <stdio.h>

#include "vram.h"

int main(void) {
    if (vram_announce_captures() != 0) {
        printf("announcing captures failed\n");
        return 1;
    }
    vram_capture_begin(0);
    vram_capture_end(0);
    void *p = vram_alloc(4096, 0, NULL);
    if (p != NULL) {
        vram_free(p, 4096, 0, NULL);
        printf("allocated\n");
        return 0;
    }
    printf("refused: %s\n", vram_last_error());
    return 0;
}
