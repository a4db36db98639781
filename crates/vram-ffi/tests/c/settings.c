/* Allocator settings from VRAMD_ALLOC: a bad one is a clear error, not a crash. */
#include <stdio.h>

#include "vram.h"

int main(void) {
    void *p = vram_alloc(4096, 0, NULL);
    if (p != NULL) {
        vram_free(p, 4096, 0, NULL);
        printf("allocated\n");
        return 0;
    }
    printf("refused: %s\n", vram_last_error());
    return 0;
}
